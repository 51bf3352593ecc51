"""Every error rule (README, "Errors"): the message names the argument, the axis, expected and actual.

The shape, dtype and option checks run before any GPU work, so most are exercised with NumPy
inputs on the CPU; the ones only device arrays can trigger (kernel dtypes, strides, alignment,
mixed frameworks) are GPU tests.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from conftest import BF16, import_jax, prefix_sums


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
        (((1, 5, 4, 264), (1, 7, 2, 264), (1, 7, 2, 264)),
         r"q.shape\[-1\] \(head_dim\) = 264 is not supported: head_dim must be a multiple of 8 from 8 to 256"),
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
        ({"window": (1.5, 2)}, TypeError, r"window must be a pair \(left, right\) of ints, -1 meaning unbounded; "
                                          r"got \(1.5, 2\)"),
        ({"window": "ab"}, TypeError, r"window must be a pair \(left, right\) of ints, -1 meaning unbounded; got 'ab'"),
        ({"window": (True, 0)}, TypeError, r"window must be a pair \(left, right\) of ints"),
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


@pytest.mark.parametrize(
    "options, error, message",
    [
        # numbers only: no strings, bools or arrays read as one
        ({"scale": "1"}, TypeError, r"scale must be a float or None, got str '1'"),
        ({"scale": True}, TypeError, r"scale must be a float or None, got bool True"),
        ({"scale": np.ones(2)}, TypeError, r"scale must be a float or None, got ndarray"),
        ({"softcap": None}, TypeError, r"softcap must be a float \(0 = off\), got NoneType None"),
        ({"softcap": "2"}, TypeError, r"softcap must be a float \(0 = off\), got str '2'"),
        ({"softcap": True}, TypeError, r"softcap must be a float \(0 = off\), got bool True"),
        # the kernels take scale * log2(e) and softcap * log2(e) in float32
        ({"scale": 1e308}, ValueError, r"scale must be a finite float > 0, got 1e\+308; it lies in \[.*float32"),
        ({"scale": 1e-45}, ValueError, r"scale must be a finite float > 0, got 1e-45; it lies in"),
        ({"softcap": 1e300}, ValueError, r"softcap must be a finite float >= 0 \(0 = off\), got 1e\+300; a nonzero"),
        ({"scale": 1e30, "softcap": 1e-20}, ValueError,
         r"scale / softcap must be finite in float32 \(the kernels' score multiplier\), got 1e\+30 / 1e-20"),
        # a Python int past a float's range is out of range, not an OverflowError
        ({"scale": 10**400}, ValueError, r"scale must be a finite float > 0, got inf \(401 digits\)"),
        ({"softcap": 10**400}, ValueError, r"softcap must be a finite float >= 0 \(0 = off\), got inf"),
    ],
)
def test_scale_and_softcap_are_numbers_the_kernels_can_hold(options, error, message):
    with pytest.raises(error, match=message):
        cuattn.attention(*arrays(), **options)


def test_a_window_wider_than_any_sequence_sees_every_key():
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(x.shape).astype(np.float32) for x in arrays())
    wide = cuattn.attention(q, k, v, window=(2**63, 2**70))
    np.testing.assert_array_equal(wide, cuattn.attention(q, k, v))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q, k, v: cuattn.attention(None, k, v), r"q must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.attention(q, k, [0.0]), r"v must be a NumPy, CuPy, torch or JAX array .*got builtins.list"),
        (lambda q, k, v: cuattn.attention(q, k, v, sinks=1.0), r"sinks must be a NumPy, CuPy, torch or JAX array"),
        (lambda q, k, v: cuattn.attention_backward(q, q, k, v, None, np.zeros((1, 4, 5), np.float32)),
         r"out must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.attention_backward(q, q, k, v, q, None), r"lse must be a NumPy, CuPy, torch or JAX array"),
        (lambda q, k, v: cuattn.decode(q[:, :1], None, v, np.array([7], np.int32)),
         r"k_cache must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.merge_states(None, np.zeros((1, 4, 5), np.float32), q, np.zeros((1, 4, 5), np.float32)),
         r"out_0 must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.fp8_scales(None), r"x must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.paged_attention_varlen(None, (k, v), np.zeros((1, 1), np.int32), [0, 1], [1], 1),
         r"q must be a NumPy, CuPy, torch or JAX array .*got None"),
        (lambda q, k, v: cuattn.paged_attention_varlen([[[0.0]]], (k, v), np.zeros((1, 1), np.int32), [0, 1], [1], 1),
         r"q must be a NumPy, CuPy, torch or JAX array .*got builtins.list"),
    ],
)
def test_a_missing_or_foreign_array_is_named(call, message):
    with pytest.raises(TypeError, match=message):
        call(*arrays())


def test_the_host_keeps_the_kernels_length_limit():
    """Positions are int32 in the kernels: Sq + Sk stays below 2^30 on the CPU path too."""
    x, cu = np.zeros((5, 4, 64), np.float32), np.array([0, 2, 5], np.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q \+ max_seqlen_k must stay below 1073741824 \(positions are "
                                         r"int32 in the kernels\), got 536870912 \+ 536870912"):
        cuattn.attention_varlen(x, x[:, :2], x[:, :2], cu, cu, 2**29, 2**29)
    q = np.zeros((1, 1, 4, 64), np.float32)
    k = np.broadcast_to(np.zeros((1, 1, 2, 64), np.float32), (1, 2**30, 2, 64))
    with pytest.raises(ValueError, match=r"q.shape\[1\] \+ k_cache.shape\[1\] \(Sq_new \+ S_max\) must stay below"):
        cuattn.decode(q, k, k, np.array([3], np.int32))
    pages = np.zeros((1, 256, 2, 64), np.float32)
    table = np.zeros((1, 2**22), np.int32)  # 2^22 blocks of 256 tokens: a 2^30-token capacity
    with pytest.raises(ValueError, match=r"q.shape\[1\] \+ the table's capacity \(Sq_new \+ max_blocks x block_size\) "
                                         r"must stay below 1073741824"):
        cuattn.paged_attention(q, (pages, pages), table, np.array([3], np.int32))


def test_fp8_options_name_themselves_on_16_bit_inputs():
    with pytest.raises(TypeError, match=r"out_dtype given: FP8 attention takes q, k and v all in float8_e4m3fn"):
        cuattn.attention(*arrays(), out_dtype=np.float16)
    with pytest.raises(TypeError, match=r"q_scale, k_scale given: FP8 attention takes q, k and v all in float8_e4m3fn"):
        cuattn.attention(*arrays(), q_scale=1.0, k_scale=1.0)


def test_e4m3_only_where_the_device_takes_it():
    """The host's any-float rule stops at e4m3, which the kernels take only as FP8 attention's
    inputs and as KV caches."""
    import ml_dtypes

    q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in arrays(d=16))
    lse = np.zeros((1, 4, 5), np.float32)
    with pytest.raises(TypeError, match=r"q.dtype is float8_e4m3fn; expected float16, bfloat16, float32 or float64 here"):
        cuattn.attention_backward(q, q, k, v, q, lse)
    out = np.zeros((1, 5, 4, 16), ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"out_0.dtype is float8_e4m3fn; expected float16"):
        cuattn.merge_states(out, lse, out, lse)
    with pytest.raises(TypeError, match=r"x.dtype is float8_e4m3fn; expected float16"):
        cuattn.quantize_fp8(np.zeros((2, 2, 16), ml_dtypes.float8_e4m3fn), 1.0)


def test_masked_arrays_cpu_dlpack_arrays_and_byte_order_are_named():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"q is a masked array; pass q.filled\(value\) or the data without a mask"):
        cuattn.attention(np.ma.masked_array(q), k, v)
    with pytest.raises(TypeError, match=r"k.dtype must equal q.dtype = float32, got float32 \(big-endian\)"):
        cuattn.attention(q, k.astype(">f4"), v)
    jnp = import_jax("jax.numpy")
    cpu = import_jax().devices("cpu")[0]
    import jax

    with pytest.raises(TypeError, match=r"q is a jax array on the CPU; the plain functions take GPU arrays, or NumPy "
                                        r"arrays for the CPU reference \(np.asarray\(q\)\); under JAX use cuattn.jax"):
        cuattn.attention(*(jax.device_put(jnp.asarray(x), cpu) for x in (q, k, v)))


def test_out_must_not_overlap_itself():
    q, k, v = arrays()
    out = np.lib.stride_tricks.as_strided(np.zeros(4 * 64, np.float32), q.shape, (0, 0, 64 * 4, 4))
    with pytest.raises(ValueError, match=r"out must not overlap itself: out.shape = \(1, 5, 4, 64\) with stride 0 "
                                         r"along axis 1 \(a broadcast view\)"):
        cuattn.attention(q, k, v, out=out)


def test_nan_stays_nan_in_out_lse_and_merges():
    """A NaN score (here a NaN key) or a NaN sink makes its rows NaN, lse too, as the kernels give it:
    not a row without keys (lse -inf), which a merge would silently drop."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal(x.shape) for x in arrays(sq=3, sk=6))
    bad = k.copy()
    bad[0, 1, 0, 0] = np.nan  # key 1 of kv head 0: query heads 0 and 1 see it
    out, lse = cuattn.attention(q, bad, v, return_lse=True)
    assert np.isnan(out[0, :, :2]).all() and np.isnan(lse[0, :2]).all()
    assert np.isfinite(out[0, :, 2:]).all() and np.isfinite(lse[0, 2:]).all()
    rest_out, rest_lse = cuattn.attention(q, k, v, return_lse=True)
    merged_out, merged_lse = cuattn.merge_states(out, lse, rest_out, rest_lse)
    assert np.isnan(merged_out[0, :, :2]).all() and np.isnan(merged_lse[0, :2]).all()
    sinks = np.array([np.nan, 0.0, 0.0, 0.0], np.float32)
    out, lse = cuattn.attention(q, k, v, sinks=sinks, return_lse=True)
    assert np.isnan(out[0, :, 0]).all() and np.isnan(lse[0, 0]).all() and np.isfinite(lse[0, 1:]).all()
    # a row without keys is still empty: out 0, lse -inf, and it weighs nothing in a merge
    out, lse = cuattn.attention(q, k[:, :0], v[:, :0], return_lse=True)
    assert not out.any() and (lse == -np.inf).all()
    merged_out, merged_lse = cuattn.merge_states(out, lse, rest_out, rest_lse)
    np.testing.assert_allclose(merged_out, rest_out, rtol=1e-12)


