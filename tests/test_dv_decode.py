"""A value head dim Dv of its own (DeepSeek style: D = 192, Dv = 128) in decode, paged_attention,
paged_attention_varlen, merge_states and cascade, and in PagedKVCache and its kernels.

q and k have head dim D and v has Dv; out is (..., Dv), the default scale stays 1/sqrt(D) and lse
is unchanged. On the CPU: the float64 reference against a written-out NumPy softmax, the public
functions' NumPy path (contiguous, paged, e4m3), the JAX adapters, the CPU cache, the dispatch
(every (D, Dv) pair runs an existing decode variant) and the errors. On the GPU: the kernels over
fp16/bf16 and e4m3 caches, contiguous and paged, one split and several, odd lengths, within 2x
the straightforward same-precision error (README, "Tests"); the cache kernels against NumPy; plans.
"""

from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import _arrays, _registry, reference
from conftest import DTYPE_IDS, DTYPES, error_budget, import_jax, prefix_sums, randn
from test_decode import check_decode

decode_module = sys.modules["cuattn.decode"]  # the module (cuattn.decode is the function)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# (D, Dv): DeepSeek's MLA, Dv < D in one tile, Dv > D, and head dims that ride padded in a tile
HEAD_DIM_PAIRS = [(192, 128), (128, 64), (64, 128), (40, 24)]
PAIR_IDS = [f"d{d}-dv{dv}" for d, dv in HEAD_DIM_PAIRS]
# an e4m3 cache's rows are whole 16-byte copies: both head dims multiples of 16
E4M3_PAIRS = [(d, dv) for d, dv in HEAD_DIM_PAIRS
              if d % _arrays.E4M3_HEAD_DIM_STEP == 0 and dv % _arrays.E4M3_HEAD_DIM_STEP == 0]
E4M3_PAIR_IDS = [f"d{d}-dv{dv}" for d, dv in E4M3_PAIRS]
# odd shapes: a prime cache, a block size whose runs cross pages, three new tokens (some rows of
# the short sequences see no key), a sequence of length 0 and one of length 1
B, SQ_NEW, HQ, HK = 4, 3, 8, 2
BLOCK_SIZE = 5
S_MAX = 141 * BLOCK_SIZE
LENS = (S_MAX, 1, 0, 333)
POISON_BYTE = 0x7E  # e4m3 448: a slot past a sequence's length that leaked into the result would show


def naive_decode(q, k, v, lens, *, scale=None, causal=True):
    """Decode written out in float64 NumPy, independent of cuattn.reference: per sequence, the
    GQA-expanded scores (scale 1/sqrt(D) by default), the causal mask (new token i sees keys j <=
    lens[b] - Sq_new + i) and the softmax over v. Returns out (B, Sq_new, Hq, Dv), lse (B, Hq, Sq_new)."""
    batch, sq_new, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = np.zeros((batch, sq_new, num_heads, v.shape[-1]))
    lse = np.full((batch, num_heads, sq_new), -np.inf)
    for b, n in enumerate(lens):
        keys = np.repeat(k[b, :n].astype(np.float64), group, axis=1)  # (n, Hq, D)
        values = np.repeat(v[b, :n].astype(np.float64), group, axis=1)  # (n, Hq, Dv)
        scores = scale * np.einsum("ihd,jhd->hij", q[b].astype(np.float64), keys)
        visible = np.arange(n)[None, :] <= (n - sq_new + np.arange(sq_new))[:, None]
        if causal:
            scores = np.where(visible[None], scores, -np.inf)
        for h in range(num_heads):
            for i in range(sq_new):
                row = scores[h, i]
                if not np.isfinite(row).any():
                    continue
                weights = np.exp(row - row.max())
                out[b, i, h] = weights @ values[:, h] / weights.sum()
                lse[b, h, i] = row.max() + np.log(weights.sum())
    return out, lse


