"""Jitted decoding: one step function, two drivers.

The drivers know only what every method shares (:mod:`specjax.state`); each method, in
:mod:`specjax.methods`, builds its own resources and state and runs its own step.

The rule that keeps jit fast:

* **Static** -- part of the compiled program, held by the hashable
  :class:`~specjax.state.DecodeLoop`: model config, cache capacity, prompt bucket,
  kernel options (:class:`~specjax.kernel_options.KernelOptions`: attention
  implementation, kernel backends, XLA compiler options), method and tree shape (budget,
  depth, width), number of stop-token and stop-sequence slots; where the sampling rule
  is fixed (``SamplingParams.rule``: a GPU's default), the rule.
* **Traced** -- arrays; changing them never recompiles: prompt tokens and length,
  max_new_tokens, temperature, top-k, top-p, seed (``SamplingParams``), stop tokens and
  stop sequences (:class:`~specjax.state.StopCondition`), the method's resources (draft
  weights, n-gram tables) and everything in :class:`~specjax.state.DecodeState`.

Prompts are padded to power-of-two buckets (at least 16) and the cache capacity is
rounded up to a power of two, so new prompts and budgets reuse compiled programs.

Drivers: :func:`run_to_completion` compiles prefill plus a ``lax.while_loop`` over steps as
one program (no host round trip per token); :func:`stream` calls the same jitted prefill
and step from Python and yields tokens as they are produced.

Batches (B rows, :func:`run_batch`, :func:`stream_batch`): the per-row program is
``jax.vmap``-ed over the rows' prompt [B, P], prompt length [B], max_new_tokens [B],
seed [B] and stop condition ([B, ...] per field); the parameters, the method's resources and
the other sampling settings (temperature, top-k, top-p: one per batch, so their
``lax.cond`` s stay branches) are shared. Every field of :class:`DecodeState` (the
method's state included) gains a leading batch axis, so each row keeps its own cache
cursor, tree, accepted count and stop condition (ragged acceptance). A ``lax.while_loop``
of batched steps runs while rows are live; a step leaves a finished row as it was
(:func:`~specjax.state.hold_finished`), so rows never affect each other and a row's
tokens are those of its batch-1 run. The batch size is static (a shape): callers pad it to
:func:`~specjax.state.batch_bucket` with rows that finish at prefill. Once at most half the rows are
live, the drivers gather the live ones into a program of the next smaller bucket
(:func:`~specjax.state.take_rows`; not over a device mesh), so finished rows stop costing
work.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels, sharding
from specjax.state import (DecodeLoop, DecodeState, RowBook, hold_finished, prefill,
                           row_sampling, state_axes, take_rows, with_buffers, without_buffers)


def run_to_completion(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens,
                      sampling, stop, resources: Any) -> DecodeState:
    """Prefill, then ``lax.while_loop`` over the method's step until done: one XLA program."""
    state = _start(params, loop, prompt, prompt_length, max_new_tokens, sampling, stop,
                   resources)
    return jax.lax.while_loop(lambda s: ~s.done,
                              lambda s: loop.method.step(params, loop, s, resources), state)


def _start(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
           stop, resources: Any) -> DecodeState:
    state, features = prefill(params, loop, prompt, prompt_length, max_new_tokens, sampling,
                              stop, loop.method.constraint_of(resources))
    return loop.method.init(params, loop, state, resources, features)


def _step(params, loop: DecodeLoop, state: DecodeState, resources: Any) -> DecodeState:
    return loop.method.step(params, loop, state, resources)


# ----------------------------------------------------------------------------- compiled programs


_EXECUTABLES: dict = {}
_FALLBACKS: dict = {}  # the same keys -> the fallbacks recorded lowering that program
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
    _FALLBACKS.clear()


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


def _program_name(fn) -> str:
    return getattr(fn, "__name__", "program").strip("_")


