"""Exact attention for prefill and training: ``attention`` and ``attention_varlen`` (forward).

    out = softmax(mask(cap(scale * q @ k^T))) @ v        lse = logsumexp of the same scores

computed tile by tile on tensor cores (``cuda_src/flash_fwd.cu``) without ever writing the
Sq x Sk score matrix: the extra device memory is ``out`` and ``lse``.

Layouts (any strides, as long as the last axis is contiguous, so the transpose of a
``(B, H, S, D)`` tensor works without a copy):

    dense    q (B, Sq, Hq, D)      k, v (B, Sk, Hk, D)      out (B, Sq, Hq, D)   lse (B, Hq, Sq)
    varlen   q (total_q, Hq, D)    k, v (total_k, Hk, D)    out (total_q, Hq, D) lse (Hq, total_q)

``Hq`` must be a multiple of ``Hk`` (MHA, GQA, MQA). ``causal`` is aligned to the bottom-right
corner: query i sees key j iff ``j <= i + Sk - Sq``. ``window=(left, right)`` keeps
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1 = unbounded). ``softcap > 0`` replaces the
scaled score s by ``softcap * tanh(s / softcap)``. ``lse`` is float32 and the **natural log** of
the softmax denominator. A row with no visible key gives out = 0 and lse = -inf, never NaN.

NumPy inputs run the float64 reference (``cuattn.reference``) on the CPU and return NumPy
arrays in q's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import _arrays, _jit, _masks, reference



# ---------------------------------------------------------------------------------------------
# Kernel choice: one traits table, tile sizes per head dim


@dataclasses.dataclass(frozen=True)
class FwdTile:
    """Tile sizes of flash_fwd_kernel: BLOCK_M query rows per CTA, BLOCK_N keys per step."""

    block_m: int
    block_n: int
    warps: int

    # Shared-memory rows carry 8 elements of padding (SmemRow::kPadElems in flash_fwd.cu).
    PAD_ELEMS = 8

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Q tile plus one K and one V tile, each row padded: [BLOCK_M + 2 BLOCK_N, D + 8]."""
        return (self.block_m + 2 * self.block_n) * (head_dim + self.PAD_ELEMS) * itemsize

    def threads(self) -> int:
        return self.warps * 32


# The fastest spill-free tiles per head dim and architecture family: `python -m cuattn build`
# checks the spills, scripts/tune_fwd.py measured the candidates on an H200 (BENCHMARKS.md).
# Each warp owns BLOCK_M / warps query rows: 32 rows (two m16 tiles) halve the shared-memory
# reads of K and V per FLOP against 16, and the fp32 output accumulator of 32 rows x D is what
# fills the registers, so the key block BLOCK_N is whatever register allocation leaves room for.
# The columns differ only where ptxas allocates differently for the two targets.
SM80, SM90 = "sm_80", "sm_90a"
FWD_TILES = {
    32: {SM80: FwdTile(128, 128, 4), SM90: FwdTile(128, 128, 4)},
    64: {SM80: FwdTile(128, 96, 4), SM90: FwdTile(128, 128, 4)},
    96: {SM80: FwdTile(128, 48, 4), SM90: FwdTile(128, 48, 4)},
    128: {SM80: FwdTile(128, 64, 4), SM90: FwdTile(128, 64, 4)},
    256: {SM80: FwdTile(64, 64, 4), SM90: FwdTile(64, 64, 4)},
}
SUPPORTED_HEAD_DIMS = tuple(sorted(FWD_TILES))
SUPPORTED_DTYPES = ("float16", "bfloat16")


def arch_family(arch: str) -> str:
    """The FWD_TILES column for a target: Hopper's own, or the sm_80 one for every other arch."""
    return SM90 if arch.startswith("sm_90") else SM80


def fwd_tile(head_dim: int, arch: str) -> FwdTile:
    return FWD_TILES[head_dim][arch_family(arch)]


