"""The Python API: :func:`load` a model, :func:`generate` text from it.

>>> model = specjax.load("smollm2-135m")
>>> out = specjax.generate(model, "def fibonacci(n):", max_new_tokens=64)
>>> out.text, out.tokens, out.stats["tokens_per_s"]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import decode, models
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError, NumericalError
from specjax.models import check_params
from specjax.sampling import make_sampling_params

METHODS = ("ar", "spec", "tree", "ngram", "staged")
SPECULATIVE_DEFAULTS = {"spec": dict(depth=4, width=1), "tree": dict(budget=16, depth=4, width=4)}
# Staged and n-gram defaults: the best settings measured with benchmarks/tune_staged.py
# (benchmarks/results/tune_staged_cpu_*.json) on the 2-core CPU, smollm2-135m + its
# shipped draft, greedy and T = 1 on HumanEval prompts 5-13. On this CPU a tree pass is
# compute-bound beyond a few nodes, so trees of ~6 nodes win; on GPUs larger ones should.
# The stage-2 priors suit a weak draft (35% agreement): with a strong one, lower them
# (stage2_prior=(0, 0) lets the draft alone rank the tree).
STAGED_DEFAULTS = dict(budget=6, rounds=1, width=1, proposal=(2, 1, 1, 1, 1, 1),
                       stage2_prior=(0.7, 0.3))
NGRAM_DEFAULTS = dict(proposal=(2, 1, 1, 1, 1, 1, 1, 1))

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16}


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model: static config, device parameters, tokenizer (or ``None``)."""

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    name: str = "model"

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict, tokenizer: Any = None,
                    name: str = "model", dtype=None) -> "Model":
        """Wraps a parameter tree (numpy or jax arrays) after a strict shape check."""
        check_params(config, params, source=name)
        dtype = resolve_dtype(dtype)
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype or None), params)
        return cls(config=config, params=params, tokenizer=tokenizer, name=name)

    def with_head_subset(self, tokens) -> "Model":
        """This model with its output head restricted to ``tokens`` (ids), for use as a
        draft: a pass reads K output rows instead of V. Tokens outside the subset get the
        row's lowest subset logit (see :func:`specjax.models.head_subset_params`). The
        target must keep its full head; speculative methods stay exact either way."""
        base = {k: v for k, v in self.params.items() if k != models.HEAD_SUBSET}
        params = models.head_subset_params(base, self.config, tokens)
        return Model(self.config, params, self.tokenizer, self.name)

    @property
    def head_size(self) -> int:
        """Tokens the output head scores (the vocabulary, or the subset's size)."""
        subset = self.params.get(models.HEAD_SUBSET)
        return self.config.vocab_size if subset is None else int(subset["tokens"].shape[0])

    def first_layers(self, num_layers: int) -> "Model":
        """A smaller model made of this one's first ``num_layers`` blocks, embedding, final
        norm and head (an untrained starting point for a draft; it shares the tokenizer)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise InvalidArgumentError(
                f"num_layers must be in [1, {self.config.num_layers}], got {num_layers}")
        params = dict(self.params, layers=jax.tree.map(lambda a: a[:num_layers],
                                                       self.params["layers"]))
        config = dataclasses.replace(self.config, num_layers=num_layers)
        return Model(config, params, self.tokenizer, f"{self.name}[:{num_layers} layers]")


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` returns."""

    text: str
    tokens: list[int]  # new token ids (a stop token that ended generation included)
    stats: dict[str, Any]
    origins: list[str] | None = None  # per token: "ngram", "lookup", "draft" or "target"


def resolve_dtype(dtype):
    """Accepts None, a jnp dtype, or a name such as ``"bf16"``."""
    if dtype is None or not isinstance(dtype, str):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def load(name_or_path: str, dtype=None, *, progress: bool = False) -> Model:
    """Loads a model by name, path or hub id.

    Args:
      name_or_path: ``smollm2-135m`` (the embedded default), a GGUF file, a Hugging Face
        directory, an orbax directory written by ``specjax convert``, or a hub id.
      dtype: parameter dtype (``"float32"``, ``"bfloat16"`` or a jnp dtype); default:
        float32.
      progress: show a progress bar while reading weights.
    Returns:
      A :class:`Model`.
    """
    from specjax.checkpoints_tools.sources import resolve_and_load

    config, params, tokenizer = resolve_and_load(name_or_path, dtype=None, progress=progress)
    return Model.from_params(config, params, tokenizer, name=str(name_or_path),
                             dtype=resolve_dtype(dtype) or jnp.float32)


