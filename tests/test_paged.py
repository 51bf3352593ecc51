"""Paged KV cache: the BlockManager against a model (hypothesis), the cache kernels, paged_attention.

The state machine drives random allocate / append / fork / free sequences and, after every
step, checks the invariants: refcounts equal the number of tables holding each block, no block
is both free and used, free + used is the pool, and no append writes into a block another
sequence still holds. It also keeps a simulated pool of token ids, applies the copy-on-write
copies and the writes as a cache would, and checks that every sequence reads back its own tokens.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cuattn
from cuattn import _arrays, _registry, reference
from cuattn.paged import PAGE_LAYOUTS
from conftest import BF16, DTYPE_IDS, DTYPES, DeviceInts, ForeignDtype, Tensor, check_decode, error_budget, import_jax, randn

NUM_BLOCKS, BLOCK_SIZE = 24, 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = cuattn.BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}  # model: seq id -> its token ids
        self.pool = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, np.int64)  # simulated cache: slot -> token id
        self.next_seq = 0
        self.next_token = 0

    def _new_tokens(self, n):
        ids = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return ids

    def _snapshot(self):
        m = self.manager
        return (m.refcount.tolist(), list(m._free), {k: list(v) for k, v in m._tables.items()}, dict(m._lengths))

    @rule(n=st.integers(0, 12))
    def allocate(self, n):
        seq = self.next_seq
        self.next_seq += 1
        before = self._snapshot()
        try:
            slots = self.manager.allocate(seq, n)
        except cuattn.OutOfBlocksError:
            assert self._snapshot() == before
            return
        ids = self._new_tokens(n)
        self.pool[slots] = ids
        self.tokens[seq] = ids

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        try:
            slots, copies = self.manager.append(seq, n)
        except cuattn.OutOfBlocksError:
            assert self._snapshot() == before
            return
        for src, dst in copies:  # run the copy-on-write first, as a cache would
            self.pool[dst * BLOCK_SIZE:(dst + 1) * BLOCK_SIZE] = self.pool[src * BLOCK_SIZE:(src + 1) * BLOCK_SIZE]
        # no write may land in a block another sequence still holds
        written_blocks = np.unique(slots // BLOCK_SIZE)
        assert (self.manager.refcount[written_blocks] == 1).all(), "append writes into a shared block"
        ids = self._new_tokens(n)
        self.pool[slots] = ids
        self.tokens[seq] = self.tokens[seq] + ids

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_seq
        self.next_seq += 1
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq)
        del self.tokens[seq]
        with pytest.raises(KeyError, match="not allocated"):
            self.manager.free(seq)

    @invariant()
    def refcounts_match_tables(self):
        counts = np.zeros(NUM_BLOCKS, np.int64)
        for seq in self.tokens:
            for block in self.manager.blocks(seq):
                counts[block] += 1
        assert np.array_equal(counts, self.manager.refcount)

    @invariant()
    def free_and_used_partition_the_pool(self):
        free = set(self.manager._free)
        assert len(free) == self.manager.num_free_blocks  # no block listed twice
        used = {b for seq in self.tokens for b in self.manager.blocks(seq)}
        assert not free & used
        assert len(free) + len(used) == NUM_BLOCKS

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not self.tokens:
            return
        seqs = sorted(self.tokens)
        table, lens = self.manager.block_table(seqs)
        for row, seq in enumerate(seqs):
            assert lens[row] == len(self.tokens[seq])
            t = np.arange(lens[row])
            slots = table[row, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
            assert self.pool[slots].tolist() == self.tokens[seq]


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PrefixCachingMachine(BlockManagerMachine):
    """The same model with prefix caching on: prompts share random prefixes over a tiny vocabulary
    (so equal blocks are common), a prompt's cached slots must already hold its tokens and are
    never written, and every sequence still reads back its own tokens."""

    PREFIXES = ([], [1, 2, 3, 0, 1, 2, 3, 0, 1], [3, 3, 1, 2, 0, 0, 2, 1, 3, 3, 1, 2, 0])

    def __init__(self):
        super().__init__()  # its fork and free rules and its refcount and read-back invariants serve here too
        self.manager = cuattn.BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.next_unknown = -2  # the contents of tokens appended without ids: unique negatives

    def _snapshot(self):
        m = self.manager
        return (m.refcount.tolist(), list(m._free), list(m._evictable), dict(m._block_of_hash),
                {k: list(v) for k, v in m._tables.items()}, dict(m._lengths))

    def _write(self, seq, slots, ids):
        written = np.unique(slots // BLOCK_SIZE)
        assert (self.manager.refcount[written] == 1).all(), "a write lands in a shared block"
        self.pool[slots] = ids

    @rule(prefix=st.integers(0, 2), suffix=st.lists(st.integers(0, 3), max_size=7))
    def allocate(self, prefix, suffix):
        prompt = list(self.PREFIXES[prefix]) + suffix
        seq = self.next_seq
        self.next_seq += 1
        before = self._snapshot()
        try:
            slots = self.manager.allocate(seq, len(prompt), token_ids=prompt)
        except cuattn.OutOfBlocksError:
            assert self._snapshot() == before
            return
        cached = self.manager.cached_tokens(seq)
        assert cached % BLOCK_SIZE == 0 and cached <= max(len(prompt) - 1, 0)
        # the cached prefix's KV is already in the pool: exactly this prompt's tokens
        assert self.pool[slots[:cached]].tolist() == prompt[:cached]
        self._write(seq, slots[cached:], prompt[cached:])
        self.tokens[seq] = prompt

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), ids=st.lists(st.integers(0, 3), min_size=1, max_size=6), known=st.booleans())
    def append(self, data, ids, known):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not known:
            ids = list(range(self.next_unknown, self.next_unknown - len(ids), -1))
            self.next_unknown -= len(ids)
        before = self._snapshot()
        try:
            slots, copies = self.manager.append(seq, len(ids), token_ids=ids if known else None)
        except cuattn.OutOfBlocksError:
            assert self._snapshot() == before
            return
        for src, dst in copies:
            self.pool[dst * BLOCK_SIZE:(dst + 1) * BLOCK_SIZE] = self.pool[src * BLOCK_SIZE:(src + 1) * BLOCK_SIZE]
        self._write(seq, slots, ids)
        self.tokens[seq] = self.tokens[seq] + ids

    @invariant()
    def free_and_used_partition_the_pool(self):  # the base's, with cached free blocks
        m = self.manager
        never_cached, evictable = set(m._free), set(m._evictable)
        assert len(never_cached) + len(evictable) == m.num_free_blocks and not never_cached & evictable
        used = {b for seq in self.tokens for b in m.blocks(seq)}
        assert not (never_cached | evictable) & used
        assert m.num_free_blocks + len(used) == NUM_BLOCKS
        # a free block is in the cache exactly when it waits for eviction
        assert all(b in m._hash_of_block for b in evictable) and not any(b in m._hash_of_block for b in never_cached)


TestPrefixCaching = PrefixCachingMachine.TestCase
TestPrefixCaching.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_prefix_caching_shares_whole_blocks_and_computes_the_last_token():
    m = cuattn.BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    m.allocate("a", 10, token_ids=prompt)
    assert m.cached_tokens("a") == 0 and m.num_cached_blocks == 2  # two full blocks of "a"
    slots = m.allocate("b", 11, token_ids=prompt[:9] + [77, 78])
    assert m.cached_tokens("b") == 8 and m.blocks("b")[:2] == m.blocks("a")[:2]
    assert m.refcount[m.blocks("a")[0]] == 2
    a_blocks = m.blocks("a")
    assert slots[:8].tolist() == [a_blocks[t // 4] * 4 + t % 4 for t in range(8)]  # a's own slots
    # the same 8-token prompt again: at most 7 tokens may come from the cache, so one block
    m.allocate("c", 8, token_ids=prompt[:8])
    assert m.cached_tokens("c") == 4
    # without token ids, or with caching off, nothing is shared
    m.allocate("d", 10)
    assert m.cached_tokens("d") == 0
    plain = cuattn.BlockManager(16, 4)
    plain.allocate("a", 10, token_ids=prompt)
    plain.allocate("b", 10, token_ids=prompt)
    assert plain.cached_tokens("b") == 0 and plain.num_cached_blocks == 0


def test_freed_cached_blocks_stay_free_and_are_evicted_least_recently_freed_first():
    m = cuattn.BlockManager(4, 2, enable_prefix_caching=True)
    m.allocate("a", 3, token_ids=[1, 2, 3])   # blocks: [1 2] cached, [3]
    m.allocate("b", 3, token_ids=[5, 6, 7])   # blocks: [5 6] cached, [7]
    a_first, b_first = m.blocks("a")[0], m.blocks("b")[0]
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 4 and m.num_cached_blocks == 2
    # two never-cached blocks go first; the third fresh block evicts "a"'s (freed before "b"'s)
    m.allocate("c", 6)
    assert a_first in m.blocks("c") and b_first not in m.blocks("c") and m.num_cached_blocks == 1
    m.free("c")
    m.allocate("d", 3, token_ids=[5, 6, 9])
    assert m.cached_tokens("d") == 2 and m.blocks("d")[0] == b_first


def test_a_freed_sequences_tail_blocks_are_evicted_before_its_prefix():
    """free() releases a sequence's blocks last to first, so eviction takes its tail before its
    head: a later prompt that shares only the first blocks still finds them cached."""
    m = cuattn.BlockManager(5, 2, enable_prefix_caching=True)
    m.allocate("a", 5, token_ids=[1, 2, 3, 4, 5])  # blocks: [1 2] and [3 4] cached, [5]
    first, second = m.blocks("a")[:2]
    m.free("a")
    assert m.num_free_blocks == 5 and m.num_cached_blocks == 2
    # three never-cached blocks go first; the fourth evicts "a"'s tail block, not its head
    m.allocate("c", 8)
    assert second in m.blocks("c") and first not in m.blocks("c") and m.num_cached_blocks == 1
    m.free("c")
    m.allocate("d", 3, token_ids=[1, 2, 9])
    assert m.cached_tokens("d") == 2 and m.blocks("d")[0] == first


def test_prefix_caching_errors_and_out_of_blocks_change_nothing():
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool, got 1"):
        cuattn.BlockManager(4, 2, enable_prefix_caching=1)
    m = cuattn.BlockManager(3, 2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"token_ids must be 3 integers \(one per token\), got 2 of int64"):
        m.allocate("a", 3, token_ids=np.array([1, 2], np.int64))
    with pytest.raises(ValueError, match=r"token_ids must be 2 integers \(one per token\), got 2 of float64"):
        m.allocate("a", 2, token_ids=[1.5, 2.0])
    # a framework's dtype NumPy cannot read is refused by name, before any copy
    with pytest.raises(ValueError, match=r"token_ids must be 2 integers \(one per token\), got 2 of float8_e5m2"):
        m.allocate("a", 2, token_ids=Tensor((2,), "float8_e5m2"))
    m.allocate("a", 4, token_ids=[1, 2, 3, 4])
    m.free("a")  # both blocks cached and free
    before = (m.refcount.tolist(), list(m._free), list(m._evictable), dict(m._block_of_hash))
    # sharing [1 2] takes one free cached block; the rest needs 3 more: 4 > 3 free
    with pytest.raises(cuattn.OutOfBlocksError, match=r"needs 4 free blocks, 3 of 3 are free"):
        m.allocate("b", 7, token_ids=[1, 2, 9, 9, 9, 9, 9])
    assert (m.refcount.tolist(), list(m._free), list(m._evictable), dict(m._block_of_hash)) == before
    assert "b" not in m
    with pytest.raises(KeyError, match=r"^seq_id = 'zz' is not an allocated sequence \(allocate it first, or was it "
                                       r"freed\?\)$"):
        m.cached_tokens("zz")


def test_block_manager_errors():
    m = cuattn.BlockManager(4, 2)
    m.allocate("a", 3)
    with pytest.raises(ValueError, match=r"sequence 'a' already exists"):
        m.allocate("a", 1)
    with pytest.raises(cuattn.OutOfBlocksError, match=r"cannot allocate 5 tokens for sequence 'b': needs 3 free blocks, 2 of 4 are free"):
        m.allocate("b", 5)
    assert "b" not in m and m.num_free_blocks == 2
    with pytest.raises(KeyError, match=r"seq_id = 'zzz' is not an allocated sequence"):
        m.append("zzz")
    with pytest.raises(ValueError, match=r"cannot fork onto sequence 'a': it already exists"):
        m.fork("a", "a")
    with pytest.raises(KeyError, match=r"parent = 'nope' is not an allocated sequence"):
        m.fork("nope", "c")
    with pytest.raises(KeyError, match=r"seq_ids\[1\] = 'nope' is not an allocated sequence"):
        m.block_table(["a", "nope"])
    with pytest.raises(ValueError, match=r"num_tokens must be an int >= 0, got -1"):
        m.append("a", -1)
    m.free("a")
    with pytest.raises(KeyError, match=r"cannot free sequence 'a': it is not allocated \(freed twice\?\)"):
        m.free("a")
    with pytest.raises(ValueError, match=r"block_size must be an int from 1 to 256, got 300"):
        cuattn.BlockManager(4, 300)
    with pytest.raises(ValueError, match=r"num_blocks must be an int >= 1, got 0"):
        cuattn.BlockManager(0, 16)
    with pytest.raises(TypeError, match=r"num_blocks must be an int >= 1, got True"):
        cuattn.BlockManager(True, 16)
    with pytest.raises(TypeError, match=r"block_size must be an int from 1 to 256, got True"):
        cuattn.BlockManager(4, True)
    with pytest.raises(TypeError, match=r"block_size must be an int from 1 to 256, got 4.0"):
        cuattn.BlockManager(4, 4.0)
    with pytest.raises(TypeError, match=r"num_blocks must be an int >= 1, got '4'"):
        cuattn.BlockManager("4", 16)
    with pytest.raises(TypeError, match=r"seq_ids must be an iterable of sequence ids \(a list, say\), got NoneType"):
        m.block_table(None)


@pytest.mark.parametrize("name, expected", [("float16", np.dtype(np.float16)), ("bfloat16", BF16),
                                            ("float32", np.dtype(np.float32))])
def test_cache_takes_torchs_dtypes(name, expected):
    """torch.float16 / torch.bfloat16 name a cache's dtype as NumPy's do (NumPy cannot read them:
    they were refused, only torch.float8_e4m3fn was taken)."""
    cache = cuattn.PagedKVCache(4, 4, 2, 16, ForeignDtype(name), device="cpu")
    assert cache.dtype == expected and cache.k_pages.dtype == expected


def test_device_arrays_of_pairs_and_token_ids_are_read_on_the_host():
    """copy_blocks' pairs, the block manager's token ids and a host write's slot ids are checked on
    the host: a device array of them is copied there (NumPy could not read one: CuPy refuses the
    implicit copy)."""
    cache = cuattn.PagedKVCache(4, 4, 2, 16, np.float32, device="cpu")
    cache.k_pages[1] = 1.0
    cache.copy_blocks(DeviceInts([[1, 3]]))
    assert (cache.k_pages[3] == 1.0).all() and not cache.k_pages[2].any()
    with pytest.raises(ValueError, match=r"pairs must be \(src, dst\) pairs, shape \(P, 2\), got shape \(3,\)"):
        cache.copy_blocks(DeviceInts([1, 2, 3]))
    # a write on the host reads device slot ids there, under the host rules
    cache = cuattn.PagedKVCache(4, 4, 2, 16, np.float32, device="cpu")
    cache.write(np.ones((2, 2, 16), np.float32), np.ones((2, 2, 16), np.float32), DeviceInts([0, 5]))
    assert cache.k_pages[0, 0].all() and cache.k_pages[1, 1].all() and cache.k_pages.sum() == 2 * 2 * 16
    with pytest.raises(ValueError, match=r"slot_ids must be 1-D \(N,\) with N = k.shape\[0\] = 2, got shape \(1,\)"):
        cache.write(np.ones((2, 2, 16), np.float32), np.ones((2, 2, 16), np.float32), DeviceInts([3]))
    with pytest.raises(ValueError, match=r"slot_ids must not repeat a slot"):
        cache.write(np.ones((2, 2, 16), np.float32), np.ones((2, 2, 16), np.float32), DeviceInts([3, 3]))
    m = cuattn.BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", 9, token_ids=DeviceInts(np.arange(9)))
    m.allocate("b", 9, token_ids=np.arange(9))
    # both full blocks before the last token's found by the ids' hashes
    assert m.blocks("b")[:2] == m.blocks("a")[:2] and m.blocks("b")[2] != m.blocks("a")[2]
    with pytest.raises(ValueError, match=r"token_ids must be 4 integers \(one per token\), got 3 of int64"):
        m.allocate("c", 4, token_ids=DeviceInts(np.arange(3, dtype=np.int64)))


def test_appending_no_tokens_and_writing_no_slots_do_nothing():
    """append(seq, 0) returns no slots and no copies (as allocate(seq, 0) does), even onto a
    shared partial block; an empty list of slot ids writes nothing."""
    m = cuattn.BlockManager(4, 4)
    m.allocate("a", 3)
    m.fork("a", "b")
    before = (m.refcount.tolist(), list(m._free), m.blocks("a"), m.seq_len("a"))
    slots, copies = m.append("a", 0)
    assert slots.dtype == np.int32 and slots.shape == (0,) and copies == []
    assert (m.refcount.tolist(), list(m._free), m.blocks("a"), m.seq_len("a")) == before
    cache = cuattn.PagedKVCache(4, 4, 2, 16, np.float32, device="cpu")
    cache.write(np.zeros((0, 2, 16), np.float32), np.zeros((0, 2, 16), np.float32), [])
    assert not cache.k_pages.any()


def test_append_slots_of_a_long_sequence_are_its_own():
    """The slots append returns are block x block_size + offset of the sequence's blocks at those
    positions (computed from the blocks written only), past many blocks and across a block edge."""
    m = cuattn.BlockManager(600, 4)
    m._free = list(np.random.default_rng().permutation(600))
    m.allocate("s", 2001)
    slots, _ = m.append("s", 6)  # tokens 2001 .. 2006: the rest of block 500 and into block 501
    blocks = m.blocks("s")
    want = [blocks[t // 4] * 4 + t % 4 for t in range(2001, 2007)]
    assert slots.tolist() == want


def test_sequence_ids_are_hashable_and_pools_int32():
    m = cuattn.BlockManager(4, 2)
    for call in (lambda: m.allocate(["a"], 1), lambda: m.free(["a"]), lambda: m.append({}), lambda: m.seq_len(["a"])):
        with pytest.raises(TypeError, match=r"seq_id must be hashable \(an int or a str, say\), got (list|dict)"):
            call()
    m.allocate("a", 1)
    with pytest.raises(TypeError, match=r"seq_id must be hashable"):
        m.fork("a", ["b"])
    with pytest.raises(ValueError, match=r"num_blocks x block_size must fit in int32 \(slot ids are int32\): 10{30} x 16 "):
        cuattn.BlockManager(10**30, 16)
    with pytest.raises(ValueError, match=r"num_blocks x block_size must fit in int32"):
        cuattn.PagedKVCache(2**31, 4, 2, 64, np.float16, device="cpu")
    # a pool whose last slot id is 2^31 - 1 fits; one block more does not (slots would wrap negative)
    assert cuattn.BlockManager(2**23, 256).num_blocks == 2**23
    with pytest.raises(ValueError, match=r"8388609 x 256 = 2147483904 slots, more than 2\^31"):
        cuattn.BlockManager(2**23 + 1, 256)


def test_host_tables_and_lengths_may_be_lists():
    rng = np.random.default_rng()
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    cache.write(*(rng.standard_normal((20, 2, 64)).astype(np.float32) for _ in range(2)), np.arange(20))
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    table, lens = np.array([[0, 1, 2], [3, 4, 0]], np.int32), np.array([9, 6], np.int32)
    expected = cuattn.paged_attention(q, cache, table, lens)
    np.testing.assert_array_equal(cuattn.paged_attention(q, cache, table.tolist(), lens.tolist()), expected)
    with pytest.raises(TypeError, match=r"seq_lens must be a NumPy, CuPy, torch or JAX array .*got None"):
        cuattn.paged_attention(q, cache, table, None)
    with pytest.raises(ValueError, match=r"block_table must hold int32 values \(in .*got 0 .. 4294967296"):
        cuattn.paged_attention(q, cache, [[0, 1, 2], [3, 4, 2**32]], lens)
    with pytest.raises(TypeError, match=r"slot_ids must be a NumPy, CuPy, torch or JAX array .*got None"):
        cache.write(np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32), None)


def test_an_unknown_sequence_is_a_key_error_and_a_value_error():
    """DESIGN's rule (a bad argument is a ValueError) and the class's (a lookup that fails is a KeyError) both hold."""
    m = cuattn.BlockManager(4, 2)
    for call in (lambda: m.free("x"), lambda: m.append("x"), lambda: m.fork("x", "y"), lambda: m.seq_len("x"),
                 lambda: m.block_table(["x"])):
        with pytest.raises(KeyError):
            call()
        with pytest.raises(ValueError, match=r"'x'(: it is| is) not (an )?allocated"):
            call()


def test_token_ids_past_int64_change_nothing():
    """The prefix cache hashes each id as an int64: larger ids are refused before anything moves,
    on allocate and on an append that would hash a full block."""
    m = cuattn.BlockManager(8, 2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"token_ids must fit in int64, got 1 .. 18446744073709551615"):
        m.allocate("a", 2, token_ids=np.array([1, 2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match=r"token_ids must fit in int64, got 1 .. 1180591620717411303424"):
        m.allocate("a", 2, token_ids=[1, 2**70])  # Python ints NumPy keeps as objects
    assert m.num_free_blocks == 8
    m.allocate("a", 2, token_ids=[1, 2])
    before = (m.seq_len("a"), m.num_free_blocks, m.blocks("a"))
    with pytest.raises(ValueError, match=r"token_ids must fit in int64, got 7 .. 9223372036854775808"):
        m.append("a", 3, token_ids=np.array([7, 7, 2**63], np.uint64))
    assert (m.seq_len("a"), m.num_free_blocks, m.blocks("a")) == before
    slots, _ = m.append("a", 2, token_ids=[3, 4])
    assert m.seq_len("a") == 4 and len(slots) == 2
    with pytest.raises(ValueError, match=r"token_ids must be 2 integers \(one per token\), got \[\[1\], 2\]"):
        m.allocate("b", 2, token_ids=[[1], 2])


def test_out_of_blocks_messages_count_in_english():
    m = cuattn.BlockManager(2, 2)
    m.allocate("a", 4)
    with pytest.raises(cuattn.OutOfBlocksError, match=r"cannot append 1 token to sequence 'a': needs 1 free block, 0 of 2 are free"):
        m.append("a")
    m.free("a")
    m.allocate("b", 2)
    with pytest.raises(cuattn.OutOfBlocksError, match=r"cannot allocate 3 tokens for sequence 'c': needs 2 free blocks, 1 of 2 is free"):
        m.allocate("c", 3)


def test_append_out_of_blocks_changes_nothing():
    m = cuattn.BlockManager(3, 2)
    m.allocate("a", 3)
    m.fork("a", "b")
    before = (m.refcount.copy(), m.num_free_blocks, m.blocks("b"), m.seq_len("b"))
    # b's last block is shared and partial: appending 3 needs a copy plus one more block (2 > 1 free)
    with pytest.raises(cuattn.OutOfBlocksError, match=r"needs 2 free blocks, 1 of 3 is free"):
        m.append("b", 3)
    assert (m.refcount.copy(), m.num_free_blocks, m.blocks("b"), m.seq_len("b"))[1:] == before[1:]
    assert np.array_equal(m.refcount, before[0])


def test_utilization_and_table_padding():
    m = cuattn.BlockManager(8, 4)
    m.allocate(0, 9)
    m.allocate(1, 1)
    table, lens = m.block_table([0, 1])
    assert table.dtype == np.int32 and lens.tolist() == [9, 1]
    assert table.shape == (2, 3) and (table[1, 1:] == -1).all()
    assert m.utilization() == 4 / 8


# ---------------------------------------------------------------------------------------------
# Pages and paged attention


def paged_setup(rng, dtype, lens, block_size, hk, d, device, num_blocks=None, fork=False):
    """A manager and cache holding random K/V for sequences of `lens`, blocks shuffled in the pool."""
    total = sum(-(-n // block_size) for n in lens) + 4
    num_blocks = num_blocks or total * 2
    manager = cuattn.BlockManager(num_blocks, block_size)
    manager._free = list(rng.permutation(num_blocks))  # physical order unrelated to token order
    cache = cuattn.PagedKVCache(num_blocks, block_size, hk, d, dtype, device=device)
    xp = np if device == "cpu" else __import__("cupy")
    for seq, n in enumerate(lens):
        if fork and seq > 0:
            # later sequences share sequence 0's prompt (written once), then diverge
            manager.fork(0, seq)
            slots, copies = manager.append(seq, n - manager.seq_len(seq)) if n > manager.seq_len(seq) else (np.zeros(0, np.int32), [])
            cache.copy_blocks(copies)
        else:
            slots = manager.allocate(seq, n)
        k = randn(rng, (len(slots), hk, d), dtype)
        v = randn(rng, (len(slots), hk, d), dtype)
        cache.write(xp.asarray(k), xp.asarray(v), slots)
    return manager, cache


def test_paged_attention_numpy_matches_reference(rng):
    lens = [5, 17, 1]
    manager, cache = paged_setup(rng, np.float32, lens, 4, 2, 64, "cpu")
    q = randn(rng, (3, 2, 8, 64), np.float32)
    table, seq_lens = manager.block_table(range(3))
    out, lse = cuattn.paged_attention(q, cache, table, seq_lens, return_lse=True)
    ref, ref_lse = reference.paged_attention(q, cache.k_pages, cache.v_pages, table, seq_lens, return_lse=True)
    np.testing.assert_array_equal(out, ref.astype(np.float32))
    np.testing.assert_array_equal(lse, ref_lse.astype(np.float32))


def unchecked_problem(rng, dtype):
    """A pair of pages and a table whose rows hold block ids outside the pool (negative and past
    it), one length past the table's capacity and one negative: what check=False lets through.
    Returns q, (k_pages, v_pages), the table and lengths, and the same clamped as the kernels
    clamp them (block ids into the pool, lengths into [0, capacity])."""
    num_blocks, block, hk, d = 9, 4, 2, 64
    table = rng.integers(0, num_blocks, (4, 5)).astype(np.int32)
    table[0, 1], table[1, 0], table[2, 4] = -7, num_blocks, num_blocks + 40
    lens = np.array([9, 30, 20, -3], np.int32)  # 30 > 5 x 4; -3 < 0
    pages = (randn(rng, (num_blocks, block, hk, d), dtype), randn(rng, (num_blocks, block, hk, d), dtype))
    q = randn(rng, (4, 2, 4, d), dtype)
    clamped_table = np.clip(table, 0, num_blocks - 1).astype(np.int32)
    clamped_lens = np.clip(lens, 0, table.shape[1] * block).astype(np.int32)
    return q, pages, table, lens, clamped_table, clamped_lens


def test_unchecked_tables_are_clamped_on_the_cpu_as_on_the_gpu(rng):
    """check=False skips the table check on the CPU path too, which then reads the table and the
    lengths clamped, as the kernels do; check=True refuses them."""
    q, pages, table, lens, clamped_table, clamped_lens = unchecked_problem(rng, np.float32)
    out, lse = cuattn.paged_attention(q, pages, table, lens, check=False, return_lse=True)
    want, want_lse = cuattn.paged_attention(q, pages, clamped_table, clamped_lens, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isneginf(lse[3]).all()  # the negative length reads no key
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 30 exceeds what block_table holds"):
        cuattn.paged_attention(q, pages, table, lens)
    cu = np.arange(0, 9, 2, dtype=np.int32)  # two queries a sequence
    packed = q.reshape(8, 4, 64)
    got = cuattn.paged_attention_varlen(packed, pages, table, cu, lens, 2, check=False)
    np.testing.assert_array_equal(got, cuattn.paged_attention_varlen(packed, pages, clamped_table, cu, clamped_lens, 2))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 30 exceeds what block_table holds"):
        cuattn.paged_attention_varlen(packed, pages, table, cu, lens, 2)


@pytest.mark.gpu
def test_unchecked_tables_are_clamped_on_the_gpu(rng):
    """The decode kernel reads an unchecked table's block ids and lengths clamped, as the CPU
    path does (within the 2x rule of the float64 reference over the clamped table)."""
    import cupy

    q, pages, table, lens, clamped_table, clamped_lens = unchecked_problem(rng, BF16)
    out, lse = cuattn.paged_attention(cupy.asarray(q), tuple(cupy.asarray(x) for x in pages), cupy.asarray(table),
                                      cupy.asarray(lens), check=False, return_lse=True)
    ref, ref_lse = reference.paged_attention(q, *pages, clamped_table, clamped_lens, return_lse=True)
    k_cache = reference.gather_pages(pages[0], clamped_table, clamped_lens)
    v_cache = reference.gather_pages(pages[1], clamped_table, clamped_lens)
    out = out.get().astype(np.float64)
    budgets = []
    for b in range(3):  # the sequences with keys
        n = int(clamped_lens[b])
        naive_b = reference.naive_attention_lowp(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], dtype=BF16,
                                                 causal=True)
        budgets.append(error_budget(np.abs(naive_b - ref[b:b + 1]).max(), BF16, 2.0, np.abs(ref[b]).max()))
        assert np.abs(out[b] - ref[b]).max() <= budgets[b], f"sequence {b} (seed {rng.seed})"
    assert (out[3] == 0).all() and np.isneginf(lse.get()[3]).all()
    np.testing.assert_allclose(lse.get()[:3], ref_lse[:3], rtol=1e-3, atol=2e-3)
    # paged_attention_varlen's decode runs (two queries a sequence) read the same clamped table
    cu = np.arange(0, 9, 2, dtype=np.int32)
    packed = q.reshape(8, 4, 64)
    got = cuattn.paged_attention_varlen(cupy.asarray(packed), tuple(cupy.asarray(x) for x in pages), cupy.asarray(table),
                                        cu, cupy.asarray(lens), 2, check=False)
    # the same problems as above, each sequence's two rows within its budget of the reference
    got = got.get().astype(np.float64).reshape(out.shape)
    for b in range(3):
        assert np.abs(got[b] - ref[b]).max() <= budgets[b], f"sequence {b} (seed {rng.seed})"
    assert (got[3] == 0).all()


def test_paged_attention_errors():
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    q = np.zeros((2, 1, 4, 64), np.float32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    lens = np.array([8, 5], np.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 exceeds what block_table holds: block_table.shape\[1\] "
                                         r"\(max_blocks\) = 2 x block_size 4 = 8 tokens"):
        cuattn.paged_attention(q, cache, table, np.array([9, 5], np.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be >= 0, got -2"):
        cuattn.paged_attention(q, cache, table, np.array([3, -2], np.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 8 is outside the pool of 8 blocks \(sequence 1 has 5 tokens\)"):
        cuattn.paged_attention(q, cache, np.array([[0, 1], [2, 8]], np.int32), lens)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1 is outside the pool"):
        cuattn.paged_attention(q, cache, np.array([[0, 1], [-1, 3]], np.int32), lens)
    # padding past a sequence's blocks is never read, so -1 there is fine
    cuattn.paged_attention(q, cache, np.array([[0, 1], [2, -1]], np.int32), np.array([8, 4], np.int32))
    with pytest.raises(TypeError, match=r"block_table.dtype must be int32, got int64"):
        cuattn.paged_attention(q, cache, table.astype(np.int64), lens)
    with pytest.raises(ValueError, match=r"block_table.shape\[0\] \(batch\) must equal q.shape\[0\] = 2, got 1"):
        cuattn.paged_attention(q, cache, table[:1], lens)
    with pytest.raises(TypeError, match=r"cache must be a PagedKVCache or a \(k_pages, v_pages\) pair, got int"):
        cuattn.paged_attention(q, 3, table, lens)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 32\) or be -1 \(padding\); got slot_ids\[0\] = 32"):
        cache.write(np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32), np.array([32]))
    with pytest.raises(ValueError, match=r"k.shape\[1\] \(Hk\) must equal the cache's num_kv_heads = 2, got 3"):
        cache.write(np.zeros((1, 3, 64), np.float32), np.zeros((1, 3, 64), np.float32), np.array([0]))
    with pytest.raises(ValueError, match=r"block ids in pairs must lie in \[0, num_blocks = 8\), got pairs\[0\] = \(0, 9\) "
                                         r"\(dst 9\)"):
        cache.copy_blocks([(0, 9)])
    with pytest.raises(ValueError, match=r"pairs: a destination block is never a source; pairs\[0\] = \(0, 1\) writes "
                                         r"block 1, which pairs\[1\] reads"):
        cache.copy_blocks([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match=r"pairs: a destination block is never a source; pairs\[1\] = \(2, 2\) writes "
                                         r"block 2, it reads too$"):
        cache.copy_blocks([(0, 1), (2, 2)])
    with pytest.raises(ValueError, match=r"pairs: each destination block may appear once; block 3 is the destination of "
                                         r"pairs\[1\] and pairs\[2\]"):
        cache.copy_blocks([(0, 2), (0, 3), (1, 3)])
    with pytest.raises(TypeError, match=r"pairs must be a list of \(src, dst\) block ids or an int array \(P, 2\), got "
                                        r"NoneType"):
        cache.copy_blocks(None)
    with pytest.raises(ValueError, match=r"head_dim = 84 is not supported: head_dim must be a multiple of 8 from 8 "
                                         r"to 256"):
        cuattn.PagedKVCache(8, 4, 2, 84, np.float16, device="cpu")


@pytest.mark.parametrize("check", [True, False])
def test_a_pool_of_no_blocks_is_refused(check):
    """A (k_pages, v_pages) pair needs a block, as PagedKVCache does: check=False clamps table entries into
    the pool, where a pool of none has no block to clamp to."""
    q = np.ones((1, 1, 2, 16), np.float32)
    pages = (np.zeros((0, 16, 2, 16), np.float32),) * 2
    table, lens = np.zeros((1, 1), np.int32), np.array([5], np.int32)
    message = r"^k_pages.shape\[0\] \(num_blocks\) must be at least 1, got 0$"
    with pytest.raises(ValueError, match=message):
        cuattn.paged_attention(q, pages, table, lens, check=check)
    with pytest.raises(ValueError, match=message):
        cuattn.paged_attention_varlen(q[0], pages, table, [0, 1], lens, 1, check=check)
    with pytest.raises(ValueError, match=message):
        cuattn.cascade_attention(q, (np.ones((4, 2, 16), np.float32),) * 2, pages, table, lens, check=check)


def test_paged_cache_and_argument_errors():
    with pytest.raises(ValueError, match=r"device must be 'cuda' or 'cpu', got 'tpu'"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.float16, device="tpu")
    with pytest.raises(TypeError, match=r"dtype is float32; the paged kernels take float16, bfloat16 or float8_e4m3fn"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.float32)
    with pytest.raises(ValueError, match=r"block_size must be an int from 1 to 256, got 0"):
        cuattn.PagedKVCache(8, 0, 2, 64, np.float16, device="cpu")
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    k = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"slot_ids must be 1-D \(N,\) with N = k.shape\[0\] = 2, got shape \(3,\)"):
        cache.write(k, k, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match=r"slot_ids.dtype must be an integer type, got float64"):
        cache.write(k, k, np.array([0.0, 1.0]))
    q = np.zeros((1, 1, 4, 64), np.float32)
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    with pytest.raises(ValueError, match=r"max_seq_len must be None or an int >= 1, got 0"):
        cuattn.paged_attention(q, cache, table, lens, max_seq_len=0)
    with pytest.raises(TypeError, match=r"max_seq_len must be None or an int >= 1, got True"):
        cuattn.paged_attention(q, cache, table, lens, max_seq_len=True)
    pages = np.zeros((4, 300, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"k_pages.shape\[1\] \(block_size\) must be from 1 to 256, got 300"):
        cuattn.paged_attention(q, (pages, pages), table, lens)


@pytest.mark.parametrize("jax_arg", ["block_table", "seq_lens"])
def test_a_jax_table_or_lengths_beside_numpy_q_is_refused(jax_arg):
    """block_table and seq_lens are NumPy arrays (or lists) on the CPU path: a JAX array is refused by its framework."""
    jnp = import_jax("jax.numpy")
    rng = np.random.default_rng()
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    q = randn(rng, (2, 1, 4, 64))
    ints = {"block_table": rng.permutation(8).astype(np.int32).reshape(2, 4),
            "seq_lens": rng.integers(0, 17, 2).astype(np.int32)}
    ints[jax_arg] = jnp.asarray(ints[jax_arg])
    with pytest.raises(TypeError, match=rf"^{jax_arg} must be a NumPy array or a list, as q is a NumPy array; "
                                        r"got a jax array$"):
        cuattn.paged_attention(q, cache, ints["block_table"], ints["seq_lens"])


def test_cpu_cache_enforces_the_device_caches_rules():
    with pytest.raises(TypeError, match=r"dtype is int32; a CPU cache takes float16, bfloat16, float32, float64 or "
                                        r"float8_e4m3fn"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.int32, device="cpu")
    # float kinds no kernel takes: e5m2 and long double are NumPy floats, refused all the same
    for dtype in ("float8_e5m2", np.longdouble):
        with pytest.raises(TypeError, match=r"a CPU cache takes float16, bfloat16, float32, float64 or float8_e4m3fn"):
            cuattn.PagedKVCache(8, 4, 2, 64, dtype, device="cpu")
    with pytest.raises(ValueError, match=r"num_kv_heads must be an int >= 1, got 0"):
        cuattn.PagedKVCache(8, 4, 0, 64, np.float32, device="cpu")
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    k32 = np.ones((3, 2, 64), np.float32)
    with pytest.raises(TypeError, match=r"k.dtype must equal the cache's dtype = float32, got float64"):
        cache.write(k32.astype(np.float64), k32, np.array([0, 1, 2]))
    with pytest.raises(TypeError, match=r"v.dtype must equal the cache's dtype = float32, got float16"):
        cache.write(k32, k32.astype(np.float16), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"slot_ids must not repeat a slot \(the writes run in parallel\); repeated: \[5\]"):
        cache.write(k32, k32, np.array([5, 1, 5]))
    assert not cache.k_pages.any(), "a refused write changed the cache"
    # -1 marks padding and may repeat
    cache.write(k32, k32, np.array([-1, 1, -1]))
    assert cache.k_pages[0, 1].all() and cache.k_pages.sum() == 2 * 64


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((8, 4, 2, 64, None), {}, TypeError, r"dtype must be a float dtype \(float16, bfloat16, float8_e4m3fn, ...\), got None"),
    ((8, 4, 2, 64, "float99"), {}, TypeError, r"dtype must be a float dtype \(float16, bfloat16, float8_e4m3fn, ...\), got "
                                               r"'float99'"),
    ((8, 4, 2, 64, "float8_e4m3fnuz"), {}, TypeError, r"dtype is float8_e4m3fnuz; a CPU cache takes float16, bfloat16, "
                                                               r"float32, float64 or float8_e4m3fn"),
    ((8, 4, 2, "64", np.float32), {}, TypeError, r"head_dim must be an int >= 0, got '64'"),
    ((8, True, 2, 64, np.float32), {}, TypeError, r"block_size must be an int from 1 to 256, got True"),
    ((8, 4, 2, 64, "float8_e4m3fn"), {"k_scale": "0.5"}, TypeError,
     r"k_scale must be a float or an array of shape \(\), \(1,\) or \(Hk,\) = \(2,\), got str"),
    ((8, 4, 2, 64, "float8_e4m3fn"), {"v_scale": None}, TypeError, r"v_scale must be a float or an array .*got NoneType"),
    # the scales are float32 on the pages' device: one that rounds to 0 or inf there is refused
    ((8, 4, 2, 64, "float8_e4m3fn"), {"k_scale": 1e-50}, ValueError,
     r"k_scale must be positive, finite and normal in float32 \(the kernels' type\), got 1e-50"),
    ((8, 4, 2, 64, "float8_e4m3fn"), {"k_scale": 1e-40}, ValueError,
     r"k_scale must be positive, finite and normal in float32 \(the kernels' type\), got 1e-40"),
    ((8, 4, 2, 64, "float8_e4m3fn"), {"v_scale": np.array([10.0, np.inf], np.float32)}, ValueError,
     r"v_scale must be positive, finite and normal .*got \[10.0, inf\]"),
    ((8, 4, 2, 64, "float8_e4m3fn"), {"v_scale": np.array([1.0, 2.0])}, TypeError,
     r"v_scale.dtype must be float32, got float64"),
])
def test_cache_constructor_errors(args, kwargs, error, message):
    import ml_dtypes

    if args[4] == "float8_e4m3fnuz":
        args = (*args[:4], ml_dtypes.float8_e4m3fnuz)
    with pytest.raises(error, match=message):
        cuattn.PagedKVCache(*args, device="cpu", **kwargs)


@pytest.mark.parametrize("pairs, error, message", [
    ([(0.5, 1.7)], TypeError, r"pairs must hold int32 values, got float64 values"),
    ([(0, 2**40)], ValueError, r"pairs must hold int32 values \(in \[-2147483648, 2147483647\]\), got 0 .. 1099511627776"),
    ([(0, 1, 2)], ValueError, r"pairs must be \(src, dst\) pairs, shape \(P, 2\), got shape \(1, 3\)"),
    (np.array([0, 1]), ValueError, r"pairs must be \(src, dst\) pairs, shape \(P, 2\), got shape \(2,\)"),
    (np.array([[0, 9]]), ValueError, r"block ids in pairs must lie in \[0, num_blocks = 8\), got pairs\[0\] = \(0, 9\) "
                                     r"\(dst 9\)"),
    # empty, but not an empty list of pairs
    (np.zeros((3, 0), np.int32), ValueError, r"pairs must be \(src, dst\) pairs, shape \(P, 2\), got shape \(3, 0\)"),
    (np.zeros((0, 5), np.int32), ValueError, r"pairs must be \(src, dst\) pairs, shape \(P, 2\), got shape \(0, 5\)"),
    (np.zeros((0, 2)), TypeError, r"pairs must hold block ids \(ints\), got float64 values"),
])
def test_copy_blocks_errors(pairs, error, message):
    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float32, device="cpu")
    cache.k_pages[0] = 1.0
    with pytest.raises(error, match=message):
        cache.copy_blocks(pairs)
    assert not cache.k_pages[1:].any(), "a refused copy changed the cache"
    cache.copy_blocks(np.array([[0, 1]], np.int32))
    np.testing.assert_array_equal(cache.k_pages[1], cache.k_pages[0])


def test_a_scale_of_a_dtype_numpy_lacks_is_refused_by_name():
    """A torch scale is checked before its copy to the host: float8_e5m2 (which NumPy cannot hold)
    failed there with torch's message, not the argument's."""
    with pytest.raises(TypeError, match=r"^k_scale.dtype must be float32, got float8_e5m2$"):
        cuattn.PagedKVCache(8, 4, 2, 64, "float8_e4m3fn", device="cpu", k_scale=Tensor((2,), "float8_e5m2"))
    with pytest.raises(TypeError, match=r"^v_scale.dtype must be float32, got float16$"):
        cuattn.PagedKVCache(8, 4, 2, 64, "float8_e4m3fn", device="cpu", v_scale=Tensor((2,), "float16"))


def test_duplicate_host_slot_ids_are_refused_on_the_device_path_too():
    """The rule is the same whichever device holds the cache (GPU: two writes to a slot race)."""
    pytest.importorskip("cupy")
    from conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is not None:
        pytest.skip(f"needs a GPU: {gpu_unavailable_reason()}")
    import cupy

    cache = cuattn.PagedKVCache(8, 4, 2, 64, np.float16)
    k = cupy.ones((2, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"slot_ids must not repeat a slot"):
        cache.write(k, k, np.array([3, 3]))
    with pytest.raises(TypeError, match=r"k.dtype must equal the cache's dtype = float16, got float32"):
        cache.write(k.astype(cupy.float32), k, np.array([3, 4]))


def test_cuda_cache_without_a_device_raises_one_line_with_the_cpu_path(monkeypatch):
    from cuattn import _jit

    reason = "no CUDA device was found (the NVIDIA driver reports none); " + _jit.CPU_PATH_HINT
    monkeypatch.setattr(_jit, "gpu_unavailable_reason", lambda: reason)
    with pytest.raises(cuattn.NoDeviceError) as info:
        cuattn.PagedKVCache(8, 4, 2, 64, np.float16, device="cuda")
    assert str(info.value) == reason and "\n" not in str(info.value)


def layout_pair(rng, dtype, device, shape=(6, 4, 3, 32, 16), tokens=10, **kwargs):
    """Two caches of the same random tokens, one per page layout, of ``shape`` (num_blocks,
    block_size, Hk, D, Dv): ``tokens`` tokens written at shuffled slots of all but the last two
    blocks (the fourth one padding), then those two blocks made copy-on-write copies of blocks 0
    and 2."""
    xp = np if device == "cpu" else __import__("cupy")
    num_blocks, block_size, hk, d, dv = shape
    caches = {layout: cuattn.PagedKVCache(num_blocks, block_size, hk, d, dtype, device=device, layout=layout,
                                          head_dim_v=dv, **kwargs)
              for layout in PAGE_LAYOUTS}
    source = np.float32 if str(dtype) == "float8_e4m3fn" else dtype
    k, v = randn(rng, (tokens, hk, d), source), randn(rng, (tokens, hk, dv), source)
    slots = rng.permutation((num_blocks - 2) * block_size)[:tokens].astype(np.int32)
    slots[3] = -1
    for cache in caches.values():
        cache.write(xp.asarray(k), xp.asarray(v), slots)
        cache.copy_blocks([(0, num_blocks - 1), (2, num_blocks - 2)])
    return caches


def page_bytes(pages):
    """A cache's pages on the host as raw bytes per element, in their (num_blocks, block_size, Hk, D) order."""
    host = pages if isinstance(pages, np.ndarray) else pages.get()
    return np.ascontiguousarray(host).view(np.uint8)


