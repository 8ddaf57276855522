"""Structured output: a regular expression or a JSON schema as a token automaton on the device.

A constraint (:class:`Regex`, :class:`JsonSchema`) is a small frozen, hashable value. Against
a tokenizer it becomes a token-level automaton, built by the ``outlines-core`` package (the
optional ``constraints`` extra), and then a set of device tables
(:class:`ConstraintTables`) that two jit-able gathers read:

* :func:`mask_logits` -- the logits of each row with every token its state forbids at
  ``-inf``;
* :func:`advance` -- each row's next state after a token.

States. A state is an ``int32``: :data:`DEAD_STATE` (0) is entered by a forbidden token
and allows only the end of sequence (it is never reached when tokens come from masked
logits); :data:`INITIAL_STATE` (1) starts every constrained row; :data:`FREE_STATE` (-1)
marks a row without a constraint (nothing masked, it stays -1), so rows with and without a
constraint share one batch. The end-of-sequence tokens are allowed only in accepting states,
where they lead back to the same state.

Tables, with static shapes (V = the model's vocabulary, the width of its logits):

* ``token_class`` int32 [V]: tokens that every state treats alike (same next state, or
  forbidden, everywhere) share a class; most of a 49k vocabulary falls in a few hundred
  classes for a typical JSON schema;
* ``next_state`` int16 [S, C]: the next state per (state, class), -1 where forbidden;
* ``forced_token`` int32 [S]: the one token a state allows, or -1 (jump-forward);
* ``accepting`` bool [S].

S and C are padded to powers of two (:func:`bucket`; at least 16): the tables are traced
values, so every constraint in the same (S, C) bucket reuses a compiled program.

Memory: per state 2 * C + 5 bytes (a ``next_state`` row, ``forced_token``, ``accepting``);
once per constraint 4 * V bytes (``token_class``). On a 49,152-token vocabulary that is
192 KiB once, and per state 517 bytes at C = 256, 4 KiB at C = 2,048, and 96 KiB at the
bound C = V (a dense int32 [S, V] next-state table would take 192 KiB per state). Rows past
the automaton's states (padding) act as the dead state. Limits: :data:`MAX_STATES` states
(int16 indices) and :data:`MAX_TABLE_BYTES` for ``next_state``; a constraint over either
is refused.

The table build is cached on disk (:func:`build_tables`), keyed by the constraint, the
tokenizer's vocabulary and the ``outlines-core`` version, under
``$XDG_CACHE_HOME/specjax/constraints`` (beside the compiled programs of
:mod:`specjax.compilation_cache`); each file is written whole (a temporary file, then a
rename).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InvalidArgumentError

FREE_STATE = -1
DEAD_STATE = 0
INITIAL_STATE = 1
MAX_STATES = 16384  # states of one automaton (the dead state included); int16 indices
MAX_TABLE_BYTES = 256 << 20  # the padded next_state table of one constraint
MIN_TABLE_BUCKET = 16
_FORMAT_VERSION = 1  # of the cache files; a change here invalidates every entry
_BYTE_LEVEL_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTINEL = "\U0010fffd"  # a private-use character, spelled only by the sentinel token


# ----------------------------------------------------------------------------- constraints


@dataclasses.dataclass(frozen=True)
class Regex:
    """Output that matches a regular expression as a whole (Rust ``regex`` syntax: no
    look-around, no back-references).

    Attributes:
      pattern: the regular expression.
    """

    pattern: str

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise InvalidArgumentError(f"Regex: the pattern must be a non-empty string, "
                                       f"got {self.pattern!r:.60}")
        if _has_start_anchor(self.pattern):
            raise InvalidArgumentError(f"Regex {self.pattern!r:.60}: the output matches the "
                                       "whole pattern; remove the ^ or \\A anchor")

    def to_regex(self) -> str:
        """The regular expression the automaton is built from."""
        return self.pattern

    def describe(self) -> str:
        """A short name for messages."""
        return f"regex {self.pattern!r:.80}"


@dataclasses.dataclass(frozen=True)
class JsonSchema:
    """Output that is a JSON document valid under a JSON schema (the subset
    ``outlines-core`` turns into a regular expression: types, properties, required, enum,
    const, arrays, anyOf/oneOf/allOf, $ref, string formats and lengths).

    Attributes:
      schema: the schema, as a dict or a JSON string; kept as compact JSON text, so that
        equal schemas are equal constraints (the order of ``properties`` is the order of the
        document's keys, so it counts).
    """

    schema: Any

    def __post_init__(self):
        schema = self.schema
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise InvalidArgumentError(f"JsonSchema: the schema is not JSON "
                                           f"({error})") from None
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"JsonSchema: the schema must be a JSON object, "
                                       f"got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"))  # key order is output order
        except (TypeError, ValueError) as error:
            raise InvalidArgumentError(f"JsonSchema: the schema is not JSON ({error})") from None
        object.__setattr__(self, "schema", text)

    def to_regex(self) -> str:
        """The regular expression of the schema's JSON documents (``outlines-core``)."""
        json_schema = _outlines_core().json_schema
        try:
            import jsonschema
        except ImportError:  # optional: outlines-core still refuses what it cannot read
            jsonschema = None
        schema = json.loads(self.schema)
        if jsonschema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as error:
                raise InvalidArgumentError(f"JsonSchema: not a valid schema "
                                           f"({_one_line(error.message)})") from None
        try:
            return json_schema.build_regex_from_schema(self.schema)
        except (ValueError, TypeError) as error:
            raise InvalidArgumentError(f"JsonSchema: unsupported schema "
                                       f"({_one_line(error)})") from None

    def describe(self) -> str:
        """A short name for messages."""
        return f"JSON schema {self.schema:.80}"


Constraint = Regex | JsonSchema


def _has_start_anchor(pattern: str) -> bool:
    """Whether ``pattern`` has a ``^`` or ``\\A`` outside a character class."""
    depth, escaped = 0, False
    for position, char in enumerate(pattern):
        if escaped:
            escaped = False
            if char == "A" and depth == 0:
                return True
        elif char == "\\":
            escaped = True
        elif char == "[":
            depth += 1
        elif char == "]" and depth and pattern[position - 1] != "[":
            depth -= 1
        elif char == "^" and depth == 0:
            return True
    return False


def check_constraint(constraint: Constraint) -> None:
    """Refuses a bad constraint before any model or tokenizer is loaded: a regex the
    automaton builder rejects, a bad schema, or an automaton over :data:`MAX_STATES` (its
    byte-level automaton, which has at least as many states as any token-level one).

    Args:
      constraint: a :class:`Regex` or :class:`JsonSchema`.

    Raises:
      InvalidArgumentError: one line naming the problem.
    """
    check_constraint_type(constraint)
    byte_tokens = [bytes([value]) for value in range(256)] + [None]  # + an EOS, id 256
    index = _build_index(constraint, byte_tokens, eos_token_ids=(256,))
    start = _start_state(index, byte_tokens)
    _check_states(constraint, len(_reachable_states(start, index.get_transitions(), 257)) + 1)


# ----------------------------------------------------------------------------- vocabulary


def _bytes_to_unicode() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2): printable character -> the byte it stands for."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for value in range(256):
        if value not in printable:
            printable.append(value)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): value for value, code in zip(printable, codes)}


