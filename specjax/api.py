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

from specjax import calibration, decode, loading, methods, models, progress as progress_lib
from specjax.batch_options import BatchOptions
from specjax.compilation_cache import use_compilation_cache
from specjax.errors import InvalidArgumentError, NumericalError, PerformanceWarning
from specjax.kernel_options import KernelOptions
from specjax.kernels import fallbacks
from specjax.loaded_model import Model, check_draft_compatible, encode_prompt, resolve_dtype
from specjax.loading import choose_default_method
from specjax.methods import MethodOptions
from specjax.methods.common import tally_of
from specjax.methods.exactness import run_exactness
from specjax.origins import ORIGIN_NAMES, origin_name
from specjax.requests import (Batch, Request, bind, constrained_method,
                              is_batch, kernel_options, model_backend, plan, platform_of,
                              prepare_batch, program, request, resolve_method, split_stop,
                              stop_strings)
from specjax.state import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, StopCondition, without_buffers

__all__ = ["BatchOptions", "GenerationResult", "KernelOptions", "Model",
           "Request", "check_draft_compatible", "choose_default_method", "constrained_method",
           "decode_text", "encode_prompt", "generate", "kernel_options", "load",
           "model_backend", "request", "resolve_dtype", "resolve_method", "split_stop",
           "stop_strings", "stream_generate"]


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
    calibration: dict | None = None  # what the default's choice timed here (calibration)


def _prepare(model: Model, prompt, req: Request) -> _Request:
    """One prompt's program and arguments; the request's stop strings end it on the device
    where they come out as one of their listed token sequences (:mod:`specjax.stop_strings`)."""
    settings, (ids,) = bind(model, req, [prompt], listed=False)
    prompt_bucket, capacity = plan(model, settings, len(ids))
    loop = program(model, settings, len(ids), capacity, prompt_bucket)
    padded = np.zeros(prompt_bucket, np.int32)
    padded[: len(ids)] = ids
    args = (model.params, jnp.asarray(padded), jnp.int32(len(ids)),
            jnp.int32(req.max_new_tokens), settings.sampling, settings.stop,
            settings.resources)
    return _Request(loop, args, len(ids), req.options, req.choice, settings.constraint_stats,
                    req.calibration)


# ----------------------------------------------------------------------------- batches


def _host_rows(state: decode.DecodeState, count: int) -> list[decode.DecodeState]:
    """The first ``count`` rows of a batched state, on the host (caches left out)."""
    host = jax.device_get(without_buffers(state))
    return [jax.tree_util.tree_map(lambda x, i=i: x[i] if np.ndim(x) else x, host)
            for i in range(count)]


def _row_request(batch: Batch, slot: int) -> _Request:
    return _Request(batch.loop, (), batch.prompt_lengths[slot], batch.options, batch.choice,
                    batch.constraint)


