"""paged_attention_varlen (cuattn/paged_varlen.py): packed query runs of any length (0 included)
over a paged cache against the float64 reference of each sequence's dense problem, on the CPU
(every sequence through the run planning of the decode path) and on the GPU (the 2x rule): mixes
of decode rows and long prefill chunks, so that both launches (paged decode for runs of at most
16 queries, the paged forward for longer ones) write their rows of one poisoned output; and its
errors.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cuattn
from cuattn import reference
from conftest import (BF16, error_budget, expected_forward_kernel, expected_tile_order, forward_kernels, prefix_sums,
                      randn)

QUERY_RUNS = (0, 1, 3, 16, 17, 40)  # empty, decode, speculative, one full run, a run and a tail, several
SEQ_LENS = (5, 300, 2, 64, 17, 129)  # the speculative run is longer than its sequence: early rows see nothing


def make_problem(rng, dtype, block=16, hq=8, hk=2, d=64, runs=QUERY_RUNS, lens=SEQ_LENS):
    cu = prefix_sums(runs)
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


@pytest.mark.parametrize("lengths, selected, block", [
    ((0, 1, 1, 1), None, (1, 4)),             # one-token sequences after an empty one
    ((40, 1, 1), (False, True, True), (1, 3)),  # a prefill chunk, then the decode rows
    ((1, 0, 1), None, None),                  # an empty sequence between: not one block
    ((1, 3, 1), None, None),                  # a speculative run among them
    ((1, 40, 1), (True, False, True), None),  # decode rows on both sides of a chunk
    ((0, 0), None, None),                     # no queries
])
def test_one_token_sequences_in_a_row_are_found(lengths, selected, block):
    from cuattn.paged_varlen import _one_token_block

    lengths = np.asarray(lengths)
    selected = np.ones(lengths.shape, bool) if selected is None else np.asarray(selected)
    assert _one_token_block(lengths, selected) == block


@pytest.mark.parametrize("runs", [(0, 1, 1, 1), (1, 0, 1, 1)], ids=["one-block", "runs"])
def test_one_token_sequences_on_the_cpu(runs):
    """Sequences of one token each in a row take views of q, the table and the lengths (one
    copy of the results); the same batch with a gap takes the planned runs; both as the reference."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32, runs=runs, lens=(5, 300, 2, 64))
    out, lse = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 1, return_lse=True)
    ref, ref_lse = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-6)


def test_e4m3_pages_on_the_cpu():
    rng = np.random.default_rng()
    q, (k_pages, v_pages), table, cu, lens = make_problem(rng, np.float32)
    k8, v8 = cuattn.quantize_fp8(k_pages, 0.02), cuattn.quantize_fp8(v_pages, 0.03)
    out = cuattn.paged_attention_varlen(q, (k8, v8), table, cu, lens, 40, k_scale=0.02, v_scale=0.03)
    ref = reference.paged_attention_varlen(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, table,
                                           cu, lens)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"window": (20, 0)}, {"causal": False}], ids=["causal", "left-window",
                                                                                   "noncausal"])
def test_sinks_join_every_row_on_the_cpu(options):
    """Each row's sink joins its denominator: out is the sinkless output times e^lse0 / (e^lse0 +
    e^sink), lse is log(e^lse0 + e^sink), and a row that sees no key gives out 0, lse = sinks[h]."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    sinks = (2 * rng.standard_normal(q.shape[1])).astype(np.float32)
    out0, lse0 = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, return_lse=True, **options)
    out, lse = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, sinks=sinks, return_lse=True, **options)
    want_lse = np.logaddexp(lse0, sinks[:, None].astype(np.float64))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    weight = np.exp(lse0 - want_lse).T[..., None]  # [total_q, Hq, 1]; 0 where a row sees no key
    np.testing.assert_allclose(out, out0 * weight, rtol=1e-5, atol=1e-6)
    ref, ref_lse = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True, sinks=sinks,
                                                    **options)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    empty = np.isneginf(lse0)
    assert empty.any() == options.get("causal", True)
    assert (out[empty.T] == 0).all()
    np.testing.assert_array_equal(lse[empty], np.broadcast_to(sinks[:, None], lse.shape)[empty])
    with pytest.raises(ValueError, match=r"sinks.shape\[0\] \(Hq\) must equal the number of query heads = 8, got 7"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, sinks=sinks[:7])


def alibi_slopes_for(rng, shape: str, batch: int, heads: int) -> np.ndarray:
    """Slopes of `shape` "per-head" (Hq,) or "per-sequence" (B, Hq): steep and shallow heads (up to
    1, as the first heads of a small model), so that some rows' bias outweighs their scores."""
    slopes = (2.0 ** rng.uniform(-8, 0, (heads,) if shape == "per-head" else (batch, heads))).astype(np.float32)
    return np.ascontiguousarray(slopes)


@pytest.mark.parametrize("shape", ["per-head", "per-sequence"])
@pytest.mark.parametrize("options", [{}, {"window": (20, 0)}, {"softcap": 15.0, "scale": 0.2}],
                         ids=["causal", "left-window", "softcap-scale"])
def test_alibi_on_the_cpu(shape, options):
    """ALiBi's bias by each sequence's own n and seq_lens through the planned runs (a run before a
    sequence's last sees fewer keys: its diagonal is placed by them) against the reference, which
    is each sequence's dense problem; with e4m3 pages too. The bias moves every output."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    slopes = alibi_slopes_for(rng, shape, len(lens), q.shape[1])
    out, lse = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, alibi_slopes=slopes, return_lse=True,
                                             **options)
    ref, ref_lse = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True, alibi_slopes=slopes,
                                                    **options)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-6)
    # every sequence with rows that see two or more keys: its bias changed them
    plain = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, **options)
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop - rows.start and lens[b] > 1:
            assert np.abs(out[rows] - plain[rows]).max() > 1e-3, f"sequence {b}"
    # the reference's bias: sequence 5's 40 queries over its 129 keys, as one dense problem
    rows = slice(int(cu[5]), int(cu[6]))
    k_cache, v_cache = (reference.gather_pages(x, table, lens)[5:6, :lens[5]] for x in pages)
    dense = reference.attention(q[None, rows], k_cache, v_cache, causal=True, alibi_slopes=slopes if shape ==
                                "per-head" else slopes[5], **options)[0]
    np.testing.assert_allclose(ref[rows], dense, rtol=1e-12, atol=1e-12)
    k8, v8 = cuattn.quantize_fp8(pages[0], 0.02), cuattn.quantize_fp8(pages[1], 0.03)
    out8 = cuattn.paged_attention_varlen(q, (k8, v8), table, cu, lens, 40, k_scale=0.02, v_scale=0.03,
                                         alibi_slopes=slopes, **options)
    ref8 = reference.paged_attention_varlen(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, table,
                                            cu, lens, alibi_slopes=slopes, **options)
    np.testing.assert_allclose(out8, ref8, rtol=1e-5, atol=1e-6)


def test_alibi_errors():
    """Slopes checked as attention's are (shape, dtype) against the table's batch, and refused
    without causal: the bias of a run before its sequence's last would be placed by its key count."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    slopes = alibi_slopes_for(rng, "per-sequence", len(lens), q.shape[1])
    with pytest.raises(ValueError, match=r"alibi_slopes: paged_attention_varlen takes ALiBi with causal=True only, "
                                         r"got causal=False"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, causal=False, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 6, got 5"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, alibi_slopes=slopes[:5])
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(Hq\) must equal the number of query heads = 8, "
                                         r"got 7"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, alibi_slopes=slopes[0, :7])
    with pytest.raises(TypeError, match=r"alibi_slopes.dtype must be float32, got float64"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, alibi_slopes=slopes.astype(np.float64))
    with pytest.raises(ValueError, match=r"alibi_slopes must be 1-D \(Hq\) or 2-D \(B, Hq\)"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, alibi_slopes=slopes[None])


