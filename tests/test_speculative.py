"""Speculative decoding end to end: exactness against ``ar``, tree attention, commit, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import specjax
from specjax import models
from specjax.cache import commit_path, init_cache
from specjax.errors import InvalidArgumentError
from specjax.tree import ancestor_mask, depths

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

NEW = 24


@pytest.fixture(scope="module")
def target(spec_target):
    return spec_target


@pytest.fixture(scope="module")
def drafts(spec_drafts):
    return spec_drafts


SHAPES = {
    "chain": dict(method="spec", draft_depth=3),
    "budget-1": dict(method="tree", tree_budget=1, draft_depth=1, draft_width=1),
    "wide-shallow": dict(method="tree", tree_budget=6, draft_depth=1, draft_width=5),
    "deep-narrow": dict(method="tree", tree_budget=8, draft_depth=6, draft_width=2),
    "dynamic": dict(method="tree", tree_budget=12, draft_depth=3, draft_width=3),
    "kary-fixed": dict(method="tree", topology="kary", tree_budget=9, draft_depth=2,
                       draft_width=3),
}


# deep-narrow and kary-fixed also run in the coupled test below; make test-all runs them here.
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow)
                                   if s in ("deep-narrow", "kary-fixed") else s
                                   for s in SHAPES])
def test_greedy_speculation_equals_ar(target, drafts, shape):
    for seed in (0, 1):
        prompt = random_prompt(seed, 7 + 5 * seed)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW).tokens
        for name, draft in drafts.items():
            out = specjax.generate(target, prompt, max_new_tokens=NEW, draft=draft,
                                   **SHAPES[shape])
            assert out.tokens == expected, (shape, name, seed)
            if name == "self" and shape != "budget-1":
                assert out.stats["mean_accepted"] > 1.5
            if name == "wrong":
                assert out.stats["mean_accepted"] == 1.0


@pytest.mark.parametrize("shape", ["chain", "dynamic", "kary-fixed"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_coupled_sampling_equals_ar_sampling(target, drafts, shape, sampling):
    for seed in (3, 4):
        prompt = random_prompt(seed, 9)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                    **sampling).tokens
        for name in ("weak", "self"):
            out = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                   draft=drafts[name], verify="coupled", **SHAPES[shape],
                                   **sampling)
            assert out.tokens == expected, (shape, name, seed)


def test_an_argmax_drafting_draft_keeps_the_coupled_tokens(target, drafts):
    """``draft_ranking="argmax"`` (the draft proposes its most likely children, not its
    guess of the target's coupled token) changes what is drafted, never the tokens."""
    totals = {}
    for ranking in ("auto", "argmax"):
        totals[ranking] = []
        for seed in (3, 4):
            prompt = random_prompt(seed, 9)
            expected = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                        temperature=1.0).tokens
            out = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                   draft=drafts["self"], verify="coupled", temperature=1.0,
                                   draft_ranking=ranking, **SHAPES["chain"])
            assert out.tokens == expected, (ranking, seed)
            totals[ranking].append(out.stats["target_calls"])
    # The self-draft's guess of a coupled token is the token itself: it drafts better with
    # the target's noise than by its argmax (so the option reached the draft).
    assert sum(totals["auto"]) < sum(totals["argmax"]), totals


def test_a_wrong_coupling_is_caught(target, drafts):
    """Sanity of the test above: a different seed gives different tokens."""
    prompt = random_prompt(3, 9)
    a = specjax.generate(target, prompt, max_new_tokens=NEW, seed=3, temperature=1.0).tokens
    b = specjax.generate(target, prompt, max_new_tokens=NEW, seed=5, temperature=1.0,
                         method="spec", draft=drafts["self"], draft_depth=3).tokens
    assert a != b


