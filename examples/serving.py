"""Continuous batching of a Llama model over cuattn's paged KV cache: chunked prefill, prefix caching.

A small Llama-architecture model with grouped-query attention (8 query heads share 2 KV heads,
head dim 64) is built from a `transformers` LlamaConfig with random weights (nothing is
downloaded) and served to a queue of requests, most of which start with the same system prompt:

- **paged cache**: every layer's keys and values live in a `cuattn.PagedKVCache`; one
  `cuattn.BlockManager` hands out the blocks (the same slots in every layer) as sequences grow
  and takes them back when they finish;
- **prefix caching**: a request's whole blocks already in the pool (the system prompt) are
  shared, not recomputed: its prefill starts at `cached_tokens`;
- **chunked prefill**: each step has a token budget; decode rows (one token per running
  sequence) come first, prompt chunks fill the rest, and all of them go through one
  `cuattn.paged_attention_varlen` call per layer.

At the end it prints tokens/s, the prefix hit rate (prompt tokens found in the pool / prompt
tokens) and the pool's use. tests/test_serving_e2e.py imports this file and checks its tokens and
logits against the same model run by transformers with its own `sdpa` attention.

Why a loop over the model's modules rather than a registered attention function: transformers'
AttentionInterface hands the attention function one padded batch of keys and values `(B, H, S,
D)` that its own Cache object has assembled, with a 4-D mask. A paged cache needs the reverse:
packed tokens of many sequences at different positions in one call, keys written to the slots
the block manager chose, and no padded copy of the cache. So `PagedLlama.forward` runs the
model's own modules (embedding, RMSNorms, q/k/v/o projections, its rotary embedding and
`apply_rotary_pos_emb`, MLP, final norm, lm_head) on a packed `(tokens, hidden)` batch and
replaces only what lies between the projections: the cache write and the paged attention. It
relies on module names that are the same across transformers releases, not on the Cache and mask
internals, which change often.

Needs torch and transformers (`pip install 'cuattn[serving]'`). Runs on the GPU (bfloat16) when
torch sees one, else on the CPU (float32, cuattn's float64 NumPy reference for the attention).

    python examples/serving.py
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.util
import sys
import time

import numpy as np

import cuattn

# The model: Llama with grouped-query attention, small enough to build in a second.
MODEL = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0)
# Random weights give nearly uniform attention (scores of std ~0.1), where positions and which
# keys are read hardly matter; q and k weights this much larger make the scores' std ~1.5, so
# the attention pattern, and any error in it, shows in the logits.
ATTENTION_SHARPNESS = 4.0
BLOCK_SIZE = 16
NUM_BLOCKS = 1024
MAX_BATCH_TOKENS = 256  # tokens per step: decode rows first, then prompt chunks
SYSTEM_PROMPT_LEN = 100  # six whole blocks of it can be shared


def build_model(dtype, device, seed: int = 0):
    """A random-initialised LlamaForCausalLM (sdpa attention, no end-of-sequence token) in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)  # weights drawn on the CPU, so the same on every machine
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(ATTENTION_SHARPNESS)
            layer.self_attn.k_proj.weight.mul_(ATTENTION_SHARPNESS)
    return model.to(device=device, dtype=dtype)


