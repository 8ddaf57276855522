"""Logit processing and Gumbel-coupled sampling against exact distributions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specjax import sampling
from specjax.errors import InvalidArgumentError
from specjax.sampling import (first_argmax, gumbel_noise, make_sampling_params,
                              perturbed_scores, sample_tokens, target_log_probs, top_k)

SAMPLES = 100_000
LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.9], np.float32)


def exact_distribution(logits, temperature, top_k=0, top_p=1.0):
    """Independent numpy statement of p~ (temperature, then top-k, then top-p)."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(z, bool)
    keep[order[: (top_k or len(z))]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    mass = 0.0
    nucleus = np.zeros_like(keep)
    for i in order:
        if not keep[i]:
            break
        nucleus[i] = True
        mass += p[i]
        if mass >= top_p:
            break
    p = np.where(nucleus, p, 0.0)
    return p / p.sum()


def empirical(temperature, top_k=0, top_p=1.0, position=7):
    """First-token frequencies over SAMPLES seeds at one position."""

    @jax.jit
    def draw(seed):
        params = make_sampling_params(temperature, top_k, top_p, 0).replace(seed=seed)
        return sample_tokens(jnp.asarray(LOGITS)[None], params, jnp.array([position]))[0]

    tokens = np.asarray(jax.vmap(draw)(jnp.arange(SAMPLES, dtype=jnp.uint32)))
    return np.bincount(tokens, minlength=len(LOGITS)) / SAMPLES


def tv(p, q):
    return 0.5 * np.abs(p - q).sum()


# With n = 1e5 samples over 8 outcomes E[TV] <= ~0.003. TV changes by at most 1/n per
# sample, so McDiarmid gives P(TV > E[TV] + 0.009) <= exp(-2 * 0.009**2 * n) < 1e-7: the
# false-alarm rate of each check. A 10% temperature error moves the distribution by > 0.02.
TV_BOUND = 0.012


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.9)])
def test_sampled_distribution_matches_processed_softmax(temperature, top_k, top_p):
    got = empirical(temperature, top_k, top_p)
    assert tv(got, exact_distribution(LOGITS, temperature, top_k, top_p)) < TV_BOUND


def test_the_same_test_rejects_a_wrong_temperature():
    got = empirical(1.0)
    assert tv(got, exact_distribution(LOGITS, 1.1)) > TV_BOUND
    assert tv(got, exact_distribution(LOGITS, 1.0, top_k=5)) > TV_BOUND


def test_target_log_probs_match_numpy_statement():
    for temperature, top_k, top_p in [(0.5, 0, 1.0), (1.0, 2, 1.0), (2.0, 0, 0.5), (1.0, 4, 0.7)]:
        lp = target_log_probs(jnp.asarray(LOGITS)[None],
                              make_sampling_params(temperature, top_k, top_p))[0]
        # fp32 probabilities (each <= 1) from a softmax over a few logits, against fp64:
        # a few units of 2**-24.
        np.testing.assert_allclose(np.exp(np.asarray(lp)),
                                   exact_distribution(LOGITS, temperature, top_k, top_p),
                                   atol=1e-6)


def documented_truncation(x, top_k, top_p):
    """The module docstring's top-k then top-p in float64, row by row; also whether a
    token's mass-above lies within 1e-5 of top_p (float32 may round either way there)."""
    out, near = np.full(x.shape, -np.inf, np.float32), False
    for r, z in enumerate(x.astype(np.float64)):
        keep = z >= (np.sort(z)[::-1][min(top_k, len(z)) - 1] if top_k else -np.inf)
        p = np.where(keep, np.exp(np.where(keep, z - z.max(), 0.0)), 0.0)
        p /= p.sum()
        if top_p < 1.0:
            above = np.array([p[z > v].sum() for v in z])
            near |= bool(np.any(np.abs(above[keep] - top_p) < 1e-5))
            keep &= above < top_p
        out[r] = np.where(keep, z, -np.inf)
    return out, near


_truncate_jitted = {branch: jax.jit(lambda x, k, p, branch=branch: sampling._truncate(
    x, k, p, branch=branch)) for branch in (True, False)}


@settings(max_examples=80, deadline=None)
@given(vocab=st.sampled_from([1, 7, 40]), levels=st.integers(1, 12),
       scale=st.sampled_from([0.1, 1.0, 4.0]), neg_inf=st.booleans(),
       top_k=st.integers(0, 45), top_p=st.one_of(st.just(1.0), st.floats(0.01, 0.999)),
       seed=st.integers(0, 2**16))