def pages_of(cache, table, block_size):
    """A contiguous cache (B, S_max, Hk, X) cut into pages (num_blocks, block_size, Hk, X) at the
    page ids of ``table`` (B, S_max / block_size)."""
    batch, s_max = cache.shape[:2]
    pages = np.empty((table.size, block_size, *cache.shape[2:]), cache.dtype)
    pages[table.reshape(-1)] = cache.reshape(batch * (s_max // block_size), block_size, *cache.shape[2:])
    return pages


def shuffled_table(rng, batch, s_max, block_size):
    return rng.permutation(batch * (s_max // block_size)).astype(np.int32).reshape(batch, -1)


# ---------------------------------------------------------------------------------------------
# CPU: the reference and the NumPy path


@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_reference_decode_is_the_written_out_softmax(rng, dims):
    d, dv = dims
    q = randn(rng, (B, SQ_NEW, HQ, d), np.float32)
    k = randn(rng, (B, S_MAX, HK, d), np.float32)
    v = randn(rng, (B, S_MAX, HK, dv), np.float32)
    out, lse = reference.decode(q, k, v, np.array(LENS), return_lse=True)
    want, want_lse = naive_decode(q, k, v, LENS)
    assert out.shape == (B, SQ_NEW, HQ, dv) and lse.shape == (B, HQ, SQ_NEW)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    # lse near 0 (a row whose scores cancel) has no relative precision to speak of: the absolute
    # tolerance test_dv.py's lse comparisons already take
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_numpy_decode_and_paged_attention(rng, dims, num_splits, paged):
    """The CPU path enforces the device path's rules and computes (..., Dv) outputs with q and k's
    lse; num_splits is accepted and does not change the float64 result."""
    d, dv = dims
    q = randn(rng, (B, SQ_NEW, HQ, d), np.float32)
    k = randn(rng, (B, S_MAX, HK, d), np.float32)
    v = randn(rng, (B, S_MAX, HK, dv), np.float32)
    lens = np.array(LENS, np.int32)
    if paged:
        table = shuffled_table(rng, B, S_MAX, BLOCK_SIZE)
        out, lse = cuattn.paged_attention(q, (pages_of(k, table, BLOCK_SIZE), pages_of(v, table, BLOCK_SIZE)), table,
                                          lens, num_splits=num_splits, return_lse=True)
    else:
        out, lse = cuattn.decode(q, k, v, lens, num_splits=num_splits, return_lse=True)
    want, want_lse = naive_decode(q, k, v, LENS)
    assert out.shape == (B, SQ_NEW, HQ, dv) and out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", E4M3_PAIRS, ids=E4M3_PAIR_IDS)
def test_numpy_e4m3_caches_attend_over_their_real_values(rng, dims):
    d, dv = dims
    q = randn(rng, (B, SQ_NEW, HQ, d), np.float32)
    k8 = cuattn.quantize_fp8(randn(rng, (B, S_MAX, HK, d), np.float32), 0.02)
    v8 = cuattn.quantize_fp8(randn(rng, (B, S_MAX, HK, dv), np.float32), 0.03)
    out = cuattn.decode(q, k8, v8, np.array(LENS, np.int32), k_scale=0.02, v_scale=0.03)
    want, _ = naive_decode(q, k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03, LENS)
    assert out.shape == (B, SQ_NEW, HQ, dv)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("e4m3", [False, True], ids=["fp32", "e4m3"])
@pytest.mark.parametrize("dims", E4M3_PAIRS, ids=E4M3_PAIR_IDS)
def test_cpu_paged_kv_cache_writes_copies_and_attends(rng, dims, e4m3):
    """PagedKVCache(head_dim_v=Dv): v pages of their own width, writes and copy-on-write copies of
    both, then paged_attention over them."""
    d, dv = dims
    cache = cuattn.PagedKVCache(12, BLOCK_SIZE, HK, d, E4M3 if e4m3 else np.float32, device="cpu", head_dim_v=dv,
                                k_scale=0.02 if e4m3 else 1.0, v_scale=0.03 if e4m3 else 1.0)
    assert cache.k_pages.shape == (12, BLOCK_SIZE, HK, d) and cache.v_pages.shape == (12, BLOCK_SIZE, HK, dv)
    assert cache.head_dim == d and cache.head_dim_v == dv
    manager = cuattn.BlockManager(12, BLOCK_SIZE)
    slots = manager.allocate(0, 13)  # three pages, the last partly filled
    k = randn(rng, (13, HK, d), np.float32)
    v = randn(rng, (13, HK, dv), np.float32)
    cache.write(k, v, slots)
    manager.fork(0, 1)
    new_slots, copies = manager.append(1, 1)  # the shared last page is copied before the write
    assert copies, "appending to a shared partial page copies it"
    cache.copy_blocks(copies)
    for src, dst in copies:
        np.testing.assert_array_equal(cache.k_pages[dst], cache.k_pages[src])
        np.testing.assert_array_equal(cache.v_pages[dst], cache.v_pages[src])
    cache.write(randn(rng, (1, HK, d), np.float32), randn(rng, (1, HK, dv), np.float32), new_slots)
    table, lens = manager.block_table([0, 1])
    q = randn(rng, (2, 1, HQ, d), np.float32)
    out = cuattn.paged_attention(q, cache, table, lens)
    k_real, v_real = cache.k_pages.astype(np.float64), cache.v_pages.astype(np.float64)
    if e4m3:
        k_real, v_real = k_real * 0.02, v_real * 0.03
    k_cache = reference.gather_pages(k_real, table, lens)
    v_cache = reference.gather_pages(v_real, table, lens)
    want, _ = naive_decode(q, k_cache, v_cache, lens)
    assert out.shape == (2, 1, HQ, dv)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_numpy_paged_attention_varlen(rng, dims):
    """Packed runs of any length (longer than 16 included) over value pages of width Dv, and their
    lse [Hq, rows]."""
    d, dv = dims
    runs, seq_lens, block = (0, 1, 3, 17, 40), (5, 300, 2, 64, 129), 16
    cu = prefix_sums(runs)
    per_seq = -(-max(seq_lens) // block)
    table = rng.permutation(len(seq_lens) * per_seq).astype(np.int32).reshape(len(seq_lens), per_seq)
    q = randn(rng, (int(cu[-1]), HQ, d), np.float32)
    k_pages = randn(rng, (table.size, block, HK, d), np.float32)
    v_pages = randn(rng, (table.size, block, HK, dv), np.float32)
    lens = np.asarray(seq_lens, np.int32)
    out, lse = cuattn.paged_attention_varlen(q, (k_pages, v_pages), table, cu, lens, max(runs), return_lse=True)
    assert out.shape == (int(cu[-1]), HQ, dv) and lse.shape == (HQ, int(cu[-1]))
    k_cache = reference.gather_pages(k_pages, table, lens)
    v_cache = reference.gather_pages(v_pages, table, lens)
    for b in range(len(runs)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want, want_lse = naive_decode(q[None, rows], k_cache[b:b + 1], v_cache[b:b + 1], [int(lens[b])])
        np.testing.assert_allclose(out[rows], want[0], rtol=1e-5, atol=1e-6, err_msg=f"sequence {b}")
        np.testing.assert_allclose(lse[:, rows], want_lse[0], rtol=1e-5, atol=1e-6, err_msg=f"sequence {b}")
    given = np.full((int(cu[-1]), HQ, dv), np.nan, np.float32)
    assert cuattn.paged_attention_varlen(q, (k_pages, v_pages), table, cu, lens, max(runs), out=given) is given
    np.testing.assert_array_equal(given, out)


def test_merge_states_of_two_key_halves_is_the_whole(rng):
    """Split decode's combine and cascade merge (..., Dv) outputs: the halves of a cache merge into
    the attention over all of it."""
    d, dv = 192, 128
    q = randn(rng, (2, 1, HQ, d), np.float32)
    k = randn(rng, (2, 300, HK, d), np.float32)
    v = randn(rng, (2, 300, HK, dv), np.float32)
    halves = [reference.decode(q, k[:, part], v[:, part], [150, 150], causal=False, return_lse=True)
              for part in (slice(0, 150), slice(150, 300))]
    out, lse = cuattn.merge_states([(o.astype(np.float32), l.astype(np.float32)) for o, l in halves])
    want, want_lse = naive_decode(q, k, v, [300, 300], causal=False)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


def test_cascade_over_a_shared_prefix(rng):
    d, dv = 192, 128
    prefix_len, own = 37, np.array([5, 9], np.int32)
    q = randn(rng, (2, 2, HQ, d), np.float32)
    prefix = (randn(rng, (prefix_len, HK, d), np.float32), randn(rng, (prefix_len, HK, dv), np.float32))
    table = np.arange(4, dtype=np.int32).reshape(2, 2)
    pages = (randn(rng, (4, 8, HK, d), np.float32), randn(rng, (4, 8, HK, dv), np.float32))
    out = cuattn.cascade_attention(q, prefix, pages, table, own)
    assert out.shape == (2, 2, HQ, dv)
    # each sequence's keys: the prefix, then its own tokens
    for b in range(2):
        keys = np.concatenate([prefix[0], reference.gather_pages(pages[0], table, own)[b, :own[b]]])[None]
        values = np.concatenate([prefix[1], reference.gather_pages(pages[1], table, own)[b, :own[b]]])[None]
        want, _ = naive_decode(q[b:b + 1], keys, values, [prefix_len + int(own[b])])
        np.testing.assert_allclose(out[b], want[0], rtol=1e-5, atol=1e-6, err_msg=f"sequence {b}")


def test_jax_decode_and_paged_attention_on_the_cpu(rng):
    """The JAX adapters size out from v's last axis (vmapped decode folds the extra axis)."""
    jax = import_jax()
    import jax.numpy as jnp

    import cuattn.jax

    cpu = jax.devices("cpu")[0]
    d, dv = 192, 128
    bf16 = _arrays.BFLOAT16
    q = randn(rng, (2, B, SQ_NEW, HQ, d), bf16)
    k = randn(rng, (B, S_MAX, HK, d), bf16)
    v = randn(rng, (B, S_MAX, HK, dv), bf16)
    lens = np.array(LENS, np.int32)
    put = [jax.device_put(jnp.asarray(x), cpu) for x in (q, k, v, lens)]
    call = jax.jit(jax.vmap(lambda q, k, v, lens: cuattn.jax.decode(q, k, v, lens, return_lse=True),
                            in_axes=(0, None, None, None)))
    out, lse = call(*put)
    assert out.shape == (2, B, SQ_NEW, HQ, dv) and lse.shape == (2, B, HQ, SQ_NEW)
    for i in range(2):
        want, _ = reference.decode(q[i], k, v, lens, return_lse=True)
        np.testing.assert_array_equal(np.asarray(out[i]), want.astype(bf16))
    table = shuffled_table(rng, B, S_MAX, BLOCK_SIZE)
    paged = [jax.device_put(jnp.asarray(x), cpu)
             for x in (q[0], pages_of(k, table, BLOCK_SIZE), pages_of(v, table, BLOCK_SIZE), table, lens)]
    out = jax.jit(cuattn.jax.paged_attention)(*paged)
    assert out.shape == (B, SQ_NEW, HQ, dv)
    np.testing.assert_array_equal(np.asarray(out), reference.decode(q[0], k, v, lens).astype(bf16))


def test_every_head_dim_pair_runs_an_existing_decode_variant():
    """The kernels are per tile head dim: a (D, Dv) call runs the tile of max(D, Dv), which the
    registry builds (no variant per pair)."""
    names = {spec.name for spec in decode_module.kernel_variants("sm_90a")}
    for d in _registry.SUPPORTED_HEAD_DIMS:
        for dv in _registry.SUPPORTED_HEAD_DIMS:
            tile = decode_module.decode_tile_dim(d, dv)
            assert tile in decode_module.DECODE_TILES and tile >= max(d, dv), (d, dv)
            assert tile == decode_module.decode_tile_dim(max(d, dv)), (d, dv)
    for tile in decode_module.DECODE_TILES:
        for dtype in DTYPES:
            for paged in (False, True):
                assert decode_module.decode_spec(dtype, tile, 1, paged).name in names


# ---------------------------------------------------------------------------------------------
# CPU: errors


def test_decode_errors_name_v_and_its_head_dim():
    q = np.zeros((1, 1, 4, 64), np.float32)
    k = np.zeros((1, 10, 2, 64), np.float32)
    lens = np.array([3], np.int32)
    for dv in (12, 264, 0):
        with pytest.raises(ValueError, match=rf"v_cache.shape\[3\] \(head_dim_v\) = {dv} is not supported: "
                                             r"head_dim must be a multiple of 8 from 8 to 256"):
            cuattn.decode(q, k, np.zeros((1, 10, 2, dv), np.float32), lens)
    with pytest.raises(ValueError, match=r"v_cache.shape\[1\] \(S_max\) must equal k_cache.shape\[1\] = 10, got 9"):
        cuattn.decode(q, k, np.zeros((1, 9, 2, 32), np.float32), lens)
    with pytest.raises(ValueError, match=r"v_cache.shape\[2\] \(Hk\) must equal k_cache.shape\[2\] = 2, got 1"):
        cuattn.decode(q, k, np.zeros((1, 10, 1, 32), np.float32), lens)
    with pytest.raises(ValueError, match=r"v_cache must be 4-D \(B, S_max, Hk, Dv\), got shape \(10, 2, 32\)"):
        cuattn.decode(q, k, np.zeros((10, 2, 32), np.float32), lens)
    with pytest.raises(ValueError, match=r"k_cache.shape\[3\] \(head_dim\) must equal q.shape\[3\] = 64, got 32"):
        cuattn.decode(q, np.zeros((1, 10, 2, 32), np.float32), k, lens)
    k8, v8 = np.zeros((1, 10, 2, 64), E4M3), np.zeros((1, 10, 2, 40), E4M3)
    with pytest.raises(ValueError, match=r"v_cache.shape\[-1\] \(head_dim_v\) = 40 is not supported with an e4m3 "
                                         r"cache: head_dim must be a multiple of 16"):
        cuattn.decode(q, k8, v8, lens)


def test_paged_errors_name_the_pages_and_their_axes():
    q = np.zeros((1, 1, 4, 64), np.float32)
    k_pages = np.zeros((8, 4, 2, 64), np.float32)
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    with pytest.raises(ValueError, match=r"v_pages.shape\[0\] \(num_blocks\) must equal k_pages.shape\[0\] = 8, got 7"):
        cuattn.paged_attention(q, (k_pages, np.zeros((7, 4, 2, 32), np.float32)), table, lens)
    with pytest.raises(ValueError, match=r"v_pages.shape\[1\] \(block_size\) must equal k_pages.shape\[1\] = 4, got 5"):
        cuattn.paged_attention(q, (k_pages, np.zeros((8, 5, 2, 32), np.float32)), table, lens)
    with pytest.raises(ValueError, match=r"v_pages.shape\[3\] \(head_dim_v\) = 36 is not supported"):
        cuattn.paged_attention(q, (k_pages, np.zeros((8, 4, 2, 36), np.float32)), table, lens)
    cu = np.array([0, 1], np.int32)
    pair = (k_pages, np.zeros((8, 4, 2, 32), np.float32))
    with pytest.raises(ValueError, match=r"out.shape must equal q.shape\[:-1\] \+ v_pages.shape\[-1:\] \(v's head dim "
                                         r"Dv last\) = \(1, 4, 32\), got \(1, 4, 64\)"):
        cuattn.paged_attention_varlen(q[0], pair, table, cu, lens, 1, out=np.zeros((1, 4, 64), np.float32))
    with pytest.raises(ValueError, match=r"v_pages must be 4-D \(num_blocks, block_size, Hk, Dv\), got shape"):
        cuattn.paged_attention_varlen(q[0], (k_pages, np.zeros((8, 4, 32), np.float32)), table, cu, lens, 1)


def test_paged_kv_cache_errors_name_head_dim_v():
    with pytest.raises(ValueError, match=r"head_dim_v = 20 is not supported: head_dim must be a multiple of 8"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu", head_dim_v=20)
    with pytest.raises(ValueError, match=r"head_dim_v = 264 is not supported"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu", head_dim_v=264)
    with pytest.raises(ValueError, match=r"head_dim_v = 24 is not supported with an e4m3 cache"):
        cuattn.PagedKVCache(8, 4, 2, 64, E4M3, device="cpu", head_dim_v=24)
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu", head_dim_v=32)
    k = np.zeros((3, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"v.shape\[2\] \(Dv\) must equal the cache's head_dim_v = 32, got 64"):
        cache.write(k, k, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"k.shape\[2\] \(D\) must equal the cache's head_dim = 64, got 32"):
        cache.write(np.zeros((3, 2, 32), np.float32), np.zeros((3, 2, 32), np.float32), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"v must be 3-D \(N, Hk, Dv\)"):
        cache.write(k, np.zeros((3, 32), np.float32), np.array([0, 1, 2]))
    assert not cache.k_pages.any() and not cache.v_pages.any(), "a refused write changed the cache"


def test_cascade_checks_prefix_v_against_the_caches_value_head_dim():
    q = np.zeros((2, 1, 4, 64), np.float32)
    table, lens = np.array([[0], [1]], np.int32), np.array([2, 3], np.int32)
    cache = cuattn.PagedKVCache(4, 4, 2, 64, np.float32, device="cpu", head_dim_v=32)
    prefix_k = np.zeros((5, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"prefix_v.shape\[2\] \(head_dim_v\) must equal the cache's head_dim_v = 32, "
                                         r"got 64"):
        cuattn.cascade_attention(q, (prefix_k, np.zeros((5, 2, 64), np.float32)), cache, table, lens)
    pages = (cache.k_pages, cache.v_pages)
    with pytest.raises(ValueError, match=r"prefix_v.shape\[2\] \(head_dim_v\) must equal v_pages.shape\[-1\] = 32, "
                                         r"got 48"):
        cuattn.cascade_attention(q, (prefix_k, np.zeros((5, 2, 48), np.float32)), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_v must be 3-D \(L, Hk, Dv\)"):
        cuattn.cascade_attention(q, (prefix_k, np.zeros((5, 32), np.float32)), pages, table, lens)


def test_jax_adapters_check_v_like_the_plain_functions():
    import_jax()
    import jax.numpy as jnp

    import cuattn.jax

    q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 10, 2, 64), jnp.bfloat16)
    lens = jnp.array([3], jnp.int32)
    with pytest.raises(ValueError, match=r"v_cache.shape\[3\] \(head_dim_v\) = 44 is not supported"):
        cuattn.jax.decode(q, k, jnp.zeros((1, 10, 2, 44), jnp.bfloat16), lens)
    with pytest.raises(ValueError, match=r"v_pages.shape\[0\] \(num_blocks\) must equal k_pages.shape\[0\] = 1, got 2"):
        cuattn.jax.paged_attention(q, k, jnp.zeros((2, 10, 2, 32), jnp.bfloat16), jnp.zeros((1, 1), jnp.int32), lens)


# ---------------------------------------------------------------------------------------------
# GPU


def _cupy():
    import cupy

    return cupy


def dv_caches(rng, dtype, d, dv, e4m3):
    """Caches (B, S_MAX, Hk, D) and (B, S_MAX, Hk, Dv) as the kernel reads them (slots past each
    length poisoned: NaN, or e4m3 448), their float64 real values, and the descales to pass."""
    if not e4m3:
        k = randn(rng, (B, S_MAX, HK, d), dtype)
        v = randn(rng, (B, S_MAX, HK, dv), dtype)
        for i, n in enumerate(LENS):
            k[i, n:] = np.nan
            v[i, n:] = np.nan
        return k, v, k.astype(np.float64), v.astype(np.float64), {}
    k_scale = rng.uniform(0.005, 0.02, HK).astype(np.float32)
    v_scale = rng.uniform(0.005, 0.02, HK).astype(np.float32)
    k8 = cuattn.quantize_fp8(randn(rng, (B, S_MAX, HK, d), np.float32), k_scale)
    v8 = cuattn.quantize_fp8(randn(rng, (B, S_MAX, HK, dv), np.float32), v_scale)
    k_real = k8.astype(np.float64) * k_scale[:, None]
    v_real = v8.astype(np.float64) * v_scale[:, None]
    k_bytes, v_bytes = k8.view(np.uint8).copy(), v8.view(np.uint8).copy()
    for i, n in enumerate(LENS):
        k_bytes[i, n:] = POISON_BYTE
        v_bytes[i, n:] = POISON_BYTE
    cupy = _cupy()
    return k_bytes, v_bytes, k_real, v_real, {"k_scale": cupy.asarray(k_scale), "v_scale": cupy.asarray(v_scale)}


def dv_cases():
    """(dtype, (D, Dv), e4m3): every dtype and pair over a 2-byte cache, the e4m3-able pairs over e4m3."""
    cases = []
    for dtype, dtype_id in zip(DTYPES, DTYPE_IDS):
        for dims, dims_id in zip(HEAD_DIM_PAIRS, PAIR_IDS):
            for e4m3 in (False, True):
                if not e4m3 or dims in E4M3_PAIRS:
                    cache_id = "e4m3" if e4m3 else "kv16"
                    cases.append(pytest.param(dtype, dims, e4m3, id=f"{dtype_id}-{dims_id}-{cache_id}"))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["1split", "3splits"])
@pytest.mark.parametrize("dtype, dims, e4m3", dv_cases())
def test_decode_kernels_with_a_value_head_dim(rng, dtype, dims, e4m3, num_splits, paged):
    cupy = _cupy()
    d, dv = dims
    q = randn(rng, (B, SQ_NEW, HQ, d), dtype)
    k, v, k_real, v_real, scales = dv_caches(rng, dtype, d, dv, e4m3)
    lens = np.array(LENS, np.int32)
    if paged:
        table = shuffled_table(rng, B, S_MAX, BLOCK_SIZE)
        pages = tuple(cupy.asarray(pages_of(x, table, BLOCK_SIZE)) for x in (k, v))
        out, lse = cuattn.paged_attention(cupy.asarray(q), pages, cupy.asarray(table), cupy.asarray(lens),
                                          num_splits=num_splits, return_lse=True, **scales)
    else:
        out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(lens),
                                 num_splits=num_splits, return_lse=True, **scales)
    assert out.shape == (*q.shape[:-1], v.shape[-1]), f"out is {out.shape}, expected (B, Sq_new, Hq, Dv)"
    check_decode(rng, dtype, q, k_real, v_real, lens, out.get(), lse.get())


@pytest.mark.gpu
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_decode_auto_splits_long_sequence_and_gqa_packing(rng, dims):
    """One long sequence (the split heuristic picks many splits) with 16 query heads per kv head
    and 5 new tokens: two m16 tiles of packed rows per CTA."""
    cupy = _cupy()
    d, dv = dims
    bf16 = _arrays.BFLOAT16
    lens = np.array([20011], np.int32)
    q = randn(rng, (1, 5, 16, d), bf16)
    k = randn(rng, (1, 20011, 1, d), bf16)
    v = randn(rng, (1, 20011, 1, dv), bf16)
    out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(lens), return_lse=True)
    assert out.shape == (1, 5, 16, dv), f"out is {out.shape}, expected (B, Sq_new, Hq, Dv)"
    check_decode(rng, bf16, q, k, v, lens, out.get(), lse.get())


@pytest.mark.gpu
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_plans_carry_the_value_head_dim(rng, dims):
    """plan_decode and plan_paged_attention own (..., Dv) outputs; a repeated plain call (the
    recorded plan of _calls) allocates (..., Dv) too and gives the same result."""
    cupy = _cupy()
    d, dv = dims
    q = cupy.asarray(randn(rng, (B, SQ_NEW, HQ, d), np.float16))
    k, v, _, _, _ = dv_caches(rng, np.float16, d, dv, False)
    k, v = cupy.asarray(k), cupy.asarray(v)
    lens = cupy.asarray(np.array(LENS, np.int32))
    first = cuattn.decode(q, k, v, lens, num_splits=3)
    again = cuattn.decode(q, k, v, lens, num_splits=3)
    assert first.shape == again.shape == (B, SQ_NEW, HQ, dv)
    assert cupy.array_equal(first, again)
    plan = cuattn.plan_decode(q, k, v, lens, num_splits=3, return_lse=True)
    out, lse = plan.run()
    assert out.shape == (B, SQ_NEW, HQ, dv) and lse.shape == (B, HQ, SQ_NEW)
    assert cupy.array_equal(out, first)
    table = cupy.asarray(shuffled_table(rng, B, S_MAX, BLOCK_SIZE))
    k_pages, v_pages = (cupy.asarray(pages_of(x.get(), table.get(), BLOCK_SIZE)) for x in (k, v))
    paged_plan = cuattn.plan_paged_attention(q, (k_pages, v_pages), table, lens, num_splits=3)
    paged = paged_plan.run()
    assert paged.shape == (B, SQ_NEW, HQ, dv)
    # the same keys through the paged kernel: the same sums up to rounding
    assert cupy.allclose(paged.astype(cupy.float32), first.astype(cupy.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, E4M3], ids=[*DTYPE_IDS, "e4m3"])
@pytest.mark.parametrize("dims", E4M3_PAIRS + [(40, 24), (24, 40)], ids=E4M3_PAIR_IDS + ["d40-dv24", "d24-dv40"])
def test_cache_write_and_copy_kernels_with_a_value_head_dim(rng, dims, dtype):
    """The kernels' threads cover max(D, Dv) columns and write k's or v's chunk only within its
    row: the GPU pages equal the CPU cache's byte for byte, and nothing past Dv or D is written."""
    cupy = _cupy()
    d, dv = dims
    if dtype == E4M3 and (d % _arrays.E4M3_HEAD_DIM_STEP or dv % _arrays.E4M3_HEAD_DIM_STEP):
        pytest.skip("an e4m3 cache takes head dims that are multiples of 16")
    token_dtype = _arrays.BFLOAT16 if dtype == E4M3 else dtype
    scales = {"k_scale": 0.02, "v_scale": 0.03} if dtype == E4M3 else {}
    gpu = cuattn.PagedKVCache(16, BLOCK_SIZE, HK, d, dtype, head_dim_v=dv, **scales)
    cpu = cuattn.PagedKVCache(16, BLOCK_SIZE, HK, d, dtype, device="cpu", head_dim_v=dv, **scales)
    k = randn(rng, (40, HK, d), token_dtype)
    v = randn(rng, (40, HK, dv), token_dtype)
    slots = rng.permutation(16 * BLOCK_SIZE)[:40].astype(np.int32)
    slots[::7] = -1
    gpu.write(cupy.asarray(k), cupy.asarray(v), slots)
    cpu.write(k, v, slots)
    pairs = [(int(a), int(b)) for a, b in zip(rng.permutation(13)[:3], range(13, 16))]
    gpu.copy_blocks(pairs)
    cpu.copy_blocks(pairs)
    for name in ("k_pages", "v_pages"):
        host = getattr(cpu, name)
        got = getattr(gpu, name).get()
        assert got.shape == host.shape, name
        assert np.array_equal(got.view(np.uint8), host.view(np.uint8)), name


@pytest.mark.gpu
@pytest.mark.parametrize("dims", HEAD_DIM_PAIRS, ids=PAIR_IDS)
def test_paged_attention_varlen_with_a_value_head_dim(rng, dims):
    """Decode rows (paged decode) and runs longer than 16 queries (the paged forward) write their
    rows of the caller's poisoned (total_q, Hq, Dv) output."""
    cupy = _cupy()
    d, dv = dims
    bf16 = _arrays.BFLOAT16
    runs, seq_lens, block = (0, 1, 3, 16, 17, 40), (5, 300, 2, 64, 17, 129), 16
    cu = prefix_sums(runs)
    per_seq = -(-max(seq_lens) // block)
    table = rng.permutation(len(seq_lens) * per_seq).astype(np.int32).reshape(len(seq_lens), per_seq)
    q = randn(rng, (int(cu[-1]), HQ, d), bf16)
    k_pages = randn(rng, (table.size, block, HK, d), bf16)
    v_pages = randn(rng, (table.size, block, HK, dv), bf16)
    lens = np.asarray(seq_lens, np.int32)
    out = cupy.asarray(np.full((int(cu[-1]), HQ, dv), np.nan, bf16))
    got = cuattn.paged_attention_varlen(cupy.asarray(q), (cupy.asarray(k_pages), cupy.asarray(v_pages)),
                                        cupy.asarray(table), cupy.asarray(cu), cupy.asarray(lens), max(runs), out=out)
    assert got is out
    got = out.get().astype(np.float64)
    ref = reference.paged_attention_varlen(q, k_pages, v_pages, table, cu, lens)
    k_cache = reference.gather_pages(k_pages, table, lens)
    v_cache = reference.gather_pages(v_pages, table, lens)
    assert np.isfinite(got).all(), f"unwritten or NaN output (seed {rng.seed})"
    for b in range(len(runs)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.stop == rows.start:
            continue
        naive = reference.naive_attention_lowp(q[None, rows], k_cache[b:b + 1, :lens[b]],
                                               v_cache[b:b + 1, :lens[b]], dtype=bf16, causal=True)[0]
        budget = error_budget(np.abs(naive - ref[rows]).max(), bf16, 2.0, np.abs(ref[rows]).max())
        assert np.abs(got[rows] - ref[rows]).max() <= budget, f"sequence {b} (seed {rng.seed})"
