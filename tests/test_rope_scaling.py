"""RoPE scaling of the long-context checkpoints users bring: YaRN (Qwen2.5 / Qwen3 and other
Llama-family configs, DeepSeek's mscale), LongRoPE (Phi-3.5, Phi-4-mini; also llama.cpp's
per-frequency factors, which is how Llama 3.1 / 3.2 GGUF files store their scaling) and
partial rotary (Phi-4-mini): logits against transformers, greedy generation, every method
equal to ``ar``, GGUF files, config round trips, and one-line refusals.

Tolerance: as in ``tests/test_families.py`` (float32 rounding of the same operations in
another order); every wrong rule below moves the logits by more than 1e-2.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax import models
from specjax.config import ModelConfig
from specjax.families import from_hf_config, to_hf_config
from specjax.rope_scaling import RopeScaling
from specjax.errors import CheckpointError, InvalidArgumentError

from conftest import random_prompt, tiny_pair
from helpers_families import hf_config, tiny_family_model
from tolerances import assert_sums_close, forward_sums

ORIGINAL = 16  # pretraining length of the scaled configs: the tests' sequences cross it
# YaRN does not depend on the sequence's length; over 256 positions its ramp spans pairs
# 0.2-3.2 of 8, so that truncating the ends (the default) matters.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "rope_theta": 10000.0}
# Each changes the frequencies or the attention factor of YARN's result.
YARN_VARIANTS = {
    "yarn": YARN,
    "yarn-untruncated": dict(YARN, truncate=False),
    "yarn-betas": dict(YARN, beta_fast=8, beta_slow=2),
    "yarn-mscale": dict(YARN, mscale=0.707, mscale_all_dim=1.0),  # DeepSeek's form
    "yarn-attention-factor": dict(YARN, attention_factor=1.3),
}
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5]  # head_dim 16: 8 rotated pairs
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]


def longrope(pairs: int = 8, **extra) -> dict:
    return {"rope_type": "longrope", "short_factor": SHORT[:pairs], "long_factor": LONG[:pairs],
            "rope_theta": 10000.0, **extra}


def _logits(model, tokens, config=None):
    logits, _ = models.forward(model.params, config or model.config, jnp.asarray(tokens),
                               jnp.arange(len(tokens)))
    return np.asarray(logits)


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


def _assert_parity(model, hf_model, tokens, config=None):
    config = config or model.config
    assert_sums_close(_logits(model, tokens, config), _hf_logits(hf_model, tokens),
                      **forward_sums(config, len(tokens)))


def _loaded(hf_model, path):
    hf_model.save_pretrained(path)
    return specjax.load(path)


def _phi3(tmp_path, seed=0, **overrides):
    """A tiny Phi-3 (no window, so the fused layers may run it) with LongRoPE over a
    pretraining length of ORIGINAL, loaded from its saved directory."""
    kwargs = dict(rope_parameters=longrope(), original_max_position_embeddings=ORIGINAL)
    hf_model = tiny_family_model("phi3-global", seed=seed, **{**kwargs, **overrides})
    return hf_model, _loaded(hf_model, tmp_path / f"phi3-{seed}")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return _phi3(tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def phi3_partial(tmp_path_factory):
    """Phi-4-mini's shape: RoPE on the first half of each head, LongRoPE on those dims."""
    return _phi3(tmp_path_factory.mktemp("phi3-partial"), seed=1,
                 rope_parameters=longrope(4, partial_rotary_factor=0.5))


# ----------------------------------------------------------------------------- YaRN


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_logits_match_transformers(kind, variant):
    hf_model, model = tiny_pair(kind, seed=3, rope_parameters=dict(YARN_VARIANTS[variant]))
    assert model.config.rope_scaling.kind == "yarn"
    _assert_parity(model, hf_model, random_prompt(7, 40))


