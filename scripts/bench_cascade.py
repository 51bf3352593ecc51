"""Cascade attention against plain paged decode for a batch that shares a long prefix, on the
current GPU (the serving issue's target: cascade at least 5x plain paged decode for 64 sequences
sharing an 8k prefix with 256-token suffixes).

python scripts/bench_cascade.py [--batch 64] [--prefix 8192] [--suffix 256] [--torch] [--json PATH]
    bf16, GQA 32/8, D = 128, block size 16, one new token per sequence:
      paged     cuattn.paged_attention over each sequence's whole context (prefix pages shared
                by every block table, as prefix caching leaves them)
      cascade   cuattn.cascade_attention: the prefix once for the batch, each suffix alone, merged
      plan      cuattn.plan_cascade(...).run(): the same launches over fixed arrays
    both as 10-step CUDA graphs (what a serving loop replays) and eagerly, CUDA events; the two
    outputs are compared; the host's time a call (50 calls queued back to back) is printed
    too. With --torch the same arrays are passed as torch tensors (zero-copy)
    and timed eagerly only (the graphs here are captured on a CuPy stream).
"""

import argparse
import json
import sys
import time

import cupy
import numpy as np

import cuattn
from cuattn.bench import timing

HQ, HK, D, BLOCK = 32, 8, 128, 16
GRAPH_STEPS = 10
HOST_CALLS = 50


def graph_ms(fn) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph of GRAPH_STEPS calls."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # compile and plan outside the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(GRAPH_STEPS):
            fn()
        graph = stream.end_capture()
        return timing.time_cuda(lambda: graph.launch(stream)) / GRAPH_STEPS


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--torch", action="store_true", help="torch tensors, eager calls only")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b, lp, ls = args.batch, args.prefix, args.suffix
    bf16 = cupy.dtype("bfloat16")
    prefix_blocks, suffix_blocks = -(-lp // BLOCK), -(-ls // BLOCK)
    num_blocks = prefix_blocks + b * suffix_blocks
    k_pages, v_pages = (cupy.random.standard_normal((num_blocks, BLOCK, HK, D), dtype=cupy.float32).astype(bf16)
                        for _ in range(2))
    # the prefix fills whole pages here (8192 = 512 x 16), so the shared pages are the prefix
    assert lp % BLOCK == 0, "the benchmark shares whole prefix pages"
    rng = np.random.default_rng(0)
    own = (prefix_blocks + rng.permutation(b * suffix_blocks)).reshape(b, suffix_blocks).astype(np.int32)
    full_table = cupy.asarray(np.concatenate([np.broadcast_to(np.arange(prefix_blocks, dtype=np.int32),
                                                              (b, prefix_blocks)), own], axis=1))
    own_table = cupy.asarray(own)
    full_lens = cupy.full(b, lp + ls, cupy.int32)
    own_lens = cupy.full(b, ls, cupy.int32)
    prefix_k, prefix_v = (x[:prefix_blocks].reshape(lp, HK, D) for x in (k_pages, v_pages))
    q = cupy.random.standard_normal((b, 1, HQ, D), dtype=cupy.float32).astype(bf16)

    if args.torch:
        import torch

        q, k_pages, v_pages, full_table, own_table, full_lens, own_lens, prefix_k, prefix_v = (
            torch.from_dlpack(x) for x in (q, k_pages, v_pages, full_table, own_table, full_lens, own_lens, prefix_k,
                                           prefix_v))
    paths = {
        "paged": lambda: cuattn.paged_attention(q, (k_pages, v_pages), full_table, full_lens, check=False,
                                                max_seq_len=lp + ls),
        "cascade": lambda: cuattn.cascade_attention(q, (prefix_k, prefix_v), (k_pages, v_pages), own_table, own_lens,
                                                    check=False, max_seq_len=ls),
    }
    paths["plan"] = cuattn.plan_cascade(q, (prefix_k, prefix_v), (k_pages, v_pages), own_table, own_lens,
                                        max_seq_len=ls).run
    paged_out = cupy.from_dlpack(paths["paged"]()).astype(cupy.float32)
    diff = max(float(cupy.abs(paged_out - cupy.from_dlpack(paths[path]()).astype(cupy.float32)).max())
               for path in ("cascade", "plan"))
    kv_bytes = b * (lp + ls) * HK * D * 2 * 2
    rows = []
    for name, fn in paths.items():
        try:
            graphed = float("nan") if args.torch else graph_ms(fn)
        except Exception as exc:  # a call that cannot be captured is timed eagerly only
            print(f"{name:8s} graph  not captured: {type(exc).__name__}: {exc}", flush=True)
            graphed = float("nan")
        # host time alone: calls queued back to back (few enough not to fill the launch queue)
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        host_us = (time.perf_counter() - start) / HOST_CALLS * 1e6
        cupy.cuda.get_current_stream().synchronize()
        print(f"{name:8s} host   {host_us:9.1f} us a call", flush=True)
        rows.append(dict(path=name, timing="host", us=host_us, framework="torch" if args.torch else "cupy"))
        for how, ms in (("graph", graphed), ("eager", timing.time_cuda(fn))):
            rows.append(dict(path=name, timing=how, ms=ms, batch=b, prefix=lp, suffix=ls, heads=[HQ, HK], head_dim=D,
                             block_size=BLOCK, dtype="bfloat16", context_tb_per_s=kv_bytes / ms / 1e9,
                             framework="torch" if args.torch else "cupy"))
            print(f"{name:8s} {how:6s} {ms * 1e3:9.1f} us  (contexts' K/V at {kv_bytes / ms / 1e9:6.2f} TB/s)",
                  flush=True)
    for path in ("cascade", "plan"):
        for how in ("graph", "eager"):
            ratio = next(r["ms"] for r in rows if r["path"] == "paged" and r["timing"] == how) / next(
                r["ms"] for r in rows if r["path"] == path and r["timing"] == how)
            print(f"{path} speedup over paged decode ({how}): {ratio:.2f}x", flush=True)
            rows.append(dict(path=f"{path} speedup", timing=how, ratio=ratio))
    print(f"max |cascade - paged| = {diff:.3g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_abs_diff": diff, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