def test_out_must_be_writable():
    q, k, v = arrays()
    out = np.zeros(q.shape, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be writable, got a read-only NumPy array"):
        cuattn.attention(q, k, v, out=out)


@pytest.mark.parametrize("name", ["k", "v"])
def test_host_path_refuses_mixed_dtypes_like_the_device_path(name):
    q, k, v = arrays(dtype=np.float16)
    args = {"q": q, "k": k, "v": v, name: (k if name == "k" else v).astype(np.float64)}
    with pytest.raises(TypeError, match=rf"{name}.dtype must equal q.dtype = float16, got float64"):
        cuattn.attention(**args)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q, k, v: cuattn.attention(q, k, v, causal="yes"), r"causal must be a bool, got 'yes'"),
        (lambda q, k, v: cuattn.attention(q, k, v, return_lse=1), r"return_lse must be a bool, got 1"),
        (lambda q, k, v: cuattn.attention_backward(q, q, k, v, q, np.zeros((1, 4, 5), np.float32), deterministic="no"),
         r"deterministic must be a bool, got 'no'"),
        (lambda q, k, v: cuattn.attention_backward(q.astype(np.float16), q, k, v, q, np.zeros((1, 4, 5), np.float32)),
         r"dout.dtype must equal q.dtype = float32, got float16"),
    ],
)
def test_flags_and_gradient_dtypes_are_checked_on_the_host(call, message):
    with pytest.raises(TypeError, match=message):
        call(*arrays())


