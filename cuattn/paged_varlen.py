"""paged_attention_varlen: packed queries of any lengths over a paged KV cache, decode rows and
prefill chunks in one call.

Sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` (n of them, 0 allowed) are its
last n tokens; its keys are its first ``seq_lens[b]`` tokens through ``block_table[b]``, and
query i sees key j iff ``j <= seq_lens[b] - n + i`` (causal, bottom-right).

How one call schedules them (on the GPU, fp16/bf16 pages):

* Sequences with at most ``PREFILL_MIN_QUERIES - 1`` = 16 queries (decode rows, speculative
  tokens, short chunks) go through ONE paged decode launch (``cuattn.paged_attention``, split-KV):
  each such sequence is one run of S = min(16, longest such n) query rows, with its block table
  row and the key count its last token sees (a shorter sequence is completed with filler rows
  whose outputs are dropped). 16 is the decode kernel's most query rows per launch entry
  (``decode.MAX_NEW_TOKENS``): up to it a sequence is one run, so its keys are read once, and
  split-KV spreads long contexts over the SMs even when the batch is small. When those sequences
  are one token each and in a row (a serving step's decode rows), the decode launch reads views
  of q, the table and the lengths and writes its rows of out and lse in place: no gathers,
  scatters or copies, whose host time a mixed step's kernels used to wait for.
* Sequences with more queries go through ONE launch of the tensor-core forward over the paged
  cache: on sm_90a the Hopper forward (``flash_fwd_sm90_kernel``) at every block size, its
  producer loading each key block page by page through the TMA where the block size makes whole
  boxes (``attention.paged_box_rows``), else copying the block's rows from their pages
  (``attention.paged_keys_by_copy``); elsewhere ``flash_fwd_kernel``'s PAGED variant. Tiles of
  64-128 queries, so the keys are read once per tile rather than once per 16 queries, and each
  tile's GEMMs are full. The launch covers only these sequences: its
  entries index them in the batch (``batch_index``, built on the host), q is read in place
  through the full ``cu_seqlens_q``, and the kernel writes its rows of ``out`` and ``lse`` in
  place. On the Hopper forward's dynamic schedule, a launch whose tiles outnumber the SMs takes
  them from a tile order as ``attention_varlen``'s does (only tiles that hold rows, the sequences
  by decreasing ``seq_lens``; ``attention.FWD_SM90_TILE_ORDER``).

Both launches run on the caller's stream and write disjoint rows of the one output (runs' decode
rows are scattered there from the decode launch's run rows). Sinks and ALiBi take both paths: the paged
forward reads sequence index[e]'s row of ``(B, Hq)`` slopes, each run its sequence's (a gather);
with ``causal`` a run's key count, seq_lens less the tokens after it, places its rows' ALiBi
diagonal where its sequence has them (without ``causal`` it would not: refused). With 17 to
~BLOCK_M queries a forward tile is partly empty, but every alternative reads the keys more often:
the decode kernel would need two or more runs. FP8 (e4m3) pages take the Hopper forward as well
where it holds D and Dv and no ALiBi is asked for (``attention.paged_e4m3_prefill``): its
producer copies their rows and widens the bytes to fp16 in registers on the way into the tiles
(the KV_E4M3 variant, whose GEMMs run in fp16 under a bf16 q too), the descales folding into the
score scale and the output; elsewhere they take the decode path for every sequence (runs of 16
tokens, keys read once per run). Value pages may have a head dim Dv of their own on both paths.
NumPy inputs run every sequence through the runs on the CPU, each run an exact float64 reference
problem. The whole split is planned on the host in NumPy, and every planned index reaches the
device in one copy (``ArrayContext.ints``).
A call whose sequences with queries all take the paged forward or the in-place decode launch of
one-token rows (prefill, mixed and decode steps of a serving loop) leaves a plan (``_calls``)
keyed by its signatures, options and the values of its prefix sums: a later such call only checks
and copies a NumPy table and lengths (device ones are read in place) and launches
(``_VarlenPlan``). On a lent H100 the full path's planning and launch preparation cost 550-950 us
of host time a call, a prefill plan 27-98 us.

Layouts: q ``(total_q, Hq, D)``, out ``(total_q, Hq, Dv)`` (Dv the value pages' head dim, D by
default); lse ``(Hq, total_q)`` float32; cu_seqlens_q int32 ``(B + 1,)``, read on the host
(device prefix sums are copied: a sync); block_table ``(B, max_blocks)`` and seq_lens ``(B,)``
int32, as in ``paged_attention``.
"""

