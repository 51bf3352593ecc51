"""JAX front end: cuattn's attention inside ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

    import cuattn.jax
    out = cuattn.jax.attention(q, k, v, causal=True)   # q (B, Sq, Hq, D), k, v (B, Sk, Hk, D)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)

The plain functions (``cuattn.attention`` and the rest) take concrete arrays through DLPack, so a
traced array has nothing to hand them. Here every call becomes an XLA custom call:

* on a CUDA GPU, ``jax.experimental.buffer_callback``: XLA hands the callback its device
  buffers and its CUDA stream; the kernels are launched on that stream and write the results
  straight into the output buffers XLA allocated (no host synchronisation, no copy); a repeated
  forward callback only writes the buffers' addresses into its prepared launch;
* on the CPU, ``jax.pure_callback`` runs the float64 reference (``cuattn.reference``), so code
  written against this module is tested without a GPU.

``jax.lax.platform_dependent`` stages out both and keeps the one of the platform the
computation is lowered for. The arguments, layouts and semantics are those of the plain
functions (README, "Attention"); inputs are float16 or bfloat16 on every platform, so that what
runs on the CPU runs on the GPU:

    attention         q (B, Sq, Hq, D)   k, v (B, Sk, Hk, D)        out (B, Sq, Hq, D)   lse (B, Hq, Sq)
    attention_varlen  q (total_q, Hq, D) k, v (total_k, Hk, D)      out (total_q, Hq, D) lse (Hq, total_q)
                      cu_seqlens_q, cu_seqlens_k int32 (B + 1,)
                      (both: v and out may have their own head dim Dv, (..., Dv))
    decode            q (B, Sq_new, Hq, D) k_cache, v_cache (B, S_max, Hk, D)  cache_seqlens int32 (B,)
    paged_attention   q (B, Sq_new, Hq, D) k_pages, v_pages (num_blocks, block_size, Hk, D)
                      block_table int32 (B, max_blocks)  seq_lens int32 (B,)

    ring_attention    q (B, S_local, Hq, D) k, v (B, S_local, Hk, D)  one shard per device of a
                      jax.shard_map mesh axis (zigzag shards when causal), differentiable

XLA's buffers are dense and row-major, whatever the layout of the arrays the caller traced.

``attention`` and ``attention_varlen`` are differentiable (``jax.custom_vjp``): the forward
saves ``out`` and ``lse`` and the backward runs cuattn's backward kernels from them (the
reference backward on the CPU). Gradients flow through ``out`` only: the ``lse`` that
``return_lse=True`` returns is wrapped in ``jax.lax.stop_gradient``. ``decode`` and
``paged_attention`` are forward-only; differentiating them raises. Options (``causal``,
``scale``, ``window``, ``softcap``, ``max_seqlen_*``, ``num_splits``, ...) are Python values
fixed when the function is traced.

``jax.vmap`` over any number of extra leading axes works: for ``attention`` (forward and
backward) and ``decode`` the vmapped axes are moved in front, unbatched operands broadcast, and
the callback folds them into the batch axis B, so one launch serves the whole batch. For
``attention_varlen`` and ``paged_attention``, whose prefix sums and block tables index one
problem each, XLA loops over the vmapped axis (one launch per element).

The backward's workspace (a float32 dQ accumulator and ``delta``) comes from CuPy's memory pool
on XLA's stream, beside XLA's own pool: run with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a lower ``XLA_PYTHON_CLIENT_MEM_FRACTION``) so that
memory is left for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _arrays, _masks, reference
from .attention import (_check_host_cu_seqlens, _check_qkv, _launch_bwd, _launch_fwd,
                        check_prefix_sums)
from .decode import _check_num_splits, check_decode_args, launch_decode, planned_length
from .paged import MAX_BLOCK_SIZE, check_table, clamp_table

__all__ = ["attention", "attention_varlen", "decode", "paged_attention", "ring_attention"]

# How the callbacks meet jax.vmap (jax.pure_callback's vmap_method): "broadcast_all" moves every
# vmapped axis in front and broadcasts unbatched operands, so the callback sees extra leading
# axes that fold into the batch axis; "sequential" loops, for calls whose index arrays (prefix
# sums, block tables) address one problem each.
FOLD_VMAPPED_AXES = "broadcast_all"
LOOP_OVER_VMAPPED_AXES = "sequential"

# Ranks of the unbatched operands, what the callbacks fold vmapped axes down to: (B, S, H, D)
# arrays and their (B, H, S) lse; packed (total, H, D) arrays and their (H, total) lse; (B,)
# lengths and (B + 1,) prefix sums; (B, max_blocks) block tables.
_DENSE, _LSE = 4, 3
_PACKED, _PACKED_LSE = 3, 2
_VECTOR, _TABLE = 1, 2

# The optional per-head arrays every function takes after its own: attention-sink logits (Hq,)
# and ALiBi slopes (Hq,) or (B, Hq), as in the plain functions. A call passes those given, in
# this order, after its arrays, and names them in _Mask.extras, so that each callback knows its
# trailing buffers; calls with any run once per vmapped element (one row of them per call).
EXTRAS = ("sinks", "alibi_slopes")
# the integer arrays the functions take (int32 in the kernels)
INT32_ARGUMENTS = ("cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table", "seq_lens")


# ---------------------------------------------------------------------------------------------
# Options and argument checks (at trace time, on shapes and dtypes: the same on every platform)


@dataclasses.dataclass(frozen=True)
class _Mask:
    """The mask and score options every call takes, checked and hashable (a static argument)."""

    causal: bool
    scale: float | None
    window: tuple[int, int]
    softcap: float
    extras: tuple[str, ...] = ()  # the EXTRAS the call was given, in order

    def kwargs(self) -> dict:
        return {"causal": self.causal, "scale": self.scale, "window": self.window, "softcap": self.softcap}

    def vmap_method(self) -> str:
        """Without extras every operand folds its vmapped axes into the batch; with them XLA
        loops over the vmapped axes (one launch per element)."""
        return LOOP_OVER_VMAPPED_AXES if self.extras else FOLD_VMAPPED_AXES


def _check_static(name: str, value) -> None:
    """Options choose the kernel and its launch when the function is traced, so they must be Python values."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, jax.core.Tracer) for v in values):
        raise TypeError(
            f"{name} must be a Python value, got a traced array: cuattn.jax fixes its options when the "
            f"function is traced (under jax.jit, pass {name} through static_argnames or close over it)"
        )


def _mask_options(causal, scale, window, softcap, extras=(), **flags) -> _Mask:
    for name, value in (("causal", causal), ("scale", scale), ("window", window), ("softcap", softcap),
                        *flags.items()):
        _check_static(name, value)
    left, right = _masks.check_options(window, softcap, scale, causal=causal, **flags)
    return _Mask(bool(causal), None if scale is None else float(scale), (left, right), float(softcap), tuple(extras))