def _decoder_kinds(backend) -> set[str]:
    """The ``type`` names of a tokenizers backend's decoder (a Sequence flattened)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds, pending = set(), [decoder]
    while pending:
        item = pending.pop()
        kinds.add(item.get("type"))
        pending.extend(item.get("decoders") or [])
    return kinds


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for in generated text; ``None`` for special tokens
    (BOS, EOS, padding, chat markers) and ids past the tokenizer (a padded model vocabulary).

    Handles byte-level BPE (GPT-2, Llama 3, SmolLM2) and SentencePiece-style vocabularies
    (``▁`` for a space, ``<0xAB>`` byte pieces).

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer.
      vocab_size: the model's vocabulary size (the width of its logits).

    Returns:
      A list of ``vocab_size`` entries.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    kinds = _decoder_kinds(backend)
    byte_level = "ByteLevel" in kinds
    byte_fallback = "ByteFallback" in kinds
    alphabet = _bytes_to_unicode() if byte_level else {}
    added = backend.get_added_tokens_decoder()
    result: list[bytes | None] = [None] * vocab_size
    for text, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id >= vocab_size:
            continue
        if token_id in added:
            result[token_id] = None if added[token_id].special else text.encode()
        elif byte_level and all(char in alphabet for char in text):
            result[token_id] = bytes(alphabet[char] for char in text)
        elif byte_fallback and _BYTE_LEVEL_PIECE.fullmatch(text):
            result[token_id] = bytes([int(text[3:5], 16)])
        else:
            result[token_id] = text.replace("\u2581", " ").encode()
    return [None if piece == b"" else piece for piece in result]


def vocabulary_hash(tokens: Sequence[bytes | None], eos_token_ids: Sequence[int]) -> str:
    """A hex digest of a vocabulary (the bytes of every id) and its end-of-sequence ids."""
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(set(int(i) for i in eos_token_ids))).encode())
    for piece in tokens:
        digest.update(b"\xff" if piece is None else len(piece).to_bytes(4, "little") + piece)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- the build


def _outlines_core():
    try:
        import outlines_core
    except ImportError:
        raise InvalidArgumentError("constraints need the outlines-core package: "
                                   "pip install 'specjax[constraints]'") from None
    return outlines_core


def _one_line(error) -> str:
    return " ".join(str(error).split())[:300]


def _build_index(constraint: Constraint, tokens: Sequence[bytes | None],
                 eos_token_ids: Sequence[int]):
    """The ``outlines_core.Index`` of ``constraint`` over ``tokens`` (id -> bytes); its EOS
    is the first of ``eos_token_ids``, and none of them is spelled by bytes."""
    outlines_core = _outlines_core()
    # outlines-core builds a search DFA: a final loop over several bytes loses its back edge
    # unless the end of text is anchored ("(ab)+" would accept only "ab"; "(ab)+\z" is
    # right), and an anchored pattern that matches the empty text has no start state. So the
    # pattern is "SENTINEL(?:P)\z" and the automaton starts after the sentinel, which a token
    # of its own (id _sentinel_id) spells. tests/test_constraints.py checks the automaton
    # against Python's re.fullmatch.
    pattern = f"{_SENTINEL}(?:{constraint.to_regex()})\\z"
    by_bytes: dict[bytes, list[int]] = {_SENTINEL.encode(): [_sentinel_id(tokens)]}
    for token_id, piece in enumerate(tokens):
        if piece is not None and token_id not in eos_token_ids:
            by_bytes.setdefault(piece, []).append(token_id)
    try:
        vocabulary = outlines_core.Vocabulary(int(eos_token_ids[0]), by_bytes)
        index = outlines_core.Index(pattern, vocabulary)
    except ValueError as error:
        reason = _describe_failure(constraint, error)
        raise InvalidArgumentError(f"{constraint.describe()}: {reason}") from None
    return index


def _sentinel_id(tokens: Sequence[bytes | None]) -> int:
    """The id of the sentinel token: one past the vocabulary (no model emits it)."""
    return len(tokens)


def _start_state(index, tokens: Sequence[bytes | None]) -> int:
    """The index state after the sentinel: the automaton's initial state."""
    return index.get_next_state(index.get_initial_state(), _sentinel_id(tokens))


