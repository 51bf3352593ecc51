"""Time the backward's tile candidates (atomic and deterministic dQ) on the current GPU.

python scripts/tune_bwd.py [--atomic-only] [D ...]
(one line per (shape, tile, mode) with TFLOP/s at 2.5x forward FLOPs)

Candidates replace the dispatcher's BWD_TILES entry for this arch while they run, so the whole
public path (preprocess, main kernel, dQ) is what gets timed.

python scripts/tune_bwd.py --dq-modes [--json PATH] [--head-dims 64,128] [--lengths 4096,16384]
(sm_90a: flash_bwd_sm90_kernel's dQ paths one by one, bf16, causal and not, beside torch SDPA's
cuDNN backward in the same run: "atomic" = float4 atomics, and flash_bwd_dq_kernel when
deterministic; "bulk" = one bulk reduction per dQ tile, ordered by semaphores when
deterministic. A star marks the path the dispatcher picks. Each row:
ms, TFLOP/s, and the ratio to cuDNN; --json writes the rows.)
"""

import argparse
import itertools
import sys

import cupy

import cuattn
from cuattn import _calls, _jit
from cuattn.bench import cases, timing
from cuattn import attention as _  # noqa: F401  (the module, for its tile table)

attention_module = sys.modules["cuattn.attention"]
BwdTile = attention_module.BwdTile

CANDIDATES = {
    64: [BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True), BwdTile(64, 128, 8, 4, 4, 2, 2, 1, 64, 32, 4), BwdTile(128, 128, 8, 4, 4, 4, 2, 1, 64, 32, 4),
         BwdTile(64, 64, 8, 2, 2, 2, 2, 2, 64, 32, 4), BwdTile(128, 64, 8, 2, 2, 4, 1, 2, 64, 32, 4)],
    128: [BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 64, 4, wgmma=True), BwdTile(64, 128, 8, 4, 4, 2, 2, 1, 64, 64, 4),
          BwdTile(64, 64, 8, 2, 2, 2, 1, 2, 64, 64, 4), BwdTile(128, 64, 8, 2, 4, 4, 1, 1, 64, 64, 4)],
}


def dq_modes(head_dims, lengths, json_path):
    """flash_bwd_sm90_kernel's dQ modes x deterministic, and torch SDPA's cuDNN backward."""
    import json

    family = attention_module.arch_family(_jit.target_arch())
    if family != attention_module.SM90:
        print(f"--dq-modes needs sm_90a, this GPU is {_jit.target_arch()}")
        return 1
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    total_tokens, hidden = 32768, 2048
    dtype = cupy.dtype("bfloat16")
    rows = []
    for d, n, causal in itertools.product(head_dims, lengths, [False, True]):
        b, h = total_tokens // n, hidden // d
        q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        flops = timing.BACKWARD_FLOP_RATIO * timing.attention_flops(b, h, n, n, d, causal)
        shape = {"head_dim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal}
        cudnn_ms = None
        if torch is not None:
            tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
            tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                fn = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)
                fn()
                torch.cuda.synchronize()
                cudnn_ms = timing.time_cuda(fn)
                rows.append({**shape, "impl": "torch-cudnn", "ms": cudnn_ms, "tflops": flops / cudnn_ms / 1e9})
                print(f"d={d:3d} n={n:5d} causal={causal!s:5} torch-cudnn{'':17} {cudnn_ms:8.3f} ms "
                      f"{flops / cudnn_ms / 1e9:7.1f} TFLOP/s", flush=True)
            except RuntimeError as exc:
                print(f"torch cudnn failed: {str(exc).splitlines()[0] if str(exc) else exc}")
        for mode, deterministic in itertools.product(attention_module.BWD_DQ_MODES, [False, True]):
            default = attention_module.bwd_tile(d, _jit.target_arch(), deterministic)
            with cases.forced_bwd_dq_mode(mode):
                ms = timing.time_cuda(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                        deterministic=deterministic))
            impl = f"cuattn-{mode}{'-deterministic' if deterministic else ''}"
            ratio = cudnn_ms / ms if cudnn_ms else None
            rows.append({**shape, "impl": impl, "ms": ms, "tflops": flops / ms / 1e9, "vs_cudnn": ratio})
            star = "*" if mode == default.dq_mode else " "
            print(f"d={d:3d} n={n:5d} causal={causal!s:5} {impl:27}{star} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
                  + (f"  {ratio:5.2f}x cudnn" if ratio else ""), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"arch": _jit.target_arch(), "dtype": "bfloat16", "flops": "2.5x forward", "rows": rows}, f,
                      indent=1)
    return 0


def main(argv):
    if "--dq-modes" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--dq-modes", action="store_true")
        parser.add_argument("--json", default=None, help="write the rows to this path")
        parser.add_argument("--head-dims", default="64,128")
        parser.add_argument("--lengths", default="4096,16384")
        args = parser.parse_args(argv)
        return dq_modes([int(x) for x in args.head_dims.split(",")], [int(x) for x in args.lengths.split(",")],
                        args.json)
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
            _calls.clear()  # (a plan an earlier candidate recorded would replay that candidate)
            try:
                ms = timing.time_cuda(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                        deterministic=deterministic))
            finally:
                attention_module.BWD_TILES[d][family] = default
                _calls.clear()
            star = "*" if tile == default else " "
            mode = "deterministic" if deterministic else "atomic"
            shape = (f"{tile.block_m}x{tile.block_n} wgmma" if tile.wgmma else
                     f"{tile.block_m}x{tile.block_n} w{tile.warps} s{tile.s_warps_n} kv{tile.kv_warps_n} "
                     f"dq{tile.dq_warps_m} st{tile.stages} cta{tile.min_blocks}")
            print(f"d={d:3d} n={n:5d} causal={causal!s:5} {mode:13s} {shape}{star} {ms:8.3f} ms "
                  f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
