"""Acceptance rules: host-walk parity, verdict invariants, and exact output distributions.

The distribution tests use a synthetic Markov "model" over a tiny vocabulary: the target's
distribution after token ``a`` is ``P[a]`` and the draft's is ``Q[a]`` (V x V tables). A
drafter builds a depth-2 tree (W children per node, sampled the way the rule assumes),
the rule verifies it, and the first two emitted tokens are recorded. When a step emits a
single token, the second one comes from a second step rooted at it (same drafter, same
rule), exactly as decoding proceeds. Over 10**5 fixed keys the joint histogram of
``(x1, x2)`` is compared with ``P[s, x1] * P[x1, x2]`` by a chi-square test at a false-alarm
rate of 1e-6 (threshold from the Wilson-Hilferty approximation of the chi-square
quantile); cells of zero target mass must stay empty. A deliberately biased rule must
fail the same test.
"""

from __future__ import annotations

import functools
import itertools
import math
from statistics import NormalDist

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from specjax import sampling
from specjax import tree as tree_lib
from specjax import verify
from specjax.errors import InvalidArgumentError

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True)
NUM_SAMPLES = 100_000
FALSE_ALARM = 1e-6
PAD_SIZE = 10  # random trees are padded to this many nodes so each rule compiles once
SMALL_VOCAB = 3  # small so that drafted tokens often match


def chi2_threshold(dof: int, alpha: float = FALSE_ALARM) -> float:
    """Upper ``alpha`` quantile of chi-square(dof) (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1.0 - alpha)
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over cells of positive mass; asserts zero-mass cells are empty."""
    counts, probs = counts.ravel(), probs.ravel()
    support = probs > 0
    assert counts[~support].sum() == 0, "tokens emitted outside the target's support"
    expected = counts.sum() * probs[support]
    assert expected.min() >= 5, "test tables too skewed for a chi-square test"
    return float(np.sum((counts[support] - expected) ** 2 / expected)), int(support.sum()) - 1


# --------------------------------------------------------------------------------------
# Random trees (host) and a brute-force walk.
# --------------------------------------------------------------------------------------


@st.composite
def padded_trees(draw, vocab=SMALL_VOCAB):
    """A random tree of 1..PAD_SIZE real nodes padded to PAD_SIZE with invalid nodes."""
    size = draw(st.integers(1, PAD_SIZE))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, PAD_SIZE)]
    flags = [True] + draw(st.lists(st.booleans(), min_size=PAD_SIZE - 1, max_size=PAD_SIZE - 1))
    valid = [True]
    for i in range(1, PAD_SIZE):
        valid.append(i < size and (flags[i] or i % 3 == 0) and valid[parents[i]])
    parents = [p if (i == 0 or i < size) else 0 for i, p in enumerate(parents)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=PAD_SIZE, max_size=PAD_SIZE))
    seed = draw(st.integers(0, 2**31 - 1))
    return (np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(valid, bool),
            seed)


def host_walk(tokens, parents, valid, choice, width=None):
    """Follows the lowest-index valid child whose token is the choice at its parent
    (among the first ``width`` valid children when a width is given)."""
    path, node = [0], 0
    while True:
        kids = [j for j in range(1, len(parents)) if valid[j] and parents[j] == node][:width]
        kids = [j for j in kids if tokens[j] == choice[node]]
        if not kids:
            return path, int(choice[node])
        node = kids[0]
        path.append(node)


def check_verdict(tokens, parents, valid, path, count, next_token, target_logp=None):
    """Verdict invariants: a root-to-node path of valid nodes, zeros past count."""
    count = int(count)
    assert 1 <= count <= len(path)
    assert path[0] == 0
    for k in range(1, count):
        assert valid[path[k]] and parents[path[k]] == path[k - 1]
    assert not np.any(path[count:])
    if target_logp is not None:
        assert np.isfinite(target_logp[path[count - 1], next_token])


MAX_DEPTH = PAD_SIZE - 1


@jax.jit
def _greedy(tokens, parents, valid, scores):
    tree = tree_lib.Tree(tokens=tokens, parents=parents, valid=valid)
    return verify.verify_greedy_or_coupled(tree, scores, MAX_DEPTH)