def _batch_stats(rows_state, batch: Batch, counts: list[int], seconds: float,
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


def _generate_batch(model: Model, batches: list[Batch],
                    stop: Sequence[str] = ()) -> list[GenerationResult]:
    """Each prompt's result, in the prompts' order (a batch's rows need not be
    consecutive prompts: :func:`batch_rows`), each ended at its first ``stop`` string
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


def _run_batch(model: Model, batch: Batch, stop: Sequence[str]):
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


def _stream_batch(model: Model, batches: list[Batch], total_rows: int, origins: bool):
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
        "backend": methods.options.backend_of(platform_of(state.length)),
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
    if request.calibration is not None:  # the step costs the default was chosen by
        stats["calibration"] = dict(request.calibration)
    counts = dict.fromkeys(ORIGIN_NAMES.values(), 0)
    tally = tally_of(state)
    if tally is None:  # ar: every token is the target's
        counts["target"] = new_tokens
        forced = getattr(state.method_state, "forced", None)
        if forced is not None:  # under a constraint: committed without a pass of their own
            stats["forced_tokens"] = int(forced)
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
    fallback = models.attention_fallback(request.loop.config, platform_of(state.length))
    if fallback is not None:  # never silent: what ran instead of the attention kernels
        stats["attention_fallback"] = fallback
    # What the programs ran instead of what was asked for (specjax.kernels.fallbacks).
    stats["fallbacks"] = sorted(str(reason) for reason in reasons)
    stats["exact"], stats["exact_reason"] = _exactness(state, request, reasons)
    return stats


def _exactness(state: decode.DecodeState, request: _Request,
               fallbacks) -> tuple[str, str]:
    """``stats["exact"]`` and why (:func:`specjax.methods.exactness.run_exactness`;
    ``fallbacks``: the run's :class:`~specjax.kernels.fallbacks.Fallback` records)."""
    options = request.options.to_dict()
    rows = options.get("tree_budget", options.get("draft_depth", 0) + 1)
    if request.constraint is not None:  # ar's pass over a forced run (jump-forward)
        rows = max(rows, options.get("jump_forward", 0) + 1)
    sampled = bool(np.any(np.asarray(state.sampling.temperature) > 0))
    return run_exactness(request.options.name, options.get("verify"), sampled,
                         platform_of(state.length), request.loop.kernels, rows, fallbacks)


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


def _request_of(model: Model, given: Request | None, keywords: dict) -> Request:
    """The request of a :func:`generate` call: ``given`` (``request=``), or one
    :func:`request` makes of ``keywords`` for the model's backend and assets."""
    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a specjax.Model (from specjax.load), got "
                                   f"{type(model).__name__}")
    if given is None:
        return request(backend=model_backend(model), assets=model.assets, **keywords)
    defaults = _REQUEST_DEFAULTS
    beside = sorted(name for name, value in keywords.items()
                    if name not in defaults or not _same(value, defaults[name]))
    if beside:
        raise InvalidArgumentError(f"{', '.join(beside)} given beside request=: the request "
                                   f"holds every setting (make it with them)")
    return given


def _same(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _progress_of(model: Model, req: Request) -> bool:
    return bool(model.progress if req.progress is None else req.progress)


def generate(model: Model, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], *,
             method: str | MethodOptions | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | Sequence[int] = 0, stop: str | int | Sequence[str | int] | None = None,
             chat: bool = False, kernels: KernelOptions | None = None,
             batch: BatchOptions | None = None, progress: bool | None = None,
             request: Request | None = None,
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
        ``stats["constraint"]``); for a batch, also a list of one per prompt (``None``:
        that row unconstrained), the rows grouped by constraint into programs.
      request: a :class:`Request` (:func:`request`) holding every setting above, checked
        before the model loaded (the ``specjax generate`` command's way); no other keyword
        may then be given.
    Returns:
      :class:`GenerationResult` with ``text``, ``tokens``, ``stats`` and, for the
      speculative methods, ``origins``; for a batch a list of them, whose ``stats`` also
      hold ``"batch"``: ``row`` (index in the list), ``rows`` and ``compiled_rows`` (this
      program's real and padded row counts), ``new_tokens`` and ``tokens_per_s`` (all rows
      of the program together; ``seconds`` is the program's time, shared by its rows).
    """
    req = _request_of(model, request, dict(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, stop=stop, chat=chat, kernels=kernels, batch=batch,
        progress=progress, **options))
    stop_strings = req.stop_strings
    if is_batch(prompt):
        batches = prepare_batch(model, prompt, req)
        with _reporting(_progress_of(model, req)):
            return _generate_batch(model, batches, stop_strings)
    _check_one_prompt(req)
    prepared = _prepare(model, prompt, calibration.calibrated(model, req, generate))
    args = prepared.args
    with _reporting(_progress_of(model, req)), fallbacks.collecting() as reasons:
        state, compile_seconds, seconds = decode.run_program(args[0], prepared.loop, *args[1:])
        tokens = np.asarray(state.tokens)[prepared.prompt_length: int(state.length)].tolist()
        if _false_stop(model, tokens, stop_strings, args[5]):  # see _false_stop: run again
            state, more, again = decode.run_program(args[0], prepared.loop, *args[1:5],
                                                    _without_sequences(args[5]), args[6])
            compile_seconds, seconds = compile_seconds + more, seconds + again
            tokens = np.asarray(state.tokens)[
                prepared.prompt_length: int(state.length)].tolist()
    cut = _stop_cut(model, tokens, stop_strings)
    stats = _stats(state, prepared, cut[0], seconds, compile_seconds, reasons)
    return _result(model, tokens, token_origins(state), cut, stats)


def _check_one_prompt(req: Request) -> None:
    if isinstance(req.constraint, tuple):
        raise InvalidArgumentError("constraint: a list of constraints (one per prompt) goes "
                                   "with a list of prompts, not one prompt")
    if req.batch is not None and req.batch.size is not None:
        # (compact_rows alone is harmless on one prompt, as it always was)
        raise InvalidArgumentError("a batch size (BatchOptions.size) applies to a list of "
                                   "prompts only")
    _check_one_seed(req.seed)


def _check_one_seed(seed) -> None:
    if isinstance(seed, (list, tuple, np.ndarray)):
        raise InvalidArgumentError(f"seed: a list of seeds ({len(seed)}) goes with a list of "
                                   "prompts; give one int for one prompt")



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
_REQUEST_DEFAULTS = {name: parameter.default
                     for name, parameter in _GENERATE_SIGNATURE.parameters.items()
                     if parameter.default is not inspect.Parameter.empty}


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
    given = arguments.pop("request")
    arguments.update(arguments.pop("options"))
    req = _request_of(model, given, arguments)
    stop, progress = req.stop_strings, _progress_of(model, req)
    if is_batch(prompt):
        if stop:
            raise InvalidArgumentError("stop strings apply to one streamed prompt; for a "
                                       "batch use generate")
        batches = prepare_batch(model, prompt, req)
        with _reporting(progress):
            yield from _stream_batch(model, batches, len(prompt), origins)
        return
    _check_one_prompt(req)
    request = _prepare(model, prompt, calibration.calibrated(model, req, generate))
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
