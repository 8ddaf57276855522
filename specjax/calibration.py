"""The default method on the machine that runs it: each method's step cost, timed once.

The default-method table (:data:`specjax.methods.choice.MEASURED`) holds speedups over
``ar`` measured on one machine. A speculative method commits the same tokens per target
pass on every machine (the same target, draft and prompts); what changes is what one of
its steps costs against one of ``ar``'s: a verify pass over N nodes, the draft's passes
and the tree's bookkeeping against a one-token pass. On a Zen 3 without AVX-512 the
table's fastest CPU method ran at 1.00x ``ar``. So on the CPU, the first time a model with
shipped assets decodes with its default method, :func:`calibrated` times a step of
``ar`` and of each method the table holds, here, scales the table by those costs
(:func:`specjax.methods.choice.predicted_speedups`) and keeps the method predicted
fastest, or ``ar`` unless one is predicted above
:data:`~specjax.methods.choice.PREDICTION_MARGIN` (1.1x). ``stats["method_choice"]`` says
so, and ``stats["calibration"]`` holds what was timed. Under a constraint the same step
costs (timed without one) scale the constrained table
(:data:`~specjax.methods.choice.MEASURED_CONSTRAINED`), whose own step costs come from its
constrained run: the constraint's share of a step is not timed here.

A step is timed whole, inside the compiled program: two greedy generations of one
program (the same prompt, two lengths, no stop token), the difference of their seconds over
the difference of their target passes, the fastest of :data:`REPEATS` interleaved rounds
after one that compiles (149 s for smollm2-135m's four methods on a 2-core CPU busy with a
test run; 470 s with longer runs under a heavier load). Once: the result is kept, per
machine, model and dtype, for every temperature (the CPU's programs trace the sampling
rule: one program runs at each), in
``$XDG_CACHE_HOME/specjax/calibration.json`` (``~/.cache/specjax``, beside the
compilation cache); ``SPECJAX_CALIBRATION`` names another file, or ``off``: the table as
it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax

from specjax import loading, methods, progress
from specjax.errors import InvalidArgumentError
from specjax.loaded_model import Model, encode_prompt
from specjax.methods import choice
from specjax.requests import Request

CALIBRATION_ENV = "SPECJAX_CALIBRATION"
_OFF = ("", "0", "off", "no", "false")
# The prompt: code, 96 tokens (cut or repeated); the two generations: 8 and 72 new tokens,
# one program for both (prompt bucket 128, capacity 256 with any CPU default's scratch).
PROMPT_TEXT = ("import math\n\n\ndef mean_and_spread(values: list[float]) -> tuple[float, "
               "float]:\n    \"\"\"The mean of values and their standard deviation.\n\n"
               "    >>> mean_and_spread([1.0, 2.0, 3.0])\n    (2.0, 0.816496580927726)\n"
               "    \"\"\"\n    if not values:\n        raise ValueError(\"no values\")\n")
PROMPT_TOKENS = 96
LENGTHS = (8, 56)
REPEATS = 2


def store_path(environ=os.environ) -> Path | None:
    """Where measurements are kept: ``$SPECJAX_CALIBRATION``, else
    ``$XDG_CACHE_HOME/specjax/calibration.json``; ``None`` when calibration is off."""
    value = environ.get(CALIBRATION_ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    try:
        base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return None
    return Path(base) / "specjax" / "calibration.json"


def machine_name() -> str:
    """The CPU: its model name, core count and widest vector extension (what sets a
    step's cost against a pass's), e.g. ``AMD EPYC 7B13, 2 cores, AVX2``."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    widest = next((label for flag, label in (("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                              ("avx", "AVX")) if flag in flags), None)
    return ", ".join(part for part in (name, f"{os.cpu_count()} cores", widest) if part)


def _key(model: Model) -> str:
    return f"{machine_name()} | {model.name} | {model.dtype} | jax {jax.__version__}"


def read_store(path: Path) -> dict[str, Any]:
    """The measurements kept in ``path`` (``{}`` if absent or unreadable: measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_store(path: Path, key: str, entry: dict) -> None:
    """Adds ``entry`` under ``key``, whole or not at all (a temporary file moved into
    place); a directory that cannot be written leaves the measurement unkept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_store(path)
        data[key] = entry
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1, sort_keys=True)
        os.replace(name, path)
    except OSError:
        pass