@SETTINGS
@given(padded_trees())
def test_greedy_walk_matches_host_walk(case):
    tokens, parents, valid, seed = case
    scores = np.random.default_rng(seed).normal(size=(PAD_SIZE, SMALL_VOCAB)).astype(np.float32)
    verdict = _greedy(tokens, parents, valid, scores)
    path, next_token = host_walk(tokens, parents, valid, scores.argmax(-1))
    assert int(verdict.count) == len(path)
    np.testing.assert_array_equal(np.asarray(verdict.path)[: len(path)], path)
    assert int(verdict.next_token) == next_token
    check_verdict(tokens, parents, valid, np.asarray(verdict.path), verdict.count, next_token)
    emitted = np.asarray(verify.emitted_tokens(tree_lib.Tree(tokens, parents, valid), verdict))
    np.testing.assert_array_equal(emitted[: len(path)], [tokens[j] for j in path[1:]] + [next_token])
    assert not emitted[len(path):].any()


def test_duplicate_siblings_follow_the_lower_index():
    # nodes 1 and 2 both carry token 1; only node 2 has a (matching) child
    tree = tree_lib.Tree(tokens=jnp.array([0, 1, 1, 2], jnp.int32),
                         parents=jnp.array([-1, 0, 0, 2], jnp.int32), valid=jnp.ones(4, bool))
    scores = jax.nn.one_hot(jnp.array([1, 0, 2, 3]), 4)  # argmax after each node
    verdict = verify.verify_greedy_or_coupled(tree, scores, 2)
    np.testing.assert_array_equal(np.asarray(verdict.path), [0, 1, 0])
    assert int(verdict.count) == 2 and int(verdict.next_token) == 0
    # with node 1 invalid the walk goes through node 2 to its child
    verdict = verify.verify_greedy_or_coupled(tree.replace(valid=jnp.array([1, 0, 1, 1], bool)),
                                              scores, 2)
    np.testing.assert_array_equal(np.asarray(verdict.path), [0, 2, 3])
    assert int(verdict.count) == 3 and int(verdict.next_token) == 3


@functools.partial(jax.jit, static_argnames=("width",))
def _all_rules(tokens, parents, valid, target_logp, draft_logp, key, width):
    tree = tree_lib.Tree(tokens=tokens, parents=parents, valid=valid)
    keys = jax.random.split(key, 4)
    out = {"match": verify.verify_match(tree, target_logp, keys[0], MAX_DEPTH)}
    for mode, k in zip(verify.CHILDREN_MODES, keys[1:]):
        out[mode] = verify.verify_rejection(tree, target_logp, draft_logp, k, MAX_DEPTH, width, mode)
    return out


RULES_WIDTH = 4  # below the widest random trees, so truncation is exercised too
_top2_log_probs = jax.jit(lambda logits: sampling.target_log_probs(
    logits, sampling.make_sampling_params(temperature=1.0, top_k=2)))


@SETTINGS
@given(padded_trees(), st.booleans())
def test_verdict_invariants_and_greedy_limit(case, one_hot):
    """Every rule returns a well-formed verdict; at temperature 0 all equal the greedy walk."""
    tokens, parents, valid, seed = case
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(PAD_SIZE, SMALL_VOCAB)).astype(np.float32)
    if one_hot:
        target_logp = np.where(np.eye(SMALL_VOCAB, dtype=bool)[logits.argmax(-1)], 0.0, -np.inf)
    else:  # masked tokens exercise the support check
        target_logp = np.asarray(_top2_log_probs(logits))
    draft_logits = rng.normal(size=(PAD_SIZE, SMALL_VOCAB))
    draft_logp = (draft_logits - np.log(np.exp(draft_logits).sum(-1, keepdims=True))).astype(np.float32)
    verdicts = _all_rules(tokens, parents, valid, target_logp.astype(np.float32), draft_logp,
                          jax.random.PRNGKey(seed), width=RULES_WIDTH)
    choice = logits.argmax(-1)
    for name, verdict in verdicts.items():
        # sample-then-match sees every child; the rejection walks the first RULES_WIDTH
        expected_path, expected_next = host_walk(tokens, parents, valid, choice,
                                                 None if name == "match" else RULES_WIDTH)
        path, count, next_token = np.asarray(verdict.path), int(verdict.count), int(verdict.next_token)
        check_verdict(tokens, parents, valid, path, count, next_token, target_logp)
        if one_hot:
            assert list(path[:count]) == expected_path, name
            assert next_token == expected_next, name


