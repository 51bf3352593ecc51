"""One paged and one contiguous decode step over the same B = 1, L = 32k cache, for a profiler.

ncu --clock-control none -k regex:decode_kernel python scripts/profile_paged.py [splits]
(GQA 32/8, D = 128, bf16, block_size 16, shuffled blocks; both kernels at the same split count,
so the two reports differ only in how K and V rows are found.)
"""

import sys

import cupy
import numpy as np

import cuattn

B, L, HQ, HK, D, BLOCK = 1, 32768, 32, 8, 128, 16


def main(argv):
    splits = int(argv[0]) if argv else 16
    bf16 = cupy.dtype("bfloat16")
    blocks = B * L // BLOCK
    k, v = (cupy.random.standard_normal((B, L, HK, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
    order = np.random.default_rng().permutation(blocks).astype(np.int32)
    # the same tokens, scattered over pages: page order[i] holds tokens [16 i, 16 i + 16)
    pages = []
    for cache in (k, v):
        paged = cupy.empty((blocks, BLOCK, HK, D), bf16)
        paged[cupy.asarray(order)] = cache.reshape(blocks, BLOCK, HK, D)
        pages.append(paged)
    table = cupy.asarray(order.reshape(B, -1))
    lens = cupy.full((B,), L, np.int32)
    q = cupy.random.standard_normal((B, 1, HQ, D), dtype=cupy.float32).astype(bf16)
    paged_out = cuattn.paged_attention(q, tuple(pages), table, lens, check=False, max_seq_len=L, num_splits=splits)
    dense_out = cuattn.decode(q, k, v, lens, num_splits=splits)
    cupy.cuda.Device().synchronize()
    err = float(cupy.abs(paged_out.astype(cupy.float32) - dense_out.astype(cupy.float32)).max())
    print(f"paged and contiguous decode, B={B} L={L} splits={splits}: max difference {err:.3g}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
