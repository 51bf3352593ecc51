"""FlashDecoding and merge_states on the GPU against the float64 reference (and torch SDPA).

Fresh random inputs every run, ragged cache lengths (0 and 1 included), every split count
path (one split writes the output directly; several merge in the last split's CTA, or in the
combine kernel where that is off), GQA packing ratios, strided caches, and a decode step
captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cuattn
from cuattn import _registry, reference
from conftest import BF16, DTYPE_IDS, DTYPES, check_decode, error_budget, randn

HEAD_DIMS = list(_registry.test_head_dims("decode"))


def _cupy():
    import cupy

    return cupy


def make_cache(rng, dtype, b, s_max, hk, d, lens):
    k = randn(rng, (b, s_max, hk, d), dtype)
    v = randn(rng, (b, s_max, hk, d), dtype)
    # slots past each row's length hold NaN: the kernel must never read them into the result
    for i, n in enumerate(lens):
        k[i, n:] = np.nan
        v[i, n:] = np.nan
    return k, v


def run_decode(rng, dtype, b, sq_new, hq, hk, d, s_max, lens, **options):
    cupy = _cupy()
    q = randn(rng, (b, sq_new, hq, d), dtype)
    k, v = make_cache(rng, dtype, b, s_max, hk, d, lens)
    lens = np.asarray(lens, np.int32)
    device_options = {**options, **{name: cupy.asarray(options[name]) for name in ("sinks", "alibi_slopes")
                                     if name in options}}
    out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(lens),
                             return_lse=True, **device_options)
    for planning_only in ("num_splits", "max_seq_len"):
        options.pop(planning_only, None)
    check_decode(rng, dtype, q, k, v, lens, out.get(), lse.get(), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["1split", "3splits", "auto"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_dtype_head_dim_splits(rng, dtype, head_dim, num_splits):
    run_decode(rng, dtype, 4, 1, 8, 2, head_dim, 700, [700, 1, 0, 333], num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [(32, 8), (8, 1), (4, 4), (16, 1)], ids=["32q8kv", "8q1kv", "mha", "16q1kv"])
@pytest.mark.parametrize("sq_new", [1, 2, 5, 16])
def test_decode_gqa_and_speculative_tokens(rng, gqa, sq_new):
    # Sq_new x group can pass 16 rows (one or two m16 tiles, then several row chunks)
    run_decode(rng, BF16, 3, sq_new, gqa[0], gqa[1], 128, 1029, [1029, 17, 3], num_splits=None)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"causal": False}, {"window": (50, 0)}, {"softcap": 20.0},
                                     {"scale": 0.05, "window": (200, -1)}],
                         ids=["noncausal", "window", "softcap", "scale-window"])
def test_decode_options(rng, options):
    run_decode(rng, DTYPES[0], 2, 4, 8, 2, 64, 2000, [2000, 401], num_splits=5, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4], ids=["1split", "4splits"])
def test_decode_sinks(rng, num_splits):
    """One split joins the sinks in the decode kernel, several in the combine; an empty row
    (length 0) gets out 0 and lse = its sink."""
    sinks = (rng.standard_normal(8) * 2).astype(np.float32)
    run_decode(rng, BF16, 3, 2, 8, 2, 128, 900, [900, 0, 37], num_splits=num_splits, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("per_sequence", [False, True], ids=["Hq", "B-Hq"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["1split", "4splits"])
@pytest.mark.parametrize("sq_new", [1, 3])
def test_decode_alibi(rng, sq_new, num_splits, per_sequence):
    """Rows pack (token, head) pairs: each row takes its own head's slope and its token's
    distance i + len - Sq_new - j; the splits' partials carry the bias into the combine."""
    slopes = 2.0 ** (-8.0 * np.arange(1, 9) / 8)
    slopes = (slopes * 0.5 ** np.arange(3)[:, None] if per_sequence else slopes).astype(np.float32)
    run_decode(rng, BF16, 3, sq_new, 8, 2, 128, 900, [900, 0, 37], num_splits=num_splits, alibi_slopes=slopes)


@pytest.mark.gpu
def test_decode_long_single_sequence_splits(rng):
    run_decode(rng, BF16, 1, 1, 32, 8, 128, 32768, [32768 - 77], num_splits=None)


@pytest.mark.gpu
def test_decode_lengths_shorter_than_new_tokens_give_empty_rows(rng):
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (2, 4, 2, 64), np.float16))
    k = cupy.asarray(randn(rng, (2, 10, 2, 64), np.float16))
    lens = cupy.asarray(np.array([2, 0], np.int32))
    out, lse = cuattn.decode(q, k, k, lens, return_lse=True)
    # row 0: 2 keys, 4 new tokens: tokens 0 and 1 see nothing under causal
    assert (out[0, :2] == 0).all() and cupy.isneginf(lse[0, :, :2]).all()
    assert cupy.isfinite(lse[0, :, 2:]).all()
    assert (out[1] == 0).all() and cupy.isneginf(lse[1]).all()


