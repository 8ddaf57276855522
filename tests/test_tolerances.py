"""The tolerances of tests/tolerances.py: large enough for rounding, far too small for bugs."""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax.cache import advance, init_cache

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums, sum_tolerance, unit_roundoff


def test_the_formula_and_its_inputs():
    assert unit_roundoff(np.float32) == 2.0 ** -24
    assert sum_tolerance(longest_sum=64, stages=2, magnitude=1.0) == pytest.approx(
        4 * 2.0 ** -24 * 8 * 2)
    with pytest.raises(ValueError):
        sum_tolerance(longest_sum=0, stages=1, magnitude=1.0)


def test_a_tiny_pass_is_held_to_a_fraction_of_a_thousandth():
    _, model = tiny_pair("llama-gqa", seed=3)
    sums = forward_sums(model.config, 24)
    assert sum_tolerance(**sums, magnitude=1.0) < 1e-3


def _cached_logits(model, tokens, position_shift: int):
    cache = init_cache(model.config, 64)
    logits, cache = models.forward(model.params, model.config, tokens[:8], jnp.arange(8), cache)
    cache = advance(cache, 8)
    step, _ = models.forward(model.params, model.config, tokens[8:9],
                             jnp.arange(8, 9) + position_shift, cache)
    return np.concatenate([np.asarray(logits), np.asarray(step)])


@pytest.mark.parametrize("shift", [0, 1])
def test_a_position_off_by_one_is_caught(shift):
    """The cached-versus-uncached comparison at this tolerance passes for the right
    positions and fails for a decode step one position off (a real bug's size)."""
    _, model = tiny_pair("llama-gqa", seed=3)
    tokens = jnp.asarray(random_prompt(3, 9))
    full, _ = models.forward(model.params, model.config, tokens, jnp.arange(9))
    got = _cached_logits(model, tokens, shift)
    if shift == 0:
        assert_sums_close(got, full, **forward_sums(model.config, 9))
    else:
        with pytest.raises(AssertionError):
            assert_sums_close(got, full, **forward_sums(model.config, 9))
