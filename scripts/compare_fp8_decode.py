"""Decode step times over an e4m3 cache beside the same cache in bf16, contiguous and paged.

python scripts/compare_fp8_decode.py [--pages=ORDER] [--layout=LAYOUT] [--block-size=N] [--rounds=N] [--paged-tile=WARPS:STAGES] [B:L ...]
    GQA 32/8, D = 128, one new bf16 token; per-head e4m3 scales from cuattn.fp8_scales; paged:
    block size 16 (or --block-size, which must divide each L), check=False, blocks shuffled across
    the pool, or with --pages=in-order or interleaved laid out as cuattn.bench.cases.block_table
    says; the pools' page layout (cuattn.paged.PAGE_LAYOUTS) each dtype's PagedKVCache default
    (--layout=default: e4m3 head-major, bf16 token-major) or one for both (--layout=NHD or HND).
    CUDA-graph step times (20 calls a graph; no L2 flush between replays: the default shapes'
    caches are larger than the L2), the four steps timed in turn --rounds times over (default 3;
    each speedup is the median of the rounds' ratios, with their range), and the largest
    difference of each output from the bf16 contiguous decode. Shapes default to SHAPES. Each
    cache takes its own default dispatch (the e4m3 cache has tiles and split rules of its own), so
    a speedup compares what a call gets, not the element type alone.
    --paged-tile=WARPS:STAGES: the paged e4m3 cache's long-stage tile (E4M3_PAGED_LONG_TILES at
    D = 128) with this many warps a CTA and ring stages, for this run (compiled on first use), or
    none: no long stage. scripts/ab_paged_tiles.py times several in turn.
"""

import dataclasses
import statistics
import sys

import cupy
import numpy as np

import cuattn
from cuattn import _calls
from cuattn.bench import cases as bench_cases, timing
from cuattn.paged import DEFAULT_PAGE_LAYOUT, E4M3_PAGE_LAYOUT, PAGE_LAYOUTS, zero_pages

decode_module = sys.modules["cuattn.decode"]  # the module (cuattn.decode is the function)

HQ, HK, D = 32, 8, 128
DEFAULT_BLOCK = 16
DEFAULT_ROUNDS = 3
LAYOUT_CHOICES = ("default", *PAGE_LAYOUTS)
SHAPES = [(1, 32768), (8, 8192), (32, 4096), (64, 2048), (8, 131072)]


@dataclasses.dataclass
class DecodeCaches:
    """One decode step's inputs: q [B, 1, Hq, D] bf16, lens, the bf16 cache k, v [B, L, Hk, D], its
    e4m3 copy k8, v8 with per-head scales, and both as pages of ``block`` tokens (kp, vp, kp8, vp8
    [num_blocks, block, Hk, D]) through ``table`` [B, blocks a sequence]."""

    q: object
    lens: object
    k: object
    v: object
    k8: object
    v8: object
    k_scale: object
    v_scale: object
    table: object
    kp: object
    vp: object
    kp8: object
    vp8: object


def page_layouts(choice: str) -> tuple[str, str]:
    """The (bf16, e4m3) pools' page layouts for --layout ``choice``."""
    return (DEFAULT_PAGE_LAYOUT, E4M3_PAGE_LAYOUT) if choice == "default" else (choice, choice)