def test_integer_inputs_are_refused_on_the_host():
    q, k, v = arrays(dtype=np.int32)
    with pytest.raises(TypeError, match=r"q.dtype is int32; expected float16, bfloat16, float32 or float64 \(the CPU "
                                        r"reference computes in float64\)"):
        cuattn.attention(q, k, v)


@pytest.mark.parametrize("dtype", ["float8_e5m2", np.longdouble])
def test_float_kinds_no_kernel_takes_are_refused_on_the_host(dtype):
    """e5m2 and long double are NumPy floats (kind "f") as well; the host path takes only the dtypes
    the reference is documented for, as the device path takes only its own."""
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, dtype) if isinstance(dtype, str) else dtype)
    name = cuattn._arrays.dtype_name(dtype)
    q, k, v = (x.astype(dtype) for x in arrays(d=16))
    message = rf"q.dtype is {name}; expected float16, bfloat16, float32 or float64 \(the CPU reference"
    with pytest.raises(TypeError, match=message):
        cuattn.attention(q, k, v)
    with pytest.raises(TypeError, match=message):
        cuattn.decode(q[:, :1], k, v, np.array([3], np.int32))
    lse = np.zeros((1, 4, 5), np.float32)
    with pytest.raises(TypeError, match=rf"out_0.dtype is {name}; expected float16"):
        cuattn.merge_states(q, lse, q, lse)


