"""Staged speculation (draft + stage 2) and the model-free ``ngram`` method, end to end:
exactness against ``ar``, token origins, compilation count, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax
from specjax.errors import InvalidArgumentError
from specjax.methods.staged import _static_parents, walk_proposal

from conftest import TINY_VOCAB, fitted_tables, random_prompt, tiny_pair

NEW = 24
_walk = jax.jit(walk_proposal, static_argnums=0)


@pytest.fixture(scope="module")
def target(spec_target):
    return spec_target


@pytest.fixture(scope="module")
def drafts(spec_drafts):
    return spec_drafts


@pytest.fixture(scope="module")
def tables(target):
    """Tables fitted to the target's own greedy text, so stage 2 proposes useful tokens."""
    return fitted_tables(target, range(100, 108), 48)


SHAPES = {
    "staged-default": dict(method="staged"),
    # No stage-2 priors: with the self draft the draft's own tokens must be chosen.
    "staged-one-round-chain": dict(method="staged", draft_rounds=1, draft_width=1,
                                   tree_budget=2, proposal=(1,), stage2_prior=(0.0, 0.0)),
    "staged-budget-1": dict(method="staged", tree_budget=1),
    "staged-wide-no-lookup": dict(method="staged", draft_rounds=3, draft_width=3,
                                  tree_budget=20, proposal=(6, 3, 1), use_lookup=False),
    "staged-priors-two-rounds": dict(method="staged", draft_rounds=2, draft_width=2,
                                     tree_budget=8, proposal=(3, 1, 1),
                                     stage2_prior=(0.5, 0.2)),
    "ngram-default": dict(method="ngram"),
    "ngram-single": dict(method="ngram", proposal=(1,)),
}


def _run(target, prompt, shape, draft, tables, **kwargs):
    options = dict(SHAPES[shape], ngram=tables, **kwargs)
    if options["method"] == "staged":
        options["draft"] = draft
    return specjax.generate(target, prompt, max_new_tokens=NEW, **options)


# The two widest staged shapes (a minute each) also run in the coupled test below.
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow)
                                   if s in ("staged-wide-no-lookup", "staged-priors-two-rounds")
                                   else s for s in SHAPES])
def test_greedy_equals_ar(target, drafts, tables, shape):
    if SHAPES[shape]["method"] == "ngram":
        names = ["none"]
    elif shape in ("staged-default", "staged-wide-no-lookup", "staged-priors-two-rounds"):
        names = list(drafts)
    else:  # edge shapes: one draft keeps the compile count (and CI time) down
        names = ["self"]
    for seed in (0, 1):
        prompt = random_prompt(seed, 7 + 5 * seed)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW).tokens
        for name in names:
            out = _run(target, prompt, shape, drafts.get(name), tables)
            assert out.tokens == expected, (shape, name, seed)
            counts = out.stats["tokens_by_origin"]
            assert sum(counts.values()) == len(out.tokens) and len(out.origins) == len(out.tokens)
            assert counts == {k: out.origins.count(k) for k in counts}
            if name == "self" and shape not in ("staged-budget-1",):
                assert out.stats["mean_accepted"] > 1.5 and counts["draft"] > 0


# The two other staged shapes (15 s each) in the slow tier.
@pytest.mark.parametrize("shape", [
    "staged-default",
    *(pytest.param(s, marks=pytest.mark.slow)
      for s in ("staged-wide-no-lookup", "staged-priors-two-rounds")),
    "ngram-default"])
@pytest.mark.parametrize("sampling", [dict(temperature=1.0),
                                      dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_coupled_sampling_equals_ar_sampling(target, drafts, tables, shape, sampling):
    for seed in (3, 4):
        prompt = random_prompt(seed, 9)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                    **sampling).tokens
        for name in ("weak", "self"):
            out = _run(target, prompt, shape, drafts[name], tables, seed=seed, **sampling)
            assert out.tokens == expected, (shape, name, seed)


def test_stage_two_tokens_are_accepted_and_counted(target, tables):
    """With tables fitted to the target's text, the n-gram/lookup stage must contribute."""
    prompt = specjax.generate(target, random_prompt(100, 6), max_new_tokens=8).tokens
    out = _run(target, random_prompt(100, 6) + prompt, "ngram-default", None, tables)
    counts = out.stats["tokens_by_origin"]
    assert counts["ngram"] + counts["lookup"] > 0 and counts["draft"] == 0
    assert out.stats["mean_accepted"] > 1.0


@pytest.mark.parametrize("method, verify", [("staged", "match"), ("staged", "rejection"),
                                            ("ngram", "rejection")])
def test_stochastic_rules_run(target, tables, method, verify):
    out = specjax.generate(target, random_prompt(6, 8), max_new_tokens=NEW, temperature=1.0,
                           method=method, verify=verify, ngram=tables,
                           **({"draft": target, "stage2_prior": (0.0, 0.0)}
                              if method == "staged" else {}))
    assert len(out.tokens) == NEW
    if method == "staged":
        assert out.stats["mean_accepted"] > 1.2


def test_no_recompilation_for_new_prompts_and_settings(target, drafts, tables):
    kwargs = dict(max_new_tokens=NEW, method="staged", draft=drafts["weak"], ngram=tables)
    specjax.generate(target, random_prompt(0, 9), **kwargs)
    for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 5, 0.8)]):
        out = specjax.generate(target, random_prompt(i + 10, 10 + i), temperature=t, top_k=k,
                               top_p=p, seed=i, **kwargs)
        assert out.stats["compile_seconds"] == 0.0


