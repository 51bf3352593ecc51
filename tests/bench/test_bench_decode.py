"""Decode throughput in TB/s of KV read: cuattn beside torch SDPA (flash, cuDNN) with a length-1 query.

GQA 32 query / 8 KV heads, D = 128, bf16, full caches (cache_seqlens = L), one new token, at the
(B, L) pairs of the decode issue. Bytes are the K and V each step must read
(`cuattn._bench.kv_bytes`). Each case records two times: `graph_ms`, with 20 steps captured in a
CUDA graph and replayed (the GPU time; the TB/s figure), and `eager_ms`, the plain Python call
on a stream (launch overhead included), both CUDA-event medians after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import _bench

pytestmark = pytest.mark.gpu

HQ, HK, D = 32, 8, 128
SHAPES = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (8, 131072)]
IMPLS = ["cuattn", "torch-flash", "torch-cudnn"]


def _callable(impl, q, k, v, lens):
    if impl == "cuattn":
        return lambda: cuattn.decode(q, k, v, lens)
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    try:
        run()
    except RuntimeError as exc:
        pytest.skip(f"{impl} does not run this shape: {exc}")
    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch, seqlen", SHAPES, ids=[f"B{b}-L{n}" for b, n in SHAPES])
def test_decode(benchmark, impl, batch, seqlen):
    import cupy

    bf16 = cupy.dtype("bfloat16")
    q = cupy.random.standard_normal((batch, 1, HQ, D), dtype=cupy.float32).astype(bf16)
    k = cupy.random.standard_normal((batch, seqlen, HK, D), dtype=cupy.float32).astype(bf16)
    v = cupy.random.standard_normal((batch, seqlen, HK, D), dtype=cupy.float32).astype(bf16)
    lens = cupy.full((batch,), seqlen, np.int32)
    fn = _callable(impl, q, k, v, lens)
    eager_ms = _bench.time_cuda(fn)
    graph_ms = _bench.time_cupy_graph(fn) if impl == "cuattn" else _bench.time_torch_graph(fn)
    nbytes = _bench.kv_bytes(batch, seqlen, HK, D)
    tbps = nbytes / graph_ms / 1e9
    benchmark.extra_info.update(impl=impl, batch=batch, seqlen=seqlen, q_heads=HQ, kv_heads=HK, head_dim=D,
                                dtype="bfloat16", graph_ms=graph_ms, eager_ms=eager_ms, kv_bytes=nbytes,
                                tbps=tbps, eager_tbps=nbytes / eager_ms / 1e9)
    print(f"\n{impl:12s} B={batch:3d} L={seqlen:7d} {nbytes / 2**20:8.1f} MiB graph {graph_ms * 1e3:8.1f} us "
          f"{tbps:5.2f} TB/s | eager {eager_ms * 1e3:8.1f} us {nbytes / eager_ms / 1e9:5.2f} TB/s")

    def synchronised():
        fn()
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(synchronised, rounds=5, iterations=1, warmup_rounds=1)
