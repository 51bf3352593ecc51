"""Arrays in and out: NumPy runs the reference on the CPU; CuPy, torch and JAX round-trip zero-copy."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

import cuattn
from cuattn import _arrays, reference
from conftest import BF16, ForeignDtype, Tensor, error_budget, import_jax, randn


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64], ids=str)
def test_numpy_in_numpy_out_in_the_input_dtype(rng, dtype):
    q = randn(rng, (2, 9, 4, 32), dtype)
    k = randn(rng, (2, 11, 2, 32), dtype)
    v = randn(rng, (2, 11, 2, 32), dtype)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, ref.astype(dtype))
    np.testing.assert_array_equal(lse, ref_lse.astype(np.float32))


def test_numpy_out_argument_is_filled(rng):
    q = randn(rng, (1, 5, 2, 64), np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    result = cuattn.attention(q, q, q, out=out)
    assert result is out
    np.testing.assert_array_equal(out, reference.attention(q, q, q).astype(np.float32))


def test_numpy_varlen_matches_reference(rng):
    cu = np.array([0, 3, 10], np.int32)
    q = randn(rng, (10, 2, 64), np.float32)
    out = cuattn.attention_varlen(q, q, q, cu, cu, 7, 7, causal=True)
    np.testing.assert_array_equal(out, reference.attention_varlen(q, q, q, cu, cu, 7, 7, causal=True).astype(np.float32))


def test_array_kind():
    assert _arrays.array_kind(np.zeros(1)) == "numpy"

    class Foreign:
        def __dlpack__(self):
            raise NotImplementedError

    assert _arrays.array_kind(Foreign()) == "dlpack"
    with pytest.raises(TypeError, match="the argument must be a NumPy, CuPy, torch or JAX array .*got builtins.float"):
        _arrays.array_kind(3.0)
    with pytest.raises(TypeError, match=r"q must be a NumPy, CuPy, torch or JAX array .*got None"):
        _arrays.array_kind(None, "q")


@pytest.mark.parametrize("jax_arg", ["q", "k"])
def test_numpy_and_jax_arrays_in_one_call_are_refused_by_name(jax_arg):
    """JAX CPU arrays beside NumPy ones: the framework check names every argument's framework."""
    jnp = import_jax("jax.numpy")
    rng = np.random.default_rng()
    named = {"q": randn(rng, (1, 5, 4, 64)), "k": randn(rng, (1, 7, 2, 64)), "v": randn(rng, (1, 7, 2, 64))}
    named[jax_arg] = jnp.asarray(named[jax_arg])
    listing = ", ".join(f"{name} is {'jax' if name == jax_arg else 'numpy'}" for name in named)
    with pytest.raises(TypeError, match=rf"^all array arguments must come from one framework; {listing}$"):
        cuattn.attention(**named)


def test_dtype_table_names_bfloat16():
    assert _arrays.CUDA_TYPES[BF16] == "__nv_bfloat16"
    assert _arrays.CUDA_TYPES[np.dtype(np.float16)] == "__half"
    assert _arrays.dtype_name(BF16) == "bfloat16"


@pytest.mark.parametrize("name, expected", [("bfloat16", False), ("float16", False), ("float8_e4m3fn", True),
                                            ("uint8", True)])
def test_is_e4m3_reads_a_dtype_numpy_cannot(name, expected):
    """cascade_attention asks it of the caller's raw q: a torch tensor's dtype must not raise (it
    did, failing every torch call of cascade_attention on the GPU)."""

    class Raw:
        dtype = ForeignDtype(name)

    with pytest.raises(TypeError):
        np.dtype(Raw.dtype)
    assert _arrays.is_e4m3(Raw()) is expected
    assert _arrays.is_e4m3(np.zeros(1, np.uint8)) and _arrays.is_e4m3(np.zeros(1, _arrays.FLOAT8_E4M3))
    assert not _arrays.is_e4m3(np.zeros(1, BF16))


