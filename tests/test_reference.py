"""Tests of the float64 NumPy references in ``cuattn.reference``.

Every test draws fresh random inputs; the seed is in each assertion message so a failure can
be replayed with ``np.random.default_rng(seed)``. All reference calls run under
``np.errstate(all="raise", under="ignore")`` so that a floating-point warning (e.g. -inf - -inf)
fails the test; underflow is the expected rounding of tiny probabilities, not a fault.
"""

import math

import ml_dtypes
import numpy as np
import pytest

from cuattn import reference
from conftest import prefix_sums

# Absolute tolerance for two float64 computations of the same quantity in different orders.
EXACT_TOL = 1e-12
# Step and tolerance of the central finite differences that check the backward pass.
FD_STEP = 1e-6
FD_TOL = 1e-7
# The naive same-precision emulations set every GPU test's error budget (the 2x / 3x rules). Their
# RMS error against float64, in units of the dtype's unit roundoff times the reference's RMS,
# measured 1.0-1.55 over random unit-normal problems of D = 64 (masks, softcap, sinks, ALiBi;
# forward and each gradient): a rounding done in the wrong dtype (about 3.6), a dropped option or
# factor (2 and far beyond) leaves this band.
LOWP_RMS_UNITS = (0.75, 1.9)
UNIT_ROUNDOFF = {np.dtype(np.float16): 2.0**-11, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
# Lengths that are not multiples of any tile size.
ODD_LENGTHS = (1, 17, 113)

WINDOWS = [(-1, -1), (3, 0), (0, 0), (4, 7), (-1, 2), (5, -1)]


@pytest.fixture
def seed():
    s = np.random.SeedSequence().entropy
    print(f"seed = {s}")
    return s


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _raise_on_fp_warnings():
    with np.errstate(all="raise", under="ignore"):
        yield


def randn(rng, *shape):
    return rng.standard_normal(shape)


def qkv(rng, b, sq, sk, hq, hk, d):
    return randn(rng, b, sq, hq, d), randn(rng, b, sk, hk, d), randn(rng, b, sk, hk, d)


def loop_attention(q, k, v, causal=False, scale=None, window=(-1, -1), softcap=0.0):
    """Independent per-(batch, head, row) implementation used as the oracle."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window
    out = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            for i in range(sq):
                keys = []
                for j in range(sk):
                    offset = j - (i + sk - sq)
                    if causal and offset > 0:
                        continue
                    if left >= 0 and offset < -left:
                        continue
                    if right >= 0 and offset > right:
                        continue
                    keys.append(j)
                if not keys:
                    continue
                s = scale * (k[bi, keys, kv] @ q[bi, i, h])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                e = np.exp(s - s.max())
                out[bi, i, h] = (e / e.sum()) @ v[bi, keys, kv]
                lse[bi, h, i] = s.max() + np.log(e.sum())
    return out, lse


def assert_close(actual, expected, seed, atol=EXACT_TOL, rtol=0.0, what=""):
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol,
                               err_msg=f"{what} seed={seed}")


# ---------------------------------------------------------------------------------- visible


@pytest.mark.parametrize("sq,sk", [(1, 1), (5, 5), (3, 8), (8, 3), (4, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_matches_rule(sq, sk, causal, window):
    left, right = window
    mask = reference.visible(sq, sk, causal, window)
    assert mask.shape == (sq, sk) and mask.dtype == bool
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            want = ((not causal or j <= diag) and (left == -1 or j >= diag - left)
                    and (right == -1 or j <= diag + right))
            assert mask[i, j] == want, (i, j)


def test_visible_causal_square_is_lower_triangular():
    np.testing.assert_array_equal(reference.visible(6, 6, causal=True),
                                  np.tril(np.ones((6, 6), dtype=bool)))


# -------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("sq,sk", [(17, 17), (5, 23), (23, 5), (1, 113)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((3, 0), 0.0), ((4, 7), 5.0),
                                            ((-1, -1), 2.0), ((0, 0), 0.0)])
def test_attention_matches_loop(rng, seed, hq, hk, sq, sk, causal, window, softcap):
    q, k, v = qkv(rng, 2, sq, sk, hq, hk, 8)
    out, lse = reference.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                   return_lse=True)
    want_out, want_lse = loop_attention(q, k, v, causal, None, window, softcap)
    assert out.dtype == np.float64 and out.shape == q.shape
    assert lse.shape == (2, hq, sq)
    assert_close(out, want_out, seed, what="out")
    assert_close(lse, want_lse, seed, what="lse")


def test_attention_explicit_scale(rng, seed):
    q, k, v = qkv(rng, 1, 9, 11, 2, 1, 16)
    out = reference.attention(q, k, v, scale=0.37)
    assert_close(out, loop_attention(q, k, v, scale=0.37)[0], seed)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_attention_accepts_low_precision_inputs(rng, seed, dtype):
    q, k, v = (x.astype(dtype) for x in qkv(rng, 2, 7, 9, 4, 2, 16))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                             causal=True, return_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert_close(out, want_out, seed, atol=0.0)
    assert_close(lse, want_lse, seed, atol=0.0)


def test_attention_chunks_heads_when_scores_are_large(rng, seed, monkeypatch):
    q, k, v = qkv(rng, 2, 13, 29, 8, 2, 8)
    want = reference.attention(q, k, v, causal=True, softcap=3.0, return_lse=True)
    # A tiny budget forces one head per chunk, exercising the chunked path.
    monkeypatch.setattr(reference, "_SCORE_CHUNK_ELEMENTS", 1)
    got = reference.attention(q, k, v, causal=True, softcap=3.0, return_lse=True)
    for g, w in zip(got, want):
        assert_close(g, w, seed)


# -------------------------------------------------------------------------- attention_tiled


@pytest.mark.parametrize("block_k", [1, 16, 64, 100])
@pytest.mark.parametrize("sq", ODD_LENGTHS)
@pytest.mark.parametrize("sk", ODD_LENGTHS)
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (9, 0), 4.0), (False, (2, 5), 0.0)])
def test_tiled_equals_attention(rng, seed, block_k, sq, sk, causal, window, softcap):
    q, k, v = qkv(rng, 1, sq, sk, 4, 2, 16)
    opts = dict(causal=causal, window=window, softcap=softcap, return_lse=True)
    out, lse = reference.attention_tiled(q, k, v, block_k=block_k, **opts)
    want_out, want_lse = reference.attention(q, k, v, **opts)
    assert_close(out, want_out, seed, what="out")
    assert_close(lse, want_lse, seed, what="lse")


# ------------------------------------------------------------------------------- empty rows


def check_empty_rows(out, lse, rows, seed):
    assert not np.isnan(out).any() and not np.isnan(lse).any(), f"seed={seed}"
    assert (out[:, rows] == 0).all(), f"seed={seed}"
    assert (lse[:, :, rows] == -np.inf).all(), f"seed={seed}"
    others = np.setdiff1d(np.arange(out.shape[1]), rows)
    assert np.isfinite(lse[:, :, others]).all(), f"seed={seed}"


@pytest.mark.parametrize("fn", ["attention", "attention_tiled"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (0, 0)), (True, (0, 0))])
def test_empty_rows_give_zero_and_minus_inf(rng, seed, fn, causal, window):
    sq, sk = 11, 4
    q, k, v = qkv(rng, 2, sq, sk, 4, 2, 8)
    out, lse = getattr(reference, fn)(q, k, v, causal=causal, window=window, return_lse=True)
    # Bottom-right alignment puts the first sq - sk queries before every key.
    check_empty_rows(out, lse, np.arange(sq - sk), seed)


def test_empty_rows_with_no_keys(rng, seed):
    q, k, v = qkv(rng, 2, 5, 0, 2, 2, 8)
    out, lse = reference.attention(q, k, v, return_lse=True)
    check_empty_rows(out, lse, np.arange(5), seed)
    dq, dk, dv = reference.attention_backward(randn(rng, *q.shape), q, k, v, out, lse)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


def test_backward_of_empty_rows_is_zero(rng, seed):
    q, k, v = qkv(rng, 1, 9, 4, 2, 1, 8)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    dq, _, _ = reference.attention_backward(randn(rng, *q.shape), q, k, v, out, lse, causal=True)
    assert np.isfinite(dq).all(), f"seed={seed}"
    assert (dq[:, :5] == 0).all(), f"seed={seed}"


# --------------------------------------------------------------------------------- backward


def check_backward_by_finite_differences(q, k, v, dout, seed, **opts):
    """reference.attention_backward's dq, dk, dv equal the finite differences of sum(out * dout)."""

    def loss():
        return np.sum(reference.attention(q, k, v, **opts) * dout)

    out, lse = reference.attention(q, k, v, return_lse=True, **opts)
    got = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    want = finite_difference_grads(loss, [q, k, v])
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape
        assert_close(g, w, seed, atol=FD_TOL, rtol=FD_TOL, what=f"d{name}")


def finite_difference_grads(loss, arrays):
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + FD_STEP
            plus = loss()
            x[idx] = orig - FD_STEP
            minus = loss()
            x[idx] = orig
            g[idx] = (plus - minus) / (2 * FD_STEP)
        grads.append(g)
    return grads


@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3), (4, 4)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (1, 1), 0.0), (True, (2, 0), 1.5),
                                                   (False, (-1, -1), 0.8)])