def _strided(x):
    """x's values in a view whose last axis has a stride of 2 elements."""
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


@pytest.mark.parametrize("call, name", [
    (lambda q, k, v: cuattn.attention(_strided(q), k, v), "q"),
    (lambda q, k, v: cuattn.attention(q, k, v, out=_strided(np.zeros_like(q))), "out"),
    (lambda q, k, v: cuattn.attention_varlen(q[0], _strided(k[0]), v[0], [0, 5], [0, 7], 5, 7), "k"),
    (lambda q, k, v: cuattn.attention_backward(q, q, k, _strided(v), q, np.zeros((1, 4, 5), np.float32)), "v"),
    (lambda q, k, v: cuattn.decode(_strided(q), k, v, np.array([7], np.int32)), "q"),
    (lambda q, k, v: cuattn.paged_attention(q, (_strided(k), v), np.zeros((1, 1), np.int32), np.array([7], np.int32)),
     "k_pages"),
    (lambda q, k, v: cuattn.paged_attention_varlen(q[0], (k, _strided(v)), np.zeros((1, 1), np.int32), [0, 5],
                                                   np.array([7], np.int32), 5), "v_pages"),
    (lambda q, k, v: cuattn.PagedKVCache(2, 4, 2, 64, np.float32, device="cpu").write(k[0, :3], _strided(v[0, :3]),
                                                                                     [0, 1, 2]), "v"),
], ids=["attention", "out", "varlen", "backward", "decode", "paged", "paged-varlen", "cache-write"])
def test_the_host_path_keeps_the_contiguous_last_axis_rule(call, name):
    """Any strides but a contiguous last axis, on the CPU as on the GPU (README, "Errors")."""
    q, k, v = arrays()
    with pytest.raises(ValueError, match=rf"{name} must be contiguous in its last axis \(head_dim\): {name}.strides\[-1\] "
                                         r"is 2 elements, expected 1"):
        call(q, k, v)


def test_out_must_match_q():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"out.shape must equal q.shape\[:-1\] \+ v.shape\[-1:\] \(v's head dim Dv "
                                         r"last\) = \(1, 5, 4, 64\), got \(1, 5, 4, 32\)"):
        cuattn.attention(q, k, v, out=np.zeros((1, 5, 4, 32), np.float32))
    with pytest.raises(TypeError, match=r"out.dtype must equal q.dtype = float32, got float16"):
        cuattn.attention(q, k, v, out=np.zeros(q.shape, np.float16))


def test_unknown_array_types_are_refused():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"q must be a NumPy, CuPy, torch or JAX array .* got builtins.list"):
        cuattn.attention(q.tolist(), k, v)


def varlen_arrays(lens_q=(3, 4), lens_k=(5, 2), hq=4, hk=2, d=64):
    cu_q = prefix_sums(lens_q)
    cu_k = prefix_sums(lens_k)
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
        (lambda a: {**a, "max_seqlen_q": "4"}, TypeError, r"max_seqlen_q must be an int >= 0, got '4'"),
    ],
)
def test_varlen_errors(change, error, message):
    q, k, v, cu_q, cu_k, mq, mk = varlen_arrays()
    args = change({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                   "max_seqlen_q": mq, "max_seqlen_k": mk})
    with pytest.raises(error, match=message):
        cuattn.attention_varlen(**args)


def lengths_problem(rng, xp=np, dtype=np.float32):
    """Random packed q, k, v with their prefix sums, and a decode problem with its lengths, as
    host int lists; the arrays in ``xp`` (NumPy, or CuPy for the device path)."""
    cu_q, cu_k = [0, 3, 7], [0, 5, 7]
    packed = [xp.asarray(rng.standard_normal(shape).astype(dtype)) for shape in ((7, 4, 64), (7, 2, 64), (7, 2, 64))]
    cache = [xp.asarray(rng.standard_normal(shape).astype(dtype)) for shape in ((2, 1, 4, 64), (2, 9, 2, 64), (2, 9, 2, 64))]
    return packed, cu_q, cu_k, cache, [3, 9]