def drafted_chains(target, draft, prompt, verify: str, temperature: float, *,
                   tree: dict | None = None, cases=((0, None), (1, None), (2, None))):
    """A ``spec`` chain of 5 levels (or, with ``tree``, the tree of ``TreeOptions(**tree)``)
    drafted after ``prompt`` (its last token the root), once with the levels as one loop
    body and once unrolled, for each ``(seed, automaton)`` of ``cases`` (``automaton``:
    ``(tables, the root's state)`` or None): [(tokens, parents, valid, log q~ per node or
    None, the draft cache's K, V)] per way, host arrays."""
    from unittest import mock

    from specjax.cache import advance
    from specjax.methods import speculative
    from specjax.methods.options import SpecOptions, TreeOptions
    from specjax.sampling import make_sampling_params
    from specjax.state import DecodeLoop

    options = (SpecOptions(verify=verify, draft_depth=5) if tree is None
               else TreeOptions(verify=verify, **tree))
    method = speculative.build(options, draft.config)
    build = method._draft_fixed if method.shape.topology is not None else method._draft_dynamic
    loop = DecodeLoop(config=target.config, capacity=64, prompt_bucket=16, method=method)
    cache = init_cache(draft.config, 64)
    tokens = jnp.asarray(prompt, jnp.int32)
    logits, cache = models.forward(draft.params, draft.config, tokens,
                                   jnp.arange(len(prompt), dtype=jnp.int32), cache)
    cache = advance(cache, len(prompt))
    root = (tokens[-1], logits[-1:], jnp.int32(len(prompt) - 1))
    results = {}
    for looped in (True, False):
        with mock.patch.object(speculative.Speculative, "_levels_in_one_loop",
                               lambda self, loop: looped):
            @jax.jit  # the root traced, as in decoding (a constant position folds RoPE)
            def drafted(sampling, key, cache, root, automaton):
                tree, logp, cache = build(draft.params, loop, cache, root[0], root[1], None,
                                          root[2], sampling, key, automaton)
                return tree.tokens, tree.parents, tree.valid, logp, cache.k, cache.v

            results[looped] = [jax.device_get(drafted(
                make_sampling_params(temperature, seed=seed, static_rule=True),
                jax.random.PRNGKey(seed), cache, root, automaton)) for seed, automaton in cases]
    return results[True], results[False]


def assert_same_chains(looped, unrolled, label):
    for a, b in zip(looped, unrolled, strict=True):
        for name, x, y in zip(("tokens", "parents", "valid", "log q~", "k", "v"), a, b,
                              strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"{name}, {label}")


# Coupled in the quick tier (the target's noise ranks the children); the other rules in
# the slow one (rejection is where a chain's levels read their keys).
@pytest.mark.parametrize("shape", ["chain", "dynamic"])
@pytest.mark.parametrize("verify,temperature", [
    pytest.param("greedy", 0.0, marks=pytest.mark.slow), ("coupled", 1.0),
    pytest.param("rejection", 1.0, marks=pytest.mark.slow)])
def test_drafted_levels_in_one_loop_are_bitwise_the_unrolled_levels(target, drafts, shape,
                                                                    verify, temperature):
    """On the CPU the drafted levels of a chain (``spec``) and of a dynamic tree are one
    loop body, each level's scratch window as wide as the deepest level's and its slots
    written at a traced offset; unrolled (a GPU, a TPU, the kernels' paths) each window is
    as wide as the slots written. The drafted tree, every node's ``log q~`` and the draft
    cache's scratch slots are the same bits either way: greedy, coupled (the target's
    noise) and rejection (a fresh sample per step for a chain)."""
    tree = None if shape == "chain" else dict(tree_budget=12, draft_depth=4, draft_width=3)
    looped, unrolled = drafted_chains(target, drafts["weak"], random_prompt(5, 11), verify,
                                      temperature, tree=tree)
    assert_same_chains(looped, unrolled, verify)
    # The seeds draft different trees where the ranking is random (not a dynamic tree's
    # deterministic children under rejection).
    random_ranking = verify == "coupled" or (verify == "rejection" and shape == "chain")
    assert len({tuple(drafted[0]) for drafted in looped}) > random_ranking


@pytest.mark.parametrize("verify", ["match", "rejection"])
def test_stochastic_rules_run_and_self_draft_accepts(target, verify):
    out = specjax.generate(target, random_prompt(6, 8), max_new_tokens=NEW, temperature=1.0,
                           method="tree", draft=target, verify=verify, tree_budget=8,
                           draft_depth=3, draft_width=2)
    assert len(out.tokens) == NEW
    assert out.stats["mean_accepted"] > 1.2


def test_no_recompilation_for_new_prompts_and_settings(target, drafts):
    kwargs = dict(max_new_tokens=NEW, method="spec", draft=drafts["weak"], draft_depth=3)
    specjax.generate(target, random_prompt(0, 9), **kwargs)
    for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 5, 0.8)]):
        out = specjax.generate(target, random_prompt(i + 10, 10 + i), temperature=t, top_k=k,
                               top_p=p, seed=i, **kwargs)
        assert out.stats["compile_seconds"] == 0.0


