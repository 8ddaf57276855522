"""Sampling rules fixed when a program is traced (``SamplingParams.rule``, the GPU's default,
forced here with ``KernelOptions(sampling_rules="static")``): the same numbers and tokens as rules
chosen on the device, no conditional left in a program, one compile per rule, bad settings
refused in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import decode, sampling
from specjax.errors import InvalidArgumentError
from specjax.methods.common import rank_children

from conftest import fitted_tables, random_prompt

NEW = 16
# (temperature, top_k, top_p): greedy, plain sampling, and each truncation.
SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (0.7, 5, 0.9)]
CONDITIONAL = re.compile(r"\bconditional\(")


@pytest.fixture
def static():
    return specjax.KernelOptions(sampling_rules="static")


@pytest.fixture(scope="module")
def tables(spec_target):
    return fitted_tables(spec_target, range(100, 108), 48)


def _every_function(params, logits, positions, key):
    log_p = sampling.target_log_probs(logits, params)
    return dict(tokens=sampling.sample_tokens(logits, params, positions), log_p=log_p,
                perturbed=sampling.perturbed_scores(log_p, params, positions),
                ranked_coupled=rank_children(logits, params, positions, "coupled"),
                ranked_match=rank_children(logits, params, positions, "match"),
                ranked_fresh=rank_children(logits, params, positions, "rejection", key))


def _rules_agree(rule_of) -> bool:
    """Whether every sampling function, with each setting's rule fixed by ``rule_of``, gives
    bit for bit what it gives with the rule chosen on the device."""
    logits = jax.random.normal(jax.random.key(0), (6, 97)) * 3
    logits = logits.at[2, 5].set(logits[2].max())  # a tie for the first place
    positions = jnp.arange(11, 17)
    key = jax.random.key(9)
    run = jax.jit(_every_function)
    for setting in SETTINGS:
        traced = sampling.make_sampling_params(*setting, seed=5)
        assert traced.rule is None
        fixed = traced.replace(rule=rule_of(*setting))
        expected, got = run(traced, logits, positions, key), run(fixed, logits, positions, key)
        if not all(np.array_equal(expected[name], got[name]) for name in expected):
            return False
    return True


def test_a_fixed_rule_computes_what_the_device_would_choose():
    assert _rules_agree(sampling.rule_of)


def test_a_rule_that_drops_the_truncation_is_caught():
    """Sanity of the test above: top-k/top-p settings compiled as plain sampling differ."""
    assert not _rules_agree(lambda t, k, p: sampling.GREEDY if t == 0 else sampling.SAMPLE)


def test_the_rule_of_each_setting():
    assert sampling.make_sampling_params(0.0, 5, 0.5, static_rule=True).rule == "greedy"
    assert sampling.make_sampling_params(1.0, static_rule=True).rule == "sample"
    assert sampling.make_sampling_params(1.0, 3, static_rule=True).rule == "truncate"
    assert sampling.make_sampling_params(0.5, 0, 0.9, static_rule=True).rule == "truncate"
    assert sampling.static_rules("gpu") and not sampling.static_rules("cpu") \
        and not sampling.static_rules("tpu")


def _run(model, prompt, setting, **options):
    temperature, top_k, top_p = setting
    return specjax.generate(model, prompt, max_new_tokens=NEW, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=3, **options)


def _conditionals() -> int:
    """Conditionals in the compiled generation programs cached since the last clear."""
    programs = [e for key, e in decode._EXECUTABLES.items()
                if key[0].__name__ == "run_to_completion"]
    assert programs
    return sum(len(CONDITIONAL.findall(e.as_text())) for e in programs)


METHODS = {  # spec shares tree's code (a chain is a tree)
    "tree": dict(method="tree", tree_budget=12, draft_depth=3, draft_width=3),
    "staged": dict(method="staged"),
    "ngram": dict(method="ngram"),
}


# tree in the fast tier; staged and ngram (13-15 s each) in the slow tier.
@pytest.mark.parametrize("method", [m if m == "tree" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in sorted(METHODS)])
def test_fixed_rules_give_ar_tokens_with_no_conditional(static, spec_target, spec_drafts,
                                                        tables, method):
    options = dict(METHODS[method], ngram=tables if method in ("staged", "ngram") else None)
    if method != "ngram":
        options["draft"] = spec_drafts["weak"]
    prompt = random_prompt(3, 9)
    for setting in (SETTINGS[0], SETTINGS[4]):  # greedy; sampled with top-k and top-p
        decode.clear_compiled()
        expected = _run(spec_target, prompt, setting, kernels=static)
        assert _conditionals() == 0
        out = _run(spec_target, prompt, setting, verify="coupled", kernels=static, **options)
        assert out.tokens == expected.tokens, (method, setting)
        assert out.stats["sampling_rule"] == sampling.rule_of(*setting)
        assert _conditionals() == 0, (method, setting)


def test_rules_chosen_on_the_device_leave_conditionals(spec_target, spec_drafts):
    """Sanity of the test above: the traced rules' program has its conditionals, and a rule
    fixed by a stochastic verify rule gives the same tokens as the traced ones."""
    prompt = random_prompt(4, 9)
    options = dict(METHODS["tree"], draft=spec_drafts["weak"], verify="rejection")
    decode.clear_compiled()
    traced = _run(spec_target, prompt, SETTINGS[3],
                  kernels=specjax.KernelOptions(sampling_rules="traced"), **options)
    assert traced.stats["sampling_rule"] == "traced"
    assert _conditionals() > 0
    fixed = _run(spec_target, prompt, SETTINGS[3],
                 kernels=specjax.KernelOptions(sampling_rules="static"), **options)
    assert fixed.tokens == traced.tokens
    assert fixed.stats["sampling_rule"] == "truncate"


def test_one_compile_per_rule(static, spec_target):
    decode.clear_compiled()
    compiles = []
    for i, setting in enumerate([(1.0, 0, 1.0), (0.5, 0, 1.0), (0.0, 0, 1.0), (0.0, 3, 0.5),
                                 (0.9, 5, 1.0), (1.2, 0, 0.8), (2.0, 0, 1.0)]):
        out = _run(spec_target, random_prompt(i + 20, 9 + i), setting, kernels=static)
        compiles.append(out.stats["compile_seconds"] > 0)
    assert compiles == [True, False, True, False, True, False, False]


def test_a_batch_with_a_fixed_rule_matches_the_traced_one(spec_target):
    prompts = [random_prompt(30, 8), random_prompt(31, 11), random_prompt(32, 5)]
    tokens = {}
    for rules in ("traced", "static"):
        out = specjax.generate(spec_target, prompts, max_new_tokens=NEW, temperature=0.8,
                               seed=[1, 2, 3], kernels=specjax.KernelOptions(sampling_rules=rules))
        tokens[rules] = [row.tokens for row in out]
    assert tokens["static"] == tokens["traced"]


@pytest.mark.parametrize("value", ["sometimes", "Static!"])
def test_a_bad_rules_setting_is_one_line(value):
    with pytest.raises(InvalidArgumentError, match="sampling_rules must be one of") as info:
        specjax.KernelOptions(sampling_rules=value)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match="sampling_rules must be one of"):
        sampling.static_rules("cpu", value)


def test_a_bad_rule_is_one_line():
    params = sampling.make_sampling_params(1.0).replace(rule="always")
    with pytest.raises(InvalidArgumentError, match="rule must be None or one of"):
        sampling.sample_tokens(jnp.zeros((1, 5)), params, jnp.zeros((1,), jnp.int32))
