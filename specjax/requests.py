"""One request path: :func:`request` checks every setting of a generation before anything
loads and makes a frozen :class:`Request`; :func:`bind` checks it against a model and loads
its resources (the draft, the n-gram tables, a constraint's automaton); :func:`plan` and
:func:`program` give the compiled program's key for a prompt length. :func:`specjax.generate`,
:func:`specjax.stream_generate` and the ``specjax generate`` command all go through here.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, loading, methods, models
from specjax.batch_options import BatchOptions
from specjax.constraints import build_tables, check_constraint_type
from specjax.errors import InvalidArgumentError, PerformanceWarning
from specjax.kernel_options import KernelOptions
from specjax.loaded_model import Model, encode_prompt
from specjax.loading import (check_resources, choose_default_method, resolve_draft,
                             resolve_ngram)
from specjax.methods import MethodOptions
from specjax.sampling import make_sampling_params, static_rules
from specjax.state import (MAX_BATCH_SIZE, Method, StopCondition, batch_bucket, batch_sampling,
                           plan_capacity, stop_condition)
from specjax.stop_strings import stop_sequences


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
    return _resolve_method(model_backend(model), model.assets, method, temperature,
                           options)[0]


def _resolve_method(backend: str, assets: str | None, method, temperature,
                    options, constrained: bool = False) -> tuple[MethodOptions, str]:
    if isinstance(method, MethodOptions):
        clash = sorted(name for name, value in options.items() if value is not None
                       and name in method.given and getattr(method, name) != value)
        if clash:  # one place for each setting: a keyword would silently win
            raise InvalidArgumentError(
                f"{', '.join(clash)} given as a keyword and, with another value, in the "
                f"{type(method).__name__} passed as method=: set it in one place")
    choice = "given"
    if method is None:
        method, choice = choose_default_method(assets, backend, float(temperature),
                                               constrained)
    return methods.method_options(method, backend=backend, **options), choice


def model_backend(model: Model) -> str:
    """Whose method defaults the model gets: ``cpu``, ``gpu`` or ``tpu``, from the device
    its weights are on (:func:`specjax.methods.options.backend_of`)."""
    return methods.options.backend_of(platform_of(jax.tree_util.tree_leaves(model.params)[0]))


def platform_of(array) -> str:
    devices = getattr(array, "devices", None)
    return next(iter(devices())).platform if callable(devices) else jax.default_backend()


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: every setting of a generation but the model and the prompts, as
    :func:`request` makes it from :func:`generate`'s keywords, before anything loads.
    :func:`generate` and :func:`stream_generate` build one from their keywords (or take one
    as ``request=``); the ``specjax generate`` command builds it from its flags, so both
    run the same checks and the same default-method choice.

    Attributes:
      backend: whose defaults it resolved (``cpu``, ``gpu`` or ``tpu``); a model whose
        weights are on another backend refuses it.
      assets: the shipped assets the default method was chosen for (``Model.assets``).
      options: the method's options, concrete for ``backend``.
      choice: ``"given"`` (the method was named) or why the default is this method
        (``stats["method_choice"]``).
      kernels: the :class:`KernelOptions`, concrete for ``backend``.
      stop_strings, stop_tokens: ``stop=`` split (:func:`split_stop`).
      draft, ngram, constraint: the resources as given (names, paths or objects); a
        batch's ``constraint`` may be a tuple, one per prompt (``None``: unconstrained).
      calibrate: the method is the default, chosen by the table alone (no method, method
        option, draft or tables given; under a constraint, by the constrained table):
        :mod:`specjax.calibration` may choose again from this machine's step costs once
        the model is known.
      calibration: what that choice timed (``stats["calibration"]``), or ``None``.
    """

    backend: str
    assets: str | None
    options: MethodOptions
    choice: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: Any  # an int, or a tuple of ints (one per prompt of a batch)
    stop_strings: tuple[str, ...]
    stop_tokens: tuple[int, ...] | None
    chat: bool
    kernels: KernelOptions
    draft: Any = None
    ngram: Any = None
    constraint: Any = None
    batch: BatchOptions | None = None
    progress: bool | None = None
    calibrate: bool = False
    calibration: dict | None = None

    def replace(self, **changes) -> "Request":
        """This request with other seeds (one per prompt: checked per row when the prompts
        are known), its resources loaded (``draft=`` a :class:`Model`, ``ngram=``
        tables: checked when the request meets the model), or, for a request made under a
        constraint (whose method was chosen for one), another constraint or one per
        prompt (e.g. a slice of a longer list for a batch of some of its prompts); every
        other setting is fixed once checked: make a new request for it."""
        fixed = sorted(set(changes) - {"seed", "draft", "ngram", "constraint"})
        if fixed:
            raise InvalidArgumentError(f"Request.replace changes the seed, draft, ngram or "
                                       f"constraint only, not {', '.join(fixed)}: make a new "
                                       f"request")
        if "constraint" in changes:
            if self.constraint is None:
                raise InvalidArgumentError("Request.replace changes the constraint of a "
                                           "request made under one only: make a new request")
            new = changes["constraint"]
            if isinstance(new, (list, tuple)):
                new = row_constraints(new)
            elif new is not None:
                check_constraint_type(new)
            changes["constraint"] = new
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A :class:`Request` bound to a model (:func:`bind`): checked against it, its
    resources loaded."""

    request: Request
    sampling: Any  # SamplingParams (scalars)
    stop: StopCondition
    stop_ids: tuple[int, ...]  # the tokens that end a row (a constraint's EOS)
    method: Method
    draft_model: Model | None
    resources: Any  # the method's own (Method.build_resources)
    constraint_stats: dict | None  # the constraint and its tables (None: unconstrained)


def kernel_options(backend: str, kernels: KernelOptions | None = None) -> KernelOptions:
    """The :class:`KernelOptions` a request on ``backend`` runs with: ``kernels`` with its
    ``auto`` values made concrete for it, or its :meth:`KernelOptions.default`."""
    if kernels is None:
        kernels = KernelOptions.default(backend)
    elif not isinstance(kernels, KernelOptions):
        raise InvalidArgumentError(f"kernels must be a specjax.KernelOptions, got "
                                   f"{type(kernels).__name__}")
    return kernels.resolved(backend)


def _check_kernels(model: Model, backend: str, kernels: KernelOptions) -> None:
    if kernels.attention == "fused" and not models.has_fused_layers(model.config):
        # Running the default layers instead would drop the bitwise guarantee silently.
        raise InvalidArgumentError(
            f"attention 'fused' needs a Llama-family model (the fused layers); {model.name}: "
            f"{models.no_fused_layers_reason(model.config)}: use 'auto' or 'kernel'")
    if kernels.attention == "fused" and backend == "cpu":
        warnings.warn(
            f"{model.name}: attention 'fused' on the CPU runs its Pallas kernels in Pallas' "
            f"interpreter, several times slower than 'auto' (it is meant for GPU/TPU); use "
            f"KernelOptions(attention='auto') on a CPU", PerformanceWarning, stacklevel=5)


def request(*, backend: str | None = None, assets: str | None = None,
            method: str | MethodOptions | None = None, max_new_tokens: int = 128,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            seed: int | Sequence[int] = 0, stop: str | int | Sequence[str | int] | None = None,
            chat: bool = False, kernels: KernelOptions | None = None,
            batch: BatchOptions | None = None, progress: bool | None = None,
            **options) -> Request:
    """A checked :class:`Request` of :func:`generate`'s keywords (same meanings and
    defaults) for a model on ``backend`` with the shipped ``assets`` (``Model.assets``,
    which the default method depends on): every check that needs no weights, and the
    default-method choice, before anything loads. ``backend``: a platform name
    (default: JAX's default backend, where :func:`load` puts a model).

    Raises:
      InvalidArgumentError: the first setting that is wrong, in one line.
    """
    backend = jax.default_backend() if backend is None else backend
    if not isinstance(backend, str) or backend.lower() not in methods.options.PLATFORMS:
        raise InvalidArgumentError(f"backend must be 'cpu', 'gpu' or 'tpu', got {backend!r}")
    backend = methods.options.backend_of(backend)
    options = dict(options)
    draft, ngram = options.pop("draft", None), options.pop("ngram", None)
    constraint = options.pop("constraint", None)
    make_sampling_params(temperature, top_k, top_p, _first_seed(seed))  # a bad temperature first
    if isinstance(constraint, (list, tuple)):  # one per prompt of a batch
        constraint = row_constraints(constraint)
    calibrate = (method is None and draft is None and ngram is None
                 and all(value is None for value in options.values()))
    if constraint is not None:
        opts, choice = constrained_method(method, constraint, backend, assets, temperature,
                                          options)
    else:
        opts, choice = _resolve_method(backend, assets, method, temperature, options)
    opts.check_sampling(float(temperature))
    check_resources(opts, draft, ngram)
    if isinstance(draft, (str, os.PathLike)):
        loading.check_draft_spec(draft)
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
            or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got "
                                   f"{max_new_tokens}")
    strings, stop_tokens = split_stop(stop)
    if batch is not None and not isinstance(batch, BatchOptions):
        raise InvalidArgumentError(f"batch must be a specjax.BatchOptions, got "
                                   f"{type(batch).__name__}")
    return Request(backend=backend, assets=assets, options=opts,
                   choice=choice, max_new_tokens=int(max_new_tokens),
                   temperature=float(temperature), top_k=top_k, top_p=top_p,
                   seed=tuple(seed) if isinstance(seed, (list, tuple, np.ndarray)) else seed,
                   stop_strings=strings,
                   stop_tokens=None if stop_tokens is None else tuple(stop_tokens),
                   chat=bool(chat), kernels=kernel_options(backend, kernels), draft=draft,
                   ngram=ngram, constraint=constraint, batch=batch, progress=progress,
                   calibrate=calibrate)


def _first_seed(seed):
    """The seed checked with the sampling settings: a batch's first (each is checked per
    row when the prompts are known)."""
    if isinstance(seed, (list, tuple, np.ndarray)):
        return seed[0] if len(seed) else 0
    return seed


def bind(model: Model, req: Request, prompts: list, *, listed: bool,
         seed=None) -> tuple[Bound, list[list[int]]]:
    """``req`` bound to ``model`` and ``prompts`` encoded: the checks that need the model,
    the prompts (``listed``: an error names its index), then the resources (the draft, the
    n-gram tables, a constraint's automaton) loaded; ``seed`` is the first row's (default:
    the request's)."""
    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a specjax.Model (from specjax.load), got "
                                   f"{type(model).__name__}")
    if not isinstance(req, Request):
        raise InvalidArgumentError(f"request must be a specjax.api.Request (from "
                                   f"specjax.api.request), got {type(req).__name__}")
    backend = model_backend(model)
    if backend != req.backend:
        raise InvalidArgumentError(f"the request was made for backend {req.backend!r} and "
                                   f"the model's weights are on {backend!r}: make it with "
                                   f"backend={backend!r}")
    sampling = make_sampling_params(
        req.temperature, req.top_k, req.top_p, req.seed if seed is None else seed,
        static_rule=static_rules(backend, req.kernels.sampling_rules))
    stop_ids = _stop_ids(model, req.stop_tokens)
    stop = _stop_array(model, stop_ids, req.stop_strings)
    if req.constraint is not None:
        if model.tokenizer is None:
            raise InvalidArgumentError(f"model {model.name!r} has no tokenizer: a constraint "
                                       f"is on the text, spelled through one")
        if not stop_ids:
            raise InvalidArgumentError("a constraint ends its output with an end-of-sequence "
                                       "token, and stop=[] leaves none: give one in stop")
    _warn_if_slow_dtype(model)
    _check_kernels(model, backend, req.kernels)
    encoded = []
    for index, prompt in enumerate(prompts):
        try:
            encoded.append(encode_prompt(model, prompt, req.chat))
        except InvalidArgumentError as error:
            if not listed:
                raise
            raise InvalidArgumentError(f"prompts[{index}]: {error}") from None
    opts = req.options
    draft_model = resolve_draft(model, req.draft) if opts.uses_draft else None
    tables = resolve_ngram(model, req.ngram) if opts.uses_ngram else None
    method = methods.build(opts, None if draft_model is None else draft_model.config)
    constraint = constraint_stats = None
    if req.constraint is not None:
        # The method's constrained step; the automaton's tables are a resource (traced:
        # constraints of one size bucket share the compiled program).
        built, info = build_tables(req.constraint, model.tokenizer, model.config.vocab_size,
                                   stop_ids)
        constraint = jax.tree.map(jnp.asarray, built)
        method = dataclasses.replace(method, constrained=True)
        constraint_stats = {
            "constraint": req.constraint.describe(), "states": info.num_states,
            "token_classes": info.num_classes,
            "table_bucket": [info.state_bucket, info.class_bucket],
            "table_bytes": info.table_bytes, "build_seconds": info.seconds,
            "from_cache": info.from_cache}
    resources = method.build_resources(
        draft_params=None if draft_model is None else draft_model.params, tables=tables,
        constraint=constraint)
    return Bound(req, sampling, stop, stop_ids, method, draft_model, resources,
                 constraint_stats), encoded


def row_constraints(items) -> tuple | None:
    """``constraint=`` given as a list, one per prompt of a batch (``None``: that row is
    unconstrained), checked; ``None`` if every row is unconstrained."""
    if not items:
        raise InvalidArgumentError("constraint: the list is empty; give one constraint (or "
                                   "None) per prompt")
    for item in items:
        if item is not None:
            check_constraint_type(item)
    return None if all(item is None for item in items) else tuple(items)


def constrained_method(method, constraint, backend: str = "cpu", assets: str | None = None,
                       temperature: float = 0.0,
                       options: dict | None = None) -> tuple[MethodOptions, str]:
    """(the method's options, its choice) for a request under ``constraint`` (one, or a
    tuple of one per row: :func:`row_constraints`) on ``backend``: the method named, else
    the fastest measured under a constraint there
    (:data:`specjax.methods.choice.MEASURED_CONSTRAINED`), ``ar`` where none is measured.
    Checks the constraint's type (:func:`specjax.constraints.check_constraint_type`)."""
    for item in constraint if isinstance(constraint, tuple) else (constraint,):
        if item is not None:
            check_constraint_type(item)
    return _resolve_method(backend, assets, method, temperature,
                           {} if options is None else options, constrained=True)


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
        PerformanceWarning, stacklevel=5)


