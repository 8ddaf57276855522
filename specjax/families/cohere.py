"""Command R (``cohere``) and Command R7B (``cohere2``) on the shared decoder: one LayerNorm
without a bias per block, attention and MLP side by side, RoPE on adjacent pairs (the key
rules reorder q and k), scaled logits; Command R7B slides three layers of every four."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.families.common import (Family, GGUFArchitecture, eos_tuple, every_nth_global,
                                     float32_value, get, hf_keys, layer_norm_gguf_config,
                                     refuse_partial_rope, sliding_layers, windows_of)
from specjax.families.llama import GGUF_TENSOR_NAMES, llama_rules
from specjax.families.rules import Rule, halves_to_pairs, pairs_to_halves
from specjax.rope_scaling import rope_from_hf


def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """Command R (``cohere``) and Command R7B (``cohere2``) on the llama forward: one
    LayerNorm without a bias that attention and a SwiGLU MLP both read side by side, RoPE
    on adjacent pairs of each head (the key map reorders q's and k's rows per head into
    the halves this forward rotates: the scores are the same sums), logits times
    ``logit_scale``, a tied head. ``cohere2``: three sliding-window layers per global one
    (``layer_types``), RoPE in the sliding layers only. Command R+'s per-head q/k norms
    (``use_qk_norm``) are refused."""
    if cfg.get("use_qk_norm"):
        raise InvalidArgumentError(f"{model_type} with use_qk_norm (per-head q/k LayerNorms) "
                                   f"is not supported")
    refuse_partial_rope(model_type, cfg)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidArgumentError(f"unsupported {model_type} activation {act!r}; expected silu")
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    theta, scaling = rope_from_hf(cfg)
    bias = bool(cfg.get("attention_bias", False))
    windows, no_rope = (), ()
    if model_type == "cohere2":
        # A layer applies RoPE where it slides (transformers' Cohere2Attention rotates only
        # where its window is set): without a window, no layer does.
        window = cfg.get("sliding_window")
        if window:  # layer_types, else three sliding layers per global one
            sliding = sliding_layers(model_type, cfg, layers)
            windows = windows_of(int(window), sliding if sliding is not None
                                 else every_nth_global(cfg, layers, 4))
        no_rope = tuple(int(w > 0) for w in windows) or (0,)
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(get(cfg, "head_dim", default=width // heads)),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        norm_eps=float(get(cfg, "layer_norm_eps", default=1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias, out_bias=bias, mlp_bias=False,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family=model_type, norm_kind="layer_nobias", parallel_residual=True,
        shared_input_norm=True, logit_scale=float(get(cfg, "logit_scale", default=0.0625)),
        layer_windows=windows, no_rope_layers=no_rope)


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``cohere`` or ``cohere2`` model (the keys
    :func:`from_hf` reads)."""
    cohere2 = config.family == "cohere2"
    windows = config.windows_per_layer
    layout = dict(layer_types=["sliding_attention" if w else "full_attention" for w in windows],
                  sliding_window=max(windows) or None) if cohere2 else {}
    return hf_keys(config, config.family,
                   "Cohere2ForCausalLM" if cohere2 else "CohereForCausalLM",
                   head_dim=config.head_dim, hidden_act="silu", layer_norm_eps=config.norm_eps,
                   attention_bias=config.qkv_bias, logit_scale=config.logit_scale,
                   use_qk_norm=False, **layout)


def cohere_rules(config: ModelConfig) -> list[Rule]:
    """Rules for CohereForCausalLM and Cohere2ForCausalLM checkpoints: Llama's names, one
    LayerNorm (a scale) per block, q's and k's rows reordered per head from RoPE on
    adjacent pairs to RoPE on halves (:func:`pairs_to_halves`)."""
    p = "model.layers.{i}."

    def pairs_rule(leaf: str, name: str, heads: int, weight: bool) -> Rule:
        if weight:  # [H*D, d] -> [d, H*D]
            return Rule(name, (leaf,), lambda a: (pairs_to_halves(a, heads).T,),
                        lambda a: halves_to_pairs(np.asarray(a).T, heads))
        return Rule(name, (leaf,), lambda a: (pairs_to_halves(a, heads),),
                    lambda a: halves_to_pairs(np.asarray(a), heads))

    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    reordered = {f"layers/{kind}{x}" for kind in "wb" for x in "qk"}
    rules = [rule for rule in llama_rules(config)
             if rule.leaves[0] not in reordered and rule.leaves != ("layers/mlp_norm",)]
    rules += [pairs_rule(f"layers/w{x}", f"{p}self_attn.{x}_proj.weight", heads[x], True)
              for x in "qk"]
    if config.qkv_bias:
        rules += [pairs_rule(f"layers/b{x}", f"{p}self_attn.{x}_proj.bias", heads[x], False)
                  for x in "qk"]
    return rules


# ----------------------------------------------------------------------------- GGUF


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``command-r`` (Command R) or ``cohere2`` (Command R7B) file as
    llama.cpp's converter writes it (Llama's tensor names): q and k as the checkpoint stores
    them (RoPE on adjacent pairs, which the key rules reorder), ``logit_scale``, LayerNorm's
    epsilon; ``cohere2``: ``attention.sliding_window`` on three layers of every four
    (llama.cpp's fixed pattern, transformers' default one), RoPE on those only."""
    arch, meta, names = gguf.arch, gguf.meta, gguf.names
    family = {"model_type": "cohere" if arch == "command-r" else "cohere2",
              "num_key_value_heads": meta("attention.head_count_kv",
                                          meta("attention.head_count")),
              "logit_scale": float32_value(meta("logit_scale", kind=float)),
              "attention_bias": "blk.0.attn_q.bias" in names}
    if "blk.0.attn_q_norm.weight" in names:
        raise CheckpointError(f"{gguf.source}: a {arch} file with per-head q/k norms "
                              f"('blk.0.attn_q_norm.weight') is not supported")
    if arch == "cohere2":
        family.update(sliding_window=meta("attention.sliding_window", 0) or None,
                      sliding_window_pattern=4)
    return layer_norm_gguf_config(gguf, family, from_hf)


FAMILY = Family("cohere", ("cohere", "cohere2"), ("cohere", "cohere2"), from_hf, to_hf,
                key_rules=cohere_rules,
                gguf=tuple(GGUFArchitecture(arch, GGUF_TENSOR_NAMES, gguf_config)
                           for arch in ("command-r", "cohere2")))
