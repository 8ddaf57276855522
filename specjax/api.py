"""The Python API: :func:`load` a model, :func:`generate` text from it.

>>> model = specjax.load("smollm2-135m")
>>> out = specjax.generate(model, "def fibonacci(n):", max_new_tokens=64)
>>> out.text, out.tokens, out.stats["tokens_per_s"]
>>> specjax.generate(model, "def f(x):", method="tree", tree_budget=8)
>>> specjax.generate(model, "def f(x):", method=specjax.StagedOptions(tree_budget=8))

The default method is :func:`specjax.loading.choose_default_method`'s: the method measured
fastest on the model's backend at the request's temperature among those its shipped draft
and n-gram tables allow, ``ar`` where none beat it (``smollm2-135m`` on a CPU: ``spec``
at every temperature); ``stats["method_choice"]`` says which and why. The CLI uses the
same.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, loading, methods, models, progress as progress_lib
from specjax.backend_options import BatchOptions, KernelOptions
from specjax.compilation_cache import use_compilation_cache
from specjax.constraints import build_tables, check_constraint_type
from specjax.errors import InvalidArgumentError, NumericalError, PerformanceWarning
from specjax.kernels import fallbacks
from specjax.loading import (check_resources, choose_default_method, resolve_draft,
                             resolve_ngram)
from specjax.methods import MethodOptions
from specjax.methods.common import tally_of
from specjax.methods.exactness import run_exactness
from specjax.model import Model, check_draft_compatible, encode_prompt, resolve_dtype
from specjax.origins import ORIGIN_NAMES, origin_name
from specjax.sampling import make_sampling_params, static_rules
from specjax.state import (MAX_BATCH_SIZE, MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, Method,
                           StopCondition, batch_bucket, batch_sampling, plan_capacity,
                           stop_condition, without_buffers)
from specjax.stop_strings import stop_sequences

__all__ = ["BatchOptions", "GenerationResult", "KernelOptions", "Model",
           "check_draft_compatible", "decode_text", "encode_prompt", "generate", "load",
           "resolve_dtype", "stream_generate"]


def load(name_or_path, dtype=None, *, progress: bool = False, mesh=None) -> Model:
    """:func:`specjax.loading.load` (same arguments), with the ``specjax`` program's
    persistent compilation cache switched on first (:mod:`specjax.compilation_cache`: a
    later process loads the compiled programs instead of compiling them again;
    ``SPECJAX_COMPILATION_CACHE=off`` in the environment, or a cache directory set in
    ``jax.config`` before, keeps it off or elsewhere).

    Args:
      progress: print what is being loaded and how long it took (stderr), with a
        progress bar per tensor on a terminal; the model keeps it (``Model.progress``)
        as the default of :func:`generate`'s ``progress``.
    """
    problem = use_compilation_cache()
    if problem is not None:
        warnings.warn(problem, PerformanceWarning, stacklevel=2)
    if not progress:
        return loading.load(name_or_path, dtype, progress=False, mesh=mesh)
    with progress_lib.reported(f"loading {name_or_path}"):
        return loading.load(name_or_path, dtype, progress=True, mesh=mesh).with_progress()


def _reporting(progress: bool):
    """Compilations reported on stderr when ``progress`` (see :func:`generate`)."""
    return decode.reporting_compiles(progress_lib.reported if progress else None)


def _collected(steps: Iterator, reasons: set) -> Iterator:
    """``steps`` (a decode driver's generator) with the fallbacks of the programs it runs
    added to ``reasons`` (:mod:`specjax.kernels.fallbacks`); the collector is set while a
    step runs, never across a yield to the caller."""
    try:
        while True:
            with fallbacks.collecting(reasons):
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item
    finally:
        steps.close()


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` returns."""

    text: str
    tokens: list[int]  # new token ids (a stop token that ended generation included)
    stats: dict[str, Any]
    origins: list[str] | None = None  # per token: "ngram", "lookup", "draft" or "target"


@dataclasses.dataclass
class _Request:
    loop: decode.DecodeLoop
    args: tuple  # (params, prompt, prompt_length, max_new_tokens, sampling, stop, resources)
    prompt_length: int
    options: MethodOptions
    choice: str = "given"  # why this method: "given", or the default's reason
    constraint: dict | None = None  # the constraint's stats (None: unconstrained)


def _stop_array(model: Model, stop_ids: Sequence[int],
                strings: Sequence[str] = ()) -> StopCondition:
    """The device's stop condition: ``stop_ids`` (:func:`_stop_ids`) and the token
    sequences that spell the stop ``strings`` (:mod:`specjax.stop_strings`)."""
    sequences = stop_sequences(model.tokenizer, model.config.vocab_size, strings)
    return stop_condition(list(stop_ids), sequences)


def _stop_ids(model: Model, stop_tokens: Sequence[int] | None) -> tuple[int, ...]:
    """The token ids that end a row: ``stop_tokens``, or (``None``) the model's EOS ids."""
    if stop_tokens is not None:
        return tuple(int(t) for t in stop_tokens)
    stop = list(model.config.eos_token_ids)
    eos = getattr(model.tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stop:
        stop.append(int(eos))
    return tuple(stop)


def resolve_method(model: Model, method: str | MethodOptions | None = None,
                   temperature: float = 0.0, **options) -> MethodOptions:
    """The validated options for ``method`` (default: :func:`choose_default_method` for
    the model, its backend and ``temperature``) with ``options`` applied; see
    :func:`specjax.methods.method_options`."""
    return _resolve_method(model, method, temperature, options)[0]


def _resolve_method(model: Model, method, temperature, options) -> tuple[MethodOptions, str]:
    if isinstance(method, MethodOptions):
        clash = sorted(name for name, value in options.items() if value is not None
                       and name in method.given and getattr(method, name) != value)
        if clash:  # one place for each setting: a keyword would silently win
            raise InvalidArgumentError(
                f"{', '.join(clash)} given as a keyword and, with another value, in the "
                f"{type(method).__name__} passed as method=: set it in one place")
    backend = model_backend(model)
    choice = "given"
    if method is None:
        method, choice = choose_default_method(model.assets, backend, float(temperature))
    return methods.method_options(method, backend=backend, **options), choice


def model_backend(model: Model) -> str:
    """Whose method defaults the model gets: ``cpu``, ``gpu`` or ``tpu``, from the device
    its weights are on (:func:`specjax.methods.options.backend_of`)."""
    return methods.options.backend_of(_platform(jax.tree_util.tree_leaves(model.params)[0]))


def _platform(array) -> str:
    devices = getattr(array, "devices", None)
    return next(iter(devices())).platform if callable(devices) else jax.default_backend()


@dataclasses.dataclass
class _Settings:
    """Everything of a request but its prompts, checked and loaded."""

    options: MethodOptions
    sampling: Any  # SamplingParams (scalars)
    stop: StopCondition
    method: Method
    draft_model: Model | None
    resources: Any  # the method's own (Method.build_resources)
    max_new_tokens: int
    choice: str = "given"
    stop_ids: tuple[int, ...] = ()  # the tokens that end a row (a constraint's EOS)
    constraint: Any = None  # a constraints.Regex or JsonSchema, or None
    constraint_stats: dict | None = None  # set with the constraint's tables


def kernel_options(model: Model, kernels: KernelOptions | None = None) -> KernelOptions:
    """The :class:`KernelOptions` a request on ``model`` runs with: ``kernels`` with its
    ``auto`` values made concrete for the model's backend, or that backend's
    :meth:`KernelOptions.default`."""
    backend = model_backend(model)
    if kernels is None:
        kernels = KernelOptions.default(backend)
    elif not isinstance(kernels, KernelOptions):
        raise InvalidArgumentError(f"kernels must be a specjax.KernelOptions, got "
                                   f"{type(kernels).__name__}")
    return kernels.resolved(backend)


def _check_kernels(model: Model, kernels: KernelOptions) -> None:
    if kernels.attention == "fused" and not models.has_fused_layers(model.config):
        # Running the default layers instead would drop the bitwise guarantee silently.
        raise InvalidArgumentError(
            f"attention 'fused' needs a Llama-family model (the fused layers); {model.name}: "
            f"{models.no_fused_layers_reason(model.config)}: use 'auto' or 'kernel'")
    if kernels.attention == "fused" and model_backend(model) == "cpu":
        warnings.warn(
            f"{model.name}: attention 'fused' on the CPU runs its Pallas kernels in Pallas' "
            f"interpreter, several times slower than 'auto' (it is meant for GPU/TPU); use "
            f"KernelOptions(attention='auto') on a CPU", PerformanceWarning, stacklevel=5)


def _settings(model: Model, *, method, max_new_tokens, temperature, top_k, top_p, seed,
              draft, ngram, stop_tokens, kernels, options, stop_strings=(),
              constraint=None) -> _Settings:
    # Every setting is checked before anything loads (the draft, the tables).
    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a specjax.Model (from specjax.load), got "
                                   f"{type(model).__name__}")
    make_sampling_params(temperature, top_k, top_p, seed)  # a bad temperature first
    constrained_choice = None
    if constraint is not None:
        method, constrained_choice = constrained_method(method, constraint)
    opts, choice = _resolve_method(model, method, temperature, options)
    choice = constrained_choice or choice
    sampling = make_sampling_params(
        temperature, top_k, top_p, seed,
        static_rule=static_rules(model_backend(model), kernels.sampling_rules))
    opts.check_sampling(float(temperature))
    check_resources(opts, draft, ngram)
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
            or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got "
                                   f"{max_new_tokens}")
    stop_ids = _stop_ids(model, stop_tokens)
    stop = _stop_array(model, stop_ids, stop_strings)
    if constraint is not None:
        if model.tokenizer is None:
            raise InvalidArgumentError(f"model {model.name!r} has no tokenizer: a constraint "
                                       f"is on the text, spelled through one")
        if not stop_ids:
            raise InvalidArgumentError("a constraint ends its output with an end-of-sequence "
                                       "token, and stop=[] leaves none: give one in stop")
    _warn_if_slow_dtype(model)
    _check_kernels(model, kernels)
    return _Settings(opts, sampling, stop, None, None, None, int(max_new_tokens),
                     choice, stop_ids, constraint)