@pytest.mark.gpu
def test_decode_lengths_past_the_cache_are_clamped(rng):
    cupy = _cupy()
    q = randn(rng, (1, 1, 4, 64), np.float16)
    k = randn(rng, (1, 50, 4, 64), np.float16)
    out = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(k), cupy.asarray(np.array([999], np.int32)))
    ref = reference.decode(q, k, k, np.array([50]))
    assert np.abs(out.get() - ref).max() < 5e-3


@pytest.mark.gpu
def test_decode_strided_cache_views(rng):
    cupy = _cupy()
    b, s_max, hk, d = 2, 300, 2, 128
    big = cupy.asarray(randn(rng, (b, s_max, 2 * hk, d), BF16))
    k, v = big[:, :, :hk], big[:, :, hk:]
    assert not k.flags.c_contiguous
    q = cupy.asarray(randn(rng, (b, 1, 8, d), BF16))
    lens = cupy.asarray(np.array([300, 123], np.int32))
    strided = cuattn.decode(q, k, v, lens)
    dense = cuattn.decode(q, cupy.ascontiguousarray(k), cupy.ascontiguousarray(v), lens)
    assert cupy.array_equal(strided, dense)


@pytest.mark.gpu
def test_decode_matches_torch_sdpa(rng):
    torch = pytest.importorskip("torch")
    b, s, hq, hk, d = 2, 4096, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    out = cuattn.decode(q, k, v, lens)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    q, k, v = (x.float().cpu().numpy() for x in (q, k, v))
    ref = reference.decode(q, k, v, lens.cpu().numpy())
    ours = np.abs(out.float().cpu().numpy() - ref).max()
    theirs = np.abs(expected.float().cpu().numpy() - ref).max()
    # the tolerance rule, over the larger of the naive computation's error and torch's
    naive = np.abs(reference.naive_attention_lowp(q, k, v, dtype=BF16) - ref).max()
    budget = error_budget(max(naive, theirs), BF16, 2.0, np.abs(ref).max())
    assert ours <= budget, f"cuattn {ours:.3g} vs torch {theirs:.3g}, naive {naive:.3g} (seed {rng.seed})"


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph(rng):
    """No host sync on the launch path: capture one step, change the inputs in place, replay."""
    cupy = _cupy()
    b, s_max, hq, hk, d = 2, 4096, 16, 4, 128
    q = cupy.asarray(randn(rng, (b, 1, hq, d), BF16))
    k = cupy.asarray(randn(rng, (b, s_max, hk, d), BF16))
    v = cupy.asarray(randn(rng, (b, s_max, hk, d), BF16))
    lens = cupy.asarray(np.array([4000, 1500], np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.decode(q, k, v, lens, num_splits=8)  # compile, load and size the workspace first
        stream.begin_capture()
        out = cuattn.decode(q, k, v, lens, num_splits=8)
        graph = stream.end_capture()
        for step in range(3):
            q[...] = cupy.asarray(randn(rng, q.shape, BF16))
            lens[...] = cupy.asarray(np.array([4000 + step, 1500 - 7 * step], np.int32))
            graph.launch(stream)
            stream.synchronize()
            check_decode(rng, BF16, q.get(), k.get(), v.get(), lens.get(), out.get(), None)


@pytest.mark.gpu
def test_a_graph_keeps_its_workspace_when_a_larger_call_outgrows_it(rng):
    """The stream's split workspace a captured step writes into stays allocated (held by the
    module) after a larger call on that stream replaces it, and the replay still matches the
    reference."""
    cupy = _cupy()
    decode_module = importlib.import_module("cuattn.decode")  # the module (cuattn.decode is the function)

    b, s_max, hq, hk, d = 2, 4096, 16, 4, 128
    q = cupy.asarray(randn(rng, (b, 1, hq, d), BF16))
    k, v = (cupy.asarray(randn(rng, (b, s_max, hk, d), BF16)) for _ in range(2))
    lens = cupy.asarray(np.array([4000, 1500], np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.decode(q, k, v, lens, num_splits=4)  # the stream's workspace, sized for 4 splits
        stream.begin_capture()
        out = cuattn.decode(q, k, v, lens, num_splits=4)
        graph = stream.end_capture()
        key = (cupy.cuda.runtime.getDevice(), stream.ptr)
        captured = decode_module._workspaces[key].data.ptr  # the address the graph writes partials to
        # 32 splits of a batch of 8 need a larger workspace on the same stream
        big_q = cupy.asarray(randn(rng, (8, 1, hq, d), BF16))
        big_k, big_v = (cupy.asarray(randn(rng, (8, s_max, hk, d), BF16)) for _ in range(2))
        cuattn.decode(big_q, big_k, big_v, cupy.full(8, s_max, np.int32), num_splits=32)
        assert decode_module._workspaces[key].data.ptr != captured
        assert any(buf.data.ptr == captured for buf in decode_module._retired_workspaces)
        q[...] = cupy.asarray(randn(rng, q.shape, BF16))
        graph.launch(stream)
        stream.synchronize()
    check_decode(rng, BF16, q.get(), k.get(), v.get(), lens.get(), out.get(), None)


# ---------------------------------------------------------------------------------------------
# the split combine fused into the decode kernel


def _split_call(rng, kind, sq_new, sinks, num_splits):
    """A split decode call of ``kind`` over fresh inputs (lengths 0, 1 and ragged: empty splits)."""
    cupy = _cupy()
    b, hq, hk, d, s_max, block = 4, 8, 2, 64, 640, 16
    lens = np.array([640, 1, 0, 517], np.int32)
    q = cupy.asarray(randn(rng, (b, sq_new, hq, d), BF16))
    k, v = (cupy.asarray(randn(rng, (b, s_max, hk, d), BF16)) for _ in range(2))
    options = dict(num_splits=num_splits, return_lse=True)
    if sinks:
        options["sinks"] = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
    if kind == "e4m3":
        ks, vs = cuattn.fp8_scales(k, per_head=True), cuattn.fp8_scales(v, per_head=True)
        k8, v8 = cuattn.quantize_fp8(k, ks), cuattn.quantize_fp8(v, vs)
        return lambda: cuattn.decode(q, k8, v8, cupy.asarray(lens), k_scale=ks, v_scale=vs, **options)
    if kind == "paged":
        pages = b * s_max // block
        order = cupy.asarray(rng.permutation(pages).astype(np.int32))
        k_pages, v_pages = (cupy.empty((pages, block, hk, d), BF16) for _ in range(2))
        k_pages[order] = k.reshape(pages, block, hk, d)
        v_pages[order] = v.reshape(pages, block, hk, d)
        return lambda: cuattn.paged_attention(q, (k_pages, v_pages), order.reshape(b, -1), cupy.asarray(lens), **options)
    return lambda: cuattn.decode(q, k, v, cupy.asarray(lens), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 7, 128])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("sq_new", [1, 5])
@pytest.mark.parametrize("kind", ["contiguous", "paged", "e4m3"])
def test_fused_split_combine_equals_the_combine_kernel(rng, monkeypatch, kind, sq_new, sinks, num_splits):
    """The last split's CTA merges as combine_kernel does (an online softmax over the splits
    instead of weights computed first: equal up to float32 rounding), empty splits and sinks
    included."""
    from cuattn import _calls

    decode_module = importlib.import_module("cuattn.decode")
    call = _split_call(rng, kind, sq_new, sinks, num_splits)
    _calls.clear()
    fused_out, fused_lse = (x.get() for x in call())
    monkeypatch.setattr(decode_module, "FUSE_SPLIT_COMBINE", False)
    _calls.clear()
    out, lse = (x.get() for x in call())
    _calls.clear()
    assert np.isfinite(fused_out.astype(np.float32)).all(), f"seed {rng.seed}"
    # one rounding of the 16-bit output apart at most
    np.testing.assert_allclose(fused_out.astype(np.float32), out.astype(np.float32), rtol=2.0**-7, atol=1e-6,
                               err_msg=f"seed {rng.seed}")
    np.testing.assert_allclose(fused_lse, lse, rtol=1e-6, atol=1e-6, err_msg=f"seed {rng.seed}")


def _arrival_counters(stream):
    cupy = _cupy()
    decode_module = importlib.import_module("cuattn.decode")
    buf = decode_module._workspaces[(cupy.cuda.runtime.getDevice(), stream.ptr)]
    return buf[:decode_module.SPLIT_ARRIVAL_SLOTS].view(cupy.uint32)


@pytest.mark.gpu
def test_split_launches_leave_their_arrival_counters_at_zero(rng):
    """Each fused launch's last arrival resets its group's counter, whatever the split count
    (the counter wraps at num_splits - 1) and the shape, so the next call on the stream starts
    from zero; the results stay exact meanwhile."""
    cupy = _cupy()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for b, hq, hk, s_max, splits in [(3, 8, 2, 900, 3), (1, 32, 8, 4096, 128), (5, 4, 4, 300, 2), (3, 8, 2, 900, 5)]:
            lens = rng.integers(0, s_max + 1, b).astype(np.int32)
            q = randn(rng, (b, 1, hq, 64), BF16)
            k, v = make_cache(rng, BF16, b, s_max, hk, 64, lens)
            out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(lens),
                                     num_splits=splits, return_lse=True)
            check_decode(rng, BF16, q, k, v, lens, out.get(), lse.get())
            assert not _arrival_counters(stream).any(), f"counters left set after {splits} splits"


@pytest.mark.gpu
def test_a_workspace_first_allocated_under_capture_zeroes_its_counters_in_the_graph_and_again_outside(rng):
    """A stream whose first split call is captured gets its workspace inside the capture: the
    counters' memset is a node of the graph (ahead of the decode), and the stream's next call
    outside a capture zeroes them again before its launch. Garbage written over the counters
    before each run stands in for the allocation's unzeroed memory."""
    cupy = _cupy()
    b, s_max, hq, hk, d = 2, 2048, 16, 4, 128
    q = cupy.asarray(randn(rng, (b, 1, hq, d), BF16))
    k, v = (cupy.asarray(randn(rng, (b, s_max, hk, d), BF16)) for _ in range(2))
    lens = cupy.asarray(np.array([2000, 700], np.int32))
    cuattn.decode(q, k, v, lens, num_splits=6)  # compile and load on another stream
    cupy.cuda.Device().synchronize()
    ref = reference.decode(q.get(), k.get(), v.get(), lens.get())
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = cuattn.decode(q, k, v, lens, num_splits=6)
        graph = stream.end_capture()
        for run in ("graph", "eager"):
            _arrival_counters(stream)[...] = 3  # not zero, and below the wrap: a launch would miscount
            if run == "graph":
                graph.launch(stream)
                got = out
            else:
                got = cuattn.decode(q, k, v, lens, num_splits=6)
            stream.synchronize()
            assert np.abs(got.get().astype(np.float64) - ref).max() < 3e-2, run
            assert not _arrival_counters(stream).any(), run


# ---------------------------------------------------------------------------------------------
# merge_states


def _split_attention(rng, dtype, split):
    q = randn(rng, (2, 37, 4, 64), dtype)
    k = randn(rng, (2, 200, 2, 64), dtype)
    v = randn(rng, (2, 200, 2, 64), dtype)
    return q, k, v, [(k[:, a:b], v[:, a:b]) for a, b in zip(split[:-1], split[1:])]


@pytest.mark.gpu
@pytest.mark.parametrize("split", [(0, 90, 200), (0, 0, 200), (0, 17, 150, 200)], ids=["halves", "empty-half", "three"])
@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float32)], ids=DTYPE_IDS + ["fp32"])
def test_merge_states_of_key_splits_equals_attention(rng, dtype, split):
    cupy = _cupy()
    kernel_dtype = dtype if dtype != np.float32 else np.float16
    q, k, v, parts = _split_attention(rng, kernel_dtype, split)
    states = []
    for kp, vp in parts:
        out, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(np.ascontiguousarray(kp)),
                                    cupy.asarray(np.ascontiguousarray(vp)), return_lse=True)
        states.append((out.astype(dtype), lse))
    merged, merged_lse = cuattn.merge_states(*states[0], *states[1]) if len(states) == 2 else cuattn.merge_states(states)
    assert merged.dtype == dtype and merged_lse.dtype == np.float32
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert np.abs(merged.get().astype(np.float64) - ref).max() < 3e-2
    np.testing.assert_allclose(merged_lse.get(), ref_lse, rtol=1e-3, atol=2e-3)


