"""The forward at the wide head dims beside torch SDPA's cuDNN backend (docs/wide_head_dims_cudnn_h200.txt).

python scripts/compare_cudnn_fwd.py [--head-dims 256,192,160] [--lengths 4096,16384]
    bf16, B * N = 32768 tokens, H = 2048 / D heads, random normal torch tensors of layout
    [B, N, H, D]: cuattn.attention on them (zero-copy, the caller's stream) against
    torch.nn.functional.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION on their
    [B, H, N, D] views, full and causal. CUDA-event medians (cuattn.bench.timing.time_cuda);
    TFLOP/s by the forward benchmark's FLOP count, and the ratio of the two.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuattn
from cuattn.bench import timing
from cuattn.bench.cases import HIDDEN, TOTAL_TOKENS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="256,192,160")
    parser.add_argument("--lengths", default="4096,16384")
    args = parser.parse_args()
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.lengths.split(",")):
            b, h = TOTAL_TOKENS // n, HIDDEN // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                flops = timing.attention_flops(b, h, n, n, d, causal)
                ours = timing.time_cuda(lambda: cuattn.attention(q, k, v, causal=causal))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = timing.time_cuda(
                        lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                print(f"D={d} N={n} {'causal' if causal else 'full  '} cuattn {flops / ours / 1e9:6.1f} "
                      f"cudnn {flops / cudnn / 1e9:6.1f} ratio {cudnn / ours:.2f}", flush=True)


if __name__ == "__main__":
    main()
