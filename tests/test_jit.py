"""The NVRTC loader: compile-only builds for sm_80 and sm_90a, the cache key, errors, the CLI.

Compiling needs NVRTC (CuPy and the NVRTC wheel) but no GPU, so these run on CPU CI; they are
what keeps a kernel that fails to compile or spills registers from ever reaching the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import cuattn
from cuattn import _jit, _tools

attention_module = importlib.import_module("cuattn.attention")  # the module, not the function

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="compiling needs CuPy's NVRTC bindings")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A private copy of cuda_src/ that a test may edit."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(_jit.source_dir(), copy)
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(copy))
    return copy


@pytest.mark.compile_all
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_variant_compiles_without_spills(arch, cache):
    rows = cuattn.build(arch)
    assert len(rows) == len(_tools.kernel_variants(arch))
    bad = [(r.kernel, r.error or ("wgmma serialized (C75xx)" if r.wgmma_serialized else
                                  f"{r.spill_store_bytes}/{r.spill_load_bytes} bytes spilled")) for r in rows if not r.ok]
    assert not bad, bad
    for row in rows:
        assert 0 < row.registers <= 255
        assert row.ctas_per_sm >= 1, f"{row.kernel} does not fit on an SM"


def test_cache_key_follows_every_header(sources, cache):
    spec = _tools.kernel_variants("sm_80")[0]
    before = _jit.cache_key(spec, "sm_80")
    first = _jit.compile_kernel(spec, "sm_80")
    assert not first.cached
    assert _jit.compile_kernel(spec, "sm_80").cached
    # an edit to a header only reached through #include must change the key and force a rebuild
    with open(sources / "common.cuh", "a") as header:
        header.write("\n// touched by test_cache_key_follows_every_header\n")
    assert _jit.cache_key(spec, "sm_80") != before
    rebuilt = _jit.compile_kernel(spec, "sm_80")
    assert not rebuilt.cached
    assert rebuilt.cubin_path != first.cubin_path


def test_cache_key_follows_its_own_source_file_only(sources, cache):
    """An edit to one .cu file changes the keys of its variants, not those of another file's."""
    variants = _tools.kernel_variants("sm_80")
    decode = next(spec for spec in variants if spec.source == "decode.cu")
    backward = next(spec for spec in variants if spec.source == "flash_bwd.cu")
    before = {spec: _jit.cache_key(spec, "sm_80") for spec in (decode, backward)}
    with open(sources / "flash_bwd.cu", "a") as source:
        source.write("\n// touched by test_cache_key_follows_its_own_source_file_only\n")
    assert _jit.cache_key(backward, "sm_80") != before[backward]
    assert _jit.cache_key(decode, "sm_80") == before[decode]


def test_cache_key_follows_a_variants_own_options(cache):
    """KernelSpec.options reach the cache key (a variant built with other ptxas options is another
    cubin), and every Hopper forward variant carries FWD_SM90_PTXAS_OPTIONS."""
    hopper = [s for s in _tools.kernel_variants("sm_90a") if "flash_fwd_sm90_kernel<" in s.name]
    assert hopper and all(s.options == attention_module.FWD_SM90_PTXAS_OPTIONS for s in hopper)
    spec = hopper[0]
    assert _jit.cache_key(dataclasses.replace(spec, options=()), "sm_90a") != _jit.cache_key(spec, "sm_90a")


def test_cache_key_separates_arch_and_variant(cache):
    a, b = _tools.kernel_variants("sm_80")[:2]
    keys = {_jit.cache_key(a, "sm_80"), _jit.cache_key(a, "sm_90a"), _jit.cache_key(b, "sm_80")}
    assert len(keys) == 3


def test_compile_error_carries_kernel_options_and_log(sources, cache):
    (sources / "broken.cu").write_text("template <int N> __global__ void broken_kernel() { undeclared_name = N; }\n")
    spec = _jit.KernelSpec("broken.cu", "broken_kernel<3>")
    with pytest.raises(cuattn.CompileError, match=r"(?s)broken_kernel<3>.*-arch=sm_80.*undeclared_name") as info:
        _jit.compile_kernel(spec, "sm_80")
    assert info.value.kernel == "broken_kernel<3>"
    assert "-arch=sm_80" in info.value.options
    assert "undeclared_name" in info.value.log


