"""Measurement helpers shared by the benchmarks (tests/bench) and the tuning scripts.

FLOPs and bytes are counted here once: forward attention does 4 * B * H * Sq * Sk * D
floating-point operations (two GEMMs of 2 * Sq * Sk * D each), halved under a causal mask with
Sq == Sk; the backward does 2.5x the forward. A decode step reads every cached key and value
once: 2 * B * L * Hk * D * itemsize bytes, reported as TB/s. Times come from CUDA events around many launches
after a warm-up, median over repeats. The L2 is not flushed between launches: a call whose
inputs fit in it (50 MiB on H100/H200; a decode cache under that) reads them from the L2 on
every launch after the first, so its TB/s is not the device memory's.

The physical ceilings the figures are read against are measured here too: the device's copy
bandwidth (one large device-to-device copy, bytes read plus bytes written) and the dense GEMM rate
of cuBLAS through ``cupy.matmul`` (2 * M * N * K FLOPs).
"""

from __future__ import annotations

import math
import statistics
import time

BACKWARD_FLOP_RATIO = 2.5
# 1 GiB per buffer: far beyond any L2 (50 MiB on H100/H200), so the copy streams from device memory.
COPY_BYTES = 1 << 30
# The GEMM ceiling's M = N = K: large enough that cuBLAS runs at its peak tile efficiency.
GEMM_SIZE = 8192


def kv_bytes(batch, seqlen, num_kv_heads, head_dim, itemsize=2) -> float:
    """Bytes of K and V a decode step must read: each cached key and value once."""
    return 2.0 * batch * seqlen * num_kv_heads * head_dim * itemsize


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False) -> float:
    """Forward FLOPs, cuattn's one convention: 4 * B * H * Sq * Sk * D, halved for causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def gemm_flops(m, n, k) -> float:
    """FLOPs of one (m x k) @ (k x n) product: a multiply and an add per term."""
    return 2.0 * m * n * k


def time_cuda(fn, *, warmup: int = 3, repeats: int = 10, inner: int | None = None, target_ms: float = 20.0) -> float:
    """Median milliseconds per call of ``fn`` on the current CuPy stream, timed with CUDA events.

    ``inner`` calls run between each pair of events (chosen from a trial run so that one timed
    window lasts about ``target_ms``), which keeps launch gaps and event resolution out of the number.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    if inner is None:
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        trial = max(cupy.cuda.get_elapsed_time(start, stop), 1e-3)
        inner = max(1, min(1000, math.ceil(target_ms / trial)))
    samples = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(inner):
            fn()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / inner)
    return statistics.median(samples)


def samples_in_turn(calls: dict, rounds: int = 3, *, before=None, timer=None) -> dict:
    """Milliseconds per call of each of ``calls`` (key -> fn), one sample a round: each round times
    every call in turn with ``timer`` (default :func:`time_cuda`); ``before(key)`` runs ahead of
    each timing (to set up a schedule, say). Cases compared with one another are timed so rather
    than once each in a fixed order, where the later ones run at the clocks the earlier ones left
    (on the H200 one call's time moved 12% between two turns in one process); a ratio of two
    cases is then best read round by round (:func:`ratio_in_turn`)."""
    timer = timer or time_cuda
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            if before is not None:
                before(key)
            times[key].append(timer(fn))
    return times


def time_in_turn(calls: dict, rounds: int = 3, *, before=None, timer=None) -> dict:
    """Median milliseconds per call of each of ``calls``, timed in turn (:func:`samples_in_turn`)."""
    samples = samples_in_turn(calls, rounds, before=before, timer=timer)
    return {key: statistics.median(times) for key, times in samples.items()}


def ratio_in_turn(numerator: list, denominator: list) -> tuple[float, float, float]:
    """(median, min, max) over the rounds of ``numerator[r] / denominator[r]``: two cases' samples
    from one :func:`samples_in_turn`, each round's pair timed back to back."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def time_synced(fn, sync, *, warmup: int = 3, repeats: int = 10, target_ms: float = 20.0) -> float:
    """Median milliseconds per call of ``fn`` by the host clock, ``sync(result)`` after each window.

    For work on a stream CuPy's events do not see (JAX's): ``inner`` back-to-back calls per
    window (chosen from a trial call so that a window lasts about ``target_ms``), then the host
    waits for the last result, so dispatch overlaps execution as in a training loop.
    """
    for _ in range(warmup):
        sync(fn())
    start = time.perf_counter()
    sync(fn())
    trial_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    inner = max(1, min(1000, math.ceil(target_ms / trial_ms)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            result = fn()
        sync(result)
        samples.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(samples)


def naive_attention_cupy(q, k, v, causal=False):
    """matmul, softmax, matmul in the inputs' precision with CuPy: the baseline that writes N x N."""
    import cupy

    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    p = _naive_probabilities(qh, kh, causal)
    return cupy.matmul(p, vh).transpose(0, 2, 1, 3)


