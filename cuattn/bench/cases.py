"""The standard benchmark sweep: its shapes, its inputs and the timed call of each implementation.

The pytest-benchmark suite (``tests/bench``) and ``python -m cuattn bench`` both run these cases,
so a figure in a pytest-benchmark JSON and one in the CLI's table come from the same inputs, the
same calls and the same timing (``cuattn.bench.timing``). Four families:

- ``forward``: 32k tokens in total (B = 32768 / N), H * D = 2048, N in {1k, 4k, 16k}, D in
  {64, 128}, causal or not (FlashAttention's benchmark shapes). TFLOP/s by `timing`'s count,
  4 * B * H * N * N * D, halved for causal.
- ``backward``: the same shapes, 2.5x the forward's FLOPs. Only the backward is timed: cuattn's
  ``attention_backward`` from the forward's out and lse; torch's ``autograd.grad`` of one SDPA
  forward kept alive with ``retain_graph``; the naive CuPy backward from the naive forward's out.
- ``decode``: GQA 32 query / 8 KV heads, D = 128, one new token over full caches at (B, L)
  pairs. TB/s of K and V read, timed on CUDA-graph replays (the GPU's time); the plain eager
  call's time is recorded beside it. ``cuattn-fp8`` reads the same cache quantised to e4m3
  (per-head scales): its TB/s counts the bytes it reads (half), so compare step times (``ms``).
- ``paged``: the decode shapes through ``paged_attention`` with block_size 16, every sequence's
  blocks shuffled across the pool, beside cuattn's contiguous decode on the same cache laid out
  contiguously, and (``paged-fp8``) the same pages in e4m3 (all measured in one case).

Implementations: ``cuattn``; torch SDPA restricted to its ``torch-flash`` (FlashAttention-2) or
``torch-cudnn`` backend, where torch is importable and the backend takes the shape; and
``naive-cupy`` (matmul, softmax, matmul with every N x N intermediate in memory), always in
float16 because its matmuls are cuBLAS half-precision GEMMs; for the forward also ``jax-cudnn``
(``jax.nn.dot_product_attention(implementation="cudnn")`` under ``jax.jit``, where JAX runs on
the GPU). A case that cannot run raises
:class:`SkipCase` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from typing import Callable

import numpy as np

from .._arrays import BFLOAT16, FLOAT16, dtype_name
from . import timing

# The families in the order tables and plots show them.
FAMILY_ORDER = ("forward", "backward", "decode", "paged")

# Forward and backward: FlashAttention's benchmark grid.
TOTAL_TOKENS = 32768
HIDDEN = 2048  # H * D
SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
MASKS = (False, True)  # causal
ATTENTION_GRID = list(itertools.product(SEQLENS, HEAD_DIMS, MASKS))
ATTENTION_IMPLS = ("cuattn", "torch-flash", "torch-cudnn", "naive-cupy")
# The forward also runs beside JAX's cuDNN attention under jax.jit (jax.nn.dot_product_attention);
# JAX differentiates forward and backward together, so the backward table has no JAX column
# (scripts/bench_jax.py times forward + backward under jit).
FORWARD_IMPLS = ATTENTION_IMPLS + ("jax-cudnn",)

# Decode and paged decode: GQA 32 / 8, D = 128, one new token, the decode issue's (B, L) pairs.
DECODE_Q_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM = 32, 8, 128
DECODE_GRID = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (8, 131072)]
DECODE_IMPLS = ("cuattn", "cuattn-fp8", "torch-flash", "torch-cudnn")
BLOCK_SIZE = 16
PAGED_IMPLS = ("paged", "contiguous", "paged-fp8")

# --quick: a few small shapes of every family, for smoke tests (seconds, not minutes).
QUICK_TOTAL_TOKENS = 4096
QUICK_ATTENTION_GRID = list(itertools.product((512, 1024), (128,), MASKS))
QUICK_DECODE_GRID = [(1, 2048), (4, 4096)]

# naive CuPy keeps B * H score matrices of N x N (and several temporaries of that size): past
# this N they no longer fit in device memory.
NAIVE_MAX_SEQLEN = 4096
NAIVE_DTYPE = FLOAT16
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION"}

# pytest-benchmark's own rounds of the synchronised call (the CUDA-event figures in extra_info
# are the ones to read; these give `pytest-benchmark compare` a wall-clock figure per case id).
BENCHMARK_ROUNDS = 5

BYTES_PER_MIB, BYTES_PER_GIB = 2**20, 2**30

TFLOPS = "TFLOP/s"
TBPS = "TB/s"


class SkipCase(Exception):
    """This implementation cannot run this case here (no torch, a backend refuses the shape, too
    large for the naive baseline); the message says why."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """Logical shape of one case.

    ``seqlen`` is N (Sq = Sk) for forward and backward, the cached keys L for decode and paged.
    """

    batch: int
    seqlen: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    block_size: int = 0  # paged decode only


@dataclasses.dataclass(frozen=True)
class Family:
    """A kind of benchmark: its unit, the implementations it compares and its shapes."""

    name: str
    unit: str
    impls: tuple[str, ...]  # table columns; the first is the one the ratio columns divide
    measured_together: bool  # paged: one case measures every implementation on the same data
    title: str

    def shapes(self, quick: bool = False) -> list[Shape]:
        if self.name in ("forward", "backward"):
            tokens, grid = (QUICK_TOTAL_TOKENS, QUICK_ATTENTION_GRID) if quick else (TOTAL_TOKENS, ATTENTION_GRID)
            return [attention_shape(n, d, causal, tokens) for n, d, causal in grid]
        grid = QUICK_DECODE_GRID if quick else DECODE_GRID
        block_size = BLOCK_SIZE if self.name == "paged" else 0
        return [decode_shape(b, seqlen, block_size) for b, seqlen in grid]

    def shape_id(self, shape: Shape) -> str:
        """The shape's part of the pytest id: ``N4096-d128-causal`` or ``B8-L8192``."""
        if self.name in ("forward", "backward"):
            return f"N{shape.seqlen}-d{shape.head_dim}-{'causal' if shape.causal else 'full'}"
        return f"B{shape.batch}-L{shape.seqlen}"

    def cases(self, quick: bool = False) -> list[Case]:
        groups = [self.impls] if self.measured_together else [(impl,) for impl in self.impls]
        return [Case(self.name, shape, group) for shape in self.shapes(quick) for group in groups]


