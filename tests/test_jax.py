"""cuattn.jax under jax.jit, jax.grad, jax.value_and_grad and jax.vmap, against the float64 reference.

Every numerical test runs twice: on JAX's CPU backend (the reference through jax.pure_callback:
the custom_vjp wiring, the vmap folding, the options and the layouts, in CI without a GPU) and,
marked gpu, on a CUDA GPU with JAX's CUDA backend (the kernels through buffer_callback on XLA's
stream). The inputs are placed on the platform's device, so the jitted calls are lowered for it.
Tolerances follow the project's rule (README, "Tests"): the forward within 2x, the gradients
within 3x the error of the straightforward same-precision computation, plus a floor. Fresh random
inputs every run (the `rng` fixture), odd lengths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cuattn
from cuattn import _registry, reference
from conftest import (BF16, DTYPE_IDS, DTYPES, check_decode, check_dsinks, check_varlen, check_varlen_gradients,
                      error_budget, import_jax, prefix_sums, Tensor, randn)

jax = import_jax()
import jax.numpy as jnp  # noqa: E402

import cuattn.jax  # noqa: E402

MASKS = _registry.MASK_OPTIONS
PLATFORMS = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def device(request):
    """The device the inputs live on, so that jax.jit lowers for its platform."""
    if request.param == "gpu":
        if jax.default_backend() != "gpu":
            pytest.skip(f"JAX has no CUDA backend here (its default backend is {jax.default_backend()}); "
                        "install jax[cuda12] or jax[cuda13]")
        return jax.devices("gpu")[0]
    return jax.devices("cpu")[0]


def put(device, *arrays):
    return [jax.device_put(jnp.asarray(x), device) for x in arrays]


def host(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def check_forward(rng, dtype, q, k, v, got, got_lse, **options):
    """out within 2x the naive same-precision error of the float64 reference; lse close to the
    reference's, and -inf exactly where it is."""
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive = reference.naive_attention_lowp(q, k, v, dtype=dtype, **options)
    got = host(got)
    assert np.isfinite(got).all(), f"NaN or inf in out (seed {rng.seed})"
    err = np.abs(got - ref).max(initial=0.0)
    budget = error_budget(np.abs(naive - ref).max(initial=0.0), dtype, 2.0, np.abs(ref).max(initial=0.0))
    assert err <= budget, f"out: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    got_lse = np.asarray(got_lse)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), f"empty rows differ (seed {rng.seed})"
    np.testing.assert_allclose(got_lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


def check_gradients(rng, dtype, dout, q, k, v, grads, **options):
    """dq, dk, dv within 3x the naive same-precision backward's error of the float64 reference backward."""
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **options)
    naive = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=dtype, **options)
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, refs, naive):
        assert got.shape == ref.shape and got.dtype == np.dtype(dtype), f"{name}: {got.shape} {got.dtype}"
        got = host(got)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), dtype, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"


def qkv(rng, dtype, b, sq, sk, hq, hk, d):
    return (randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hk, d), dtype), randn(rng, (b, sk, hk, d), dtype))


def projected_loss(dout, **options):
    """sum(out * dout) in float32: its gradient with respect to out is dout, so grad gives the VJP."""
    weights = jnp.asarray(dout).astype(jnp.float32)

    def loss(q, k, v):
        return jnp.sum(cuattn.jax.attention(q, k, v, **options).astype(jnp.float32) * weights)

    return loss


# ---------------------------------------------------------------------------------------------
# attention: forward, gradients, vmap


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_under_jit_matches_reference(device, rng, dtype, head_dim, mask):
    q, k, v = qkv(rng, dtype, 2, 37, 53, 4, 2, head_dim)
    options = MASKS[mask]
    call = jax.jit(lambda q, k, v: cuattn.jax.attention(q, k, v, return_lse=True, **options))
    out, lse = call(*put(device, q, k, v))
    assert out.dtype == jnp.dtype(dtype) and out.shape == q.shape and lse.dtype == jnp.float32
    assert lse.shape == (2, 4, 37)
    check_forward(rng, dtype, q, k, v, out, lse, **options)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gradients_under_jit_grad_match_reference_backward(device, rng, dtype, mask, deterministic):
    q, k, v = qkv(rng, dtype, 2, 45, 29, 4, 1, 64)
    dout = randn(rng, q.shape, dtype)
    options = MASKS[mask]
    loss = projected_loss(dout, deterministic=deterministic, **options)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put(device, q, k, v))
    check_gradients(rng, dtype, dout, q, k, v, grads, **options)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128)], ids=["d192-dv128", "d64-dv128"])
def test_gradients_with_a_v_head_dim_of_its_own(device, rng, d, dv, deterministic):
    """v (..., Dv) and out (..., Dv): dv takes v's shape, dq and dk q's and k's."""
    dtype = DTYPES[0]
    q, k, v = randn(rng, (2, 45, 4, d), dtype), randn(rng, (2, 29, 1, d), dtype), randn(rng, (2, 29, 1, dv), dtype)
    dout = randn(rng, (2, 45, 4, dv), dtype)
    loss = projected_loss(dout, deterministic=deterministic, causal=True)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put(device, q, k, v))
    check_gradients(rng, dtype, dout, q, k, v, grads, causal=True)


