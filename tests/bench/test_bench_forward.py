"""Forward attention throughput: cuattn beside torch SDPA (flash, cuDNN) and naive CuPy.

Shapes follow FlashAttention's benchmark: 32k tokens in total (B = 32768 / N), H * D = 2048,
N in {1k, 4k, 16k}, D in {64, 128}, causal or not, bf16 (the naive CuPy baseline runs in fp16:
its matmuls are cuBLAS half-precision GEMMs). Each case's `extra_info` records the shapes and
TFLOP/s measured with CUDA events after warm-up (cuattn._bench.time_cuda, median); the
pytest-benchmark timing around it is the same call synchronised, for `pytest-benchmark compare`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import cuattn
from cuattn import _bench

pytestmark = pytest.mark.gpu

TOTAL_TOKENS = 32768
HIDDEN = 2048
CASES = list(itertools.product([1024, 4096, 16384], [64, 128], [False, True]))
IMPLS = ["cuattn", "torch-flash", "torch-cudnn", "naive-cupy"]


def _inputs(n, d, dtype):
    import cupy

    b, h = TOTAL_TOKENS // n, HIDDEN // d
    return [cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(3)]


def _callable(impl, q, k, v, causal):
    import cupy

    if impl == "cuattn":
        out = cupy.empty_like(q)
        return lambda: cuattn.attention(q, k, v, causal=causal, out=out)
    if impl == "naive-cupy":
        return lambda: _bench.naive_attention_cupy(q, k, v, causal=causal)
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n, d, causal", CASES, ids=[f"N{n}-d{d}-{'causal' if c else 'full'}" for n, d, c in CASES])
def test_forward(benchmark, impl, n, d, causal):
    import cupy

    if impl == "naive-cupy" and n > 4096:
        pytest.skip("naive CuPy at N = 16k needs 16 GB per score matrix and several copies")
    dtype = np.float16 if impl == "naive-cupy" else cupy.dtype("bfloat16")
    q, k, v = _inputs(n, d, dtype)
    fn = _callable(impl, q, k, v, causal)
    ms = _bench.time_cuda(fn)
    b, h = TOTAL_TOKENS // n, HIDDEN // d
    tflops = _bench.attention_flops(b, h, n, n, d, causal) / ms / 1e9
    benchmark.extra_info.update(
        impl=impl, batch=b, heads=h, seqlen=n, head_dim=d, causal=causal,
        dtype="float16" if impl == "naive-cupy" else "bfloat16", ms=ms, tflops=tflops,
    )
    print(f"\n{impl:12s} N={n:6d} d={d:3d} causal={causal!s:5s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s")

    def synchronised():
        fn()
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(synchronised, rounds=5, iterations=1, warmup_rounds=1)


def test_forward_one_head_131072(benchmark):
    """N = 131072, one head: cuattn needs out + lse; the naive score matrix alone is 32 GiB in fp16."""
    import cupy

    n, d = 131072, 128
    q, k, v = (cupy.random.standard_normal((1, n, 1, d), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
               for _ in range(3))
    pool = cupy.get_default_memory_pool()
    out = cupy.empty_like(q)
    ms = _bench.time_cuda(lambda: cuattn.attention(q, k, v, causal=True, out=out), repeats=3)
    before = pool.total_bytes()
    _, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    extra = pool.total_bytes() - before
    naive_scores_bytes = n * n * 2
    benchmark.extra_info.update(impl="cuattn", seqlen=n, head_dim=d, causal=True, ms=ms,
                                tflops=_bench.attention_flops(1, 1, n, n, d, True) / ms / 1e9,
                                extra_bytes=extra, naive_score_bytes=naive_scores_bytes)
    assert extra <= out.nbytes + lse.nbytes
    benchmark.pedantic(lambda: (cuattn.attention(q, k, v, causal=True, out=out), cupy.cuda.Device().synchronize()),
                       rounds=2, iterations=1)