def _check_states(constraint: Constraint, states: int) -> None:
    """Refuses an automaton of more than MAX_STATES states (``states`` counts the dead one)."""
    if states > MAX_STATES:
        raise InvalidArgumentError(f"{constraint.describe()}: its automaton has {states} states, "
                                   f"over the limit of {MAX_STATES}; simplify the constraint")


def _describe_failure(constraint: Constraint, error: ValueError) -> str:
    """Why outlines-core refused a pattern, in one line (its own message says little for a
    syntax error; Python's parser names the position when it fails too)."""
    message = _one_line(error)
    if "DFA" in message and isinstance(constraint, Regex):
        try:
            re.compile(constraint.pattern)
        except re.error as syntax:
            return f"invalid regular expression ({syntax})"
        return (f"invalid regular expression for the automaton builder ({message}; "
                "look-around and back-references are not supported)")
    if "incompatible" in message:
        return f"the vocabulary cannot spell it ({message})"
    return message


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConstraintTables:
    """The device tables of one constraint (all traced; shapes in the module docstring)."""

    token_class: Any  # int32 [V]
    next_state: Any  # int16 [S, C], -1 where the class is forbidden
    forced_token: Any  # int32 [S], the one allowed token or -1
    accepting: Any  # bool [S]


@dataclasses.dataclass(frozen=True)
class TableInfo:
    """What one table build made, for reports: counts before padding, the padded sizes, the
    device bytes, the build time and whether the disk cache answered."""

    num_states: int
    num_classes: int
    state_bucket: int
    class_bucket: int
    table_bytes: int
    seconds: float
    from_cache: bool
    cache_path: str | None


