"""Cascade attention: a prefix shared by every sequence of a batch, read once per step.

Many samples of one prompt, beam search, or a long system prompt give a batch whose sequences
start with the same L tokens. Decode over a paged cache reads those tokens' keys and values once
per sequence; here the shared prefix is read once for the whole batch, and each sequence's own
tokens (its suffix, in the paged cache) once for that sequence:

    prefix   every query of the batch against the prefix keys, non-causal, on tensor cores, the
             prefix's bytes read once. The B x Sq_new queries are one sequence, and each KV
             head's G query heads are packed into its rows ((query, group member) pairs). Alone
             that would fill two tiles per KV head (16 CTAs for 64 queries and GQA 32/8), so
             the prefix's keys are split into S contiguous ranges and the rows repeated S
             times: one attention_varlen call over S "sequences" of the same rows, each against
             its key range, fills the GPU (S x tiles ~ the SM count)
    suffix   each sequence's queries against its own tokens (cuattn.paged_attention, causal);
             the sinks join here, once per row
    merge    the S prefix states (read in place: the splits are evenly strided; written
             unpacked, into a permuted view of the prefix's (B, Sq_new, Hq, Dv)), then the
             prefix with the suffix, by their log-sum-exp (cuattn.merge_states): softmax over
             disjoint key sets merges exactly

Layouts:

    q                 (B, Sq_new, Hq, D)    the new tokens, which are the last of each suffix
    prefix_k          (L, Hk, D)            the shared prefix, before every sequence's own tokens
    prefix_v          (L, Hk, Dv)           Dv: v's head dim, D by default (DeepSeek: D = 192, Dv = 128)
    cache             PagedKVCache or (k_pages, v_pages) (num_blocks, block_size, Hk, D | Dv)
    block_table       (B, max_blocks) int32 sequence b's own tokens, seq_lens[b] of them (>= Sq_new)
    out               (B, Sq_new, Hq, Dv)   lse (B, Hq, Sq_new) float32, natural log

Sequence b's keys are the L prefix tokens then its seq_lens[b] own tokens; with ``causal``, new
token i sees every prefix key and its own tokens j <= seq_lens[b] - Sq_new + i (the prefix always
lies before the new tokens, so it needs no mask).

A repeated call (CuPy or torch arrays of the same signatures and options, ``check=False``) runs a
plan (cuattn._calls): its first call, after the steps above, prepares their launches over one
scratch allocation of the caller's framework, and later calls only allocate out, lse and that
scratch and launch:

    copy      q's rows, GQA group packed, once per split            scratch [S, R, G, Hk, D]
    prefix    the varlen forward over the splits (static schedule)  scratch [S R G, Hk, Dv], [Hk, S R G]
    merge     the S prefix states into state 0                      scratch [2, B, Sq_new, Hq, Dv]
              (with Sq_new > 1 its lse through [R, Hk, G], copied)  scratch [2, B, Hq, Sq_new]
    suffix    paged decode (its split partials in the scratch too)  state 1
    final     states 0 and 1 merged into out and lse
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _calls, _jit, _masks, decode as _decode
from .attention import FWD_SM90_TILES, SM90, _launch_fwd, attention_varlen, fwd_sm90_tile_dims, fwd_tile
from .decode import max_merge_parts, merge_stacked, merge_states
from .paged import PagedKVCache, _cache_pair, paged_attention, prepare_copy

# Fewest prefix keys one split takes when the split count is chosen here: a split of fewer keys
# spends more of its time on its tile's prologue and epilogue than on its key blocks.
MIN_SPLIT_KEYS = 512
# The splits' cu_seqlens on the device, by (device, splits, packed rows, keys per split, L): a
# serving loop repeats one shape step after step, and its calls and the CUDA graphs captured
# from them reuse one pair. Kept for the life of the process (a graph reads them at every
# replay; a few hundred bytes a shape), as are the pairs made during captures.
_split_bounds_cache: dict[tuple, tuple] = {}
_captured_split_bounds: list[tuple] = []


def cascade_attention(q, prefix, cache, block_table, seq_lens, *, causal=True, scale=None, softcap=0.0, sinks=None,
                      return_lse=False, max_seq_len=None, check=True, k_scale=None, v_scale=None, prefix_splits=None):
    """Attention of each sequence's new tokens over a shared prefix and its own paged tokens.

    Args:
        q: ``(B, Sq_new, Hq, D)``, Sq_new from 1 to 16, float16 or bfloat16.
        prefix: ``(prefix_k, prefix_v)``, ``(L, Hk, D)`` and ``(L, Hk, Dv)`` in q's dtype and
            framework: the keys and values of the tokens every sequence starts with (L >= 1); Dv
            is the cache's value head dim too.
        cache, block_table, seq_lens, max_seq_len, check, k_scale, v_scale: each sequence's own
            tokens, as in :func:`cuattn.paged_attention` (an e4m3 cache works too). ``seq_lens[b]``
            counts sequence b's own tokens, the new ones included, so it is at least Sq_new;
            NumPy and checked lengths are refused below that.
        causal, scale, softcap, sinks: as in :func:`cuattn.decode` (the sinks join once per row).
        prefix_splits: how many key ranges the prefix is split into at most (1 to L), each
            attended by a copy of the queries and merged; the ranges are ceil(L / prefix_splits)
            keys each, the last one shorter, so that none is empty: fewer where that leaves a range
            over (L = 5 asked for 4 takes 3 ranges of 2, 2 and 1 keys). Default: on the GPU enough
            to give every SM a tile (each range at least MIN_SPLIT_KEYS keys), on the CPU 1.

    Returns:
        ``out`` ``(B, Sq_new, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)``.

    NumPy inputs run the GPU's algorithm on the float64 reference: the prefix's and the own
    tokens' states, each in q's dtype with a float32 lse, merged (within about 1e-7 relative of a
    one-shot float64 decode over ``[prefix; own tokens]`` for float64 inputs, less where lse is
    large; the plain functions' results are that one-shot reference).
    """
    call_key = None
    planned = None if check else _plan_inputs(q, prefix, cache, sinks, k_scale, v_scale)
    if planned is not None:
        arrays = _plan_arrays(planned[0], block_table, seq_lens)
        options = (bool(causal), scale, softcap, bool(return_lse), max_seq_len, prefix_splits,
                   _decode.scale_options(k_scale, v_scale))
        result, call_key = _calls.run("cascade_attention", arrays, options)
        if result is not None:
            return result
    _masks.check_options((-1, -1), softcap, scale, causal=causal, return_lse=return_lse, check=check)
    prefix_k, prefix_v = _check_prefix(prefix, q, cache)
    seq_lens = _check_suffix_lengths(seq_lens, q, check)
    out_prefix, lse_prefix = _prefix_states(q, prefix_k, prefix_v, prefix_splits, scale, softcap)
    out_own, lse_own = paged_attention(q, cache, block_table, seq_lens, max_seq_len=max_seq_len, causal=causal,
                                       scale=scale, softcap=softcap, sinks=sinks, return_lse=True, check=check,
                                       k_scale=k_scale, v_scale=v_scale)
    out, lse = merge_states(out_prefix, lse_prefix, out_own, lse_own)
    if call_key is not None:
        # the checks above passed: later calls of this signature run the plan
        _calls.remember(call_key, _plan(planned[0], planned[1], block_table, seq_lens, causal=causal, scale=scale,
                                        softcap=softcap, return_lse=return_lse, max_seq_len=max_seq_len,
                                        splits=prefix_splits))
    return (out, lse) if return_lse else out


def plan_cascade(q, prefix, cache, block_table, seq_lens, *, causal=True, scale=None, softcap=0.0, sinks=None,
                 return_lse=False, max_seq_len=None, k_scale=None, v_scale=None, prefix_splits=None):
    """Plan once, run many: a :class:`StepPlan` whose ``run()`` is one cascade step over these arrays.

    Takes the arguments of :func:`cascade_attention` (CuPy or torch arrays; ``block_table`` and
    ``seq_lens`` on the device, not read on the host, as with ``check=False``) and checks them
    once, by one call. The plan owns its outputs and scratch and keeps reading the arrays given
    here: write each step's queries into ``q`` and the lengths and table into ``seq_lens`` and
    ``block_table`` in place (the prefix and the pages stay where they are), then call
    ``plan.run()``: only the step's five or six launches, no allocation and no host-device copy,
    so it can be captured in a CUDA graph; it returns the plan's ``out`` (and ``lse``),
    overwritten by each run.
    """
    planned = _plan_inputs(q, prefix, cache, sinks, k_scale, v_scale)
    if planned is None or any(_calls.framework(x) is None for x in (q, block_table, seq_lens)):
        raise TypeError("plan_cascade plans GPU launches over CuPy or torch arrays (a (prefix_k, prefix_v) pair, "
                        "device block_table and seq_lens); call cuattn.cascade_attention otherwise")
    options = dict(causal=causal, scale=scale, softcap=softcap, return_lse=return_lse, max_seq_len=max_seq_len)
    # every check of the full path, once
    cascade_attention(q, prefix, cache, block_table, seq_lens, sinks=sinks, check=False, k_scale=k_scale,
                      v_scale=v_scale, prefix_splits=prefix_splits, **options)
    # launches of its own (a cached plan's are rewritten by every planned call)
    plan = _plan(planned[0], planned[1], block_table, seq_lens, splits=prefix_splits, **options)
    arrays = _plan_arrays(planned[0], block_table, seq_lens)
    step = None if plan is None else plan.step(arrays, [_calls.framework(x) if x is not None else None
                                                        for x in arrays])
    if step is None:
        raise ValueError("plan_cascade cannot plan these arrays (a stream capture running, q's rows (b, s) not one "
                         "axis, block_table rows or seq_lens not contiguous, another device current, or an "
                         "unaligned view)")
    return step


def _prefix_states(q, prefix_k, prefix_v, splits, scale, softcap):
    """Every query against the whole prefix: ``(out, lse)`` as ``(B, Sq_new, Hq, Dv)`` and
    ``(B, Hq, Sq_new)`` in q's framework, from S key ranges merged by their lse.

    The GQA group's query heads are packed into the rows of their KV head: KV head k's rows are
    (query r, group member g) for the R = B x Sq_new queries, R x G of them, so 64 decode rows of
    a 4-head group fill two whole 128-row tiles instead of half of each of four.
    """
    batch, sq_new, num_heads, head_dim = (int(n) for n in q.shape)
    prefix_len, num_kv_heads, head_dim_v = int(prefix_k.shape[0]), int(prefix_k.shape[1]), int(prefix_v.shape[2])
    group = num_heads // num_kv_heads
    rows = batch * sq_new
    packed = rows * group  # rows of one KV head in one split
    with _arrays.array_context(q=q, prefix_k=prefix_k, prefix_v=prefix_v) as ctx:
        splits, per_split = _split_ranges(splits, prefix_len, packed, num_kv_heads, head_dim, head_dim_v,
                                          None if ctx.on_host else ctx.device_id)
        # the prefix's layout rule by its own names (the varlen call below would name k and v)
        _arrays.check_last_axes({"prefix_k": ctx.view(prefix_k), "prefix_v": ctx.view(prefix_v)})
        # [S, R, G, Hk, D]: query r's head k * G + g is row (r, g) of KV head k, once per split
        grouped = ctx.view(q).reshape(rows, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3)
        shape = (splits, rows, group, num_kv_heads, head_dim)
        if ctx.on_host:
            repeated = np.ascontiguousarray(np.broadcast_to(grouped, shape))
        else:
            # device memory comes from the caller's framework, here and in the varlen call (torch's
            # allocator keeps what a captured graph used for that graph)
            repeated = ctx.empty(shape, grouped.dtype)
            repeated[...] = grouped
        cu_q, cu_k = _split_bounds(ctx, splits, packed, per_split, prefix_len)
        # out [S * R * G, Hk, Dv], lse [Hk, S * R * G], in the caller's framework, then viewed
        out, lse = attention_varlen(ctx.to_caller(repeated.reshape(splits * packed, num_kv_heads, head_dim)), prefix_k,
                                    prefix_v, ctx.to_caller(cu_q), ctx.to_caller(cu_k), packed, per_split, scale=scale,
                                    softcap=softcap, return_lse=True)
        out, lse = ctx.view(out), ctx.view(lse)
        # the splits' states, stacked: [S, R, G, Hk, Dv] and [S, R, Hk, G] (views)
        parts = out.reshape(splits, rows, group, num_kv_heads, head_dim_v)
        parts_lse = lse.reshape(num_kv_heads, splits, rows, group).transpose(1, 2, 0, 3)
        if ctx.on_host:
            grouped_out, grouped_lse = merge_states(list(zip(parts, parts_lse)))
            out = grouped_out.transpose(0, 2, 1, 3).reshape(batch, sq_new, num_heads, head_dim_v)
            return out, np.ascontiguousarray(grouped_lse.reshape(batch, sq_new, num_heads).transpose(0, 2, 1))
        # the merged state lands unpacked: (R, G, Hk, Dv) is a permuted view of (B, Sq_new, Hq, Dv)
        merged_out = ctx.empty((batch, sq_new, num_heads, head_dim_v), out.dtype)
        merged_lse = ctx.empty((batch, num_heads, sq_new), np.float32)
        grouped_out = merged_out.reshape(rows, num_kv_heads, group, head_dim_v).transpose(0, 2, 1, 3)
        # (B, Hq, 1) is (R, Hk, G) for decode rows; with Sq_new > 1, (b, s) is no single axis there
        grouped_lse = (merged_lse.reshape(rows, num_kv_heads, group) if sq_new == 1
                       else ctx.empty((rows, num_kv_heads, group), np.float32))
        merge_stacked(parts, parts_lse, grouped_out, grouped_lse, ctx.stream)
        if sq_new > 1:
            merged_lse[...] = grouped_lse.reshape(batch, sq_new, num_heads).transpose(0, 2, 1)
        return ctx.to_caller(merged_out), ctx.to_caller(merged_lse)


def _split_ranges(splits, prefix_len: int, packed: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                  device_id) -> tuple[int, int]:
    """(S, keys per split): ``splits`` checked, or by default (device_id None: the CPU, one split)
    enough to give every SM a tile. Split s takes keys [s * per_split, (s + 1) * per_split), the
    last one up to L; no split is empty (L = 5 asked for 4 splits takes 3 of 2, 2 and 1 keys)."""
    splits = _check_splits(splits, prefix_len) if splits is not None else (
        1 if device_id is None else default_prefix_splits(packed, num_kv_heads, prefix_len, device_id,
                                                          _tile_rows(head_dim, head_dim_v)))
    per_split = -(-prefix_len // splits)
    return -(-prefix_len // per_split), per_split


def _split_bounds(ctx, splits: int, packed: int, per_split: int, prefix_len: int):
    """cu_seqlens_q and cu_seqlens_k of the splits, int32 [S + 1] each: split s holds rows
    [s * packed, (s + 1) * packed) and keys [s * per_split, min((s + 1) * per_split, L))."""
    key = (ctx.device_id, splits, packed, per_split, prefix_len)
    cached = None if ctx.on_host else _split_bounds_cache.get(key)
    if cached is not None:
        return cached
    if not ctx.on_host and ctx.stream.is_capturing():
        # a copy from the host cannot be captured: made on the device by the graph itself (not
        # cached: their values exist only once it has run)
        import cupy

        made = (cupy.arange(0, (splits + 1) * packed, packed, dtype=np.int32),
                cupy.minimum(cupy.arange(0, (splits + 1) * per_split, per_split, dtype=np.int32), prefix_len))
        _captured_split_bounds.append(made)
        return made
    cu_q = (np.arange(splits + 1, dtype=np.int64) * packed).astype(np.int32)
    cu_k = np.minimum(np.arange(splits + 1, dtype=np.int64) * per_split, prefix_len).astype(np.int32)
    if ctx.on_host:
        return cu_q, cu_k
    bounds = ctx.ints(cu_q, cu_k)
    # the copy has landed before any stream reads the pair
    ctx.stream.synchronize()
    _split_bounds_cache[key] = bounds
    return bounds


def default_prefix_splits(rows: int, num_kv_heads: int, prefix_len: int, device_id: int, tile_rows: int) -> int:
    """Key ranges that give the prefix's varlen call about one tile per SM (``rows`` packed rows
    per KV head in tiles of ``tile_rows`` query rows), none shorter than MIN_SPLIT_KEYS."""
    tiles = -(-rows // tile_rows) * num_kv_heads
    by_sms = _jit.multiprocessor_count(device_id) // tiles
    return max(1, min(by_sms, prefix_len // MIN_SPLIT_KEYS))


def _tile_rows(head_dim: int, head_dim_v: int) -> int:
    """Query rows per tile of the forward the prefix runs on: the Hopper tile holding the head dims
    on sm_90a, else flash_fwd_kernel's (the split count only needs the tile count roughly)."""
    arch = _jit.target_arch()
    dims = fwd_sm90_tile_dims(head_dim, head_dim_v) if arch == SM90 else None
    return FWD_SM90_TILES[dims].block_m if dims is not None else fwd_tile(head_dim, arch, head_dim_v=head_dim_v).block_m


