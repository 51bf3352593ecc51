"""Where the host time of one eager call goes: cProfile over many calls of one overhead case.

Usage: python scripts/profile_host.py [FUNCTION] [FRAMEWORK] [--calls N]
(FUNCTION and FRAMEWORK as in `python -m cuattn bench overhead`, default decode torch).
Prints the functions with the most cumulative and own time per call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from cuattn.bench import overhead
from cuattn._arrays import BFLOAT16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("function", nargs="?", default="decode")
    parser.add_argument("framework", nargs="?", default="torch")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    setup = next(s for c, s in overhead.cases(BFLOAT16) if (c.function, c.framework) == (args.function, args.framework))
    fn = setup()
    for _ in range(overhead.WARMUP_CALLS):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        fn()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