def plan(model: Model, settings: Bound, prompt_length: int) -> tuple[int, int]:
    """(prompt_bucket, capacity) for the longest prompt, checked against both models."""
    budget = settings.request.max_new_tokens
    bucket_and_capacity = plan_capacity(prompt_length, budget, settings.method.scratch,
                                        model.config)
    if settings.draft_model is not None:
        plan_capacity(prompt_length, budget, settings.method.scratch,
                      settings.draft_model.config)
    return bucket_and_capacity


def program(model: Model, settings: Bound, prompt_length: int, capacity: int,
            prompt_bucket: int) -> decode.DecodeLoop:
    """The static program of a generation whose longest prompt has ``prompt_length``
    tokens, with the target's and the draft's configs for ``prompt_length +
    max_new_tokens`` positions (LongRoPE's factor set, picked once for the whole
    generation: :meth:`~specjax.config.ModelConfig.for_length`)."""
    length = prompt_length + settings.request.max_new_tokens
    method = settings.method
    if getattr(method, "draft_config", None) is not None:
        method = dataclasses.replace(method, draft_config=method.draft_config.for_length(length))
    return decode.DecodeLoop(config=model.config.for_length(length), capacity=capacity,
                             prompt_bucket=prompt_bucket, kernels=settings.request.kernels,
                             method=method)


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


