"""Time forward tile candidates against torch SDPA on the current GPU: flash_fwd_kernel tiles and,
on sm_90a, flash_fwd_sm90_kernel variants with each overlap switched on one at a time.

python scripts/tune_fwd.py [--sm90]   (prints one line per (shape, tile) with TFLOP/s;
                                       --sm90: only the Hopper kernel's candidates)
"""

import itertools
import sys

import cupy
import numpy as np

import cuattn
from cuattn.bench import timing
from cuattn import _jit
from cuattn.attention import FWD_SM90_TILES, FwdSm90Tile, FwdTile, _launch_fwd, fwd_tile

CANDIDATES = {
    64: [FwdTile(128, 64, 4), FwdTile(128, 96, 4), FwdTile(128, 128, 4)],
    128: [FwdTile(128, 32, 4), FwdTile(128, 64, 4)],
}
# (block_n, consumers, stages, overlap, pingpong): neither overlap, each alone, both; stage counts
SM90_CANDIDATES = {
    64: [FwdSm90Tile(128, 2, 2, False, False), FwdSm90Tile(128, 2, 2, True, False),
         FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 2, True, True), FwdSm90Tile(128, 2, 4, True, True)],
    128: [FwdSm90Tile(128, 2, 2, False, False), FwdSm90Tile(128, 2, 2, True, False),
          FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 2, True, True)],
    256: [FwdSm90Tile(80, 2, 2, False, False), FwdSm90Tile(80, 2, 2, False, True), FwdSm90Tile(80, 2, 2, True, True)],
}
HEAD_DIMS = (64, 128, 256)


def label(tile) -> str:
    if isinstance(tile, FwdSm90Tile):
        return (f"sm90 n{tile.block_n} {tile.consumers}wg {tile.stages}st ov={int(tile.overlap)} "
                f"pp={int(tile.pingpong)}")
    return f"mma {tile.block_m}x{tile.block_n}x{tile.warps}"


def is_default(tile, d: int) -> bool:
    arch = _jit.target_arch()
    if arch == "sm_90a" and d in FWD_SM90_TILES:
        return tile == FWD_SM90_TILES[d]
    return tile == fwd_tile(d, arch)


def main():
    total_tokens, hidden = 32768, 2048
    dtype = cupy.dtype("bfloat16")
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    sm90_only = "--sm90" in sys.argv
    for d, n, causal in itertools.product(HEAD_DIMS, [1024, 4096, 16384], [False, True]):
        b, h = total_tokens // n, hidden // d
        q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
        out = cupy.empty_like(q)
        flops = timing.attention_flops(b, h, n, n, d, causal)
        candidates = [] if sm90_only else list(CANDIDATES.get(d, [fwd_tile(d, _jit.target_arch())]))
        if _jit.target_arch() == "sm_90a":
            candidates += SM90_CANDIDATES[d]
        for tile in candidates:
            fn = lambda: _launch_fwd(q, k, v, out, None, None, None, batch=b, seqlen_q=n, seqlen_k=n,
                                     causal=causal, scale=None, window=(-1, -1), softcap=0.0,
                                     stream=cupy.cuda.get_current_stream(), tile=tile)
            ms = timing.time_cuda(fn)
            star = "*" if is_default(tile, d) else " "
            print(f"d={d:3d} n={n:5d} causal={causal!s:5} {label(tile):28}{star} "
                  f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
        if torch is not None:
            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel([backend]):
                        fn = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                        fn()
                        torch.cuda.synchronize()
                        ms = timing.time_cuda(fn)
                    print(f"d={d:3d} n={n:5d} causal={causal!s:5} torch-{name:5}{'':23} {ms:8.3f} ms "
                          f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
                except Exception as exc:
                    print(f"torch {name} failed: {exc}")


if __name__ == "__main__":
    sys.exit(main())