@pytest.mark.gpu
def test_merge_states_all_empty_parts_give_zero_and_minus_inf():
    cupy = _cupy()
    out = cupy.full((1, 3, 2, 32), np.nan, np.float32)  # garbage behind lse = -inf must not leak
    lse = cupy.full((1, 2, 3), -np.inf, np.float32)
    merged, merged_lse = cuattn.merge_states(out, lse, out, lse)
    assert (merged == 0).all() and cupy.isneginf(merged_lse).all()


@pytest.mark.gpu
def test_merge_states_varlen_layout_and_torch(rng):
    torch = pytest.importorskip("torch")
    out_a = torch.randn(50, 4, 64, device="cuda")
    out_b = torch.randn(50, 4, 64, device="cuda")
    lse_a = torch.randn(4, 50, device="cuda")
    lse_b = torch.randn(4, 50, device="cuda")
    before = torch.cuda.memory_allocated()
    merged, lse = cuattn.merge_states(out_a, lse_a, out_b, lse_b)
    assert isinstance(merged, torch.Tensor) and merged.shape == (50, 4, 64) and lse.shape == (4, 50)
    # the results come from torch's caching allocator, not from CuPy's pool
    assert torch.cuda.memory_allocated() - before >= merged.nbytes + lse.nbytes
    ref, ref_lse = reference.merge_states(out_a.cpu().numpy(), lse_a.cpu().numpy(), out_b.cpu().numpy(), lse_b.cpu().numpy())
    np.testing.assert_allclose(merged.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-5, atol=1e-5)


