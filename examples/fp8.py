"""FP8 (float8 e4m3) in cuattn: a KV cache at half the bytes, and the FP8 Hopper forward.

1. **An e4m3 paged KV cache.** Eight sequences of different lengths fill two
   `cuattn.PagedKVCache`s through one `cuattn.BlockManager`: one in the model's 16-bit dtype, one
   in `float8_e4m3fn` with a descale per kv head (`cuattn.fp8_scales`: amax / 448) that its
   `write` kernel quantises with. One decode step (`cuattn.paged_attention`, GQA 32/8, D = 128)
   runs over each; both are checked against the float64 attention of the unquantised keys and
   values, and on a GPU both steps are timed (CUDA graphs): the e4m3 cache holds half the bytes,
   and a step that streams it takes about half the time once the cache is long.
2. **The FP8 forward.** q, k and v with outliers (FlashAttention-3's test inputs: N(0, 1), plus
   N(0, 10^2) on 0.1% of the elements) are quantised by `cuattn.fp8.quantize_qkv` three ways:
   per tensor, per block (q per 64 rows, k per 128 keys), and per block after the random-sign
   Hadamard rotation of q and k (incoherent processing). Each runs `cuattn.attention` on the e4m3
   tensors; the RMSE against float64 of the unquantised inputs is printed beside the 16-bit call.
   On an H100/H200 (sm_90a) this is the e4m3 wgmma kernel, timed against bf16 at N = 8k.

Without a GPU, NumPy arrays run the float64 reference of the dequantised values on the CPU: the
inputs' quantisation error is the same, the kernels' own rounding (the probabilities in e4m3 for
P V) is not there. Part 2 takes that path on GPUs other than sm_90a too.

    python examples/fp8.py
"""

import numpy as np

import cuattn
import cuattn.fp8

HQ, HK, D, BLOCK = 32, 8, 128, 16
OUTLIER_RATE, OUTLIER_STD = 0.001, 10.0
# RMSE bounds on the outlier inputs, the README's measured errors with room for the seed:
# 16-bit inputs about 1e-3, per-tensor e4m3 1.3-1.7e-2, block + Hadamard 0.7-1.0e-2
RMSE_BOUNDS = {"16-bit": 3e-3, "fp8 tensor": 2.5e-2, "fp8 block": 2.5e-2, "fp8 block + hadamard": 2e-2}
# RMSE bounds of a decode step against float64: an e4m3 cache rounds each key and value to 3
# mantissa bits (up to 2^-4 of its magnitude), a 16-bit one to 10 (fp16)
CACHE_RMSE_BOUNDS = {"16-bit": 2e-3, "e4m3": 3e-2}


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def hopper() -> bool:
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def outlier_inputs(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return x + (rng.random(shape) < OUTLIER_RATE) * rng.standard_normal(shape).astype(np.float32) * OUTLIER_STD


def rmse(x, expected: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.asarray(x, np.float64) - expected) ** 2)))


