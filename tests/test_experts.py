"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE;
``specjax.models.decoder``):
both ways of reading the experts (the picked experts' weights gathered per row for a few
rows, every expert on every row for many) equal a float64 loop over tokens, a wrong
routing rule is told apart by the same comparison, and the checkpoint key map names a
missing, stray or mis-shaped expert tensor. Parity with transformers' Mixtral, Qwen3-MoE
and OLMoE, and every method's exactness on them, are in tests/test_families.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import models
from specjax.checkpoints_tools.keymap import hf_tensors_from_params, params_from_hf_tensors
from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.models import decoder

CONFIG = ModelConfig(architecture="llama", vocab_size=61, hidden_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=24,
                     max_position_embeddings=64, tie_word_embeddings=False, family="mixtral",
                     num_experts=5, experts_per_token=2)


def _layer(config: ModelConfig, seed: int = 0) -> dict:
    """Layer 0's parameters, the router's logits spread over a few units (distinct top
    experts, their probabilities far from 0 and 1)."""
    params = models.init_params(config, jax.random.key(seed))
    layer = {name: np.asarray(value[0]) for name, value in params["layers"].items()}
    layer["router"] = layer["router"] * 10.0
    for name in ("we_gate", "we_up", "we_down"):
        layer[name] = layer[name] * 10.0
    return layer


def _loop(config: ModelConfig, layer: dict, h: np.ndarray, normalize: bool) -> np.ndarray:
    """The rule, one token at a time in float64: softmax over the router's logits, the k
    most probable experts, their probabilities (rescaled to sum 1 with ``normalize``)
    weighting their SwiGLU outputs."""
    p = {name: np.asarray(value, np.float64) for name, value in layer.items()}
    out = []
    for row in np.asarray(h, np.float64):
        logits = row @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:config.experts_per_token]
        weights = probs[top] / (probs[top].sum() if normalize else 1.0)
        total = np.zeros_like(row)
        for weight, e in zip(weights, top):
            gate = row @ p["we_gate"][e]
            total += weight * ((gate / (1 + np.exp(-gate)) * (row @ p["we_up"][e]))
                               @ p["we_down"][e])
        if config.shared_expert_size:  # Qwen2-MoE's: every row, behind a sigmoid gate
            gate = row @ p["ws_gate"]
            shared = (gate / (1 + np.exp(-gate)) * (row @ p["ws_up"])) @ p["ws_down"]
            total += shared / (1 + np.exp(-(row @ p["shared_gate"])))
        out.append(total)
    return np.stack(out)


@pytest.mark.parametrize("normalize,shared", [(True, 0), (False, 0), (False, 12)],
                         ids=["rescaled", "as-given", "shared-expert"])
def test_both_ways_of_reading_the_experts_equal_a_loop_over_tokens(normalize, shared):
    config = dataclasses.replace(CONFIG, normalize_expert_weights=normalize,
                                 shared_expert_size=shared)
    layer = _layer(config)
    h = np.random.default_rng(1).standard_normal((7, config.hidden_size)).astype(np.float32)
    want = _loop(config, layer, h, normalize)
    # 7 rows x 2 experts > 5 experts: every expert runs on every row.
    every = np.asarray(decoder._experts(config, layer, jnp.asarray(h)))
    # 1 row x 2 experts <= 5: the two picked experts' weights are gathered.
    picked = np.concatenate([np.asarray(decoder._experts(config, layer, jnp.asarray(h[i:i + 1])))
                             for i in range(len(h))])
    scale = np.abs(want).max()
    np.testing.assert_allclose(every, want, atol=1e-5 * scale)
    np.testing.assert_allclose(picked, want, atol=1e-5 * scale)
    # The same comparison tells the other rescaling rule apart.
    assert np.abs(_loop(config, layer, h, not normalize) - want).max() > 1e-2 * scale


