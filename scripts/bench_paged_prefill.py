"""Prefill throughput over a paged KV cache: cuattn.paged_attention_varlen against cuattn.attention_varlen
on the same tokens in a dense packed layout, on the current GPU.

python scripts/bench_paged_prefill.py OUT.json [--no-runs] [--block-size 16] [--only RE] [--alibi]
    bf16, D = 128, GQA 32/8, block size 16 (or --block-size), pages shuffled over the pool, causal (bottom-right):
      prefill  4 sequences x 4096 new queries over 4096, 6144, 8192 and 8192 keys
      mixed    1 prefill chunk of 2048 queries over 4096 keys + 64 decode rows over 4096 keys each
      mixed-8k 1 chunk of 2048 queries + 63 decode rows, 8192 keys each; also the chunk alone and
               the rows alone (paged_attention), and the ratio of the mixed call to their sum
      ragged   24 chunks of 64-2047 queries over their own tokens and 0-4095 earlier ones (drawn
               once, seed 1)
    one line per (case, path): ms and TFLOP/s (4 * H * D per visible query-key pair). The paged
    times include the call's host planning (check=False, device tables). Dense and paged are each
    timed twice: as dispatched (the Hopper forward on an H200, its PAGED variant for the paged
    call) and on flash_fwd_kernel, the mma.sync kernel (its PAGED variant: the paged forward
    before Hopper), so the cost of the page lookups shows apart from the kernel's; and both
    without the Hopper forward's tile order (attention.FWD_SM90_TILE_ORDER off), which each
    launches where its tiles outnumber the SMs.
    Unless --no-runs, a last path times the decode-only schedule (every sequence cut into runs of
    16 queries through paged decode, what paged_attention_varlen did before the paged forward).
    --only RE: only the (case, path) lines that match RE ("case path", e.g. "ragged .*tile order").
    --alibi: also both calls with ALiBi (slopes 2^(-8 h / H), h = 1..H), each timed beside its
    plain call, and their ratio (what ALiBi costs each).
"""

import argparse
import contextlib
import importlib
import json
import re
import sys

import cupy
import numpy as np

import cuattn
from cuattn import _calls, paged_varlen
from cuattn.bench import cases as bench_cases, timing

attention_module = importlib.import_module("cuattn.attention")  # the module, not the function

HQ, HK, D = 32, 8, 128
CASES = {
    # name: (queries per sequence, keys per sequence)
    "prefill": ((4096,) * 4, (4096, 6144, 8192, 8192)),
    "mixed": ((2048,) + (1,) * 64, (4096,) * 65),
    # the serving issue's mixed step: one 2k-token chunk and 63 decode rows over 8k contexts,
    # also timed as its two parts launched separately (the chunk alone, the rows alone)
    "mixed-8k": ((2048,) + (1,) * 63, (8192,) * 64),
}
_ragged = np.random.default_rng(1)
_ragged_queries = tuple(int(n) for n in _ragged.integers(64, 2048, size=24))
CASES["ragged"] = (_ragged_queries, tuple(n + int(c) for n, c in zip(_ragged_queries,
                                                                     _ragged.integers(0, 4096, size=24))))
SPLIT_CASES = ("mixed-8k",)


