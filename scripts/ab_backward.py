"""The backward's dQ paths side by side, and beside torch SDPA's cuDNN backend.

python scripts/ab_backward.py LABEL IMPLS [SEQLENS]
    IMPLS, comma-separated: cuattn (the default path), cuattn-det (deterministic=True); with the
    dQ mode forced on sm_90a: cuattn-atomic / cuattn-atomicdet (float4 atomics; deterministic:
    flash_bwd_dq_kernel), cuattn-bulk / cuattn-bulkdet (bulk reductions, ordered where
    BWD_ORDERED_HEAD_DIMS or deterministic says), cuattn-unordered (bulk reductions never
    ordered); and any backward implementation of `python -m cuattn bench` (torch-cudnn,
    torch-flash). The bench grid:
    bf16, B * N = 32k tokens, H * D = 2048, D = 64 and 128, full and causal; SEQLENS defaults to
    1024,4096,16384. One line per case, TFLOP/s at 2.5x the forward's FLOPs. Run it from two
    checkouts with two labels to compare kernels (docs/bwd_ws_ab_h200.txt), and one variant per
    process for the fairest comparison (a second variant's arrays land elsewhere in memory).
"""

import dataclasses
import importlib
import sys

import cupy

import cuattn
from cuattn import _calls
from cuattn.bench import cases, timing

attention_module = importlib.import_module("cuattn.attention")
plain_bwd_tile = attention_module.bwd_tile
plain_ordered = attention_module.BWD_ORDERED_HEAD_DIMS


def forced_bwd_tile(mode: str):
    """bwd_tile with the dQ mode forced on wgmma tiles (ALiBi keeps its own choice)."""
    def bwd_tile(head_dim, arch, deterministic=False, alibi=False, head_dim_v=None):
        tile = plain_bwd_tile(head_dim, arch, deterministic, alibi, head_dim_v)
        return dataclasses.replace(tile, dq_mode=mode) if tile.wgmma and not alibi else tile
    return bwd_tile


def time_cuattn(impl: str, shape) -> float:
    """ms per attention_backward call of one cuattn variant (IMPLS above)."""
    forced = next((mode for mode in ("atomic", "bulk", "unordered") if mode in impl), None)
    attention_module.bwd_tile = plain_bwd_tile if forced is None else forced_bwd_tile(
        "bulk" if forced == "unordered" else forced)
    # "unordered": the bulk tile without the ordered path at any head dim (deterministic=False)
    attention_module.BWD_ORDERED_HEAD_DIMS = () if forced == "unordered" else plain_ordered
    # a plan recorded by an earlier variant of the same signature would replay that variant's
    # kernels: every variant starts from the full path
    _calls.clear()
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
        attention_module.BWD_ORDERED_HEAD_DIMS = plain_ordered
        _calls.clear()


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
