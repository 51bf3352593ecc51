"""Forward attention on the GPU against the float64 reference, torch SDPA and itself.

Every case draws fresh inputs, poisons the output buffer with NaN before the launch, and checks
the result under the tolerance rule (README, "Tests"): max error at most 2x that of the straightforward
same-precision computation (matmul, softmax, matmul), plus a floor.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cuattn
from cuattn import _jit, _registry, reference
from conftest import (DTYPE_IDS, DTYPES, RISES, TILE_ORDER_CHUNK, check_varlen, error_budget, expected_tile_order,
                      forward_kernels, import_jax, prefix_sums, randn, rising_scores)

pytestmark = pytest.mark.gpu

HEAD_DIMS = list(_registry.test_head_dims("attention"))
MASKS = _registry.MASK_OPTIONS
attention_module = importlib.import_module("cuattn.attention")  # the module, not cuattn.attention the function


@pytest.fixture(autouse=True)
def fwd_kernel(forward_kernel, request, monkeypatch):
    """Every test here runs on both forward kernels (conftest's forward_kernel): the Hopper one
    (flash_fwd_sm90_kernel, where a tile holds the head dim, on the dynamic tile schedule;
    test_sm90_schedules runs the static one too) and the mma.sync one."""
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", "dynamic")  # whatever the dispatcher's default
    head_dim = getattr(request.node, "callspec", None) and request.node.callspec.params.get("head_dim")
    if forward_kernel == "sm90" and head_dim and attention_module.fwd_sm90_tile_dims(head_dim, head_dim) is None:
        pytest.skip(f"D = {head_dim} runs flash_fwd_kernel on sm_90a too: the mma pass covers it")
    return forward_kernel


@pytest.mark.parametrize("head_dim", sorted(d for d, dv in attention_module.FWD_SM90_TILES if d == dv))
def test_hopper_kernel_runs_where_it_has_a_tile(rng, caplog, fwd_kernel, head_dim):
    """The debug log names the kernel: the Hopper one for its head dims and any view the TMA reads,
    the mma.sync one when the Hopper table is emptied or a row stride is not a multiple of 16 bytes."""
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (1, 130, 2, head_dim), np.float16))
    with caplog.at_level("DEBUG", logger="cuattn"):
        cuattn.attention(q, q, q)
    chosen = forward_kernels(caplog)
    expected = "flash_fwd_sm90_kernel" if fwd_kernel == "sm90" else "flash_fwd_kernel"
    assert chosen and expected in chosen[-1], chosen
    # k and v broadcast over the heads (head stride 0): the TMA needs positive strides, so the
    # mma.sync kernel takes the call
    kv = cupy.asarray(randn(rng, (1, 130, 1, head_dim), np.float16))
    wide = cupy.broadcast_to(kv, (1, 130, 2, head_dim))
    caplog.clear()
    with caplog.at_level("DEBUG", logger="cuattn"):
        got = cuattn.attention(q, wide, wide)
    chosen = forward_kernels(caplog)
    assert chosen and "flash_fwd_kernel<" in chosen[-1], chosen
    ref = reference.attention(q.get(), wide.get(), wide.get())
    assert np.abs(got.get().astype(np.float64) - ref).max() < 5e-3


def _cupy():
    import cupy

    return cupy


def run_and_check(rng, dtype, b, sq, sk, hq, hk, d, *, factor=2.0, inputs=None, **options):
    """Run cuattn.attention on CuPy arrays and check out and lse against the references; q, k, v
    random normal, or ``inputs`` (arrays of ``dtype`` of those shapes)."""
    cupy = _cupy()
    q, k, v = inputs or (randn(rng, (b, s, h, d), dtype) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    out = cupy.full((b, sq, hq, d), np.nan, dtype=dtype)  # poison: every element must be written
    device_options = {**options, **{name: cupy.asarray(options[name]) for name in ("sinks", "alibi_slopes")
                                     if name in options}}
    got, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out,
                                return_lse=True, **device_options)
    assert got is out
    got = got.get().astype(np.float64)
    lse = lse.get()
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive = reference.naive_attention_lowp(q, k, v, dtype=dtype, **options)
    assert np.isfinite(got).all(), f"unwritten or NaN output (seed {rng.seed})"
    err = np.abs(got - ref).max(initial=0.0)
    budget = error_budget(np.abs(naive - ref).max(initial=0.0), dtype, factor, np.abs(ref).max(initial=0.0))
    assert err <= budget, f"max error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    # lse: -inf exactly where the reference row is empty, close elsewhere
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), f"empty rows differ (seed {rng.seed})"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3,
                               err_msg=f"seed {rng.seed}")
    assert (got[empty.transpose(0, 2, 1)] == 0).all(), "rows with no visible key must be 0"
    return got, lse


# ---------------------------------------------------------------------------------------------
# Attention sinks


def _sinks(rng, heads):
    """Sink logits around the scores' own range, so that they matter without dominating."""
    return (rng.standard_normal(heads) * 2.0).astype(np.float32)


@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap-causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sinks_join_every_rows_denominator(rng, head_dim, mask):
    run_and_check(rng, DTYPES[1], 2, 77, 203, 4, 2, head_dim, sinks=_sinks(rng, 4), **MASKS[mask])


def test_sinks_give_empty_rows_their_own_lse(rng):
    """Rows that see no key (causal, Sq > Sk: the first Sq - Sk rows): out 0 and lse = their sink."""
    cupy = _cupy()
    q = randn(rng, (1, 9, 2, 64), DTYPES[0])
    k = randn(rng, (1, 4, 2, 64), DTYPES[0])
    sinks = _sinks(rng, 2)
    out, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(k), causal=True,
                                sinks=cupy.asarray(sinks), return_lse=True)
    assert (out[:, :5] == 0).all()
    np.testing.assert_allclose(lse[:, :, :5].get(), np.broadcast_to(sinks[None, :, None], (1, 2, 5)), rtol=1e-6)
    assert (lse[:, :, 5:].get() > sinks[None, :, None]).all()


def test_sinks_in_varlen(rng):
    cupy = _cupy()
    lens = [13, 0, 150]
    cu = prefix_sums(lens)
    q, k, v = (randn(rng, (cu[-1], 4, 64), DTYPES[1]) for _ in range(3))
    sinks = _sinks(rng, 4)
    out, lse = cuattn.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu, cu)), max(lens), max(lens),
                                       causal=True, sinks=cupy.asarray(sinks), return_lse=True)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, sinks=sinks,
                                              return_lse=True)
    naive = np.concatenate([reference.naive_attention_lowp(q[None, a:b], k[None, a:b], v[None, a:b], causal=True,
                                                           dtype=q.dtype, sinks=sinks)[0]
                            for a, b in zip(cu[:-1], cu[1:])])
    budget = error_budget(np.abs(naive - ref).max(), q.dtype, 2.0, np.abs(ref).max())
    assert np.abs(out.get().astype(np.float64) - ref).max() <= budget, f"seed {rng.seed}"
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-3, atol=2e-3)


