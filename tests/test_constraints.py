"""Constraints (specjax.constraints): the device tables of a regex or JSON schema against the
outlines-core index they are built from, against Python's ``re.fullmatch`` and the
``jsonschema`` validator, the one-line refusals, and the disk cache across processes.

The tokenizer is a tiny byte-level BPE (printable ASCII, a few merges, a special EOS) over a
logits width padded past it, so every table builds in milliseconds."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specjax import constraints
from specjax.constraints import (DEAD_STATE, FREE_STATE, INITIAL_STATE, JsonSchema, Regex,
                                 advance, allowed_tokens, build_tables, forced_token,
                                 mask_logits)
from specjax.errors import InvalidArgumentError
from specjax.methods.options import JUMP_FORWARD

import jsonschema  # the test extra carries the constraints extra

V = 128  # the logits width: the tokenizer's 101 ids, then 27 ids it never produces
MERGES = [("a", "b"), ("1", "2"), ("{", '"'), ('"', ":"), ("Ġ", "a"), ("b", "a")]
REGEXES = ["(ab)+", "a(ba)*", "[0-9]{1,3}", "(ab|ba)*c?", "x|yz|(12)+", r"\d+(\.\d+)?",
           "[a-c ]{0,4}b"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "array", "items": {"type": "boolean"}},
                                           "c": {"type": "string", "maxLength": 3}},
          "required": ["a", "b"]}


def tiny_tokenizer_json() -> str:
    """A byte-level BPE over printable ASCII with a few merges and a special ``<eos>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    unicode_of = {value: char for char, value in constraints._bytes_to_unicode().items()}
    vocab = {unicode_of[value]: value - 32 for value in range(32, 127)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer.to_str()


@functools.cache
def tiny_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tiny_tokenizer_json())


@functools.cache
def eos_id() -> int:
    return tiny_tokenizer().token_to_id("<eos>")


@functools.cache
def tables_of(constraint):
    tables, _ = build_tables(constraint, tiny_tokenizer(), V, [eos_id()], use_cache=False)
    return jax.device_put(tables)


_allowed = jax.jit(allowed_tokens)
_advance = jax.jit(advance)


def spelled(tokens) -> bytes:
    pieces = constraints.token_bytes(tiny_tokenizer(), V)
    return b"".join(pieces[t] for t in tokens)


def test_token_bytes_reads_byte_level_and_sentencepiece_vocabularies():
    pieces = constraints.token_bytes(tiny_tokenizer(), V)
    tokenizer = tiny_tokenizer()
    assert pieces[tokenizer.token_to_id("Ġa")] == b" a"
    assert pieces[tokenizer.token_to_id("ab")] == b"ab"
    assert pieces[tokenizer.token_to_id("Ġ")] == b" "
    assert pieces[eos_id()] is None and pieces[V - 1] is None

    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581a": 1, "<0x0A>": 2, "b": 3, "<0xC3>": 4}
    piece_tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    piece_tokenizer.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    piece_tokenizer.add_special_tokens(["<unk>"])
    assert constraints.token_bytes(piece_tokenizer, 6) == [None, b" a", b"\n", b"b", b"\xc3",
                                                           None]


def walk_both(constraint):
    """Walks the outlines-core index and the tables side by side from their initial
    states; yields (index state, table state) pairs, each table state once."""
    pieces = constraints.token_bytes(tiny_tokenizer(), V)
    index = constraints._build_index(constraint, pieces, [eos_id()])
    tables = tables_of(constraint)
    pairs, seen = [(constraints._start_state(index, pieces), INITIAL_STATE)], {}
    while pairs:
        index_state, state = pairs.pop()
        if state in seen:
            assert seen[state] == index_state  # one table state per index state
            continue
        seen[state] = index_state
        yield index, tables, index_state, state
        for token in index.get_allowed_tokens(index_state):
            if token != eos_id() and token < V:  # V: the index's sentinel token
                following = int(_advance(tables, jnp.int32(state), jnp.int32(token)))
                pairs.append((index.get_next_state(index_state, token), following))


@pytest.mark.parametrize("constraint", [Regex(p) for p in REGEXES] + [JsonSchema(SCHEMA)],
                         ids=REGEXES + ["schema"])
def test_tables_agree_with_the_outlines_core_index(constraint):
    visited = 0
    for index, tables, index_state, state in walk_both(constraint):
        allowed = set(np.flatnonzero(_allowed(tables, jnp.int32(state))).tolist())
        # (the index also knows the sentinel token, id V: the tables start after it)
        assert allowed == set(index.get_allowed_tokens(index_state)) - {V}
        final = index.is_final_state(index_state)
        assert (eos_id() in allowed) == final == bool(tables.accepting[state])
        assert int(forced_token(tables, state)) == (allowed.pop() if len(allowed) == 1 else -1)
        visited += 1
    assert visited >= 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(text=st.text(alphabet="ab12c.xyz ", max_size=10),
       pattern=st.sampled_from(REGEXES))
@example(text="abab", pattern="(ab)+").via("a final loop of several bytes")
@example(text="ababa", pattern="a(ba)*").via("a final loop of several bytes")
@example(text="", pattern="(ab|ba)*c?").via("the empty text")
def test_a_text_ends_in_an_accepting_state_exactly_when_it_matches(text, pattern):
    """Tokenized by the BPE (merged pieces included), a text walks to an accepting state iff
    ``re.fullmatch`` accepts it, and never to the dead state when it matches. (outlines-core
    alone accepts only "ab" for "(ab)+": constraints._build_index anchors the end.)"""
    tables = tables_of(Regex(pattern))
    state = jnp.int32(INITIAL_STATE)
    for token in tiny_tokenizer().encode(text).ids:
        state = _advance(tables, state, jnp.int32(token))
    matches = re.fullmatch(pattern, text) is not None
    assert bool(tables.accepting[int(state)]) == matches
    if matches:
        assert int(state) != DEAD_STATE


def random_walk(tables, choices) -> list[int] | None:
    """Follows ``choices`` (indexes into each state's allowed tokens) until EOS; None if
    the choices run out first."""
    state, tokens = jnp.int32(INITIAL_STATE), []
    for choice in choices:
        allowed = np.flatnonzero(_allowed(tables, state))
        assert len(allowed) > 0
        token = int(allowed[choice % len(allowed)])
        if token == eos_id():
            return tokens
        tokens.append(token)
        state = _advance(tables, state, jnp.int32(token))
        assert int(state) != DEAD_STATE
    return None


@settings(max_examples=40, deadline=None, derandomize=True)
@given(choices=st.lists(st.integers(0, 1000), min_size=1, max_size=30),
       pattern=st.sampled_from(REGEXES))
def test_every_walk_over_allowed_tokens_spells_a_match(choices, pattern):
    tokens = random_walk(tables_of(Regex(pattern)), choices)
    if tokens is not None:
        assert re.fullmatch(pattern, spelled(tokens).decode())


