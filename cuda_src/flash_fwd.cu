// flash_fwd.cu: tiled FlashAttention forward on tensor cores (mma.sync m16n8k16, sm_80+).
//
// Computes out = softmax(mask(cap(scale * q k^T) + alibi)) v and the natural-log lse per query row,
// without ever writing the Sq x Sk score matrix: each CTA owns BLOCK_M query rows of one
// (batch, head), walks the key blocks that any of its rows can see, and keeps the online-softmax
// state (running max m, running sum l, unnormalised output) in registers.
//
// Layouts (element strides in FwdParams, params.cuh; the last axis is contiguous):
//   q    [B, Sq, Hq, D]    (varlen: [total_q, Hq, D] with cu_seqlens_q [B + 1])
//   k    [B, Sk, Hk, D]    (varlen: [total_k, Hk, D] with cu_seqlens_k [B + 1]); Hq % Hk == 0
//   v    [B, Sk, Hk, Dv]   (varlen: [total_k, Hk, Dv])
//   out  [B, Sq, Hq, Dv]   (varlen: [total_q, Hq, Dv])
//   lse  [B, Hq, Sq] fp32  (varlen: [Hq, total_q]); may be null
//
// Masking: query i sees key j iff j < Sk and i + Sk - Sq - left <= j <= i + Sk - Sq + right.
// The host turns `causal` into right = 0 and an unbounded side into a bound no row reaches,
// so one rule covers causal, sliding window and plain attention. Only key blocks that straddle
// a boundary evaluate it (`kMasked` below); the others run the unmasked path.
//
// Pipeline per key block n (K and V each have one shared-memory buffer):
//   wait for K[n]; start loading V[n]; S = Q K[n]^T; softmax update; wait for V[n];
//   start loading K[n-1]; O += P V[n].
// The V load overlaps the first GEMM and the softmax, the next K load overlaps the second GEMM.
// Key blocks are visited from last to first, so the masked blocks at the causal edge come first.
//
// Head dims: the kernel is instantiated for a tile head dim HEAD_DIM and runs any D = p.head_dim
// (q and k) and Dv = p.head_dim_v (v and out) <= HEAD_DIM that are multiples of 8 (DeepSeek's
// prefill: D = 192, Dv = 128, in the 256 tile). A 16-byte copy holds 8 elements, so the columns
// past a tensor's own head dim are whole copies: zero-filled in shared memory, never read from
// global memory. The padding is exact, not an approximation: Q and K columns D .. HEAD_DIM are
// zero in both operands, so each product they add to a score of Q K^T is exactly 0 (no rounding:
// adding an exact zero leaves an fp32 sum as it is), and S is the dot product over D columns;
// V columns Dv .. HEAD_DIM are zero, so those output columns are sums of P x 0 = 0, simply not
// stored. Neither padding touches the softmax state (m, l, lse), which depends on S alone.
#include "attention_tile.cuh"
#include "block_range.cuh"
#include "params.cuh"

namespace cuattn {

// Copy rows first_row .. first_row + ROWS - 1 of HEAD_DIM elements from `rows` (a DenseRows or
// PagedRows source, block_range.cuh) into a padded shared tile with 16-byte cp.async,
// zero-filling tile rows at or past `valid_rows` and columns at or past `head_dim` (a multiple of
// 8: the tensor's own head dim, D for Q and K, Dv for V).
template <typename T, int ROWS, int HEAD_DIM, int THREADS, class Rows>
__device__ __forceinline__ void load_tile(T* smem, const Rows& rows, int first_row, int valid_rows, int head_dim) {
  constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
  constexpr int kElemsPerChunk = kCopyBytes / sizeof(T);
  // A pass copies kRowsPerPass whole rows; with D = 96 (12 chunks a row) a few threads idle.
  constexpr int kRowsPerPass = THREADS / kChunksPerRow;
  constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
  if (threadIdx.x >= kRowsPerPass * kChunksPerRow) return;
  // Each thread keeps one column and walks down the rows with one cursor (a dense one is a
  // pointer bumped by a fixed step, rather than a 64-bit address per copy held live across the
  // main loop; a paged one looks up each row's page).
  const int col = (threadIdx.x % kChunksPerRow) * kElemsPerChunk;
  // a thread past the head dim only zero-fills: as if every row were past the end
  if (col >= head_dim) valid_rows = 0;
  int row = threadIdx.x / kChunksPerRow;
  auto src = rows.at(first_row, row, col, kRowsPerPass);
  T* dst = smem + row * SmemRow<HEAD_DIM>::kStride + col;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    if (ROWS % kRowsPerPass == 0 || row < ROWS) {
      const bool valid = row < valid_rows;
      // rows past the end are zero-filled from a readable address, never looked up
      const T* from = rows.fallback(first_row);
      if (valid) from = src.address();
      cp_async_16(dst, from, valid);
    }
    row += kRowsPerPass;
    src.next();
    dst += kRowsPerPass * SmemRow<HEAD_DIM>::kStride;
  }
}

