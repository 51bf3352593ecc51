"""Backward on the GPU against the float64 reference backward (the 3x tolerance rule) and torch autograd.

Fresh random inputs every run; the forward's own out and lse feed the backward, as in training.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

import cuattn
from cuattn import _registry, reference
from conftest import BF16, DTYPE_IDS, DTYPES, check_dsinks, check_varlen_gradients, error_budget, prefix_sums, randn

HEAD_DIMS = list(_registry.test_head_dims("attention"))
MASKS = _registry.MASK_OPTIONS


def run_backward(rng, dtype, b, sq, sk, hq, hk, d, deterministic=False, **options):
    import cupy

    q, k, v = (randn(rng, shape, dtype) for shape in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = randn(rng, (b, sq, hq, d), dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuattn.attention(qd, kd, vd, return_lse=True, **options)
    dq, dk, dv = cuattn.attention_backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, **options)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **options)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=dtype, **options)
    for name, got, ref, low in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naive):
        got = got.get().astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), dtype, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", ["full", "causal", "softcap-causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_with_sinks(rng, head_dim, mask, deterministic):
    """dq, dk, dv and dsinks under the 3x rule. dsinks = -sum over a head's rows of
    exp(sink - lse) * delta: its straightforward same-precision value takes delta from the
    low-precision forward output (delta = rowsum(dout * out), with out rounded to bf16)."""
    import cupy

    b, sq, sk, hq, hk = 2, 113, 203, 4, 2
    options = MASKS[mask]
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    q, k, v = (randn(rng, shape, BF16) for shape in ((b, sq, hq, head_dim), (b, sk, hk, head_dim), (b, sk, hk, head_dim)))
    dout = randn(rng, (b, sq, hq, head_dim), BF16)
    qd, kd, vd, dod, sd = (cupy.asarray(x) for x in (q, k, v, dout, sinks))
    out, lse = cuattn.attention(qd, kd, vd, sinks=sd, return_lse=True, **options)
    grads = cuattn.attention_backward(dod, qd, kd, vd, out, lse, sinks=sd, deterministic=deterministic, **options)
    assert len(grads) == 4 and grads[3].dtype == np.float32 and grads[3].shape == (hq,)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, sinks=sinks, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, sinks=sinks, **options)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=BF16, sinks=sinks, **options)
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, refs, naive):
        got = got.get().astype(np.float64)
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), BF16, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    out_lowp = reference.naive_attention_lowp(q, k, v, dtype=BF16, sinks=sinks, **options)
    check_dsinks(rng, BF16, grads[3].get(), refs[3], dout, sinks, ref_out, ref_lse, out_lowp)
    if deterministic:
        again = cuattn.attention_backward(dod, qd, kd, vd, out, lse, sinks=sd, deterministic=True, **options)
        assert all(cupy.array_equal(x, y) for x, y in zip(grads, again))


@pytest.mark.gpu
@pytest.mark.parametrize("per_sequence", [False, True], ids=["Hq", "B-Hq"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap-causal"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_backward_with_alibi(rng, head_dim, mask, deterministic, per_sequence):
    """dq, dk, dv under the 3x rule with ALiBi (every backward kernel: mma.sync, the Hopper one
    at 64, 80, 96 and 128, the deterministic dQ one); the slopes get no gradient."""
    import cupy

    b, sq, sk, hq, hk = 2, 113, 203, 4, 2
    options = MASKS[mask]
    slopes = 2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)
    slopes = (slopes * np.array([[1.0], [0.5]]) if per_sequence else slopes).astype(np.float32)
    q, k, v = (randn(rng, shape, BF16) for shape in ((b, sq, hq, head_dim), (b, sk, hk, head_dim), (b, sk, hk, head_dim)))
    dout = randn(rng, (b, sq, hq, head_dim), BF16)
    qd, kd, vd, dod, ad = (cupy.asarray(x) for x in (q, k, v, dout, slopes))
    out, lse = cuattn.attention(qd, kd, vd, alibi_slopes=ad, return_lse=True, **options)
    grads = cuattn.attention_backward(dod, qd, kd, vd, out, lse, alibi_slopes=ad, deterministic=deterministic,
                                      **options)
    assert len(grads) == 3
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, alibi_slopes=slopes, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, alibi_slopes=slopes, **options)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=BF16, alibi_slopes=slopes, **options)
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, refs, naive):
        got = got.get().astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), BF16, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_dtype_head_dim_mask(rng, dtype, head_dim, mask, deterministic):
    run_backward(rng, dtype, 2, 113, 203, 4, 2, head_dim, deterministic=deterministic, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (100, 3), "softcap": 20.0}],
                         ids=["full", "causal", "window-softcap"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_deterministic_backward_is_bit_identical(rng, head_dim, options):
    """(On sm_90a, full masks order the dQ reductions by ascending key block, bounded right window
    sides by descending ones: both orders are here.)"""
    import cupy

    q, k, v, dout = (cupy.asarray(randn(rng, shape, BF16)) for shape in
                     ((2, 777, 8, head_dim), (2, 1031, 2, head_dim), (2, 1031, 2, head_dim), (2, 777, 8, head_dim)))
    out, lse = cuattn.attention(q, k, v, return_lse=True, **options)
    first = cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for _ in range(3):
        again = cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} differs between runs"
    # and the atomic default agrees with it to rounding
    atomic = cuattn.attention_backward(dout, q, k, v, out, lse, **options)
    for a, b in zip(first, atomic):
        assert float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max()) < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("dq_mode", ["bulk", "atomic"])
def test_sm90_dq_modes(rng, request, dq_mode, head_dim, mask, deterministic):
    """Both dQ paths of flash_bwd_sm90_kernel (BwdTile.dq_mode, forced whatever the dispatcher
    would pick: bulk is ordered when deterministic, atomic then leaves dQ to
    flash_bwd_dq_kernel; cuattn.bench.cases.forced_bwd_dq_mode, which also clears the plans a
    call remembers) under the 3x rule, with several key blocks per query block and several
    query heads per kv head (so several CTAs reduce into each dQ tile, in order when
    deterministic, and bit-identical run to run then)."""
    import contextlib
    import importlib

    import cupy

    from cuattn import _jit
    from cuattn.bench.cases import forced_bwd_dq_mode

    attention_module = importlib.import_module("cuattn.attention")
    arch = _jit.target_arch()
    if attention_module.arch_family(arch) != attention_module.SM90:
        pytest.skip(f"flash_bwd_sm90_kernel needs sm_90a, this GPU is {arch}")
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    stack.enter_context(forced_bwd_dq_mode(dq_mode))
    assert attention_module.bwd_tile(head_dim, arch, deterministic).dq_mode == dq_mode
    run_backward(rng, BF16, 2, 300, 517, 8, 2, head_dim, deterministic=deterministic, **MASKS[mask])
    if deterministic:
        q, k, v, dout = (cupy.asarray(randn(rng, shape, BF16)) for shape in
                         ((1, 640, 4, head_dim), (1, 900, 2, head_dim), (1, 900, 2, head_dim), (1, 640, 4, head_dim)))
        out, lse = cuattn.attention(q, k, v, return_lse=True, **MASKS[mask])
        first = cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **MASKS[mask])
        for _ in range(3):
            again = cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **MASKS[mask])
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), f"{name} differs between runs"



def test_forced_bwd_dq_mode_forces_and_restores():
    """forced_bwd_dq_mode (the benchmarks' and test_sm90_dq_modes' way to pick a dQ path): inside
    it every wgmma tile without ALiBi's own path takes the mode, remembered plans are cleared on
    entry and exit, and everything is as before afterwards; an unknown mode is refused."""
    import importlib

    from cuattn import _calls
    from cuattn.bench.cases import forced_bwd_dq_mode

    attention_module = importlib.import_module("cuattn.attention")
    before = {(d, det, alibi): attention_module.bwd_tile(d, "sm_90a", det, alibi)
              for d in (64, 80, 96, 128) for det in (False, True) for alibi in (False, True)}
    for mode in ("atomic", "bulk"):
        _calls.remember(("a call",), object())
        with forced_bwd_dq_mode(mode):
            assert _calls._plans == {}
            _calls.remember(("a call",), object())
            for (d, det, alibi), tile in before.items():
                forced = attention_module.bwd_tile(d, "sm_90a", det, alibi)
                keeps = not tile.wgmma or alibi
                assert forced == (tile if keeps else dataclasses.replace(tile, dq_mode=mode))
        assert _calls._plans == {}
        assert all(attention_module.bwd_tile(d, "sm_90a", det, alibi) == tile for (d, det, alibi), tile in before.items())
    # the wide tile has float4 atomics alone: forcing bulk leaves it be
    wide = attention_module.bwd_tile(256, "sm_90a")
    assert attention_module.bwd_dq_modes(wide, 256) == ("atomic",) and wide.dq_mode == "atomic"
    with forced_bwd_dq_mode("bulk"):
        assert attention_module.bwd_tile(256, "sm_90a") == wide
    with pytest.raises(ValueError, match="mode must be one of"):
        with forced_bwd_dq_mode("ordered"):
            pass

def test_sm90_backward_maps_refuse_broadcast_views():
    """flash_bwd_sm90_kernel reads q, k, v and dout through TMA maps (_bwd_maps): four of them for
    ordinary views; none (the call then takes the mma.sync tile) for a view the TMA cannot read,
    such as k broadcast over the batch (stride 0, which the kernels' layout check allows)."""
    import importlib

    attention_module = importlib.import_module("cuattn.attention")
    tile = attention_module.bwd_tile(128, "sm_90a")
    q, dout = (np.zeros((2, 96, 4, 128), np.float16) for _ in range(2))
    k, v = (np.zeros((2, 80, 2, 128), np.float16) for _ in range(2))
    maps = attention_module._bwd_maps(q, k, v, dout, tile)
    assert [field for field, _, _ in maps] == ["q_map", "k_map", "v_map", "do_map"]
    assert [role for _, role, _ in maps] == ["q", "k", "v", "dout"]
    # boxes of BLOCK_M query rows and kBwdSm90BlockN key rows, one 128-byte panel wide
    assert [layout.box for _, _, layout in maps] == [(64, tile.block_m, 1, 1), (64, 128, 1, 1), (64, 128, 1, 1),
                                                     (64, tile.block_m, 1, 1)]
    broadcast_k = np.broadcast_to(k[:1], k.shape)
    assert attention_module._bwd_maps(q, broadcast_k, v, dout, tile) == ()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_of_broadcast_views(rng, head_dim):
    """k and v broadcast over the batch (stride 0): on sm_90a no TMA map takes them, so the call
    runs the mma.sync backward; dq, dk, dv (one per batch entry of the views) under the 3x rule."""
    import cupy

    b, sq, sk, hq, hk = 2, 150, 203, 4, 2
    q, dout = (randn(rng, (b, sq, hq, head_dim), BF16) for _ in range(2))
    k1, v1 = (randn(rng, (1, sk, hk, head_dim), BF16) for _ in range(2))
    k, v = (np.broadcast_to(x, (b, sk, hk, head_dim)) for x in (k1, v1))
    qd, dod = cupy.asarray(q), cupy.asarray(dout)
    kd, vd = (cupy.broadcast_to(cupy.asarray(x), (b, sk, hk, head_dim)) for x in (k1, v1))
    assert kd.strides[0] == 0
    out, lse = cuattn.attention(qd, kd, vd, return_lse=True, causal=True)
    grads = cuattn.attention_backward(dod, qd, kd, vd, out, lse, causal=True)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, causal=True)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=BF16, causal=True)
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, refs, naive):
        got = got.get().astype(np.float64)
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), BF16, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"

