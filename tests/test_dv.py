"""A v head dim Dv of its own: q and k (..., D), v and out (..., Dv), in attention and attention_varlen.

DeepSeek's prefill runs D = 192 (128 "nope" + 64 rope columns) against Dv = 128. On sm_90a the
forward runs the Hopper kernel's smallest (D, Dv) tile that holds both (its (192, 128) tile, or a
D = Dv tile with the narrower head dim padded by zeros the TMA reads); flash_fwd_kernel runs the
tile of max(D, Dv), the smaller head dim zero-padded (exact: flash_fwd.cu). The GPU forward tests
run on both kernels. The default scale is 1 / sqrt(D) and lse does not depend on v.

CPU tests: the NumPy path's shapes and values against a direct einsum, the reference's own
consistency, the NumPy backward against central differences, the argument checks (the same on
both paths) and the dispatchers' choices. GPU tests: the forward (2x rule, into NaN-poisoned
outputs) and the backward (3x rule) against the float64 reference, dense and varlen with ragged
odd lengths.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import cuattn
from cuattn import _arrays, _registry, reference
from conftest import (DTYPE_IDS, DTYPES, error_budget, expected_forward_kernel, forward_kernels, import_jax,
                      prefix_sums, randn)

attention_module = importlib.import_module("cuattn.attention")  # the module, not cuattn.attention the function

# (D, Dv): DeepSeek's prefill, each head dim twice the other, padded head dims both ways, the
# largest tile holding a smaller Dv
PAIRS = [(192, 128), (128, 64), (64, 128), (40, 24), (24, 40), (256, 128)]
PAIR_IDS = [f"d{d}-dv{dv}" for d, dv in PAIRS]
MASKS = _registry.MASK_OPTIONS
# ragged varlen lengths: odd, one empty query run, one sequence longer than a key block of every tile
VARLEN_Q = [1, 17, 113, 0, 203]
VARLEN_K = [5, 17, 301, 9, 203]
HQ, HK = 4, 2
HEAD_DIM_RULE = r"is not supported: head_dim must be a multiple of 8 from 8 to 256"


def _qkv(rng, dtype, shape_q, shape_k, dv):
    """q (..., D), k (..., D) and v of k's shape with Dv last."""
    return randn(rng, shape_q, dtype), randn(rng, shape_k, dtype), randn(rng, (*shape_k[:-1], dv), dtype)


