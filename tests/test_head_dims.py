"""Head dims: every multiple of 8 from 8 to 256, on the CPU path and in the dispatchers' choices.

A kernel is instantiated for a tile head dim and takes any smaller multiple of 8 at run time; the
GPU tests of each family sweep `_registry.test_head_dims` (tile head dims and a few padded ones).
These tests need no GPU: the argument checks (the same on both paths), the NumPy path at padded
head dims, and that every kernel a dispatcher can pick for any supported head dim is listed in
`kernel_variants` (what `python -m cuattn build` and CI compile and check for spills).
"""

import importlib

import numpy as np
import pytest

import cuattn
from cuattn import _arrays, _registry, reference
from conftest import error_budget, expected_forward_kernel, forward_kernels, randn

attention_module = importlib.import_module("cuattn.attention")  # the modules, not the functions
decode_module = importlib.import_module("cuattn.decode")
ARCHS = ["sm_80", "sm_90a"]
DTYPES = ["float16", "bfloat16"]
UNSUPPORTED = [7, 12, 264, 0]
RULE = r"is not supported: head_dim must be a multiple of 8 from 8 to 256"


def test_supported_head_dims_are_the_multiples_of_8_to_256():
    assert _registry.SUPPORTED_HEAD_DIMS == tuple(range(8, 257, 8))
    assert attention_module.SUPPORTED_HEAD_DIMS == decode_module.SUPPORTED_HEAD_DIMS == _registry.SUPPORTED_HEAD_DIMS
    for family in ("attention", "decode"):
        swept = _registry.test_head_dims(family)
        assert set(_registry.FAMILIES[family].tile_head_dims) <= set(swept)
        assert set(swept) <= set(_registry.SUPPORTED_HEAD_DIMS)


@pytest.mark.parametrize("d", UNSUPPORTED)
def test_every_entry_point_refuses_an_unsupported_head_dim(d):
    q = np.zeros((1, 3, 2, d), np.float32)
    with pytest.raises(ValueError, match=rf"q.shape\[-1\] \(head_dim\) = {d} {RULE}"):
        cuattn.attention(q, q, q)
    with pytest.raises(ValueError, match=rf"q.shape\[-1\] \(head_dim\) = {d} {RULE}"):
        cuattn.attention_backward(q, q, q, q, q, np.zeros((1, 2, 3), np.float32))
    cu = np.array([0, 3], np.int32)
    with pytest.raises(ValueError, match=rf"q.shape\[-1\] \(head_dim\) = {d} {RULE}"):
        cuattn.attention_varlen(q[0], q[0], q[0], cu, cu, 3, 3)
    lens = np.array([3], np.int32)
    with pytest.raises(ValueError, match=rf"q.shape\[-1\] \(head_dim\) = {d} {RULE}"):
        cuattn.decode(q[:, :1], q, q, lens)
    with pytest.raises(ValueError, match=rf"head_dim = {d} {RULE}"):
        cuattn.PagedKVCache(4, 16, 2, d, np.float32, device="cpu")


@pytest.mark.parametrize("d", UNSUPPORTED)
def test_paged_entry_points_refuse_an_unsupported_head_dim(d):
    pages = np.zeros((4, 16, 2, d), np.float32)
    table, lens = np.array([[0, 1]], np.int32), np.array([20], np.int32)
    with pytest.raises(ValueError, match=rf"q.shape\[-1\] \(head_dim\) = {d} {RULE}"):
        cuattn.paged_attention(np.zeros((1, 1, 2, d), np.float32), (pages, pages), table, lens)
    with pytest.raises(ValueError, match=rf"head_dim\) = {d} {RULE}"):
        cuattn.paged_attention_varlen(np.zeros((1, 2, d), np.float32), (pages, pages), table,
                                      np.array([0, 1], np.int32), lens, 1)


