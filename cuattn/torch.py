"""torch adapter: ``cuattn.torch.attention`` and ``attention_varlen`` as differentiable ops
(forward and backward kernels).

    import cuattn.torch
    out = cuattn.torch.attention(q, k, v, causal=True)   # q (B, Sq, Hq, D), k, v (B, Sk, Hk, D)
    out.sum().backward()                                  # q.grad, k.grad, v.grad
    out = cuattn.torch.attention(q, k, v)                 # v (B, Sk, Hk, Dv): out (B, Sq, Hq, Dv)
    out = cuattn.torch.attention(q, k, v, sinks=sinks)   # sinks (Hq,) float32: sinks.grad too
    out = cuattn.torch.ring_attention(q, k, v, group, causal=True)   # this rank's shards (cuattn.distributed)
    out = cuattn.torch.attention(q, k, v, alibi_slopes=slopes)  # (Hq,) or (B, Hq) float32, no gradient
    # packed sequences: q (total_q, Hq, D), k, v (total_k, Hk, D), int32 (B + 1,) prefix sums
    out = cuattn.torch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal=True)

Each is registered with ``torch.library.custom_op`` (as ``torch.ops.cuattn.attention_fwd`` and
``attention_bwd``, ``attention_varlen_fwd`` and ``attention_varlen_bwd``) with fake
implementations, so ``torch.compile`` traces through them instead of breaking the graph. Eager
calls run the same bodies through a ``torch.autograd.Function``, without the custom op's dispatch
(several times the kernels' own host time).
``ring_attention`` (context parallelism over a process group) is a plain
``torch.autograd.Function``: its group is not a tensor, so it is not a custom op and
``torch.compile`` breaks the graph around it. torch is imported only when this module is.
"""

# no `from __future__ import annotations`: torch 2.4's custom_op reads the annotations as types
# to build the schema, and strings (postponed annotations) only from a later release
from typing import Optional

import torch

from . import _arrays, _masks
from .attention import (attention as _forward, attention_backward as _backward_kernels,
                        attention_varlen as _varlen_forward, attention_varlen_backward as _varlen_backward_kernels)

_LIB = "cuattn"
_ROW_ALIGN_BYTES = 16  # the kernels' cp.async and ldmatrix rows
# inputs of the forward ops, one gradient (or None) each: q, k, v, sinks, alibi_slopes and six
# options; varlen adds the two prefix sums and two lengths
_ATTENTION_INPUTS = 11
_VARLEN_INPUTS = 15


# Each op's body is a plain function, used twice: registered as a custom op (what torch.compile
# traces) and called straight by an eager torch.autograd.Function. In eager mode the custom op's
# dispatch (schema defaults, the dynamo-disabled wrapper, the autograd wrapper's pytree work) cost
# more host time than the kernels' own Python: a training step of (1, 128, 8, 64) took 670 us of
# host time through the ops against 208 for torch SDPA's (H100, torch 2.11; BENCHMARKS.md).


def _attention_fwd_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                        alibi_slopes: Optional[torch.Tensor], causal: bool, scale: float, window_left: int,
                        window_right: int, softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only reaches the backward (through setup_context's inputs)
    out, lse = _forward(q, k, v, causal=causal, scale=scale, window=(window_left, window_right),
                        softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, return_lse=True)
    return out, lse


def _attention_fwd_fake(q, k, v, sinks, alibi_slopes, causal, scale, window_left, window_right, softcap,
                        deterministic):
    # the kernels return fresh contiguous arrays whatever the inputs' strides; out has v's head dim
    batch, seqlen_q, num_heads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, num_heads, v.shape[-1])),
            q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32))


def _four_gradients(grads: tuple, q: torch.Tensor, sinks: Optional[torch.Tensor]) -> tuple:
    """dq, dk, dv and dsinks: an op returns a fixed number of tensors, so without sinks dsinks is
    an empty float32 tensor."""
    return grads if sinks is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


def _fake_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor]) -> tuple:
    """What a backward op returns, as torch.compile traces it: dq, dk, dv in q's, k's and v's
    shapes, and dsinks in the sinks' (empty without sinks)."""
    dsinks = q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _kernel_readable(x: torch.Tensor) -> bool:
    """What the kernels read (cuattn._arrays.check_kernel_layout): a unit last stride and rows
    that start on 16-byte boundaries."""
    elems = _ROW_ALIGN_BYTES // x.element_size()
    return x.stride(-1) == 1 and all(s % elems == 0 for s in x.stride()[:-1]) and x.data_ptr() % _ROW_ALIGN_BYTES == 0