# Why ar is the default under a constraint (stats["method_choice"]): every method decodes
# under one, but none is timed against ar there yet.
CONSTRAINED_CHOICE = "ar: under a constraint no method is timed against ar yet"


def constrained_method(method, constraint) -> tuple[Any, str | None]:
    """(the method, its choice) for a request under ``constraint``: ``ar`` when none is
    named, else the method named. Checks the constraint's type
    (:func:`specjax.constraints.check_constraint_type`)."""
    check_constraint_type(constraint)
    if method is None:
        return "ar", CONSTRAINED_CHOICE
    return method, None


# Half-precision parameters XLA's CPU backend runs slower than float32: its bf16/fp16 matmuls
# and conversions are not vectorised like its float32 ones (benchmarks/README.md, "Half
# precision on the CPU").
_SLOW_ON_CPU = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _warn_if_slow_dtype(model: Model) -> None:
    """A :class:`PerformanceWarning` when ``model``'s parameters are bf16/fp16 on a CPU."""
    leaves = [x for x in jax.tree_util.tree_leaves(model.params)
              if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)]
    slow = sorted({x.dtype.name for x in leaves if jnp.dtype(x.dtype) in _SLOW_ON_CPU})
    if not slow or any(d.platform != "cpu" for x in leaves for d in x.devices()):
        return
    warnings.warn(
        f"{model.name}: {'/'.join(slow)} parameters on the CPU run slower than float32 there "
        f"(XLA's CPU matmuls in half precision: a one-token pass measured 7x slower in "
        f"bfloat16, 2x in float16); load with dtype='float32' or 'auto' on a CPU",
        PerformanceWarning, stacklevel=4)