def test_qwen3_yarn_logits_match_transformers(tmp_path):
    hf_model = tiny_family_model("qwen3-tied", seed=2, rope_parameters=dict(YARN))
    model = _loaded(hf_model, tmp_path / "qwen3")
    _assert_parity(model, hf_model, random_prompt(8, 40))


def test_yarn_reads_transformers_default_attention_factor():
    _, model = tiny_pair("llama-gqa", rope_parameters=dict(YARN))
    assert model.config.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    _, deepseek = tiny_pair("llama-gqa", rope_parameters=YARN_VARIANTS["yarn-mscale"])
    assert deepseek.config.rope_scaling.attention_factor == pytest.approx(
        (0.1 * 0.707 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1))


# ----------------------------------------------------------------------------- LongRoPE


def test_longrope_short_sequences_match_transformers(phi3):
    hf_model, model = phi3
    scaling = model.config.rope_scaling
    assert (scaling.kind, scaling.long, scaling.original_max_position_embeddings) == (
        "longrope", False, ORIGINAL)
    assert scaling.attention_factor == pytest.approx(
        np.sqrt(1 + np.log(256 / ORIGINAL) / np.log(ORIGINAL)))
    _assert_parity(model, hf_model, random_prompt(1, ORIGINAL))


def test_longrope_long_sequences_match_transformers(phi3):
    """Past the pretraining length transformers rotates every position by the long
    factors; so does the config a generation of that length runs (``for_length``)."""
    hf_model, model = phi3
    tokens = random_prompt(2, 30)
    config = model.config.for_length(len(tokens))
    assert config.rope_scaling.long and model.config.for_length(ORIGINAL) == model.config
    _assert_parity(model, hf_model, tokens, config)


def test_partial_rotary_with_longrope_matches_transformers(phi3_partial):
    hf_model, model = phi3_partial
    assert (model.config.rotary_dim, model.config.rope_dim, model.config.head_dim) == (8, 8, 16)
    _assert_parity(model, hf_model, random_prompt(3, ORIGINAL))
    tokens = random_prompt(4, 28)
    _assert_parity(model, hf_model, tokens, model.config.for_length(len(tokens)))


def test_generation_within_the_pretraining_length_is_transformers_generate(phi3):
    from conftest import hf_greedy

    hf_model, model = phi3
    prompt = random_prompt(5, 6)
    assert specjax.generate(model, prompt, max_new_tokens=ORIGINAL - 6).tokens == \
        hf_greedy(hf_model, prompt, ORIGINAL - 6)


def test_a_generation_past_it_is_the_long_factor_model_at_every_position(phi3):
    """A generation whose prompt plus budget passes the pretraining length runs the long
    factors from its first position (transformers would switch mid-generation, after its
    cache holds keys rotated by the short ones): each greedy token is the argmax of
    transformers' own forward pass over the whole text, which rotates every position by
    the long factors."""
    hf_model, model = phi3
    prompt = random_prompt(6, 6)
    tokens = specjax.generate(model, prompt, max_new_tokens=24).tokens
    logits = _hf_logits(hf_model, prompt + tokens)
    assert np.argmax(logits[len(prompt) - 1:-1], axis=-1).tolist() == tokens


def test_a_prompt_past_it_generates_as_transformers(phi3):
    from conftest import hf_greedy

    hf_model, model = phi3
    prompt = random_prompt(7, ORIGINAL + 4)
    assert specjax.generate(model, prompt, max_new_tokens=12).tokens == \
        hf_greedy(hf_model, prompt, 12)


@pytest.mark.parametrize("method", ["spec"] + [pytest.param(method, marks=pytest.mark.slow)
                                               for method in ("tree", "ngram", "staged")])
