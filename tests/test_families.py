"""Qwen3, Gemma 2, Gemma 3 (text), Phi-3, SmolLM3, Granite, OLMo 2, OLMo 3, StableLM and
GPT-NeoX (Pythia): parity with transformers, every method exact.

Tolerance: logits within 1e-4 of transformers' (fp32, both sides with IEEE float32
matmuls). What bounds it is float32 rounding of the same operations done in different
orders (our blocked online softmax, fused score scaling; logits here span ~10 units, so
1e-4 is ~1e-5 relative); a missing feature moves them by > 1e-2 (checked below).
"""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax import models
from specjax.families import from_hf_config, to_hf_config
from specjax.errors import CheckpointError, InvalidArgumentError

from conftest import drop_compiled_programs, hf_greedy, random_prompt, tiny_pair
from helpers_families import VARIANTS, hf_config, tiny_family_model
from tolerances import assert_sums_close, forward_sums

NEW = 28  # new tokens per generation: past every variant's window


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """variant -> (transformers model, specjax Model loaded from its saved HF directory;
    one variant saved in shards)."""
    out = {}
    for i, variant in enumerate(VARIANTS):
        hf_model = tiny_family_model(variant, seed=i)
        path = tmp_path_factory.mktemp(variant)
        kwargs = {"max_shard_size": "60KB"} if variant == "phi3" else {}
        hf_model.save_pretrained(path, **kwargs)
        out[variant] = hf_model, specjax.load(path)
    return out


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


def _assert_same_logits(got, want, config, tokens) -> None:
    """Two float32 forward passes of ``config`` over ``tokens`` (specjax's and transformers',
    or two of transformers'), summing in different orders: held to the rounding bound of
    that pass's chained sums (tests/tolerances.py)."""
    assert_sums_close(got, want, **forward_sums(config, len(tokens)))


def _logits(model, tokens, config=None):
    logits, _ = models.forward(model.params, config or model.config, jnp.asarray(tokens),
                               jnp.arange(len(tokens)))
    return np.asarray(logits)


def test_the_sharded_directory_is_sharded(pairs, tmp_path):
    hf_model, _ = pairs["phi3"]
    hf_model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(pairs, variant):
    hf_model, model = pairs[variant]
    assert model.config.family == hf_model.config.model_type
    tokens = random_prompt(7, 20)
    _assert_same_logits(_logits(model, tokens), _hf_logits(hf_model, tokens), model.config,
                        tokens)


# The mixtures of experts beyond Mixtral, and Gemma 1, Phi, StarCoder2, GPTBigCode and
# Cohere's models, generate in the slow tier (their parity, here, is what differs between
# them and the others; `spec` on Phi, StarCoder2, GPTBigCode and Command R is quick).
MOE_SLOW = ("qwen3-moe", "olmoe", "gemma", "qwen2-moe", "phi", "starcoder2",
            "starcoder2-nobias", "gpt-bigcode", "gpt-bigcode-mha", "cohere", "cohere2")


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v in MOE_SLOW
                                     else v for v in VARIANTS])
def test_greedy_generation_equals_transformers_generate(pairs, variant):
    hf_model, model = pairs[variant]
    for seed in (0, 1):
        prompt = random_prompt(seed, 6 + 7 * seed)
        assert specjax.generate(model, prompt, max_new_tokens=NEW).tokens == \
            hf_greedy(hf_model, prompt, NEW), (variant, seed)


# A deliberately wrong variant of each feature: the parity test above would catch it.
WRONG = [
    ("gemma2", "attn_softcap", None), ("gemma2", "final_softcap", None),
    ("gemma2", "layer_windows", ()), ("gemma2", "query_scale", None),
    ("gemma2", "norm_plus_one", False), ("gemma2", "embed_scale", False),
    ("gemma2", "sandwich_norms", False), ("gemma2", "hidden_act", "silu"),
    ("gemma3", "local_rope_theta", None), ("gemma3", "layer_windows", (4, 4, 4, 4, 4, 0)),
    ("qwen3-untied-sliding", "layer_windows", ()), ("phi3", "layer_windows", (7,)),
    ("smollm3", "no_rope_layers", ()), ("smollm3", "no_rope_layers", (0, 1)),
    ("granite", "embed_multiplier", None), ("granite", "residual_multiplier", None),
    ("granite", "query_scale", None), ("granite", "logits_divisor", None),
    ("olmo3", "local_rope_theta", None), ("olmo3", "layer_windows", ()),
    ("gpt-neox", "parallel_residual", False), ("gpt-neox", "rotary_dim", None),
    ("gpt-neox-sequential", "parallel_residual", True), ("gpt-neox", "norm_kind", "rms"),
    ("stablelm", "rotary_dim", None), ("stablelm", "norm_kind", "rms"),
    ("phi", "parallel_residual", False), ("phi", "head_bias", False),
    ("phi", "rotary_dim", None),
    ("starcoder2", "layer_windows", ()), ("starcoder2", "norm_kind", "rms"),
    ("starcoder2", "parallel_residual", True),
    ("gpt-bigcode", "learned_positions", False), ("gpt-bigcode-mha", "query_scale", None),
    ("cohere", "logit_scale", None), ("cohere", "norm_kind", "rms"),
    ("cohere2", "no_rope_layers", ()), ("cohere2", "layer_windows", ()),
    ("gemma", "norm_plus_one", False), ("gemma", "embed_scale", False),
    ("gemma", "hidden_act", "silu"), ("mixtral", "normalize_expert_weights", False),
    ("mixtral", "experts_per_token", 1),
    ("qwen3-moe", "normalize_expert_weights", True), ("qwen2-moe", "shared_expert_size", 0),
    ("qwen2-moe", "normalize_expert_weights", True), ("olmoe", "experts_per_token", 3),
]


@pytest.mark.parametrize("variant,field,value", WRONG)
def test_a_missing_or_wrong_feature_fails_parity(pairs, variant, field, value):
    hf_model, model = pairs[variant]
    tokens = random_prompt(7, 20)
    params = model.params
    if variant == "phi" and field == "parallel_residual":  # its one norm before each in turn
        params = {**params, "layers": {**params["layers"],
                                       "mlp_norm": params["layers"]["attn_norm"],
                                       "mlp_norm_bias": params["layers"]["attn_norm_bias"]}}
        wrong = dataclasses.replace(model.config, parallel_residual=False,
                                    shared_input_norm=False)
    else:
        wrong = dataclasses.replace(model.config, **{field: value})
    if field == "sandwich_norms":
        params = {**params, "layers": {k: v for k, v in params["layers"].items()
                                       if not k.startswith("post_")}}
    logits, _ = models.forward(params, wrong, jnp.asarray(tokens), jnp.arange(len(tokens)))
    assert np.abs(np.asarray(logits) - _hf_logits(hf_model, tokens)).max() > 1e-2


def _olmo_per_head_qk_norms(model):
    """An OLMo 2 read as if its q/k norms were per head (Qwen3's): each head normed by its
    own slice of the whole-width weights."""
    config = dataclasses.replace(model.config, qk_norm_whole=False)
    layers = dict(model.params["layers"])
    for name in ("q_norm", "k_norm"):  # [L, H*D] -> the first head's [L, D]
        layers[name] = layers[name][:, :config.head_dim]
    return config, {**model.params, "layers": layers}


def _olmo_pre_norms(model):
    """An OLMo 2 read as Gemma 2 reads its four norms: unit pre-norms added."""
    config = dataclasses.replace(model.config, pre_norms=True)
    layers = dict(model.params["layers"])
    for name in ("attn_norm", "mlp_norm"):
        layers[name] = jnp.ones_like(layers["post_attn_norm"])
    return config, {**model.params, "layers": layers}


@pytest.mark.parametrize("misread", [_olmo_per_head_qk_norms, _olmo_pre_norms])
def test_olmo_read_as_another_family_fails_parity(pairs, misread):
    """The two ways OLMo 2's block differs from the families before it: q/k normed over
    all heads at once, and no norm on the attention's and MLP's inputs."""
    hf_model, model = pairs["olmo2"]
    tokens = random_prompt(7, 20)
    config, params = misread(model)
    logits, _ = models.forward(params, config, jnp.asarray(tokens), jnp.arange(20))
    assert np.abs(np.asarray(logits) - _hf_logits(hf_model, tokens)).max() > 1e-2


