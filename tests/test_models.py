"""Model-level invariants: parity with transformers, cached == uncached, jit/grad."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from specjax import models
from specjax.cache import advance, init_cache
from specjax.config import ModelConfig, gpt2, smollm2_135m
from specjax.errors import InvalidArgumentError

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

KINDS = ["llama-mha", "llama-gqa", "qwen2", "gpt2"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    hf_model, model = tiny_pair(kind, seed=1)
    tokens = random_prompt(1, 24)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].numpy()
    logits, _ = models.forward(model.params, model.config, jnp.asarray(tokens), jnp.arange(24))
    # torch and XLA order their fp32 sums differently: bounded by the pass's sums.
    assert_sums_close(logits, expected, **forward_sums(model.config, 24))


def test_llama3_rope_scaling_matches_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf_model, model = tiny_pair("llama-gqa", seed=2, rope_scaling=scaling)
    assert model.config.rope_scaling is not None
    tokens = random_prompt(2, 64)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].numpy()
    logits, _ = models.forward(model.params, model.config, jnp.asarray(tokens), jnp.arange(64))
    assert_sums_close(logits, expected, **forward_sums(model.config, 64))


@pytest.mark.parametrize("kind", ["llama-gqa", "gpt2"])
def test_cached_decode_equals_uncached_forward(kind):
    _, model = tiny_pair(kind, seed=3)
    tokens = jnp.asarray(random_prompt(3, 20))
    full, _ = models.forward(model.params, model.config, tokens, jnp.arange(20))
    cache = init_cache(model.config, 64)
    # 8-token prefill, then a 5-token chunk, then one token at a time.
    chunks = [(0, 8), (8, 13)] + [(i, i + 1) for i in range(13, 20)]
    got = []
    for start, end in chunks:
        logits, cache = models.forward(model.params, model.config, tokens[start:end],
                                       jnp.arange(start, end), cache)
        cache = advance(cache, end - start)
        got.append(logits)
    # The cached path sums attention blockwise (online softmax): fp32 rounding, not 0,
    # bounded by the pass's sums (it depends on the CPU's vector width and instruction set).
    assert_sums_close(np.concatenate(got), full, **forward_sums(model.config, 20))


def test_forward_is_differentiable_and_trains():
    _, model = tiny_pair("llama-gqa", seed=4)
    tokens = jnp.asarray(random_prompt(4, 33))

    def loss_fn(params):
        logits, _ = models.forward(params, model.config, tokens[:-1], jnp.arange(32))
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()

    opt = optax.adam(1e-2)
    params, state = model.params, opt.init(model.params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(20):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_vmap_over_a_batch_equals_single_calls():
    _, model = tiny_pair("gpt2", seed=5)
    batch = jnp.asarray([random_prompt(s, 12) for s in range(3)])
    fn = lambda t: models.forward(model.params, model.config, t, jnp.arange(12))[0]
    batched = jax.vmap(fn)(batch)
    for i in range(3):
        # A batched matmul may tile its sums differently from a single row's.
        assert_sums_close(batched[i], fn(batch[i]), **forward_sums(model.config, 12))


def test_presets_have_the_published_sizes():
    assert abs(models.num_params(gpt2("124m")) - 124.4e6) < 0.5e6
    assert abs(models.num_params(gpt2("1.5b")) - 1557.6e6) < 2e6
    assert abs(models.num_params(smollm2_135m()) - 134.5e6) < 0.5e6


def test_config_round_trips_through_hf_dict():
    from specjax.families import from_hf_config, to_hf_config
    for config in (gpt2("355m"), smollm2_135m()):
        assert from_hf_config(to_hf_config(config)) == config


def test_check_params_names_the_bad_leaf():
    from specjax.errors import CheckpointError
    _, model = tiny_pair("llama-gqa", seed=6)
    params = jax.tree.map(lambda a: a, model.params)
    params["layers"]["wq"] = params["layers"]["wq"][:, :, :-1]
    with pytest.raises(CheckpointError, match=r"wq.*shape"):
        models.check_params(model.config, params)
    del params["layers"]["wq"]
    with pytest.raises(CheckpointError, match="missing parameter.*wq"):
        models.check_params(model.config, params)


def test_bad_config_is_rejected():
    from specjax.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, num_layers=1,
                    num_heads=3, num_kv_heads=2, head_dim=4, intermediate_size=8,
                    max_position_embeddings=16)


def test_head_subset_scores_the_subset_and_floors_the_rest(tmp_path):
    from specjax.checkpoints_tools.hf import load_hf_directory, save_hf_directory

    target = tiny_pair("llama-mha", seed=4)[1]
    config, params = target.config, target.params
    subset = np.array([3, 1, 7, 7, 40])
    restricted = target.with_head_subset(subset)
    assert restricted.head_size == 4  # sorted, unique
    tokens = jnp.asarray(random_prompt(2, 6))
    full, _ = models.forward(params, config, tokens, jnp.arange(6))
    part, _ = models.forward(restricted.params, config, tokens, jnp.arange(6))
    keep = np.unique(subset)
    # Only the head's rows differ: the same sums, the head's matmul narrower.
    assert_sums_close(np.asarray(part)[:, keep], np.asarray(full)[:, keep],
                      **forward_sums(config, 6))
    rest = np.delete(np.asarray(part), keep, axis=1)
    np.testing.assert_array_equal(rest, np.asarray(part)[:, keep].min(1, keepdims=True)
                                  * np.ones_like(rest))
    # Restricting again starts from the full head; an HF export writes the full model.
    assert restricted.with_head_subset([5]).head_size == 1
    save_hf_directory(config, restricted.params, tmp_path / "hf")
    _, loaded = load_hf_directory(tmp_path / "hf")
    assert "head_subset" not in loaded
    with pytest.raises(InvalidArgumentError, match="head subset"):
        target.with_head_subset([config.vocab_size])
