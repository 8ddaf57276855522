"""The families on the shared decoder that switch on its optional features: Qwen3, Gemma
(1, 2, 3), Phi-3, SmolLM3, Granite, OLMo 2/3, StableLM and the mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE). One reading of their Hugging Face configs, since they share
most keys and differ in a few (see :class:`~specjax.config.ModelConfig` for each feature)."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.families.common import (GELU_TANH, Family, eos_to_hf, eos_tuple, every_nth_global,
                                     get, sliding_layers, windows_of)
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


FAMILY = Family("extended", FAMILIES + ("gemma3",), FAMILIES, from_hf, to_hf)
