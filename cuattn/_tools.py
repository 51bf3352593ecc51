"""``cuattn.info()``, ``cuattn.build()`` and ``cuattn.prune_cache()``: the environment report, the
ahead-of-time build and the kernel cache's upkeep.

``build`` compiles every kernel variant the dispatchers can choose for the given architectures
(no GPU needed) and reports, per kernel, registers, dynamic and static shared memory, stack and
spill bytes, and how many CTAs fit on one SM by registers and by shared memory. ``prune_cache``
removes the cached kernels no current variant has (a new release's sources, or an edit, key
every variant afresh, and the old cubins would stay on disk).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import platform

from . import _jit, _registry

DEFAULT_ARCHS = ("sm_80", "sm_90a")
# Per-SM budgets of sm_80 / sm_90, for the occupancy column of the report.
REGISTERS_PER_SM = 65536
SMEM_PER_SM = {"sm_80": 167936, "sm_90a": 233472, "sm_90": 233472}
MAX_THREADS_PER_SM = 2048


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """Every variant any dispatcher in cuattn can launch on ``arch`` (the variant registry's list)."""
    return _registry.kernel_variants(arch)


@dataclasses.dataclass(frozen=True)
class BuildRow:
    kernel: str
    arch: str
    registers: int
    smem_bytes: int  # dynamic, per launch
    static_smem_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    ctas_per_sm: int
    seconds: float
    error: str = ""
    wgmma_serialized: bool = False  # ptxas serialised the kernel's wgmma (C7514, C7520, ...)

    @property
    def ok(self) -> bool:
        return (not self.error and self.spill_store_bytes == 0 and self.spill_load_bytes == 0
                and not self.wgmma_serialized)


def _ctas_per_sm(spec: _jit.KernelSpec, res: _jit.Resources, arch: str) -> int:
    return _jit.occupancy(spec.threads, res.registers, spec.smem_bytes + res.static_smem_bytes,
                          registers_per_sm=REGISTERS_PER_SM, smem_per_sm=SMEM_PER_SM.get(arch, SMEM_PER_SM["sm_80"]),
                          threads_per_sm=MAX_THREADS_PER_SM)


def parse_archs(arch) -> list[str]:
    """A list of targets from "sm_80,sm_90a" or a sequence, each checked before anything compiles."""
    archs = [a.strip() for a in arch.split(",")] if isinstance(arch, str) else [str(a).strip() for a in arch]
    if not archs or not all(archs):
        raise ValueError(f"arch must name at least one target, e.g. sm_80,sm_90a; got {arch!r}")
    return [_jit.check_arch(a) for a in archs]


def build(arch=DEFAULT_ARCHS, kernels=None, *, use_cache: bool = True) -> list[BuildRow]:
    """Compile every kernel variant for each architecture in ``arch`` (a list or "sm_80,sm_90a").

    ``kernels`` keeps only variants whose name contains one of the given substrings. Returns one
    row per (kernel, arch); a compile failure is recorded in the row's ``error``.
    """
    archs = parse_archs(arch)
    if isinstance(kernels, str):
        kernels = [kernels]
    selected = {}
    for target in archs:
        specs = [s for s in kernel_variants(target) if not kernels or any(k in s.name for k in kernels)]
        if not specs:
            raise ValueError(f"no kernel variant matches {kernels!r}")
        selected[target] = specs
    rows = []
    for target, specs in selected.items():
        for spec in specs:
            if spec.needs_sm90a and target != "sm_90a":
                continue
            try:
                compiled = _jit.compile_kernel(spec, target, use_cache=use_cache)
            except _jit.CompileError as exc:
                rows.append(BuildRow(spec.name, target, 0, spec.smem_bytes, 0, 0, 0, 0, 0, 0.0, str(exc)))
                continue
            res = compiled.resources
            rows.append(BuildRow(
                spec.name, target, res.registers, spec.smem_bytes, res.static_smem_bytes,
                res.stack_bytes, res.spill_store_bytes, res.spill_load_bytes,
                _ctas_per_sm(spec, res, target), compiled.seconds,
                "" if res.registers else "ptxas printed no resource report (registers, spills unknown)",
                res.wgmma_serialized,
            ))
    return rows


def cache_report() -> dict:
    """The kernel cache: its folder for this NVRTC version and, for each NVRTC version's folder
    under the cache root, its entries and megabytes; this version's entries counted as current
    (a kernel variant of the current sources has their key) or stale."""
    return _cache_report(_current_keys())


def _cache_report(current: set[str]) -> dict:
    """cache_report's with ``current`` the keys of the current kernel variants (_current_keys')."""
    present = _jit.cache_keys()
    fresh = len(present & current)
    return {"directory": str(_jit.cache_dir()), "current": fresh, "stale": len(present) - fresh,
            "versions": {name: (count, nbytes / 2**20) for name, (count, nbytes) in _jit.cache_sizes().items()}}


def _current_keys() -> set[str]:
    """The cache keys of every kernel variant of the current sources, for each target this NVRTC
    version's cache has entries of."""
    archs = {e["arch"] for e in _jit.cached_kernels() if e.get("arch") in _jit.supported_archs()}
    return {_jit.cache_key(spec, arch) for arch in archs for spec in kernel_variants(arch)
            if not (spec.needs_sm90a and arch != "sm_90a")}


def prune_cache() -> dict:
    """Remove this NVRTC version's cached kernels that no kernel variant of the current sources
    has (an older release's, an edited source's, or tiles compiled for an experiment, which compile
    again on use); other NVRTC versions' folders are left (``clear_cache`` removes every one).
    Returns the entries removed and the megabytes freed, and the report after."""
    current = _current_keys()
    removed, freed = _jit.remove_cache_entries(current)
    return {"removed": removed, "freed MB": freed / 2**20, **_cache_report(current)}


def clear_cache() -> dict:
    """Remove the whole kernel cache (every NVRTC version's folder); returns what it held."""
    import shutil

    sizes = _jit.cache_sizes()
    if _jit.cache_root().is_dir():
        shutil.rmtree(_jit.cache_root())
    return {"directory": str(_jit.cache_root()), "removed": sum(n for n, _ in sizes.values()),
            "freed MB": sum(b for _, b in sizes.values()) / 2**20}


def format_cache_report(report: dict) -> str:
    lines = []
    if "removed" in report:
        lines.append(f"removed {report['removed']} cached kernels ({report['freed MB']:.1f} MB)")
    if "current" in report:
        hint = " (`python -m cuattn cache --prune` removes them)" if report["stale"] else ""
        lines.append(f"{report['directory']}: {report['current']} current kernels, {report['stale']} stale{hint}")
    for name, (count, megabytes) in report.get("versions", {}).items():
        lines.append(f"  {name}: {count} kernel{'' if count == 1 else 's'}, {megabytes:.1f} MB")
    return "\n".join(lines)


def format_build_table(rows: list[BuildRow]) -> str:
    header = f"{'kernel':<70} {'arch':<7} {'regs':>4} {'smem':>7} {'stack':>5} {'spill':>9} {'cta/SM':>6} {'s':>5}"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.error:
            lines.append(f"{r.kernel:<70} {r.arch:<7} COMPILE ERROR")
            continue
        spill = f"{r.spill_store_bytes}/{r.spill_load_bytes}"
        flag = "  <- wgmma serialized (ptxas C75xx)" if r.wgmma_serialized else "" if r.ok else "  <- spills"
        lines.append(
            f"{r.kernel:<70} {r.arch:<7} {r.registers:>4} {r.smem_bytes + r.static_smem_bytes:>7} "
            f"{r.stack_bytes:>5} {spill:>9} {r.ctas_per_sm:>6} {r.seconds:>5.2f}{flag}"
        )
    return "\n".join(lines)


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    from importlib import metadata

    for dist in {"cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"), "torch": ("torch",), "jax": ("jax",),
                 "numpy": ("numpy",), "ml_dtypes": ("ml_dtypes",)}.get(module, (module,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "installed"


def info() -> dict:
    """Versions, device, architecture, kernel sources and cache: what to paste into a bug report."""
    from . import __version__

    report = {
        "cuattn": __version__,
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "ml_dtypes": _version("ml_dtypes"),
        "cupy": _version("cupy"),
        "torch": _version("torch"),
        "jax": _version("jax"),
    }
    try:
        report["kernel sources"] = str(_jit.source_dir())
        report["sources hash"] = _jit.sources_hash()[:16]
    except FileNotFoundError as exc:  # a wrong CUATTN_SOURCE_DIR, or a broken install
        report["kernel sources"] = f"missing ({exc})"
    try:
        report["nvrtc"] = ".".join(map(str, _jit.nvrtc_version()))
        mismatch = _jit.installed_toolkit_mismatch()
        if mismatch is not None:
            report["nvrtc"] += f" (warning: {mismatch})"
        report["cuda headers"] = _jit.cuda_include_dir() or "not found"
        report["cache directory"] = str(_jit.cache_dir())
        report["cached kernels"] = len(_jit.cached_kernels())
    except ImportError as exc:
        report["nvrtc"] = f"unavailable ({exc})"
        report["cache directory"] = f"{_jit.cache_root()} (one folder per NVRTC version)"
    report["device"] = _device_report()
    report["forward kernels"] = _forward_report()
    return report


def _forward_report() -> str:
    """Which forward kernel serves which head dims on this device (a debug record on the `cuattn`
    logger names the kernel of each call)."""
    import importlib

    attention = importlib.import_module("cuattn.attention")  # the module, not the function it re-exports

    arch = _jit.target_arch(0) if _jit.gpu_unavailable_reason() is None else None
    hopper = sorted(attention.FWD_SM90_TILES) if arch == attention.SM90 else []
    tiles = ", ".join(map(str, attention.TILE_HEAD_DIMS))
    parts = []
    if hopper:
        pairs = ", ".join(f"({d}, {dv})" for d, dv in hopper)
        parts.append(f"flash_fwd_sm90_kernel (TMA, wgmma) for D and Dv above {attention.FWD_SM90_MIN_HEAD_DIM}, "
                     f"run in the smallest of its tiles (D, Dv) = {pairs} that holds them")
    others = "every other D" if hopper else "every D"
    parts.append(f"flash_fwd_kernel (mma.sync) for {others} (a multiple of 8 up to 256, run in the smallest of "
                 f"its tiles D = {tiles} that holds it)")
    where = f"on {arch}" if arch else "on sm_80/86/89; sm_90a adds the Hopper kernel"
    return "; ".join(parts) + f" ({where}; views the TMA cannot read take flash_fwd_kernel)"


def _device_report() -> str:
    reason = _jit.gpu_unavailable_reason()
    if reason is not None:
        return reason
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    arch = _jit.target_arch(0)
    return f"{name} (compute capability {props['major']}.{props['minor']}, {props['multiProcessorCount']} SMs, arch {arch}); {count} device(s)"


def format_info(report: dict) -> str:
    width = max(map(len, report))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in report.items())
