"""TMA tensor maps (cuattn/_tma.py): which views the Hopper forward's copy engine can read, and
the driver's encoding (GPU). The forward tests run every case through the maps on sm_90a."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cuattn
from cuattn import _params, _tma
from conftest import BF16

attention_module = importlib.import_module("cuattn.attention")
BOX = (64, 128, 1, 1)


def layout(dims, strides, dtype=np.float16):
    return _tma.MapLayout.of(dtype, dims, strides, BOX)


def test_contiguous_and_transposed_views_are_readable():
    # (D, S, H, B) of a contiguous [B, S, H, D] and of a [B, H, S, D] seen as [B, S, H, D]
    assert layout((128, 1000, 8, 2), (1, 8 * 128, 128, 1000 * 8 * 128)) is not None
    assert layout((128, 1000, 8, 2), (1, 128, 1000 * 128, 8 * 1000 * 128), BF16) is not None


@pytest.mark.parametrize("strides, why", [
    ((1, 8 * 128, 0, 1000 * 8 * 128), "a broadcast head axis (stride 0)"),
    ((1, 8 * 128 + 4, 128, 1000 * 8 * 128), "a row stride of 8 bytes past a multiple of 16"),
    ((2, 8 * 128, 128, 1000 * 8 * 128), "a strided last axis"),
])
def test_views_the_copy_engine_cannot_read_are_refused(strides, why):
    assert layout((128, 1000, 8, 2), strides) is None, why


def test_empty_axes_and_oversized_boxes_are_refused():
    assert layout((128, 0, 8, 2), (1, 1024, 128, 0)) is None
    assert _tma.MapLayout.of(np.float16, (64, 10, 1, 1), (1, 64, 640, 640), (64, 512, 1, 1)) is None


def test_a_single_index_axis_takes_any_stride():
    # B = 1: the batch stride is never applied, so an odd one (a sliced view) does not matter
    found = layout((128, 1000, 8, 1), (1, 1024, 128, 12345))
    assert found is not None and found.strides[3] * 2 % _tma.STRIDE_ALIGN_BYTES == 0


def test_the_forward_struct_holds_four_aligned_maps():
    dtype = _params.struct_dtype("FwdParams")
    for name in ("q_map", "k_map", "v_map", "v_row_map"):
        sub, offset = dtype.fields[name][:2]
        assert offset % _params.TENSOR_MAP_ALIGN == 0 and sub.itemsize == _tma.MAP_BYTES
    assert dtype.itemsize % _params.TENSOR_MAP_ALIGN == 0


@pytest.mark.parametrize("block_size, block_n, rows", [
    (16, 128, 16), (8, 128, 8), (64, 128, 64), (128, 128, 128), (256, 128, 128), (384, 128, 128),
    (16, 80, 16), (40, 80, 40), (160, 80, 80),
    (1, 128, None), (4, 128, None), (7, 128, None), (12, 128, None), (192, 128, None), (32, 80, None),
])
def test_paged_keys_load_in_boxes_of_a_page_or_a_key_block(block_size, block_n, rows):
    # None: a page shorter than a swizzle atom (8 rows), or neither of page and block divides the other
    assert attention_module.paged_box_rows(block_size, block_n) == rows


@pytest.mark.parametrize("block_size, block_n, by_copy", [
    (1, 128, True), (7, 128, True), (16, 128, True), (32, 128, True), (32, 80, True), (48, 128, True),
    (192, 128, True), (64, 128, False), (128, 128, False), (256, 128, False), (40, 80, False), (160, 80, False),
])
def test_small_pages_and_those_no_box_takes_are_copied_row_by_row(monkeypatch, block_size, block_n, by_copy):
    monkeypatch.setattr(attention_module, "FWD_SM90_COPY_MAX_BLOCK_SIZE", 32)
    assert attention_module.paged_keys_by_copy(block_size, block_n) == by_copy
    if attention_module.paged_box_rows(block_size, block_n) is not None:
        # without the size rule, every page a box takes comes in boxes
        monkeypatch.setattr(attention_module, "FWD_SM90_COPY_MAX_BLOCK_SIZE", 0)
        assert not attention_module.paged_keys_by_copy(block_size, block_n)


def test_copied_pages_need_q_map_only():
    tile = attention_module.FWD_SM90_TILES[128, 128]
    q = np.empty((1, 300, 32, 128), BF16)
    pages = np.empty((50, 16, 8, 128), BF16)
    maps = attention_module._fwd_maps(q, pages, pages, tile, copy_pages=True)
    assert [(field, pointer) for field, pointer, _ in maps] == [("q_map", "q")]


def test_paged_maps_view_the_pages_and_read_v_row_by_row_too():
    tile = attention_module.FWD_SM90_TILES[128, 128]
    q = np.empty((1, 300, 32, 128), BF16)
    pages = np.empty((50, 16, 8, 128), BF16)  # [num_blocks, block_size, Hk, D]
    maps = {field: (pointer, found) for field, pointer, found in
            attention_module._fwd_maps(q, pages, pages, tile, page_rows=16)}
    assert set(maps) == {"q_map", "k_map", "v_map", "v_row_map"}
    assert maps["k_map"][1].dims == (128, 16, 8, 50) and maps["k_map"][1].box == (64, 16, 1, 1)
    assert maps["v_row_map"] == ("v", _tma.MapLayout.of(BF16, (128, 16, 8, 50), (1, 1024, 128, 16384), (64, 1, 1, 1)))
    assert maps["q_map"][1].box == (64, tile.block_m, 1, 1)
    assert {pointer for pointer, _ in maps.values()} == {"q", "k", "v"}


def test_out_map_views_dense_out_in_boxes_of_a_consumers_rows():
    out = np.zeros((2, 200, 4, 72), BF16)
    field, pointer, found = attention_module._out_map(out)
    assert (field, pointer) == ("o_map", "out")
    assert found.dims == (72, 200, 4, 2) and found.strides == (1, 288, 72, 200 * 288)
    assert found.box == (64, _params.constant("kWgmmaM"), 1, 1)
    # a row of 68 bf16 (136 bytes) is no multiple of 16 bytes: the epilogue's own stores take it
    assert attention_module._out_map(np.zeros((1, 64, 1, 68), BF16)[..., :64]) is None


def test_gradient_maps_view_dense_dk_and_dv_in_boxes_of_a_consumers_keys():
    dk = np.zeros((2, 90, 2, 128), BF16)
    dv = np.zeros((2, 90, 2, 64), BF16)
    (k_field, k_pointer, k_map), (v_field, v_pointer, v_map) = attention_module._dkv_maps(dk, dv)
    assert (k_field, k_pointer, v_field, v_pointer) == ("dk_map", "dk", "dv_map", "dv")
    assert k_map.dims == (128, 90, 2, 2) and v_map.dims == (64, 90, 2, 2)
    assert k_map.box == v_map.box == (64, _params.constant("kWgmmaM"), 1, 1)
    # either view unwritable by the TMA (rows of 136 bytes): both keep the kernel's own stores
    assert attention_module._dkv_maps(dk, np.zeros((2, 90, 2, 68), BF16)[..., :64]) == ()


def test_tiles_without_the_overlap_take_the_bounded_softmax():
    with pytest.raises(ValueError, match=r"bounded=False needs overlap=True .*overlap=False"):
        attention_module.FwdSm90Tile(128, 3, 3, overlap=False, bounded=False)


def test_calls_without_a_mask_take_the_unmasked_tiles():
    """FWD_SM90_UNMASKED_TILES replaces FWD_SM90_TILES' tile for calls without a causal or window
    mask below the long tile's key count (FWD_SM90_LONG_TILES), never under a mask or for paged keys,
    and is a registered variant."""
    names = {spec.name for spec in attention_module.kernel_variants("sm_90a")}
    assert attention_module.FWD_SM90_UNMASKED_TILES
    for dims, tile in attention_module.FWD_SM90_UNMASKED_TILES.items():
        assert tile != attention_module.FWD_SM90_TILES[dims]
        long = attention_module.FWD_SM90_LONG_TILES.get(dims)
        for keys in (1, 1000, 100000):
            # a long key range takes its long tile first, where its head dims have one
            unmasked = long.tile if long is not None and long.takes(keys, banded=False) else tile
            assert attention_module.fwd_sm90_tile(dims, seqlen_k=keys, banded=False) == unmasked
            masked = attention_module.fwd_sm90_tile(dims, seqlen_k=keys, banded=True)
            assert masked == (long.tile if long is not None and long.takes(keys, banded=True)
                              else attention_module.FWD_SM90_TILES[dims])
            assert attention_module.fwd_sm90_tile(dims, paged=True, seqlen_k=keys, banded=False) == \
                attention_module.fwd_sm90_tile(dims, paged=True)
        for alibi in (False, True):
            assert attention_module.fwd_sm90_spec(np.dtype(BF16), *dims, tile, alibi=alibi).name in names


def test_long_key_ranges_take_their_tile_from_their_length_and_mask():
    for dims, long in attention_module.FWD_SM90_LONG_TILES.items():
        for banded, keys in ((True, long.keys), (False, long.unmasked_keys)):
            # below the count: the tile of the call's mask (FWD_SM90_UNMASKED_TILES' without one)
            short = (not banded and attention_module.FWD_SM90_UNMASKED_TILES.get(dims)) or \
                attention_module.FWD_SM90_TILES[dims]
            assert attention_module.fwd_sm90_tile(dims, seqlen_k=keys - 1, banded=banded) == short
            assert attention_module.fwd_sm90_tile(dims, seqlen_k=keys, banded=banded) == long.tile
            # paged prefill keeps its own tile at every length
            assert attention_module.fwd_sm90_tile(dims, paged=True, seqlen_k=keys, banded=banded) == \
                attention_module.fwd_sm90_tile(dims, paged=True)
        names = {spec.name for spec in attention_module.kernel_variants("sm_90a")}
        for alibi in (False, True):
            assert attention_module.fwd_sm90_spec(np.dtype(BF16), *dims, long.tile, alibi=alibi).name in names


def test_causal_row_shift_is_whole_warpgroups_past_the_last_row():
    """fwd_sm90_row_shift (the kernel's FwdSm90Work::row_shift): whole warpgroups of 64 rows, the
    same number of tiles, and no warpgroup of the last tile left without rows."""
    assert attention_module.fwd_sm90_row_shift(8192, 192) == 64  # the FP8 forward at D = 128
    assert attention_module.fwd_sm90_row_shift(4096, 192) == 128
    assert attention_module.fwd_sm90_row_shift(130, 128) == 64
    assert attention_module.fwd_sm90_row_shift(1024, 128) == 0
    for block_m in (128, 192):
        for sq in range(1, 3 * block_m + 1):
            shift = attention_module.fwd_sm90_row_shift(sq, block_m)
            assert shift % 64 == 0 and 0 <= shift < block_m
            tiles = -(-sq // block_m)
            assert -(-(sq + shift) // block_m) == tiles, (sq, block_m)
            assert tiles * block_m - (sq + shift) < 64, (sq, block_m)


def test_each_hopper_tile_has_alibi_and_paged_variants():
    names = {spec.name for spec in attention_module.kernel_variants("sm_90a")}
    for (d, dv), tile in attention_module.FWD_SM90_TILES.items():
        # the paged tile is the dense one but where it would spill under the paged producer
        paged_tile = attention_module.fwd_sm90_tile((d, dv), paged=True)
        assert paged_tile == attention_module.FWD_SM90_PAGED_TILES.get((d, dv), tile)
        assert paged_tile.block_n == tile.block_n, "the same key block: the same page sizes take the Hopper path"
        for dtype in (np.float16, BF16):
            spec = attention_module.fwd_sm90_spec(np.dtype(dtype), d, dv, paged_tile, paged=True)
            assert spec.name.endswith(", true>") and spec.name in names, spec.name
            assert attention_module.fwd_sm90_spec(np.dtype(dtype), d, dv, tile).name in names
            alibi = attention_module.fwd_sm90_spec(np.dtype(dtype), d, dv, tile, alibi=True).name
            assert alibi.endswith(", true, false>") and alibi in names, alibi


@pytest.mark.parametrize("arch, block_size, why", [("sm_80", None, r"arch sm_80, head_dim 128"),
                                                   ("sm_90a", 7, r"arch sm_90a, .*, block_size 7\)")],
                         ids=["not-hopper", "paged-q-rows-of-264-bytes"])
def test_a_forced_hopper_tile_the_call_cannot_take_is_refused(monkeypatch, arch, block_size, why):
    # tests and tuning force tiles; the dispatcher itself falls back to flash_fwd_kernel there. Paged
    # keys of any block size can be copied: q's rows of 132 elements (264 bytes) are what no TMA reads.
    monkeypatch.setattr(attention_module._jit, "target_arch", lambda device_id=None: arch)
    q = np.zeros((1, 40, 4, 128 if block_size is None else 132), BF16)[..., :128]
    k = v = q if block_size is None else np.zeros((6, block_size, 4, 128), BF16)
    paged = None if block_size is None else attention_module.PagedKeys(
        block_table=np.zeros((1, 6), np.int32), seq_lens=np.full(1, 40, np.int32), batch_index=np.zeros(1, np.int32),
        block_size=block_size, num_blocks=6)
    cu = None if block_size is None else np.array([0, 40], np.int32)
    with pytest.raises(ValueError, match=rf"flash_fwd_sm90_kernel cannot run this call \({why}"):
        attention_module._launch_fwd(q, k, v, q, None, cu, None, batch=1, seqlen_q=40, seqlen_k=40, causal=False,
                                     scale=None, window=(-1, -1), softcap=0.0, stream=None,
                                     tile=attention_module.FWD_SM90_TILES[128, 128], paged=paged)


def test_dynamic_schedule_sections_span_l2_under_a_mask_only():
    """l2_section_heads: under a causal or window mask as many (batch, head) pairs as keep their K
    and V within FWD_SM90_L2_SECTION_BYTES (a kv head's q heads counted once); without a mask one
    pair a section, the static schedule's order."""
    budget = attention_module.FWD_SM90_L2_SECTION_BYTES
    kv_head = 2 * 1024 * 128 * 2  # K and V of one kv head, N = 1k, D = 128, bf16
    assert attention_module.l2_section_heads(32, 16, 16, 1024, 128, 2) == budget // kv_head
    assert attention_module.l2_section_heads(32, 16, 4, 1024, 128, 2) == 4 * (budget // kv_head)
    assert attention_module.l2_section_heads(1, 4, 4, 1024, 128, 2) == 4  # never past the pairs there are
    assert attention_module.l2_section_heads(32, 16, 16, 1024, 128, 2, banded=False) == 1
    assert attention_module.l2_section_heads(1, 1, 1, 1 << 30, 256, 2) == 1  # at least one


def test_hopper_tiles_fit_the_shared_memory_of_one_cta():
    limit = _params.constant("kSm90MaxSmem")
    for (head_dim, head_dim_v), tile in attention_module.FWD_SM90_TILES.items():
        assert tile.smem_bytes(head_dim, head_dim_v, 2) <= limit, (head_dim, head_dim_v, tile)
    for head_dim, tile in attention_module.FWD_SM90_FP8_TILES.items():
        assert tile.smem_bytes(head_dim, head_dim, 1) <= limit, (head_dim, tile)


@pytest.mark.parametrize("block_m", [128, 192])
def test_tile_order_capacity_holds_every_tile_of_the_packed_rows(rng, block_m):
    """tile_order_capacity bounds the tiles of any lengths that fill (or underfill) the packed
    rows: each sequence's query blocks, at most the launch's m_blocks, on every head; and it is
    never more than the launch's tiles."""
    for _ in range(50):
        batch, heads = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        lens = rng.integers(0, 3 * block_m, size=batch)
        total = int(lens.sum()) + int(rng.integers(0, block_m))  # q may hold rows past the last sequence
        m_blocks = -(-max(int(lens.max()), 1) // block_m)
        tiles = heads * sum(min(-(-int(n) // block_m), m_blocks) for n in lens)
        capacity = attention_module.tile_order_capacity(batch, heads, total, block_m, m_blocks)
        assert tiles <= capacity <= heads * batch * m_blocks, (batch, heads, lens.tolist(), total)


@pytest.mark.gpu
def test_encoding_through_the_driver_is_cached_per_address():
    import cupy

    x = cupy.zeros((2, 256, 4, 128), cupy.float16)
    found = layout((128, 256, 4, 2), (1, 512, 128, 256 * 512))
    first = found.encode(x.data.ptr)
    assert first.shape == (_tma.MAP_WORDS,) and first.any()
    assert found.encode(x.data.ptr) is first
    assert not np.array_equal(found.encode(x.data.ptr + 1024), first)
    with pytest.raises(ValueError, match="16-byte aligned"):
        found.encode(x.data.ptr + 8)


def _every_hopper_forward_tile():
    """(D, Dv, bytes of an input element, tile) of every table the Hopper forward reads."""
    yield from ((d, dv, 2, t) for (d, dv), t in attention_module.FWD_SM90_TILES.items())
    yield from ((d, dv, 2, t) for (d, dv), t in attention_module.FWD_SM90_UNMASKED_TILES.items())
    yield from ((d, dv, 2, t) for (d, dv), t in attention_module.FWD_SM90_PAGED_TILES.items())
    yield from ((d, dv, 2, long.tile) for (d, dv), long in attention_module.FWD_SM90_LONG_TILES.items())
    yield from ((d, d, 1, t) for d, t in attention_module.FWD_SM90_FP8_TILES.items())


def test_hopper_shared_memory_sizes_equal_the_kernels(tmp_path, monkeypatch):
    """FwdSm90Tile.smem_bytes (the launch's dynamic shared memory) against the kernel's
    FwdSm90Smem::kBytes of flash_fwd_sm90.cu, by static_assert under NVRTC (no GPU needed), for
    every tile of the 16-bit, paged, long and FP8 tables, with and without ALiBi (whose key tile
    some 16-bit tiles take), and the paged tiles over e4m3 pages (whose staging most take)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the check compiles with NVRTC")
    from cuattn import _jit

    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    asserts = [
        f"static_assert(cuattn::FwdSm90SmemOf<{d}, {dv}, {t.block_n}, {t.consumers}, {t.stages}, {size}, "
        f"{str(alibi).lower()}>::type::kBytes == {t.smem_bytes(d, dv, size, alibi=alibi)}, "
        f"\"{t} D = {d}, Dv = {dv}, alibi {alibi}\");"
        for d, dv, size, t in _every_hopper_forward_tile() for alibi in (False, True)
    ]
    # the variants over e4m3 pages (KV_E4M3: the paged tiles, 16-bit, no ALiBi), staging or not
    asserts += [
        f"static_assert(cuattn::FwdSm90SmemOf<{d}, {dv}, {t.block_n}, {t.consumers}, {t.stages}, 2, false, "
        f"true>::type::kBytes == {t.smem_bytes(d, dv, 2, kv_e4m3=True)}, \"{t} D = {d}, Dv = {dv}, e4m3 pages\");"
        for d, dv in attention_module.FWD_SM90_TILES
        for t in [attention_module.fwd_sm90_tile((d, dv), kv_e4m3=True)]
    ]
    sources = tmp_path / "sources"
    sources.mkdir()
    for path in _jit.source_dir().iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    (sources / "smem_check.cu").write_text(
        '#include "flash_fwd_sm90.cu"\n' + "\n".join(asserts)
        + "\ntemplate <int N> __global__ void smem_check_kernel(int* x) { *x = N; }\n")
    monkeypatch.setenv("CUATTN_SOURCE_DIR", str(sources))
    compiled = _jit.compile_kernel(_jit.KernelSpec("smem_check.cu", "smem_check_kernel<1>"), "sm_90a")
    assert compiled.lowered_name


def test_a_v_width_whose_wgmma_pieces_miss_a_panel_does_not_compile(tmp_path, monkeypatch):
    """WgmmaRow splits the PV GEMM into pieces whose MN-major descriptors start at 64-column panels:
    Dv = 112 (64 + 32 + 16, the last at column 96) is refused at compile time, Dv = 96 (64 + 32) is not."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the check compiles with NVRTC")
    from cuattn import _jit

    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    tile = attention_module.FwdSm90Tile(64, 2, 2)
    with pytest.raises(cuattn.CompileError, match="the PV GEMM's pieces start at V's panels"):
        _jit.compile_kernel(attention_module.fwd_sm90_spec(np.dtype(np.float16), 128, 112, tile), "sm_90a")
    assert _jit.compile_kernel(attention_module.fwd_sm90_spec(np.dtype(np.float16), 128, 96, tile), "sm_90a").cubin_path