def test_every_method_equals_ar_across_the_pretraining_length(phi3, method):
    """Greedy and coupled: the generations cross ORIGINAL, so ``ar`` and every method must
    pick the same factors (by prompt + budget, not by the method's own cache size), and the
    draft the target's."""
    from conftest import fitted_tables

    model = phi3[1]
    resources = {"ngram": fitted_tables(model, (0,), 24)} if method in ("ngram", "staged") \
        else {}
    if method != "ngram":
        resources["draft"] = model
    for sampling in ({}, dict(temperature=1.0)):
        prompt = random_prompt(9, 6)
        expected = specjax.generate(model, prompt, max_new_tokens=24, seed=1, **sampling)
        out = specjax.generate(model, prompt, max_new_tokens=24, seed=1, method=method,
                               **resources, **sampling)
        assert out.tokens == expected.tokens, (method, sampling)
        if not sampling and method != "ngram":
            # the target drafts for itself; a draft left on the short factors accepted
            # 1.26 / 1.33 / 1.33 tokens per pass (spec / tree / staged), against 4.0 / 1.71
            # for spec / staged with the target's
            assert out.stats["mean_accepted"] > 1.5, out.stats["mean_accepted"]


def test_a_batch_across_the_pretraining_length_gives_each_row_its_own_tokens(phi3):
    """Rows on either side of the pretraining length run different factors, so they run as
    separate batch programs; each row equals its own call, in the caller's order."""
    model = phi3[1]
    prompts = [random_prompt(1, 4), random_prompt(2, 10), random_prompt(3, 5)]
    outs = specjax.generate(model, prompts, max_new_tokens=10)  # totals 14, 20, 15
    assert [o.tokens for o in outs] == [
        specjax.generate(model, prompt, max_new_tokens=10).tokens for prompt in prompts]
    assert [o.stats["batch"]["rows"] for o in outs] == [2, 1, 2]
    rows = [[] for _ in prompts]
    *steps, (_, stats) = specjax.stream_generate(model, prompts, max_new_tokens=10)
    for new, _ in steps:
        for row, tokens in enumerate(new):
            rows[row] += tokens
    assert rows == [o.tokens for o in outs]
    assert [s["new_tokens"] for s in stats] == [10, 10, 10]


# ----------------------------------------------------------------------------- wrong rules


def _wrong(config: ModelConfig, **changes) -> ModelConfig:
    scaling_fields = {f.name for f in dataclasses.fields(RopeScaling)}
    scaling = {k: v for k, v in changes.items() if k in scaling_fields}
    others = {k: v for k, v in changes.items() if k not in scaling_fields}
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(config.rope_scaling,
                                                                        **scaling), **others)


@pytest.mark.parametrize("change", [dict(attention_factor=1.0), dict(truncate=False),
                                    dict(beta_slow=4.0), dict(factor=2.0)])
def test_a_wrong_yarn_rule_fails_parity(change):
    hf_model, model = tiny_pair("llama-gqa", seed=3, rope_parameters=dict(YARN))
    tokens = random_prompt(7, 40)
    wrong = _wrong(model.config, **change)
    assert np.abs(_logits(model, tokens, wrong) - _hf_logits(hf_model, tokens)).max() > 1e-2


@pytest.mark.parametrize("fixture,length,change", [
    ("phi3", ORIGINAL, dict(long=True)), ("phi3", 30, dict(long=False)),
    ("phi3", ORIGINAL, dict(attention_factor=1.0)),
    ("phi3_partial", ORIGINAL, dict(rotary_dim=None, short_factor=SHORT, long_factor=LONG)),
])
def test_a_wrong_longrope_rule_fails_parity(request, fixture, length, change):
    hf_model, model = request.getfixturevalue(fixture)
    tokens = random_prompt(8, length)
    wrong = _wrong(model.config.for_length(length), **change)
    assert np.abs(_logits(model, tokens, wrong) - _hf_logits(hf_model, tokens)).max() > 1e-2


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fixture", ["phi3", "phi3_partial"])
def test_longrope_configs_round_trip_through_transformers(request, fixture):
    import transformers

    config = request.getfixturevalue(fixture)[1].config
    hf = transformers.Phi3Config(**to_hf_config(config))
    assert from_hf_config(hf.to_dict()) == config


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_yarn_configs_round_trip_through_transformers(kind):
    import transformers

    config = tiny_pair(kind, rope_parameters=YARN_VARIANTS["yarn-mscale"])[1].config
    hf_class = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    assert from_hf_config(hf_class(**to_hf_config(config)).to_dict()) == config