from __future__ import annotations

import numpy as np

from . import _arrays, _calls, _masks
from .attention import (PagedKeys, _check_alibi, _check_host_cu_seqlens, _check_out, _launch_fwd, _plan_fwd,
                        paged_e4m3_prefill)
from .decode import MAX_NEW_TOKENS, check_cache_scales, launch_decode, planned_length, scale_options, workspace_address
from .paged import (MAX_BLOCK_SIZE, PagedKVCache, _cache_pair, _check_no_pair_scales, check_device_pages, check_table,
                    clamp_table, paged_attention)

# The fewest queries a sequence sends through the paged forward; fewer go through paged decode.
PREFILL_MIN_QUERIES = MAX_NEW_TOKENS + 1


def paged_attention_varlen(q, cache, block_table, cu_seqlens_q, seq_lens, max_seqlen_q, *, causal=True, scale=None,
                           window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False,
                           max_seq_len=None, check=True, k_scale=None, v_scale=None, out=None):
    """Attention of packed query runs of any lengths (decode rows and prefill chunks) over a paged cache.

    Args:
        q: ``(total_q, Hq, D)`` float16 or bfloat16 (any float for NumPy inputs).
        cache: a :class:`PagedKVCache` or a ``(k_pages, v_pages)`` pair, as in :func:`cuattn.paged_attention`
            (e4m3 pages with ``k_scale`` / ``v_scale`` too; those run every sequence through paged decode;
            v's head dim Dv may differ from D).
        block_table: int32 ``(B, max_blocks)``; seq_lens: int32 ``(B,)`` keys per sequence.
        cu_seqlens_q: int32 ``(B + 1,)`` prefix sums of the query runs (0 allowed), starting at 0
            and ending at total_q; read on the host.
        max_seqlen_q: an int at least the longest run.
        causal, scale, softcap, sinks, return_lse, max_seq_len, check: as in :func:`cuattn.paged_attention`
            (sinks: float32 ``(Hq,)`` logits that join every row's softmax denominator).
        alibi_slopes: optional float32 ``(Hq,)`` or ``(B, Hq)`` ALiBi slopes: query i of sequence b's
            n gains ``-slope * |i + seq_lens[b] - n - j|`` on key j (after scale and softcap). With
            ``causal=True`` only: a decode run that is not its sequence's last (e4m3 pages, NumPy
            inputs) sees fewer keys than its sequence, which places the diagonal by its key count.
        window: ``(left, right)`` with ``causal``, whose mask caps the right side at 0 as in every
            function (so a left window); none without (see alibi_slopes). The default ``(-1, -1)``
            sees every earlier key.
        out: optional ``(total_q, Hq, Dv)`` array of q's dtype and framework to write into.

    Returns:
        ``out`` ``(total_q, Hq, Dv)``, or ``(out, lse)`` with lse ``(Hq, total_q)`` float32.
    """
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse, check=check)
    if not causal and (left >= 0 or right >= 0):
        raise ValueError(f"window = {tuple(window)}: paged_attention_varlen takes a window with causal=True only "
                         "(a decode run that is not its sequence's last places the diagonal by its key count)")
    if alibi_slopes is not None and not causal:
        raise ValueError("alibi_slopes: paged_attention_varlen takes ALiBi with causal=True only, got causal=False")
    # A repeated call with the same signatures, options and host prefix sums takes its plan (calls
    # whose launches read no gathered runs record one: _varlen_plan). NumPy tables and
    # lengths are checked (check=True) and copied by the plan; device ones are read in place,
    # unchecked only (a check would read them on the host).
    call_key = None
    cu_key = _prefix_sums_key(cu_seqlens_q)
    host = (type(block_table) is np.ndarray, type(seq_lens) is np.ndarray)
    if cu_key is not None and isinstance(max_seqlen_q, int) and (all(host) or not check):
        own = isinstance(cache, PagedKVCache)
        pages = (cache.k_pages, cache.v_pages) if own else cache
        scales = (cache.k_scale, cache.v_scale) if own and cache.e4m3 else (k_scale, v_scale)
        if own or (isinstance(pages, (tuple, list)) and len(pages) == 2):
            # the plan's inputs (_PLAN_INPUTS); host tables and lengths enter the key by shape and dtype
            arrays = (q, *pages, block_table, seq_lens, out, sinks, alibi_slopes,
                      *(x if _arrays.is_array(x) else None for x in scales))
            plan, call_key, readers = _calls.find(
                "paged_attention_varlen",
                (q, *pages, None if host[0] else block_table, None if host[1] else seq_lens, *arrays[_LENS + 1:]),
                (bool(causal), scale, left, right, softcap, bool(return_lse), max_seqlen_q, max_seq_len, own,
                 scale_options(*scales), cu_key, bool(check),
                 *((x.shape, x.dtype.str) if on_host else None for x, on_host in zip((block_table, seq_lens), host))))
            if plan is not None:
                result = plan.run_over(readers, *arrays)
                if result is not None:
                    return result
    checked = bool(check)
    max_seqlen_q = _arrays.check_int("max_seqlen_q", max_seqlen_q, 0)
    _arrays.array_kind(q, "q")  # an array at all, before its shape is read
    _arrays.check_ndim("q", q, "(total_q, Hq, D)")
    block_table, seq_lens = (_arrays.host_int32(name, x) for name, x in (("block_table", block_table),
                                                                          ("seq_lens", seq_lens)))
    table_host, lens_host = (_arrays.array_kind(x, name) == "numpy"
                             for name, x in (("block_table", block_table), ("seq_lens", seq_lens)))
    cu = _host_prefix_sums(cu_seqlens_q)
    _arrays.check_ndim("cu_seqlens_q", cu, "(B + 1)")
    _arrays.check_int32("cu_seqlens_q", cu)
    _arrays.check_ndim("block_table", block_table, "(B, max_blocks)")
    _arrays.check_axis("cu_seqlens_q", cu, 0, "B + 1", int(block_table.shape[0]) + 1, "block_table.shape[0] + 1")
    _check_host_cu_seqlens(cu, int(q.shape[0]), max_seqlen_q, "q")
    pages_named = {} if isinstance(cache, PagedKVCache) else dict(zip(("k_pages", "v_pages"), _cache_pair(cache)))
    # q, out, the pages of a pair, and the table and lengths when they live on the device, are viewed in one framework
    named = {"q": q, **({} if out is None else {"out": out}), **({} if sinks is None else {"sinks": sinks}),
             **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}), **pages_named,
             **({} if table_host else {"block_table": block_table}), **({} if lens_host else {"seq_lens": seq_lens})}
    with _arrays.array_context(**named) as ctx:
        qv, ov, sv, av = ctx.view(q), ctx.view(out), ctx.view(sinks), ctx.view(alibi_slopes)
        table = block_table if table_host else ctx.view(block_table)
        lens = seq_lens if lens_host else ctx.view(seq_lens)
        if isinstance(cache, PagedKVCache):
            kv, vv, pair = cache.k_pages, cache.v_pages, cache
        else:
            kv, vv = ctx.view(pages_named["k_pages"]), ctx.view(pages_named["v_pages"])
            pair = (kv, vv)
        # array scales of the caller's framework, as CuPy views beside the viewed pages
        k_scale, v_scale = (ctx.view(x) if _arrays.is_array(x) and _arrays.array_kind(x) == ctx.kind else x
                            for x in (k_scale, v_scale))
        # every sequence's arguments, before any plan: the launches below see only the sequences
        # with queries, and would name their own runs rather than the caller's sequences
        if isinstance(cache, PagedKVCache):
            _check_no_pair_scales(k_scale, v_scale)
            # an e4m3 cache's own descales, which a prefill launch reading its pages takes
            own = (cache.k_scale, cache.v_scale) if cache.e4m3 else (None, None)
            e4m3, *scales = _check_call(qv, kv, vv, table, lens, *own, ctx.on_host or cache.device == "cpu")
        else:
            e4m3, *scales = _check_call(qv, kv, vv, table, lens, k_scale, v_scale, ctx.on_host)
        kv_scales = tuple(scales) if e4m3 else None
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[1]), ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, int(table.shape[0]), int(qv.shape[1]), ctx.on_host, qv)
        # device lengths left unchecked: a run's key count is its sequence's, clamped as the
        # kernels clamp it, less the tokens after the run (below)
        clamp_lens = not check and not ctx.on_host
        if check:
            check_table(table if table_host else table.get(), lens if lens_host else lens.get(),
                        int(kv.shape[0]), int(kv.shape[1]))
            check = False  # every row of the table was just checked
        elif ctx.on_host:
            table, lens = clamp_table(table, lens, int(kv.shape[0]), int(kv.shape[1]))
        total_q, num_heads, head_dim = map(int, qv.shape)
        head_dim_v = int(vv.shape[3])
        out_shape = (total_q, num_heads, head_dim_v)
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k_pages": kv, "v_pages": vv, "out": ov})
        if ov is not None:
            _check_out(ov, qv, vv, "v_pages")
            if not ctx.on_host:
                _arrays.check_kernel_layout("out", ov)
                _arrays.check_same_device("out", ov, "q", qv)
        lengths = np.diff(cu.astype(np.int64))
        prefill = np.zeros(lengths.shape, bool)
        # long query runs take the paged forward (2-byte pages, any Dv; e4m3 pages where the Hopper
        # kernel widens them, paged_e4m3_prefill); other e4m3 pages run as decode rows
        if not ctx.on_host and (kv_scales is None or paged_e4m3_prefill(qv, head_dim, head_dim_v, av is not None)):
            prefill = lengths >= PREFILL_MIN_QUERIES
        options = dict(causal=causal, scale=scale, window=(left, right), softcap=softcap, sinks=sv)
        if prefill.any():
            check_device_pages(qv, kv, vv)
        xp = np if ctx.on_host else __import__("cupy")
        if ov is None:
            ov = np.empty(out_shape, qv.dtype) if ctx.on_host else ctx.empty(out_shape, qv.dtype)
        lse = xp.empty((num_heads, total_q), np.float32) if ctx.on_host or not return_lse else \
            ctx.empty((num_heads, total_q), np.float32)
        if num_heads == 0:  # no query heads, as every function takes them: nothing to plan or launch
            return _to_caller(ov, lse, out, return_lse, ctx)
        # the whole plan on the host, then where the kernels read it in one copy (one-token
        # sequences in a row on the GPU need no runs: their decode launch reads views)
        block = None if ctx.on_host else _one_token_block(lengths, ~prefill)
        runs = _Runs.of(cu, ~prefill if block is None else np.zeros_like(prefill))
        index = np.flatnonzero(prefill)
        cu_x, index_x, rows_x, sequence_x, tail_x, query_rows_x, keep_x = ctx.ints(
            cu, index, runs.rows, runs.sequence, runs.tail, runs.query_rows, runs.keep)
        parts = []  # the launches' plans: (bound launches, workspace arguments)
        if prefill.any() or block is not None:
            import cupy

            if not prefill.any():
                check_device_pages(qv, kv, vv)
            # the table and lengths as the kernels read them, contiguous int32 (host ones copied)
            table_d, lens_d = (cupy.ascontiguousarray(cupy.asarray(x, dtype=cupy.int32)) for x in (table, lens))
            in_place = ((table_host or table_d.data.ptr == table.data.ptr)
                        and (lens_host or lens_d.data.ptr == lens.data.ptr))
            lse_d = lse if return_lse else None
            if prefill.any():
                launch = _launch_prefill(qv, kv, vv, table_d, lens_d, cu, index, cu_x, index_x, ov, lse_d, ctx,
                                         alibi=(av, alibi_sb), kv_scales=kv_scales, **options)
                if launch is not None:
                    parts.append(_plan_fwd(launch, {role: role for role in _PLAN_ROLES},
                                           order_fields={"seq_lens": "seq_lens"}))
            if block is not None:
                # sequences [first, last), one token each (a serving step's decode rows): rows
                # cu[first]..cu[last) of q, out and lse
                rows = slice(int(cu[block[0]]), int(cu[block[1]]))
                parts.append(_launch_block(qv, kv, vv, table_d, lens_d, ov, lse_d, rows=rows, block=block,
                                           e4m3=kv_scales is not None, scales=scales, alibi=(av, alibi_sb),
                                           max_seq_len=max_seq_len, ctx=ctx, **options))
            # every sequence with queries in these launches, reading the caller's device table and
            # lengths in place (host ones: their copies): later calls replay them over their own arrays
            if call_key is not None and parts and not runs.count and in_place:
                _calls.remember(call_key, _varlen_plan(parts, cu_x, ctx, out is None, out_shape, return_lse, checked,
                                                       (int(kv.shape[0]), int(kv.shape[1]))))
        if runs.count:
            # each run's S query rows [runs, S, Hq, D] (filler positions repeat a real row), its
            # sequence's table row, and the keys its last token sees (seq_lens less the tokens after it)
            run_q = qv[rows_x]
            run_table = table[runs.sequence if table_host else sequence_x]
            run_lens = lens[runs.sequence if lens_host else sequence_x].astype(np.int32)
            if clamp_lens:
                run_lens = run_lens.clip(0, int(table.shape[1]) * int(kv.shape[1]))
            if causal:
                run_lens = run_lens - (runs.tail if lens_host else tail_x)
                run_lens = (run_lens * (run_lens > 0)).astype(np.int32)  # a run before the first key sees none
            # (B, Hq) slopes: each run takes its sequence's row
            run_slopes = av if av is None or av.ndim == 1 else av[runs.sequence if ctx.on_host else sequence_x]
            run_out, run_lse = paged_attention(run_q, pair, run_table, run_lens, max_seq_len=max_seq_len,
                                               return_lse=True, check=check, alibi_slopes=run_slopes,
                                               k_scale=k_scale, v_scale=v_scale, **options)
            # the decode rows' results among the runs' rows: out [total_q, Hq, Dv], lse [Hq, total_q]
            ov[query_rows_x] = run_out.reshape(-1, num_heads, head_dim_v)[keep_x]
            if return_lse:
                lse.T[query_rows_x] = run_lse.transpose(1, 0, 2).reshape(num_heads, -1).T[keep_x]
        return _to_caller(ov, lse, out, return_lse, ctx)