def _extra_names(sinks, alibi_slopes) -> tuple[str, ...]:
    """The EXTRAS a call was given (None: left out), in order."""
    return tuple(name for name, x in zip(EXTRAS, (sinks, alibi_slopes)) if x is not None)


def _extras(batch: int, num_heads: int, sinks, alibi_slopes) -> tuple:
    """The EXTRAS given as checked JAX arrays: float32 sinks ``(Hq,)``, float32 slopes ``(Hq,)``
    or ``(B, Hq)`` (``batch``: the sequences), on every platform."""
    named = {name: x for name, x in zip(EXTRAS, (sinks, alibi_slopes)) if x is not None}
    arrays = _as_arrays(**named)
    for name, x in zip(named, arrays):
        if name == "sinks":
            _arrays.check_sinks(x, num_heads, True, "q", None)
        else:
            _arrays.check_alibi_slopes(x, batch, num_heads, True, "q", None)
    return tuple(arrays)


def _host_extras(mask: _Mask, extras) -> dict:
    """A host callback's extras by the reference functions' keywords."""
    return {name: np.asarray(x) for name, x in zip(mask.extras, extras)}


def _extra_ranks(extras) -> tuple:
    """Ranks of the extras' buffers: unbatched (their calls loop over vmapped axes)."""
    return tuple(len(x.shape) for x in extras)


def _device_extras(mask: _Mask, views, batch: int, q) -> dict:
    """A device callback's extras as launch arguments: ``sinks`` and ``alibi`` (the slopes and
    their batch stride, as _launch_fwd, _launch_bwd and launch_decode take them)."""
    named = dict(zip(mask.extras, views))
    slopes = named.get("alibi_slopes")
    stride = 0 if slopes is None else _arrays.check_alibi_slopes(slopes, batch, int(q.shape[-2]), False, "q", q)
    return {"sinks": named.get("sinks"), "alibi": (slopes, stride)}


def _as_arrays(**named) -> list:
    """JAX arrays (or tracers) of the array arguments; NumPy arrays are taken as constants, refused
    where JAX would change their dtype (without jax_enable_x64 it narrows int64 and float64 to 32
    bits, and a length of 2**32 + 1 would run as 1)."""
    arrays = []
    for name, x in named.items():
        # (a torch or CuPy array has a shape and a dtype too, but NumPy cannot read torch's dtypes)
        if not hasattr(x, "shape") or not hasattr(x, "dtype") or (
                _arrays.is_array(x) and _arrays.array_kind(x, name) in ("torch", "cupy")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__module__}.{type(x).__name__}")
        converted = jnp.asarray(x)
        if np.dtype(converted.dtype) != np.dtype(x.dtype):
            wanted = _wanted_dtype(name)
            raise TypeError(f"{name}.dtype is {_arrays.dtype_name(x.dtype)}, which JAX would turn into "
                            f"{_arrays.dtype_name(converted.dtype)}; pass {wanted} (the kernels' type)")
        arrays.append(converted)
    return arrays


def _wanted_dtype(name: str) -> str:
    """The dtype the kernels take argument ``name`` in, for _as_arrays' error: float32 for the EXTRAS,
    int32 for the lengths, prefix sums and block tables, float16 or bfloat16 for the tensors."""
    if name in EXTRAS:
        return "float32"
    if name in INT32_ARGUMENTS:
        return "int32"
    return "float16 or bfloat16"


def _concrete_on_cpu(*arrays) -> bool:
    """Whether the arrays hold values on the CPU now (not traced, no device to sync with): then an
    eager call can check their values before dispatch rather than inside the callback."""
    return all(not isinstance(x, jax.core.Tracer) and all(d.platform == "cpu" for d in x.devices()) for x in arrays)


def _check_dtypes(named: dict) -> None:
    """float16 or bfloat16, one dtype for all: the kernels' types, required on the CPU too."""
    (ref_name, ref), *rest = named.items()
    dtype = np.dtype(ref.dtype)
    if dtype not in _arrays.CUDA_TYPES:
        raise TypeError(
            f"{ref_name}.dtype is {_arrays.dtype_name(dtype)}; cuattn.jax takes float16 or bfloat16 on every "
            f"platform (the CPU path too, so that it runs what the GPU runs): cast with "
            f"{ref_name}.astype(jnp.bfloat16)"
        )
    for name, x in rest:
        _arrays.check_same_dtype(name, x, ref_name, ref)


def _check_length(name: str, value, minimum: int) -> int:
    _check_static(name, value)
    return _arrays.check_int(name, value, minimum)


def _lse_shape(out_shape) -> tuple:
    """lse of an out ``(..., S, H, D)``: ``(..., H, S)``."""
    return (*out_shape[:-3], out_shape[-2], out_shape[-3])


def _result_shapes(q, v=None) -> tuple:
    """out in q's shape (with v's head dim last when ``v`` is given) and dtype, lse in float32."""
    out_shape = q.shape if v is None else reference.out_shape(q, v)
    return jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(_lse_shape(q.shape), jnp.float32)


# ---------------------------------------------------------------------------------------------
# Platforms: one branch per platform, the callbacks behind them


def _per_platform(args, host, device):
    """``host(*args)`` where the computation runs on the CPU, ``device(*args)`` on a CUDA GPU."""
    return jax.lax.platform_dependent(*args, cpu=host, cuda=device)


def _host_call(callback, result_shapes, vmap_method):
    return lambda *args: jax.pure_callback(callback, result_shapes, *args, vmap_method=vmap_method)


def _device_call(callback, result_shapes, vmap_method, graph_safe: bool):
    """A buffer callback. ``graph_safe``: the callback only launches kernels on XLA's stream into
    XLA's buffers (no allocation, nothing read on the host), so XLA may record it once into a
    command buffer (a CUDA graph) and replay it."""

    def call(*args):
        from jax.experimental.buffer_callback import buffer_callback

        return buffer_callback(callback, result_shapes, vmap_method=vmap_method,
                               command_buffer_compatible=graph_safe)(*args)

    return call


def _fold(x, rank: int):
    """``x`` with the leading axes beyond an unbatched ``rank`` (vmap's, put in front by
    "broadcast_all") folded into its first axis: a view, since the buffers are contiguous."""
    lead = math.prod(x.shape[:x.ndim - rank + 1])
    return x.reshape((lead, *x.shape[x.ndim - rank + 1:]))


def _host_arrays(arrays, ranks):
    return [_fold(np.asarray(x), rank) for x, rank in zip(arrays, ranks)]