# ----------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Batch:
    """One compiled batch program of a request over a list of prompts
    (:func:`prepare_batch`): ``rows`` are indices into the prompt list."""

    loop: decode.DecodeLoop
    args: tuple  # as decode.run_batch's, with [B] / [B, ...] per-row arrays
    rows: list[int]
    prompt_lengths: list[int]
    options: MethodOptions
    compact: bool = True  # live rows move to smaller programs as rows finish
    choice: str = "given"  # why this method: "given", or the default's reason
    constraint: dict | None = None  # the constraint's stats (None: unconstrained)


def is_batch(prompt) -> bool:
    """Whether ``prompt`` is a list of prompts (strings or token-id lists) rather than one
    prompt (a string or a list of token ids)."""
    if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
        return False
    return len(prompt) == 0 or all(isinstance(p, (str, list, tuple, np.ndarray))
                                   for p in prompt)


def per_row_seeds(seed, rows: int) -> list[int]:
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


def prepare_batch(model: Model, prompts, req: Request) -> list[Batch]:
    """``req`` bound to ``model`` for a list of ``prompts``: their programs and arguments,
    at most ``req.batch.size`` rows each (default: every prompt in one; at most
    :data:`~specjax.state.MAX_BATCH_SIZE`)."""
    if len(prompts) == 0:
        raise InvalidArgumentError("the list of prompts is empty: give at least one prompt")
    if isinstance(req.constraint, tuple):
        return _prepare_by_constraint(model, prompts, req)
    batch = req.batch or BatchOptions()
    limit = MAX_BATCH_SIZE
    batch_size = batch.size
    if batch_size is None:
        if len(prompts) > limit:
            raise InvalidArgumentError(
                f"{len(prompts)} prompts exceed the maximum batch size {limit}: pass "
                f"batch=specjax.BatchOptions(size=B) (B at most {limit}) to run them in "
                f"batches of B")
        batch_size = len(prompts)
    seeds = per_row_seeds(req.seed, len(prompts))
    settings, encoded = bind(model, req, list(prompts), listed=True, seed=seeds[0])
    batches = []
    for rows in batch_rows(model, encoded, req.max_new_tokens, int(batch_size)):
        lengths = [len(encoded[row]) for row in rows]
        prompt_bucket, capacity = plan(model, settings, max(lengths))
        loop = program(model, settings, max(lengths), capacity, prompt_bucket)
        size = batch_bucket(len(rows))
        # Padding rows: one token, one new token: done at prefill, then held.
        padded = np.zeros((size, prompt_bucket), np.int32)
        prompt_lengths = np.ones(size, np.int32)
        budgets = np.ones(size, np.int32)
        row_seeds = np.zeros(size, np.uint32)
        for slot, row in enumerate(rows):
            padded[slot, : lengths[slot]] = encoded[row]
            prompt_lengths[slot] = lengths[slot]
            budgets[slot] = req.max_new_tokens
            row_seeds[slot] = seeds[row]
        stop = jax.tree.map(lambda x, size=size: jnp.broadcast_to(x, (size, *x.shape)),
                            settings.stop)
        args = (model.params, jnp.asarray(padded), jnp.asarray(prompt_lengths),
                jnp.asarray(budgets), batch_sampling(settings.sampling, row_seeds),
                stop, settings.resources)
        batches.append(Batch(loop, args, rows, lengths, req.options, batch.compact_rows,
                              req.choice, settings.constraint_stats))
    return batches


def _prepare_by_constraint(model: Model, prompts, req: Request) -> list[Batch]:
    """A batch with one constraint per prompt: the rows grouped by constraint, each group
    in its own programs (one automaton's tables per program), every row decoding as its
    own call would."""
    if len(req.constraint) != len(prompts):
        raise InvalidArgumentError(
            f"constraint: got {len(req.constraint)} constraints for {len(prompts)} prompts; "
            f"give one per prompt (None: unconstrained), or one for every prompt")
    seeds = per_row_seeds(req.seed, len(prompts))
    groups: dict[str, tuple] = {}
    for row, constraint in enumerate(req.constraint):
        groups.setdefault(repr(constraint), (constraint, []))[1].append(row)
    batches = []
    for constraint, rows in groups.values():
        group = dataclasses.replace(req, constraint=constraint,
                                    seed=tuple(seeds[row] for row in rows))
        for batch in prepare_batch(model, [prompts[row] for row in rows], group):
            batch.rows = [rows[slot] for slot in batch.rows]
            batches.append(batch)
    return batches


def batch_rows(model: Model, encoded: list, max_new_tokens: int,
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
