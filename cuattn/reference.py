"""Float64 NumPy reference implementations of every cuattn operation.

These functions define what the GPU kernels must compute, and they are also the CPU path
the public API takes for NumPy inputs. Each accepts arrays of any float dtype (float16,
float32, float64, ``ml_dtypes.bfloat16``), computes in float64 and returns float64 arrays;
callers cast. The exceptions are the ``*_lowp`` functions, which emulate a low-precision
computation on purpose (operands rounded to fp16/bf16, float32 arithmetic) for the tests'
error budgets. Arguments are not validated beyond what computing needs: the public layer does
that.

Layouts (B batch, Sq/Sk query/key lengths, Hq/Hk query/kv heads, D head dim of q and k, Dv head
dim of v and out, which may differ from D):

- dense: q ``(B, Sq, Hq, D)``, k ``(B, Sk, Hk, D)``, v ``(B, Sk, Hk, Dv)``, out ``(B, Sq, Hq, Dv)``,
  lse ``(B, Hq, Sq)``. ``Hq % Hk == 0``; query head h reads kv head ``h // (Hq // Hk)``.
- varlen: q ``(total_q, Hq, D)``, k ``(total_k, Hk, D)``, v ``(total_k, Hk, Dv)``, ``cu_seqlens``
  prefix sums ``(batch + 1,)``; out ``(total_q, Hq, Dv)``, lse ``(Hq, total_q)``.
- decode: q ``(B, Sq_new, Hq, D)``, caches ``(B, S_max, Hk, D)``, ``cache_seqlens`` ``(B,)``.
- paged: pages ``(num_blocks, block_size, Hk, D)``, ``block_table`` ``(B, max_blocks)``.

Scores are ``s = scale * q.k`` (scale defaults to ``1/sqrt(D)``, q's head dim), then
``softcap * tanh(s / softcap)`` when ``softcap > 0``. Query i sees key j iff
``j <= i + Sk - Sq`` when causal (bottom-right aligned) and
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` for ``window=(left, right)`` (-1 =
unbounded). lse is the natural-log logsumexp of the visible scores. A row that sees no key
gives out = 0 and lse = -inf, never NaN and never a floating-point warning.

``sinks`` (float, ``(Hq,)``): one extra logit per query head, in score units, that joins every
row's softmax denominator and carries no value (gpt-oss's attention sinks):
``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m))`` and
``lse = log(sum_j exp(s_j) + exp(sinks[h]))``; a row with no visible key then gives out = 0 and
lse = sinks[h]. The backward also returns ``dsinks[h] = -sum_(b,i) exp(sinks[h] - lse) * D_i``
with ``D_i = rowsum(dout * out)``.

``alibi_slopes`` (float, ``(Hq,)`` or ``(B, Hq)`` per sequence): after scaling and softcap, score
(i, j) of head h gains ``-slope[h] * |i + Sk - Sq - j|`` (FlashAttention-2's ALiBi), with Sq and
Sk the sequence's own lengths (varlen: each sequence's; decode: the new queries and the cache
length). Masked keys stay masked; the bias is not differentiated.
"""

import math

import numpy as np

# Largest number of score elements (heads x Sq x Sk) materialised at once; bounds the
# memory of one float64 score chunk (and its few same-sized temporaries) to ~32 MiB each.
_SCORE_CHUNK_ELEMENTS = 1 << 22

# Window bound meaning "unbounded" on that side.
_UNBOUNDED = -1