def _check_splits(splits, prefix_len: int) -> int:
    """At most a key per split, and at most as many splits as one merge takes."""
    limit = min(prefix_len, max_merge_parts())
    return _arrays.check_int("prefix_splits", splits, 1, limit, why=f" (the prefix length L = {prefix_len}, and at "
                                                                     f"most {max_merge_parts()} parts a merge)")


def _check_prefix(prefix, q, cache):
    if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2):
        raise TypeError(f"prefix must be a (prefix_k, prefix_v) pair, got {type(prefix).__name__}")
    prefix_k, prefix_v = prefix
    _arrays.common_kind({"q": q, "prefix_k": prefix_k, "prefix_v": prefix_v})
    _arrays.check_ndim("q", q, "(B, Sq_new, Hq, D)")
    for name, x, layout in (("prefix_k", prefix_k, "(L, Hk, D)"), ("prefix_v", prefix_v, "(L, Hk, Dv)")):
        _arrays.check_ndim(name, x, layout)
        _arrays.check_positive(name, x, 0, "L")
    # the raw arrays of any framework (not views); q's own dtype rule is the suffix call's
    # (paged_attention), but the prefix runs through the 16-bit forward: no e4m3 q or prefix
    if _arrays.is_e4m3(q):
        raise TypeError("q.dtype is float8_e4m3fn; cascade_attention takes float16 or bfloat16 q (an e4m3 cache "
                        "is fine: its suffix is read by paged decode)")
    for name, x in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        _arrays.check_same_dtype(name, x, "q", q)
    _arrays.check_axis("prefix_k", prefix_k, 2, "head_dim", int(q.shape[3]), "q.shape[3]")
    _arrays.check_positive("prefix_k", prefix_k, 1, "Hk")
    num_heads, num_kv_heads = int(q.shape[2]), int(prefix_k.shape[1])
    if num_heads % num_kv_heads:
        raise ValueError(f"q.shape[2] (num_heads) = {num_heads} must be a multiple of prefix_k.shape[1] (num_kv_heads) "
                         f"= {num_kv_heads}")
    for axis, axis_name in enumerate(("L", "Hk")):
        _arrays.check_axis("prefix_v", prefix_v, axis, axis_name, int(prefix_k.shape[axis]), f"prefix_k.shape[{axis}]")
    _arrays.check_head_dim("prefix_v.shape[2] (head_dim_v)", int(prefix_v.shape[2]))
    # the prefix's keys are the first tokens of every sequence: its kv heads are the cache's; v's
    # head dim is its own, and the prefix's and the suffix's outputs merge: the cache's v pages set it
    if isinstance(cache, PagedKVCache):
        heads, heads_from = cache.num_kv_heads, "the cache's num_kv_heads"
        head_dim_v, head_dim_v_from = cache.head_dim_v, "the cache's head_dim_v"
    else:
        k_pages, v_pages = _cache_pair(cache)
        _arrays.common_kind({"q": q, "k_pages": k_pages, "v_pages": v_pages})
        _arrays.check_ndim("k_pages", k_pages, "(num_blocks, block_size, Hk, D)")
        _arrays.check_ndim("v_pages", v_pages, "(num_blocks, block_size, Hk, Dv)")
        heads, heads_from = int(k_pages.shape[2]), "k_pages.shape[2]"
        head_dim_v, head_dim_v_from = int(v_pages.shape[-1]), "v_pages.shape[-1]"
    _arrays.check_axis("prefix_k", prefix_k, 1, "Hk", heads, heads_from)
    _arrays.check_axis("prefix_v", prefix_v, 2, "head_dim_v", head_dim_v, head_dim_v_from)
    return prefix_k, prefix_v


