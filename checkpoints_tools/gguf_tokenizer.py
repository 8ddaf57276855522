"""A GGUF file's tokenizer, rebuilt from its ``tokenizer.ggml.*`` fields (byte-level BPE or
SentencePiece BPE) with the ``tokenizers`` library, without torch or sentencepiece."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from specjax.checkpoints_tools.gguf_reader import GGUFFile, metadata_value
from specjax.checkpoints_tools.hf import check_chat_template, one_line, quiet_transformers_import
from specjax.errors import CheckpointError


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
                     "command-r", "mpt", "olmo"), _GPT2_SPLIT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# llama.cpp (and these models' original tokenizer.json, as a Digits(individual_digits=True)
# step) first isolate every digit for these. transformers' GGUF loader does not, and the two
# disagree on whitespace before a digit: "\n    0" splits into the words ["\n   ", " 0"]
# there and ["\n    ", "0"] in llama.cpp. ``split_digits`` picks llama.cpp's behaviour.
_DIGIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})

# tokenizer.ggml.token_type values (SentencePiece's piece types, which llama.cpp writes for
# every vocabulary kind).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE_MARK = "\u2581"  # SentencePiece writes a space as "▁"


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


class _Vocabulary(NamedTuple):
    """The ``tokenizer.*`` fields that every GGUF tokenizer kind shares."""
    tokens: list[str]
    token_types: list[int]
    special_ids: dict[str, int]  # "bos", "eos", "unknown", "padding" -> id, where given
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def special(self, name: str) -> str | None:
        index = self.special_ids.get(name)
        return None if index is None else self.tokens[index]


def _metadata_reader(reader: GGUFFile, source: str):
    """(get, strings): typed readers of ``tokenizer.*`` metadata for error-naming code."""
    def get(key, default=None, kind=None):
        return metadata_value(reader, f"tokenizer.{key}", default, source=source, kind=kind)

    def strings(key):
        values = get(key, [], kind=list)
        if not all(isinstance(value, str) for value in values):
            raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.{key}' should be an "
                                  "array of strings")
        return list(values)

    return get, strings


def _read_vocabulary(reader: GGUFFile, source: str, add_bos_default: bool) -> _Vocabulary:
    """Tokens, their types, the special token ids, the BOS/EOS flags and the chat template.

    ``add_bos_default`` applies when the file has no ``tokenizer.ggml.add_bos_token``
    (llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise).
    """
    get, strings = _metadata_reader(reader, source)
    tokens = strings("ggml.tokens")
    token_types = get("ggml.token_type", np.full(len(tokens), _NORMAL, np.int32), kind=list)
    if not isinstance(token_types, np.ndarray) or token_types.dtype.kind not in "iu":
        raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.ggml.token_type' should be "
                              "an array of integers")
    if not tokens or len(token_types) != len(tokens):
        raise CheckpointError(f"{source}: GGUF tokenizer fields are incomplete (tokens and "
                              "one token_type per token are needed)")
    special_ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        index = get(f"ggml.{name}_token_id", kind=int)
        if index is None:
            continue
        if not 0 <= index < len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.{name}_token_id {index} is out "
                                  "of range")
        special_ids[name] = index
    add_bos = get("ggml.add_bos_token", add_bos_default, kind=bool) and "bos" in special_ids
    add_eos = get("ggml.add_eos_token", False, kind=bool) and "eos" in special_ids
    chat_template = get("chat_template", kind=str)
    if chat_template is not None:
        check_chat_template(chat_template, f"{source}: tokenizer.chat_template")
    return _Vocabulary(tokens, token_types.tolist(), special_ids, add_bos, add_eos,
                       chat_template)


def _byte_level_tokenizer(reader: GGUFFile, vocabulary: _Vocabulary, source: str,
                          split_digits: bool):
    """(tokenizers.Tokenizer, keep) for ``tokenizer.ggml.model == "gpt2"``: byte-level BPE
    with the file's merges; ``keep(token)`` says whether a control or user-defined token
    can be added whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    get, strings = _metadata_reader(reader, source)
    pre = get("ggml.pre", "default", kind=str)
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; expected one of "
            f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    if "tokenizer.ggml.merges" not in reader.fields:
        raise CheckpointError(f"{source}: GGUF tokenizer fields are incomplete (a byte-level "
                              "BPE vocabulary needs tokenizer.ggml.merges)")
    pair_list = []
    for merge in strings("ggml.merges"):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: malformed GGUF merge {merge[:40]!r}")
        pair_list.append((parts[0], parts[1]))

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # Byte-level vocabularies are written in the byte alphabet; a token that is not
        # (a raw special token) is respelled so that the BPE model can still hold it.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(vocabulary.tokens)}
    regexes = [_PRE_TOKENIZER_SPLITS[pre]]
    if split_digits and pre in _DIGIT_PRE_TOKENIZERS:
        regexes.insert(0, r"\p{N}")
    # tokenizers rejects, e.g., a merge of tokens not in the vocabulary: the caller names it.
    backend = Tokenizer(models.BPE(vocab, pair_list, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens fit the byte alphabet in a well-formed file; one that
    # does not is a mislabel and would be cut, not matched whole: leave it to BPE.
    return backend, lambda token: set(token) <= alphabet


def sentencepiece_merges(tokens: list[str], token_types: list[int],
                         scores) -> list[tuple[str, str]]:
    """BPE merges that tokenize as SentencePiece BPE does with these scores.

    SentencePiece (and llama.cpp's SPM tokenizer) repeatedly joins the adjacent pair of
    pieces whose joined piece is in the vocabulary with the highest score. A ranked merge
    list says the same: each way to cut a piece into two pieces of the vocabulary is a
    merge, ranked by the joined piece's score, best first. Equal scores rank by the joined
    piece's id (SentencePiece writes pieces in merge order); among equal scores
    SentencePiece joins the leftmost pair instead, which differs only for ties.

    Only normal pieces take part: control and byte tokens are never the result of joining,
    and user-defined ones are matched whole before BPE runs.

    Args:
      tokens: the vocabulary [V].
      token_types: ``tokenizer.ggml.token_type`` [V].
      scores: ``tokenizer.ggml.scores`` [V].
    Returns:
      (left, right) pairs, best first.
    """
    scores = np.asarray(scores, np.float64).tolist()  # Python floats: faster to index
    mergeable: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind == _NORMAL:
            mergeable.setdefault(token, index)
    ranked = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, mergeable[left], left, right))
    ranked.sort()  # (score, id, left id) is unique per merge: the strings never compare
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_tokenizer(reader: GGUFFile, vocabulary: _Vocabulary, source: str):
    """(tokenizers.Tokenizer, keep) for ``tokenizer.ggml.model == "llama"`` (SentencePiece
    BPE: Llama 2, Mistral, Gemma 2/3, Phi-3), tokenizing as llama.cpp does.

    Spaces become "▁" and, where ``tokenizer.ggml.add_space_prefix`` says so (llama.cpp's
    default; Gemma's files say no), every stretch of text between special tokens starts
    with one. Characters outside the vocabulary fall back to ``<0xNN>`` byte tokens. The
    file's merges, if any, are ignored as llama.cpp ignores them: the scores rank merging.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    get, _ = _metadata_reader(reader, source)
    tokens = vocabulary.tokens
    scores = get("ggml.scores", kind=list)
    if scores is None:
        scores = np.zeros(len(tokens), np.float32)  # llama.cpp reads a missing score as 0
    if (not isinstance(scores, np.ndarray) or scores.dtype.kind not in "fiu"
            or len(scores) != len(tokens)):
        raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.ggml.scores' should be an "
                              f"array of {len(tokens)} numbers, one per token")
    byte_tokens = {f"<0x{byte:02X}>" for byte in range(256)}
    if vocabulary.special("unknown") is None and not byte_tokens <= set(tokens):
        # BPE would then drop the characters it cannot spell, silently.
        raise CheckpointError(f"{source}: the GGUF SentencePiece vocabulary has neither an "
                              "unknown token (tokenizer.ggml.unknown_token_id) nor the 256 "
                              "byte tokens <0x00>..<0xFF>, so it cannot encode every text")
    add_prefix = get("ggml.add_space_prefix", True, kind=bool)
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, vocabulary.token_types, scores)
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=vocabulary.special("unknown"),
                                   fuse_unk=True, byte_fallback=True))
    # The normalizer runs on each stretch between added tokens, so Prepend puts "▁" after
    # every special token too, as llama.cpp does; a pre-tokenizer would split words, which
    # SentencePiece does not.
    replace = normalizers.Replace(" ", _SPACE_MARK)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE_MARK), replace])
                          if add_prefix else replace)
    steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix space of the first word
    backend.decoder = decoders.Sequence(steps)
    return backend, lambda token: True


# tokenizer.ggml.model values supported, and what they name.
_TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}


def tokenizer_from_gguf(reader: GGUFFile, source: str = "gguf", model_max_length: int | None = None,
                        *, split_digits: bool = False):
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*`` fields.

    Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM,
    Llama 3, Qwen2, StarCoder ...), tokenized as transformers' own GGUF loader does
    (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), and SentencePiece BPE
    vocabularies (``"llama"``: Llama 2, Mistral, Gemma 2/3, Phi-3), tokenized as llama.cpp
    does (see :func:`_sentencepiece_tokenizer`); neither needs torch or sentencepiece.
    Tokens marked control become special tokens and those marked user-defined become added
    tokens, so both stay whole.

    Args:
      reader: a parsed file (see :func:`read_gguf`).
      source: a name for error messages.
      model_max_length: recorded on the tokenizer (the model's context length).
      split_digits: for SmolLM/StarCoder-style files (``tokenizer.ggml.pre`` "smollm",
        "starcoder" ...), isolate every digit first as llama.cpp and the models' original
        tokenizers do; transformers does not (see ``_DIGIT_PRE_TOKENIZERS``).

    Raises:
      CheckpointError: the file has no tokenizer, one of a kind not supported here, fields
        of the wrong type, or a chat template that reaches for Python internals.
    """
    kind = metadata_value(reader, "tokenizer.ggml.model", source=source, kind=str)
    if kind is None:
        raise CheckpointError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.model)")
    if kind not in _TOKENIZER_KINDS:
        supported = ", ".join(f"{name!r} ({what})" for name, what in _TOKENIZER_KINDS.items())
        raise CheckpointError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (only {supported}); "
            "load the model's HF directory for its tokenizer")
    vocabulary = _read_vocabulary(reader, source, add_bos_default=kind == "llama")
    try:
        if kind == "gpt2":
            backend, keep = _byte_level_tokenizer(reader, vocabulary, source, split_digits)
        else:
            backend, keep = _sentencepiece_tokenizer(reader, vocabulary, source)
        return _wrap_tokenizer(backend, keep, vocabulary, model_max_length)
    except CheckpointError:
        raise
    except Exception as error:  # tokenizers/transformers raise Exception, ValueError...
        raise CheckpointError(f"{source}: the GGUF tokenizer cannot be built "
                              f"({one_line(error)})") from error


def _wrap_tokenizer(backend, keep, vocabulary: _Vocabulary, model_max_length: int | None):
    """Adds the control / user-defined tokens that ``keep`` accepts and BOS/EOS to
    ``backend``, and wraps it as transformers' tokenizer (chat template included)."""
    from tokenizers import AddedToken, processors
    with quiet_transformers_import():
        from transformers import PreTrainedTokenizerFast

    pairs = list(zip(vocabulary.tokens, vocabulary.token_types))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in pairs if kind == _CONTROL and keep(token)])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in pairs if kind == _USER_DEFINED and keep(token)])
    bos, eos = vocabulary.special("bos"), vocabulary.special("eos")
    template = ([bos] if vocabulary.add_bos else []) + ["$A"] + (
        [eos] if vocabulary.add_eos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=template, pair=template + ["$B:1"],
        special_tokens=[(vocabulary.special(name), vocabulary.special_ids[name])
                        for name in ("bos", "eos") if name in vocabulary.special_ids])
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos,
        unk_token=vocabulary.special("unknown"), pad_token=vocabulary.special("padding"),
        chat_template=vocabulary.chat_template, add_bos_token=vocabulary.add_bos,
        add_eos_token=vocabulary.add_eos, **kwargs)