def _to_caller(ov, lse, out, return_lse: bool, ctx):
    """The call's result: ``out`` (the caller's array where one was given) or ``(out, lse)``, in
    the caller's framework."""
    if not ctx.on_host:
        ov, lse = (out if out is not None else ctx.to_caller(ov)), (ctx.to_caller(lse) if return_lse else None)
    return (ov, lse) if return_lse else ov


def _check_call(q, k, v, table, lens, k_scale, v_scale, host: bool):
    """The pages' shapes against q's, their dtype and descales, the table's and the lengths' shapes
    and dtypes: what paged_attention checks for its rows, here for every sequence of the call
    (those without queries too, and a call without any). Returns check_cache_scales' (e4m3, k
    KvScale, v KvScale)."""
    _arrays.check_ndim("k_pages", k, "(num_blocks, block_size, Hk, D)")
    _arrays.check_ndim("v_pages", v, "(num_blocks, block_size, Hk, Dv)")
    for axis, axis_name in enumerate(("num_blocks", "block_size", "Hk")):
        _arrays.check_axis("v_pages", v, axis, axis_name, int(k.shape[axis]), f"k_pages.shape[{axis}]")
    _arrays.check_axis("k_pages", k, 3, "head_dim", int(q.shape[2]), "q.shape[2]")
    _arrays.check_positive("k_pages", k, 2, "Hk")
    _arrays.check_positive("k_pages", k, 0, "num_blocks")  # as paged_attention's (check=False clamps into the pool)
    if int(q.shape[1]) % int(k.shape[2]):
        raise ValueError(f"q.shape[1] (num_heads) = {int(q.shape[1])} must be a multiple of k_pages.shape[2] "
                         f"(num_kv_heads) = {int(k.shape[2])}")
    _arrays.check_head_dim("q.shape[-1] (head_dim)", int(q.shape[2]))
    _arrays.check_head_dim("v_pages.shape[3] (head_dim_v)", int(v.shape[3]))
    if not 1 <= int(k.shape[1]) <= MAX_BLOCK_SIZE:
        raise ValueError(f"k_pages.shape[1] (block_size) must be from 1 to {MAX_BLOCK_SIZE}, got {int(k.shape[1])}")
    checked = check_cache_scales(q, k, v, k_scale, v_scale, ("k_pages", "v_pages"), host)
    _arrays.check_int32("block_table", table)
    _arrays.check_ndim("seq_lens", lens, "(B)")
    _arrays.check_axis("seq_lens", lens, 0, "batch", int(table.shape[0]), "block_table.shape[0]")
    _arrays.check_int32("seq_lens", lens)
    return checked