def test_backward_matches_finite_differences(rng, seed, hq, hk, sq, sk, causal, window, softcap):
    q, k, v = qkv(rng, 2, sq, sk, hq, hk, 3)
    dout = randn(rng, 2, sq, hq, 3)
    opts = dict(causal=causal, window=window, softcap=softcap, scale=0.9)

    check_backward_by_finite_differences(q, k, v, dout, seed, **opts)


# ----------------------------------------------------------------------------------- varlen


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (True, (5, 0), 3.0), (False, (2, 2), 0.0)])
def test_varlen_equals_per_sequence(rng, seed, causal, window, softcap):
    lens_q = np.array([3, 0, 17, 1, 9])
    lens_k = np.array([5, 4, 17, 0, 23])
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    hq, hk, d = 4, 2, 8
    q = randn(rng, cu_q[-1], hq, d)
    k, v = randn(rng, cu_k[-1], hk, d), randn(rng, cu_k[-1], hk, d)
    dout = randn(rng, *q.shape)
    opts = dict(causal=causal, window=window, softcap=softcap)
    args = (cu_q, cu_k, int(lens_q.max()), int(lens_k.max()))
    out, lse = reference.attention_varlen(q, k, v, *args, return_lse=True, **opts)
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, out, lse, *args, **opts)
    assert out.shape == q.shape and lse.shape == (hq, cu_q[-1])
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = reference.attention(q[None, qs], k[None, ks], v[None, ks], return_lse=True, **opts)
        assert_close(out[qs], o[0], seed, what=f"out seq {b}")
        assert_close(lse[:, qs], l[0], seed, what=f"lse seq {b}")
        g = reference.attention_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                                         o, l, **opts)
        for name, got, want in zip("qkv", (dq[qs], dk[ks], dv[ks]), g):
            assert_close(got, want[0], seed, what=f"d{name} seq {b}")


