"""Ring attention on two GPUs against plain cuattn on one: forward + backward time and throughput.

    python scripts/bench_ring.py [--seqlen 131072] [--batch 1] [--heads 16] [--head-dim 128]
                                 [--group nccl|torch] [--json PATH]

The full problem is q, k, v (B, N, H, D) bf16, causal (the issue's target: N = 128k, D = 128).
One GPU runs ``cuattn.attention`` + ``attention_backward`` on all N tokens; two GPUs (one spawned
process each, zigzag shards of N / 2 tokens) run ``cuattn.distributed.ring_attention`` +
``ring_attention_backward``. Both do the same FLOPs (4 B H N^2 D / 2 forward, 2.5x that backward),
so the throughput ratio is the time ratio. To show the overlap, the ring also runs with the
transfers left out (compute only: each rank reuses its own K/V) and with the attention left out
(communication only): with the transfers hidden, compute + communication takes about as long
as compute alone. Times are CUDA-event medians per rank, the slower rank counted. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0). Prints a table; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORLD_SIZE = 2
WARMUP, REPEATS = 1, 3
# rank 1 polls for the NCCL unique id that rank 0 writes
ID_WAIT_S, ID_POLL_S = 120, 0.05
MODES = ("ring", "compute only", "communication only", "compute + communication")


def _inputs(shape):
    """q, k, v, dout: standard normal bf16 on the current device."""
    import cupy

    from cuattn._arrays import BFLOAT16

    return [cupy.random.standard_normal(shape, dtype=cupy.float32).astype(BFLOAT16) for _ in range(4)]


def _time(fn):
    """Median ms of fn on the current stream; a fixed number of calls (every rank must make the same)."""
    from cuattn.bench.timing import time_cuda

    return time_cuda(fn, warmup=WARMUP, repeats=REPEATS, inner=1)


def run_single(args):
    """Plain cuattn on GPU 0, all N tokens."""
    import cuattn

    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v, dout = _inputs(shape)
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    forward = _time(lambda: cuattn.attention(q, k, v, causal=True, return_lse=True))
    backward = _time(lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=True))
    return {"forward_ms": forward, "backward_ms": backward}


def _group(args, folder: pathlib.Path, rank: int):
    if args.group == "torch":
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # NCCL's P2P ops run on the current device
        dist.init_process_group("nccl", init_method=f"file://{folder / 'torch_store'}", rank=rank,
                                world_size=WORLD_SIZE, device_id=device)
        return dist.group.WORLD
    from cuattn.distributed import NcclGroup

    path = folder / "nccl_id.json"
    if rank == 0:
        staging = folder / "nccl_id.json.tmp"
        staging.write_text(json.dumps(list(NcclGroup.unique_id())))
        staging.rename(path)
    deadline = time.monotonic() + ID_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no NCCL unique id after {ID_WAIT_S} s")
        time.sleep(ID_POLL_S)
    return NcclGroup(rank, WORLD_SIZE, tuple(json.loads(path.read_text())))


def run_rank(args, folder: pathlib.Path, rank: int):
    """One rank of the ring: its zigzag shard of N / 2 tokens (random: values do not change the time)."""
    import cupy

    from cuattn import distributed

    group = _group(args, folder, rank)
    shape = (args.batch, args.seqlen // WORLD_SIZE, args.heads, args.head_dim)
    q, k, v, dout = _inputs(shape)
    stream = cupy.cuda.get_current_stream()
    ring = distributed._as_group(group, "cupy", q)  # the group interface the internal ring functions take
    out, lse = distributed.ring_attention(q, k, v, group, causal=True, return_lse=True)

    def public():
        distributed.ring_attention(q, k, v, group, causal=True)
        distributed.ring_attention_backward(dout, q, k, v, out, lse, group, causal=True)

    def parts(compute, communicate):
        options = dict(causal=True, scale=None, softcap=0.0, compute=compute, communicate=communicate)

        def run():
            distributed._forward(ring, stream, q, k, v, **options)
            distributed._backward(ring, stream, dout, q, k, v, out, lse, **options)
        return run

    times = {"ring": _time(public)}
    for mode, flags in (("compute only", (True, False)), ("communication only", (False, True)),
                        ("compute + communication", (True, True))):
        times[mode] = _time(parts(*flags))
    forward = _time(lambda: distributed.ring_attention(q, k, v, group, causal=True))
    return {"fwd_bwd_ms": times, "forward_ms": forward}


def _spawn(args, folder: pathlib.Path, role: str, device: int):
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(WORLD_SIZE))))}
    command = [sys.executable, __file__, "--worker", role, "--dir", str(folder), "--seqlen", str(args.seqlen),
               "--batch", str(args.batch), "--heads", str(args.heads), "--head-dim", str(args.head_dim),
               "--group", args.group]
    return subprocess.Popen(command, env=env)


def _wait(processes):
    for p in processes:
        p.wait()
    failed = [p.args[3] for p in processes if p.returncode]
    if failed:
        raise SystemExit(f"worker(s) {', '.join(failed)} failed; see their output above")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="N, the full sequence (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", choices=("nccl", "torch"), default="nccl")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        import cupy

        rank = 0 if args.worker == "single" else int(args.worker)
        cupy.cuda.Device(rank).use()
        result = run_single(args) if args.worker == "single" else run_rank(args, args.dir, rank)
        (args.dir / f"{args.worker}.json").write_text(json.dumps(result))
        return

    from cuattn.bench.timing import attention_flops

    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        _wait([_spawn(args, folder, "single", 0)])
        _wait([_spawn(args, folder, str(rank), rank) for rank in range(WORLD_SIZE)])
        single = json.loads((folder / "single.json").read_text())
        ranks = [json.loads((folder / f"{rank}.json").read_text()) for rank in range(WORLD_SIZE)]

    forward_flops = attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim, causal=True)
    total_flops = forward_flops * 3.5  # forward plus a backward of 2.5x its FLOPs
    single_ms = single["forward_ms"] + single["backward_ms"]
    ring_ms = {mode: max(r["fwd_bwd_ms"][mode] for r in ranks) for mode in MODES}
    ratio = single_ms / ring_ms["ring"]
    compute, comm, both = (ring_ms[m] for m in MODES[1:])
    hidden = (compute + comm - both) / comm if comm > 0 else 1.0

    print(f"causal attention, B = {args.batch}, N = {args.seqlen}, H = {args.heads}, D = {args.head_dim}, bf16, "
          f"forward + backward ({args.group} group)")
    print("| run | ms | TFLOP/s |\n|---|---:|---:|")
    print(f"| 1 GPU, cuattn (forward {single['forward_ms']:.1f} + backward {single['backward_ms']:.1f}) | "
          f"{single_ms:.1f} | {total_flops / single_ms / 1e9:.0f} |")
    for mode in MODES:
        print(f"| 2 GPUs, {mode} | {ring_ms[mode]:.1f} | {total_flops / ring_ms[mode] / 1e9:.0f} |")
    print(f"throughput ratio, 2 GPUs (ring) / 1 GPU: {ratio:.2f}x (target 1.8x)")
    print(f"overlap: compute {compute:.1f} ms + communication {comm:.1f} ms run together in {both:.1f} ms: "
          f"{100 * hidden:.0f}% of the communication hidden")
    if args.json:
        record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "shape": {"batch": args.batch, "seqlen": args.seqlen, "heads": args.heads,
                            "head_dim": args.head_dim, "causal": True, "dtype": "bfloat16"},
                  "group": args.group, "world_size": WORLD_SIZE, "single_gpu_ms": single,
                  "ring_ms_per_rank": ranks, "ring_ms": ring_ms, "ratio": ratio, "hidden_fraction": hidden,
                  "fwd_bwd_tflops": {"single": total_flops / single_ms / 1e9,
                                     **{mode: total_flops / ms / 1e9 for mode, ms in ring_ms.items()}}}
        args.json.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