def _einsum_attention(q, k, v, scale, visible):
    """Softmax attention written out with einsum (float64), every row seeing at least one key:
    out (B, Sq, Hq, Dv) and lse (B, Hq, Sq)."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.where(visible, np.einsum("bqhd,bkhd->bhqk", q, k) * scale, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhe->bqhe", weights / total, v)
    return out, (peak + np.log(total))[..., 0]


def _causal(sq, sk):
    """Bottom-right aligned causal visibility (sq, sk)."""
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq


# ---------------------------------------------------------------------------------------------
# CPU: the NumPy path and the reference


@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
def test_numpy_path_gives_dv_columns_matching_einsum(rng, d, dv):
    q, k, v = _qkv(rng, np.float64, (2, 9, HQ, d), (2, 13, HK, d), dv)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 9, HQ, dv) and lse.shape == (2, HQ, 9)
    expected, expected_lse = _einsum_attention(q, k, v, 1 / math.sqrt(d), _causal(9, 13))
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-6, atol=1e-6)  # lse comes back in float32


@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
def test_default_scale_is_one_over_sqrt_of_qs_head_dim(rng, d, dv):
    q, k, v = _qkv(rng, np.float64, (1, 5, HQ, d), (1, 7, HK, d), dv)
    np.testing.assert_allclose(cuattn.attention(q, k, v), cuattn.attention(q, k, v, scale=1 / math.sqrt(d)),
                               rtol=1e-12, atol=1e-12)
    assert not np.allclose(cuattn.attention(q, k, v), cuattn.attention(q, k, v, scale=1 / math.sqrt(dv)))


@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
def test_lse_does_not_depend_on_v(rng, d, dv):
    q, k, v = _qkv(rng, np.float64, (1, 6, HQ, d), (1, 11, HK, d), dv)
    _, lse = cuattn.attention(q, k, v, window=(3, 1), return_lse=True)
    _, lse_same_dims = cuattn.attention(q, k, k, window=(3, 1), return_lse=True)
    np.testing.assert_array_equal(lse, lse_same_dims)


@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
def test_numpy_varlen_is_dense_attention_per_sequence(rng, d, dv):
    lens_q, lens_k = [3, 0, 8], [5, 2, 8]
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q, k, v = _qkv(rng, np.float64, (int(cu_q[-1]), HQ, d), (int(cu_k[-1]), HK, d), dv)
    out, lse = cuattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert out.shape == (cu_q[-1], HQ, dv) and lse.shape == (HQ, cu_q[-1])
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense, dense_lse = cuattn.attention(q[None, rows], k[None, keys], v[None, keys], causal=True,
                                            return_lse=True)
        np.testing.assert_array_equal(out[rows], dense[0])
        np.testing.assert_array_equal(lse[:, rows], dense_lse[0])


@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
def test_reference_online_softmax_and_lowp_take_dv(rng, d, dv):
    q, k, v = _qkv(rng, np.float32, (2, 11, HQ, d), (2, 29, HK, d), dv)
    ref, ref_lse = reference.attention(q, k, v, window=(7, 2), return_lse=True)
    tiled, tiled_lse = reference.attention_tiled(q, k, v, block_k=8, window=(7, 2), return_lse=True)
    np.testing.assert_allclose(tiled, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tiled_lse, ref_lse, rtol=1e-12, atol=1e-12)
    naive = reference.naive_attention_lowp(q, k, v, window=(7, 2), dtype=np.float16)
    assert naive.shape == ref.shape == (2, 11, HQ, dv)
    assert np.abs(naive - ref).max() < 1e-2


def test_out_argument_takes_dv_on_the_host(rng):
    q, k, v = _qkv(rng, np.float32, (1, 5, HQ, 192), (1, 7, HK, 192), 128)
    out = np.empty((1, 5, HQ, 128), np.float32)
    assert cuattn.attention(q, k, v, out=out) is out
    np.testing.assert_allclose(out, reference.attention(q, k, v), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Argument errors (the same rules on the host and the device: these run the host path)


def _varlen(q, k, v, **options):
    cu_q = np.array([0, q.shape[1]], np.int32)
    cu_k = np.array([0, k.shape[1]], np.int32)
    return cuattn.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, q.shape[1], k.shape[1], **options)


@pytest.mark.parametrize("dv", [36, 4, 264, 0])
def test_a_dv_outside_the_head_dims_is_refused(dv):
    q = np.zeros((1, 5, HQ, 64), np.float32)
    k = np.zeros((1, 7, HK, 64), np.float32)
    v = np.zeros((1, 7, HK, dv), np.float32)
    message = rf"v.shape\[-1\] \(head_dim_v\) = {dv} {HEAD_DIM_RULE}"
    with pytest.raises(ValueError, match=message):
        cuattn.attention(q, k, v)
    with pytest.raises(ValueError, match=message):
        _varlen(q, k, v)
    with pytest.raises(ValueError, match=message):
        cuattn.attention_backward(q, q, k, v, q, np.zeros((1, HQ, 5), np.float32))


def test_v_still_shares_ks_other_axes():
    q = np.zeros((1, 5, HQ, 64), np.float32)
    k = np.zeros((1, 7, HK, 64), np.float32)
    with pytest.raises(ValueError, match=r"v.shape\[1\] \(Sk\) must equal k.shape\[1\] = 7, got 6"):
        cuattn.attention(q, k, np.zeros((1, 6, HK, 32), np.float32))
    with pytest.raises(ValueError, match=r"v must be 4-D \(B, Sk, Hk, Dv\), got shape \(7, 2, 32\)"):
        cuattn.attention(q, k, np.zeros((7, HK, 32), np.float32))
    with pytest.raises(ValueError, match=r"v.shape\[1\] \(Hk\) must equal k.shape\[1\] = 2, got 1"):
        _varlen(q, k, np.zeros((1, 7, 1, 32), np.float32))


@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128)], ids=["d192-dv128", "d64-dv128"])
def test_an_out_of_qs_shape_is_refused_when_dv_differs(d, dv):
    q = np.zeros((1, 5, HQ, d), np.float32)
    k = np.zeros((1, 7, HK, d), np.float32)
    v = np.zeros((1, 7, HK, dv), np.float32)
    with pytest.raises(ValueError, match=rf"out.shape must equal q.shape\[:-1\] \+ v.shape\[-1:\] \(v's head dim Dv "
                                         rf"last\) = \(1, 5, 4, {dv}\), got \(1, 5, 4, {d}\)"):
        cuattn.attention(q, k, v, out=np.zeros(q.shape, np.float32))
    with pytest.raises(ValueError, match=rf"= \(5, 4, {dv}\), got \(5, 4, {d}\)"):
        _varlen(q, k, v, out=np.zeros(q.shape[1:], np.float32))


def test_fp8_refuses_a_dv_of_its_own(rng):
    q8, k8 = (cuattn.quantize_fp8(randn(rng, shape, np.float32), 1.0) for shape in ((1, 8, HQ, 128), (1, 9, HK, 128)))
    v8 = cuattn.quantize_fp8(randn(rng, (1, 9, HK, 64), np.float32), 1.0)
    with pytest.raises(ValueError, match=r"v.shape\[3\] \(head_dim_v\) must equal q.shape\[3\] \(head_dim\) = 128 with "
                                         r"FP8 inputs, got 64"):
        cuattn.attention(q8, k8, v8, q_scale=1.0, k_scale=1.0, v_scale=1.0)


# ---------------------------------------------------------------------------------------------
# Kernel choice


@pytest.mark.parametrize("d, dv, tile", [(192, 128, 256), (128, 64, 128), (64, 128, 128), (40, 24, 64),
                                         (24, 40, 64), (256, 128, 256), (80, 72, 80), (72, 88, 96)])
def test_the_tile_is_that_of_the_larger_head_dim(d, dv, tile):
    assert attention_module.fwd_tile_dim(d, dv) == attention_module.fwd_tile_dim(dv, d) == tile
    for arch in ("sm_80", "sm_90a"):
        assert attention_module.fwd_tile(d, arch, head_dim_v=dv) == attention_module.fwd_tile(max(d, dv), arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_kernel_a_pair_of_head_dims_can_pick_is_listed(arch):
    """Dv adds no kernel: the tile of max(D, Dv) is a tile every head dim already has."""
    listed = {spec.name for spec in cuattn._registry.kernel_variants(arch)}
    dims = _registry.SUPPORTED_HEAD_DIMS
    for dtype in DTYPES:
        for d in dims:
            for dv in dims:
                tile_dim = attention_module.fwd_tile_dim(d, dv)
                for alibi in (False, True):
                    tile = attention_module.fwd_tile(d, arch, alibi, dv)
                    assert attention_module.fwd_spec(dtype, tile_dim, tile, alibi).name in listed, (d, dv, alibi)
                paged = attention_module.fwd_spec(dtype, tile_dim, attention_module.fwd_tile(d, arch, head_dim_v=dv),
                                                  paged=True)
                assert paged.name in listed, (d, dv)
                hopper = attention_module.fwd_sm90_tile_dims(d, dv)
                if arch == "sm_90a" and hopper is not None:
                    spec = attention_module.fwd_sm90_spec(dtype, *hopper, attention_module.FWD_SM90_TILES[hopper])
                    assert spec.name in listed, (d, dv)


@pytest.mark.parametrize("d, dv, tile", [(192, 128, (192, 128)), (136, 128, (160, 160)), (176, 128, (192, 128)), (128, 64, (128, 128)),
                                         (64, 128, (128, 128)), (200, 96, (256, 256)), (256, 128, (256, 256)),
                                         (40, 24, None), (24, 40, None), (72, 72, (80, 80)), (152, 160, (160, 160))])
def test_the_hopper_tile_is_the_smallest_pair_holding_both_head_dims(d, dv, tile):
    """fwd_sm90_tile_dims: the (D, Dv) pair of the fewest columns that holds both (192/128 has its
    own); head dims of at most FWD_SM90_MIN_HEAD_DIM take flash_fwd_kernel."""
    assert attention_module.fwd_sm90_tile_dims(d, dv) == tile
    if tile is not None:
        assert tile in attention_module.FWD_SM90_TILES and tile[0] >= d and tile[1] >= dv


# ---------------------------------------------------------------------------------------------
# jax's forward on the CPU (the GPU runs the kernels above through the same _launch_fwd)


def test_jax_forward_declares_dv_outputs(rng):
    jax = import_jax()
    import jax.numpy as jnp

    import cuattn.jax

    q, k, v = _qkv(rng, _arrays.BFLOAT16, (2, 9, HQ, 192), (2, 13, HK, 192), 128)
    with jax.default_device(jax.devices("cpu")[0]):
        out, lse = cuattn.jax.attention(*(jnp.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
        cu = np.array([0, 4, 9], np.int32)
        packed = cuattn.jax.attention_varlen(*(jnp.asarray(x) for x in (q[0], k[0, :9], v[0, :9], cu, cu)), 5, 5)
    assert out.shape == (2, 9, HQ, 128) and lse.shape == (2, HQ, 9) and packed.shape == (9, HQ, 128)
    ref = reference.attention(q, k, v, causal=True)
    naive = reference.naive_attention_lowp(q, k, v, causal=True, dtype="bfloat16")
    budget = error_budget(np.abs(naive - ref).max(), _arrays.BFLOAT16, 2.0, np.abs(ref).max())
    assert np.abs(np.asarray(out).astype(np.float64) - ref).max() <= budget, f"seed {rng.seed}"


# ---------------------------------------------------------------------------------------------
# GPU: both forward kernels with Dv != D


def _check_out(rng, got, ref, naive, dtype, what=""):
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"unwritten or NaN output {what}(seed {rng.seed})"
    err = np.abs(got - ref).max(initial=0.0)
    budget = error_budget(np.abs(naive - ref).max(initial=0.0), dtype, 2.0, np.abs(ref).max(initial=0.0))
    assert err <= budget, f"max error {err:.3g} > budget {budget:.3g} {what}(seed {rng.seed})"


def _check_lse(rng, lse, ref_lse):
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"empty rows differ (seed {rng.seed})"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dense_forward_with_dv_matches_reference(rng, caplog, forward_kernel, dtype, d, dv, mask):
    import cupy

    options = MASKS[mask]
    q, k, v = _qkv(rng, dtype, (2, 77, HQ, d), (2, 131, HK, d), dv)
    out = cupy.full((2, 77, HQ, dv), np.nan, dtype)  # poison: every element must be written
    with caplog.at_level("DEBUG", logger="cuattn"):
        got, lse = cuattn.attention(*(cupy.asarray(x) for x in (q, k, v)), out=out, return_lse=True, **options)
    assert got is out
    chosen = forward_kernels(caplog)
    assert chosen and expected_forward_kernel(dtype, d, dv) in chosen[-1], chosen
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive = reference.naive_attention_lowp(q, k, v, dtype=dtype, **options)
    _check_out(rng, got.get(), ref, naive, dtype)
    _check_lse(rng, lse.get(), ref_lse)
    # without out=: the first call allocates (..., Dv) and leaves a plan, the second runs the plan,
    # which allocates the same
    for call in ("full path", "plan"):
        again = cuattn.attention(*(cupy.asarray(x) for x in (q, k, v)), **options)
        assert again.shape == (2, 77, HQ, dv), call
        _check_out(rng, again.get(), ref, naive, dtype, f"({call}) ")


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_forward_with_dv_matches_reference_per_sequence(rng, forward_kernel, dtype, d, dv, mask):
    import cupy

    options = MASKS[mask]
    cu_q = prefix_sums(VARLEN_Q)
    cu_k = prefix_sums(VARLEN_K)
    q, k, v = _qkv(rng, dtype, (int(cu_q[-1]), HQ, d), (int(cu_k[-1]), HK, d), dv)
    out = cupy.full((int(cu_q[-1]), HQ, dv), np.nan, dtype)
    got, lse = cuattn.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), max(VARLEN_Q),
                                       max(VARLEN_K), out=out, return_lse=True, **options)
    got, lse = got.get(), lse.get()
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), return_lse=True,
                                              **options)
    for b in range(len(VARLEN_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        naive = reference.naive_attention_lowp(q[None, rows], k[None, keys], v[None, keys], dtype=dtype, **options)[0]
        _check_out(rng, got[rows], ref[rows], naive, dtype, f"in sequence {b} ")
    _check_lse(rng, lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128), (128, 64)], ids=["d192-dv128", "d64-dv128", "d128-dv64"])
def test_sinks_and_alibi_with_dv(rng, forward_kernel, d, dv):
    """The ALiBi variant (its own tile at D = 128 on sm_80) and the sinks' epilogue with Dv != D."""
    import cupy

    dtype = DTYPES[1]
    q, k, v = _qkv(rng, dtype, (2, 67, HQ, d), (2, 150, HK, d), dv)
    sinks = (rng.standard_normal(HQ) * 2.0).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, HQ + 1)).astype(np.float32)
    options = dict(causal=True, sinks=sinks, alibi_slopes=slopes)
    got, lse = cuattn.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, causal=True,
                                sinks=cupy.asarray(sinks), alibi_slopes=cupy.asarray(slopes))
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    _check_out(rng, got.get(), ref, reference.naive_attention_lowp(q, k, v, dtype=dtype, **options), dtype)
    _check_lse(rng, lse.get(), ref_lse)