@functools.lru_cache(maxsize=None)
def fwd_spec(dtype, head_dim: int, tile: FwdTile) -> _jit.KernelSpec:
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    return _jit.KernelSpec(
        "flash_fwd.cu",
        f"cuattn::flash_fwd_kernel<{ctype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}>",
        threads=tile.threads(),
        smem_bytes=tile.smem_bytes(head_dim, np.dtype(dtype).itemsize),
    )


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """Every forward variant the dispatcher can pick on ``arch`` (for ``cuattn.build``)."""
    return [fwd_spec(dtype, d, fwd_tile(d, arch)) for dtype in _arrays.CUDA_TYPES for d in SUPPORTED_HEAD_DIMS]


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the GPU and CPU paths


def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim not in FWD_TILES:
        supported = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        raise ValueError(f"{name}.shape[-1] (head_dim) = {head_dim} is not supported; supported head dims: {supported}")


def _check_qkv(q, k, v, *, packed: bool) -> None:
    """Shapes of q, k, v: dense (B, S, H, D) or packed varlen (total, H, D)."""
    if packed:
        layouts = ("(total_q, Hq, D)", "(total_k, Hk, D)")
    else:
        layouts = ("(B, Sq, Hq, D)", "(B, Sk, Hk, D)")
    _arrays.check_ndim("q", q, layouts[0])
    _arrays.check_ndim("k", k, layouts[1])
    _arrays.check_ndim("v", v, layouts[1])
    head_axis, dim_axis = q.ndim - 2, q.ndim - 1
    if not packed:
        _arrays.check_axis("k", k, 0, "batch", q.shape[0], "q.shape[0]")
    _arrays.check_axis("k", k, dim_axis, "head_dim", q.shape[dim_axis], f"q.shape[{dim_axis}]")
    for axis, axis_name in enumerate(layouts[1].strip("()").split(", ")):
        _arrays.check_axis("v", v, axis, axis_name, k.shape[axis], f"k.shape[{axis}]")
    num_heads, num_kv_heads = int(q.shape[head_axis]), int(k.shape[head_axis])
    _arrays.check_positive("k", k, head_axis, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q.shape[{head_axis}] (num_heads) = {num_heads} must be a multiple of "
            f"k.shape[{head_axis}] (num_kv_heads) = {num_kv_heads}"
        )
    _check_head_dim("q", int(q.shape[dim_axis]))


def _check_dtypes(q, k, v, host: bool) -> None:
    if host:
        for name, x in (("q", q), ("k", k), ("v", v)):
            _arrays.check_host_float_dtype(name, x)
        return
    _arrays.check_float_dtype("q", q)
    _arrays.check_same_dtype("k", k, "q", q)
    _arrays.check_same_dtype("v", v, "q", q)


def _check_out(out, q) -> None:
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out.shape must equal q.shape = {tuple(q.shape)}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(q.dtype):
        raise TypeError(
            f"out.dtype must equal q.dtype = {_arrays.dtype_name(q.dtype)}, got {_arrays.dtype_name(out.dtype)}"
        )


def _check_device_arrays(named: dict) -> None:
    first_name, first = next(iter(named.items()))
    for name, x in named.items():
        _arrays.check_kernel_layout(name, x)
        _arrays.check_same_device(name, x, first_name, first)


