"""Forward attention throughput: cuattn beside torch SDPA (flash, cuDNN) and naive CuPy.

Shapes follow FlashAttention's benchmark: 32k tokens in total (B = 32768 / N), H * D = 2048,
N in {1k, 4k, 16k}, D in {64, 128}, causal or not, bf16 (the naive CuPy baseline runs in fp16:
its matmuls are cuBLAS half-precision GEMMs). The cases, their inputs and their timing live in
`cuattn.bench.cases`, which `python -m cuattn bench forward` runs too. Each case's `extra_info`
records the shapes and TFLOP/s measured with CUDA events after warm-up (cuattn.bench.timing.time_cuda,
median); the pytest-benchmark timing around it is the same call synchronised, for
`pytest-benchmark compare`.
"""

from __future__ import annotations

import pytest

import cuattn
from cuattn.bench import cases as bench_cases
from cuattn.bench import timing

pytestmark = pytest.mark.gpu

CASES = bench_cases.ATTENTION_GRID
IDS = [bench_cases.FAMILIES["forward"].shape_id(bench_cases.attention_shape(n, d, c)) for n, d, c in CASES]
LONG_SEQLEN, LONG_HEAD_DIM = 131072, 128


@pytest.mark.parametrize("impl", bench_cases.FORWARD_IMPLS)
@pytest.mark.parametrize("n, d, causal", CASES, ids=IDS)
def test_forward(benchmark, impl, n, d, causal):
    case = bench_cases.Case("forward", bench_cases.attention_shape(n, d, causal), (impl,))
    bench_cases.run_benchmark(benchmark, case, pytest.skip)


def test_forward_one_head_131072(benchmark):
    """N = 131072, one head: cuattn needs out + lse; the naive score matrix alone is 32 GiB in fp16."""
    import cupy

    n, d = LONG_SEQLEN, LONG_HEAD_DIM
    q, k, v = (cupy.random.standard_normal((1, n, 1, d), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
               for _ in range(3))
    pool = cupy.get_default_memory_pool()
    out = cupy.empty_like(q)
    ms = timing.time_cuda(lambda: cuattn.attention(q, k, v, causal=True, out=out), repeats=3)
    before = pool.total_bytes()
    _, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    extra = pool.total_bytes() - before
    naive_scores_bytes = n * n * bench_cases.NAIVE_DTYPE.itemsize
    benchmark.extra_info.update(impl="cuattn", seqlen=n, head_dim=d, causal=True, ms=ms,
                                tflops=timing.attention_flops(1, 1, n, n, d, True) / ms / 1e9,
                                extra_bytes=extra, naive_score_bytes=naive_scores_bytes)
    assert extra <= out.nbytes + lse.nbytes
    benchmark.pedantic(lambda: (cuattn.attention(q, k, v, causal=True, out=out), cupy.cuda.Device().synchronize()),
                       rounds=2, iterations=1)