@pytest.mark.parametrize("dtype", [np.float32, "float8_e4m3fn"], ids=["fp32", "e4m3"])
def test_page_layouts_hold_the_same_pages(rng, dtype):
    """layout="HND" stores each kv head's tokens of a page in one run (a view of (num_blocks, Hk,
    block_size, D) storage), "NHD" whole tokens; writes, copies and attention see the same
    (num_blocks, block_size, Hk, D) pages either way. None takes HND for e4m3 caches only."""
    default = cuattn.PagedKVCache(6, 4, 3, 32, dtype, device="cpu")
    assert default.layout == ("HND" if dtype == "float8_e4m3fn" else "NHD")
    caches = layout_pair(rng, dtype, "cpu")
    for layout, cache in caches.items():
        assert cache.layout == layout
        assert cache.k_pages.shape == (6, 4, 3, 32) and cache.v_pages.shape == (6, 4, 3, 16)
        for pages in (cache.k_pages, cache.v_pages):
            # the axes from the largest stride to the smallest
            in_memory = tuple(int(a) for a in np.argsort(pages.strides)[::-1])
            assert in_memory == ((0, 1, 2, 3) if layout == "NHD" else (0, 2, 1, 3)), (layout, pages.strides)
    nhd, hnd = caches["NHD"], caches["HND"]
    for name in ("k_pages", "v_pages"):
        assert np.array_equal(page_bytes(getattr(nhd, name)), page_bytes(getattr(hnd, name))), name
    assert page_bytes(nhd.k_pages).any()
    q = randn(rng, (2, 1, 6, 32), np.float32)
    table, lens = np.array([[0, 1, 2], [3, 4, 5]], np.int32), np.array([9, 12], np.int32)
    np.testing.assert_array_equal(cuattn.paged_attention(q, nhd, table, lens), cuattn.paged_attention(q, hnd, table, lens))


