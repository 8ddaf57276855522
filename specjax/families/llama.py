"""Llama and the families that load as Llama (Mistral, Qwen2, SmolLM, SmolLM2): the plain
form of the shared decoder, with biases where the config asks (Qwen2: on q, k and v)."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.families.common import (Family, GGUFArchitecture, eos_to_hf, eos_tuple,
                                     float32_value, get)
from specjax.families.rules import Rule, linear, same
from specjax.rope_scaling import RopeScaling, rope_from_hf, rope_scaling_to_hf

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


def llama_rules(config: ModelConfig) -> list[Rule]:
    """Rules for LlamaForCausalLM-style checkpoints (Llama, Mistral, Qwen2, SmolLM)."""
    p = "model.layers.{i}."
    rules = [
        same("embed", "model.embed_tokens.weight"),
        same("final_norm", "model.norm.weight"),
        same("layers/attn_norm", p + "input_layernorm.weight"),
        same("layers/mlp_norm", p + "post_attention_layernorm.weight"),
        linear("layers/wq", p + "self_attn.q_proj.weight"),
        linear("layers/wk", p + "self_attn.k_proj.weight"),
        linear("layers/wv", p + "self_attn.v_proj.weight"),
        linear("layers/wo", p + "self_attn.o_proj.weight"),
        linear("layers/w_gate", p + "mlp.gate_proj.weight"),
        linear("layers/w_up", p + "mlp.up_proj.weight"),
        linear("layers/w_down", p + "mlp.down_proj.weight"),
    ]
    if config.qkv_bias:
        rules += [same("layers/bq", p + "self_attn.q_proj.bias"),
                  same("layers/bk", p + "self_attn.k_proj.bias"),
                  same("layers/bv", p + "self_attn.v_proj.bias")]
    if config.out_bias:
        rules.append(same("layers/bo", p + "self_attn.o_proj.bias"))
    if config.mlp_bias:
        rules += [same("layers/b_gate", p + "mlp.gate_proj.bias"),
                  same("layers/b_up", p + "mlp.up_proj.bias"),
                  same("layers/b_down", p + "mlp.down_proj.bias")]
    if not config.tie_word_embeddings:
        rules.append(linear("lm_head", "lm_head.weight"))
    return rules


# ----------------------------------------------------------------------------- GGUF

# GGUF tensor name -> HF name; "{i}" is the block index. Llama's names, which most families'
# files share.
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
    **{f"blk.{{i}}.{gguf}.{kind}": f"model.layers.{{i}}.self_attn.{hf}.{kind}"
       for gguf, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                        ("attn_output", "o_proj"))
       for kind in ("weight", "bias")},
}


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``llama``, ``mistral`` or ``qwen2`` file. RoPE scaling comes as
    ``rope.scaling.type`` linear, or as llama.cpp's per-frequency factors
    (``rope_freqs.weight``: Llama 3.1/3.2 store their Llama 3 scaling so), read as LongRoPE
    with one factor set. llama.cpp writes Mixtral as ``llama`` with ``expert_count`` and
    ``expert_used_count``: read as the ``mixtral`` family."""
    arch, meta, source, names = gguf.arch, gguf.meta, gguf.source, gguf.names
    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    if heads == 0:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' is 0")
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head dim "
            f"{head_dim}) is not supported")
    tokens = gguf.field("tokenizer.ggml.tokens", kind=list)
    vocab = len(tokens) if tokens is not None else meta("vocab_size")
    scaling = None
    scaling_type = meta("rope.scaling.type", "none", kind=str)
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float32_value(meta("rope.scaling.factor", kind=float)))
    elif scaling_type != "none":
        raise CheckpointError(f"{source}: RoPE scaling {scaling_type!r} is not supported")
    factors = gguf.rope_factors("rope_freqs.weight")
    if factors is not None:
        if scaling is not None:
            raise CheckpointError(f"{source}: both 'rope_freqs.weight' and RoPE scaling "
                                  f"{scaling_type!r}; expected one")
        # llama.cpp divides frequency i by factor i (how it stores Llama 3.1's scaling):
        # LongRoPE's rule with one set of factors, never switched.
        scaling = RopeScaling("longrope", original_max_position_embeddings=meta(
            "context_length"), short_factor=factors, long_factor=factors)
    eos_ids, bos = gguf.special_token_ids()
    window = meta("attention.sliding_window", 0)
    experts = {}
    if meta("expert_count", 0):  # Mixtral, as llama.cpp's converter writes it
        experts = dict(family="mixtral", num_experts=meta("expert_count"),
                       experts_per_token=meta("expert_used_count"),
                       normalize_expert_weights=gguf.field(
                           f"{arch}.expert_weights_norm", True, kind=bool))
    try:
        return ModelConfig(
            architecture="llama", vocab_size=vocab, hidden_size=hidden,
            num_layers=meta("block_count"), num_heads=heads,
            num_kv_heads=meta("attention.head_count_kv", heads), head_dim=head_dim,
            intermediate_size=meta("feed_forward_length"),
            max_position_embeddings=meta("context_length"),
            norm_eps=float32_value(meta("attention.layer_norm_rms_epsilon", kind=float)),
            rope_theta=float32_value(meta("rope.freq_base", 10000.0, kind=float)),
            rope_scaling=scaling, tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names, out_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_gate.bias" in names, eos_token_ids=tuple(eos_ids),
            bos_token_id=bos, sliding_window=window or None, **experts,
        )
    except InvalidArgumentError as error:
        raise CheckpointError(f"{source}: GGUF metadata describes an invalid model ({error})"
                              ) from None


# llama.cpp's converter permutes Q and K of llama (and mistral) files; qwen2's are as stored.
FAMILY = Family("llama", MODEL_TYPES, ("llama",), from_hf, to_hf, key_rules=llama_rules,
                gguf=tuple(GGUFArchitecture(arch, GGUF_TENSOR_NAMES, gguf_config, permuted)
                           for arch, permuted in (("llama", True), ("mistral", True),
                                                  ("qwen2", False))))
