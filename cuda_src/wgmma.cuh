// wgmma.cuh: sm_90a warpgroup MMA (wgmma.mma_async) and the shared-memory tiles it reads.
//
// A warpgroup (4 consecutive warps, 128 threads) computes D[64 x N] (+)= A[64 x 16] B[16 x N]
// per instruction, asynchronously: issue several, commit them as a group, wait for the group.
// A comes from shared memory (a descriptor) or from registers; B always from shared memory.
//
// Shared tiles: SwizzledTile<ROWS, COLS> holds [ROWS][COLS] 16-bit elements as COLS / 64 panels
// of [ROWS][64] (128-byte rows); within a panel, 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) (the 128-byte swizzle: the 8 rows one access phase touches hit 8 different bank
// groups). The same bytes serve as a K-major operand (rows = M or N, columns = K) and as an
// MN-major one (rows = K, columns = M or N); only the descriptor differs:
//   K-major:  8-row groups 1024 B apart (SBO); a k16 step moves 32 B within the 128-byte row,
//             k = 64 starts the next panel.
//   MN-major: 64 M/N columns per panel, panels kPanelBytes apart (LBO); 8-row (k) groups 1024 B
//             apart (SBO); a k16 step moves 16 rows = 2048 B.
// Every tile starts on a 1024-byte boundary, so the swizzle pattern's phase is the row index.
//
// Register layouts (warp w of the warpgroup, g = lane / 4, t = lane % 4):
//   accumulator of m64nN: d[4 j + e], j < N / 8: row 16 w + g + 8 (e / 2), column 8 j + 2 t + e % 2
//   A from registers, one k16 step: a[0] (16 w + g, 2 t..), a[1] (16 w + g + 8, 2 t..),
//     a[2] (16 w + g, 2 t + 8..), a[3] (16 w + g + 8, 2 t + 8..): the mma.sync A fragment, so
//     accumulator columns 16 s .. 16 s + 15 pack straight into the A operand of k step s.
#pragma once

#include "fp8.cuh"
#include "mma.cuh"

namespace cuattn {

using u64 = unsigned long long;
static_assert(sizeof(u64) == 8, "64-bit descriptor");

constexpr int kWarpgroupThreads = 128;
constexpr int kWarpsPerWarpgroup = 4;
constexpr int kWgmmaM = 64;                // rows of one wgmma
constexpr int kWgmmaK = 16;                // k of one wgmma with 16-bit operands
constexpr int kWgmmaK8 = 32;               // k of one wgmma with 8-bit (e4m3) operands: the same 32 bytes
constexpr int kSwizzleRowBytes = 128;      // one swizzled row: 64 16-bit elements
constexpr int kSwizzlePanelCols = 64;
constexpr int kSwizzleAtomBytes = 1024;    // 8 rows of 128 B: the swizzle pattern's period
constexpr int kChunksPerSwizzleRow = kSwizzleRowBytes / kCopyBytes;

// The columns of the whole 64-column panels that hold `cols` columns (a tile of a head dim that is
// not a multiple of 64 pads its last panel; TMA fills the padding with zeros).
constexpr int panel_cols(int cols) { return (cols + kSwizzlePanelCols - 1) / kSwizzlePanelCols * kSwizzlePanelCols; }

template <int ROWS, int COLS>
struct SwizzledTile {
  static_assert(ROWS % 8 == 0 && COLS % kSwizzlePanelCols == 0, "whole swizzle atoms");
  static constexpr int kPanelBytes = ROWS * kSwizzleRowBytes;
  static constexpr int kBytes = ROWS * COLS * 2;