# ---------------------------------------------------------------------------------------------
# Public API


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, return_lse=False, out=None):
    """Exact softmax attention of q over k, v; FlashAttention-style, never materialising scores.

    Args:
        q: ``(B, Sq, Hq, D)`` float16 or bfloat16 (any float dtype for NumPy inputs).
        k, v: ``(B, Sk, Hk, D)``, same dtype; ``Hq % Hk == 0`` (MHA, GQA, MQA).
        causal: mask keys after the query, aligned to the bottom-right corner when Sq != Sk.
        scale: score multiplier, default ``1 / sqrt(D)``.
        window: ``(left, right)`` sliding window around the (bottom-right aligned) diagonal;
            -1 leaves a side unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        return_lse: also return the float32 log-sum-exp ``(B, Hq, Sq)``, natural log.
        out: optional ``(B, Sq, Hq, D)`` array (q's dtype and framework) to write into.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse``, in the framework of the inputs.
    """
    left, right = _masks.check_options(window, softcap, scale)
    with _arrays.array_context(q=q, k=k, v=v, out=out) as ctx:
        qv, kv, vv, ov = (ctx.view(x) for x in (q, k, v, out))
        _check_qkv(qv, kv, vv, packed=False)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        if ov is not None:
            _check_out(ov, qv)
        if ctx.on_host:
            result = reference.attention(
                qv, kv, vv, causal=causal, scale=scale, window=(left, right), softcap=softcap, return_lse=True
            )
            return _host_result(result, qv, ov, return_lse)

        import cupy

        _check_device_arrays({"q": qv, "k": kv, "v": vv, **({"out": ov} if ov is not None else {})})
        batch, seqlen_q, num_heads, _ = map(int, qv.shape)
        if ov is None:
            ov = cupy.empty(qv.shape, qv.dtype)
        lse = cupy.empty((batch, num_heads, seqlen_q), cupy.float32) if return_lse else None
        _launch_fwd(
            qv, kv, vv, ov, lse, None, None,
            batch=batch, seqlen_q=seqlen_q, seqlen_k=int(kv.shape[1]),
            causal=causal, scale=scale, window=(left, right), softcap=softcap, stream=ctx.stream,
        )
        result = out if out is not None else ctx.to_caller(ov)
        return (result, ctx.to_caller(lse)) if return_lse else result


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    causal=False, scale=None, window=(-1, -1), softcap=0.0, return_lse=False, out=None,
):
    """Attention over a packed batch of sequences of different lengths, no padding.

    Sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (``(total_q, Hq, D)``) and
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v (``(total_k, Hk, D)``); masks apply per
    sequence with its own lengths. ``cu_seqlens_*`` are int32 ``(B + 1,)`` prefix sums on the
    same device (their values are not read on the host, so nothing synchronises), and
    ``max_seqlen_*`` are host ints bounding every sequence's length: a length above them is
    not processed. Returns ``out`` ``(total_q, Hq, D)``, and with ``return_lse`` also float32 lse
    ``(Hq, total_q)`` (natural log).
    """
    left, right = _masks.check_options(window, softcap, scale)
    with _arrays.array_context(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out) as ctx:
        qv, kv, vv, ov, cuq, cuk = (ctx.view(x) for x in (q, k, v, out, cu_seqlens_q, cu_seqlens_k))
        _check_qkv(qv, kv, vv, packed=True)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        if ov is not None:
            _check_out(ov, qv)
        for name, cu in (("cu_seqlens_q", cuq), ("cu_seqlens_k", cuk)):
            _arrays.check_ndim(name, cu, "(B + 1)")
            _arrays.check_int32(name, cu)
            if int(cu.shape[0]) < 2:
                raise ValueError(f"{name}.shape[0] (B + 1) must be at least 2, got {cu.shape[0]}")
        _arrays.check_axis("cu_seqlens_k", cuk, 0, "B + 1", int(cuq.shape[0]), "cu_seqlens_q.shape[0]")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if ctx.on_host:
            _check_host_cu_seqlens(cuq, qv.shape[0], max_seqlen_q, "q")
            _check_host_cu_seqlens(cuk, kv.shape[0], max_seqlen_k, "k")
            result = reference.attention_varlen(
                qv, kv, vv, cuq, cuk, max_seqlen_q, max_seqlen_k,
                causal=causal, scale=scale, window=(left, right), softcap=softcap, return_lse=True,
            )
            return _host_result(result, qv, ov, return_lse)

        import cupy

        _check_device_arrays({"q": qv, "k": kv, "v": vv, **({"out": ov} if ov is not None else {})})
        _arrays.check_same_device("cu_seqlens_q", cuq, "q", qv)
        _arrays.check_same_device("cu_seqlens_k", cuk, "q", qv)
        total_q, num_heads, _ = map(int, qv.shape)
        if ov is None:
            ov = cupy.empty(qv.shape, qv.dtype)
        lse = cupy.empty((num_heads, total_q), cupy.float32) if return_lse else None
        _launch_fwd(
            qv[None], kv[None], vv[None], ov[None], lse[None] if lse is not None else None,
            cupy.ascontiguousarray(cuq), cupy.ascontiguousarray(cuk),
            batch=int(cuq.shape[0]) - 1, seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k),
            causal=causal, scale=scale, window=(left, right), softcap=softcap, stream=ctx.stream,
        )
        result = out if out is not None else ctx.to_caller(ov)
        return (result, ctx.to_caller(lse)) if return_lse else result


