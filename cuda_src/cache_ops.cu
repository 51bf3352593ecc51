// cache_ops.cu: writes into the paged KV cache and copy-on-write block copies.
//
//   cache_write_kernel  new tokens' keys k [N, Hk, D] and values v [N, Hk, Dv] into their slots
//                       of k_pages [num_blocks, block_size, Hk, D] and v_pages [..., Dv]; slot s
//                       is offset s % block_size of page s / block_size. Slot -1 marks padding and
//                       is skipped (as is any slot outside the pool, read at its own width: int32
//                       slot_ids or int64 slot_ids_wide, so no id wraps into the pool). One thread
//                       writes 16 bytes of k and the same 16 bytes of v. Pages of e4m3 take
//                       round-to-nearest-even(x / scale[h]), saturated to +-448 (fp8.cuh), from
//                       fp16, bf16 or fp32 tokens.
//   copy_blocks_kernel  for each (src, dst) pair [P, 2], page dst of k_pages and v_pages becomes
//                       a copy of page src: one launch for all pairs, 16-byte vectors.
//   strided_copy_kernel a copy between two strided 5-D views, rows of contiguous chunks (a
//                       zero source stride repeats the source): cascade attention's packed
//                       queries and its log-sum-exps. Takes CopyParams.
// The first two take CacheParams (params.cuh). V may have its own head dim Dv: a thread's column covers
// max(D, Dv), and it writes only the tensor (k or v) whose row reaches that column.
#include "common.cuh"
#include "fp8.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cuattn {

constexpr int kCacheThreads = 256;  // both kernels: one 16-byte chunk per thread

// Elements [col, col + 16 / sizeof(Tcache)) of one token's head: copied when the types agree,
// quantised into one 16-byte store when the cache holds e4m3.
template <typename T, typename Tcache>
__device__ __forceinline__ void store_chunk(Tcache* dst, const T* src, const float* scale, int h) {
  if constexpr (sizeof(Tcache) == sizeof(T)) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    constexpr int kElems = kCopyBytes / sizeof(Tcache);
    const float s = scale[h];
    // an IEEE division (the build's fast math would approximate x / s), so that the rounding to
    // e4m3 matches NumPy's float32 x / scale bit for bit
    union {
      uint4 vector;
      unsigned char bytes[kElems];
    } packed;
#pragma unroll
    for (int i = 0; i < kElems; ++i) packed.bytes[i] = float_to_e4m3(__fdiv_rn(DType<T>::to_float(src[i]), s));
    *reinterpret_cast<uint4*>(dst) = packed.vector;
  }
}

// grid.x covers N * Hk * max(D, Dv) / (16 / sizeof(Tcache)) chunks
template <typename T, typename Tcache>
__global__ void __launch_bounds__(kCacheThreads)
cache_write_kernel(const __grid_constant__ CacheParams<T, Tcache> p) {
  static_assert(sizeof(Tcache) == sizeof(T) || sizeof(Tcache) == 1, "a copy, or a quantising write to e4m3");
  const T* __restrict__ k = p.k;
  const T* __restrict__ v = p.v;
  const int* __restrict__ slot_ids = p.slot_ids;
  const i64* __restrict__ slot_ids_wide = p.slot_ids_wide;
  Tcache* __restrict__ k_pages = p.k_pages;
  Tcache* __restrict__ v_pages = p.v_pages;
  const i64 k_sn = p.k_sn, k_sh = p.k_sh, v_sn = p.v_sn, v_sh = p.v_sh;
  const i64 kp_sp = p.kp_sp, kp_ss = p.kp_ss, kp_sh = p.kp_sh, vp_sp = p.vp_sp, vp_ss = p.vp_ss, vp_sh = p.vp_sh;
  const int num_tokens = p.num_tokens, num_kv_heads = p.num_kv_heads, head_dim = p.head_dim;
  const int head_dim_v = p.head_dim_v;
  const int block_size = p.block_size, num_blocks = p.num_blocks;
  constexpr int kElemsPerChunk = kCopyBytes / sizeof(Tcache);
  const int chunks_per_row = max(head_dim, head_dim_v) / kElemsPerChunk;
  const i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<i64>(num_tokens) * num_kv_heads * chunks_per_row) return;
  const int col = static_cast<int>(idx % chunks_per_row) * kElemsPerChunk;
  const int h = static_cast<int>((idx / chunks_per_row) % num_kv_heads);
  const int n = static_cast<int>(idx / (static_cast<i64>(chunks_per_row) * num_kv_heads));
  // no slot ids: token n into slot n
  const i64 slot = slot_ids_wide != nullptr ? slot_ids_wide[n] : slot_ids != nullptr ? slot_ids[n] : n;
  if (slot < 0 || slot >= static_cast<i64>(num_blocks) * block_size) return;  // padding
  const int in_pool = static_cast<int>(slot);  // below num_blocks * block_size, an int (the host checks)
  const int page = in_pool / block_size, offset = in_pool % block_size;
  if (col < head_dim) {
    store_chunk(k_pages + page * kp_sp + offset * kp_ss + h * kp_sh + col, k + n * k_sn + h * k_sh + col, p.k_scale, h);
  }
  if (col < head_dim_v) {
    store_chunk(v_pages + page * vp_sp + offset * vp_ss + h * vp_sh + col, v + n * v_sn + h * v_sh + col, p.v_scale, h);
  }
}

