"""wgmma.cuh on the GPU: each operand form the sm_90a backward uses, against NumPy matmuls.

One warpgroup runs one GEMM on tiles copied into 128-byte-swizzled shared memory (or, for A,
into registers in the documented fragment layout) and writes its accumulator out through the
documented accumulator layout, so a wrong swizzle, descriptor or fragment layout fails here
with a plain matrix mismatch rather than as a wrong gradient.
  ss_kk  C[64 x 64]  = A[64 x 128] B[64 x 128]^T   A, B K-major (S^T = K Q^T)
  rs_mn  C[64 x 128] = A[64 x 64] B[64 x 128]      A from registers, B MN-major (dV = P^T dO;
         also N = 96, 160 and 192 in one instruction, the forward's PV GEMM at those head dims)
  ss_mn  C[64 x 64]  = A[128 x 64]^T B[128 x 128][:, 64:128]   A, B MN-major (dQ = dS K)
and the e4m3 forms of the FP8 forward:
  ss_e4m3  C[64 x 128] = A[64 x 128] B[128 x 128]^T   e4m3, A and B K-major (S = Q K^T)
  pv_e4m3  C[64 x 128] = e4m3(P)[64 x 128] V[128 x 128]   P given in the fp32 accumulator layout,
           packed by AttentionTile::to_e4m3_fragments, V^T as the host writes it
           (fp8_v_transposed: keys permuted to the fragments' order), k32 from registers
"""

from __future__ import annotations

import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

import cuattn  # noqa: F401 (registers cuattn.attention, the module the V^T layout comes from)
from conftest import BF16

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

SRC_DIR = pathlib.Path(__file__).resolve().parent.parent / "cuda_src"

