"""FlashDecoding: a few new tokens attend to a long KV cache, and the exact merge of partial states.

``decode`` is bandwidth-bound: every step reads the whole cache once. One CTA per (sequence,
kv head) would leave most of an H200 idle for a single long sequence, so the keys are split
across CTAs (split-KV); each split writes a float32 partial output and lse, and the last CTA of
a (sequence, kv head) to finish merges them exactly, counting arrivals in the workspace's head
(``cuda_src/decode.cu``; a combine kernel of its own where the counters do not apply). The
query heads that share a kv head are packed into one tile (GQA packing), so each cache byte is
read once per step, not once per query head. Choosing the split count needs only shapes and the
SM count, never the device's ``cache_seqlens``: a decode step has no device-to-host copy and can
be captured in a CUDA graph.

Layouts (any strides on the leading axes; the last axis is contiguous):

    q              (B, Sq_new, Hq, D)      Sq_new from 1 to 16 (speculative decoding)
    k_cache        (B, S_max, Hk, D)       cache_seqlens (B,) int32 on the device
    v_cache        (B, S_max, Hk, Dv)      Dv: v's own head dim (DeepSeek: D = 192, Dv = 128)
    out            (B, Sq_new, Hq, Dv)     lse (B, Hq, Sq_new) float32, natural log

The caches hold q's dtype, or float8 e4m3 (FP8) with descales ``k_scale``, ``v_scale`` (real value
= stored x scale, per tensor or per kv head): the kernel reads half the bytes and widens them to
fp16 in registers (``cuda_src/fp8.cuh``; a bf16 q is converted to fp16 once, and both GEMMs run
in fp16); the descales fold into the score scale and the output, outside the GEMMs.

``cache_seqlens[b]`` counts every key of row b, the new tokens' own included (write them into
the cache first). With ``causal``, new token i of row b sees keys ``j <= cache_seqlens[b] -
Sq_new + i``. NumPy inputs run the float64 reference on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _arrays, _calls, _jit, _masks, _params, reference

MAX_NEW_TOKENS = 16
MAX_SPLITS = 128
# A split should stream at least this many keys, or the combine costs more than it saves.
MIN_KEYS_PER_SPLIT = 256
# Two CTAs share an SM (paged caches) only when each split streams at least this many keys.
SHARED_SM_MIN_KEYS_PER_SPLIT = 2048
# An e4m3 CTA widens every byte it reads, a chain of dependent steps per block that one CTA per SM
# leaves unhidden: e4m3 decode runs at least this many (scripts/tune_decode.py --fp8, H200).
E4M3_MIN_CTAS_PER_SM = 2
# The decode launch's grid: (splits, Hk x row chunks, B); y and z take at most this many CTAs.
MAX_GRID_Z = 65535
MAX_GRID_Y = 65535
# Packed query rows (new tokens x the group's heads) of one m16 tile; a CTA takes 1 to max_mt of them.
M16_ROWS = 16


# ---------------------------------------------------------------------------------------------
# Kernel choice: one traits table per head dim


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """max_mt: m16 tiles of packed query rows per CTA (more rows take more CTAs); stages: cp.async ring
    depth; long_stage: stages of kDecodeLongBlockN keys instead of kDecodeBlockN; warps: the CTA's
    warps (the kernels' WARPS, None for kDecodeWarps), each taking an equal share of every stage in
    k16 slices (the default stage gives each of four warps one, the long stage two, or one each to
    eight warps)."""

    max_mt: int
    stages: int
    long_stage: bool = False
    warps: int | None = None

    def block_n(self) -> int:
        """Keys a stage holds (the kernels' BLOCK_N)."""
        return _params.constant("kDecodeLongBlockN" if self.long_stage else "kDecodeBlockN")

    def num_warps(self) -> int:
        return _params.constant("kDecodeWarps") if self.warps is None else self.warps

    def threads(self) -> int:
        return self.num_warps() * _params.constant("kWarpSize")

    def smem_bytes(self, head_dim: int, itemsize: int, mt: int, kv_itemsize: int) -> int:
        """Mirrors DecodeSmem in decode.cu: Q tile + max(K/V ring, the warps' merge buffers); K/V
        rows are padded by 16 bytes whatever their element size (KvRow). ``head_dim`` is the tile
        head dim, which holds both q/k's D and v's Dv: every buffer is tile wide."""
        q_tile = 16 * mt * (head_dim + _params.constant("kPadElems")) * itemsize
        kv_row_bytes = head_dim * kv_itemsize + _params.constant("kCopyBytes")
        ring = self.stages * 2 * self.block_n() * kv_row_bytes
        merge = self.num_warps() * 16 * mt * (head_dim + 2) * 4
        return q_tile + max(ring, merge)


# Chosen so that two CTAs fit on an SM at D = 128 (two stages in flight each) and no variant
# spills (`python -m cuattn build`); D = 32 keeps one m16 tile because two spill on sm_80.
DECODE_TILES = {
    32: DecodeTile(max_mt=1, stages=4),
    64: DecodeTile(max_mt=2, stages=4),
    96: DecodeTile(max_mt=2, stages=3),
    128: DecodeTile(max_mt=2, stages=3),
    256: DecodeTile(max_mt=1, stages=2),
}
# The e4m3 caches' long-stage variants, by tile head dim (one m16 tile of packed rows): eight warps
# a CTA, one k16 slice each of a 128-key stage, three stages (115 KB at D = 128; its 156-167
# registers a thread hold it to one CTA an SM, as many warps as two CTAs of four). With half the
# CTAs of two an SM, a launch streams half as many runs of the cache at once, and the same keys
# stream faster. They run where the launch fits one wave of them, over a contiguous cache only while
# each split streams at most E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS keys (use_long_variant; the splits
# are planned on the cache's capacity, which over pages is often the block table's, far past the
# sequences: no such rule there). Over a contiguous cache on the H200 (GQA 32/8,
# one bf16 token, CUDA graphs, BENCHMARKS.md "Thirty-fifth session"), against CTAs of four warps:
# B = 8, L = 8k 41.3 -> 39.2 us, L = 16k 77.6 -> 70.9, B = 16, L = 8k 76.6 -> 69.3, B = 1, L = 32k
# 28.2 -> 24.9, B = 4, L = 8k 25.2 -> 23.7 (2k-8k keys a split); but B = 8, L = 131k 556 -> 568
# (65k keys a split: its 128 CTAs leave 4 of the 132 SMs idle, which a long stream pays for on the
# H200's bandwidth), hence the split rule. Over pages (shuffled 16-token pages,
# H100, BENCHMARKS.md "Fifty-second session") they replaced four warps of two k16 slices, two
# stages, two CTAs an SM, which they beat at every shape measured: GQA 32/8 B = 8, L = 8k 55.6 ->
# 54.8 us, B = 16 101.0 -> 94.2, B = 1, L = 32k 35.3 -> 31.7; 16 packed rows (GQA 32/2) B = 8, L = 8k
# 25.8 -> 19.2, B = 2, L = 32k 46.3 -> 25.8; MHA with ALiBi B = 4, L = 8k 100.6 -> 99.3. Where the
# eight-warp launch does not fit one wave the default stage ran as fast as the four-warp long one
# or faster (MHA with ALiBi B = 8, L = 8k 190.1 against 193.4 us). The H200 measured the
# eight-warp paged stage slower before the paged prologue looked up all its stages' rows first
# (B = 8, L = 8k 43.4 -> 44.2 us; 131k, 65k keys a split, 582 -> 630: "Thirty-fifth session").
# Since then, timed in turn on an H200 ("Fifty-third session"), the two paged stages ran within
# 0.3-2.5% of each other at B = 8 with the four-warp one ahead (8k 43.1-43.3 against 43.5-43.8 us,
# 32k 150.3 against 154.0) and the eight-warp one ahead at B = 16, L = 8k (77.7-77.9 against
# 78.1-78.5) and B = 1, L = 32k (27.2 against 29.8). On the H100 the eight-warp paged stage still
# gains at 65k keys a split (B = 8, L = 131k 754.1 -> 748.0 us).
E4M3_CONTIGUOUS_LONG_TILES = {128: DecodeTile(max_mt=1, stages=3, long_stage=True, warps=8)}
E4M3_PAGED_LONG_TILES = dict(E4M3_CONTIGUOUS_LONG_TILES)
E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS = 8192
# The contiguous e4m3 cache's wide variants, by tile head dim: launch bounds for
# E4M3_WIDE_MIN_CTAS CTAs an SM (at D = 128, 128 registers a thread instead of 162, without
# spills; the paged kernel spills 24 bytes there, so it has none) and a ring shallow enough that
# their shared memory fits as many. Picked only where the default variant needs more than one
# wave of CTAs (no splits: large batches of short contexts), where the wider wave ends the tail:
# on the H200, B = 64, L = 2k (GQA 32/8) 101.5 -> 74.7 us; with one wave or less the deeper ring
# is faster (B = 8, L = 8k 44.9 against 49.4 us), BENCHMARKS.md ("Tenth session").
E4M3_WIDE_DECODE_TILES = {128: DecodeTile(max_mt=1, stages=2)}
E4M3_WIDE_MIN_CTAS = 4
# The paged e4m3 cache's variants for the same case: its kernel spills under the 128-register cap,
# so instead of more CTAs an SM it takes fewer, a fourth ring stage leaving two CTAs an SM where
# the default has three: 512 CTAs (B = 64, GQA 32/8) then run as two full waves instead of one
# and a third. Picked only while they need at most E4M3_WIDE_PAGED_MAX_WAVES waves: on the H200
# (GQA 32/8, D = 128, L = 2k) 400 and 512 CTAs 80.2 -> 77.3 and 97.6 -> 81.1 us, but 640, 800 and
# 1024 CTAs 14%, 11% and 1% slower (three CTAs an SM stream faster once both need several
# waves); BENCHMARKS.md, "Fifteenth session".
E4M3_WIDE_PAGED_DECODE_TILES = {128: DecodeTile(max_mt=1, stages=4)}
E4M3_WIDE_PAGED_MAX_WAVES = 2
# The target they are built and picked for: on sm_80 the 128-register cap spills 8 bytes.
E4M3_WIDE_DECODE_ARCH = "sm_90a"
# every head dim decode and paged decode take (a multiple of 16 over an e4m3 cache), for q and k (D)
# and for v (Dv) alike; a call runs the smallest tile head dim at least max(D, Dv)
# (DecodeParams::head_dim and head_dim_v: the columns past each are zero-filled, never read, so a
# padded call streams the same cache bytes and only its MMA work grows)
SUPPORTED_HEAD_DIMS = _arrays.SUPPORTED_HEAD_DIMS
TILE_HEAD_DIMS = tuple(sorted(DECODE_TILES))


def decode_tile_dim(head_dim: int, head_dim_v: int | None = None) -> int:
    """The tile head dim the decode kernels are instantiated with for q and k of ``head_dim`` and v
    of ``head_dim_v`` (default ``head_dim``): one tile holds both, so it is that of the larger."""
    return _arrays.tile_head_dim(max(head_dim, head_dim if head_dim_v is None else head_dim_v), DECODE_TILES)


MERGE_DTYPES = {np.dtype(np.float32): "float", **_arrays.CUDA_TYPES}


# ALiBi's decode variants (the kernels' ALIBI flag) take one m16 tile of packed rows: ALiBi models
# are MHA (BLOOM, MPT), so a tile holds a step's 16 new tokens per kv head; more rows run as more
# row chunks instead of doubling the variants.
ALIBI_DECODE_MT = 1


def long_tiles(paged: bool) -> dict:
    """The long-stage variants' tiles by tile head dim: E4M3_PAGED_LONG_TILES over pages,
    E4M3_CONTIGUOUS_LONG_TILES over a contiguous cache."""
    return E4M3_PAGED_LONG_TILES if paged else E4M3_CONTIGUOUS_LONG_TILES


def has_long_variant(head_dim: int, mt: int, paged: bool, e4m3: bool) -> bool:
    """Whether a decode of this tile head dim, m16 tiles and cache kind has a long-stage variant
    (long_tiles: e4m3 caches, one m16 tile)."""
    return e4m3 and mt == 1 and head_dim in long_tiles(paged)


def use_long_variant(ctas: int, long_per_sm: int, sms: int, split_keys: int | None = None) -> bool:
    """Whether a launch of ``ctas`` CTAs (its splits counted) takes the long-stage variant
    (``long_per_sm`` CTAs an SM): where it holds them in one wave (beyond, the default's more CTAs
    an SM end the tail sooner, also where the caller's ``num_splits`` asks for more), and over a
    contiguous cache (``split_keys``: the keys each of its splits would stream) only while that
    is at most E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS."""
    if ctas > long_per_sm * sms:
        return False
    return split_keys is None or split_keys <= E4M3_CONTIGUOUS_LONG_MAX_SPLIT_KEYS


def wide_tiles(paged: bool) -> dict:
    """The wide variants' tiles by tile head dim: E4M3_WIDE_PAGED_DECODE_TILES over pages,
    E4M3_WIDE_DECODE_TILES over a contiguous cache."""
    return E4M3_WIDE_PAGED_DECODE_TILES if paged else E4M3_WIDE_DECODE_TILES


def has_wide_variant(head_dim: int, mt: int, paged: bool, e4m3: bool, alibi: bool) -> bool:
    """Whether a decode of this tile head dim, m16 tiles, cache kind and bias has a wide variant,
    the one for more CTAs than a wave of the default (wide_tiles: e4m3 caches without ALiBi)."""
    tile = wide_tiles(paged).get(head_dim)
    return e4m3 and not alibi and tile is not None and mt <= tile.max_mt


def use_wide_variant(ctas: int, default_per_sm: int, wide_per_sm, sms: int, paged: bool) -> bool:
    """Whether a launch of ``ctas`` CTAs takes the wide variant over the default (of
    ``default_per_sm`` CTAs an SM): where the default needs more than one wave, and over pages
    where the wide one (``wide_per_sm()`` CTAs an SM, asked only then) needs at most
    E4M3_WIDE_PAGED_MAX_WAVES."""
    if ctas <= default_per_sm * sms:
        return False
    return not paged or ctas <= E4M3_WIDE_PAGED_MAX_WAVES * wide_per_sm() * sms


def wide_min_ctas(paged: bool) -> int:
    """The launch bound (CTAs an SM) of the wide variants: contiguous ones are capped for
    E4M3_WIDE_MIN_CTAS, paged ones have none (0)."""
    return 0 if paged else E4M3_WIDE_MIN_CTAS


# Calls that pack at most this many query rows (G * Sq_new) take the variants whose softmax runs on
# half of the m16 tile (ROW_HALVES = 1 in decode.cu): rows 8-15 are padding there.
HALF_TILE_ROWS = 8


def takes_half_tile(rows: int, mt: int, alibi: bool) -> bool:
    """Whether a call of ``rows`` packed query rows on ``mt`` m16 tiles runs a half-tile variant
    (one m16 tile, at most HALF_TILE_ROWS rows; ALiBi's variants have none)."""
    return mt == 1 and rows <= HALF_TILE_ROWS and not alibi


@functools.lru_cache(maxsize=None)
def decode_spec(dtype, head_dim: int, mt: int, paged: bool, e4m3: bool = False, alibi: bool = False,
                wide: bool = False, half: bool = False, long: bool = False) -> _jit.KernelSpec:
    """A decode kernel (instantiated at tile head dim ``head_dim``) for q of ``dtype`` over a cache of
    ``dtype``, or of e4m3 with ``e4m3``; ``alibi`` adds ALiBi's bias; ``wide``: the e4m3 cache's
    variant for more CTAs than a wave of the default (has_wide_variant); ``half``: the variant for
    at most HALF_TILE_ROWS packed rows (takes_half_tile); ``long``: the long-stage variant
    (has_long_variant), with or without ``half`` and ``alibi``."""
    if half and (mt != 1 or alibi or wide):
        raise ValueError(f"the half-tile decode variants take one m16 tile, no ALiBi and the default tiles; got mt "
                         f"{mt}, alibi {alibi}, wide {wide}")
    if long and (wide or not has_long_variant(head_dim, mt, paged, e4m3)):
        raise ValueError(f"the long-stage decode variants take e4m3 caches at tile head dims "
                         f"{sorted(E4M3_PAGED_LONG_TILES)} (paged) and {sorted(E4M3_CONTIGUOUS_LONG_TILES)} "
                         f"(contiguous) and one m16 tile, not the wide tiles; got head_dim {head_dim}, mt {mt}, "
                         f"paged {paged}, e4m3 {e4m3}, wide {wide}")
    if wide and not has_wide_variant(head_dim, mt, paged, e4m3, alibi):
        raise ValueError(f"the wide decode variants take e4m3 caches without ALiBi at tile head dims "
                         f"{sorted(E4M3_WIDE_DECODE_TILES)} (contiguous) and {sorted(E4M3_WIDE_PAGED_DECODE_TILES)} "
                         f"(paged) and one m16 tile; got head_dim {head_dim}, mt {mt}, paged {paged}, e4m3 {e4m3}, "
                         f"alibi {alibi}")
    tile = (wide_tiles(paged)[head_dim] if wide else long_tiles(paged)[head_dim] if long
            else DECODE_TILES[head_dim])
    min_ctas = wide_min_ctas(paged) if wide else 0
    kernel = "paged_decode_kernel" if paged else "decode_kernel"
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    kv_ctype = _arrays.E4M3_TYPE if e4m3 else ctype
    kv_itemsize = 1 if e4m3 else np.dtype(dtype).itemsize
    with_alibi = "true" if alibi else "false"
    # ROW_HALVES, BLOCK_N and WARPS: the names of the 16-row, default-stage, four-warp variants leave
    # them at their defaults
    warps = f", {tile.warps}" if tile.warps is not None else ""
    block_n = f", {tile.block_n()}" if tile.long_stage or warps else ""
    row_halves = ", 1" if half else ", 2" if block_n else ""
    return _jit.KernelSpec(
        "decode.cu",
        f"cuattn::{kernel}<{ctype}, {kv_ctype}, {head_dim}, {mt}, {tile.stages}, {with_alibi}, {min_ctas}"
        f"{row_halves}{block_n}{warps}>",
        threads=tile.threads(),
        smem_bytes=tile.smem_bytes(head_dim, np.dtype(dtype).itemsize, mt, kv_itemsize),
    )


@functools.lru_cache(maxsize=None)
def combine_spec(in_dtype, out_dtype) -> _jit.KernelSpec:
    tin, tout = MERGE_DTYPES[np.dtype(in_dtype)], MERGE_DTYPES[np.dtype(out_dtype)]
    return _jit.KernelSpec("decode.cu", f"cuattn::combine_kernel<{tin}, {tout}>", threads=_params.constant("kCombineThreads"))


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """Every decode, paged-decode and combine variant the dispatchers can pick."""
    specs = []
    for dtype in _arrays.CUDA_TYPES:
        for d, tile in DECODE_TILES.items():
            for mt in range(1, tile.max_mt + 1):
                for e4m3 in (False, True):
                    specs += [decode_spec(dtype, d, mt, paged=False, e4m3=e4m3),
                              decode_spec(dtype, d, mt, paged=True, e4m3=e4m3)]
            for e4m3 in (False, True):
                specs += [decode_spec(dtype, d, 1, paged=False, e4m3=e4m3, half=True),
                          decode_spec(dtype, d, 1, paged=True, e4m3=e4m3, half=True)]
            for e4m3 in (False, True):
                specs += [decode_spec(dtype, d, ALIBI_DECODE_MT, paged=False, e4m3=e4m3, alibi=True),
                          decode_spec(dtype, d, ALIBI_DECODE_MT, paged=True, e4m3=e4m3, alibi=True)]
        for paged in (False, True):
            for d in long_tiles(paged):
                specs += [decode_spec(dtype, d, 1, paged=paged, e4m3=True, long=True),
                          decode_spec(dtype, d, 1, paged=paged, e4m3=True, half=True, long=True),
                          decode_spec(dtype, d, ALIBI_DECODE_MT, paged=paged, e4m3=True, alibi=True, long=True)]
        for paged in (False, True):
            for d, tile in wide_tiles(paged).items() if arch == E4M3_WIDE_DECODE_ARCH else ():
                for mt in range(1, tile.max_mt + 1):
                    specs.append(decode_spec(dtype, d, mt, paged=paged, e4m3=True, wide=True))
        specs += [combine_spec(np.float32, dtype), combine_spec(dtype, dtype)]
    specs.append(combine_spec(np.float32, np.float32))
    return specs


def fast_divisor(divisor: int) -> tuple[np.uint32, np.int32]:
    """(mul, shift) with n // divisor == umulhi(n, mul) >> shift for 0 <= n < 2**31 (FastDivisor
    in common.cuh): the round-up multiplier 2**(31 + ceil(log2 d)) / d. Divisor 1 is mul = 0."""
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    if divisor == 1:
        return np.uint32(0), np.int32(0)
    log2_ceil = (divisor - 1).bit_length()
    mul = ((1 << (31 + log2_ceil)) + divisor - 1) // divisor
    return np.uint32(mul), np.int32(log2_ceil - 1)


def choose_num_splits(batch: int, num_kv_heads: int, row_chunks: int, max_seqlen: int, sms: int,
                      ctas_per_sm: int = 1, min_ctas_per_sm: int = 1) -> int:
    """Splits so that one wave of CTAs fills the GPU, each split streaming enough keys.

    A contiguous cache streams fastest with one CTA per SM (``ctas_per_sm = 1``;
    scripts/tune_decode.py on the H200, D = 128: B = 1, L = 32k 3.15 TB/s at 16 splits against
    2.89 at 32). A paged CTA starts with two dependent round trips (its first block-table entries,
    then its first pages), and a second CTA per SM (``ctas_per_sm = 2``) hides that start, but only
    once each split streams ``SHARED_SM_MIN_KEYS_PER_SPLIT`` keys; shorter splits go back to one
    CTA per SM (scripts/tune_paged.py: B = 8, L = 8k 3.49 TB/s at 4 splits against 3.41 at 2;
    B = 1, L = 32k 2.89 at 16 splits against 2.75 at 33; BENCHMARKS.md). An e4m3 cache
    (``min_ctas_per_sm = 2``) never goes below two CTAs per SM: a block costs an e4m3 CTA as long
    as a 2-byte one although it reads half the bytes (B = 1, L = 32k: 29.6 us at 32 splits, 34.1
    at 16; B = 8, L = 8k: 44.5 us at 4 splits, 59.2 at 2).

    Depends on shapes and the device only (never on the device's cache_seqlens): no sync.
    """
    ctas = max(1, batch * num_kv_heads * row_chunks)  # an empty batch launches nothing: any count

    def splits(wave_ctas: int) -> int:
        by_occupancy = wave_ctas // ctas
        by_length = max(1, max_seqlen // MIN_KEYS_PER_SPLIT)
        return max(1, min(by_occupancy, by_length, MAX_SPLITS))

    if ctas_per_sm > 1:
        shared = splits(ctas_per_sm * sms)
        if max_seqlen >= shared * SHARED_SM_MIN_KEYS_PER_SPLIT:
            return shared
    return splits(min(min_ctas_per_sm, ctas_per_sm) * sms)


def ctas_per_sm(spec: _jit.KernelSpec) -> int:
    """How many CTAs of a decode variant fit on one SM, by shared memory, threads and registers
    (the loaded kernel's count)."""
    return max(1, _jit.occupancy(spec.threads, _jit.get_function(spec).num_regs, spec.smem_bytes,
                                 registers_per_sm=_jit.device_attribute("MaxRegistersPerMultiprocessor"),
                                 smem_per_sm=_jit.device_attribute("MaxSharedMemoryPerMultiprocessor"),
                                 threads_per_sm=_jit.device_attribute("MaxThreadsPerMultiProcessor")))


# ---------------------------------------------------------------------------------------------
# Public API


def decode(q, k_cache, v_cache, cache_seqlens, *, max_seq_len=None, num_splits=None, causal=True, scale=None,
           window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False, k_scale=None,
           v_scale=None):
    """Attention of ``Sq_new`` new tokens per sequence over a KV cache (FlashDecoding).

    Args:
        q: ``(B, Sq_new, Hq, D)``, Sq_new from 1 to 16, float16 or bfloat16.
        k_cache, v_cache: ``(B, S_max, Hk, D)`` and ``(B, S_max, Hk, Dv)``, ``Hq % Hk == 0``: q's
            dtype, or both float8 e4m3 (``torch.float8_e4m3fn``, CuPy ``uint8`` holding the bytes,
            NumPy ``ml_dtypes.float8_e4m3fn``; :func:`cuattn.quantize_fp8` makes them). v's head
            dim Dv may differ from D (the same rules: a multiple of 8 up to 256, of 16 for e4m3);
            the default scale stays ``1/sqrt(D)``.
        cache_seqlens: ``(B,)`` int32, keys in each row's cache (new tokens included). Values
            are read on the device only (no sync), so they are not checked: a value above S_max
            is treated as S_max and a negative one as 0, on the GPU and on the CPU path alike.
        max_seq_len: optional bound on ``cache_seqlens`` for choosing the split count (and the
            variant), as in :func:`cuattn.paged_attention`; default S_max. A hint only: a row
            longer than it still attends to all of its keys, in splits planned for shorter rows.
        num_splits: split-KV factor; None chooses from B, Hk, min(max_seq_len, S_max) and the SM count.
        causal, scale, window, softcap, sinks, alibi_slopes: as in :func:`cuattn.attention`, with
            Sk = cache_seqlens[b] per row and Sq = Sq_new (ALiBi's distance of new token i to key j
            is ``|i + cache_seqlens[b] - Sq_new - j|``).
        return_lse: also return lse ``(B, Hq, Sq_new)`` float32 (natural log).
        k_scale, v_scale: descales of an e4m3 cache (real value = stored x scale): None (1), a
            float, or a float32 array ``()``, ``(1,)`` or ``(Hk,)`` (per kv head) on q's device,
            read on the device (no sync; update it in place between steps).

    Returns:
        ``out`` ``(B, Sq_new, Hq, Dv)`` in q's dtype, or ``(out, lse)``, in the framework of the inputs.
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, max_seq_len, num_splits, causal, scale, window, softcap, sinks,
                   alibi_slopes, return_lse, k_scale, v_scale, planning=False)


def plan_decode(q, k_cache, v_cache, cache_seqlens, *, max_seq_len=None, num_splits=None, causal=True, scale=None,
                window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False, k_scale=None,
                v_scale=None):
    """Plan once, run many: a :class:`StepPlan` whose ``run()`` is one decode step over these arrays.

    Takes the arguments of :func:`decode` (CuPy or torch arrays) and checks them once. The plan
    owns its outputs and split workspace and keeps reading the arrays given here: write each
    step's queries into ``q`` and its lengths into ``cache_seqlens`` in place (and the new keys
    into the caches), then call ``plan.run()``. A run allocates nothing, copies nothing between
    host and device and only launches (a few microseconds of host time), so it can be captured
    in a CUDA graph; it returns the plan's ``out`` (and ``lse``), overwritten by each run.
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, max_seq_len, num_splits, causal, scale, window, softcap, sinks,
                   alibi_slopes, return_lse, k_scale, v_scale, planning=True)


def scale_arrays(k_scale, v_scale) -> dict:
    """The scales given as arrays, by argument name (floats are options, not arrays)."""
    return {name: x for name, x in (("k_scale", k_scale), ("v_scale", v_scale)) if _arrays.is_array(x)}


def scale_options(k_scale, v_scale) -> tuple:
    """What a plan key holds of the scales: floats by value, arrays by their signature (elsewhere)."""
    return tuple(None if x is None or _arrays.is_array(x) else x for x in (k_scale, v_scale))


def check_cache_scales(q, k, v, k_scale, v_scale, names, host: bool):
    """The caches' element type and descales: ``(e4m3, k KvScale, v KvScale)``."""
    e4m3 = _arrays.check_kv_dtypes(q, dict(zip(names, (k, v))), host)
    if e4m3:
        # check_kv_dtypes checks k's head dim; v's may differ and has the same 16-byte rule
        _arrays.check_e4m3_head_dim(f"{names[1]}.shape[-1] (head_dim_v)", int(v.shape[-1]))
    num_kv_heads = int(k.shape[2])
    ks = _arrays.check_kv_scale("k_scale", k_scale, e4m3, num_kv_heads, host, "q", q)
    vs = _arrays.check_kv_scale("v_scale", v_scale, e4m3, num_kv_heads, host, "q", q)
    return e4m3, ks, vs


def dequantize(x, scale: _arrays.KvScale):
    """The real values of a host e4m3 cache [..., Hk, D] (float64), for the reference."""
    per_head = scale.per_head(int(x.shape[-2]))
    return _arrays.as_e4m3(x).astype(np.float64) * per_head[:, None]


def _decode(q, k_cache, v_cache, cache_seqlens, max_seq_len, num_splits, causal, scale, window, softcap, sinks,
            alibi_slopes, return_lse, k_scale, v_scale, *, planning: bool):
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse)
    scales = scale_arrays(k_scale, v_scale)
    call_key = None
    if not planning:
        result, call_key = _calls.run(
            "decode", (q, k_cache, v_cache, cache_seqlens, sinks, alibi_slopes, scales.get("k_scale"),
                       scales.get("v_scale")),
            (max_seq_len, num_splits, bool(causal), scale, left, right, softcap, bool(return_lse),
             scale_options(k_scale, v_scale)))
        if result is not None:
            return result
    lists, ints = _arrays.int_lists(cache_seqlens=cache_seqlens)
    if planning and lists:
        raise TypeError("plan_decode reads cache_seqlens on the device each run: pass a device array (CuPy or q's "
                        "framework) that the loop updates in place, not a list")
    with _arrays.array_context(q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks, alibi_slopes=alibi_slopes,
                               **ints, **scales) as ctx:
        qv, kv, vv, sv, av = (ctx.view(x) for x in (q, k_cache, v_cache, sinks, alibi_slopes))
        lens = ctx.int_view("cache_seqlens", lists, ints)
        k_scale, v_scale = (ctx.view(x) if _arrays.is_array(x) else x for x in (k_scale, v_scale))
        check_decode_args(qv, kv, vv, lens, "cache_seqlens", ("(B, S_max, Hk, D)", "S_max"))
        _check_num_splits(num_splits)
        _arrays.check_int("max_seq_len", max_seq_len, 1, optional=True)
        e4m3, ks, vs = check_cache_scales(qv, kv, vv, k_scale, v_scale, ("k_cache", "v_cache"), ctx.on_host)
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[2]), ctx.on_host, "q", qv)
        alibi_sb = check_alibi(av, qv, ctx.on_host)
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k_cache": kv, "v_cache": vv})
            if planning:
                raise TypeError("plan_decode plans GPU launches and got NumPy arrays; call cuattn.decode for "
                                "the CPU reference")
            _masks.check_total_length(int(qv.shape[1]), int(kv.shape[1]), "q.shape[1] + k_cache.shape[1] (Sq_new + "
                                                                         "S_max)")
            # the kernel reads min(max(cache_seqlens[b], 0), S_max) keys: the host does the same
            lens = np.clip(lens, 0, int(kv.shape[1]))
            if e4m3:
                kv, vv = dequantize(kv, ks), dequantize(vv, vs)
            result = reference.decode(qv, kv, vv, lens, causal=causal, scale=scale, window=(left, right),
                                      softcap=softcap, return_lse=True, sinks=sv, alibi_slopes=av)
            return _host_result(result, qv, return_lse)

        for name, x in (("q", qv), ("k_cache", kv), ("v_cache", vv)):
            _arrays.check_kernel_layout(name, x)
            _arrays.check_same_device(name, x, "q", qv)
        _arrays.check_same_device("cache_seqlens", lens, "q", qv)
        lens, lens_copied = contiguous_rows("cache_seqlens", lens, planning)
        out, lse, step = decode_outputs(ctx, qv, vv, return_lse, planning)
        capacity = int(kv.shape[1])
        bound, workspace = launch_decode(
            qv, kv, vv, lens, out, lse, None, capacity, num_splits=num_splits, causal=causal, scale=scale,
            window=(left, right), softcap=softcap, stream=ctx.stream,
            split_length=planned_length(max_seq_len, capacity), step=step, sinks=sv, e4m3=e4m3,
            k_scale=ks, v_scale=vs, alibi=(av, alibi_sb),
        )
        if step is not None:
            return step
        if not lens_copied:  # a plan reads the caller's lengths in place
            _calls.remember(call_key, decode_plan(("q", "k", "v", "lens", "sinks", "alibi_slopes", "k_scale",
                                                   "v_scale"), bound, workspace, out, lse))
        out = ctx.to_caller(out)
        return (out, ctx.to_caller(lse)) if return_lse else out


