"""Time flash_fwd_kernel tile candidates against torch SDPA on the current GPU.

python scripts/tune_fwd.py   (prints one line per (shape, tile) with TFLOP/s)
"""

import itertools
import sys

import cupy
import numpy as np

import cuattn
from cuattn.bench import timing
from cuattn import _jit
from cuattn.attention import FwdTile, _launch_fwd, fwd_tile

CANDIDATES = {
    64: [FwdTile(128, 64, 4), FwdTile(128, 96, 4), FwdTile(128, 128, 4)],
    128: [FwdTile(128, 32, 4), FwdTile(128, 64, 4)],
}


def main():
    total_tokens, hidden = 32768, 2048
    dtype = cupy.dtype("bfloat16")
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    for d, n, causal in itertools.product([64, 128], [4096, 16384], [False, True]):
        b, h = total_tokens // n, hidden // d
        q, k, v = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
        out = cupy.empty_like(q)
        flops = timing.attention_flops(b, h, n, n, d, causal)
        for tile in CANDIDATES[d]:
            fn = lambda: _launch_fwd(q, k, v, out, None, None, None, batch=b, seqlen_q=n, seqlen_k=n,
                                     causal=causal, scale=None, window=(-1, -1), softcap=0.0,
                                     stream=cupy.cuda.get_current_stream(), tile=tile)
            ms = timing.time_cuda(fn)
            star = "*" if tile == fwd_tile(d, _jit.target_arch()) else " "
            print(f"d={d:3d} n={n:5d} causal={causal!s:5} tile={tile.block_m}x{tile.block_n}x{tile.warps}{star} "
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
                    print(f"d={d:3d} n={n:5d} causal={causal!s:5} torch-{name:5}        {ms:8.3f} ms "
                          f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
                except Exception as exc:
                    print(f"torch {name} failed: {exc}")


if __name__ == "__main__":
    sys.exit(main())
