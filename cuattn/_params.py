"""Kernel parameter structs on the host: NumPy structured dtypes read from ``cuda_src/params.cuh``.

Every kernel family takes one struct by value (``FwdParams``, ``BwdParams``, ``DecodeParams``,
``CombineParams``, ``CacheParams``). The header is the only place a field is declared: this
module parses its members (``TYPE NAME;`` lines) into a NumPy dtype with C alignment, and the
launch code fills a zeroed instance by field name. CuPy passes the resulting structured scalar
to the kernel as the struct's bytes.

Filling is strict: every field must be given (a forgotten field would silently stay zero), and
an unknown name is an error, so the host and the header cannot drift apart.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from . import _jit

HEADER = "params.cuh"
# C type of a member -> NumPy scalar type; any pointer is a 64-bit device address.
SCALAR_TYPES = {"i64": np.int64, "int": np.int32, "u32": np.uint32, "float": np.float32}
POINTER = np.uint64

_STRUCT_RE = re.compile(r"struct\s+(\w+Params)\s*\{(.*?)\n\};", re.S)
_MEMBER_RE = re.compile(r"^\s*(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", re.M)


@functools.lru_cache(maxsize=None)
def _parse(header: Path) -> dict[str, np.dtype]:
    structs = {}
    for name, body in _STRUCT_RE.findall(header.read_text()):
        fields = []
        for ctype, star, member in _MEMBER_RE.findall(body):
            if star:
                fields.append((member, POINTER))
            elif ctype in SCALAR_TYPES:
                fields.append((member, SCALAR_TYPES[ctype]))
            else:
                raise ValueError(f"{header}: {name}.{member} has type {ctype}, which the host cannot mirror; "
                                 f"use a pointer or one of {', '.join(SCALAR_TYPES)}")
        structs[name] = np.dtype(fields, align=True)
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


def pack(name: str, **fields) -> np.void:
    """One kernel argument: a ``name`` struct with every field set (pointers from arrays or None)."""
    dtype = struct_dtype(name)
    missing = [f for f in dtype.names if f not in fields]
    unknown = [f for f in fields if f not in dtype.fields]
    if missing or unknown:
        raise TypeError(f"{name}: fields missing {missing}, unknown {unknown}")
    row = tuple(pointer(fields[f]) if dtype.fields[f][0] == POINTER else fields[f] for f in dtype.names)
    return np.array(row, dtype)[()]
