"""`python -m cuattn bench`: its argument errors, tables, JSON record, plot panels and progress bar.

The CPU tests feed fabricated results to the pure functions of `cuattn.bench` (and run the
whole command with the measuring parts replaced), so they check formatting and records without
a GPU. The GPU test runs a real tiny sweep in a subprocess and reads back its JSON.
"""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from cuattn.bench import cases as bench_cases
from cuattn.bench import cli, plot, report
from cuattn.__main__ import main

CEILINGS = {"copy_tbps": 4.22, "copy_bytes": 1 << 30, "gemm_tflops": 743.0, "gemm_dtype": "bfloat16",
            "gemm_size": 8192}
ENVIRONMENT = {
    "device": {"name": "NVIDIA H200", "compute_capability": "9.0", "sms": 132, "memory_gib": 139.8,
               "arch": "sm_90a", "driver_cuda": "13.0", "runtime_cuda": "13.0"},
    "versions": {"cuattn": "0.1.0", "python": "3.12.3", "numpy": "2.5.2", "cupy": "14.2.0", "ml_dtypes": "0.6.0",
                 "torch": "2.11.0", "nvrtc": "13.0"},
}
N_SMALL, N_LARGE, HEAD_DIM = 1024, 16384, 128
NAIVE_SKIP = "naive CuPy runs up to N = 4096"


def result(family, impl, shape, rate=None, *, dtype="bfloat16", skipped="", error=""):
    ms = None if rate is None else 1.0 / rate
    return bench_cases.Result(family, impl, shape, dtype, ms, rate, {"ms": ms}, skipped, error)


def forward_results():
    """Two shapes x four implementations; naive CuPy skipped at 16k."""
    small = bench_cases.attention_shape(N_SMALL, HEAD_DIM, False)
    large = bench_cases.attention_shape(N_LARGE, HEAD_DIM, True)
    return [
        result("forward", "cuattn", small, 316.7),
        result("forward", "torch-flash", small, 318.7),
        result("forward", "torch-cudnn", small, 542.6),
        result("forward", "naive-cupy", small, 11.8, dtype="float16"),
        result("forward", "cuattn", large, 340.3),
        result("forward", "torch-flash", large, 323.1),
        result("forward", "torch-cudnn", large, 567.1),
        result("forward", "naive-cupy", large, dtype="float16", skipped=NAIVE_SKIP),
    ]


def decode_results():
    shape = bench_cases.decode_shape(1, 32768)
    return [
        result("decode", "cuattn", shape, 2.95),
        result("decode", "torch-flash", shape, skipped="torch is not importable (No module named 'torch')"),
        result("decode", "torch-cudnn", shape, error="RuntimeError: boom"),
    ]


def paged_results():
    shape = bench_cases.decode_shape(8, 8192, bench_cases.BLOCK_SIZE)
    return [result("paged", "paged", shape, 2.46), result("paged", "contiguous", shape, 3.66)]


