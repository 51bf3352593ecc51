// decode.cu: FlashDecoding. A few new query tokens attend to a long KV cache, split across CTAs.
//
//   decode_kernel   one CTA per (split, kv head, row chunk, sequence): the query heads that share
//                   a kv head are packed into the rows of one mma tile (GQA packing), so each
//                   cache byte is read once per step, not once per query head. The CTA's warps (4,
//                   or 8: WARPS) take equal shares of every 64- or 128-key block streamed through a
//                   multi-stage cp.async ring, then merge their softmax states through shared memory. With one split
//                   the CTA writes the final output; with several, a float32 partial output and
//                   lse per split, and (given split_arrivals) the last of a group's split CTAs to
//                   finish merges them into the output: the split-KV combine without a launch of
//                   its own, whose start and drain cost a step 2.5-3.6 us on the H200.
//   combine_kernel  merges per-split (or any) partial states exactly: merge_states, and the
//                   split-KV combine where decode_kernel does not fuse it.
//
// Layouts (element strides in DecodeParams and CombineParams, params.cuh; last axis contiguous):
//   q              [B, Sq_new, Hq, D]         out  [B, Sq_new, Hq, Dv]  lse [B, Hq, Sq_new] fp32
//   contiguous KV  k [B, S_max, Hk, D], v [B, S_max, Hk, Dv]            cache_seqlens [B] int32
//   paged KV       k [num_blocks, block_size, Hk, D], v [..., Dv]       block_table [B, max_blocks] int32
//   partials       part_out [splits, B, Sq_new, Hq, Dv] fp32, part_lse [splits, B, Hq, Sq_new] fp32
// D is q's and k's head dim, Dv v's (equal for most models; DeepSeek's MLA has D = 192, Dv = 128).
//
// K and V hold q's type, or e4m3 bytes (Tkv = e4m3, fp8.cuh) with descales per tensor or kv head:
// the stage ring then holds bytes and each warp widens its fragments to fp16 in registers (a bf16
// q is rewritten as fp16 once, in shared memory), so both GEMMs run in fp16; the descales fold
// into the score scale and the output.
//
// Query row r of a CTA's tile is new token i = r / G of query head hk * G + r % G (G = Hq / Hk).
// Token i of sequence b has diagonal seqlen_b - Sq_new + i: with causal it sees keys up to it.
//
// Head dims: a kernel is instantiated for a tile head dim HEAD_DIM and runs any D = p.head_dim and
// Dv = p.head_dim_v up to HEAD_DIM (the host picks the tile of max(D, Dv)) whose rows are whole
// 16-byte copies (a multiple of 8 elements, of 16 for e4m3). Both GEMMs run over the whole tile
// and the columns past each tensor's own head dim are zero-filled in shared memory (never read
// from memory), which is exact: a Q or K column past D is zero in both operands of Q K^T, so each
// score is the sum over D columns alone; a V column past Dv is zero, so P V gives 0 in that
// output column, which is never stored. Partial outputs are Dv wide.
#include "attention_tile.cuh"
#include "fp8.cuh"
#include "params.cuh"

namespace cuattn {

// Warps of a CTA (WARPS in the kernels): kDecodeWarps but for the e4m3 caches' long-stage
// variants, whose eight warps make one CTA an SM stream faster than two of four
// (E4M3_CONTIGUOUS_LONG_TILES and E4M3_PAGED_LONG_TILES in cuattn/decode.py).
constexpr int kDecodeWarps = 4;
// Keys a pipeline stage holds (BLOCK_N in the kernels): each warp takes BLOCK_N / WARPS of them,
// one k16 slice of P V (the default stage; the long stage with eight warps) or two (a long stage
// of four warps, which no table takes: eight warps beat it over pages on the H100 and ran within
// 2.5% of it either way on the H200; scripts/compare_fp8_decode.py --paged-tile=4:2 and
// scripts/ab_paged_tiles.py still build it). A warp's two
// slices are independent MMA chains and halve the softmax's reductions, the barrier, the loop and
// a paged cache's lookups per key.
constexpr int kDecodeBlockN = 64;
constexpr int kDecodeLongBlockN = 128;
constexpr int kDecodeSliceKeys = 16;  // keys of one k16 slice of P V
// Q fragments stay in registers when they take at most this many (one m16 tile at D <= 128).
constexpr int kMaxQFragmentRegisters = 32;
// Partial-output columns the fused combine merges per thread (one 16-byte load per split).
constexpr int kCombineVec = 4;
static_assert(kCombineVec == 4, "the fused combine reads its columns as one float4");
// Parts read per unrolled step (combine_kernel, the fused combine); combine_kernel's weights take
// shared memory rounded up to whole steps.
constexpr int kCombineUnroll = 8;

// How the CTA's WARPS * 32 threads copy one stage of BLOCK_N rows: each keeps one 16-byte column
// of a run of kRun consecutive rows (so a paged cache is looked up once per run, not once per row).
// The runs tile the stage exactly; with D = 96 and four warps (12 chunks a row, 8 runs) a quarter
// of the threads idle.
constexpr int floor_pow2(int x) { return x < 2 ? 1 : 2 * floor_pow2(x / 2); }

template <typename Tkv, int HEAD_DIM, int BLOCK_N, int WARPS>
struct StageCopy {
  static constexpr int kChunksPerRow = HEAD_DIM * sizeof(Tkv) / kCopyBytes;
  static constexpr int kElemsPerChunk = kCopyBytes / sizeof(Tkv);
  static constexpr int kRuns = floor_pow2(WARPS * kWarpSize / kChunksPerRow);
  static constexpr int kRun = BLOCK_N / kRuns;  // rows a thread copies per stage
  static_assert(BLOCK_N % kRuns == 0, "runs tile the stage");

  static __device__ __forceinline__ bool active() { return threadIdx.x < kRuns * kChunksPerRow; }
  static __device__ __forceinline__ int first_row() { return threadIdx.x / kChunksPerRow * kRun; }
};

// Where tokens j0 .. j0 + RUN - 1 of the CTA's sequence and kv head live. A policy splits the
// lookup in two: `locate(j0, stop)` (any global reads it needs, issued one pipeline stage ahead
// so their latency hides behind the GEMMs) and `for_each_row(cursor, j0, stop, k_col, v_col, copy)`
// (arithmetic only, unless pages are shorter than a run), which calls copy(i, k_row, v_row) with
// the addresses of column `k_col` of row i of K and column `v_col` of V (two columns: K and V may
// have different head dims). Rows at or past `stop` are not read, but still get an address inside
// the cache, so that copy() needs no select per row.

// A contiguous cache k [B, S_max, Hk, D], v [B, S_max, Hk, Dv]: nothing to look up.
template <typename T, int RUN>
struct ContiguousKV {
  struct Cursor {};
  static constexpr bool kReadsTable = false;
  const T* k;  // already offset to (b, hk)
  const T* v;
  i64 k_row_stride, v_row_stride;

