"""Ring attention (context parallelism): a causal sequence split over ranks equals attention on all of it.

Each rank holds its zigzag shard of q, k, v (chunks r and 2P-1-r of 2P), runs
cuattn.distributed.ring_attention and its backward, and compares its shard of the result with
plain cuattn.attention over the whole sequence. With two GPUs (and NCCL for CuPy) it spawns one
process per GPU over a NcclGroup in bf16; otherwise it simulates four ranks as threads of this
process (LocalGroup) over NumPy arrays, which run the float64 reference on the CPU.
"""

import multiprocessing

import numpy as np

import cuattn
from cuattn.distributed import LocalGroup, ring_attention, ring_attention_backward, zigzag_shard

BATCH, CHUNK, HEADS, KV_HEADS, HEAD_DIM = 1, 32, 4, 2, 64
SIMULATED_RANKS, GPU_RANKS = 4, 2
# bf16 rounds each of out's few hundred summed terms differently on one GPU and on the ring
GPU_TOLERANCE = 5e-2
CPU_TOLERANCE = 1e-5


def full_inputs(world_size, seed=0):
    rng = np.random.default_rng(seed)
    seqlen = 2 * world_size * CHUNK
    q = rng.standard_normal((BATCH, seqlen, HEADS, HEAD_DIM))
    k, v = (rng.standard_normal((BATCH, seqlen, KV_HEADS, HEAD_DIM)) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape)


def rank_step(group, arrays, to_device):
    """This rank's ring forward and backward, and its largest difference from whole-sequence attention."""
    world_size, rank = group.world_size, group.rank
    full = [to_device(x) for x in arrays]
    q, k, v, dout = (zigzag_shard(x, rank, world_size) for x in full)
    out, lse = ring_attention(q, k, v, group, causal=True, return_lse=True)
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, group, causal=True)
    want, want_lse = cuattn.attention(*full[:3], causal=True, return_lse=True)
    want_grads = cuattn.attention_backward(full[3], *full[:3], want, want_lse, causal=True)
    pairs = zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (want, *want_grads))
    return {name: _relative_difference(_host(got), _host(zigzag_shard(ref, rank, world_size)))
            for name, got, ref in pairs}


def _relative_difference(got, ref):
    """Largest difference, relative to the reference's largest magnitude (at least 1)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def gpu_rank(rank, unique_id, results):
    import cupy

    from cuattn.distributed import NcclGroup

    cupy.cuda.Device(rank).use()
    group = NcclGroup(rank, GPU_RANKS, unique_id)
    bf16 = cuattn._arrays.BFLOAT16
    results.put((rank, rank_step(group, full_inputs(GPU_RANKS), lambda x: cupy.asarray(x.astype(bf16)))))


def two_gpus_with_nccl() -> bool:
    if cuattn._jit.gpu_unavailable_reason() is not None:
        return False
    import cupy
    from cupy.cuda import nccl

    return cupy.cuda.runtime.getDeviceCount() >= GPU_RANKS and nccl.available


def main():
    if two_gpus_with_nccl():
        from cuattn.distributed import NcclGroup

        context = multiprocessing.get_context("spawn")
        results, unique_id = context.Queue(), NcclGroup.unique_id()
        workers = [context.Process(target=gpu_rank, args=(r, unique_id, results)) for r in range(GPU_RANKS)]
        for w in workers:
            w.start()
        per_rank = dict(results.get() for _ in workers)
        for w in workers:
            w.join()
        where, tolerance = f"{GPU_RANKS} GPUs over NCCL, bf16", GPU_TOLERANCE
    else:
        arrays = full_inputs(SIMULATED_RANKS)
        per_rank = dict(enumerate(LocalGroup.run(SIMULATED_RANKS, lambda g: rank_step(g, arrays, lambda x: x))))
        where, tolerance = f"{SIMULATED_RANKS} ranks simulated on the CPU (float64 reference)", CPU_TOLERANCE
    print(f"causal ring attention, {where}: sequence {2 * len(per_rank) * CHUNK}, zigzag shards of {2 * CHUNK}")
    for rank in sorted(per_rank):
        print(f"  rank {rank}: largest relative difference from whole-sequence attention: "
              + ", ".join(f"{name} {diff:.2e}" for name, diff in per_rank[rank].items()))
    worst = max(max(d.values()) for d in per_rank.values())
    assert worst <= tolerance, f"ring attention differs from whole-sequence attention by {worst:.3g}"
    print("ring attention equals attention over the whole sequence")


if __name__ == "__main__":
    main()
