"""Backward attention throughput: cuattn beside torch SDPA (flash, cuDNN) and naive CuPy.

The forward benchmark's shapes (32k tokens in total, H * D = 2048, N in {1k, 4k, 16k}, D in
{64, 128}, causal or not, bf16; naive CuPy in fp16). FLOPs are 2.5x the forward's
(`cuattn.bench.timing.BACKWARD_FLOP_RATIO`). Only the backward is timed: cuattn's
`attention_backward` (delta, main kernel, dQ conversion) from the forward's out and lse; torch's
autograd backward of one SDPA forward, kept alive with retain_graph; the naive CuPy backward.
cuattn's case also records `extra_bytes`, the device memory it allocates beyond dq, dk, dv.
The cases live in `cuattn.bench.cases`, which `python -m cuattn bench backward` runs too.
"""

from __future__ import annotations

import pytest

from cuattn.bench import cases as bench_cases

pytestmark = pytest.mark.gpu

CASES = bench_cases.ATTENTION_GRID
IDS = [bench_cases.FAMILIES["backward"].shape_id(bench_cases.attention_shape(n, d, c)) for n, d, c in CASES]


@pytest.mark.parametrize("impl", bench_cases.ATTENTION_IMPLS)
@pytest.mark.parametrize("n, d, causal", CASES, ids=IDS)
def test_backward(benchmark, impl, n, d, causal):
    case = bench_cases.Case("backward", bench_cases.attention_shape(n, d, causal), (impl,))
    bench_cases.run_benchmark(benchmark, case, pytest.skip)
