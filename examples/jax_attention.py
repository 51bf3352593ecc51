"""A jitted JAX training loop through cuattn.jax.attention, against the same loop on jax.nn.dot_product_attention.

A one-layer causal self-attention model (projections to q, k, v in bfloat16, attention, output
projection) learns to output the running mean of its input sequence, y[t] = mean(x[0..t]),
by plain SGD on the mean squared error. Each step is one jax.jit of jax.value_and_grad: the
forward and backward of the attention run inside XLA's program (cuattn's kernels on a CUDA GPU,
the float64 reference on the CPU). The same model trained with jax.nn.dot_product_attention from
the same initial parameters must follow the same loss curve; both curves are printed.

    python examples/jax_attention.py
"""

import importlib.util
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if importlib.util.find_spec("jax") is None:
    sys.exit("examples/jax_attention.py needs jax (not found): pip install jax (jax[cuda12] or jax[cuda13] for a GPU)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cuattn.jax  # noqa: E402

BATCH, SEQ, EMBED, HEADS, HEAD_DIM = 8, 33, 64, 2, 64
STEPS, LEARNING_RATE = 12, 0.5
# The two curves differ only by the rounding of the bfloat16 attention output (2e-4 apart on the
# CPU); dQ off by 30% moves them 8e-3 apart within these steps, a missing dK 3e-2.
CURVE_RTOL = 5e-3


def init(key):
    """Projections scaled so that the scores start of order one."""
    keys = jax.random.split(key, 4)
    inner = HEADS * HEAD_DIM
    return {
        "wq": jax.random.normal(keys[0], (EMBED, inner)) / jnp.sqrt(EMBED),
        "wk": jax.random.normal(keys[1], (EMBED, inner)) / jnp.sqrt(EMBED),
        "wv": jax.random.normal(keys[2], (EMBED, inner)) / jnp.sqrt(EMBED),
        "wo": jax.random.normal(keys[3], (inner, EMBED)) / jnp.sqrt(inner),
    }


def model(params, x, attend):
    """x (B, S, E) float32 -> (B, S, E); attention on (B, S, H, D) bfloat16 heads."""
    batch, seq, _ = x.shape

    def heads(w):
        return (x @ w).reshape(batch, seq, HEADS, HEAD_DIM).astype(jnp.bfloat16)

    out = attend(heads(params["wq"]), heads(params["wk"]), heads(params["wv"]))
    return out.astype(jnp.float32).reshape(batch, seq, HEADS * HEAD_DIM) @ params["wo"]


def cuattn_attend(q, k, v):
    return cuattn.jax.attention(q, k, v, causal=True)


def reference_attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def train(attend, params, x, y):
    """Losses of STEPS jitted SGD steps (each loss measured before its update)."""

    def loss_fn(params):
        return jnp.mean((model(params, x, attend) - y) ** 2)

    @jax.jit
    def step(params):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss

    losses = []
    for _ in range(STEPS):
        params, loss = step(params)
        losses.append(float(loss))
    return losses


def main():
    key_params, key_data = jax.random.split(jax.random.PRNGKey(0))
    params = init(key_params)
    x = jax.random.normal(key_data, (BATCH, SEQ, EMBED))
    # the running mean: what uniform causal attention over an identity value projection computes
    y = jnp.cumsum(x, axis=1) / jnp.arange(1, SEQ + 1)[None, :, None]

    ours = train(cuattn_attend, params, x, y)
    theirs = train(reference_attend, params, x, y)
    path = "cuattn kernels" if jax.default_backend() == "gpu" else "float64 reference on the CPU"
    print(f"one-layer causal attention, B={BATCH} S={SEQ} H={HEADS} D={HEAD_DIM}, bfloat16, SGD; "
          f"cuattn.jax runs the {path}")
    print(f"{'step':>4}  {'cuattn.jax':>12}  {'jax.nn':>12}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    print(f"largest relative difference between the curves: {worst:.2e} (allowed {CURVE_RTOL:.0e})")
    if worst > CURVE_RTOL:
        sys.exit("jax_attention: the loss curve through cuattn.jax differs from jax.nn.dot_product_attention's")
    if not ours[-1] < ours[0]:
        sys.exit("jax_attention: the loss did not decrease")


if __name__ == "__main__":
    main()