def table_row(table: str, *starts: str) -> list[str]:
    """The cells of the table row whose first cells are ``starts``."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:len(starts)] == list(starts):
            return cells
    raise AssertionError(f"no row starting {starts} in\n{table}")


# ---------------------------------------------------------------------------------------------
# Argument errors: exit 2 with a message naming the argument, never a traceback


@pytest.mark.parametrize("argv, message", [
    (["bench", "sideways"], "argument family: invalid choice: 'sideways'"),
    (["bench", "--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32' (choose from 'bf16', 'fp16')"),
    (["bench", "decode", "--quick", "--plot"], "argument --plot: expected one argument"),
    (["bench", "decode", "--repeat", "3"], "unrecognized arguments: --repeat 3"),
    (["bench", "overhead", "--quick"], "bench overhead takes --dtype and --json only (no --plot, --from-json or --quick)"),
])
def test_argparse_refusals(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m cuattn") and message in err


def test_plot_without_matplotlib_names_the_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--plot", str(tmp_path / "bench.png")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err and "cuattn[plot]" in err


def test_plot_needs_an_image_suffix(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--plot", str(tmp_path / "bench.txt")])
    assert exit_info.value.code == 2
    assert "--plot must name a .png, .pdf or .svg file" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_folder_must_exist(capsys, tmp_path, option):
    missing = tmp_path / "no_such_folder" / "bench.png"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", option, str(missing)])
    assert exit_info.value.code == 2
    assert f"{option} {missing}: its folder {missing.parent} does not exist" in capsys.readouterr().err


def test_no_gpu_is_an_argument_error_before_any_measuring(capsys, monkeypatch):
    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: "no CUDA device was found")

    def must_not_run():
        raise AssertionError("measured without a GPU")

    monkeypatch.setattr(cli, "environment", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--quick"])
    assert exit_info.value.code == 2
    assert "bench measures on a CUDA device: no CUDA device was found" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Tables


def test_forward_table_has_a_column_per_impl_and_ratios():
    table = report.format_table("forward", forward_results(), "bfloat16")
    lines = table.splitlines()
    assert lines[0].startswith("forward (TFLOP/s, bfloat16; naive-cupy in float16):")
    header = [c.strip() for c in lines[2].strip().strip("|").split("|")]
    assert header == ["N", "D", "mask", "B x H", "cuattn", "torch-flash", "torch-cudnn", "naive-cupy",
                      "cuattn/torch-flash", "cuattn/torch-cudnn", "cuattn/naive-cupy"]
    assert table_row(table, "1024", "128", "full") == [
        "1024", "128", "full", "32 x 16", "316.7", "318.7", "542.6", "11.8", "0.99", "0.58", "27x"]
    assert table_row(table, "16384", "128", "causal") == [
        "16384", "128", "causal", "2 x 16", "340.3", "323.1", "567.1", "skip", "1.05", "0.60", ""]
    assert f"skipped: naive-cupy at N16384-d128-causal: {NAIVE_SKIP}" in lines
    # every line of the table has the same width: the columns are aligned
    assert len({len(line) for line in lines if line.startswith("|")}) == 1


def test_decode_table_marks_skips_and_errors():
    table = report.format_table("decode", decode_results(), "bfloat16")
    assert table_row(table, "1", "32768") == ["1", "32768", "128", "2.95", "skip", "error", "", ""]
    assert "skipped: torch-flash at B1-L32768: torch is not importable (No module named 'torch')" in table
    assert "error: torch-cudnn at B1-L32768: RuntimeError: boom" in table


def test_paged_table_divides_paged_by_contiguous():
    table = report.format_table("paged", paged_results(), "bfloat16")
    header = [c.strip() for c in table.splitlines()[2].strip().strip("|").split("|")]
    assert header[-3:] == ["paged", "contiguous", "paged/contiguous"]
    assert table_row(table, "8", "8192") == ["8", "8192", "256", "2.46", "3.66", "0.67"]


@pytest.mark.parametrize("subject, baseline, expected", [(3.0, 2.0, "1.50"), (340.0, 11.8, "29x"), (1.0, None, "")])
def test_format_ratio(subject, baseline, expected):
    shape = bench_cases.decode_shape(1, 1024)
    a = result("decode", "cuattn", shape, subject)
    b = result("decode", "torch-flash", shape, baseline, skipped="" if baseline else "no torch")
    assert report.format_ratio(a, b) == expected


def test_ceilings_line():
    line = report.format_ceilings(CEILINGS)
    assert "device copy 4.22 TB/s" in line and "bfloat16 GEMM 743.0 TFLOP/s (cupy.matmul 8192 x 8192 x 8192)" in line


# ---------------------------------------------------------------------------------------------
# JSON record


def written_record(tmp_path):
    """The fabricated results of every family, written as a JSON record: (results, path)."""
    results = forward_results() + decode_results() + paged_results()
    record = report.build_record(results, ceilings=CEILINGS, environment=ENVIRONMENT,
                                    command="python -m cuattn bench all", dtype="bfloat16", quick=False,
                                    date="2026-11-29T12:00:00+00:00")
    path = tmp_path / "bench.json"
    report.write_json(path, record)
    return results, path


def test_json_record_round_trips(tmp_path):
    results, path = written_record(tmp_path)
    loaded = json.loads(path.read_text())
    assert loaded["format"] == report.JSON_FORMAT and loaded["date"] == "2026-11-29T12:00:00+00:00"
    assert loaded["device"]["name"] == "NVIDIA H200" and loaded["versions"]["nvrtc"] == "13.0"
    assert loaded["ceilings"] == CEILINGS
    assert len(loaded["cases"]) == len(results)
    first = loaded["cases"][0]
    assert {k: first[k] for k in ("family", "impl", "id", "batch", "seqlen", "q_heads", "head_dim", "causal",
                                  "dtype", "unit", "rate", "status")} == {
        "family": "forward", "impl": "cuattn", "id": "N1024-d128-full", "batch": 32, "seqlen": 1024,
        "q_heads": 16, "head_dim": 128, "causal": False, "dtype": "bfloat16", "unit": "TFLOP/s",
        "rate": 316.7, "status": "ok"}
    statuses = {(c["family"], c["impl"], c["id"]): (c["status"], c["reason"]) for c in loaded["cases"]}
    assert statuses["forward", "naive-cupy", "N16384-d128-causal"] == ("skipped", NAIVE_SKIP)
    assert statuses["decode", "torch-cudnn", "B1-L32768"] == ("error", "RuntimeError: boom")
    assert loaded["cases"][-1]["block_size"] == bench_cases.BLOCK_SIZE


def test_from_json_prints_the_same_tables_without_a_gpu(capsys, monkeypatch, tmp_path):
    results, path = written_record(tmp_path)
    # replaying must not look for a device
    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: "no GPU here")
    assert main(["bench", "--from-json", str(path)]) == 0
    out, _ = capsys.readouterr()
    for family in ("forward", "decode", "paged"):
        assert report.format_table(family, results, "bfloat16") in out
    assert main(["bench", "decode", "--from-json", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "decode (TB/s" in out and "forward (TFLOP/s" not in out


@pytest.mark.parametrize("content, message", [
    ("{}", r"not a cuattn bench record \(ValueError: format must be 'cuattn-bench/1', got None\)"),
    ("not json", r"not a cuattn bench record \(JSONDecodeError"),
])
def test_from_json_refuses_what_is_not_a_record(capsys, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--from-json", str(path)])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_from_json_needs_the_file(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--from-json", str(missing)])
    assert exit_info.value.code == 2
    assert f"--from-json {missing}: no such file" in capsys.readouterr().err


def test_json_refuses_a_nan_rather_than_writing_invalid_json(tmp_path):
    shape = bench_cases.decode_shape(1, 1024)
    record = report.build_record([result("decode", "cuattn", shape, math.nan)], ceilings=CEILINGS,
                                    environment=ENVIRONMENT, command="", dtype="bfloat16", quick=True)
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        report.write_json(tmp_path / "bench.json", record)


def test_json_refuses_a_value_it_cannot_write_and_writes_no_file(tmp_path):
    path = tmp_path / "bench.json"
    with pytest.raises(TypeError, match=r"^cannot write set to JSON: \{3\}$"):
        report.write_json(path, {"cases": [{"info": {"heads": {3}}}]})
    assert not path.exists()


def _refusing_backend():
    raise RuntimeError("\nNo available kernel.  Aborting execution.\nmore detail")


def _empty_refusal():
    raise RuntimeError("")


@pytest.mark.parametrize("call, reason", [
    (lambda: bench_cases._check_naive("naive-cupy", bench_cases.attention_shape(N_LARGE, HEAD_DIM, True)),
     r"naive CuPy runs up to N = 4096: at N = 16384 its score matrices alone take 16 GiB and the softmax makes "
     r"several copies"),
    (lambda: bench_cases._refused("torch-flash", _refusing_backend),
     r"torch-flash does not run this shape: No available kernel\.  Aborting execution\."),
    (lambda: bench_cases._refused("jax-cudnn", _empty_refusal), r"jax-cudnn does not run this shape: RuntimeError"),
])
def test_skip_reasons_name_the_implementation_and_why(call, reason):
    with pytest.raises(bench_cases.SkipCase, match=rf"^{reason}$"):
        call()


@pytest.mark.parametrize("framework, stand_in, reason", [
    ("torch", None, r"torch is not importable \(.+\)"),  # None in sys.modules: import raises ImportError
    ("torch", types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False)),
     r"torch sees no CUDA device \(a CPU-only build\?\)"),
    ("jax", None, r"jax is not importable \(.+\)"),
    ("jax", types.SimpleNamespace(default_backend=lambda: "cpu"), r"jax runs on cpu, not on the GPU"),
])
def test_skip_reasons_for_a_framework_that_cannot_run_on_the_gpu(monkeypatch, framework, stand_in, reason):
    monkeypatch.setitem(sys.modules, framework, stand_in)
    with pytest.raises(bench_cases.SkipCase, match=rf"^{reason}$"):
        {"torch": bench_cases._torch, "jax": bench_cases._jax}[framework]()


# ---------------------------------------------------------------------------------------------
# Plot panels and drawing


def test_plot_panels_one_per_family_head_dim_and_mask():
    panels = plot.plot_panels(forward_results() + decode_results() + paged_results(), CEILINGS)
    assert [p.title for p in panels] == [
        "forward, D = 128, full", "forward, D = 128, causal", "decode, GQA 32/8, D = 128",
        "paged decode (block 16) vs contiguous, GQA 32/8, D = 128"]
    full, causal, decode, paged = panels
    assert full.series == {"cuattn": [(N_SMALL, 316.7)], "torch-flash": [(N_SMALL, 318.7)],
                           "torch-cudnn": [(N_SMALL, 542.6)], "naive-cupy": [(N_SMALL, 11.8)]}
    assert "naive-cupy" not in causal.series  # skipped: no point
    assert full.ceiling == ("bfloat16 GEMM 743", 743.0) and full.unit == "TFLOP/s"
    assert decode.ceiling == ("copy 4.22", 4.22) and list(decode.series) == ["cuattn"]
    assert decode.xticks == [(32768, "32768\nB=1")]
    assert paged.series == {"paged": [(8192, 2.46)], "contiguous": [(8192, 3.66)]}


def test_draw_plot_writes_an_image(tmp_path):
    import matplotlib  # noqa: F401  (the test extra installs it: a run without it fails here)

    path = tmp_path / "bench.png"
    panels = plot.plot_panels(forward_results() + decode_results() + paged_results(), CEILINGS)
    plot.draw_plot(panels, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# Progress bar and the whole command on fabricated measurements


def test_progress_writes_a_line_per_case_off_a_terminal():
    stream = io.StringIO()
    progress = cli.Progress(2, stream, width=4)
    progress.step("decode B1-L1024 cuattn")
    progress.step("decode B1-L1024 torch-flash")
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[....] 1/2") and lines[0].endswith("decode B1-L1024 cuattn")
    assert lines[1].startswith("[##..] 2/2") and lines[2].startswith("2/2 cases in")


def test_command_end_to_end_on_fabricated_measurements(capsys, monkeypatch, tmp_path):
    """Everything but the measuring: argument checks, tables on stdout, progress on stderr, the
    JSON record, and exit code 1 because one case failed."""
    def fake_run_case(case, dtype):
        if case.impls == ("torch-cudnn",):
            raise RuntimeError("the backend fell over")
        return [result(case.family, impl, case.shape, 1.5) for impl in case.impls]

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(cli, "environment", lambda: ENVIRONMENT)
    monkeypatch.setattr(cli, "measure_ceilings", lambda dtype: CEILINGS)
    monkeypatch.setattr(cli, "_release_memory", lambda: None)
    monkeypatch.setattr(bench_cases, "run_case", fake_run_case)
    path = tmp_path / "bench.json"
    assert main(["bench", "decode", "--quick", "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    shapes = bench_cases.FAMILIES["decode"].shapes(quick=True)
    assert "python -m cuattn bench decode --quick --json" in out and "device copy 4.22 TB/s" in out
    assert table_row(out, str(shapes[0].batch), str(shapes[0].seqlen))[3:] == ["1.50", "1.50", "1.50", "error", "1.00",
                                                                                "1.00", ""]
    assert f"{len(shapes) * len(bench_cases.DECODE_IMPLS)}/{len(shapes) * len(bench_cases.DECODE_IMPLS)} cases" in err
    assert "error: decode torch-cudnn B1-L2048: RuntimeError: the backend fell over" in err
    record = json.loads(path.read_text())
    assert record["quick"] is True and record["dtype"] == "bfloat16"
    assert [c["status"] for c in record["cases"]] == ["ok", "ok", "ok", "error"] * len(shapes)


# ---------------------------------------------------------------------------------------------
# On a GPU: a real tiny sweep


@pytest.mark.gpu
def test_bench_decode_quick_writes_its_json(tmp_path):
    path = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "cuattn", "bench", "decode", "--quick", "--json", str(path)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "decode (TB/s, bfloat16)" in run.stdout and "ceilings: device copy" in run.stdout
    record = json.loads(path.read_text())
    assert record["device"]["name"] and record["versions"]["nvrtc"]
    assert record["ceilings"]["copy_tbps"] > 0 and record["ceilings"]["gemm_tflops"] > 0
    shapes = bench_cases.FAMILIES["decode"].shapes(quick=True)
    assert len(record["cases"]) == len(shapes) * len(bench_cases.DECODE_IMPLS)
    for case in record["cases"]:
        assert case["family"] == "decode" and case["status"] in ("ok", "skipped"), case
        assert case["status"] == "ok" or case["reason"], case
        if case["impl"] == "cuattn":
            assert case["status"] == "ok" and case["rate"] > 0 and case["info"]["graph_ms"] > 0


def test_time_in_turn_interleaves_the_calls_and_reports_medians():
    """timing.time_in_turn times every call once a round, in the calls' order, `before` ahead of
    each, and reports each call's median over the rounds (a fake timer: no GPU)."""
    from cuattn.bench import timing

    order, seen = [], []
    samples = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def timer(fn):
        order.append(fn())
        return next(samples[order[-1]])

    medians = timing.time_in_turn({"a": lambda: "a", "b": lambda: "b"}, 3, before=seen.append, timer=timer)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert seen == order
    assert medians == {"a": 3.0, "b": 4.0}


