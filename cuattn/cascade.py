"""Cascade attention: a prefix shared by every sequence of a batch, read once per step.

Many samples of one prompt, beam search, or a long system prompt give a batch whose sequences
start with the same L tokens. Decode over a paged cache reads those tokens' keys and values once
per sequence; here the shared prefix is read once for the whole batch, and each sequence's own
tokens (its suffix, in the paged cache) once for that sequence:

    prefix   every query of the batch against the prefix keys, one dense non-causal attention
             (cuattn.attention with the B x Sq_new queries as one sequence): tensor cores, the
             prefix's bytes read once
    suffix   each sequence's queries against its own tokens (cuattn.paged_attention, causal)
    merge    the two partial results by their log-sum-exp (cuattn.merge_states): softmax over
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

from . import _arrays
from .attention import attention
from .decode import merge_states
from .paged import PagedKVCache, _cache_pair, paged_attention


def cascade_attention(q, prefix, cache, block_table, seq_lens, *, causal=True, scale=None, softcap=0.0, sinks=None,
                      return_lse=False, max_seq_len=None, check=True, k_scale=None, v_scale=None):
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

    Returns:
        ``out`` ``(B, Sq_new, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)``.
    """
    prefix_k, prefix_v = _check_prefix(prefix, q, cache)
    _check_suffix_lengths(seq_lens, int(q.shape[1]), check)
    batch, sq_new, num_heads, head_dim = (int(n) for n in q.shape)
    head_dim_v = int(prefix_v.shape[2])
    # every query of the batch as one sequence of B x Sq_new rows over the prefix: no mask
    rows = q.reshape(1, batch * sq_new, num_heads, head_dim)
    out_prefix, lse_prefix = attention(rows, prefix_k.reshape(1, *prefix_k.shape), prefix_v.reshape(1, *prefix_v.shape),
                                       scale=scale, softcap=softcap, sinks=sinks, return_lse=True)
    out_prefix = out_prefix.reshape(batch, sq_new, num_heads, head_dim_v)
    lse_prefix = _heads_after_batch(lse_prefix.reshape(num_heads, batch, sq_new))  # (B, Hq, Sq_new)
    out_own, lse_own = paged_attention(q, cache, block_table, seq_lens, max_seq_len=max_seq_len, causal=causal,
                                       scale=scale, softcap=softcap, return_lse=True, check=check, k_scale=k_scale,
                                       v_scale=v_scale)
    out, lse = merge_states(out_prefix, lse_prefix, out_own, lse_own)
    return (out, lse) if return_lse else out


def _check_prefix(prefix, q, cache):
    if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2):
        raise TypeError(f"prefix must be a (prefix_k, prefix_v) pair, got {type(prefix).__name__}")
    prefix_k, prefix_v = prefix
    for name, x, layout in (("prefix_k", prefix_k, "(L, Hk, D)"), ("prefix_v", prefix_v, "(L, Hk, Dv)")):
        _arrays.check_ndim(name, x, layout)
        _arrays.check_positive(name, x, 0, "L")
    _arrays.check_axis("prefix_k", prefix_k, 2, "head_dim", int(q.shape[3]), "q.shape[3]")
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


def _heads_after_batch(x):
    """(H, B, S) -> (B, H, S) in the array's own framework (torch names it permute)."""
    return x.permute(1, 0, 2) if _arrays.array_kind(x) == "torch" else x.transpose(1, 0, 2)
