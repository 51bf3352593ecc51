"""The FP8 forward (#16) on the current GPU: speed beside the bf16 forward and torch SDPA, and
accuracy against float64 on inputs with outliers.

python scripts/bench_fp8_fwd.py [--lengths 4096,8192,16384] [--head-dims 128,256] [--rounds 3] [--json PATH] [--tune]

Speed: one line per (head dim, N, mask): ms and TFLOP/s of
    fp8        cuattn.attention on e4m3 q, k, v with per-head scales, bf16 output: the whole call
               from quantised inputs (its V^T pass, V^T buffer, output and host checks included;
               the quantisation itself, cuattn.fp8.quantize_qkv, is not: it runs once before)
    fp8-kernel the same minus the V^T pass (fp8_v_transpose_kernel on the device, timed alone:
               "vt" ms, one read and one write of V), round by round
    bf16       cuattn.attention on bf16 q, k, v (flash_fwd_sm90_kernel)
    sdpa       torch.nn.functional.scaled_dot_product_attention, bf16 (when torch imports)
    32k tokens in total (B = 32768 / N), H * D = 2048, as the forward benchmark. The calls of a
    (head dim, N, mask) are timed in turn, --rounds times over (medians).
--tune: first time FP8 tile candidates (stages, overlap, pingpong, consumers) at each length for
the FWD_SM90_FP8_TILES table (every candidate compiles without spills: `python -m cuattn build`),
the remembered plans cleared around each (a plan replays the kernel it was made with).
Accuracy: RMSE against the float64 reference of the unquantised inputs (FlashAttention-3's
outliers: N(0, 1) plus N(0, 10^2) on 0.1 % of the elements) for plain FP8 (per-tensor scales),
block quantisation (q per 64 rows, k per 128 keys, v per head), block + incoherent processing
(cuattn.fp8.quantize_qkv), and bf16 inputs through the bf16 kernel.
"""

import argparse
import itertools
import json
import statistics
import sys

import cupy
import numpy as np

import cuattn
import cuattn.fp8
from cuattn import _calls, reference
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS  # the forward benchmark's shapes

attention_module = sys.modules["cuattn.attention"]
MODES = {"plain": ("tensor", False), "block": ("block", False), "incoherent": ("block", True)}
OUTLIER_RATE, OUTLIER_STD = 0.001, 10.0
# the accuracy table's shape: small enough for the float64 reference on the CPU
ACCURACY_SHAPE = (1, 2048, 8)  # B, N, H


def outlier_inputs(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return x + (rng.random(shape) < OUTLIER_RATE) * rng.standard_normal(shape).astype(np.float32) * OUTLIER_STD


def speed(lengths, head_dims, rows, rounds):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    bf16 = cupy.dtype("bfloat16")
    for d in head_dims:
        for n in lengths:
            b, h = max(1, TOTAL_TOKENS // n), HIDDEN // d
            q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32) for _ in range(3))
            q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(q, k, v, granularity="head")
            qb, kb, vb = (x.astype(bf16) for x in (q, k, v))
            if torch is not None:
                tq, tk, tv = (torch.randn(b, h, n, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            for causal in (False, True):
                flops = timing.attention_flops(b, h, n, n, d, causal)
                calls = {"vt": lambda: attention_module._fp8_v_transposed_on_device(v8, None),
                         "fp8": lambda: cuattn.attention(q8, k8, v8, causal=causal, q_scale=qs, k_scale=ks, v_scale=vs),
                         "bf16": lambda: cuattn.attention(qb, kb, vb, causal=causal)}
                if torch is not None:
                    calls["sdpa"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                samples = timing.samples_in_turn(calls, rounds)
                vt = samples.pop("vt")
                # the call less its V^T pass, round by round
                samples = {"fp8": samples["fp8"], "fp8-kernel": [a - b for a, b in zip(samples["fp8"], vt)],
                           **{name: times for name, times in samples.items() if name != "fp8"}}
                vt_ms = statistics.median(vt)
                line = [f"D={d:3d} N={n:6d} {'causal' if causal else 'full  '} vt {vt_ms:6.3f} ms"]
                for name, times in samples.items():
                    ms = statistics.median(times)
                    rows.append(dict(kind="speed", head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, impl=name,
                                     ms=ms, tflops=flops / ms / 1e9, vt_ms=vt_ms))
                    line.append(f"{name} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
                print(" | ".join(line), flush=True)


def accuracy(head_dims, rows):
    bf16 = cupy.dtype("bfloat16")
    b, n, h = ACCURACY_SHAPE
    for d in head_dims:
        for causal in (False, True):
            rng = np.random.default_rng(0)
            q, k, v = (outlier_inputs(rng, (b, n, h, d)) for _ in range(3))
            ref = reference.attention(q, k, v, causal=causal)
            errors = {}
            for mode, (granularity, incoherent) in MODES.items():
                q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(*(cupy.asarray(x) for x in (q, k, v)),
                                                                 granularity=granularity, incoherent=incoherent)
                out = cuattn.attention(q8, k8, v8, causal=causal, q_scale=qs, k_scale=ks, v_scale=vs)
                errors[mode] = float(np.sqrt(np.mean((out.get().astype(np.float64) - ref) ** 2)))
            out = cuattn.attention(*(cupy.asarray(x).astype(bf16) for x in (q, k, v)), causal=causal)
            errors["bf16"] = float(np.sqrt(np.mean((out.get().astype(np.float64) - ref) ** 2)))
            rows.append(dict(kind="rmse", head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, **errors))
            print(f"RMSE D={d:3d} N={n} {'causal' if causal else 'full  '} "
                  + "  ".join(f"{mode} {err:.2e}" for mode, err in errors.items()), flush=True)


def tune(head_dims, lengths, rows):
    tile = attention_module.FwdSm90Tile
    candidates = {
        # three consumer warpgroups (192 query rows) spill with the overlap at 128 keys, not without
        128: [tile(128, 2, stages, True, pingpong) for stages in (2, 3, 4) for pingpong in (True, False)]
        + [tile(128, 3, stages, False, False) for stages in (2, 3, 4)],
        256: [tile(128, 2, 2, False, pingpong) for pingpong in (True, False)],
    }
    for d, n in itertools.product(head_dims, lengths):
        b, h = max(1, TOTAL_TOKENS // n), HIDDEN // d
        q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(
            *(cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32) for _ in range(3)), granularity="head")
        default = attention_module.FWD_SM90_FP8_TILES[d]
        for candidate in candidates.get(d, []):
            attention_module.FWD_SM90_FP8_TILES[d] = candidate
            _calls.clear()
            for causal in (False, True):
                ms = timing.time_cuda(lambda: cuattn.attention(q8, k8, v8, causal=causal, q_scale=qs, k_scale=ks,
                                                               v_scale=vs))
                tflops = timing.attention_flops(b, h, n, n, d, causal) / ms / 1e9
                rows.append(dict(kind="tune", head_dim=d, seqlen=n, causal=causal, tile=str(candidate), ms=ms,
                                 tflops=tflops))
                print(f"tune D={d:3d} N={n} {'causal' if causal else 'full  '} {candidate}: {ms:7.3f} ms {tflops:6.1f} TFLOP/s",
                      flush=True)
        attention_module.FWD_SM90_FP8_TILES[d] = default
        _calls.clear()


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--head-dims", default="128,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args(argv)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    rows = []
    if args.tune:
        tune(head_dims, [int(x) for x in args.lengths.split(",")], rows)
    accuracy(head_dims, rows)
    speed([int(x) for x in args.lengths.split(",")], head_dims, rows, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
