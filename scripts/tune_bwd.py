"""Time the backward's tile candidates (atomic and deterministic dQ) on the current GPU.

python scripts/tune_bwd.py [--atomic-only] [D ...]
(one line per (shape, tile, mode) with TFLOP/s at 2.5x forward FLOPs)

Candidates replace the dispatcher's BWD_TILES entry for this arch while they run, so the whole
public path (preprocess, main kernel, dQ) is what gets timed.
"""

import itertools
import sys

import cupy

import cuattn
from cuattn import _jit
from cuattn.bench import timing
from cuattn import attention as _  # noqa: F401  (the module, for its tile table)

attention_module = sys.modules["cuattn.attention"]
BwdTile = attention_module.BwdTile

CANDIDATES = {
    64: [BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True), BwdTile(64, 128, 8, 4, 4, 2, 2, 1, 64, 32, 4), BwdTile(128, 128, 8, 4, 4, 4, 2, 1, 64, 32, 4),
         BwdTile(64, 64, 8, 2, 2, 2, 2, 2, 64, 32, 4), BwdTile(128, 64, 8, 2, 2, 4, 1, 2, 64, 32, 4)],
    128: [BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 64, 4, wgmma=True), BwdTile(64, 128, 8, 4, 4, 2, 2, 1, 64, 64, 4),
          BwdTile(64, 64, 8, 2, 2, 2, 1, 2, 64, 64, 4), BwdTile(128, 64, 8, 2, 4, 4, 1, 1, 64, 64, 4)],
}


def main(argv):
    modes = [False] if "--atomic-only" in argv else [False, True]
    head_dims = [int(x) for x in argv if x != "--atomic-only"] or sorted(CANDIDATES)
    total_tokens, hidden = 32768, 2048
    dtype = cupy.dtype("bfloat16")
    family = attention_module.arch_family(_jit.target_arch())
    for d, n, causal in itertools.product(head_dims, [4096, 16384], [False, True]):
        b, h = total_tokens // n, hidden // d
        q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        flops = timing.BACKWARD_FLOP_RATIO * timing.attention_flops(b, h, n, n, d, causal)
        default = attention_module.BWD_TILES[d][family]
        for tile, deterministic in itertools.product(CANDIDATES.get(d, [default]), modes):
            attention_module.BWD_TILES[d][family] = tile
            try:
                ms = timing.time_cuda(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                        deterministic=deterministic))
            finally:
                attention_module.BWD_TILES[d][family] = default
            star = "*" if tile == default else " "
            mode = "deterministic" if deterministic else "atomic"
            shape = (f"{tile.block_m}x{tile.block_n} wgmma" if tile.wgmma else
                     f"{tile.block_m}x{tile.block_n} w{tile.warps} s{tile.s_warps_n} kv{tile.kv_warps_n} "
                     f"dq{tile.dq_warps_m} st{tile.stages} cta{tile.min_blocks}")
            print(f"d={d:3d} n={n:5d} causal={causal!s:5} {mode:13s} {shape}{star} {ms:8.3f} ms "
                  f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
