// flash_fwd_sm90.cu: the FlashAttention forward on Hopper (sm_90a): TMA loads, wgmma, and
// warp specialisation in the FlashAttention-3 design.
//
// Computes what flash_fwd.cu computes (same FwdParams, same masks, softcap, ALiBi, GQA, varlen, lse):
// out = softmax(mask(cap(scale * q k^T))) v, without writing the Sq x Sk scores.
//
// Layouts (FwdParams, params.cuh; the last axis contiguous, every other stride a multiple of
// 16 bytes, which the TMA needs; the host falls back to flash_fwd.cu otherwise):
//   q    [B, Sq, Hq, D]   through q_map as 4-D (D, Sq, Hq, B)   varlen: (D, total_q, Hq, 1)
//   k    [B, Sk, Hk, D]   through k_map the same way
//   v    [B, Sk, Hk, Dv]  through v_map the same way
//   out  [B, Sq, Hq, Dv]  through o_map by TMA where p.o_by_tma, else 16-byte stores (rows past a
//                         varlen sequence belong to the next: those warpgroups take the stores)
//   paged keys (PAGED, p.block_table set; paged_attention_varlen's prefill): k and v are pages
//        [num_blocks, block_size, Hk, D | Dv], each key block loaded page by page through k_map /
//        v_map as 4-D (D, block_size, Hk, num_blocks) (the producer's page_of, load_chunk), or
//        with p.pages_by_copy row by row in 16-byte cp.async pieces (copy_key_rows; every
//        stride a multiple of 16 bytes); q, out and lse packed as in varlen; ALiBi's (B, Hq) slopes
//        read at the sequence the entry names (batch_index)
//   e4m3 pages (KV_E4M3, with PAGED and T = fp16): the same pages in e4m3 bytes, their rows
//        copied by cp.async into a staging of e4m3 rows (stage_key_rows) and widened to fp16 on
//        the way into the tiles (widen_staged_rows), real value = stored x descale (FwdParams'
//        k_scale / k_descale, v_scale / v_descale). T is fp16 for a bf16 q too (TOut bf16):
//        each consumer turns its rows of q into fp16 in shared memory (kQFromBf16)
// Head dims: the tile's HEAD_DIM (q, k) and HEAD_DIM_V (v, out), multiples of 16, hold any
// p.head_dim <= HEAD_DIM and p.head_dim_v <= HEAD_DIM_V (multiples of 8). Shared tiles are whole
// 64-column panels; the TMA reads zeros past a tensor's last column (its map's inner dim is the
// array's D), so padded columns add zeros to the scores and zero output columns, which the
// epilogue does not store. The GEMMs run as rows of wgmma (WgmmaRow), one instruction a k step
// at every tile's Dv (64 to 256).
//   lse  [B, Hq, Sq] fp32 (varlen [Hq, total_q]), or null
//
// A persistent CTA (one per SM) walks work tiles of BLOCK_M = 64 * CONSUMERS query rows of one
// (batch, head), with 128 (CONSUMERS + 1) threads in warpgroups:
//   warpgroup 0, the producer: gives up most of its registers (setmaxnreg) and one thread (all
//     four warps with paged keys, loading pages in TMA boxes or copying rows) issues the loads:
//     each tile's Q, then K and V of each visible key block into a circular buffer of STAGES
//     stages, each stage guarded by a "full" mbarrier (TMA bytes, or every producer thread's
//     copies, landed) and an "empty" one (every consumer thread is done reading it);
//   warpgroups 1..CONSUMERS, the consumers: 64 query rows each, with the registers. Per key
//     block: S = Q K^T (wgmma, both operands in shared memory), mask and online softmax in
//     registers (AttentionTile: the wgmma accumulator layout is the mma.sync one), then
//     O += P V (wgmma with P from registers, V read MN-major from shared memory).
// Two overlaps hide the softmax behind the tensor cores:
//   OVERLAP (within a warpgroup): block j's S GEMM and block j-1's PV GEMM are issued together;
//     the softmax of block j runs while PV still computes; the output's rescale waits for it.
//   PINGPONG (between warpgroups): named barriers take turns issuing GEMMs, so one warpgroup's
//     softmax runs under the other's GEMMs.
// BOUNDED: the softmax exponentiates each block against the rows' running max as it stands and
//   finds the block's max only where the sums show it grew past the lazy rescale's bound
//   (AttentionTile::softmax_to_fragments). Without OVERLAP it packs P as it goes and the
//   warpgroup votes before the PV GEMM; with OVERLAP the probabilities wait in the scores'
//   registers until the previous PV GEMM has read P's, and the warpgroup votes then. Either way a
//   vote for the exact path computes the block's S again (K and Q are released after the vote).
//   Always on without OVERLAP. With OVERLAP it can be off, the lazy max of softmax_update found
//   before the exponentials, where it does not pay (the max-first softmax is already hidden under
//   the PV GEMM: only D = 64's overlapped tile takes BOUNDED) or does not fit (D = 192 and 256
//   spill); the tile tables of cuattn/attention.py choose. In the ALIBI variants a warp takes the
//   exact path at once on a block that holds one of its rows' diagonals, where a steep head's
//   scores peak (holds_warp_diagonal).
// ALIBI adds ALiBi's bias (p.alibi_slopes is set). A template flag, not a runtime test of the
// pointer: the bias's per-row offsets then fold away in the variants without it, which keep the
// code they had before ALiBi existed (a runtime test cost D = 64 2-3% without ALiBi). In the
// tiles of D = 64 to 96 with 16-bit inputs the S GEMM adds the bias's per-key part by one more
// k16 step (kAlibiGemm, alibi_a: the slope in registers times each key's offset in its block,
// from a small tile in shared memory, AlibiKeyStep) wherever a warp's rows all lie on one side of
// the block's keys, leaving one offset a row to the softmax; only blocks a warp's diagonals
// cross add it per score, and under a causal mask (every visible key left of its row's diagonal)
// not even those (alibi_side). One k step more costs the tensor cores an eighth of the S GEMM's work
// at D = 64 and a sixth at D = 96, against a multiply-add a score on the softmax's path
// (FwdSm90SmemOf).
// Key blocks are visited last to first, so the masked blocks at the causal edge come first; the
// BOUNDED and ALIBI variants start at the block holding the tile's diagonal instead, go down to
// the first, then right of it up to the last (FwdSm90Work::key_block; the same under a causal
// mask): attention, and ALiBi's bias by construction, is largest near the diagonal, so the row
// max is found early. A BOUNDED softmax computes a block whose scores rise past the running max
// twice (AttentionTile::softmax_to_fragments); the lazy max rescales O where the max grows past
// its bound, which with ALiBi last to first was every block right of the diagonal for the steep
// heads' rows. Only blocks that cross a mask boundary evaluate the mask.
//
// Tile schedule: the producer picks each tile and hands its index to the consumers through a
// ring of kFwdSm90TileRing slots in shared memory, each guarded by a "tile full" mbarrier (one
// arrival: the producer's, after it wrote the slot; its release and the consumers' acquiring
// wait order the slot's write before their reads) and a "tile empty" one (every consumer thread
// arrives once it has read the slot). The producer publishes tile t + 1 as soon as it has
// issued tile t's last load, so the consumers find it waiting when tile t's epilogue ends, and
// kFwdSm90NoTile ends the loop. Which tiles:
//   static  (p.tile_counter null): CTA i takes tiles i, i + gridDim.x, ... in (batch, head)-major
//           order, the last query block of a head first (with a grid of one CTA per tile, the
//           hardware schedules);
//   dynamic (p.tile_counter [2]): CTA i starts with tile i, then the producer takes the next
//           index with one atomicAdd on tile_counter[0] (issued a tile ahead, so its latency
//           hides under that tile's loads). The index space runs over L2 sections of
//           p.tile_section (batch, head) pairs (as many as keep their K and V in L2), and within
//           a section query block by query block, the last (under a causal mask the heaviest)
//           first, over the section's heads; so the CTAs running at once share one section's K
//           and V, and the long tiles start first, the short ones fill in at the end. A varlen
//           launch (p.tile_order) takes positions in a tile order instead, which
//           fwd_tile_order_kernel (tile_order.cu) wrote after the counters: only tiles that hold
//           rows, the longest sequences first, each sequence's tiles in the order above.
//   Either way a tile past its varlen sequence's end is skipped by the producer and never
//   reaches the ring (no pipeline iteration, no barrier traffic).
// Row alignment (FwdSm90Work::row_shift): a warpgroup past Sq computes its blocks all the same
// where the warpgroups take turns (ping-pong), and still fills the pipeline's stages otherwise.
// Dense calls whose right window edge hides keys (causal) align the tiles to end at the last
// row instead of starting at row 0 where Sq leaves whole warpgroups of the last tile without
// rows (the FP8 forward's 192-row tiles at N = 8192: 64 rows over all keys), so the surplus goes
// to the first tile, whose rows see the fewest keys: that tile starts at row 0 and stores only
// the rows before the second tile's start (its other warpgroups store nothing: under ping-pong
// they compute the second tile's first rows again, over the few keys they see; otherwise they
// drop every block).
// Dropped blocks (FwdSm90Work::drop_unseen): where the consumers do not take turns, each
// warpgroup leaves out the first visits of the tile's key blocks that none of its stored rows sees
// (past its rows' diagonal where the tile is taller than a key block, all of them where it stores
// no row), releasing their stages once they have landed; the producer loads every block of the
// tile for the warpgroups that need it.
// Counter reset (dynamic): a producer whose take came back past the last tile adds one to
// tile_counter[1] (after a fence, so its last take is ordered before); the CTA that brings it to
// gridDim.x is the last to take, and writes both counters back to zero. Every launch thus starts
// from zero with no memset launch, CUDA-graph replays included; the host gives each stream its
// own counter, so launches on different streams do not share one.
//
// FP8 (T = e4m3, output TOut fp16/bf16; cuattn.attention with e4m3 q, k, v): the same pipeline on
// k32 e4m3 wgmma (wgmma.cuh). Differences, each under `if constexpr (kFp8)`:
//   tiles   Q [BLOCK_M, D] and K [BLOCK_N, D] bytes, 128 e4m3 columns per swizzled row (TMA box
//           [rows, 128]); D = 128 or 256.
//   V       8-bit wgmma operands are K-major only, so B of O += P V must be V^T with the keys
//           contiguous. fp8_v_transpose_kernel (below) writes it once per call, v_map reading
//           [B, Hk, D, Sk_pad] (Sk padded to 16 with zeros, keys of each 16 in the order pi of
//           AttentionTile::to_e4m3_fragments); a stage holds V^T [D, BLOCK_N] (one 128-key box
//           of D rows), read K-major. Cost: one extra read and write of V (B Sk Hk D bytes
//           each: 2 x 64 MiB at the benchmark's 32k tokens x 2048, 39 us on the H200 at 3.4
//           TB/s, against 1-5 ms of attention at N = 4k-16k), and a V^T buffer of V's size.
//           Moving the transpose into this kernel's producer warps was measured and not kept
//           (BENCHMARKS.md, thirteenth session).
//   P       the fp32 probabilities are rounded to e4m3 in registers (to_e4m3_fragments), as
//           FlashAttention-3 does; the row sums l stay in fp32 from the unrounded values.
//   scales  q_descale x k_descale (per tensor, head, or q block of 64 rows) multiply the score
//           scale; a k scale per block of kFp8ScaleBlockKeys keys (block quantisation) multiplies
//           the block's raw scores instead (raw maxima of differently scaled blocks do not
//           compare); v's descale multiplies the normalised output.
#include "attention_tile.cuh"
#include "block_range.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cuattn {