# ----------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("sq_new", [1, 3])
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 0.0),
                                                   (True, (6, 0), 2.0)])
def test_decode_equals_attention_on_sliced_cache(rng, seed, sq_new, causal, window, softcap):
    seqlens = np.array([0, 1, 7, 30, 32], dtype=np.int32)
    b, s_max, hq, hk, d = len(seqlens), 32, 8, 2, 16
    q = randn(rng, b, sq_new, hq, d)
    k_cache, v_cache = randn(rng, b, s_max, hk, d), randn(rng, b, s_max, hk, d)
    for bi, n in enumerate(seqlens):
        # Poison the stale slots: the reference must never read past cache_seqlens.
        k_cache[bi, n:] = np.nan
        v_cache[bi, n:] = np.nan
    opts = dict(causal=causal, window=window, softcap=softcap)
    out, lse = reference.decode(q, k_cache, v_cache, seqlens, return_lse=True, **opts)
    assert out.shape == q.shape and lse.shape == (b, hq, sq_new)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), f"seed={seed}"
    for bi, n in enumerate(seqlens):
        o, l = reference.attention(q[bi:bi + 1], k_cache[bi:bi + 1, :n], v_cache[bi:bi + 1, :n],
                                   return_lse=True, **opts)
        assert_close(out[bi], o[0], seed, what=f"out row {bi}")
        assert_close(lse[bi], l[0], seed, what=f"lse row {bi}")
    # An empty cache leaves every new token without keys.
    check_empty_rows(out[:1], lse[:1], np.arange(sq_new), seed)
    if causal and sq_new > 1:
        # With one key, only the last new token sees it.
        check_empty_rows(out[1:2], lse[1:2], np.arange(sq_new - 1), seed)


def test_decode_causal_new_token_sees_its_prefix(rng, seed):
    q = randn(rng, 1, 2, 2, 8)
    k_cache, v_cache = randn(rng, 1, 10, 2, 8), randn(rng, 1, 10, 2, 8)
    out = reference.decode(q, k_cache, v_cache, np.array([6]))
    # New token 0 of 2 with 6 cached keys sees keys 0..4; token 1 sees keys 0..5.
    first = reference.attention(q[:, :1], k_cache[:, :5], v_cache[:, :5])
    last = reference.attention(q[:, 1:], k_cache[:, :6], v_cache[:, :6])
    assert_close(out[:, :1], first, seed)
    assert_close(out[:, 1:], last, seed)


# ------------------------------------------------------------------------------ merge_states


@pytest.mark.parametrize("split", [0, 1, 20, 37, 57])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_merge_two_halves_equals_full(rng, seed, split, softcap):
    q, k, v = qkv(rng, 2, 9, 57, 4, 2, 8)
    full_out, full_lse = reference.attention(q, k, v, softcap=softcap, return_lse=True)
    a = reference.attention(q, k[:, :split], v[:, :split], softcap=softcap, return_lse=True)
    b = reference.attention(q, k[:, split:], v[:, split:], softcap=softcap, return_lse=True)
    out, lse = reference.merge_states(a[0], a[1], b[0], b[1])
    assert_close(out, full_out, seed, what="out")
    assert_close(lse, full_lse, seed, what="lse")


