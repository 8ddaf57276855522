"""Stop strings end the compiled loop on the device, with the host's text and tokens.

The host rule (``specjax.generate``'s ``stop=``): the tokens end at the first token after
which the decoded new text contains a stop string, the text just before it. The device
checks the token sequences that spell a string (``specjax.stop_strings``) inside the loop,
so a generation with an early stop runs few target passes; the tokens and text are those
of the host rule applied to the full generation, for every method, single and batched.

The tiny models decode through a tiny byte-level tokenizer in which "\\n\\n" is one token,
two "\\n" tokens, part of longer tokens (".\\n\\n", "\\n\\n\\n") and split over others
("b\\n" + "\\na").
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models as token_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specjax
from specjax import api, requests, stop_strings
from specjax.state import DecodeState, StopCondition, append_tokens, stop_condition

from conftest import TINY_VOCAB, fitted_tables, random_prompt

NEW = 24
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Byte-level pieces ("Ċ" is "\n", "Ġ" a space, "â" the lone byte 0xE2, which decodes to
# U+FFFD), then letters and letter pairs up to TINY_VOCAB tokens.
PIECES = ["â", "Ċ", "ĊĊ", ".ĊĊ", "ĊĊĊ", "Ġ", ".", ",", ":", "Ċa", "bĊ", "ĠĊ", *LETTERS]
PIECES += [x + y for x in LETTERS for y in LETTERS if x != y][::11][:TINY_VOCAB - len(PIECES)]
ID = {piece: i for i, piece in enumerate(PIECES)}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(token_models.BPE(vocab=dict(ID), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def target(spec_target):
    """The speculative tests' tiny target (its compiled programs shared) with the tokenizer."""
    return dataclasses.replace(spec_target, tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def methods(spec_drafts, target):
    """Each method's options by name (the n-gram tables fitted on first use: slow tier)."""
    weak, fitted = spec_drafts["weak"], {}

    def options(name):
        if name in ("ngram", "staged"):
            if not fitted:
                fitted["tables"] = fitted_tables(target, range(200, 203), 24)
            tables = fitted["tables"]
            return {"ngram": dict(method="ngram", ngram=tables),
                    "staged": dict(method="staged", draft=weak, ngram=tables,
                                   tree_budget=6)}[name]
        return {"ar": dict(method="ar"),
                "spec": dict(method="spec", draft=weak, draft_depth=3),
                "tree": dict(method="tree", draft=weak, tree_budget=6, draft_width=2)}[name]

    return options


def host_rule(model, tokens: list[int], stop: str) -> tuple[list[int], str]:
    """The tokens through the one after which the text first contains ``stop``, and the
    text before it (all of both when it never does)."""
    for k in range(1, len(tokens) + 1):
        text = model.tokenizer.decode(tokens[:k])
        if stop in text:
            return tokens[:k], text[:text.index(stop)]
    return tokens, model.tokenizer.decode(tokens)


def early_stop(model, tokens: list[int], start: int, end: int) -> str:
    """A stop string whose first occurrence in the text of ``tokens`` is completed by token
    ``end - 1`` and starts in token ``start``: the text from the last character of token
    ``start`` through the first of token ``end - 1`` or more, without a byte piece's U+FFFD
    (no token sequence spells that), or an error."""
    decode = model.tokenizer.decode
    head = len(decode(tokens[:start + 1])) - 1
    for stop_end in range(len(decode(tokens[:end - 1])) + 1, len(decode(tokens[:end])) + 1):
        stop = decode(tokens[:end])[head:stop_end]
        if len(host_rule(model, tokens, stop)[0]) == end and "\ufffd" not in stop:
            return stop
    raise AssertionError(f"no stop string first completed by token {end - 1}")


def checked(out, model, free: list[int], stop: str):
    """Asserts ``out`` follows the host rule over ``free`` and counts returned tokens."""
    tokens, text = host_rule(model, free, stop)
    assert (out.tokens, out.text) == (tokens, text)
    assert out.stats["new_tokens"] == len(out.tokens)
    assert sum(out.stats["tokens_by_origin"].values()) == len(out.tokens)
    return out


def test_the_loop_ends_at_the_stop_string(target):
    """ar, greedy: a stop string completed by the 4th token ends the program there (4
    target passes, not 24), with the host rule's tokens and text."""
    prompt = random_prompt(2, 9)
    free = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[]).tokens
    stop = early_stop(target, free, 2, 4)
    out = checked(specjax.generate(target, prompt, max_new_tokens=NEW, stop=[stop]),
                  target, free, stop)
    assert len(out.tokens) == 4 and out.stats["stop_string"] == stop
    assert out.stats["target_calls"] == 4  # the prefill and three steps
    # Another string: the same program (the sequences are traced).
    other = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[early_stop(
        target, free, 3, 6)])
    assert other.stats["compile_seconds"] == 0.0 and other.stats["target_calls"] == 6


