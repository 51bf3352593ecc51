"""FP8 (float8 e4m3): scales and quantisation of KV caches and of the FP8 forward's q, k, v.

An e4m3 cache stores each key and value in one byte (4 exponent bits, 3 mantissa bits, largest
value 448) with a float32 descale per tensor or per kv head: real value = stored x scale.
``decode`` and ``paged_attention`` read such caches directly (half the bytes of fp16/bf16) and
widen them to fp16 in registers (a bf16 q is converted to fp16 once); ``PagedKVCache(...,
dtype=float8_e4m3fn)`` quantises in
its write kernel. This module makes the scales and quantises whole arrays (a contiguous cache):

    fp8_scales(x, per_head=False)   amax / 448: a float32 scalar array, or (H,) over x's axis -2
    quantize_fp8(x, scale)          round-to-nearest-even(x / scale), saturated to +-448
    quantize_qkv(q, k, v, granularity="tensor", incoherent=False, seed=0)
                                    q, k, v (B, S, H, D) for attention(..., q_scale, k_scale,
                                    v_scale): per-tensor, per-head or block scales, and optionally
                                    incoherent processing (a random-sign Hadamard rotation of the
                                    head dim applied to q and k, which leaves q k^T unchanged and
                                    spreads outliers over the head dim before rounding)
    hadamard_rotate(x, signs)       x diag(signs) H / sqrt(D), the fast Walsh-Hadamard transform

Layouts: ``x`` is ``(..., H, D)`` (a cache ``(B, S, Hk, D)``, pages ``(num_blocks, block_size,
Hk, D)``, new tokens ``(N, Hk, D)``). On the GPU the quantised array is CuPy uint8 (CuPy has no
float8 type) or torch.float8_e4m3fn; NumPy arrays give ml_dtypes.float8_e4m3fn.
"""

from __future__ import annotations

import math

import numpy as np

from . import _arrays, _jit, _params, paged

GRANULARITIES = ("tensor", "head", "block")


def fp8_scales(x, *, per_head: bool = False):
    """The descale that maps ``x``'s largest magnitude to 448 (the background's s = 448 / amax,
    inverted): amax / 448, float32, of shape ``()`` or, with ``per_head``, ``(H,)`` (amax over
    every axis but -2). An all-zero (or empty) tensor (or head) gets scale 1; NaN or inf in x
    gives a NaN or inf scale (which no descale check accepts). Returns an array of x's framework."""
    if not isinstance(per_head, (bool, np.bool_)):
        raise TypeError(f"per_head must be a bool, got {per_head!r}")
    with _arrays.array_context(x=x) as ctx:
        xv = ctx.view(x)
        if xv.ndim < 2:
            raise ValueError(f"x must be (..., H, D) with at least 2 axes, got shape {tuple(xv.shape)}")
        (_arrays.check_host_float_dtype if ctx.on_host else _check_device_float)("x", xv)
        xp = np if ctx.on_host else __import__("cupy")
        axes = tuple(a for a in range(xv.ndim) if a != xv.ndim - 2) if per_head else None
        if xv.size:
            amax = xp.abs(xv.astype(xp.float32)).max(axis=axes)
        else:  # nothing to scale: the all-zero answer
            amax = xp.zeros((int(xv.shape[-2]),) if per_head else (), xp.float32)
        return _float32_to_caller(_amax_scale(amax, xp), ctx)


