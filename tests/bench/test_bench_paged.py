"""Paged decode throughput (TB/s of KV read) beside cuattn's contiguous decode on the same shapes.

GQA 32 / 8 heads, D = 128, bf16, block_size 16, full sequences, one new token, at the decode
benchmark's (B, L) pairs. Physical blocks are shuffled across the pool, as after a while of
serving. Times are graph replays (GPU time) and eager calls, CUDA-event medians after warm-up;
`ratio` (paged / contiguous) is the ratio of the graph-timed throughputs. The cases live in
`cuattn.bench.cases`, which `python -m cuattn bench paged` runs too.
"""

from __future__ import annotations

import pytest

from cuattn.bench import cases as bench_cases

pytestmark = pytest.mark.gpu

SHAPES = bench_cases.DECODE_GRID


@pytest.mark.parametrize("batch, seqlen", SHAPES, ids=[f"B{b}-L{n}" for b, n in SHAPES])
def test_paged_decode(benchmark, batch, seqlen):
    shape = bench_cases.decode_shape(batch, seqlen, bench_cases.BLOCK_SIZE)
    bench_cases.run_benchmark(benchmark, bench_cases.Case("paged", shape, bench_cases.PAGED_IMPLS), pytest.skip)