def test_a_stop_inside_one_step_and_one_over_two_steps(target, spec_drafts):
    """spec with the target as its draft accepts 3 drafts + 1 token per step: tokens 1-4
    come from step 1, 5-8 from step 2. A stop completed by token 3 (tokens 2-3, one
    step's accepted tokens) ends it in step 1; one over tokens 4-5 (the tail of step 1 and
    the start of step 2) in step 2, mid-step, the tokens after it dropped."""
    prompt = random_prompt(2, 9)
    kwargs = dict(method="spec", draft=spec_drafts["self"], draft_depth=3,
                  max_new_tokens=NEW)
    free = specjax.generate(target, prompt, stop=[], **kwargs)
    assert free.stats["accepted_histogram"][-1] == free.stats["target_calls"] - 1
    for start, end, calls in ((1, 3, 2), (4, 6, 3)):
        stop = early_stop(target, free.tokens, start, end)
        out = checked(specjax.generate(target, prompt, stop=stop, **kwargs), target,
                      free.tokens, stop)
        ar = specjax.generate(target, prompt, max_new_tokens=NEW, stop=stop)
        assert len(out.tokens) == end and out.tokens == ar.tokens
        assert out.stats["target_calls"] == calls, (start, end)
        assert out.origins == free.origins[:end]


def _device_stops(condition: StopCondition, prompt: list[int], steps: list[list[int]]):
    """Appends ``steps`` (token lists) after ``prompt`` as a decode loop does; returns how
    many tokens were kept when the condition ended it (``None``: never)."""
    tokens = jnp.zeros(64, jnp.int32).at[:len(prompt)].set(jnp.asarray(prompt))
    state = DecodeState(
        cache=None, tokens=tokens, length=jnp.int32(len(prompt)),
        prompt_length=jnp.int32(len(prompt)), max_length=jnp.int32(60), done=jnp.bool_(False),
        nonfinite=jnp.bool_(False), nonfinite_position=jnp.int32(-1),
        target_calls=jnp.int32(0), draft_calls=jnp.int32(0), stop=condition, sampling=None)
    for step in steps:
        padded = jnp.asarray(step + [0] * (4 - len(step)), jnp.int32)
        state = append_tokens(state, padded, jnp.int32(len(step)))
        if bool(state.done):
            return int(state.length) - len(prompt)
    return None