def test_dropping_the_q_k_norms_fails_parity(pairs):
    hf_model, model = pairs["qwen3-tied"]
    tokens = random_prompt(7, 20)
    wrong = dataclasses.replace(model.config, qk_norm=False)
    params = {**model.params, "layers": {k: v for k, v in model.params["layers"].items()
                                         if k not in ("q_norm", "k_norm")}}
    logits, _ = models.forward(params, wrong, jnp.asarray(tokens), jnp.arange(20))
    assert np.abs(np.asarray(logits) - _hf_logits(hf_model, tokens)).max() > 1e-2


def test_configs_read_the_features(pairs):
    config = pairs["gemma2"][1].config
    assert (config.attn_softcap, config.final_softcap) == (3.0, 6.0)
    assert config.layer_windows == (5, 0) and config.head_dim == 256
    assert config.query_scale == pytest.approx(224 ** -0.5)
    gemma3 = pairs["gemma3"][1].config
    assert gemma3.layer_windows == (5, 5, 5, 5, 5, 0)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (10000.0, 100.0)
    assert gemma3.attn_softcap is None and gemma3.qk_norm
    assert pairs["qwen3-untied-sliding"][1].config.layer_windows == (0, 6, 6)
    assert pairs["gemma2"][1].config.windows_per_layer == (5, 0, 5, 0)
    # a draft of the first layers keeps their windows
    first = pairs["gemma3"][1].first_layers(2)
    assert first.config.windows_per_layer == (5, 5)
    assert pairs["phi3"][1].config.layer_windows == (6,)
    assert pairs["phi3-global"][1].config.layer_windows == ()
    smollm3 = pairs["smollm3"][1].config
    assert smollm3.no_rope_layers == (1, 0) and smollm3.rope_per_layer == (True, False, True)
    assert smollm3.family == "smollm3" and not smollm3.qk_norm
    # a pattern of NoPE layers only is kept (a draft of one NoPE layer), all-RoPE is ()
    assert dataclasses.replace(smollm3, no_rope_layers=(0,)).rope_per_layer == (False,) * 3
    assert dataclasses.replace(smollm3, no_rope_layers=(1, 1)).no_rope_layers == ()
    with pytest.raises(InvalidArgumentError, match="no_rope_layers must be 1"):
        dataclasses.replace(smollm3, no_rope_layers=(1, 2))
    olmo2, olmo3 = pairs["olmo2"][1].config, pairs["olmo3"][1].config
    assert olmo2.qk_norm_whole and not olmo2.pre_norms and olmo2.sandwich_norms
    assert olmo2.layer_windows == () and olmo2.local_rope_theta is None
    assert olmo3.layer_windows == (5, 5, 5, 0) and olmo3.local_rope_theta == 10000.0
    assert olmo3.rope_scaling.kind == "yarn" and olmo3.rope_scaling.factor == 4.0
    assert "layers/attn_norm" not in str(models.param_shapes(olmo2))
    assert models.param_shapes(olmo2)["layers"]["q_norm"] == (3, 64)
    with pytest.raises(InvalidArgumentError, match="pre_norms=False needs"):
        dataclasses.replace(olmo2, sandwich_norms=False)
    with pytest.raises(InvalidArgumentError, match="qk_norm_whole applies"):
        dataclasses.replace(olmo2, qk_norm=False)
    neox, sequential = pairs["gpt-neox"][1].config, pairs["gpt-neox-sequential"][1].config
    assert (neox.norm_kind, neox.gated_mlp, neox.parallel_residual) == ("layer", False, True)
    assert (neox.rotary_dim, sequential.rotary_dim) == (4, 8) and neox.head_dim == 16
    assert (neox.hidden_act, sequential.hidden_act) == ("gelu", "gelu_tanh")
    assert not sequential.parallel_residual and sequential.tie_word_embeddings
    assert "w_gate" not in models.param_shapes(neox)["layers"]
    assert models.param_shapes(neox)["final_norm_bias"] == (64,)
    with pytest.raises(InvalidArgumentError, match="unknown norm_kind"):
        dataclasses.replace(neox, norm_kind="batch")
    stablelm = pairs["stablelm"][1].config
    assert (stablelm.norm_kind, stablelm.rotary_dim, stablelm.qkv_bias) == ("layer", 4, True)
    assert stablelm.gated_mlp and not stablelm.parallel_residual
    for key in ("use_parallel_residual", "qk_layernorm"):  # StableLM 2 12B's: refused
        with pytest.raises(InvalidArgumentError, match=f"stablelm with {key}"):
            from_hf_config(hf_config("stablelm", **{key: True}).to_dict())
    mixtral, qwen3_moe, olmoe = (pairs[v][1].config for v in ("mixtral", "qwen3-moe", "olmoe"))
    qwen2_moe = pairs["qwen2-moe"][1].config
    assert (qwen2_moe.shared_expert_size, qwen2_moe.intermediate_size) == (80, 48)
    assert qwen2_moe.qkv_bias and not qwen2_moe.normalize_expert_weights
    assert models.param_shapes(qwen2_moe)["layers"]["shared_gate"] == (3, 64, 1)
    assert (mixtral.num_experts, mixtral.experts_per_token) == (4, 2)
    assert mixtral.normalize_expert_weights and mixtral.layer_windows == (6,)
    assert (qwen3_moe.num_experts, qwen3_moe.experts_per_token) == (6, 3)
    assert qwen3_moe.intermediate_size == 48 and not qwen3_moe.normalize_expert_weights
    assert qwen3_moe.qk_norm and not qwen3_moe.qk_norm_whole
    assert olmoe.qk_norm_whole and olmoe.pre_norms and not olmoe.sandwich_norms
    assert models.param_shapes(olmoe)["layers"]["we_down"] == (3, 8, 96, 64)
    assert "w_gate" not in models.param_shapes(olmoe)["layers"]
    for overrides, message in ((dict(mlp_only_layers=[1]), "dense layers among the sparse"),
                               (dict(decoder_sparse_step=2), "dense layers among the sparse")):
        with pytest.raises(InvalidArgumentError, match=message):
            from_hf_config(hf_config("qwen3-moe", **overrides).to_dict())
    with pytest.raises(InvalidArgumentError, match="olmoe with clip_qkv"):
        from_hf_config(hf_config("olmoe", clip_qkv=8.0).to_dict())
    with pytest.raises(InvalidArgumentError, match="learned_positions applies with"):
        dataclasses.replace(pairs["gpt-bigcode"][1].config, no_rope_layers=())
    with pytest.raises(InvalidArgumentError, match="cohere with use_qk_norm"):
        from_hf_config(hf_config("cohere", use_qk_norm=True).to_dict())
    raw = hf_config("starcoder2").to_dict()
    for key, value, message in (("partial_rotary_factor", 0.5, "RoPE on part of each head"),
                                ("hidden_act", "silu", "unsupported starcoder2 activation")):
        with pytest.raises(InvalidArgumentError, match=message):
            from_hf_config({**raw, key: value})
    for fields, message in ((dict(experts_per_token=7), r"experts_per_token must be in \[1"),
                            (dict(num_experts=0), "experts_per_token and shared_expert_size "
                                                  "apply with"),
                            (dict(mlp_bias=True), "gated MLPs without biases")):
        with pytest.raises(InvalidArgumentError, match=message):
            dataclasses.replace(qwen3_moe, **fields)


