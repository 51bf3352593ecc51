// flash_bwd.cu: FlashAttention backward by recomputation (mma.sync m16n8k16, sm_80+).
//
// Given q, k, v, out, dout and the forward's natural-log lse, computes dq, dk, dv without an
// N x N buffer: probabilities are recomputed tile by tile as P = exp(s - lse).
//
//   bwd_preprocess_kernel   delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]   (fp32);
//                           zeroes the dQ accumulator where dQ is summed in no fixed order
//   flash_bwd_kernel        one CTA per (key block, sequence, kv head): K and V of BLOCK_N keys
//                           stay in shared memory, dK and dV accumulate in registers over every
//                           query block of every query head of the kv head's group (so GQA sums
//                           happen in registers, with no per-query-head copy of k and v).
//                           ATOMIC_DQ: dQ goes to a float32 accumulator with atomicAdd (order
//                           varies run to run); otherwise dQ is left to flash_bwd_dq_kernel.
//   flash_bwd_dq_kernel     deterministic dQ: one CTA per (query block, sequence, query head)
//                           recomputes P and dP over the key blocks and sums dQ in registers.
//   bwd_convert_dq_kernel   dq = scale * dq_accum in q's dtype
//   flash_bwd_sm90_kernel   sm_90a only: flash_bwd_kernel's job for tiles D = 64-128 and the wide
//                           D = 256 tile (float4-atomic dQ), warp-specialised
//                           (a TMA producer warp, two wgmma consumer warpgroups, setmaxnreg),
//                           with dQ by float4 atomics, by one bulk reduction per tile, or
//                           (deterministic) by bulk reductions in a fixed order; described above
//                           its definition
//   bwd_convert_dq_tiles_kernel  dq = scale * the bulk reductions' tile accumulator, in q's dtype
//
// Per query block the main kernel runs five warp GEMMs on shared tiles (warp tiles of 32 x 32
// where the tile allows, so each fragment read from shared memory feeds several mma):
//   S^T  = K Q^T    [BLOCK_N x BLOCK_M]  P^T = exp2(S^T * scale * log2e - lse * log2e), masked
//                                        (ALiBi's bias joins as a per-element lse, BwdProblem::alibi_lse2)
//   dP^T = V dO^T   [BLOCK_N x BLOCK_M]  dS^T = P^T (dP^T - delta) (x (1 - tanh^2) with a softcap)
//   P^T and dS^T -> shared memory (fp16/bf16)
//   dV  += P^T dO   [BLOCK_N x D]        dK += dS^T Q   [BLOCK_N x D]   (registers)
//   dQ   = dS K     [BLOCK_M x D]        atomicAdd to the fp32 accumulator
// With STAGES = 2, Q and dO of the next query block stream in with cp.async while the current
// one computes; with one stage (where shared memory is short) each block's load is waited for.
//
// Every kernel takes one BwdParams (params.cuh), filled once per call. Layouts (element strides
// in the struct; the last axis is contiguous):
//   q, dq [B, Sq, Hq, D]   out, dout [B, Sq, Hq, Dv]   k, dk [B, Sk, Hk, D]   v, dv [B, Sk, Hk, Dv]
//   lse, delta [B, Hq, Sq]
//   dq_accum           [B, Sq, Hq, D] fp32, contiguous, zeroed by bwd_preprocess_kernel (atomic
//                      dQ); the sm_90a kernel's bulk dQ: tiles of BLOCK_M x HEAD_DIM, see above
//                      flash_bwd_sm90_kernel
// Varlen: as flash_fwd.cu (cu_seqlens pointers, batch strides 0).
// Head dims: every main and dQ kernel is instantiated for a tile head dim HEAD_DIM and takes
// D = BwdParams::head_dim (q, k, dq, dk) and Dv = BwdParams::head_dim_v (v, out, dout, dv), both
// multiples of 8 up to HEAD_DIM, as flash_fwd.cu does: columns D .. HEAD_DIM of Q and K and
// Dv .. HEAD_DIM of V and dO are zero in shared memory (the mma.sync kernels' loads write them,
// the sm_90a kernel's TMA fills them), so they add nothing to S (Q K^T) and dP (dO V^T) and give
// dQ, dK, dV columns that are not stored; dq_accum rows are D wide.
#include "attention_tile.cuh"
#include "block_range.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cuattn {

// Copy ROWS rows of HEAD_DIM elements into a padded shared tile with cp.async, zero past
// `valid_rows` and from column `head_dim` (a multiple of 8: whole 16-byte copies) on.
// BwdColumns gives both arguments for the loads inside the kernels' loops.
template <typename T, int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void bwd_load_rows(T* smem, const T* gmem, i64 row_stride, int valid_rows, int head_dim) {
  constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
  constexpr int kElemsPerChunk = kCopyBytes / sizeof(T);
#pragma unroll
  for (int idx = threadIdx.x; idx < ROWS * kChunksPerRow; idx += THREADS) {
    const int row = idx / kChunksPerRow;
    const int col = (idx % kChunksPerRow) * kElemsPerChunk;
    const bool valid = row < valid_rows && col < head_dim;
    cp_async_16(smem + row * SmemRow<HEAD_DIM>::kStride + col, valid ? gmem + row * row_stride + col : gmem, valid);
  }
}

// The run-time head dim as the loops' bwd_load_rows calls see it. Where THREADS is a multiple of
// the 16-byte chunks of a row, every copy of a thread lands in the same column, so whether that
// column lies before the head dim is one predicate, tested once per kernel: the copies then take
// valid_rows = 0 and the head dim drops out of the loop (held in a register across it, it spilled
// the deterministic dQ kernel at D = 64). Otherwise each copy compares its column.
template <typename T, int HEAD_DIM, int THREADS>
struct BwdColumns {
  static constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
  static constexpr bool kFixed = THREADS % kChunksPerRow == 0;
  bool mine;     // kFixed: this thread's column lies before the head dim
  int head_dim;  // !kFixed: the head dim each copy compares its column with

  __device__ __forceinline__ explicit BwdColumns(int d)
      : mine((threadIdx.x % kChunksPerRow) * (kCopyBytes / static_cast<int>(sizeof(T))) < d), head_dim(d) {}
  __device__ __forceinline__ int rows(int valid_rows) const { return !kFixed || mine ? valid_rows : 0; }
  __device__ __forceinline__ int limit() const { return kFixed ? HEAD_DIM : head_dim; }
};

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[mt][nt][e] = 0.f;
}

// Store a warp's fp32 [MT m16 x NT n8] accumulator to a padded shared tile as T pairs.
template <typename T, int MT, int NT, int STRIDE>
__device__ __forceinline__ void store_tile(T* tile, const float (&c)[MT][NT][4], int row0, int col0, int lane) {
  const int g = lane / kQuadSize, tq = lane % kQuadSize;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      T* at = tile + (row0 + mt * 16 + g) * STRIDE + col0 + nt * 8 + 2 * tq;
      *reinterpret_cast<u32*>(at) = DType<T>::pack(c[mt][nt][0], c[mt][nt][1]);
      *reinterpret_cast<u32*>(at + 8 * STRIDE) = DType<T>::pack(c[mt][nt][2], c[mt][nt][3]);
    }
}

