"""Feature drafts (EAGLE-style): exactness, the features a draft reads, training, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax
from specjax import api, decode, models
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families import to_hf_config
from specjax.training import feature_draft as fd

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

NEW = 24
SHAPES = {
    "chain": dict(method="spec", draft_depth=3),
    "dynamic": dict(method="tree", tree_budget=8, draft_depth=3, draft_width=2),
    "kary": dict(method="tree", topology="kary", tree_budget=7, draft_depth=2, draft_width=2),
}


def feature_draft(target, seed: int, init_layers=(0,)) -> specjax.Model:
    """A feature draft from the target's blocks ``init_layers`` with a random ``fc``."""
    config, params = fd.feature_draft_from_target(target.config, target.params, init_layers)
    fc = 0.3 * np.random.default_rng(seed).standard_normal(params["fc"].shape)
    params = dict(params, fc=fc.astype(np.float32))
    return specjax.Model.from_params(config, params, name=f"feature-{seed}")


@pytest.fixture(scope="module")
def target():
    return tiny_pair("llama-gqa", seed=31)[1]


@pytest.fixture(scope="module")
def one_layer_target():
    return tiny_pair("llama-gqa", seed=32, num_hidden_layers=1)[1]


# The fixed topology runs in make test-all (the dynamic tree and the chain cover the rest).
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow) if s == "kary" else s
                                   for s in SHAPES])
def test_greedy_and_coupled_equal_ar(target, shape):
    draft = feature_draft(target, seed=1)
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        prompt = random_prompt(seed, 7 + 5 * seed)
        expected = specjax.generate(target, prompt, max_new_tokens=NEW, temperature=temperature,
                                    seed=seed).tokens
        out = specjax.generate(target, prompt, max_new_tokens=NEW, temperature=temperature,
                               seed=seed, draft=draft, **SHAPES[shape])
        assert out.tokens == expected, (shape, temperature)


def _final_state(target, draft, prompt, method, **options):
    request = api._prepare(target, prompt, api.request(
        method=method, max_new_tokens=NEW, draft=draft, **options))
    return decode.run_program(request.args[0], request.loop, *request.args[1:])[0]


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_kept_features_are_the_targets_at_every_committed_position(target, shape):
    """The kept features (``state.method_state.features``) after generation equal the
    target's features of the whole sequence by teacher forcing, at every position the
    target ran (all but the pending token): the prefill's and each accepted path's,
    written at the right offset."""
    draft = feature_draft(target, seed=2)
    prompt = random_prompt(3, 9)
    state = _final_state(target, draft, prompt, **SHAPES[shape])
    length = int(state.length)
    tokens = jnp.asarray(state.tokens[: length - 1])
    expected, _ = models.hidden_states(target.params, target.config, tokens,
                                       jnp.arange(length - 1, dtype=jnp.int32))
    # The decode's passes (prefill, tree passes through the cache) against one forward,
    # summed in other orders (tests/tolerances.py).
    assert_sums_close(state.method_state.features[: length - 1], expected,
                      **forward_sums(target.config, length))
    assert int(state.target_calls) < NEW  # some drafted tokens were accepted on the way


def test_a_position_reads_the_previous_positions_feature(target):
    """Decoding and training agree on what position ``t`` reads: the target's feature at
    ``t - 1``, zeros at ``t = 0``."""
    from types import SimpleNamespace

    from specjax.drafters.model import previous_features

    features = jnp.arange(10 * 4, dtype=jnp.float32).reshape(10, 4) + 1
    positions = jnp.asarray([0, 1, 5, 9], jnp.int32)
    draft_config = dataclasses.replace(target.config, feature_input=True)
    read = previous_features({}, draft_config, SimpleNamespace(features=features), positions)
    np.testing.assert_array_equal(read, np.stack([np.zeros(4), features[0], features[4],
                                                  features[8]]))
    shifted = fd.shift_features(features[None])[0]
    np.testing.assert_array_equal(read[1:], shifted[positions[1:]])
    assert previous_features({}, target.config, SimpleNamespace(features=None),
                             positions) is None


def test_a_draft_that_predicts_the_targets_features_is_always_accepted(one_layer_target):
    """A one-block target's own block as a feature draft with ``fc = [I; 0]`` computes
    exactly the target's features, so at temperature 0 every drafted node on the target's
    path is accepted: full-depth acceptance checks the tree passes, scratch masks and the
    commit of a feature draft."""
    target = one_layer_target
    config, params = fd.feature_draft_from_target(target.config, target.params, (0,))
    draft = specjax.Model.from_params(config, params, name="oracle")
    prompt = random_prompt(4, 8)
    for shape, depth in (("chain", 3), ("dynamic", 3)):
        out = specjax.generate(target, prompt, max_new_tokens=NEW, draft=draft, **SHAPES[shape])
        steps = np.asarray(out.stats["accepted_histogram"])
        assert out.tokens == specjax.generate(target, prompt, max_new_tokens=NEW).tokens
        assert steps[:-1].sum() <= 1, (shape, steps)  # only the step cut by max_new_tokens
        assert steps[depth] >= 1


