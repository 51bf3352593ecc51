"""Paged decode throughput (TB/s of KV read) beside cuattn's contiguous decode on the same shapes.

GQA 32 / 8 heads, D = 128, bf16, block_size 16, full sequences, one new token, at the decode
benchmark's (B, L) pairs. Physical blocks are shuffled across the pool, as after a while of
serving. Times are graph replays (GPU time) and eager calls, CUDA-event medians after warm-up;
`paged/contiguous` is the ratio of the graph-timed throughputs.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import _bench

pytestmark = pytest.mark.gpu

HQ, HK, D, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (8, 131072)]


@pytest.mark.parametrize("batch, seqlen", SHAPES, ids=[f"B{b}-L{n}" for b, n in SHAPES])
def test_paged_decode(benchmark, batch, seqlen):
    import cupy

    bf16 = cupy.dtype("bfloat16")
    blocks_per_seq = seqlen // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k_pages = cupy.random.standard_normal((num_blocks, BLOCK_SIZE, HK, D), dtype=cupy.float32).astype(bf16)
    v_pages = cupy.random.standard_normal((num_blocks, BLOCK_SIZE, HK, D), dtype=cupy.float32).astype(bf16)
    table = cupy.asarray(np.random.default_rng().permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int32))
    lens = cupy.full((batch,), seqlen, np.int32)
    q = cupy.random.standard_normal((batch, 1, HQ, D), dtype=cupy.float32).astype(bf16)
    # the contiguous layout of the same cache for the baseline
    k_cache = k_pages[table].reshape(batch, seqlen, HK, D)
    v_cache = v_pages[table].reshape(batch, seqlen, HK, D)

    def paged():
        return cuattn.paged_attention(q, (k_pages, v_pages), table, lens, check=False, max_seq_len=seqlen)

    def contiguous():
        return cuattn.decode(q, k_cache, v_cache, lens)

    nbytes = _bench.kv_bytes(batch, seqlen, HK, D)
    results = {}
    for name, fn in (("paged", paged), ("contiguous", contiguous)):
        graph_ms = _bench.time_cupy_graph(fn)
        eager_ms = _bench.time_cuda(fn)
        results[name] = (graph_ms, eager_ms, nbytes / graph_ms / 1e9)
    ratio = results["paged"][2] / results["contiguous"][2]
    benchmark.extra_info.update(
        batch=batch, seqlen=seqlen, block_size=BLOCK_SIZE, q_heads=HQ, kv_heads=HK, head_dim=D, dtype="bfloat16",
        kv_bytes=nbytes, paged_graph_ms=results["paged"][0], paged_eager_ms=results["paged"][1],
        paged_tbps=results["paged"][2], contiguous_graph_ms=results["contiguous"][0],
        contiguous_eager_ms=results["contiguous"][1], contiguous_tbps=results["contiguous"][2], ratio=ratio,
    )
    print(f"\nB={batch:3d} L={seqlen:7d} paged {results['paged'][2]:5.2f} TB/s ({results['paged'][0] * 1e3:7.1f} us) "
          f"contiguous {results['contiguous'][2]:5.2f} TB/s ({results['contiguous'][0] * 1e3:7.1f} us) ratio {ratio:.3f}")

    def synchronised():
        paged()
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(synchronised, rounds=5, iterations=1, warmup_rounds=1)