LENGTHS = [(1, 1), (17, 17), (203, 113), (113, 203), (1023, 1023), (130, 257)]
GQA = [(4, 4), (8, 2), (8, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("gqa", GQA, ids=[f"{a}q{b}kv" for a, b in GQA])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
def test_backward_lengths_and_gqa(rng, lengths, causal, gqa, deterministic):
    # Sq > Sk with causal leaves the first Sq - Sk rows with no key: their dq must be 0
    run_backward(rng, BF16, 1, lengths[0], lengths[1], gqa[0], gqa[1], 128, deterministic=deterministic,
                 causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("lengths", [(203, 113), (113, 203)], ids=["sq>sk", "sq<sk"])
def test_backward_window_both_alignments(rng, lengths, deterministic):
    run_backward(rng, BF16, 2, lengths[0], lengths[1], 4, 2, 64, deterministic=deterministic, window=(37, 5))


@pytest.fixture
def poisoned_allocations():
    """CuPy allocations filled with 0xFF bytes (float32 NaN) before the caller sees them, for the
    length of the test: workspace a kernel reads before writing shows."""
    import cupy

    pool = cupy.cuda.MemoryPool()

    def malloc(size):
        memory = pool.malloc(size)
        cupy.cuda.runtime.memset(memory.ptr, 0xFF, size)
        return memory

    cupy.cuda.set_allocator(malloc)
    yield
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    pool.free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(20, 0))], ids=["causal", "window"])
@pytest.mark.parametrize("dq_mode, head_dim", [(None, 32), (None, 64), (None, 128), ("atomic", 64), ("atomic", 128)],
                         ids=["32", "64", "128", "atomic-64", "atomic-128"])