def test_merge_states_numpy_runs_the_reference(rng):
    q, k, v, parts = _split_attention(rng, np.float32, (0, 120, 200))
    states = [cuattn.attention(q, kp, vp, return_lse=True) for kp, vp in parts]
    merged, lse = cuattn.merge_states(states)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(merged, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hint, capacity, expected", [(None, 4096, 4096), (100, 4096, 100), (9000, 4096, 4096),
                                                      (4096, 4096, 4096)])
def test_the_planned_length_is_the_hint_within_the_capacity(hint, capacity, expected):
    """What decode, paged_attention (and its cascade) and the JAX adapters plan their splits for."""
    assert importlib.import_module("cuattn.decode").planned_length(hint, capacity) == expected


def test_max_seq_len_on_the_cpu_path_is_checked_and_changes_no_result(rng):
    """The NumPy path takes max_seq_len (a planning hint) and returns the reference, rows longer
    than the hint included."""
    q = randn(rng, (2, 1, 4, 64), np.float32)
    k = randn(rng, (2, 20, 2, 64), np.float32)
    lens = np.array([20, 5], np.int32)
    out = cuattn.decode(q, k, k, lens, max_seq_len=8)
    np.testing.assert_array_equal(out, reference.decode(q, k, k, lens).astype(np.float32))


