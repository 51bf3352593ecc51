"""Exact attention for prefill and training: ``attention`` and ``attention_varlen`` (forward) and
their gradients, ``attention_backward`` and ``attention_varlen_backward``.

    out = softmax(mask(cap(scale * q @ k^T))) @ v        lse = logsumexp of the same scores

computed tile by tile on tensor cores (the forward in ``cuda_src/flash_fwd_sm90.cu`` on sm_90a
where the TMA can read the arrays, else ``cuda_src/flash_fwd.cu``; the backward by recomputation
in ``cuda_src/flash_bwd.cu``) without ever writing the Sq x Sk score matrix: the forward's extra
device memory is ``out`` and ``lse``. The kernels' variants, tiles and launch choices are this
module's tables (``FWD_TILES``, ``FWD_SM90_TILES``, ``BWD_TILES``, ...).

Layouts (any strides, as long as the last axis is contiguous, so the transpose of a
``(B, H, S, D)`` tensor works without a copy):

    dense    q (B, Sq, Hq, D)      k (B, Sk, Hk, D)      v (B, Sk, Hk, Dv)      out (B, Sq, Hq, Dv)
             lse (B, Hq, Sq)
    varlen   q (total_q, Hq, D)    k (total_k, Hk, D)    v (total_k, Hk, Dv)    out (total_q, Hq, Dv)
             lse (Hq, total_q)

``Hq`` must be a multiple of ``Hk`` (MHA, GQA, MQA). The head dims D (of q and k) and Dv (of v
and the output) are each a multiple of 8 from 8 to 256; Dv may differ from D (DeepSeek's prefill:
D = 192, Dv = 128), and the default scale is ``1 / sqrt(D)`` either way. ``causal`` is aligned
to the bottom-right corner: query i sees key j iff ``j <= i + Sk - Sq``. ``window=(left, right)``
keeps ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1 = unbounded). ``softcap > 0``
replaces the scaled score s by ``softcap * tanh(s / softcap)``. ``lse`` is float32 and the
**natural log** of the softmax denominator. A row with no visible key gives out = 0 and lse = -inf, never NaN.

NumPy inputs run the float64 reference (``cuattn.reference``) on the CPU and return NumPy
arrays in q's dtype.

FP8: e4m3 q, k, v with ``q_scale``, ``k_scale``, ``v_scale`` (real value = stored x scale) run
``flash_fwd_sm90_kernel`` on e4m3 tensor cores (sm_90a, D = Dv = 128 or 256) and return ``out_dtype``
(bf16 by default); see ``_attention_fp8`` and ``cuattn.fp8.quantize_qkv``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from . import _arrays, _calls, _jit, _masks, _params, _tma, reference
from .decode import fast_divisor



# ---------------------------------------------------------------------------------------------
# Kernel choice: one traits table, tile sizes per head dim


@dataclasses.dataclass(frozen=True)
class FwdTile:
    """Tile sizes of flash_fwd_kernel: BLOCK_M query rows per CTA, BLOCK_N keys per step."""

    block_m: int
    block_n: int
    warps: int

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Q tile plus one K and one V tile, each row padded (SmemRow::kPadElems in
        attention_tile.cuh): [BLOCK_M + 2 BLOCK_N, D + pad]."""
        return (self.block_m + 2 * self.block_n) * (head_dim + _params.constant("kPadElems")) * itemsize

    def threads(self) -> int:
        return self.warps * 32


# The fastest spill-free tiles per head dim and architecture family: `python -m cuattn build`
# checks the spills, scripts/tune_fwd.py measured the candidates on an H200 (BENCHMARKS.md).
# Each warp owns BLOCK_M / warps query rows: 32 rows (two m16 tiles) halve the shared-memory
# reads of K and V per FLOP against 16, and the fp32 output accumulator of 32 rows x D is what
# fills the registers, so the key block BLOCK_N is whatever register allocation leaves room for.
# The columns differ only where ptxas allocates differently for the two targets.
# The keys are tile head dims: a call runs the smallest tile at least its head dim, which it gives
# at run time (FwdParams::head_dim: columns past it are zero on load and not stored). 80 (ViT-H)
# and 160 have tiles of their own, since 96 and 256 would spend 20% and 60% more MMA work on
# zeros; the others pad (192 and 224: 33% and 14% in the 256 tile). Their sizes follow the
# neighbours' register budget (32 rows x 80 of output beside 64 keys; 160 like 256, 16 rows a warp)
# and are not measured yet (scripts/tune_fwd.py). D = 64 on sm_90a takes sm_80's 96-key blocks:
# with the run-time head dim's compare 128 keys spill 16 bytes (this kernel runs D = 64 there only
# for views the TMA cannot read, and for the head dims padded to 64).
SM80, SM90 = "sm_80", "sm_90a"
FWD_TILES = {
    32: {SM80: FwdTile(128, 128, 4), SM90: FwdTile(128, 128, 4)},
    64: {SM80: FwdTile(128, 96, 4), SM90: FwdTile(128, 96, 4)},
    80: {SM80: FwdTile(128, 64, 4), SM90: FwdTile(128, 64, 4)},
    96: {SM80: FwdTile(128, 48, 4), SM90: FwdTile(128, 48, 4)},
    128: {SM80: FwdTile(128, 64, 4), SM90: FwdTile(128, 64, 4)},
    160: {SM80: FwdTile(64, 64, 4), SM90: FwdTile(64, 64, 4)},
    256: {SM80: FwdTile(64, 64, 4), SM90: FwdTile(64, 64, 4)},
}
# flash_fwd_kernel's ALiBi variants (ALIBI, dense and paged) where FWD_TILES' tile spills with
# them: at D = 128 on sm_80 the bias pass (the slope is read per key block) spills 16 bytes with
# 64-key blocks and with 48, and 32 keys take 242 registers; on sm_90a the paged variant spills 8
# bytes with 64-key blocks (its block table's registers), 48 keys take 254 (`python -m cuattn
# build`, NVRTC 13.0). Not measured for speed yet (scripts/tune_fwd.py).
FWD_ALIBI_TILES = {
    128: {SM80: FwdTile(128, 32, 4), SM90: FwdTile(128, 48, 4)},
}
# every head dim the forward and backward take (the CPU path takes the same)
SUPPORTED_HEAD_DIMS = _arrays.SUPPORTED_HEAD_DIMS
TILE_HEAD_DIMS = tuple(sorted(FWD_TILES))
SUPPORTED_DTYPES = ("float16", "bfloat16")


def arch_family(arch: str) -> str:
    """The FWD_TILES column for a target: Hopper's own, or the sm_80 one for every other arch."""
    return SM90 if arch.startswith("sm_90") else SM80


def fwd_tile_dim(head_dim: int, head_dim_v: int | None = None) -> int:
    """The tile head dim flash_fwd_kernel is instantiated with for q's and k's ``head_dim`` and v's
    ``head_dim_v`` (None: the same): the tile of the larger, whose columns hold both (the
    smaller one's extra columns are zero-filled, which flash_fwd.cu explains is exact)."""
    return _arrays.tile_head_dim(max(head_dim, head_dim_v or head_dim), FWD_TILES)


def fwd_tile(head_dim: int, arch: str, alibi: bool = False, head_dim_v: int | None = None) -> FwdTile:
    """flash_fwd_kernel's tile for ``head_dim`` and v's ``head_dim_v`` (None: the same; any
    supported ones) on ``arch``; ``alibi``: for its ALiBi variant."""
    family, tile_dim = arch_family(arch), fwd_tile_dim(head_dim, head_dim_v)
    alibi_tile = FWD_ALIBI_TILES.get(tile_dim, {}).get(family) if alibi else None
    return alibi_tile or FWD_TILES[tile_dim][family]


def _cpp_bool(flag: bool) -> str:
    return "true" if flag else "false"


@functools.lru_cache(maxsize=None)
def fwd_spec(dtype, head_dim: int, tile: FwdTile, alibi: bool = False, paged: bool = False) -> _jit.KernelSpec:
    """flash_fwd_kernel for ``tile`` instantiated at tile head dim ``head_dim``; ``alibi``: the
    variant that adds ALiBi's bias (its ALIBI flag);
    ``paged``: the variant reading keys and values from a paged cache (its PAGED flag)."""
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    return _jit.KernelSpec(
        "flash_fwd.cu",
        f"cuattn::flash_fwd_kernel<{ctype}, {head_dim}, {tile.block_m}, {tile.block_n}, {tile.warps}, "
        f"{_cpp_bool(alibi)}, {_cpp_bool(paged)}>",
        threads=tile.threads(),
        smem_bytes=tile.smem_bytes(head_dim, np.dtype(dtype).itemsize),
    )


