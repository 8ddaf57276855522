"""Tiny random checkpoints for the checkpoint-layer tests: HF directories and GGUF files.

Weights are redrawn with a large scale so logits spread over several units: a transposed,
permuted or swapped tensor then moves them far beyond the tolerances.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 61
PROMPT = [3, 17, 42, 5, 9, 33, 60, 0, 28, 11, 7, 50]

# kind -> transformers config kwargs (hidden 64, 2-3 layers).
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=128, rope_theta=5000.0, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=None)
KINDS = {
    "llama-mha-tied": (transformers.LlamaConfig,
                       dict(_LLAMA, num_hidden_layers=2, num_key_value_heads=4,
                            tie_word_embeddings=True)),
    "llama-gqa-untied": (transformers.LlamaConfig,
                         dict(_LLAMA, num_hidden_layers=3, num_key_value_heads=2,
                              tie_word_embeddings=False)),
    "llama-biases": (transformers.LlamaConfig,
                     dict(_LLAMA, num_hidden_layers=2, num_key_value_heads=2,
                          tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "qwen2": (transformers.Qwen2Config,
              dict(_LLAMA, num_hidden_layers=2, num_key_value_heads=1,
                   tie_word_embeddings=False)),
    "gpt2": (transformers.GPT2Config,
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                  bos_token_id=0, eos_token_id=0)),
}


def tiny_model(kind: str, seed: int = 0):
    """A random transformers causal LM of the given kind, in eval mode, fp32."""
    return _build(*KINDS[kind], seed)


def _build(config_class, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif param.ndim == 1:  # norm scales stay near one
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.25 * noise)
    return model


def hf_logits(model, tokens=PROMPT) -> np.ndarray:
    """float32 [T, V] logits of a transformers model."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def save_tiny(model, path: Path, fmt: str = "safetensors") -> Path:
    """Saves ``model`` as ``safetensors``, ``sharded`` safetensors or a ``bin`` state dict."""
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        model.save_pretrained(path)
    elif fmt == "sharded":
        model.save_pretrained(path, max_shard_size="40KB")
        assert (path / "model.safetensors.index.json").is_file()
    elif fmt == "bin":
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        raise ValueError(fmt)
    return path


# ----------------------------------------------------------------------------- GGUF