  // Byte offset of 16-byte chunk `chunk` (8 elements) of row `row`. Unsigned arithmetic: signed
  // `row % 8` cannot fold into an immediate, so offsets computed once per tile (the Hopper
  // forward's epilogue) would stay live in registers across the key loop and spill.
  static __device__ __forceinline__ int chunk_offset(int row, int chunk) {
    const unsigned r = static_cast<unsigned>(row), c = static_cast<unsigned>(chunk);
    return static_cast<int>((c / kChunksPerSwizzleRow) * kPanelBytes + r * kSwizzleRowBytes +
                            (((c % kChunksPerSwizzleRow) ^ (r % 8u)) * kCopyBytes));
  }
  // Byte offset of element (row, col).
  static __device__ __forceinline__ int offset(int row, int col) {
    return chunk_offset(row, col / 8) + (col % 8) * 2;
  }
};

// The descriptor of an operand at shared address `addr` (PTX ISA, "matrix descriptor"): address,
// LBO and SBO in 16-byte units, the layout in bits 62-63 (1 = 128-byte swizzle, 0 = none).
constexpr u64 kWgmmaSwizzle128 = 1;
constexpr u64 kWgmmaUnswizzled = 0;
__device__ __forceinline__ u64 wgmma_descriptor(u32 addr, u32 lbo_bytes, u32 sbo_bytes,
                                                u64 layout = kWgmmaSwizzle128) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<u64>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (layout << 62);
}

// An unswizzled K-major operand of 16-byte rows, row r at addr + 16 r, from row `row0`: its core
// matrices (8 rows of 16 bytes) lie 128 bytes apart along the rows, and the descriptor puts the
// next 8 k columns (LBO) 128 bytes on as well, the next 8 rows: a k16 step reads columns 8-15
// from there, which only an A whose columns 8-15 are zero can take (the forward's ALiBi keys).
__device__ __forceinline__ u64 rows16_descriptor(u32 addr, int row0) {
  constexpr u32 kCoreMatrixBytes = 8 * kCopyBytes;
  return wgmma_descriptor(addr + row0 * kCopyBytes, kCoreMatrixBytes, kCoreMatrixBytes, kWgmmaUnswizzled);
}

// K-major operand: rows [row0, row0 + 64 or N) of a SwizzledTile, k16 step `step` of its columns.
template <class Tile>
__device__ __forceinline__ u64 kmajor_descriptor(u32 tile, int row0, int step) {
  const int col = step * kWgmmaK;
  const u32 addr = tile + (col / kSwizzlePanelCols) * Tile::kPanelBytes + row0 * kSwizzleRowBytes +
                   (col % kSwizzlePanelCols) * 2;
  return wgmma_descriptor(addr, kCopyBytes, kSwizzleAtomBytes);
}

// MN-major operand: columns [col0, col0 + 64 or N) (col0 a multiple of 64), k16 step `step` of its rows.
template <class Tile>
__device__ __forceinline__ u64 mnmajor_descriptor(u32 tile, int col0, int step) {
  const u32 addr = tile + (col0 / kSwizzlePanelCols) * Tile::kPanelBytes + step * kWgmmaK * kSwizzleRowBytes;
  return wgmma_descriptor(addr, Tile::kPanelBytes, kSwizzleAtomBytes);
}

// The accumulators of an m64nN tile, N / 2 fp32 registers a thread, as the asm statements below
// name them: CUATTN_ACC<N/2>_LIST, the brace list "{%0, %1, ...}" of the instruction, and
// CUATTN_ACC<N/2>_OPERANDS(d), the "+f" operands d[0], d[1], ... bound to %0, %1, ... Each width
// extends the next narrower one by runs of eight registers.
#define CUATTN_REGS8(r0, r1, r2, r3, r4, r5, r6, r7) \
  "%" #r0 ", %" #r1 ", %" #r2 ", %" #r3 ", %" #r4 ", %" #r5 ", %" #r6 ", %" #r7
#define CUATTN_OPERANDS8(d, i)                                                                             \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])

// m64n8 (4), m64n16 (8), m64n32 (16), m64n64 (32), m64n80 (40), m64n96 (48), m64n128 (64),
// m64n160 (80), m64n192 (96), m64n256 (128)
#define CUATTN_ACC4_REGS "%0, %1, %2, %3"
#define CUATTN_ACC8_REGS CUATTN_REGS8(0, 1, 2, 3, 4, 5, 6, 7)
#define CUATTN_ACC16_REGS CUATTN_ACC8_REGS ", " CUATTN_REGS8(8, 9, 10, 11, 12, 13, 14, 15)
#define CUATTN_ACC32_REGS \
  CUATTN_ACC16_REGS ", " CUATTN_REGS8(16, 17, 18, 19, 20, 21, 22, 23) ", " CUATTN_REGS8(24, 25, 26, 27, 28, 29, 30, 31)
