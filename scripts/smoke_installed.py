"""Smoke test of an installed cuattn: what a user of the wheel meets first.

Run by `.ci/run` with the Python of a fresh virtual environment that installed the wheel, from a
folder outside the checkout, so that `import cuattn` finds the installed package and nothing of
the source tree. Checks, in order:

1. the imported package lives in site-packages, not in a checkout;
2. the kernel sources resolve inside it (`cuattn/cuda_src/`) and the LICENSE ships with it;
3. `python -m cuattn info` runs and reports the kernel sources and the device (or why there is none);
4. `python -m cuattn build --arch sm_90a --kernels cache_write_kernel` compiles one small kernel
   family with NVRTC (no GPU needed) into cubins that hold their whole ELF image, and
   `python -m cuattn cache --prune` finds them current (the installed sources' keys) and removes none;
5. `cuattn.attention` on NumPy arrays equals a float64 softmax(q k^T / sqrt(D)) v;
6. where a GPU is present, the same call on CuPy float16 arrays runs the installed kernels
   (compiled from the installed sources) and agrees; elsewhere it prints why it did not run.

Exits 1 with the failed check's message; prints one line per check otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

# one small family, fast to compile, enough to prove NVRTC finds the sources and the CUDA headers
SMOKE_ARCH = "sm_90a"
SMOKE_KERNELS = "cache_write_kernel"


def check(condition: bool, message: str) -> None:
    if not condition:
        print(f"smoke test FAILED: {message}", file=sys.stderr)
        sys.exit(1)


def run_cli(*args: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "cuattn", *args], capture_output=True, text=True, env=env)
    check(done.returncode == 0, f"python -m cuattn {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def main() -> None:
    import cuattn
    from cuattn import _jit

    package = Path(cuattn.__file__).resolve().parent
    check("site-packages" in package.parts, f"cuattn was imported from {package}, not from an installed wheel")
    print(f"ok  imported from {package}")

    sources = _jit.source_dir()
    check(sources == package / "cuda_src", f"kernel sources resolve to {sources}, not inside the package")
    check((sources / "common.cuh").is_file(), f"{sources} holds no common.cuh")
    files = [str(f) for f in metadata.files("cuattn") or ()]
    check(any(f.endswith("LICENSE") for f in files), f"no LICENSE among the installed files: {files}")
    print(f"ok  kernel sources in {sources}; LICENSE installed")

    env = {**os.environ, "CUATTN_CACHE_DIR": tempfile.mkdtemp(prefix="cuattn-smoke-cache-")}
    env.pop("CUATTN_SOURCE_DIR", None)
    info = run_cli("info", env=env)
    check(str(sources) in info and "device" in info, f"info does not report the sources and the device:\n{info}")
    print("ok  python -m cuattn info")

    built = run_cli("build", "--arch", SMOKE_ARCH, "--kernels", SMOKE_KERNELS, env=env)
    check(SMOKE_KERNELS in built and "0 failed or spilled" in built, f"build did not compile {SMOKE_KERNELS}:\n{built}")
    cubins = sorted(Path(env["CUATTN_CACHE_DIR"]).glob("nvrtc-*/*.cubin"))
    cut = [f.name for f in cubins if _jit.elf_extent(f.read_bytes()) != f.stat().st_size]
    check(bool(cubins) and not cut, f"cached cubins short of their ELF image: {cut or 'no cubin written'}")
    print(f"ok  python -m cuattn build --arch {SMOKE_ARCH} --kernels {SMOKE_KERNELS} ({len(cubins)} whole cubins)")

    pruned = run_cli("cache", "--prune", env=env)
    check("removed 0 cached kernels" in pruned and " 0 stale" in pruned,
          f"cache --prune removed or counted as stale what build just compiled:\n{pruned}")
    print("ok  python -m cuattn cache --prune keeps the kernels build compiled")

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 33, 4, 64)) for _ in range(3))
    out = cuattn.attention(q, k, v)
    scores = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(64)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhij,bjhd->bihd", probs / probs.sum(-1, keepdims=True), v)
    check(out.dtype == np.float64 and out.shape == q.shape, f"attention returned {out.dtype} {out.shape}")
    error = float(np.abs(out - expected).max())
    check(error < 1e-12, f"NumPy attention differs from a float64 softmax by {error}")
    print(f"ok  NumPy attention equals a float64 softmax (max error {error:.1e})")

    reason = _jit.gpu_unavailable_reason()
    if reason is not None:
        print(f"--  no GPU kernel run: {reason}")
        return
    import cupy

    q16, k16, v16 = (cupy.asarray(x.astype(np.float16)) for x in (q, k, v))
    got = cuattn.attention(q16, k16, v16).get().astype(np.float64)
    error = float(np.abs(got - expected).max())
    # float16 inputs and output: a few units in the last place of values of order 1
    check(error < 1e-2, f"the GPU kernel differs from a float64 softmax by {error}")
    print(f"ok  GPU attention on {cuattn.info()['device']} (max error {error:.1e})")


if __name__ == "__main__":
    main()
