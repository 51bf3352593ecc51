"""Packaging: kernel sources found in every install form, the license metadata, and a README
whose Layout section names every tracked file.

The installed wheel itself is exercised by `.ci/run` (scripts/smoke_installed.py from outside
the checkout); these tests cover the same rules without building one: a package folder laid out
as a wheel lays it out, run in a fresh interpreter from a folder outside the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuattn import _jit

ROOT = Path(__file__).resolve().parent.parent


def _run_outside(site: Path, code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "CUATTN_SOURCE_DIR"}
    environment.update(PYTHONPATH=str(site), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env=environment, timeout=120)


@pytest.fixture
def wheel_layout(tmp_path) -> Path:
    """site/cuattn/ with the sources in site/cuattn/cuda_src/, as pip installs the wheel."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "cuattn", site / "cuattn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "cuda_src", site / "cuattn" / "cuda_src")
    (tmp_path / "elsewhere").mkdir()
    return site


def test_sources_resolve_inside_an_installed_package(wheel_layout):
    code = "import cuattn; from cuattn import _jit; print(cuattn.__file__); print(_jit.source_dir()); print(_jit.sources_hash())"
    done = _run_outside(wheel_layout, code, wheel_layout.parent / "elsewhere")
    assert done.returncode == 0, done.stderr
    package_file, sources, digest = done.stdout.split()
    assert Path(package_file).parent == wheel_layout / "cuattn", "imported the checkout, not the installed copy"
    assert Path(sources) == wheel_layout / "cuattn" / "cuda_src"
    # the cache key hashes every header, whatever the install form
    assert digest == _jit.sources_hash(ROOT / "cuda_src")


def test_source_dir_override_wins_over_the_installed_copy(wheel_layout, tmp_path):
    override = tmp_path / "my_sources"
    shutil.copytree(ROOT / "cuda_src", override)
    (override / "common.cuh").write_text((override / "common.cuh").read_text() + "\n// edited\n")
    code = "from cuattn import _jit; print(_jit.source_dir()); print(_jit.sources_hash())"
    done = _run_outside(wheel_layout, code, wheel_layout.parent / "elsewhere", CUATTN_SOURCE_DIR=str(override))
    assert done.returncode == 0, done.stderr
    sources, digest = done.stdout.split()
    assert Path(sources) == override and digest != _jit.sources_hash(ROOT / "cuda_src")


def test_missing_sources_name_both_places_and_the_override(wheel_layout):
    shutil.rmtree(wheel_layout / "cuattn" / "cuda_src")
    done = _run_outside(wheel_layout, "from cuattn import _jit; _jit.source_dir()", wheel_layout.parent / "elsewhere")
    assert done.returncode != 0
    assert re.search(r"FileNotFoundError: cuattn's kernel sources are missing: neither .*cuattn/cuda_src \(an installed "
                     r"wheel\) nor .*cuda_src \(a source checkout\) holds common.cuh; .*CUATTN_SOURCE_DIR", done.stderr), done.stderr


def test_checkout_resolves_its_own_sources(monkeypatch):
    monkeypatch.delenv("CUATTN_SOURCE_DIR", raising=False)
    assert _jit.source_dir() == ROOT / "cuda_src"


def test_license_is_apache_in_spdx_form_and_shipped():
    pyproject = (ROOT / "pyproject.toml").read_text()
    # the SPDX string form; the table form `license = { text = ... }` is deprecated by setuptools
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.M), "pyproject's license is not the SPDX string"
    assert re.search(r'^license-files = \["LICENSE"\]$', pyproject, re.M)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


# The folders the Layout section lists in full; the root line only names files that must exist.
LAYOUT_FOLDERS = ("cuattn/", "cuattn/bench/", "cuda_src/", "tests/", "tests/bench/", "examples/", "scripts/", "docs/", ".ci/")
# Build and cache litter that is never tracked.
UNTRACKED = re.compile(r"(^|/)(__pycache__|\.pytest_cache|\.hypothesis|\.benchmarks)(/|$)|\.pyc$")


def _files_in(folder: str) -> set[str]:
    """The files directly in one of the repository's folders (not its subfolders), by path."""
    return {f"{folder}{p.name}" for p in (ROOT / folder).iterdir()
            if p.is_file() and not UNTRACKED.search(f"{folder}{p.name}")}


def _layout_entries() -> dict[str, set[str]]:
    """README's Layout block as {folder: names}; a folder's lines go on until the next folder."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", readme, re.M | re.S)
    assert block, "README has no Layout section with a code block"
    entries: dict[str, set[str]] = {}
    folder = None
    for line in block.group(1).splitlines():
        head = re.match(r"^(\S+/)\s", line)
        if head:
            folder = head.group(1)
        assert folder, f"Layout line before any folder: {line!r}"
        # a name is a file name with an extension, or `run` under .ci/; parenthesised notes are prose
        prose_free = re.sub(r"\([^)]*\)", "", line[len(head.group(0)):] if head else line)
        names = re.findall(r"(?<![\w.])(\.?[\w-]+\.\w+|\.gitignore|LICENSE|run)(?![\w(])", prose_free)
        entries.setdefault(folder, set()).update(names)
    return entries


def test_readme_layout_names_every_file_and_nothing_else():
    entries = _layout_entries()
    assert sorted(set(entries) - set(LAYOUT_FOLDERS) - {"./"}) == [], "Layout lists folders this test does not know"
    for name in entries["./"]:
        assert (ROOT / name).is_file(), f"README's Layout names {name}, which is not in the repository's root"
    named = {folder + name for folder, names in entries.items() if folder != "./" for name in names}
    present = set().union(*(_files_in(folder) for folder in LAYOUT_FOLDERS))
    assert sorted(named - present) == [], "README's Layout names files the tree does not have"
    assert sorted(present - named) == [], "files missing from README's Layout"


def test_readme_states_the_requirements():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Requirements\n(.*?)^## ", readme, re.M | re.S)
    assert section, "README has no Requirements section"
    text = section.group(1)
    for fact in ("compute capability 8.0", "sm_80", "sm_90a", "H200", "cuattn[cuda12]", "cuattn[cuda13]",
                 "pip install .", "NoDeviceError", 'pytest -m "not compile_all"'):
        assert fact in text, f"Requirements does not say {fact!r}"


def _collected(*args: str) -> list[str]:
    """Test ids ``pytest --collect-only`` lists for ``args``, run from the checkout's root."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_split_the_suite_once_over():
    """--shard I/N (tests/conftest.py): N runs that together hold every test once, none twice, in
    a like mix (interleaved, so no shard takes one file's slow tests alone)."""
    target = "tests/test_params.py"
    whole = _collected(target)
    shards = [_collected(target, "--shard", f"{i}/3") for i in range(3)]
    assert len(whole) >= 6 and all(shards)
    assert sorted(sum(shards, [])) == sorted(whole)
    assert shards[1] == whole[1::3]
    for bad, message in (("3/3", "needs 0 <= I < N"), ("1", "takes I/N")):
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 target, "--shard", bad], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_torch_adapter_keeps_its_annotations_as_types():
    """torch.library.custom_op builds the ops' schemas from the annotations; torch 2.4 (the oldest
    torch the serving extra takes) reads them only as types, so cuattn/torch.py must not postpone
    them (with the future import its import failed on 2.4: "Parameter q has unsupported type")."""
    import ast

    tree = ast.parse((ROOT / "cuattn" / "torch.py").read_text())
    postponed = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module == "__future__" and any(alias.name == "annotations" for alias in node.names)]
    assert postponed == [], f"cuattn/torch.py postpones annotations at line {postponed}"