def visible_pairs(queries, keys) -> int:
    """Query-key pairs a causal bottom-right mask leaves: query i of n sees keys j <= Sk - n + i."""
    return sum(n * (sk - n) + n * (n + 1) // 2 for n, sk in zip(queries, keys))


def make_case(rng, queries, keys, block):
    """Packed q, dense packed k and v, and the same keys and values scattered over shuffled pages."""
    bf16 = cupy.dtype("bfloat16")
    cu_q = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(keys)]).astype(np.int32)
    q, k, v = (cupy.random.standard_normal((int(cu[-1]), h, D), dtype=cupy.float32).astype(bf16)
               for cu, h in ((cu_q, HQ), (cu_k, HK), (cu_k, HK)))
    per_seq = -(-max(keys) // block)
    order = rng.permutation(len(keys) * per_seq).astype(np.int32)
    table = order.reshape(len(keys), per_seq)
    pages = [cupy.zeros((order.size, block, HK, D), bf16) for _ in range(2)]
    for b, n in enumerate(keys):
        blocks = -(-n // block)
        slots = (table[b, :blocks, None] * block + np.arange(block)).reshape(-1)[:n]
        for dense, paged in zip((k, v), pages):
            paged.reshape(-1, HK, D)[cupy.asarray(slots)] = dense[int(cu_k[b]):int(cu_k[b + 1])]
    return q, k, v, cu_q, cu_k, tuple(pages), cupy.asarray(table), cupy.asarray(np.asarray(keys, np.int32))


@contextlib.contextmanager
def schedule(path: str):
    """The dispatch a path times: mma.sync forward only (the Hopper tile table emptied, plans of
    the other dispatch dropped), the Hopper forward without its tile order, or every sequence
    through paged decode, or as shipped."""
    tiles, threshold = dict(attention_module.FWD_SM90_TILES), paged_varlen.PREFILL_MIN_QUERIES
    order = attention_module.FWD_SM90_TILE_ORDER
    _calls.clear()
    if "mma.sync" in path:
        attention_module.FWD_SM90_TILES.clear()
    if "no tile order" in path:
        attention_module.FWD_SM90_TILE_ORDER = False
    if path.startswith("decode runs"):
        paged_varlen.PREFILL_MIN_QUERIES = np.iinfo(np.int32).max
    try:
        yield
    finally:
        attention_module.FWD_SM90_TILES.update(tiles)
        attention_module.FWD_SM90_TILE_ORDER = order
        paged_varlen.PREFILL_MIN_QUERIES = threshold
        _calls.clear()


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--no-runs", action="store_true")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--only", metavar="RE", help="time only the lines whose 'case path' matches")
    parser.add_argument("--alibi", action="store_true", help="also time both calls with ALiBi")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    slopes = cupy.asarray(bench_cases.alibi_slopes(HQ))
    rows = []
    for name, (queries, keys) in CASES.items():
        q, k, v, cu_q, cu_k, pages, table, lens = make_case(rng, queries, keys, args.block_size)
        cuq_d, cuk_d = cupy.asarray(cu_q), cupy.asarray(cu_k)
        paths = {
            "dense attention_varlen": lambda: cuattn.attention_varlen(q, k, v, cuq_d, cuk_d, max(queries), max(keys),
                                                                      causal=True),
            "paged_attention_varlen": lambda: cuattn.paged_attention_varlen(q, pages, table, cu_q, lens, max(queries),
                                                                            check=False),
        }
        if args.alibi:
            paths["dense attention_varlen, alibi"] = lambda: cuattn.attention_varlen(
                q, k, v, cuq_d, cuk_d, max(queries), max(keys), causal=True, alibi_slopes=slopes)
            paths["paged_attention_varlen, alibi"] = lambda: cuattn.paged_attention_varlen(
                q, pages, table, cu_q, lens, max(queries), check=False, alibi_slopes=slopes)
        # agreement first: the two layouts hold the same tokens
        diff = max(float(cupy.abs(paths[f"dense attention_varlen{kind}"]().astype(cupy.float32)
                                  - paths[f"paged_attention_varlen{kind}"]().astype(cupy.float32)).max())
                   for kind in ("", ", alibi") if f"dense attention_varlen{kind}" in paths)
        timed = list(paths.items()) + [("dense attention_varlen, mma.sync", paths["dense attention_varlen"]),
                                       ("paged_attention_varlen, mma.sync", paths["paged_attention_varlen"]),
                                       ("dense attention_varlen, no tile order", paths["dense attention_varlen"]),
                                       ("paged_attention_varlen, no tile order", paths["paged_attention_varlen"])]
        if not args.no_runs:
            timed.append(("decode runs of 16 (old schedule)", paths["paged_attention_varlen"]))
        if name in SPLIT_CASES:
            # the chunk alone (sequence 0) and the decode rows alone (the others), over the same pages
            chunk_cu = cu_q[:2]
            timed.append(("the chunk alone", lambda: cuattn.paged_attention_varlen(
                q[:int(cu_q[1])], pages, table[:1], chunk_cu, lens[:1], int(queries[0]), check=False)))
            timed.append(("the decode rows alone", lambda: cuattn.paged_attention(
                q[int(cu_q[1]):].reshape(len(queries) - 1, 1, HQ, D), pages, table[1:], lens[1:], check=False)))
        if args.only:
            timed = [(path, fn) for path, fn in timed if re.search(args.only, f"{name} {path}")]
        times = {}
        for path, fn in timed:
            with schedule(path):
                ms = timing.time_cuda(fn)
            times[path] = ms
            part = {"the chunk alone": slice(0, 1), "the decode rows alone": slice(1, None)}.get(path, slice(None))
            work = 4.0 * HQ * D * visible_pairs(queries[part], keys[part])
            row = dict(case=name, path=path, queries=list(queries)[:4] + (["..."] if len(queries) > 4 else []),
                       sequences=len(queries), keys=list(keys)[:4], ms=ms, tflops=work / ms / 1e9,
                       max_abs_diff_paged_vs_dense=diff, dtype="bfloat16", head_dim=D, heads=[HQ, HK], block_size=args.block_size)
            rows.append(row)
            print(f"{name:8s} {path:38s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)
        print(f"{name:8s} max |paged - dense| = {diff:.3g}", flush=True)
        if name in SPLIT_CASES and {"the chunk alone", "the decode rows alone", "paged_attention_varlen"} <= set(times):
            parts = times["the chunk alone"] + times["the decode rows alone"]
            ratio = times["paged_attention_varlen"] / parts
            rows.append(dict(case=name, path="mixed / (chunk alone + rows alone)", ratio=ratio))
            print(f"{name:8s} one mixed call / the two parts separately = {ratio:.3f}", flush=True)
        for call in ("dense attention_varlen", "paged_attention_varlen"):
            if f"{call}, alibi" in times and call in times:
                ratio = times[f"{call}, alibi"] / times[call]
                rows.append(dict(case=name, path=f"{call}: alibi / plain", ratio=ratio))
                print(f"{name:8s} {call}: alibi / plain = {ratio:.3f}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
