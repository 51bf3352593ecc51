"""The fast path of repeated calls: plans keyed by what the checks and the kernel choice depend on.

A public function's first call with given array signatures (framework, shape, strides, dtype,
device) and options runs the full path: conversion, every check, kernel choice, split count,
launch geometry and the parameter struct. When that call launched, it leaves a plan here; a later
call with the same signatures and options finds it and only

  * reads the arrays' addresses (``data.ptr`` / ``data_ptr()``, no DLPack round trip) and checks
    their 16-byte alignment, the one property a signature does not fix;
  * allocates the outputs in the caller's framework (torch's caching allocator for torch inputs);
  * writes the addresses into the prepared structs and launches on the caller's current stream.

Anything unusual (another device current, an unaligned view, a framework without a fast reader)
falls back to the full path, which raises the error or records a new plan. The plan table is
bounded; a full table is cleared, so a workload with ever-new shapes costs the full path only.
"""

from __future__ import annotations

import dataclasses

from . import _arrays

MAX_PLANS = 512
_plans: dict = {}


# ---------------------------------------------------------------------------------------------
# Frameworks: what a plan needs to know about an array, read directly


class _Cupy:
    @staticmethod
    def signature(x):
        return ("cupy", x.shape, x.strides, x.dtype, x.data.device_id)

    @staticmethod
    def address(x) -> int:
        return x.data.ptr

    @staticmethod
    def stream(x) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    @staticmethod
    def device_ok(x, device_id: int) -> bool:
        import cupy

        return cupy.cuda.runtime.getDevice() == device_id

    @staticmethod
    def empty(shape, like, float32: bool = False):
        import cupy

        return cupy.empty(shape, cupy.float32 if float32 else like.dtype)

    @staticmethod
    def zeros(shape, like, float32: bool = False):
        import cupy

        return cupy.zeros(shape, cupy.float32 if float32 else like.dtype)


class _Torch:
    _raw_stream = None  # torch._C._cuda_getCurrentRawStream, looked up once

    @staticmethod
    def signature(x):
        return ("torch", x.shape, x.stride(), x.dtype, x.device)

    @staticmethod
    def address(x) -> int:
        return x.data_ptr()

    @staticmethod
    def stream(x) -> int:
        raw = _Torch._raw_stream
        if raw is None:
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is None:  # a torch without the raw accessor: its public (slower) stream object
                return torch.cuda.current_stream(x.device).cuda_stream
            _Torch._raw_stream = raw
        # get_device() is the index as an int, without building a torch.device
        return raw(x.get_device())

    @staticmethod
    def device_ok(x, device_id: int) -> bool:
        import cupy

        # the plan's kernels were loaded on device_id, and CuPy's current device is where they launch
        return x.get_device() == device_id and cupy.cuda.runtime.getDevice() == device_id

    @staticmethod
    def empty(shape, like, float32: bool = False):
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)

    @staticmethod
    def zeros(shape, like, float32: bool = False):
        import torch

        return torch.zeros(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)


_FRAMEWORKS: dict[type, object] = {}


def framework(x):
    """The fast reader of x's framework, or None (NumPy, JAX, other DLPack arrays take the full path)."""
    kind = type(x)
    found = _FRAMEWORKS.get(kind)
    if found is None and kind not in _FRAMEWORKS:
        module = kind.__module__.split(".")[0]
        found = {"cupy": _Cupy, "torch": _Torch}.get(module) if module in ("cupy", "torch") else None
        if found is _Cupy and kind.__name__ != "ndarray":
            found = None
        _FRAMEWORKS[kind] = found
    return found


def key(name: str, arrays, options):
    """The plan key of a call, or None when the call cannot use a plan (see :func:`run`)."""
    call_key = _read(name, arrays, options)[0]
    try:
        hash(call_key)
    except TypeError:  # an option given as a list, say: such calls take the full path
        return None
    return call_key


def _read(name, arrays, options):
    """(key, readers): each array's signature names its framework, so a mix the full path accepts
    (torch queries over a CuPy paged cache) has plans too; a mix it refuses never records one.
    The key is None when an array has no fast reader."""
    readers = []
    signatures = []
    for x in arrays:
        if x is None:
            readers.append(None)
            signatures.append(None)
            continue
        found = _FRAMEWORKS.get(type(x), _UNKNOWN)
        if found is _UNKNOWN:
            found = framework(x)
        if found is None:
            return None, None
        readers.append(found)
        signatures.append(found.signature(x))
    return (name, options, *signatures), readers


_UNKNOWN = object()


def run(name: str, arrays, options):
    """``(result, key)``: the result of the call's plan when one exists and accepts the arrays
    (else None), and the key to :func:`remember` a plan under (None: this call cannot have one).
    Each array is read once, for the key and for the launch."""
    plan, call_key, readers = find(name, arrays, options)
    if plan is None:
        return None, call_key
    return plan.run(arrays, readers), call_key


