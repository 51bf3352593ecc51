"""Context parallelism: ring attention over P ranks, each holding one shard of the sequence.

Every rank holds its queries and its keys and values; the K/V blocks travel around the ring
(rank r sends to r + 1 and receives from r - 1), so after P steps each rank's queries have
seen every key. Each step computes attention of the local queries against the block held now
(``cuattn.attention`` with ``return_lse``) and merges it into a running ``(out, lse)``
with ``cuattn.merge_states``: softmax over disjoint key sets merges exactly by the lse.
On the GPU the next block is sent and received on the group's communication stream while the
current one is computed; CUDA events order the two streams and two receive buffers alternate.

The backward (the scheme of ring-flash-attn) takes the forward's global ``out`` and ``lse``:
with them ``cuattn.attention_backward`` of one block gives that block's exact share of the
gradients (delta = rowsum(dout * out) is the global one). dq sums locally; dk and dv
accumulators (float32 on the GPU) travel around the ring with K/V, each rank adding its
queries' share, and after P steps each accumulator is back at the rank that owns its K/V.

Layouts (rank r of P; any strides with a contiguous last axis, as ``cuattn.attention``):

    q (B, S_local, Hq, D)    k, v (B, S_local, Hk, D), Hq % Hk == 0    out like q
    lse (B, Hq, S_local) float32, natural log, over every key of every rank
    causal=False: contiguous shards, rank r holds tokens [r S_local, (r + 1) S_local)
    causal=True:  zigzag shards of 2P chunks of c = S_local / 2 tokens: rank r holds chunk r
                  then chunk 2P-1-r, so every rank does the same work (``zigzag_shard``)

Causal steps on rank r (chunk src of the sender below the diagonal, 2P-1-src above it):
step 0 is plain causal attention on the local shard (chunk r precedes chunk 2P-1-r, so the
concatenation's own causal mask is right); K/V from src < r: all local queries against the
first half (chunk src; chunk 2P-1-src is later than both local chunks), no mask; from src > r:
only the second local half (chunk 2P-1-r) against all of it (both of src's chunks precede it
and follow chunk r), no mask. Every step after the first is c x 2c scores, half a full block.

Groups: ``NcclGroup`` (NCCL through ``cupy.cuda.nccl``, from ``NcclGroup.unique_id()``), a
``torch.distributed`` process group passed as it is (NCCL P2P on zero-copy torch views), or
``LocalGroup`` (P threads of one process exchanging NumPy arrays: the same ring code on the
CPU's float64 reference path). Every call starts with a handshake (an all-gather of each rank's
shapes, dtype and options) so that a shard or option that differs between ranks raises the
same ValueError on every rank instead of hanging the ring. torch and CuPy are imported lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading

import numpy as np

from . import _arrays, _masks
from .attention import _check_bwd_args, _check_qkv, attention, attention_backward
from .decode import merge_states

# The handshake's fields, one int64 each: what every rank must agree on, named as the errors name them.
_HANDSHAKE_FIELDS = (
    "call (0 ring_attention, 1 ring_attention_backward)",
    "q.shape[0] (batch)", "q.shape[1] (S_local)", "q.shape[2] (num_heads)", "k.shape[2] (num_kv_heads)",
    "q.shape[3] (head_dim)", "q.dtype", "causal", "scale", "softcap",
)
# dtype <-> handshake code (a fixed table: numpy's type numbers can differ between processes)
_DTYPE_CODES = ("float16", "bfloat16", "float32", "float64")
# How long a LocalGroup rank waits for a peer before it reports the ring stuck (the CPU reference
# of a large shard takes minutes; a lost message should still end in an error, not a hang).
LOCAL_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------
# Zigzag layout


def _concat(parts, axis: int):
    """Concatenate arrays of one framework along ``axis``."""
    kind = _arrays.array_kind(parts[0])
    if kind == "numpy":
        return np.concatenate(parts, axis=axis)
    if kind == "torch":
        import torch

        return torch.cat(parts, dim=axis)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.concatenate(parts, axis=axis)
    import cupy

    return cupy.concatenate([cupy.from_dlpack(p) if kind == "dlpack" else p for p in parts], axis=axis)


def _check_axis_arg(name: str, x, axis) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be in [{-x.ndim}, {x.ndim}) for {name} of shape {tuple(x.shape)}, got {axis}")
    return axis % x.ndim


def _take(x, axis: int, start: int, stop: int):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def zigzag_shard(x, rank: int, world_size: int, axis: int = 1):
    """Rank ``rank``'s zigzag shard of the full sequence ``x``: its 2P equal chunks along
    ``axis``, chunk ``rank`` then chunk ``2P-1-rank``, concatenated (a new array of x's
    framework: NumPy, CuPy, torch or JAX). ``x.shape[axis]`` must be a multiple of 2P."""
    world_size = _arrays.check_int("world_size", world_size, 1)
    rank = _arrays.check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
    _arrays.common_kind({"x": x})
    axis = _check_axis_arg("x", x, axis)
    length, chunks = int(x.shape[axis]), 2 * world_size
    if length % chunks:
        raise ValueError(
            f"x.shape[{axis}] (sequence) = {length} must be a multiple of 2 * world_size = {chunks}: "
            "the zigzag layout cuts the sequence into 2P equal chunks"
        )
    chunk = length // chunks
    late = chunks - 1 - rank
    return _concat([_take(x, axis, rank * chunk, (rank + 1) * chunk), _take(x, axis, late * chunk, (late + 1) * chunk)],
                   axis)


def zigzag_unshard(shards, axis: int = 1):
    """The full sequence from every rank's zigzag shard (``shards[r]`` from rank r, all of one
    shape and framework): the inverse of :func:`zigzag_shard`."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of arrays (one per rank), got {type(shards).__name__}")
    _arrays.common_kind({f"shards[{i}]": s for i, s in enumerate(shards)})
    first = shards[0]
    axis = _check_axis_arg("shards[0]", first, axis)
    for i, shard in enumerate(shards):
        if tuple(shard.shape) != tuple(first.shape):
            raise ValueError(
                f"shards[{i}].shape must equal shards[0].shape = {tuple(first.shape)}, got {tuple(shard.shape)}: "
                "every rank's shard has one shape"
            )
        _arrays.check_same_dtype(f"shards[{i}]", shard, "shards[0]", first)
    local = int(first.shape[axis])
    if local % 2:
        raise ValueError(
            f"shards[0].shape[{axis}] (S_local) = {local} must be even: a zigzag shard is two equal chunks"
        )
    half = local // 2
    early = [_take(s, axis, 0, half) for s in shards]
    late = [_take(s, axis, half, local) for s in reversed(shards)]
    return _concat(early + late, axis)


