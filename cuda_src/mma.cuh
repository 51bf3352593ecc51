// mma.cuh: thin wrappers over the sm_80+ instructions the tiled kernels are built from.
//
//   cp.async 16-byte global->shared copies (with zero fill for rows past the end), commit/wait;
//   ldmatrix x4 (plain and transposed) from shared memory into mma.sync operand fragments;
//   mma.sync.aligned.m16n8k16 with fp16/bf16 operands and fp32 accumulators;
//   warp_gemm: a warp's [MT m16 x NT n8] accumulator += A B over K, both operands in shared memory.
//
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4), which the kernels rely on:
//   A (16x16, row-major)  a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, k x n)       b0: (k = 2t..2t+1, n = g)           b1: (k = 2t+8.., n = g)
//   C (16x8, fp32)        c0, c1: (g, 2t..2t+1)                c2, c3: (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace cuattn {

constexpr int kCopyBytes = 16;  // one cp.async / vector load moves 16 bytes

__device__ __forceinline__ u32 smem_address(const void* ptr) {
  return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// 16-byte async copy into shared memory, bypassing L1. `valid == false` writes 16 zero bytes
// without reading global memory (rows past the sequence end must be 0, never stale data:
// 0 * NaN would poison the accumulator).
__device__ __forceinline__ void cp_async_16(u32 smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? kCopyBytes : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(smem_address(smem), gmem, valid);
}

// 4-byte async copy (one float), zero when `valid == false`: per-row statistics beside a tile.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? static_cast<int>(sizeof(float)) : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 matrices of 16-bit elements; lane i supplies the row address of matrix i / 8, row i % 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

// The same, each 8x8 matrix transposed on the way: turns a row-major [k][n] tile into B fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

template <typename T>
struct Mma;

// D = A * B + D on a 16x8x16 tile, fp16 operands.
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// D = A * B + D on a 16x8x16 tile, bf16 operands.
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Operand fragments from a padded shared tile with row pitch STRIDE elements. "Row-major" names
// how the operand sits in memory: A [row][k] or its transpose [k][row]; B [n][k] (k contiguous,
// e.g. K rows for Q K^T) or [k][n] (n contiguous, e.g. V rows for P V).
template <int STRIDE, typename T>
__device__ __forceinline__ void load_a(u32 (&a)[4], const T* tile, int row0, int k0, int lane) {
  ldmatrix_x4(a, tile + (row0 + lane % 16) * STRIDE + k0 + (lane / 16) * 8);
}

template <int STRIDE, typename T>
__device__ __forceinline__ void load_a_from_kr(u32 (&a)[4], const T* tile, int row0, int k0, int lane) {
  ldmatrix_x4_trans(a, tile + (k0 + lane % 8 + (lane / 16) * 8) * STRIDE + row0 + ((lane / 8) % 2) * 8);
}

// b[0], b[1]: n8 tile at n0; b[2], b[3]: n8 tile at n0 + 8.
template <int STRIDE, typename T>
__device__ __forceinline__ void load_b_from_nk(u32 (&b)[4], const T* tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * STRIDE + k0 + ((lane / 8) % 2) * 8);
}

template <int STRIDE, typename T>
__device__ __forceinline__ void load_b_from_kn(u32 (&b)[4], const T* tile, int n0, int k0, int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE + n0 + (lane / 16) * 8);
}

// One k16 step's operands of a warp tile: MT A fragments and NT / 2 B fragment pairs.
template <typename T, int MT, int NT, bool A_KR, bool B_KN, int SA, int SB>
__device__ __forceinline__ void load_step_fragments(u32 (&a)[MT][4], u32 (&b)[NT / 2][4], const T* a_tile, int row0,
                                                    const T* b_tile, int n0, int k0, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if constexpr (A_KR) load_a_from_kr<SA>(a[mt], a_tile, row0 + mt * 16, k0, lane);
    else load_a<SA>(a[mt], a_tile, row0 + mt * 16, k0, lane);
  }
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    if constexpr (B_KN) load_b_from_kn<SB>(b[np], b_tile, n0 + np * 16, k0, lane);
    else load_b_from_nk<SB>(b[np], b_tile, n0 + np * 16, k0, lane);
  }
}

// c[MT][NT] += A[row0 .. row0 + 16 MT, 0 .. K) B[0 .. K, n0 .. n0 + 8 NT): each B fragment pair
// feeds all MT row tiles and each A fragment all NT column tiles, so a 32 x 32 warp tile reads
// 4 ldmatrix.x4 per 8 mma. The fragments of step k + 1 are loaded before the mma of step k
// (two register buffers), so ldmatrix latency hides behind tensor-core work even with only two
// warps per scheduler. A_KR / B_KN pick the memory order (see load_a* / load_b*).
template <typename T, int MT, int NT, int K, bool A_KR, bool B_KN, int SA, int SB>
__device__ __forceinline__ void warp_gemm(float (&c)[MT][NT][4], const T* a_tile, int row0, const T* b_tile, int n0,
                                          int lane) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "warp_gemm: n16 x k16 steps");
  constexpr int kSteps = K / 16;
  u32 a[2][MT][4], b[2][NT / 2][4];
  load_step_fragments<T, MT, NT, A_KR, B_KN, SA, SB>(a[0], b[0], a_tile, row0, b_tile, n0, 0, lane);
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    const int cur = step % 2;
    if (step + 1 < kSteps)
      load_step_fragments<T, MT, NT, A_KR, B_KN, SA, SB>(a[1 - cur], b[1 - cur], a_tile, row0, b_tile, n0,
                                                         (step + 1) * 16, lane);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma<T>::run(c[mt][2 * np], a[cur][mt], b[cur][np][0], b[cur][np][1]);
        Mma<T>::run(c[mt][2 * np + 1], a[cur][mt], b[cur][np][2], b[cur][np][3]);
      }
  }
}

// Two independent GEMMs of the same shape in one k loop: c1 += A1 B1 and c2 += A2 B2. Twice the
// independent accumulators per k16 step, so back-to-back mma never wait on each other's result
// (mma.sync has a fixed latency several times its issue interval). Used where the two products
// share their operands' layouts (S^T and dP^T; dV and dK in the backward).
template <typename T, int MT, int NT, int K, bool A_KR, bool B_KN, int SA, int SB>
__device__ __forceinline__ void warp_gemm_pair(float (&c1)[MT][NT][4], const T* a1_tile, const T* b1_tile,
                                               float (&c2)[MT][NT][4], const T* a2_tile, const T* b2_tile, int row0,
                                               int n0, int lane) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "warp_gemm_pair: n16 x k16 steps");
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    u32 a1[MT][4], b1[NT / 2][4], a2[MT][4], b2[NT / 2][4];
    load_step_fragments<T, MT, NT, A_KR, B_KN, SA, SB>(a1, b1, a1_tile, row0, b1_tile, n0, k0, lane);
    load_step_fragments<T, MT, NT, A_KR, B_KN, SA, SB>(a2, b2, a2_tile, row0, b2_tile, n0, k0, lane);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Mma<T>::run(c1[mt][2 * np], a1[mt], b1[np][0], b1[np][1]);
        Mma<T>::run(c2[mt][2 * np], a2[mt], b2[np][0], b2[np][1]);
        Mma<T>::run(c1[mt][2 * np + 1], a1[mt], b1[np][2], b1[np][3]);
        Mma<T>::run(c2[mt][2 * np + 1], a2[mt], b2[np][2], b2[np][3]);
      }
  }
}

}  // namespace cuattn