def test_sm90a_only_kernels_are_not_built_for_other_targets(cache):
    spec = _jit.KernelSpec("flash_fwd.cu", "x", needs_sm90a=True)
    with pytest.raises(ValueError, match=r"kernel x uses sm_90a instructions; cannot build it for sm_80"):
        _jit.compile_kernel(spec, "sm_80")


def test_compile_is_logged(cache, caplog):
    spec = _tools.kernel_variants("sm_80")[1]
    with caplog.at_level("INFO", logger="cuattn"):
        _jit.compile_kernel(spec, "sm_80", use_cache=False)
    assert any(spec.name in r.getMessage() and "sm_80" in r.getMessage() for r in caplog.records)


def test_parse_resources_reads_ptxas_report():
    log = (
        "ptxas info    : Compiling entry function '_Z3fooi' for 'sm_80'\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 96 registers, used 1 barriers, 2048 bytes smem, 380 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function '_Z3bari' for 'sm_80'\n"
        "ptxas info    : Used 10 registers\n"
    )
    res = _jit.parse_resources(log, "_Z3fooi")
    assert res == _jit.Resources(96, 8, 4, 12, 2048) and res.spills
    assert _jit.parse_resources(log, "_Z3bari").registers == 10
    assert _jit.parse_resources(log, "_Z3bazi") is None


def test_parse_resources_reads_serialized_wgmma():
    """ptxas's notes that it serialised a kernel's wgmma (C7520, C7514, ...) mark that kernel alone, and
    fail its build row."""
    log = (
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
        "to program dependence on compiler-inserted WG.AR in divergent path in the function '_Z3fooi'\n"
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
        "to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the "
        "pipeline stage in the function '_Z3bazi'\n"
        "ptxas info    : Compiling entry function '_Z3fooi' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
        "ptxas info    : Compiling entry function '_Z3bari' for 'sm_90a'\n"
        "ptxas info    : Used 168 registers\n"
    )
    assert _jit.parse_resources(log, "_Z3fooi").wgmma_serialized
    assert not _jit.parse_resources(log, "_Z3bari").wgmma_serialized
    assert _jit.parse_resources(log + "ptxas info    : Compiling entry function '_Z3bazi' for 'sm_90a'\n"
                                "ptxas info    : Used 100 registers\n", "_Z3bazi").wgmma_serialized
    row = _tools.BuildRow("foo", "sm_90a", 168, 0, 0, 0, 0, 0, 1, 0.0, wgmma_serialized=True)
    assert not row.ok and "wgmma serialized" in _tools.format_build_table([row])


def test_a_cached_kernel_reads_serialized_wgmma_from_its_log(cache):
    """A cache entry keeps ptxas's log: the flag comes from it on load, also for entries written
    before the flag existed."""
    spec = _tools.kernel_variants("sm_80")[0]
    compiled = _jit.compile_kernel(spec, "sm_80")
    assert not compiled.resources.wgmma_serialized
    meta_path = compiled.cubin_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["resources"].pop("wgmma_serialized", None)
    meta["log"] += ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
                    f"serialized due to a reason in the function '{compiled.lowered_name}'\n")
    meta_path.write_text(json.dumps(meta))
    loaded = _jit.compile_kernel(spec, "sm_80")
    assert loaded.cached and loaded.resources.wgmma_serialized


def test_a_missing_resource_report_keeps_the_cubin_and_says_so(cache, monkeypatch, caplog):
    """A compile whose log lacks ptxas's report (seen from NVRTC on the H200) keeps its cubin, warns,
    and shows in `cuattn build` as an error row, so the spill check cannot pass on it silently."""
    monkeypatch.setattr(_jit, "parse_resources", lambda log, name: None)
    spec = _tools.kernel_variants("sm_80")[2]
    with caplog.at_level("WARNING", logger="cuattn"):
        compiled = _jit.compile_kernel(spec, "sm_80", use_cache=False)
    assert compiled.cubin_path.is_file() and compiled.resources.registers == 0
    assert any("no resource report" in r.getMessage() for r in caplog.records)
    rows = cuattn.build("sm_80", kernels=spec.name)
    assert rows and all("no resource report" in row.error and not row.ok for row in rows)


def _headers_end(image: bytes) -> int:
    """Where an ELF64 image's program and section header tables end, read straight from its header."""
    ph_offset, sh_offset = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", image, 0x36)
    return max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)