def _check_suffix_lengths(seq_lens, q, check: bool):
    """Each sequence's own tokens include its new ones. Read on the host only where that costs no
    sync it would not pay anyway: NumPy lengths (a list becomes one, which this returns), or
    device lengths with ``check``."""
    seq_lens = _arrays.host_int32("seq_lens", seq_lens)
    if _arrays.array_kind(seq_lens, "seq_lens") == "numpy":
        lens = seq_lens
    elif check:
        # the dtype first: a torch dtype NumPy lacks would fail the copy with torch's own message
        _arrays.check_int32("seq_lens", seq_lens)
        lens = _arrays.to_numpy(seq_lens)
    else:
        return seq_lens
    _arrays.check_ndim("seq_lens", lens, "(B)")
    _arrays.check_axis("seq_lens", lens, 0, "batch", int(q.shape[0]), "q.shape[0]")
    _arrays.check_int32("seq_lens", lens)
    sq_new = int(q.shape[1])
    short = np.flatnonzero(lens < sq_new)
    if short.size:
        b = int(short[0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} counts sequence {b}'s own tokens, the new ones included, "
                         f"so it must be at least q.shape[1] (Sq_new) = {sq_new}")
    return seq_lens


# ---------------------------------------------------------------------------------------------
# The plan of repeated calls

