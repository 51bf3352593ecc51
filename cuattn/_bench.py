"""Measurement helpers shared by the benchmarks (tests/bench) and the tuning scripts.

FLOPs and bytes are counted here once: forward attention does 4 * B * H * Sq * Sk * D
floating-point operations (two GEMMs of 2 * Sq * Sk * D each), halved under a causal mask with
Sq == Sk; the backward does 2.5x the forward. A decode step reads every cached key and value
once: 2 * B * L * Hk * D * itemsize bytes, reported as TB/s. Times come from CUDA events around many launches
after a warm-up, median over repeats.
"""

from __future__ import annotations

import math
import statistics

BACKWARD_FLOP_RATIO = 2.5


def kv_bytes(batch, seqlen, num_kv_heads, head_dim, itemsize=2) -> float:
    """Bytes of K and V a decode step must read: each cached key and value once."""
    return 2.0 * batch * seqlen * num_kv_heads * head_dim * itemsize


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False) -> float:
    """Forward FLOPs, DESIGN.md's convention: 4 * B * H * Sq * Sk * D, halved for causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


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


def naive_attention_cupy(q, k, v, causal=False):
    """matmul, softmax, matmul in the inputs' precision with CuPy: the baseline that writes N x N."""
    import cupy

    b, sq, h, d = q.shape
    sk = k.shape[1]
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = cupy.matmul(qh, kh.transpose(0, 1, 3, 2)) * q.dtype.type(1.0 / math.sqrt(d))
    if causal:
        i = cupy.arange(sq)[:, None]
        j = cupy.arange(sk)[None, :]
        s = cupy.where(j <= i + sk - sq, s, q.dtype.type(-math.inf))
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cupy.matmul(p, vh).transpose(0, 2, 1, 3)


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
