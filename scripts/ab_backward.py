"""The backward's dQ paths side by side, and beside torch SDPA's cuDNN backend.

python scripts/ab_backward.py LABEL IMPLS [SEQLENS]
    IMPLS, comma-separated: cuattn (the default path), cuattn-det (deterministic=True),
    cuattn-bulk / cuattn-bulkdet (the same with the bulk-dQ tile forced on sm_90a: ordered
    reductions where BWD_ORDERED_HEAD_DIMS or deterministic says, unordered elsewhere), and any
    backward implementation of `python -m cuattn bench` (torch-cudnn, torch-flash). The bench grid:
    bf16, B * N = 32k tokens, H * D = 2048, D = 64 and 128, full and causal; SEQLENS defaults to
    1024,4096,16384. One line per case, TFLOP/s at 2.5x the forward's FLOPs. Run it from two
    checkouts with two labels to compare kernels (docs/bwd_ws_ab_h200.txt).
"""

import dataclasses
import importlib
import sys

import cupy

import cuattn
from cuattn.bench import cases, timing

attention_module = importlib.import_module("cuattn.attention")
plain_bwd_tile = attention_module.bwd_tile


def bulk_bwd_tile(head_dim, arch, deterministic=False, alibi=False, head_dim_v=None):
    """bwd_tile with the bulk dQ forced on wgmma tiles (ALiBi keeps its own choice)."""
    tile = plain_bwd_tile(head_dim, arch, deterministic, alibi, head_dim_v)
    return dataclasses.replace(tile, dq_mode="bulk") if tile.wgmma and not alibi else tile


def time_cuattn(impl: str, shape) -> float:
    """ms per attention_backward call of one cuattn variant (IMPLS above)."""
    attention_module.bwd_tile = bulk_bwd_tile if "bulk" in impl else plain_bwd_tile
    try:
        q, k, v, dout = (cupy.random.standard_normal((shape.batch, shape.seqlen, shape.q_heads, shape.head_dim),
                                                     dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
                         for _ in range(4))
        out, lse = cuattn.attention(q, k, v, causal=shape.causal, return_lse=True)
        deterministic = impl.endswith("det")
        fn = lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=shape.causal,
                                               deterministic=deterministic)
        fn()
        return timing.time_cuda(fn)
    finally:
        attention_module.bwd_tile = plain_bwd_tile


def main():
    label, impls = sys.argv[1], sys.argv[2].split(",")
    seqlens = tuple(int(x) for x in sys.argv[3].split(",")) if len(sys.argv) > 3 else cases.SEQLENS
    for n in seqlens:
        for d in cases.HEAD_DIMS:
            for causal in cases.MASKS:
                shape = cases.attention_shape(n, d, causal)
                for impl in impls:
                    if impl.startswith("cuattn"):
                        ms = time_cuattn(impl, shape)
                        tflops = timing.BACKWARD_FLOP_RATIO * timing.attention_flops(
                            shape.batch, shape.q_heads, n, n, d, causal) / ms / 1e9
                    else:
                        (result,) = cases.run_case(cases.Case("backward", shape, (impl,)))
                        if result.ms is None:
                            print(label, impl, n, d, causal, "skipped:", result.skipped, flush=True)
                            continue
                        ms, tflops = result.ms, result.rate
                    print(f"{label} {impl:14s} N={n:6d} D={d:3d} causal={causal!s:5s} {ms:8.3f} ms {tflops:6.1f} TFLOP/s",
                          flush=True)


if __name__ == "__main__":
    main()
