"""FP8 (e4m3) KV caches (cuattn/fp8.py and the e4m3 paths of decode, paged_attention and
PagedKVCache): quantisation rules, the CPU reference path and its argument errors, and on the GPU
every e4m3 byte widened exactly, decode and paged decode against the float64 reference of the
dequantised cache, and the quantising writes bit for bit against NumPy.
"""

from __future__ import annotations

import importlib
import re
import sys

import ml_dtypes
import numpy as np
import pytest

import cuattn
import cuattn.fp8
from cuattn import _arrays, _jit, _params, _registry, reference
from conftest import BF16, DTYPE_IDS, DTYPES, RISES, error_budget, randn, rising_scores
from test_decode import check_decode

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
attention_module = sys.modules["cuattn.attention"]  # the module (cuattn.attention is the function)
# an e4m3 cache takes head dims that are multiples of 16 (16-byte rows of 1-byte elements): the
# decode tiles and two that ride padded in the 96 and 256 tiles
E4M3_PADDED_HEAD_DIMS = (80, 160)
HEAD_DIMS = sorted({d for d in _registry.test_head_dims("decode") if d % _arrays.E4M3_HEAD_DIM_STEP == 0}
                   | set(E4M3_PADDED_HEAD_DIMS))
NAN_BYTES = (0x7F, 0xFF)  # e4m3fn has one NaN pattern per sign and no infinities
POISON_BYTE = 0x7E  # 448: a slot past a sequence's length that leaked into the result would show


def _cupy():
    import cupy

    return cupy


def quantized_cache(rng, shape, heads_axis_scale):
    """e4m3 bytes of a normal cache with a few outliers, and its float64 real values."""
    x = randn(rng, shape, np.float32)
    x.reshape(-1)[rng.choice(x.size, size=max(1, x.size // 500), replace=False)] *= 20.0
    stored = cuattn.quantize_fp8(x, np.asarray(heads_axis_scale, np.float32))
    return stored, stored.astype(np.float64) * np.asarray(heads_axis_scale, np.float64).reshape(-1, 1)


# ---------------------------------------------------------------------------------------------
# Quantisation rules (CPU)


def test_quantize_rounds_to_nearest_even_and_saturates():
    x = np.array([[[0.0, 1.0625, 1.1875, -3.3, 447.0, 460.0, 1e6, -np.inf, 2.0 ** -10, 3 * 2.0 ** -10,
                    1e-30, -0.0, 5.0, 240.0, 1.5, 0.1]]], np.float32)
    got = cuattn.quantize_fp8(x, 1.0).astype(np.float64)[0, 0]
    # 1.0625 lies halfway between 1 and 1.125: even mantissa (1); 1.1875 between 1.125 and 1.25: 1.25;
    # 2^-10 is half the smallest subnormal 2^-9: ties to 0; 3 x 2^-10 ties to 2 x 2^-9
    expected = [0.0, 1.0, 1.25, -3.25, 448.0, 448.0, 448.0, -448.0, 0.0, 2.0 ** -8, 0.0, -0.0, 5.0, 240.0, 1.5,
                0.1015625]
    np.testing.assert_array_equal(got, expected)


def test_quantize_divides_by_the_per_head_scale():
    rng = np.random.default_rng()
    x = randn(rng, (3, 4, 2, 32), np.float32)
    scale = np.array([0.5, 0.03], np.float32)
    got = cuattn.quantize_fp8(x, scale)
    assert got.dtype == E4M3 and got.shape == x.shape
    expected = np.clip(x / scale[:, None], -448, 448).astype(E4M3)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_scales_map_amax_to_448_per_tensor_and_per_head():
    rng = np.random.default_rng()
    x = randn(rng, (2, 5, 3, 16), np.float32)
    x[:, :, 2] = 0.0  # an all-zero head keeps scale 1
    per_tensor = cuattn.fp8_scales(x)
    assert per_tensor.shape == () and per_tensor.dtype == np.float32
    assert np.isclose(per_tensor, np.abs(x).max() / 448)
    per_head = cuattn.fp8_scales(x, per_head=True)
    np.testing.assert_allclose(per_head[:2], np.abs(x[:, :, :2]).max(axis=(0, 1, 3)) / 448, rtol=1e-6)
    assert per_head[2] == 1.0
    # the largest magnitude lands on 448 exactly (or one rounding of the division below it)
    stored = cuattn.quantize_fp8(x, per_head).astype(np.float64)
    assert np.abs(stored[:, :, :2]).max() == 448.0


# ---------------------------------------------------------------------------------------------
# The CPU path: the reference over the dequantised cache


@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
def test_decode_over_e4m3_cache_is_the_reference_of_its_real_values(per_head):
    rng = np.random.default_rng()
    q = randn(rng, (2, 3, 4, 32), BF16)
    k_scale = np.array([0.02, 0.05], np.float32) if per_head else np.float32(0.03)
    v_scale = np.array([0.1, 0.01], np.float32) if per_head else 0.07
    k8, k_real = quantized_cache(rng, (2, 40, 2, 32), np.broadcast_to(k_scale, (2,)))
    # a Python float descale is taken as it is (float64 on the host path), an array as its values
    v8, v_real = quantized_cache(rng, (2, 40, 2, 32), np.broadcast_to(np.asarray(v_scale), (2,)))
    lens = np.array([40, 9], np.int32)
    out, lse = cuattn.decode(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    ref, ref_lse = reference.decode(q, k_real, v_real, lens, return_lse=True)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(BF16).astype(np.float64), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse.astype(np.float32), rtol=1e-6)
    # the same bytes as uint8 (how CuPy holds them) are read as e4m3 too
    as_bytes = cuattn.decode(q, k8.view(np.uint8), v8.view(np.uint8), lens, k_scale=k_scale, v_scale=v_scale)
    np.testing.assert_array_equal(as_bytes.astype(np.float32), out.astype(np.float32))


def test_paged_cpu_cache_quantises_writes_and_attends_over_real_values():
    rng = np.random.default_rng()
    k_scale, v_scale = np.array([0.01, 0.02], np.float32), 0.05
    cache = cuattn.PagedKVCache(6, 4, 2, 32, "float8_e4m3fn", device="cpu", k_scale=k_scale, v_scale=v_scale)
    assert cache.k_pages.dtype == E4M3
    k_new, v_new = randn(rng, (9, 2, 32), np.float32), randn(rng, (9, 2, 32), BF16)
    slots = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13], np.int32)
    # one write kernel reads k and v in one type: the host path refuses a mix as the device's does
    with pytest.raises(TypeError, match=r"v.dtype must equal k.dtype = float32, got bfloat16"):
        cache.write(k_new, v_new, slots)
    v_new = v_new.astype(np.float32)
    cache.write(k_new, v_new, slots)
    expected_k = np.clip(k_new / k_scale[:, None], -448, 448).astype(E4M3)
    np.testing.assert_array_equal(cache.k_pages.reshape(-1, 2, 32)[5:14].view(np.uint8), expected_k.view(np.uint8))
    table = np.array([[1, 2, 3]], np.int32)
    q = randn(rng, (1, 2, 4, 32), np.float16)
    out = cuattn.paged_attention(q, cache, table, np.array([10], np.int32))
    # the cache keeps its scales in float32 (v_scale = 0.05 is float32(0.05) there): the real
    # values are the pages times those, not times the Python float
    assert cache.v_scale.dtype == np.float32 and np.array_equal(cache.v_scale, np.float32([v_scale, v_scale]))
    k_real = cache.k_pages.astype(np.float64) * cache.k_scale[:, None]
    v_real = cache.v_pages.astype(np.float64) * cache.v_scale[:, None]
    ref = reference.paged_attention(q, k_real, v_real, table, np.array([10]))
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float16).astype(np.float64), atol=1e-12)