// dst[0] += x, dst[1] += y (dst 8-byte aligned). Hopper has a vector float2 atomic: half the
// L2 atomic operations, which bound the dQ accumulation.
__device__ __forceinline__ void atomic_add_pair(float* dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// delta = rowsum(dout * out) over the (b, i, h) rows of the view (varlen: the packed rows as one
// batch entry, whose batch strides are 0). A row is read in 16-byte chunks (kPreprocessChunk
// elements: every row is 16-byte aligned, Dv a multiple of 8) by bwd_preprocess_lanes(Dv) lanes
// (the power of two that covers its chunks, at most a warp), so a warp takes 32 / lanes rows at
// once, and each lane kPreprocessRows such rows, a warp's rows apart, their loads all issued
// before the first sum (with one 2-byte element per lane and one row per warp it took 191 us at
// N = 4k, D = 128 on the H200, 151 us with one row a lane, 139 us with 32-bit divisions, and
// 147 -> 98 us (ncu's locked clocks; 113 -> 77 us unlocked) with four rows a lane; beside about
// 5.3 ms of main kernel).
constexpr int kPreprocessWarps = 4;
constexpr int kPreprocessChunk = 8;  // elements of one 16-byte load
constexpr int kPreprocessRows = 4;   // rows a lane reads at once
constexpr i64 kU32Max = 0xffffffffll;

__host__ __device__ constexpr int bwd_preprocess_lanes(int head_dim_v) {
  int lanes = 1;
  while (lanes < kWarpSize && lanes * kPreprocessChunk < head_dim_v) lanes *= 2;
  return lanes;
}

template <typename T>
__global__ void __launch_bounds__(kPreprocessWarps * kWarpSize)
bwd_preprocess_kernel(const BwdParams<T> p) {
  static_assert(sizeof(T) * kPreprocessChunk == 16, "16-byte chunks");
  const int lanes = bwd_preprocess_lanes(p.head_dim_v);
  const int views = p.cu_seqlens_q != nullptr ? 1 : p.batch;
  const int lane = threadIdx.x % kWarpSize;
  const i64 rows = static_cast<i64>(views) * p.rows_q * p.num_heads;
  const int rows_per_pass = kPreprocessWarps * (kWarpSize / lanes);  // the CTA's rows at once
  const i64 first = blockIdx.x * static_cast<i64>(rows_per_pass) * kPreprocessRows + static_cast<int>(threadIdx.x) / lanes;
  // this lane's rows first + r * rows_per_pass: their (b, i, h), live ones' chunks loaded at once
  int h[kPreprocessRows], i[kPreprocessRows], b[kPreprocessRows];
  bool live[kPreprocessRows];
  uint4 o[kPreprocessRows], d[kPreprocessRows];
  const int col = (lane % lanes) * kPreprocessChunk;
#pragma unroll
  for (int r = 0; r < kPreprocessRows; ++r) {
    const i64 row = first + static_cast<i64>(r) * rows_per_pass;
    live[r] = row < rows;
    // 32-bit divisions where the rows fit (64-bit ones are emulated, a hundred instructions each,
    // against a thread's two 16-byte loads a row)
    if (rows <= kU32Max) {
      const u32 x = static_cast<u32>(row), heads = p.num_heads, rows_q = p.rows_q;
      h[r] = static_cast<int>(x % heads);
      i[r] = static_cast<int>(x / heads % rows_q);
      b[r] = static_cast<int>(x / heads / rows_q);
    } else {
      h[r] = static_cast<int>(row % p.num_heads);
      i[r] = static_cast<int>((row / p.num_heads) % p.rows_q);
      b[r] = static_cast<int>(row / (static_cast<i64>(p.num_heads) * p.rows_q));
    }
    // one chunk a lane: Dv is at most kWarpSize chunks (256), and lanes cover it
    const bool load = live[r] && col < p.head_dim_v;
    o[r] = load ? *reinterpret_cast<const uint4*>(p.out + b[r] * p.o_sb + i[r] * p.o_ss + h[r] * p.o_sh + col)
                : make_uint4(0u, 0u, 0u, 0u);
    d[r] = load ? *reinterpret_cast<const uint4*>(p.dout + b[r] * p.do_sb + i[r] * p.do_ss + h[r] * p.do_sh + col)
                : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int r = 0; r < kPreprocessRows; ++r) {
    const T* oe = reinterpret_cast<const T*>(&o[r]);
    const T* de = reinterpret_cast<const T*>(&d[r]);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < kPreprocessChunk; ++e) acc += DType<T>::to_float(oe[e]) * DType<T>::to_float(de[e]);
    // the row's lanes are consecutive and their count a power of two: a butterfly within them
    for (int offset = lanes / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (live[r] && lane % lanes == 0) p.delta[b[r] * p.lse_sb + h[r] * p.lse_sh + i[r]] = acc;
  }
  // The atomic and unordered bulk dQ sums add into dq_accum: zeroed here, in 16-byte stores over
  // the whole grid, instead of by a memset launch of its own, the stores beside this kernel's
  // loads (its sizes are multiples of 8 floats, D and the tiles' widths; allocations 16-byte
  // aligned)
  const i64 threads = static_cast<i64>(gridDim.x) * blockDim.x;
  float4* dq_accum = reinterpret_cast<float4*>(p.dq_accum);
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < p.dq_accum_zero_floats / 4; idx += threads)
    dq_accum[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// The per-(b, head) geometry both recomputing kernels share: sequence offsets (varlen), lengths
// and the mask, with the visible key range of a query row [diag - left, diag + right] where
// diag = row + Sk - Sq (bottom-right alignment).
struct BwdProblem : SequenceRange {
  int window_left, window_right;
  float score_scale, softcap_out;

  __device__ __forceinline__ BwdProblem(const int* cu_q, const int* cu_k, int b, int sq, int sk, int left, int right,
                                        float scale, float cap)
      : SequenceRange(cu_q, cu_k, b, sq, sk), window_left(left), window_right(right), score_scale(scale),
        softcap_out(cap) {}

  // Whether some (query, key) of the tile is invisible: only such tiles pay for the mask.
  __device__ __forceinline__ bool tile_needs_mask(int m0, int rows, int n0, int cols) const {
    return m0 + rows > seqlen_q || n0 + cols > seqlen_k || n0 + cols - 1 > m0 + offset + window_right ||
           n0 < m0 + rows - 1 + offset - window_left;
  }

  __device__ __forceinline__ bool visible(int query, int key) const {
    const int diag = query + offset;
    return query < seqlen_q && key < seqlen_k && key <= diag + window_right && key >= diag - window_left;
  }

  // P = exp2(scaled (capped) score - lse2) for one element; lse2 = lse * log2(e), +inf on empty rows.
  // SOFTCAP: softcap_out > 0 (a template flag, see with_tile_flags).
  template <bool SOFTCAP>
  __device__ __forceinline__ float probability(float s, float lse2) const {
    const float x = SOFTCAP ? tanhf(s * score_scale) * softcap_out : s * score_scale;
    return exp2f(x - lse2);
  }

  // ALiBi's bias in log2 units, b = -alibi2 * |query + Sk - Sq - key| (alibi2 = slope * log2(e)),
  // joins P = exp2(x + b - lse2) as exp2(x - (lse2 - b)): folded into lse2, it leaves
  // probability() as it is and score_grad() too: the bias is a constant of (query, key), so dS
  // takes no term of its own, and the softcap's tanh is still recovered from log2(p) + (lse2 - b).
  // Without ALIBI it is lse2 itself; an empty row's +inf stays +inf.
  template <bool ALIBI>
  __device__ __forceinline__ float alibi_lse2(float lse2, float alibi2, int query, int key) const {
    if constexpr (!ALIBI) return lse2;
    return fmaf(alibi2, fabsf(static_cast<float>(query + offset - key)), lse2);
  }

  // dS = P (dP - delta), times the softcap's derivative 1 - tanh^2 (tanh recovered from P).
  template <bool SOFTCAP>
  __device__ __forceinline__ float score_grad(float p, float dp, float delta, float lse2) const {
    float grad = p * (dp - delta);
    if (SOFTCAP && p > 0.f) {
      const float t = (__log2f(p) + lse2) / softcap_out;
      grad *= 1.f - t * t;
    }
    return grad;
  }
};

// A compile-time bool handed to a generic lambda.
template <bool B>
struct TileFlag {
  static constexpr bool value = B;
};

// f(TileFlag<masked>, TileFlag<softcap>): the elementwise loops of a tile, instantiated once per
// combination, so that tiles inside the mask skip its compares and calls without a softcap its
// tanh. Both conditions are uniform across the CTA; left to the compiler, this unswitching
// happened or not depending on the kernel's parameter list (without it the sm_90a kernel ran
// 20-30% slower).
template <class F>
__device__ __forceinline__ void with_tile_flags(bool masked, bool softcap, F&& f) {
  if (masked) {
    if (softcap) f(TileFlag<true>{}, TileFlag<true>{});
    else f(TileFlag<true>{}, TileFlag<false>{});
  } else {
    if (softcap) f(TileFlag<false>{}, TileFlag<true>{});
    else f(TileFlag<false>{}, TileFlag<false>{});
  }
}

// ALiBi slope of (b, h) in log2 units (unread without ALIBI).
template <bool ALIBI>
__device__ __forceinline__ float bwd_alibi2(const float* alibi_slopes, i64 alibi_sb, int b, int h) {
  return ALIBI ? alibi_slopes[b * alibi_sb + h] * kLog2e : 0.f;
}

// lse2 of a query row as the kernels use it: padding rows and empty rows (lse = -inf) get +inf,
// so exp2(s - lse2) = 0, never NaN.
__device__ __forceinline__ float bwd_lse2(const float* lse, i64 at, bool valid) {
  const float l = valid ? lse[at] : -infinity();
  return l == -infinity() ? infinity() : l * kLog2e;
}

// Warp layouts: S_WARPS_N warps along the keys of S^T (the rest along queries), KV_WARPS_N along
// the keys of dK/dV (the rest along D), DQ_WARPS_M along the queries of dQ (the rest along D).
// ALIBI (here and in the other main and dQ kernels): alibi_slopes is set and its bias joins lse2; a
// template flag so that the kernels without ALiBi keep the registers they had before it existed.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int S_WARPS_N, int KV_WARPS_N,
          int DQ_WARPS_M, int STAGES, int MIN_BLOCKS, bool ATOMIC_DQ, bool ALIBI>
__global__ void __launch_bounds__(NUM_WARPS * kWarpSize, MIN_BLOCKS)
flash_bwd_kernel(const BwdParams<T> p) {
  // the arrays as __restrict__ locals, as the positional arguments were: no two alias, so
  // loads may take the read-only path and stay in flight across stores
  const T* __restrict__ q = p.q;
  const T* __restrict__ k = p.k;
  const T* __restrict__ v = p.v;
  const T* __restrict__ dout = p.dout;
  const float* __restrict__ lse = p.lse;
  const float* __restrict__ delta = p.delta;
  float* __restrict__ dq_accum = p.dq_accum;
  T* __restrict__ dk = p.dk;
  T* __restrict__ dv = p.dv;
  using DT = DType<T>;
  constexpr int kThreads = NUM_WARPS * kWarpSize;
  constexpr int kStride = SmemRow<HEAD_DIM>::kStride;
  constexpr int kPStride = SmemRow<BLOCK_M>::kStride;  // sP, sdS rows: BLOCK_M queries + pad
  // S^T / dP^T warp tile: kSKeys keys x kSQueries queries
  constexpr int kSKeys = BLOCK_N / S_WARPS_N, kSQueries = BLOCK_M / (NUM_WARPS / S_WARPS_N);
  // dK / dV warp tile: kKvKeys keys x kKvCols of D
  constexpr int kKvKeys = BLOCK_N / KV_WARPS_N, kKvCols = HEAD_DIM / (NUM_WARPS / KV_WARPS_N);
  // dQ warp tile: kDqRows queries x kDqCols of D
  constexpr int kDqRows = BLOCK_M / DQ_WARPS_M, kDqCols = HEAD_DIM / (NUM_WARPS / DQ_WARPS_M);
  static_assert(kSKeys % 16 == 0 && kSQueries % 16 == 0 && kKvKeys % 16 == 0 && kKvCols % 16 == 0 &&
                    kDqRows % 16 == 0 && kDqCols % 16 == 0,
                "warp tiles are whole m16 x n16 steps");
  // the loop prefetches one query block ahead: a third stage would only take shared memory
  static_assert(STAGES == 1 || STAGES == 2, "one or two Q/dO stages");

  const i64 bhk = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  if (bhk >= static_cast<i64>(p.batch) * p.num_kv_heads) return;
  const int b = static_cast<int>(bhk / p.num_kv_heads);
  const int hk = static_cast<int>(bhk % p.num_kv_heads);
  const int group = p.num_heads / p.num_kv_heads;
  const BwdProblem pb(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, p.score_scale,
                      p.softcap_out);
  const int n0 = blockIdx.x * BLOCK_N;
  if (n0 >= pb.seqlen_k) return;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);        // [BLOCK_N, D + pad]
  T* sV = sK + BLOCK_N * kStride;                // [BLOCK_N, D + pad]
  T* sQ = sV + BLOCK_N * kStride;                // [STAGES, BLOCK_M, D + pad]
  T* sdO = sQ + STAGES * BLOCK_M * kStride;      // [STAGES, BLOCK_M, D + pad]
  T* sP = sdO + STAGES * BLOCK_M * kStride;      // [BLOCK_N, BLOCK_M + pad]: P^T, keys by queries
  T* sdS = sP + BLOCK_N * kPStride;              // [BLOCK_N, BLOCK_M + pad]: dS^T
  float* sLse = reinterpret_cast<float*>(sdS + BLOCK_N * kPStride);  // [STAGES, BLOCK_M] lse * log2(e)
  float* sDelta = sLse + STAGES * BLOCK_M;                            // [STAGES, BLOCK_M]

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / kQuadSize, tq = lane % kQuadSize;
  const int s_key0 = (warp % S_WARPS_N) * kSKeys, s_query0 = (warp / S_WARPS_N) * kSQueries;
  const int kv_key0 = (warp % KV_WARPS_N) * kKvKeys, kv_col0 = (warp / KV_WARPS_N) * kKvCols;
  const int dq_row0 = (warp % DQ_WARPS_M) * kDqRows, dq_col0 = (warp / DQ_WARPS_M) * kDqCols;

  // K and V of this block stay for the whole CTA
  bwd_load_rows<T, BLOCK_N, HEAD_DIM, kThreads>(sK, k + b * p.k_sb + (pb.k_start + n0) * p.k_ss + hk * p.k_sh, p.k_ss,
                                                pb.seqlen_k - n0, p.head_dim);
  bwd_load_rows<T, BLOCK_N, HEAD_DIM, kThreads>(sV, v + b * p.v_sb + (pb.k_start + n0) * p.v_ss + hk * p.v_sh, p.v_ss,
                                                pb.seqlen_k - n0, p.head_dim_v);

  float dK[kKvKeys / 16][kKvCols / 8][4], dV[kKvKeys / 16][kKvCols / 8][4];  // fp32, this warp's tile
  zero(dK);
  zero(dV);

  // Query rows that see any of keys [n0, n0 + BLOCK_N): i + offset + right >= n0 and
  // i + offset - left <= n0 + BLOCK_N - 1.
  const int m_begin = max(0, n0 - pb.offset - pb.window_right);
  const int m_end = min(pb.seqlen_q, n0 + BLOCK_N - 1 - pb.offset + pb.window_left + 1);
  const int m_block_begin = m_begin / BLOCK_M;
  const int m_blocks = m_end > m_begin ? (m_end + BLOCK_M - 1) / BLOCK_M - m_block_begin : 0;
  const int steps = group * m_blocks;  // (query head, query block) pairs, head-major

  // the fields the lambdas below read, as locals: a lambda that captured p by reference would
  // take the parameter's address and put the whole struct in local memory
  const i64 q_sb = p.q_sb;
  const i64 q_ss = p.q_ss;
  const i64 q_sh = p.q_sh;
  const i64 do_sb = p.do_sb;
  const i64 do_ss = p.do_ss;
  const i64 do_sh = p.do_sh;
  const i64 lse_sb = p.lse_sb;
  const i64 lse_sh = p.lse_sh;
  // Q, dO (cp.async) and lse, delta of step `step` into stage `stage`
  const BwdColumns<T, HEAD_DIM, kThreads> columns(p.head_dim), columns_v(p.head_dim_v);
  auto load_step = [&](int step, int stage) {
    const int h = hk * group + step / m_blocks;
    const int m0 = (m_block_begin + step % m_blocks) * BLOCK_M;
    bwd_load_rows<T, BLOCK_M, HEAD_DIM, kThreads>(sQ + stage * BLOCK_M * kStride,
                                                  q + b * q_sb + (pb.q_start + m0) * q_ss + h * q_sh, q_ss,
                                                  columns.rows(pb.seqlen_q - m0), columns.limit());
    bwd_load_rows<T, BLOCK_M, HEAD_DIM, kThreads>(sdO + stage * BLOCK_M * kStride,
                                                  dout + b * do_sb + (pb.q_start + m0) * do_ss + h * do_sh, do_ss,
                                                  columns_v.rows(pb.seqlen_q - m0), columns_v.limit());
    for (int i = threadIdx.x; i < BLOCK_M; i += kThreads) {
      const bool valid = m0 + i < pb.seqlen_q;
      const i64 at = b * lse_sb + h * lse_sh + pb.q_start + m0 + i;
      sLse[stage * BLOCK_M + i] = bwd_lse2(lse, at, valid);
      sDelta[stage * BLOCK_M + i] = valid ? delta[at] : 0.f;
    }
  };

  if (steps > 0) load_step(0, 0);
  cp_async_commit();

  for (int step = 0; step < steps; ++step) {
    const int stage = STAGES > 1 ? step % STAGES : 0;
    const int h = hk * group + step / m_blocks;
    const int m0 = (m_block_begin + step % m_blocks) * BLOCK_M;
    if constexpr (STAGES > 1) {
      // prefetch the next step's Q and dO into the other stage while this one computes
      if (step + 1 < steps) {
        load_step(step + 1, (step + 1) % STAGES);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    } else {
      // one stage: the previous step's final barrier freed it
      if (step > 0) {
        load_step(step, 0);
        cp_async_commit();
      }
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* cQ = sQ + stage * BLOCK_M * kStride;
    const T* cdO = sdO + stage * BLOCK_M * kStride;
    const float* cLse = sLse + stage * BLOCK_M;
    const float* cDelta = sDelta + stage * BLOCK_M;

    // S^T = K Q^T and dP^T = V dO^T on this warp's keys x queries
    float s[kSKeys / 16][kSQueries / 8][4], dp[kSKeys / 16][kSQueries / 8][4];
    zero(s);
    zero(dp);
    warp_gemm_pair<T, kSKeys / 16, kSQueries / 8, HEAD_DIM, false, false, kStride, kStride>(
        s, sK, cQ, dp, sV, cdO, s_key0, s_query0, lane);

    // P^T and dS^T: mask only tiles that cross a boundary
    const float alibi2 = bwd_alibi2<ALIBI>(p.alibi_slopes, p.alibi_sb, b, h);
    // a copy of the loop per mask and softcap case, except that the softcap is tested per element
    // in the atomic-dQ tile at D = 128, where the copies spill (sm_80)
    constexpr bool kSoftcapCopies = !(HEAD_DIM == 128 && ATOMIC_DQ);
    const bool softcap = pb.softcap_out > 0.f;
    with_tile_flags(pb.tile_needs_mask(m0, BLOCK_M, n0, BLOCK_N), kSoftcapCopies && softcap, [&](auto mask, auto cap) {
      const auto capped = [&] { return kSoftcapCopies ? decltype(cap)::value : softcap; };
#pragma unroll
      for (int mt = 0; mt < kSKeys / 16; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSQueries / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n0 + s_key0 + mt * 16 + g + (e / 2) * 8;
            const int col = s_query0 + nt * 8 + 2 * tq + (e % 2);
            const float lse2 = pb.alibi_lse2<ALIBI>(cLse[col], alibi2, m0 + col, key);
            float prob = capped() ? pb.template probability<true>(s[mt][nt][e], lse2)
                                  : pb.template probability<false>(s[mt][nt][e], lse2);
            if (decltype(mask)::value && !pb.visible(m0 + col, key)) prob = 0.f;
            s[mt][nt][e] = prob;
            dp[mt][nt][e] = capped() ? pb.template score_grad<true>(prob, dp[mt][nt][e], cDelta[col], lse2)
                                     : pb.template score_grad<false>(prob, dp[mt][nt][e], cDelta[col], lse2);
          }
    });
    store_tile<T, kSKeys / 16, kSQueries / 8, kPStride>(sP, s, s_key0, s_query0, lane);
    store_tile<T, kSKeys / 16, kSQueries / 8, kPStride>(sdS, dp, s_key0, s_query0, lane);
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q over this block's queries
    warp_gemm_pair<T, kKvKeys / 16, kKvCols / 8, BLOCK_M, false, true, kPStride, kStride>(
        dV, sP, cdO, dK, sdS, cQ, kv_key0, kv_col0, lane);

    if constexpr (ATOMIC_DQ) {
      // dQ = dS K over this block's keys (dS read transposed from sdS), added to the accumulator;
      // wide warp tiles go in column chunks so the dQ registers fit beside dK and dV (n16 chunks
      // where 32 columns do not divide the tile: 80 columns at D = 160)
      constexpr int kDqWideTile = 64, kDqChunkColumns = 32, kDqNarrowChunk = 16;
      constexpr int kDqChunk = kDqCols <= kDqWideTile ? kDqCols
                               : kDqCols % kDqChunkColumns == 0 ? kDqChunkColumns : kDqNarrowChunk;
      static_assert(kDqCols % kDqChunk == 0, "dQ column chunks tile the warp's columns");
#pragma unroll
      for (int c0 = dq_col0; c0 < dq_col0 + kDqCols; c0 += kDqChunk) {
        if (c0 >= p.head_dim) continue;  // a chunk wholly past the head dim (the condition is warp-uniform)
        float dq[kDqRows / 16][kDqChunk / 8][4];
        zero(dq);
        warp_gemm<T, kDqRows / 16, kDqChunk / 8, BLOCK_N, true, true, kPStride, kStride>(dq, sdS, dq_row0, sK, c0,
                                                                                          lane);
#pragma unroll
        for (int mt = 0; mt < kDqRows / 16; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int query = m0 + dq_row0 + mt * 16 + g + 8 * r;
            if (query >= pb.seqlen_q) continue;
            float* dst = dq_accum + b * p.acc_sb + ((pb.q_start + query) * p.num_heads + h) * p.head_dim + c0 + 2 * tq;
#pragma unroll
            for (int nt = 0; nt < kDqChunk / 8; ++nt) {
              if (c0 + nt * 8 < p.head_dim) atomic_add_pair(dst + nt * 8, dq[mt][nt][2 * r], dq[mt][nt][2 * r + 1]);
            }
          }
      }
    }
    // every warp is done with this stage's Q, dO, sP and sdS before they are overwritten
    __syncthreads();
  }

  // (a block no query sees issued only its K and V copies)
  cp_async_wait<0>();

  // dK (times the softmax scale) and dV of this warp's tile
#pragma unroll
  for (int mt = 0; mt < kKvKeys / 16; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = n0 + kv_key0 + mt * 16 + g + 8 * r;
      if (key >= pb.seqlen_k) continue;
      T* dk_row = dk + b * p.dk_sb + (pb.k_start + key) * p.dk_ss + hk * p.dk_sh + kv_col0 + 2 * tq;
      T* dv_row = dv + b * p.dv_sb + (pb.k_start + key) * p.dv_ss + hk * p.dv_sh + kv_col0 + 2 * tq;
#pragma unroll
      for (int nt = 0; nt < kKvCols / 8; ++nt) {
        if (kv_col0 + nt * 8 < p.head_dim)
          *reinterpret_cast<u32*>(dk_row + nt * 8) =
              DT::pack(dK[mt][nt][2 * r] * p.softmax_scale, dK[mt][nt][2 * r + 1] * p.softmax_scale);
        if (kv_col0 + nt * 8 < p.head_dim_v)
          *reinterpret_cast<u32*>(dv_row + nt * 8) = DT::pack(dV[mt][nt][2 * r], dV[mt][nt][2 * r + 1]);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// sm_90a: the main kernel on warpgroup MMA (wgmma), warp-specialised as in FlashAttention-3.
//
// Three warpgroups per CTA. Warpgroup 0, the producer, gives its registers up (setmaxnreg) and
// one warp of it loads; warpgroups 1 and 2, the consumers, take the registers and compute. A CTA
// owns BLOCK_N = 128 keys and walks BLOCK_M = 64 queries per step; consumer c owns keys
// [64 c, 64 c + 64) of the block for S^T, dP^T, dV and dK. (Wide tiles, D above 128, split the
// work the other way: see kBwdSm90MaxKvCols.)
//
// Loads (the producer warp; rows as 4-D (D, S, H, B) TMA views, varlen (D, total, H, 1), boxes of
// one 128-byte panel of columns):
//   K, V [BLOCK_N, D]       once, by TMA (k_map, v_map), onto the kv barrier
//   Q, dO [BLOCK_M, D]      per step, by TMA (q_map, do_map), into stage step % STAGES
//   lse, delta [BLOCK_M]    per step, by cp.async from the warp's 32 lanes, into the same stage
// Each stage has a "full" mbarrier (the TMA bytes, plus one arrival per lane when its cp.async
// copies land: 1 + 32 arrivals) and an "empty" one (every consumer thread arrives once its GEMMs
// have read the stage). Rows past a sequence: the TMA reads zeros past the tensor's end and the
// next sequence's rows inside a packed (varlen) one, cp.async reads zeros; all finite, and such
// rows only appear in tiles that take the mask, which zeroes their probabilities and so dS.
//
// Per step, each consumer (all tiles 128-byte swizzled, wgmma.cuh):
//   S^T  = K Q^T, dP^T = V dO^T        ss, both operands K-major, two commit groups
//   P^T, dS^T in registers             the exponentials start while dP^T is in flight; P^T and
//                                      dS^T leave the accumulators as the A fragments below
//   dV += P^T dO, dK += dS^T Q         rs, B (dO, Q) read MN-major from the stage
//   dS^T -> shared, dQ = dS K          ss, both operands MN-major; dQ leaves as DQ_MODE says
// dQ and the two consumers. dQ sums over all 128 keys, so it needs both consumers' dS^T rows:
// consumer s % 2 computes all of D of step s (the two take the steps in turn: one dQ tile a step,
// not two halves over keys, so half the dQ traffic; and at D = 128 one m64n128 GEMM a step, which
// reads 48 KB of shared memory where two m64n64 halves read 64 KB). The dQ GEMM of step s runs in
// step s + 1, after that step's dV and dK GEMMs are issued (at D = 128 once they are done: see
// kDqAfterKv), from one of kBwdSm90DsBuffers dS^T buffers (buffer s % 2), guarded by two mbarriers
// each: ds_full (both consumers wrote their rows) and ds_empty (the GEMMs that read it are done;
// both consumers arrive). The other consumer wrote its rows a step earlier, so the wait is
// seldom a wait. Past the start there is no CTA-wide barrier: the consumers drift apart, and
// one's exponentials run under the other's GEMMs.
//
// DQ_MODE, how each step's dQ tile (64 queries x D, fp32) reaches global memory:
//   kBwdDqNone     not at all (flash_bwd_dq_kernel computes dQ: the older deterministic path)
//   kBwdDqAtomic   float4 atomicAdd per element quad into dq_accum [B, Sq, Hq, D]
//   kBwdDqBulk     each consumer stages its dQ part in shared memory (two parts in turn) and hands
//                  it (dq_full) to a dQ writer of its own, one lane of producer warp 1 + c, which
//                  issues one cp.reduce.async.bulk (.add.f32) into the tile's contiguous slot of
//                  the tile accumulator and frees the part (dq_empty) once it has been read: a
//                  few instructions per tile instead of 2048 (D = 128) vector atomics, L2 sees
//                  whole lines, and the consumer never waits for L2
//   kBwdDqOrdered  kBwdDqBulk whose reductions into each tile happen in a fixed order, so dQ is
//                  bit-identical run to run (deterministic=True)
//
// Tile accumulator (bulk modes): dq_accum [tiles, BLOCK_M * D] fp32, tile = b * acc_tile_sb +
// h * acc_tile_sh + q_block0(b) + query block, where q_block0 is 0 dense and
// (cu_seqlens_q[b] + b * BLOCK_M) / BLOCK_M varlen (each sequence's blocks start on a fresh
// tile, and the b * BLOCK_M keeps them from overlapping the previous sequence's last block).
// A tile holds [BLOCK_M, D] (one step's whole dQ: the bulk tiles' consumers take the steps in
// turn) in wgmma accumulator order, so that the shared staging stores are conflict-free float4s of
// consecutive threads:
//   element (row, col) -> (j * 128 + t) * 4 + 2 r + col % 2
//   with j = col / 8, t = 32 (row / 16) + 4 (row % 8) + (col % 8) / 2, r = (row % 16) / 8
// (t the thread of the warpgroup holding it, 4 j + 2 r + col % 2 its accumulator index);
// bwd_convert_dq_tiles_kernel undoes it. Rows past the sequence's end hold zeros (their
// probabilities are masked to 0), which the convert kernel does not store.
//
// Ordered reductions (kBwdDqOrdered). dq_semaphores [tiles] int32, zeroed, count the reductions
// done into each tile; cta_ticket [1] int32, zeroed, hands out work in the order CTAs start. The
// key blocks that visit query block m form a range [first(m), last(m)] (the mask is a band); a
// CTA's rank there is key_block - first(m) (ascending) or last(m) - key_block (dq_descending: a
// bounded right window side, e.g. causal, where the highest key block reaches a query block first
// because it starts at its diagonal); a CTA reduces into each tile once. The issuing thread spins
// until the semaphore equals its rank, reduces (rank 0 stores: the ordered accumulator is not
// zeroed, and a tile whose semaphore is still 0 after the kernel was visited by no key block,
// which the convert kernel reads as zeros), waits for the
// writes to be performed and adds one. That thread is the consumer's dQ writer, so the
// waits stall no GEMM unless the writer falls a whole step behind. Deadlock-free without
// co-residency: a CTA takes its (kv head, key block) from the ticket, ordered so that it only
// ever waits on CTAs with smaller tickets, which were running before it and themselves only
// wait on smaller tickets.
//
// dK and dV through the TMA (bwd_sm90_dkv_by_tma below, and p.dkv_by_tma: dense dk and dv the
// TMA can write). At the end a consumer's own dQ staging parts hold its 64 rows of dK (times the
// softmax scale) and dV as two swizzled [64, D] tiles, once its writer has read its last staged
// parts out; thread 0 of the consumer then stores them with one box per panel and tensor (rows
// past Sk and columns past D or Dv lie outside the maps). Otherwise, and for varlen (rows past a
// sequence belong to the next), 32-bit stores from the accumulators: scattered over eight rows
// per instruction, they kept the store queue full for 5-9% of the kernel's warp time at N = 1k
// (ncu, BENCHMARKS.md "Twentieth session").
//
// Barriers: 0 (__syncthreads) once, after the mbarriers are initialised; consumer c's own
// kBwdSm90ConsumerBarrier + c before its dK and dV stores; the rest are mbarriers. A consumer
// rewrites a dQ staging part only after its writer has seen the part's previous reduction read it
// (bulk_wait_read, then dq_empty).
constexpr int kBwdSm90BlockN = 128;
constexpr int kBwdSm90Consumers = 2;
// Wide tiles (D above this) split dK and dV by columns: 64 keys x D of both would not fit a
// consumer's registers. The CTA then takes 64 keys (BLOCK_N = 64) and consumer c computes S^T and
// dP^T for query columns [32 c, 32 c + 32) of each step, writes its half of P^T and dS^T to
// shared memory, and once both halves are in (ds_full) keeps columns [c D / 2, (c + 1) D / 2) of
// dV += P^T dO, dK += dS^T Q and dQ = dS K, with P^T and dS^T read from shared memory. No GEMM is
// done twice. The dQ tiles do not fit beside the tiles in shared memory: float4 atomics.
constexpr int kBwdSm90MaxKvCols = 128;
template <int HEAD_DIM>
__host__ __device__ constexpr bool bwd_sm90_wide() { return HEAD_DIM > kBwdSm90MaxKvCols; }
template <int HEAD_DIM>
__host__ __device__ constexpr int bwd_sm90_block_n() { return bwd_sm90_wide<HEAD_DIM>() ? kWgmmaM : kBwdSm90BlockN; }
constexpr int kBwdSm90Threads = (kBwdSm90Consumers + 1) * kWarpgroupThreads;
constexpr int kBwdSm90Stages = 2;     // Q/dO/lse/delta stages of the producer's ring
constexpr int kBwdSm90DsBuffers = 2;  // dS^T buffers: a step's, and the one the delayed dQ GEMM reads
constexpr int kBwdSm90DqStages = 2;   // bulk dQ staging parts per consumer at most: one staged, one being read
constexpr int kBwdSm90ProducerRegs = 24;
constexpr int kBwdSm90ConsumerRegs = consumer_registers(kBwdSm90Consumers, kBwdSm90ProducerRegs);
// mbarriers: kv_full, full and empty per stage, ds_full and ds_empty per dS^T buffer, dq_full and
// dq_empty per bulk dQ staging part
constexpr int kBwdSm90Barriers = 1 + 2 * kBwdSm90Stages + 2 * kBwdSm90DsBuffers + 2 * kBwdSm90Consumers * kBwdSm90DqStages;
// the full barrier's arrivals: the producer lane's expect_tx and the loading warp's cp.async lanes
constexpr int kBwdSm90FullArrivals = 1 + kWarpSize;
constexpr int kBwdDqNone = 0;
constexpr int kBwdDqAtomic = 1;
constexpr int kBwdDqBulk = 2;
constexpr int kBwdDqOrdered = 3;
constexpr int kBwdSm90ConsumerBarrier = 1;  // + c: consumer c's named barrier
// The most accumulators (dK, dV and dQ, a thread) beside which a consumer issues the dQ GEMM while
// the dV and dK GEMMs still read P^T's and dS^T's fragments (D = 96's 144 build clean at 240
// registers; D = 128's 192 did not: kDqAfterKv in the kernel).
constexpr int kBwdSm90DqBesideKvAccumulators = 160;

// Who computes dQ (always over all BLOCK_N keys): the consumers take the steps in turn, each the
// whole of D, at D = 64-128 (at D = 64-96 a half of 32, 40 or 48 columns would start inside a
// swizzle panel, where no MN-major descriptor of K starts; at D = 128 the halves took the main
// kernel 5.31 ms at N = 4k against 5.10 ms for the whole, on the H200: BENCHMARKS.md "Thirty-first
// session"); a wide tile's consumers each compute their half of D.
template <int HEAD_DIM>
__host__ __device__ constexpr bool bwd_sm90_dq_alternate() {
  return !bwd_sm90_wide<HEAD_DIM>();
}
template <int HEAD_DIM>
__host__ __device__ constexpr int bwd_sm90_dq_cols() {
  return bwd_sm90_dq_alternate<HEAD_DIM>() ? HEAD_DIM : HEAD_DIM / kBwdSm90Consumers;
}

// Whether the consumers can stage dK and dV in their bulk dQ parts for the TMA: a bulk dQ mode and
// two [64, D] tiles within a consumer's parts (D = 64 and 128; the single 24 KB part of D = 80
// and 96 holds one).
template <int HEAD_DIM, int DQ_MODE, int DQ_STAGE_BYTES>
__host__ __device__ constexpr bool bwd_sm90_dkv_by_tma() {
  return (DQ_MODE == kBwdDqBulk || DQ_MODE == kBwdDqOrdered) && !bwd_sm90_wide<HEAD_DIM>() &&
         2 * SwizzledTile<kWgmmaM, panel_cols(HEAD_DIM)>::kBytes <= DQ_STAGE_BYTES;
}

// dst[0..3] += v (dst 16-byte aligned): Hopper's vector atomic, a quarter of the scalar operations.
__device__ __forceinline__ void atomic_add_quad(float* dst, float4 v) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// Shared memory of flash_bwd_sm90_kernel, byte offsets from a 1024-byte-aligned base. Python
// mirrors kBytes (cuattn/attention.py, BwdTile.smem_bytes). Rows of D columns are padded to whole
// 64-column panels (D = 96 takes two), which the TMA fills with zeros past the array's own D.
template <int HEAD_DIM, int BLOCK_M, bool BULK_DQ>
struct BwdSm90Smem {
  static constexpr int STAGES = kBwdSm90Stages;
  static constexpr int BLOCK_N = bwd_sm90_block_n<HEAD_DIM>();
  using KTile = SwizzledTile<BLOCK_N, panel_cols(HEAD_DIM)>;  // K, V   [BLOCK_N, D]
  using QTile = SwizzledTile<BLOCK_M, panel_cols(HEAD_DIM)>;  // Q, dO  [BLOCK_M, D] per stage
  using STile = SwizzledTile<BLOCK_N, BLOCK_M>;               // dS^T   [BLOCK_N, BLOCK_M] per buffer
  static constexpr int kK = 0;
  static constexpr int kV = kK + KTile::kBytes;
  static constexpr int kQ = kV + KTile::kBytes;
  static constexpr int kdO = kQ + STAGES * QTile::kBytes;
  static constexpr int kdS = kdO + STAGES * QTile::kBytes;
  // wide tiles: P^T [BLOCK_N, BLOCK_M] per dS^T buffer, beside it
  static constexpr int kP = kdS + kBwdSm90DsBuffers * STile::kBytes;
  // lse [STAGES, BLOCK_M] fp32, natural log
  static constexpr int kLse = kP + (bwd_sm90_wide<HEAD_DIM>() ? kBwdSm90DsBuffers * STile::kBytes : 0);
  static constexpr int kDelta = kLse + STAGES * BLOCK_M * sizeof(float);  // [STAGES, BLOCK_M] fp32
  // bulk dQ staging: [consumers, kDqStages, BLOCK_M * kDqCols] fp32; two parts a consumer where
  // they fit (D = 80, 96 and 128 have room for one: their consumers take the steps in turn, so one
  // part still has a step of slack before it is restaged)
  static constexpr int kdQ = kDelta + STAGES * BLOCK_M * sizeof(float);
  static constexpr int kDqPartBytes = BLOCK_M * bwd_sm90_dq_cols<HEAD_DIM>() * sizeof(float);
  // the dynamic allocation's base is only 16-byte aligned: one atom of slack to round it up
  static constexpr int kOverhead = kBwdSm90Barriers * kMbarrierBytes + kSwizzleAtomBytes;
  static constexpr int kDqStages =
      kdQ + kBwdSm90Consumers * kBwdSm90DqStages * kDqPartBytes + kOverhead <= kSm90MaxSmem ? kBwdSm90DqStages : 1;
  static constexpr int kdQBytes = BULK_DQ ? kBwdSm90Consumers * kDqStages * kDqPartBytes : 0;
  static constexpr int kBarriers = kdQ + kdQBytes;  // [kBwdSm90Barriers] mbarriers
  static constexpr int kBytes = kBarriers + kOverhead;
  static_assert(kBytes <= kSm90MaxSmem, "the tiles fit in shared memory");
};

template <typename T, int HEAD_DIM, int BLOCK_M, int DQ_MODE, bool ALIBI>
__global__ void __launch_bounds__(kBwdSm90Threads, 1)
flash_bwd_sm90_kernel(const __grid_constant__ BwdParams<T> p) {
  // the arrays as __restrict__ locals: no two alias, so loads may take the read-only path and
  // stay in flight across stores
  const float* __restrict__ lse = p.lse;
  const float* __restrict__ delta = p.delta;
  float* __restrict__ dq_accum = p.dq_accum;
  T* __restrict__ dk = p.dk;
  T* __restrict__ dv = p.dv;
  constexpr bool kBulkDq = DQ_MODE == kBwdDqBulk || DQ_MODE == kBwdDqOrdered;
  using DT = DType<T>;
  using Smem = BwdSm90Smem<HEAD_DIM, BLOCK_M, kBulkDq>;
  using KTile = typename Smem::KTile;
  using QTile = typename Smem::QTile;
  using STile = typename Smem::STile;
  constexpr int STAGES = Smem::STAGES;
  constexpr int BLOCK_N = Smem::BLOCK_N;
  // a wide tile's consumers both take all BLOCK_N keys, and split dK and dV by columns
  constexpr bool kWide = bwd_sm90_wide<HEAD_DIM>();
  constexpr int kKeysPerWarpgroup = kWide ? BLOCK_N : BLOCK_N / kBwdSm90Consumers;
  constexpr int kKvCols = kWide ? HEAD_DIM / kBwdSm90Consumers : HEAD_DIM;
  // query columns of S^T and dP^T this consumer computes: all of the step's, or (wide) its half
  constexpr int kQueries = kWide ? BLOCK_M / kBwdSm90Consumers : BLOCK_M;
  constexpr int kPanels = panel_cols(HEAD_DIM) / kSwizzlePanelCols;  // TMA boxes per row block: one per panel
  // dQ over all keys: all of D by consumer step % 2, or (wide) half of D by each consumer
  constexpr bool kDqAlternate = bwd_sm90_dq_alternate<HEAD_DIM>();
  constexpr int kDqCols = bwd_sm90_dq_cols<HEAD_DIM>();
  // the dQ a consumer emits: every step's, or (alternate) every other one's, from step c on
  constexpr int kDqStride = kDqAlternate ? kBwdSm90Consumers : 1;
  using SdP = Wgmma<T, kQueries>;  // S^T, dP^T: 64 keys x kQueries queries
  using KV = WgmmaRow<T, kKvCols>;  // dV, dK: 64 keys x D (one n80 or n96 at D = 80, 96), or D / 2
  using DQ = WgmmaRow<T, kDqCols>;   // dQ: 64 queries x kDqCols
  // The dQ GEMM is issued once the step's dV and dK GEMMs are done (their A fragments, P^T and dS^T,
  // then free) where the accumulators of dK, dV and a whole-D dQ (192 registers at D = 128) leave
  // no room for those fragments beside them: issued while they were live, ptxas serialised every
  // wgmma of the kernel (C7512, insufficient registers). D = 64-96 issue it beside the dV and dK
  // GEMMs.
  constexpr bool kDqAfterKv = 2 * KV::kAccumulators + DQ::kAccumulators > kBwdSm90DqBesideKvAccumulators;
  static_assert(kKeysPerWarpgroup == kWgmmaM, "one m64 row tile of keys per consumer");
  static_assert(BLOCK_M == kWgmmaM, "one m64 tile of queries: S^T's N and dQ's rows");
  static_assert(HEAD_DIM % kWgmmaK == 0 && kKvCols <= kBwdSm90MaxKvCols,
                "whole k16 steps; dK, dV of 128 columns at most");
  static_assert(wgmma_row_panel_aligned(kKvCols) && wgmma_row_panel_aligned(kDqCols),
                "the MN-major GEMMs' pieces start at panels");
  static_assert(!kWide || (kKvCols % kSwizzlePanelCols == 0 && !kBulkDq), "a wide tile: panel halves, atomic dQ");
  // (so a bulk dQ tile, BLOCK_M x D, is one step's whole dQ: one staging part and one semaphore)
  static_assert(!kBulkDq || kDqCols == HEAD_DIM, "bulk dQ: the consumers take the steps in turn");
  // a staging part: one step's dQ, BLOCK_M x kDqCols fp32, DQ::kAccumulators per thread of a warpgroup
  constexpr int kDqPartFloats = BLOCK_M * kDqCols;
  static_assert(kDqPartFloats == DQ::kAccumulators * kWarpgroupThreads, "a part is one warpgroup's accumulators");
  constexpr int kDqStages = Smem::kDqStages;
  // dK and dV leave through the TMA from the consumer's dQ parts (above the kernel)
  constexpr bool kDkvByTma = bwd_sm90_dkv_by_tma<HEAD_DIM, DQ_MODE, kDqStages * Smem::kDqPartBytes>();
  using KvTile = SwizzledTile<kWgmmaM, panel_cols(HEAD_DIM)>;  // a consumer's dK or dV [64, D], staged
  static_assert(!kDkvByTma || (Smem::kdQ % kSwizzleAtomBytes == 0 && Smem::kDqPartBytes % kSwizzleAtomBytes == 0),
                "staged dK and dV start on swizzle atoms");
  static_assert(kBwdSm90ConsumerRegs == 240, "two consumers at 240 registers");

  // (kv head, key block) of this CTA: the grid position, or (ordered dQ) the ticket's, so that
  // the semaphore waits only ever point at CTAs that started earlier. Bulk dQ takes the key
  // blocks in the ordered mode's order (descending where dq_descending says), so that the CTAs
  // running at once walk the same query blocks together: their Q, dO and dQ tiles meet in L2.
  i64 bhk = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  int key_block = kBulkDq && p.dq_descending ? static_cast<int>(gridDim.x) - 1 - blockIdx.x : blockIdx.x;
  if constexpr (DQ_MODE == kBwdDqOrdered) {
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = atomicAdd(p.cta_ticket, 1);
    __syncthreads();
    bhk = ticket / static_cast<int>(gridDim.x);
    const int x = ticket % static_cast<int>(gridDim.x);
    key_block = p.dq_descending ? static_cast<int>(gridDim.x) - 1 - x : x;
  }
  if (bhk >= static_cast<i64>(p.batch) * p.num_kv_heads) return;
  const int b = static_cast<int>(bhk / p.num_kv_heads);
  const int hk = static_cast<int>(bhk % p.num_kv_heads);
  const int group = p.num_heads / p.num_kv_heads;
  const BwdProblem pb(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, p.score_scale,
                      p.softcap_out);
  const int n0 = key_block * BLOCK_N;
  if (n0 >= pb.seqlen_k) return;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 raw_addr = smem_address(smem_raw);
  const u32 smem0 = (raw_addr + kSwizzleAtomBytes - 1) & ~static_cast<u32>(kSwizzleAtomBytes - 1);
  unsigned char* base = smem_raw + (smem0 - raw_addr);
  const u32 sK = smem0 + Smem::kK, sV = smem0 + Smem::kV;
  float* sLse = reinterpret_cast<float*>(base + Smem::kLse);
  float* sDelta = reinterpret_cast<float*>(base + Smem::kDelta);
  const u32 bars = smem0 + Smem::kBarriers;
  const u32 kv_full = bars;
  const auto full = [&](int stage) { return bars + (1 + stage) * kMbarrierBytes; };
  const auto empty = [&](int stage) { return bars + (1 + STAGES + stage) * kMbarrierBytes; };
  const auto ds_full = [&](int buf) { return bars + (1 + 2 * STAGES + buf) * kMbarrierBytes; };
  const auto ds_empty = [&](int buf) { return bars + (1 + 2 * STAGES + kBwdSm90DsBuffers + buf) * kMbarrierBytes; };
  // staging part `part` = c * kDqStages + stage (the barriers are laid out for kBwdSm90DqStages)
  constexpr int kDqParts = kBwdSm90Consumers * kBwdSm90DqStages;
  const auto dq_full = [&](int part) { return bars + (1 + 2 * STAGES + 2 * kBwdSm90DsBuffers + part) * kMbarrierBytes; };
  const auto dq_empty = [&](int part) {
    return bars + (1 + 2 * STAGES + 2 * kBwdSm90DsBuffers + kDqParts + part) * kMbarrierBytes;
  };

  // Query rows that see any of keys [n0, n0 + BLOCK_N) (as in flash_bwd_kernel)
  const int m_begin = max(0, n0 - pb.offset - pb.window_right);
  const int m_end = min(pb.seqlen_q, n0 + BLOCK_N - 1 - pb.offset + pb.window_left + 1);
  const int m_block_begin = m_begin / BLOCK_M;
  const int m_blocks = m_end > m_begin ? (m_end + BLOCK_M - 1) / BLOCK_M - m_block_begin : 0;
  const int steps = group * m_blocks;  // (query head, query block) pairs, head-major
  // Every key block of a head adds into the same dQ rows: with atomics, starting each CTA at a
  // different query block spreads them over the accumulator instead of queueing them on the
  // same lines. The bulk modes walk the query blocks in ascending order instead: ordered, so that
  // the CTA a rank waits for reaches each block before it (descending ranks: it started further
  // along) or at the same step (ascending ranks: then the CTAs of a head settle one reduction
  // apart); and either way the CTAs of a head share their Q and dO loads in L2.
  const int m_rotation = !kBulkDq && m_blocks > 0 ? static_cast<int>(blockIdx.x % m_blocks) : 0;
  const auto step_m0 = [&](int step) {
    int m = step % m_blocks + m_rotation;
    m = m >= m_blocks ? m - m_blocks : m;
    return (m_block_begin + m) * BLOCK_M;
  };
  const auto step_head = [&](int step) { return hk * group + step / m_blocks; };

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&p.q_map);
    prefetch_tensor_map(&p.k_map);
    prefetch_tensor_map(&p.v_map);
    prefetch_tensor_map(&p.do_map);
    mbarrier_init(kv_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(full(s), kBwdSm90FullArrivals);
      mbarrier_init(empty(s), kBwdSm90Consumers * kWarpgroupThreads);
    }
    for (int i = 0; i < kBwdSm90DsBuffers; ++i) {
      mbarrier_init(ds_full(i), kBwdSm90Consumers * kWarpgroupThreads);
      mbarrier_init(ds_empty(i), kBwdSm90Consumers * kWarpgroupThreads);
    }
    for (int part = 0; part < kDqParts; ++part) {
      mbarrier_init(dq_full(part), kWarpgroupThreads);
      mbarrier_init(dq_empty(part), 1);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // (the warpgroup through a shuffle: ptxas then knows it is warp-uniform, and a branch on the
  // consumer index, as D = 64's alternating dQ takes, is no divergent path that serialises wgmma)
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
  const int lane = threadIdx.x % kWarpSize;
  if (wg == 0) {
    // ---- producer: warp 0 loads (lane 0 the TMA boxes, every lane its rows of lse and delta);
    // (bulk dQ) lane 0 of warp 1 + c reduces consumer c's staged dQ parts into the tile
    // accumulator; the other threads only give their registers up
    registers_decrease<kBwdSm90ProducerRegs>();
    const int warp = threadIdx.x / kWarpSize;
    if (steps == 0) return;
    if constexpr (kBulkDq) {
      if (warp >= 1 && warp <= kBwdSm90Consumers && lane == 0) {
        // The dQ writer of consumer c, which stages the dQ of every other step from step c (its
        // e-th is step c + e * kDqStride). The consumer never waits for L2: only for the writer to
        // have issued the previous part's reduction and seen it read out of shared memory.
        const int c = warp - 1;
        constexpr u32 kPartBytes = kDqPartFloats * sizeof(float);
        // (32-bit tile arithmetic: far fewer than 2^31 tiles fit in memory)
        const int q_block0 =
            p.cu_seqlens_q != nullptr ? static_cast<int>((pb.q_start + static_cast<i64>(b) * BLOCK_M) / BLOCK_M) : 0;
        for (int e = 0, i = c; i < steps; ++e, i += kDqStride) {
          const int m0 = step_m0(i);
          const int tile =
              b * static_cast<int>(p.acc_tile_sb) + step_head(i) * static_cast<int>(p.acc_tile_sh) + q_block0 + m0 / BLOCK_M;
          float* dst = dq_accum + static_cast<i64>(tile) * (BLOCK_M * HEAD_DIM);
          int* sem = p.dq_semaphores + tile;
          const int part = c * kDqStages + e % kDqStages;
          mbarrier_wait(dq_full(part), (e / kDqStages) & 1);
          int rank = 1;  // (unordered: every reduction adds into the zeroed accumulator)
          if constexpr (DQ_MODE == kBwdDqOrdered) {
            // rank among the key blocks that visit this query block (the range [first, last])
            const int first = max(0, m0 + pb.offset - pb.window_left) / BLOCK_N;
            const int last = min((pb.seqlen_k + BLOCK_N - 1) / BLOCK_N - 1,
                                 (m0 + BLOCK_M - 1 + pb.offset + pb.window_right) / BLOCK_N);
            rank = p.dq_descending ? last - key_block : key_block - first;
            if (!semaphore_wait_equal(sem, rank)) __trap();
            // the earlier reductions (released with the semaphore) come before ours
            fence_proxy_async_global();
          }
          // the first of the ordered writes stores the tile: the accumulator is not zeroed
          if (rank == 0)
            bulk_store(dst, smem0 + Smem::kdQ + part * kPartBytes, kPartBytes);
          else
            bulk_reduce_add_f32(dst, smem0 + Smem::kdQ + part * kPartBytes, kPartBytes);
          bulk_commit();
          bulk_wait_read<0>();
          mbarrier_arrive(dq_empty(part));  // the consumer may stage into it again
          if constexpr (DQ_MODE == kBwdDqOrdered) {
            bulk_wait<0>();
            fence_proxy_async_global();
            semaphore_increment(sem);
          }
        }
        // the reductions read their parts before the CTA's shared memory goes
        bulk_wait<0>();
        return;
      }
    }
    if (warp != 0) return;
    const int tma_b = p.cu_seqlens_q != nullptr ? 0 : b;  // varlen: the packed view's one batch entry
    if (lane == 0) {
      mbarrier_arrive_expect_tx(kv_full, 2 * KTile::kBytes);
      const int row = static_cast<int>(pb.k_start) + n0;
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel) {
        tma_load_4d(sK + panel * KTile::kPanelBytes, &p.k_map, kv_full, panel * kSwizzlePanelCols, row, hk, tma_b);
        tma_load_4d(sV + panel * KTile::kPanelBytes, &p.v_map, kv_full, panel * kSwizzlePanelCols, row, hk, tma_b);
      }
    }
    for (int step = 0; step < steps; ++step) {
      const int stage = step % STAGES;
      const int h = step_head(step);
      const int m0 = step_m0(step);
      // every consumer is done with the step that used this stage before
      mbarrier_wait(empty(stage), ((step / STAGES) & 1) ^ 1);
      if (lane == 0) {
        mbarrier_arrive_expect_tx(full(stage), 2 * QTile::kBytes);
        const int row = static_cast<int>(pb.q_start) + m0;
        const u32 sQ = smem0 + Smem::kQ + stage * QTile::kBytes, sdO = smem0 + Smem::kdO + stage * QTile::kBytes;
#pragma unroll
        for (int panel = 0; panel < kPanels; ++panel) {
          tma_load_4d(sQ + panel * QTile::kPanelBytes, &p.q_map, full(stage), panel * kSwizzlePanelCols, row, h, tma_b);
          tma_load_4d(sdO + panel * QTile::kPanelBytes, &p.do_map, full(stage), panel * kSwizzlePanelCols, row, h,
                      tma_b);
        }
      }
      // lse and delta rows [[[B, Hq, Sq]]] past the sequence read 0 (see above)
      for (int i = lane; i < BLOCK_M; i += kWarpSize) {
        const bool valid = m0 + i < pb.seqlen_q;
        const i64 at = b * p.lse_sb + h * p.lse_sh + pb.q_start + m0 + i;
        cp_async_4(sLse + stage * BLOCK_M + i, valid ? lse + at : lse, valid);
        cp_async_4(sDelta + stage * BLOCK_M + i, valid ? delta + at : delta, valid);
      }
      cp_async_mbarrier_arrive_noinc(full(stage));
    }
    // (the warp's copies land before it exits)
    cp_async_wait<0>();
    return;
  }

  // ---- consumers: consumer c owns keys [64 c, 64 c + 64) of the block
  registers_increase<kBwdSm90ConsumerRegs>();
  const int c = wg - 1;
  const int wg_thread = threadIdx.x % kWarpgroupThreads;
  const int wg_warp = wg_thread / kWarpSize;
  const int g = lane / kQuadSize, tq = lane % kQuadSize;
  const int key0 = kWide ? 0 : c * kKeysPerWarpgroup;  // this consumer's keys within the block,
  const int q0 = kWide ? c * kQueries : 0;               // its query columns of S^T and dP^T,
  const int kv_col0 = kWide ? c * kKvCols : 0;           // and its columns of dK and dV
  const int dq_col0 = kDqAlternate ? 0 : c * kDqCols;
  const u32 sdS = smem0 + Smem::kdS;

  float dK[KV::kAccumulators], dV[KV::kAccumulators];  // fp32: this consumer's 64 keys x D
#pragma unroll
  for (int i = 0; i < KV::kAccumulators; ++i) dK[i] = dV[i] = 0.f;
  if (steps > 0) mbarrier_wait(kv_full, 0);

  // dQ = dS K of step `src` (its dS^T in buffer src % 2) over all BLOCK_N keys, issued as one
  // commit group once both consumers' rows of the buffer are in: dS read MN-major from dS^T, K
  // MN-major ([key][d]). The issue and its accumulators sit whole inside the owner's branch (the
  // consumer index comes through a shuffle, so ptxas knows the branch is warp-uniform).
  const auto issue_dq = [&](float (&dq)[DQ::kAccumulators], int src) {
    const int buf = src % kBwdSm90DsBuffers;
    mbarrier_wait(ds_full(buf), (src / kBwdSm90DsBuffers) & 1);
    const u32 dS_keys = sdS + buf * STile::kBytes;
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / kWgmmaK; ++ks)
      DQ::template ss<1, 1>(dq, mnmajor_descriptor<STile>(dS_keys, 0, ks),
                            [&](int col) { return mnmajor_descriptor<KTile>(sK, dq_col0 + col, ks); }, ks > 0);
    wgmma_commit();
  };

  // dQ of step `src`, computed (the GEMM waited for), to global memory as DQ_MODE says
  const auto emit_dq = [&](const float (&dq)[DQ::kAccumulators], int src) {
    if constexpr (DQ_MODE == kBwdDqAtomic) {
      const int h = step_head(src);
      const int m0 = step_m0(src);
      // lanes t and t ^ 1 hold neighbouring column pairs: swap halves so that each adds four
      // consecutive columns at once (the even lane of n8 tiles 2 p, the odd lane of 2 p + 1)
      const bool odd = tq % 2;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int query = m0 + wg_warp * 16 + g + 8 * r;
        float* dst = dq_accum + b * p.acc_sb + ((pb.q_start + query) * p.num_heads + h) * p.head_dim + dq_col0 +
                     2 * (tq & ~1);
#pragma unroll
        for (int j = 0; j < kDqCols / 8; j += 2) {
          const float* even_tile = dq + 4 * j + 2 * r;
          const float* odd_tile = dq + 4 * (j + 1) + 2 * r;
          // the pair this lane adds, and the one it hands its partner (selects, not a runtime
          // index: the accumulator must stay in registers)
          const float mine0 = odd ? odd_tile[0] : even_tile[0], mine1 = odd ? odd_tile[1] : even_tile[1];
          const float give0 = odd ? even_tile[0] : odd_tile[0], give1 = odd ? even_tile[1] : odd_tile[1];
          const float x = __shfl_xor_sync(0xffffffffu, give0, 1);
          const float y = __shfl_xor_sync(0xffffffffu, give1, 1);
          const float4 quad = odd ? make_float4(x, y, mine0, mine1) : make_float4(mine0, mine1, x, y);
          if (query < pb.seqlen_q && dq_col0 + 8 * (j + odd) < p.head_dim) atomic_add_quad(dst + 8 * (j + odd), quad);
        }
      }
    } else if constexpr (kBulkDq) {
      // Stage the part in accumulator order (float4 j of thread t at j * 128 + t) and hand it
      // to the writer (the caller waited for the part to be free: dq_part_free); src is this
      // consumer's (src / kDqStride)-th
      const int part_index = c * kDqStages + (src / kDqStride) % kDqStages;
      float4* part = reinterpret_cast<float4*>(base + Smem::kdQ) + part_index * (kDqPartFloats / 4);
#pragma unroll
      for (int j = 0; j < DQ::kAccumulators / 4; ++j)
        part[j * kWarpgroupThreads + wg_thread] = make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
      // the stores reach the bulk copy's async proxy before the writer reads them
      fence_proxy_async();
      mbarrier_arrive(dq_full(part_index));
    }
  };

  // Whether this consumer computes the dQ of step `src` (src >= 0).
  const auto owns_dq = [&](int src) { return !kDqAlternate || src % kBwdSm90Consumers == c; };
  // (bulk) wait until the writer has seen the staging part of step `src` (this consumer's e-th
  // dQ, e = src / kDqStride, in part e % kDqStages) read out for its dQ before last (two parts)
  // or last (one part, whose consumer owns every other step), a step or more of slack. Waited
  // for at the top of a step, with the stage's wait: a spin between the GEMMs made ptxas
  // serialise the wgmma.
  const auto dq_part_free = [&](int src) {
    if (kBulkDq && src >= 0 && owns_dq(src)) {
      const int e = src / kDqStride;
      mbarrier_wait(dq_empty(c * kDqStages + e % kDqStages), ((e / kDqStages) & 1) ^ 1);
    }
  };

  for (int step = 0; step < steps; ++step) {
    const int stage = step % STAGES;
    const int h = step_head(step);
    const int m0 = step_m0(step);
    // this step's Q, dO (TMA) and lse, delta (cp.async) have landed
    mbarrier_wait(full(stage), (step / STAGES) & 1);
    dq_part_free(step - 1);
    const u32 cQ = smem0 + Smem::kQ + stage * QTile::kBytes;
    const u32 cdO = smem0 + Smem::kdO + stage * QTile::kBytes;
    const float* cLse = sLse + stage * BLOCK_M;
    const float* cDelta = sDelta + stage * BLOCK_M;

    // S^T = K Q^T and dP^T = V dO^T on this consumer's 64 keys x kQueries queries, as two
    // groups: the exponentials of P^T run while dP^T is still in the tensor cores
    float s[SdP::kAccumulators], dp[SdP::kAccumulators];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / kWgmmaK; ++ks)
      SdP::template ss<0, 0>(s, kmajor_descriptor<KTile>(sK, key0, ks), kmajor_descriptor<QTile>(cQ, q0, ks), ks > 0);
    wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / kWgmmaK; ++ks)
      SdP::template ss<0, 0>(dp, kmajor_descriptor<KTile>(sV, key0, ks), kmajor_descriptor<QTile>(cdO, q0, ks), ks > 0);
    wgmma_commit();
    // this lane's query columns' lse2 while the GEMMs run (after the wait, the shared loads
    // would sit on the critical path)
    float lse2[kQueries / 8][2];
#pragma unroll
    for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float l = cLse[q0 + 8 * j + 2 * tq + e];
        lse2[j][e] = l == -infinity() ? infinity() : l * kLog2e;  // empty rows: P = 0, never NaN
      }
    wgmma_wait<1>();
    fence_registers(s);

    // P^T = exp2(S^T * scale - lse2): masked only on tiles that cross a boundary
    const int key_row = n0 + key0 + wg_warp * 16 + g;
    // the fields the lambdas below read, as locals: a lambda that captured p by reference would
    // take the parameter's address and put the whole struct in local memory
    const float* alibi_slopes = p.alibi_slopes;
    const i64 alibi_sb = p.alibi_sb;
    // lse2 of element e of query group j (query m0 + q0 + 8 j + 2 tq + e % 2, key key_row + 8 (e / 2)),
    // ALiBi's bias included; the slope is read where it is used (an L1 hit) instead of held in a
    // register across the GEMM waits
    const auto element_lse2 = [&](int j, int e) {
      return pb.alibi_lse2<ALIBI>(lse2[j][e % 2], bwd_alibi2<ALIBI>(alibi_slopes, alibi_sb, b, h),
                                  m0 + q0 + 8 * j + 2 * tq + e % 2, key_row + 8 * (e / 2));
    };
    const bool softcap = pb.softcap_out > 0.f;
    with_tile_flags(pb.tile_needs_mask(m0, BLOCK_M, n0, BLOCK_N), softcap, [&](auto mask, auto cap) {
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float prob = pb.template probability<decltype(cap)::value>(s[4 * j + e], element_lse2(j, e));
          if (decltype(mask)::value && !pb.visible(m0 + q0 + 8 * j + 2 * tq + e % 2, key_row + 8 * (e / 2)))
            prob = 0.f;
          s[4 * j + e] = prob;
        }
    });

    // dS^T = P^T (dP^T - delta) (delta read before the wait, as lse2)
    float row_delta[kQueries / 8][2];
#pragma unroll
    for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) row_delta[j][e] = cDelta[q0 + 8 * j + 2 * tq + e];
    wgmma_wait<0>();
    fence_registers(dp);
    u32 dsa[kQueries / kWgmmaK][4];
    // one copy of the loop per softcap case (7-13% faster on the H200 than a test per element)
    with_tile_flags(false, softcap, [&](auto, auto cap) {
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[4 * j + e] = pb.template score_grad<decltype(cap)::value>(s[4 * j + e], dp[4 * j + e], row_delta[j][e % 2],
                                                                       element_lse2(j, e));
    });
    // P^T and dS^T packed into the A fragments of the two GEMMs below (k step j = queries
    // q0 + 16 j .. + 15), only now: packed P^T held across the dS loop cost 16 registers where
    // the consumers have none to spare
    u32 pa[kQueries / kWgmmaK][4];