  __device__ __forceinline__ Cursor locate(int, int) const { return Cursor{}; }

  template <class Copy>
  __device__ __forceinline__ void for_each_row(Cursor, int j0, int stop, int k_col, int v_col, Copy&& copy) const {
    if (j0 + RUN <= stop) {
      // a whole run: one address computation, then a row stride per row
      const T* k_row = k + j0 * k_row_stride + k_col;
      const T* v_row = v + j0 * v_row_stride + v_col;
#pragma unroll
      for (int i = 0; i < RUN; ++i, k_row += k_row_stride, v_row += v_row_stride) copy(i, k_row, v_row);
      return;
    }
    // the last run: rows past `stop` (perhaps past the cache's capacity) point at the last row
#pragma unroll
    for (int i = 0; i < RUN; ++i) {
      const int j = min(j0 + i, stop - 1);
      copy(i, k + j * k_row_stride + k_col, v + j * v_row_stride + v_col);
    }
  }
};

// A paged cache: token j is slot j % block_size of page table[j / block_size]. A run starting at
// slot s stays in its page when s + RUN <= block_size (always, when block_size is a multiple of
// RUN: runs start at multiples of RUN, decode_body aligns the first stage); otherwise it spills into the next page, whose id locate()
// also fetches, and, only with pages shorter than a run, into pages looked up row by row.
template <typename T, int RUN>
struct PagedKV {
  struct Cursor {
    int page;       // of token j0, as the block table holds it
    int next_page;  // the page after it, when the run reaches it
    int slot;       // j0 % block_size
  };
  static constexpr bool kReadsTable = true;
  const T* k;  // already offset to kv head hk: [num_blocks, block_size, Hk, D]
  const T* v;  // [num_blocks, block_size, Hk, Dv]
  // element strides of a page and of a slot; the host checks they fit in 32 bits, so each
  // offset is a 32 x 32 -> 64-bit multiply-add (widened before the product: a slot-major pool's
  // slot * slot stride passes 2^31 where the page's is small)
  int k_page_stride, k_slot_stride, v_page_stride, v_slot_stride;
  const int* table;        // this sequence's row of the block table
  FastDivisor block_size;  // any size: j / block_size costs a multiply-high, not a division
  int num_blocks;

  // The ids are not used until for_each_row(), so the reads stay in flight meanwhile. The next
  // page is read only when a row of the run before `stop` lies in it (the table may end there).
  __device__ __forceinline__ Cursor locate(int j0, int stop) const {
    const int index = block_size.div(j0);
    const int slot = block_size.mod(j0, index);
    const bool spills = slot + RUN > block_size.divisor && (index + 1) * block_size.divisor < stop;
    return Cursor{table[index], spills ? table[index + 1] : 0, slot};
  }

  // Columns `k_col` of K and `v_col` of V of a slot (page clamped into the pool, clamp_page).
  __device__ __forceinline__ void address(int page, int slot, int k_col, int v_col, const T*& k_row,
                                          const T*& v_row) const {
    const i64 p = clamp_page(page, num_blocks);
    k_row = k + (p * k_page_stride + static_cast<i64>(slot) * k_slot_stride + k_col);
    v_row = v + (p * v_page_stride + static_cast<i64>(slot) * v_slot_stride + v_col);
  }

