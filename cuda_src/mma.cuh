// mma.cuh: thin wrappers over the sm_80+ instructions the tiled kernels are built from.
//
//   cp.async 16-byte global->shared copies (with zero fill for rows past the end), commit/wait;
//   ldmatrix x4 (plain and transposed) from shared memory into mma.sync operand fragments;
//   mma.sync.aligned.m16n8k16 with fp16/bf16 operands and fp32 accumulators.
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
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? kCopyBytes : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
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

}  // namespace cuattn
