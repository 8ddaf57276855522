"""Jitted decoding: one step function, two drivers.

The rule that keeps jit fast (DESIGN.md section 4):

* **Static** -- part of the compiled program, held by the hashable :class:`DecodeLoop`:
  model config, cache capacity, prompt bucket, attention implementation, method and
  tree shape (budget, depth, width), number of stop-token slots; where the sampling rule
  is fixed (``SamplingParams.rule``: a GPU's default), the rule.
* **Traced** -- arrays; changing them never recompiles: prompt tokens and length,
  max_new_tokens, temperature, top-k, top-p, seed (:class:`SamplingParams`), stop tokens,
  the method's :class:`Resources` (draft weights, n-gram tables) and everything in
  :class:`DecodeState`.

Prompts are padded to power-of-two buckets (at least 16) and the cache capacity is
rounded up to a power of two, so new prompts and budgets reuse compiled programs.

Sequence bookkeeping: ``state.tokens`` holds prompt + generated tokens, ``state.length``
counts them. The cache always holds K/V for all but the last token: that *pending* token is
the input of the next step (the root of the next speculative tree). Token ``t`` of the
sequence has position id ``t`` and, when sampled, Gumbel noise ``g_t``
(:mod:`specjax.sampling`).

Drivers: :func:`run_to_completion` compiles prefill plus a ``lax.while_loop`` over steps as
one program (no host round trip per token); :func:`stream` calls the same jitted prefill
and step from Python and yields tokens as they are produced.

Batches (B rows, :func:`run_batch`, :func:`stream_batch`): the per-row program is
``jax.vmap``-ed over the rows' prompt [B, P], prompt length [B], max_new_tokens [B],
seed [B] and stop tokens [B, MAX_STOP_TOKENS]; the parameters, the :class:`Resources` and
the other sampling settings (temperature, top-k, top-p: one per batch, so their
``lax.cond`` s stay branches) are shared. Every field of :class:`DecodeState` gains a
leading batch axis, so each row keeps its own cache cursor, tree, accepted count and stop
condition (ragged acceptance). A ``lax.while_loop`` of batched steps runs while rows are
live; a step leaves a finished row as it was (:func:`hold_finished`), so rows never affect
each other and a row's tokens are those of its batch-1 run. The batch size is static (a
shape): callers pad it to :func:`batch_bucket` with rows that finish at prefill. Once at
most half the rows are live, the drivers gather the live ones into a program of the next
smaller bucket (:func:`take_rows`; not over a device mesh), so finished rows stop costing
work.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from typing import Any, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import models, sharding
from specjax.cache import KVCache, advance, init_cache
from specjax.config import ModelConfig
from specjax.drafters.ngram import NgramTables
from specjax.errors import InvalidArgumentError
from specjax.sampling import SamplingParams, sample_tokens

MIN_BUCKET = 16
MAX_STOP_TOKENS = 8
# The most rows one compiled batch program takes (callers split longer lists).
MAX_BATCH_SIZE = 64


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def batch_bucket(rows: int) -> int:
    """Rows of the compiled program for a batch of ``rows``: the smallest power of two
    >= ``rows`` (1, 2, 4, 8, ...)."""
    return bucket(rows, minimum=1)


@struct.dataclass
class Resources:
    """What a method decodes with besides the target (traced arrays, passed to every
    step; ``None`` where the method takes none)."""

    draft_params: dict | None = None  # the draft model's parameter tree
    tables: NgramTables | None = None  # stage-2 n-gram tables


class Method(Protocol):
    """A decoding method: a hashable static object (it sits in :class:`DecodeLoop`).

    ``init`` runs once after the target prefill (e.g. the draft's prefill); ``step`` runs
    one target pass and appends at least one token. Both are traced inside one program.
    """

    name: str

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write."""

    def init(self, params, loop: "DecodeLoop", state: "DecodeState",
             resources: Resources) -> "DecodeState": ...

    def step(self, params, loop: "DecodeLoop", state: "DecodeState",
             resources: Resources) -> "DecodeState": ...


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Static description of a compiled generation program (hashable).

    Attributes:
      config: target model config.
      capacity: S, cache slots and sequence-buffer length.
      prompt_bucket: P, padded prompt length.
      attn_impl: attention implementation (``auto``, ``reference``, ``kernel``).
      method: the :class:`Method` (``ar`` by default); ``capacity`` must hold the longest
        sequence plus its ``scratch``.
    """

    config: ModelConfig
    capacity: int
    prompt_bucket: int
    attn_impl: str = "auto"
    method: Method = None  # None: Autoregressive()

    def __post_init__(self):
        if self.method is None:
            object.__setattr__(self, "method", Autoregressive())


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
    stop_tokens: jax.Array  # int32 [MAX_STOP_TOKENS], -1 padded
    sampling: SamplingParams
    draft_cache: KVCache | None = None  # the draft's cache (methods with a draft model)
    # float [S, d]: the target's features (final-normed hidden states) at every position
    # the target has run; methods whose draft reads them (``method.uses_features``).
    # [S, F*d], the outputs of target blocks ``method.feature_layers``, for a multi-layer
    # feature draft (the draft fuses them itself: the target pass stays the draft's)
    features: jax.Array | None = None
    tally: Any = None  # per-step statistics (speculative methods: methods.common.Tally)


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


def append_tokens(state: DecodeState, new_tokens: jax.Array, count: jax.Array) -> DecodeState:
    """Appends ``new_tokens[:count]`` (int32 [M]) to the sequence, cut at the first stop token
    (kept) and at ``max_length``, and updates ``done``."""
    width = new_tokens.shape[0]
    j = jnp.arange(width)
    live = j < count
    is_stop = live & jnp.isin(new_tokens, state.stop_tokens)
    through_stop = jnp.where(jnp.any(is_stop), jnp.argmax(is_stop) + 1, count)
    kept = jnp.minimum(jnp.minimum(count, through_stop), state.max_length - state.length)
    tokens = jax.lax.dynamic_update_slice(state.tokens, new_tokens.astype(jnp.int32),
                                          (state.length,))
    length = state.length + kept
    done = state.done | jnp.any(is_stop & (j < kept)) | (length >= state.max_length)
    return state.replace(tokens=tokens, length=length, done=done)


def flag_nonfinite(state: DecodeState, finite: jax.Array) -> DecodeState:
    """Stops generation at a step whose target logits were not all finite (``finite``:
    bool []) and records the position of the token that step was to produce. The step
    must then append nothing: no token sampled from such logits enters the sequence."""
    bad = ~finite
    position = jnp.where(state.nonfinite, state.nonfinite_position,
                         jnp.where(bad, state.length, -1))
    return state.replace(nonfinite=state.nonfinite | bad, nonfinite_position=position,
                         done=state.done | bad)


def _check_finite(state: DecodeState, logits: jax.Array) -> DecodeState:
    return flag_nonfinite(state, jnp.all(jnp.isfinite(logits)))


def prefill(params, loop: DecodeLoop, prompt: jax.Array, prompt_length: jax.Array,
            max_new_tokens: jax.Array, sampling: SamplingParams,
            stop_tokens: jax.Array) -> DecodeState:
    """Runs the target over the padded prompt [P] and samples the first new token."""
    config = loop.config
    dtype = params["embed"].dtype
    cache = sharding.constrain_cache(init_cache(config, loop.capacity, dtype), config)
    positions = jnp.arange(loop.prompt_bucket, dtype=jnp.int32)
    uses_features = getattr(loop.method, "uses_features", False)
    feature_layers = getattr(loop.method, "feature_layers", ()) if uses_features else ()
    out = models.hidden_states(params, config, prompt, positions, cache,
                               attn_impl=loop.attn_impl, feature_layers=feature_layers)
    hidden, cache = out[0], out[-1]
    features = out[1] if feature_layers else hidden
    cache = advance(cache, prompt_length)
    # The head only where it is needed: the last prompt token.
    last = models.lm_head(params, config,
                          jax.lax.dynamic_index_in_dim(hidden, prompt_length - 1, keepdims=True))
    first = sample_tokens(last, sampling, prompt_length[None])
    tokens = jnp.zeros((loop.capacity,), jnp.int32).at[: loop.prompt_bucket].set(prompt)
    state = DecodeState(
        cache=cache, tokens=tokens, length=prompt_length, prompt_length=prompt_length,
        max_length=prompt_length + max_new_tokens, done=jnp.bool_(False),
        nonfinite=jnp.bool_(False), nonfinite_position=jnp.int32(-1),
        target_calls=jnp.int32(0), draft_calls=jnp.int32(0), stop_tokens=stop_tokens,
        sampling=sampling,
    )
    if uses_features:
        kept = jnp.zeros((loop.capacity, features.shape[1]), features.dtype)
        state = state.replace(features=kept.at[: loop.prompt_bucket].set(features))
    state = _check_finite(state, last)
    return append_tokens(state, first, (~state.nonfinite).astype(jnp.int32))


def ar_step(params, loop: DecodeLoop, state: DecodeState) -> DecodeState:
    """One autoregressive step: feed the pending token, sample the next one."""
    position = state.length - 1
    token = jax.lax.dynamic_index_in_dim(state.tokens, position, keepdims=True)  # [1]
    logits, cache = models.forward(params, loop.config, token, position[None], state.cache,
                                   attn_impl=loop.attn_impl)
    state = state.replace(cache=advance(cache, 1), target_calls=state.target_calls + 1)
    state = _check_finite(state, logits)
    new = sample_tokens(logits, state.sampling, state.length[None])
    return append_tokens(state, new, (~state.nonfinite).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Autoregressive:
    """The ``ar`` method: one target pass per token."""

    name: str = "ar"
    scratch: int = 1

    def init(self, params, loop: DecodeLoop, state: DecodeState,
             resources: Resources) -> DecodeState:
        del params, loop, resources
        return state

    def step(self, params, loop: DecodeLoop, state: DecodeState,
             resources: Resources) -> DecodeState:
        del resources
        return ar_step(params, loop, state)


def run_to_completion(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens,
                      sampling, stop_tokens, resources: Resources) -> DecodeState:
    """Prefill, then ``lax.while_loop`` over the method's step until done: one XLA program."""
    state = _start(params, loop, prompt, prompt_length, max_new_tokens, sampling, stop_tokens,
                   resources)
    return jax.lax.while_loop(lambda s: ~s.done,
                              lambda s: loop.method.step(params, loop, s, resources), state)


def _start(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
           stop_tokens, resources: Resources) -> DecodeState:
    state = prefill(params, loop, prompt, prompt_length, max_new_tokens, sampling, stop_tokens)
    return loop.method.init(params, loop, state, resources)


def _step(params, loop: DecodeLoop, state: DecodeState, resources: Resources) -> DecodeState:
    return loop.method.step(params, loop, state, resources)


# ----------------------------------------------------------------------------- compiled programs


_EXECUTABLES: dict = {}
# Held while compiling: threads that need the same new program compile it once (the
# others wait and reuse it); a thread whose program is cached never takes it.
_COMPILE_LOCK = threading.Lock()


def _signature(args) -> tuple:
    # The placement is part of a program: an executable compiled for one device takes no
    # arrays sharded over a mesh (specjax.sharding), and the other way round.
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((np.shape(x), str(getattr(x, "dtype", None) or np.result_type(x)),
                           getattr(x, "sharding", None)) for x in leaves)


def clear_compiled() -> None:
    """Drops every cached executable (they hold device and host memory)."""
    _EXECUTABLES.clear()


_COMPILER_OPTIONS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "specjax_compiler_options", default=())