def test_batch_rows_equal_their_batch_1_outputs(target):
    draft = feature_draft(target, seed=5)
    prompts = [random_prompt(s, 5 + 3 * s) for s in range(2)]
    outs = specjax.generate(target, prompts, max_new_tokens=12, draft=draft, **SHAPES["dynamic"])
    for prompt, out in zip(prompts, outs):
        single = specjax.generate(target, prompt, max_new_tokens=12, draft=draft,
                                  **SHAPES["dynamic"])
        assert out.tokens == single.tokens


def _train(target, steps: int, seed: int = 0):
    """A feature draft trained on fresh random windows each step; returns its params."""
    config, params = fd.feature_draft_from_target(target.config, target.params, (0,))
    trainable, frozen = fd.split_feature_trainable(jax.tree.map(jnp.asarray, params))
    rows = fd.head_rows(frozen, config, None)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(trainable)
    train_step, _ = fd.make_feature_steps(config, fd.FeatureLossConfig(unroll=2), optimizer)
    features = jax.jit(lambda w: fd.target_features(target.params, target.config, w))
    rng, key = np.random.default_rng(seed), jax.random.PRNGKey(seed)
    for _ in range(steps):
        windows = jnp.asarray(rng.integers(0, target.config.vocab_size, (16, 32)), jnp.int32)
        key, sub = jax.random.split(key)
        trainable, opt_state, _, _ = train_step(trainable, opt_state, frozen, windows,
                                                features(windows), rows, sub)
    return config, {**trainable, **frozen}, rows


def test_training_brings_the_draft_closer_to_the_target(target):
    """On the target's own held-out text, a trained feature draft is closer to the target
    (KL and top-1 agreement, at depth 1 and at depth 2, where it reads its own
    predictions) than the untrained one, and what it predicts depends on the features it
    reads (training moved the feature half of ``fc`` off zero)."""
    held = jnp.asarray([random_prompt(s, 6) + specjax.generate(
        target, random_prompt(s, 6), max_new_tokens=26).tokens for s in range(7, 13)],
        jnp.int32)
    held_features = fd.target_features(target.params, target.config, held)
    config, params, rows = _train(target, 200)
    _, eval_step = fd.make_feature_steps(config, fd.FeatureLossConfig(), optax.adam(0.0))
    untrained = fd.feature_draft_from_target(target.config, target.params, (0,))[1]
    before = eval_step(jax.tree.map(jnp.asarray, untrained), held, held_features, rows)
    after = eval_step(params, held, held_features, rows)
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    assert after["agreement"] >= before["agreement"], (before, after)
    assert after["agreement2"] >= before["agreement2"], (before, after)
    inputs = fd.shift_features(held_features)
    moved = fd.draft_features(params, config, held, inputs + 0.5)
    np.testing.assert_array_less(1e-3, np.abs(np.asarray(
        moved - fd.draft_features(params, config, held, inputs))).max())


def test_staged_with_a_feature_draft_equals_ar(target):
    """``staged`` takes a feature draft (its proposal nodes read a stale feature, which
    changes only the ranking): greedy and coupled output equal ``ar``'s."""
    from specjax.training.ngram_build import build_ngram

    draft = feature_draft(target, seed=6)
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        prompt = random_prompt(seed + 20, 9)
        tables = build_ngram([prompt * 3], target.config.vocab_size, top_k=4,
                             trigram_top_k=2, trigram_buckets=64, min_context_count=1).tables
        expected = specjax.generate(target, prompt, max_new_tokens=NEW, temperature=temperature,
                                    seed=seed).tokens
        out = specjax.generate(target, prompt, max_new_tokens=NEW, temperature=temperature,
                               seed=seed, draft=draft, method="staged", ngram=tables)
        assert out.tokens == expected, temperature