def test_run_plan_answers_every_selected_row_once():
    """The decode launch's runs cover each selected sequence's rows exactly once (an overlapping last
    run answers only the rows the run before left), and nothing of the other sequences."""
    from cuattn.paged_varlen import _Runs

    lengths = np.array([0, 1, 16, 17, 40, 5, 300])
    cu = prefix_sums(lengths)
    selected = np.array([True, True, True, True, True, True, False])
    runs = _Runs.of(cu, selected)
    want = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in np.flatnonzero(selected)])
    assert np.array_equal(np.sort(runs.query_rows), want)
    # each answered row sits at its own position of its run
    size = runs.rows.shape[1]
    assert np.array_equal(runs.rows.reshape(-1)[runs.keep], runs.query_rows)
    assert size == 16 and np.unique(runs.keep).size == runs.keep.size


def _runs_by_loop(cu, selected, size):
    """The run plan written as the loop it describes (the oracle of the vectorised _Runs.of)."""
    rows, sequence, tail, query_rows, keep = [], [], [], [], []
    for b in np.flatnonzero(selected):
        n = int(cu[b + 1] - cu[b])
        for j, start in enumerate(range(0, n, size)):
            start = min(start, n - size)
            positions = np.arange(start, start + size)
            new = np.flatnonzero(positions >= j * size)
            keep.append(len(rows) * size + new)
            rows.append(int(cu[b]) + np.maximum(positions, 0))
            sequence.append(b)
            tail.append(n - start - size)
            query_rows.append(int(cu[b]) + positions[new])
    return rows, sequence, tail, query_rows, keep


def test_run_plan_matches_its_loop_on_random_batches():
    from cuattn.paged_varlen import _Runs

    rng = np.random.default_rng()
    for _ in range(20):
        lengths = rng.choice([0, 1, 2, 15, 16, 17, 33, 100], size=int(rng.integers(1, 40)))
        cu = prefix_sums(lengths)
        selected = rng.random(lengths.size) < 0.7
        runs = _Runs.of(cu, selected)
        size = runs.rows.shape[1]
        rows, sequence, tail, query_rows, keep = _runs_by_loop(cu, selected, size)
        assert runs.count == len(sequence)
        assert np.array_equal(runs.rows, np.array(rows, np.int64).reshape(-1, size))
        assert np.array_equal(runs.sequence, sequence) and np.array_equal(runs.tail, tail)
        assert np.array_equal(runs.query_rows, np.concatenate(query_rows or [np.zeros(0, np.int64)]))
        assert np.array_equal(runs.keep, np.concatenate(keep or [np.zeros(0, np.int64)]))


def test_out_argument_on_the_cpu():
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    got = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, out=out)
    assert got is out and np.isfinite(out).all()
    np.testing.assert_allclose(out, reference.paged_attention_varlen(q, *pages, table, cu, lens), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"out.shape must equal q.shape\[:-1\] \+ v_pages.shape\[-1:\] \(v's head dim "
                                         r"Dv last\) = \(77, 8, 64\), got \(76, 8, 64\)"):
        cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, out=out[1:])


def test_a_right_window_under_a_causal_mask_is_capped_at_the_diagonal():
    """As in attention and decode: causal caps the right side at 0, so (8, 4) sees what (8, 0) does."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    capped = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, window=(8, 4))
    np.testing.assert_array_equal(capped, cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, window=(8, 0)))
    np.testing.assert_allclose(capped, reference.paged_attention_varlen(q, *pages, table, cu, lens, window=(8, 0)),
                               rtol=1e-5, atol=1e-6)


def test_argument_errors():
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    for window in ((8, -1), (-1, 4), (8, 0)):
        with pytest.raises(ValueError, match=rf"window = \({window[0]}, {window[1]}\): paged_attention_varlen takes a "
                                             r"window with causal=True only \(a decode run that is not its sequence's "
                                             r"last places the diagonal by its key count\)"):
            cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40, causal=False, window=window)
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


def test_no_query_heads_give_empty_results():
    """Hq = 0 (every Hk divides it) gives empty out and lse, as attention and decode do, not an error from
    the runs' planning."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    out, lse = cuattn.paged_attention_varlen(q[:, :0], pages, table, cu, lens, 40, return_lse=True)
    assert out.shape == (q.shape[0], 0, pages[1].shape[3]) and lse.shape == (0, q.shape[0])
    assert out.dtype == q.dtype and lse.dtype == np.float32


@pytest.mark.parametrize("block_size", [0, 257])
def test_block_size_outside_the_kernels_range_is_refused(block_size):
    rng = np.random.default_rng()
    q, _, table, cu, lens = make_problem(rng, np.float32)
    pages = randn(rng, (4, block_size, 2, 64))
    with pytest.raises(ValueError, match=rf"^k_pages.shape\[1\] \(block_size\) must be from 1 to 256, got "
                                         rf"{block_size}$"):
        cuattn.paged_attention_varlen(q, (pages, pages), table, cu, lens, 40)


