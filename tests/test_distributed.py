"""Ring attention (cuattn.distributed): P ranks each holding a shard equal full attention.

CPU: P simulated ranks (LocalGroup threads over NumPy arrays, the float64 reference path) run the
same ring code as the GPUs; forward, lse and gradients after unsharding equal the full-sequence
reference. GPU: two processes, one per GPU, over NCCL (CuPy's communicator, and a
torch.distributed process group through cuattn.torch's autograd op), bf16, against the float64
reference under the 2x (forward) / 3x (gradients) rule. Fresh random inputs every run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from cuattn import distributed, reference
from cuattn.distributed import LocalGroup, ring_attention, ring_attention_backward, zigzag_shard, zigzag_unshard
from conftest import BF16, error_budget, randn

ROOT = pathlib.Path(__file__).resolve().parent.parent
# float64 inputs; the lse the public functions return is float32 (its rounding, ~1e-7 relative,
# bounds what merging and recomputing from it can reach)
CPU_TOLERANCE = 1e-5
# lengths of one zigzag chunk: odd and not a multiple of any tile
CHUNK = 17
# a two-GPU run (two processes, kernels compiled on first use) takes well under this
WORKER_TIMEOUT_S = 600
OPTIONS = {
    "gqa-softcap": dict(heads=(4, 2), options=dict(softcap=5.0)),
    "mha-scale": dict(heads=(3, 3), options=dict(scale=0.3)),
}


def _shard(x, rank, world_size, causal, axis=1):
    """Rank's shard: zigzag for causal, contiguous otherwise."""
    if causal:
        return zigzag_shard(x, rank, world_size, axis=axis)
    return np.split(x, world_size, axis=axis)[rank]


def _unshard(shards, causal, axis=1):
    return zigzag_unshard(shards, axis=axis) if causal else np.concatenate(shards, axis=axis)


def _close(name, got, ref, seed):
    err = np.abs(got.astype(np.float64) - ref).max()
    budget = CPU_TOLERANCE * max(1.0, np.abs(ref).max())
    assert err <= budget, f"{name}: error {err:.3g} > {budget:.3g} (seed {seed})"


@pytest.mark.parametrize("variant", list(OPTIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_equals_full_attention_on_simulated_ranks(rng, world_size, causal, variant):
    hq, hk = OPTIONS[variant]["heads"]
    options = dict(causal=causal, **OPTIONS[variant]["options"])
    b, d = 2, 32
    seqlen = 2 * world_size * CHUNK
    q = randn(rng, (b, seqlen, hq, d), np.float64)
    k, v = (randn(rng, (b, seqlen, hk, d), np.float64) for _ in range(2))
    dout = randn(rng, (b, seqlen, hq, d), np.float64)

    def rank_body(group):
        q_s, k_s, v_s, dout_s = (_shard(x, group.rank, world_size, causal) for x in (q, k, v, dout))
        out, lse = ring_attention(q_s, k_s, v_s, group, return_lse=True, **options)
        assert out.shape == q_s.shape and lse.shape == (b, hq, seqlen // world_size)
        assert out.dtype == np.float64 and lse.dtype == np.float32
        return (out, lse, *ring_attention_backward(dout_s, q_s, k_s, v_s, out, lse, group, **options))

    results = LocalGroup.run(world_size, rank_body)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **options)
    for i, (name, ref) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), (ref_out, ref_lse, *ref_grads))):
        got = _unshard([r[i] for r in results], causal, axis=2 if name == "lse" else 1)
        assert got.shape == ref.shape, name
        _close(name, got, ref, rng.seed)