def test_a_row_routed_past_the_others_keeps_its_result():
    """Rows are routed independently: a row's output is the same alone and among rows
    that pick other experts (each row's picks differ here)."""
    layer = _layer(CONFIG, seed=2)
    h = np.random.default_rng(3).standard_normal((6, CONFIG.hidden_size)).astype(np.float32)
    probs = jax.nn.softmax(jnp.asarray(h) @ layer["router"], axis=-1)
    assert len({tuple(sorted(np.argsort(-np.asarray(p))[:2])) for p in probs}) > 1
    together = np.asarray(decoder._experts(CONFIG, layer, jnp.asarray(h)))
    for i in range(len(h)):
        alone = np.asarray(decoder._experts(CONFIG, layer, jnp.asarray(h[i:i + 1])))[0]
        np.testing.assert_allclose(together[i], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,prefix,names", [
    ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"))])
def test_expert_tensors_round_trip_and_a_missing_stray_or_misshaped_one_is_named(
        family, prefix, names):
    config = dataclasses.replace(CONFIG, family=family, qk_norm=family == "qwen3_moe")
    params = jax.tree.map(np.asarray, models.init_params(config, jax.random.key(4)))
    tensors = hf_tensors_from_params(config, params)
    experts = [n for n in tensors if ".experts." in n]
    assert len(experts) == config.num_layers * config.num_experts * 3
    assert f"model.layers.1.{prefix}.gate.weight" in tensors
    again = params_from_hf_tensors(config, tensors)
    for name in ("router", "we_gate", "we_up", "we_down"):
        np.testing.assert_array_equal(again["layers"][name], params["layers"][name])
    gate, up, down = (f"model.layers.1.{prefix}.experts.{{e}}.{n}.weight" for n in names)
    missing = {k: v for k, v in tensors.items() if k != up.format(e=3)}
    with pytest.raises(CheckpointError, match=f"missing tensor '{up.format(e=3)}'"):
        params_from_hf_tensors(config, missing)
    stray = {**tensors, gate.format(e=5): tensors[gate.format(e=0)]}
    with pytest.raises(CheckpointError, match="names expert 5 but the config has 5 experts"):
        params_from_hf_tensors(config, stray)
    misshaped = {**tensors, down.format(e=0): tensors[down.format(e=0)][:, :-1]}
    with pytest.raises(CheckpointError, match=f"'{down.format(e=0)}' has shape"):
        params_from_hf_tensors(config, misshaped)


def _dot_operand_shapes(config: ModelConfig, layer: dict, rows: int) -> set:
    """The shapes of every operand of a matrix product in the expert MLP of ``rows`` rows."""
    h = jnp.zeros((rows, config.hidden_size), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda p, x: decoder._experts(config, p, x))(layer, h)
    return {tuple(var.aval.shape) for eqn in jaxpr.jaxpr.eqns
            if eqn.primitive.name == "dot_general" for var in eqn.invars}


def test_a_decode_step_multiplies_only_the_picked_experts_weights():
    """One row (2 of 5 experts): the products read the two picked experts' gathered
    weights, never the stack of all five; seven rows (14 picks > 5 experts) multiply by
    the whole stack, each expert once."""
    layer = _layer(CONFIG)
    d, f, e, k = CONFIG.hidden_size, CONFIG.intermediate_size, 5, 2
    one = _dot_operand_shapes(CONFIG, layer, 1)
    assert {(1, k, d, f), (1, k, f, d)} <= one and not {(e, d, f), (e, f, d)} & one, one
    seven = _dot_operand_shapes(CONFIG, layer, 7)
    assert {(e, d, f), (e, f, d)} <= seven, seven


def test_a_grown_mixture_of_experts_draft_starts_out_computing_the_draft():
    """Target blocks copied into a draft add exactly zero while their outputs are zero: for
    experts that is every expert's ``we_down`` (a block whose experts still wrote would
    change the draft's logits)."""
    from specjax.training.drafts import grow_draft

    params = models.init_params(CONFIG, jax.random.key(5))
    params = jax.tree.map(lambda a: np.asarray(a) * (10.0 if a.ndim > 1 else 1.0), params)
    draft_config = dataclasses.replace(CONFIG, num_layers=1)
    draft = {**params, "layers": {k: v[:1] for k, v in params["layers"].items()}}
    grown_config, grown = grow_draft(draft_config, draft, CONFIG, params, [1])
    tokens = jnp.asarray([3, 14, 15, 9, 26])

    def logits(config, p):
        return np.asarray(models.forward(p, config, tokens, jnp.arange(5))[0])

    np.testing.assert_array_equal(logits(grown_config, grown), logits(draft_config, draft))
    writing = {**grown, "layers": {**grown["layers"], "we_down": params["layers"]["we_down"]}}
    assert np.abs(logits(grown_config, writing) - logits(draft_config, draft)).max() > 1e-3