def _device_array(buffer):
    """A zero-copy CuPy view of one of XLA's buffers (dense, row-major).

    The address comes from ``__cuda_array_interface__`` and the dtype and shape from the buffer
    itself, since the interface spells bfloat16 as two raw bytes ("<V2"). A JAX whose buffers
    lack the interface for a dtype still exports it through DLPack, which names bfloat16."""
    import cupy

    try:
        address = int(buffer.__cuda_array_interface__["data"][0])
    except Exception:  # jaxlib raises its own runtime error type for an unsupported dtype
        return cupy.from_dlpack(buffer)
    dtype, shape = np.dtype(buffer.dtype), tuple(int(n) for n in buffer.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return cupy.empty(shape, dtype)  # XLA may give an empty buffer no address
    # the device is read from the address's attributes, as cupy.asarray does
    memory = cupy.cuda.UnownedMemory(address, nbytes, buffer)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


@contextlib.contextmanager
def _xla_stream(ctx, buffers, ranks):
    """CuPy views of XLA's buffers (zero-copy, vmapped axes folded) with XLA's stream current on
    their device: what the kernels launch on, ordered with the rest of the XLA program."""
    import cupy

    views = [_fold(_device_array(b), rank) for b, rank in zip(buffers, ranks)]
    device = views[0].device.id
    stream = _arrays.external_stream(_stream_handle(ctx), device)
    with cupy.cuda.Device(device), stream:
        yield stream, views


def _check_layouts(named: dict) -> None:
    """XLA's buffers are dense; what is left to check is the kernels' 16-byte row alignment."""
    for name, x in named.items():
        _arrays.check_kernel_layout(name, x)


def _forward_only(name: str, fn, *arrays):
    """``fn(*arrays)``, refusing differentiation with a message that names the function and why."""

    @jax.custom_jvp
    def call(*arrays):
        return fn(*arrays)

    @call.defjvp
    def _refuse(primals, tangents):
        raise TypeError(f"cuattn.jax.{name} is forward-only (no backward kernels); "
                        "differentiate through cuattn.jax.attention instead")

    return call(*arrays)


# ---------------------------------------------------------------------------------------------
# attention: forward and backward


def _host_attention(mask: _Mask, q, k, v, *extras):
    qf, kf, vf = _host_arrays((q, k, v), (_DENSE,) * 3)
    out, lse = reference.attention(qf, kf, vf, return_lse=True, **_host_extras(mask, extras), **mask.kwargs())
    return out.astype(q.dtype).reshape(reference.out_shape(q, v)), lse.astype(np.float32).reshape(_lse_shape(q.shape))


# Forward launches already prepared, by (mask, the five buffers' shapes and dtypes, device): a
# repeated callback only writes the buffers' addresses into the launch and launches on XLA's
# stream. Under jit the callback runs on XLA's thread while the GPU waits for it, so its host
# time is not hidden behind earlier kernels as an eager call's is.
_FWD_LAUNCHES: dict = {}
_FWD_FIELDS = ("q", "k", "v", "out", "lse")  # then the extras, each its own field


def _buffer_address(buffer) -> int | None:
    """The device address of one of XLA's buffers, or None where the fast path should not guess."""
    try:
        return int(buffer.__cuda_array_interface__["data"][0])
    except Exception:  # no interface for this dtype in this JAX: the full path takes DLPack
        return None


def _stream_handle(ctx) -> int:
    # a property in current JAX (0.10, 0.11); early buffer_callback versions had a method
    return int(ctx.stream() if callable(ctx.stream) else ctx.stream)


def _device_attention(mask: _Mask, ctx, outs, q, k, v, *extras):
    import cupy

    buffers = (q, k, v, *outs, *extras)
    addresses = [_buffer_address(b) for b in buffers]
    known = None not in addresses and all(a % _arrays.VECTOR_BYTES == 0 for a in addresses[:4])
    if known:
        device = cupy.cuda.runtime.pointerGetAttributes(addresses[0]).device
        call_key = (mask, device, *((tuple(b.shape), str(b.dtype)) for b in buffers))
        launch = _FWD_LAUNCHES.get(call_key)
        if launch is not None and cupy.cuda.runtime.getDevice() == device:
            fields = _FWD_FIELDS + mask.extras
            launch.run(_stream_handle(ctx), [(launch.slot(f), a) for f, a in zip(fields, addresses)])
            return
    with _xla_stream(ctx, buffers, (_DENSE,) * 4 + (_LSE,) + _extra_ranks(extras)) as (stream, views):
        qv, kv, vv, ov, lv = views[:5]
        _check_layouts({"q": qv, "k": kv, "v": vv, "out": ov})
        batch, seqlen_q = int(qv.shape[0]), int(qv.shape[1])
        # the static tile schedule: XLA may record this callback into a command buffer (stream
        # capture), where the dynamic schedule could not allocate a new stream's counters
        launch = _launch_fwd(qv, kv, vv, ov, lv, None, None, batch=batch, seqlen_q=seqlen_q, schedule="static",
                             seqlen_k=int(kv.shape[1]), stream=stream, **_device_extras(mask, views[5:], batch, qv),
                             **mask.kwargs())
    if known and launch is not None:
        _FWD_LAUNCHES[call_key] = launch


def _attention_forward(q, k, v, extras, mask: _Mask):
    shapes = _result_shapes(q, v)
    method = mask.vmap_method()
    return _per_platform(
        (q, k, v, *extras),
        host=_host_call(functools.partial(_host_attention, mask), shapes, method),
        device=_device_call(functools.partial(_device_attention, mask), shapes, method, graph_safe=True),
    )


def _gradient_shapes(q, k, v, extras, mask: _Mask) -> tuple:
    """What a backward callback returns: dq, dk, dv in q's, k's and v's shapes and dtypes, and
    dsinks with sinks (the slopes get no gradient)."""
    grads_of = (q, k, v) + tuple(x for name, x in zip(mask.extras, extras) if name == "sinks")
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in grads_of)


def _host_gradients(mask: _Mask, grads, like) -> tuple:
    """The reference's float64 gradients as a host callback returns them (_gradient_shapes): dq,
    dk, dv in the (possibly vmapped) shapes and dtypes of ``like``, then float32 dsinks with sinks."""
    cast = tuple(g.astype(x.dtype).reshape(x.shape) for g, x in zip(grads, like))
    return cast + ((grads[3].astype(np.float32),) if "sinks" in mask.extras else ())


def _extra_cotangents(grads, mask: _Mask) -> tuple:
    """The extras' cotangents in mask.extras' order: dsinks for sinks, None (zero) for the slopes."""
    return tuple(grads[3] if name == "sinks" else None for name in mask.extras)


def _host_attention_backward(mask: _Mask, dout, q, k, v, out, lse, *extras):
    arrays = _host_arrays((dout, q, k, v, out, lse), (_DENSE,) * 5 + (_LSE,))
    grads = reference.attention_backward(*arrays, **_host_extras(mask, extras), **mask.kwargs())
    return _host_gradients(mask, grads, (q, k, v))