def test_backward_on_poisoned_workspace(rng, request, poisoned_allocations, dq_mode, head_dim, options, deterministic):
    """No dQ accumulator is zeroed by a memset: the ordered bulk one needs no zeros (each tile
    part's first reduction stores, and the convert reads a part no key block reached as zeros),
    and bwd_preprocess_kernel zeroes the ones atomics or unordered bulk reductions add into
    (D = 32: the mma.sync kernels' atomics; "atomic": the sm_90a kernel's float4 atomics, forced).
    With Sq > Sk bottom-right, the first Sq - Sk query rows see no key (three whole 64-row query
    blocks here); every new array starts as NaN bytes, and dq must still match."""
    if dq_mode is not None:
        import contextlib

        from cuattn import _jit
        from cuattn.bench.cases import forced_bwd_dq_mode

        attention_module = sys.modules["cuattn.attention"]
        if attention_module.arch_family(_jit.target_arch()) != attention_module.SM90:
            pytest.skip(f"the dQ modes are flash_bwd_sm90_kernel's, which needs sm_90a, this GPU is {_jit.target_arch()}")
        stack = contextlib.ExitStack()
        request.addfinalizer(stack.close)
        stack.enter_context(forced_bwd_dq_mode(dq_mode))
    run_backward(rng, BF16, 2, 333, 90, 4, 2, head_dim, deterministic=deterministic, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 72])