def decode_outputs(ctx, qv, vv, return_lse: bool, planning: bool):
    """A decode-like call's (decode, paged_attention) new out (q's shape with v's head dim Dv last,
    q's dtype), lse ((B, Hq, Sq_new) float32; None unless asked) and, when planning, the step plan
    that records them (None otherwise)."""
    batch, sq_new, num_heads, _ = map(int, qv.shape)
    out = ctx.empty(reference.out_shape(qv, vv), qv.dtype)
    lse = ctx.empty((batch, num_heads, sq_new), np.float32) if return_lse else None
    return out, lse, (_calls.StepPlan(ctx, out, lse) if planning else None)


def decode_plan(inputs, bound, workspace: int, out, lse):
    """The plan of a decode-like call (decode, paged_attention) whose first run wrote `out` and
    `lse` (None unless asked): new arrays of their shapes each run, the launches."""
    if not bound:
        return None
    return_lse = lse is not None

    def finish(results, arrays):
        return (results["out"], results["lse"]) if return_lse else results["out"]

    outputs = {"out": (tuple(out.shape), False), **({"lse": (tuple(lse.shape), True)} if return_lse else {})}
    return _calls.Plan(inputs=inputs, outputs=outputs, bound=bound, finish=finish, aligned=("q", "k", "v"),
                       workspace=workspace, workspace_of=workspace_address)