def test_merge_list_of_three(rng, seed):
    q, k, v = qkv(rng, 2, 6, 40, 4, 4, 8)
    full_out, full_lse = reference.attention(q, k, v, return_lse=True)
    parts = [reference.attention(q, k[:, s], v[:, s], return_lse=True)
             for s in (slice(0, 7), slice(7, 31), slice(31, 40))]
    out, lse = reference.merge_states(parts)
    assert_close(out, full_out, seed, what="out")
    assert_close(lse, full_lse, seed, what="lse")


def test_merge_varlen_layout(rng, seed):
    t, h, d = 13, 4, 8
    q = randn(rng, t, h, d)
    k, v = randn(rng, 20, h, d), randn(rng, 20, h, d)
    cu_q, cu_k = np.array([0, t], dtype=np.int32), np.array([0, 20], dtype=np.int32)
    full = reference.attention_varlen(q, k, v, cu_q, cu_k, t, 20, return_lse=True)
    half = np.array([0, 10], dtype=np.int32)
    a = reference.attention_varlen(q, k[:10], v[:10], cu_q, half, t, 10, return_lse=True)
    b = reference.attention_varlen(q, k[10:], v[10:], cu_q, half, t, 10, return_lse=True)
    out, lse = reference.merge_states([a, b])
    assert lse.shape == (h, t)
    assert_close(out, full[0], seed, what="out")
    assert_close(lse, full[1], seed, what="lse")


def test_merge_all_empty_gives_zero_and_minus_inf(rng, seed):
    b, s, h, d = 2, 5, 3, 4
    empty = (np.zeros((b, s, h, d)), np.full((b, h, s), -np.inf))
    out, lse = reference.merge_states([empty, empty, empty])
    assert (out == 0).all() and (lse == -np.inf).all()


def test_merge_mixed_empty_rows(rng, seed):
    # Row-wise mix: causal parts leave some rows empty in one half and not the other.
    q, k, v = qkv(rng, 1, 8, 8, 2, 2, 4)
    full = reference.attention(q, k, v, causal=True, return_lse=True)
    mask = reference.visible(8, 8, causal=True)
    parts = []
    for keys in (slice(0, 3), slice(3, 8)):
        s = np.einsum("bihd,bjhd->bhij", q, k[:, keys]) / math.sqrt(4)
        s = np.where(mask[:, keys], s, -np.inf)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        m0 = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m0)
        l = e.sum(axis=-1, keepdims=True)
        o = np.einsum("bhij,bjhd->bihd", e / np.where(l > 0, l, 1.0), v[:, keys])
        with np.errstate(divide="ignore"):
            lse = np.where(l > 0, m0 + np.log(l), -np.inf)[..., 0]
        parts.append((o, lse))
    out, lse = reference.merge_states(parts)
    assert_close(out, full[0], seed, what="out")
    assert_close(lse, full[1], seed, what="lse")


def test_merge_rejects_wrong_arity():
    with pytest.raises(TypeError, match=r"merge_states takes \(out_a, lse_a, out_b, lse_b\) or one list of \(out, lse\) "
                                        r"pairs, got 2 positional arguments"):
        reference.merge_states(np.zeros(1), np.zeros(1))


# ------------------------------------------------------------------------------------ paged