@dataclasses.dataclass(frozen=True)
class Case:
    """One unit of measurement: a family, a shape and the implementations measured together."""

    family: str
    shape: Shape
    impls: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.family} {FAMILIES[self.family].shape_id(self.shape)} {'/'.join(self.impls)}"


@dataclasses.dataclass
class Result:
    """One implementation's figures on one shape (or why there are none).

    ``rate`` is in the family's unit (TFLOP/s or TB/s) and ``ms`` the time per call it comes from
    (graph-replay time for decode and paged). ``info`` is what the pytest-benchmark case records
    in ``extra_info`` (shapes, dtype, times, rates).
    """

    family: str
    impl: str
    shape: Shape
    dtype: str
    ms: float | None = None
    rate: float | None = None
    info: dict = dataclasses.field(default_factory=dict)
    skipped: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.rate is not None and not self.skipped and not self.error

    @property
    def unit(self) -> str:
        return FAMILIES[self.family].unit

    def record(self) -> dict:
        """A JSON-ready dict: identity, shape, figures, status."""
        status = "error" if self.error else "skipped" if self.skipped else "ok"
        return {
            "family": self.family, "impl": self.impl, "id": FAMILIES[self.family].shape_id(self.shape),
            **dataclasses.asdict(self.shape), "dtype": self.dtype, "unit": self.unit, "ms": self.ms,
            "rate": self.rate, "status": status, "reason": self.error or self.skipped, "info": self.info,
        }


@dataclasses.dataclass
class Prepared:
    """A case with its inputs built: ``fn`` is the call pytest-benchmark times (the caller
    synchronises), ``measure`` times every implementation of the case with CUDA events."""

    case: Case
    fn: Callable[[], object]
    measure: Callable[[], list[Result]]


