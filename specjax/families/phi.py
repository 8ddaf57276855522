"""Phi (1, 1.5, 2) on the shared decoder: GPT-NeoX's parallel block with one LayerNorm,
biases everywhere, the head's included."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import GELU_TANH, Family, eos_tuple, get, hf_keys
from specjax.rope_scaling import rope_from_hf

def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """Phi-1, 1.5 and 2 on the llama forward: GPT-NeoX's parallel block with one LayerNorm
    that attention and MLP both read, biases on every projection, the tanh GELU, RoPE on the
    first ``partial_rotary_factor`` of each head, a head with a bias. The per-head q/k
    LayerNorms of ``qk_layernorm`` (no released checkpoint has them) are refused."""
    if cfg.get("qk_layernorm"):
        raise InvalidArgumentError("phi with qk_layernorm (per-head q/k LayerNorms) is not "
                                   "supported")
    act = cfg.get("hidden_act", "gelu_new")
    if act not in GELU_TANH + ("gelu_fast",):
        raise InvalidArgumentError(f"unsupported phi activation {act!r}; expected gelu_new")
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    head_dim = width // heads
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(get(cfg, "partial_rotary_factor",
                         default=rope.get("partial_rotary_factor", 0.5)))
    theta, scaling = rope_from_hf(cfg)
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("layer_norm_eps", 1e-5)), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="phi", hidden_act="gelu_tanh", norm_kind="layer", gated_mlp=False,
        parallel_residual=True, shared_input_norm=True, head_bias=True,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial))


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``phi`` model (the keys :func:`from_hf` reads)."""
    return hf_keys(config, "phi", "PhiForCausalLM", hidden_act="gelu_new",
                    layer_norm_eps=config.norm_eps, qk_layernorm=False,
                    partial_rotary_factor=config.rope_dim / config.head_dim)


FAMILY = Family('phi', ("phi",), ("phi",), from_hf, to_hf)