  template <class Copy>
  __device__ __forceinline__ void for_each_row(const Cursor& c, int j0, int stop, int k_col, int v_col,
                                               Copy&& copy) const {
    if (c.slot + RUN <= block_size.divisor) {
      // the whole run in one page (rows past `stop` included): one address computation, then a
      // slot stride per row
      const T* k_row;
      const T* v_row;
      address(c.page, c.slot, k_col, v_col, k_row, v_row);
#pragma unroll
      for (int i = 0; i < RUN; ++i, k_row += k_slot_stride, v_row += v_slot_stride) copy(i, k_row, v_row);
      return;
    }
    // a run across pages (never with block sizes that are multiples of RUN): kept rolled, out of
    // the way of the registers the fast path and the GEMMs use
#pragma unroll 1
    for (int i = 0; i < RUN; ++i) {
      int slot = c.slot + i;
      int page = c.page;
      if (slot >= 2 * block_size.divisor) {
        // pages shorter than half a run: this row's page is read here, with its latency (and
        // only for a row before the end: the table may end there)
        const int index = block_size.div(j0 + i);
        slot = block_size.mod(j0 + i, index);
        page = j0 + i < stop ? table[index] : 0;
      } else if (slot >= block_size.divisor) {
        slot -= block_size.divisor;
        page = c.next_page;
      }
      const T* k_row;
      const T* v_row;
      address(page, slot, k_col, v_col, k_row, v_row);
      copy(i, k_row, v_row);
    }
  }
};

// Rows of a K/V stage in shared memory: HEAD_DIM elements (K's D and V's Dv both fit) and 16
// bytes of padding, so that the 8 rows one ldmatrix phase reads start in 8 different bank groups,
// for 2-byte and 1-byte elements.
template <typename Tkv, int HEAD_DIM>
struct KvRow {
  static constexpr int kStride = HEAD_DIM + kCopyBytes / sizeof(Tkv);
};

// Look up where this thread's run of the stage starting at key n0 lives.
template <typename Tkv, int HEAD_DIM, int BLOCK_N, int WARPS, class KV>
__device__ __forceinline__ typename KV::Cursor locate_stage(const KV& kv, int n0, int stop) {
  using Copy = StageCopy<Tkv, HEAD_DIM, BLOCK_N, WARPS>;
  const int j0 = n0 + Copy::first_row();
  return Copy::active() && j0 < stop ? kv.locate(j0, stop) : typename KV::Cursor{};
}

// One pipeline stage: keys [n0, n0 + BLOCK_N) of K and V into padded shared tiles, rows at
// or past `stop`, K's columns at or past `head_dim` and V's at or past `head_dim_v` zero-filled
// (never stale: 0 * NaN would poison the accumulator).
template <typename Tkv, int HEAD_DIM, int BLOCK_N, int WARPS, class KV>
__device__ __forceinline__ void load_kv_stage(Tkv* sK, Tkv* sV, const KV& kv, int n0, int stop, int head_dim,
                                              int head_dim_v, const typename KV::Cursor& cursor) {
  using Copy = StageCopy<Tkv, HEAD_DIM, BLOCK_N, WARPS>;
  constexpr int kStride = KvRow<Tkv, HEAD_DIM>::kStride;
  if (!Copy::active()) return;
  const int col = (threadIdx.x % Copy::kChunksPerRow) * Copy::kElemsPerChunk;
  const int j0 = n0 + Copy::first_row();
  Tkv* k_dst = sK + Copy::first_row() * kStride + col;
  Tkv* v_dst = sV + Copy::first_row() * kStride + col;
  // a thread past a tensor's head dim only zero-fills that tensor's rows, as for a run past the
  // end, from column 0 of its rows (an address inside the cache, never read)
  const int k_rows = col < head_dim ? stop - j0 : 0;
  const int v_rows = col < head_dim_v ? stop - j0 : 0;
  const auto copy = [&](int i, const Tkv* k_row, const Tkv* v_row) {
    cp_async_16(k_dst + i * kStride, k_row, i < k_rows);
    cp_async_16(v_dst + i * kStride, v_row, i < v_rows);
  };
  if (k_rows > 0 || v_rows > 0) {
    kv.for_each_row(cursor, j0, stop, col < head_dim ? col : 0, col < head_dim_v ? col : 0, copy);
  } else {
    // a run wholly past the end: zero its rows without a lookup
#pragma unroll
    for (int i = 0; i < Copy::kRun; ++i) copy(i, kv.k, kv.v);
  }
}

// Shared memory of one CTA, in bytes: the Q tile, then the larger of the K/V ring and the
// buffers the warps merge through. Python mirrors this (cuattn/decode.py, DecodeTile).
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, int BLOCK_N, int WARPS>
struct DecodeSmem {
  static constexpr int kRows = 16 * MT;
  static constexpr int kStride = SmemRow<HEAD_DIM>::kStride;       // Q rows, elements of T
  static constexpr int kKvStride = KvRow<Tkv, HEAD_DIM>::kStride;  // K/V rows, elements of Tkv
  static constexpr int kQ = kRows * kStride * sizeof(T);
  static constexpr int kRing = STAGES * 2 * BLOCK_N * kKvStride * sizeof(Tkv);
  static constexpr int kMerge = WARPS * kRows * (HEAD_DIM + 2) * sizeof(float);
  static constexpr int kBytes = kQ + (kRing > kMerge ? kRing : kMerge);
};

// Everything the decode body needs beyond the KV policy.
struct DecodeArgs {
  int seqlen;       // this sequence's cache length (keys [0, seqlen) exist)
  int sq_new;       // new tokens per sequence
  int group;        // query heads per kv head
  int rows;         // group * sq_new: rows of the packed tile
  int row_base;     // first row of this CTA's chunk
  int split, num_splits;
  MaskParams mask;    // score_scale includes the kv head's k descale (e4m3 caches)
  const float* sinks;  // at head h0: [G] attention-sink logits of the group's heads, or null
  float v_descale;     // the kv head's v descale (e4m3 caches; 1 otherwise): multiplies the output
  const float* alibi_slopes;  // at (b, h0): [G] ALiBi slopes of the group's heads, or null
  int head_dim;               // D <= HEAD_DIM, of q and k
  int head_dim_v;             // Dv <= HEAD_DIM, of v and the output
};

// Column c (0 or 1) of lane quad position tq in n8 tile dt of the output accumulator: which head
// dim it holds. With 2-byte K/V it is the usual dt * 8 + 2 tq + c. With e4m3 V, one transposing
// ldmatrix gives each lane the byte pairs (d, d + 1) of two keys for 32 head dims at once, so n8
// tile 4j + u holds d = 32 j + 16 (u / 2) + 2 n + (u % 2) at its column n = 2 tq + c.
template <typename Tkv>
__device__ __forceinline__ int output_column(int dt, int tq, int c) {
  if (sizeof(Tkv) == 2) return dt * 8 + 2 * tq + c;
  constexpr int kTilesPerGroup = 4;
  const int j = dt / kTilesPerGroup, u = dt % kTilesPerGroup;
  return 32 * j + 16 * (u / 2) + 2 * (2 * tq + c) + u % 2;
}

// The split-KV combine of one CTA's rows of packed queries, run by the last of a group's split CTAs
// to finish (finish_split): rows [row_base, row_base + rows_here) of the group's tile, row r being
// token r / group of head r % group (pointers at the group's first head).
//   parts  at (split 0, b, 0, h0) of [splits, B, Sq_new, Hq, Dv]   part_lse at (split 0, b, h0, 0) of [splits, B, Hq, Sq_new]
//   out    at (b, 0, h0) of [B, Sq_new, Hq, Dv]                      lse at (b, h0, 0) of [B, Hq, Sq_new], or null
// Each thread merges kCombineVec columns of one row on its own, an online softmax over the
// splits (each normalised split a state with m = its lse in log2 units and l = 1), reading
// kCombineUnroll splits' lse and columns at once: one round trip to L2 for up to that many
// splits, and no barrier. A split with lse = -inf saw no key and weighs 0, whatever it holds.
template <typename T, int THREADS>
__device__ __forceinline__ void combine_splits(int rows_here, int row_base, int group, int num_splits, int head_dim_v,
                                               const float* sinks, const float* parts, i64 part_row_stride,
                                               i64 part_head_stride, i64 part_split_stride, const float* part_lse,
                                               i64 part_lse_head_stride, i64 part_lse_split_stride, T* out,
                                               i64 o_row_stride, i64 o_head_stride, float* lse, i64 lse_head_stride) {
  const int vecs_per_row = head_dim_v / kCombineVec;
  for (int idx = threadIdx.x; idx < rows_here * vecs_per_row; idx += THREADS) {
    const int row = idx / vecs_per_row, d = idx % vecs_per_row * kCombineVec;
    const int r = row_base + row, token = r / group, head = r % group;
    const float* lse_row = part_lse + head * part_lse_head_stride + token;
    const float* src = parts + token * part_row_stride + head * part_head_stride + d;
    SoftmaxState merged;
    merged.init();
    float acc[kCombineVec] = {};
    for (int p0 = 0; p0 < num_splits; p0 += kCombineUnroll) {
      float part_lse_at[kCombineUnroll];
      float4 x[kCombineUnroll];
#pragma unroll
      for (int i = 0; i < kCombineUnroll; ++i) {
        // read through L2: other SMs wrote them
        const int p = min(p0 + i, num_splits - 1);
        part_lse_at[i] = p0 + i < num_splits ? __ldcg(lse_row + p * part_lse_split_stride) : -infinity();
        x[i] = __ldcg(reinterpret_cast<const float4*>(src + p * part_split_stride));
      }
#pragma unroll
      for (int i = 0; i < kCombineUnroll; ++i) {
        if (part_lse_at[i] == -infinity()) continue;
        float scale_self, scale_part;
        merged.merge(SoftmaxState{part_lse_at[i] * kLog2e, 1.f}, scale_self, scale_part);
        acc[0] = acc[0] * scale_self + x[i].x * scale_part;
        acc[1] = acc[1] * scale_self + x[i].y * scale_part;
        acc[2] = acc[2] * scale_self + x[i].z * scale_part;
        acc[3] = acc[3] * scale_self + x[i].w * scale_part;
      }
    }
    // an attention sink joins the denominator once per row (it carries no value)
    const float sink_factor = sinks != nullptr ? merged.add_sink(sinks[head] * kLog2e) : 1.f;
    const float scale = merged.inv_sum() * sink_factor;
    T* dst = out + token * o_row_stride + head * o_head_stride + d;
#pragma unroll
    for (int c = 0; c < kCombineVec; ++c) dst[c] = DType<T>::from_float(acc[c] * scale);
    if (lse != nullptr && d == 0) lse[head * lse_head_stride + token] = merged.lse();
  }
}

// ALIBI: add ALiBi's bias (a.alibi_slopes is set); a template flag so that the kernels without it
// keep the registers they had before ALiBi existed (the bias pass costs up to 36 more at D = 96).
// ROW_HALVES: 1 when the call packs at most 8 rows (MT = 1; the host picks it): the softmax then
// runs on each lane's row g alone, rows 8-15 of the m16 tile being padding (AttentionTile).
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, bool ALIBI, int ROW_HALVES, int BLOCK_N, int WARPS,
          class KV>
__device__ __forceinline__ void decode_body(
    const T* q,  // at (b, token 0, head hk * G)
    i64 q_row_stride, i64 q_head_stride, const KV& kv, const DecodeArgs& a,
    T* out, i64 o_row_stride, i64 o_head_stride,  // at (b, 0, hk * G); final output (one split), Dv wide
    float* lse, i64 lse_head_stride,              // at (b, hk * G, 0); may be null
    float* part_out, i64 part_row_stride, i64 part_head_stride,  // at (split, b, 0, hk * G), Dv wide
    float* part_lse, i64 part_lse_head_stride) {                 // at (split, b, hk * G, 0)
  using Smem = DecodeSmem<T, Tkv, HEAD_DIM, MT, STAGES, BLOCK_N, WARPS>;
  constexpr int kThreads = WARPS * kWarpSize;
  constexpr int kWarpKeys = BLOCK_N / WARPS;             // keys of a stage each warp takes
  constexpr int kSlices = kWarpKeys / kDecodeSliceKeys;  // its k16 slices of P V
  static_assert(kSlices * kDecodeSliceKeys * WARPS == BLOCK_N, "warps take whole k16 slices of the stage");
  using Tile = AttentionTile<T, MT, kWarpKeys / 8, HEAD_DIM / 8, ROW_HALVES>;
  static_assert(ROW_HALVES == 2 || MT == 1, "a tile of at most 8 rows is one m16 tile");
  // An e4m3 cache is widened in registers, between its shared-memory load and the GEMMs, to
  // fp16 whatever q's type: e4m3 widens to fp16 in one instruction on sm_89+ (to bf16 it takes
  // bit arithmetic), and a bf16 q becomes fp16 once, in shared memory (exact in fp16's range,
  // see bf16x2_to_half2). Both GEMMs then run in fp16.
  constexpr bool kFp8 = sizeof(Tkv) == 1;
  using QkType = typename Conditional<kFp8, __half, T>::type;
  using Mm = Mma<QkType>;
  using PvType = typename Conditional<kFp8, __half, T>::type;
  using PvMm = Mma<PvType>;
  static_assert(sizeof(Tkv) == 2 || kFp8, "K/V elements are 2-byte floats or e4m3");
  constexpr int kStride = Smem::kStride;
  constexpr int kKvStride = Smem::kKvStride;
  constexpr int kRows = Smem::kRows;
  constexpr int kKSteps = HEAD_DIM / 16;
  static_assert(!kFp8 || HEAD_DIM % 32 == 0, "e4m3 fragments cover 32 head dims per load");
  static_assert(!kFp8 || (IsSame<QkType, __half>::value && IsSame<PvType, __half>::value),
                "e4m3 operands widen to fp16 (e4m3x4_to_half2x2)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);                         // [kRows, D + pad]
  Tkv* sRing = reinterpret_cast<Tkv*>(smem_raw + Smem::kQ);       // [STAGES][2][BLOCK_N, D + pad]
  float* sMergeO = reinterpret_cast<float*>(smem_raw + Smem::kQ);  // [warps, kRows, HEAD_DIM] (after the ring drains)
  float* sMergeM = sMergeO + WARPS * kRows * HEAD_DIM;             // [warps, kRows]
  float* sMergeL = sMergeM + WARPS * kRows;                        // [warps, kRows]

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  // Q rows of this chunk: row r is token r / G of head r % G.
  {
    constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
    constexpr int kElemsPerChunk = kCopyBytes / sizeof(T);
    for (int idx = threadIdx.x; idx < kRows * kChunksPerRow; idx += kThreads) {
      const int row = idx / kChunksPerRow;
      const int col = (idx % kChunksPerRow) * kElemsPerChunk;
      const int r = a.row_base + row;
      const bool valid = r < a.rows && col < a.head_dim;
      const T* src = valid ? q + (r / a.group) * q_row_stride + (r % a.group) * q_head_stride + col : q;
      cp_async_16(sQ + row * kStride + col, src, valid);
    }
    cp_async_commit();
  }

  // The keys any row can see, [n_begin, n_end), cut into num_splits chunks of whole blocks.
  // n_begin is rounded down to a block (the window's mask hides the extra keys) so that every
  // stage, and every thread's run of rows, starts where a page of a multiple of the run starts.
  const int offset = a.seqlen - a.sq_new;
  const int n_end = min(a.seqlen, offset + a.sq_new - 1 + a.mask.window_right + 1);
  const int n_begin = max(0, offset - a.mask.window_left) / BLOCK_N * BLOCK_N;
  const int span = max(0, n_end - n_begin);
  const int blocks_total = (span + BLOCK_N - 1) / BLOCK_N;
  const int blocks_per_split = (blocks_total + a.num_splits - 1) / a.num_splits;
  const int start = n_begin + a.split * blocks_per_split * BLOCK_N;
  const int stop = min(n_end, start + blocks_per_split * BLOCK_N);
  const int num_blocks = stop > start ? (stop - start + BLOCK_N - 1) / BLOCK_N : 0;
  // Keys every row sees: below the first token's right edge, at or past the last token's left edge.
  const int clean_end = min(stop, offset + a.mask.window_right + 1);
  const int clean_begin = offset + a.sq_new - 1 - a.mask.window_left;
  const MaskParams mask{stop, a.mask.window_left, a.mask.window_right, a.mask.score_scale, a.mask.softcap_out};

  // prologue: fill all but one stage of the ring, then look up the rows of the next one. A policy
  // that reads a table (KV::kReadsTable) looks up the rows of all STAGES stages first, so that
  // its reads overlap instead of each waiting behind the copies before it.
  const auto locate_at = [&](int st) {
    return st < num_blocks ? locate_stage<Tkv, HEAD_DIM, BLOCK_N, WARPS>(kv, start + st * BLOCK_N, stop)
                           : typename KV::Cursor{};
  };
  typename KV::Cursor first[STAGES];
  if constexpr (KV::kReadsTable) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) first[st] = locate_at(st);
  }
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < num_blocks) {
      Tkv* sK = sRing + (2 * st) * BLOCK_N * kKvStride;
      load_kv_stage<Tkv, HEAD_DIM, BLOCK_N, WARPS>(sK, sK + BLOCK_N * kKvStride, kv, start + st * BLOCK_N, stop, a.head_dim,
                                   a.head_dim_v, KV::kReadsTable ? first[st] : locate_at(st));
    }
    cp_async_commit();
  }
  typename KV::Cursor cursor = KV::kReadsTable ? first[STAGES - 1] : locate_at(STAGES - 1);

  // Every warp needs every row of Q. Small tiles keep its fragments in registers for the whole
  // loop; larger ones (they would crowd out the accumulator) re-read them from shared memory.
  // (With an e4m3 cache the widened K and V operands take registers too: two m16 tiles at D = 64
  // would spill, so there only one tile's Q stays in registers.)
  constexpr bool kQInRegisters = MT * kKSteps * 4 <= kMaxQFragmentRegisters && (!kFp8 || MT == 1);
  cp_async_wait<STAGES - 1>();
  __syncthreads();
  if constexpr (kFp8 && !IsSame<QkType, T>::value) {
    // a bf16 q over an e4m3 cache: every pair of sQ [kRows, D + pad] rewritten as fp16 in place
    u32* words = reinterpret_cast<u32*>(sQ);
    for (int i = threadIdx.x; i < kRows * kStride / 2; i += kThreads) words[i] = bf16x2_to_half2(words[i]);
    __syncthreads();
  }
  u32 qa[kQInRegisters ? MT : 1][kQInRegisters ? kKSteps : 1][4];
  const auto q_fragment = [&](int mt, int ks, u32(&frag)[4]) {
    if (!kFp8) {
      ldmatrix_x4(frag, sQ + (mt * 16 + lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
      return;
    }
    // e4m3 K: a lane's 4 key bytes of a k16 step are head dims 4 tq .. 4 tq + 3, and bytes 0, 1
    // (then 2, 3) widen to one operand register, so the step's k order is d = 4 tq, 4 tq + 1 for
    // k = 2 tq, 2 tq + 1 and d = 4 tq + 2, 4 tq + 3 for k = 8 + 2 tq, 9 + 2 tq: Q takes the same,
    // which is its own pairs of head dims as they lie in memory
    const T* row = sQ + (mt * 16 + lane / kQuadSize) * kStride + ks * 16 + 4 * (lane % kQuadSize);
    const uint2 top = *reinterpret_cast<const uint2*>(row);                 // d 4 tq .. 4 tq + 3 of row g
    const uint2 bottom = *reinterpret_cast<const uint2*>(row + 8 * kStride);  // of row g + 8
    frag[0] = top.x;     // (d, d + 1)
    frag[1] = bottom.x;
    frag[2] = top.y;     // (d + 2, d + 3)
    frag[3] = bottom.y;
  };
  if (kQInRegisters) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) q_fragment(mt, ks, qa[kQInRegisters ? mt : 0][kQInRegisters ? ks : 0]);
  }

  Tile tile;
  tile.init();
  const auto diag_of = [=](int mt, int r) { return (a.row_base + mt * 16 + lane / kQuadSize + 8 * r) / a.group + offset; };
  // ALiBi slope of the lane's row r of m16 tile mt (row r is head r % G), read per block (an L1
  // hit) rather than held in registers across the loop
  const auto alibi_of = [&](int mt, int r) {
    return alibi_score_slope(a.alibi_slopes, 0, 0, (a.row_base + mt * 16 + lane / kQuadSize + 8 * r) % a.group,
                             mask.softmax_scale());
  };

  for (int t = 0; t < num_blocks; ++t) {
    // block t has landed, and every warp is done with the stage the next load overwrites
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int t_next = t + STAGES - 1;
    if (t_next < num_blocks) {
      Tkv* sK = sRing + (2 * (t_next % STAGES)) * BLOCK_N * kKvStride;
      load_kv_stage<Tkv, HEAD_DIM, BLOCK_N, WARPS>(sK, sK + BLOCK_N * kKvStride, kv, start + t_next * BLOCK_N, stop,
                                   a.head_dim, a.head_dim_v, cursor);
      // look up the stage after (a paged cache reads its block table): the reads complete
      // while this block's GEMMs run
      if (t_next + 1 < num_blocks) cursor = locate_stage<Tkv, HEAD_DIM, BLOCK_N, WARPS>(kv, start + (t_next + 1) * BLOCK_N, stop);
    }
    cp_async_commit();

    // this warp's kWarpKeys keys of the block, k16 slices kk = 0 .. kSlices - 1
    const Tkv* sK = sRing + (2 * (t % STAGES)) * BLOCK_N * kKvStride + warp * kWarpKeys * kKvStride;
    const Tkv* sV = sK + BLOCK_N * kKvStride;
    const int n0 = start + t * BLOCK_N + warp * kWarpKeys;

    // S = Q K^T. Slice kk's matrices: keys 0-7 | d 0-7, keys 0-7 | d 8-15, keys 8-15 | d 0-7,
    // keys 8-15 | d 8-15 (keys counted from the slice's first), into n8 tiles 2 kk and 2 kk + 1
    tile.zero_scores();
    u32 packed[kSlices][4];  // e4m3 keys of two k16 steps, per slice
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      u32 b[kSlices][4];
#pragma unroll
      for (int kk = 0; kk < kSlices; ++kk) {
        const Tkv* slice = sK + kk * kDecodeSliceKeys * kKvStride;
        if (!kFp8) {
          ldmatrix_x4(b[kk], slice + (lane % 8 + (lane / 16) * 8) * kKvStride + ks * 16 + ((lane / 8) % 2) * 8);
        } else {
          // matrices keys 0-7 | d 0-15, keys 8-15 | d 0-15, keys 0-7 | d 16-31, keys 8-15 | d 16-31
          // of 32 head dims, loaded at even steps: packed[kk][0], [1] hold keys g, g + 8, bytes
          // 4 tq .. 4 tq + 3 of this step; packed[kk][2], [3] of the next
          if (ks % 2 == 0) {
            ldmatrix_x4(packed[kk], slice + (lane % 8 + ((lane / 8) % 2) * 8) * kKvStride + ks * 16 + (lane / 16) * 16);
          }
          e4m3x4_to_half2x2(packed[kk][2 * (ks % 2)], b[kk][0], b[kk][1]);      // key g
          e4m3x4_to_half2x2(packed[kk][2 * (ks % 2) + 1], b[kk][2], b[kk][3]);  // key g + 8
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        u32 from_smem[4];
        if (!kQInRegisters) q_fragment(mt, ks, from_smem);
        const u32(&a_frag)[4] = kQInRegisters ? qa[kQInRegisters ? mt : 0][kQInRegisters ? ks : 0] : from_smem;
#pragma unroll
        for (int kk = 0; kk < kSlices; ++kk) {
          Mm::run(tile.s[mt][2 * kk], a_frag, b[kk][0], b[kk][1]);
          Mm::run(tile.s[mt][2 * kk + 1], a_frag, b[kk][2], b[kk][3]);
        }
      }
    }
    if (n0 + kWarpKeys > clean_end || n0 < clean_begin) {
      tile.template cap_and_mask<true>(mask, diag_of, n0, lane);
    } else {
      tile.template cap_and_mask<false>(mask, diag_of, n0, lane);
    }
    // each row's ALiBi offset (add_alibi); 0 without ALiBi, where it folds away
    float row_bias[MT][2] = {};
    if constexpr (ALIBI) tile.add_alibi(diag_of, alibi_of, n0, lane, row_bias);
    tile.softmax_update(mask.softmax_scale(), row_bias);

    // O += P V over the warp's keys, slice by slice: matrices keys 0-7 | d 0-7, keys 8-15 | d 0-7,
    // keys 0-7 | d 8-15, keys 8-15 | d 8-15 of the slice.
    // With an e4m3 cache this GEMM runs in fp16 (see QkType): probabilities in [0, 2^8] keep 3
    // more bits in fp16 than in bf16 (below 2^-24 of the row max they flush, which no sum can see).
    u32 p[MT][kSlices][4];
    tile.template to_fragments<PvType>(p);
    if (!kFp8) {
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp)
#pragma unroll
        for (int kk = 0; kk < kSlices; ++kk) {
          u32 b[4];
          ldmatrix_x4_trans(b, sV + (kk * kDecodeSliceKeys + lane % 8 + ((lane / 8) % 2) * 8) * kKvStride + dp * 16 +
                                   (lane / 16) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mm::run(tile.o[mt][2 * dp], p[mt][kk], b[0], b[1]);
            Mm::run(tile.o[mt][2 * dp + 1], p[mt][kk], b[2], b[3]);
          }
        }
    } else {
      // the same four matrices as for K, transposed: r[0] holds keys 2 tq, 2 tq + 1 of the byte
      // pair (2 g, 2 g + 1) of d 0-15, r[1] keys 8 + 2 tq, 9 + 2 tq; r[2], r[3] of d 16-31. Bytes
      // 0, 2 are one head dim's two keys, bytes 1, 3 the next's: one permute puts each head
      // dim's pair in a half, which widens to the operand of one of four n8 tiles (output_column)
#pragma unroll
      for (int j = 0; j < HEAD_DIM / 32; ++j)
#pragma unroll
        for (int kk = 0; kk < kSlices; ++kk) {
          u32 r[4];
          ldmatrix_x4_trans(r, sV + (kk * kDecodeSliceKeys + lane % 8 + ((lane / 8) % 2) * 8) * kKvStride + j * 32 +
                                   (lane / 16) * 16);
          u32 even[4], odd[4];  // fp16 pairs of head dims 2 g (then 2 g + 1) of each register's keys
#pragma unroll
          for (int x = 0; x < 4; ++x) e4m3x4_to_half2x2(__byte_perm(r[x], 0, kPairEvenOdd), even[x], odd[x]);
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const u32(&half)[4] = u % 2 == 0 ? even : odd;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
              PvMm::run(tile.o[mt][4 * j + u], p[mt][kk], half[2 * (u / 2)], half[2 * (u / 2) + 1]);
          }
        }
    }
  }

  // Merge the warps' states (disjoint keys) through shared memory, which the ring no longer needs.
  cp_async_wait<0>();
  __syncthreads();
  const int g = lane / kQuadSize, tq = lane % kQuadSize;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < Tile::kRowHalves; ++r) {
      const int row = mt * 16 + g + 8 * r;
      const float l = quad_sum(tile.state[mt][r].l);
      if (tq == 0) {
        sMergeM[warp * kRows + row] = tile.state[mt][r].m;
        sMergeL[warp * kRows + row] = l;
      }
#pragma unroll
      for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
        float* dst = sMergeO + (warp * kRows + row) * HEAD_DIM;
        dst[output_column<Tkv>(dt, tq, 0)] = tile.o[mt][dt][2 * r];
        dst[output_column<Tkv>(dt, tq, 1)] = tile.o[mt][dt][2 * r + 1];
      }
    }
  __syncthreads();

  for (int idx = threadIdx.x; idx < kRows * HEAD_DIM; idx += kThreads) {
    const int row = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    const int r = a.row_base + row;
    // output columns past Dv hold P times V's zero columns: not part of the output
    if (r >= a.rows || d >= a.head_dim_v) continue;
    SoftmaxState merged{sMergeM[row], sMergeL[row]};
    float value = sMergeO[row * HEAD_DIM + d];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
      const SoftmaxState other{sMergeM[w * kRows + row], sMergeL[w * kRows + row]};
      float scale_self, scale_other;
      merged.merge(other, scale_self, scale_other);
      value = value * scale_self + sMergeO[(w * kRows + row) * HEAD_DIM + d] * scale_other;
    }
    const int token = r / a.group, head = r % a.group;
    // one split holds every key: the sink joins here (with several, the combine adds it once)
    const float sink_factor =
        a.num_splits == 1 && a.sinks != nullptr ? merged.add_sink(a.sinks[head] * kLog2e) : 1.f;
    value *= merged.inv_sum() * sink_factor * a.v_descale;
    if (a.num_splits == 1) {
      out[token * o_row_stride + head * o_head_stride + d] = DType<T>::from_float(value);
      if (lse != nullptr && d == 0) lse[head * lse_head_stride + token] = merged.lse();
    } else {
      part_out[token * part_row_stride + head * part_head_stride + d] = value;
      if (d == 0) part_lse[head * part_lse_head_stride + token] = merged.lse();
    }
  }
}