FAMILIES = {
    "forward": Family("forward", TFLOPS, FORWARD_IMPLS, False,
                      "attention forward, Sq = Sk = N, H * D = 2048, FLOPs 4 * B * H * N * N * D (halved for causal)"),
    "backward": Family("backward", TFLOPS, ATTENTION_IMPLS, False,
                       "attention backward (dq, dk, dv from out and lse), Sq = Sk = N, H * D = 2048, "
                       "FLOPs 2.5x the forward's"),
    "decode": Family("decode", TBPS, DECODE_IMPLS, False,
                     f"one new token over full caches, GQA {DECODE_Q_HEADS}/{DECODE_KV_HEADS}, D = {DECODE_HEAD_DIM}, "
                     "K and V bytes read per CUDA-graph-timed step"),
    "paged": Family("paged", TBPS, PAGED_IMPLS, True,
                    f"paged_attention (block_size {BLOCK_SIZE}, shuffled blocks) vs contiguous decode on the same "
                    f"cache, GQA {DECODE_Q_HEADS}/{DECODE_KV_HEADS}, D = {DECODE_HEAD_DIM}, CUDA-graph timed"),
}


def attention_shape(n: int, head_dim: int, causal: bool, total_tokens: int = TOTAL_TOKENS) -> Shape:
    """Forward/backward shape: ``total_tokens`` tokens in sequences of N, H * D = 2048, MHA."""
    heads = HIDDEN // head_dim
    return Shape(total_tokens // n, n, heads, heads, head_dim, causal)


def alibi_slopes(heads: int) -> np.ndarray:
    """The ALiBi paper's slopes of ``heads`` heads, float32: 2^(-8 i / H) for i = 1 .. H where H is a
    power of two; otherwise those of the power of two P below H, then every other slope of 2P's
    (the paper's reference code, which ALiBi models ship)."""
    if heads & (heads - 1) == 0:
        return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    below = 1 << (heads.bit_length() - 1)
    return np.concatenate([alibi_slopes(below), alibi_slopes(2 * below)[0::2][: heads - below]])


def decode_shape(batch: int, seqlen: int, block_size: int = 0) -> Shape:
    """Decode shape: GQA 32 / 8, D = 128, full caches of ``seqlen`` keys."""
    return Shape(batch, seqlen, DECODE_Q_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, False, block_size)


# Where a paged benchmark's sequences find their blocks in the pool (block_table):
#   shuffled     anywhere, as after a while of serving (the sweep's and the scripts' default)
#   in-order     each sequence's blocks one after another (a freshly filled pool)
#   interleaved  block p of sequence b at p * B + b (sequences that grew in lock step)
# The three tell the cost of where pages lie (TLB reach, DRAM locality) from the lookup's own.
PAGE_ORDERS = ("shuffled", "in-order", "interleaved")


def block_table(batch: int, blocks_per_seq: int, order: str = "shuffled", rng=None) -> np.ndarray:
    """int32 ``(batch, blocks_per_seq)``: each sequence's blocks of a pool of ``batch *
    blocks_per_seq``, every block used once, laid out as ``order`` (PAGE_ORDERS) says; ``rng``
    (a NumPy Generator, default a fresh one) draws the shuffle."""
    pool = batch * blocks_per_seq
    if order == "shuffled":
        blocks = (rng or np.random.default_rng()).permutation(pool)
    elif order == "in-order":
        blocks = np.arange(pool)
    elif order == "interleaved":
        blocks = np.arange(pool).reshape(blocks_per_seq, batch).T
    else:
        raise ValueError(f"order must be one of {', '.join(PAGE_ORDERS)}, got {order!r}")
    return blocks.reshape(batch, blocks_per_seq).astype(np.int32)


def impl_dtype(impl: str, dtype) -> np.dtype:
    """The dtype an implementation runs in: the sweep's, except naive CuPy's float16."""
    return NAIVE_DTYPE if impl == "naive-cupy" else np.dtype(dtype)


def prepare(case: Case, dtype=BFLOAT16) -> Prepared:
    """Build the case's inputs and calls; raise SkipCase where it cannot run here."""
    return _PREPARERS[case.family](case, np.dtype(dtype))


def run_case(case: Case, dtype=BFLOAT16) -> list[Result]:
    """Prepare and measure one case: one Result per implementation, skipped ones with the reason."""
    try:
        return prepare(case, dtype).measure()
    except SkipCase as exc:
        return [Result(case.family, impl, case.shape, dtype_name(impl_dtype(impl, dtype)), skipped=str(exc))
                for impl in case.impls]


def extra_info(case: Case, results: list[Result]) -> dict:
    """What the pytest-benchmark case records: the one result's info, or for paged decode both
    layouts' figures under ``paged_`` / ``contiguous_`` keys and their ratio, and the e4m3 pages'
    step time (``fp8_graph_ms``) and speedup over the 2-byte pages."""
    if case.family != "paged":
        (result,) = results
        return dict(result.info)
    by_impl = {r.impl: r for r in results}
    paged, contiguous = by_impl["paged"], by_impl["contiguous"]
    s = paged.shape
    return dict(
        batch=s.batch, seqlen=s.seqlen, block_size=s.block_size, q_heads=s.q_heads, kv_heads=s.kv_heads,
        head_dim=s.head_dim, dtype=paged.dtype, kv_bytes=paged.info["kv_bytes"],
        paged_graph_ms=paged.info["graph_ms"], paged_eager_ms=paged.info["eager_ms"], paged_tbps=paged.rate,
        contiguous_graph_ms=contiguous.info["graph_ms"], contiguous_eager_ms=contiguous.info["eager_ms"],
        contiguous_tbps=contiguous.rate, ratio=paged.rate / contiguous.rate,
        **({"fp8_graph_ms": by_impl["paged-fp8"].info["graph_ms"], "fp8_tbps": by_impl["paged-fp8"].rate,
            "fp8_speedup": paged.info["graph_ms"] / by_impl["paged-fp8"].info["graph_ms"]}
           if "paged-fp8" in by_impl else {}),
    )


def summary(results: list[Result]) -> str:
    """One line per result for the pytest log: shape, time and rate."""
    lines = []
    for r in results:
        s = r.shape
        if r.family in ("forward", "backward"):
            lines.append(f"{r.impl:12s} N={s.seqlen:6d} d={s.head_dim:3d} causal={s.causal!s:5s} "
                         f"{r.ms:8.3f} ms {r.rate:7.1f} TFLOP/s")
        else:
            lines.append(f"{r.impl:12s} B={s.batch:3d} L={s.seqlen:7d} {r.info['kv_bytes'] / BYTES_PER_MIB:8.1f} MiB "
                         f"graph {r.info['graph_ms'] * 1e3:8.1f} us {r.rate:5.2f} TB/s | "
                         f"eager {r.info['eager_ms'] * 1e3:8.1f} us {r.info['eager_tbps']:5.2f} TB/s")
    return "\n".join(lines)


def run_benchmark(benchmark, case: Case, skip: Callable[[str], None], dtype=BFLOAT16) -> list[Result]:
    """The pytest-benchmark test of one case: skip (``skip`` is ``pytest.skip``, passed in so that
    cuattn does not import pytest) where it cannot run, record its figures in
    ``benchmark.extra_info``, print one line per implementation, then let pytest-benchmark time
    the same call synchronised."""
    import cupy

    try:
        prepared = prepare(case, dtype)
        results = prepared.measure()
    except SkipCase as exc:
        skip(str(exc))
    benchmark.extra_info.update(extra_info(case, results))
    print("\n" + summary(results))

    def synchronised():
        prepared.fn()
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(synchronised, rounds=BENCHMARK_ROUNDS, iterations=1, warmup_rounds=1)
    return results


# ---------------------------------------------------------------------------------------------
# Inputs and calls


def _randn(shape, dtype):
    import cupy

    return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype)


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise SkipCase(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise SkipCase("torch sees no CUDA device (a CPU-only build?)")
    return torch


def _jax():
    # JAX would otherwise reserve most of the GPU's memory when it starts, beside CuPy's and torch's pools
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError as exc:
        raise SkipCase(f"jax is not importable ({exc})") from None
    if jax.default_backend() != "gpu":
        raise SkipCase(f"jax runs on {jax.default_backend()}, not on the GPU")
    return jax


def _jax_cudnn_forward(q, k, v, causal: bool):
    """JAX's cuDNN attention under jax.jit on the same inputs (zero-copy views of the CuPy arrays)."""
    jax = _jax()
    import jax.numpy as jnp

    jq, jk, jv = (jnp.from_dlpack(x) for x in (q, k, v))
    call = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="cudnn"))
    fn = lambda: call(jq, jk, jv)
    _refused("jax-cudnn", lambda: fn().block_until_ready())
    return fn