def test_sinks_argument_errors(rng):
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (1, 8, 4, 64), DTYPES[0]))
    with pytest.raises(ValueError, match=r"sinks.shape\[0\] \(Hq\) must equal the number of query heads = 4, got 3"):
        cuattn.attention(q, q, q, sinks=cupy.zeros(3, cupy.float32))
    with pytest.raises(TypeError, match="sinks.dtype must be float32, got float16"):
        cuattn.attention(q, q, q, sinks=cupy.zeros(4, cupy.float16))
    with pytest.raises(ValueError, match=r"sinks must be 1-D \(Hq\)"):
        cuattn.attention(q, q, q, sinks=cupy.zeros((1, 4), cupy.float32))
    with pytest.raises(ValueError, match="sinks must be contiguous, got a stride of 2 elements"):
        cuattn.attention(q, q, q, sinks=cupy.zeros(8, cupy.float32)[::2])


# ---------------------------------------------------------------------------------------------
# ALiBi


def _alibi_slopes(heads, batch=None):
    """ALiBi's geometric slopes 2^(-8 h / H); per sequence, each row halved once more."""
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    if batch is not None:
        slopes = slopes[None] * 0.5 ** np.arange(batch)[:, None]
    return slopes.astype(np.float32)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["Hq", "B-Hq"])
@pytest.mark.parametrize("mask", ["full", "causal", "window", "softcap-causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_bias_by_distance(rng, head_dim, mask, per_sequence):
    """Sq != Sk (bottom-right distances), lengths off every tile; with causal the first rows of
    the second case see no key and stay out 0, lse -inf."""
    slopes = _alibi_slopes(4, 2 if per_sequence else None)
    run_and_check(rng, DTYPES[1], 2, 77, 203, 4, 2, head_dim, alibi_slopes=slopes, **MASKS[mask])
    run_and_check(rng, DTYPES[0], 2, 113, 17, 4, 4, head_dim, alibi_slopes=slopes, **MASKS[mask])


def test_alibi_runs_the_alibi_variant(rng, caplog, fwd_kernel):
    """alibi_slopes select the kernel's ALIBI instantiation (its last flag but paged); without
    slopes the plain one runs, which carries no ALiBi code."""
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (1, 130, 2, 128), DTYPES[1]))
    names = []
    for slopes in (None, cupy.asarray(_alibi_slopes(2))):
        caplog.clear()
        with caplog.at_level("DEBUG", logger="cuattn"):
            cuattn.attention(q, q, q, alibi_slopes=slopes)
        names.append(forward_kernels(caplog)[-1])
    # flash_fwd_sm90_kernel<..., OVERLAP, PINGPONG, ALIBI, PAGED>, flash_fwd_kernel<..., ALIBI, PAGED>
    assert names[0].endswith(", false, false>") and names[1].endswith(", true, false>"), names
    assert ("flash_fwd_sm90_kernel<" in names[1]) == (fwd_kernel == "sm90"), names


@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_alibi_slope_of_each_tile_a_cta_takes(rng, head_dim, mask):
    """More tiles than an H100 or H200 has SMs (3 sequences x 48 heads x at least 2 query blocks),
    so each persistent CTA of the Hopper forward takes several, and a slope for every (sequence,
    head), all distinct: a tile given another tile's slope shows in its rows."""
    slopes = rng.uniform(2.0 ** -8, 0.5, (3, 48)).astype(np.float32)
    run_and_check(rng, DTYPES[1], 3, 300, 300, 48, 16, head_dim, alibi_slopes=slopes, **MASKS[mask])


@pytest.mark.parametrize("head_dim", [96, 128, 192, 256])
def test_alibi_visits_keys_from_the_diagonal(rng, head_dim):
    """Self-attention without a mask over several key blocks: the Hopper ALiBi variants visit a
    tile's blocks from the one holding its diagonal down to the first, then the ones right of it
    (every tile but the last wraps around), so steep heads find their row max at once."""
    run_and_check(rng, DTYPES[1], 2, 517, 517, 8, 4, head_dim, alibi_slopes=_alibi_slopes(8))


def test_alibi_with_sinks_and_long_keys(rng):
    """Distances into the thousands (fp32 exact) beside sinks, on a long non-causal row."""
    run_and_check(rng, DTYPES[1], 1, 203, 4100, 8, 2, 128, alibi_slopes=_alibi_slopes(8), sinks=_sinks(rng, 8))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 160])
@pytest.mark.parametrize("rise", list(RISES.values()), ids=list(RISES))
def test_alibi_on_whole_key_blocks(rng, head_dim, rise):
    """Rows whose diagonal lies past every key of a block, or before every one, take ALiBi's bias
    through the Hopper kernel's S GEMM in the tiles of head dims up to kAlibiGemmMaxHeadDim (one
    more k step in 64-key pieces: the slope times each key's offset in its block; the per-score
    path's linear branch elsewhere), and only blocks the diagonals cross add it per score. Sq = Sk
    and Sk = Sq + 1 put warps' diagonals on and one past block edges; 385 and 1024 keys without a
    mask run each head dim's tile below and above its long-key tile's threshold
    (FWD_SM90_LONG_TILES, unmasked: D = 80 from 512 keys, 64 and 96 from 1024); slopes of both
    signs; scores that rise block after block, so the softmax computes blocks' S again (the extra
    step with them)."""
    slopes = np.array([0.5, -0.03125, 2.0 ** -8, 0.0], np.float32)
    for dtype, sq, sk, causal in ((DTYPES[1], 512, 512, False), (DTYPES[0], 512, 513, False),
                                  (DTYPES[1], 512, 513, True), (DTYPES[1], 384, 385, False),
                                  (DTYPES[0], 1024, 1024, False)):
        shape = (1, sq, sk, 4, 2, head_dim)
        run_and_check(rng, dtype, *shape, causal=causal, alibi_slopes=slopes,
                      inputs=rising_scores(rng, *shape, rise, dtype))