def _load_resources(model: Model, settings: _Settings, draft, ngram) -> None:
    opts = settings.options
    draft_model = resolve_draft(model, draft) if opts.uses_draft else None
    tables = resolve_ngram(model, ngram) if opts.uses_ngram else None
    settings.method = methods.build(opts, None if draft_model is None else draft_model.config)
    settings.draft_model = draft_model
    constraint = None
    if settings.constraint is not None:
        # The method's constrained step; the automaton's tables are a resource (traced:
        # constraints of one size bucket share the compiled program).
        built, info = build_tables(settings.constraint, model.tokenizer,
                                   model.config.vocab_size, settings.stop_ids)
        constraint = jax.tree.map(jnp.asarray, built)
        settings.method = dataclasses.replace(settings.method, constrained=True)
        settings.constraint_stats = {
            "constraint": settings.constraint.describe(), "states": info.num_states,
            "token_classes": info.num_classes,
            "table_bucket": [info.state_bucket, info.class_bucket],
            "table_bytes": info.table_bytes, "build_seconds": info.seconds,
            "from_cache": info.from_cache}
    settings.resources = settings.method.build_resources(
        draft_params=None if draft_model is None else draft_model.params, tables=tables,
        constraint=constraint)


def _plan(model: Model, settings: _Settings, prompt_length: int) -> tuple[int, int]:
    """(prompt_bucket, capacity) for the longest prompt, checked against both models."""
    plan = plan_capacity(prompt_length, settings.max_new_tokens, settings.method.scratch,
                         model.config)
    if settings.draft_model is not None:
        plan_capacity(prompt_length, settings.max_new_tokens, settings.method.scratch,
                      settings.draft_model.config)
    return plan


def _loop(model: Model, settings: _Settings, prompt_length: int, capacity: int,
          prompt_bucket: int, kernels) -> decode.DecodeLoop:
    """The static program of a generation whose longest prompt has ``prompt_length``
    tokens, with the target's and the draft's configs for ``prompt_length +
    max_new_tokens`` positions (LongRoPE's factor set, picked once for the whole
    generation: :meth:`~specjax.config.ModelConfig.for_length`)."""
    length = prompt_length + settings.max_new_tokens
    method = settings.method
    if getattr(method, "draft_config", None) is not None:
        method = dataclasses.replace(method, draft_config=method.draft_config.for_length(length))
    return decode.DecodeLoop(config=model.config.for_length(length), capacity=capacity,
                             prompt_bucket=prompt_bucket, kernels=kernels, method=method)


def _prepare(model: Model, prompt, *, method, max_new_tokens, temperature, top_k, top_p,
             seed, draft, ngram, stop_tokens, chat, kernels, options,
             stop_strings: Sequence[str] = (), constraint=None) -> _Request:
    """One prompt's request; ``stop_strings`` end it on the device where they come out as
    one of their listed token sequences (:mod:`specjax.stop_strings`)."""
    settings = _settings(model, method=method, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         draft=draft, ngram=ngram, stop_tokens=stop_tokens,
                         kernels=kernels, options=options, stop_strings=stop_strings,
                         constraint=constraint)
    ids = encode_prompt(model, prompt, chat)
    _load_resources(model, settings, draft, ngram)
    prompt_bucket, capacity = _plan(model, settings, len(ids))
    loop = _loop(model, settings, len(ids), capacity, prompt_bucket, kernels)
    padded = np.zeros(prompt_bucket, np.int32)
    padded[: len(ids)] = ids
    args = (model.params, jnp.asarray(padded), jnp.int32(len(ids)), jnp.int32(max_new_tokens),
            settings.sampling, settings.stop, settings.resources)
    return _Request(loop, args, len(ids), settings.options, settings.choice,
                    settings.constraint_stats)


# ----------------------------------------------------------------------------- batches


@dataclasses.dataclass
class _Batch:
    """One compiled batch program's rows: ``rows`` are indices into the prompt list."""

    loop: decode.DecodeLoop
    args: tuple  # as decode.run_batch's, with [B] / [B, ...] per-row arrays
    rows: list[int]
    prompt_lengths: list[int]
    options: MethodOptions
    compact: bool = True  # live rows move to smaller programs as rows finish
    choice: str = "given"  # why this method (see _Request)
    constraint: dict | None = None  # see _Request


def is_batch(prompt) -> bool:
    """Whether ``prompt`` is a list of prompts (strings or token-id lists) rather than one
    prompt (a string or a list of token ids)."""
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
        return False
    return len(prompt) == 0 or all(isinstance(p, (str, list, tuple, np.ndarray))
                                   for p in prompt)


def _row_seeds(seed, rows: int) -> list[int]:
    if isinstance(seed, (list, tuple, np.ndarray)):
        seeds = list(seed)
        if len(seeds) != rows:
            raise InvalidArgumentError(f"seed: got {len(seeds)} seeds for {rows} prompts; give "
                                       f"one seed per prompt, or one int for every prompt")
    else:
        seeds = [seed] * rows
    for value in seeds:
        make_sampling_params(seed=value)  # the one-line error for a bad seed
    return [int(value) for value in seeds]


