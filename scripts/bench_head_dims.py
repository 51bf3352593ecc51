"""Forward and backward TFLOP/s per head dim on the current GPU (issue #19's target: D = 80 and 160
at least 0.9x the TFLOP/s of the next tiled head dim).

python scripts/bench_head_dims.py [--head-dims 64,80,96,128,160,192,256,192:128] [--seqlen 4096] [--json PATH]
    per (head dim D, mask): milliseconds and TFLOP/s of cuattn.attention (forward) and
    cuattn.attention_backward (from the forward's out and lse), bf16, B * N = 32768 tokens of
    N = 4096, H = round(2048 / D) heads (H * D about 2048, the forward benchmark's hidden size).
    "D:Dv" gives v a head dim of its own. TFLOP/s counts the call's own D and Dv
    (2 * B * H * N^2 * (D + Dv), halved for causal; the backward 2.5x), so a head dim padded
    inside a larger tile shows the padding's cost as a lower rate. Each row names the kernels the
    dispatcher picked (the `cuattn` logger's debug records) and the tile head dim, and the
    summary prints each D's rate over the next tile head dim's.
"""

import argparse
import importlib
import json
import logging
import sys

import cupy

import cuattn
from cuattn import _jit
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS  # the forward benchmark's shapes

attention_module = importlib.import_module("cuattn.attention")  # the module, not the function


class _KernelNames(logging.Handler):
    """Collects the kernel names the forward dispatcher logs at debug level."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("attention forward:"):
            self.names.append(message.split(": ", 1)[1])


def measure(d: int, dv: int, n: int, causal: bool, log: _KernelNames) -> dict:
    bf16 = cupy.dtype("bfloat16")
    h = max(1, round(HIDDEN / d))
    b = max(1, TOTAL_TOKENS // n)
    q, k = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(2))
    v, dout = (cupy.random.standard_normal((b, n, h, dv), dtype=cupy.float32).astype(bf16) for _ in range(2))
    log.names.clear()
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
    forward_kernel = log.names[-1] if log.names else "?"
    fwd_ms = timing.time_cuda(lambda: cuattn.attention(q, k, v, causal=causal))
    bwd_ms = timing.time_cuda(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal))
    flops = timing.attention_flops(b, h, n, n, (d + dv) / 2, causal)
    hopper = attention_module.fwd_sm90_tile_dims(d, dv) if "flash_fwd_sm90_kernel" in forward_kernel else None
    return dict(head_dim=d, head_dim_v=dv, heads=h, batch=b, seqlen=n, causal=causal,
                fwd_tile_head_dim=hopper[0] if hopper else attention_module.fwd_tile_dim(max(d, dv)),
                bwd_tile_head_dim=attention_module.bwd_tile_dim(max(d, dv), _jit.target_arch()),
                forward_kernel=forward_kernel, fwd_ms=fwd_ms, fwd_tflops=flops / fwd_ms / 1e9,
                bwd_ms=bwd_ms, bwd_tflops=timing.BACKWARD_FLOP_RATIO * flops / bwd_ms / 1e9)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,80,96,128,160,192,256,192:128")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    log = _KernelNames()
    logger = logging.getLogger("cuattn")
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    rows = []
    for pair in args.head_dims.split(","):
        d, dv = (int(x) for x in (pair.split(":") if ":" in pair else (pair, pair)))
        for causal in (False, True):
            row = measure(d, dv, args.seqlen, causal, log)
            rows.append(row)
            print(f"D={d:3d} Dv={dv:3d} (fwd tile {row['fwd_tile_head_dim']:3d}, bwd tile {row['bwd_tile_head_dim']:3d}) "
                  f"H={row['heads']:2d} {'causal' if causal else 'full  '} fwd {row['fwd_tflops']:6.1f} TFLOP/s "
                  f"bwd {row['bwd_tflops']:6.1f} TFLOP/s  [{row['forward_kernel']}]", flush=True)
    # each head dim's rate over the next larger measured head dim that is a tile head dim of the forward
    by_key = {(r["head_dim"], r["causal"]): r for r in rows if r["head_dim_v"] == r["head_dim"]}
    tiles = sorted({d for d, dv in attention_module.FWD_SM90_TILES if d == dv} | set(attention_module.FWD_TILES))
    for r in rows:
        if r["head_dim_v"] != r["head_dim"]:
            continue
        larger = [t for t in tiles if t > r["head_dim"] and (t, r["causal"]) in by_key]
        if not larger:
            continue
        ref = by_key[(larger[0], r["causal"])]
        r["next_tile_head_dim"] = larger[0]
        r["fwd_ratio"] = r["fwd_tflops"] / ref["fwd_tflops"]
        r["bwd_ratio"] = r["bwd_tflops"] / ref["bwd_tflops"]
        print(f"D={r['head_dim']:3d} {'causal' if r['causal'] else 'full  '} over D={larger[0]:3d}: "
              f"fwd {r['fwd_ratio']:.3f}  bwd {r['bwd_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