def test_decode_numpy_runs_the_reference(rng):
    q = randn(rng, (2, 3, 4, 64), np.float32)
    k = randn(rng, (2, 20, 2, 64), np.float32)
    lens = np.array([20, 5], np.int32)
    out, lse = cuattn.decode(q, k, k, lens, return_lse=True)
    ref, ref_lse = reference.decode(q, k, k, lens, return_lse=True)
    np.testing.assert_array_equal(out, ref.astype(np.float32))
    np.testing.assert_array_equal(lse, ref_lse.astype(np.float32))


@pytest.mark.parametrize(
    "batch, kv_heads, seqlen, per_sm, expected",
    [(1, 8, 32768, 1, 16), (8, 8, 8192, 1, 2), (32, 8, 4096, 1, 1), (64, 8, 2048, 1, 1), (1, 8, 300, 1, 1),
     # two CTAs per SM (paged) when each split still streams 2048 keys, else one
     (8, 8, 8192, 2, 4), (8, 8, 131072, 2, 4), (1, 1, 1 << 20, 2, 128), (1, 8, 32768, 2, 16), (1, 8, 8192, 2, 16)],
)
def test_split_heuristic(batch, kv_heads, seqlen, per_sm, expected):
    from cuattn.decode import choose_num_splits

    assert choose_num_splits(batch, kv_heads, 1, seqlen, 132, per_sm) == expected


@pytest.mark.parametrize(
    "batch, kv_heads, seqlen, per_sm, expected",
    # e4m3: three CTAs per SM with 2048-key splits, else never fewer than two
    [(1, 8, 32768, 3, 33), (8, 8, 8192, 3, 4), (8, 8, 131072, 3, 6), (32, 8, 4096, 3, 1), (1, 8, 300, 3, 1),
     (8, 8, 8192, 1, 2)],
)
def test_split_heuristic_e4m3(batch, kv_heads, seqlen, per_sm, expected):
    from cuattn.decode import E4M3_MIN_CTAS_PER_SM, choose_num_splits

    assert choose_num_splits(batch, kv_heads, 1, seqlen, 132, per_sm, E4M3_MIN_CTAS_PER_SM) == expected


@pytest.mark.parametrize("divisor", list(range(1, 300)) + [1000, 4096, 65535])
def test_fast_divisor_matches_integer_division(divisor):
    from cuattn.decode import fast_divisor

    mul, shift = (int(x) for x in fast_divisor(divisor))
    n = np.concatenate([np.arange(0, 4096), np.random.default_rng(divisor).integers(0, 2**31, 4096),
                        [2**31 - 1, 2**31 - 2, 2**24, 2**24 + 1]]).astype(np.uint64)
    quotient = n if mul == 0 else ((n * np.uint64(mul)) >> np.uint64(32)) >> np.uint64(shift)
    np.testing.assert_array_equal(quotient, n // np.uint64(divisor))


def test_fast_divisor_refuses_zero():
    from cuattn.decode import fast_divisor

    with pytest.raises(ValueError, match="divisor must be >= 1, got 0"):
        fast_divisor(0)


def test_lengths_outside_the_cache_are_clamped_on_the_cpu_path(rng):
    """cache_seqlens is never read on the host for device inputs, so it cannot be refused there;
    both paths read min(max(len, 0), S_max) keys instead."""
    q = randn(rng, (3, 1, 4, 32), np.float32)
    k, v = (randn(rng, (3, 20, 2, 32), np.float32) for _ in range(2))
    out, lse = cuattn.decode(q, k, v, np.array([25, -3, 7], np.int32), return_lse=True)
    ref, ref_lse = cuattn.decode(q, k, v, np.array([20, 0, 7], np.int32), return_lse=True)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, ref_lse)
    assert np.isneginf(lse[1]).all() and not out[1].any()


@pytest.mark.gpu
def test_lengths_outside_the_cache_are_clamped_on_the_gpu_like_the_cpu(rng):
    cupy = _cupy()
    q = randn(rng, (3, 1, 4, 64), np.float16)
    k, v = (randn(rng, (3, 40, 2, 64), np.float16) for _ in range(2))
    lens = np.array([45, -3, 17], np.int32)
    out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(lens), return_lse=True)
    host_out, host_lse = cuattn.decode(q, k, v, lens, return_lse=True)
    check_decode(rng, np.dtype(np.float16), q, k, v, np.clip(lens, 0, 40), out.get(), lse.get())
    assert np.abs(out.get().astype(np.float64) - host_out.astype(np.float64)).max() < 1e-2
    assert np.array_equal(np.isneginf(lse.get()), np.isneginf(host_lse))


