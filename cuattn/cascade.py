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
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _jit
from .attention import FWD_SM90_TILES, SM90, attention_varlen, fwd_sm90_tile_dims, fwd_tile
from .decode import max_merge_parts, merge_stacked, merge_states
from .paged import PagedKVCache, _cache_pair, paged_attention

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
        prefix_splits: how many key ranges the prefix is split into (1 to L), each attended by a
            copy of the queries and merged; default: on the GPU enough to give every SM a tile
            (each range at least MIN_SPLIT_KEYS keys), on the CPU 1.

    Returns:
        ``out`` ``(B, Sq_new, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)``.
    """
    prefix_k, prefix_v = _check_prefix(prefix, q, cache)
    _check_suffix_lengths(seq_lens, int(q.shape[1]), check)
    batch, sq_new, num_heads, head_dim = (int(n) for n in q.shape)
    out_prefix, lse_prefix = _prefix_states(q, prefix_k, prefix_v, prefix_splits, scale, softcap)
    out_own, lse_own = paged_attention(q, cache, block_table, seq_lens, max_seq_len=max_seq_len, causal=causal,
                                       scale=scale, softcap=softcap, sinks=sinks, return_lse=True, check=check,
                                       k_scale=k_scale, v_scale=v_scale)
    out, lse = merge_states(out_prefix, lse_prefix, out_own, lse_own)
    return (out, lse) if return_lse else out


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
        splits = _check_splits(splits, prefix_len) if splits is not None else (
            1 if ctx.on_host else default_prefix_splits(packed, num_kv_heads, prefix_len, ctx.device_id,
                                                        _tile_rows(head_dim, head_dim_v)))
        # split s takes keys [s * per_split, (s + 1) * per_split), the last one up to L; no split is
        # empty (L = 5 asked for 4 splits takes 3 of 2, 2 and 1 keys)
        per_split = -(-prefix_len // splits)
        splits = -(-prefix_len // per_split)
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
    if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or not 1 <= splits <= limit:
        raise ValueError(f"prefix_splits must be an int from 1 to {limit} (the prefix length L = {prefix_len}, and "
                         f"at most {max_merge_parts()} parts a merge), got {splits!r}")
    return int(splits)


def _check_prefix(prefix, q, cache):
    if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2):
        raise TypeError(f"prefix must be a (prefix_k, prefix_v) pair, got {type(prefix).__name__}")
    prefix_k, prefix_v = prefix
    for name, x, layout in (("prefix_k", prefix_k, "(L, Hk, D)"), ("prefix_v", prefix_v, "(L, Hk, Dv)")):
        _arrays.check_ndim(name, x, layout)
        _arrays.check_positive(name, x, 0, "L")
    _arrays.check_axis("prefix_k", prefix_k, 2, "head_dim", int(q.shape[3]), "q.shape[3]")
    num_heads, num_kv_heads = int(q.shape[2]), int(prefix_k.shape[1])
    if num_heads % num_kv_heads:
        raise ValueError(f"q.shape[2] (num_heads) = {num_heads} must be a multiple of prefix_k.shape[1] (num_kv_heads) "
                         f"= {num_kv_heads}")
    for axis, axis_name in enumerate(("L", "Hk")):
        _arrays.check_axis("prefix_v", prefix_v, axis, axis_name, int(prefix_k.shape[axis]), f"prefix_k.shape[{axis}]")
    # v's head dim is its own, and the prefix's and the suffix's outputs merge: the cache's v pages set it
    if isinstance(cache, PagedKVCache):
        head_dim_v, source = cache.head_dim_v, "the cache's head_dim_v"
    else:
        v_pages = _cache_pair(cache)[1]
        head_dim_v, source = int(v_pages.shape[-1]), "v_pages.shape[-1]"
    _arrays.check_axis("prefix_v", prefix_v, 2, "head_dim_v", head_dim_v, source)
    return prefix_k, prefix_v


def _check_suffix_lengths(seq_lens, sq_new: int, check: bool) -> None:
    """Each sequence's own tokens include its new ones. Read on the host only where that costs no
    sync it would not pay anyway: NumPy lengths, or device lengths with ``check``."""
    if isinstance(seq_lens, (list, tuple)) or _arrays.array_kind(seq_lens) == "numpy":
        lens = np.asarray(seq_lens)
    elif check:
        lens = _arrays.to_numpy(seq_lens)
    else:
        return
    short = np.flatnonzero(lens < sq_new)
    if short.size:
        b = int(short[0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} counts sequence {b}'s own tokens, the new ones included, "
                         f"so it must be at least q.shape[1] (Sq_new) = {sq_new}")
