"""Paged KV cache: a host-side block allocator with copy-on-write, device pages, and paged_attention.

Sequences of unknown length are served from one pool of fixed-size KV blocks, as an operating
system pages memory (PagedAttention): a sequence's tokens live in whichever blocks were free,
listed in order in its block table, so memory is never fragmented and never reserved for a
maximum length. Sequences that fork (parallel sampling, beam search) share their blocks, each
block carrying a reference count; a shared block is copied only when one of them writes to it.

    BlockManager(num_blocks, block_size, enable_prefix_caching=False)
                                              host (NumPy): tables, refcounts, free list, and
                                              (prefix caching) full blocks keyed by their prefix
    PagedKVCache(num_blocks, block_size, Hk, D, dtype, k_scale=1.0, v_scale=1.0, head_dim_v=None, layout=None)
        k_pages           (num_blocks, block_size, Hk, D)    device arrays (or NumPy with device="cpu")
        v_pages           (num_blocks, block_size, Hk, Dv)   Dv = head_dim_v, default D; stored token-major
                                                             ("NHD") or head-major ("HND", e4m3's
                                                             default: views of (num_blocks, Hk,
                                                             block_size, D) storage)
        write(k, v, slot_ids)     new tokens (N, Hk, D) and (N, Hk, Dv) into slots (block *
                                  block_size + offset); an e4m3 cache quantises them with its scales
        copy_blocks(pairs)        (src, dst) page copies: the copy-on-write that append asks for
    paged_attention(q, cache, block_table, seq_lens, ...)   decode over the block table

A decode step: ``slots, copies = manager.append(seq)`` for each live sequence, then
``cache.copy_blocks(copies)``, ``cache.write(k_new, v_new, slots)``, and
``paged_attention(q, cache, *manager.block_table(seqs))``.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math

import numpy as np

from . import _arrays, _calls, _jit, _masks, _params, decode as _decode, reference
from ._errors import OutOfBlocksError, UnknownSequenceError

# Padding of block tables past a sequence's last block; never read (positions past seq_lens).
TABLE_PAD = -1
MAX_BLOCK_SIZE = 256
# Token ids the prefix cache's hash chain takes (each hashed as an int64).
TOKEN_ID_RANGE = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
# dtypes of token-id arrays, by name (any framework's)
INTEGER_DTYPE_NAMES = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))


def _check_pool(num_blocks: int, block_size: int) -> None:
    """Block ids are int32 in block tables and slot ids are block x block_size + offset: both int32
    counts (block ids and slots below 2^31)."""
    if num_blocks * block_size > _arrays.INT32_RANGE[1] + 1:
        raise ValueError(f"num_blocks x block_size must fit in int32 (slot ids are int32): {num_blocks} x "
                         f"{block_size} = {num_blocks * block_size} slots, more than 2^31")


def _check_block_size(block_size) -> None:
    _arrays.check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)


# Where a PagedKVCache puts its page bytes, in FlashInfer's names: "NHD" token-major, stored
# (num_blocks, block_size, Hk, D) as it is indexed; "HND" head-major, (num_blocks, Hk, block_size,
# D) storage seen through a (num_blocks, block_size, Hk, D) view, so that one kv head's tokens of
# a page lie in one run of block_size * D elements. Every kernel reads pages through their
# strides: the two differ only in where the bytes lie. A decode CTA streams one kv head. Token-major,
# that is a 128-byte piece of each 1 KB token row of an e4m3 page (Hk = 8, D = 128), and such
# pieces scattered over a shuffled pool cost the e4m3 step 5% against pages in order on an H100
# (B = 8, L = 8k, 16-token pages: 54.9 against 52.1 us); head-major, each page gives the CTA one
# 2 KB run: 53.9 us, and 93.8 against 97.2 at B = 16 (BENCHMARKS.md, "Sixty-third session"). A
# 16-bit cache's 256-byte pieces moved 1% or less either way, so it keeps the token-major pages it
# always had.
PAGE_LAYOUTS = ("NHD", "HND")
E4M3_PAGE_LAYOUT = "HND"
DEFAULT_PAGE_LAYOUT = "NHD"


def _page_layout(layout, e4m3: bool) -> str:
    """A cache's page layout: ``layout`` checked, or its element type's default for None."""
    if layout is None:
        return E4M3_PAGE_LAYOUT if e4m3 else DEFAULT_PAGE_LAYOUT
    if not isinstance(layout, str) or layout not in PAGE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in PAGE_LAYOUTS)} or None (the dtype's "
                         f"default), got {layout!r}")
    return layout


def zero_pages(xp, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, layout: str):
    """Zeroed pages as the (num_blocks, block_size, Hk, D) array the kernels index, stored as
    ``layout`` says (for "HND" a view of (num_blocks, Hk, block_size, D) storage)."""
    if layout == "HND":
        return xp.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype).transpose(0, 2, 1, 3)
    return xp.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype)


# ---------------------------------------------------------------------------------------------
# Host-side allocator


class BlockManager:
    """Allocates KV blocks to sequences, with reference counts for sharing and copy-on-write.

    Sequence ids are any hashable values. Every method that cannot be carried out raises before
    changing anything: ``OutOfBlocksError`` when the pool is short, ``UnknownSequenceError`` (a
    ``KeyError`` and a ``ValueError``) for an unknown sequence, ``ValueError`` or ``TypeError`` for
    a bad argument.

    Prefix caching (``enable_prefix_caching=True``, vLLM's automatic prefix caching): a full block
    whose token ids are known is identified by a hash chained over every token id from the
    sequence's start to the block's end, so two prompts with the same first n blocks of tokens
    have the same first n hashes. ``allocate(..., token_ids=...)`` shares (reference count + 1, no
    copy) the blocks of the longest cached prefix of whole blocks, at most ``num_tokens - 1``
    tokens (the last token is always computed), and ``cached_tokens(seq_id)`` says how many
    tokens that covers: their KV is already in the pages. A cached block whose count drops to 0
    stays cached and counts as free; fresh blocks come from never-cached free blocks first, then
    by evicting the least recently freed cached block.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        _arrays.check_int("num_blocks", num_blocks, 1)
        _check_block_size(block_size)
        _check_pool(num_blocks, block_size)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = np.zeros(self.num_blocks, np.int32)  # [num_blocks] tables holding each block
        # a stack: blocks freed last are reused first (they are likeliest still in L2)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._tables: dict[object, list[int]] = {}  # seq id -> its blocks in order
        self._lengths: dict[object, int] = {}  # seq id -> tokens stored
        # prefix caching: block <-> chained hash of its full, known prefix; cached blocks nobody
        # holds, least recently freed first (they are free, and evicted in that order)
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        # per sequence: its token ids while all are known (None once a token came without one),
        # the chain of its full blocks' hashes, and the tokens its allocation found cached
        self._token_ids: dict[object, list[int] | None] = {}
        self._hashes: dict[object, list[bytes]] = {}
        self._cached: dict[object, int] = {}

    # -- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: never-cached ones and cached ones that may be evicted."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks a later prompt with the same prefix can share (held or not)."""
        return len(self._hash_of_block)

    def utilization(self) -> float:
        """Fraction of the pool's blocks in use by at least one sequence."""
        return self.num_used_blocks / self.num_blocks

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> list:
        return list(self._tables)

    def seq_len(self, seq_id) -> int:
        self._require(seq_id)
        return self._lengths[seq_id]

    def cached_tokens(self, seq_id) -> int:
        """Tokens of ``seq_id``'s allocation found in the prefix cache (a multiple of block_size; 0
        without caching): ``slots[:cached_tokens]`` are shared and must not be written."""
        self._require(seq_id)
        return self._cached[seq_id]

    def blocks(self, seq_id) -> list[int]:
        """The physical blocks of a sequence, in token order (a copy)."""
        self._require(seq_id)
        return list(self._tables[seq_id])

    def block_table(self, seq_ids) -> tuple[np.ndarray, np.ndarray]:
        """``(table, seq_lens)`` for a batch: int32 ``(B, max_blocks)`` padded with -1, and int32 ``(B,)``."""
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
            raise TypeError(f"seq_ids must be an iterable of sequence ids (a list, say), got {type(seq_ids).__name__}")
        seq_ids = list(seq_ids)
        for index, seq_id in enumerate(seq_ids):
            self._require(seq_id, f"seq_ids[{index}]")
        width = max([len(self._tables[s]) for s in seq_ids] + [1])
        table = np.full((len(seq_ids), width), TABLE_PAD, np.int32)
        for row, seq_id in enumerate(seq_ids):
            blocks = self._tables[seq_id]
            table[row, :len(blocks)] = blocks
        lens = np.array([self._lengths[s] for s in seq_ids], np.int32)
        return table, lens

    # -- changes

    def allocate(self, seq_id, num_tokens: int, *, token_ids=None) -> np.ndarray:
        """Start sequence ``seq_id`` with room for ``num_tokens`` (its prompt); returns their int32 slot ids.

        With prefix caching, ``token_ids`` (``num_tokens`` ints) lets the sequence share the cached
        blocks of its longest known prefix (see :meth:`cached_tokens`) and makes its own full
        blocks shareable."""
        _check_seq_id(seq_id)
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists; free it first or pick another id")
        num_tokens = _arrays.check_int("num_tokens", num_tokens, minimum=0)
        tokens = self._check_token_ids(token_ids, num_tokens)
        hashes = self._chain([], tokens, 0) if tokens is not None else []
        # the longest cached prefix of whole blocks, leaving at least the last token to compute
        shared = []
        for digest in hashes[:max(num_tokens - 1, 0) // self.block_size]:
            block = self._block_of_hash.get(digest)
            if block is None:
                break
            shared.append(block)
        needed = self._blocks_for(num_tokens) - len(shared)
        reclaimed = sum(1 for block in shared if self.refcount[block] == 0)  # free now, held after
        self._require_free(needed + reclaimed, f"allocate {_count(num_tokens, 'token')} for sequence {seq_id!r}")
        for block in shared:
            if self.refcount[block] == 0:
                del self._evictable[block]
            self.refcount[block] += 1
        blocks = shared + [self._take() for _ in range(needed)]
        self._tables[seq_id] = blocks
        self._lengths[seq_id] = num_tokens
        self._token_ids[seq_id] = tokens
        self._hashes[seq_id] = hashes
        self._cached[seq_id] = len(shared) * self.block_size
        self._register(blocks, hashes, len(shared))
        return self._slots(blocks, 0, num_tokens)

    def append(self, seq_id, num_tokens: int = 1, *, token_ids=None) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Room for ``num_tokens`` more tokens of ``seq_id``.

        Returns the int32 slot ids to write them to, and the ``(src, dst)`` block copies that must
        run first: when the partly filled last block is shared with another sequence, this
        sequence gets a private copy of it (copy-on-write) before writing into it. With prefix
        caching, ``token_ids`` makes the blocks these tokens fill shareable (a sequence whose
        tokens came once without ids caches no further blocks).
        """
        self._require(seq_id)
        num_tokens = _arrays.check_int("num_tokens", num_tokens, minimum=0)
        new_tokens = self._check_token_ids(token_ids, num_tokens)
        blocks, length = self._tables[seq_id], self._lengths[seq_id]
        if num_tokens == 0:  # nothing to write: no copy-on-write either (as allocate of 0 tokens)
            return np.zeros(0, np.int32), []
        partial = length % self.block_size != 0
        copy_on_write = partial and self.refcount[blocks[-1]] > 1
        needed = self._blocks_for(length + num_tokens) - len(blocks) + int(copy_on_write)
        self._require_free(needed, f"append {_count(num_tokens, 'token')} to sequence {seq_id!r}")
        copies = []
        if copy_on_write:
            # the last block is shared and about to be written: swap in a private copy
            src, dst = blocks[-1], self._take()
            self.refcount[src] -= 1
            blocks[-1] = dst
            copies.append((src, dst))
        while len(blocks) < self._blocks_for(length + num_tokens):
            blocks.append(self._take())
        self._lengths[seq_id] = length + num_tokens
        known = self._token_ids[seq_id]
        if known is not None and new_tokens is not None:
            known.extend(new_tokens)
            hashes = self._hashes[seq_id]
            done = len(hashes)
            hashes.extend(self._chain(hashes, known, done))
            self._register(blocks, hashes, done)
        else:
            self._token_ids[seq_id] = None
        return self._slots(blocks, length, num_tokens), copies

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference counts + 1, nothing copied)."""
        self._require(parent, "parent")
        _check_seq_id(child)
        if child in self._tables:
            raise ValueError(f"cannot fork onto sequence {child!r}: it already exists")
        blocks = list(self._tables[parent])
        for block in blocks:
            self.refcount[block] += 1
        self._tables[child] = blocks
        self._lengths[child] = self._lengths[parent]
        known = self._token_ids[parent]
        self._token_ids[child] = list(known) if known is not None else None
        self._hashes[child] = list(self._hashes[parent])
        self._cached[child] = self._cached[parent]

    def free(self, seq_id) -> None:
        """Drop a sequence; blocks no other sequence holds go back to the pool (cached ones stay
        cached, to be shared again or evicted when fresh blocks run out)."""
        _check_seq_id(seq_id)
        if seq_id not in self._tables:
            raise UnknownSequenceError(f"cannot free sequence {seq_id!r}: it is not allocated (freed twice?)")
        for block in reversed(self._tables.pop(seq_id)):
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                if block in self._hash_of_block:
                    self._evictable[block] = None  # the most recently freed: evicted last
                else:
                    self._free.append(block)
        for per_seq in (self._lengths, self._token_ids, self._hashes, self._cached):
            del per_seq[seq_id]

    # -- helpers

    def _require(self, seq_id, name: str = "seq_id") -> None:
        _check_seq_id(seq_id)
        if seq_id not in self._tables:
            raise UnknownSequenceError(f"{name} = {seq_id!r} is not an allocated sequence (allocate it first, or "
                                       "was it freed?)")

    def _require_free(self, needed: int, what: str) -> None:
        free = self.num_free_blocks
        if needed > free:
            raise OutOfBlocksError(
                f"cannot {what}: needs {_count(needed, 'free block')}, {free} of {self.num_blocks} "
                f"{'is' if free == 1 else 'are'} free"
            )

    def _check_token_ids(self, token_ids, num_tokens: int) -> list[int] | None:
        """The token ids as ints (None when not given or caching is off)."""
        if token_ids is None or not self.enable_prefix_caching:
            return None
        if _arrays.is_array(token_ids) and _arrays.any_dtype_name(token_ids.dtype) not in INTEGER_DTYPE_NAMES:
            # told by name before any copy: a framework's dtype NumPy lacks (torch.float8_e5m2)
            shape = tuple(token_ids.shape)
            raise ValueError(f"token_ids must be {num_tokens} integers (one per token), got "
                             f"{shape[0] if len(shape) == 1 else shape} of {_arrays.any_dtype_name(token_ids.dtype)}")
        try:
            # the block manager lives on the host: a device array of ids is copied there
            ids = np.asarray(_arrays.to_numpy(token_ids) if _arrays.is_array(token_ids) else token_ids)
        except ValueError as exc:  # ragged nesting
            raise ValueError(f"token_ids must be {num_tokens} integers (one per token), got {token_ids!r:.80}") from exc
        if (ids.dtype == object and ids.ndim == 1 and ids.shape[0] == num_tokens
                and all(isinstance(t, (int, np.integer)) for t in ids)):
            big = [int(t) for t in ids]  # Python ints past int64, which NumPy keeps as objects
            raise ValueError(f"token_ids must fit in int64, got {min(big)} .. {max(big)}")
        if ids.ndim != 1 or ids.shape[0] != num_tokens or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"token_ids must be {num_tokens} integers (one per token), got "
                             f"{ids.shape[0] if ids.ndim == 1 else ids.shape} of {ids.dtype}")
        # the hash chain reads each id as an int64
        if ids.size and (int(ids.min()) < TOKEN_ID_RANGE[0] or int(ids.max()) > TOKEN_ID_RANGE[1]):
            raise ValueError(f"token_ids must fit in int64, got {int(ids.min())} .. {int(ids.max())}")
        return [int(t) for t in ids]

    def _chain(self, hashes: list[bytes], tokens: list[int], start_block: int) -> list[bytes]:
        """Hashes of the full blocks from ``start_block`` on: each covers its tokens and, through
        the previous hash, every token before them."""
        out = []
        previous = hashes[start_block - 1] if start_block else b""
        for block in range(start_block, len(tokens) // self.block_size):
            chunk = np.asarray(tokens[block * self.block_size:(block + 1) * self.block_size], np.int64)
            previous = hashlib.sha256(previous + chunk.tobytes()).digest()
            out.append(previous)
        return out

    def _register(self, blocks: list[int], hashes: list[bytes], start: int) -> None:
        """Make blocks[start:len(hashes)] shareable under their hashes (a prefix already cached in
        another block keeps that block)."""
        if not self.enable_prefix_caching:
            return
        for index in range(start, len(hashes)):
            block, digest = blocks[index], hashes[index]
            if digest not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[digest] = block
                self._hash_of_block[block] = digest

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        """A fresh block: a never-cached free one, else the least recently freed cached one, whose
        hash is forgotten."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
        self.refcount[block] = 1
        return block

    def _slots(self, blocks: list[int], start: int, count: int) -> np.ndarray:
        """Slot ids of tokens start .. start + count - 1: block * block_size + offset."""
        if not count:
            return np.zeros(0, np.int32)
        # only the blocks these tokens fall in (a long sequence's append stays O(count))
        first = start // self.block_size
        written = np.asarray(blocks[first:self._blocks_for(start + count)], np.int64)
        positions = np.arange(start, start + count)
        return (written[positions // self.block_size - first] * self.block_size
                + positions % self.block_size).astype(np.int32)


def _check_seq_id(seq_id) -> None:
    """Sequence ids key dicts: any hashable value."""
    try:
        hash(seq_id)
    except TypeError as exc:
        raise TypeError(f"seq_id must be hashable (an int or a str, say), got {type(seq_id).__name__}") from exc


def _count(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``: error messages count in English."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# ---------------------------------------------------------------------------------------------
# Device pages


class PagedKVCache:
    """Key pages ``(num_blocks, block_size, Hk, D)`` and value pages ``(num_blocks, block_size, Hk,
    Dv)`` with the kernels that fill them; ``head_dim_v`` (Dv, default None: D) is v's own head dim,
    under the same rules as ``head_dim`` (DeepSeek-style caches: D = 192, Dv = 128).

    ``device="cuda"`` (default) keeps the pages in CuPy arrays on the current GPU;
    ``device="cpu"`` keeps them in NumPy arrays (writes and copies then run in NumPy, and
    ``paged_attention`` on NumPy queries runs the float64 reference).

    ``dtype`` float16 or bfloat16, or float8 e4m3 (``ml_dtypes.float8_e4m3fn``, ``"float8_e4m3fn"``
    or ``torch.float8_e4m3fn``): an FP8 cache takes half the memory, and ``write`` stores
    round-to-nearest-even(x / scale) saturated to +-448 from fp16, bf16 or fp32 tokens. ``k_scale``
    and ``v_scale`` (real value = stored x scale) are floats or ``(Hk,)`` arrays (per kv head; see
    :func:`cuattn.fp8_scales`), fixed for the cache's life and used by ``paged_attention``. The
    pages of a GPU FP8 cache are CuPy uint8 arrays holding the e4m3 bytes.

    ``layout`` says where the page bytes lie (``layout`` attribute); ``k_pages`` and ``v_pages``
    are indexed ``(num_blocks, block_size, Hk, D)`` either way. ``"NHD"``: token-major, contiguous
    arrays (the default of 16-bit caches). ``"HND"``: head-major, views of ``(num_blocks, Hk,
    block_size, D)`` storage, each kv head's tokens of a page in one run (the default of e4m3
    caches, whose decode steps over scattered pages it speeds up). A pool of your own in either
    layout goes to ``paged_attention`` the same way, as such a view.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device="cuda", *,
                 k_scale=1.0, v_scale=1.0, head_dim_v=None, layout=None):
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads)):
            _arrays.check_int(name, value, 1)
        _check_block_size(block_size)
        _check_pool(num_blocks, block_size)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            _arrays.check_head_dim(name, _arrays.check_int(name, value, 0))
        dtype = _cache_dtype(dtype)
        self.e4m3 = dtype == _arrays.FLOAT8_E4M3
        self.layout = _page_layout(layout, self.e4m3)
        if self.e4m3:
            _arrays.check_e4m3_head_dim("head_dim", head_dim)
            _arrays.check_e4m3_head_dim("head_dim_v", head_dim_v)
        if device == "cuda" and dtype not in _arrays.CUDA_TYPES and not self.e4m3:
            raise TypeError(f"dtype is {_arrays.dtype_name(dtype)}; the paged kernels take float16, bfloat16 or "
                            "float8_e4m3fn")
        if device == "cpu":
            if dtype not in (*_arrays.HOST_FLOAT_TYPES, _arrays.FLOAT8_E4M3):
                raise TypeError(f"dtype is {_arrays.dtype_name(dtype)}; a CPU cache takes float16, bfloat16, float32, "
                                "float64 or float8_e4m3fn")
            xp = np
        else:
            _jit.require_gpu()
            import cupy as xp
        pages = (int(num_blocks), int(block_size), int(num_kv_heads))
        # the pages' storage: e4m3 bytes are uint8 in CuPy, which has no float8 type
        storage = _arrays.E4M3_STORAGE if self.e4m3 and device == "cuda" else dtype
        self.k_pages = zero_pages(xp, *pages, int(head_dim), storage, self.layout)  # [num_blocks, block_size, Hk, D]
        self.v_pages = zero_pages(xp, *pages, int(head_dim_v), storage, self.layout)  # [num_blocks, block_size, Hk, Dv]
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.num_kv_heads, self.head_dim, self.dtype, self.device = int(num_kv_heads), int(head_dim), dtype, device
        self.head_dim_v = int(head_dim_v)
        # per kv head, float32, where the pages are: the write kernel and paged_attention read them
        self.k_scale, self.v_scale = (self._scale_per_head(name, value, xp)
                                      for name, value in (("k_scale", k_scale), ("v_scale", v_scale)))

    def _scale_per_head(self, name: str, value, xp):
        """A cache scale as float32 ``(Hk,)`` on the pages' device; only an e4m3 cache has scales other than 1."""
        if _arrays.is_array(value):
            # the dtype before the copy, which a torch dtype NumPy lacks would fail
            _arrays.check_float32(name, value)
            given = _arrays.to_numpy(value)
        elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
            given = _arrays.as_float(value)
        else:
            raise TypeError(f"{name} must be a float or an array of shape (), (1,) or (Hk,) = ({self.num_kv_heads},), "
                            f"got {type(value).__name__}")
        # checked as the kernels (and the host writes) take it: in float32
        with np.errstate(over="ignore", under="ignore"):
            host = np.asarray(given, np.float64).astype(np.float32)
        if host.shape not in ((), (1,), (self.num_kv_heads,)):
            raise ValueError(f"{name}.shape must be (), (1,) or (Hk,) = ({self.num_kv_heads},), got {host.shape}")
        if not _arrays.positive_normal_float32(host):
            raise ValueError(f"{name} must be positive, finite and normal in float32 (the kernels' type), got "
                             f"{np.asarray(given).tolist()}")
        if not self.e4m3 and (host != 1).any():
            raise ValueError(f"{name} applies to float8_e4m3fn caches only; this cache holds "
                             f"{_arrays.dtype_name(self.dtype)}")
        return xp.asarray(np.broadcast_to(host.reshape(-1), (self.num_kv_heads,)))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, k, v, slot_ids) -> None:
        """Store new tokens' keys ``(N, Hk, D)`` and values ``(N, Hk, Dv)`` at ``slot_ids`` ``(N,)``
        (-1 = padding, skipped).

        k and v have the cache's dtype; an e4m3 cache takes float16, bfloat16 or float32 and stores
        round-to-nearest-even(x / scale) saturated to +-448. Each slot id appears at most once (the tokens are written
        in parallel, so two writes to one slot have no order). Host slot ids (NumPy, lists) are
        checked for both rules against the pool before launch, on either device; device slot ids
        (any framework's) are checked for their shape, integer dtype and device but their values
        are not read on the host (no sync): the kernel skips any outside the pool, and duplicates
        are the caller's to avoid. int32 and int64 device ids reach the kernel without a cast (see
        _kernel_slots). A write on the host (a CPU cache, or NumPy tokens) copies device slot ids
        there and checks them in full.
        """
        with _arrays.array_context(k=k, v=v) as ctx:
            kv_, vv_ = ctx.view(k), ctx.view(v)
            for name, x, dim, dim_name, dim_field in (("k", kv_, self.head_dim, "D", "head_dim"),
                                                      ("v", vv_, self.head_dim_v, "Dv", "head_dim_v")):
                _arrays.check_ndim(name, x, f"(N, Hk, {dim_name})")
                _arrays.check_axis(name, x, 1, "Hk", self.num_kv_heads, "the cache's num_kv_heads")
                _arrays.check_axis(name, x, 2, dim_name, dim, f"the cache's {dim_field}")
            _arrays.check_axis("v", vv_, 0, "N", int(kv_.shape[0]), "k.shape[0]")
            host_path = self.device == "cpu" or ctx.on_host
            slots = _slot_array(slot_ids, int(kv_.shape[0]), self.num_slots, host_path)
            if not isinstance(slots, np.ndarray):  # a device array, bound for the kernel
                _arrays.check_same_device("slot_ids", slots, "k", kv_)
            for name, x in (("k", kv_), ("v", vv_)):
                if self.e4m3:
                    if np.dtype(x.dtype) not in QUANTIZED_WRITE_TYPES:
                        raise TypeError(f"{name}.dtype is {_arrays.dtype_name(x.dtype)}; an e4m3 cache takes float16, "
                                        "bfloat16 or float32 tokens and quantises them")
                    # one write kernel reads both in one type
                    _arrays.check_same_dtype(name, x, "k", kv_)
                elif np.dtype(x.dtype) != self.dtype:
                    raise TypeError(f"{name}.dtype must equal the cache's dtype = {_arrays.dtype_name(self.dtype)}, "
                                    f"got {_arrays.dtype_name(x.dtype)}")
            if host_path:
                _arrays.check_last_axes({"k": kv_, "v": vv_})  # the device's layout rule, kept on the CPU
                self._write_host(kv_, vv_, slots)
                return
            import cupy

            for name, x in (("k", kv_), ("v", vv_)):
                _arrays.check_kernel_layout(name, x)
            self._launch_write(kv_, vv_, _kernel_slots(cupy.asarray(slots)), ctx.stream)

    def copy_blocks(self, pairs) -> None:
        """Run ``(src, dst)`` page copies (both K and V) in one launch; an empty list does nothing.

        The copies run in parallel, so each destination appears once and is no pair's source
        (``BlockManager.append`` always hands out fresh destinations).
        """
        if pairs is None or not (isinstance(pairs, (list, tuple)) or _arrays.is_array(pairs)):
            raise TypeError(f"pairs must be a list of (src, dst) block ids or an int array (P, 2), got "
                            f"{type(pairs).__name__}")
        # the pairs are checked on the host: a device array is copied there first
        pairs = np.asarray(_arrays.to_numpy(_arrays.host_int32("pairs", pairs)))
        if pairs.shape == (0,):  # an empty list
            pairs = np.zeros((0, 2), np.int32)
        if pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs must be (src, dst) pairs, shape (P, 2), got shape {pairs.shape}")
        if pairs.dtype.kind not in "iu":
            raise TypeError(f"pairs must hold block ids (ints), got {pairs.dtype} values")
        outside = (pairs < 0) | (pairs >= self.num_blocks)
        if outside.any():
            i, j = map(int, np.argwhere(outside)[0])
            raise ValueError(f"block ids in pairs must lie in [0, num_blocks = {self.num_blocks}), got pairs[{i}] = "
                             f"{tuple(pairs[i].tolist())} ({'src' if j == 0 else 'dst'} {int(pairs[i, j])})")
        dst = pairs[:, 1]
        unique, counts = np.unique(dst, return_counts=True)
        if (counts > 1).any():
            # the copies run in parallel: a block written twice has no order
            twice = int(unique[counts > 1][0])
            rows = np.flatnonzero(dst == twice)[:2].tolist()
            raise ValueError(f"pairs: each destination block may appear once; block {twice} is the destination of "
                             f"pairs[{rows[0]}] and pairs[{rows[1]}]")
        read = np.flatnonzero(np.isin(dst, pairs[:, 0]))
        if read.size:
            # a block both written and read has no order either
            i = int(read[0])
            readers = np.flatnonzero(pairs[:, 0] == dst[i])
            which = "it reads too" if readers.tolist() == [i] else f"which pairs[{int(readers[readers != i][0])}] reads"
            raise ValueError(f"pairs: a destination block is never a source; pairs[{i}] = {tuple(pairs[i].tolist())} "
                             f"writes block {int(dst[i])}, {which}")
        if not pairs.size:
            return
        if self.device == "cpu":
            for src, dst in pairs:
                self.k_pages[dst] = self.k_pages[src]
                self.v_pages[dst] = self.v_pages[src]
            return
        import cupy

        spec = cache_spec("copy_blocks_kernel", self.dtype)
        chunks = self.block_size * self.num_kv_heads * self._chunks_per_row()
        pairs_d = cupy.ascontiguousarray(cupy.asarray(pairs, dtype=cupy.int32))  # [P, 2], read as 2 P ints
        params = self._cache_params(k=None, v=None, slot_ids=None, slot_ids_wide=None, pairs=pairs_d, k_sn=0, k_sh=0,
                                    v_sn=0, v_sh=0, num_tokens=0)
        with cupy.cuda.Device(self.k_pages.device.id):
            _jit.prepare(spec, (len(pairs), math.ceil(chunks / _params.constant("kCacheThreads")), 1), params).run(_jit.stream_ptr(None))

    def _cache_params(self, **fields):
        """CacheParams with the pages' fields filled in; the call's own fields come in ``fields``."""
        kp, vp = _arrays.element_strides(self.k_pages), _arrays.element_strides(self.v_pages)
        return _params.pack(
            "CacheParams", k_pages=self.k_pages, v_pages=self.v_pages,
            k_scale=self.k_scale if self.e4m3 else None, v_scale=self.v_scale if self.e4m3 else None, kp_sp=kp[0], kp_ss=kp[1], kp_sh=kp[2],
            vp_sp=vp[0], vp_ss=vp[1], vp_sh=vp[2], num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            head_dim_v=self.head_dim_v, block_size=self.block_size, num_blocks=self.num_blocks, **fields,
        )

    def _chunks_per_row(self) -> int:
        """16-byte chunks the cache kernels give one (slot, kv head): a thread's column covers k's and
        v's rows at once, so as many as the longer row holds."""
        return max(self.head_dim, self.head_dim_v) * self.dtype.itemsize // _params.constant("kCopyBytes")

    def _write_host(self, k, v, slots) -> None:
        keep = slots >= 0
        slots = np.asarray(slots)[keep]
        xp = np if self.device == "cpu" else __import__("cupy")
        pages, offsets = slots // self.block_size, slots % self.block_size
        k, v = xp.asarray(k)[keep], xp.asarray(v)[keep]
        if self.e4m3:
            k, v = (quantize_e4m3(_arrays.to_numpy(x), _arrays.to_numpy(scale))
                    for x, scale in ((k, self.k_scale), (v, self.v_scale)))
            if self.device == "cuda":
                k, v = (xp.asarray(x.view(_arrays.E4M3_STORAGE)) for x in (k, v))
        self.k_pages[pages, offsets] = k
        self.v_pages[pages, offsets] = v

    def _launch_write(self, k, v, slots: tuple, stream) -> None:
        """The write kernel over ``slots``, _kernel_slots' (int32 ids, int64 ids): one is None."""
        num_tokens = int(k.shape[0])
        if num_tokens == 0:
            return
        spec = cache_spec("cache_write_kernel", self.dtype, k.dtype)
        ks, vs = _arrays.element_strides(k), _arrays.element_strides(v)
        chunks = num_tokens * self.num_kv_heads * self._chunks_per_row()
        params = self._cache_params(k=k, v=v, slot_ids=slots[0], slot_ids_wide=slots[1], pairs=None, k_sn=ks[0],
                                    k_sh=ks[1], v_sn=vs[0], v_sh=vs[1], num_tokens=num_tokens)
        _jit.prepare(spec, (math.ceil(chunks / _params.constant("kCacheThreads")), 1, 1), params).run(_jit.stream_ptr(stream))




