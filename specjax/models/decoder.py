"""The shared decoder (``architecture="llama"``): every family but GPT-2 runs on it.

Its plain form is Llama's (Llama 2/3, SmolLM/SmolLM2, Qwen2, Mistral): RMSNorm, RoPE,
SwiGLU, GQA. The same block, switched by static fields (features) of
:class:`~specjax.config.ModelConfig` that each family's config sets, runs the families that
differ from Llama in a few places:

* Qwen3: RMSNorm on each head of q and k before RoPE (``qk_norm``); no q/k/v bias.
* Gemma 2: GeGLU (``hidden_act="gelu_tanh"``), RMSNorm by ``1 + w`` (``norm_plus_one``),
  embeddings times sqrt(d) (``embed_scale``), norms on the attention and MLP outputs too
  (``sandwich_norms``), soft-capped attention scores and logits (``attn_softcap``,
  ``final_softcap``), sliding-window layers alternating with global ones
  (``layer_windows``), scores scaled by ``query_pre_attn_scalar ** -0.5``
  (``query_scale``).
* Gemma 3 (text): Gemma 2 without soft-capping, with ``qk_norm``, five sliding layers per
  global one, and the sliding layers' own RoPE base (``local_rope_theta``).
* Phi-3: Llama itself once the checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` are
  split at load; its ``sliding_window`` slides every layer. Phi-3.5 and Phi-4-mini add
  LongRoPE scaling and (Phi-4-mini) partial rotary (``rotary_dim``).
* SmolLM3: Llama with every fourth layer a "NoPE" layer, attending without RoPE
  (``no_rope_layers``).
* Granite (3.x): Llama with four scalars: embeddings times ``embed_multiplier``, attention
  scores times ``query_scale``, each block output times ``residual_multiplier`` before its
  residual add, logits divided by ``logits_divisor``.
* OLMo 2: RMSNorm on the attention and MLP outputs only, none on their inputs
  (``sandwich_norms`` without ``pre_norms``), and on q and k over all their heads at once
  before RoPE (``qk_norm_whole``: weights [H*D] and [K*D]). OLMo 3 adds Gemma 3's layout:
  three sliding-window layers per global one, the scaling (YaRN) on the global layers'
  RoPE only (``local_rope_theta``).
* GPT-NeoX (Pythia): LayerNorm with biases (``norm_kind="layer"``), biases on q|k|v, the
  output and the MLP, RoPE on the first quarter of each head (``rotary_dim``), a GELU MLP of
  two matrices (``gated_mlp=False``: ``w_up``, ``w_down``), attention and MLP reading the
  block's input side by side (``parallel_residual``), an untied head.
* Phi (1, 1.5, 2): GPT-NeoX's block with one LayerNorm that attention and MLP both read
  (``shared_input_norm``), the tanh GELU, RoPE on part of each head, and a head with a
  bias (``head_bias``: ``lm_head_bias``).
* StarCoder2: GPT-NeoX's sequential block with grouped KV heads, the tanh GELU and a
  sliding window in every layer.
* GPTBigCode (StarCoder, SantaCoder): GPT-2's block with one KV head (multi-query) on this
  forward: learned positions added to the embedding (``learned_positions``:
  ``pos_embed``) and no RoPE in any layer.
* Command R, Command R7B (Cohere): Phi's one norm per block, as a LayerNorm without a
  bias (``norm_kind="layer_nobias"``), before attention and a SwiGLU MLP side by side;
  logits times ``logit_scale``. Their RoPE rotates adjacent pairs; the key map reorders q's
  and k's rows per head into the halves rotated here. Command R7B: three sliding-window
  layers with RoPE per global one without.
* Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: a routed mixture of experts in place of each MLP
  (``num_experts``, ``experts_per_token``, ``normalize_expert_weights``); Qwen2-MoE adds a
  gated shared expert (``shared_expert_size``) and q/k/v biases, Qwen3-MoE Qwen3's
  per-head q/k norms, OLMoE OLMo's whole-width ones with the usual input norms.

Per-layer differences stay data, not control flow: the layer loop reads layer ``i``'s
window from a constant [L] array at the loop index (:func:`layer_attention`), and picks
the local or global RoPE tables, or none, by it (:func:`layer_context`); one compiled layer
body serves every layer.

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
                  (no w_gate, b_gate without gated_mlp)
    layers/router [L, d, E]  layers/we_gate [L, E, d, F]  layers/we_up [L, E, d, F]
    layers/we_down [L, E, F, d]   (num_experts E: in place of w_gate, w_up, w_down)
    layers/ws_gate [L, d, S]  layers/ws_up [L, d, S]  layers/ws_down [L, S, d]
    layers/shared_gate [L, d, 1]  (shared_expert_size S: Qwen2-MoE's shared expert)
    layers/attn_norm_bias [L, d]  layers/mlp_norm_bias [L, d]  final_norm_bias [d]
                                  (LayerNorm's biases, norm_kind "layer"; no mlp_norm,
                                  mlp_norm_bias with shared_input_norm)
    final_norm  [d]
    pos_embed   [P, d]   (learned_positions: GPTBigCode; P = max_position_embeddings)
    lm_head     [d, V]   (absent when the head is tied to ``embed``)
    lm_head_bias [V]     (head_bias: Phi)
    layers/q_norm [L, D]  layers/k_norm [L, D]        (qk_norm; [L, H*D] and [L, K*D] with
                                                       qk_norm_whole)
    layers/post_attn_norm [L, d]  layers/post_mlp_norm [L, d]   (sandwich_norms; then
                                  attn_norm and mlp_norm are absent without pre_norms)
    fc          [2d, d]  (feature drafts only, ``config.feature_input``)
    feature_norm [d]     (feature drafts only: RMSNorm scale of the features read)
    feature_fc  [F*d, d] (multi-layer feature drafts, ``config.feature_layers``: fuses the
                          F target layers' outputs into the feature ``fc`` reads)
    draft_head  [K, d]   (``config.draft_vocab_size`` K: a head of its own over K ids...)
    draft_vocab [K]      (... int32, the full-vocabulary id of each of its rows; such a
                          model has no ``lm_head``, its ``embed`` is only the input table)

Fused projections (:func:`fuse_layers`, done once after loading, outside any jit): the
layer's q/k/v matrices concatenated along their output axis into ``w_qkv [L, d,
(H+2K)*D]`` (``b_qkv`` likewise) and gate/up into ``w_gate_up [L, d, 2F]`` (``b_gate_up``):
one matmul where there were three, and two, per layer. :func:`block` takes either layout;
checkpoints and their strict key mapping keep the separate matrices
(:func:`unfuse_layers` restores them exactly).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.config import ModelConfig
from specjax.models.experts_fused import experts_fused
from specjax.models.layers import (apply_rope, concat_shapes, dense, fuse_groups, gelu_tanh,
                                   layer_norm, matmul_precision, rms_norm, rope_tables,
                                   unfuse_groups, write_rope_rows)


# fused name -> the separate parameters it concatenates, in order, along the last axis.
FUSED_GROUPS = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"),
                "w_gate_up": ("w_gate", "w_up"), "b_gate_up": ("b_gate", "b_up")}


def param_shapes(config: ModelConfig, fused: bool = False) -> dict:
    """The parameter tree of ``config`` with shapes as leaves (``fused``: the fused
    projections' layout, see the module docstring)."""
    shapes = _param_shapes(config)
    if fused:
        shapes["layers"] = fuse_layers(shapes["layers"], concat=concat_shapes)
    return shapes


def fuse_layers(layers: dict, concat=None) -> dict:
    """The layer parameters with q|k|v and gate|up concatenated (see the module docstring).

    Args:
      layers: the ``layers`` subtree (stacked [L, ...] arrays), separate layout.
      concat: how to join a group (default: ``jnp.concatenate`` along the last axis).
    """
    return fuse_groups(layers, FUSED_GROUPS, concat)


def unfuse_layers(config: ModelConfig, layers: dict) -> dict:
    """Inverse of :func:`fuse_layers` (exact: a split of the concatenated arrays)."""
    return unfuse_groups(layers, FUSED_GROUPS, _group_widths(config))


def _group_widths(config: ModelConfig) -> dict:
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    f = config.intermediate_size
    return {"w_qkv": (q_width, kv_width, kv_width), "b_qkv": (q_width, kv_width, kv_width),
            "w_gate_up": (f, f), "b_gate_up": (f, f)}


def _param_shapes(config: ModelConfig) -> dict:
    d, L = config.hidden_size, config.num_layers
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    f = config.intermediate_size
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q_width), "wk": (L, d, kv_width),
        "wv": (L, d, kv_width), "wo": (L, q_width, d), "mlp_norm": (L, d),
        "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    if not config.pre_norms:
        del layers["attn_norm"], layers["mlp_norm"]
    elif config.norm_kind == "layer":
        layers.update(attn_norm_bias=(L, d), mlp_norm_bias=(L, d))
    if config.shared_input_norm:  # Phi: the MLP reads the attention's normed input
        layers.pop("mlp_norm", None)
        layers.pop("mlp_norm_bias", None)
    if not config.gated_mlp:
        del layers["w_gate"]
    if config.num_experts:  # a routed set of E experts in place of the one MLP
        e = config.num_experts
        del layers["w_gate"], layers["w_up"], layers["w_down"]
        layers.update(router=(L, d, e), we_gate=(L, e, d, f), we_up=(L, e, d, f),
                      we_down=(L, e, f, d))
        if config.shared_expert_size:  # Qwen2-MoE's shared expert and its gate
            s = config.shared_expert_size
            layers.update(ws_gate=(L, d, s), ws_up=(L, d, s), ws_down=(L, s, d),
                          shared_gate=(L, d, 1))
    if config.qkv_bias:
        layers.update(bq=(L, q_width), bk=(L, kv_width), bv=(L, kv_width))
    if config.out_bias:
        layers.update(bo=(L, d))
    if config.mlp_bias:
        layers.update(b_up=(L, f), b_down=(L, d))
        if config.gated_mlp:
            layers.update(b_gate=(L, f))
    if config.qk_norm_whole:
        layers.update(q_norm=(L, q_width), k_norm=(L, kv_width))
    elif config.qk_norm:
        layers.update(q_norm=(L, config.head_dim), k_norm=(L, config.head_dim))
    if config.sandwich_norms:
        layers.update(post_attn_norm=(L, d), post_mlp_norm=(L, d))
    shapes = {"embed": (config.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if config.norm_kind == "layer":
        shapes["final_norm_bias"] = (d,)
    if config.learned_positions:
        shapes["pos_embed"] = (config.max_position_embeddings, d)
    if config.feature_input:
        shapes["fc"] = (2 * d, d)
        shapes["feature_norm"] = (d,)
    if config.feature_layers:
        shapes["feature_fc"] = (len(config.feature_layers) * d, d)
    if config.draft_vocab_size:
        shapes["draft_head"] = (config.draft_vocab_size, d)
        shapes["draft_vocab"] = (config.draft_vocab_size,)
    else:
        if not config.tie_word_embeddings:
            shapes["lm_head"] = (d, config.vocab_size)
        if config.head_bias:
            shapes["lm_head_bias"] = (config.vocab_size,)
    return shapes


def fuse_features(params, config: ModelConfig, features: jax.Array) -> jax.Array:
    """The feature [T, d] a feature draft's ``fc`` reads, from the target's features
    [T, F*d] (``config.feature_layers``: the F layers' outputs, fused by ``feature_fc``) or
    [T, d] (its final-normed hidden states, read as they are)."""
    if not config.feature_layers:
        return features
    return dense(features.astype(params["feature_fc"].dtype), params["feature_fc"])


def embed(params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
          features: jax.Array | None = None):
    """Token embeddings [T, d]; a feature draft's (``config.feature_input``) are
    ``[embed(tokens); rms_norm(features)] @ fc`` with ``features`` [T, d] the target's
    features (normed with the draft's ``feature_norm``: a target's final-normed hidden
    states are typically an order of magnitude larger than its embeddings)."""
    x = jnp.take(params["embed"], tokens, axis=0)
    if config.learned_positions:  # GPTBigCode; clipped as GPT-2's (specjax.models.gpt2)
        x = x + jnp.take(params["pos_embed"], positions, axis=0, mode="clip")
    if config.embed_scale:  # Gemma: sqrt(d) rounded to the model dtype, then the product
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    if config.embed_multiplier is not None:  # Granite
        x = x * jnp.asarray(config.embed_multiplier, x.dtype)
    if config.feature_input:
        normed = rms_norm(features.astype(x.dtype), params["feature_norm"], config.norm_eps)
        x = dense(jnp.concatenate([x, normed], axis=-1), params["fc"])
    return x


def position_context(config: ModelConfig, positions: jax.Array):
    """RoPE (cos, sin) tables shared by every block; with ``config.local_rope_theta``, a
    pair (global tables, sliding layers' tables) that :func:`layer_context` picks from."""
    if config.local_rope_theta is None:
        return rope_tables(config, positions)
    return rope_tables(config, positions), rope_tables(config, positions, local=True)


def layer_windows(config: ModelConfig) -> jax.Array:
    """int32 [L]: each layer's sliding window, 0 for a global layer."""
    return jnp.asarray(config.windows_per_layer, jnp.int32)


def layer_context(config: ModelConfig, context, index):
    """Layer ``index``'s (cos, sin) from :func:`position_context`'s (``index`` traced); a
    layer without RoPE (``config.no_rope_layers``, SmolLM3's NoPE layers) gets the identity
    rotation, cos 1 and sin 0, which leaves q and k as they are."""
    if config.local_rope_theta is None:
        cos, sin = context
    else:
        sliding = layer_windows(config)[index] > 0
        (cos, sin), (cos_local, sin_local) = context
        cos, sin = jnp.where(sliding, cos_local, cos), jnp.where(sliding, sin_local, sin)
    if not config.no_rope_layers:
        return cos, sin
    rotates = jnp.asarray(config.rope_per_layer)[index]
    return jnp.where(rotates, cos, 1.0), jnp.where(rotates, sin, 0.0)


def layer_attention(config: ModelConfig, positions: jax.Array, mask: jax.Array, index):
    """Layer ``index``'s attention mask among the new tokens [T, T] and the keyword
    arguments of :func:`specjax.attention.attention` (score scale, soft-cap, the sliding
    window's first visible cache slot per query) for ``config``."""
    extras = dict(scale=config.query_scale, softcap=config.attn_softcap)
    if not config.layer_windows:
        return mask, extras
    window = layer_windows(config)[index]
    # Query at position p sees keys at positions p - window < p' <= p; window 0 is global.
    near = positions[:, None] - positions[None, :] < window
    mask = mask & ((window == 0) | near)
    lowest = jnp.iinfo(jnp.int32).min
    extras["first_visible"] = jnp.where(window > 0, positions - window + 1, lowest)
    return mask, extras


def _norm(config: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, config.norm_eps, plus_one=config.norm_plus_one)


def _block_norm(config: ModelConfig, x: jax.Array, p: dict, name: str) -> jax.Array:
    """``x`` normed by ``p[name]``: RMSNorm, or LayerNorm with ``p[name + "_bias"]`` for
    ``norm_kind="layer"`` and without a bias for ``"layer_nobias"``."""
    if config.norm_kind == "layer":
        return layer_norm(x, p[name], p[name + "_bias"], config.norm_eps)
    if config.norm_kind == "layer_nobias":
        return layer_norm(x, p[name], None, config.norm_eps)
    return _norm(config, x, p[name])


def _input_norm(config: ModelConfig, x: jax.Array, p: dict, name: str) -> jax.Array:
    """The attention's or MLP's input: ``x`` normed by ``p[name]`` (none without
    ``config.pre_norms``: OLMo 2/3)."""
    return _block_norm(config, x, p, name) if config.pre_norms else x


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh,
                "gelu": functools.partial(jax.nn.gelu, approximate=False)}


def _activation(config: ModelConfig):
    return _ACTIVATIONS[config.hidden_act]


def block(p, config: ModelConfig, x: jax.Array, rope, attend):
    """One decoder block (separate or fused projections). ``attend(q, k, v)`` runs
    attention; returns (x, k, v)."""
    cos, sin = rope
    t = x.shape[0]
    widths = _group_widths(config)
    h = _input_norm(config, x, p, "attn_norm")
    if "w_qkv" in p:
        q, k, v = jnp.split(dense(h, p["w_qkv"], p.get("b_qkv")),
                            np.cumsum(widths["w_qkv"])[:-1], axis=-1)
    else:
        q, k, v = (dense(h, p["wq"], p.get("bq")), dense(h, p["wk"], p.get("bk")),
                   dense(h, p["wv"], p.get("bv")))
    if config.qk_norm_whole:  # OLMo: over every head at once, before the split into heads
        q, k = _norm(config, q, p["q_norm"]), _norm(config, k, p["k_norm"])
    q = q.reshape(t, config.num_heads, config.head_dim)
    k = k.reshape(t, config.num_kv_heads, config.head_dim)
    v = v.reshape(t, config.num_kv_heads, config.head_dim)
    if config.qk_norm and not config.qk_norm_whole:
        q, k = _norm(config, q, p["q_norm"]), _norm(config, k, p["k_norm"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = attend(q, k, v).reshape(t, config.num_heads * config.head_dim)
    out = dense(a, p["wo"], p.get("bo"))
    if config.sandwich_norms:
        out = _norm(config, out, p["post_attn_norm"])
    if config.parallel_residual:  # GPT-NeoX: the MLP reads the block's input too
        mlp_in = h if config.shared_input_norm else _input_norm(config, x, p, "mlp_norm")
        mlp_out = _mlp(config, p, mlp_in, widths)
        return x + (out + mlp_out), k, v
    x = x + _residual(config, out)
    out = _mlp(config, p, _input_norm(config, x, p, "mlp_norm"), widths)
    if config.sandwich_norms:
        out = _norm(config, out, p["post_mlp_norm"])
    return x + _residual(config, out), k, v


def _mlp(config: ModelConfig, p: dict, h: jax.Array, widths: dict) -> jax.Array:
    """The MLP of normed input ``h``: ``down(act(gate) * up)``, or ``down(act(up))``
    without ``config.gated_mlp``; a mixture of experts with ``config.num_experts``."""
    if config.num_experts:
        return _experts(config, p, h)
    if not config.gated_mlp:
        return dense(_activation(config)(dense(h, p["w_up"], p.get("b_up"))), p["w_down"],
                     p.get("b_down"))
    if "w_gate_up" in p:
        gate, up = jnp.split(dense(h, p["w_gate_up"], p.get("b_gate_up")),
                             np.cumsum(widths["w_gate_up"])[:-1], axis=-1)
    else:
        gate, up = dense(h, p["w_gate"], p.get("b_gate")), dense(h, p["w_up"], p.get("b_up"))
    return dense(_activation(config)(gate) * up, p["w_down"], p.get("b_down"))


def _experts(config: ModelConfig, p: dict, h: jax.Array) -> jax.Array:
    """The mixture-of-experts MLP of normed input ``h`` [T, d]: each row runs the
    ``config.experts_per_token`` experts of highest router probability (a softmax in
    float32 of the router's logits, computed in the model dtype as transformers computes
    them), and the weighted outputs, each rounded to the model dtype, are summed in expert
    order.

    Which experts' weights are read is chosen by shape: ``T * k`` rows at most ``E``
    (decoding, small verify passes) gather the experts each row picked, so a decode step
    reads ``k`` experts' weights, not ``E``; more rows (prefill, wide trees) run every
    expert on every row and keep the picked outputs, reading each expert once. Either way
    a row's result depends on that row alone."""
    k, num = config.experts_per_token, config.num_experts
    probs = jax.nn.softmax(dense(h, p["router"]).astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, k)  # [T, k]
    if config.normalize_expert_weights:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    order = jnp.argsort(chosen, axis=-1)
    chosen = jnp.take_along_axis(chosen, order, axis=-1)
    weights = jnp.take_along_axis(weights, order, axis=-1)
    act = _activation(config)
    dtype = h.dtype
    precision = matmul_precision(h)

    def mm(spec, x, w):
        return jnp.einsum(spec, x, w.astype(dtype), precision=precision)

    if h.shape[0] * k <= num:
        gate = mm("td,tkdf->tkf", h, p["we_gate"][chosen])
        up = mm("td,tkdf->tkf", h, p["we_up"][chosen])
        out = mm("tkf,tkfd->tkd", act(gate) * up, p["we_down"][chosen])
    else:
        gate = mm("td,edf->tef", h, p["we_gate"])
        up = mm("td,edf->tef", h, p["we_up"])
        out = mm("tef,efd->ted", act(gate) * up, p["we_down"])
        out = jnp.take_along_axis(out, chosen[:, :, None], axis=1)
    out = jnp.sum((out.astype(jnp.float32) * weights[:, :, None]).astype(dtype), axis=1)
    if config.shared_expert_size:  # every row's shared expert, scaled by its own gate
        shared = dense(act(dense(h, p["ws_gate"])) * dense(h, p["ws_up"]), p["ws_down"])
        out = out + jax.nn.sigmoid(dense(h, p["shared_gate"])) * shared
    return out


def _residual(config: ModelConfig, out: jax.Array) -> jax.Array:
    """A block's attention or MLP output as its residual add takes it (Granite scales it by
    ``config.residual_multiplier``)."""
    if config.residual_multiplier is None:
        return out
    return out * jnp.asarray(config.residual_multiplier, out.dtype)


def _fused_input(config: ModelConfig, layers: dict, name: str, x: jax.Array, index,
                 interpret_variant: str, stacked: bool = True):
    """(rows, norm weight) for a fused projection that reads ``x`` normed by ``name``:
    Llama's RMSNorm is folded into the projection kernel (x as it is, the weight); other
    norms (LayerNorm, ``1 + w``) run in the row-tiled norm kernel
    :func:`specjax.kernels.norm_groups` first (normed rows, ``None``); without
    ``config.pre_norms``, (x, ``None``). ``stacked``: ``layers[name]`` is [L, d] (read at
    ``index``), else [d] (the final norm)."""
    if not config.pre_norms and name != "final_norm":
        return x, None
    if config.norm_kind == "rms" and not config.norm_plus_one:
        return x, layers[name]
    kind = "layer" if config.norm_kind != "rms" else "rms_plus_one"
    weight, bias = layers[name], layers.get(name + "_bias")
    if not stacked:
        weight, bias, index = weight[None], None if bias is None else bias[None], 0
    h = kernels.norm_groups(x, weight, index, start=0, groups=1, eps=config.norm_eps,
                            kind=kind, bias=bias, interpret_variant=interpret_variant)
    return h, None


def fused_final_input(params: dict, config: ModelConfig, x: jax.Array,
                      interpret_variant: str):
    """(rows, norm weight) for the fused head's call: :func:`_fused_input` of the final
    norm."""
    return _fused_input(config, params, "final_norm", x, 0, interpret_variant, stacked=False)


def _project_qkv(layers: dict, index, config: ModelConfig, h: jax.Array, linear, norm):
    """The fused layers' q|k|v rows [rows, (H + 2K) * D] of the (padded) residual stream
    ``h`` (with ``norm``, the RMSNorm weight folded in; :func:`_fused_input`), one call
    over a fused matrix, else three calls joined."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    kwargs = dict(norm=norm, layer=index, eps=config.norm_eps)
    if "w_qkv" in layers:
        return linear(h, (layers["w_qkv"],), biases=(layers.get("b_qkv"),), offsets=(0,),
                      width=q_width + 2 * kv_width, **kwargs)
    return jnp.concatenate([
        linear(h, (layers[w],), biases=(layers.get(b),), offsets=(0,), width=width, **kwargs)
        for w, b, width in (("wq", "bq", q_width), ("wk", "bk", kv_width),
                            ("wv", "bv", kv_width))], axis=-1)


def _kind(config: ModelConfig) -> str:
    """The norm kernel's kind of ``config``'s RMSNorms (q/k and output norms)."""
    return "rms_plus_one" if config.norm_plus_one else "rms"


def _qk_norms(layers: dict, index, config: ModelConfig, qkv: jax.Array,
              interpret_variant: str) -> jax.Array:
    """The q|k|v rows [rows, (H + 2K) * D] with q and k RMSNorm'd (``config.qk_norm``: per
    head, or over all heads at once with ``qk_norm_whole``) by the row-tiled kernel
    :func:`specjax.kernels.norm_groups`, in place: a reduction, so not written in jnp
    between the kernels (XLA may tile it by the row count)."""
    if not config.qk_norm:
        return qkv
    heads, kv_heads = (1, 1) if config.qk_norm_whole else (config.num_heads,
                                                           config.num_kv_heads)
    for weight, start, groups in ((layers["q_norm"], 0, heads),
                                  (layers["k_norm"], config.num_heads * config.head_dim,
                                   kv_heads)):
        qkv = kernels.norm_groups(qkv, weight, index, start=start, groups=groups,
                                  eps=config.norm_eps, kind=_kind(config),
                                  interpret_variant=interpret_variant)
    return qkv


def _add_output(config: ModelConfig, linear, x: jax.Array, h: jax.Array, weight, bias,
                index, post_norm=None, interpret_variant: str = "gpu") -> jax.Array:
    """``x + h @ weight + bias``, the residual add folded into the kernel; with Granite's
    ``residual_multiplier``, ``x + (h @ weight + bias) * m`` elementwise after it (as
    :func:`block` rounds it; elementwise, so the same arithmetic per row at any row
    count). ``post_norm`` [L, d] (``config.sandwich_norms``): the product RMSNorm'd by the
    row-tiled norm kernel (one group of width d) before the residual add."""
    if config.residual_multiplier is None and post_norm is None:
        return linear(h, (weight,), biases=(bias,), residual=x, layer=index,
                      eps=config.norm_eps)
    out = linear(h, (weight,), biases=(bias,), layer=index, eps=config.norm_eps)
    return x + _residual(config, _output_norm(config, out, post_norm, index,
                                              interpret_variant))


def _output_norm(config: ModelConfig, out: jax.Array, post_norm, index,
                 interpret_variant: str) -> jax.Array:
    """``out`` RMSNorm'd by ``post_norm`` [L, d] in the row-tiled norm kernel (one group of
    width d; ``config.sandwich_norms``), or as it is without one."""
    if post_norm is None:
        return out
    return kernels.norm_groups(out, post_norm, index, start=0, groups=1, eps=config.norm_eps,
                               kind=_kind(config), interpret_variant=interpret_variant)


def _gate_up(layers: dict, index, config: ModelConfig, h: jax.Array, norm, linear):
    """The down projection's input, one kernel call on ``h`` (``norm`` folded in, as
    :func:`_fused_input` gives it): gate|up with the gated activation (SwiGLU, GeGLU), or
    without ``config.gated_mlp`` the activation of up (the epilogue's ``activation``)."""
    f = config.intermediate_size
    if not config.gated_mlp:
        return linear(h, (layers["w_up"],), norm=norm, biases=(layers.get("b_up"),),
                      layer=index, eps=config.norm_eps, activation=config.hidden_act)
    activation = None if config.hidden_act == "silu" else config.hidden_act
    if "w_gate_up" in layers:
        pair, biases, offsets = ((layers["w_gate_up"],) * 2, (layers.get("b_gate_up"),) * 2,
                                 (0, f))
    else:
        pair, biases, offsets = ((layers["w_gate"], layers["w_up"]),
                                 (layers.get("b_gate"), layers.get("b_up")), (0, 0))
    return linear(h, pair, norm=norm, biases=biases, layer=index, offsets=offsets, width=f,
                  eps=config.norm_eps, **({} if activation is None else
                                          {"activation": activation}))


def _attention_out_and_mlp(layers: dict, index, config: ModelConfig, x: jax.Array,
                           a: jax.Array, linear, interpret_variant: str, attn_input,
                           num_tokens: int):
    """The rest of a fused layer after attention's output ``a`` [rows, H*D]: o with the
    residual, then the norm + gate|up + SwiGLU, then down with the residual (output norms
    with ``config.sandwich_norms``; a mixture of experts, run on the first ``num_tokens``
    rows, with ``config.num_experts``: :func:`.experts_fused.experts_fused`). With
    ``config.parallel_residual`` (GPT-NeoX, Phi, Cohere) the MLP reads the block's input
    (``attn_input``, the attention's (rows, norm) with ``shared_input_norm``) and
    ``x + (o + mlp)`` is added elementwise, as :func:`block` adds it."""
    def experts(h, norm):
        return experts_fused(layers, index, config, h, norm, linear, num_tokens=num_tokens,
                             interpret_variant=interpret_variant)

    if config.parallel_residual:
        out = linear(a, (layers["wo"],), biases=(layers.get("bo"),), layer=index,
                     eps=config.norm_eps)
        out = _output_norm(config, out, layers.get("post_attn_norm"), index,
                           interpret_variant)
        h, norm = attn_input if config.shared_input_norm else _fused_input(
            config, layers, "mlp_norm", x, index, interpret_variant)
        mlp = experts(h, norm) if config.num_experts else linear(
            _gate_up(layers, index, config, h, norm, linear), (layers["w_down"],),
            biases=(layers.get("b_down"),), layer=index, eps=config.norm_eps)
        return x + (out + mlp)
    x = _add_output(config, linear, x, a, layers["wo"], layers.get("bo"), index,
                    layers.get("post_attn_norm"), interpret_variant)
    h, norm = _fused_input(config, layers, "mlp_norm", x, index, interpret_variant)
    if config.num_experts:
        out = _output_norm(config, experts(h, norm), layers.get("post_mlp_norm"), index,
                           interpret_variant)
        return x + _residual(config, out)
    return _add_output(config, linear, x, _gate_up(layers, index, config, h, norm, linear),
                       layers["w_down"], layers.get("b_down"), index,
                       layers.get("post_mlp_norm"), interpret_variant)


def block_fused(layers: dict, index, config: ModelConfig, x: jax.Array, rope, attend,
                linear, *, interpret_variant: str = "gpu"):
    """:func:`block` with each projection one call of ``linear`` (the row-tiled kernels of
    :mod:`specjax.kernels.linear_gpu` / :mod:`~specjax.kernels.linear_tpu`, or their
    reference): RMSNorm folded into the q|k|v and gate|up calls, SwiGLU into gate|up, the
    residual adds into the o and down calls.

    Every feature of this decoder is taken, each computed the same way per row whatever the
    number of rows in the call: the elementwise ones between the kernels (scaled embeddings
    and Granite's multipliers, learned positions, a head bias, a logit scale or divisor,
    final logit soft-capping; partial RoPE and NoPE layers, which change the rotation
    tables), the query scale inside the ordered attention kernels, blocks without input
    norms (the kernels' norm left out), parallel attention and MLP (their sum added
    elementwise), and in the row-tiled norm kernel (:func:`specjax.kernels.norm_groups`):
    q/k norms (per head or over all heads), output norms (``sandwich_norms``), LayerNorm
    (with or without biases) and Gemma's ``1 + w`` RMSNorm; GELU (tanh or erf; gated, or of
    a two-matrix MLP's up projection) in the projection kernels' epilogue; attention
    soft-capping and sliding windows (and the sliding layers' own RoPE) in the ordered
    attention kernels, GPU and TPU (per score, and a mask by absolute position); mixtures of experts (:mod:`.experts_fused`: the router in
    the projection kernel, routing per row, each (row, slot) pair's expert a one-row call
    of the projection kernels, the k outputs and the gated shared expert added in a fixed
    order).

    ``layers`` are the stacked [L, ...] parameters (separate or fused projections), read at
    the traced ``index`` inside the kernels, so no layer's matrices are copied out.
    ``linear(x, weights, norm=, biases=, residual=, layer=, offsets=, width=, eps=)`` has
    the signature of :func:`specjax.kernels.fused_linear`. ``rope``: layer ``index``'s
    tables (:func:`layer_context`: NoPE layers' are the identity; partial RoPE's cover the
    first ``rope_dim`` dims). q/k norms run in :func:`_qk_norms`' kernel;
    ``interpret_variant`` picks its variant. Returns (x, k, v).

    ``x`` may carry rows past the T tokens (T = the RoPE tables' rows): the residual stream
    padded once per pass to the kernels' row tile (:func:`specjax.kernels.linear_row_tile`),
    so that no projection pads its input or slices its output. Those rows stay out of
    attention and the K/V (sliced off after q|k|v), and the kernels' rows are independent,
    so they change no bit of the real rows; x comes back with the same rows.
    """
    cos, sin = rope
    t, rows = cos.shape[0], x.shape[0]
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    attn_input = _fused_input(config, layers, "attn_norm", x, index, interpret_variant)
    qkv = _project_qkv(layers, index, config, attn_input[0], linear, attn_input[1])
    qkv = _qk_norms(layers, index, config, qkv, interpret_variant)[:t]
    q, k, v = jnp.split(qkv, (q_width, q_width + kv_width), axis=-1)
    q = q.reshape(t, config.num_heads, config.head_dim)
    k = k.reshape(t, config.num_kv_heads, config.head_dim)
    v = v.reshape(t, config.num_kv_heads, config.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = jnp.pad(attend(q, k, v).reshape(t, q_width), ((0, rows - t), (0, 0)))
    x = _attention_out_and_mlp(layers, index, config, x, a, linear, interpret_variant,
                               attn_input, t)
    return x, k, v


def block_fused_packed(layers: dict, index, config: ModelConfig, x: jax.Array, rope,
                       packed: jax.Array, attend, linear, *, interpret_variant: str = "gpu",
                       gpu_linear: str = "triton", num_tokens: int | None = None):
    """:func:`block_fused` for an attention kernel that reads the layer's rows in place
    (:func:`specjax.kernels.ordered_attention_packed`).

    The q|k|v rows, RoPE applied to q and k (``rope``: tables with x's rows), are written
    as layer ``index`` of ``packed`` [L, rows, H + 2K, D], a buffer the layer loop carries:
    one in-place write, which is also how each layer's K/V leave the loop. With fused
    q|k|v weights (and no q/k norms or partial RoPE) the projection, RoPE and the write
    are one call, :func:`specjax.kernels.qkv_rope_into` (one kernel on a GPU).
    ``attend(packed, index)`` returns the [rows, H*D] input of the output projection;
    ``interpret_variant`` and ``gpu_linear`` pick that kernel's variant and backend
    (:class:`~specjax.kernel_options.KernelOptions`). ``num_tokens``: the tokens among
    x's rows (``None``: every row), the rows a mixture of experts runs. Returns (x, packed).
    """
    cos, sin = rope
    heads = config.num_heads + config.num_kv_heads  # those RoPE rotates
    attn_input = _fused_input(config, layers, "attn_norm", x, index, interpret_variant)
    h, norm = attn_input
    if "w_qkv" in layers and not config.qk_norm and config.rope_dim == config.head_dim:
        # One launch on a GPU: the projection, RoPE and the write in one kernel.
        packed = kernels.qkv_rope_into(packed, h, layers["w_qkv"], cos, sin, index,
                                       norm=norm, bias=layers.get("b_qkv"),
                                       rope_heads=heads, eps=config.norm_eps,
                                       interpret_variant=interpret_variant,
                                       gpu_linear=gpu_linear)
    else:
        # q/k norms come between the projection and RoPE; partial RoPE pairs dims the
        # kernel's epilogue does not: the projection, then the jnp rotation and write.
        qkv = _qk_norms(layers, index, config,
                        _project_qkv(layers, index, config, h, linear, norm), interpret_variant)
        packed = write_rope_rows(packed, qkv, index, cos, sin, heads)
    x = _attention_out_and_mlp(layers, index, config, x, attend(packed, index), linear,
                               interpret_variant, attn_input,
                               x.shape[0] if num_tokens is None else num_tokens)
    return x, packed


def final_norm(params, config: ModelConfig, x: jax.Array) -> jax.Array:
    return _block_norm(config, x, params, "final_norm")