class PagedLlama:
    """A LlamaForCausalLM's modules run over packed tokens, with every layer's K/V in a paged cache.

    ``forward(rows)`` computes each row's tokens (a prefill chunk or a decode token of one
    sequence, at positions ``start ..``), writes their keys and values into the slots that
    ``manager`` gave the sequence, and returns the logits of each row's last token. On a CPU
    model the pages are NumPy and the attention is cuattn's float64 reference.
    """

    def __init__(self, model, manager: cuattn.BlockManager):
        config = model.config
        self.model, self.manager = model, manager
        parameter = next(model.parameters())
        self.on_gpu = parameter.device.type == "cuda"
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = model.model.layers
        # [num_blocks, block_size, Hk, D] keys and values, one cache per layer: the model's dtype on
        # the GPU (a cache takes torch's dtype); float32 NumPy pages on the CPU (they hold float16
        # and bfloat16 values exactly)
        page_dtype = parameter.dtype if self.on_gpu else np.float32
        self.caches = [cuattn.PagedKVCache(manager.num_blocks, manager.block_size, self.num_kv_heads, self.head_dim,
                                           page_dtype, device="cuda" if self.on_gpu else "cpu")
                       for _ in layers]
        # the model's own RoPE application, from its modeling module (Llama, Mistral, Qwen2 alike)
        self.apply_rope = importlib.import_module(type(layers[0].self_attn).__module__).apply_rotary_pos_emb

    def cache_bytes(self) -> int:
        return sum(cache.k_pages.nbytes + cache.v_pages.nbytes for cache in self.caches)

    def forward(self, rows, copies=()):
        """rows: ``(seq_id, start, token_ids)`` per sequence, its slots for positions ``start ..
        start + len(token_ids) - 1`` already allocated; copies: copy-on-write block pairs to run first.

        Returns float32 logits ``(len(rows), vocab)`` of each row's last token."""
        import torch

        model = self.model.model
        device = next(self.model.parameters()).device
        lengths = np.array([len(tokens) for _, _, tokens in rows])
        starts = np.array([start for _, start, _ in rows])
        table, _ = self.manager.block_table([seq_id for seq_id, _, _ in rows])  # [B, max_blocks]
        seq_lens = (starts + lengths).astype(np.int32)  # [B] keys each row's last token sees
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)  # [B + 1]
        row_of_token = np.repeat(np.arange(len(rows)), lengths)
        positions = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, lengths)])  # [N]
        slots = (table[row_of_token, positions // self.manager.block_size].astype(np.int64) * self.manager.block_size
                 + positions % self.manager.block_size).astype(np.int32)  # [N]
        for cache in self.caches:
            cache.copy_blocks(list(copies))
        ids = torch.as_tensor(np.concatenate([tokens for _, _, tokens in rows]), device=device)
        hidden = model.embed_tokens(ids)  # [N, hidden]
        num_tokens = hidden.shape[0]
        cos, sin = model.rotary_emb(hidden, torch.as_tensor(positions, device=device)[None])  # [1, N, D] each
        for layer, cache in zip(model.layers, self.caches):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = self.apply_rope(q, k, cos[0], sin[0], unsqueeze_dim=1)  # cos [N, D] -> [N, 1, D]
            out = self._attend(q, k, v, cache, slots, table, cu_seqlens, seq_lens, int(lengths.max()),
                               getattr(attn, "scaling", self.head_dim ** -0.5))
            hidden = hidden + attn.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = torch.as_tensor(cu_seqlens[1:] - 1, device=device)
        return self.model.lm_head(model.norm(hidden[last])).float()

    def _attend(self, q, k, v, cache, slots, table, cu_seqlens, seq_lens, max_seqlen_q, scale):
        """Write k, v [N, Hk, D] to their slots, then attention of q [N, Hq, D] over the pages."""
        import torch

        if self.on_gpu:  # torch CUDA tensors straight in and out, on torch's current stream
            cache.write(k, v, slots)
            return cuattn.paged_attention_varlen(q, cache, table, cu_seqlens, seq_lens, max_seqlen_q, scale=scale)
        cache.write(k.float().numpy(), v.float().numpy(), slots)
        out = cuattn.paged_attention_varlen(q.float().numpy(), cache, table, cu_seqlens, seq_lens, max_seqlen_q,
                                            scale=scale)
        return torch.from_numpy(np.asarray(out, np.float32)).to(q.dtype)


@dataclasses.dataclass
class Request:
    """A prompt to complete with ``max_new_tokens`` greedy tokens, arriving at step ``arrival``.

    ``forced`` (teacher forcing) feeds these tokens instead of the argmax; ``record_logits`` keeps
    the float32 logits each new token was chosen from. The server fills ``output`` and
    ``cached_tokens`` (prompt tokens found in the prefix cache)."""

    prompt: list
    max_new_tokens: int
    arrival: int = 0
    forced: list | None = None
    record_logits: bool = False
    output: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    cached_tokens: int = 0


class _Running:
    """A request being served: its tokens so far and how many of them have K/V in the pages."""

    def __init__(self, seq_id, request: Request, cached: int):
        self.seq_id, self.request = seq_id, request
        self.tokens = list(request.prompt)
        self.computed = cached  # tokens whose keys and values are in the cache

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.request.prompt)


@dataclasses.dataclass
class Stats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0  # prompt chunks and decode rows run through the model
    generated_tokens: int = 0
    peak_blocks: int = 0
    seconds: float = 0.0