SOURCE = r"""
#include "attention_tile.cuh"
#include "wgmma.cuh"
using namespace cuattn;
using T = __nv_bfloat16;

// rows x cols row-major global -> SwizzledTile<ROWS, COLS> at byte offset `at` of shared memory
template <int ROWS, int COLS>
__device__ void to_tile(unsigned char* smem, const T* g) {
  using Tile = SwizzledTile<ROWS, COLS>;
  for (int idx = threadIdx.x; idx < ROWS * COLS / 8; idx += kWarpgroupThreads) {
    const int row = idx / (COLS / 8), chunk = idx % (COLS / 8);
    *reinterpret_cast<uint4*>(smem + Tile::chunk_offset(row, chunk)) =
        *reinterpret_cast<const uint4*>(g + row * COLS + chunk * 8);
  }
}

// accumulator of an m64nN tile -> C [64][N] row-major
template <int ACC>
__device__ void store_acc(float* c, const float (&d)[ACC]) {
  constexpr int N = ACC * 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < ACC; ++i) {
    const int j = i / 4, e = i % 4;
    c[(16 * warp + g + 8 * (e / 2)) * N + 8 * j + 2 * t + e % 2] = d[i];
  }
}

__device__ unsigned char* aligned_smem() {
  extern __shared__ __align__(16) unsigned char raw[];
  const u32 addr = smem_address(raw);
  return raw + (((addr + kSwizzleAtomBytes - 1) & ~(kSwizzleAtomBytes - 1)) - addr);
}

extern "C" __global__ void ss_kk(const T* a, const T* b, float* c) {  // a [64][128], b [64][128]
  using ATile = SwizzledTile<64, 128>;
  unsigned char* smem = aligned_smem();
  to_tile<64, 128>(smem, a);
  to_tile<64, 128>(smem + ATile::kBytes, b);
  fence_proxy_async();
  __syncthreads();
  const u32 sa = smem_address(smem), sb = sa + ATile::kBytes;
  float d[32];
  wgmma_fence();
  for (int ks = 0; ks < 8; ++ks)
    Wgmma<T, 64>::ss<0, 0>(d, kmajor_descriptor<ATile>(sa, 0, ks), kmajor_descriptor<ATile>(sb, 0, ks), ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(d);
  store_acc(c, d);
}

// a [64][64], b [64][COLS]: C = A B[:, :N], one Wgmma<T, N> per k16 step (B MN-major, N within
// whole panels of COLS columns)
template <int N, int COLS>
__device__ void rs_mn_of(const T* a, const T* b, float* c) {
  using BTile = SwizzledTile<64, COLS>;
  unsigned char* smem = aligned_smem();
  to_tile<64, COLS>(smem, b);
  fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  u32 frag[4][4];
  for (int s = 0; s < 4; ++s)
    for (int r = 0; r < 4; ++r) {
      const T* at = a + (16 * warp + g + 8 * (r % 2)) * 64 + 16 * s + 8 * (r / 2) + 2 * t;
      frag[s][r] = *reinterpret_cast<const u32*>(at);
    }
  float d[N / 2];
  wgmma_fence();
  for (int s = 0; s < 4; ++s)
    Wgmma<T, N>::template rs<1>(d, frag[s], mnmajor_descriptor<BTile>(smem_address(smem), 0, s), s > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(d);
  store_acc(c, d);
}

extern "C" __global__ void rs_mn(const T* a, const T* b, float* c) { rs_mn_of<128, 128>(a, b, c); }
// the whole head dims' single instructions: across 1.5, 2.5 and 3 panels
extern "C" __global__ void rs_mn96(const T* a, const T* b, float* c) { rs_mn_of<96, 128>(a, b, c); }
extern "C" __global__ void rs_mn160(const T* a, const T* b, float* c) { rs_mn_of<160, 192>(a, b, c); }
extern "C" __global__ void rs_mn192(const T* a, const T* b, float* c) { rs_mn_of<192, 192>(a, b, c); }

// rows x bytes row-major e4m3 -> SwizzledTile<ROWS, BYTES / 2> (16-byte chunks are the same)
template <int ROWS, int BYTES>
__device__ void to_tile8(unsigned char* smem, const unsigned char* g) {
  using Tile = SwizzledTile<ROWS, BYTES / 2>;
  for (int idx = threadIdx.x; idx < ROWS * BYTES / 16; idx += kWarpgroupThreads) {
    const int row = idx / (BYTES / 16), chunk = idx % (BYTES / 16);
    *reinterpret_cast<uint4*>(smem + Tile::chunk_offset(row, chunk)) =
        *reinterpret_cast<const uint4*>(g + row * BYTES + chunk * 16);
  }
}

extern "C" __global__ void ss_e4m3(const unsigned char* a, const unsigned char* b, float* c) {  // a [64][128], b [128][128]
  using ATile = SwizzledTile<64, 64>;
  using BTile = SwizzledTile<128, 64>;
  unsigned char* smem = aligned_smem();
  to_tile8<64, 128>(smem, a);
  to_tile8<128, 128>(smem + ATile::kBytes, b);
  fence_proxy_async();
  __syncthreads();
  const u32 sa = smem_address(smem), sb = sa + ATile::kBytes;
  float d[64];
  wgmma_fence();
  for (int ks = 0; ks < 4; ++ks)
    Wgmma<e4m3, 128>::ss<0, 0>(d, kmajor_descriptor<ATile>(sa, 0, ks), kmajor_descriptor<BTile>(sb, 0, ks), ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(d);
  store_acc(c, d);
}

// p [64][128] fp32 (rows, keys), vt [128][128] e4m3 (D rows, keys permuted as the host's V^T)
extern "C" __global__ void pv_e4m3(const float* p, const unsigned char* vt, float* c) {
  using VTile = SwizzledTile<128, 64>;
  unsigned char* smem = aligned_smem();
  to_tile8<128, 128>(smem, vt);
  fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  AttentionTile<T, 1, 16, 16> tile;
  for (int j = 0; j < 16; ++j)
    for (int e = 0; e < 4; ++e) tile.s[0][j][e] = p[(16 * warp + g + 8 * (e / 2)) * 128 + 8 * j + 2 * t + e % 2];
  u32 frag[4][4];
  tile.to_e4m3_fragments(frag);
  float d[64];
  wgmma_fence();
  for (int s = 0; s < 4; ++s)
    Wgmma<e4m3, 128>::rs<0>(d, frag[s], kmajor_descriptor<VTile>(smem_address(smem), 0, s), s > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(d);
  store_acc(c, d);
}

extern "C" __global__ void ss_mn(const T* a, const T* b, float* c) {  // a [128][64] (k, m), b [128][128] (k, n)
  using ATile = SwizzledTile<128, 64>;
  using BTile = SwizzledTile<128, 128>;
  unsigned char* smem = aligned_smem();
  to_tile<128, 64>(smem, a);
  to_tile<128, 128>(smem + ATile::kBytes, b);
  fence_proxy_async();
  __syncthreads();
  const u32 sa = smem_address(smem), sb = sa + ATile::kBytes;
  float d[32];
  wgmma_fence();
  for (int ks = 0; ks < 8; ++ks)
    Wgmma<T, 64>::ss<1, 1>(d, mnmajor_descriptor<ATile>(sa, 0, ks), mnmajor_descriptor<BTile>(sb, 64, ks), ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(d);
  store_acc(c, d);
}
"""

SMEM_BYTES = 96 * 1024


def _module():
    import cupy

    from cuattn import _jit

    if _jit.target_arch() != "sm_90a":
        pytest.skip("wgmma needs an sm_90 GPU")
    include = _jit.cuda_include_dir()
    options = ("-arch=sm_90a", "-std=c++17", f"-I{SRC_DIR}", *([f"-I{include}"] if include else []))
    return cupy.RawModule(code=SOURCE, options=options, backend="nvrtc")