def _attention_bwd_body(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, sinks: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                        causal: bool, scale: float, window_left: int, window_right: int, softcap: float,
                        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # autograd may hand over an expanded (stride 0) or sliced gradient: copy only then. (Here, in
    # the op's eager body, not in the traced backward: fake tensors have no data pointer.)
    dout = dout if _kernel_readable(dout) else dout.contiguous()
    grads = _backward_kernels(dout, q, k, v, out, lse, causal=causal, scale=scale, window=(window_left, window_right),
                              softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return _four_gradients(grads, q, sinks)


def _attention_bwd_fake(dout, q, k, v, out, lse, sinks, alibi_slopes, causal, scale, window_left, window_right,
                        softcap, deterministic):
    return _fake_gradients(q, k, v, sinks)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, alibi_slopes, causal, scale, window_left, window_right, softcap, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, alibi_slopes)
    ctx.options = (causal, scale, window_left, window_right, softcap, deterministic)


def _attention_backward_with(bwd):
    """The autograd formula of attention's forward, running the backward through ``bwd`` (the op
    or its body)."""

    def backward(ctx, dout, _dlse):
        if dout is None:  # (eager Function: grads not materialised) out took no part in the loss
            return (None,) * _ATTENTION_INPUTS
        q, k, v, out, lse, sinks, alibi_slopes = ctx.saved_tensors
        dq, dk, dv, dsinks = bwd(dout, q, k, v, out, lse, sinks, alibi_slopes, *ctx.options)
        # the slopes are a fixed bias: no gradient (as FlashAttention-2's)
        return (dq, dk, dv, dsinks if sinks is not None else None) + (None,) * (_ATTENTION_INPUTS - 4)

    return backward


_attention_fwd = torch.library.custom_op(f"{_LIB}::attention_fwd", _attention_fwd_body, mutates_args=())
_attention_fwd.register_fake(_attention_fwd_fake)
_attention_bwd = torch.library.custom_op(f"{_LIB}::attention_bwd", _attention_bwd_body, mutates_args=())
_attention_bwd.register_fake(_attention_bwd_fake)
_attention_fwd.register_autograd(_attention_backward_with(_attention_bwd), setup_context=_setup_context)


def _eager_forward(ctx, body, setup, inputs):
    """An eager Function's forward: the op's body and context, with lse marked non-differentiable
    and left unmaterialised (autograd fills no zero gradient for it on every backward). The
    Functions take ctx first: with a separate setup_context, Function.apply binds its arguments
    through inspect.signature on every call."""
    output = body(*inputs)
    setup(ctx, inputs, output)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    return output


class _EagerAttention(torch.autograd.Function):
    """attention's op for plain eager calls (see _traced): the same body, context and formula,
    without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, *inputs):
        return _eager_forward(ctx, _attention_fwd_body, _setup_context, inputs)

    backward = staticmethod(_attention_backward_with(_attention_bwd_body))


def _check_arguments(function: str, tensors: dict, extras: dict, causal, scale, window, softcap,
                     deterministic) -> tuple[int, int]:
    """The options checked by name (as the plain functions check them) before an op's typed schema
    converts them: bool("False") or int(1.9) would otherwise pass. ``tensors`` must be torch
    tensors, ``extras`` torch tensors or None. Returns the window's (left, right)."""
    left, right = _masks.check_options(window, softcap, scale, causal=causal, deterministic=deterministic)
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor (cuattn.torch.{function}), got {type(x).__name__}")
    for name, x in extras.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch tensor or None (cuattn.torch.{function}), got "
                            f"{type(x).__name__}")
    return left, right


