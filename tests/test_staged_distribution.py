"""End-to-end distribution tests of sampled staged decoding: the token that the first
staged step emits must follow the target's (processed) distribution under every stochastic
rule, through the whole jitted step (stage 2, draft passes, tree selection, verification).

The first new token is sampled by the prefill; the second comes from the first staged
step. Its exact marginal, sum over x1 of p(x1) p(x2 | x1), is computed from the target;
a chi-square test compares it with the tokens of many seeds. The same test rejects a
deliberately wrong rule plugged into the same step.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import BatchOptions
from specjax import decode, models, verify
from specjax.methods import common
from specjax.sampling import make_sampling_params, target_log_probs
from specjax.training.ngram_build import build_ngram

from conftest import TINY_VOCAB, random_prompt
from test_verify import chi2_threshold

# 40 full batches of 64 rows: one compiled program per test (2,500 left a last batch of 4
# rows, a program of its own).
SEEDS = 2560
PROMPT = random_prompt(77, 7)
SAMPLING = dict(temperature=1.0, top_k=6)


@pytest.fixture(scope="module")
def setup(spec_target):
    target = spec_target
    corpus = [specjax.generate(target, random_prompt(200 + s, 6), max_new_tokens=32).tokens
              for s in range(6)]
    tables = build_ngram(corpus, TINY_VOCAB, top_k=8, trigram_top_k=4, trigram_buckets=256,
                         min_context_count=1).tables
    return target, tables, _second_token_marginal(target)


def _log_probs(target, tokens):
    logits, _ = models.forward(target.params, target.config, jnp.asarray(tokens, jnp.int32),
                               jnp.arange(len(tokens), dtype=jnp.int32))
    params = make_sampling_params(**SAMPLING)
    return np.asarray(target_log_probs(logits[-1:], params)[0], np.float64)


def _second_token_marginal(target):
    first = np.exp(_log_probs(target, PROMPT))
    marginal = np.zeros(TINY_VOCAB)
    for x1 in np.flatnonzero(first):
        marginal += first[x1] * np.exp(_log_probs(target, PROMPT + [int(x1)]))
    return marginal


def _pooled_chi2(counts, probs):
    """Pearson statistic with cells of expected count < 5 pooled into one."""
    support = probs > 0
    assert counts[~support].sum() == 0, "tokens emitted outside the target's support"
    expected = counts.sum() * probs
    big = support & (expected >= 5)
    cells_c = list(counts[big]) + [counts[support & ~big].sum()]
    cells_e = list(expected[big]) + [expected[support & ~big].sum()]
    stat = sum((c - e) ** 2 / e for c, e in zip(cells_c, cells_e) if e > 0)
    return float(stat), len(cells_c) - 1


def _second_tokens(target, tables, **options):
    """The second token of ``SEEDS`` generations, one seed each. They run as batches of 64
    rows: each row's tokens are those of its own batch-1 call with its seed (tested in
    test_batch.py), so the counts are the same, at a fraction of the calls."""
    decode.clear_compiled()
    outs = specjax.generate(target, [PROMPT] * SEEDS, max_new_tokens=2,
                            seed=list(range(SEEDS)), stop=[], ngram=tables,
                            batch=BatchOptions(size=64, compact_rows=False), **SAMPLING,
                            **options)
    decode.clear_compiled()
    return np.bincount([out.tokens[1] for out in outs], minlength=TINY_VOCAB)


STAGED = dict(method="staged", tree_budget=6, draft_width=2, proposal=(2, 1),
              stage2_prior=(0.5, 0.2))


# match in the slow tier (16 s): the quick tier keeps rejection and the wrong-rule check.
@pytest.mark.parametrize("verify_rule", ["rejection", pytest.param("match",
                                                                   marks=pytest.mark.slow)])
def test_staged_step_samples_the_target_distribution(setup, verify_rule):
    target, tables, marginal = setup
    counts = _second_tokens(target, tables, draft=target, verify=verify_rule, **STAGED)
    statistic, dof = _pooled_chi2(counts, marginal)
    assert statistic < chi2_threshold(dof), (verify_rule, statistic, dof)


def test_the_same_test_catches_a_wrong_rule(setup, monkeypatch):
    """WRONG on purpose: rejection sampling told the draft is uniform (q = 1/V), so it
    accepts drafted tokens with min(1, p V) -- nearly always."""
    target, tables, marginal = setup
    real_rejection = verify.verify_rejection

    def uniform_q_rejection(tree, log_p, draft_logp, key, max_depth, width, children_mode):
        del draft_logp, children_mode
        uniform = jnp.full(log_p.shape, -np.log(log_p.shape[-1]), jnp.float32)
        return real_rejection(tree, log_p, uniform, key, max_depth, width, "with_replacement")

    monkeypatch.setattr(common, "verify_rejection", uniform_q_rejection)  # verify_tree's
    counts = _second_tokens(target, tables, draft=target, verify="rejection", **STAGED)
    statistic, dof = _pooled_chi2(counts, marginal)
    assert statistic > chi2_threshold(dof), (statistic, dof)


# tree in the slow tier (14 s): staged, here, runs the same reduced head in its draft rounds.
@pytest.mark.parametrize("method", ["staged", pytest.param("tree", marks=pytest.mark.slow)])
def test_a_reduced_vocabulary_feature_draft_keeps_the_distribution(setup, method):
    """An EAGLE-3 draft (target block outputs fused, probability 0 outside a vocabulary of
    half the ids): the sampled second token still follows the target's distribution
    through the whole step, staged or tree, under the rejection rule."""
    from specjax.training import eagle3

    target, tables, marginal = setup
    vocab = np.sort(np.random.default_rng(3).choice(TINY_VOCAB, TINY_VOCAB // 2,
                                                    replace=False))
    config, params = eagle3.eagle3_draft_from_target(target.config, target.params, vocab,
                                                     (0, 1, 2))
    params["fc"] = (0.3 * np.random.default_rng(4).standard_normal(params["fc"].shape)
                    ).astype(np.float32)
    draft = specjax.Model.from_params(config, params, name="eagle3")
    options = STAGED if method == "staged" else dict(method="tree", tree_budget=6,
                                                    draft_depth=2, draft_width=2)
    counts = _second_tokens(target, tables if method == "staged" else None, draft=draft,
                            verify="rejection", **options)
    statistic, dof = _pooled_chi2(counts, marginal)
    assert statistic < chi2_threshold(dof), (method, statistic, dof)
    assert counts[np.setdiff1d(np.arange(TINY_VOCAB), vocab)].sum() > 0  # ids it never drafts


# A fixed tree drafted by the draft's argmax (draft_ranking="argmax"): its children are no
# sample of the draft, and the rejection rule treats them as deterministic.
KARY_ARGMAX = dict(method="tree", topology="kary", tree_budget=6, draft_depth=2,
                   draft_width=2, draft_ranking="argmax")


@pytest.mark.slow  # ~15-45 s (2,560 sampled steps); the rule's own tests are quick
def test_an_argmax_drafted_fixed_tree_samples_the_target_distribution(setup):
    target, _, marginal = setup
    counts = _second_tokens(target, None, draft=target, verify="rejection", **KARY_ARGMAX)
    statistic, dof = _pooled_chi2(counts, marginal)
    assert statistic < chi2_threshold(dof), (statistic, dof)


@pytest.mark.slow  # ~15 s: the control of the test above
def test_argmax_children_taken_for_a_sample_are_caught(setup, monkeypatch):
    """WRONG on purpose: the argmax-drafted children verified as a sample without
    replacement (the draft is the target, so its best child is always accepted)."""
    from specjax.methods.speculative import Speculative

    target, _, marginal = setup
    monkeypatch.setattr(Speculative, "children_mode",
                        property(lambda self: "without_replacement"))
    counts = _second_tokens(target, None, draft=target, verify="rejection", **KARY_ARGMAX)
    statistic, dof = _pooled_chi2(counts, marginal)
    assert statistic > chi2_threshold(dof), (statistic, dof)