# Hub config.json files as released, in the keys of their time (Pythia-160M's GPT-NeoX
# keys, OLMo-2-0425-1B's and StableLM-2-1.6B's): read as transformers reads them.
HUB_CONFIGS = {
    "gpt_neox": dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"],
                     vocab_size=50304, hidden_size=768, intermediate_size=3072,
                     num_hidden_layers=12, num_attention_heads=12, hidden_act="gelu",
                     rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048,
                     layer_norm_eps=1e-5, use_parallel_residual=True,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], vocab_size=100352,
                  hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-6,
                  rope_theta=500000, rope_scaling=None, max_position_embeddings=4096,
                  attention_bias=False, tie_word_embeddings=False, eos_token_id=100257),
    "stablelm": dict(model_type="stablelm", architectures=["StableLmForCausalLM"],
                     vocab_size=100352, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                     partial_rotary_factor=0.25, rope_theta=10000, layer_norm_eps=1e-5,
                     use_qkv_bias=True, qk_layernorm=False, use_parallel_residual=False,
                     max_position_embeddings=4096, tie_word_embeddings=False,
                     bos_token_id=100257, eos_token_id=100257),
    # phi-2 as released (RoPE on 40% of its 80-wide heads)
    "phi": dict(model_type="phi", architectures=["PhiForCausalLM"], vocab_size=51200,
                hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=None, hidden_act="gelu_new",
                partial_rotary_factor=0.4, qk_layernorm=False, layer_norm_eps=1e-5,
                rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
                tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256),
    # gemma-2b as released (hidden_act "gelu", the legacy name of the tanh form)
    "gemma": dict(model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=256000,
                  hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                  hidden_act="gelu", max_position_embeddings=8192, rms_norm_eps=1e-6,
                  rope_theta=10000.0, attention_bias=False, bos_token_id=2, eos_token_id=1,
                  pad_token_id=0),
    # Qwen1.5-MoE-A2.7B as released (a shared expert of 5,632 beside 60 of 1,408)
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                      vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                      num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      decoder_sparse_step=1, max_position_embeddings=8192, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, use_sliding_window=False, sliding_window=32768,
                      max_window_layers=21, tie_word_embeddings=False, bos_token_id=151643,
                      eos_token_id=151643),
    # Mixtral-8x7B-v0.1, Qwen3-30B-A3B and OLMoE-1B-7B-0924 as released
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
                    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
                    sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
                    router_aux_loss_coef=0.02, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
                      rope_theta=1e6, rope_scaling=None, use_sliding_window=False,
                      sliding_window=None, max_window_layers=48, tie_word_embeddings=False,
                      bos_token_id=151643, eos_token_id=151645),
    # Command R (35B)'s and Command R7B's configs
    "cohere": dict(model_type="cohere", architectures=["CohereForCausalLM"], vocab_size=256000,
                   hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                   num_attention_heads=64, num_key_value_heads=64, hidden_act="silu",
                   max_position_embeddings=8192, layer_norm_eps=1e-5, logit_scale=0.0625,
                   rope_theta=8000000.0, use_qk_norm=False, attention_bias=False,
                   tie_word_embeddings=True, bos_token_id=5, eos_token_id=255001),
    "cohere2": dict(model_type="cohere2", architectures=["Cohere2ForCausalLM"],
                    vocab_size=256000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    hidden_act="silu", max_position_embeddings=8192, layer_norm_eps=1e-5,
                    logit_scale=0.25, rope_theta=50000.0, sliding_window=4096,
                    sliding_window_pattern=4, attention_bias=False, tie_word_embeddings=True,
                    bos_token_id=5, eos_token_id=255001),
    # StarCoder (15.5B)'s config: multi-query, learned positions over 8,192
    "gpt_bigcode": dict(model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"],
                        vocab_size=49152, n_embd=6144, n_inner=24576, n_layer=40, n_head=48,
                        n_positions=8192, multi_query=True, layer_norm_epsilon=1e-5,
                        activation_function="gelu_pytorch_tanh", scale_attn_weights=True,
                        attention_softmax_in_fp32=True, scale_attention_softmax_in_fp32=True,
                        bos_token_id=0, eos_token_id=0),
    # StarCoder2-3B's config (a window of 4,096 in every layer, 2 KV heads of 24)
    "starcoder2": dict(model_type="starcoder2", architectures=["Starcoder2ForCausalLM"],
                       vocab_size=49152, hidden_size=3072, intermediate_size=12288,
                       num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                       hidden_act="gelu_pytorch_tanh", max_position_embeddings=16384,
                       norm_epsilon=1e-5, rope_theta=999999.4420358813, sliding_window=4096,
                       use_bias=True, residual_dropout=0.1, embedding_dropout=0.1,
                       attention_dropout=0.1, bos_token_id=0, eos_token_id=0),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], vocab_size=50304,
                  hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                  num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  rope_scaling=None, tie_word_embeddings=False, pad_token_id=1,
                  eos_token_id=50279),
}


@pytest.mark.parametrize("model_type", list(HUB_CONFIGS))
def test_hub_config_files_read_as_transformers_reads_them(model_type):
    import transformers

    raw = HUB_CONFIGS[model_type]
    ours = from_hf_config(raw)
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    assert ours == from_hf_config(config_class(**raw).to_dict())
    assert ours.rope_dim == {"gpt_neox": 16, "olmo2": 128, "stablelm": 16, "mixtral": 128,
                             "qwen3_moe": 128, "olmoe": 128, "gemma": 256,
                             "qwen2_moe": 128, "phi": 32, "starcoder2": 128,
                             "gpt_bigcode": 128, "cohere": 128, "cohere2": 128}[model_type]
    if model_type == "phi":
        assert (ours.head_dim, ours.hidden_act, ours.head_bias) == (80, "gelu_tanh", True)
        assert ours.parallel_residual and ours.shared_input_norm
    if model_type == "starcoder2":
        assert (ours.layer_windows, ours.num_kv_heads, ours.norm_kind) == ((4096,), 2, "layer")
        assert ours.qkv_bias and ours.mlp_bias and ours.tie_word_embeddings
        assert not ours.gated_mlp and not ours.parallel_residual
        assert ours.hidden_act == "gelu_tanh"
    if model_type in ("cohere", "cohere2"):
        assert ours.norm_kind == "layer_nobias" and ours.shared_input_norm
        assert ours.logit_scale == {"cohere": 0.0625, "cohere2": 0.25}[model_type]
        assert ours.layer_windows == {"cohere": (), "cohere2": (4096, 4096, 4096, 0)}[
            model_type]
        assert ours.no_rope_layers == {"cohere": (), "cohere2": (1, 1, 1, 0)}[model_type]
    if model_type == "gpt_bigcode":
        assert (ours.num_kv_heads, ours.intermediate_size, ours.max_position_embeddings) == (
            1, 24576, 8192)
        assert ours.learned_positions and ours.rope_per_layer == (False,) * 40
        assert ours.query_scale is None and ours.tie_word_embeddings
    if model_type == "gemma":
        assert ours.hidden_act == "gelu_tanh" and ours.norm_plus_one and ours.embed_scale
        assert not ours.sandwich_norms and ours.tie_word_embeddings
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        assert (ours.num_experts, ours.experts_per_token, ours.intermediate_size,
                ours.shared_expert_size) == {
            "mixtral": (8, 2, 14336, 0), "qwen2_moe": (60, 4, 1408, 5632),
            "qwen3_moe": (128, 8, 768, 0), "olmoe": (64, 8, 1024, 0)}[model_type]
        assert ours.normalize_expert_weights == (model_type in ("mixtral", "qwen3_moe"))
        assert ours.layer_windows == ()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_configs_round_trip_through_transformers(pairs, variant):
    config = pairs[variant][1].config
    config_class, _ = VARIANTS[variant]
    assert from_hf_config(config_class(**to_hf_config(config)).to_dict()) == config


def test_the_multimodal_gemma3_config_reads_its_text_tower():
    import transformers

    text = hf_config("gemma3").to_dict()
    nested = transformers.Gemma3Config(text_config=text).to_dict()
    assert nested["model_type"] == "gemma3"
    assert from_hf_config(nested) == from_hf_config(text)