def shuffled_block_table(rng, seqlens, block_size, extra_blocks=3):
    """Block table whose rows use a random permutation of the physical blocks."""
    blocks_per_row = [-(-int(n) // block_size) for n in seqlens]
    num_blocks = sum(blocks_per_row) + extra_blocks
    physical = rng.permutation(num_blocks)
    table = np.zeros((len(seqlens), max(1, max(blocks_per_row))), dtype=np.int32)
    used = 0
    for bi, nb in enumerate(blocks_per_row):
        table[bi, :nb] = physical[used:used + nb]
        used += nb
    return table, num_blocks


def to_pages(cache, table, seqlens, num_blocks, block_size):
    """Scatter a contiguous cache into its physical blocks; slots holding no token are NaN."""
    pages = np.full((num_blocks, block_size) + cache.shape[2:], np.nan)
    for bi, n in enumerate(seqlens):
        for t in range(int(n)):
            pages[table[bi, t // block_size], t % block_size] = cache[bi, t]
    return pages


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("sq_new,causal,softcap", [(1, True, 0.0), (3, True, 2.5), (2, False, 0.0)])
def test_paged_equals_decode_on_contiguous(rng, seed, block_size, sq_new, causal, softcap):
    seqlens = np.array([0, 1, 16, 23, 40], dtype=np.int32)
    b, hq, hk, d = len(seqlens), 4, 2, 8
    k_cache, v_cache = randn(rng, b, 40, hk, d), randn(rng, b, 40, hk, d)
    for bi, n in enumerate(seqlens):
        k_cache[bi, n:] = 0.0
        v_cache[bi, n:] = 0.0
    table, num_blocks = shuffled_block_table(rng, seqlens, block_size)
    k_pages = to_pages(k_cache, table, seqlens, num_blocks, block_size)
    v_pages = to_pages(v_cache, table, seqlens, num_blocks, block_size)
    for pages, cache in ((k_pages, k_cache), (v_pages, v_cache)):
        np.testing.assert_array_equal(reference.gather_pages(pages, table, seqlens), cache,
                                      err_msg=f"seed={seed}")
    q = randn(rng, b, sq_new, hq, d)
    opts = dict(causal=causal, softcap=softcap, return_lse=True)
    out, lse = reference.paged_attention(q, k_pages, v_pages, table, seqlens, **opts)
    want_out, want_lse = reference.decode(q, k_cache, v_cache, seqlens, **opts)
    assert_close(out, want_out, seed, what="out")
    assert_close(lse, want_lse, seed, what="lse")


def test_gather_pages_all_empty_has_one_position():
    pages = np.ones((2, 4, 1, 3))
    cache = reference.gather_pages(pages, np.zeros((3, 1), dtype=np.int32), np.zeros(3, np.int32))
    assert cache.shape == (3, 1, 1, 3) and (cache == 0).all()


# --------------------------------------------------------------------------------- low-prec


ALIBI_SLOPES = 2.0 ** (-8.0 * np.arange(1, 5) / 4)  # the standard slopes of 4 heads

# Options of the low-precision emulation tests (B = 2, Hq = 4, D = 64). "scale" is explicit and
# unlike the default 1 / sqrt(64): a helper that ignores it misses by far more than the band
# (0.1 measured 1.0-1.45 units over 60 seeds; a larger one such as 0.3 sharpens the softmax, and
# its larger rounded scores alone measure about 2, past the band). "alibi-per-sequence" gives
# each sequence its own, distinct (B, Hq) row of slopes.
LOWP_OPTIONS = {
    "full": lambda rng: {},
    "causal": lambda rng: {"causal": True},
    "scale": lambda rng: {"scale": 0.1},
    "window-softcap": lambda rng: {"window": (20, 3), "softcap": 5.0},
    "sinks": lambda rng: {"sinks": (2 * rng.standard_normal(4)).astype(np.float32)},
    "alibi": lambda rng: {"causal": True, "alibi_slopes": ALIBI_SLOPES.astype(np.float32)},
    "alibi-per-sequence": lambda rng: {
        "causal": True, "alibi_slopes": np.stack([ALIBI_SLOPES, 4 * ALIBI_SLOPES[::-1]]).astype(np.float32)},
}


def _rms_units(low, ref, dtype):
    """RMS error in units of the dtype's unit roundoff times the reference's RMS."""
    def rms(x):
        return float(np.sqrt(np.mean(np.square(x))))

    return rms(low - ref) / (UNIT_ROUNDOFF[np.dtype(dtype)] * rms(ref))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", LOWP_OPTIONS)
def test_naive_lowp_error_is_about_one_unit_roundoff(rng, seed, dtype, case):
    """The forward emulation's error sits in LOWP_RMS_UNITS of its dtype: not exact, and no
    larger than its roundings make it (so the budgets it sets are neither 0 nor inflated)."""
    q, k, v = qkv(rng, 2, 64, 80, 4, 2, 64)
    options = LOWP_OPTIONS[case](rng)
    ref = reference.attention(q, k, v, **options)
    low = reference.naive_attention_lowp(q, k, v, dtype=dtype, **options)
    assert low.dtype == np.float64 and low.shape == ref.shape
    units = _rms_units(low, ref, dtype)
    assert LOWP_RMS_UNITS[0] < units < LOWP_RMS_UNITS[1], f"{units:.2f} units (seed {seed})"


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", LOWP_OPTIONS)
def test_naive_backward_lowp_error_is_about_one_unit_roundoff(rng, seed, dtype, case):
    """The same for the backward emulation's dq, dk and dv against the float64 backward."""
    q, k, v = qkv(rng, 2, 64, 80, 4, 2, 64)
    options = LOWP_OPTIONS[case](rng)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    dout = randn(rng, *out.shape)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **options)[:3]
    lows = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=dtype, **options)
    for name, low, ref in zip(("dq", "dk", "dv"), lows, grads):
        assert low.shape == ref.shape, name
        units = _rms_units(low, ref, dtype)
        assert LOWP_RMS_UNITS[0] < units < LOWP_RMS_UNITS[1], f"{name}: {units:.2f} units (seed {seed})"


def test_naive_lowp_bf16_is_coarser_than_fp16(rng, seed):
    q, k, v = qkv(rng, 1, 64, 64, 4, 4, 64)
    ref = reference.attention(q, k, v)
    err = {dt: np.abs(reference.naive_attention_lowp(q, k, v, dtype=dt) - ref).max()
           for dt in (np.float16, "bfloat16")}
    assert err["bfloat16"] > err[np.float16], f"{err} seed={seed}"


def test_naive_lowp_empty_rows_are_zero(rng, seed):
    q, k, v = qkv(rng, 1, 7, 3, 2, 1, 64)
    low = reference.naive_attention_lowp(q, k, v, causal=True, dtype=np.float16)
    assert not np.isnan(low).any() and (low[:, :4] == 0).all(), f"seed={seed}"


# ------------------------------------------------------------------------------------ sinks


def _with_sink_column(q, k, v, sinks, **opts):
    """Attention with sinks, computed as the textbook softmax over the scores plus one extra column
    per head holding the sink logit, whose value row is 0."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    scale = opts.get("scale") or 1 / math.sqrt(d)
    mask = reference.visible(sq, sk, opts.get("causal", False), opts.get("window", (-1, -1)))
    group = hq // k.shape[2]
    out = np.zeros((b, sq, hq, d))
    lse = np.zeros((b, hq, sq))
    for bi in range(b):
        for h in range(hq):
            s = np.where(mask, scale * q[bi, :, h] @ k[bi, :, h // group].T, -np.inf)
            full = np.concatenate([s, np.full((sq, 1), sinks[h])], axis=1)
            m = full.max(axis=1, keepdims=True)
            e = np.exp(full - m)
            out[bi, :, h] = e[:, :-1] @ v[bi, :, h // group] / e.sum(axis=1, keepdims=True)
            lse[bi, h] = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    return out, lse


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (1, 2))])
def test_sinks_equal_an_extra_value_less_column(rng, seed, causal, window):
    q, k, v = qkv(rng, 2, 5, 7, 4, 2, 8)
    sinks = rng.standard_normal(4) * 2
    with np.errstate(all="raise", under="ignore"):
        out, lse = reference.attention(q, k, v, causal=causal, window=window, sinks=sinks, return_lse=True)
    want_out, want_lse = _with_sink_column(q, k, v, sinks, causal=causal, window=window)
    assert_close(out, want_out, seed, atol=EXACT_TOL, rtol=EXACT_TOL, what="out")
    assert_close(lse, want_lse, seed, atol=EXACT_TOL, rtol=EXACT_TOL, what="lse")


def test_sinks_backward_matches_finite_differences(rng, seed):
    q, k, v = qkv(rng, 2, 4, 6, 4, 2, 3)
    dout = randn(rng, 2, 4, 4, 3)
    sinks = rng.standard_normal(4)
    opts = dict(causal=True, softcap=1.5, scale=0.9)

    def loss():
        return np.sum(reference.attention(q, k, v, sinks=sinks, **opts) * dout)

    out, lse = reference.attention(q, k, v, return_lse=True, sinks=sinks, **opts)
    got = reference.attention_backward(dout, q, k, v, out, lse, sinks=sinks, **opts)
    want = finite_difference_grads(loss, [q, k, v, sinks])
    assert len(got) == 4
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close(g, w, seed, atol=FD_TOL, rtol=FD_TOL, what=name)


def test_sinks_on_the_cpu_path_and_their_errors(rng, seed):
    import cuattn

    q, k, v = (x.astype(np.float32) for x in qkv(rng, 1, 6, 6, 4, 4, 32))
    sinks = rng.standard_normal(4).astype(np.float32)
    got = cuattn.attention(q, k, v, sinks=sinks)
    assert_close(got, _with_sink_column(q, k, v, sinks)[0], seed, atol=1e-6, rtol=1e-6, what="out")
    cu = np.array([0, 2, 6], np.int32)
    varlen = cuattn.attention_varlen(q[0], k[0], v[0], cu, cu, 4, 4, sinks=sinks)
    first = _with_sink_column(q[:, :2], k[:, :2], v[:, :2], sinks)[0][0]
    assert_close(varlen[:2], first, seed, atol=1e-6, rtol=1e-6, what="varlen out")
    with pytest.raises(ValueError, match=r"sinks.shape\[0\] \(Hq\) must equal the number of query heads = 4, got 2"):
        cuattn.attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks.dtype must be float32, got int64"):
        cuattn.attention(q, k, v, sinks=np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="sinks.dtype must be float32, got float64"):
        cuattn.attention(q, k, v, sinks=np.zeros(4))
    lse = cuattn.attention(q, k, v, sinks=sinks, return_lse=True)[1]
    grads = cuattn.attention_backward(q, q, k, v, got, lse, sinks=sinks)
    assert len(grads) == 4 and grads[3].dtype == np.float32 and grads[3].shape == (4,)
    # the values: the float64 backward's (itself checked against finite differences above)
    want = reference.attention_backward(q, q, k, v, got, lse, sinks=sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert_close(g, w, seed, atol=1e-5, rtol=1e-5, what=name)
    # varlen: each sequence's gradients, dsinks summed over the sequences
    varlen, varlen_lse = cuattn.attention_varlen(q[0], k[0], v[0], cu, cu, 4, 4, sinks=sinks, return_lse=True)
    dout = rng.standard_normal(varlen.shape).astype(np.float32)
    dq, dk, dv, dsinks = cuattn.attention_varlen_backward(dout, q[0], k[0], v[0], varlen, varlen_lse, cu, cu, 4, 4,
                                                          sinks=sinks)
    want_dsinks = np.zeros(4)
    for rows in (slice(0, 2), slice(2, 6)):
        one = reference.attention_backward(dout[None, rows], q[:, rows], k[:, rows], v[:, rows], varlen[None, rows],
                                           varlen_lse[None, :, rows], sinks=sinks)
        for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), one):
            assert_close(g[rows], w[0], seed, atol=1e-5, rtol=1e-5, what=f"varlen {name}")
        want_dsinks += one[3]
    assert_close(dsinks, want_dsinks, seed, atol=1e-5, rtol=1e-5, what="varlen dsinks")


# ------------------------------------------------------------------------------------ ALiBi


def _explicit_alibi(q, k, v, slopes, causal=False, window=(-1, -1), softcap=0.0):
    """ALiBi as a textbook bias matrix, one (batch, head, query, key) at a time: score = cap(scale
    q.k) - slope * |i + Sk - Sq - j| over the visible keys. ``slopes`` is (Hq,) or (B, Hq)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    slopes = np.asarray(slopes, np.float64)
    mask = reference.visible(sq, sk, causal, window)
    out = np.zeros(q.shape)
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            slope = slopes[h] if slopes.ndim == 1 else slopes[bi, h]
            kv = h // (hq // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if mask[i, j]]
                if not keys:
                    continue
                s = (k[bi, keys, kv] @ q[bi, i, h]) / math.sqrt(d)
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                s = s - slope * np.array([abs(i + sk - sq - j) for j in keys])
                m = s.max()
                out[bi, i, h] = np.exp(s - m) @ v[bi, keys, kv] / np.exp(s - m).sum()
                lse[bi, h, i] = m + np.log(np.exp(s - m).sum())
    return out, lse


def _slopes(rng, *shape):
    """ALiBi's geometric slopes (2^(-8 h / H)) scaled per entry, so that (B, Hq) rows differ."""
    heads = shape[-1]
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads) * rng.uniform(0.5, 2.0, shape)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["Hq", "B-Hq"])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (2, 3), 0.0), (True, (-1, -1), 1.5)])
def test_alibi_equals_an_explicit_bias(rng, seed, per_sequence, sq, sk, causal, window, softcap):
    """Bottom-right aligned distances with causal masks and windows (Sq > Sk leaves rows empty:
    out 0, lse -inf, unaffected by the bias), and the bias added after the softcap."""
    q, k, v = qkv(rng, 2, sq, sk, 4, 2, 8)
    slopes = _slopes(rng, 2, 4) if per_sequence else _slopes(rng, 4)
    out, lse = reference.attention(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                                   return_lse=True)
    want_out, want_lse = _explicit_alibi(q, k, v, slopes, causal=causal, window=window, softcap=softcap)
    assert_close(out, want_out, seed, what="out")
    assert_close(lse, want_lse, seed, what="lse")
    # the bias must matter: without it the result differs
    assert np.abs(out - reference.attention(q, k, v, causal=causal, window=window, softcap=softcap)).max() > 1e-3


