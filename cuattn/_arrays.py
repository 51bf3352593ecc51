"""Arrays in and out: DLPack conversion, the dtype table, validation, and the stream to launch on.

The only module that converts or validates arrays. The public functions hand it their array
arguments; it tells which framework they came from ("numpy", "cupy", "torch", "jax", or "dlpack"
for any other CUDA array with ``__dlpack__``), views them as CuPy arrays without a copy, picks the
caller's current stream (torch's through ``cupy.cuda.Stream.from_external``), and converts
results back to the caller's framework, again without a copy. NumPy arrays stay on the host: the
public functions run the float64 reference for them.

The checks here produce cuattn's error messages (README, "Errors"): they name the argument, the axis,
what was expected and what came. A JAX tracer (an array inside jax.jit, jax.grad or jax.vmap) is
refused here with a pointer to ``cuattn.jax``, which runs the same functions under those
transformations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import ml_dtypes
import numpy as np

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# numpy dtype -> the C++ type the kernels are instantiated with
CUDA_TYPES = {FLOAT16: "__half", BFLOAT16: "__nv_bfloat16"}
# what the CPU reference takes besides: float32 and float64 (it computes in float64). Not any float
# kind: ml_dtypes' float8_e5m2 and np.longdouble are kind "f" too, and no kernel takes them.
HOST_FLOAT_TYPES = (FLOAT16, BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
# FP8 KV caches hold float8 e4m3 (e4m3fn: no infinities, largest value 448). NumPy holds it as
# ml_dtypes' float8_e4m3fn; CuPy has no float8 type and holds the bytes as uint8 (so a uint8
# cache is read as e4m3, on the host too); torch.float8_e4m3fn tensors are viewed as uint8.
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_STORAGE = np.dtype(np.uint8)
E4M3_TYPE = "cuattn::e4m3"
E4M3_MAX = 448.0
# Kernels move 16 bytes per thread per load; every row they address must start on that boundary.
VECTOR_BYTES = 16
# Head dims every kernel family takes: the multiples of HEAD_DIM_STEP up to MAX_HEAD_DIM. A kernel
# is instantiated for a few tile head dims (each family's tile table) and serves any head dim up to
# its tile given at run time: a row of 8 fp16/bf16 elements is one 16-byte copy, so the columns past
# the head dim are whole copies that are zero-filled on load and skipped on store. An e4m3 cache
# (1-byte elements) takes multiples of E4M3_HEAD_DIM_STEP, for the same reason.
HEAD_DIM_STEP = 8
MAX_HEAD_DIM = 256
E4M3_HEAD_DIM_STEP = 16
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_STEP, MAX_HEAD_DIM + 1, HEAD_DIM_STEP))
HEAD_DIM_RULE = f"head_dim must be a multiple of {HEAD_DIM_STEP} from {HEAD_DIM_STEP} to {MAX_HEAD_DIM}"


class _TorchDtypes(dict):
    """NumPy dtype -> torch dtype, filled on first use (torch is imported only when a caller uses it)."""

    def __missing__(self, dtype):
        import torch

        if not self:
            # results, workspaces (float32) and the backward's semaphores (int32)
            self.update({FLOAT16: torch.float16, BFLOAT16: torch.bfloat16, np.dtype(np.float32): torch.float32,
                         np.dtype(np.int32): torch.int32, np.dtype(np.uint8): torch.uint8})
            if dtype in self:
                return dict.__getitem__(self, dtype)
        raise KeyError(f"internal: no torch dtype for {dtype_name(dtype)}")


TORCH_DTYPES = _TorchDtypes()


def dtype_name(dtype) -> str:
    """A dtype's name in messages, its byte order too where it is not the machine's (big-endian
    float32 and native float32 are different dtypes with one name)."""
    dtype = np.dtype(dtype)
    name = "bfloat16" if dtype == BFLOAT16 else dtype.name
    return name if dtype.isnative else f"{name} ({'big' if dtype.byteorder == '>' else 'little'}-endian)"


def any_dtype_name(dtype) -> str:
    """dtype_name of any framework's dtype (torch's too, which NumPy cannot interpret)."""
    try:
        return dtype_name(dtype)
    except TypeError:
        return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Which framework an array comes from

# DLPack's device type of host memory (kDLCPU)
DLPACK_CPU = 1


def array_kind(x, name: str | None = None) -> str:
    """The framework of array ``x`` (argument ``name``, for the error on anything else)."""
    module = type(x).__module__.split(".")[0]
    if isinstance(x, np.ma.MaskedArray):
        # its mask would be ignored (the kernels and the reference read the data)
        raise TypeError(f"{name or 'the argument'} is a masked array; pass {name or 'it'}.filled(value) or the "
                        "data without a mask")
    if isinstance(x, np.ndarray):
        return "numpy"
    if module == "cupy":
        return "cupy"
    if module == "torch":
        return "torch"
    if module in ("jax", "jaxlib"):
        return "jax"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    what = "None" if x is None else f"{type(x).__module__}.{type(x).__name__}"
    raise TypeError(
        f"{name or 'the argument'} must be a NumPy, CuPy, torch or JAX array (or any array with __dlpack__), "
        f"got {what}"
    )


def check_not_traced(name: str, x) -> None:
    """Refuse a JAX tracer (an array inside jax.jit, jax.grad or jax.vmap): it has no device buffer to
    view, and DLPack would fail with a message that does not say why. jax is looked up, never
    imported: an array can only be a tracer once jax is loaded."""
    jax = sys.modules.get("jax")
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    if tracer is not None and isinstance(x, tracer):
        raise TypeError(
            f"{name} is a JAX tracer ({type(x).__name__}): the plain cuattn functions take concrete arrays and "
            "cannot run inside jax.jit, jax.grad or jax.vmap; use the same function from cuattn.jax "
            "(import cuattn.jax; cuattn.jax.attention(q, k, v, ...)), which does"
        )


# Array arguments that may be None (absent) wherever a call names them; any other array argument
# must be given. The backward functions' `out`, which they require, is checked by them.
OPTIONAL_ARRAYS = frozenset(("out", "sinks", "alibi_slopes"))


def require(**named) -> None:
    """Refuse None for array arguments that OPTIONAL_ARRAYS lets pass elsewhere (a backward's `out`)."""
    for name, x in named.items():
        if x is None:
            array_kind(x, name)


def common_kind(named: dict) -> str:
    """The one framework all given arrays come from; mixing frameworks is refused, and so is None
    for an array argument outside OPTIONAL_ARRAYS."""
    for name, x in named.items():
        check_not_traced(name, x)
    kinds = {name: array_kind(x, name) for name, x in named.items() if x is not None or name not in OPTIONAL_ARRAYS}
    distinct = set(kinds.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{name} is {kind}" for name, kind in kinds.items())
        raise TypeError(f"all array arguments must come from one framework; {listing}")
    return distinct.pop()


class _StreamHandle:
    """A raw ``cudaStream_t`` address as the CUDA stream protocol's object, which is what
    ``cupy.cuda.Stream.from_external`` reads (XLA gives a bare address; torch versions before the
    protocol give ``cuda_stream`` alone)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr: int, device_id: int):
    """CuPy's handle on a stream another framework owns (torch, XLA, a process group's), at address
    ``ptr`` on device ``device_id``.

    ``Stream.from_external`` takes the stream's device to be the current one, so the handle is made
    with ``device_id`` current: made under another device, entering it beside ``device_id`` (a
    tensor on cuda:1 while cuda:0 is current) fails CuPy's stream-device check."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


def _torch_stream(x):
    """CuPy's handle on torch's current stream of x's device, and that device's index."""
    import torch

    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return external_stream(torch.cuda.current_stream(device).cuda_stream, device), device


class _TorchExport:
    """A torch tensor as cupy.from_dlpack sees it, without DLPack's stream handshake.

    ``from_dlpack`` passes the consumer's stream (CuPy's current one) to ``__dlpack__``, and torch
    then makes that stream wait for its own current stream (a stream handle, an event and a
    wait, in Python): a view took 19-29 us of host time with it and 9 us without on the H200's
    host. cuattn converts tensors only inside ``array_context``, where CuPy's current stream IS
    torch's current stream, so the wait is a no-op and is left out."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **versions):
        # (versions: max_version, dl_device, copy, where the caller and torch know them)
        return self.tensor.__dlpack__(**versions)


def _cupy_view_of_torch(tensor):
    """A zero-copy CuPy view of a CUDA tensor, on the current stream (see _TorchExport)."""
    import cupy

    return cupy.from_dlpack(_TorchExport(tensor))


class ArrayContext:
    """Holds one call's framework and stream; converts inputs to CuPy views and outputs back."""

    def __init__(self, kind: str, stream, device_id: int | None):
        self.kind = kind
        self.stream = stream
        self.device_id = device_id
        self._made = {}  # id(CuPy view) -> the caller's array it views (outputs made by empty())

    def empty(self, shape, dtype):
        """A new output: allocated by the caller's framework (torch's caching allocator for torch
        inputs, so freed memory returns to the pool the caller manages), as the CuPy view the
        kernels write; :meth:`to_caller` hands back the caller's own array."""
        import cupy

        if self.kind != "torch":
            return cupy.empty(shape, dtype)
        import torch

        tensor = torch.empty(tuple(shape), dtype=TORCH_DTYPES[np.dtype(dtype)], device=f"cuda:{self.device_id}")
        view = _cupy_view_of_torch(tensor)
        self._made[id(view)] = (view, tensor)
        return view

    @property
    def on_host(self) -> bool:
        return self.kind == "numpy"

    def ints(self, *arrays):
        """Integer arrays planned on the host (indices, lengths, prefix sums below 2^31), where the
        kernels read them: as int32 CuPy arrays that are views of one buffer, brought over in ONE
        copy (each small host-to-device copy costs 0.1-0.25 ms of host time, more than a planned
        call's Python), or on the host as they are."""
        if self.on_host:
            return arrays
        import cupy

        flat = [np.asarray(x).reshape(-1) for x in arrays]
        device = cupy.asarray(np.concatenate(flat).astype(np.int32) if flat else np.zeros(0, np.int32))
        ends = np.cumsum([x.size for x in flat])
        return tuple(device[end - x.size:end].reshape(np.shape(a)) for a, x, end in zip(arrays, flat, ends))

    def int_view(self, name: str, lists: dict, arrays: dict):
        """Int32 argument ``name`` (split by :func:`int_lists`) where the kernels read it: one given
        as a list as its NumPy array on the CPU path, copied onto the device otherwise (pass device
        arrays to keep a call free of copies); an array as :meth:`view` gives it."""
        if name not in lists:
            return self.view(arrays[name])
        return lists[name] if self.on_host else self.ints(lists[name])[0]

    def view(self, x):
        """What the checks and kernels work on: NumPy arrays as they are, device arrays as zero-copy CuPy views."""
        if x is None or self.kind in ("numpy", "cupy"):
            return x
        if self.kind == "torch":
            # an array beside the named ones (a scale) that array_context did not see
            check_torch_on_cuda(x)
        import cupy

        if self.kind == "torch":
            if x.requires_grad:
                # the kernels do not record autograd history (cuattn.torch does): share the storage
                x = x.detach()
            if x.dtype == _torch_e4m3():
                x = x.view(torch_uint8())  # CuPy has no float8 type: its bytes, as CuPy holds e4m3
            return _cupy_view_of_torch(x)
        return cupy.from_dlpack(x)

    def to_caller(self, x):
        """A result in the caller's framework, zero-copy."""
        if x is None or self.kind in ("numpy", "cupy", "dlpack"):
            return x
        if self.kind == "torch":
            made = self._made.get(id(x))
            if made is not None and made[0] is x:
                return made[1]
            import torch

            return torch.from_dlpack(x)
        import jax.numpy as jnp

        return jnp.from_dlpack(x)


def check_torch_on_cuda(x, name: str | None = None) -> None:
    """A torch tensor the kernels can read: on a CUDA device (``name``, where given, says which
    argument is not)."""
    if not x.is_cuda:
        raise ValueError(f"torch tensors must be on a CUDA device, got {x.device}{f' for {name}' if name else ''}; "
                         "for CPU work pass NumPy arrays (x.numpy())")


@contextlib.contextmanager
def array_context(**named):
    """Enter a call: pick the framework and device of ``named`` arrays and make the caller's stream current.

    Torch work is queued on torch's current stream, so results are ordered with the caller's other
    work without any host synchronisation; other frameworks use CuPy's current stream.
    """
    kind = common_kind(named)
    if kind == "numpy":
        yield ArrayContext(kind, None, None)
        return
    first_name, first = next((n, x) for n, x in named.items() if x is not None)
    device_of = getattr(first, "__dlpack_device__", None)
    if kind in ("jax", "dlpack") and device_of is not None and device_of()[0] == DLPACK_CPU:
        raise TypeError(f"{first_name} is a {kind} array on the CPU; the plain functions take GPU arrays, or NumPy "
                        f"arrays for the CPU reference (np.asarray({first_name})); under JAX use cuattn.jax")
    # every tensor, not the first alone (a CPU k beside a CUDA q would reach CuPy's DLPack import),
    # and before CuPy is imported: a machine without it gets this answer too
    for name, x in named.items() if kind == "torch" else ():
        if x is not None:
            check_torch_on_cuda(x, None if x is first else name)
    import cupy

    if kind == "torch":
        stream, device_id = _torch_stream(first)
    else:
        device_id = _device_of(cupy.from_dlpack(first) if kind != "cupy" else first)
        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.get_current_stream()
    with cupy.cuda.Device(device_id), stream:
        yield ArrayContext(kind, stream, device_id)


def _torch_e4m3():
    import torch

    return getattr(torch, "float8_e4m3fn", None)


def torch_uint8():
    import torch

    return torch.uint8


def _device_of(x) -> int:
    return int(x.device.id)


def to_numpy(x) -> np.ndarray:
    """Host copy of any supported array (for tests and the reference path)."""
    kind = array_kind(x)
    if kind == "numpy":
        return x
    if kind == "cupy":
        return x.get()
    if kind == "torch":
        import torch

        if x.dtype == torch.bfloat16:
            return x.detach().float().cpu().numpy().astype(BFLOAT16)
        if x.dtype == _torch_e4m3():
            return x.detach().view(torch.uint8).cpu().numpy().view(FLOAT8_E4M3)
        return x.detach().cpu().numpy()
    return np.asarray(x)


# ---------------------------------------------------------------------------------------------
# Validation: every message names the argument, the axis, what was expected and what came


def check_ndim(name: str, x, layout: str) -> None:
    """``layout`` is the axes' names, e.g. "(B, Sq, Hq, D)"."""
    ndim = layout.count(",") + 1
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def check_axis(name: str, x, axis: int, axis_name: str, expected: int, expected_from: str) -> None:
    """``{name}.shape[axis] ({axis_name}) must equal {expected_from} = {expected}, got ...``."""
    actual = int(x.shape[axis])
    if actual != expected:
        raise ValueError(
            f"{name}.shape[{axis}] ({axis_name}) must equal {expected_from} = {expected}, got {actual}"
        )


def check_positive(name: str, x, axis: int, axis_name: str) -> None:
    if int(x.shape[axis]) < 1:
        raise ValueError(f"{name}.shape[{axis}] ({axis_name}) must be at least 1, got {x.shape[axis]}")


def check_float_dtype(name: str, x) -> None:
    dtype = np.dtype(x.dtype)
    if dtype not in CUDA_TYPES:
        raise TypeError(
            f"{name}.dtype is {dtype_name(dtype)}; cuattn kernels take float16 or bfloat16: "
            f"cast with {name}.astype(cupy.float16) (torch: {name}.half())"
        )


def check_host_float_dtype(name: str, x) -> None:
    """NumPy inputs run the float64 reference: HOST_FLOAT_TYPES; not integers, other float8 kinds
    or long doubles, nor e4m3 but where the device path takes it too (FP8 attention's q, k and v,
    e4m3 caches: their own checks)."""
    dtype = np.dtype(x.dtype)
    if dtype == FLOAT8_E4M3:
        raise TypeError(f"{name}.dtype is float8_e4m3fn; expected float16, bfloat16, float32 or float64 here (e4m3 "
                        "is taken by FP8 attention's q, k and v and by e4m3 KV caches)")
    if dtype not in HOST_FLOAT_TYPES:
        raise TypeError(f"{name}.dtype is {dtype_name(dtype)}; expected float16, bfloat16, float32 or float64 (the "
                        "CPU reference computes in float64)")


def check_dtypes(named: dict, host: bool) -> None:
    """Every array in ``named`` has the first one's dtype: float16 or bfloat16 for the kernels,
    any float dtype for the host reference (which computes in float64 either way)."""
    (ref_name, ref), *rest = named.items()
    (check_host_float_dtype if host else check_float_dtype)(ref_name, ref)
    for name, x in rest:
        check_same_dtype(name, x, ref_name, ref)


def check_same_dtype(name: str, x, ref_name: str, ref) -> None:
    """``x`` and ``ref`` (arrays of one framework, any: torch's dtypes compare among themselves,
    though NumPy cannot read them) hold one dtype."""
    if x.dtype != ref.dtype:
        raise TypeError(
            f"{name}.dtype must equal {ref_name}.dtype = {any_dtype_name(ref.dtype)}, "
            f"got {any_dtype_name(x.dtype)}"
        )


def check_int(name: str, value, minimum: int, maximum: int | None = None, *, optional: bool = False,
              why: str = "") -> int | None:
    """A host count or length: an int, not a bool (else TypeError), in [minimum, maximum] (else
    ValueError); returned as an int. ``optional``: None passes (and is returned). ``why`` ends the
    message (where the bounds come from)."""
    if optional and value is None:
        return None
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    message = f"{name} must be {'None or ' if optional else ''}an int {bounds}{why}, got {value!r}"
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(message)
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(message)
    return int(value)


def as_float(value) -> float:
    """A Python or NumPy number as a float; an int too large for one is inf (refused as such by
    the range checks that follow, rather than raising OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def show_number(value) -> str:
    """A number as an error message shows it: its repr, or for a huge int its float rounding."""
    text = repr(value)
    return text if len(text) <= 24 else f"{as_float(value):.6g} ({len(text)} digits)"


def check_int32(name: str, x) -> None:
    """An int32 argument (lengths, tables, prefix sums), any framework's array: its dtype is read by
    name, so a caller's torch array is checked before it is copied to the host (to_numpy)."""
    if any_dtype_name(x.dtype) != "int32":
        raise TypeError(f"{name}.dtype must be int32, got {any_dtype_name(x.dtype)}")


INT32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


def host_int32(name: str, x):
    """Host ints given as a list or tuple, as an int32 NumPy array: every entry an int that fits
    in int32 (the kernels' type). Arrays pass through, to be checked as arrays."""
    if not isinstance(x, (list, tuple)):
        return x
    try:
        values = np.asarray(x)
    except ValueError as exc:  # ragged nesting
        raise ValueError(f"{name} must be a rectangular list of ints, got {x!r:.80}") from exc
    if values.size and (values.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold int32 values, got {values.dtype} values")
    if values.size and (int(values.min()) < INT32_RANGE[0] or int(values.max()) > INT32_RANGE[1]):
        raise ValueError(f"{name} must hold int32 values (in [{INT32_RANGE[0]}, {INT32_RANGE[1]}]), got "
                         f"{int(values.min())} .. {int(values.max())}")
    return values.astype(np.int32)


def int_lists(**named) -> tuple[dict, dict]:
    """Int arguments split in two: those given as lists or tuples of host ints, as int32 NumPy
    arrays (host_int32), and the others, arrays that join array_context (the call's framework
    comes from its arrays alone); ArrayContext.int_view puts each where the kernels read it."""
    lists = {name: host_int32(name, x) for name, x in named.items() if isinstance(x, (list, tuple))}
    return lists, {name: x for name, x in named.items() if name not in lists}


def element_strides(x) -> tuple[int, ...]:
    """Strides in elements (CuPy and NumPy report bytes)."""
    itemsize = x.dtype.itemsize
    return tuple(s // itemsize for s in x.strides)


def check_last_axis(name: str, x) -> None:
    """Any strides but a contiguous last axis (head_dim): the layout rule of every path, the CPU
    reference's too (the kernels' alignment rules, check_kernel_layout, are the device's)."""
    if x.size and x.shape[-1] > 1 and element_strides(x)[-1] != 1:
        raise ValueError(
            f"{name} must be contiguous in its last axis (head_dim): {name}.strides[-1] is "
            f"{element_strides(x)[-1]} elements, expected 1; pass {name}.copy() or a view with a contiguous last axis"
        )


def check_last_axes(named: dict) -> None:
    """check_last_axis of every array in ``named`` (None: not given)."""
    for name, x in named.items():
        if x is not None:
            check_last_axis(name, x)


def check_kernel_layout(name: str, x) -> None:
    """The kernels read rows of 16 bytes: the last axis must be contiguous and every row aligned."""
    if x.size == 0:
        return
    check_last_axis(name, x)
    strides = element_strides(x)
    per_vector = VECTOR_BYTES // x.dtype.itemsize
    for axis, stride in enumerate(strides[:-1]):
        if x.shape[axis] > 1 and stride % per_vector:
            raise ValueError(
                f"{name}.strides[{axis}] must be a multiple of {per_vector} elements "
                f"({VECTOR_BYTES} bytes) for vector loads, got {stride}"
            )
    if x.data.ptr % VECTOR_BYTES:
        raise ValueError(f"{name} must start on a {VECTOR_BYTES}-byte boundary (an offset view?)")


def check_same_device(name: str, x, ref_name: str, ref) -> None:
    if _device_of(x) != _device_of(ref):
        raise ValueError(
            f"{name} is on device {_device_of(x)} but {ref_name} is on device {_device_of(ref)}; "
            "all arrays must be on one GPU"
        )


def check_float32(name: str, x, what: str = "") -> None:
    """A float32 argument (sinks, slopes, lse, descales: the kernels' type), on either path; its
    dtype read by name, as check_int32's."""
    if any_dtype_name(x.dtype) != "float32":
        raise TypeError(f"{name}.dtype must be float32{what}, got {any_dtype_name(x.dtype)}")


def check_sinks(sinks, num_heads: int, host: bool, ref_name: str, ref) -> None:
    """Attention-sink logits: ``(Hq,)`` float32 (on the host too), on ``ref``'s device."""
    check_ndim("sinks", sinks, "(Hq)")
    check_axis("sinks", sinks, 0, "Hq", num_heads, "the number of query heads")
    check_float32("sinks", sinks)
    if host:
        return
    check_same_device("sinks", sinks, ref_name, ref)
    if sinks.size and element_strides(sinks)[0] != 1:
        raise ValueError(f"sinks must be contiguous, got a stride of {element_strides(sinks)[0]} elements")


def is_array(x) -> bool:
    """An array argument (NumPy scalars count as numbers, like Python floats)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, np.generic)


def is_e4m3(x) -> bool:
    """Whether an array holds e4m3: float8_e4m3fn, or its uint8 storage (CuPy). Any framework's
    array, a caller's raw one too: torch's dtypes are told by name, as NumPy cannot read them."""
    return any_dtype_name(x.dtype) in (dtype_name(FLOAT8_E4M3), dtype_name(E4M3_STORAGE))


def as_e4m3(x):
    """A host e4m3 array as ml_dtypes' float8_e4m3fn (uint8 bytes are reinterpreted, not converted)."""
    return x.view(FLOAT8_E4M3) if np.dtype(x.dtype) == E4M3_STORAGE else x


def check_head_dim(name: str, head_dim: int) -> None:
    """``name`` (an argument, or an argument's axis: ``q.shape[-1] (head_dim)``) is a head dim the
    kernels take (the CPU path takes the same set)."""
    if not (HEAD_DIM_STEP <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_STEP == 0):
        raise ValueError(f"{name} = {head_dim} is not supported: {HEAD_DIM_RULE}")


def check_e4m3_head_dim(name: str, head_dim: int) -> None:
    """An e4m3 cache's rows are whole 16-byte copies: its head dim is a multiple of E4M3_HEAD_DIM_STEP."""
    if head_dim % E4M3_HEAD_DIM_STEP:
        raise ValueError(f"{name} = {head_dim} is not supported with an e4m3 cache: head_dim must be a "
                         f"multiple of {E4M3_HEAD_DIM_STEP} (16-byte rows of 1-byte elements)")


def tile_head_dim(head_dim: int, tiles) -> int:
    """The smallest tile head dim of ``tiles`` (a family's tile table) that serves ``head_dim``."""
    return min(d for d in tiles if d >= head_dim)


def check_kv_dtypes(q, named_kv: dict, host: bool) -> bool:
    """The caches hold q's dtype, or both hold e4m3 (q then fp16 or bf16; any float on the host;
    the head dim a multiple of E4M3_HEAD_DIM_STEP). Returns whether they are e4m3."""
    (k_name, k), (v_name, v) = named_kv.items()
    if not is_e4m3(k):
        check_dtypes({"q": q, k_name: k, v_name: v}, host)
        return False
    if is_e4m3(q):
        raise TypeError("q.dtype is float8_e4m3fn; over an e4m3 cache q stays float16 or bfloat16 (any float but "
                        "e4m3 on the host), and the output takes its dtype")
    (check_host_float_dtype if host else check_float_dtype)("q", q)
    if np.dtype(v.dtype) != np.dtype(k.dtype):
        raise TypeError(f"{v_name}.dtype must equal {k_name}.dtype = {dtype_name(k.dtype)} (an e4m3 cache holds "
                        f"both in e4m3), got {dtype_name(v.dtype)}")
    check_e4m3_head_dim(f"{k_name}.shape[-1] (head_dim)", int(k.shape[-1]))
    return True


@dataclasses.dataclass(frozen=True)
class KvScale:
    """A checked descale of an e4m3 cache: real value = stored x factor x array[h * stride].
    ``factor`` is a host float (1 when the scale is an array), ``array`` a float32 ``(Hk,)`` or
    one-element array (stride 0) or None."""

    factor: float = 1.0
    array: object = None
    stride: int = 0

    def per_head(self, num_kv_heads: int) -> np.ndarray:
        """Host float64 ``(Hk,)`` values (the reference path)."""
        values = np.ones(num_kv_heads) * self.factor
        if self.array is not None:
            values = values * np.asarray(self.array, np.float64).reshape(-1)[np.arange(num_kv_heads) * self.stride]
        return values


NO_SCALE = KvScale()


def positive_normal_float32(values) -> bool:
    """Whether every value (float32 already) is finite, positive and normal in float32: a descale
    the kernels can multiply by without losing bits."""
    return bool(np.all(np.isfinite(values)) and np.all(np.asarray(values) >= np.finfo(np.float32).tiny))


def scalar_scale(name: str, scale, shapes: str) -> float | None:
    """A descale given as a number (an e4m3 cache's k_scale / v_scale, the FP8 forward's q, k and
    v scales): its value rounded to float32, the type the kernels take it in, so that the CPU path
    computes with the same number; checked positive, finite and normal there (a subnormal descale
    would lose bits in the kernels' products). None when ``scale`` is an array. ``shapes`` lists
    the array shapes the caller takes, for the error on anything else."""
    if is_array(scale):
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float or a float32 array of shape {shapes}, got {type(scale).__name__}")
    with np.errstate(over="ignore", under="ignore"):
        value = float(np.float32(as_float(scale)))
    if not positive_normal_float32(value):
        raise ValueError(f"{name} must be a positive float, finite and normal in float32 (the kernels' type), "
                         f"got {show_number(scale)}")
    return value


def check_kv_scale(name: str, scale, e4m3: bool, num_kv_heads: int, host: bool, ref_name: str, ref) -> KvScale:
    """``k_scale`` / ``v_scale``: None (1), a positive, finite, normal float, or a float32 array of
    shape ``()``, ``(1,)`` or ``(Hk,)`` on ``ref``'s device (float32 on the host too); only with an
    e4m3 cache, whose real values are stored x scale."""
    if scale is None:
        return NO_SCALE
    if not e4m3:
        raise ValueError(f"{name} applies to float8_e4m3fn caches only; this cache holds {dtype_name(ref.dtype)}")
    value = scalar_scale(name, scale, f"(), (1,) or (Hk,) = ({num_kv_heads},)")
    if value is not None:
        return KvScale(value)
    shape = tuple(int(n) for n in scale.shape)
    if shape not in ((), (1,), (num_kv_heads,)):
        raise ValueError(f"{name}.shape must be (), (1,) or (Hk,) = ({num_kv_heads},) (per tensor or per kv head), "
                         f"got {shape}")
    per_head = shape == (num_kv_heads,) and num_kv_heads > 1
    check_float32(name, scale)
    if host:
        return KvScale(1.0, np.asarray(scale).reshape(-1), int(per_head))
    check_same_device(name, scale, ref_name, ref)
    if per_head and element_strides(scale)[0] != 1:
        raise ValueError(f"{name} must be contiguous, got a stride of {element_strides(scale)[0]} elements")
    return KvScale(1.0, scale, int(per_head))
def check_alibi_slopes(slopes, batch: int, num_heads: int, host: bool, ref_name: str, ref) -> int:
    """ALiBi slopes: ``(Hq,)`` (every sequence) or ``(B, Hq)`` (per sequence), float32 (on the host
    too), on ``ref``'s device, contiguous along the heads. Returns the batch stride in elements the
    kernels read them with: 0 for ``(Hq,)``."""
    if slopes.ndim not in (1, 2):
        raise ValueError(f"alibi_slopes must be 1-D (Hq) or 2-D (B, Hq), got shape {tuple(slopes.shape)}")
    if slopes.ndim == 2:
        check_axis("alibi_slopes", slopes, 0, "B", batch, "the batch size")
    check_axis("alibi_slopes", slopes, slopes.ndim - 1, "Hq", num_heads, "the number of query heads")
    check_float32("alibi_slopes", slopes)
    if host:
        return 0
    check_same_device("alibi_slopes", slopes, ref_name, ref)
    strides = element_strides(slopes)
    if slopes.size and num_heads > 1 and strides[-1] != 1:
        raise ValueError(f"alibi_slopes must be contiguous along the heads (its last axis), got a stride of "
                         f"{strides[-1]} elements")
    return strides[0] if slopes.ndim == 2 and batch > 1 else 0
