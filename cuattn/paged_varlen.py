"""paged_attention_varlen: packed queries of any lengths over a paged KV cache, decode rows and
prefill chunks in one call.

Sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` (n of them, 0 allowed) are its
last n tokens; its keys are its first ``seq_lens[b]`` tokens through ``block_table[b]``, and
query i sees key j iff ``j <= seq_lens[b] - n + i`` (causal, bottom-right).

How one call schedules them: every sequence's queries are cut into runs of S = min(16, longest n)
consecutive tokens, and all runs of all sequences go through ONE paged decode launch
(``cuattn.paged_attention``, its batch axis being the runs), each run with its sequence's block
table row and the length its last token sees: run tokens p .. p + S - 1 of n see keys up to
``seq_lens[b] - n + p + S - 1``, which is the decode kernel's causal rule for a row of length
``seq_lens[b] - n + p + S``. A run shorter than S (a decode row, or a sequence's tail) is
completed with query rows whose outputs are dropped: the last run of a sequence ends at its last
token. Decode rows therefore cost what ``paged_attention`` costs, in the same launch as the
prefill chunks, and split-KV spreads long sequences over the GPU. A long prefill run is read
16 tokens at a time: the key/value bytes are streamed once per run, where a prefill tile of 128
queries would stream them once per 128 (BENCHMARKS names this as the next step).

Layouts: q, out ``(total_q, Hq, D)``; lse ``(Hq, total_q)`` float32; cu_seqlens_q int32
``(B + 1,)``, read on the host (device prefix sums are copied: a sync); block_table ``(B,
max_blocks)`` and seq_lens ``(B,)`` int32, as in ``paged_attention``.
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _masks
from .attention import _check_host_cu_seqlens
from .decode import MAX_NEW_TOKENS
from .paged import paged_attention


def paged_attention_varlen(q, cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, *, causal=True, scale=None,
                           window=(-1, -1), softcap=0.0, return_lse=False, max_seq_len=None, check=True, k_scale=None,
                           v_scale=None):
    """Attention of packed query runs of any lengths (decode rows and prefill chunks) over a paged cache.

    Args:
        q: ``(total_q, Hq, D)`` float16 or bfloat16 (any float for NumPy inputs).
        cache: a :class:`PagedKVCache` or a ``(k_pages, v_pages)`` pair, as in :func:`cuattn.paged_attention`
            (e4m3 pages with ``k_scale`` / ``v_scale`` too).
        block_table: int32 ``(B, max_blocks)``; seq_lens: int32 ``(B,)`` keys per sequence.
        cu_seqlens_q: int32 ``(B + 1,)`` prefix sums of the query runs (0 allowed), starting at 0
            and ending at total_q; read on the host.
        max_seqlen_q: an int at least the longest run.
        causal, scale, softcap, return_lse, max_seq_len, check: as in :func:`cuattn.paged_attention`.
        window: ``(left, -1)`` or ``(left, 0)`` with ``causal`` (a left window); the default
            ``(-1, -1)`` sees every earlier key.

    Returns:
        ``out`` ``(total_q, Hq, D)``, or ``(out, lse)`` with lse ``(Hq, total_q)`` float32.
    """
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse, check=check)
    if (not causal and (left >= 0 or right >= 0)) or right > 0:
        raise ValueError(f"window = {tuple(window)}: paged_attention_varlen takes a left window only, with "
                         "causal=True (window[1] -1 or 0)")
    max_seqlen_q = _arrays.check_int("max_seqlen_q", max_seqlen_q, 0)
    _arrays.check_ndim("q", q, "(total_q, Hq, D)")
    table_host, lens_host = (isinstance(x, (list, tuple)) or _arrays.array_kind(x) == "numpy"
                             for x in (block_table, seq_lens))
    block_table = np.asarray(block_table) if table_host else block_table
    seq_lens = np.asarray(seq_lens) if lens_host else seq_lens
    cu = _host_prefix_sums(cu_seqlens_q)
    _arrays.check_ndim("cu_seqlens_q", cu, "(B + 1)")
    _arrays.check_int32("cu_seqlens_q", cu)
    _arrays.check_ndim("block_table", block_table, "(B, max_blocks)")
    _arrays.check_axis("cu_seqlens_q", cu, 0, "B + 1", int(block_table.shape[0]) + 1, "block_table.shape[0] + 1")
    _check_host_cu_seqlens(cu, int(q.shape[0]), max_seqlen_q, "q")
    runs = _Runs.of(cu)
    # q, and the table and lengths when they live on the device, are viewed in one framework
    named = {"q": q, **({} if table_host else {"block_table": block_table}), **({} if lens_host else {"seq_lens": seq_lens})}
    with _arrays.array_context(**named) as ctx:
        qv = ctx.view(q)
        table = block_table if table_host else ctx.view(block_table)
        lens = seq_lens if lens_host else ctx.view(seq_lens)
        xp = np if ctx.on_host else __import__("cupy")
        num_heads, head_dim = int(qv.shape[1]), int(qv.shape[2])
        if runs.count == 0:
            out, lse = xp.zeros((0, num_heads, head_dim), qv.dtype), xp.zeros((num_heads, 0), np.float32)
            out, lse = (ctx.to_caller(out), ctx.to_caller(lse)) if not ctx.on_host else (out, lse)
            return (out, lse) if return_lse else out
        # each run's S query rows [runs, S, Hq, D] (filler positions repeat a real row), its
        # sequence's table row, and the keys its last token sees (seq_lens less the tokens after it)
        run_q = qv[xp.asarray(runs.rows)]
        run_table = _rows_of(table, runs.sequence)
        run_lens = _rows_of(lens, runs.sequence).astype(np.int32)
        if causal:
            run_lens = run_lens - _like(run_lens, runs.tail)
            run_lens = (run_lens * (run_lens > 0)).astype(np.int32)  # a run before the first key sees none
        run_out, run_lse = paged_attention(run_q, cache, run_table, run_lens, max_seq_len=max_seq_len, causal=causal,
                                           scale=scale, window=(left, right), softcap=softcap, return_lse=True,
                                           check=check, k_scale=k_scale, v_scale=v_scale)
        # each query's result among the runs' rows: out [total_q, Hq, D], lse [Hq, total_q]
        keep = xp.asarray(runs.keep)
        out = xp.ascontiguousarray(run_out.reshape(-1, num_heads, head_dim)[keep])
        lse = xp.ascontiguousarray(run_lse.transpose(1, 0, 2).reshape(num_heads, -1)[:, keep])
        if not ctx.on_host:
            out, lse = ctx.to_caller(out), ctx.to_caller(lse)
        return (out, lse) if return_lse else out


def _rows_of(x, index: np.ndarray):
    """x[index] with the index in x's own array module (a host table stays on the host)."""
    return x[index] if isinstance(x, np.ndarray) else x[_like(x, index)]