def test_one_rank_is_plain_attention(rng):
    """P = 1: nothing travels, and the result is cuattn.attention's own."""
    import cuattn

    q, k, v = (randn(rng, (1, 2 * CHUNK, 2, 32), np.float64) for _ in range(3))
    out, lse = LocalGroup.run(1, lambda g: ring_attention(q, k, v, g, causal=True, return_lse=True))[0]
    want, want_lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_zigzag_shard_places_chunks_and_unshard_inverts_it(world_size, axis):
    shape = (2 * world_size * 3,) * 3
    positions = np.indices(shape)[axis % 3]  # each element holds its own index along `axis`
    chunk = shape[axis] // (2 * world_size)
    shards = [zigzag_shard(positions, r, world_size, axis=axis) for r in range(world_size)]
    for rank, shard in enumerate(shards):
        # the shard's sequence positions in order: chunk rank, then chunk 2P-1-rank
        got = np.moveaxis(shard, axis, 0).reshape(2 * chunk, -1)[:, 0]
        late = 2 * world_size - 1 - rank
        np.testing.assert_array_equal(got, np.r_[rank * chunk:(rank + 1) * chunk, late * chunk:(late + 1) * chunk])
    np.testing.assert_array_equal(zigzag_unshard(shards, axis=axis), positions)


def test_zigzag_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"x must be a NumPy, CuPy, torch or JAX array .*got None"):
        zigzag_shard(None, 0, 2)
    shards = [np.zeros((1, 4)), np.zeros((1, 4), np.float32)]
    with pytest.raises(TypeError, match=r"shards\[1\].dtype must equal shards\[0\].dtype = float64, got float32"):
        zigzag_unshard(shards)


def test_zigzag_layout_balances_causal_work():
    """Every rank sees the same number of visible (query, key) pairs under the causal mask."""
    world_size, chunk = 4, 5
    positions = np.arange(2 * world_size * chunk)
    visible = []
    for rank in range(world_size):
        mine = zigzag_shard(positions, rank, world_size, axis=0)
        visible.append(int(sum((positions <= i).sum() for i in mine)))
    assert len(set(visible)) == 1, visible


# ---------------------------------------------------------------------------------------------
# Errors: each names the argument, the axis, what was expected and what came


HEAD_DIM = 32


def _inputs(seqlen=4, dtype=np.float64, heads=(2, 2)):
    q = np.zeros((1, seqlen, heads[0], HEAD_DIM), dtype)
    kv = np.zeros((1, seqlen, heads[1], HEAD_DIM), dtype)
    return q, kv, kv.copy()


def _backward_with(group, dout=None, lse_len=4):
    """ring_attention_backward on zero inputs (seqlen 4, two heads), with a given dout or lse length."""
    q, k, v = _inputs()
    dout = q if dout is None else dout
    return ring_attention_backward(dout, q, k, v, q, np.zeros((1, 2, lse_len), np.float32), group)


@pytest.mark.parametrize("call, error, match", [
    (lambda: zigzag_shard(np.zeros((1, 10)), 0, 3), ValueError,
     r"x.shape\[1\] \(sequence\) = 10 must be a multiple of 2 \* world_size = 6"),
    (lambda: zigzag_shard(np.zeros((1, 8)), 2, 2), ValueError, r"rank must be in \[0, world_size = 2\), got 2"),
    (lambda: zigzag_shard(np.zeros((1, 8)), 0, 0), ValueError, r"world_size must be an int >= 1, got 0"),
    (lambda: zigzag_shard(np.zeros((1, 8)), 0, 2, axis=2), ValueError,
     r"axis must be in \[-2, 2\) for x of shape \(1, 8\), got 2"),
    (lambda: zigzag_unshard([np.zeros((1, 4)), np.zeros((1, 6))]), ValueError,
     r"shards\[1\].shape must equal shards\[0\].shape = \(1, 4\), got \(1, 6\)"),
    (lambda: zigzag_unshard([np.zeros((1, 3))] * 2), ValueError,
     r"shards\[0\].shape\[1\] \(S_local\) = 3 must be even"),
    (lambda: zigzag_unshard([]), TypeError, r"shards must be a non-empty list of arrays"),
])
def test_shard_helpers_refuse_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _run_each(world_size, body):
    return LocalGroup.run(world_size, body)