@pytest.mark.parametrize("check, wanted", [(_arrays.check_int32, "int32"), (_arrays.check_float32, "float32")])
def test_int32_and_float32_checks_read_a_dtype_numpy_cannot(check, wanted):
    """The callers check a caller's raw array before copying it to the host, where a torch dtype
    NumPy lacks (float8_e5m2) failed with torch's message, not the argument's."""
    check("x", Tensor((2,), wanted))
    check("x", np.zeros(2, wanted))
    with pytest.raises(TypeError, match=rf"^x.dtype must be {wanted}, got float8_e5m2$"):
        check("x", Tensor((2,), "float8_e5m2"))
    with pytest.raises(TypeError, match=rf"^x.dtype must be {wanted}, got {wanted} \(big-endian\)$"):
        check("x", np.zeros(2, np.dtype(wanted).newbyteorder(">")))


def test_torch_cpu_tensors_are_refused_before_cupy_is_needed(monkeypatch):
    """The answer to a CPU tensor is the same on a machine without CuPy (it was its ImportError)."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(ValueError, match=r"torch tensors must be on a CUDA device, got cpu; for CPU work pass "
                                         r"NumPy arrays \(x.numpy\(\)\)"):
        with _arrays.array_context(q=Tensor((1, 4, 2, 64)), k=Tensor((1, 4, 2, 64))):
            pass
    # a CPU tensor after a CUDA one is refused by name, not handed to CuPy
    cuda_q = Tensor((1, 4, 2, 64))
    cuda_q.is_cuda, cuda_q.device = True, "cuda:0"
    with pytest.raises(ValueError, match=r"torch tensors must be on a CUDA device, got cpu for v; "):
        with _arrays.array_context(q=cuda_q, k=cuda_q, v=Tensor((1, 4, 2, 64))):
            pass
    # an array viewed beside them (a scale) is held to the same rule
    with pytest.raises(ValueError, match=r"torch tensors must be on a CUDA device, got cpu; "):
        _arrays.ArrayContext("torch", None, 0).view(Tensor((2,), "float32"))


@pytest.mark.gpu
def test_cupy_in_cupy_out(rng):
    import cupy

    q = cupy.asarray(randn(rng, (1, 33, 2, 64), BF16))
    out = cuattn.attention(q, q, q)
    assert isinstance(out, cupy.ndarray) and out.dtype == BF16 and out.shape == q.shape


@pytest.mark.gpu
def test_torch_round_trip_keeps_dtype_and_pointer():
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 17, 2, 64, device="cuda", dtype=torch.bfloat16)
    with _arrays.array_context(x=x) as ctx:
        view = ctx.view(x)
        assert view.data.ptr == x.data_ptr() and view.dtype == BF16
        back = ctx.to_caller(view)
    assert back.data_ptr() == x.data_ptr() and back.dtype == torch.bfloat16


@pytest.mark.gpu
def test_torch_work_runs_on_torchs_current_stream():
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 17, 2, 64, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with _arrays.array_context(x=x) as ctx:
            assert ctx.stream.ptr == side.cuda_stream


def test_torch_export_leaves_out_the_stream_handshake():
    """ctx.view and ctx.empty hand torch tensors to cupy.from_dlpack through _TorchExport, which
    drops the consumer's stream (cuattn converts on torch's current stream, where torch's wait
    would be a no-op costing 10-20 us) and passes DLPack's version arguments on."""
    seen = []

    class Exporter:
        def __dlpack__(self, **kwargs):
            seen.append(kwargs)
            return "capsule"

        def __dlpack_device__(self):
            return (2, 1)

    export = _arrays._TorchExport(Exporter())
    assert export.__dlpack__(stream=7, max_version=(1, 0)) == "capsule"
    assert export.__dlpack__(stream=7) == "capsule"
    assert seen == [{"max_version": (1, 0)}, {}]
    assert export.__dlpack_device__() == (2, 1)


def test_stream_handles_speak_the_cuda_stream_protocol():
    """XLA and torch give a bare cudaStream_t address; CuPy 14 wraps only objects with
    ``__cuda_stream__`` (version 0, the address)."""
    assert _arrays._StreamHandle(0x7F00).__cuda_stream__() == (0, 0x7F00)


@pytest.mark.gpu
def test_torch_calls_raise_no_deprecation_warnings(rng):
    """Each call wraps torch's stream for CuPy; CuPy 14 deprecated ExternalStream, whose warning
    reached the caller on every call."""
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(randn(rng, (1, 33, 2, 64))).to("cuda", torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _arrays.array_context(q=q) as ctx:
            assert ctx.stream.ptr == torch.cuda.current_stream().cuda_stream
        cuattn.attention(q, q, q, causal=True)
    torch.cuda.synchronize()
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, DeprecationWarning)]
    assert not deprecated, deprecated