# ---------------------------------------------------------------------------------------------
# Groups: rank, world_size, a communication stream, send_recv to the next rank / from the previous
# one, and a small all-gather for the handshake


class LocalGroup:
    """One rank of P simulated in threads of this process, exchanging NumPy arrays through queues:
    the ring code runs unchanged on the CPU (NumPy inputs run the float64 reference).

        results = LocalGroup.run(4, lambda group: ring_attention(q[group.rank], ..., group))

    ``LocalGroup.create(P)`` gives the P handles for threads you start yourself.
    """

    stream = None

    def __init__(self, rank: int, world_size: int, hub: "_Hub"):
        self.rank, self.world_size, self._hub = rank, world_size, hub

    @classmethod
    def create(cls, world_size: int) -> list["LocalGroup"]:
        world_size = _arrays.check_int("world_size", world_size, 1)
        hub = _Hub(world_size)
        return [cls(rank, world_size, hub) for rank in range(world_size)]

    @classmethod
    def run(cls, world_size: int, fn) -> list:
        """``fn(group)`` on P threads, one per rank; returns their results in rank order. If a
        rank raises, the others stop at their next exchange, and the first rank's own error is
        raised: a rank stopped by another's (PeerFailedError, PeerRefusedError) gives way to it,
        whichever of the two its thread met first."""
        groups = cls.create(world_size)
        results, errors = [None] * len(groups), [None] * len(groups)

        def body(group):
            try:
                results[group.rank] = fn(group)
            except BaseException as error:  # noqa: B036 - handed to the caller's thread below
                errors[group.rank] = error
                group._hub.abort()

        threads = [threading.Thread(target=body, args=(g,), name=f"cuattn-rank{g.rank}") for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # a rank's own error first, then a peer's refusal as a rank saw it, then any
        for stopped_by_peer in ((PeerFailedError, PeerRefusedError), PeerFailedError, ()):
            first = next((e for e in errors if e is not None and not isinstance(e, stopped_by_peer)), None)
            if first is not None:
                raise first
        return results

    def send_recv(self, send, recv) -> None:
        """Send copies of ``send`` to rank + 1 and fill ``recv`` with what rank - 1 sent."""
        self._hub.put((self.rank + 1) % self.world_size, tuple(np.array(x, copy=True) for x in send))
        for target, got in zip(recv, self._hub.get(self.rank)):
            target[...] = got

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return self._hub.all_gather(self.rank, values)


class PeerFailedError(RuntimeError):
    """A LocalGroup rank stopped because another rank of its ring raised."""


class PeerRefusedError(ValueError):
    """This rank's inputs were fine, but another rank of the ring refused its own at the handshake
    (that rank raises the error that says why)."""


class _Hub:
    """What a LocalGroup's ranks share: one inbox per rank and a barrier for the all-gather."""

    _ABORT = object()

    def __init__(self, world_size: int):
        self.inboxes = [queue.Queue() for _ in range(world_size)]
        self.barrier = threading.Barrier(world_size)
        self.slots = [None] * world_size
        self.aborted = False  # a rank raised (abort): what a broken barrier means, or a timeout

    def put(self, rank: int, item) -> None:
        self.inboxes[rank].put(item)

    def get(self, rank: int):
        try:
            item = self.inboxes[rank].get(timeout=LOCAL_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"LocalGroup rank {rank} received nothing from rank {(rank - 1) % len(self.inboxes)} in "
                               f"{LOCAL_TIMEOUT_S:.3g} s: the ranks' calls do not match") from None
        if item is self._ABORT:
            raise PeerFailedError(f"LocalGroup rank {rank} stopped: another rank of the ring raised")
        return item

    def all_gather(self, rank: int, values: np.ndarray) -> np.ndarray:
        self.slots[rank] = np.array(values, copy=True)
        try:
            self.barrier.wait(LOCAL_TIMEOUT_S)
        except threading.BrokenBarrierError:
            if self.aborted:
                raise PeerFailedError(f"LocalGroup rank {rank} stopped: another rank of the ring raised") from None
            # the wait timed out (here or at an earlier all-gather of the group, which breaks the
            # barrier for good): not every rank came
            raise RuntimeError(f"LocalGroup rank {rank} waited {LOCAL_TIMEOUT_S:.3g} s at an all-gather that not every "
                               "rank reached: the ranks' calls do not match") from None
        gathered = np.stack(self.slots)
        try:
            # nobody writes its slot for the next all-gather before every rank has read this one
            self.barrier.wait(LOCAL_TIMEOUT_S)
        except threading.BrokenBarrierError:
            # Every slot was written (the first wait passed), so the gather is whole. A rank that
            # left after it (the handshake's refusal) aborts the barrier, which can catch this
            # rank still waking from the second wait: the rank keeps its gather (a refusing rank
            # then raises its own error, not PeerFailedError) and its next exchange stops it.
            pass
        return gathered

    def abort(self) -> None:
        self.aborted = True
        self.barrier.abort()
        for inbox in self.inboxes:
            inbox.put(self._ABORT)


# A stream priority above every device's range: CUDA (and torch) clamp it to the device's highest.
HIGHEST_STREAM_PRIORITY = -(2**16)


def _highest_stream_priority() -> int:
    """The transfers' stream priority: the device's highest (CUDA clamps HIGHEST_STREAM_PRIORITY
    into its range). With it the block scheduler gives NCCL's kernels an SM as soon as one frees,
    instead of after every CTA of the attention kernel queued before them has started: otherwise
    the transfers mostly run after the compute they were meant to hide behind."""
    return HIGHEST_STREAM_PRIORITY


def _communicator(nccl, world_size: int, unique_id, rank: int):
    """A NcclCommunicator from a unique id given as bytes or ints: CuPy 14 takes the id's 128 bytes,
    earlier CuPy a tuple of (signed char) ints."""
    raw = bytes(int(x) & 0xFF for x in unique_id)
    try:
        return nccl.NcclCommunicator(world_size, raw, rank)
    except TypeError:
        return nccl.NcclCommunicator(world_size, tuple(int(x) for x in unique_id), rank)


class NcclGroup:
    """One rank of a NCCL communicator (``cupy.cuda.nccl``) on the current CUDA device.

        uid = NcclGroup.unique_id()            # on one process; hand it to every rank
        group = NcclGroup(rank, world_size, uid)

    NCCL comes from NVIDIA's wheel (``pip install 'cuattn[distributed-cuda13]'``, or
    ``distributed-cuda12``). The group owns a non-blocking stream of the highest priority for
    its transfers.
    """

    def __init__(self, rank: int, world_size: int, unique_id, *, device: int | None = None):
        world_size = _arrays.check_int("world_size", world_size, 1)
        rank = _arrays.check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
        import cupy

        nccl = _nccl()
        self.rank, self.world_size = rank, world_size
        self.device = int(cupy.cuda.Device().id if device is None else device)
        with cupy.cuda.Device(self.device):
            self._comm = _communicator(nccl, world_size, unique_id, rank)
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=_highest_stream_priority())

    @staticmethod
    def unique_id() -> tuple:
        """A new NCCL unique id (a tuple of ints, picklable and JSON-able): create it once, give it
        to every rank."""
        return tuple(int(x) for x in _nccl().get_unique_id())

    def send_recv(self, send, recv) -> None:
        nccl = _nccl()
        after, before = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        # one NCCL group: the sends and receives proceed together, so no pair of ranks deadlocks
        nccl.groupStart()
        for x in send:
            self._comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, after, self.stream.ptr)
        for x in recv:
            self._comm.recv(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, before, self.stream.ptr)
        nccl.groupEnd()

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        import cupy

        nccl = _nccl()
        # everything on the group's own stream: the host then waits for the handshake only, not
        # for the caller's work queued on the compute stream
        with cupy.cuda.Device(self.device), self.stream:
            mine = cupy.asarray(values, dtype=np.int64)
            every = cupy.empty((self.world_size, mine.size), np.int64)
            self._comm.allGather(mine.data.ptr, every.data.ptr, mine.size, nccl.NCCL_INT64, self.stream.ptr)
            self.stream.synchronize()
            return every.get()