def test_gradients_are_written_inside_their_views_only(rng, d):
    """Gradient buffers that are views of larger NaN-filled arrays (more rows, more columns), as
    the JAX adapter passes XLA's: dk and dv (which the sm_90a kernel stores through tensor maps of
    the views at D = 64 and 128, rows past Sk and columns past D outside them; D = 72 keeps its
    32-bit stores) equal the public call's bit for bit, dq matches it, and nothing outside the
    views is written. Sk off every key block, GQA, causal and not."""
    import cupy

    from cuattn import _arrays

    attention_module = sys.modules["cuattn.attention"]
    b, sq, sk, hq, hk = 2, 150, 90, 4, 2
    q, dout = (cupy.asarray(randn(rng, (b, sq, hq, d), BF16)) for _ in range(2))
    k, v = (cupy.asarray(randn(rng, (b, sk, hk, d), BF16)) for _ in range(2))
    for causal in (False, True):
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        expected = cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal)
        buffers = [cupy.full((b, rows + 9, heads, d + 8), np.nan, dtype=BF16) for rows, heads in
                   ((sq, hq), (sk, hk), (sk, hk))]
        views = tuple(x[:, :rows, :, :d] for x, rows in zip(buffers, (sq, sk, sk)))
        with _arrays.array_context(q=q) as ctx:
            got = attention_module._launch_bwd(dout, q, k, v, out, lse, None, None, batch=b, seqlen_q=sq, seqlen_k=sk,
                                               causal=causal, scale=None, window=(-1, -1), softcap=0.0,
                                               deterministic=False, ctx=ctx, grads=views)
        assert all(g is view for g, view in zip(got, views))
        for name, g, e in zip(("dk", "dv"), got[1:], expected[1:]):
            assert bool((g.view(cupy.uint16) == e.view(cupy.uint16)).all()), name
        np.testing.assert_allclose(got[0].get().astype(np.float32), expected[0].get().astype(np.float32),
                                   rtol=1e-2, atol=1e-2)
        for name, buffer, rows in zip(("dq", "dk", "dv"), buffers, (sq, sk, sk)):
            host = buffer.get()
            assert np.isnan(host[:, rows:]).all() and np.isnan(host[..., d:]).all(), f"{name} written outside its view"