@pytest.mark.parametrize("layout", ["hnd", "NDH", 1, b"HND"])
def test_an_unknown_page_layout_is_refused(layout):
    with pytest.raises(ValueError, match=r"^layout must be one of 'NHD', 'HND' or None \(the dtype's default\), got "
                                         + re.escape(repr(layout)) + "$"):
        cuattn.PagedKVCache(8, 4, 2, 64, np.float16, device="cpu", layout=layout)


def test_cpu_cache_write_skips_padding_and_copies_blocks(rng):
    cache = cuattn.PagedKVCache(4, 2, 1, 32, np.float32, device="cpu")
    k = randn(rng, (3, 1, 32), np.float32)
    cache.write(k, -k, np.array([5, -1, 0]))
    np.testing.assert_array_equal(cache.k_pages[2, 1], k[0])
    np.testing.assert_array_equal(cache.k_pages[0, 0], k[2])
    assert (cache.k_pages[0, 1] == 0).all()
    cache.copy_blocks([(2, 3)])
    np.testing.assert_array_equal(cache.v_pages[3], cache.v_pages[2])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cache_write_and_copy_kernels_match_numpy(rng, dtype, layout):
    import cupy

    gpu = cuattn.PagedKVCache(16, 5, 2, 128, dtype, layout=layout)
    cpu = cuattn.PagedKVCache(16, 5, 2, 128, dtype, device="cpu")
    k = randn(rng, (40, 2, 128), dtype)
    v = randn(rng, (40, 2, 128), dtype)
    slots = rng.permutation(80)[:40].astype(np.int32)
    slots[::7] = -1
    gpu.write(cupy.asarray(k), cupy.asarray(v), slots)
    cpu.write(k, v, slots)
    # copy-on-write pairs: fresh destinations, never another pair's source
    pairs = [(int(a), int(b)) for a, b in zip(rng.permutation(13)[:3], range(13, 16))]
    gpu.copy_blocks(pairs)
    cpu.copy_blocks(pairs)
    assert np.array_equal(gpu.k_pages.get(), cpu.k_pages) and np.array_equal(gpu.v_pages.get(), cpu.v_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, "float8_e4m3fn"], ids=["bf16", "e4m3"])