def _sdpa(impl: str, tq, tk, tv, **options) -> Callable[[], object]:
    """A call of torch SDPA restricted to the implementation's backend (imports resolved here,
    outside the timed call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = getattr(SDPBackend, TORCH_BACKENDS[impl])

    def run():
        with sdpa_kernel([backend]):
            return scaled_dot_product_attention(tq, tk, tv, **options)

    return run


def _refused(impl: str, call: Callable[[], object]):
    """Run ``call`` once; a backend that refuses the shape (torch raises RuntimeError, out of
    memory included) becomes a skip naming the first line of its message."""
    try:
        return call()
    except RuntimeError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SkipCase(f"{impl} does not run this shape: {first_line}") from None


def _check_naive(impl: str, shape: Shape) -> None:
    if impl == "naive-cupy" and shape.seqlen > NAIVE_MAX_SEQLEN:
        score_bytes = shape.batch * shape.q_heads * shape.seqlen**2 * NAIVE_DTYPE.itemsize
        raise SkipCase(f"naive CuPy runs up to N = {NAIVE_MAX_SEQLEN}: at N = {shape.seqlen} its score matrices "
                       f"alone take {score_bytes / BYTES_PER_GIB:.0f} GiB and the softmax makes several copies")


def _attention_info(impl: str, shape: Shape, dtype: np.dtype, ms: float, tflops: float) -> dict:
    return dict(impl=impl, batch=shape.batch, heads=shape.q_heads, seqlen=shape.seqlen, head_dim=shape.head_dim,
                causal=shape.causal, dtype=dtype_name(dtype), ms=ms, tflops=tflops)


def _prepare_forward(case: Case, dtype: np.dtype) -> Prepared:
    import cupy

    import cuattn

    (impl,) = case.impls
    s = case.shape
    _check_naive(impl, s)
    torch = _torch() if impl in TORCH_BACKENDS else None
    dtype = impl_dtype(impl, dtype)
    q, k, v = (_randn((s.batch, s.seqlen, s.q_heads, s.head_dim), dtype) for _ in range(3))
    if impl == "cuattn":
        out = cupy.empty_like(q)
        fn = lambda: cuattn.attention(q, k, v, causal=s.causal, out=out)
    elif impl == "naive-cupy":
        fn = lambda: timing.naive_attention_cupy(q, k, v, causal=s.causal)
    elif impl == "jax-cudnn":
        fn = _jax_cudnn_forward(q, k, v, s.causal)
    else:
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
        fn = _sdpa(impl, tq, tk, tv, is_causal=s.causal)
        _refused(impl, fn)

    def measure():
        # JAX runs on its own stream: timed by the host clock around back-to-back jitted calls
        ms = (timing.time_synced(fn, lambda out: out.block_until_ready()) if impl == "jax-cudnn"
              else timing.time_cuda(fn))
        tflops = timing.attention_flops(s.batch, s.q_heads, s.seqlen, s.seqlen, s.head_dim, s.causal) / ms / 1e9
        info = _attention_info(impl, s, dtype, ms, tflops)
        return [Result(case.family, impl, s, dtype_name(dtype), ms, tflops, info)]

    return Prepared(case, fn, measure)


# The dQ paths forced_bwd_dq_mode takes: BwdTile.dq_mode values (bulk reductions are ordered for
# deterministic=True).
BWD_FORCED_DQ_MODES = ("atomic", "bulk")


@contextlib.contextmanager
def forced_bwd_dq_mode(mode: str):
    """Within the block, attention_backward on sm_90a's wgmma tiles takes the dQ path ``mode``
    (BWD_FORCED_DQ_MODES) whatever the dispatcher would pick (tiles where ALiBi keeps its own
    path, tiles without that path (bwd_dq_modes) and mma.sync tiles are left alone). Remembered
    plans are cleared on entry and exit: a plan keeps the kernels of the call that made it, so a
    second path forced for the same shapes would otherwise replay the first one's."""
    import importlib

    from .. import _calls

    if mode not in BWD_FORCED_DQ_MODES:
        raise ValueError(f"mode must be one of {BWD_FORCED_DQ_MODES}, got {mode!r}")
    attention_module = importlib.import_module("cuattn.attention")
    plain_bwd_tile = attention_module.bwd_tile

    def bwd_tile(head_dim, arch, deterministic=False, alibi=False, head_dim_v=None):
        tile = plain_bwd_tile(head_dim, arch, deterministic, alibi, head_dim_v)
        tile_dim = attention_module.bwd_tile_dim(max(head_dim, head_dim_v or head_dim), arch)
        takes = tile.wgmma and not alibi and mode in attention_module.bwd_dq_modes(tile, tile_dim)
        return dataclasses.replace(tile, dq_mode=mode) if takes else tile

    attention_module.bwd_tile = bwd_tile
    _calls.clear()
    try:
        yield
    finally:
        attention_module.bwd_tile = plain_bwd_tile
        _calls.clear()


