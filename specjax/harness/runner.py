"""The suite runner: every method and peer on every prompt, interleaved, in one process.

Order of work (so that machine drift and background load hit every system alike):

1. **Warm-up**: one short generation (``warmup_tokens``) per system and temperature on
   the first prompt; it compiles the programs and warms PyTorch. Compilation is never in
   a timed number anyway: :func:`specjax.generate` reports it apart (``compile_seconds``)
   when a later prompt needs a new prompt bucket or cache capacity.
2. **For each prompt**, for each temperature, ``repeats`` rounds of *every* system (specjax
   methods, then peers); each row keeps the fastest round (other processes only ever add
   time). PyTorch's thread count is re-probed before each prompt's peers.
3. **Pass breakdown** (``pass_breakdown``, on by default): after the prompts, each specjax
   system's target pass and draft passes are timed on their own, every system's passes
   interleaved round by round (:func:`specjax.harness.passcost.step_breakdowns`), so the
   report can split a step into target, draft and the rest.
4. **Output check**: each specjax row's tokens are compared with ``ar``'s for the same
   prompt, temperature and seed. They must be equal at temperature 0 and, at temperature
   > 0, under the coupled rule; peers are compared at temperature 0 for information.

Systems are method names passed to :func:`specjax.generate` (``ar``, ``spec``, ``tree``, and
whatever else it accepts); :data:`METHOD_OPTIONS` says which suite options each one takes.
Every stats key a method reports is carried into its row, unknown ones included.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from typing import Any, Callable, Sequence

import jax
from tqdm.auto import tqdm

from specjax import api
from specjax.constraints import check_constraint_type
from specjax.errors import InvalidArgumentError
from specjax.harness import metrics, passcost
from specjax.harness.peers import PEERS, TransformersPeers, one_line
from specjax.kernel_options import KernelOptions
from specjax.loaded_model import check_draft_compatible
from specjax.loading import resolve_ngram
from specjax.methods import METHODS
from specjax.methods import method_options as build_options
from specjax.methods.options import default_value, methods_taking
from specjax.models import HEAD_SUBSET

def _suite_options(cls) -> tuple[str, ...]:
    resources = (("draft",) if cls.uses_draft else ()) + (("ngram",) if cls.uses_ngram else ())
    return resources + cls.option_names()


# The generate() options each method takes (its resources, then its options class's
# fields: specjax.methods.options owns them).
METHOD_OPTIONS = {name: _suite_options(cls) for name, cls in METHODS.items()}


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """What to run. Every field is a flag of ``specjax bench`` and is stored in the JSON.

    Attributes:
      methods: specjax methods (``ar`` is always run, first: it is the reference).
      temperatures: 0 is greedy; others sample (with ``top_k``/``top_p``).
      tree_budgets: one run per budget for methods that take one (``(None,)``: default).
      draft_depth, draft_width, draft_rounds, proposal, ngram, use_lookup, stage2_prior,
      verify: passed
        to the methods that take them (see :data:`METHOD_OPTIONS`); ``None``: defaults.
      kernels: the :class:`~specjax.kernel_options.KernelOptions` every system runs with
        (``specjax bench`` builds it from the same flags as ``specjax generate``).
      peers: subset of :data:`~specjax.harness.peers.PEERS`.
      repeats: rounds per prompt; each row keeps its fastest.
      warmup_tokens: new tokens of each warm-up generation.
      torch_threads: PyTorch CPU threads (0: probe 1 and all cores, keep the faster).
      pass_breakdown: time each system's target and draft passes on their own after the
        prompts (:mod:`specjax.harness.passcost`).
      constraint: a :class:`~specjax.constraints.Regex` or
        :class:`~specjax.constraints.JsonSchema` every system decodes under (``None``:
        none); the outputs then end at the model's end-of-sequence token, and no
        transformers peer runs (they would decode without it).
    """

    suite: str = "humaneval"
    methods: tuple[str, ...] = ("ar", "spec", "tree")
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    limit: int | None = None
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    tree_budgets: tuple[int | None, ...] = (None,)
    draft_depth: int | None = None
    draft_width: int | None = None
    draft_rounds: int | None = None
    proposal: tuple[int, ...] | None = None
    ngram: str | None = None
    use_lookup: bool = True
    stage2_prior: tuple[float, float] | None = None
    verify: str | None = None
    topology: Any = None
    kernels: KernelOptions = KernelOptions()
    peers: tuple[str, ...] = ()
    repeats: int = 1
    warmup_tokens: int = 4
    torch_threads: int = 0
    pass_breakdown: bool = True
    constraint: Any = None

    def __post_init__(self):
        if not self.methods or any(not m or not m.replace("_", "").isalnum()
                                   for m in self.methods):
            raise InvalidArgumentError(f"methods must be method names, got {self.methods!r}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise InvalidArgumentError(
                f"temperatures must be >= 0 (0 is greedy), got {self.temperatures!r}")
        for name in ("max_new_tokens", "repeats", "warmup_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise InvalidArgumentError(f"limit must be >= 1, got {self.limit}")
        if any(b is not None and b < 1 for b in self.tree_budgets) or not self.tree_budgets:
            raise InvalidArgumentError(f"tree budgets must be >= 1, got {self.tree_budgets!r}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise InvalidArgumentError(f"unknown peer {unknown[0]!r}; expected one of {PEERS}")
        if self.constraint is not None:
            check_constraint_type(self.constraint)
            if self.peers:
                raise InvalidArgumentError("a constraint (--regex/--json-schema) and peers: the "
                                           "transformers peers decode without it; drop --peers")
        self.method_options()  # every method's options, validated before anything loads

    def given_options(self) -> dict[str, Any]:
        """The method options set for the suite (not their defaults)."""
        given = {name: getattr(self, name) for name in
                 ("draft_depth", "draft_width", "draft_rounds", "proposal", "stage2_prior",
                  "verify", "topology") if getattr(self, name) is not None}
        if not self.use_lookup:
            given["use_lookup"] = False
        return given

    def method_options(self) -> dict[tuple[str, int | None], Any]:
        """``{(method, tree budget): options}`` for every system the suite runs.

        Raises:
          InvalidArgumentError: an unknown method, an invalid value, or an option that
            none of the methods takes.
        """
        methods = ["ar", *self.methods]
        for method in methods:
            method_options(method)
        given = self.given_options()
        if self.tree_budgets != (None,):
            given["tree_budget"] = self.tree_budgets[0]
        for name in given:
            if not any(name in METHODS[m].option_names() for m in methods):
                raise InvalidArgumentError(
                    f"{name} applies to {', '.join(methods_taking(name))}, none of the methods "
                    f"run ({', '.join(dict.fromkeys(methods))})")
        out = {}
        for method in dict.fromkeys(methods):
            cls = METHODS[method]
            own = {k: v for k, v in given.items() if k in cls.option_names()}
            budgets = self.tree_budgets if "tree_budget" in cls.option_names() else (None,)
            for budget in budgets:
                own = dict(own, tree_budget=budget) if budget is not None else own
                options = build_options(method, backend=jax.default_backend(), **own)
                for temperature in self.temperatures:
                    options.check_sampling(temperature)
                out[method, budget] = options
        return out


@dataclasses.dataclass(frozen=True)
class System:
    """One column of the comparison: a specjax method (with its options) or a peer."""

    label: str  # unique: the method, "tree@32" in a budget sweep, or the peer name
    kind: str  # "specjax" or "peer"
    method: str
    tree_budget: int | None = None
    options: tuple = ()  # generate() keyword arguments, as (name, value) pairs
    resolved: tuple = ()  # every option the method runs with, defaults included, as pairs

    def kwargs(self) -> dict:
        return dict(self.options)


def method_options(method: str) -> tuple[str, ...]:
    if method not in METHOD_OPTIONS:
        raise InvalidArgumentError(f"unknown method {method!r}; expected one of "
                                   f"{', '.join(METHOD_OPTIONS)}")
    return METHOD_OPTIONS[method]


def needs_draft(method: str) -> bool:
    """Whether the suite must be given a draft model for ``method`` (so that its weight
    traffic is counted and the ``hf-assisted`` peer can use the same draft)."""
    return "draft" in method_options(method)


def default_tree_budget(method: str) -> int | None:
    return default_value(method, "tree_budget")


def build_systems(config: SuiteConfig, draft=None, ngram=None) -> list[System]:
    """The specjax systems to run, ``ar`` first, one per (method, tree budget).

    Args:
      config: the suite.
      draft: the draft :class:`~specjax.Model` (required by methods that take one).
      ngram: n-gram tables to pass instead of ``config.ngram`` (loaded once).
    """
    sweep = len(config.tree_budgets) > 1
    systems = []
    for (method, budget), options in config.method_options().items():
        if needs_draft(method) and draft is None:
            raise InvalidArgumentError(f"method {method!r} needs a draft model (--draft)")
        given = dict(config.given_options(), tree_budget=budget)
        values = {"draft": draft, "ngram": config.ngram if ngram is None else ngram,
                  **{k: getattr(options, k) for k in options.option_names() if k in given}}
        pairs = tuple((k, v) for k, v in values.items()
                      if k in method_options(method) and v is not None)
        budget = getattr(options, "tree_budget", None)
        label = f"{method}@{budget}" if sweep and budget is not None else method
        resolved = tuple((k, v) for k, v in options.to_dict().items() if k != "method")
        systems.append(System(label, "specjax", method, budget, pairs, resolved))
    return systems


def describe_options(system: System, config: SuiteConfig) -> dict:
    described = {}
    for key, value in system.options:
        if key == "draft":
            value = value.name
        elif key == "ngram":
            value = config.ngram or "shipped"
        described[key] = value
    return described


def weight_bytes(model) -> int:
    """Bytes of the parameter arrays one forward pass reads at batch 1: all of them,
    except that with a restricted head (:meth:`specjax.Model.with_head_subset`) the
    embedding is only gathered (a few rows), and the head reads the subset's rows."""
    params = model.params
    if HEAD_SUBSET in params:
        params = {k: v for k, v in params.items() if k != "embed"}
    return int(sum(a.nbytes for a in jax.tree.leaves(params)))