def test_attention_reads_either_page_layout_alike_on_the_gpu(rng, dtype):
    """Decode steps (one new token; three, split over the keys) and a paged prefill chunk (the
    Hopper forward's TMA boxes of 16-token pages, or decode runs over e4m3 pages) read HND pages as
    they read NHD ones: outputs equal bit for bit, and near the float64 reference."""
    import cupy

    scales = {"k_scale": 0.05, "v_scale": 0.04} if dtype == "float8_e4m3fn" else {}
    caches = layout_pair(rng, dtype, "cuda", shape=(48, 16, 2, 128, 128), tokens=700, **scales)
    table = np.arange(44, dtype=np.int32).reshape(2, 22)
    lens = np.array([345, 290], np.int32)
    q = cupy.asarray(randn(rng, (2, 3, 8, 128), BF16))
    q_packed = cupy.asarray(randn(rng, (41, 8, 128), BF16))
    cu = np.array([0, 40, 41], np.int32)
    calls = {
        "decode": lambda c: cuattn.paged_attention(q[:, :1], c, table, lens),
        "split decode": lambda c: cuattn.paged_attention(q, c, table, lens, num_splits=3),
        "prefill chunk": lambda c: cuattn.paged_attention_varlen(q_packed, c, table, cu, lens, 40),
    }
    nhd, hnd = caches["NHD"], caches["HND"]
    ref_k, ref_v = (reference.gather_pages(page_bytes_as_float(pages, dtype, scale), table, lens)
                    for pages, scale in ((nhd.k_pages, scales.get("k_scale", 1.0)),
                                         (nhd.v_pages, scales.get("v_scale", 1.0))))
    for name, call in calls.items():
        got = call(hnd)
        assert cupy.array_equal(got, call(nhd)), name
        if name == "decode":
            ref = reference.decode(q[:, :1].get().astype(np.float64), ref_k, ref_v, lens)
            assert np.abs(got.get().astype(np.float64) - ref).max() < 2e-2, f"seed {rng.seed}"