@pytest.mark.gpu
def test_backward_strided_views_match_contiguous(rng):
    import cupy

    b, h, s, d = 2, 4, 129, 64
    q, k, v, do = (cupy.asarray(randn(rng, (b, h, s, d), np.float16)).transpose(0, 2, 1, 3) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    # deterministic: the same sums in the same order, so strided and dense agree bit for bit
    strided = cuattn.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=True)
    dense = cuattn.attention_backward(*(cupy.ascontiguousarray(x) for x in (do, q, k, v, out)), lse, causal=True,
                                      deterministic=True)
    for name, a, b_ in zip(("dq", "dk", "dv"), strided, dense):
        assert bool((a.view(cupy.uint16) == b_.view(cupy.uint16)).all()), name


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 40, 80, 104])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_backward_matches_per_sequence_reference(rng, deterministic, causal, d):
    """(On sm_90a the bulk dQ path puts each sequence's query blocks on their own accumulator
    tiles: a sequence of 1, of 0 and of more than one tile sit side by side here.)"""
    import cupy

    # a sequence with no queries, one with no keys (its queries' dq is 0), one longer than a tile;
    # d = 40 and 104 run padded in the 64 and 128 tiles (on sm_90a the wgmma kernel's TMA reads
    # zeros past their D), 80 in the 96 tile elsewhere
    lens_q, lens_k = [1, 17, 113, 0, 203, 7], [5, 17, 300, 9, 203, 0]
    hq, hk = 4, 2
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    q = randn(rng, (cu_q[-1], hq, d), np.float16)
    k = randn(rng, (cu_k[-1], hk, d), np.float16)
    v = randn(rng, (cu_k[-1], hk, d), np.float16)
    dout = randn(rng, q.shape, np.float16)
    args = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lens_q), max(lens_k))
    out, lse = cuattn.attention_varlen(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), *args, causal=causal,
                                       return_lse=True)
    grads = cuattn.attention_varlen_backward(cupy.asarray(dout), cupy.asarray(q), cupy.asarray(k), cupy.asarray(v),
                                             out, lse, *args, causal=causal, deterministic=deterministic)
    check_varlen_gradients(rng, np.float16, dout, q, k, v, cu_q, cu_k, [g.get() for g in grads], causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_varlen_backward_with_sinks_counts_only_rows_of_a_sequence(rng, deterministic):
    """Sinks through the varlen backward: dq, dk, dv and dsinks per sequence under the 3x rule,
    with q and dout padded past cu_seqlens_q[-1] by rows of other finite values and out and lse
    by NaN (a caller's padded batch: the forward leaves such rows of out and lse unwritten). Those
    rows get dq = 0 and add nothing to dsinks."""
    import cupy

    lens_q, lens_k, pad = [5, 0, 17, 6, 131], [9, 3, 17, 0, 140], 7
    hq, hk, d = 4, 2, 64
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    total_q = int(cu_q[-1])
    q, dout = randn(rng, (total_q, hq, d), BF16), randn(rng, (total_q, hq, d), BF16)
    k, v = randn(rng, (cu_k[-1], hk, d), BF16), randn(rng, (cu_k[-1], hk, d), BF16)
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)

    def padded(x, fill):
        return cupy.asarray(np.concatenate([x, fill((pad, *x.shape[1:])).astype(x.dtype)]))

    noise = lambda shape: rng.standard_normal(shape) * 100  # noqa: E731
    args = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lens_q), max(lens_k))
    qd, dod = padded(q, noise), padded(dout, noise)
    out = padded(np.zeros_like(q), lambda shape: np.full(shape, np.nan))
    _, lse = cuattn.attention_varlen(qd, cupy.asarray(k), cupy.asarray(v), *args, sinks=cupy.asarray(sinks), out=out,
                                     return_lse=True)
    lse[:, total_q:] = cupy.nan
    grads = cuattn.attention_varlen_backward(dod, qd, cupy.asarray(k), cupy.asarray(v), out, lse, *args,
                                             sinks=cupy.asarray(sinks), deterministic=deterministic)
    dq, dk, dv, dsinks = (g.get() for g in grads)
    assert not dq[total_q:].astype(np.float32).any(), "rows of no sequence must get dq = 0"
    check_varlen_gradients(rng, BF16, dout, q, k, v, cu_q, cu_k, (dq[:total_q], dk, dv, dsinks), sinks=sinks)


@pytest.mark.gpu
def test_backward_matches_torch_autograd(rng):
    torch = pytest.importorskip("torch")
    b, s, hq, hk, d = 2, 257, 8, 2, 128
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    expected.backward(dout)
    with torch.no_grad():
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        before = torch.cuda.memory_allocated()
        dq, dk, dv = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
        # the gradients come from torch's caching allocator, not from CuPy's pool
        assert torch.cuda.memory_allocated() - before >= sum(g.nbytes for g in (dq, dk, dv))
        assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    to64 = lambda x: x.detach().float().cpu().numpy().astype(np.float64)  # noqa: E731
    ref_out, ref_lse = reference.attention(to64(q), to64(k), to64(v), causal=True, return_lse=True)
    refs = reference.attention_backward(to64(dout), to64(q), to64(k), to64(v), ref_out, ref_lse, causal=True)
    naives = reference.naive_attention_backward_lowp(to64(dout), to64(q), to64(k), to64(v), causal=True, dtype=BF16)
    for name, ours, theirs, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), (q.grad, k.grad, v.grad), refs,
                                              naives):
        ours_err = np.abs(to64(ours) - ref).max()
        torch_err = np.abs(to64(theirs) - ref).max()
        # the 3x rule, over the larger of the naive backward's error and torch's
        budget = error_budget(max(np.abs(naive - ref).max(), torch_err), BF16, 3.0, np.abs(ref).max())
        assert ours_err <= budget, f"{name}: cuattn {ours_err:.3g} vs torch {torch_err:.3g}"


