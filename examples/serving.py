"""Continuous batching over a paged KV cache, with a prompt forked into samples (copy-on-write).

A toy serving loop: requests arrive over time, each step appends one token to every live
sequence (its key/value written into the pages), runs paged_attention for the whole batch, and
retires sequences that reached their length, freeing their blocks. One prompt is forked into 4
samples that share its blocks until each writes into the shared last block, which is then
copied for it. At the end it prints the pool's peak use against the memory contiguous
max-length buffers would have reserved, and checks the last step against the float64 reference.

Runs on the GPU when there is one, else on the CPU (NumPy, float64 reference path).

    python examples/serving.py
"""

import numpy as np

import cuattn

BLOCK_SIZE = 16
NUM_BLOCKS = 256
HQ, HK, D = 8, 2, 64
MAX_SEQ_LEN = 512  # what a contiguous cache would reserve per sequence
SAMPLES = 4


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def main():
    rng = np.random.default_rng(0)
    on_gpu = gpu_available()
    xp = __import__("cupy") if on_gpu else np
    dtype = np.float16 if on_gpu else np.float32
    manager = cuattn.BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    cache = cuattn.PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, HK, D, dtype, device="cuda" if on_gpu else "cpu")

    def kv(n):
        return (xp.asarray(rng.standard_normal((n, HK, D)).astype(dtype)),
                xp.asarray(rng.standard_normal((n, HK, D)).astype(dtype)))

    # (arrival step, prompt length, tokens to generate); request 0 is sampled 4 times
    requests = [(0, 45, [30, 55, 80, 20]), (3, 120, [40]), (8, 7, [90]), (20, 200, [25])]
    targets, live, copies_run, peak_blocks, peak_contiguous = {}, [], 0, 0, 0
    last = None
    for step in range(150):
        for index, (arrival, prompt, gen) in enumerate(requests):
            if arrival != step:
                continue
            first = (index, 0)
            cache.write(*kv(prompt), manager.allocate(first, prompt))  # the prompt is written once
            for sample in range(1, len(gen)):
                manager.fork(first, (index, sample))  # shares every block, copies nothing
            for sample, n in enumerate(gen):
                targets[(index, sample)] = prompt + n
                live.append((index, sample))
        if not live:
            continue
        # one new token per live sequence: copy-on-write first, then write all keys/values in one launch
        slots, copies = [], []
        for seq in live:
            s, c = manager.append(seq)
            slots.append(s)
            copies += c
        cache.copy_blocks(copies)
        copies_run += len(copies)
        cache.write(*kv(len(live)), np.concatenate(slots))
        table, seq_lens = manager.block_table(live)
        q = xp.asarray(rng.standard_normal((len(live), 1, HQ, D)).astype(dtype))
        out = cuattn.paged_attention(q, cache, table, seq_lens)
        last = (q, table, seq_lens, out)
        peak_blocks = max(peak_blocks, manager.num_used_blocks)
        peak_contiguous = max(peak_contiguous, len(live))
        for seq in [s for s in live if manager.seq_len(s) >= targets[s]]:
            manager.free(seq)
            live.remove(seq)

    bytes_per_token = 2 * HK * D * np.dtype(dtype).itemsize
    paged_mib = peak_blocks * BLOCK_SIZE * bytes_per_token / 2**20
    contiguous_mib = peak_contiguous * MAX_SEQ_LEN * bytes_per_token / 2**20
    print(f"{'GPU' if on_gpu else 'CPU (NumPy reference)'}: 7 sequences, {copies_run} copy-on-write block copies")
    print(f"peak pool use: {peak_blocks} blocks of {BLOCK_SIZE} tokens = {paged_mib:.2f} MiB; "
          f"contiguous {MAX_SEQ_LEN}-token buffers for the {peak_contiguous} concurrent sequences: "
          f"{contiguous_mib:.2f} MiB ({contiguous_mib / paged_mib:.1f}x)")
    print(f"blocks free at the end: {manager.num_free_blocks} of {NUM_BLOCKS}")

    q, table, seq_lens, out = last
    to_host = (lambda x: x.get()) if on_gpu else (lambda x: x)
    ref = cuattn.reference.paged_attention(to_host(q), to_host(cache.k_pages), to_host(cache.v_pages), table, seq_lens)
    err = np.abs(to_host(out).astype(np.float64) - ref).max()
    print(f"last step: max |out - float64 reference| = {err:.2e}")
    if err > 1e-2 or manager.num_free_blocks != NUM_BLOCKS:
        raise SystemExit("serving example: wrong result or leaked blocks")


if __name__ == "__main__":
    main()