def page_bytes_as_float(pages, dtype, scale: float):
    """A cache's pages on the host as float64 values (e4m3 bytes times their scale)."""
    host = pages.get()
    if str(dtype) == "float8_e4m3fn":
        return host.view(_arrays.FLOAT8_E4M3).astype(np.float64) * scale
    return host.astype(np.float64)


def test_strided_copy_refuses_mismatched_views():
    from cuattn import paged

    a = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="one shape and dtype"):
        paged.prepare_copy(a, np.zeros((4, 9), np.float32))
    with pytest.raises(ValueError, match="one shape and dtype"):
        paged.prepare_copy(a, np.zeros((4, 8), np.float16))
    with pytest.raises(ValueError, match="1 to 5 axes, the last contiguous"):
        paged.prepare_copy(a[:, ::2], np.zeros((4, 4), np.float32))
    six = np.zeros((1,) * 6, np.float32)
    with pytest.raises(ValueError, match="1 to 5 axes"):
        paged.prepare_copy(six, six)

    class DeviceView:
        """What prepare_copy reads of a CuPy view: its layout and address."""

        def __init__(self, x, address):
            self.shape, self.dtype, self.strides, self.ndim = x.shape, x.dtype, x.strides, x.ndim
            self.itemsize, self.size = x.itemsize, x.size
            self.data = type("Pointer", (), {"ptr": address})()

    # fp16 rows of 3 elements (6 bytes) are no whole number of 32-bit words
    rows = np.zeros((4, 3), np.float16)
    with pytest.raises(ValueError, match="a strided copy moves whole 32-bit words; got rows of 6 bytes"):
        paged.prepare_copy(DeviceView(rows, 0x1000), DeviceView(rows, 0x2000))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, row", [(BF16, 128), (np.float32, 1), (np.float16, 12)],
                         ids=["bf16-vectors", "f32-words", "f16-odd"])