def test_backward_numpy_runs_the_reference(rng):
    q = randn(rng, (1, 9, 4, 32), np.float32)
    k = randn(rng, (1, 11, 2, 32), np.float32)
    dout = randn(rng, q.shape, np.float32)
    out, lse = cuattn.attention(q, k, k, causal=True, return_lse=True)
    grads = cuattn.attention_backward(dout, q, k, k, out, lse, causal=True)
    refs = reference.attention_backward(dout, q, k, k, out, lse, causal=True)
    for got, ref in zip(grads, refs):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ref.astype(np.float32))


def test_naive_lowp_backward_is_close_but_not_exact(rng):
    q = randn(rng, (1, 40, 2, 64), np.float32)
    k = randn(rng, (1, 50, 1, 64), np.float32)
    dout = randn(rng, q.shape, np.float32)
    out, lse = reference.attention(q, k, k, causal=True, return_lse=True)
    refs = reference.attention_backward(dout, q, k, k, out, lse, causal=True)
    low = reference.naive_attention_backward_lowp(dout, q, k, k, causal=True, dtype=np.float16)
    for a, b in zip(low, refs):
        err = np.abs(a - b).max()
        assert 0 < err < 5e-2


def test_backward_errors():
    q = np.zeros((1, 5, 4, 64), np.float32)
    k = np.zeros((1, 7, 2, 64), np.float32)
    lse = np.zeros((1, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"dout.shape must equal q.shape = \(1, 5, 4, 64\), got \(1, 4, 4, 64\)"):
        cuattn.attention_backward(q[:, :4], q, k, k, q, lse)
    with pytest.raises(ValueError, match=r"lse.shape must be \(1, 4, 5\) \(the forward's lse\), got \(1, 5, 4\)"):
        cuattn.attention_backward(q, q, k, k, q, lse.transpose(0, 2, 1))
    q12, k12 = np.zeros((1, 5, 4, 12), np.float32), np.zeros((1, 7, 2, 12), np.float32)
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head_dim\) = 12 is not supported: head_dim must be a "
                                         r"multiple of 8 from 8 to 256"):
        cuattn.attention_backward(q12, q12, k12, k12, q12, lse)


@pytest.mark.gpu
def test_backward_device_errors():
    import cupy

    q = cupy.zeros((1, 5, 4, 64), cupy.float16)
    k = cupy.zeros((1, 7, 2, 64), cupy.float16)
    lse = cupy.zeros((1, 4, 5), cupy.float32)
    with pytest.raises(TypeError, match=r"lse.dtype must be float32 \(the forward's lse\), got float16"):
        cuattn.attention_backward(q, q, k, k, q, lse.astype(cupy.float16))
    with pytest.raises(TypeError, match=r"dout.dtype must equal q.dtype = float16, got float32"):
        cuattn.attention_backward(q.astype(cupy.float32), q, k, k, q, lse)


def test_varlen_backward_errors():
    q = np.zeros((9, 4, 64), np.float32)
    k = np.zeros((11, 2, 64), np.float32)
    lse = np.zeros((4, 9), np.float32)
    cu_q, cu_k = np.array([0, 9], np.int32), np.array([0, 11], np.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q.shape\[0\] \(B \+ 1\) must be at least 2, got 1"):
        cuattn.attention_varlen_backward(q, q, k, k, q, lse, cu_q[:1], cu_k[:1], 9, 11)
    with pytest.raises(TypeError, match=r"max_seqlen_k must be an int >= 0, got None"):
        cuattn.attention_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 9, None)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal k.shape\[0\] \(total_k\) = 11, got 10"):
        cuattn.attention_varlen_backward(q, q, k, k, q, lse, cu_q, np.array([0, 10], np.int32), 9, 11)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 4 is below the longest sequence, 9"):
        cuattn.attention_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 4, 11)
    with pytest.raises(ValueError, match=r"lse.shape must be \(4, 9\) \(the forward's lse\), got \(9, 4\)"):
        cuattn.attention_varlen_backward(q, q, k, k, q, lse.T, cu_q, cu_k, 9, 11)