def test_truncation_keeps_exactly_the_documented_tokens(vocab, levels, scale, neg_inf, top_k,
                                                        top_p, seed):
    """Ties (few distinct levels) at both boundaries, -inf and -0.0 included; with and
    without the conditionals, the same tokens as the float64 statement."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(-levels, levels + 1, (3, vocab)) * scale).astype(np.float32)
    if neg_inf:
        x[rng.random(x.shape) < 0.3] = -np.inf
    x[:, 0] = np.maximum(x[:, 0], 0.0)  # one finite logit per row
    x[1, 0] = -0.0
    want, near = documented_truncation(x, top_k, top_p)
    assume(not near)
    for branch in (True, False):
        got = _truncate_jitted[branch](jnp.asarray(x), jnp.int32(top_k), jnp.float32(top_p))
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("logits,top_k,top_p,kept", [
    ([21.0, 15.0, 3.0, 0.0], 3, 1.0, 3),  # top-p off: the third token stays, tiny as it is
    ([1.5, 1.5] + [1.0] * 7 + [0.5] * 3, 3, 0.47, 9),  # top-p renormalises over top-k's ties
    ([2.0, 1.0] + [0.0] * 8, 2, 0.7, 1),  # 0.73 of top-k's mass is above the 2nd (0.41 of all)
])
def test_truncation_cases_a_sorted_prefix_got_wrong(logits, top_k, top_p, kept):
    """A sort-then-cumsum truncation dropped the 3rd token of the first row (its mass
    before rounds to 1.0) and renormalised the second over 3 tokens, not top-k's 9; the
    third row fails if top-p renormalises over the whole vocabulary."""
    x = jnp.asarray([logits], jnp.float32)
    for branch in (True, False):
        got = _truncate_jitted[branch](x, jnp.int32(top_k), jnp.float32(top_p))
        assert int(jnp.isfinite(got).sum()) == kept


@pytest.mark.parametrize("platform,rules", [("cpu", None), ("tpu", None),
                                            ("cuda", sampling.TRUNCATE)])
def test_truncation_neither_sorts_nor_loops_on_a_gpu(platform, rules):
    """No sort in any platform's truncation; a GPU program (static rules, no conditional)
    also has no loop: its searches are unrolled."""
    params = make_sampling_params(1.0, 40, 0.9).replace(rule=rules)
    logits = jax.ShapeDtypeStruct((16, 49152), jnp.float32)
    text = jax.jit(lambda x: target_log_probs(x, params)).trace(logits).lower(
        lowering_platforms=(platform,)).as_text()
    assert "sort" not in text
    assert ("stablehlo.while" in text) == (rules is None)


def test_greedy_is_argmax_and_ignores_the_seed():
    logits = jax.random.normal(jax.random.PRNGKey(0), (5, 50))
    for seed in (0, 1, 2):
        toks = sample_tokens(logits, make_sampling_params(0.0, seed=seed), jnp.arange(5))
        np.testing.assert_array_equal(toks, np.argmax(np.asarray(logits), -1))


def test_noise_depends_only_on_seed_and_position():
    a = gumbel_noise(jnp.uint32(3), jnp.array([5, 9, 5]), 20)
    np.testing.assert_array_equal(a[0], a[2])
    assert not np.allclose(a[0], a[1])
    b = gumbel_noise(jnp.uint32(4), jnp.array([5]), 20)
    assert not np.allclose(a[0], b[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(seed=-1), "seed")])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_sampling_params(**kwargs)


_top_k_jitted = jax.jit(top_k, static_argnums=1)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 40), k=st.integers(1, 6),
       levels=st.integers(1, 5), neg_inf=st.booleans(), seed=st.integers(0, 2**16))
def test_top_k_matches_lax_top_k(rows, vocab, k, levels, neg_inf, seed):
    """Same values and indices as lax.top_k, ties (few distinct levels) and -inf included."""
    k = min(k, vocab)
    x = np.random.default_rng(seed).integers(0, levels, (rows, vocab)).astype(np.float32)
    if neg_inf:
        x[:, ::2] = -np.inf
    want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
    values, index = _top_k_jitted(jnp.asarray(x), k)  # one compile, not one per operation
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


@pytest.mark.parametrize("platform,native", [("cpu", False), ("cuda", True), ("tpu", True)])
def test_top_k_lowers_to_passes_on_the_cpu_and_to_one_top_k_elsewhere(platform, native):
    """The platform is the lowering's, not the host's: a program compiled ahead of time for
    a GPU or TPU on this CPU gets one top-k operation (a GPU runs ~5 launches per pass
    otherwise); the CPU's gets the passes (its top-k is a full sort) and no sort."""
    x = jax.ShapeDtypeStruct((4, 49152), jnp.float32)
    text = jax.jit(lambda x: top_k(x, 3)).trace(x).lower(
        lowering_platforms=(platform,)).as_text()
    assert ("top_k" in text) == native
    assert "sort" not in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf]), min_size=1,
                         max_size=9), min_size=1, max_size=4).filter(
                             lambda rows: len({len(r) for r in rows}) == 1))
def test_first_argmax_is_numpy_argmax_with_the_lowest_index_on_ties(rows):
    # Both lowerings: the CPU's (max, then the lowest index reaching it) and the one GPU
    # and TPU programs take (the variadic argmax reduction).
    x = np.asarray(rows, np.float32)  # few distinct values: ties and infinities are common
    for argmax in (first_argmax, sampling._first_argmax_by_max, sampling._first_argmax_variadic):
        got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32 and np.array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("platform, variadic", [("cpu", False), ("cuda", True), ("tpu", True)])
def test_first_argmax_lowering_per_platform(platform, variadic):
    # An argmax reduces (value, index) pairs in one reduction; the CPU's form has two.
    x = jax.ShapeDtypeStruct((4, 49152), jnp.float32)
    text = jax.jit(first_argmax).trace(x).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("stablehlo.reduce") == (1 if variadic else 2)


def test_sample_tokens_is_the_argmax_of_log_p_plus_the_position_noise():
    """The unnormalised shortcut picks the token the definition picks (temperature, top-k
    and top-p included); a shortcut that dropped the temperature or the truncation fails."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (16, 300)) * 3.0
    positions = jnp.arange(16) + 40
    # Jitted once each (the settings are traced), rather than compiled operation by operation.
    definition = jax.jit(lambda x, params, positions: jnp.argmax(perturbed_scores(
        target_log_probs(x, params), params, positions), axis=-1))
    shortcut = jax.jit(sample_tokens)
    for temperature, k, p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.3, 0, 1.0), (2.5, 0, 1.0),
                              (1.0, 5, 1.0), (1.0, 0, 0.6), (0.8, 20, 0.9)):
        params = make_sampling_params(temperature, k, p, seed=11)
        assert np.array_equal(np.asarray(shortcut(logits, params, positions)),
                              np.asarray(definition(logits, params, positions))), \
            (temperature, k, p)