def test_an_e4m3_cache_takes_multiples_of_16():
    q = np.zeros((1, 1, 2, 40), np.float32)
    cache = np.zeros((1, 8, 2, 40), _arrays.FLOAT8_E4M3)
    with pytest.raises(ValueError, match=r"k_cache.shape\[-1\] \(head_dim\) = 40 is not supported with an e4m3 "
                                         r"cache: head_dim must be a multiple of 16"):
        cuattn.decode(q, cache, cache, np.array([8], np.int32))
    with pytest.raises(ValueError, match=r"head_dim = 40 is not supported with an e4m3 cache"):
        cuattn.PagedKVCache(4, 16, 2, 40, "float8_e4m3fn", device="cpu")
    cuattn.PagedKVCache(4, 16, 2, 48, "float8_e4m3fn", device="cpu")


@pytest.mark.parametrize("d", [8, 40, 80, 200])
def test_the_cpu_path_takes_padded_head_dims(rng, d):
    """attention and decode on NumPy arrays at tile and padded head dims: each equal to the float64
    reference with the call's own default scale 1 / sqrt(D), decode on each row's live keys."""
    q, k, v = (randn(rng, (2, 9, 2, d), np.float32) for _ in range(3))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
    # the default scale is the call's own 1 / sqrt(D), not its tile's
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True, scale=d ** -0.5), rtol=1e-6, atol=1e-6)
    lens = np.array([9, 4], np.int32)
    out, lse = cuattn.decode(q[:, :1], k, v, lens, return_lse=True)
    ref, ref_lse = reference.decode(q[:, :1], k, v, lens, scale=d ** -0.5, return_lse=True)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6, err_msg=f"seed {rng.seed}")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6, err_msg=f"seed {rng.seed}")


@pytest.mark.parametrize("d", [8, 32, 40, 72, 80, 88, 96, 104, 152, 160, 168, 192, 224, 256])
def test_each_head_dim_runs_the_smallest_tile_that_holds_it(d):
    # (the backward's rows differ per arch family: Hopper has an 80 tile of its own)
    backward = [([t for t, row in attention_module.BWD_TILES.items() if attention_module.arch_family(arch) in row],
                 lambda d, arch=arch: attention_module.bwd_tile_dim(d, arch)) for arch in ("sm_80", "sm_90a")]
    for tiles, pick in ((attention_module.FWD_TILES, attention_module.fwd_tile_dim),
                        *backward,
                        (decode_module.DECODE_TILES, decode_module.decode_tile_dim)):
        tile = pick(d)
        assert tile >= d and tile in tiles and not [t for t in tiles if d <= t < tile]


@pytest.mark.parametrize("d, tile_dim, sm80_dim", [(40, 64, 64), (56, 64, 64), (72, 80, 96), (80, 80, 96),
                                                    (88, 96, 96), (104, 128, 128), (120, 128, 128)])