@dataclasses.dataclass(frozen=True)
class FwdSm90Tile:
    """flash_fwd_sm90_kernel (sm_90a, persistent: one CTA per SM walks the tiles): a producer
    warpgroup and `consumers` warpgroups of 64 query rows each, K and V in `stages` TMA stages
    of `block_n` keys; `overlap` issues block j's S GEMM with block j-1's PV GEMM, `pingpong`
    lets the consumers take turns; `bounded`: the softmax exponentiates against the running row
    max and finds a block's max only where the sums say it grew (AttentionTile::
    softmax_to_fragments), visiting the key blocks from the diagonal outward (as every ALiBi
    variant does)."""

    block_n: int
    consumers: int
    stages: int
    overlap: bool = True
    pingpong: bool = True
    bounded: bool = True

    def __post_init__(self):
        if not (self.overlap or self.bounded):
            raise ValueError(f"FwdSm90Tile: bounded=False needs overlap=True (without the overlap the softmax is "
                             f"the bounded one), got {self}")

    @property
    def block_m(self) -> int:
        return _params.constant("kWgmmaM") * self.consumers

    def threads(self) -> int:
        return _params.constant("kWarpgroupThreads") * (self.consumers + 1)

    def drops_unseen(self, alibi: bool = False) -> bool:
        """Whether each consumer warpgroup leaves out the key blocks none of its stored rows sees
        (flash_fwd_sm90_kernel's kDropUnseen, FwdSm90Work::drop_unseen; mirrored for the tests): not
        with ping-pong, whose turns pair the warpgroups' blocks, nor with ALiBi beside the overlap
        (it spilled there)."""
        return not self.pingpong and not (self.overlap and alibi)

    def smem_bytes(self, head_dim: int, head_dim_v: int, itemsize: int, out_itemsize: int = 2,
                   alibi: bool = False, kv_e4m3: bool = False) -> int:
        """FwdSm90Smem: Q [BLOCK_M, D], K [stages, BLOCK_N, D] and V [stages, BLOCK_N, Dv] (or
        V^T [stages, Dv, BLOCK_N]), swizzled in rows of whole 128-byte panels (``itemsize`` 2, or
        1 for e4m3); two 8-byte mbarriers for Q, four per stage and two per slot of the tile ring,
        the ring's int32 tile indices and the producer's hand-over slots, an atom of alignment
        slack, and an O tile [BLOCK_M, Dv] of the 16-bit output where that still fits (else O is
        staged in Q's). ``alibi``: the ALIBI variant, which with 16-bit inputs and head dims up
        to kAlibiGemmMaxHeadDim adds the ALiBi key offsets' tile for pieces of the whole block, or
        else of kAlibiMinPieceKeys keys, where it fits beside the rest without taking O's tile
        (FwdSm90SmemOf, the kernel's kAlibiGemm). ``kv_e4m3``: the variant over e4m3 pages, which
        adds a staging of one key block's e4m3 rows of K and V ([block_n, D and Dv rounded up to
        whole spans of 128 bytes, or of 64 at D = 64]), O's tile given up where both do not fit
        beside it."""
        panel = _params.constant("kSwizzleRowBytes")

        def row_bytes(cols: int, size: int) -> int:
            return -(-cols * size // panel) * panel

        q_tile = self.block_m * row_bytes(head_dim, itemsize)
        o_tile = self.block_m * row_bytes(head_dim_v, out_itemsize)
        # e4m3 V^T rows are BLOCK_N keys (whole panels), one per Dv column
        v_rows, v_cols = (head_dim_v, self.block_n) if itemsize == 1 else (self.block_n, head_dim_v)
        v_stage = v_rows * row_bytes(v_cols, itemsize)
        ring = _params.constant("kFwdSm90TileRing")
        barriers = 2 + 4 * self.stages + 2 * ring
        index_words = ring + _params.constant("kFwdSm90ProducerSlots")
        trailing = (_params.constant("kMbarrierBytes") * barriers
                    + _params.constant("kFwdSm90TileIndexBytes") * index_words + _params.constant("kSwizzleAtomBytes"))
        fixed = q_tile + self.stages * (self.block_n * row_bytes(head_dim, itemsize) + v_stage) + trailing
        limit = _params.constant("kSm90MaxSmem")

        def with_o(tiles: int) -> int:  # FwdSm90Smem::kBytes: the O tile where it still fits
            return tiles + o_tile if tiles + o_tile <= limit else tiles

        def alibi_bytes(piece: int) -> int:  # FwdSm90Smem::kAlibiBytes
            row = _params.constant("kAlibiKeyRowBytes")
            return max((piece + _params.constant("kAlibiTailRows")) * row, 2 * piece * row - trailing)

        def staged_row_bytes(cols: int) -> int:  # e4m3_staging_row_bytes: whole spans of a row's lanes
            copy, warp = _params.constant("kCopyBytes"), _params.constant("kWarpSize")
            lanes = cols // copy if cols < panel and cols % copy == 0 and warp % (cols // copy) == 0 else panel // copy
            return -(-cols // (lanes * copy)) * lanes * copy

        if kv_e4m3:  # FwdSm90SmemOf::kStagingBytes
            return with_o(fixed + self.block_n * (staged_row_bytes(head_dim) + staged_row_bytes(head_dim_v)))
        if alibi and itemsize == 2 and max(head_dim, head_dim_v) <= _params.constant("kAlibiGemmMaxHeadDim"):
            # FwdSm90SmemOf::fits: the key tile beside the rest, O's tile kept where it had one
            own_o = o_tile if fixed + o_tile <= limit else 0
            for piece in (self.block_n, _params.constant("kAlibiMinPieceKeys")):
                tiles = fixed + alibi_bytes(piece)
                if tiles + own_o <= limit:
                    return tiles + own_o
        return with_o(fixed)


# The Hopper forward's tiles, keyed by the (D, Dv) they are instantiated for. A call runs the
# smallest pair that holds its own head dims (fwd_sm90_tile_dims): the TMA reads zeros past its
# D and Dv and the kernel stores Dv columns, so D = 72 runs in the (80, 80) tile and D = 192 with
# Dv = 64 in (192, 128). Head dims of at most FWD_SM90_MIN_HEAD_DIM and views the TMA cannot read
# run flash_fwd_kernel. Shared tiles are whole 64-column panels (D = 160 takes three), and the
# wide head dims take 80-key blocks: at D = 160, 96- and 112-key blocks build without spills
# (NVRTC 13.0) but ran 1-11% slower (BENCHMARKS.md, "Twenty-ninth session"). D = 256
# takes the intra-warpgroup overlap without ping-pong: its output accumulator alone is 128
# registers a thread, a second block's P sits beside it, and with ping-pong as well it spills.
# Only D = 64 takes the bounded softmax beside the overlap (2-3% faster at 1k keys without a
# mask, the same causal): from D = 80 on it measured 1-12% slower there than the lazy max (its
# vote waits for the PV GEMM and holds K's stage the while), and at 192 and 256 it spills.
# `scripts/tune_fwd.py --sm90` and `scripts/ab_forward.py` measured the candidates on the H200
# (BENCHMARKS.md).
FWD_SM90_TILES = {
    (64, 64): FwdSm90Tile(128, 2, 4),
    (80, 80): FwdSm90Tile(128, 2, 2, bounded=False),
    (96, 96): FwdSm90Tile(128, 2, 2, bounded=False),
    (128, 128): FwdSm90Tile(128, 2, 2, bounded=False),
    (160, 160): FwdSm90Tile(80, 2, 2, pingpong=False, bounded=False),
    (192, 128): FwdSm90Tile(128, 2, 2, bounded=False),
    (192, 192): FwdSm90Tile(80, 2, 2, bounded=False),
    (256, 256): FwdSm90Tile(80, 2, 2, pingpong=False, bounded=False),
}
# Tiles that calls without a causal or window mask take in place of FWD_SM90_TILES' (at any key
# count). D = 160 without a mask runs ping-pong: its tile in FWD_SM90_TILES leaves the two
# consumers without turns so that each can drop the key blocks its rows do not see under a causal
# mask, which a call without a mask never does. On the H200 (bf16, B * N = 32k tokens, H = 13,
# four runs on two machines, BENCHMARKS.md "Twenty-fifth session"): without a mask 550.3-582.7
# TFLOP/s (mean 572.1) against 541.7-564.9 (550.6) at 4k keys, 495.8-507.0 against 477.4-502.7
# at 1k; causal 493.9-509.7 against 507.3-513.9 at 4k, so the masked calls keep the drop.
FWD_SM90_UNMASKED_TILES = {
    (160, 160): FwdSm90Tile(80, 2, 2, bounded=False),
}
# The PAGED variant's tile where the dense one does not fit its registers: the paged producer is
# the whole warpgroup and keeps more registers (kFwdSm90PagedProducerRegs), leaving the consumers
# 16 fewer (224), and D = 256's intra-warpgroup overlap spilled there already at 232.
FWD_SM90_PAGED_TILES = {
    (256, 256): FwdSm90Tile(80, 2, 2, overlap=False, pingpong=False),
}
# The KV_E4M3 variant's tile where the paged one leaves no room for the e4m3 rows' staging
# (FwdSm90SmemOf::kStagingBytes, which lets each block's copies run ahead of their widening): the
# same tile with 64-key blocks (builds without spills).
FWD_SM90_E4M3_PAGED_TILES = {
    (192, 128): FwdSm90Tile(64, 2, 2, bounded=False),
    (256, 256): FwdSm90Tile(64, 2, 2, overlap=False, pingpong=False),
}


@dataclasses.dataclass(frozen=True)
class LongKeyTile:
    """A Hopper tile for long key ranges: calls over at least ``keys`` keys a sequence take it
    under a causal or window mask, and from ``unmasked_keys`` without one."""

    keys: int
    unmasked_keys: int
    tile: FwdSm90Tile

    def takes(self, seqlen_k: int, banded: bool) -> bool:
        return seqlen_k >= (self.keys if banded else self.unmasked_keys)


# Tiles for long key ranges: three consumer warpgroups (192 query rows a tile, FlashAttention-3's
# D = 64 shape) without either overlap: 160 registers a consumer against the two-warpgroup
# tile's 240 (too few for a second block's P), but a third softmax under the others' GEMMs, and
# the softmax that skips the row max on most blocks (`bounded`, which needs the GEMMs done). On
# the H200 (bf16, full / causal, BENCHMARKS.md "Sixteenth session"): D = 64 465 / 389 TFLOP/s at
# 4k keys and 491 / 468 at 16k; D = 80 439 / 388 and D = 96 530 / 446 at 4k against the
# two-warpgroup tile's 418 / 370 and 505 / 438. D = 64 and 96 take it from 1k keys without a
# mask: D = 64 7% faster there, D = 96 level on dense calls and 7% faster on ragged varlen ones
# ("Twentieth session"). Under a causal mask, since each warpgroup drops the key blocks its rows
# do not see, it leads from 512 keys at D = 64 (223 against 198 TFLOP/s; 309 against 267 at 1k)
# and from 768 at D = 96 (311 against 283; 4% behind at 512), and trails both at 256 by 8-20%
# ("Twenty-third session"; before the drop the two-warpgroup tiles led at 1k by 9-20%). Window
# masks take the causal counts (`banded`; not measured apart). D = 80 took 112-key blocks and
# three stages while 128 keys spilled; the 128-key, two-stage tile (D = 96's) now builds without
# spills (NVRTC 13.0 and 12.9) and runs 3-14% faster from 4k keys (521 / 486 at 4k, 560 / 502
# at 16k) and ahead of the two-warpgroup tile from 512 keys, masked or not (1k: 419 / 325 against
# 409 / 293; 768: 439-441 / 288 against 385-387 / 263; 512: 358-360 / 223 against 351-353 / 215).
# The intra-warpgroup overlap fits beside 96-key blocks at D = 64, 80 and 96 (112 at D = 64):
# 6-25% slower at D = 64 and 96, and at D = 80 within the runs' spread, slower with ALiBi
# ("Seventeenth session"). D = 160 takes three warpgroups with its 80-key blocks (160 registers a
# consumer fit its 80 of O without the overlap; 198 KB of shared memory, O staged in Q's tile):
# on the H200 (bf16, B * N = 32k, H = 13, three interleaved rounds, "Thirty-third session")
# without a mask 554-559 against 515-545 TFLOP/s at 2k, 574-578 against 560-570 at 4k, 612-630
# against 581-589 at 16k, but 481-500 against 493-514 at 1k; under a causal mask 360-363 against
# 348-356 at 1k and 513-525 against 501-506 at 4k (D = 192's 80-key tile: 0.90-0.98 of it now).
# D = 128 takes them too, with 128-key blocks and two stages (225 KB of shared memory, O staged
# in Q's tile; no spills): two interleaved runs (four rounds each, "Thirty-fourth session") put
# it ahead of the two-warpgroup tile with both overlaps from 1k keys, 0.7-1.6% without a mask at
# 1k (533 against 530), 3-5% at 2k-4k, 7-9% at 8k-16k (683 against 628 at 16k), and under a
# causal mask 5% at 1k (399 against 381) and 6-7% from 2k. With ALiBi it leads as well (525 / 395
# against 497 / 375 at 1k, 624 / 551 against 575 / 522 at 4k, full / causal) since a warp finds
# the max of a block holding its diagonals first (flash_fwd_sm90.cu, holds_warp_diagonal).
FWD_SM90_LONG_TILES = {
    (64, 64): LongKeyTile(512, 1024, FwdSm90Tile(128, 3, 4, overlap=False, pingpong=False)),
    (80, 80): LongKeyTile(512, 512, FwdSm90Tile(128, 3, 2, overlap=False, pingpong=False)),
    (96, 96): LongKeyTile(768, 1024, FwdSm90Tile(128, 3, 2, overlap=False, pingpong=False)),
    (128, 128): LongKeyTile(1024, 1024, FwdSm90Tile(128, 3, 2, overlap=False, pingpong=False)),
    (160, 160): LongKeyTile(1024, 2048, FwdSm90Tile(80, 3, 2, overlap=False, pingpong=False)),
}


def fwd_sm90_tile(dims: tuple[int, int], paged: bool = False, seqlen_k: int = 0, banded: bool = True,
                  kv_e4m3: bool = False) -> FwdSm90Tile:
    """The Hopper forward's tile at tile head dims ``dims`` (a key of FWD_SM90_TILES), for dense or
    paged keys (``kv_e4m3``: e4m3 pages, the KV_E4M3 variant), over at most ``seqlen_k`` keys a
    sequence, under a causal or window mask (``banded``) or none."""
    if kv_e4m3:
        return FWD_SM90_E4M3_PAGED_TILES.get(dims) or fwd_sm90_tile(dims, paged=True)
    if paged:
        return FWD_SM90_PAGED_TILES.get(dims) or FWD_SM90_TILES[dims]
    long = FWD_SM90_LONG_TILES.get(dims)
    if long is not None and long.takes(seqlen_k, banded):
        return long.tile
    return (not banded and FWD_SM90_UNMASKED_TILES.get(dims)) or FWD_SM90_TILES[dims]


# ptxas options of every flash_fwd_sm90_kernel variant. At ptxas's default -O3 (CUDA 13.0) some
# variants computed wrong outputs on the H200, every launch the same way: D = 160 and 192 with
# 80-key blocks and ping-pong, D = 256 with ping-pong and no intra-warpgroup overlap, D = 192 with
# 64-key blocks without ping-pong, and which ones flipped with unrelated edits (a store guard in
# the epilogue). At -O1 every one of them is right, and the variants measured as fast or faster
# (BENCHMARKS.md, "Hopper tiles for every head dim"); tests/test_attention.py keeps those
# variants in its sweep. On the sources of the fifty-seventh session the same five variants
# built at -O3 were right (an H100), with no racecheck hazard or synccheck error, so no missing
# fence that -O1 hides showed up; -O1 stays because -O3 then ran level to 4% slower everywhere
# but D = 160 without a mask (2% faster; BENCHMARKS.md, "Fifty-seventh session").
FWD_SM90_PTXAS_OPTIONS = ("--ptxas-options=-O1",)
# Head dims up to this run flash_fwd_kernel, in its 32-column tile: the Hopper kernel's narrowest
# tile is 64 columns, half or more of them zeros there (the two are not measured against each
# other at these head dims yet).
FWD_SM90_MIN_HEAD_DIM = 32


def fwd_sm90_row_shift(seqlen_q: int, block_m: int) -> int:
    """The rows by which flash_fwd_sm90_kernel moves its tiles' alignment back in a dense call under
    a causal mask (FwdSm90Work::row_shift computes it; this mirrors it for the tests): those of the
    whole warpgroups (kWgmmaM rows) that a last tile aligned at row 0 would leave past Sq. The
    tiles then end at the last row, and the surplus falls in the first tile (clamped to start at
    row 0), whose rows see the fewest keys (flash_fwd_sm90.cu, "Row alignment")."""
    rows = _params.constant("kWgmmaM")
    return (-seqlen_q) % block_m // rows * rows


def fwd_sm90_tile_dims(head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """The (D, Dv) of the Hopper tile that runs these head dims: of the pairs in FWD_SM90_TILES that
    hold both, the one of the fewest columns; None when none does (or a head dim is at most
    FWD_SM90_MIN_HEAD_DIM)."""
    if min(head_dim, head_dim_v) <= FWD_SM90_MIN_HEAD_DIM:
        return None
    fits = [pair for pair in FWD_SM90_TILES if pair[0] >= head_dim and pair[1] >= head_dim_v]
    return min(fits, key=lambda pair: (pair[0] + pair[1], pair)) if fits else None
# The FP8 forward (e4m3 q, k, v; flash_fwd_sm90_kernel with T = e4m3): D = 128 and 256 (a row of
# D = 64 is half a 128-byte swizzle row). Key blocks of kFp8ScaleBlockKeys = 128 (one 128-byte
# row of V^T per D row). D = 128 runs three consumer warpgroups (192 query rows a tile) without
# either overlap: at 160 registers a consumer the overlap spills, and without it the third
# warpgroup's softmax runs under the others' GEMMs (`scripts/bench_fp8_fwd.py --tune`, H200:
# 847 / 757 TFLOP/s at N = 8192 full / causal against 786 / 718 for the 16-bit kernels' tile;
# since the softmax skips the row max on most blocks, 963 / 852). D = 256 takes no
# intra-warpgroup overlap: beside the 128 accumulator registers of O, a second 128-key block's P
# spills (36 bytes without ping-pong).
FWD_SM90_FP8_TILES = {
    128: FwdSm90Tile(128, 3, 3, overlap=False, pingpong=False),
    256: FwdSm90Tile(128, 2, 2, overlap=False),
}
FP8_HEAD_DIMS = tuple(sorted(FWD_SM90_FP8_TILES))
FP8_OUT_DTYPES = ("bfloat16", "float16")

# Longest key range a causal or windowed call still runs on the persistent grid under the static
# schedule (measured: 1k faster persistent, 4k and 16k faster with one CTA per tile).
FWD_SM90_PERSISTENT_BANDED_KEYS = 2048

# flash_fwd_sm90_kernel's tile schedule (the kernel file's opening comment):
#   "dynamic"  one CTA per SM; each takes its next tile from a per-stream counter (an atomicAdd),
#              the heaviest query blocks first, over L2 sections of heads (l2_section_heads: under
#              a causal or window mask; without one, (batch, head) pair after pair);
#   "static"   one CTA per SM with a fixed stride over (batch, head)-major tiles, or one CTA per
#              tile for banded masks over more than FWD_SM90_PERSISTENT_BANDED_KEYS keys.
#   "auto"     dynamic, but static for dense calls without a mask whose Sq is a whole number of
#              tiles. Measured on the H200 (BENCHMARKS.md, "The dynamic tile schedule" and
#              "Twenty-sixth session"): dynamic is 4-24% faster on causal calls at N <= 4k and on
#              ragged varlen; without a mask, pair after pair, 2-6% faster at N <= 4k where the
#              last tile of each head is short (the 192-row tiles of D = 64 and 96, e4m3 D = 128:
#              Sq = 1024 is 5 1/3 tiles; level at 16k), and 0.1-2.3% slower where every tile is
#              whole (D = 128 to 256 at 1k-16k, e4m3 D = 256 at 8k), which the static strides
#              balance as well.
# A module switch (tests, scripts/bench_varlen.py --schedules): plans keep the launch they were
# made with, so clear them (_calls.clear()) after changing it.
FWD_SM90_SCHEDULES = ("auto", "dynamic", "static")
FWD_SM90_SCHEDULE = "auto"
# L2 bytes of K and V one section of the dynamic schedule's heads may span (the H200 has 50 MB
# of L2; the tiles running at once also hold Q and write O).
FWD_SM90_L2_SECTION_BYTES = 32 << 20
# Whether varlen launches on the dynamic schedule (attention_varlen's, and paged_attention_varlen's
# prefill over paged keys) take their tiles from a tile order (tile_order.cu: only tiles that hold
# rows, the longest sequences first), where they hold more than one sequence, the tiles outnumber
# the grid and the longest sequence has at least FWD_SM90_TILE_ORDER_MIN_KEYS keys (paged keys:
# the block table's capacity). The
# order costs a launch of one CTA (2-10 us a call on the H200); below that length the calls are
# short and their tiles few key blocks each, and ran 4-31% slower with it at 64-256 tokens a
# sequence (BENCHMARKS.md, "Twenty-ninth session"). A module switch (tests,
# scripts/bench_varlen.py --tile-order): clear the plans (_calls.clear()) after changing it.
FWD_SM90_TILE_ORDER = True
FWD_SM90_TILE_ORDER_MIN_KEYS = 512
# The dynamic schedule's workspace: int32 counters [2] at its head, next tile and finished CTAs
# (params.cuh), and after them a varlen launch's tile order (tile_order.cu: kTileOrderHead ints,
# then the tiles)
TILE_COUNTER_BYTES = 8

_schedule_workspaces: dict[tuple[int, int], list] = {}


def schedule_workspace_address(nbytes: int, stream_ptr: int, device_id: int) -> int:
    """The dynamic schedule's workspace of (device, stream), at least ``nbytes``: zeroed on that
    stream when allocated (ordered before the launches that follow there), its counters then left
    at zero by every launch (the last CTA resets them), so no launch needs a memset and a CUDA
    graph can replay it. One per stream: launches running at once on two streams must not share
    counters or tile orders. A launch that needs more than the stream's workspace holds gets a
    larger one; every workspace is held for the process's life (a captured graph keeps the
    address). ``nbytes``: TILE_COUNTER_BYTES, or a tile order's :func:`tile_order_bytes` (the
    plans' workspace call).

    A launch under stream capture (a CUDA graph, an XLA command buffer) cannot allocate there:
    where the stream's workspace is too small it gets 0, a null counter, and the kernel runs the
    static schedule (the tile order kernel then writes nothing)."""
    import cupy

    key = (device_id, stream_ptr)
    held = _schedule_workspaces.setdefault(key, [])
    if held and held[-1].nbytes >= nbytes:
        return held[-1].data.ptr
    if cupy.cuda.runtime.streamIsCapturing(stream_ptr):
        return 0
    size = max(nbytes, 2 * held[-1].nbytes if held else TILE_COUNTER_BYTES)
    with cupy.cuda.Device(device_id):
        buf = cupy.empty(-(-size // 4), cupy.int32)
        cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, stream_ptr)
    held.append(buf)
    return buf.data.ptr


def tile_order_entries(capacity: int, grid: int) -> int:
    """Ints of a tile order after its head: ``capacity`` tiles, and the positions past the last
    tile that the ``grid`` CTAs of the forward may read (each CTA's first position, and its last
    take), at most 2 x grid beyond it."""
    return capacity + 2 * grid


def tile_order_bytes(entries: int) -> int:
    """Workspace bytes of a tile order of ``entries`` ints: the counters, the count, the entries."""
    return 4 * (_params.constant("kTileOrderHead") + entries)


def l2_section_heads(batch: int, num_heads: int, num_kv_heads: int, seqlen_k: int, head_dim: int,
                     itemsize: int, banded: bool = True) -> int:
    """(batch, head) pairs per section of the dynamic schedule: under a causal or window mask
    (``banded``) as many as keep their K and V within FWD_SM90_L2_SECTION_BYTES (the q heads of
    one kv head count once), at least one; without a mask one, pair after pair, as the static
    schedule's order: every tile of a pair costs the same there, and the CTAs running at once then
    share the few pairs' K and V (at N = 1k, D = 128 on the H200 32 MiB sections ran 13% slower)."""
    if not banded:
        return 1
    kv_head_bytes = max(1, 2 * seqlen_k * head_dim * itemsize)
    kv_heads = max(1, FWD_SM90_L2_SECTION_BYTES // kv_head_bytes)
    return max(1, min(batch * num_heads, kv_heads * (num_heads // num_kv_heads)))


def _plan_fwd(launch, fields: dict, order_fields: dict | None = None) -> tuple[list, dict]:
    """A forward plan's launches and workspace arguments (``_calls.Plan(bound=..., **workspace)``)
    from ``_launch_fwd``'s launch and the forward's ``fields``: a dynamic launch reads the
    schedule workspace of the stream each planned call runs on, and a tile order's launch
    (:class:`OrderedFwd`) writes it first, its inputs bound as ``order_fields`` says (default:
    the caller's prefix sums)."""
    if isinstance(launch, OrderedFwd):
        if order_fields is None:
            order_fields = {"cu_seqlens_q": "cu_seqlens_q", "cu_seqlens_k": "cu_seqlens_k"}
        order = _calls.Bound(launch.order, {**order_fields, "workspace": "workspace+0"})
        main = _calls.Bound(launch.main, {**fields, "tile_counter": "workspace+0"})
        return [order, main], dict(workspace=launch.workspace_bytes, workspace_of=schedule_workspace_address)
    if int(launch.params[launch.slot("tile_counter")]) == 0:
        return [_calls.Bound(launch, fields)], {}
    return ([_calls.Bound(launch, {**fields, "tile_counter": "workspace+0"})],
            dict(workspace=TILE_COUNTER_BYTES, workspace_of=schedule_workspace_address))


@dataclasses.dataclass(frozen=True)
class OrderedFwd:
    """A varlen forward on the dynamic schedule with its tile order: ``order``
    (fwd_tile_order_kernel) writes the order into the stream's schedule workspace
    (``workspace_bytes`` of it), then ``main`` (flash_fwd_sm90_kernel) takes the tiles it lists."""

    order: _jit.Launch
    main: _jit.Launch
    workspace_bytes: int

    def run(self, stream_ptr: int) -> None:
        self.order.run(stream_ptr)
        self.main.run(stream_ptr)


@functools.lru_cache(maxsize=None)
def tile_order_spec() -> _jit.KernelSpec:
    """fwd_tile_order_kernel (tile_order.cu): a varlen Hopper forward's tile order, one CTA."""
    return _jit.KernelSpec("tile_order.cu", "cuattn::fwd_tile_order_kernel",
                           threads=_params.constant("kTileOrderThreads"))


def tile_order_capacity(batch: int, num_heads: int, total_q: int, block_m: int, m_blocks: int) -> int:
    """Tiles a varlen launch can list: each sequence's query blocks on every head, at most
    ceil(total_q / block_m) + batch of them over ``total_q`` packed rows (a sequence's last block may
    be partial), and at most the launch's ``m_blocks`` a sequence."""
    return num_heads * min(-(-total_q // block_m) + batch, batch * m_blocks)


@functools.lru_cache(maxsize=None)
def fwd_sm90_spec(dtype, head_dim: int, head_dim_v: int, tile: FwdSm90Tile, out_dtype=None,
                  alibi: bool = False, paged: bool = False, kv_e4m3: bool = False) -> _jit.KernelSpec:
    """flash_fwd_sm90_kernel for ``tile`` at tile head dims (``head_dim``, ``head_dim_v``): 16-bit
    ``dtype`` (output the same), or e4m3 inputs (``dtype`` float8_e4m3fn or its uint8 storage)
    with a 16-bit ``out_dtype``; ``alibi``: its ALIBI variant; ``paged``: its PAGED variant (keys
    and values from a paged cache, 16-bit, or with ``kv_e4m3`` e4m3 pages widened to fp16 as the
    producer copies them: the KV_E4M3 variant, whose GEMMs run in fp16 under a bf16 q too)."""
    fp8 = np.dtype(dtype) in (_arrays.FLOAT8_E4M3, _arrays.E4M3_STORAGE)
    if kv_e4m3 and (fp8 or not paged or alibi):
        raise ValueError("the e4m3-pages variant is a paged 16-bit one without ALiBi")
    # e4m3 pages under a bf16 q run the fp16 GEMMs (the kernel's kQFromBf16), output bf16
    ctype = _arrays.E4M3_TYPE if fp8 else _arrays.CUDA_TYPES[np.dtype(np.float16 if kv_e4m3 else dtype)]
    out_ctype = _arrays.CUDA_TYPES[np.dtype(out_dtype if fp8 else dtype)]
    # KV_E4M3 is the kernel's last template parameter, false by default: named only when set
    flags = ", ".join(_cpp_bool(flag) for flag in (tile.overlap, tile.pingpong, tile.bounded, alibi, paged)
                      + ((True,) if kv_e4m3 else ()))
    return _jit.KernelSpec(
        "flash_fwd_sm90.cu",
        f"cuattn::flash_fwd_sm90_kernel<{ctype}, {out_ctype}, {head_dim}, {head_dim_v}, {tile.block_n}, "
        f"{tile.consumers}, {tile.stages}, {flags}>",
        threads=tile.threads(),
        smem_bytes=tile.smem_bytes(head_dim, head_dim_v, 1 if fp8 else np.dtype(dtype).itemsize, alibi=alibi,
                                   kv_e4m3=kv_e4m3),
        needs_sm90a=True,
        options=FWD_SM90_PTXAS_OPTIONS,
    )


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """Every forward and backward variant the dispatchers can pick on ``arch`` (for ``cuattn.build``):
    flash_fwd_kernel with and without ALiBi, dense and paged (paged_attention_varlen's long runs);
    flash_fwd_sm90_kernel per tile with and without ALiBi (16-bit and e4m3), its paged tiles with
    and without ALiBi and over e4m3 pages (paged_attention_varlen's prefill on sm_90a), the FP8 V^T
    pass and the varlen tile order (fwd_tile_order_kernel)."""
    forward = [fwd_spec(dtype, d, fwd_tile(d, arch, alibi), alibi, paged) for dtype in _arrays.CUDA_TYPES
               for d in TILE_HEAD_DIMS for alibi in (False, True) for paged in (False, True)]
    if arch == SM90:
        dense = (list(FWD_SM90_TILES.items()) + list(FWD_SM90_UNMASKED_TILES.items())
                 + [(dims, long.tile) for dims, long in FWD_SM90_LONG_TILES.items()])
        forward += [fwd_sm90_spec(dtype, *dims, tile, alibi=alibi) for dtype in _arrays.CUDA_TYPES
                    for dims, tile in dense for alibi in (False, True)]
        forward += [fwd_sm90_spec(dtype, *dims, fwd_sm90_tile(dims, paged=True), alibi=alibi, paged=True)
                    for dtype in _arrays.CUDA_TYPES for dims in FWD_SM90_TILES for alibi in (False, True)]
        forward += [fwd_sm90_spec(dtype, *dims, fwd_sm90_tile(dims, kv_e4m3=True), paged=True, kv_e4m3=True)
                    for dtype in _arrays.CUDA_TYPES for dims in FWD_SM90_TILES]
        forward += [fwd_sm90_spec(_arrays.FLOAT8_E4M3, d, d, tile, out, alibi=alibi) for out in _arrays.CUDA_TYPES
                    for d, tile in FWD_SM90_FP8_TILES.items() for alibi in (False, True)]
        forward += [fp8_transpose_spec(), tile_order_spec()]
    return forward + bwd_kernel_variants(arch)


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the GPU and CPU paths


def _check_head_dim(name: str, head_dim: int) -> None:
    _arrays.check_head_dim(f"{name}.shape[-1] (head_dim)", head_dim)


def _check_qkv(q, k, v, *, packed: bool) -> None:
    """Shapes of q, k, v: dense (B, S, H, D) or packed varlen (total, H, D) for q and k; v shares
    k's axes but the last, its own head dim Dv (checked as a head dim itself)."""
    if packed:
        layouts = ("(total_q, Hq, D)", "(total_k, Hk, D)", "(total_k, Hk, Dv)")
    else:
        layouts = ("(B, Sq, Hq, D)", "(B, Sk, Hk, D)", "(B, Sk, Hk, Dv)")
    _arrays.check_ndim("q", q, layouts[0])
    _arrays.check_ndim("k", k, layouts[1])
    _arrays.check_ndim("v", v, layouts[2])
    head_axis, dim_axis = q.ndim - 2, q.ndim - 1
    if not packed:
        _arrays.check_axis("k", k, 0, "batch", q.shape[0], "q.shape[0]")
    _arrays.check_axis("k", k, dim_axis, "head_dim", q.shape[dim_axis], f"q.shape[{dim_axis}]")
    for axis, axis_name in enumerate(layouts[1].strip("()").split(", ")[:dim_axis]):
        _arrays.check_axis("v", v, axis, axis_name, k.shape[axis], f"k.shape[{axis}]")
    num_heads, num_kv_heads = int(q.shape[head_axis]), int(k.shape[head_axis])
    _arrays.check_positive("k", k, head_axis, "num_kv_heads")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"q.shape[{head_axis}] (num_heads) = {num_heads} must be a multiple of "
            f"k.shape[{head_axis}] (num_kv_heads) = {num_kv_heads}"
        )
    _check_head_dim("q", int(q.shape[dim_axis]))
    _arrays.check_head_dim("v.shape[-1] (head_dim_v)", int(v.shape[dim_axis]))


def _check_dtypes(q, k, v, host: bool) -> None:
    _arrays.check_dtypes({"q": q, "k": k, "v": v}, host)


def _check_out(out, q, v, v_name: str = "v") -> None:
    """``out=``: q's shape with v's head dim Dv last (``v_name``: the argument holding v, for the
    message), and q's dtype."""
    if tuple(out.shape) != reference.out_shape(q, v):
        raise ValueError(f"out.shape must equal q.shape[:-1] + {v_name}.shape[-1:] (v's head dim Dv last) = "
                         f"{reference.out_shape(q, v)}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(q.dtype):
        raise TypeError(
            f"out.dtype must equal q.dtype = {_arrays.dtype_name(q.dtype)}, got {_arrays.dtype_name(out.dtype)}"
        )
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out must be writable, got a read-only NumPy array")
    # a zero stride on a longer axis writes one element from several rows: the last one would win
    strides = _arrays.element_strides(out)
    shared = [axis for axis, (n, stride) in enumerate(zip(out.shape, strides)) if n > 1 and stride == 0]
    if shared:
        raise ValueError(f"out must not overlap itself: out.shape = {tuple(out.shape)} with stride 0 along axis "
                         f"{shared[0]} (a broadcast view)")


def _check_device_arrays(named: dict) -> None:
    first_name, first = next(iter(named.items()))
    for name, x in named.items():
        _arrays.check_kernel_layout(name, x)
        _arrays.check_same_device(name, x, first_name, first)


# ---------------------------------------------------------------------------------------------
# Public API


def _check_alibi(slopes, batch: int, num_heads: int, host: bool, q) -> int:
    """Checks ``alibi_slopes`` (when given) against the batch and q's heads; returns the batch
    stride the kernels read them with (0: one row of slopes for every sequence, or none)."""
    return 0 if slopes is None else _arrays.check_alibi_slopes(slopes, batch, num_heads, host, "q", q)


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None,
              return_lse=False, out=None, q_scale=None, k_scale=None, v_scale=None, out_dtype=None):
    """Exact softmax attention of q over k, v; FlashAttention-style, never materialising scores.

    Args:
        q: ``(B, Sq, Hq, D)`` float16 or bfloat16 (any float dtype for NumPy inputs).
        k: ``(B, Sk, Hk, D)``, same dtype; ``Hq % Hk == 0`` (MHA, GQA, MQA).
        v: ``(B, Sk, Hk, Dv)``, same dtype; its head dim Dv may differ from D (each a multiple of
            8 from 8 to 256), and the output has it.
        causal: mask keys after the query, aligned to the bottom-right corner when Sq != Sk.
        scale: score multiplier, default ``1 / sqrt(D)`` (q's head dim, whatever Dv).
        window: ``(left, right)`` sliding window around the (bottom-right aligned) diagonal;
            -1 leaves a side unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        sinks: optional float32 ``(Hq,)`` attention-sink logits (score units): each joins its
            head's softmax denominators and carries no value; lse includes it, and a row with no
            visible key gets lse = sinks[h].
        alibi_slopes: optional float32 ``(Hq,)`` or ``(B, Hq)`` ALiBi slopes: after scale and
            softcap, score (i, j) of head h gains ``-slope * |i + Sk - Sq - j|`` (FlashAttention-2's
            convention; masked keys stay masked).
        return_lse: also return the float32 log-sum-exp ``(B, Hq, Sq)``, natural log.
        out: optional ``(B, Sq, Hq, Dv)`` array (q's dtype and framework; with FP8 inputs
            ``out_dtype``) to write into.
        q_scale, k_scale, v_scale: descales of FP8 inputs (q, k, v all float8_e4m3fn, CuPy uint8
            storage, torch.float8_e4m3fn), required with them: real value = stored x scale. Each
            a positive float or a float32 array ``()``, ``(1,)`` or ``(H,)`` (per head of that
            tensor); q and k also ``(B, H, ceil(S / block))`` for block quantisation, one scale
            per 64 rows of q and per 128 keys of k (``cuattn.fp8.quantize_qkv`` makes them).
            FP8 runs on sm_90a, D = Dv = 128 or 256 (``FP8_HEAD_DIMS``), not with varlen.
        out_dtype: the output dtype of FP8 inputs, float16 or bfloat16 (default bfloat16).

    Returns:
        ``out`` ``(B, Sq, Hq, Dv)``, or ``(out, lse)`` with ``return_lse``, in the framework of the inputs.
    """
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse)
    fp8 = dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype)
    if any(x is not None for x in fp8.values()):
        return _attention_fp8(q, k, v, causal=causal, scale=scale, window=(left, right), softcap=softcap, sinks=sinks,
                              alibi_slopes=alibi_slopes, return_lse=return_lse, out=out, **fp8)
    result, call_key = _calls.run("attention", (q, k, v, out, sinks, alibi_slopes),
                                  (bool(causal), scale, left, right, softcap, bool(return_lse)))
    if result is not None:
        return result
    with _arrays.array_context(q=q, k=k, v=v, out=out, sinks=sinks, alibi_slopes=alibi_slopes) as ctx:
        qv, kv, vv, ov, sv, av = (ctx.view(x) for x in (q, k, v, out, sinks, alibi_slopes))
        if any(_arrays.is_e4m3(x) for x in (qv, kv, vv)):
            _check_fp8_dtypes(qv, kv, vv, "an e4m3 input")
            raise ValueError("q_scale is required with float8_e4m3fn q (real value = stored x q_scale); "
                             "so are k_scale and v_scale")
        _check_qkv(qv, kv, vv, packed=False)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        if ov is not None:
            _check_out(ov, qv, vv)
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[2]), ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, int(qv.shape[0]), int(qv.shape[2]), ctx.on_host, qv)
        _masks.check_total_length(int(qv.shape[1]), int(kv.shape[1]), "q.shape[1] + k.shape[1] (Sq + Sk)")
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k": kv, "v": vv, "out": ov})
            result = reference.attention(
                qv, kv, vv, causal=causal, scale=scale, window=(left, right), softcap=softcap, return_lse=True,
                sinks=sv, alibi_slopes=av,
            )
            return _host_result(result, qv, ov, return_lse)

        _check_device_arrays({"q": qv, "k": kv, "v": vv, **({"out": ov} if ov is not None else {})})
        batch, seqlen_q, num_heads, _ = map(int, qv.shape)
        lse_shape, out_shape = (batch, num_heads, seqlen_q), reference.out_shape(qv, vv)
        if ov is None:
            ov = ctx.empty(out_shape, qv.dtype)
        lse = ctx.empty(lse_shape, np.float32) if return_lse else None
        launch = _launch_fwd(
            qv, kv, vv, ov, lse, None, None,
            batch=batch, seqlen_q=seqlen_q, seqlen_k=int(kv.shape[1]),
            causal=causal, scale=scale, window=(left, right), softcap=softcap, stream=ctx.stream, sinks=sv,
            alibi=(av, alibi_sb),
        )
        if launch is not None:
            outputs = {**({} if out is not None else {"out": (out_shape, False)}),
                       **({"lse": (lse_shape, True)} if return_lse else {})}
            bound, workspace = _plan_fwd(launch, {"q": "q", "k": "k", "v": "v", "out": "out", "lse": "lse",
                                                  "sinks": "sinks", "alibi_slopes": "alibi_slopes"})
            _calls.remember(call_key, _calls.Plan(
                inputs=("q", "k", "v", "out", "sinks", "alibi_slopes"), outputs=outputs, aligned=("q", "k", "v", "out"),
                bound=bound, finish=_fwd_result(return_lse), **workspace))
        result = out if out is not None else ctx.to_caller(ov)
        return (result, ctx.to_caller(lse)) if return_lse else result


def _varlen_result(return_lse: bool):
    """How a varlen plan returns: the new (or given) out, and lse when asked for."""
    def finish(results, arrays):
        out = results["out"] if "out" in results else arrays[5]
        return (out, results["lse"]) if return_lse else out
    return finish


def _fwd_result(return_lse: bool):
    """How a plan returns: the new (or given) out, and lse when asked for."""
    def finish(results, arrays):
        out = results["out"] if "out" in results else arrays[3]
        return (out, results["lse"]) if return_lse else out
    return finish


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    causal=False, scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False,
    out=None,
):
    """Attention over a packed batch of sequences of different lengths, no padding.

    Sequence b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (``(total_q, Hq, D)``) and
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k (``(total_k, Hk, D)``) and v (``(total_k, Hk, Dv)``,
    Dv as in :func:`attention`); masks apply per
    sequence with its own lengths. ``cu_seqlens_*`` are int32 ``(B + 1,)`` prefix sums on the
    same device (their values are not read on the host, so nothing synchronises; lists of ints are
    copied there), and
    ``max_seqlen_*`` are host ints bounding every sequence's length: a length above them is
    not processed. Rows past ``cu_seqlens_*[-1]`` (a padded batch) are left unwritten in ``out``;
    the kernels may read them beside a sequence's last rows, with their scores masked, so they
    must hold finite values. ``sinks`` as in :func:`attention`; ``alibi_slopes`` too, ``(B, Hq)`` holding
    one row per sequence, with Sq and Sk each sequence's own lengths. Returns ``out`` ``(total_q, Hq, Dv)``, and
    with ``return_lse`` also float32 lse ``(Hq, total_q)`` (natural log).
    """
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse)
    call_key = None
    if isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int):
        result, call_key = _calls.run(
            "attention_varlen", (q, k, v, cu_seqlens_q, cu_seqlens_k, out, sinks, alibi_slopes),
            (bool(causal), scale, left, right, softcap, bool(return_lse), max_seqlen_q, max_seqlen_k))
        if result is not None:
            return result
    lists, ints = _arrays.int_lists(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    with _arrays.array_context(q=q, k=k, v=v, out=out, sinks=sinks, alibi_slopes=alibi_slopes, **ints) as ctx:
        qv, kv, vv, ov, sv, av = (ctx.view(x) for x in (q, k, v, out, sinks, alibi_slopes))
        cuq, cuk = (ctx.int_view(name, lists, ints) for name in ("cu_seqlens_q", "cu_seqlens_k"))
        if any(_arrays.is_e4m3(x) for x in (qv, kv, vv)):
            raise TypeError("attention_varlen takes float16 or bfloat16 q, k, v; FP8 (float8_e4m3fn) inputs run "
                            "through attention (dense (B, S, H, D) inputs, sm_90a, D = 128 or 256)")
        _check_qkv(qv, kv, vv, packed=True)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        if ov is not None:
            _check_out(ov, qv, vv)
        _check_varlen_args(cuq, cuk, max_seqlen_q, max_seqlen_k, qv, kv, ctx.on_host)
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[1]), ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, int(cuq.shape[0]) - 1, int(qv.shape[1]), ctx.on_host, qv)
        _masks.check_total_length(max_seqlen_q, max_seqlen_k, "max_seqlen_q + max_seqlen_k")
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k": kv, "v": vv, "out": ov})
            result = reference.attention_varlen(
                qv, kv, vv, cuq, cuk, max_seqlen_q, max_seqlen_k,
                causal=causal, scale=scale, window=(left, right), softcap=softcap, return_lse=True, sinks=sv,
                alibi_slopes=av,
            )
            return _host_result(result, qv, ov, return_lse)

        import cupy

        _check_device_arrays({"q": qv, "k": kv, "v": vv, **({"out": ov} if ov is not None else {})})
        total_q, num_heads, _ = map(int, qv.shape)
        out_shape = reference.out_shape(qv, vv)
        if ov is None:
            ov = ctx.empty(out_shape, qv.dtype)
        lse_shape = (num_heads, total_q)
        lse = ctx.empty(lse_shape, np.float32) if return_lse else None
        cuq_c, cuk_c = cupy.ascontiguousarray(cuq), cupy.ascontiguousarray(cuk)
        launch = _launch_fwd(
            qv[None], kv[None], vv[None], ov[None], lse[None] if lse is not None else None, cuq_c, cuk_c,
            batch=int(cuq.shape[0]) - 1, seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k),
            causal=causal, scale=scale, window=(left, right), softcap=softcap, stream=ctx.stream, sinks=sv,
            alibi=(av, alibi_sb),
        )
        # a plan reads the caller's cu_seqlens in place: only when no contiguous copy was needed
        if launch is not None and cuq_c is cuq and cuk_c is cuk:
            outputs = {**({} if out is not None else {"out": (out_shape, False)}),
                       **({"lse": (lse_shape, True)} if return_lse else {})}
            bound, workspace = _plan_fwd(launch, {
                "q": "q", "k": "k", "v": "v", "out": "out", "lse": "lse", "sinks": "sinks",
                "alibi_slopes": "alibi_slopes", "cu_seqlens_q": "cu_seqlens_q", "cu_seqlens_k": "cu_seqlens_k"})
            _calls.remember(call_key, _calls.Plan(
                inputs=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "out", "sinks", "alibi_slopes"),
                outputs=outputs, aligned=("q", "k", "v", "out"),
                bound=bound, finish=_varlen_result(return_lse), **workspace))
        result = out if out is not None else ctx.to_caller(ov)
        return (result, ctx.to_caller(lse)) if return_lse else result


