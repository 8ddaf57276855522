"""The default method on the machine that runs it (specjax.calibration): each method's
step cost timed here scales the default-method table, and the measurement is kept."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

import specjax
from specjax import api, calibration, loading
from specjax.methods import choice

SHIPPED = {"draft", "ngram"}
MEASURED = choice.MEASURED["cpu", "greedy"]


def test_the_table_predicts_itself_on_its_own_machine():
    for key, measured in choice.MEASURED.items():
        if measured.step_cost:
            assert choice.predicted_speedups(measured, measured.step_cost) == pytest.approx(
                dict(measured.speedup), abs=1e-3), key
    method = choice.choose_method("cpu", 0.0, SHIPPED)[0]
    assert choice.choose_method("cpu", 0.0, SHIPPED, MEASURED.step_cost)[0] == method


def test_slower_steps_here_make_ar_the_default():
    slower = {name: cost * 1.5 for name, cost in MEASURED.step_cost.items()}
    method, reason = choice.choose_method("cpu", 0.0, SHIPPED, slower, here="a Zen 3")
    assert method == "ar", reason
    assert reason.startswith("ar: no method predicted above 1.10x it for cpu, T=0")
    assert "predicted for a Zen 3" in reason and "x ar step" in reason
    # Cheaper tree steps here: tree, the method that commits the most tokens per pass.
    cheap_tree = dict(MEASURED.step_cost, tree=MEASURED.step_cost["tree"] / 2)
    assert choice.choose_method("cpu", 0.0, SHIPPED, cheap_tree)[0] == "tree"
    # A method not timed here is not chosen, whatever the table says of it.
    assert choice.choose_method("cpu", 0.0, SHIPPED, {"tree": 2.0})[0] == "tree"
    # A prediction must clear the margin: spec predicted 1.05x here is not enough.
    just_above = {"spec": MEASURED.speedup["spec"] * MEASURED.step_cost["spec"] / 1.05}
    assert choice.predicted_speedups(MEASURED, just_above) == {"spec": 1.05}
    assert choice.choose_method("cpu", 0.0, SHIPPED, just_above)[0] == "ar"


def _fake_generate(costs: dict, calls: list):
    """A generate whose method commits `per_pass` tokens a pass, each pass costing
    costs[method] seconds, plus a fixed 0.5 s (the prefill and the call)."""
    per_pass = {"ar": 1, "spec": 2, "tree": 3, "ngram": 2, "staged": 3}

    def generate(model, prompt, *, method, max_new_tokens, **settings):
        calls.append(dict(settings, method=method, max_new_tokens=max_new_tokens,
                          prompt=len(prompt)))
        passes = -(-max_new_tokens // per_pass[method]) + 1
        return SimpleNamespace(stats={"target_calls": passes, "compile_seconds": 0.0,
                                      "seconds": 0.5 + passes * costs[method]})
    return generate


def test_a_step_is_the_difference_of_two_runs_over_their_passes(spec_target):
    calls = []
    costs = calibration.measure_step_costs(
        spec_target, ["spec", "staged"], 0.0,
        _fake_generate({"ar": 0.04, "spec": 0.09, "staged": 0.1}, calls), resources={})
    # Seconds over tokens (or over passes with the fixed cost left in) would not give these.
    assert costs == {"spec": 2.25, "staged": 2.5}
    assert {c["max_new_tokens"] for c in calls} == set(calibration.LENGTHS)
    assert all(c["stop"] == [] and c["prompt"] == calibration.PROMPT_TOKENS for c in calls)
    assert len(calls) == 3 * 2 * (calibration.REPEATS + 1)  # ar too; round 0 compiles


def test_steps_timed_on_a_tiny_pair(spec_target, spec_drafts):
    costs = calibration.measure_step_costs(
        spec_target, ["spec"], 0.0, specjax.generate, repeats=1,
        resources={"spec": {"draft": spec_drafts["weak"]}})
    assert set(costs) == {"spec"} and 0 < costs["spec"] < 100


@pytest.fixture
def shipped_target(spec_target, monkeypatch, tmp_path):
    """The tiny target as if it shipped smollm2-135m's assets (never loaded: the draft and
    tables are stand-ins), the store in tmp_path."""
    monkeypatch.setenv(calibration.CALIBRATION_ENV, str(tmp_path / "calibration.json"))
    monkeypatch.setattr(loading, "resolve_draft", lambda model: "draft")
    monkeypatch.setattr(loading, "resolve_ngram", lambda model: "tables")
    return dataclasses.replace(spec_target, assets="smollm2-135m")


def _request(model, **settings):
    return api.request(backend="cpu", assets=model.assets, **settings)


def test_measured_once_then_kept(shipped_target, tmp_path):
    calls = []
    costs = {"ar": 0.04, "spec": 0.06, "tree": 0.2, "ngram": 0.2, "staged": 0.2}
    req = calibration.calibrated(shipped_target, _request(shipped_target),
                                 _fake_generate(costs, calls))
    # spec: 1.135 * 2.106 / 1.5 = 1.59x predicted at T=0 (0.949 * 2.148 / 1.5 = 1.36x at
    # T=1); the others below 1.
    assert req.options.name == "spec" and req.choice.startswith("spec: the fastest for cpu")
    assert req.calibration["step_cost"] == {"spec": 1.5, "tree": 5.0, "ngram": 5.0,
                                            "staged": 5.0}
    assert {c.get("draft") for c in calls if c["method"] == "spec"} == {"draft"}
    kept = json.loads((tmp_path / "calibration.json").read_text())
    assert [entry["step_cost"] for entry in kept.values()] == [req.calibration["step_cost"]]
    measured = len(calls)
    again = calibration.calibrated(shipped_target, _request(shipped_target, temperature=1.0),
                                   _fake_generate(costs, calls))
    assert len(calls) == measured  # kept: not timed again, at any temperature
    assert again.options.name == "spec" and again.choice.startswith("spec: the fastest for "
                                                                    "cpu, T>0")


def test_generate_decodes_with_the_calibrated_choice(shipped_target, tmp_path):
    slower = {name: cost * 1.5 for name, cost in MEASURED.step_cost.items()}
    (tmp_path / "calibration.json").write_text(json.dumps({
        calibration._key(shipped_target): {"step_cost": slower, "machine": "a slow CPU"}}))
    out = specjax.generate(shipped_target, [1, 2, 3], max_new_tokens=4)
    assert out.stats["method"] == "ar"
    assert "predicted for a slow CPU" in out.stats["method_choice"]
    assert out.stats["calibration"]["step_cost"] == slower
    assert out.tokens == specjax.generate(shipped_target, [1, 2, 3], max_new_tokens=4,
                                          method="ar").tokens


def test_under_a_constraint_the_same_costs_scale_the_constrained_table(shipped_target,
                                                                       tmp_path):
    """A constrained default is calibrated too: the costs kept (timed once, for every
    method of either table) scale the constrained table, and cheap enough steps keep its
    choice while slow ones make ar the default."""
    constraint = specjax.Regex("[a-z]+")
    constrained = choice.MEASURED_CONSTRAINED["cpu", "greedy"]
    calls = []
    costs = {"ar": 0.04, "spec": 0.06, "tree": 0.2, "ngram": 0.2, "staged": 0.2}
    req = calibration.calibrated(shipped_target, _request(shipped_target,
                                                          constraint=constraint),
                                 _fake_generate(costs, calls))
    assert req.options.name == "spec"
    assert req.choice.startswith("spec: the fastest for cpu, T=0, under a constraint")
    assert constrained.source in req.choice and "predicted for" in req.choice
    assert set(req.calibration["step_cost"]) == set(MEASURED.step_cost) | set(
        constrained.step_cost)  # one entry serves both tables
    assert req.calibration["reference_step_cost"] == dict(constrained.step_cost)
    # Kept: an unconstrained request is not timed again.
    measured = len(calls)
    plain = calibration.calibrated(shipped_target, _request(shipped_target),
                                   _fake_generate(costs, calls))
    assert len(calls) == measured and plain.options.name == "spec"
    slower = {name: cost * 1.5 for name, cost in constrained.step_cost.items()}
    (tmp_path / "calibration.json").write_text(json.dumps({
        calibration._key(shipped_target): {"step_cost": slower, "machine": "a slow CPU"}}))
    req = calibration.calibrated(shipped_target, _request(shipped_target,
                                                          constraint=constraint),
                                 _fake_generate(costs, calls))
    assert req.options.name == "ar" and "under a constraint" in req.choice
    assert "predicted for a slow CPU" in req.choice


def test_named_methods_and_calibration_off_keep_the_request(shipped_target, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("timed a step")
    for req in (_request(shipped_target, method="ar"),
                _request(shipped_target, verify="greedy"),
                _request(shipped_target, draft="first-layers:1")):
        assert calibration.calibrated(shipped_target, req, refuse) is req
    monkeypatch.setenv(calibration.CALIBRATION_ENV, "off")
    req = _request(shipped_target)
    assert calibration.calibrated(shipped_target, req, refuse) is req


def test_an_unreadable_store_is_measured_again(shipped_target, tmp_path):
    (tmp_path / "calibration.json").write_text("{not json")
    calls = []
    req = calibration.calibrated(shipped_target, _request(shipped_target),
                                 _fake_generate({m: 0.04 for m in ("ar", *MEASURED.step_cost)},
                                                calls))
    assert calls and req.calibration["step_cost"] == dict.fromkeys(MEASURED.step_cost, 1.0)
    assert json.loads((tmp_path / "calibration.json").read_text())
