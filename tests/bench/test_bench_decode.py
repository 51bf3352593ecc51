"""Decode throughput in TB/s of KV read: cuattn beside torch SDPA (flash, cuDNN) with a length-1 query.

GQA 32 query / 8 KV heads, D = 128, bf16, full caches (cache_seqlens = L), one new token, at the
(B, L) pairs of the decode issue. Bytes are the K and V each step must read
(`cuattn._bench.kv_bytes`). Each case records two times: `graph_ms`, with 20 steps captured in a
CUDA graph and replayed (the GPU time; the TB/s figure), and `eager_ms`, the plain Python call
on a stream (launch overhead included), both CUDA-event medians after warm-up. The cases live in
`cuattn._benchcases`, which `python -m cuattn bench decode` runs too.
"""

from __future__ import annotations

import pytest

from cuattn import _benchcases

pytestmark = pytest.mark.gpu

SHAPES = _benchcases.DECODE_GRID


@pytest.mark.parametrize("impl", _benchcases.DECODE_IMPLS)
@pytest.mark.parametrize("batch, seqlen", SHAPES, ids=[f"B{b}-L{n}" for b, n in SHAPES])
def test_decode(benchmark, impl, batch, seqlen):
    case = _benchcases.Case("decode", _benchcases.decode_shape(batch, seqlen), (impl,))
    _benchcases.run_benchmark(benchmark, case, pytest.skip)
