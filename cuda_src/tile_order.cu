// tile_order.cu: the order in which a varlen flash_fwd_sm90_kernel launch on the dynamic schedule
// takes its tiles (FwdParams::tile_order), written by one CTA before that launch on its stream.
//
// A varlen launch (packed keys, or paged ones: paged prefill, whose launch entries name sequences
// through batch_index and take their key counts from seq_lens) spans B x H x m_blocks tiles,
// m_blocks from the longest sequence; a shorter sequence's tiles past its last row hold nothing.
// Taken from a counter in index order, each such tile costs its CTA an atomic round trip, and
// the last tiles taken are whatever sequence comes last. The order here lists only the tiles
// that hold rows, and the sequences by decreasing key count (the longest tiles first, so the
// short ones fill in at the end: longest processing time first), in chunks of kTileOrderChunk
// sequences sorted apart (each sequence ranked by one thread against the chunk's others: no
// sorting network, five barriers a chunk).
//
// Within a sequence the tiles go as the dense dynamic schedule's go within a pair: its heads in
// sections of `section` heads; a section's query blocks last (under a causal mask the heaviest)
// to first, each over the section's heads. Each tile is written as its index in the static order
// (bh * m_blocks + m_rank, m_rank counting query blocks from the last), which the forward maps
// back (FwdSm90Work::tile_pair).
//
// workspace: int32 [kTileOrderHead + entries]
//   [0, 2)  the forward's counters (left alone: every forward launch leaves them at zero)
//   [2]     the number of tiles listed (at most capacity)
//   [3, ..) the tiles, then kTileOrderEnd up to `entries` (a CTA's take past the last tile reads
//           it, so the forward compares no position with the count)
#include "common.cuh"
#include "params.cuh"

namespace cuattn {

constexpr int kTileOrderThreads = 1024;
// Sequences sorted together: one a thread, each ranked against the chunk's others.
constexpr int kTileOrderChunk = kTileOrderThreads;

using u64 = unsigned long long;

// Launch entry b's sequence: itself, or with paged keys the one batch_index names.
__device__ __forceinline__ int tile_order_sequence(const TileOrderParams& p, int b) {
  return p.batch_index != nullptr ? p.batch_index[b] : b;
}

// Entry b's sort key: ascending keys put longer key ranges first, then lower indices (so no two
// keys of a launch are equal). The high word is INT32_MAX - keys, which is non-negative for any
// key count and smaller for more keys.
__device__ __forceinline__ u64 tile_order_key(const TileOrderParams& p, int b) {
  constexpr int kMostKeys = 0x7fffffff;  // INT32_MAX: NVRTC has no <climits>
  const int keys = p.seq_lens != nullptr ? min(max(p.seq_lens[tile_order_sequence(p, b)], 0), p.max_keys)
                                         : max(p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b], 0);
  return (static_cast<u64>(kMostKeys - keys) << 32) | static_cast<u32>(b);
}

// Tiles of entry b: its sequence's query blocks (at most the launch's m_blocks) on every head.
__device__ __forceinline__ int tile_order_tiles(const TileOrderParams& p, int b) {
  const int s = tile_order_sequence(p, b);
  const int rows = max(p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s], 0);
  return p.num_heads * min((rows + p.block_m - 1) / p.block_m, p.m_blocks);
}

extern "C" __global__ void __launch_bounds__(kTileOrderThreads) fwd_tile_order_kernel(const TileOrderParams p) {
  __shared__ u64 keys[kTileOrderChunk];     // the chunk's sort keys, by sequence
  __shared__ int counts[kTileOrderChunk];   // by rank: the sequence's tiles
  __shared__ int sequence[kTileOrderChunk]; // by rank: the sequence
  __shared__ int starts[kTileOrderChunk];   // by rank: its first tile in the chunk's list
  __shared__ int warp_totals[kTileOrderThreads / kWarpSize];
  if (p.workspace == nullptr) return;
  int* const tiles_out = p.workspace + kTileOrderHead;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  int listed = 0;  // tiles of the chunks before (the same in every thread)
  for (int c0 = 0; c0 < p.batch; c0 += kTileOrderChunk) {
    const int n = min(kTileOrderChunk, p.batch - c0);
    __syncthreads();  // the previous chunk's fill is done with the arrays
    const u64 key = tid < n ? tile_order_key(p, c0 + tid) : ~0ull;
    keys[tid] = key;
    __syncthreads();
    // this thread's sequence's rank: the keys below its own (all threads read the same key at
    // once, a broadcast; no two keys are equal)
    if (tid < n) {
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += keys[j] < key;
      counts[rank] = tile_order_tiles(p, c0 + tid);
      sequence[rank] = c0 + tid;
    }
    __syncthreads();
    // the tiles before each rank: an exclusive scan of the counts in rank order, within each
    // warp and then over the warps' totals
    const int mine = tid < n ? counts[tid] : 0;
    int inclusive = mine;
#pragma unroll
    for (int d = 1; d < kWarpSize; d *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += x;
    }
    if (lane == kWarpSize - 1) warp_totals[warp] = inclusive;
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kTileOrderThreads / kWarpSize; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      total += warp_totals[w];
    }
    starts[tid] = before + inclusive - mine;
    __syncthreads();
    // tile t of the chunk: the last rank starting at or before t (ranks without tiles share the
    // next one's start and are passed over), then its place among the sequence's tiles
    for (int t = tid; t < total && listed + t < p.capacity; t += kTileOrderThreads) {
      int lo = 0, hi = n - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= t) lo = mid;
        else hi = mid - 1;
      }
      const int b = sequence[lo];
      const int m_tiles = counts[lo] / p.num_heads;  // the sequence's query blocks
      int local = t - starts[lo];
      // the section holding it: whole sections of p.section heads, the last one narrower
      const int section_tiles = p.section * m_tiles;
      const int full = p.num_heads / p.section;
      int h0, width_h;
      if (local < full * section_tiles) {
        h0 = local / section_tiles * p.section;
        local %= section_tiles;
        width_h = p.section;
      } else {
        h0 = full * p.section;
        local -= full * section_tiles;
        width_h = p.num_heads - h0;
      }
      const int h = h0 + local % width_h;
      const int m = m_tiles - 1 - local / width_h;  // query block, from the sequence's last
      tiles_out[listed + t] = (b * p.num_heads + h) * p.m_blocks + (p.m_blocks - 1 - m);
    }
    listed += total;
  }
  listed = min(listed, p.capacity);
  for (int t = listed + tid; t < p.entries; t += kTileOrderThreads) tiles_out[t] = kTileOrderEnd;
  if (tid == 0) p.workspace[kTileOrderHead - 1] = listed;
}

}  // namespace cuattn
