"""Forward and backward of cuattn on JAX arrays, eagerly, through DLPack (no copies).

Computes attention and its gradients with cuattn's kernels on jax.Array inputs and checks them
against jax.vjp of a plain jnp implementation. Needs JAX with a CUDA GPU.

    python examples/jax_attention.py
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402


def jnp_attention(q, k, v):
    """(B, S, H, D) causal attention in float32, the reference for jax.vjp."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, dout = (jax.random.normal(key, (2, 256, 4, 64), jnp.float32).astype(jnp.bfloat16) for key in keys)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert isinstance(dq, jax.Array) and dq.dtype == jnp.bfloat16

    ref_out, vjp = jax.vjp(jnp_attention, *(x.astype(jnp.float32) for x in (q, k, v)))
    ref_grads = vjp(dout.astype(jnp.float32))
    errors = [float(jnp.abs(a.astype(jnp.float32) - b).max()) for a, b in zip((out, dq, dk, dv), (ref_out, *ref_grads))]
    print("max |cuattn - jax.vjp reference|: out {:.2e}, dq {:.2e}, dk {:.2e}, dv {:.2e}".format(*errors))
    if max(errors) > 0.1:
        sys.exit("jax_attention: cuattn's gradients differ from jax.vjp")


if __name__ == "__main__":
    main()
