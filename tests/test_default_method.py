"""The default method follows the measured table (specjax.methods.choice): the fastest
measured method where one beat ``ar``, ``ar`` where none did, and the table holds what
the committed result files hold."""

from __future__ import annotations

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


def test_the_measured_cpu_choices():
    """What the committed 164-prompt CPU run with the EAGLE-3 draft says: spec at T=0 and
    at T>0 (with the token draft it was staged at T=0 and ar at T>0)."""
    assert loading.default_method("smollm2-135m", "cpu", 0.0) == "spec"
    assert loading.default_method("smollm2-135m", "cpu", 1.0) == "spec"
    assert loading.default_method("smollm2-135m", "cpu", 0.8) == "spec"


def test_unmeasured_backends_and_models_without_assets():
    for backend in ("gpu", "tpu"):
        method, reason = loading.choose_default_method("smollm2-135m", backend, 0.0)
        assert method == "staged" and "no timing" in reason
        method, reason = loading.choose_default_method("smollm2-135m", backend, 1.0)
        assert method == "ar" and "no timing" in reason
    assert loading.choose_default_method(None, "cpu", 0.0) == (
        "ar", "ar: the model ships no draft or n-gram tables")


def test_the_api_default_follows_the_temperature(smollm2):
    assert api.resolve_method(smollm2).name == "spec"
    assert api.resolve_method(smollm2, temperature=0.8).name == "spec"
    assert api.resolve_method(smollm2, "ar", temperature=0.8).name == "ar"
    assert api.resolve_method(smollm2, "tree", temperature=0.8).name == "tree"


def test_the_help_says_what_the_default_is(capsys):
    with pytest.raises(SystemExit):
        specjax.cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "cpu: spec at T=0, spec at T>0" in text
    assert "method_choice" in text