// setmaxnreg of the producer warpgroup. 384 threads start at 168 registers, so with two
// consumers producer + 2 x consumer must stay within 3 x 168 = 504, or setmaxnreg.inc waits for
// registers forever: 24 + 2 x 240. The paged variant's producer (its page lookups and row
// copies) spills at 40 and takes 48, its consumers 224 (no tile spills there; at 232 the dense
// D = 256 tile ran 2-3% slower, so the dense variants keep 240).
constexpr int kFwdSm90ProducerRegs = 24;
constexpr int kFwdSm90PagedProducerRegs = 48;
// Barrier ids: 0 is __syncthreads; the pingpong turn of consumer c is kFwdSm90TurnBarrier + c,
// consumer c's own barrier (its epilogue, its softmax's vote) kFwdSm90ConsumerBarrier + c.
constexpr int kFwdSm90TurnBarrier = 1;
constexpr int kFwdSm90ConsumerBarrier = 5;
// the producer warpgroup's own barrier (paged keys, which all four of its warps load)
constexpr int kFwdSm90ProducerBarrier = 3;
// Keys per k scale of a block-quantised e4m3 k: the FP8 kernels' key block (BLOCK_N); q's blocks
// are one consumer's kWgmmaM rows.
constexpr int kFp8ScaleBlockKeys = 128;
// Tile schedule: slots in the ring of tile indices from the producer to the consumers (the
// producer runs at most this many tiles ahead of the consumers' reads), and the index that ends
// the loop.
constexpr int kFwdSm90TileRing = 2;
constexpr int kFwdSm90TileIndexBytes = 4;
constexpr int kFwdSm90NoTile = -1;
// With paged keys (all four producer warps loading) the leader hands each tile index to the
// other warps through two alternating int32 slots after the ring's (one barrier per hand-over).
constexpr int kFwdSm90ProducerSlots = 2;
// ALiBi's bias through the S GEMM (kAlibiGemm in the kernel): one more k16 step multiplies a
// per-row slope (A, registers) by each key's offset in its block (B, shared memory), in pieces
// of PIECE keys (the whole block where its tile fits, else kAlibiMinPieceKeys). B is rows of
// kAlibiKeyRowBytes, unswizzled (rows16_descriptor): row n holds (n, n, n, 1, 1, 1, 0, 0), and
// every piece reads rows 0 .. its width - 1. The piece at offset o gets the slope's three parts in
// T (hi + mid + lo) for k columns 0-2 and o times them for columns 3-5 (exact: o is a power of
// two), so it adds slope (n + o) to key o + n. Its k columns 8-15 read the 8 rows after each group
// of 8, which A's zeros cancel: the tile holds PIECE + kAlibiTailRows rows. Pieces of 64 keys let the tile fit
// beside the three-warpgroup tiles' O at D = 80 and 96 (1920 bytes left; a 128-key block's tile
// takes 2880, a 64-key piece's 1152).
// compute-sanitizer counts a wgmma read as the bytes of a whole [width, 16] operand from the
// descriptor's address: the tile takes what more of those the barriers and slack after it do not
// hold (FwdSm90Smem::kAlibiBytes).
constexpr int kAlibiKeyRowBytes = 16;
constexpr int kAlibiMinPieceKeys = 64;
constexpr int kAlibiTailRows = 8;  // the rows past a piece's that its k columns 8-15 read
constexpr int kAlibiPastKeys = 0x7fffffff;  // a first key beyond every block's (alibi_side's bounds)
constexpr int alibi_pieces(int block_n, int piece) { return (block_n + piece - 1) / piece; }
// the key tile's rows for pieces of `piece` keys (0: no tile)
constexpr int alibi_key_rows(int piece) { return piece == 0 ? 0 : piece + kAlibiTailRows; }
// the bytes compute-sanitizer counts for a piece's wgmma read: a whole [piece, 16] 16-bit operand
constexpr int alibi_read_bytes(int piece) { return 2 * piece * kAlibiKeyRowBytes; }
// the key tile's bytes: its rows, and as many more as a read's span needs past the `trailing`
// bytes after the tile
constexpr int alibi_key_bytes(int piece, int trailing) {
  return alibi_key_rows(piece) * kAlibiKeyRowBytes > alibi_read_bytes(piece) - trailing
             ? alibi_key_rows(piece) * kAlibiKeyRowBytes
             : alibi_read_bytes(piece) - trailing;
}

// The k step over a block of BLOCK_N keys in pieces of PIECE, piece P on: keys [o, o + width) of
// the block take the scores' accumulators from o / 2 (wgmma.cuh's accumulator layout keeps
// columns in order), the key tile's rows from 0 and A words[P].
template <typename T, int BLOCK_N, int PIECE, int P = 0>
struct AlibiKeyStep {
  static constexpr int kOffset = P * PIECE;
  static constexpr int kWidth = BLOCK_N - kOffset < PIECE ? BLOCK_N - kOffset : PIECE;
  static __device__ __forceinline__ void rs(float (&s)[BLOCK_N / 2],
                                            const u32 (&words)[alibi_pieces(BLOCK_N, PIECE)][4], u32 keys,
                                            int accumulate) {
    WgmmaRow<T, kWidth>::template rs<0>(*reinterpret_cast<float(*)[kWidth / 2]>(&s[kOffset / 2]), words[P],
                                        [&](int key) { return rows16_descriptor(keys, key); }, accumulate);
    if constexpr (kOffset + kWidth < BLOCK_N) AlibiKeyStep<T, BLOCK_N, PIECE, P + 1>::rs(s, words, keys, accumulate);
  }
};

// The e4m3 pages' staging (KV_E4M3): one key block's rows of e4m3 bytes as they come from the
// pages, [BLOCK_N, COLS rounded up to whole spans] per tensor, before the producer widens them
// into the 16-bit tiles (stage_key_rows, widen_staged_rows). A row spreads over the lanes of a
// span, 16 bytes each: eight (128 bytes), or for a row of fewer bytes that a whole number of
// lanes splits evenly into a warp's rows (D = 64: four), as many as it has pieces, so that no lane
// idles.
constexpr int e4m3_row_lanes(int cols) {
  return cols < kSwizzleRowBytes && cols % kCopyBytes == 0 && kWarpSize % (cols / kCopyBytes) == 0
             ? cols / kCopyBytes
             : kSwizzleRowBytes / kCopyBytes;
}
constexpr int e4m3_staging_row_bytes(int cols) {
  const int span = e4m3_row_lanes(cols) * kCopyBytes;
  return (cols + span - 1) / span * span;
}
constexpr int e4m3_staging_bytes(int block_n, int head_dim, int head_dim_v) {
  return block_n * (e4m3_staging_row_bytes(head_dim) + e4m3_staging_row_bytes(head_dim_v));
}

// Shared memory, byte offsets from a 1024-byte-aligned base. The host mirrors kBytes
// (cuattn/attention.py, FwdSm90Tile.smem_bytes). ELEM_BYTES: 2 (fp16/bf16 q, k, v) or 1 (e4m3);
// the output is 16-bit either way. SwizzledTile counts 16-bit columns, so a tile of e4m3 rows
// of D bytes is SwizzledTile<ROWS, D / 2> (wgmma.cuh). ALIBI_PIECE: the keys of a piece of
// ALiBi's k step, whose key offsets' tile it holds (kAlibiGemm), or 0 (none). STAGING_BYTES: the
// e4m3 pages' staging of K and V (e4m3_staging_bytes), or 0 (none).
template <int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int CONSUMERS, int STAGES, int ELEM_BYTES = 2,
          int ALIBI_PIECE = 0, int STAGING_BYTES = 0>
struct FwdSm90Smem {
  static constexpr bool kFp8 = ELEM_BYTES == 1;
  static constexpr int BLOCK_M = kWgmmaM * CONSUMERS;
  // a row of D elements in 16-bit columns, padded to whole panels
  static constexpr int kRowCols = panel_cols(HEAD_DIM * ELEM_BYTES / 2);
  using QTile = SwizzledTile<BLOCK_M, kRowCols>;  // [BLOCK_M, D]
  using KTile = SwizzledTile<BLOCK_N, kRowCols>;  // [BLOCK_N, D] per stage
  // per stage: V [BLOCK_N, Dv] (16-bit, read MN-major), or V^T [Dv, BLOCK_N] (e4m3, read K-major)
  using VTile = typename Conditional<kFp8, SwizzledTile<HEAD_DIM_V, BLOCK_N / 2>,
                                     SwizzledTile<BLOCK_N, panel_cols(HEAD_DIM_V)>>::type;
  using OTile = SwizzledTile<BLOCK_M, panel_cols(HEAD_DIM_V)>;  // [BLOCK_M, Dv] of the 16-bit output
  // mbarriers: Q full, Q empty, then per stage K full, V full, K empty, V empty, then per ring
  // slot tile full, tile empty (8 bytes each); then the ring's tile indices and the producer's
  // hand-over slots (int32); the dynamic allocation's base is only 16-byte aligned: one atom of
  // slack to round it up
  static constexpr int kBarrierCount = 2 + 4 * STAGES + 2 * kFwdSm90TileRing;
  static constexpr int kIndexWords = kFwdSm90TileRing + kFwdSm90ProducerSlots;
  // after the key tile: the barriers, indices and slack
  static constexpr int kTrailingBytes =
      kBarrierCount * kMbarrierBytes + kIndexWords * kFwdSm90TileIndexBytes + kSwizzleAtomBytes;
  static constexpr int kAlibiRows = alibi_key_rows(ALIBI_PIECE);
  static constexpr int kAlibiReadBytes = alibi_read_bytes(ALIBI_PIECE);
  static constexpr int kAlibiBytes = alibi_key_bytes(ALIBI_PIECE, kTrailingBytes);
  static constexpr int kFixed = QTile::kBytes + STAGES * (KTile::kBytes + VTile::kBytes) + STAGING_BYTES +
                                kAlibiBytes + kTrailingBytes;
  // The epilogue stages O in a tile of its own where it fits (so the next tile's Q loads under
  // this one's epilogue); otherwise (16-bit D = 256, say) in Q's, which is then released after
  // the stores.
  static constexpr bool kOwnO = kFixed + OTile::kBytes <= kSm90MaxSmem;
  static_assert(kOwnO || OTile::kBytes <= QTile::kBytes, "O staged in Q's tile fits there");
  static constexpr int kQ = 0;
  static constexpr int kO = kOwnO ? kQ + QTile::kBytes : kQ;  // [BLOCK_M, Dv]
  static constexpr int kK = kOwnO ? kO + OTile::kBytes : kQ + QTile::kBytes;
  static constexpr int kV = kK + STAGES * KTile::kBytes;
  // e4m3 K rows [BLOCK_N, e4m3_staging_row_bytes(D)], then V's [BLOCK_N, ...(Dv)]
  static constexpr int kStaging = kV + STAGES * VTile::kBytes;
  static constexpr int kStagingV = kStaging + BLOCK_N * e4m3_staging_row_bytes(HEAD_DIM);
  static constexpr int kAlibiKeys = kStaging + STAGING_BYTES;  // [kAlibiRows, 8] 16-bit, unswizzled
  static constexpr int kBarriers = kAlibiKeys + kAlibiBytes;
  static constexpr int kTileRing = kBarriers + kBarrierCount * kMbarrierBytes;  // int32 [kFwdSm90TileRing]
  static constexpr int kProducerSlots = kTileRing + kFwdSm90TileRing * kFwdSm90TileIndexBytes;  // int32 [2]
  static constexpr int kBytes = kFixed + (kOwnO ? OTile::kBytes : 0);
  static_assert(kBytes <= kSm90MaxSmem, "tiles fit in shared memory");
  static_assert(kAlibiKeys + kAlibiReadBytes <= kBytes, "a wgmma's read of the key tile stays in bounds");
};

// The shared memory of a variant. ALiBi's bias goes through the S GEMM's extra k step
// (kAlibiGemm) for 16-bit inputs up to kAlibiGemmMaxHeadDim wherever the key tile fits beside the
// rest without taking O's tile; else one multiply-add a score (AttentionTile::add_alibi). At
// D = 64, where the softmax's issue rate, not the tensor cores, sets the pace, on the H200 (bf16,
// time over the plain call, BENCHMARKS.md "Twenty-sixth session") it took ALiBi from 1.136 /
// 1.061 to 1.068 / 1.045 at 4k keys (full / causal). A whole block's key tile does not fit beside
// the three-warpgroup tiles' O at D = 80 and 96; staging O in Q's tile to make room cost more at
// 1k keys than the step saved ("Thirty-eighth session"), so there the step goes in pieces of
// kAlibiMinPieceKeys, which took ALiBi at 4k keys from 1.058-1.060 to 1.037-1.039 at D = 80 and
// from 1.034-1.035 to 1.011-1.015 at D = 96 ("Thirty-ninth session"). Past kAlibiGemmMaxHeadDim,
// D = 128's three-warpgroup tile spilled and serialised its wgmma with the step's registers, and
// ALiBi costs it 3-6% per score already. e4m3 cannot hold the key offsets.
constexpr int kAlibiGemmMaxHeadDim = 96;
// The e4m3 pages' variant (KV_E4M3) stages K's and V's rows (stage_key_rows), O's own tile given
// up where both do not fit beside it (the host's tiles for it leave room: FWD_SM90_E4M3_PAGED_TILES).
template <int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int CONSUMERS, int STAGES, int ELEM_BYTES, bool ALIBI,
          bool KV_E4M3 = false>
struct FwdSm90SmemOf {
  using Plain = FwdSm90Smem<HEAD_DIM, HEAD_DIM_V, BLOCK_N, CONSUMERS, STAGES, ELEM_BYTES>;
  static constexpr int kStagingBytes = KV_E4M3 ? e4m3_staging_bytes(BLOCK_N, HEAD_DIM, HEAD_DIM_V) : 0;
  // whether the key tile for pieces of `piece` keys fits beside the rest, O's tile kept
  static constexpr bool fits(int piece) {
    const int tiles = Plain::kFixed + alibi_key_bytes(piece, Plain::kTrailingBytes);
    return Plain::kOwnO ? tiles + Plain::OTile::kBytes <= kSm90MaxSmem : tiles <= kSm90MaxSmem;
  }
  static constexpr int kAlibiPiece =
      !(ALIBI && ELEM_BYTES == 2 && HEAD_DIM <= kAlibiGemmMaxHeadDim && HEAD_DIM_V <= kAlibiGemmMaxHeadDim) ? 0
      : fits(BLOCK_N)                                                                                         ? BLOCK_N
      : fits(kAlibiMinPieceKeys)                                                                              ? kAlibiMinPieceKeys
                                                                                                              : 0;
  using type =
      FwdSm90Smem<HEAD_DIM, HEAD_DIM_V, BLOCK_N, CONSUMERS, STAGES, ELEM_BYTES, kAlibiPiece, kStagingBytes>;
};