def check_lists_equal_int32_arrays(rng, xp, dtype):
    """Host prefix sums and lengths given as lists compute what the same int32 arrays of the call's
    framework compute (README, "Errors"); a list of non-int32 values is refused by name."""
    (q, k, v), cu_q, cu_k, (qd, kc, vc), lens = lengths_problem(rng, xp, dtype)
    host = xp.asnumpy if xp is not np else np.asarray

    def as_array(values):
        return xp.asarray(np.asarray(values, np.int32))

    out, lse = cuattn.attention_varlen(q, k, v, cu_q, tuple(cu_k), 4, 5, causal=True, return_lse=True)
    want, want_lse = cuattn.attention_varlen(q, k, v, as_array(cu_q), as_array(cu_k), 4, 5, causal=True,
                                             return_lse=True)
    np.testing.assert_array_equal(host(out), host(want))
    grads = cuattn.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, 4, 5, causal=True)
    want_grads = cuattn.attention_varlen_backward(out, q, k, v, out, lse, as_array(cu_q), as_array(cu_k), 4, 5,
                                                  causal=True)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_array_equal(host(got), host(expected))
    np.testing.assert_array_equal(host(cuattn.decode(qd, kc, vc, lens)), host(cuattn.decode(qd, kc, vc, as_array(lens))))
    with pytest.raises(TypeError, match=r"cu_seqlens_k must hold int32 values, got float64 values"):
        cuattn.attention_varlen(q, k, v, cu_q, [0, 5.0, 7.5], 4, 5)
    with pytest.raises(ValueError, match=r"cache_seqlens must hold int32 values \(in \[-2147483648, 2147483647\]\), "
                                         r"got 3 .. 4294967296"):
        cuattn.decode(qd, kc, vc, [3, 2**32])


def test_prefix_sums_and_lengths_may_be_lists(rng):
    check_lists_equal_int32_arrays(rng, np, np.float32)
    # a plan reads its lengths in place each run: a list is refused first, on any input
    _, _, _, (qd, kc, vc), lens = lengths_problem(rng)
    with pytest.raises(TypeError, match=r"plan_decode reads cache_seqlens on the device each run: pass a device array "
                                        r"\(CuPy or q's framework\) that the loop updates in place, not a list"):
        cuattn.plan_decode(qd, kc, vc, lens)


# ---------------------------------------------------------------------------------------------
# Errors only device arrays can trigger


def _device(x):
    import cupy

    return cupy.asarray(x)


@pytest.mark.gpu
def test_prefix_sums_and_lengths_may_be_lists_on_the_gpu(rng):
    """Lists reach the kernels as device copies, with the results of device arrays; plan_decode,
    which reads the lengths in place each run, refuses a list."""
    import cupy

    check_lists_equal_int32_arrays(rng, cupy, np.float16)
    _, _, _, (qd, kc, vc), lens = lengths_problem(rng, cupy, np.float16)
    with pytest.raises(TypeError, match=r"plan_decode reads cache_seqlens on the device each run: pass a device array"):
        cuattn.plan_decode(qd, kc, vc, lens)


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


# ---------------------------------------------------------------------------------------------
# decode and merge_states


