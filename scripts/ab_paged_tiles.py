"""The paged e4m3 cache's long-stage tile candidates timed in turn in one process (#16).

python scripts/ab_paged_tiles.py [--tiles none,4:2,8:3] [--rounds 3] [B:L[:HQ:HK[:ALIBI]] ...]
    Each shape (default SHAPES; HQ/HK default 32/8, ALIBI 1 adds slopes 2^(-8 h / HQ)) gets a
    bf16 and an e4m3 cache (per-head scales) in shuffled 16-token pages, D = 128, one bf16 token.
    Every round times the bf16 paged step, then the e4m3 paged step under each tile in turn (the
    order reversed on odd rounds): E4M3_PAGED_LONG_TILES[128] set to WARPS x STAGES 128-key
    stages, or removed ("none": the default 64-key stage), the remembered plans cleared. CUDA-graph
    step times (timing.time_cupy_graph); each line gives the min over rounds, every round, and the
    bf16 step over the e4m3 one. Each tile's output must match the first tile's within 0.02 and the
    bf16 cache's within 0.3 (e4m3 rounding; steep ALiBi heads average few values).
"""

import argparse
import sys

import cupy
import numpy as np

import cuattn
# a sibling script (scripts/ is sys.path[0]): the caches and the paged tile's parser and setter
from compare_fp8_decode import make_caches, parse_paged_tile, use_paged_tile
from cuattn.bench import cases as bench_cases, timing

BLOCK = 16
SHAPES = [(8, 8192, 32, 8, 0), (16, 8192, 32, 8, 0), (1, 32768, 32, 8, 0), (8, 8192, 32, 2, 0),
          (4, 8192, 32, 32, 1)]
SAME_KERNEL_TOL, BF16_TOL = 0.02, 0.3


def compare(shape, tiles: dict, rounds: int, rng) -> None:
    batch, seqlen, hq, hk, alibi = shape
    c = make_caches(batch, seqlen, hq, hk, "shuffled", BLOCK, rng)
    q, lens, table, kp, vp, kp8, vp8 = c.q, c.lens, c.table, c.kp, c.vp, c.kp8, c.vp8
    k_scale, v_scale = c.k_scale, c.v_scale
    options = {}
    if alibi:
        options["alibi_slopes"] = cupy.asarray(bench_cases.alibi_slopes(hq))

    def bf16_step():
        return cuattn.paged_attention(q, (kp, vp), table, lens, check=False, **options)

    def e4m3_step():
        return cuattn.paged_attention(q, (kp8, vp8), table, lens, k_scale=k_scale, v_scale=v_scale, check=False,
                                      **options)

    reference = bf16_step().astype(cupy.float32)
    first = None
    bf16_times, times = [], {name: [] for name in tiles}
    for r in range(rounds):
        bf16_times.append(timing.time_cupy_graph(bf16_step))
        for name in (list(tiles) if r % 2 == 0 else list(reversed(list(tiles)))):
            use_paged_tile(tiles[name])
            got = e4m3_step().astype(cupy.float32)
            first = got if first is None else first
            same, near = float(cupy.abs(got - first).max()), float(cupy.abs(got - reference).max())
            if same > SAME_KERNEL_TOL or near > BF16_TOL:
                raise SystemExit(f"{shape} tile {name}: max difference {same} from the first tile, {near} from bf16")
            times[name].append(timing.time_cupy_graph(e4m3_step))
    base = min(bf16_times) * 1e3
    line = f"B={batch:3d} L={seqlen:6d} H={hq}/{hk} alibi={alibi} bf16-paged {base:7.1f}"
    for name, ts in times.items():
        best = min(ts) * 1e3
        line += f" | {name} {best:6.1f} ({', '.join(f'{t * 1e3:.1f}' for t in ts)}) {base / best:.3f}x"
    print(line, flush=True)


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", default="none,4:2,8:3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("shapes", nargs="*")
    args = parser.parse_args(argv)
    tiles = {name: parse_paged_tile(name, "--tiles") for name in args.tiles.split(",")}
    shapes = []
    for text in args.shapes:
        fields = [int(x) for x in text.split(":")]
        if len(fields) not in (2, 4, 5) or fields[1] % BLOCK:
            raise SystemExit(f"shapes are B:L[:HQ:HK[:ALIBI]] with L a multiple of {BLOCK}, got {text!r}")
        shapes.append(tuple(fields + [32, 8, 0][len(fields) - 2:]))
    rng = np.random.default_rng(1)
    for shape in shapes or SHAPES:
        compare(shape, tiles, args.rounds, rng)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:])