// One work tile: BLOCK_M query rows of one (batch, head), and the key blocks they see.
// PAGED: launch entries name sequences of a paged cache (FwdParams' paged fields).
template <int BLOCK_M, int BLOCK_N, typename Params, bool PAGED>
struct FwdSm90Work {
  int b, h, m0;
  int m_end;  // the tile stores rows [m0, min(m_end, Sq)) (row_shift: the first tile's may end sooner)
  SequenceRange seq;
  int n_first, n_last;  // key blocks [n_first, n_last)

  // Tile `tile` of the schedule's order (the file's opening comment): static, (batch, head)-major;
  // dynamic, L2 sections of p.tile_section (batch, head) pairs, each query block by query block
  // over the section's pairs. Within a pair either way the last query rows (the heaviest under a
  // causal mask) come first. Sections of one pair are the static order: a tile order's launch
  // (p.tile_order) lists its tiles as static indices and has p.tile_section 1.
  __device__ __forceinline__ FwdSm90Work(const Params& p, int tile, int m_blocks)
      : FwdSm90Work(p, tile_pair(p, tile, m_blocks), m_blocks) {}

  // (batch * num_heads + head, query block counted from the last) of `tile`
  struct Pair {
    int bh, m_rank;
  };
  __device__ __forceinline__ static Pair tile_pair(const Params& p, int tile, int m_blocks) {
    if (p.tile_counter == nullptr) return {tile / m_blocks, tile % m_blocks};
    const int section_tiles = p.tile_section * m_blocks;
    const int first = tile / section_tiles * p.tile_section;  // the section's first pair
    const int width = min(p.tile_section, p.batch * p.num_heads - first);  // the last section may be narrower
    const int local = tile - first * m_blocks;
    return {first + local % width, local / width};
  }
  // Rows the tiles start before row 0 ("Row alignment" in the file's opening comment; the host's
  // attention.fwd_sm90_row_shift mirrors it): dense calls whose right window edge hides keys (a
  // causal mask) and whose Sq leaves whole warpgroups of a row-0-aligned last tile without rows
  static __device__ __forceinline__ int row_shift(const Params& p) {
    if (PAGED || p.cu_seqlens_q != nullptr || p.window_right >= p.seqlen_k) return 0;
    return (BLOCK_M - p.seqlen_q % BLOCK_M) % BLOCK_M / kWgmmaM * kWgmmaM;
  }
  // b is the sequence: launch entry pair.bh / num_heads, or with paged keys the sequence that
  // entry names (batch_index)
  __device__ __forceinline__ FwdSm90Work(const Params& p, Pair pair, int m_blocks)
      : FwdSm90Work(p, pair, (m_blocks - 1 - pair.m_rank) * BLOCK_M - row_shift(p), 0) {}
  // the tile whose rows would start at `start` (the unnamed int tells it from the one above)
  __device__ __forceinline__ FwdSm90Work(const Params& p, Pair pair, int start, int)
      : b(PAGED ? p.batch_index[pair.bh / p.num_heads] : pair.bh / p.num_heads),
        h(pair.bh % p.num_heads),
        m0(max(start, 0)),
        m_end(start + BLOCK_M),
        seq(PAGED ? SequenceRange::paged(p, b)
                  : SequenceRange(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k)) {
    seq.key_blocks<BLOCK_N>(m0, BLOCK_M, p.window_left, p.window_right, n_first, n_last);
  }
  // The key block visited i-th. DIAG_FIRST (the BOUNDED and ALIBI variants, the file's opening
  // comment): the block holding the diagonal of the tile's last row (clamped into the visible
  // ones) down to n_first, then the ones after it up to n_last - 1. Otherwise last to first (the
  // lazy max only rescales then). Under a causal mask both are last to first.
  template <bool DIAG_FIRST>
  __device__ __forceinline__ int key_block(int i) const {
    if constexpr (!DIAG_FIRST) return n_last - 1 - i;
    const int diag = max(min(max(m0 + BLOCK_M - 1 + seq.offset, 0) / BLOCK_N, n_last - 1), n_first);
    return i <= diag - n_first ? diag - i : n_first + i;
  }
  // Drops the first visits of the key blocks that the tile's rows [m0 + row, m0 + row + kWgmmaM)
  // (one warpgroup's) do not need, and returns how many: all of them where the tile stores none
  // of these rows (past Sq, or past a shifted first tile's m_end); where the visits run last to
  // first (a causal mask: the tile's last block holds its last row's diagonal), the blocks past
  // these rows' diagonal; otherwise none. The visits left keep their order.
  template <bool DIAG_FIRST>
  __device__ __forceinline__ int drop_unseen(int row, int right) {
    const int first_row = m0 + row;
    const int rows = min(kWgmmaM, min(m_end, seq.seqlen_q) - first_row);
    // one past the last key these rows see, as a block bound
    const int end = min(seq.seqlen_k, first_row + rows + seq.offset + right);
    const int seen = min(max((end + BLOCK_N - 1) / BLOCK_N, n_first), n_last);
    const bool last_to_first = !DIAG_FIRST || key_block<DIAG_FIRST>(0) == n_last - 1;
    const int last = rows <= 0 ? n_first : last_to_first ? seen : n_last;
    const int dropped = n_last - last;
    n_last = last;
    return dropped;
  }
  // varlen: a sequence shorter than the longest has tiles past its end
  __device__ __forceinline__ bool empty() const { return m0 >= seq.seqlen_q; }
  // whether row m0 + row is this tile's to store
  __device__ __forceinline__ bool stores(int row) const { return m0 + row < min(m_end, seq.seqlen_q); }
  __device__ __forceinline__ int blocks() const { return n_last - n_first; }
};

// Paged keys copied row by row (the producer warpgroup, p.pages_by_copy): warp wp copies rows
// [wp R, wp R + R) of a key block of BLOCK_N rows, R = copy_warp_rows(BLOCK_N); lane l of the warp
// has looked up row wp R + l (a KeyRow: its page and slot, or kNoKeyRow past the sequence).
struct KeyRow {
  int page, slot;
};
constexpr int kNoKeyRow = -1;
__host__ __device__ constexpr int copy_warp_rows(int block_n) { return block_n / (kWarpgroupThreads / kWarpSize); }

// How a warp's rows of a key block spread over its lanes for a copy row by row: LANES lanes a row,
// lane l moving the 16 bytes l % LANES of each span of 16 LANES bytes of the row's ROW_BYTES, so
// a pass covers kPassRows = 32 / LANES of the warp's copy_warp_rows(BLOCK_N) rows. Lane l has
// looked up row l of the warp's (a KeyRow), and a pass takes its rows' page and slot by shuffle.
template <int BLOCK_N, int ROW_BYTES, int LANES>
struct RowPieces {
  static constexpr int kPassRows = kWarpSize / LANES;
  static constexpr int kSpanBytes = LANES * kCopyBytes;  // bytes a pass covers of a row
  static constexpr int kSpans = (ROW_BYTES + kSpanBytes - 1) / kSpanBytes;
  static constexpr int kRows = copy_warp_rows(BLOCK_N);
  static constexpr int kPasses = kRows / kPassRows;
  static_assert(kRows % kPassRows == 0 && kRows <= kWarpSize, "whole passes; one lane looks up each row");
  // the tile's row for this lane in the pass that starts at row r0 of the warp's (pass r0 / kPassRows)
  __device__ __forceinline__ static int row(int r0, int lane, int warp) { return warp * kRows + r0 + lane / LANES; }
  // that row's page and slot, from the lane that looked it up
  __device__ __forceinline__ static KeyRow looked_up(KeyRow mine, int r0, int lane) {
    const int from = r0 + lane / LANES;
    return KeyRow{__shfl_sync(0xffffffffu, mine.page, from), __shfl_sync(0xffffffffu, mine.slot, from)};
  }
  // this lane's first column of `span` in its row, in elements of ELEM_BYTES bytes
  template <int ELEM_BYTES>
  __device__ __forceinline__ static int col(int span, int lane) {
    return span * (kSpanBytes / ELEM_BYTES) + lane % LANES * (kCopyBytes / ELEM_BYTES);
  }
};

// One key block's rows of k or v pages [num_blocks, block_size, Hk, D] (src: the kv head's first
// element; strides in elements) into a swizzled tile [BLOCK_N, TILE_COLS] (Tile), as the TMA would
// write it: RowPieces of eight lanes a row, so a span is one 128-byte panel of the tile's. Rows
// past the sequence and columns from `cols` on are zero (cp.async's source size 0, nothing read):
// a page's slots past the sequence may hold NaN, and P = 0 times NaN is NaN.
template <class Tile, int BLOCK_N, int TILE_COLS, typename T>
__device__ __forceinline__ void copy_key_rows(u32 tile, const T* src, i64 page_stride, i64 row_stride, int cols,
                                              KeyRow mine, int lane, int warp) {
  constexpr int kElemBytes = static_cast<int>(sizeof(T));
  constexpr int kPieceCols = kCopyBytes / kElemBytes;
  using Rows = RowPieces<BLOCK_N, TILE_COLS * kElemBytes, kSwizzleRowBytes / kCopyBytes>;
#pragma unroll 1
  for (int r0 = 0; r0 < Rows::kRows; r0 += Rows::kPassRows) {
    const KeyRow at = Rows::looked_up(mine, r0, lane);
    const int row = Rows::row(r0, lane, warp);
    const T* row_src = at.page == kNoKeyRow ? src : src + at.page * page_stride + at.slot * row_stride;
#pragma unroll
    for (int span = 0; span < Rows::kSpans; ++span) {
      const int col = Rows::template col<kElemBytes>(span, lane);
      // columns past the tile's are never read (a panel may reach past TILE_COLS)
      if (col < TILE_COLS) {
        const bool valid = at.page != kNoKeyRow && col < cols;
        cp_async_16(tile + Tile::chunk_offset(row, col / kPieceCols), valid ? row_src + col : src, valid);
      }
    }
  }
}

// The rows copy_key_rows copies, from e4m3 pages (bytes; strides in bytes) into an fp16 tile,
// widened in registers (fp8.cuh, e4m3x4_to_half2x2: exact; a bf16 q runs the fp16 GEMMs too):
// RowPieces of e4m3_row_lanes(D) lanes a row, each lane's 16 bytes (16 columns) becoming two
// 16-byte pieces of the swizzled tile. Rows past the sequence and columns from `cols` on (D, a
// multiple of 16) are zero, never read. stage_key_rows copies a block's rows into FwdSm90Smem's
// staging with cp.async, and widen_staged_rows, once they have landed, reads each lane's own
// pieces back (so no barrier between the two) and stores them widened. The copies of the next
// block go out as soon as a lane has read this one's, so a block's bytes are in flight while the
// producer widens the other tensor and waits for free stages. Loading the rows into registers
// instead (four 16-byte loads in flight a lane within the producer's 48 registers) ran D = 192 and
// 256 1.7x slower on an H100; copies two blocks ahead ran level with one, and halving D = 64's
// passes nearly halved its time, so the producer's own instructions a block, not the copies'
// round trips, set the pace (BENCHMARKS.md, "Sixty-sixth
// session").
template <int BLOCK_N, int TILE_COLS>
struct E4m3RowCopy : RowPieces<BLOCK_N, TILE_COLS, e4m3_row_lanes(TILE_COLS)> {
  using Rows = RowPieces<BLOCK_N, TILE_COLS, e4m3_row_lanes(TILE_COLS)>;
  static constexpr int kStagingRowBytes = e4m3_staging_row_bytes(TILE_COLS);
  static_assert(kStagingRowBytes == Rows::kSpans * Rows::kSpanBytes, "a staged row holds every span");
};

