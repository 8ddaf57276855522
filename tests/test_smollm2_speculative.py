"""The real target with a tiny draft: speculative output equals ``ar`` token for token."""

import pytest

import specjax


@pytest.fixture(scope="module")
def tiny_draft(smollm2):
    """A 2-layer draft cut from the target (shares its tokenizer and tied head)."""
    return smollm2.first_layers(2)


PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"]


@pytest.mark.parametrize("kwargs", [dict(method="spec", draft_depth=3),
                                    dict(method="tree", tree_budget=8, draft_depth=3,
                                         draft_width=2),
                                    dict(method="staged"),  # the shipped draft and tables
                                    dict(method="ngram")])
def test_greedy_and_coupled_equal_ar_on_smollm2(smollm2, tiny_draft, kwargs):
    if kwargs["method"] in ("spec", "tree"):
        kwargs = dict(kwargs, draft=tiny_draft)
    for prompt in PROMPTS:
        for sampling in (dict(), dict(temperature=1.0, seed=7)):
            expected = specjax.generate(smollm2, prompt, max_new_tokens=24, **sampling).tokens
            out = specjax.generate(smollm2, prompt, max_new_tokens=24, **kwargs, **sampling)
            assert out.tokens == expected, (kwargs["method"], sampling)
            if kwargs["method"] in ("staged", "ngram") and not sampling:
                assert out.stats["mean_accepted"] > 1.0
