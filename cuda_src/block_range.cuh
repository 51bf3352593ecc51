// block_range.cuh: where one sequence's rows are and which (query, key) blocks a mask leaves.
//
// Sequence b of a dense batch starts at row 0 of its batch slice; of a packed varlen batch at
// row cu_seqlens[b] of the packed rows, with its own lengths. Masks are aligned to the
// bottom-right corner: query i sees key j iff j < Sk and
//   i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right
// (the host turns `causal` into window_right = 0 and an unbounded side into a bound no row
// reaches). The forward kernels walk the key blocks a query block can see and evaluate the mask
// only on blocks that cross a boundary; these are the ranges they need.
#pragma once

#include "common.cuh"

namespace cuattn {

struct SequenceRange {
  i64 q_start;  // first packed row of the sequence (0 when dense)
  i64 k_start;
  int seqlen_q;
  int seqlen_k;
  int offset;  // Sk - Sq: the diagonal of query i is i + offset

  // `seqlen_q` / `seqlen_k` are the dense lengths (varlen: the max lengths, replaced here).
  __device__ __forceinline__ SequenceRange(const int* cu_seqlens_q, const int* cu_seqlens_k, int b, int sq, int sk)
      : q_start(0), k_start(0), seqlen_q(sq), seqlen_k(sk) {
    if (cu_seqlens_q != nullptr) {
      q_start = cu_seqlens_q[b];
      k_start = cu_seqlens_k[b];
      seqlen_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
      seqlen_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    }
    offset = seqlen_k - seqlen_q;
  }

  // Key blocks of BLOCK_N keys any of query rows [m0, m0 + rows) sees: [first, last).
  template <int BLOCK_N>
  __device__ __forceinline__ void key_blocks(int m0, int rows, int left, int right, int& first, int& last) const {
    const int end = min(seqlen_k, m0 + rows - 1 + offset + right + 1);
    const int begin = max(0, m0 + offset - left);
    first = begin / BLOCK_N;
    last = end > begin ? (end + BLOCK_N - 1) / BLOCK_N : first;
  }

  // Whether key block [n0, n0 + BLOCK_N) needs the mask for query rows [m0, m0 + rows): some key
  // lies past the sequence, past the first row's right edge or before the last row's left edge.
  template <int BLOCK_N>
  __device__ __forceinline__ bool block_needs_mask(int m0, int rows, int n0, int left, int right) const {
    const int clean_end = min(seqlen_k, m0 + offset + right + 1);
    const int clean_begin = m0 + rows - 1 + offset - left;
    return n0 + BLOCK_N > clean_end || n0 < clean_begin;
  }
};

}  // namespace cuattn