@pytest.mark.parametrize("change, error, message", [
    (lambda lens: lens[:-1], ValueError, r"seq_lens.shape\[0\] \(batch\) must equal block_table.shape\[0\] = 6, got 5"),
    (lambda lens: np.array(5, np.int32), ValueError, r"seq_lens must be 1-D \(B\), got shape \(\)"),
    (lambda lens: lens.astype(np.int64) + 2**32, TypeError, r"seq_lens.dtype must be int32, got int64"),
    (lambda lens: lens + 0.5, TypeError, r"seq_lens.dtype must be int32, got float64"),
    (lambda lens: np.where(np.arange(6) == 2, -1, lens).astype(np.int32), ValueError, r"seq_lens\[2\] must be >= 0, got -1"),
    (lambda lens: [5, 300, 2, 64, 17, 2**40], ValueError, r"seq_lens must hold int32 values"),
])
def test_seq_lens_errors(change, error, message):
    """Every sequence's length is checked before any run is planned (the runs index into them)."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    with pytest.raises(error, match=message):
        cuattn.paged_attention_varlen(q, pages, table, cu, change(lens), 40)


def test_lists_are_host_int32_arrays():
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    expected = cuattn.paged_attention_varlen(q, pages, table, cu, lens, 40)
    got = cuattn.paged_attention_varlen(q, pages, table.tolist(), cu.tolist(), lens.tolist(), 40)
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must hold int32 values .*got 0 .. 1099511627776"):
        cuattn.paged_attention_varlen(q, pages, table, [0, 2**40] + cu.tolist()[2:], lens, 40)
    with pytest.raises(TypeError, match=r"block_table must hold int32 values, got float64 values"):
        cuattn.paged_attention_varlen(q, pages, (table + 0.5).tolist(), cu, lens, 40)


def test_device_prefix_sums_are_checked_before_their_copy():
    """cu_seqlens_q on the device is copied to the host (the runs are planned from it); its dtype
    is checked first, so a torch dtype NumPy lacks gets the argument's message, not torch's."""
    from conftest import Tensor

    cu = Tensor((3,), "float8_e5m2")
    cu.is_cuda, cu.device = True, "cuda:0"
    with pytest.raises(TypeError, match=r"^cu_seqlens_q.dtype must be int32, got float8_e5m2$"):
        importlib.import_module("cuattn.paged_varlen")._host_prefix_sums(cu)


def test_sequences_without_queries_are_checked_too():
    """A call checks every sequence it is given: those without queries (which no run reads) and
    a call without any query, whose arguments are checked all the same; errors name the caller's
    sequences, not the runs."""
    rng = np.random.default_rng()
    q, pages, table, cu, lens = make_problem(rng, np.float32)
    num_blocks = pages[0].shape[0]
    bad = table.copy()
    bad[0, 0] = num_blocks  # sequence 0 has no queries
    with pytest.raises(ValueError, match=rf"block_table\[0, 0\] = {num_blocks} is outside the pool of {num_blocks} "
                                         r"blocks \(sequence 0 has 5 tokens\)"):
        cuattn.paged_attention_varlen(q, pages, bad, cu, lens, 40)
    bad = table.copy()
    bad[5, 8] = -3  # sequence 5 (40 queries, two runs and a tail) reads its ninth block
    with pytest.raises(ValueError, match=r"block_table\[5, 8\] = -3 is outside the pool"):
        cuattn.paged_attention_varlen(q, pages, bad, cu, lens, 40)
    with pytest.raises(ValueError, match=r"seq_lens\[5\] = 400 exceeds what block_table holds"):
        cuattn.paged_attention_varlen(q, pages, table, cu, np.where(np.arange(6) == 5, 400, lens).astype(np.int32), 40)
    empty = np.zeros(7, np.int32)
    k_pages, v_pages = pages
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(num_heads\) = 3 must be a multiple of k_pages.shape\[2\] "
                                         r"\(num_kv_heads\) = 2"):
        cuattn.paged_attention_varlen(q[:0, :3], pages, table, empty, lens, 0)
    with pytest.raises(ValueError, match=r"k_scale applies to float8_e4m3fn caches only"):
        cuattn.paged_attention_varlen(q[:0], pages, table, empty, lens, 0, k_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head_dim\) = 12 is not supported"):
        cuattn.paged_attention_varlen(q[:0, :, :12], (k_pages[..., :12], v_pages[..., :12]), table, empty, lens, 0)
    out = cuattn.paged_attention_varlen(q[:0], pages, table, empty, lens, 0)
    assert out.shape == (0, 8, 64)


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


# Query runs of a mixed batch: empty, decode rows, a speculative run, the longest decode-path run,
# the shortest prefill run (its first rows see no key: 17 queries over 9 keys), long prefill
# chunks (the first over its whole prompt), and more decode rows after them.
MIXED_RUNS = (0, 1, 7, 16, 17, 200, 1030, 1, 3)
MIXED_LENS = (5, 301, 7, 40, 9, 200, 1337, 1, 2)


def make_mixed(rng, dtype, block, hq, hk, d, runs=MIXED_RUNS, lens=MIXED_LENS, poison=False):
    """A batch over a pool with spare pages: each sequence's pages drawn from a shuffled pool, table
    entries past a sequence's pages set to -1 (the kernels must not read them). ``poison``: every
    slot no sequence owns (past a sequence's last key, and the spare pages) holds NaN, which must
    not reach an output (a P of 0 times NaN is NaN)."""
    cu = prefix_sums(runs)
    q = randn(rng, (int(cu[-1]), hq, d), dtype)
    per_seq = -(-max(lens) // block)
    num_blocks = len(lens) * per_seq + 3
    pool = rng.permutation(num_blocks).astype(np.int32)
    table = np.full((len(lens), per_seq), -1, np.int32)
    used = 0
    for b, n in enumerate(lens):
        pages = -(-n // block)
        table[b, :pages] = pool[used:used + pages]
        used += pages
    k_pages = randn(rng, (num_blocks, block, hk, d), dtype)
    v_pages = randn(rng, (num_blocks, block, hk, d), dtype)
    if poison:
        owned = np.zeros((num_blocks, block), bool)
        for b, n in enumerate(lens):
            keys = np.arange(n)
            owned[table[b, keys // block], keys % block] = True
        k_pages[~owned] = np.nan
        v_pages[~owned] = np.nan
    return q, (k_pages, v_pages), table, cu, np.asarray(lens, np.int32)


def check_against_reference(rng, got, lse, q, pages, table, cu, lens, dtype, options):
    """Each sequence within 2x the naive same-precision error of the float64 reference; lse (unless
    None) -inf exactly on empty rows and close elsewhere."""
    ref, ref_lse = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True, **options)
    k_cache = reference.gather_pages(pages[0], table, lens)
    v_cache = reference.gather_pages(pages[1], table, lens)
    assert np.isfinite(got).all(), f"unwritten or NaN output (seed {rng.seed})"
    slopes = options.get("alibi_slopes")
    for b in range(len(lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop == rows.start:
            continue
        # (B, Hq) slopes: the sequence's own row
        own = {} if slopes is None else {"alibi_slopes": slopes if slopes.ndim == 1 else slopes[b]}
        naive = reference.naive_attention_lowp(q[None, rows], k_cache[b:b + 1, :lens[b]], v_cache[b:b + 1, :lens[b]],
                                               dtype=dtype, causal=options.get("causal", True),
                                               **{k: v for k, v in options.items()
                                                  if k not in ("causal", "alibi_slopes")}, **own)[0]
        ref_max = np.abs(ref[rows]).max(initial=0.0)
        budget = error_budget(np.abs(naive - ref[rows]).max(initial=0.0), dtype, 2.0, ref_max)
        err = np.abs(got[rows] - ref[rows]).max(initial=0.0)
        assert err <= budget, f"sequence {b}: max error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    empty = np.isneginf(ref_lse)
    assert (got[empty.T] == 0).all(), "rows with no visible key must be 0"
    if lse is not None:
        assert np.array_equal(np.isneginf(lse), empty), f"empty rows differ (seed {rng.seed})"
        np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


MIXED_OPTIONS = {
    "causal": {},
    "left-window": {"window": (100, 0)},
    "softcap-scale": {"softcap": 20.0, "scale": 0.1},
    "noncausal": {"causal": False},
}


# (dtype, mask options, block size): each option and block size with each dtype at least once,
# rather than the full product (its float64 references are the slow part of a device run)
# Blocks 8-64 and 256 are whole TMA boxes of the Hopper forward's paged loads (one page, or 128
# keys of a 256-key page); 1 and 7 run flash_fwd_kernel's PAGED variant there too.
MIXED_CASES = [
    (BF16, "causal", 16), (np.float16, "causal", 1), (BF16, "left-window", 7), (np.float16, "left-window", 16),
    (np.float16, "softcap-scale", 7), (BF16, "softcap-scale", 1), (BF16, "noncausal", 16), (np.float16, "noncausal", 7),
    (BF16, "causal", 8), (np.float16, "causal", 32), (BF16, "noncausal", 64), (BF16, "left-window", 256),
]


def expected_paged_kernel(dtype, head_dim: int, block: int) -> tuple[str, str, str | None]:
    """The start and end of the kernel name the paged forward logs, and how the Hopper kernel loads
    the pages (its "paged keys:" log line; None for flash_fwd_kernel): the Hopper kernel wherever the
    dispatcher would take it for dense keys, copying rows (small pages, and those no TMA box takes)
    or in boxes of a page, else flash_fwd_kernel's PAGED variant (its last template flag)."""
    from cuattn import _arrays

    attention_module = importlib.import_module("cuattn.attention")
    expected = expected_forward_kernel(dtype, head_dim, head_dim)
    if expected.startswith("flash_fwd_sm90_kernel"):
        tile = attention_module.fwd_sm90_tile(attention_module.fwd_sm90_tile_dims(head_dim, head_dim), paged=True)
        if attention_module.paged_keys_by_copy(block, tile.block_n):
            return expected, ", true>", "row copies"
        return expected, ", true>", f"TMA boxes of {attention_module.paged_box_rows(block, tile.block_n)} rows"
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    return f"flash_fwd_kernel<{ctype}, {attention_module.fwd_tile_dim(head_dim, head_dim)},", ", false, true>", None


def logged_forward(caplog) -> tuple[list[str], list[str]]:
    """The forward kernels and paged-key loads the debug log names."""
    messages = [r.getMessage() for r in caplog.records]
    return (forward_kernels(caplog),
            [m.removeprefix("paged keys: ") for m in messages if m.startswith("paged keys: ")])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,mask,block", MIXED_CASES,
                         ids=[f"{'bf16' if d == BF16 else 'fp16'}-{m}-block{b}" for d, m, b in MIXED_CASES])