@pytest.mark.gpu
def test_no_query_heads_give_empty_results_on_the_gpu_like_the_cpu(rng):
    """Hq = 0 (every Hk divides it): empty out and lse from decode, paged_attention and
    paged_attention_varlen on the GPU, as on the CPU, with no launch of zero row chunks."""
    cupy = _cupy()
    q = randn(rng, (2, 1, 0, 64), np.float16)
    k, v = (randn(rng, (2, 32, 2, 64), np.float16) for _ in range(2))
    lens = np.array([32, 17], np.int32)
    table = np.arange(4, dtype=np.int32).reshape(2, 2)
    pages = tuple(x.reshape(4, 16, 2, 64) for x in (k, v))
    calls = {
        "decode": lambda xp: cuattn.decode(xp.asarray(q), xp.asarray(k), xp.asarray(v), xp.asarray(lens),
                                           return_lse=True),
        "paged_attention": lambda xp: cuattn.paged_attention(xp.asarray(q), tuple(map(xp.asarray, pages)), table, lens,
                                                             return_lse=True),
        "paged_attention_varlen": lambda xp: cuattn.paged_attention_varlen(
            xp.asarray(q[:, 0]), tuple(map(xp.asarray, pages)), table, [0, 1, 2], lens, 1, return_lse=True),
    }
    for name, call in calls.items():
        (host_out, host_lse), (out, lse) = call(np), call(cupy)
        cupy.cuda.get_current_stream().synchronize()
        assert out.shape == host_out.shape and lse.shape == host_lse.shape, name
        assert out.size == 0 and lse.size == 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["slices of one tensor", "unevenly spaced", "mixed strides"])
def test_merge_states_reads_strided_parts_in_place_or_copies_when_it_must(rng, layout):
    cupy = _cupy()
    p, b, s, h, d = 5, 2, 33, 4, 64
    outs = randn(rng, (p, b, s, h, d), np.float32)
    lses = randn(rng, (p, b, h, s), np.float32)
    lses[1, 0, 2] = -np.inf  # a part that saw nothing in one row
    ref, ref_lse = reference.merge_states([(outs[i], lses[i]) for i in range(p)])
    big_out, big_lse = cupy.asarray(outs), cupy.asarray(lses)
    parts = [(big_out[i], big_lse[i]) for i in range(p)]
    if layout == "unevenly spaced":
        parts = parts[:2] + parts[3:] + [parts[2]]
        ref, ref_lse = reference.merge_states([(outs[i], lses[i]) for i in (0, 1, 3, 4, 2)])
    if layout == "mixed strides":
        transposed = cupy.ascontiguousarray(big_out[0].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        parts[0] = (transposed, parts[0][1])
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    before = pool.used_bytes()
    merged, merged_lse = cuattn.merge_states(parts)
    grown = pool.used_bytes() - before
    results = merged.nbytes + merged_lse.nbytes
    if layout == "slices of one tensor":
        assert grown <= results + 1024, f"merge_states copied its parts: {grown} bytes"
    np.testing.assert_allclose(merged.get(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged_lse.get(), ref_lse, rtol=1e-5, atol=1e-5)


def test_alibi_decode_variants_are_listed():
    """Decode with alibi_slopes runs the ALIBI kernels with ALIBI_DECODE_MT tiles of rows; those are
    in kernel_variants (compiled and spill-checked by `python -m cuattn build`) for every head dim."""
    import importlib

    decode_module = importlib.import_module("cuattn.decode")  # the module, not cuattn.decode the function
    listed = {spec.name for spec in decode_module.kernel_variants("sm_80")}
    for dtype in ("float16", "bfloat16"):
        for d in decode_module.TILE_HEAD_DIMS:
            for paged in (False, True):
                assert decode_module.decode_spec(dtype, d, decode_module.ALIBI_DECODE_MT, paged, True).name in listed
                if d in decode_module.wide_tiles(paged):
                    # built for sm_90a alone (the capped ones spill on sm_80)
                    wide = decode_module.decode_spec(dtype, d, 1, paged, True, wide=True).name
                    assert wide not in listed
                    assert wide in {spec.name for spec in decode_module.kernel_variants("sm_90a")}


@pytest.mark.parametrize("rows, mt, alibi, expected", [
    (1, 1, False, True), (8, 1, False, True), (9, 1, False, False), (16, 1, False, False), (4, 2, False, False),
    (4, 1, True, False)])
def test_half_tile_rule(rows, mt, alibi, expected):
    """At most HALF_TILE_ROWS packed rows on one m16 tile, without ALiBi, take the half-tile variant."""
    decode_module = importlib.import_module("cuattn.decode")
    assert decode_module.takes_half_tile(rows, mt, alibi) == expected


def test_half_tile_variants_are_listed():
    """Every default tile has a half-tile variant for each dtype, cache and element type, in
    kernel_variants (built and spill-checked by `python -m cuattn build`), named apart from the
    16-row one."""
    decode_module = importlib.import_module("cuattn.decode")
    listed = {spec.name for spec in decode_module.kernel_variants("sm_90a")}
    for dtype in DTYPES:
        for d in decode_module.TILE_HEAD_DIMS:
            for paged in (False, True):
                for e4m3 in (False, True):
                    half = decode_module.decode_spec(dtype, d, 1, paged, e4m3, half=True)
                    assert half.name.endswith(", 0, 1>") and half.name in listed, half.name
                    assert half.name != decode_module.decode_spec(dtype, d, 1, paged, e4m3).name


@pytest.mark.parametrize("args", [dict(mt=2), dict(e4m3=True, alibi=True), dict(e4m3=True, wide=True)],
                         ids=["two-tiles", "alibi", "wide"])
def test_half_tile_variants_take_one_tile_without_alibi(args):
    decode_module = importlib.import_module("cuattn.decode")
    call = {"dtype": "bfloat16", "head_dim": 128, "mt": 1, "paged": False, **args}
    with pytest.raises(ValueError, match=r"the half-tile decode variants take one m16 tile, no ALiBi and the "
                                         r"default tiles; got mt \d, alibi (True|False), wide (True|False)"):
        decode_module.decode_spec(**call, half=True)


@pytest.mark.gpu
@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16-cache", "e4m3-cache"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("gqa, sq_new, half", [((8, 1), 1, True), ((4, 1), 2, True), ((3, 1), 3, False),
                                               ((1, 1), 8, True), ((16, 1), 1, False)],
                         ids=["8rows", "4x2rows", "9rows", "mha-8tokens", "16rows"])