def test_fp8_argument_errors():
    rng = np.random.default_rng()
    q = randn(rng, (1, 1, 4, 32), BF16)
    k = randn(rng, (1, 8, 2, 32), BF16)
    k8 = cuattn.quantize_fp8(randn(rng, (1, 8, 2, 32)), 0.01)
    lens = np.array([8], np.int32)
    with pytest.raises(ValueError, match=r"k_scale applies to float8_e4m3fn caches only; this cache holds bfloat16"):
        cuattn.decode(q, k, k, lens, k_scale=0.5)
    with pytest.raises(TypeError, match=r"v_cache.dtype must equal k_cache.dtype = float8_e4m3fn \(an e4m3 cache"):
        cuattn.decode(q, k8, k, lens)
    with pytest.raises(ValueError, match=r"k_scale.shape must be \(\), \(1,\) or \(Hk,\) = \(2,\) \(per tensor or "
                                         r"per kv head\), got \(4,\)"):
        cuattn.decode(q, k8, k8, lens, k_scale=np.ones(4, np.float32))
    for bad in (-1.0, 1e-50, 1e-40, 1e39):  # negative; zero, subnormal and infinite in float32
        with pytest.raises(ValueError, match=rf"v_scale must be a positive float, finite and normal in float32 "
                                             rf"\(the kernels' type\), got {re.escape(repr(bad))}"):
            cuattn.decode(q, k8, k8, lens, v_scale=bad)
    with pytest.raises(TypeError, match=r"k_scale must be a float or a float32 array"):
        cuattn.decode(q, k8, k8, lens, k_scale="1")
    with pytest.raises(ValueError, match=r"k_scale applies to float8_e4m3fn caches only; this cache holds float16"):
        cuattn.PagedKVCache(4, 4, 2, 32, np.float16, device="cpu", k_scale=0.5)
    with pytest.raises(ValueError, match=r"v_scale.shape must be \(\), \(1,\) or \(Hk,\) = \(2,\), got \(3,\)"):
        cuattn.PagedKVCache(4, 4, 2, 32, E4M3, device="cpu", v_scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"k_scale must be positive, finite and normal in float32"):
        cuattn.PagedKVCache(4, 4, 2, 32, E4M3, device="cpu", k_scale=0.0)
    cache = cuattn.PagedKVCache(4, 4, 2, 32, E4M3, device="cpu")
    with pytest.raises(ValueError, match=r"k_scale and v_scale come with a PagedKVCache"):
        cuattn.paged_attention(q, cache, np.zeros((1, 1), np.int32), np.array([1], np.int32), k_scale=1.0)
    with pytest.raises(TypeError, match=r"k.dtype is int32; an e4m3 cache takes float16, bfloat16 or float32"):
        cache.write(np.zeros((1, 2, 32), np.int32), np.zeros((1, 2, 32), np.int32), [0])
    with pytest.raises(ValueError, match=r"x must be \(..., H, D\) with at least 2 axes, got shape \(5,\)"):
        cuattn.fp8_scales(np.ones(5, np.float32))
    with pytest.raises(TypeError, match=r"per_head must be a bool, got 'no'"):
        cuattn.fp8_scales(np.ones((5, 2, 32), np.float32), per_head="no")
    # the host takes what the device takes: 16-byte rows, a scale, q of 16 bits (any float but e4m3)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(D\) must be a multiple of 16 \(the write kernel stores 16 "
                                         r"bytes at a time\), got 24"):
        cuattn.quantize_fp8(np.ones((5, 2, 24), np.float32), 0.1)
    with pytest.raises(TypeError, match=r"scale must be a float or a float32 array of shape \(\), \(1,\) or \(H,\), got "
                                        r"None \(cuattn.fp8_scales\(x\) computes one\)"):
        cuattn.quantize_fp8(np.ones((5, 2, 32), np.float32), None)
    with pytest.raises(TypeError, match=r"q.dtype is float8_e4m3fn; over an e4m3 cache q stays float16 or bfloat16"):
        cuattn.decode(k8[:, :1].copy(), k8, k8, lens)


def test_scales_of_non_finite_tensors_are_not_finite():
    """NaN or inf in x shows in its scale (no descale check accepts it), not as an all-zero tensor's 1."""
    x = np.ones((4, 3, 32), np.float32)
    x[1, 0, 5], x[2, 1, 7] = np.nan, np.inf
    scale = cuattn.fp8_scales(x, per_head=True)
    assert np.isnan(scale[0]) and np.isinf(scale[1]) and scale[2] == np.float32(1 / 448)
    assert np.isnan(cuattn.fp8_scales(x))
    with pytest.raises(ValueError, match=r"scale must be a positive float, finite and normal"):
        cuattn.quantize_fp8(x, float(cuattn.fp8_scales(x[:, 1:2])))


@pytest.mark.parametrize("granularity", cuattn.fp8.GRANULARITIES)
def test_quantize_qkv_scales_of_non_finite_tensors_are_not_finite(granularity):
    """quantize_qkv's scales follow fp8_scales: NaN in a tensor (head, block) makes its scale NaN, which shows,
    instead of the all-zero tensor's 1, which would quantise its finite values at scale 1 without a word."""
    x = np.full((1, 4, 2, 32), 1e-3, np.float32)
    x[0, 0, 0, 0] = np.nan
    *_, q_scale, k_scale, v_scale = cuattn.fp8.quantize_qkv(x, x, x, granularity=granularity)
    for scale in (q_scale, k_scale, v_scale):
        if scale.ndim == 0:
            assert np.isnan(scale)
            continue
        # per head (H,) or per block (B, H, blocks): the NaN's head is NaN, head 1 is amax / 448
        by_head = scale if scale.ndim == 1 else scale[0, :, 0]
        assert np.isnan(by_head[0])
        assert by_head[1] == np.float32(np.float32(1e-3) / np.float32(448))


@pytest.mark.parametrize("per_head, shape", [(False, ()), (True, (2,))])
def test_scales_of_an_empty_tensor_are_one(per_head, shape):
    scale = cuattn.fp8_scales(np.zeros((0, 2, 32), np.float32), per_head=per_head)
    assert scale.shape == shape and scale.dtype == np.float32 and np.all(scale == 1)


def test_fp8_attention_takes_the_kernels_head_dims_on_the_host_too():
    rng = np.random.default_rng()
    x = cuattn.quantize_fp8(randn(rng, (1, 8, 2, 64)), 0.01)
    with pytest.raises(ValueError, match=r"q.shape\[3\] \(head_dim\) = 64 is not supported with FP8 inputs; supported "
                                         r"head dims: 128, 256"):
        cuattn.attention(x, x, x, q_scale=0.01, k_scale=0.01, v_scale=0.01)


@pytest.mark.parametrize("shape", [(), (32,)])
def test_quantize_takes_at_least_heads_and_head_dim(shape):
    x = np.asarray(randn(np.random.default_rng(), shape))
    with pytest.raises(ValueError, match=rf"^x must be \(..., H, D\) with at least 2 axes, got shape "
                                         rf"{re.escape(str(shape))}$"):
        cuattn.quantize_fp8(x, 0.1)


@pytest.mark.parametrize("shape", [(1, 8, 4, 64), (1, 7, 4, 128), (8, 4, 128)])
def test_fp8_attention_out_must_have_qs_shape_on_the_host_too(shape):
    rng = np.random.default_rng()
    q8 = cuattn.quantize_fp8(randn(rng, (1, 8, 4, 128)), 0.01)
    k8 = cuattn.quantize_fp8(randn(rng, (1, 9, 2, 128)), 0.01)
    with pytest.raises(ValueError, match=rf"^out.shape must equal q.shape = \(1, 8, 4, 128\), got "
                                         rf"{re.escape(str(shape))}$"):
        cuattn.attention(q8, k8, k8, q_scale=0.01, k_scale=0.01, v_scale=0.01, out=np.zeros(shape, BF16))


def test_descale_arrays_are_float32_on_the_host_too():
    """The kernels take descale arrays in float32: the CPU path refuses float64 ones as the device does."""
    rng = np.random.default_rng()
    x = cuattn.quantize_fp8(randn(rng, (1, 8, 2, 128)), 0.01)
    with pytest.raises(TypeError, match=r"q_scale.dtype must be float32, got float64"):
        cuattn.attention(x, x, x, q_scale=np.full(2, 0.01), k_scale=0.01, v_scale=0.01)
    q = randn(rng, (1, 1, 4, 32), np.float32)
    k8 = cuattn.quantize_fp8(randn(rng, (1, 8, 2, 32)), 0.01)
    with pytest.raises(TypeError, match=r"k_scale.dtype must be float32, got float64"):
        cuattn.decode(q, k8, k8, np.array([8], np.int32), k_scale=np.full(2, 0.01), v_scale=0.01)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_e4m3_write_takes_one_token_dtype_on_the_gpu():
    """One write kernel reads k and v in one type: a mix is refused before launch, the cache unchanged."""
    cupy = _cupy()
    cache = cuattn.PagedKVCache(4, 4, 2, 32, E4M3, k_scale=0.01, v_scale=0.01)
    k = cupy.ones((3, 2, 32), cupy.float16)
    with pytest.raises(TypeError, match=r"v.dtype must equal k.dtype = float16, got float32"):
        cache.write(k, k.astype(cupy.float32), np.array([0, 1, 2], np.int32))
    assert not cache.k_pages.any() and not cache.v_pages.any()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_e4m3_byte_is_widened_exactly(dtype, head_dim):
    """One key per sequence: the output is that key's value row, every e4m3 byte (NaN excepted)
    at every head-dim position, so a wrong byte or a wrong column would show exactly."""
    cupy = _cupy()
    codes = np.array([c for c in range(256) if c not in NAN_BYTES], np.uint8)
    rows = -(-codes.size // head_dim) * head_dim
    pattern = np.resize(codes, rows).reshape(-1, head_dim)  # [heads, D], every code at least once
    hk = pattern.shape[0]
    rng = np.random.default_rng()
    # a second sequence shifts the codes by one column, so each code meets several columns
    v = np.stack([pattern, np.roll(pattern, 1, axis=1)])[:, None]  # [2, 1, Hk, D]
    k = rng.integers(0, 0x70, size=v.shape, dtype=np.uint8)  # any finite keys: one key, weight 1
    q = randn(rng, (2, 1, hk, head_dim), dtype)
    out = cuattn.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(np.array([1, 1], np.int32)))
    expected = v.view(E4M3).astype(np.float64)[:, 0][:, None]  # exact in fp16 and bf16
    np.testing.assert_array_equal(out.get().astype(np.float64), expected)


