"""Decode throughput in TB/s of KV read: cuattn beside torch SDPA (flash, cuDNN) with a length-1 query.

GQA 32 query / 8 KV heads, D = 128, bf16, full caches (cache_seqlens = L), one new token, at the
(B, L) pairs of the decode issue. Bytes are the K and V each step must read
(`cuattn.bench.timing.kv_bytes`). Each case records two times: `graph_ms`, with 20 steps captured in a
CUDA graph and replayed (the GPU time; the TB/s figure), and `eager_ms`, the plain Python call
on a stream (launch overhead included), both CUDA-event medians after warm-up. The cases live in
`cuattn.bench.cases`, which `python -m cuattn bench decode` runs too.
"""

from __future__ import annotations

import pytest

from cuattn.bench import cases as bench_cases

pytestmark = pytest.mark.gpu

SHAPES = bench_cases.DECODE_GRID


@pytest.mark.parametrize("impl", bench_cases.DECODE_IMPLS)
@pytest.mark.parametrize("batch, seqlen", SHAPES, ids=[f"B{b}-L{n}" for b, n in SHAPES])
def test_decode(benchmark, impl, batch, seqlen):
    case = bench_cases.Case("decode", bench_cases.decode_shape(batch, seqlen), (impl,))
    bench_cases.run_benchmark(benchmark, case, pytest.skip)
