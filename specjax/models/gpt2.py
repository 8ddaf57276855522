"""GPT-2: learned positions, pre-LayerNorm blocks, GELU (tanh) MLP, tied head.

Parameter tree (layers stacked on a leading axis L; matrices stored [in, out], which is
also how HF's ``Conv1D`` stores them)::

    embed      [V, d]        pos_embed [P, d]
    layers/ln1_scale [L, d]  layers/ln1_bias [L, d]
    layers/wq, wk, wv [L, d, d]   layers/bq, bk, bv [L, d]
    layers/wo  [L, d, d]     layers/bo [L, d]
    layers/ln2_scale [L, d]  layers/ln2_bias [L, d]
    layers/w_fc [L, d, F]    layers/b_fc [L, F]
    layers/w_proj [L, F, d]  layers/b_proj [L, d]
    final_norm_scale [d]     final_norm_bias [d]

Fused projections (:func:`fuse_layers`, once after loading, outside any jit): q|k|v as
``w_qkv [L, d, 3 * H * D]`` and ``b_qkv [L, 3 * H * D]`` (HF's own ``c_attn`` layout), one
matmul where there were three; :func:`unfuse_layers` restores the separate matrices exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.models.layers import (concat_shapes, dense, fuse_groups, layer_norm,
                                   unfuse_groups)

# fused name -> the separate parameters it concatenates, in order, along the last axis.
FUSED_GROUPS = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv")}


def param_shapes(config: ModelConfig, fused: bool = False) -> dict:
    """The parameter tree of ``config`` with shapes as leaves (``fused``: q|k|v fused)."""
    shapes = _param_shapes(config)
    if fused:
        shapes["layers"] = fuse_layers(shapes["layers"], concat=concat_shapes)
    return shapes


def fuse_layers(layers: dict, concat=None) -> dict:
    """The layer parameters with q|k|v concatenated (see the module docstring)."""
    return fuse_groups(layers, FUSED_GROUPS, concat)


def unfuse_layers(config: ModelConfig, layers: dict) -> dict:
    """Inverse of :func:`fuse_layers` (exact)."""
    width = config.num_heads * config.head_dim
    return unfuse_groups(layers, FUSED_GROUPS,
                         {name: (width,) * 3 for name in FUSED_GROUPS})


def _param_shapes(config: ModelConfig) -> dict:
    d, L, f = config.hidden_size, config.num_layers, config.intermediate_size
    width = config.num_heads * config.head_dim
    layers = {
        "ln1_scale": (L, d), "ln1_bias": (L, d),
        "wq": (L, d, width), "bq": (L, width), "wk": (L, d, width), "bk": (L, width),
        "wv": (L, d, width), "bv": (L, width), "wo": (L, width, d), "bo": (L, d),
        "ln2_scale": (L, d), "ln2_bias": (L, d),
        "w_fc": (L, d, f), "b_fc": (L, f), "w_proj": (L, f, d), "b_proj": (L, d),
    }
    return {"embed": (config.vocab_size, d), "pos_embed": (config.max_position_embeddings, d),
            "layers": layers, "final_norm_scale": (d,), "final_norm_bias": (d,)}


def embed(params, config: ModelConfig, tokens: jax.Array, positions: jax.Array):
    del config
    # Positions past the table occur only for rows that are never kept (prompt padding up
    # to its bucket, speculative nodes past max_length at the position limit). jnp.take's
    # default fills them with NaN, and a NaN value row poisons every query of the pass
    # (a masked slot still contributes 0 * NaN); clipping keeps them finite.
    x = (jnp.take(params["embed"], tokens, axis=0)
         + jnp.take(params["pos_embed"], positions, axis=0, mode="clip"))
    return x


def position_context(config: ModelConfig, positions: jax.Array):
    return None


def block(p, config: ModelConfig, x: jax.Array, context, attend):
    """One GPT-2 block. ``attend(q, k, v)`` runs attention; returns (x, k, v)."""
    del context
    t, heads, dim = x.shape[0], config.num_heads, config.head_dim
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"], config.norm_eps)
    if "w_qkv" in p:
        q, k, v = jnp.split(dense(h, p["w_qkv"], p["b_qkv"]), 3, axis=-1)
    else:
        q, k, v = (dense(h, p[w], p[b]) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    q, k, v = (a.reshape(t, heads, dim) for a in (q, k, v))
    x = x + dense(attend(q, k, v).reshape(t, heads * dim), p["wo"], p["bo"])
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"], config.norm_eps)
    h = jax.nn.gelu(dense(h, p["w_fc"], p["b_fc"]), approximate=True)
    return x + dense(h, p["w_proj"], p["b_proj"]), k, v


def final_norm(params, config: ModelConfig, x: jax.Array) -> jax.Array:
    return layer_norm(x, params["final_norm_scale"], params["final_norm_bias"], config.norm_eps)