def calibration_prompt(model: Model) -> list[int]:
    """:data:`PROMPT_TOKENS` tokens of :data:`PROMPT_TEXT` (repeated if it encodes to
    fewer)."""
    if model.tokenizer is None:  # a model without one (tests): ids 1, 2, ...
        ids = [1 + i % (model.config.vocab_size - 1) for i in range(PROMPT_TOKENS)]
    else:
        ids = encode_prompt(model, PROMPT_TEXT)
    return (ids * (PROMPT_TOKENS // max(len(ids), 1) + 1))[:PROMPT_TOKENS]


def measure_step_costs(model: Model, names, temperature: float, generate: Callable,
                       kernels=None, repeats: int = REPEATS,
                       resources: dict[str, dict] | None = None) -> dict[str, float]:
    """Each method of ``names``' step time over ``ar``'s on this machine, at
    ``temperature`` (see the module's text).

    Args:
      generate: :func:`specjax.generate` (passed in: this module sits beside it).
      resources: per method, the ``draft=``/``ngram=`` it runs with (default: the model's
        shipped draft and tables, for the methods that take them).
    """
    prompt = calibration_prompt(model)
    if resources is None:
        resources = {}
        for name in names:
            options = methods.method_options(name)
            resources[name] = dict(
                draft=loading.resolve_draft(model) if options.uses_draft else None,
                ngram=loading.resolve_ngram(model) if options.uses_ngram else None)
    resources = {"ar": {}, **{name: resources.get(name, {}) for name in names}}
    best: dict[str, float] = {}
    for round_ in range(repeats + 1):  # round 0 compiles each program: not timed
        for name, given in resources.items():
            runs = [generate(model, prompt, method=name, max_new_tokens=length,
                             temperature=temperature, stop=[], kernels=kernels,
                             **{k: v for k, v in given.items() if v is not None}).stats
                    for length in LENGTHS]
            passes = runs[1]["target_calls"] - runs[0]["target_calls"]
            if passes < 1:
                raise InvalidArgumentError(f"calibrating {name}: no step was timed")
            step = (runs[1]["seconds"] - runs[0]["seconds"]) / passes
            if round_ and step > 0:
                best[name] = min(best.get(name, step), step)
    if "ar" not in best:
        raise InvalidArgumentError("calibrating ar: no step was timed")
    return {name: round(step / best["ar"], 3) for name, step in best.items() if name != "ar"}


def eligible(req: Request) -> bool:
    """Whether ``req`` chose its method by the table, on a backend whose table holds step
    costs: the default method, with no method option, draft or tables given."""
    if not req.calibrate:
        return False
    measured = choice.measurement(req.backend, req.temperature, req.constraint is not None)
    return measured is not None and bool(measured.step_cost)


def calibrated(model: Model, req: Request, generate: Callable,
               environ=os.environ) -> Request:
    """``req`` with the default method this machine's step costs predict fastest (see the
    module's text), timed now if not kept yet; ``req`` itself where it named its method,
    where the backend's table holds no step costs, or with calibration off."""
    path = store_path(environ)
    if path is None or not eligible(req):
        return req
    measured = choice.measurement(req.backend, req.temperature, req.constraint is not None)
    shipped = loading.shipped_resources(model.assets)
    key = _key(model)
    entry = read_store(path).get(key)
    if not (isinstance(entry, dict) and isinstance(entry.get("step_cost"), dict)):
        # Every method either table holds for the backend: one entry serves both.
        timed = {name: None for table in (choice.MEASURED, choice.MEASURED_CONSTRAINED)
                 for (backend, _), row in sorted(table.items()) if backend == req.backend
                 for name in row.step_cost}
        names = [name for name in timed
                 if set(choice.needs(methods.METHODS[name])) <= set(shipped)]
        started = time.perf_counter()
        with (progress.reported(f"timing this machine's steps for {model.name}'s default "
                                f"method (once; {CALIBRATION_ENV}=off: the table as it is)")
              if req.progress is not False else contextlib.nullcontext()):
            step_cost = measure_step_costs(model, names, 0.0, generate, kernels=req.kernels)
        entry = {"machine": machine_name(), "model": model.name, "dtype": str(model.dtype),
                 "step_cost": step_cost, "seconds": round(time.perf_counter() - started, 1),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        _write_store(path, key, entry)
    step_cost = {name: float(value) for name, value in entry["step_cost"].items()}
    method, reason = choice.choose_method(req.backend, req.temperature, shipped,
                                          step_cost_here=step_cost,
                                          here=entry.get("machine", "this machine"),
                                          constrained=req.constraint is not None)
    record = dict(entry, store=str(path), reference_step_cost=dict(measured.step_cost),
                  predicted_speedup=choice.predicted_speedups(measured, step_cost))
    options = methods.method_options(method, backend=req.backend)
    return dataclasses.replace(req, options=options, choice=reason, calibrate=False,
                               calibration=record)