@settings(max_examples=25, deadline=None, derandomize=True)
@given(choices=st.lists(st.integers(0, 1000), min_size=1, max_size=60))
def test_every_walk_under_a_schema_spells_a_valid_document(choices):
    tokens = random_walk(tables_of(JsonSchema(SCHEMA)), choices)
    if tokens is not None:
        jsonschema.validate(json.loads(spelled(tokens)), SCHEMA)


def test_the_device_functions_take_batches_free_rows_and_reuse_one_program():
    tables = tables_of(Regex("(ab)+"))
    token = {text: tiny_tokenizer().token_to_id(text) for text in ("a", "b", "ab")}
    states = jnp.array([[INITIAL_STATE, FREE_STATE], [DEAD_STATE, INITIAL_STATE]], jnp.int32)
    logits = jax.random.normal(jax.random.key(0), (2, 2, V))
    masked = jax.jit(mask_logits)(tables, states, logits)
    np.testing.assert_array_equal(masked[0, 1], logits[0, 1])  # a free row: untouched
    assert np.isfinite(masked[0, 0]).sum() == 2  # "a" or "ab"
    assert np.flatnonzero(np.isfinite(masked[1, 0])).tolist() == [eos_id()]
    tokens = jnp.array([[token["ab"], token["b"]], [token["a"], token["b"]]], jnp.int32)
    following = _advance(tables, states, tokens)
    assert following[0, 1] == FREE_STATE and following[1, 0] == DEAD_STATE
    assert following[1, 1] == DEAD_STATE  # "b" cannot start "(ab)+"
    assert tables.accepting[int(following[0, 0])]
    # Another constraint in the same (states, classes) bucket runs the same program.
    other = tables_of(Regex("[0-9]{1,3}"))
    assert jax.tree.map(jnp.shape, other) == jax.tree.map(jnp.shape, tables)
    traces = []

    @jax.jit
    def masked(tables, states, logits):
        traces.append(tables)  # runs once per trace
        return mask_logits(tables, states, logits)

    masked(tables, states, logits)
    masked(other, states, logits)
    assert len(traces) == 1


@pytest.mark.parametrize("make, message", [
    (lambda: Regex("(ab"), "invalid regular expression"),
    (lambda: Regex("(?=a)a"), "look-around"),
    (lambda: Regex(""), "non-empty string"),
    (lambda: Regex("^ab|c"), "remove the"),
    (lambda: JsonSchema("{not json"), "not JSON"),
    (lambda: JsonSchema([1, 2]), "must be a JSON object"),
    (lambda: JsonSchema({"type": "nonsense"}), "not a valid schema"),
    (lambda: JsonSchema({"if": {"type": "string"}}), "unsupported schema"),
    (lambda: JsonSchema({"$ref": "#/$defs/missing"}), "unsupported schema"),
])
def test_a_bad_constraint_is_refused_in_one_line_before_a_tokenizer_exists(make, message):
    with pytest.raises(InvalidArgumentError, match=message) as error:
        constraints.check_constraint(make())
    assert "\n" not in str(error.value)


def test_a_constraint_over_the_limits_or_the_vocabulary_is_refused(monkeypatch):
    with pytest.raises(InvalidArgumentError, match="cannot spell"):
        build_tables(Regex("a\tb"), tiny_tokenizer(), V, [eos_id()], use_cache=False)
    with pytest.raises(InvalidArgumentError, match="eos_token_ids"):
        build_tables(Regex("ab"), tiny_tokenizer(), V, [V], use_cache=False)
    monkeypatch.setattr(constraints, "MAX_STATES", 8)
    with pytest.raises(InvalidArgumentError, match=r"has \d+ states, over the limit of 8"):
        constraints.check_constraint(Regex("[0-9]{12}"))
    with pytest.raises(InvalidArgumentError, match=r"has \d+ states, over the limit of 8"):
        build_tables(Regex("[0-9]{12}"), tiny_tokenizer(), V, [eos_id()], use_cache=False)
    monkeypatch.setattr(constraints, "MAX_TABLE_BYTES", 100)
    with pytest.raises(InvalidArgumentError, match="over the limit of 0 MiB"):
        build_tables(Regex("ab"), tiny_tokenizer(), V, [eos_id()], use_cache=False)


SECOND_PROCESS = """
import json, sys
import numpy as np
from tokenizers import Tokenizer
from specjax.constraints import JsonSchema, build_tables
tokenizer = Tokenizer.from_file(sys.argv[1])
tables, info = build_tables(JsonSchema(json.loads(sys.argv[3])), tokenizer, {V},
                            [tokenizer.token_to_id("<eos>")], cache_dir=sys.argv[2])
print(json.dumps({{"from_cache": info.from_cache,
                  "next_state": np.asarray(tables.next_state).tolist()}}))
"""


def test_the_table_cache_survives_a_second_process(tmp_path):
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(tiny_tokenizer_json())
    cache = tmp_path / "cache"
    tables, info = build_tables(JsonSchema(SCHEMA), tiny_tokenizer(), V, [eos_id()],
                                cache_dir=cache)
    assert not info.from_cache and Path(info.cache_path).is_file()
    assert [path.name for path in cache.iterdir()] == [Path(info.cache_path).name]  # no temp
    run = subprocess.run([sys.executable, "-c", SECOND_PROCESS.format(V=V), str(tokenizer_file),
                          str(cache), json.dumps(SCHEMA)],
                         capture_output=True, text=True, timeout=120, check=True)
    answer = json.loads(run.stdout.splitlines()[-1])
    assert answer["from_cache"]
    np.testing.assert_array_equal(answer["next_state"], tables.next_state)
    # Another constraint, or a damaged file, builds afresh.
    _, other = build_tables(Regex("ab"), tiny_tokenizer(), V, [eos_id()], cache_dir=cache)
    assert not other.from_cache and other.cache_path != info.cache_path
    Path(info.cache_path).write_bytes(b"half a file")
    again, rebuilt = build_tables(JsonSchema(SCHEMA), tiny_tokenizer(), V, [eos_id()],
                                  cache_dir=cache)
    assert not rebuilt.from_cache
    np.testing.assert_array_equal(again.next_state, tables.next_state)


FUNCTION_SCHEMA = {  # a function's signature and docstring, as issue-style JSON
    "type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
        "parameters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "type": {"type": "string"},
            "default": {"type": ["string", "null"]}}, "required": ["name", "type"]}},
        "returns": {"type": "string"}, "docstring": {"type": "string"}},
    "required": ["name", "parameters", "returns", "docstring"]}


