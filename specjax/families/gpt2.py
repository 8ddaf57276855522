"""GPT-2: the one family on its own forward (:mod:`specjax.models.gpt2`: LayerNorm,
learned positions, a GELU MLP)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import Family, eos_tuple
from specjax.families.rules import Rule, same


def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig:
    """The config of a ``gpt2`` model."""
    width = int(cfg["n_embd"])
    heads = int(cfg["n_head"])
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise InvalidArgumentError(f"unsupported GPT-2 activation {act!r}; expected gelu_new")
    return ModelConfig(
        architecture="gpt2", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=int(cfg["n_layer"]), num_heads=heads, num_kv_heads=heads,
        head_dim=width // heads, intermediate_size=int(cfg.get("n_inner") or 4 * width),
        max_position_embeddings=int(cfg.get("n_positions", 1024)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), tie_word_embeddings=True,
        qkv_bias=True, out_bias=True, mlp_bias=True,
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
    )


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a GPT-2 model."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.intermediate_size,
        "n_positions": config.max_position_embeddings,
        "layer_norm_epsilon": config.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "eos_token_id": config.eos_token_ids[0] if config.eos_token_ids else None,
        "bos_token_id": config.bos_token_id,
    }


def gpt2_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPT2LMHeadModel checkpoints (HF ``Conv1D`` weights are already [in, out])."""
    p = "h.{i}."

    def split3(a):
        return tuple(np.split(a, 3, axis=-1))

    def join3(q, k, v):
        return np.concatenate([q, k, v], axis=-1)

    return [
        same("embed", "wte.weight"),
        same("pos_embed", "wpe.weight"),
        same("final_norm_scale", "ln_f.weight"),
        same("final_norm_bias", "ln_f.bias"),
        same("layers/ln1_scale", p + "ln_1.weight"),
        same("layers/ln1_bias", p + "ln_1.bias"),
        same("layers/ln2_scale", p + "ln_2.weight"),
        same("layers/ln2_bias", p + "ln_2.bias"),
        Rule(p + "attn.c_attn.weight", ("layers/wq", "layers/wk", "layers/wv"), split3, join3),
        Rule(p + "attn.c_attn.bias", ("layers/bq", "layers/bk", "layers/bv"), split3, join3),
        same("layers/wo", p + "attn.c_proj.weight"),
        same("layers/bo", p + "attn.c_proj.bias"),
        same("layers/w_fc", p + "mlp.c_fc.weight"),
        same("layers/b_fc", p + "mlp.c_fc.bias"),
        same("layers/w_proj", p + "mlp.c_proj.weight"),
        same("layers/b_proj", p + "mlp.c_proj.bias"),
    ]


def _checkpoint_name(name: str, config: ModelConfig) -> str:
    """GPT-2 checkpoints appear both with and without the "transformer." prefix."""
    return name[len("transformer."):] if name.startswith("transformer.") else name


FAMILY = Family("gpt2", ("gpt2",), ("gpt2",), from_hf, to_hf, key_rules=gpt2_rules,
                checkpoint_name=_checkpoint_name, export_prefix="transformer.")