def visible(sq, sk, causal=False, window=(_UNBOUNDED, _UNBOUNDED)):
    """Bool mask ``(sq, sk)``: True where query i may attend to key j."""
    left, right = window
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    # The diagonal is bottom-right aligned: the last query sits on the last key.
    diag = i + sk - sq
    mask = np.ones((sq, sk), dtype=bool)
    if causal:
        mask &= j <= diag
    if left != _UNBOUNDED:
        mask &= j >= diag - left
    if right != _UNBOUNDED:
        mask &= j <= diag + right
    return mask


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _default_scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _expand_kv(x, num_q_heads):
    """``(B, S, Hk, D)`` -> ``(B, S, Hq, D)`` (any last axis, D or Dv): repeat each kv head over its
    query-head group."""
    return np.repeat(x, num_q_heads // x.shape[2], axis=2)


def _reduce_kv(dx, num_kv_heads):
    """Inverse of ``_expand_kv`` for gradients: sum over the query heads of each group."""
    b, s, hq, d = dx.shape
    return dx.reshape(b, s, num_kv_heads, hq // num_kv_heads, d).sum(axis=3)


def _head_chunks(num_heads, sq, sk):
    """Slices over heads so that one chunk's scores stay within ``_SCORE_CHUNK_ELEMENTS``."""
    per_chunk = max(1, _SCORE_CHUNK_ELEMENTS // max(1, sq * sk))
    return [slice(h, min(h + per_chunk, num_heads)) for h in range(0, num_heads, per_chunk)]


def _heads_first(x):
    """``(S, H, D)`` -> ``(H, S, D)`` so that heads are the matmul batch axis."""
    return x.transpose(1, 0, 2)


def _raw_scores(qh, kh, scale):
    """Scaled scores ``(H, Sq, Sk)`` from ``qh (H, Sq, D)`` and ``kh (H, Sk, D)``."""
    return scale * (qh @ kh.transpose(0, 2, 1))


def _cap(s_raw, softcap):
    return softcap * np.tanh(s_raw / softcap) if softcap > 0 else s_raw


def _masked_scores(qh, kh, mask, scale, softcap):
    """Capped scores with invisible keys set to -inf, so that exp() sends them to 0."""
    return np.where(mask, _cap(_raw_scores(qh, kh, scale), softcap), -np.inf)


def _finite_or_zero(m):
    """A running max that is -inf (row saw no key) is replaced by 0 so that s - m stays -inf."""
    return np.where(np.isfinite(m), m, 0.0)


def _finalize(acc, m, l):
    """Normalise the accumulator and form lse; rows with l == 0 give out 0 and lse -inf. A NaN
    (a NaN score or sink) stays NaN in out and lse, as the kernels give it, rather than reading
    as a row without keys."""
    nonempty = ~(l == 0)
    l_safe = np.where(nonempty, l, 1.0)
    out = acc / l_safe
    lse = np.where(nonempty, _finite_or_zero(m) + np.log(l_safe), -np.inf)
    return out, lse[..., 0]


def _softmax_attend(s, vh, sink=None):
    """One-shot softmax over masked scores ``s (H, Sq, Sk)`` applied to ``vh (H, Sk, Dv)``;
    ``sink`` ``(H,)`` adds one value-less logit per head to every row's denominator."""
    # The row max (-inf for empty rows, also when Sk == 0) keeps exp() from overflowing.
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, sink[:, None, None])
    p = np.exp(s - _finite_or_zero(m))
    l = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink[:, None, None] - _finite_or_zero(m))
    return _finalize(p @ vh, m, l)


def _sinks(sinks):
    return None if sinks is None else np.asarray(sinks, dtype=np.float64).reshape(-1)


def _alibi(alibi_slopes, batch):
    """Slopes as float64 ``(batch, Hq)`` (a ``(Hq,)`` array serves every sequence), or None."""
    if alibi_slopes is None:
        return None
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    return np.broadcast_to(slopes, (batch, slopes.shape[-1]))


def _alibi_bias(slopes, sq, sk):
    """``(H, Sq, Sk)`` bias ``-slope[h] * |i + Sk - Sq - j|`` for slopes ``(H,)``."""
    distance = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
    return -slopes[:, None, None] * distance


def _with_alibi(s, slopes, mask):
    """Add ALiBi's bias to scores ``s (H, Sq, Sk)`` (masked keys stay -inf); slopes None: s."""
    if slopes is None:
        return s
    return np.where(mask, s + _alibi_bias(slopes, *s.shape[1:]).astype(s.dtype), -np.inf)


def _options(q, scale, window):
    return _default_scale(scale, q.shape[-1]), tuple(int(w) for w in window)


def out_shape(q, v) -> tuple:
    """The output of q over v: q's shape with v's head dim Dv last (every path's out, NumPy or not)."""
    return (*q.shape[:-1], v.shape[-1])


def attention(q, k, v, *, causal=False, scale=None, window=(_UNBOUNDED, _UNBOUNDED),
              softcap=0.0, return_lse=False, sinks=None, alibi_slopes=None):
    """Dense attention. Returns out ``(B, Sq, Hq, Dv)`` and, with return_lse, lse ``(B, Hq, Sq)``."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    sinks = _sinks(sinks)
    alibi = _alibi(alibi_slopes, q.shape[0])
    scale, window = _options(q, scale, window)
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    mask = visible(sq, sk, causal, window)
    k, v = _expand_kv(k, hq), _expand_kv(v, hq)
    out = np.empty(out_shape(q, v), dtype=np.float64)
    lse = np.empty((b, hq, sq), dtype=np.float64)
    # Looping over batch and head chunks bounds the memory of the score matrices.
    for bi in range(b):
        for hs in _head_chunks(hq, sq, sk):
            qh, kh, vh = (_heads_first(x[bi, :, hs]) for x in (q, k, v))
            s = _with_alibi(_masked_scores(qh, kh, mask, scale, softcap), None if alibi is None else alibi[bi, hs],
                            mask)
            o, lse[bi, hs] = _softmax_attend(s, vh, None if sinks is None else sinks[hs])
            out[bi, :, hs] = _heads_first(o)
    return (out, lse) if return_lse else out


def dequantize_fp8(x, scale, block_rows):
    """Real float64 values of an e4m3 q, k or v ``(B, S, H, D)``: stored x scale, with ``scale`` a
    float, an array ``()``, ``(1,)`` or ``(H,)`` (per head), or ``(B, H, ceil(S / block_rows))``
    (one scale per block of ``block_rows`` rows of each sequence and head). Any array dtype;
    uint8 arrays are read as e4m3 bytes."""
    import ml_dtypes

    x = np.asarray(x)
    if x.dtype == np.uint8:
        x = x.view(ml_dtypes.float8_e4m3fn)
    b, s, h, _ = x.shape
    scale = np.asarray(scale, np.float64)
    if scale.ndim == 3:
        rows = np.arange(s) // block_rows
        per_row = scale[:, :, rows].transpose(0, 2, 1)  # (B, S, H)
    else:
        # one value for every head, or one per head
        per_row = np.broadcast_to(scale.reshape(-1), (b, s, h))
    return x.astype(np.float64) * per_row[..., None]


def attention_tiled(q, k, v, *, block_k=64, causal=False, scale=None,
                    window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, return_lse=False):
    """``attention`` computed by the online-softmax recurrence over key blocks of ``block_k``.

    This is the algorithm the flash kernels run; it must match ``attention`` to rounding.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    scale, window = _options(q, scale, window)
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    mask = visible(sq, sk, causal, window)
    k, v = _expand_kv(k, hq), _expand_kv(v, hq)
    out = np.empty(out_shape(q, v), dtype=np.float64)
    lse = np.empty((b, hq, sq), dtype=np.float64)
    for bi in range(b):
        qh, kh, vh = (_heads_first(x[bi]) for x in (q, k, v))
        # State per query row: running max m, running denominator l, unnormalised output acc.
        m = np.full((hq, sq, 1), -np.inf)
        l = np.zeros((hq, sq, 1))
        acc = np.zeros((hq, sq, dv))
        for start in range(0, sk, block_k):
            blk = slice(start, min(start + block_k, sk))
            s_blk = _masked_scores(qh, kh[:, blk], mask[:, blk], scale, softcap)
            # The new max covers every visible key seen so far, this block included.
            m_new = np.maximum(m, s_blk.max(axis=-1, keepdims=True, initial=-np.inf))
            m_new_safe = _finite_or_zero(m_new)
            # Old terms were exponentiated against m; rescale them to m_new. A row that has
            # still seen no visible key has m = m_new = -inf: its factor is 0, acc and l stay 0.
            alpha = np.where(np.isfinite(m_new), np.exp(m - m_new_safe), 0.0)
            # This block's probabilities relative to m_new; masked keys are -inf and give 0.
            p = np.exp(s_blk - m_new_safe)
            acc = acc * alpha + p @ vh[:, blk]
            l = l * alpha + p.sum(axis=-1, keepdims=True)
            m = m_new
        # Normalise once at the end: out = acc / l, lse = m + log(l); empty rows 0 / -inf.
        o, lse[bi] = _finalize(acc, m, l)
        out[bi] = _heads_first(o)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                       window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, sinks=None, alibi_slopes=None):
    """Gradients ``(dq, dk, dv)`` of dense attention, shaped like q, k, v (float64); with
    ``sinks`` also ``dsinks`` ``(Hq,)``. ``lse`` is the forward's (sinks included)."""
    dout, q, k, v, out, lse = (_f64(x) for x in (dout, q, k, v, out, lse))
    sinks = _sinks(sinks)
    alibi = _alibi(alibi_slopes, q.shape[0])
    dsinks = None if sinks is None else np.zeros(sinks.shape, np.float64)
    scale, window = _options(q, scale, window)
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    mask = visible(sq, sk, causal, window)
    k, v = _expand_kv(k, hq), _expand_kv(v, hq)
    dq = np.empty(q.shape, dtype=np.float64)
    dk = np.empty(k.shape, dtype=np.float64)
    dv = np.empty(v.shape, dtype=np.float64)
    for bi in range(b):
        for hs in _head_chunks(hq, sq, sk):
            qh, kh, vh, oh, doh = (_heads_first(x[bi, :, hs]) for x in (q, k, v, out, dout))
            lse_h = lse[bi, hs][..., None]
            s_raw = _raw_scores(qh, kh, scale)
            s = _with_alibi(np.where(mask, _cap(s_raw, softcap), -np.inf), None if alibi is None else alibi[bi, hs],
                            mask)
            # Recompute the probabilities from the saved lse; rows with lse -inf saw no key.
            p = np.where(np.isfinite(lse_h), np.exp(s - _finite_or_zero(lse_h)), 0.0)
            dv[bi, :, hs] = _heads_first(p.transpose(0, 2, 1) @ doh)
            dp = doh @ vh.transpose(0, 2, 1)
            # D_i = rowsum(dout * out) equals sum_j p_ij dp_ij: the softmax Jacobian's offset.
            di = np.sum(doh * oh, axis=-1, keepdims=True)
            if sinks is not None:
                # the sink's probability exp(sink - lse) times its dP (0: it carries no value) - D_i
                p_sink = np.where(np.isfinite(lse_h), np.exp(sinks[hs][:, None, None] - _finite_or_zero(lse_h)), 0.0)
                dsinks[hs] -= (p_sink * di).sum(axis=(1, 2))
            ds = p * (dp - di)
            if softcap > 0:
                # Chain rule through softcap * tanh(s_raw / softcap) (ALiBi's additive bias has no share).
                ds = ds * (1.0 - np.tanh(s_raw / softcap) ** 2)
            dq[bi, :, hs] = _heads_first(scale * (ds @ kh))
            dk[bi, :, hs] = _heads_first(scale * (ds.transpose(0, 2, 1) @ qh))
    grads = (dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk))
    return grads if sinks is None else (*grads, dsinks)


