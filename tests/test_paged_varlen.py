"""paged_attention_varlen (cuattn/paged_varlen.py): packed query runs of any length (0 included)
over a paged cache against the float64 reference of each sequence's dense problem, on the CPU
(through the same run planning as the GPU path) and on the GPU (the 2x rule), and its errors.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import reference
from conftest import BF16, error_budget, randn

QUERY_RUNS = (0, 1, 3, 16, 17, 40)  # empty, decode, speculative, one full run, a run and a tail, several
SEQ_LENS = (5, 300, 2, 64, 17, 129)  # the speculative run is longer than its sequence: early rows see nothing


def make_problem(rng, dtype, block=16, hq=8, hk=2, d=64, runs=QUERY_RUNS, lens=SEQ_LENS):
    cu = np.concatenate([[0], np.cumsum(runs)]).astype(np.int32)
    q = randn(rng, (int(cu[-1]), hq, d), dtype)
    per_seq = -(-max(lens) // block)
    table = rng.permutation(len(lens) * per_seq).astype(np.int32).reshape(len(lens), per_seq)
    k_pages = randn(rng, (len(lens) * per_seq, block, hk, d), dtype)
    v_pages = randn(rng, (len(lens) * per_seq, block, hk, d), dtype)
    return q, (k_pages, v_pages), table, cu, np.asarray(lens, np.int32)


@pytest.mark.parametrize("options", [{}, {"causal": False}, {"window": (20, 0)}, {"softcap": 15.0, "scale": 0.2}],
                         ids=["causal", "noncausal", "left-window", "softcap-scale"])
def test_packed_runs_equal_each_sequence_dense_problem(options):
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    out, lse = cuattn.paged_attention_varlen(q, pages, table, cu, lens, max(QUERY_RUNS), return_lse=True, **options)
    ref, ref_lse = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True, **options)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    empty = np.isneginf(ref_lse)
    # causal: the speculative run is longer than its sequence, so rows that see no key exist
    assert empty.any() == options.get("causal", True)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-6)


def test_decode_only_batches_take_runs_of_one_token():
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32, runs=(1, 1, 1, 1, 1, 1))
    out = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 1)
    np.testing.assert_allclose(out, cuattn.paged_attention(q[:, None], pages, table, lens)[:, 0], rtol=1e-6)


def test_e4m3_pages_on_the_cpu():
    rng = np.random.default_rng()
    q, (k_pages, v_pages), table, cu, lens = make_problem(rng, np.float32)
    k8, v8 = cuattn.quantize_fp8(k_pages, 0.02), cuattn.quantize_fp8(v_pages, 0.03)
    out = cuattn.paged_attention_varlen(q, (k8, v8), table, cu, lens, 40, k_scale=0.02, v_scale=0.03)
    ref = reference.paged_attention_varlen(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, table,
                                           cu, lens)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_argument_errors():
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    with pytest.raises(ValueError, match=r"paged_attention_varlen takes a left window only, with causal=True"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, causal=False, window=(8, -1))
    with pytest.raises(ValueError, match=r"paged_attention_varlen takes a left window only"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, window=(8, 4))
    with pytest.raises(ValueError, match=r"max_seqlen_q = 39 is below the longest sequence, 40"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 39)
    with pytest.raises(ValueError, match=r"cu_seqlens_q.shape\[0\] \(B \+ 1\) must equal block_table.shape\[0\] \+ 1 = 7, "
                                         r"got 6"):
        cuattn.paged_attention_varlen(q, pages, table, cu[:-1], lens, 40)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal q.shape\[0\] \(total_q\) = 77, got 76"):
        cuattn.paged_attention_varlen(q, pages, table, np.append(cu[:-1], 76).astype(np.int32), lens, 40)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total_q, Hq, D\)"):
        cuattn.paged_attention_varlen(q[None], pages, table, cu, lens, 40)
    with pytest.raises(TypeError, match=r"cu_seqlens_q.dtype must be int32, got int64"):
        cuattn.paged_attention_varlen(q, pages, table, cu.astype(np.int64), lens, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 7])
def test_packed_runs_on_the_gpu(rng, block):
    import cupy

    q, (k_pages, v_pages), table, cu, lens = make_problem(rng, BF16, block=block, hq=32, hk=8, d=128)
    out, lse = cuattn.paged_attention_varlen(cupy.asarray(q), (cupy.asarray(k_pages), cupy.asarray(v_pages)),
                                             cupy.asarray(table), cupy.asarray(cu), cupy.asarray(lens), 40,
                                             return_lse=True)
    out, lse = out.get().astype(np.float64), lse.get()
    ref, ref_lse = reference.paged_attention_varlen(q, k_pages, v_pages, table, cu, lens, return_lse=True)
    k_cache = reference.gather_pages(k_pages, table, lens)
    v_cache = reference.gather_pages(v_pages, table, lens)
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop == rows.start:
            continue
        naive = reference.naive_attention_lowp(q[None, rows], k_cache[b:b + 1, :lens[b]], v_cache[b:b + 1, :lens[b]],
                                               causal=True, dtype=BF16)[0]
        budget = error_budget(np.abs(naive - ref[rows]).max(), BF16, 2.0, np.abs(ref[rows]).max())
        assert np.abs(out[rows] - ref[rows]).max() <= budget, f"sequence {b} (seed {rng.seed})"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3)
