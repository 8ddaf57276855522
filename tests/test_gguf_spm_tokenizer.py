"""SentencePiece BPE tokenizers of GGUF files (``tokenizer.ggml.model == "llama"``: Llama 2,
Mistral, Gemma 2/3, Phi-3), rebuilt without sentencepiece.

The vocabulary is :func:`helpers_checkpoints.tiny_sentencepiece_vocabulary`, written as
llama.cpp's converter writes one (tokens, scores, token types, no merges). Token ids are
compared exactly with :func:`helpers_checkpoints.sentencepiece_reference`, llama.cpp's
algorithm written directly; a merge order other than by score is caught.
"""

from __future__ import annotations

import gguf
import pytest

from helpers_checkpoints import (add_sentencepiece_vocabulary, sentencepiece_reference,
                                 tiny_sentencepiece_vocabulary)
from specjax.checkpoints_tools import gguf_tokenizer
from specjax.checkpoints_tools.gguf_reader import read_gguf
from specjax.checkpoints_tools.gguf_tokenizer import tokenizer_from_gguf
from specjax.errors import CheckpointError

# No added token in these: they decode back to themselves.
ROUND_TRIP = [
    "the", "were there", "That is the theater", "  two leading spaces", "trailing  ",
    "a  b   c", "line one\nline two\n\n", "def f(x):\n    if x:\n        return x + 1\n",
    "\tindented\twith tabs", "héllo wörld ✓", "日本語のテキスト", "emoji 🙂 at the end",
    " ", "\n", "",
]
WITH_ADDED_TOKENS = ["<|user|>\nhi<|end|>\n<|assistant|>\n", "a<br>b", "<s>x</s>", "<br>"]


def finish(writer):
    """Writes a GGUF file that has metadata and no tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_vocabulary_gguf(path, scores=None, **kwargs):
    """A GGUF file holding only the tiny SentencePiece vocabulary (``scores`` replaces its
    scores)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_sentencepiece_vocabulary(writer, scores=scores, **kwargs)
    finish(writer)
    return path


def load_tokenizer(path):
    """The path a user's file takes: parse, then rebuild the tokenizer."""
    return tokenizer_from_gguf(read_gguf(path), str(path))


@pytest.fixture(scope="module", params=[True, False, None], ids=["prefix", "gemma", "unset"])
def spm(request, tmp_path_factory):
    """(tokenizer, whether it adds a space prefix): Llama 2 / Phi-3 files say yes, Gemma's
    say no, older files say nothing (llama.cpp's default: yes)."""
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    tokenizer = load_tokenizer(write_vocabulary_gguf(path, add_space_prefix=request.param))
    return tokenizer, request.param is not False


def reference(text, add_space_prefix, scores=None):
    tokens, default_scores, types = tiny_sentencepiece_vocabulary()
    return [1] + sentencepiece_reference(text, tokens, scores or default_scores, types,
                                         add_space_prefix)


@pytest.mark.parametrize("text", ROUND_TRIP + WITH_ADDED_TOKENS)
def test_ids_equal_llama_cpp_s_algorithm(spm, text):
    tokenizer, prefix = spm
    assert tokenizer(text).input_ids == reference(text, prefix)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_text_decodes_back_to_itself(spm, text):
    tokenizer, _ = spm
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


def test_hand_computed_pieces(spm):
    tokenizer, prefix = spm

    def pieces(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids)

    if prefix:
        assert pieces("the") == ["<s>", "▁the"]
        assert pieces("were") == ["<s>", "▁wer", "e"]  # "e r" ranks above "r e"
        assert pieces("é\n") == ["<s>", "▁", "<0xC3>", "<0xA9>", "<0x0A>"]
        assert pieces("a<br>b") == ["<s>", "▁a", "<br>", "▁", "b"]
    else:
        assert pieces("the") == ["<s>", "t", "he"]
        assert pieces("  return") == ["<s>", "▁▁", "re", "turn"]  # "▁ ▁" joins before "▁ r"
        assert pieces("é\n") == ["<s>", "<0xC3>", "<0xA9>", "<0x0A>"]
        assert pieces("a<br>b") == ["<s>", "a", "<br>", "b"]


def swapped_scores(first: str, second: str) -> list[float]:
    tokens, scores, _ = tiny_sentencepiece_vocabulary()
    scores = list(scores)
    i, j = tokens.index(first), tokens.index(second)
    scores[i], scores[j] = scores[j], scores[i]
    return scores