def test_a_function_schema_on_smollm2s_vocabulary(tmp_path):
    """The real 49,152-token byte-level vocabulary: the tables are a few hundred classes wide,
    and a walk that takes the closing quote where allowed, else the lowest allowed id, spells
    a valid document."""
    from specjax.checkpoints_tools.gguf_reader import read_gguf
    from specjax.checkpoints_tools.gguf_tokenizer import tokenizer_from_gguf
    from specjax.checkpoints_tools.sources import known_model_path

    tokenizer = tokenizer_from_gguf(read_gguf(known_model_path("smollm2-135m")))
    vocab_size, eos = 49152, tokenizer.eos_token_id
    quote = tokenizer.convert_tokens_to_ids('"')
    tables, info = build_tables(JsonSchema(FUNCTION_SCHEMA), tokenizer, vocab_size, [eos],
                                cache_dir=tmp_path)
    assert info.num_classes < 1024 and info.num_states < MAX_WALK
    assert tables.token_class.shape == (vocab_size,)
    tables = jax.device_put(tables)

    @jax.jit
    def step(state):
        preference = -jnp.arange(vocab_size, dtype=jnp.float32).at[quote].set(1.0)
        scores = mask_logits(tables, state, preference)
        token = jnp.argmax(scores).astype(jnp.int32)
        return token, advance(tables, state, token)

    state, tokens = jnp.int32(INITIAL_STATE), []
    for _ in range(MAX_WALK):
        token, state = step(state)
        if int(token) == eos:
            break
        tokens.append(int(token))
    document = json.loads(tokenizer.decode(tokens))
    jsonschema.validate(document, FUNCTION_SCHEMA)
    assert list(document) == list(FUNCTION_SCHEMA["properties"])  # the schema's key order


MAX_WALK = 400


# ------------------------------------------------------------------------ ar under a constraint

BOUNDED = ["[0-9]{1,3}", "(yes|no|maybe)", "[a-c]{2,5}", r'\{"a":[0-9]\}', "(ab|ba){1,3}"]


@pytest.fixture(scope="module")
def tiny_model():
    from conftest import tiny_pair

    return tiny_pair("llama-gqa", seed=5, vocab_size=V)[1]


def constrained_run(model, prompt, constraint, temperature, seed, max_new_tokens=12):
    """The constrained ``ar`` method below the API: the request ``ar`` would run, with the
    constrained step object and the constraint's tables as its resources."""
    from specjax import api, decode
    from specjax.methods import Autoregressive

    request = api._prepare(model, prompt, api.request(
        method="ar", max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
        stop=[eos_id()]))
    loop = dataclasses.replace(request.loop, method=Autoregressive(constrained=True))
    args = request.args[:-1] + (tables_of(constraint),)
    state = decode.run_program(args[0], loop, *args[1:])[0]
    return [int(t) for t in state.tokens[request.prompt_length:int(state.length)]]


def greedy_reference(model, prompt, constraint, max_new_tokens=12) -> list[int]:
    """Greedy decoding by hand: the whole sequence through the model (causal, padded to 32
    tokens: one program) at every step, the last logits masked by the automaton's state
    (numpy), the first maximum."""
    from specjax import models

    tables = tables_of(constraint)
    allowed = np.asarray(_allowed(tables, jnp.arange(tables.next_state.shape[0])))
    forward = jax.jit(lambda tokens: models.forward(
        model.params, model.config, tokens, jnp.arange(32, dtype=jnp.int32),
        attn_impl="reference")[0])
    tokens, state, out = list(prompt), INITIAL_STATE, []
    for _ in range(max_new_tokens):
        logits = forward(jnp.asarray(tokens + [0] * (32 - len(tokens)), jnp.int32))
        last = np.asarray(logits[len(tokens) - 1])
        token = int(np.argmax(np.where(allowed[state], last, -np.inf)))
        out.append(token)
        if token == eos_id():
            break
        tokens.append(token)
        state = int(_advance(tables, jnp.int32(state), jnp.int32(token)))
    return out


@pytest.mark.parametrize("pattern", BOUNDED)
def test_ar_under_a_regex_spells_a_match_greedy_and_coupled(tiny_model, pattern):
    rng = np.random.default_rng(len(pattern))
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        prompt = rng.integers(0, 100, 5 + seed).tolist()
        tokens = constrained_run(tiny_model, prompt, Regex(pattern), temperature, seed)
        assert tokens[-1] == eos_id(), (pattern, seed)  # bounded: each run ends, by EOS
        assert re.fullmatch(pattern, spelled(tokens[:-1]).decode()), (pattern, seed)
        if temperature == 0.0:
            assert tokens == greedy_reference(tiny_model, prompt, Regex(pattern))


def test_ar_under_a_schema_spells_valid_documents_or_their_prefixes(tiny_model):
    finished = 0
    for seed in range(4):
        prompt = np.random.default_rng(seed).integers(0, 100, 6).tolist()
        tokens = constrained_run(tiny_model, prompt, JsonSchema(SCHEMA), 1.0, seed,
                                 max_new_tokens=48)
        if tokens[-1] == eos_id():
            jsonschema.validate(json.loads(spelled(tokens[:-1])), SCHEMA)
            finished += 1
        else:  # the budget ran out: a prefix of a document, still alive
            state = jnp.int32(INITIAL_STATE)
            for token in tokens:
                state = _advance(tables_of(JsonSchema(SCHEMA)), state, jnp.int32(token))
            assert int(state) != DEAD_STATE
    assert finished >= 1


def test_constraints_in_one_size_bucket_share_the_compiled_program(tiny_model):
    from specjax import decode

    compiles = []

    def reporter(description):
        compiles.append(description)
        return contextlib.nullcontext()

    prompt = list(range(3, 9))
    constrained_run(tiny_model, prompt, Regex(BOUNDED[0]), 0.0, 0)
    with decode.reporting_compiles(reporter):
        for pattern in BOUNDED[1:]:
            assert tables_of(Regex(pattern)).next_state.shape == (16, 16)
            constrained_run(tiny_model, prompt, Regex(pattern), 0.0, 0)
        assert compiles == []
        larger = Regex("[0-9]{20}")  # a bucket no other test runs
        assert tables_of(larger).next_state.shape == (32, 16)
        constrained_run(tiny_model, prompt, larger, 0.0, 0)
        assert len(compiles) == 1


def test_a_batch_under_one_constraint_equals_its_single_runs(tiny_model):
    """A batch of constrained ar rows (jumping forward) equals each row's single run
    (one pass per token)."""
    from specjax import api, decode
    from specjax.batch_options import BatchOptions
    from specjax.methods import Autoregressive

    prompts = [np.random.default_rng(seed).integers(0, 100, 4 + 3 * seed).tolist()
               for seed in range(3)]
    constraint = Regex(BOUNDED[3])
    (batch,) = api.prepare_batch(tiny_model, prompts, api.request(
        method="ar", max_new_tokens=12, stop=[eos_id()], batch=BatchOptions()))
    # The batch jumps forward (the regex forces some tokens), the single runs do not: its
    # vmapped lax.cond runs both passes and selects. The capacity (128) holds its scratch.
    loop = dataclasses.replace(batch.loop,
                               method=Autoregressive(constrained=True, jump_forward=8))
    assert loop.capacity >= 10 + 12 + loop.method.scratch
    args = batch.args[:-1] + (tables_of(constraint),)
    state = decode.run_batch(args[0], loop, *args[1:])[0]
    for row, prompt in zip(batch.rows, prompts):
        start, end = int(state.prompt_length[row]), int(state.length[row])
        tokens = np.asarray(state.tokens[row, start:end]).tolist()
        assert tokens == constrained_run(tiny_model, prompt, constraint, 0.0, 0)
        assert re.fullmatch(BOUNDED[3], spelled(tokens[:-1]).decode())