def _prepare_batch(model: Model, prompts, *, method, max_new_tokens, temperature, top_k,
                   top_p, seed, draft, ngram, stop_tokens, chat, kernels, batch: BatchOptions,
                   options, stop_strings: Sequence[str] = (), constraint=None) -> list[_Batch]:
    if len(prompts) == 0:
        raise InvalidArgumentError("the list of prompts is empty: give at least one prompt")
    limit = MAX_BATCH_SIZE
    batch_size = batch.size
    if batch_size is None:
        if len(prompts) > limit:
            raise InvalidArgumentError(
                f"{len(prompts)} prompts exceed the maximum batch size {limit}: pass "
                f"batch=specjax.BatchOptions(size=B) (B at most {limit}) to run them in "
                f"batches of B")
        batch_size = len(prompts)
    seeds = _row_seeds(seed, len(prompts))
    settings = _settings(model, method=method, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seeds[0],
                         draft=draft, ngram=ngram, stop_tokens=stop_tokens,
                         kernels=kernels, options=options, stop_strings=stop_strings,
                         constraint=constraint)
    encoded = []
    for index, prompt in enumerate(prompts):
        try:
            encoded.append(encode_prompt(model, prompt, chat))
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"prompts[{index}]: {error}") from None
    _load_resources(model, settings, draft, ngram)
    batches = []
    for rows in _batch_rows(model, encoded, settings.max_new_tokens, int(batch_size)):
        lengths = [len(encoded[row]) for row in rows]
        prompt_bucket, capacity = _plan(model, settings, max(lengths))
        loop = _loop(model, settings, max(lengths), capacity, prompt_bucket, kernels)
        size = batch_bucket(len(rows))
        # Padding rows: one token, one new token: done at prefill, then held.
        padded = np.zeros((size, prompt_bucket), np.int32)
        prompt_lengths = np.ones(size, np.int32)
        budgets = np.ones(size, np.int32)
        row_seeds = np.zeros(size, np.uint32)
        for slot, row in enumerate(rows):
            padded[slot, : lengths[slot]] = encoded[row]
            prompt_lengths[slot] = lengths[slot]
            budgets[slot] = settings.max_new_tokens
            row_seeds[slot] = seeds[row]
        stop = jax.tree.map(lambda x, size=size: jnp.broadcast_to(x, (size, *x.shape)),
                            settings.stop)
        args = (model.params, jnp.asarray(padded), jnp.asarray(prompt_lengths),
                jnp.asarray(budgets), batch_sampling(settings.sampling, row_seeds),
                stop, settings.resources)
        batches.append(_Batch(loop, args, rows, lengths, settings.options,
                              batch.compact_rows, settings.choice, settings.constraint_stats))
    return batches


def _batch_rows(model: Model, encoded: list, max_new_tokens: int,
                batch_size: int) -> list[list[int]]:
    """The prompts' row indices in batches of at most ``batch_size``, in order, except that
    rows whose configs differ by length (a LongRoPE model's rows within its pretraining
    length and those past it: :meth:`~specjax.config.ModelConfig.for_length`) never share a
    batch, so each row decodes as its own call would."""
    groups: dict = {}
    for row, ids in enumerate(encoded):
        groups.setdefault(model.config.for_length(len(ids) + max_new_tokens), []).append(row)
    return [rows[first:first + batch_size] for rows in groups.values()
            for first in range(0, len(rows), batch_size)]


def _host_rows(state: decode.DecodeState, count: int) -> list[decode.DecodeState]:
    """The first ``count`` rows of a batched state, on the host (caches left out)."""
    host = jax.device_get(without_buffers(state))
    return [jax.tree_util.tree_map(lambda x, i=i: x[i] if np.ndim(x) else x, host)
            for i in range(count)]


def _row_request(batch: _Batch, slot: int) -> _Request:
    return _Request(batch.loop, (), batch.prompt_lengths[slot], batch.options, batch.choice,
                    batch.constraint)


def _batch_stats(rows_state, batch: _Batch, counts: list[int], seconds: float,
                 compile_seconds: float, reasons=()) -> list[dict[str, Any]]:
    total = sum(counts)
    all_stats = []
    for slot, row in enumerate(batch.rows):
        try:
            stats = _stats(rows_state[slot], _row_request(batch, slot), counts[slot], seconds,
                           compile_seconds, reasons)
        except NumericalError as error:
            raise NumericalError(f"prompts[{row}]: {error}") from None
        stats["batch"] = {
            "row": row, "rows": len(batch.rows),
            "compiled_rows": int(batch.args[1].shape[0]),
            "new_tokens": total,
            "tokens_per_s": total / seconds if seconds > 0 else None,
        }
        all_stats.append(stats)
    return all_stats


def _generate_batch(model: Model, batches: list[_Batch],
                    stop: Sequence[str] = ()) -> list[GenerationResult]:
    """Each prompt's result, in the prompts' order (a batch's rows need not be
    consecutive prompts: :func:`_batch_rows`), each ended at its first ``stop`` string
    (:func:`_stop_cut`)."""
    results: list = [None] * sum(len(batch.rows) for batch in batches)
    for batch in batches:
        with fallbacks.collecting() as reasons:
            rows_state, tokens, compile_seconds, seconds = _run_batch(model, batch, stop)
        cuts = [_stop_cut(model, row_tokens, stop) for row_tokens in tokens]
        stats = _batch_stats(rows_state, batch, [count for count, _ in cuts], seconds,
                             compile_seconds, reasons)
        for slot, row in enumerate(batch.rows):
            results[row] = _result(model, tokens[slot], token_origins(rows_state[slot]),
                                   cuts[slot], stats[slot])
    return results


