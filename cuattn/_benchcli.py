"""``python -m cuattn bench``: the standard sweep on this GPU, as tables, a JSON record and a plot.

First the physical ceilings are measured in the same run (device copy bandwidth in TB/s, dense
GEMM rate of cuBLAS in TFLOP/s; ``cuattn._bench``), then every case of the chosen families
(``cuattn._benchcases``, the cases the pytest-benchmark suite runs) with a progress bar on
stderr. Each family prints a table: one row per shape, one column per implementation in TFLOP/s
or TB/s, then ratio columns cuattn / each baseline (for paged decode: paged / contiguous).
``--json`` writes every figure with the device, versions and date; ``--plot`` draws throughput
against sequence length, one panel per (family, head dim, mask), with the ceiling as a line.

Everything that formats (tables, JSON record, plot panels, progress bar) is a pure function of
the results, so it is tested without a GPU; only ``environment``, ``measure_ceilings`` and
``run`` touch the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from . import _bench, _benchcases, _jit
from ._arrays import BFLOAT16, FLOAT16, dtype_name

FAMILY_ORDER = ("forward", "backward", "decode", "paged")
# "overhead" (host time per call, _benchoverhead) is its own run, not part of "all"
FAMILY_CHOICES = (*FAMILY_ORDER, "all", "overhead")
DTYPES = {"bf16": BFLOAT16, "fp16": FLOAT16}
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
JSON_FORMAT = "cuattn-bench/1"
MATPLOTLIB_HINT = "pip install matplotlib (or pip install 'cuattn[plot]')"

# Progress bar: characters of the bar.
PROGRESS_WIDTH = 24
# Plot geometry: panels per row, inches per panel, resolution of the saved image.
PLOT_COLUMNS = 4
PANEL_INCHES = (4.2, 3.3)
PLOT_DPI = 130
# Room above the highest point or ceiling for the legend, as a factor on the y axis's top.
PLOT_HEADROOM = 1.4
# Ratio columns: a baseline this many times slower is shown without decimals (e.g. "42x").
RATIO_PLAIN_ABOVE = 10.0
DESCRIPTION = """\
Measure this GPU's copy bandwidth and GEMM rate, then run the standard sweep
(the cases of tests/bench) and print one table per family: TFLOP/s or TB/s of each
implementation (cuattn; torch SDPA's flash and cuDNN backends when torch is
installed; naive CuPy) and cuattn's ratio to each. A progress bar goes to stderr."""
EPILOG = """examples:
  python -m cuattn bench                          # every family, bf16
  python -m cuattn bench decode --quick           # a few small shapes: a smoke test
  python -m cuattn bench all --json bench.json --plot bench.png
"""


# ---------------------------------------------------------------------------------------------
# Arguments