@pytest.mark.gpu
def test_k_and_v_as_column_slices_of_one_kv_tensor(rng, forward_kernel):
    """DeepSeek-style k and v cut from one (B, Sk, Hk, D + Dv) projection: row strides of D + Dv
    elements, v starting D columns in."""
    import cupy

    dtype, d, dv = DTYPES[0], 192, 128
    q = randn(rng, (1, 70, HQ, d), dtype)
    kv = randn(rng, (1, 97, HK, d + dv), dtype)
    k, v = kv[..., :d], kv[..., d:]
    kv_device = cupy.asarray(kv)
    got = cuattn.attention(cupy.asarray(q), kv_device[..., :d], kv_device[..., d:], causal=True)
    ref = reference.attention(q, k, v, causal=True)
    _check_out(rng, got.get(), ref, reference.naive_attention_lowp(q, k, v, causal=True, dtype=dtype), dtype)


def _bwd_budgets(got, refs, naive, dtype, rng, label=""):
    """dq, dk, dv against the float64 reference under the backward's 3x rule."""
    for name, g, ref, low in zip(("dq", "dk", "dv"), got, refs, naive):
        g = g.get().astype(np.float64)
        assert g.shape == ref.shape, f"{label}{name}: shape {g.shape}, expected {ref.shape}"
        assert np.isfinite(g).all(), f"{label}{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(g - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), dtype, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{label}{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"