def _run_batch(model: Model, batch: _Batch, stop: Sequence[str]):
    """Runs ``batch``; returns (its rows' host states, their new tokens, compile seconds,
    run seconds). Runs it again without stop sequences where one row's ended it falsely
    (:func:`_false_stop`)."""
    args, compile_seconds, seconds = batch.args, 0.0, 0.0
    for _ in range(2):
        state, more, again = decode.run_batch(args[0], batch.loop, *args[1:],
                                              compact=batch.compact)
        compile_seconds, seconds = compile_seconds + more, seconds + again
        rows_state = _host_rows(state, len(batch.rows))
        tokens = [np.asarray(r.tokens)[int(r.prompt_length): int(r.length)].tolist()
                  for r in rows_state]
        if not any(_false_stop(model, row_tokens, stop, args[5]) for row_tokens in tokens):
            break
        args = (*args[:5], _without_sequences(args[5]), args[6])
    return rows_state, tokens, compile_seconds, seconds


def _stream_batch(model: Model, batches: list[_Batch], total_rows: int, origins: bool):
    del model
    all_stats: list = [None] * total_rows
    for batch in batches:
        compile_total, state, reasons = 0.0, None, set()
        counts = [0] * len(batch.rows)
        start = time.perf_counter()
        for new, state, compile_seconds in _collected(
                decode.stream_batch(batch.args[0], batch.loop, *batch.args[1:],
                                    compact=batch.compact), reasons):
            compile_total += compile_seconds
            rows_new: list[list[int]] = [[] for _ in range(total_rows)]
            for slot, row in enumerate(batch.rows):
                rows_new[row] = new[slot]
                counts[slot] += len(new[slot])
            if not any(rows_new):
                continue
            if origins:
                rows_state = _host_rows(state, len(batch.rows))
                names: list[list[str]] = [[] for _ in range(total_rows)]
                for slot, row in enumerate(batch.rows):
                    if new[slot]:
                        known = token_origins(rows_state[slot])
                        names[row] = (["target"] * len(new[slot]) if known is None else
                                      known[counts[slot] - len(new[slot]):counts[slot]])
                yield rows_new, names, None
            else:
                yield rows_new, None
        seconds = time.perf_counter() - start - compile_total
        rows_state = _host_rows(state, len(batch.rows))
        for slot, stats in enumerate(_batch_stats(rows_state, batch, counts, seconds,
                                                  compile_total, reasons)):
            all_stats[batch.rows[slot]] = stats
    yield ([], [], all_stats) if origins else ([], all_stats)


def _stats(state: decode.DecodeState, request: _Request, new_tokens: int, seconds: float,
           compile_seconds: float, reasons=()) -> dict[str, Any]:
    if bool(state.nonfinite):
        position = int(state.nonfinite_position)
        raise NumericalError(
            f"the model produced non-finite logits (NaN or inf) for the token at position "
            f"{position} (new token {position - request.prompt_length + 1}); generation "
            f"stopped there: check the weights and dtype")
    target_calls = int(state.target_calls) + 1  # + the prefill pass
    stats = {
        "method": request.options.name,
        # "given" (method= named it), or why the default is this method
        "method_choice": request.choice,
        "options": request.options.to_dict(),
        # how the program was built (KernelOptions, the backend's defaults made concrete)
        "kernels": request.loop.kernels.to_dict(),
        # whose defaults a method name gets here (methods.options.BACKEND_DEFAULTS)
        "backend": methods.options.backend_of(_platform(state.length)),
        # the sampling rule compiled alone, or "traced": every rule, chosen on the device
        "sampling_rule": state.sampling.rule or "traced",
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,  # None: too fast to time
        "compile_seconds": compile_seconds,
        "target_calls": target_calls,
        "draft_calls": int(state.draft_calls),
        "mean_accepted": new_tokens / target_calls,
    }
    if request.constraint is not None:  # the constraint and its automaton's tables
        stats["constraint"] = dict(request.constraint)
    counts = dict.fromkeys(ORIGIN_NAMES.values(), 0)
    tally = tally_of(state)
    if tally is None:  # ar: every token is the target's
        counts["target"] = new_tokens
    else:
        steps = np.asarray(tally.accepted)  # steps[c]: steps that accepted c drafts
        total = max(int(steps.sum()), 1)
        stats["accepted_histogram"] = steps.tolist()
        stats["acceptance_by_depth"] = [float(steps[d:].sum()) / total
                                        for d in range(1, len(steps))]
        stats["draft_calls_per_target_call"] = int(state.draft_calls) / target_calls
        for code, value in enumerate(np.asarray(tally.origin_counts).tolist()):
            counts[ORIGIN_NAMES[code]] = int(value)
    stats["tokens_by_origin"] = counts
    fallback = models.attention_fallback(request.loop.config, _platform(state.length))
    if fallback is not None:  # never silent: what ran instead of the attention kernels
        stats["attention_fallback"] = fallback
    # What the programs ran instead of what was asked for (specjax.kernels.fallbacks).
    stats["fallbacks"] = sorted(reasons)
    stats["exact"], stats["exact_reason"] = _exactness(state, request)
    return stats