@pytest.mark.parametrize("order", bench_cases.PAGE_ORDERS)
def test_block_table_uses_every_block_of_the_pool_once(order):
    batch, blocks = 3, 5
    table = bench_cases.block_table(batch, blocks, order, np.random.default_rng(1))
    assert table.shape == (batch, blocks) and table.dtype == np.int32
    assert sorted(table.reshape(-1).tolist()) == list(range(batch * blocks))
    if order == "in-order":
        np.testing.assert_array_equal(table, np.arange(batch * blocks).reshape(batch, blocks))
    elif order == "interleaved":
        # block p of sequence b at p * B + b: the sequences took turns as they grew
        np.testing.assert_array_equal(table, np.arange(blocks)[None, :] * batch + np.arange(batch)[:, None])
    else:
        assert not np.array_equal(table, np.arange(batch * blocks).reshape(batch, blocks))


def test_block_table_refuses_an_unknown_order():
    with pytest.raises(ValueError, match="order must be one of shuffled, in-order, interleaved, got 'sorted'"):
        bench_cases.block_table(2, 2, "sorted")


def test_build_and_info_answer_a_missing_source_folder_in_one_line(tmp_path, monkeypatch, capsys):
    """A CUATTN_SOURCE_DIR without the kernel sources: `build` exits 1 with one line naming the
    variable, `info` reports it and still prints the rest."""
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(tmp_path))
    assert main(["build", "--arch", "sm_80", "--kernels", "cache_write"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m cuattn build: CUATTN_SOURCE_DIR = {tmp_path} holds no "
                                               "common.cuh"), err
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kernel sources   missing (CUATTN_SOURCE_DIR = {tmp_path} holds no common.cuh" in out and "device" in out


def test_alibi_slopes_follow_the_alibi_papers_code():
    """2^(-8 i / H) for a power-of-two H; otherwise the power of two below, then every other slope
    of twice it (H = 6: the four of 4 heads, then 2^-1 and 2^-3 of 8 heads)."""
    np.testing.assert_array_equal(bench_cases.alibi_slopes(4), np.float32([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]))
    np.testing.assert_array_equal(bench_cases.alibi_slopes(6), np.float32([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1,
                                                                      2 ** -3]))
    assert bench_cases.alibi_slopes(1).tolist() == [2 ** -8] and bench_cases.alibi_slopes(25).dtype == np.float32
    assert len(set(bench_cases.alibi_slopes(25).tolist())) == 25


def test_ratio_in_turn_takes_each_rounds_pair():
    """The median and range of the rounds' ratios, each round's numerator over its own denominator."""
    from cuattn.bench import timing

    assert timing.ratio_in_turn([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == (3.0, 2.0, 4.0)
    samples = timing.samples_in_turn({"a": lambda: 1, "b": lambda: 2}, 2, timer=lambda fn: float(fn()))
    assert samples == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    with pytest.raises(ValueError):
        timing.ratio_in_turn([1.0], [1.0, 2.0])
