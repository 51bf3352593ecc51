"""Continuous batching over a paged KV cache, with prefix caching and a prompt forked into samples.

A toy serving loop: requests arrive over time, each step appends one token to every live
sequence (its key/value written into the pages), runs paged_attention for the whole batch, and
retires sequences that reached their length, freeing their blocks. One prompt is forked into 4
samples that share its blocks until each writes into the shared last block, which is then
copied for it. Three requests start with the same system prompt: with prefix caching, the later
ones find its whole blocks in the pool and compute only the rest (a token's key and value here
are a fixed function of the token id and its position, as a model's would be). At the end it
prints the prefix hit rate and the pool's peak use against the memory contiguous max-length
buffers would have reserved, and checks the last step against the float64 reference and every
live sequence's pages against the keys its tokens give.

Runs on the GPU when there is one, else on the CPU (NumPy, float64 reference path).

    python examples/serving.py
"""

import numpy as np

import cuattn

BLOCK_SIZE = 16
NUM_BLOCKS = 256
HQ, HK, D = 8, 2, 64
MAX_SEQ_LEN = 512  # what a contiguous cache would reserve per sequence
VOCAB = 50
SYSTEM_PROMPT_LEN = 70  # shared by requests 1-3: four whole blocks of it can be cached


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
    manager = cuattn.BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
    cache = cuattn.PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, HK, D, dtype, device="cuda" if on_gpu else "cpu")
    # the "model": a token's key and value from its id and position
    key_of_token, value_of_token = (rng.standard_normal((VOCAB, HK, D)) for _ in range(2))
    key_of_position = rng.standard_normal((MAX_SEQ_LEN, HK, D)) * 0.1

    def kv(tokens, start):
        positions = np.arange(start, start + len(tokens))
        k = key_of_token[tokens] + key_of_position[positions]
        return xp.asarray(k.astype(dtype)), xp.asarray(value_of_token[tokens].astype(dtype))

    system = list(rng.integers(0, VOCAB, SYSTEM_PROMPT_LEN))
    # (arrival step, prompt token ids, tokens to generate per sample); request 0 is sampled 4 times
    requests = [(0, list(rng.integers(0, VOCAB, 45)), [30, 55, 80, 20]),
                (3, system + list(rng.integers(0, VOCAB, 50)), [40]),
                (8, system + list(rng.integers(0, VOCAB, 7)), [90]),
                (20, system + list(rng.integers(0, VOCAB, 130)), [25])]
    targets, tokens, live, copies_run, peak_blocks, peak_contiguous = {}, {}, [], 0, 0, 0
    prompt_tokens = cached_tokens = 0
    last = None
    for step in range(150):
        for index, (arrival, prompt, gen) in enumerate(requests):
            if arrival != step:
                continue
            first = (index, 0)
            slots = manager.allocate(first, len(prompt), token_ids=prompt)
            hit = manager.cached_tokens(first)  # whole blocks of a prompt seen before: already in the pages
            cache.write(*kv(prompt[hit:], hit), slots[hit:])
            prompt_tokens, cached_tokens = prompt_tokens + len(prompt), cached_tokens + hit
            for sample in range(1, len(gen)):
                manager.fork(first, (index, sample))  # shares every block, copies nothing
            for sample, n in enumerate(gen):
                targets[(index, sample)] = len(prompt) + n
                tokens[(index, sample)] = list(prompt)
                live.append((index, sample))
        if not live:
            continue
        # one new token per live sequence: copy-on-write first, then write all keys/values in one launch
        slots, copies, new_k, new_v = [], [], [], []
        for seq in live:
            token = int(rng.integers(0, VOCAB))
            s, c = manager.append(seq, 1, token_ids=[token])
            k, v = kv([token], len(tokens[seq]))
            tokens[seq].append(token)
            slots.append(s)
            copies += c
            new_k.append(k)
            new_v.append(v)
        cache.copy_blocks(copies)
        copies_run += len(copies)
        cache.write(xp.concatenate(new_k), xp.concatenate(new_v), np.concatenate(slots))
        table, seq_lens = manager.block_table(live)
        q = xp.asarray(rng.standard_normal((len(live), 1, HQ, D)).astype(dtype))
        out = cuattn.paged_attention(q, cache, table, seq_lens)
        last = (q, table, seq_lens, out, list(live))
        peak_blocks = max(peak_blocks, manager.num_used_blocks)
        peak_contiguous = max(peak_contiguous, len(live))
        for seq in [s for s in live if manager.seq_len(s) >= targets[s]]:
            manager.free(seq)
            live.remove(seq)

    bytes_per_token = 2 * HK * D * np.dtype(dtype).itemsize
    paged_mib = peak_blocks * BLOCK_SIZE * bytes_per_token / 2**20
    contiguous_mib = peak_contiguous * MAX_SEQ_LEN * bytes_per_token / 2**20
    print(f"{'GPU' if on_gpu else 'CPU (NumPy reference)'}: 7 sequences, {copies_run} copy-on-write block copies")
    print(f"prefix cache: {cached_tokens} of {prompt_tokens} prompt tokens found in the pool "
          f"({cached_tokens / prompt_tokens:.0%}), {manager.num_cached_blocks} blocks cached at the end")
    print(f"peak pool use: {peak_blocks} blocks of {BLOCK_SIZE} tokens = {paged_mib:.2f} MiB; "
          f"contiguous {MAX_SEQ_LEN}-token buffers for the {peak_contiguous} concurrent sequences: "
          f"{contiguous_mib:.2f} MiB ({contiguous_mib / paged_mib:.1f}x)")
    print(f"blocks free at the end: {manager.num_free_blocks} of {NUM_BLOCKS}")

    q, table, seq_lens, out, batch = last
    to_host = (lambda x: x.get()) if on_gpu else (lambda x: x)
    k_pages, v_pages = to_host(cache.k_pages), to_host(cache.v_pages)
    ref = cuattn.reference.paged_attention(to_host(q), k_pages, v_pages, table, seq_lens)
    err = np.abs(to_host(out).astype(np.float64) - ref).max()
    print(f"last step: max |out - float64 reference| = {err:.2e}")
    # every sequence of that step, shared prefix blocks included, holds the keys its own tokens give
    pages_ok = all(np.array_equal(cuattn.reference.gather_pages(k_pages, table[row:row + 1], seq_lens[row:row + 1])[0],
                                  to_host(kv(tokens[seq], 0)[0]).astype(np.float64))
                   for row, seq in enumerate(batch))
    if err > 1e-2 or manager.num_free_blocks != NUM_BLOCKS or cached_tokens == 0 or not pages_ok:
        raise SystemExit("serving example: wrong result, wrong pages, no prefix hit or leaked blocks")


if __name__ == "__main__":
    main()