// Each warp owns BLOCK_M / WARPS query rows: an AttentionTile of that many m16 tiles, with the
// whole key block and the whole head dim.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct FlashFwd : AttentionTile<T, BLOCK_M / WARPS / 16, BLOCK_N / 8, HEAD_DIM / 8> {
  using Tile = AttentionTile<T, BLOCK_M / WARPS / 16, BLOCK_N / 8, HEAD_DIM / 8>;
  using Tile::kMTiles;
  using Tile::kNTiles;
  using Tile::kDTiles;
  using Tile::s;
  using Tile::o;
  static constexpr int kThreads = WARPS * kWarpSize;
  static constexpr int kRowsPerWarp = BLOCK_M / WARPS;
  static constexpr int kStride = SmemRow<HEAD_DIM>::kStride;
  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "k16 steps");

  using Mm = Mma<T>;

  // S = Q K^T for this warp's rows: A fragments from sQ, B fragments from sK (both row-major in D).
  __device__ __forceinline__ void qk(const T* sQ, const T* sK, int warp, int lane) {
    this->zero_scores();
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
      u32 a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
        ldmatrix_x4(a[mt], sQ + (warp * kRowsPerWarp + mt * 16 + lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        // matrices: keys 0-7 | d 0-7, keys 0-7 | d 8-15, keys 8-15 | d 0-7, keys 8-15 | d 8-15
        u32 b[4];
        ldmatrix_x4(b, sK + (np * 16 + lane % 8 + (lane / 16) * 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mm::run(s[mt][2 * np], a[mt], b[0], b[1]);
          Mm::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // O += P V, V coming in as B fragments through transposing ldmatrix.
  __device__ __forceinline__ void pv(const u32 (&p)[kMTiles][BLOCK_N / 16][4], const T* sV, int lane) {
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        // matrices: keys 0-7 | d 0-7, keys 8-15 | d 0-7, keys 0-7 | d 8-15, keys 8-15 | d 8-15
        u32 b[4];
        ldmatrix_x4_trans(b, sV + (ks * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dp * 16 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mm::run(o[mt][2 * dp], p[mt][ks], b[0], b[1]);
          Mm::run(o[mt][2 * dp + 1], p[mt][ks], b[2], b[3]);
        }
      }
    }
  }
};

// Where a launch entry's keys are: dense or packed varlen rows (PAGED false), or a paged cache
// through its block table (PAGED true, FwdParams' paged fields).
template <typename T, bool PAGED>
struct KvSource;

template <typename T>
struct KvSource<T, false> {
  using Rows = DenseRows<T>;
  __device__ __forceinline__ static int sequence(const FwdParams<T>&, int entry) { return entry; }
  __device__ __forceinline__ static SequenceRange range(const FwdParams<T>& p, int b) {
    return SequenceRange(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k);
  }
  __device__ __forceinline__ static Rows rows(const FwdParams<T>&, const T* x, i64 batch_stride, i64 row_stride,
                                              i64 head_stride, int b, int h_kv, const SequenceRange& seq) {
    return {x + b * batch_stride + seq.k_start * row_stride + h_kv * head_stride, row_stride};
  }
};

template <typename T>
struct KvSource<T, true> {
  using Rows = PagedRows<T>;
  __device__ __forceinline__ static int sequence(const FwdParams<T>& p, int entry) { return p.batch_index[entry]; }
  __device__ __forceinline__ static SequenceRange range(const FwdParams<T>& p, int b) {
    return SequenceRange::paged(p, b);
  }
  __device__ __forceinline__ static Rows rows(const FwdParams<T>& p, const T* x, i64 page_stride, i64 row_stride,
                                              i64 head_stride, int b, int h_kv, const SequenceRange&) {
    return {x + h_kv * head_stride, p.block_table + b * p.table_stride, page_stride, row_stride,
            FastDivisor{p.block_size, p.block_size_mul, p.block_size_shift}, p.num_blocks};
  }
};

// ALIBI: add ALiBi's bias (p.alibi_slopes is set). A template flag, not a runtime test of the
// pointer, so that the kernels without it compile to the code they had before ALiBi existed: the
// bias pass and the slope held across the key loop cost registers the tiles have none of to spare.
// PAGED: keys and values from a paged cache (KvSource), queries packed as in varlen.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool ALIBI, bool PAGED>
__global__ void __launch_bounds__(WARPS * kWarpSize, 2)
flash_fwd_kernel(const __grid_constant__ FwdParams<T> p) {
  // the fields this kernel reads, as locals
  const T* __restrict__ q = p.q;
  T* __restrict__ out = p.out;
  float* __restrict__ lse = p.lse;
  const i64 q_batch_stride = p.q_batch_stride, q_row_stride = p.q_row_stride, q_head_stride = p.q_head_stride;
  const i64 k_batch_stride = p.k_batch_stride, k_row_stride = p.k_row_stride, k_head_stride = p.k_head_stride;
  const i64 v_batch_stride = p.v_batch_stride, v_row_stride = p.v_row_stride, v_head_stride = p.v_head_stride;
  const i64 o_batch_stride = p.o_batch_stride, o_row_stride = p.o_row_stride, o_head_stride = p.o_head_stride;
  const i64 lse_batch_stride = p.lse_batch_stride, lse_head_stride = p.lse_head_stride;
  const int batch = p.batch, num_heads = p.num_heads, num_kv_heads = p.num_kv_heads;
  const float score_scale = p.score_scale, softcap_out = p.softcap_out;
  const int window_left = p.window_left, window_right = p.window_right;
  const int head_dim = p.head_dim, head_dim_v = p.head_dim_v;
  using Fwd = FlashFwd<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  using DT = DType<T>;
  constexpr int kStride = Fwd::kStride;
  constexpr int kThreads = Fwd::kThreads;

  using Kv = KvSource<T, PAGED>;

  // B * H can pass 65535: it is split over grid.y and grid.z
  const i64 bh = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  if (bh >= static_cast<i64>(batch) * num_heads) return;
  const int b = Kv::sequence(p, static_cast<int>(bh / num_heads));
  const int h = static_cast<int>(bh % num_heads);
  const int h_kv = h / (num_heads / num_kv_heads);

  // Locate this sequence: packed varlen rows start at cu_seqlens, dense ones at b * batch_stride.
  const SequenceRange seq = Kv::range(p, b);
  const i64 q_start = seq.q_start;
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const MaskParams mp{seqlen_k, window_left, window_right, score_scale, softcap_out};
  // Sk - Sq: aligns causal and window masks to the bottom-right corner
  const int offset = seq.offset;
  const float softmax_scale = mp.softmax_scale();

  // Heaviest causal blocks (the last query rows) are scheduled first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int m0 = m_block * BLOCK_M;
  if (m0 >= seqlen_q) return;

  const DenseRows<T> q_rows{q + b * q_batch_stride + q_start * q_row_stride + h * q_head_stride + m0 * q_row_stride,
                            q_row_stride};
  const typename Kv::Rows k_rows = Kv::rows(p, p.k, k_batch_stride, k_row_stride, k_head_stride, b, h_kv, seq);
  const typename Kv::Rows v_rows = Kv::rows(p, p.v, v_batch_stride, v_row_stride, v_head_stride, b, h_kv, seq);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // tile rows of HEAD_DIM + pad elements: columns past D (Q, K) or Dv (V) hold zeros
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [BLOCK_M, HEAD_DIM + pad]
  T* sK = sQ + BLOCK_M * kStride;          // [BLOCK_N, HEAD_DIM + pad]
  T* sV = sK + BLOCK_N * kStride;          // [BLOCK_N, HEAD_DIM + pad]

  // Key blocks any row of this CTA can see: [n_block_min, n_block_max).
  int n_block_min, n_block_max;
  seq.key_blocks<BLOCK_N>(m0, BLOCK_M, window_left, window_right, n_block_min, n_block_max);

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  Fwd fwd;
  fwd.init();

  // prologue: Q and the last visible K block travel together
  load_tile<T, BLOCK_M, HEAD_DIM, kThreads>(sQ, q_rows, 0, seqlen_q - m0, head_dim);
  if (n_block_max > n_block_min) {
    const int n0 = (n_block_max - 1) * BLOCK_N;
    load_tile<T, BLOCK_N, HEAD_DIM, kThreads>(sK, k_rows, n0, seqlen_k - n0, head_dim);
  }
  cp_async_commit();

  const int row0 = m0 + warp * Fwd::kRowsPerWarp;
  // the diagonal (query position + Sk - Sq) of this lane's row r of m16 tile mt
  const auto diag_of = [=](int mt, int r) { return row0 + mt * 16 + lane / 4 + 8 * r + offset; };
  for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
    const int n0 = n_block * BLOCK_N;
    // K[n] has landed, and every warp is done reading V[n+1]: its buffer may be refilled
    cp_async_wait<0>();
    __syncthreads();
    load_tile<T, BLOCK_N, HEAD_DIM, kThreads>(sV, v_rows, n0, seqlen_k - n0, head_dim_v);
    cp_async_commit();

    fwd.qk(sQ, sK, warp, lane);
    const bool masked = seq.block_needs_mask<BLOCK_N>(m0, BLOCK_M, n0, window_left, window_right);
    if (masked) {
      fwd.template cap_and_mask<true>(mp, diag_of, n0, lane);
    } else {
      fwd.template cap_and_mask<false>(mp, diag_of, n0, lane);
    }
    // each row's ALiBi offset (add_alibi); 0 without ALiBi, where it folds away
    float row_bias[Fwd::kMTiles][2] = {};
    if constexpr (ALIBI) {
      // this head's slope in the units of the scores add_alibi sees, read per block (an L1 hit)
      // rather than held in a register across the loop: D = 64 and 128 have none to spare on sm_90a
      const float alibi = alibi_score_slope(p.alibi_slopes, p.alibi_batch_stride, b, h, softmax_scale);
      fwd.add_alibi(diag_of, [=](int, int) { return alibi; }, n0, lane, row_bias);
    }
    fwd.softmax_update(softmax_scale, row_bias);
    u32 p[Fwd::kMTiles][BLOCK_N / 16][4];
    fwd.to_fragments(p);

    // V[n] has landed, and every warp is done reading K[n]: prefetch K[n-1] behind the second GEMM
    cp_async_wait<0>();
    __syncthreads();
    if (n_block > n_block_min) {
      const int n_prev = n0 - BLOCK_N;
      load_tile<T, BLOCK_N, HEAD_DIM, kThreads>(sK, k_rows, n_prev, seqlen_k - n_prev, head_dim);
    }
    cp_async_commit();
    fwd.pv(p, sV, lane);
  }

  // Epilogue: normalise, stage the warp's rows in its own slice of sQ, then write 16-byte
  // vectors to global memory. When no key block was visited, the Q copies (issued by every
  // thread, into every warp's rows) may still be in flight: drain them before sQ is reused.
  cp_async_wait<0>();
  __syncthreads();
  T* sO = sQ + warp * Fwd::kRowsPerWarp * kStride;  // [kRowsPerWarp, HEAD_DIM + pad], columns past Dv zero
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Fwd::kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      SoftmaxState& st = fwd.state[mt][r];
      st.l = quad_sum(st.l);  // the lanes' partial sums make the row's total
      const float sink_factor = p.sinks != nullptr ? st.add_sink(p.sinks[h] * kLog2e) : 1.f;
      const float inv = st.inv_sum() * sink_factor;
      const int row = mt * 16 + g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < Fwd::kDTiles; ++dt) {
        const u32 packed = DType<T>::pack(fwd.o[mt][dt][2 * r] * inv, fwd.o[mt][dt][2 * r + 1] * inv);
        *reinterpret_cast<u32*>(sO + row * kStride + dt * 8 + 2 * t) = packed;
      }
      if (lse != nullptr && t == 0 && row0 + row < seqlen_q) {
        lse[b * lse_batch_stride + h * lse_head_stride + q_start + row0 + row] = st.lse();
      }
    }
  __syncwarp();
  constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
  constexpr int kElemsPerChunk = kCopyBytes / sizeof(T);
  T* o_ptr = out + b * o_batch_stride + (q_start + row0) * o_row_stride + h * o_head_stride;
#pragma unroll
  for (int idx = lane; idx < Fwd::kRowsPerWarp * kChunksPerRow; idx += kWarpSize) {
    const int row = idx / kChunksPerRow;
    const int col = (idx % kChunksPerRow) * kElemsPerChunk;
    if (row0 + row < seqlen_q && col < head_dim_v) {
      *reinterpret_cast<uint4*>(o_ptr + row * o_row_stride + col) =
          *reinterpret_cast<const uint4*>(sO + row * kStride + col);
    }
  }
}

}  // namespace cuattn