def test_a_cached_cubin_holds_its_whole_elf_image(cache):
    """CuPy's getCUBIN drops the image's last byte; the cache keeps the whole image, so that
    cuobjdump and nvdisasm read it and the driver is given every byte its headers name."""
    for arch in ("sm_80", "sm_90a"):
        spec = next(s for s in _tools.kernel_variants(arch) if s.needs_sm90a == (arch == "sm_90a"))
        image = _jit.compile_kernel(spec, arch).cubin_path.read_bytes()
        assert image.startswith(b"\x7fELF")
        assert len(image) == _headers_end(image) == _jit.elf_extent(image)


def test_a_cubin_cut_short_by_an_older_cuattn_is_completed_on_load(cache):
    spec = _tools.kernel_variants("sm_80")[0]
    compiled = _jit.compile_kernel(spec, "sm_80")
    whole = compiled.cubin_path.read_bytes()
    compiled.cubin_path.write_bytes(whole[:-1])
    assert _jit.compile_kernel(spec, "sm_80").cached
    assert compiled.cubin_path.read_bytes() == whole


def test_a_short_cubin_in_a_cache_it_cannot_write_still_loads(cache, monkeypatch):
    spec = _tools.kernel_variants("sm_80")[0]
    compiled = _jit.compile_kernel(spec, "sm_80")
    short = compiled.cubin_path.read_bytes()[:-1]
    compiled.cubin_path.write_bytes(short)

    def refuse(path, data):
        raise PermissionError(f"read-only cache: {path}")

    monkeypatch.setattr(_jit, "_atomic_write", refuse)
    assert _jit.compile_kernel(spec, "sm_80").cached
    assert compiled.cubin_path.read_bytes() == short


def test_whole_cubin_restores_only_the_dropped_zero_tail():
    image = bytearray(b"\x7fELF\x02\x01" + bytes(122))
    struct.pack_into("<QQ", image, 0x20, 64, 0)  # one program header right after the ELF header
    struct.pack_into("<HHHH", image, 0x36, 64, 1, 64, 0)
    assert _jit.elf_extent(bytes(image)) == 128
    assert _jit.whole_cubin(bytes(image[:-1])) == bytes(image)
    assert _jit.whole_cubin(bytes(image)) == bytes(image)  # a CuPy that returns every byte
    assert _jit.whole_cubin(bytes(image) + bytes(8)) == bytes(image) + bytes(8)  # padding past the tables
    assert _jit.whole_cubin(bytes(image[:-40])) is None  # more than the zero tail is missing
    assert _jit.whole_cubin(b"not an ELF image") == b"not an ELF image"  # nothing to tell by


def test_a_cubin_cut_shorter_than_cupy_cuts_is_a_compile_error(cache, monkeypatch):
    real = _jit._nvrtc()

    class ShortCubins:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def getCUBIN(prog):
            return real.getCUBIN(prog)[:-64]

    monkeypatch.setattr(_jit, "_nvrtc", ShortCubins)
    spec = _tools.kernel_variants("sm_80")[0]
    with pytest.raises(cuattn.CompileError, match="cut short of its ELF headers' extent"):
        _jit.compile_kernel(spec, "sm_80", use_cache=False)


def test_build_refuses_an_unknown_kernel_filter(cache):
    with pytest.raises(ValueError, match=r"no kernel variant matches \['no_such_kernel'\]"):
        cuattn.build("sm_80", kernels="no_such_kernel")