def merge_states(*args):
    """Exact merge of attention outputs over disjoint key sets (split-KV, cascade, ring attention).

    Call as ``merge_states(out_a, lse_a, out_b, lse_b)`` or ``merge_states([(out, lse), ...])``.
    ``out`` is ``(..., S, H, D)`` (float16, bfloat16 or float32) and ``lse`` its float32,
    natural-log lse of shape ``(..., H, S)``: ``(B, S, H, D)`` with ``(B, H, S)`` as
    ``attention`` returns them, or ``(T, H, D)`` with ``(H, T)`` as ``attention_varlen`` does.
    Returns ``(out, lse)`` in the same layouts, out in the inputs' dtype. A part whose lse is
    -inf (it saw no key) contributes nothing; if every part is empty, out is 0 and lse -inf.
    """
    states = _parse_states(args)
    named = {}
    for i, (out, lse) in enumerate(states):
        named[f"out_{i}"], named[f"lse_{i}"] = out, lse
    # a repeated call with the same signatures takes its plan: the combine launch over the parts'
    # addresses, read in place as one strided array when they are evenly spaced
    result, call_key = _calls.run("merge_states", tuple(named.values()), ())
    if result is not None:
        return result
    with _arrays.array_context(**named) as ctx:
        views = [(ctx.view(o), ctx.view(l)) for o, l in states]
        _check_states(views, ctx.on_host)
        if ctx.on_host:
            out, lse = reference.merge_states(views)
            return out.astype(views[0][0].dtype), lse.astype(np.float32)
        out, lse, launch = _merge_on_device(views, ctx)
        if launch is not None:
            _calls.remember(call_key, _merge_plan(tuple(named), launch, views))
        return ctx.to_caller(out), ctx.to_caller(lse)