def make_caches(batch: int, seqlen: int, hq: int, hk: int, order: str, block: int, rng,
                layouts: tuple[str, str] = ("NHD", "NHD")) -> DecodeCaches:
    """Random caches of one (B, L), the pages placed in the pool as ``order`` says, the bf16 and
    e4m3 pools' bytes laid out as ``layouts`` says (cuattn.paged.PAGE_LAYOUTS)."""
    bf16 = cupy.dtype("bfloat16")
    q = cupy.random.standard_normal((batch, 1, hq, D), dtype=cupy.float32).astype(bf16)
    k, v = (cupy.random.standard_normal((batch, seqlen, hk, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
    lens = cupy.full((batch,), seqlen, np.int32)
    k_scale, v_scale = cuattn.fp8_scales(k, per_head=True), cuattn.fp8_scales(v, per_head=True)
    k8, v8 = cuattn.quantize_fp8(k, k_scale), cuattn.quantize_fp8(v, v_scale)
    num_blocks = batch * seqlen // block
    table = cupy.asarray(bench_cases.block_table(batch, num_blocks // batch, order, rng))  # [B, blocks a sequence]

    def pages(x, layout):
        # [num_blocks, block, Hk, D] stored as PagedKVCache stores a cache of that layout
        out = zero_pages(cupy, num_blocks, block, hk, D, x.dtype, layout)
        out[table.reshape(-1)] = x.reshape(num_blocks, block, hk, D)
        return out

    paged = (pages(x, layouts[0]) for x in (k, v)), (pages(x, layouts[1]) for x in (k8, v8))
    return DecodeCaches(q, lens, k, v, k8, v8, k_scale, v_scale, table, *paged[0], *paged[1])


def compare(batch: int, seqlen: int, order: str, block: int, rng, rounds: int = DEFAULT_ROUNDS,
            layout: str = "default") -> None:
    """Time the four decode steps of one (B, L) in turn, ``rounds`` times over, and print their
    medians with the e4m3 speedups (pools laid out as --layout ``layout`` says)."""
    c = make_caches(batch, seqlen, HQ, HK, order, block, rng, page_layouts(layout))
    q, lens, k, v, k8, v8, k_scale, v_scale = c.q, c.lens, c.k, c.v, c.k8, c.v8, c.k_scale, c.v_scale
    table, kp, vp, kp8, vp8 = c.table, c.kp, c.vp, c.kp8, c.vp8
    steps = {
        "bf16": lambda: cuattn.decode(q, k, v, lens),
        "bf16-paged": lambda: cuattn.paged_attention(q, (kp, vp), table, lens, check=False),
        "e4m3": lambda: cuattn.decode(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale),
        "e4m3-paged": lambda: cuattn.paged_attention(q, (kp8, vp8), table, lens, k_scale=k_scale, v_scale=v_scale,
                                                     check=False),
    }
    reference = steps["bf16"]().astype(cupy.float32)
    diffs = {name: float(cupy.abs(fn().astype(cupy.float32) - reference).max()) for name, fn in steps.items()}
    samples = timing.samples_in_turn(steps, rounds, timer=timing.time_cupy_graph)
    for name, times in samples.items():
        us = [t * 1e3 for t in times]
        print(f"B={batch:3d} L={seqlen:7d} {name:11s} {statistics.median(us):8.1f} us ({min(us):.1f}-{max(us):.1f} over "
              f"{rounds} rounds)  max diff from bf16 {diffs[name]:.3f}", flush=True)
    speedups = []
    for layout, bf16, e4m3 in (("contiguous", "bf16", "e4m3"), ("paged", "bf16-paged", "e4m3-paged")):
        median, low, high = timing.ratio_in_turn(samples[bf16], samples[e4m3])
        speedups.append(f"{median:.2f}x {layout} ({low:.2f}-{high:.2f})")
    print(f"B={batch:3d} L={seqlen:7d} e4m3 speedup (bf16 step over e4m3 step, median of the rounds' ratios): "
          + ", ".join(speedups), flush=True)


def parse_paged_tile(text: str, option: str = "--paged-tile"):
    """'WARPS:STAGES' -> the DecodeTile of that many warps a CTA and 128-key ring stages, or None
    for 'none' (the default 64-key stage)."""
    if text == "none":
        return None
    try:
        warps, stages = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"{option} takes none or WARPS:STAGES (e.g. 8:3), got {text!r}") from None
    return decode_module.DecodeTile(max_mt=1, stages=stages, long_stage=True, warps=warps)


def use_paged_tile(tile) -> None:
    """The paged e4m3 long-stage tile at D = 128 for this process (None: no long stage), the
    remembered specs and plans cleared so that the next call launches it."""
    if tile is None:
        decode_module.E4M3_PAGED_LONG_TILES.pop(D, None)
    else:
        decode_module.E4M3_PAGED_LONG_TILES[D] = tile
    decode_module.decode_spec.cache_clear()
    _calls.clear()


def main(argv):
    order = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--pages=")), "shuffled")
    if order not in bench_cases.PAGE_ORDERS:
        raise SystemExit(f"--pages must be one of {', '.join(bench_cases.PAGE_ORDERS)}, got {order!r}")
    tile = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--paged-tile=")), None)
    if tile is not None:
        paged_tile = parse_paged_tile(tile)
        use_paged_tile(paged_tile)
        print("paged e4m3 long tile: " + (f"{paged_tile.warps} warps, {paged_tile.stages} stages" if paged_tile
                                          else "none (the default stage)"), flush=True)
    layout = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--layout=")), "default")
    if layout not in LAYOUT_CHOICES:
        raise SystemExit(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, got {layout!r}")
    block_arg = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--block-size=")), str(DEFAULT_BLOCK))
    if not block_arg.isdigit():
        raise SystemExit(f"--block-size takes a positive int, got {block_arg!r}")
    block = int(block_arg)
    rounds_arg = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--rounds=")), str(DEFAULT_ROUNDS))
    if not rounds_arg.isdigit() or int(rounds_arg) < 1:
        raise SystemExit(f"--rounds takes a positive int, got {rounds_arg!r}")
    rounds = int(rounds_arg)
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in argv if not arg.startswith("--")] or SHAPES
    for batch, seqlen in shapes:
        if block < 1 or seqlen % block:
            raise SystemExit(f"--block-size must divide each L, got {block} for L = {seqlen}")
    rng = np.random.default_rng(0)
    bf16_layout, e4m3_layout = page_layouts(layout)
    print(f"paged caches: {block}-token blocks {order}, pages {bf16_layout} (bf16) and {e4m3_layout} (e4m3)",
          flush=True)
    for batch, seqlen in shapes:
        compare(batch, seqlen, order, block, rng, rounds, layout)
        # the shape's caches are gone with compare's frame: give their memory back before the next
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:])