def test_orbax_keeps_the_scaling(phi3_partial, tmp_path):
    from specjax.checkpoints_tools.orbax_io import load_orbax, save_orbax

    model = phi3_partial[1]
    save_orbax(tmp_path / "ckpt", model.config, model.params)
    config, params, _ = load_orbax(tmp_path / "ckpt")
    assert config == model.config and hash(config) == hash(model.config)
    tokens = random_prompt(3, 20)
    np.testing.assert_array_equal(_logits(specjax.Model(config, params), tokens),
                                  _logits(model, tokens))


# ----------------------------------------------------------------------------- kernels


def test_fused_layers_run_longrope_exactly(phi3):
    """The fused layers (kernels interpreted here) read the scaled tables as they are:
    ``ar``'s greedy tokens across the pretraining length."""
    model = phi3[1]
    assert models.has_fused_layers(model.config)
    prompt = random_prompt(0, 6)
    expected = specjax.generate(model, prompt, max_new_tokens=20).tokens
    assert specjax.generate(model, prompt, max_new_tokens=20,
                            kernels=specjax.KernelOptions(attention="fused")).tokens == expected


def test_fused_layers_run_partial_rotary_exactly(phi3_partial):
    """The fused layers rotate the first half of each head with the scaled tables (the
    rotation in jnp after the q|k|v kernel, elementwise): ``ar``'s greedy tokens."""
    model = phi3_partial[1]
    assert models.has_fused_layers(model.config)
    prompt = random_prompt(0, 6)
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    assert specjax.generate(model, prompt, max_new_tokens=8,
                            kernels=specjax.KernelOptions(attention="fused")).tokens == expected


# ----------------------------------------------------------------------------- refusals


def _phi3_raw(**scaling):
    raw = hf_config("phi3").to_dict()
    raw["rope_parameters"] = None
    raw["rope_scaling"] = scaling
    return raw


