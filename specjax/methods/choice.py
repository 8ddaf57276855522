"""Which method decodes when none is named: per backend and sampling, from measurements.

The default must never be slower than ``ar``. Whether a speculative method wins depends on
the backend (what a verify pass of N nodes costs against one token) and on the sampling
(at T > 0 fewer drafted tokens are accepted). :data:`MEASURED` holds, per (backend,
sampling), the median speedup over ``ar`` of each method with the model's shipped draft
and tables, copied from a committed ``specjax bench`` suite result;
:func:`choose_method` takes the fastest method the model has the resources for, or
``ar`` where none is faster. Under a constraint the choice follows
:data:`MEASURED_CONSTRAINED` (``benchmarks/experiments/bench_constrained.py`` results),
``ar`` where that holds nothing.

To re-derive after the shipped draft, the tables or a method's defaults change: run the
suite (``specjax bench --methods ar,spec,tree,ngram,staged --temperatures 0,1
--max-new-tokens 128 --peers none --json FILE``), commit FILE under
``benchmarks/results/``, and replace the entry's ``source`` and ``speedup`` with
:func:`speedups_from_suite` of it (``tests/test_default_method.py`` checks that the
numbers here are those of the file).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

from specjax.methods.options import METHODS, MethodOptions


def needs(options: type[MethodOptions] | MethodOptions) -> tuple[str, ...]:
    """What a method needs besides the target (a known model ships them), from its
    options: ``"draft"`` where it ``uses_draft``, ``"ngram"`` where it ``uses_ngram``."""
    return tuple(resource for resource, used in (("draft", options.uses_draft),
                                                 ("ngram", options.uses_ngram)) if used)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One suite run of every method on one backend at one temperature."""

    source: str  # the result file, relative to the repository root
    temperature: float  # the temperature the suite sampled at
    speedup: Mapping[str, float]  # method -> median over prompts of its tokens/s / ar's
    where: str  # machine, prompts and commit, for the reason line
    # method -> the time of one of its steps (a target pass and what the method runs
    # beside it) over one of ar's, over the whole suite (:func:`step_costs_from_suite`):
    # what a speedup is scaled by on another machine (specjax.calibration). Empty: none.
    step_cost: Mapping[str, float] = dataclasses.field(default_factory=dict)


# The protocol run at today's CPU defaults (tree's budget 8) with the shipped EAGLE-3 draft
# and tables, on a 2-core AMD EPYC (Zen 3, AVX2): spec at T=0, no method above ar at T=1.
# The runs before it: the same draft at tree's old budget of 16 on another machine state
# (benchmarks/results/cpu/suite_eagle3_164_2026-11-27.json: spec 1.31x / 1.10x), the token
# draft (benchmarks/results/cpu/suite_all_methods_164_2026-11-25.json: staged at T=0, ar
# at T>0).
_CPU_SUITE = "benchmarks/results/cpu/suite_defaults_164_2026-11-30.json"

# The suite on a GPU in bf16 with attention "auto" (the GPU defaults), the shipped draft
# and tables (benchmarks/results/h200/README.md). On that path bf16 tokens are ar's only up
# to rounding (docs/guide.md, "Numerics").
_GPU_SUITE = "benchmarks/results/h200/suite_2026-11-27/suite_bf16_default_8.json"

# (backend, "greedy" | "sampled") -> the measurement the default follows.
MEASURED: dict[tuple[str, str], Measurement] = {
    ("cpu", "greedy"): Measurement(
        _CPU_SUITE, 0.0, {"spec": 1.135, "tree": 1.123, "ngram": 0.956, "staged": 1.115},
        "2-core CPU, smollm2-135m, 164 HumanEval prompts",
        {"spec": 2.106, "tree": 2.512, "ngram": 2.153, "staged": 2.165}),
    ("cpu", "sampled"): Measurement(
        _CPU_SUITE, 1.0, {"spec": 0.949, "tree": 0.937, "ngram": 0.664, "staged": 0.828},
        "2-core CPU, smollm2-135m, 164 HumanEval prompts",
        {"spec": 2.148, "tree": 2.648, "ngram": 2.141, "staged": 2.129}),
    ("gpu", "greedy"): Measurement(
        _GPU_SUITE, 0.0, {"spec": 1.712, "tree": 2.066, "ngram": 2.51, "staged": 2.477},
        "one H200, bf16, smollm2-135m, 8 HumanEval prompts"),
    ("gpu", "sampled"): Measurement(
        _GPU_SUITE, 1.0, {"spec": 1.435, "tree": 1.723, "ngram": 1.308, "staged": 1.444},
        "one H200, bf16, smollm2-135m, 8 HumanEval prompts"),
}