def _exactness(state: decode.DecodeState, request: _Request) -> tuple[str, str]:
    """``stats["exact"]`` and why (:func:`specjax.methods.exactness.run_exactness`)."""
    options = request.options.to_dict()
    rows = options.get("tree_budget", options.get("draft_depth", 0) + 1)
    sampled = bool(np.any(np.asarray(state.sampling.temperature) > 0))
    return run_exactness(request.options.name, options.get("verify"), sampled,
                         _platform(state.length), request.loop.kernels, rows)


def token_origins(state: decode.DecodeState) -> list[str] | None:
    """The origin of every generated token, or ``None`` for ``ar``."""
    tally = tally_of(state)
    if tally is None:
        return None
    codes = np.asarray(tally.origins)[int(state.prompt_length): int(state.length)]
    return [origin_name(c) for c in codes]


def decode_text(model: Model, tokens: list[int]) -> str:
    if model.tokenizer is None:
        return ""
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


@dataclasses.dataclass
class _Arguments:
    """:func:`generate`'s keywords as the request functions take them."""

    settings: dict  # _prepare's keywords (and _prepare_batch's, but for batch)
    stop: tuple[str, ...]  # stop strings (checked on the host)
    batch: BatchOptions | None
    progress: bool


def _arguments(model: Model, *, method, max_new_tokens, temperature, top_k, top_p, seed,
               stop, chat, kernels, batch, progress, options: dict) -> _Arguments:
    """Checks the keywords and takes the resources (``draft``, ``ngram``) out of
    ``options``."""
    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a specjax.Model (from specjax.load), got "
                                   f"{type(model).__name__}")
    options = dict(options)
    strings, stop_tokens = split_stop(stop)
    if batch is not None and not isinstance(batch, BatchOptions):
        raise InvalidArgumentError(f"batch must be a specjax.BatchOptions, got "
                                   f"{type(batch).__name__}")
    settings = dict(method=method, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=seed, draft=options.pop("draft", None),
                    ngram=options.pop("ngram", None),
                    constraint=options.pop("constraint", None), stop_tokens=stop_tokens,
                    chat=chat,
                    kernels=kernel_options(model, kernels), options=options)
    return _Arguments(settings, strings, batch,
                      bool(model.progress if progress is None else progress))


