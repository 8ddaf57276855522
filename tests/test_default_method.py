"""The default method follows the measured table (specjax.methods.choice): the fastest
measured method where one beat ``ar``, ``ar`` where none did, and the table holds what
the committed result files hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import specjax
from specjax import api, loading
from specjax.methods import choice

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", sorted(choice.MEASURED))
def test_the_table_holds_the_committed_measurements(key):
    measured = choice.MEASURED[key]
    source = ROOT / measured.source
    assert source.is_file(), measured.source
    assert dict(measured.speedup) == choice.speedups_from_suite(source, measured.temperature)
    if measured.step_cost:  # what specjax.calibration scales the speedups by
        assert dict(measured.step_cost) == {
            name: cost for name, cost in choice.step_costs_from_suite(
                source, measured.temperature).items() if name in measured.speedup}


@pytest.mark.parametrize("key", sorted(choice.MEASURED))
def test_the_choice_is_the_fastest_measured_or_ar(key):
    backend, kind = key
    measured = choice.MEASURED[key]
    temperature = 0.0 if kind == "greedy" else 0.7
    best = max(measured.speedup, key=measured.speedup.get)
    expected = best if measured.speedup[best] > 1.0 else "ar"
    method, reason = choice.choose_method(backend, temperature, {"draft", "ngram"})
    assert method == expected and reason.startswith(f"{expected}: ")
    assert measured.source in reason
    # Without the draft only ar and ngram can run: the choice is among those.
    method, _ = choice.choose_method(backend, temperature, {"ngram"})
    ngram = measured.speedup["ngram"]
    assert method == ("ngram" if ngram > 1.0 else "ar")


@pytest.mark.parametrize("key", sorted(choice.MEASURED_CONSTRAINED))
def test_the_constrained_table_holds_the_committed_measurements(key):
    """The constrained table's numbers are its file's, a run at the backend's defaults
    (constrained ar without options: on the CPU one pass per token) whose every
    constrained output is ar's."""
    measured = choice.MEASURED_CONSTRAINED[key]
    source = ROOT / measured.source
    data = json.loads(source.read_text())
    assert dict(measured.speedup) == choice.speedups_from_constrained(source)
    assert dict(measured.step_cost) == choice.step_costs_from_constrained(source)
    assert measured.temperature == choice.temperature_of_constrained(source)
    assert key[1] == choice.sampling_kind(measured.temperature)
    assert data["complete"] and not data["dirty_tree"]
    for label, row in data["summary"].items():
        if row["constrained"]:
            assert row["same_tokens_as_constrained_ar"] == row["prompts"], label
    ar = data["summary"]["ar+schema"]
    assert ar["jump_forward_share"] == 0.0 and key[0] == "cpu"  # the CPU's default
    # A method commits the same tokens per pass on every machine: speedup x step cost is
    # its tokens per pass (up to median against aggregate), what calibration rests on.
    for name, cost in measured.step_cost.items():
        label = f"{name}+schema"
        assert measured.speedup[name] * cost == pytest.approx(
            data["summary"][label]["aggregate_tokens_per_target_pass"], rel=0.08), name


def test_the_default_under_a_constraint():
    """The fastest of the constrained table on the CPU at T=0 where it beats ar; at T>0,
    where none beat it, ar; ar wherever the constrained table holds nothing (GPU, TPU) or
    the model ships no draft; a table whose methods all lose to ar gives ar."""
    measured = choice.MEASURED_CONSTRAINED["cpu", "greedy"]
    best = max(measured.speedup, key=measured.speedup.get)
    method, reason = choice.choose_method("cpu", 0.0, {"draft", "ngram"}, constrained=True)
    assert (method, best) == ("spec", "spec") and measured.speedup["spec"] > 1.0
    assert reason.startswith("spec: the fastest for cpu, T=0, under a constraint (")
    assert measured.source in reason
    method, reason = choice.choose_method("cpu", 0.8, {"draft", "ngram"}, constrained=True)
    assert method == "ar" and max(choice.MEASURED_CONSTRAINED["cpu", "sampled"].speedup
                                  .values()) < 1.0
    assert reason.startswith("ar: no method beat it for cpu, T>0, under a constraint (")
    for backend, temperature in (("gpu", 0.0), ("gpu", 1.0), ("tpu", 0.0)):
        method, reason = choice.choose_method(backend, temperature, {"draft", "ngram"},
                                              constrained=True)
        assert method == "ar" and "under a constraint, no method is timed" in reason
    # ngram is not in the constrained table: with the tables only, ar.
    assert choice.choose_method("cpu", 0.0, {"ngram"}, constrained=True)[0] == "ar"
    assert choice.choose_method("cpu", 0.0, set(), constrained=True)[0] == "ar"
    losing = {name: 0.9 for name in measured.speedup}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(choice.MEASURED_CONSTRAINED, ("cpu", "greedy"),
                      choice.Measurement(measured.source, 0.0, losing, measured.where))
        method, reason = choice.choose_method("cpu", 0.0, {"draft"}, constrained=True)
        assert method == "ar" and reason.startswith("ar: no method beat it for cpu, T=0, "
                                                    "under a constraint")
    req = api.request(backend="cpu", assets="smollm2-135m",
                      constraint=specjax.Regex("[a-z]+"))
    assert req.options.name == "spec" and req.choice.startswith("spec: ") and req.calibrate
    req = api.request(backend="cpu", assets="smollm2-135m", temperature=1.0,
                      constraint=[specjax.Regex("[a-z]+"), None])
    assert req.options.name == "ar" and req.choice.startswith("ar: no method beat it")
    # A method option without a method applies to the default chosen, as without one.
    req = api.request(backend="gpu", assets="smollm2-135m", jump_forward=2,
                      constraint=specjax.Regex("[a-z]+"))
    assert req.options.name == "ar" and req.options.jump_forward == 2 and not req.calibrate