def _nccl():
    from cupy.cuda import nccl

    if not nccl.available:
        raise ImportError(
            "cupy.cuda.nccl cannot load NCCL: install NVIDIA's NCCL wheel for your CUDA "
            "(pip install 'cuattn[distributed-cuda13]' or 'cuattn[distributed-cuda12]'), "
            "or pass a torch.distributed process group instead"
        )
    return nccl


class _TorchGroup:
    """A torch.distributed process group (NCCL backend) behind the same interface: transfers
    are batched isend/irecv on a torch stream that CuPy sees as ``stream``."""

    def __init__(self, process_group, device: int):
        import torch
        import torch.distributed as dist

        self._group, self._dist = process_group, dist
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self._next = dist.get_global_rank(process_group, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(process_group, (self.rank - 1) % self.world_size)
        self.device = device
        # NCCL runs on the process group's own streams (high priority when the group was made with
        # ProcessGroupNCCL.Options(is_high_priority_stream=True)); this stream waits for them
        self._torch_stream = torch.cuda.Stream(device=device, priority=_highest_stream_priority())
        self.stream = _arrays.external_stream(self._torch_stream.cuda_stream, device)

    def send_recv(self, send, recv) -> None:
        import torch

        dist = self._dist
        with torch.cuda.stream(self._torch_stream):
            ops = ([dist.P2POp(dist.isend, torch.from_dlpack(x), self._next, self._group) for x in send]
                   + [dist.P2POp(dist.irecv, torch.from_dlpack(x), self._prev, self._group) for x in recv])
            # wait() on a NCCL request orders the current (communication) stream after it; the host goes on
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        import torch

        with torch.cuda.stream(self._torch_stream):
            mine = torch.as_tensor(np.asarray(values, dtype=np.int64), device=f"cuda:{self.device}")
            every = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device=mine.device)
            self._dist.all_gather_into_tensor(every, mine, group=self._group)
            return every.cpu().numpy().reshape(self.world_size, -1)