# ----------------------------------------------------------------------------- the API and CLI


@pytest.fixture(scope="module")
def spelling_model(tiny_model):
    """The tiny model with the tiny tokenizer (transformers' wrapper of it), so that
    ``generate`` builds the constraint's tables itself."""
    import specjax
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), eos_token="<eos>")
    return specjax.Model.from_params(tiny_model.config, tiny_model.params, tokenizer,
                                     name="tiny-spelling")


def test_generate_under_a_constraint_runs_the_constrained_ar_step(spelling_model, tiny_model):
    """``generate(..., constraint=)`` (one prompt, a batch, a stream) gives the tokens of
    the constrained step run by hand, greedy and coupled; the stats say so; without a
    method the choice is ar (the model ships no draft) and says why."""
    import specjax
    from specjax import api

    constraint = Regex(BOUNDED[3])
    prompts = [np.random.default_rng(seed).integers(0, 100, 4 + 3 * seed).tolist()
               for seed in range(2)]
    for temperature, seed in ((0.0, 0), (1.0, 3)):
        out = specjax.generate(spelling_model, prompts[0], constraint=constraint,
                               max_new_tokens=12, temperature=temperature, seed=seed,
                               stop=[eos_id()])
        assert out.tokens == constrained_run(tiny_model, prompts[0], constraint, temperature,
                                             seed)
    assert out.stats["method"] == "ar"
    assert out.stats["method_choice"] == "ar: the model ships no draft or n-gram tables"
    assert out.stats["constraint"]["constraint"] == constraint.describe()
    assert out.stats["constraint"]["table_bucket"] == [16, 16]
    rows = specjax.generate(spelling_model, prompts, constraint=constraint, max_new_tokens=12,
                            stop=[eos_id()], method="ar")
    assert [r.tokens for r in rows] == [constrained_run(tiny_model, p, constraint, 0.0, 0)
                                        for p in prompts]
    assert rows[1].stats["constraint"] == rows[0].stats["constraint"]
    streamed = list(specjax.stream_generate(spelling_model, prompts[1], constraint=constraint,
                                            max_new_tokens=12, stop=[eos_id()]))
    assert sum((new for new, _ in streamed), []) == rows[1].tokens
    # The model's own EOS ends the output when stop is not given.
    text = specjax.generate(spelling_model, prompts[0], constraint=Regex("(yes|no)"),
                            max_new_tokens=8).text
    assert text in ("yes", "no")


def test_the_default_under_a_constraint_is_the_measured_one_with_ars_tokens(spelling_model,
                                                                           tiny_model):
    """A model that ships smollm2-135m's assets: under a constraint the default is the
    fastest method of the constrained table on the CPU at T=0 (spec), the reason says so,
    and its tokens are constrained ar's; at T>0 (none beat ar there) ar; a method named is
    kept."""
    import specjax
    from specjax.methods import choice

    model = dataclasses.replace(spelling_model, assets="smollm2-135m")
    draft = spelling_model.first_layers(1)
    measured = choice.MEASURED_CONSTRAINED["cpu", "greedy"]
    best = max(measured.speedup, key=measured.speedup.get)
    assert best == "spec"  # the committed table's choice (tests/test_default_method.py)
    constraint, prompt = Regex(BOUNDED[3]), [5, 9, 14, 3]
    out = specjax.generate(model, prompt, constraint=constraint, max_new_tokens=12,
                           stop=[eos_id()], draft=draft)
    assert out.stats["method"] == "spec"
    assert out.stats["method_choice"].startswith("spec: the fastest for cpu, T=0, under a "
                                                 "constraint")
    assert measured.source in out.stats["method_choice"]
    assert out.tokens == constrained_run(tiny_model, prompt, constraint, 0.0, 0)
    sampled = specjax.generate(model, prompt, constraint=constraint, max_new_tokens=12,
                               stop=[eos_id()], temperature=1.0, seed=3)
    assert sampled.stats["method"] == "ar"
    assert sampled.stats["method_choice"].startswith("ar: no method beat it for cpu, T>0, "
                                                     "under a constraint")
    named = specjax.generate(model, prompt, constraint=constraint, max_new_tokens=12,
                             stop=[eos_id()], method="ar")
    assert named.stats["method_choice"] == "given" and named.tokens == out.tokens


def test_a_batch_with_one_constraint_per_row_equals_its_single_runs(spelling_model):
    """``constraint=[...]``, one per prompt (None: unconstrained): each row's tokens are
    those of its own call (greedy and coupled at T=1, its own seed), the rows grouped by
    constraint in the prompts' order, each row's stats naming its own constraint."""
    import specjax

    digits, words = Regex(BOUNDED[3]), Regex("(yes|no)")
    prompts = [np.random.default_rng(seed).integers(0, 100, 4 + seed).tolist()
               for seed in range(4)]
    constraints = [digits, None, words, digits]
    for temperature in (0.0, 1.0):
        settings = dict(max_new_tokens=6, temperature=temperature, stop=[eos_id()],
                        method="ar", jump_forward=0)  # the batch_under test jumps forward
        rows = specjax.generate(spelling_model, prompts, constraint=constraints,
                                seed=[5, 6, 7, 8], **settings)
        for row, (prompt, constraint) in enumerate(zip(prompts, constraints)):
            alone = specjax.generate(spelling_model, prompt, constraint=constraint,
                                     seed=5 + row, **settings)
            assert rows[row].tokens == alone.tokens, (temperature, row)
            described = [(out.stats.get("constraint") or {}).get("constraint")
                         for out in (rows[row], alone)]
            assert described[0] == described[1], (row, described)
    assert rows[1].stats.get("constraint") is None
    assert rows[2].stats["constraint"]["constraint"] == words.describe()
    cases = [(dict(constraint=[digits]), "got 1 constraints for 4 prompts"),
             (dict(constraint=[digits, "x", None, None]), "constraint must be specjax.Regex"),
             (dict(constraint=[]), "the list is empty")]
    for kwargs, message in cases:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            specjax.generate(spelling_model, prompts, max_new_tokens=4, **kwargs)
    with pytest.raises(InvalidArgumentError, match="goes with a list of prompts"):
        specjax.generate(spelling_model, prompts[0], constraint=[digits], max_new_tokens=4)