#define CUATTN_ACC40_REGS CUATTN_ACC32_REGS ", " CUATTN_REGS8(32, 33, 34, 35, 36, 37, 38, 39)
#define CUATTN_ACC48_REGS CUATTN_ACC40_REGS ", " CUATTN_REGS8(40, 41, 42, 43, 44, 45, 46, 47)
#define CUATTN_ACC64_REGS \
  CUATTN_ACC48_REGS ", " CUATTN_REGS8(48, 49, 50, 51, 52, 53, 54, 55) ", " CUATTN_REGS8(56, 57, 58, 59, 60, 61, 62, 63)
#define CUATTN_ACC80_REGS \
  CUATTN_ACC64_REGS ", " CUATTN_REGS8(64, 65, 66, 67, 68, 69, 70, 71) ", " CUATTN_REGS8(72, 73, 74, 75, 76, 77, 78, 79)
#define CUATTN_ACC96_REGS \
  CUATTN_ACC80_REGS ", " CUATTN_REGS8(80, 81, 82, 83, 84, 85, 86, 87) ", " CUATTN_REGS8(88, 89, 90, 91, 92, 93, 94, 95)
#define CUATTN_ACC128_REGS                                                                                \
  CUATTN_ACC96_REGS ", " CUATTN_REGS8(96, 97, 98, 99, 100, 101, 102, 103) ", "                            \
      CUATTN_REGS8(104, 105, 106, 107, 108, 109, 110, 111) ", " CUATTN_REGS8(112, 113, 114, 115, 116, 117, 118, 119) \
      ", " CUATTN_REGS8(120, 121, 122, 123, 124, 125, 126, 127)

#define CUATTN_ACC4_LIST "{" CUATTN_ACC4_REGS "}"
#define CUATTN_ACC8_LIST "{" CUATTN_ACC8_REGS "}"
#define CUATTN_ACC16_LIST "{" CUATTN_ACC16_REGS "}"
#define CUATTN_ACC32_LIST "{" CUATTN_ACC32_REGS "}"
#define CUATTN_ACC40_LIST "{" CUATTN_ACC40_REGS "}"
#define CUATTN_ACC48_LIST "{" CUATTN_ACC48_REGS "}"
#define CUATTN_ACC64_LIST "{" CUATTN_ACC64_REGS "}"
#define CUATTN_ACC80_LIST "{" CUATTN_ACC80_REGS "}"
#define CUATTN_ACC96_LIST "{" CUATTN_ACC96_REGS "}"
#define CUATTN_ACC128_LIST "{" CUATTN_ACC128_REGS "}"

#define CUATTN_ACC4_OPERANDS(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define CUATTN_ACC8_OPERANDS(d) CUATTN_OPERANDS8(d, 0)
#define CUATTN_ACC16_OPERANDS(d) CUATTN_ACC8_OPERANDS(d), CUATTN_OPERANDS8(d, 8)
#define CUATTN_ACC32_OPERANDS(d) CUATTN_ACC16_OPERANDS(d), CUATTN_OPERANDS8(d, 16), CUATTN_OPERANDS8(d, 24)
#define CUATTN_ACC40_OPERANDS(d) CUATTN_ACC32_OPERANDS(d), CUATTN_OPERANDS8(d, 32)
#define CUATTN_ACC48_OPERANDS(d) CUATTN_ACC40_OPERANDS(d), CUATTN_OPERANDS8(d, 40)
#define CUATTN_ACC64_OPERANDS(d) CUATTN_ACC48_OPERANDS(d), CUATTN_OPERANDS8(d, 48), CUATTN_OPERANDS8(d, 56)
#define CUATTN_ACC80_OPERANDS(d) CUATTN_ACC64_OPERANDS(d), CUATTN_OPERANDS8(d, 64), CUATTN_OPERANDS8(d, 72)
#define CUATTN_ACC96_OPERANDS(d) CUATTN_ACC80_OPERANDS(d), CUATTN_OPERANDS8(d, 80), CUATTN_OPERANDS8(d, 88)
#define CUATTN_ACC128_OPERANDS(d) \
  CUATTN_ACC96_OPERANDS(d), CUATTN_OPERANDS8(d, 96), CUATTN_OPERANDS8(d, 104), CUATTN_OPERANDS8(d, 112), \
      CUATTN_OPERANDS8(d, 120)