@contextlib.contextmanager
def compiler_options(**options):
    """Generation programs compiled inside this block get these XLA compiler options
    (``Lowered.compile(compiler_options=...)``), e.g. ``xla_backend_optimization_level=0``
    to compile small models faster at some cost in run time. The options are part of the
    executable cache key; a block inside another adds to its options, and an option
    given as ``None`` is removed. The options are a context variable: a new thread starts
    without them (run it in ``contextvars.copy_context()`` to carry them).
    """
    merged = {**dict(_COMPILER_OPTIONS.get()), **options}
    token = _COMPILER_OPTIONS.set(tuple(sorted((name, value) for name, value in merged.items()
                                               if value is not None)))
    try:
        yield
    finally:
        _COMPILER_OPTIONS.reset(token)


# Called around each compilation (not around a lookup in the in-process cache): a context
# manager factory taking a one-line description, e.g. the API's progress line.
_COMPILE_REPORTER: contextvars.ContextVar = contextvars.ContextVar("compile_reporter",
                                                                   default=None)


@contextlib.contextmanager
def reporting_compiles(reporter) -> Iterator[None]:
    """Within the block, each program :func:`compiled` compiles runs inside
    ``reporter(description)`` (a context manager factory); ``None`` reports nothing."""
    token = _COMPILE_REPORTER.set(reporter)
    try:
        yield
    finally:
        _COMPILE_REPORTER.reset(token)