def test_cli_build_and_info(cache):
    run = subprocess.run(
        [sys.executable, "-m", "cuattn", "build", "--arch", "sm_80", "--kernels", "__half, 64,"],
        capture_output=True, text=True, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "flash_fwd_kernel<__half, 64," in run.stdout and "0 failed or spilled" in run.stdout
    info = subprocess.run([sys.executable, "-m", "cuattn", "info"], capture_output=True, text=True, check=True)
    for key in ("cuattn", "nvrtc", "cache directory", "cached kernels", "device", "forward kernels"):
        assert key in info.stdout
    # which forward kernel serves which head dim: the mma.sync one always has some
    assert "flash_fwd_kernel (mma.sync) for every" in info.stdout


def test_a_cache_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """CUATTN_CACHE_DIR naming a file: the compile's write fails, and the error names the cache and
    the setting (build prints it as one line) instead of a bare NotADirectoryError."""
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(not_a_dir))
    spec = next(s for s in _tools.kernel_variants("sm_80") if "copy_blocks_kernel" in s.name)
    with pytest.raises(OSError, match=rf"^the kernel cache {re.escape(str(not_a_dir))}/nvrtc-[0-9.]+ cannot be "
                                      rf"written \(Not a directory\); set CUATTN_CACHE_DIR to a writable directory "
                                      rf"\(it is '{re.escape(str(not_a_dir))}'\)$"):
        _jit.compile_kernel(spec, "sm_80")
    run = subprocess.run([sys.executable, "-m", "cuattn", "build", "--arch", "sm_80", "--kernels", "copy_blocks"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("python -m cuattn build: the kernel cache "), run.stderr


def test_prune_cache_removes_what_no_current_variant_has(cache, sources, monkeypatch):
    """Kernels compiled from an edited header (an older release's, to the cache) are stale once
    the sources change back, and so are entries of no variant at all: prune removes both and keeps
    the current kernels, a file still being written and other NVRTC versions' folders."""
    (sources / "common.cuh").write_text((sources / "common.cuh").read_text() + "\n// an edit\n")
    cuattn.build("sm_80", kernels="cache_write_kernel")
    edited = _jit.cache_keys()
    monkeypatch.delenv("CUATTN_SOURCE_DIR")  # the package's own sources again
    cuattn.build("sm_80", kernels="cache_write_kernel")
    current = _jit.cache_keys() - edited
    assert edited and current and not edited & current
    folder = _jit.cache_dir()
    (folder / ("f" * 32 + ".cubin")).write_bytes(b"a cubin without metadata")
    (folder / ("e" * 32 + ".json")).write_text("not json")
    writing = folder / ("d" * 32 + ".cubinx1y2.tmp")
    writing.write_bytes(b"half a cubin")
    other = cache / "nvrtc-1.0"
    other.mkdir()
    (other / ("c" * 32 + ".cubin")).write_bytes(b"another NVRTC's")
    report = _tools.cache_report()
    assert (report["current"], report["stale"]) == (len(current), len(edited) + 2)
    assert report["versions"]["nvrtc-1.0"][0] == 1
    pruned = cuattn.prune_cache()
    assert pruned["removed"] == len(edited) + 2 and pruned["freed MB"] > 0
    assert (pruned["current"], pruned["stale"]) == (len(current), 0)
    assert _jit.cache_keys() == current and writing.exists() and (other / ("c" * 32 + ".cubin")).exists()
    # the current kernels still load from the cache
    spec = next(s for s in _tools.kernel_variants("sm_80") if "cache_write_kernel" in s.name)
    assert _jit.compile_kernel(spec, "sm_80").cached


def test_cli_cache_reports_prunes_and_clears(cache):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cuattn", "cache", *args], capture_output=True, text=True,
                              check=False)

    cuattn.build("sm_80", kernels="cache_write_kernel")
    count = len(_jit.cache_keys())
    (_jit.cache_dir() / ("f" * 32 + ".cubin")).write_bytes(b"stale")
    run = cli()
    assert run.returncode == 0 and f"{count} current kernels, 1 stale" in run.stdout, run.stdout + run.stderr
    run = cli("--prune")
    assert run.returncode == 0 and "removed 1 cached kernels" in run.stdout and "0 stale" in run.stdout, run.stdout
    run = cli("--prune", "--clear")
    assert run.returncode == 2 and "not allowed with argument" in run.stderr
    run = cli("--clear")
    assert run.returncode == 0 and f"removed {count} cached kernels" in run.stdout and not cache.exists()


@pytest.mark.parametrize("arch", ["sm90", "sm_75", "compute_90", ""])
def test_cli_build_refuses_an_unknown_arch_at_once_with_the_accepted_ones(arch):
    run = subprocess.run([sys.executable, "-m", "cuattn", "build", "--arch", f"sm_80,{arch}"],
                         capture_output=True, text=True, check=False, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "accepted" in run.stderr or "at least one target" in run.stderr
    assert "sm_80, " in run.stderr or "at least one target" in run.stderr
    # refused before anything compiled: the table header never printed
    assert "kernel" not in run.stdout


@pytest.mark.parametrize("arch", ["", "sm_80,", " , ", []])
def test_an_arch_list_without_a_target_is_refused(arch):
    with pytest.raises(ValueError, match=rf"^arch must name at least one target, e.g. sm_80,sm_90a; got "
                                         rf"{re.escape(repr(arch))}$"):
        cuattn.build(arch)


def test_missing_kernel_sources_name_both_places_they_are_looked_for(tmp_path, monkeypatch):
    """No CUATTN_SOURCE_DIR and neither an installed wheel's cuda_src/ nor a checkout's beside the package."""
    monkeypatch.delenv("CUATTN_SOURCE_DIR", raising=False)
    package = tmp_path / "site-packages" / "cuattn"
    monkeypatch.setattr(_jit, "__file__", str(package / "_jit.py"))
    package = package.resolve()
    with pytest.raises(FileNotFoundError, match=rf"^cuattn's kernel sources are missing: neither "
                                                rf"{re.escape(str(package / 'cuda_src'))} \(an installed wheel\) nor "
                                                rf"{re.escape(str(package.parent / 'cuda_src'))} \(a source checkout\) "
                                                r"holds common.cuh; reinstall cuattn, or point CUATTN_SOURCE_DIR at a "
                                                r"copy of cuda_src/$"):
        _jit.source_dir()


def test_unknown_arch_is_refused_before_any_compile(monkeypatch):
    def must_not_compile(*args, **kwargs):
        raise AssertionError("compiled before checking every arch")

    monkeypatch.setattr(_jit, "compile_kernel", must_not_compile)
    with pytest.raises(ValueError, match=r"arch 'sm_75' is not a target cuattn builds for; accepted .*sm_80.*sm_90a"):
        cuattn.build("sm_80,sm_75")
    assert "sm_90a" in _jit.supported_archs() and "sm_75" not in _jit.supported_archs()


@pytest.fixture
def fresh_reason():
    _jit.gpu_unavailable_reason.cache_clear()
    yield
    _jit.gpu_unavailable_reason.cache_clear()


def test_no_driver_is_said_as_such_not_as_an_old_driver(monkeypatch, fresh_reason):
    monkeypatch.setattr(_jit, "_driver_library_loads", lambda: False)
    reason = _jit.gpu_unavailable_reason()
    assert reason.startswith("no NVIDIA driver was found") and "insufficient" not in reason
    assert "NumPy arrays" in reason and "\n" not in reason
    with pytest.raises(cuattn.NoDeviceError, match=r"^no NVIDIA driver was found .*float64 reference on the CPU"):
        _jit.require_gpu()


def test_an_old_driver_names_both_cuda_versions(monkeypatch, fresh_reason):
    import cupy

    def insufficient():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(_jit, "_driver_library_loads", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", insufficient)
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: 12020)
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: 13000)
    reason = _jit.gpu_unavailable_reason()
    assert reason.startswith("no CUDA device can be used (the NVIDIA driver supports CUDA 12.2 but CuPy was "
                             "built for CUDA 13.0: update the driver, or install cuattn[cuda12])"), reason


def test_info_and_test_skips_give_the_librarys_own_reason():
    from conftest import gpu_unavailable_reason

    reason = _jit.gpu_unavailable_reason()
    assert gpu_unavailable_reason() == reason
    device = _tools.info()["device"]
    if reason is None:
        assert "compute capability" in device
    else:
        assert device == reason
        with pytest.raises(cuattn.NoDeviceError, match=re.escape(reason)):
            cuattn.PagedKVCache(4, 16, 1, 64, "float16")


def test_cli_rejects_bad_arguments():
    run = subprocess.run([sys.executable, "-m", "cuattn", "build", "--kernels", "nothing_matches"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "no kernel variant matches" in run.stderr
    run = subprocess.run([sys.executable, "-m", "cuattn", "frobnicate"], capture_output=True, text=True, check=False)
    assert run.returncode == 2 and "invalid choice" in run.stderr


@pytest.mark.gpu
def test_functions_are_memoised_per_device(cache):
    # a variant that asks for more than 48 KB, so the opt-in path runs
    spec = next(s for s in _tools.kernel_variants(_jit.target_arch()) if s.smem_bytes > _jit.DEFAULT_DYNAMIC_SMEM_LIMIT)
    assert spec.smem_bytes > _jit.DEFAULT_DYNAMIC_SMEM_LIMIT
    assert _jit.get_function(spec) is _jit.get_function(spec, 0)
    assert spec.smem_bytes <= _jit.max_shared_memory_per_block()


def test_launch_refuses_a_tile_larger_than_the_device_allows(monkeypatch):
    """A 99 KB-per-block GPU (sm_86, sm_89, sm_120) gets a clear error, not a driver fault."""
    cupy = pytest.importorskip("cupy")
    small_gpu_limit = 101376
    spec = _jit.KernelSpec("flash_bwd.cu", "cuattn::some_kernel<128>", threads=256, smem_bytes=141824)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(_jit, "get_function", lambda spec, device_id=None: object())
    monkeypatch.setattr(_jit, "max_shared_memory_per_block", lambda device_id=None: small_gpu_limit)
    monkeypatch.setattr(_jit, "target_arch", lambda device_id=None: "sm_89")
    with pytest.raises(ValueError, match=r"cuattn::some_kernel<128> needs 141824 bytes of shared memory per block; "
                                         r"device 0 \(sm_89\) allows 101376: this head dim has no tile for this GPU"):
        _jit.launch_params(spec, (1, 1, 1), np.zeros(1, np.dtype([("x", np.uint64)]))[0])


@pytest.mark.parametrize("nvrtc, runtime, driver, expected", [
    ((12, 9), 12090, 0, None),
    ((12, 9), 12090, 12040, None),
    ((13, 0), 13000, 13000, None),
    ((13, 0), 12090, 0, r"^NVRTC 13\.0 builds the kernels but CuPy was built for CUDA 12\.9: install the CuPy and "
                        r"NVRTC of one CUDA version \(cuattn\[cuda12\] or cuattn\[cuda13\]\)$"),
    ((12, 9), 13000, 13000, r"^NVRTC 12\.9 builds the kernels but CuPy was built for CUDA 13\.0"),
    ((13, 0), 12090, 12080, r"^NVRTC 13\.0 builds the kernels but the NVIDIA driver supports CUDA 12\.8: update "
                            r"the driver, or remove the CUDA 13 NVRTC wheel so that CuPy loads CUDA 12's$"),
])
def test_toolkit_mismatch_names_nvrtc_cupy_and_driver_versions(nvrtc, runtime, driver, expected):
    message = _jit.toolkit_mismatch(nvrtc, runtime, driver)
    if expected is None:
        assert message is None
    else:
        assert re.search(expected, message), message


def test_info_warns_of_a_toolkit_mismatch(monkeypatch):
    monkeypatch.setattr(_jit, "installed_toolkit_mismatch", lambda: "NVRTC 13.0 builds the kernels but ...")
    version = ".".join(map(str, _jit.nvrtc_version()))
    assert _tools.info()["nvrtc"] == f"{version} (warning: NVRTC 13.0 builds the kernels but ...)"
    monkeypatch.setattr(_jit, "installed_toolkit_mismatch", lambda: None)
    assert _tools.info()["nvrtc"] == version


@pytest.mark.parametrize("mismatch", [None, "NVRTC 13.0 builds the kernels but the NVIDIA driver supports CUDA 12.8"])
def test_a_kernel_the_driver_refuses_names_the_toolkit_mismatch(monkeypatch, tmp_path, mismatch):
    import contextlib

    import cupy

    class DriverRefused(Exception):
        pass

    def refuse(path):
        raise DriverRefused("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")

    compiled = type("Compiled", (), {"cubin_path": tmp_path / "k.cubin", "lowered_name": "_Z1kv"})
    monkeypatch.setattr(_jit, "compile_kernel", lambda spec, arch: compiled)
    monkeypatch.setattr(_jit, "device_arch", lambda spec, device_id: "sm_90a")
    monkeypatch.setattr(_jit, "installed_toolkit_mismatch", lambda: mismatch)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id: contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", DriverRefused)
    monkeypatch.setattr(cupy, "RawModule", refuse)
    spec = _jit.KernelSpec("decode.cu", "refused_kernel")
    if mismatch is None:
        with pytest.raises(DriverRefused, match="^CUDA_ERROR_UNSUPPORTED_PTX_VERSION$"):
            _jit.get_function(spec, 0)
    else:
        with pytest.raises(RuntimeError, match=r"^the driver did not load refused_kernel "
                                               r"\(CUDA_ERROR_UNSUPPORTED_PTX_VERSION\): NVRTC 13\.0 builds"):
            _jit.get_function(spec, 0)
    assert (0, spec) not in _jit._functions
