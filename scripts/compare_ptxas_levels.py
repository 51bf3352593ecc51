"""flash_fwd_sm90_kernel variants built at one ptxas optimisation level: right or wrong, and how fast.

python scripts/compare_ptxas_levels.py LEVEL     (LEVEL: 0-3; 3 is ptxas's default)
    per variant (D, Dv, key block, overlap, ping-pong): the largest error against the float64
    reference on small causal inputs (130 queries over 80 and 203 keys, fp16), and TFLOP/s on
    the forward benchmark's shapes (bf16, B * N = 32768 with N = 4096, H = round(2048 / D)),
    without and with the causal mask. The variants are the defaults of FWD_SM90_TILES and those
    ptxas -O3 compiled into wrong outputs on the H200 (attention.FWD_SM90_PTXAS_OPTIONS). Run
    each level in its own process with its own CUATTN_CACHE_DIR: a level replaces the variants'
    ptxas options (FWD_SM90_PTXAS_OPTIONS, which the variants' specs carry).
"""

import importlib
import sys

import cupy
import numpy as np

from cuattn import reference
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS

attention_module = importlib.import_module("cuattn.attention")  # the module, not the function
Tile = attention_module.FwdSm90Tile
VARIANTS = [(64, 64, Tile(128, 2, 4)), (128, 128, Tile(128, 2, 2)), (256, 256, Tile(80, 2, 2, False, True)),
            (256, 256, Tile(80, 2, 2, False, False)), (160, 160, Tile(80, 2, 2, True, True)),
            (160, 160, Tile(80, 2, 2, True, False)), (192, 192, Tile(80, 2, 2, True, True)),
            (192, 192, Tile(80, 2, 2, True, False)), (96, 96, Tile(128, 2, 2)), (80, 80, Tile(128, 2, 2)),
            (192, 128, Tile(128, 2, 2))]
SEQLEN = 4096


def main(argv):
    level = int(argv[0])
    attention_module.FWD_SM90_PTXAS_OPTIONS = (f"--ptxas-options=-O{level}",)
    attention_module.fwd_sm90_spec.cache_clear()
    rng = np.random.default_rng(1)
    stream = cupy.cuda.get_current_stream()
    bf16 = cupy.dtype("bfloat16")

    def launch(q, k, v, out, causal, tile, schedule=None):
        return attention_module._launch_fwd(q, k, v, out, None, None, None, batch=q.shape[0], seqlen_q=q.shape[1],
                                            seqlen_k=k.shape[1], causal=causal, scale=None, window=(-1, -1),
                                            softcap=0.0, stream=stream, tile=tile, schedule=schedule)

    for d, dv, tile in VARIANTS:
        errors = []
        for keys in (80, 203):
            q = rng.standard_normal((1, 130, 2, d)).astype(np.float16)
            k = rng.standard_normal((1, keys, 2, d)).astype(np.float16)
            v = rng.standard_normal((1, keys, 2, dv)).astype(np.float16)
            out = cupy.full((1, 130, 2, dv), np.nan, np.float16)
            launch(*(cupy.asarray(x) for x in (q, k, v)), out, True, tile, "static")
            errors.append(float(np.abs(out.get().astype(np.float64) - reference.attention(q, k, v, causal=True)).max()))
        h, b = round(HIDDEN / d), TOTAL_TOKENS // SEQLEN
        q, k = (cupy.random.standard_normal((b, SEQLEN, h, d), dtype=cupy.float32).astype(bf16) for _ in range(2))
        v = cupy.random.standard_normal((b, SEQLEN, h, dv), dtype=cupy.float32).astype(bf16)
        out = cupy.empty((b, SEQLEN, h, dv), bf16)
        rates = []
        for causal in (False, True):
            ms = timing.time_cuda(lambda: launch(q, k, v, out, causal, tile))
            rates.append(timing.attention_flops(b, h, SEQLEN, SEQLEN, (d + dv) / 2, causal) / ms / 1e9)
        print(f"-O{level} d={d} dv={dv} bn={tile.block_n} ov={int(tile.overlap)} pp={int(tile.pingpong)}: "
              f"err {max(errors):.2g}  full {rates[0]:.1f}  causal {rates[1]:.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
