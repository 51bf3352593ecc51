"""Options every attention kernel takes, checked once and turned into the kernels' scalars.

``scale`` and ``softcap`` become the score multiplier and cap of ``MaskParams``
(``cuda_src/attention_tile.cuh``): scores are kept in log2 units so each probability is one FMA
and one exp2. ``window=(left, right)`` and ``causal`` become two int32 bounds around the
bottom-right aligned diagonal, an unbounded side turning into a bound no row reaches.
"""

from __future__ import annotations

import math

import numpy as np

from . import _arrays

LOG2E = 1.0 / math.log(2.0)
# The kernels keep window bounds and sequence positions in int32.
MAX_TOTAL_LENGTH = 1 << 30
# The kernels take the score multiplier scale * log2(e) (or scale / softcap) and the softcap in
# float32: scale is refused where that multiplier is not a finite, normal float32.
MAX_FLOAT32 = float(np.finfo(np.float32).max)
MIN_SCALE = float(np.finfo(np.float32).tiny) / LOG2E
MAX_SCALE = MAX_FLOAT32 / LOG2E
MIN_SOFTCAP, MAX_SOFTCAP = MIN_SCALE, MAX_SCALE


def check_options(window, softcap, scale, **flags) -> tuple[int, int]:
    """Validate window, softcap, scale and the boolean ``flags`` (causal, return_lse, ...) by
    name; returns the window as a pair of ints. Host and device paths both call this first."""
    # Every call runs this, the planned ones too: the usual arguments (a tuple of two ints, a
    # float softcap, no scale, plain bools) pass with identity and type tests only.
    if (type(window) is tuple and len(window) == 2 and (scale is None or type(scale) is float)
            and type(softcap) is float):
        left, right = window
        if (type(left) is int and type(right) is int and -1 <= left < MAX_TOTAL_LENGTH
                and -1 <= right < MAX_TOTAL_LENGTH and (softcap == 0.0 or MIN_SOFTCAP <= softcap < MAX_SOFTCAP)
                and (scale is None or (MIN_SCALE <= scale < MAX_SCALE
                                       and (softcap == 0.0 or scale / softcap < MAX_FLOAT32)))):
            for value in flags.values():
                if value is not True and value is not False:
                    break
            else:
                return left, right
    return _check_options_generic(window, softcap, scale, flags)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _check_options_generic(window, softcap, scale, flags) -> tuple[int, int]:
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    message = f"window must be a pair (left, right) of ints, -1 meaning unbounded; got {window!r}"
    if not isinstance(window, (tuple, list)) or not all(
            isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) for w in window):
        raise TypeError(message)
    if len(window) != 2:
        raise ValueError(message)
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got window = ({left}, {right})")
    if not _is_number(softcap):
        raise TypeError(f"softcap must be a float (0 = off), got {type(softcap).__name__} {softcap!r}")
    softcap = _arrays.as_float(softcap)
    if not (softcap == 0 or MIN_SOFTCAP <= softcap < MAX_SOFTCAP):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap}; a nonzero softcap lies in "
                         f"[{MIN_SOFTCAP:.3g}, {MAX_SOFTCAP:.3g}) (softcap * log2(e) finite and normal in float32, "
                         "the kernels' type)")
    if scale is not None:
        if not _is_number(scale):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}")
        if not MIN_SCALE <= _arrays.as_float(scale) < MAX_SCALE:
            raise ValueError(f"scale must be a finite float > 0, got {_arrays.show_number(scale)}; it lies in "
                             f"[{MIN_SCALE:.3g}, {MAX_SCALE:.3g}) (scale * log2(e) finite and normal in float32, the "
                             "kernels' type)")
        if softcap > 0 and not float(scale) / softcap < MAX_FLOAT32:
            raise ValueError(f"scale / softcap must be finite in float32 (the kernels' score multiplier), got "
                             f"{scale} / {softcap}")
    # a side wider than any sequence (Sq + Sk stays below MAX_TOTAL_LENGTH) sees every key: clamped
    # there, so that no bound overflows an int
    return min(left, MAX_TOTAL_LENGTH), min(right, MAX_TOTAL_LENGTH)


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale a call uses: ``scale``, or 1/sqrt(head_dim) for None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def score_scalars(scale, softcap, head_dim: int) -> tuple[float, float]:
    """(score_scale, softcap_out) of MaskParams: scale * log2(e) and 0, or scale / softcap and softcap * log2(e)."""
    scale = resolve_scale(scale, head_dim)
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


def check_total_length(seqlen_q: int, seqlen_k: int, names: str = "Sq + Sk") -> None:
    """Positions stay int32 in the kernels (MAX_TOTAL_LENGTH); ``names`` says which arguments the
    two lengths come from, for the message."""
    if seqlen_q + seqlen_k >= MAX_TOTAL_LENGTH:
        raise ValueError(f"{names} must stay below {MAX_TOTAL_LENGTH} (positions are int32 in the kernels), got "
                         f"{seqlen_q} + {seqlen_k}")
