"""The fused layers' mixture of experts (``attn_impl="fused"``): what
:func:`specjax.models.decoder._experts` computes, with each row's arithmetic independent of
how many rows the pass has, so that a verify pass reproduces the one-token step bit for bit.

* The router's logits: one call of the row-tiled projection kernel
  (:func:`specjax.kernels.fused_linear`), in the model dtype. A router whose E columns are
  not a multiple of the kernel's 16-column tile (Mixtral's 8, Qwen2-MoE's 60) is read at
  the layer and padded with zero columns (a [d, E] copy per layer), which change no other
  column.
* The float32 softmax, top-k, the renormalisation and the sort by expert id: per row;
  each sum over a row is a chain of additions in column order (:func:`sum_in_order`), not
  a jnp reduction (XLA may tile those by the row count), and top-k a sort on unique keys
  (ties broken by id whatever algorithm XLA picks for the shape).
* Each (row, slot) pair runs its expert as a one-row call: that row alone through the
  gate|up kernel (SwiGLU in its epilogue) and the down kernel, reading the expert's
  matrices in place (the stacked ``[L, E, ...]`` weights seen as ``[L*E, ...]``, read at
  ``layer * E + expert``). The pairs are a ``jax.vmap`` of that one-row function: Pallas
  batches the kernel call (one more grid axis on a GPU, Triton's or Mosaic GPU's; a loop
  of calls on a TPU, whose kernel reads the layer as a prefetched scalar), so each pair's
  program is exactly the one-row call's. No path is chosen by the number of rows (the jnp
  MLP runs every expert on every row past ``T * k > E``).
* The k weighted outputs, each rounded to the model dtype, are added in expert order in the
  model dtype; Qwen2-MoE's shared expert runs through the same kernels on every row and is
  scaled by the sigmoid of its gate (a one-column projection, padded like the router).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import kernels
from specjax.config import ModelConfig

# Output columns the projection kernels take a multiple of (the Triton kernel's tile).
COLUMN_TILE = 16


def sum_in_order(parts) -> jax.Array:
    """``parts[0] + parts[1] + ...``, left to right: elementwise additions in a fixed
    order, whatever the shapes."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def route(config: ModelConfig, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [R, k], experts int32 [R, k]) of router ``logits`` [R, E]: the k
    experts of highest softmax probability (renormalised with
    ``config.normalize_expert_weights``), sorted by expert id, as
    :func:`~specjax.models.decoder._experts` picks them; every sum is
    :func:`sum_in_order` over a row's columns."""
    k = config.experts_per_token
    logits = logits.astype(jnp.float32)
    exp = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # a max is exact
    probs = exp / sum_in_order([exp[:, j] for j in range(exp.shape[1])])[:, None]
    # lax.top_k's order (probability down, the lower id first on a tie) as a sort on the
    # unique keys (-probability, id): one result whatever algorithm XLA picks for the
    # shape (its GPU TopK kernel or a sort), so a tie (equal bfloat16 logits) is broken
    # the same way in a one-row step and in a verify pass.
    ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, 1)
    negated, ids = jax.lax.sort((-probs, ids), dimension=1, num_keys=2)
    weights, chosen = -negated[:, :k], ids[:, :k]
    if config.normalize_expert_weights:
        weights = weights / sum_in_order([weights[:, j] for j in range(k)])[:, None]
    chosen, weights = jax.lax.sort((chosen, weights), dimension=1, num_keys=1)  # by id
    return weights, chosen


def project_narrow(linear, h: jax.Array, weight: jax.Array, index, eps: float) -> jax.Array:
    """``h @ weight[index]`` ([rows, N]) by ``linear`` for stacked ``weight`` [L, d, N] of
    any N: in place when N is a multiple of :data:`COLUMN_TILE`, else the layer's matrix
    padded with zero columns to one (the router, the shared expert's gate)."""
    width = weight.shape[-1]
    if width % COLUMN_TILE == 0:
        return linear(h, (weight,), layer=index, eps=eps)
    matrix = jax.lax.dynamic_index_in_dim(weight, index, keepdims=False)
    matrix = jnp.pad(matrix, ((0, 0), (0, -width % COLUMN_TILE)))
    return linear(h, (matrix,), eps=eps)[:, :width]


def expert_pairs(layers: dict, index, config: ModelConfig, rows: jax.Array,
                 experts: jax.Array, linear) -> jax.Array:
    """Expert ``experts[p]`` of layer ``index`` on row ``rows[p]`` ([P, d] -> [P, d]), each
    pair a one-row call of the projection kernels (see the module docstring)."""
    num = config.num_experts
    flat = {name: layers[name].reshape(-1, *layers[name].shape[2:])
            for name in ("we_gate", "we_up", "we_down")}  # [L*E, ...]: free reshapes
    activation = {} if config.hidden_act == "silu" else {"activation": config.hidden_act}

    def one_row(row, layer):
        gated = linear(row[None], (flat["we_gate"], flat["we_up"]), layer=layer,
                       offsets=(0, 0), width=config.intermediate_size, eps=config.norm_eps,
                       **activation)
        return linear(gated, (flat["we_down"],), layer=layer, eps=config.norm_eps)[0]

    return jax.vmap(one_row)(rows, index * num + experts)


def experts_fused(layers: dict, index, config: ModelConfig, h: jax.Array, norm, linear, *,
                  num_tokens: int, interpret_variant: str = "gpu") -> jax.Array:
    """The mixture-of-experts MLP's output [rows, d] of the fused layers' rows ``h``
    [rows, d] (``norm``: the RMSNorm weight [L, d] to apply first, or ``None`` when ``h`` is
    normed already, as :func:`~specjax.models.decoder._fused_input` gives them).

    ``linear`` is :func:`specjax.kernels.fused_linear` with the run's options bound, as
    :func:`~specjax.models.decoder.block_fused` takes it. Only the first ``num_tokens``
    rows run experts; the rows past them (the pass padded to the kernels' row tile) get
    zeros, and the shared expert's product like every row.
    """
    if norm is not None:  # one normed copy that the router and every expert read
        h = kernels.norm_groups(h, norm, index, start=0, groups=1, eps=config.norm_eps,
                                kind="rms", interpret_variant=interpret_variant)
    k, dtype = config.experts_per_token, h.dtype
    weights, chosen = route(config, project_narrow(linear, h, layers["router"], index,
                                                   config.norm_eps))
    weights, chosen = weights[:num_tokens], chosen[:num_tokens]
    outs = expert_pairs(layers, index, config, jnp.repeat(h[:num_tokens], k, axis=0),
                        chosen.reshape(-1), linear).reshape(num_tokens, k, -1)
    terms = (outs.astype(jnp.float32) * weights[:, :, None]).astype(dtype)
    out = sum_in_order([terms[:, j] for j in range(k)])
    out = jnp.pad(out, ((0, h.shape[0] - num_tokens), (0, 0)))
    if config.shared_expert_size:  # every row's shared expert, scaled by its own gate
        activation = {} if config.hidden_act == "silu" else {"activation": config.hidden_act}
        gated = linear(h, (layers["ws_gate"], layers["ws_up"]), layer=index, offsets=(0, 0),
                       width=config.shared_expert_size, eps=config.norm_eps, **activation)
        shared = linear(gated, (layers["ws_down"],), layer=index, eps=config.norm_eps)
        gate = project_narrow(linear, h, layers["shared_gate"], index, config.norm_eps)
        out = out + jax.nn.sigmoid(gate) * shared
    return out
