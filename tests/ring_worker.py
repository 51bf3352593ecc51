"""One rank of tests/test_distributed.py's two-GPU ring test, run as its own process on GPU `rank`.

    python tests/ring_worker.py DIR RANK WORLD_SIZE {nccl,torch} CAUSAL

Reads DIR/inputs{RANK}.npz (this rank's shards of q, k, v, dout as float32 holding bf16 values,
(B, S_local, H, D)) and DIR/options.json, runs the ring forward and backward in bf16 and writes
out, lse, dq, dk, dv as float32 to DIR/rank{RANK}.npz. "nccl": cuattn.distributed.NcclGroup over
CuPy arrays with the plain functions (rank 0 writes the NCCL unique id to DIR/nccl_id.json);
"torch": a torch.distributed NCCL process group (a file store in DIR) with torch tensors through
the autograd op cuattn.torch.ring_attention, its gradients from out.backward(dout).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import numpy as np

# rank 1 polls for the unique id rank 0 writes; NCCL itself waits far longer for its peers
ID_WAIT_S = 120
ID_POLL_S = 0.05


def _nccl_unique_id(folder: pathlib.Path, rank: int):
    from cuattn.distributed import NcclGroup

    path = folder / "nccl_id.json"
    if rank == 0:
        staging = folder / "nccl_id.json.tmp"
        staging.write_text(json.dumps(list(NcclGroup.unique_id())))
        staging.rename(path)  # atomic: the other rank never reads half a file
    deadline = time.monotonic() + ID_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no NCCL unique id in {path} after {ID_WAIT_S} s")
        time.sleep(ID_POLL_S)
    return tuple(json.loads(path.read_text()))


def run_nccl(folder, rank, world_size, inputs, options):
    import cupy

    import cuattn
    from cuattn.distributed import NcclGroup, ring_attention, ring_attention_backward

    group = NcclGroup(rank, world_size, _nccl_unique_id(folder, rank))
    bf16 = cuattn._arrays.BFLOAT16
    q, k, v, dout = (cupy.asarray(inputs[name].astype(bf16)) for name in ("q", "k", "v", "dout"))
    out, lse = ring_attention(q, k, v, group, return_lse=True, **options)
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, group, **options)
    assert all(isinstance(x, cupy.ndarray) for x in (out, lse, dq, dk, dv)), "CuPy in, CuPy out"
    return {name: x.astype(cupy.float32).get() for name, x in
            (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}


def run_torch(folder, rank, world_size, inputs, options):
    import torch
    import torch.distributed as dist

    import cuattn.distributed
    import cuattn.torch

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)  # NCCL's P2P ops run on the current device
    dist.init_process_group("nccl", init_method=f"file://{folder / 'torch_store'}", rank=rank,
                            world_size=world_size, device_id=device)
    try:
        group = dist.group.WORLD
        q, k, v, dout = (torch.from_numpy(inputs[name]).to(device).bfloat16() for name in ("q", "k", "v", "dout"))
        for x in (q, k, v):
            x.requires_grad_(True)
        out = cuattn.torch.ring_attention(q, k, v, group, **options)
        out.backward(dout)
        # lse from the plain function on torch tensors (the autograd op returns out only)
        _, lse = cuattn.distributed.ring_attention(q.detach(), k.detach(), v.detach(), group, return_lse=True,
                                                   **options)
        results = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        return {name: x.float().cpu().numpy() for name, x in results.items()}
    finally:
        dist.destroy_process_group()


def main(argv):
    folder, rank, world_size, group_kind, causal = pathlib.Path(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    import cupy

    cupy.cuda.Device(rank).use()
    inputs = dict(np.load(folder / f"inputs{rank}.npz"))
    options = json.loads((folder / "options.json").read_text())
    assert options["causal"] == bool(int(causal)), "options.json and the command line disagree"
    run = {"nccl": run_nccl, "torch": run_torch}[group_kind]
    results = run(folder, rank, world_size, inputs, options)
    np.savez(folder / f"rank{rank}.npz", **results)
    print(f"rank {rank}: {group_kind} ring, causal={options['causal']}, wrote {sorted(results)}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main(sys.argv[1:])