def _like(x, values: np.ndarray):
    """values in x's array module."""
    return values if isinstance(x, np.ndarray) else __import__("cupy").asarray(values)


def _host_prefix_sums(cu):
    """The prefix sums on the host (a device array is copied: the runs are planned from them)."""
    if isinstance(cu, (list, tuple)):
        return np.asarray(cu, np.int32)
    return cu if _arrays.array_kind(cu) == "numpy" else _arrays.to_numpy(cu)


class _Runs:
    """The runs of S query tokens the call launches, planned on the host from the prefix sums.

    ``rows`` [runs, S]: the packed query row of each run position (filler positions repeat the
    run's first real row); ``sequence`` [runs]: the run's sequence; ``tail`` [runs]: how many of
    the sequence's tokens follow the run's last token (its key count is seq_lens - tail);
    ``keep`` [total_q]: where each query's result sits among the runs' flattened rows."""

    def __init__(self, rows, sequence, tail, keep):
        self.rows, self.sequence, self.tail, self.keep = rows, sequence, tail, keep
        self.count = int(sequence.shape[0])

    @classmethod
    def of(cls, cu: np.ndarray) -> "_Runs":
        lengths = np.diff(cu.astype(np.int64))
        size = int(min(MAX_NEW_TOKENS, max(int(lengths.max(initial=0)), 1)))
        rows, sequence, tail = [], [], []
        keep = np.zeros(int(cu[-1]), np.int64)
        for b, n in enumerate(lengths):
            n = int(n)
            starts = list(range(0, n, size))
            for start in starts:
                # the last run ends at the sequence's last token (it may overlap the one before);
                # a sequence shorter than S is preceded by filler positions
                start = min(start, n - size)
                positions = np.arange(start, start + size)
                index = len(rows)
                rows.append(int(cu[b]) + np.maximum(positions, 0))
                sequence.append(b)
                tail.append(n - (start + size))
                real = positions >= 0
                keep[int(cu[b]) + positions[real]] = index * size + np.flatnonzero(real)
        if not rows:
            return cls(np.zeros((0, size), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), keep)
        return cls(np.stack(rows), np.asarray(sequence, np.int64), np.asarray(tail, np.int32), keep)