# What _traced asks torch on every call, looked up once: the infrastructure dispatch modes (fake
# tensors, proxies, functionalisation) by key, and functorch's transform stack. A torch without
# one of them sends every call to the custom ops.
_DISPATCH_MODE_OF = getattr(torch._C, "_get_dispatch_mode", None)
_DISPATCH_MODE_KEY_ENUM = getattr(torch._C, "_TorchDispatchModeKey", None)
_DISPATCH_MODE_KEYS = None if _DISPATCH_MODE_KEY_ENUM is None else tuple(_DISPATCH_MODE_KEY_ENUM.__members__.values())
_PEEK_INTERPRETER = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def _traced(q) -> bool:
    """Whether this call is being traced or transformed rather than run: torch.compile or export
    (dynamo), a dispatch mode (make_fx, FakeTensorMode, a user's mode), a tensor subclass, or a
    torch.func transform. Those see the custom ops, as before the eager Function existed (torch.func
    transforms then stop at torch's own error: the ops' generated autograd function has no
    setup_context); a plain eager call takes the Function."""
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
        return True
    if (_DISPATCH_MODE_OF is None or _DISPATCH_MODE_KEYS is None
            or any(_DISPATCH_MODE_OF(key) is not None for key in _DISPATCH_MODE_KEYS)):
        return True
    if torch._C._len_torch_dispatch_stack() > 0:
        return True
    return _PEEK_INTERPRETER is None or _PEEK_INTERPRETER() is not None


def _differentiable(op, eager, *args) -> torch.Tensor:
    """``out`` of a forward op (traced calls: see _traced) or of its eager Function."""
    out, _ = op(*args) if _traced(args[0]) else eager.apply(*args)
    return out


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None,
              deterministic=False):
    """Differentiable :func:`cuattn.attention` for torch CUDA tensors ``(B, S, H, D)``; returns ``out``.

    v may have its own head dim Dv (``(B, Sk, Hk, Dv)``, out ``(B, Sq, Hq, Dv)``; the default scale
    stays ``1 / sqrt(D)``).

    ``sinks``: optional float32 ``(Hq,)`` attention-sink logits, differentiated too (a learnable
    per-head parameter). ``alibi_slopes``: optional float32 ``(Hq,)`` or ``(B, Hq)`` ALiBi slopes, a
    fixed bias that gets no gradient. ``deterministic=True`` makes the backward bit-reproducible (see
    :func:`cuattn.attention_backward`).
    """
    left, right = _check_arguments("attention", {"q": q, "k": k, "v": v},
                                   {"sinks": sinks, "alibi_slopes": alibi_slopes}, causal, scale, window, softcap,
                                   deterministic)
    scale = _masks.resolve_scale(scale, q.shape[-1])
    return _differentiable(_attention_fwd, _EagerAttention, q, k, v, sinks, alibi_slopes, bool(causal), scale, left,
                           right, float(softcap), bool(deterministic))


def _attention_varlen_fwd_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               sinks: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], causal: bool,
                               scale: float, window_left: int, window_right: int, softcap: float,
                               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only reaches the backward (through setup_context's inputs)
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               scale=scale, window=(window_left, window_right), softcap=softcap, sinks=sinks,
                               alibi_slopes=alibi_slopes, return_lse=True)
    return out, lse


def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, alibi_slopes,
                               causal, scale, window_left, window_right, softcap, deterministic):
    # out (total_q, Hq, Dv), lse (Hq, total_q): fresh contiguous arrays
    total_q, num_heads, _ = q.shape
    return (q.new_empty((total_q, num_heads, v.shape[-1])),
            q.new_empty((num_heads, total_q), dtype=torch.float32))


def _attention_varlen_bwd_body(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               sinks: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], causal: bool,
                               scale: float, window_left: int, window_right: int, softcap: float,
                               deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout if _kernel_readable(dout) else dout.contiguous()  # as in _attention_bwd_body
    grads = _varlen_backward_kernels(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal=causal, scale=scale, window=(window_left, window_right), softcap=softcap,
                                     sinks=sinks, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return _four_gradients(grads, q, sinks)


def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
                               alibi_slopes, causal, scale, window_left, window_right, softcap, deterministic):
    return _fake_gradients(q, k, v, sinks)


def _setup_varlen_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, alibi_slopes, *options) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes)
    ctx.lengths, ctx.options = (max_seqlen_q, max_seqlen_k), tuple(options)


def _varlen_backward_with(bwd):
    """The autograd formula of attention_varlen's forward, running the backward through ``bwd``
    (the op or its body)."""

    def backward(ctx, dout, _dlse):
        if dout is None:  # as in _attention_backward_with
            return (None,) * _VARLEN_INPUTS
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes = ctx.saved_tensors
        dq, dk, dv, dsinks = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, sinks,
                                 alibi_slopes, *ctx.options)
        # one per input of the op: the prefix sums, lengths, slopes and options get none
        dsinks = dsinks if sinks is not None else None
        return (dq, dk, dv, None, None, None, None, dsinks) + (None,) * (_VARLEN_INPUTS - 8)

    return backward


