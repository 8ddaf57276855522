"""GGUF files (llama.cpp): model config, dequantized weights and tokenizer, without torch.

A GGUF file carries three things, all read here with the ``gguf`` package:

- metadata ``{arch}.*`` (``llama``, ``qwen2``, ``mistral``) that becomes a
  :class:`~specjax.config.ModelConfig`;
- tensors named ``token_embd``, ``blk.N.attn_q`` ... that are dequantized to float32
  (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, K-quants: whatever ``gguf.quants`` can undo),
  renamed to their Hugging Face names and handed to the strict
  :func:`~specjax.checkpoints_tools.keymap.params_from_hf_tensors`, so an unmapped, missing
  or mis-shaped tensor is rejected exactly as for an HF checkpoint;
- a tokenizer in ``tokenizer.ggml.*`` fields, rebuilt with the ``tokenizers`` library.

Two layout facts matter (DESIGN.md section 8):

- ``gguf`` lists a tensor's shape fastest-axis first (``[in, out]``), but the arrays it
  returns are numpy row-major ``[out, in]``: the HF ``nn.Linear`` layout.
- llama.cpp's converter permutes the rows of Q and K (weights and biases) of ``llama``
  models so that its RoPE can rotate adjacent pairs; HF models rotate the two halves of a
  head. :func:`unpermute_rope_rows` undoes that. ``qwen2`` files are stored unpermuted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from specjax.checkpoints_tools import keymap
from specjax.checkpoints_tools.hf import as_numpy_dtype, one_line
from specjax.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, ModelNotFoundError

# GGUF architectures that run as specjax "llama", and whether their Q/K rows are permuted.
_ARCHITECTURES = {"llama": True, "mistral": True, "qwen2": False}

# GGUF tensor name -> HF name; "{i}" is the block index.
_TENSOR_NAMES = {
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
}
for _gguf, _hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                   ("attn_output", "o_proj")):
    for _kind in ("weight", "bias"):
        _TENSOR_NAMES[f"blk.{{i}}.{_gguf}.{_kind}"] = f"model.layers.{{i}}.self_attn.{_hf}.{_kind}"


def _name_patterns(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)") + "$"), dst)
            for src, dst in table.items()]


_TO_HF = _name_patterns(_TENSOR_NAMES)
_TO_GGUF = _name_patterns({hf: gguf for gguf, hf in _TENSOR_NAMES.items()})


def _rename(name: str, patterns) -> str | None:
    for pattern, target in patterns:
        match = pattern.match(name)
        if match:
            return target.format(i=match.group(1)) if match.groups() else target
    return None


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name, or ``None`` when it has none."""
    return _rename(gguf_name, _TO_HF)


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation.

    llama.cpp stores, within each head, the rows in the order (0, D/2, 1, D/2+1, ...),
    i.e. it viewed the head's rows as [2, D/2] and transposed them to [D/2, 2]. We view them
    as [D/2, 2] and transpose back.

    Args:
      rows: [num_heads * D, ...] weight ([out, in]) or bias ([out]).
      num_heads: heads the rows belong to (query heads for Q, KV heads for K).
    Returns:
      array of the same shape in HF order.
    """
    head_dim = rows.shape[0] // num_heads
    split = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


# ----------------------------------------------------------------------------- reading


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path``.

    Raises:
      ModelNotFoundError: no such file.
      CheckpointError: the file is not GGUF, or is truncated or corrupt.
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except Exception as error:  # the reader raises ValueError, IndexError, KeyError...
        raise CheckpointError(
            f"{path}: not a valid GGUF file, or truncated ({one_line(error)})") from error


def _field(reader, key: str, default: Any = None, *, required: bool = False, source: str = ""):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise CheckpointError(f"{source}: GGUF metadata {key!r} is missing")
        return default
    try:
        return field.contents()
    except Exception as error:
        raise CheckpointError(f"{source}: GGUF metadata {key!r} is unreadable "
                              f"({one_line(error)})") from error


def _float32_value(value) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal
    # that round-trips through float32 recovers the value the model was converted with.
    return float(str(np.float32(value)))


def config_from_gguf(reader, source: str = "gguf") -> ModelConfig:
    """Builds the :class:`ModelConfig` described by a GGUF file's metadata.

    Raises:
      CheckpointError: the architecture is not supported or a needed key is missing.
    """
    arch = _field(reader, "general.architecture", required=True, source=source)
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{sorted(_ARCHITECTURES)}")

    def meta(key, default=None, required=True):
        return _field(reader, f"{arch}.{key}", default,
                      required=required and default is None, source=source)

    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{source}: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, Llama 3.1 "
            "style) is not supported; load the model from its HF directory instead")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dims = meta("rope.dimension_count", head_dim)
    if int(rope_dims) != head_dim:
        raise CheckpointError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head dim "
            f"{head_dim}) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else meta("vocab_size")
    scaling = None
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", _float32_value(meta("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise CheckpointError(f"{source}: RoPE scaling {scaling_type!r} is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window = meta("attention.sliding_window", 0)
    return ModelConfig(
        architecture="llama", vocab_size=int(vocab), hidden_size=hidden,
        num_layers=int(meta("block_count")), num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(meta("feed_forward_length")),
        max_position_embeddings=int(meta("context_length")),
        norm_eps=_float32_value(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, out_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names, eos_token_ids=eos_ids,
        bos_token_id=None if bos is None else int(bos),
        sliding_window=int(window) if window else None,
    )


def _gguf_names_in_message(message: str) -> str:
    # keymap names tensors by their HF names; show the GGUF name the user can find too.
    def swap(match):
        gguf = _rename(match.group(1), _TO_GGUF)
        return f"'{gguf}' ({match.group(1)})" if gguf else match.group(0)

    return re.sub(r"'((?:model\.|lm_head\.)[^']*)'", swap, message)


def _dequantize(tensor, source: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} has quantization {tensor.tensor_type.name}, "
            "which gguf cannot dequantize") from error
    except Exception as error:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} is corrupt ({one_line(error)})") from error
    expected = tuple(int(n) for n in reversed(tensor.shape))  # gguf lists fastest axis first
    if array.shape != expected:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} dequantized to shape {array.shape}, expected "
            f"{expected}")
    return array


def params_from_gguf(reader, config: ModelConfig, source: str = "gguf", dtype=None,
                     progress: bool = False) -> dict:
    """Dequantized parameter tree (numpy) of a GGUF file; see the module docstring."""
    arch = _field(reader, "general.architecture")
    permuted = _ARCHITECTURES.get(arch, False)
    tensors: dict[str, np.ndarray] = {}
    items = reader.tensors
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="dequantizing GGUF tensors", unit="tensor")
    for tensor in items:
        name = hf_name(tensor.name)
        array = _dequantize(tensor, source)
        if name is None:
            name = tensor.name  # keymap reports it as unmapped
        elif permuted and ".self_attn.q_proj." in name:
            array = unpermute_rope_rows(array, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            array = unpermute_rope_rows(array, config.num_kv_heads)
        tensors[name] = array
    try:
        return keymap.params_from_hf_tensors(config, tensors, source=source,
                                             dtype=as_numpy_dtype(dtype))
    except CheckpointError as error:
        raise CheckpointError(_gguf_names_in_message(str(error))) from None


# ----------------------------------------------------------------------------- tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex that splits text into words before byte-level BPE.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "codeshell",
                     "command-r"), _GPT2_SPLIT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# llama.cpp (and these models' original tokenizer.json, as a Digits(individual_digits=True)
# step) first isolate every digit for these. transformers' GGUF loader does not, and the two
# disagree on whitespace before a digit: "\n    0" splits into the words ["\n   ", " 0"]
# there and ["\n    ", "0"] in llama.cpp. ``split_digits`` picks llama.cpp's behaviour.
_DIGIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte spelled as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the characters
    from U+0100 on, in byte order.
    """
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: chr(byte) for byte in kept}
    for offset, byte in enumerate(b for b in range(256) if b not in spelling):
        spelling[byte] = chr(0x100 + offset)
    return spelling