@pytest.mark.parametrize("raw,message", [
    (_phi3_raw(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 7),
     "longrope needs short_factor and long_factor of one length"),
    (_phi3_raw(type="longrope", short_factor=[1.0] * 4, long_factor=[1.0] * 4),
     "need rotary dims / 2 = 8 entries, got 4"),
    (_phi3_raw(type="longrope", short_factor=[1.0] * 7 + [0.0], long_factor=[1.0] * 8),
     "short_factor must be > 0"),
    (_phi3_raw(type="longrope", short_factor="wide", long_factor=[1.0] * 8),
     "short_factor must be a list of numbers"),
    ({**hf_config("phi3").to_dict(), "rope_parameters": {"rope_type": "dynamic",
                                                         "factor": 2.0}},
     "unsupported rope scaling type 'dynamic'"),
    ({"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 8,
      "rope_scaling": {"rope_type": "llama3"}}, "llama3 rope scaling without 'factor'"),
])
def test_bad_scaling_is_refused_in_one_line(raw, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        from_hf_config(raw)
    assert "\n" not in str(info.value)


def test_partial_rotary_is_refused_outside_phi3():
    raw = {**hf_config("qwen3-tied").to_dict(), "partial_rotary_factor": 0.5}
    with pytest.raises(InvalidArgumentError, match="qwen3 partial_rotary_factor 0.5"):
        from_hf_config(raw)
    with pytest.raises(InvalidArgumentError, match="rotary_dim must be an even int"):
        dataclasses.replace(from_hf_config(hf_config("phi3").to_dict()), rotary_dim=7)


# ----------------------------------------------------------------------------- GGUF


def _llama3_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's converter's per-frequency factors for Llama 3 scaling (what a
    Llama 3.1 / 3.2 GGUF stores as ``rope_freqs.weight``): frequency i is divided by
    factor i."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old = scaling["original_max_position_embeddings"]
    low, high = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    smooth = (old / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"])
    factors = np.where(wavelen < high, 1.0, np.where(
        wavelen > low, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)))
    return factors.astype(np.float32)


def test_a_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """Llama 3.1 / 3.2 GGUF files carry their scaling as ``rope_freqs.weight``."""
    import transformers
    from helpers_checkpoints import _LLAMA, _build, tiny_vocabulary, write_tiny_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500.0}
    kwargs = dict(_LLAMA, vocab_size=len(tiny_vocabulary()[0]), num_hidden_layers=2,
                  num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=scaling)
    hf_model = _build(transformers.LlamaConfig, kwargs, seed=4)
    head_dim = hf_model.config.hidden_size // hf_model.config.num_attention_heads
    factors = _llama3_factors(scaling, head_dim, 500.0)
    assert 1.0 < factors.max() and factors.min() == 1.0  # the test sees all three bands
    path = write_tiny_gguf(hf_model, tmp_path / "llama3.gguf",
                           extra_tensors={"rope_freqs.weight": factors})
    config, params, _ = load_gguf(path)
    assert config.rope_scaling.kind == "longrope"
    model = specjax.Model.from_params(config, params)
    _assert_parity(model, hf_model, random_prompt(4, 48, vocab=hf_model.config.vocab_size))
    # and without its factors the file would be a different model
    plain = dataclasses.replace(config, rope_scaling=None)
    tokens = random_prompt(4, 48, vocab=hf_model.config.vocab_size)
    assert np.abs(_logits(model, tokens, plain) - _hf_logits(hf_model, tokens)).max() > 1e-2


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_a_phi3_gguf_with_longrope_factors_matches_transformers(tmp_path, partial):
    from helpers_checkpoints import tiny_vocabulary
    from helpers_families import write_family_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    pairs = 8 if partial == 1.0 else 4
    hf_model = tiny_family_model(
        "phi3-global", seed=6, vocab_size=len(tiny_vocabulary()[0]),
        rope_parameters=longrope(pairs, partial_rotary_factor=partial),
        original_max_position_embeddings=ORIGINAL)
    config, params, _ = load_gguf(write_family_gguf(hf_model, tmp_path / "phi3.gguf"))
    model = specjax.Model.from_params(config, params)
    assert config.rope_dim == int(16 * partial)
    vocab = hf_model.config.vocab_size
    _assert_parity(model, hf_model, random_prompt(1, ORIGINAL, vocab=vocab))
    tokens = random_prompt(2, 30, vocab=vocab)
    _assert_parity(model, hf_model, tokens, config.for_length(len(tokens)))


@pytest.mark.parametrize("tensors,message", [
    ({"rope_factors_long.weight": np.ones(8, np.float32)}, "come together; one is missing"),
    ({"rope_freqs.weight": np.ones(8, np.float32)}, "'rope_freqs.weight' in a phi3 file"),
    ({"rope_factors_long.weight": np.ones(8, np.float32),
      "rope_factors_short.weight": -np.ones(8, np.float32)}, "1-D positive finite RoPE"),
])
def test_bad_rope_factor_tensors_are_refused_in_one_line(tmp_path, tensors, message):
    from helpers_checkpoints import tiny_vocabulary
    from helpers_families import write_family_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("phi3-global", vocab_size=len(tiny_vocabulary()[0]))
    path = write_family_gguf(hf_model, tmp_path / "bad.gguf", extra_tensors=tensors)
    with pytest.raises(CheckpointError, match=message) as info:
        load_gguf(path)
    assert "\n" not in str(info.value)
