"""One backward call each way (atomic dQ, deterministic dQ) for a profiler to look at.

ncu --clock-control none -k regex:flash_bwd python scripts/profile_bwd.py [D] [N] [causal]
"""

import sys

import cupy

import cuattn

TOTAL_TOKENS, HIDDEN = 32768, 2048


def main(argv):
    d = int(argv[0]) if argv else 128
    n = int(argv[1]) if len(argv) > 1 else 4096
    causal = len(argv) > 2 and argv[2] == "causal"
    b, h = TOTAL_TOKENS // n, HIDDEN // d
    bf16 = cupy.dtype("bfloat16")
    q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
    for deterministic in (False, True):
        cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    cupy.cuda.Device().synchronize()
    print(f"backward of B={b} N={n} H={h} D={d} causal={causal}: atomic, then deterministic")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
