"""StarCoder2 on the shared decoder: LayerNorms, grouped KV heads, a two-matrix tanh-GELU
MLP, a sliding window in every layer."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import (NEOX_ACTS, Family, eos_tuple, get, hf_keys,
                                     refuse_partial_rope)
from specjax.rope_scaling import rope_from_hf

def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """StarCoder2 on the llama forward: pre-norm sequential blocks with LayerNorms (weights
    and biases), grouped KV heads, RoPE on the whole head, a two-matrix tanh-GELU MLP
    (``c_fc``, ``c_proj``), biases on every projection when ``use_bias``, the head tied to
    the embedding unless ``tie_word_embeddings`` is false; ``sliding_window`` slides every
    layer."""
    act = cfg.get("hidden_act", "gelu_pytorch_tanh")
    if act not in NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported starcoder2 activation {act!r}; expected one "
                                   f"of {sorted(NEOX_ACTS)}")
    refuse_partial_rope("starcoder2", cfg)
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    theta, scaling = rope_from_hf(cfg)
    bias = bool(cfg.get("use_bias", True))
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)),
        head_dim=width // heads, intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_eps=float(get(cfg, "norm_epsilon", "layer_norm_eps", default=1e-5)),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="starcoder2", hidden_act=NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        layer_windows=(int(window),) * layers if window else ())


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``starcoder2`` model (the keys
    :func:`from_hf` reads)."""
    return hf_keys(config, "starcoder2", "Starcoder2ForCausalLM",
                    hidden_act="gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh",
                    norm_epsilon=config.norm_eps, use_bias=config.qkv_bias,
                    sliding_window=max(config.windows_per_layer) or None)


FAMILY = Family('starcoder2', ("starcoder2",), ("starcoder2",), from_hf, to_hf)
