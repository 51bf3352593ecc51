"""Shared test machinery: the `gpu` marker, random inputs, and the tolerance rule (README, "Tests")."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from cuattn import _registry

# JAX must not grab 75% of GPU memory when a test imports it beside CuPy and torch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = list(_registry.DTYPES)  # float16, bfloat16
DTYPE_IDS = ["fp16", "bf16"]


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through CuPy; otherwise the library's own one-line reason."""
    from cuattn import _jit

    return _jit.gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class SeededRng:
    """A NumPy Generator that remembers its seed, so a failure message can name it."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generator = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._generator, name)


@pytest.fixture
def rng():
    """Fresh random inputs every run; `rng.seed` reproduces a failure."""
    return SeededRng(int(np.random.SeedSequence().entropy % (2**32)))


def randn(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def error_budget(naive_err: float, dtype, factor: float, ref_max: float) -> float:
    """The tolerance rule: at most `factor` x the straightforward same-precision error, plus a small floor.

    The floor is one unit in the last place of the output's magnitude in that dtype, so that
    outputs the naive computation happens to get exactly right still leave room for rounding.
    """
    eps = float(ml_dtypes.finfo(dtype).eps)
    return factor * naive_err + eps * max(ref_max, 1.0)