def bucket(n: int) -> int:
    """Smallest power of two >= max(n, MIN_TABLE_BUCKET)."""
    return max(MIN_TABLE_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def _reachable_states(start: int, transitions: dict, vocab_size: int) -> list[int]:
    """The index's states reachable from ``start`` by tokens under ``vocab_size`` (not the
    sentinel), in breadth-first order."""
    order, seen = [start], {start}
    for state in order:
        for token, following in transitions.get(state, {}).items():
            if token < vocab_size and following not in seen:
                seen.add(following)
                order.append(following)
    return order


def _tables_from_index(constraint: Constraint, index, start: int, vocab_size: int,
                       eos_token_ids: Sequence[int]) -> dict:
    """Numpy tables (padded) from an ``outlines_core.Index`` and its ``start`` state; the
    columns of tokens that every state treats alike are merged into classes."""
    transitions = index.get_transitions()  # {state: {token: next state}}
    order = _reachable_states(start, transitions, vocab_size)
    number = {state: row for row, state in enumerate(order, start=INITIAL_STATE)}
    num_states = len(order) + 1
    _check_states(constraint, num_states)
    rows = []  # per table row: (token ids int64, next rows int64)
    for state in order:
        edges = transitions.get(state, {})
        tokens = np.fromiter(edges.keys(), np.int64, len(edges))
        following = np.fromiter((number[s] for s in edges.values()), np.int64, len(edges))
        keep = tokens < vocab_size
        tokens, following = tokens[keep], following[keep]
        if index.is_final_state(state):
            extra = np.array([i for i in eos_token_ids if i not in edges], np.int64)
            tokens = np.concatenate([tokens, extra])
            following = np.concatenate([following, np.full(len(extra), number[state])])
        else:  # outlines-core allows its EOS in final states only; the others follow suit
            keep = ~np.isin(tokens, eos_token_ids)
            tokens, following = tokens[keep], following[keep]
        rows.append((tokens, following))
    dead_tokens = np.asarray(sorted(set(eos_token_ids)), np.int64)
    rows.insert(0, (dead_tokens, np.full(len(dead_tokens), DEAD_STATE)))
    # A token's signature: two random projections of its column (next state + 1, 0 where
    # forbidden). Equal columns give equal signatures; the check below proves the converse.
    generator = np.random.default_rng(0)
    weights = generator.integers(1, 2**63, size=(2, num_states), dtype=np.uint64) | 1
    signature = np.zeros((2, vocab_size), np.uint64)
    for row, (tokens, following) in enumerate(rows):
        signature[:, tokens] += weights[:, row:row + 1] * (following + 1).astype(np.uint64)
    _, representative, token_class = np.unique(signature.T, axis=0, return_index=True,
                                               return_inverse=True)
    token_class = token_class.reshape(-1)
    num_classes = len(representative)
    state_bucket, class_bucket = bucket(num_states), bucket(num_classes)
    table_bytes = 2 * state_bucket * class_bucket
    if table_bytes > MAX_TABLE_BYTES:
        raise InvalidArgumentError(
            f"{constraint.describe()}: its table ({num_states} states x {num_classes} classes) "
            f"needs {table_bytes >> 20} MiB, over the limit of {MAX_TABLE_BYTES >> 20} MiB; "
            "simplify the constraint")
    next_state = np.full((state_bucket, class_bucket), -1, np.int16)
    next_state[num_states:, token_class[dead_tokens]] = DEAD_STATE  # padding acts dead
    class_size = np.bincount(token_class, minlength=num_classes)
    forced = np.full(state_bucket, -1, np.int32)
    accepting = np.zeros(state_bucket, bool)
    for row, (tokens, following) in enumerate(rows):
        next_state[row, token_class[tokens]] = following
        allowed = np.flatnonzero(next_state[row, :num_classes] >= 0)
        # Exactness of the classes: every listed edge is kept, and nothing else is allowed.
        if (not np.array_equal(next_state[row, token_class[tokens]], following)
                or class_size[allowed].sum() != len(tokens)):
            raise RuntimeError("constraint tables: token classes merged unequal columns")
        if len(tokens) == 1:
            forced[row] = tokens[0]
        accepting[row] = row != DEAD_STATE and index.is_final_state(order[row - 1])
    return {"token_class": token_class.astype(np.int32), "next_state": next_state,
            "forced_token": forced, "accepting": accepting,
            "num_states": np.int64(num_states), "num_classes": np.int64(num_classes)}


def default_cache_dir(environ=os.environ) -> Path:
    """``$XDG_CACHE_HOME/specjax/constraints`` (``~/.cache/specjax/constraints``)."""
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specjax" / "constraints"


def _cache_key(constraint: Constraint, vocabulary: str, vocab_size: int) -> str:
    import importlib.metadata

    try:
        builder = importlib.metadata.version("outlines-core")
    except importlib.metadata.PackageNotFoundError:
        builder = "unknown"
    text = json.dumps([_FORMAT_VERSION, builder, type(constraint).__name__,
                       dataclasses.astuple(constraint), vocabulary, vocab_size,
                       MAX_STATES, MIN_TABLE_BUCKET])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_cache(path: Path) -> dict | None:
    try:
        with np.load(path) as stored:
            return {name: stored[name] for name in stored.files}
    except (OSError, ValueError, EOFError):  # absent, or unreadable: build again
        return None


def _write_cache(path: Path, arrays: dict) -> None:
    """Writes ``arrays`` to ``path`` whole or not at all (temporary file, then rename); a
    directory that cannot be written is skipped: the cache only saves time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(buffer.getvalue())
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass


def build_tables(constraint: Constraint, tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int], cache_dir: str | os.PathLike | None = None,
                 use_cache: bool = True) -> tuple[ConstraintTables, TableInfo]:
    """The device tables of ``constraint`` for a tokenizer, from the disk cache when a
    build for the same constraint and vocabulary is there.

    Args:
      constraint: a :class:`Regex` or :class:`JsonSchema`.
      tokenizer: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer
        (:func:`token_bytes`).
      vocab_size: V, the width of the model's logits (>= the tokenizer's size).
      eos_token_ids: the tokens that end a sequence (allowed in accepting states only).
      cache_dir: where builds are kept; None: :func:`default_cache_dir`.
      use_cache: False to neither read nor write the cache.

    Returns:
      ``(tables, info)``: :class:`ConstraintTables` of numpy arrays (``jax.device_put``
      them, or pass them to a jitted function), and a :class:`TableInfo`.

    Raises:
      InvalidArgumentError: a bad pattern or schema, an automaton over :data:`MAX_STATES`
        states or tables over :data:`MAX_TABLE_BYTES`, or an end-of-sequence id outside
        the vocabulary.
    """
    check_constraint_type(constraint)
    eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
    if not eos_token_ids or not all(0 <= i < vocab_size for i in eos_token_ids):
        raise InvalidArgumentError(f"eos_token_ids must be one or more ids in [0, {vocab_size}),"
                                   f" got {eos_token_ids}")
    start = time.perf_counter()
    tokens = token_bytes(tokenizer, vocab_size)
    path = None
    if use_cache:
        key = _cache_key(constraint, vocabulary_hash(tokens, eos_token_ids), vocab_size)
        path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.npz"
    arrays = _read_cache(path) if path is not None else None
    from_cache = arrays is not None
    if arrays is None:
        index = _build_index(constraint, tokens, eos_token_ids)
        arrays = _tables_from_index(constraint, index, _start_state(index, tokens), vocab_size,
                                    eos_token_ids)
        if path is not None:
            _write_cache(path, arrays)
    tables = ConstraintTables(token_class=arrays["token_class"], next_state=arrays["next_state"],
                              forced_token=arrays["forced_token"], accepting=arrays["accepting"])
    table_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tables))
    info = TableInfo(num_states=int(arrays["num_states"]),
                     num_classes=int(arrays["num_classes"]),
                     state_bucket=tables.next_state.shape[0],
                     class_bucket=tables.next_state.shape[1], table_bytes=table_bytes,
                     seconds=time.perf_counter() - start, from_cache=from_cache,
                     cache_path=None if path is None else str(path))
    return tables, info


def check_constraint_type(constraint) -> None:
    """Raises InvalidArgumentError unless ``constraint`` is a :class:`Regex` or
    :class:`JsonSchema`."""
    if not isinstance(constraint, (Regex, JsonSchema)):
        raise InvalidArgumentError(f"constraint must be specjax.Regex or specjax.JsonSchema, "
                                   f"got {type(constraint).__name__}")


def add_constraint_arguments(parser) -> None:
    """``--regex PATTERN`` and ``--json-schema FILE`` (one or neither), for ``specjax
    generate`` and ``specjax bench``; :func:`constraint_from_args` reads them."""
    group = parser.add_mutually_exclusive_group()
    default = ("the default method under a constraint: the one measured fastest there, ar "
               "where none beat it or none is timed")
    group.add_argument("--regex", default=None, metavar="PATTERN",
                       help=f"the output matches PATTERN as a whole, then ends (an automaton "
                            f"on the device; {default})")
    group.add_argument("--json-schema", default=None, metavar="FILE",
                       help=f"the output is a JSON document valid under the schema in FILE, "
                            f"then ends ({default})")


def constraint_from_args(args):
    """The constraint of ``--regex`` or ``--json-schema`` (``None`` without either), checked
    before anything loads: a bad pattern or schema, or an automaton over the size limit, is
    a one-line error naming the flag."""
    if getattr(args, "regex", None) is not None:
        flag, make = "--regex", lambda: Regex(args.regex)
    elif getattr(args, "json_schema", None) is not None:
        flag = "--json-schema"
        path = Path(args.json_schema)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"--json-schema {path}: cannot read it "
                                       f"({error.__class__.__name__})") from None
        make = lambda: JsonSchema(text)  # noqa: E731
    else:
        return None
    try:
        constraint = make()
        check_constraint(constraint)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{flag}: {error}") from None
    return constraint


# ----------------------------------------------------------------------------- on the device


def allowed_tokens(tables: ConstraintTables, state: jax.Array) -> jax.Array:
    """Which tokens each state allows.

    Args:
      tables: the constraint's :class:`ConstraintTables`.
      state: int32 [...] states (:data:`FREE_STATE` allows every token).

    Returns:
      bool [..., V].
    """
    state = jnp.asarray(state, jnp.int32)
    rows = jnp.take(tables.next_state, jnp.maximum(state, 0), axis=0)  # [..., C]
    allowed = jnp.take(rows, tables.token_class, axis=-1) >= 0  # [..., V]
    return allowed | (state < 0)[..., None]


def mask_logits(tables: ConstraintTables, state: jax.Array, logits: jax.Array) -> jax.Array:
    """``logits`` with the tokens each row's state forbids at ``-inf``.

    Args:
      tables: the constraint's :class:`ConstraintTables`.
      state: int32 [...] states.
      logits: float [..., V].

    Returns:
      float [..., V], the dtype of ``logits``.
    """
    return jnp.where(allowed_tokens(tables, state), logits, -jnp.inf).astype(logits.dtype)


def advance(tables: ConstraintTables, state: jax.Array, token: jax.Array) -> jax.Array:
    """Each row's state after ``token``: :data:`DEAD_STATE` after a forbidden token,
    :data:`FREE_STATE` stays free.

    Args:
      tables: the constraint's :class:`ConstraintTables`.
      state: int32 [...] states.
      token: int32 [...] tokens (broadcast against ``state``).

    Returns:
      int32 [...] states.
    """
    state = jnp.asarray(state, jnp.int32)
    token_class = jnp.take(tables.token_class, token, mode="clip")
    following = tables.next_state[jnp.maximum(state, 0), token_class].astype(jnp.int32)
    following = jnp.where(following < 0, DEAD_STATE, following)
    return jnp.where(state < 0, FREE_STATE, following)


def forced_token(tables: ConstraintTables, state: jax.Array) -> jax.Array:
    """The one token each state allows (jump-forward), or -1 (also for free rows).

    Args:
      tables: the constraint's :class:`ConstraintTables`.
      state: int32 [...] states.

    Returns:
      int32 [...].
    """
    state = jnp.asarray(state, jnp.int32)
    return jnp.where(state < 0, -1, jnp.take(tables.forced_token, jnp.maximum(state, 0)))


def start_automaton(tables: ConstraintTables, state) -> jax.Array:
    """The automaton's state after the prefill's token (sampled under
    :data:`INITIAL_STATE`): int32 []. ``state``: the decode state after the prefill."""
    return advance(tables, jnp.int32(INITIAL_STATE),
                   jax.lax.dynamic_index_in_dim(state.tokens, state.prompt_length,
                                                keepdims=False))


def tree_states(tables: ConstraintTables, root_state: jax.Array, tokens: jax.Array,
                parents: jax.Array, max_depth: int) -> jax.Array:
    """The automaton's state after each node of a tree: int32 [N].

    Args:
      tables: the constraint's tables.
      root_state: int32 [], the state after the root's token (committed already).
      tokens: int32 [N] the nodes' tokens; ``parents`` int32 [N], -1 at the root.
      max_depth: the tree's depth bound (static): a node at depth d is right after d rounds.
    """
    states = jnp.full(tokens.shape, root_state, jnp.int32)
    for _ in range(max_depth):
        following = advance(tables, states[jnp.maximum(parents, 0)], tokens)
        states = jnp.where(parents >= 0, following, root_state)
    return states