def decode_arrays(b=2, sq_new=1, hq=8, hk=2, s_max=50, d=64):
    q = np.zeros((b, sq_new, hq, d), np.float32)
    k = np.zeros((b, s_max, hk, d), np.float32)
    return q, k, k.copy(), np.full(b, s_max, np.int32)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: {**a, "q": np.zeros((2, 17, 8, 64), np.float32)}, ValueError,
         r"q.shape\[1\] \(Sq_new\) must be between 1 and 16, got 17; use cuattn.attention for prefill"),
        (lambda a: {**a, "q": np.zeros((2, 0, 8, 64), np.float32)}, ValueError, r"q.shape\[1\] \(Sq_new\) must be between 1 and 16, got 0"),
        (lambda a: {**a, "k_cache": a["k_cache"][:1]}, ValueError, r"k_cache.shape\[0\] \(batch\) must equal q.shape\[0\] = 2, got 1"),
        (lambda a: {**a, "v_cache": a["v_cache"][:, :40]}, ValueError, r"v_cache.shape\[1\] \(S_max\) must equal k_cache.shape\[1\] = 50, got 40"),
        (lambda a: {**a, "k_cache": np.zeros((2, 50, 3, 64), np.float32), "v_cache": np.zeros((2, 50, 3, 64), np.float32)},
         ValueError, r"q.shape\[2\] \(num_heads\) = 8 must be a multiple of k_cache.shape\[2\] \(num_kv_heads\) = 3"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].astype(np.int64)}, TypeError, r"cache_seqlens.dtype must be int32, got int64"),
        (lambda a: {**a, "cache_seqlens": a["cache_seqlens"][:1]}, ValueError, r"cache_seqlens.shape\[0\] \(batch\) must equal q.shape\[0\] = 2, got 1"),
        (lambda a: {**a, "k_cache": a["k_cache"].astype(np.float64)}, TypeError, r"k_cache.dtype must equal q.dtype = float32, got float64"),
        (lambda a: {**a, "causal": "yes"}, TypeError, r"causal must be a bool, got 'yes'"),
        (lambda a: {**a, "num_splits": 0}, ValueError, r"num_splits must be None or an int from 1 to 128, got 0"),
        (lambda a: {**a, "num_splits": 129}, ValueError, r"num_splits must be None or an int from 1 to 128, got 129"),
        (lambda a: {**a, "num_splits": "4"}, TypeError, r"num_splits must be None or an int from 1 to 128, got '4'"),
        (lambda a: {**a, "num_splits": True}, TypeError, r"num_splits must be None or an int from 1 to 128, got True"),
        (lambda a: {**a, "max_seq_len": 0}, ValueError, r"max_seq_len must be None or an int >= 1, got 0"),
        (lambda a: {**a, "max_seq_len": True}, TypeError, r"max_seq_len must be None or an int >= 1, got True"),
        (lambda a: {**a, "max_seq_len": 8.0}, TypeError, r"max_seq_len must be None or an int >= 1, got 8.0"),
        (lambda a: {**a, "window": (5,)}, ValueError, r"window must be a pair"),
    ],
)
def test_decode_errors(change, error, message):
    q, k, v, lens = decode_arrays()
    args = change({"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens})
    with pytest.raises(error, match=message):
        cuattn.decode(**args)


def test_decode_batch_beyond_grid_limit():
    q, k, v, lens = decode_arrays(b=65536, hq=1, hk=1, s_max=1, d=32)
    with pytest.raises(ValueError, match=r"q.shape\[0\] \(batch\) must be at most 65535, got 65536"):
        cuattn.decode(q, k, v, lens)


@pytest.mark.parametrize("hk", [1, 4])
def test_decode_query_rows_beyond_grid_limit(hk):
    """Hk x ceil(Sq_new x Hq / Hk / 16) CTAs along the launch's grid.y: one more than it takes is an
    error on the CPU path as on the device's, for decode and paged_attention (q a zero-stride view)."""
    sq_new, hq = 16, 65536
    q = np.broadcast_to(np.zeros(8, np.float32), (1, sq_new, hq, 8))
    k = np.zeros((1, 4, hk, 8), np.float32)
    message = (rf"k_cache.shape\[2\] \(num_kv_heads\) x ceil\(Sq_new x Hq / Hk / 16\) = {hk} x {65536 // hk} must "
               r"be at most 65535 \(the decode launch's grid.y\), got 65536")
    with pytest.raises(ValueError, match=message):
        cuattn.decode(q, k, k, np.full(1, 4, np.int32))
    table = np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match=message.replace("k_cache", "k_pages")):
        cuattn.paged_attention(q, (k, k), table, np.full(1, 4, np.int32))
    # one row chunk fewer launches
    assert cuattn.decode(q[:, :, : hq - 16 * hk], k, k, np.full(1, 4, np.int32)).shape == (1, sq_new, hq - 16 * hk, 8)


def test_decode_unsupported_head_dim():
    q, k, v, lens = decode_arrays(d=44)
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head_dim\) = 44 is not supported: head_dim must be a "
                                         r"multiple of 8 from 8 to 256"):
        cuattn.decode(q, k, v, lens)