def test_a_prompts_file_gives_each_line_its_own_constraint(spelling_model, tmp_path, capsys,
                                                           monkeypatch):
    """``specjax generate --prompts-file``: a line's ``"regex"`` or ``"json_schema"`` is its
    own constraint (none: unconstrained); the records equal each prompt's own call (the
    batches of the per-row API test: its programs). Both on a line, a bad one, or lines'
    own beside ``--regex`` are refused in one line before the model loads."""
    import specjax
    from specjax import cli

    from conftest import serve_models

    prompts = [np.random.default_rng(seed).integers(0, 100, 4 + seed).tolist()
               for seed in range(4)]
    constraints = [Regex(BOUNDED[3]), None, Regex("(yes|no)"), Regex(BOUNDED[3])]
    lines = [dict(prompt=prompt, **({} if c is None else {"regex": c.pattern}))
             for prompt, c in zip(prompts, constraints)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    served = serve_models(monkeypatch, {"tiny": spelling_model}, [])
    settings = ["--method", "ar", "--jump-forward", "0", "--max-new-tokens", "6",
                "--batch-size", "4"]
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", "-m", "tiny", "--prompts-file", str(path), "--output",
                     str(out), *settings]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record, prompt, constraint in zip(records, prompts, constraints):
        alone = specjax.generate(served["tiny"], prompt, constraint=constraint, method="ar",
                                 jump_forward=0, max_new_tokens=6)
        assert record["tokens"] == alone.tokens
        assert (record["stats"].get("constraint") or {}).get("constraint") == (
            None if constraint is None else constraint.describe())
    cases = [({"prompt": "x", "regex": "a", "json_schema": {}}, [], "line 1: give \"regex\""),
             ({"prompt": "x", "regex": "(ab"}, [], "\"regex\": regex '(ab': invalid regular"),
             ({"prompt": "x", "json_schema": 3}, [], "\"json_schema\": JsonSchema: the schema"),
             ({"prompt": "x", "regex": "a"}, ["--regex", "b"], "drop --regex/--json-schema")]
    for line, flags, message in cases:
        path.write_text(json.dumps(line) + "\n")
        capsys.readouterr()
        code = cli.main(["generate", "-m", str(tmp_path / "no-such-model"), "--prompts-file",
                         str(path), *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err
    from specjax import api  # the request a batch of lines takes its slice of constraints by

    request = api.request(method="ar", constraint=constraints)
    assert request.replace(constraint=constraints[1:3]).constraint == tuple(constraints[1:3])
    assert request.replace(constraint=[None, None]).constraint is None
    with pytest.raises(InvalidArgumentError, match="made under one only"):
        api.request(method="ar").replace(constraint=constraints[0])


# Runs of six forced letters between free digits, then a forced EOS: 16 tokens.
JUMP_PATTERN = "([0-9]xyzxyz){2}[0-9]"
# (temperature, seed, max_new_tokens, stop strings): greedy, coupled, a budget and a stop
# string that end the output inside a forced run.
JUMP_CASES = [(0.0, 0, 20, []), (1.0, 3, 20, []), (1.0, 4, 5, []), (0.0, 0, 20, ["zxy"])]


def jump_forward_runs(model, **options) -> list:
    """``ar`` under JUMP_PATTERN for each of JUMP_CASES (one program for all of them)."""
    import specjax

    return [specjax.generate(model, DIST_PROMPT, method="ar", constraint=Regex(JUMP_PATTERN),
                             temperature=temperature, seed=seed, max_new_tokens=budget,
                             stop=[eos_id(), *strings], **options)
            for temperature, seed, budget, strings in JUMP_CASES]


@pytest.fixture(scope="module")
def one_pass_per_token(spelling_model):
    """The reference: constrained ar with one target pass per token."""
    return jump_forward_runs(spelling_model, jump_forward=0)


def test_ar_commits_a_forced_run_without_a_pass_per_token(spelling_model, one_pass_per_token):
    """Jump-forward (a GPU's or TPU's default under a constraint, asked for here on the
    CPU, whose default is one pass per token): the tokens of one pass per token,
    greedy and coupled, cut by a budget or a stop string inside a forced run, with a
    target pass per free token only; stats count the forced tokens and say the run is
    exact up to rounding on this CPU (the forced run's pass has several rows)."""
    from specjax.methods.exactness import BITWISE, UP_TO_ROUNDING

    runs = jump_forward_runs(spelling_model, jump_forward=JUMP_FORWARD)
    for case, got, expected in zip(JUMP_CASES, runs, one_pass_per_token):
        assert got.tokens == expected.tokens, case
    full, reference = runs[0], one_pass_per_token[0]
    assert re.fullmatch(JUMP_PATTERN, spelled(full.tokens[:-1]).decode())
    assert len(full.tokens) == 16 and full.tokens[-1] == eos_id()
    # prefill (a digit), then per step a forced run and a pass: 6 letters + a digit twice,
    # then the forced EOS (whose pass picks nothing: the EOS ends the output)
    assert (full.stats["target_calls"], full.stats["forced_tokens"]) == (4, 13)
    assert (reference.stats["target_calls"], reference.stats["forced_tokens"]) == (16, 0)
    assert full.stats["mean_accepted"] == 4.0 and reference.stats["mean_accepted"] == 1.0
    assert len(runs[2].tokens) == 5 and runs[2].stats["forced_tokens"] == 4
    assert spelled(runs[3].tokens).decode().endswith("zxy")
    assert (full.stats["exact"], reference.stats["exact"]) == (UP_TO_ROUNDING, BITWISE)


def wrong_forced_token(tables, state):
    """WRONG on purpose: a state with a choice forces its smallest allowed token."""
    allowed = constraints.allowed_tokens(tables, state)
    return jnp.where(jnp.any(allowed), jnp.argmax(allowed), -1).astype(jnp.int32)


def dropping_run(original):
    """WRONG on purpose: the run's first forced token is skipped (the automaton still
    advances over it)."""
    def run(tables, automaton, room, width):
        tokens, count, after = original(tables, automaton, room, width)
        return jnp.roll(tokens, -1), jnp.maximum(count - 1, 0), after
    return run


@pytest.mark.parametrize("wrong", ["unforced", pytest.param("dropped", marks=pytest.mark.slow)])
def test_the_jump_forward_test_catches_a_wrong_run(spelling_model, one_pass_per_token,
                                                   monkeypatch, programs_aside, wrong):
    from specjax.methods import ar

    programs_aside()
    if wrong == "unforced":
        monkeypatch.setattr(ar, "forced_token", wrong_forced_token)
    else:
        monkeypatch.setattr(ar, "forced_run", dropping_run(ar.forced_run))
    runs = jump_forward_runs(spelling_model, jump_forward=JUMP_FORWARD)
    assert sum(got.tokens != expected.tokens
               for got, expected in zip(runs, one_pass_per_token)) >= 2


def test_a_constraint_is_refused_in_one_line_where_it_cannot_run(spelling_model, tiny_model):
    import specjax

    cases = [
        (spelling_model, dict(constraint="[0-9]+"), "constraint must be specjax.Regex"),
        (spelling_model, dict(constraint=Regex("[0-9]+"), stop=[]), "stop=[] leaves none"),
        (tiny_model, dict(constraint=Regex("[0-9]+")), "has no tokenizer"),
    ]
    for model, kwargs, message in cases:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)) as info:
            specjax.generate(model, [1, 2, 3], max_new_tokens=4, **kwargs)
        assert "\n" not in str(info.value)


