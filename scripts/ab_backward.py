"""The backward's dQ paths side by side, and beside torch SDPA's cuDNN backend.

python scripts/ab_backward.py LABEL IMPLS [SEQLENS [HEAD_DIMS]]
    IMPLS, comma-separated: cuattn (the default path), cuattn-det (deterministic=True); with the
    dQ mode forced on sm_90a: cuattn-atomic / cuattn-atomicdet (float4 atomics; deterministic:
    flash_bwd_dq_kernel), cuattn-bulk / cuattn-bulkdet (bulk reductions, ordered for
    deterministic=True); cuattn-mmasync / cuattn-mmasyncdet (the mma.sync kernels, flash_bwd_kernel, in
    place of the wgmma one); and any backward implementation of `python -m cuattn bench`
    (torch-cudnn, torch-flash). The bench grid:
    bf16, B * N = 32k tokens, H * D = 2048, full and causal; SEQLENS defaults to 1024,4096,16384
    and HEAD_DIMS to the bench's (64,128). One line per case, TFLOP/s at 2.5x the forward's
    FLOPs. Run it from two checkouts with two labels to compare kernels (docs/bwd_ws_ab_h200.txt),
    and one variant per process for the fairest comparison (a second variant's arrays land
    elsewhere in memory).
"""

import contextlib
import importlib
import sys

import cupy

import cuattn
from cuattn import _calls
from cuattn.bench import cases, timing

attention_module = importlib.import_module("cuattn.attention")


@contextlib.contextmanager
def forced_mma_sync():
    """The mma.sync backward tile of the call's head dims (the sm_80 family's), whatever the
    dispatcher would pick (the remembered plans cleared on entry and exit, as forced_bwd_dq_mode
    does)."""
    plain = attention_module.bwd_tile, attention_module.bwd_tile_dim
    sm80 = attention_module.SM80

    def bwd_tile_dim(head_dim, arch):
        return plain[1](head_dim, sm80)

    def bwd_tile(head_dim, arch, deterministic=False, alibi=False, head_dim_v=None):
        return plain[0](head_dim, sm80, deterministic, alibi, head_dim_v)

    _calls.clear()
    attention_module.bwd_tile, attention_module.bwd_tile_dim = bwd_tile, bwd_tile_dim
    try:
        yield
    finally:
        attention_module.bwd_tile, attention_module.bwd_tile_dim = plain
        _calls.clear()


def time_cuattn(impl: str, shape) -> float:
    """ms per attention_backward call of one cuattn variant (IMPLS above)."""
    forced = next((mode for mode in cases.BWD_FORCED_DQ_MODES if mode in impl), None)
    if "mmasync" in impl:
        context = forced_mma_sync()
    else:
        context = contextlib.nullcontext() if forced is None else cases.forced_bwd_dq_mode(forced)
    with context:
        q, k, v, dout = (cupy.random.standard_normal((shape.batch, shape.seqlen, shape.q_heads, shape.head_dim),
                                                     dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
                         for _ in range(4))
        out, lse = cuattn.attention(q, k, v, causal=shape.causal, return_lse=True)
        deterministic = impl.endswith("det")
        fn = lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=shape.causal,
                                               deterministic=deterministic)
        fn()
        return timing.time_cuda(fn)


def main():
    label, impls = sys.argv[1], sys.argv[2].split(",")
    seqlens = tuple(int(x) for x in sys.argv[3].split(",")) if len(sys.argv) > 3 else cases.SEQLENS
    head_dims = tuple(int(x) for x in sys.argv[4].split(",")) if len(sys.argv) > 4 else cases.HEAD_DIMS
    for n in seqlens:
        for d in head_dims:
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
