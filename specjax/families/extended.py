"""The families on the shared decoder that switch on its optional features: Qwen3, Gemma
(1, 2, 3), Phi-3, SmolLM3, Granite, OLMo 2/3, StableLM and the mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE). One reading of their Hugging Face configs, since they share
most keys and differ in a few (see :class:`~specjax.config.ModelConfig` for each feature).

Their checkpoints use Llama's tensor names with each family's differences
(:func:`family_rules`). Their GGUF files (:data:`GGUF_ARCHITECTURES`, as llama.cpp's
converter writes them) are read as the same Hugging Face config keys, so both formats share
one reading of each feature. None is Q/K-permuted but ``smollm3`` and ``granite`` (llama.cpp
converts them as Llama); Gemma's norm weights are stored plus one; Phi-3's fused
``attn_qkv`` and ``ffn_up`` (gate and up) are split by the key rules as for its HF
checkpoint; llama.cpp writes OLMo 3 as ``olmo2`` with a sliding window, a per-layer pattern
and YaRN, read as Hugging Face's ``olmo3`` (the scaling on the global layers only).

Mixtures of experts: Qwen2-MoE is ``qwen2moe`` (its shared expert as ``ffn_*_shexp`` of
``expert_shared_feed_forward_length``, its gate ``ffn_gate_inp_shexp``), Qwen3-MoE
``qwen3moe`` (experts of ``expert_feed_forward_length``) and OLMoE ``olmoe`` (Mixtral is
``llama`` with experts, :mod:`specjax.families.llama`). The router is ``blk.N.ffn_gate_inp``
and each layer's experts are stacked in one tensor per projection (``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, [E, out, in]), split into the checkpoints' one tensor
per expert. Whether the picked experts' probabilities are rescaled to sum 1 is fixed per
architecture in llama.cpp's graphs (Qwen3-MoE yes, Qwen2-MoE and OLMoE no) unless the file
says ``expert_weights_norm``; Phi-3's LongRoPE factors travel as ``rope_factors_long`` and
``rope_factors_short`` with ``rope.scaling.original_context_length`` and
``rope.scaling.attn_factor``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.families.common import (GELU_TANH, Family, GGUFArchitecture, config_from_gguf_keys,
                                     eos_to_hf, eos_tuple, every_nth_global, float32_value, get,
                                     sliding_layers, windows_of)
from specjax.families.llama import GGUF_TENSOR_NAMES, llama_rules
from specjax.families.rules import Rule, layer_norm_rules, linear, linear_split, same
from specjax.rope_scaling import RopeScaling, rope_from_hf, rope_scaling_to_hf

# The families of this module, by Hugging Face model_type ("gemma3" is read as its text tower).
FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3", "granite", "olmo2",
            "olmo3", "stablelm", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
# OLMo 2/3: norms on the attention and MLP outputs only, q and k normed over all heads.
_OLMO = ("olmo2", "olmo3")
_OLMO3_THETA = 500000.0
# Mixture-of-experts families: every block's MLP is a routed set of experts.
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _layer_windows(model_type: str, cfg: Mapping[str, Any], num_layers: int) -> tuple:
    """Per-layer sliding windows (0 = global) from ``layer_types`` or the older keys."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen3", "smollm3", "qwen2_moe", "qwen3_moe") and not cfg.get(
            "use_sliding_window", False):
        window = None
    if model_type == "olmo2":  # no sliding layers (an Olmo 3 config names olmo3)
        window = None
    if not window:
        return ()
    window = int(window)
    if model_type == "phi3":  # one window for every layer
        return windows_of(window, [True] * num_layers)
    sliding = sliding_layers(model_type, cfg, num_layers)
    if sliding is None:
        if model_type == "gemma2":  # even layers slide
            sliding = [i % 2 == 0 for i in range(num_layers)]
        elif model_type == "gemma3_text":  # five sliding layers, a global one
            sliding = every_nth_global(cfg, num_layers, 6)
        elif model_type == "olmo3":  # three sliding layers, then a global one
            sliding = [(i + 1) % 4 != 0 for i in range(num_layers)]
        else:
            sliding = [i >= int(cfg.get("max_window_layers", 0)) for i in range(num_layers)]
    return windows_of(window, sliding)