def test_mixed_decode_and_prefill_on_the_gpu(rng, caplog, forward_kernel, dtype, mask, block):
    """GQA 32/8 at D = 128: the long runs take the paged forward (the Hopper kernel or the PAGED
    flash_fwd_kernel, named in the debug log), the short ones paged decode, into one NaN-poisoned
    output; the slots of the cache no sequence owns hold NaN."""
    import cupy

    options = MIXED_OPTIONS[mask]
    q, pages, table, cu, lens = make_mixed(rng, dtype, block, hq=32, hk=8, d=128, poison=True)
    out = cupy.full(q.shape, np.nan, dtype)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.paged_attention_varlen(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages),
                                                 cupy.asarray(table), cupy.asarray(cu), cupy.asarray(lens),
                                                 max(MIXED_RUNS), return_lse=True, out=out, **options)
    assert got is out
    chosen, loads = logged_forward(caplog)
    start, end, load = expected_paged_kernel(dtype, 128, block)
    assert len(chosen) == 1 and chosen[0].startswith(f"attention forward: cuattn::{start}"), (chosen, start)
    assert chosen[0].endswith(end), (chosen, end)
    assert loads == ([] if load is None else [load]), loads
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, pages, table, cu, lens, dtype, options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,block", [(BF16, 16), (np.float16, 7)], ids=["bf16-block16", "fp16-block7"])
def test_sinks_on_both_paths_on_the_gpu(rng, caplog, dtype, block):
    """Sinks on a mixed batch: the decode runs' combine and the paged forward's epilogue each add
    every row's sink once (the short speculative run's empty rows give out 0, lse = sinks[h])."""
    import cupy

    q, pages, table, cu, lens = make_mixed(rng, dtype, block, hq=32, hk=8, d=128, poison=True)
    sinks = (2 * rng.standard_normal(32)).astype(np.float32)
    out = cupy.full(q.shape, np.nan, dtype)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.paged_attention_varlen(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages),
                                                 cupy.asarray(table), cupy.asarray(cu), cupy.asarray(lens),
                                                 max(MIXED_RUNS), sinks=cupy.asarray(sinks), return_lse=True, out=out)
    chosen, _ = logged_forward(caplog)
    assert len(chosen) == 1, chosen  # the long runs took the paged forward
    got, lse = got.get().astype(np.float64), lse.get()
    check_against_reference(rng, got, lse, q, pages, table, cu, lens, dtype, {"sinks": sinks})
    _, lse0 = reference.paged_attention_varlen(q, *pages, table, cu, lens, return_lse=True)
    empty = np.isneginf(lse0)
    assert empty.any() and (got[empty.T] == 0).all()
    np.testing.assert_allclose(lse[empty], np.broadcast_to(sinks[:, None], lse.shape)[empty], rtol=1e-6)


# (dtype, slopes, mask options, block size, head dim): the Hopper forward's ALiBi through the S
# GEMM's k step (D = 64) and per score (D = 128), boxes of pages and row copies (block 7), both
# slope shapes, a left window
ALIBI_CASES = [
    (BF16, "per-head", "causal", 16, 128), (np.float16, "per-sequence", "causal", 7, 128),
    (BF16, "per-sequence", "left-window", 16, 64), (np.float16, "per-head", "softcap-scale", 32, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape,mask,block,head_dim", ALIBI_CASES,
                         ids=[f"{'bf16' if d == BF16 else 'fp16'}-{s}-{m}-block{b}-d{h}"
                              for d, s, m, b, h in ALIBI_CASES])
def test_alibi_on_both_paths_on_the_gpu(rng, caplog, forward_kernel, dtype, shape, mask, block, head_dim):
    """ALiBi on a mixed batch: the paged forward's ALiBi variant (named in the debug log) for the
    long runs and paged decode's for the short ones, into one NaN-poisoned output, with NaN in the
    slots no sequence owns; each sequence's bias by its own n and seq_lens."""
    import cupy

    options = MIXED_OPTIONS[mask]
    q, pages, table, cu, lens = make_mixed(rng, dtype, block, hq=8, hk=2, d=head_dim, poison=True)
    slopes = alibi_slopes_for(rng, shape, len(lens), q.shape[1])
    out = cupy.full(q.shape, np.nan, dtype)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.paged_attention_varlen(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages),
                                                 cupy.asarray(table), cupy.asarray(cu), cupy.asarray(lens),
                                                 max(MIXED_RUNS), alibi_slopes=cupy.asarray(slopes), return_lse=True,
                                                 out=out, **options)
    chosen, _ = logged_forward(caplog)
    start, _, _ = expected_paged_kernel(dtype, head_dim, block)
    # the ALIBI and PAGED flags are the kernel's last two
    assert len(chosen) == 1 and chosen[0].startswith(f"attention forward: cuattn::{start}"), (chosen, start)
    assert chosen[0].endswith(", true, true>"), chosen
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, pages, table, cu, lens, dtype,
                            {**options, "alibi_slopes": slopes})