// The descale of kv head hk of an e4m3 cache: the host's factor times the device array's entry,
// when there is one. It folds into the score scale (K: scores are linear in k) and the output
// (V: linear in v). A 2-byte cache has none.
template <typename Tkv>
__device__ __forceinline__ float kv_descale(float host, const float* device, int stride, int hk) {
  if (sizeof(Tkv) != 1) return 1.f;
  return device != nullptr ? host * device[hk * stride] : host;
}

// The fused split-KV combine, after decode_body wrote this CTA's partials. Every thread's
// partials are made visible GPU-wide (fence), the CTA meets, then it arrives once on its group's
// counter (grid y and z: kv head and row chunk, sequence); the arrival that completes the count
// (atomicInc wraps the counter back to 0, ready for the next launch) elects the CTA that merges
// every split's partials of its rows. Everything is read from the parameter struct here, so the
// main loop keeps no register for it.
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, int BLOCK_N, int WARPS>
__device__ __forceinline__ void finish_split(const DecodeParams<T, Tkv>& p) {
  if (p.num_splits == 1 || p.split_arrivals == nullptr) return;
  using Smem = DecodeSmem<T, Tkv, HEAD_DIM, MT, STAGES, BLOCK_N, WARPS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  u32* is_last = reinterpret_cast<u32*>(smem_raw + Smem::kQ);  // the merge buffers are free again
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 last_arrival = static_cast<u32>(p.num_splits - 1);
    *is_last = atomicInc(p.split_arrivals + blockIdx.z * gridDim.y + blockIdx.y, last_arrival) == last_arrival;
  }
  __syncthreads();
  if (*is_last == 0) return;
  __threadfence();
  const int b = blockIdx.z;
  const int hk = blockIdx.y / p.row_chunks, chunk = blockIdx.y % p.row_chunks;
  const int group = p.num_heads / p.num_kv_heads;
  const int h0 = hk * group;
  const int row_base = chunk * Smem::kRows;
  const i64 sq_heads = static_cast<i64>(p.sq_new) * p.num_heads;  // one sequence's rows of partials
  combine_splits<T, WARPS * kWarpSize>(min(Smem::kRows, group * p.sq_new - row_base), row_base, group, p.num_splits, p.head_dim_v,
                    p.sinks != nullptr ? p.sinks + h0 : nullptr,
                    p.part_out + (b * sq_heads + h0) * p.head_dim_v, static_cast<i64>(p.num_heads) * p.head_dim_v,
                    p.head_dim_v, p.batch * sq_heads * p.head_dim_v,
                    p.part_lse + (b * sq_heads + static_cast<i64>(h0) * p.sq_new), p.sq_new, p.batch * sq_heads,
                    p.out + b * p.o_sb + h0 * p.o_sh, p.o_ss, p.o_sh,
                    p.lse != nullptr ? p.lse + b * p.lse_sb + h0 * p.lse_sh : nullptr, p.lse_sh);
}