def test_alibi_hq_slopes_serve_every_sequence(rng, seed):
    q, k, v = qkv(rng, 3, 7, 11, 4, 4, 8)
    slopes = _slopes(rng, 4)
    shared = reference.attention(q, k, v, causal=True, alibi_slopes=slopes)
    tiled = reference.attention(q, k, v, causal=True, alibi_slopes=np.tile(slopes, (3, 1)))
    assert_close(shared, tiled, seed)


def test_alibi_varlen_uses_each_sequences_own_lengths(rng, seed):
    """Sequence b's distances are i + Sk_b - Sq_b - j: its own lengths and (B, Hq) row."""
    lens_q, lens_k = [3, 0, 8, 5], [7, 4, 8, 2]
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q = randn(rng, cu_q[-1], 4, 8)
    k, v = randn(rng, cu_k[-1], 2, 8), randn(rng, cu_k[-1], 2, 8)
    slopes = _slopes(rng, 4, 4)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                          alibi_slopes=slopes, return_lse=True)
    for b in range(len(lens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = _explicit_alibi(q[None, qs], k[None, ks], v[None, ks], slopes[b], causal=True)
        assert_close(out[qs], o[0], seed, what=f"out seq {b}")
        assert_close(lse[:, qs], l[0], seed, what=f"lse seq {b}")


def test_alibi_decode_with_several_new_queries(rng, seed):
    """Decode: Sq is the number of new tokens, Sk the row's cache length (stale slots unread)."""
    lens = np.array([9, 3, 0], np.int32)
    q = randn(rng, 3, 3, 4, 8)
    k_cache, v_cache = randn(rng, 3, 12, 2, 8), randn(rng, 3, 12, 2, 8)
    slopes = _slopes(rng, 3, 4)
    out, lse = reference.decode(q, k_cache, v_cache, lens, alibi_slopes=slopes, return_lse=True)
    for b, n in enumerate(lens):
        o, l = _explicit_alibi(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], slopes[b], causal=True)
        assert_close(out[b], o[0], seed, what=f"out row {b}")
        assert_close(lse[b], l[0], seed, what=f"lse row {b}")
    table = np.arange(3 * 4, dtype=np.int32).reshape(3, 4)
    pages = (k_cache.reshape(12, 3, 2, 8), v_cache.reshape(12, 3, 2, 8))
    paged = reference.paged_attention(q, *pages, table, lens, alibi_slopes=slopes)
    assert_close(paged, out, seed, what="paged")


@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.7)])
def test_alibi_backward_matches_finite_differences(rng, seed, causal, softcap):
    """The bias is a constant of (i, j): dq, dk, dv follow; the softcap's derivative is the
    capped score's, not the biased one's."""
    q, k, v = qkv(rng, 2, 4, 5, 2, 1, 3)
    dout = randn(rng, 2, 4, 2, 3)
    opts = dict(causal=causal, softcap=softcap, scale=0.9, alibi_slopes=_slopes(rng, 2, 2))

    check_backward_by_finite_differences(q, k, v, dout, seed, **opts)


