"""Graph-timed decode TB/s and step time over num_splits for the decode benchmark's shapes (GQA 32/8, D 128).

python scripts/tune_decode.py [--fp16] [--fp8] [B:L ...]   (default 1:32768, bf16 q and cache)
--fp16: fp16 q (and cache); --fp8: the cache in e4m3 (per-head scales), q as given. TB/s counts
the bytes the cache holds; the step time compares caches.
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
    fp8, fp16 = "--fp8" in argv, "--fp16" in argv
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in argv if not arg.startswith("--")] or [(1, 32768)]
    dtype = cupy.float16 if fp16 else cupy.dtype("bfloat16")
    for batch, seqlen in shapes:
        q = cupy.random.standard_normal((batch, 1, HQ, D), dtype=cupy.float32).astype(dtype)
        k, v = (cupy.random.standard_normal((batch, seqlen, HK, D), dtype=cupy.float32).astype(dtype) for _ in range(2))
        scales = {}
        if fp8:
            scales = {"k_scale": cuattn.fp8_scales(k, per_head=True), "v_scale": cuattn.fp8_scales(v, per_head=True)}
            k, v = cuattn.quantize_fp8(k, scales["k_scale"]), cuattn.quantize_fp8(v, scales["v_scale"])
        lens = cupy.full((batch,), seqlen, np.int32)
        nbytes = timing.kv_bytes(batch, seqlen, HK, D, k.dtype.itemsize)
        label = f"B={batch:3d} L={seqlen:7d} {'e4m3' if fp8 else 'fp16' if fp16 else 'bf16'}"
        ms = timing.time_cupy_graph(lambda: cuattn.decode(q, k, v, lens, **scales))
        print(f"{label} splits=auto {nbytes / ms / 1e9:5.2f} TB/s {ms * 1e3:8.1f} us", flush=True)
        for splits in SPLITS:
            ms = timing.time_cupy_graph(lambda: cuattn.decode(q, k, v, lens, num_splits=splits, **scales))
            print(f"{label} splits={splits:4d} {nbytes / ms / 1e9:5.2f} TB/s {ms * 1e3:8.1f} us", flush=True)
    print(f"SMs: {_jit.multiprocessor_count()}; MIN_KEYS_PER_SPLIT={decode_module.MIN_KEYS_PER_SPLIT}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
