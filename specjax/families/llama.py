"""Llama and the families that load as Llama (Mistral, Qwen2, SmolLM, SmolLM2): the plain
form of the shared decoder, with biases where the config asks (Qwen2: on q, k and v)."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import Family, eos_to_hf, eos_tuple, get
from specjax.rope_scaling import rope_from_hf, rope_scaling_to_hf

MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2")


def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """The config of a ``llama``, ``mistral``, ``qwen2``, ``smollm`` or ``smollm2`` model."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise InvalidArgumentError(f"unsupported {model_type} activation {act!r}; expected silu")
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    theta, scaling = rope_from_hf(cfg)
    if model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        qkv_bias = out_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(get(cfg, "head_dim", default=width // heads)),
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(get(cfg, "rms_norm_eps", default=1e-6)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        sliding_window=int(window) if window else None,
    )


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a plain-decoder model: ``qwen2`` when q, k and v have
    biases and the output has none, else ``llama``."""
    if config.qkv_bias and not config.out_bias:
        model_type, arch = "qwen2", "Qwen2ForCausalLM"
    else:
        model_type, arch = "llama", "LlamaForCausalLM"
    out: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "eos_token_id": eos_to_hf(config.eos_token_ids),
        "bos_token_id": config.bos_token_id,
    }
    if model_type == "llama":
        out["attention_bias"] = config.qkv_bias
        out["mlp_bias"] = config.mlp_bias
    if config.rope_scaling is not None:
        out["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    return out


FAMILY = Family("llama", MODEL_TYPES, ("llama",), from_hf, to_hf)