def _byte_alphabet() -> list[str]:
    """GPT-2's byte spelling, written independently of the loader's copy."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE]
    others = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + i) for i, b in enumerate(others)})
    return [spelling[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): three control tokens, 256 bytes, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ 1"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + _byte_alphabet() + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


# A SentencePiece BPE vocabulary laid out as Llama 2's (ids 0-2 <unk> <s> </s>, then the
# 256 byte tokens), with Phi-3-style chat tokens, one user-defined token (Gemma's files
# mark HTML tags so), printable ASCII and "▁" as single pieces (no "\n" or "\t": those
# fall back to bytes), and pieces made by these joins, best (highest score) first.
# "e r" before "r e" makes the order matter: "ere" is "er" "e", not "e" "re".
SENTENCEPIECE_JOINS = [
    "▁ t", "h e", "▁t he", "e r", "r e", "i n", "▁ a", "o n", "▁ ▁", "▁▁ ▁▁", "▁ d", "e f",
    "▁d ef", "▁ r", "▁r e", "t u", "r n", "tu rn", "▁re turn", "▁ i", "▁i f", "▁i n",
    "( )", "() :", "▁ 1", "▁ f", "▁ x", "▁ =", "▁ +", "a t", "▁ w", "▁w er", "▁th at",
]
SENTENCEPIECE_CONTROL = ["<|user|>", "<|assistant|>", "<|end|>"]
SENTENCEPIECE_USER_DEFINED = ["<br>"]
UNKNOWN, NORMAL, CONTROL, USER_DEFINED, BYTE = 2, 1, 3, 4, 6  # token_type values


def tiny_sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece BPE vocabulary as llama.cpp writes
    it: special and byte tokens score 0, single characters rank below every joined piece,
    joined pieces score minus their rank."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    tokens += SENTENCEPIECE_CONTROL + SENTENCEPIECE_USER_DEFINED
    types += [CONTROL] * len(SENTENCEPIECE_CONTROL) + [USER_DEFINED]
    scores = [0.0] * len(tokens)
    characters = ["▁"] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += characters
    scores += [-1000.0 - i for i in range(len(characters))]
    joined = [join.replace(" ", "") for join in SENTENCEPIECE_JOINS]
    assert len(set(joined)) == len(joined) and not set(joined) & set(tokens)
    tokens += joined
    scores += [-float(rank) for rank in range(len(joined))]
    types += [NORMAL] * (len(characters) + len(joined))
    return tokens, scores, types


def add_bpe_vocabulary(writer, vocab_size: int, chat_template: str | None = None) -> None:
    """Writes :func:`tiny_vocabulary` as llama.cpp writes a byte-level BPE tokenizer
    (SmolLM2's pre-tokenizer; BOS 1, EOS 2) into a ``gguf.GGUFWriter``."""
    tokens, types, merges = tiny_vocabulary()
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def add_sentencepiece_vocabulary(writer, *, add_space_prefix: bool | None = True,
                                 add_bos: bool = True, chat_template: str | None = None,
                                 scores: list[float] | None = None) -> None:
    """Writes :func:`tiny_sentencepiece_vocabulary` as llama.cpp's converter writes a
    Llama 2 / Gemma / Phi-3 vocabulary (no merges; ``add_space_prefix=None`` leaves the
    flag out, as older files do; ``scores`` replaces the vocabulary's)."""
    tokens, default_scores, types = tiny_sentencepiece_vocabulary()
    scores = default_scores if scores is None else scores
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|end|>"))
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def _llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows (first half, second half) interleaved."""
    head_dim = rows.shape[0] // num_heads
    return (rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def write_tiny_gguf(model, path: Path, quant: str = "F32", *, drop: str | None = None,
                    extra: str | None = None, arch: str | None = None,
                    permute: bool = True, extra_tensors: dict | None = None,
                    float_metadata: dict | None = None) -> Path:
    """Writes a llama/qwen2 transformers model as a GGUF file, as llama.cpp would.

    Args:
      quant: type of the 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1); norms stay F32.
      drop: a GGUF tensor name to leave out; extra: a GGUF tensor name to add.
      arch: override general.architecture; permute: apply llama.cpp's Q/K permutation.
      extra_tensors: more tensors by GGUF name, written as they are (``rope_freqs.weight``).
      float_metadata: more float32 metadata, by key (``{arch}`` filled in).
    """
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    arch = arch or ("qwen2" if cfg.model_type == "qwen2" else "llama")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for key, value in (float_metadata or {}).items():
        writer.add_float32(key.format(arch=arch), float(value))
    add_bpe_vocabulary(writer, cfg.vocab_size)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, tensor in model.state_dict().items():
        target = gguf_name(name)
        if target == drop or (target == "output.weight" and cfg.tie_word_embeddings):
            continue
        array = tensor.detach().float().numpy()
        if permute and arch in ("llama", "smollm3", "granite") and ".attn_q." in target:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        if permute and arch in ("llama", "smollm3", "granite") and ".attn_k." in target:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if array.ndim == 2 and quant != "F32":
            writer.add_tensor(target, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, array.astype(np.float32))
    if extra is not None:
        writer.add_tensor(extra, np.zeros(cfg.hidden_size, np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_llama(seed: int = 0, tied: bool = False):
    """A tiny Llama whose vocabulary is :func:`tiny_vocabulary` (so GGUF can carry it)."""
    tokens, _, _ = tiny_vocabulary()
    kwargs = dict(_LLAMA, vocab_size=len(tokens), num_hidden_layers=2, num_key_value_heads=2,
                  tie_word_embeddings=tied)
    return _build(transformers.LlamaConfig, kwargs, seed)


def sentencepiece_reference(text: str, tokens: list[str], scores: list[float],
                            types: list[int], add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece BPE tokenization, written directly (no BOS): control and
    user-defined tokens cut the text (longest first); each stretch between them gets a
    leading space if ``add_space_prefix``, spaces become "▁", and the adjacent pair whose
    join is a normal piece of highest score is joined (leftmost on ties) until none is;
    a piece outside the vocabulary is spelled by its UTF-8 byte tokens."""
    import re

    ids = {token: index for index, token in enumerate(tokens)}
    score = {t: s for t, s, kind in zip(tokens, scores, types) if kind == NORMAL}
    whole = sorted((t for t, kind in zip(tokens, types) if kind in (CONTROL, USER_DEFINED)),
                   key=len, reverse=True)
    out = []
    for index, fragment in enumerate(re.split("(" + "|".join(map(re.escape, whole)) + ")", text)):
        if index % 2:
            out.append(ids[fragment])
            continue
        if not fragment:
            continue
        pieces = list((" " + fragment if add_space_prefix else fragment).replace(" ", "▁"))
        while True:
            joins = [(score[a + b], -i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))
                     if a + b in score]
            if not joins:
                break
            i = -max(joins)[1]
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        for piece in pieces:
            out += ([ids[piece]] if piece in score else
                    [ids[f"<0x{b:02X}>"] for b in piece.encode("utf-8")])
    return out
