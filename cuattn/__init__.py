"""cuattn: FlashAttention, FlashDecoding and paged attention for Python without a deep-learning framework.

Kernels are CUDA C++ compiled at run time by NVRTC (through CuPy) and cached on disk. Arrays come
in from CuPy, torch or JAX through DLPack and go back out as the same kind without copies; NumPy
arrays run the float64 reference on the CPU.
"""

__version__ = "0.1.0"

from . import reference
from ._errors import CompileError, NoDeviceError, OutOfBlocksError, UnknownSequenceError
from ._tools import build, info, prune_cache
from .attention import attention, attention_backward, attention_varlen, attention_varlen_backward
from .cascade import cascade_attention, plan_cascade
from ._calls import StepPlan
from .decode import decode, merge_states, plan_decode
from .fp8 import fp8_scales, quantize_fp8
from .paged import BlockManager, PagedKVCache, paged_attention, plan_paged_attention
from .paged_varlen import paged_attention_varlen
# ring attention: NumPy and cuattn only at import (CuPy, NCCL and torch load when a group needs them)
from . import distributed

__all__ = [
    "BlockManager",
    "PagedKVCache",
    "CompileError",
    "NoDeviceError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "StepPlan",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "build",
    "cascade_attention",
    "decode",
    "distributed",
    "fp8_scales",
    "info",
    "merge_states",
    "paged_attention",
    "paged_attention_varlen",
    "plan_cascade",
    "plan_decode",
    "plan_paged_attention",
    "prune_cache",
    "quantize_fp8",
    "reference",
]