// 16 e4m3 bytes widened to fp16, stored as two 16-byte pieces of a swizzled tile at (row, col)
template <class Tile>
__device__ __forceinline__ void store_widened(u32 tile, int row, int col, uint4 w) {
  constexpr int kPieceCols = kCopyBytes / static_cast<int>(sizeof(__half));  // columns of a 16-bit piece
  static_assert(kCopyBytes == 2 * kPieceCols, "16 bytes widen into two pieces");
  u32 out[8];
  e4m3x4_to_half2x2(w.x, out[0], out[1]);
  e4m3x4_to_half2x2(w.y, out[2], out[3]);
  e4m3x4_to_half2x2(w.z, out[4], out[5]);
  e4m3x4_to_half2x2(w.w, out[6], out[7]);
  const u32 lo = tile + Tile::chunk_offset(row, col / kPieceCols);
  const u32 hi = tile + Tile::chunk_offset(row, col / kPieceCols + 1);
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(lo), "r"(out[0]), "r"(out[1]), "r"(out[2]),
               "r"(out[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(hi), "r"(out[4]), "r"(out[5]), "r"(out[6]),
               "r"(out[7]) : "memory");
}

// A block's rows into the staging [BLOCK_N, kStagingRowBytes] (e4m3 bytes, unswizzled),
// zeros where nothing is read (cp.async's source size 0). The caller commits the group.
template <int BLOCK_N, int TILE_COLS>
__device__ __forceinline__ void stage_key_rows(u32 staging, const unsigned char* src, i64 page_stride,
                                               i64 row_stride, int cols, KeyRow mine, int lane, int warp) {
  using Copy = E4m3RowCopy<BLOCK_N, TILE_COLS>;
#pragma unroll 1
  for (int pass = 0; pass < Copy::kPasses; ++pass) {
    const KeyRow at = Copy::looked_up(mine, pass * Copy::kPassRows, lane);
    const int row = Copy::row(pass * Copy::kPassRows, lane, warp);
    const unsigned char* row_src = at.page == kNoKeyRow ? src : src + at.page * page_stride + at.slot * row_stride;
#pragma unroll
    for (int span = 0; span < Copy::kSpans; ++span) {
      const int col = Copy::template col<1>(span, lane);
      if (col < TILE_COLS) {
        const bool valid = at.page != kNoKeyRow && col < cols;
        cp_async_16(staging + row * Copy::kStagingRowBytes + col, valid ? row_src + col : src, valid);
      }
    }
  }
}

// This lane's pieces of the staging (its own copies, landed: cp.async.wait_group) widened
// into the fp16 tile [BLOCK_N, TILE_COLS] (Tile).
template <class Tile, int BLOCK_N, int TILE_COLS>
__device__ __forceinline__ void widen_staged_rows(u32 tile, u32 staging, int lane, int warp) {
  using Copy = E4m3RowCopy<BLOCK_N, TILE_COLS>;
#pragma unroll 2
  for (int pass = 0; pass < Copy::kPasses; ++pass) {
    const int row = Copy::row(pass * Copy::kPassRows, lane, warp);
#pragma unroll
    for (int span = 0; span < Copy::kSpans; ++span) {
      const int col = Copy::template col<1>(span, lane);
      if (col < TILE_COLS) {
        uint4 w;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(staging + row * Copy::kStagingRowBytes + col)
                     : "memory");
        store_widened<Tile>(tile, row, col, w);
      }
    }
  }
}

// KV_E4M3 (with PAGED, T = fp16): the pages hold e4m3 bytes with descales (FwdParams' k_scale,
// k_descale, v_scale, v_descale, per tensor or kv head), which the producer widens into fp16 tiles
// as it copies their rows (stage_key_rows, widen_staged_rows); k's descale folds into the score
// scale and v's multiplies the output, as in the FP8 kernel, and the GEMMs run in fp16 (a bf16 q
// too, its rows turned into fp16 once a tile, with a bf16 output: kQFromBf16).
template <typename T, typename TOut, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_N, int CONSUMERS, int STAGES,
          bool OVERLAP, bool PINGPONG, bool BOUNDED, bool ALIBI, bool PAGED, bool KV_E4M3 = false>
