// attention_tile.cuh: the per-warp attention tile the tensor-core kernels are built on.
//
// A warp owns MT m16 tiles of query rows. For one block of keys it holds the scores
// s[MT][NT][4] (NT n8 tiles of keys, mma.sync C fragments), the unnormalised output
// o[MT][DT][4] (DT n8 tiles of the head dim) and one SoftmaxState per row. The verbs are the
// steps of the online softmax:
//   cap_and_mask      softcap and causal/window/length mask (masks only on boundary blocks)
//   add_alibi         ALiBi's linear distance bias (only in kernels given slopes)
//   softmax_update    move the row max (lazily), rescale the output, exp2 into probabilities
//   to_fragments      probabilities as fp16/bf16 A fragments for O += P V
//   to_e4m3_fragments probabilities as e4m3 A fragments of an 8-bit wgmma (the FP8 Hopper forward)
//   softmax_to_fragments  the two steps at once, the row max found only when the sums ask for it
// flash_fwd.cu (rows split over warps), flash_fwd_sm90.cu (a warp's 16 rows of a warpgroup's
// wgmma tile) and decode.cu (keys split over warps) call them between their own GEMMs.
#pragma once

#include "common.cuh"
#include "fp8.cuh"
#include "mma.cuh"

namespace cuattn {

// Shared-memory rows are padded by 16 bytes: D + 8 elements. With the row pitch an odd number of
// 16-byte units, the eight rows one ldmatrix phase reads fall in eight different bank groups.
template <int HEAD_DIM>
struct SmemRow {
  static constexpr int kPadElems = 8;
  static constexpr int kStride = HEAD_DIM + kPadElems;
};

// What the mask and the score transform need. Query row with diagonal `diag` (its position
// + Sk - Sq) sees key j iff j < key_end and diag - window_left <= j <= diag + window_right; the
// host turns `causal` into window_right = 0 and an unbounded side into a bound no row reaches.
struct MaskParams {
  int key_end;
  int window_left, window_right;
  float score_scale;  // scale * log2(e), or scale / softcap with a softcap (always > 0)
  float softcap_out;  // 0, or softcap * log2(e)

  // The exp2 multiplier: capped scores arrive in log2 units already, raw ones take the scale.
  __device__ __forceinline__ float softmax_scale() const { return softcap_out > 0.f ? 1.f : score_scale; }
};

// ALiBi slope of sequence b, head h ([B, H] slopes with `batch_stride`, 0 for [H]) in the units
// add_alibi takes: the natural-log slope times log2(e) / softmax_scale.
__device__ __forceinline__ float alibi_score_slope(const float* slopes, i64 batch_stride, int b, int h,
                                                   float softmax_scale) {
  return slopes[b * batch_stride + h] * kLog2e / softmax_scale;
}

// ROW_HALVES: 2, or 1 where the caller knows that rows 8-15 of every m16 tile are padding (decode
// with at most 8 packed query rows): then only each lane's row g takes part in the softmax, and
// the fragments give rows g + 8 a probability of 0. Their scores and outputs are computed by the
// same MMAs and never read.
template <typename T, int MT, int NT, int DT, int ROW_HALVES = 2>
struct AttentionTile {
  static constexpr int kMTiles = MT;  // m16 tiles of query rows
  static constexpr int kNTiles = NT;  // n8 tiles of keys in one block
  static constexpr int kDTiles = DT;  // n8 tiles of the head dim
  static constexpr int kRowHalves = ROW_HALVES;  // rows g (and g + 8) of each m16 tile that are real
  static_assert(ROW_HALVES == 1 || ROW_HALVES == 2, "an m16 tile holds rows g and g + 8");
  using DTy = DType<T>;

