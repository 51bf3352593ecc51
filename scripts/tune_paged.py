"""Graph-timed paged decode TB/s (and us) over num_splits (GQA 32/8, D 128, bf16, block_size 16, shuffled blocks).

python scripts/tune_paged.py [--pages=ORDER] [--e4m3] [--paged-tile=W:S] [B:L ...]
    (default 1:32768 64:2048); each shape is drawn twice with fresh shuffles, to show how much the
    placement of the blocks moves the figure.
--pages=in-order | interleaved: each sequence's blocks one after another (a freshly filled pool),
or interleaved as sequences that grew in lock step get them (cuattn.bench.cases.block_table), to
tell the cost of scattered pages (TLB reach, DRAM locality) from the cost of the lookup itself.
--sequential is --pages=in-order.
--stages=N: override the D = 128 decode tile's cp.async ring depth for this run (fewer stages,
less shared memory, more CTAs per SM).
--e4m3: the cache in e4m3 with per-head scales (TB/s of its one-byte elements), the FP8 issue's
paged case; --paged-tile=WARPS:STAGES sets its long-stage tile as compare_fp8_decode.py does.
"""

import sys

import cupy
import numpy as np

import cuattn
from compare_fp8_decode import set_paged_tile  # a sibling script: scripts/ is sys.path[0]
from cuattn.bench import cases, timing

decode_module = sys.modules["cuattn.decode"]  # the module (cuattn.decode is the function)

HQ, HK, D, BLOCK = 32, 8, 128, 16
SPLITS = [None, 1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48, 64]


def main(argv):
    order = "in-order" if "--sequential" in argv else "shuffled"
    e4m3 = "--e4m3" in argv
    for arg in argv:
        if arg.startswith("--pages="):
            order = arg.split("=", 1)[1]
        if arg.startswith("--stages="):
            tile = decode_module.DECODE_TILES[D]
            decode_module.DECODE_TILES[D] = decode_module.DecodeTile(tile.max_mt, int(arg.split("=")[1]))
            decode_module.decode_spec.cache_clear()
            print(f"D = {D} decode tile: {decode_module.DECODE_TILES[D]}")
        if arg.startswith("--paged-tile="):
            set_paged_tile(arg.split("=", 1)[1])
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in argv if not arg.startswith("--")] or [(1, 32768), (64, 2048)]
    bf16 = cupy.dtype("bfloat16")
    for (batch, seqlen), draw in ((shape, draw) for shape in shapes for draw in range(2)):
        blocks = batch * seqlen // BLOCK
        pages = [cupy.random.standard_normal((blocks, BLOCK, HK, D), dtype=cupy.float32).astype(bf16) for _ in range(2)]
        scales = {}
        if e4m3:
            # per-kv-head scales, as a serving cache holds them: [Hk]
            scales = {"k_scale": cuattn.fp8_scales(pages[0], per_head=True),
                      "v_scale": cuattn.fp8_scales(pages[1], per_head=True)}
            pages = [cuattn.quantize_fp8(x, s) for x, s in zip(pages, scales.values())]
        table = cupy.asarray(cases.block_table(batch, blocks // batch, order))
        lens = cupy.full((batch,), seqlen, np.int32)
        q = cupy.random.standard_normal((batch, 1, HQ, D), dtype=cupy.float32).astype(bf16)
        nbytes = timing.kv_bytes(batch, seqlen, HK, D, pages[0].dtype.itemsize)
        line = []
        for splits in SPLITS:
            if splits is not None and splits > seqlen // 256:
                continue
            ms = timing.time_cupy_graph(lambda: cuattn.paged_attention(
                q, tuple(pages), table, lens, check=False, max_seq_len=seqlen, num_splits=splits, **scales))
            line.append(f"{'auto' if splits is None else splits}:{nbytes / ms / 1e9:.2f} ({ms * 1e3:.1f} us)")
        placement = f"{'e4m3 ' if e4m3 else ''}{order} draw {draw}"
        print(f"B={batch:3d} L={seqlen:7d} {placement}: " + " ".join(line), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