template <typename T, int N>
struct Wgmma;

// One specialisation per (dtype, N): ss (A and B from shared memory) and rs (A from registers).
// `accumulate` = 0 overwrites D (no zeroing pass), 1 adds; TRANS_A / TRANS_B = 1 read an
// MN-major operand.
#define CUATTN_DEFINE_WGMMA(TYPE, PTX_TYPES, N, ACC, SS_TAIL, RS_TAIL)                                        \
  template <>                                                                                                   \
  struct Wgmma<TYPE, N> {                                                                                       \
    static constexpr int kAccumulators = ACC;                                                                   \
    static constexpr int kK = kWgmmaK;                                                                          \
    template <int TRANS_A, int TRANS_B>                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[ACC], u64 desc_a, u64 desc_b, int accumulate) {       \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_TAIL                                                 \
                   : CUATTN_ACC##ACC##_OPERANDS(d)                                                              \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));                   \
    }                                                                                                           \
    template <int TRANS_B>                                                                                      \
    static __device__ __forceinline__ void rs(float (&d)[ACC], const u32 (&a)[4], u64 desc_b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_TAIL                                                 \
                   : CUATTN_ACC##ACC##_OPERANDS(d)                                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));  \
    }                                                                                                           \
  };

// operands after the accumulators: ss  %ACC desc_a, +1 desc_b, +2 accumulate, +3 trans_a, +4 trans_b;
//                                   rs  %ACC..+3 a, +4 desc_b, +5 accumulate, +6 trans_b
#define CUATTN_WGMMA_SS(N, PTX_TYPES, ACC_LIST, A, B, P, TA, TB) \
  #P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPES " " ACC_LIST ", %" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"
#define CUATTN_WGMMA_RS(N, PTX_TYPES, ACC_LIST, A0, A1, A2, A3, B, P, TB)                                    \
  #P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPES " " ACC_LIST ", {%" #A0 ", %" #A1 \
  ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, %" #TB ";\n}\n"

CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 64, 32,
                    CUATTN_WGMMA_SS(64, "bf16.bf16", CUATTN_ACC32_LIST, 32, 33, 34, 35, 36),
                    CUATTN_WGMMA_RS(64, "bf16.bf16", CUATTN_ACC32_LIST, 32, 33, 34, 35, 36, 37, 38))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 128, 64,
                    CUATTN_WGMMA_SS(128, "bf16.bf16", CUATTN_ACC64_LIST, 64, 65, 66, 67, 68),
                    CUATTN_WGMMA_RS(128, "bf16.bf16", CUATTN_ACC64_LIST, 64, 65, 66, 67, 68, 69, 70))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 64, 32,
                    CUATTN_WGMMA_SS(64, "f16.f16", CUATTN_ACC32_LIST, 32, 33, 34, 35, 36),
                    CUATTN_WGMMA_RS(64, "f16.f16", CUATTN_ACC32_LIST, 32, 33, 34, 35, 36, 37, 38))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 128, 64,
                    CUATTN_WGMMA_SS(128, "f16.f16", CUATTN_ACC64_LIST, 64, 65, 66, 67, 68),
                    CUATTN_WGMMA_RS(128, "f16.f16", CUATTN_ACC64_LIST, 64, 65, 66, 67, 68, 69, 70))

CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 80, 40,
                    CUATTN_WGMMA_SS(80, "bf16.bf16", CUATTN_ACC40_LIST, 40, 41, 42, 43, 44),
                    CUATTN_WGMMA_RS(80, "bf16.bf16", CUATTN_ACC40_LIST, 40, 41, 42, 43, 44, 45, 46))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 80, 40,
                    CUATTN_WGMMA_SS(80, "f16.f16", CUATTN_ACC40_LIST, 40, 41, 42, 43, 44),
                    CUATTN_WGMMA_RS(80, "f16.f16", CUATTN_ACC40_LIST, 40, 41, 42, 43, 44, 45, 46))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 256, 128,
                    CUATTN_WGMMA_SS(256, "bf16.bf16", CUATTN_ACC128_LIST, 128, 129, 130, 131, 132),
                    CUATTN_WGMMA_RS(256, "bf16.bf16", CUATTN_ACC128_LIST, 128, 129, 130, 131, 132, 133, 134))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 256, 128,
                    CUATTN_WGMMA_SS(256, "f16.f16", CUATTN_ACC128_LIST, 128, 129, 130, 131, 132),
                    CUATTN_WGMMA_RS(256, "f16.f16", CUATTN_ACC128_LIST, 128, 129, 130, 131, 132, 133, 134))

// Widths of whole head dims (96, 160, 192): one instruction where two pieces would take two
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 96, 48,
                    CUATTN_WGMMA_SS(96, "bf16.bf16", CUATTN_ACC48_LIST, 48, 49, 50, 51, 52),
                    CUATTN_WGMMA_RS(96, "bf16.bf16", CUATTN_ACC48_LIST, 48, 49, 50, 51, 52, 53, 54))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 96, 48,
                    CUATTN_WGMMA_SS(96, "f16.f16", CUATTN_ACC48_LIST, 48, 49, 50, 51, 52),
                    CUATTN_WGMMA_RS(96, "f16.f16", CUATTN_ACC48_LIST, 48, 49, 50, 51, 52, 53, 54))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 160, 80,
                    CUATTN_WGMMA_SS(160, "bf16.bf16", CUATTN_ACC80_LIST, 80, 81, 82, 83, 84),
                    CUATTN_WGMMA_RS(160, "bf16.bf16", CUATTN_ACC80_LIST, 80, 81, 82, 83, 84, 85, 86))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 160, 80,
                    CUATTN_WGMMA_SS(160, "f16.f16", CUATTN_ACC80_LIST, 80, 81, 82, 83, 84),
                    CUATTN_WGMMA_RS(160, "f16.f16", CUATTN_ACC80_LIST, 80, 81, 82, 83, 84, 85, 86))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 192, 96,
                    CUATTN_WGMMA_SS(192, "bf16.bf16", CUATTN_ACC96_LIST, 96, 97, 98, 99, 100),
                    CUATTN_WGMMA_RS(192, "bf16.bf16", CUATTN_ACC96_LIST, 96, 97, 98, 99, 100, 101, 102))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 192, 96,
                    CUATTN_WGMMA_SS(192, "f16.f16", CUATTN_ACC96_LIST, 96, 97, 98, 99, 100),
                    CUATTN_WGMMA_RS(192, "f16.f16", CUATTN_ACC96_LIST, 96, 97, 98, 99, 100, 101, 102))

// Narrow pieces (the tail of a WgmmaRow whose width is not a sum of the wide ones)
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 8, 4,
                    CUATTN_WGMMA_SS(8, "bf16.bf16", CUATTN_ACC4_LIST, 4, 5, 6, 7, 8),
                    CUATTN_WGMMA_RS(8, "bf16.bf16", CUATTN_ACC4_LIST, 4, 5, 6, 7, 8, 9, 10))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 8, 4,
                    CUATTN_WGMMA_SS(8, "f16.f16", CUATTN_ACC4_LIST, 4, 5, 6, 7, 8),
                    CUATTN_WGMMA_RS(8, "f16.f16", CUATTN_ACC4_LIST, 4, 5, 6, 7, 8, 9, 10))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 16, 8,
                    CUATTN_WGMMA_SS(16, "bf16.bf16", CUATTN_ACC8_LIST, 8, 9, 10, 11, 12),
                    CUATTN_WGMMA_RS(16, "bf16.bf16", CUATTN_ACC8_LIST, 8, 9, 10, 11, 12, 13, 14))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 16, 8,
                    CUATTN_WGMMA_SS(16, "f16.f16", CUATTN_ACC8_LIST, 8, 9, 10, 11, 12),
                    CUATTN_WGMMA_RS(16, "f16.f16", CUATTN_ACC8_LIST, 8, 9, 10, 11, 12, 13, 14))