#pragma unroll
    for (int j = 0; j < kQueries / kWgmmaK; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[j][r] = DT::pack(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
        dsa[j][r] = DT::pack(dp[8 * j + 2 * r], dp[8 * j + 2 * r + 1]);
      }

    if constexpr (kWide) {
      // P^T and dS^T halves to buffer step % 2 (once the GEMMs that read it two steps back are
      // done), then, once the other consumer's halves are in, this consumer's columns of
      // dV += P^T dO, dK += dS^T Q and dQ = dS K, all three from shared memory
      const int buf = step % kBwdSm90DsBuffers;
      const int phase = (step / kBwdSm90DsBuffers) & 1;
      mbarrier_wait(ds_empty(buf), phase ^ 1);
      unsigned char* p_tile = base + Smem::kP + buf * STile::kBytes;
      unsigned char* dS_tile = base + Smem::kdS + buf * STile::kBytes;
#pragma unroll
      for (int j = 0; j < kQueries / kWgmmaK; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = wg_warp * 16 + g + 8 * (r % 2);
          const int col = q0 + 16 * j + 8 * (r / 2) + 2 * tq;
          *reinterpret_cast<u32*>(p_tile + STile::offset(row, col)) = pa[j][r];
          *reinterpret_cast<u32*>(dS_tile + STile::offset(row, col)) = dsa[j][r];
        }
      fence_proxy_async();
      mbarrier_arrive(ds_full(buf));
      mbarrier_wait(ds_full(buf), phase);
      const u32 sP = smem0 + Smem::kP + buf * STile::kBytes, sdS_buf = sdS + buf * STile::kBytes;
      wgmma_fence(dV, dK);
#pragma unroll
      for (int k = 0; k < BLOCK_M / kWgmmaK; ++k)
        KV::template ss<0, 1>(dV, kmajor_descriptor<STile>(sP, 0, k),
                              [&](int col) { return mnmajor_descriptor<QTile>(cdO, kv_col0 + col, k); }, 1);
#pragma unroll
      for (int k = 0; k < BLOCK_M / kWgmmaK; ++k)
        KV::template ss<0, 1>(dK, kmajor_descriptor<STile>(sdS_buf, 0, k),
                              [&](int col) { return mnmajor_descriptor<QTile>(cQ, kv_col0 + col, k); }, 1);
      wgmma_commit();
      if constexpr (DQ_MODE != kBwdDqNone) {
        float dq[DQ::kAccumulators];
        issue_dq(dq, step);
        wgmma_wait<0>();
        fence_registers(dq);
        fence_registers(dV);
        fence_registers(dK);
        mbarrier_arrive(empty(stage));
        mbarrier_arrive(ds_empty(buf));
        emit_dq(dq, step);
      } else {
        wgmma_wait<0>();
        fence_registers(dV);
        fence_registers(dK);
        mbarrier_arrive(empty(stage));
        mbarrier_arrive(ds_empty(buf));
      }
    } else {
      // dV += P^T dO and dK += dS^T Q: 64 keys x D over this block's queries
      wgmma_fence(dV, dK, pa, dsa);
#pragma unroll
      for (int j = 0; j < BLOCK_M / kWgmmaK; ++j)
        KV::template rs<1>(dV, pa[j], [&](int col) { return mnmajor_descriptor<QTile>(cdO, kv_col0 + col, j); }, 1);
#pragma unroll
      for (int j = 0; j < BLOCK_M / kWgmmaK; ++j)
        KV::template rs<1>(dK, dsa[j], [&](int col) { return mnmajor_descriptor<QTile>(cQ, kv_col0 + col, j); }, 1);
      wgmma_commit();

      if constexpr (DQ_MODE != kBwdDqNone) {
        // dS^T to buffer step % 2, once the buffer's readers (the dQ GEMM of two steps back) are
        // done: fragment register r of k step j holds rows +8 (r odd), columns +8 (r >= 2)
        const int buf = step % kBwdSm90DsBuffers;
        mbarrier_wait(ds_empty(buf), ((step / kBwdSm90DsBuffers) & 1) ^ 1);
        unsigned char* dS_tile = base + Smem::kdS + buf * STile::kBytes;
#pragma unroll
        for (int j = 0; j < BLOCK_M / kWgmmaK; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int row = key0 + wg_warp * 16 + g + 8 * (r % 2);
            const int col = 16 * j + 8 * (r / 2) + 2 * tq;
            *reinterpret_cast<u32*>(dS_tile + STile::offset(row, col)) = dsa[j][r];
          }
        // the rows are visible to wgmma, and announced to the other consumer
        fence_proxy_async();
        mbarrier_arrive(ds_full(buf));
      }
      // The dQ GEMM of the previous step, whose dS^T rows the other consumer wrote a step ago: by
      // its owner (every other step), or in a wide tile by both (each its half of D). Owner or
      // not, the stage goes back to the producer once the dV and dK GEMMs are done, and the dS^T
      // buffer once its reader's GEMM is (ds_empty counts both consumers).
      const int dq_src = step - 1;
      const auto step_done = [&] {
        fence_registers(pa);
        fence_registers(dsa);
        fence_registers(dV);
        fence_registers(dK);
        mbarrier_arrive(empty(stage));
      };
      if (DQ_MODE == kBwdDqNone || dq_src < 0 || !owns_dq(dq_src)) {
        wgmma_wait<0>();
        step_done();
        if (DQ_MODE != kBwdDqNone && dq_src >= 0) mbarrier_arrive(ds_empty(dq_src % kBwdSm90DsBuffers));
      } else {
        float dq[DQ::kAccumulators];
        if constexpr (kDqAfterKv) {
          wgmma_wait<0>();
          step_done();
          wgmma_fence();
        }
        issue_dq(dq, dq_src);
        wgmma_wait<0>();
        fence_registers(dq);
        if constexpr (!kDqAfterKv) step_done();
        mbarrier_arrive(ds_empty(dq_src % kBwdSm90DsBuffers));
        emit_dq(dq, dq_src);
      }
    }
  }
  // the last step's dQ (a wide tile's is done in its step)
  if (!kWide && DQ_MODE != kBwdDqNone && steps > 0 && owns_dq(steps - 1)) {
    float dq[DQ::kAccumulators];
    dq_part_free(steps - 1);
    wgmma_fence();
    issue_dq(dq, steps - 1);
    wgmma_wait<0>();
    fence_registers(dq);
    emit_dq(dq, steps - 1);
  }

  // dK (times the softmax scale) and dV of this consumer's 64 keys and kKvCols columns, those
  // below D and Dv: through the TMA (above the kernel), or 32-bit stores
  if (kDkvByTma && p.dkv_by_tma != 0) {
    // the writer has read this consumer's last staged dQ parts (its e-th dQ went to part
    // e % kDqStages, whose dq_empty phase e / kDqStages completes once the part is read)
    const int emits = (steps - c + 1) / kBwdSm90Consumers;  // (every other step from step c)
    for (int e = max(0, emits - kDqStages); e < emits; ++e)
      mbarrier_wait(dq_empty(c * kDqStages + e % kDqStages), (e / kDqStages) & 1);
    const int staged = Smem::kdQ + c * kDqStages * Smem::kDqPartBytes;  // dK [64, D], then dV [64, D]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wg_warp * 16 + g + 8 * r;
#pragma unroll
      for (int j = 0; j < kKvCols / 8; ++j) {
        *reinterpret_cast<u32*>(base + staged + KvTile::offset(row, 8 * j + 2 * tq)) =
            DT::pack(dK[4 * j + 2 * r] * p.softmax_scale, dK[4 * j + 2 * r + 1] * p.softmax_scale);
        *reinterpret_cast<u32*>(base + staged + KvTile::kBytes + KvTile::offset(row, 8 * j + 2 * tq)) =
            DT::pack(dV[4 * j + 2 * r], dV[4 * j + 2 * r + 1]);
      }
    }
    // the rows reach the TMA's async proxy before thread 0 stores them
    fence_proxy_async();
    named_barrier_sync(kBwdSm90ConsumerBarrier + c, kWarpgroupThreads);
    if (wg_thread == 0) {
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel) {
        const u32 at = smem0 + staged + panel * KvTile::kPanelBytes;
        tma_store_4d(&p.dk_map, at, panel * kSwizzlePanelCols, n0 + key0, hk, b);
        tma_store_4d(&p.dv_map, at + KvTile::kBytes, panel * kSwizzlePanelCols, n0 + key0, hk, b);
      }
      bulk_commit();
      bulk_wait<0>();  // written before the CTA's shared memory goes
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0 + key0 + wg_warp * 16 + g + 8 * r;
    if (key >= pb.seqlen_k) continue;
    T* dk_row = dk + b * p.dk_sb + (pb.k_start + key) * p.dk_ss + hk * p.dk_sh + kv_col0 + 2 * tq;
    T* dv_row = dv + b * p.dv_sb + (pb.k_start + key) * p.dv_ss + hk * p.dv_sh + kv_col0 + 2 * tq;
