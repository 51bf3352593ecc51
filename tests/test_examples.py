"""Every example runs to completion (on the CPU path here; on the GPU where there is one)."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import import_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
# these need a framework's CUDA build; the others fall back to the CPU reference path
GPU_ONLY = {"torch_training.py"}
# these import frameworks that run on the CPU too: the test extra installs jax (from Python 3.11:
# import_jax), torch and transformers come with the serving extra (without them the example skips)
FRAMEWORK = {"jax_attention.py": ("jax",), "serving.py": ("torch", "transformers")}
EXAMPLES = [
    pytest.param(path, id=path.name, marks=[pytest.mark.gpu] if path.name in GPU_ONLY else [])
    for path in sorted((ROOT / "examples").glob("*.py"))
]


@pytest.mark.parametrize("path", EXAMPLES)
def test_example_runs(path):
    for module in FRAMEWORK.get(path.name, ()):
        if module == "jax":
            import_jax(module)
        else:
            pytest.importorskip(module)
    # the checkout must be importable also where cuattn is not installed (the GPU machine)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip(), "an example should say what it did"
