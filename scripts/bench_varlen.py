"""attention_varlen at ragged lengths against the dense forward at the same total tokens, on the
current GPU (the Hopper forward issue's target: varlen at least 0.9x the dense rate).

python scripts/bench_varlen.py [--lengths 1024,4096,16384] [--head-dims 64,128] [--schedules dynamic,static]
                               [--section-mib 0,8,32] [--tile-order on,off] [--rounds 3] [--draws 1]
                               [--seed S] [--json PATH]
    per (head dim, mean length N, mask): TFLOP/s of
      dense          cuattn.attention, B = 32768 / N sequences of N tokens
      varlen-equal   cuattn.attention_varlen over the same B x N tokens packed
      varlen-ragged  cuattn.attention_varlen over B sequences of lengths drawn uniformly from
                     [N / 4, 7 N / 4] (the last one takes what is left of 32768 tokens)
    TFLOP/s counts each sequence's own work (sum over sequences of its attention FLOPs), so
    ragged lengths, which hold more work than equal ones, are compared by rate, not time.
    "tile share" is the ragged lengths' own work over the work of the whole tiles the Hopper
    forward computes for them (query rows padded to its block_m, keys to its block_n), over the
    same share of the dense layout: the ragged/dense ratio a kernel that runs every tile at the
    dense rate reaches.
    --draws: ragged layouts to draw (each timed and printed apart), for the spread over draws;
    --seed: the draws' seed (default: fresh ones each run), to time two checkouts on the same.
    bf16, H * D = 2048, CUDA events, the forward benchmark's timing. The layouts and schedules of
    a case are timed in turn, --rounds times over, and each reports the median of its rounds
    (cuattn.bench.timing.time_in_turn; before, once each in a fixed order, ragged last).
    --schedules: flash_fwd_sm90_kernel's tile schedules to time each case on (an A/B of
    cuattn.attention.FWD_SM90_SCHEDULE; default: the dispatcher's own), one line and one JSON row
    per schedule.
    --tile-order: on, off or both (on,off): varlen launches with and without their tile order
    (cuattn.attention.FWD_SM90_TILE_ORDER; default: the module's own); with both, each line's
    schedule label names it, as auto/order or auto/no-order.
    --section-mib: L2 section sizes of the dynamic schedule to time it at (an A/B of
    cuattn.attention.FWD_SM90_L2_SECTION_BYTES, in MiB; 0: one (batch, head) pair a section, the
    static schedule's pair-major order); "dynamic" lines then name the size, as dynamic@8.
    Causal cases only: calls without a mask take one pair a section whatever the size
    (attention.l2_section_heads).
"""

import argparse
import importlib
import json
import sys

import cupy
import numpy as np

import cuattn
from cuattn import _calls
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS  # the forward benchmark's shapes

attention_module = importlib.import_module("cuattn.attention")  # the module, not cuattn.attention the function