// One CTA of decode_kernel or paged_decode_kernel (grid: x = split, y = kv head * row chunks +
// chunk, z = sequence) over the KV policy make_kv(b, hk) builds for sequence b and kv head hk:
// the call's arguments, decode_body, then the fused combine. The two kernels differ only in
// that policy.
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, bool ALIBI, int MIN_CTAS, int ROW_HALVES,
          int BLOCK_N, int WARPS, class MakeKV>
__device__ __forceinline__ void decode_cta(const DecodeParams<T, Tkv>& p, MakeKV&& make_kv) {
  const T* __restrict__ q = p.q;              // [B, Sq_new, Hq, D]
  const int* __restrict__ lens = p.lens;      // [B]
  T* __restrict__ out = p.out;
  float* __restrict__ lse = p.lse;
  float* __restrict__ part_out = p.part_out;
  float* __restrict__ part_lse = p.part_lse;
  const i64 q_sb = p.q_sb, q_ss = p.q_ss, q_sh = p.q_sh;
  const i64 o_sb = p.o_sb, o_ss = p.o_ss, o_sh = p.o_sh, lse_sb = p.lse_sb, lse_sh = p.lse_sh;
  const int batch = p.batch, sq_new = p.sq_new, num_heads = p.num_heads, num_kv_heads = p.num_kv_heads;
  const int row_chunks = p.row_chunks, num_splits = p.num_splits, max_seqlen = p.max_seqlen;
  const float score_scale = p.score_scale, softcap_out = p.softcap_out;
  const int window_left = p.window_left, window_right = p.window_right;
  const int b = blockIdx.z;
  const int hk = blockIdx.y / row_chunks;
  const int chunk = blockIdx.y % row_chunks;
  const int group = num_heads / num_kv_heads;
  const int h0 = hk * group;
  const auto kv = make_kv(b, hk);
  // a length past the cache's capacity (S_max, or the block table's) is clamped to it: never read
  // outside the cache or the table
  const DecodeArgs a{max(0, min(lens[b], max_seqlen)), sq_new, group, group * sq_new, chunk * 16 * MT, (int)blockIdx.x, num_splits,
                     MaskParams{0, window_left, window_right, score_scale * kv_descale<Tkv>(p.k_descale, p.k_scale, p.k_scale_stride, hk), softcap_out},
                     p.sinks != nullptr ? p.sinks + h0 : nullptr, kv_descale<Tkv>(p.v_descale, p.v_scale, p.v_scale_stride, hk),
                     ALIBI ? p.alibi_slopes + b * p.alibi_sb + h0 : nullptr, p.head_dim, p.head_dim_v};
  // partials are contiguous: [splits, B, Sq_new, Hq, Dv] and [splits, B, Hq, Sq_new], Dv = p.head_dim_v
  const i64 part_rows = static_cast<i64>(blockIdx.x) * batch + b;
  decode_body<T, Tkv, HEAD_DIM, MT, STAGES, ALIBI, ROW_HALVES, BLOCK_N, WARPS>(
      q + b * q_sb + h0 * q_sh, q_ss, q_sh, kv, a,
      out + b * o_sb + h0 * o_sh, o_ss, o_sh, lse != nullptr ? lse + b * lse_sb + h0 * lse_sh : nullptr, lse_sh,
      part_out + (part_rows * sq_new * num_heads + h0) * p.head_dim_v, static_cast<i64>(num_heads) * p.head_dim_v,
      p.head_dim_v,
      part_lse + (part_rows * num_heads + h0) * sq_new, sq_new);
  // the wide variants' register cap (MIN_CTAS) spills with the fused combine: the host merges
  // their splits with combine_kernel
  if constexpr (MIN_CTAS == 0) finish_split<T, Tkv, HEAD_DIM, MT, STAGES, BLOCK_N, WARPS>(p);
}