def compiled(fn, loop: DecodeLoop, args: tuple, donate: tuple[int, ...] = (),
             carry: int | None = None):
    """Returns (executable, compile seconds, or 0.0 when cached) of ``fn(params, loop, *rest)``
    for ``args = (params, *rest)``. Executables are cached per (fn, loop, argument shapes).

    ``carry``: the index in ``args`` of the state ``fn`` returns updated (a step). With
    parameters on a device mesh the result is then placed like that argument, so that the
    step runs again on its own output (XLA may otherwise choose other shardings for it).

    Thread-safe: concurrent callers needing the same new program compile it once (see
    ``_COMPILE_LOCK``; compilations are serialised)."""
    options = _COMPILER_OPTIONS.get()
    key = (fn, loop, donate, carry, options, _signature(args))
    hit = _EXECUTABLES.get(key)
    if hit is not None:
        return hit, 0.0
    with _COMPILE_LOCK:
        hit = _EXECUTABLES.get(key)
        if hit is not None:  # another thread compiled it while this one waited
            return hit, 0.0
        start = time.perf_counter()
        mesh = sharding.mesh_of(args[0])
        placement = {}
        if carry is not None and mesh is not None:
            placement["out_shardings"] = jax.tree.map(lambda x: x.sharding, args[carry])
        jitted = jax.jit(lambda params, *rest: fn(params, loop, *rest), donate_argnums=donate,
                         **placement)
        reporter = _COMPILE_REPORTER.get()
        report = (contextlib.nullcontext() if reporter is None else
                  reporter(f"compiling {getattr(loop.method, 'name', 'ar')} "
                           f"({getattr(fn, '__name__', 'program').strip('_')}, cache "
                           f"{loop.capacity})"))
        with report, sharding.tracing(mesh):  # parameters on a mesh: see there
            executable = jitted.lower(*args).compile(dict(options) or None)
        _EXECUTABLES[key] = executable
        return executable, time.perf_counter() - start