_attention_varlen_fwd = torch.library.custom_op(f"{_LIB}::attention_varlen_fwd", _attention_varlen_fwd_body,
                                                mutates_args=())
_attention_varlen_fwd.register_fake(_attention_varlen_fwd_fake)
_attention_varlen_bwd = torch.library.custom_op(f"{_LIB}::attention_varlen_bwd", _attention_varlen_bwd_body,
                                                mutates_args=())
_attention_varlen_bwd.register_fake(_attention_varlen_bwd_fake)
_attention_varlen_fwd.register_autograd(_varlen_backward_with(_attention_varlen_bwd),
                                        setup_context=_setup_varlen_context)


class _EagerAttentionVarlen(torch.autograd.Function):
    """attention_varlen's op for plain eager calls (as _EagerAttention)."""

    @staticmethod
    def forward(ctx, *inputs):
        return _eager_forward(ctx, _attention_varlen_fwd_body, _setup_varlen_context, inputs)

    backward = staticmethod(_varlen_backward_with(_attention_varlen_bwd_body))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, deterministic=False):
    """Differentiable :func:`cuattn.attention_varlen` for torch CUDA tensors; returns ``out``
    ``(total_q, Hq, Dv)``.

    ``q`` ``(total_q, Hq, D)``, ``k`` ``(total_k, Hk, D)`` and ``v`` ``(total_k, Hk, Dv)`` hold
    the packed sequences; ``cu_seqlens_q``, ``cu_seqlens_k``: int32 ``(B + 1,)`` tensors of prefix
    sums on q's device (their values are not read on the host); ``max_seqlen_q``,
    ``max_seqlen_k``: ints bounding every sequence's length. ``sinks`` (float32 ``(Hq,)``,
    differentiable), ``alibi_slopes`` (float32 ``(Hq,)`` or ``(B, Hq)``, no gradient) and
    ``deterministic`` as in :func:`attention`. Rows of no sequence (past ``cu_seqlens_q[-1]``)
    are left unwritten in ``out``, get zero dq and count in no sinks' gradient; padded rows of the
    inputs must be finite (see :func:`cuattn.attention_varlen`).
    """
    left, right = _check_arguments("attention_varlen",
                                   {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
                                   {"sinks": sinks, "alibi_slopes": alibi_slopes}, causal, scale, window, softcap,
                                   deterministic)
    lengths = [_arrays.check_int(name, value, 0) for name, value in
               (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))]
    scale = _masks.resolve_scale(scale, q.shape[-1])
    return _differentiable(_attention_varlen_fwd, _EagerAttentionVarlen, q, k, v, cu_seqlens_q, cu_seqlens_k, *lengths,
                           sinks, alibi_slopes, bool(causal), scale, left, right, float(softcap), bool(deterministic))


class _RingAttention(torch.autograd.Function):
    """cuattn.distributed's ring forward; its backward sends dk and dv around the same ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, softcap):
        from . import distributed

        out, lse = distributed.ring_attention(q, k, v, group, causal=causal, scale=scale, softcap=softcap,
                                              return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.options = group, dict(causal=causal, scale=scale, softcap=softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        from . import distributed

        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if _kernel_readable(dout) else dout.contiguous()
        dq, dk, dv = distributed.ring_attention_backward(dout, q, k, v, out, lse, ctx.group, **ctx.options)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, group, *, causal=False, scale=None, softcap=0.0):
    """Differentiable :func:`cuattn.distributed.ring_attention` for this rank's CUDA tensor shards
    ``(B, S_local, H, D)`` (zigzag layout when ``causal``); ``group`` a torch.distributed process
    group or a ``cuattn.distributed.NcclGroup``. Returns ``out``; ``backward`` gives this rank's
    q.grad and the grads of its k and v summed over every rank's queries (every rank must call
    backward, as every rank called forward)."""
    # as given: ring_attention checks the options by name (a conversion here would hide bad ones)
    return _RingAttention.apply(q, k, v, group, causal, scale, softcap)
