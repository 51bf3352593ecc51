"""Where a paged cache's placement costs decode time (#16): the same pages laid out in the pool in
several orders, bf16 and e4m3 caches, timed in one process.

python scripts/ab_page_orders.py [--rounds R] [--orders BLOCK:ORDER,...] [B:L ...]
    GQA 32/8, D = 128, one new bf16 token, per-head e4m3 scales (cuattn.fp8_scales). Each shape
    (default SHAPES) is paged in pages of BLOCK tokens placed as ORDER says, for each BLOCK:ORDER of
    --orders (default ORDERS):
      in-order      the pool holds each sequence's pages one after another
      shuffled      a random permutation of the whole pool (compare_fp8_decode.py's default)
      interleaved   the sequences' pages taking turns (bench_cases.block_table)
      windowN       the in-order pool permuted only within windows of N consecutive pages: with
                    N = 8 and 16-token pages a 128-key stage of the long-stage kernel still reads
                    the same eight pages as in order, with N = 64 its eight pages lie anywhere in
                    a megabyte (e4m3) of the pool
    and timed as CUDA-graph steps (timing.time_cupy_graph) beside the contiguous cache: every step
    of a shape in turn, R rounds over (timing.samples_in_turn), printed as the median of the rounds
    and each e4m3 speedup as the median of the rounds' ratios (each round's pair timed back to
    back), with its range. Every e4m3 output must match the bf16 contiguous decode within
    E4M3_TOL.
"""

import argparse
import statistics

import cupy
import numpy as np

import cuattn
# a sibling script (scripts/ is sys.path[0]): the random caches and their e4m3 copies
from compare_fp8_decode import HK, HQ, D, make_caches
from cuattn.bench import cases as bench_cases, timing

SHAPES = [(8, 8192), (16, 8192), (8, 16384)]
ORDERS = [(16, "in-order"), (16, "shuffled"), (16, "window64"), (16, "window8"), (256, "in-order"), (256, "shuffled")]
E4M3_TOL = 0.05  # e4m3 rounding of K and V, against the bf16 cache's output (compare_fp8_decode sees 0.003)


def block_table(order: str, batch: int, blocks_per_seq: int, rng, to_device: bool = True):
    """int32 (batch, blocks_per_seq): every block of a pool of batch * blocks_per_seq once, placed as
    ``order`` says (the module's docstring; bench_cases.block_table's PAGE_ORDERS, or windowN); a
    CuPy array, or NumPy without ``to_device``."""
    width = order[len("window"):]
    if order.startswith("window") and width.isdigit() and int(width) > 0:
        pool, width = batch * blocks_per_seq, int(width)
        blocks = np.concatenate([start + rng.permutation(min(width, pool - start)) for start in range(0, pool, width)])
        table = blocks.reshape(batch, blocks_per_seq).astype(np.int32)
    elif order in bench_cases.PAGE_ORDERS:
        table = bench_cases.block_table(batch, blocks_per_seq, order, rng)
    else:
        raise ValueError(f"order must be one of {', '.join(bench_cases.PAGE_ORDERS)} or windowN (N > 0), got {order!r}")
    return cupy.asarray(table) if to_device else table


def parse_orders(text: str) -> list[tuple[int, str]]:
    """'16:in-order,16:window8' -> [(16, 'in-order'), (16, 'window8')], each order checked."""
    orders = []
    for item in text.split(","):
        block, _, order = item.partition(":")
        if not block.isdigit() or int(block) < 1:
            raise SystemExit(f"--orders takes BLOCK:ORDER items with a positive BLOCK, got {item!r}")
        try:
            block_table(order, 1, 1, np.random.default_rng(0), to_device=False)
        except ValueError as exc:
            raise SystemExit(f"--orders: {exc}") from None
        orders.append((int(block), order))
    return orders


def compare(batch: int, seqlen: int, orders: list, rounds: int, rng) -> None:
    """Time one shape's caches in every (block, order) of ``orders`` and the contiguous cache, all
    in turn, and print one line for it."""
    # compare_fp8_decode's caches (its own pages are not used: each order below pages them anew)
    c = make_caches(batch, seqlen, HQ, HK, "in-order", orders[0][0], rng)
    q, lens, k, v, k8, v8, k_scale, v_scale = c.q, c.lens, c.k, c.v, c.k8, c.v8, c.k_scale, c.v_scale
    reference = cuattn.decode(q, k, v, lens).astype(cupy.float32)

    # (label, bf16 step, e4m3 step) of each placement, then of the contiguous cache
    placements = []
    for block, order in orders:
        blocks = batch * seqlen // block
        table = block_table(order, batch, seqlen // block, rng)

        def pages(x):
            out = cupy.empty((blocks, block, HK, D), x.dtype)  # [num_blocks, block, Hk, D]
            out[table.reshape(-1)] = x.reshape(blocks, block, HK, D)
            return out

        kp, vp, kp8, vp8 = (pages(x) for x in (k, v, k8, v8))

        def bf16_step(kp=kp, vp=vp, table=table):
            return cuattn.paged_attention(q, (kp, vp), table, lens, check=False)

        def e4m3_step(kp8=kp8, vp8=vp8, table=table):
            return cuattn.paged_attention(q, (kp8, vp8), table, lens, k_scale=k_scale, v_scale=v_scale, check=False)

        diff = float(cupy.abs(e4m3_step().astype(cupy.float32) - reference).max())
        if diff > E4M3_TOL:
            raise SystemExit(f"B={batch} L={seqlen} {block}/{order}: e4m3 output {diff} from the bf16 decode")
        placements.append((f"{block}/{order}", bf16_step, e4m3_step))
    placements.append(("contiguous", lambda: cuattn.decode(q, k, v, lens),
                       lambda: cuattn.decode(q, k8, v8, lens, k_scale=k_scale, v_scale=v_scale)))

    calls = {(label, kind): step for label, bf16, e4m3 in placements for kind, step in (("bf16", bf16), ("e4m3", e4m3))}
    samples = timing.samples_in_turn(calls, rounds, timer=timing.time_cupy_graph)
    line = f"B={batch:3d} L={seqlen:6d}"
    for label, _, _ in placements:
        t16, t8 = (samples[label, kind] for kind in ("bf16", "e4m3"))
        speedup, low, high = timing.ratio_in_turn(t16, t8)
        line += (f" | {label} bf16 {statistics.median(t16) * 1e3:.1f} e4m3 {statistics.median(t8) * 1e3:.1f} "
                 f"{speedup:.3f}x ({low:.3f}-{high:.3f})")
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every step in turn; medians are printed (default 3)")
    parser.add_argument("--orders", type=parse_orders, default=ORDERS,
                        help="comma-separated BLOCK:ORDER (default: " + ",".join(f"{b}:{o}" for b, o in ORDERS) + ")")
    parser.add_argument("shapes", nargs="*", help="B:L (default: SHAPES)")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes] or SHAPES
    largest_page = max(block for block, _ in args.orders)
    for _, seqlen in shapes:
        if seqlen % largest_page:
            raise SystemExit(f"each L must be a multiple of the {largest_page}-token pages, got {seqlen}")
    rng = np.random.default_rng(0)
    for batch, seqlen in shapes:
        compare(batch, seqlen, args.orders, args.rounds, rng)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