def run_program(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
                stop_tokens, resources: Resources = Resources()
                ) -> tuple[DecodeState, float, float]:
    """Compiles (once) and runs the whole generation; returns (state, compile s, run s)."""
    args = (params, prompt, prompt_length, max_new_tokens, sampling, stop_tokens, resources)
    args = sharding.place_arguments(args)  # replicated over the mesh of params, if any
    executable, compile_seconds = compiled(run_to_completion, loop, args)
    start = time.perf_counter()
    state = executable(*args)
    jax.block_until_ready(state.length)
    return state, compile_seconds, time.perf_counter() - start


# ----------------------------------------------------------------------------- batches

def _row_sampling(rule: str | None) -> SamplingParams:
    """vmap axes of a batch's SamplingParams: one seed per row, the rest shared (the static
    rule must be the batch's own for the axes to match its structure)."""
    return SamplingParams(temperature=None, top_k=None, top_p=None, seed=0, rule=rule)


def batch_sampling(sampling: SamplingParams, seeds) -> SamplingParams:
    """``sampling`` (scalars) with one seed per row: uint32 [B]."""
    return sampling.replace(seed=jnp.asarray(seeds, jnp.uint32).reshape(-1))


def _state_axes(rule: str | None) -> DecodeState:
    """vmap axes of a batched :class:`DecodeState` whose sampling rule is ``rule``: 0
    everywhere but the shared sampling settings."""
    return DecodeState(cache=0, tokens=0, length=0, prompt_length=0, max_length=0, done=0,
                       nonfinite=0, nonfinite_position=0, target_calls=0, draft_calls=0,
                       stop_tokens=0, sampling=_row_sampling(rule), draft_cache=0, features=0,
                       tally=0)


