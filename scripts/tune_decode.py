"""Graph-timed decode TB/s over num_splits for the decode benchmark's shapes (GQA 32/8, D 128, bf16).

python scripts/tune_decode.py [B:L ...]   (default 1:32768; '*' marks the dispatcher's choice)
"""

import importlib
import sys

import cupy
import numpy as np

import cuattn
from cuattn import _jit
from cuattn.bench import timing

decode_module = importlib.import_module("cuattn.decode")

HQ, HK, D = 32, 8, 128
SPLITS = [1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64]


def main(argv):
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in argv] or [(1, 32768)]
    bf16 = cupy.dtype("bfloat16")
    for batch, seqlen in shapes:
        q = cupy.random.standard_normal((batch, 1, HQ, D), dtype=cupy.float32).astype(bf16)
        k, v = (cupy.random.standard_normal((batch, seqlen, HK, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
        lens = cupy.full((batch,), seqlen, np.int32)
        nbytes = timing.kv_bytes(batch, seqlen, HK, D)
        ms = timing.time_cupy_graph(lambda: cuattn.decode(q, k, v, lens))
        print(f"B={batch:3d} L={seqlen:7d} splits=auto {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
        for splits in SPLITS:
            ms = timing.time_cupy_graph(lambda: cuattn.decode(q, k, v, lens, num_splits=splits))
            print(f"B={batch:3d} L={seqlen:7d} splits={splits:4d} {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
    print(f"SMs: {_jit.multiprocessor_count()}; MIN_KEYS_PER_SPLIT={decode_module.MIN_KEYS_PER_SPLIT}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