_TORCH_GROUPS: dict = {}  # (id(process group), device) -> (process group, its _TorchGroup)


def _is_torch_group(group) -> bool:
    return type(group).__module__.split(".")[0] == "torch" and "ProcessGroup" in type(group).__name__


def _as_group(group, kind: str, q):
    """The group interface for a call on arrays of framework ``kind`` ("numpy", "cupy", "torch",
    ...), after checking that the group fits that framework and q's device."""
    on_host = kind == "numpy"
    if isinstance(group, LocalGroup):
        if not on_host:
            raise TypeError(f"group is a LocalGroup, which exchanges NumPy arrays between threads, but q is a "
                            f"{kind} array: on GPUs use cuattn.distributed.NcclGroup or a torch.distributed "
                            "process group")
        return group
    if not isinstance(group, NcclGroup) and not _is_torch_group(group):
        raise TypeError(f"group must be a cuattn.distributed.NcclGroup, a torch.distributed ProcessGroup or (NumPy "
                        f"inputs) a cuattn.distributed.LocalGroup, got {type(group).__module__}.{type(group).__name__}")
    if on_host:
        raise TypeError(f"q is a NumPy array, which runs on the CPU: use a cuattn.distributed.LocalGroup (one per "
                        f"simulated rank), not a {type(group).__name__}")
    device = _arrays._device_of(q)
    if isinstance(group, NcclGroup):
        if group.device != device:
            raise ValueError(f"q is on device {device} but the NcclGroup's communicator is on device "
                             f"{group.device}; every array of a rank must be on its group's GPU")
        return group
    key = (id(group), device)
    if key not in _TORCH_GROUPS:
        _TORCH_GROUPS[key] = (group, _TorchGroup(group, device))
    return _TORCH_GROUPS[key][1]