def find(name: str, arrays, options):
    """``(plan, key, readers)``: :func:`run`'s lookup without the run, for a plan whose run takes
    more than the arrays (plan None: none recorded yet; key None too: this call cannot have one)."""
    call_key, readers = _read(name, arrays, options)
    if call_key is None:
        return None, None, None
    try:
        return _plans.get(call_key), call_key, readers
    except TypeError:  # an option given as a list, say: such calls take the full path
        return None, None, None


def remember(call_key, plan) -> None:
    if call_key is None or plan is None:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[call_key] = plan


def clear() -> None:
    """Forget every plan (tests; after freeing a kernel cache)."""
    _plans.clear()


# ---------------------------------------------------------------------------------------------
# Plans


@dataclasses.dataclass
class Bound:
    """One prepared launch and where its pointer fields come from: ``{field: role}``; a role names
    an input or output of the call, ``workspace+OFFSET`` (bytes into the stream's workspace),
    ``OUTPUT+OFFSET`` (bytes into an output: a call's scratch, allocated with its results),
    ``INPUT+OFFSET`` (bytes into an input: a launch over a block of its rows; null stays null), or
    ``step:ITEMSIZE:IN_0,IN_1,...`` (an int64 field, not a pointer: the constant step between the
    inputs' addresses in elements of ITEMSIZE bytes, 0 for one input, which lets a kernel read
    several inputs as one strided array; inputs not evenly spaced send the call to the full path)."""

    launch: object  # _jit.Launch
    fields: dict[str, str]


class Plan:
    """A validated call: its inputs by role, the outputs to allocate, the launches to run.

    ``outputs`` maps a role to ``(shape, float32)`` or ``(shape, float32, zeroed)``: a new array of
    that shape in the first input's framework, of that input's dtype or float32, zero-filled when
    ``zeroed`` (workspace a kernel accumulates into: the backward's dQ sums and semaphores). ``finish(results, arrays)`` turns the
    outputs into the function's return value. ``workspace`` (bytes per stream, or 0) comes from
    ``workspace_of(bytes, stream, device)``. Everything a call needs is resolved here, once: each
    launch's pointer words as (slot, input index | output name | workspace offset).
    """

    def __init__(self, inputs, outputs, bound, finish, aligned, workspace: int = 0, workspace_of=None):
        self.inputs = tuple(inputs)
        self.outputs = [(role, tuple(spec[0]), spec[1], len(spec) > 2 and spec[2]) for role, spec in outputs.items()]
        self.finish = finish
        self.aligned = tuple(i for i, role in enumerate(self.inputs) if role in aligned)
        self.workspace, self.workspace_of = workspace, workspace_of
        self.device_id = bound[0].launch.device_id
        if self.inputs[0] in outputs:
            raise ValueError("a plan's first input is the array whose framework and device the call follows")
        # each launch's words by source: (slot, input index, byte offset), (slot, output role,
        # offset), (slot, workspace offset), (slot, input indices, itemsize) of a step between inputs
        self.launches = []
        used = set()
        for b in bound:
            from_inputs, from_outputs, from_workspace, from_steps = [], [], [], []
            for field, role in b.fields.items():
                slot = b.launch.slot(field)
                if role.startswith("step:"):
                    _, itemsize, roles = role.split(":")
                    indices = tuple(self.inputs.index(r) for r in roles.split(","))
                    from_steps.append((slot, indices, int(itemsize)))
                    used.update(indices)
                    continue
                name, _, offset = role.partition("+")
                if name == "workspace":
                    from_workspace.append((slot, int(offset)))
                elif name in outputs:
                    # a new output (`out` when the caller gave none), or a region of one
                    from_outputs.append((slot, name, int(offset or 0)))
                elif name not in self.inputs:
                    from_outputs.append((slot, role, 0))  # a role this call leaves null
                else:
                    from_inputs.append((slot, self.inputs.index(name), int(offset or 0)))
                    used.add(self.inputs.index(name))
            self.launches.append((b.launch, tuple(from_inputs), tuple(from_outputs), tuple(from_workspace),
                                  tuple(from_steps)))
        self.used = tuple(sorted(used | set(self.aligned)))
        # the step words' sources by launch, or None when no launch has one (most plans)
        self._steps = tuple(launch[4] for launch in self.launches)
        self._steps = self._steps if any(self._steps) else None

    def run(self, arrays, readers):
        """Launch over ``arrays`` (read by ``readers``, their frameworks), or None to send the
        call down the full path (another device current, an unaligned address)."""
        bound = self.bind(arrays, readers)
        if bound is None:
            return None
        results, stream, launches = bound
        for launch, pointers in launches:
            launch.run(stream, pointers)
        return self.finish(results, arrays)

    def step(self, arrays, readers):
        """A :class:`StepPlan` over these arrays: this plan's launches with every pointer written
        once (the plan is the step's alone from here on), and outputs (scratch included) the step
        owns; None where :meth:`run` would take the full path."""
        if self.workspace:
            raise ValueError("a plan with a per-stream workspace has no step of its own")
        bound = self.bind(arrays, readers)
        if bound is None:
            return None
        results, _, launches = bound
        for launch, pointers in launches:
            launch.bind(pointers)
        out = self.finish(results, arrays)
        out, lse = out if isinstance(out, tuple) else (out, None)
        return StepPlan.of(out, lse, [launch for launch, _ in launches], list(results.values()), self.device_id)

    def bind(self, arrays, readers):
        """(outputs by role, the stream, [(launch, its (slot, address) pairs)]) for launches that
        run in the order listed, or None (:meth:`run`'s full path). Nothing runs yet: a call of
        several plans binds them all before any launches."""
        like, fw = arrays[0], readers[0]
        if fw is None or not fw.device_ok(like, self.device_id):
            return None
        # plain loops: this runs on every planned call, and each comprehension is a function call
        addresses = [0] * len(arrays)
        for i in self.used:
            x = arrays[i]
            if x is not None:
                addresses[i] = readers[i].address(x)
        for i in self.aligned:
            if addresses[i] % _arrays.VECTOR_BYTES:
                return None  # the full path names the misaligned argument
        steps = None
        if self._steps is not None:
            steps = []
            for launch_steps in self._steps:
                words = []
                for slot, indices, itemsize in launch_steps:
                    word = _step_word([addresses[i] for i in indices], itemsize)
                    if word is None:
                        return None  # not evenly spaced: the full path reads them another way
                    words.append((slot, word))
                steps.append(words)
        results, out_addresses = {}, {}
        for role, shape, float32, zeroed in self.outputs:
            x = results[role] = (fw.zeros if zeroed else fw.empty)(shape, like, float32)
            out_addresses[role] = fw.address(x)
        stream = fw.stream(like)
        base = self.workspace_of(self.workspace, stream, self.device_id) if self.workspace else 0
        launches = []
        for k, (launch, from_inputs, from_outputs, from_workspace, _) in enumerate(self.launches):
            pointers = steps[k] if steps is not None else []
            for slot, i, offset in from_inputs:
                address = addresses[i]
                pointers.append((slot, address + offset if address else 0))
            for slot, role, offset in from_outputs:
                pointers.append((slot, out_addresses[role] + offset if role in out_addresses else 0))
            for slot, offset in from_workspace:
                pointers.append((slot, base + offset))
            launches.append((launch, pointers))
        return results, stream, launches