@pytest.mark.gpu
def test_alibi_over_e4m3_pages_on_the_gpu(rng, caplog):
    """e4m3 pages send a 40-query chunk through three decode runs, the first two before its
    sequence's last token: each run's diagonal comes from the keys it sees."""
    import cupy

    q, (k_pages, v_pages), table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 64, (40, 1, 3), (300, 50, 9))
    k8, v8 = cuattn.quantize_fp8(k_pages, 0.02), cuattn.quantize_fp8(v_pages, 0.03)
    slopes = alibi_slopes_for(rng, "per-sequence", len(lens), q.shape[1])
    with caplog.at_level("DEBUG", logger="cuattn"):
        got = cuattn.paged_attention_varlen(cupy.asarray(q), (cupy.asarray(k8.view(np.uint8)),
                                                              cupy.asarray(v8.view(np.uint8))),
                                            table, cu, lens, 40, k_scale=0.02, v_scale=0.03,
                                            alibi_slopes=cupy.asarray(slopes))
    assert not forward_kernels(caplog), "ALiBi over e4m3 pages runs as decode runs (no KV_E4M3 ALiBi variant)"
    ref = reference.paged_attention_varlen(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, table, cu,
                                           lens, alibi_slopes=slopes)
    assert np.abs(got.get().astype(np.float64) - ref).max() < 3e-2, f"seed {rng.seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,heads", [(64, (8, 8)), (256, (4, 1)), (32, (6, 2)), (96, (4, 2)), (40, (4, 2)),
                                           (200, (4, 1))],
                         ids=["d64-mha", "d256-mqa", "d32-gqa", "d96-gqa", "d40-gqa", "d200-mqa"])
@pytest.mark.parametrize("block", [256, 16, 2])
@pytest.mark.parametrize("copy_max", [None, 32], ids=["loads-default", "copy-upto32"])
def test_head_dims_and_block_sizes_on_the_gpu(rng, caplog, monkeypatch, forward_kernel, head_dim, heads, block,
                                              copy_max):
    """Every head dim of the forward; a block bigger than any key tile, one of 16 (whole TMA boxes
    of the Hopper kernel at every tile) and one of two tokens (no box: rows copied); with the
    default rule (boxes wherever they fit) and with the rows of pages up to 32 tokens copied too;
    NaN in the slots no sequence owns."""
    import cupy

    if copy_max is not None:
        monkeypatch.setattr(importlib.import_module("cuattn.attention"), "FWD_SM90_COPY_MAX_BLOCK_SIZE", copy_max)
    runs, lens = (33, 1, 300, 0, 129), (33, 77, 1000, 3, 500)
    q, pages, table, cu, lens = make_mixed(rng, BF16, block, heads[0], heads[1], head_dim, runs, lens, poison=True)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.paged_attention_varlen(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages), table, cu,
                                                 lens, max(runs), return_lse=True)
    _, loads = logged_forward(caplog)
    load = expected_paged_kernel(BF16, head_dim, block)[2]
    assert loads == ([] if load is None else [load]), loads
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, pages, table, cu, lens, BF16, {})


@pytest.mark.gpu
@pytest.mark.parametrize("runs", [(300, 1, 1, 1, 1), (1, 300, 1, 1)], ids=["rows-in-one-block", "rows-apart"])
def test_a_chunk_with_one_token_sequences_on_the_gpu(rng, runs):
    """A serving step's shape: a prefill chunk and one-token sequences, in one block after it (the
    decode launch on views, one copy of its results) or on both sides (the planned runs), with
    return_lse and without; NaN in the slots no sequence owns."""
    import cupy

    q, pages, table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 128, runs, (700, 40, 513, 1, 90)[:len(runs)],
                                           poison=True)
    args = (cupy.asarray(q), tuple(cupy.asarray(x) for x in pages), table, cu, lens, max(runs))
    got, lse = cuattn.paged_attention_varlen(*args, return_lse=True)
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, pages, table, cu, lens, BF16, {})
    assert cupy.array_equal(cuattn.paged_attention_varlen(*args), got)


@pytest.mark.gpu
def test_prefill_only_and_decode_only_batches_on_the_gpu(rng, caplog):
    """A batch of prefill chunks only (no decode launch) and one of decode rows only (no forward
    launch), without return_lse, from a PagedKVCache."""
    import cupy

    for runs, lens, forward_launches in ((64, 1200), (64, 2500), 1), ((1, 16, 5), (900, 16, 33), 0):
        q, (k_pages, v_pages), table, cu, lens = make_mixed(rng, np.float16, 16, 16, 4, 128, runs, lens)
        cache = cuattn.PagedKVCache(k_pages.shape[0], 16, 4, 128, np.float16)
        cache.k_pages[...] = cupy.asarray(k_pages)
        cache.v_pages[...] = cupy.asarray(v_pages)
        caplog.clear()
        with caplog.at_level("DEBUG", logger="cuattn"):
            got = cuattn.paged_attention_varlen(cupy.asarray(q), cache, cupy.asarray(table), cu, cupy.asarray(lens),
                                                max(runs))
        chosen = forward_kernels(caplog)
        assert len(chosen) == forward_launches, chosen
        check_against_reference(rng, got.get().astype(np.float64), None, q, (k_pages, v_pages), table, cu, lens,
                                np.float16, {})


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_prefill_chunks_take_the_tile_order_on_the_gpu(rng, monkeypatch, causal):
    """Prefill chunks whose tiles outnumber the grid over a block table of at least
    FWD_SM90_TILE_ORDER_MIN_KEYS keys: the paged forward runs after fwd_tile_order_kernel (an
    OrderedFwd), whose list holds exactly the launch entries' tiles that hold rows, the entries by
    decreasing key count from seq_lens through batch_index (clamped to the table's capacity), and
    the rows match the reference; decode rows, an empty sequence and one whose unchecked length
    passes its table (check=False: the kernels clamp it) among them, the cache's unowned slots NaN."""
    import cupy

    from cuattn import _jit, paged_varlen

    attention_module = importlib.import_module("cuattn.attention")
    if not expected_forward_kernel(BF16, 64, 64).startswith("flash_fwd_sm90_kernel"):
        pytest.skip("the tile order of flash_fwd_sm90_kernel")
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: 5)
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", "dynamic")
    launches = []
    launch_fwd = paged_varlen._launch_fwd
    monkeypatch.setattr(paged_varlen, "_launch_fwd", lambda *a, **kw: launches.append(launch_fwd(*a, **kw)))
    prefill = [int(n) for n in rng.integers(17, 300, size=12)]
    runs = [1, 0, *prefill[:6], 3, *prefill[6:], 1]
    lens = [40, 7] + [n + int(rng.integers(0, 400)) for n in prefill[:6]] + [90]
    lens += [n + int(rng.integers(0, 400)) for n in prefill[6:]] + [33]
    lens[2] = attention_module.FWD_SM90_TILE_ORDER_MIN_KEYS + 20  # the table's capacity past the minimum
    # two sequences at the table's capacity (whole pages, the longest); the later one's length on the
    # device passes the table: clamped, the two tie and the earlier one comes first
    lens[3] = lens[-2] = -(-max(lens) // 16) * 16 + 16
    q, pages, table, cu, lens = make_mixed(rng, BF16, 16, hq=4, hk=2, d=64, runs=runs, lens=lens, poison=True)
    capacity = table.shape[1] * 16
    assert lens[3] == lens[-2] == capacity
    lens_device = cupy.asarray(lens)
    lens_device[-2] = capacity + 50
    out = cupy.full(q.shape, np.nan, BF16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got, lse = cuattn.paged_attention_varlen(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages),
                                                 cupy.asarray(table), cu, lens_device, max(runs), causal=causal,
                                                 return_lse=True, out=out, check=False)
    stream.synchronize()
    assert len(launches) == 1 and isinstance(launches[0], attention_module.OrderedFwd), launches
    fields = np.frombuffer(launches[0].order.params.tobytes(),
                           attention_module._params.struct_dtype("TileOrderParams"), count=1)[0]
    entries = [b for b, n in enumerate(runs) if n >= paged_varlen.PREFILL_MIN_QUERIES]
    expected = expected_tile_order([runs[b] for b in entries], [min(int(lens[b]), capacity) for b in entries], 4,
                                   int(fields["m_blocks"]), int(fields["block_m"]), int(fields["section"]),
                                   int(fields["capacity"]))
    workspace = attention_module._schedule_workspaces[(cupy.cuda.runtime.getDevice(), stream.ptr)][-1].get()
    head = attention_module._params.constant("kTileOrderHead")
    assert workspace[:2].tolist() == [0, 0], "the counters must be back at zero after the launch"
    assert int(workspace[head - 1]) == len(expected)
    np.testing.assert_array_equal(workspace[head:head + len(expected)], expected)
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, pages, table, cu, lens, BF16,
                            {"causal": causal})


