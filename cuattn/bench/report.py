"""Tables and the JSON record of a benchmark run: pure functions of the results (no GPU).

One Markdown table per family: a row per shape, a column per implementation in TFLOP/s or TB/s,
then cuattn's ratio to each baseline (paged decode: paged / contiguous). The JSON record holds
the command, date, device, versions, ceilings and every case; ``result_from_record`` reads it back.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import numpy as np

from . import cases, timing

JSON_FORMAT = "cuattn-bench/1"
# Ratio columns: a baseline this many times slower is shown without decimals (e.g. "42x").
RATIO_PLAIN_ABOVE = 10.0


def format_environment(env: dict, command: str) -> str:
    d, v = env["device"], env["versions"]
    return (f"{command}\n{d['name']} (compute capability {d['compute_capability']}, {d['sms']} SMs, "
            f"{d['memory_gib']} GiB, arch {d['arch']}), driver for CUDA {d['driver_cuda']}, "
            f"CUDA runtime {d['runtime_cuda']}\n"
            + ", ".join(f"{key} {value}" for key, value in v.items()))


def format_ceilings(ceilings: dict) -> str:
    n = ceilings["gemm_size"]
    return (f"ceilings: device copy {ceilings['copy_tbps']:.2f} TB/s "
            f"({ceilings['copy_bytes'] / cases.BYTES_PER_GIB:g} GiB device-to-device, bytes read + written); "
            f"{ceilings['gemm_dtype']} GEMM {ceilings['gemm_tflops']:.1f} TFLOP/s (cupy.matmul {n} x {n} x {n})")


def _row_labels(family: str, shape: cases.Shape) -> list[tuple[str, str]]:
    """The columns that name a row: N, D, mask, B x H; or B, L and the KV bytes read."""
    if family in ("forward", "backward"):
        return [("N", str(shape.seqlen)), ("D", str(shape.head_dim)), ("mask", "causal" if shape.causal else "full"),
                ("B x H", f"{shape.batch} x {shape.q_heads}")]
    kv_mib = timing.kv_bytes(shape.batch, shape.seqlen, shape.kv_heads, shape.head_dim) / cases.BYTES_PER_MIB
    return [("B", str(shape.batch)), ("L", str(shape.seqlen)), ("KV MiB", f"{kv_mib:g}")]


def _format_rate(result, unit: str) -> str:
    if result is None:
        return ""
    if result.error:
        return "error"
    if result.skipped:
        return "skip"
    return f"{result.rate:.2f}" if unit == cases.TBPS else f"{result.rate:.1f}"


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
    spec = cases.FAMILIES[family]
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
    spec = cases.FAMILIES[family]
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        if r.error or r.skipped:
            kind = "error" if r.error else "skipped"
            grouped.setdefault((kind, r.impl, r.error or r.skipped), []).append(spec.shape_id(r.shape))
    return [f"{kind}: {impl} at {', '.join(ids)}: {reason}" for (kind, impl, reason), ids in grouped.items()]


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
        "units": {family: spec.unit for family, spec in cases.FAMILIES.items()},
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


def result_from_record(case: dict) -> cases.Result:
    """Inverse of Result.record()."""
    shape = cases.Shape(**{f.name: case[f.name] for f in dataclasses.fields(cases.Shape)})
    status = case["status"]
    return cases.Result(
        case["family"], case["impl"], shape, case["dtype"], ms=case["ms"], rate=case["rate"], info=case["info"],
        skipped=case["reason"] if status == "skipped" else "", error=case["reason"] if status == "error" else "")
