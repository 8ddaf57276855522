"""The fused layers' mixture of experts (``specjax/models/experts_fused.py``: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE under ``attn_impl="fused"``), kernels interpreted on the CPU:

* each row of a many-row call (17 tokens, 34 (row, slot) pairs, more than the 4 experts:
  where the jnp MLP switches to running every expert) is bitwise the row's one-row call,
  and both are within a composite op's tolerance of the jnp MLP
  (:func:`specjax.models.decoder._experts`);
* deliberately wrong variants, each computing the experts one way for a one-row call and
  another for many rows, are caught by the same comparison: the jnp MLP's switch to
  running every expert when the pairs outnumber the experts, a reduction chunk of the
  experts' kernels chosen by the number of pairs, the router's logits by a jnp product on
  many rows;
* whole models: every node on a root-to-leaf path of a 17-node tree is bitwise the
  one-token step that ``ar`` runs (:func:`test_fused_kernels._path_versus_tree`), and the
  switch to every expert is caught there too.

The families' generations under ``"fused"`` are in tests/test_families.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.kernels.linear_gpu import GpuLinearBlockSizes
from specjax.models import decoder, experts_fused
from specjax.models.layers import dense, matmul_precision, rms_norm

from test_fused_kernels import (_feature_params, _path_versus_tree, _pinned, _tiny_config,
                                _unpacked)

# Four experts, two per token, renormalised, and Qwen2-MoE's gated shared expert; expert and
# shared widths of two 16-column tiles. The router's 4 columns and the shared gate's 1 are
# padded to one tile.
EXPERTS = dict(num_experts=4, experts_per_token=2, intermediate_size=32,
               normalize_expert_weights=True, shared_expert_size=32)
TOKENS = 17  # padded to 32 rows, as a 17-node verify pass is
LAYER = 1


def _layers(dtype, **overrides):
    config = _tiny_config(**{**EXPERTS, **overrides})
    return config, _feature_params(config, dtype)["layers"]


def _rows(config, dtype, rows: int = 32) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(4), (rows, config.hidden_size)).astype(dtype)


def _fused(config, layers, h, num_tokens: int):
    """The fused experts of layer :data:`LAYER` on the first ``num_tokens`` rows of ``h``
    (its RMSNorm folded in, as the fused layers call it), compiled as the path tests
    compile (``_pinned``)."""
    linear = functools.partial(kernels.fused_linear, fallback=True)

    def run(layers, h, index):
        return experts_fused.experts_fused(layers, index, config, h, layers["mlp_norm"],
                                           linear, num_tokens=num_tokens)

    return _pinned(run, layers, h, jnp.int32(LAYER))(layers, h, jnp.int32(LAYER))


def _each_row_alone_is_the_same(config, layers, h) -> tuple[list[bool], np.ndarray]:
    """(per token, whether its row of the many-row call is bitwise its one-row call (the
    row alone in a 16-row tile, as a one-token step pads it); the many-row call's rows)."""
    many = np.asarray(_fused(config, layers, h, TOKENS))
    tile = jnp.zeros((16, config.hidden_size), h.dtype)
    linear = functools.partial(kernels.fused_linear, fallback=True)
    one = _pinned(lambda layers, h, index: experts_fused.experts_fused(
        layers, index, config, h, layers["mlp_norm"], linear, num_tokens=1),
        layers, tile, jnp.int32(LAYER))
    return [bool(np.array_equal(np.asarray(one(layers, tile.at[0].set(h[i]),
                                               jnp.int32(LAYER)))[0], many[i]))
            for i in range(TOKENS)], many


@pytest.mark.parametrize("dtype,overrides", [
    (jnp.float32, {}),
    pytest.param(jnp.bfloat16, {}, marks=pytest.mark.slow),
    # Qwen3-MoE's and OLMoE's routing: three of four experts, as the softmax gave them; no
    # shared expert
    pytest.param(jnp.float32, dict(experts_per_token=3, normalize_expert_weights=False,
                                   shared_expert_size=0), marks=pytest.mark.slow)],
    ids=["fp32", "bf16", "fp32-three-unnormalised"])
def test_each_rows_experts_are_bitwise_its_one_row_call(dtype, overrides):
    config, layers = _layers(dtype, **overrides)
    h = _rows(config, dtype)
    same, many = _each_row_alone_is_the_same(config, layers, h)
    assert all(same)
    if dtype != jnp.float32:
        return
    # The jnp MLP (the fast path) on the same rows: other kernels, other summation orders
    # of a composite op.
    layer = {name: value[LAYER] for name, value in layers.items()}
    normed = rms_norm(h[:TOKENS], layer["mlp_norm"], config.norm_eps)
    want = np.asarray(decoder._experts(config, layer, normed))
    np.testing.assert_allclose(many[:TOKENS], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_routing_breaks_a_tie_by_the_lower_id_as_top_k_does():
    """Equal router logits (common in bfloat16) at the k-th place: the lower expert id is
    picked, as ``lax.top_k`` picks it for the jnp MLP; the weights come sorted by id.
    (The sort on unique keys gives one answer whatever algorithm XLA picks for a shape; a
    CPU runs one algorithm, so only the rule is checked here.)"""
    config = _tiny_config(**{**EXPERTS, "num_experts": 6, "experts_per_token": 3,
                             "normalize_expert_weights": False})
    logits = jnp.asarray([[0.5, 2.0, 1.0, 2.0, 1.0, -1.0],   # 1 and 3 tie; 2 beats 4
                          [3.0, 1.0, 1.0, 1.0, 1.0, 1.0]])   # four tie for places 2-3
    weights, chosen = experts_fused.route(config, logits)
    assert chosen.tolist() == [[1, 2, 3], [0, 1, 2]]
    probs = jax.nn.softmax(logits, axis=-1)
    want_weights, want = jax.lax.top_k(probs, 3)
    order = jnp.argsort(want, axis=-1)
    assert jnp.take_along_axis(want, order, axis=-1).tolist() == chosen.tolist()
    np.testing.assert_allclose(weights, jnp.take_along_axis(want_weights, order, axis=-1),
                               rtol=1e-6)


def _all_experts_past_the_expert_count(monkeypatch):
    """The jnp MLP's switch: when the (row, slot) pairs outnumber the experts, every expert
    runs on every row in jnp (one product per expert over all rows) and each pair keeps
    its expert's output; fewer pairs run the kernels."""
    right = experts_fused.expert_pairs

    def pairs(layers, index, config, rows, experts, linear):
        if rows.shape[0] <= config.num_experts:
            return right(layers, index, config, rows, experts, linear)
        p = {name: layers[name][index] for name in ("we_gate", "we_up", "we_down")}
        precision = matmul_precision(rows)
        gate = jnp.einsum("td,edf->tef", rows, p["we_gate"], precision=precision)
        up = jnp.einsum("td,edf->tef", rows, p["we_up"], precision=precision)
        out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, p["we_down"],
                         precision=precision)
        return jnp.take_along_axis(out, experts[:, None, None], axis=1)[:, 0]

    monkeypatch.setattr(experts_fused, "expert_pairs", pairs)


def _chunks_by_pair_count(monkeypatch):
    """The experts' kernels with a reduction chunk of 16 when the pairs outnumber the
    experts (their default: all 64 input features, or 32, in one chunk)."""
    right = experts_fused.expert_pairs

    def pairs(layers, index, config, rows, experts, linear):
        if rows.shape[0] > config.num_experts:
            linear = functools.partial(linear, block_sizes=GpuLinearBlockSizes(block_k=16))
        return right(layers, index, config, rows, experts, linear)

    monkeypatch.setattr(experts_fused, "expert_pairs", pairs)


def _router_in_jnp_on_many_rows(monkeypatch):
    """The router's logits by a jnp product (XLA's dot) on more than one row tile."""
    right = experts_fused.project_narrow

    def project(linear, h, weight, index, eps):
        if h.shape[0] <= 16:
            return right(linear, h, weight, index, eps)
        return dense(h, weight[index])

    monkeypatch.setattr(experts_fused, "project_narrow", project)


WRONG = {"all-experts": _all_experts_past_the_expert_count,
         "chunks-by-pair-count": _chunks_by_pair_count,
         "router-in-jnp": _router_in_jnp_on_many_rows}


@pytest.mark.parametrize("variant", [name if name == "all-experts" else
                                     pytest.param(name, marks=pytest.mark.slow)
                                     for name in WRONG])
def test_experts_computed_differently_by_row_count_are_caught(monkeypatch, variant):
    """The comparison of :func:`test_each_rows_experts_are_bitwise_its_one_row_call` fails
    for each variant of :data:`WRONG`."""
    WRONG[variant](monkeypatch)
    config, layers = _layers(jnp.float32)
    assert not all(_each_row_alone_is_the_same(config, layers, _rows(config, jnp.float32))[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,packed", [(jnp.float32, True), (jnp.bfloat16, True),
                                          (jnp.float32, False)],
                         ids=["fp32-packed", "bf16-packed", "fp32-unpacked"])
def test_every_node_on_a_path_is_bitwise_the_ar_step_with_experts(dtype, packed,
                                                                  monkeypatch):
    """Whole models (2 layers of :data:`EXPERTS`): every node on a path of the 17-node tree
    (34 pairs) is bitwise ``ar``'s one-token step (2 pairs); the packed attention kernel
    (what a GPU runs, the experts on the pass's tokens only) and the unpacked one."""
    if not packed:
        _unpacked(monkeypatch)
    config = _tiny_config(**EXPERTS)
    assert all(_path_versus_tree(config, _feature_params(config, dtype), 12))


@pytest.mark.slow
def test_the_switch_to_every_expert_is_caught_in_a_whole_model(monkeypatch):
    _all_experts_past_the_expert_count(monkeypatch)
    config = _tiny_config(**EXPERTS)
    assert not all(_path_versus_tree(config, _feature_params(config), 12))
