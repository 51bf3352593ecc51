"""What the host mirrors of the device code, read from ``cuda_src/`` itself: parameter structs and constants.

Every kernel family takes one struct by value (``FwdParams``, ``BwdParams``, ``DecodeParams``,
``CombineParams``, ``CacheParams``, ``CopyParams``, ``TileOrderParams``, ``Fp8TransposeParams``).
The header is the only place a field is declared: this module parses its members (``TYPE NAME;``
lines) into a NumPy dtype with C alignment, and the launch code fills a zeroed instance by field
name. ``_jit`` launches the kernel with the instance's bytes as its one argument (``cuLaunchKernel``).

Filling is strict: every field must be given (a forgotten field would silently stay zero), and
an unknown name is an error, so the host and the header cannot drift apart.

Constants the host needs to size launches (threads per CTA, keys per stage, shared-memory row
padding, ...) are read the same way: :func:`constant` evaluates the sources' ``constexpr int
kName = EXPR;`` declarations, so a tile constant is stated once, in the kernel file.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from pathlib import Path

import numpy as np

from . import _jit

HEADER = "params.cuh"
# C type of a member -> NumPy scalar type; any pointer is a 64-bit device address.
SCALAR_TYPES = {"i64": np.int64, "int": np.int32, "u32": np.uint32, "float": np.float32}
POINTER = np.uint64
# TensorMap (tma.cuh): a CUtensorMap, 128 bytes aligned to 64, filled as 16 64-bit words
TENSOR_MAP = "TensorMap"
TENSOR_MAP_FORMAT = (np.uint64, (16,))
TENSOR_MAP_ALIGN = 64

_CONSTANT_RE = re.compile(r"constexpr int (k\w+) = ([^;]+);")
# what a constant's expression may hold: names, integers, + - * / and parentheses
_EXPRESSION_RE = re.compile(r"^[\w\s+\-*/()]+$")
_STRUCT_RE = re.compile(r"struct\s+(\w+Params)\s*\{(.*?)\n\};", re.S)
_MEMBER_RE = re.compile(r"^\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", re.M)


@functools.lru_cache(maxsize=None)
def _parse(header: Path) -> dict[str, np.dtype]:
    structs = {}
    for name, body in _STRUCT_RE.findall(header.read_text()):
        names, formats, offsets = [], [], []
        offset, struct_align = 0, 1
        for ctype, star, member in _MEMBER_RE.findall(body):
            if star:
                fmt, align = POINTER, 8
            elif ctype in SCALAR_TYPES:
                fmt = SCALAR_TYPES[ctype]
                align = np.dtype(fmt).itemsize
            elif ctype == TENSOR_MAP:
                fmt, align = TENSOR_MAP_FORMAT, TENSOR_MAP_ALIGN
            else:
                raise ValueError(f"{header}: {name}.{member} has type {ctype}, which the host cannot mirror; "
                                 f"use a pointer, {TENSOR_MAP} or one of {', '.join(SCALAR_TYPES)}")
            # C layout: each member at the next multiple of its alignment, the struct padded to its largest
            offset = -(-offset // align) * align
            names.append(member)
            formats.append(fmt)
            offsets.append(offset)
            offset += np.dtype(fmt).itemsize
            struct_align = max(struct_align, align)
        structs[name] = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                                  "itemsize": -(-offset // struct_align) * struct_align})
    return structs


_dtypes: dict[str, np.dtype] = {}


def struct_dtype(name: str) -> np.dtype:
    """The NumPy dtype mirroring ``struct name`` of params.cuh (same field order, sizes, padding).

    Read once per process: every launch asks, and resolving the source folder touches the disk."""
    dtype = _dtypes.get(name)
    if dtype is None:
        _dtypes.update(_parse(_jit.source_dir() / HEADER))
        dtype = _dtypes[name]
    return dtype


def pointer(x) -> int:
    """A device address: None is null; CuPy arrays, torch tensors and raw ints are accepted."""
    if x is None:
        return 0
    if isinstance(x, (int, np.integer)):
        return int(x)
    data = getattr(x, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return int(data.ptr)
    return int(x.data_ptr())


# struct module codes of the members' NumPy types (little-endian, the GPU's byte order)
_STRUCT_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
                 np.dtype(np.uint32): "I", np.dtype(np.float32): "f"}
_SCALAR, _POINTER, _WORDS = 0, 1, 2  # how pack turns a field's value into struct values


@functools.lru_cache(maxsize=None)
def _packer(name: str) -> tuple:
    """(struct.Struct of the whole C struct, padding included; its field names, their kinds; the
    names as a set). ``struct.pack`` of one flat tuple is several times faster than building a
    NumPy record, which matters for the calls that pack a struct per launch (the backward)."""
    dtype = struct_dtype(name)
    fmt, end, kinds = "<", 0, []
    for member in dtype.names:
        member_dtype, offset = dtype.fields[member][:2]
        fmt += "x" * (offset - end)
        if member_dtype.subdtype is not None:  # TensorMap: 16 64-bit words
            base, shape = member_dtype.subdtype
            fmt += f"{shape[0]}{_STRUCT_CODES[base]}"
            kinds.append(_WORDS)
        else:
            fmt += _STRUCT_CODES[member_dtype]
            kinds.append(_POINTER if member_dtype == POINTER else _SCALAR)
        end = offset + member_dtype.itemsize
    fmt += "x" * (dtype.itemsize - end)
    return struct.Struct(fmt), dtype.names, tuple(kinds), frozenset(dtype.names)


def pack(name: str, **fields) -> np.void:
    """One kernel argument: a ``name`` struct with every field set (pointers from arrays or None)."""
    layout, names, kinds, known = _packer(name)
    if fields.keys() != known:
        missing = [f for f in names if f not in fields]
        unknown = [f for f in fields if f not in known]
        raise TypeError(f"{name}: fields missing {missing}, unknown {unknown}")
    values = []
    for field, kind in zip(names, kinds):
        value = fields[field]
        if kind == _POINTER:
            values.append(pointer(value))
        elif kind == _WORDS:
            values.extend(int(word) for word in np.asarray(value, np.uint64).ravel())
        else:
            values.append(value)
    return np.frombuffer(layout.pack(*values), struct_dtype(name))[0]


@functools.lru_cache(maxsize=None)
def _constants(folder: Path) -> dict[str, int]:
    """Every ``constexpr int kName = EXPR;`` of the sources whose value follows from the others
    (template-dependent ones are left out); a name declared twice with two values maps to None."""
    declared = []
    for path in sorted(folder.iterdir()):
        if path.suffix in _jit.SOURCE_SUFFIXES:
            declared += _CONSTANT_RE.findall(path.read_text())
    values: dict[str, int | None] = {}
    pending = [(name, expr.strip()) for name, expr in declared if _EXPRESSION_RE.match(expr.strip())]
    progress = True
    while pending and progress:  # a declaration may use names declared after it in another file
        progress, waiting = False, []
        for name, expr in pending:
            try:
                value = eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(values))  # noqa: S307 (checked above)
            except NameError:
                waiting.append((name, expr))
                continue
            progress = True
            values[name] = value if values.get(name, value) == value else None
        pending = waiting
    return values


_constant_values: dict[tuple[str | None, str], int] = {}


def constant(name: str) -> int:
    """The value of ``constexpr int name`` in ``cuda_src/`` (threads, tile and padding constants).

    Remembered per source folder override ($CUATTN_SOURCE_DIR): launches ask on every call, and
    resolving the folder touches the disk (under cProfile, the two lookups of a backward call took
    about 40% of its host time on the H200's host)."""
    key = (os.environ.get("CUATTN_SOURCE_DIR"), name)
    value = _constant_values.get(key)
    if value is None:
        values = _constants(_jit.source_dir())
        if values.get(name) is None:
            why = "declared with two values" if name in values else "not a constant the host can evaluate"
            raise KeyError(f"{name} is {why} in {_jit.source_dir()}")
        value = _constant_values[key] = values[name]
    return value
