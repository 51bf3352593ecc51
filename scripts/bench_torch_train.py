"""A training step's attention as a torch user runs it: forward and backward through autograd,
eager, cuattn.torch.attention beside torch SDPA's cuDNN backend, on the current GPU.

python scripts/bench_torch_train.py [CASES]
    CASES, comma-separated N:D:mask (mask full or causal), default
    4096:128:full,4096:128:causal,16384:128:causal,4096:64:full. bf16, 32k tokens in total
    (B = 32768 / N), H * D = 2048; cuattn on [B, N, H, D] tensors, SDPA on [B, H, N, D] copies
    (its own layout); CUDA events over 20 steps after 3; TFLOP/s at 3.5x the forward's FLOPs
    (forward 1, backward 2.5), halved for causal. One line per case, with cuDNN's time over
    cuattn's.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuattn.torch

TOKENS = 32768
WIDTH = 2048  # H * D
STEPS, WARMUP = 20, 3
FWD_BWD_FLOP_RATIO = 3.5
DEFAULT_CASES = "4096:128:full,4096:128:causal,16384:128:causal,4096:64:full"


def time_steps(step) -> float:
    """ms per step: CUDA events around STEPS steps after WARMUP."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        step()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / STEPS


def main():
    torch.manual_seed(0)
    for case in (sys.argv[1] if len(sys.argv) > 1 else DEFAULT_CASES).split(","):
        n, d, mask = case.split(":")
        n, d, causal = int(n), int(d), mask == "causal"
        b, h = TOKENS // n, WIDTH // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        grad_t = grad.transpose(1, 2).contiguous()

        def ours():
            cuattn.torch.attention(q, k, v, causal=causal).backward(grad)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).backward(grad_t)

        flops = FWD_BWD_FLOP_RATIO * 4 * b * h * n * n * d / (2 if causal else 1)
        ms = {name: time_steps(step) for name, step in (("cuattn", ours), ("sdpa-cudnn", cudnn))}
        rates = {name: flops / t / 1e9 for name, t in ms.items()}
        print(f"N={n} D={d} causal={causal} fwd+bwd ms: cuattn {ms['cuattn']:.3f} ({rates['cuattn']:.1f} TFLOP/s)  "
              f"sdpa-cudnn {ms['sdpa-cudnn']:.3f} ({rates['sdpa-cudnn']:.1f})  ratio {ms['sdpa-cudnn'] / ms['cuattn']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
