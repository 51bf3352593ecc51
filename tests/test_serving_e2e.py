"""A transformers Llama model served on cuattn's paged cache gives the tokens and logits of the
same model run by transformers with its own ``sdpa`` attention.

examples/serving.py runs a random-initialised ``LlamaForCausalLM`` (grouped-query attention, 8
query heads over 2 KV heads, head dim 64) through its continuous-batching server: chunked
prefill under a small token budget (prompt chunks and decode rows in one
``paged_attention_varlen`` call per layer), prefix caching (one prompt shares its first 112
tokens with another) and the paged cache. The reference is the model's own ``generate`` (greedy,
``sdpa``, its DynamicCache) in the same dtype.

Why not plain token equality: a random-initialised model has near-tied logits. Over a 1000-token
vocabulary the top two logits of a step are often within 0.001 of each other, while bfloat16
rounding alone moves logits by about 0.015 (float16: 0.002) whichever attention runs: sdpa under
another batching flips such a near-tie as readily as cuattn does. So the test measures against
the same weights run in float64 (``truth``), along the reference's tokens (teacher forcing):

1. logits: the server, fed the reference's tokens, gives logits whose largest error against
   ``truth`` is within the repo's error budget (conftest.error_budget: 2x the error of sdpa's own
   ``generate`` logits in the same dtype, plus one unit in the last place). A real fault
   (a key missing from a row, a wrong scale) costs 5 to 100 times that; a position shift common
   to every token is no fault (RoPE sees only differences);
2. greedy tokens: free-running generation (the server's own argmax fed back) yields the
   reference's 64 tokens, or the same tokens up to a step where the two pick different tokens
   whose float64 logits differ by less than the two errors allowed (2x the budget): a tie,
   which either side may break, after which the sequences part. Given 1, a tie is the only way
   they can differ; 2 states the outcome in tokens, and checks that the argmax is what is fed
   back.

With ``pytest -rP`` each case prints, per prompt, how many greedy tokens matched and the errors.
float32 on the CPU runs the same loop with cuattn's float64 NumPy reference attention; float16
and bfloat16 run the kernels on the GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import error_budget  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("serving_example", ROOT / "examples" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serving  # its dataclasses look their module up
_spec.loader.exec_module(serving)

NEW_TOKENS = 64
# Small, so prompts are cut into chunks that share steps with decode rows. With it, prompt 4's first
# chunk runs in the step of prompt 3's last chunk, which completes the last block they share: each
# layer must write it before it reads it.
MAX_BATCH_TOKENS = 40
SHARED_PREFIX = 112  # seven whole blocks of prompt 3 that prompt 4 starts with
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
                torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}

CASES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=pytest.mark.slow),  # about a minute on two cores
    pytest.param("cuda", torch.float16, id="gpu-fp16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu),
]


def make_prompts(vocab: int) -> list[list[int]]:
    """Lengths 1 (no prefill chunk), 16 (one whole block), 37, 130 (three chunks), and a prompt
    sharing the first SHARED_PREFIX tokens of the 130-token one."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 16, 37, 130)]
    prompts.append(prompts[3][:SHARED_PREFIX] + rng.integers(0, vocab, 29).tolist())
    return prompts


def reference(model, truth_model, prompt):
    """sdpa's greedy tokens and their logits (float32), and the float64 logits along those tokens."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.cat(out.logits).float().cpu()  # [NEW_TOKENS, vocab]
    # position len(prompt) - 1 + i predicts new token i
    context = torch.tensor([prompt + tokens[:-1]], device=model.device)
    truth = truth_model(context).logits[0, len(prompt) - 1:].cpu()  # [NEW_TOKENS, vocab] float64
    return tokens, logits, truth


def serve(model, prompts, forced=None):
    requests = [serving.Request(prompt, NEW_TOKENS, forced=None if forced is None else forced[i],
                                record_logits=True) for i, prompt in enumerate(prompts)]
    server = serving.Server(model, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    server.run(requests)
    assert server.manager.num_free_blocks == server.manager.num_blocks, "the server leaked blocks"
    return requests


@pytest.mark.parametrize("device,dtype", CASES)
def test_llama_served_on_paged_cache_matches_sdpa(device, dtype):
    model = serving.build_model(dtype, device)
    assert model.config._attn_implementation == "sdpa"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    truth_model = copy.deepcopy(model).double()  # the same (rounded) weights, in float64
    prompts = make_prompts(model.config.vocab_size)
    with torch.no_grad():
        refs = [reference(model, truth_model, prompt) for prompt in prompts]
        forced = serve(model, prompts, forced=[tokens for tokens, _, _ in refs])
        free = serve(model, prompts)
    assert forced[4].cached_tokens == SHARED_PREFIX, "the shared prompt prefix was not found in the prefix cache"

    for index, ((tokens, sdpa_logits, truth), teacher, greedy) in enumerate(zip(refs, forced, free)):
        truth32 = truth.float()
        served = torch.stack(teacher.logits)  # [NEW_TOKENS, vocab]
        sdpa_err = (sdpa_logits - truth32).abs().max().item()
        served_err = (served - truth32).abs().max().item()
        budget = error_budget(sdpa_err, NUMPY_DTYPES[dtype], 2.0, truth32.abs().max().item())
        where = f"prompt {index} ({len(prompts[index])} tokens)"
        # 1. logits along the reference's tokens
        assert served_err <= budget, (f"{where}: served logits off by {served_err:.3g} from float64, over the budget "
                                      f"{budget:.3g} (sdpa's own error: {sdpa_err:.3g})")
        # 2. free-running greedy generation: the same tokens, up to a tie if there is one
        tie = 2 * budget
        assert len(greedy.output) == NEW_TOKENS
        differ = [step for step in range(NEW_TOKENS) if greedy.output[step] != tokens[step]]
        matched = differ[0] if differ else NEW_TOKENS
        if differ:
            gap = abs(truth[matched, tokens[matched]] - truth[matched, greedy.output[matched]]).item()
            assert gap <= tie, (f"{where}: greedy tokens differ from sdpa's first at step {matched} "
                                f"({greedy.output[matched]} against {tokens[matched]}), where the float64 logits "
                                f"differ by {gap:.3g}, no tie (within {tie:.3g})")
        print(f"{where}: {matched} of {NEW_TOKENS} greedy tokens equal to sdpa's{' up to a tie' if differ else ''}; "
              f"logits error {served_err:.3g} (sdpa {sdpa_err:.3g}, budget {budget:.3g})")