# ---------------------------------------------------------------------------------------------
# Helpers


def _check_host_cu_seqlens(cu, total: int, max_seqlen: int, which: str) -> None:
    """On the host the prefix sums can be checked for free; on the device that would synchronise."""
    name = f"cu_seqlens_{which}"
    cu = np.asarray(cu)
    lengths = np.diff(cu)
    if cu[0] != 0 or np.any(lengths < 0):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal {which}.shape[0] (total_{which}) = {total}, got {int(cu[-1])}")
    if lengths.size and int(lengths.max()) > max_seqlen:
        raise ValueError(f"max_seqlen_{which} = {max_seqlen} is below the longest sequence, {int(lengths.max())}")


def _host_result(result, q, out, return_lse):
    """Cast the float64 reference to q's dtype (and into ``out`` when given)."""
    out_f64, lse_f64 = result
    if out is not None:
        out[...] = out_f64.astype(out.dtype)
        value = out
    else:
        value = out_f64.astype(q.dtype)
    return (value, lse_f64.astype(np.float32)) if return_lse else value


def _launch_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, batch, seqlen_q, seqlen_k,
                causal, scale, window, softcap, stream, tile: FwdTile | None = None):
    """Launch flash_fwd_kernel on 4-D views q, k, v, out [B, S, H, D] and lse [B, H, S] (or None)."""
    head_dim = int(q.shape[3])
    num_heads, num_kv_heads = int(q.shape[2]), int(k.shape[2])
    _masks.check_total_length(seqlen_q, seqlen_k)
    if seqlen_q == 0 or batch == 0 or num_heads == 0:
        return
    tile = fwd_tile(head_dim, _jit.target_arch()) if tile is None else tile
    spec = fwd_spec(np.dtype(q.dtype), head_dim, tile)
    score_scale, softcap_out = _masks.score_scalars(scale, softcap, head_dim)
    left, right = _masks.window_bounds(causal, window, seqlen_q + seqlen_k + tile.block_m)

    qs, ks, vs, os_ = (list(_arrays.element_strides(x)) for x in (q, k, v, out))
    lse_strides = [lse.strides[0] // 4, lse.strides[1] // 4] if lse is not None else [0, 0]
    if cu_seqlens_q is not None:
        # packed rows: a sequence starts at its cu_seqlens offset, not at b * batch_stride
        for strides in (qs, ks, vs, os_, lse_strides):
            strides[0] = 0
    bh = batch * num_heads
    grid_yz = _split_grid(bh)
    grid = ((seqlen_q + tile.block_m - 1) // tile.block_m, *grid_yz)
    i64, i32, f32 = np.int64, np.int32, np.float32
    null = np.uint64(0)
    args = (
        q, k, v, out, lse if lse is not None else null,
        cu_seqlens_q if cu_seqlens_q is not None else null,
        cu_seqlens_k if cu_seqlens_k is not None else null,
        i64(qs[0]), i64(qs[1]), i64(qs[2]),
        i64(ks[0]), i64(ks[1]), i64(ks[2]),
        i64(vs[0]), i64(vs[1]), i64(vs[2]),
        i64(os_[0]), i64(os_[1]), i64(os_[2]),
        i64(lse_strides[0]), i64(lse_strides[1]),
        i32(batch), i32(num_heads), i32(num_kv_heads), i32(seqlen_q), i32(seqlen_k),
        f32(score_scale), f32(softcap_out), i32(left), i32(right),
    )
    _jit.launch(spec, grid, args, stream=stream)


# grid.y and grid.z are limited to 65535 each; B * H beyond that folds into grid.z.
GRID_YZ_LIMIT = 65535


def _split_grid(count: int) -> tuple[int, int]:
    y = min(count, GRID_YZ_LIMIT)
    return y, (count + y - 1) // y