  float s[MT][NT][4];     // scores of the current key block, then probabilities
  float o[MT][DT][4];     // unnormalised output accumulator
  SoftmaxState state[MT][2];  // rows g and g + 8 of each m16 tile; l holds this lane's partial sum

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      state[mt][0].init();
      state[mt][1].init();
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    }
  }

  __device__ __forceinline__ void zero_scores() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
  }

  // With a softcap, turn the raw scores into capped log2-unit scores here (tanh needs them);
  // without one, leave them raw: the softmax folds the scale into its exp2 as one FMA.
  // On boundary blocks, set invisible keys to -inf. `diag_of(mt, r)` gives the diagonal of the
  // lane's row r (0: g, 1: g + 8) of m16 tile mt, i.e. query position + Sk - Sq. The mask
  // compares each key's column within the block against per-row limits, so the per-element
  // work is two compares against compile-time offsets.
  template <bool kMasked, class DiagOf>
  __device__ __forceinline__ void cap_and_mask(const MaskParams& mp, DiagOf diag_of, int col0, int lane) {
    if (!kMasked && mp.softcap_out == 0.f) return;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) {
        // key columns (relative to this lane's first column in the block) the row may see: [lo, hi]
        const int first_col = col0 + (lane % 4) * 2;
        const int diag = kMasked ? diag_of(mt, r) - first_col : 0;
        const int hi = min(diag + mp.window_right, mp.key_end - first_col - 1);
        const int lo = diag - mp.window_left;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float x = s[mt][nt][2 * r + c];
            if (mp.softcap_out > 0.f) x = tanhf(x * mp.score_scale) * mp.softcap_out;
            if (kMasked) {
              const int j = nt * 8 + c;
              x = (j <= hi && j >= lo) ? x : -infinity();
            }
            s[mt][nt][2 * r + c] = x;
          }
      }
  }

  // ALiBi: score(i, j) -= slope * |diag_i - j| on every key of the block (masked keys stay
  // -inf). `slope_of(mt, r)` gives the slope of the lane's row r of m16 tile mt in the units the
  // scores are in here: the natural-log slope times log2(e) / softmax_scale(), since raw scores
  // reach the exp2 multiplied by softmax_scale() and capped ones are in log2 units already. Called
  // after cap_and_mask, so the bias adds to the capped score. Distances are exact in fp32 for any
  // length below 2^24.
  //
  // Where no row of the warp has its diagonal inside the lane's columns of the block (every
  // block of a causal row but the diagonal one), the bias is linear in the key:
  //     -slope * |d - j| = sigma * j - sigma * d,   sigma = slope left of the diagonal (d >= j),
  //                                                        -slope right of it (d <= j)
  // with d the row's diagonal relative to the lane's first column and j = 8 nt + c the register's
  // column, a compile-time constant: one multiply-add per score. The per-row rest, -sigma * d,
  // goes to `bias[mt][r]` (the row's offset, in the scores' units) for row_max and
  // exponentiate, once per row. Elsewhere the distance takes its absolute value per score, and
  // the offset is 0.
  template <class DiagOf, class SlopeOf>
  __device__ __forceinline__ void add_alibi(DiagOf diag_of, SlopeOf slope_of, int col0, int lane,
                                            float (&bias)[MT][2]) {
    constexpr int kLastCol = (kNTiles - 1) * 8 + 1;  // the lane's last column, relative to its first
    // the row's diagonal relative to this lane's first column: key column j is at distance |diag - j|
    const auto diag_rel = [&](int mt, int r) { return diag_of(mt, r) - col0 - (lane % 4) * 2; };
    bool linear = true;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) {
        const int d = diag_rel(mt, r);
        linear &= d >= kLastCol || d <= 0;
      }
    // one path for the warp, so that its lanes do not diverge
    if (__all_sync(0xffffffffu, linear)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < kRowHalves; ++r) {
          const float d = static_cast<float>(diag_rel(mt, r));
          const float slope = slope_of(mt, r);
          const float sigma = d > 0.f ? slope : -slope;
          bias[mt][r] = -sigma * d;
          map_row(mt, r, [=](float x, float j) { return fmaf(sigma, j, x); });
        }
      return;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) {
        const float diag = static_cast<float>(diag_rel(mt, r));
        const float slope = slope_of(mt, r);
        bias[mt][r] = 0.f;
        map_row(mt, r, [=](float x, float j) { return fmaf(-slope, fabsf(diag - j), x); });
      }
  }

  // Every score of the lane's row r of m16 tile mt becomes f(score, j), j its column in the
  // block relative to the lane's first (a compile-time constant after unrolling).
  template <class F>
  __device__ __forceinline__ void map_row(int mt, int r, F f) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) s[mt][nt][2 * r + c] = f(s[mt][nt][2 * r + c], static_cast<float>(nt * 8 + c));
  }

  // Online softmax over the new block: move the row max, rescale the running output, and turn
  // the scores into unnormalised probabilities exp2(scale * x - m). `scale` > 0 (checked on the
  // host), so the max of the raw scores scales to the max of the scaled ones.
  //
  // The max moves lazily: while no row of the warp has grown by more than
  // kLazyRescaleLog2 (SoftmaxState::needs_rescale), m stays put and the output is not rescaled;
  // probabilities are then at most 2^kLazyRescaleLog2, far inside fp32 and the P dtype. After
  // the first blocks the max rarely moves that far, so most blocks skip the rescale.
  //
  // `bias[mt][r]` (add_alibi's per-row offset, 0 without ALiBi) belongs to every score of the
  // lane's row r: the scores held are score - bias. The four lanes of a row hold different
  // offsets, so each adds its own before the quad's max, and exponentiate subtracts it from m.
  __device__ __forceinline__ float row_max(int mt, int r, float scale, const float (&bias)[MT][2]) const {
    float x = -infinity();
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) x = fmaxf(x, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
    // the four lanes of a quad hold the row between them
    return quad_max(x + bias[mt][r]) * scale;
  }

  // Move the row maxes that must move (lazily, see above). Returns whether any row of the warp
  // moved; then factor[mt][r] rescales row r's running output (SoftmaxState::update), which
  // the caller applies with rescale_output: at once (softmax_update), or after a GEMM that is
  // still adding into the output has finished (the Hopper forward).
  __device__ __forceinline__ bool move_max(float scale, float (&factor)[MT][2], const float (&bias)[MT][2]) {
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) rescale |= state[mt][r].needs_rescale(row_max(mt, r, scale, bias));
    // Rare path: recompute the row maxes rather than keep them live in registers.
    if (!__any_sync(0xffffffffu, rescale)) return false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) factor[mt][r] = state[mt][r].update(row_max(mt, r, scale, bias));
    return true;
  }

  // The row max moved: bring the running output to the new reference.
  __device__ __forceinline__ void rescale_output(const float (&factor)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][2 * r] *= factor[mt][r];
          o[mt][dt][2 * r + 1] *= factor[mt][r];
        }
  }

  // Scores to unnormalised probabilities exp2(scale * (x + bias) - m), summed into l.
  __device__ __forceinline__ void exponentiate(float scale, const float (&bias)[MT][2]) {
    float sums[MT][2];
    exponentiate(scale, bias, sums);
    add_row_sums(sums);
  }

  // The same, each row's sum of the block into sums[mt][r] (this lane's part) rather than l.
  __device__ __forceinline__ void exponentiate(float scale, const float (&bias)[MT][2], float (&sums)[MT][2]) {
    float ref[MT][2];
    references(scale, bias, ref);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) {
        float block_sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          const float p0 = exp2f(fmaf(s[mt][nt][2 * r], scale, -ref[mt][r]));
          const float p1 = exp2f(fmaf(s[mt][nt][2 * r + 1], scale, -ref[mt][r]));
          s[mt][nt][2 * r] = p0;
          s[mt][nt][2 * r + 1] = p1;
          block_sum += p0 + p1;
        }
        sums[mt][r] = block_sum;
      }
  }

  __device__ __forceinline__ void softmax_update(float scale, const float (&bias)[MT][2]) {
    float factor[MT][2];
    if (move_max(scale, factor, bias)) rescale_output(factor);
    exponentiate(scale, bias);
  }

  // Round the probabilities to P (T unless the PV GEMM runs in another type) as mma A
  // fragments: two n8 tiles of S make one k16 slice. Done before the second GEMM so the fp32
  // scores are dead while V streams in.
  template <typename P = T>
  __device__ __forceinline__ void to_fragments(u32 (&p)[MT][NT / 2][4]) const {
    fragments_of<P>(p, [&](int mt, int nt, int e) { return s[mt][nt][e]; });
  }

  // The same packing of value(mt, nt, e) in place of the score s[mt][nt][e]. value is called
  // once per score, in the order the fragments take them.
  template <typename P, class Value>
  __device__ __forceinline__ static void fragments_of(u32 (&p)[MT][NT / 2][4], Value value) {
    using DTy = DType<P>;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int ks = 0; ks < NT / 2; ++ks)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float x0 = value(mt, 2 * ks + j, 0), x1 = value(mt, 2 * ks + j, 1);
          if (kRowHalves == 1) {
            p[mt][ks][2 * j] = DTy::pack(x0, x1);
            p[mt][ks][2 * j + 1] = 0u;  // rows g + 8: padding, probability 0
            continue;
          }
          const float x2 = value(mt, 2 * ks + j, 2), x3 = value(mt, 2 * ks + j, 3);
          p[mt][ks][2 * j] = DTy::pack(x0, x1);
          p[mt][ks][2 * j + 1] = DTy::pack(x2, x3);
        }
  }

  // The probabilities as e4m3 A fragments of a k32 wgmma (wgmma.cuh), one per 32 keys. The
  // accumulator gives lane (g, t) keys 8 j + 2 t and 8 j + 2 t + 1 of n8 tile j (rows g, g + 8);
  // the 8-bit A fragment wants keys 4 t .. 4 t + 3 of each 16 (a[0], a[1]) and 16 + 4 t .. (a[2],
  // a[3]). Rather than move bytes between lanes, each lane packs what it holds: within every 16
  // keys, fragment column 4 t + i carries key
  //     pi(4 t + i) = 2 t + (i % 2) + 8 (i / 2)        (i < 4)
  // i.e. a[0] = keys (2 t, 2 t + 1) of n8 tile 4 s and of tile 4 s + 1 (row g), a[1] the same
  // for row g + 8, a[2] and a[3] those of tiles 4 s + 2 and 4 s + 3. The B operand must hold the
  // values of the same keys in the same order: the host stores V^T with the keys of each group
  // of 16 permuted by pi (cuattn/attention.py, _fp8_v_transposed), so O += P V sums over the
  // same key pairs. Probabilities are at most 2^kLazyRescaleLog2 = 256 < 448: no saturation.
  // (A template so that tiles of fewer than 32 keys, which never call it, still declare it.)
  template <int KSTEPS>
  __device__ __forceinline__ void to_e4m3_fragments(u32 (&p)[KSTEPS][4]) const {
    e4m3_fragments_of(p, [&](int, int nt, int e) { return s[0][nt][e]; });
  }

  // The same packing of value(0, nt, e) in place of the score s[0][nt][e], called once per score.
  template <int KSTEPS, class Value>
  __device__ __forceinline__ static void e4m3_fragments_of(u32 (&p)[KSTEPS][4], Value value) {
    static_assert(MT == 1 && KSTEPS * 4 == NT, "one m16 tile per warp, k32 steps covering the block");
    static_assert(kRowHalves == 2, "the FP8 forward's tiles hold 16 rows");
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int lo = 4 * ks + 2 * half, hi = lo + 1;
        const float lo0 = value(0, lo, 0), lo1 = value(0, lo, 1), lo2 = value(0, lo, 2), lo3 = value(0, lo, 3);
        const float hi0 = value(0, hi, 0), hi1 = value(0, hi, 1), hi2 = value(0, hi, 2), hi3 = value(0, hi, 3);
        p[ks][2 * half] = pack_e4m3x4(lo0, lo1, hi0, hi1);      // row g
        p[ks][2 * half + 1] = pack_e4m3x4(lo2, lo3, hi2, hi3);  // row g + 8
      }
  }

  // ---- The online softmax straight into P's fragments (softmax_update + to_fragments), with
  // the row max found only where it must move.
  //
  // softmax_update finds each row's block max before any exponential: a max per score, then the
  // quad's shuffles, a dependent chain ahead of the first exp2. Here the block is exponentiated
  // against the rows' current references first and packed into P as it goes. A lane's partial
  // sum of a row bounds every probability it summed (they are >= 0), so when no lane's sum
  // exceeds 2^kLazyRescaleLog2 every probability is within the lazy rescale's bound, the bound
  // softmax_update keeps, and the block is done. Otherwise (some row's max grew) this returns
  // false, the scores having died as P was packed: the caller computes them again and calls with
  // `exact`, which moves every row's max to the block's (not lazily), rescales the output and l,
  // and exponentiates. A warp with a row that has seen no key yet (its reference is a stand-in)
  // takes the exact path at once. After the first block the max rarely grows that much, so most
  // blocks skip the max altogether. Calling with `exact` again on the same scores changes
  // nothing (the max is where it moved). Only for callers that may write P's fragments now (no
  // GEMM reads them) and rescale the output now (no GEMM adds into it).
  //
  // pack(ref, sums): the fragments of exp2(scale * x - ref[mt][r]) for every score x of row r,
  // each row's sum of them into sums[mt][r] (probs_of gives the values and the sums). The caller
  // adds the sums of the call that returned true to l (add_row_sums).
  template <class Pack>
  __device__ __forceinline__ bool softmax_to_fragments(float scale, const float (&bias)[MT][2], Pack pack,
                                                       bool exact, float (&sums)[MT][2]) {
    float ref[MT][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) exact |= state[mt][r].m == -infinity();
    if (__any_sync(0xffffffffu, exact)) {
      float factor[MT][2];
      move_max_now(scale, factor, bias);
      rescale_output(factor);
      references(scale, bias, ref);
      pack(ref, sums);
      return true;
    }
    references(scale, bias, ref);
    pack(ref, sums);
    return !__any_sync(0xffffffffu, !sums_within_bound(sums));
  }

  // Whether a row of the warp has seen no visible key yet (its reference is a stand-in, so its
  // sums bound nothing): the bounded softmax then takes its exact path at once.
  __device__ __forceinline__ bool any_row_empty() const {
    bool empty = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) empty |= state[mt][r].m == -infinity();
    return __any_sync(0xffffffffu, empty);
  }

  // The exact path's max: every row's max moves to the block's (not lazily, so the block's
  // probabilities are at most 1); factor[mt][r] rescales the running output (l is rescaled here).
  __device__ __forceinline__ void move_max_now(float scale, float (&factor)[MT][2], const float (&bias)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) factor[mt][r] = state[mt][r].update(row_max(mt, r, scale, bias));
  }

  // Whether this lane's partial row sums of a block keep each of its probabilities within the
  // lazy rescale's bound 2^kLazyRescaleLog2 (a sum of non-negative terms bounds each term).
  __device__ __forceinline__ static bool sums_within_bound(const float (&sums)[MT][2]) {
    constexpr float kBound = static_cast<float>(1 << static_cast<int>(kLazyRescaleLog2));
    bool over = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) over |= sums[mt][r] > kBound;
    return !over;
  }

  __device__ __forceinline__ void add_row_sums(const float (&sums)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) state[mt][r].l += sums[mt][r];
  }

  // Each row's reference for the exponentials: m, less the row's ALiBi offset (exponentiate's)
  __device__ __forceinline__ void references(float scale, const float (&bias)[MT][2], float (&ref)[MT][2]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < kRowHalves; ++r) ref[mt][r] = fmaf(-bias[mt][r], scale, state[mt][r].reference());
  }

  // The value function of fragments_of / e4m3_fragments_of for softmax_to_fragments' pack: the
  // probability exp2(scale * x - ref) of score (mt, nt, e), summed into its row's sums.
  __device__ __forceinline__ auto probs_of(float scale, const float (&ref)[MT][2], float (&sums)[MT][2]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) sums[mt][0] = sums[mt][1] = 0.f;
    return [&, scale](int mt, int nt, int e) {
      const float x = exp2f(fmaf(s[mt][nt][e], scale, -ref[mt][e / 2]));
      sums[mt][e / 2] += x;
      return x;
    };
  }
};

}  // namespace cuattn
