"""StarCoder2 on the shared decoder: LayerNorms, grouped KV heads, a two-matrix tanh-GELU
MLP, a sliding window in every layer."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import (NEOX_ACTS, Family, GGUFArchitecture, eos_tuple, get,
                                     hf_keys, layer_norm_gguf_config, refuse_partial_rope)
from specjax.families.rules import Rule, layer_norm_rules, linear, same
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


def starcoder2_rules(config: ModelConfig) -> list[Rule]:
    """Rules for Starcoder2ForCausalLM checkpoints: Llama's attention names, LayerNorms
    with biases, ``c_fc``/``c_proj`` for the MLP, projection biases when ``use_bias``."""
    p = "model.layers.{i}."
    rules = [
        same("embed", "model.embed_tokens.weight"),
        *layer_norm_rules(("final_norm", "model.norm"),
                          ("layers/attn_norm", p + "input_layernorm"),
                          ("layers/mlp_norm", p + "post_attention_layernorm")),
        *[linear(f"layers/w{leaf}", f"{p}self_attn.{leaf}_proj.weight") for leaf in "qkvo"],
        linear("layers/w_up", p + "mlp.c_fc.weight"),
        linear("layers/w_down", p + "mlp.c_proj.weight"),
    ]
    if config.qkv_bias:
        rules += [same(f"layers/b{leaf}", f"{p}self_attn.{leaf}_proj.bias") for leaf in "qkvo"]
        rules += [same("layers/b_up", p + "mlp.c_fc.bias"),
                  same("layers/b_down", p + "mlp.c_proj.bias")]
    if not config.tie_word_embeddings:
        rules.append(linear("lm_head", "lm_head.weight"))
    return rules


# ----------------------------------------------------------------------------- GGUF

# Llama's names for the norms and attention, ffn_up/ffn_down for c_fc/c_proj, LayerNorms with
# biases, projection biases when the model has them.
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "model.norm"),
        ("blk.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
        ("blk.{i}.ffn_norm", "model.layers.{i}.post_attention_layernorm"),
        ("blk.{i}.attn_q", "model.layers.{i}.self_attn.q_proj"),
        ("blk.{i}.attn_k", "model.layers.{i}.self_attn.k_proj"),
        ("blk.{i}.attn_v", "model.layers.{i}.self_attn.v_proj"),
        ("blk.{i}.attn_output", "model.layers.{i}.self_attn.o_proj"),
        ("blk.{i}.ffn_up", "model.layers.{i}.mlp.c_fc"),
        ("blk.{i}.ffn_down", "model.layers.{i}.mlp.c_proj")) for kind in ("weight", "bias")},
    "output.weight": "lm_head.weight",
}


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``starcoder2`` file as llama.cpp's converter writes it: grouped KV
    heads, LayerNorm's epsilon, projection biases if its tensors are there. llama.cpp
    attends globally in every layer unless the file names ``attention.sliding_window``
    (its converter writes none): read so, a generation longer than the Hugging Face
    config's window (4,096 in the released models) follows llama.cpp, not transformers."""
    window = gguf.meta("attention.sliding_window", 0)
    return layer_norm_gguf_config(gguf, {
        "model_type": "starcoder2", "num_key_value_heads": gguf.meta(
            "attention.head_count_kv", gguf.meta("attention.head_count")),
        "use_bias": "blk.0.attn_q.bias" in gguf.names, "sliding_window": window or None},
        from_hf)


FAMILY = Family("starcoder2", ("starcoder2",), ("starcoder2",), from_hf, to_hf,
                key_rules=starcoder2_rules,
                gguf=(GGUFArchitecture("starcoder2", GGUF_TENSOR_NAMES, gguf_config),))