@dataclasses.dataclass
class _Request:
    loop: decode.DecodeLoop
    args: tuple
    prompt_length: int


def encode_prompt(model: Model, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
    """Token ids for a prompt string (optionally through the chat template) or id list."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        if model.tokenizer is None:
            raise InvalidArgumentError(
                f"model {model.name!r} has no tokenizer: pass a list of token ids")
        if chat:
            if not getattr(model.tokenizer, "chat_template", None):
                raise InvalidArgumentError(f"model {model.name!r} has no chat template")
            ids = model.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = model.tokenizer(prompt)["input_ids"]
        ids = list(ids)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidArgumentError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"prompt token id {bad[0]} is outside the vocabulary [0, {model.config.vocab_size})")
    return ids


def _stop_array(model: Model, stop_tokens: Sequence[int] | None) -> jax.Array:
    if stop_tokens is None:
        stop = list(model.config.eos_token_ids)
        eos = getattr(model.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in stop:
            stop.append(int(eos))
    else:
        stop = [int(t) for t in stop_tokens]
    if len(stop) > decode.MAX_STOP_TOKENS:
        raise InvalidArgumentError(
            f"at most {decode.MAX_STOP_TOKENS} stop tokens are supported, got {len(stop)}")
    return jnp.asarray(stop + [-1] * (decode.MAX_STOP_TOKENS - len(stop)), jnp.int32)


def check_draft_compatible(model: Model, draft: Model) -> None:
    """Raises :class:`InvalidArgumentError` if ``draft`` cannot draft for ``model``."""
    if draft.config.vocab_size != model.config.vocab_size:
        raise InvalidArgumentError(
            f"draft {draft.name!r} has vocabulary size {draft.config.vocab_size}, the target "
            f"{model.name!r} has {model.config.vocab_size}: they must share one tokenizer")
    if model.tokenizer is not None and draft.tokenizer is not None:
        if model.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise InvalidArgumentError(
                f"draft {draft.name!r} and target {model.name!r} use different tokenizers")


def _speculative_method(model: Model, method: str, draft, tree_budget, draft_depth,
                        draft_width, verify, topology, temperature):
    from specjax import speculative, tree

    if draft is None:
        raise InvalidArgumentError(f"method {method!r} needs a draft model (draft=...)")
    if isinstance(draft, str):
        draft = load(draft)
    check_draft_compatible(model, draft)
    if verify is None:
        verify = "coupled"
    if verify == "greedy" and temperature > 0:
        raise InvalidArgumentError("verify='greedy' needs temperature 0; use 'coupled'")
    defaults = SPECULATIVE_DEFAULTS[method]
    depth = defaults["depth"] if draft_depth is None else draft_depth
    if method == "spec":
        if tree_budget not in (None, depth + 1) or draft_width not in (None, 1):
            raise InvalidArgumentError(
                "method 'spec' drafts a chain: set draft_depth, not tree_budget or draft_width")
        shape = speculative.TreeShape(budget=_positive("draft_depth", depth) + 1, depth=depth,
                                      width=1, topology=tuple(tree.chain_parents(depth + 1)))
    else:
        budget = defaults["budget"] if tree_budget is None else tree_budget
        width = defaults["width"] if draft_width is None else draft_width
        _positive("tree_budget", budget), _positive("draft_depth", depth)
        _positive("draft_width", width)
        parents = None
        if topology == "kary":
            parents = tree.kary_parents(width, depth, budget)
        elif topology not in (None, "dynamic"):
            parents = tree.validate_parents(np.asarray(topology, np.int32))
        if parents is not None:
            budget = len(parents)
            depth, width = tree.measure_topology(parents)
            parents = tuple(int(p) for p in parents)
        shape = speculative.TreeShape(budget=budget, depth=max(depth, 1), width=max(width, 1),
                                      topology=parents)
    return speculative.Speculative(method, draft.config, shape, verify), draft


def load_ngram_tables(model: Model, ngram=None):
    """N-gram tables for ``model``: ``ngram`` (tables or a path), else the bundled ones."""
    from specjax.drafters import ngram as ngram_module

    if ngram is None:
        try:
            path = ngram_module.bundled_ngram_path(model.name)
        except Exception as error:  # ModelNotFoundError: name it in terms of the method
            raise InvalidArgumentError(
                f"no n-gram tables for model {model.name!r}: pass ngram=PATH (--ngram), "
                "built with 'specjax build-ngram'") from error
        ngram = path
    if isinstance(ngram, ngram_module.NgramTables):
        tables = ngram
        if tables.vocab_size != model.config.vocab_size:
            raise InvalidArgumentError(
                f"n-gram tables have vocabulary size {tables.vocab_size}, the model "
                f"{model.config.vocab_size}")
    else:
        tables = ngram_module.load_ngram(ngram, vocab_size=model.config.vocab_size)
    return jax.tree.map(jnp.asarray, tables)


def _staged_method(model: Model, method: str, draft, ngram, tree_budget, draft_rounds,
                   draft_width, proposal, verify, use_lookup, temperature, stage2_prior=None):
    from specjax import staged

    if verify is None:
        verify = "coupled"
    if verify == "greedy" and temperature > 0:
        raise InvalidArgumentError("verify='greedy' needs temperature 0; use 'coupled'")
    defaults = STAGED_DEFAULTS if method == "staged" else NGRAM_DEFAULTS
    shape = tuple(defaults["proposal"] if proposal is None else proposal)
    if not shape or any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1
                        for n in shape):
        raise InvalidArgumentError(
            f"proposal must be a non-empty list of integers >= 1, got {proposal!r}")
    shape = tuple(int(n) for n in shape)
    tables = load_ngram_tables(model, ngram)
    if method == "ngram":
        if draft is not None:
            raise InvalidArgumentError("method 'ngram' takes no draft model (it is model-free)")
        for name, value in (("tree_budget", tree_budget), ("draft_rounds", draft_rounds),
                            ("draft_width", draft_width)):
            if value is not None:
                raise InvalidArgumentError(
                    f"method 'ngram' verifies the proposal tree as is: {name} does not apply "
                    "(set proposal)")
        spec = staged.NgramOnly(proposal=shape, verify=verify, use_lookup=bool(use_lookup))
        return spec, None, (tables,)
    if draft is None:
        draft = default_draft(model)
    if isinstance(draft, str):
        draft = load(draft)
    check_draft_compatible(model, draft)
    budget = defaults["budget"] if tree_budget is None else _positive("tree_budget", tree_budget)
    rounds = defaults["rounds"] if draft_rounds is None else _positive("draft_rounds",
                                                                        draft_rounds)
    width = defaults["width"] if draft_width is None else _positive("draft_width", draft_width)
    prior = defaults["stage2_prior"] if stage2_prior is None else tuple(stage2_prior)
    if len(prior) != 2 or not all(isinstance(p, (int, float, np.floating)) for p in prior):
        raise InvalidArgumentError(
            f"stage2_prior must be two probabilities (lookup, ngram), got {stage2_prior!r}")
    spec = staged.Staged(draft.config, budget=budget, rounds=rounds, proposal=shape,
                         width=width, verify=verify, use_lookup=bool(use_lookup),
                         lookup_prior=float(prior[0]), ngram_prior=float(prior[1]))
    return spec, draft, (draft.params, tables)


def default_draft(model: Model) -> Model:
    """The draft shipped for ``model`` (see ``specjax/assets``)."""
    from specjax.checkpoints_tools.sources import load_bundled_draft

    return load_bundled_draft(model)


def _positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _prepare(model: Model, prompt, *, max_new_tokens, temperature, top_k, top_p, seed,
             method, draft, stop_tokens, chat, attn_impl, tree_budget=None, draft_depth=None,
             draft_width=None, verify=None, topology=None, ngram=None, draft_rounds=None,
             proposal=None, use_lookup=True, stage2_prior=None) -> _Request:
    if method not in METHODS:
        raise InvalidArgumentError(f"unknown method {method!r}; expected one of {METHODS}")
    sampling = make_sampling_params(temperature, top_k, top_p, seed)
    if method == "ar":
        if draft is not None:
            raise InvalidArgumentError("method 'ar' takes no draft model")
        spec, extra, scratch = None, (), 1
    elif method in ("ngram", "staged"):
        spec, draft, extra = _staged_method(model, method, draft, ngram, tree_budget,
                                            draft_rounds, draft_width, proposal, verify,
                                            use_lookup, float(temperature), stage2_prior)
        scratch = spec.scratch
    else:
        spec, draft = _speculative_method(model, method, draft, tree_budget, draft_depth,
                                          draft_width, verify, topology, float(temperature))
        extra, scratch = (draft.params,), spec.shape.scratch
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    ids = encode_prompt(model, prompt, chat)
    prompt_bucket, capacity = decode.plan_capacity(len(ids), int(max_new_tokens), scratch,
                                                   model.config)
    if draft is not None:
        decode.plan_capacity(len(ids), int(max_new_tokens), scratch, draft.config)
    loop = decode.DecodeLoop(config=model.config, capacity=capacity, prompt_bucket=prompt_bucket,
                             attn_impl=attn_impl, scratch=scratch, method=spec)
    padded = np.zeros(prompt_bucket, np.int32)
    padded[: len(ids)] = ids
    args = (model.params, jnp.asarray(padded), jnp.int32(len(ids)), jnp.int32(max_new_tokens),
            sampling, _stop_array(model, stop_tokens), *extra)
    return _Request(loop, args, len(ids))


def _stats(state: decode.DecodeState, new_tokens: int, seconds: float,
           compile_seconds: float) -> dict[str, Any]:
    if bool(state.nonfinite):
        raise NumericalError("the model produced non-finite logits (NaN or inf); check the "
                             "weights and dtype")
    target_calls = int(state.target_calls) + 1  # + the prefill pass
    stats = {
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,  # None: too fast to time
        "compile_seconds": compile_seconds,
        "target_calls": target_calls,
        "draft_calls": int(state.draft_calls),
        "mean_accepted": new_tokens / target_calls,
    }
    if state.aux is not None:
        steps = np.asarray(state.aux["accepted"])  # steps[c]: steps that accepted c drafts
        total = max(int(steps.sum()), 1)
        stats["accepted_histogram"] = steps.tolist()
        stats["acceptance_by_depth"] = [float(steps[d:].sum()) / total
                                        for d in range(1, len(steps))]
        stats["draft_calls_per_target_call"] = int(state.draft_calls) / target_calls
    stats["tokens_by_origin"] = _origin_counts(state, new_tokens)
    return stats


def _origin_counts(state: decode.DecodeState, new_tokens: int) -> dict[str, int]:
    """Emitted tokens by the stage that proposed them."""
    from specjax.staged import ORIGIN_NAMES

    counts = dict.fromkeys(ORIGIN_NAMES.values(), 0)
    aux = state.aux
    if aux is not None and "origin_counts" in aux:
        for code, value in enumerate(np.asarray(aux["origin_counts"]).tolist()):
            counts[ORIGIN_NAMES[code]] = int(value)
        counts["target"] += 1  # the token sampled by the prefill
    elif aux is not None:  # spec / tree: every step's last token is the target's
        steps = np.asarray(aux["accepted"])
        counts["target"] = int(steps.sum()) + 1
        counts["draft"] = new_tokens - counts["target"]
    else:
        counts["target"] = new_tokens
    return counts


def token_origins(state: decode.DecodeState) -> list[str] | None:
    """The origin of every generated token, or ``None`` for methods that do not track it."""
    from specjax.staged import ORIGIN_NAMES

    if state.aux is None or "origins" not in state.aux:
        return None
    codes = np.asarray(state.aux["origins"])[int(state.prompt_length): int(state.length)]
    names = [ORIGIN_NAMES.get(int(c), "target") for c in codes]
    if names:
        names[0] = "target"  # sampled by the prefill
    return names


def decode_text(model: Model, tokens: list[int]) -> str:
    if model.tokenizer is None:
        return ""
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def generate(model: Model, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             method: str = "ar", draft: Model | str | None = None,
             stop_tokens: Sequence[int] | None = None, chat: bool = False,
             attn_impl: str = "auto", tree_budget: int | None = None,
             draft_depth: int | None = None, draft_width: int | None = None,
             verify: str | None = None, topology=None, ngram=None,
             draft_rounds: int | None = None, proposal: Sequence[int] | None = None,
             use_lookup: bool = True,
             stage2_prior: Sequence[float] | None = None) -> GenerationResult:
    """Generates a continuation as one compiled program on the device.

    Args:
      model: a :class:`Model` from :func:`load` (or :meth:`Model.from_params`).
      prompt: a string (tokenized with the model's tokenizer) or a list of token ids.
      max_new_tokens: upper bound on generated tokens (traced: no recompilation).
      temperature: 0 for greedy; otherwise sampling temperature (traced).
      top_k: keep the k most likely tokens; 0 disables (traced).
      top_p: nucleus mass in (0, 1]; 1 disables (traced).
      seed: sampling seed; the noise of token t depends only on (seed, t) (traced).
      method: ``"ar"`` (autoregressive), ``"spec"`` (draft chain, Leviathan/Chen),
        ``"tree"`` (draft token tree verified in one target pass), ``"staged"`` (draft
        model helped by n-gram tables and context lookup, :mod:`specjax.staged`) or
        ``"ngram"`` (n-gram + context-lookup trees verified directly; no draft model).
      draft: draft model (a :class:`Model` or a name/path for :func:`load`) for ``spec``,
        ``tree`` and ``staged``; it must share the target's tokenizer. ``staged`` uses the
        shipped draft of a known model by default.
      stop_tokens: ids that end generation (default: the model's EOS ids).
      chat: wrap a string prompt in the model's chat template.
      attn_impl: ``"auto"``, ``"reference"`` or ``"kernel"``.
      tree_budget: ``tree``: nodes verified per target pass, root included (default 16).
      draft_depth: drafted levels per step (default 4).
      draft_width: ``tree``: children per expanded node and frontier size (default 4).
      verify: acceptance rule: ``coupled`` (default; greedy at temperature 0),
        ``greedy``, ``match`` (sample-then-match) or ``rejection``.
      topology: ``tree``: ``None``/``"dynamic"`` (best nodes by draft score), ``"kary"``
        or a fixed parents list.
      ngram: ``staged``/``ngram``: n-gram tables (a path to a ``specjax build-ngram``
        file or :class:`~specjax.drafters.ngram.NgramTables`); default: the tables
        shipped for a known model.
      draft_rounds: ``staged``: draft passes per step, the first of which also catches
        the draft up (default ``STAGED_DEFAULTS["rounds"]``).
      proposal: ``staged``/``ngram``: stage-2 proposal shape, candidates per level
        (defaults in :data:`STAGED_DEFAULTS` / :data:`NGRAM_DEFAULTS`).
      use_lookup: ``staged``/``ngram``: merge context lookup into the proposals.
      stage2_prior: ``staged``: ``(lookup, ngram)`` probabilities that floor the draft's
        score of stage-2 proposals from each source (:class:`specjax.staged.Staged`);
        default ``STAGED_DEFAULTS["stage2_prior"]``. Ranking only, never exactness.
    Returns:
      :class:`GenerationResult` with ``text``, ``tokens``, ``stats`` and, for ``staged``
      and ``ngram``, ``origins``.
    """
    request = _prepare(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed, method=method, draft=draft,
                       stop_tokens=stop_tokens, chat=chat, attn_impl=attn_impl,
                       tree_budget=tree_budget, draft_depth=draft_depth,
                       draft_width=draft_width, verify=verify, topology=topology, ngram=ngram,
                       draft_rounds=draft_rounds, proposal=proposal, use_lookup=use_lookup,
                       stage2_prior=stage2_prior)
    state, compile_seconds, seconds = decode.run_program(request.args[0], request.loop,
                                                         *request.args[1:])
    tokens = np.asarray(state.tokens)[request.prompt_length: int(state.length)].tolist()
    stats = _stats(state, len(tokens), seconds, compile_seconds)
    stats["method"] = method
    return GenerationResult(text=decode_text(model, tokens), tokens=tokens, stats=stats,
                            origins=token_origins(state))


def stream_generate(model: Model, prompt: str | Sequence[int], **kwargs
                    ) -> Iterator[tuple[list[int], dict[str, Any] | None]]:
    """Like :func:`generate`, but driven from Python over the same jitted step.

    Yields ``(new_token_ids, None)`` as tokens are produced, then ``([], stats)`` once.
    With ``origins=True`` it yields ``(new_token_ids, new_token_origins, None)`` and then
    ``([], [], stats)``; origins are ``"ngram"``, ``"lookup"``, ``"draft"`` or
    ``"target"`` (all ``"target"`` for methods that do not track them).
    Accepts the same keyword arguments as :func:`generate`.
    """
    import time

    defaults = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                    method="ar", draft=None, stop_tokens=None, chat=False, attn_impl="auto",
                    tree_budget=None, draft_depth=None, draft_width=None, verify=None,
                    topology=None, ngram=None, draft_rounds=None, proposal=None,
                    use_lookup=True, stage2_prior=None)
    with_origins = bool(kwargs.pop("origins", False))
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise InvalidArgumentError(f"unknown argument {sorted(unknown)[0]!r}")
    request = _prepare(model, prompt, **{**defaults, **kwargs})
    compile_total, count, state = 0.0, 0, None
    start = time.perf_counter()
    for new, state, compile_seconds in decode.stream(request.args[0], request.loop,
                                                     *request.args[1:]):
        compile_total += compile_seconds
        count += len(new)
        if new and with_origins:
            names = token_origins(state)
            names = ["target"] * len(new) if names is None else names[count - len(new):count]
            yield new, names, None
        elif new:
            yield new, None
    seconds = time.perf_counter() - start - compile_total
    stats = _stats(state, count, seconds, compile_total)
    stats["method"] = kwargs.get("method", "ar")
    yield ([], [], stats) if with_origins else ([], stats)
