"""Fused projection weights: q|k|v and gate|up concatenated once after loading.

One matmul per group instead of three (q, k, v) and two (gate, up) per layer, with the
checkpoint layout and its strict key mapping unchanged (the fusion is a separate step,
exactly undone by ``unfuse_projections``).

Logits are compared bit for bit with the separate layout. A column of a matmul does not in
general keep its last bit when the matrix grows: that is the backend's GEMM, not the
fusion (XLA's CPU GEMM gives the tiny Qwen2's [64, 96] product within 1.5e-5 of its [64, 64]
and [64, 16] parts at 5-24 rows, and the same bits at one row). So: bitwise for the
one-token step of every family and for every pass of the Llama shapes, where the CPU GEMM
keeps the bits; 1e-4 (composite fp32) for Qwen2's multi-row passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import models
from specjax.cache import advance, init_cache
from specjax.errors import CheckpointError

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

KINDS = {"llama-gqa": {}, "llama-mha-biases": dict(mlp_bias=True, attention_bias=True),
         "qwen2": {}, "gpt2": {}}
BITWISE_MULTI_ROW = {"llama-gqa", "llama-mha-biases"}


def _pair(kind):
    base = "llama-mha" if kind == "llama-mha-biases" else kind
    return tiny_pair(base, seed=5, **KINDS[kind])[1]


@pytest.mark.parametrize("kind", [k if k in ("llama-gqa", "gpt2") else
                                  pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_fused_logits_equal_the_separate_ones(kind):
    model = _pair(kind)
    config, params = model.config, model.params
    fused = models.fuse_projections(config, params)
    assert models.projections_fused(fused) and not models.projections_fused(params)
    layers = fused["layers"]
    assert not {"wq", "wk", "wv", "w_gate", "w_up", "bq", "b_gate"} & set(layers)
    models.check_params(config, fused, source="fused")  # the fused layout checks too

    tokens = jnp.asarray(random_prompt(5, 24))
    full = jax.jit(lambda p: models.forward(p, config, tokens, jnp.arange(24))[0])
    step = jax.jit(lambda p, t, cache: models.forward(
        p, config, t, 8 + jnp.arange(t.shape[0]), cache)[0])
    cache = advance(init_cache(config, 64), 8)
    for rows, run in (("prefill-24", lambda p: full(p)),
                      ("decode-1", lambda p: step(p, tokens[:1], cache)),
                      ("verify-5", lambda p: step(p, tokens[:5], cache)),
                      ("verify-16", lambda p: step(p, tokens[:16], cache))):
        separate, together = np.asarray(run(params)), np.asarray(run(fused))
        if rows == "decode-1" or kind in BITWISE_MULTI_ROW:
            np.testing.assert_array_equal(together, separate, err_msg=f"{kind} {rows}")
        else:
            # Wider matmuls may tile their sums differently: bounded by the pass's sums.
            assert_sums_close(together, separate, **forward_sums(config, 32),
                              err_msg=f"{kind} {rows}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_unfuse_restores_the_checkpoint_layout_exactly(kind):
    model = _pair(kind)
    config, params = model.config, model.params
    back = models.unfuse_projections(config, models.fuse_projections(config, params))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Fusing twice, or unfusing the separate layout, changes nothing.
    fused = models.fuse_projections(config, params)
    assert models.fuse_projections(config, fused) is fused
    assert models.unfuse_projections(config, params) is params


def test_a_mis_shaped_fused_tree_is_refused():
    model = _pair("llama-gqa")
    fused = models.fuse_projections(model.config, model.params)
    bad = {**fused, "layers": {**fused["layers"],
                               "w_qkv": fused["layers"]["w_qkv"][..., :-1]}}
    with pytest.raises(CheckpointError, match=r"w_qkv.*expected"):
        models.check_params(model.config, bad, source="fused")


def test_generation_with_fused_projections_equals_separate():
    model = _pair("llama-gqa")
    fused = specjax.Model.from_params(
        model.config, models.fuse_projections(model.config, model.params), name="fused")
    prompt = random_prompt(9, 11)
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    assert specjax.generate(fused, prompt, max_new_tokens=8).tokens == expected


def test_a_fused_target_and_draft_draft_exactly():
    # Model.with_fused_projections on both: tree output equals the separate target's ar.
    model = _pair("llama-gqa")
    fused = model.with_fused_projections()
    assert models.projections_fused(fused.params) and fused.with_fused_projections() is fused
    draft = fused.first_layers(1)
    assert models.projections_fused(draft.params)
    prompt = random_prompt(10, 9)
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    out = specjax.generate(fused, prompt, max_new_tokens=8, method="tree", draft=draft,
                           tree_budget=6, draft_depth=3, draft_width=2)
    assert out.tokens == expected and out.stats["draft_calls"] > 0


def test_a_fused_layer_runs_three_fewer_matmuls():
    """The layer loop's body in the compiled forward: q/k/v and gate/up fused (7 -> 4
    projection matmuls per layer; the attention's own products are the same in both)."""
    model = _pair("llama-gqa")
    config = model.config
    tokens = jnp.asarray(random_prompt(5, 4))
    cache = advance(init_cache(config, 64), 8)

    def dots(params):
        text = jax.jit(lambda p: models.forward(p, config, tokens, 8 + jnp.arange(4), cache)[0]
                       ).lower(params).as_text()
        return text.count("stablehlo.dot_general")

    separate = dots(model.params)
    assert separate - dots(models.fuse_projections(config, model.params)) == 3