def test_strided_copy_kernel_matches_numpy(rng, dtype, row):
    """A repeated (stride 0), permuted and sliced source into a padded destination, copied by
    16-byte vectors where the rows, strides and addresses allow (bf16 rows of 128) and by 32-bit
    words otherwise (float32 scalars, fp16 rows of 24 bytes); the padding stays untouched."""
    import cupy

    from cuattn import paged

    src_host = randn(rng, (2, 3, 4, row), dtype)
    # [3 (a repeat), 3, 2, 2, row]: axes 1 and 2 swapped, axis 3 sliced
    src = cupy.broadcast_to(cupy.asarray(src_host).transpose(1, 0, 2, 3)[None], (3, 3, 2, 4, row))[:, :, :, 1:3]
    pad = 16 // np.dtype(dtype).itemsize  # a 16-byte offset keeps the rows' addresses 16-byte aligned
    full = cupy.full((3, 3, 2, 2, row + 2 * pad), np.nan, dtype)
    dst = full[..., pad:pad + row]
    launch = paged.prepare_copy(src, dst)
    assert launch.spec == paged.copy_spec(16 if row * np.dtype(dtype).itemsize % 16 == 0 else 4)
    launch.run(cupy.cuda.get_current_stream().ptr)
    got = cupy.asnumpy(full).astype(np.float32)
    expected = np.broadcast_to(src_host.transpose(1, 0, 2, 3)[None, :, :, 1:3], (3, 3, 2, 2, row))
    assert np.array_equal(got[..., pad:pad + row], expected.astype(np.float32))
    assert np.isnan(got[..., :pad]).all() and np.isnan(got[..., pad + row:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_tables_and_lengths_of_any_strides_are_read_by_value(rng, framework):
    """A column-major block table (np.concatenate over a broadcast makes one) and strided views of
    the lengths give what their values say: the plain calls copy them (bit for bit the result of
    contiguous copies, and the float64 reference); the step plans, which read them in place
    every run, refuse them and name the argument."""
    import cupy

    if framework == "torch":
        torch = pytest.importorskip("torch")
    batch, prefix_pages, hq, hk, d, block = 8, 56, 16, 4, 128, 16
    num_blocks = prefix_pages + batch
    k_pages, v_pages = (randn(rng, (num_blocks, block, hk, d), np.float16) for _ in range(2))
    q = randn(rng, (batch, 1, hq, d), np.float16)
    own = (prefix_pages + np.arange(batch, dtype=np.int32))[:, None]
    table = np.concatenate([np.broadcast_to(np.arange(prefix_pages, dtype=np.int32), (batch, prefix_pages)), own], 1)
    assert not table.flags.c_contiguous  # column-major: rows are strided
    lens = rng.integers(prefix_pages * block - 40, (prefix_pages + 1) * block + 1, batch).astype(np.int32)
    ref = reference.paged_attention(q, k_pages, v_pages, table, lens)

    def dev(x):
        x = cupy.asarray(x)  # keeps a column-major layout
        return torch.from_dlpack(x) if framework == "torch" else x

    strided_lens = dev(np.repeat(lens, 2))[::2]
    args = (dev(q), (dev(k_pages), dev(v_pages)))
    got = cuattn.paged_attention(*args, dev(table), strided_lens, check=False)
    again = cuattn.paged_attention(*args, dev(np.ascontiguousarray(table)), dev(lens), check=False)
    got, again = (_arrays.to_numpy(x) for x in (got, again))
    assert np.array_equal(got, again)
    assert np.abs(got.astype(np.float64) - ref).max() < 1e-2, f"seed {rng.seed}"
    with pytest.raises(ValueError, match=r"block_table must have a contiguous last axis \(stride 4 bytes\)"):
        cuattn.plan_paged_attention(*args, dev(table), dev(lens))
    with pytest.raises(ValueError, match="seq_lens must have a contiguous last axis"):
        cuattn.plan_paged_attention(*args, dev(np.ascontiguousarray(table)), strided_lens)
    # the contiguous decode's lengths too
    k_cache = reference.gather_pages(k_pages, table, lens).astype(np.float16)
    v_cache = reference.gather_pages(v_pages, table, lens).astype(np.float16)
    dense = _arrays.to_numpy(cuattn.decode(dev(q), dev(k_cache), dev(v_cache), strided_lens))
    assert np.array_equal(dense, _arrays.to_numpy(cuattn.decode(dev(q), dev(k_cache), dev(v_cache), dev(lens))))
    with pytest.raises(ValueError, match="cache_seqlens must have a contiguous last axis"):
        cuattn.plan_decode(dev(q), dev(k_cache), dev(v_cache), strided_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_cache_write_reads_strided_device_slot_ids_by_value(rng, framework):
    """Device slot ids as a strided view (every other entry of a longer vector) and copy pairs as a
    column-major array land where their values say, as on the CPU cache."""
    import cupy

    if framework == "torch":
        torch = pytest.importorskip("torch")
    gpu = cuattn.PagedKVCache(16, 5, 2, 64, BF16)
    cpu = cuattn.PagedKVCache(16, 5, 2, 64, BF16, device="cpu")
    k, v = randn(rng, (30, 2, 64), BF16), randn(rng, (30, 2, 64), BF16)
    slots = rng.permutation(60)[:30].astype(np.int32)
    doubled = cupy.asarray(np.repeat(slots, 2))
    strided = (torch.from_dlpack(doubled) if framework == "torch" else doubled)[::2]
    gpu.write(cupy.asarray(k), cupy.asarray(v), strided)
    cpu.write(k, v, slots)
    pairs = np.asfortranarray(np.array([[1, 12], [4, 13]], np.int32))
    gpu.copy_blocks(pairs)
    cpu.copy_blocks(pairs)
    assert np.array_equal(gpu.k_pages.get(), cpu.k_pages) and np.array_equal(gpu.v_pages.get(), cpu.v_pages)


# device slot ids of a wide integer type, some past int32 (and past the pool)
WIDE_SLOT_IDS = [("int64", [2**32 + 5, 7, -1, 2**40]), ("uint32", [2**31 + 3, 9, 2**32 - 1, 12]),
                 ("uint64", [2**63 + 5, 2**32 + 1, 20, 4])]


@pytest.mark.gpu
@pytest.mark.parametrize("framework, dtype, slots", [("cupy", *case) for case in WIDE_SLOT_IDS]
                         + [("torch", *WIDE_SLOT_IDS[0])], ids=lambda x: x if isinstance(x, str) else "")
def test_wide_device_slot_ids_are_read_at_their_width(rng, framework, dtype, slots):
    """int64 slot ids (serving engines' slot mappings) reach the kernel as they are, and ids past
    int32 are skipped as outside the pool, not wrapped into it (a cast to int32 made 2^32 + 5 slot 5)."""
    import cupy

    dev = (lambda x: x) if framework == "cupy" else pytest.importorskip("torch").from_dlpack
    gpu = cuattn.PagedKVCache(8, 4, 2, 64, BF16)
    cpu = cuattn.PagedKVCache(8, 4, 2, 64, BF16, device="cpu")
    k, v = randn(rng, (4, 2, 64), BF16), randn(rng, (4, 2, 64), BF16)
    gpu.write(cupy.asarray(k), cupy.asarray(v), dev(cupy.asarray(np.array(slots, dtype))))
    keep = [i for i, s in enumerate(slots) if 0 <= s < gpu.num_slots]
    cpu.write(k[keep], v[keep], np.array([slots[i] for i in keep], np.int32))
    assert np.array_equal(gpu.k_pages.get(), cpu.k_pages) and np.array_equal(gpu.v_pages.get(), cpu.v_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_device_slot_ids_of_the_wrong_shape_or_dtype_are_refused(framework):
    """The kernel reads slot_ids[n] for every token n: a shorter device array would be read past its
    end, and float ids were cast silently. Both are refused before launch (values unread)."""
    import cupy

    dev = (lambda x: x) if framework == "cupy" else pytest.importorskip("torch").from_dlpack
    cache = cuattn.PagedKVCache(4, 4, 2, 64, np.float16)
    k = cupy.zeros((3, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"slot_ids must be 1-D \(N,\) with N = k.shape\[0\] = 3, got shape \(2,\)"):
        cache.write(k, k, dev(cupy.arange(2, dtype=cupy.int32)))
    with pytest.raises(ValueError, match=r"slot_ids must be 1-D \(N,\) with N = k.shape\[0\] = 3, got shape \(3, 1\)"):
        cache.write(k, k, dev(cupy.arange(3, dtype=cupy.int32).reshape(3, 1)))
    with pytest.raises(TypeError, match=r"slot_ids.dtype must be an integer type, got float32"):
        cache.write(k, k, dev(cupy.arange(3, dtype=cupy.float32)))
    cache.write(k + 1, k + 1, dev(cupy.asarray([0, 5, 15], cupy.int64)))
    assert int(cache.k_pages.astype(cupy.float32).sum()) == 3 * 2 * 64


def check_paged_against_decode(rng, dtype, block_size, d, **options):
    import cupy

    lens = [700, 1, 0, 333, 1024]
    hq, hk = 8, 2
    manager, cache = paged_setup(rng, dtype, lens, block_size, hk, d, "cuda")
    q = randn(rng, (len(lens), 1, hq, d), dtype)
    table, seq_lens = manager.block_table(range(len(lens)))
    device_options = {**options, **{name: cupy.asarray(options[name]) for name in ("sinks", "alibi_slopes")
                                     if name in options}}
    out, lse = cuattn.paged_attention(cupy.asarray(q), cache, table, seq_lens, return_lse=True, **device_options)
    # the same cache gathered into contiguous rows, through the contiguous decode kernel
    k_cache = reference.gather_pages(cache.k_pages.get(), table, seq_lens).astype(dtype)
    v_cache = reference.gather_pages(cache.v_pages.get(), table, seq_lens).astype(dtype)
    dense, dense_lse = cuattn.decode(cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache),
                                     cupy.asarray(seq_lens), return_lse=True, **device_options)
    ref_options = {key: val for key, val in options.items() if key != "num_splits"}
    ref, ref_lse = reference.paged_attention(q, cache.k_pages.get(), cache.v_pages.get(), table, seq_lens,
                                             return_lse=True, **ref_options)
    got = out.get().astype(np.float64)
    naive_err = max(np.abs(reference.naive_attention_lowp(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                                                          causal=True, dtype=dtype, **ref_options)[0] - ref[b]).max(initial=0)
                    for b, n in enumerate(lens))
    assert np.abs(got - ref).max() <= error_budget(naive_err, dtype, 2.0, np.abs(ref).max()), f"seed {rng.seed}"
    assert np.abs(got - dense.get().astype(np.float64)).max() <= error_budget(naive_err, dtype, 2.0, 1.0)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse.get()), empty)
    np.testing.assert_allclose(lse.get()[~empty], ref_lse[~empty], rtol=1e-3, atol=2e-3)


# Each thread copies a run of consecutive rows (8 at D = 128, 4 at D = 64, 16 at D = 256) and
# looks its page up once per run: 16, 48 and 256 keep every run in one page; 12 and 100 make some
# runs cross into the next page; 1, 3 and 5 make runs cross several pages.
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 5, 12, 16, 48, 100, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention_matches_decode_and_reference(rng, dtype, block_size):
    check_paged_against_decode(rng, dtype, block_size, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [3, 12])
@pytest.mark.parametrize("d", _registry.test_head_dims("decode"))
def test_paged_attention_head_dims_with_runs_across_pages(rng, d, block_size):
    check_paged_against_decode(rng, BF16, block_size, d)


# A sliding window starts the visible keys anywhere; the kernel starts its first stage at the
# block below, so runs still begin at page boundaries.
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [12, 16])
@pytest.mark.parametrize("window", [(50, 0), (333, -1)])
def test_paged_attention_sliding_window(rng, block_size, window):
    check_paged_against_decode(rng, BF16, block_size, 128, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_alibi(rng, num_splits):
    """(Hq,) slopes: every sequence, through the paged kernel and the contiguous one alike."""
    slopes = (2.0 ** (-8.0 * np.arange(1, 9) / 8)).astype(np.float32)
    check_paged_against_decode(rng, BF16, 16, 128, alibi_slopes=slopes, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_sinks(rng, num_splits):
    sinks = (rng.standard_normal(8) * 2).astype(np.float32)
    check_paged_against_decode(rng, BF16, 16, 128, sinks=sinks, num_splits=num_splits)


@pytest.mark.gpu
def test_forked_sequences_share_a_prefix_written_once(rng):
    import cupy

    lens = [300, 310, 301, 500]
    manager, cache = paged_setup(rng, BF16, lens, 16, 2, 64, "cuda", fork=True)
    shared = set(manager.blocks(0)[:300 // 16])
    assert all(shared <= set(manager.blocks(s)) for s in range(1, 4)), "forks keep the full prompt blocks"
    q = randn(rng, (4, 3, 4, 64), BF16)
    table, seq_lens = manager.block_table(range(4))
    out = cuattn.paged_attention(cupy.asarray(q), cache, table, seq_lens, num_splits=4)
    # every sequence's pages gathered into contiguous rows: each row within its budget
    k_rows, v_rows = (reference.gather_pages(x.get(), table, seq_lens) for x in (cache.k_pages, cache.v_pages))
    check_decode(rng, BF16, q, k_rows, v_rows, seq_lens, out.get(), None)


@pytest.mark.gpu
def test_paged_attention_torch_query_and_unchecked_device_table(rng):
    torch = pytest.importorskip("torch")
    import cupy

    manager, cache = paged_setup(rng, np.float16, [90, 33], 8, 1, 64, "cuda")
    table, seq_lens = manager.block_table([0, 1])
    q = torch.randn(2, 2, 4, 64, device="cuda", dtype=torch.float16)
    out = cuattn.paged_attention(q, cache, torch.from_numpy(table).cuda(), torch.from_numpy(seq_lens).cuda(),
                                 check=False, max_seq_len=90)
    assert isinstance(out, torch.Tensor)
    ref = reference.paged_attention(q.cpu().numpy(), cache.k_pages.get(), cache.v_pages.get(), table, seq_lens)
    assert np.abs(out.cpu().numpy().astype(np.float64) - ref).max() < 5e-3
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 999 is outside the pool"):
        bad = table.copy()
        bad[0, 0] = 999
        cuattn.paged_attention(q, cache, torch.from_numpy(bad).cuda(), torch.from_numpy(seq_lens).cuda())
    assert cupy.isfinite(cache.k_pages).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["float16", "e4m3"])
def test_slot_offsets_past_2_31_elements_in_a_slot_major_pool(rng, kv):
    """Pages viewed from a slot-major allocation ((block_size, num_blocks, Hk, D), transposed): each
    stride fits in 32 bits, but from slot 8 the slot times the slot stride reaches 2^31 elements,
    which the kernel multiplies in 64 bits (a thread's run of rows starts at slot 0 or 8 in float16,
    at a multiple of 4 in e4m3: those starts are where the product is formed). The sequence's
    pages lie at both ends of the pool and between. 16 GiB of device memory in float16, 8 GiB in
    e4m3, given back at the end."""
    import cupy

    block, hq, hk, d = 16, 4, 1, 128
    num_blocks = 2**21
    slot_stride = num_blocks * hk * d
    assert 8 * slot_stride > 2**31 - 1 >= slot_stride
    pages = np.array([num_blocks - 1, 5, 1_300_001], np.int32)
    lens = np.array([len(pages) * block], np.int32)
    q = randn(rng, (1, 1, hq, d), np.float16)
    if kv == "e4m3":
        k8, v8 = (cuattn.quantize_fp8(randn(rng, (1, int(lens[0]), hk, d)), scale) for scale in (0.02, 0.03))
        stored, scales = (k8.view(np.uint8), v8.view(np.uint8)), {"k_scale": 0.02, "v_scale": 0.03}
        k, v = k8.astype(np.float64) * 0.02, v8.astype(np.float64) * 0.03
    else:
        k, v = (randn(rng, (1, int(lens[0]), hk, d), np.float16) for _ in range(2))
        stored, scales = (k, v), {}
    try:
        pool = []
        for x in stored:
            whole = cupy.empty((block, num_blocks, hk, d), x.dtype).transpose(1, 0, 2, 3)
            whole[cupy.asarray(pages)] = cupy.asarray(x.reshape(len(pages), block, hk, d))
            pool.append(whole)
        assert pool[0].strides[1] == slot_stride * x.itemsize
        out = cuattn.paged_attention(cupy.asarray(q), tuple(pool), cupy.asarray(pages[None]), cupy.asarray(lens),
                                     **scales)
        check_decode(rng, np.float16, q, k, v, lens, out.get(), None)
    finally:
        pool = whole = None
        cupy.get_default_memory_pool().free_all_blocks()


def test_page_strides_must_fit_32_bits():
    """The kernel multiplies 32-bit page and slot strides; a wider view is refused by name."""
    from cuattn import paged as paged_module

    paged_module._check_page_strides("k_pages", (2**31 - 1, 1024, 128, 1))
    with pytest.raises(ValueError, match=r"k_pages: the stride of axis 0 is 2147483648 elements; paged_attention needs"):
        paged_module._check_page_strides("k_pages", (2**31, 1024, 128, 1))
    with pytest.raises(ValueError, match=r"v_pages: the stride of axis 1 is 4294967296 elements"):
        paged_module._check_page_strides("v_pages", (1024, 2**32, 128, 1))