def hold_finished(old: DecodeState, new: DecodeState) -> DecodeState:
    """One row's state after a step: ``new``, or ``old`` when the row was already done.

    The K/V buffers of the caches are taken from ``new`` either way: a step writes them only
    at and past the committed cursor (:mod:`specjax.cache`), which is restored, so a
    finished row's committed prefix is untouched and no copy of its cache is made.
    """
    def pick(before, after):
        return jnp.where(old.done, before, after)

    held = jax.tree_util.tree_map(pick, old.replace(sampling=None), new.replace(sampling=None))
    held = held.replace(sampling=new.sampling,
                        cache=held.cache.replace(k=new.cache.k, v=new.cache.v))
    if new.draft_cache is not None:
        held = held.replace(draft_cache=held.draft_cache.replace(k=new.draft_cache.k,
                                                                 v=new.draft_cache.v))
    return held


def _start_batch(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens, sampling,
                 stop_tokens, resources: Resources) -> DecodeState:
    def start_row(prompt, prompt_length, max_new, row_sampling, stop):
        return _start(params, loop, prompt, prompt_length, max_new, row_sampling, stop,
                      resources)

    state = jax.vmap(start_row, in_axes=(0, 0, 0, _row_sampling(sampling.rule), 0),
                     out_axes=_state_axes(sampling.rule),
                     spmd_axis_name=sharding.batch_axis(prompts.shape[0]))(
        prompts, prompt_lengths, max_new_tokens, sampling, stop_tokens)
    return sharding.readable_by_every_process(state)  # several hosts: all rows to each


def _step_batch(params, loop: DecodeLoop, state: DecodeState,
                resources: Resources) -> DecodeState:
    def step_row(row):
        return hold_finished(row, loop.method.step(params, loop, row, resources))

    axes = _state_axes(state.sampling.rule)
    state = jax.vmap(step_row, in_axes=(axes,), out_axes=axes,
                     spmd_axis_name=sharding.batch_axis(state.length.shape[0]))(state)
    return sharding.readable_by_every_process(state)


def run_batch_to_completion(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens,
                            sampling, stop_tokens, resources: Resources) -> DecodeState:
    """Prefill every row, then one ``lax.while_loop`` of batched steps until every row is
    done (finished rows held): one XLA program. Arguments as :func:`run_batch`."""
    state = _start_batch(params, loop, prompts, prompt_lengths, max_new_tokens, sampling,
                         stop_tokens, resources)
    state = _steps_while_busy(params, loop, state, resources, compact=False)
    return sharding.readable_by_every_process(state)


def _steps_while_busy(params, loop: DecodeLoop, state: DecodeState, resources: Resources, *,
                      compact: bool) -> DecodeState:
    """Batched steps until every row is done or (``compact``) at most half the rows are
    live, at which point the driver moves the live rows to a smaller program."""
    rows = state.length.shape[0]
    most_live_to_stop = rows // 2 if compact and rows > 1 else 0

    def busy(s):
        live = jnp.sum(~s.done)
        return (live > 0) & (live > most_live_to_stop)

    return jax.lax.while_loop(busy, lambda s: _step_batch(params, loop, s, resources), state)


def _start_batch_and_steps(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens,
                           sampling, stop_tokens, resources: Resources) -> DecodeState:
    state = _start_batch(params, loop, prompts, prompt_lengths, max_new_tokens, sampling,
                         stop_tokens, resources)
    return _steps_while_busy(params, loop, state, resources, compact=True)


