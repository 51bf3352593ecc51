"""The variant registry: what each kernel family supports and every variant its dispatcher can launch.

Read by ``cuattn.build`` / ``python -m cuattn build`` (what to compile), ``tests/test_jit.py``
(every variant compiles without spills), the tests' parametrisation (dtypes, head dims, mask
modes) and the benchmarks. Each family's head dims come from its tile table, so a head dim is
added in one place; an unsupported one is refused with this list.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from . import _arrays, _jit, attention, decode, paged


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    kernels: str  # the .cu file(s)
    head_dims: tuple[int, ...]
    variants: Callable[[str], list[_jit.KernelSpec]]  # every variant for an arch


FAMILIES = {
    family.name: family
    for family in (
        Family("attention", "flash_fwd.cu, flash_bwd.cu", attention.SUPPORTED_HEAD_DIMS, attention.kernel_variants),
        Family("decode", "decode.cu", decode.SUPPORTED_HEAD_DIMS, decode.kernel_variants),
        Family("cache", "cache_ops.cu", decode.SUPPORTED_HEAD_DIMS, paged.kernel_variants),
    )
}
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