@pytest.mark.gpu
def test_e4m3_pages_take_the_decode_path_without_a_hopper_tile_on_the_gpu(rng, caplog):
    """D = 32 has no Hopper tile (FWD_SM90_MIN_HEAD_DIM), and flash_fwd_kernel reads 16-bit pages
    only: a 40-query chunk over e4m3 pages runs as decode runs."""
    import cupy

    q, (k_pages, v_pages), table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 32, (40, 1), (300, 50))
    k8, v8 = cuattn.quantize_fp8(k_pages, 0.02), cuattn.quantize_fp8(v_pages, 0.03)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got = cuattn.paged_attention_varlen(cupy.asarray(q), (cupy.asarray(k8.view(np.uint8)),
                                                              cupy.asarray(v8.view(np.uint8))),
                                            table, cu, lens, 40, k_scale=0.02, v_scale=0.03)
    assert not forward_kernels(caplog)
    ref = reference.paged_attention_varlen(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, table, cu,
                                           lens)
    assert np.abs(got.get().astype(np.float64) - ref).max() < 3e-2, f"seed {rng.seed}"


@pytest.mark.gpu
def test_prefill_argument_errors_on_the_gpu(rng):
    """The checks of the paged forward's inputs, reached when a sequence has more than 16 queries."""
    import cupy

    q, pages, table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 64, (40, 1), (300, 50))
    qd, pd = cupy.asarray(q), tuple(cupy.asarray(x) for x in pages)
    with pytest.raises(TypeError, match=r"block_table.dtype must be int32, got int64"):
        cuattn.paged_attention_varlen(qd, pd, table.astype(np.int64), cu, lens, 40)
    with pytest.raises(TypeError, match=r"k_pages.dtype must equal q.dtype = bfloat16, got float16"):
        cuattn.paged_attention_varlen(qd, tuple(x.astype(np.float16) for x in pd), table, cu, lens, 40)
    with pytest.raises(ValueError, match=r"k_pages.shape\[3\] \(head_dim\) must equal q.shape\[2\] = 64, got 32"):
        cuattn.paged_attention_varlen(qd, tuple(x[..., :32] for x in pd), table, cu, lens, 40)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(num_heads\) = 8 must be a multiple of k_pages.shape\[2\] "
                                         r"\(num_kv_heads\) = 3"):
        cuattn.paged_attention_varlen(qd, tuple(cupy.concatenate([x, x[:, :, :1]], axis=2) for x in pd), table, cu,
                                      lens, 40)
    bad = table.copy()
    bad[0, 2] = pages[0].shape[0]
    with pytest.raises(ValueError, match=rf"block_table\[0, 2\] = {pages[0].shape[0]} is outside the pool"):
        cuattn.paged_attention_varlen(qd, pd, bad, cu, lens, 40)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 400 exceeds what block_table holds"):
        cuattn.paged_attention_varlen(qd, pd, table, cu, np.array([400, 50], np.int32), 40)


@pytest.mark.gpu
def test_torch_tensors_on_the_gpu(rng):
    """torch q, pages, table and lengths: both launches on torch's stream, out and lse torch tensors."""
    torch = pytest.importorskip("torch")

    q, pages, table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 64, (40, 1, 3), (300, 50, 9))

    def device(x):
        x = np.asarray(x)
        if x.dtype == BF16:
            return torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16)
        return torch.from_numpy(x).cuda()

    got, lse = cuattn.paged_attention_varlen(device(q), tuple(device(x) for x in pages), device(table), device(cu),
                                             device(lens), 40, return_lse=True)
    assert isinstance(got, torch.Tensor) and isinstance(lse, torch.Tensor)
    check_against_reference(rng, got.float().cpu().numpy().astype(np.float64), lse.cpu().numpy(), q, pages, table, cu,
                            lens, BF16, {})


# (q dtype, D, (Hq, Hk), block size) of the e4m3-pages prefill cases: tiles of 128-key blocks
# (D = 64, 80, 96, 128), of 80-key blocks (160 and 192, whose e4m3 staging takes O's tile) and of
# 64-key blocks (256), pages of 16 tokens and of 7
E4M3_PREFILL_CASES = [(BF16, 128, (8, 2), 16), (np.float16, 128, (8, 2), 7), (BF16, 96, (4, 2), 16),
                      (np.float16, 256, (4, 1), 16), (BF16, 160, (4, 4), 7), (np.float16, 64, (8, 8), 16),
                      (BF16, 80, (4, 1), 7), (BF16, 192, (4, 2), 16)]


def e4m3_pages(rng, pages, hk):
    """e4m3 copies of float pages (k, v) with a per-head k descale and a per-tensor v one: the
    bytes as CuPy arrays, the descales, and the dequantised pages in float64 (NaN kept)."""
    import cupy

    k_scale = (0.01 + 0.02 * rng.random(hk)).astype(np.float32)
    v_scale = np.float32(0.03)
    k8, v8 = cuattn.quantize_fp8(pages[0], k_scale), cuattn.quantize_fp8(pages[1], v_scale)
    dequantised = (k8.astype(np.float64) * k_scale[:, None], v8.astype(np.float64) * np.float64(v_scale))
    return (cupy.asarray(k8.view(np.uint8)), cupy.asarray(v8.view(np.uint8))), k_scale, v_scale, dequantised


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,heads,block", E4M3_PREFILL_CASES,
                         ids=[f"{'bf16' if d == BF16 else 'fp16'}-d{h}-block{b}" for d, h, _, b in E4M3_PREFILL_CASES])