def _launch_prefill(q, k, v, table, lens, cu: np.ndarray, index: np.ndarray, cu_device, index_device, out, lse, ctx,
                    *, causal, scale, window, softcap, sinks, alibi, kv_scales):
    """One paged forward launch (the Hopper kernel or flash_fwd_kernel's PAGED variant) over the
    sequences ``index`` (host; ``index_device`` the same on the device, and ``cu_device`` the
    prefix sums) of the device ``table`` and ``lens`` (contiguous int32): q, out and lse in place
    (their rows through the full prefix sums), launch entry e being sequence index[e], which also
    picks its row of ``(B, Hq)`` slopes (``alibi``: the slopes or None, and their batch stride).
    ``kv_scales``: e4m3 pages' (k, v) descales, or None for 16-bit pages. Returns the prepared
    launch (None: nothing to compute)."""
    longest = int(np.diff(cu.astype(np.int64))[index].max())
    paged = PagedKeys(block_table=table, seq_lens=lens, batch_index=index_device, block_size=int(k.shape[1]),
                      num_blocks=int(k.shape[0]))
    return _launch_fwd(q[None], k, v, out[None], lse[None] if lse is not None else None, cu_device, None,
                       batch=int(index.size), seqlen_q=longest, seqlen_k=paged.capacity(), causal=causal,
                       scale=scale, window=window, softcap=softcap, stream=ctx.stream, sinks=sinks, alibi=alibi,
                       paged=paged, kv_scales=kv_scales)


