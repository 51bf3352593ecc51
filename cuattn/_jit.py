"""Run-time compilation of the CUDA kernels in ``cuda_src/`` and their disk cache.

This is the only module that talks to NVRTC and ``cupy.RawModule``. A kernel variant is a
:class:`KernelSpec`: the ``.cu`` file it lives in and the template instantiation written as a C++
name expression (``cuattn::flash_fwd_kernel<__half, 128, 128, 64, 4, false, false>``), which NVRTC instantiates
through ``nvrtcAddNameExpression`` and lowers to the mangled symbol we load.

Compiled cubins are cached on disk under ``$CUATTN_CACHE_DIR`` (default ``~/.cache/cuattn``), one
folder per NVRTC version. The cache key hashes every header under ``cuda_src/`` and the variant's
own ``.cu`` file: CuPy's own kernel cache keys only the top-level source, so an edited header found
through ``-I`` would otherwise reuse a stale binary, while an edit to one kernel file leaves the
other files' cubins valid.

Nothing here needs a GPU except :func:`get_function`, :func:`launch_params` and :class:`Launch`;
:func:`compile_kernel` works for any architecture NVRTC knows, which is how CI checks every
variant for spills.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ._errors import CompileError, NoDeviceError

logger = logging.getLogger("cuattn")

# Kernels launched with more dynamic shared memory than this must opt in per function.
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
# mma.sync.m16n8k16 with bf16 operands, ldmatrix and cp.async need Ampere or newer.
MIN_COMPUTE_CAPABILITY = 80
SOURCE_SUFFIXES = (".cu", ".cuh")
HEADER_SUFFIX = ".cuh"
# Targets with "a" suffixes: arch-specific instruction sets (wgmma, setmaxnreg on sm_90a).
ARCH_SPECIFIC_TARGETS = ("sm_90a",)
# Shown by every "no GPU" message: what works without one.
CPU_PATH_HINT = (
    "cuattn's kernels need an NVIDIA GPU of compute capability 8.0 or newer; without one, pass NumPy "
    "arrays to run the float64 reference on the CPU (and PagedKVCache(..., device='cpu'))"
)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel variant: a template instantiation in one ``.cu`` file of ``cuda_src/``."""

    source: str  # file name under cuda_src/, e.g. "flash_fwd.cu"
    name: str  # C++ name expression of the instantiation
    threads: int = 128  # block size the kernel is written for
    smem_bytes: int = 0  # dynamic shared memory per launch (the limit is raised past 48 KB)
    needs_sm90a: bool = False  # uses wgmma/setmaxnreg: only the arch-specific sm_90a target has them
    options: tuple[str, ...] = ()  # NVRTC options of this variant alone, after compile_options


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel: the numbers that decide occupancy and speed."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_smem_bytes: int
    # ptxas said it serialised the kernel's wgmma instructions (C7514, C7520, ...: a wgmma issued
    # or waited for in a branch, say), which cost the Hopper forward a fifth of its speed
    wgmma_serialized: bool = False

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    spec: KernelSpec
    arch: str
    cubin_path: Path
    lowered_name: str
    resources: Resources
    log: str
    seconds: float  # compile time; 0.0 when the cubin came from the disk cache
    cached: bool


# ---------------------------------------------------------------------------------------------
# Sources, headers and the cache key


def source_dir() -> Path:
    """The folder holding the kernels: $CUATTN_SOURCE_DIR, the installed package's copy, or a checkout's.

    A wheel installs the sources as ``cuattn/cuda_src/`` beside this file; a source checkout (and
    an editable install of it) keeps them in ``cuda_src/`` beside the package folder. NVRTC takes
    an include folder on disk, so the answer is always a real directory.
    """
    override = os.environ.get("CUATTN_SOURCE_DIR")
    if override:
        if not (Path(override) / "common.cuh").is_file():
            raise FileNotFoundError(f"CUATTN_SOURCE_DIR = {override} holds no common.cuh: point it at a copy of "
                                    "cuattn's cuda_src/ folder, or unset it to use the installed sources")
        return Path(override)
    package = Path(__file__).resolve().parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"cuattn's kernel sources are missing: neither {package / 'cuda_src'} (an installed wheel) nor "
        f"{package.parent / 'cuda_src'} (a source checkout) holds common.cuh; reinstall cuattn, or point "
        "CUATTN_SOURCE_DIR at a copy of cuda_src/"
    )