def test_coupled_walk_reproduces_autoregressive_sampling():
    """With shared per-position Gumbel noise, any tree yields the autoregressive tokens."""
    vocab, size, offset = 4, 12, 37
    rng = np.random.default_rng(0)
    table = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(vocab, vocab)) * 1.5, jnp.float32), -1)
    parents = tree_lib.kary_parents(2, 3, size)
    node_depths = tree_lib.depths(parents)
    node_positions = tree_lib.positions(node_depths, offset)

    @jax.vmap
    def one(seed, tokens):
        tree = tree_lib.Tree(tokens=tokens, parents=jnp.asarray(parents), valid=jnp.ones(size, bool))
        scores = table[tokens] + sampling.gumbel_noise(seed, node_positions, vocab)
        verdict = verify.verify_greedy_or_coupled(tree, scores, 3)
        # autoregressive coupled sampling from the root token
        noise = sampling.gumbel_noise(seed, offset + jnp.arange(4), vocab)
        token, reference = tokens[0], []
        for step in range(4):
            token = jnp.argmax(table[token] + noise[step]).astype(jnp.int32)
            reference.append(token)
        return verify.emitted_tokens(tree, verdict), verdict.count, jnp.stack(reference)

    seeds = jnp.arange(2000, dtype=jnp.uint32)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(2000, size)), jnp.int32)
    emitted, count, reference = (np.asarray(a) for a in jax.jit(one)(seeds, tokens))
    slots = np.arange(4)[None, :] < count[:, None]
    np.testing.assert_array_equal(np.where(slots, emitted, -1), np.where(slots, reference, -1))
    assert (count > 1).mean() > 0.2  # the trees were actually accepted into, not just skipped


# --------------------------------------------------------------------------------------
# Distribution tests on a two-step synthetic model.
# --------------------------------------------------------------------------------------

VOCAB = 5
START = 0


def _tables(seed, vocab, spread):
    rng = np.random.default_rng(seed)
    target_logits = rng.normal(size=(vocab, vocab))
    draft_logits = target_logits + spread * rng.normal(size=(vocab, vocab))
    return target_logits.astype(np.float32), draft_logits.astype(np.float32)


TARGET_LOGITS, DRAFT_LOGITS = _tables(1, VOCAB, 1.0)
LOG_P = np.asarray(jax.nn.log_softmax(TARGET_LOGITS, -1))
LOG_Q = np.asarray(jax.nn.log_softmax(DRAFT_LOGITS, -1))


def draft_tree(keys, root, log_q, width, mode):
    """A depth-2 tree: ``width`` children of the root, ``width`` children of each.

    ``keys``: [width + 1] PRNG keys, one per expanded node (split outside the compiled
    program: every random-number site costs compile time on CPU).
    """
    level1 = verify.sample_draft_children(keys[0], log_q[root], width, mode)
    level2 = jax.vmap(lambda k, t: verify.sample_draft_children(k, log_q[t], width, mode))(
        keys[1:], level1)
    tokens = jnp.concatenate([jnp.reshape(root, (1,)), level1, level2.reshape(-1)]).astype(jnp.int32)
    parents = jnp.asarray(tree_lib.kary_parents(width, 2))
    return tree_lib.Tree(tokens=tokens, parents=parents, valid=jnp.ones(tokens.shape, bool))


def rejection_rule(mode, width):
    return lambda tree, target_logp, draft_logp, key: verify.verify_rejection(
        tree, target_logp, draft_logp, key, max_depth=2, width=width, children_mode=mode)


def match_rule(tree, target_logp, draft_logp, key):
    del draft_logp
    return verify.verify_match(tree, target_logp, key, max_depth=2)


def _biased_rule(tree, target_logp, draft_logp, key):
    """WRONG on purpose: used on top-W (argmax) drafts, it accepts with min(1, p/q) as if
    the children had been sampled from q."""
    return verify.verify_rejection(tree, target_logp, draft_logp, key, max_depth=2,
                                   width=3, children_mode="with_replacement")