def _more_steps(params, loop: DecodeLoop, state: DecodeState,
                resources: Resources) -> DecodeState:
    return _steps_while_busy(params, loop, state, resources, compact=True)


def take_rows(state: DecodeState, rows) -> DecodeState:
    """The batched ``state`` restricted to ``rows`` (int32 [B'], in that order): every
    per-row field (caches included), the shared sampling settings unchanged."""
    rows = jnp.asarray(rows, jnp.int32)

    def take(axis, subtree):
        if axis is None:
            return subtree
        return jax.tree.map(lambda leaf: jnp.take(leaf, rows, axis=0), subtree)

    return jax.tree_util.tree_map(take, _state_axes(state.sampling.rule), state,
                                  is_leaf=lambda x: x is None)


_take_rows = jax.jit(take_rows)


class _RowBook:
    """Host-side record of a batch whose live rows move to smaller programs as others
    finish (:func:`run_batch`, :func:`stream_batch`): which original row each compiled row
    holds, and every row's latest non-cache fields (what results are read from)."""

    def __init__(self, state: DecodeState):
        self.order = np.arange(state.length.shape[0])
        self.view = jax.device_get(state.replace(cache=None, draft_cache=None, features=None))

    def update(self, state: DecodeState) -> None:
        host = jax.device_get(state.replace(cache=None, draft_cache=None, features=None))

        def put(axis, full, part):
            if axis is None:
                return part
            return jax.tree.map(lambda f, p: _scatter(f, self.order, p), full, part)

        self.view = jax.tree_util.tree_map(put, _state_axes(host.sampling.rule), self.view, host,
                                           is_leaf=lambda x: x is None)

    def compact(self, state: DecodeState) -> DecodeState | None:
        """The live rows of ``state`` in a smaller bucket (filled with finished rows), or
        ``None`` when that would not shrink the program."""
        done = np.asarray(jax.device_get(state.done))
        live = np.flatnonzero(~done)
        size = batch_bucket(max(len(live), 1))
        if size >= len(done):
            return None
        keep = np.concatenate([live, np.flatnonzero(done)[: size - len(live)]])
        self.order = self.order[keep]
        return _take_rows(state, keep)


def _scatter(full: np.ndarray, order: np.ndarray, part: np.ndarray) -> np.ndarray:
    full = np.array(full)
    full[order] = part
    return full


def _compacting(args: tuple, compact: bool) -> bool:
    """Live rows move to smaller programs when asked, unless the batch is split over a
    device mesh (whose 'data' axis must keep dividing the rows)."""
    return compact and sharding.mesh_of(args[0]) is None


def run_batch(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens, sampling,
              stop_tokens, resources: Resources = Resources(), *, compact: bool = True
              ) -> tuple[DecodeState, float, float]:
    """Compiles (once per loop and batch shape) and runs a batch's whole generation.

    With ``compact``, once at most half the rows are live, the live ones move to a program
    of the next smaller batch bucket (their states gathered, nothing recomputed), so
    finished rows stop costing work, at the price of compiling up to log2(B) more programs
    (once per process each); each row's tokens are those of its batch-1 run either way.
    Over a device mesh, or without ``compact``, the batch keeps its size (one program).

    Args:
      params: the target's parameters (shared by every row).
      loop: the static program; ``prompt_bucket`` and ``capacity`` must fit every row.
      prompts: int32 [B, P] padded prompts.
      prompt_lengths: int32 [B].
      max_new_tokens: int32 [B].
      sampling: :class:`SamplingParams` with scalar temperature, top-k, top-p and a
        uint32 [B] seed (:func:`batch_sampling`).
      stop_tokens: int32 [B, MAX_STOP_TOKENS], -1 padded.
      resources: shared by every row.
      compact: move live rows to smaller programs as rows finish (see above).
    Returns:
      (state with a leading [B] axis on every field but the shared sampling settings, on
      the host and without caches when rows were moved; compile seconds or 0.0 when
      cached; run seconds).
    """
    args = (params, prompts, prompt_lengths, max_new_tokens, sampling, stop_tokens, resources)
    # Over a mesh: rows split over 'data', the rest replicated (specjax.sharding).
    args = sharding.place_arguments(args, rows=prompts.shape[0])
    if not _compacting(args, compact):
        executable, compile_seconds = compiled(run_batch_to_completion, loop, args)
        start = time.perf_counter()
        state = executable(*args)
        jax.block_until_ready(state.length)
        return state, compile_seconds, time.perf_counter() - start
    executable, compile_seconds = compiled(_start_batch_and_steps, loop, args)
    start = time.perf_counter()
    state = executable(*args)
    book = _RowBook(state)
    while not bool(np.all(np.asarray(book.view.done))):
        smaller = book.compact(state)
        if smaller is None:
            smaller = state  # nothing to shrink: run on
        more, seconds = compiled(_more_steps, loop, (params, smaller, args[-1]), carry=1,
                                 donate=(1,))
        compile_seconds += seconds
        start += seconds  # compile time is not run time
        state = more(params, smaller, args[-1])
        book.update(state)
    return book.view, compile_seconds, time.perf_counter() - start