@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_alibi_slopes_past_fp16_add_the_bias_per_score(rng, head_dim):
    """In score units (slope / scale) a slope of 2e4 is past fp16's range, so an fp16 call cannot
    feed it to the S GEMM's extra k step: the kernel adds that tile's bias per score."""
    slopes = np.array([2e4, -0.25], np.float32)
    run_and_check(rng, DTYPES[0], 1, 300, 300, 2, 1, head_dim, alibi_slopes=slopes)
    run_and_check(rng, DTYPES[0], 1, 300, 300, 2, 1, head_dim, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_alibi_slope_whose_far_piece_overflows_fp16_adds_the_bias_per_score(rng, head_dim):
    """The long-key tiles of D = 80 and 96 take the S GEMM's extra k step in two 64-key pieces,
    the second with words 64 times the slope's. A slope of 450 is about 4000 in score units
    (slope / scale): within fp16's range, but 64 times it is not, so an fp16 call adds those
    tiles' bias per score. 1100 keys without a mask run the long-key tile at both head dims."""
    slopes = np.array([450.0, -0.25], np.float32)
    run_and_check(rng, DTYPES[0], 1, 1100, 1100, 2, 1, head_dim, alibi_slopes=slopes)


def test_alibi_in_varlen(rng):
    """Each sequence's own lengths and its own row of slopes."""
    _check_alibi_varlen(rng, [13, 0, 150, 1], [40, 7, 150, 1023])


def _check_alibi_varlen(rng, lens_q, lens_k, slopes=None):
    """Causal attention_varlen (Hq = 4, Hk = 2, D = 64) with (B, Hq) slopes (default ALiBi's, each
    sequence's halved once more) against the float64 reference, out and lse."""
    cupy = _cupy()
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q = randn(rng, (cu_q[-1], 4, 64), DTYPES[1])
    k, v = (randn(rng, (cu_k[-1], 2, 64), DTYPES[1]) for _ in range(2))
    slopes = _alibi_slopes(4, len(lens_q)) if slopes is None else slopes
    out, lse = cuattn.attention_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), max(lens_q), max(lens_k),
                                       causal=True, alibi_slopes=cupy.asarray(slopes), return_lse=True)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                              alibi_slopes=slopes, return_lse=True)
    naive = np.concatenate([reference.naive_attention_lowp(q[None, a:b], k[None, c:d], v[None, c:d], causal=True,
                                                           dtype=q.dtype, alibi_slopes=slopes[i])[0]
                            for i, (a, b, c, d) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))])
    budget = error_budget(np.abs(naive - ref).max(), q.dtype, 2.0, np.abs(ref).max())
    assert np.abs(out.get().astype(np.float64) - ref).max() <= budget, f"seed {rng.seed}"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse.get()), empty)
    np.testing.assert_allclose(lse.get()[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3)


def test_alibi_argument_errors(rng):
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (2, 8, 4, 64), DTYPES[0]))
    with pytest.raises(TypeError, match="alibi_slopes.dtype must be float32, got float16"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros(4, cupy.float16))
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(Hq\) must equal the number of query heads = 4, "
                                         r"got 3"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros(3, cupy.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 2, got 1"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros((1, 4), cupy.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes must be 1-D \(Hq\) or 2-D \(B, Hq\)"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros((2, 4, 1), cupy.float32))
    with pytest.raises(ValueError, match="alibi_slopes must be contiguous along the heads .* a stride of 2 elements"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros(8, cupy.float32)[::2])
    with pytest.raises(ValueError, match="alibi_slopes must be contiguous along the heads"):
        cuattn.attention(q, q, q, alibi_slopes=cupy.zeros((4, 2), cupy.float32).T)
    with pytest.raises(ValueError, match=r"alibi_slopes.shape\[0\] \(B\) must equal the batch size = 2, got 3"):
        cuattn.attention_backward(q, q, q, q, q, cupy.zeros((2, 4, 8), cupy.float32),
                                  alibi_slopes=cupy.zeros((3, 4), cupy.float32))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dtype_head_dim_mask(rng, dtype, head_dim, mask):
    run_and_check(rng, dtype, 2, 113, 203, 4, 2, head_dim, **MASKS[mask])


LENGTHS = [(1, 1), (17, 17), (1, 203), (203, 113), (113, 203), (1023, 1023), (64, 64), (130, 257)]
GQA = [(4, 4), (8, 2), (8, 1), (4, 1)]


@pytest.mark.parametrize("gqa", GQA, ids=[f"{a}q{b}kv" for a, b in GQA])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
def test_lengths_and_gqa(rng, lengths, causal, gqa):
    sq, sk = lengths
    run_and_check(rng, DTYPES[1], 1, sq, sk, gqa[0], gqa[1], 128, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", [{"causal": True}, {}, {"window": (256, 0)}], ids=["causal", "full", "window"])
def test_long_sequence(rng, head_dim, options):
    run_and_check(rng, DTYPES[1], 1, 4096, 4096, 2, 1, head_dim, **options)


@pytest.mark.parametrize("window", [(0, 0), (3, 7), (-1, 0), (0, -1), (100, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_windows(rng, window, causal):
    # Sq > Sk leaves rows with no visible key at the top under causal and small windows
    run_and_check(rng, DTYPES[0], 2, 150, 97, 2, 2, 64, causal=causal, window=window)


def test_empty_rows_are_zero_with_minus_inf_lse(rng):
    got, lse = run_and_check(rng, DTYPES[1], 1, 200, 50, 2, 2, 64, causal=True)
    # with Sq = 200, Sk = 50 bottom-right causal, the first 150 query rows see no key
    assert (got[:, :150] == 0).all()
    assert np.isneginf(lse[:, :, :150]).all()
    assert np.isfinite(lse[:, :, 150:]).all()


def test_zero_length_keys(rng):
    cupy = _cupy()
    q = cupy.asarray(randn(rng, (1, 5, 2, 64), np.float16))
    k = cupy.zeros((1, 0, 2, 64), np.float16)
    out, lse = cuattn.attention(q, k, k, return_lse=True)
    assert (out == 0).all() and cupy.isneginf(lse).all()


def test_scale_and_softcap_options(rng):
    run_and_check(rng, DTYPES[0], 2, 77, 77, 4, 4, 128, scale=0.3, softcap=5.0)
    run_and_check(rng, DTYPES[1], 1, 77, 300, 4, 4, 64, scale=0.01)


def test_strided_bhsd_views_without_copy(rng):
    """A (B, H, S, D) tensor passed as .transpose(0, 2, 1, 3) works and matches the contiguous call."""
    cupy = _cupy()
    b, h, s, d = 2, 4, 129, 64
    q_bhsd = cupy.asarray(randn(rng, (b, h, s, d), np.float16))
    k_bhsd = cupy.asarray(randn(rng, (b, h, s, d), np.float16))
    v_bhsd = cupy.asarray(randn(rng, (b, h, s, d), np.float16))
    views = [x.transpose(0, 2, 1, 3) for x in (q_bhsd, k_bhsd, v_bhsd)]
    assert not views[0].flags.c_contiguous
    strided = cuattn.attention(*views, causal=True)
    dense = cuattn.attention(*(cupy.ascontiguousarray(x) for x in views), causal=True)
    assert cupy.array_equal(strided, dense)
    # a slice of a larger buffer along the head axis
    big = cupy.asarray(randn(rng, (b, s, 3 * h, d), np.float16))
    qs, ks, vs = big[:, :, :h], big[:, :, h:2 * h], big[:, :, 2 * h:]
    sliced = cuattn.attention(qs, ks, vs)
    ref = cuattn.attention(*(cupy.ascontiguousarray(x) for x in (qs, ks, vs)))
    assert cupy.array_equal(sliced, ref)


@pytest.mark.parametrize("d", [64, 72, 128, 256])
def test_out_views_are_written_inside_the_view_only(rng, d):
    """out= a view of a larger NaN-filled buffer (more rows, more columns): the view holds the
    result and the rest of the buffer stays NaN. On the Hopper kernel dense calls store O through
    a tensor map of the view (rows past Sq and columns past Dv outside it; D = 72 clips inside a
    64-column box, D = 256 stages O in Q's tile and keeps the 16-byte stores); lengths off every
    tile, two batches, GQA."""
    cupy = _cupy()
    b, sq, sk, hq, hk = 2, 200, 333, 4, 2
    q = randn(rng, (b, sq, hq, d), DTYPES[0])
    k, v = (randn(rng, (b, sk, hk, d), DTYPES[0]) for _ in range(2))
    buffer = cupy.full((b, sq + 9, hq, d + 8), np.nan, dtype=DTYPES[0])
    out = buffer[:, :sq, :, :d]
    for causal in (False, True):
        got = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal, out=out)
        assert got is out
        ref = reference.attention(q, k, v, causal=causal)
        naive = reference.naive_attention_lowp(q, k, v, dtype=DTYPES[0], causal=causal)
        err = np.abs(got.get().astype(np.float64) - ref).max()
        assert err <= error_budget(np.abs(naive - ref).max(), DTYPES[0], 2.0, np.abs(ref).max()), err
        outside = buffer.get()
        assert np.isnan(outside[:, sq:]).all() and np.isnan(outside[..., d:]).all(), "written outside the view"


def test_many_heads_beyond_grid_limit(rng):
    """B * H > 65535 folds into grid.z; every head still gets its own result."""
    cupy = _cupy()
    b, h, s, d = 2, 33000, 3, 32
    q = randn(rng, (b, s, h, d), np.float16)
    k = randn(rng, (b, s, h, d), np.float16)
    v = randn(rng, (b, s, h, d), np.float16)
    out = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)).get().astype(np.float64)
    ref = reference.attention(q, k, v)
    assert np.abs(out - ref).max() < 5e-3


@pytest.mark.parametrize("d", [128, 40, 200])
def test_varlen_matches_per_sequence_dense(rng, d):
    cupy = _cupy()
    lens_q = [1, 17, 113, 0, 203]
    lens_k = [5, 17, 300, 9, 203]
    hq, hk = 4, 2
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q = randn(rng, (cu_q[-1], hq, d), DTYPES[1])
    k = randn(rng, (cu_k[-1], hk, d), DTYPES[1])
    v = randn(rng, (cu_k[-1], hk, d), DTYPES[1])
    poisoned = cupy.full(q.shape, np.nan, dtype=q.dtype)
    out, lse = cuattn.attention_varlen(
        cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(cu_q), cupy.asarray(cu_k),
        max(lens_q), max(lens_k), causal=True, return_lse=True, out=poisoned,
    )
    check_varlen(rng, DTYPES[1], q, k, v, cu_q, cu_k, out.get(), causal=True)
    lse = lse.get()
    _, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                            return_lse=True)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# flash_fwd_sm90_kernel's tile schedules