# ---------------------------------------------------------------------------------------------
# FP8 forward: e4m3 q, k, v with descales, a 16-bit output


def fp8_block_rows() -> tuple[int, int]:
    """Rows per scale of block-quantised q and k: one consumer warpgroup's query rows (64) and one
    key block of the FP8 kernels (kFp8ScaleBlockKeys = 128)."""
    return _params.constant("kWgmmaM"), _params.constant("kFp8ScaleBlockKeys")


@dataclasses.dataclass(frozen=True)
class Fp8Scale:
    """A checked descale of e4m3 q, k or v: real value of row s, head h of sequence b =
    stored x factor x array[b * strides[0] + h * strides[1] + (s // block_rows) * strides[2]]
    (array None: factor alone). ``value`` is what the caller passed (the host reference reads it)."""

    factor: float = 1.0
    array: object = None
    strides: tuple = (0, 0, 0)
    value: object = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Args:
    """The FP8 launch's scales (FwdParams' q/k/v scale fields); the default is the 16-bit launch's."""

    q: Fp8Scale = Fp8Scale()
    k: Fp8Scale = Fp8Scale()
    v: Fp8Scale = Fp8Scale()

    def fields(self) -> dict:
        f = {"q_scale": self.q.array, "k_scale": self.k.array, "v_scale": self.v.array,
             "q_descale": self.q.factor, "k_descale": self.k.factor, "v_descale": self.v.factor,
             "v_scale_head_stride": self.v.strides[1]}
        for name, sc in (("q", self.q), ("k", self.k)):
            for axis, stride in zip(("batch", "head", "block"), sc.strides):
                f[f"{name}_scale_{axis}_stride"] = stride
        return f