// grid: x = split, y = kv head * row chunks + chunk, z = sequence (decode_cta). MIN_CTAS: the CTAs
// an SM must hold at once (launch bounds): 0, no bound (the compiler's own register count; a bound
// of 1 let it take 172 registers instead of 162 at D = 128 over e4m3, one CTA an SM fewer), but for the
// e4m3 cache's wide variants, whose registers are capped so that more CTAs share an SM
// (cuattn/decode.py, E4M3_WIDE_DECODE_TILES). ROW_HALVES: 1 for calls of at most 8 packed rows
// (decode_body); its default keeps the names of the 16-row variants. BLOCK_N: keys a stage,
// kDecodeBlockN or kDecodeLongBlockN; WARPS: the CTA's warps (blockDim.x / 32). Their defaults
// keep the names of the default stage's four-warp variants.
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, bool ALIBI, int MIN_CTAS, int ROW_HALVES = 2,
          int BLOCK_N = kDecodeBlockN, int WARPS = kDecodeWarps>
__global__ void __launch_bounds__(WARPS * kWarpSize, MIN_CTAS)
decode_kernel(const __grid_constant__ DecodeParams<T, Tkv> p) {
  decode_cta<T, Tkv, HEAD_DIM, MT, STAGES, ALIBI, MIN_CTAS, ROW_HALVES, BLOCK_N, WARPS>(p, [&](int b, int hk) {
    const Tkv* __restrict__ k_cache = p.k;  // [B, S_max, Hk, D]
    const Tkv* __restrict__ v_cache = p.v;  // [B, S_max, Hk, Dv]
    return ContiguousKV<Tkv, StageCopy<Tkv, HEAD_DIM, BLOCK_N, WARPS>::kRun>{
        k_cache + b * p.k_sb + hk * p.k_sh, v_cache + b * p.v_sb + hk * p.v_sh, p.k_ss, p.v_ss};
  });
}