def test_e4m3_pages_prefill_on_the_gpu(rng, caplog, dtype, head_dim, heads, block):
    """Long runs over e4m3 pages take flash_fwd_sm90_kernel's KV_E4M3 variant (its producer widens
    each row to fp16, the GEMMs' type under a bf16 q too; named in the debug log) wherever
    paged_e4m3_prefill says so, else decode runs; a per-head k and a per-tensor v descale; NaN in
    every slot no sequence owns. Against float64 over the dequantised pages, and the same bits from
    a PagedKVCache (head-major pages)."""
    import cupy

    attention_module = importlib.import_module("cuattn.attention")
    runs, lens = (33, 1, 300, 0, 129), (33, 77, 1000, 3, 500)
    q, pages, table, cu, lens = make_mixed(rng, dtype, block, heads[0], heads[1], head_dim, runs, lens, poison=True)
    pages8, k_scale, v_scale, dequantised = e4m3_pages(rng, pages, heads[1])
    qd = cupy.asarray(q)
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.paged_attention_varlen(qd, pages8, table, cu, lens, max(runs), return_lse=True,
                                                 k_scale=cupy.asarray(k_scale), v_scale=float(v_scale))
    kernels, loads = logged_forward(caplog)
    if attention_module.paged_e4m3_prefill(qd, head_dim, head_dim, False):
        assert len(kernels) == 1 and "flash_fwd_sm90_kernel<" in kernels[0], kernels
        assert kernels[0].endswith(", false, true, true>"), kernels
    else:
        assert kernels == [], kernels
    check_against_reference(rng, got.get().astype(np.float64), lse.get(), q, dequantised, table, cu, lens, dtype, {})
    cache = cuattn.PagedKVCache(pages8[0].shape[0], block, heads[1], head_dim, "float8_e4m3fn",
                                k_scale=cupy.asarray(k_scale), v_scale=float(v_scale))
    assert cache.layout == "HND"
    cache.k_pages[...] = pages8[0]
    cache.v_pages[...] = pages8[1]
    assert cupy.array_equal(cuattn.paged_attention_varlen(qd, cache, table, cu, lens, max(runs)), got)


@pytest.mark.gpu
def test_e4m3_pages_prefill_beside_an_out_and_sinks_on_the_gpu(rng):
    """The KV_E4M3 variant under the options the 16-bit one takes: sinks, a softcap, a left window,
    into a caller's NaN-filled out."""
    import cupy

    runs, lens = (200, 1, 64), (700, 50, 64)
    q, pages, table, cu, lens = make_mixed(rng, BF16, 16, 8, 2, 128, runs, lens, poison=True)
    pages8, k_scale, v_scale, dequantised = e4m3_pages(rng, pages, 2)
    sinks = rng.standard_normal(8).astype(np.float32)
    options = {"softcap": 20.0, "window": (100, 0)}
    out = cupy.full(q.shape, np.nan, BF16)
    got = cuattn.paged_attention_varlen(cupy.asarray(q), pages8, table, cu, lens, max(runs), out=out,
                                        sinks=cupy.asarray(sinks), k_scale=float(k_scale[0]),
                                        v_scale=cupy.asarray(np.full(2, v_scale, np.float32)), **options)
    assert got is out
    dequantised = (dequantised[0] / k_scale[:, None] * k_scale[0], dequantised[1])
    check_against_reference(rng, got.get().astype(np.float64), None, q, dequantised, table, cu, lens, BF16,
                            {**options, "sinks": sinks})


def test_the_e4m3_pages_gate_and_its_refusals(monkeypatch):
    """paged_e4m3_prefill sends e4m3 prefill chunks to the Hopper forward on sm_90a only, with a
    tile holding D and Dv and no ALiBi; the KV_E4M3 variant exists only paged, 16-bit, without
    ALiBi, and a launch that cannot take the Hopper kernel is refused rather than run elsewhere."""
    from cuattn import _arrays

    attention_module = importlib.import_module("cuattn.attention")
    q = np.zeros((40, 8, 128), np.float16)
    monkeypatch.setattr(attention_module._jit, "target_arch", lambda: attention_module.SM90)
    assert attention_module.paged_e4m3_prefill(q, 128, 128, False)
    assert not attention_module.paged_e4m3_prefill(q, 128, 128, True)  # ALiBi: decode runs
    assert not attention_module.paged_e4m3_prefill(q[..., :32], 32, 32, False)  # no Hopper tile at D = 32
    monkeypatch.setattr(attention_module._jit, "target_arch", lambda: "sm_80")
    assert not attention_module.paged_e4m3_prefill(q, 128, 128, False)

    tile = attention_module.fwd_sm90_tile((128, 128), paged=True)
    assert attention_module.fwd_sm90_spec(np.float16, 128, 128, tile, paged=True, kv_e4m3=True).name.endswith(
        ", false, true, true>")
    # a bf16 q over e4m3 pages runs the fp16 GEMMs with a bf16 output; over 16-bit pages it stays bf16
    kv8 = attention_module.fwd_sm90_spec(BF16, 128, 128, tile, paged=True, kv_e4m3=True).name
    assert kv8.startswith("cuattn::flash_fwd_sm90_kernel<__half, __nv_bfloat16, 128, 128,"), kv8
    kv16 = attention_module.fwd_sm90_spec(BF16, 128, 128, tile, paged=True).name
    assert kv16.startswith("cuattn::flash_fwd_sm90_kernel<__nv_bfloat16, __nv_bfloat16, 128, 128,"), kv16
    for options in ({"paged": False}, {"paged": True, "alibi": True}):
        with pytest.raises(ValueError, match=r"^the e4m3-pages variant is a paged 16-bit one without ALiBi$"):
            attention_module.fwd_sm90_spec(np.float16, 128, 128, tile, kv_e4m3=True, **options)
    with pytest.raises(ValueError, match=r"^the e4m3-pages variant is a paged 16-bit one without ALiBi$"):
        attention_module.fwd_sm90_spec(_arrays.FLOAT8_E4M3, 128, 128, tile, np.float16, paged=True, kv_e4m3=True)

    # on sm_80 no Hopper tile: e4m3 pages have no kernel there
    pages = np.zeros((4, 16, 2, 128), np.uint8)
    paged = attention_module.PagedKeys(block_table=None, seq_lens=None, batch_index=None, block_size=16,
                                       num_blocks=4)
    with pytest.raises(ValueError, match=r"^e4m3 pages take flash_fwd_sm90_kernel alone \(arch sm_80, head_dim 128, "
                                         r"head_dim_v 128, q.strides .*\): paged_e4m3_prefill says where$"):
        attention_module._launch_fwd(q[None], pages, pages, q[None], None, None, None, batch=1, seqlen_q=40,
                                     seqlen_k=64, causal=True, scale=None, window=(-1, -1), softcap=0.0, stream=None,
                                     paged=paged, kv_scales=(_arrays.KvScale(), _arrays.KvScale()))


def test_the_plan_key_holds_host_prefix_sums_by_value():
    """A plan is keyed by the prefix sums it was planned from: a NumPy array's dtype, shape and bytes
    or a list's ints; device prefix sums (read through a copy) and anything else have no key."""
    pv = importlib.import_module("cuattn.paged_varlen")
    cu = prefix_sums((40, 0, 300))
    assert pv._prefix_sums_key(cu) == pv._prefix_sums_key(cu.copy())
    assert pv._prefix_sums_key(cu) != pv._prefix_sums_key(prefix_sums((40, 1, 299)))
    assert pv._prefix_sums_key(cu) != pv._prefix_sums_key(cu.astype(np.int64))
    assert pv._prefix_sums_key([0, 40, 40, 340]) == (0, 40, 40, 340)
    assert pv._prefix_sums_key([0, 40.0]) is None
    assert pv._prefix_sums_key(object()) is None


def test_numpy_and_checked_calls_record_no_plan():
    """The CPU reference and checked calls (the table read on the host) take the full path and
    leave no plan; the result is the reference's either way."""
    from cuattn import _calls

    _calls.clear()
    q, pages, table, cu, lens = make_problem(np.random.default_rng(3), np.float32)
    for check in (True, False):
        got = cuattn.paged_attention_varlen(q, pages, table, cu, lens, int(np.diff(cu).max()), check=check)
        ref = reference.paged_attention_varlen(q, *pages, table, cu, lens)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not _calls._plans