def _merge_plan(roles, launch, views) -> _calls.Plan:
    """The plan of a merge_states call whose parts were read in place (``roles``: out_0, lse_0,
    out_1, ...): the combine launch with the first part's addresses and the steps to the others."""
    outs, lses = roles[0::2], roles[1::2]
    out0, lse0 = views[0]
    return _calls.Plan(
        inputs=roles, outputs={"out": (tuple(out0.shape), False), "lse": (tuple(lse0.shape), True)},
        bound=[_calls.Bound(launch, {"parts": outs[0], "part_lse": lses[0], "out": "out", "lse_out": "lse",
                                     "p_part": f"step:{out0.dtype.itemsize}:{','.join(outs)}",
                                     "l_part": f"step:4:{','.join(lses)}"})],
        finish=lambda results, arrays: (results["out"], results["lse"]), aligned=())


# ---------------------------------------------------------------------------------------------
# Checks shared with paged attention


def rows_contiguous(x) -> bool:
    """Whether the last axis of a device array is contiguous (what the kernels' index reads assume)."""
    return x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize


def contiguous_rows(name: str, x, planning: bool):
    """``(x, copied)``: a CuPy int array as the kernels read it, its last axis contiguous (a block
    table's rows, a length vector): x itself, or a contiguous copy (a Fortran-ordered table from
    np.concatenate over a broadcast, a strided view of the lengths). A step plan reads x in place
    every run, so planning refuses a copy; a plain call with a copy records no plan either."""
    if rows_contiguous(x):
        return x, False
    if planning:
        raise ValueError(f"{name} must have a contiguous last axis (stride {x.itemsize} bytes) to be planned: the "
                         f"plan reads it in place every run; got strides {tuple(x.strides)} bytes")
    import cupy

    return cupy.ascontiguousarray(x), True