def _check_varlen(rng, lens_q, lens_k, hq, hk, d, causal, dtype=DTYPES[1]):
    """attention_varlen into a poisoned out against the float64 reference, sequence by sequence."""
    cupy = _cupy()
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q, k, v = (randn(rng, (int(cu[-1]), h, d), dtype) for cu, h in ((cu_q, hq), (cu_k, hk), (cu_k, hk)))
    poisoned = cupy.full(q.shape, np.nan, dtype=q.dtype)
    out = cuattn.attention_varlen(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(cu_q),
                                  cupy.asarray(cu_k), max(lens_q), max(lens_k), causal=causal, out=poisoned)
    check_varlen(rng, dtype, q, k, v, cu_q, cu_k, out.get(), causal=causal)


# more (batch, head) query blocks than an H200 has SMs (132), so CTAs take several tiles each
SCHEDULE_CASES = {
    "causal-many-tiles": dict(b=2, sq=1100, sk=1100, hq=8, hk=2, d=64, causal=True),  # 144 tiles
    "full-d128": dict(b=2, sq=700, sk=333, hq=12, hk=12, d=128, causal=False),
    "causal-long-keys": dict(b=1, sq=300, sk=4100, hq=2, hk=1, d=128, causal=True),  # static: one CTA per tile
}


@pytest.mark.parametrize("schedule", attention_module.FWD_SM90_SCHEDULES)
@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_sm90_schedules(rng, monkeypatch, fwd_kernel, schedule, case):
    """Both schedules of the Hopper kernel, dense and ragged varlen (sequences shorter than the
    longest leave empty tiles, which the producer skips), against the float64 reference."""
    if fwd_kernel != "sm90":
        pytest.skip("a schedule of flash_fwd_sm90_kernel")
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", schedule)
    c = SCHEDULE_CASES[case]
    run_and_check(rng, DTYPES[1], c["b"], c["sq"], c["sk"], c["hq"], c["hk"], c["d"], causal=c["causal"])
    lens_q = [c["sq"], 1, c["sq"] // 3, 0, 130, c["sq"] // 2 + 7]
    lens_k = [c["sk"], 5, c["sk"] // 3, 9, 130, c["sk"] // 2 + 7]
    _check_varlen(rng, lens_q, lens_k, c["hq"], c["hk"], c["d"], c["causal"])


# CTAs of the persistent grid for test_few_ctas_walk_many_tiles: each takes dozens of tiles, so
# the Q tile's barriers and the tile ring go round many times
FEW_CTAS = 5


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_few_ctas_walk_many_tiles(rng, monkeypatch, fwd_kernel, schedule, d):
    """A persistent grid of FEW_CTAS CTAs: every CTA loads Q, and stages O in its tile (D = 256)
    or one of its own, dozens of times, with tiles of one key block and of many, causal and not,
    empty varlen tiles skipped in between."""
    if fwd_kernel != "sm90":
        pytest.skip("the persistent grid of flash_fwd_sm90_kernel")
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", schedule)
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: FEW_CTAS)
    run_and_check(rng, DTYPES[0], 3, 700, 333, 8, 2, d)
    run_and_check(rng, DTYPES[1], 2, 650, 650, 6, 3, d, causal=True)
    _check_varlen(rng, [500, 1, 0, 260, 129], [500, 7, 9, 130, 700], 4, 2, d, True)


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_few_ctas_walk_many_tiles_with_alibi(rng, monkeypatch, fwd_kernel, schedule, d):
    """ALiBi on a persistent grid of FEW_CTAS CTAs: each walks dozens of tiles of different
    (sequence, head) pairs, every pair with a slope of its own ((B, Hq) slopes drawn at random, of
    both signs), so a tile that took another tile's slope would show; the default tiles (333 keys)
    and the long-key ones (1100), without a mask and causal; at D = 64 varlen too."""
    if fwd_kernel != "sm90":
        pytest.skip("the persistent grid of flash_fwd_sm90_kernel")
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", schedule)
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: FEW_CTAS)
    slopes = rng.uniform(-0.05, 0.5, (2, 4)).astype(np.float32)
    run_and_check(rng, DTYPES[0], 2, 700, 333, 4, 2, d, alibi_slopes=slopes)
    run_and_check(rng, DTYPES[1], 2, 1100, 1100, 4, 2, d, alibi_slopes=slopes)
    run_and_check(rng, DTYPES[1], 2, 1100, 1100, 4, 2, d, causal=True, alibi_slopes=slopes)
    if d == 64:
        # packed sequences (in a tile order on the dynamic schedule), empty ones among them
        lens_q, lens_k = [500, 0, 1, 260, 129, 700], [500, 7, 9, 130, 700, 1100]
        _check_alibi_varlen(rng, lens_q, lens_k, rng.uniform(-0.05, 0.5, (len(lens_q), 4)).astype(np.float32))


def _tile_signature(tile) -> str:
    """How a flash_fwd_sm90_kernel tile appears in the launched kernel's template arguments (the
    debug log's kernel name): block_n, consumers, stages and the overlap / pingpong / bounded flags."""
    flags = ", ".join(attention_module._cpp_bool(flag) for flag in (tile.overlap, tile.pingpong, tile.bounded))
    return f", {tile.block_n}, {tile.consumers}, {tile.stages}, {flags},"


def _long_tiles_from_0_keys(monkeypatch, pairs=None):
    """FWD_SM90_LONG_TILES with the tiles of ``pairs`` (default: all) taken from 0 keys, masked or
    not."""
    tiles = dict(attention_module.FWD_SM90_LONG_TILES)
    for pair in tiles if pairs is None else pairs:
        tiles[pair] = attention_module.LongKeyTile(0, 0, tiles[pair].tile)
    monkeypatch.setattr(attention_module, "FWD_SM90_LONG_TILES", tiles)