__global__ void __launch_bounds__(kWarpgroupThreads * (CONSUMERS + 1), 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdParams<T, TOut> p) {
  constexpr bool kFp8 = kIsE4m3<T>;
  using SmemOf = FwdSm90SmemOf<HEAD_DIM, HEAD_DIM_V, BLOCK_N, CONSUMERS, STAGES, sizeof(T), ALIBI, KV_E4M3>;
  constexpr int kAlibiPiece = SmemOf::kAlibiPiece;  // keys of a piece of ALiBi's k step
  constexpr bool kAlibiGemm = kAlibiPiece > 0;
  constexpr int kAlibiPieces = kAlibiGemm ? alibi_pieces(BLOCK_N, kAlibiPiece) : 1;
  // key blocks from the one holding the diagonal (the file's opening comment)
  constexpr bool kDiagFirst = BOUNDED || ALIBI;
  // e4m3 pages under a bf16 q run in fp16 (T = half, TOut = bf16; P too): the pages widen by one
  // conversion a byte pair (bf16 takes three through fp32) and each consumer turns its rows of Q
  // into fp16 once a tile (bf16x2_to_half2: exact in fp16's range, as decode does). On an H100 this
  // took bf16 q's prefill chunks over e4m3 pages 9-20% less time (BENCHMARKS.md, "Sixty-seventh
  // session"), where fp16 q was already 10-20% faster than bf16.
  constexpr bool kQFromBf16 = KV_E4M3 && IsSame<TOut, __nv_bfloat16>::value;  // T is fp16 (asserted below)
  using Smem = typename SmemOf::type;
  using QTile = typename Smem::QTile;
  using KTile = typename Smem::KTile;
  using VTile = typename Smem::VTile;
  using OTile = typename Smem::OTile;
  constexpr int BLOCK_M = Smem::BLOCK_M;
  // TMA boxes per tile: one per 128-byte row of columns (64 16-bit or 128 e4m3 elements), the
  // last one reaching past D where D is not a whole number of them
  constexpr int kBoxCols = kSwizzleRowBytes / static_cast<int>(sizeof(T));
  constexpr int kPanels = (HEAD_DIM + kBoxCols - 1) / kBoxCols;
  // V^T: boxes of 128 keys x Dv rows
  constexpr int kVPanels = kFp8 ? BLOCK_N / kBoxCols : (HEAD_DIM_V + kBoxCols - 1) / kBoxCols;
  using S = WgmmaRow<T, BLOCK_N>;   // 64 rows x BLOCK_N keys
  using O = WgmmaRow<T, HEAD_DIM_V>;  // 64 rows x Dv
  constexpr int kPSteps = BLOCK_N / O::kK;  // k steps of the PV GEMM
  using Tile = AttentionTile<TOut, 1, BLOCK_N / 8, HEAD_DIM_V / 8>;
  using Work = FwdSm90Work<BLOCK_M, BLOCK_N, FwdParams<T, TOut>, PAGED>;
  static_assert(sizeof(TOut) == 2 && (kFp8 || sizeof(T) == 2), "16-bit output; 16-bit or e4m3 inputs");
  static_assert(HEAD_DIM % S::kK == 0, "whole k steps of the S GEMM");
  static_assert(kFp8 || wgmma_row_panel_aligned(HEAD_DIM_V), "the PV GEMM's pieces start at V's panels");
  static_assert(!kFp8 || (HEAD_DIM % kBoxCols == 0 && HEAD_DIM_V == HEAD_DIM), "e4m3: whole panels, Dv = D");
  static_assert(!kFp8 || BLOCK_N % kBoxCols == 0, "V^T boxes of whole 128-key rows");
  static_assert(!kFp8 || BLOCK_N == kFp8ScaleBlockKeys, "a k scale block is one key block");
  static_assert(CONSUMERS == 2 || !PINGPONG, "pingpong takes turns between two warpgroups");
  static_assert(OVERLAP || BOUNDED, "without the overlap the softmax is the bounded one");
  static_assert(!(kFp8 && PAGED), "paged keys are 16-bit, or e4m3 widened to 16 bits (KV_E4M3)");
  static_assert(!KV_E4M3 || (PAGED && !kFp8), "e4m3 pages feed the 16-bit kernel's paged variant");
  static_assert(!KV_E4M3 || IsSame<T, __half>::value, "e4m3 pages widen to fp16, whatever q's type");
  // The registers the consumers take (consumer_registers, tma.cuh): 240 with two consumers, 160
  // with three; paged (kFwdSm90PagedProducerRegs) 224, 152.
  constexpr int kProducerRegs = PAGED ? kFwdSm90PagedProducerRegs : kFwdSm90ProducerRegs;
  constexpr int kConsumerRegs = consumer_registers(CONSUMERS, kProducerRegs);

  // Persistent grid: the producer picks the tiles (the file's opening comment) and runs ahead
  // into the next tile's loads while the consumers finish this one's epilogue. Tile indices are
  // int: B * H * ceil(Sq / BLOCK_M) is below 2^30 for any q that fits in a GPU's memory.
  const int m_blocks = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
  const int num_tiles = m_blocks * p.batch * p.num_heads;
  // TMA coordinates: dense rows are per batch slice, varlen rows are packed (batch coordinate 0)
  const bool varlen = p.cu_seqlens_q != nullptr;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 raw_addr = smem_address(smem_raw);
  const u32 smem0 = (raw_addr + kSwizzleAtomBytes - 1) & ~static_cast<u32>(kSwizzleAtomBytes - 1);
  unsigned char* base = smem_raw + (smem0 - raw_addr);
  const u32 sQ = smem0 + Smem::kQ;
  const auto sK = [&](int stage) { return smem0 + Smem::kK + stage * KTile::kBytes; };
  const auto sV = [&](int stage) { return smem0 + Smem::kV + stage * VTile::kBytes; };
  const u32 q_full = smem0 + Smem::kBarriers;
  const u32 q_empty = q_full + kMbarrierBytes;
  const auto k_full = [&](int stage) { return q_full + kMbarrierBytes * (2 + stage); };
  const auto v_full = [&](int stage) { return q_full + kMbarrierBytes * (2 + STAGES + stage); };
  const auto k_empty = [&](int stage) { return q_full + kMbarrierBytes * (2 + 2 * STAGES + stage); };
  const auto v_empty = [&](int stage) { return q_full + kMbarrierBytes * (2 + 3 * STAGES + stage); };
  const auto tile_full = [&](int slot) { return q_full + kMbarrierBytes * (2 + 4 * STAGES + slot); };
  const auto tile_empty = [&](int slot) {
    return q_full + kMbarrierBytes * (2 + 4 * STAGES + kFwdSm90TileRing + slot);
  };
  volatile int* tile_ring = reinterpret_cast<volatile int*>(base + Smem::kTileRing);  // [kFwdSm90TileRing]
  // Paged keys copied row by row (p.pages_by_copy; else TMA boxes of pages): every producer thread
  // arrives on K's and V's "full" barriers once its copies have landed (announce_copies).
  const bool copy_pages = PAGED && (KV_E4M3 || p.pages_by_copy != 0);
  // paged keys in boxes: each producer warp arms K's and V's barriers for its own boxes
  constexpr int kProducerWarps = kWarpgroupThreads / kWarpSize;
  const int full_arrivals = copy_pages ? kWarpgroupThreads : PAGED ? kProducerWarps : 1;

  const int wg = threadIdx.x / kWarpgroupThreads;
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&p.q_map);
    if (!copy_pages) {
      prefetch_tensor_map(&p.k_map);
      prefetch_tensor_map(&p.v_map);
    }
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, CONSUMERS * kWarpgroupThreads);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(k_full(s), full_arrivals);
      mbarrier_init(v_full(s), full_arrivals);
      mbarrier_init(k_empty(s), CONSUMERS * kWarpgroupThreads);
      mbarrier_init(v_empty(s), CONSUMERS * kWarpgroupThreads);
    }
    for (int s = 0; s < kFwdSm90TileRing; ++s) {
      mbarrier_init(tile_full(s), 1);
      mbarrier_init(tile_empty(s), CONSUMERS * kWarpgroupThreads);
    }
    fence_barrier_init();
  }
  if constexpr (kAlibiGemm) {
    // the key offsets' tile: row n (n, n, n, 1, 1, 1, 0, 0)
    for (int n = threadIdx.x; n < Smem::kAlibiRows; n += blockDim.x) {
      const float key = static_cast<float>(n);
      *reinterpret_cast<uint4*>(base + Smem::kAlibiKeys + n * kAlibiKeyRowBytes) =
          make_uint4(DType<T>::pack(key, key), DType<T>::pack(key, 1.f), DType<T>::pack(1.f, 1.f), 0u);
    }
    fence_proxy_async();  // the writes, visible to wgmma
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: thread 0 (the leader) streams each tile's Q, then K and V block by block
    // (in key_block's order): it takes and publishes the tiles, arms every barrier and issues the
    // loads of dense keys. Paged keys come one of two ways:
    //   TMA boxes of pages: each of the block's chunks (pages) has a thread of its own, round
    //     robin over the four warps, so a block's page lookups run in parallel and its TMAs issue
    //     from four schedulers. Both mattered: one lookup after another, and then one warp
    //     issuing a 16-token page's 32 boxes a block, each made the producer, not the tensor
    //     cores, the bottleneck;
    //   row copies (copy_pages): the whole warpgroup copies the block's rows in 16-byte pieces
    //     with cp.async (copy_key_rows), where no box takes the pages.
    // The dense producer's other threads only give their registers up.
    registers_decrease<kProducerRegs>();
    constexpr u32 kLanes = PAGED ? 0xffffffffu : 1u;  // the producer's lanes in each of its warps, as a mask
    const int producers = PAGED ? kWarpgroupThreads : 1;
    if (static_cast<int>(threadIdx.x) >= producers) return;
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const bool leader = threadIdx.x == 0;
    int loads = 0;  // K/V blocks loaded so far: the stage and phase of the next
    int tiles = 0;  // tiles started (and published) so far: the phase of Q's and the ring's barriers
    int* const counter = p.tile_counter;
    // the index after `tile` in this CTA's sequence (dynamic: the leader's take, past the first
    // wave; the other lanes read 0 and learn the result from the leader where it is used)
    const auto take = [&](int tile) {
      if (counter == nullptr) return tile + static_cast<int>(gridDim.x);
      return leader ? atomicAdd(counter, 1) + static_cast<int>(gridDim.x) : 0;
    };
    // A value of the leader's, for every producer thread (the dense producer is the leader alone:
    // no warp operations in its loop). Paged keys: the other threads read it from a hand-over
    // slot behind the producer's barrier; the slots alternate, so the leader's next write to one
    // comes after the next barrier, which everyone reaches only after reading it.
    int handovers = 0;
    volatile int* handover = reinterpret_cast<volatile int*>(base + Smem::kProducerSlots);  // [2]
    const auto from_leader = [&](int value) {
      if constexpr (PAGED) {
        volatile int* slot = handover + (handovers++ & 1);
        if (leader) *slot = value;
        named_barrier_sync(kFwdSm90ProducerBarrier, kWarpgroupThreads);
        value = *slot;
      }
      return value;
    };
    const auto publish = [&](int tile) {
      if (leader) {
        const int slot = tiles % kFwdSm90TileRing;
        mbarrier_wait(tile_empty(slot), ((tiles / kFwdSm90TileRing) & 1) ^ 1);
        tile_ring[slot] = tile;
        mbarrier_arrive(tile_full(slot));  // release: the consumers' wait sees the write
      }
    };
    // The leader arms `bar` for a tile's bytes before any copy into it can land; with paged keys
    // in boxes each warp's lane 0 arms K's and V's barriers for its warp's boxes (arm_warp: the
    // barrier expects one arrival per warp, and the bytes add up).
    const auto arm = [&](u32 bar, int bytes) {
      if (leader) mbarrier_arrive_expect_tx(bar, bytes);
      if constexpr (PAGED) __syncwarp(kLanes);
    };
    const auto arm_warp = [&](u32 bar, int bytes) {
      if (lane == 0) mbarrier_arrive_expect_tx(bar, bytes);
      __syncwarp(kLanes);
    };
    // Paged keys: key block [key0, key0 + BLOCK_N) of w's sequence comes in chunks of
    // min(block_size, BLOCK_N) rows (the host checks that one divides the other and that a chunk
    // is whole swizzle atoms: at most BLOCK_N / 8 chunks, fewer than the threads). Chunk `mine`
    // of the block is this thread's: it looks up the chunk's page (page_of, before the stage is
    // free, so the lookup's latency hides under the wait) and loads it with one TMA per panel at
    // (column, slot, kv head, page). A chunk past the sequence reads a page past the pool: the
    // TMA writes zeros and still counts the box's bytes. V's chunk holding the sequence's last
    // key comes row by row through v_row_map, the rows past the end from a slot past the page
    // (zeros): those slots may hold anything, NaN included, and P = 0 times NaN is NaN (K's stale
    // rows only reach masked scores, which the mask replaces).
    const int chunk = PAGED ? min(p.block_size, BLOCK_N) : BLOCK_N;
    struct PageChunk {
      int key, page, slot;  // page p.num_blocks: past the pool
    };
    // chunks go round robin over the warps
    const int mine = lane * kProducerWarps + warp;
    const int chunks = BLOCK_N / chunk;
    // warp wp's share of a K or V tile's bytes: its chunks' (every box counts, zeros included)
    const int warp_chunks = (chunks - warp + kProducerWarps - 1) / kProducerWarps;
    // the page (clamped into the pool) and slot of key `key` of w's sequence
    const auto locate = [&](const Work& w, int key) {
      const FastDivisor block_size{p.block_size, p.block_size_mul, p.block_size_shift};
      const int index = block_size.div(key);
      return KeyRow{clamp_page(__ldg(p.block_table + w.b * p.table_stride + index), p.num_blocks),
                    block_size.mod(key, index)};
    };
    const auto page_of = [&](const Work& w, int key0) {
      PageChunk c{key0 + mine * chunk, p.num_blocks, 0};
      if (mine < chunks && c.key < w.seq.seqlen_k) {
        const KeyRow at = locate(w, c.key);
        c.page = at.page;
        c.slot = at.slot;
      }
      return c;
    };
    const auto load_chunk = [&](u32 tile, int panel_bytes, int panels, const TensorMap* map, const PageChunk& c,
                                u32 bar, const Work& w, int h_kv, bool zero_tail) {
      if (mine >= chunks) return;
      const u32 dst = tile + mine * chunk * kSwizzleRowBytes;
      if (zero_tail && c.key < w.seq.seqlen_k && c.key + chunk > w.seq.seqlen_k) {
#pragma unroll 1
        for (int r = 0; r < chunk; ++r) {
          // slot block_size is past the page: a row of zeros
          const int row_slot = c.key + r < w.seq.seqlen_k ? c.slot + r : p.block_size;
#pragma unroll 1
          for (int panel = 0; panel < panels; ++panel)
            tma_load_4d(dst + panel * panel_bytes + r * kSwizzleRowBytes, &p.v_row_map, bar, panel * kBoxCols,
                        row_slot, h_kv, c.page);
        }
        return;
      }
#pragma unroll 1
      for (int panel = 0; panel < panels; ++panel)
        tma_load_4d(dst + panel * panel_bytes, map, bar, panel * kBoxCols, c.slot, h_kv, c.page);
    };
    // Row copies land through the generic proxy, and wgmma reads shared memory through the async
    // proxy: each producer thread waits until its copies but the last group (all of them: `all`)
    // have landed, fences the proxies and arrives on `full` (one arrival per thread). So K's
    // arrival waits for K's copies alone (V's are issued behind them), and V's comes when the next
    // block's K copies are issued (or at the tile's end), off the consumers' path.
    const auto announce_copies = [&](u32 full, bool all) {
      if (all) cp_async_wait<0>();
      else cp_async_wait<1>();
      fence_proxy_async();
      mbarrier_arrive(full);
    };
    // Row copies: lane l of warp wp looks up row wp R + l of the key block at key0 (R =
    // copy_warp_rows(BLOCK_N), the rows copy_key_rows gives a warp), before the stage is free.
    const auto row_of = [&](const Work& w, int key0) {
      const int key = key0 + warp * copy_warp_rows(BLOCK_N) + lane;
      return lane < copy_warp_rows(BLOCK_N) && key < w.seq.seqlen_k ? locate(w, key) : KeyRow{kNoKeyRow, 0};
    };
    // A tile order (dynamic, p.tile_order): the takes are positions in it, each read as the tile
    // listed there (kTileOrderEnd, past every tile, after the list); otherwise a take is the tile.
    // The order's address comes from the parameters at each take, not kept in registers: the
    // producer has kProducerRegs of them.
    const auto tile_at = [&](int position) {
      if (p.tile_counter == nullptr || p.tile_order == 0) return position;
      return p.tile_counter[kTileOrderHead + position];
    };
    int tile = tile_at(blockIdx.x);
    for (;;) {
      // skip the tiles past a varlen sequence's end here: they never reach the consumers
      while (tile < num_tiles && Work(p, tile, m_blocks).empty()) tile = from_leader(tile_at(take(tile)));
      if (tile >= num_tiles) break;
      const Work w(p, tile, m_blocks);
      publish(tile);
      // the next take now, its result used after this tile's loads: the atomic's round trip
      // runs under them
      const int next = take(tile);
      const int tma_b = varlen ? 0 : w.b;
      const int h_kv = w.h / (p.num_heads / p.num_kv_heads);
      // the consumers are done with the previous tile's Q
      mbarrier_wait(q_empty, (tiles & 1) ^ 1);
      arm(q_full, QTile::kBytes);
      if (leader) {
#pragma unroll
        for (int panel = 0; panel < kPanels; ++panel)
          tma_load_4d(sQ + panel * QTile::kPanelBytes, &p.q_map, q_full, panel * kBoxCols,
                      static_cast<int>(w.seq.q_start) + w.m0, w.h, tma_b);
      }
      ++tiles;
      // the first key of the i-th block visited
      const auto block_row = [&](int i) {
        return static_cast<int>(w.seq.k_start) + w.template key_block<kDiagFirst>(i) * BLOCK_N;
      };
      // e4m3 pages, staged: the rows of the block after the one being widened, looked up a block
      // before their copies (the table read's round trip under the widening)
      [[maybe_unused]] KeyRow ahead{kNoKeyRow, 0};
      for (int i = 0; i < w.blocks(); ++i, ++loads) {
        const int stage = loads % STAGES, parity = (loads / STAGES) & 1;
        const int row = static_cast<int>(w.seq.k_start) + w.template key_block<kDiagFirst>(i) * BLOCK_N;
        if constexpr (KV_E4M3) {
          const unsigned char* k_src = reinterpret_cast<const unsigned char*>(p.k) + h_kv * p.k_head_stride;
          const unsigned char* v_src = reinterpret_cast<const unsigned char*>(p.v) + h_kv * p.v_head_stride;
          // Block i's copies went out a block ahead (the tile's first block's here, K and V a
          // group each). Each tensor is widened once its group has landed, and the next block's
          // copies into the staging follow at once (a lane reads back only its own pieces), so
          // two commits a block, empty ones after the tile's last, keep the groups in step.
          const u32 k_staging = smem0 + Smem::kStaging, v_staging = smem0 + Smem::kStagingV;
          const auto stage_k = [&](KeyRow r) {
            stage_key_rows<BLOCK_N, HEAD_DIM>(k_staging, k_src, p.k_batch_stride, p.k_row_stride, p.head_dim, r,
                                              lane, warp);
          };
          const auto stage_v = [&](KeyRow r) {
            stage_key_rows<BLOCK_N, HEAD_DIM_V>(v_staging, v_src, p.v_batch_stride, p.v_row_stride, p.head_dim_v,
                                                r, lane, warp);
          };
          const bool more = i + 1 < w.blocks();
          if (i == 0) {
            const KeyRow r = row_of(w, row);
            stage_k(r);
            cp_async_commit();
            stage_v(r);
            cp_async_commit();
            if (more) ahead = row_of(w, block_row(1));
          }
          cp_async_wait<1>();  // block i's K has landed; its V may be in flight
          mbarrier_wait(k_empty(stage), parity ^ 1);
          widen_staged_rows<KTile, BLOCK_N, HEAD_DIM>(sK(stage), k_staging, lane, warp);
          fence_proxy_async();
          mbarrier_arrive(k_full(stage));
          if (more) stage_k(ahead);
          cp_async_commit();
          cp_async_wait<1>();  // block i's V has landed; the next block's K may be in flight
          mbarrier_wait(v_empty(stage), parity ^ 1);
          widen_staged_rows<VTile, BLOCK_N, HEAD_DIM_V>(sV(stage), v_staging, lane, warp);
          fence_proxy_async();
          mbarrier_arrive(v_full(stage));
          if (more) {
            stage_v(ahead);
            if (i + 2 < w.blocks()) ahead = row_of(w, block_row(i + 2));
          }
          cp_async_commit();
          continue;
        } else if constexpr (PAGED) {
          if (copy_pages) {
            // K's copies; the previous block's V announced once it has landed (below); V's copies;
            // this block's K announced once it has landed
            const KeyRow r = row_of(w, row);
            mbarrier_wait(k_empty(stage), parity ^ 1);
            copy_key_rows<KTile, BLOCK_N, HEAD_DIM>(sK(stage), p.k + h_kv * p.k_head_stride, p.k_batch_stride,
                                                   p.k_row_stride, p.head_dim, r, lane, warp);
            cp_async_commit();
            if (i > 0) announce_copies(v_full((loads - 1) % STAGES), false);
            mbarrier_wait(v_empty(stage), parity ^ 1);
            copy_key_rows<VTile, BLOCK_N, HEAD_DIM_V>(sV(stage), p.v + h_kv * p.v_head_stride, p.v_batch_stride,
                                                     p.v_row_stride, p.head_dim_v, r, lane, warp);
            cp_async_commit();
            announce_copies(k_full(stage), false);
            if (i == w.blocks() - 1) announce_copies(v_full(stage), true);
            continue;
          }
        }
        const PageChunk c = PAGED ? page_of(w, row) : PageChunk{};
        mbarrier_wait(k_empty(stage), parity ^ 1);
        if constexpr (PAGED) {
          arm_warp(k_full(stage), KTile::kBytes / chunks * warp_chunks);
          load_chunk(sK(stage), KTile::kPanelBytes, kPanels, &p.k_map, c, k_full(stage), w, h_kv, false);
        } else if (leader) {
          arm(k_full(stage), KTile::kBytes);
#pragma unroll
          for (int panel = 0; panel < kPanels; ++panel)
            tma_load_4d(sK(stage) + panel * KTile::kPanelBytes, &p.k_map, k_full(stage), panel * kBoxCols, row,
                        h_kv, tma_b);
        }
        mbarrier_wait(v_empty(stage), parity ^ 1);
        if constexpr (PAGED) {
          arm_warp(v_full(stage), VTile::kBytes / chunks * warp_chunks);
          load_chunk(sV(stage), VTile::kPanelBytes, kVPanels, &p.v_map, c, v_full(stage), w, h_kv, true);
        } else if (leader) {
          arm(v_full(stage), VTile::kBytes);
#pragma unroll
          for (int panel = 0; panel < kVPanels; ++panel) {
            if constexpr (kFp8) {
              // V^T [D rows, keys]: panel = 128 keys of all D rows (the key coordinate innermost)
              tma_load_4d(sV(stage) + panel * VTile::kPanelBytes, &p.v_map, v_full(stage), row + panel * kBoxCols, 0,
                          h_kv, tma_b);
            } else {
              tma_load_4d(sV(stage) + panel * VTile::kPanelBytes, &p.v_map, v_full(stage), panel * kBoxCols, row,
                          h_kv, tma_b);
            }
          }
        }
      }
      // a listed tile is read once this tile's loads are issued: its latency, like the take's,
      // runs under the consumers' last blocks (a take a tile ahead, measured, hid it on tiles of
      // few key blocks but cost the dense calls 1%: FWD_SM90_TILE_ORDER_MIN_KEYS keeps the order
      // to long keys instead)
      tile = from_leader(tile_at(next));
    }
    publish(kFwdSm90NoTile);
    if (leader && counter != nullptr) {
      // this CTA's last take is done; the last CTA to get here resets the counters for the next
      // launch (no CTA of this one reads them again)
      __threadfence();
      if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        atomicExch(counter, 0);
        atomicExch(counter + 1, 0);
      }
    }
    return;
  }

  // ---- consumers: warpgroup c owns query rows [m0 + 64 c, m0 + 64 c + 64) of each tile
  registers_increase<kConsumerRegs>();
  // Without ping-pong (whose turns pair the warpgroups' blocks) a warpgroup leaves out the blocks
  // none of its stored rows sees (Work::drop_unseen), except with ALiBi beside the overlap, where
  // the dropping spilled (D = 256). The number of blocks it drops depends on c, so c comes through
  // a shuffle there, which the compiler knows to be the same across the warp: the K/V stage
  // counter then stays in uniform registers (as computed from wg, it took some 10 more registers
  // a thread, and the three-warpgroup tiles spilled 20-100 bytes). The shuffle also made the
  // e4m3 ping-pong tile (D = 256) 2-3% faster, and the 16-bit ones (D = 128) 1-3% slower, which
  // keep c from wg (BENCHMARKS.md, twenty-second session).
  constexpr bool kDropUnseen = !PINGPONG && !(OVERLAP && ALIBI);
  const int c = kDropUnseen || kFp8 ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
  const int tid = threadIdx.x - wg * kWarpgroupThreads;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;

  // Pingpong: consumer c issues its GEMMs after the other's turn ends. In each tile with key
  // blocks consumer 1 lets 0 go first and skips its last pass, so every turn waited for is passed
  // exactly once; a tile without key blocks takes no turn.
  const int other = 1 - c;
  const auto open_turns = [&] {
    if (PINGPONG && c == 1) named_barrier_arrive(kFwdSm90TurnBarrier + other, 2 * kWarpgroupThreads);
  };
  const auto take_turn = [&] {
    if (PINGPONG) named_barrier_sync(kFwdSm90TurnBarrier + c, 2 * kWarpgroupThreads);
  };
  const auto pass_turn = [&](bool closing) {
    if (PINGPONG && !(closing && c == 1)) named_barrier_arrive(kFwdSm90TurnBarrier + other, 2 * kWarpgroupThreads);
  };

  constexpr int kWarpRows = kWgmmaM / kWarpsPerWarpgroup;  // a warp's query rows
  // a word a piece of the k step
  struct AlibiWords {
    u32 piece[kAlibiPieces];
  };
  // What one tile's softmax and epilogue read: its work, descales and mask.
  struct TileContext {
    Work w;
    int wg_m0;  // this warpgroup's first query row
    float v_descale, softmax_scale, alibi;
    const float* k_block_scale;
    MaskParams mp;
    bool alibi_gemm;  // kAlibiGemm: the slope fits T and no softcap comes between (add to the capped score)
    AlibiWords alibi_word;  // kAlibiGemm: this lane's A words of the extra k step for +slope (alibi_a)
    // ALIBI: the key blocks whose first key lies in [diag_first_key, diag_last_key] hold one of
    // this warp's diagonals (holds_warp_diagonal)
    int diag_first_key, diag_last_key;
    // kAlibiGemm: a key block whose first key is at most alibi_left_key lies wholly left of this
    // warp's diagonals, one whose first key is at least alibi_right_key wholly right (alibi_side)
    int alibi_left_key, alibi_right_key;
  };
  int loads = 0;  // K/V blocks consumed so far, as the producer counts them
  int tiles = 0;  // tiles taken from the ring so far
  // the next tile index from the ring (kFwdSm90NoTile: no more)
  const auto take_tile = [&] {
    const int slot = tiles % kFwdSm90TileRing;
    mbarrier_wait(tile_full(slot), (tiles / kFwdSm90TileRing) & 1);
    const int index = tile_ring[slot];
    mbarrier_arrive(tile_empty(slot));
    return index;
  };
  // the context of tile `tile_index`
  const auto context_of = [&](int tile_index) {
    Work w(p, tile_index, m_blocks);
    const int wg_m0 = w.m0 + c * kWgmmaM;
    // FP8 descales (1 for 16-bit inputs): q's and a per-tensor or per-head k's fold into the score
    // scale; a block-quantised k's multiplies each block's raw scores (k_block_scale). e4m3 pages
    // (KV_E4M3) come with per-tensor or per-kv-head k and v descales alone (no q scale, no k blocks)
    float qk_descale = 1.f, v_descale = 1.f;
    const float* k_block_scale = nullptr;
    if constexpr (kFp8 || KV_E4M3) {
      const int h_kv = w.h / (p.num_heads / p.num_kv_heads);
      qk_descale = p.q_descale * p.k_descale;
      // this warpgroup's block of q rows; a warpgroup wholly past the last row (its rows are
      // never stored) reads the last block's scale rather than past the array
      const int q_block = min(wg_m0, w.seq.seqlen_q - 1) / kWgmmaM;
      if (p.q_scale != nullptr)
        qk_descale *= p.q_scale[w.b * p.q_scale_batch_stride + w.h * p.q_scale_head_stride +
                                q_block * p.q_scale_block_stride];
      if (p.k_scale != nullptr) {
        const float* k_scale = p.k_scale + w.b * p.k_scale_batch_stride + h_kv * p.k_scale_head_stride;
        if (p.k_scale_block_stride != 0) k_block_scale = k_scale;
        else qk_descale *= *k_scale;
      }
      v_descale = p.v_descale * (p.v_scale != nullptr ? p.v_scale[h_kv * p.v_scale_head_stride] : 1.f);
    }
    const MaskParams mp{w.seq.seqlen_k, p.window_left, p.window_right, p.score_scale * qk_descale, p.softcap_out};
    const float softmax_scale = mp.softmax_scale();
    // this head's ALiBi slope in the units of the scores add_alibi sees
    const float alibi =
        ALIBI ? alibi_score_slope(p.alibi_slopes, p.alibi_batch_stride, w.b, w.h, softmax_scale) : 0.f;
    bool alibi_gemm = false;
    AlibiWords alibi_word{};
    // a block's keys [n0, n0 + BLOCK_N) lie left of the diagonals [d, d + kWarpRows) of this
    // warp's rows when n0 <= d - (BLOCK_N - 1), right of them when n0 >= d + kWarpRows - 1, and
    // hold one of them in between (both bounds included: a block that ends at the first diagonal
    // holds it and lies left of every row)
    const int d_first = wg_m0 + warp * kWarpRows + w.seq.offset;
    const int diag_first_key = d_first - (BLOCK_N - 1), diag_last_key = d_first + kWarpRows - 1;
    // no block on either side: every block adds the bias per score
    int alibi_left_key = -kAlibiPastKeys, alibi_right_key = kAlibiPastKeys;
    if constexpr (kAlibiGemm) {
      // the slope as hi + mid + lo in T (exact to fp32's precision), and for the piece at offset
      // o those times o: lane t = 0 holds k columns 0, 1 of its rows (hi, mid), lane t = 1
      // columns 2, 3 (lo, o hi), lane t = 2 columns 4, 5 (o mid, o lo), lane 3 zeros
      using DT = DType<T>;
      const float hi = DT::to_float(DT::from_float(alibi));
      const float mid = DT::to_float(DT::from_float(alibi - hi));
      const float lo = alibi - hi - mid;
      constexpr float kLastOffset = (kAlibiPieces - 1) * kAlibiPiece;
      alibi_gemm = mp.softcap_out == 0.f && isfinite(DT::to_float(DT::from_float(kLastOffset * hi)));
      const int t = lane % 4;
#pragma unroll
      for (int piece = 0; piece < kAlibiPieces; ++piece) {
        const float o = static_cast<float>(piece * kAlibiPiece);
        alibi_word.piece[piece] = t == 0   ? DT::pack(hi, mid)
                                  : t == 1 ? DT::pack(lo, o * hi)
                                  : t == 2 ? DT::pack(o * mid, o * lo)
                                           : 0u;
      }
      // Under a causal mask (a right window edge at the diagonal) every visible key lies left of
      // its row's diagonal, so every block takes the left side's linear bias, those that hold one
      // of the warp's diagonals too (the mask replaces the scores right of them)
      const bool keys_left_only = p.window_right <= 0;
      if (alibi_gemm) {
        alibi_left_key = keys_left_only ? kAlibiPastKeys : diag_first_key;
        alibi_right_key = keys_left_only ? kAlibiPastKeys : diag_last_key;
      }
    }
    return TileContext{w,          wg_m0,      v_descale,  softmax_scale,  alibi,         k_block_scale,  mp,
                       alibi_gemm, alibi_word, diag_first_key, diag_last_key, alibi_left_key, alibi_right_key};
  };

  Tile tile;
  float (&s_acc)[S::kAccumulators] = reinterpret_cast<float (&)[S::kAccumulators]>(tile.s);
  float (&o_acc)[O::kAccumulators] = reinterpret_cast<float (&)[O::kAccumulators]>(tile.o);
  // P as wgmma A fragments (k step j: keys 16 j .. 16 j + 15, or 32 j .. 32 j + 31 in e4m3)
  u32 pa[kPSteps][4];

  // the stage and phase of K/V block `load` (counted over the CTA's tiles)
  const auto stage_at = [](int load) { return load % STAGES; };
  const auto parity_at = [](int load) { return (load / STAGES) & 1; };
  // ALiBi through the S GEMM (kAlibiGemm): the A operand of the extra k step, [64 rows, 16] a
  // piece (wgmma.cuh's A layout: a[0] row g, a[1] row g + 8, columns 2 t, 2 t + 1; a[2], a[3]
  // columns 8-15, zero). Where every row of this warp lies on one side of block i's keys, the bias
  // -slope |d - j| of row diagonal d and key j = n0 + k is linear in k:
  //   left  (d >= every j):  slope k - slope (d - n0)
  //   right (d <= every j): -slope k + slope (d - n0)
  // so the warp's rows take sigma = +slope or -slope (the sign bits of the slope's words), and
  // prepare_scores adds only each row's rest, -sigma (d - n0) (row_bias). A warp whose rows cross
  // block i's keys gives zeros and adds the bias per score (AttentionTile::add_alibi).
  u32 alibi_a[kAlibiPieces][4] = {};
  constexpr u32 kSignBits16x2 = 0x80008000u;  // the sign bits of a word's two 16-bit values
  // the first key of the block visited i-th
  const auto block_first_key = [&](const TileContext& x, int i) { return x.w.template key_block<kDiagFirst>(i) * BLOCK_N; };
  // this warp's side of block i: 1 left, -1 right, 0 crossing (or no GEMM bias in this tile).
  // Two comparisons with the tile's bounds (TileContext::alibi_left_key; never both true).
  const auto alibi_side = [&](const TileContext& x, int i) -> int {
    if constexpr (kAlibiGemm) {
      const int n0 = block_first_key(x, i);
      return n0 <= x.alibi_left_key ? 1 : n0 >= x.alibi_right_key ? -1 : 0;
    }
    return 0;
  };
  // ALiBi in the BOUNDED softmax: whether block i holds the diagonal of one of this warp's rows.
  // A steep head's row max lies at its diagonal, and the tile's first block (the last row's
  // diagonal block) lies right of the diagonals of the rows a block or more before it, so their
  // scores rise past its max in the block visited next: such a warp finds that block's max first
  // (the exact path: a max and a rescale of O) rather than exponentiating against the old max and
  // having the whole warpgroup compute the block again. On the H200 (bf16, 1k keys, no mask) that
  // took ALiBi's cost over the plain call from 13% to 9% at D = 80 and from 10% to 7% at D = 96,
  // and made the three-warpgroup tile D = 128's best with ALiBi too.
  const auto holds_warp_diagonal = [&](const TileContext& x, int i) -> bool {
    if constexpr (ALIBI) {
      const int n0 = block_first_key(x, i);
      return n0 >= x.diag_first_key && n0 <= x.diag_last_key;
    }
    return false;
  };
  // before the fence ahead of a block's S GEMM: its A words for this warp's side of it
  // (alibi_side), pinned there
  const auto set_alibi_a = [&](const TileContext& x, int side) {
    if constexpr (kAlibiGemm) {
#pragma unroll
      for (int piece = 0; piece < kAlibiPieces; ++piece) {
        const u32 word = x.alibi_word.piece[piece];
        alibi_a[piece][0] = alibi_a[piece][1] = side == 0 ? 0u : side > 0 ? word : word ^ kSignBits16x2;
      }
      fence_registers(alibi_a);
    }
  };
  const auto issue_s = [&](int stage) {
    // the first k step overwrites the accumulators: their old values are dead here. ALiBi's
    // step comes first, so that its pieces (wgmma on parts of the accumulators) open the chain:
    // after the full-width steps they serialised every wgmma of the tile (ptxas C7511)
    forget_registers(s_acc);
    if constexpr (kAlibiGemm) AlibiKeyStep<T, BLOCK_N, kAlibiPiece>::rs(s_acc, alibi_a, smem0 + Smem::kAlibiKeys, 0);
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / S::kK; ++ks)
      S::template ss<0, 0>(s_acc, kmajor_descriptor<QTile>(sQ, c * kWgmmaM, ks),
                           [&](int key) { return kmajor_descriptor<KTile>(sK(stage), key, ks); }, kAlibiGemm || ks > 0);
    wgmma_commit();
  };
  const auto issue_pv = [&](int stage) {
#pragma unroll
    for (int ks = 0; ks < kPSteps; ++ks) {
      if constexpr (kFp8) {
        O::template rs<0>(o_acc, pa[ks], [&](int col) { return kmajor_descriptor<VTile>(sV(stage), col, ks); }, 1);
      } else {
        O::template rs<1>(o_acc, pa[ks], [&](int col) { return mnmajor_descriptor<VTile>(sV(stage), col, ks); }, 1);
      }
    }
    wgmma_commit();
  };
  // block i's scores (key block key_block<kDiagFirst>(i)) ready for the softmax: a block-quantised
  // k's descale, the mask, ALiBi's bias (row_bias: each row's offset, 0 without ALiBi, where it
  // folds away; `side`: this warp's side of the block, alibi_side's, which the callers work out
  // before the GEMM rather than again behind the opaque i after it)
  const auto prepare_scores = [&](const TileContext& x, int i, int side, float (&row_bias)[1][2]) {
    const int n = x.w.template key_block<kDiagFirst>(i);
    const int n0 = n * BLOCK_N;
    if (kFp8 && x.k_block_scale != nullptr) {
      const float k_descale = x.k_block_scale[n * p.k_scale_block_stride];
#pragma unroll
      for (int e = 0; e < S::kAccumulators; ++e) s_acc[e] *= k_descale;
    }
    const int diag0 = x.wg_m0 + warp * 16 + lane / 4 + x.w.seq.offset;  // this lane's first row's diagonal
    const auto diag_of = [=](int, int r) { return diag0 + 8 * r; };
    if (x.w.seq.template block_needs_mask<BLOCK_N>(x.wg_m0, kWgmmaM, n0, p.window_left, p.window_right)) {
      tile.template cap_and_mask<true>(x.mp, diag_of, n0, lane);
    } else {
      tile.template cap_and_mask<false>(x.mp, diag_of, n0, lane);
    }
    row_bias[0][0] = row_bias[0][1] = 0.f;
    const float slope = x.alibi;
    if constexpr (ALIBI) {
      if (side != 0) {
        const float sigma = side > 0 ? slope : -slope;
        row_bias[0][0] = -sigma * static_cast<float>(diag_of(0, 0) - n0);
        row_bias[0][1] = -sigma * static_cast<float>(diag_of(0, 1) - n0);
      } else {
        tile.add_alibi(diag_of, [=](int, int) { return slope; }, n0, lane, row_bias);
      }
    }
  };
  // the softmax of block i while the previous block's PV GEMM still runs (OVERLAP), the lazy max
  // (no BOUNDED, and block 0): probabilities into the scores' registers; returns whether the
  // output must be rescaled by `factor` (the caller does it once no GEMM adds into it) before
  // to_fragments
  const auto softmax = [&](const TileContext& x, int i, int side, float (&factor)[1][2]) {
    float row_bias[1][2];
    prepare_scores(x, i, side, row_bias);
    const bool moved = tile.move_max(x.softmax_scale, factor, row_bias);
    tile.exponentiate(x.softmax_scale, row_bias);
    return moved;
  };
  // OVERLAP with BOUNDED: block i's probabilities against the rows' running max as it stands,
  // into the scores' registers while the previous PV GEMM reads P's, each row's sums into
  // row_sums (not yet l). Returns whether this warp's sums keep the probabilities within the
  // lazy bound (AttentionTile::softmax_to_fragments' test); a warp with a row that has seen no
  // key moves its max at once (`moved`: rescale the output by `factor` once PV is done).
  const auto softmax_bounded = [&](const TileContext& x, int i, int side, float (&factor)[1][2],
                                   float (&row_sums)[1][2], bool& moved) {
    float row_bias[1][2];
    prepare_scores(x, i, side, row_bias);
    moved = tile.any_row_empty();
    if constexpr (ALIBI) moved = moved || holds_warp_diagonal(x, i);
    if (moved) tile.move_max_now(x.softmax_scale, factor, row_bias);
    tile.exponentiate(x.softmax_scale, row_bias, row_sums);
    return moved || Tile::sums_within_bound(row_sums);
  };
  const auto to_fragments = [&] {
    if constexpr (kFp8) {
      tile.to_e4m3_fragments(pa);
    } else {
      u32(&frag)[1][kPSteps][4] = reinterpret_cast<u32(&)[1][kPSteps][4]>(pa);
      tile.template to_fragments<T>(frag);  // P in the GEMMs' type (TOut's but under kQFromBf16)
    }
  };
  // the softmax of block i when no GEMM runs (no OVERLAP, always BOUNDED): straight into P's
  // fragments, the row max found only where the sums ask for it
  // (AttentionTile::softmax_to_fragments: false when the scores must be computed again for its
  // exact path)
  const auto softmax_to_fragments = [&](const TileContext& x, int i, int side, bool exact,
                                        float(&row_sums)[1][2]) {
    float row_bias[1][2];
    prepare_scores(x, i, side, row_bias);
    const auto pack = [&](const float(&ref)[1][2], float(&sums)[1][2]) {
      const auto probs = tile.probs_of(x.softmax_scale, ref, sums);
      if constexpr (kFp8) {
        Tile::e4m3_fragments_of(pa, probs);
      } else {
        Tile::template fragments_of<T>(reinterpret_cast<u32(&)[1][kPSteps][4]>(pa), probs);
      }
    };
    return tile.softmax_to_fragments(x.softmax_scale, row_bias, pack, exact, row_sums);
  };
  // the tile's last S GEMM has finished: Q may be refilled with the next tile's (unless the
  // epilogue still stages O there)
  const auto release_q = [&] {
    if (Smem::kOwnO) mbarrier_arrive(q_empty);
  };
  // block i's S GEMM again, outside the turns, for the bounded softmax's exact path (rare)
  const auto recompute_s = [&](const TileContext& x, int i, int side) {
    set_alibi_a(x, side);
    wgmma_fence();
    issue_s(stage_at(loads + i));
    wgmma_wait<0>();
    fence_registers(s_acc);
  };
  // K/V block `load`'s PV GEMM with nothing beside it, in its turn (`closing`: the tile's last)
  const auto pv_alone = [&](int load, bool closing) {
    mbarrier_wait(v_full(stage_at(load)), parity_at(load));
    take_turn();
    wgmma_fence(o_acc, pa);
    issue_pv(stage_at(load));
    pass_turn(closing);
    wgmma_wait<0>();
    fence_registers(o_acc);
    fence_registers(pa);
    mbarrier_arrive(v_empty(stage_at(load)));
  };
  // OVERLAP: block 0's S GEMM alone (its first turn opens a segment) and its softmax
  const auto first_block = [&](const TileContext& x) {
    const int blocks = x.w.blocks();
    float factor[1][2];
    mbarrier_wait(k_full(stage_at(loads)), parity_at(loads));
    open_turns();
    const int side = alibi_side(x, 0);
    set_alibi_a(x, side);
    take_turn();
    wgmma_fence();
    issue_s(stage_at(loads));
    pass_turn(false);
    wgmma_wait<0>();
    fence_registers(s_acc);
    mbarrier_arrive(k_empty(stage_at(loads)));
    if (blocks == 1) release_q();
    if (softmax(x, 0, side, factor)) tile.rescale_output(factor);
    to_fragments();
  };
  // OVERLAP: blocks 1 .. blocks - 1, block i's S with block i-1's PV and block i's softmax under
  // PV; the last block's PV is left to the caller
  const auto overlapped_blocks = [&](const TileContext& x) {
    const int blocks = x.w.blocks();
    float factor[1][2];
    for (int i = 1; i < blocks; ++i) {
      const int load = loads + i;
      mbarrier_wait(k_full(stage_at(load)), parity_at(load));
      mbarrier_wait(v_full(stage_at(load - 1)), parity_at(load - 1));
      const int side = alibi_side(x, i);
      set_alibi_a(x, side);
      take_turn();
      wgmma_fence(o_acc, pa);
      issue_s(stage_at(load));
      issue_pv(stage_at(load - 1));
      pass_turn(false);
      wgmma_wait<1>();
      fence_registers(s_acc);
      // K and Q stay until the bounded softmax knows it will not compute S again
      const auto release_k = [&] {
        mbarrier_arrive(k_empty(stage_at(load)));
        if (i == blocks - 1) release_q();
      };
      if (!BOUNDED) release_k();
      float row_sums[1][2];
      bool moved;
      const bool within = BOUNDED ? softmax_bounded(x, i, side, factor, row_sums, moved) : (moved = softmax(x, i, side, factor));
      wgmma_wait<0>();
      fence_registers(o_acc);
      fence_registers(pa);
      mbarrier_arrive(v_empty(stage_at(load - 1)));
      if (moved) tile.rescale_output(factor);
      if constexpr (BOUNDED) {
        // a row's max grew past the bound somewhere in the warpgroup, which issues its GEMMs
        // together: all four warps compute block i again and move every row's max to it.
        // i opaque: the mask's per-column tests of the first pass are not kept live for this one
        if (named_barrier_any(kFwdSm90ConsumerBarrier + c, kWarpgroupThreads, !within)) {
          recompute_s(x, i, side);
          float row_bias[1][2];
          prepare_scores(x, opaque(i), side, row_bias);
          tile.move_max_now(x.softmax_scale, factor, row_bias);
          tile.rescale_output(factor);
          tile.exponentiate(x.softmax_scale, row_bias, row_sums);
        }
        tile.add_row_sums(row_sums);
        release_k();
      }
      to_fragments();
    }
  };
  // no OVERLAP: every block's S, softmax and PV in turn; the last PV closes the segment
  const auto plain_blocks = [&](const TileContext& x) {
    const int blocks = x.w.blocks();
    open_turns();
    for (int i = 0; i < blocks; ++i) {
      const int load = loads + i;
      mbarrier_wait(k_full(stage_at(load)), parity_at(load));
      // this warp's side of block i for the k step, once for both of the softmax's passes and
      // before the GEMM (computed again behind the opaque i after it, it cost D = 64 about 20
      // instructions a warp a block)
      const int side = alibi_side(x, i);
      // block i's S, a second time (outside the turns) where a warp's softmax asks for its exact
      // path: the warpgroup issues its GEMMs together, so all four warps vote, and all go again
      for (bool exact = false;; exact = true) {
        set_alibi_a(x, side);
        if (!exact) take_turn();
        wgmma_fence();
        issue_s(stage_at(load));
        if (!exact) pass_turn(false);
        wgmma_wait<0>();
        fence_registers(s_acc);
        // i opaque: left to itself the compiler hoists the mask's per-column tests (invariant in
        // this loop) ahead of the GEMM, where every block paid for them
        float row_sums[1][2];
        bool max_first = exact;
        if constexpr (ALIBI) max_first = max_first || holds_warp_diagonal(x, i);
        const bool done = softmax_to_fragments(x, opaque(i), side, max_first, row_sums);
        if (!named_barrier_any(kFwdSm90ConsumerBarrier + c, kWarpgroupThreads, !done)) {
          tile.add_row_sums(row_sums);
          break;
        }
      }
      // Q and the stage's K are released after the softmax, which may read them again
      mbarrier_arrive(k_empty(stage_at(load)));
      if (i == blocks - 1) release_q();
      pv_alone(load, i == blocks - 1);
    }
  };
  // ---- epilogue of tile x: normalise, stage this warpgroup's 64 rows in its rows of the O tile,
  // then store them. The barrier first: the warpgroup's stores of the previous tile still read
  // those rows. Two ways out of shared memory:
  //   o_by_tma (p.o_by_tma: an out the TMA can write, dense or packed; O in a tile of its own):
  //     every thread fences its staging writes for the async proxy, and after the warpgroup's
  //     barrier thread 0 stores one [64 rows, 64 columns] box per panel through o_map, as one bulk
  //     group; rows past the array and columns past Dv lie outside the map and are not written.
  //     Packed rows (varlen, paged) past a sequence are the next one's, inside the map: there a
  //     warpgroup whose rows cross its sequence's end takes the other way. The next epilogue
  //     waits until the group has read the rows, the kernel's end until it has written them.
  //   otherwise 16-byte stores of whole rows by every thread, those past the sequence or Dv
  //     skipped.
  const bool o_by_tma = Smem::kOwnO && p.o_by_tma != 0;
  constexpr int kOPanels = panel_cols(HEAD_DIM_V) / kSwizzlePanelCols;
  constexpr int kOBoxCols = kSwizzleRowBytes / static_cast<int>(sizeof(TOut));
  const auto epilogue = [&](const TileContext& x) {
    const Work& w = x.w;
    if (o_by_tma && tid == 0) bulk_wait_read<0>();
    named_barrier_sync(kFwdSm90ConsumerBarrier + c, kWarpgroupThreads);
    const int g = lane / 4, t = lane % 4;
    const i64 lse_base = w.b * p.lse_batch_stride + w.h * p.lse_head_stride + w.seq.q_start;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      SoftmaxState& st = tile.state[0][r];
      st.l = quad_sum(st.l);  // the lanes' partial sums make the row's total
      const float sink_factor = p.sinks != nullptr ? st.add_sink(p.sinks[w.h] * kLog2e) : 1.f;
      const float inv = st.inv_sum() * sink_factor * x.v_descale;
      const int row = c * kWgmmaM + warp * 16 + g + 8 * r;  // row within the tile
#pragma unroll
      for (int dt = 0; dt < HEAD_DIM_V / 8; ++dt) {
        const u32 packed = DType<TOut>::pack(tile.o[0][dt][2 * r] * inv, tile.o[0][dt][2 * r + 1] * inv);
        *reinterpret_cast<u32*>(base + Smem::kO + OTile::offset(row, dt * 8 + 2 * t)) = packed;
      }
      if (p.lse != nullptr && t == 0 && w.stores(row)) p.lse[lse_base + w.m0 + row] = st.lse();
    }
    // Dense rows past Sq lie outside the map, and a shifted first tile's rows past m_end are the
    // next tile's, whole warpgroups: the TMA takes any dense warpgroup. Packed rows past a
    // sequence belong to the next one: there only a warpgroup whose 64 rows all lie inside its
    // sequence stores through the TMA (every one but a sequence's last, partial one).
    if (o_by_tma) fence_proxy_async();
    named_barrier_sync(kFwdSm90ConsumerBarrier + c, kWarpgroupThreads);
    if (o_by_tma && (!varlen || w.stores(c * kWgmmaM + kWgmmaM - 1))) {
      if (tid == 0) {
        const u32 rows = smem0 + Smem::kO + c * kWgmmaM * kSwizzleRowBytes;
        if (w.stores(c * kWgmmaM)) {
#pragma unroll
          for (int panel = 0; panel < kOPanels; ++panel)
            tma_store_4d(&p.o_map, rows + panel * OTile::kPanelBytes, panel * kOBoxCols,
                         static_cast<int>(w.seq.q_start) + x.wg_m0, w.h, varlen ? 0 : w.b);
        }
        bulk_commit();
      }
      return;
    }
    // whole 16-byte chunks of the tile's rows; those past the call's Dv are padding
    constexpr int kChunksPerRow = HEAD_DIM_V * sizeof(TOut) / kCopyBytes;
    const int chunks = p.head_dim_v * static_cast<int>(sizeof(TOut)) / kCopyBytes;
    TOut* o_ptr =
        p.out + w.b * p.o_batch_stride + (w.seq.q_start + x.wg_m0) * p.o_row_stride + w.h * p.o_head_stride;
