"""GPT-NeoX (Pythia, GPT-NeoX-20B) on the shared decoder: LayerNorms with biases, RoPE on
part of each head, a two-matrix GELU MLP, attention and MLP side by side."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import NEOX_ACTS, Family, eos_to_hf, eos_tuple, get
from specjax.rope_scaling import rope_from_hf, rope_scaling_to_hf

def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """GPT-NeoX (Pythia, GPT-NeoX-20B) on the llama forward: LayerNorm with biases, q|k|v
    with biases, RoPE on the first ``rotary_pct`` of each head, a two-matrix GELU MLP,
    parallel residual (``use_parallel_residual``), an untied head."""
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    act = cfg.get("hidden_act", "gelu")
    if act not in NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported gpt_neox activation {act!r}; expected one of "
                                   f"{sorted(NEOX_ACTS)}")
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(get(cfg, "partial_rotary_factor", "rotary_pct",
                         default=rope.get("partial_rotary_factor", 1.0)))
    if "rope_theta" not in cfg and "rope_theta" not in rope:
        cfg = {**cfg, "rope_theta": float(cfg.get("rotary_emb_base", 10000.0))}
    theta, scaling = rope_from_hf(cfg)
    head_dim = width // heads
    bias = bool(cfg.get("attention_bias", True))
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads,
        head_dim=head_dim, intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias, out_bias=bias, mlp_bias=True,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="gpt_neox", hidden_act=NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        rotary_dim=None if partial == 1.0 else int(head_dim * partial))


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``gpt_neox`` model (the keys :func:`from_hf`
    reads)."""
    out: dict[str, Any] = {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "gelu" if config.hidden_act == "gelu" else "gelu_new",
        "max_position_embeddings": config.max_position_embeddings,
        "layer_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.rope_dim / config.head_dim,
        "use_parallel_residual": config.parallel_residual,
        "attention_bias": config.qkv_bias, "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": eos_to_hf(config.eos_token_ids),
        "bos_token_id": config.bos_token_id,
    }
    if config.rope_scaling is not None:
        out["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    return out


FAMILY = Family('neox', ("gpt_neox",), ("gpt_neox",), from_hf, to_hf)
