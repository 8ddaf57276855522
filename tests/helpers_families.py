"""Tiny random checkpoints of the families on the llama forward that differ from Llama
(Qwen3, Gemma 2, Gemma 3 text, Phi-3), made by transformers' own classes.

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

# variant -> (transformers config class, kwargs)
VARIANTS = {
    # Qwen3: q/k norms, tied head, every layer global.
    "qwen3-tied": (transformers.Qwen3Config, dict(_BASE, tie_word_embeddings=True)),
    # Qwen3: untied head; layers from max_window_layers on slide (use_sliding_window).
    "qwen3-untied-sliding": (transformers.Qwen3Config, dict(
        _BASE, tie_word_embeddings=False, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),
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