def test_the_multimodal_gemma3_checkpoint_names_load(pairs):
    from specjax.checkpoints_tools.keymap import hf_tensors_from_params, params_from_hf_tensors

    model = pairs["gemma3"][1]
    tensors = hf_tensors_from_params(model.config, model.params)
    renamed = {name.replace("model.", "model.language_model.", 1): value
               for name, value in tensors.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    params = params_from_hf_tensors(model.config, renamed)
    np.testing.assert_array_equal(params["layers"]["q_norm"],
                                  np.asarray(model.params["layers"]["q_norm"]))


def test_phi3_fused_tensors_with_a_wrong_shape_are_named(pairs):
    from specjax.checkpoints_tools.keymap import hf_tensors_from_params, params_from_hf_tensors

    model = pairs["phi3"][1]
    tensors = hf_tensors_from_params(model.config, model.params)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    with pytest.raises(CheckpointError, match="qkv_proj.weight"):
        params_from_hf_tensors(model.config, tensors)
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        params_from_hf_tensors(model.config, tensors)


@pytest.mark.parametrize("variant", ["gemma2", "olmo3", "gpt-neox", "stablelm", "mixtral",
                                     pytest.param("qwen3-moe", marks=pytest.mark.slow),
                                     pytest.param("qwen2-moe", marks=pytest.mark.slow),
                                     pytest.param("phi", marks=pytest.mark.slow),
                                     pytest.param("starcoder2", marks=pytest.mark.slow),
                                     pytest.param("gpt-bigcode", marks=pytest.mark.slow),
                                     pytest.param("gpt-bigcode-mha", marks=pytest.mark.slow),
                                     "cohere",
                                     pytest.param("cohere2", marks=pytest.mark.slow)])
def test_the_exported_directory_loads_in_transformers(pairs, tmp_path, variant):
    import transformers
    from specjax.checkpoints_tools.hf import save_hf_directory

    hf_model, model = pairs[variant]
    save_hf_directory(model.config, model.params, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = random_prompt(7, 20)
    _assert_same_logits(_hf_logits(again, tokens), _hf_logits(hf_model, tokens), model.config,
                        tokens)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == \
        hf_model.config.model_type


METHOD_VARIANTS = ["qwen3-untied-sliding", "gemma2", "gemma3", "phi3", "smollm3", "granite",
                   "olmo2", "olmo3", "gpt-neox", "stablelm", "mixtral", "qwen3-moe", "olmoe",
                   "gemma", "qwen2-moe", "phi", "starcoder2", "gpt-bigcode", "cohere",
                   "cohere2"]


class _LazyTables(dict):
    """variant -> n-gram tables fitted to its model, on first use (the quick tier's cases
    of most variants are `spec`, which reads none)."""

    def __init__(self, pairs):
        super().__init__()
        self.pairs = pairs

    def __missing__(self, variant):
        from conftest import fitted_tables

        self[variant] = fitted_tables(self.pairs[variant][1], (0, 1), 32)
        return self[variant]


@pytest.fixture(scope="module")
def tables(pairs):
    return _LazyTables(pairs)


# The newest variants' features are in their layers, which every method runs alike: `spec`
# in the quick tier, their whole grid in the slow one (CI runs both).
QUICK_ONLY_SPEC = ("smollm3", "granite", "gpt-neox", "mixtral", "phi")
# Whole grid in the slow tier; parity covers the quick one.
SLOW_ONLY = ("olmo2", "olmo3", "stablelm", "qwen3-moe", "olmoe", "gemma", "qwen2-moe",
             "starcoder2", "gpt-bigcode", "cohere", "cohere2")
GRID_METHODS = ("spec", "tree", "ngram", "staged")


# The slow tier's variants whose numerics differ most from Llama's, each with one method
# compiled as users compile (marked users_compile): sliding windows with YaRN (OLMo 3),
# LayerNorm with a parallel residual (GPT-NeoX) or partial RoPE (StableLM), Cohere 2's
# logit scale and windows, and routed experts (Mixtral's two, Qwen3-MoE's eight), with
# every method among them. Compiled as users compile, a case took 28-62 s of a loaded slow
# tier, 19-26 s with the suite's options (2026-11-29; a method per variant had been so
# compiled); the real model checks every method as users compile
# (tests/test_smollm2_speculative.py).
AS_USERS = {"olmo3": "tree", "gpt-neox": "staged", "stablelm": "spec", "cohere2": "ngram",
            "mixtral": "tree", "qwen3-moe": "staged"}


def _method_case(method: str, variant: str):
    """The suite compiles with XLA's CPU optimisations off (conftest._fast_compiles), which
    is a third to a quarter of the compile time of these tiny programs as users compile
    them. In the slow tier each variant of :data:`AS_USERS` has its method there compiled as
    users do (marked users_compile): `ar` and the method alike in either case."""
    if not (variant in SLOW_ONLY or (variant in QUICK_ONLY_SPEC and method != "spec")):
        return (method, variant)
    marks = [pytest.mark.slow] + ([pytest.mark.users_compile]
                                  if AS_USERS.get(variant) == method else [])
    return pytest.param(method, variant, marks=marks)


# Variant by variant, so that a worker runs a variant's methods one after another and
# one_variants_programs keeps its `ar` programs for them.
METHOD_CASES = [_method_case(method, variant)
                for variant in METHOD_VARIANTS for method in GRID_METHODS]


_LAST_VARIANT = {"name": None}


@pytest.fixture
def one_variants_programs(variant):
    """The grid compiles hundreds of programs (20 variants, each method greedy and
    coupled): kept until the module's end (conftest._release_compiled_programs), all in
    one worker of the slow tier, XLA crashed in that worker three times in two days (an
    abort in ``serialize()``, a segmentation fault compiling, each in a late `staged`
    case, in workers of 4-5 GB). A case of another variant than the case before drops
    the compiled programs first."""
    if _LAST_VARIANT["name"] not in (None, variant):
        drop_compiled_programs()
    _LAST_VARIANT["name"] = variant


@pytest.mark.parametrize("method,variant", METHOD_CASES)
@pytest.mark.usefixtures("one_variants_programs")
def test_every_method_equals_ar(pairs, tables, variant, method):
    """Greedy and coupled sampling (temperature 1) give ``ar``'s tokens. The target drafts
    for itself, so most tokens come from deep tree nodes, whose logits the verify pass
    computes over windows that the committed cache and the tree straddle."""
    from specjax.methods import METHODS

    model = pairs[variant][1]
    resources = {}
    if METHODS[method].uses_draft:
        resources["draft"] = model
    if METHODS[method].uses_ngram:
        resources["ngram"] = tables[variant]
    for sampling in ({}, dict(temperature=1.0)):
        for seed in (0, 1):
            prompt = random_prompt(seed, 6)
            expected = specjax.generate(model, prompt, max_new_tokens=NEW, seed=seed,
                                        **sampling).tokens
            out = specjax.generate(model, prompt, max_new_tokens=NEW, seed=seed,
                                   method=method, **resources, **sampling)
            assert out.tokens == expected, (variant, method, sampling, seed)
            if not sampling and method != "ngram":
                assert out.stats["mean_accepted"] > 1.5, out.stats["mean_accepted"]


@pytest.mark.parametrize("variant", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_the_attention_kernel_takes_soft_capping_and_windows(pairs, variant):
    """Gemma's soft-capping and sliding windows are in the GPU attention kernel: with
    ``attention="kernel"`` (interpreted on the CPU) greedy generation gives ``auto``'s
    tokens and the stats name no attention fallback."""
    prompt = random_prompt(0, 9)  # 9 + 8 tokens: past both models' 5-slot windows
    model = pairs[variant][1]
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    out = specjax.generate(model, prompt, max_new_tokens=8,
                           kernels=specjax.KernelOptions(attention="kernel"))
    assert out.tokens == expected
    assert "attention_fallback" not in out.stats
    assert models.attention_fallback(model.config, "gpu") is None


def kernel_gives_autos_tokens(hf_model, folder, kernel: str):
    """Saves ``hf_model`` to ``folder`` and loads it; attention ``"kernel"`` with the
    ``kernel`` platform's kernel interpreted gives ``"auto"``'s 8 tokens after a 9-token
    prompt, and no stats or platform names an attention fallback. Returns the model."""
    hf_model.save_pretrained(folder)
    model = specjax.load(folder)
    prompt = random_prompt(0, 9)
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    out = specjax.generate(model, prompt, max_new_tokens=8, kernels=specjax.KernelOptions(
        attention="kernel", interpret_variant=kernel))
    assert out.tokens == expected
    assert "attention_fallback" not in out.stats
    assert models.attention_fallback(model.config, kernel) is None
    return model


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_the_attention_kernels_take_phi3s_head_dim_96(tmp_path, kernel):
    """Phi-3's head size (96; here 2 query heads over 1 KV head, its sliding window in every
    layer): attention ``"kernel"``, each kernel interpreted on the CPU (the GPU kernel's
    128-wide tiles over the 96 columns of the cache), gives ``"auto"``'s tokens (the jnp
    attention on the CPU), and no platform's stats would name an attention fallback."""
    hf_model = tiny_family_model("phi3", seed=7, hidden_size=192, num_attention_heads=2,
                                 num_key_value_heads=1)
    model = kernel_gives_autos_tokens(hf_model, tmp_path, kernel)  # 17 tokens > 6 slots
    assert model.config.head_dim == 96 and model.config.layer_windows


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_the_attention_kernels_take_phi2s_head_dim_80(tmp_path, kernel):
    """Phi-2's head size (80; here 2 heads, RoPE on 40% of each, biases): attention
    ``"kernel"``, each kernel interpreted on the CPU (the GPU kernel's 128-wide tiles over
    the 80 columns of the cache), gives ``"auto"``'s tokens (the jnp attention on the CPU),
    and no platform's stats would name an attention fallback."""
    hf_model = tiny_family_model("phi", seed=7, hidden_size=160, num_attention_heads=2)
    assert kernel_gives_autos_tokens(hf_model, tmp_path, kernel).config.head_dim == 80


def test_the_attention_fallback_is_recorded_and_the_kernel_refuses(pairs):
    """A head_dim the TPU kernel does not take (16): the stats of a TPU run would name it,
    and ``attention="kernel"`` with the TPU kernel refuses in one line. Phi-3's head_dim 96
    and Phi-2's 80 are taken by both kernels, 48 by the GPU kernel only; 40 by neither, and
    both platforms name it."""
    phi3 = pairs["phi3-global"][1]
    assert models.attention_fallback(phi3.config, "tpu") == (
        "jnp attention: the Pallas attention kernel (tpu) takes no head_dim 16")
    assert models.attention_fallback(pairs["qwen3-tied"][1].config, "gpu") is None
    for platform in ("gpu", "tpu"):
        for taken in (80, 96):
            assert models.attention_fallback(
                dataclasses.replace(phi3.config, head_dim=taken), platform) is None, platform
        assert models.attention_fallback(dataclasses.replace(phi3.config, head_dim=40),
                                         platform) == (
            f"jnp attention: the Pallas attention kernel ({platform}) takes no head_dim 40")
    assert models.attention_fallback(dataclasses.replace(phi3.config, head_dim=48), "gpu") is None
    assert models.attention_fallback(dataclasses.replace(phi3.config, head_dim=48), "tpu") == (
        "jnp attention: the Pallas attention kernel (tpu) takes no head_dim 48")
    with pytest.raises(InvalidArgumentError, match="head_dim 16 is not supported") as info:
        specjax.generate(phi3, random_prompt(0, 6), max_new_tokens=2,
                         kernels=specjax.KernelOptions(attention="kernel",
                                                       interpret_variant="tpu"))
    assert "\n" not in str(info.value)


def test_fused_layers_are_refused_naming_the_architecture(pairs):
    """Every family here runs on the shared decoder, whose fused layers take all its
    features (mixtures of experts too: tests/test_fused_experts.py); a GPT-2 model has no
    fused layers, and ``"fused"`` refuses it in one line naming that."""
    assert all(models.has_fused_layers(model.config) for _, model in pairs.values())
    _, gpt2 = tiny_pair("gpt2", seed=3)
    with pytest.raises(InvalidArgumentError,
                       match=re.escape("attention 'fused'") + ".*gpt2 models have none"
                       ) as info:
        specjax.generate(gpt2, [1, 2, 3], max_new_tokens=2,
                         kernels=specjax.KernelOptions(attention="fused"))
    assert "\n" not in str(info.value)


# Families whose layers the fused kernels take: Phi-3 (Llama once its fused tensors are
# split), Qwen3 (per-head q/k norms in the row-tiled norm kernel), SmolLM3 (NoPE layers),
# Granite (its four multipliers: elementwise, and the query scale in the attention kernel),
# OLMo 2 (no input norms; whole-width q/k norms and output norms in the norm kernel),
# StableLM (LayerNorm with biases in the norm kernel, partial RoPE), Command R (one
# LayerNorm without a bias for attention and MLP side by side, a logit scale), Gemma (1)
# (1 + w norms, GeGLU in the epilogue, scaled embeddings, one KV head), GPT-NeoX (parallel
# and sequential; the erf GELU of a two-matrix MLP), Phi, StarCoder2 without a window, and
# GPTBigCode (learned positions; multi-query, and MHA without the score scale); the
# families with sliding windows (by position in the GPU ordered kernel) and Gemma 2's
# soft-capped attention: Qwen3's sliding layers, Gemma 2 and 3 (local RoPE), Phi-3,
# StarCoder2, OLMo 3, Command R7B; and the mixtures of experts (tests/test_fused_experts.py):
# Mixtral (with its window), Qwen2-MoE (a gated shared expert), Qwen3-MoE, OLMoE.
@pytest.mark.parametrize("variant", ["phi3-global"] + [
    pytest.param(variant, marks=pytest.mark.slow)
    for variant in ("qwen3-tied", "smollm3", "granite", "olmo2", "stablelm", "cohere", "gemma", "gpt-neox",
                    "gpt-neox-sequential", "phi", "starcoder2-nobias", "gpt-bigcode",
                    "gpt-bigcode-mha", "qwen3-untied-sliding", "gemma2", "gemma2-nocap",
                    "gemma3", "phi3", "starcoder2", "olmo3", "cohere2", "mixtral",
                    "qwen2-moe", "qwen3-moe", "olmoe")])
def test_the_fused_layers_give_ar_tokens(pairs, variant):
    """The fused (kernel, interpreted here) layers give ``ar``'s greedy tokens; the
    mixtures of experts with every projection of their layers in the kernels (no fallback
    but the head's, over a vocabulary that is not a multiple of 16: the experts' widths
    are, the routers' and the shared gate's are padded to one)."""
    model = pairs[variant][1]
    assert models.has_fused_layers(model.config)
    prompt = random_prompt(0, 6)
    expected = specjax.generate(model, prompt, max_new_tokens=8).tokens
    out = specjax.generate(model, prompt, max_new_tokens=8,
                           kernels=specjax.KernelOptions(attention="fused"))
    assert out.tokens == expected
    if model.config.num_experts:
        head = f"N={model.config.vocab_size} must be"
        assert [reason for reason in out.stats["fallbacks"] if head not in reason] == []


GGUF_VARIANTS = {"qwen3-tied": {}, "qwen3-untied-sliding": dict(use_sliding_window=False),
                 # llama.cpp keeps no query_pre_attn_scalar: it is head_dim (27B aside)
                 "gemma2": dict(query_pre_attn_scalar=256), "gemma3": {}, "phi3": {},
                 # llama.cpp writes Olmo 3 as olmo2: window, layer pattern, YaRN
                 "olmo2": {}, "olmo3": {}, "stablelm": {},
                 # Mixtral as llama.cpp's `llama` with experts (no window there); llama.cpp's
                 # graphs rescale Qwen3-MoE's picked probabilities and never OLMoE's
                 "mixtral": dict(sliding_window=None), "qwen3-moe": dict(norm_topk_prob=True),
                 "olmoe": dict(norm_topk_prob=False), "gemma": {},
                 "qwen2-moe": dict(norm_topk_prob=False)}


def _gguf_pair(variant, path, **kwargs):
    from helpers_checkpoints import tiny_sentencepiece_vocabulary, tiny_vocabulary
    from helpers_families import write_family_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    tokens = (tiny_sentencepiece_vocabulary() if kwargs.get("vocabulary") == "sentencepiece"
              else tiny_vocabulary())[0]
    hf_model = tiny_family_model(variant, seed=5, vocab_size=len(tokens),
                                 **GGUF_VARIANTS[variant])
    config, params, tokenizer = load_gguf(write_family_gguf(hf_model, path, **kwargs))
    return hf_model, specjax.Model.from_params(config, params, tokenizer)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v in MOE_SLOW
                                     else v for v in GGUF_VARIANTS])
def test_gguf_written_from_the_same_weights_gives_the_same_logits(variant, tmp_path):
    hf_model, model = _gguf_pair(variant, tmp_path / f"{variant}.gguf")
    expected_config = from_hf_config(hf_model.config.to_dict())
    assert dataclasses.replace(model.config, eos_token_ids=(), bos_token_id=None,
                               max_position_embeddings=expected_config.max_position_embeddings
                               ) == dataclasses.replace(expected_config, eos_token_ids=(),
                                                        bos_token_id=None)
    tokens = random_prompt(7, 20, vocab=hf_model.config.vocab_size)
    _assert_same_logits(_logits(model, tokens), _hf_logits(hf_model, tokens), model.config,
                        tokens)
    assert model.tokenizer("the")["input_ids"]  # the GGUF's tokenizer came with it


def test_a_quantized_mixtral_gguf_splits_its_stacked_experts(tmp_path):
    """llama.cpp stacks each layer's experts in one tensor per projection ([E, out, in]):
    quantized (Q8_0), every expert's rows are the gguf package's own dequantization of
    its slice, transposed to specjax's [in, out], and the router likewise."""
    import gguf
    from gguf.quants import dequantize
    from helpers_checkpoints import tiny_vocabulary
    from helpers_families import write_family_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("mixtral", seed=5, vocab_size=len(tiny_vocabulary()[0]),
                                 sliding_window=None)
    path = write_family_gguf(hf_model, tmp_path / "mixtral-q8.gguf", quant="Q8_0")
    config, params, _ = load_gguf(path)
    assert (config.family, config.num_experts, config.experts_per_token) == ("mixtral", 4, 2)
    stored = {t.name: dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    for leaf, name in (("we_gate", "ffn_gate_exps"), ("we_up", "ffn_up_exps"),
                       ("we_down", "ffn_down_exps"), ("router", "ffn_gate_inp")):
        want = stored[f"blk.1.{name}.weight"]
        np.testing.assert_array_equal(np.asarray(params["layers"][leaf][1]),
                                      np.swapaxes(want, -1, -2))


def test_a_granite_gguf_gets_its_multipliers(tmp_path):
    """llama.cpp's granite files: Q/K permuted as for Llama, the four scalars as
    ``embedding_scale``, ``residual_scale``, ``logit_scale`` and ``attention.scale``."""
    import gguf
    from helpers_checkpoints import tiny_vocabulary, write_tiny_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("granite", seed=9, vocab_size=len(tiny_vocabulary()[0]))
    cfg = hf_model.config
    metadata = {gguf.Keys.LLM.EMBEDDING_SCALE: cfg.embedding_multiplier,
                gguf.Keys.LLM.RESIDUAL_SCALE: cfg.residual_multiplier,
                gguf.Keys.LLM.LOGIT_SCALE: cfg.logits_scaling,
                gguf.Keys.Attention.SCALE: cfg.attention_multiplier}
    config, params, _ = load_gguf(write_tiny_gguf(hf_model, tmp_path / "granite.gguf",
                                                  arch="granite", float_metadata=metadata))
    assert (config.embed_multiplier, config.logits_divisor) == (12.0, 8.0)
    model = specjax.Model.from_params(config, params)
    tokens = random_prompt(7, 20, vocab=cfg.vocab_size)
    _assert_same_logits(_logits(model, tokens), _hf_logits(hf_model, tokens), config, tokens)


def test_a_smollm3_gguf_gets_its_nope_layers(tmp_path):
    """llama.cpp's smollm3 files carry no key for the NoPE layers (every fourth, hard-coded
    there) and permute Q/K as for Llama: the loaded model is transformers' SmolLM3."""
    from helpers_checkpoints import tiny_vocabulary, write_tiny_gguf
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("smollm3", seed=8, vocab_size=len(tiny_vocabulary()[0]),
                                 num_hidden_layers=4, no_rope_layer_interval=4)
    config, params, _ = load_gguf(write_tiny_gguf(hf_model, tmp_path / "smollm3.gguf",
                                                  arch="smollm3"))
    assert config.no_rope_layers == (1, 1, 1, 0) and config.family == "smollm3"
    model = specjax.Model.from_params(config, params)
    tokens = random_prompt(7, 20, vocab=hf_model.config.vocab_size)
    _assert_same_logits(_logits(model, tokens), _hf_logits(hf_model, tokens), config, tokens)


def _layer_norm_gguf_writer(cfg, path, arch: str, *, eps=None, ffn=None, kv_heads=None,
                            partial_rope: bool = True):
    """A GGUF writer of ``arch`` with the metadata llama.cpp's converter writes for the
    LayerNorm families (``gptneox``, ``phi2``, ``starcoder2``, ``starcoder``, ``command-r``,
    ``cohere2``: RoPE dims when ``partial_rope``, KV heads when given) and the tiny
    vocabulary."""
    import gguf
    from helpers_checkpoints import add_bpe_vocabulary

    dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(ffn or cfg.intermediate_size)
    if partial_rope:
        writer.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * dim))
    writer.add_head_count(cfg.num_attention_heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps if eps is None else eps)
    add_bpe_vocabulary(writer, cfg.vocab_size)
    return writer