def compiled(fn, loop: DecodeLoop, args: tuple, donate: tuple[int, ...] = (),
             carry: int | None = None):
    """Returns (executable, compile seconds, or 0.0 when cached) of ``fn(params, loop, *rest)``
    for ``args = (params, *rest)``. Executables are cached per (fn, loop, argument shapes);
    the loop's ``kernels.compiler_options`` go to XLA (``Lowered.compile``).

    ``carry``: the index in ``args`` of the state ``fn`` returns updated (a step). With
    parameters on a device mesh the result is then placed like that argument, so that the
    step runs again on its own output (XLA may otherwise choose other shardings for it).

    Thread-safe: concurrent callers needing the same new program compile it once (see
    ``_COMPILE_LOCK``; compilations are serialised). The fallbacks recorded lowering the
    program go to the active :func:`.kernels.fallbacks.collecting` block, cached or not."""
    options = dict(loop.kernels.compiler_options)
    key = (fn, loop, donate, carry, tuple(sorted(options.items())), _signature(args))
    hit = _EXECUTABLES.get(key)
    if hit is not None:
        kernels.fallbacks.record_all(_FALLBACKS[key])
        return hit, 0.0
    with _COMPILE_LOCK:
        hit = _EXECUTABLES.get(key)
        if hit is not None:  # another thread compiled it while this one waited
            kernels.fallbacks.record_all(_FALLBACKS[key])
            return hit, 0.0
        start = time.perf_counter()
        mesh = sharding.mesh_of(args[0])  # parameters on a mesh: see sharding.tracing
        placement = {}
        if carry is not None and mesh is not None:
            placement["out_shardings"] = jax.tree.map(lambda x: x.sharding, args[carry])
        def program(params, *rest):
            return fn(params, loop, *rest)

        # Named after its driver: XLA's module (``jit_run_to_completion``), profiles and
        # compile events say which program it is.
        program.__name__ = program.__qualname__ = _program_name(fn)
        jitted = jax.jit(program, donate_argnums=donate, **placement)
        reporter = _COMPILE_REPORTER.get()
        report = (contextlib.nullcontext() if reporter is None else
                  reporter(f"compiling {getattr(loop.method, 'name', 'ar')} "
                           f"({_program_name(fn)}, cache "
                           f"{loop.capacity})"))
        with report, sharding.tracing(mesh), kernels.fallbacks.collecting() as reasons:
            executable = jitted.lower(*args).compile(options or None)
        _FALLBACKS[key] = frozenset(reasons)  # first: a reader without the lock finds both
        _EXECUTABLES[key] = executable
        kernels.fallbacks.record_all(reasons)
        return executable, time.perf_counter() - start


def run_program(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
                stop, resources: Any = None
                ) -> tuple[DecodeState, float, float]:
    """Compiles (once) and runs the whole generation; returns (state, compile s, run s)."""
    args = (params, prompt, prompt_length, max_new_tokens, sampling, stop, resources)
    args = sharding.place_arguments(args)  # replicated over the mesh of params, if any
    executable, compile_seconds = compiled(run_to_completion, loop, args)
    start = time.perf_counter()
    state = executable(*args)
    jax.block_until_ready(state.length)
    return state, compile_seconds, time.perf_counter() - start


# ----------------------------------------------------------------------------- batches

def _readable(state: DecodeState) -> DecodeState:
    """:func:`sharding.readable_by_every_process` for a batch's state: every field the host
    reads replicated, the caches and the method state's ``buffers`` kept split by row."""
    light = sharding.readable_by_every_process(without_buffers(state), keep=())
    return with_buffers(light, state)


def _start_batch(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens, sampling,
                 stop, resources: Any) -> DecodeState:
    def start_row(prompt, prompt_length, max_new, row_sampling, stop):
        return _start(params, loop, prompt, prompt_length, max_new, row_sampling, stop,
                      resources)

    state = jax.vmap(start_row, in_axes=(0, 0, 0, row_sampling(sampling.rule), 0),
                     out_axes=state_axes(sampling.rule),
                     spmd_axis_name=sharding.batch_axis(prompts.shape[0]))(
        prompts, prompt_lengths, max_new_tokens, sampling, stop)
    return _readable(state)  # several hosts: all rows to each


def _step_batch(params, loop: DecodeLoop, state: DecodeState,
                resources: Any) -> DecodeState:
    def step_row(row):
        return hold_finished(row, loop.method.step(params, loop, row, resources))

    axes = state_axes(state.sampling.rule)
    state = jax.vmap(step_row, in_axes=(axes,), out_axes=axes,
                     spmd_axis_name=sharding.batch_axis(state.length.shape[0]))(state)
    return _readable(state)


