// block_range.cuh: where one sequence's rows are and which (query, key) blocks a mask leaves.
//
// Sequence b of a dense batch starts at row 0 of its batch slice; of a packed varlen batch at
// row cu_seqlens[b] of the packed rows, with its own lengths. Masks are aligned to the
// bottom-right corner: query i sees key j iff j < Sk and
//   i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right
// (the host turns `causal` into window_right = 0 and an unbounded side into a bound no row
// reaches). The forward kernels walk the key blocks a query block can see and evaluate the mask
// only on blocks that cross a boundary; these are the ranges they need.
//
// Row sources: where row j of a sequence's keys (or queries) lives in global memory, for the
// tile loaders. DenseRows: row j at base + j * row_stride (dense and packed varlen tensors).
// PagedRows: key j in slot j % block_size of page block_table[j / block_size] of a paged cache
// [num_blocks, block_size, Hk, D]. A loader walks rows with a cursor (`at(first, row, col,
// step)`, then `address()` / `next()`): a dense cursor is one pointer bumped by a fixed step; a
// paged one finds each row's page (reading the table when the row leaves the last page it
// read), so any block size works, down to one token a page.
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

  // Paged keys: the queries packed from row q_start, the keys 0 .. seqlen_k of the block table.
  __device__ __forceinline__ SequenceRange(i64 q_first, int sq, int sk)
      : q_start(q_first), k_start(0), seqlen_q(sq), seqlen_k(sk), offset(sk - sq) {}

  // Sequence b of a paged launch (FwdParams' paged fields): its queries packed through
  // cu_seqlens_q, seq_lens[b] keys clamped to [0, the table's capacity p.seqlen_k], as the paged
  // decode clamps unchecked lengths.
  template <class Params>
  __device__ __forceinline__ static SequenceRange paged(const Params& p, int b) {
    const int q_start = p.cu_seqlens_q[b];
    return SequenceRange(q_start, p.cu_seqlens_q[b + 1] - q_start, min(max(p.seq_lens[b], 0), p.seqlen_k));
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

// Rows at a fixed pitch from `base` (row 0 of the sequence at this head).
template <typename T>
struct DenseRows {
  const T* base;
  i64 row_stride;

  struct Cursor {
    const T* ptr;
    i64 step;
    __device__ __forceinline__ const T* address() const { return ptr; }
    __device__ __forceinline__ void next() { ptr += step; }
  };
  // Column `col` of row first + row, moving `step` rows at a time.
  __device__ __forceinline__ Cursor at(int first, int row, int col, int step) const {
    const T* tile = fallback(first);
    return {tile + row * row_stride + col, step * row_stride};
  }
  // A readable address for the copies of a tile from row `first` that only zero-fill (rows past
  // the end).
  __device__ __forceinline__ const T* fallback(int first) const { return base + first * row_stride; }
};

// Keys of one sequence in a paged cache: `base` is page 0, slot 0 at this kv head; `table` the
// sequence's row of the block table. Page ids are clamped into the pool, as the paged decode
// does, so an unchecked table cannot send a copy outside the cache.
template <typename T>
struct PagedRows {
  const T* base;
  const int* table;
  i64 page_stride;
  i64 row_stride;
  FastDivisor block_size;
  int num_blocks;

  // Walks rows j, j + step, ...: consecutive rows mostly share a page, so the cursor keeps the
  // last page it looked up and reads the table again only when the page changes (each read is a
  // dependent load in front of the copy).
  struct Cursor {
    const PagedRows* rows;
    int j;
    int col;
    int step;
    int page;            // the page of the last lookup, or -1
    const T* page_base;  // its slot 0 at this kv head, column col
    __device__ __forceinline__ const T* address() {
      const int p = rows->block_size.div(j);
      if (p != page) {
        const int block = clamp_page(__ldg(rows->table + p), rows->num_blocks);
        page_base = rows->base + block * rows->page_stride + col;
        page = p;
      }
      return page_base + rows->block_size.mod(j, p) * rows->row_stride;
    }
    __device__ __forceinline__ void next() { j += step; }
  };
  __device__ __forceinline__ Cursor at(int first, int row, int col, int step) const {
    return {this, first + row, col, step, -1, base};
  }
  __device__ __forceinline__ const T* fallback(int) const { return base; }
};

}  // namespace cuattn
