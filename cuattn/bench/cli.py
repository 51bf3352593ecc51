"""``python -m cuattn bench``: the standard sweep on this GPU, as tables, a JSON record and a plot.

First the physical ceilings are measured in the same run (device copy bandwidth in TB/s, dense
GEMM rate of cuBLAS in TFLOP/s; ``timing``), then every case of the chosen families (``cases``,
the cases the pytest-benchmark suite runs) with a progress bar on stderr; ``report`` prints the
tables and writes ``--json``, ``plot`` draws ``--plot``. ``bench overhead`` (``overhead``)
measures host time per call instead.

Only ``environment``, ``measure_ceilings`` and ``run`` touch the device; everything they feed
is tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from .. import _jit
from .._arrays import BFLOAT16, FLOAT16, dtype_name
from . import cases, overhead, plot, report, timing

# "overhead" (host time per call, overhead.py) is its own run, not part of "all"
FAMILY_CHOICES = (*cases.FAMILY_ORDER, "all", "overhead")
DTYPES = {"bf16": BFLOAT16, "fp16": FLOAT16}
# Progress bar: characters of the bar.
PROGRESS_WIDTH = 24
DESCRIPTION = """\
Measure this GPU's copy bandwidth and GEMM rate, then run the standard sweep
(the cases of cuattn/bench/cases.py, which tests/bench also runs) and print one
table per family: TFLOP/s or TB/s of each implementation (cuattn; torch SDPA's
flash and cuDNN backends when torch is installed; naive CuPy) and cuattn's
ratio to each. A progress bar goes to stderr."""
EPILOG = """examples:
  python -m cuattn bench                          # every family, bf16
  python -m cuattn bench decode --quick           # a few small shapes: a smoke test
  python -m cuattn bench all --json bench.json --plot bench.png
"""


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
                       help=f"draw throughput against sequence length ({', '.join(plot.PLOT_SUFFIXES)}; needs matplotlib)")
    bench.add_argument("--quick", action="store_true", help="a tiny sweep of small shapes, for smoke tests")
    bench.add_argument("--from-json", metavar="FILE",
                       help="measure nothing: print the tables (and --plot) of a record --json wrote")
    return bench


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; otherwise the one-line reason every entry point gives."""
    return _jit.gpu_unavailable_reason()


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
        if suffix not in plot.PLOT_SUFFIXES:
            parser.error(f"--plot must name a {', '.join(plot.PLOT_SUFFIXES[:-1])} or {plot.PLOT_SUFFIXES[-1]} file, "
                         f"got {args.plot!r} (suffix {suffix!r})")
        try:
            plot.import_matplotlib()
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
    families = cases.FAMILY_ORDER if args.family == "all" else (args.family,)
    dtype = DTYPES[args.dtype]
    command = shlex.join(["python", "-m", "cuattn", *argv])
    env = environment()
    print(report.format_environment(env, command))
    if args.family == "overhead":
        return _overhead(args, env, command, dtype)
    ceilings = measure_ceilings(dtype)
    print(report.format_ceilings(ceilings))
    results = run(families, dtype, args.quick)
    record = report.build_record(results, ceilings=ceilings, environment=env, command=command,
                          dtype=dtype_name(dtype), quick=args.quick)
    if args.json:
        report.write_json(args.json, record)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot.draw_plot(plot.plot_panels(results, ceilings), args.plot, title=plot.plot_title(env, dtype_name(dtype), record["date"]))
        print(f"wrote {args.plot}")
    errors = [r for r in results if r.error]
    for r in errors:
        print(f"error: {r.family} {r.impl} {cases.FAMILIES[r.family].shape_id(r.shape)}: {r.error}",
              file=sys.stderr)
    return 1 if errors else 0


def _overhead(args, env: dict, command: str, dtype) -> int:
    """``bench overhead``: host us per call and eager throughput, by function and input framework."""
    results = overhead.run(dtype)
    print("\n" + overhead.format_table(results))
    if args.json:
        record = {"format": report.JSON_FORMAT + "+overhead", "command": command, **env,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "calls": overhead.CALLS, "rows": [overhead.record(r) for r in results]}
        report.write_json(args.json, record)
        print(f"\nwrote {args.json}")
    return 0


def replay(parser: argparse.ArgumentParser, args) -> int:
    """Tables and plot of a saved record (e.g. measured on a GPU machine without matplotlib)."""
    try:
        record = json.loads(Path(args.from_json).expanduser().read_text())
        if record.get("format") != report.JSON_FORMAT:
            raise ValueError(f"format must be {report.JSON_FORMAT!r}, got {record.get('format')!r}")
        results = [report.result_from_record(case) for case in record["cases"]]
    except (ValueError, KeyError, TypeError) as exc:
        parser.error(f"--from-json {args.from_json}: not a cuattn bench record ({type(exc).__name__}: {exc})")
    if args.family != "all":
        results = [r for r in results if r.family == args.family]
    print(report.format_environment({k: record[k] for k in ("device", "versions")}, record["command"]))
    print(report.format_ceilings(record["ceilings"]))
    for family in cases.FAMILY_ORDER:
        if any(r.family == family for r in results):
            print("\n" + report.format_table(family, results, record["dtype"]))
    if args.plot:
        env = {k: record[k] for k in ("device", "versions")}
        plot.draw_plot(plot.plot_panels(results, record["ceilings"]), args.plot,
                  title=plot.plot_title(env, record["dtype"], record["date"]))
        print(f"wrote {args.plot}")
    return 0


def environment() -> dict:
    """Device and versions, for the header, the JSON record and the plot's title."""
    import cupy

    from .. import __version__, _tools

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {
        "device": {
            "name": name,
            "compute_capability": f"{props['major']}.{props['minor']}",
            "sms": int(props["multiProcessorCount"]),
            "memory_gib": round(props["totalGlobalMem"] / cases.BYTES_PER_GIB, 1),
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

    copy_tbps = timing.copy_bandwidth()
    gemm_tflops, gemm_dtype = timing.gemm_rate(dtype=dtype)
    cupy.get_default_memory_pool().free_all_blocks()
    return {"copy_tbps": copy_tbps, "copy_bytes": timing.COPY_BYTES, "gemm_tflops": gemm_tflops,
            "gemm_dtype": gemm_dtype, "gemm_size": timing.GEMM_SIZE}


def run(families, dtype, quick: bool, stream=None) -> list[cases.Result]:
    """Every case of ``families``, in order, with a progress bar; each family's table is printed
    as soon as its cases are done. A case that raises is recorded as an error and the sweep goes on."""
    todo = [case for family in families for case in cases.FAMILIES[family].cases(quick)]
    progress = Progress(len(todo), sys.stderr if stream is None else stream)
    results: list[cases.Result] = []
    for family in families:
        family_results = []
        for case in (c for c in todo if c.family == family):
            progress.step(case.label)
            try:
                family_results += cases.run_case(case, dtype)
            except Exception as exc:  # one broken case must not lose the rest of a long sweep
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                family_results += [cases.Result(case.family, impl, case.shape,
                                                dtype_name(cases.impl_dtype(impl, dtype)), error=message)
                                   for impl in case.impls]
            _release_memory()
        progress.clear()
        print("\n" + report.format_table(family, family_results, dtype_name(dtype)), flush=True)
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