@pytest.mark.parametrize("d", sorted(d for d, _ in attention_module.FWD_SM90_LONG_TILES))
def test_long_key_tiles(rng, caplog, monkeypatch, fwd_kernel, d):
    """The three-warpgroup tiles long key ranges take (FWD_SM90_LONG_TILES), forced from 0 keys:
    masks, ALiBi, GQA, varlen, lengths off every tile; the log names the tile."""
    if fwd_kernel != "sm90":
        pytest.skip("a flash_fwd_sm90_kernel tile")
    tile = attention_module.FWD_SM90_LONG_TILES[d, d].tile
    _long_tiles_from_0_keys(monkeypatch, [(d, d)])
    with caplog.at_level("DEBUG", logger="cuattn"):
        run_and_check(rng, DTYPES[0], 2, 211, 333, 4, 2, d)
    chosen = forward_kernels(caplog)
    assert chosen and _tile_signature(tile) in chosen[-1], chosen
    run_and_check(rng, DTYPES[1], 1, 400, 390, 6, 3, d, causal=True)
    run_and_check(rng, DTYPES[1], 2, 77, 203, 4, 2, d, window=(40, 3), alibi_slopes=_alibi_slopes(4))
    _check_varlen(rng, [300, 1, 0, 193], [300, 7, 9, 500], 4, 1, d, True)


@pytest.mark.parametrize("d", sorted(d for d, _ in attention_module.FWD_SM90_LONG_TILES))
def test_long_key_tiles_with_alibi(rng, caplog, monkeypatch, fwd_kernel, d):
    """ALiBi in the long-key tiles (FWD_SM90_LONG_TILES, forced from 0 keys), where a warp finds
    the max of a block holding its rows' diagonals first (the bounded softmax's exact path without
    a second S GEMM): without a mask, self-attention whose blocks wrap around the diagonal, causal,
    in a window beside sinks and per-sequence slopes, scores that rise block after block with
    slopes of both signs (the second pass), lengths off every block; the log names the tile."""
    if fwd_kernel != "sm90":
        pytest.skip("a flash_fwd_sm90_kernel tile")
    tile = attention_module.FWD_SM90_LONG_TILES[d, d].tile
    _long_tiles_from_0_keys(monkeypatch, [(d, d)])
    with caplog.at_level("DEBUG", logger="cuattn"):
        run_and_check(rng, DTYPES[0], 2, 211, 333, 4, 2, d, alibi_slopes=_alibi_slopes(4))
    chosen = forward_kernels(caplog)
    assert chosen and _tile_signature(tile) in chosen[-1], chosen
    run_and_check(rng, DTYPES[1], 1, 517, 517, 8, 4, d, alibi_slopes=_alibi_slopes(8))
    run_and_check(rng, DTYPES[1], 1, 400, 390, 6, 3, d, causal=True, alibi_slopes=_alibi_slopes(6))
    run_and_check(rng, DTYPES[1], 2, 77, 203, 4, 2, d, window=(40, 3), alibi_slopes=_alibi_slopes(4, batch=2),
                  sinks=_sinks(rng, 4))
    slopes = np.array([0.5, -0.03125, 2.0 ** -8, 0.0], np.float32)
    shape = (1, 290, 291, 4, 2, d)
    for rise in RISES.values():
        run_and_check(rng, DTYPES[1], *shape, alibi_slopes=slopes, inputs=rising_scores(rng, *shape, rise, DTYPES[1]))


def _forward_kernel_logged(caplog, *args, **kwargs) -> str:
    with caplog.at_level("DEBUG", logger="cuattn"):
        caplog.clear()
        cuattn.attention(*args, **kwargs)
    chosen = forward_kernels(caplog)
    assert chosen, caplog.records
    return chosen[-1]