@pytest.mark.parametrize("mask", ["full", "causal", "softcap-causal"])
def test_sinks_forward_and_gradients_under_jit(device, rng, mask):
    """out and lse with sinks under the 2x rule; dq, dk, dv and dsinks through jax.grad under the
    3x rule (dsinks' straightforward value takes delta from the bf16-rounded forward output, as
    in tests/test_backward.py)."""
    options = MASKS[mask]
    q, k, v = qkv(rng, BF16, 2, 41, 67, 4, 2, 64)
    sinks = (rng.standard_normal(4) * 2).astype(np.float32)
    dout = randn(rng, q.shape, BF16)
    args = put(device, q, k, v, sinks)
    out, lse = jax.jit(lambda q, k, v, s: cuattn.jax.attention(q, k, v, sinks=s, return_lse=True, **options))(*args)
    check_forward(rng, BF16, q, k, v, out, lse, sinks=sinks, **options)
    weights = jnp.asarray(dout).astype(jnp.float32)
    loss = lambda q, k, v, s: jnp.sum(cuattn.jax.attention(q, k, v, sinks=s, **options).astype(jnp.float32) * weights)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    check_gradients(rng, BF16, dout, q, k, v, grads[:3], sinks=sinks, **options)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, sinks=sinks, **options)
    ref_dsinks = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, sinks=sinks, **options)[3]
    out_lowp = reference.naive_attention_lowp(q, k, v, dtype=BF16, sinks=sinks, **options)
    assert grads[3].dtype == jnp.float32 and grads[3].shape == (4,)
    check_dsinks(rng, BF16, host(grads[3]), ref_dsinks, dout, sinks, ref_out, ref_lse, out_lowp)


def test_sinks_under_vmap_run_per_element(device, rng):
    """vmap over q and sinks together: each element uses its own sinks row."""
    q, k, v = qkv(rng, BF16, 1, 17, 21, 4, 4, 64)
    qs = np.stack([q, randn(rng, q.shape, BF16)])
    sinks = (rng.standard_normal((2, 4)) * 2).astype(np.float32)
    qd, kd, vd, sd = put(device, qs, k, v, sinks)
    outs = jax.jit(jax.vmap(lambda q, s: cuattn.jax.attention(q, kd, vd, sinks=s, return_lse=True)))(qd, sd)
    for i in range(2):
        check_forward(rng, BF16, qs[i], k, v, outs[0][i], outs[1][i], sinks=sinks[i])


def _alibi_slopes(rng, *shape):
    """Random positive ALiBi slopes around the usual 2^(-8 h / H) range, float32."""
    return (2.0 ** -rng.uniform(0.5, 8.0, shape)).astype(np.float32)


@pytest.mark.parametrize("extras", ["alibi", "alibi-per-sequence", "alibi-and-sinks"])
def test_alibi_forward_and_gradients_under_jit(device, rng, extras):
    """ALiBi slopes ((Hq,) or (B, Hq)), alone or beside sinks: out and lse under the 2x rule, dq,
    dk, dv through jax.grad under the 3x rule, and no gradient for the slopes (zeros)."""
    q, k, v = qkv(rng, BF16, 2, 41, 67, 4, 2, 64)
    slopes = _alibi_slopes(rng, *((2, 4) if extras == "alibi-per-sequence" else (4,)))
    options = {"causal": True, "alibi_slopes": slopes}
    if extras == "alibi-and-sinks":
        options["sinks"] = (rng.standard_normal(4) * 2).astype(np.float32)
    given = {name: jnp.asarray(x) for name, x in options.items() if name != "causal"}
    dout = randn(rng, q.shape, BF16)
    args = put(device, q, k, v, given["alibi_slopes"])
    sinks = given.get("sinks")

    def call(q, k, v, slopes, **flags):
        return cuattn.jax.attention(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks, **flags)

    out, lse = jax.jit(lambda *a: call(*a, return_lse=True))(*args)
    check_forward(rng, BF16, q, k, v, out, lse, **options)
    weights = jnp.asarray(dout).astype(jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(call(*a).astype(jnp.float32) * weights), argnums=(0, 1, 2, 3)))(*args)
    check_gradients(rng, BF16, dout, q, k, v, grads[:3], **options)
    assert grads[3].shape == slopes.shape and not np.asarray(grads[3]).any()


def test_alibi_under_vmap_runs_per_element(device, rng):
    """vmap over q and the slopes together: each element uses its own slopes."""
    q, k, v = qkv(rng, BF16, 1, 17, 21, 4, 4, 64)
    qs = np.stack([q, randn(rng, q.shape, BF16)])
    slopes = _alibi_slopes(rng, 2, 4)
    qd, kd, vd, sd = put(device, qs, k, v, slopes)
    outs = jax.jit(jax.vmap(lambda q, s: cuattn.jax.attention(q, kd, vd, alibi_slopes=s, return_lse=True)))(qd, sd)
    for i in range(2):
        check_forward(rng, BF16, qs[i], k, v, outs[0][i], outs[1][i], alibi_slopes=slopes[i])


def test_value_and_grad_agrees_with_the_forward_and_grad(device, rng):
    q, k, v = qkv(rng, BF16, 1, 33, 33, 2, 2, 64)
    dout = randn(rng, q.shape, BF16)
    loss = projected_loss(dout, causal=True)
    args = put(device, q, k, v)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    expected = np.sum(host(jax.jit(lambda q, k, v: cuattn.jax.attention(q, k, v, causal=True))(*args)) * host(dout))
    assert abs(float(value) - expected) <= 1e-4 * max(1.0, abs(expected)), f"{float(value)} vs {expected}"
    check_gradients(rng, BF16, dout, q, k, v, grads, causal=True)