def test_the_cli_refuses_a_bad_constraint_before_the_model_loads(tmp_path, capsys):
    """``--regex`` and ``--json-schema`` are checked first: the model named here does not
    exist, and the error is the constraint's."""
    from specjax import cli

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "nonsense"}}}')
    cases = [(["--regex", "(ab"], "--regex:"),
             (["--json-schema", str(schema)], "--json-schema: JsonSchema: not a valid schema"),
             (["--json-schema", str(tmp_path / "missing.json")], "cannot read it")]
    for flags, message in cases:
        code = cli.main(["generate", "x", "-m", str(tmp_path / "no-such-model"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err
        assert "no-such-model" not in err


# ----------------------------------------------------------------------------- speculative


# spec drafts through the fixed-topology builder (a chain), tree through the dynamic one.
# staged without context lookup: its program is the one the staged forcing test reuses
# (ngram keeps lookup on). The reference of these tests is ar with one target pass per
# token (jump_forward=0; jump-forward's own test proves its tokens equal).
SPECULATIVE = [("spec", {}), ("tree", {}), ("staged", {"use_lookup": False}), ("ngram", {})]


@pytest.fixture(scope="module")
def ngram_tables():
    """n-gram tables over random ids and over text the constraint allows: they propose
    tokens it forbids as well as ones it allows."""
    from specjax.training.ngram_build import build_ngram

    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 100, 200).tolist() for _ in range(20)]
    corpus += [tiny_tokenizer().encode("".join(rng.choice(["ab", "ba"], 3))).ids
               for _ in range(40)]  # text the constraint allows
    return build_ngram(corpus, V, top_k=4, trigram_top_k=2, trigram_buckets=256).tables


@pytest.fixture(scope="module")
def drafts(spelling_model):
    """The draft: the target itself, whose favourite token is the target's unconstrained
    one, which the constraint forbids at most positions (one draft: each compiles its own
    programs)."""
    return {"itself": spelling_model}


@pytest.mark.parametrize("method, options", SPECULATIVE)
def test_every_method_under_a_constraint_equals_ar_greedy_and_coupled(
        spelling_model, drafts, ngram_tables, method, options):
    """Each node's target logits are masked by the automaton's state after it: the
    greedy and coupled outputs are constrained ar's, token for token, with a draft whose
    favourite tokens the constraint forbids (ngram: no draft; staged and ngram with
    n-gram tables that propose forbidden tokens too)."""
    import specjax

    constraint = Regex(BOUNDED[4])
    if method in ("staged", "ngram"):
        options = dict(options, ngram=ngram_tables)
    for index, (which, draft) in enumerate(drafts.items()):
        if method != "ngram":
            options = dict(options, draft=draft)
        for temperature, seed in ((0.0, 0), (1.0, 5 + index), (1.0, 9 + index)):
            prompt = np.random.default_rng(seed + 20).integers(0, 100, 5).tolist()
            kwargs = dict(constraint=constraint, max_new_tokens=12, temperature=temperature,
                          seed=seed, stop=[eos_id()])
            got = specjax.generate(spelling_model, prompt, method=method, **options, **kwargs)
            expected = specjax.generate(spelling_model, prompt, method="ar", jump_forward=0,
                                        **kwargs)
            assert got.tokens == expected.tokens, (which, temperature)
            assert re.fullmatch(BOUNDED[4], spelled(got.tokens[:-1]).decode())
            assert got.stats["constraint"]["states"] == expected.stats["constraint"]["states"]


@pytest.mark.parametrize("wrong", [None, pytest.param("unfiltered", marks=pytest.mark.slow)])
def test_staged_proposals_keep_what_the_constraint_allows(spelling_model, ngram_tables,
                                                          monkeypatch, programs_aside, wrong):
    """``staged`` under a constraint: its stage-2 proposals keep what the automaton allows,
    forced tokens first (the draft's ranking is masked too), so a forced run is the spine:
    3.7 tokens per target pass on a mostly forced pattern (the default CPU options and the
    program of the SPECULATIVE case), with ar's tokens. WRONG on purpose (slow tier: its own
    compile, ~10 s here): the proposals left unfiltered, 1.8 (the masked draft's children
    still propose forced tokens, one level deep)."""
    import specjax
    from specjax.methods import staged

    kwargs = dict(constraint=Regex("(xyz){3}[0-9]"), max_new_tokens=12, stop=[eos_id()])
    ar = specjax.generate(spelling_model, DIST_PROMPT, method="ar", jump_forward=0,
                          **kwargs)
    if wrong:
        programs_aside()
        original = staged.propose
        monkeypatch.setattr(staged, "propose", lambda *args, automaton=None, **kw: original(
            *args, **kw))
    out = specjax.generate(spelling_model, DIST_PROMPT, method="staged", draft=spelling_model,
                           ngram=ngram_tables, use_lookup=False, **kwargs)
    assert out.tokens == ar.tokens and len(out.tokens) == 11
    accepted = out.stats["mean_accepted"]
    assert (accepted < 2.0) if wrong else (accepted >= 3.5), accepted


def test_the_draft_proposes_only_what_the_constraint_allows(spelling_model, monkeypatch,
                                                            programs_aside):
    """With the target as its own draft at temperature 0, the draft's masked choice is the
    target's: under a 10-digit regex nearly every drafted token is accepted (under a
    20-digit one, 4.2 tokens per target pass for spec and 3.5 for tree, measured). A draft
    left unfiltered proposes the target's unconstrained favourite, forbidden, at every
    position: one token per pass."""
    import specjax
    from specjax.methods import speculative

    kwargs = dict(constraint=Regex("[0-9]{10}"), max_new_tokens=12, stop=[eos_id()])
    ar = specjax.generate(spelling_model, DIST_PROMPT, method="ar", jump_forward=0,
                          **kwargs)
    out = specjax.generate(spelling_model, DIST_PROMPT, method="spec", draft=spelling_model,
                           **kwargs)
    assert out.tokens == ar.tokens and len(out.tokens) == 11
    assert out.stats["mean_accepted"] >= 2.5, out.stats["mean_accepted"]
    programs_aside()  # WRONG on purpose below: the draft not filtered
    monkeypatch.setattr(speculative.Speculative, "_filters_draft", property(lambda _: False))
    out = specjax.generate(spelling_model, DIST_PROMPT, method="spec", draft=spelling_model,
                           **kwargs)
    assert out.tokens == ar.tokens and out.stats["mean_accepted"] < 1.5


def test_the_ngram_proposal_keeps_what_the_constraint_allows_forced_first(
        spelling_model, ngram_tables, monkeypatch, programs_aside):
    """``ngram`` under a constraint: each proposal level keeps the tokens the automaton
    allows after the spine above it, a forced token (a state allowing one token only)
    first, so a forced run is committed a whole proposal depth per target pass
    (jump-forward), with ar's tokens. Tables fitted to other text, left unfiltered, propose
    forbidden tokens: one token per pass."""
    import specjax
    from specjax.methods import staged

    kwargs = dict(constraint=Regex("(xyz){3}[0-9]"), max_new_tokens=12, stop=[eos_id()])
    ar = specjax.generate(spelling_model, DIST_PROMPT, method="ar", jump_forward=0,
                          **kwargs)
    ngram = dict(method="ngram", ngram=ngram_tables, use_lookup=False)  # tables alone
    out = specjax.generate(spelling_model, DIST_PROMPT, **ngram, **kwargs)
    assert out.tokens == ar.tokens and len(out.tokens) == 11
    assert out.stats["mean_accepted"] >= 3.0, out.stats["mean_accepted"]
    programs_aside()  # WRONG on purpose below: the proposal not filtered
    original = staged.propose
    monkeypatch.setattr(staged, "propose", lambda *args, automaton=None, **kw: original(
        *args, **kw))
    out = specjax.generate(spelling_model, DIST_PROMPT, **ngram, **kwargs)
    assert out.tokens == ar.tokens and out.stats["mean_accepted"] < 1.5


def test_the_proposal_spine_as_one_loop_equals_its_unrolled_levels(ngram_tables):
    """On the CPU the proposal's spine runs as one loop body; on a GPU or TPU its levels are
    unrolled. Under a constraint (every level ranked by what the automaton allows after the
    spine above it, a forced token first) both give the same proposal, from every state
    of an automaton with forced runs and from random histories. (Unconstrained, both are
    checked against a reference in tests/test_ngram.py.)"""
    from test_ngram import unrolled_spine

    from specjax.drafters import propose

    automaton = tables_of(Regex(JUMP_PATTERN))
    shape = (3, 2, 1, 1, 1, 1)
    loop = jax.jit(propose, static_argnames=("shape", "use_lookup"))
    unrolled = jax.jit(unrolled_spine(propose), static_argnames=("shape", "use_lookup"))
    rng = np.random.default_rng(7)
    states = np.flatnonzero(np.asarray(automaton.next_state).max(axis=1) >= 0)
    assert len(states) > 5 and (np.asarray(automaton.forced_token)[states] >= 0).any()
    allowed_text = tiny_tokenizer().encode("3xyzxyz4xyzxyz5xyzxyz6xyzxyz7").ids
    for state in states:  # random ids, or text the automaton allows (lookup finds it)
        history = np.resize(rng.permutation(allowed_text) if state % 2 else
                            rng.integers(0, 100, 24), 24).astype(np.int32)
        length = int(rng.integers(3, 25))
        for use_lookup in (True, False):
            got = [jax.device_get(program(ngram_tables, history, length, shape=shape,
                                          use_lookup=use_lookup,
                                          automaton=(automaton, np.int32(state))))
                   for program in (loop, unrolled)]
            for field in got[0]._fields:
                np.testing.assert_array_equal(getattr(got[0], field), getattr(got[1], field),
                                              err_msg=f"{field}, state {state}")


def test_a_chain_drafted_in_one_loop_under_a_constraint_is_its_unrolled_levels(
        spelling_model):
    """``spec``'s drafted levels as one loop body (the CPU) and unrolled (a GPU or TPU)
    under a constraint: every level's logits masked by its node's state, the state
    advanced by the level's token in the loop's carry. From every live state of an
    automaton with forced runs, coupled: the same tokens, ``log q~`` and scratch slots.
    (Unconstrained, each rule: tests/test_speculative.py.)"""
    from test_speculative import assert_same_chains, drafted_chains

    automaton = tables_of(Regex(JUMP_PATTERN))
    states = np.flatnonzero(np.asarray(automaton.next_state).max(axis=1) >= 0)
    assert len(states) > 5 and (np.asarray(automaton.forced_token)[states] >= 0).any()
    prompt = tiny_tokenizer().encode("3xyzxyz4xy").ids
    cases = [(int(seed), (automaton, jnp.int32(state))) for seed, state in enumerate(states)]
    looped, unrolled = drafted_chains(spelling_model, spelling_model, prompt, "coupled", 1.0,
                                      cases=cases)
    assert_same_chains(looped, unrolled, "coupled")
    # Inside the loop too, a node in a forced state drafts the forced token next.
    forced = np.asarray(automaton.forced_token)
    checked = 0
    for chain, (_, (_, state)) in zip(looped, cases):
        state = int(_advance(automaton, state, jnp.int32(chain[0][1])))
        for token in chain[0][2:]:
            if state < 0:
                break
            if forced[state] >= 0:
                assert token == forced[state], chain[0]
                checked += 1
            state = int(_advance(automaton, jnp.int32(state), jnp.int32(token)))
    assert checked >= 5, checked


def test_a_masked_draft_proposes_the_forced_token_first():
    """Jump-forward in ``spec`` and ``tree`` needs no code of its own: the draft's logits
    are masked by its node's state, so in a forced state its best child, by every rule's
    ranking and at every temperature, is the forced token, and no other child is finite
    (a dynamic tree drops them). Unmasked, the draft's own favourite comes first."""
    from specjax.methods.common import rank_children
    from specjax.sampling import make_sampling_params

    tables = tables_of(Regex(JUMP_PATTERN))
    forced = np.asarray(tables.forced_token)
    states = np.flatnonzero(forced >= 0)
    logits = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (len(states), V))
    positions = jnp.arange(len(states), dtype=jnp.int32) + 9
    fresh = dict(sample_key=jax.random.PRNGKey(1))  # a sample without replacement
    for temperature, rule, how in ((0.0, "greedy", {}), (1.0, "coupled", {}),
                                   (1.0, "match", {}), (1.0, "rejection", fresh),
                                   (1.0, "coupled", dict(argmax=True))):
        sampling = make_sampling_params(temperature, seed=3, static_rule=True)
        ranked = np.asarray(rank_children(mask_logits(tables, jnp.asarray(states), logits),
                                          sampling, positions, rule, **how))
        assert (ranked.argmax(-1) == forced[states]).all(), (rule, how)
        assert (np.isfinite(ranked).sum(-1) == 1).all(), (rule, how)
        unmasked = np.asarray(rank_children(logits, sampling, positions, rule, **how))
        assert (unmasked.argmax(-1) != forced[states]).sum() >= len(states) - 2, (rule, how)


