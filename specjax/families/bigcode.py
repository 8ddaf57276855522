"""GPTBigCode (StarCoder, StarCoderBase, SantaCoder) on the shared decoder: GPT-2's block
with one KV head (multi-query), learned positions and no RoPE."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import NEOX_ACTS, Family, eos_to_hf, eos_tuple, get

def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """GPTBigCode (StarCoder, StarCoderBase, SantaCoder) on the llama forward: GPT-2's block
    (LayerNorms with biases, biases on every projection, a two-matrix GELU MLP, learned
    positions, no RoPE) with one KV head when ``multi_query`` (else one per head), the head
    tied unless ``tie_word_embeddings`` is false; ``scale_attn_weights=False`` scores
    without the ``1/sqrt(D)``."""
    act = cfg.get("activation_function", "gelu_pytorch_tanh")
    if act not in NEOX_ACTS:
        raise InvalidArgumentError(f"unsupported gpt_bigcode activation {act!r}; expected one "
                                   f"of {sorted(NEOX_ACTS)}")
    width = int(get(cfg, "n_embd", "hidden_size"))
    heads = int(get(cfg, "n_head", "num_attention_heads"))
    if width % heads:
        raise InvalidArgumentError(f"gpt_bigcode n_head ({heads}) does not divide n_embd "
                                   f"({width})")
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(get(cfg, "n_layer", "num_hidden_layers")), num_heads=heads,
        num_kv_heads=1 if cfg.get("multi_query", True) else heads, head_dim=width // heads,
        intermediate_size=int(get(cfg, "n_inner", "intermediate_size", default=4 * width)),
        max_position_embeddings=int(get(cfg, "n_positions", "max_position_embeddings",
                                         default=1024)),
        norm_eps=float(get(cfg, "layer_norm_epsilon", "layer_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family="gpt_bigcode", hidden_act=NEOX_ACTS[act], norm_kind="layer", gated_mlp=False,
        query_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
        no_rope_layers=(0,), learned_positions=True)


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a ``gpt_bigcode`` model (the keys :func:`from_hf`
    reads)."""
    if config.num_kv_heads not in (1, config.num_heads):
        raise InvalidArgumentError(f"a gpt_bigcode model has one KV head or one per head, got "
                                   f"{config.num_kv_heads} of {config.num_heads}")
    return {
        "model_type": "gpt_bigcode", "architectures": ["GPTBigCodeForCausalLM"],
        "vocab_size": config.vocab_size, "n_embd": config.hidden_size,
        "n_layer": config.num_layers, "n_head": config.num_heads,
        "multi_query": config.num_kv_heads == 1 and config.num_heads > 1,
        "n_inner": config.intermediate_size, "n_positions": config.max_position_embeddings,
        "activation_function": "gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh",
        "layer_norm_epsilon": config.norm_eps,
        "scale_attn_weights": config.query_scale is None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": eos_to_hf(config.eos_token_ids), "bos_token_id": config.bos_token_id,
    }


FAMILY = Family('bigcode', ("gpt_bigcode",), ("gpt_bigcode",), from_hf, to_hf)