def _prepare_backward(case: Case, dtype: np.dtype) -> Prepared:
    import cupy

    import cuattn

    (impl,) = case.impls
    s = case.shape
    _check_naive(impl, s)
    torch = _torch() if impl in TORCH_BACKENDS else None
    dtype = impl_dtype(impl, dtype)
    q, k, v, dout = (_randn((s.batch, s.seqlen, s.q_heads, s.head_dim), dtype) for _ in range(4))
    if impl == "cuattn":
        out, lse = cuattn.attention(q, k, v, causal=s.causal, return_lse=True)
        fn = lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=s.causal)
    elif impl == "naive-cupy":
        out = timing.naive_attention_cupy(q, k, v, causal=s.causal)
        fn = lambda: timing.naive_attention_backward_cupy(dout, q, k, v, out, causal=s.causal)
    else:
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
        tdo = torch.from_dlpack(dout).transpose(1, 2)
        tout = _refused(impl, _sdpa(impl, tq, tk, tv, is_causal=s.causal))
        fn = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)
        _refused(impl, fn)

    def measure():
        ms = timing.time_cuda(fn)
        forward_flops = timing.attention_flops(s.batch, s.q_heads, s.seqlen, s.seqlen, s.head_dim, s.causal)
        tflops = timing.BACKWARD_FLOP_RATIO * forward_flops / ms / 1e9
        info = _attention_info(impl, s, dtype, ms, tflops)
        if impl == "cuattn":
            # every allocation of one backward call beyond dq, dk, dv (the README's budget: dQ accumulator + delta)
            pool = cupy.get_default_memory_pool()
            cupy.cuda.Device().synchronize()
            pool.free_all_blocks()
            before = pool.total_bytes()
            grads = fn()
            info["extra_bytes"] = pool.total_bytes() - before - sum(g.nbytes for g in grads)
            del grads
        return [Result(case.family, impl, s, dtype_name(dtype), ms, tflops, info)]

    return Prepared(case, fn, measure)