def _naive_probabilities(qh, kh, causal):
    """softmax(Q K^T / sqrt(D)) of [B, H, S, D] views in their precision, [B, H, Sq, Sk] in memory
    (causal: bottom-right aligned)."""
    import cupy

    sq, sk, d = qh.shape[2], kh.shape[2], qh.shape[3]
    s = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)) * qh.dtype.type(1.0 / math.sqrt(d))
    if causal:
        i = cupy.arange(sq)[:, None]
        j = cupy.arange(sk)[None, :]
        s = cupy.where(j <= i + sk - sq, s, qh.dtype.type(-math.inf))
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def time_cupy_graph(fn, *, calls_per_graph: int = 20, repeats: int = 10) -> float:
    """Median milliseconds per call with ``calls_per_graph`` calls captured in one CUDA graph.

    Replaying a graph removes the host's launch overhead, so this is the GPU time of the work
    itself (for small decode steps the Python launch path otherwise dominates).
    """
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls_per_graph):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        ms = time_cuda(lambda: graph.launch(stream), warmup=2, repeats=repeats, inner=5)
    return ms / calls_per_graph


def time_torch_graph(fn, *, calls_per_graph: int = 20, repeats: int = 10) -> float:
    """The same for work that torch launches, captured with torch.cuda.graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    torch.cuda.synchronize()
    return time_cuda(graph.replay, warmup=2, repeats=repeats, inner=5) / calls_per_graph


def naive_attention_backward_cupy(dout, q, k, v, out, causal=False):
    """The backward of :func:`naive_attention_cupy` in the inputs' precision: recompute P, then
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D),
    every N x N intermediate in memory."""
    import cupy

    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    qh, kh, vh, oh, doh = (x.transpose(0, 2, 1, 3) for x in (q, k, v, out, dout))
    p = _naive_probabilities(qh, kh, causal)
    dv = cupy.matmul(p.transpose(0, 1, 3, 2), doh)
    dp = cupy.matmul(doh, vh.transpose(0, 1, 3, 2))
    ds = p * (dp - (doh * oh).sum(axis=-1, keepdims=True))
    dq = cupy.matmul(ds, kh) * scale
    dk = cupy.matmul(ds.transpose(0, 1, 3, 2), qh) * scale
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


def copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """The device's copy bandwidth in TB/s: one ``nbytes`` device-to-device cudaMemcpyAsync,
    counting the bytes read and the bytes written (2 * nbytes per copy)."""
    import cupy

    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    ms = time_cuda(lambda: dst.data.copy_from_device_async(src.data, nbytes))
    return 2.0 * nbytes / ms / 1e9


def gemm_rate(size: int = GEMM_SIZE, dtype=None) -> tuple[float, str]:
    """Dense GEMM TFLOP/s of ``cupy.matmul`` (cuBLAS) on ``size x size`` matrices, and the dtype used.

    ``dtype`` defaults to bfloat16 (CuPy 14.2's cuBLAS dtype table takes it); a CuPy whose
    matmul refuses it (TypeError: "dtype is not supported") is measured in float16 instead, which
    runs on the same tensor cores at the same rate.
    """
    import cupy
    import numpy as np

    from .._arrays import BFLOAT16, FLOAT16, dtype_name

    candidates = list(dict.fromkeys([np.dtype(BFLOAT16 if dtype is None else dtype), FLOAT16]))
    refusals = []
    for candidate in candidates:
        a, b = (cupy.random.standard_normal((size, size), dtype=cupy.float32).astype(candidate) for _ in range(2))
        out = cupy.empty((size, size), dtype=candidate)
        try:
            cupy.matmul(a, b, out=out)
        except Exception as exc:  # CuPy's dtype table raises TypeError, cuBLAS its own CUBLASError
            refusals.append(f"{dtype_name(candidate)}: {type(exc).__name__}: {exc}")
            continue
        ms = time_cuda(lambda: cupy.matmul(a, b, out=out))
        return gemm_flops(size, size, size) / ms / 1e9, dtype_name(candidate)
    raise TypeError(f"cupy.matmul refuses every GEMM dtype tried: {'; '.join(refusals)}")