# Scratch regions start on this many bytes (the kernels' 16-byte vectors, the TMA's 16-byte
# addresses, with room to spare).
SCRATCH_ALIGN = 256
_ROLES = ("q", "prefix_k", "prefix_v", "k", "v", "table", "lens", "sinks", "k_scale", "v_scale")


def _plan_inputs(q, prefix, cache, sinks, k_scale, v_scale):
    """``((q, prefix_k, prefix_v, k_pages, v_pages, sinks, k_scale array, v_scale array), (k_scale,
    v_scale))`` of a call a plan may run (a (prefix_k, prefix_v) pair and a cache whose pages are
    arrays): the arrays, and the scales the suffix reads (a GPU PagedKVCache's own, or the
    caller's floats or arrays); else None (the full path raises what is wrong)."""
    if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2):
        return None
    if isinstance(cache, PagedKVCache):
        if k_scale is not None or v_scale is not None or cache.device != "cuda":
            return None
        k_pages, v_pages = cache.k_pages, cache.v_pages
        if cache.e4m3:
            k_scale, v_scale = cache.k_scale, cache.v_scale
    elif isinstance(cache, (tuple, list)) and len(cache) == 2:
        k_pages, v_pages = cache
    else:
        return None
    scales = _decode.scale_arrays(k_scale, v_scale)
    arrays = (q, prefix[0], prefix[1], k_pages, v_pages, sinks, scales.get("k_scale"), scales.get("v_scale"))
    return arrays, (k_scale, v_scale)