def test_streaming_speculation_equals_while_loop(target, drafts):
    kwargs = dict(max_new_tokens=NEW, method="tree", draft=drafts["weak"], **{
        k: v for k, v in SHAPES["dynamic"].items() if k != "method"})
    prompt = random_prompt(7, 11)
    full = specjax.generate(target, prompt, **kwargs)
    streamed = []
    for new, _ in specjax.stream_generate(target, prompt, **kwargs):
        streamed += new
    assert streamed == full.tokens


@pytest.mark.slow  # ~1-2 min: 10 random trees, each compiled
@settings(max_examples=10, deadline=None)
@given(st.data())
def test_tree_attention_equals_causal_paths(data):
    """Each tree node's logits equal a plain causal forward over prefix + its path."""
    _, model = _tree_model()
    n = data.draw(st.integers(2, 8))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, 96), min_size=n, max_size=n))
    prefix = random_prompt(8, 6)
    parents_arr = jnp.asarray(parents, jnp.int32)
    mask = ancestor_mask(parents_arr, jnp.ones(n, bool))
    cache = init_cache(model.config, 32)
    _, cache = models.forward(model.params, model.config, jnp.asarray(prefix), jnp.arange(6), cache)
    cache = cache.replace(length=jnp.int32(6))
    positions = 6 + depths(parents_arr)
    logits, _ = models.forward(model.params, model.config, jnp.asarray(tokens), positions,
                               cache, mask)
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        seq = prefix + path[::-1]
        ref, _ = models.forward(model.params, model.config, jnp.asarray(seq), jnp.arange(len(seq)))
        # A tree pass against a plain causal pass: other sums, bounded by the pass's sums.
        assert_sums_close(logits[i], ref[-1], **forward_sums(model.config, len(seq)))


_TREE_MODEL = {}


def _tree_model():
    if not _TREE_MODEL:
        _TREE_MODEL["m"] = tiny_pair("llama-gqa", seed=23)
    return _TREE_MODEL["m"]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(0, 10), st.data())
def test_commit_moves_exactly_the_accepted_path(count, length, data):
    config = _tree_model()[1].config
    cache = init_cache(config, 32)
    k = jax.random.normal(jax.random.PRNGKey(length), cache.k.shape)
    v = jax.random.normal(jax.random.PRNGKey(length + 1), cache.v.shape)
    cache = cache.replace(k=k, v=v, length=jnp.int32(length))
    path = [0] + sorted(data.draw(st.lists(st.integers(1, 9), min_size=4, max_size=4, unique=True)))
    out = commit_path(cache, jnp.asarray(path, jnp.int32), jnp.int32(count))
    assert int(out.length) == length + count
    k, out_k = np.asarray(k), np.asarray(out.k)
    np.testing.assert_array_equal(out_k[:, :length], k[:, :length])  # prefix untouched
    for j in range(count):
        np.testing.assert_array_equal(out_k[:, length + j], k[:, length + path[j]])
        np.testing.assert_array_equal(np.asarray(out.v)[:, length + j],
                                      np.asarray(v)[:, length + path[j]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="spec"), "no draft is shipped"),
    (dict(method="tree", tree_budget=0), "tree_budget"),
    (dict(method="tree", draft_depth=0), "draft_depth"),
    (dict(method="spec", draft_depth=0), "draft_depth"),
    (dict(method="tree", verify="bogus"), "unknown verify rule"),
    (dict(method="spec", verify="greedy", temperature=1.0), "temperature 0"),
    (dict(method="spec", tree_budget=9), "'tree_budget' does not apply to method 'spec'"),
])
def test_bad_speculative_arguments(target, drafts, kwargs, match):
    if kwargs.get("method") and "no draft" not in match:
        kwargs = dict(kwargs, draft=drafts["weak"])
    with pytest.raises(InvalidArgumentError, match=match):
        specjax.generate(target, [1, 2, 3], max_new_tokens=4, **kwargs)


def test_vocabulary_mismatch_is_an_error_before_compute(target):
    _, other = tiny_pair("llama-mha", seed=24, vocab_size=50)
    with pytest.raises(InvalidArgumentError, match="vocabulary size"):
        specjax.generate(target, [1, 2, 3], max_new_tokens=4, method="spec", draft=other)