def _decode_figures(fn, nbytes: float, *, torch_graph: bool) -> dict:
    eager_ms = timing.time_cuda(fn)
    graph_ms = timing.time_torch_graph(fn) if torch_graph else timing.time_cupy_graph(fn)
    return dict(graph_ms=graph_ms, eager_ms=eager_ms, kv_bytes=nbytes, tbps=nbytes / graph_ms / 1e9,
                eager_tbps=nbytes / eager_ms / 1e9)


def _prepare_decode(case: Case, dtype: np.dtype) -> Prepared:
    import cupy

    import cuattn

    (impl,) = case.impls
    s = case.shape
    torch = _torch() if impl in TORCH_BACKENDS else None
    q = _randn((s.batch, 1, s.q_heads, s.head_dim), dtype)
    k = _randn((s.batch, s.seqlen, s.kv_heads, s.head_dim), dtype)
    v = _randn((s.batch, s.seqlen, s.kv_heads, s.head_dim), dtype)
    lens = cupy.full((s.batch,), s.seqlen, np.int32)
    kv_itemsize = np.dtype(dtype).itemsize
    if impl == "cuattn":
        fn = lambda: cuattn.decode(q, k, v, lens)
    elif impl == "cuattn-fp8":
        k_scale, v_scale = (cuattn.fp8_scales(x, per_head=True) for x in (k, v))
        k, v = cuattn.quantize_fp8(k, k_scale), cuattn.quantize_fp8(v, v_scale)  # [B, L, Hk, D] e4m3
        kv_itemsize = 1
        fn = lambda: cuattn.decode(q, k, v, lens, k_scale=k_scale, v_scale=v_scale)
    else:
        tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
        fn = _sdpa(impl, tq, tk, tv, enable_gqa=True)
        _refused(impl, fn)

    def measure():
        nbytes = timing.kv_bytes(s.batch, s.seqlen, s.kv_heads, s.head_dim, kv_itemsize)
        figures = _decode_figures(fn, nbytes, torch_graph=impl in TORCH_BACKENDS)
        info = dict(impl=impl, batch=s.batch, seqlen=s.seqlen, q_heads=s.q_heads, kv_heads=s.kv_heads,
                    head_dim=s.head_dim, dtype=dtype_name(dtype), **figures)
        return [Result(case.family, impl, s, dtype_name(dtype), figures["graph_ms"], figures["tbps"], info)]

    return Prepared(case, fn, measure)