# ---------------------------------------------------------------------------------------------
# The ring's moving parts


class _Exchange:
    """Transfers around the ring, ordered against the compute stream: the communication stream
    waits until the compute stream has queued everything before ``start`` (the buffers to send
    are written and the buffers to receive into are no longer read), and ``wait`` makes the
    compute stream wait for the transfer. On the CPU (LocalGroup) a transfer is done on return.
    ``enabled=False`` skips the transfers (the benchmark's compute-only run)."""

    def __init__(self, group, compute_stream, enabled: bool = True):
        self._group, self._compute, self.enabled = group, compute_stream, enabled
        self._pending = None

    def start(self, send, recv) -> None:
        if not self.enabled:
            return
        if self._compute is None:
            self._group.send_recv(send, recv)
            return
        comm = self._group.stream
        comm.wait_event(self._compute.record())
        with comm:
            self._group.send_recv(send, recv)
        self._pending = comm.record()

    def wait(self) -> None:
        if self._pending is not None:
            self._compute.wait_event(self._pending)
            self._pending = None


@dataclasses.dataclass(frozen=True)
class _Block:
    """One ring step on one rank: which local query rows meet which rows of the held K/V, and
    whether the causal mask applies (only to the rank's own block)."""

    rows_q: slice
    rows_k: slice
    causal: bool


def _block(rank: int, world_size: int, step: int, causal: bool, local: int) -> _Block:
    """The zigzag schedule (module docstring): K/V held at ``step`` came from rank - step."""
    everything = slice(0, local)
    if not causal:
        return _Block(everything, everything, False)
    if step == 0:
        return _Block(everything, everything, True)
    src = (rank - step) % world_size
    half = local // 2
    if src < rank:
        return _Block(everything, slice(0, half), False)
    return _Block(slice(half, local), everything, False)


def _rows(x, rows: slice, axis: int = 1):
    return _take(x, axis, rows.start, rows.stop)


def _handshake(group, call: int, q, k, causal: bool, scale, softcap: float, refused: Exception | None) -> None:
    """All-gather what every rank must agree on; a difference raises the same error on every rank.

    ``refused``: this rank's own check failed with that error. The rank still meets the others
    here, so that every rank raises (this one its own error, the others one naming it) instead of
    the others waiting in the ring for a rank that has left."""
    if refused is None:
        dtype = _arrays.dtype_name(q.dtype)
        # scale and softcap as the kernels hold them (float32, the default scale resolved, -0.0 as
        # 0.0): scale=None and an explicit 1/sqrt(D) are one option
        scale_used = np.float32(_masks.resolve_scale(scale, int(q.shape[3])))
        fields = [call, *map(int, q.shape[:3]), int(k.shape[2]), int(q.shape[3]),
                  _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1, int(bool(causal)),
                  *(np.float64(x + np.float32(0.0)).view(np.int64) for x in (scale_used, np.float32(softcap)))]
    else:
        fields = [call] + [-1] * (len(_HANDSHAKE_FIELDS) - 1)
    every = group.all_gather(np.array([int(refused is None), *fields], dtype=np.int64))
    if refused is not None:
        raise refused
    if not every[:, 0].all():
        rank = int(np.argmin(every[:, 0]))
        raise PeerRefusedError(f"rank {rank} of the ring refused its inputs (its own error says why), so this rank "
                               "stops too: every rank of the ring must call with valid shards and options")
    every = every[:, 1:]
    for field, name in enumerate(_HANDSHAKE_FIELDS):
        values = every[:, field]
        if (values != values[0]).any():
            other = int(np.argmax(values != values[0]))
            shown = [_shown(name, v) for v in (values[0], values[other])]
            raise ValueError(f"{name} differs between ranks: rank 0 has {shown[0]}, rank {other} has {shown[1]}; "
                             "every rank of the ring must call with shards of one shape and dtype and the same options")