def _segments(cu_seqlens):
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return [slice(int(cu[i]), int(cu[i + 1])) for i in range(cu.shape[0] - 1)]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, scale=None, window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0,
                     return_lse=False, sinks=None, alibi_slopes=None):
    """Packed variable-length attention: sequence b attends only within its own slices.

    Returns out ``(total_q, Hq, Dv)`` and, with return_lse, lse ``(Hq, total_q)``.
    ``max_seqlen_q`` / ``max_seqlen_k`` are accepted for API parity and not needed here.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    out = np.empty(out_shape(q, v), dtype=np.float64)
    lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float64)
    segments = list(zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)))
    alibi = _alibi(alibi_slopes, len(segments))
    # Each sequence is an independent dense problem of batch 1 with its own lengths.
    for bi, (qs, ks) in enumerate(segments):
        o, l = attention(q[None, qs], k[None, ks], v[None, ks], causal=causal, scale=scale,
                         window=window, softcap=softcap, return_lse=True, sinks=sinks,
                         alibi_slopes=None if alibi is None else alibi[bi])
        out[qs], lse[:, qs] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                              window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, sinks=None, alibi_slopes=None):
    """Gradients ``(dq, dk, dv)`` of ``attention_varlen``, shaped like q, k, v (float64); with
    ``sinks`` also ``dsinks`` ``(Hq,)``."""
    dout, q, k, v, out, lse = (_f64(x) for x in (dout, q, k, v, out, lse))
    dsinks = None if sinks is None else np.zeros(_sinks(sinks).shape, np.float64)
    dq = np.zeros(q.shape, dtype=np.float64)
    dk = np.zeros(k.shape, dtype=np.float64)
    dv = np.zeros(v.shape, dtype=np.float64)
    # Keys outside every segment get no gradient, hence the zero initialisation.
    segments = list(zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k)))
    alibi = _alibi(alibi_slopes, len(segments))
    for bi, (qs, ks) in enumerate(segments):
        g = attention_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                               out[None, qs], lse[None, :, qs], causal=causal, scale=scale,
                               window=window, softcap=softcap, sinks=sinks,
                               alibi_slopes=None if alibi is None else alibi[bi])
        dq[qs], dk[ks], dv[ks] = (x[0] for x in g[:3])
        if sinks is not None:
            dsinks += g[3]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


def _one_sequence(q, k, v, *, causal, scale, window, softcap, sinks=None, alibi_slopes=None):
    """Dense attention of one sequence, the decode-family references' building block: q ``(Sq, Hq,
    D)`` over k ``(Sk, Hk, D)`` and v ``(Sk, Hk, Dv)``, where v's head dim Dv may differ from D
    (the default scale stays ``1/sqrt(D)``). ``alibi_slopes``: ``(Hq,)`` or None. Returns out
    ``(Sq, Hq, Dv)`` and lse ``(Hq, Sq)``."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    sinks = _sinks(sinks)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64).reshape(-1)
    scale, window = _options(q, scale, window)
    sq, hq, _ = q.shape
    sk = k.shape[0]
    mask = visible(sq, sk, causal, window)
    k, v = _expand_kv(k[None], hq)[0], _expand_kv(v[None], hq)[0]
    out = np.empty((sq, hq, v.shape[-1]), dtype=np.float64)
    lse = np.empty((hq, sq), dtype=np.float64)
    for hs in _head_chunks(hq, sq, sk):
        qh, kh, vh = (_heads_first(x[:, hs]) for x in (q, k, v))
        s = _with_alibi(_masked_scores(qh, kh, mask, scale, softcap), None if slopes is None else slopes[hs], mask)
        o, lse[hs] = _softmax_attend(s, vh, None if sinks is None else sinks[hs])
        out[:, hs] = _heads_first(o)
    return out, lse