// The same over a paged cache; grid as decode_kernel.
template <typename T, typename Tkv, int HEAD_DIM, int MT, int STAGES, bool ALIBI, int MIN_CTAS, int ROW_HALVES = 2,
          int BLOCK_N = kDecodeBlockN, int WARPS = kDecodeWarps>
__global__ void __launch_bounds__(WARPS * kWarpSize, MIN_CTAS)
paged_decode_kernel(const __grid_constant__ DecodeParams<T, Tkv> p) {
  decode_cta<T, Tkv, HEAD_DIM, MT, STAGES, ALIBI, MIN_CTAS, ROW_HALVES, BLOCK_N, WARPS>(p, [&](int b, int hk) {
    const Tkv* __restrict__ k_pages = p.k;                // [num_blocks, block_size, Hk, D]
    const Tkv* __restrict__ v_pages = p.v;                // [num_blocks, block_size, Hk, Dv]
    const int* __restrict__ block_table = p.block_table;  // [B, max_blocks]
    return PagedKV<Tkv, StageCopy<Tkv, HEAD_DIM, BLOCK_N, WARPS>::kRun>{
        k_pages + hk * p.k_sh, v_pages + hk * p.v_sh, static_cast<int>(p.k_sb), static_cast<int>(p.k_ss),
        static_cast<int>(p.v_sb), static_cast<int>(p.v_ss), block_table + b * p.table_stride,
        FastDivisor{p.block_size, p.block_size_mul, p.block_size_shift}, p.num_blocks};
  });
}