@contextlib.contextmanager
def _ring_call(group, call: int, **named):
    """One ring call's array context, its arrays' views (in ``named``'s order) and its group. A rank
    whose arrays are refused here, before its ring exists, still meets its peers in the handshake
    (_meet_refused), so that they raise at once naming it instead of waiting until their timeout."""
    stack = contextlib.ExitStack()
    with stack:
        try:
            if "out" in named:  # the backward's out, which array_context would let be None
                _arrays.require(out=named["out"])
            ctx = stack.enter_context(_arrays.array_context(**named))
            views = tuple(ctx.view(x) for x in named.values())
        except (ValueError, TypeError) as refused:
            _meet_refused(group, call, refused)
        ring = _as_group(group, ctx.kind, views[list(named).index("q")])
        entered = stack.pop_all()
    with entered:
        yield ctx, views, ring


def _meet_refused(group, call: int, refused: Exception) -> None:
    """Raise ``refused``, this rank's error from before its ring existed, after meeting the other
    ranks in the handshake where its group can gather without the call's arrays (a LocalGroup or an
    NcclGroup; a torch.distributed group needs them for its device)."""
    if isinstance(group, (LocalGroup, NcclGroup)):
        try:
            _handshake(group, call, None, None, False, None, 0.0, refused)  # raises `refused`
        except Exception as met:  # noqa: BLE001 - whatever stops the gather, this rank's error stands
            if met is not refused:  # the group could not gather (no NCCL, a peer gone)
                raise refused from None
    raise refused


def _refusal(check) -> Exception | None:
    """The error of this rank's own checks (``check()``), or None: handed to _handshake, which
    raises it after meeting the other ranks."""
    try:
        check()
    except (ValueError, TypeError) as exc:
        return exc
    return None


def _shown(field: str, value) -> str:
    if field == "q.dtype":
        return _DTYPE_CODES[value] if 0 <= value < len(_DTYPE_CODES) else "another dtype"
    if field in ("scale", "softcap"):
        return str(np.float32(np.int64(value).view(np.float64)))
    if field == "causal":
        return str(bool(value))
    return str(int(value))


def _check_ring_inputs(q, k, v, causal: bool, host: bool) -> None:
    _check_qkv(q, k, v, packed=False)
    # one head dim for q, k and v: the ranks' handshake compares q's only, and the ring's transfers
    # and backward assume v's is the same
    if int(v.shape[3]) != int(q.shape[3]):
        raise ValueError(f"v.shape[3] (head_dim_v) must equal q.shape[3] (head_dim) = {int(q.shape[3])} in ring "
                         f"attention, got {int(v.shape[3])}")
    _arrays.check_dtypes({"q": q, "k": k, "v": v}, host)
    _check_ring_rows({"q": q}, host, q)
    if not host:  # k and v need only q's device: the ring sends contiguous copies of them
        for name, x in (("k", k), ("v", v)):
            _arrays.check_same_device(name, x, "q", q)
    _arrays.check_axis("k", k, 1, "S_local", int(q.shape[1]), "q.shape[1]")
    _arrays.check_positive("q", q, 1, "S_local")
    if causal and int(q.shape[1]) % 2:
        raise ValueError(
            f"q.shape[1] (S_local) = {int(q.shape[1])} must be even with causal=True: a zigzag shard is two equal "
            "chunks (chunk rank, then chunk 2P-1-rank; see cuattn.distributed.zigzag_shard)"
        )


def _check_ring_rows(named: dict, host: bool, q) -> None:
    """The layout attention and attention_backward take for the arrays the ring hands them as they
    are (views of q's rows; dout and out): a contiguous last axis, and on the device the kernels'
    row alignment and q's device. Checked before the handshake, so that a rank that would fail at
    its first step refuses instead, and its peers learn it rather than wait."""
    for name, x in named.items():
        if host:
            _arrays.check_last_axis(name, x)
        else:
            _arrays.check_kernel_layout(name, x)
            _arrays.check_same_device(name, x, "q", q)


