"""GPTBigCode (StarCoder, StarCoderBase, SantaCoder) on the shared decoder: GPT-2's block
with one KV head (multi-query), learned positions and no RoPE."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.families.common import (NEOX_ACTS, Family, GGUFArchitecture, eos_to_hf, eos_tuple,
                                     get, layer_norm_gguf_config)
from specjax.families.rules import (Rule, layer_norm_rules, linear, linear_split,
                                    per_head_qkv_rules, same)


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


def bigcode_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPTBigCodeForCausalLM checkpoints (StarCoder, SantaCoder): GPT-2's names
    under ``transformer.``, Linear weights ([out, in]), ``c_attn`` rows q | k | v with one
    KV head (multi-query), or interleaved per head as GPT-NeoX's without."""
    p = "transformer.h.{i}."
    if config.num_kv_heads == config.num_heads and config.num_heads > 1:
        qkv_weight, qkv_bias = per_head_qkv_rules(config, p + "attn.c_attn")
    else:
        widths = (config.num_heads * config.head_dim,) + (config.head_dim,) * 2
        bounds = np.cumsum(widths)[:-1]
        qkv_weight = linear_split(("layers/wq", "layers/wk", "layers/wv"), p + "attn.c_attn.weight",
                              widths)
        qkv_bias = Rule(p + "attn.c_attn.bias", ("layers/bq", "layers/bk", "layers/bv"),
                        lambda a: tuple(np.split(a, bounds)), lambda *parts: np.concatenate(parts))
    rules = [
        same("embed", "transformer.wte.weight"), same("pos_embed", "transformer.wpe.weight"),
        *layer_norm_rules(("final_norm", "transformer.ln_f"),
                          ("layers/attn_norm", p + "ln_1"), ("layers/mlp_norm", p + "ln_2")),
        qkv_weight, qkv_bias,
        linear("layers/wo", p + "attn.c_proj.weight"), same("layers/bo", p + "attn.c_proj.bias"),
        linear("layers/w_up", p + "mlp.c_fc.weight"), same("layers/b_up", p + "mlp.c_fc.bias"),
        linear("layers/w_down", p + "mlp.c_proj.weight"),
        same("layers/b_down", p + "mlp.c_proj.bias"),
    ]
    if not config.tie_word_embeddings:
        rules.append(linear("lm_head", "lm_head.weight"))
    return rules


# ----------------------------------------------------------------------------- GGUF

# llama.cpp's ``starcoder``: GPT-2's names under "transformer."; attn_qkv is c_attn as the
# checkpoint stores it (q | k | v with one KV head).
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output.weight": "lm_head.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "transformer.ln_f"), ("blk.{i}.attn_norm", "transformer.h.{i}.ln_1"),
        ("blk.{i}.attn_qkv", "transformer.h.{i}.attn.c_attn"),
        ("blk.{i}.attn_output", "transformer.h.{i}.attn.c_proj"),
        ("blk.{i}.ffn_norm", "transformer.h.{i}.ln_2"),
        ("blk.{i}.ffn_up", "transformer.h.{i}.mlp.c_fc"),
        ("blk.{i}.ffn_down", "transformer.h.{i}.mlp.c_proj")) for kind in ("weight", "bias")},
}


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``starcoder`` file (StarCoder, SantaCoder: GPTBigCode) as llama.cpp's
    converter writes it: learned positions, one KV head (``attention.head_count_kv``),
    LayerNorm's epsilon."""
    heads = gguf.meta("attention.head_count")
    kv_heads = gguf.meta("attention.head_count_kv", heads)
    if kv_heads not in (1, heads):
        raise CheckpointError(f"{gguf.source}: a starcoder file with {kv_heads} KV heads of "
                              f"{heads} is not supported; expected 1 (multi-query) or {heads}")
    return layer_norm_gguf_config(gguf, {
        "model_type": "gpt_bigcode", "multi_query": kv_heads == 1 and heads > 1}, from_hf)


FAMILY = Family("bigcode", ("gpt_bigcode",), ("gpt_bigcode",), from_hf, to_hf,
                key_rules=bigcode_rules,
                gguf=(GGUFArchitecture("starcoder", GGUF_TENSOR_NAMES, gguf_config),))