# What a quantising write (to an e4m3 cache) reads.
QUANTIZED_WRITE_TYPES = {**_arrays.CUDA_TYPES, np.dtype(np.float32): "float"}


# Cache dtypes given by name (as str() gives them) that NumPy cannot read or would not take as
# e4m3: torch's dtypes, and e4m3's own name.
CACHE_DTYPE_NAMES = {"float8_e4m3fn": _arrays.FLOAT8_E4M3, "torch.float8_e4m3fn": _arrays.FLOAT8_E4M3,
                     "torch.float16": np.dtype(np.float16), "torch.bfloat16": _arrays.BFLOAT16,
                     "torch.float32": np.dtype(np.float32)}


def _cache_dtype(dtype) -> np.dtype:
    """A cache dtype as NumPy's: NumPy's own, or one CACHE_DTYPE_NAMES names."""
    if dtype is None:
        raise TypeError("dtype must be a float dtype (float16, bfloat16, float8_e4m3fn, ...), got None")
    if str(dtype) in CACHE_DTYPE_NAMES:
        return CACHE_DTYPE_NAMES[str(dtype)]
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype must be a float dtype (float16, bfloat16, float8_e4m3fn, ...), got {dtype!r}") from exc


def quantize_e4m3(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Host e4m3 of x [..., Hk, D] / scale [Hk] (float32 division, as the write kernel does):
    round to nearest even, saturated to +-448, NaN kept."""
    ratio = x.astype(np.float32) / np.asarray(scale, np.float32).reshape(-1, 1)
    return np.clip(ratio, -_arrays.E4M3_MAX, _arrays.E4M3_MAX).astype(_arrays.FLOAT8_E4M3)


def _check_slot_layout(slots, num_tokens: int) -> None:
    """One integer slot id per token: the kernel reads slot_ids[n] for every token n < N."""
    if slots.ndim != 1 or slots.shape[0] != num_tokens:
        raise ValueError(f"slot_ids must be 1-D (N,) with N = k.shape[0] = {num_tokens}, got shape {slots.shape}")
    if slots.dtype.kind not in "iu":
        raise TypeError(f"slot_ids.dtype must be an integer type, got {_arrays.dtype_name(slots.dtype)}")


def _kernel_slots(slots) -> tuple:
    """Device slot ids as the write kernel reads them, ``(int32 ids, None)`` or ``(None, int64
    ids)``, contiguous (a strided view is copied). int32 and int64 ids are read as they are (no
    cast kernel for the int64 slot mappings serving engines keep); uint32 and uint64 ones widen to
    int64 and narrower ones to int32, so that no id wraps into the pool: the kernel skips every id
    outside it at full width."""
    import cupy

    if slots.dtype == np.int32 or slots.dtype.itemsize < np.dtype(np.int32).itemsize:
        return cupy.ascontiguousarray(slots, dtype=cupy.int32), None
    return None, cupy.ascontiguousarray(slots, dtype=cupy.int64)


def _slot_array(slot_ids, num_tokens: int, num_slots: int, host: bool):
    """Slot ids where the write reads them. A write on the host checks them in full (device ones
    are copied there first); one by the kernel checks a device array's layout and device only,
    never its values (no sync: the kernel skips slots outside the pool)."""
    device = not isinstance(slot_ids, (list, tuple)) and _arrays.array_kind(slot_ids, "slot_ids") != "numpy"
    if device and not host:
        import cupy

        slots = cupy.asarray(slot_ids)  # any framework's device array, zero-copy (CUDA array interface)
        _check_slot_layout(slots, num_tokens)
        return slots
    slots = np.asarray(_arrays.to_numpy(slot_ids) if device else _arrays.host_int32("slot_ids", slot_ids))
    _check_slot_layout(slots, num_tokens)
    bad = (slots < -1) | (slots >= num_slots)
    if bad.any():
        at = np.flatnonzero(bad)[:8]
        raise ValueError(f"slot_ids must lie in [0, {num_slots}) or be -1 (padding); got "
                         + ", ".join(f"slot_ids[{i}] = {int(slots[i])}" for i in at))
    written = slots[slots >= 0]
    unique, counts = np.unique(written, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_ids must not repeat a slot (the writes run in parallel); repeated: "
                         f"{unique[counts > 1][:8].tolist()}")
    return slots.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Attention over the pages


CACHE_KERNELS = ("cache_write_kernel", "copy_blocks_kernel")


def _cache_ctype(dtype) -> str:
    dtype = np.dtype(dtype)
    return _arrays.E4M3_TYPE if dtype in (_arrays.FLOAT8_E4M3, _arrays.E4M3_STORAGE) else _arrays.CUDA_TYPES[dtype]


@functools.lru_cache(maxsize=None)
def cache_spec(name: str, dtype, token_dtype=None) -> _jit.KernelSpec:
    """One of the cache kernels (CACHE_KERNELS) for pages of ``dtype``; the write takes tokens of
    ``token_dtype`` (default: the pages' own; fp16, bf16 or fp32 into e4m3 pages)."""
    pages = _cache_ctype(dtype)
    if name == "copy_blocks_kernel":
        args = pages
    else:
        tokens = pages if token_dtype is None else QUANTIZED_WRITE_TYPES[np.dtype(token_dtype)]
        args = f"{tokens}, {pages}"
    return _jit.KernelSpec("cache_ops.cu", f"cuattn::{name}<{args}>", threads=_params.constant("kCacheThreads"))


def kernel_variants(arch: str) -> list[_jit.KernelSpec]:
    """The cache kernels and the strided copies (the paged attention variants are listed with decode's)."""
    specs = [cache_spec(name, dtype) for dtype in _arrays.CUDA_TYPES for name in CACHE_KERNELS]
    specs.append(cache_spec("copy_blocks_kernel", _arrays.FLOAT8_E4M3))
    specs += [cache_spec("cache_write_kernel", _arrays.FLOAT8_E4M3, token) for token in QUANTIZED_WRITE_TYPES]
    specs += [copy_spec(chunk) for chunk in COPY_CHUNK_BYTES]
    return specs


# strided_copy_kernel's chunks, widest first: 16-byte vectors (rows of 16-bit elements whose head
# dim is a multiple of 8), 32-bit words (float32 scalars: log-sum-exps)
COPY_CHUNK_BYTES = (16, 4)
COPY_AXES = 5  # four outer axes and the contiguous row


@functools.lru_cache(maxsize=None)
def copy_spec(chunk_bytes: int) -> _jit.KernelSpec:
    """strided_copy_kernel (cache_ops.cu) moving chunks of ``chunk_bytes`` (one of COPY_CHUNK_BYTES)."""
    return _jit.KernelSpec("cache_ops.cu", f"cuattn::strided_copy_kernel<{chunk_bytes}>",
                           threads=_params.constant("kCacheThreads"))


def prepare_copy(src, dst) -> _jit.Launch | None:
    """A prepared ``dst[...] = src`` between CuPy views of one shape and dtype (at most COPY_AXES
    axes, the last contiguous in both); ``src`` may repeat along an axis (stride 0, from
    ``cupy.broadcast_to``). A plan rewrites the ``src`` and ``dst`` fields per run. Chunks are the
    widest of COPY_CHUNK_BYTES that divides the row, every stride and both addresses. Returns None
    when there is nothing to copy."""
    if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
        raise ValueError(f"a strided copy needs one shape and dtype, got {src.shape} {src.dtype} -> "
                         f"{dst.shape} {dst.dtype}")
    if not 1 <= dst.ndim <= COPY_AXES or any(x.ndim and x.strides[-1] != x.itemsize for x in (src, dst)):
        raise ValueError(f"a strided copy takes 1 to {COPY_AXES} axes, the last contiguous; got shape {dst.shape}, "
                         f"strides {src.strides} -> {dst.strides}")
    if dst.size == 0:
        return None
    src_address, dst_address = src.data.ptr, dst.data.ptr
    row_bytes = int(dst.shape[-1]) * dst.itemsize
    byte_strides = [int(n) for x in (src, dst) for n in x.strides[:-1]]
    chunk = next((c for c in COPY_CHUNK_BYTES
                  if all(n % c == 0 for n in (row_bytes, src_address, dst_address, *byte_strides))), None)
    if chunk is None:
        raise ValueError(f"a strided copy moves whole 32-bit words; got rows of {row_bytes} bytes, strides "
                         f"{src.strides} -> {dst.strides}")
    pad = COPY_AXES - dst.ndim  # leading axes of one entry
    outer = (1,) * pad + tuple(int(n) for n in dst.shape[:-1])
    src_strides = (0,) * pad + tuple(int(n) // chunk for n in src.strides[:-1])
    dst_strides = (0,) * pad + tuple(int(n) // chunk for n in dst.strides[:-1])
    row_chunks = row_bytes // chunk
    params = _params.pack(
        "CopyParams", src=src_address, dst=dst_address,
        **{f"src_s{i}": n for i, n in enumerate(src_strides)}, **{f"dst_s{i}": n for i, n in enumerate(dst_strides)},
        **{f"n{i}": n for i, n in enumerate(outer)}, row_chunks=row_chunks)
    spec = copy_spec(chunk)
    chunks = int(np.prod(outer)) * row_chunks
    return _jit.prepare(spec, (-(-chunks // spec.threads), 1, 1), params)


def paged_attention(q, cache, block_table, seq_lens, *, max_seq_len=None, num_splits=None, causal=True,
                    scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False,
                    check=True, k_scale=None, v_scale=None):
    """Decode or short chunked prefill (``Sq_new <= 16``) of a batch over a paged KV cache.

    Args:
        q: ``(B, Sq_new, Hq, D)``.
        cache: a :class:`PagedKVCache`, or a ``(k_pages, v_pages)`` pair of arrays
            ``(num_blocks, block_size, Hk, D)`` and ``(num_blocks, block_size, Hk, Dv)`` from any
            framework (NumPy too); v's head dim Dv may differ from D (as in :func:`cuattn.decode`);
            any block size from 1 to 256; page and slot strides below 2^31 elements.
        block_table: int32 ``(B, max_blocks)``: sequence b's token t is in page
            ``block_table[b, t // block_size]``. NumPy tables are uploaded.
        seq_lens: int32 ``(B,)`` tokens per sequence, the new tokens' own included.
        max_seq_len: optional bound on ``seq_lens`` for choosing the split count; default the
            table's capacity (or the largest host length).
        check: refuse, before launch, block ids outside the pool and lengths beyond the table's
            capacity. Device tables and lengths are then copied to the host (a sync); pass
            ``check=False`` to skip that (e.g. inside a CUDA graph): lengths are then clamped to
            [0, the capacity] and block ids to the pool, on the device and on the CPU path alike.
        num_splits, causal, scale, window, softcap, sinks, alibi_slopes, return_lse: as in
            :func:`cuattn.decode`, with Sk = seq_lens[b].
        k_scale, v_scale: descales of e4m3 pages given as a pair (as in :func:`cuattn.decode`); a
            :class:`PagedKVCache` brings its own.

    Returns:
        ``out`` ``(B, Sq_new, Hq, Dv)``, or ``(out, lse)`` with lse ``(B, Hq, Sq_new)`` (natural log).
    """
    return _paged_attention(q, cache, block_table, seq_lens, max_seq_len, num_splits, causal, scale, window,
                            softcap, sinks, alibi_slopes, return_lse, check, k_scale, v_scale, planning=False)


def plan_paged_attention(q, cache, block_table, seq_lens, *, max_seq_len=None, num_splits=None, causal=True,
                         scale=None, window=(-1, -1), softcap=0.0, sinks=None, alibi_slopes=None, return_lse=False,
                         k_scale=None, v_scale=None):
    """Plan once, run many: a :class:`StepPlan` whose ``run()`` is one paged decode step.

    Takes the arguments of :func:`paged_attention`, with ``block_table`` and ``seq_lens`` as
    device arrays (CuPy or torch) that the serving loop rewrites in place each step: their
    contents are not read on the host (the kernel clamps lengths to the table's capacity and
    block ids to the pool, as with ``check=False``). ``max_seq_len`` bounds the lengths the split
    count plans for (default: the table's capacity). See :func:`cuattn.plan_decode` for ``run``.
    """
    return _paged_attention(q, cache, block_table, seq_lens, max_seq_len, num_splits, causal, scale, window,
                            softcap, sinks, alibi_slopes, return_lse, False, k_scale, v_scale, planning=True)


def _paged_attention(q, cache, block_table, seq_lens, max_seq_len, num_splits, causal, scale, window, softcap,
                     sinks, alibi_slopes, return_lse, check, k_scale, v_scale, *, planning: bool):
    left, right = _masks.check_options(window, softcap, scale, causal=causal, return_lse=return_lse, check=check)
    own_scales = {}  # a PagedKVCache's scales: its own arrays, on its own device
    if isinstance(cache, PagedKVCache):
        k_pages, v_pages = cache.k_pages, cache.v_pages
        _check_no_pair_scales(k_scale, v_scale)
        if cache.e4m3:
            k_scale, v_scale = cache.k_scale, cache.v_scale
            if cache.device == "cuda":
                own_scales = {"k_scale": k_scale, "v_scale": v_scale}
        # a GPU cache's CuPy pages (and scales) serve queries from any GPU framework
        named = {"q": q} if cache.device == "cuda" else {"q": q, "k_pages": k_pages, "v_pages": v_pages}
    else:
        k_pages, v_pages = _cache_pair(cache)
        named = {"q": q, "k_pages": k_pages, "v_pages": v_pages}
    scales = _decode.scale_arrays(k_scale, v_scale)
    if sinks is not None:
        named["sinks"] = sinks
    if alibi_slopes is not None:
        named["alibi_slopes"] = alibi_slopes
    named.update({name: x for name, x in scales.items() if name not in own_scales})
    call_key = None
    if not (check or planning):
        result, call_key = _calls.run(
            "paged_attention", (q, k_pages, v_pages, block_table, seq_lens, sinks, alibi_slopes, scales.get("k_scale"),
                                scales.get("v_scale")),
            (max_seq_len, num_splits, bool(causal), scale, left, right, softcap, bool(return_lse),
             _decode.scale_options(k_scale, v_scale)))
        if result is not None:
            return result
    with _arrays.array_context(**named) as ctx:
        if ctx.on_host and _arrays.array_kind(k_pages) != "numpy":
            raise TypeError("q is a NumPy array but the cache is on the GPU; pass device arrays, or build the "
                            "cache with device='cpu'")
        qv = ctx.view(q)
        kv, vv = (k_pages, v_pages) if "k_pages" not in named else (ctx.view(k_pages), ctx.view(v_pages))
        # host lists become int32 arrays; anything else not an array is named
        block_table, seq_lens = (_arrays.host_int32(name, x) for name, x in (("block_table", block_table),
                                                                              ("seq_lens", seq_lens)))
        table_host = _arrays.array_kind(block_table, "block_table") == "numpy"
        lens_host = _arrays.array_kind(seq_lens, "seq_lens") == "numpy"
        if planning and not ctx.on_host and (table_host or lens_host):
            raise TypeError("plan_paged_attention reads block_table and seq_lens on the device each run: pass device "
                            "arrays (CuPy or q's framework) that the loop updates in place")
        table = block_table if table_host else ctx.view(_same_kind("block_table", block_table, ctx))
        lens = seq_lens if lens_host else ctx.view(_same_kind("seq_lens", seq_lens, ctx))
        _decode.check_decode_args(qv, kv, vv, lens, "seq_lens", ("(num_blocks, block_size, Hk, D)", "block_size"))
        _arrays.check_ndim("block_table", table, "(B, max_blocks)")
        _arrays.check_axis("block_table", table, 0, "batch", int(qv.shape[0]), "q.shape[0]")
        _arrays.check_int32("block_table", table)
        _decode._check_num_splits(num_splits)
        num_blocks, block_size = int(kv.shape[0]), int(kv.shape[1])
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"k_pages.shape[1] (block_size) must be from 1 to {MAX_BLOCK_SIZE}, got {block_size}")
        capacity = int(table.shape[1]) * block_size
        _arrays.check_int("max_seq_len", max_seq_len, 1, optional=True)
        k_scale, v_scale = (x if name in own_scales else ctx.view(x) if _arrays.is_array(x) else x
                            for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
        e4m3, ks, vs = _decode.check_cache_scales(qv, kv, vv, k_scale, v_scale, ("k_pages", "v_pages"), ctx.on_host)
        sv = ctx.view(sinks)
        if sv is not None:
            _arrays.check_sinks(sv, int(qv.shape[2]), ctx.on_host, "q", qv)
        av = ctx.view(alibi_slopes)
        alibi_sb = _decode.check_alibi(av, qv, ctx.on_host)
        host_lens = None
        if check:
            host_table = table if table_host else table.get()
            host_lens = lens if lens_host else lens.get()
            check_table(host_table, host_lens, num_blocks, block_size)
        elif ctx.on_host:
            table, lens = clamp_table(table, lens, num_blocks, block_size)
        if ctx.on_host:
            _arrays.check_last_axes({"q": qv, "k_pages": kv, "v_pages": vv})
            if planning:
                raise TypeError("plan_paged_attention plans GPU launches and got NumPy arrays; call "
                                "cuattn.paged_attention for the CPU reference")
            _masks.check_total_length(int(qv.shape[1]), capacity, "q.shape[1] + the table's capacity "
                                                                  "(Sq_new + max_blocks x block_size)")
            if e4m3:
                kv, vv = _decode.dequantize(kv, ks), _decode.dequantize(vv, vs)
            result = reference.paged_attention(qv, kv, vv, table, lens, causal=causal, scale=scale,
                                               window=(left, right), softcap=softcap, return_lse=True, sinks=sv,
                                               alibi_slopes=av)
            return _decode._host_result(result, qv, return_lse)

        import cupy

        check_device_pages(qv, kv, vv)
        if max_seq_len is None and host_lens is not None:
            max_seq_len = int(host_lens.max(initial=1))  # checked: within the capacity
        # the kernel reads a table row and the lengths as contiguous int32
        table_d, table_copied = _decode.contiguous_rows("block_table", cupy.asarray(table, dtype=cupy.int32), planning)
        lens_d, lens_copied = _decode.contiguous_rows("seq_lens", cupy.asarray(lens, dtype=cupy.int32), planning)
        out, lse, step = _decode.decode_outputs(ctx, qv, vv, return_lse, planning)
        bound, workspace = _decode.launch_decode(
            qv, kv, vv, lens_d, out, lse, (table_d, block_size, num_blocks), capacity, num_splits=num_splits,
            causal=causal, scale=scale, window=(left, right), softcap=softcap,
            stream=ctx.stream, split_length=_decode.planned_length(max_seq_len, capacity), step=step, sinks=sv,
            e4m3=e4m3, k_scale=ks, v_scale=vs, alibi=(av, alibi_sb),
        )
        if step is not None:
            return step
        if not (check or table_host or lens_host or table_copied or lens_copied):
            # device tables read in place, unchecked: nothing of this call is read on the host, so it
            # can be replayed
            _calls.remember(call_key, _decode.decode_plan(("q", "k", "v", "table", "lens", "sinks", "alibi_slopes",
                                                           "k_scale", "v_scale"),
                                                          bound, workspace, out, lse))
        out = ctx.to_caller(out)
        return (out, ctx.to_caller(lse)) if return_lse else out


def _check_no_pair_scales(k_scale, v_scale) -> None:
    """A PagedKVCache brings its own scales: refuse the ones a (k_pages, v_pages) pair takes."""
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale and v_scale come with a PagedKVCache (its constructor's); pass them only "
                         "with a (k_pages, v_pages) pair")


def _cache_pair(cache):
    if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
        raise TypeError(f"cache must be a PagedKVCache or a (k_pages, v_pages) pair, got {type(cache).__name__}")
    return cache


def _same_kind(name: str, x, ctx):
    """``x`` (block_table or seq_lens, not NumPy) if it comes from q's framework."""
    kind = _arrays.array_kind(x)
    if kind != ctx.kind:
        if ctx.on_host:
            raise TypeError(f"{name} must be a NumPy array or a list, as q is a NumPy array; got a {kind} array")
        raise TypeError(f"{name} must be a NumPy array, a list or an array of q's framework ({ctx.kind}); "
                        f"got a {kind} array")
    return x


# The kernel offsets a row by page * page_stride + slot * slot_stride with 32-bit strides.
MAX_PAGE_STRIDE = 2**31 - 1


def check_device_pages(q, k, v) -> None:
    """What a paged kernel reads of device pages beyond their shapes and dtypes: the pages on q's
    device, laid out for the kernels (q too), page strides its 32-bit offsets hold."""
    for name, x in (("k_pages", k), ("v_pages", v)):
        _arrays.check_kernel_layout(name, x)
        _arrays.check_same_device(name, x, "q", q)
        _check_page_strides(name, _arrays.element_strides(x))
    _arrays.check_kernel_layout("q", q)


def _check_page_strides(name: str, strides) -> None:
    """Strides (elements) of a page and of a slot must fit in 32 bits (any pool laid out as
    (num_blocks, block_size, Hk, D) does: block_size * Hk * D is far below 2^31)."""
    for axis in (0, 1):
        if abs(int(strides[axis])) > MAX_PAGE_STRIDE:
            raise ValueError(f"{name}: the stride of axis {axis} is {int(strides[axis])} elements; paged_attention "
                             f"needs page and slot strides of at most {MAX_PAGE_STRIDE}")


def clamp_table(table, lens, num_blocks: int, block_size: int):
    """A host table and lengths as the kernels read them unchecked (``check=False``): lengths
    clamped to [0, the table's capacity], block ids into the pool (clamp_page)."""
    capacity = int(table.shape[1]) * block_size
    return (np.clip(table, 0, max(num_blocks - 1, 0)).astype(np.int32, copy=False),
            np.clip(lens, 0, capacity).astype(np.int32, copy=False))


def check_table(table, lens, num_blocks: int, block_size: int) -> None:
    """Every block a sequence uses must be in the pool; no length may pass its table row."""
    capacity = table.shape[1] * block_size
    if lens.size and (lens.min() < 0 or lens.max() > capacity):
        worst = int(np.argmax(np.abs(lens - np.clip(lens, 0, capacity))))
        if lens[worst] < 0:
            raise ValueError(f"seq_lens[{worst}] must be >= 0, got {int(lens[worst])}")
        raise ValueError(
            f"seq_lens[{worst}] = {int(lens[worst])} exceeds what block_table holds: block_table.shape[1] "
            f"(max_blocks) = {table.shape[1]} x block_size {block_size} = {capacity} tokens"
        )
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // block_size)
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])} is outside the pool of {num_blocks} blocks "
            f"(sequence {b} has {int(lens[b])} tokens)"
        )