class _Ops:
    """The array operations the ring needs, on NumPy (float64 accumulators) or CuPy (float32)."""

    def __init__(self, host: bool):
        if host:
            self.xp, self.accum = np, np.dtype(np.float64)
        else:
            import cupy

            self.xp, self.accum = cupy, np.dtype(np.float32)

    def contiguous(self, x):
        return self.xp.ascontiguousarray(x)

    def zeros(self, shape):
        return self.xp.zeros(shape, self.accum)


# ---------------------------------------------------------------------------------------------
# Forward and backward on the arrays as the kernels see them (CuPy views or NumPy arrays)


class _KvRing:
    """The K/V block a rank holds, and the two buffers the next block arrives in, alternating
    (never the caller's k and v), moved by ``exchange``."""

    def __init__(self, ops: "_Ops", k, v, exchange: _Exchange, world_size: int):
        self.held = (ops.contiguous(k), ops.contiguous(v))
        self._spare = [None, None]
        self._xp, self._exchange, self._world_size = ops.xp, exchange, world_size

    def send(self, step: int) -> None:
        """Start passing the held block on and receiving the next one (none after the last step)."""
        if step + 1 < self._world_size:
            slot = step % 2
            if self._spare[slot] is None:
                self._spare[slot] = tuple(self._xp.empty_like(x) for x in self.held)
            self._exchange.start(self.held, self._spare[slot])

    def receive(self, step: int) -> None:
        """Wait for the next block and hold it."""
        self._exchange.wait()
        if step + 1 < self._world_size and self._exchange.enabled:
            self.held = self._spare[step % 2]


def _forward(group, stream, q, k, v, *, causal, scale, softcap, compute=True, communicate=True):
    """(out in the accumulator dtype, lse float32) of the local queries over every rank's keys.
    ``compute`` / ``communicate`` False leave out the attention or the transfers (benchmark only)."""
    ops = _Ops(stream is None)
    world_size, rank, local = group.world_size, group.rank, int(q.shape[1])
    ring = _KvRing(ops, k, v, _Exchange(group, stream, enabled=communicate and world_size > 1), world_size)
    out = lse = None
    for step in range(world_size):
        ring.send(step)
        held = ring.held
        if compute:
            block = _block(rank, world_size, step, causal, local)
            part, part_lse = attention(_rows(q, block.rows_q), _rows(held[0], block.rows_k),
                                       _rows(held[1], block.rows_k), causal=block.causal, scale=scale,
                                       softcap=softcap, return_lse=True)
            part = part.astype(ops.accum)
            if out is None:
                out, lse = part, part_lse
            else:
                merged, merged_lse = merge_states(_rows(out, block.rows_q), _rows(lse, block.rows_q, axis=2),
                                                  part, part_lse)
                _rows(out, block.rows_q)[...] = merged
                _rows(lse, block.rows_q, axis=2)[...] = merged_lse
        ring.receive(step)
    return out, lse


def _backward(group, stream, dout, q, k, v, out, lse, *, causal, scale, softcap, compute=True, communicate=True):
    """(dq, dk, dv) in the accumulator dtype: the local queries' gradients, and the gradients of
    this rank's k and v summed over every rank's queries."""
    ops = _Ops(stream is None)
    world_size, rank, local = group.world_size, group.rank, int(q.shape[1])
    ring = _KvRing(ops, k, v, _Exchange(group, stream, enabled=communicate and world_size > 1), world_size)
    grad_exchange = _Exchange(group, stream, enabled=communicate and world_size > 1)
    dq = ops.zeros(q.shape)
    # the dk, dv accumulator of the K/V held now, and the one arriving for the next step
    grads = [(ops.zeros(k.shape), ops.zeros(v.shape)), (ops.zeros(k.shape), ops.zeros(v.shape))]
    for step in range(world_size):
        ring.send(step)
        held = ring.held
        current = grads[step % 2]
        if compute:
            block = _block(rank, world_size, step, causal, local)
            rows_q, rows_k = block.rows_q, block.rows_k
            dq_part, dk_part, dv_part = attention_backward(
                _rows(dout, rows_q), _rows(q, rows_q), _rows(held[0], rows_k), _rows(held[1], rows_k),
                _rows(out, rows_q), _rows(lse, rows_q, axis=2), causal=block.causal, scale=scale, softcap=softcap)
            _rows(dq, rows_q)[...] += dq_part.astype(ops.accum)
            # the accumulator for this K/V arrived during the step's backward kernels
            grad_exchange.wait()
            _rows(current[0], rows_k)[...] += dk_part.astype(ops.accum)
            _rows(current[1], rows_k)[...] += dv_part.astype(ops.accum)
        else:
            grad_exchange.wait()
        # pass the accumulator on; after the last step it reaches the rank that owns this K/V
        grad_exchange.start(current, grads[(step + 1) % 2])
        ring.receive(step)
    grad_exchange.wait()
    dk, dv = grads[world_size % 2] if grad_exchange.enabled else grads[0]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Public API