CUATTN_DEFINE_WGMMA(__nv_bfloat16, "bf16.bf16", 32, 16,
                    CUATTN_WGMMA_SS(32, "bf16.bf16", CUATTN_ACC16_LIST, 16, 17, 18, 19, 20),
                    CUATTN_WGMMA_RS(32, "bf16.bf16", CUATTN_ACC16_LIST, 16, 17, 18, 19, 20, 21, 22))
CUATTN_DEFINE_WGMMA(__half, "f16.f16", 32, 16,
                    CUATTN_WGMMA_SS(32, "f16.f16", CUATTN_ACC16_LIST, 16, 17, 18, 19, 20),
                    CUATTN_WGMMA_RS(32, "f16.f16", CUATTN_ACC16_LIST, 16, 17, 18, 19, 20, 21, 22))

// e4m3 x e4m3 -> fp32, k32 per instruction (sm_90a). 8-bit operands have no transpose: A and B
// are both K-major, so B of a GEMM over keys (O += P V) must be V^T with the keys contiguous.
// A k32 step covers the same 32 bytes of a swizzled row as a 16-bit k16 step, so a tile of
// e4m3 is a SwizzledTile<ROWS, BYTES / 2> (its "16-bit columns" are byte pairs) and
// kmajor_descriptor's step s is k32 step s.
// A from registers (PTX ISA, wgmma .m64nNk32 A fragment for 8-bit types; warp w, g = lane / 4,
// t = lane % 4; byte j of a register is element j):
//   a[0] row 16 w + g,     columns 4 t .. 4 t + 3        a[1] row 16 w + g + 8, columns 4 t ..
//   a[2] row 16 w + g,     columns 16 + 4 t .. + 3       a[3] row 16 w + g + 8, columns 16 + 4 t ..
#define CUATTN_DEFINE_WGMMA8(N, ACC, SS_TAIL, RS_TAIL)                                                         \
  template <>                                                                                                   \
  struct Wgmma<e4m3, N> {                                                                                       \
    static constexpr int kAccumulators = ACC;                                                                   \
    static constexpr int kK = kWgmmaK8;                                                                         \
    template <int TRANS_A, int TRANS_B>                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[ACC], u64 desc_a, u64 desc_b, int accumulate) {       \
      static_assert(TRANS_A == 0 && TRANS_B == 0, "8-bit wgmma operands are K-major");                         \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_TAIL                                                \
                   : CUATTN_ACC##ACC##_OPERANDS(d)                                                              \
                   : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                \
    }                                                                                                           \
    template <int TRANS_B>                                                                                      \
    static __device__ __forceinline__ void rs(float (&d)[ACC], const u32 (&a)[4], u64 desc_b, int accumulate) { \
      static_assert(TRANS_B == 0, "8-bit wgmma operands are K-major");                                         \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_TAIL                                                \
                   : CUATTN_ACC##ACC##_OPERANDS(d)                                                              \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                \
    }                                                                                                           \
  };
// operands after the accumulators: ss  %ACC desc_a, +1 desc_b, +2 accumulate;
//                                   rs  %ACC..+3 a, +4 desc_b, +5 accumulate
#define CUATTN_WGMMA8_SS(N, ACC_LIST, A, B, P) \
  #P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " ACC_LIST ", %" #A ", %" #B ", p, 1, 1;\n}\n"
#define CUATTN_WGMMA8_RS(N, ACC_LIST, A0, A1, A2, A3, B, P)                                              \
  #P ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " ACC_LIST ", {%" #A0 ", %" #A1 \
  ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1;\n}\n"

CUATTN_DEFINE_WGMMA8(128, 64, CUATTN_WGMMA8_SS(128, CUATTN_ACC64_LIST, 64, 65, 66),
                     CUATTN_WGMMA8_RS(128, CUATTN_ACC64_LIST, 64, 65, 66, 67, 68, 69))
CUATTN_DEFINE_WGMMA8(256, 128, CUATTN_WGMMA8_SS(256, CUATTN_ACC128_LIST, 128, 129, 130),
                     CUATTN_WGMMA8_RS(256, CUATTN_ACC128_LIST, 128, 129, 130, 131, 132, 133))