def _check_fp8_dtypes(q, k, v, reason: str) -> None:
    """``reason``: what made the call an FP8 one (its FP8 options, or an e4m3 input), for the message."""
    others = [f"{name}.dtype is {_arrays.dtype_name(x.dtype)}" for name, x in (("q", q), ("k", k), ("v", v))
              if not _arrays.is_e4m3(x)]
    if others:
        raise TypeError(f"{reason}: FP8 attention takes q, k and v all in float8_e4m3fn (CuPy: its uint8 storage); "
                        + ", ".join(others))


def _check_fp8_scale(name: str, scale, x, x_name: str, block_rows: int, blocks: bool, host: bool) -> Fp8Scale:
    """``q_scale``, ``k_scale`` or ``v_scale`` of e4m3 ``x`` (B, S, H, D): a positive float, or a
    float32 array (on the host too) of shape (), (1,), (H,) or, with ``blocks``,
    (B, H, ceil(S / block_rows)), on x's device."""
    batch, seqlen, heads = int(x.shape[0]), int(x.shape[1]), int(x.shape[2])
    block_shape = (batch, heads, -(-seqlen // block_rows))
    shapes = "(), (1,), (H,) = " + f"({heads},)" + (f" or (B, H, ceil(S / {block_rows})) = {block_shape}"
                                                     if blocks else "")
    if scale is None:
        raise ValueError(f"{name} is required with float8_e4m3fn {x_name} (real value = stored x {name})")
    value = _arrays.scalar_scale(name, scale, shapes)
    if value is not None:
        return Fp8Scale(factor=value, value=value)
    shape = tuple(int(n) for n in scale.shape)
    if shape not in ((), (1,), (heads,)) and not (blocks and shape == block_shape):
        raise ValueError(f"{name}.shape must be {shapes}, got {shape}")
    _arrays.check_float32(name, scale)
    if host:
        return Fp8Scale(value=np.asarray(scale))
    _arrays.check_same_device(name, scale, x_name, x)
    if len(shape) == 3:
        strides = tuple(s if n > 1 else 0 for s, n in zip(_arrays.element_strides(scale), shape))
    elif shape == (heads,) and heads > 1:
        strides = (0, _arrays.element_strides(scale)[0], 0)
    else:
        strides = (0, 0, 0)
    return Fp8Scale(array=scale, strides=strides, value=scale)


def _fp8_out_dtype(out_dtype) -> np.dtype:
    """out_dtype: None (bfloat16), a NumPy dtype or its name, or a torch dtype."""
    if out_dtype is None:
        return _arrays.BFLOAT16
    by_name = {"bfloat16": _arrays.BFLOAT16, "float16": _arrays.FLOAT16}
    name = str(out_dtype).removeprefix("torch.")
    try:
        dtype = by_name.get(name) or np.dtype(out_dtype)
    except TypeError:
        dtype = None
    if dtype not in _arrays.CUDA_TYPES:
        got = repr(out_dtype) if dtype is None else _arrays.dtype_name(dtype)
        raise TypeError(f"out_dtype must be float16 or bfloat16 (FP8 attention's output), got {got}")
    return dtype


def fp8_key_order(group: int = 16) -> np.ndarray:
    """The keys of one group of 16 in V^T's order: position 4 t + 2 h + e holds key 8 h + 2 t + e
    (pi of AttentionTile::to_e4m3_fragments, the order each lane's probabilities take in the 8-bit
    A fragment of the PV wgmma)."""
    t, h, e = np.meshgrid(np.arange(group // 4), np.arange(2), np.arange(2), indexing="ij")
    return (8 * h + 2 * t + e).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Fp8TransposeShape:
    """fp8_v_transpose_kernel's template arguments: key groups of kFp8KeyGroup keys a thread (its
    span, which Sk is padded to), head-dim bytes a thread (its chunk), chunks along a warp."""

    groups: int
    chunk_bytes: int
    lanes_d: int

    @property
    def span(self) -> int:
        return self.groups * _params.constant("kFp8KeyGroup")


def fp8_transpose_shape() -> Fp8TransposeShape:
    """The pass's shape the calls use (flash_fwd_sm90.cu's kFp8Transpose* constants)."""
    c = _params.constant
    return Fp8TransposeShape(c("kFp8TransposeGroups"), c("kFp8TransposeBytes"), c("kFp8TransposeLanesD"))


# CTAs of the V^T pass an SM at most. Its 80 registers a thread let three share an SM, and two
# stream faster (an H100, 32k tokens x 2048: 50.7 against 52.3 us at D = 128, 50.6 against 53.0
# at D = 256), so each CTA reserves shared memory it never touches.
FP8_TRANSPOSE_CTAS_PER_SM = 2


def fp8_transpose_smem_bytes() -> int:
    """The V^T pass's dynamic shared memory: an sm_90 SM's (the per-block maximum plus the driver's
    reserve per CTA) over FP8_TRANSPOSE_CTAS_PER_SM + 1, plus that reserve, so that one CTA more
    than the cap does not fit (78,848 bytes: the value timed on the H100)."""
    per_sm = _params.constant("kSm90MaxSmem") + _jit.RESERVED_SMEM_PER_CTA
    return per_sm // (FP8_TRANSPOSE_CTAS_PER_SM + 1) + _jit.RESERVED_SMEM_PER_CTA


@functools.lru_cache(maxsize=None)
def fp8_transpose_spec(shape: Fp8TransposeShape | None = None) -> _jit.KernelSpec:
    """fp8_v_transpose_kernel (flash_fwd_sm90.cu): V^T of fp8_v_transposed on the device."""
    shape = shape or fp8_transpose_shape()
    return _jit.KernelSpec("flash_fwd_sm90.cu",
                           f"cuattn::fp8_v_transpose_kernel<{shape.groups}, {shape.chunk_bytes}, {shape.lanes_d}>",
                           threads=_params.constant("kFp8TransposeThreads"), smem_bytes=fp8_transpose_smem_bytes(),
                           needs_sm90a=True)


def _fp8_v_transposed_on_device(v, stream, shape: Fp8TransposeShape | None = None):
    """fp8_v_transposed by fp8_v_transpose_kernel: one pass over V (read once, V^T written once)."""
    import cupy

    shape = shape or fp8_transpose_shape()
    b, sk, hk, d = map(int, v.shape)
    padded_len = -(-sk // shape.span) * shape.span
    v_t = cupy.empty((b, hk, d, padded_len), _arrays.E4M3_STORAGE)
    # a thread per (span of keys, chunk of head-dim bytes) of each (batch, kv head) pair, a warp
    # lanes_d chunks x the rest spans: whole warps of chunks, which the FP8 head dims
    # (FP8_HEAD_DIMS, checked before) give
    assert d % (shape.chunk_bytes * shape.lanes_d) == 0, f"head dim {d} is not whole warps of chunks"
    warp_spans = _params.constant("kWarpSize") // shape.lanes_d
    threads = -(-padded_len // (shape.span * warp_spans)) * warp_spans * (d // shape.chunk_bytes)
    if threads and b * hk:
        sb, ss, sh, _ = _arrays.element_strides(v)
        spec = fp8_transpose_spec(shape)
        params = _params.pack("Fp8TransposeParams", v=v, vt=v_t, v_batch_stride=sb, v_row_stride=ss,
                              v_head_stride=sh, batch=b, seqlen_k=sk, padded=padded_len, num_kv_heads=hk, head_dim=d)
        _jit.launch_params(spec, (-(-threads // spec.threads), *_split_grid(b * hk)), params, stream=stream)
    return v_t


def fp8_v_transposed(v, xp=np, span: int | None = None):
    """V^T for the FP8 kernel: e4m3 bytes ``v`` (B, Sk, Hk, D) -> (B, Hk, D, Sk_pad), Sk padded with
    zeros to a multiple of the pass's ``span`` (fp8_transpose_shape; the TMA needs 16 bytes), the
    keys of each group of 16 in the order of :func:`fp8_key_order`. One copy of V (B Sk Hk D bytes
    read and written): the 8-bit wgmma reads B K-major only, so O += P V needs the keys contiguous."""
    b, sk, hk, d = map(int, v.shape)
    group = _params.constant("kFp8KeyGroup")
    span = span or fp8_transpose_shape().span
    padded_len = -(-sk // span) * span
    if padded_len != sk:
        padded = xp.zeros((b, padded_len, hk, d), v.dtype)
        padded[:, :sk] = v
        v = padded
    # key 8 h + 2 t + e of group G as axes (G, h, t, e), reordered (G, t, h, e)
    keys = v.reshape(b, padded_len // group, 2, group // 4, 2, hk, d)
    return xp.ascontiguousarray(keys.transpose(0, 5, 6, 1, 3, 2, 4)).reshape(b, hk, d, padded_len)


def _attention_fp8(q, k, v, *, causal, scale, window, softcap, sinks, alibi_slopes, return_lse, out, q_scale,
                   k_scale, v_scale, out_dtype):
    """attention() with e4m3 q, k, v: checks, the float64 reference of the dequantised inputs on
    the host, flash_fwd_sm90_kernel with T = e4m3 on the device (not through the call plans)."""
    scales = {name: x for name, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))
              if _arrays.is_array(x)}
    with _arrays.array_context(q=q, k=k, v=v, out=out, sinks=sinks, alibi_slopes=alibi_slopes, **scales) as ctx:
        qv, kv, vv, ov, sv, av = (ctx.view(x) for x in (q, k, v, out, sinks, alibi_slopes))
        given = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}
        sc = {name: ctx.view(x) if name in scales else x for name, x in given.items()}
        _check_fp8_dtypes(qv, kv, vv, ", ".join(name for name, x in (*given.items(), ("out_dtype", out_dtype))
                                                 if x is not None) + " given")
        _check_qkv(qv, kv, vv, packed=False)
        if int(vv.shape[3]) != int(qv.shape[3]):
            raise ValueError(f"v.shape[3] (head_dim_v) must equal q.shape[3] (head_dim) = {int(qv.shape[3])} with FP8 "
                             f"inputs, got {int(vv.shape[3])}: the e4m3 kernel has no run-time head dims "
                             "(dequantise to bfloat16 for Dv != D)")
        dtype = _fp8_out_dtype(out_dtype)
        if ov is not None:
            if tuple(ov.shape) != tuple(qv.shape):
                raise ValueError(f"out.shape must equal q.shape = {tuple(qv.shape)}, got {tuple(ov.shape)}")
            if np.dtype(ov.dtype) != dtype:
                raise TypeError(f"out.dtype must equal out_dtype = {_arrays.dtype_name(dtype)}, got "
                                f"{_arrays.dtype_name(ov.dtype)}")
        q_rows, k_rows = fp8_block_rows()
        args = Fp8Args(
            q=_check_fp8_scale("q_scale", sc["q_scale"], qv, "q", q_rows, True, ctx.on_host),
            k=_check_fp8_scale("k_scale", sc["k_scale"], kv, "k", k_rows, True, ctx.on_host),
            v=_check_fp8_scale("v_scale", sc["v_scale"], vv, "v", k_rows, False, ctx.on_host))
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[2]), ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, int(qv.shape[0]), int(qv.shape[2]), ctx.on_host, qv)
        _masks.check_total_length(int(qv.shape[1]), int(kv.shape[1]), "q.shape[1] + k.shape[1] (Sq + Sk)")
        head_dim = int(qv.shape[3])
        # the host path takes the head dims the e4m3 kernel has, as every other check does
        if head_dim not in FWD_SM90_FP8_TILES:
            raise ValueError(f"q.shape[3] (head_dim) = {head_dim} is not supported with FP8 inputs; supported head "
                             f"dims: {', '.join(map(str, FP8_HEAD_DIMS))}")
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k": kv, "v": vv, "out": ov})
            real = [reference.dequantize_fp8(x, s.value, rows) for x, s, rows in
                    ((qv, args.q, q_rows), (kv, args.k, k_rows), (vv, args.v, k_rows))]
            result = reference.attention(*real, causal=causal, scale=scale, window=window, softcap=softcap,
                                         return_lse=True, sinks=sv, alibi_slopes=av)
            return _host_result(result, np.empty(0, dtype), ov, return_lse)

        arch = _jit.target_arch()
        if arch != SM90:
            raise NotImplementedError(
                f"FP8 attention (float8_e4m3fn q, k, v) runs on sm_90a only (e4m3 wgmma); this GPU is {arch}. "
                f"Supported: sm_90a, dense (B, S, H, D) inputs, head dims {', '.join(map(str, FP8_HEAD_DIMS))}, "
                "output float16 or bfloat16; elsewhere dequantise to bfloat16 and call attention without scales")
        _check_device_arrays({"q": qv, "k": kv, "v": vv, **({"out": ov} if ov is not None else {})})
        batch, seqlen_q, num_heads, _ = map(int, qv.shape)
        lse_shape = (batch, num_heads, seqlen_q)
        if ov is None:
            ov = ctx.empty(qv.shape, dtype)
        lse = ctx.empty(lse_shape, np.float32) if return_lse else None
        if int(kv.shape[1]) == 0 or qv.size == 0:
            # no key: out = 0 and lse = -inf (or the row's sink), as the 16-bit forward gives
            ov[...] = 0
            if lse is not None:
                lse[...] = -np.inf if sv is None else sv[None, :, None]
            result = out if out is not None else ctx.to_caller(ov)
            return (result, ctx.to_caller(lse)) if return_lse else result
        v_t = _fp8_v_transposed_on_device(vv, ctx.stream)  # CuPy holds e4m3 as uint8
        _launch_fwd(qv, kv, v_t, ov, lse, None, None, batch=batch, seqlen_q=seqlen_q, seqlen_k=int(kv.shape[1]),
                    causal=causal, scale=scale, window=window, softcap=softcap, stream=ctx.stream, sinks=sv,
                    alibi=(av, alibi_sb), fp8=args)
        result = out if out is not None else ctx.to_caller(ov)
        return (result, ctx.to_caller(lse)) if return_lse else result


# ---------------------------------------------------------------------------------------------
# Helpers


def check_prefix_sums(cuq, cuk) -> None:
    """cu_seqlens_q and cu_seqlens_k: int32 ``(B + 1,)`` with B + 1 >= 2 entries, the same B."""
    for name, cu in (("cu_seqlens_q", cuq), ("cu_seqlens_k", cuk)):
        _arrays.check_ndim(name, cu, "(B + 1)")
        _arrays.check_int32(name, cu)
        if int(cu.shape[0]) < 2:
            raise ValueError(f"{name}.shape[0] (B + 1) must be at least 2, got {cu.shape[0]}")
    _arrays.check_axis("cu_seqlens_k", cuk, 0, "B + 1", int(cuq.shape[0]), "cu_seqlens_q.shape[0]")


def _check_varlen_args(cuq, cuk, max_seqlen_q, max_seqlen_k, q, k, host: bool) -> None:
    """cu_seqlens (int32 prefix sums, B + 1 >= 2 entries, on q's device) and max_seqlen (ints >= 0);
    on the host also the prefix sums' values."""
    check_prefix_sums(cuq, cuk)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _arrays.check_int(name, value, 0)
    if host:
        _check_host_cu_seqlens(cuq, q.shape[0], max_seqlen_q, "q")
        _check_host_cu_seqlens(cuk, k.shape[0], max_seqlen_k, "k")
    else:
        _arrays.check_same_device("cu_seqlens_q", cuq, "q", q)
        _arrays.check_same_device("cu_seqlens_k", cuk, "q", q)


def _check_host_cu_seqlens(cu, total: int, max_seqlen: int, which: str) -> None:
    """On the host the prefix sums can be checked for free; on the device that would synchronise."""
    name = f"cu_seqlens_{which}"
    cu = np.asarray(cu)
    lengths = np.diff(cu)
    if cu[0] != 0 or np.any(lengths < 0):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal {which}.shape[0] (total_{which}) = {total}, got {int(cu[-1])}")
    if lengths.size and int(lengths.max()) > max_seqlen:
        raise ValueError(f"max_seqlen_{which} = {max_seqlen} is below the longest sequence, {int(lengths.max())}")


def _host_result(result, q, out, return_lse):
    """Cast the float64 reference to q's dtype (and into ``out`` when given)."""
    out_f64, lse_f64 = result
    if out is not None:
        out[...] = out_f64.astype(out.dtype)
        value = out
    else:
        value = out_f64.astype(q.dtype)
    return (value, lse_f64.astype(np.float32)) if return_lse else value


@dataclasses.dataclass(frozen=True)
class PagedKeys:
    """Keys and values of a paged cache for flash_fwd_kernel's PAGED variant (FwdParams' paged
    fields): k and v passed to :func:`_launch_fwd` are the pages [num_blocks, block_size, Hk, D];
    launch entry e is sequence ``batch_index[e]`` (int32 device arrays ``block_table`` [B_all,
    max_blocks], ``seq_lens`` [B_all], ``batch_index`` [batch]); lengths are clamped to the table's
    capacity and page ids to the pool on the device."""

    block_table: object
    seq_lens: object
    batch_index: object
    block_size: int
    num_blocks: int

    def capacity(self) -> int:
        return int(self.block_table.shape[1]) * self.block_size


def _launch_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, batch, seqlen_q, seqlen_k,
                causal, scale, window, softcap, stream, tile=None, sinks=None, alibi=(None, 0), paged=None, fp8=None,
                schedule=None, execute=True, kv_scales=None):
    """Launch the forward on 4-D views q, k [B, S, H, D], v, out [B, S, H, Dv] and lse [B, H, S] (or
    None): flash_fwd_sm90_kernel where the GPU, head dims (a tile of FWD_SM90_TILES holds them) and
    strides allow, else flash_fwd_kernel. Dv is read from out (v is V^T with ``fp8``, and Dv = D there).
    ``tile`` forces a kernel (a FwdTile or FwdSm90Tile: tests, tuning). ``alibi``: the slopes
    ([B, Hq] | [Hq], or None) and their batch stride in elements (0 for [Hq]). ``paged``: a
    :class:`PagedKeys` (flash_fwd_kernel's PAGED variant; q, out and lse packed as in varlen with
    ``cu_seqlens_q``, ``cu_seqlens_k`` None, ``seqlen_k`` the table's capacity). ``fp8``: e4m3 q,
    k and ``v`` already V^T (``_fp8_v_transposed``), with their checked scales (:class:`Fp8Args`).
    ``kv_scales``: with ``paged``, pages of e4m3 bytes and their checked descales (a
    ``(k, v)`` pair of ``_arrays.KvScale``), which only flash_fwd_sm90_kernel's KV_E4M3 variant
    reads (:func:`paged_e4m3_prefill`; its producer copies and widens the rows).
    ``schedule``: flash_fwd_sm90_kernel's tile schedule, FWD_SM90_SCHEDULE when None ("static"
    for launches that may be recorded by stream capture: the dynamic one's per-stream counters
    are allocated on a stream's first launch). ``execute=False`` only prepares the launch (a plan
    that runs it later, over addresses of its own).

    Returns the prepared launch (the plan of later identical calls), or None when there was
    nothing to compute."""
    head_dim, head_dim_v = int(q.shape[3]), int(out.shape[3])
    if fp8 is None and int(v.shape[3]) != head_dim_v:
        raise ValueError(f"v.shape[3] (head_dim_v) must equal out.shape[3] = {head_dim_v}, got {int(v.shape[3])}")
    num_heads, num_kv_heads = int(q.shape[2]), int(k.shape[2])
    _masks.check_total_length(seqlen_q, seqlen_k)
    if seqlen_q == 0 or batch == 0 or num_heads == 0:
        return None
    arch = _jit.target_arch()
    banded = causal or window != (-1, -1)  # a causal or window mask: tiles differ in cost
    maps = ()
    sm90_dims = None  # the Hopper tile's (D, Dv)
    copy_pages = False  # paged keys the Hopper kernel copies row by row
    if fp8 is not None:
        tile = tile or FWD_SM90_FP8_TILES[head_dim]
        maps = _fwd_maps(q, k, v, tile, fp8=True)
        if not maps:
            raise ValueError("FP8 attention reads q and k through the TMA: every stride but the last must be a "
                             f"multiple of 16 bytes, got q.strides {q.strides}, k.strides {k.strides}")
    elif tile is None or isinstance(tile, FwdSm90Tile):
        # the smallest Hopper tile holding D and Dv (padded columns read as zeros)
        sm90_dims = fwd_sm90_tile_dims(head_dim, head_dim_v) if arch == SM90 else None
        sm90_tile = None if sm90_dims is None else tile or fwd_sm90_tile(sm90_dims, paged is not None, seqlen_k, banded,
                                                                          kv_e4m3=kv_scales is not None)
        # paged keys: rows copied by the producer warpgroup, or boxes of one page (or BLOCK_N rows
        # of a longer one)
        copy_pages = paged is not None and sm90_tile is not None and (
            kv_scales is not None or paged_keys_by_copy(paged.block_size, sm90_tile.block_n))
        page_rows = None if paged is None or sm90_tile is None or copy_pages else paged_box_rows(
            paged.block_size, sm90_tile.block_n)
        if sm90_tile is not None:
            maps = _fwd_maps(q, k, v, sm90_tile, page_rows=page_rows, copy_pages=copy_pages)
        if maps:
            tile = sm90_tile
        elif tile is not None:
            raise ValueError(f"flash_fwd_sm90_kernel cannot run this call (arch {arch}, head_dim {head_dim}, "
                             f"head_dim_v {head_dim_v}, strides {q.strides}, {k.strides}, {v.strides}"
                             + (f", block_size {paged.block_size}" if paged is not None else "") + ")")
    if kv_scales is not None and not isinstance(tile, FwdSm90Tile):
        raise ValueError(f"e4m3 pages take flash_fwd_sm90_kernel alone (arch {arch}, head_dim {head_dim}, head_dim_v "
                         f"{head_dim_v}, q.strides {q.strides}): paged_e4m3_prefill says where")
    if tile is None:
        tile = fwd_tile(head_dim, arch, alibi[0] is not None, head_dim_v)
    if fp8 is not None:
        spec = fwd_sm90_spec(_arrays.FLOAT8_E4M3, head_dim, head_dim, tile, np.dtype(out.dtype),
                             alibi=alibi[0] is not None)
    elif isinstance(tile, FwdSm90Tile):
        spec = fwd_sm90_spec(np.dtype(q.dtype), *sm90_dims, tile, alibi=alibi[0] is not None, paged=paged is not None,
                             kv_e4m3=kv_scales is not None)
    else:
        spec = fwd_spec(np.dtype(q.dtype), fwd_tile_dim(head_dim, head_dim_v), tile, alibi[0] is not None,
                        paged is not None)
    _jit.logger.debug("attention forward: %s", spec.name)
    if paged is not None and isinstance(tile, FwdSm90Tile):
        _jit.logger.debug("paged keys: %s", "row copies" if copy_pages else f"TMA boxes of {page_rows} rows")
    score_scale, softcap_out = _masks.score_scalars(scale, softcap, head_dim)
    left, right = _masks.window_bounds(causal, window, seqlen_q + seqlen_k + tile.block_m)

    qs, ks, vs, os_ = (list(_arrays.element_strides(x)) for x in (q, k, v, out))
    if fp8 is not None:
        vs = [0, 0, 0, 0]  # V^T is read through its tensor map only
    lse_strides = [lse.strides[0] // 4, lse.strides[1] // 4] if lse is not None else [0, 0]
    if cu_seqlens_q is not None:
        # packed rows: a sequence starts at its cu_seqlens offset, not at b * batch_stride
        # (paged keys keep axis 0 of k and v: the page stride)
        for strides in (qs, os_, lse_strides) if paged is not None else (qs, ks, vs, os_, lse_strides):
            strides[0] = 0
    bh = batch * num_heads
    m_blocks = (seqlen_q + tile.block_m - 1) // tile.block_m
    counter, section, order_capacity, order_entries, workspace_bytes = None, 0, 0, 0, 0
    if isinstance(tile, FwdSm90Tile):
        # One CTA per SM walks the tiles (shared memory allows one per SM), its loads running
        # under the previous tile's epilogue. Dynamic: the CTAs take tiles from a counter, heavy
        # first. Static: fixed strides; or one CTA per tile (the hardware hands out tiles as SMs
        # free up) for long banded masks, where the tiles' costs differ so much that fixed strides
        # spread the CTAs over many heads' K and V (BENCHMARKS.md: 488 vs 602 TFLOP/s).
        tiles = m_blocks * bh
        schedule = FWD_SM90_SCHEDULE if schedule is None else schedule
        if schedule not in FWD_SM90_SCHEDULES:
            raise ValueError(f"FWD_SM90_SCHEDULE must be one of {FWD_SM90_SCHEDULES}, got {schedule!r}")
        if schedule == "auto":
            schedule = "dynamic" if banded or cu_seqlens_q is not None or seqlen_q % tile.block_m else "static"
        dynamic = schedule == "dynamic"
        persistent = dynamic or not banded or seqlen_k <= FWD_SM90_PERSISTENT_BANDED_KEYS
        grid = (min(tiles, _jit.multiprocessor_count()) if persistent else tiles, 1, 1)
        if dynamic:
            section = l2_section_heads(batch, num_heads, num_kv_heads, seqlen_k, head_dim, 1 if fp8 is not None
                                       else np.dtype(q.dtype).itemsize, banded)
            # packed sequences take their tiles from a tile order (tile_order.cu) where the grid
            # is full: only tiles that hold rows, the longest sequences first; a section then
            # spans heads of one sequence
            # (paged prefill too: seqlen_k is then the block table's capacity, which bounds its keys;
            # one sequence has nothing to reorder and no empty tiles)
            if (FWD_SM90_TILE_ORDER and cu_seqlens_q is not None and batch > 1 and tiles > grid[0]
                    and seqlen_k >= FWD_SM90_TILE_ORDER_MIN_KEYS):
                order_capacity = tile_order_capacity(batch, num_heads, int(q.shape[1]), tile.block_m, m_blocks)
                order_entries = tile_order_entries(order_capacity, grid[0])
                section = min(section, num_heads)
            workspace_bytes = tile_order_bytes(order_entries) if order_capacity else TILE_COUNTER_BYTES
            counter = schedule_workspace_address(workspace_bytes, _jit.stream_ptr(stream), _jit.current_device())
    else:
        grid = (m_blocks, *_split_grid(bh))
    # the Hopper kernel stores O through the TMA where out's strides allow (it does so where O has
    # a tile of its own, and with packed rows only for the warpgroups wholly inside a sequence)
    o_map = _out_map(out) if isinstance(tile, FwdSm90Tile) else None
    if o_map is not None:
        maps = (*maps, o_map)
    no_map = np.zeros(_tma.MAP_WORDS, np.uint64)  # filled by the launch from the pointers
    params = _params.pack(
        "FwdParams", q_map=no_map, k_map=no_map, v_map=no_map, v_row_map=no_map, o_map=no_map,
        o_by_tma=int(o_map is not None),
        q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks,
        **(fp8 or _kv_e4m3_args(kv_scales)).fields(),
        alibi_slopes=alibi[0], alibi_batch_stride=alibi[1],
        q_batch_stride=qs[0], q_row_stride=qs[1], q_head_stride=qs[2],
        k_batch_stride=ks[0], k_row_stride=ks[1], k_head_stride=ks[2],
        v_batch_stride=vs[0], v_row_stride=vs[1], v_head_stride=vs[2],
        o_batch_stride=os_[0], o_row_stride=os_[1], o_head_stride=os_[2],
        lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1],
        batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        score_scale=score_scale, softcap_out=softcap_out, window_left=left, window_right=right, head_dim=head_dim,
        head_dim_v=head_dim_v, **_paged_fields(paged, copy_pages),
        # a tile order lists static indices, which sections of one pair read as such
        tile_counter=counter, tile_section=1 if order_capacity else section, tile_order=int(order_capacity > 0),
    )
    launch = _jit.prepare(spec, grid, params, maps=maps)
    if order_capacity:
        order_params = _params.pack(
            "TileOrderParams", cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            seq_lens=None if paged is None else paged.seq_lens,
            batch_index=None if paged is None else paged.batch_index,
            max_keys=0 if paged is None else seqlen_k, workspace=counter, batch=batch, num_heads=num_heads,
            m_blocks=m_blocks, block_m=tile.block_m, section=section, capacity=order_capacity, entries=order_entries)
        launch = OrderedFwd(_jit.prepare(tile_order_spec(), (1, 1, 1), order_params), launch, workspace_bytes)
    if execute:
        launch.run(_jit.stream_ptr(stream))
    return launch


def _kv_e4m3_args(kv_scales) -> Fp8Args:
    """FwdParams' scale fields for e4m3 pages' ``(k, v)`` KvScale pair (per tensor: a factor; per
    kv head: an (Hk,) array at its stride), or the 16-bit launch's (None)."""
    if kv_scales is None:
        return Fp8Args()
    k, v = (Fp8Scale(factor=sc.factor, array=sc.array, strides=(0, sc.stride, 0)) for sc in kv_scales)
    return Fp8Args(k=k, v=v)


def paged_e4m3_prefill(q, head_dim: int, head_dim_v: int, alibi: bool) -> bool:
    """Whether paged_attention_varlen's long query runs over e4m3 pages can take
    flash_fwd_sm90_kernel's KV_E4M3 variant (sm_90a, a Hopper tile holding D and Dv, no ALiBi, q
    ``(total_q, Hq, D)`` readable by the TMA); else they run as decode rows."""
    if alibi or _jit.target_arch() != SM90:
        return False
    dims = fwd_sm90_tile_dims(head_dim, head_dim_v)
    if dims is None:
        return False
    return _row_map("q_map", "q", q[None], fwd_sm90_tile(dims, kv_e4m3=True).block_m) is not None


def _paged_fields(paged: PagedKeys | None, copy_pages: bool = False) -> dict:
    """FwdParams' paged fields: zero for dense and varlen launches. ``copy_pages``: the Hopper
    kernel's producer copies the key rows (:func:`paged_keys_by_copy`)."""
    if paged is None:
        return dict(block_table=None, seq_lens=None, batch_index=None, table_stride=0, block_size=0,
                    block_size_mul=np.uint32(0), block_size_shift=0, num_blocks=0, pages_by_copy=0)
    mul, shift = fast_divisor(paged.block_size)
    return dict(block_table=paged.block_table, seq_lens=paged.seq_lens, batch_index=paged.batch_index,
                table_stride=_arrays.element_strides(paged.block_table)[0], block_size=paged.block_size,
                block_size_mul=mul, block_size_shift=shift, num_blocks=paged.num_blocks,
                pages_by_copy=int(copy_pages))


# Paged keys in flash_fwd_sm90_kernel come in TMA boxes of a page (or of a key block), one box per
# page and 128-byte panel, where the block size allows (paged_box_rows); other block sizes are
# copied row by row by the producer warpgroup (cp.async, 16 bytes a thread). Pages of at most this
# many tokens would be copied too: 0, since the copies ran slower than boxes at every block size
# measured (`scripts/tune_paged_prefill.py` on the H200, D = 128: 345-357 TFLOP/s, 0.58-0.62x the
# dense forward, against 0.79-0.81x for 2 KB boxes at 16-token pages and 0.94-1.0x at 32 and 64),
# and 1.5x flash_fwd_kernel's PAGED variant, which took those block sizes before.
FWD_SM90_COPY_MAX_BLOCK_SIZE = 0


def paged_keys_by_copy(block_size: int, block_n: int) -> bool:
    """Whether flash_fwd_sm90_kernel's producer copies paged keys row by row rather than in TMA
    boxes: pages of at most FWD_SM90_COPY_MAX_BLOCK_SIZE tokens, and pages no box takes
    (:func:`paged_box_rows`)."""
    return block_size <= FWD_SM90_COPY_MAX_BLOCK_SIZE or paged_box_rows(block_size, block_n) is None


def paged_box_rows(block_size: int, block_n: int) -> int | None:
    """Rows of one TMA box of paged keys in flash_fwd_sm90_kernel (load_chunk): a whole page, or
    BLOCK_N rows of a page that holds whole key blocks; None (the paged call runs flash_fwd_kernel)
    where neither divides the other or a page is shorter than a swizzle atom (each box must start
    a whole atom of the shared tile)."""
    atom_rows = _params.constant("kSwizzleAtomBytes") // _params.constant("kSwizzleRowBytes")
    rows = min(block_size, block_n)
    if rows % atom_rows or max(block_size, block_n) % rows:
        return None
    return rows


def _fwd_maps(q, k, v, tile: FwdSm90Tile, fp8: bool = False, page_rows: int | None = None,
              copy_pages: bool = False):
    """The TMA views of q, k, v [B, S, H, D] for flash_fwd_sm90_kernel: 4-D (D, S, H, B), boxes of
    [BLOCK rows, one 128-byte row of columns] (64 16-bit or 128 e4m3 elements); () when one of
    them cannot be read that way (a byte stride that is not a multiple of 16, an empty axis).
    ``fp8``: v is V^T [B, Hk, D, Sk_pad], read as (Sk_pad, D, Hk, B) in boxes of [D rows, 128 keys].
    ``page_rows``: k and v are pages [num_blocks, block_size, Hk, D], read in boxes of that many
    rows (:func:`paged_box_rows`), and v_row_map reads v in boxes of one row. ``copy_pages``: k and
    v are pages the kernel copies row by row (16-byte pieces, which the callers' layout checks
    allow): q's map alone."""
    views = [("q", q, tile.block_m)]
    if not copy_pages:
        views += [("k", k, page_rows or tile.block_n), ("v", v, page_rows or tile.block_n)]
    if page_rows is not None:
        views.append(("v_row", v, 1))
    maps = []
    for field, x, rows in views:
        role = "v" if field == "v_row" else field
        if fp8 and field == "v":
            b, h, d, s = map(int, x.shape)
            sb, sh, sd, ss = _arrays.element_strides(x)
            panel = _params.constant("kSwizzleRowBytes") // x.dtype.itemsize
            layout = _tma.MapLayout.of(x.dtype, (s, d, h, b), (ss, sd, sh, sb), (panel, d, 1, 1))
            entry = None if layout is None else (f"{field}_map", role, layout)
        else:
            entry = _row_map(f"{field}_map", role, x, rows)
        if entry is None:
            return ()
        maps.append(entry)
    return tuple(maps)


def _row_map(field: str, role: str, x, rows: int):
    """A launch's tensor map entry ``(field, role, layout)`` viewing x [B, S, H, D] as 4-D
    (D, S, H, B) in boxes of [rows, one 128-byte panel]; None when the TMA cannot take that view
    (a byte stride that is not a multiple of 16, an empty axis)."""
    b, s, h, d = map(int, x.shape)
    sb, ss, sh, sd = _arrays.element_strides(x)
    box = (_params.constant("kSwizzleRowBytes") // x.dtype.itemsize, rows, 1, 1)
    layout = _tma.MapLayout.of(x.dtype, (d, s, h, b), (sd, ss, sh, sb), box)
    return None if layout is None else (field, role, layout)


def _out_map(out):
    """flash_fwd_sm90_kernel's TMA view of out [B, Sq, Hq, Dv] (packed rows: B = 1) for its
    epilogue's stores, in boxes of one consumer's rows (the launch's "o_map" entry); None when the
    TMA cannot write it."""
    return _row_map("o_map", "out", out, _params.constant("kWgmmaM"))


# grid.y and grid.z are limited to 65535 each; B * H beyond that folds into grid.z.
GRID_YZ_LIMIT = 65535


def _split_grid(count: int) -> tuple[int, int]:
    y = min(count, GRID_YZ_LIMIT)
    return y, (count + y - 1) // y


# ---------------------------------------------------------------------------------------------
# Backward


# How flash_bwd_sm90_kernel's dQ reaches global memory (BwdTile.dq_mode)
BWD_DQ_MODES = ("bulk", "atomic")


@dataclasses.dataclass(frozen=True)
class BwdTile:
    """Tiles of the backward kernels for one head dim.

    flash_bwd_kernel: BLOCK_N keys per CTA, BLOCK_M queries per step, `warps` warps laid out
    `s_warps_n` along the keys of S^T (the rest along queries), `kv_warps_n` along the keys of
    dK/dV (the rest along D), `dq_warps_m` along the queries of dQ (the rest along D); Q and dO in
    `stages` shared buffers; `min_blocks` CTAs per SM for the register allocator.
    flash_bwd_dq_kernel (deterministic dQ): `dq_block_m` queries per CTA, `dq_block_n` keys per
    step, `dq_warps` warps of 16 query rows each.
    `wgmma`: the main kernel is flash_bwd_sm90_kernel instead (sm_90a; a TMA producer warpgroup and
    two wgmma consumer warpgroups, BLOCK_N = 128, or 64 for a wide tile (bwd_sm90_block_n), two
    Q/dO stages; only block_m and block_n count, the warp layout fields do not apply; views the TMA
    cannot read run the sm_80 row's mma.sync kernels).
    `dq_mode` (wgmma only): "bulk" sends each step's dQ tile to a tile accumulator with one bulk
    reduction, in an order per-tile semaphores fix where bwd_ordered says (deterministic=True);
    "atomic" is the earlier design, float4 atomics and, for
    deterministic=True, flash_bwd_dq_kernel (kept selectable to compare and to fall back).
    """

    block_m: int
    block_n: int
    warps: int
    s_warps_n: int
    kv_warps_n: int
    dq_warps_m: int
    stages: int
    min_blocks: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    wgmma: bool = False
    dq_mode: str = "bulk"

    def __post_init__(self):
        if self.dq_mode not in BWD_DQ_MODES:
            raise ValueError(f"dq_mode must be one of {BWD_DQ_MODES}, got {self.dq_mode!r}")

    @property
    def bulk_dq(self) -> bool:
        """Whether the main kernel is flash_bwd_sm90_kernel with bulk-reduced dQ."""
        return self.wgmma and self.dq_mode == "bulk"

    def smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """K, V [BLOCK_N, D + 8]; Q, dO [stages, BLOCK_M, D + 8]; P^T, dS^T [BLOCK_N, BLOCK_M + 8];
        lse, delta [stages, BLOCK_M] fp32. wgmma (BwdSm90Smem): unpadded swizzled K, V, two Q/dO
        stages, two dS^T buffers, lse and delta, the bulk dQ staging parts (bulk_dq), the
        mbarriers, and the alignment slack."""
        if self.wgmma:
            # BLOCK_N keys (flash_bwd.cu's bwd_sm90_block_n), kBwdSm90Stages Q/dO stages, kBwdSm90DsBuffers dS^T
            # buffers and kBwdSm90Barriers mbarriers; rows padded to whole swizzle panels; the
            # bulk dQ staging parts are BLOCK_M x bwd_dq_cols(self, D) each, kBwdSm90DqStages a
            # consumer where they fit in kSm90MaxSmem, else one; swizzled tiles start on
            # kSwizzleAtomBytes boundaries, so that much slack rounds the base up
            c = _params.constant
            block_n, stages = self.block_n, c("kBwdSm90Stages")
            consumers, panel = c("kBwdSm90Consumers"), c("kSwizzlePanelCols")
            tiles = (2 * block_n + 2 * stages * self.block_m) * (-(-head_dim // panel) * panel) * itemsize
            # (a wide tile keeps P^T beside each dS^T buffer)
            ds_tiles = 2 if bwd_wide(self, head_dim) else 1
            ds = ds_tiles * c("kBwdSm90DsBuffers") * block_n * self.block_m * itemsize
            stats = 2 * stages * self.block_m * 4
            overhead = c("kBwdSm90Barriers") * c("kMbarrierBytes") + c("kSwizzleAtomBytes")
            fixed = tiles + ds + stats + overhead
            if not self.bulk_dq:
                return fixed
            part = self.block_m * bwd_dq_cols(self, head_dim) * 4
            dq_stages = c("kBwdSm90DqStages")
            if fixed + consumers * dq_stages * part > c("kSm90MaxSmem"):
                dq_stages = 1
            return fixed + consumers * dq_stages * part
        pad = _params.constant("kPadElems")
        tiles = (2 * self.block_n + 2 * self.stages * self.block_m) * (head_dim + pad) * itemsize
        return tiles + 2 * self.block_n * (self.block_m + pad) * itemsize + 2 * self.stages * self.block_m * 4

    def dq_smem_bytes(self, head_dim: int, itemsize: int) -> int:
        """Q, dO [BLOCK_M, D + 8]; K, V [2, BLOCK_N, D + 8]."""
        return (2 * self.dq_block_m + 4 * self.dq_block_n) * (head_dim + _params.constant("kPadElems")) * itemsize


def bwd_wide(tile: "BwdTile", tile_dim: int) -> bool:
    """Whether ``tile`` at ``tile_dim`` is flash_bwd_sm90_kernel's wide tile (flash_bwd.cu's
    bwd_sm90_wide: D above kBwdSm90MaxKvCols, 64 keys a CTA, dK, dV and dQ split by columns)."""
    return tile.wgmma and tile_dim > _params.constant("kBwdSm90MaxKvCols")


def bwd_dq_modes(tile: "BwdTile", tile_dim: int) -> tuple[str, ...]:
    """The dq_modes a backward tile has: an mma.sync tile its own; flash_bwd_sm90_kernel both,
    but in a wide tile float4 atomics alone: its dQ tiles do not fit in shared memory beside K,
    V and the Q/dO stages."""
    if not tile.wgmma:
        return (tile.dq_mode,)
    return ("atomic",) if bwd_wide(tile, tile_dim) else BWD_DQ_MODES


def bwd_dq_head_dim(head_dim: int, arch: str) -> int:
    """The tile head dim of the deterministic dQ kernel (flash_bwd_dq_kernel) for a backward of
    head dims up to ``head_dim`` on ``arch``: the main kernel's, but under a wide wgmma tile the
    mma.sync kernels' own (D = 160 keeps its 160 tile there, not the wide one's 256)."""
    tile_dim = bwd_tile_dim(head_dim, arch)
    wide = bwd_wide(BWD_TILES[tile_dim][arch_family(arch)], tile_dim)
    return bwd_tile_dim(head_dim, SM80) if wide else tile_dim


def bwd_dq_cols(tile: "BwdTile", tile_dim: int) -> int:
    """Columns of the dQ tile one consumer of flash_bwd_sm90_kernel computes (flash_bwd.cu's
    bwd_sm90_dq_cols): all of D (D = 64-128, whose consumers take the steps in turn), or half of it
    in a wide tile (bwd_wide)."""
    return tile_dim // _params.constant("kBwdSm90Consumers") if bwd_wide(tile, tile_dim) else tile_dim


# One row per tile head dim, one entry per arch family that has it (a head dim runs its family's
# smallest tile at least it, given at run time, as the forward's FWD_TILES). Hopper runs the tiles
# D = 64, 80, 96, 128 and 256 on the wgmma kernel (flash_bwd_sm90_kernel: 64 queries x 128 keys,
# a TMA producer and two wgmma consumer warpgroups; the wide 256 tile 64 keys, each consumer half
# the queries of S^T and half of D of dK, dV and dQ, float4 atomics for dQ; BENCHMARKS.md,
# "Eleventh session" and "Twelfth session"), every head dim and Dv above 32 among them (padded
# ones read zeros past their own D); its 80 tile's deterministic dQ kernel (the atomic path's,
# kept for comparison) takes 16-key steps, which do not spill there. The mma.sync rows: warp
# tiles of 32 x 32 where the tile allows (each shared-memory fragment feeds several mma); dK and
# dV of BLOCK_N keys x D live in registers across the 8 warps, which is what bounds BLOCK_N (64
# at D = 256); sm_80's 163 KB of shared memory per CTA holds one Q/dO stage at D = 128.
# scripts/tune_bwd.py measured the candidates (BENCHMARKS.md).
# D = 160 (not measured yet) takes D = 256's layout with dK/dV split 4 ways along the keys (80
# columns a warp: a 2-way split would leave 40, not whole n16 steps) and two Q/dO stages, which
# its smaller rows leave room for; D = 80 runs padded in the 96 tile (no 8-warp layout splits
# 80 columns into whole n16 steps with dQ's rows in m16 tiles).
# `python -m cuattn build` checks the spills and the fit.
_BWD_D32 = BwdTile(64, 128, 8, 4, 4, 4, 2, 1, 64, 32, 4)
_BWD_D96 = BwdTile(64, 128, 8, 4, 4, 4, 2, 1, 64, 32, 4)
_BWD_D160 = BwdTile(64, 64, 8, 2, 4, 4, 2, 1, 64, 32, 4)
_BWD_D256 = BwdTile(64, 64, 8, 2, 2, 4, 1, 1, 64, 32, 4)
BWD_TILES = {
    32: {SM80: _BWD_D32, SM90: _BWD_D32},
    64: {SM80: BwdTile(64, 128, 8, 4, 4, 2, 2, 1, 64, 32, 4),
         SM90: BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True)},
    80: {SM90: BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 16, 4, wgmma=True)},
    96: {SM80: _BWD_D96, SM90: BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True)},
    128: {SM80: BwdTile(64, 128, 8, 4, 4, 2, 1, 1, 128, 32, 8),
          SM90: BwdTile(64, 128, 8, 0, 0, 0, 2, 1, 128, 32, 8, wgmma=True)},
    160: {SM80: _BWD_D160},
    256: {SM80: _BWD_D256, SM90: BwdTile(64, 64, 8, 0, 0, 0, 2, 1, 64, 32, 4, wgmma=True, dq_mode="atomic")},
}


# Tile head dims whose bulk dQ variants spill with ALiBi's bias on sm_90a: at D = 96 the consumers
# sit at their 240 registers, and the staging and semaphore code add 8-20 bytes of spill
# (`python -m cuattn build`; D = 128's build clean since its dQ GEMM waits for the dV and dK
# GEMMs, kDqAfterKv in flash_bwd.cu). There ALiBi keeps the atomic dQ, and deterministic ALiBi the
# earlier path (BwdTile.dq_mode "atomic": no dQ in the main kernel, then flash_bwd_dq_kernel).
BWD_ORDERED_ALIBI_FALLBACK = (96,)


def bwd_ordered(tile: "BwdTile", deterministic: bool) -> bool:
    """Whether the backward's main kernel reduces dQ in a fixed order (kBwdDqOrdered): a bulk tile
    of a deterministic call. On the H200 (BENCHMARKS.md, "Eleventh session") the bulk reductions
    ran 1.02-1.24x the float4 atomics at D = 64 and 1.16-1.33x at D = 128; ordered, they cost
    D = 64 0-11%, and D = 128 (since its consumers take the steps' dQ in turn, one staging part
    each) up to 7% (N = 1k and 4k without a mask; "Thirty-first session"), so calls order them only
    for deterministic=True."""
    return tile.bulk_dq and deterministic


def bwd_tile_dim(head_dim: int, arch: str) -> int:
    """The tile head dim the backward kernels are instantiated with for ``head_dim`` on ``arch``
    (the smallest of its family's rows of BWD_TILES holding it)."""
    family = arch_family(arch)
    return _arrays.tile_head_dim(head_dim, [d for d, row in BWD_TILES.items() if family in row])


def bwd_tile(head_dim: int, arch: str, deterministic: bool = False, alibi: bool = False,
             head_dim_v: int | None = None) -> BwdTile:
    """The backward's tiles for ``head_dim`` (any supported one) on ``arch``; ``alibi`` picks the
    dQ path. A "bulk" tile (flash_bwd_sm90_kernel's bulk dQ reductions, ordered as bwd_ordered
    says) stays one except where ALiBi's bulk variants would spill (BWD_ORDERED_ALIBI_FALLBACK),
    which take the atomic path (and flash_bwd_dq_kernel for deterministic=True). The tile is that
    of the larger of ``head_dim`` and a v head dim ``head_dim_v`` of its own; the kernels read
    zeros past each array's own head dim and store only its columns. ``deterministic`` does not
    change the tile (bwd_ordered and bwd_specs read it)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tile_dim = bwd_tile_dim(max(head_dim, head_dim_v), arch)
    tile = BWD_TILES[tile_dim][arch_family(arch)]
    if tile.bulk_dq and alibi and tile_dim in BWD_ORDERED_ALIBI_FALLBACK:
        return dataclasses.replace(tile, dq_mode="atomic")
    return tile



@functools.lru_cache(maxsize=None)
def bwd_specs(dtype, head_dim: int, tile: BwdTile, deterministic: bool = False,
              alibi: bool = False, dq_head_dim: int | None = None) -> tuple[_jit.KernelSpec, ...]:
    """(preprocess, main, convert or deterministic dQ) kernels of the backward at tile head dim
    ``head_dim``; ``alibi``: the main and dQ kernels' variants that fold ALiBi's bias into lse
    (their ALIBI flag); ``dq_head_dim``: the tile head dim of the deterministic dQ kernel
    (flash_bwd_dq_kernel) where it differs (bwd_dq_head_dim)."""
    ctype = _arrays.CUDA_TYPES[np.dtype(dtype)]
    t = tile
    itemsize = np.dtype(dtype).itemsize
    atomic, with_alibi = _cpp_bool(not deterministic), _cpp_bool(alibi)
    if t.wgmma:
        # flash_bwd.cu's DQ_MODE constants
        if t.bulk_dq:
            mode = _params.constant("kBwdDqOrdered" if bwd_ordered(t, deterministic) else "kBwdDqBulk")
        else:
            mode = _params.constant("kBwdDqNone" if deterministic else "kBwdDqAtomic")
        main_name = f"cuattn::flash_bwd_sm90_kernel<{ctype}, {head_dim}, {t.block_m}, {mode}, {with_alibi}>"
    else:
        main_name = (f"cuattn::flash_bwd_kernel<{ctype}, {head_dim}, {t.block_m}, {t.block_n}, {t.warps}, "
                     f"{t.s_warps_n}, {t.kv_warps_n}, {t.dq_warps_m}, {t.stages}, {t.min_blocks}, {atomic}, "
                     f"{with_alibi}>")
    main = _jit.KernelSpec("flash_bwd.cu", main_name,
                           threads=_params.constant("kBwdSm90Threads") if t.wgmma else t.warps * 32,
                           smem_bytes=t.smem_bytes(head_dim, itemsize), needs_sm90a=t.wgmma)
    if t.bulk_dq:
        last = _jit.KernelSpec("flash_bwd.cu",
                               f"cuattn::bwd_convert_dq_tiles_kernel<{ctype}, {head_dim}, {t.block_m}>",
                               threads=_params.constant("kConvertTileThreads"))
    elif deterministic:
        last = _jit.KernelSpec(
            "flash_bwd.cu",
            f"cuattn::flash_bwd_dq_kernel<{ctype}, {dq_head_dim or head_dim}, {t.dq_block_m}, {t.dq_block_n}, "
            f"{t.dq_warps}, "
            f"{with_alibi}>",
            threads=t.dq_warps * 32, smem_bytes=t.dq_smem_bytes(dq_head_dim or head_dim, itemsize))
    else:
        last = _jit.KernelSpec("flash_bwd.cu", f"cuattn::bwd_convert_dq_kernel<{ctype}>",
                               threads=_params.constant("kConvertThreads"))
    return (
        _jit.KernelSpec("flash_bwd.cu", f"cuattn::bwd_preprocess_kernel<{ctype}>",
                        threads=_params.constant("kPreprocessWarps") * _params.constant("kWarpSize")),
        main,
        last,
    )


def bwd_kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """What the backward dispatcher can pick for every supported head dim: (wgmma tiles) both
    dq_modes, the other one selectable for comparison and fallback, and the mma.sync tile that
    stands in for views the TMA cannot read."""
    specs = set()
    for dtype, d, det, alibi in itertools.product(_arrays.CUDA_TYPES, SUPPORTED_HEAD_DIMS, (False, True),
                                                  (False, True)):
        tile_dim = bwd_tile_dim(d, arch)
        tile = bwd_tile(d, arch, det, alibi)
        # (ALiBi's bulk variants spill where BWD_ORDERED_ALIBI_FALLBACK says; an mma.sync tile has
        # one dQ path)
        spills = alibi and tile_dim in BWD_ORDERED_ALIBI_FALLBACK
        tiles = [dataclasses.replace(tile, dq_mode=mode) for mode in bwd_dq_modes(tile, tile_dim)
                 if not (spills and mode == "bulk")]
        for each in tiles if tile.wgmma else [tile]:
            specs.update(bwd_specs(dtype, tile_dim, each, det, alibi, bwd_dq_head_dim(d, arch)))
        if tile.wgmma:
            sm80_dim = bwd_tile_dim(d, SM80)
            specs.update(bwd_specs(dtype, sm80_dim, BWD_TILES[sm80_dim][SM80], det, alibi))
    return sorted(specs, key=lambda spec: spec.name)


def _check_bwd_args(dout, out, lse, q, v, lse_shape: tuple, host: bool) -> None:
    """dout and out: the forward output's shape (q's, with v's head dim Dv last), lse: the forward's."""
    same = int(v.shape[-1]) == int(q.shape[-1])
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != reference.out_shape(q, v):
            expected = "q.shape" if same else "q.shape[:-1] + v.shape[-1:] (v's head dim Dv last)"
            raise ValueError(f"{name}.shape must equal {expected} = {reference.out_shape(q, v)}, got {tuple(x.shape)}")
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse.shape must be {lse_shape} (the forward's lse), got {tuple(lse.shape)}")
    _arrays.check_same_dtype("dout", dout, "q", q)
    _arrays.check_same_dtype("out", out, "q", q)
    _arrays.check_float32("lse", lse, " (the forward's lse)")


def attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                       sinks=None, alibi_slopes=None, deterministic=False):
    """Gradients ``(dq, dk, dv)`` of :func:`attention` by recomputation (FlashAttention-2 backward);
    with ``sinks``, ``(dq, dk, dv, dsinks)`` (dsinks float32 ``(Hq,)``).

    ``out`` and ``lse`` (natural log, ``(B, Hq, Sq)``) are the forward's; every option must match
    the forward call. ``dk`` and ``dv`` sum over the query heads of each kv head's group (GQA).
    No N x N buffer: the extra device memory is ``delta = rowsum(dout * out)`` ``(B, Hq, Sq)``
    and, by default, a float32 dQ accumulator ``(B, Sq, Hq, D)`` (on sm_90a up to D = 128 about
    the same size in 64-row tiles of the tile head dim) summed by atomics or bulk reductions,
    whose order varies between runs. ``deterministic=True`` gives bit-identical gradients run
    after run: on sm_90a up to D = 128 the main kernel adds its dQ tiles in a fixed order (one
    int32 semaphore per tile more); elsewhere a second kernel sums dQ in a fixed order (no
    accumulator). The sinks' gradient is
    ``dsinks[h] = -sum over rows of exp(sinks[h] - lse) * delta`` (a deterministic reduction).
    ``alibi_slopes`` (as the forward's) are a constant bias: they get no gradient.
    """
    left, right = _masks.check_options(window, softcap, scale, causal=causal, deterministic=deterministic)
    result, call_key = _calls.run("attention_backward", (q, k, v, dout, out, lse, sinks, alibi_slopes),
                                  (bool(causal), scale, left, right, softcap, bool(deterministic)))
    if result is not None:
        return result
    _arrays.require(out=out)
    with _arrays.array_context(dout=dout, q=q, k=k, v=v, out=out, lse=lse, sinks=sinks,
                               alibi_slopes=alibi_slopes) as ctx:
        dov, qv, kv, vv, ov, lv, sv, av = (ctx.view(x) for x in (dout, q, k, v, out, lse, sinks, alibi_slopes))
        _check_qkv(qv, kv, vv, packed=False)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        batch, seqlen_q, num_heads, _ = map(int, qv.shape)
        _check_bwd_args(dov, ov, lv, qv, vv, (batch, num_heads, seqlen_q), ctx.on_host)
        if sv is not None:
            _arrays.check_sinks(sv, num_heads, ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, batch, num_heads, ctx.on_host, qv)
        _masks.check_total_length(int(qv.shape[1]), int(kv.shape[1]), "q.shape[1] + k.shape[1] (Sq + Sk)")
        if ctx.on_host:
            _arrays.check_last_axes({"dout": dov, "q": qv, "k": kv, "v": vv, "out": ov})
            grads = reference.attention_backward(dov, qv, kv, vv, ov, lv, causal=causal, scale=scale,
                                                 window=(left, right), softcap=softcap, sinks=sv, alibi_slopes=av)
            return _host_grads(grads, (qv, kv, vv))
        _check_device_arrays({"dout": dov, "q": qv, "k": kv, "v": vv, "out": ov})
        _arrays.check_same_device("lse", lv, "q", qv)
        plan = {}
        grads = _launch_bwd(dov, qv, kv, vv, ov, lv, None, None, batch=batch, seqlen_q=seqlen_q,
                            seqlen_k=int(kv.shape[1]), causal=causal, scale=scale, window=(left, right),
                            softcap=softcap, deterministic=bool(deterministic), ctx=ctx, sinks=sv,
                            alibi=(av, alibi_sb), plan=plan)
        if plan:
            _calls.remember(call_key, _bwd_plan(plan))
        return tuple(ctx.to_caller(g) for g in grads)


def _bwd_plan(plan: dict, varlen: bool = False):
    """The plan of an attention_backward or attention_varlen_backward call without sinks: new
    gradients (zeroed where varlen leaves rows to no CTA) and workspace (delta, the dQ accumulator,
    which the preprocess zeroes where it must be, and the zeroed semaphores), the same launches."""

    def finish(results, arrays):
        return results["dq"], results["dk"], results["dv"]

    cu_seqlens = ("cu_seqlens_q", "cu_seqlens_k") if varlen else ()
    return _calls.Plan(inputs=("q", "k", "v", "dout", "out", "lse", *cu_seqlens, "sinks", "alibi_slopes"),
                       outputs=plan["outputs"], bound=plan["bound"], finish=finish,
                       aligned=("q", "k", "v", "dout", "out"))


def _host_grads(grads, inputs):
    """The reference's float64 gradients in the inputs' dtypes (dsinks, when present, in float32)."""
    cast = tuple(g.astype(x.dtype) for g, x in zip(grads, inputs))
    return cast + (grads[3].astype(np.float32),) if len(grads) == 4 else cast


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, scale=None, window=(-1, -1), softcap=0.0, sinks=None,
                              alibi_slopes=None, deterministic=False):
    """Gradients of :func:`attention_varlen`; lse is the forward's ``(Hq, total_q)``. With ``sinks``,
    ``(dq, dk, dv, dsinks)`` as :func:`attention_backward`. Rows past ``cu_seqlens_q[-1]`` (a
    padded batch, whose ``out`` and ``lse`` rows the forward left unwritten) get dq = 0 and add
    nothing to dsinks; as in the forward, padded rows of q, k, v and dout must be finite."""
    left, right = _masks.check_options(window, softcap, scale, causal=causal, deterministic=deterministic)
    result, call_key = _calls.run(
        "attention_varlen_backward", (q, k, v, dout, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi_slopes),
        (bool(causal), scale, left, right, softcap, bool(deterministic), max_seqlen_q, max_seqlen_k))
    if result is not None:
        return result
    _arrays.require(out=out)
    lists, ints = _arrays.int_lists(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    with _arrays.array_context(dout=dout, q=q, k=k, v=v, out=out, lse=lse, sinks=sinks, alibi_slopes=alibi_slopes,
                               **ints) as ctx:
        dov, qv, kv, vv, ov, lv, sv, av = (ctx.view(x) for x in (dout, q, k, v, out, lse, sinks, alibi_slopes))
        cuq, cuk = (ctx.int_view(name, lists, ints) for name in ("cu_seqlens_q", "cu_seqlens_k"))
        _check_qkv(qv, kv, vv, packed=True)
        _check_dtypes(qv, kv, vv, ctx.on_host)
        total_q, num_heads, _ = map(int, qv.shape)
        _check_bwd_args(dov, ov, lv, qv, vv, (num_heads, total_q), ctx.on_host)
        _check_varlen_args(cuq, cuk, max_seqlen_q, max_seqlen_k, qv, kv, ctx.on_host)
        if sv is not None:
            _arrays.check_sinks(sv, num_heads, ctx.on_host, "q", qv)
        alibi_sb = _check_alibi(av, int(cuq.shape[0]) - 1, num_heads, ctx.on_host, qv)
        _masks.check_total_length(max_seqlen_q, max_seqlen_k, "max_seqlen_q + max_seqlen_k")
        if ctx.on_host:
            _arrays.check_last_axes({"dout": dov, "q": qv, "k": kv, "v": vv, "out": ov})
            grads = reference.attention_varlen_backward(dov, qv, kv, vv, ov, lv, cuq, cuk, max_seqlen_q, max_seqlen_k,
                                                        causal=causal, scale=scale, window=(left, right),
                                                        softcap=softcap, sinks=sv, alibi_slopes=av)
            return _host_grads(grads, (qv, kv, vv))
        import cupy

        _check_device_arrays({"dout": dov, "q": qv, "k": kv, "v": vv, "out": ov})
        _arrays.check_same_device("lse", lv, "q", qv)
        # (a plan passes the caller's cu_seqlens: only ones the kernels read in place)
        plan = {} if cuq.flags.c_contiguous and cuk.flags.c_contiguous else None
        grads = _launch_bwd(dov[None], qv[None], kv[None], vv[None], ov[None], lv[None],
                            cupy.ascontiguousarray(cuq), cupy.ascontiguousarray(cuk), batch=int(cuq.shape[0]) - 1,
                            seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k), causal=causal, scale=scale,
                            window=(left, right), softcap=softcap, deterministic=bool(deterministic), ctx=ctx,
                            sinks=sv, alibi=(av, alibi_sb), plan=plan)
        if plan:
            _calls.remember(call_key, _bwd_plan(plan, varlen=True))
        return tuple(ctx.to_caller(g[0] if g.ndim > 1 else g) for g in grads)


def _launch_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, batch, seqlen_q, seqlen_k, causal, scale,
                window, softcap, deterministic, ctx, sinks=None, alibi=(None, 0), grads=None, plan=None):
    """Backward kernels on 4-D views [B, S, H, D] (lse [B, H, S]); returns (dq, dk, dv).
    ``alibi``: the slopes ([B, Hq] | [Hq], or None) and their batch stride in elements.
    ``grads``: (dq, dk, dv) arrays of q's, k's and v's shapes to write into (cuattn.jax hands
    XLA's output buffers), instead of new ones. ``plan``: a dict that a call without sinks over a
    contiguous lse fills with what :func:`_bwd_plan` needs ("bound", "outputs").

    Atomic dQ: preprocess (delta), main kernel with dQ atomics into a float32 accumulator, convert;
    deterministic: preprocess, main kernel without dQ, then a kernel per query block that sums dQ
    in registers in a fixed order (no atomics: bit-identical run to run, about 1.4x the work).
    Bulk dQ (sm_90a, BwdTile.bulk_dq, the default there): the main kernel reduces whole dQ tiles
    into a tile accumulator, in a fixed order per tile where bwd_ordered says; then a tile convert.
    """
    import cupy

    varlen = cu_seqlens_q is not None
    rows_q, num_heads, head_dim = int(q.shape[1]), int(q.shape[2]), int(q.shape[3])
    num_kv_heads, head_dim_v = int(k.shape[2]), int(v.shape[3])
    stream = ctx.stream

    def zeros(shape, dtype):
        x = ctx.empty(shape, dtype)
        x.fill(0)  # on the caller's stream, current inside the array context
        return x

    # Gradients and workspace come from the caller's framework (torch's allocator for torch inputs).
    # varlen: rows past cu_seqlens[-1] (or past max_seqlen) belong to no CTA; they must read 0.
    # (The atomic path's convert kernel writes every element of dq, so only dk, dv need it there.)
    alloc = zeros if varlen else ctx.empty
    arch = _jit.target_arch()
    tile = bwd_tile(head_dim, arch, deterministic, alibi[0] is not None, head_dim_v)
    maps = _bwd_maps(q, k, v, dout, tile) if tile.wgmma else ()
    tile_dim = bwd_tile_dim(max(head_dim, head_dim_v), arch)
    if tile.wgmma and not maps:
        # a view the TMA cannot read: the mma.sync kernels take it, in their own tile
        tile_dim = bwd_tile_dim(max(head_dim, head_dim_v), SM80)
        tile = BWD_TILES[tile_dim][SM80]

    def gradient(index, like, make):
        if grads is None:
            return make(tuple(like.shape), like.dtype)
        given = grads[index]
        if make is zeros:
            given.fill(0)
        return given

    # (the bulk path's tile convert writes only rows inside a sequence)
    dq = gradient(0, q, alloc if deterministic or tile.bulk_dq else ctx.empty)  # [B, Sq, Hq, D]
    dk = gradient(1, k, alloc)  # [B, Sk, Hk, D]
    dv = gradient(2, v, alloc)  # [B, Sk, Hk, D]
    if q.size == 0 or k.size == 0:
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
        # no key: every row's lse is its sink and out is 0, so delta and dsinks are 0 too
        return (dq, dk, dv) if sinks is None else (dq, dk, dv, cupy.zeros(sinks.shape, cupy.float32))
    _masks.check_total_length(seqlen_q, seqlen_k)
    dq_dim = bwd_dq_head_dim(max(head_dim, head_dim_v), arch) if tile.wgmma else tile_dim
    pre, main, last = bwd_specs(np.dtype(q.dtype), tile_dim, tile, deterministic, alibi[0] is not None, dq_dim)
    lse_contiguous, lse = lse.flags.c_contiguous, cupy.ascontiguousarray(lse)
    delta = ctx.empty(tuple(lse.shape), np.float32)  # [B, Hq, Sq] (varlen [1, Hq, total_q]), lse's layout
    # [B, Sq, Hq, D] fp32, summed by atomics; the deterministic path writes dq directly; bulk dQ:
    # [tiles, BLOCK_M * tile D], each sequence's query blocks on their own tiles (flash_bwd.cu).
    # The preprocess zeroes what atomics or unordered bulk reductions add into (dq_accum_zero_floats)
    atomic = not deterministic and not tile.bulk_dq
    dq_accum = ctx.empty((int(q.shape[0]), rows_q, num_heads, head_dim), np.float32) if atomic else None
    acc_tile_sb = acc_tile_sh = 0
    semaphores = ticket = None
    if tile.bulk_dq:
        if varlen:
            # sequence b's blocks start at tile (cu_seqlens_q[b] + b * BLOCK_M) // BLOCK_M
            acc_tile_sb, acc_tile_sh = 0, (rows_q + batch * tile.block_m) // tile.block_m
        else:
            acc_tile_sh = -(-seqlen_q // tile.block_m)
            acc_tile_sb = num_heads * acc_tile_sh
        tiles = num_heads * acc_tile_sh if varlen else batch * acc_tile_sb
        ordered = bwd_ordered(tile, deterministic)
        # ordered: each tile's first write stores, and the convert reads a tile no write reached
        # (semaphore 0) as zeros, so only the unordered reductions need a zeroed accumulator
        dq_accum = ctx.empty((tiles, tile.block_m * tile_dim), np.float32)
        if ordered:
            # [tiles] semaphores and the CTA ticket [1], zero
            semaphores = zeros((tiles,), np.int32)
            ticket = zeros((1,), np.int32)
    # (float4 stores: D and the tiles' widths are multiples of 8)
    zero_floats = int(dq_accum.size) if dq_accum is not None and semaphores is None else 0
    strides = {name: list(_arrays.element_strides(x)) for name, x in
               (("q", q), ("k", k), ("v", v), ("do", dout), ("o", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    lse_s = list(_arrays.element_strides(lse)[:2])
    acc_sb = rows_q * num_heads * head_dim
    if varlen:
        # packed rows: a sequence starts at its cu_seqlens offset, not at b * batch_stride
        for s in (*strides.values(), lse_s):
            s[0] = 0
        acc_sb = 0
    score_scale, softcap_out = _masks.score_scalars(scale, softcap, head_dim)
    # an unbounded window side becomes a bound past every key and query the kernels compute
    left, right = _masks.window_bounds(causal, window, seqlen_q + seqlen_k + tile.block_n)
    # dense calls with bulk dQ store dK and dV through the TMA where their strides allow (the
    # kernel does so at the head dims whose dQ staging parts hold them; packed rows past a
    # sequence belong to the next)
    dkv_maps = _dkv_maps(dk, dv) if maps and tile.bulk_dq and not varlen else ()
    maps = (*maps, *dkv_maps)
    # one BwdParams for every launch of the call (flash_bwd.cu)
    no_map = np.zeros(_tma.MAP_WORDS, np.uint64)  # filled by the main kernel's launch (maps)
    params = _params.pack(
        "BwdParams", q_map=no_map, k_map=no_map, v_map=no_map, do_map=no_map, dk_map=no_map, dv_map=no_map,
        dkv_by_tma=int(bool(dkv_maps)), q=q, k=k, v=v, out=out, dout=dout, lse=lse, delta=delta, dq_accum=dq_accum, dq=dq, dk=dk, dv=dv,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi[0], alibi_sb=alibi[1],
        dq_semaphores=semaphores, cta_ticket=ticket,
        **{f"{name}_{axis}": stride[i] for name, stride in strides.items() for i, axis in enumerate(("sb", "ss", "sh"))},
        lse_sb=lse_s[0], lse_sh=lse_s[1], acc_sb=acc_sb, acc_tile_sb=acc_tile_sb, acc_tile_sh=acc_tile_sh,
        dq_accum_zero_floats=zero_floats,
        batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        rows_q=rows_q, score_scale=score_scale, softcap_out=softcap_out,
        softmax_scale=1.0 / np.sqrt(head_dim) if scale is None else float(scale), window_left=left,
        window_right=right, head_dim=head_dim, head_dim_v=head_dim_v,
        # ordered dQ ranks descend where the right window side is bounded (causal): see flash_bwd.cu
        dq_descending=int(causal or window[1] >= 0),
    )

    # (a plan passes the caller's lse: only one the kernels read in place)
    planning = plan is not None and sinks is None and grads is None and lse_contiguous
    if planning:
        # where each pointer field of the struct comes from in a later planned call: the call's
        # inputs, its gradients, or workspace it allocates (zeroed where kernels accumulate)
        # (varlen: the caller's arrays are the packed 3-D ones, the views' axis 0 is the batch of 1)
        roles = dict(q="q", k="k", v="v", dout="dout", out="out", lse="lse", alibi_slopes="alibi_slopes",
                     dq="dq", dk="dk", dv="dv", delta="delta", cu_seqlens_q="cu_seqlens_q",
                     cu_seqlens_k="cu_seqlens_k")
        caller_shape = (lambda x: tuple(x.shape[1:])) if varlen else (lambda x: tuple(x.shape))
        outputs = {name: (caller_shape(x), False, zeroed) for name, x, zeroed in
                   (("dq", q, varlen and (deterministic or tile.bulk_dq)), ("dk", k, varlen), ("dv", v, varlen))}
        outputs["delta"] = (tuple(lse.shape), True)
        # (the accumulator is zeroed by the preprocess or needs no zeros: see zero_floats)
        for field, role, array, zeroed in (("dq_accum", "dq_accum", dq_accum, False),
                                           ("dq_semaphores", "semaphores", semaphores, True),
                                           ("cta_ticket", "ticket", ticket, True)):
            roles[field] = role
            if array is not None:  # int32 semaphores: zero bits either way
                outputs[role] = ((int(array.size),), True, zeroed)
        plan.update(bound=[], outputs=outputs)

    def run(spec, grid, maps=()):
        if planning or maps:
            launch = _jit.prepare(spec, grid, params, maps=maps)
            launch.run(_jit.stream_ptr(stream))
            if planning:
                plan["bound"].append(_calls.Bound(launch, roles))
        else:
            _jit.launch_params(spec, grid, params, stream=stream)

    # delta = rowsum(dout * out) for every (b, i, h) row (varlen: the packed rows as one batch)
    views = int(q.shape[0])
    run(pre, (-(-(views * rows_q * num_heads) // _preprocess_rows_per_cta(head_dim_v)), 1, 1))
    run(main, (-(-seqlen_k // tile.block_n), *_split_grid(batch * num_kv_heads)), maps)
    if tile.bulk_dq:
        run(last, (-(-seqlen_q // tile.block_m), *_split_grid(batch * num_heads)))
    elif deterministic:
        run(last, (-(-seqlen_q // tile.dq_block_m), *_split_grid(batch * num_heads)))
    else:
        run(last, (-(-int(dq_accum.size) // _params.constant("kConvertThreads")), 1, 1))
    if sinks is None:
        return dq, dk, dv
    # varlen: only rows inside a sequence (and within max_seqlen_q of its start) have an lse and a
    # delta of their own; the others hold whatever the forward's buffers held
    rows = _rows_in_sequences(cu_seqlens_q, rows_q, batch, seqlen_q) if varlen else None
    return dq, dk, dv, _sink_grads(sinks, lse, delta, rows)


def _preprocess_rows_per_cta(head_dim_v: int) -> int:
    """Rows of delta one CTA of bwd_preprocess_kernel computes: kPreprocessWarps warps of
    kWarpSize / bwd_preprocess_lanes(Dv) rows each, kPreprocessRows times over (flash_bwd.cu)."""
    c = _params.constant
    lanes = 1
    while lanes < c("kWarpSize") and lanes * c("kPreprocessChunk") < head_dim_v:
        lanes *= 2
    return c("kPreprocessWarps") * (c("kWarpSize") // lanes) * c("kPreprocessRows")


def _bwd_maps(q, k, v, dout, tile: BwdTile):
    """The TMA views flash_bwd_sm90_kernel loads through: q and dout in boxes of [BLOCK_M rows, one
    128-byte panel], k and v in boxes of [tile.block_n rows, one panel], all 4-D (D, S, H, B)
    of the [B, S, H, D] views; () when one of them cannot be read that way (a byte stride that is
    not a multiple of 16)."""
    maps = tuple(_row_map(field, role, x, rows) for field, role, x, rows in (
        ("q_map", "q", q, tile.block_m), ("k_map", "k", k, tile.block_n), ("v_map", "v", v, tile.block_n),
        ("do_map", "dout", dout, tile.block_m)))
    return () if None in maps else maps


def _dkv_maps(dk, dv):
    """flash_bwd_sm90_kernel's TMA views of dense dk and dv [B, Sk, Hk, D] for its final stores, in
    boxes of one consumer's 64 keys (the launch's "dk_map" and "dv_map" entries); () when the TMA
    cannot write either."""
    rows = _params.constant("kWgmmaM")
    maps = (_row_map("dk_map", "dk", dk, rows), _row_map("dv_map", "dv", dv, rows))
    return () if None in maps else maps


def _rows_in_sequences(cu_seqlens, rows: int, batch: int, max_seqlen: int):
    """[rows] bool on the device: whether packed row r lies in a sequence b (cu_seqlens[b] <= r <
    cu_seqlens[b + 1]) within max_seqlen of its start, the rows the varlen kernels compute."""
    import cupy

    row = cupy.arange(rows, dtype=cupy.int32)
    seq = cupy.searchsorted(cu_seqlens, row, side="right").astype(cupy.int32) - 1  # -1 or B: none
    start = cu_seqlens[cupy.clip(seq, 0, batch)]
    return (seq >= 0) & (seq < batch) & (row - start < max_seqlen)


def _sink_grads(sinks, lse, delta, rows=None):
    """dsinks[h] = -sum over rows of exp(sinks[h] - lse) * delta, from lse and delta [B, Hq, Sq]
    (a CuPy reduction on the current stream: deterministic). ``rows``: optional [Sq] bool, the
    rows that count (the others' lse and delta may hold anything, NaN included)."""
    import cupy

    counted = cupy.isfinite(lse) if rows is None else cupy.isfinite(lse) & rows[None, None, :]
    terms = cupy.where(counted, cupy.exp(sinks[None, :, None] - lse) * delta, 0.0)
    return -terms.sum(axis=(0, 2), dtype=cupy.float32)