@pytest.mark.parametrize("body, error, match", [
    # zigzag shards are two equal chunks
    (lambda g: ring_attention(*_inputs(5), g, causal=True), ValueError,
     r"q.shape\[1\] \(S_local\) = 5 must be even with causal=True"),
    (lambda g: ring_attention(_inputs(4)[0], *_inputs(6)[1:], g), ValueError,
     r"k.shape\[1\] \(S_local\) must equal q.shape\[1\] = 4, got 6"),
    (lambda g: ring_attention(*_inputs(heads=(3, 2)), g), ValueError,
     r"q.shape\[2\] \(num_heads\) = 3 must be a multiple of k.shape\[2\] \(num_kv_heads\) = 2"),
    (lambda g: ring_attention(*_inputs(), object()), TypeError,
     r"group must be a cuattn.distributed.NcclGroup, a torch.distributed ProcessGroup or \(NumPy inputs\) a "
     r"cuattn.distributed.LocalGroup, got builtins.object"),
    (lambda g: ring_attention(*_inputs(), g, softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
    (lambda g: ring_attention(*_inputs()[:2], np.zeros((1, 4, 2, 2 * HEAD_DIM)), g), ValueError,
     rf"v.shape\[3\] \(head_dim_v\) must equal q.shape\[3\] \(head_dim\) = {HEAD_DIM} in ring attention, got "
     rf"{2 * HEAD_DIM}"),
    (lambda g: _backward_with(g, lse_len=5), ValueError,
     r"lse.shape must be \(1, 2, 4\) \(the forward's lse\), got \(1, 2, 5\)"),
    (lambda g: _backward_with(g, dout=np.zeros((1, 4, 2, 64))), ValueError,
     r"dout.shape must equal q.shape = \(1, 4, 2, 32\), got \(1, 4, 2, 64\)"),
    # shards that differ between ranks: every rank raises the same error instead of hanging
    (lambda g: ring_attention(*_inputs(4 + 2 * g.rank), g), ValueError,
     r"q.shape\[1\] \(S_local\) differs between ranks: rank 0 has 4, rank 1 has 6"),
    (lambda g: ring_attention(*_inputs(), g, causal=g.rank == 0), ValueError,
     r"causal differs between ranks: rank 0 has True, rank 1 has False"),
    (lambda g: ring_attention(*_inputs(dtype=(np.float64, np.float32)[g.rank]), g), ValueError,
     r"q.dtype differs between ranks: rank 0 has float64, rank 1 has float32"),
    (lambda g: ring_attention(*_inputs(), g, scale=(None, 0.5)[g.rank]), ValueError,
     r"scale differs between ranks: rank 0 has 0.17677669, rank 1 has 0.5"),
    (lambda g: ring_attention(*_inputs(), g, softcap=(0.0, 30.0)[g.rank]), ValueError,
     r"softcap differs between ranks: rank 0 has 0.0, rank 1 has 30.0"),
    # one rank's bad input stops its peers too (they raise PeerFailedError; the bad rank's error wins)
    (lambda g: ring_attention(*_inputs(4 + g.rank), g, causal=True), ValueError,
     r"q.shape\[1\] \(S_local\) = 5 must be even with causal=True"),
])
def test_ring_refuses_bad_input_on_every_rank(body, error, match):
    with pytest.raises(error, match=match):
        _run_each(2, body)


@pytest.mark.parametrize("peer_error", [distributed.PeerFailedError("stopped at an exchange"),
                                        distributed.PeerRefusedError("rank 1 of the ring refused its inputs")])
def test_local_run_raises_the_refusing_ranks_own_error(peer_error):
    """A rank stopped by its peer's bad input meets either error first, PeerFailedError (an exchange
    aborted under it) or PeerRefusedError (the handshake named the peer), by thread timing; either
    way LocalGroup.run raises the bad rank's own error, though the stopped rank comes first."""
    def body(group):
        if group.rank == 0:
            raise peer_error
        raise ValueError("rank 1's own error")

    with pytest.raises(ValueError, match="rank 1's own error"):
        LocalGroup.run(2, body)


def test_local_run_raises_a_peer_refusal_over_an_abort():
    def body(group):
        raise (distributed.PeerFailedError("aborted") if group.rank == 0 else
               distributed.PeerRefusedError("rank 0 of the ring refused its inputs"))

    with pytest.raises(distributed.PeerRefusedError, match="rank 0 of the ring refused"):
        LocalGroup.run(2, body)


def test_local_all_gather_is_kept_when_an_abort_lands_after_it():
    """Once every rank has passed the all-gather's first barrier the gather is whole. A rank that
    leaves right after it (a refusing rank raising its own error) aborts the barrier, and the abort
    can reach a peer still waking from the second wait: that peer keeps its gather (it raised
    PeerFailedError there, and a refusing rank's own error was lost that way)."""
    import threading

    class AbortLandsWhileWaking:
        """The hub's barrier, but rank 0's second wait breaks just after the barrier trips."""

        def __init__(self, barrier):
            self.barrier, self.waits = barrier, {}

        def wait(self, timeout=None):
            self.barrier.wait(timeout)
            name = threading.current_thread().name
            self.waits[name] = self.waits.get(name, 0) + 1
            if name == "rank0" and self.waits[name] == 2:
                raise threading.BrokenBarrierError

        def abort(self):
            self.barrier.abort()

    hub = distributed._Hub(2)
    hub.barrier = AbortLandsWhileWaking(hub.barrier)
    got = [None, None]

    def gather(rank):
        got[rank] = hub.all_gather(rank, np.array([rank, 10 + rank]))

    threads = [threading.Thread(target=gather, args=(rank,), name=f"rank{rank}") for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for rank in range(2):
        np.testing.assert_array_equal(got[rank], [[0, 10], [1, 11]])


def test_a_local_rank_that_receives_nothing_says_from_whom_after_the_timeout(monkeypatch):
    """Ranks whose calls do not match (here rank 2 never sends) end in an error, not a hang."""
    monkeypatch.setattr(distributed, "LOCAL_TIMEOUT_S", 0.01)
    group = LocalGroup.create(3)[0]
    x = np.random.default_rng().standard_normal(4)
    with pytest.raises(RuntimeError, match=r"^LocalGroup rank 0 received nothing from rank 2 in 0.01 s: the ranks' "
                                           r"calls do not match$"):
        group.send_recv((x,), (np.empty_like(x),))


def test_a_local_all_gather_that_not_every_rank_reaches_times_out_as_a_mismatch(monkeypatch):
    """No rank raised: the barrier's timeout is the ranks' mismatch, not a peer's failure, and the
    group's later all-gathers say the same."""
    monkeypatch.setattr(distributed, "LOCAL_TIMEOUT_S", 0.05)
    group = LocalGroup.create(2)[0]
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^LocalGroup rank 0 waited 0.05 s at an all-gather that not every "
                                               r"rank reached: the ranks' calls do not match$"):
            group.all_gather(np.arange(3))


@pytest.mark.parametrize("exchange", ["send_recv", "all_gather"])
def test_a_local_rank_waiting_at_an_exchange_stops_when_a_peer_raises(exchange):
    """LocalGroup.run aborts the ring when a rank raises: a rank waiting in send_recv or at the
    all-gather's barrier stops with PeerFailedError (and run raises the failing rank's own error)."""
    stopped = []

    def body(group):
        if group.rank == 0:
            raise ValueError("rank 0's own error")
        x = np.random.default_rng().standard_normal(4)
        with pytest.raises(distributed.PeerFailedError, match=r"^LocalGroup rank 1 stopped: another rank of the ring "
                                                              r"raised$"):
            group.send_recv((x,), (np.empty_like(x),)) if exchange == "send_recv" else group.all_gather(x)
        stopped.append(group.rank)

    with pytest.raises(ValueError, match=r"^rank 0's own error$"):
        LocalGroup.run(2, body)
    assert stopped == [1]


def test_a_rank_refused_before_its_ring_keeps_its_own_error_when_a_peer_is_gone():
    """A rank whose arrays are refused before the ring exists (a masked q) meets its peers in the
    handshake; when that fails because a peer raised, it raises its own refusal, not chained to
    the PeerFailedError it met."""
    rng = np.random.default_rng()
    q, k, v = (randn(rng, (1, 4, 2, HEAD_DIM), np.float64) for _ in range(3))

    def body(group):
        if group.rank == 1:
            raise RuntimeError("rank 1 is gone")
        ring_attention(np.ma.masked_array(q), k, v, group)

    with pytest.raises(TypeError, match=r"^q is a masked array; pass q.filled\(value\) or the data without a "
                                        r"mask$") as refused:
        LocalGroup.run(2, body)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_nccl_group_refuses_a_rank_outside_the_world_before_loading_nccl():
    with pytest.raises(ValueError, match=r"^rank must be in \[0, world_size = 2\), got 2$"):
        distributed.NcclGroup(2, 2, unique_id=(0,) * 128)


def test_nccl_group_without_nccl_names_the_wheel_to_install(monkeypatch):
    nccl = pytest.importorskip("cupy.cuda.nccl")
    monkeypatch.setattr(nccl, "available", False)
    with pytest.raises(ImportError, match=r"^cupy.cuda.nccl cannot load NCCL: install NVIDIA's NCCL wheel for your "
                                          r"CUDA \(pip install 'cuattn\[distributed-cuda13\]' or "
                                          r"'cuattn\[distributed-cuda12\]'\), or pass a torch.distributed process "
                                          r"group instead$"):
        distributed.NcclGroup.unique_id()


def test_ranks_agree_on_options_spelled_differently(rng):
    """The handshake compares the options the kernels use: scale=None on one rank and an explicit
    1/sqrt(D) on another, or softcap 0.0 and -0.0 (both: no cap), are one call (they were refused
    as different)."""
    q, k, v = (randn(rng, (1, 4 * CHUNK, 2, HEAD_DIM), np.float64) for _ in range(3))
    got = _run_each(2, lambda g: ring_attention(*(_shard(x, g.rank, 2, True) for x in (q, k, v)), g, causal=True,
                                                scale=(None, 1 / np.sqrt(HEAD_DIM))[g.rank],
                                                softcap=(0.0, -0.0)[g.rank]))
    _close("out", _unshard(got, True, axis=1), reference.attention(q, k, v, causal=True), rng.seed)


@pytest.mark.parametrize("call, bad", [(call, bad) for call in ("forward", "backward")
                                       for bad in ("odd-length", "missing-array", "strided-q", "float64-lse")
                                       if (call, bad) != ("forward", "float64-lse")])  # the forward takes no lse
def test_one_ranks_bad_input_raises_on_every_rank_without_an_abort(monkeypatch, call, bad):
    """Ranks that call on their own (no LocalGroup.run to abort the others): the rank whose shard is
    bad raises its own error, and its peer, which met it in the handshake, raises one naming it,
    rather than waiting in the ring until the timeout. So too for an argument refused before the
    ring exists (None for v or out: array_context's own check), and for what attention and
    attention_backward would refuse at the ring's first step (a q whose last axis is strided, a
    float64 lse): refused before the handshake, not in the ring."""
    import threading

    monkeypatch.setattr(distributed, "LOCAL_TIMEOUT_S", 20.0)
    groups = LocalGroup.create(2)
    errors = [None, None]
    own_error = {"odd-length": (ValueError, "must be even with causal=True"),
                 "missing-array": (TypeError, f"{'v' if call == 'forward' else 'out'} must be a NumPy, CuPy, torch "
                                              "or JAX array"),
                 "strided-q": (ValueError, "q must be contiguous in its last axis"),
                 "float64-lse": (TypeError, "lse.dtype must be float32")}[bad]

    def body(group):
        try:
            q, k, v = _inputs(4 + group.rank if bad == "odd-length" else 4)  # rank 1's S_local is odd
            bad_rank = group.rank == 1
            missing = bad == "missing-array" and bad_rank
            if bad == "strided-q" and bad_rank:
                q = np.asfortranarray(q)
            if call == "forward":
                ring_attention(q, k, None if missing else v, group, causal=True)
            else:
                out, lse = np.zeros_like(q), np.zeros((1, 2, q.shape[1]))
                lse_dtype = np.float64 if bad == "float64-lse" and bad_rank else np.float32
                distributed.ring_attention_backward(q, q, k, v, None if missing else out, lse.astype(lse_dtype),
                                                    group, causal=True)
        except Exception as error:  # noqa: BLE001 - each rank's error is the test's result
            errors[group.rank] = error

    threads = [threading.Thread(target=body, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting for its peer"
    assert isinstance(errors[1], own_error[0]) and own_error[1] in str(errors[1]), errors
    assert isinstance(errors[0], distributed.PeerRefusedError) and str(errors[0]).startswith(
        "rank 1 of the ring refused its inputs (its own error says why), so this rank stops too"), errors


def test_local_group_is_for_numpy_and_numpy_for_local_group():
    class FakeDeviceGroup(distributed.NcclGroup):
        def __init__(self):  # no communicator: the framework check comes first
            pass

    with pytest.raises(TypeError, match=r"q is a NumPy array, which runs on the CPU: use a "
                                        r"cuattn.distributed.LocalGroup \(one per simulated rank\), not a FakeDeviceGroup"):
        ring_attention(*_inputs(), FakeDeviceGroup())


# ---------------------------------------------------------------------------------------------
# Two GPUs: one process per GPU (tests/ring_worker.py), bf16, the 2x / 3x rule


def _two_gpus_or_skip():
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip(f"ring attention on GPUs needs 2 CUDA devices, found {count}")


def _group_available_or_skip(group_kind):
    if group_kind == "torch":
        pytest.importorskip("torch", reason="the torch.distributed group needs torch")
        return
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("cupy.cuda.nccl cannot load NCCL here (pip install nvidia-nccl-cu13 or nvidia-nccl-cu12, "
                    "matching CuPy's CUDA)")


def _spawn_ring(tmp_path, world_size, group_kind, causal):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off, as in the ring benchmark (BENCHMARKS.md)
    workers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "ring_worker.py"), str(tmp_path), str(rank),
                                 str(world_size), group_kind, str(int(causal))],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
               for rank in range(world_size)]
    try:
        logs = [w.communicate(timeout=WORKER_TIMEOUT_S)[0] for w in workers]
    finally:
        # a rank that failed leaves its peer blocked in NCCL: end both
        for w in workers:
            if w.poll() is None:
                w.kill()
    for rank, (worker, log) in enumerate(zip(workers, logs)):
        assert worker.returncode == 0, f"rank {rank} failed:\n{log}"
    return [np.load(tmp_path / f"rank{rank}.npz") for rank in range(world_size)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group_kind", ["nccl", "torch"])
def test_ring_on_two_gpus_matches_the_reference(rng, tmp_path, group_kind, causal):
    """bf16 over two GPUs: out within 2x and dq, dk, dv within 3x the straightforward bf16
    computation's error against the float64 reference (the rule single-GPU attention meets)."""
    _two_gpus_or_skip()
    _group_available_or_skip(group_kind)
    world_size, b, chunk, hq, hk, d = 2, 2, 113, 4, 2, 128
    seqlen = 2 * world_size * chunk
    options = dict(causal=causal, softcap=0.0)
    q = randn(rng, (b, seqlen, hq, d), BF16)
    k, v = (randn(rng, (b, seqlen, hk, d), BF16) for _ in range(2))
    dout = randn(rng, (b, seqlen, hq, d), BF16)
    for rank in range(world_size):
        np.savez(tmp_path / f"inputs{rank}.npz",
                 **{name: _shard(x, rank, world_size, causal).astype(np.float32)
                    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))})
    (tmp_path / "options.json").write_text(json.dumps(options))
    results = _spawn_ring(tmp_path, world_size, group_kind, causal)

    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    refs = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **options)
    naive_out = reference.naive_attention_lowp(q, k, v, dtype=BF16, **options)
    naive_grads = reference.naive_attention_backward_lowp(dout, q, k, v, dtype=BF16, **options)
    checks = [("out", ref_out, naive_out, 2.0)] + [(n, r, l, 3.0) for n, r, l in zip(("dq", "dk", "dv"), refs, naive_grads)]
    for name, ref, low, factor in checks:
        got = _unshard([r[name] for r in results], causal).astype(np.float64)
        assert np.isfinite(got).all(), f"{name}: NaN or inf (seed {rng.seed})"
        err = np.abs(got - ref).max()
        budget = error_budget(np.abs(low - ref).max(), BF16, factor, np.abs(ref).max())
        assert err <= budget, f"{group_kind} {name}: error {err:.3g} > budget {budget:.3g} (seed {rng.seed})"
    lse = _unshard([r["lse"] for r in results], causal, axis=2)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-3 * max(1.0, np.abs(ref_lse).max()))