@pytest.mark.parametrize("d, dv", [(24, 16), (16, 24)], ids=["d24-dv16", "d16-dv24"])
def test_numpy_backward_with_dv_is_the_forwards_gradient(rng, d, dv):
    """The NumPy backward against central differences of the NumPy forward (float64), through a
    random projection of out: dq, dk (D wide) and dv (Dv wide)."""
    q, k, v = _qkv(rng, np.float64, (1, 3, 2, d), (1, 4, 1, d), dv)
    dout = rng.standard_normal((1, 3, 2, dv))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    grads = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    step = 1e-6
    for which, grad in enumerate(grads):
        x = (q, k, v)[which]
        for index in [(0, 0, 0, 0), (0, 2, 0, x.shape[-1] - 1), (0, 1, x.shape[2] - 1, x.shape[-1] // 2)]:
            sums = []
            for sign in (1, -1):
                moved = [q, k, v]
                moved[which] = x.copy()
                moved[which][index] += sign * step
                sums.append(np.sum(cuattn.attention(*moved, causal=True) * dout))
            np.testing.assert_allclose(grad[index], (sums[0] - sums[1]) / (2 * step), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128)], ids=["d192-dv128", "d64-dv128"])
def test_backward_refuses_a_dout_of_qs_shape_when_dv_differs(rng, d, dv):
    q, k, v = _qkv(rng, np.float32, (1, 5, HQ, d), (1, 7, HK, d), dv)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=rf"dout.shape must equal q.shape\[:-1\] \+ v.shape\[-1:\] \(v's head dim Dv "
                                         rf"last\) = \(1, 5, {HQ}, {dv}\), got \(1, 5, {HQ}, {d}\)"):
        cuattn.attention_backward(np.zeros(q.shape, np.float32), q, k, v, out, lse)


