"""Train a small attention model with cuattn and with torch SDPA from the same seed.

A one-layer causal self-attention model learns to copy a shifted token sequence. Both runs
start from the same weights and data; the script prints the two loss curves side by side and
exits non-zero if they drift apart. Needs torch with a CUDA GPU.

    python examples/torch_training.py
"""

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:
    sys.exit("examples/torch_training.py needs torch with a CUDA GPU (torch not found)")

import torch  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("examples/torch_training.py needs a CUDA GPU (torch sees none): it trains the same model on "
             "cuattn's kernels and on torch SDPA's; examples/quickstart.py runs the CPU reference")

import cuattn.torch  # noqa: E402

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS = 64, 128, 4, 128, 16, 300


class Block(torch.nn.Module):
    def __init__(self, use_cuattn: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.use_cuattn = use_cuattn

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos
        q, k, v = self.qkv(x).view(x.shape[0], SEQ, 3, HEADS, DIM // HEADS).unbind(2)  # (B, S, H, D) views
        if self.use_cuattn:
            y = cuattn.torch.attention(q, k, v, causal=True)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return self.head(x + self.proj(y.reshape(x.shape[0], SEQ, DIM)))


def train(use_cuattn: bool) -> list[float]:
    torch.manual_seed(0)
    model = Block(use_cuattn).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=generator)
        logits = model(tokens[:, :-1])
        # target: the token two positions back (needs attention to look back)
        target = torch.roll(tokens[:, :-1], 2, dims=1)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    ours, theirs = train(True), train(False)
    print("step   cuattn    torch-SDPA")
    for step in range(0, STEPS, 25):
        print(f"{step:4d}  {ours[step]:8.4f}  {theirs[step]:8.4f}")
    print(f"{STEPS - 1:4d}  {ours[-1]:8.4f}  {theirs[-1]:8.4f}")
    drift = max(abs(a - b) / max(b, 1e-3) for a, b in zip(ours[-20:], theirs[-20:]))
    print(f"largest relative gap over the last 20 steps: {drift:.3f}")
    if not ours[-1] < 0.5 * ours[0] or drift > 0.1:
        sys.exit("torch_training: cuattn's loss curve does not follow torch SDPA's")


if __name__ == "__main__":
    main()