def _second_gpu_or_skip(torch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"a tensor on a second GPU needs 2 CUDA devices, found {torch.cuda.device_count()}")


@pytest.mark.gpu
def test_torch_tensors_on_a_second_gpu_run_there_while_the_first_is_current(rng):
    """The stream handle records the device it is made under: made while cuda:0 was current, a
    call on cuda:1 tensors failed CuPy's stream-device check. Twice: a plan launches only where
    its device is current, so the repeated call takes the full path again."""
    torch = pytest.importorskip("torch")
    _second_gpu_or_skip(torch)
    shape = (2, 77, 4, 64)
    with torch.cuda.device(0):
        for _ in range(2):
            q, k, v = (randn(rng, shape, BF16) for _ in range(3))
            on_second = [torch.from_numpy(x.astype(np.float32)).to("cuda:1", torch.bfloat16) for x in (q, k, v)]
            out = cuattn.attention(*on_second, causal=True)
            assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
            got = out.float().cpu().numpy().astype(np.float64)
            ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
            naive = reference.naive_attention_lowp(q, k, v, causal=True, dtype=BF16)
            budget = error_budget(np.abs(naive - ref).max(), BF16, 2.0, np.abs(ref).max())
            assert np.abs(got - ref).max() <= budget


@pytest.mark.gpu
def test_torch_views_of_strided_tensors_made_on_a_side_stream():
    """A tensor written on a side stream and viewed there: same memory, strides and values."""
    torch = pytest.importorskip("torch")
    import cupy

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(2, 64, 3, 40, device="cuda", dtype=torch.float16).transpose(1, 2)
        with _arrays.array_context(x=x) as ctx:
            view = ctx.view(x)
            assert view.data.ptr == x.data_ptr() and view.strides == tuple(2 * n for n in x.stride())
            made = ctx.empty((4, 8), np.float32)
            made.fill(3.0)
            copied = view.copy()
            result = ctx.to_caller(made)
    side.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(copied), x.cpu().numpy())
    assert isinstance(result, torch.Tensor) and bool((result == 3.0).all())


@pytest.mark.gpu
def test_jax_round_trip_keeps_dtype_and_values(rng):
    jax = import_jax()
    x = jax.numpy.asarray(randn(rng, (1, 9, 2, 32), BF16))
    with _arrays.array_context(x=x) as ctx:
        view = ctx.view(x)
        assert view.dtype == BF16
        back = ctx.to_caller(view)
    assert back.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_torch_dtypes_map_every_buffer_type_and_refuse_others():
    """Buffers allocated through torch: results (fp16, bf16), workspaces (float32) and the
    backward's int32 semaphores; an unmapped dtype raises KeyError instead of recursing."""
    pytest.importorskip("torch")
    import torch

    table = _arrays._TorchDtypes()
    assert table[np.dtype(np.int32)] is torch.int32 and table[_arrays.BFLOAT16] is torch.bfloat16
    with pytest.raises(KeyError, match="no torch dtype for complex64"):
        table[np.dtype(np.complex64)]


def test_host_planned_ints_stay_on_the_host_for_numpy_calls():
    cu, rows = np.array([0, 3, 7], np.int32), np.arange(6).reshape(2, 3)
    with _arrays.array_context(q=np.zeros(1)) as ctx:
        got = ctx.ints(cu, rows)
    assert got[0] is cu and got[1] is rows


@pytest.mark.gpu
def test_host_planned_ints_reach_the_device_in_one_buffer():
    import cupy

    cu, rows, empty = np.array([0, 3, 7], np.int32), np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros(0, np.int64)
    with _arrays.array_context(q=cupy.zeros(1)) as ctx:
        got = ctx.ints(cu, rows, empty)
    assert [x.shape for x in got] == [(3,), (2, 3), (0,)] and all(x.dtype == np.int32 for x in got)
    assert np.array_equal(got[0].get(), cu) and np.array_equal(got[1].get(), rows)
    # views of one allocation: one host-to-device copy
    assert got[1].data.ptr == got[0].data.ptr + cu.nbytes