def generate(model: Model, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *,
             method: str | MethodOptions | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | Sequence[int] = 0, stop: str | int | Sequence[str | int] | None = None,
             chat: bool = False, kernels: KernelOptions | None = None,
             batch: BatchOptions | None = None, progress: bool | None = None,
             **options) -> GenerationResult | list[GenerationResult]:
    """Generates a continuation as one compiled program on the device.

    A list of prompts is a batch: the rows decode together in one program (weights read
    once per step for all rows), each with its own length, cache cursor, accepted count
    per step and stop condition, and each row's tokens are exactly those of its own
    batch-1 call with the same settings and seed. The result is a list, one
    :class:`GenerationResult` per prompt, in order.

    Threads may call it (and :func:`stream_generate`) on one shared :class:`Model` at
    once: a program several threads need for the first time is compiled once, the others
    wait for it (``tests/test_reliability.py``). Non-finite target logits raise
    :class:`~specjax.errors.NumericalError` naming the position where generation stopped.

    Args:
      model: a :class:`Model` from :func:`load` (or :meth:`Model.from_params`).
      prompt: a string (tokenized with the model's tokenizer) or a list of token ids;
        or a list of such prompts (a batch; at most ``MAX_BATCH_SIZE`` = 64 unless
        ``batch`` gives a size).
      method: a method name -- ``"ar"`` (autoregressive), ``"spec"`` (draft chain,
        Leviathan/Chen), ``"tree"`` (draft token tree verified in one target pass),
        ``"staged"`` (draft model helped by n-gram tables and context lookup) or
        ``"ngram"`` (n-gram + context-lookup trees, no draft model) -- or an options
        object (:class:`~specjax.methods.StagedOptions` ...). Default: the method
        measured fastest for the model's backend at ``temperature`` among those its
        shipped draft and tables allow, ``"ar"`` where none beat it
        (:func:`specjax.loading.choose_default_method`; ``stats["method_choice"]``).
      max_new_tokens: upper bound on generated tokens (traced: no recompilation).
      temperature: 0 for greedy; otherwise sampling temperature (traced).
      top_k: keep the k most likely tokens; 0 disables (traced).
      top_p: nucleus mass in (0, 1]; 1 disables (traced).
      seed: sampling seed; the noise of token t depends only on (seed, t) (traced). For
        a batch: one int used by every row (so a row's output does not depend on its
        place in the list), or a list with one seed per prompt.
      stop: what ends generation: a string, a token id, or a list of them. Token ids
        end it on the device, in place of the model's EOS ids (the default; list them
        too to keep them); an empty list ends it at ``max_new_tokens`` only (no EOS). A
        string ends the text: it is cut before the first one
        found, and ``tokens`` at the token that completed it (``stats["stop_string"]``
        names it). :func:`generate` also ends the program on the device at the first
        token that completes one of the token sequences spelling a string (the tokens
        whose text contains it, then sequences of up to 4 tokens whose joined texts do,
        from the tokenizer: :mod:`specjax.stop_strings`; at most 128 for all strings),
        so the tokens after it are not computed; a string that comes out in another
        tokenization is cut on the host, so the text and tokens are always those of the
        rule above, and ``stats`` (``new_tokens``, ``tokens_per_s``,
        ``tokens_by_origin``) count the tokens returned. :func:`stream_generate` checks
        the text after each step and stops at the step that completed a string.
      chat: wrap a string prompt in the model's chat template.
      kernels: a :class:`~specjax.KernelOptions`: the attention implementation (``"fused"``,
        Llama family, GPU/TPU: the Pallas kernels for attention and every projection,
        row-tiled, so a verify pass reproduces the one-token step bit for bit; fuse the
        weights first, :meth:`Model.with_fused_projections`), the kernels' backends,
        sampling rules and XLA compiler options. Default: the model's backend's
        (:meth:`KernelOptions.default`); ``stats["kernels"]`` records what ran.
      batch: a batch only: a :class:`~specjax.BatchOptions` (rows per compiled program,
        moving live rows to smaller programs as rows finish). Default: the whole list in
        one program, compacted.
      progress: print each load and compilation and its time on stderr (a compiled
        program is kept for the process: the same settings do not compile again).
        ``None``: the model's setting (``Model.progress``, set by ``load(...,
        progress=True)`` or :meth:`Model.with_progress`).
      **options: the method's options by name (see its options class: e.g.
        ``tree_budget``, ``draft_depth``, ``draft_width``, ``draft_rounds``,
        ``proposal``, ``use_lookup``, ``stage2_prior``, ``topology``, ``verify``), an
        option the method does not take being an error naming both; and the resources it
        decodes with: ``draft`` (``spec``/``tree``/``staged``: a :class:`Model`, a
        shipped draft's name such as ``"smollm2-135m-draft"``, ``"first-layers:K"``, a
        draft asset folder or any model :func:`load` accepts, sharing the target's
        tokenizer; default: the draft shipped for the model) and ``ngram``
        (``staged``/``ngram``: a ``specjax build-ngram`` file or
        :class:`~specjax.drafters.ngram.NgramTables`; default: the shipped tables). And
        ``constraint``: a :class:`~specjax.constraints.Regex` or
        :class:`~specjax.constraints.JsonSchema` the output must match (an automaton on
        the device, every method; ``ar`` is the default under one;
        ``stats["constraint"]``).
    Returns:
      :class:`GenerationResult` with ``text``, ``tokens``, ``stats`` and, for the
      speculative methods, ``origins``; for a batch a list of them, whose ``stats`` also
      hold ``"batch"``: ``row`` (index in the list), ``rows`` and ``compiled_rows`` (this
      program's real and padded row counts), ``new_tokens`` and ``tokens_per_s`` (all rows
      of the program together; ``seconds`` is the program's time, shared by its rows).
    """
    call = _arguments(model, method=method, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                      chat=chat, kernels=kernels, batch=batch, progress=progress,
                      options=options)
    if is_batch(prompt):
        batches = _prepare_batch(model, prompt, batch=call.batch or BatchOptions(),
                                 stop_strings=call.stop, **call.settings)
        with _reporting(call.progress):
            return _generate_batch(model, batches, call.stop)
    _check_one_prompt(call)
    request = _prepare(model, prompt, stop_strings=call.stop, **call.settings)
    args = request.args
    with _reporting(call.progress), fallbacks.collecting() as reasons:
        state, compile_seconds, seconds = decode.run_program(args[0], request.loop, *args[1:])
        tokens = np.asarray(state.tokens)[request.prompt_length: int(state.length)].tolist()
        if _false_stop(model, tokens, call.stop, args[5]):  # see _false_stop: run again
            state, more, again = decode.run_program(args[0], request.loop, *args[1:5],
                                                    _without_sequences(args[5]), args[6])
            compile_seconds, seconds = compile_seconds + more, seconds + again
            tokens = np.asarray(state.tokens)[request.prompt_length: int(state.length)].tolist()
    cut = _stop_cut(model, tokens, call.stop)
    stats = _stats(state, request, cut[0], seconds, compile_seconds, reasons)
    return _result(model, tokens, token_origins(state), cut, stats)


def _check_one_prompt(call: _Arguments) -> None:
    if call.batch is not None and call.batch.size is not None:
        # (compact_rows alone is harmless on one prompt, as it always was)
        raise InvalidArgumentError("a batch size (BatchOptions.size) applies to a list of "
                                   "prompts only")
    _check_one_seed(call.settings["seed"])


def _check_one_seed(seed) -> None:
    if isinstance(seed, (list, tuple, np.ndarray)):
        raise InvalidArgumentError(f"seed: a list of seeds ({len(seed)}) goes with a list of "
                                   "prompts; give one int for one prompt")


def stop_strings(stop) -> tuple[str, ...]:
    """``stop=`` as a tuple of non-empty strings (one string is a tuple of one).

    Raises:
      InvalidArgumentError: not a string or a list of non-empty strings.
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(
            isinstance(item, str) and item for item in items):
        raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got "
                                   f"{stop!r}")
    return tuple(items)


def split_stop(stop) -> tuple[tuple[str, ...], list[int] | None]:
    """``stop=`` as (stop strings, stop token ids): the ids are ``None`` (the model's EOS
    ids) unless ids are given, and ``[]`` (no stop token) for an empty list.

    Raises:
      InvalidArgumentError: not a string, a token id, or a list of them.
    """
    items = [stop] if isinstance(stop, (int, np.integer)) else stop
    if not isinstance(items, (list, tuple)):
        return stop_strings(stop), None
    if not items:
        return (), []
    ids = [item for item in items if isinstance(item, (int, np.integer))]
    if any(isinstance(item, bool) for item in ids):
        raise InvalidArgumentError(f"stop: a token id must be an integer, got {stop!r}")
    strings = stop_strings([item for item in items if not isinstance(item, (int, np.integer))])
    return strings, ([int(item) for item in ids] or None)


def first_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(index, string) of the earliest stop string in ``text``, or ``None``."""
    found = [(text.find(item), item) for item in stop if item in text]
    return min(found) if found else None