// Exact merge of P partial states per row: parts [P, B, S, H, D] with lse [P, B, H, S] (any
// strides, natural-log lse) into out [B, S, H, D] and lse_out [B, H, S] (may be null).
// One CTA per (b, s, h) row: warp 0 merges the parts' states and leaves each part's weight in
// shared memory (dynamic, [P] floats); then every thread owns a column d and sums the weighted
// parts, several loads in flight. A part with lse = -inf weighs 0, whatever its output holds.
constexpr int kCombineThreads = 128;
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kCombineThreads)
combine_kernel(const __grid_constant__ CombineParams<Tin, Tout> params) {
  // `p` names the part index below
  const Tin* __restrict__ parts = params.parts;
  const float* __restrict__ part_lse = params.part_lse;
  Tout* __restrict__ out = params.out;
  float* __restrict__ lse_out = params.lse_out;
  const int num_parts = params.num_parts, seqlen = params.seqlen, heads = params.heads, head_dim = params.head_dim;
  const i64 p_part = params.p_part, p_b = params.p_b, p_s = params.p_s, p_h = params.p_h;
  const i64 l_part = params.l_part, l_b = params.l_b, l_h = params.l_h, l_s = params.l_s;
  const i64 o_b = params.o_b, o_s = params.o_s, o_h = params.o_h, lo_b = params.lo_b, lo_h = params.lo_h, lo_s = params.lo_s;
  extern __shared__ float weights[];  // [P rounded up to a multiple of 8]: the unrolled loop may read whole groups
  const i64 row = blockIdx.x;
  const int h = static_cast<int>(row % heads);
  const int s = static_cast<int>((row / heads) % seqlen);
  const int b = static_cast<int>(row / (static_cast<i64>(heads) * seqlen));
  const float* lse_row = part_lse + b * l_b + h * l_h + s * l_s;
  const Tin* part_row = parts + b * p_b + s * p_s + h * p_h;

  if (threadIdx.x < kWarpSize) {
    // each normalised part is a state with m = its lse (log2 units) and l = 1 (0 when empty);
    // lanes merge every 32nd part, then the warp merges the lanes' states
    const int lane = threadIdx.x;
    SoftmaxState merged;
    merged.init();
    for (int p = lane; p < num_parts; p += kWarpSize) {
      const float lse_p = lse_row[p * l_part];
      const SoftmaxState part{lse_p * kLog2e, lse_p == -infinity() ? 0.f : 1.f};
      float scale_self, scale_other;
      merged.merge(part, scale_self, scale_other);
    }
    // an attention sink joins the denominator once per row (it carries no value: no weight)
    if (params.sinks != nullptr && lane == 0) merged.add_sink(params.sinks[h] * kLog2e);
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const SoftmaxState other{__shfl_xor_sync(0xffffffffu, merged.m, offset),
                               __shfl_xor_sync(0xffffffffu, merged.l, offset)};
      float scale_self, scale_other;
      merged.merge(other, scale_self, scale_other);
    }
    // each part's weight is its share of the merged denominator
    const float ref = merged.reference();
    const float inv = merged.inv_sum();
    for (int p = lane; p < num_parts; p += kWarpSize) {
      const float lse_p = lse_row[p * l_part];
      weights[p] = lse_p == -infinity() ? 0.f : exp2f(lse_p * kLog2e - ref) * inv;
    }
    if (lse_out != nullptr && lane == 0) lse_out[b * lo_b + h * lo_h + s * lo_s] = merged.lse();
  }
  __syncthreads();
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
#pragma unroll kCombineUnroll
    for (int p = 0; p < num_parts; ++p) {
      // an empty part's output is never read: it may hold anything
      const float w = weights[p];
      if (w != 0.f) acc += w * DType<Tin>::to_float(part_row[p * p_part + d]);
    }
    out[b * o_b + s * o_s + h * o_h + d] = DType<Tout>::from_float(acc);
  }
}

}  // namespace cuattn