def describe_model(model) -> dict | None:
    if model is None:
        return None
    c = model.config
    return {"name": model.name, "num_layers": c.num_layers, "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "weight_bytes": weight_bytes(model),
            "parameters": int(sum(a.size for a in jax.tree.leaves(model.params))),
            "dtype": str(jax.tree.leaves(model.params)[0].dtype)}


def log_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Progress:
    """tqdm over prompts with a running speedup (a terminal); one line per prompt on a
    pipe; nothing when ``mode`` is ``"off"``."""

    def __init__(self, total: int, mode: str, log: Callable[[str], None], done: int = 0):
        self.mode, self.log, self.total = mode, log, total
        self.bar = None
        if mode == "bar":
            self.bar = tqdm(total=total, initial=done, unit="prompt", desc="bench",
                            file=sys.stderr)

    def update(self, done: int, summary: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(summary, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines":
            self.log(f"prompt {done}/{self.total}: {summary}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _running_speedups(totals: dict, temperature: float) -> str:
    """"T=0 so far: tree 1.52x, hf 0.61x ar" from the token and second totals of the
    prompts done so far at one temperature (a running figure, not this prompt's)."""
    base = totals.get(("ar", temperature))
    if not base or not base[1]:
        return ""
    parts = []
    for (label, t), (tokens, seconds) in totals.items():
        if t == temperature and label != "ar" and seconds:
            parts.append(f"{label} {(tokens / seconds) / (base[0] / base[1]):.2f}x")
    return f"T={temperature:g} so far: " + ", ".join(parts) + " ar"


def _stats_row(result: api.GenerationResult, target_bytes: int, draft_bytes: int) -> dict:
    stats = result.stats
    row = {"new_tokens": stats["new_tokens"], "seconds": stats["seconds"],
           "tokens_per_s": stats.get("tokens_per_s"),
           "compile_seconds": stats.get("compile_seconds", 0.0),
           "target_calls": stats.get("target_calls"), "draft_calls": stats.get("draft_calls", 0),
           "mean_accepted": stats.get("mean_accepted")}
    if row["target_calls"] is not None:
        row["weight_bytes_read"] = (row["target_calls"] * target_bytes
                                    + (row["draft_calls"] or 0) * draft_bytes)
    for key in ("tokens_by_origin", "acceptance_by_depth"):
        if key in stats:
            row[key] = stats[key]
    row["stats"] = stats
    return row


def finished_prompts(saved: dict[str, Any]) -> list[int]:
    """The prompts a saved suite result has rows for, in order (peer status rows aside)."""
    return sorted({r["prompt"] for r in saved.get("rows") or () if r.get("prompt") is not None})


def resume_point(saved: dict[str, Any], config: SuiteConfig, models: dict[str, Any],
                 prompts: int) -> int:
    """The first prompt a part-way result ``saved`` lacks, after checking that it can be
    continued by a run of ``config`` with ``models`` over ``prompts`` prompts.

    Its rows must cover exactly prompts ``0 .. n-1`` (the results are saved after whole
    prompts), every one with a row per system and temperature.

    Raises:
      InvalidArgumentError: the result is complete, or comes from another configuration
        or other models (the first differing field is named), or its rows are not whole
        prompts.
    """
    if saved.get("benchmark", "suite") != "suite" or "rows" not in saved:
        raise InvalidArgumentError("cannot resume: not a suite result (no rows)")
    if saved.get("complete") is not False:
        raise InvalidArgumentError("cannot resume: that result is already complete")
    want = json.loads(json.dumps(dataclasses.asdict(config)))
    have = saved.get("config") or {}
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            raise InvalidArgumentError(
                f"cannot resume: config field {key!r} was {have.get(key)!r}, this run has "
                f"{want.get(key)!r}")
    want = json.loads(json.dumps(models))
    for role in ("target", "draft"):
        if (saved.get("models") or {}).get(role) != want[role]:
            raise InvalidArgumentError(f"cannot resume: the {role} model differs from the "
                                       f"saved run's")
    done = finished_prompts(saved)
    if done != list(range(len(done))) or len(done) > prompts:
        raise InvalidArgumentError(f"cannot resume: the saved rows are not prompts 0..n-1 of "
                                   f"{prompts}")
    per_prompt = {}
    for r in saved["rows"]:
        if r.get("prompt") is not None:
            per_prompt.setdefault(r["prompt"], set()).add((r["system"], r["temperature"]))
    expected = {(s["label"], t) for s in saved.get("systems", ()) for t in config.temperatures}
    broken = [p for p in done if not expected <= per_prompt[p]]
    if broken:
        raise InvalidArgumentError(f"cannot resume: prompt {broken[0]} lacks rows")
    return len(done)


def run_suite(config: SuiteConfig, target, draft, prompts: Sequence[str | Sequence[int]],
              *, progress: str | None = None, log: Callable[[str], None] = log_line,
              generate: Callable[..., api.GenerationResult] | None = None,
              on_prompt: Callable[[dict[str, Any]], None] | None = None,
              resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """Runs every system on every prompt and returns the results (JSON-ready).

    Args:
      config: what to run.
      target, draft: :class:`specjax.Model` objects (``draft`` may be ``None`` when no
        method needs one).
      prompts: strings (tokenized with the target's tokenizer) or token-id lists.
      progress: ``"bar"`` (tqdm), ``"lines"`` (one line per prompt) or ``"off"``;
        default: a bar when stderr is a terminal, else lines.
      log: where messages (mismatches, per-prompt lines) go.
      generate: the generation function (default :func:`specjax.generate`); tests pass a
        wrapper.
      on_prompt: called after every prompt with the results so far (the same form, with
        ``"complete": False`` and no pass breakdown), so that a caller can save them: a run
        stopped part-way (a time limit) keeps the prompts it finished.
      resume: such a part-way result: its rows are kept and the run goes on from the first
        prompt it lacks (the programs are compiled and warmed up again first). It must
        come from the same configuration and models (:func:`resume_point` checks).
    Returns:
      ``{"config", "models", "systems", "peers", "warmup", "rows", "aggregates",
      "pass_breakdown", "mismatches", "all_outputs_match", "complete"}``; see
      :mod:`specjax.harness.metrics` for rows.
    """
    generate = generate or api.generate
    if progress is None:
        progress = "bar" if sys.stderr.isatty() else "lines"
    if not prompts:
        raise InvalidArgumentError("no prompts to run")
    ids = [api.encode_prompt(target, p) for p in prompts]
    ngram = None
    if any("ngram" in METHOD_OPTIONS.get(m, ()) for m in config.methods):
        ngram = resolve_ngram(target, config.ngram)  # once, not per generation
    systems = build_systems(config, draft, ngram)
    if draft is not None:
        check_draft_compatible(target, draft)
    target_bytes = weight_bytes(target)
    draft_bytes = weight_bytes(draft) if draft is not None else 0
    peers = TransformersPeers(config.peers, target, draft, config.torch_threads)
    n = config.max_new_tokens
    common = dict(top_k=config.top_k, top_p=config.top_p, seed=config.seed, stop=[],
                  kernels=config.kernels)
    if config.constraint is not None:  # the output ends where the constraint is met
        common.update(stop=None, constraint=config.constraint)

    def run_ours(system: System, prompt_ids, temperature, max_new_tokens):
        return generate(target, prompt_ids, max_new_tokens=max_new_tokens,
                        temperature=temperature, method=system.method, **common,
                        **system.kwargs())

    def run_peer(name, prompt_ids, temperature, max_new_tokens):
        return peers.generate(name, prompt_ids, max_new_tokens, temperature,
                              config.top_k, config.top_p, config.seed)

    rows: list[dict] = []
    first = 0
    if resume is not None:
        first = resume_point(resume, config, {"target": describe_model(target),
                                              "draft": describe_model(draft)}, len(ids))
        rows = [r for r in copy.deepcopy(resume["rows"]) if r.get("prompt") is not None]
    warmup = copy.deepcopy(resume.get("warmup", [])) if resume is not None else []
    warmup += _warm_up(config, systems, peers, run_ours, run_peer, ids[0])
    for name in config.peers:
        if not peers.available(name):
            for temperature in config.temperatures:
                rows.append({"prompt": None, "system": name, "kind": "peer", "method": name,
                             "temperature": temperature, "tree_budget": None,
                             **peers.status[name]})

    def results(rows: list[dict], breakdown: dict, complete: bool) -> dict[str, Any]:
        return _results(config, target, draft, systems, peers, warmup, rows, breakdown,
                        complete)

    bar = _Progress(len(ids), progress, log, done=first)
    totals: dict[tuple, list] = {}  # (label, temperature) -> [tokens, seconds] so far
    for row in rows:
        total = totals.setdefault((row["system"], row["temperature"]), [0, 0.0])
        total[0] += row.get("new_tokens") or 0
        total[1] += row.get("seconds") or 0.0
    systems_by_label = {s.label: s for s in systems}
    try:
        for i, prompt_ids in enumerate(ids):
            if i < first:
                continue
            if any(peers.available(p) for p in config.peers):
                peers.tune_threads()
            for temperature in config.temperatures:
                best, tokens = _best_of_repeats(
                    config, systems, peers, lambda system: run_ours(
                        system, prompt_ids, temperature, n),
                    lambda name: run_peer(name, prompt_ids, temperature, n),
                    (target_bytes, draft_bytes), rows, i, temperature)
                for label, row in best.items():
                    row = _finish_row(row, i, prompt_ids, label, systems_by_label.get(label),
                                      temperature, tokens, log)
                    rows.append(row)
                    total = totals.setdefault((label, temperature), [0, 0.0])
                    total[0] += row["new_tokens"]
                    total[1] += row["seconds"]
            bar.update(i + 1, _running_speedups(totals, config.temperatures[0]))
            if on_prompt is not None:
                on_prompt(results(copy.deepcopy(rows), {}, complete=False))
    finally:
        bar.close()

    breakdown = _pass_breakdown(config, systems, target, draft) if config.pass_breakdown else {}
    return results(rows, breakdown, complete=True)


def _best_of_repeats(config: SuiteConfig, systems, peers, run_ours, run_peer,
                     weight_bytes_of: tuple[int, int], rows: list, prompt: int,
                     temperature: float) -> tuple[dict, dict]:
    """(best row, its tokens) per system and peer on one prompt at one temperature: the
    fastest of ``config.repeats`` runs. A peer that fails is disabled and its failure
    appended to ``rows``."""
    best: dict[str, dict] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(config.repeats):
        for system in systems:
            out = run_ours(system)
            row = _stats_row(out, *weight_bytes_of)
            if system.label not in best or row["seconds"] < best[system.label]["seconds"]:
                best[system.label], tokens[system.label] = row, out.tokens
        for name in config.peers:
            if not peers.available(name):
                continue
            try:
                new, seconds = run_peer(name)
            except Exception as err:
                peers.disable(name, f"failed on prompt {prompt}: {one_line(err)}")
                rows.append({"prompt": prompt, "system": name, "kind": "peer",
                             "method": name, "temperature": temperature,
                             "tree_budget": None, **peers.status[name]})
                best.pop(name, None)
                continue
            row = {"new_tokens": len(new), "seconds": seconds,
                   "tokens_per_s": len(new) / seconds if seconds > 0 else None,
                   "compile_seconds": 0.0,
                   "torch_threads_probe_ms": dict(peers.threads_probe)}
            if name not in best or seconds < best[name]["seconds"]:
                best[name], tokens[name] = row, new
    return best, tokens


def _warm_up(config: SuiteConfig, systems, peers, run_ours, run_peer, prompt_ids) -> list:
    """Compiles and warms every system (and peer) on the first prompt, at each temperature;
    returns the warm-up rows. A peer that fails here is disabled, not fatal."""
    warmup = []
    tokens = min(config.warmup_tokens, config.max_new_tokens)
    for temperature in config.temperatures:
        for system in systems:
            out = run_ours(system, prompt_ids, temperature, tokens)
            warmup.append({"system": system.label, "temperature": temperature,
                           "compile_seconds": out.stats.get("compile_seconds", 0.0),
                           "seconds": out.stats["seconds"]})
        for name in config.peers:
            if not peers.available(name):
                continue
            try:
                _, seconds = run_peer(name, prompt_ids, temperature, tokens)
                warmup.append({"system": name, "temperature": temperature, "seconds": seconds})
            except Exception as err:  # a failing peer is reported, not fatal
                peers.disable(name, f"failed at warm-up: {one_line(err)}")
    return warmup


def _results(config: SuiteConfig, target, draft, systems, peers, warmup: list, rows: list,
             breakdown: dict, complete: bool) -> dict[str, Any]:
    """The suite's JSON-ready results (see :func:`run_suite`)."""
    metrics.derive(rows)
    failed = metrics.mismatches(rows)
    return {
        "config": dataclasses.asdict(config),
        "models": {"target": describe_model(target), "draft": describe_model(draft)},
        "systems": [{"label": s.label, "kind": s.kind, "method": s.method,
                     "tree_budget": s.tree_budget,
                     "options": describe_options(s, config),
                     "resolved_options": dict(s.resolved)}
                    for s in systems],
        "peers": peers.describe(),
        "warmup": warmup,
        "rows": rows,
        "aggregates": metrics.aggregate(rows),
        "pass_breakdown": breakdown,
        "mismatches": [{k: r.get(k) for k in ("prompt", "system", "temperature",
                                              "first_mismatch")} for r in failed],
        "all_outputs_match": not failed,
        "complete": complete,
    }


def _pass_breakdown(config: SuiteConfig, systems, target, draft) -> dict:
    """Each system's step split into its parts (:mod:`specjax.harness.passcost`)."""
    steps = {}
    for system in systems:
        options = build_options(system.method, backend=jax.default_backend(),
                                **{k: v for k, v in system.options if k not in ("draft", "ngram")})
        steps[system.label] = (options, draft if needs_draft(system.method) else None)
    return passcost.step_breakdowns(target, steps, attn_impl=config.kernels)


def _finish_row(timing: dict, prompt: int, prompt_ids: list[int], label: str,
                system: System | None, temperature: float, tokens: dict[str, list[int]],
                log: Callable[[str], None]) -> dict:
    """The row of one system on one prompt: identity, timing, and the output check
    against ``ar`` (``system`` is ``None`` for a peer)."""
    kind = "peer" if system is None else "specjax"
    row = {"prompt": prompt, "prompt_tokens": len(prompt_ids), "system": label, "kind": kind,
           "method": label if system is None else system.method, "temperature": temperature,
           "tree_budget": None if system is None else system.tree_budget, "status": "ok",
           **timing}
    if label != "ar" and (kind == "specjax" or temperature == 0):
        verify = None if system is None else dict(system.options).get("verify")
        row["must_match_ar"] = metrics.must_match_ar(kind, temperature, verify)
        diff = metrics.first_difference(tokens["ar"], tokens[label])
        row["matches_ar"], row["first_mismatch"] = diff is None, diff
        if diff is not None and row["must_match_ar"]:
            log(_mismatch_message(row, tokens["ar"], tokens[label]))
    return row


def _mismatch_message(row: dict, expected: list[int], got: list[int]) -> str:
    j = row["first_mismatch"]
    a = expected[j] if j < len(expected) else "end"
    b = got[j] if j < len(got) else "end"
    return (f"specjax bench: MISMATCH: {row['system']} differs from ar on prompt "
            f"{row['prompt']} at T={row['temperature']:g}: first differing new token is #{j} "
            f"(ar {a}, {row['system']} {b})")