def _launch_block(q, k, v, table, lens, out, lse, *, rows: slice, block: tuple, e4m3: bool, scales, alibi,
                  max_seq_len, ctx, causal, scale, window, softcap, sinks):
    """The paged decode launch (split-KV) of sequences ``block`` = [first, last), one query each,
    rows ``rows`` of q: it reads views of q, the device ``table`` and ``lens`` (contiguous int32)
    and the slopes, and writes its rows of out [total_q, Hq, Dv] and lse [Hq, total_q] (or None)
    in place. Returns its plan part: the launches, each view's role an offset into the call's
    array, and the workspace arguments."""
    first, last = block
    slopes, slopes_stride = alibi
    # [n, 1, Hq, D] queries and [n, 1, Hq, Dv] outputs, [n, Hq, 1] lse: the packed rows as decode's batch
    views = {"q": (q, q[rows][:, None]), "block_table": (table, table[first:last]),
             "seq_lens": (lens, lens[first:last]), "out": (out, out[rows][:, None])}
    if lse is not None:
        views["lse"] = (lse, lse[:, rows].T[:, :, None])
    if slopes is not None and slopes.ndim == 2:  # (B, Hq) slopes: the block's rows
        views["alibi_slopes"] = (slopes, slopes[first:last])
    view = {role: x for role, (_, x) in views.items()}
    num_blocks, block_size = int(k.shape[0]), int(k.shape[1])
    capacity = int(table.shape[1]) * block_size
    bound, workspace = launch_decode(
        view["q"], k, v, view["seq_lens"], view["out"], view.get("lse"), (view["block_table"], block_size, num_blocks),
        capacity, num_splits=None, causal=causal, scale=scale, window=window, softcap=softcap, stream=ctx.stream,
        split_length=planned_length(max_seq_len, capacity), sinks=sinks,
        alibi=(view.get("alibi_slopes", slopes), slopes_stride), e4m3=e4m3, k_scale=scales[0], v_scale=scales[1])
    # launch_decode's roles, renamed to the call's inputs at the views' byte offsets
    renamed = {"table": "block_table", "lens": "seq_lens"}
    offsets = {role: f"{role}+{x.data.ptr - base.data.ptr}" for role, (base, x) in views.items()}
    for b in bound:
        b.fields = {field: offsets.get(renamed.get(role, role), renamed.get(role, role))
                    for field, role in b.fields.items()}
    return bound, (dict(workspace=workspace, workspace_of=workspace_address) if workspace else {})