def test_every_tokenization_of_a_stop_at_a_boundary():
    """"\\n\\n" as one token, two tokens (in one step or over two), inside a longer token,
    and split over two longer ones ends the loop at the token that completes it; "\\n"
    tokens that do not spell it (a prompt "\\n", a lone byte piece between) never do."""
    tokenizer = tiny_tokenizer()
    sequences = stop_strings.stop_sequences(tokenizer, TINY_VOCAB, ["\n\n"])
    for spelling in (("ĊĊ",), (".ĊĊ",), ("ĊĊĊ",), ("Ċ", "Ċ"), ("bĊ", "Ċa"), ("ĠĊ", "ĊĊ")):
        assert tuple(ID[p] for p in spelling) in sequences, spelling
    condition = stop_condition([], sequences)
    a, n = ID["a"], ID["Ċ"]
    cases = {
        "one token": ([a], [[a, ID["ĊĊ"], a]], 2),
        "inside a token": ([a], [[a, a, ID[".ĊĊ"]]], 3),
        "two tokens, one step": ([a], [[a, n, n, a]], 3),
        "two tokens, two steps": ([a], [[a, n], [n, a]], 3),
        "split over two tokens": ([a], [[a, ID["bĊ"]], [ID["Ċa"], a]], 3),
        "the prompt's newline": ([a, n], [[n, a, a]], None),
        "a byte piece between": ([a], [[n, ID["â"], n, a]], None),
    }
    for name, (prompt, steps, kept) in cases.items():
        assert _device_stops(condition, prompt, steps) == kept, name
        text = tokenizer.decode([t for step in steps for t in step])
        assert ("\n\n" in text) == (kept is not None), name  # the host rule agrees
    # Nothing listed decodes without the string, at the start or after other tokens.
    for sequence in sequences:
        assert "\n\n" in tokenizer.decode(list(sequence))
        assert "\n\n" in tokenizer.decode([ID["â"], *sequence])


SAMPLINGS = {"greedy": dict(), "coupled": dict(temperature=1.0, top_k=20, seed=5)}


@pytest.mark.parametrize("method", ["ar", "spec", *(
    pytest.param(m, marks=pytest.mark.slow) for m in ("tree", "ngram", "staged"))])
def test_every_method_stops_like_ar(target, methods, method):
    """Greedy and coupled: a method's tokens with a stop string are ar's with it, the host
    rule over the full generation, and its loop ended there (no more target passes than
    tokens returned)."""
    prompt, options = random_prompt(3, 8), methods(method)
    for name, sampling in SAMPLINGS.items():
        free = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[], **sampling)
        stop = early_stop(target, free.tokens, 3, 5)
        ar = specjax.generate(target, prompt, max_new_tokens=NEW, stop=stop, **sampling)
        out = checked(specjax.generate(target, prompt, max_new_tokens=NEW, stop=stop,
                                       **options, **sampling), target, free.tokens,
                      stop)
        assert out.tokens == ar.tokens and len(out.tokens) == 5, (method, name)
        assert out.stats["target_calls"] <= len(out.tokens), (method, name)


@pytest.mark.parametrize("method", ["ar", pytest.param("spec", marks=pytest.mark.slow)])
def test_batch_rows_stop_on_their_own(target, methods, method):
    """Each row of a batch stops at its own first stop string, as its batch-1 call does."""
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([5, 9, 3])]
    free = [specjax.generate(target, p, max_new_tokens=NEW, stop=[]).tokens for p in prompts]
    stop = early_stop(target, free[0], 2, 4)
    kwargs = dict(methods(method), max_new_tokens=NEW, stop=stop)
    singles = [specjax.generate(target, p, **kwargs) for p in prompts]
    outs = specjax.generate(target, prompts, **kwargs)
    for row, (out, single) in enumerate(zip(outs, singles)):
        checked(out, target, free[row], stop)
        assert (out.tokens, out.text) == (single.tokens, single.text), row
        assert out.stats["target_calls"] == single.stats["target_calls"], row
    assert len(outs[0].tokens) == 4 and outs[0].stats["target_calls"] <= 4
    assert outs[0].stats["batch"]["new_tokens"] == sum(len(o.tokens) for o in outs)


def test_stats_count_returned_tokens_when_the_host_cuts(target, monkeypatch):
    """A tokenization the device does not list (here: none listed) runs on to the budget;
    the host cuts, and ``new_tokens``, ``tokens_per_s`` and ``tokens_by_origin`` count
    the returned tokens only."""
    prompt = random_prompt(2, 9)
    free = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[]).tokens
    stop = early_stop(target, free, 2, 4)
    monkeypatch.setattr(requests, "stop_sequences", lambda *args: [])
    out = checked(specjax.generate(target, prompt, max_new_tokens=NEW, stop=stop), target,
                  free, stop)
    assert out.stats["target_calls"] == NEW and len(out.tokens) == 4
    assert out.stats["tokens_per_s"] == pytest.approx(4 / out.stats["seconds"])