#pragma unroll
    for (int j = 0; j < kKvCols / 8; ++j) {
      if (kv_col0 + 8 * j < p.head_dim)
        *reinterpret_cast<u32*>(dk_row + 8 * j) =
            DT::pack(dK[4 * j + 2 * r] * p.softmax_scale, dK[4 * j + 2 * r + 1] * p.softmax_scale);
      if (kv_col0 + 8 * j < p.head_dim_v)
        *reinterpret_cast<u32*>(dv_row + 8 * j) = DT::pack(dV[4 * j + 2 * r], dV[4 * j + 2 * r + 1]);
    }
  }
}

// Deterministic dQ: one CTA per (query block, sequence, query head); warp w owns query rows
// w * 16 MT .. and all BLOCK_N keys of each key block, so dS leaves the S/dP registers straight
// as A fragments of dQ += dS K, and dQ sums in registers in a fixed key order.
//   S = Q K^T, P = exp2(S * scale * log2e - lse2), dP = dO V^T, dS = P (dP - delta), dQ += dS K
// K and V blocks are double-buffered with cp.async.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, bool ALIBI>
__global__ void __launch_bounds__(NUM_WARPS * kWarpSize)
flash_bwd_dq_kernel(const BwdParams<T> p) {
  // the arrays as __restrict__ locals, as the positional arguments were: no two alias, so
  // loads may take the read-only path and stay in flight across stores
  const T* __restrict__ q = p.q;
  const T* __restrict__ k = p.k;
  const T* __restrict__ v = p.v;
  const T* __restrict__ dout = p.dout;
  const float* __restrict__ lse = p.lse;
  const float* __restrict__ delta = p.delta;
  T* __restrict__ dq = p.dq;
  using DT = DType<T>;
  constexpr int kThreads = NUM_WARPS * kWarpSize;
  constexpr int kStride = SmemRow<HEAD_DIM>::kStride;
  constexpr int kMT = BLOCK_M / NUM_WARPS / 16;  // m16 tiles of query rows per warp
  constexpr int kNT = BLOCK_N / 8;               // n8 tiles of keys per block
  constexpr int kDT = HEAD_DIM / 8;              // n8 tiles of D
  static_assert(kMT >= 1 && BLOCK_M == kMT * 16 * NUM_WARPS && kNT % 2 == 0, "dQ tiling");

  const i64 bh = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  if (bh >= static_cast<i64>(p.batch) * p.num_heads) return;
  const int b = static_cast<int>(bh / p.num_heads);
  const int h = static_cast<int>(bh % p.num_heads);
  const int hk = h / (p.num_heads / p.num_kv_heads);
  const BwdProblem pb(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right, p.score_scale,
                      p.softcap_out);
  const int m0 = blockIdx.x * BLOCK_M;
  if (m0 >= pb.seqlen_q) return;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BLOCK_M, D + pad]
  T* sdO = sQ + BLOCK_M * kStride;         // [BLOCK_M, D + pad]
  T* sK = sdO + BLOCK_M * kStride;         // [2, BLOCK_N, D + pad]
  T* sV = sK + 2 * BLOCK_N * kStride;      // [2, BLOCK_N, D + pad]

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane / kQuadSize, tq = lane % kQuadSize;
  const int row0 = warp * kMT * 16;

  bwd_load_rows<T, BLOCK_M, HEAD_DIM, kThreads>(sQ, q + b * p.q_sb + (pb.q_start + m0) * p.q_ss + h * p.q_sh, p.q_ss,
                                                pb.seqlen_q - m0, p.head_dim);
  bwd_load_rows<T, BLOCK_M, HEAD_DIM, kThreads>(sdO, dout + b * p.do_sb + (pb.q_start + m0) * p.do_ss + h * p.do_sh,
                                                p.do_ss, pb.seqlen_q - m0, p.head_dim_v);

  const float alibi2 = bwd_alibi2<ALIBI>(p.alibi_slopes, p.alibi_sb, b, h);
  // lse2 and delta of this lane's rows g and g + 8 of each m16 tile
  float row_lse2[kMT][2], row_delta[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int query = m0 + row0 + mt * 16 + g + 8 * r;
      const bool valid = query < pb.seqlen_q;
      const i64 at = b * p.lse_sb + h * p.lse_sh + pb.q_start + query;
      row_lse2[mt][r] = bwd_lse2(lse, at, valid);
      row_delta[mt][r] = valid ? delta[at] : 0.f;
    }

  // Key blocks any row of this query block sees: [m0 + offset - left, m0 + BLOCK_M - 1 + offset + right]
  const int key_begin = max(0, m0 + pb.offset - pb.window_left);
  const int key_end = min(pb.seqlen_k, m0 + BLOCK_M - 1 + pb.offset + pb.window_right + 1);
  const int n_block_begin = key_begin / BLOCK_N;
  const int n_blocks = key_end > key_begin ? (key_end + BLOCK_N - 1) / BLOCK_N - n_block_begin : 0;

  // the fields the lambdas below read, as locals: a lambda that captured p by reference would
  // take the parameter's address and put the whole struct in local memory
  const i64 k_sb = p.k_sb;
  const i64 k_ss = p.k_ss;
  const i64 k_sh = p.k_sh;
  const i64 v_sb = p.v_sb;
  const i64 v_ss = p.v_ss;
  const i64 v_sh = p.v_sh;
  const BwdColumns<T, HEAD_DIM, kThreads> columns(p.head_dim), columns_v(p.head_dim_v);
  auto load_kv = [&](int i, int stage) {
    const int n0 = (n_block_begin + i) * BLOCK_N;
    bwd_load_rows<T, BLOCK_N, HEAD_DIM, kThreads>(sK + stage * BLOCK_N * kStride,
                                                  k + b * k_sb + (pb.k_start + n0) * k_ss + hk * k_sh, k_ss,
                                                  columns.rows(pb.seqlen_k - n0), columns.limit());
    bwd_load_rows<T, BLOCK_N, HEAD_DIM, kThreads>(sV + stage * BLOCK_N * kStride,
                                                  v + b * v_sb + (pb.k_start + n0) * v_ss + hk * v_sh, v_ss,
                                                  columns_v.rows(pb.seqlen_k - n0), columns_v.limit());
  };
  if (n_blocks > 0) load_kv(0, 0);
  cp_async_commit();

  float acc[kMT][kDT][4];  // dQ rows of this warp, fp32
  zero(acc);
  for (int i = 0; i < n_blocks; ++i) {
    const int stage = i % 2;
    const int n0 = (n_block_begin + i) * BLOCK_N;
    // prefetch the next K and V block while this one computes
    if (i + 1 < n_blocks) {
      load_kv(i + 1, (i + 1) % 2);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* cK = sK + stage * BLOCK_N * kStride;
    const T* cV = sV + stage * BLOCK_N * kStride;

    float s[kMT][kNT][4], dp[kMT][kNT][4];
    zero(s);
    zero(dp);
    warp_gemm_pair<T, kMT, kNT, HEAD_DIM, false, false, kStride, kStride>(s, sQ, cK, dp, sdO, cV, row0, 0, lane);

    with_tile_flags(pb.tile_needs_mask(m0, BLOCK_M, n0, BLOCK_N), pb.softcap_out > 0.f, [&](auto mask, auto cap) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            const int query = m0 + row0 + mt * 16 + g + 8 * r;
            const int key = n0 + nt * 8 + 2 * tq + (e % 2);
            const float lse2 = pb.alibi_lse2<ALIBI>(row_lse2[mt][r], alibi2, query, key);
            float prob = pb.template probability<decltype(cap)::value>(s[mt][nt][e], lse2);
            if (decltype(mask)::value && !pb.visible(query, key)) prob = 0.f;
            dp[mt][nt][e] = pb.template score_grad<decltype(cap)::value>(prob, dp[mt][nt][e], row_delta[mt][r], lse2);
          }
    });

    // dQ += dS K: dS as A fragments straight from registers, K [key][d] as B