def test_scores_not_file_order_rank_the_merges(tmp_path):
    """With "re" now scored above "er" (their places in the file unchanged), llama.cpp
    joins "r e" first: a loader ranking by position would not."""
    scores = swapped_scores("er", "re")
    tokenizer = load_tokenizer(write_vocabulary_gguf(tmp_path / "v.gguf", scores=scores))
    assert tokenizer.convert_ids_to_tokens(tokenizer("were").input_ids) == [
        "<s>", "▁w", "e", "re"]
    for text in ROUND_TRIP + WITH_ADDED_TOKENS:
        assert tokenizer(text).input_ids == reference(text, True, scores), text


def test_a_wrong_merge_order_is_caught(tmp_path, monkeypatch):
    """The comparison above can fail: merges in reverse order change the ids."""
    real = gguf_tokenizer.sentencepiece_merges
    monkeypatch.setattr(gguf_tokenizer, "sentencepiece_merges",
                        lambda *args: real(*args)[::-1])
    tokenizer = load_tokenizer(write_vocabulary_gguf(tmp_path / "v.gguf"))
    wrong = [text for text in ROUND_TRIP if tokenizer(text).input_ids != reference(text, True)]
    assert "were there" in wrong and "def f(x):\n    if x:\n        return x + 1\n" in wrong


def test_special_tokens_and_chat_template_come_from_the_metadata(tmp_path):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    tokenizer = load_tokenizer(write_vocabulary_gguf(tmp_path / "v.gguf", add_bos=False,
                                                     chat_template=template))
    tokens, _, _ = tiny_sentencepiece_vocabulary()
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token,
            tokenizer.pad_token) == ("<s>", "<|end|>", "<unk>", "</s>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, tokens.index("<|end|>"))
    assert tokenizer("hi").input_ids == reference("hi", True)[1:]  # add_bos_token false
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    text = "<|user|>\nhi there<|end|>\n<|assistant|>\n"
    assert list(ids) == reference(text, True)[1:]
    # Each special token is one id; llama.cpp puts "▁" before the text after one.
    assert tokenizer.convert_ids_to_tokens(ids[-3:]) == ["<|assistant|>", "▁", "<0x0A>"]
    assert ids[0] == tokens.index("<|user|>")


def test_agrees_with_transformers_gguf_load_where_both_follow_sentencepiece(tmp_path):
    """transformers' own GGUF loader builds this vocabulary independently. It prefixes a
    space only at the very start of a text not starting with one (Metaspace), llama.cpp
    after every special token and always: compared on texts where the two agree."""
    import transformers

    path = write_vocabulary_gguf(tmp_path / "v.gguf")
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ROUND_TRIP:
        if text and not text[0].isspace():
            assert ours(text).input_ids == theirs(text).input_ids, text
    assert ours("  hi").input_ids != theirs("  hi").input_ids  # the documented difference


@pytest.mark.parametrize("model", ["t5", "bert", "gemma4"])
def test_an_unknown_tokenizer_model_is_refused_in_one_line(tmp_path, model):
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["<unk>", "a"])
    finish(writer)
    with pytest.raises(CheckpointError, match=rf"tokenizer model '{model}' is not supported "
                       r"\(only 'gpt2' \(byte-level BPE\), 'llama' \(SentencePiece BPE\)\)"
                       ) as info:
        load_tokenizer(tmp_path / "v.gguf")
    assert "\n" not in str(info.value)


def test_scores_of_the_wrong_length_are_named(tmp_path):
    scores = tiny_sentencepiece_vocabulary()[1][:-1]
    with pytest.raises(CheckpointError, match=r"'tokenizer.ggml.scores' should be an array of "
                       r"\d+ numbers, one per token"):
        load_tokenizer(write_vocabulary_gguf(tmp_path / "v.gguf", scores=scores))


def test_a_vocabulary_that_cannot_spell_every_text_is_refused(tmp_path):
    """No unknown token and no byte tokens: BPE would drop unknown characters silently."""
    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<s>", "▁", "a"])
    writer.add_token_scores([0.0, -1.0, -2.0])
    writer.add_token_types([3, 1, 1])
    finish(writer)
    with pytest.raises(CheckpointError, match="neither an unknown token"):
        load_tokenizer(tmp_path / "v.gguf")