def test_vmap_folds_leading_axes_into_the_batch(device, rng):
    """Two vmapped axes over q (k and v shared): forward and per-example gradients."""
    lead, b, sq, sk, hq, hk, d = (3, 2), 1, 19, 23, 4, 2, 64
    options = {"window": (7, 2)}
    q = randn(rng, (*lead, b, sq, hq, d), BF16)
    k, v = randn(rng, (b, sk, hk, d), BF16), randn(rng, (b, sk, hk, d), BF16)
    dout = randn(rng, q.shape, BF16)
    qd, kd, vd, dd = put(device, q, k, v, dout)
    per_item = jax.vmap(jax.vmap(lambda q: cuattn.jax.attention(q, kd, vd, return_lse=True, **options)))
    out, lse = jax.jit(per_item)(qd)
    assert out.shape == q.shape and lse.shape == (*lead, b, hq, sq)

    def item_loss(q, k, v, dout):
        return jnp.sum(cuattn.jax.attention(q, k, v, **options).astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(item_loss, argnums=(0, 1, 2))
    per_item_grads = jax.vmap(jax.vmap(grad, in_axes=(0, None, None, 0)), in_axes=(0, None, None, 0))
    dq, dk, dv = jax.jit(per_item_grads)(qd, kd, vd, dd)
    assert dk.shape == (*lead, *k.shape)
    for i in np.ndindex(*lead):
        check_forward(rng, BF16, q[i], k, v, out[i], lse[i], **options)
        check_gradients(rng, BF16, dout[i], q[i], k, v, (dq[i], dk[i], dv[i]), **options)


def test_returned_lse_carries_no_gradient(device, rng):
    q, k, v = put(device, *qkv(rng, BF16, 1, 9, 9, 2, 2, 32))
    grads = jax.jit(jax.grad(lambda q: jnp.sum(cuattn.jax.attention(q, k, v, return_lse=True)[1])))(q)
    assert not np.any(np.asarray(grads)), "lse leaves through stop_gradient: its gradient must be zero"


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["gpu"], indirect=True)
def test_repeated_jitted_calls_and_eager_calls_compute_fresh_results(device, rng):
    """One compiled program run on new inputs each time (XLA may replay the forward from a
    command buffer, and a repeated callback launches its prepared launch: either way it must
    read the new buffers), and an eager call outside jit."""
    call = jax.jit(lambda q, k, v: cuattn.jax.attention(q, k, v, causal=True, return_lse=True))
    for _ in range(3):
        q, k, v = qkv(rng, BF16, 2, 129, 257, 8, 2, 128)
        out, lse = call(*put(device, q, k, v))
        check_forward(rng, BF16, q, k, v, out, lse, causal=True)
    assert any(key[0].causal for key in cuattn.jax._FWD_LAUNCHES), "the repeated forward kept no prepared launch"
    q, k, v = qkv(rng, DTYPES[0], 1, 77, 77, 2, 2, 64)
    out, lse = cuattn.jax.attention(*put(device, q, k, v), return_lse=True)
    check_forward(rng, DTYPES[0], q, k, v, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["gpu"], indirect=True)
def test_jitted_calls_raise_no_deprecation_warnings(device, rng):
    """Each callback wraps XLA's stream for CuPy; CuPy 14 deprecated ExternalStream, whose warning
    reached the caller on every forward and backward."""
    q, k, v = qkv(rng, BF16, 1, 65, 65, 4, 2, 64)
    loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(cuattn.jax.attention(q, k, v, causal=True)), argnums=(0, 1, 2)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(loss(*put(device, q, k, v)))
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)]
    assert not deprecated, deprecated


# ---------------------------------------------------------------------------------------------
# attention_varlen: forward, gradients, vmap; decode, paged_attention (forward only)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_under_jit_and_vmap_matches_reference(device, rng, dtype):
    lengths_q, lengths_k = [5, 0, 17, 1], [9, 3, 17, 6]
    cu_q, cu_k = prefix_sums(lengths_q), prefix_sums(lengths_k)
    hq, hk, d = 4, 2, 64
    q = randn(rng, (2, int(cu_q[-1]), hq, d), dtype)
    k, v = randn(rng, (2, int(cu_k[-1]), hk, d), dtype), randn(rng, (2, int(cu_k[-1]), hk, d), dtype)
    def varlen(q, k, v, cu_q, cu_k):
        return cuattn.jax.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                           return_lse=True)

    call = jax.jit(jax.vmap(varlen, in_axes=(0, 0, 0, None, None)))
    out, lse = call(*put(device, q, k, v, cu_q, cu_k))
    assert out.shape == q.shape and lse.shape == (2, hq, q.shape[1])
    for i in range(2):
        ref, ref_lse = reference.attention_varlen(q[i], k[i], v[i], cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  causal=True, return_lse=True)
        segments = zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
        naive = max(np.abs(reference.naive_attention_lowp(q[i, None, a:b], k[i, None, c:e], v[i, None, c:e],
                                                          dtype=dtype, causal=True)[0] - ref[a:b]).max(initial=0.0)
                    for a, b, c, e in segments)
        err = np.abs(host(out[i]) - ref).max()
        assert err <= error_budget(naive, dtype, 2.0, np.abs(ref).max()), f"error {err:.3g} (seed {rng.seed})"
        np.testing.assert_allclose(np.asarray(lse[i]), ref_lse, rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


# A sequence with no queries, one with no keys (its queries' gradients are 0), one longer than
# a 128-row tile, and odd lengths.
VARLEN_GRAD_LENGTHS = ([5, 0, 17, 6, 131], [9, 3, 17, 0, 140])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("extras", ["plain", "sinks", "alibi-per-sequence", "alibi-and-sinks"])
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap-causal"])
def test_varlen_gradients_under_jit_grad_match_reference_backward(device, rng, mask, extras, deterministic):
    """dq, dk, dv (and dsinks) of attention_varlen through jax.grad, each sequence under the 3x
    rule; the slopes get no gradient and the prefix sums none at all."""
    lens_q, lens_k = VARLEN_GRAD_LENGTHS
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    hq, hk, d = 4, 2, 64
    q = randn(rng, (int(cu_q[-1]), hq, d), BF16)
    k, v = randn(rng, (int(cu_k[-1]), hk, d), BF16), randn(rng, (int(cu_k[-1]), hk, d), BF16)
    dout = randn(rng, q.shape, BF16)
    options = dict(MASKS[mask])
    if "sinks" in extras:
        options["sinks"] = (rng.standard_normal(hq) * 2).astype(np.float32)
    if "alibi" in extras:
        options["alibi_slopes"] = _alibi_slopes(rng, len(lens_q), hq)
    given = {name: jnp.asarray(x) for name, x in options.items() if name in ("sinks", "alibi_slopes")}
    flags = {name: x for name, x in options.items() if name not in given}
    weights = jnp.asarray(dout).astype(jnp.float32)

    def loss(q, k, v, extras):
        out = cuattn.jax.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), deterministic=deterministic,
                                          **extras, **flags)
        return jnp.sum(out.astype(jnp.float32) * weights)

    (dq, dk, dv, dextras) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*put(device, q, k, v), given)
    assert all(g.dtype == jnp.bfloat16 for g in (dq, dk, dv))
    grads = (dq, dk, dv) + ((dextras["sinks"],) if "sinks" in given else ())
    assert "sinks" not in given or dextras["sinks"].dtype == jnp.float32
    check_varlen_gradients(rng, BF16, dout, q, k, v, cu_q, cu_k, grads, **options)
    if "alibi_slopes" in given:
        assert dextras["alibi_slopes"].shape == (len(lens_q), hq) and not np.asarray(dextras["alibi_slopes"]).any()