def test_alibi_on_the_cpu_path_and_its_errors(rng, seed):
    import cuattn

    q, k, v = (x.astype(np.float32) for x in qkv(rng, 2, 6, 6, 4, 4, 32))
    slopes = _slopes(rng, 4).astype(np.float32)
    got = cuattn.attention(q, k, v, causal=True, alibi_slopes=slopes)
    assert_close(got, _explicit_alibi(q, k, v, slopes, causal=True)[0], seed, atol=1e-6, rtol=1e-6, what="out")
    out, lse = cuattn.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    grads = cuattn.attention_backward(q, q, k, v, out, lse, alibi_slopes=slopes)
    want = reference.attention_backward(q, q, k, v, out, lse, alibi_slopes=slopes)
    assert len(grads) == 3
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(g, w, seed, atol=1e-5, rtol=1e-5, what=name)
    # against the gradients without ALiBi, which differ (the slopes reach the backward)
    assert not np.allclose(grads[0], reference.attention_backward(q, q, k, v, out, lse)[0], atol=1e-3)
    cu = np.array([0, 2, 6], np.int32)
    varlen = cuattn.attention_varlen(q[0], k[0], v[0], cu, cu, 4, 4, alibi_slopes=np.stack([slopes, slopes / 2]))
    second = _explicit_alibi(q[:, 2:], k[:, 2:], v[:, 2:], slopes / 2)[0][0]
    assert_close(varlen[2:], second, seed, atol=1e-6, rtol=1e-6, what="varlen out")
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(Hq\) must equal the number of query heads = 4, "
                                         r"got 2"):
        cuattn.attention(q, k, v, alibi_slopes=slopes[:2])
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[1\] \(Hq\) must equal the number of query heads = 4, "
                                         r"got 3"):
        cuattn.attention(q, k, v, alibi_slopes=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 2, got 3"):
        cuattn.attention(q, k, v, alibi_slopes=np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 2, got 1"):
        cuattn.attention_varlen(q[0], k[0], v[0], cu, cu, 4, 4, alibi_slopes=slopes[None])
    with pytest.raises(ValueError, match=r"alibi_slopes must be 1-D \(Hq\) or 2-D \(B, Hq\), got shape \(1, 2, 4\)"):
        cuattn.attention(q, k, v, alibi_slopes=np.zeros((1, 2, 4), np.float32))
    with pytest.raises(TypeError, match="alibi_slopes.dtype must be float32, got int32"):
        cuattn.attention(q, k, v, alibi_slopes=np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="alibi_slopes.dtype must be float32, got float64"):
        cuattn.attention(q, k, v, alibi_slopes=np.zeros(4))
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 2, got 5"):
        cuattn.decode(q[:, :1], k, v, np.array([6, 3], np.int32), alibi_slopes=np.zeros((5, 4), np.float32))