def sources_hash(directory: Path | None = None, source: str | None = None) -> str:
    """SHA-256 over the name and bytes of every kernel header and source, in name order; with
    ``source`` (a ``.cu`` file name), of every header and that source only, so that an edit to one
    kernel file leaves the other files' cached cubins valid (a header edit still reaches all:
    no ``.cu`` file includes another)."""
    directory = source_dir() if directory is None else Path(directory)
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.suffix == HEADER_SUFFIX or (path.suffix in SOURCE_SUFFIXES and source in (None, path.name)):
            digest.update(path.name.encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "cuattn compiles its kernels with NVRTC through CuPy: install it with "
            "pip install 'cuattn[cuda12]' or 'cuattn[cuda13]'"
        ) from exc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def _cuda_version(encoded: int) -> str:
    """CUDA's version integers (1000 * major + 10 * minor) as major.minor."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def toolkit_mismatch(nvrtc: tuple[int, int], runtime: int, driver: int) -> str | None:
    """Why kernels NVRTC ``nvrtc`` builds may not load beside CuPy's CUDA ``runtime`` and a driver
    supporting CUDA ``driver`` (version integers; 0: no driver), or None where they agree.

    CuPy loads the newest NVRTC it finds, so a CUDA 13 NVRTC (torch's cu13 wheels bring one) can
    sit beside cupy-cuda12x, whose users chose it for a CUDA 12 driver; a driver older than the
    NVRTC that built a cubin may refuse to load it."""
    built = f"{nvrtc[0]}.{nvrtc[1]}"
    if driver and nvrtc[0] > driver // 1000:
        return (f"NVRTC {built} builds the kernels but the NVIDIA driver supports CUDA {_cuda_version(driver)}: "
                f"update the driver, or remove the CUDA {nvrtc[0]} NVRTC wheel so that CuPy loads CUDA "
                f"{driver // 1000}'s")
    if nvrtc[0] != runtime // 1000:
        return (f"NVRTC {built} builds the kernels but CuPy was built for CUDA {_cuda_version(runtime)}: "
                f"install the CuPy and NVRTC of one CUDA version (cuattn[cuda12] or cuattn[cuda13])")
    return None


def installed_toolkit_mismatch() -> str | None:
    """:func:`toolkit_mismatch` for this installation (None where CuPy cannot say)."""
    import cupy

    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception:  # a courtesy check: an installation that cannot answer has other errors to give
        return None
    return toolkit_mismatch(nvrtc_version(), runtime, driver)


def cuda_include_dir() -> str | None:
    """Where cuda_fp16.h and cuda_bf16.h live: the CUDA runtime wheel, or a system toolkit."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            return str(found)
    except Exception:  # pathfinder missing or unable to look: fall back to the usual roots
        pass
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    return None


def compile_options(arch: str) -> tuple[str, ...]:
    """NVRTC options for one target; the include folders are added at compile time."""
    return (
        "-std=c++17",
        f"-arch={arch}",
        "--use_fast_math",
        "--ptxas-options=-v",
        "-default-device",
    )


def cache_root() -> Path:
    """$CUATTN_CACHE_DIR, or ~/.cache/cuattn: the kernel cache, one folder per NVRTC version."""
    return Path(os.environ.get("CUATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuattn"))


def cache_dir() -> Path:
    major, minor = nvrtc_version()
    return cache_root() / f"nvrtc-{major}.{minor}"


def cache_key(spec: KernelSpec, arch: str, src_hash: str | None = None) -> str:
    """The cubin's name in the cache: the headers and the variant's own source file (``src_hash``,
    :func:`sources_hash` with ``source=spec.source``), the variant, the target, the options and
    NVRTC's version."""
    src_hash = sources_hash(source=spec.source) if src_hash is None else src_hash
    fields = [src_hash, spec.source, spec.name, arch, *compile_options(arch), *spec.options, repr(nvrtc_version())]
    return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Targets and devices


def supported_archs() -> tuple[str, ...]:
    """The targets ``build`` accepts: NVRTC's archs from sm_80 up, and the arch-specific ones."""
    try:
        numbers = [n for n in _nvrtc().getSupportedArchs() if n >= MIN_COMPUTE_CAPABILITY]
    except (ImportError, AttributeError):  # no NVRTC to ask: the archs cuattn is built and tested for
        numbers = [MIN_COMPUTE_CAPABILITY, 90]
    archs = [f"sm_{n}" for n in sorted(numbers)]
    for target in ARCH_SPECIFIC_TARGETS:
        if target[:-1] in archs:
            archs.insert(archs.index(target[:-1]) + 1, target)
    return tuple(archs)


def check_arch(arch: str) -> str:
    """``arch`` if it is a target cuattn can build for, else a ValueError listing the ones it can."""
    accepted = supported_archs()
    if arch not in accepted:
        raise ValueError(
            f"arch {arch!r} is not a target cuattn builds for; accepted (compute capability 8.0 and newer, "
            f"as this NVRTC knows them): {', '.join(accepted)}"
        )
    return arch


def _driver_library_loads() -> bool:
    """Whether the NVIDIA driver's CUDA library is installed (CuPy's runtime cannot tell this apart
    from a driver that is too old: both come back as cudaErrorInsufficientDriver)."""
    name = "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable through CuPy; otherwise one line: what is missing, and the CPU path.

    The same sentence is raised by every device entry point (:func:`require_gpu`), printed by
    ``python -m cuattn info`` and given as the GPU tests' skip reason.
    """
    try:
        import cupy
    except ImportError:
        return ("no CUDA device can be used: CuPy is not installed (pip install 'cuattn[cuda12]' or "
                f"'cuattn[cuda13]'); {CPU_PATH_HINT}")
    if not _driver_library_loads():
        return f"no NVIDIA driver was found (libcuda cannot be loaded), so no CUDA device can be used; {CPU_PATH_HINT}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no CUDA device can be used ({_runtime_error_hint(cupy, exc)}); {CPU_PATH_HINT}"
    if count == 0:
        return f"no CUDA device was found (the NVIDIA driver reports none); {CPU_PATH_HINT}"
    return None


def _runtime_error_hint(cupy, exc) -> str:
    """Why CuPy's runtime refused, said for a person: a too-old driver names both CUDA versions."""
    if "InsufficientDriver" not in str(exc):
        return str(exc)
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
        runtime = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:  # the versions are a courtesy; the error itself is the answer
        return str(exc)
    return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)} but CuPy was built for "
            f"CUDA {_cuda_version(runtime)}: update the driver, or install cuattn[cuda12]")


