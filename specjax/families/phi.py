"""Phi (1, 1.5, 2) on the shared decoder: GPT-NeoX's parallel block with one LayerNorm,
biases everywhere, the head's included."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.families.common import (GELU_TANH, Family, GGUFArchitecture, eos_tuple, get, hf_keys,
                                     layer_norm_gguf_config)
from specjax.families.rules import Rule, layer_norm_rules, linear, same
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


def phi_rules(config: ModelConfig) -> list[Rule]:
    """Rules for PhiForCausalLM checkpoints (Phi-1, 1.5, 2): one LayerNorm per block,
    ``dense`` for the attention's output, ``fc1``/``fc2`` for the MLP, biases everywhere,
    the head's included."""
    p = "model.layers.{i}."
    rules = [
        same("embed", "model.embed_tokens.weight"),
        *layer_norm_rules(("final_norm", "model.final_layernorm"),
                          ("layers/attn_norm", p + "input_layernorm")),
        *[rule for leaf, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"),
                                  ("o", "dense"))
          for rule in (linear(f"layers/w{leaf}", f"{p}self_attn.{name}.weight"),
                       same(f"layers/b{leaf}", f"{p}self_attn.{name}.bias"))],
        linear("layers/w_up", p + "mlp.fc1.weight"), same("layers/b_up", p + "mlp.fc1.bias"),
        linear("layers/w_down", p + "mlp.fc2.weight"), same("layers/b_down", p + "mlp.fc2.bias"),
        same("lm_head_bias", "lm_head.bias"),
    ]
    if not config.tie_word_embeddings:
        rules.append(linear("lm_head", "lm_head.weight"))
    return rules


# ----------------------------------------------------------------------------- GGUF

# llama.cpp's ``phi2`` (Phi-1, 1.5 too): Llama's block names for its one norm, q, k, v and
# output; fc1 and fc2 as ffn_up and ffn_down; every projection, the norms and the head with
# biases.
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "model.final_layernorm"), ("output", "lm_head"),
        ("blk.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
        ("blk.{i}.attn_q", "model.layers.{i}.self_attn.q_proj"),
        ("blk.{i}.attn_k", "model.layers.{i}.self_attn.k_proj"),
        ("blk.{i}.attn_v", "model.layers.{i}.self_attn.v_proj"),
        ("blk.{i}.attn_output", "model.layers.{i}.self_attn.dense"),
        ("blk.{i}.ffn_up", "model.layers.{i}.mlp.fc1"),
        ("blk.{i}.ffn_down", "model.layers.{i}.mlp.fc2")) for kind in ("weight", "bias")},
}


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``phi2`` file (Phi-1, 1.5, 2) as llama.cpp's converter writes it:
    RoPE on ``rope.dimension_count`` dims of each head, LayerNorm's epsilon. Files from the
    original Microsoft checkpoints fuse q|k|v in ``attn_qkv``: refused, naming it."""
    if "blk.0.attn_qkv.weight" in gguf.names:
        raise CheckpointError(f"{gguf.source}: a phi2 file with fused 'blk.0.attn_qkv.weight' "
                              f"is not supported; convert the model from its Hugging Face "
                              f"directory")
    return layer_norm_gguf_config(gguf, {
        "model_type": "phi", "num_key_value_heads": gguf.meta(
            "attention.head_count_kv", gguf.meta("attention.head_count"))}, from_hf)


FAMILY = Family("phi", ("phi",), ("phi",), from_hf, to_hf, key_rules=phi_rules,
                gguf=(GGUFArchitecture("phi2", GGUF_TENSOR_NAMES, gguf_config),))