def test_the_same_test_catches_an_unmasked_verify_pass(spelling_model, drafts, monkeypatch,
                                                      programs_aside):
    """WRONG on purpose: the verify pass decides on the target's unmasked logits. The
    drafted tokens the constraint forbids are then accepted where the target likes them."""
    import specjax
    from specjax.methods import common

    # The programs compiled with the right mask must not be reused, nor the wrong ones kept.
    programs_aside()
    monkeypatch.setattr(common, "mask_logits", lambda tables, states, logits: logits)
    differ = 0
    for seed in range(3):
        prompt = np.random.default_rng(seed + 20).integers(0, 100, 5).tolist()
        kwargs = dict(constraint=Regex(BOUNDED[4]), max_new_tokens=12, stop=[eos_id()])
        got = specjax.generate(spelling_model, prompt, method="spec",
                               draft=drafts["itself"], **kwargs)
        differ += got.tokens != specjax.generate(spelling_model, prompt, method="ar",
                                                 jump_forward=0, **kwargs).tokens
    assert differ >= 2


# ----------------------------------------------------------------------------- sampled


DIST_SEEDS = 1024
DIST_PROMPT = [5, 17, 42, 8, 61]
DIST_PATTERN = BOUNDED[4]


def masked_log_probs(model, tokens, state) -> np.ndarray:
    """log p~ of the token after ``tokens`` at temperature 1, masked by the automaton's
    ``state`` (the distribution ar samples from under the constraint)."""
    from specjax import models

    logits = models.forward(model.params, model.config, jnp.asarray(tokens, jnp.int32),
                            jnp.arange(len(tokens), dtype=jnp.int32))[0][-1]
    tables = tables_of(Regex(DIST_PATTERN))
    masked = np.where(np.asarray(_allowed(tables, jnp.int32(state))), np.asarray(logits,
                                                                                np.float64),
                      -np.inf)
    return masked - np.logaddexp.reduce(masked)