def stream_batch(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens, sampling,
                 stop_tokens, resources: Resources = Resources(), *, compact: bool = True
                 ) -> Iterator[tuple[list[list[int]], DecodeState, float]]:
    """:func:`stream` for a batch (arguments as :func:`run_batch`): yields (new token ids
    per row, a list of B lists, some empty; the batch's state, every row's non-cache
    fields on the host; compile seconds spent before this yield) after the prefill and
    after every batched step, until every row is done. With ``compact`` live rows move to
    smaller programs as in :func:`run_batch`."""
    args = (params, prompts, prompt_lengths, max_new_tokens, sampling, stop_tokens, resources)
    # Over a mesh: rows split over 'data', the rest replicated (specjax.sharding).
    args = sharding.place_arguments(args, rows=prompts.shape[0])
    compacting = _compacting(args, compact)
    resources = args[-1]
    start_exec, compile_seconds = compiled(_start_batch, loop, args)
    state = start_exec(*args)
    book = _RowBook(state)
    emitted = np.asarray(book.view.prompt_length).copy()
    while True:
        lengths = np.asarray(book.view.length)
        tokens = np.asarray(book.view.tokens)
        new = [tokens[row, emitted[row]:lengths[row]].tolist() for row in range(len(lengths))]
        emitted = lengths.copy()
        yield new, book.view, compile_seconds
        compile_seconds = 0.0
        if bool(np.all(np.asarray(book.view.done))):
            return
        smaller = book.compact(state) if compacting else None
        if smaller is not None:
            state = smaller
        step_exec, step_compile = compiled(_step_batch, loop, (params, state, resources),
                                           carry=1, donate=(1,))
        compile_seconds += step_compile
        state = step_exec(params, state, resources)
        book.update(state)


def stream(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
           stop_tokens, resources: Resources = Resources()
           ) -> Iterator[tuple[list[int], DecodeState, float]]:
    """Python-driven generation over the same jitted prefill and step.

    Yields (new token ids, state, compile seconds spent before this yield) after the
    prefill and after every step, until done.
    """
    args = (params, prompt, prompt_length, max_new_tokens, sampling, stop_tokens, resources)
    args = sharding.place_arguments(args)  # replicated over the mesh of params, if any
    resources = args[-1]
    start_exec, compile_seconds = compiled(_start, loop, args)
    state = start_exec(*args)
    step_exec, step_compile = compiled(_step, loop, (params, state, resources), donate=(1,),
                                       carry=1)
    compile_seconds += step_compile
    emitted = int(state.prompt_length)
    while True:
        length = int(state.length)
        new = np.asarray(state.tokens)[emitted:length].tolist()
        emitted = length
        yield new, state, compile_seconds
        compile_seconds = 0.0
        if bool(state.done):
            return
        state = step_exec(params, state, resources)