// A GEMM D[64 x N] of any N that is a multiple of 8, as a row of the wgmma Wgmma defines: one
// instruction where Wgmma has N (96, 160, 192 among them), else the widest that fits first (so
// N = 224 runs as 128 + 96, 112 as 64 + 32 + 16).
// Piece p covers columns [offset, offset + width) of D, which are its accumulators
// [offset / 2, (offset + width) / 2) (the accumulator layout above keeps columns in order), and
// reads its B columns through desc_b(offset): the caller's descriptor of B's columns (rows of a
// K-major tile, columns of an MN-major one) from offset on. A K-major B takes any offset (a
// multiple of 8 rows); an MN-major descriptor starts at a 64-column panel, so a row over an
// MN-major B must have its offsets there (wgmma_row_panel_aligned: 224 = 128 + 96 does, 112 = 64 +
// 32 + 16 and 176 = 128 + 32 + 16 do not).
constexpr int wgmma_piece(int n) {
  return n >= 256 ? 256 : n == 192 || n == 160 ? n : n >= 128 ? 128 : n == 96 || n == 80 ? n : n >= 64 ? 64
         : n >= 32 ? 32 : n >= 16 ? 16 : 8;
}
constexpr bool wgmma_row_panel_aligned(int n) {
  for (int offset = 0; offset < n; offset += wgmma_piece(n - offset))
    if (offset % kSwizzlePanelCols != 0) return false;
  return true;
}

template <typename T, int N, int OFFSET = 0>
struct WgmmaRow {
  static_assert(N % 8 == 0 && OFFSET < N, "whole n8 columns");
  static constexpr int kAccumulators = N / 2;
  static constexpr int kWidth = wgmma_piece(N - OFFSET);
  using Piece = Wgmma<T, kWidth>;
  static constexpr int kK = Piece::kK;
  using Rest = WgmmaRow<T, N, (OFFSET + kWidth < N ? OFFSET + kWidth : OFFSET)>;

  static __device__ __forceinline__ float (&piece(float (&d)[N / 2]))[kWidth / 2] {
    return *reinterpret_cast<float(*)[kWidth / 2]>(&d[OFFSET / 2]);
  }
  template <int TRANS_A, int TRANS_B, class DescB>
  static __device__ __forceinline__ void ss(float (&d)[N / 2], u64 desc_a, DescB desc_b, int accumulate) {
    Piece::template ss<TRANS_A, TRANS_B>(piece(d), desc_a, desc_b(OFFSET), accumulate);
    if constexpr (OFFSET + kWidth < N) Rest::template ss<TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
  }
  template <int TRANS_B, class DescB>
  static __device__ __forceinline__ void rs(float (&d)[N / 2], const u32 (&a)[4], DescB desc_b, int accumulate) {
    Piece::template rs<TRANS_B>(piece(d), a, desc_b(OFFSET), accumulate);
    if constexpr (OFFSET + kWidth < N) Rest::template rs<TRANS_B>(d, a, desc_b, accumulate);
  }
};

// Close the wgmma issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ordinary shared-memory writes (st.shared, cp.async) become visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pin registers in place: nothing reads an accumulator before the wgmma_wait above it, and
// nothing writes one that a running wgmma still reads.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int S>
__device__ __forceinline__ void fence_registers(u32 (&r)[S][4]) {
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[s][i])::"memory");
}

// The registers' values are dead (the next wgmma overwrites them without reading): nothing
// holds them across the code in between.
template <int N>
__device__ __forceinline__ void forget_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "=f"(r[i]));
}

// Registers written by ordinary instructions are about to feed wgmma: `operands` are the
// accumulators and A fragments the next wgmma read. Their writes are pinned before the fence
// first: the fence names no registers, so the compiler could otherwise sink an ordinary write of
// an operand (a rescale of the output, P's packing) below it, and the wgmma would read the
// register before the write lands (CUTLASS fences its operands the same way).
template <class... Operands>
__device__ __forceinline__ void wgmma_fence(Operands&... operands) {
  (fence_registers(operands), ...);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

}  // namespace cuattn
