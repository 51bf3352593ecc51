"""Cascade attention: many samples of one prompt decode over a shared prefix read once per step.

Eight samples continue one 2000-token prompt. The prompt's keys and values are one shared
prefix; each sample's own tokens live in a paged cache. Every step appends one token to each
sample and attends over prefix + own tokens with `cuattn.cascade_attention`; the result is
checked against plain paged decode over each sample's whole context (the prompt's pages shared
by every block table). With a GPU the loop runs a step plan (`cuattn.plan_cascade`): the
arrays are updated in place and `run()` only launches. Without one, NumPy arrays run the float64
reference on the CPU.

    python examples/cascade.py
"""

import time

import numpy as np

import cuattn

SAMPLES, PROMPT, STEPS = 8, 2000, 16
HQ, HK, D, BLOCK = 16, 4, 128, 16


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def main():
    rng = np.random.default_rng(0)
    gpu = gpu_available()
    dtype = np.float16 if gpu else np.float32
    xp = np
    if gpu:
        import cupy as xp
    prompt_blocks = -(-PROMPT // BLOCK)
    own_blocks = -(-STEPS // BLOCK)
    num_blocks = prompt_blocks + SAMPLES * own_blocks
    # the pool: the prompt's pages first (written once), then each sample's own pages
    k_pages = rng.standard_normal((num_blocks, BLOCK, HK, D), dtype=np.float32).astype(dtype)
    v_pages = rng.standard_normal((num_blocks, BLOCK, HK, D), dtype=np.float32).astype(dtype)
    prefix_k = k_pages[:prompt_blocks].reshape(-1, HK, D)[:PROMPT]
    prefix_v = v_pages[:prompt_blocks].reshape(-1, HK, D)[:PROMPT]
    own_table = (prompt_blocks + np.arange(SAMPLES * own_blocks)).reshape(SAMPLES, own_blocks).astype(np.int32)
    # plain paged decode's view of the same pool: the prompt's pages, then the sample's own
    # (the prompt fills whole pages here, so its tokens and the sample's are contiguous)
    assert PROMPT % BLOCK == 0
    full_table = np.concatenate([np.broadcast_to(np.arange(prompt_blocks, dtype=np.int32),
                                                 (SAMPLES, prompt_blocks)), own_table], axis=1)

    dev = (lambda x: xp.asarray(x)) if gpu else (lambda x: x)
    pages = (dev(k_pages), dev(v_pages))
    prefix = (dev(np.ascontiguousarray(prefix_k)), dev(np.ascontiguousarray(prefix_v)))
    q = dev(np.zeros((SAMPLES, 1, HQ, D), dtype))
    own_lens = dev(np.ones(SAMPLES, np.int32))
    table = dev(own_table)
    plan = cuattn.plan_cascade(q, prefix, pages, table, own_lens) if gpu else None

    worst, elapsed = 0.0, 0.0
    for step in range(STEPS):
        # sample b's new token: its query, and its own length step + 1 (the keys are already in the pool)
        q[...] = dev(rng.standard_normal((SAMPLES, 1, HQ, D), dtype=np.float32).astype(dtype))
        own_lens[...] = step + 1
        start = time.perf_counter()
        out = plan.run() if gpu else cuattn.cascade_attention(q, prefix, pages, table, own_lens)
        if gpu:
            xp.cuda.get_current_stream().synchronize()
        elapsed += time.perf_counter() - start
        full = cuattn.paged_attention(q, pages, dev(full_table), own_lens + PROMPT, check=False)
        got, want = (np.asarray(x.get() if gpu else x, np.float64) for x in (out, full))
        worst = max(worst, float(np.abs(got - want).max()))
    where = "GPU, plan_cascade(...).run()" if gpu else "CPU float64 reference"
    print(f"{SAMPLES} samples x {STEPS} steps over a {PROMPT}-token shared prompt ({where}): "
          f"{elapsed / STEPS * 1e3:.3f} ms a step, max |cascade - paged decode| = {worst:.2e}")
    if worst > (2e-2 if gpu else 1e-6):
        raise SystemExit("cascade: result differs from paged decode")


if __name__ == "__main__":
    main()
