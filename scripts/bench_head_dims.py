"""Forward and backward TFLOP/s per head dim on the current GPU (issue #19's target: D = 80 and 160
at least 0.9x the TFLOP/s of the next tiled head dim).

python scripts/bench_head_dims.py [--head-dims 64,80,96,128,160,192,256,192:128] [--seqlen 4096]
                                  [--tokens 32768] [--rounds 3] [--forward-only] [--json PATH]
    per (head dim D, mask): milliseconds and TFLOP/s of cuattn.attention (forward) and
    cuattn.attention_backward (from the forward's out and lse), bf16, B * N = --tokens tokens of
    N = --seqlen, H = round(2048 / D) heads (H * D about 2048, the forward benchmark's hidden size;
    rounded, not floored as cases.attention_shape does: D = 160 and 192 then fill the same share
    of their last round of tiles at the defaults, 0.96-0.97, where 2048 // D gives 160 whole
    rounds and 192 a last one 0.97 full).
    "D:Dv" gives v a head dim of its own. TFLOP/s counts the call's own D and Dv
    (2 * B * H * N^2 * (D + Dv), halved for causal; the backward 2.5x), so a head dim padded
    inside a larger tile shows the padding's cost as a lower rate. Every case's forward (then
    backward) is timed in turn, --rounds times over; each row gives the median and names the
    kernels the dispatcher picked (the `cuattn` logger's debug records), the tile head dim and,
    for the Hopper forward, its tiles and the share of the persistent CTAs' last round they fill
    (one CTA an SM: a last round of few tiles lowers a rate whatever the head dim, more so at
    fewer --tokens). The summary prints each D's rate over the next tile head dim's, the median
    of the rounds' ratios and their range.
"""

import argparse
import importlib
import json
import logging
import statistics
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


def make_case(d: int, dv: int, n: int, tokens: int, causal: bool, log: _KernelNames) -> dict:
    """One (D, Dv, mask) case: its arrays, its forward and backward calls, and what it runs."""
    bf16 = cupy.dtype("bfloat16")
    h = max(1, round(HIDDEN / d))
    b = max(1, tokens // n)
    q, k = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(2))
    v, dout = (cupy.random.standard_normal((b, n, h, dv), dtype=cupy.float32).astype(bf16) for _ in range(2))
    log.names.clear()
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
    forward_kernel = log.names[-1] if log.names else "?"
    hopper = attention_module.fwd_sm90_tile_dims(d, dv) if "flash_fwd_sm90_kernel" in forward_kernel else None
    row = dict(head_dim=d, head_dim_v=dv, heads=h, batch=b, seqlen=n, causal=causal,
               fwd_tile_head_dim=hopper[0] if hopper else attention_module.fwd_tile_dim(max(d, dv)),
               bwd_tile_head_dim=attention_module.bwd_tile_dim(max(d, dv), _jit.target_arch()),
               forward_kernel=forward_kernel,
               flops=timing.attention_flops(b, h, n, n, (d + dv) / 2, causal))
    if hopper:
        tile = attention_module.fwd_sm90_tile(hopper, seqlen_k=n, banded=causal)
        tiles = b * h * -(-n // tile.block_m)
        sms = _jit.multiprocessor_count()
        row.update(fwd_tiles=tiles, fwd_last_round_fill=tiles / (-(-tiles // sms) * sms))
    return dict(row=row, fwd=lambda: cuattn.attention(q, k, v, causal=causal),
                bwd=lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,80,96,128,160,192,256,192:128")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=TOTAL_TOKENS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    log = _KernelNames()
    logger = logging.getLogger("cuattn")
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    cases = {}
    for pair in args.head_dims.split(","):
        d, dv = (int(x) for x in (pair.split(":") if ":" in pair else (pair, pair)))
        for causal in (False, True):
            cases[(d, dv, causal)] = make_case(d, dv, args.seqlen, args.tokens, causal, log)
    fwd = timing.samples_in_turn({key: c["fwd"] for key, c in cases.items()}, args.rounds)
    bwd = None if args.forward_only else timing.samples_in_turn({key: c["bwd"] for key, c in cases.items()},
                                                                args.rounds)
    rows = []
    for key, case in cases.items():
        row = case["row"]
        row["fwd_ms"] = statistics.median(fwd[key])
        row["fwd_tflops"] = row["flops"] / row["fwd_ms"] / 1e9
        if bwd is not None:
            row["bwd_ms"] = statistics.median(bwd[key])
            row["bwd_tflops"] = timing.BACKWARD_FLOP_RATIO * row["flops"] / row["bwd_ms"] / 1e9
        rows.append(row)
        tiles = (f" {row['fwd_tiles']} tiles, last round {row['fwd_last_round_fill']:.2f} full"
                 if "fwd_tiles" in row else "")
        backward = f" bwd {row['bwd_tflops']:6.1f} TFLOP/s" if bwd is not None else ""
        print(f"D={row['head_dim']:3d} Dv={row['head_dim_v']:3d} (fwd tile {row['fwd_tile_head_dim']:3d}, bwd tile "
              f"{row['bwd_tile_head_dim']:3d}) H={row['heads']:2d} {'causal' if row['causal'] else 'full  '} fwd "
              f"{row['fwd_tflops']:6.1f} TFLOP/s{backward}  [{row['forward_kernel']}]{tiles}", flush=True)
    # each head dim's rate over the next larger measured head dim that is a tile head dim of the
    # forward: rate ratio = (flops_a / t_a) / (flops_b / t_b), round by round
    tiles = sorted({d for d, dv in attention_module.FWD_SM90_TILES if d == dv} | set(attention_module.FWD_TILES))
    for (d, dv, causal), case in cases.items():
        row = case["row"]
        larger = [t for t in tiles if t > d and (t, t, causal) in cases]
        if dv != d or not larger:
            continue
        ref_key = (larger[0], larger[0], causal)
        flop_ratio = row["flops"] / cases[ref_key]["row"]["flops"]
        row["next_tile_head_dim"] = larger[0]
        summary = []
        for name, samples in (("fwd", fwd), ("bwd", bwd)):
            if samples is None:
                continue
            median, low, high = timing.ratio_in_turn(samples[ref_key], samples[(d, dv, causal)])
            row[f"{name}_ratio"] = median * flop_ratio
            summary.append(f"{name} {median * flop_ratio:.3f} ({low * flop_ratio:.3f}-{high * flop_ratio:.3f})")
        print(f"D={d:3d} {'causal' if causal else 'full  '} over D={larger[0]:3d}: " + "  ".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