def _prefix_sums_key(cu):
    """What a plan key holds of host prefix sums (their values plan the call): a NumPy array's
    dtype, shape and bytes, or a list's ints; None for anything else (device prefix sums are
    copied to the host, which a plan would not save)."""
    if type(cu) is np.ndarray:
        return cu.dtype.str, cu.shape, cu.tobytes()
    if isinstance(cu, (list, tuple)) and all(type(x) is int for x in cu):
        return tuple(cu)
    return None


# A plan's inputs: the arrays in the order paged_attention_varlen passes them, then the lse it
# allocates; each also names the FwdParams field it fills (decode's launches rename theirs:
# _launch_block). out (the caller's, or one the plan allocates) is sixth.
_PLAN_INPUTS = ("q", "k", "v", "block_table", "seq_lens", "out", "sinks", "alibi_slopes", "k_scale", "v_scale")
_PLAN_ROLES = (*_PLAN_INPUTS, "lse")
_TABLE, _LENS, _OUT = (_PLAN_INPUTS.index(role) for role in ("block_table", "seq_lens", "out"))


class _VarlenPlan:
    """A call whose sequences with queries all took the paged forward or the decode launch over
    its block of one-token sequences, replayed: each part (the forward's, the block's) a
    :class:`_calls.Plan` of its launches, over the call's arrays, out and lse, which the plan
    allocates. The launches read the prefix sums and the forward's sequence index from
    ``constants``, which the call that made the plan copied to the device on its stream; until
    that copy is seen done (``ready``), a run makes its own stream wait for it. A NumPy block
    table or seq_lens is checked when the call asks (``check``, against the pool's
    ``(num_blocks, block_size)``) and copied each run, both in one copy on the launch's stream."""

    def __init__(self, parts, *, constants, ready, check: bool, pool: tuple, out_shape: tuple, new_out: bool,
                 return_lse: bool):
        self.parts, self.constants, self.ready, self.check, self.pool = parts, constants, ready, check, pool
        self.out_shape, self.new_out, self.return_lse = out_shape, new_out, return_lse
        self.lse_shape = (out_shape[1], out_shape[0])  # [Hq, total_q]

    def run_over(self, readers, *arrays):
        """Run over paged_attention_varlen's arrays in key order (host table and lengths as NumPy
        arrays, their readers None), or None for the full path."""
        import cupy

        fw, like = readers[0], arrays[0]
        stream = fw.stream(like)
        if self.ready is not None:
            if self.ready.done:
                self.ready = None
            else:
                cupy.cuda.runtime.streamWaitEvent(stream, self.ready.ptr)
        arrays, readers = list(arrays), list(readers)
        host = [i for i in (_TABLE, _LENS) if readers[i] is None]
        if host:
            if self.check:
                check_table(arrays[_TABLE], arrays[_LENS], *self.pool)
            flat = [np.ascontiguousarray(arrays[i], np.int32).reshape(-1) for i in host]
            ints = np.concatenate(flat) if len(flat) > 1 else flat[0]
            if stream == cupy.cuda.get_current_stream().ptr:
                device = cupy.asarray(ints)
            else:  # torch's current stream: the copy goes where the launch will read it
                with _arrays.external_stream(stream, self.parts[0].device_id):
                    device = cupy.asarray(ints)
            start = 0
            for i, x in zip(host, flat):
                arrays[i] = device[start:start + x.size].reshape(arrays[i].shape)
                readers[i] = _calls.framework(device)
                start += x.size
        if self.new_out:
            arrays[_OUT], readers[_OUT] = fw.empty(self.out_shape, like), fw
        lse = fw.empty(self.lse_shape, like, True) if self.return_lse else None
        arrays.append(lse)
        readers.append(fw if self.return_lse else None)
        # every part bound before any launches: one that would take the full path launches nothing
        bound = [part.bind(arrays, readers) for part in self.parts]
        if any(b is None for b in bound):
            return None
        for _, part_stream, launches in bound:
            for launch, pointers in launches:
                launch.run(part_stream, pointers)
        return (arrays[_OUT], lse) if self.return_lse else arrays[_OUT]