def require_gpu() -> None:
    """Raise :class:`cuattn.NoDeviceError` with :func:`gpu_unavailable_reason` where there is no device."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise NoDeviceError(reason)


# ---------------------------------------------------------------------------------------------
# Compiling (no GPU needed)

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
# ptxas's notes that it serialised a function's wgmma (C75xx, one code per reason: C7514 and C7520
# were seen here)
_SERIALIZED_RE = re.compile(r"\(C75\d\d\) Potential Performance Loss: wgmma[^\n]*?function '([^'\n]+)'")


def wgmma_serialized(log: str, lowered_name: str) -> bool:
    """Whether a ptxas -v log says it serialised the wgmma of entry ``lowered_name``."""
    return lowered_name in _SERIALIZED_RE.findall(log)


def parse_resources(log: str, lowered_name: str) -> Resources | None:
    """Registers, stack, spills and static shared memory of one entry in a ptxas -v log; None when
    the log has no report for it."""
    sections = _ENTRY_RE.split(log)
    # split() alternates [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(sections[1::2], sections[2::2]):
        if name != lowered_name:
            continue
        frame = _FRAME_RE.search(body)
        regs = _REGS_RE.search(body)
        smem = _SMEM_RE.search(body)
        return Resources(
            registers=int(regs.group(1)) if regs else 0,
            stack_bytes=int(frame.group(1)) if frame else 0,
            spill_store_bytes=int(frame.group(2)) if frame else 0,
            spill_load_bytes=int(frame.group(3)) if frame else 0,
            static_smem_bytes=int(smem.group(1)) if smem else 0,
            wgmma_serialized=wgmma_serialized(log, lowered_name),
        )
    return None


# ELF64 (little-endian) fields a cubin's extent is read from: the header's e_phoff and e_shoff at
# 0x20, then e_phentsize, e_phnum, e_shentsize, e_shnum at 0x36; a section header's sh_type at 4
# and its sh_offset and sh_size at 0x18.
_ELF64_IDENT = b"\x7fELF\x02\x01"
_ELF64_HEADER_BYTES = 64
_SHT_NOBITS = 8  # a section with no bytes in the file (.nv.shared.*)
# CuPy's getCUBIN (14.x) takes NVRTC's cubin size for a string's, less a terminating NUL, and
# drops the image's last byte. NVRTC writes the program header table last, whose final field (the
# last segment's 64-bit alignment) ends in zero bytes: at most the top half of it is restored.
_CUBIN_ZERO_TAIL_BYTES = 4


def elf_extent(image: bytes) -> int | None:
    """The bytes an ELF64 image spans: the end of its program and section header tables and of every
    section stored in the file; None if ``image`` does not start with a whole ELF64 header."""
    if len(image) < _ELF64_HEADER_BYTES or not image.startswith(_ELF64_IDENT):
        return None
    ph_offset, sh_offset = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_count, sh_size, sh_count = struct.unpack_from("<HHHH", image, 0x36)
    extent = max(ph_offset + ph_size * ph_count, sh_offset + sh_size * sh_count)
    for i in range(sh_count):
        header = sh_offset + i * sh_size
        if header + sh_size > len(image):
            break  # the table's tail is what is missing: no more sections to read
        (kind,) = struct.unpack_from("<I", image, header + 4)
        offset, size = struct.unpack_from("<QQ", image, header + 0x18)
        if kind != _SHT_NOBITS:
            extent = max(extent, offset + size)
    return extent


def whole_cubin(image: bytes) -> bytes | None:
    """``image`` (a cubin from CuPy's getCUBIN) with the zero bytes CuPy dropped from its end put
    back; ``image`` itself where nothing is missing (a CuPy that returns every byte) or there is
    nothing to tell by (not ELF64); None where more than those bytes are missing."""
    extent = elf_extent(image)
    if extent is None or extent <= len(image):
        return image
    if extent - len(image) > _CUBIN_ZERO_TAIL_BYTES:
        return None
    return image + bytes(extent - len(image))


def _atomic_write(path: Path, data: bytes) -> None:
    """Write through a temporary file and rename, so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _restore_cached_cubin(path: Path) -> None:
    """Complete a cache entry written before compile_kernel restored getCUBIN's dropped byte: the
    driver loads either, but cuobjdump and nvdisasm refuse the short one."""
    image = path.read_bytes()
    whole = whole_cubin(image)
    if whole is not None and len(whole) > len(image):
        try:
            _atomic_write(path, whole)
        except OSError as exc:  # a cache this process may not write: the entry loads as it is
            logger.debug("left %s one byte short: %s", path, exc)


def compile_kernel(spec: KernelSpec, arch: str, *, use_cache: bool = True) -> CompiledKernel:
    """Compile one variant for ``arch`` (``sm_80``, ``sm_90a``, ...) to a cubin, or load it from the cache."""
    if spec.needs_sm90a and arch != "sm_90a":
        raise ValueError(f"kernel {spec.name} uses sm_90a instructions; cannot build it for {arch}")
    src_dir = source_dir()
    key = cache_key(spec, arch, sources_hash(src_dir, spec.source))
    folder = cache_dir()
    cubin_path, meta_path = folder / f"{key}.cubin", folder / f"{key}.json"
    if use_cache and cubin_path.is_file() and meta_path.is_file():
        _restore_cached_cubin(cubin_path)
        meta = json.loads(meta_path.read_text())
        logger.debug("loaded %s for %s from %s", spec.name, arch, cubin_path)
        # (the serialised-wgmma flag from the cached log: entries written before it existed lack it)
        resources = {**meta["resources"], "wgmma_serialized": wgmma_serialized(meta["log"], meta["lowered_name"])}
        return CompiledKernel(
            spec, arch, cubin_path, meta["lowered_name"], Resources(**resources), meta["log"], 0.0, True,
        )

    nvrtc = _nvrtc()
    options = list(compile_options(arch)) + list(spec.options) + [f"-I{src_dir}"]
    include = cuda_include_dir()
    if include:
        options.append(f"-I{include}")
    source = (src_dir / spec.source).read_text()
    start = time.perf_counter()
    prog = nvrtc.createProgram(source, spec.source, [], [])
    try:
        nvrtc.addNameExpression(prog, spec.name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(spec.name, options, log or str(exc)) from None
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, spec.name)
        cubin = whole_cubin(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - start
    if cubin is None:
        raise CompileError(spec.name, options, log + "\nNVRTC's cubin came back cut short of its ELF headers' extent "
                           "by more than CuPy's dropped last byte")
    res = parse_resources(log, lowered)
    if res is None:
        # The cubin is whole; only the report is missing. NVRTC on the H200 returned an empty
        # program log for a few compiles that succeeded (not reproduced elsewhere). The resources
        # read 0, which `cuattn build` and its spill check report as unknown registers.
        logger.warning("ptxas printed no resource report for %s (program log %r); its resources read 0",
                       spec.name, log)
        res = Resources(0, 0, 0, 0, 0)
    logger.info("compiled %s for %s in %.2f s (%d registers)", spec.name, arch, seconds, res.registers)
    meta = {
        "kernel": spec.name, "source": spec.source, "arch": arch, "lowered_name": lowered,
        "resources": dataclasses.asdict(res), "log": log, "seconds": seconds,
    }
    try:
        _atomic_write(cubin_path, cubin)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    except OSError as exc:  # the module loads from the cached file: without it there is nothing to load
        setting = os.environ.get("CUATTN_CACHE_DIR")
        raise OSError(f"the kernel cache {folder} cannot be written ({exc.strerror or exc}); set CUATTN_CACHE_DIR "
                      f"to a writable directory (it is {repr(setting) if setting else 'unset: ~/.cache/cuattn'})") from exc
    return CompiledKernel(spec, arch, cubin_path, lowered, res, log, seconds, False)


def cached_kernels() -> list[dict]:
    """What the disk cache of this NVRTC version holds: kernel, arch, registers, spills."""
    folder = cache_dir()
    if not folder.is_dir():
        return []
    entries = []
    for meta_path in sorted(folder.glob("*.json")):
        try:
            entries.append(json.loads(meta_path.read_text()))
        except (OSError, ValueError):
            continue
    return entries


def cache_sizes() -> dict[str, tuple[int, int]]:
    """Every NVRTC version's folder under the cache root: its name, and its entries (cubins) and
    bytes on disk."""
    root = cache_root()
    if not root.is_dir():
        return {}
    sizes = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = [f for f in folder.iterdir() if f.is_file()]
        sizes[folder.name] = (sum(f.suffix == ".cubin" for f in files), sum(f.stat().st_size for f in files))
    return sizes


def _cache_key_of(path: Path) -> str | None:
    """The key of a file of the cache (``<key>.cubin`` or ``<key>.json``); None for a temporary file
    being written (_atomic_write's), which another process may still rename into place."""
    return None if path.suffix == ".tmp" or not path.is_file() else path.name.split(".")[0]


def cache_keys() -> set[str]:
    """The keys of this NVRTC version's cache entries (a cubin and its metadata, or either alone)."""
    folder = cache_dir()
    return {key for key in map(_cache_key_of, folder.iterdir()) if key} if folder.is_dir() else set()


def remove_cache_entries(keep: set[str]) -> tuple[int, int]:
    """Delete the entries of this NVRTC version's cache whose key is not in ``keep``; returns the
    entries (keys) removed and the bytes freed. Files being written are left alone."""
    folder = cache_dir()
    if not folder.is_dir():
        return 0, 0
    keys, freed = set(), 0
    for path in folder.iterdir():
        key = _cache_key_of(path)
        if key and key not in keep:
            keys.add(key)
            freed += path.stat().st_size
            path.unlink()
    return len(keys), freed


# ---------------------------------------------------------------------------------------------
# Loading and launching (needs a GPU)

_lock = threading.Lock()
_functions: dict[tuple[int, KernelSpec], object] = {}
_smem_opt_in: set[tuple[int, KernelSpec]] = set()


def current_device() -> int:
    """CuPy's current device; where there is none, :class:`NoDeviceError` says why in one line."""
    import cupy

    try:
        return cupy.cuda.runtime.getDevice()
    except cupy.cuda.runtime.CUDARuntimeError:
        require_gpu()
        raise


def device_arch(spec: KernelSpec, device_id: int) -> str:
    """The target for a device: sm_XY from its compute capability, sm_90a where a kernel needs it."""
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    # On Hopper every kernel is built for sm_90a, a superset of sm_90: what runs is what
    # `cuattn build --arch sm_90a` checked for spills.
    if cc == 90:
        return "sm_90a"
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"cuattn kernels need compute capability {MIN_COMPUTE_CAPABILITY // 10}.0 or newer; "
            f"device {device_id} has {cc // 10}.{cc % 10}"
        )
    if spec.needs_sm90a:
        raise RuntimeError(f"kernel {spec.name} needs an sm_90 GPU; device {device_id} is sm_{cc}")
    return f"sm_{cc}"


def target_arch(device_id: int | None = None) -> str:
    """The arch kernels are built for on a device (memoised: asked on every launch)."""
    if device_id is None:
        device_id = current_device()
    arch = _archs.get(device_id)
    if arch is None:
        arch = _archs[device_id] = device_arch(KernelSpec("", ""), device_id)
    return arch


_archs: dict[int, str] = {}


def get_function(spec: KernelSpec, device_id: int | None = None):
    """The loaded kernel for the current (or given) device, compiled on first use and memoised."""
    import cupy

    if device_id is None:
        device_id = current_device()
    key = (device_id, spec)
    function = _functions.get(key)
    if function is not None:
        return function
    with _lock:
        function = _functions.get(key)
        if function is None:
            compiled = compile_kernel(spec, device_arch(spec, device_id))
            with cupy.cuda.Device(device_id):
                try:
                    module = cupy.RawModule(path=str(compiled.cubin_path))
                    function = module.get_function(compiled.lowered_name)
                except cupy.cuda.driver.CUDADriverError as exc:
                    mismatch = installed_toolkit_mismatch()
                    if mismatch is None:
                        raise
                    raise RuntimeError(f"the driver did not load {spec.name} ({exc}): {mismatch}") from exc
            _functions[key] = function
    return function


def _loaded_function(spec: KernelSpec, device_id: int):
    """The kernel, with its dynamic shared-memory limit raised on first use when the spec asks for more."""
    function = get_function(spec, device_id)
    key = (device_id, spec)
    if spec.smem_bytes > DEFAULT_DYNAMIC_SMEM_LIMIT and key not in _smem_opt_in:
        limit = max_shared_memory_per_block(device_id)
        if spec.smem_bytes > limit:
            # e.g. the A100/H100 tiles on a GPU with 99 KB per block (sm_86, sm_89, sm_120)
            raise ValueError(
                f"{spec.name} needs {spec.smem_bytes} bytes of shared memory per block; device {device_id} "
                f"({target_arch(device_id)}) allows {limit}: this head dim has no tile for this GPU"
            )
        function.max_dynamic_shared_size_bytes = spec.smem_bytes
        _smem_opt_in.add(key)
    return function


def launch_params(spec: KernelSpec, grid, params: np.void, *, stream=None) -> None:
    """Launch a variant once with the packed struct ``params`` as its only argument, through the
    driver (cuLaunchKernel copies the struct when called): for calls that pack a struct per launch
    and keep no :class:`Launch` (the backward, the FP8 forward's V^T pass)."""
    function = _loaded_function(spec, current_device())
    buffer = np.frombuffer(params.tobytes(), np.uint64)  # 8-byte aligned, as the struct's pointers need
    args = np.array([buffer.ctypes.data], np.uint64)  # void*[1]: the struct's address
    _driver().launchKernel(function.kernel.ptr, *(int(g) for g in grid), spec.threads, 1, 1, spec.smem_bytes,
                           stream_ptr(stream), args.ctypes.data, 0)


class Launch:
    """One kernel launch made ready: the function, its geometry and its parameter struct.

    The struct's scalars are filled once; :meth:`run` writes the call's device addresses into it
    and launches through the driver (``cuLaunchKernel`` with the struct as the only argument), so
    a repeated call costs a few stores and the launch itself.
    """

    __slots__ = ("spec", "device_id", "function_ptr", "grid", "block", "shared_mem", "params", "_slots",
                 "_maps", "_args_address", "_args", "_lock")

    def __init__(self, spec: KernelSpec, grid, params, *, shared_mem: int | None = None, maps=()):
        self.spec = spec
        self.device_id = current_device()
        # RawKernel.kernel: the loaded CUfunction of the current device
        self.function_ptr = _loaded_function(spec, self.device_id).kernel.ptr
        self.grid = tuple(int(g) for g in grid)
        self.block = (spec.threads, 1, 1)
        self.shared_mem = spec.smem_bytes if shared_mem is None else shared_mem
        # the struct as 8-byte words (pointers are 8-byte aligned, so each is one word): the launch
        # buffer, its pointer words rewritten in place under the lock by each run
        self.params = np.frombuffer(params.tobytes(), np.uint64).copy()
        self._slots = {name: params.dtype.fields[name][1] // 8 for name in params.dtype.names}
        # tensor maps (TMA) follow a pointer field: [map's first word, pointer's word, _tma.MapLayout,
        # the address the map holds now (None: not encoded yet)]
        self._maps = tuple([self._slots[map_field], self._slots[pointer_field], layout, None]
                           for map_field, pointer_field, layout in maps)
        self._args = np.array([self.params.ctypes.data], np.uint64)  # void*[1]: the struct's address
        self._args_address = self._args.ctypes.data
        self._lock = threading.Lock()
        self._refresh_maps()

    def slot(self, field: str) -> int:
        """The word index of a pointer field, for :meth:`run`."""
        return self._slots[field]

    def _refresh_maps(self) -> None:
        """Each tensor map re-encoded for the address its pointer field now holds (cached per address)."""
        params = self.params
        for entry in self._maps:
            word, pointer_slot, layout, held = entry
            address = int(params[pointer_slot])
            if address != held:  # a loop over the same buffers skips even the cache lookup
                encoded = layout.encode(address)
                params[word:word + encoded.size] = encoded
                entry[3] = address

    def bind(self, pointers) -> None:
        """Write ``(slot, address)`` pairs (and the tensor maps of those addresses) for every later
        :meth:`run`: a step plan's launches over fixed arrays."""
        with self._lock:
            for slot, address in pointers:
                self.params[slot] = address
            if self._maps:
                self._refresh_maps()

    def run(self, stream_ptr: int, pointers=()) -> None:
        """Launch on the raw CUDA stream ``stream_ptr`` with ``(slot, address)`` pairs written first
        (and the tensor maps of those addresses).

        cuLaunchKernel copies the struct when it is called, so the buffer may be rewritten as soon
        as it returns; the lock keeps two threads from interleaving writes and launch."""
        params = self.params
        driver = _driver()
        if not driver.ctxGetCurrent():
            _make_context_current(self.device_id)
        with self._lock:
            for slot, address in pointers:
                params[slot] = address
            if self._maps:
                self._refresh_maps()
            driver.launchKernel(self.function_ptr, *self.grid, *self.block, self.shared_mem, stream_ptr,
                                self._args_address, 0)


def _make_context_current(device_id: int) -> None:
    """Make ``device_id``'s primary context current on this thread.

    A launch through the driver needs a current context, which a thread gets from its first CUDA
    runtime call. A thread that has made none may still reach a planned call, which launches and
    allocates through caches: torch's autograd worker (torch sets its device lazily) running a
    backward whose plan the main thread recorded failed with CUDA_ERROR_INVALID_CONTEXT."""
    import cupy

    cupy.cuda.runtime.setDevice(device_id)
    cupy.cuda.runtime.free(0)  # the runtime's own way to initialise a thread's context


_driver_module = None


def _driver():
    """CuPy's driver-API module, imported once (a per-launch import costs a dict lookup and a lock)."""
    global _driver_module
    if _driver_module is None:
        from cupy_backends.cuda.api import driver

        _driver_module = driver
    return _driver_module


def stream_ptr(stream) -> int:
    """The raw handle of a CuPy stream, an int handle, or (None) CuPy's current stream."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return int(getattr(stream, "ptr", stream))


def prepare(spec: KernelSpec, grid, params, *, shared_mem: int | None = None, maps=()) -> Launch:
    """A :class:`Launch` of ``spec`` with the packed struct ``params``; callers return before an
    empty grid (no rows, no sequences), so every grid here has work. ``maps``: ``(map field,
    pointer field, _tma.MapLayout)`` triples, tensor maps kept in step with their pointers."""
    return Launch(spec, grid, params, shared_mem=shared_mem, maps=maps)


_attributes: dict[tuple[int, str], int] = {}


def device_attribute(name: str, device_id: int | None = None) -> int:
    """A CUDA device attribute by CuPy's name ("MultiProcessorCount", ...), memoised: launches ask often."""
    import cupy

    if device_id is None:
        device_id = current_device()
    key = (device_id, name)
    value = _attributes.get(key)
    if value is None:
        value = _attributes[key] = int(cupy.cuda.Device(device_id).attributes[name])
    return value


# Registers are allocated per warp, in units of this many.
REGISTER_ALLOCATION_UNIT = 256
# Shared memory the driver reserves per CTA on sm_80 and later (its occupancy counts it beside
# the kernel's own).
RESERVED_SMEM_PER_CTA = 1024


def ctas_by_registers(threads: int, registers: int, registers_per_sm: int) -> int:
    """How many CTAs of ``threads`` threads at ``registers`` registers a thread an SM's register
    file of ``registers_per_sm`` holds at once."""
    regs_per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    return registers_per_sm // max(regs_per_warp * (threads // 32), 1)


def occupancy(threads: int, registers: int, smem_bytes: int, *, registers_per_sm: int, smem_per_sm: int,
              threads_per_sm: int) -> int:
    """How many CTAs of ``threads`` threads, ``registers`` registers a thread and ``smem_bytes`` of
    shared memory (with the driver's RESERVED_SMEM_PER_CTA beside it) an SM of these budgets holds
    at once: the fewest that its registers, shared memory and threads allow (0 if one does not fit)."""
    by_smem = smem_per_sm // (smem_bytes + RESERVED_SMEM_PER_CTA)
    return min(ctas_by_registers(threads, registers, registers_per_sm), by_smem, threads_per_sm // threads)


def max_shared_memory_per_block(device_id: int | None = None) -> int:
    """The opt-in dynamic shared-memory limit of a device (232448 bytes on an H100/H200)."""
    return device_attribute("MaxSharedMemoryPerBlockOptin", device_id)


def multiprocessor_count(device_id: int | None = None) -> int:
    return device_attribute("MultiProcessorCount", device_id)