// grid: x = pair, y covers one page's block_size * Hk * max(D, Dv) / (16 / sizeof(T)) chunks
template <typename T>
__global__ void __launch_bounds__(kCacheThreads)
copy_blocks_kernel(const __grid_constant__ CacheParams<T, T> p) {
  T* __restrict__ k_pages = p.k_pages;
  T* __restrict__ v_pages = p.v_pages;
  const int* __restrict__ pairs = p.pairs;
  const i64 kp_sp = p.kp_sp, kp_ss = p.kp_ss, kp_sh = p.kp_sh, vp_sp = p.vp_sp, vp_ss = p.vp_ss, vp_sh = p.vp_sh;
  const int block_size = p.block_size, num_kv_heads = p.num_kv_heads, head_dim = p.head_dim;
  const int head_dim_v = p.head_dim_v;
  constexpr int kElemsPerChunk = kCopyBytes / sizeof(T);
  const int chunks_per_row = max(head_dim, head_dim_v) / kElemsPerChunk;
  const int idx = blockIdx.y * blockDim.x + threadIdx.x;
  if (idx >= block_size * num_kv_heads * chunks_per_row) return;
  const int col = (idx % chunks_per_row) * kElemsPerChunk;
  const int h = (idx / chunks_per_row) % num_kv_heads;
  const int offset = idx / (chunks_per_row * num_kv_heads);
  const i64 src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  if (col < head_dim) {
    *reinterpret_cast<uint4*>(k_pages + dst * kp_sp + offset * kp_ss + h * kp_sh + col) =
        *reinterpret_cast<const uint4*>(k_pages + src * kp_sp + offset * kp_ss + h * kp_sh + col);
  }
  if (col < head_dim_v) {
    *reinterpret_cast<uint4*>(v_pages + dst * vp_sp + offset * vp_ss + h * vp_sh + col) =
        *reinterpret_cast<const uint4*>(v_pages + src * vp_sp + offset * vp_ss + h * vp_sh + col);
  }
}

// grid.x covers n0 * n1 * n2 * n3 * row_chunks chunks of kChunkBytes (16: rows of 16-byte
// vectors; 4: float32 scalars)
template <int kChunkBytes>
__global__ void __launch_bounds__(kCacheThreads) strided_copy_kernel(const __grid_constant__ CopyParams p) {
  using Chunk = typename Conditional<kChunkBytes == kCopyBytes, uint4, u32>::type;
  static_assert(sizeof(Chunk) == kChunkBytes, "a chunk is one 16-byte vector or one 32-bit word");
  const Chunk* __restrict__ src = static_cast<const Chunk*>(p.src);
  Chunk* __restrict__ dst = static_cast<Chunk*>(p.dst);
  const i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  // idx -> (i0, i1, i2, i3, chunk), the chunk fastest
  const i64 row = idx / p.row_chunks;
  const int chunk = static_cast<int>(idx % p.row_chunks);
  if (row >= static_cast<i64>(p.n0) * p.n1 * p.n2 * p.n3) return;
  const int i3 = static_cast<int>(row % p.n3);
  const int i2 = static_cast<int>((row / p.n3) % p.n2);
  const int i1 = static_cast<int>((row / (static_cast<i64>(p.n3) * p.n2)) % p.n1);
  const int i0 = static_cast<int>(row / (static_cast<i64>(p.n3) * p.n2 * p.n1));
  dst[i0 * p.dst_s0 + i1 * p.dst_s1 + i2 * p.dst_s2 + i3 * p.dst_s3 + chunk] =
      src[i0 * p.src_s0 + i1 * p.src_s1 + i2 * p.src_s2 + i3 * p.src_s3 + chunk];
}

}  // namespace cuattn