def second_token_marginal(model) -> np.ndarray:
    tables = tables_of(Regex(DIST_PATTERN))
    first = np.exp(masked_log_probs(model, DIST_PROMPT, INITIAL_STATE))
    marginal = np.zeros(V)
    for x1 in np.flatnonzero(first):
        state = int(_advance(tables, jnp.int32(INITIAL_STATE), jnp.int32(x1)))
        marginal += first[x1] * np.exp(masked_log_probs(model, DIST_PROMPT + [int(x1)], state))
    return marginal


def second_tokens(model, draft, **options) -> np.ndarray:
    """The second token of DIST_SEEDS constrained generations, one seed each (batches of 64
    rows: each row is its own batch-1 call, tests/test_batch.py)."""
    import specjax
    from specjax import BatchOptions

    outs = specjax.generate(model, [DIST_PROMPT] * DIST_SEEDS, max_new_tokens=2,
                            seed=list(range(DIST_SEEDS)), stop=[eos_id()], temperature=1.0,
                            constraint=Regex(DIST_PATTERN), draft=draft,
                            batch=BatchOptions(size=64, compact_rows=False), **options)
    return np.bincount([out.tokens[1] for out in outs if len(out.tokens) > 1], minlength=V)


def pearson(counts, probs) -> float:
    """Pearson's statistic over the cells of expected count >= 5 (the rest pooled), and
    its degrees of freedom; a count outside the support is an infinite statistic."""
    from test_verify import chi2_threshold

    support = probs > 0
    if counts[~support].sum():
        return float("inf"), chi2_threshold(1)
    expected = counts.sum() * probs / probs.sum()
    big = support & (expected >= 5)
    cells = [(counts[big], expected[big]),
             (np.array([counts[support & ~big].sum()]), np.array([expected[support & ~big].sum()]))]
    stat = sum(float(((c - e) ** 2 / np.where(e > 0, e, 1)).sum()) for c, e in cells)
    return stat, chi2_threshold(int(big.sum()))


SAMPLED = [("tree", dict(verify="rejection", tree_budget=6, draft_depth=2, draft_width=3)),
           pytest.param("spec", dict(verify="match", draft_depth=2), marks=pytest.mark.slow)]


@pytest.mark.parametrize("method, options", SAMPLED)
def test_match_and_rejection_sample_the_masked_target_distribution(spelling_model, method,
                                                                   options):
    """The second token (the first a verify step decides) of constrained generations
    follows the target's masked distribution, marginalised over the first: a chi-square
    test. The draft is the target itself, so most drafted tokens are forbidden ones."""
    counts = second_tokens(spelling_model, spelling_model, method=method, **options)
    statistic, threshold = pearson(counts, second_token_marginal(spelling_model))
    assert statistic < threshold, (method, statistic, threshold)


def test_the_same_test_catches_rejection_on_unmasked_logits(spelling_model, monkeypatch,
                                                            programs_aside):
    """WRONG on purpose: rejection sampling decides on the target's unmasked logits."""
    from specjax.methods import common

    programs_aside()
    monkeypatch.setattr(common, "mask_logits", lambda tables, states, logits: logits)
    method, options = SAMPLED[0]
    counts = second_tokens(spelling_model, spelling_model, method=method, **options)
    statistic, threshold = pearson(counts, second_token_marginal(spelling_model))
    assert statistic > threshold, (statistic, threshold)


def test_the_suite_runs_every_system_under_the_constraint(spelling_model, tmp_path, capsys,
                                                          monkeypatch):
    """``specjax bench --regex``: every system decodes under the constraint (outputs that
    match it and equal ar's, checked by the suite), stored in the result's config; peers
    are refused with it, before anything loads."""
    from specjax import cli

    from conftest import serve_models

    serve_models(monkeypatch, {"tiny": spelling_model}, ["ab", "ba ab"])
    out = tmp_path / "suite.json"
    argv = ["bench", "-m", "tiny", "--draft", "tiny", "--methods", "ar,spec", "--regex",
            BOUNDED[4], "--max-new-tokens", "8", "--warmup-tokens", "2",
            "--no-pass-breakdown", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["constraint"] == {"pattern": BOUNDED[4]}
    assert result["all_outputs_match"]
    rows = [r for r in result["rows"] if r.get("prompt") is not None]
    assert {r["system"] for r in rows} == {"ar", "spec"} and all(r["status"] == "ok"
                                                                  for r in rows)
    # Under the constraint each output ends at its EOS, before the 8-token budget that
    # an unconstrained run (the suite's stop=[]) fills.
    assert all(r["new_tokens"] < 8 for r in rows), [r["new_tokens"] for r in rows]
    capsys.readouterr()
    assert cli.main([*argv[:-2], "--peers", "hf"]) == 2
    assert "drop --peers" in capsys.readouterr().err
