"""Shared test machinery: the `gpu` marker, `--shard I/N`, random inputs, the tolerance rule
(README, "Tests"), the tile order a varlen forward launch should list, and stand-ins for a torch
tensor, a torch dtype and a CuPy device array where neither torch nor a GPU is at hand (CI)."""

from __future__ import annotations

import importlib
import math
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from cuattn import _params, _registry, reference

# JAX must not grab 75% of GPU memory when a test imports it beside CuPy and torch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = list(_registry.DTYPES)  # float16, bfloat16
DTYPE_IDS = ["fp16", "bf16"]


# jax 0.10, which the test extra asks for, needs Python 3.11
JAX_MIN_PYTHON = (3, 11)


def import_jax(module: str = "jax"):
    """jax or one of its modules. The test extra installs jax from Python 3.11 on, so there a
    missing jax is a broken environment and fails the test; on 3.10 the test skips without it."""
    if sys.version_info >= JAX_MIN_PYTHON:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="the test extra installs jax from Python 3.11 on")


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through CuPy; otherwise the library's own one-line reason."""
    from cuattn import _jit

    return _jit.gpu_unavailable_reason()


def pytest_addoption(parser):
    parser.addoption(
        "--shard", default=None, metavar="I/N",
        help="run only shard I of N (0 <= I < N): every Nth test of the collection, from the Ith, so that N "
             "runs (one after another, or at once on one machine) cover the suite once with a like mix of tests")


