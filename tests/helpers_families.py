"""Tiny random checkpoints of the families on the llama forward that differ from Llama
(Qwen3, Gemma 1, 2 and 3 text, Phi-3, SmolLM3, Granite, OLMo 2 and 3, StableLM,
GPT-NeoX, Phi, StarCoder2, GPTBigCode, Cohere's Command R and R7B, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE), made by transformers' own classes.

Every variant's sliding window is shorter than the test sequences (prompts of 6-20 tokens,
24+ new ones), so a window that is ignored, off by one or applied to the wrong layers
changes the logits. Weights are redrawn with spread-out values (norm scales included) so
that a missing feature moves the logits by far more than the parity tolerance.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 97
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)

_NEOX = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=256, layer_norm_eps=1e-5,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)

_BIGCODE = dict(vocab_size=VOCAB, n_embd=64, n_inner=96, n_layer=3, n_head=4, n_positions=256,
                layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)

# variant -> (transformers config class, kwargs)
VARIANTS = {
    # Qwen3: q/k norms, tied head, every layer global.
    "qwen3-tied": (transformers.Qwen3Config, dict(_BASE, tie_word_embeddings=True)),
    # Qwen3: untied head; layers from max_window_layers on slide (use_sliding_window).
    "qwen3-untied-sliding": (transformers.Qwen3Config, dict(
        _BASE, tie_word_embeddings=False, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),
    # Gemma (1): GeGLU, (1 + w) norms, embeddings times sqrt(d), head_dim 32 over a
    # 64-wide model (as Gemma-2B's 256 over 2048), one KV head (multi-query), tied head.
    "gemma": (transformers.GemmaConfig, dict(
        _BASE, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    # Gemma 2: head_dim 256, soft-capping on, alternating sliding/global, a query scale
    # other than head_dim ** -0.5.
    "gemma2": (transformers.Gemma2Config, dict(
        _BASE, num_attention_heads=2, num_key_value_heads=1, head_dim=256, num_hidden_layers=4,
        sliding_window=5, query_pre_attn_scalar=224, attn_logit_softcapping=3.0,
        final_logit_softcapping=6.0)),
    # Gemma 2 with soft-capping off and an untied head.
    "gemma2-nocap": (transformers.Gemma2Config, dict(
        _BASE, sliding_window=4, attn_logit_softcapping=None, final_logit_softcapping=None,
        tie_word_embeddings=False, query_pre_attn_scalar=16)),
    # Gemma 3: q/k norms, five sliding layers then a global one, local/global RoPE bases.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        _BASE, num_hidden_layers=6, hidden_size=32, sliding_window=5, query_pre_attn_scalar=16,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Phi-3: fused qkv_proj and gate_up_proj; sliding window in every layer.
    "phi3": (transformers.Phi3Config, dict(
        {k: v for k, v in _BASE.items() if k != "head_dim"}, sliding_window=6,
        tie_word_embeddings=False)),
    # SmolLM3: a layer without RoPE (NoPE) every second one here (every fourth in the
    # released model), tied head.
    "smollm3": (transformers.SmolLM3Config, dict(
        _BASE, no_rope_layer_interval=2, tie_word_embeddings=True)),
    # Granite: embeddings, attention scores, block outputs and logits scaled (Granite
    # 3.x's embedding multiplier 12 and logits scaling 8; the others away from 1 too).
    "granite": (transformers.GraniteConfig, dict(
        _BASE, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.1, logits_scaling=8.0, tie_word_embeddings=True)),
    # OLMo 2: norms on the attention and MLP outputs only, q/k normed over all heads.
    "olmo2": (transformers.Olmo2Config, dict(_BASE, tie_word_embeddings=False)),
    # OLMo 3: OLMo 2 with three sliding layers per global one, and YaRN on the global
    # layers' RoPE only (the sliding ones keep the plain tables), tied head.
    "olmo3": (transformers.Olmo3Config, dict(
        _BASE, num_hidden_layers=4, sliding_window=5, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64,
                               "attention_factor": 1.2}})),
    # GPT-NeoX (Pythia): LayerNorm with biases, interleaved q|k|v with biases, RoPE on a
    # quarter of each head, a GELU MLP of two matrices, parallel residual, untied head.
    "gpt-neox": (transformers.GPTNeoXConfig, dict(_NEOX, rotary_pct=0.25)),
    # GPT-NeoX with the sequential residual (use_parallel_residual=False), RoPE on half of
    # each head, the tanh GELU and a tied head.
    "gpt-neox-sequential": (transformers.GPTNeoXConfig, dict(
        _NEOX, rotary_pct=0.5, use_parallel_residual=False, hidden_act="gelu_new",
        tie_word_embeddings=True)),
    # Phi (2): one LayerNorm per block that attention and MLP both read side by side,
    # biases on every projection and on the head, RoPE on 40% of each head (Phi-2's
    # factor; 6 of 16 dims here), the tanh GELU, untied head.
    "phi": (transformers.PhiConfig, dict(_NEOX, partial_rotary_factor=0.4)),
    # StarCoder2: sequential pre-norm blocks with LayerNorms, grouped KV heads, biases on
    # every projection, a tanh-GELU MLP of two matrices, a window in every layer, tied head.
    "starcoder2": (transformers.Starcoder2Config, dict(
        {k: v for k, v in _BASE.items() if k not in ("head_dim", "rms_norm_eps")},
        norm_epsilon=1e-5, use_bias=True, sliding_window=6, tie_word_embeddings=True)),
    # StarCoder2 without projection biases (use_bias=False), globally attending, untied.
    "starcoder2-nobias": (transformers.Starcoder2Config, dict(
        {k: v for k, v in _BASE.items() if k not in ("head_dim", "rms_norm_eps")},
        norm_epsilon=1e-5, use_bias=False, sliding_window=None, tie_word_embeddings=False)),
    # GPTBigCode (StarCoder, SantaCoder): GPT-2's block with learned positions and one KV
    # head (multi-query), the tanh GELU, tied head.
    "gpt-bigcode": (transformers.GPTBigCodeConfig, dict(_BIGCODE)),
    # GPTBigCode without multi-query (q, k, v interleaved per head in c_attn), scores
    # without 1/sqrt(D), the exact GELU, an untied head.
    "gpt-bigcode-mha": (transformers.GPTBigCodeConfig, dict(
        _BIGCODE, multi_query=False, scale_attn_weights=False, activation_function="gelu",
        tie_word_embeddings=False)),
    # Command R (cohere): one LayerNorm without a bias before attention and MLP side by
    # side, RoPE on adjacent pairs, q/k/v/o biases (attention_bias), logits times 0.25.
    "cohere": (transformers.CohereConfig, dict(
        {k: v for k, v in _BASE.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5,
        attention_bias=True, logit_scale=0.25)),
    # Command R7B (cohere2): three sliding layers with RoPE, then a global one without;
    # logits times 0.5, an untied head.
    "cohere2": (transformers.Cohere2Config, dict(
        {k: v for k, v in _BASE.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5,
        num_hidden_layers=4, sliding_window=5, logit_scale=0.5, tie_word_embeddings=False)),
    # StableLM (2): LayerNorm with biases, q/k/v biases, RoPE on a quarter of each head,
    # SwiGLU, grouped KV heads, untied head.
    "stablelm": (transformers.StableLmConfig, dict(
        {k: v for k, v in _BASE.items() if k not in ("head_dim", "rms_norm_eps")},
        layer_norm_eps=1e-5, use_qkv_bias=True, tie_word_embeddings=False)),
    # Mixtral: four experts, two per token, their weights renormalized; sliding window.
    "mixtral": (transformers.MixtralConfig, dict(
        {k: v for k, v in _BASE.items() if k != "head_dim"}, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6)),
    # Qwen2-MoE: q/k/v biases, four of six experts per token as the softmax gave them, and
    # a shared expert of its own width behind a sigmoid gate.
    "qwen2-moe": (transformers.Qwen2MoeConfig, dict(
        {k: v for k, v in _BASE.items() if k != "head_dim"}, num_experts=6,
        num_experts_per_tok=4, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        norm_topk_prob=False)),
    # Qwen3-MoE: Qwen3's per-head q/k norms, experts of their own width
    # (moe_intermediate_size), three of six per token, the top three's weights as the
    # softmax gave them (norm_topk_prob off), tied head.
    "qwen3-moe": (transformers.Qwen3MoeConfig, dict(
        _BASE, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
        norm_topk_prob=False, tie_word_embeddings=True)),
    # OLMoE: OLMo's whole-width q/k norms with the usual input norms, 8 experts, 2 per
    # token, renormalized (norm_topk_prob on).
    "olmoe": (transformers.OlmoeConfig, dict(
        {k: v for k, v in _BASE.items() if k != "head_dim"}, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-5)),
    # Phi-3 without a window (its fused layers then run attn_impl="fused").
    "phi3-global": (transformers.Phi3Config, dict(
        {k: v for k, v in _BASE.items() if k != "head_dim"}, tie_word_embeddings=True)),
}


def hf_config(variant: str, **overrides):
    config_class, kwargs = VARIANTS[variant]
    return config_class(**{**kwargs, **overrides})


def tiny_family_model(variant: str, seed: int = 0, **overrides):
    """A random transformers causal LM of ``variant``, eval mode, fp32."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(variant, **overrides)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    gemma = variant.startswith("gemma")
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1:  # norm scales: near one (Gemma stores scale - 1: near 0)
                param.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            else:
                param.copy_(0.25 * noise)
    return model


