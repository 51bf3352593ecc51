"""Backward attention throughput: cuattn beside torch SDPA (flash, cuDNN) and naive CuPy.

The forward benchmark's shapes (32k tokens in total, H * D = 2048, N in {1k, 4k, 16k}, D in
{64, 128}, causal or not, bf16; naive CuPy in fp16). FLOPs are 2.5x the forward's
(`cuattn._bench.BACKWARD_FLOP_RATIO`). Only the backward is timed: cuattn's
`attention_backward` (delta, main kernel, dQ conversion) from the forward's out and lse; torch's
autograd backward of one SDPA forward, kept alive with retain_graph; the naive CuPy backward.
cuattn's case also records `extra_bytes`, the device memory it allocates beyond dq, dk, dv.
The cases live in `cuattn._benchcases`, which `python -m cuattn bench backward` runs too.
"""

from __future__ import annotations

import pytest

from cuattn import _benchcases

pytestmark = pytest.mark.gpu

CASES = _benchcases.ATTENTION_GRID
IDS = [_benchcases.FAMILIES["backward"].shape_id(_benchcases.attention_shape(n, d, c)) for n, d, c in CASES]


@pytest.mark.parametrize("impl", _benchcases.ATTENTION_IMPLS)
@pytest.mark.parametrize("n, d, causal", CASES, ids=IDS)
def test_backward(benchmark, impl, n, d, causal):
    case = _benchcases.Case("backward", _benchcases.attention_shape(n, d, causal), (impl,))
    _benchcases.run_benchmark(benchmark, case, pytest.skip)