def test_the_measured_cpu_choices():
    """What the committed 164-prompt CPU run at today's defaults says: spec at T=0 (1.14x),
    ar at T>0 (spec 0.95x: no method beat ar there)."""
    assert loading.default_method("smollm2-135m", "cpu", 0.0) == "spec"
    assert loading.default_method("smollm2-135m", "cpu", 1.0) == "ar"
    assert loading.default_method("smollm2-135m", "cpu", 0.8) == "ar"


def test_the_measured_gpu_choices():
    """What the committed H200 suite (bf16, attention "auto", 8 prompts) says: ngram at
    T=0 (median 2.51x, staged 2.48x), tree at T>0 (1.72x)."""
    assert loading.default_method("smollm2-135m", "gpu", 0.0) == "ngram"
    method, reason = loading.choose_default_method("smollm2-135m", "gpu", 0.8)
    assert method == "tree" and "H200" in reason


def test_unmeasured_backends_and_models_without_assets():
    method, reason = loading.choose_default_method("smollm2-135m", "tpu", 0.0)
    assert method == "staged" and "no timing" in reason
    method, reason = loading.choose_default_method("smollm2-135m", "tpu", 1.0)
    assert method == "ar" and "no timing" in reason
    assert loading.choose_default_method(None, "cpu", 0.0) == (
        "ar", "ar: the model ships no draft or n-gram tables")


def test_the_api_default_follows_the_temperature(smollm2):
    assert api.resolve_method(smollm2).name == "spec"
    assert api.resolve_method(smollm2, temperature=0.8).name == "ar"
    assert api.resolve_method(smollm2, "ar", temperature=0.8).name == "ar"
    assert api.resolve_method(smollm2, "tree", temperature=0.8).name == "tree"


def test_the_help_says_what_the_default_is(capsys):
    with pytest.raises(SystemExit):
        specjax.cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "cpu: spec at T=0, ar at T>0" in text
    assert ("under a --regex or --json-schema: spec on the cpu at T=0, ar on the cpu at T>0, "
            "ar where not timed") in text
    assert "method_choice" in text


@pytest.mark.parametrize("backend, begin, end, methods", [
    ("cpu", "Measured on a 2-core x86-64 CPU", "Every output of every method equals",
     ["ar", "spec", "staged", "tree", "ngram"]),
    ("gpu", "**On a GPU with the shipped draft**", "So the default on a GPU",
     ["spec", "tree", "ngram", "staged"])])
def test_the_readme_tables_are_the_committed_suites(backend, begin, end, methods):
    """The README's CPU and GPU tables (median speedup over ar, tokens per target pass; on
    the CPU ar's tokens/s) are what the committed suites the default follows hold, rounded
    as printed, and the source the CPU table names is that suite."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(begin):]
    section = section[:section.index(end)]
    rows = re.findall(r"^\| `(\w+)`[^|]*\| (.+?) \| (.+?) \|$", section, re.M)
    measured = choice.MEASURED[backend, "greedy"]
    if backend == "cpu":
        assert f"`{measured.source}`" in " ".join(section.split())
    suite = json.loads((ROOT / measured.source).read_text())
    aggregates = {(a["method"], float(a["temperature"])): a for a in suite["aggregates"]
                  if a.get("kind") == "specjax"}
    assert [name for name, _, _ in rows] == methods
    for name, *cells in rows:
        for temperature, cell in zip((0.0, 1.0), cells):
            aggregate = aggregates[name, temperature]
            if name == "ar":
                rate = re.fullmatch(r"1\.00x \(([\d.]+) tok/s\)", cell).group(1)
                assert float(rate) == round(aggregate["tokens_per_s"]["aggregate"], 1), cell
                continue
            speedup, tokens = re.fullmatch(r"\**([\d.]+)x\** \(([\d.]+)\)", cell).groups()
            key = (backend, "greedy" if temperature == 0.0 else "sampled")
            assert float(speedup) == round(choice.MEASURED[key].speedup[name], 2), (name, cell)
            assert float(tokens) == round(aggregate["mean_accepted"]["aggregate"], 2), (name, cell)