# What one CTA may ask for (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100 and H100/H200.
SMEM_PER_BLOCK = {"sm_80": 166912, "sm_90a": 232448}


@pytest.mark.parametrize("arch", list(SMEM_PER_BLOCK))
def test_backward_tiles_fit_their_arch(arch):
    import importlib

    attention_module = importlib.import_module("cuattn.attention")
    for d in attention_module.SUPPORTED_HEAD_DIMS:
        default, tile_dim = attention_module.bwd_tile(d, arch), attention_module.bwd_tile_dim(d, arch)
        # every dQ path of the tile (the wgmma kernel's bulk one stages a dQ tile in shared memory)
        for mode in attention_module.bwd_dq_modes(default, tile_dim):
            tile = dataclasses.replace(default, dq_mode=mode)
            # fp16 and bf16 both take 2 bytes; the kernels' shared memory is sized by the tile head dim
            assert tile.smem_bytes(tile_dim, 2) <= SMEM_PER_BLOCK[arch], (d, tile)
            assert tile.dq_smem_bytes(tile_dim, 2) <= SMEM_PER_BLOCK[arch], (d, tile)


def test_backward_tiles_cover_the_forward_head_dims():
    """Every head dim the forward takes has a backward tile at least as wide, on both targets."""
    import importlib

    attention_module = importlib.import_module("cuattn.attention")

    for d in attention_module.SUPPORTED_HEAD_DIMS:
        for arch in SMEM_PER_BLOCK:
            tile_dim = attention_module.bwd_tile_dim(d, arch)
            assert tile_dim >= d
            assert attention_module.bwd_tile(d, arch) == attention_module.BWD_TILES[tile_dim][
                attention_module.arch_family(arch)]


@pytest.mark.parametrize("arch", list(SMEM_PER_BLOCK))
def test_alibi_variants_are_listed_beside_the_plain_ones(arch):
    """With alibi_slopes the forward dispatcher picks the ALIBI instantiation of flash_fwd_kernel,
    listed in kernel_variants (what `python -m cuattn build` and CI compile and check for spills)
    beside the plain one. (tests/test_head_dims.py checks every backward variant the dispatcher
    can pick, ALiBi or not, for every head dim.)"""
    import importlib

    attention_module = importlib.import_module("cuattn.attention")
    listed = {spec.name for spec in attention_module.kernel_variants(arch)}
    for dtype in ("float16", "bfloat16"):
        for d in attention_module.TILE_HEAD_DIMS:
            plain, alibi = (attention_module.fwd_spec(dtype, d, attention_module.fwd_tile(d, arch, a), a).name
                            for a in (False, True))
            assert {plain, alibi} <= listed and plain.endswith(", false, false>") and alibi.endswith(", true, false>")


def test_sm90_backward_picks_bulk_dq():
    """On sm_90a the wgmma kernel reduces dQ by bulk reductions in the main kernel plus the tile
    convert (measured fastest), ordered when deterministic, except
    where BWD_ORDERED_ALIBI_FALLBACK sends ALiBi to the atomic path (deterministic: then
    flash_bwd_dq_kernel); every one of these, and the other dQ mode, is listed for the build."""
    import importlib

    from cuattn import _params

    attention_module = importlib.import_module("cuattn.attention")
    arch = "sm_90a"
    listed = {spec.name for spec in attention_module.kernel_variants(arch)}
    # bulk dQ staging parts a consumer (each BLOCK_M x D: the consumers take the steps' dQ in
    # turn): two where they fit beside the tiles (D = 64), else one
    staging_parts = {64: 2, 80: 1, 96: 1, 128: 1}
    for d in (64, 80, 96, 128):
        for deterministic, alibi in ((False, False), (True, False), (False, True), (True, True)):
            tile = attention_module.bwd_tile(d, arch, deterministic, alibi)
            assert tile.wgmma
            fallback = alibi and d in attention_module.BWD_ORDERED_ALIBI_FALLBACK
            assert tile.bulk_dq == (not fallback), (d, deterministic, alibi)
            ordered = tile.bulk_dq and deterministic
            assert attention_module.bwd_ordered(tile, deterministic) == ordered
            _, main, last = attention_module.bwd_specs("bfloat16", d, tile, deterministic, alibi)
            if tile.bulk_dq:
                mode = _params.constant("kBwdDqOrdered" if ordered else "kBwdDqBulk")
                assert "bwd_convert_dq_tiles_kernel" in last.name
            elif deterministic:
                mode = _params.constant("kBwdDqNone")
                assert "flash_bwd_dq_kernel" in last.name
            else:
                mode = _params.constant("kBwdDqAtomic")
            assert main.name.endswith(f", {mode}, {'true' if alibi else 'false'}>"), main.name
            assert {main.name, last.name} <= listed
            atomic, bulk = (dataclasses.replace(tile, dq_mode=m) for m in ("atomic", "bulk"))
            # (ALiBi's bulk variants spill where BWD_ORDERED_ALIBI_FALLBACK says: not built)
            for other in (atomic,) if fallback else (atomic, bulk):
                names = {spec.name for spec in attention_module.bwd_specs("bfloat16", d, other, deterministic, alibi)}
                assert names <= listed, (d, deterministic, alibi, other.dq_mode)
            # the staging parts: BLOCK_M x D fp32 each, more shared memory on the bulk path
            cols = d
            assert attention_module.bwd_dq_cols(tile, d) == cols
            staging = _params.constant("kBwdSm90Consumers") * staging_parts[d] * tile.block_m * cols * 4
            assert bulk.smem_bytes(d, 2) - atomic.smem_bytes(d, 2) == staging
            assert bulk.smem_bytes(d, 2) <= _params.constant("kSm90MaxSmem")
    # the wide tile's consumers each compute half of D (its dQ goes by float4 atomics)
    assert attention_module.bwd_dq_cols(attention_module.bwd_tile(256, "sm_90a"), 256) == \
        256 // _params.constant("kBwdSm90Consumers")
    with pytest.raises(ValueError, match="dq_mode must be one of"):
        attention_module.BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True, dq_mode="tma")