def test_calls_of_at_most_8_rows_run_the_half_tile(rng, launched_kernels, gqa, sq_new, half, paged, e4m3):
    """The dispatcher launches the half-tile variant exactly where the call packs at most 8 rows
    (its rows 8-15 are padding, their softmax skipped), long-stage or not, and its output matches
    the reference: NaN past each cache length, ragged lengths, several splits."""
    decode_module = importlib.import_module("cuattn.decode")
    hq, hk = gqa
    s_max, block, lens = 608, 16, [608, 200, 1]
    if e4m3:
        from test_fp8 import run_fp8_decode

        run_fp8_decode(rng, BF16, 3, sq_new, hq, hk, 128, s_max, lens, True, paged_block=block if paged else None,
                       num_splits=3)
    elif paged:
        # the caches of run_decode as shuffled pages
        cupy = _cupy()
        q = randn(rng, (3, sq_new, hq, 128), BF16)
        k, v = make_cache(rng, BF16, 3, s_max, hk, 128, lens)
        table = rng.permutation(3 * s_max // block).astype(np.int32).reshape(3, -1)
        pages_k, pages_v = (np.empty((3 * s_max // block, block, hk, 128), x.dtype) for x in (k, v))
        pages_k[table.reshape(-1)] = k.reshape(-1, block, hk, 128)
        pages_v[table.reshape(-1)] = v.reshape(-1, block, hk, 128)
        out, lse = cuattn.paged_attention(cupy.asarray(q), (cupy.asarray(pages_k), cupy.asarray(pages_v)),
                                          cupy.asarray(table), cupy.asarray(np.asarray(lens, np.int32)),
                                          return_lse=True, num_splits=3)
        check_decode(rng, BF16, q, k, v, np.asarray(lens, np.int32), out.get(), lse.get())
    else:
        run_decode(rng, BF16, 3, sq_new, hq, hk, 128, s_max, lens, num_splits=3)
    rows = hq // hk * sq_new
    mt = 1 if rows <= 16 else 2
    # three sequences fit one wave of the long-stage variant where the call has one (paged e4m3)
    long = decode_module.has_long_variant(128, mt, paged, e4m3)
    spec = decode_module.decode_spec(BF16, 128, mt, paged, e4m3, half=half, long=long)
    assert spec.name in launched_kernels, launched_kernels


@pytest.mark.parametrize("ctas, paged, expected", [
    (396, True, False), (400, True, True), (512, True, True), (528, True, True), (529, True, False),
    (640, True, False), (1024, True, False), (400, False, True), (1024, False, True), (396, False, False)])
def test_wide_variant_rule(ctas, paged, expected):
    """The wide variant runs where the default (3 CTAs an SM on 132 SMs here) needs more than one
    wave; over pages (2 CTAs an SM) only while it needs at most two waves itself (measured on the
    H200: 400 and 512 CTAs faster, 640 and more slower)."""
    decode_module = importlib.import_module("cuattn.decode")
    wide_per_sm = 2 if paged else 4
    assert decode_module.use_wide_variant(ctas, 3, lambda: wide_per_sm, 132, paged) == expected


def test_wide_decode_variants_take_e4m3_caches_alone():
    import importlib

    decode_module = importlib.import_module("cuattn.decode")
    spec = decode_module.decode_spec("bfloat16", 128, 1, False, True, wide=True)
    assert spec.name.endswith(f", {decode_module.E4M3_WIDE_MIN_CTAS}>")
    assert decode_module.decode_spec("bfloat16", 128, 1, False, True).name.endswith(", 0>")
    # the paged one: no launch bound, a deeper ring than the default's
    paged = decode_module.decode_spec("bfloat16", 128, 1, True, True, wide=True)
    stages = decode_module.E4M3_WIDE_PAGED_DECODE_TILES[128].stages
    assert stages > decode_module.DECODE_TILES[128].stages
    assert paged.name.startswith("cuattn::paged_decode_kernel") and paged.name.endswith(f", 1, {stages}, false, 0>")
    for args in (dict(e4m3=False), dict(e4m3=True, alibi=True), dict(e4m3=True, mt=2), dict(e4m3=True, head_dim=64),
                 dict(e4m3=True, paged=True, alibi=True), dict(e4m3=False, paged=True)):
        call = {"dtype": "bfloat16", "head_dim": 128, "mt": 1, "paged": False, **args}
        with pytest.raises(ValueError, match=r"the wide decode variants take e4m3 caches without ALiBi at tile head "
                                             r"dims \[128\] \(contiguous\) and \[128\] \(paged\)"):
            decode_module.decode_spec(**call, wide=True)


@pytest.mark.gpu
@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "pages16"])
def test_an_empty_batch_decodes_to_empty_outputs(e4m3, paged):
    """A decode of no sequences (B = 0; the split choice then has no CTAs to divide by) returns
    empty out and lse of the batch's shapes, as the NumPy path does."""
    cupy = _cupy()
    hq, hk, d, s_max = 8, 2, 128, 64
    cache_dtype = np.uint8 if e4m3 else BF16
    scales = {"k_scale": 0.01, "v_scale": 0.01} if e4m3 else {}
    q = np.zeros((0, 1, hq, d), BF16)
    lens = np.zeros((0,), np.int32)
    if paged:
        table = np.zeros((0, s_max // 16), np.int32)
        pages = np.zeros((4, 16, hk, d), cache_dtype)
        args = (q, (pages, pages), table, lens)
        run = cuattn.paged_attention
    else:
        cache = np.zeros((0, s_max, hk, d), cache_dtype)
        args = (q, cache, cache, lens)
        run = cuattn.decode
    for xp in (np, cupy):
        inputs = [tuple(xp.asarray(y) for y in x) if isinstance(x, tuple) else xp.asarray(x) for x in args]
        out, lse = run(*inputs, return_lse=True, **scales)
        assert out.shape == (0, 1, hq, d) and lse.shape == (0, hq, 1), (xp.__name__, out.shape, lse.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("hint", [None, 96, 600, 5000], ids=["none", "below-a-length", "above-the-lengths", "past-S_max"])
def test_max_seq_len_plans_the_splits_and_every_key_still_counts(rng, monkeypatch, e4m3, hint):
    """decode's max_seq_len is the length the split count plans for, min(hint, S_max) (S_max
    without one), as paged_attention's is; a row longer than the hint still attends to all of its
    keys (NaN past each length, a length of 0), so the output matches the reference either way."""
    decode_module = importlib.import_module("cuattn.decode")
    planned = []
    choose = decode_module.choose_num_splits

    def recording(batch, num_kv_heads, row_chunks, max_seqlen, *args):
        planned.append(max_seqlen)
        return choose(batch, num_kv_heads, row_chunks, max_seqlen, *args)

    monkeypatch.setattr(decode_module, "choose_num_splits", recording)
    s_max, lens = 1024, [517, 1024, 0, 90]
    if e4m3:
        from test_fp8 import run_fp8_decode

        run_fp8_decode(rng, BF16, 4, 1, 8, 2, 128, s_max, lens, True, max_seq_len=hint)
    else:
        run_decode(rng, BF16, 4, 1, 8, 2, 128, s_max, lens, max_seq_len=hint)
    assert planned and set(planned) == {min(hint or s_max, s_max)}, planned


@pytest.mark.gpu
def test_an_over_allocated_e4m3_cache_takes_the_long_stage_under_a_max_seq_len(rng, launched_kernels):
    """A contiguous e4m3 cache allocated far past its sequences (S_max 32k, rows of at most 8k, 64
    CTAs a split) plans on S_max without a hint: splits of 16k keys each, past the long stage's
    rule, so the default stage runs. max_seq_len=8192 plans splits of 4k keys, which the long
    stage takes where one wave holds its CTAs (one an SM); the outputs agree either way."""
    cupy = _cupy()
    decode_module = importlib.import_module("cuattn.decode")
    from cuattn import _jit

    b, hq, hk, d, s_max, longest = 8, 32, 8, 128, 32768, 8192
    lens = cupy.asarray(rng.integers(longest // 2, longest + 1, b).astype(np.int32))
    q = cupy.asarray(randn(rng, (b, 1, hq, d), BF16))
    # e4m3 bytes of magnitude below 2 (exponent field below 8), either sign: no NaN byte
    k8, v8 = (cupy.asarray((rng.integers(0, 0x40, (b, s_max, hk, d)) | rng.integers(0, 2, (b, s_max, hk, d)) << 7)
                           .astype(np.uint8)) for _ in range(2))
    scales = {"k_scale": 0.5, "v_scale": 0.5}
    plain = cuattn.decode(q, k8, v8, lens, **scales)
    half = decode_module.takes_half_tile(hq // hk, 1, False)  # 4 rows a KV head
    default = decode_module.decode_spec(BF16, d, 1, False, True, half=half)
    long_spec = decode_module.decode_spec(BF16, d, 1, False, True, half=half, long=True)
    assert launched_kernels == [default.name]
    hinted = cuattn.decode(q, k8, v8, lens, max_seq_len=longest, **scales)
    one_wave = b * hk * 2 <= _jit.multiprocessor_count()  # two splits of 4k keys, one CTA an SM
    assert launched_kernels[1:] == [long_spec.name if one_wave else default.name], launched_kernels
    # the two split the keys differently: bf16 rounding of the output apart
    plain32 = plain.astype(cupy.float32)
    assert float(cupy.abs(hinted.astype(cupy.float32) - plain32).max()) <= 2 ** -7 * float(cupy.abs(plain32).max())