@pytest.mark.parametrize("d, dv", [(192, 128), (40, 40)], ids=["d192-dv128", "d40"])
def test_varlen_gradients_under_vmap_run_per_element(device, rng, d, dv):
    """vmap of jax.grad over q, k, v and dout (the prefix sums shared): one backward per element,
    each under the 3x rule; v and dv in their own head dim."""
    lens_q, lens_k = [7, 33, 1], [12, 33, 20]
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    q = randn(rng, (2, int(cu_q[-1]), 4, d), BF16)
    k, v = randn(rng, (2, int(cu_k[-1]), 2, d), BF16), randn(rng, (2, int(cu_k[-1]), 2, dv), BF16)
    dout = randn(rng, (2, int(cu_q[-1]), 4, dv), BF16)

    def loss(q, k, v, dout, cu_q, cu_k):
        out = cuattn.jax.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    per_item = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0, 0, None, None))
    dq, dk, dv_ = jax.jit(per_item)(*put(device, q, k, v, dout, cu_q, cu_k))
    for i in range(2):
        check_varlen_gradients(rng, BF16, dout[i], q[i], k[i], v[i], cu_q, cu_k, (dq[i], dk[i], dv_[i]), causal=True)


@pytest.mark.parametrize("num_splits, max_seq_len", [(1, None), (3, None), (None, None), (None, 100)],
                         ids=["1split", "3splits", "auto", "auto-max-seq-len"])