# Under a constraint (a regex or JSON schema, issue 61), per (backend, sampling): every
# method at the backend's defaults against ``ar`` under the same constraint, on
# benchmarks/experiments/bench_constrained.py's prompts (a HumanEval function's signature
# as JSON) with the shipped draft, every output ar's
# (:func:`speedups_from_constrained`). A setting without one decodes with ``ar``. The CPU's:
# spec 1.07x at 2.38 tokens per pass, tree 0.99x, staged 0.88x, constrained ar at 21.6
# tokens/s. Two earlier runs on a faster state of the same machine (ar 26.7-26.9 tokens/s,
# the same tokens per pass) gave spec 1.14x and 1.15x
# (benchmarks/results/cpu/constrained_32_all_methods_2026-12-01.json against its jf=0 ar,
# .../constrained_32_jf0_default_2026-12-01.json): which is why the CPU's choice is scaled
# by the machine's own step costs (specjax.calibration).
_CPU_CONSTRAINED = "benchmarks/results/cpu/constrained_32_defaults_2026-12-01.json"
_CPU_CONSTRAINED_SAMPLED = "benchmarks/results/cpu/constrained_32_t1_2026-12-01.json"
MEASURED_CONSTRAINED: dict[tuple[str, str], Measurement] = {
    ("cpu", "greedy"): Measurement(
        _CPU_CONSTRAINED, 0.0, {"spec": 1.074, "tree": 0.988, "staged": 0.883},
        "2-core CPU, smollm2-135m, 32 HumanEval prompts under a JSON schema",
        {"spec": 2.354, "tree": 2.82, "staged": 2.246}),
    # At T=1 (coupled, prompt i's seed i; a minute apart on the same machine state): no
    # method beat ar, so ar, measured.
    ("cpu", "sampled"): Measurement(
        _CPU_CONSTRAINED_SAMPLED, 1.0, {"spec": 0.892, "tree": 0.855, "staged": 0.755},
        "2-core CPU, smollm2-135m, 32 HumanEval prompts under a JSON schema",
        {"spec": 2.369, "tree": 2.989, "staged": 2.329}),
}

# Backends without a measurement of the current code (TPU): at T = 0 staged, the default
# before the choice was measured, which beat ar at T = 0 on every backend timed; at T > 0
# ar, the default before the GPU and the EAGLE-3 draft were timed (an H100 run at an older
# commit with the token draft had no method beat ar at T > 0:
# benchmarks/results/h100-2026-11-23/suite_fp32_shipped_draft.json).
UNMEASURED = {"greedy": "staged", "sampled": "ar"}

def sampling_kind(temperature: float) -> str:
    """``greedy`` at temperature 0, else ``sampled`` (measured at T = 1)."""
    return "greedy" if float(temperature) == 0.0 else "sampled"


def measurement(backend: str, temperature: float,
                constrained: bool = False) -> Measurement | None:
    """The measurement the default follows on ``backend`` at ``temperature``: the
    constrained table's under a constraint (:data:`MEASURED_CONSTRAINED`), else
    :data:`MEASURED`'s; ``None`` where the table holds none."""
    table = MEASURED_CONSTRAINED if constrained else MEASURED
    return table.get((backend, sampling_kind(temperature)))


def choose_method(backend: str, temperature: float, shipped: set[str] | frozenset[str],
                  step_cost_here: Mapping[str, float] | None = None,
                  here: str = "this machine", constrained: bool = False) -> tuple[str, str]:
    """The default method and why, in one line.

    Args:
      backend: ``cpu``, ``gpu`` or ``tpu``.
      temperature: the sampling temperature (0: greedy).
      shipped: what the model ships: a subset of ``{"draft", "ngram"}``.
      constrained: the request decodes under a constraint: the choice follows
        :data:`MEASURED_CONSTRAINED`, ``ar`` where it holds no measurement.
      step_cost_here: each method's step time over ``ar``'s measured on the machine that
        will run it (:mod:`specjax.calibration`), or ``None``: the table as it is. Each
        measured speedup is scaled by the measurement's step cost over this one
        (:func:`predicted_speedups`), and must then exceed :data:`PREDICTION_MARGIN`; a
        method not measured here is not chosen.
      here: the machine's name in the reason.
    Returns:
      (method name, reason).
    """
    kind = sampling_kind(temperature)
    usable = {name for name, cls in METHODS.items() if set(needs(cls)) <= set(shipped)}
    if usable == {"ar"}:
        return "ar", "ar: the model ships no draft or n-gram tables"
    measured = measurement(backend, temperature, constrained)
    setting = f"{backend}, {'T=0' if kind == 'greedy' else 'T>0'}"
    if constrained:
        setting += ", under a constraint"
        if measured is None:
            return "ar", f"ar: {setting}, no method is timed against ar yet"
    if measured is None:
        method = UNMEASURED[kind] if UNMEASURED[kind] in usable else "ar"
        why = ("staged beat ar at T=0 on every backend timed" if kind == "greedy" else
               "ar until the suite is timed on it")
        return method, f"{method}: {setting}, no timing of the current code; {why}"
    candidates = {m: s for m, s in measured.speedup.items() if m in usable}
    source, needed = f"{measured.where}, {measured.source}", 1.0
    if step_cost_here is not None:
        candidates = predicted_speedups(measured, step_cost_here, candidates)
        source = (f"predicted for {here}: {source}, scaled by each step's cost over ar's "
                  f"measured here ({_listed(step_cost_here, 'x ar step')})")
        needed = PREDICTION_MARGIN
    best = max(candidates, key=candidates.get, default=None)
    if best is None or candidates[best] <= needed:
        beat = "beat it" if needed == 1.0 else f"predicted above {needed:.2f}x it"
        return "ar", f"ar: no method {beat} for {setting} ({_listed(candidates)}; {source})"
    return best, (f"{best}: the fastest for {setting} ({_listed(candidates)}; {source})")