#pragma unroll
    for (int ks = 0; ks < kNT / 2; ++ks) {
      u32 a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = DT::pack(dp[mt][2 * ks][0], dp[mt][2 * ks][1]);
        a[mt][1] = DT::pack(dp[mt][2 * ks][2], dp[mt][2 * ks][3]);
        a[mt][2] = DT::pack(dp[mt][2 * ks + 1][0], dp[mt][2 * ks + 1][1]);
        a[mt][3] = DT::pack(dp[mt][2 * ks + 1][2], dp[mt][2 * ks + 1][3]);
      }
#pragma unroll
      for (int dpair = 0; dpair < kDT / 2; ++dpair) {
        u32 bk[4];
        load_b_from_kn<kStride>(bk, cK, dpair * 16, ks * 16, lane);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>::run(acc[mt][2 * dpair], a[mt], bk[0], bk[1]);
          Mma<T>::run(acc[mt][2 * dpair + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
    // every warp is done with this stage before the prefetch two blocks on overwrites it
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int query = m0 + row0 + mt * 16 + g + 8 * r;
      if (query >= pb.seqlen_q) continue;
      T* dst = dq + b * p.dq_sb + (pb.q_start + query) * p.dq_ss + h * p.dq_sh + 2 * tq;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        if (dt * 8 < p.head_dim)
          *reinterpret_cast<u32*>(dst + dt * 8) = DT::pack(acc[mt][dt][2 * r] * p.softmax_scale, acc[mt][dt][2 * r + 1] * p.softmax_scale);
      }
    }
}

