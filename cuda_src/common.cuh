// common.cuh: device code every cuattn kernel shares.
//
//   * dtype traits: the storage type T (__half or __nv_bfloat16) and its packed pair T2;
//     conversions float <-> T and float2 -> packed 32-bit pair (the A operand of mma.sync).
//   * quad reductions: a row of an mma.sync accumulator is spread over the 4 lanes of a quad.
//   * SoftmaxState: the online-softmax statistics of one query row (running max m and running
//     sum l, both in the log2 domain), with `update` (a new block of scores arrives) and `merge`
//     (two states over disjoint key sets). Forward, decode, split-KV combine and merge_states all
//     use it, so the -inf conventions live in one place.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cuattn {

// NVRTC ships no <stdint.h>: the two fixed-width types the kernels need.
using u32 = unsigned int;
using i64 = long long;
static_assert(sizeof(u32) == 4 && sizeof(i64) == 8, "fixed-width types");

// std::conditional without <type_traits> (NVRTC ships none): A if C, else B.
template <bool C, typename A, typename B>
struct Conditional {
  using type = A;
};
template <typename A, typename B>
struct Conditional<false, A, B> {
  using type = B;
};

// std::is_same, for the same reason.
template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// +inf as a bit pattern: NVRTC has no constexpr infinity
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.4426950408889634f;  // 1 / ln 2: natural-log lse to the kernels' log2 domain
constexpr int kWarpSize = 32;
// mma.sync rows are spread over the four lanes of a quad that share lane / 4.
constexpr int kQuadSize = 4;

template <typename T>
struct DType;

template <>
struct DType<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
};

template <>
struct DType<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
};

// float partial results (split-KV, merge_states) go through the same conversions.
template <>
struct DType<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// x, through a move the compiler cannot see through: what is computed from the result stays
// where it is written (the compiler cannot hoist it out of a loop in which x is invariant).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// How far (in log2 units) a row max may grow before the forward rescales its running output:
// probabilities exp2(x - m) stay below 2^8 = 256, exact in fp32 and representable in fp16/bf16.
constexpr float kLazyRescaleLog2 = 8.f;

// Online-softmax statistics of one query row. Scores are kept in log2 units (the host folds
// scale * log2(e) into one multiplier), so every exponential is a single exp2f.
//
// A row that has not yet seen a visible key has m = -inf and l = 0. Its reference max for the
// exponentials is taken as 0 instead of -inf, so exp2f(score - ref) never evaluates
// (-inf) - (-inf) = NaN: masked scores are -inf and give exactly 0.
struct SoftmaxState {
  float m;  // running max of the scaled scores; -inf until a visible key is seen
  float l;  // running sum of exp2(score - m) over the keys seen so far

  __device__ __forceinline__ void init() {
    m = -infinity();
    l = 0.f;
  }

  // The max every exponential of the current block subtracts: never -inf (see above).
  __device__ __forceinline__ float reference() const { return m == -infinity() ? 0.f : m; }

  // A new block whose row max is `block_max` arrives: move the running max and return the
  // factor that rescales l and the output accumulator (the row max moved, so every earlier
  // exp2(score - m_old) must become exp2(score - m_new)).
  __device__ __forceinline__ float update(float block_max) {
    const float m_new = fmaxf(m, block_max);
    // exp2(-inf - m_new) = 0 when the row was empty; a row still empty keeps factor 1 (l = 0 anyway)
    const float factor = m_new == -infinity() ? 1.f : exp2f(m - m_new);
    m = m_new;
    l *= factor;
    return factor;
  }

  // Whether a block whose row max is `block_max` must move m: the row was empty and now sees a
  // key, or the max grew past the lazy-rescale slack (see kLazyRescaleLog2).
  __device__ __forceinline__ bool needs_rescale(float block_max) const {
    return m == -infinity() ? block_max > -infinity() : block_max > m + kLazyRescaleLog2;
  }

  // Merge a state over a disjoint key set. Returns through `scale_self` and `scale_other` the
  // factors each side's unnormalised accumulator must be multiplied by. Two empty states stay
  // empty with both factors 0: the reference max is 0, never -inf, so no NaN appears.
  __device__ __forceinline__ void merge(const SoftmaxState& other, float& scale_self, float& scale_other) {
    const float m_new = fmaxf(m, other.m);
    const float ref = m_new == -infinity() ? 0.f : m_new;
    scale_self = exp2f(m - ref);
    scale_other = exp2f(other.m - ref);
    l = l * scale_self + other.l * scale_other;
    m = m_new;
  }

  // Join an attention sink: one logit (log2 units) that adds to the denominator and carries no
  // value, i.e. a state {sink, 1} whose output is 0. Returns the factor the unnormalised output
  // must take. An empty row becomes {sink, 1}: output 0, lse = the sink.
  __device__ __forceinline__ float add_sink(float sink) {
    float scale_self, scale_sink;
    merge(SoftmaxState{sink, 1.f}, scale_self, scale_sink);
    return scale_self;
  }

  // 1 / l for normalising the output; an empty row (l = 0) gives an output of 0, not NaN.
  __device__ __forceinline__ float inv_sum() const { return l > 0.f ? 1.f / l : 0.f; }

  // Natural-log log-sum-exp of the row's scaled scores: (m + log2 l) * ln 2; -inf when empty.
  __device__ __forceinline__ float lse() const { return l > 0.f ? (m + __log2f(l)) * kLn2 : -infinity(); }
};

// n / d and n % d for a divisor known only at run time, without the ~20-instruction integer
// division: q = umulhi(n, mul) >> shift with the host's round-up multiplier (exact for
// 0 <= n < 2^31; cuattn.decode.fast_divisor computes mul and shift, d = 1 is passed as mul = 0).
struct FastDivisor {
  int divisor;
  u32 mul;
  int shift;

  __device__ __forceinline__ int div(int n) const {
    return mul == 0 ? n : static_cast<int>(__umulhi(static_cast<u32>(n), mul) >> shift);
  }
  __device__ __forceinline__ int mod(int n, int quotient) const { return n - quotient * divisor; }
};

// A page id read from a block table, clamped into the pool of num_blocks pages: ids outside it
// are refused on the host when checked, and an unchecked table still reads only the cache.
__device__ __forceinline__ int clamp_page(int page, int num_blocks) { return min(max(page, 0), num_blocks - 1); }

}  // namespace cuattn
