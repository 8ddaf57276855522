"""GPT-NeoX (Pythia, GPT-NeoX-20B) on the shared decoder: LayerNorms with biases, RoPE on
part of each head, a two-matrix GELU MLP, attention and MLP side by side."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import (NEOX_ACTS, Family, GGUFArchitecture, eos_to_hf, eos_tuple,
                                     get, layer_norm_gguf_config)
from specjax.families.rules import Rule, layer_norm_rules, linear, per_head_qkv_rules, same
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


def neox_rules(config: ModelConfig) -> list[Rule]:
    """Rules for GPTNeoXForCausalLM checkpoints (Pythia). Their ``query_key_value`` rows
    interleave the heads, [H, 3 (q, k, v), D], rather than stacking q, k and v."""
    p = "gpt_neox.layers.{i}."
    qkv_weight, qkv_bias = per_head_qkv_rules(config, p + "attention.query_key_value")
    rules = [
        same("embed", "gpt_neox.embed_in.weight"),
        *layer_norm_rules(("final_norm", "gpt_neox.final_layer_norm"),
                          ("layers/attn_norm", p + "input_layernorm"),
                          ("layers/mlp_norm", p + "post_attention_layernorm")),
        qkv_weight,
        linear("layers/wo", p + "attention.dense.weight"),
        linear("layers/w_up", p + "mlp.dense_h_to_4h.weight"),
        same("layers/b_up", p + "mlp.dense_h_to_4h.bias"),
        linear("layers/w_down", p + "mlp.dense_4h_to_h.weight"),
        same("layers/b_down", p + "mlp.dense_4h_to_h.bias"),
    ]
    if config.qkv_bias:
        rules += [qkv_bias, same("layers/bo", p + "attention.dense.bias")]
    if not config.tie_word_embeddings:
        rules.append(linear("lm_head", "embed_out.weight"))
    return rules


def _ignores(name: str, config: ModelConfig) -> bool:
    """Older GPT-NeoX checkpoints (Pythia's) keep the causal mask buffers."""
    return name.endswith((".attention.bias", ".attention.masked_bias"))


def _checkpoint_name(name: str, config: ModelConfig) -> str:
    """The head's module name; files keep the original one."""
    return "embed_out.weight" if name == "lm_head.weight" else name


# ----------------------------------------------------------------------------- GGUF

# llama.cpp's names (``gptneox``) and the HF checkpoint's, both its own (llama.cpp's converter
# stores q|k|v stacked, [3 * H * D, d]; the HF checkpoint interleaves them per head, see
# _qkv_to_hf).
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "gpt_neox.embed_in.weight",
    "output_norm.weight": "gpt_neox.final_layer_norm.weight",
    "output_norm.bias": "gpt_neox.final_layer_norm.bias",
    "output.weight": "embed_out.weight",
    **{f"blk.{{i}}.{gguf}.{kind}": f"gpt_neox.layers.{{i}}.{hf}.{kind}"
       for gguf, hf in (("attn_norm", "input_layernorm"),
                        ("attn_qkv", "attention.query_key_value"),
                        ("attn_output", "attention.dense"),
                        ("ffn_norm", "post_attention_layernorm"),
                        ("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h"))
       for kind in ("weight", "bias")},
}


def _qkv_to_hf(array: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's stacked GPT-NeoX q|k|v rows [3, H, D, ...] as the HF checkpoint's
    per-head interleaving [H, 3, D, ...] (weights [3*H*D, d] and biases [3*H*D])."""
    if array.shape[0] % (3 * num_heads):
        return array  # the key map names the wrong shape
    stacked = array.reshape(3, num_heads, array.shape[0] // (3 * num_heads), *array.shape[1:])
    return np.swapaxes(stacked, 0, 1).reshape(array.shape)


def _gguf_transform(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    return _qkv_to_hf(array, config.num_heads) if ".attn_qkv." in name else array


def gguf_config(gguf) -> ModelConfig:
    """The config of a ``gptneox`` file (Pythia, GPT-NeoX-20B) as llama.cpp's converter
    writes it: RoPE on ``rope.dimension_count`` dims of each head, ``use_parallel_residual``,
    LayerNorm's epsilon, no RoPE base (llama.cpp's default, 10000, unless written). Such
    files name no activation: read with Pythia's exact GELU (HF's ``gelu``; llama.cpp's graph
    computes the tanh form)."""
    return layer_norm_gguf_config(gguf, {
        "model_type": "gpt_neox",
        "use_parallel_residual": gguf.field("gptneox.use_parallel_residual", True, kind=bool),
        "attention_bias": "blk.0.attn_qkv.bias" in gguf.names}, from_hf)


FAMILY = Family("neox", ("gpt_neox",), ("gpt_neox",), from_hf, to_hf, key_rules=neox_rules,
                checkpoint_name=_checkpoint_name, ignores=_ignores,
                gguf=(GGUFArchitecture("gptneox", GGUF_TENSOR_NAMES, gguf_config,
                                       transform=_gguf_transform),))
