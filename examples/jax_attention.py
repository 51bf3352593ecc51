"""A jitted JAX training loop through cuattn.jax.attention, against the same loop on jax.nn.dot_product_attention.

A one-layer causal self-attention model (projections to q, k, v in bfloat16, attention, output
projection) learns to output the running mean of its input sequence, y[t] = mean(x[0..t]),
by plain SGD on the mean squared error. Each step is one jax.jit of jax.value_and_grad: the
forward and backward of the attention run inside XLA's program (cuattn's kernels on a CUDA GPU,
the float64 reference on the CPU). The same model trained with jax.nn.dot_product_attention from
the same initial parameters must follow the same loss curve; both curves are printed.

Then the same model on sequences of different lengths packed into one (total, E) array, without
padding: cuattn.jax.attention_varlen over the prefix sums of the lengths, against
jax.nn.dot_product_attention with a block-diagonal causal mask over the packed tokens.

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
# the packed run's sequence lengths (odd, one of a single token)
PACKED_LENGTHS = (33, 5, 20, 1, 17, 9)
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
    """x (..., S, E) float32 -> (..., S, E); attention on (..., S, H, D) bfloat16 heads (a batch
    (B, S, E), or packed sequences (total, E))."""

    def heads(w):
        return (x @ w).reshape(*x.shape[:-1], HEADS, HEAD_DIM).astype(jnp.bfloat16)

    out = attend(heads(params["wq"]), heads(params["wk"]), heads(params["wv"]))
    return out.astype(jnp.float32).reshape(*x.shape[:-1], HEADS * HEAD_DIM) @ params["wo"]


def cuattn_attend(q, k, v):
    return cuattn.jax.attention(q, k, v, causal=True)


def reference_attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def packed_attends(lengths):
    """cuattn.jax.attention_varlen over packed sequences of ``lengths``, and the same attention by
    jax.nn.dot_product_attention with a block-diagonal causal mask (a token sees the earlier
    tokens of its own sequence); also each packed token's sequence start."""
    cu_seqlens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.asarray(lengths, jnp.int32))])
    segment = jnp.repeat(jnp.arange(len(lengths)), jnp.asarray(lengths), total_repeat_length=sum(lengths))
    position = jnp.arange(sum(lengths))
    mask = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])

    def ours(q, k, v):  # (total, H, D)
        return cuattn.jax.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max(lengths), max(lengths), causal=True)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q[None], k[None], v[None], mask=mask[None, None])[0]

    return ours, theirs, cu_seqlens[segment]


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


def compare(title, ours, theirs, function):
    """Print both loss curves; exit with a message if they part or the loss does not fall."""
    print(title)
    print(f"{'step':>4}  {function:>27}  {'jax.nn':>12}")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i:>4}  {a:>27.6f}  {b:>12.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    print(f"largest relative difference between the curves: {worst:.2e} (allowed {CURVE_RTOL:.0e})")
    if worst > CURVE_RTOL:
        sys.exit(f"jax_attention: the loss curve through {function} differs from jax.nn.dot_product_attention's")
    if not ours[-1] < ours[0]:
        sys.exit(f"jax_attention: the loss through {function} did not decrease")


def main():
    key_params, key_data, key_packed = jax.random.split(jax.random.PRNGKey(0), 3)
    params = init(key_params)
    x = jax.random.normal(key_data, (BATCH, SEQ, EMBED))
    # the running mean: what uniform causal attention over an identity value projection computes
    y = jnp.cumsum(x, axis=1) / jnp.arange(1, SEQ + 1)[None, :, None]
    path = "cuattn kernels" if jax.default_backend() == "gpu" else "float64 reference on the CPU"
    compare(f"one-layer causal attention, B={BATCH} S={SEQ} H={HEADS} D={HEAD_DIM}, bfloat16, SGD; "
            f"cuattn.jax runs the {path}", train(cuattn_attend, params, x, y), train(reference_attend, params, x, y),
            "cuattn.jax.attention")

    # packed sequences: each token's target is the running mean over its own sequence
    ours, theirs, starts = packed_attends(PACKED_LENGTHS)
    x = jax.random.normal(key_packed, (sum(PACKED_LENGTHS), EMBED))
    totals = jnp.cumsum(x, axis=0)
    before = jnp.where((starts > 0)[:, None], totals[starts - 1], 0.0)
    y = (totals - before) / (jnp.arange(x.shape[0]) - starts + 1)[:, None]
    compare(f"\nthe same model on {len(PACKED_LENGTHS)} packed sequences of lengths {PACKED_LENGTHS}",
            train(ours, params, x, y), train(theirs, params, x, y), "cuattn.jax.attention_varlen")


if __name__ == "__main__":
    main()
