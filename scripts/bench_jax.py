"""cuattn under jax.jit against the same kernels called eagerly, and JAX's cuDNN attention, on the
current GPU (the JAX issue's target: under jit within 5% of eager at N >= 4k).

python scripts/bench_jax.py [--lengths 4096,16384] [--head-dim 128] [--json PATH]
    per (N, mask): forward and forward + backward in ms for
      eager      cuattn.attention (+ attention_backward) on CuPy arrays, back to back, CUDA events
      eager-host the same, timed by the host clock like jit (a synchronise after each window)
      jit        cuattn.jax.attention under jax.jit (forward + backward: jax.vjp), host clock
      jax-cudnn  jax.nn.dot_product_attention(implementation="cudnn") under jax.jit, host clock
    bf16, 32k tokens in total (B = 32768 / N), H * D = 2048
"""

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cuattn  # noqa: E402
import cuattn.jax  # noqa: E402
from cuattn.bench import timing  # noqa: E402
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS  # noqa: E402 (the forward benchmark's shapes)



def ready(result):
    jax.block_until_ready(result)


def sync(result):
    cupy.cuda.get_current_stream().synchronize()


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    d = args.head_dim
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        b, h = max(1, TOTAL_TOKENS // n), HIDDEN // d
        q, k, v, dout = (cupy.random.standard_normal((b, n, h, d), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
                         for _ in range(4))
        jq, jk, jv, jdo = (jnp.from_dlpack(x) for x in (q, k, v, dout))
        for causal in (False, True):
            def eager_fwd_bwd():
                out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
                return cuattn.attention_backward(dout, q, k, v, out, lse, causal=causal)

            ours = lambda a, b_, c: cuattn.jax.attention(a, b_, c, causal=causal)
            cudnn = lambda a, b_, c: jax.nn.dot_product_attention(a, b_, c, is_causal=causal, implementation="cudnn")
            jit_fwd = jax.jit(ours)
            jit_fwd_bwd = jax.jit(lambda a, b_, c, g: jax.vjp(ours, a, b_, c)[1](g))
            cudnn_fwd = jax.jit(cudnn)
            cudnn_fwd_bwd = jax.jit(lambda a, b_, c, g: jax.vjp(cudnn, a, b_, c)[1](g))
            times = {
                "eager forward": timing.time_cuda(lambda: cuattn.attention(q, k, v, causal=causal)),
                "eager-host forward": timing.time_synced(lambda: cuattn.attention(q, k, v, causal=causal), sync),
                "jit forward": timing.time_synced(lambda: jit_fwd(jq, jk, jv), ready),
                "jax-cudnn forward": timing.time_synced(lambda: cudnn_fwd(jq, jk, jv), ready),
                "eager forward+backward": timing.time_cuda(eager_fwd_bwd),
                "eager-host forward+backward": timing.time_synced(eager_fwd_bwd, sync),
                "jit forward+backward": timing.time_synced(lambda: jit_fwd_bwd(jq, jk, jv, jdo), ready),
                "jax-cudnn forward+backward": timing.time_synced(lambda: cudnn_fwd_bwd(jq, jk, jv, jdo), ready),
            }
            flops = timing.attention_flops(b, h, n, n, d, causal)
            for name, ms in times.items():
                total = flops * (1 + timing.BACKWARD_FLOP_RATIO) if "backward" in name else flops
                row = dict(seqlen=n, batch=b, heads=h, head_dim=d, causal=causal, run=name, ms=ms,
                           tflops=total / ms / 1e9)
                rows.append(row)
                print(f"N={n:6d} {'causal' if causal else 'full  '} {name:28s} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s",
                      flush=True)
            for what in ("forward", "forward+backward"):
                print(f"N={n:6d} {'causal' if causal else 'full  '} jit / eager {what}: "
                      f"{times['jit ' + what] / times['eager ' + what]:.3f} (host clock both: "
                      f"{times['jit ' + what] / times['eager-host ' + what]:.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