def run_batch_to_completion(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens,
                            sampling, stop, resources: Any) -> DecodeState:
    """Prefill every row, then one ``lax.while_loop`` of batched steps until every row is
    done (finished rows held): one XLA program. Arguments as :func:`run_batch`."""
    state = _start_batch(params, loop, prompts, prompt_lengths, max_new_tokens, sampling,
                         stop, resources)
    state = _steps_while_busy(params, loop, state, resources, compact=False)
    return _readable(state)


def _steps_while_busy(params, loop: DecodeLoop, state: DecodeState, resources: Any, *,
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
                           sampling, stop, resources: Any) -> DecodeState:
    state = _start_batch(params, loop, prompts, prompt_lengths, max_new_tokens, sampling,
                         stop, resources)
    return _steps_while_busy(params, loop, state, resources, compact=True)


def _more_steps(params, loop: DecodeLoop, state: DecodeState,
                resources: Any) -> DecodeState:
    return _steps_while_busy(params, loop, state, resources, compact=True)


_take_rows = jax.jit(take_rows)


def _compact(book: RowBook, state: DecodeState) -> DecodeState | None:
    """The live rows of ``state`` in a smaller bucket (:meth:`RowBook.compact`), or
    ``None``."""
    keep = book.compact(np.asarray(jax.device_get(state.done)))
    return None if keep is None else _take_rows(state, keep)


def _compacting(args: tuple, compact: bool) -> bool:
    """Live rows move to smaller programs when asked, unless the batch is split over a
    device mesh (whose 'data' axis must keep dividing the rows)."""
    return compact and sharding.mesh_of(args[0]) is None


def run_batch(params, loop: DecodeLoop, prompts, prompt_lengths, max_new_tokens, sampling,
              stop, resources: Any = None, *, compact: bool = True
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
      sampling: :class:`~specjax.sampling.SamplingParams` with scalar temperature, top-k,
        top-p and a uint32 [B] seed (:func:`~specjax.state.batch_sampling`).
      stop: a :class:`~specjax.state.StopCondition` with a leading [B] axis per field.
      resources: shared by every row.
      compact: move live rows to smaller programs as rows finish (see above).
    Returns:
      (state with a leading [B] axis on every field but the shared sampling settings, on
      the host and without caches when rows were moved; compile seconds or 0.0 when
      cached; run seconds).
    """
    args = (params, prompts, prompt_lengths, max_new_tokens, sampling, stop, resources)
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
    book = RowBook(state)
    while not bool(np.all(np.asarray(book.view.done))):
        smaller = _compact(book, state)
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
                 stop, resources: Any = None, *, compact: bool = True
                 ) -> Iterator[tuple[list[list[int]], DecodeState, float]]:
    """:func:`stream` for a batch (arguments as :func:`run_batch`): yields (new token ids
    per row, a list of B lists, some empty; the batch's state, every row's non-cache
    fields on the host; compile seconds spent before this yield) after the prefill and
    after every batched step, until every row is done. With ``compact`` live rows move to
    smaller programs as in :func:`run_batch`."""
    args = (params, prompts, prompt_lengths, max_new_tokens, sampling, stop, resources)
    # Over a mesh: rows split over 'data', the rest replicated (specjax.sharding).
    args = sharding.place_arguments(args, rows=prompts.shape[0])
    compacting = _compacting(args, compact)
    resources = args[-1]
    start_exec, compile_seconds = compiled(_start_batch, loop, args)
    state = start_exec(*args)
    book = RowBook(state)
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
        smaller = _compact(book, state) if compacting else None
        if smaller is not None:
            state = smaller
        step_exec, step_compile = compiled(_step_batch, loop, (params, state, resources),
                                           carry=1, donate=(1,))
        compile_seconds += step_compile
        state = step_exec(params, state, resources)
        book.update(state)


def stream(params, loop: DecodeLoop, prompt, prompt_length, max_new_tokens, sampling,
           stop, resources: Any = None
           ) -> Iterator[tuple[list[int], DecodeState, float]]:
    """Python-driven generation over the same jitted prefill and step.

    Yields (new token ids, state, compile seconds spent before this yield) after the
    prefill and after every step, until done.
    """
    args = (params, prompt, prompt_length, max_new_tokens, sampling, stop, resources)
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