def _varlen_plan(parts, constants, ctx, new_out: bool, out_shape: tuple, return_lse: bool, check: bool,
                 pool: tuple) -> _VarlenPlan:
    """The plan of a call that ran as ``parts`` (each ``(bound launches, workspace arguments)``:
    the paged forward's, the decode block's): inputs :data:`_PLAN_ROLES`, out (where the caller
    gave none) and lse (when asked for) new each run; ``constants`` (the device prefix sums and
    sequence index) held for its life; ``check`` and ``pool`` as :class:`_VarlenPlan` takes them."""
    import cupy

    plans = [_calls.Plan(inputs=_PLAN_ROLES, outputs={}, bound=bound, finish=None, aligned=("q", "k", "v", "out"),
                         **workspace) for bound, workspace in parts]
    ready = cupy.cuda.Event(block=False, disable_timing=True)
    ready.record(ctx.stream)
    return _VarlenPlan(plans, constants=constants, ready=ready, check=check, pool=pool, out_shape=out_shape,
                       new_out=new_out, return_lse=return_lse)


def _host_prefix_sums(cu):
    """The prefix sums on the host (a device array is copied: the runs are planned from them)."""
    cu = _arrays.host_int32("cu_seqlens_q", cu)
    if _arrays.array_kind(cu, "cu_seqlens_q") == "numpy":
        return cu
    # the dtype before the copy: a torch dtype NumPy lacks would fail it with torch's own message
    _arrays.check_int32("cu_seqlens_q", cu)
    return _arrays.to_numpy(cu)