def test_decode_under_jit_and_vmap_matches_reference(device, rng, num_splits, max_seq_len):
    """Ragged lengths: 0, one past S_max (clamped to S_max on every platform), and two speculative
    tokens; a max_seq_len below two of the lengths plans the splits and leaves the result alone."""
    b, sq_new, hq, hk, d, s_max = 3, 2, 8, 2, 128, 301
    lens = np.array([0, 173, s_max + 1], np.int32)
    q = randn(rng, (2, b, sq_new, hq, d), BF16)
    k_cache, v_cache = randn(rng, (b, s_max, hk, d), BF16), randn(rng, (b, s_max, hk, d), BF16)
    call = jax.jit(jax.vmap(lambda q, k, v, lens: cuattn.jax.decode(q, k, v, lens, num_splits=num_splits,
                                                                      max_seq_len=max_seq_len, return_lse=True),
                            in_axes=(0, None, None, None)))
    out, lse = call(*put(device, q, k_cache, v_cache, lens))
    clamped = np.clip(lens, 0, s_max)
    for i in range(2):
        ref, ref_lse = reference.decode(q[i], k_cache, v_cache, clamped, return_lse=True)
        for row, n in enumerate(clamped):
            live = slice(row, row + 1), slice(0, n)
            naive = reference.naive_attention_lowp(q[i, row:row + 1], k_cache[live], v_cache[live], dtype=BF16,
                                                   causal=True)[0]
            budget = error_budget(np.abs(naive - ref[row]).max(initial=0.0), BF16, 2.0,
                                  np.abs(ref[row]).max(initial=0.0))
            err = np.abs(host(out[i, row]) - ref[row]).max()
            assert err <= budget, f"row {row} (len {n}): error {err:.3g} > {budget:.3g} (seed {rng.seed})"
        empty = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(np.asarray(lse[i])), empty)
        np.testing.assert_allclose(np.asarray(lse[i])[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("block_size", [5, 16])
def test_paged_attention_under_jit_matches_reference(device, rng, block_size):
    b, hq, hk, d = 3, 4, 1, 64
    lens = np.array([1, 37, 70], np.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = b * max_blocks + 1
    # each sequence's blocks are scattered over the pool; padding past a sequence points nowhere
    table = rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    for row, n in enumerate(lens):
        table[row, -(-int(n) // block_size):] = -1
    k_pages, v_pages = (randn(rng, (num_blocks, block_size, hk, d), DTYPES[0]) for _ in range(2))
    q = randn(rng, (b, 1, hq, d), DTYPES[0])
    call = jax.jit(lambda *arrays: cuattn.jax.paged_attention(*arrays, return_lse=True))
    out, lse = call(*put(device, q, k_pages, v_pages, table, lens))
    ref, ref_lse = reference.paged_attention(q, k_pages, v_pages, table, lens, return_lse=True)
    k_cache = reference.gather_pages(k_pages, table, lens).astype(DTYPES[0])
    v_cache = reference.gather_pages(v_pages, table, lens).astype(DTYPES[0])
    naive = max(np.abs(reference.naive_attention_lowp(q[r:r + 1], k_cache[r:r + 1, :n], v_cache[r:r + 1, :n],
                                                      dtype=DTYPES[0], causal=True)[0] - ref[r]).max()
                for r, n in enumerate(lens))
    err = np.abs(host(out) - ref).max()
    assert err <= error_budget(naive, DTYPES[0], 2.0, np.abs(ref).max()), f"error {err:.3g} (seed {rng.seed})"
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


def test_varlen_decode_and_paged_take_sinks_and_alibi(device, rng):
    """attention_varlen, decode and paged_attention forward with sinks and per-sequence ALiBi
    slopes, as the plain functions: each sequence under the 2x rule."""
    hq, hk, d = 4, 2, 64
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    # varlen: three sequences, one of them without queries
    lengths_q, lengths_k = [5, 0, 17], [9, 3, 17]
    cu_q, cu_k = prefix_sums(lengths_q), prefix_sums(lengths_k)
    q, k, v = randn(rng, (int(cu_q[-1]), hq, d), BF16), *(randn(rng, (int(cu_k[-1]), hk, d), BF16) for _ in range(2))
    slopes = _alibi_slopes(rng, 3, hq)
    out = jax.jit(lambda *a: cuattn.jax.attention_varlen(*a[:5], 17, 17, causal=True, sinks=a[5], alibi_slopes=a[6]))(
        *put(device, q, k, v, cu_q, cu_k, sinks, slopes))
    check_varlen(rng, BF16, q, k, v, cu_q, cu_k, np.asarray(out), causal=True, sinks=sinks, alibi_slopes=slopes)
    # decode: two new tokens over ragged lengths
    lens = np.array([0, 40, 301], np.int32)
    q = randn(rng, (3, 2, hq, d), BF16)
    k_cache, v_cache = (randn(rng, (3, 301, hk, d), BF16) for _ in range(2))
    out, lse = jax.jit(lambda *a: cuattn.jax.decode(*a[:4], sinks=a[4], alibi_slopes=a[5], return_lse=True))(
        *put(device, q, k_cache, v_cache, lens, sinks, slopes))
    check_decode(rng, BF16, q, k_cache, v_cache, lens, np.asarray(out), np.asarray(lse), sinks=sinks,
                 alibi_slopes=slopes)
    # paged: the same cache in shuffled 16-token pages
    block = 16
    pages = rng.permutation(3 * 301 // block + 3)[:3 * (-(-301 // block))].reshape(3, -1).astype(np.int32)
    k_pages, v_pages = (np.zeros((3 * 301 // block + 3, block, hk, d), BF16) for _ in range(2))
    for row in range(3):
        for j, page in enumerate(pages[row]):
            keys = slice(j * block, min((j + 1) * block, 301))
            k_pages[page, :keys.stop - keys.start] = k_cache[row, keys]
            v_pages[page, :keys.stop - keys.start] = v_cache[row, keys]
    out = jax.jit(lambda *a: cuattn.jax.paged_attention(*a[:5], sinks=a[5], alibi_slopes=a[6]))(
        *put(device, q, k_pages, v_pages, pages, lens, sinks, slopes))
    check_decode(rng, BF16, q, k_cache, v_cache, lens, np.asarray(out), None, sinks=sinks, alibi_slopes=slopes)


def test_forward_only_functions_refuse_differentiation():
    q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
    lens = jnp.ones((1,), jnp.int32)
    with pytest.raises(TypeError, match=r"cuattn.jax.decode is forward-only \(no backward kernels\)"):
        jax.grad(lambda q: jnp.sum(cuattn.jax.decode(q, q, q, lens).astype(jnp.float32)))(q)
    pages = jnp.zeros((2, 4, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match=r"cuattn.jax.paged_attention is forward-only \(no backward kernels\)"):
        jax.grad(lambda q: jnp.sum(cuattn.jax.paged_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32),
                                                              lens).astype(jnp.float32)))(q)


def test_paged_attention_checks_a_table_it_is_given_on_the_cpu():
    """Eager and on the CPU the values are known: a block id outside the pool or a length past the
    table raises as the plain function's check=True does, rather than being clamped."""
    cpu = jax.devices("cpu")[0]
    q = jax.device_put(jnp.zeros((2, 1, 4, 16), jnp.bfloat16), cpu)
    pages = jax.device_put(jnp.zeros((6, 4, 2, 16), jnp.bfloat16), cpu)
    table = lambda rows: jax.device_put(jnp.array(rows, jnp.int32), cpu)
    lens = lambda values: jax.device_put(jnp.array(values, jnp.int32), cpu)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 is outside the pool of 6 blocks \(sequence 0 has "
                                         r"5 tokens\)"):
        cuattn.jax.paged_attention(q, pages, pages, table([[0, 9], [2, 3]]), lens([5, 8]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 exceeds what block_table holds: block_table.shape\[1\] "
                                         r"\(max_blocks\) = 2 x block_size 4 = 8 tokens"):
        cuattn.jax.paged_attention(q, pages, pages, table([[0, 1], [2, 3]]), lens([9, 8]))
    # traced values are not read: the kernel's clamp applies, as with check=False
    out = jax.jit(cuattn.jax.paged_attention)(q, pages, pages, table([[0, 9], [2, 3]]), lens([9, 8]))
    assert out.shape == (2, 1, 4, 16)


# ---------------------------------------------------------------------------------------------
# Which platform runs what; imports


def test_lowering_picks_the_kernels_on_cuda_and_the_reference_on_the_cpu():
    """Lowered for CUDA (no GPU needed to lower), the forward is a graph-safe buffer callback and
    the backward a plain one, and no host callback is left; lowered for the CPU, only host callbacks."""
    q = jnp.zeros((1, 5, 2, 64), jnp.bfloat16)
    train = jax.jit(jax.grad(lambda q: jnp.sum(cuattn.jax.attention(q, q, q).astype(jnp.float32))))
    on_cuda = train.trace(q).lower(lowering_platforms=("cuda",)).as_text()
    targets = sorted(line.split("custom_call @")[1].split("(")[0] for line in on_cuda.splitlines()
                     if "custom_call @" in line)
    assert targets == ["xla_buffer_python_gpu_callback", "xla_buffer_python_gpu_callback_cmd_buffer"], targets
    # On a GPU machine XLA refuses a CPU lowering of a computation placed on the GPU: place it
    # on the CPU device instead of naming the platform.
    on_cpu = train.trace(jax.device_put(q, jax.devices("cpu")[0])).lower().as_text()
    assert "buffer_python" not in on_cpu and "python_cpu_callback" in on_cpu


def test_cuattn_imports_jax_only_through_cuattn_jax():
    probe = ("import sys, cuattn; assert 'jax' not in sys.modules, 'import cuattn loaded jax'; "
             "import cuattn.jax; assert cuattn.jax.attention")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


# ---------------------------------------------------------------------------------------------
# Errors


_TRACED_CALLS = {
    "attention": lambda q: cuattn.attention(q, q, q),
    "attention_backward": lambda q: cuattn.attention_backward(q, q, q, q, q, np.zeros((1, 2, 3), np.float32))[0],
    "attention_varlen": lambda q: cuattn.attention_varlen(q[0], q[0], q[0], np.array([0, 3], np.int32),
                                                          np.array([0, 3], np.int32), 3, 3)[None],
    "decode": lambda q: cuattn.decode(q, q, q, np.full((1,), 3, np.int32)),
    "paged_attention": lambda q: cuattn.paged_attention(q, (q, q), np.zeros((1, 1), np.int32), np.ones((1,), np.int32)),
}


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
@pytest.mark.parametrize("name", list(_TRACED_CALLS))
def test_plain_functions_refuse_jax_tracers_and_point_to_cuattn_jax(name, transform):
    call = _TRACED_CALLS[name]
    q = jnp.zeros((1, 3, 2, 64), jnp.bfloat16)
    traced = {"jit": jax.jit(call), "grad": jax.grad(lambda q: jnp.sum(call(q).astype(jnp.float32))),
              "vmap": lambda q: jax.vmap(call)(q[None])}[transform]
    # the first array argument checked: dout for the backward, q elsewhere
    named = "dout" if name == "attention_backward" else "q"
    with pytest.raises(TypeError, match=rf"^{named} is a JAX tracer \(\w+Tracer\): .* use the same function from "
                                        r"cuattn\.jax"):
        traced(q)


def _dense(dtype=jnp.bfloat16, b=1, sq=5, sk=7, hq=4, hk=2, d=64):
    return jnp.zeros((b, sq, hq, d), dtype), jnp.zeros((b, sk, hk, d), dtype), jnp.zeros((b, sk, hk, d), dtype)


def _packed():
    """q (total_q = 5, Hq, D), k and v (total_k = 7, Hk, D)."""
    return tuple(x[0] for x in _dense())


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: cuattn.jax.attention(*_dense(jnp.float32)), TypeError,
         r"q.dtype is float32; cuattn.jax takes float16 or bfloat16 .* cast with q.astype\(jnp.bfloat16\)"),
        (lambda: cuattn.jax.attention(_dense()[0], *_dense(jnp.float16)[1:]), TypeError,
         r"k.dtype must equal q.dtype = bfloat16, got float16"),
        (lambda: cuattn.jax.attention(_dense(d=64)[0], *_dense(d=32)[1:]), ValueError,
         r"k.shape\[3\] \(head_dim\) must equal q.shape\[3\] = 64, got 32"),
        (lambda: cuattn.jax.attention(*_dense(hq=6, hk=4)), ValueError,
         r"q.shape\[2\] \(num_heads\) = 6 must be a multiple of k.shape\[2\] \(num_kv_heads\) = 4"),
        (lambda: cuattn.jax.attention(*_dense(d=12)), ValueError,
         r"q.shape\[-1\] \(head_dim\) = 12 is not supported: head_dim must be a multiple of 8 from 8 to 256"),
        (lambda: cuattn.jax.attention(_dense()[0][0], *_dense()[1:]), ValueError,
         r"q must be 4-D \(B, Sq, Hq, D\), got shape \(5, 4, 64\)"),
        (lambda: cuattn.jax.attention([[1.0]], *_dense()[1:]), TypeError,
         r"q must be a JAX or NumPy array, got builtins.list"),
        # a torch tensor has a shape and a dtype too: refused by name, not by NumPy reading its dtype
        (lambda: cuattn.jax.attention(Tensor((2, 5, 4, 64)), *_dense()[1:]), TypeError,
         r"q must be a JAX or NumPy array, got torch.Tensor"),
        (lambda: cuattn.jax.attention(*_dense(), causal=1), TypeError, r"causal must be a bool, got 1"),
        (lambda: cuattn.jax.attention(*_dense(), window=(-2, 0)), ValueError, r"window entries must be >= -1"),
        (lambda: cuattn.jax.attention(*_dense(), softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
        (lambda: jax.jit(lambda s: cuattn.jax.attention(*_dense(), scale=s))(0.5), TypeError,
         r"scale must be a Python value, got a traced array"),
        (lambda: cuattn.jax.attention(*_dense(), sinks=jnp.zeros(3, jnp.float32)), ValueError,
         r"sinks.shape\[0\] \(Hq\) must equal the number of query heads = 4, got 3"),
        (lambda: cuattn.jax.attention(*_dense(), sinks=jnp.zeros(4, jnp.bfloat16)), TypeError,
         r"sinks.dtype must be float32, got bfloat16"),
        (lambda: cuattn.jax.attention(*_dense(), sinks=jnp.zeros((1, 4), jnp.float32)), ValueError,
         r"sinks must be 1-D \(Hq\)"),
        (lambda: cuattn.jax.attention(*_dense(), alibi_slopes=jnp.zeros((2, 4), jnp.float32)), ValueError,
         r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 1, got 2"),
        (lambda: cuattn.jax.decode(*_dense(), jnp.ones((1,), jnp.int32), alibi_slopes=jnp.zeros(4, jnp.float16)),
         TypeError,
         r"alibi_slopes.dtype must be float32, got float16"),
        (lambda: cuattn.jax.attention_varlen(*_packed(), jnp.array([0, 5]), jnp.array([0, 7], jnp.float32), 5, 7),
         TypeError, r"cu_seqlens_k.dtype must be int32, got float32"),
        (lambda: cuattn.jax.attention_varlen(*_packed(), jnp.array([0, 5]), jnp.array([0, 2, 7]), 5, 7),
         ValueError, r"cu_seqlens_k.shape\[0\] \(B \+ 1\) must equal cu_seqlens_q.shape\[0\] = 2, got 3"),
        (lambda: cuattn.jax.attention_varlen(*_packed(), jnp.array([0, 5]), jnp.array([0, 7]), -1, 7),
         ValueError, r"max_seqlen_q must be an int >= 0, got -1"),
        (lambda: cuattn.jax.decode(_dense(sq=17)[0], *_dense()[1:], jnp.zeros((1,), jnp.int32)), ValueError,
         r"q.shape\[1\] \(Sq_new\) must be between 1 and 16, got 17"),
        (lambda: cuattn.jax.decode(*_dense(), jnp.zeros((2,), jnp.int32)), ValueError,
         r"cache_seqlens.shape\[0\] \(batch\) must equal q.shape\[0\] = 1, got 2"),
        (lambda: cuattn.jax.decode(*_dense(), jnp.zeros((1,), jnp.int32), num_splits=0), ValueError,
         r"num_splits must be None or an int from 1 to 128, got 0"),
        (lambda: cuattn.jax.paged_attention(_dense()[0], *_dense(b=4)[1:], jnp.zeros((2, 3), jnp.int32),
                                            jnp.zeros((1,), jnp.int32)), ValueError,
         r"block_table.shape\[0\] \(batch\) must equal q.shape\[0\] = 1, got 2"),
        (lambda: cuattn.jax.paged_attention(_dense()[0], *_dense(b=4, sk=300)[1:], jnp.zeros((1, 3), jnp.int32),
                                            jnp.zeros((1,), jnp.int32)), ValueError,
         r"k_pages.shape\[1\] \(block_size\) must be from 1 to 256, got 300"),
        (lambda: cuattn.jax.paged_attention(_dense()[0], *_dense(b=4)[1:], jnp.zeros((1, 3), jnp.int32),
                                            jnp.zeros((1,), jnp.int32), max_seq_len=0), ValueError,
         r"max_seq_len must be an int >= 1, got 0"),
        (lambda: cuattn.jax.decode(*_dense(), jnp.zeros((1,), jnp.int32), max_seq_len=0), ValueError,
         r"max_seq_len must be an int >= 1, got 0"),
    ],
    ids=["dtype", "mixed-dtypes", "head-dim", "gqa", "unsupported-head-dim", "ndim", "not-an-array", "torch-tensor", "causal-int",
         "window", "softcap", "traced-scale", "sinks-heads", "sinks-dtype", "sinks-ndim", "alibi-batch", "alibi-dtype", "cu-dtype", "cu-length", "max-seqlen", "sq-new", "lens-batch",
         "num-splits", "table-batch", "block-size", "max-seq-len", "decode-max-seq-len"],
)
def test_argument_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_numpy_arrays_jax_would_narrow_are_refused():
    """Without jax_enable_x64, jnp.asarray makes int64 int32 and float64 float32: a length of
    2**32 + 1 would run as 1. cuattn.jax refuses them, as the plain functions refuse int64."""
    q, k, v = _dense()
    with pytest.raises(TypeError, match=r"cache_seqlens.dtype is int64, which JAX would turn into int32; pass int32"):
        cuattn.jax.decode(q, k, v, np.array([2**32 + 1], np.int64))
    with pytest.raises(TypeError, match=r"q.dtype is float64, which JAX would turn into float32; pass float16 or "
                                        r"bfloat16"):
        cuattn.jax.attention(np.zeros(q.shape), k, v)
    # each argument's own dtype: float32 for sinks and slopes, int32 for prefix sums
    heads = q.shape[2]
    with pytest.raises(TypeError, match=r"^sinks.dtype is float64, which JAX would turn into float32; pass float32 "):
        cuattn.jax.attention(q, k, v, sinks=np.zeros(heads))
    with pytest.raises(TypeError, match=r"^alibi_slopes.dtype is float64, .*; pass float32 "):
        cuattn.jax.attention(q, k, v, alibi_slopes=np.ones(heads))
    with pytest.raises(TypeError, match=r"^cu_seqlens_q.dtype is float64, which JAX would turn into float32; pass int32 "):
        cuattn.jax.attention_varlen(q[0], k[0], v[0], np.array([0.0, q.shape[1]]),
                                    np.array([0, k.shape[1]], np.int32), q.shape[1], k.shape[1])


def test_concrete_prefix_sums_are_checked_before_the_call_on_the_cpu():
    """On the CPU their values cost no sync: a bad one raises ValueError before dispatch, not an XLA
    runtime error from inside the callback."""
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(x, cpu) for x in _packed())
    cu_q, cu_k = (jax.device_put(jnp.array(x, jnp.int32), cpu) for x in ([0, 5, 3], [0, 3, 7]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0 and be non-decreasing, got \[0, 5, 3\]"):
        cuattn.jax.attention_varlen(q, k, v, cu_q, cu_k, 5, 7)


# ---------------------------------------------------------------------------------------------
# ring_attention inside jax.shard_map: P simulated CPU devices in a child process (the device
# count is fixed when JAX starts)

_RING_PROBE = r"""
import os, sys
world, causal, platform = int(sys.argv[1]), sys.argv[2] == "causal", sys.argv[3]
if platform == "cpu":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import cuattn.jax
from cuattn import reference
from cuattn.distributed import zigzag_shard, zigzag_unshard
sys.path.insert(0, "tests")
from conftest import error_budget

rng = np.random.default_rng()
# CPU: chunks of 3 tokens, nothing tile-aligned; GPU: chunks of 75 tokens (several key blocks, ragged)
chunk, dim = (3, 32) if platform == "cpu" else (75, 128)
shape = lambda heads: (2, 2 * chunk * world, heads, dim)
q, dout = (rng.standard_normal(shape(4)).astype(np.float16) for _ in range(2))
k, v = (rng.standard_normal(shape(2)).astype(np.float16) for _ in range(2))
assert jax.default_backend() == platform, jax.default_backend()
mesh = jax.make_mesh((world,), ("ring",), devices=jax.devices()[:world])
spec = PartitionSpec(None, "ring")
lay = lambda x: np.concatenate([zigzag_shard(x, r, world) for r in range(world)], axis=1) if causal else x
unlay = lambda x: zigzag_unshard(np.split(np.asarray(x), world, axis=1)) if causal else np.asarray(x)
put = lambda x: jax.device_put(lay(x), NamedSharding(mesh, spec))
ring = jax.shard_map(lambda a, b, c: cuattn.jax.ring_attention(a, b, c, "ring", causal=causal), mesh=mesh,
                     in_specs=(spec, spec, spec), out_specs=spec)
out = unlay(jax.jit(ring)(put(q), put(k), put(v))).astype(np.float64)
cot = put(dout)
loss = lambda a, b, c: jnp.sum(ring(a, b, c).astype(jnp.float32) * cot.astype(jnp.float32))
grads = [unlay(g).astype(np.float64) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(put(q), put(k), put(v))]
ref, lse = reference.attention(q, k, v, causal=causal, return_lse=True)
ref_grads = reference.attention_backward(dout, q, k, v, ref, lse, causal=causal)
naive = reference.naive_attention_lowp(q, k, v, causal=causal, dtype=np.float16)
naive_grads = reference.naive_attention_backward_lowp(dout, q, k, v, causal=causal, dtype=np.float16)
checks = [("out", out, ref, naive, 2.0)] + [(n, g, r, l, 3.0) for n, g, r, l in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads)]
for name, got, exact, low, factor in checks:
    budget = error_budget(np.abs(low - exact).max(), np.float16, factor, np.abs(exact).max())
    err = np.abs(got - exact).max()
    assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g}"
print("ok")
"""


def _run_ring_probe(world, mask, platform):
    env = {**os.environ, "JAX_PLATFORMS": "cpu" if platform == "cpu" else "cuda"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off, as in the ring benchmark (BENCHMARKS.md)
    run = subprocess.run([sys.executable, "-c", _RING_PROBE, str(world), mask, platform], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_ring_attention_in_shard_map_equals_attention_over_the_whole_sequence(world, mask):
    """On P simulated CPU devices, out and the gradients of the shards, put back in sequence
    order, equal the float64 reference over the whole sequence under the 2x / 3x rule."""
    _run_ring_probe(world, mask, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_ring_attention_on_two_gpus_equals_attention_over_the_whole_sequence(mask):
    """The same check on two CUDA GPUs: the kernels through buffer_callback on each device, K and
    V (and the dK/dV accumulators) passed by ppermute over NVLink."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs visible to JAX, found {len(gpus)}")
    _run_ring_probe(2, mask, "gpu")


def test_ring_attention_argument_errors():
    q = jnp.zeros((1, 5, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(S_local\) = 5 must be even with causal=True"):
        cuattn.jax.ring_attention(q, q, q, "ring", causal=True)
    with pytest.raises(ValueError, match=r"k.shape\[1\] \(S_local\) must equal q.shape\[1\] = 5, got 4"):
        cuattn.jax.ring_attention(q, q[:, :4], q[:, :4], "ring")