def check_decode_args(q, k, v, lens, lens_name: str, cache_layout: tuple[str, str]) -> None:
    """Shapes of q and the caches (contiguous or paged), dtype of the length vector. v's last axis
    is its own head dim Dv: any supported head dim, not necessarily k's."""
    layout, length_axis = cache_layout
    _arrays.check_ndim("q", q, "(B, Sq_new, Hq, D)")
    cache_names = ("k_cache", "v_cache") if length_axis == "S_max" else ("k_pages", "v_pages")
    _arrays.check_ndim(cache_names[0], k, layout)
    _arrays.check_ndim(cache_names[1], v, layout.replace(", D)", ", Dv)"))
    sq_new = int(q.shape[1])
    if not 1 <= sq_new <= MAX_NEW_TOKENS:
        raise ValueError(
            f"q.shape[1] (Sq_new) must be between 1 and {MAX_NEW_TOKENS}, got {sq_new}; "
            "use cuattn.attention for prefill"
        )
    if length_axis == "S_max":
        _arrays.check_axis(cache_names[0], k, 0, "batch", int(q.shape[0]), "q.shape[0]")
    _arrays.check_axis(cache_names[0], k, 3, "head_dim", int(q.shape[3]), "q.shape[3]")
    for axis, axis_name in enumerate(layout.strip("()").split(", ")[:-1]):
        _arrays.check_axis(cache_names[1], v, axis, axis_name, int(k.shape[axis]), f"{cache_names[0]}.shape[{axis}]")
    _arrays.check_positive(cache_names[0], k, 2, "Hk")
    if length_axis != "S_max":
        # as PagedKVCache's: check=False clamps table entries into the pool, which needs a block
        _arrays.check_positive(cache_names[0], k, 0, "num_blocks")
    num_heads, num_kv_heads = int(q.shape[2]), int(k.shape[2])
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q.shape[2] (num_heads) = {num_heads} must be a multiple of "
            f"{cache_names[0]}.shape[2] (num_kv_heads) = {num_kv_heads}"
        )
    _arrays.check_head_dim("q.shape[-1] (head_dim)", int(q.shape[3]))
    _arrays.check_head_dim(f"{cache_names[1]}.shape[3] (head_dim_v)", int(v.shape[3]))
    _arrays.check_ndim(lens_name, lens, "(B)")
    _arrays.check_axis(lens_name, lens, 0, "batch", int(q.shape[0]), "q.shape[0]")
    _arrays.check_int32(lens_name, lens)
    if int(q.shape[0]) > MAX_GRID_Z:
        raise ValueError(f"q.shape[0] (batch) must be at most {MAX_GRID_Z}, got {q.shape[0]}")
    # grid.y at its largest (one m16 tile a CTA): the kv heads times each head's 16-row chunks of its
    # group's packed rows (Sq_new x Hq / Hk), a bound every tile the device picks stays within
    row_chunks = math.ceil(num_heads // num_kv_heads * sq_new / M16_ROWS)
    if num_kv_heads * row_chunks > MAX_GRID_Y:
        raise ValueError(
            f"{cache_names[0]}.shape[2] (num_kv_heads) x ceil(Sq_new x Hq / Hk / 16) = {num_kv_heads} x {row_chunks} "
            f"must be at most {MAX_GRID_Y} (the decode launch's grid.y), got {num_kv_heads * row_chunks}")


def _check_num_splits(num_splits) -> None:
    _arrays.check_int("num_splits", num_splits, 1, MAX_SPLITS, optional=True)


def _host_result(result, q, return_lse):
    out, lse = result
    out = out.astype(q.dtype)
    return (out, lse.astype(np.float32)) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Launch


_workspaces: dict[tuple[int, int], object] = {}
# Workspaces outgrown by a larger call: a graph captured before still writes into them.
_retired_workspaces: list = []
# (device, stream) whose workspace's arrival counters were zeroed only inside a stream capture
# (a graph node): the next call outside a capture zeroes them on the stream first.
_unzeroed_arrivals: set = set()

# A split launch's workspace: SPLIT_ARRIVAL_SLOTS uint32 arrival counters (DecodeParams::
# split_arrivals, one per CTA group, zero between launches: the last arrival resets its own),
# then the partial outputs and lse. The head is the same for every call, so a stream's workspace
# keeps zeroed counters whatever shape used it before; a launch of more CTA groups than slots
# merges with combine_kernel instead.
SPLIT_ARRIVAL_SLOTS = 4096
SPLIT_ARRIVAL_BYTES = 4 * SPLIT_ARRIVAL_SLOTS
# Whether split launches merge in their last CTA (True) or by combine_kernel (tests compare the
# two). Plans keep the launches they were made with: clear them (_calls.clear()) after a change.
FUSE_SPLIT_COMBINE = True


def workspace_address(nbytes: int, stream_ptr: int, device_id: int) -> int:
    """A grow-only buffer per (device, stream) for split launches (SPLIT_ARRIVAL_BYTES of arrival
    counters, then partials); returns its address.

    Reusing it keeps allocations off the decode path, so a step captured in a CUDA graph keeps
    pointing at live memory when it is replayed. It is held for the process's life (one per
    stream that ever decoded with splits), so it never goes back to a pool; one that a larger
    call outgrows is kept too (a graph captured before still points at it), and the new one is
    at least twice its size, so what is kept stays under the largest buffer's size. A new
    buffer's counters are zeroed on the stream, ahead of the launch that follows; allocated
    under a stream capture, that memset is a node of the graph, and the stream's next call
    outside a capture zeroes them again before its own launch.
    """
    import cupy

    key = (device_id, stream_ptr)
    buf = _workspaces.get(key)
    if buf is None or buf.nbytes < nbytes:
        if buf is not None:
            _retired_workspaces.append(buf)
            nbytes = max(nbytes, 2 * buf.nbytes)
        with cupy.cuda.Device(device_id):
            buf = cupy.empty(max(nbytes, SPLIT_ARRIVAL_BYTES) // 4 + 1, cupy.float32)
        _workspaces[key] = buf
        _unzeroed_arrivals.add(key)
    if key in _unzeroed_arrivals:
        cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, SPLIT_ARRIVAL_BYTES, stream_ptr)
        if not cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            _unzeroed_arrivals.discard(key)
    return buf.data.ptr


def check_alibi(slopes, q, host: bool) -> int:
    """Checks ``alibi_slopes`` (when given) against q ``(B, Sq_new, Hq, D)``; returns the batch
    stride the decode kernel reads them with (0: one row of slopes for every sequence, or none)."""
    if slopes is None:
        return 0
    return _arrays.check_alibi_slopes(slopes, int(q.shape[0]), int(q.shape[2]), host, "q", q)


def planned_length(max_seq_len: int | None, capacity: int) -> int:
    """The longest sequence a decode-like call's split count plans for: the caller's
    ``max_seq_len`` hint (checked before), at most the cache's ``capacity``; the capacity without one."""
    return capacity if max_seq_len is None else min(int(max_seq_len), capacity)


def launch_decode(q, k, v, lens, out, lse, paged, max_seqlen: int, *, num_splits, causal, scale, window, softcap,
                  stream, split_length: int | None = None, step=None, sinks=None, alibi=(None, 0), e4m3: bool = False,
                  k_scale: _arrays.KvScale = _arrays.NO_SCALE,
                  v_scale: _arrays.KvScale = _arrays.NO_SCALE) -> tuple[list, int]:
    """Launch (paged_)decode_kernel into ``out`` [B, Sq_new, Hq, Dv] and ``lse`` [B, Hq, Sq_new] (or
    None); q and k have head dim D, v (and so out) Dv. With several splits the kernel's last CTA
    of each group merges them (SPLIT_ARRIVAL_SLOTS), or combine_kernel does where that does not apply.

    ``paged`` is None for a contiguous cache, else ``(block_table, block_size, num_blocks)``; ``max_seqlen``
    is the capacity the kernel clamps lengths to (S_max, or max_blocks * block_size);
    ``split_length`` the longest sequence the split heuristic plans for (default ``max_seqlen``).
    Returns the launches bound to the call's roles (q, k, v, lens, table, out, lse and the
    workspace, sinks, scales) and the workspace bytes: the plan of later identical calls. ``sinks``
    (float32 [Hq] or None) join in the decode kernel with one split, in the combine with several.
    ``alibi``: the slopes ([B, Hq] | [Hq], or None) and their batch stride in elements; the decode
    kernel adds the bias to the scores (the combine merges partials that already carry it).
    ``e4m3``: k and v hold e4m3 bytes, with descales ``k_scale`` and ``v_scale``. With ``step`` (a
    :class:`cuattn._calls.StepPlan`) nothing runs: the launches, with a workspace the step
    owns, are added to it instead.
    """
    batch, sq_new, num_heads, head_dim = map(int, q.shape)
    num_kv_heads, head_dim_v = int(k.shape[2]), int(v.shape[3])
    group = num_heads // num_kv_heads
    rows = group * sq_new
    if batch == 0 or rows == 0:  # no sequence or no query head (Hq = 0): nothing to launch
        return [], 0
    tile_dim = decode_tile_dim(head_dim, head_dim_v)
    tile = DECODE_TILES[tile_dim]
    with_alibi = alibi[0] is not None
    mt = ALIBI_DECODE_MT if with_alibi else 1 if rows <= 16 else tile.max_mt
    row_chunks = math.ceil(rows / (M16_ROWS * mt))
    half = takes_half_tile(rows, mt, with_alibi)
    spec = decode_spec(q.dtype, tile_dim, mt, paged is not None, e4m3, with_alibi, half=half)
    ctas = batch * num_kv_heads * row_chunks
    length = split_length or max_seqlen  # the longest sequence the split count plans for
    wide = long = False
    if has_long_variant(tile_dim, mt, paged is not None, e4m3):
        long_spec = decode_spec(q.dtype, tile_dim, mt, paged is not None, e4m3, with_alibi, half=half, long=True)
        long_per_sm, sms = ctas_per_sm(long_spec), _jit.multiprocessor_count()
        # the keys each split of the long variant streams: its splits as the launch below would
        # choose them (its CTAs an SM), kept for it where it runs
        long_splits = num_splits or choose_num_splits(batch, num_kv_heads, row_chunks, length, sms, long_per_sm,
                                                      E4M3_MIN_CTAS_PER_SM)
        # the launch's CTAs: with the caller's splits it may span waves, which the default's more
        # CTAs an SM end sooner
        # (over pages `length` is often the table's capacity, far past the lengths: no split rule)
        split_keys = math.ceil(length / long_splits) if paged is None else None
        long = use_long_variant(ctas * long_splits, long_per_sm, sms, split_keys)
        if long:
            spec, num_splits = long_spec, long_splits
    if (not long and has_wide_variant(tile_dim, mt, paged is not None, e4m3, with_alibi)
            and _jit.target_arch() == E4M3_WIDE_DECODE_ARCH):
        # more CTAs than one wave of the default variant: the wide one's waves end the tail sooner
        wide_spec = decode_spec(q.dtype, tile_dim, mt, paged is not None, e4m3, wide=True)
        wide = use_wide_variant(ctas, ctas_per_sm(spec), lambda: ctas_per_sm(wide_spec), _jit.multiprocessor_count(),
                                paged is not None)
        spec = wide_spec if wide else spec
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, row_chunks, length, _jit.multiprocessor_count(),
                                       ctas_per_sm(spec) if paged is not None or e4m3 else 1,
                                       E4M3_MIN_CTAS_PER_SM if e4m3 else 1)

    _masks.check_total_length(sq_new, max_seqlen)
    score_scale, softcap_out = _masks.score_scalars(scale, softcap, head_dim)
    # an unbounded side's bound: past every key, with the longest stage's slack (the kernels round
    # the first key down to a stage)
    left, right = _masks.window_bounds(causal, window, max_seqlen + sq_new + _params.constant("kDecodeLongBlockN"))
    part_elems = num_splits * batch * sq_new * num_heads * head_dim_v
    lse_elems = num_splits * batch * num_heads * sq_new
    stream = _jit.stream_ptr(stream)
    workspace = SPLIT_ARRIVAL_BYTES + (part_elems + lse_elems) * 4 if num_splits > 1 else 0
    arrivals = part_out = part_lse = None
    # (the capped wide variants have no fused combine: it spills under their register cap)
    fused = FUSE_SPLIT_COMBINE and not (wide and wide_min_ctas(paged is not None)) and ctas <= SPLIT_ARRIVAL_SLOTS
    if workspace:
        # the stream's workspace (or the step plan's own, zeroed): arrival counters [B, Hk * row
        # chunks], then partials [splits, B, Sq_new, Hq, Dv] and [splits, B, Hq, Sq_new]
        base = step.workspace(workspace) if step is not None else workspace_address(workspace, stream,
                                                                                  _jit.current_device())
        arrivals = base if fused else None
        part_out = base + SPLIT_ARRIVAL_BYTES
        part_lse = part_out + part_elems * 4
    qs, ks, vs, os_ = (_arrays.element_strides(x) for x in (q, k, v, out))
    lse_strides = (lse.strides[0] // 4, lse.strides[1] // 4) if lse is not None else (0, 0)
    table, block_size, num_blocks, table_stride = None, 0, 0, 0
    if paged is not None:
        table, block_size, num_blocks = paged
        table_stride = _arrays.element_strides(table)[0]
    mul, shift = fast_divisor(max(block_size, 1))
    params = _params.pack(
        "DecodeParams", q=q, k=k, v=v, lens=lens, block_table=table, out=out, lse=lse, part_out=part_out,
        part_lse=part_lse, split_arrivals=arrivals, sinks=sinks, alibi_slopes=alibi[0], alibi_sb=alibi[1], k_scale=k_scale.array, v_scale=v_scale.array, k_descale=k_scale.factor,
        v_descale=v_scale.factor, k_scale_stride=k_scale.stride, v_scale_stride=v_scale.stride, q_sb=qs[0], q_ss=qs[1], q_sh=qs[2], k_sb=ks[0], k_ss=ks[1], k_sh=ks[2],
        v_sb=vs[0], v_ss=vs[1], v_sh=vs[2], o_sb=os_[0], o_ss=os_[1], o_sh=os_[2],
        lse_sb=lse_strides[0], lse_sh=lse_strides[1], table_stride=table_stride, block_size=block_size,
        block_size_mul=mul, block_size_shift=shift, num_blocks=num_blocks, batch=batch, sq_new=sq_new,
        num_heads=num_heads, num_kv_heads=num_kv_heads, row_chunks=row_chunks, num_splits=num_splits,
        max_seqlen=max_seqlen, score_scale=score_scale, softcap_out=softcap_out, window_left=left,
        window_right=right, head_dim=head_dim, head_dim_v=head_dim_v,
    )
    launch = _jit.prepare(spec, (num_splits, num_kv_heads * row_chunks, batch), params)
    if step is None:
        launch.run(stream)
    else:
        step.add(launch)
    parts_role = f"workspace+{SPLIT_ARRIVAL_BYTES}"
    parts_lse_role = f"workspace+{SPLIT_ARRIVAL_BYTES + part_elems * 4}"
    fields = {"q": "q", "k": "k", "v": "v", "lens": "lens", "block_table": "table", "out": "out", "lse": "lse",
              "sinks": "sinks", "alibi_slopes": "alibi_slopes", "k_scale": "k_scale", "v_scale": "v_scale"}
    if workspace:
        fields.update(part_out=parts_role, part_lse=parts_lse_role)
        if fused:
            fields["split_arrivals"] = "workspace+0"
    bound = [_calls.Bound(launch, fields)]
    if num_splits > 1 and not fused:
        # the partials are outputs: Dv wide
        dims = (num_splits, batch, sq_new, num_heads, head_dim_v)
        token_elems = num_heads * head_dim_v  # one new token's partial outputs
        part_strides = (batch * sq_new * token_elems, sq_new * token_elems, token_elems, head_dim_v)
        lse_part_strides = (batch * num_heads * sq_new, num_heads * sq_new, sq_new, 1)
        combine = _launch_combine(part_out, part_strides, part_lse, lse_part_strides, dims, np.float32, out, lse, stream,
                                  execute=step is None, sinks=sinks)
        if step is not None:
            step.add(combine)
        bound.append(_calls.Bound(combine, {"parts": parts_role, "part_lse": parts_lse_role, "out": "out",
                                            "lse_out": "lse", "sinks": "sinks"}))
    return bound, workspace


def max_merge_parts() -> int:
    """combine_kernel keeps one float weight per part in (default, 48 KB) dynamic shared memory,
    rounded up to whole unrolled steps."""
    return _jit.DEFAULT_DYNAMIC_SMEM_LIMIT // 4 - _params.constant("kCombineUnroll")


def _launch_combine(parts, part_strides, part_lse, lse_strides, dims, parts_dtype, out, lse, stream,
                    execute: bool = True, sinks=None):
    """Merge parts [P, B, S, H, D] (strides (part, b, s, h)) with lse [P, B, H, S] (strides
    (part, b, h, s)) into out [B, S, H, D] and lse [B, H, S] (or None).

    ``parts`` and ``part_lse`` are arrays or raw device addresses (ints) into a workspace;
    ``sinks`` (float32 [H]) join each row's denominator once (split decode).
    Returns the prepared launch (None when there are no rows); ``execute=False`` only prepares it.
    """
    num_parts, batch, seqlen, heads, head_dim = dims
    rows = batch * seqlen * heads
    if rows == 0:
        return None
    os_ = _arrays.element_strides(out)
    los = (lse.strides[0] // 4, lse.strides[1] // 4, lse.strides[2] // 4) if lse is not None else (0, 0, 0)
    params = _params.pack(
        "CombineParams", parts=parts, part_lse=part_lse, out=out, lse_out=lse, sinks=sinks,
        **dict(zip(("p_part", "p_b", "p_s", "p_h"), part_strides)), **dict(zip(("l_part", "l_b", "l_h", "l_s"), lse_strides)),
        o_b=os_[0], o_s=os_[1], o_h=os_[2], lo_b=los[0], lo_h=los[1], lo_s=los[2],
        num_parts=num_parts, batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim,
    )
    spec = combine_spec(np.dtype(parts_dtype), np.dtype(out.dtype))
    # one CTA per row; the parts' weights take num_parts floats of dynamic shared memory, rounded
    # up to whole groups of the unrolled loop, whose reads the compiler may vectorise
    unroll = _params.constant("kCombineUnroll")
    weight_slots = -(-num_parts // unroll) * unroll
    launch = _jit.prepare(spec, (rows, 1, 1), params, shared_mem=4 * weight_slots)
    if execute:
        launch.run(_jit.stream_ptr(stream))
    return launch


# ---------------------------------------------------------------------------------------------
# merge_states helpers


def _parse_states(args):
    if len(args) == 4:
        return [(args[0], args[1]), (args[2], args[3])]
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        states = list(args[0])
        if not states or not all(isinstance(s, (list, tuple)) and len(s) == 2 for s in states):
            raise TypeError("merge_states([(out, lse), ...]) needs a non-empty list of (out, lse) pairs")
        return states
    if len(args) == 1:
        raise TypeError(f"merge_states takes one list (or tuple) of (out, lse) pairs, got a {type(args[0]).__name__}; "
                        "pass list(...) of it")
    raise TypeError(
        f"merge_states takes (out_a, lse_a, out_b, lse_b) or one list of (out, lse) pairs, "
        f"got {len(args)} positional arguments"
    )


def _check_states(views, host: bool) -> None:
    out0, _ = views[0]
    if len(views) > max_merge_parts():
        raise ValueError(f"merge_states takes at most {max_merge_parts()} parts, got {len(views)}; merge in rounds")
    if out0.ndim < 3:
        raise ValueError(f"out_0 must have at least 3 axes (..., S, H, D), got shape {tuple(out0.shape)}")
    expected_lse = tuple(out0.shape[:-3]) + (int(out0.shape[-2]), int(out0.shape[-3]))
    for i, (out, lse) in enumerate(views):
        if tuple(out.shape) != tuple(out0.shape):
            raise ValueError(f"out_{i}.shape must equal out_0.shape = {tuple(out0.shape)}, got {tuple(out.shape)}")
        if tuple(lse.shape) != expected_lse:
            raise ValueError(
                f"lse_{i}.shape must be out's shape without D with its last two axes swapped, "
                f"{expected_lse}, got {tuple(lse.shape)}"
            )
        _arrays.check_float32(f"lse_{i}", lse)
        # the combine reads each row's D values contiguously (every other stride is the caller's)
        _arrays.check_last_axis(f"out_{i}", out)
        if host:
            # the reference merges in float64: any float dtype of out (float64 out of a float64
            # reference call too), one for every out_i
            _arrays.check_host_float_dtype(f"out_{i}", out)
            _arrays.check_same_dtype(f"out_{i}", out, "out_0", out0)
            continue
        if np.dtype(out.dtype) not in MERGE_DTYPES:
            raise TypeError(f"out_{i}.dtype is {_arrays.dtype_name(out.dtype)}; merge_states takes float16, bfloat16 or float32")
        _arrays.check_same_dtype(f"out_{i}", out, "out_0", out0)
        _arrays.check_same_device(f"out_{i}", out, "out_0", out0)
        _arrays.check_same_device(f"lse_{i}", lse, "out_0", out0)


def _strided_parts(arrays, rank: int):
    """Read P arrays of one shape in place as [P, ...] with one part stride: ``(base address,
    (part stride, batch stride, two more strides))`` in elements, when their leading axes fold into one batch axis
    (``rank`` axes remain), they share strides and dtype, and their addresses step by a constant
    (any two parts do; so do slices of one tensor, however large). None otherwise."""
    first = arrays[0]
    if first.ndim > rank + 1:
        return None
    strides = _arrays.element_strides(first)
    if first.ndim == rank:
        strides = (0, *strides)  # no leading axis: one batch entry
    itemsize = first.dtype.itemsize
    step = (arrays[1].data.ptr - first.data.ptr) if len(arrays) > 1 else 0
    if step % itemsize:
        return None
    for i, x in enumerate(arrays):
        if x.dtype != first.dtype or x.strides != first.strides or x.data.ptr - first.data.ptr != i * step:
            return None
    # the part, batch and the next two axes' strides: (part, b, s, h) of out, (part, b, h, s) of lse
    return first.data.ptr, (step // itemsize, *strides[:3])


def _merge_on_device(views, ctx):
    """The combine kernel over the parts, read in place when evenly strided; out and lse come from
    the caller's framework (ctx.empty), in the parts' leading layout. Returns ``(out, lse, launch)``:
    the launch where it read the parts in place and ran (the plan of later calls), else None."""
    import cupy

    out0, lse0 = views[0]
    lead = tuple(int(n) for n in out0.shape[:-3])
    seqlen, heads, head_dim = (int(n) for n in out0.shape[-3:])
    batch = int(np.prod(lead)) if lead else 1
    parts = _strided_parts([o for o, _ in views], 3)
    plse = _strided_parts([l for _, l in views], 2)
    in_place = parts is not None and plse is not None
    if not in_place:
        # no common stride between the parts: copy each once into [P, B', S, H, D] / [P, B', H, S]
        stacked = cupy.stack([cupy.ascontiguousarray(o).reshape(batch, seqlen, heads, head_dim) for o, _ in views])
        stacked_lse = cupy.stack([cupy.ascontiguousarray(l).reshape(batch, heads, seqlen) for _, l in views])
        parts = stacked.data.ptr, _arrays.element_strides(stacked)[:4]
        plse = stacked_lse.data.ptr, _arrays.element_strides(stacked_lse)
    out = ctx.empty(tuple(out0.shape), out0.dtype)  # contiguous: viewed as [B', S, H, D] below
    lse = ctx.empty(tuple(lse0.shape), np.float32)  # [B', H, S]
    dims = (len(views), batch, seqlen, heads, head_dim)
    launch = _launch_combine(parts[0], parts[1], plse[0], plse[1], dims, out0.dtype,
                             out.reshape(batch, seqlen, heads, head_dim), lse.reshape(batch, heads, seqlen), ctx.stream)
    return out, lse, launch if in_place else None


def merge_stacked(parts, parts_lse, out, lse, stream, execute: bool = True):
    """merge_states on the device over P states stacked in two CuPy arrays of any strides, parts
    ``[P, B, S, H, D]`` and parts_lse ``[P, B, H, S]``, written into out ``[B, S, H, D]`` and float32
    lse ``[B, H, S]`` (or None), also of any strides (cascade attention's split prefix: the parts
    are slices of one varlen output, and the merged state lands in a permuted view of its final
    layout). Returns the prepared launch; ``execute=False`` only prepares it."""
    return _launch_combine(parts.data.ptr, _arrays.element_strides(parts)[:4], parts_lse.data.ptr,
                           _arrays.element_strides(parts_lse), tuple(int(n) for n in parts.shape), parts.dtype, out,
                           lse, stream, execute=execute)
