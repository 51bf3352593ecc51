"""Tensor maps for the Hopper kernels' TMA loads, encoded by the CUDA driver.

A tensor map (``CUtensorMap``, 128 opaque bytes) describes a global tensor to the copy engine:
base address, dims, byte strides, the box one copy moves and the shared-memory swizzle. Only
the driver can encode one (``cuTensorMapEncodeTiled``). CuPy does not wrap it, so this module
calls it from ``libcuda`` through ctypes: the driver is already loaded by every CUDA process, and
the alternative, NVIDIA's ``cuda-bindings`` package, would be a dependency of its own for one
function.

A map holds the base address, so a kernel that reads new arrays needs new maps. :class:`MapLayout`
is everything but the address (hashable, fixed by a call's signature); :meth:`MapLayout.encode`
keeps the maps of the addresses it has seen, so a loop over the same buffers (training steps,
CUDA graphs captured once) encodes each map once.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np

# CUtensorMapDataType values of the element types the kernels take
_DATA_TYPES = {np.dtype(np.float16): 6, np.dtype(np.uint8): 0}  # uint8: the bytes of e4m3
_BFLOAT16_DATA_TYPE = 9
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = 0
_OOB_FILL_ZERO = 0  # boxes reaching past a dim read zeros
MAP_BYTES = 128
MAP_WORDS = MAP_BYTES // 8
STRIDE_ALIGN_BYTES = 16  # every byte stride but the innermost's, and the base address
MAX_BOX = 256  # elements per box dim
MAX_STRIDE_BYTES = 1 << 40
MAX_DIM = 1 << 32
# maps kept per layout (addresses seen); a full table is cleared
MAX_CACHED_MAPS = 64

_encode_fn = None


def _encoder():
    global _encode_fn
    if _encode_fn is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode_fn = fn
    return _encode_fn


def data_type(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return _BFLOAT16_DATA_TYPE
    return _DATA_TYPES[dtype]


def _valid_stride(stride_bytes: int) -> bool:
    return stride_bytes % STRIDE_ALIGN_BYTES == 0 and 0 < stride_bytes < MAX_STRIDE_BYTES


@dataclasses.dataclass(frozen=True)
class MapLayout:
    """A tiled tensor map without its address: dims and element strides innermost first."""

    dtype: np.dtype
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # elements; strides[0] must be 1
    box: tuple[int, ...]

    @classmethod
    def of(cls, dtype, dims, strides, box) -> "MapLayout | None":
        """The layout, or None when the TMA cannot read this view (the caller takes another kernel):
        a byte stride that is not a multiple of 16, an empty or oversized dim."""
        itemsize = np.dtype(dtype).itemsize
        dims, box = tuple(int(d) for d in dims), tuple(int(b) for b in box)
        if strides[0] != 1 or any(d <= 0 or d > MAX_DIM for d in dims) or any(b > MAX_BOX for b in box):
            return None
        fixed = [1]
        for dim, stride in zip(dims[1:], strides[1:]):
            stride_bytes = int(stride) * itemsize
            if dim == 1:
                # one index only: the stride is never applied, any valid value will do
                stride_bytes = STRIDE_ALIGN_BYTES
            elif not _valid_stride(stride_bytes):
                return None
            fixed.append(stride_bytes // itemsize)
        return cls(np.dtype(dtype), dims, tuple(fixed), box)

    def encode(self, address: int) -> np.ndarray:
        """The map of this layout at ``address``, as 16 little-endian 64-bit words."""
        cache = _maps.setdefault(self, {})
        words = cache.get(address)
        if words is None:
            if len(cache) >= MAX_CACHED_MAPS:
                cache.clear()
            words = cache[address] = self._encode(address)
        return words

    def _encode(self, address: int) -> np.ndarray:
        if address % STRIDE_ALIGN_BYTES:
            raise ValueError(f"a TMA base address must be {STRIDE_ALIGN_BYTES}-byte aligned, got {address:#x}")
        rank = len(self.dims)
        itemsize = self.dtype.itemsize
        words = np.zeros(MAP_WORDS, np.uint64)  # 8-byte aligned; the driver asks for 64
        buffer = (ctypes.c_uint64 * (MAP_WORDS + 8))()
        aligned = (ctypes.addressof(buffer) + 63) // 64 * 64
        dims = (ctypes.c_uint64 * rank)(*self.dims)
        strides = (ctypes.c_uint64 * (rank - 1))(*(s * itemsize for s in self.strides[1:]))
        box = (ctypes.c_uint32 * rank)(*self.box)
        element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
        status = _encoder()(aligned, data_type(self.dtype), rank, address, dims, strides, box, element_strides,
                            _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO)
        if status != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {self} at {address:#x}")
        words[:] = np.frombuffer(ctypes.string_at(aligned, MAP_BYTES), np.uint64)
        return words


_maps: dict[MapLayout, dict[int, np.ndarray]] = {}