def add_parser(commands) -> argparse.ArgumentParser:
    """The ``bench`` subcommand on ``python -m cuattn``'s subparsers."""
    bench = commands.add_parser(
        "bench", help="run the benchmark sweep on this GPU: tables, --json record, --plot",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("family", nargs="?", default="all", choices=FAMILY_CHOICES,
                       help="which sweep to run (default: %(default)s)")
    bench.add_argument("--dtype", default="bf16", choices=tuple(DTYPES),
                       help="inputs' dtype (default: %(default)s; naive CuPy always runs in fp16)")
    bench.add_argument("--json", metavar="FILE", help="write every case's figures, the ceilings, device and versions")
    bench.add_argument("--plot", metavar="FILE.png",
                       help=f"draw throughput against sequence length ({', '.join(PLOT_SUFFIXES)}; needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="a tiny sweep of small shapes, for smoke tests")
    bench.add_argument("--from-json", metavar="FILE",
                       help="measure nothing: print the tables (and --plot) of a record --json wrote")
    return bench


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; otherwise the one-line reason every entry point gives."""
    return _jit.gpu_unavailable_reason()


def import_matplotlib():
    """matplotlib with a file-only backend (no display needed); ImportError names the install."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not importable ({exc}): {MATPLOTLIB_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse, before any measuring, what would fail after a long sweep: exit 2 with a message."""
    if args.family == "overhead" and (args.plot or args.from_json or args.quick):
        parser.error("bench overhead takes --dtype and --json only (no --plot, --from-json or --quick)")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        folder = Path(path).expanduser().resolve().parent
        if not folder.is_dir():
            parser.error(f"{option} {path}: its folder {folder} does not exist")
    if args.plot is not None:
        suffix = Path(args.plot).suffix.lower()
        if suffix not in PLOT_SUFFIXES:
            parser.error(f"--plot must name a {', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]} file, "
                         f"got {args.plot!r} (suffix {suffix!r})")
        try:
            import_matplotlib()
        except ImportError as exc:
            parser.error(str(exc))
    if args.from_json is not None:
        if not Path(args.from_json).expanduser().is_file():
            parser.error(f"--from-json {args.from_json}: no such file")
        return
    reason = gpu_unavailable_reason()
    if reason is not None:
        parser.error(f"bench measures on a CUDA device: {reason}")


def main(parser: argparse.ArgumentParser, args, argv: list[str]) -> int:
    """Check the arguments, run the sweep, print tables, write --json and --plot. Exit code 1
    when any case failed with an error (a skip is not a failure)."""
    check_args(parser, args)
    if args.from_json is not None:
        return replay(parser, args)
    families = FAMILY_ORDER if args.family == "all" else (args.family,)
    dtype = DTYPES[args.dtype]
    command = shlex.join(["python", "-m", "cuattn", *argv])
    env = environment()
    print(format_environment(env, command))
    if args.family == "overhead":
        return _overhead(args, env, command, dtype)
    ceilings = measure_ceilings(dtype)
    print(format_ceilings(ceilings))
    results = run(families, dtype, args.quick)
    record = build_record(results, ceilings=ceilings, environment=env, command=command,
                          dtype=dtype_name(dtype), quick=args.quick)
    if args.json:
        write_json(args.json, record)
        print(f"\nwrote {args.json}")
    if args.plot:
        draw_plot(plot_panels(results, ceilings), args.plot, title=plot_title(env, dtype_name(dtype), record["date"]))
        print(f"wrote {args.plot}")
    errors = [r for r in results if r.error]
    for r in errors:
        print(f"error: {r.family} {r.impl} {_benchcases.FAMILIES[r.family].shape_id(r.shape)}: {r.error}",
              file=sys.stderr)
    return 1 if errors else 0


def _overhead(args, env: dict, command: str, dtype) -> int:
    """``bench overhead``: host us per call and eager throughput, by function and input framework."""
    from . import _benchoverhead

    results = _benchoverhead.run(dtype)
    print("\n" + _benchoverhead.format_table(results))
    if args.json:
        record = {"format": JSON_FORMAT + "+overhead", "command": command, **env,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "calls": _benchoverhead.CALLS, "rows": [_benchoverhead.record(r) for r in results]}
        write_json(args.json, record)
        print(f"\nwrote {args.json}")
    return 0


def replay(parser: argparse.ArgumentParser, args) -> int:
    """Tables and plot of a saved record (e.g. measured on a GPU machine without matplotlib)."""
    try:
        record = json.loads(Path(args.from_json).expanduser().read_text())
        if record.get("format") != JSON_FORMAT:
            raise ValueError(f"format must be {JSON_FORMAT!r}, got {record.get('format')!r}")
        results = [result_from_record(case) for case in record["cases"]]
    except (ValueError, KeyError, TypeError) as exc:
        parser.error(f"--from-json {args.from_json}: not a cuattn bench record ({type(exc).__name__}: {exc})")
    if args.family != "all":
        results = [r for r in results if r.family == args.family]
    print(format_environment({k: record[k] for k in ("device", "versions")}, record["command"]))
    print(format_ceilings(record["ceilings"]))
    for family in FAMILY_ORDER:
        if any(r.family == family for r in results):
            print("\n" + format_table(family, results, record["dtype"]))
    if args.plot:
        env = {k: record[k] for k in ("device", "versions")}
        draw_plot(plot_panels(results, record["ceilings"]), args.plot,
                  title=plot_title(env, record["dtype"], record["date"]))
        print(f"wrote {args.plot}")
    return 0


def result_from_record(case: dict) -> _benchcases.Result:
    """Inverse of Result.record()."""
    shape = _benchcases.Shape(**{f.name: case[f.name] for f in dataclasses.fields(_benchcases.Shape)})
    status = case["status"]
    return _benchcases.Result(
        case["family"], case["impl"], shape, case["dtype"], ms=case["ms"], rate=case["rate"], info=case["info"],
        skipped=case["reason"] if status == "skipped" else "", error=case["reason"] if status == "error" else "")


# ---------------------------------------------------------------------------------------------
# Measuring (GPU)


def environment() -> dict:
    """Device and versions, for the header, the JSON record and the plot's title."""
    import cupy

    from . import __version__, _jit, _tools

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {
        "device": {
            "name": name,
            "compute_capability": f"{props['major']}.{props['minor']}",
            "sms": int(props["multiProcessorCount"]),
            "memory_gib": round(props["totalGlobalMem"] / _benchcases.BYTES_PER_GIB, 1),
            "arch": _jit.target_arch(device.id),
            # the CUDA version the driver supports, and the one CuPy's runtime was built for
            "driver_cuda": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
            "runtime_cuda": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        },
        "versions": {
            "cuattn": __version__,
            "python": platform.python_version(),
            "numpy": _tools._version("numpy"),
            "cupy": _tools._version("cupy"),
            "ml_dtypes": _tools._version("ml_dtypes"),
            "torch": _tools._version("torch"),
            "nvrtc": ".".join(map(str, _jit.nvrtc_version())),
        },
    }


def _cuda_version(code: int) -> str:
    """CUDA's integer version (12080) as text (12.8)."""
    return f"{code // 1000}.{code % 1000 // 10}"


def measure_ceilings(dtype=BFLOAT16) -> dict:
    """The device's copy bandwidth and dense GEMM rate in the sweep's dtype (float16 where CuPy's
    matmul refuses it), measured now, in the same run and at the same clocks as the sweep."""
    import cupy

    copy_tbps = _bench.copy_bandwidth()
    gemm_tflops, gemm_dtype = _bench.gemm_rate(dtype=dtype)
    cupy.get_default_memory_pool().free_all_blocks()
    return {"copy_tbps": copy_tbps, "copy_bytes": _bench.COPY_BYTES, "gemm_tflops": gemm_tflops,
            "gemm_dtype": gemm_dtype, "gemm_size": _bench.GEMM_SIZE}


def run(families, dtype, quick: bool, stream=None) -> list[_benchcases.Result]:
    """Every case of ``families``, in order, with a progress bar; each family's table is printed
    as soon as its cases are done. A case that raises is recorded as an error and the sweep goes on."""
    cases = [case for family in families for case in _benchcases.FAMILIES[family].cases(quick)]
    progress = Progress(len(cases), sys.stderr if stream is None else stream)
    results: list[_benchcases.Result] = []
    for family in families:
        family_results = []
        for case in (c for c in cases if c.family == family):
            progress.step(case.label)
            try:
                family_results += _benchcases.run_case(case, dtype)
            except Exception as exc:  # one broken case must not lose the rest of a long sweep
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                family_results += [_benchcases.Result(case.family, impl, case.shape,
                                                      dtype_name(_benchcases.impl_dtype(impl, dtype)), error=message)
                                   for impl in case.impls]
            _release_memory()
        progress.clear()
        print("\n" + format_table(family, family_results, dtype_name(dtype)), flush=True)
        results += family_results
    progress.finish()
    return results


def _release_memory() -> None:
    """Return the cached blocks of CuPy's pool (and torch's, if loaded) between cases, so that
    one case's inputs never crowd the next one's."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class Progress:
    """A one-line progress bar over the cases: redrawn in place on a terminal, one line per case
    otherwise (logs stay readable)."""

    def __init__(self, total: int, stream, width: int = PROGRESS_WIDTH):
        self.total, self.stream, self.width = total, stream, width
        self.done = 0
        self.started = time.monotonic()
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())
        self._last_length = 0

    def render(self, label: str) -> str:
        filled = self.width * self.done // max(self.total, 1)
        elapsed = time.monotonic() - self.started
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done + 1}/{self.total} {elapsed:5.0f} s  {label}"

    def step(self, label: str) -> None:
        """Show that the next case, ``label``, starts now."""
        line = self.render(label)
        if self.interactive:
            self.stream.write("\r" + line.ljust(self._last_length))
            self._last_length = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def clear(self) -> None:
        if self.interactive and self._last_length:
            self.stream.write("\r" + " " * self._last_length + "\r")
            self.stream.flush()
            self._last_length = 0

    def finish(self) -> None:
        self.clear()
        self.stream.write(f"{self.done}/{self.total} cases in {time.monotonic() - self.started:.0f} s\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Tables (pure)


def format_environment(env: dict, command: str) -> str:
    d, v = env["device"], env["versions"]
    return (f"{command}\n{d['name']} (compute capability {d['compute_capability']}, {d['sms']} SMs, "
            f"{d['memory_gib']} GiB, arch {d['arch']}), driver for CUDA {d['driver_cuda']}, "
            f"CUDA runtime {d['runtime_cuda']}\n"
            + ", ".join(f"{key} {value}" for key, value in v.items()))


def format_ceilings(ceilings: dict) -> str:
    n = ceilings["gemm_size"]
    return (f"ceilings: device copy {ceilings['copy_tbps']:.2f} TB/s "
            f"({ceilings['copy_bytes'] / _benchcases.BYTES_PER_GIB:g} GiB device-to-device, bytes read + written); "
            f"{ceilings['gemm_dtype']} GEMM {ceilings['gemm_tflops']:.1f} TFLOP/s (cupy.matmul {n} x {n} x {n})")


def _row_labels(family: str, shape: _benchcases.Shape) -> list[tuple[str, str]]:
    """The columns that name a row: N, D, mask, B x H; or B, L and the KV bytes read."""
    if family in ("forward", "backward"):
        return [("N", str(shape.seqlen)), ("D", str(shape.head_dim)), ("mask", "causal" if shape.causal else "full"),
                ("B x H", f"{shape.batch} x {shape.q_heads}")]
    kv_mib = _bench.kv_bytes(shape.batch, shape.seqlen, shape.kv_heads, shape.head_dim) / _benchcases.BYTES_PER_MIB
    return [("B", str(shape.batch)), ("L", str(shape.seqlen)), ("KV MiB", f"{kv_mib:g}")]


def _format_rate(result, unit: str) -> str:
    if result is None:
        return ""
    if result.error:
        return "error"
    if result.skipped:
        return "skip"
    return f"{result.rate:.2f}" if unit == _benchcases.TBPS else f"{result.rate:.1f}"


def format_ratio(subject, baseline) -> str:
    """subject / baseline of two results' rates; empty when either has none."""
    if subject is None or baseline is None or not (subject.ok and baseline.ok) or baseline.rate <= 0:
        return ""
    ratio = subject.rate / baseline.rate
    return f"{ratio:.0f}x" if ratio >= RATIO_PLAIN_ABOVE else f"{ratio:.2f}"


def format_table(family: str, results: list, dtype: str) -> str:
    """A Markdown table (aligned, so it reads in a terminal too) of one family's results: one row
    per shape in sweep order, one column per implementation, then the ratio columns; skipped and
    failed cells are explained below it."""
    spec = _benchcases.FAMILIES[family]
    results = [r for r in results if r.family == family]
    if not results:
        return f"{family}: no results"
    shapes = list(dict.fromkeys(r.shape for r in results))
    cells = {(r.shape, r.impl): r for r in results}
    impls = [impl for impl in spec.impls if any(r.impl == impl for r in results)]
    subject, baselines = impls[0], impls[1:]
    header = ([name for name, _ in _row_labels(family, shapes[0])] + impls
              + [f"{subject}/{b}" for b in baselines])
    rows = []
    for shape in shapes:
        rows.append([value for _, value in _row_labels(family, shape)]
                    + [_format_rate(cells.get((shape, impl)), spec.unit) for impl in impls]
                    + [format_ratio(cells.get((shape, subject)), cells.get((shape, b))) for b in baselines])
    label_columns = len(_row_labels(family, shapes[0]))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(values):
        return "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths)) + " |"

    rule = "|" + "|".join(("-" * (w + 2)) if i < label_columns else ("-" * (w + 1) + ":")
                          for i, w in enumerate(widths)) + "|"
    other_dtypes = sorted({f"{r.impl} in {r.dtype}" for r in results if r.dtype != dtype})
    title = f"{family} ({spec.unit}, {dtype}{''.join('; ' + d for d in other_dtypes)}): {spec.title}"
    lines = [title, "", line(header), rule, *(line(row) for row in rows)]
    notes = _notes(family, results)
    return "\n".join(lines + ([""] + notes if notes else []))


def _notes(family: str, results: list) -> list[str]:
    """One line per (implementation, reason) of the skipped and failed cells, naming the shapes."""
    spec = _benchcases.FAMILIES[family]
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        if r.error or r.skipped:
            kind = "error" if r.error else "skipped"
            grouped.setdefault((kind, r.impl, r.error or r.skipped), []).append(spec.shape_id(r.shape))
    return [f"{kind}: {impl} at {', '.join(ids)}: {reason}" for (kind, impl, reason), ids in grouped.items()]


# ---------------------------------------------------------------------------------------------
# JSON record (pure)


def build_record(results: list, *, ceilings: dict, environment: dict, command: str, dtype: str, quick: bool,
                 date: str | None = None) -> dict:
    """Everything a reader needs to trust or redo a figure: the command, date, device, versions,
    ceilings, and every case with its shape, dtype, time, rate and status."""
    if date is None:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "format": JSON_FORMAT,
        "command": command,
        "date": date,
        "dtype": dtype,
        "quick": quick,
        **environment,
        "ceilings": ceilings,
        "units": {family: spec.unit for family, spec in _benchcases.FAMILIES.items()},
        "cases": [r.record() for r in results],
    }


def _json_value(value):
    """numpy scalars (sizes and rates can be numpy numbers) as plain Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON: {value!r}")


def write_json(path, record: dict) -> None:
    """Strict JSON (a NaN or infinity is an error, not a token other parsers refuse)."""
    text = json.dumps(record, indent=2, allow_nan=False, default=_json_value)
    Path(path).expanduser().write_text(text + "\n")


# ---------------------------------------------------------------------------------------------
# Plot (panels are pure; drawing needs matplotlib)


@dataclasses.dataclass
class Panel:
    """One subplot: throughput against sequence length, one series per implementation."""

    title: str
    unit: str
    series: dict[str, list[tuple[int, float]]]  # impl -> [(seqlen, rate)], sorted by seqlen
    xticks: list[tuple[int, str]]
    ceiling: tuple[str, float] | None


def _panel_key(result) -> tuple:
    s = result.shape
    if result.family in ("forward", "backward"):
        return (FAMILY_ORDER.index(result.family), s.head_dim, s.causal)
    return (FAMILY_ORDER.index(result.family), s.head_dim, False)


def _panel_title(result) -> str:
    s = result.shape
    if result.family in ("forward", "backward"):
        return f"{result.family}, D = {s.head_dim}, {'causal' if s.causal else 'full'}"
    if result.family == "paged":
        return f"paged decode (block {s.block_size}) vs contiguous, GQA {s.q_heads}/{s.kv_heads}, D = {s.head_dim}"
    return f"decode, GQA {s.q_heads}/{s.kv_heads}, D = {s.head_dim}"


def plot_panels(results: list, ceilings: dict | None) -> list[Panel]:
    """Group results into panels, one per (family, head dim, mask), in sweep order; each carries
    the ceiling of its unit (GEMM rate for TFLOP/s, copy bandwidth for TB/s)."""
    groups: dict[tuple, list] = {}
    for r in results:
        groups.setdefault(_panel_key(r), []).append(r)
    panels = []
    for key in sorted(groups):
        members = groups[key]
        family = members[0].family
        spec = _benchcases.FAMILIES[family]
        series = {}
        for impl in spec.impls:
            points = sorted((r.shape.seqlen, r.rate) for r in members if r.impl == impl and r.ok)
            if points:
                series[impl] = points
        with_batch = family not in ("forward", "backward")
        ticks = sorted({(r.shape.seqlen, f"{r.shape.seqlen}\nB={r.shape.batch}" if with_batch else str(r.shape.seqlen))
                        for r in members})
        ceiling = None
        if ceilings:
            ceiling = ((f"{ceilings['gemm_dtype']} GEMM {ceilings['gemm_tflops']:.0f}", ceilings["gemm_tflops"])
                       if spec.unit == _benchcases.TFLOPS
                       else (f"copy {ceilings['copy_tbps']:.2f}", ceilings["copy_tbps"]))
        panels.append(Panel(_panel_title(members[0]), spec.unit, series, ticks, ceiling))
    return panels


def plot_title(env: dict, dtype: str, date: str) -> str:
    d, v = env["device"], env["versions"]
    return (f"cuattn {v['cuattn']} on {d['name']} ({dtype}), CuPy {v['cupy']}, torch {v['torch']}, "
            f"NVRTC {v['nvrtc']}, {date[:10]}")


def draw_plot(panels: list[Panel], path, title: str = "") -> None:
    """Save the panels as one figure; each ceiling is a dashed horizontal line."""
    plt = import_matplotlib()
    columns = min(len(panels), PLOT_COLUMNS) or 1
    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows),
                             squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for impl, points in panel.series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=impl)
        if panel.ceiling is not None:
            label, value = panel.ceiling
            ax.axhline(value, color="gray", linestyle="--", linewidth=1, label=label)
        ax.set_xscale("log", base=2)
        if panel.xticks:
            ax.set_xticks([x for x, _ in panel.xticks], [label for _, label in panel.xticks])
            ax.minorticks_off()
        highest = max([y for points in panel.series.values() for _, y in points]
                      + ([panel.ceiling[1]] if panel.ceiling else []), default=1.0)
        ax.set_ylim(0, highest * PLOT_HEADROOM)
        ax.set_title(panel.title, fontsize="medium")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(panel.unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(Path(path).expanduser(), dpi=PLOT_DPI)
    plt.close(fig)
