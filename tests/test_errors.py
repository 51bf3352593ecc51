"""Every error rule of DESIGN.md: the message names the argument, the axis, expected and actual.

The shape, dtype and option checks run before any GPU work, so most are exercised with NumPy
inputs on the CPU; the ones only device arrays can trigger (kernel dtypes, strides, alignment,
mixed frameworks) are GPU tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from conftest import BF16


def arrays(b=1, sq=5, sk=7, hq=4, hk=2, d=64, dtype=np.float32):
    q = np.zeros((b, sq, hq, d), dtype)
    k = np.zeros((b, sk, hk, d), dtype)
    return q, k, k.copy()


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((5, 4, 64), (1, 7, 2, 64), (1, 7, 2, 64)), r"q must be 4-D \(B, Sq, Hq, D\), got shape \(5, 4, 64\)"),
        (((1, 5, 4, 64), (7, 2, 64), (1, 7, 2, 64)), r"k must be 4-D \(B, Sk, Hk, D\), got shape \(7, 2, 64\)"),
        (((2, 5, 4, 64), (1, 7, 2, 64), (1, 7, 2, 64)), r"k.shape\[0\] \(batch\) must equal q.shape\[0\] = 2, got 1"),
        (((1, 5, 4, 128), (1, 7, 2, 64), (1, 7, 2, 64)), r"k.shape\[3\] \(head_dim\) must equal q.shape\[3\] = 128, got 64"),
        (((1, 5, 4, 64), (1, 7, 2, 64), (1, 8, 2, 64)), r"v.shape\[1\] \(Sk\) must equal k.shape\[1\] = 7, got 8"),
        (((1, 5, 4, 64), (1, 7, 2, 64), (1, 7, 1, 64)), r"v.shape\[2\] \(Hk\) must equal k.shape\[2\] = 2, got 1"),
        (((1, 5, 6, 64), (1, 7, 4, 64), (1, 7, 4, 64)),
         r"q.shape\[2\] \(num_heads\) = 6 must be a multiple of k.shape\[2\] \(num_kv_heads\) = 4"),
        (((1, 5, 4, 80), (1, 7, 2, 80), (1, 7, 2, 80)),
         r"q.shape\[-1\] \(head_dim\) = 80 is not supported; supported head dims: 32, 64, 96, 128, 256"),
        (((1, 5, 4, 64), (1, 7, 0, 64), (1, 7, 0, 64)), r"k.shape\[2\] \(num_kv_heads\) must be at least 1, got 0"),
    ],
)
def test_shape_errors(shapes, message):
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(ValueError, match=message):
        cuattn.attention(q, k, v)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"window": (1, 2, 3)}, ValueError, r"window must be a pair \(left, right\) of ints, -1 meaning unbounded"),
        ({"window": (1.5, 2)}, ValueError, r"window must be a pair"),
        ({"window": (-2, 0)}, ValueError, r"window entries must be >= -1 \(-1 = unbounded\), got window = \(-2, 0\)"),
        ({"softcap": -1.0}, ValueError, r"softcap must be a finite float >= 0 \(0 = off\), got -1.0"),
        ({"softcap": float("nan")}, ValueError, r"softcap must be a finite float >= 0"),
        ({"scale": 0.0}, ValueError, r"scale must be a finite float > 0, got 0.0"),
        ({"scale": float("inf")}, ValueError, r"scale must be a finite float > 0, got inf"),
    ],
)
def test_option_errors(options, error, message):
    with pytest.raises(error, match=message):
        cuattn.attention(*arrays(), **options)


def test_integer_inputs_are_refused_on_the_host():
    q, k, v = arrays(dtype=np.int32)
    with pytest.raises(TypeError, match=r"q.dtype is int32; expected a floating-point dtype"):
        cuattn.attention(q, k, v)


def test_out_must_match_q():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"out.shape must equal q.shape = \(1, 5, 4, 64\), got \(1, 5, 4, 32\)"):
        cuattn.attention(q, k, v, out=np.zeros((1, 5, 4, 32), np.float32))
    with pytest.raises(TypeError, match=r"out.dtype must equal q.dtype = float32, got float16"):
        cuattn.attention(q, k, v, out=np.zeros(q.shape, np.float16))


def test_unknown_array_types_are_refused():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"expected a NumPy, CuPy, torch or JAX array .* got builtins.list"):
        cuattn.attention(q.tolist(), k, v)


def varlen_arrays(lens_q=(3, 4), lens_k=(5, 2), hq=4, hk=2, d=64):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = np.zeros((cu_q[-1], hq, d), np.float32)
    k = np.zeros((cu_k[-1], hk, d), np.float32)
    return q, k, k.copy(), cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: {**a, "q": a["q"][None]}, ValueError, r"q must be 3-D \(total_q, Hq, D\), got shape \(1, 7, 4, 64\)"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].astype(np.int64)}, TypeError,
         r"cu_seqlens_q.dtype must be int32, got int64"),
        (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:2]}, ValueError,
         r"cu_seqlens_k.shape\[0\] \(B \+ 1\) must equal cu_seqlens_q.shape\[0\] = 3, got 2"),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][:1]}, ValueError,
         r"cu_seqlens_q.shape\[0\] \(B \+ 1\) must be at least 2, got 1"),
        (lambda a: {**a, "cu_seqlens_q": np.array([0, 5, 3], np.int32)}, ValueError,
         r"cu_seqlens_q must start at 0 and be non-decreasing, got \[0, 5, 3\]"),
        (lambda a: {**a, "cu_seqlens_k": np.array([0, 5, 6], np.int32)}, ValueError,
         r"cu_seqlens_k\[-1\] must equal k.shape\[0\] \(total_k\) = 7, got 6"),
        (lambda a: {**a, "max_seqlen_q": 3}, ValueError, r"max_seqlen_q = 3 is below the longest sequence, 4"),
        (lambda a: {**a, "max_seqlen_k": -1}, ValueError, r"max_seqlen_k must be an int >= 0, got -1"),
    ],
)
def test_varlen_errors(change, error, message):
    q, k, v, cu_q, cu_k, mq, mk = varlen_arrays()
    args = change({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                   "max_seqlen_q": mq, "max_seqlen_k": mk})
    with pytest.raises(error, match=message):
        cuattn.attention_varlen(**args)


# ---------------------------------------------------------------------------------------------
# Errors only device arrays can trigger


def _device(x):
    import cupy

    return cupy.asarray(x)


@pytest.mark.gpu
def test_float32_is_refused_with_a_cast_hint():
    q, k, v = (_device(x) for x in arrays(dtype=np.float32))
    with pytest.raises(TypeError, match=r"q.dtype is float32; cuattn kernels take float16 or bfloat16: cast with q.astype\(cupy.float16\)"):
        cuattn.attention(q, k, v)


@pytest.mark.gpu
def test_mixed_dtypes_are_refused():
    q, k, v = (_device(x) for x in arrays(dtype=np.float16))
    with pytest.raises(TypeError, match=r"v.dtype must equal q.dtype = float16, got bfloat16"):
        cuattn.attention(q, k, v.astype(BF16))


@pytest.mark.gpu
def test_non_contiguous_head_dim_is_refused():
    import cupy

    q, k, v = (_device(x) for x in arrays(dtype=np.float16))
    wide = cupy.zeros((1, 5, 4, 128), np.float16)
    with pytest.raises(ValueError, match=r"q must be contiguous in its last axis \(head_dim\): q.strides\[-1\] is 2 elements, expected 1"):
        cuattn.attention(wide[..., ::2], k, v)


@pytest.mark.gpu
def test_unaligned_rows_are_refused():
    import cupy

    q, k, v = (_device(x) for x in arrays(dtype=np.float16))
    odd = cupy.zeros((1, 5, 8, 65), np.float16)[..., :64]  # strides (2600, 520, 65, 1)
    with pytest.raises(ValueError, match=r"q.strides\[2\] must be a multiple of 8 elements \(16 bytes\) for vector loads, got 65"):
        cuattn.attention(odd, k, v)
    flat = cupy.zeros(1 * 5 * 4 * 64 + 1, np.float16)
    shifted = flat[1:].reshape(1, 5, 4, 64)
    with pytest.raises(ValueError, match=r"q must start on a 16-byte boundary"):
        cuattn.attention(shifted, k, v)


@pytest.mark.gpu
def test_mixed_frameworks_are_refused():
    q, k, v = arrays(dtype=np.float16)
    with pytest.raises(TypeError, match=r"all array arguments must come from one framework; q is cupy, k is numpy, v is numpy"):
        cuattn.attention(_device(q), k, v)


@pytest.mark.gpu
def test_torch_cpu_tensors_are_refused():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 5, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"torch tensors must be on a CUDA device, got cpu"):
        cuattn.attention(q, q, q)