def _one_token_block(lengths: np.ndarray, selected: np.ndarray) -> tuple[int, int] | None:
    """(first, last) when the selected sequences that have queries are sequences [first, last) and
    each has exactly one (their rows then follow one another); else None."""
    chosen = np.flatnonzero(selected & (lengths > 0))
    if chosen.size == 0:
        return None
    first, last = int(chosen[0]), int(chosen[-1]) + 1
    return (first, last) if last - first == chosen.size and bool((lengths[first:last] == 1).all()) else None


class _Runs:
    """The runs of S query tokens the decode launch computes, planned on the host from the prefix sums.

    ``rows`` [runs, S]: the packed query row of each run position (filler positions repeat the
    run's first real row); ``sequence`` [runs]: the run's sequence; ``tail`` [runs]: how many of
    the sequence's tokens follow the run's last token (its key count is seq_lens - tail);
    ``query_rows`` [n]: the packed query rows the runs answer, and ``keep`` [n]: where each one's
    result sits among the runs' flattened rows."""

    def __init__(self, rows, sequence, tail, query_rows, keep):
        self.rows, self.sequence, self.tail, self.query_rows, self.keep = rows, sequence, tail, query_rows, keep
        self.count = int(sequence.shape[0])

    @classmethod
    def of(cls, cu: np.ndarray, selected: np.ndarray) -> "_Runs":
        """Runs of the sequences marked in ``selected`` (bool [B]), planned with whole-array NumPy
        (a mixed serving step has hundreds of decode rows; a loop over them cost a millisecond).
        Run j of a sequence of n tokens starts at min(j S, n - S): the last run ends at the
        sequence's last token and may overlap the one before, whose rows it leaves to it; a
        sequence shorter than S is preceded by filler positions (negative, reading row 0 of it)."""
        lengths = np.diff(cu.astype(np.int64))
        size = int(min(MAX_NEW_TOKENS, max(int(lengths[selected].max(initial=0)), 1)))
        chosen = np.flatnonzero(selected)
        n = lengths[chosen]
        per_sequence = -(-n // size)  # runs of each chosen sequence (none for an empty one)
        sequence = np.repeat(chosen, per_sequence)
        n_run = np.repeat(n, per_sequence)
        j = np.arange(sequence.size) - np.repeat(np.cumsum(per_sequence) - per_sequence, per_sequence)
        start = np.minimum(j * size, n_run - size)
        positions = start[:, None] + np.arange(size)  # [runs, S] positions in the sequence
        first = cu.astype(np.int64)[sequence][:, None]  # each run's sequence's first packed row
        # run j answers its positions from j S on (those below are the run before's)
        new = positions >= (j * size)[:, None]
        tail = (n_run - start - size).astype(np.int32)
        return cls(first + np.maximum(positions, 0), sequence.astype(np.int64), tail, (first + positions)[new],
                   np.flatnonzero(new.reshape(-1)))
