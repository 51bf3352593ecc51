"""Options every attention kernel takes, checked once and turned into the kernels' scalars.

``scale`` and ``softcap`` become the score multiplier and cap of ``MaskParams``
(``cuda_src/attention_tile.cuh``): scores are kept in log2 units so each probability is one FMA
and one exp2. ``window=(left, right)`` and ``causal`` become two int32 bounds around the
bottom-right aligned diagonal, an unbounded side turning into a bound no row reaches.
"""

from __future__ import annotations

import math

import numpy as np

LOG2E = 1.0 / math.log(2.0)
# The kernels keep window bounds and sequence positions in int32.
MAX_TOTAL_LENGTH = 1 << 30


def check_options(window, softcap, scale, **flags) -> tuple[int, int]:
    """Validate window, softcap, scale and the boolean ``flags`` (causal, return_lse, ...) by
    name; returns the window as a pair of ints. Host and device paths both call this first."""
    # Every call runs this, the planned ones too: the usual arguments (a tuple of two ints, a
    # float softcap, no scale, plain bools) pass with identity and type tests only.
    if (type(window) is tuple and len(window) == 2 and (scale is None or type(scale) is float)
            and type(softcap) is float):
        left, right = window
        if (type(left) is int and type(right) is int and left >= -1 and right >= -1 and 0.0 <= softcap < math.inf
                and (scale is None or 0.0 < scale < math.inf)):
            for value in flags.values():
                if value is not True and value is not False:
                    break
            else:
                return left, right
    return _check_options_generic(window, softcap, scale, flags)


def _check_options_generic(window, softcap, scale, flags) -> tuple[int, int]:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)
    ):
        raise ValueError(f"window must be a pair (left, right) of ints, -1 meaning unbounded; got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got window = ({left}, {right})")
    if not math.isfinite(float(softcap)) or float(softcap) < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap}")
    if scale is not None and not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale must be a finite float > 0, got {scale}")
    return left, right


def score_scalars(scale, softcap, head_dim: int) -> tuple[float, float]:
    """(score_scale, softcap_out) of MaskParams: scale * log2(e) and 0, or scale / softcap and softcap * log2(e)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def window_bounds(causal: bool, window, max_len: int) -> tuple[int, int]:
    """Kernel window bounds: -1 becomes ``max_len`` (no row reaches it); causal caps the right side at 0."""
    left, right = window
    left = max_len if left == -1 else min(left, max_len)
    right = max_len if right == -1 else min(right, max_len)
    if causal:
        right = min(right, 0)
    return left, right


def check_total_length(seqlen_q: int, seqlen_k: int) -> None:
    if seqlen_q + seqlen_k >= MAX_TOTAL_LENGTH:
        raise ValueError(f"Sq + Sk must stay below {MAX_TOTAL_LENGTH}, got {seqlen_q} + {seqlen_k}")
