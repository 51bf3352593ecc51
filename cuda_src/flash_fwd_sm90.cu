// flash_fwd_sm90.cu: the FlashAttention forward on Hopper (sm_90a): TMA loads, wgmma, and
// warp specialisation in the FlashAttention-3 design.
//
// Computes what flash_fwd.cu computes (same FwdParams, same masks, softcap, GQA, varlen, lse):
// out = softmax(mask(cap(scale * q k^T))) v, without writing the Sq x Sk scores.
//
// Layouts (FwdParams, params.cuh; the last axis contiguous, every other stride a multiple of
// 16 bytes, which the TMA needs; the host falls back to flash_fwd.cu otherwise):
//   q    [B, Sq, Hq, D]  through q_map as 4-D (D, Sq, Hq, B)   varlen: (D, total_q, Hq, 1)
//   k, v [B, Sk, Hk, D]  through k_map, v_map the same way
//   out  [B, Sq, Hq, D]  plain 16-byte stores (rows past a varlen sequence belong to the next)
//   lse  [B, Hq, Sq] fp32 (varlen [Hq, total_q]), or null
//
// One CTA owns BLOCK_M = 64 * CONSUMERS query rows of one (batch, head) and 128 (CONSUMERS + 1)
// threads in warpgroups:
//   warpgroup 0, the producer: gives up most of its registers (setmaxnreg) and one thread
//     issues every TMA load: Q once, then K and V of each visible key block into a circular
//     buffer of STAGES stages, each stage guarded by a "full" mbarrier (TMA bytes landed) and
//     an "empty" one (every consumer thread is done reading it);
//   warpgroups 1..CONSUMERS, the consumers: 64 query rows each, with the registers. Per key
//     block: S = Q K^T (wgmma, both operands in shared memory), mask and online softmax in
//     registers (AttentionTile: the wgmma accumulator layout is the mma.sync one), then
//     O += P V (wgmma with P from registers, V read MN-major from shared memory).
// Two overlaps hide the softmax behind the tensor cores:
//   OVERLAP (within a warpgroup): block j's S GEMM and block j-1's PV GEMM are issued together;
//     the softmax of block j runs while PV still computes; the output's rescale waits for it.
//   PINGPONG (between warpgroups): named barriers take turns issuing GEMMs, so one warpgroup's
//     softmax runs under the other's GEMMs.
// Key blocks are visited from last to first, so the masked blocks at the causal edge come first;
// only blocks that cross a mask boundary evaluate the mask.
#include "attention_tile.cuh"
#include "block_range.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace cuattn {

constexpr int kFwdSm90BlockN = 128;       // keys per block: S is a 64 x 128 wgmma tile per warpgroup
constexpr int kFwdSm90ProducerRegs = 24;  // setmaxnreg of the producer warpgroup
// Barrier ids: 0 is __syncthreads; the pingpong turn of consumer c is kFwdSm90TurnBarrier + c,
// consumer c's own epilogue barrier kFwdSm90EpilogueBarrier + c.
constexpr int kFwdSm90TurnBarrier = 1;
constexpr int kFwdSm90EpilogueBarrier = 5;

// Shared memory, byte offsets from a 1024-byte-aligned base. The host mirrors kBytes
// (cuattn/attention.py, FwdSm90Tile.smem_bytes).
template <int HEAD_DIM, int CONSUMERS, int STAGES>
struct FwdSm90Smem {
  static constexpr int BLOCK_M = kWgmmaM * CONSUMERS;
  using QTile = SwizzledTile<BLOCK_M, HEAD_DIM>;         // [BLOCK_M, D]
  using KVTile = SwizzledTile<kFwdSm90BlockN, HEAD_DIM>;  // [BLOCK_N, D] per stage
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + QTile::kBytes;
  static constexpr int kV = kK + STAGES * KVTile::kBytes;
  // mbarriers: Q full, then per stage K full, V full, K empty, V empty (8 bytes each)
  static constexpr int kBarriers = kV + STAGES * KVTile::kBytes;
  static constexpr int kBarrierCount = 1 + 4 * STAGES;
  // the dynamic allocation's base is only 16-byte aligned: one atom of slack to round it up
  static constexpr int kBytes = kBarriers + kBarrierCount * 8 + kSwizzleAtomBytes;
};