# (pages, where the table and lengths live, check): every kind of each at least once
PLAN_CASES = [("bf16", "device", False, ""), ("e4m3", "device", False, "sinks"), ("bf16", "host", True, "alibi"),
              ("e4m3", "host", False, "out"), ("bf16", "host", False, "out-softcap-window")]
# A serving loop's steps: the query runs; the keys of three calls in turn (the same table shape,
# more queries than keys in the third's first sequence); runs of the same batch and total whose
# decode rows need runs (a sequence of 2), which plan nothing.
PLAN_STEPS = {"prefill": ((40, 0, 300, 129), ((40, 9, 1000, 500), (40, 5, 1000, 420), (33, 9, 999, 500)),
                          (40, 2, 298, 129)),
              "mixed": ((40, 1, 1, 1, 300, 0), ((40, 700, 9, 1, 1000, 5), (45, 701, 10, 2, 1000, 6),
                                                (33, 1000, 1, 3, 999, 5)), (40, 2, 1, 0, 300, 0)),
              "decode": ((1, 1, 1, 1, 1), ((700, 9, 1, 1000, 5), (701, 10, 2, 1000, 6), (1000, 1, 3, 999, 400)),
                         (1, 2, 0, 1, 1))}


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("step_kind", list(PLAN_STEPS))
@pytest.mark.parametrize("kind, tables, check, extra", PLAN_CASES,
                         ids=[f"{k}-{t}-{'checked' if c else 'unchecked'}{'-' + e if e else ''}"
                              for k, t, c, e in PLAN_CASES])
def test_steps_take_their_plan_on_the_gpu(rng, monkeypatch, framework, step_kind, kind, tables, check, extra):
    """Calls whose sequences with queries all take the paged forward or the in-place decode launch
    of one-token rows (prefill, mixed and decode steps; sequences without queries too) record a
    plan; later calls with the same prefix sums take it (the full path is made to fail) over new q,
    new page contents and descales, new table rows and lengths (a device table rewritten in place,
    or new NumPy arrays, checked when asked), on another stream too. A call whose decode rows need
    runs records none; a checked plan refuses a page outside the pool as the full path does.
    ``extra`` adds sinks, (B, Hq) ALiBi slopes, or a NaN-filled ``out`` each call (with a softcap
    and a left window). Against float64 with NaN in every unowned slot; e4m3 pages plan a prefill
    where the Hopper forward takes them."""
    import cupy

    from cuattn import _arrays, _calls

    if framework == "torch":
        torch = pytest.importorskip("torch")
    attention_module = importlib.import_module("cuattn.attention")
    _calls.clear()
    runs, key_counts, unplanned = PLAN_STEPS[step_kind]
    hq, hk, d, block = 8, 2, 128, 16

    def to(x):
        device = cupy.asarray(x)
        return torch.from_dlpack(device) if framework == "torch" else device

    def problem(lens):
        """q, the pages as stored, as the reference reads them, their descales, the table, cu, lens."""
        q, pages, table, cu, lens = make_mixed(rng, BF16, block, hq, hk, d, runs, lens, poison=True)
        if kind == "bf16":
            return q, tuple(cupy.asarray(x) for x in pages), pages, None, table, cu, lens
        pages8, k_scale, v_scale, dequantised = e4m3_pages(rng, pages, hk)
        return q, pages8, dequantised, (k_scale, np.full(hk, v_scale, np.float32)), table, cu, lens

    q, stored, ref_pages, descales, table, cu, lens = problem(key_counts[0])
    scales = {} if kind == "bf16" else {"k_scale": cupy.ones(hk, cupy.float32), "v_scale": cupy.ones(hk, cupy.float32)}
    cache = cuattn.PagedKVCache(stored[0].shape[0], block, hk, d, BF16 if kind == "bf16" else "float8_e4m3fn",
                                **scales)
    table_d, lens_d = to(table), to(lens)
    planned = (kind == "bf16" or step_kind == "decode"
               or attention_module.paged_e4m3_prefill(cupy.asarray(q), d, d, False))

    options = {"sinks": rng.standard_normal(hq).astype(np.float32)} if extra == "sinks" else \
        {"alibi_slopes": (0.02 + 0.1 * rng.random((len(runs), hq))).astype(np.float32)} if extra == "alibi" else \
        {"softcap": 20.0, "window": (100, 0)} if extra == "out-softcap-window" else {}

    def call(q, table, lens, cu=cu):
        if tables == "device":
            table_d[...] = to(table)
            lens_d[...] = to(lens)
            table, lens = table_d, lens_d
        given = {name: to(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
        if extra.startswith("out"):
            given["out"] = to(np.full(q.shape, np.nan, BF16))
        got, lse = cuattn.paged_attention_varlen(to(q), cache, table, cu, lens, int(np.diff(cu).max()),
                                                 check=check, return_lse=True, **given)
        assert "out" not in given or got is given["out"]
        return got, lse

    def step(q, stored, ref_pages, descales, table, lens):
        """Every array the plan reads rewritten in place (q new), then one call against float64."""
        cache.k_pages[...] = stored[0]
        cache.v_pages[...] = stored[1]
        if descales is not None:
            cache.k_scale[...] = cupy.asarray(descales[0])
            cache.v_scale[...] = cupy.asarray(descales[1])
        got, lse = call(q, table, lens)
        assert type(got).__module__.split(".")[0] == framework
        check_against_reference(rng, _arrays.to_numpy(got).astype(np.float64), _arrays.to_numpy(lse), q, ref_pages,
                                table, cu, lens, BF16, options)

    step(q, stored, ref_pages, descales, table, lens)
    assert [key[0] for key in _calls._plans] == (["paged_attention_varlen"] if planned else [])
    if not planned:
        return
    # the next problems first: quantising their pages goes through cuattn's full path
    second, third = problem(key_counts[1]), problem(key_counts[2])
    monkeypatch.setattr(_arrays, "array_context", _refuse_the_full_path)
    q, stored, ref_pages, descales, table, cu_again, lens = second
    assert np.array_equal(cu_again, cu)
    step(q, stored, ref_pages, descales, table, lens)
    q, stored, ref_pages, descales, table, _, lens = third
    # a new stream, non-blocking: it waits once for the default stream's work (this problem, made
    # there), and the step writes the pages in place on it, as a caller's cache writes are on the
    # stream its call takes
    if framework == "torch":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _arrays.external_stream(side.cuda_stream, side.device.index):
            step(q, stored, ref_pages, descales, table, lens)
        torch.cuda.synchronize()
    else:
        side = cupy.cuda.Stream(non_blocking=True)
        side.wait_event(cupy.cuda.get_current_stream().record())
        with side:
            step(q, stored, ref_pages, descales, table, lens)
        side.synchronize()
    if tables == "host" and check:
        bad = table.copy()
        bad[2, 0] = stored[0].shape[0]
        with pytest.raises(ValueError, match=r"^block_table\[2, 0\] = \d+ is outside the pool of \d+ blocks "):
            call(q, bad, lens)
    monkeypatch.undo()
    call(q, table, lens, cu=prefix_sums(unplanned))
    assert [key[0] for key in _calls._plans].count("paged_attention_varlen") == 1, "a call with decode runs planned"


def _refuse_the_full_path(**named):
    raise AssertionError("a planned call took the full path")