CASES = {
    # name: (A shape, B shape, reference from the NumPy arrays)
    "ss_kk": ((64, 128), (64, 128), lambda a, b: a @ b.T),
    "rs_mn": ((64, 64), (64, 128), lambda a, b: a @ b),
    "rs_mn96": ((64, 64), (64, 128), lambda a, b: a @ b[:, :96]),
    "rs_mn160": ((64, 64), (64, 192), lambda a, b: a @ b[:, :160]),
    "rs_mn192": ((64, 64), (64, 192), lambda a, b: a @ b),
    "ss_mn": ((128, 64), (128, 128), lambda a, b: a.T @ b[:, 64:]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_wgmma_operand_forms(rng, name):
    import cupy

    a_shape, b_shape, reference = CASES[name]
    kernel = _module().get_function(name)
    kernel.max_dynamic_shared_size_bytes = SMEM_BYTES
    a = rng.standard_normal(a_shape).astype(BF16)
    b = rng.standard_normal(b_shape).astype(BF16)
    want = reference(a.astype(np.float64), b.astype(np.float64))
    c = cupy.full(want.shape, np.nan, cupy.float32)  # poisoned: every element must be written
    # bf16 travels as its raw 16-bit pattern
    kernel((1,), (128,), (cupy.asarray(a.view(np.uint16)), cupy.asarray(b.view(np.uint16)), c),
           shared_mem=SMEM_BYTES)
    got = cupy.asnumpy(c)
    # fp32 accumulation of exact bf16 products: only summation-order rounding
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"seed {rng.seed}")


# Hopper's e4m3 wgmma adds each k32 step's products in a limited-precision accumulator (about 13
# significant bits, aligned to the step's largest product), not in fp32: a sum carries an error up
# to about 2^-11 of the sum of its products' magnitudes (measured here: 0.019 on sums of 128
# standard-normal products). A wrong fragment layout pairs the wrong elements: errors of the size
# of the sums themselves.
E4M3_ACCUMULATION = 2.0 ** -10


def assert_e4m3_sums_close(got, want, magnitudes, seed):
    err = np.abs(got - want)
    bound = E4M3_ACCUMULATION * magnitudes + 1e-6
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"error {err[worst]:.3g} > {bound[worst]:.3g} at {worst} "
                                  f"(sum {want[worst]:.3g}); seed {seed}")


@pytest.mark.gpu
def test_wgmma_e4m3_qk(rng):
    """S = Q K^T on e4m3 tiles (both K-major): exact products, sums within the FP8 accumulator's precision."""
    import cupy

    kernel = _module().get_function("ss_e4m3")
    kernel.max_dynamic_shared_size_bytes = SMEM_BYTES
    a = rng.standard_normal((64, 128)).astype(E4M3)
    b = rng.standard_normal((128, 128)).astype(E4M3)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    c = cupy.full(want.shape, np.nan, cupy.float32)
    kernel((1,), (128,), (cupy.asarray(a.view(np.uint8)), cupy.asarray(b.view(np.uint8)), c), shared_mem=SMEM_BYTES)
    magnitudes = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    assert_e4m3_sums_close(cupy.asnumpy(c), want, magnitudes, rng.seed)


@pytest.mark.gpu
def test_wgmma_e4m3_pv_from_accumulator_layout(rng):
    """O = e4m3(P) V with P packed from the accumulator layout and V^T in the host's permuted order:
    a wrong fragment packing or permutation pairs probabilities with the wrong keys' values."""
    import cupy

    attention_module = sys.modules["cuattn.attention"]
    kernel = _module().get_function("pv_e4m3")
    kernel.max_dynamic_shared_size_bytes = SMEM_BYTES
    p = rng.random((64, 128)).astype(np.float32) * 2.0  # probabilities of a lazily moved max: up to 2^8
    v = rng.standard_normal((128, 128)).astype(E4M3)  # [keys, D]
    vt = attention_module.fp8_v_transposed(v.view(np.uint8)[None, :, None, :])[0, 0]  # [D, keys]
    want = p.astype(E4M3).astype(np.float64) @ v.astype(np.float64)
    c = cupy.full(want.shape, np.nan, cupy.float32)
    kernel((1,), (128,), (cupy.asarray(p), cupy.asarray(vt), c), shared_mem=SMEM_BYTES)
    magnitudes = np.abs(p.astype(E4M3).astype(np.float64)) @ np.abs(v.astype(np.float64))
    assert_e4m3_sums_close(cupy.asnumpy(c), want, magnitudes, rng.seed)