class Server:
    """Continuous batching over a :class:`PagedLlama`: admission, a token budget per step, greedy sampling.

    Each step admits the requests that have arrived while the pool can hold their whole prompt
    and output besides what the running ones may still grow to (so no sequence is ever
    preempted), then schedules up to ``max_batch_tokens`` tokens: one decode row per running
    sequence first, then prompt chunks in arrival order.

    The prefix cache hands out a prompt's blocks as soon as their tokens are known, before their
    keys and values exist: a prompt sharing the system prompt with an earlier one still in its
    prefill holds blocks nobody has written yet. Arrival order keeps that safe: it gets tokens
    of the budget only after the earlier prompt's last chunk, and each layer writes the whole
    step's keys and values before its attention reads any, so the shared blocks are written
    before (or in the same step as) its first chunk reads them. A scheduler that reorders
    prompts must instead hold such a prompt back until the blocks it shares are written.
    """

    def __init__(self, model, *, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_batch_tokens=MAX_BATCH_TOKENS):
        self.manager = cuattn.BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.runner = PagedLlama(model, self.manager)
        self.max_batch_tokens = max_batch_tokens
        self.stats = Stats()

    def run(self, requests) -> Stats:
        """Serve every request to completion (arrival steps count from this call); returns this
        run's statistics, also ``self.stats``. The prefix cache carries over to the next run."""
        import torch

        self.stats = Stats()
        waiting = collections.deque(sorted(enumerate(requests), key=lambda item: item[1].arrival))
        for index, request in waiting:
            if not request.prompt or request.max_new_tokens < 1:
                raise ValueError(f"request {index} needs a prompt and max_new_tokens >= 1, got "
                                 f"{len(request.prompt)} prompt tokens and max_new_tokens = {request.max_new_tokens}")
            total = len(request.prompt) + request.max_new_tokens
            if -(-total // self.manager.block_size) > self.manager.num_blocks:
                raise ValueError(f"request {index} ({len(request.prompt)} prompt tokens, {request.max_new_tokens} new) "
                                 f"does not fit a pool of {self.manager.num_blocks} blocks of {self.manager.block_size}")
        running: list[_Running] = []
        begin = time.perf_counter()
        with torch.no_grad():
            while waiting or running:
                self._admit(waiting, running)
                rows, copies = self._schedule(running)
                if rows:
                    logits = self.runner.forward([(seq.seq_id, start, seq.tokens[start:start + n])
                                                  for seq, start, n in rows], copies)
                    self._sample(rows, logits, running)
                self.stats.steps += 1
        if self.runner.on_gpu:
            torch.cuda.synchronize()
        self.stats.seconds += time.perf_counter() - begin
        return self.stats

    def _admit(self, waiting, running) -> None:
        block_size = self.manager.block_size

        def blocks_for(tokens):
            return -(-tokens // block_size)

        # blocks the running sequences may still take before they finish
        growth = sum(max(0, blocks_for(len(s.request.prompt) + s.request.max_new_tokens)
                         - len(self.manager.blocks(s.seq_id))) for s in running)
        while waiting and waiting[0][1].arrival <= self.stats.steps:
            seq_id, request = waiting[0]
            need = blocks_for(len(request.prompt) + request.max_new_tokens)
            if need + growth > self.manager.num_free_blocks:
                break  # first come, first served: later requests wait too
            waiting.popleft()
            self.manager.allocate(seq_id, len(request.prompt), token_ids=request.prompt)
            request.cached_tokens = self.manager.cached_tokens(seq_id)
            running.append(_Running(seq_id, request, request.cached_tokens))
            growth += need - len(self.manager.blocks(seq_id))
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.cached_tokens += request.cached_tokens
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.manager.num_used_blocks)

    def _schedule(self, running):
        """This step's rows ``(sequence, start, count)`` and the copy-on-write block copies they need."""
        budget, rows, copies = self.max_batch_tokens, [], []
        for seq in running:
            if not seq.prefilling and budget:
                # its last sampled token: room for it, then compute it
                _, needed = self.manager.append(seq.seq_id, 1, token_ids=seq.tokens[-1:])
                copies += needed
                rows.append((seq, seq.computed, 1))
                budget -= 1
        for seq in running:  # in arrival order: see the class docstring
            if seq.prefilling and budget:
                count = min(len(seq.request.prompt) - seq.computed, budget)
                rows.append((seq, seq.computed, count))
                budget -= count
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.manager.num_used_blocks)
        return rows, copies

    def _sample(self, rows, logits, running) -> None:
        """Advance every row; a row that reaches its sequence's last token picks the next one."""
        import torch

        self.stats.computed_tokens += sum(n for _, _, n in rows)
        choices = torch.argmax(logits, dim=-1).tolist()
        for (seq, start, count), row_logits, choice in zip(rows, logits, choices):
            seq.computed = start + count
            if seq.computed < len(seq.tokens):
                continue  # a prompt chunk that is not the prompt's last
            request = seq.request
            token = request.forced[len(request.output)] if request.forced is not None else choice
            if request.record_logits:
                request.logits.append(row_logits.cpu())
            request.output.append(int(token))
            seq.tokens.append(int(token))
            self.stats.generated_tokens += 1
            if len(request.output) == request.max_new_tokens:
                self.manager.free(seq.seq_id)  # its full blocks stay cached for later prompts
                running.remove(seq)