def quantize_fp8(x, scale):
    """``x`` ``(..., H, D)`` (fp16, bf16 or fp32) as e4m3 with descale ``scale`` (a float, or a
    float32 array ``()``, ``(1,)`` or ``(H,)``): round-to-nearest-even(x / scale) saturated to
    +-448, the rule of ``PagedKVCache.write``. Runs the cache write kernel on the GPU."""
    if scale is None:
        raise TypeError("scale must be a float or a float32 array of shape (), (1,) or (H,), got None "
                        "(cuattn.fp8_scales(x) computes one)")
    with _arrays.array_context(x=x, **({"scale": scale} if _arrays.is_array(scale) else {})) as ctx:
        xv = ctx.view(x)
        if xv.ndim < 2:
            raise ValueError(f"x must be (..., H, D) with at least 2 axes, got shape {tuple(xv.shape)}")
        heads, head_dim = int(xv.shape[-2]), int(xv.shape[-1])
        sv = ctx.view(scale) if _arrays.is_array(scale) else scale
        checked = _arrays.check_kv_scale("scale", sv, True, heads, ctx.on_host, "x", xv)
        _check_write_rows("x.shape[-1] (D)", head_dim)
        if ctx.on_host:
            _arrays.check_host_float_dtype("x", xv)
            return paged.quantize_e4m3(np.asarray(xv), checked.per_head(heads))
        if np.dtype(xv.dtype) not in paged.QUANTIZED_WRITE_TYPES:
            raise TypeError(f"x.dtype is {_arrays.dtype_name(xv.dtype)}; quantize_fp8 takes float16, bfloat16 or "
                            "float32")
        out = _quantize_on_device(xv, checked, heads, head_dim, ctx.stream)
        if ctx.kind == "torch":
            import torch

            return torch.from_dlpack(out).view(torch.float8_e4m3fn)
        return ctx.to_caller(out)


def _check_write_rows(label: str, head_dim: int) -> None:
    """The write kernel stores whole 16-byte chunks of a row: the host path takes the rows it takes."""
    if head_dim % _params.constant("kCopyBytes"):
        raise ValueError(f"{label} must be a multiple of {_params.constant('kCopyBytes')} (the write kernel stores "
                         f"16 bytes at a time), got {head_dim}")


def _check_device_float(name, x) -> None:
    if np.dtype(x.dtype) not in paged.QUANTIZED_WRITE_TYPES:
        raise TypeError(f"{name}.dtype is {_arrays.dtype_name(x.dtype)}; expected float16, bfloat16 or float32")


def _quantize_on_device(x, scale: _arrays.KvScale, heads: int, head_dim: int, stream):
    """The cache write kernel with no slot ids: token n of x [N, H, D] into slot n of one page [N, H, D]."""
    import cupy

    tokens = x.reshape(-1, heads, head_dim)
    if tokens.size and (tokens.strides[-1] != tokens.itemsize or tokens.data.ptr % _arrays.VECTOR_BYTES):
        tokens = cupy.ascontiguousarray(tokens)
    out = cupy.empty(x.shape, _arrays.E4M3_STORAGE)
    num_tokens = int(tokens.shape[0])
    if num_tokens == 0:
        return out
    # the kernel divides by scale[h]: one float32 per head on the device
    per_head = scale.factor * (cupy.asarray(scale.array, cupy.float32).reshape(-1)[
        np.arange(heads) * scale.stride] if scale.array is not None else cupy.ones(heads, cupy.float32))
    per_head = cupy.ascontiguousarray(per_head, cupy.float32)
    pages = out.reshape(1, num_tokens, heads, head_dim)
    ts, ps = _arrays.element_strides(tokens), _arrays.element_strides(pages)
    params = _params.pack(
        "CacheParams", k=tokens, v=tokens, slot_ids=None, slot_ids_wide=None, pairs=None, k_pages=pages,
        v_pages=pages, k_scale=per_head, v_scale=per_head, k_sn=ts[0], k_sh=ts[1], v_sn=ts[0], v_sh=ts[1],
        kp_sp=ps[0], kp_ss=ps[1], kp_sh=ps[2], vp_sp=ps[0], vp_ss=ps[1], vp_sh=ps[2],
        num_tokens=num_tokens, num_kv_heads=heads, head_dim=head_dim, head_dim_v=head_dim, block_size=num_tokens,
        num_blocks=1,
    )
    spec = paged.cache_spec("cache_write_kernel", _arrays.FLOAT8_E4M3, x.dtype)
    chunks = num_tokens * heads * head_dim // _params.constant("kCopyBytes")
    grid = (math.ceil(chunks / _params.constant("kCacheThreads")), 1, 1)
    _jit.prepare(spec, grid, params).run(_jit.stream_ptr(stream))
    return out


def random_signs(head_dim: int, seed: int = 0) -> np.ndarray:
    """float32 (D,) of +-1, the sign flips of incoherent processing (the same for q and k)."""
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), head_dim)