# e4m3x4_to_half2x2 (fp8.cuh) alone: the decode kernels run the hardware converts on sm_89 and
# later and the bit path before; compute_80 PTX, JIT-compiled by the driver for this GPU, runs the
# bit path on any GPU the tests have.
WIDEN_SOURCE = r"""
#include "fp8.cuh"
extern "C" __global__ void widen(const unsigned* words, unsigned* lo, unsigned* hi, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) cuattn::e4m3x4_to_half2x2(words[i], lo[i], hi[i]);
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["hardware", "bit-path"])
def test_four_e4m3_bytes_widen_to_two_fp16_pairs(path):
    """Every (byte 0, byte 1) pair with random bytes 2, 3 (NaN codes left out: the bit path reads
    them as 480): lo holds bytes 0, 1 and hi bytes 2, 3 as fp16, the lower byte in the low half."""
    cupy = _cupy()
    arch = _jit.target_arch() if path == "hardware" else "compute_80"
    if path == "hardware" and int(arch.removeprefix("sm_").rstrip("a")) < 89:
        pytest.skip(f"the hardware convert needs sm_89 or later; this GPU is {arch}")
    include = _jit.cuda_include_dir()
    options = (f"-arch={arch}", "-std=c++17", f"-I{_jit.source_dir()}", *([f"-I{include}"] if include else []))
    kernel = cupy.RawModule(code=WIDEN_SOURCE, options=options, backend="nvrtc").get_function("widen")
    rng = np.random.default_rng()
    low = np.arange(256 * 256, dtype=np.uint32)
    high = rng.integers(0, 256 * 256, low.size, dtype=np.uint32)
    words = low | (high << 16)
    as_bytes = words.view(np.uint8).reshape(-1, 4)
    finite = ~np.isin(as_bytes, NAN_BYTES).any(axis=1)
    half_bits = as_bytes.view(E4M3).astype(np.float16).view(np.uint16).astype(np.uint32)  # [n, 4]
    want_lo, want_hi = half_bits[:, 0] | (half_bits[:, 1] << 16), half_bits[:, 2] | (half_bits[:, 3] << 16)
    lo, hi = (cupy.full(words.shape, 0xFFFFFFFF, cupy.uint32) for _ in range(2))  # poisoned
    kernel(((words.size + 255) // 256,), (256,), (cupy.asarray(words), lo, hi, np.int32(words.size)))
    np.testing.assert_array_equal(lo.get()[finite], want_lo[finite])
    np.testing.assert_array_equal(hi.get()[finite], want_hi[finite])


def run_fp8_decode(rng, dtype, b, sq_new, hq, hk, d, s_max, lens, per_head, paged_block=None, **options):
    cupy = _cupy()
    k_scale = (rng.uniform(0.005, 0.02, hk) if per_head else np.full(hk, 0.01)).astype(np.float32)
    v_scale = (rng.uniform(0.005, 0.02, hk) if per_head else np.full(hk, 0.015)).astype(np.float32)
    k8, k_real = quantized_cache(rng, (b, s_max, hk, d), k_scale)
    v8, v_real = quantized_cache(rng, (b, s_max, hk, d), v_scale)
    k_bytes, v_bytes = k8.view(np.uint8).copy(), v8.view(np.uint8).copy()
    for i, n in enumerate(lens):
        k_bytes[i, n:] = POISON_BYTE
        v_bytes[i, n:] = POISON_BYTE
    q = randn(rng, (b, sq_new, hq, d), dtype)
    lens = np.asarray(lens, np.int32)
    scales = ({"k_scale": cupy.asarray(k_scale), "v_scale": cupy.asarray(v_scale)} if per_head
              else {"k_scale": float(k_scale[0]), "v_scale": float(v_scale[0])})
    scales.update({name: cupy.asarray(options.pop(name)) for name in ("sinks", "alibi_slopes") if name in options})
    host_options = {**options, **{name: scales[name].get() for name in ("sinks", "alibi_slopes") if name in scales}}
    if paged_block is None:
        out, lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k_bytes), cupy.asarray(v_bytes), cupy.asarray(lens),
                                 return_lse=True, **scales, **options)
    else:
        # the same caches cut into shuffled pages of paged_block tokens
        per_seq = s_max // paged_block
        order = rng.permutation(b * per_seq).astype(np.int32)
        table = order.reshape(b, per_seq)
        pages_k = np.empty((b * per_seq, paged_block, hk, d), np.uint8)
        pages_v = np.empty_like(pages_k)
        pages_k[table.reshape(-1)] = k_bytes.reshape(b * per_seq, paged_block, hk, d)
        pages_v[table.reshape(-1)] = v_bytes.reshape(b * per_seq, paged_block, hk, d)
        out, lse = cuattn.paged_attention(cupy.asarray(q), (cupy.asarray(pages_k), cupy.asarray(pages_v)),
                                          cupy.asarray(table), cupy.asarray(lens), return_lse=True, **scales, **options)
    for planning_only in ("num_splits", "max_seq_len"):
        host_options.pop(planning_only, None)
    check_decode(rng, dtype, q, k_real, v_real, lens, out.get(), lse.get(), **host_options)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("num_splits", [1, None], ids=["1split", "auto"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_e4m3_cache(rng, dtype, head_dim, num_splits, per_head):
    run_fp8_decode(rng, dtype, 3, 1, 8, 2, head_dim, 700, [700, 1, 333], per_head, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("sq_new, gqa", [(1, (32, 8)), (5, (8, 1)), (16, (4, 4))], ids=["32q8kv", "spec5-8q1kv", "spec16"])
def test_decode_e4m3_gqa_speculative_and_options(rng, sq_new, gqa):
    run_fp8_decode(rng, BF16, 2, sq_new, gqa[0], gqa[1], 128, 1029, [1029, 17], True, softcap=30.0,
                   window=(300, 0))


def test_a_float_descale_is_the_float32_the_kernels_take_on_the_cpu_too(rng):
    """A descale given as a Python float reaches the kernels as float32; the CPU path rounds it the
    same way, so both compute with one number: 0.1 gives what float32(0.1) gives, bit for bit."""
    q = randn(rng, (1, 1, 4, 32), BF16)
    k8 = cuattn.quantize_fp8(randn(rng, (1, 8, 2, 32)), 0.01)
    lens = np.array([8], np.int32)
    rounded = float(np.float32(0.1))
    assert rounded != 0.1
    assert _arrays.scalar_scale("k_scale", 0.1, "()") == rounded
    out = cuattn.decode(q, k8, k8, lens, k_scale=0.1, v_scale=0.1)
    np.testing.assert_array_equal(out, cuattn.decode(q, k8, k8, lens, k_scale=rounded, v_scale=rounded))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 7, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_e4m3_pages(rng, head_dim, block_size):
    s_max = block_size * (1536 // block_size)
    run_fp8_decode(rng, BF16, 3, 2, 8, 2, head_dim, s_max, [s_max, 1, 411], True, paged_block=block_size,
                   num_splits=None)


@pytest.mark.gpu
@pytest.mark.parametrize("paged_block", [None, 16], ids=["contiguous", "paged"])
def test_large_batches_over_e4m3_run_the_wide_variant(rng, launched_kernels, paged_block):
    """More (sequence, kv head) CTAs than one wave of the default e4m3 variant run the wide one:
    over a contiguous cache E4M3_WIDE_DECODE_TILES' (four CTAs an SM), over pages
    E4M3_WIDE_PAGED_DECODE_TILES' (a deeper ring, two CTAs an SM); both match the reference."""
    import importlib

    decode_module = importlib.import_module("cuattn.decode")
    launched = launched_kernels
    batch, hq, hk, s_max = 56, 32, 8, 320
    paged = paged_block is not None
    # GQA 32/8 packs 4 rows a kv head: the default variant is the half-tile one
    default = decode_module.decode_spec(BF16, 128, 1, paged, True, half=decode_module.takes_half_tile(hq // hk, 1, False))
    wide = decode_module.decode_spec(BF16, 128, 1, paged, True, wide=True)
    sms = _cupy().cuda.Device().attributes["MultiProcessorCount"]
    one_wave = decode_module.ctas_per_sm(default) * sms
    lens = rng.integers(1, s_max + 1, batch)
    lens[0] = s_max
    run_fp8_decode(rng, BF16, batch, 1, hq, hk, 128, s_max, list(lens), True, paged_block=paged_block,
                   num_splits=None)
    on_sm90 = _jit.target_arch() == decode_module.E4M3_WIDE_DECODE_ARCH
    expected = on_sm90 and decode_module.use_wide_variant(batch * hk, decode_module.ctas_per_sm(default),
                                                          lambda: decode_module.ctas_per_sm(wide), sms, paged)
    assert (wide if expected else default).name in launched, launched
    assert batch * hk > one_wave or one_wave >= 448, "the case should need more than one wave on this GPU"


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 7, None], ids=["pages16", "pages7", "contiguous"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["auto", "3splits"])
@pytest.mark.parametrize("rows", ["gqa4", "gqa16", "alibi", "options"])
def test_e4m3_within_one_wave_runs_the_long_stage(rng, launched_kernels, rows, num_splits, block_size):
    """An e4m3 call at D = 128 on one m16 tile whose CTAs fit one wave of the long-stage variant
    (E4M3_PAGED_LONG_TILES over pages, E4M3_CONTIGUOUS_LONG_TILES over a contiguous cache: 128-key
    stages, eight warps of one k16 slice each) runs it: the
    half-tile one for 4 packed rows (also with a sliding window that starts inside a stage, a
    softcap and sinks), the 16-row one, the ALiBi one. Ragged lengths that end inside a stage and
    inside a page, pages shorter than a copy run (7), poisoned bytes past each length; matches the
    reference."""
    decode_module = importlib.import_module("cuattn.decode")
    paged = block_size is not None
    hq, hk = (16, 1) if rows == "gqa16" else (8, 2)
    s_max = (block_size or 1) * (1400 // (block_size or 1))
    options = {"num_splits": num_splits}
    if rows == "alibi":
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, hq).astype(np.float32)
    if rows == "options":
        options.update(window=(300, 0), softcap=30.0, sinks=rng.standard_normal(hq).astype(np.float32))
    run_fp8_decode(rng, BF16, 3, 1, hq, hk, 128, s_max, [s_max, 1, 411], True, paged_block=block_size, **options)
    alibi = rows == "alibi"
    mt = decode_module.ALIBI_DECODE_MT if alibi else 1
    half = decode_module.takes_half_tile(hq // hk, mt, alibi)
    long = decode_module.decode_spec(BF16, 128, mt, paged, True, alibi, half=half, long=True)
    tile = decode_module.long_tiles(paged)[128]
    assert long.name.endswith(f", {tile.block_n()}" + ("" if tile.warps is None else f", {tile.warps}") + ">")
    assert long.threads == 32 * tile.num_warps()
    assert [name for name in launched_kernels if "decode_kernel" in name] == [long.name], launched_kernels


@pytest.mark.gpu
def test_paged_e4m3_past_one_long_wave_runs_the_default_stage(rng, launched_kernels):
    """Past one wave of the long-stage variant (one CTA an SM at D = 128) a paged e4m3 call runs
    the default 64-key stages, which hold three an SM, or the wide variant beyond those."""
    decode_module = importlib.import_module("cuattn.decode")
    hq, hk = 8, 8
    sms = _cupy().cuda.Device().attributes["MultiProcessorCount"]
    long = decode_module.decode_spec(BF16, 128, 1, True, True, half=True, long=True)
    batch = decode_module.ctas_per_sm(long) * sms // hk + 1
    s_max = 64
    run_fp8_decode(rng, BF16, batch, 1, hq, hk, 128, s_max, list(rng.integers(1, s_max + 1, batch)), True,
                   paged_block=16)
    decodes = [name for name in launched_kernels if "decode_kernel" in name]
    assert decodes == [decode_module.decode_spec(BF16, 128, 1, True, True, half=True).name], launched_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, None], ids=["pages16", "contiguous"])