def _visited_query_blocks(n, sq, sk, left, right, block_m, block_n):
    """flash_bwd_sm90_kernel's query blocks of key block n (m_block_begin, m_blocks), restated."""
    offset, n0 = sk - sq, n * block_n
    m_begin, m_end = max(0, n0 - offset - right), min(sq, n0 + block_n - 1 - offset + left + 1)
    first = m_begin // block_m
    return range(first, -(-m_end // block_m)) if m_end > m_begin else range(0)


def _rank_range(m, sq, sk, left, right, block_m, block_n):
    """The [first, last] key blocks its ordered dQ ranks assume for query block m, restated."""
    offset, m0 = sk - sq, m * block_m
    first = max(0, m0 + offset - left) // block_n
    last = min(-(-sk // block_n) - 1, (m0 + block_m - 1 + offset + right) // block_n)
    return first, last


def test_ordered_dq_ranks_are_the_visiting_key_blocks(rng):
    """The ordered bulk dQ (kBwdDqOrdered) waits, at query block m, for semaphore value = the CTA's
    rank in [first(m), last(m)]: a hang unless the key blocks that visit m are exactly that range
    for every mask. The kernel's formulas, restated, over random lengths and windows; and the
    varlen tile start (cu_seqlens_q[b] + b * BLOCK_M) // BLOCK_M gives each sequence's blocks
    their own tiles below the host's count."""
    import importlib

    from cuattn import _masks

    attention_module = importlib.import_module("cuattn.attention")
    tile = attention_module.bwd_tile(128, "sm_90a")
    block_m, block_n = tile.block_m, tile.block_n
    for _ in range(300):
        sq, sk = (int(x) for x in rng.integers(1, 1200, size=2))
        causal = bool(rng.integers(2))
        window = tuple(int(rng.choice([-1, int(rng.integers(0, 500))])) for _ in range(2))
        left, right = _masks.window_bounds(causal, window, sq + sk + block_n)
        key_blocks = -(-sk // block_n)
        visits = [set(_visited_query_blocks(n, sq, sk, left, right, block_m, block_n)) for n in range(key_blocks)]
        for m in range(-(-sq // block_m)):
            who = [n for n in range(key_blocks) if m in visits[n]]
            if who:
                first, last = _rank_range(m, sq, sk, left, right, block_m, block_n)
                assert who == list(range(first, last + 1)), (sq, sk, causal, window, m, rng.seed)
    for _ in range(100):
        lens = rng.integers(0, 400, size=int(rng.integers(1, 9)))
        starts, batch = np.concatenate([[0], np.cumsum(lens)]), len(lens)
        tiles_per_head = (int(starts[-1]) + batch * block_m) // block_m  # _launch_bwd's acc_tile_sh
        used = [t for b in range(batch) for t in
                range((int(starts[b]) + b * block_m) // block_m,
                      (int(starts[b]) + b * block_m) // block_m + -(-int(lens[b]) // block_m))]
        assert len(used) == len(set(used)) and all(t < tiles_per_head for t in used), (lens, rng.seed)