_WORD_MASK = (1 << 64) - 1


def _step_word(addresses, itemsize: int):
    """The step between evenly spaced addresses in elements, as the int64 word of a parameter
    struct (two's complement: a later input may lie below the first); None when they are not
    evenly spaced in whole elements."""
    step = addresses[1] - addresses[0] if len(addresses) > 1 else 0
    if step % itemsize:
        return None
    for i, address in enumerate(addresses):
        if address - addresses[0] != i * step:
            return None
    return (step // itemsize) & _WORD_MASK


class StepPlan:
    """Plan once, run many (FlashInfer's plan/run): launches over fixed arrays, for serving loops.

    Built by ``plan_decode`` / ``plan_paged_attention`` after their checks. It holds the
    prepared launches (every pointer fixed: the caller's inputs, the plan's own outputs and split
    workspace), so :meth:`run` only looks up the caller's current stream and launches: no check,
    no allocation, no host-device copy. The caller updates the inputs' contents in place between
    runs; the outputs are overwritten by each run. Runs on one stream at a time (the workspace is
    the plan's), and on the device it was planned on.
    """

    def __init__(self, ctx, out, lse):
        import cupy

        self.out = ctx.to_caller(out)
        self.lse = ctx.to_caller(lse) if lse is not None else None
        self._reader = framework(self.out)
        if self._reader is None:
            raise TypeError(f"a step plan runs on CuPy or torch arrays; got {ctx.kind} arrays: use the plain call")
        self.device_id = cupy.cuda.runtime.getDevice()
        self._launches = []
        self._buffers = []  # the workspace, held for the plan's life

    @classmethod
    def of(cls, out, lse, launches, buffers, device_id: int) -> "StepPlan":
        """A step over launches whose pointers are already written (:meth:`Plan.step`), holding
        ``buffers`` (its scratch) for its life."""
        step = cls.__new__(cls)
        step.out, step.lse, step._reader, step.device_id = out, lse, framework(out), device_id
        step._launches, step._buffers = list(launches), list(buffers)
        return step

    def workspace(self, nbytes: int) -> int:
        """The plan's own split workspace of ``nbytes``, zeroed (its head holds the split
        launches' arrival counters, which every launch leaves at zero); returns its address."""
        import cupy

        buf = cupy.zeros(max(nbytes, 1) // 4 + 1, cupy.float32)
        self._buffers.append(buf)
        return buf.data.ptr

    def add(self, launch) -> None:
        self._launches.append(launch)

    def run(self):
        """One step on the caller's current stream; returns ``out``, or ``(out, lse)``."""
        import cupy

        if cupy.cuda.runtime.getDevice() != self.device_id:
            raise RuntimeError(f"this plan was made on device {self.device_id}; make it current "
                               f"(cupy.cuda.Device({self.device_id}) or torch.cuda.device) before run()")
        stream = self._reader.stream(self.out)
        for launch in self._launches:
            launch.run(stream)
        return (self.out, self.lse) if self.lse is not None else self.out