def tokenizer_from_gguf(reader, source: str = "gguf", model_max_length: int | None = None,
                        *, split_digits: bool = False):
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*`` fields.

    Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``, used by
    SmolLM, Llama 3, Qwen2, StarCoder ...) and tokenizes as transformers' own GGUF loader
    does (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), without needing torch.
    Tokens marked control become special tokens and those marked user-defined become added
    tokens, so both stay whole.

    Args:
      reader: a ``gguf.GGUFReader`` (see :func:`open_gguf`).
      source: a name for error messages.
      model_max_length: recorded on the tokenizer (the model's context length).
      split_digits: for SmolLM/StarCoder-style files (``tokenizer.ggml.pre`` "smollm",
        "starcoder" ...), isolate every digit first as llama.cpp and the models' original
        tokenizers do; transformers does not (see ``_DIGIT_PRE_TOKENIZERS``).

    Raises:
      CheckpointError: the file has no tokenizer, or one of a kind not supported here.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    def get(key, default=None):
        return _field(reader, f"tokenizer.{key}", default, source=source)

    kind = get("ggml.model")
    if kind is None:
        raise CheckpointError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.model)")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
            "'gpt2'); load the model's HF directory for its tokenizer")
    pre = get("ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; expected one of "
            f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    tokens = list(get("ggml.tokens", []))
    token_types = list(get("ggml.token_type", [1] * len(tokens)))
    merges = get("ggml.merges")
    if not tokens or merges is None or len(token_types) != len(tokens):
        raise CheckpointError(f"{source}: GGUF tokenizer fields are incomplete "
                              "(tokens, token_type and merges are needed)")

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # Byte-level vocabularies are written in the byte alphabet; a token that is not
        # (a raw special token) is respelled so that the BPE model can still hold it.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pair_list = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: malformed GGUF merge {merge!r}")
        pair_list.append((parts[0], parts[1]))
    regexes = [_PRE_TOKENIZER_SPLITS[pre]]
    if split_digits and pre in _DIGIT_PRE_TOKENIZERS:
        regexes.insert(0, r"\p{N}")
    backend = Tokenizer(models.BPE(vocab, pair_list, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens fit the byte alphabet in a well-formed file; a token marked control
    # that does not is a mislabel and would be cut, not matched whole: leave it to BPE.
    backend.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, token_kind in zip(tokens, token_types)
        if token_kind == _CONTROL and set(token) <= alphabet])
    backend.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_kind in zip(tokens, token_types)
        if token_kind == _USER_DEFINED and token in vocab])

    def special(key):
        index = get(f"ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.{key} {index} is out of range")
        return tokens[int(index)]

    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(get("ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(get("ggml.add_eos_token", False)) and eos is not None
    template = ([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=template, pair=template + ["$B:1"],
        special_tokens=[(t, vocab[spelled(t)]) for t in {bos, eos} if t is not None])
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos,
        unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        chat_template=get("chat_template"), add_bos_token=add_bos, add_eos_token=add_eos,
        **kwargs)


# ----------------------------------------------------------------------------- public


def load_gguf(path: str | os.PathLike, dtype=None, progress: bool = False
              ) -> tuple[ModelConfig, dict, Any]:
    """Loads a llama-family GGUF file.

    Args:
      path: the ``.gguf`` file.
      dtype: cast the dequantized (float32) parameters to this dtype; ``None`` keeps float32.
      progress: show a per-tensor progress bar while dequantizing.
    Returns:
      (config, params, tokenizer): params is the nested dict of numpy arrays described by
      :mod:`specjax.models`; tokenizer is a ``transformers.PreTrainedTokenizerFast``.
    Raises:
      ModelNotFoundError: no such file.
      CheckpointError: the file is truncated or corrupt, its architecture, quantization or
        tokenizer is not supported, or a tensor is unmapped, missing or mis-shaped.
    """
    source = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, source)
    params = params_from_gguf(reader, config, source, dtype=dtype, progress=progress)
    tokenizer = tokenizer_from_gguf(reader, source, model_max_length=config.max_position_embeddings)
    return config, params, tokenizer