def _device_backward(mask: _Mask, deterministic: bool, ctx, outs, tensors, prefix_sums, extras, max_seqlens=None):
    """The backward kernels on XLA's buffers ``tensors`` (dout, q, k, v, out, lse), writing the
    gradients straight into ``outs`` (dq, dk, dv, then dsinks with sinks): a dense batch, or
    packed sequences (``prefix_sums`` cu_seqlens_q and cu_seqlens_k, with their ``max_seqlens``)
    launched as one batch of sequences at their offsets, as attention_varlen_backward does."""
    packed = bool(prefix_sums)
    tensor_rank, lse_rank = (_PACKED, _PACKED_LSE) if packed else (_DENSE, _LSE)
    with_sinks = "sinks" in mask.extras
    buffers = (*tensors, *prefix_sums, *extras, *outs)
    ranks = ((tensor_rank,) * 5 + (lse_rank,) + (_VECTOR,) * len(prefix_sums) + _extra_ranks(extras)
             + (tensor_rank,) * 3 + (_VECTOR,) * with_sinks)
    with _xla_stream(ctx, buffers, ranks) as (stream, views):
        dov, qv, kv, vv, ov, lv = views[:6]
        extra_views = views[6 + len(prefix_sums):6 + len(prefix_sums) + len(extras)]
        dq, dk, dv = views[6 + len(prefix_sums) + len(extras):][:3]
        _check_layouts({"dout": dov, "q": qv, "k": kv, "v": vv, "out": ov, "dq": dq, "dk": dk, "dv": dv})
        if packed:
            cuq, cuk = views[6:8]
            batch, (seqlen_q, seqlen_k) = int(cuq.shape[0]) - 1, max_seqlens
            batched = [x[None] for x in (dov, qv, kv, vv, ov, lv, dq, dk, dv)]  # [1, total, H, D]
        else:
            cuq = cuk = None
            batch, seqlen_q, seqlen_k = int(qv.shape[0]), int(qv.shape[1]), int(kv.shape[1])
            batched = [dov, qv, kv, vv, ov, lv, dq, dk, dv]
        # the gradients are written straight into XLA's buffers (dsinks, a small reduction, is
        # copied in; packed rows of no sequence are zeroed first); the workspace (delta, the dQ
        # accumulator) comes from CuPy's pool on XLA's stream
        with _arrays.array_context(q=qv) as arrays:
            grads = _launch_bwd(*batched[:6], cuq, cuk, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                causal=mask.causal, scale=mask.scale, window=mask.window, softcap=mask.softcap,
                                deterministic=deterministic, ctx=arrays, grads=tuple(batched[6:]),
                                **_device_extras(mask, extra_views, batch, qv))
        if with_sinks:
            views[-1][...] = grads[3]


def _device_attention_backward(mask: _Mask, deterministic: bool, ctx, outs, dout, q, k, v, out, lse, *extras):
    _device_backward(mask, deterministic, ctx, outs, (dout, q, k, v, out, lse), (), extras)


def _attention_backward(dout, q, k, v, out, lse, extras, mask: _Mask, deterministic: bool):
    shapes = _gradient_shapes(q, k, v, extras, mask)
    method = mask.vmap_method()
    return _per_platform(
        (dout, q, k, v, out, lse, *extras),
        host=_host_call(functools.partial(_host_attention_backward, mask), shapes, method),
        # the backward allocates its workspace with CuPy: not recordable in a graph
        device=_device_call(functools.partial(_device_attention_backward, mask, deterministic), shapes,
                            method, graph_safe=False),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _differentiable_attention(q, k, v, extras, mask: _Mask, deterministic: bool):
    return _attention_forward(q, k, v, extras, mask)


def _differentiable_attention_fwd(q, k, v, extras, mask: _Mask, deterministic: bool):
    out, lse = _attention_forward(q, k, v, extras, mask)
    return (out, lse), (q, k, v, extras, out, lse)


def _differentiable_attention_bwd(mask: _Mask, deterministic: bool, residuals, cotangents):
    # lse leaves attention() through stop_gradient, so its cotangent is zero
    dout, _ = cotangents
    q, k, v, extras, out, lse = residuals
    grads = _attention_backward(dout.astype(q.dtype), q, k, v, out, lse, extras, mask, deterministic)
    return (*grads[:3], _extra_cotangents(grads, mask))


_differentiable_attention.defvjp(_differentiable_attention_fwd, _differentiable_attention_bwd)

# Every entry point is jitted (inlined under an outer jit): an eager call then lowers for the
# platform its inputs live on, which is where platform_dependent chooses, and is compiled once
# per signature rather than dispatched op by op.
_attention_call = jax.jit(_differentiable_attention, static_argnums=(4, 5))


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None,
              return_lse=False, deterministic=False):
    """Differentiable :func:`cuattn.attention` for JAX arrays, under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

    Args:
        q: ``(B, Sq, Hq, D)`` float16 or bfloat16.
        k, v: ``(B, Sk, Hk, D)``, q's dtype; ``Hq % Hk == 0`` (MHA, GQA, MQA). v may have its own
            head dim Dv, ``(B, Sk, Hk, Dv)``, as in :func:`cuattn.attention`.
        causal, scale, window, softcap: as in :func:`cuattn.attention` (Python values).
        sinks: optional float32 ``(Hq,)`` attention-sink logits, as in :func:`cuattn.attention`;
            differentiable (their gradient is ``dsinks`` of :func:`cuattn.attention_backward`).
        alibi_slopes: optional float32 ``(Hq,)`` or ``(B, Hq)`` ALiBi slopes, as in
            :func:`cuattn.attention`; no gradient. Under ``jax.vmap`` a call with sinks or slopes
            runs once per vmapped element.
        return_lse: also return the float32 log-sum-exp ``(B, Hq, Sq)`` (natural log), through
            ``jax.lax.stop_gradient``: gradients flow through ``out`` only.
        deterministic: a bit-reproducible backward (see :func:`cuattn.attention_backward`).

    Returns:
        ``out`` ``(B, Sq, Hq, Dv)``, or ``(out, lse)``.
    """
    q, k, v = _as_arrays(q=q, k=k, v=v)
    mask = _mask_options(causal, scale, window, softcap, _extra_names(sinks, alibi_slopes), return_lse=return_lse,
                         deterministic=deterministic)
    _check_qkv(q, k, v, packed=False)
    _check_dtypes({"q": q, "k": k, "v": v})
    _masks.check_total_length(int(q.shape[1]), int(k.shape[1]))
    extras = _extras(int(q.shape[0]), int(q.shape[2]), sinks, alibi_slopes)
    out, lse = _attention_call(q, k, v, extras, mask, bool(deterministic))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention_varlen: forward and backward


