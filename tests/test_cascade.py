"""Cascade attention (cuattn/cascade.py): a prefix shared by the batch plus each sequence's own
paged tokens equals decode over each sequence's whole key list (prefix then own tokens), on the
CPU (float64) and on the GPU (the 2x rule), with options, an e4m3 suffix cache, and its errors.
"""

from __future__ import annotations

import importlib

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import reference
from conftest import BF16, check_decode, randn

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _cupy():
    import cupy

    return cupy


def make_batch(rng, dtype, batch=3, sq_new=2, hq=8, hk=2, d=64, prefix_len=37, block=16, lens=(5, 17, 40)):
    """Queries, the shared prefix, paged own tokens (shuffled pages), and each sequence's whole
    key list laid out contiguously for the reference: [B, L + max own, Hk, D]."""
    q = randn(rng, (batch, sq_new, hq, d), dtype)
    prefix_k, prefix_v = randn(rng, (prefix_len, hk, d), dtype), randn(rng, (prefix_len, hk, d), dtype)
    per_seq = -(-max(lens) // block)
    order = rng.permutation(batch * per_seq).astype(np.int32)
    table = order.reshape(batch, per_seq)
    k_pages = randn(rng, (batch * per_seq, block, hk, d), dtype)
    v_pages = randn(rng, (batch * per_seq, block, hk, d), dtype)
    full_len = prefix_len + per_seq * block
    k_full = np.zeros((batch, full_len, hk, d), dtype)
    v_full = np.zeros((batch, full_len, hk, d), dtype)
    for b in range(batch):
        k_full[b, :prefix_len], v_full[b, :prefix_len] = prefix_k, prefix_v
        k_full[b, prefix_len:] = k_pages[table[b]].reshape(-1, hk, d)
        v_full[b, prefix_len:] = v_pages[table[b]].reshape(-1, hk, d)
    lens = np.asarray(lens, np.int32)
    return q, (prefix_k, prefix_v), (k_pages, v_pages), table, lens, k_full, v_full, prefix_len + lens


@pytest.mark.parametrize("options", [{}, {"causal": False}, {"softcap": 20.0, "scale": 0.1}, {"sinks": "random"}],
                         ids=["causal", "noncausal", "softcap-scale", "sinks"])
@pytest.mark.parametrize("sq_new", [1, 3])
@pytest.mark.parametrize("prefix_splits", [None, 1, 4, 36, 37], ids=lambda s: f"splits{s}")
def test_cascade_equals_decode_over_prefix_then_own_tokens(sq_new, options, prefix_splits):
    rng = np.random.default_rng()
    q, prefix, pages, table, lens, k_full, v_full, full_lens = make_batch(rng, np.float32, sq_new=sq_new)
    if options.get("sinks") == "random":
        options = {"sinks": rng.standard_normal(q.shape[2]).astype(np.float32)}
    out, lse = cuattn.cascade_attention(q, prefix, pages, table, lens, return_lse=True, prefix_splits=prefix_splits,
                                        **options)
    ref, ref_lse = reference.decode(q, k_full, v_full, full_lens, return_lse=True, **options)
    assert out.dtype == np.float32 and out.shape == q.shape and lse.shape == (3, q.shape[2], sq_new)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-6)