def _fwht(x, xp):
    """Unnormalised Walsh-Hadamard transform of the last axis (a power of two): log2(D) passes of
    sums and differences of the pairs (i, i + h) in each block of 2 h, on the array's device."""
    d = int(x.shape[-1])
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.reshape(-1, d // (2 * h), 2, h)
        y = xp.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), axis=2)
        h *= 2
    return y.reshape(x.shape)


def hadamard_rotate(x, signs):
    """``x`` (..., D) times diag(signs) H / sqrt(D) (H the Sylvester Hadamard matrix, D a power of
    two), in float32: an orthogonal map, so rotating q and k by it leaves q k^T unchanged (rotate a
    decode step's q by the signs its cache's keys were rotated with). ``x`` of any framework
    (fp16, bf16, fp32; float64 too on the CPU path); ``signs`` (D,) of +-1, a NumPy array or list,
    or an array of x's framework (:func:`random_signs` draws them). Returns a float32 array of x's
    framework."""
    named = {"x": x}
    if _arrays.is_array(signs) and not isinstance(signs, np.ndarray):
        named["signs"] = signs  # on x's device, in x's framework
    with _arrays.array_context(**named) as ctx:
        xv = ctx.view(x)
        if xv.ndim < 1:
            raise ValueError(f"x must be (..., D) with at least 1 axis, got shape {tuple(xv.shape)}")
        (_arrays.check_host_float_dtype if ctx.on_host else _check_device_float)("x", xv)
        sv = ctx.view(signs) if "signs" in named else np.asarray(signs)
        d = int(xv.shape[-1])
        if tuple(sv.shape) != (d,):
            raise ValueError(f"signs must have shape (D,) = ({d},) (x.shape[-1]), got {tuple(sv.shape)}")
        xp = np if ctx.on_host else __import__("cupy")
        return _float32_to_caller(_rotate(xv, sv, xp), ctx)


def _rotate(x, signs, xp):
    """hadamard_rotate on checked arrays of one module (NumPy or CuPy)."""
    d = int(x.shape[-1])
    if d & (d - 1) or d == 0:
        raise ValueError(f"x.shape[-1] (D) must be a power of two for the Hadamard rotation, got {d}")
    signed = x.astype(xp.float32) * xp.asarray(signs, xp.float32)
    return _fwht(signed, xp) * np.float32(1.0 / math.sqrt(d))


def _amax_scale(amax, xp):
    """amax / 448 in float32: 1 where amax is 0 (an all-zero tensor, head or block); NaN or inf
    in x stays NaN or inf in its scale, so that it shows rather than quantising the rest at 1."""
    return xp.where(amax == 0, np.float32(1), amax / np.float32(_arrays.E4M3_MAX)).astype(np.float32)