def _stop_cut(model: Model, tokens: list[int], stop: Sequence[str]
              ) -> tuple[int, tuple[int, str] | None]:
    """Where ``tokens`` end at their first stop string: (tokens kept: through the one that
    completed it, or all; ``first_stop`` of the kept tokens' text, or ``None``)."""
    if not stop or first_stop(decode_text(model, tokens), stop) is None:
        return len(tokens), None
    count = next(k for k in range(1, len(tokens) + 1)
                 if first_stop(decode_text(model, tokens[:k]), stop) is not None)
    return count, first_stop(decode_text(model, tokens[:count]), stop)


def _result(model: Model, tokens: list[int], origins: list[str] | None,
            cut: tuple[int, tuple[int, str] | None], stats: dict) -> GenerationResult:
    """The result of ``tokens`` ended at ``cut`` (:func:`_stop_cut`): the text before the
    stop string, the tokens up to the one that completed it; ``stats`` (already counting
    the kept tokens) get ``stop_string`` and the kept tokens' origins."""
    count, found = cut
    text = decode_text(model, tokens[:count])
    if found is not None:
        text = text[:found[0]]
        stats["stop_string"] = found[1]
    origins = None if origins is None else origins[:count]
    if count < len(tokens):  # the tally counted the tokens past the stop string too
        counts = dict.fromkeys(ORIGIN_NAMES.values(), 0)
        for name in origins or ["target"] * count:
            counts[name] += 1
        stats["tokens_by_origin"] = counts
    return GenerationResult(text=text, tokens=tokens[:count], stats=stats, origins=origins)


def _false_stop(model: Model, tokens: list[int], stop: Sequence[str],
                condition: StopCondition) -> bool:
    """Whether the device ended ``tokens`` at a stop sequence (:mod:`specjax.stop_strings`)
    whose text holds no stop string: the sequences are checked against the tokenizer in a
    few contexts, not all, so where one fails the request runs again without them (same
    program), and its text is exactly that of the host rule."""
    if not stop:
        return False
    # A batch's rows share their sequences: its first row's.
    rows = np.asarray(condition.sequences).reshape(-1, MAX_STOP_SEQUENCES, MAX_STOP_LENGTH)[0]
    lengths = np.asarray(condition.lengths).reshape(-1, MAX_STOP_SEQUENCES)[0]
    ends = any(0 < n <= len(tokens) and row[len(row) - n:].tolist() == tokens[len(tokens) - n:]
               for row, n in zip(rows, lengths.tolist()))
    return ends and first_stop(decode_text(model, tokens), stop) is None


def _without_sequences(condition: StopCondition) -> StopCondition:
    """``condition`` with its stop sequences off (same shapes: the same program)."""
    return condition.replace(lengths=jnp.zeros_like(condition.lengths))


_GENERATE_SIGNATURE = inspect.signature(generate)


def stream_generate(model: Model, prompt: str | Sequence[int], *, origins: bool = False,
                    **kwargs) -> Iterator[tuple]:
    """Like :func:`generate`, but driven from Python over the same jitted step.

    Takes the same keyword arguments as :func:`generate` (same defaults). Yields
    ``(new_token_ids, None)`` as tokens are produced, then ``([], stats)`` once. With
    ``origins=True`` it yields ``(new_token_ids, new_token_origins, None)`` and then
    ``([], [], stats)``; origins are ``"ngram"``, ``"lookup"``, ``"draft"`` or ``"target"``.

    A list of prompts streams as a batch: each yield holds one list per prompt (in order,
    ``len(prompts)`` lists, empty for rows with nothing new), ``(rows_new_token_ids,
    None)`` (or ``(rows_new_token_ids, rows_new_token_origins, None)``), and the last one
    is ``([], stats_list)`` (or ``([], [], stats_list)``), one stats dict per prompt.
    """
    try:
        bound = _GENERATE_SIGNATURE.bind(model, prompt, **kwargs)
    except TypeError as error:
        raise InvalidArgumentError(str(error)) from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("model"), arguments.pop("prompt")
    call = _arguments(model, **arguments)
    stop, progress = call.stop, call.progress
    if is_batch(prompt):
        if stop:
            raise InvalidArgumentError("stop strings apply to one streamed prompt; for a "
                                       "batch use generate")
        batches = _prepare_batch(model, prompt, batch=call.batch or BatchOptions(),
                                 **call.settings)
        with _reporting(progress):
            yield from _stream_batch(model, batches, len(prompt), origins)
        return
    _check_one_prompt(call)
    request = _prepare(model, prompt, **call.settings)
    compile_total, state, tokens, found, reasons = 0.0, None, [], None, set()
    start = time.perf_counter()
    with _reporting(progress):
        steps = _collected(decode.stream(request.args[0], request.loop, *request.args[1:]),
                           reasons)
        for new, state, compile_seconds in steps:
            compile_total += compile_seconds
            if stop and new:
                # Keep the tokens up to the one that completes a stop string, then stop.
                for keep in range(1, len(new) + 1):
                    found = first_stop(decode_text(model, tokens + new[:keep]), stop)
                    if found is not None:
                        break
                new = new[:keep]
            tokens += new
            count = len(tokens)
            if new and origins:
                names = token_origins(state)
                names = (["target"] * len(new) if names is None
                         else names[count - len(new):count])
                yield new, names, None
            elif new:
                yield new, None
            if found is not None:
                steps.close()
                break
    seconds = time.perf_counter() - start - compile_total
    stats = _stats(state, request, len(tokens), seconds, compile_total, reasons)
    if found is not None:
        stats["stop_string"] = found[1]
    yield ([], [], stats) if origins else ([], stats)
