"""One forward call (after a warm-up call) for a profiler to look at.

ncu --clock-control none -k regex:flash_fwd --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    python scripts/profile_fwd.py [D] [N] [causal]
"""

import sys

import cupy

import cuattn
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS  # the forward benchmark's shapes


def main(argv):
    d = int(argv[0]) if argv else 128
    n = int(argv[1]) if len(argv) > 1 else 8192
    causal = len(argv) > 2 and argv[2] == "causal"
    b, h = max(1, TOTAL_TOKENS // n), HIDDEN // d
    bf16 = cupy.dtype("bfloat16")
    q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
    for _ in range(2):  # the first compiles and warms up; the profiler takes the second
        cuattn.attention(q, k, v, causal=causal)
    cupy.cuda.Device().synchronize()
    print(f"forward of B={b} N={n} H={h} D={d} causal={causal}, twice")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
