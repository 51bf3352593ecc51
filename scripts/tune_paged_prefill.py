"""Candidate tiles of the Hopper forward's PAGED variant on paged prefill, against the dense
varlen call over the same tokens, on the current GPU (sm_90a).

python scripts/tune_paged_prefill.py [--block-sizes 16,64] [--tiles all|default]
    bf16, D = 128, GQA 32/8, 4 sequences x 4096 queries over 4096-8192 keys on shuffled pages
    (bench_paged_prefill.py's prefill case); one line per (block size, tile, page loads): ms,
    TFLOP/s and the ratio to the dense call. Page loads: "copy" (the producer warpgroup's row
    copies) and, where a TMA box takes the page, "tma" (boxes of a page), whatever
    FWD_SM90_COPY_MAX_BLOCK_SIZE would choose. Every candidate compiles without spills (`python -m
    cuattn build` checks the defaults; the others were checked with _jit.compile_kernel).
"""

import argparse
import importlib
import sys

import cupy
import numpy as np

import cuattn
from cuattn import _calls
from cuattn.bench import timing

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_paged_prefill import CASES, D, HQ, make_case, visible_pairs  # noqa: E402

attention_module = importlib.import_module("cuattn.attention")  # the module, not the function
TILE = attention_module.FwdSm90Tile
# (block_n, consumers, stages, overlap, pingpong): the default, more stages, no ping-pong, 64 keys
CANDIDATES = [TILE(128, 2, 2), TILE(128, 2, 3), TILE(128, 2, 3, True, False), TILE(128, 2, 2, True, False),
              TILE(64, 2, 4)]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", default="16,64")
    parser.add_argument("--tiles", choices=("all", "default"), default="all")
    args = parser.parse_args(argv)
    queries, keys = CASES["prefill"]
    work = 4.0 * HQ * D * visible_pairs(queries, keys)
    default = attention_module.FWD_SM90_PAGED_TILES.get((D, D))
    copy_max = attention_module.FWD_SM90_COPY_MAX_BLOCK_SIZE
    tiles = CANDIDATES if args.tiles == "all" else [attention_module.fwd_sm90_tile((D, D), paged=True)]
    try:
        for block in map(int, args.block_sizes.split(",")):
            q, k, v, cu_q, cu_k, pages, table, lens = make_case(np.random.default_rng(0), queries, keys, block)
            cuq_d, cuk_d = cupy.asarray(cu_q), cupy.asarray(cu_k)
            _calls.clear()
            dense = timing.time_cuda(lambda: cuattn.attention_varlen(q, k, v, cuq_d, cuk_d, max(queries), max(keys),
                                                                     causal=True))
            print(f"block {block:3d} dense attention_varlen           {dense:7.3f} ms {work / dense / 1e9:6.1f} TFLOP/s",
                  flush=True)
            for tile in tiles:
                attention_module.FWD_SM90_PAGED_TILES[(D, D)] = tile
                loads = {"copy": block}
                if attention_module.paged_box_rows(block, tile.block_n) is not None:
                    loads["tma"] = 0
                for load, rule in loads.items():
                    attention_module.FWD_SM90_COPY_MAX_BLOCK_SIZE = rule
                    _calls.clear()
                    ms = timing.time_cuda(lambda: cuattn.paged_attention_varlen(q, pages, table, cu_q, lens,
                                                                                max(queries), check=False))
                    print(f"block {block:3d} n{tile.block_n} {tile.consumers}wg {tile.stages}st ov={int(tile.overlap)} "
                          f"pp={int(tile.pingpong)} {load:4s} {ms:7.3f} ms {work / ms / 1e9:6.1f} TFLOP/s  "
                          f"{dense / ms:.3f}x dense", flush=True)
    finally:
        attention_module.FWD_SM90_COPY_MAX_BLOCK_SIZE = copy_max
        if default is None:
            attention_module.FWD_SM90_PAGED_TILES.pop((D, D), None)
        else:
            attention_module.FWD_SM90_PAGED_TILES[(D, D)] = default
        _calls.clear()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