#pragma unroll
    for (int idx = tid; idx < kWgmmaM * kChunksPerRow; idx += kWarpgroupThreads) {
      const int row = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
      if (w.stores(c * kWgmmaM + row) && chunk < chunks) {
        *reinterpret_cast<uint4*>(o_ptr + row * p.o_row_stride + chunk * (kCopyBytes / sizeof(TOut))) =
            *reinterpret_cast<const uint4*>(base + Smem::kO + OTile::chunk_offset(c * kWgmmaM + row, chunk));
      }
    }
    if (!Smem::kOwnO) mbarrier_arrive(q_empty);  // O was staged in Q's tile: read out now
  };

  // the key blocks from `loads` to `end`, which this warpgroup leaves out: it releases their
  // stages once they have landed (a stage's "empty" barrier then counts its arrivals toward the
  // producer's current fill of it, not the next)
  const auto skip_blocks = [&](int end) {
#pragma unroll 1
    for (; loads < end; ++loads) {
      const int stage = stage_at(loads), parity = parity_at(loads);
      mbarrier_wait(k_full(stage), parity);
      mbarrier_arrive(k_empty(stage));
      mbarrier_wait(v_full(stage), parity);
      mbarrier_arrive(v_empty(stage));
    }
  };

  for (int index = take_tile(); index != kFwdSm90NoTile; index = take_tile()) {
    TileContext x = context_of(index);
    // the blocks none of this warpgroup's stored rows sees (kDropUnseen, above)
    if constexpr (kDropUnseen)
      skip_blocks(loads + x.w.template drop_unseen<kDiagFirst>(c * kWgmmaM, p.window_right));
    const int blocks = x.w.blocks();
    mbarrier_wait(q_full, tiles & 1);
    if constexpr (kQFromBf16) {
      // bf16 q over e4m3 pages runs the fp16 GEMMs: this warpgroup's rows of Q [64, D] turn
      // into fp16 in place (each 16-byte piece on its own: the swizzle moves whole pieces)
      constexpr int kChunks = Smem::kRowCols / (kCopyBytes / static_cast<int>(sizeof(T)));  // of a row
#pragma unroll 4
      for (int idx = tid; idx < kWgmmaM * kChunks; idx += kWarpgroupThreads) {
        const u32 at = sQ + QTile::chunk_offset(c * kWgmmaM + idx / kChunks, idx % kChunks);
        u32 w[4];
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(at) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(bf16x2_to_half2(w[0])),
                     "r"(bf16x2_to_half2(w[1])), "r"(bf16x2_to_half2(w[2])), "r"(bf16x2_to_half2(w[3])) : "memory");
      }
      fence_proxy_async();  // the stores, visible to wgmma
      named_barrier_sync(kFwdSm90ConsumerBarrier + c, kWarpgroupThreads);
    }
    ++tiles;
    tile.init();
    if (blocks == 0) {
      release_q();
    } else if (OVERLAP) {
      first_block(x);
      overlapped_blocks(x);
      // the last block's PV closes the segment
      pv_alone(loads + blocks - 1, true);
    } else {
      plain_blocks(x);
    }
    loads += blocks;
    epilogue(x);
  }
  if (o_by_tma && tid == 0) bulk_wait<0>();  // the last O stores are written before the CTA exits
}