def test_streaming_equals_while_loop_with_origins(target, drafts, tables):
    kwargs = dict(max_new_tokens=NEW, method="staged", draft=drafts["self"], ngram=tables)
    prompt = random_prompt(7, 11)
    full = specjax.generate(target, prompt, **kwargs)
    tokens, origins, stats = [], [], None
    for new, names, stats in specjax.stream_generate(target, prompt, origins=True, **kwargs):
        tokens += new
        origins += names
    assert tokens == full.tokens and origins == full.origins
    assert stats["tokens_by_origin"] == full.stats["tokens_by_origin"]


@pytest.mark.slow  # about a minute
def test_subset_head_draft_is_exact_and_still_helps(target, drafts, tables):
    """A draft scoring a third of the vocabulary (the target's own head restricted)
    proposes only subset tokens; outputs stay those of ar, greedy and coupled."""
    subset = list(range(0, TINY_VOCAB, 3))
    restricted = drafts["self"].with_head_subset(subset)
    assert restricted.head_size == len(subset)
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        prompt = random_prompt(seed + 40, 9)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                    temperature=temperature).tokens
        for method in ("staged", "spec", "tree"):
            options = dict(ngram=tables) if method == "staged" else {}
            out = specjax.generate(target, prompt, max_new_tokens=NEW, seed=seed,
                                   temperature=temperature, method=method, draft=restricted,
                                   **options)
            assert out.tokens == expected, (method, seed)
    # Draft-proposed tokens come from the subset: with stage 2 off, every token the
    # draft got accepted is a subset token.
    out = specjax.generate(target, random_prompt(50, 9), max_new_tokens=NEW, method="staged",
                           draft=restricted, ngram=tables, use_lookup=False,
                           stage2_prior=(0.0, 0.0), proposal=(1,), tree_budget=2)
    drafted = [t for t, o in zip(out.tokens, out.origins) if o == "draft"]
    assert drafted and all(t in subset for t in drafted)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="staged", stage2_prior=(1.0, 0.0)), "stage2_prior"),
    (dict(method="staged", stage2_prior=(0.1,)), "stage2_prior"),
    (dict(method="staged", proposal=(0,)), "proposal"),
    (dict(method="staged", proposal=()), "proposal"),
    (dict(method="staged", tree_budget=0), "tree_budget"),
    (dict(method="staged", draft_rounds=0), "draft_rounds"),
    (dict(method="staged", tree_budget=10_000), "exceeds"),
    (dict(method="staged", verify="nope"), "verify"),
    (dict(method="staged", verify="greedy", temperature=1.0), "greedy"),
    (dict(method="ngram", draft_width=2), "draft_width"),
])
def test_bad_arguments_are_one_line_errors(target, drafts, tables, kwargs, match):
    options = dict(kwargs)
    if options["method"] == "staged":
        options["draft"] = drafts["weak"]
    with pytest.raises(InvalidArgumentError, match=match) as info:
        specjax.generate(target, [1, 2, 3], max_new_tokens=4, ngram=tables, **options)
    assert "\n" not in str(info.value)


def test_table_and_draft_mismatches_are_errors(target, drafts, tables):
    other = tiny_pair("llama-mha", seed=3, vocab_size=TINY_VOCAB + 1)[1]
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        specjax.generate(other, [1, 2], max_new_tokens=4, method="ngram", ngram=tables)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        specjax.generate(target, [1, 2], max_new_tokens=4, method="staged", draft=other,
                         ngram=tables)
    with pytest.raises(InvalidArgumentError, match="no n-gram tables"):
        specjax.generate(target, [1, 2], max_new_tokens=4, method="ngram")
    with pytest.raises(InvalidArgumentError, match="takes no draft"):
        specjax.generate(target, [1, 2], max_new_tokens=4, method="ngram", ngram=tables,
                         draft=drafts["weak"])


def walk_reference(proposal, tokens, valid, best_child, history, visible, history_at,
                   visible_at):
    """The walk one level at a time in Python: the first valid child of the current node
    whose token is the draft's best child of it; stop at the first level with none."""
    parents = [-1] + [0 if p < 0 else p + 1 for p in _static_parents(proposal)]
    history, visible = list(history), list(visible)
    node, matched, lo = 0, 0, 1
    for count in proposal:
        hits = [i for i in range(lo, lo + count)
                if valid[i] and parents[i] == node and tokens[i] == best_child[node]]
        if not hits:
            break
        node = hits[0]
        if history_at + matched < len(history):
            history[history_at + matched] = tokens[node]
        if visible_at + node < len(visible):
            visible[visible_at + node] = True
        matched += 1
        lo += count
    return node, matched, history, visible


@settings(max_examples=80, deadline=None)
@given(data=st.data(), proposal=st.sampled_from([(2, 1, 1, 1, 1, 1), (4, 2, 1, 1, 1, 1),
                                                 (3, 1, 1), (1,), (6, 3, 1)]))
def test_walk_matches_a_level_by_level_walk(data, proposal):
    # Tokens from {0, 1, 2}: matches are common, and ties among siblings occur.
    size = 1 + sum(proposal)
    tokens = data.draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    valid = [True] + data.draw(st.lists(st.booleans(), min_size=size - 1, max_size=size - 1))
    best = data.draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    history_at = data.draw(st.integers(0, 12))
    visible_at = data.draw(st.integers(0, 12))
    history, visible = list(range(100, 116)), [False] * 20
    got = _walk(proposal, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid),
                jnp.asarray(best, jnp.int32), jnp.asarray(history, jnp.int32),
                jnp.asarray(visible), history_at, visible_at)
    want = walk_reference(proposal, tokens, valid, best, history, visible, history_at,
                          visible_at)
    assert (int(got[0]), int(got[1])) == want[:2]
    assert np.asarray(got[2]).tolist() == want[2] and np.asarray(got[3]).tolist() == want[3]
