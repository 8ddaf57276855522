"""Command R (``cohere``) and Command R7B (``cohere2``) on the shared decoder: one LayerNorm
without a bias per block, attention and MLP side by side, RoPE on adjacent pairs (the key
rules reorder q and k), scaled logits; Command R7B slides three layers of every four."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import (Family, eos_tuple, every_nth_global, get, hf_keys,
                                     refuse_partial_rope, sliding_layers, windows_of)
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


FAMILY = Family('cohere', ("cohere", "cohere2"), ("cohere", "cohere2"), from_hf, to_hf)
