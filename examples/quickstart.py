"""cuattn quickstart: exact attention on whatever this machine has.

With a CUDA GPU (and CuPy) it runs the tensor-core kernels on CuPy arrays and checks them
against the float64 reference; on a machine without one it runs the same call on NumPy arrays,
which takes the float64 reference path on the CPU.

    python examples/quickstart.py
"""

import numpy as np

import cuattn


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def main():
    rng = np.random.default_rng()
    # (batch, seqlen, heads, head_dim); 8 query heads share 2 key/value heads (GQA)
    q = rng.standard_normal((2, 300, 8, 64), dtype=np.float32).astype(np.float16)
    k = rng.standard_normal((2, 300, 2, 64), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((2, 300, 2, 64), dtype=np.float32).astype(np.float16)
    expected, expected_lse = cuattn.reference.attention(q, k, v, causal=True, return_lse=True)

    if gpu_available():
        import cupy

        out, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True, return_lse=True)
        out, lse = out.get(), lse.get()
        where = f"GPU kernels on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    else:
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        where = "no GPU here: NumPy inputs ran the float64 reference on the CPU"

    err = np.abs(out.astype(np.float64) - expected).max()
    lse_err = np.abs(lse - expected_lse).max()
    print(f"cuattn.attention: out {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype} ({where})")
    print(f"max |out - float64 reference| = {err:.2e}, max |lse - reference| = {lse_err:.2e}")
    if not (err < 1e-2 and lse_err < 1e-2):
        raise SystemExit("quickstart: result differs from the reference")


if __name__ == "__main__":
    main()