@functools.partial(jax.jit, static_argnames=("rule", "draft_mode", "width"))
def _decode_steps(keys, roots, log_p, log_q, rule, draft_mode, width):
    """One speculative step per root; ``keys``: [n, width + 2] (drafting, then verifying)."""

    def one(step_keys, root):
        tree = draft_tree(step_keys[:-1], root, log_q, width, draft_mode)
        verdict = rule(tree, log_p[tree.tokens], log_q[tree.tokens], step_keys[-1])
        return verify.emitted_tokens(tree, verdict), verdict

    return jax.vmap(one)(keys, roots)


def simulate(rule, draft_mode, width, log_p=LOG_P, log_q=LOG_Q, base_seed=1234):
    """Decodes two tokens per key; returns (x1, x2, first-step count, first-step path).

    A second step rooted at x1 supplies x2 wherever the first step emitted one token.
    """
    log_p, log_q = jnp.asarray(log_p, jnp.float32), jnp.asarray(log_q, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(base_seed), (2, NUM_SAMPLES, width + 2))
    roots = jnp.full((NUM_SAMPLES,), START, jnp.int32)
    emitted, verdict = _decode_steps(keys[0], roots, log_p, log_q, rule, draft_mode, width)
    emitted2, _ = _decode_steps(keys[1], emitted[:, 0], log_p, log_q, rule, draft_mode, width)
    second = jnp.where(verdict.count >= 2, emitted[:, 1], emitted2[:, 0])
    return tuple(np.asarray(a) for a in (emitted[:, 0], second, verdict.count, verdict.path))


def joint_statistic(x1, x2, log_p, vocab):
    counts = np.bincount(x1 * vocab + x2, minlength=vocab * vocab).reshape(vocab, vocab)
    p = np.exp(np.asarray(log_p, np.float64))
    exact = p[START][:, None] * p
    return chi2_statistic(counts, exact)