def _scales_and_ratio(x, granularity: str, block_rows: int, xp):
    """The descales of x (B, S, H, D) float32 and x / scale (per element) for one granularity."""
    b, s, h, d = map(int, x.shape)
    a = xp.abs(x)
    if granularity == "tensor":
        scale = _amax_scale(a.max(), xp)
        return scale, x / scale
    if granularity == "head":
        scale = _amax_scale(a.max(axis=(0, 1, 3)), xp)
        return scale, x / scale[:, None]
    blocks = -(-s // block_rows)
    padded = xp.zeros((b, blocks * block_rows, h, d), xp.float32)
    padded[:, :s] = a
    amax = padded.reshape(b, blocks, block_rows, h, d).max(axis=(2, 4))  # (B, blocks, H)
    scale = xp.ascontiguousarray(_amax_scale(amax, xp).transpose(0, 2, 1))  # (B, H, blocks)
    per_row = scale[:, :, xp.arange(s) // block_rows].transpose(0, 2, 1)  # (B, S, H)
    return scale, x / per_row[..., None]


def quantize_qkv(q, k, v, *, granularity: str = "tensor", incoherent: bool = False, seed: int = 0):
    """q, k, v ``(B, S, H, D)`` (fp16, bf16 or fp32) as e4m3 with descales, the inputs of
    ``attention(q8, k8, v8, q_scale=..., k_scale=..., v_scale=...)``. Returns
    ``(q8, k8, v8, q_scale, k_scale, v_scale)``, the scales float32 arrays of the same framework.

    granularity: ``"tensor"`` (one scale each, shape ()), ``"head"`` ((H,) per head of each
        tensor) or ``"block"`` (q: one scale per 64 rows, k: per 128 keys, of each sequence and
        head, shape (B, H, ceil(S / rows)), the blocks the FP8 kernel reads them in; v per head:
        its scale multiplies the output, so it cannot vary along the keys).
    incoherent: rotate q and k by the same random-sign Hadamard matrix of the head dim (seeded
        by ``seed``) before quantising: q k^T is unchanged, and an outlier channel is spread over
        all D channels, so a per-block amax no longer wastes the e4m3 range on it (QuaRot,
        FlashAttention-3). D must be a power of two.
    Each scale is amax / 448 of what it covers (1 where that is all zero; NaN or inf there gives a
    NaN or inf scale, as :func:`fp8_scales`); the values are round-to-nearest-even(x / scale)
    saturated to +-448, as :func:`quantize_fp8`. D must be a multiple of 16 (the write kernel's
    rows), q and k of one D, k and v of one batch, length and head count.
    """
    if granularity not in GRANULARITIES:
        error = ValueError if isinstance(granularity, str) else TypeError
        raise error(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if not isinstance(incoherent, (bool, np.bool_)):
        raise TypeError(f"incoherent must be a bool, got {incoherent!r}")
    seed = _arrays.check_int("seed", seed, 0)
    from .attention import fp8_block_rows

    with _arrays.array_context(q=q, k=k, v=v) as ctx:
        views = {name: ctx.view(x) for name, x in (("q", q), ("k", k), ("v", v))}
        for name, x in views.items():
            _arrays.check_ndim(name, x, "(B, S, H, D)")
            (_arrays.check_host_float_dtype if ctx.on_host else _check_device_float)(name, x)
            _check_write_rows(f"{name}.shape[3] (D)", int(x.shape[-1]))
        _check_qkv_shapes(**views)
        xp = np if ctx.on_host else __import__("cupy")
        q_rows, k_rows = fp8_block_rows()
        signs = random_signs(int(views["q"].shape[-1]), seed) if incoherent else None
        results, scales = [], []
        for name, rows in (("q", q_rows), ("k", k_rows), ("v", k_rows)):
            x = views[name].astype(xp.float32)
            if signs is not None and name != "v":
                x = _rotate(x, signs, xp)
            level = "head" if name == "v" and granularity == "block" else granularity
            scale, ratio = _scales_and_ratio(x, level, rows, xp)
            scales.append(scale)
            results.append(_quantize_ratio(xp.ascontiguousarray(ratio, xp.float32), ctx))
        return (*results, *(_float32_to_caller(sc, ctx) for sc in scales))


def _check_qkv_shapes(q, k, v) -> None:
    """q (B, Sq, Hq, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv): one batch, k and v one sequence of
    keys, q and k one head dim (the rotation's signs and the scores'), as attention takes them."""
    _arrays.check_axis("k", k, 0, "B", int(q.shape[0]), "q.shape[0]")
    _arrays.check_axis("k", k, 3, "D", int(q.shape[3]), "q.shape[3]")
    for axis, axis_name in ((0, "B"), (1, "Sk"), (2, "Hk")):
        _arrays.check_axis("v", v, axis, axis_name, int(k.shape[axis]), f"k.shape[{axis}]")


def _quantize_ratio(ratio, ctx):
    """e4m3 of values already divided by their scale (the write kernel's rounding, scale 1)."""
    heads, head_dim = int(ratio.shape[-2]), int(ratio.shape[-1])
    if ctx.on_host:
        return paged.quantize_e4m3(ratio, np.ones(heads, np.float32))
    out = _quantize_on_device(ratio, _arrays.KvScale(1.0), heads, head_dim, ctx.stream)
    if ctx.kind == "torch":
        import torch

        return torch.from_dlpack(out).view(torch.float8_e4m3fn)
    return ctx.to_caller(out)


def _float32_to_caller(x, ctx):
    """A float32 result (NumPy or CuPy) in the caller's framework, in memory of its allocator."""
    if ctx.on_host:
        return np.asarray(x, np.float32)
    out = ctx.empty(x.shape, np.float32)
    out[...] = x
    return ctx.to_caller(out)