// ---- V^T for the FP8 kernel: v [B, Sk, Hk, D] e4m3 bytes (row strides in bytes) -> vt [B, Hk, D,
// padded] (contiguous, padded = Sk rounded up to a thread's span of GROUPS x kFp8KeyGroup keys),
// the keys of each group of kFp8KeyGroup in the order pi of AttentionTile::to_e4m3_fragments:
// position 4 t + 2 h + e holds key 8 h + 2 t + e, keys past Sk read 0. A thread takes BYTES
// head-dim bytes (a chunk) of one span: one BYTES-wide load per key, 4 x 4 byte transposes in
// registers (eight byte permutes per four words of V^T), and per head-dim row one piece of the
// span's bytes. A warp is LANES_D consecutive chunks x kWarpSize / LANES_D consecutive spans, so
// each load covers LANES_D x BYTES contiguous bytes of kWarpSize / LANES_D key rows and each store
// that many spans' bytes of LANES_D V^T rows. CTA blockIdx.x of (batch, kv head) pair
// blockIdx.z * gridDim.y + blockIdx.y; indices within a pair are 32-bit (64-bit divisions per
// coordinate made the pass 11% slower). The host's layout check makes every row 16-byte aligned.
// The shape below (one group, 16 bytes, 8 chunks a warp: whole 128-byte key rows per load) ran
// at 3.4 TB/s on the H200 against 2.6 for two groups of 4 bytes, 2.7 for two groups of 16
// bytes (BENCHMARKS.md, twenty-first session). The reference is attention.fp8_v_transposed.
constexpr int kFp8TransposeThreads = 256;
constexpr int kFp8KeyGroup = 16;        // keys per permutation group
constexpr int kFp8TransposeGroups = 1;  // key groups per thread (a span)
constexpr int kFp8TransposeBytes = 16;  // head-dim bytes per thread (a chunk)
constexpr int kFp8TransposeLanesD = 8;  // a warp's chunks: 128 bytes of a key row per load