def ragged_lengths(rng, count: int, mean: int) -> list[int]:
    """``count`` lengths drawn from [mean / 4, 7 mean / 4] summing to count * mean (at least 1 each)."""
    lengths = rng.integers(mean // 4, 7 * mean // 4 + 1, size=count)
    lengths[-1] = 0
    lengths[-1] = max(1, count * mean - int(lengths[:-1].sum()))
    while lengths.sum() > count * mean:  # the draws overshot: trim the longest
        i = int(np.argmax(lengths[:-1]))
        lengths[i] -= min(int(lengths.sum()) - count * mean, int(lengths[i]) - 1)
    return [int(n) for n in lengths]


def tile_share(lengths, block_m: int, block_n: int, causal: bool) -> float:
    """The sequences' own score entries over those of the whole tiles computed for them: query
    blocks of block_m rows, each over its key blocks of block_n (under the bottom-right causal
    mask, the blocks up to its last row's diagonal)."""
    own = computed = 0
    for n in lengths:
        own += n * (n + 1) // 2 if causal else n * n
        for m0 in range(0, n, block_m):
            keys = min(m0 + block_m, n) if causal else n
            computed += block_m * -(-keys // block_n) * block_n
    return own / computed


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--schedules", default=attention_module.FWD_SM90_SCHEDULE,
                        help=f"comma-separated, of {', '.join(attention_module.FWD_SM90_SCHEDULES)}")
    parser.add_argument("--section-mib", help="comma-separated (default: the module's own size)")
    parser.add_argument("--tile-order", help="on, off or on,off (default: the module's own)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draws", type=int, default=1, help="ragged layouts drawn per case")
    parser.add_argument("--seed", type=int, help="the ragged lengths' seed (default: fresh)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    default_bytes = attention_module.FWD_SM90_L2_SECTION_BYTES
    section_bytes = ([int(float(x) * (1 << 20)) for x in args.section_mib.split(",")] if args.section_mib
                     else [default_bytes])
    # (label, schedule, L2 section bytes): the dynamic schedule once per section size, the others
    # (which read no sections) once at the module's own
    schedules = []
    for schedule in args.schedules.split(","):
        if schedule not in attention_module.FWD_SM90_SCHEDULES:
            parser.error(f"--schedules: {schedule!r} is not one of {attention_module.FWD_SM90_SCHEDULES}")
        if schedule == "dynamic" and args.section_mib:
            schedules += [(f"dynamic@{size / (1 << 20):g}", schedule, size) for size in section_bytes]
        else:
            schedules.append((schedule, schedule, section_bytes[0] if schedule == "dynamic" else default_bytes))
    switches = {"on": True, "off": False}
    orders = [attention_module.FWD_SM90_TILE_ORDER]
    if args.tile_order:
        if any(x not in switches for x in args.tile_order.split(",")):
            parser.error(f"--tile-order: {args.tile_order!r} is not on, off or on,off")
        orders = [switches[x] for x in args.tile_order.split(",")]
    if len(orders) > 1:
        schedules = [(f"{label}/{'order' if order else 'no-order'}", schedule, size, order)
                     for label, schedule, size in schedules for order in orders]
    else:
        schedules = [(*entry, orders[0]) for entry in schedules]

    def select(case):
        """Before timing (layout, (label, schedule, section bytes, tile order)): that schedule,
        section size and tile order."""
        _, (_, schedule, size, order) = case
        attention_module.FWD_SM90_SCHEDULE = schedule
        attention_module.FWD_SM90_L2_SECTION_BYTES = size
        attention_module.FWD_SM90_TILE_ORDER = order
        _calls.clear()  # plans keep the launch (and schedule) they were made with

    bf16 = cupy.dtype("bfloat16")
    rng = np.random.default_rng(args.seed)
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        h = HIDDEN // d
        q, k, v = (cupy.random.standard_normal((TOTAL_TOKENS, h, d), dtype=cupy.float32).astype(bf16)
                   for _ in range(3))
        for n in (int(x) for x in args.lengths.split(",")):
            b = max(1, TOTAL_TOKENS // n)
            for draw, causal in ((draw, causal) for draw in range(args.draws) for causal in (False, True)):
                if not causal:
                    layouts = {"dense": [n] * b, "varlen-equal": [n] * b, "varlen-ragged": ragged_lengths(rng, b, n)}
                tile = attention_module.fwd_sm90_tile(attention_module.fwd_sm90_tile_dims(d, d), seqlen_k=n,
                                                      banded=causal)
                share = (tile_share(layouts["varlen-ragged"], tile.block_m, tile.block_n, causal)
                         / tile_share(layouts["dense"], tile.block_m, tile.block_n, causal))
                calls = {}  # layout -> (call, its FLOPs)
                for name, lengths in layouts.items():
                    total = sum(lengths)
                    flops = sum(timing.attention_flops(1, h, s, s, d, causal) for s in lengths)
                    if name == "dense":
                        qd, kd, vd = (x[:total].reshape(b, n, h, d) for x in (q, k, v))
                        fn = lambda qd=qd, kd=kd, vd=vd: cuattn.attention(qd, kd, vd, causal=causal)  # noqa: E731
                    else:
                        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
                        longest = max(lengths)
                        qv, kv, vv = (x[:total] for x in (q, k, v))
                        fn = lambda qv=qv, kv=kv, vv=vv, cu=cu, longest=longest: cuattn.attention_varlen(  # noqa: E731
                            qv, kv, vv, cu, cu, longest, longest, causal=causal)
                    calls[name] = (fn, flops)
                # every (layout, schedule) in turn, --rounds times over, each reporting its median
                medians = timing.time_in_turn({(name, entry): fn for name, (fn, _) in calls.items()
                                               for entry in schedules}, args.rounds, before=select)
                rates = {entry[0]: {} for entry in schedules}
                for name, (_, flops) in calls.items():
                    for entry in schedules:
                        label, schedule, size, order = entry
                        ms = medians[name, entry]
                        rates[label][name] = flops / ms / 1e9
                        rows.append(dict(head_dim=d, mean_seqlen=n, sequences=b, causal=causal, layout=name,
                                         schedule=schedule, section_bytes=size, tile_order=order, draw=draw,
                                         lengths=layouts[name], ms=ms, tflops=rates[label][name]))
                for label, rate in rates.items():
                    print(f"D={d:3d} N={n:6d} {'causal' if causal else 'full  '} {label:10s} "
                          + "  ".join(f"{name} {r:6.1f}" for name, r in rate.items())
                          + f"  ragged/dense {rate['varlen-ragged'] / rate['dense']:.3f}"
                          + f"  equal/dense {rate['varlen-equal'] / rate['dense']:.3f}"
                          + f"  tile share {share:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
