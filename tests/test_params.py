"""Kernel parameter structs: the host's NumPy mirror of cuda_src/params.cuh has the C layout.

The host dtype is parsed from the header itself, so field order and types agree by construction;
what could still differ is padding. The layout check needs NVRTC but no GPU: for every struct it
compiles a static_assert that the C struct's sizeof equals NumPy's itemsize (NVRTC has no
offsetof; every GPU test then exercises the fields through the kernels).
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn import _jit, _params

STRUCTS = {"FwdParams": "<__half>", "BwdParams": "<__nv_bfloat16>", "DecodeParams": "<__nv_bfloat16, cuattn::e4m3>",
           "CombineParams": "<float, __half>", "CacheParams": "<float, cuattn::e4m3>", "TileOrderParams": "", "CopyParams": "",
           "Fp8TransposeParams": ""}


def test_every_struct_of_the_header_is_mirrored():
    header = (_jit.source_dir() / _params.HEADER).read_text()
    assert {name for name, _ in _params._STRUCT_RE.findall(header)} == set(STRUCTS)
    for name in STRUCTS:
        dtype = _params.struct_dtype(name)
        assert dtype.names, name
        # every member line of the struct became a field, in order
        body = header[header.index(f"struct {name} {{"):]
        body = body[:body.index("\n};")]
        declared = [line.split(";")[0].split()[-1].lstrip("*") for line in body.splitlines()[1:] if ";" in line]
        assert list(dtype.names) == declared, name


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_host_size_equals_the_compilers(name, tmp_path, monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the layout check compiles with NVRTC")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    dtype = _params.struct_dtype(name)
    ctype = f"cuattn::{name}{STRUCTS[name]}"
    asserts = [f"using Checked = {ctype};", f"static_assert(sizeof(Checked) == {dtype.itemsize}, \"sizeof\");"]
    source = tmp_path / "layout_check.cu"
    source.write_text('#include "params.cuh"\n' + "\n".join(asserts)
                      + "\ntemplate <int N> __global__ void layout_check_kernel(int* size) { *size = sizeof(Checked) + N; }\n")
    sources = tmp_path / "sources"
    sources.mkdir()
    for path in _jit.source_dir().iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    (sources / "layout_check.cu").write_bytes(source.read_bytes())
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(sources))
    compiled = _jit.compile_kernel(_jit.KernelSpec("layout_check.cu", "layout_check_kernel<1>"), "sm_80")
    assert compiled.lowered_name


def test_pack_is_strict_about_fields():
    dtype = _params.struct_dtype("CacheParams")
    fields = {name: 0 for name in dtype.names}
    packed = _params.pack("CacheParams", **{**fields, "num_tokens": 7, "k_pages": 0x1000})
    assert packed["num_tokens"] == 7 and packed["k_pages"] == 0x1000 and packed.dtype == dtype
    with pytest.raises(TypeError, match=r"CacheParams: fields missing \['num_blocks'\], unknown \[\]"):
        _params.pack("CacheParams", **{k: v for k, v in fields.items() if k != "num_blocks"})
    with pytest.raises(TypeError, match=r"unknown \['nmu_tokens'\]"):
        _params.pack("CacheParams", **fields, nmu_tokens=3)


def test_pointers_come_from_arrays_ints_or_none():
    class Tensor:  # torch's way of telling its address
        def data_ptr(self):
            return 0xABC0

    class Memory:
        ptr = 0x1230

    class CupyLike:
        data = Memory()

    assert _params.pointer(None) == 0
    assert _params.pointer(np.uint64(16)) == 16
    assert _params.pointer(Tensor()) == 0xABC0
    assert _params.pointer(CupyLike()) == 0x1230


def test_an_unmirrorable_member_type_is_named(tmp_path, monkeypatch):
    (tmp_path / _params.HEADER).write_text("struct BadParams {\n  double x;\n};\n")
    with pytest.raises(ValueError, match=r"BadParams.x has type double, which the host cannot mirror"):
        _params._parse(tmp_path / _params.HEADER)


# The constants the host sizes launches with; each must equal the compiler's value.
HOST_CONSTANTS = ["kDecodeWarps", "kDecodeBlockN", "kPadElems", "kCombineThreads", "kCombineUnroll",
                  "kCacheThreads", "kPreprocessWarps", "kConvertThreads", "kBwdSm90BlockN", "kBwdSm90Stages",
                  "kSwizzleAtomBytes", "kWarpSize"]


def test_host_constants_equal_the_compilers(tmp_path, monkeypatch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the check compiles with NVRTC")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "sources"
    sources.mkdir()
    for path in _jit.source_dir().iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    checks = [f'static_assert({name} == {_params.constant(name)}, "{name}");' for name in HOST_CONSTANTS
              if name != "kPadElems"]
    checks.append(f'static_assert(SmemRow<64>::kPadElems == {_params.constant("kPadElems")}, "kPadElems");')
    (sources / "constants_check.cu").write_text(
        '#include "decode.cu"\n#include "flash_bwd.cu"\n#include "cache_ops.cu"\nnamespace cuattn {\n'
        + "\n".join(checks) + "\n}\ntemplate <int N> __global__ void constants_check_kernel(int* out) { *out = N; }\n")
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(sources))
    _jit.compile_kernel(_jit.KernelSpec("constants_check.cu", "constants_check_kernel<1>"), "sm_90a")


def test_constants_are_evaluated_in_dependency_order_and_conflicts_refused(tmp_path):
    (tmp_path / "a.cuh").write_text("constexpr int kLate = kEarly * 4;\nconstexpr int kTwice = 1;\n"
                                    "template <int M> struct S { static constexpr int kRows = 16 * M; };\n")
    (tmp_path / "b.cuh").write_text("constexpr int kEarly = 8 / 2;\nconstexpr int kTwice = 2;\n")
    values = _params._constants(tmp_path)
    assert values["kEarly"] == 4 and values["kLate"] == 16
    assert values["kTwice"] is None and "kRows" not in values


def test_constant_lookup_errors_name_the_constant(tmp_path, monkeypatch):
    with pytest.raises(KeyError, match=r"kNoSuchConstant is not a constant the host can evaluate in "):
        _params.constant("kNoSuchConstant")
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"CUATTN_SOURCE_DIR = {tmp_path} holds no common.cuh: point it at a "
                                                r"copy of cuattn's cuda_src/ folder"):
        _params.constant("kTwice")
    (tmp_path / "common.cuh").write_text("")
    (tmp_path / "a.cuh").write_text("constexpr int kTwice = 1;\n")
    (tmp_path / "b.cuh").write_text("constexpr int kTwice = 2;\n")
    with pytest.raises(KeyError, match=r"kTwice is declared with two values in "):
        _params.constant("kTwice")