# How far above ar a speedup predicted for another machine must be for its method to be the
# default: the prediction assumes the table's tokens per pass, which other prompts need not
# give. On 16 HumanEval prompts the table never used (its last 16), this 2-core CPU
# predicted tree 1.18x / 1.07x (T=0 / T=1) and ran it at a median 1.01x / 0.98x, with 2.78 /
# 2.42 tokens per pass against the table's 3.02 / 2.79
# (benchmarks/results/cpu/calibrated_default_2026-11-30.json, a loaded machine).
PREDICTION_MARGIN = 1.1


def predicted_speedups(measured: Measurement, step_cost_here: Mapping[str, float],
                       methods: Mapping[str, float] | None = None) -> dict[str, float]:
    """The speedups ``measured`` predicts on a machine whose steps cost ``step_cost_here``
    (each method's step time over ``ar``'s there): a method commits the same tokens per
    pass on every machine (the same draft, the same target), so its speedup scales with
    the inverse of its step cost, ``speedup * step_cost / step_cost_here``. Only methods
    in both (and in ``methods``, default all measured) are predicted."""
    names = measured.speedup if methods is None else methods
    return {name: round(measured.speedup[name] * measured.step_cost[name]
                        / step_cost_here[name], 3)
            for name in names if name in step_cost_here and name in measured.step_cost}


def _listed(speedups: Mapping[str, float], unit: str = "x") -> str:
    ranked = sorted(speedups.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {value:.2f}{unit}" for name, value in ranked) + (
        " ar" if unit == "x" else "")


def _aggregates(path: str | Path, temperature: float) -> dict[str, dict]:
    data = json.loads(Path(path).read_text())
    return {row["method"]: row for row in data["aggregates"]
            if row.get("kind") == "specjax"
            and float(row["temperature"]) == float(temperature)}


def step_costs_from_suite(path: str | Path, temperature: float) -> dict[str, float]:
    """Each method's step time over ``ar``'s at ``temperature`` in a suite result, over
    all its prompts: (seconds per target pass) / (``ar``'s seconds per token), i.e. its
    tokens per pass times ``ar``'s tokens/s over its own; rounded to 3 decimals."""
    rows = _aggregates(path, temperature)
    ar = rows["ar"]["tokens_per_s"]["aggregate"]
    return {name: round(row["mean_accepted"]["aggregate"] * ar
                        / row["tokens_per_s"]["aggregate"], 3)
            for name, row in rows.items() if name != "ar"}


def temperature_of_constrained(path: str | Path) -> float:
    """The temperature a ``bench_constrained.py`` result sampled at (0 before the option)."""
    return float(json.loads(Path(path).read_text()).get("temperature", 0.0))


def _constrained_rows(path: str | Path) -> dict[str, dict]:
    """A ``bench_constrained.py`` result's summary rows, by method, of the methods run
    under the constraint at their defaults; ``ar`` must be among them."""
    data = json.loads(Path(path).read_text())
    options = {config["label"]: config for config in data["configurations"]}
    rows = {options[label]["method"]: row for label, row in data["summary"].items()
            if row["constrained"] and not options[label]["options"]}
    if "ar" not in rows:
        raise ValueError(f"{path}: no constrained ar at its defaults")
    return rows


def speedups_from_constrained(path: str | Path) -> dict[str, float]:
    """Each method's median speedup over constrained ``ar`` (per-prompt ratios) in a
    ``benchmarks/experiments/bench_constrained.py`` result, rounded to 3 decimals."""
    return {name: round(row["median_speedup_vs_constrained_ar"], 3)
            for name, row in _constrained_rows(path).items() if name != "ar"}


def step_costs_from_constrained(path: str | Path) -> dict[str, float]:
    """Each method's step time over constrained ``ar``'s in a ``bench_constrained.py``
    result (as :func:`step_costs_from_suite`, from the aggregates)."""
    rows = _constrained_rows(path)
    ar = rows["ar"]["aggregate_tokens_per_s"] / rows["ar"]["aggregate_tokens_per_target_pass"]
    return {name: round(row["aggregate_tokens_per_target_pass"] * ar
                        / row["aggregate_tokens_per_s"], 3)
            for name, row in rows.items() if name != "ar"}


def speedups_from_suite(path: str | Path, temperature: float) -> dict[str, float]:
    """Each method's median speedup over ``ar`` at ``temperature`` in a suite result
    (``specjax bench --json``), rounded to 3 decimals as :data:`MEASURED` holds them."""
    return {name: round(row["speedup_vs_ar"]["median"], 3)
            for name, row in _aggregates(path, temperature).items() if name != "ar"}