def _gemma3_rope(cfg: Mapping[str, Any], local_default: float = 10000.0
                 ) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta) of a Gemma 3 or Olmo 3 config: nested
    ``rope_parameters`` per layer type (transformers >= 5) or ``rope_theta`` +
    ``rope_scaling`` + ``rope_local_base_freq`` (Gemma 3; Olmo 3's sliding layers take
    ``rope_theta`` without the scaling, ``local_default``)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        theta, scaling = rope_from_hf({"rope_parameters": params["full_attention"]})
        local, local_scaling = rope_from_hf(
            {"rope_parameters": params.get("sliding_attention")
             or {"rope_theta": local_default}})
        if local_scaling is not None:
            raise InvalidArgumentError(
                f"{cfg.get('model_type', 'gemma3_text')}: rope scaling on the sliding layers "
                f"({local_scaling.kind!r}) is not supported")
        return theta, scaling, local
    theta, scaling = rope_from_hf(cfg)
    if cfg.get("model_type") == "olmo3":
        return theta, scaling, theta
    return theta, scaling, float(cfg.get("rope_local_base_freq", local_default))


def from_hf(model_type: str, cfg: Mapping[str, Any]) -> ModelConfig | Mapping[str, Any]:
    """The config of a :data:`FAMILIES` model; of a ``gemma3`` (multimodal) checkpoint, the
    Hugging Face config of its text tower."""
    if model_type == "gemma3":  # the multimodal checkpoints: the text tower's config
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise InvalidArgumentError("a gemma3 config without a text_config dict")
        return {"model_type": "gemma3_text", **text}
    heads = int(cfg["num_attention_heads"])
    width = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    gemma = model_type in _GEMMA
    act = get(cfg, "hidden_activation", "hidden_act",
              default="gelu_pytorch_tanh" if gemma else "silu")
    olmo = model_type in _OLMO
    if model_type == "gemma" and act == "gelu":
        act = "gelu_tanh"  # the released Gemma configs' legacy name for it (transformers reads so)
    if model_type == "gemma" and cfg.get("use_bidirectional_attention"):
        raise InvalidArgumentError("gemma with use_bidirectional_attention (an embedding model) "
                                   "is not supported: specjax decodes causally")
    if gemma and act in GELU_TANH + ("gelu_tanh",):
        act = "gelu_tanh"
    elif gemma or act != "silu":
        raise InvalidArgumentError(
            f"unsupported {model_type} activation {act!r}; expected "
            f"{'gelu_pytorch_tanh' if gemma else 'silu'}")
    for bias in ("attention_bias", "mlp_bias"):
        if bool(cfg.get(bias, False)):
            raise InvalidArgumentError(f"{model_type} with {bias} is not supported")
    stablelm = model_type == "stablelm"
    if stablelm:
        for key, what in (("use_parallel_residual", "parallel attention and MLP"),
                          ("qk_layernorm", "per-head q/k LayerNorms")):
            if cfg.get(key):
                raise InvalidArgumentError(f"stablelm with {key} ({what}, StableLM 2 12B) is "
                                           f"not supported")
    experts = _experts_from_hf(model_type, cfg)
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(get(cfg, "partial_rotary_factor", default=rope.get(
        "partial_rotary_factor", 0.25 if stablelm else 1.0)))  # the config classes' defaults
    head_dim = int(get(cfg, "head_dim", default=width // heads))
    rotary_dim = None
    if partial != 1.0:
        if model_type not in ("phi3", "stablelm"):
            raise InvalidArgumentError(
                f"{model_type} partial_rotary_factor {partial} is not supported (RoPE on the "
                f"whole head only)")
        rotary_dim = int(head_dim * partial)  # as transformers rounds it
    local_theta = None
    if model_type == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(cfg)
    elif model_type == "olmo3":
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg = {**cfg, "rope_theta": _OLMO3_THETA}  # its config class's default
        theta, scaling, local_theta = _gemma3_rope(cfg, _OLMO3_THETA)
        if scaling is None and local_theta == theta:  # one set of tables serves both
            local_theta = None
    else:
        if model_type == "phi3":
            cfg = _phi3_rope_names(cfg)
        theta, scaling = rope_from_hf(cfg)
    query_scale = None
    if gemma and cfg.get("query_pre_attn_scalar") is not None:
        query_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    if model_type == "granite":
        query_scale = float(cfg.get("attention_multiplier", head_dim ** -0.5))
    if query_scale == head_dim ** -0.5:
        query_scale = None
    granite = {key: float(cfg[key]) if model_type == "granite" and cfg.get(key) is not None
               and float(cfg[key]) != 1.0 else None
               for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
    softcap = {name: float(cfg[name]) if gemma and cfg.get(name) is not None else None
               for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        architecture="llama", vocab_size=int(cfg["vocab_size"]), hidden_size=width,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get(cfg, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate_size=int(cfg["moe_intermediate_size" if model_type in ("qwen2_moe",
                                                                            "qwen3_moe")
                                  else "intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(get(cfg, "layer_norm_eps" if stablelm else "rms_norm_eps", default=(
            1e-5 if olmo or stablelm or model_type in ("mixtral", "olmoe") else 1e-6))),
        rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        eos_token_ids=eos_tuple(cfg.get("eos_token_id")), bos_token_id=cfg.get("bos_token_id"),
        family=model_type, qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe",
                                                  *_OLMO),
        qk_norm_whole=olmo or model_type == "olmoe", pre_norms=not olmo,
        norm_plus_one=gemma, hidden_act=act, embed_scale=gemma,
        sandwich_norms=(gemma and model_type != "gemma") or olmo,
        query_scale=query_scale, attn_softcap=softcap["attn_logit_softcapping"],
        final_softcap=softcap["final_logit_softcapping"],
        layer_windows=_layer_windows(model_type, cfg, layers), local_rope_theta=local_theta,
        rotary_dim=rotary_dim, no_rope_layers=_no_rope_layers(model_type, cfg, layers),
        norm_kind="layer" if stablelm else "rms", qkv_bias=(stablelm and bool(
            cfg.get("use_qkv_bias", False))) or (model_type == "qwen2_moe" and bool(
                cfg.get("qkv_bias", True))),
        embed_multiplier=granite["embedding_multiplier"],
        residual_multiplier=granite["residual_multiplier"],
        logits_divisor=granite["logits_scaling"], **experts,
    )


def _experts_from_hf(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` expert fields of a Mixtral, Qwen3-MoE or OLMoE config
    (``{}`` for the other families); what they hold that specjax does not run is refused
    in one line."""
    if model_type not in _MOE:
        return {}
    if model_type in ("qwen2_moe", "qwen3_moe") and (
            cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
        raise InvalidArgumentError(
            f"{model_type} with dense layers among the sparse ones (mlp_only_layers "
            f"{cfg.get('mlp_only_layers')!r}, decoder_sparse_step "
            f"{cfg.get('decoder_sparse_step')!r}) is not supported: every layer must be sparse")
    if model_type == "olmoe" and cfg.get("clip_qkv") is not None:
        raise InvalidArgumentError(f"olmoe with clip_qkv ({cfg['clip_qkv']}) is not supported")
    experts = get(cfg, "num_local_experts", "num_experts")
    if experts is None or cfg.get("num_experts_per_tok") is None:
        raise InvalidArgumentError(f"a {model_type} config needs num_experts "
                                   f"(num_local_experts) and num_experts_per_tok")
    return dict(num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
                normalize_expert_weights=model_type == "mixtral" or bool(
                    cfg.get("norm_topk_prob", False)),
                shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0)


def _no_rope_layers(model_type: str, cfg: Mapping[str, Any], num_layers: int) -> tuple:
    """SmolLM3's per-layer RoPE flags (``no_rope_layers``, else a NoPE layer every
    ``no_rope_layer_interval``, as transformers fills them in); ``()`` for the others."""
    if model_type != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(flags, (list, tuple)) or len(flags) != num_layers:
        raise InvalidArgumentError(f"smollm3 no_rope_layers must hold one 0/1 flag per layer "
                                   f"({num_layers}), got {flags!r}")
    return tuple(int(f) if f in (0, 1) else f for f in flags)


def _phi3_rope_names(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Phi-3 config with its scaling's older names ("su", "yarn") read as transformers'
    Phi-3 reads them: LongRoPE."""
    out = dict(cfg)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = out.get(key)
        if isinstance(scaling, Mapping):
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in ("su", "yarn"):
                out[key] = {**scaling, "rope_type": "longrope", "type": "longrope"}
    return out


def to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config of a :data:`FAMILIES` model (the keys :func:`from_hf`
    reads)."""
    family = config.family
    arch = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
            "gemma": "GemmaForCausalLM",
            "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM",
            "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
            "stablelm": "StableLmForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]
    out: dict[str, Any] = {
        "model_type": family, "architectures": [arch], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
        "eos_token_id": eos_to_hf(config.eos_token_ids),
        "bos_token_id": config.bos_token_id,
    }
    if family == "gemma":  # Gemma 1: GeGLU, (1 + w) norms, scaled embeddings and nothing more
        out["hidden_act"] = "gelu_pytorch_tanh"
    elif family in _GEMMA:
        out["hidden_activation"] = "gelu_pytorch_tanh"
        scalar = (config.head_dim if config.query_scale is None
                  else round(config.query_scale ** -2, 6))
        out["query_pre_attn_scalar"] = int(scalar) if scalar == int(scalar) else scalar
        out["attn_logit_softcapping"] = config.attn_softcap
        out["final_logit_softcapping"] = config.final_softcap
    else:
        out["hidden_act"] = "silu"
    if family == "gemma3_text":
        out["rope_local_base_freq"] = config.local_rope_theta
    windows = config.windows_per_layer if config.layer_windows else ()
    if windows:
        out["sliding_window"] = max(windows)
        if family != "phi3":
            out["layer_types"] = ["sliding_attention" if w else "full_attention"
                                  for w in windows]
        if family in ("qwen3", "smollm3", "qwen2_moe", "qwen3_moe"):
            out["use_sliding_window"] = True
    elif family in _GEMMA and family != "gemma":
        # Gemma configs always slide some layers: a window past every position is global.
        out["sliding_window"] = config.max_position_embeddings
    if family == "olmo3":  # per layer type; the scaling is the global layers' only
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            full = {**rope_scaling_to_hf(config.rope_scaling), "rope_theta": config.rope_theta}
        local = config.rope_theta if config.local_rope_theta is None else config.local_rope_theta
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}}
        out.pop("rope_theta")
    elif config.rope_scaling is not None:
        out["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
        if family == "phi3":  # transformers' Phi-3 reads this key before the scaling's own
            out["original_max_position_embeddings"] = (
                config.rope_scaling.original_max_position_embeddings)
    if config.rotary_dim is not None:
        out["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if family == "smollm3":
        out["no_rope_layers"] = [int(flag) for flag in config.rope_per_layer]
    if family in ("smollm3", "granite"):
        out["mlp_bias"] = False
    if family == "stablelm":
        out.update(layer_norm_eps=out.pop("rms_norm_eps"), use_qkv_bias=config.qkv_bias,
                   partial_rotary_factor=config.rope_dim / config.head_dim,
                   use_parallel_residual=False, qk_layernorm=False)
    if family == "granite":
        out.update(
            attention_multiplier=(config.head_dim ** -0.5 if config.query_scale is None
                                  else config.query_scale),
            embedding_multiplier=config.embed_multiplier or 1.0,
            residual_multiplier=config.residual_multiplier or 1.0,
            logits_scaling=config.logits_divisor or 1.0)
    if family in _MOE:
        out.update(num_experts_per_tok=config.experts_per_token,
                   **{"num_local_experts" if family == "mixtral" else "num_experts":
                      config.num_experts})
        if family != "mixtral":
            out["norm_topk_prob"] = config.normalize_expert_weights
        if family in ("qwen2_moe", "qwen3_moe"):
            out.update(moe_intermediate_size=out["intermediate_size"], decoder_sparse_step=1,
                       mlp_only_layers=[])
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=config.shared_expert_size,
                       qkv_bias=config.qkv_bias)
    return out


def family_rules(config: ModelConfig) -> list[Rule]:
    """Rules for the :data:`FAMILIES` checkpoints: Llama's names
    with the differences of each family."""
    p = "model.layers.{i}."
    rules = [rule for rule in llama_rules(config) if config.family != "phi3" or not (
        rule.leaves[0] in ("layers/wq", "layers/wk", "layers/wv", "layers/w_gate", "layers/w_up"))]
    if config.family == "phi3":  # fused q|k|v and gate|up in the checkpoint
        q_width = config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        f = config.intermediate_size
        rules += [linear_split(("layers/wq", "layers/wk", "layers/wv"),
                           p + "self_attn.qkv_proj.weight", (q_width, kv_width, kv_width)),
                  linear_split(("layers/w_gate", "layers/w_up"), p + "mlp.gate_up_proj.weight",
                           (f, f))]
    if config.norm_kind == "layer":  # StableLM: LayerNorms with biases
        rules += [rule for rule in layer_norm_rules(
            ("final_norm", "model.norm"), ("layers/attn_norm", p + "input_layernorm"),
            ("layers/mlp_norm", p + "post_attention_layernorm")) if rule.hf_name.endswith("bias")]
    if config.qk_norm:
        rules += [same("layers/q_norm", p + "self_attn.q_norm.weight"),
                  same("layers/k_norm", p + "self_attn.k_norm.weight")]
    if config.num_experts:  # Mixtral, Qwen3-MoE, OLMoE: a router and E experts per layer
        rules = [rule for rule in rules
                 if rule.leaves[0] not in ("layers/w_gate", "layers/w_up", "layers/w_down")]
        rules += _expert_rules(config)
    if config.sandwich_norms:  # Gemma: post_attention_layernorm is the attention output's
        rules = [rule for rule in rules
                 if rule.leaves not in (("layers/mlp_norm",), ("layers/attn_norm",))]
        rules += [same("layers/post_attn_norm", p + "post_attention_layernorm.weight"),
                  same("layers/post_mlp_norm", p + "post_feedforward_layernorm.weight")]
        if config.pre_norms:  # OLMo 2/3 have none: their only norms are the two above
            rules += [same("layers/attn_norm", p + "input_layernorm.weight"),
                      same("layers/mlp_norm", p + "pre_feedforward_layernorm.weight")]
    return rules


def _expert_rules(config: ModelConfig) -> list[Rule]:
    """The router and experts of a mixture-of-experts layer, as the released checkpoints
    name them (one tensor per expert; transformers 5 stacks them in memory but writes them
    back this way)."""
    if config.family == "mixtral":
        p = "model.layers.{i}.block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        p = "model.layers.{i}.mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    rules = [linear("layers/router", p + "gate.weight")] + [
        linear(leaf, p + "experts.{e}." + name + ".weight")
        for leaf, name in zip(("layers/we_gate", "layers/we_up", "layers/we_down"), names)]
    if config.shared_expert_size:  # Qwen2-MoE
        rules += [linear("layers/ws_gate", p + "shared_expert.gate_proj.weight"),
                  linear("layers/ws_up", p + "shared_expert.up_proj.weight"),
                  linear("layers/ws_down", p + "shared_expert.down_proj.weight"),
                  linear("layers/shared_gate", p + "shared_expert_gate.weight")]
    return rules


# Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration): the text tower under
# these prefixes (transformers >= 4.52, then older), read as a Gemma3ForCausalLM's names.
_GEMMA3_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                         "language_model.lm_head.": "lm_head."}
# ... and the image side, which a text model does not read.
_GEMMA3_IMAGE_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.",
                          "vision_tower.", "multi_modal_projector.")


def _ignores(name: str, config: ModelConfig) -> bool:
    return config.family == "gemma3_text" and name.startswith(_GEMMA3_IMAGE_PREFIXES)


def _checkpoint_name(name: str, config: ModelConfig) -> str:
    if config.family == "gemma3_text":
        for prefix, ours in _GEMMA3_TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
    return name


# ----------------------------------------------------------------------------- GGUF

# GGUF architecture -> the Hugging Face model_type of the families with optional features.
# (llama.cpp's smollm3 has no key for its NoPE layers: every fourth, hard-coded, as the
# Hugging Face config's default no_rope_layer_interval gives.)
GGUF_ARCHITECTURES = {"qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3", "smollm3": "smollm3",
                      "granite": "granite", "olmo2": "olmo2", "stablelm": "stablelm",
                      "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# Mixtures of experts: whether llama.cpp's graph rescales the picked experts'
# probabilities to sum 1 when the file does not say (``{arch}.expert_weights_norm``).
_EXPERT_WEIGHTS_NORM = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}
# A stacked experts tensor -> the projection of each expert in the HF checkpoints
# (Mixtral's names, the others').
_EXPERT_TENSORS = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
                   "ffn_down_exps": ("w2", "down_proj")}
# Qwen2-MoE's shared expert and its gate (one tensor each) -> their checkpoint names.
_SHARED_EXPERT_TENSORS = {"ffn_gate_shexp": "shared_expert.gate_proj",
                          "ffn_up_shexp": "shared_expert.up_proj",
                          "ffn_down_shexp": "shared_expert.down_proj",
                          "ffn_gate_inp_shexp": "shared_expert_gate"}
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

_QK_NORMS = {"blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
             "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
# Gemma's four norms per block: llama.cpp's ffn_norm is the MLP's input norm.
_GEMMA_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Per architecture: names added to (or replacing) Llama's (llama.GGUF_TENSOR_NAMES).
_GGUF_TENSOR_NAMES = {
    "qwen3": _QK_NORMS,
    "qwen3moe": _QK_NORMS,
    "olmoe": _QK_NORMS,
    "gemma2": _GEMMA_NORMS,
    "gemma3": {**_GEMMA_NORMS, **_QK_NORMS},
    "phi3": {"blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
             "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight"},
    # OLMo 2: only the attention's and MLP's output norms (no attn_norm, no ffn_norm).
    "olmo2": {**_QK_NORMS, **{k: v for k, v in _GEMMA_NORMS.items() if "ffn_norm" not in k}},
    # StableLM: Llama's names, and the LayerNorms' biases.
    "stablelm": {"output_norm.bias": "model.norm.bias",
                 "blk.{i}.attn_norm.bias": "model.layers.{i}.input_layernorm.bias",
                 "blk.{i}.ffn_norm.bias": "model.layers.{i}.post_attention_layernorm.bias"},
}


def gguf_config(gguf) -> ModelConfig:
    """The config of a :data:`GGUF_ARCHITECTURES` file: its metadata as the Hugging Face
    config keys :func:`from_hf` reads, so both formats share one reading of each family's
    features."""
    arch, meta, names, source = gguf.arch, gguf.meta, gguf.names, gguf.source
    hidden, heads, layers = (meta("embedding_length"), meta("attention.head_count"),
                             meta("block_count"))
    if heads == 0:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' is 0")
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim and arch not in ("phi3", "stablelm"):
        raise CheckpointError(f"{source}: partial RoPE ({arch}.rope.dimension_count) is not "
                              f"supported")
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' in a {arch} file is not "
                              f"supported")
    tokens = gguf.field("tokenizer.ggml.tokens", kind=list)
    eos, bos = gguf.special_token_ids()
    cfg = {
        "model_type": GGUF_ARCHITECTURES[arch],
        "vocab_size": len(tokens) if tokens is not None else meta("vocab_size"),
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads), "head_dim": head_dim,
        "intermediate_size": meta("feed_forward_length"),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": float32_value(meta("attention.layer_norm_rms_epsilon", kind=float))
        if arch != "stablelm" else None,
        "rope_theta": float32_value(meta("rope.freq_base", 10000.0, kind=float)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": eos or None, "bos_token_id": bos,
    }
    # Phi-4-mini, StableLM: RoPE on the first rope_dims of each head
    cfg["partial_rotary_factor"] = rope_dims / head_dim
    if arch in _EXPERT_WEIGHTS_NORM:
        cfg.update(num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                   norm_topk_prob=gguf.field(f"{arch}.expert_weights_norm",
                                             _EXPERT_WEIGHTS_NORM[arch], kind=bool))
        if arch in ("qwen2moe", "qwen3moe"):
            cfg["moe_intermediate_size"] = meta("expert_feed_forward_length")
        if arch == "qwen2moe":
            cfg["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", 0)
            cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
    if arch == "stablelm":
        cfg["layer_norm_eps"] = float32_value(meta("attention.layer_norm_epsilon", kind=float))
        cfg["use_qkv_bias"] = "blk.0.attn_q.bias" in names
        # llama.cpp runs a file without MLP norms as parallel attention and MLP (whatever
        # use_parallel_residual says), which specjax's StableLM does not take.
        cfg["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in names
    scaling = meta("rope.scaling.type", "none", kind=str)
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float32_value(meta("rope.scaling.factor", kind=float))}
    elif scaling == "yarn" and arch == "olmo2":  # Olmo 3's, as llama.cpp's converter writes it
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float32_value(meta("rope.scaling.factor", kind=float)),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
        attention = meta("rope.scaling.attn_factor", 0.0, kind=float)
        if attention:
            cfg["rope_scaling"]["attention_factor"] = float32_value(attention)
    elif scaling != "none":
        raise CheckpointError(f"{source}: RoPE scaling {scaling!r} is not supported")
    long, short = (gguf.rope_factors(f"rope_factors_{kind}.weight")
                   for kind in ("long", "short"))
    if (long is None) != (short is None):
        raise CheckpointError(f"{source}: 'rope_factors_long.weight' and "
                              f"'rope_factors_short.weight' come together; one is missing")
    if long is not None:
        if arch != "phi3" or "rope_scaling" in cfg:
            raise CheckpointError(f"{source}: LongRoPE factors in a {arch} file"
                                  f"{' with other RoPE scaling' if arch == 'phi3' else ''} are "
                                  f"not supported")
        # llama.cpp's Phi-3 (convert_hf_to_gguf.py): the factor sets as tensors, the
        # pretraining length and the attention factor as metadata.
        cfg["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": short,
                               "long_factor": long}
        attention = meta("rope.scaling.attn_factor", 0.0, kind=float)
        if attention:
            cfg["rope_scaling"]["attention_factor"] = float32_value(attention)
    _gguf_layout(gguf, layers, cfg)
    return config_from_gguf_keys(gguf, from_hf, cfg)


def _gguf_layout(gguf, layers: int, cfg: dict) -> None:
    """Adds to ``cfg`` (Hugging Face keys) what :func:`gguf_config` reads per family:
    sliding windows and their layer pattern, Gemma's query scale and soft-caps, Granite's
    scalars, Gemma 3's local RoPE base."""
    arch, meta, source = gguf.arch, gguf.meta, gguf.source
    window = meta("attention.sliding_window", 0)
    if window and arch in ("qwen3", "qwen2moe", "qwen3moe"):  # none slides in llama.cpp
        raise CheckpointError(f"{source}: a {arch} GGUF with a sliding window ({window}) is "
                              f"not supported; load the model from its HF directory")
    if window:
        cfg["sliding_window"] = window
        if arch == "olmo2":
            # llama.cpp writes Olmo 3 as olmo2 with its window and one flag per layer (its
            # converter's default: three sliding layers, then a global one).
            cfg["model_type"] = "olmo3"
            pattern = gguf.field(f"{arch}.attention.sliding_window_pattern")
            sliding = (list(pattern) if isinstance(pattern, list) else
                       [(i + 1) % 4 != 0 for i in range(layers)])
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention"
                                  for s in sliding]
        if arch in _GEMMA_ARCHITECTURES:
            # llama.cpp's pattern: a period n (layer i slides iff i % n < n - 1; Gemma 2
            # alternates, Gemma 3 slides five in six) or one flag per layer.
            pattern = gguf.field(f"{arch}.attention.sliding_window_pattern",
                                 2 if arch == "gemma2" else 6)
            sliding = (list(pattern) if isinstance(pattern, list) else
                       [i % int(pattern) < int(pattern) - 1 for i in range(layers)])
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention"
                                  for s in sliding]
    if arch in _GEMMA_ARCHITECTURES:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        # llama.cpp's query scale: attention.scale when written, else head_dim ** -0.5,
        # except the 27B models (46 / 62 blocks) whose scale is (hidden / heads) ** -0.5.
        scale = meta("attention.scale", 0.0, kind=float)
        big = layers == {"gemma2": 46, "gemma3": 62}.get(arch)
        cfg["query_pre_attn_scalar"] = (
            scale ** -2 if scale else
            cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = meta(key, 0.0, kind=float)
            cfg[key] = float32_value(value) if value else None
    if arch == "granite":  # llama.cpp's names for Granite's four scalars
        for key, hf_key in (("embedding_scale", "embedding_multiplier"),
                            ("residual_scale", "residual_multiplier"),
                            ("logit_scale", "logits_scaling"),
                            ("attention.scale", "attention_multiplier")):
            value = meta(key, 0.0, kind=float)
            if value:
                cfg[hf_key] = float32_value(value)
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = float32_value(meta("rope.freq_base_swa", 10000.0,
                                                          kind=float))


def _gguf_tensors(name: str, array: np.ndarray, config: ModelConfig) -> dict | None:
    """A mixture of experts' router or stacked experts tensor under its checkpoint names
    (one tensor per expert: ``array[e]``); ``None`` for any other tensor."""
    match = re.fullmatch(r"blk\.(\d+)\.(ffn_\w+)\.weight", name)
    kinds = ("ffn_gate_inp", *_EXPERT_TENSORS, *_SHARED_EXPERT_TENSORS)
    if match is None or match.group(2) not in kinds or not config.num_experts:
        return None
    layer, kind = match.groups()
    prefix = (f"model.layers.{layer}.block_sparse_moe." if config.family == "mixtral"
              else f"model.layers.{layer}.mlp.")
    if kind == "ffn_gate_inp":
        return {prefix + "gate.weight": array}
    if kind in _SHARED_EXPERT_TENSORS:  # the gate may be stored 1-D ([d]); HF's is [1, d]
        shaped = array.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else array
        return {f"{prefix}{_SHARED_EXPERT_TENSORS[kind]}.weight": shaped}
    projection = _EXPERT_TENSORS[kind][config.family != "mixtral"]
    return {f"{prefix}experts.{e}.{projection}.weight": array[e] for e in range(len(array))}


def _gguf_transform(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Gemma's norm weights are stored plus one (llama.cpp scales by ``w``, HF by ``1 + w``):
    subtracted, exactly (the stored value is the float32 ``1 + w`` that HF computes)."""
    return array - np.float32(1.0) if name.endswith("norm.weight") else array


# llama.cpp's converter permutes Q and K of smollm3 and granite files (it converts them as
# Llama); the others are as stored.
FAMILY = Family("extended", FAMILIES + ("gemma3",), FAMILIES, from_hf, to_hf,
                key_rules=family_rules, checkpoint_name=_checkpoint_name, ignores=_ignores,
                gguf=tuple(GGUFArchitecture(
                    arch, {**GGUF_TENSOR_NAMES, **_GGUF_TENSOR_NAMES.get(arch, {})}, gguf_config,
                    permuted=arch in ("smollm3", "granite"),
                    transform=_gguf_transform if arch in _GEMMA_ARCHITECTURES else None)
                    for arch in GGUF_ARCHITECTURES),
                gguf_tensors=_gguf_tensors,
                native_despite_auto_map=("phi3",))  # Microsoft's Phi-3 repositories
