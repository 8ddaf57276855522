"""Llama family (Llama 2/3, SmolLM/SmolLM2, Qwen2, Mistral): RMSNorm, RoPE, SwiGLU, GQA.

Parameter tree (layers stacked on a leading axis L so the blocks run under ``lax.scan``;
matrices are stored [in, out]; ``d`` = hidden size, ``F`` = intermediate size)::

    embed       [V, d]
    layers/attn_norm [L, d]      layers/mlp_norm [L, d]
    layers/wq   [L, d, H*D]      layers/bq [L, H*D]   (qkv_bias)
    layers/wk   [L, d, K*D]      layers/bk [L, K*D]   (qkv_bias)
    layers/wv   [L, d, K*D]      layers/bv [L, K*D]   (qkv_bias)
    layers/wo   [L, H*D, d]      layers/bo [L, d]     (out_bias)
    layers/w_gate [L, d, F]  layers/w_up [L, d, F]  layers/w_down [L, F, d]
    layers/b_gate [L, F]     layers/b_up [L, F]     layers/b_down [L, d]   (mlp_bias)
    final_norm  [d]
    lm_head     [d, V]   (absent when the head is tied to ``embed``)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.models.layers import apply_rope, dense, rms_norm, rope_tables


def param_shapes(config: ModelConfig) -> dict:
    """The parameter tree of ``config`` with shapes as leaves."""
    d, L = config.hidden_size, config.num_layers
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    f = config.intermediate_size
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q_width), "wk": (L, d, kv_width),
        "wv": (L, d, kv_width), "wo": (L, q_width, d), "mlp_norm": (L, d),
        "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    if config.qkv_bias:
        layers.update(bq=(L, q_width), bk=(L, kv_width), bv=(L, kv_width))
    if config.out_bias:
        layers.update(bo=(L, d))
    if config.mlp_bias:
        layers.update(b_gate=(L, f), b_up=(L, f), b_down=(L, d))
    shapes = {"embed": (config.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def embed(params, config: ModelConfig, tokens: jax.Array, positions: jax.Array):
    """Token embeddings [T, d]."""
    del config, positions
    return jnp.take(params["embed"], tokens, axis=0)


def position_context(config: ModelConfig, positions: jax.Array):
    """RoPE (cos, sin) tables shared by every block."""
    return rope_tables(config, positions)


def block(p, config: ModelConfig, x: jax.Array, rope, attend):
    """One decoder block. ``attend(q, k, v)`` runs attention; returns (x, k, v)."""
    cos, sin = rope
    t = x.shape[0]
    h = rms_norm(x, p["attn_norm"], config.norm_eps)
    q = dense(h, p["wq"], p.get("bq")).reshape(t, config.num_heads, config.head_dim)
    k = dense(h, p["wk"], p.get("bk")).reshape(t, config.num_kv_heads, config.head_dim)
    v = dense(h, p["wv"], p.get("bv")).reshape(t, config.num_kv_heads, config.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = attend(q, k, v).reshape(t, config.num_heads * config.head_dim)
    x = x + dense(a, p["wo"], p.get("bo"))
    h = rms_norm(x, p["mlp_norm"], config.norm_eps)
    gate = jax.nn.silu(dense(h, p["w_gate"], p.get("b_gate")))
    x = x + dense(gate * dense(h, p["w_up"], p.get("b_up")), p["w_down"], p.get("b_down"))
    return x, k, v


def final_norm(params, config: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["final_norm"], config.norm_eps)
