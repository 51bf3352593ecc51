"""The variant registry: what each kernel family supports and every variant its dispatcher can launch.

Read by ``cuattn.build`` / ``python -m cuattn build`` (what to compile), ``tests/test_jit.py``
(every variant compiles without spills) and the tests' parametrisation (dtypes, head dims, mask
modes). Every family takes every head dim of ``_arrays.SUPPORTED_HEAD_DIMS``
(multiples of 8 up to 256); its kernels are instantiated for the tile head dims of its tile table,
and a head dim runs the smallest tile at least it, given at run time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import _arrays, _jit, attention, decode, paged


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    kernels: str  # the .cu file(s)
    tile_head_dims: tuple[int, ...]  # the head dims its kernels are instantiated for
    variants: Callable[[str], list[_jit.KernelSpec]]  # every variant for an arch


FAMILIES = {
    family.name: family
    for family in (
        Family("attention", "flash_fwd.cu, flash_fwd_sm90.cu, flash_bwd.cu, tile_order.cu", attention.TILE_HEAD_DIMS,
               attention.kernel_variants),
        Family("decode", "decode.cu", decode.TILE_HEAD_DIMS, decode.kernel_variants),
        Family("cache", "cache_ops.cu", (), paged.kernel_variants),
    )
}
# Every head dim the kernels and the CPU path take.
SUPPORTED_HEAD_DIMS = _arrays.SUPPORTED_HEAD_DIMS
# Head dims the tests sweep: every family's tile head dims and a few that ride padded in a larger
# tile (8 in 32, 40 in 64, 104 in 128, 200 in 256), kept few so that the GPU suite stays short.
PADDED_TEST_HEAD_DIMS = (8, 40, 104, 200)


def test_head_dims(family: str) -> tuple[int, ...]:
    """The head dims the tests sweep for ``family``: its tile head dims and PADDED_TEST_HEAD_DIMS."""
    return tuple(sorted(set(FAMILIES[family].tile_head_dims) | set(PADDED_TEST_HEAD_DIMS)))
# The element types every kernel is instantiated for (NumPy dtypes; the CPU path takes any float).
DTYPES = tuple(_arrays.CUDA_TYPES)
# Mask modes every attention kernel takes (one kernel per tile handles them all): name -> options.
MASK_OPTIONS = {
    "full": {},
    "causal": {"causal": True},
    "window": {"window": (37, 5)},
    "softcap-causal": {"causal": True, "softcap": 30.0},
}


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """Every variant any dispatcher in cuattn can launch on ``arch``."""
    return [spec for family in FAMILIES.values() for spec in family.variants(arch)]
