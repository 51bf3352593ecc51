"""Time forward tile candidates against torch SDPA on the current GPU: flash_fwd_kernel tiles and,
on sm_90a, flash_fwd_sm90_kernel variants with each overlap switched on one at a time.

python scripts/tune_fwd.py [--sm90] [--head-dims 64,128] [--lengths 4096] [--varlen]
    prints one line per (shape, tile) with TFLOP/s; --sm90: only the Hopper kernel's
    candidates; --varlen: attention_varlen over ragged lengths against dense attention with the
    same total tokens (default kernels)
"""

import argparse
import itertools
import sys

import cupy
import numpy as np

from cuattn.bench import timing
from cuattn import _jit
from cuattn.attention import FWD_SM90_TILES, FwdSm90Tile, FwdTile, _launch_fwd, fwd_tile

CANDIDATES = {
    64: [FwdTile(128, 64, 4), FwdTile(128, 96, 4), FwdTile(128, 128, 4)],
    80: [FwdTile(128, 48, 4), FwdTile(128, 64, 4), FwdTile(128, 80, 4)],
    128: [FwdTile(128, 32, 4), FwdTile(128, 64, 4)],
    160: [FwdTile(64, 64, 4), FwdTile(64, 128, 4)],
}
# (block_n, consumers, stages, overlap, pingpong): neither overlap, each alone, both; stage counts
SM90_CANDIDATES = {
    64: [FwdSm90Tile(128, 2, 2, False, False), FwdSm90Tile(128, 2, 2, True, False),
         FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 2, True, True), FwdSm90Tile(128, 2, 4, True, True),
         # three consumers (192 query rows a tile, FlashAttention-3's D = 64 shape): at 160 registers
         # a consumer the overlap spills with 128-key blocks, not with 96 or 112
         FwdSm90Tile(128, 3, 2, False, False), FwdSm90Tile(128, 3, 3, False, False),
         FwdSm90Tile(128, 3, 4, False, False), FwdSm90Tile(96, 3, 2, True, False), FwdSm90Tile(96, 3, 3, True, False),
         FwdSm90Tile(112, 3, 2, True, False), FwdSm90Tile(112, 3, 3, True, False)],
    128: [FwdSm90Tile(128, 2, 2, False, False), FwdSm90Tile(128, 2, 2, True, False),
          FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 2, True, True)],
    256: [FwdSm90Tile(80, 2, 2, False, False), FwdSm90Tile(80, 2, 2, False, True), FwdSm90Tile(80, 2, 2, True, False)],
    # head dims of padded panels (every candidate compiles without spills)
    80: [FwdSm90Tile(128, 2, 2), FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 3, False, True),
         FwdSm90Tile(128, 3, 2, False, False)],
    96: [FwdSm90Tile(128, 2, 2), FwdSm90Tile(128, 2, 2, False, True), FwdSm90Tile(128, 2, 3, False, True),
         FwdSm90Tile(128, 3, 2, False, False)],
    160: [FwdSm90Tile(80, 2, 2, True, False), FwdSm90Tile(80, 2, 2), FwdSm90Tile(64, 2, 2),
          FwdSm90Tile(112, 2, 2, False, True), FwdSm90Tile(64, 2, 3, False, True)],
    192: [FwdSm90Tile(80, 2, 2), FwdSm90Tile(80, 2, 2, True, False), FwdSm90Tile(64, 2, 2),
          FwdSm90Tile(96, 2, 2, False, True)],
}
HEAD_DIMS = (64, 128, 256)


def label(tile) -> str:
    if isinstance(tile, FwdSm90Tile):
        return (f"sm90 n{tile.block_n} {tile.consumers}wg {tile.stages}st ov={int(tile.overlap)} "
                f"pp={int(tile.pingpong)}")
    return f"mma {tile.block_m}x{tile.block_n}x{tile.warps}"


def is_default(tile, d: int) -> bool:
    arch = _jit.target_arch()
    if arch == "sm_90a" and (d, d) in FWD_SM90_TILES:
        return tile == FWD_SM90_TILES[d, d]
    return tile == fwd_tile(d, arch)


def ragged_lengths(total: int, rng) -> list[int]:
    """Sequence lengths from 256 to 8192 (log-uniform) summing to `total`."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(min(total - sum(lengths), np.exp(rng.uniform(np.log(256), np.log(8192))))))
    return lengths


def varlen(head_dims, total_tokens, hidden, dtype):
    rng = np.random.default_rng(0)
    lengths = ragged_lengths(total_tokens, rng)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    print(f"varlen: {len(lengths)} sequences, lengths {min(lengths)}-{max(lengths)}, {sum(lengths)} tokens")
    for d, causal in itertools.product(head_dims, [False, True]):
        h = hidden // d
        q, k, v = (cupy.random.standard_normal((total_tokens, h, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
        flops = sum(timing.attention_flops(1, h, n, n, d, causal) for n in lengths)
        # time the prepared launches: attention_varlen's host path would leave gaps between kernels
        stream = cupy.cuda.get_current_stream()
        out = cupy.empty_like(q)
        launch = _launch_fwd(q[None], k[None], v[None], out[None], None, cu, cu, batch=len(lengths),
                             seqlen_q=max(lengths), seqlen_k=max(lengths), causal=causal, scale=None,
                             window=(-1, -1), softcap=0.0, stream=stream)
        ms = timing.time_cuda(lambda: launch.run(stream.ptr))
        n = 4096
        dense = [x.reshape(total_tokens // n, n, h, d) for x in (q, k, v, out)]
        dense_launch = _launch_fwd(*dense, None, None, None, batch=total_tokens // n, seqlen_q=n, seqlen_k=n,
                                   causal=causal, scale=None, window=(-1, -1), softcap=0.0, stream=stream)
        dense_ms = timing.time_cuda(lambda: dense_launch.run(stream.ptr))
        dense_flops = timing.attention_flops(total_tokens // n, h, n, n, d, causal)
        print(f"d={d:3d} causal={causal!s:5} varlen {flops / ms / 1e9:7.1f} TFLOP/s   dense N={n} "
              f"{dense_flops / dense_ms / 1e9:7.1f} TFLOP/s   ratio {flops / ms / (dense_flops / dense_ms):.2f}",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm90", action="store_true")
    parser.add_argument("--varlen", action="store_true")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--lengths", default="1024,4096,16384")
    args = parser.parse_args()
    head_dims = [int(x) for x in args.head_dims.split(",")]
    total_tokens, hidden = 32768, 2048
    dtype = cupy.dtype("bfloat16")
    if args.varlen:
        return varlen(head_dims, total_tokens, hidden, dtype)
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    lengths = [int(x) for x in args.lengths.split(",")]
    for d, n, causal in itertools.product(head_dims, lengths, [False, True]):
        b, h = total_tokens // n, hidden // d
        q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
        out = cupy.empty_like(q)
        flops = timing.attention_flops(b, h, n, n, d, causal)
        candidates = [] if args.sm90 else list(CANDIDATES.get(d, [fwd_tile(d, _jit.target_arch())]))
        if _jit.target_arch() == "sm_90a":
            candidates += SM90_CANDIDATES.get(d, [])
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