def decode(q, k_cache, v_cache, cache_seqlens, *, causal=True, scale=None,
           window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, return_lse=False, sinks=None, alibi_slopes=None):
    """Attention of new tokens over a KV cache of per-row length ``cache_seqlens[b]``.

    Row b sees keys ``[0, cache_seqlens[b])`` with Sk = cache_seqlens[b] in the mask rules.
    ``v_cache`` ``(B, S_max, Hk, Dv)`` may have its own head dim Dv. Returns out ``(B, Sq_new,
    Hq, Dv)`` and, with return_lse, lse ``(B, Hq, Sq_new)``.
    """
    q = _f64(q)
    lengths = np.asarray(cache_seqlens, dtype=np.int64)
    out = np.empty(q.shape[:-1] + v_cache.shape[-1:], dtype=np.float64)
    lse = np.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=np.float64)
    alibi = _alibi(alibi_slopes, q.shape[0])
    # Slicing the cache to each row's length keeps stale slots beyond it out of the result.
    for bi in range(q.shape[0]):
        n = int(lengths[bi])
        out[bi], lse[bi] = _one_sequence(q[bi], k_cache[bi, :n], v_cache[bi, :n], causal=causal, scale=scale,
                                         window=window, softcap=softcap, sinks=sinks,
                                         alibi_slopes=None if alibi is None else alibi[bi])
    return (out, lse) if return_lse else out


