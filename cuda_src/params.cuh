// params.cuh: the one parameter struct of each kernel family (forward, backward, decode/paged,
// combine, cache ops), passed by value as the kernel's only argument.
//
// This file is also the host's field list: cuattn/_params.py reads these declarations and
// builds the matching NumPy structured dtype (natural C alignment), which the launch code fills
// by field name. So a field is declared here and nowhere else. Keep every member on a line of
// its own, `TYPE NAME;` with TYPE one of: a pointer (`const T*`, `float*`, ...), i64, int, u32,
// float, or TensorMap (128 bytes, 64-byte aligned: the host's cuTensorMapEncodeTiled output).
// Strides are in elements; pointer comments give the buffer's layout.
#pragma once

#include "common.cuh"
#include "fp8.cuh"  // e4m3, the element type of FP8 caches
#include "tma.cuh"

namespace cuattn {

// Forward (flash_fwd.cu, flash_fwd_sm90.cu). D is head_dim (of q and k) and Dv head_dim_v (of v
// and out), each at most the kernel's HEAD_DIM (see flash_fwd.cu). Dense rows [B, S, H, D], or
// varlen packed rows [total, H, D] with cu_seqlens (batch strides then 0 and B from cu_seqlens).
// The tensor maps are the Hopper kernel's TMA view of q, k, v as 4-D [B, S, H, D] (varlen: B = 1,
// S = total) with a box of [rows, 64 columns], and of out [B, Sq, Hq, Dv] (packed: B = 1) with a
// box of [64 rows, 64 columns] where o_by_tma is set; the mma.sync kernel leaves them zero.
//
// Paged keys (flash_fwd_kernel's PAGED variants, and the Hopper kernel when block_table is set):
// k and v are pages [num_blocks, block_size, Hk, D] (k_batch_stride / v_batch_stride: the page
// stride), key j of sequence b is slot j % block_size of page block_table[b, j / block_size],
// sequence b has min(seq_lens[b], seqlen_k) keys (seqlen_k: the table's capacity) and its
// queries are packed at cu_seqlens_q[b]. Launch entry e is sequence batch_index[e], so one launch
// can cover any subset of a batch. The Hopper kernel's k_map and v_map then view the pages as
// 4-D [num_blocks, block_size, Hk, D] with a box of [min(block_size, BLOCK_N) rows, 64 columns],
// and v_row_map the same with a box of one row. Dense and varlen launches leave these fields zero.
//
// The FP8 Hopper forward (T = e4m3, TOut fp16/bf16) reads v_map as V^T [B, Hk, D, Sk_pad] (keys
// permuted, flash_fwd_sm90.cu) and takes descales: real q = stored x q_descale x q_scale[b * sb + h * sh + (row / 64) * sblk]
// (a null array reads 1; strides 0 on broadcast axes), k likewise with blocks of kFp8ScaleBlockKeys
// keys, v = stored x v_descale x v_scale[hk * v_scale_head_stride]. The 16-bit kernels ignore them.
template <typename T, typename TOut = T>
struct FwdParams {
  TensorMap q_map;
  TensorMap k_map;
  TensorMap v_map;
  TensorMap v_row_map;
  TensorMap o_map;
  const T* q;              // [B, Sq, Hq, D] | [total_q, Hq, D]
  const T* k;              // [B, Sk, Hk, D] | [total_k, Hk, D]
  const T* v;              // [B, Sk, Hk, Dv] | [total_k, Hk, Dv]
  TOut* out;               // [B, Sq, Hq, Dv] | [total_q, Hq, Dv]
  float* lse;              // [B, Hq, Sq] | [Hq, total_q], or null
  const float* q_scale;    // [B, Hq, ceil(Sq / 64)] (broadcast axes stride 0), or null
  const float* k_scale;    // [B, Hk, ceil(Sk / kFp8ScaleBlockKeys)] (broadcast axes stride 0), or null
  const float* v_scale;    // [Hk] (or one value, stride 0), or null
  i64 q_scale_batch_stride;
  i64 q_scale_head_stride;
  i64 q_scale_block_stride;
  i64 k_scale_batch_stride;
  i64 k_scale_head_stride;
  i64 k_scale_block_stride;
  i64 v_scale_head_stride;
  float q_descale;         // host factors, 1 for 16-bit inputs
  float k_descale;
  float v_descale;
  const int* cu_seqlens_q;  // [B + 1] prefix sums, or null (dense)
  const int* cu_seqlens_k;  // [B + 1] prefix sums, or null (dense)
  const float* sinks;      // [Hq] attention-sink logits (natural-log units), or null
  const float* alibi_slopes;  // [B, Hq] | [Hq] (alibi_batch_stride 0) ALiBi slopes (natural-log units), or null
  i64 alibi_batch_stride;
  i64 q_batch_stride;
  i64 q_row_stride;
  i64 q_head_stride;
  i64 k_batch_stride;
  i64 k_row_stride;
  i64 k_head_stride;
  i64 v_batch_stride;
  i64 v_row_stride;
  i64 v_head_stride;
  i64 o_batch_stride;
  i64 o_row_stride;
  i64 o_head_stride;
  i64 lse_batch_stride;
  i64 lse_head_stride;
  int batch;
  int num_heads;
  int num_kv_heads;
  int seqlen_q;            // dense: Sq; varlen: max_seqlen_q
  int seqlen_k;            // dense: Sk; varlen: max_seqlen_k
  float score_scale;       // scale * log2(e), or scale / softcap with a softcap
  float softcap_out;       // softcap * log2(e), or 0
  int window_left;         // visible keys of row i: [i + Sk - Sq - left, i + Sk - Sq + right]
  int window_right;
  int head_dim;            // D, a multiple of 8 up to the kernel's tile head dim (the Hopper kernel
                           // reads zeros past it through its maps, or zero-fills its row copies there)
  int head_dim_v;          // Dv, v's and out's head dim, likewise (the Hopper kernel stores its columns)
  const int* block_table;  // paged: [B_all, max_blocks] page ids, or null
  const int* seq_lens;     // paged: [B_all] keys per sequence, or null
  const int* batch_index;  // paged: [batch] the sequence (row of block_table) of each launch entry, or null
  i64 table_stride;
  int block_size;
  u32 block_size_mul;      // FastDivisor of block_size
  int block_size_shift;
  int num_blocks;          // page ids are clamped to [0, num_blocks)
  int pages_by_copy;       // paged, flash_fwd_sm90_kernel: 1 = the producer warpgroup copies key rows
                           // (cp.async, any block size), 0 = TMA boxes of whole pages (the maps)
  int o_by_tma;            // flash_fwd_sm90_kernel: 1 = the epilogue stores O through o_map (every
                           // stride but the last a multiple of 16 bytes), 0 = 16-byte stores
  // flash_fwd_sm90_kernel's schedule (flash_fwd_sm90.cu): tile_counter null is the static one
  // (CTA i takes tiles i, i + gridDim.x, ...), else the dynamic one with int32 [2] counters, the
  // next tile and the CTAs finished, zero at every launch's start (its last CTA resets them),
  // and tile_section (batch, head) pairs per L2 section. With tile_order 1 (varlen) the
  // counters head the tile order that fwd_tile_order_kernel wrote before the launch
  // (TileOrderParams' workspace), the CTAs take its tiles in turn, and tile_section is 1 (its
  // tiles are indices of the static order)
  int* tile_counter;
  int tile_section;
  int tile_order;
};

// The tile order of a varlen flash_fwd_sm90_kernel launch on the dynamic schedule
// (tile_order.cu): which of the launch's tiles hold rows, longest sequences first.
// Ints of the workspace before the tiles: the forward's two counters and the number of tiles.
constexpr int kTileOrderHead = 3;
// What the entries after the listed tiles hold: past every tile of any launch.
constexpr int kTileOrderEnd = 0x7fffffff;
struct TileOrderParams {
  const int* cu_seqlens_q;  // [batch + 1], or with paged keys [B_all + 1] read through batch_index
  const int* cu_seqlens_k;  // [batch + 1] (null with paged keys)
  const int* seq_lens;      // [B_all]: paged keys, launch entry b's key count seq_lens[batch_index[b]]
                            // clamped to [0, max_keys] as the forward clamps it (null: cu_seqlens_k)
  const int* batch_index;   // [batch]: paged keys, launch entry b's sequence (null: b itself)
  int max_keys;             // paged keys: the block table's capacity
  int* workspace;           // [kTileOrderHead + entries]: the forward's two counters (left alone),
                            // the number of tiles, the tiles, then kTileOrderEnd
                            // (null: the launch runs static, nothing to write)
  int batch;
  int num_heads;
  int m_blocks;             // the launch's query blocks a (sequence, head) pair: ceil(max_seqlen_q / BLOCK_M)
  int block_m;
  int section;              // heads of a sequence whose tiles go query block by query block (FwdParams::tile_section)
  int capacity;             // tiles listed at most
  int entries;              // ints written after the head: capacity and the positions the forward's
                            // CTAs may read past the last tile (2 x its grid: attention.tile_order_entries)
};

// Backward (flash_bwd.cu): one struct for the whole family, filled once per call and passed to
// each of its launches (preprocess, main kernel, dQ or convert). Dense rows [B, S, H, D], or
// varlen packed rows as one batch entry [1, total, H, D] with cu_seqlens (batch strides 0).
// Strides are in elements, in the order batch (sb), row (ss), head (sh).
template <typename T>
struct BwdParams {
  TensorMap q_map;         // the sm_90a kernel's TMA views (flash_bwd.cu), else zero
  TensorMap k_map;
  TensorMap v_map;
  TensorMap do_map;
  TensorMap dk_map;        // dense dk, dv [B, Sk, Hk, D] in boxes of [64 rows, 64 columns] where
  TensorMap dv_map;        // dkv_by_tma is set, else zero
  const T* q;              // [B, Sq, Hq, D]
  const T* k;              // [B, Sk, Hk, D]
  const T* v;              // [B, Sk, Hk, Dv]
  const T* out;            // [B, Sq, Hq, Dv] the forward's output
  const T* dout;           // [B, Sq, Hq, Dv]
  const float* lse;        // [B, Hq, Sq] the forward's lse, natural log
  float* delta;            // [B, Hq, Sq] rowsum(dout * out), lse's layout
  float* dq_accum;         // atomic dQ: [B, Sq, Hq, D] fp32 contiguous; bulk dQ: [tiles, BLOCK_M * D]
                           // (flash_bwd.cu, above flash_bwd_sm90_kernel), or null (deterministic dQ kernel)
  T* dq;                   // [B, Sq, Hq, D]
  T* dk;                   // [B, Sk, Hk, D]
  T* dv;                   // [B, Sk, Hk, Dv]
  const int* cu_seqlens_q;  // [B + 1] prefix sums, or null (dense)
  const int* cu_seqlens_k;  // [B + 1] prefix sums, or null (dense)
  const float* alibi_slopes;  // [B, Hq] | [Hq] (alibi_sb 0) ALiBi slopes, or null
  int* dq_semaphores;      // ordered bulk dQ: [tiles] int32, zeroed; else null
  int* cta_ticket;         // ordered bulk dQ: [1] int32, zeroed; else null
  i64 alibi_sb;
  i64 q_sb;
  i64 q_ss;
  i64 q_sh;
  i64 k_sb;
  i64 k_ss;
  i64 k_sh;
  i64 v_sb;
  i64 v_ss;
  i64 v_sh;
  i64 o_sb;
  i64 o_ss;
  i64 o_sh;
  i64 do_sb;
  i64 do_ss;
  i64 do_sh;
  i64 dq_sb;
  i64 dq_ss;
  i64 dq_sh;
  i64 dk_sb;
  i64 dk_ss;
  i64 dk_sh;
  i64 dv_sb;
  i64 dv_ss;
  i64 dv_sh;
  i64 lse_sb;              // lse and delta
  i64 lse_sh;
  i64 acc_sb;              // atomic dQ accumulator's batch stride (varlen: 0)
  i64 acc_tile_sb;         // bulk dQ: the tile accumulator's strides in tiles (varlen: acc_tile_sb 0)
  i64 acc_tile_sh;
  i64 dq_accum_zero_floats;  // floats of dq_accum bwd_preprocess_kernel zeroes (unordered dQ sums), else 0
  int batch;               // sequences (varlen: len(cu_seqlens) - 1)
  int num_heads;
  int num_kv_heads;
  int seqlen_q;            // dense: Sq; varlen: max_seqlen_q
  int seqlen_k;            // dense: Sk; varlen: max_seqlen_k
  int rows_q;              // q's rows per batch entry of the view: Sq, or (varlen) total_q
  float score_scale;       // scale * log2(e), or scale / softcap with a softcap
  float softcap_out;       // softcap * log2(e), or 0
  float softmax_scale;     // dk = softmax_scale * dS^T Q, dq = softmax_scale * dS K
  int window_left;         // visible keys of row i: [i + Sk - Sq - left, i + Sk - Sq + right]
  int window_right;
  int head_dim;            // D of q, k, dq, dk: a multiple of 8 up to the tile head dim, that of
                           // max(D, Dv) (both kernels read zeros past each array's own head dim)
  int head_dim_v;          // Dv of v, out, dout, dv (a multiple of 8 up to the same tile)
  int dq_descending;       // ordered bulk dQ: 1 where ranks descend (a bounded right window side)
  int dkv_by_tma;          // sm_90a, bulk dQ, dense: 1 = dK and dV leave through dk_map, dv_map
};

// Decode and paged decode (decode.cu). A contiguous cache [B, S_max, Hk, D] or pages
// [num_blocks, block_size, Hk, D] through block_table, of T or of e4m3 (Tkv) with descales:
// real value = stored x k_descale x k_scale[hk * k_scale_stride] (likewise v). D is q's and k's
// head dim, Dv v's (DeepSeek-style caches have Dv < D); the output and the partials are Dv wide.
template <typename T, typename Tkv>
struct DecodeParams {
  const T* q;              // [B, Sq_new, Hq, D]
  const Tkv* k;            // [B, S_max, Hk, D] | [num_blocks, block_size, Hk, D]
  const Tkv* v;            // [B, S_max, Hk, Dv] | [num_blocks, block_size, Hk, Dv]
  const float* k_scale;    // [Hk] (stride 1) or [1] (stride 0) device descale, or null
  const float* v_scale;    // as k_scale
  const int* lens;         // [B] keys per sequence (cache_seqlens / seq_lens)
  const int* block_table;  // [B, max_blocks] (paged), or null
  T* out;                  // [B, Sq_new, Hq, Dv]
  float* lse;              // [B, Hq, Sq_new], or null
  float* part_out;         // [splits, B, Sq_new, Hq, Dv] (splits > 1)
  float* part_lse;         // [splits, B, Hq, Sq_new] (splits > 1)
  // [B, Hk * row_chunks] arrivals per CTA group (splits > 1), zero between launches: the group's
  // last CTA to finish merges the splits (decode.cu's fused combine). Null: combine_kernel merges.
  u32* split_arrivals;
  const float* sinks;      // [Hq] attention-sink logits, or null (the combine adds them when splits > 1)
  float k_descale;         // a host descale (1 for 2-byte caches), times k_scale[hk] when that is given
  float v_descale;
  int k_scale_stride;
  int v_scale_stride;
  const float* alibi_slopes;  // [B, Hq] | [Hq] (alibi_sb 0) ALiBi slopes, or null
  i64 alibi_sb;
  i64 q_sb;
  i64 q_ss;
  i64 q_sh;
  i64 k_sb;                // the batch stride, or (paged) the page stride
  i64 k_ss;
  i64 k_sh;
  i64 v_sb;
  i64 v_ss;
  i64 v_sh;
  i64 o_sb;
  i64 o_ss;
  i64 o_sh;
  i64 lse_sb;
  i64 lse_sh;
  i64 table_stride;
  int block_size;
  u32 block_size_mul;      // FastDivisor of block_size
  int block_size_shift;
  int num_blocks;
  int batch;
  int sq_new;
  int num_heads;
  int num_kv_heads;
  int row_chunks;
  int num_splits;
  int max_seqlen;          // lengths are clamped to [0, max_seqlen]
  float score_scale;
  float softcap_out;
  int window_left;
  int window_right;
  int head_dim;            // D, a multiple of 8 up to the kernel's HEAD_DIM (of 16 with an e4m3 cache)
  int head_dim_v;          // Dv, the same rules as D
};

// Exact merge of split or partial states (decode.cu): parts [P, B, S, H, D] with lse [P, B, H, S]
// into out [B, S, H, D] and lse_out [B, H, S]. D is the parts' own head dim (for split decode,
// v's head dim Dv).
template <typename Tin, typename Tout>
struct CombineParams {
  const Tin* parts;        // [P, B, S, H, D]
  const float* part_lse;   // [P, B, H, S] natural log
  Tout* out;               // [B, S, H, D]
  float* lse_out;          // [B, H, S], or null
  const float* sinks;      // [H] attention-sink logits joined once per row, or null
  i64 p_part;
  i64 p_b;
  i64 p_s;
  i64 p_h;
  i64 l_part;
  i64 l_b;
  i64 l_h;
  i64 l_s;
  i64 o_b;
  i64 o_s;
  i64 o_h;
  i64 lo_b;
  i64 lo_h;
  i64 lo_s;
  int num_parts;
  int batch;
  int seqlen;
  int heads;
  int head_dim;
};

// Paged-cache writes and copy-on-write copies (cache_ops.cu). New tokens of T into pages of
// Tcache: the same type, or e4m3, quantised as round(x / scale[h]) with a float32 scale per kv head.
// D is k's head dim, Dv v's.
template <typename T, typename Tcache>
struct CacheParams {
  const T* k;              // [N, Hk, D] new tokens (write)
  const T* v;              // [N, Hk, Dv]
  const int* slot_ids;     // [N] (write), int32; or null
  const i64* slot_ids_wide;  // [N] (write), int64 ids as the caller holds them (no cast); or null
  const int* pairs;        // [P, 2] (src, dst) pages (copy)
  Tcache* k_pages;         // [num_blocks, block_size, Hk, D]
  Tcache* v_pages;         // [num_blocks, block_size, Hk, Dv]
  const float* k_scale;    // [Hk] (an e4m3 cache's write), or null
  const float* v_scale;    // [Hk]
  i64 k_sn;
  i64 k_sh;
  i64 v_sn;
  i64 v_sh;
  i64 kp_sp;
  i64 kp_ss;
  i64 kp_sh;
  i64 vp_sp;
  i64 vp_ss;
  i64 vp_sh;
  int num_tokens;
  int num_kv_heads;
  int head_dim;            // D, a multiple of the elements in 16 bytes of Tcache
  int head_dim_v;          // Dv, the same rule
  int block_size;
  int num_blocks;
};

// Strided copies (cache_ops.cu's strided_copy_kernel): dst[i0, i1, i2, i3, :] = src[i0, i1, i2, i3, :]
// over four outer axes and a contiguous row of row_chunks chunks of the kernel's chunk bytes; the
// strides count chunks, and a zero source stride repeats the source along that axis (cascade
// attention's queries, copied once per prefix split with their GQA group packed into rows).
struct CopyParams {
  const void* src;         // [n0, n1, n2, n3, row] with the src strides below
  void* dst;               // [n0, n1, n2, n3, row] with the dst strides below
  i64 src_s0;
  i64 src_s1;
  i64 src_s2;
  i64 src_s3;
  i64 dst_s0;
  i64 dst_s1;
  i64 dst_s2;
  i64 dst_s3;
  int n0;
  int n1;
  int n2;
  int n3;
  int row_chunks;
};

// V^T for the FP8 Hopper forward (flash_fwd_sm90.cu's fp8_v_transpose_kernel): e4m3 bytes, so
// strides in elements are strides in bytes.
struct Fp8TransposeParams {
  const void* v;           // [B, Sk, Hk, D] with the strides below, every row 16-byte aligned
  void* vt;                // [B, Hk, D, padded], contiguous
  i64 v_batch_stride;
  i64 v_row_stride;
  i64 v_head_stride;
  int batch;
  int seqlen_k;
  int padded;              // Sk rounded up to a thread's span of keys; keys past Sk read 0
  int num_kv_heads;
  int head_dim;
};

}  // namespace cuattn