@pytest.mark.parametrize("d, dv, tile", [(192, 128, 256), (128, 64, 128), (64, 128, 128), (40, 24, 64), (88, 72, 96)],
                         ids=["d192-dv128", "d128-dv64", "d64-dv128", "d40-dv24", "d88-dv72"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_backward_tile_is_the_larger_head_dims(d, dv, tile, arch):
    """Dv != D runs the tile of the larger head dim: on sm_90a the wgmma kernel's (it reads zeros
    past each array's own head dim), else the mma.sync kernels'."""
    chosen = attention_module.bwd_tile(d, arch, head_dim_v=dv)
    family = attention_module.arch_family(arch)
    assert chosen == attention_module.BWD_TILES[tile][family]
    assert chosen.wgmma == (family == attention_module.SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", ["full", "causal", "softcap-causal"])
@pytest.mark.parametrize("d, dv", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dense_backward_with_dv_matches_reference(rng, dtype, d, dv, mask, deterministic):
    import cupy

    options = MASKS[mask]
    q, k, v = _qkv(rng, dtype, (2, 77, HQ, d), (2, 131, HK, d), dv)
    dout = randn(rng, (2, 77, HQ, dv), dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuattn.attention(qd, kd, vd, return_lse=True, **options)
    got = cuattn.attention_backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, **options)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **options)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=dtype, **options)
    _bwd_budgets(got, refs, naive, dtype, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128), (40, 24)], ids=["d192-dv128", "d64-dv128", "d40-dv24"])