def merge_states(*args):
    """Exact merge of attention states computed over disjoint key sets.

    Call as ``merge_states(out_a, lse_a, out_b, lse_b)`` or ``merge_states(states)`` with
    ``states`` a sequence of ``(out, lse)`` pairs. out is ``(..., S, H, D)`` (D: the outputs' own
    head dim, v's) and lse is out's
    shape without D with its last two axes swapped, ``(..., H, S)``: ``(B, S, H, D)`` with
    ``(B, H, S)``, or ``(T, H, D)`` with ``(H, T)``. Returns ``(out, lse)`` in the same layouts.
    """
    if len(args) == 1:
        states = list(args[0])
    elif len(args) == 4:
        states = [(args[0], args[1]), (args[2], args[3])]
    else:
        raise TypeError("merge_states takes (out_a, lse_a, out_b, lse_b) or one list of "
                        f"(out, lse) pairs, got {len(args)} positional arguments")
    outs = np.stack([_f64(o) for o, _ in states])
    # Bring lse to out's (..., S, H) layout with a trailing axis that broadcasts over D.
    lses = np.stack([np.swapaxes(_f64(l), -1, -2)[..., None] for _, l in states])
    # logsumexp over the parts, shifted by the largest lse; all -inf means no part saw a key.
    m = _finite_or_zero(lses.max(axis=0))
    total = np.exp(lses - m).sum(axis=0)
    # a NaN (or +inf) lse is not an empty part: it stays NaN (or non-finite) in the merge
    nonempty = ~(total == 0)
    lse = np.where(nonempty, m + np.log(np.where(nonempty, total, 1.0)), -np.inf)
    # Each part's weight is its share of the merged denominator; empty parts (lse -inf) weigh 0.
    weights = np.where(lses == -np.inf, 0.0, np.exp(lses - _finite_or_zero(lse)))
    out = (weights * np.where(weights > 0, outs, 0.0)).sum(axis=0)
    return out, np.swapaxes(lse[..., 0], -1, -2)


