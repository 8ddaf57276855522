"""What every decoding method shares: the static loop, the state, the method protocol.

* :class:`DecodeLoop` -- the static description of a compiled generation program
  (hashable; it holds the :class:`Method`), sized on the host by :func:`plan_capacity`.
* :class:`DecodeState` -- what every method has (sequence buffer, target cache, lengths,
  sampling settings, stop condition, counters) plus one ``method_state`` pytree that the
  method alone builds (:meth:`Method.init`), reads and writes (:meth:`Method.step`): a
  draft cache, kept target features, a tally, or ``None`` (``ar``).
* :class:`Method` -- the protocol a method implements (:mod:`specjax.methods` holds
  them): a hashable static step object, its own resources (:meth:`Method.build_resources`)
  and its own state.
* :class:`StopCondition` -- what ends a generation on the device besides its budget: stop
  token ids and stop token sequences (:func:`stop_condition` builds one on the host).
* :func:`prefill` -- the target's pass over the prompt, which starts every state.
* The operations drivers and methods apply to a state: :func:`append_tokens`,
  :func:`flag_nonfinite`, and for batches (every field with a leading row axis but the
  shared sampling settings) :func:`state_axes`, :func:`hold_finished`, :func:`take_rows`,
  :func:`without_buffers`, :func:`with_buffers`, :class:`RowBook`. The drivers
  themselves, and the compiled programs, are in :mod:`specjax.decode`.

Sequence bookkeeping: ``state.tokens`` holds prompt + generated tokens, ``state.length``
counts them. The cache always holds K/V for all but the last token: that *pending* token is
the input of the next step (the root of the next speculative tree). Token ``t`` of the
sequence has position id ``t`` and, when sampled, Gumbel noise ``g_t``
(:mod:`specjax.sampling`).

A method state may name, in a class attribute ``buffers``, the fields that only the device
reads (caches, kept features): the host never copies them (:func:`without_buffers`) and,
over several processes, they stay split by row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import models, sharding
# MAX_BATCH_SIZE: the most rows one compiled batch program takes (callers split longer
# lists); defined beside BatchOptions, which checks it.
from specjax.batch_options import MAX_BATCH_SIZE  # noqa: F401
from specjax.cache import KVCache, advance, init_cache
from specjax.config import ModelConfig
from specjax.constraints import INITIAL_STATE, ConstraintTables, mask_logits
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.sampling import SamplingParams, sample_tokens

MIN_BUCKET = 16
MAX_STOP_TOKENS = 8
# Stop sequences: rows of token ids that end a generation where the sequence's last token
# is appended (the token sequences that spell a stop string: specjax.stop_strings).
MAX_STOP_SEQUENCES = 128
MAX_STOP_LENGTH = 4


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def batch_bucket(rows: int) -> int:
    """Rows of the compiled program for a batch of ``rows``: the smallest power of two
    >= ``rows`` (1, 2, 4, 8, ...)."""
    return bucket(rows, minimum=1)


def plan_capacity(prompt_length: int, max_new_tokens: int, scratch: int,
                  config: ModelConfig) -> tuple[int, int]:
    """Host-side check of lengths; returns (prompt_bucket, capacity).

    Raises:
      InvalidArgumentError: the request does not fit the model's positions.
    """
    if prompt_length < 1:
        raise InvalidArgumentError("prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    total = prompt_length + max_new_tokens
    if total > config.max_position_embeddings:
        raise InvalidArgumentError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the model's {config.max_position_embeddings} positions")
    if config.sliding_window is not None and total > config.sliding_window:
        raise InvalidArgumentError(
            f"prompt + max_new_tokens = {total} exceeds the model's sliding window "
            f"({config.sliding_window}), which specjax does not implement")
    prompt_bucket = bucket(prompt_length)
    # The sequence buffer takes up to `scratch` tokens past max_length in one step.
    capacity = bucket(max(prompt_bucket, total + scratch), minimum=128)
    return prompt_bucket, capacity


class Method(Protocol):
    """A decoding method: a hashable static object (it sits in :class:`DecodeLoop`).

    ``init`` runs once after the target prefill (e.g. the draft's prefill) and builds the
    method's own state (``DecodeState.method_state``); ``step`` runs one target pass and
    appends at least one token. Both are traced inside one program.
    """

    name: str
    # Whether the prefill keeps the target's features for the method (``init`` then gets
    # them), and which target blocks' outputs they are (``()``: the final-normed hidden
    # states).
    uses_features: bool
    feature_layers: tuple[int, ...]

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write."""

    def build_resources(self, draft_params=None, tables=None, constraint=None) -> Any:
        """The traced arrays the method decodes with besides the target (a pytree passed
        to every ``init`` and ``step``; ``None`` where it takes none), from the draft's
        parameters, the stage-2 n-gram tables and the constraint's tables it was given."""

    def constraint_of(self, resources) -> Any:
        """The constraint's tables in ``resources`` (the prefill samples under them), or
        ``None`` for a method decoding without one."""

    def init(self, params, loop: "DecodeLoop", state: "DecodeState", resources,
             prompt_features) -> "DecodeState":
        """``state`` after the target prefill, with the method's state. ``prompt_features``:
        float [P, F], the target's features over the padded prompt when ``uses_features``,
        else ``None``."""

    def step(self, params, loop: "DecodeLoop", state: "DecodeState",
             resources) -> "DecodeState": ...


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Static description of a compiled generation program (hashable).

    Attributes:
      config: target model config.
      capacity: S, cache slots and sequence-buffer length.
      prompt_bucket: P, padded prompt length.
      kernels: the :class:`~specjax.kernel_options.KernelOptions` the program is built
        with (attention implementation, kernel backends, sampling rules, compiler
        options); the methods pass it to the model functions as ``attn_impl=``.
      method: the :class:`Method` (``specjax.methods.build`` makes it from its options;
        ``ar`` is :class:`specjax.methods.ar.Autoregressive`); ``capacity`` must hold the
        longest sequence plus its ``scratch``.
    """

    config: ModelConfig
    capacity: int
    prompt_bucket: int
    kernels: KernelOptions = KernelOptions()
    method: Method = None

    def __post_init__(self):
        if self.method is None:
            raise InvalidArgumentError(
                "DecodeLoop needs a method: build one with specjax.methods.build(options) "
                "(specjax.methods.ar.Autoregressive() for ar)")
        if not isinstance(self.kernels, KernelOptions):
            raise InvalidArgumentError(f"DecodeLoop.kernels must be a KernelOptions, got "
                                       f"{self.kernels!r}")


@struct.dataclass
class StopCondition:
    """What ends a generation on the device besides ``max_new_tokens`` (all traced: other
    stops never recompile). A batch's has a leading [B] axis on every field.

    A generation ends at the first appended token that is a stop token, or that completes
    a stop sequence: the last ``lengths[i]`` generated tokens (never prompt tokens) equal
    the last ``lengths[i]`` entries of ``sequences[i]``. The token that ends it is kept.
    """

    tokens: jax.Array  # int32 [MAX_STOP_TOKENS], -1 padded
    # int32 [MAX_STOP_SEQUENCES, MAX_STOP_LENGTH], each row right-aligned, -1 padded on the left
    sequences: jax.Array
    lengths: jax.Array  # int32 [MAX_STOP_SEQUENCES], 0 for an unused row


def stop_condition(tokens: Sequence[int] = (),
                   sequences: Sequence[Sequence[int]] = ()) -> StopCondition:
    """A :class:`StopCondition` from stop token ids and stop token sequences (host side).

    Raises:
      InvalidArgumentError: more than ``MAX_STOP_TOKENS`` ids or ``MAX_STOP_SEQUENCES``
        sequences, or a sequence empty or longer than ``MAX_STOP_LENGTH``.
    """
    tokens = [int(t) for t in tokens]
    if len(tokens) > MAX_STOP_TOKENS:
        raise InvalidArgumentError(
            f"at most {MAX_STOP_TOKENS} stop tokens are supported, got {len(tokens)}")
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise InvalidArgumentError(f"at most {MAX_STOP_SEQUENCES} stop sequences are "
                                   f"supported, got {len(sequences)}")
    rows = np.full((MAX_STOP_SEQUENCES, MAX_STOP_LENGTH), -1, np.int32)
    lengths = np.zeros(MAX_STOP_SEQUENCES, np.int32)
    for i, sequence in enumerate(sequences):
        if not 1 <= len(sequence) <= MAX_STOP_LENGTH:
            raise InvalidArgumentError(f"a stop sequence has 1 to {MAX_STOP_LENGTH} tokens, "
                                       f"got {len(sequence)}")
        rows[i, MAX_STOP_LENGTH - len(sequence):] = sequence
        lengths[i] = len(sequence)
    padded = np.full(MAX_STOP_TOKENS, -1, np.int32)
    padded[: len(tokens)] = tokens
    return StopCondition(tokens=jnp.asarray(padded), sequences=jnp.asarray(rows),
                         lengths=jnp.asarray(lengths))


@struct.dataclass
class DecodeState:
    """Everything a step reads and writes (all traced)."""

    cache: KVCache  # target cache, holds all tokens but the pending last one
    tokens: jax.Array  # int32 [S] prompt + generated tokens
    length: jax.Array  # int32 [] tokens in ``tokens``
    prompt_length: jax.Array  # int32 []
    max_length: jax.Array  # int32 [] prompt_length + max_new_tokens
    done: jax.Array  # bool []
    nonfinite: jax.Array  # bool [] a step saw NaN/inf target logits (and stopped)
    # int32 [] sequence position of the token the first such step was to produce; -1: none
    nonfinite_position: jax.Array
    target_calls: jax.Array  # int32 [] target forward passes after prefill
    draft_calls: jax.Array  # int32 [] draft forward passes
    stop: StopCondition
    sampling: SamplingParams
    method_state: Any = None  # the method's own pytree (Method.init builds it)


def prefill(params, loop: DecodeLoop, prompt: jax.Array, prompt_length: jax.Array,
            max_new_tokens: jax.Array, sampling: SamplingParams, stop: StopCondition,
            constraint: ConstraintTables | None = None) -> tuple[DecodeState, jax.Array | None]:
    """Runs the target over the padded prompt [P] and samples the first new token (under
    the ``constraint``'s initial state, when given: its tables).

    Returns:
      (the state, without a method state; the target's features over the prompt [P, F]
      when the method ``uses_features`` (its ``feature_layers``' outputs, or the
      final-normed hidden states), else ``None``).
    """
    config = loop.config
    dtype = params["embed"].dtype
    cache = sharding.constrain_cache(init_cache(config, loop.capacity, dtype), config)
    positions = jnp.arange(loop.prompt_bucket, dtype=jnp.int32)
    uses_features = loop.method.uses_features
    feature_layers = loop.method.feature_layers if uses_features else ()
    out = models.hidden_states(params, config, prompt, positions, cache,
                               attn_impl=loop.kernels, feature_layers=feature_layers)
    hidden, cache = out[0], out[-1]
    features = (out[1] if feature_layers else hidden) if uses_features else None
    cache = advance(cache, prompt_length)
    # The head only where it is needed: the last prompt token.
    last = models.lm_head(params, config,
                          jax.lax.dynamic_index_in_dim(hidden, prompt_length - 1, keepdims=True))
    target_logits = last
    if constraint is not None:
        last = mask_logits(constraint, jnp.int32(INITIAL_STATE), last)
    first = sample_tokens(last, sampling, prompt_length[None])
    tokens = jnp.zeros((loop.capacity,), jnp.int32).at[: loop.prompt_bucket].set(prompt)
    state = DecodeState(
        cache=cache, tokens=tokens, length=prompt_length, prompt_length=prompt_length,
        max_length=prompt_length + max_new_tokens, done=jnp.bool_(False),
        nonfinite=jnp.bool_(False), nonfinite_position=jnp.int32(-1),
        target_calls=jnp.int32(0), draft_calls=jnp.int32(0), stop=stop,
        sampling=sampling,
    )
    state = check_finite(state, target_logits)  # the target's own logits, before any mask
    return append_tokens(state, first, (~state.nonfinite).astype(jnp.int32)), features


def append_tokens(state: DecodeState, new_tokens: jax.Array, count: jax.Array) -> DecodeState:
    """Appends ``new_tokens[:count]`` (int32 [M]) to the sequence, cut at the first token
    that is a stop token or completes a stop sequence (kept; :class:`StopCondition`) and at
    ``max_length``, and updates ``done``."""
    width = new_tokens.shape[0]
    j = jnp.arange(width)
    live = j < count
    tokens = jax.lax.dynamic_update_slice(state.tokens, new_tokens.astype(jnp.int32),
                                          (state.length,))
    is_stop = live & (jnp.isin(new_tokens, state.stop.tokens)
                      | completes_sequence(state, tokens, width))
    through_stop = jnp.where(jnp.any(is_stop), jnp.argmax(is_stop) + 1, count)
    kept = jnp.minimum(jnp.minimum(count, through_stop), state.max_length - state.length)
    length = state.length + kept
    done = state.done | jnp.any(is_stop & (j < kept)) | (length >= state.max_length)
    return state.replace(tokens=tokens, length=length, done=done)


def completes_sequence(state: DecodeState, tokens: jax.Array, width: int) -> jax.Array:
    """bool [width]: whether the token at ``state.length + j`` of ``tokens`` (int32 [S], the
    sequence with a step's ``width`` new tokens written from ``state.length``) completes a
    stop sequence of ``state.stop``, over generated tokens only."""
    sequences, lengths = state.stop.sequences, state.stop.lengths  # [Q, L], [Q]
    span = sequences.shape[1]
    # The L tokens ending at each new token: positions length + j - L + 1 .. length + j.
    positions = state.length + jnp.arange(width)[:, None] + jnp.arange(1 - span, 1)[None, :]
    window = jnp.take(tokens, jnp.clip(positions, 0, tokens.shape[0] - 1))  # [width, L]
    # A prompt token never takes part (the text a stop string is found in is the
    # generated text); -2 equals no token and no padding.
    window = jnp.where(positions >= state.prompt_length, window, -2)
    equal = (sequences[None] == -1) | (sequences[None] == window[:, None, :])  # [width, Q, L]
    return jnp.any(jnp.all(equal, axis=-1) & (lengths > 0)[None], axis=-1)


def flag_nonfinite(state: DecodeState, finite: jax.Array) -> DecodeState:
    """Stops generation at a step whose target logits were not all finite (``finite``:
    bool []) and records the position of the token that step was to produce. The step
    must then append nothing: no token sampled from such logits enters the sequence."""
    bad = ~finite
    position = jnp.where(state.nonfinite, state.nonfinite_position,
                         jnp.where(bad, state.length, -1))
    return state.replace(nonfinite=state.nonfinite | bad, nonfinite_position=position,
                         done=state.done | bad)


def check_finite(state: DecodeState, logits: jax.Array) -> DecodeState:
    """:func:`flag_nonfinite` for a step whose target logits are ``logits`` (all rows)."""
    return flag_nonfinite(state, jnp.all(jnp.isfinite(logits)))


# ----------------------------------------------------------------------------- batches


def batch_sampling(sampling: SamplingParams, seeds) -> SamplingParams:
    """``sampling`` (scalars) with one seed per row: uint32 [B]."""
    return sampling.replace(seed=jnp.asarray(seeds, jnp.uint32).reshape(-1))


def row_sampling(rule: str | None) -> SamplingParams:
    """vmap axes of a batch's SamplingParams: one seed per row, the rest shared (the static
    rule must be the batch's own for the axes to match its structure)."""
    return SamplingParams(temperature=None, top_k=None, top_p=None, seed=0, rule=rule)


def state_axes(rule: str | None) -> DecodeState:
    """vmap axes of a batched :class:`DecodeState` whose sampling rule is ``rule``: 0
    everywhere (the method's state included) but the shared sampling settings."""
    return DecodeState(cache=0, tokens=0, length=0, prompt_length=0, max_length=0, done=0,
                       nonfinite=0, nonfinite_position=0, target_calls=0, draft_calls=0,
                       stop=0, sampling=row_sampling(rule), method_state=0)


def _is_cache(node) -> bool:
    return isinstance(node, KVCache)


def hold_finished(old: DecodeState, new: DecodeState) -> DecodeState:
    """One row's state after a step: ``new``, or ``old`` when the row was already done.

    The K/V buffers of every cache (the target's, and any in the method's state) are taken
    from ``new`` either way: a step writes them only at and past the committed cursor
    (:mod:`specjax.cache`), which is restored, so a finished row's committed prefix is
    untouched and no copy of its caches is made.
    """
    def pick(before, after):
        return jnp.where(old.done, before, after)

    def new_buffers(held, after):
        return held.replace(k=after.k, v=after.v) if _is_cache(held) else held

    old_rest, new_rest = old.replace(sampling=None), new.replace(sampling=None)
    held = jax.tree_util.tree_map(pick, old_rest, new_rest)
    held = jax.tree_util.tree_map(new_buffers, held, new_rest, is_leaf=_is_cache)
    return held.replace(sampling=new.sampling)


def take_rows(state: DecodeState, rows) -> DecodeState:
    """The batched ``state`` restricted to ``rows`` (int32 [B'], in that order): every
    per-row field (caches included), the shared sampling settings unchanged."""
    rows = jnp.asarray(rows, jnp.int32)

    def take(axis, subtree):
        if axis is None:
            return subtree
        return jax.tree.map(lambda leaf: jnp.take(leaf, rows, axis=0), subtree)

    return jax.tree_util.tree_map(take, state_axes(state.sampling.rule), state,
                                  is_leaf=lambda x: x is None)


def buffer_names(method_state) -> tuple[str, ...]:
    """The fields of a method's state that only the device reads (its ``buffers``)."""
    return tuple(getattr(method_state, "buffers", ()))


def without_buffers(state: DecodeState) -> DecodeState:
    """``state`` without the target cache and the method state's ``buffers``: the fields
    the host reads (tokens, lengths, counters, a tally)."""
    method_state = state.method_state
    names = buffer_names(method_state)
    if names:
        method_state = method_state.replace(**dict.fromkeys(names))
    return state.replace(cache=None, method_state=method_state)


def with_buffers(light: DecodeState, state: DecodeState) -> DecodeState:
    """``light`` (:func:`without_buffers` of a state like ``state``) with ``state``'s
    target cache and method-state buffers put back."""
    method_state = light.method_state
    names = buffer_names(state.method_state)
    if names:
        method_state = method_state.replace(
            **{name: getattr(state.method_state, name) for name in names})
    return light.replace(cache=state.cache, method_state=method_state)


class RowBook:
    """Host-side record of a batch whose live rows move to smaller programs as others
    finish (:func:`specjax.decode.run_batch`, :func:`specjax.decode.stream_batch`): which
    original row each compiled row holds, and every row's latest fields but its buffers
    (what results are read from)."""

    def __init__(self, state: DecodeState):
        self.order = np.arange(state.length.shape[0])
        self.view = jax.device_get(without_buffers(state))

    def update(self, state: DecodeState) -> None:
        host = jax.device_get(without_buffers(state))

        def put(axis, full, part):
            if axis is None:
                return part
            return jax.tree.map(lambda f, p: _scatter(f, self.order, p), full, part)

        self.view = jax.tree_util.tree_map(put, state_axes(host.sampling.rule), self.view, host,
                                           is_leaf=lambda x: x is None)

    def compact(self, done: np.ndarray) -> np.ndarray | None:
        """The rows (int [B']) that make a smaller bucket of the batch whose rows are
        ``done`` (bool [B]): the live ones, then finished ones to fill it; ``None`` when
        that would not shrink the program. The record then follows those rows."""
        live = np.flatnonzero(~done)
        size = batch_bucket(max(len(live), 1))
        if size >= len(done):
            return None
        keep = np.concatenate([live, np.flatnonzero(done)[: size - len(live)]])
        self.order = self.order[keep]
        return keep


def _scatter(full: np.ndarray, order: np.ndarray, part: np.ndarray) -> np.ndarray:
    full = np.array(full)
    full[order] = part
    return full
