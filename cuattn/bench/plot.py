"""The plot of a benchmark run: throughput against sequence length, one panel per (family, head
dim, mask), the measured ceiling as a dashed line. matplotlib is optional (``cuattn[plot]``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from . import cases

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
MATPLOTLIB_HINT = "pip install matplotlib (or pip install 'cuattn[plot]')"
# Plot geometry: panels per row, inches per panel, resolution of the saved image.
PLOT_COLUMNS = 4
PANEL_INCHES = (4.2, 3.3)
PLOT_DPI = 130
# Room above the highest point or ceiling for the legend, as a factor on the y axis's top.
PLOT_HEADROOM = 1.4


def import_matplotlib():
    """matplotlib with a file-only backend (no display needed); ImportError names the install."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib, which is not importable ({exc}): {MATPLOTLIB_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
        return (cases.FAMILY_ORDER.index(result.family), s.head_dim, s.causal)
    return (cases.FAMILY_ORDER.index(result.family), s.head_dim, False)


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
        spec = cases.FAMILIES[family]
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
                       if spec.unit == cases.TFLOPS
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