template <int GROUPS, int BYTES, int LANES_D>
__global__ void __launch_bounds__(kFp8TransposeThreads)
fp8_v_transpose_kernel(const __grid_constant__ Fp8TransposeParams p) {
  constexpr int kKeys = GROUPS * kFp8KeyGroup;  // keys of a span
  constexpr int kInWords = BYTES / 4;           // 4-byte words of one key's chunk
  constexpr int kOutWords = kKeys / 4;          // 4-byte words of one V^T row's piece
  constexpr int kSpansPerWarp = kWarpSize / LANES_D;
  constexpr int kWarps = kFp8TransposeThreads / kWarpSize;
  static_assert(kInWords == 1 || kInWords == 2 || kInWords == 4, "4, 8 or 16-byte loads");
  static_assert(kOutWords % 4 == 0, "16-byte stores");
  const int chunks = p.head_dim / BYTES;  // a multiple of LANES_D (host)
  const int spans = p.padded / kKeys;
  // warp w of the pair: span block w / chunk blocks, chunk block w % chunk blocks
  const int chunk_blocks = chunks / LANES_D;
  const int warp = blockIdx.x * kWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int span = warp / chunk_blocks * kSpansPerWarp + lane / LANES_D;
  const int chunk = warp % chunk_blocks * LANES_D + lane % LANES_D;
  const int pair = blockIdx.z * gridDim.y + blockIdx.y;
  if (span >= spans || pair >= p.batch * p.num_kv_heads) return;
  const int h = pair % p.num_kv_heads, b = pair / p.num_kv_heads;
  const unsigned char* src =
      static_cast<const unsigned char*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride + chunk * BYTES;
  u32 w[kKeys][kInWords];  // [span keys, chunk words] in key order
#pragma unroll
  for (int k = 0; k < kKeys; ++k) {
    const int key = span * kKeys + k;
    const unsigned char* row = src + key * p.v_row_stride;
    if constexpr (kInWords == 4) {
      const uint4 x = key < p.seqlen_k ? *reinterpret_cast<const uint4*>(row) : make_uint4(0u, 0u, 0u, 0u);
      w[k][0] = x.x, w[k][1] = x.y, w[k][2] = x.z, w[k][3] = x.w;
    } else if constexpr (kInWords == 2) {
      const uint2 x = key < p.seqlen_k ? *reinterpret_cast<const uint2*>(row) : make_uint2(0u, 0u);
      w[k][0] = x.x, w[k][1] = x.y;
    } else {
      w[k][0] = key < p.seqlen_k ? *reinterpret_cast<const u32*>(row) : 0u;
    }
  }
  unsigned char* dst = static_cast<unsigned char*>(p.vt) +
                       ((static_cast<i64>(b) * p.num_kv_heads + h) * p.head_dim + chunk * BYTES) * p.padded + span * kKeys;
#pragma unroll
  for (int q = 0; q < kInWords; ++q) {
    // word j of V^T rows 4 q .. 4 q + 3 of the chunk holds byte 0..3 of word q of the keys at
    // positions 4 j .. 4 j + 3: keys a, a + 1, a + 8, a + 9 of group j / 4, a = 2 (j % 4)
    u32 out[4][kOutWords];
#pragma unroll
    for (int j = 0; j < kOutWords; ++j) {
      const int a = j / 4 * kFp8KeyGroup + 2 * (j % 4);
      const u32 lo01 = __byte_perm(w[a][q], w[a + 1][q], 0x5140);      // a0 b0 a1 b1
      const u32 lo23 = __byte_perm(w[a][q], w[a + 1][q], 0x7362);      // a2 b2 a3 b3
      const u32 hi01 = __byte_perm(w[a + 8][q], w[a + 9][q], 0x5140);  // x0 y0 x1 y1
      const u32 hi23 = __byte_perm(w[a + 8][q], w[a + 9][q], 0x7362);  // x2 y2 x3 y3
      out[0][j] = __byte_perm(lo01, hi01, 0x5410);
      out[1][j] = __byte_perm(lo01, hi01, 0x7632);
      out[2][j] = __byte_perm(lo23, hi23, 0x5410);
      out[3][j] = __byte_perm(lo23, hi23, 0x7632);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4* row = reinterpret_cast<uint4*>(dst + static_cast<i64>(4 * q + c) * p.padded);
#pragma unroll
      for (int s = 0; s < kOutWords / 4; ++s)
        row[s] = make_uint4(out[c][4 * s], out[c][4 * s + 1], out[c][4 * s + 2], out[c][4 * s + 3]);
    }
  }
}

}  // namespace cuattn
