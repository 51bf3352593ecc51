// fp8.cuh: the float8 e4m3 (e4m3fn: no infinities, max 448) storage type of quantised KV caches
// and of the FP8 Hopper forward's q, k, v; its conversion to the fp16 operands of mma.sync,
// the quantiser of the cache writes, and the packing of fp32 probabilities into e4m3 operands.
//
// A cache element is one byte; its real value is stored x scale (a descale factor per tensor or
// per kv head, applied by the kernels outside the GEMMs). Decode reads four bytes of a row at a
// time and widens them to two packed fp16 registers (mma operands), so the cache is never
// expanded in memory. Every e4m3 value, subnormals included, is exact in fp16.
#pragma once

#include "common.cuh"

namespace cuattn {

// One e4m3 byte. A struct of its own (not unsigned char) so that kernels are instantiated on it
// by name (`decode_kernel<__nv_bfloat16, cuattn::e4m3, ...>`) and no byte array is mistaken for it.
struct e4m3 {
  unsigned char bits;
};

// Whether an element type is e4m3 (the kernels templated on it take the FP8 paths).
template <typename T>
constexpr bool kIsE4m3 = false;
template <>
constexpr bool kIsE4m3<e4m3> = true;

constexpr float kE4m3Max = 448.f;  // the largest finite e4m3 value: writes saturate to +-448
// e4m3: 4 exponent bits (bias 7), 3 mantissa bits
constexpr int kE4m3MantissaBits = 3;
constexpr int kE4m3Bias = 7;
constexpr int kF32MantissaBits = 23;
constexpr int kF32Bias = 127;

// Two e4m3 values, bytes 0 and 2 of `w` (bytes 1 and 3 are ignored), as a packed fp16 pair (byte
// 0 in the low half), without the hardware conversion of sm_89: each byte's exponent and mantissa
// go to the bottom of fp16's exponent and mantissa fields, which divides the value by 2^(15 - 7)
// (the two exponent biases; subnormals land on subnormals, so it holds for them too), and one
// packed multiply by 256 restores it exactly. An e4m3 NaN (S.1111.111) reads as +-480 here.
constexpr u32 kE4m3PairSigns = 0x00800080u;      // the sign bits of bytes 0 and 2
constexpr u32 kE4m3PairMagnitudes = 0x007f007fu;  // exponent and mantissa bits of bytes 0 and 2
constexpr int kHalfSignShift = 8;                 // bit 7 of a byte to bit 15 of its half
constexpr int kHalfMantissaBits = 10;
constexpr float kHalfRestore = 256.f;             // 2^(15 - 7)

__device__ __forceinline__ u32 e4m3x2_to_half2_bits(u32 w) {
  const u32 bits = ((w & kE4m3PairSigns) << kHalfSignShift) |
                   ((w & kE4m3PairMagnitudes) << (kHalfMantissaBits - kE4m3MantissaBits));
  __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&bits), __floats2half2_rn(kHalfRestore, kHalfRestore));
  return *reinterpret_cast<u32*>(&h);
}

// Four e4m3 bytes of `w` as two packed fp16 pairs (an mma operand register each): bytes 0 and 1
// into `lo`, bytes 2 and 3 into `hi`, the lower byte in the low half. sm_89 and later convert a
// 16-bit half in one instruction that reads either half of the register in place, so four bytes
// cost two instructions and no byte permute; earlier GPUs first spread each pair to bytes 0 and 2
// for the bit path.
__device__ __forceinline__ void e4m3x4_to_half2x2(u32 w, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n"
      " cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  constexpr u32 kSpreadLow = 0x4140u;   // bytes 0, 1 to bytes 0, 2 (zeros between)
  constexpr u32 kSpreadHigh = 0x4342u;  // bytes 2, 3 to bytes 0, 2
  lo = e4m3x2_to_half2_bits(__byte_perm(w, 0, kSpreadLow));
  hi = e4m3x2_to_half2_bits(__byte_perm(w, 0, kSpreadHigh));
#endif
}