template <typename T, int HEAD_DIM, int CONSUMERS, int STAGES, bool OVERLAP, bool PINGPONG>
__global__ void __launch_bounds__(kWarpgroupThreads * (CONSUMERS + 1), 1)
flash_fwd_sm90_kernel(const __grid_constant__ FwdParams<T> p) {
  using Smem = FwdSm90Smem<HEAD_DIM, CONSUMERS, STAGES>;
  using QTile = typename Smem::QTile;
  using KVTile = typename Smem::KVTile;
  constexpr int BLOCK_M = Smem::BLOCK_M;
  constexpr int BLOCK_N = kFwdSm90BlockN;
  constexpr int kPanels = HEAD_DIM / kSwizzlePanelCols;  // TMA boxes per tile: one per 64 columns
  using S = Wgmma<T, BLOCK_N>;   // 64 rows x BLOCK_N keys
  using O = Wgmma<T, HEAD_DIM>;  // 64 rows x D
  using Tile = AttentionTile<T, 1, BLOCK_N / 8, HEAD_DIM / 8>;
  static_assert(HEAD_DIM % kSwizzlePanelCols == 0, "whole 64-column panels");
  static_assert(CONSUMERS == 2 || !PINGPONG, "pingpong takes turns between two warpgroups");
  // the registers the consumers take: what the producer gives up, shared out (multiple of 8)
  constexpr int kConsumerRegs =
      ((65536 / kWarpgroupThreads - kFwdSm90ProducerRegs) / CONSUMERS) / 8 * 8 > 240
          ? 240
          : ((65536 / kWarpgroupThreads - kFwdSm90ProducerRegs) / CONSUMERS) / 8 * 8;

  // B * H can pass 65535: it is split over grid.y and grid.z
  const i64 bh = blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z;
  if (bh >= static_cast<i64>(p.batch) * p.num_heads) return;
  const int b = static_cast<int>(bh / p.num_heads);
  const int h = static_cast<int>(bh % p.num_heads);
  const int h_kv = h / (p.num_heads / p.num_kv_heads);
  const SequenceRange seq(p.cu_seqlens_q, p.cu_seqlens_k, b, p.seqlen_q, p.seqlen_k);
  // heaviest causal blocks (the last query rows) first
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BLOCK_M;
  if (m0 >= seq.seqlen_q) return;
  int n_first, n_last;
  seq.key_blocks<BLOCK_N>(m0, BLOCK_M, p.window_left, p.window_right, n_first, n_last);
  const int blocks = n_last - n_first;
  // TMA coordinates: dense rows are per batch slice, varlen rows are packed (batch coordinate 0)
  const bool varlen = p.cu_seqlens_q != nullptr;
  const int tma_b = varlen ? 0 : b;
  const int q_row0 = static_cast<int>(seq.q_start) + m0;
  const int k_row0 = static_cast<int>(seq.k_start);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 raw_addr = smem_address(smem_raw);
  const u32 smem0 = (raw_addr + kSwizzleAtomBytes - 1) & ~static_cast<u32>(kSwizzleAtomBytes - 1);
  unsigned char* base = smem_raw + (smem0 - raw_addr);
  const u32 sQ = smem0 + Smem::kQ;
  const auto sK = [&](int stage) { return smem0 + Smem::kK + stage * KVTile::kBytes; };
  const auto sV = [&](int stage) { return smem0 + Smem::kV + stage * KVTile::kBytes; };
  const u32 q_full = smem0 + Smem::kBarriers;
  const auto k_full = [&](int stage) { return q_full + 8 * (1 + stage); };
  const auto v_full = [&](int stage) { return q_full + 8 * (1 + STAGES + stage); };
  const auto k_empty = [&](int stage) { return q_full + 8 * (1 + 2 * STAGES + stage); };
  const auto v_empty = [&](int stage) { return q_full + 8 * (1 + 3 * STAGES + stage); };

  const int wg = threadIdx.x / kWarpgroupThreads;
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&p.q_map);
    prefetch_tensor_map(&p.k_map);
    prefetch_tensor_map(&p.v_map);
    mbarrier_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(k_full(s), 1);
      mbarrier_init(v_full(s), 1);
      mbarrier_init(k_empty(s), CONSUMERS * kWarpgroupThreads);
      mbarrier_init(v_empty(s), CONSUMERS * kWarpgroupThreads);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: one thread streams Q, then K and V block by block (last block first)
    registers_decrease<kFwdSm90ProducerRegs>();
    if (threadIdx.x != 0) return;
    mbarrier_arrive_expect_tx(q_full, QTile::kBytes);
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel)
      tma_load_4d(sQ + panel * QTile::kPanelBytes, &p.q_map, q_full, panel * kSwizzlePanelCols, q_row0, h, tma_b);
    for (int i = 0; i < blocks; ++i) {
      const int stage = i % STAGES, parity = (i / STAGES) & 1;
      const int row = k_row0 + (n_last - 1 - i) * BLOCK_N;
      mbarrier_wait(k_empty(stage), parity ^ 1);
      mbarrier_arrive_expect_tx(k_full(stage), KVTile::kBytes);
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel)
        tma_load_4d(sK(stage) + panel * KVTile::kPanelBytes, &p.k_map, k_full(stage), panel * kSwizzlePanelCols,
                    row, h_kv, tma_b);
      mbarrier_wait(v_empty(stage), parity ^ 1);
      mbarrier_arrive_expect_tx(v_full(stage), KVTile::kBytes);
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel)
        tma_load_4d(sV(stage) + panel * KVTile::kPanelBytes, &p.v_map, v_full(stage), panel * kSwizzlePanelCols,
                    row, h_kv, tma_b);
    }
    return;
  }

  // ---- consumers: warpgroup c owns query rows [m0 + 64 c, m0 + 64 c + 64)
  registers_increase<kConsumerRegs>();
  const int c = wg - 1;
  const int tid = threadIdx.x - wg * kWarpgroupThreads;
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int wg_m0 = m0 + c * kWgmmaM;
  const int row0 = wg_m0 + warp * 16;  // this warp's 16 rows
  const MaskParams mp{seq.seqlen_k, p.window_left, p.window_right, p.score_scale, p.softcap_out};
  const float softmax_scale = mp.softmax_scale();
  const auto diag_of = [=](int, int r) { return row0 + lane / 4 + 8 * r + seq.offset; };

  // Pingpong: consumer c issues its GEMMs after the other's turn ends; consumer 1 lets 0 go first.
  const int other = 1 - c;
  const auto take_turn = [&] {
    if (PINGPONG) named_barrier_sync(kFwdSm90TurnBarrier + c, 2 * kWarpgroupThreads);
  };
  const auto pass_turn = [&](bool last) {
    // the other warpgroup waits for as many turns as this one passes: consumer 1 passes one at
    // the start, so it skips its last
    if (PINGPONG && !(last && c == 1)) named_barrier_arrive(kFwdSm90TurnBarrier + other, 2 * kWarpgroupThreads);
  };
  if (PINGPONG && c == 1) named_barrier_arrive(kFwdSm90TurnBarrier + other, 2 * kWarpgroupThreads);

  Tile tile;
  tile.init();
  float (&s_acc)[S::kAccumulators] = reinterpret_cast<float (&)[S::kAccumulators]>(tile.s);
  float (&o_acc)[O::kAccumulators] = reinterpret_cast<float (&)[O::kAccumulators]>(tile.o);
  u32 pa[BLOCK_N / kWgmmaK][4];  // P as wgmma A fragments (k step j: keys 16 j .. 16 j + 15)

  const auto issue_s = [&](int stage) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / kWgmmaK; ++ks)
      S::template ss<0, 0>(s_acc, kmajor_descriptor<QTile>(sQ, c * kWgmmaM, ks), kmajor_descriptor<KVTile>(sK(stage), 0, ks),
                           ks > 0);
    wgmma_commit();
  };
  const auto issue_pv = [&](int stage) {
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / kWgmmaK; ++ks)
      O::template rs<1>(o_acc, pa[ks], mnmajor_descriptor<KVTile>(sV(stage), 0, ks), 1);
    wgmma_commit();
  };
  // mask and softmax of the scores of block i (key block n_last - 1 - i); returns whether the
  // output must be rescaled by `factor` (done by the caller once no GEMM adds into it)
  const auto softmax = [&](int i, float (&factor)[1][2]) {
    const int n0 = (n_last - 1 - i) * BLOCK_N;
    if (seq.block_needs_mask<BLOCK_N>(wg_m0, kWgmmaM, n0, p.window_left, p.window_right)) {
      tile.template cap_and_mask<true>(mp, diag_of, n0, lane);
    } else {
      tile.template cap_and_mask<false>(mp, diag_of, n0, lane);
    }
    const bool moved = tile.move_max(softmax_scale, factor);
    tile.exponentiate(softmax_scale);
    return moved;
  };
  const auto to_fragments = [&] {
    u32(&frag)[1][BLOCK_N / kWgmmaK][4] = reinterpret_cast<u32(&)[1][BLOCK_N / kWgmmaK][4]>(pa);
    tile.to_fragments(frag);
  };

  mbarrier_wait(q_full, 0);
  if (blocks > 0) {
    if (OVERLAP) {
      // block 0: S alone
      mbarrier_wait(k_full(0), 0);
      take_turn();
      wgmma_fence();
      issue_s(0);
      pass_turn(false);
      wgmma_wait<0>();
      fence_registers(s_acc);
      mbarrier_arrive(k_empty(0));
      float factor[1][2];
      if (softmax(0, factor)) tile.rescale_output(factor);
      to_fragments();
      // block i's S with block i-1's PV; block i's softmax under PV
      for (int i = 1; i < blocks; ++i) {
        const int stage = i % STAGES, parity = (i / STAGES) & 1;
        const int prev = (i - 1) % STAGES, prev_parity = ((i - 1) / STAGES) & 1;
        mbarrier_wait(k_full(stage), parity);
        mbarrier_wait(v_full(prev), prev_parity);
        take_turn();
        wgmma_fence();
        issue_s(stage);
        issue_pv(prev);
        pass_turn(false);
        wgmma_wait<1>();
        fence_registers(s_acc);
        mbarrier_arrive(k_empty(stage));
        const bool moved = softmax(i, factor);
        wgmma_wait<0>();
        fence_registers(o_acc);
        fence_registers(pa);
        mbarrier_arrive(v_empty(prev));
        if (moved) tile.rescale_output(factor);
        to_fragments();
      }
      // the last block's PV
      const int last = (blocks - 1) % STAGES, last_parity = ((blocks - 1) / STAGES) & 1;
      mbarrier_wait(v_full(last), last_parity);
      take_turn();
      wgmma_fence();
      issue_pv(last);
      pass_turn(true);
      wgmma_wait<0>();
      fence_registers(o_acc);
      fence_registers(pa);
      mbarrier_arrive(v_empty(last));
    } else {
      for (int i = 0; i < blocks; ++i) {
        const int stage = i % STAGES, parity = (i / STAGES) & 1;
        mbarrier_wait(k_full(stage), parity);
        take_turn();
        wgmma_fence();
        issue_s(stage);
        pass_turn(false);
        wgmma_wait<0>();
        fence_registers(s_acc);
        mbarrier_arrive(k_empty(stage));
        float factor[1][2];
        if (softmax(i, factor)) tile.rescale_output(factor);
        to_fragments();
        mbarrier_wait(v_full(stage), parity);
        take_turn();
        wgmma_fence();
        issue_pv(stage);
        pass_turn(i == blocks - 1);
        wgmma_wait<0>();
        fence_registers(o_acc);
        fence_registers(pa);
        mbarrier_arrive(v_empty(stage));
      }
    }
  } else if (PINGPONG) {
    // no key block: balance the turns the other warpgroup waits for
    take_turn();
    pass_turn(true);
  }

  // ---- epilogue: normalise, stage this warpgroup's 64 rows in its own rows of the Q tile (its
  // S GEMMs, the only readers, are done), then 16-byte stores of whole rows
  const int g = lane / 4, t = lane % 4;
  const i64 lse_base = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_start;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    SoftmaxState& st = tile.state[0][r];
    st.l = quad_sum(st.l);  // the lanes' partial sums make the row's total
    const float inv = st.inv_sum();
    const int row = c * kWgmmaM + warp * 16 + g + 8 * r;  // row within the CTA's Q tile
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt) {
      const u32 packed = DType<T>::pack(tile.o[0][dt][2 * r] * inv, tile.o[0][dt][2 * r + 1] * inv);
      *reinterpret_cast<u32*>(base + Smem::kQ + QTile::offset(row, dt * 8 + 2 * t)) = packed;
    }
    if (p.lse != nullptr && t == 0 && m0 + row < seq.seqlen_q) p.lse[lse_base + m0 + row] = st.lse();
  }
  named_barrier_sync(kFwdSm90EpilogueBarrier + c, kWarpgroupThreads);
  constexpr int kChunksPerRow = HEAD_DIM * sizeof(T) / kCopyBytes;
  T* o_ptr = p.out + b * p.o_batch_stride + (seq.q_start + wg_m0) * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int idx = tid; idx < kWgmmaM * kChunksPerRow; idx += kWarpgroupThreads) {
    const int row = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
    if (wg_m0 + row < seq.seqlen_q) {
      *reinterpret_cast<uint4*>(o_ptr + row * p.o_row_stride + chunk * (kCopyBytes / sizeof(T))) =
          *reinterpret_cast<const uint4*>(base + Smem::kQ + QTile::chunk_offset(c * kWgmmaM + row, chunk));
    }
  }
}

}  // namespace cuattn