def _write_tensors(writer, hf_model, names: dict, blocks: str = "model.layers",
                   rename=lambda name: name):
    """Writes ``hf_model``'s tensors under llama.cpp's names and closes the file: a block's
    module ``{blocks}.{i}.{sub}`` as ``blk.{i}.{names[sub]}``, others as ``names[module]``
    (a tied head is not written); ``rename`` edits each name last."""
    tied = hf_model.config.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        if module == "lm_head" and tied:
            continue  # llama.cpp writes no output tensor for a tied head
        if module.startswith(blocks + "."):
            index, sub = module[len(blocks) + 1:].split(".", 1)
            target = f"blk.{index}.{names[sub]}.{kind}"
        else:
            target = f"{names[module]}.{kind}"
        writer.add_tensor(rename(target), tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_reads_as_transformers(path, hf_model):
    """Loads the GGUF file ``path`` written from ``hf_model``: its config as transformers'
    (special ids aside), its logits within the pass's rounding bound. Returns the config."""
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    config, params, tokenizer = load_gguf(path)
    assert dataclasses.replace(config, eos_token_ids=(), bos_token_id=None) == \
        from_hf_config(hf_model.config.to_dict())
    tokens = random_prompt(7, 20, vocab=hf_model.config.vocab_size)
    model = specjax.Model.from_params(config, params, tokenizer)
    _assert_same_logits(_logits(model, tokens), _hf_logits(hf_model, tokens), config, tokens)
    return config


def _write_neox_gguf(hf_model, path, *, stack_qkv: bool = True):
    """A tiny GPT-NeoX written as llama.cpp's converter writes one (its metadata keys; q|k|v
    stacked rather than interleaved per head unless ``stack_qkv`` is False)."""
    cfg = hf_model.config
    heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    writer = _layer_norm_gguf_writer(cfg, path, "gptneox")
    writer.add_parallel_residual(cfg.use_parallel_residual)
    names = {"embed_in": "token_embd", "final_layer_norm": "output_norm",
             "input_layernorm": "attn_norm", "attention.query_key_value": "attn_qkv",
             "attention.dense": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            writer.add_tensor("output.weight", array)
            continue
        parts = name.split(".")
        layer = parts[2] if parts[1] == "layers" else None
        module = ".".join(parts[3:-1] if layer is not None else parts[1:-1])
        target = names[module] + "." + parts[-1]
        if module == "attention.query_key_value" and stack_qkv:  # [H, 3, D] -> [3, H, D]
            array = np.swapaxes(array.reshape(heads, 3, dim, -1), 0, 1).reshape(array.shape)
        writer.add_tensor(f"blk.{layer}.{target}" if layer is not None else target, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("variant", ["gpt-neox", "gpt-neox-sequential"])
def test_a_gpt_neox_gguf_gives_transformers_logits(variant, tmp_path):
    """llama.cpp's gptneox files (Pythia): q|k|v stacked, which the loader interleaves per
    head again; partial RoPE from ``rope.dimension_count``; the residual kind from
    ``use_parallel_residual``. Read without the re-interleaving, the logits are wrong."""
    from helpers_checkpoints import tiny_vocabulary
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    # The file names no activation: read as Pythia's exact GELU (HF's "gelu"; llama.cpp's
    # own graph computes the tanh form), so the model here is one with that GELU.
    hf_model = tiny_family_model(variant, seed=6, vocab_size=len(tiny_vocabulary()[0]),
                                 hidden_act="gelu")
    config = _gguf_reads_as_transformers(_write_neox_gguf(hf_model, tmp_path / "neox.gguf"),
                                         hf_model)
    tokens = random_prompt(7, 20, vocab=hf_model.config.vocab_size)
    _, unstacked, _ = load_gguf(_write_neox_gguf(hf_model, tmp_path / "interleaved.gguf",
                                                 stack_qkv=False))
    wrong = _logits(specjax.Model.from_params(config, unstacked), tokens)
    assert np.abs(wrong - _hf_logits(hf_model, tokens)).max() > 1e-2


def test_cohere_q_and_k_read_without_reordering_their_pairs_fail_parity(pairs):
    """Cohere's RoPE rotates adjacent pairs of each head; the key map moves them to the
    halves this forward rotates. Rows left in the checkpoint's order give other logits."""
    from specjax.families.rules import halves_to_pairs

    hf_model, model = pairs["cohere"]
    config, layers = model.config, dict(model.params["layers"])
    for leaf, heads in (("wq", config.num_heads), ("wk", config.num_kv_heads)):
        layers[leaf] = np.stack([halves_to_pairs(np.asarray(w).T, heads).T
                                 for w in layers[leaf]])
    for leaf, heads in (("bq", config.num_heads), ("bk", config.num_kv_heads)):
        layers[leaf] = np.stack([halves_to_pairs(np.asarray(b), heads)
                                 for b in layers[leaf]])
    tokens = random_prompt(7, 20)
    logits, _ = models.forward({**model.params, "layers": layers}, config, jnp.asarray(tokens),
                               jnp.arange(len(tokens)))
    assert np.abs(np.asarray(logits) - _hf_logits(hf_model, tokens)).max() > 1e-2


def test_a_head_subset_keeps_phis_head_bias(pairs):
    """A draft's head subset (Model.with_head_subset) scores its ids as the whole head
    does, the head's bias included (without it every subset logit would be off by its
    bias, about 1 here)."""
    model = pairs["phi"][1]
    tokens = random_prompt(7, 12)
    full = _logits(model, tokens)
    ids = np.arange(0, model.config.vocab_size, 3)
    subset = _logits(model.with_head_subset(ids), tokens)
    np.testing.assert_allclose(subset[:, ids], full[:, ids], rtol=1e-6, atol=1e-5)


def test_a_phi2_gguf_gives_transformers_logits(tmp_path):
    """llama.cpp's phi2 files: Llama's names for q, k, v and the one norm, ``attn_output``
    for ``dense``, ``ffn_up``/``ffn_down`` for ``fc1``/``fc2``, biases everywhere (the
    head's too), ``rope.dimension_count`` for the partial rotary; the original checkpoints'
    fused ``attn_qkv`` is refused in one line."""
    from helpers_checkpoints import tiny_vocabulary
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("phi", seed=6, vocab_size=len(tiny_vocabulary()[0]))
    cfg = hf_model.config
    names = {"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm",
             "lm_head": "output", "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}

    def write(path, fused=False):
        writer = _layer_norm_gguf_writer(cfg, path, "phi2", kv_heads=cfg.num_key_value_heads)
        _write_tensors(writer, hf_model, names, rename=(
            (lambda name: name.replace("attn_q.", "attn_qkv.")) if fused else str))
        return path

    _gguf_reads_as_transformers(write(tmp_path / "phi2.gguf"), hf_model)
    with pytest.raises(CheckpointError, match="fused 'blk.0.attn_qkv.weight'") as info:
        load_gguf(write(tmp_path / "fused.gguf", fused=True))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("window", [pytest.param(None, marks=pytest.mark.slow), 6])
def test_a_starcoder2_gguf_gives_transformers_logits(window, tmp_path):
    """llama.cpp's starcoder2 files: Llama's names for the norms and attention,
    ``ffn_up``/``ffn_down`` for ``c_fc``/``c_proj``, LayerNorm biases and projection biases,
    the head tied; no window unless the file names ``attention.sliding_window`` (llama.cpp's
    converter writes none, and its graph then attends globally)."""
    from helpers_checkpoints import tiny_vocabulary

    hf_model = tiny_family_model("starcoder2", seed=6, vocab_size=len(tiny_vocabulary()[0]),
                                 sliding_window=window)
    cfg = hf_model.config
    writer = _layer_norm_gguf_writer(cfg, tmp_path / "starcoder2.gguf", "starcoder2",
                                     eps=cfg.norm_epsilon, kv_heads=cfg.num_key_value_heads,
                                     partial_rope=False)
    if window:
        writer.add_sliding_window(window)
    _write_tensors(writer, hf_model, {
        "model.embed_tokens": "token_embd", "model.norm": "output_norm",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        **{f"self_attn.{x}_proj": f"attn_{x}" for x in "qkv"},
        "self_attn.o_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"})
    config = _gguf_reads_as_transformers(tmp_path / "starcoder2.gguf", hf_model)
    assert config.layer_windows == ((window,) if window else ())


@pytest.mark.slow
def test_a_starcoder_gguf_gives_transformers_logits(tmp_path):
    """llama.cpp's starcoder files (GPTBigCode): GPT-2's tensors with ``position_embd``,
    ``attn_qkv`` as the checkpoint's ``c_attn`` (q | k | v, one KV head), LayerNorm biases,
    the head tied; a KV head count other than 1 or every head is refused in one line."""
    from helpers_checkpoints import tiny_vocabulary
    from specjax.checkpoints_tools.gguf_loader import load_gguf

    hf_model = tiny_family_model("gpt-bigcode", seed=6, vocab_size=len(tiny_vocabulary()[0]))
    cfg = hf_model.config
    names = {"transformer.wte": "token_embd", "transformer.wpe": "position_embd",
             "transformer.ln_f": "output_norm", "ln_1": "attn_norm", "attn.c_attn": "attn_qkv",
             "attn.c_proj": "attn_output", "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up",
             "mlp.c_proj": "ffn_down"}

    def write(path, kv_heads=1):
        writer = _layer_norm_gguf_writer(cfg, path, "starcoder", eps=cfg.layer_norm_epsilon,
                                         ffn=cfg.n_inner, kv_heads=kv_heads,
                                         partial_rope=False)
        _write_tensors(writer, hf_model, names, blocks="transformer.h")
        return path

    _gguf_reads_as_transformers(write(tmp_path / "starcoder.gguf"), hf_model)
    with pytest.raises(CheckpointError, match="2 KV heads of 4 is not supported") as info:
        load_gguf(write(tmp_path / "gqa.gguf", kv_heads=2))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("variant,arch", [
    ("cohere", "command-r"), pytest.param("cohere2", "cohere2", marks=pytest.mark.slow)])
def test_a_cohere_gguf_gives_transformers_logits(variant, arch, tmp_path):
    """llama.cpp's command-r and cohere2 files: Llama's tensor names, one norm per block,
    q and k as the checkpoint stores them (RoPE on adjacent pairs), ``logit_scale``;
    cohere2's window on three layers of four, RoPE on those only."""
    from helpers_checkpoints import tiny_vocabulary

    hf_model = tiny_family_model(variant, seed=6, vocab_size=len(tiny_vocabulary()[0]))
    cfg = hf_model.config
    path = tmp_path / f"{arch}.gguf"
    writer = _layer_norm_gguf_writer(cfg, path, arch, kv_heads=cfg.num_key_value_heads,
                                     partial_rope=False)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_logit_scale(cfg.logit_scale)
    if arch == "cohere2":
        writer.add_sliding_window(cfg.sliding_window)
    _write_tensors(writer, hf_model, {
        "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
        "input_layernorm": "attn_norm", **{f"self_attn.{x}_proj": f"attn_{x}" for x in "qkv"},
        "self_attn.o_proj": "attn_output",
        **{f"mlp.{x}_proj": f"ffn_{x}" for x in ("gate", "up", "down")}})
    _gguf_reads_as_transformers(path, hf_model)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "phi3"])
def test_gguf_with_a_sentencepiece_vocabulary_brings_its_tokenizer(variant, tmp_path):
    """Real Gemma 2/3 and Phi-3 GGUF files carry a SentencePiece vocabulary
    (``tokenizer.ggml.model == "llama"``): ``load_gguf`` rebuilds it (ids exactly as
    llama.cpp's algorithm, Gemma without the space prefix), and a chat prompt through its
    template generates what transformers generates from the same ids."""
    from helpers_checkpoints import sentencepiece_reference, tiny_sentencepiece_vocabulary

    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    hf_model, model = _gguf_pair(variant, tmp_path / f"{variant}.gguf",
                                 vocabulary="sentencepiece", chat_template=template)
    tokens, scores, types = tiny_sentencepiece_vocabulary()
    prefix = not variant.startswith("gemma")
    for text in ["def f(x):\n    return x + 1\n", "  were there ✓", "<|user|>\nhi<|end|>"]:
        ids = model.tokenizer(text)["input_ids"]
        assert ids == [1] + sentencepiece_reference(text, tokens, scores, types, prefix), text
    code = "def f(x):\n    return x + 1\n"
    assert model.tokenizer.decode(model.tokenizer(code)["input_ids"],
                                  skip_special_tokens=True) == code
    prompt = sentencepiece_reference("<|user|>\nhi there<|end|>\n<|assistant|>\n",
                                     tokens, scores, types, prefix)
    assert specjax.generate(model, "hi there", chat=True, max_new_tokens=8,
                            stop=[]).tokens == hf_greedy(hf_model, prompt, 8)


def test_gemma_gguf_norms_without_llama_cpp_s_plus_one_are_caught(tmp_path):
    """llama.cpp stores Gemma's norm weights plus one; a file without the shift (or a
    loader that forgot to undo it) moves the logits far past the tolerance."""
    hf_model, model = _gguf_pair("gemma3", tmp_path / "g.gguf", norm_shift=False)
    tokens = random_prompt(7, 20, vocab=hf_model.config.vocab_size)
    assert np.abs(_logits(model, tokens) - _hf_logits(hf_model, tokens)).max() > 1e-2


@pytest.fixture(scope="module")
def padded_target(tmp_path_factory):
    """A Qwen3 target whose vocabulary is its tokenizer's plus 32 padding rows (the tiny
    GGUF vocabulary's tokenizer, read back from a GGUF file)."""
    from helpers_checkpoints import tiny_vocabulary

    _, with_tokenizer = _gguf_pair("qwen3-tied", tmp_path_factory.mktemp("tok") / "t.gguf")
    used = len(tiny_vocabulary()[0])
    hf_model = tiny_family_model("qwen3-tied", seed=9, vocab_size=used + 32)
    config = from_hf_config(hf_model.config.to_dict())
    from specjax.checkpoints_tools.keymap import params_from_hf_tensors as read

    params = read(config, {k: v.numpy() for k, v in hf_model.state_dict().items()})
    return specjax.Model.from_params(config, params, with_tokenizer.tokenizer, "qwen3-big"), used


def test_a_draft_padded_differently_is_accepted_and_exact(padded_target):
    """The draft is the target's first layer with 5 padding rows instead of 32, and its own
    copy of the tokenizer: accepted, given the target's rows, and exact."""
    import copy

    target, used = padded_target
    small = target.first_layers(1)
    params = dict(small.params, embed=small.params["embed"][:used + 5])
    draft = specjax.Model(dataclasses.replace(small.config, vocab_size=used + 5), params,
                          copy.deepcopy(target.tokenizer), "qwen3-small")
    prompt = random_prompt(3, 8, vocab=used)
    expected = specjax.generate(target, prompt, max_new_tokens=NEW).tokens
    for method in ("spec", "tree"):
        out = specjax.generate(target, prompt, max_new_tokens=NEW, method=method, draft=draft)
        assert out.tokens == expected, method
        assert out.stats["mean_accepted"] > 1.0  # the padded draft's proposals were taken


class _Vocabulary:
    """A tokenizer stand-in: what the compatibility check reads."""

    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


@pytest.mark.parametrize("edit,message", [
    (lambda v: {**v, "Ġthe": v["in"], "in": v["Ġthe"]},
     r"different tokenizers: token '.*' is id \d+ in the draft, \d+ in the target"),
    (lambda v: {**v, "<extra>": len(v)},
     r"different tokenizers: 1 tokens are in one only \(the first, '<extra>', in the draft\)"),
])
def test_a_real_tokenizer_mismatch_is_refused_in_one_line(padded_target, edit, message):
    from specjax.loaded_model import check_draft_compatible

    target, used = padded_target
    draft = specjax.Model(dataclasses.replace(target.config, vocab_size=used + 5),
                          dict(target.params, embed=target.params["embed"][:used + 5]),
                          _Vocabulary(edit(target.tokenizer.get_vocab())), "other")
    with pytest.raises(InvalidArgumentError, match=message) as info:
        check_draft_compatible(target, draft)
    assert "\n" not in str(info.value)


def test_rows_past_the_smaller_vocabulary_in_use_are_refused(padded_target):
    from specjax.loaded_model import check_draft_compatible

    target, used = padded_target
    draft = specjax.Model(dataclasses.replace(target.config, vocab_size=used - 1),
                          dict(target.params, embed=target.params["embed"][:used - 1]),
                          target.tokenizer, "cut")
    with pytest.raises(InvalidArgumentError, match="differ by more than padding"):
        check_draft_compatible(target, draft)


@pytest.mark.parametrize("variant", ["gemma3", "phi3", "smollm3", "olmo3", "gpt-neox", "olmoe",
                                     "phi", "starcoder2", "gpt-bigcode", "cohere2"])
def test_orbax_round_trip_keeps_the_family(pairs, variant, tmp_path):
    from specjax.checkpoints_tools.orbax_io import load_orbax, save_orbax

    model = pairs[variant][1]
    save_orbax(tmp_path / "ckpt", model.config, model.params)
    config, params, _ = load_orbax(tmp_path / "ckpt")
    assert config == model.config
    tokens = random_prompt(7, 20)
    np.testing.assert_array_equal(_logits(specjax.Model(config, params), tokens),
                                  _logits(model, tokens))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_the_flax_modules_run_the_families(pairs, api):
    """The Flax views of a Gemma 2 model give its logits (batched), and a model rebuilt from
    the Flax parameters generates its tokens."""
    from specjax.flax_modules import model_from_flax, to_flax

    hf_model, model = pairs["gemma2"]
    tokens = jnp.asarray([random_prompt(7, 20), random_prompt(8, 20)])
    if api == "nnx":
        module = to_flax(model, "nnx")
        logits, _ = module(tokens)
        rebuilt = model_from_flax(module)
    else:
        module, variables = to_flax(model, "linen")
        logits, _ = module.apply(variables, tokens)
        rebuilt = model_from_flax(variables, model.config)
    for row in range(2):
        _assert_same_logits(np.asarray(logits[row]), _hf_logits(hf_model, tokens[row].tolist()),
                            model.config, tokens[row])
    prompt = random_prompt(0, 6)
    assert specjax.generate(rebuilt, prompt, max_new_tokens=8).tokens == \
        specjax.generate(model, prompt, max_new_tokens=8).tokens


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
@pytest.mark.parametrize("feature", [False, True], ids=["token-draft", "feature-draft"])
def test_train_draft_works_for_a_gemma_target(tmp_path, feature):
    """``train-draft`` (a few steps) on a Gemma 2 target with the GGUF's tokenizer: the
    draft keeps the target's family features, decodes exactly, and the token draft's HF
    export is a Gemma 2 checkpoint that transformers loads with the same logits."""
    import transformers
    from conftest import write_corpus
    from specjax.commands import train_draft

    _, target = _gguf_pair("gemma2", tmp_path / "t.gguf")
    files = write_corpus(tmp_path, [f"def f_{i}(x):\n    return x * {i} + 1\n" * 8
                                    for i in range(12)])
    cfg = train_draft.TrainConfig(
        init_layers=(0,) if feature else (0, 1), steps=4, batch_size=2, seq_len=16,
        warmup_steps=1, eval_every=2, eval_windows=2, checkpoint_every=2,
        heldout_fraction=0.2, feature_draft=feature)
    summary = train_draft.train_draft(target, tmp_path / "run", cfg, corpus_files=files,
                                      export_hf=not feature, log=lambda _: None)
    draft = specjax.load(summary["draft"])
    assert draft.config.family == "gemma2" and draft.config.feature_input == feature
    assert draft.config.attn_softcap == target.config.attn_softcap
    prompt = target.tokenizer("def f_3(x):")["input_ids"]
    expected = specjax.generate(target, prompt, max_new_tokens=12).tokens
    assert specjax.generate(target, prompt, max_new_tokens=12, method="tree",
                            draft=draft).tokens == expected
    if not feature:
        hf = transformers.AutoModelForCausalLM.from_pretrained(summary["draft_hf"]).eval()
        assert hf.config.model_type == "gemma2"
        _assert_same_logits(_logits(draft, prompt), _hf_logits(hf, prompt), draft.config,
                            prompt)


def test_a_phi3_directory_naming_its_own_code_loads_without_it(pairs, tmp_path):
    """Phi-3's published config.json still carries an auto_map (code written before
    transformers had Phi3ForCausalLM): the architecture is phi3's, so it loads; the same
    auto_map on another model type is refused."""
    hf_model, _ = pairs["phi3"]
    hf_model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_phi3.Phi3Config",
                       "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tokens = random_prompt(7, 20)
    loaded = specjax.load(tmp_path)
    _assert_same_logits(_logits(loaded, tokens), _hf_logits(hf_model, tokens), loaded.config,
                        tokens)
    raw["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="needs its own Python code"):
        specjax.load(tmp_path)


def test_windowed_blocked_attention_equals_the_reference():
    """The CPU path skips cache blocks below every query's window: same output as the
    reference (both float32, summed in different orders: the bound of a softmax over the
    cache and a weighted sum, tests/tolerances.py); a window that started one slot later
    would change it."""
    import jax

    from specjax.attention import attention_blocked, attention_reference

    keys = jax.random.split(jax.random.key(0), 5)
    t, h, k, d, s = 3, 4, 2, 16, 64
    q = jax.random.normal(keys[0], (t, h, d))
    k_new, v_new = (jax.random.normal(keys[i], (t, k, d)) for i in (1, 2))
    k_cache, v_cache = (jax.random.normal(keys[i], (s, k, d)) for i in (3, 4))
    length = jnp.int32(40)
    positions = length + jnp.arange(t)
    mask = jnp.tril(jnp.ones((t, t), bool))
    first = positions - 12 + 1
    kwargs = dict(softcap=4.0, scale=0.2)
    want = attention_reference(q, k_new, v_new, k_cache, v_cache, length, mask,
                               first_visible=first, **kwargs)
    got = attention_blocked(q, k_new, v_new, k_cache, v_cache, length, mask, block=8,
                            first_visible=first, **kwargs)
    assert_sums_close(got, want, longest_sum=s + t, stages=2)
    shifted = attention_reference(q, k_new, v_new, k_cache, v_cache, length, mask,
                                  first_visible=first + 1, **kwargs)
    assert np.abs(np.asarray(shifted) - np.asarray(want)).max() > 1e-3
