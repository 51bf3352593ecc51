"""Shapes of the FP8 forward's V^T pass (fp8_v_transpose_kernel) on the current GPU: each one bit
for bit against attention.fp8_v_transposed on strided views, then its time and bandwidth.

python scripts/tune_fp8_transpose.py [--shapes 2x4x8,1x16x8,...]
    A shape is GROUPSxBYTESxLANES_D (Fp8TransposeShape: key groups of 16 a thread, head-dim bytes
    a thread, chunks along a warp); the default list holds the one the calls use
    (fp8_transpose_shape) and the candidates measured beside it. V (B, N, Hk, D) e4m3 bytes at the
    forward benchmark's sizes (B * N = 32k tokens, Hk * D = 2048); bandwidth counts V read once
    and V^T written once; CUDA-event medians, the best of three.
"""

import argparse
import importlib

import cupy
import numpy as np

from cuattn.bench import timing

attention_module = importlib.import_module("cuattn.attention")
CANDIDATES = "2x4x8,1x16x8,2x16x8,1x16x4,2x8x8,1x8x8,2x16x4"
CASES = ((128, 1024), (128, 8192), (128, 16384), (256, 8192))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=CANDIDATES)
    args = parser.parse_args()
    shapes = [attention_module.Fp8TransposeShape(*map(int, s.split("x"))) for s in args.shapes.split(",")]
    rng = np.random.default_rng()
    for shape in shapes:
        wrong = 0
        for d in (128, 256):
            for sk in (1, 37, 80, 128, 300):
                whole = rng.integers(0, 256, (2, sk, 6, d), dtype=np.uint8)
                got = attention_module._fp8_v_transposed_on_device(cupy.asarray(whole)[:, :, 1::2], None, shape)
                wrong += not np.array_equal(got.get(), attention_module.fp8_v_transposed(whole[:, :, 1::2],
                                                                                        span=shape.span))
        print(f"{shape}: {wrong} of 10 cases differ from fp8_v_transposed", flush=True)
    for d, n in CASES:
        v = cupy.asarray(rng.integers(0, 256, (32768 // n, n, 2048 // d, d), dtype=np.uint8))
        row = [f"D={d} N={n}"]
        for shape in shapes:
            ms = min(timing.time_cuda(lambda: attention_module._fp8_v_transposed_on_device(v, None, shape))
                     for _ in range(3))
            row.append(f"{shape.groups}x{shape.chunk_bytes}x{shape.lanes_d}: {ms * 1e3:5.1f} us "
                       f"{2 * v.size / ms / 1e9:4.2f} TB/s")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
