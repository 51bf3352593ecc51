"""Where the host time of a cuattn.torch training step goes, layer by layer.

python scripts/profile_torch_step.py [--profile]

On (1, 128, 8, 64) bf16 tensors (small enough that the host, not the GPU, sets the time), host us
per call (200 calls back to back, best of 5, as ``python -m cuattn bench overhead``) of: the plain
forward and backward, the custom ops called directly (``torch.ops.cuattn.*``, what torch.compile
traces), ``cuattn.torch.attention``'s forward, a whole step (forward + ``torch.autograd.grad``),
and torch SDPA's forward and step on the same shapes. ``--profile`` adds cProfile's top functions
of the step (the calling thread's share: autograd may run the backward on its device thread).
"""

import argparse
import cProfile
import io
import pstats

import torch

import cuattn
import cuattn.torch
from cuattn.bench.overhead import CALLS, time_calls

SHAPE = (1, 128, 8, 64)  # (B, S, H, D)
PROFILE_ROWS = 35


def cases() -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    q, k, v, dout = (randn(SHAPE) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scale = SHAPE[-1] ** -0.5
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    # the ops' trailing options: sinks, alibi_slopes, causal, scale, window left / right, softcap, deterministic
    options = (None, None, False, scale, -1, -1, 0.0, False)
    sdpa_leaves = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    sdpa_dout = dout.transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_grad(call):
        def run():
            with torch.no_grad():
                return call()
        return run

    return {
        "plain attention(return_lse=True)": lambda: cuattn.attention(q, k, v, return_lse=True),
        "plain attention, leaves that require grad": lambda: cuattn.attention(*leaves, return_lse=True),
        "op attention_fwd, no_grad": no_grad(lambda: torch.ops.cuattn.attention_fwd(q, k, v, *options)),
        "op attention_fwd, leaves that require grad": lambda: torch.ops.cuattn.attention_fwd(*leaves, *options),
        "cuattn.torch.attention forward": lambda: cuattn.torch.attention(*leaves),
        "plain attention_backward": lambda: cuattn.attention_backward(dout, q, k, v, out, lse),
        "op attention_bwd, no_grad": no_grad(lambda: torch.ops.cuattn.attention_bwd(dout, q, k, v, out, lse,
                                                                                     *options)),
        "step: cuattn.torch.attention": lambda: torch.autograd.grad(cuattn.torch.attention(*leaves), leaves, dout),
        "SDPA forward": lambda: sdpa(*sdpa_leaves),
        "step: SDPA": lambda: torch.autograd.grad(sdpa(*sdpa_leaves), sdpa_leaves, sdpa_dout),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="cProfile of the cuattn.torch step")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {SHAPE} bf16")
    found = cases()
    for name, call in found.items():
        host, eager = time_calls(call, torch.cuda.synchronize)
        print(f"{name:44s} host {host:7.1f} us  eager {eager:7.1f} us")
    if args.profile:
        step = found["step: cuattn.torch.attention"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            step()
        torch.cuda.synchronize()
        profile.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(PROFILE_ROWS)
            print(f"--- step, by {order}\n{text.getvalue()}")


if __name__ == "__main__":
    main()