def test_varlen_backward_with_dv_matches_reference(rng, d, dv, deterministic):
    import cupy

    dtype = DTYPES[0]
    cu_q = prefix_sums(VARLEN_Q)
    cu_k = prefix_sums(VARLEN_K)
    q, k, v = _qkv(rng, dtype, (int(cu_q[-1]), HQ, d), (int(cu_k[-1]), HK, d), dv)
    dout = randn(rng, (int(cu_q[-1]), HQ, dv), dtype)
    args = (max(VARLEN_Q), max(VARLEN_K))
    out, lse = cuattn.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), *args, causal=True,
                                       return_lse=True)
    got = cuattn.attention_varlen_backward(*(cupy.asarray(x) for x in (dout, q, k, v)), out, lse,
                                           cupy.asarray(cu_q), cupy.asarray(cu_k), *args, causal=True,
                                           deterministic=deterministic)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, *args, causal=True, return_lse=True)
    refs = reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, *args, causal=True)
    naive = [np.zeros_like(r) for r in refs]
    for b in range(len(VARLEN_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if VARLEN_Q[b] and VARLEN_K[b]:
            low = reference.naive_attention_backward_lowp(dout[None, rows], q[None, rows], k[None, keys],
                                                          v[None, keys], causal=True, dtype=dtype)
            for total, part, at in zip(naive, low, (rows, keys, keys)):
                total[at] = part[0]
    _bwd_budgets(got, refs, naive, dtype, rng)
