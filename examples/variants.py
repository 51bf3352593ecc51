"""Attention variants of today's models, each checked against float64.

- **gpt-oss**: a learnable attention-sink logit per head (`sinks`) on a 128-token sliding window,
  GQA 64/8, D = 64. The forward, then `cuattn.attention_backward(..., sinks=sinks)`, which also
  returns the sinks' gradient `dsinks`; that gradient is checked against central differences of
  the float64 reference's loss.
- **BLOOM / MPT**: ALiBi, `alibi_slopes` with the geometric slopes 2^(-8 i / H) of the ALiBi
  paper, causal; the backward takes the same slopes (they get no gradient).
- **DeepSeek prefill (MLA)**: q and k with D = 192, v with Dv = 128; out comes Dv wide.
- **ViT-H**: D = 80, no mask, 257 tokens (16 x 16 patches and a class token).

With a CUDA GPU (CuPy) each runs on the GPU kernels; without one, NumPy arrays run the float64
reference on the CPU (the same calls, the same rules).

    python examples/variants.py
"""

import numpy as np

import cuattn

# each result's largest difference from the float64 reference, over the largest magnitude of
# that reference: fp16 inputs and outputs, fp32 accumulation
RELATIVE_BOUND = 1e-2
# central differences of the float64 loss: step and agreement with the kernels' dsinks
SINK_STEP, SINK_BOUND = 1e-3, 2e-2


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi paper's slopes: 2^(-8 i / H), i = 1 .. H, for a power-of-two head count H; otherwise
    those of the power of two P below H, then every other slope of 2P's (as ALiBi models ship them)."""
    if num_heads & (num_heads - 1) == 0:
        return (2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)).astype(np.float32)
    below = 1 << (num_heads.bit_length() - 1)
    return np.concatenate([alibi_slopes(below), alibi_slopes(2 * below)[0::2][: num_heads - below]])


class Runner:
    """Runs cuattn on the GPU (CuPy arrays) when there is one, else on NumPy arrays, and checks
    every result against the float64 reference."""

    def __init__(self, rng):
        self.rng = rng
        self.gpu = gpu_available()
        self.xp = np
        if self.gpu:
            import cupy

            self.xp = cupy
        self.ok = True

    def randn(self, *shape) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float16)

    def device(self, *arrays):
        return [self.xp.asarray(x) for x in arrays]

    def host(self, x) -> np.ndarray:
        return (x.get() if self.gpu else x).astype(np.float64)

    def check(self, name: str, got, expected) -> None:
        err = float(np.abs(self.host(got) - expected).max() / np.abs(expected).max())
        self.ok &= err < RELATIVE_BOUND
        print(f"  {name:44s} max error / max |reference| {err:.1e}")


def gpt_oss(run: Runner) -> None:
    b, s, hq, hk, d, window = 1, 384, 64, 8, 64, 128
    q, k, v, dout = run.randn(b, s, hq, d), run.randn(b, s, hk, d), run.randn(b, s, hk, d), run.randn(b, s, hq, d)
    sinks = run.rng.standard_normal(hq).astype(np.float32)
    options = dict(causal=True, window=(window - 1, 0))  # each token sees itself and the 127 before it
    out, lse = cuattn.attention(*run.device(q, k, v), sinks=run.xp.asarray(sinks), return_lse=True, **options)
    dq, dk, dv, dsinks = cuattn.attention_backward(*run.device(dout, q, k, v), out, lse, sinks=run.xp.asarray(sinks),
                                                   **options)
    ref_out, ref_lse = cuattn.reference.attention(q, k, v, sinks=sinks, return_lse=True, **options)
    run.check("gpt-oss: sinks + 128-token window, out", out, ref_out)
    # dq, dk, dv against the float64 backward of the float64 forward
    ref_grads = cuattn.reference.attention_backward(dout, q, k, v, ref_out, ref_lse, sinks=sinks, **options)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        run.check(f"gpt-oss: {name}", got, want)

    # dsinks against central differences of the float64 loss sum(out * dout), a few heads
    def loss(sink_values):
        return float(np.sum(cuattn.reference.attention(q, k, v, sinks=sink_values, **options) * dout))

    heads = [0, 17, 63]
    numeric = []
    for h in heads:
        up, down = sinks.astype(np.float64), sinks.astype(np.float64)
        up[h] += SINK_STEP
        down[h] -= SINK_STEP
        numeric.append((loss(up) - loss(down)) / (2 * SINK_STEP))
    got = run.host(dsinks)[heads]
    err = float(np.abs(got - numeric).max() / np.abs(numeric).max())
    run.ok &= err < SINK_BOUND
    print(f"  {'gpt-oss: dsinks against central differences':44s} max error / max |difference| {err:.1e}")


def alibi(run: Runner) -> None:
    b, s, h, d = 2, 300, 16, 128
    q, k, v, dout = (run.randn(b, s, h, d) for _ in range(4))
    slopes = alibi_slopes(h)
    out, lse = cuattn.attention(*run.device(q, k, v), causal=True, alibi_slopes=run.xp.asarray(slopes),
                                return_lse=True)
    dq, dk, dv = cuattn.attention_backward(*run.device(dout, q, k, v), out, lse, causal=True,
                                           alibi_slopes=run.xp.asarray(slopes))
    ref_out, ref_lse = cuattn.reference.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    run.check("BLOOM / MPT: ALiBi, causal, out", out, ref_out)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), cuattn.reference.attention_backward(
            dout, q, k, v, ref_out, ref_lse, causal=True, alibi_slopes=slopes)):
        run.check(f"BLOOM / MPT: {name}", got, want)


def deepseek_mla(run: Runner) -> None:
    b, s, hq, hk = 1, 256, 16, 16
    q, k, v = run.randn(b, s, hq, 192), run.randn(b, s, hk, 192), run.randn(b, s, hk, 128)
    out = cuattn.attention(*run.device(q, k, v), causal=True)
    assert out.shape == (b, s, hq, 128), out.shape
    run.check("DeepSeek prefill: D = 192, Dv = 128, out", out, cuattn.reference.attention(q, k, v, causal=True))


def vit_h(run: Runner) -> None:
    b, s, h, d = 4, 257, 16, 80
    q, k, v = (run.randn(b, s, h, d) for _ in range(3))
    out = cuattn.attention(*run.device(q, k, v))
    run.check("ViT-H: D = 80, 257 tokens, out", out, cuattn.reference.attention(q, k, v))


def main():
    run = Runner(np.random.default_rng(0))
    print("attention variants " + ("on the GPU" if run.gpu else "(no GPU here: NumPy inputs run the float64 "
                                   "reference on the CPU)"))
    for model in (gpt_oss, alibi, deepseek_mla, vit_h):
        model(run)
    if not run.ok:
        raise SystemExit("variants example: a result is past its bound")


if __name__ == "__main__":
    main()