def _plan_arrays(inputs, block_table, seq_lens) -> tuple:
    """The plan's arrays in _ROLES order: _plan_inputs' with the table and lengths after the pages."""
    return (*inputs[:5], block_table, seq_lens, *inputs[5:])


class _Deferred:
    """launch_decode's step: collects nothing (its launches come back bound to roles) and places
    the split partials at offset 0 of a region whose size it records."""

    nbytes = 0

    def workspace(self, nbytes: int) -> int:
        self.nbytes = nbytes
        return 0

    def add(self, launch) -> None:
        pass


class _Scratch:
    """The plan's regions in one allocation: offsets by name, and CuPy views of a buffer."""

    def __init__(self):
        self.regions = {}
        self.nbytes = 0

    def add(self, name: str, shape, dtype) -> None:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        self.regions[name] = (self.nbytes, tuple(shape), dtype)
        self.nbytes += -(-max(size, 1) // SCRATCH_ALIGN) * SCRATCH_ALIGN

    def role(self, name: str, extra: int = 0) -> str:
        return f"scratch+{self.regions[name][0] + extra}"

    def views(self, buf) -> dict:
        out = {}
        for name, (offset, shape, dtype) in self.regions.items():
            size = int(np.prod(shape)) * dtype.itemsize
            out[name] = buf[offset:offset + size].view(dtype).reshape(shape)
        return out


def _rebind(bound, roles: dict, scratch_offset: int = 0):
    """Bound launches with their roles renamed (``roles``; a role mapped to None is dropped, so
    the field keeps null) and ``workspace+N`` moved to ``scratch+(scratch_offset + N)``."""
    rebound = []
    for b in bound:
        fields = {}
        for field, role in b.fields.items():
            if role.startswith("workspace+"):
                role = f"scratch+{scratch_offset + int(role[len('workspace+'):])}"
            role = roles.get(role, role)
            if role is not None:
                fields[field] = role
        rebound.append(_calls.Bound(b.launch, fields))
    return rebound


def _plan(arrays, scales, block_table, seq_lens, *, causal, scale, softcap, return_lse, max_seq_len, splits):
    """The plan of a call whose checks passed, or None where the call's layout has none (a
    capture running, rows (b, s) of q not one axis, NumPy or JAX arrays, ...): the launches of the
    module docstring, prepared over views of a scratch allocated for this purpose alone (each run
    allocates its own)."""
    q, prefix_k, prefix_v, k_pages, v_pages, sinks = arrays[:6]
    if any(_calls.framework(x) is None for x in (q, prefix_k, prefix_v, k_pages, v_pages, block_table, seq_lens)):
        return None
    import cupy

    with _arrays.array_context(q=q, prefix_k=prefix_k, prefix_v=prefix_v, sinks=sinks) as ctx:
        if ctx.stream.is_capturing():
            return None
        # a GPU PagedKVCache brings CuPy pages and scales whatever q's framework; the rest is q's
        qv, pk, pv, sv, kv, vv, table, lens = (x if isinstance(x, cupy.ndarray) else ctx.view(x) for x in (
            q, prefix_k, prefix_v, sinks, k_pages, v_pages, block_table, seq_lens))
        k_scale, v_scale = (x if isinstance(x, cupy.ndarray) or not _arrays.is_array(x) else ctx.view(x)
                            for x in scales)
        batch, sq_new, num_heads, head_dim = (int(n) for n in qv.shape)
        prefix_len, num_kv_heads, head_dim_v = int(pk.shape[0]), int(pk.shape[1]), int(pv.shape[2])
        group, rows = num_heads // num_kv_heads, batch * sq_new
        packed = rows * group
        if batch == 0 or (batch > 1 and sq_new > 1 and qv.strides[0] != sq_new * qv.strides[1]) or not (
                _decode.rows_contiguous(table) and _decode.rows_contiguous(lens)):
            # the copy reads q's rows (b, s) as one axis; the decode reads table rows and lengths
            # in place, contiguous (the full path copies others each call)
            return None
        splits, per_split = _split_ranges(splits, prefix_len, packed, num_kv_heads, head_dim, head_dim_v,
                                          ctx.device_id)
        state_shape, state_lse_shape = (batch, sq_new, num_heads, head_dim_v), (batch, num_heads, sq_new)
        scratch = _Scratch()
        scratch.add("rows", (splits, rows, group, num_kv_heads, head_dim), qv.dtype)
        scratch.add("parts", (splits * packed, num_kv_heads, head_dim_v), qv.dtype)
        scratch.add("parts_lse", (num_kv_heads, splits * packed), np.float32)
        scratch.add("states", (2, *state_shape), qv.dtype)  # the prefix's state, then the suffix's
        scratch.add("states_lse", (2, *state_lse_shape), np.float32)
        scratch.add("grouped_lse", (rows, num_kv_heads, group), np.float32)
        views = scratch.views(cupy.empty(scratch.nbytes, cupy.uint8))
        state_bytes = int(np.prod(state_shape)) * qv.dtype.itemsize
        lse_bytes = int(np.prod(state_lse_shape)) * 4
        bound = []

        # copy: [S, R, G, Hk, D], query r's head k * G + g as row (r, g) of KV head k, per split
        grouped = qv.reshape(rows, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3)
        copy = prepare_copy(cupy.broadcast_to(grouped, views["rows"].shape), views["rows"])
        bound.append(_calls.Bound(copy, {"src": "q", "dst": scratch.role("rows")}))

        # prefix: split s's rows against keys [s * per_split, (s + 1) * per_split)
        cu_q, cu_k = _split_bounds(ctx, splits, packed, per_split, prefix_len)
        launch = _launch_fwd(views["rows"].reshape(splits * packed, num_kv_heads, head_dim)[None], pk[None], pv[None],
                             views["parts"][None], views["parts_lse"][None], cu_q, cu_k, batch=splits, seqlen_q=packed,
                             seqlen_k=per_split, causal=False, scale=scale, window=(-1, -1), softcap=softcap,
                             stream=ctx.stream, schedule="static", execute=False)
        bound.append(_calls.Bound(launch, {"q": scratch.role("rows"), "k": "prefix_k", "v": "prefix_v",
                                           "out": scratch.role("parts"), "lse": scratch.role("parts_lse")}))

        # merge: the splits' states, read in place ([S, R, G, Hk, Dv], [S, R, Hk, G]) into state 0 seen
        # grouped ([R, G, Hk, Dv]); its lse straight into [B, Hq, 1] for decode rows, else through
        # [R, Hk, G] and a copy ((b, s) is no single axis of [B, Hq, Sq_new])
        parts = views["parts"].reshape(splits, rows, group, num_kv_heads, head_dim_v)
        parts_lse = views["parts_lse"].reshape(num_kv_heads, splits, rows, group).transpose(1, 2, 0, 3)
        grouped_out = views["states"][0].reshape(rows, num_kv_heads, group, head_dim_v).transpose(0, 2, 1, 3)
        lse_region = "states_lse" if sq_new == 1 else "grouped_lse"
        grouped_lse = (views["states_lse"][0].reshape(rows, num_kv_heads, group) if sq_new == 1
                       else views["grouped_lse"])
        merge = merge_stacked(parts, parts_lse, grouped_out, grouped_lse, ctx.stream, execute=False)
        bound.append(_calls.Bound(merge, {"parts": scratch.role("parts"), "part_lse": scratch.role("parts_lse"),
                                          "out": scratch.role("states"), "lse_out": scratch.role(lse_region)}))
        if sq_new > 1:
            lse_copy = prepare_copy(
                views["grouped_lse"].reshape(batch, sq_new, num_kv_heads, group, 1).transpose(0, 2, 3, 1, 4),
                views["states_lse"][0].reshape(batch, num_kv_heads, group, sq_new, 1))
            bound.append(_calls.Bound(lse_copy, {"src": scratch.role("grouped_lse"),
                                                 "dst": scratch.role("states_lse")}))

        # suffix: paged decode into state 1, its split partials after the other regions
        e4m3, ks, vs = _decode.check_cache_scales(qv, kv, vv, k_scale, v_scale, ("k_pages", "v_pages"), False)
        left, right = _masks.check_options((-1, -1), softcap, scale, causal=causal, return_lse=True)
        block_size, num_blocks = int(kv.shape[1]), int(kv.shape[0])
        capacity = int(table.shape[1]) * block_size
        deferred = _Deferred()
        suffix, _ = _decode.launch_decode(
            qv, kv, vv, lens, views["states"][1], views["states_lse"][1], (table, block_size, num_blocks), capacity,
            num_splits=None, causal=causal, scale=scale, window=(left, right), softcap=softcap, stream=ctx.stream,
            split_length=_decode.planned_length(max_seq_len, capacity), step=deferred, sinks=sv, e4m3=e4m3,
            k_scale=ks, v_scale=vs)
        scratch.add("partials", (deferred.nbytes,), np.uint8)
        # the split arrivals (the workspace's head) in a zeroed output of their own: the scratch is
        # not zeroed, and each launch leaves its counters at zero again
        suffix = [_calls.Bound(b.launch, {field: "arrivals" if field == "split_arrivals" else role
                                          for field, role in b.fields.items()}) for b in suffix]
        bound += _rebind(suffix, {"out": scratch.role("states", state_bytes),
                                  "lse": scratch.role("states_lse", lse_bytes), "alibi_slopes": None},
                         scratch.regions["partials"][0])

        # final: the two states merged into out (and lse)
        final = merge_stacked(views["states"], views["states_lse"], views["states"][0],
                              views["states_lse"][0] if return_lse else None, ctx.stream, execute=False)
        bound.append(_calls.Bound(final, {"parts": scratch.role("states"), "part_lse": scratch.role("states_lse"),
                                          "out": "out", **({"lse_out": "lse"} if return_lse else {})}))

    outputs = {"out": (state_shape, False), **({"lse": (state_lse_shape, True)} if return_lse else {}),
               "scratch": ((scratch.nbytes // 4,), True),
               "arrivals": ((_decode.SPLIT_ARRIVAL_SLOTS,), True, True)}

    def finish(results, arrays):
        return (results["out"], results["lse"]) if return_lse else results["out"]

    return _calls.Plan(inputs=_ROLES, outputs=outputs, bound=bound, finish=finish,
                       aligned=("q", "prefix_k", "prefix_v", "k", "v"))