def test_errors_are_one_line(target):
    draft = feature_draft(target, seed=6)
    wide = dataclasses.replace(draft.config, hidden_size=96)
    wide_params = models.init_params(wide, jax.random.PRNGKey(0))
    with pytest.raises(InvalidArgumentError, match="reads features of width 96"):
        specjax.generate(target, [1, 2, 3], max_new_tokens=4, method="spec",
                         draft=specjax.Model.from_params(wide, wide_params, name="wide"))
    with pytest.raises(InvalidArgumentError, match="a feature draft needs features"):
        models.forward(draft.params, draft.config, jnp.zeros((3,), jnp.int32),
                       jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(InvalidArgumentError, match="feature_input drafts are llama-family"):
        ModelConfig(architecture="gpt2", vocab_size=10, hidden_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8,
                    max_position_embeddings=16, feature_input=True)
    with pytest.raises(InvalidArgumentError, match="no Hugging Face equivalent"):
        to_hf_config(draft.config)
    with pytest.raises(InvalidArgumentError, match="unroll must be 1 or 2"):
        fd.FeatureLossConfig(unroll=3)


def test_a_feature_draft_asset_round_trips(target, tmp_path):
    """``save_draft_asset`` records ``feature_input`` and stores ``fc``; the loaded draft
    is a feature draft with the float16 tensors, the target's embedding, and decodes
    exactly; an asset whose record drops the flag fails in one line."""
    import json

    from specjax.checkpoints_tools.sources import load_bundled_draft, save_draft_asset
    from specjax.errors import CheckpointError

    draft = feature_draft(target, seed=7)
    asset = save_draft_asset(tmp_path / "asset", target.config, draft.params,
                             target.params["embed"], {"note": "test"}, head_tokens=range(40))
    record = json.loads((asset / "draft.json").read_text())
    assert record["feature_input"] is True
    loaded = load_bundled_draft(target, asset)
    assert loaded.config == draft.config and loaded.head_size == 40
    np.testing.assert_array_equal(loaded.params["fc"],
                                  np.asarray(draft.params["fc"], np.float16).astype(np.float32))
    assert loaded.params["embed"] is target.params["embed"]
    prompt = random_prompt(8, 7)
    assert (specjax.generate(target, prompt, max_new_tokens=12, draft=loaded, method="spec").tokens
            == specjax.generate(target, prompt, max_new_tokens=12).tokens)
    (asset / "draft.json").write_text(json.dumps({**record, "feature_input": False}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'fc'"):
        load_bundled_draft(target, asset)
    (asset / "draft.json").write_text(json.dumps({**record, "feature_input": "yes"}))
    with pytest.raises(CheckpointError, match="feature_input must be true or false"):
        load_bundled_draft(target, asset)


def test_a_standalone_draft_converts_to_a_feature_draft_computing_it(target):
    """``feature_draft_from_draft``: ``fc = [I; 0]``, so whatever the features, the logits
    are the standalone draft's (bitwise); training then starts from that draft."""
    standalone = tiny_pair("llama-gqa", seed=33, num_hidden_layers=2)[1]
    config, params = fd.feature_draft_from_draft(standalone.config, standalone.params)
    assert config.feature_input and config.num_layers == 2
    tokens, positions = jnp.asarray([3, 9, 27, 81, 5]), jnp.arange(5, dtype=jnp.int32)
    features = jax.random.normal(jax.random.PRNGKey(1), (5, config.hidden_size))
    ours, _ = models.forward(params, config, tokens, positions, features=features)
    theirs, _ = models.forward(standalone.params, standalone.config, tokens, positions)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert fd.feature_draft_from_draft(config, params) == (config, params)


@pytest.mark.parametrize("variant", ["phi", "cohere", *(pytest.param(v, marks=pytest.mark.slow)
                                                          for v in ("granite", "gemma2"))])
def test_training_scores_features_as_the_target_head_does(variant, tmp_path):
    """Feature-draft training scores a feature through the target's head as decoding does:
    Phi's head bias, Cohere's logit scale, Granite's divisor, Gemma 2's soft-cap (before
    2026-11-28 it took the plain products, so the KL term fit another distribution). A
    subset of a biased head's rows is refused in one line."""
    from helpers_families import tiny_family_model

    tiny_family_model(variant, seed=2).save_pretrained(tmp_path)
    target = specjax.load(tmp_path)
    draft_config, params = fd.feature_draft_from_target(target.config, target.params, (0,))
    _, frozen = fd.split_feature_trainable(jax.tree.map(jnp.asarray, params))
    windows = jnp.asarray([random_prompt(3, 12)], jnp.int32)
    features = fd.target_features(target.params, target.config, windows)[0]
    got = fd.head_scores(frozen, draft_config, fd.head_rows(frozen, draft_config, None),
                         features)
    want = models.lm_head(target.params, target.config, features)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if variant == "phi":
        with pytest.raises(InvalidArgumentError, match="whole vocabulary") as info:
            fd.head_scores(frozen, draft_config, fd.head_rows(frozen, draft_config, [1, 2]),
                           features)
        assert "\n" not in str(info.value)