def ring_attention(q, k, v, group, *, causal=False, scale=None, softcap=0.0, return_lse=False):
    """Attention of this rank's queries over the keys of every rank of ``group`` (ring attention).

    Args:
        q: this rank's ``(B, S_local, Hq, D)`` shard; k, v ``(B, S_local, Hk, D)``, ``Hq % Hk == 0``.
            float16 or bfloat16 on the group's GPU; NumPy arrays (any float dtype) with a
            :class:`LocalGroup` run the float64 reference on the CPU.
        group: :class:`NcclGroup`, a ``torch.distributed`` process group, or :class:`LocalGroup`.
        causal: causal attention over the full sequence; the shards are then in the zigzag
            layout (:func:`zigzag_shard`), so ``S_local`` is even. Contiguous shards otherwise.
        scale, softcap: as in :func:`cuattn.attention` (sinks and windows are not supported here).
        return_lse: also return lse ``(B, Hq, S_local)`` float32, natural log over every key.

    Returns:
        ``out`` ``(B, S_local, Hq, D)`` in q's dtype and framework (queued on the caller's
        stream), or ``(out, lse)``. Every rank must call with the same shapes and options.
    """
    with _ring_call(group, 0, q=q, k=k, v=v) as (ctx, (qv, kv, vv), ring):

        def check():
            _masks.check_options((-1, -1), softcap, scale, causal=causal, return_lse=return_lse)
            _check_ring_inputs(qv, kv, vv, causal, ctx.on_host)

        _handshake(ring, 0, qv, kv, causal, scale, softcap, _refusal(check))
        out_acc, lse = _forward(ring, ctx.stream, qv, kv, vv, causal=causal, scale=scale, softcap=softcap)
        out = _result(ctx, out_acc, qv.dtype)
        return (out, _result(ctx, lse, np.float32)) if return_lse else out


def ring_attention_backward(dout, q, k, v, out, lse, group, *, causal=False, scale=None, softcap=0.0):
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention` for this rank's shards.

    ``out`` and ``lse`` (natural log, ``(B, Hq, S_local)``) are this rank's results of the
    forward; options must match it. dk and dv are the gradients of this rank's k and v summed
    over every rank's queries; each comes back to its owner around the ring.
    """
    with _ring_call(group, 1, dout=dout, q=q, k=k, v=v, out=out, lse=lse) as (ctx, views, ring):
        dov, qv, kv, vv, ov, lv = views

        def check():
            _masks.check_options((-1, -1), softcap, scale, causal=causal)
            _check_ring_inputs(qv, kv, vv, causal, ctx.on_host)
            batch, local, num_heads, _ = map(int, qv.shape)
            # attention_backward's own checks of the forward's results (lse's float32 among them)
            _check_bwd_args(dov, ov, lv, qv, vv, (batch, num_heads, local), ctx.on_host)
            _check_ring_rows({"dout": dov, "out": ov}, ctx.on_host, qv)
            if not ctx.on_host:
                _arrays.check_same_device("lse", lv, "q", qv)

        _handshake(ring, 1, qv, kv, causal, scale, softcap, _refusal(check))
        grads = _backward(ring, ctx.stream, dov, qv, kv, vv, ov, lv, causal=causal, scale=scale, softcap=softcap)
        return tuple(_result(ctx, g, x.dtype) for g, x in zip(grads, (qv, kv, vv)))


def _result(ctx, x, dtype):
    """An accumulator in ``dtype``, as the caller's framework's array (allocated by it)."""
    if ctx.on_host:
        return x.astype(dtype)
    result = ctx.empty(tuple(x.shape), dtype)
    result[...] = x
    return ctx.to_caller(result)
