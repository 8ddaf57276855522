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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.models.layers import dense, layer_norm


def param_shapes(config: ModelConfig) -> dict:
    """The parameter tree of ``config`` with shapes as leaves."""
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
    q = dense(h, p["wq"], p["bq"]).reshape(t, heads, dim)
    k = dense(h, p["wk"], p["bk"]).reshape(t, heads, dim)
    v = dense(h, p["wv"], p["bv"]).reshape(t, heads, dim)
    x = x + dense(attend(q, k, v).reshape(t, heads * dim), p["wo"], p["bo"])
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"], config.norm_eps)
    h = jax.nn.gelu(dense(h, p["w_fc"], p["b_fc"]), approximate=True)
    return x + dense(h, p["w_proj"], p["b_proj"]), k, v


def final_norm(params, config: ModelConfig, x: jax.Array) -> jax.Array:
    return layer_norm(x, params["final_norm_scale"], params["final_norm_bias"], config.norm_eps)