// Byte permutes of four bytes w = (b0, b1, b2, b3): kPairEvenOdd makes (b0, b2, b1, b3), the
// even bytes in the low half and the odd ones in the high half.
constexpr u32 kPairEvenOdd = 0x3120u;

// A bf16 pair as an fp16 pair, for the fp16 GEMMs of an e4m3 cache under a bf16 query. Exact
// for every bf16 value in fp16's normal range (bf16's 8 significant bits fit in fp16's 11);
// finite values beyond +-65504 saturate there, NaN and inf pass through, and magnitudes below
// 2^-14 keep fp16's subnormal precision.
constexpr float kHalfMax = 65504.f;

__device__ __forceinline__ float saturate_to_half_range(float x) {
  return fabsf(x) > kHalfMax && !isinf(x) ? copysignf(kHalfMax, x) : x;
}

__device__ __forceinline__ u32 bf16x2_to_half2(u32 w) {
  constexpr u32 kHighHalf = 0xffff0000u;
  constexpr int kHalfBits = 16;
  const float low = saturate_to_half_range(__uint_as_float(w << kHalfBits));
  const float high = saturate_to_half_range(__uint_as_float(w & kHighHalf));
  __half2 h = __floats2half2_rn(low, high);
  return *reinterpret_cast<u32*>(&h);
}

// Round x to the nearest e4m3 value, ties to even, saturating at +-448 (and +-inf to +-448); NaN
// stays NaN. Done in integer arithmetic on the float's bits, the same on every architecture, so
// the tests check it on the device against NumPy's rounding.
__device__ __forceinline__ unsigned char float_to_e4m3(float x) {
  constexpr u32 kSign = 0x80u;
  constexpr u32 kNan = 0x7fu;
  constexpr u32 kMaxBits = 0x7eu;  // 448 = 1.75 x 2^8
  constexpr float kMinNormal = 0.015625f;  // 2^(1 - 7)
  constexpr float kSubnormalUnit = 512.f;  // 1 / 2^(1 - 7 - 3): subnormals step by 2^-9
  constexpr int kDrop = kF32MantissaBits - kE4m3MantissaBits;  // mantissa bits rounded away
  const u32 f = __float_as_uint(x);
  const u32 sign = (f >> 24) & kSign;
  const float a = fabsf(x);
  u32 magnitude;
  if (a != a) {
    magnitude = kNan;
  } else if (a >= kE4m3Max) {
    magnitude = kMaxBits;
  } else if (a < kMinNormal) {
    // subnormal (or zero): a multiple of 2^-9; rounding to 8 steps gives the smallest normal,
    // whose bits (exponent 1, mantissa 0) are 8 as well
    magnitude = static_cast<u32>(__float2int_rn(a * kSubnormalUnit));
  } else {
    // ties to even on the dropped mantissa bits; a carry moves into the exponent, as it should
    const u32 bits = __float_as_uint(a);
    const u32 rounded = bits + ((1u << (kDrop - 1)) - 1u) + ((bits >> kDrop) & 1u);
    magnitude = (rounded >> kDrop) - (static_cast<u32>(kF32Bias - kE4m3Bias) << kE4m3MantissaBits);
    // below 448 a value rounds to at most 448 (the next step, 480, is past the saturation test)
  }
  return static_cast<unsigned char>(sign | magnitude);
}

// Four floats as four e4m3 bytes of one register, `x0` in the lowest byte (the order of an 8-bit
// wgmma/mma operand register: element 4 i + j of a fragment sits in byte j of register i),
// rounded to nearest even and saturated to +-448. sm_89 and later convert two at a time in
// hardware (cvt ... e4m3x2 d, a, b puts a in the high byte of d, b in the low one).
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
#if __CUDA_ARCH__ >= 890
  u32 out;
  asm("{\n .reg .b16 lo, hi;\n"
      " cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      " cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      " mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(out)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return out;
#else
  return static_cast<u32>(float_to_e4m3(x0)) | (static_cast<u32>(float_to_e4m3(x1)) << 8) |
         (static_cast<u32>(float_to_e4m3(x2)) << 16) | (static_cast<u32>(float_to_e4m3(x3)) << 24);
#endif
}

}  // namespace cuattn