def paged_cache_step(rng, gpu: bool) -> bool:
    """Part 1: one decode step over a 16-bit and an e4m3 paged cache; returns whether both are
    within CACHE_RMSE_BOUNDS."""
    xp = np
    if gpu:
        import cupy as xp
    lengths = [8192, 6000, 8192, 7001, 8192, 4096, 8192, 5555] if gpu else [300, 171, 409, 55, 256, 17, 333, 128]
    dtype = np.float16  # the 16-bit cache (fp16: NumPy reads it on the CPU path too, unlike bf16)
    device = "cuda" if gpu else "cpu"
    manager = cuattn.BlockManager(sum(-(-n // BLOCK) for n in lengths), BLOCK)

    # the sequences' keys and values [tokens, Hk, D], written to the slots the manager hands out
    keys = [rng.standard_normal((n, HK, D)).astype(np.float32) for n in lengths]
    values = [rng.standard_normal((n, HK, D)).astype(np.float32) for n in lengths]
    all_k, all_v = np.concatenate(keys), np.concatenate(values)
    k_scale = cuattn.fp8_scales(all_k, per_head=True)  # float32 (Hk,): amax / 448 per kv head
    v_scale = cuattn.fp8_scales(all_v, per_head=True)
    wide = cuattn.PagedKVCache(manager.num_blocks, BLOCK, HK, D, dtype, device)
    fp8 = cuattn.PagedKVCache(manager.num_blocks, BLOCK, HK, D, "float8_e4m3fn", device, k_scale=k_scale,
                              v_scale=v_scale)
    slots = np.concatenate([manager.allocate(seq, n) for seq, n in enumerate(lengths)])
    k_in, v_in = (xp.asarray(x.astype(dtype)) for x in (all_k, all_v))
    for cache in (wide, fp8):
        # host slot ids are checked against the pool; the e4m3 cache rounds x / scale to nearest even
        cache.write(k_in, v_in, slots)

    # one new token per sequence (already in the caches: it is the last of each length)
    q = rng.standard_normal((len(lengths), 1, HQ, D)).astype(np.float32)
    table, seq_lens = manager.block_table(range(len(lengths)))
    q_in, table_in, lens_in = xp.asarray(q.astype(dtype)), xp.asarray(table), xp.asarray(seq_lens)
    expected = np.concatenate([cuattn.reference.decode(q[b:b + 1].astype(np.float64), keys[b][None].astype(np.float64),
                                                       values[b][None].astype(np.float64),
                                                       np.array([n], np.int32))
                               for b, n in enumerate(lengths)])

    ok = True
    times = {}
    for name, cache in (("16-bit", wide), ("e4m3", fp8)):
        def step(cache=cache):
            return cuattn.paged_attention(q_in, cache, table_in, lens_in, check=False)

        out = step()
        out = out.get() if gpu else out
        diff = out.astype(np.float64) - expected
        err = rmse(out, expected)
        ok &= err < CACHE_RMSE_BOUNDS[name]
        nbytes = cache.k_pages.nbytes + cache.v_pages.nbytes
        line = (f"  {name:6s} cache {np.dtype(cache.dtype).name:13s} {nbytes / 2 ** 20:7.1f} MiB   against float64: "
                f"RMSE {err:.1e}, max {np.abs(diff).max():.1e}")
        if gpu:
            from cuattn.bench.timing import time_cupy_graph

            times[name] = time_cupy_graph(step) * 1e3
            line += f"   {times[name]:6.1f} us a step"
        print(line)
    if gpu:
        print(f"  e4m3 step {times['16-bit'] / times['e4m3']:.2f}x as fast as the 16-bit one "
              f"({len(lengths)} sequences, {sum(lengths)} tokens, CUDA graphs)")
    return ok


def fp8_forward(rng, gpu: bool) -> bool:
    """Part 2: RMSE of the FP8 forward on outlier inputs, three quantisations beside 16 bits;
    returns whether each is within RMSE_BOUNDS."""
    on_device = gpu and hopper()
    xp = np
    if on_device:
        import cupy as xp
    shape = (1, 1024 if on_device else 512, 4, 128)
    q, k, v = (outlier_inputs(rng, shape) for _ in range(3))
    expected = cuattn.reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    wide = np.float16  # the 16-bit call (fp16: NumPy has a matmul for it on the CPU path too)
    outs = {"16-bit": cuattn.attention(*(xp.asarray(x.astype(wide)) for x in (q, k, v)), causal=True)}
    for name, granularity, incoherent in (("fp8 tensor", "tensor", False), ("fp8 block", "block", False),
                                          ("fp8 block + hadamard", "block", True)):
        q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(*(xp.asarray(x) for x in (q, k, v)), granularity=granularity,
                                                         incoherent=incoherent)
        outs[name] = cuattn.attention(q8, k8, v8, causal=True, q_scale=qs, k_scale=ks, v_scale=vs)  # bf16
    ok = True
    for name, out in outs.items():
        out = out.get() if on_device else out
        err = rmse(out, expected)
        ok &= err < RMSE_BOUNDS[name]
        print(f"  {name:21s} RMSE against float64 {err:.1e}")
    if on_device:
        import cupy
        from cuattn.bench.timing import time_cuda

        b, n, h = 2, 8192, 16
        x = [cupy.asarray(rng.standard_normal((b, n, h, 128)).astype(np.float32)) for _ in range(3)]
        q8, k8, v8, qs, ks, vs = cuattn.fp8.quantize_qkv(*x, granularity="block")
        x16 = [t.astype(cupy.dtype("bfloat16")) for t in x]
        flops = 4 * b * h * n * n * 128
        for name, call in (("bf16", lambda: cuattn.attention(*x16)),
                           ("e4m3", lambda: cuattn.attention(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs))):
            ms = time_cuda(call)
            print(f"  {name} forward B={b} N={n} H={h} D=128: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    else:
        print("  (the float64 reference of the dequantised inputs: "
              + ("this GPU is not sm_90a, which the FP8 forward needs)" if gpu else "no GPU here)"))
    return ok


def main():
    rng = np.random.default_rng(0)
    gpu = gpu_available()
    print("1. decode over a paged KV cache, 16-bit and e4m3" + ("" if gpu else " (no GPU here: the CPU reference)"))
    cache_ok = paged_cache_step(rng, gpu)
    print("2. the FP8 forward on inputs with outliers (causal, D = 128)")
    forward_ok = fp8_forward(rng, gpu)
    if not (cache_ok and forward_ok):
        raise SystemExit("fp8 example: an error is past its bound")


if __name__ == "__main__":
    main()