def make_requests(rng, count: int, vocab: int, new_tokens: tuple[int, int]) -> list[Request]:
    """Requests arriving two steps apart, each wanting a number of new tokens in ``new_tokens``;
    three in four start with the same system prompt."""
    system = rng.integers(0, vocab, SYSTEM_PROMPT_LEN).tolist()
    requests = []
    for index in range(count):
        user = rng.integers(0, vocab, int(rng.integers(5, 150))).tolist()
        prompt = system + user if index % 4 != 3 else user
        requests.append(Request(prompt, int(rng.integers(*new_tokens)), arrival=2 * index))
    return requests


def main():
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"examples/serving.py needs torch and transformers ({' and '.join(missing)} not found): "
                 "pip install 'cuattn[serving]'")
    import torch

    on_gpu = torch.cuda.is_available()
    model = build_model(torch.bfloat16 if on_gpu else torch.float32, "cuda" if on_gpu else "cpu")
    rng = np.random.default_rng(0)
    # a first short run compiles the kernels (NVRTC, cached on disk), so the timed run measures serving
    Server(model, num_blocks=8).run([Request(list(range(40)), 2)])
    server = Server(model)
    # the CPU runs the attention in float64 NumPy: a lighter load there
    count, new_tokens = (32, (32, 128)) if on_gpu else (6, (8, 24))
    requests = make_requests(rng, count, MODEL["vocab_size"], new_tokens)
    stats = server.run(requests)

    manager = server.manager
    print(f"{'GPU, bfloat16' if on_gpu else 'CPU, float32 (attention: float64 NumPy reference)'}: "
          f"Llama of {MODEL['num_hidden_layers']} layers, {MODEL['num_attention_heads']} query heads over "
          f"{MODEL['num_key_value_heads']} KV heads, {len(requests)} requests, {stats.steps} steps of at most "
          f"{server.max_batch_tokens} tokens")
    print(f"throughput: {stats.generated_tokens / stats.seconds:.0f} generated tokens/s, "
          f"{stats.computed_tokens / stats.seconds:.0f} tokens/s through the model (prompt chunks and decode rows); "
          f"{stats.generated_tokens} tokens in {stats.seconds:.2f} s, {1e3 * stats.seconds / stats.steps:.1f} ms a step")
    print(f"prefix cache: {stats.cached_tokens} of {stats.prompt_tokens} prompt tokens found in the pool "
          f"(hit rate {stats.cached_tokens / stats.prompt_tokens:.0%}); {manager.num_cached_blocks} blocks cached "
          f"at the end")
    print(f"pool: peak {stats.peak_blocks} of {manager.num_blocks} blocks of {manager.block_size} tokens "
          f"({stats.peak_blocks / manager.num_blocks:.0%}), "
          f"{server.runner.cache_bytes() / manager.num_blocks * stats.peak_blocks / 2**20:.1f} of "
          f"{server.runner.cache_bytes() / 2**20:.1f} MiB of pages over {MODEL['num_hidden_layers']} layers; "
          f"{manager.num_free_blocks} blocks free at the end")
    if manager.num_free_blocks != manager.num_blocks or stats.cached_tokens == 0 or \
            any(len(r.output) != r.max_new_tokens for r in requests):
        raise SystemExit("serving example: leaked blocks, no prefix hit or an unfinished request")


if __name__ == "__main__":
    main()