def test_padded_head_dims_on_hopper_take_the_wgmma_backward(d, tile_dim, sm80_dim):
    """flash_bwd_sm90_kernel takes its head dims at run time: a head dim padded to one of its
    tiles (64, 80, 96, 128, 256) runs there, reading zeros past its own D; at 32 and less the
    mma.sync kernels run. The 80 tile is Hopper's alone: elsewhere 80 runs in 96."""
    assert attention_module.bwd_tile_dim(d, "sm_90a") == tile_dim
    assert attention_module.bwd_tile_dim(d, "sm_80") == sm80_dim
    assert attention_module.bwd_tile(d, "sm_80") == attention_module.BWD_TILES[sm80_dim][attention_module.SM80]
    assert attention_module.bwd_tile(d, "sm_90a") == attention_module.BWD_TILES[tile_dim][attention_module.SM90]
    assert attention_module.bwd_tile(d, "sm_90a").wgmma
    for other in (8, 16, 32):
        assert not attention_module.bwd_tile(other, "sm_90a").wgmma
    # above 128 the wide 256 tile (half of D a consumer); elsewhere the mma.sync 160 and 256 tiles
    for other, sm80_dim in ((136, 160), (160, 160), (192, 256), (256, 256)):
        assert attention_module.bwd_tile_dim(other, "sm_90a") == 256
        assert attention_module.bwd_tile(other, "sm_90a") == attention_module.BWD_TILES[256][attention_module.SM90]
        wide = attention_module.bwd_tile(other, "sm_90a")
        assert wide.wgmma and wide.block_n == 64
        assert attention_module.bwd_tile_dim(other, "sm_80") == sm80_dim
        # deterministic=True leaves dQ to flash_bwd_dq_kernel in the mma.sync kernels' tile
        assert attention_module.bwd_dq_head_dim(other, "sm_90a") == sm80_dim
        tile = attention_module.bwd_tile(other, "sm_90a", deterministic=True)
        _, _, last = attention_module.bwd_specs("bfloat16", 256, tile, True, False,
                                                attention_module.bwd_dq_head_dim(other, "sm_90a"))
        assert last.name.startswith(f"cuattn::flash_bwd_dq_kernel<__nv_bfloat16, {sm80_dim},"), last.name
    assert attention_module.bwd_dq_head_dim(d, "sm_90a") == tile_dim


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_a_head_dim_can_pick_is_listed(arch):
    listed = {spec.name for spec in cuattn._registry.kernel_variants(arch)}
    for dtype in DTYPES:
        for d in _registry.SUPPORTED_HEAD_DIMS:
            tile_dim = attention_module.fwd_tile_dim(d)
            for alibi in (False, True):
                spec = attention_module.fwd_spec(dtype, tile_dim, attention_module.fwd_tile(d, arch, alibi), alibi)
                assert spec.name in listed, (d, spec.name)
            paged = attention_module.fwd_spec(dtype, tile_dim, attention_module.fwd_tile(d, arch), paged=True)
            assert paged.name in listed, (d, paged.name)
            hopper = attention_module.fwd_sm90_tile_dims(d, d)
            if arch == "sm_90a" and hopper is not None:
                spec = attention_module.fwd_sm90_spec(dtype, *hopper, attention_module.FWD_SM90_TILES[hopper])
                assert spec.name in listed, (d, spec.name)
            for deterministic in (False, True):
                for alibi in (False, True):
                    tile = attention_module.bwd_tile(d, arch, deterministic, alibi)
                    specs = attention_module.bwd_specs(dtype, attention_module.bwd_tile_dim(d, arch), tile, deterministic,
                                                       alibi, attention_module.bwd_dq_head_dim(d, arch))
                    assert {spec.name for spec in specs} <= listed, (d, deterministic, alibi)
            decode_dim = decode_module.decode_tile_dim(d)
            for paged_cache in (False, True):
                spec = decode_module.decode_spec(dtype, decode_dim, 1, paged_cache)
                assert spec.name in listed, (d, spec.name)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 72, 80, 96, 136, 160, 192, 200])
def test_padded_and_new_tile_head_dims_run_their_forward(rng, caplog, forward_kernel, d):
    """Each head dim runs the kernel and tile the dispatcher names (the Hopper kernel's smallest
    tile holding it on sm_90a, flash_fwd_kernel at its tile head dim otherwise or when forced),
    into a NaN-poisoned output; k and v of odd lengths."""
    import cupy

    q = randn(rng, (2, 67, 4, d), np.float16)
    k, v = (randn(rng, (2, 131, 2, d), np.float16) for _ in range(2))
    out = cupy.full(q.shape, np.nan, np.float16)
    with caplog.at_level("DEBUG", logger="cuattn"):
        cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=True, out=out)
    chosen = forward_kernels(caplog)
    assert chosen and expected_forward_kernel(np.float16, d, d) in chosen[-1], chosen
    ref = reference.attention(q, k, v, causal=True)
    naive = reference.naive_attention_lowp(q, k, v, causal=True, dtype=np.float16)
    got = out.get().astype(np.float64)
    budget = error_budget(np.abs(naive - ref).max(), np.float16, 2.0, np.abs(ref).max())
    assert np.isfinite(got).all() and np.abs(got - ref).max() <= budget, f"seed {rng.seed}"