def _host_varlen(mask: _Mask, max_seqlen_q: int, max_seqlen_k: int, q, k, v, cu_seqlens_q, cu_seqlens_k, *extras):
    q, k, v, cuq, cuk = (np.asarray(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    # the prefix sums' values are known only now: a bad one raises here (an XLA runtime error)
    _check_host_cu_seqlens(cuq, int(q.shape[0]), max_seqlen_q, "q")
    _check_host_cu_seqlens(cuk, int(k.shape[0]), max_seqlen_k, "k")
    out, lse = reference.attention_varlen(q, k, v, cuq, cuk, max_seqlen_q, max_seqlen_k, return_lse=True,
                                          **_host_extras(mask, extras), **mask.kwargs())
    return out.astype(q.dtype), lse.astype(np.float32)


def _device_varlen(mask: _Mask, max_seqlen_q: int, max_seqlen_k: int, ctx, outs, q, k, v, cu_seqlens_q,
                   cu_seqlens_k, *extras):
    # vmap loops here ("sequential"): every buffer is one unbatched problem
    buffers = (q, k, v, cu_seqlens_q, cu_seqlens_k, *outs, *extras)
    ranks = (_PACKED,) * 3 + (_VECTOR,) * 2 + (_PACKED, _PACKED_LSE) + _extra_ranks(extras)
    with _xla_stream(ctx, buffers, ranks) as (stream, views):
        qv, kv, vv, cuq, cuk, ov, lv = views[:7]
        _check_layouts({"q": qv, "k": kv, "v": vv, "out": ov})
        batch = int(cuq.shape[0]) - 1
        _launch_fwd(qv[None], kv[None], vv[None], ov[None], lv[None], cuq, cuk, batch=batch,
                    schedule="static",  # as in _device_attention
                    seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, stream=stream,
                    **_device_extras(mask, views[7:], batch, qv), **mask.kwargs())


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask: _Mask, max_seqlen_q: int, max_seqlen_k: int):
    # out (total_q, Hq, Dv): v's head dim; lse (Hq, total_q)
    shapes = (jax.ShapeDtypeStruct(reference.out_shape(q, v), q.dtype),
              jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32))
    return _per_platform(
        (q, k, v, cu_seqlens_q, cu_seqlens_k, *extras),
        host=_host_call(functools.partial(_host_varlen, mask, max_seqlen_q, max_seqlen_k), shapes,
                        LOOP_OVER_VMAPPED_AXES),
        device=_device_call(functools.partial(_device_varlen, mask, max_seqlen_q, max_seqlen_k), shapes,
                            LOOP_OVER_VMAPPED_AXES, graph_safe=True),
    )


def _host_varlen_backward(mask: _Mask, max_seqlen_q: int, max_seqlen_k: int, dout, q, k, v, out, lse, cu_seqlens_q,
                          cu_seqlens_k, *extras):
    arrays = [np.asarray(x) for x in (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)]
    grads = reference.attention_varlen_backward(*arrays, max_seqlen_q, max_seqlen_k, **_host_extras(mask, extras),
                                                **mask.kwargs())
    # (a sequence without keys gives its queries zero gradients, as on the GPU)
    return _host_gradients(mask, grads, (q, k, v))


def _device_varlen_backward(mask: _Mask, deterministic: bool, max_seqlen_q: int, max_seqlen_k: int, ctx, outs, dout,
                            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *extras):
    # vmap loops here ("sequential"): every buffer is one unbatched problem
    _device_backward(mask, deterministic, ctx, outs, (dout, q, k, v, out, lse), (cu_seqlens_q, cu_seqlens_k), extras,
                     (max_seqlen_q, max_seqlen_k))


def _varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, extras, mask: _Mask, max_seqlen_q: int,
                     max_seqlen_k: int, deterministic: bool):
    shapes = _gradient_shapes(q, k, v, extras, mask)
    lengths = (max_seqlen_q, max_seqlen_k)
    return _per_platform(
        (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *extras),
        host=_host_call(functools.partial(_host_varlen_backward, mask, *lengths), shapes, LOOP_OVER_VMAPPED_AXES),
        # the backward allocates its workspace with CuPy: not recordable in a graph
        device=_device_call(functools.partial(_device_varlen_backward, mask, deterministic, *lengths), shapes,
                            LOOP_OVER_VMAPPED_AXES, graph_safe=False),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _differentiable_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask: _Mask, max_seqlen_q: int,
                           max_seqlen_k: int, deterministic: bool):
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask, max_seqlen_q, max_seqlen_k)


def _differentiable_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask: _Mask, max_seqlen_q: int,
                               max_seqlen_k: int, deterministic: bool):
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask, max_seqlen_q, max_seqlen_k)
    return (out, lse), (q, k, v, cu_seqlens_q, cu_seqlens_k, extras, out, lse)


def _differentiable_varlen_bwd(mask: _Mask, max_seqlen_q: int, max_seqlen_k: int, deterministic: bool, residuals,
                               cotangents):
    # lse leaves attention_varlen() through stop_gradient, so its cotangent is zero
    dout, _ = cotangents
    q, k, v, cu_seqlens_q, cu_seqlens_k, extras, out, lse = residuals
    grads = _varlen_backward(dout.astype(q.dtype), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, extras, mask,
                             max_seqlen_q, max_seqlen_k, deterministic)
    # the prefix sums are integers (None: no cotangent)
    return (*grads[:3], None, None, _extra_cotangents(grads, mask))


_differentiable_varlen.defvjp(_differentiable_varlen_fwd, _differentiable_varlen_bwd)
_varlen_call = jax.jit(_differentiable_varlen, static_argnums=(6, 7, 8, 9))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False,
                     deterministic=False):
    """Differentiable :func:`cuattn.attention_varlen` for JAX arrays: a packed batch of sequences
    of different lengths, ``q`` ``(total_q, Hq, D)``, ``k`` ``(total_k, Hk, D)`` and ``v``
    ``(total_k, Hk, Dv)`` (Dv as in :func:`cuattn.attention`).

    ``cu_seqlens_q``, ``cu_seqlens_k``: int32 ``(B + 1,)`` prefix sums (arrays, may be traced);
    ``max_seqlen_q``, ``max_seqlen_k``: Python ints bounding every sequence's length. On the GPU
    the prefix sums are not read on the host (as with the plain function, rows of no sequence or
    past ``max_seqlen_q`` are left unwritten in ``out``, get zero dq and count in no dsinks, and
    padded rows of the inputs must be finite); on the CPU concrete ones are checked before the
    call (ValueError), traced ones when it runs (inside the callback, an XLA runtime error).
    ``sinks`` (float32 ``(Hq,)``, differentiable) and ``alibi_slopes`` (float32 ``(Hq,)`` or
    ``(B, Hq)``, no gradient) as in :func:`attention`. The backward runs
    :func:`cuattn.attention_varlen_backward`'s kernels (``deterministic`` as there). Returns
    ``out`` ``(total_q, Hq, Dv)``, or ``(out, lse)`` with lse ``(Hq, total_q)`` through
    ``jax.lax.stop_gradient``.
    """
    q, k, v, cu_seqlens_q, cu_seqlens_k = _as_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                                     cu_seqlens_k=cu_seqlens_k)
    mask = _mask_options(causal, scale, window, softcap, _extra_names(sinks, alibi_slopes), return_lse=return_lse,
                         deterministic=deterministic)
    _check_qkv(q, k, v, packed=True)
    _check_dtypes({"q": q, "k": k, "v": v})
    check_prefix_sums(cu_seqlens_q, cu_seqlens_k)
    extras = _extras(int(cu_seqlens_q.shape[0]) - 1, int(q.shape[1]), sinks, alibi_slopes)
    max_seqlen_q = _check_length("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = _check_length("max_seqlen_k", max_seqlen_k, 0)
    _masks.check_total_length(max_seqlen_q, max_seqlen_k, "max_seqlen_q + max_seqlen_k")
    if _concrete_on_cpu(cu_seqlens_q, cu_seqlens_k):
        # values known now: a bad one raises here (as ValueError), not inside the callback
        _check_host_cu_seqlens(np.asarray(cu_seqlens_q), int(q.shape[0]), max_seqlen_q, "q")
        _check_host_cu_seqlens(np.asarray(cu_seqlens_k), int(k.shape[0]), max_seqlen_k, "k")
    out, lse = _varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, extras, mask, max_seqlen_q, max_seqlen_k,
                            bool(deterministic))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