// dq = scale * dq_accum in q's dtype; one thread per element of the view (varlen: the packed
// rows as one batch entry).
constexpr int kConvertThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kConvertThreads)
bwd_convert_dq_kernel(const BwdParams<T> p) {
  const int views = p.cu_seqlens_q != nullptr ? 1 : p.batch;
  const i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const i64 total = static_cast<i64>(views) * p.rows_q * p.num_heads * p.head_dim;
  if (idx >= total) return;
  const int d = static_cast<int>(idx % p.head_dim);
  const int h = static_cast<int>((idx / p.head_dim) % p.num_heads);
  const int i = static_cast<int>((idx / (static_cast<i64>(p.head_dim) * p.num_heads)) % p.rows_q);
  const int b = static_cast<int>(idx / (static_cast<i64>(p.head_dim) * p.num_heads * p.rows_q));
  p.dq[b * p.dq_sb + i * p.dq_ss + h * p.dq_sh + d] = DType<T>::from_float(p.dq_accum[idx] * p.softmax_scale);
}

// dq = scale * the sm_90a kernel's bulk tile accumulator (layout above flash_bwd_sm90_kernel), in
// q's dtype: one CTA per (query block, sequence, query head), each thread two neighbouring
// columns of rows r and r + 8 per item (a float4 of the tile, two 4-byte stores of dq). Rows
// past the sequence's end are left alone (varlen: the host zeroes dq), and so are a padded
// tile's columns past D (tiles are HEAD_DIM wide). Ordered reductions (dq_semaphores set): a tile
// whose semaphore is 0 got no reduction and was never written (the accumulator is not zeroed): its
// dq is 0.
constexpr int kConvertTileThreads = 256;
constexpr int kConvertTileLoads = 4;  // float4 reads a thread has in flight
template <typename T, int HEAD_DIM, int BLOCK_M>
__global__ void __launch_bounds__(kConvertTileThreads)
bwd_convert_dq_tiles_kernel(const BwdParams<T> p) {
  static_assert(bwd_sm90_dq_cols<HEAD_DIM>() == HEAD_DIM, "a bulk dQ tile is one step's whole dQ");
  constexpr int kPairsPerRow = HEAD_DIM / 2;
  const i64 bh = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  if (bh >= static_cast<i64>(p.batch) * p.num_heads) return;
  const int b = static_cast<int>(bh / p.num_heads);
  const int h = static_cast<int>(bh % p.num_heads);
  // (the key lengths do not matter here: the query ones stand in for them)
  const SequenceRange seq(p.cu_seqlens_q, p.cu_seqlens_q, b, p.seqlen_q, p.seqlen_q);
  const int m0 = blockIdx.x * BLOCK_M;
  if (m0 >= seq.seqlen_q) return;
  const i64 q_block0 = p.cu_seqlens_q != nullptr ? (seq.q_start + static_cast<i64>(b) * BLOCK_M) / BLOCK_M : 0;
  const int rows = min(BLOCK_M, seq.seqlen_q - m0);
  const i64 tile_index = b * p.acc_tile_sb + h * p.acc_tile_sh + q_block0 + blockIdx.x;
  // whether the tile holds reductions
  const bool written = p.dq_semaphores == nullptr || p.dq_semaphores[tile_index] != 0;
  const float* tile = p.dq_accum + tile_index * (BLOCK_M * HEAD_DIM);
  // One float4 holds a column pair of rows r and r + 8 of a 16-row group (the accumulator's
  // r = (row % 16) / 8 is its last index bit but one): each item is a column pair of such a row
  // pair, read whole. The items of the tile's row pairs, a compile-time count per row (so the
  // index splits without a division at run time), kConvertTileLoads of them a thread read before
  // any is stored; pairs past the call's D and rows past the sequence are skipped (the tile holds
  // BLOCK_M rows: the reads stay inside it).
  const int items = (rows + 15) / 16 * 8 * kPairsPerRow;
  for (int first = threadIdx.x; first < items; first += kConvertTileThreads * kConvertTileLoads) {
    float4 quad[kConvertTileLoads];
#pragma unroll
    for (int u = 0; u < kConvertTileLoads; ++u) {
      const int idx = first + u * kConvertTileThreads;
      const int lo = idx / kPairsPerRow, col = (idx % kPairsPerRow) * 2;
      const int row = 16 * (lo / 8) + lo % 8;
      const int thread = 32 * (row / 16) + 4 * (row % 8) + (col % 8) / 2;
      const int at = ((col / 8) * kWarpgroupThreads + thread) * 4;
      const bool read = written && idx < items && col < p.head_dim && row < rows;
      quad[u] = read ? *reinterpret_cast<const float4*>(tile + at) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kConvertTileLoads; ++u) {
      const int idx = first + u * kConvertTileThreads;
      const int lo = idx / kPairsPerRow, col = (idx % kPairsPerRow) * 2;
      const int row = 16 * (lo / 8) + lo % 8;
      if (idx >= items || col >= p.head_dim) continue;
      T* dst = p.dq + b * p.dq_sb + (seq.q_start + m0 + row) * p.dq_ss + h * p.dq_sh + col;
      if (row < rows)
        *reinterpret_cast<u32*>(dst) = DType<T>::pack(quad[u].x * p.softmax_scale, quad[u].y * p.softmax_scale);
      if (row + 8 < rows)
        *reinterpret_cast<u32*>(dst + 8 * p.dq_ss) =
            DType<T>::pack(quad[u].z * p.softmax_scale, quad[u].w * p.softmax_scale);
    }
  }
}

}  // namespace cuattn
