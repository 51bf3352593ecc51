"""The forward's kernels side by side, one checkout at a time (docs/bounded_softmax_h200.txt,
docs/overlap_bounded_h200.txt).

python scripts/ab_forward.py LABEL [--alibi] [--long-tiles-from-0] [--d80-tile BLOCK_N/STAGES]
        [--unbounded] [--tile D:BLOCK_N/CONSUMERS/STAGES/OVERLAP/PINGPONG/BOUNDED ...]
        [--schedule auto|static|dynamic] [--keys N[,N ...]] [--only RE]
    Times cuattn.attention (CUDA-event medians) on a fixed list of cases: e4m3 q, k, v with
    per-head scales (cuattn.fp8.quantize_qkv; the call, its V^T pass included, bf16 output) at
    D = 128 and 256, and bf16 at D = 64, 80, 96, 128, 160; B * N = 32k tokens, H * D = 2048,
    random normal inputs, full and causal. One line per case, TFLOP/s. --alibi adds ALiBi slopes
    2^(-8 h / H) (the cases from 4k keys); --long-tiles-from-0 runs the three-warpgroup tiles of
    FWD_SM90_LONG_TILES at every length; --d80-tile puts D = 80's long tile at that block and
    stage count; --unbounded runs every tile of FWD_SM90_TILES with the max-first softmax
    (FwdSm90Tile.bounded off); --tile (flags 0 or 1, repeatable) runs head dim D in that tile at
    every length; --schedule sets FWD_SM90_SCHEDULE; --keys runs the bf16 head dims at these key
    counts instead of the list's; --only RE keeps the cases whose line matches RE. Run it from
    two checkouts (PYTHONPATH, and a CUATTN_CACHE_DIR each) with two labels, interleaved, to
    compare kernels, or with two sets of options in one.
"""

import argparse
import dataclasses
import importlib
import re

import cupy
import ml_dtypes

import cuattn
import cuattn.fp8
from cuattn import _calls
from cuattn.bench import cases as bench_cases, timing

attention_module = importlib.import_module("cuattn.attention")

TOKENS = 32768
HEADS_X_DIM = 2048
# (kind, head dim, keys)
CASES = [("fp8", 128, 4096), ("fp8", 128, 8192), ("fp8", 128, 16384), ("fp8", 256, 8192), ("fp8", 256, 16384),
         ("bf16", 64, 4096), ("bf16", 64, 16384), ("bf16", 80, 16384), ("bf16", 96, 16384),
         ("bf16", 128, 4096), ("bf16", 64, 1024), ("bf16", 80, 1024), ("bf16", 80, 4096), ("bf16", 96, 1024),
         ("bf16", 96, 4096), ("bf16", 128, 1024), ("bf16", 128, 16384), ("bf16", 160, 4096)]
ALIBI_MIN_KEYS = 4096


def run(label: str, kind: str, d: int, n: int, alibi: bool, only: str | None) -> None:
    b, h = max(1, TOKENS // n), HEADS_X_DIM // d
    q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32) for _ in range(3))
    options = {"alibi_slopes": cupy.asarray(bench_cases.alibi_slopes(h))} if alibi else {}
    if kind == "fp8":
        q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(q, k, v, granularity="head")
        args = (q8, k8, v8)
        options.update(q_scale=qs, k_scale=ks, v_scale=vs)
    else:
        args = tuple(x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    for causal in (False, True):
        line = f"{label} {kind} D={d} N={n} {'alibi ' if alibi else ''}{'causal' if causal else 'full  '}"
        if only and not re.search(only, line):
            continue

        def call():
            return cuattn.attention(*args, causal=causal, **options)

        call()
        cupy.cuda.runtime.deviceSynchronize()
        ms = timing.time_cuda(call)
        tflops = timing.attention_flops(b, h, n, n, d, causal) / ms / 1e9
        print(f"{line} {ms:.3f} ms {tflops:.1f} TFLOP/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("label")
    parser.add_argument("--alibi", action="store_true")
    parser.add_argument("--long-tiles-from-0", action="store_true")
    parser.add_argument("--d80-tile", metavar="BLOCK_N/STAGES")
    parser.add_argument("--unbounded", action="store_true")
    parser.add_argument("--only", metavar="RE")
    parser.add_argument("--tile", action="append", default=[], metavar="D:N/C/S/OV/PP/BD")
    parser.add_argument("--schedule", choices=("auto", "static", "dynamic"))
    parser.add_argument("--keys", metavar="N[,N ...]")
    args = parser.parse_args()
    long_tiles = dict(attention_module.FWD_SM90_LONG_TILES)
    if args.long_tiles_from_0:
        long_tiles = {dims: attention_module.LongKeyTile(0, 0, long.tile) for dims, long in long_tiles.items()}
    if args.d80_tile:
        block_n, stages = (int(x) for x in args.d80_tile.split("/"))
        long_tiles[80, 80] = dataclasses.replace(long_tiles[80, 80], tile=attention_module.FwdSm90Tile(
            block_n, 3, stages, overlap=False, pingpong=False))
    attention_module.FWD_SM90_LONG_TILES = long_tiles
    if args.unbounded:
        attention_module.FWD_SM90_TILES = {
            dims: dataclasses.replace(tile, bounded=False) for dims, tile in attention_module.FWD_SM90_TILES.items()}
    for spec in args.tile:
        d, fields = spec.split(":")
        block_n, consumers, stages, overlap, pingpong, bounded = (int(x) for x in fields.split("/"))
        dims = (int(d), int(d))
        attention_module.FWD_SM90_TILES = {**attention_module.FWD_SM90_TILES, dims: attention_module.FwdSm90Tile(
            block_n, consumers, stages, overlap=bool(overlap), pingpong=bool(pingpong), bounded=bool(bounded))}
        attention_module.FWD_SM90_LONG_TILES = {
            pair: entry for pair, entry in attention_module.FWD_SM90_LONG_TILES.items() if pair != dims}
    if args.schedule:
        attention_module.FWD_SM90_SCHEDULE = args.schedule
    _calls.clear()
    cases = CASES
    if args.keys:
        bf16_dims = sorted({d for kind, d, _ in CASES if kind == "bf16"})
        cases = [("bf16", d, int(n)) for d in bf16_dims for n in args.keys.split(",")]
    for kind, d, n in cases:
        if not args.alibi or n >= ALIBI_MIN_KEYS:
            run(args.label, kind, d, n, args.alibi, args.only)


if __name__ == "__main__":
    main()