# ---------------------------------------------------------------------------------------------
# decode (forward)


def _host_decode(mask: _Mask, q, k_cache, v_cache, cache_seqlens, *extras):
    qf, kf, vf, lens = _host_arrays((q, k_cache, v_cache, cache_seqlens), (_DENSE,) * 3 + (_VECTOR,))
    # the kernel reads min(max(cache_seqlens[b], 0), S_max) keys: the host does the same
    lens = np.clip(lens, 0, int(kf.shape[1]))
    out, lse = reference.decode(qf, kf, vf, lens, return_lse=True, **_host_extras(mask, extras), **mask.kwargs())
    # out takes v's head dim Dv, over q's (possibly vmapped) leading axes
    out_shape = reference.out_shape(q, v_cache)
    return out.astype(q.dtype).reshape(out_shape), lse.astype(np.float32).reshape(_lse_shape(q.shape))


def _device_decode(mask: _Mask, num_splits, max_seq_len, ctx, outs, q, k_cache, v_cache, cache_seqlens, *extras):
    buffers = (q, k_cache, v_cache, cache_seqlens, *outs, *extras)
    with _xla_stream(ctx, buffers, (_DENSE,) * 3 + (_VECTOR, _DENSE, _LSE) + _extra_ranks(extras)) as (stream, views):
        qv, kv, vv, lens, ov, lv = views[:6]
        _check_layouts({"q": qv, "k_cache": kv, "v_cache": vv, "out": ov})
        capacity = int(kv.shape[1])
        launch_decode(qv, kv, vv, lens, ov, lv, None, capacity, num_splits=num_splits, stream=stream,
                      split_length=planned_length(max_seq_len, capacity),
                      **_device_extras(mask, views[6:], int(qv.shape[0]), qv), **mask.kwargs())