# llama.cpp's tensor names for these families (HF module -> GGUF name), as its
# convert_hf_to_gguf.py writes them; "{i}" is the block.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
}
_GEMMA_LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_ARCH = {"qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "phi3": "phi3",
             "olmo2": "olmo2", "olmo3": "olmo2", "stablelm": "stablelm", "mixtral": "llama",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def family_gguf_name(hf_name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "model.norm.bias": "output_norm.bias",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "mlp.gate.weight":  # a mixture of experts' router
        return f"blk.{layer}.ffn_gate_inp.weight"
    shared = {"mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp",  # Qwen2-MoE's
              "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
              "mlp.shared_expert.down_proj.weight": "ffn_down_shexp"}
    if rest in shared:
        return f"blk.{layer}.{shared[rest]}.weight"
    module, kind = rest.rsplit(".", 1)
    names = dict(_GGUF_LAYER_NAMES, post_attention_layernorm="ffn_norm")
    if arch in ("gemma2", "gemma3", "olmo2"):  # Gemma 1's are Llama's
        names.update(_GEMMA_LAYER_NAMES)
    return f"blk.{layer}.{names[module]}.{kind}"


def write_family_gguf(model, path, quant: str = "F32", *, norm_shift: bool = True,
                      vocabulary: str = "byte-level", chat_template: str | None = None,
                      extra_tensors: dict | None = None):
    """Writes a tiny Qwen3 / Gemma 2 / Gemma 3 / Phi-3 / OLMo 2 / OLMo 3 transformers model
    as llama.cpp's converter would: its names and metadata keys (OLMo 3 as ``olmo2`` with
    its window, per-layer pattern and YaRN), Gemma's norms stored plus one
    (``norm_shift``), no Q/K permutation; the byte-level tiny vocabulary of
    :func:`helpers_checkpoints.tiny_vocabulary` or, with ``vocabulary="sentencepiece"``,
    :func:`helpers_checkpoints.tiny_sentencepiece_vocabulary` as the real Gemma and Phi-3
    files carry (no space prefix for Gemma). The model's vocab_size must match. A Phi-3
    with LongRoPE gets llama.cpp's factor tensors and metadata, partial rotary its
    ``rope.dimension_count``; ``extra_tensors`` (GGUF name -> array) are added as they
    are."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from helpers_checkpoints import (_llama_cpp_permute, add_bpe_vocabulary,
                                     add_sentencepiece_vocabulary, tiny_sentencepiece_vocabulary)

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters
    partial = rope.get("partial_rotary_factor", 1.0) if arch in ("phi3", "stablelm") else 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))
    if arch == "stablelm":
        writer.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        # as llama.cpp's convert_hf_to_gguf.py writes a Phi-3 with LongRoPE
        original = cfg.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        factor = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(factor) / np.log(original))))
        extra_tensors = {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
                         "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32),
                         **(extra_tensors or {})}
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    elif cfg.model_type == "olmo3":  # as llama.cpp's converter writes Olmo 3
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(full["factor"])
            writer.add_rope_scaling_attn_factors(full["attention_factor"])
            writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(cfg, "sliding_window", None) and arch != "qwen3":
        writer.add_sliding_window(cfg.sliding_window)
    if arch.startswith("gemma"):
        if getattr(cfg, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if vocabulary == "sentencepiece":
        assert len(tiny_sentencepiece_vocabulary()[0]) == cfg.vocab_size
        add_sentencepiece_vocabulary(writer, add_space_prefix=not arch.startswith("gemma"),
                                     chat_template=chat_template)
    else:
        add_bpe_vocabulary(writer, cfg.vocab_size, chat_template)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    tensors = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' in-memory [E, 2F, d]
            gate, up = np.split(array, 2, axis=1)  # stacked per projection, as llama.cpp
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = array
        else:
            target = family_gguf_name(name, arch)
            if target.endswith("ffn_gate_inp_shexp.weight"):
                array = array.reshape(-1)  # llama.cpp's shape for it: [d]
            if arch == "llama" and ".attn_q." in target:  # llama.cpp permutes Llama's Q/K
                array = _llama_cpp_permute(array, cfg.num_attention_heads)
            if arch == "llama" and ".attn_k." in target:
                array = _llama_cpp_permute(array, cfg.num_key_value_heads)
            tensors[target] = array
    for target, array in tensors.items():
        if target == "output.weight" and cfg.tie_word_embeddings:
            continue
        if norm_shift and arch.startswith("gemma") and target.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if array.ndim >= 2 and quant != "F32":  # matrices and stacked experts
            writer.add_tensor(target, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, array.astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