def exact_first_acceptance(p, q, width, mode):
    """P(some root child is accepted), by enumerating the drafted children (host)."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if mode == "deterministic":
        return float(p[np.argsort(-q, kind="stable")[:width]].sum())
    total = 0.0
    for children in itertools.product(range(len(p)), repeat=width):
        r, proposal, chance, none_accepted = p.copy(), q.copy(), 1.0, 1.0
        for x in children:
            chance *= proposal[x]
            accept = min(1.0, r[x] / proposal[x]) if proposal[x] > 0 else 0.0
            none_accepted *= 1.0 - accept
            if accept < 1.0:
                rest = np.maximum(r - proposal, 0.0)
                r = rest / rest.sum() if rest.sum() > 0 else p
            if mode == "without_replacement":
                proposal = proposal.copy()
                proposal[x] = 0.0
                proposal = proposal / proposal.sum() if proposal.sum() > 0 else proposal
        total += chance * (1.0 - none_accepted)
    return total


CASES = {
    "leviathan_chain": (rejection_rule("with_replacement", 1), "with_replacement", 1),
    "with_replacement_w3": (rejection_rule("with_replacement", 3), "with_replacement", 3),
    "without_replacement_w3": (rejection_rule("without_replacement", 3), "without_replacement", 3),
    "deterministic_top3": (rejection_rule("deterministic", 3), "deterministic", 3),
    "match_sampled_w3": (match_rule, "with_replacement", 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_reproduces_target_distribution(name):
    rule, draft_mode, width = CASES[name]
    x1, x2, count, path = simulate(rule, draft_mode, width)
    statistic, dof = joint_statistic(x1, x2, LOG_P, VOCAB)
    assert statistic < chi2_threshold(dof), (name, statistic, chi2_threshold(dof))

    # every branch was exercised: stop at the root, after depth 1, and at a leaf
    for accepted in (1, 2, 3):
        assert (count == accepted).mean() > 0.02, (name, accepted)
    # verdict invariants on the k-ary tree (parent of i is (i - 1) // width)
    slots = np.arange(3)[None, :]
    assert (path[:, 0] == 0).all() and not path[slots >= count[:, None]].any()
    deep = count == 3
    assert ((path[deep, 2] - 1) // width == path[deep, 1]).all()
    assert ((path[count >= 2, 1] >= 1) & (path[count >= 2, 1] <= width)).all()

    # efficiency: the rule accepts as often as the algorithm says, not just exactly
    if name != "match_sampled_w3":
        p, q = np.exp(LOG_P[START]), np.exp(LOG_Q[START])
        expected = exact_first_acceptance(p, q, width, draft_mode)
        tolerance = 6 * math.sqrt(expected * (1 - expected) / NUM_SAMPLES)
        assert abs((count >= 2).mean() - expected) < tolerance, (name, (count >= 2).mean(), expected)


@pytest.mark.parametrize("mode", ["without_replacement", "deterministic"])
def test_processed_target_distribution(mode):
    """p~ after temperature + top-k (zero-mass tokens must never be emitted)."""
    vocab = 6
    target_logits, draft_logits = _tables(2, vocab, 0.7)
    log_p = sampling.target_log_probs(
        jnp.asarray(target_logits), sampling.make_sampling_params(temperature=0.7, top_k=3))
    log_q = sampling.target_log_probs(
        jnp.asarray(draft_logits), sampling.make_sampling_params(temperature=1.3, top_p=0.95))
    assert np.isinf(np.asarray(log_p)).sum() == vocab * 3
    x1, x2, count, _ = simulate(rejection_rule(mode, 3), mode, 3, log_p, log_q)
    counts = np.bincount(x1 * vocab + x2, minlength=vocab * vocab).reshape(vocab, vocab)
    p = np.exp(np.asarray(log_p, np.float64))
    statistic, dof = chi2_statistic(counts, p[START][:, None] * p)
    assert statistic < chi2_threshold(dof), (mode, statistic, chi2_threshold(dof))
    assert (count == 3).mean() > 0.02


WRONG_RULES = {
    # top-W (argmax) drafts accepted with min(1, p/q) as if sampled
    "argmax_drafts_as_sampled": (_biased_rule, "deterministic"),
    # drafts sampled without replacement verified as if i.i.d. (q never loses x)
    "without_replacement_as_iid": (rejection_rule("with_replacement", 3), "without_replacement"),
}


@pytest.mark.parametrize("name", list(WRONG_RULES))
def test_biased_rule_is_caught(name):
    """The same distribution test rejects rules that are subtly or grossly wrong."""
    rule, draft_mode = WRONG_RULES[name]
    x1, x2, _, _ = simulate(rule, draft_mode, 3)
    statistic, dof = joint_statistic(x1, x2, LOG_P, VOCAB)
    assert statistic > chi2_threshold(dof), (name, statistic, chi2_threshold(dof))


def test_lone_root_is_plain_sampling():
    """Budget 1 (no drafted nodes, width 0) is one autoregressive sample from p~."""
    tree = tree_lib.Tree(tokens=jnp.array([START], jnp.int32), parents=jnp.array([-1], jnp.int32),
                         valid=jnp.ones(1, bool))
    log_p = jnp.asarray(LOG_P[START:START + 1])

    @jax.vmap
    def one(key):
        first, second = jax.random.split(key)
        a = verify.verify_rejection(tree, log_p, log_p, first, 0, 0, "with_replacement")
        b = verify.verify_match(tree, log_p, second, 0)
        return jnp.stack([a.count, b.count]), jnp.stack([a.next_token, b.next_token])

    counts, tokens = (np.asarray(a) for a in jax.jit(one)(
        jax.random.split(jax.random.PRNGKey(5), NUM_SAMPLES)))
    assert (counts == 1).all()
    for column in tokens.T:
        statistic, dof = chi2_statistic(np.bincount(column, minlength=VOCAB), np.exp(LOG_P[START]))
        assert statistic < chi2_threshold(dof)


# --------------------------------------------------------------------------------------
# Numerics and errors.
# --------------------------------------------------------------------------------------


def test_zero_mass_residual_falls_back_and_never_nans():
    p = jnp.array([0.25, 0.25, 0.5, 0.0])
    # Four probabilities renormalised in fp32: one rounding of values <= 1 (2**-24 each).
    np.testing.assert_allclose(verify._residual(p, p, p), p, atol=1e-7)
    np.testing.assert_allclose(verify._residual(p, jnp.array([0.5, 0.5, 0.0, 0.0]), p),
                               [0.0, 0.0, 1.0, 0.0], atol=1e-7)
    # draft == target: every child accepted, the bonus from p at the leaf, never NaN
    log_p = jnp.log(jnp.array([[0.2, 0.3, 0.5, 0.0]] * 3))
    tree = tree_lib.Tree(tokens=jnp.array([0, 2, 1], jnp.int32),
                         parents=jnp.asarray(tree_lib.chain_parents(3)), valid=jnp.ones(3, bool))
    run = jax.jit(jax.vmap(lambda k: verify.verify_rejection(tree, log_p, log_p, k, 2, 1,
                                                             "with_replacement")))
    verdicts = run(jax.random.split(jax.random.PRNGKey(3), 2000))
    assert (np.asarray(verdicts.count) == 3).all()
    assert set(np.unique(np.asarray(verdicts.next_token))) <= {0, 1, 2}


def test_rejection_argument_errors():
    tree = tree_lib.Tree(tokens=jnp.zeros(2, jnp.int32), parents=jnp.array([-1, 0]),
                         valid=jnp.ones(2, bool))
    logp = jnp.zeros((2, 3))
    with pytest.raises(InvalidArgumentError):
        verify.verify_rejection(tree, logp, logp, jax.random.PRNGKey(0), 1, 1, "sideways")
    with pytest.raises(InvalidArgumentError):
        verify.verify_rejection(tree, logp, None, jax.random.PRNGKey(0), 1, 1, "with_replacement")
    with pytest.raises(InvalidArgumentError):
        verify.sample_draft_children(jax.random.PRNGKey(0), logp[0], 2, "sideways")
    verdict = verify.verify_rejection(tree, logp, None, jax.random.PRNGKey(0), 1, 1, "deterministic")
    assert int(verdict.count) in (1, 2)


# --------------------------------------------------------------------------------------
# A reduced-vocabulary draft (an EAGLE-3 draft's own head: probability 0 outside it).
# --------------------------------------------------------------------------------------

DRAFT_VOCAB = np.array([0, 2, 3])  # the draft never proposes ids 1 and 4
LOG_Q_REDUCED = np.asarray(jax.nn.log_softmax(
    np.where(np.isin(np.arange(VOCAB), DRAFT_VOCAB), DRAFT_LOGITS, -np.inf), -1))


def _restricted_target_rule(tree, target_logp, draft_logp, key):
    """WRONG on purpose: verifies against the target renormalised over the draft's
    vocabulary (a bug a reduced head invites: the target's own ids outside it vanish)."""
    inside = np.isin(np.arange(VOCAB), DRAFT_VOCAB)
    restricted = jax.nn.log_softmax(jnp.where(inside, target_logp, -jnp.inf), axis=-1)
    return verify.verify_rejection(tree, restricted, draft_logp, key, max_depth=2, width=3,
                                   children_mode="without_replacement")


@pytest.mark.parametrize("name", list(CASES))
def test_a_reduced_vocabulary_draft_keeps_the_target_distribution(name):
    """Every rule stays exact with a draft whose probability is 0 outside its vocabulary:
    the target's tokens outside it are emitted as often as the target says (through the
    residual and the bonus token), and the rules accept as often as the algorithm says."""
    rule, draft_mode, width = CASES[name]
    assert np.isneginf(LOG_Q_REDUCED[:, [1, 4]]).all()
    x1, x2, count, _ = simulate(rule, draft_mode, width, log_q=LOG_Q_REDUCED)
    statistic, dof = joint_statistic(x1, x2, LOG_P, VOCAB)
    assert statistic < chi2_threshold(dof), (name, statistic, chi2_threshold(dof))
    assert (count == 3).mean() > 0.02, name
    if name != "match_sampled_w3":
        p, q = np.exp(LOG_P[START]), np.exp(LOG_Q_REDUCED[START])
        expected = exact_first_acceptance(p, q, width, draft_mode)
        tolerance = 6 * math.sqrt(expected * (1 - expected) / NUM_SAMPLES)
        assert abs((count >= 2).mean() - expected) < tolerance, (name, (count >= 2).mean(),
                                                                 expected)


def test_a_rule_that_drops_the_targets_ids_outside_the_draft_vocabulary_is_caught():
    x1, x2, _, _ = simulate(_restricted_target_rule, "without_replacement", 3,
                            log_q=LOG_Q_REDUCED)
    statistic, dof = joint_statistic(x1, x2, LOG_P, VOCAB)
    assert statistic > chi2_threshold(dof), (statistic, chi2_threshold(dof))