def decode(q, k_cache, v_cache, cache_seqlens, *, max_seq_len=None, num_splits=None, causal=True, scale=None,
           window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False):
    """:func:`cuattn.decode` for JAX arrays (forward only): ``Sq_new`` (1 to 16) new tokens per
    sequence over a KV cache ``(B, S_max, Hk, D)`` (v ``(B, S_max, Hk, Dv)``, Dv may differ from
    D) holding ``cache_seqlens[b]`` keys (int32 ``(B,)``, new tokens included; clamped to ``[0,
    S_max]`` on every platform). ``max_seq_len``: optional Python int bounding the lengths the
    split count plans for (default S_max). ``sinks`` and ``alibi_slopes`` as in the plain function.

    Returns ``out`` ``(B, Sq_new, Hq, Dv)``, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)``.
    """
    q, k_cache, v_cache, cache_seqlens = _as_arrays(q=q, k_cache=k_cache, v_cache=v_cache,
                                                    cache_seqlens=cache_seqlens)
    mask = _mask_options(causal, scale, window, softcap, _extra_names(sinks, alibi_slopes), return_lse=return_lse)
    check_decode_args(q, k_cache, v_cache, cache_seqlens, "cache_seqlens", ("(B, S_max, Hk, D)", "S_max"))
    extras = _extras(int(q.shape[0]), int(q.shape[2]), sinks, alibi_slopes)
    _check_static("num_splits", num_splits)
    _check_num_splits(num_splits)
    if max_seq_len is not None:
        max_seq_len = _check_length("max_seq_len", max_seq_len, 1)
    _check_dtypes({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    _masks.check_total_length(int(q.shape[1]), int(k_cache.shape[1]))
    out, lse = _decode_call(q, k_cache, v_cache, cache_seqlens, *extras, mask=mask,
                            num_splits=None if num_splits is None else int(num_splits), max_seq_len=max_seq_len)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("mask", "num_splits", "max_seq_len"))
def _decode_call(q, k_cache, v_cache, cache_seqlens, *extras, mask: _Mask, num_splits: int | None,
                 max_seq_len: int | None):
    # out (B, Sq_new, Hq, Dv): v's head dim; lse as q's rows
    shapes = (jax.ShapeDtypeStruct(reference.out_shape(q, v_cache), q.dtype),
              jax.ShapeDtypeStruct(_lse_shape(q.shape), jnp.float32))

    def forward(*arrays):
        return _per_platform(
            arrays,
            host=_host_call(functools.partial(_host_decode, mask), shapes, mask.vmap_method()),
            # split partials live in cuattn's per-stream workspace, which may be reallocated
            # between calls: not recordable in a graph
            device=_device_call(functools.partial(_device_decode, mask, num_splits, max_seq_len), shapes,
                                mask.vmap_method(), graph_safe=False),
        )

    return _forward_only("decode", forward, q, k_cache, v_cache, cache_seqlens, *extras)


# ---------------------------------------------------------------------------------------------
# paged_attention (forward)


def _host_paged(mask: _Mask, q, k_pages, v_pages, block_table, seq_lens, *extras):
    q, k_pages, v_pages, table, lens = (np.asarray(x) for x in (q, k_pages, v_pages, block_table, seq_lens))
    # the kernel clamps lengths to the table's capacity and block ids to the pool: so does the host
    table, lens = clamp_table(table, lens, int(k_pages.shape[0]), int(k_pages.shape[1]))
    out, lse = reference.paged_attention(q, k_pages, v_pages, table, lens, return_lse=True,
                                         **_host_extras(mask, extras), **mask.kwargs())
    return out.astype(q.dtype), lse.astype(np.float32)


def _device_paged(mask: _Mask, num_splits, max_seq_len, ctx, outs, q, k_pages, v_pages, block_table, seq_lens,
                  *extras):
    # vmap loops here ("sequential"): every buffer is one unbatched problem
    buffers = (q, k_pages, v_pages, block_table, seq_lens, *outs, *extras)
    ranks = (_DENSE,) * 3 + (_TABLE, _VECTOR, _DENSE, _LSE) + _extra_ranks(extras)
    with _xla_stream(ctx, buffers, ranks) as (stream, views):
        qv, kv, vv, table, lens, ov, lv = views[:7]
        _check_layouts({"q": qv, "k_pages": kv, "v_pages": vv, "out": ov})
        num_blocks, block_size = int(kv.shape[0]), int(kv.shape[1])
        capacity = int(table.shape[1]) * block_size
        launch_decode(qv, kv, vv, lens, ov, lv, (table, block_size, num_blocks), capacity, num_splits=num_splits,
                      stream=stream, split_length=planned_length(max_seq_len, capacity),
                      **_device_extras(mask, views[7:], int(qv.shape[0]), qv),
                      **mask.kwargs())


def paged_attention(q, k_pages, v_pages, block_table, seq_lens, *, max_seq_len=None, num_splits=None, causal=True,
                    scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False):
    """:func:`cuattn.paged_attention` for JAX arrays (forward only), over page pools ``k_pages``
    ``(num_blocks, block_size, Hk, D)`` and ``v_pages`` ``(num_blocks, block_size, Hk, Dv)`` (Dv
    may differ from D).

    ``block_table`` int32 ``(B, max_blocks)`` and ``seq_lens`` int32 ``(B,)`` are arrays (may be
    traced). Where an eager call gives them on the CPU their values are checked now, as the plain
    function's ``check=True`` does (ValueError for a block id outside the pool or a length past
    the table); otherwise they are never read on the host, and lengths are clamped to the table's
    capacity and block ids to the pool (the plain function's ``check=False``). ``max_seq_len``: optional
    Python int bounding the lengths the split count plans for (default the table's capacity).
    ``sinks`` and ``alibi_slopes`` as in the plain function. Returns ``out`` ``(B, Sq_new, Hq, Dv)``, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)``.
    """
    q, k_pages, v_pages, block_table, seq_lens = _as_arrays(q=q, k_pages=k_pages, v_pages=v_pages,
                                                            block_table=block_table, seq_lens=seq_lens)
    mask = _mask_options(causal, scale, window, softcap, _extra_names(sinks, alibi_slopes), return_lse=return_lse)
    check_decode_args(q, k_pages, v_pages, seq_lens, "seq_lens", ("(num_blocks, block_size, Hk, D)", "block_size"))
    extras = _extras(int(q.shape[0]), int(q.shape[2]), sinks, alibi_slopes)
    _arrays.check_ndim("block_table", block_table, "(B, max_blocks)")
    _arrays.check_axis("block_table", block_table, 0, "batch", int(q.shape[0]), "q.shape[0]")
    _arrays.check_int32("block_table", block_table)
    block_size = int(k_pages.shape[1])
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"k_pages.shape[1] (block_size) must be from 1 to {MAX_BLOCK_SIZE}, got {block_size}")
    _check_static("num_splits", num_splits)
    _check_num_splits(num_splits)
    if max_seq_len is not None:
        max_seq_len = _check_length("max_seq_len", max_seq_len, 1)
    _check_dtypes({"q": q, "k_pages": k_pages, "v_pages": v_pages})
    _masks.check_total_length(int(q.shape[1]), int(block_table.shape[1]) * block_size)
    if _concrete_on_cpu(block_table, seq_lens):
        # values known now: a bad one raises here, not clamped inside the callback
        check_table(np.asarray(block_table), np.asarray(seq_lens), int(k_pages.shape[0]), block_size)
    out, lse = _paged_call(q, k_pages, v_pages, block_table, seq_lens, *extras, mask=mask,
                           num_splits=None if num_splits is None else int(num_splits), max_seq_len=max_seq_len)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("mask", "num_splits", "max_seq_len"))
def _paged_call(q, k_pages, v_pages, block_table, seq_lens, *extras, mask: _Mask, num_splits: int | None,
                max_seq_len: int | None):
    # out (B, Sq_new, Hq, Dv): v's head dim; lse as q's rows
    shapes = (jax.ShapeDtypeStruct(reference.out_shape(q, v_pages), q.dtype),
              jax.ShapeDtypeStruct(_lse_shape(q.shape), jnp.float32))

    def forward(*arrays):
        return _per_platform(
            arrays,
            host=_host_call(functools.partial(_host_paged, mask), shapes, LOOP_OVER_VMAPPED_AXES),
            # split partials live in cuattn's per-stream workspace: not recordable in a graph
            device=_device_call(functools.partial(_device_paged, mask, num_splits, max_seq_len), shapes,
                                LOOP_OVER_VMAPPED_AXES, graph_safe=False),
        )

    return _forward_only("paged_attention", forward, q, k_pages, v_pages, block_table, seq_lens, *extras)


# ---------------------------------------------------------------------------------------------
# ring_attention (context parallelism inside jax.shard_map)
#
# The single-controller form of cuattn.distributed's ring: each device of a mesh axis holds one
# shard of the sequence, K/V (and in the backward the dK/dV accumulators) travel to the next
# device by jax.lax.ppermute, each step's block runs the attention kernels above, and the
# partial results merge by their lse. Zigzag shards when causal: device r of P holds chunks r and
# 2P-1-r of 2P, so at every step after the first each device computes half a block:
#   K/V from src < r: every local query against the first held half (chunk src), no mask;
#   K/V from src > r: the second local half (chunk 2P-1-r) against all of it, no mask.
# Which of the two a step runs depends on the device (a traced index): lax.cond over branches
# that return the full local shape, the rows a branch does not compute set to empty (lse -inf,
# zero gradients).


def _ring_shift(x, axis_name: str, size: int):
    """x from every device to the next one around the ring."""
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % size) for i in range(size)])


def _as_varying(x, axis_name: str):
    """x typed as varying over the mesh axis, as shard_map checks a custom rule's results to be:
    the kernels' results come from callbacks that JAX types as the same on every device."""
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)  # JAX >= 0.11 names the set of varying axes vma
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    if axis_name in varying:
        return x
    pvary = getattr(jax.lax, "pvary", None)
    return pvary(x, axis_name) if pvary is not None else jax.lax.pcast(x, axis_name, to="varying")


def _merge_partial(out, lse, part, part_lse):
    """Merge a partial (out, lse) over other keys into the running one (out float32 (B, S, H, D),
    lse (B, H, S)); rows empty on both sides stay empty."""
    merged = jnp.logaddexp(lse, part_lse)
    reference_lse = jnp.where(jnp.isneginf(merged), 0.0, merged)
    weight_self = jnp.exp(lse - reference_lse).transpose(0, 2, 1)[..., None]
    weight_part = jnp.exp(part_lse - reference_lse).transpose(0, 2, 1)[..., None]
    return out * weight_self + part.astype(jnp.float32) * weight_part, merged