def test_merge_states_errors():
    out = np.zeros((2, 5, 4, 64), np.float32)
    lse = np.zeros((2, 4, 5), np.float32)
    with pytest.raises(TypeError, match=r"merge_states takes \(out_a, lse_a, out_b, lse_b\) or one list of \(out, lse\) pairs, got 3"):
        cuattn.merge_states(out, lse, out)
    with pytest.raises(TypeError, match=r"needs a non-empty list of \(out, lse\) pairs"):
        cuattn.merge_states([])
    with pytest.raises(TypeError, match=r"merge_states takes one list \(or tuple\) of \(out, lse\) pairs, got a generator"):
        cuattn.merge_states((out, lse) for _ in range(2))
    # the combine reads D contiguously: a strided last axis is refused on the host as on the device
    wide = np.zeros((2, 5, 4, 128), np.float32)
    with pytest.raises(ValueError, match=r"out_1 must be contiguous in its last axis \(head_dim\): out_1.strides\[-1\] is "
                                         r"2 elements, expected 1"):
        cuattn.merge_states(out, lse, wide[..., ::2], lse)
    with pytest.raises(ValueError, match=r"lse_1.shape must be out's shape without D with its last two axes swapped, \(2, 4, 5\), got \(2, 5, 4\)"):
        cuattn.merge_states(out, lse, out, np.zeros((2, 5, 4), np.float32))
    with pytest.raises(ValueError, match=r"out_1.shape must equal out_0.shape = \(2, 5, 4, 64\), got \(2, 5, 4, 32\)"):
        cuattn.merge_states(out, lse, np.zeros((2, 5, 4, 32), np.float32), lse)
    with pytest.raises(ValueError, match=r"merge_states takes at most 12280 parts, got 12281; merge in rounds"):
        cuattn.merge_states([(out, lse)] * 12281)
    with pytest.raises(ValueError, match=r"out_0 must have at least 3 axes \(..., S, H, D\), got shape \(4, 64\)"):
        cuattn.merge_states(np.zeros((4, 64)), np.zeros(4), np.zeros((4, 64)), np.zeros(4))
    # the host merges in float64, but takes float32 lse and float out of one dtype as the device does
    with pytest.raises(TypeError, match=r"lse_0.dtype must be float32, got int32"):
        cuattn.merge_states(out, lse.astype(np.int32), out, lse)
    with pytest.raises(TypeError, match=r"lse_0.dtype must be float32, got float64"):
        cuattn.merge_states(out, lse.astype(np.float64), out, lse)
    with pytest.raises(TypeError, match=r"lse_1.dtype must be float32, got complex64"):
        cuattn.merge_states(out, lse, out, lse.astype(np.complex64))
    with pytest.raises(TypeError, match=r"out_1.dtype must equal out_0.dtype = float32, got float16"):
        cuattn.merge_states(out, lse, out.astype(np.float16), lse)


@pytest.mark.gpu
def test_merge_states_refuses_evenly_spaced_parts_with_a_strided_last_axis():
    """Parts read in place as one strided array must have D contiguous (the combine reads it so):
    evenly spaced views with a last-axis stride of 2 are refused, not merged as if contiguous."""
    import cupy

    wide = cupy.zeros((2, 2, 5, 4, 128), np.float32)  # [part, B, S, H, 2 D]
    lse = cupy.zeros((2, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"out_0 must be contiguous in its last axis"):
        cuattn.merge_states([(wide[0, ..., ::2], lse), (wide[1, ..., ::2], lse)])


@pytest.mark.gpu
def test_merge_states_device_dtype_errors():
    import cupy

    out = cupy.zeros((2, 5, 4, 64), cupy.float32)
    lse = cupy.zeros((2, 4, 5), cupy.float32)
    with pytest.raises(TypeError, match=r"lse_1.dtype must be float32, got float64"):
        cuattn.merge_states(out, lse, out, lse.astype(cupy.float64))
    with pytest.raises(TypeError, match=r"out_1.dtype must equal out_0.dtype = float32, got float16"):
        cuattn.merge_states(out, lse, out.astype(cupy.float16), lse)
    with pytest.raises(TypeError, match=r"out_0.dtype is float64; merge_states takes float16, bfloat16 or float32"):
        cuattn.merge_states(out.astype(cupy.float64), lse, out.astype(cupy.float64), lse)