def parse_shard(value: str) -> tuple[int, int]:
    """``--shard``'s ``I/N`` as (I, N), refusing anything but 0 <= I < N."""
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N (two ints, e.g. 0/3), got {value!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--shard I/N needs 0 <= I < N, got {value!r}")
    return index, count


def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard") is not None:
        index, count = parse_shard(config.getoption("--shard"))
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
        items[:] = items[index::count]
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class ForeignDtype:
    """A dtype NumPy cannot read, printed as torch prints its own (torch.bfloat16, ...)."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class Tensor:
    """Stands in for a torch CPU tensor where torch is not installed (CI): what cuattn reads of one
    before it converts it (its module, shape, dtype, device)."""

    __module__ = "torch"

    def __init__(self, shape, dtype="float16"):
        self.shape, self.dtype = tuple(shape), ForeignDtype(dtype)
        self.is_cuda, self.device = False, "cpu"


class DeviceInts:
    """Stands in for a CuPy device array of ints: NumPy may not read it (CuPy refuses the implicit
    copy), only its .get() reaches the host."""

    __module__ = "cupy"

    def __init__(self, values):
        self._values = np.asarray(values)
        self.shape, self.dtype = self._values.shape, self._values.dtype

    def get(self):
        return self._values

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


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


def rising_scores(rng, b, sq, sk, hq, hk, d, rise, dtype=np.float32):
    """q, k, v whose scores grow toward the first keys, where the kernels visit key blocks last
    first: every 128-key block's scores (scale 1 / sqrt(d)) sit about ``rise`` log2 units above the
    block visited before it, around a normal spread. A rise past kLazyRescaleLog2 (8) moves every
    row's max on every block; one of 5.5 moves none of them lazily (probabilities up to 2^5.5), but
    lifts the sum of a lane's 32 probabilities of a row past 2^8 (their mean is about 11), which
    the bounded softmax (AttentionTile::softmax_to_fragments) takes its exact path for."""
    step = rise * math.log(2) * math.sqrt(d) / (128 * 4.0)  # a key's score rise over q's 4 along axis 0
    q = randn(rng, (b, sq, hq, d)) * 0.5
    k = randn(rng, (b, sk, hk, d)) * 0.5
    q[..., 0] = 4.0
    k[..., 0] = step * (sk - np.arange(sk))[None, :, None]
    return q.astype(dtype), k.astype(dtype), randn(rng, (b, sk, hk, d), dtype)


# rising_scores' rises: one the lazy max never moves for, one past it
RISES = {"sums-past-the-bound": 5.5, "max-past-the-slack": 12.0}


def error_budget(naive_err: float, dtype, factor: float, ref_max: float) -> float:
    """The tolerance rule: at most `factor` x the straightforward same-precision error, plus a small floor.

    The floor is one unit in the last place of the output's magnitude in that dtype, so that
    outputs the naive computation happens to get exactly right still leave room for rounding.
    """
    eps = float(ml_dtypes.finfo(dtype).eps)
    return factor * naive_err + eps * max(ref_max, 1.0)


def check_decode(rng, dtype, q, k, v, lens, got, got_lse, **options):
    """A decode output (B, Sq_new, Hq, Dv) over the contiguous cache k, v with ``lens`` keys per row:
    each row within 2x the naive same-precision error of the float64 reference on its live keys
    (the tolerance rule); its lse (None: not checked) -inf exactly on empty rows and close elsewhere."""
    ref, ref_lse = reference.decode(q, k, v, lens, return_lse=True, **options)
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"NaN or unwritten output (seed {rng.seed})"
    for b, n in enumerate(lens):
        # the straightforward same-precision computation on this row's live cache
        row_options = {key: val for key, val in options.items() if key != "causal"}
        if np.ndim(options.get("alibi_slopes")) == 2:
            row_options["alibi_slopes"] = options["alibi_slopes"][b]  # (B, Hq): this row's slopes
        naive = reference.naive_attention_lowp(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], dtype=dtype,
                                               causal=options.get("causal", True), **row_options)[0]
        budget = error_budget(np.abs(naive - ref[b]).max(initial=0.0), dtype, 2.0, np.abs(ref[b]).max(initial=0.0))
        err = np.abs(got[b] - ref[b]).max(initial=0.0)
        assert err <= budget, f"row {b} (len {n}): error {err:.3g} > {budget:.3g} (seed {rng.seed})"
    if got_lse is None:
        return
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), empty), f"empty rows differ (seed {rng.seed})"
    np.testing.assert_allclose(got_lse[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3, err_msg=f"seed {rng.seed}")


def check_varlen(rng, dtype, q, k, v, cu_q, cu_k, got, **options):
    """A varlen output (total_q, Hq, Dv): each sequence within 2x the naive same-precision error of
    the float64 reference (the tolerance rule), every row written."""
    ref = reference.attention_varlen(q, k, v, cu_q, cu_k, int(np.diff(cu_q).max(initial=0)),
                                     int(np.diff(cu_k).max(initial=0)), **options)
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"NaN or unwritten rows (seed {rng.seed})"
    for i in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if rows.stop == rows.start:
            continue
        sequence_options = dict(options)
        if np.ndim(options.get("alibi_slopes")) == 2:
            sequence_options["alibi_slopes"] = options["alibi_slopes"][i]  # (B, Hq): this sequence's slopes
        naive = reference.naive_attention_lowp(q[None, rows], k[None, keys], v[None, keys], dtype=dtype,
                                               **sequence_options)[0]
        budget = error_budget(np.abs(naive - ref[rows]).max(initial=0.0), dtype, 2.0,
                              np.abs(ref[rows]).max(initial=0.0))
        err = np.abs(got[rows] - ref[rows]).max(initial=0.0)
        assert err <= budget, f"sequence {i}: error {err:.3g} > {budget:.3g} (seed {rng.seed})"


def prefix_sums(lengths) -> np.ndarray:
    """int32 ``(B + 1,)`` prefix sums of sequence lengths (cu_seqlens)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def check_varlen_gradients(rng, dtype, dout, q, k, v, cu_q, cu_k, grads, **options):
    """Varlen gradients ``(dq, dk, dv)`` (and ``dsinks`` with sinks) of packed ``(total, H, D)``
    inputs: each within 3x the error of the straightforward same-precision backward, run sequence
    by sequence, against the float64 reference backward (the tolerance rule). dsinks'
    straightforward value takes delta from the same-precision forward output."""
    lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
    lengths = (int(lens_q.max(initial=0)), int(lens_k.max(initial=0)))
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, *lengths, return_lse=True, **options)
    refs = reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, *lengths, **options)
    naive = [np.zeros_like(r) for r in refs[:3]]
    out_lowp = np.zeros_like(ref_out)
    for b in range(len(lens_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] == 0 or lens_k[b] == 0:
            continue  # no score: the gradients are exactly zero
        sequence_options = dict(options)
        if np.ndim(options.get("alibi_slopes")) == 2:
            sequence_options["alibi_slopes"] = options["alibi_slopes"][b]  # (B, Hq): this sequence's slopes
        low = reference.naive_attention_backward_lowp(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                                                      dtype=dtype, **sequence_options)
        for total, part, rows in zip(naive, low, (qs, ks, ks)):
            total[rows] = part[0]
        out_lowp[qs] = reference.naive_attention_lowp(q[None, qs], k[None, ks], v[None, ks], dtype=dtype,
                                                      **sequence_options)[0]
    for name, got, ref, low in zip(("dq", "dk", "dv"), grads, refs, naive):
        assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
        got = np.asarray(got).astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(got - ref).max(initial=0.0)
        budget = error_budget(np.abs(low - ref).max(initial=0.0), dtype, 3.0, np.abs(ref).max(initial=0.0))
        assert err <= budget, f"{name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    if options.get("sinks") is None:
        return
    check_dsinks(rng, dtype, grads[3], refs[3], dout, options["sinks"], ref_out, ref_lse, out_lowp)


def check_dsinks(rng, dtype, got, ref, dout, sinks, ref_out, ref_lse, out_lowp):
    """dsinks ``(Hq,)`` against the float64 ``ref`` under the 3x rule, dense (lse [B, Hq, Sq]) or
    varlen (lse [Hq, total_q]). dsinks sums every row's delta = sum(dout * out), so its error is a
    sum of the output's rounding errors: the straightforward value's (delta from the
    same-precision forward ``out_lowp``) can cancel by chance below what rounding the exact output
    to ``dtype`` alone leaves, and the budget takes the larger of the two."""
    sinks = np.asarray(sinks, np.float64)
    dense = np.ndim(ref_lse) == 3

    def dsinks_from(out):
        delta = np.sum(dout.astype(np.float64) * out, axis=-1)  # [B, Sq, Hq] or [total_q, Hq]
        if dense:
            return -(np.exp(sinks[None, :, None] - ref_lse) * delta.transpose(0, 2, 1)).sum(axis=(0, 2))
        return -(np.exp(sinks[:, None] - ref_lse) * delta.T).sum(axis=1)

    naive_err = max(np.abs(dsinks_from(out_lowp) - ref).max(),
                    np.abs(dsinks_from(ref_out.astype(dtype).astype(np.float64)) - ref).max())
    got = np.asarray(got).astype(np.float64)
    assert got.shape == sinks.shape, f"dsinks: shape {got.shape}, expected {sinks.shape}"
    err = np.abs(got - ref).max()
    budget = error_budget(naive_err, dtype, 3.0, np.abs(ref).max())
    assert err <= budget, f"dsinks: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"


@pytest.fixture
def launched_kernels(monkeypatch):
    """The names of the kernels prepared from here on, in order: _jit.prepare is recorded, and
    remembered plans are cleared (a plan of an earlier test would launch without preparing)."""
    from cuattn import _calls, _jit

    names = []
    prepare = _jit.prepare

    def recording(spec, *args, **kwargs):
        names.append(spec.name)
        return prepare(spec, *args, **kwargs)

    monkeypatch.setattr(_jit, "prepare", recording)
    _calls.clear()
    return names


# The two forward kernels a GPU test can ask for (the `forward_kernel` fixture): the Hopper one
# where the dispatcher picks it, and flash_fwd_kernel, forced by emptying the Hopper tile table.
FWD_KERNELS = ["sm90", "mma"]


@pytest.fixture(params=FWD_KERNELS)
def forward_kernel(request, monkeypatch):
    """Runs the test on each forward kernel: "sm90" leaves the dispatcher alone (skipped on a GPU
    that is not sm_90a), "mma" empties attention.FWD_SM90_TILES. Remembered plans are cleared
    before and after, since a plan keeps the kernel it was made with."""
    import importlib

    from cuattn import _calls, _jit

    attention_module = importlib.import_module("cuattn.attention")
    _calls.clear()
    if request.param == "mma":
        monkeypatch.setattr(attention_module, "FWD_SM90_TILES", {})
    elif _jit.gpu_unavailable_reason() is None and _jit.target_arch() != "sm_90a":
        pytest.skip(f"flash_fwd_sm90_kernel needs sm_90a; this GPU is {_jit.target_arch()}")
    yield request.param
    _calls.clear()


def forward_kernels(caplog) -> list[str]:
    """The forward kernels launched while ``caplog`` recorded, in order: the messages of the
    dispatcher's "attention forward: <kernel>" debug records."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention forward:")]


def expected_forward_kernel(dtype, head_dim: int, head_dim_v: int) -> str:
    """The start of the kernel name the forward dispatcher logs for these head dims under the
    current tile tables on the current GPU: flash_fwd_sm90_kernel at its tile's (D, Dv), or
    flash_fwd_kernel at its tile head dim."""
    import importlib

    from cuattn import _arrays, _jit

    attention_module = importlib.import_module("cuattn.attention")
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    hopper = attention_module.fwd_sm90_tile_dims(head_dim, head_dim_v) if _jit.target_arch() == "sm_90a" else None
    if hopper is not None:
        return f"flash_fwd_sm90_kernel<{ctype}, {ctype}, {hopper[0]}, {hopper[1]},"
    return f"flash_fwd_kernel<{ctype}, {attention_module.fwd_tile_dim(head_dim, head_dim_v)},"


TILE_ORDER_CHUNK = _params.constant("kTileOrderChunk")


def expected_tile_order(lens_q, lens_k, num_heads, m_blocks, block_m, section, capacity):
    """tile_order.cu's list, in Python, from each launch entry's query and key counts: chunks of
    TILE_ORDER_CHUNK entries, each by decreasing key count (then index); an entry's heads in
    sections of ``section``, a section's query blocks last to first over its heads; each tile as
    its static index bh * m_blocks + m_rank."""
    tiles = []
    for c0 in range(0, len(lens_q), TILE_ORDER_CHUNK):
        chunk = range(c0, min(len(lens_q), c0 + TILE_ORDER_CHUNK))
        for b in sorted(chunk, key=lambda i: (-max(lens_k[i], 0), i)):
            m_tiles = min(-(-max(lens_q[b], 0) // block_m), m_blocks)
            for h0 in range(0, num_heads, section):
                heads = range(h0, min(num_heads, h0 + section))
                tiles += [(b * num_heads + h) * m_blocks + m_blocks - 1 - m
                          for m in reversed(range(m_tiles)) for h in heads]
    return tiles[:capacity]