def _pad_rows(x, rows: int, before: bool, fill, axis: int = 1):
    """Pad axis ``axis`` with ``rows`` entries of ``fill`` before or after x."""
    pad_shape = list(x.shape)
    pad_shape[axis] = rows
    pad = jnp.full(pad_shape, fill, x.dtype)
    return jnp.concatenate([pad, x] if before else [x, pad], axis=axis)


def _ring_step_forward(q, k, v, mask: _Mask, step: int, rank, size: int):
    """This step's partial (out, lse) over the local queries: full shape, rows not seen empty."""
    if step == 0:
        return _attention_forward(q, k, v, (), mask)
    if not mask.causal:
        return _attention_forward(q, k, v, (), mask)
    half = q.shape[1] // 2
    unmasked = dataclasses.replace(mask, causal=False)

    def earlier(q, k, v):  # every query, the sender's first chunk
        return _attention_forward(q, k[:, :half], v[:, :half], (), unmasked)

    def later(q, k, v):  # the second local chunk, all of the sender's keys
        out, lse = _attention_forward(q[:, half:], k, v, (), unmasked)
        return _pad_rows(out, half, True, 0), _pad_rows(lse, half, True, -jnp.inf, axis=2)

    source = (rank - step) % size
    return jax.lax.cond(source < rank, earlier, later, q, k, v)


def _ring_step_backward(dout, q, k, v, out, lse, mask: _Mask, step: int, rank, size: int):
    """This step's share of (dq, dk, dv) for the held K/V: full shapes, unseen rows zero."""
    deterministic = False
    if step == 0 or not mask.causal:
        return _attention_backward(dout, q, k, v, out, lse, (), mask, deterministic)
    half = q.shape[1] // 2
    unmasked = dataclasses.replace(mask, causal=False)

    def earlier(dout, q, k, v, out, lse):
        dq, dk, dv = _attention_backward(dout, q, k[:, :half], v[:, :half], out, lse, (), unmasked, deterministic)
        return dq, _pad_rows(dk, half, False, 0), _pad_rows(dv, half, False, 0)

    def later(dout, q, k, v, out, lse):
        dq, dk, dv = _attention_backward(dout[:, half:], q[:, half:], k, v, out[:, half:], lse[..., half:], (), unmasked,
                                         deterministic)
        return _pad_rows(dq, half, True, 0), dk, dv

    source = (rank - step) % size
    return jax.lax.cond(source < rank, earlier, later, dout, q, k, v, out, lse)


def _ring_forward(q, k, v, axis_name: str, mask: _Mask):
    size = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    held = (k, v)
    out = lse = None
    for step in range(size):
        part, part_lse = _ring_step_forward(q, *held, mask, step, rank, size)
        if out is None:
            out, lse = part.astype(jnp.float32), part_lse
        else:
            out, lse = _merge_partial(out, lse, part, part_lse)
        if step + 1 < size:
            held = tuple(_ring_shift(x, axis_name, size) for x in held)
    return _as_varying(out.astype(q.dtype), axis_name), _as_varying(lse, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _differentiable_ring(q, k, v, axis_name: str, mask: _Mask):
    return _ring_forward(q, k, v, axis_name, mask)


def _differentiable_ring_fwd(q, k, v, axis_name: str, mask: _Mask):
    out, lse = _ring_forward(q, k, v, axis_name, mask)
    return (out, lse), (q, k, v, out, lse)


def _differentiable_ring_bwd(axis_name: str, mask: _Mask, residuals, cotangents):
    # lse leaves ring_attention() through stop_gradient, so its cotangent is zero
    dout, _ = cotangents
    q, k, v, out, lse = residuals
    dout = dout.astype(q.dtype)
    size = jax.lax.axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    held = (k, v)
    dq = jnp.zeros(q.shape, jnp.float32)
    # the dK/dV accumulator of the K/V held now travels with it and is back at its owner at the end
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for step in range(size):
        dq_part, dk_part, dv_part = _ring_step_backward(dout, q, *held, out, lse, mask, step, rank, size)
        dq = dq + dq_part.astype(jnp.float32)
        dk, dv = dk + dk_part.astype(jnp.float32), dv + dv_part.astype(jnp.float32)
        if step + 1 < size:
            held = tuple(_ring_shift(x, axis_name, size) for x in held)
        dk, dv = (_ring_shift(x, axis_name, size) for x in (dk, dv))
    return tuple(_as_varying(g.astype(x.dtype), axis_name) for g, x in ((dq, q), (dk, k), (dv, v)))


_differentiable_ring.defvjp(_differentiable_ring_fwd, _differentiable_ring_bwd)


def ring_attention(q, k, v, axis_name: str, *, causal=False, scale=None, softcap=0.0, return_lse=False):
    """Differentiable ring attention across the devices of mesh axis ``axis_name``, inside ``jax.shard_map``.

    Each device holds one shard of the sequence: q ``(B, S_local, Hq, D)``, k and v ``(B, S_local,
    Hk, D)`` (float16 or bfloat16, ``Hq % Hk == 0``), contiguous shards without ``causal`` and
    zigzag shards with it (device r of P holds chunks r and 2P-1-r of 2P: lay the global sequence
    out with ``cuattn.distributed.zigzag_shard`` before sharding). K and V travel around the ring
    by ``jax.lax.ppermute``; each step runs cuattn's kernels (the reference on the CPU) and the
    partial results merge by their lse. The backward sends dK/dV accumulators around the same
    ring. Returns this shard's ``out`` ``(B, S_local, Hq, D)``, or ``(out, lse)`` with lse
    ``(B, Hq, S_local)`` over every device's keys (through ``stop_gradient``).

        mesh = jax.make_mesh((P,), ("ring",))
        f = jax.shard_map(lambda q, k, v: cuattn.jax.ring_attention(q, k, v, "ring", causal=True),
                          mesh=mesh, in_specs=PartitionSpec(None, "ring"), out_specs=PartitionSpec(None, "ring"))
    """
    q, k, v = _as_arrays(q=q, k=k, v=v)
    _check_static("axis_name", axis_name)
    mask = _mask_options(causal, scale, (-1, -1), softcap, return_lse=return_lse)
    _check_qkv(q, k, v, packed=False)
    _check_dtypes({"q": q, "k": k, "v": v})
    _arrays.check_axis("k", k, 1, "S_local", int(q.shape[1]), "q.shape[1]")
    if mask.causal and int(q.shape[1]) % 2:
        raise ValueError(f"q.shape[1] (S_local) = {q.shape[1]} must be even with causal=True: a zigzag shard is "
                         "two equal chunks")
    out, lse = _differentiable_ring(q, k, v, axis_name, mask)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out