def test_a_sequence_that_stops_too_early_is_run_again(target, monkeypatch):
    """Where a listed sequence ends the loop but the text holds no stop string (a
    tokenizer whose text depends on context), the request runs again without sequences:
    the tokens are still the host rule's."""
    prompt = random_prompt(2, 9)
    free = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[]).tokens
    stop = early_stop(target, free, 5, 8)
    monkeypatch.setattr(requests, "stop_sequences", lambda *args: [(free[1],)])  # not the string
    for kwargs in (dict(), dict(batch=specjax.BatchOptions())):
        one = specjax.generate(target, [prompt] if kwargs else prompt, max_new_tokens=NEW,
                               stop=stop, **kwargs)
        one = one[0] if kwargs else one
        assert len(checked(one, target, free, stop).tokens) == 8


def test_stream_generate_stops_at_the_string(target):
    prompt = random_prompt(3, 8)
    free = specjax.generate(target, prompt, max_new_tokens=NEW, stop=[]).tokens
    stop = early_stop(target, free, 3, 5)
    streamed, stats = [], None
    for new, stats in specjax.stream_generate(target, prompt, max_new_tokens=NEW, stop=stop):
        streamed += new
    assert streamed == host_rule(target, free, stop)[0] and stats["stop_string"] == stop
    assert stats["new_tokens"] == len(streamed)


def test_stop_sequence_limits_are_one_line_errors():
    with pytest.raises(specjax.InvalidArgumentError, match="at most 128 stop sequences"):
        stop_condition([], [(1,)] * 129)
    with pytest.raises(specjax.InvalidArgumentError, match="1 to 4 tokens"):
        stop_condition([], [(1, 2, 3, 4, 5)])
    assert np.asarray(stop_condition([7], [(1, 2)]).sequences)[0].tolist() == [-1, -1, 1, 2]


def _sentencepiece_tokenizer(folder, add_space_prefix: bool):
    """The tiny SentencePiece vocabulary (Llama 2's layout: "\\n" a byte piece) from a
    GGUF file, as a user's file is read."""
    import gguf

    from helpers_checkpoints import add_sentencepiece_vocabulary
    from specjax.checkpoints_tools.gguf_reader import read_gguf
    from specjax.checkpoints_tools.gguf_tokenizer import tokenizer_from_gguf

    path = folder / f"vocab-{add_space_prefix}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_sentencepiece_vocabulary(writer, add_space_prefix=add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(read_gguf(path), str(path))


def test_the_device_never_stops_before_the_host_rule(tmp_path):
    """Random token streams (mostly tokens of the listed sequences) through a byte-level
    and two SentencePiece tokenizers: the first token that completes a listed sequence
    is never before the first token after which the decoded text contains the string
    (it is that token in most streams; after it, or never, where the string came out in
    a tokenization not listed)."""
    tokenizers = [(tiny_tokenizer(), TINY_VOCAB)] + [
        (tokenizer, len(tokenizer)) for tokenizer in
        (_sentencepiece_tokenizer(tmp_path, prefix) for prefix in (True, False))]
    rng = np.random.default_rng(0)
    exact = 0
    for tokenizer, size in tokenizers:
        for stop in ["\n\n", " the", "e r", "he", ":\n", "x ="]:
            sequences = stop_strings.stop_sequences(tokenizer, size, [stop])
            pool = sorted({t for sequence in sequences for t in sequence}) or [0]
            for _ in range(100):
                tokens = [int(rng.choice(pool)) if rng.random() < 0.6 else int(rng.integers(size))
                          for _ in range(10)]
                device = next((k for k in range(1, 11) if any(
                    tuple(tokens[max(0, k - len(s)):k]) == s for s in sequences)), None)
                host = next((k for k in range(1, 11) if stop in tokenizer.decode(
                    tokens[:k], skip_special_tokens=True)), None)
                assert device is None or (host is not None and device >= host), (stop, tokens)
                exact += device is not None and device == host
    assert exact > 400, exact  # most streams: the same token
