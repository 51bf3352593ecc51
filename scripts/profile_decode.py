"""Where a decode call's host time goes: wall time per call and a cProfile of many calls.

python scripts/profile_decode.py   (on a GPU machine)
"""

import cProfile
import pstats
import time

import cupy
import numpy as np

import cuattn


def main():
    bf16 = cupy.dtype("bfloat16")
    q = cupy.random.standard_normal((1, 1, 32, 128), dtype=cupy.float32).astype(bf16)
    k = cupy.random.standard_normal((1, 32768, 8, 128), dtype=cupy.float32).astype(bf16)
    lens = cupy.full((1,), 32768, np.int32)
    for _ in range(10):
        cuattn.decode(q, k, k, lens)
    cupy.cuda.Device().synchronize()
    calls = 2000
    start = time.perf_counter()
    for _ in range(calls):
        cuattn.decode(q, k, k, lens)
    host = (time.perf_counter() - start) / calls
    cupy.cuda.Device().synchronize()
    print(f"host time per decode call: {host * 1e6:.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        cuattn.decode(q, k, k, lens)
    profile.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