def test_e4m3_with_splits_past_one_long_wave_runs_the_default_stage(rng, launched_kernels, block_size):
    """A caller's num_splits that takes the launch past one wave of the long-stage variant (its
    CTAs counted with their splits) runs the default stage, and a split count within the wave the
    long stage; both match the reference."""
    decode_module = importlib.import_module("cuattn.decode")
    paged = block_size is not None
    sms = _cupy().cuda.Device().attributes["MultiProcessorCount"]
    batch, hq, hk = 2, 8, 2
    long = decode_module.decode_spec(BF16, 128, 1, paged, True, half=True, long=True)
    wave = decode_module.ctas_per_sm(long) * sms
    s_max = 16 * 64
    for num_splits, takes_long in ((wave // (batch * hk), True), (wave // (batch * hk) + 1, False)):
        launched_kernels.clear()
        run_fp8_decode(rng, BF16, batch, 1, hq, hk, 128, s_max, [s_max, 333], True, paged_block=block_size,
                       num_splits=num_splits)
        spec = decode_module.decode_spec(BF16, 128, 1, paged, True, half=True, long=takes_long)
        decodes = [name for name in launched_kernels if "decode_kernel" in name]
        assert decodes == [spec.name], (num_splits, launched_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, None], ids=["pages16", "contiguous"])
def test_the_split_rule_holds_over_a_contiguous_cache_not_over_pages(rng, launched_kernels, block_size):
    """Where each split would stream more than E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS keys, a
    contiguous e4m3 call runs the default stage and one more split brings the long stage back;
    over pages (whose splits are planned on the table's capacity) the long stage runs both ways.
    All match the reference."""
    decode_module = importlib.import_module("cuattn.decode")
    paged = block_size is not None
    s_max = decode_module.E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS + 32
    for num_splits, long in ((1, paged), (2, True)):
        launched_kernels.clear()
        run_fp8_decode(rng, BF16, 1, 1, 8, 2, 128, s_max, [s_max], True, paged_block=block_size,
                       num_splits=num_splits)
        spec = decode_module.decode_spec(BF16, 128, 1, paged, True, half=True, long=long)
        assert [name for name in launched_kernels if "decode_kernel" in name] == [spec.name], launched_kernels


@pytest.mark.parametrize("ctas, per_sm, split_keys, expected", [
    (264, 2, None, True), (265, 2, None, False), (1, 2, None, True), (396, 3, None, True), (132, 1, None, True),
    (132, 1, 8192, True), (132, 1, 8193, False), (133, 1, 1024, False), (1, 1, 2048, True)])
def test_long_variant_rule(ctas, per_sm, split_keys, expected):
    """The long-stage variant runs while its CTAs an SM (on 132 SMs here) hold the launch in one
    wave, and over a contiguous cache (split_keys given) while each split streams at most
    E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS keys."""
    decode_module = importlib.import_module("cuattn.decode")
    assert decode_module.E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS == 8192
    assert decode_module.use_long_variant(ctas, per_sm, 132, split_keys) == expected


def test_long_variants_are_listed_and_refused_elsewhere():
    """The long-stage variants (e4m3 caches, paged and contiguous, one m16 tile: 16-row, half-tile,
    ALiBi) are in kernel_variants for every dtype; any other call for one is refused, naming what
    takes them."""
    decode_module = importlib.import_module("cuattn.decode")
    listed = {spec.name for spec in decode_module.kernel_variants("sm_90a")}
    for dtype in ("float16", "bfloat16"):
        for paged in (False, True):
            for d in decode_module.long_tiles(paged):
                for extra in (dict(), dict(half=True), dict(alibi=True)):
                    spec = decode_module.decode_spec(dtype, d, 1, paged, True, long=True, **extra)
                    default = decode_module.decode_spec(dtype, d, 1, paged, True, **extra)
                    assert spec.name in listed and spec.name != default.name
    for args in (dict(e4m3=False), dict(e4m3=False, paged=False), dict(mt=2), dict(head_dim=64), dict(wide=True)):
        call = {"dtype": "bfloat16", "head_dim": 128, "mt": 1, "paged": True, "e4m3": True, **args}
        with pytest.raises(ValueError, match=r"the long-stage decode variants take e4m3 caches at tile head dims "
                                             r"\[128\] \(paged\) and \[128\] \(contiguous\) and one m16 tile, "
                                             r"not the wide tiles; got head_dim "):
            decode_module.decode_spec(**call, long=True)


@pytest.mark.gpu
@pytest.mark.parametrize("token_dtype", [np.float16, BF16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_paged_cache_quantising_write_matches_numpy_bit_for_bit(token_dtype):
    cupy = _cupy()
    rng = np.random.default_rng()
    k_scale = np.array([0.01, 0.002, 0.05], np.float32)
    cache = cuattn.PagedKVCache(8, 16, 3, 64, E4M3, k_scale=k_scale, v_scale=0.02)
    assert cache.k_pages.dtype == np.uint8
    # normals, values past 448 x scale (saturated), subnormal-range values and exact ties
    k = (randn(rng, (40, 3, 64), np.float32) * np.array([3.0, 0.5, 30.0])[:, None]).astype(token_dtype)
    k[0, 0, :4] = np.array([1.0625, 1.1875, -2.0 ** -10, 1e-6], np.float32) * k_scale[0]
    v = randn(rng, (40, 3, 64), token_dtype, scale=4.0)
    slots = rng.permutation(128)[:40].astype(np.int32)
    cache.write(cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots))
    k_pages, v_pages = cache.k_pages.get().reshape(128, 3, 64), cache.v_pages.get().reshape(128, 3, 64)
    for name, x, pages, scale in (("k", k, k_pages, k_scale), ("v", v, v_pages, np.full(3, 0.02, np.float32))):
        expected = np.clip(x.astype(np.float32) / scale[:, None], -448, 448).astype(E4M3).view(np.uint8)
        np.testing.assert_array_equal(pages[slots], expected, err_msg=name)
    # the device quantiser of whole arrays is the same kernel
    np.testing.assert_array_equal(cuattn.quantize_fp8(cupy.asarray(k), cupy.asarray(k_scale)).get(),
                                  np.clip(k.astype(np.float32) / k_scale[:, None], -448, 448).astype(E4M3).view(np.uint8))


@pytest.mark.gpu
def test_paged_kv_cache_e4m3_end_to_end_and_plan_reads_scales_each_run(rng):
    cupy = _cupy()
    hk, d, block = 2, 128, 16
    k_scale = cupy.asarray(np.array([0.01, 0.02], np.float32))
    cache = cuattn.PagedKVCache(32, block, hk, d, E4M3, k_scale=k_scale, v_scale=0.01)
    k = randn(rng, (100, hk, d), BF16)
    v = randn(rng, (100, hk, d), BF16)
    cache.write(cupy.asarray(k), cupy.asarray(v), cupy.arange(100, dtype=cupy.int32))
    q = cupy.asarray(randn(rng, (1, 1, 8, d), BF16))
    table = cupy.asarray(np.arange(7, dtype=np.int32)[None])
    lens = cupy.asarray(np.array([100], np.int32))
    out = cuattn.paged_attention(q, cache, table, lens)
    k_real = cache.k_pages.get().view(E4M3).astype(np.float64) * k_scale.get()[:, None]
    v_real = cache.v_pages.get().view(E4M3).astype(np.float64) * 0.01
    check_decode(rng, BF16, q.get(), k_real[:7].reshape(1, 7 * block, hk, d), v_real[:7].reshape(1, 7 * block, hk, d),
                 np.array([100]), out.get(), cuattn.paged_attention(q, cache, table, lens, return_lse=True)[1].get())
    # a plan reads the descale array on the device at every run: doubling v_scale's array doubles out
    v_scale = cupy.asarray(np.full(hk, 0.01, np.float32))
    plan = cuattn.plan_paged_attention(q, (cache.k_pages, cache.v_pages), table, lens, k_scale=k_scale, v_scale=v_scale)
    first = plan.run().get().astype(np.float64)
    np.testing.assert_array_equal(first, out.get().astype(np.float64))
    v_scale *= 2
    np.testing.assert_allclose(plan.run().get().astype(np.float64), 2 * first, rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_torch_float8_caches(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 300, 2, 128, device="cuda")
    v = torch.randn(2, 300, 2, 128, device="cuda")
    k_scale, v_scale = cuattn.fp8_scales(k, per_head=True), cuattn.fp8_scales(v)
    assert isinstance(k_scale, torch.Tensor) and k_scale.shape == (2,)
    k8, v8 = cuattn.quantize_fp8(k, k_scale), cuattn.quantize_fp8(v, v_scale)
    assert k8.dtype == torch.float8_e4m3fn and k8.shape == k.shape
    lens = torch.tensor([300, 41], dtype=torch.int32, device="cuda")
    out = cuattn.decode(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    k_real = k8.float().cpu().numpy() * k_scale.cpu().numpy()[:, None]
    v_real = v8.float().cpu().numpy() * v_scale.cpu().numpy()
    q_host = q.float().cpu().numpy().astype(BF16)
    lse = cuattn.decode(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale, return_lse=True)[1]
    check_decode(rng, BF16, q_host, k_real, v_real, np.array([300, 41]), out.float().cpu().numpy(),
                 lse.cpu().numpy())
    # against bf16 attention over the original values, e4m3's 3 mantissa bits (a relative
    # rounding error of at most 2^-4, about 2^-5 on average) leave an RMS error of a few percent
    full = cuattn.decode(q, k.bfloat16(), v.bfloat16(), lens).float()
    relative_rms = ((out.float() - full).pow(2).mean() / full.pow(2).mean()).sqrt().item()
    assert relative_rms < 2.0 ** -4, relative_rms


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_hadamard_rotate_on_the_gpu_matches_the_host(rng, kind):
    x_host = outlier_inputs(rng, (3, 5, 2, 128)).astype(BF16)
    signs = cuattn.fp8.random_signs(128, 7)
    expected = cuattn.fp8.hadamard_rotate(x_host, signs)
    if kind == "cupy":
        cupy = _cupy()
        x, device_signs = cupy.asarray(x_host), cupy.asarray(signs)
    else:
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x_host.astype(np.float32)).to("cuda").bfloat16()
        device_signs = torch.from_numpy(signs).to("cuda")
    for given in (signs, list(signs), device_signs):  # host signs, or x's framework's
        out = cuattn.fp8.hadamard_rotate(x, given)
        assert _arrays.array_kind(out) == kind and str(out.dtype).endswith("float32")
        np.testing.assert_allclose(_arrays.to_numpy(out), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="x.dtype is int32; expected float16, bfloat16 or float32"):
        cuattn.fp8.hadamard_rotate(x[..., 0:64].int() if kind == "torch" else x[..., 0:64].astype(np.int32),
                                   np.ones(64))


@pytest.mark.gpu
def test_fp8_device_argument_errors():
    cupy = _cupy()
    q = cupy.zeros((1, 1, 4, 32), BF16)
    k8 = cupy.zeros((1, 8, 2, 32), np.uint8)
    lens = cupy.asarray(np.array([8], np.int32))
    with pytest.raises(TypeError, match=r"k_scale.dtype must be float32, got float64"):
        cuattn.decode(q, k8, k8, lens, k_scale=cupy.ones(2, cupy.float64))
    with pytest.raises(ValueError, match=r"v_scale must be contiguous, got a stride of 2 elements"):
        cuattn.decode(q, k8, k8, lens, v_scale=cupy.ones(4, cupy.float32)[::2])
    with pytest.raises(TypeError, match=r"x.dtype is int32; quantize_fp8 takes float16, bfloat16 or float32"):
        cuattn.quantize_fp8(cupy.zeros((4, 2, 32), cupy.int32), 1.0)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(D\) must be a multiple of 16 \(the write kernel stores 16 "
                                         r"bytes at a time\), got 24"):
        cuattn.quantize_fp8(cupy.zeros((4, 2, 24), cupy.float32), 1.0)
    with pytest.raises(TypeError, match=r"x.dtype is int32; expected float16, bfloat16 or float32"):
        cuattn.fp8_scales(cupy.zeros((4, 2, 32), cupy.int32))


# ---------------------------------------------------------------------------------------------
# The FP8 forward: attention(q8, k8, v8, q_scale=, k_scale=, v_scale=, out_dtype=) (#16)

FP8_HEAD_DIMS = list(attention_module.FP8_HEAD_DIMS)
GRANULARITIES = list(cuattn.fp8.GRANULARITIES)
OUTLIER_RATE = 0.001  # FlashAttention-3's outlier inputs: N(0, 1) + N(0, 10^2) x Bernoulli(0.001)
OUTLIER_STD = 10.0


def outlier_inputs(rng, shape):
    """float32 N(0, 1) with a few large values: each element gains N(0, 10^2) with probability 0.001."""
    x = rng.standard_normal(shape).astype(np.float32)
    hit = rng.random(shape) < OUTLIER_RATE
    return x + hit * rng.standard_normal(shape).astype(np.float32) * np.float32(OUTLIER_STD)


def fp8_emulated(q, k, v, *, causal=False, scale=None, alibi_slopes=None, p_scale=1.0):
    """The FP8 kernel's arithmetic in NumPy on real float64 q, k, v (B, S, H, D): exact scores
    (with ALiBi's bias for (Hq,) or (B, Hq) slopes), probabilities exp(s - rowmax) rounded to e4m3 for the PV
    product (as p_scale * p, divided back), the row sums from the unrounded ones. The naive error
    of an FP8 forward, for the tolerance and the RMSE bounds."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    group = hq // hk
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    if alibi_slopes is not None:
        distance = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        s = s - np.asarray(alibi_slopes, np.float64).reshape(-1, hq, 1, 1) * distance
    mask = reference.visible(sq, sk, causal)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p8 = (p * p_scale).astype(E4M3).astype(np.float64) / p_scale
    out = np.einsum("bhij,bjhd->bihd", p8, vv) / np.where(l > 0, l, 1.0).transpose(0, 2, 1, 3)
    return out


def fp8_inputs(rng, b, sq, sk, hq, hk, d, granularity="head", incoherent=False):
    """Outlier q, k, v (outlier_inputs) of these sizes, as `quantised` returns them."""
    q, k, v = (outlier_inputs(rng, (b, s, h, d)) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    return quantised(q, k, v, granularity, incoherent)


def quantised(q, k, v, granularity="head", incoherent=False):
    """q, k, v quantised by quantize_qkv: ((q8, k8, v8), scales, the real float64 [q, k, v])."""
    q8, k8, v8, *scales = cuattn.fp8.quantize_qkv(q, k, v, granularity=granularity, incoherent=incoherent)
    q_rows, k_rows = attention_module.fp8_block_rows()
    real = [reference.dequantize_fp8(x, sc, rows) for x, sc, rows in zip((q8, k8, v8), scales, (q_rows, k_rows, k_rows))]
    return (q8, k8, v8), scales, real


@pytest.mark.parametrize("block_rows", [5, *attention_module.fp8_block_rows()])
def test_dequantize_fp8_multiplies_each_row_by_its_scale(rng, block_rows):
    """reference.dequantize_fp8 (what the CPU FP8 path and fp8_inputs both read e4m3 through):
    stored value x scale, with one scale for the tensor (a float, () or (1,)), one per head (H,),
    or one per block of ``block_rows`` rows of each sequence and head (B, H, ceil(S / block_rows)),
    S two full blocks and a partial last one (which has a scale of its own); uint8 read as e4m3
    bytes. The expected values repeat the scales along the rows here, apart from the function."""
    b, h, d = 2, 3, 16
    s = 2 * block_rows + block_rows // 2 + 1
    blocks = -(-s // block_rows)
    stored = randn(rng, (b, s, h, d), np.float32).astype(E4M3)
    x = stored.astype(np.float64)
    per_tensor = np.float32(rng.uniform(0.01, 2.0))
    per_head = rng.uniform(0.01, 2.0, h).astype(np.float32)
    per_block = rng.uniform(0.01, 2.0, (b, h, blocks)).astype(np.float32)
    # each block's scale on each of its rows: (B, H, S) cut to S, then rows before heads
    row_scales = np.repeat(per_block.astype(np.float64), block_rows, axis=2)[:, :, :s].transpose(0, 2, 1)
    cases = {
        "float": (float(per_tensor), x * float(per_tensor)),
        "()": (np.asarray(per_tensor), x * float(per_tensor)),
        "(1,)": (np.asarray([per_tensor]), x * float(per_tensor)),
        "(H,)": (per_head, x * per_head.astype(np.float64)[None, None, :, None]),
        "(B, H, blocks)": (per_block, x * row_scales[..., None]),
    }
    for name, (scale, expected) in cases.items():
        for storage in (stored, stored.view(np.uint8)):
            got = reference.dequantize_fp8(storage, scale, block_rows)
            assert got.dtype == np.float64 and got.shape == x.shape, name
            # an e4m3 value times a float32 scale is exact in float64
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} scale, {storage.dtype} (seed {rng.seed})")


# Accuracy modes of the FP8 forward: (granularity, incoherent)
FP8_MODES = {"plain": ("tensor", False), "block": ("block", False), "incoherent": ("block", True)}
# RMSE against float64 on outlier inputs (B = 1, S = 1024, H = 4, D = 128, outlier_inputs): the NumPy
# emulation of the kernel's arithmetic (fp8_emulated) measured 1.5e-2 (plain, per-tensor scales),
# 1.3e-2 (block) and 0.9-1.0e-2 (block + incoherent) over causal and not; the bounds leave a third
# on top for the seed and the kernel's own rounding (P at up to 2^8 before e4m3, bf16 output).
# bf16 inputs measure 1e-3 (inputs rounded to bf16) and 2e-3 bounds the bf16 kernel.
FP8_RMSE_BOUNDS = {"plain": 2.0e-2, "block": 1.7e-2, "incoherent": 1.3e-2, "bf16": 2.0e-3}


def rmse(x, ref):
    return float(np.sqrt(np.mean((np.asarray(x, np.float64) - ref) ** 2)))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("incoherent", [False, True], ids=["", "incoherent"])
def test_fp8_attention_host_is_the_reference_of_the_dequantised_inputs(rng, granularity, incoherent):
    (q8, k8, v8), scales, real = fp8_inputs(rng, 2, 67, 203, 4, 2, 128, granularity, incoherent)
    assert q8.dtype == E4M3 and all(sc.dtype == np.float32 for sc in scales)
    out, lse = cuattn.attention(q8, k8, v8, causal=True, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2],
                                return_lse=True)
    expected, expected_lse = reference.attention(*real, causal=True, return_lse=True)
    assert out.dtype == BF16 and out.shape == q8.shape
    np.testing.assert_array_equal(out, expected.astype(BF16))
    np.testing.assert_allclose(lse, expected_lse.astype(np.float32))
    half = cuattn.attention(q8, k8, v8, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2], out_dtype="float16")
    assert half.dtype == np.float16


def test_fp8_attention_float_scales_and_uint8_storage(rng):
    q, k, v = (randn(rng, (1, 40, 2, 128), np.float32) for _ in range(3))
    q8, k8, v8 = (cuattn.quantize_fp8(x, 0.01) for x in (q, k, v))
    out = cuattn.attention(q8.view(np.uint8), k8, v8, q_scale=0.01, k_scale=np.float32(0.01), v_scale=0.01,
                           out_dtype=np.float16)
    # every descale is the float32 nearest 0.01, given as a float or as an array (the kernels' type)
    descale = float(np.float32(0.01))
    expected = reference.attention(*(x.astype(np.float64) * descale for x in (q8, k8, v8)))
    np.testing.assert_array_equal(out, expected.astype(np.float16))


def test_quantize_qkv_scales_and_incoherent_rotation(rng):
    q, k, v = (outlier_inputs(rng, (2, 150, 3, 64)) for _ in range(3))
    q_rows, k_rows = attention_module.fp8_block_rows()
    for granularity, shapes in (("tensor", ((), (), ())), ("head", ((3,), (3,), (3,))),
                                ("block", ((2, 3, -(-150 // q_rows)), (2, 3, -(-150 // k_rows)), (3,)))):
        *_, qs, ks, vs = cuattn.fp8.quantize_qkv(q, k, v, granularity=granularity)
        assert (qs.shape, ks.shape, vs.shape) == shapes, granularity
    # block scales: amax / 448 of each block of rows of each sequence and head
    *_, qs, _, _ = cuattn.fp8.quantize_qkv(q, k, v, granularity="block")
    np.testing.assert_allclose(qs[1, 2, 1], np.abs(q[1, q_rows:2 * q_rows, 2]).max() / 448, rtol=1e-6)
    np.testing.assert_allclose(qs[0, 0, -1], np.abs(q[0, 2 * q_rows:, 0]).max() / 448, rtol=1e-6)
    # the rotation is orthogonal and the same for q and k: q k^T is unchanged
    signs = cuattn.fp8.random_signs(64, 3)
    qr, kr = cuattn.fp8.hadamard_rotate(q, signs), cuattn.fp8.hadamard_rotate(k, signs)
    np.testing.assert_allclose(np.einsum("bihd,bjhd->bhij", qr, kr), np.einsum("bihd,bjhd->bhij", q, k),
                               rtol=1e-4, atol=1e-3)
    walsh = np.array([[(-1) ** bin(i & j).count("1") for j in range(64)] for i in range(64)]) / 8.0
    np.testing.assert_allclose(qr, (q * signs) @ walsh, rtol=1e-5, atol=1e-5)
    # and it spreads the outliers: the rotated amax is far below the original's
    assert np.abs(qr).max() < 0.5 * np.abs(q).max()


@pytest.mark.parametrize("span", [None, 16, 32])
def test_fp8_v_transposed_orders_keys_as_the_p_fragments(span):
    """V^T position 4 t + i of each 16 keys holds key 2 t + i % 2 + 8 (i // 2) (the keys lane t of a
    quad holds in the accumulator, in the order of the 8-bit A fragment), padded with zeros to a
    multiple of the span (by default the pass's, fp8_transpose_shape)."""
    v = np.arange(2 * 37 * 3 * 16, dtype=np.int64).reshape(2, 37, 3, 16).astype(np.uint8)
    vt = attention_module.fp8_v_transposed(v, span=span)
    multiple = span or attention_module.fp8_transpose_shape().span
    padded = -(-37 // multiple) * multiple
    assert vt.shape == (2, 3, 16, padded)
    for position in range(padded):
        t, i = position % 16 // 4, position % 4
        key = position // 16 * 16 + 2 * t + i % 2 + 8 * (i // 2)
        expected = v[:, key] if key < 37 else np.zeros_like(v[:, 0])
        np.testing.assert_array_equal(vt[..., position], expected, err_msg=str(position))


@pytest.mark.parametrize("mode", list(FP8_MODES))
def test_fp8_input_quantisation_rmse_on_outliers(rng, mode):
    """The CPU path (exact arithmetic on the dequantised inputs): the input rounding alone stays
    under each mode's bound, and incoherent processing beats plain FP8 on the same inputs."""
    granularity, incoherent = FP8_MODES[mode]
    q, k, v = (outlier_inputs(rng, (1, 512, 4, 128)) for _ in range(3))
    ref = reference.attention(q, k, v)
    _, _, real = quantised(q, k, v, granularity, incoherent)
    err = rmse(reference.attention(*real), ref)
    assert err < FP8_RMSE_BOUNDS[mode], f"RMSE {err:.3g} (seed {rng.seed})"
    if mode == "incoherent":
        _, _, plain = quantised(q, k, v, "tensor", False)
        plain_err = rmse(reference.attention(*plain), ref)
        assert err < plain_err, f"RMSE {err:.3g}, plain FP8 {plain_err:.3g} (seed {rng.seed})"


def test_fp8_attention_argument_errors(rng):
    q8 = cuattn.quantize_fp8(randn(rng, (1, 8, 4, 128), np.float32), 1.0)
    k8 = cuattn.quantize_fp8(randn(rng, (1, 9, 2, 128), np.float32), 1.0)
    ok = dict(q_scale=1.0, k_scale=1.0, v_scale=1.0)
    for missing in ok:
        with pytest.raises(ValueError, match=f"{missing} is required with float8_e4m3fn"):
            cuattn.attention(q8, k8, k8, **{**ok, missing: None}) if missing != "q_scale" else \
                cuattn.attention(q8, k8, k8, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="q_scale is required with float8_e4m3fn q"):
        cuattn.attention(q8, k8, k8)
    with pytest.raises(TypeError, match=r"q, k and v all in float8_e4m3fn .*k.dtype is bfloat16"):
        cuattn.attention(q8, k8.astype(BF16), k8, **ok)
    with pytest.raises(ValueError, match=r"v_scale.shape must be \(\), \(1,\), \(H,\) = \(2,\), got \(1, 2, 1\)"):
        cuattn.attention(q8, k8, k8, **{**ok, "v_scale": np.ones((1, 2, 1), np.float32)})
    with pytest.raises(ValueError, match=r"k_scale.shape must be .* or \(B, H, ceil\(S / 128\)\) = \(1, 2, 1\), got \(3,\)"):
        cuattn.attention(q8, k8, k8, **{**ok, "k_scale": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"q_scale must be a positive float, finite and normal in float32 \(the kernels' type\), got -1.0"):
        cuattn.attention(q8, k8, k8, **{**ok, "q_scale": -1.0})
    with pytest.raises(TypeError, match=r"out_dtype must be float16 or bfloat16 \(FP8 attention's output\), got float32$"):
        cuattn.attention(q8, k8, k8, **ok, out_dtype="float32")
    with pytest.raises(TypeError, match=r"out_dtype must be float16 or bfloat16 .*got float32$"):
        cuattn.attention(q8, k8, k8, **ok, out_dtype=np.float32)
    with pytest.raises(TypeError, match=r"out_dtype must be float16 or bfloat16 .*got 'fp8'$"):
        cuattn.attention(q8, k8, k8, **ok, out_dtype="fp8")
    with pytest.raises(TypeError, match="out.dtype must equal out_dtype = bfloat16, got float16"):
        cuattn.attention(q8, k8, k8, **ok, out=np.zeros(q8.shape, np.float16))
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="attention_varlen takes float16 or bfloat16 q, k, v; FP8"):
        cuattn.attention_varlen(q8[0], k8[0, :8], k8[0, :8], cu, cu, 8, 8)
    with pytest.raises(ValueError, match="granularity must be one of tensor, head, block, got 'row'"):
        cuattn.fp8.quantize_qkv(q8, k8, k8, granularity="row")
    with pytest.raises(TypeError, match="granularity must be one of tensor, head, block, got 3"):
        cuattn.fp8.quantize_qkv(q8, k8, k8, granularity=3)
    with pytest.raises(TypeError, match="incoherent must be a bool, got 1"):
        cuattn.fp8.quantize_qkv(q8, k8, k8, incoherent=1)
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        cuattn.fp8.quantize_qkv(q8, k8, k8, incoherent=True, seed=-1)
    x = np.ones((1, 4, 2, 32), np.float32)
    with pytest.raises(ValueError, match=r"^k.shape\[3\] \(D\) must be a multiple of 16 \(the write kernel stores 16 "
                                         r"bytes at a time\), got 24$"):
        cuattn.fp8.quantize_qkv(x[..., :16], x[..., :24], x[..., :16])
    with pytest.raises(ValueError, match=r"^k.shape\[0\] \(B\) must equal q.shape\[0\] = 1, got 2$"):
        cuattn.fp8.quantize_qkv(x, np.ones((2, 4, 2, 32), np.float32), x)
    with pytest.raises(ValueError, match=r"^k.shape\[3\] \(D\) must equal q.shape\[3\] = 32, got 48$"):
        cuattn.fp8.quantize_qkv(x, np.ones((1, 4, 2, 48), np.float32), np.ones((1, 4, 2, 48), np.float32))
    with pytest.raises(ValueError, match=r"^v.shape\[1\] \(Sk\) must equal k.shape\[1\] = 4, got 3$"):
        cuattn.fp8.quantize_qkv(x, x, x[:, :3])
    with pytest.raises(ValueError, match=r"^v.shape\[2\] \(Hk\) must equal k.shape\[2\] = 1, got 2$"):
        cuattn.fp8.quantize_qkv(x, x[:, :, :1], x)
    with pytest.raises(ValueError, match="must be a power of two for the Hadamard rotation, got 96"):
        cuattn.fp8.hadamard_rotate(np.zeros((2, 96), np.float32), np.ones(96))
    with pytest.raises(ValueError, match=r"signs must have shape \(D,\) = \(64,\) \(x.shape\[-1\]\), got "
                                         r"\(32,\)"):
        cuattn.fp8.hadamard_rotate(np.zeros((2, 64), np.float32), np.ones(32))
    with pytest.raises(ValueError, match=r"x must be \(..., D\) with at least 1 axis, got shape \(\)"):
        cuattn.fp8.hadamard_rotate(np.ones((), np.float32), np.ones(1))
    with pytest.raises(TypeError, match="x.dtype is int32; expected float16, bfloat16, float32 or float64"):
        cuattn.fp8.hadamard_rotate(np.zeros((2, 64), np.int32), np.ones(64))


def _require_sm90():
    from cuattn import _jit

    if _jit.target_arch() != "sm_90a":
        pytest.skip(f"the FP8 forward needs sm_90a; this GPU is {_jit.target_arch()}")


# Hopper's e4m3 tensor cores add the products of a k32 step in a limited-precision accumulator
# (about 13 significant bits, aligned to the step's largest product; the 16-bit GEMMs' fp32 sums
# are near exact): measured on the H200 (tests/test_wgmma.py), a sum of e4m3 products carries an
# error of up to about 2^-11 of the sum of the products' magnitudes; 2^-10 bounds it.
FP8_ACCUMULATION = 2.0 ** -10


def fp8_score_error(q, k):
    """The largest score error that accumulation allows, in natural-log units: FP8_ACCUMULATION x
    softmax scale x the largest sum over d of |q_id k_jd| (real q [B, Sq, Hq, D], k [B, Sk, Hk, D])."""
    group = q.shape[2] // k.shape[2]
    magnitudes = np.einsum("bihd,bjhd->bhij", np.abs(q), np.repeat(np.abs(k), group, axis=2))
    return FP8_ACCUMULATION / np.sqrt(q.shape[-1]) * float(magnitudes.max())


def score_error_reach(q, k, v, causal, error):
    """How far score errors of at most ``error`` move out, to first order: out_i = sum_j p_ij v_j,
    and errors e_ij move it by sum_j p_ij (e_ij - mean) v_j = sum_j p_ij e_ij (v_j - out_i), at
    most error x sum_j p_ij |v_jd - out_id| (the largest over rows i and dims d)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    sq, sk = q.shape[1], k.shape[1]
    visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq if causal else np.ones((sq, sk), bool)
    reach = 0.0
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            scores = np.where(visible, q[b, :, h] @ k[b, :, h // group].T * scale, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            vh = v[b, :, h // group]
            spread = np.abs(vh[None, :, :] - (p @ vh)[:, None, :])  # [Sq, Sk, D]
            reach = max(reach, float(np.einsum("ij,ijd->id", p, spread).max()))
    return error * reach


# How far past the naive FP8 error an FP8 forward may land. Measured on the H200 over 96 draws of
# test_fp8_forward_matches_the_reference's inputs (tensor and per-head scales, D = 128, causal and
# not, bf16 and fp16 outputs): at most 1.61x the worst naive error over FP8_P_SCALES (0.54 of
# this budget), and over 32 draws at D = 256 0.40 of it. (Against the naive error at scale 1
# alone, a factor of 5 was exceeded about once in 25 draws.)
FP8_NAIVE_FACTOR = 3.0
# Scales P is rounded at in the naive emulations the budget takes the worst of: a third of an
# octave apart, so each rounds every probability differently (at 1 alone the row max rounds
# exactly, which the kernel's rows, scaled by their moved max, do not).
FP8_P_SCALES = (1.0, 2.0 ** (1 / 3), 2.0 ** (2 / 3))


def fp8_budget(real, out, causal, out_dtype, ref, alibi_slopes=None):
    """The tolerance of an FP8 forward: FP8_NAIVE_FACTOR x the naive FP8 error (fp8_emulated: the
    same inputs, P rounded to e4m3 once, exact otherwise) plus one unit of the output dtype, plus
    what the scores' accumulation error (fp8_score_error) reaches to first order
    (score_error_reach). The kernel rounds P against a lazily moved max, so each row's
    probabilities are rounded at a scale exp(max - moved max) of its own, and in another order:
    its errors are the naive ones' kind, not the same values: the naive error is the worst over
    the scales of FP8_P_SCALES."""
    naive_err = max(float(np.abs(fp8_emulated(*real, causal=causal, alibi_slopes=alibi_slopes, p_scale=c) - ref).max())
                    for c in FP8_P_SCALES)
    scores = score_error_reach(*real, causal, fp8_score_error(real[0], real[1]))
    return error_budget(naive_err, out_dtype, FP8_NAIVE_FACTOR, float(np.abs(ref).max())) + scores


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("granularity, shape", [
    ("tensor", (2, 197, 333, 4, 2)),   # odd lengths, GQA
    ("head", (1, 300, 300, 8, 8)),     # MHA
    ("block", (3, 129, 257, 6, 1)),    # MQA; partial last q and k scale blocks
], ids=["tensor-gqa", "head-mha", "block-mqa"])
def test_fp8_forward_matches_the_reference(head_dim, causal, granularity, shape):
    _require_sm90()
    cupy = _cupy()
    rng = np.random.default_rng()
    b, sq, sk, hq, hk = shape
    (q8, k8, v8), scales, real = fp8_inputs(rng, b, sq, sk, hq, hk, head_dim, granularity)
    for out_dtype in (BF16, np.float16):
        _check_fp8_forward((q8, k8, v8), scales, real, causal, out_dtype,
                           out=cupy.full(q8.shape, np.nan, out_dtype))


def _check_fp8_forward(qkv8, scales, real, causal, out_dtype=BF16, out=None):
    """cuattn.attention on e4m3 q, k, v (``qkv8``) with their q, k, v ``scales`` against the float64
    reference of their ``real`` values: the output within fp8_budget, lse within the scores' error."""
    cupy = _cupy()
    ref, ref_lse = reference.attention(*real, causal=causal, return_lse=True)
    out, lse = cuattn.attention(*(cupy.asarray(x.view(np.uint8)) for x in qkv8), causal=causal,
                                **{f"{n}_scale": cupy.asarray(sc) for n, sc in zip("qkv", scales)},
                                out_dtype=out_dtype, out=out, return_lse=True)
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all()
    err = float(np.abs(got - ref).max())
    assert err <= fp8_budget(real, got, causal, out_dtype, ref), (out_dtype, err)
    # P's rounding does not reach lse; the scores' accumulation error does, by at most its bound
    # (lse is a smooth maximum of the scores): the 16-bit forward's tolerance plus that
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-3, atol=2e-3 + fp8_score_error(real[0], real[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
@pytest.mark.parametrize("rise", list(RISES.values()), ids=list(RISES))
def test_fp8_forward_rising_scores(head_dim, rise):
    """Scores that rise block after block in the order the kernel visits keys: its softmax's exact
    path (the row max moved, the scores computed again) on every block (conftest.rising_scores)."""
    _require_sm90()
    rng = np.random.default_rng()
    q, k, v = rising_scores(rng, 2, 200, 700, 4, 2, head_dim, rise)
    q8, k8, v8, *scales = cuattn.fp8.quantize_qkv(q, k, v, granularity="head")
    real = [reference.dequantize_fp8(x, sc, 1) for x, sc in zip((q8, k8, v8), scales)]  # per-head scales
    for causal in (False, True):
        _check_fp8_forward((q8, k8, v8), scales, real, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_forward_with_alibi(head_dim, causal):
    """alibi_slopes run the FP8 kernel's ALIBI variant; Sq != Sk, so the distances are bottom-right."""
    _require_sm90()
    cupy = _cupy()
    rng = np.random.default_rng()
    (q8, k8, v8), scales, real = fp8_inputs(rng, 2, 197, 333, 4, 2, head_dim, "head")
    slopes = (2.0 ** (-8.0 * np.arange(1, 5) / 4)).astype(np.float32)
    ref = reference.attention(*real, causal=causal, alibi_slopes=slopes)
    out = cuattn.attention(*(cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8)), causal=causal,
                           **{f"{n}_scale": cupy.asarray(sc) for n, sc in zip("qkv", scales)},
                           alibi_slopes=cupy.asarray(slopes))
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all()
    assert float(np.abs(got - ref).max()) <= fp8_budget(real, got, causal, BF16, ref, alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
def test_fp8_forward_with_alibi_on_few_ctas(monkeypatch, head_dim):
    """The FP8 kernel's ALIBI variant on a persistent grid of 5 CTAs, each walking several tiles of
    different (sequence, head) pairs, every pair with a random slope of its own ((B, Hq) slopes)."""
    _require_sm90()
    cupy = _cupy()
    monkeypatch.setattr(_jit, "multiprocessor_count", lambda device_id=None: 5)
    rng = np.random.default_rng()
    (q8, k8, v8), scales, real = fp8_inputs(rng, 2, 400, 333, 4, 2, head_dim, "head")
    slopes = rng.uniform(-0.05, 0.5, (2, 4)).astype(np.float32)
    ref = reference.attention(*real, alibi_slopes=slopes)
    out = cuattn.attention(*(cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8)),
                           **{f"{n}_scale": cupy.asarray(sc) for n, sc in zip("qkv", scales)},
                           alibi_slopes=cupy.asarray(slopes))
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all()
    assert float(np.abs(got - ref).max()) <= fp8_budget(real, got, False, BF16, ref, alibi_slopes=slopes)


@pytest.mark.gpu
def test_fp8_forward_host_float_scales_and_torch():
    _require_sm90()
    torch = pytest.importorskip("torch")
    (q8, k8, v8), _, _ = fp8_inputs(np.random.default_rng(), 2, 256, 512, 4, 4, 128, "tensor")
    real = [x.astype(np.float64) * sc for x, sc in ((q8, 0.02), (k8, 0.03), (v8, 0.5))]
    ref = reference.attention(*real)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn) for x in (q8, k8, v8))
    out = cuattn.attention(tq, tk, tv, q_scale=0.02, k_scale=0.03, v_scale=0.5, out_dtype=torch.float16)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    got = out.float().cpu().numpy().astype(np.float64)
    assert float(np.abs(got - ref).max()) <= fp8_budget(real, got, False, np.float16, ref)


@pytest.mark.gpu
def test_fp8_forward_accuracy_on_outliers():
    """RMSE against float64 on FlashAttention-3's outlier inputs, per mode, under FP8_RMSE_BOUNDS;
    bf16 through the bf16 kernel for comparison. The numbers the benchmark reports."""
    _require_sm90()
    cupy = _cupy()
    errors = {}
    for mode, (granularity, incoherent) in FP8_MODES.items():
        rng = np.random.default_rng(11)
        (q8, k8, v8), scales, _ = fp8_inputs(rng, 1, 1024, 1024, 4, 4, 128, granularity, incoherent)
        rng = np.random.default_rng(11)
        q, k, v = (outlier_inputs(rng, (1, 1024, 4, 128)) for _ in range(3))
        ref = reference.attention(q, k, v)
        out = cuattn.attention(*(cupy.asarray(x.view(np.uint8)) for x in (q8, k8, v8)),
                               **{f"{n}_scale": cupy.asarray(sc) for n, sc in zip("qkv", scales)})
        errors[mode] = rmse(out.get(), ref)
    bf16 = cuattn.attention(*(cupy.asarray(x.astype(BF16)) for x in (q, k, v)))
    errors["bf16"] = rmse(bf16.get(), ref)
    for mode, err in errors.items():
        assert err < FP8_RMSE_BOUNDS[mode], errors
    assert errors["incoherent"] < errors["plain"], errors


@pytest.mark.gpu
def test_fp8_forward_device_errors():
    cupy = _cupy()
    q8 = cupy.zeros((1, 64, 2, 64), np.uint8)
    from cuattn import _jit

    if _jit.target_arch() != "sm_90a":
        with pytest.raises(NotImplementedError, match="runs on sm_90a only .* Supported: sm_90a"):
            cuattn.attention(q8, q8, q8, q_scale=1.0, k_scale=1.0, v_scale=1.0)
        return
    with pytest.raises(ValueError, match=r"head_dim\) = 64 is not supported with FP8 inputs; supported head dims: 128, 256"):
        cuattn.attention(q8, q8, q8, q_scale=1.0, k_scale=1.0, v_scale=1.0)
    q8 = cupy.zeros((1, 64, 2, 128), np.uint8)
    with pytest.raises(TypeError, match="q_scale.dtype must be float32, got float64"):
        cuattn.attention(q8, q8, q8, q_scale=cupy.ones(2), k_scale=1.0, v_scale=1.0)


@pytest.mark.parametrize("registers", [40, 80, 84, 128])
def test_fp8_v_transpose_runs_at_most_its_ctas_per_sm(registers):
    """The V^T pass's shared-memory reservation caps it at FP8_TRANSPOSE_CTAS_PER_SM CTAs an sm_90 SM
    whatever its register count allows (the build report's occupancy rule)."""
    from cuattn import _tools

    spec = attention_module.fp8_transpose_spec()
    assert spec.smem_bytes <= _params.constant("kSm90MaxSmem")
    ctas = _tools._ctas_per_sm(spec, _jit.Resources(registers, 0, 0, 0, 0), "sm_90a")
    by_registers = _jit.ctas_by_registers(spec.threads, registers, _tools.REGISTERS_PER_SM)
    assert ctas == min(attention_module.FP8_TRANSPOSE_CTAS_PER_SM, by_registers) == min(2, by_registers)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_k", [37, 128, 1, 80])
def test_fp8_v_transpose_kernel_matches_numpy(seqlen_k):
    """fp8_v_transpose_kernel against fp8_v_transposed, bit for bit, on a strided view of V."""
    _require_sm90()
    cupy = _cupy()
    rng = np.random.default_rng()
    whole = rng.integers(0, 256, (2, seqlen_k, 6, 128), dtype=np.uint8)
    v = whole[:, :, 1::2]  # every other head: a head stride of 256 bytes
    got = attention_module._fp8_v_transposed_on_device(cupy.asarray(whole)[:, :, 1::2], None).get()
    np.testing.assert_array_equal(got, attention_module.fp8_v_transposed(v))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
@pytest.mark.parametrize("seqlen_k", [1, 37, 128, 300])
def test_fp8_forward_reads_v_views(head_dim, seqlen_k):
    """v a view (every other head) of a NaN-poisoned buffer a key block longer than Sk: the call
    reads only the view's rows (none of the poisoned heads, zeros past Sk) and gives the output of
    a contiguous copy bit for bit, within the reference's budget."""
    _require_sm90()
    cupy = _cupy()
    rng = np.random.default_rng()
    (q8, k8, v8), scales, real = fp8_inputs(rng, 2, 70, seqlen_k, 4, 2, head_dim, "head")
    block_n = attention_module.FWD_SM90_FP8_TILES[head_dim].block_n
    whole = np.full((2, seqlen_k + block_n, 4, head_dim), NAN_BYTES[0], np.uint8)
    whole[:, :seqlen_k, 1::2] = v8.view(np.uint8)
    v_view = cupy.asarray(whole)[:, :seqlen_k, 1::2]
    q, k = (cupy.asarray(x.view(np.uint8)) for x in (q8, k8))
    scale_args = {f"{n}_scale": cupy.asarray(sc) for n, sc in zip("qkv", scales)}
    got = cuattn.attention(q, k, v_view, **scale_args).get()
    np.testing.assert_array_equal(got, cuattn.attention(q, k, cupy.ascontiguousarray(v_view), **scale_args).get())
    ref = reference.attention(*real)
    got = got.astype(np.float64)
    assert float(np.abs(got - ref).max()) <= fp8_budget(real, got, False, BF16, ref)
