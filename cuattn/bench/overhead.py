"""``python -m cuattn bench overhead``: host time per call and eager back-to-back throughput.

(The CLI, its --json record and the environment header are ``cli``'s.)

For each public function at a small shape, and for each input framework (CuPy, torch), it calls
the function ``CALLS`` times back to back without synchronising:

    host us per call   = wall time of the loop of calls / CALLS        (launch only, no sync)
    eager us per call  = wall time of the loop plus the final sync / CALLS

The shapes are small enough that the kernels take less time than the host: the first number is
then the Python and launch cost a user pays on every eager call, and the second what an eager
loop achieves. torch SDPA on the same shapes is the baseline. Decode-like cases also report the
eager loop's rate of KV-cache reading in TB/s (K and V bytes per call / eager time per call). The
torch adapter's ops (``cuattn.torch.attention``, ``attention_varlen``) are timed as a training
step uses them, forward and backward through autograd, beside torch SDPA's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .cases import block_table

# Calls per measured loop: well below the CUDA launch queue's depth (about 1000 launches), so a
# loop of launches that run faster than the GPU never blocks on a full queue.
CALLS = 200
WARMUP_CALLS = 20
REPEATS = 5  # the loop is repeated and the fastest repeat kept (other processes' noise only adds)


@dataclasses.dataclass(frozen=True)
class OverheadCase:
    function: str  # the public function, or "torch SDPA" for the baseline
    framework: str  # "cupy" or "torch"
    shape: str  # for the table
    kv_bytes: int = 0  # K and V bytes read per call (decode-like cases), 0 when not a rate case


@dataclasses.dataclass(frozen=True)
class OverheadResult:
    case: OverheadCase
    host_us: float
    eager_us: float

    @property
    def tb_per_s(self) -> float:
        return self.case.kv_bytes / (self.eager_us * 1e-6) / 1e12 if self.case.kv_bytes else float("nan")


def time_calls(fn: Callable[[], object], synchronize: Callable[[], None]) -> tuple[float, float]:
    """(host us per call, eager us per call): the best of ``REPEATS`` loops of ``CALLS`` calls."""
    for _ in range(WARMUP_CALLS):
        fn()
    synchronize()
    best_host = best_eager = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        launched = time.perf_counter()
        synchronize()
        done = time.perf_counter()
        best_host = min(best_host, (launched - start) / CALLS * 1e6)
        best_eager = min(best_eager, (done - start) / CALLS * 1e6)
    return best_host, best_eager


def _inputs(framework: str, rng, shapes: dict, dtype) -> dict:
    """Random device arrays of the given shapes in one framework (int32 where the name says so)."""
    import cupy

    out = {}
    for name, (shape, kind) in shapes.items():
        if kind == "int32":
            host = np.asarray(shape, np.int32)
        else:
            host = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        arr = cupy.asarray(host)
        if framework == "torch":
            import torch

            arr = torch.from_dlpack(arr)
        out[name] = arr
    return out


def cases(dtype) -> list[tuple[OverheadCase, Callable[[], Callable[[], object]]]]:
    """Every (case, setup) pair; setup() builds the inputs and returns the call to time."""
    import cuattn

    rng = np.random.default_rng(0)
    b, s, h, d = 1, 128, 8, 64
    dec_b, dec_len, dec_hq, dec_hk, dec_d = 1, 32768, 32, 8, 128
    block = 16
    # paged_attention_varlen's mixed step: a chunk and decode rows, each sequence over step_len keys
    step_b, step_chunk, step_len = 4, 64, 1024
    step_shape = (f"{step_chunk} + {step_b - 1} x 1 queries, L {step_len // 1024}k, {dec_hq}/{dec_hk}, D {dec_d}, "
                  f"NumPy table")
    kv_bytes = 2 * dec_b * dec_len * dec_hk * dec_d * np.dtype(dtype).itemsize
    attn_shape = f"({b}, {s}, {h}, {d})"
    dec_shape = f"B {dec_b}, L {dec_len // 1024}k, {dec_hq}/{dec_hk}, D {dec_d}"
    found = []

    for fw in ("cupy", "torch"):
        def attention_setup(fw=fw):
            x = _inputs(fw, rng, {n: ((b, s, h, d), "f") for n in "qkv"}, dtype)
            return lambda: cuattn.attention(x["q"], x["k"], x["v"])

        def backward_setup(fw=fw):
            x = _inputs(fw, rng, {n: ((b, s, h, d), "f") for n in "qkv"}, dtype)
            out, lse = cuattn.attention(x["q"], x["k"], x["v"], return_lse=True)
            return lambda: cuattn.attention_backward(out, x["q"], x["k"], x["v"], out, lse)

        def varlen_setup(fw=fw):
            x = _inputs(fw, rng, {**{n: ((s, h, d), "f") for n in "qkv"}, "cu": ([0, s // 2, s], "int32")}, dtype)
            return lambda: cuattn.attention_varlen(x["q"], x["k"], x["v"], x["cu"], x["cu"], s // 2, s // 2)

        def merge_setup(fw=fw):
            x = _inputs(fw, rng, {n: ((b, s, h, d), "f") for n in "qkv"}, dtype)
            o1, l1 = cuattn.attention(x["q"], x["k"], x["v"], return_lse=True)
            o2, l2 = cuattn.attention(x["q"], x["v"], x["k"], return_lse=True)
            return lambda: cuattn.merge_states(o1, l1, o2, l2)

        def decode_setup(fw=fw):
            x = _inputs(fw, rng, {"q": ((dec_b, 1, dec_hq, dec_d), "f"), "k": ((dec_b, dec_len, dec_hk, dec_d), "f"),
                                  "v": ((dec_b, dec_len, dec_hk, dec_d), "f"), "lens": ([dec_len] * dec_b, "int32")},
                        dtype)
            return lambda: cuattn.decode(x["q"], x["k"], x["v"], x["lens"])

        def paged_setup(fw=fw):
            pages = dec_b * dec_len // block
            table = block_table(dec_b, pages // dec_b, rng=rng)
            x = _inputs(fw, rng, {"q": ((dec_b, 1, dec_hq, dec_d), "f"), "kp": ((pages, block, dec_hk, dec_d), "f"),
                                  "vp": ((pages, block, dec_hk, dec_d), "f"), "table": (table, "int32"),
                                  "lens": ([dec_len] * dec_b, "int32")}, dtype)
            return lambda: cuattn.paged_attention(x["q"], (x["kp"], x["vp"]), x["table"], x["lens"], check=False)

        def varlen_step_setup(fw=fw):
            # a serving step: one prefill chunk and decode rows, the table and lengths NumPy arrays
            # as a block manager keeps them (checked each call, the default)
            runs = [step_chunk] + [1] * (step_b - 1)
            pages = step_b * step_len // block
            cu = np.concatenate([[0], np.cumsum(runs)]).astype(np.int32)
            table = block_table(step_b, pages // step_b, rng=rng)
            lens = np.full(step_b, step_len, np.int32)
            x = _inputs(fw, rng, {"q": ((int(cu[-1]), dec_hq, dec_d), "f"),
                                  "kp": ((pages, block, dec_hk, dec_d), "f"), "vp": ((pages, block, dec_hk, dec_d), "f")},
                        dtype)
            return lambda: cuattn.paged_attention_varlen(x["q"], (x["kp"], x["vp"]), table, cu, lens, step_chunk)

        def decode_plan_setup(fw=fw):
            x = _inputs(fw, rng, {"q": ((dec_b, 1, dec_hq, dec_d), "f"), "k": ((dec_b, dec_len, dec_hk, dec_d), "f"),
                                  "v": ((dec_b, dec_len, dec_hk, dec_d), "f"), "lens": ([dec_len] * dec_b, "int32")},
                        dtype)
            return cuattn.plan_decode(x["q"], x["k"], x["v"], x["lens"]).run

        found += [
            (OverheadCase("attention", fw, attn_shape), attention_setup),
            (OverheadCase("attention_varlen", fw, f"2 x ({s // 2}, {h}, {d})"), varlen_setup),
            (OverheadCase("attention_backward", fw, attn_shape), backward_setup),
            (OverheadCase("merge_states", fw, f"2 x {attn_shape}"), merge_setup),
            (OverheadCase("decode", fw, dec_shape, kv_bytes), decode_setup),
            (OverheadCase("paged_attention", fw, f"{dec_shape}, block {block}", kv_bytes), paged_setup),
            (OverheadCase("plan_decode(...).run", fw, dec_shape, kv_bytes), decode_plan_setup),
            (OverheadCase("paged_attention_varlen", fw, step_shape), varlen_step_setup),
        ]

    def sdpa_attention_setup():
        import torch

        x = _inputs("torch", rng, {n: ((b, h, s, d), "f") for n in "qkv"}, dtype)
        return lambda: torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"])

    def sdpa_decode_setup():
        import torch

        x = _inputs("torch", rng, {"q": ((dec_b, dec_hq, 1, dec_d), "f"), "k": ((dec_b, dec_hk, dec_len, dec_d), "f"),
                                   "v": ((dec_b, dec_hk, dec_len, dec_d), "f")}, dtype)
        return lambda: torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], enable_gqa=True)

    def _leaves(shapes: dict):
        """torch leaves that require gradients, and a dout in q's shape."""
        x = _inputs("torch", rng, shapes, dtype)
        return {n: t.requires_grad_() if n in ("q", "k", "v") else t for n, t in x.items()}, x["q"].detach().clone()

    def _step(call, leaves, dout):
        """A training step's attention: the forward through autograd, then dq, dk, dv (no .grad
        accumulation, which would add a kernel per leaf)."""
        import torch

        inputs = [leaves[n] for n in "qkv"]
        return lambda: torch.autograd.grad(call(*inputs), inputs, dout)

    def torch_training_setup():
        import cuattn.torch

        leaves, dout = _leaves({n: ((b, s, h, d), "f") for n in "qkv"})
        return _step(cuattn.torch.attention, leaves, dout)

    def torch_varlen_training_setup():
        import cuattn.torch

        leaves, dout = _leaves({**{n: ((s, h, d), "f") for n in "qkv"}, "cu": ([0, s // 2, s], "int32")})
        cu = leaves["cu"]
        return _step(lambda q, k, v: cuattn.torch.attention_varlen(q, k, v, cu, cu, s // 2, s // 2), leaves, dout)

    def sdpa_training_setup():
        import torch

        leaves, dout = _leaves({n: ((b, h, s, d), "f") for n in "qkv"})
        return _step(torch.nn.functional.scaled_dot_product_attention, leaves, dout)

    training = "forward + backward, autograd"
    found += [
        (OverheadCase("torch SDPA", "torch", attn_shape), sdpa_attention_setup),
        (OverheadCase("torch SDPA", "torch", dec_shape, kv_bytes), sdpa_decode_setup),
        (OverheadCase("cuattn.torch.attention", "torch", f"{attn_shape}, {training}"), torch_training_setup),
        (OverheadCase("cuattn.torch.attention_varlen", "torch", f"2 x ({s // 2}, {h}, {d}), {training}"),
         torch_varlen_training_setup),
        (OverheadCase("torch SDPA", "torch", f"{attn_shape}, {training}"), sdpa_training_setup),
    ]
    return found


def run(dtype) -> list[OverheadResult]:
    """Measure every case whose framework is importable; a case that cannot run is left out."""
    import importlib.util

    import cupy

    synchronize = cupy.cuda.Device().synchronize
    results = []
    for case, setup in cases(dtype):
        if case.framework == "torch" and importlib.util.find_spec("torch") is None:
            continue
        host_us, eager_us = time_calls(setup(), synchronize)
        results.append(OverheadResult(case, host_us, eager_us))
    return results


def record(result: OverheadResult) -> dict:
    """One row of the JSON record."""
    rate = result.tb_per_s if result.case.kv_bytes else None
    return {**dataclasses.asdict(result.case), "host_us": result.host_us, "eager_us": result.eager_us, "tb_per_s": rate}


def format_table(results: list[OverheadResult]) -> str:
    header = "| function | inputs | shape | host us / call | eager us / call | eager TB/s |"
    lines = [header, "|---|---|---|---:|---:|---:|"]
    for r in results:
        rate = f"{r.tb_per_s:.2f}" if r.case.kv_bytes else ""
        lines.append(f"| {r.case.function} | {r.case.framework} | {r.case.shape} | {r.host_us:.1f} | "
                     f"{r.eager_us:.1f} | {rate} |")
    return "\n".join(lines)

