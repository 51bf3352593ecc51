"""What the attention variants cost: forward (and backward) time with sinks or ALiBi against plain
attention on the same inputs, on the current GPU (the variants issue's target: at most 5%).

python scripts/bench_variants.py [--lengths 4096] [--head-dims 64,128] [--backward] [--rounds 3] [--json PATH]
    one line per (head dim, N, mask, variant): ms, TFLOP/s and the ratio to the plain call;
    bf16, 32k tokens in total (B = 32768 / N), H * D = 2048, as the forward benchmark. The
    variants of a case are timed in turn, --rounds times over, and each reports the median of its
    rounds (cuattn.bench.timing.time_in_turn): timed once each, one after the other, sinks showed a
    6-9% cost at D = 64, 1k, causal on the H200, where the kernels ran 543.9 against 544.3 us under
    ncu's locked clocks.
"""

import argparse
import json
import sys

import cupy
import numpy as np

import cuattn
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS, alibi_slopes  # the forward benchmark's shapes



def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    bf16 = cupy.dtype("bfloat16")
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            b, h = max(1, TOTAL_TOKENS // n), HIDDEN // d
            q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16)
                             for _ in range(4))
            variants = {
                "plain": {},
                "sinks": {"sinks": cupy.asarray(np.random.default_rng().standard_normal(h).astype(np.float32))},
                # the ALiBi paper's slopes (2^(-8 i / H) where H is a power of two)
                "alibi": {"alibi_slopes": cupy.asarray(alibi_slopes(h))},
            }
            for causal in (False, True):
                calls = {}
                for name, options in variants.items():
                    if args.backward:
                        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True, **options)
                        calls[name] = (lambda out=out, lse=lse, options=options: cuattn.attention_backward(
                            dout, q, k, v, out, lse, causal=causal, **options))
                    else:
                        calls[name] = lambda options=options: cuattn.attention(q, k, v, causal=causal, **options)
                medians = timing.time_in_turn(calls, args.rounds)
                base = None
                for name, ms in medians.items():
                    flops = timing.attention_flops(b, h, n, n, d, causal) * (timing.BACKWARD_FLOP_RATIO if args.backward else 1)
                    base = base or ms
                    row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant=name, ms=ms,
                               tflops=flops / ms / 1e9, ratio=ms / base, backward=args.backward)
                    rows.append(row)
                    print(f"D={d:3d} N={n:6d} {'causal' if causal else 'full  '} {name:6s} {ms:8.3f} ms "
                          f"{row['tflops']:6.1f} TFLOP/s  x{row['ratio']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