@pytest.mark.parametrize("d", sorted(d for d, _ in attention_module.FWD_SM90_LONG_TILES))
def test_calls_take_the_long_tile_from_its_key_counts(rng, caplog, fwd_kernel, d):
    """A call takes its head dim's long-key tile from LongKeyTile.keys keys under a causal or
    window mask and from LongKeyTile.unmasked_keys without one; a key fewer keeps the default
    tile, or without a mask the unmasked one (the launched kernel's template arguments, from the
    debug log)."""
    if fwd_kernel != "sm90":
        pytest.skip("a flash_fwd_sm90_kernel tile")
    long = attention_module.FWD_SM90_LONG_TILES[d, d]
    cupy = _cupy()
    q, k, v = (cupy.asarray(randn(rng, (1, max(long.keys, long.unmasked_keys), 2, d), DTYPES[0])) for _ in range(3))

    def logged(n, **mask):
        return _forward_kernel_logged(caplog, q[:, :n], k[:, :n], v[:, :n], **mask)

    taken, short = _tile_signature(long.tile), _tile_signature(attention_module.FWD_SM90_TILES[d, d])
    # a key fewer without a mask: the unmasked tile where the head dims have one
    short_unmasked = _tile_signature(attention_module.FWD_SM90_UNMASKED_TILES.get((d, d))
                                     or attention_module.FWD_SM90_TILES[d, d])
    assert taken in logged(long.unmasked_keys)
    assert short_unmasked in logged(long.unmasked_keys - 1)
    for mask in ({"causal": True}, {"window": (long.keys // 2, 0)}):
        assert taken in logged(long.keys, **mask)
        assert short in logged(long.keys - 1, **mask)


@pytest.mark.parametrize("d", sorted(d for d, _ in attention_module.FWD_SM90_UNMASKED_TILES))
def test_calls_without_a_mask_take_the_unmasked_tile(rng, caplog, fwd_kernel, d):
    """A call without a causal or window mask takes its head dim's FWD_SM90_UNMASKED_TILES tile, a
    masked one FWD_SM90_TILES' (the launched kernel's template arguments, from the debug log); the
    unmasked tile against the reference: lengths off every tile, GQA, sinks, ALiBi, varlen."""
    if fwd_kernel != "sm90":
        pytest.skip("a flash_fwd_sm90_kernel tile")
    cupy = _cupy()
    q, k, v = (cupy.asarray(randn(rng, (1, 300, 2, d), DTYPES[0])) for _ in range(3))
    unmasked, masked = attention_module.FWD_SM90_UNMASKED_TILES[d, d], attention_module.FWD_SM90_TILES[d, d]
    assert _tile_signature(unmasked) in _forward_kernel_logged(caplog, q, k, v)
    assert _tile_signature(masked) in _forward_kernel_logged(caplog, q, k, v, causal=True)
    assert _tile_signature(masked) in _forward_kernel_logged(caplog, q, k, v, window=(40, 3))
    run_and_check(rng, DTYPES[0], 2, 211, 333, 4, 2, d)
    run_and_check(rng, DTYPES[1], 1, 400, 97, 6, 3, d, sinks=rng.standard_normal(6).astype(np.float32),
                  alibi_slopes=_alibi_slopes(6))
    _check_varlen(rng, [300, 1, 0, 193], [300, 7, 9, 500], 4, 1, d, False)


@pytest.mark.parametrize("head_dim, sq, sk, mask", [
    (64, 130, 130, "causal"),      # the two-warpgroup tile: its first tile stores one warpgroup
    (128, 60, 300, "causal"),      # Sk > Sq: one tile, its second warpgroup stores nothing
    (96, 130, 257, "window"),      # a window with a right edge shifts too
    (64, 4096, 4096, "causal"),    # the long tile (192 rows): the first stores one warpgroup
    (64, 4096 + 64, 4096 + 64, "causal"),  # the long tile: the first stores two
], ids=["d64-128rows", "d128-sk-longer", "d96-window", "d64-long-two", "d64-long-one"])
def test_causal_tiles_end_at_the_last_row(rng, fwd_kernel, head_dim, sq, sk, mask):
    """Dense calls under a causal or window mask whose Sq leaves whole warpgroups of a row-0-aligned
    last tile without rows align the tiles to end at the last row (fwd_sm90_row_shift > 0; the
    first tile stores only its own rows; on the mma.sync kernel the same cases run as always):
    out, poisoned, and lse against the reference."""
    if fwd_kernel == "sm90":
        dims = attention_module.fwd_sm90_tile_dims(head_dim, head_dim)
        tile = attention_module.fwd_sm90_tile(dims, seqlen_k=sk, banded=True)
        assert attention_module.fwd_sm90_row_shift(sq, tile.block_m) > 0, (sq, tile)
    run_and_check(rng, DTYPES[1], 1, sq, sk, 2, 1, head_dim, **MASKS[mask])


# (tiles, head dim, Sq, Sk, options) where the Hopper tiles' warpgroups leave out key blocks their
# rows do not see (FwdSm90Tile.drops_unseen): past their rows' diagonal where a tile is taller
# than a key block (192-row long tiles over 128 keys, 128 rows over D = 160 and 256's 80),
# all of them where Sq > Sk leaves rows without keys, or past Sq, or past a window's right edge.
# "sinks" and "alibi_slopes" take random per-head values.
DROPPED_BLOCKS = [
    ("long", 64, 700, 700, {"causal": True}),
    ("long", 64, 700, 701, {"causal": True}),     # each warpgroup's last key opens a block
    ("long", 96, 600, 250, {"causal": True, "sinks": None}),  # rows 0 .. 349 see no key
    ("long", 80, 500, 900, {"window": (200, 0)}),
    ("long", 64, 450, 450, {}),                   # the last tile's third warpgroup is past Sq
    ("long", 96, 333, 333, {"causal": True, "alibi_slopes": None}),
    ("default", 160, 333, 333, {"causal": True}),
    ("default", 160, 300, 301, {"window": (50, 1)}),  # a right edge past the diagonal
    ("default", 256, 200, 517, {"causal": True, "softcap": 30.0}),
]


@pytest.mark.parametrize("tiles, head_dim, sq, sk, options", DROPPED_BLOCKS,
                         ids=[f"{t}-d{d}-{sq}x{sk}-{'-'.join(o) or 'full'}" for t, d, sq, sk, o in DROPPED_BLOCKS])
def test_warpgroups_drop_the_blocks_their_rows_do_not_see(rng, monkeypatch, fwd_kernel, tiles, head_dim, sq, sk,
                                                          options):
    """Where a Hopper tile's consumer warpgroups do not take turns, each leaves out the key blocks
    none of its stored rows sees (it only releases their stages): out, poisoned, and lse against
    the reference, rows without keys included, on FEW_CTAS CTAs that each walk many tiles (the
    stages' phases carry across the dropped blocks; on the mma.sync kernel the same cases run as
    always)."""
    dims = (head_dim, head_dim)
    if tiles == "long":
        _long_tiles_from_0_keys(monkeypatch, [dims])
    hq = 2
    options = {name: rng.standard_normal(hq).astype(np.float32) if value is None else value
               for name, value in options.items()}
    if fwd_kernel == "sm90":
        tile = attention_module.fwd_sm90_tile(dims, seqlen_k=sk, banded="causal" in options or "window" in options)
        assert tile.drops_unseen(alibi="alibi_slopes" in options), tile
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: FEW_CTAS)
    run_and_check(rng, DTYPES[1], 2, sq, sk, hq, 1, head_dim, **options)


@pytest.mark.parametrize("rise", list(RISES.values()), ids=list(RISES))
@pytest.mark.parametrize("tiles", ["default", "long"])
def test_rising_scores_move_the_row_max(rng, monkeypatch, fwd_kernel, tiles, rise):
    """Scores that rise block after block in the kernels' visiting order: the lazy rescale's and the
    bounded softmax's exact paths on every block, on the default tiles (the intra-warpgroup
    overlap: the bounded softmax votes after the PV GEMM and computes S again, or the lazy max
    where a tile is not `bounded`) and the long-key tiles (no overlap: the bounded softmax before
    the PV GEMM), against the reference."""
    dims = sorted(d for d, dv in attention_module.FWD_SM90_TILES if d == dv)
    if tiles == "long":
        if fwd_kernel != "sm90":
            pytest.skip("flash_fwd_sm90_kernel's long-key tiles")
        _long_tiles_from_0_keys(monkeypatch)
        dims = sorted(d for d, _ in attention_module.FWD_SM90_LONG_TILES)
    for d in dims:
        for dtype, causal in ((DTYPES[0], False), (DTYPES[1], True)):
            shape = (2, 200, 700, 4, 2, d)
            run_and_check(rng, dtype, *shape, causal=causal, inputs=rising_scores(rng, *shape, rise, dtype))


# Hopper variants that ptxas's default -O3 compiled into wrong outputs on the H200 (CUDA 13.0;
# attention.FWD_SM90_PTXAS_OPTIONS): under the options their specs carry, each must match the
# reference.
O3_MISCOMPILED = [(160, attention_module.FwdSm90Tile(80, 2, 2)), (192, attention_module.FwdSm90Tile(80, 2, 2)),
                  (192, attention_module.FwdSm90Tile(64, 2, 2, pingpong=False)),
                  (256, attention_module.FwdSm90Tile(80, 2, 2, overlap=False)),
                  (160, attention_module.FwdSm90Tile(64, 2, 2, overlap=False))]


@pytest.mark.parametrize("d, tile", O3_MISCOMPILED,
                         ids=[f"d{d}-n{t.block_n}-ov{int(t.overlap)}-pp{int(t.pingpong)}" for d, t in O3_MISCOMPILED])
def test_hopper_variants_ptxas_once_got_wrong(rng, monkeypatch, fwd_kernel, d, tile):
    if fwd_kernel != "sm90":
        pytest.skip("a flash_fwd_sm90_kernel variant")
    monkeypatch.setattr(attention_module, "FWD_SM90_TILES", {**attention_module.FWD_SM90_TILES, (d, d): tile})
    run_and_check(rng, DTYPES[0], 1, 130, 203, 2, 2, d)
    run_and_check(rng, DTYPES[1], 2, 77, 80, 4, 2, d, causal=True)


def _schedule_workspace(stream):
    """The dynamic schedule's workspace of ``stream`` on the current device (the latest one)."""
    cupy = _cupy()
    stream.synchronize()
    return attention_module._schedule_workspaces[(cupy.cuda.runtime.getDevice(), stream.ptr)][-1]


def _tile_counters(stream):
    """The dynamic schedule's counters of ``stream`` on the current device, on the host."""
    return _schedule_workspace(stream)[:2].get().tolist()


def test_dynamic_schedule_counters_reset_between_launches_and_graph_replays(rng, fwd_kernel):
    """Each launch of the dynamic schedule leaves its stream's counters at zero (its last CTA resets
    them), so back-to-back launches of different tile counts with no sync between, and replays of
    a captured CUDA graph, each compute every tile: outputs poisoned before each run must match the
    float64 reference every time."""
    if fwd_kernel != "sm90":
        pytest.skip("the dynamic schedule of flash_fwd_sm90_kernel")
    cupy = _cupy()
    shapes = [(2, 1100, 8, 2, 64), (2, 1000, 12, 12, 128), (1, 130, 3, 1, 64)]  # 144, 192, 6 tiles
    inputs = [[randn(rng, (b, s, h, d), DTYPES[1]) for h in (hq, hk, hk)] for b, s, hq, hk, d in shapes]
    refs = [reference.attention(q, k, v, causal=True) for q, k, v in inputs]
    device = [[cupy.asarray(x) for x in qkv] for qkv in inputs]
    outs = [cupy.empty(q.shape, q.dtype) for q, _, _ in device]

    def check(what):
        for i, (out, ref) in enumerate(zip(outs, refs)):
            err = np.abs(out.get().astype(np.float64) - ref).max()
            assert np.isfinite(err) and err < 3e-2, f"{what}: shape {shapes[i]} error {err:.3g} (seed {rng.seed})"

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for (q, k, v), out in zip(device, outs):  # compile, load, make the stream's counters
            cuattn.attention(q, k, v, causal=True, out=out)
        for rounds in range(2):
            for out in outs:
                out.fill(np.nan)
            for (q, k, v), out in zip(device, outs):
                cuattn.attention(q, k, v, causal=True, out=out)
            assert _tile_counters(stream) == [0, 0]
            check(f"back-to-back round {rounds}")

        stream.begin_capture()
        for (q, k, v), out in zip(device, outs):
            cuattn.attention(q, k, v, causal=True, out=out)
        graph = stream.end_capture()
        for replay in range(3):
            for i, (q, k, v) in enumerate(device):
                fresh = [randn(rng, tuple(x.shape), DTYPES[1]) for x in (q, k, v)]
                for x, new in zip((q, k, v), fresh):
                    x[...] = cupy.asarray(new)
                refs[i] = reference.attention(*fresh, causal=True)
                outs[i].fill(np.nan)
            graph.launch(stream)
            assert _tile_counters(stream) == [0, 0]
            check(f"graph replay {replay}")



def test_first_launch_on_a_stream_under_capture(rng, fwd_kernel):
    """A stream whose first forward is recorded by stream capture (a fresh CUDA-graph stream, an
    XLA command buffer) gets no counters allocated there: that launch runs the static schedule
    (a null counter), and its graph replays compute every tile."""
    if fwd_kernel != "sm90":
        pytest.skip("the dynamic schedule of flash_fwd_sm90_kernel")
    cupy = _cupy()
    q, k, v = (cupy.asarray(randn(rng, (2, 700, h, 128), DTYPES[1])) for h in (8, 2, 2))
    out = cupy.empty(q.shape, q.dtype)
    cuattn.attention(q, k, v, causal=True, out=out)  # compiled and loaded outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cuattn.attention(q, k, v, causal=True, out=out)
        graph = stream.end_capture()
        for replay in range(2):
            fresh = [randn(rng, tuple(x.shape), DTYPES[1]) for x in (q, k, v)]
            for x, new in zip((q, k, v), fresh):
                x[...] = cupy.asarray(new)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            err = np.abs(out.get().astype(np.float64) - reference.attention(*fresh, causal=True)).max()
            assert np.isfinite(err) and err < 3e-2, f"replay {replay}: error {err:.3g} (seed {rng.seed})"


# ---------------------------------------------------------------------------------------------
# The tile order of varlen launches (tile_order.cu)

def _ordered_varlen(rng, lens_q, lens_k, hq, hk, d, causal, stream):
    """attention_varlen's forward launched on ``stream`` through _launch_fwd (an OrderedFwd), out
    poisoned; returns (launch, inputs, cu_seqlens, out) after the stream has finished."""
    cupy = _cupy()
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
    q, k, v = (randn(rng, (int(cu[-1]), h, d), DTYPES[1]) for cu, h in ((cu_q, hq), (cu_k, hk), (cu_k, hk)))
    qd, kd, vd, cuqd, cukd = (cupy.asarray(x) for x in (q, k, v, cu_q, cu_k))
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    launch = attention_module._launch_fwd(
        qd[None], kd[None], vd[None], out[None], None, cuqd, cukd, batch=len(lens_q), seqlen_q=max(lens_q),
        seqlen_k=max(lens_k), causal=causal, scale=None, window=(-1, -1), softcap=0.0, stream=stream)
    stream.synchronize()
    return launch, (q, k, v), (cu_q, cu_k), out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_tile_order_lists_the_tiles_that_hold_rows_longest_first(rng, monkeypatch, fwd_kernel, causal):
    """A varlen launch on the dynamic schedule whose tiles outnumber the grid runs
    fwd_tile_order_kernel first: the stream's workspace then lists exactly expected_tile_order's
    tiles (no empty ones, the sequences by decreasing key count, more sequences than one chunk
    sorts), its counters are back at zero, and every row is computed."""
    if fwd_kernel != "sm90":
        pytest.skip("the tile order of flash_fwd_sm90_kernel")
    cupy = _cupy()
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: FEW_CTAS)
    count = TILE_ORDER_CHUNK + 300  # two chunks, the second one short
    lens_q = rng.integers(0, 150, size=count)
    lens_k = rng.integers(0, 200, size=count)
    lens_q[:3], lens_k[:3] = 0, [0, 7, 0]  # empty sequences: no queries, or keys and no queries
    lens_q[3], lens_k[3] = 5, 0  # queries without keys: zero rows
    # the longest sequence, last of the second chunk: past the order's minimum key count
    lens_q[-1], lens_k[-1] = 400, attention_module.FWD_SM90_TILE_ORDER_MIN_KEYS + 11
    lens_q, lens_k = lens_q.tolist(), lens_k.tolist()
    stream = cupy.cuda.Stream(non_blocking=True)
    launch, inputs, cu, out = _ordered_varlen(rng, lens_q, lens_k, 2, 1, 64, causal, stream)
    assert isinstance(launch, attention_module.OrderedFwd)
    fields = np.frombuffer(launch.order.params.tobytes(), attention_module._params.struct_dtype("TileOrderParams"),
                           count=1)[0]
    m_blocks, block_m, section = int(fields["m_blocks"]), int(fields["block_m"]), int(fields["section"])
    assert m_blocks == -(-max(lens_q) // block_m)
    expected = expected_tile_order(lens_q, lens_k, 2, m_blocks, block_m, section, int(fields["capacity"]))
    workspace = _schedule_workspace(stream).get()
    head = attention_module._params.constant("kTileOrderHead")
    assert workspace[:2].tolist() == [0, 0], "the counters must be back at zero after the launch"
    assert int(workspace[head - 1]) == len(expected)
    np.testing.assert_array_equal(workspace[head:head + len(expected)], expected)
    # after the list, every position a CTA may take past it reads as past every tile
    end = head + int(fields["entries"])
    assert (workspace[head + len(expected):end] == attention_module._params.constant("kTileOrderEnd")).all()
    check_varlen(rng, DTYPES[1], *inputs, *cu, out.get(), causal=causal)


def test_tile_order_runs_where_the_tiles_outnumber_the_grid_and_keys_are_long(monkeypatch, fwd_kernel):
    """_launch_fwd prepares an OrderedFwd for varlen launches on the dynamic schedule of more than
    one sequence whose tiles outnumber the grid and whose longest sequence has
    FWD_SM90_TILE_ORDER_MIN_KEYS keys or more, and a plain launch otherwise (or with
    FWD_SM90_TILE_ORDER off, or on the static schedule)."""
    if fwd_kernel != "sm90":
        pytest.skip("the tile order of flash_fwd_sm90_kernel")
    cupy = _cupy()
    least = attention_module.FWD_SM90_TILE_ORDER_MIN_KEYS
    sms = _jit.multiprocessor_count()

    def launch(sequences, heads, keys):
        cu = cupy.asarray(np.arange(sequences + 1, dtype=np.int32) * keys)
        q = cupy.zeros((1, sequences * keys, heads, 64), DTYPES[1])
        return attention_module._launch_fwd(q, q[:, :, :1], q[:, :, :1], q, None, cu, cu, batch=sequences,
                                            seqlen_q=keys, seqlen_k=keys, causal=False, scale=None,
                                            window=(-1, -1), softcap=0.0, stream=None, execute=False)

    many = sms + 1  # sequences of one query block or more, one head: more tiles than the grid
    assert isinstance(launch(many, 1, least), attention_module.OrderedFwd)
    assert not isinstance(launch(many, 1, least - 8), attention_module.OrderedFwd)  # short keys
    assert not isinstance(launch(1, 1, least), attention_module.OrderedFwd)  # a few tiles
    assert not isinstance(launch(1, many, least), attention_module.OrderedFwd)  # one sequence, many tiles
    assert isinstance(launch(2, many, least), attention_module.OrderedFwd)
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", "static")
    assert not isinstance(launch(many, 1, least), attention_module.OrderedFwd)
    monkeypatch.setattr(attention_module, "FWD_SM90_SCHEDULE", "dynamic")
    monkeypatch.setattr(attention_module, "FWD_SM90_TILE_ORDER", False)
    assert not isinstance(launch(many, 1, least), attention_module.OrderedFwd)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ordered_varlen_matches_the_reference(rng, fwd_kernel, d, causal):
    """Ragged sequences whose tiles outnumber the SMs (the tile order's launches), empty ones
    among them, GQA, against the float64 reference sequence by sequence."""
    if fwd_kernel != "sm90":
        pytest.skip("the tile order of flash_fwd_sm90_kernel")
    lens_q = [int(n) for n in rng.integers(1, 700, size=40)] + [0, 3, 700]
    lens_k = [n + int(rng.integers(0, 90)) for n in lens_q[:-3]] + [50, 0, 703]
    _check_varlen(rng, lens_q, lens_k, 8, 2, d, causal)


def test_ordered_varlen_graph_replays_read_new_lengths(rng, fwd_kernel):
    """A captured ordered varlen call replayed over new contents of the same shapes, cu_seqlens
    included: each replay's tile order comes from that replay's lengths."""
    if fwd_kernel != "sm90":
        pytest.skip("the tile order of flash_fwd_sm90_kernel")
    cupy = _cupy()
    count, hq, hk, d = 48, 4, 2, 64
    total = 48 * 160

    def draw():
        cuts = np.sort(rng.choice(np.arange(1, total), size=count - 1, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
        return prefix_sums(lens)
    cu = draw()
    q, k, v = (cupy.asarray(randn(rng, (total, h, d), DTYPES[1])) for h in (hq, hk, hk))
    cu_d = cupy.asarray(cu)
    out = cupy.empty(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        max_len = total  # a bound every draw meets
        cuattn.attention_varlen(q, k, v, cu_d, cu_d, max_len, max_len, causal=True, out=out)
        stream.begin_capture()
        cuattn.attention_varlen(q, k, v, cu_d, cu_d, max_len, max_len, causal=True, out=out)
        graph = stream.end_capture()
        for replay in range(3):
            cu = draw()
            cu_d[...] = cupy.asarray(cu)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            ref = reference.attention_varlen(*(x.get() for x in (q, k, v)), cu, cu, max_len, max_len, causal=True)
            err = np.abs(out.get().astype(np.float64) - ref).max()
            assert np.isfinite(err) and err < 3e-2, f"replay {replay}: error {err:.3g} (seed {rng.seed})"


def test_result_is_deterministic(rng):
    cupy = _cupy()
    q, k, v = (cupy.asarray(randn(rng, (2, 300, 4, 128), np.float16)) for _ in range(3))
    first = cuattn.attention(q, k, v, causal=True)
    for _ in range(3):
        assert cupy.array_equal(first, cuattn.attention(q, k, v, causal=True))


def test_peak_memory_is_out_plus_lse(rng):
    """The forward allocates out and lse and nothing else: no N x N buffer, no workspace."""
    cupy = _cupy()

    class AllocationCounter(cupy.cuda.MemoryHook):
        name = "allocation_counter"

        def __init__(self):
            self.bytes = 0

        def malloc_preprocess(self, **kwargs):
            self.bytes += kwargs["mem_size"]

    b, s, h, d = 1, 16384, 2, 128
    q, k, v = (cupy.asarray(randn(rng, (b, s, h, d), np.float16)) for _ in range(3))
    cuattn.attention(q, k, v, return_lse=True)  # compile and load outside the count
    counter = AllocationCounter()
    with counter:
        out, lse = cuattn.attention(q, k, v, return_lse=True)
    # the pool rounds each request up to its 512-byte allocation unit
    assert counter.bytes == out.nbytes + lse.nbytes > 0


# ---------------------------------------------------------------------------------------------
# Frameworks through DLPack


def test_torch_in_torch_out_matches_sdpa(rng):
    torch = pytest.importorskip("torch")
    b, s, h, d = 2, 257, 8, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # q, k and v come from the default stream
    with torch.cuda.stream(stream):
        out = cuattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    q, k, v = (x.transpose(1, 2).float().cpu().numpy() for x in (q, k, v))
    ref = reference.attention(q, k, v, causal=True)
    ours = np.abs(out.float().cpu().numpy() - ref).max()
    theirs = np.abs(expected.float().cpu().numpy() - ref).max()
    # the tolerance rule, over the larger of the naive computation's error and torch SDPA's
    naive = np.abs(reference.naive_attention_lowp(q, k, v, causal=True, dtype=DTYPES[1]) - ref).max()
    budget = error_budget(max(naive, theirs), DTYPES[1], 2.0, np.abs(ref).max())
    assert ours <= budget, f"cuattn error {ours:.3g} vs torch SDPA {theirs:.3g}, naive {naive:.3g}"


def test_torch_out_argument_is_written_in_place(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    result = cuattn.attention(q, q, q, out=out)
    torch.cuda.synchronize()
    assert result is out and torch.isfinite(out).all()


def test_jax_in_jax_out(rng):
    jax = import_jax()
    jnp = jax.numpy
    q = randn(rng, (1, 100, 4, 64), DTYPES[1])
    k = randn(rng, (1, 120, 2, 64), DTYPES[1])
    v = randn(rng, (1, 120, 2, 64), DTYPES[1])
    out = cuattn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    ref = reference.attention(q, k, v, causal=True)
    naive = reference.naive_attention_lowp(q, k, v, causal=True, dtype=DTYPES[1])
    budget = error_budget(np.abs(naive - ref).max(), DTYPES[1], 2.0, np.abs(ref).max())
    assert np.abs(np.asarray(out, dtype=np.float64) - ref).max() <= budget, f"seed {rng.seed}"


def test_torch_pointer_is_shared_zero_copy():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 8, 1, 32, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    assert cuattn.attention(q, q, q, out=out).data_ptr() == out.data_ptr()