def gather_pages(pages, block_table, seq_lens):
    """Contiguous cache ``(B, max(seq_lens) or 1, Hk, D)`` from paged storage ``(num_blocks,
    block_size, Hk, D)`` (D: the pages' own head dim, k's or v's); zero past seq_lens."""
    pages = _f64(pages)
    block_table = np.asarray(block_table, dtype=np.int64)
    lengths = np.asarray(seq_lens, dtype=np.int64)
    block_size = pages.shape[1]
    max_len = max(1, int(lengths.max(initial=0)))
    cache = np.zeros((lengths.shape[0], max_len) + pages.shape[2:], dtype=np.float64)
    for bi in range(lengths.shape[0]):
        t = np.arange(int(lengths[bi]))
        # Token t lives in logical block t // block_size at offset t % block_size.
        cache[bi, :t.shape[0]] = pages[block_table[bi, t // block_size], t % block_size]
    return cache


def paged_attention_varlen(q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens, *, causal=True, scale=None,
                           window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, return_lse=False, sinks=None,
                           alibi_slopes=None):
    """Packed queries over a paged cache: sequence b's queries ``q[cu[b]:cu[b+1]]`` are its last
    n tokens, and query i sees key j < seq_lens[b] iff ``j <= seq_lens[b] - n + i`` (causal).
    ``v_pages`` ``(num_blocks, block_size, Hk, Dv)`` may have its own head dim Dv; ``sinks``
    ``(Hq,)`` join every row's denominator; ``alibi_slopes`` ``(Hq,)`` or ``(B, Hq)`` add
    ``-slope * |i + seq_lens[b] - n - j|``. Returns out ``(total_q, Hq, Dv)`` and, with
    return_lse, lse ``(Hq, total_q)``."""
    q = _f64(q)
    out = np.zeros(q.shape[:-1] + v_pages.shape[-1:], dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    k_cache = gather_pages(k_pages, block_table, seq_lens)
    v_cache = gather_pages(v_pages, block_table, seq_lens)
    alibi = _alibi(alibi_slopes, len(seq_lens))
    for bi, qs in enumerate(_segments(cu_seqlens_q)):
        if qs.stop == qs.start:
            continue
        n_keys = int(seq_lens[bi])
        # A sequence is a dense problem of its n queries over its keys, causal bottom-right.
        out[qs], lse[:, qs] = _one_sequence(q[qs], k_cache[bi, :n_keys], v_cache[bi, :n_keys], causal=causal,
                                            scale=scale, window=window, softcap=softcap, sinks=sinks,
                                            alibi_slopes=None if alibi is None else alibi[bi])
    return (out, lse) if return_lse else out


def paged_attention(q, k_pages, v_pages, block_table, seq_lens, *, causal=True, scale=None,
                    window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, return_lse=False, sinks=None, alibi_slopes=None):
    """``decode`` over a paged KV cache: gather each row's pages, then attend (out ``(B, Sq_new,
    Hq, Dv)``, Dv the v pages' head dim)."""
    k_cache = gather_pages(k_pages, block_table, seq_lens)
    v_cache = gather_pages(v_pages, block_table, seq_lens)
    return decode(q, k_cache, v_cache, seq_lens, causal=causal, scale=scale, window=window,
                  softcap=softcap, return_lse=return_lse, sinks=sinks, alibi_slopes=alibi_slopes)


def naive_attention_lowp(q, k, v, *, causal=False, scale=None,
                         window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, dtype, sinks=None, alibi_slopes=None):
    """The straightforward same-precision computation that sets the tests' error budget.

    Emulates matmul -> softmax -> matmul in ``dtype`` (float16 or bfloat16): every matmul
    runs in float32 on ``dtype``-rounded operands and its result, the capped scores and the
    probabilities are each rounded to ``dtype``. Returns float64 out ``(B, Sq, Hq, Dv)``.
    """
    rounded = _rounding_to(dtype)
    q, k, v = rounded(q), rounded(k), rounded(v)
    scale, window = _options(q, scale, window)
    scale = np.float32(scale)
    b, sq, hq, _ = q.shape
    sk = k.shape[1]
    mask = visible(sq, sk, causal, window)
    alibi = _alibi(alibi_slopes, b)
    k, v = _expand_kv(k, hq), _expand_kv(v, hq)
    out = np.empty(out_shape(q, v), dtype=np.float64)
    for bi in range(b):
        qh, kh, vh = (_heads_first(x[bi]) for x in (q, k, v))
        _, p = _naive_probabilities_lowp(qh, kh, mask, None if alibi is None else alibi[bi], scale, softcap, sinks,
                                         rounded)
        out[bi] = _heads_first(rounded(p @ vh).astype(np.float64))
    return out


def _rounding_to(dtype):
    """x -> x rounded to ``dtype`` (float16 or bfloat16, or its name) and held in float32."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        # NumPy knows bfloat16 only through ml_dtypes; only the naive low-precision paths need it.
        import ml_dtypes

        dtype = ml_dtypes.bfloat16

    def rounded(x):
        return np.asarray(x).astype(dtype).astype(np.float32)

    return rounded


def _naive_probabilities_lowp(qh, kh, mask, alibi, scale, softcap, sinks, rounded):
    """The naive same-precision forward of one sequence, heads first (qh [H, Sq, D], kh [H, Sk,
    D]): its rounded scores before the softcap, and its probabilities, the softmax in float32 (as
    framework kernels do internally) rounded to the dtype."""
    s_raw = rounded(scale * (qh @ kh.transpose(0, 2, 1)))
    s = rounded(np.float32(softcap) * np.tanh(s_raw / np.float32(softcap))) if softcap > 0 else s_raw
    s = _with_alibi(np.where(mask, s, -np.inf), alibi, mask).astype(np.float32)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = None if sinks is None else np.asarray(sinks, np.float32).reshape(-1)[:, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.exp(s - _finite_or_zero(m).astype(np.float32))
    denom = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - _finite_or_zero(m).astype(np.float32))
    return s_raw, rounded(e / np.where(denom > 0, denom, np.float32(1.0)))


def naive_attention_backward_lowp(dout, q, k, v, *, causal=False, scale=None,
                                  window=(_UNBOUNDED, _UNBOUNDED), softcap=0.0, dtype, sinks=None,
                                  alibi_slopes=None):
    """The straightforward same-precision backward that sets the gradient tests' error budget.

    Emulates the textbook backward in ``dtype``: the forward's scores and probabilities and the
    backward's dV, dP, dS, dQ and dK each computed in float32 from ``dtype``-rounded operands
    and rounded to ``dtype``. Returns float64 ``(dq, dk, dv)`` shaped like q, k, v.
    """
    rounded = _rounding_to(dtype)
    dout, q, k, v = (rounded(x) for x in (dout, q, k, v))
    scale, window = _options(q, scale, window)
    scale = np.float32(scale)
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    mask = visible(sq, sk, causal, window)
    alibi = _alibi(alibi_slopes, b)
    ke, ve = _expand_kv(k, hq), _expand_kv(v, hq)
    dq = np.empty(q.shape, np.float64)
    dk = np.empty(ke.shape, np.float64)
    dv = np.empty(ve.shape, np.float64)
    for bi in range(b):
        qh, kh, vh, doh = (_heads_first(x[bi]) for x in (q, ke, ve, dout))
        s_raw, p = _naive_probabilities_lowp(qh, kh, mask, None if alibi is None else alibi[bi], scale, softcap,
                                             sinks, rounded)
        oh = rounded(p @ vh)
        dv[bi] = _heads_first(rounded(p.transpose(0, 2, 1) @ doh))
        dp = rounded(doh @ vh.transpose(0, 2, 1))
        di = np.sum(doh * oh, axis=-1, keepdims=True)
        ds = p * (dp - di)
        if softcap > 0:
            ds = ds * (1.0 - np.tanh(s_raw / np.float32(softcap)) ** 2)
        ds = rounded(ds)
        dq[bi] = _heads_first(rounded(scale * (ds @ kh)))
        dk[bi] = _heads_first(rounded(scale * (ds.transpose(0, 2, 1) @ qh)))
    return dq, _reduce_kv(dk, hk), _reduce_kv(dv, hk)