def test_cascade_argument_errors():
    rng = np.random.default_rng()
    q, prefix, pages, table, lens, *_ = make_batch(rng, np.float32, sq_new=3)
    with pytest.raises(TypeError, match=r"prefix must be a \(prefix_k, prefix_v\) pair, got ndarray"):
        cuattn.cascade_attention(q, prefix[0], pages, table, lens)
    # the prefix's own names, not those of the varlen call that reads it
    wide = np.zeros(prefix[1].shape[:-1] + (2 * prefix[1].shape[-1],), np.float32)
    with pytest.raises(ValueError, match=r"prefix_v must be contiguous in its last axis \(head_dim\): prefix_v.strides\[-1\] "
                                         r"is 2 elements, expected 1"):
        cuattn.cascade_attention(q, (prefix[0], wide[..., ::2]), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_v.shape\[2\] \(head_dim_v\) = 12 is not supported"):
        cuattn.cascade_attention(q, (prefix[0], prefix[1][..., :12]), (pages[0], pages[1][..., :12]), table, lens)
    e4m3 = ml_dtypes.float8_e4m3fn
    with pytest.raises(TypeError, match=r"q.dtype is float8_e4m3fn; cascade_attention takes float16 or bfloat16 q"):
        cuattn.cascade_attention(q.astype(e4m3), tuple(x.astype(e4m3) for x in prefix), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_k must be 3-D \(L, Hk, D\), got shape \(1, 37, 2, 64\)"):
        cuattn.cascade_attention(q, (prefix[0][None], prefix[1]), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_v.shape\[0\] \(L\) must equal prefix_k.shape\[0\] = 37, got 36"):
        cuattn.cascade_attention(q, (prefix[0], prefix[1][1:]), pages, table, lens)
    with pytest.raises(ValueError, match=r"q.shape\[2\] \(num_heads\) = 8 must be a multiple of prefix_k.shape\[1\] "
                                         r"\(num_kv_heads\) = 3"):
        cuattn.cascade_attention(q, tuple(np.concatenate([x, x[:, :1]], axis=1) for x in prefix), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_k.shape\[2\] \(head_dim\) must equal q.shape\[3\] = 64, got 32"):
        cuattn.cascade_attention(q, (prefix[0][..., :32], prefix[1][..., :32]), pages, table, lens)
    for splits, error in ((0, ValueError), (38, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=rf"prefix_splits must be an int from 1 to 37 \(the prefix length L = 37, "
                                             rf"and at most \d+ parts a merge\), got {splits!r}"):
            cuattn.cascade_attention(q, prefix, pages, table, lens, prefix_splits=splits)
    # a prefix longer than a merge's parts: the merge's limit bounds the splits
    from cuattn.decode import max_merge_parts

    limit = max_merge_parts()
    long_prefix = tuple(np.zeros((limit + 1, 2, 64), np.float32) for _ in range(2))
    with pytest.raises(ValueError, match=rf"prefix_splits must be an int from 1 to {limit} \(the prefix length "
                                         rf"L = {limit + 1}, and at most {limit} parts a merge\), got {limit + 1}"):
        cuattn.cascade_attention(q, long_prefix, pages, table, lens, prefix_splits=limit + 1)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 2 counts sequence 1's own tokens, the new ones included, "
                                         r"so it must be at least q.shape\[1\] \(Sq_new\) = 3"):
        cuattn.cascade_attention(q, prefix, pages, table, np.array([5, 2, 40], np.int32))
    # the prefix's checks come first and run on checked arguments: q's rank, the options, the
    # prefix's dtype and its kv heads, which are the cache's
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, Sq_new, Hq, D\), got shape \(3, 8, 64\)"):
        cuattn.cascade_attention(q[0], prefix, pages, table, lens)
    with pytest.raises(TypeError, match=r"q must be a NumPy, CuPy, torch or JAX array .*got builtins.list"):
        cuattn.cascade_attention(q.tolist(), prefix, pages, table, lens)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got 'yes'"):
        cuattn.cascade_attention(q, prefix, pages, table, lens, return_lse="yes")
    with pytest.raises(TypeError, match=r"prefix_k.dtype must equal q.dtype = float32, got float16"):
        cuattn.cascade_attention(q, tuple(x.astype(np.float16) for x in prefix), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_k.shape\[1\] \(Hk\) must be at least 1, got 0"):
        cuattn.cascade_attention(q, tuple(x[:, :0] for x in prefix), pages, table, lens)
    with pytest.raises(ValueError, match=r"prefix_k.shape\[1\] \(Hk\) must equal k_pages.shape\[2\] = 2, got 1"):
        cuattn.cascade_attention(q, tuple(x[:, :1] for x in prefix), pages, table, lens)
    # the lengths are checked as lengths before they are read
    with pytest.raises(ValueError, match=r"seq_lens must be 1-D \(B\), got shape \(3, 1\)"):
        cuattn.cascade_attention(q, prefix, pages, table, lens[:, None])
    with pytest.raises(TypeError, match=r"seq_lens.dtype must be int32, got str64"):
        cuattn.cascade_attention(q, prefix, pages, table, np.array(["5", "17", "40"]))
    with pytest.raises(ValueError, match=r"seq_lens must be a rectangular list of ints"):
        cuattn.cascade_attention(q, prefix, pages, table, [[5], 17, 40])
    with pytest.raises(ValueError, match=r"seq_lens.shape\[0\] \(batch\) must equal q.shape\[0\] = 3, got 2"):
        cuattn.cascade_attention(q, prefix, pages, table, lens[:2])
    np.testing.assert_array_equal(cuattn.cascade_attention(q, prefix, pages, table.tolist(), lens.tolist()),
                                  cuattn.cascade_attention(q, prefix, pages, table, lens))


def test_device_seq_lens_are_checked_before_their_copy():
    """With check=True device lengths are copied to the host; their dtype is checked first, so a
    torch dtype NumPy lacks gets seq_lens' message, not torch's (the copy's)."""
    from cuattn import cascade as cascade_module
    from conftest import Tensor

    q = np.zeros((2, 1, 4, 64), np.float32)
    lens = Tensor((2,), "float8_e5m2")
    lens.is_cuda, lens.device = True, "cuda:0"
    with pytest.raises(TypeError, match=r"^seq_lens.dtype must be int32, got float8_e5m2$"):
        cascade_module._check_suffix_lengths(lens, q, True)
    assert cascade_module._check_suffix_lengths(lens, q, False) is lens, "without check nothing is read"


def test_default_prefix_splits_fill_the_sms(monkeypatch):
    from cuattn import _jit, cascade

    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: 132)
    # 64 decode rows of a 4-head group packed per KV head: 256 rows, 2 tiles per KV head, 16 tiles
    # for 8 KV heads, so 8 key ranges give 128 CTAs
    assert cascade.default_prefix_splits(256, 8, 8192, 0, 128) == 8
    assert cascade.default_prefix_splits(64, 32, 8192, 0, 128) == 4
    # no range shorter than MIN_SPLIT_KEYS, and never fewer than one
    assert cascade.default_prefix_splits(64, 32, 3 * cascade.MIN_SPLIT_KEYS - 1, 0, 128) == 2
    assert cascade.default_prefix_splits(64, 32, 100, 0, 128) == 1
    # rows enough to fill the SMs alone: no split
    assert cascade.default_prefix_splits(1024, 32, 8192, 0, 128) == 1
    # tiles of 64 rows: 4 per KV head, 32 in all, so 4 key ranges
    assert cascade.default_prefix_splits(256, 8, 8192, 0, 64) == 4


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_prefix_tile_rows_follow_the_forward_tile_tables(monkeypatch, arch):
    import importlib

    from cuattn import _jit, cascade

    attention_module = importlib.import_module("cuattn.attention")
    monkeypatch.setattr(_jit, "target_arch", lambda device_id=None: arch)
    # the Hopper tiles are 128 query rows; flash_fwd_kernel's are 128, but 64 in its 256 tile
    # (D = 192 pads into it); D = 24 has no Hopper tile
    wide = 128 if arch == "sm_90a" else 64
    for (d, dv), rows in {(128, 128): 128, (64, 64): 128, (192, 128): wide, (24, 24): 128}.items():
        assert cascade._tile_rows(d, dv) == rows, (d, dv)
    # a three-warpgroup Hopper tile (192 rows) counts where the table holds one, on sm_90a only
    three = attention_module.FwdSm90Tile(128, 3, 2, False, False)
    monkeypatch.setitem(attention_module.FWD_SM90_TILES, (128, 128), three)
    assert cascade._tile_rows(128, 128) == (192 if arch == "sm_90a" else 128)


@pytest.mark.gpu
@pytest.mark.parametrize("sq_new", [1, 4])
@pytest.mark.parametrize("prefix_splits", [None, 1, 7], ids=lambda s: f"splits{s}")
def test_cascade_on_the_gpu(rng, sq_new, prefix_splits):
    cupy = _cupy()
    # a 2000-key prefix: the default splits it in 3 (8 KV heads, one tile of packed rows each) on an H200
    q, prefix, pages, table, lens, k_full, v_full, full_lens = make_batch(
        rng, BF16, batch=6, sq_new=sq_new, hq=32, hk=8, d=128, prefix_len=2000, lens=(5, 17, 400, 64, 9, 300))
    out, lse = cuattn.cascade_attention(cupy.asarray(q), tuple(cupy.asarray(x) for x in prefix),
                                        tuple(cupy.asarray(x) for x in pages), cupy.asarray(table), cupy.asarray(lens),
                                        return_lse=True, prefix_splits=prefix_splits)
    check_decode(rng, BF16, q, k_full, v_full, full_lens, out.get(), lse.get())


@pytest.mark.gpu
def test_cascade_with_torch_sinks_and_splits(rng):
    torch = pytest.importorskip("torch")
    q, prefix, pages, table, lens, k_full, v_full, full_lens = make_batch(
        rng, BF16, batch=4, sq_new=2, hq=8, hk=2, d=64, prefix_len=300, lens=(5, 17, 40, 2))
    sinks = rng.standard_normal(8).astype(np.float32)

    def dev(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", torch.bfloat16 if x.dtype == BF16 else None)

    out, lse = cuattn.cascade_attention(dev(q), tuple(dev(x) for x in prefix), tuple(dev(x) for x in pages),
                                        torch.from_numpy(table).cuda(), torch.from_numpy(lens).cuda(),
                                        return_lse=True, sinks=torch.from_numpy(sinks).cuda(), prefix_splits=5)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    check_decode(rng, BF16, q, k_full, v_full, full_lens, out.float().cpu().numpy().astype(BF16),
                 lse.cpu().numpy(), sinks=sinks)


@pytest.mark.gpu
def test_cascade_over_an_e4m3_paged_cache(rng):
    cupy = _cupy()
    q, prefix, (k_pages, v_pages), table, lens, _, _, full_lens = make_batch(rng, BF16, hq=8, hk=2, d=128)
    cache = cuattn.PagedKVCache(k_pages.shape[0], k_pages.shape[1], 2, 128, "float8_e4m3fn", k_scale=0.01,
                                v_scale=0.02)
    slots = np.arange(k_pages.shape[0] * k_pages.shape[1], dtype=np.int32)
    cache.write(cupy.asarray(k_pages.reshape(-1, 2, 128)), cupy.asarray(v_pages.reshape(-1, 2, 128)), slots)
    out, lse = cuattn.cascade_attention(cupy.asarray(q), tuple(cupy.asarray(x) for x in prefix), cache,
                                        cupy.asarray(table), cupy.asarray(lens), return_lse=True)
    # the reference over the prefix and the cache's real (dequantised) own tokens
    k_real = cache.k_pages.get().view(E4M3).astype(np.float64) * 0.01
    v_real = cache.v_pages.get().view(E4M3).astype(np.float64) * 0.02
    prefix_len = prefix[0].shape[0]
    k_full = np.concatenate([np.broadcast_to(prefix[0].astype(np.float64), (3, *prefix[0].shape)),
                             k_real[table].reshape(3, -1, 2, 128)], axis=1)
    v_full = np.concatenate([np.broadcast_to(prefix[1].astype(np.float64), (3, *prefix[1].shape)),
                             v_real[table].reshape(3, -1, 2, 128)], axis=1)
    assert k_full.shape[1] >= prefix_len + int(lens.max())
    check_decode(rng, BF16, q, k_full, v_full, full_lens, out.get(), lse.get())


@pytest.mark.gpu
def test_cascade_captured_in_a_cuda_graph(rng):
    """The splits' bounds come from a cache filled by eager calls; a capture that misses it makes
    them on the device (a host copy cannot be captured). Both replay to the reference."""
    cupy = _cupy()
    from cuattn import cascade

    q, prefix, pages, table, lens, k_full, v_full, full_lens = make_batch(
        rng, BF16, batch=5, sq_new=1, hq=8, hk=2, d=128, prefix_len=1500, lens=(5, 17, 40, 2, 9))
    args = (cupy.asarray(q), tuple(cupy.asarray(x) for x in prefix), tuple(cupy.asarray(x) for x in pages),
            cupy.asarray(table), cupy.asarray(lens))
    captured_before = len(cascade._captured_split_bounds)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.cascade_attention(*args, prefix_splits=3, check=False)  # kernels loaded, bounds of 3 cached
        assert any(key[1] == 3 for key in cascade._split_bounds_cache)
        results = {}
        for splits in (3, 4):  # 4: not cached, made during the capture
            stream.synchronize()
            stream.begin_capture()
            out, lse = cuattn.cascade_attention(*args, prefix_splits=splits, check=False, return_lse=True)
            graph = stream.end_capture()
            out[...] = cupy.nan
            graph.launch(stream)
            stream.synchronize()
            results[splits] = (out.get(), lse.get())
        assert not any(key[1] == 4 for key in cascade._split_bounds_cache)
        # the bounds the capture made live on: the graph writes and reads them at every replay
        assert len(cascade._captured_split_bounds) == captured_before + 1
    for out, lse in results.values():
        check_decode(rng, BF16, q, k_full, v_full, full_lens, out, lse)


@pytest.mark.gpu
def test_cascade_in_a_torch_cuda_graph(rng):
    """Captured with torch.cuda.graph, the call's device memory comes from torch's allocator, which
    keeps it for the graph: arrays made after the capture (CuPy's and torch's) are not written by
    a replay, and the replay matches the reference."""
    torch = pytest.importorskip("torch")
    cupy = _cupy()
    q, prefix, pages, table, lens, k_full, v_full, full_lens = make_batch(
        rng, BF16, batch=4, sq_new=2, hq=8, hk=2, d=64, prefix_len=700, lens=(5, 17, 40, 2))

    def dev(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to("cuda", torch.bfloat16)

    args = (dev(q), tuple(dev(x) for x in prefix), tuple(dev(x) for x in pages), torch.from_numpy(table).cuda(),
            torch.from_numpy(lens).cuda())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuattn.cascade_attention(*args, prefix_splits=3, check=False)  # kernels, plans, cached bounds
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = cuattn.cascade_attention(*args, prefix_splits=3, check=False, return_lse=True)
    clutter = [cupy.full((1 << 18,), cupy.nan, cupy.float32) for _ in range(8)]
    clutter += [cupy.asarray(torch.full((1 << 18,), float("nan"), device="cuda")) for _ in range(8)]
    graph.replay()
    torch.cuda.synchronize()
    assert all(bool(cupy.isnan(c).all()) for c in clutter), "the replay wrote memory the capture had freed"
    check_decode(rng, BF16, q, k_full, v_full, full_lens, out.float().cpu().numpy().astype(BF16), lse.cpu().numpy())


# (Sq_new, options, suffix lengths): decode rows with the default splits, several new tokens (the
# prefix lse through its grouped layout and a copy) with sinks and softcap, and long suffixes of
# two sequences (the suffix decode splits: its partials live in the plan's scratch too)
PLAN_CASES = [(1, {}, (5, 17, 400, 64, 9, 300)),
              (4, {"sinks": True, "softcap": 25.0, "scale": 0.07}, (5, 17, 400, 64, 9, 300)),
              (3, {"causal": False}, (3000, 1777))]


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("sq_new, options, lens", PLAN_CASES, ids=["decode", "sq4-sinks-softcap", "long-suffix"])
@pytest.mark.parametrize("return_lse", [True, False], ids=["lse", "out-only"])
def test_cascade_second_call_takes_the_plan(rng, monkeypatch, framework, sq_new, options, lens, return_lse):
    """With check=False the second call of a signature runs the plan (the full path is made to
    fail) over fresh inputs and matches the reference; the plan's launches are the copy, the
    prefix forward, the merge, the lse copy where Sq_new > 1, the suffix decode (which merges its
    splits in its last CTA when it splits) and the final merge."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
    from cuattn import _arrays, _calls

    _calls.clear()
    batch = len(lens)
    hq, hk, d = 32, 8, 128
    sinks = rng.standard_normal(hq).astype(np.float32) if options.get("sinks") else None
    call_options = {**options, "sinks": sinks}

    def dev(x):
        if x is None:
            return None
        if framework == "torch":
            return torch.from_numpy(np.asarray(x, np.float32) if x.dtype == BF16 else x).to(
                "cuda", torch.bfloat16 if x.dtype == BF16 else None)
        return _cupy().asarray(x)

    for step in range(2):
        if step == 1:
            # the first call's parts (attention_varlen, paged_attention) leave plans of their own
            (plan,) = (plan for key, plan in _calls._plans.items() if key[0] == "cascade_attention")
            assert len(plan.launches) == 5 + (sq_new > 1)
            suffix = plan.launches[3 + (sq_new > 1)][0]
            assert suffix.spec.name.startswith("cuattn::paged_decode_kernel")
            if lens[0] == 3000:
                assert suffix.grid[0] > 1, "the long suffix splits its keys"
            # its arrival counters come from a zeroed output (the scratch is not zeroed)
            decode_module = importlib.import_module("cuattn.decode")
            assert ("arrivals", (decode_module.SPLIT_ARRIVAL_SLOTS,), True, True) in plan.outputs

            def refuse(**named):
                raise AssertionError("a planned call took the full path")

            monkeypatch.setattr(_arrays, "array_context", refuse)
        q, prefix, pages, table, seq_lens, k_full, v_full, full_lens = make_batch(
            rng, BF16, batch=batch, sq_new=sq_new, hq=hq, hk=hk, d=d, prefix_len=1900, lens=lens)
        result = cuattn.cascade_attention(dev(q), tuple(dev(x) for x in prefix), tuple(dev(x) for x in pages),
                                          dev(table), dev(seq_lens), check=False, return_lse=return_lse,
                                          **{**call_options, "sinks": dev(sinks)})
        out, lse = result if return_lse else (result, None)
        assert type(out).__module__.split(".")[0] == framework and tuple(out.shape) == q.shape
        got = _arrays.to_numpy(out).astype(np.float32).astype(BF16)
        if lse is None:  # checked through the output alone
            ref_lse = reference.decode(q, k_full, v_full, full_lens, return_lse=True, **call_options)[1]
            check_decode(rng, BF16, q, k_full, v_full, full_lens, got, ref_lse, **call_options)
        else:
            check_decode(rng, BF16, q, k_full, v_full, full_lens, got, _arrays.to_numpy(lse), **call_options)
    assert sum(key[0] == "cascade_attention" for key in _calls._plans) == 1


@pytest.mark.gpu
def test_cascade_plan_over_an_e4m3_cache_and_with_check_takes_none(rng, monkeypatch):
    """A PagedKVCache of e4m3 brings its scales into the plan; check=True always takes the full path."""
    cupy = _cupy()
    from cuattn import _calls

    _calls.clear()
    q, prefix, (k_pages, v_pages), table, lens, _, _, full_lens = make_batch(rng, BF16, hq=8, hk=2, d=128)
    cache = cuattn.PagedKVCache(k_pages.shape[0], k_pages.shape[1], 2, 128, "float8_e4m3fn", k_scale=0.01,
                                v_scale=0.02)
    slots = np.arange(k_pages.shape[0] * k_pages.shape[1], dtype=np.int32)
    cache.write(cupy.asarray(k_pages.reshape(-1, 2, 128)), cupy.asarray(v_pages.reshape(-1, 2, 128)), slots)
    args = (cupy.asarray(q), tuple(cupy.asarray(x) for x in prefix), cache, cupy.asarray(table), cupy.asarray(lens))
    def cascade_plans():
        return sum(key[0] == "cascade_attention" for key in _calls._plans)

    checked = cuattn.cascade_attention(*args, return_lse=True)
    assert cascade_plans() == 0
    first = cuattn.cascade_attention(*args, return_lse=True, check=False)
    assert cascade_plans() == 1
    planned = cuattn.cascade_attention(*args, return_lse=True, check=False)
    # the plan repeats the first call's kernels and split counts: the same bits
    assert all(bool(cupy.array_equal(x, y)) for x, y in zip(first, planned))
    # the checked call may split the suffix by its longest length instead of the table's capacity
    np.testing.assert_allclose(cupy.asnumpy(planned[0]).astype(np.float32),
                               cupy.asnumpy(checked[0]).astype(np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(cupy.asnumpy(planned[1]), cupy.asnumpy(checked[1]), rtol=1e-3, atol=1e-3)


def test_plan_cascade_refuses_host_arrays():
    rng = np.random.default_rng()
    q, prefix, pages, table, lens, *_ = make_batch(rng, np.float32)
    with pytest.raises(TypeError, match="plan_cascade plans GPU launches over CuPy or torch arrays"):
        cuattn.plan_cascade(q, prefix, pages, table, lens)


def test_plan_cascade_names_what_keeps_a_call_from_a_plan(monkeypatch):
    """Where the checked call has no plan (a capture running, q's rows (b, s) not one axis,
    strided table rows or lengths, ...), plan_cascade says so instead of returning a step."""
    from cuattn import _calls, cascade

    rng = np.random.default_rng()
    q, prefix, pages, table, lens, *_ = make_batch(rng, np.float32)
    monkeypatch.setattr(_calls, "framework", lambda x: object())  # device arrays, as far as the check sees
    monkeypatch.setattr(cascade, "cascade_attention", lambda *args, **kwargs: None)
    monkeypatch.setattr(cascade, "_plan", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="plan_cascade cannot plan these arrays .*block_table rows or seq_lens not "
                                         "contiguous"):
        cuattn.plan_cascade(q, prefix, pages, table, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("sq_new", [1, 2])
def test_plan_cascade_runs_steps_over_arrays_updated_in_place(rng, framework, sq_new):
    """A step plan reads q, the table and the lengths where they are: each step writes new ones in
    place, and run() (eagerly, then replayed from a CUDA graph) matches the reference."""
    cupy = _cupy()
    if framework == "torch":
        torch = pytest.importorskip("torch")
    from cuattn import _arrays

    batch, hq, hk, d, prefix_len, max_len = 4, 16, 4, 128, 900, 70
    q, prefix, pages, table, lens, *_ = make_batch(rng, BF16, batch=batch, sq_new=sq_new, hq=hq, hk=hk, d=d,
                                                   prefix_len=prefix_len, lens=(max_len,) * batch)
    sinks = rng.standard_normal(hq).astype(np.float32)
    dq, dtable, dlens = cupy.asarray(q), cupy.asarray(table), cupy.asarray(lens)
    device = [dq, *(cupy.asarray(x) for x in prefix), *(cupy.asarray(x) for x in pages), dtable, dlens,
              cupy.asarray(sinks)]
    wrapped = [torch.from_dlpack(x) for x in device] if framework == "torch" else device
    plan = cuattn.plan_cascade(wrapped[0], (wrapped[1], wrapped[2]), (wrapped[3], wrapped[4]), wrapped[5],
                               wrapped[6], sinks=wrapped[7], return_lse=True, max_seq_len=max_len)
    stream = cupy.cuda.Stream(non_blocking=True)
    for step in range(3):
        # a new step: fresh queries, each sequence one of its own lengths, the table's rows shuffled
        q = randn(rng, q.shape, BF16)
        lens = rng.integers(sq_new, max_len + 1, batch).astype(np.int32)
        table = table[rng.permutation(batch)]
        dq[...], dlens[...], dtable[...] = cupy.asarray(q), cupy.asarray(lens), cupy.asarray(table)
        if step < 2:
            out, lse = plan.run()
        else:  # replayed from a graph captured on a CuPy stream (CuPy arrays: torch's stream differs)
            if framework == "torch":
                continue
            with stream:
                stream.synchronize()
                stream.begin_capture()
                out, lse = plan.run()
                graph = stream.end_capture()
                plan.out[...] = cupy.nan
                graph.launch(stream)
                stream.synchronize()
        k_full = np.concatenate([np.broadcast_to(prefix[0], (batch, *prefix[0].shape)),
                                 pages[0][table].reshape(batch, -1, hk, d)], axis=1)
        v_full = np.concatenate([np.broadcast_to(prefix[1], (batch, *prefix[1].shape)),
                                 pages[1][table].reshape(batch, -1, hk, d)], axis=1)
        check_decode(rng, BF16, q, k_full, v_full, prefix_len + lens,
                     _arrays.to_numpy(out).astype(np.float32).astype(BF16), _arrays.to_numpy(lse), sinks=sinks)