def _prepare_paged(case: Case, dtype: np.dtype) -> Prepared:
    import cupy

    import cuattn

    s = case.shape
    blocks_per_seq = s.seqlen // s.block_size
    num_blocks = s.batch * blocks_per_seq
    page_shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)  # [num_blocks, block_size, Hk, D]
    k_pages, v_pages = _randn(page_shape, dtype), _randn(page_shape, dtype)
    # blocks shuffled across the pool, as after a while of serving
    table = cupy.asarray(block_table(s.batch, blocks_per_seq))  # [B, max_blocks]
    lens = cupy.full((s.batch,), s.seqlen, np.int32)
    q = _randn((s.batch, 1, s.q_heads, s.head_dim), dtype)
    # the same cache laid out contiguously, for the baseline: [B, L, Hk, D]
    k_cache = k_pages[table].reshape(s.batch, s.seqlen, s.kv_heads, s.head_dim)
    v_cache = v_pages[table].reshape(s.batch, s.seqlen, s.kv_heads, s.head_dim)

    def paged():
        # check=False: no host copy of the table, so the call can be captured in a CUDA graph
        return cuattn.paged_attention(q, (k_pages, v_pages), table, lens, check=False, max_seq_len=s.seqlen)

    def contiguous():
        return cuattn.decode(q, k_cache, v_cache, lens)

    # the same pages in e4m3, per-head scales: [num_blocks, block_size, Hk, D] bytes
    k_scale, v_scale = (cuattn.fp8_scales(x, per_head=True) for x in (k_pages, v_pages))
    k8, v8 = cuattn.quantize_fp8(k_pages, k_scale), cuattn.quantize_fp8(v_pages, v_scale)

    def paged_fp8():
        return cuattn.paged_attention(q, (k8, v8), table, lens, check=False, max_seq_len=s.seqlen, k_scale=k_scale,
                                      v_scale=v_scale)

    calls = {"paged": paged, "contiguous": contiguous, "paged-fp8": paged_fp8}

    def measure():
        results = []
        for impl in case.impls:
            itemsize = 1 if impl == "paged-fp8" else np.dtype(dtype).itemsize
            nbytes = timing.kv_bytes(s.batch, s.seqlen, s.kv_heads, s.head_dim, itemsize)
            fn = calls[impl]
            graph_ms = timing.time_cupy_graph(fn)
            eager_ms = timing.time_cuda(fn)
            info = dict(graph_ms=graph_ms, eager_ms=eager_ms, kv_bytes=nbytes, tbps=nbytes / graph_ms / 1e9,
                        eager_tbps=nbytes / eager_ms / 1e9)
            results.append(Result(case.family, impl, s, dtype_name(dtype), graph_ms, info["tbps"], info))
        return results

    return Prepared(case, paged, measure)


_PREPARERS = {
    "forward": _prepare_forward,
    "backward": _prepare_backward,
    "decode": _prepare_decode,
    "paged": _prepare_paged,
}
