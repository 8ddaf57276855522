"""``benchmarks/gpu_check.sh``, the one-command GPU check, rehearsed on the CPU: the JSON's
structure, every step run, the exactness comparison catching a wrong method, and a budget
cut short leaving a valid partial JSON."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import fast_xla_flags, load_benchmark

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


gpu_check = load_benchmark("gpu_check")


def rehearse(out: Path, timeout: int, **env) -> tuple[subprocess.CompletedProcess, dict]:
    full = dict(os.environ, SPECJAX_GPU_CHECK_CPU="1", PYTHON=sys.executable,
                XLA_FLAGS=fast_xla_flags(), **env)
    done = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)
    report = json.loads((out / "gpu_check.json").read_text())
    return done, report


def check_structure(report: dict) -> None:
    assert {"device", "jax", "steps", "targets"} <= set(report)
    for step in report["steps"]:
        assert {"name", "seconds", "ok"} <= set(step), step
        assert step["ok"] or step["error"], step
    assert [s["name"] for s in report["steps"]] == [name for name, _, _ in gpu_check.STEPS]
    for target in report["targets"]:
        assert set(target) >= {"name", "goal", "measured", "met"}, target


def test_compare_outputs_finds_the_first_difference():
    expected = [[5, 6, 7], [8, 9]]
    assert gpu_check.compare_outputs(expected, [[5, 6, 7], [8, 9]])["equal"]
    wrong = gpu_check.compare_outputs(expected, [[5, 6, 7], [8, 4]])
    assert not wrong["equal"]
    assert wrong["first_difference"] == {"prompt": 1, "index": 1, "expected": 9, "got": 4}
    short = gpu_check.compare_outputs(expected, [[5, 6]])
    assert not short["equal"] and short["first_difference"]["prompt"] == 1
    longer = gpu_check.compare_outputs(expected, [[5, 6, 7, 1], [8, 9]])
    assert longer["first_difference"] == {"prompt": 0, "index": 3, "expected": None, "got": 1}


def test_compare_outputs_counts_the_equal_generations():
    got = gpu_check.compare_outputs([[5, 6], [7, 8], [9, 1]], [[5, 6], [7, 3], [9, 1]])
    assert (got["generations_equal"], got["generations"]) == (2, 3)


def test_acceptance_must_both_accept_and_reject():
    """A run proves something about both paths only if its mean accepted length lies
    strictly between 1.3 and the drafted depth and some step rejected a drafted token."""
    partial = gpu_check.acceptance([[2, 3, 1, 0, 1], [1, 1, 0, 2, 2]], [2.1, 2.5])
    assert partial["acceptance_error"] is None
    assert (partial["depth"], partial["steps"], partial["rejections"]) == (4, 13, 10)
    assert partial["mean_accepted"] == pytest.approx(2.3)
    identical = gpu_check.acceptance([[0, 0, 0, 0, 7], [0, 0, 0, 0, 6]], [4.0, 3.9])
    assert "accepted every drafted token in all 13 steps: the rejection path was not " \
        "exercised" in identical["acceptance_error"]
    never = gpu_check.acceptance([[31, 0, 0, 0, 0]], [1.0])
    assert "mean accepted 1.00 below 1.3" in never["acceptance_error"]
    barely = gpu_check.acceptance([[20, 2, 0, 0, 1]], [1.3])  # the bound itself fails
    assert "below 1.3" in barely["acceptance_error"]
    deep = gpu_check.acceptance([[0, 0, 0, 1, 9]], [4.6])  # a rejection, but too few
    assert "not below the drafted depth 4" in deep["acceptance_error"]


def test_targets_from_figures():
    steps = {
        "ar": {"rows": [{"dtype": "bfloat16", "path": "fused", "ms_per_token": 0.4,
                         "trace_kernels_per_pass": 300.0},
                        {"dtype": "bfloat16", "path": "default", "ms_per_token": 0.9,
                         "trace_kernels_per_pass": 700.0}]},
        "step_cost": {"rows": [{"method": "tree", "path": "fused", "relative_to_ar": 1.4}]},
        "exactness": {"comparisons": [
            {"method": m, "sampling": s, "dtype": "float32", "path": p, "equal": True,
             "mean_accepted": 2.0}
            for m in gpu_check.SPEC_METHODS for s in gpu_check.SAMPLINGS
            for p in ("default", "fused")] + [
            {"method": "tree", "sampling": "greedy", "dtype": "bfloat16", "path": "fused",
             "equal": False, "mean_accepted": 2.0}]},
    }
    by_name = {t["name"]: t for t in gpu_check.targets(steps)}
    assert by_name["ar bf16 ms/token"]["met"] is True
    assert by_name["ar bf16 ms/token"]["measured"] == 0.4
    assert by_name["kernels per token (ar bf16)"]["met"] is False
    assert by_name["tree 16-node step / ar step (bf16)"]["met"] is True
    assert by_name["staged step / ar step (bf16)"]["met"] is None  # not measured
    assert by_name["exact fp32"]["met"] is True
    assert "paths default, fused" in by_name["exact fp32"]["detail"]
    assert by_name["exact bf16 (fused)"]["met"] is False
    assert "tree greedy fused" in by_name["exact bf16 (fused)"]["detail"]
    assert by_name["exact bf16 (default)"]["met"] is None
    for row in steps["exactness"]["comparisons"]:
        row.update(generations_equal=2, generations=2)
    by_name = {t["name"]: t for t in gpu_check.targets(steps)}
    assert "32 of 32 generations equal" in by_name["exact fp32"]["detail"]
    # Equal outputs whose drafts were all accepted prove nothing: the target fails.
    steps["exactness"]["comparisons"][0]["acceptance_error"] = "accepted every drafted token"
    unproven = {t["name"]: t for t in gpu_check.targets(steps)}["exact fp32"]
    assert unproven["met"] is False
    assert "no rejection: spec greedy default" in unproven["detail"]
    assert "| ar bf16 ms/token | <= 0.5 | 0.4 | yes |" in gpu_check.markdown(
        {"device": "x", "jax": "y", "targets": gpu_check.targets(steps), "steps": []})


def test_the_paths_and_combos_can_be_narrowed(monkeypatch):
    """GPU_CHECK_STEP_PATHS and GPU_CHECK_EXACT_COMBOS narrow what a short window runs;
    a name outside the known ones stops the run with the choices."""
    monkeypatch.setenv("GPU_CHECK_STEP_PATHS", "default")
    monkeypatch.setenv("GPU_CHECK_EXACT_COMBOS", "float32:default,bfloat16:fused")
    sh = gpu_check.shapes(False)
    assert sh.step_paths == ("default",)
    assert sh.exact_combos == (("float32", "default"), ("bfloat16", "fused"))
    assert sh.target == gpu_check.default_shapes(False).target
    monkeypatch.setenv("GPU_CHECK_EXACT_COMBOS", "float16:default")
    with pytest.raises(SystemExit, match="float32:default"):
        gpu_check.shapes(False)
    monkeypatch.delenv("GPU_CHECK_EXACT_COMBOS")
    monkeypatch.setenv("GPU_CHECK_STEP_PATHS", "triton")
    with pytest.raises(SystemExit, match="default and/or fused"):
        gpu_check.shapes(False)
    monkeypatch.delenv("GPU_CHECK_STEP_PATHS")
    assert gpu_check.shapes(True) == gpu_check.default_shapes(True)


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_a_budget_cut_short_leaves_a_valid_partial_json(tmp_path):
    """With 14 s the environment step runs, exactness is stopped at the budget with what it
    had recorded, and the rest are recorded as not run."""
    done, report = rehearse(tmp_path / "cut", 120, GPU_CHECK_BUDGET="14")
    check_structure(report)
    assert done.returncode == 1, done.stdout + done.stderr
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["environment"]["ok"] and steps["environment"]["backend"] == "cpu"
    assert report["device"] == "cpu" and report["jax"]
    assert not steps["exactness"]["ok"] and "stopped at its limit" in steps["exactness"]["error"]
    assert not steps["batch"]["ok"] and steps["batch"]["error"].startswith("not run")
    assert "| batch | **no** |" in (tmp_path / "cut" / "gpu_check.md").read_text()
    assert "| target | goal | measured | met |" in done.stdout


@pytest.mark.slow  # ~20 s
def test_chosen_steps_still_record_the_machine(tmp_path):
    """``GPU_CHECK_STEPS`` narrows the run, but the environment step always runs, so that
    the JSON names the machine (an H100 run of 2026-11-27 without it said "unknown
    device")."""
    done, report = rehearse(tmp_path / "one", 300, GPU_CHECK_STEPS="gpt2_roofline",
                            GPU_CHECK_BUDGET="200")
    assert [s["name"] for s in report["steps"]] == ["environment", "gpt2_roofline"], \
        done.stdout + done.stderr
    assert report["device"] == "cpu" and report["jax"]
    assert "unknown device" not in (tmp_path / "one" / "gpu_check.md").read_text()


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_step_and_catches_a_wrong_method(tmp_path):
    """Every step runs to its end on tiny shapes; ``tree``'s bf16 output is made wrong by
    the test-only hook, and the bf16 target says so while fp32 stays exact; every method
    both accepted and rejected drafted tokens; the JSON names the commit it ran."""
    # Limits far above the rehearsal's minutes on a quiet machine: a shared CI machine may
    # be slower, and this test checks what the steps record, not how fast they run.
    before = _git(ROOT, "rev-parse", "HEAD")  # others may commit while the run goes on
    done, report = rehearse(tmp_path / "full", 1800, GPU_CHECK_BREAK="tree/bfloat16",
                            GPU_CHECK_BUDGET="1500", GPU_CHECK_STEP_LIMIT="600")
    check_structure(report)
    steps = {s["name"]: s for s in report["steps"]}
    assert all(s["ok"] for s in report["steps"]), [
        (s["name"], s.get("error")) for s in report["steps"] if not s["ok"]]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    comparisons = steps["exactness"]["comparisons"]
    combos = steps["exactness"]["combos"]
    assert combos == [["float32", "default"], ["bfloat16", "default"]]
    assert len(comparisons) == len(combos) * len(gpu_check.SPEC_METHODS) * 2
    wrong = [c for c in comparisons if not c["equal"]]
    assert {(c["method"], c["dtype"]) for c in wrong} == {("tree", "bfloat16")}, wrong
    assert all(c["first_difference"]["index"] == 15 and c["generations_equal"] == 2
               for c in wrong)
    # Drafted tokens were both accepted and rejected by every method, greedy and coupled.
    assert all(c["acceptance_error"] is None and c["rejections"] > 0 for c in comparisons)
    assert {c["exact"] for c in comparisons} == {"up to rounding"}
    assert report["commit"] == before or subprocess.run(
        ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", before, report["commit"]]
    ).returncode == 0, (before, report["commit"])
    assert isinstance(report["dirty"], list) and report["source"] == "git"
    targets = {t["name"]: t for t in report["targets"]}
    assert targets["exact fp32"]["met"] is True
    assert targets["exact bf16 (default)"]["met"] is False
    assert targets["exact bf16 (fused)"]["measured"] is None  # not in the rehearsal
    assert targets["verify-attention kernel checks"]["met"] is True
    for name in ("ar bf16 ms/token", "kernels per token (ar bf16)",
                 "tree 16-node step / ar step (bf16)", "staged step / ar step (bf16)",
                 "ngram step / ar step (bf16)"):
        assert isinstance(targets[name]["measured"], float), targets[name]
    # Each profiled row says what its step's data-movement fusions write.
    assert all(isinstance(r["hlo_data_movement_bytes_per_step"], int)
               for r in steps["ar"]["rows"] + steps["step_cost"]["rows"])
    assert [r["nodes"] for r in steps["verify"]["rows"]] == [1, 6, 16, 64] * 2
    assert steps["verify"]["kernel"]["relative_16_to_1"] > 0
    assert steps["gpt2_roofline"]["fraction_of_roofline_measured"] > 0
    assert [r["batch_size"] for r in steps["batch"]["rows"]] == [1, 2, 4]
    assert all(r["tokens_per_s"] > 0 for r in steps["batch"]["rows"])


@pytest.mark.slow  # ~30 s: two methods' programs and ar's for one (dtype, path)
def test_exactness_writes_each_comparison_as_it_is_made(monkeypatch):
    """A step stopped at its limit keeps the methods that finished: each comparison is
    recorded when its method's runs end, not once the whole (dtype, path) is done (an H200
    run of 2026-11-28 stopped the fp32 part after 158 s with none of its comparisons
    written)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as run_step does for a step
    # Two methods and no kernel checks: what is tested is when comparisons are written.
    monkeypatch.setattr(gpu_check, "SPEC_METHODS", ("spec", "ngram"))
    monkeypatch.setattr(gpu_check, "kernel_checks", lambda sh, interpret: [])
    sh = dataclasses.replace(gpu_check.default_shapes(True),
                             exact_combos=(("float32", "default"),))
    written = []

    def record(**figures):
        if "comparisons" in figures:
            written.append(len(figures["comparisons"]))

    gpu_check.step_exactness(sh, record)
    wanted = len(gpu_check.SPEC_METHODS) * len(gpu_check.SAMPLINGS)
    # Recorded with 1, 2, ... comparisons, not only with all of them.
    assert sorted(set(written)) == list(range(1, wanted + 1)), written


def test_the_autotuning_cache_travels_between_runs(tmp_path):
    """A run's XLA autotuning results are archived whole and seed a later run's cache; a
    missing or damaged archive, or one whose member would leave the cache, stops the run
    with one line and writes nothing outside."""
    first = tmp_path / "first" / gpu_check.AUTOTUNE_DIR
    (first / "sub").mkdir(parents=True)
    (first / "a.textproto").write_text("result a")
    (first / "sub" / "b.textproto").write_text("result b")
    archive = tmp_path / gpu_check.AUTOTUNE_ARCHIVE
    assert gpu_check.save_autotune_cache(first, archive) == 2
    later = tmp_path / "later" / gpu_check.AUTOTUNE_DIR
    assert gpu_check.seed_autotune_cache(later, archive) == {
        "seeded_from": str(archive), "entries_seeded": 2}
    assert (later / "sub" / "b.textproto").read_text() == "result b"
    assert gpu_check.save_autotune_cache(tmp_path / "none", tmp_path / "no.tar.gz") == 0
    assert not (tmp_path / "no.tar.gz").exists()  # nothing to archive: no archive

    with pytest.raises(SystemExit, match="no such file"):
        gpu_check.seed_autotune_cache(later, tmp_path / "missing.tar.gz")
    damaged = tmp_path / "damaged.tar.gz"
    damaged.write_bytes(archive.read_bytes()[:40])
    with pytest.raises(SystemExit, match="not a readable .tar.gz") as caught:
        gpu_check.seed_autotune_cache(later, damaged)
    assert "\n" not in str(caught.value)
    hostile = tmp_path / "hostile.tar.gz"
    with tarfile.open(hostile, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(SystemExit, match="not a readable"):
        gpu_check.seed_autotune_cache(later, hostile)
    assert not (later.parent / "escaped").exists()


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_json_names_the_commit_and_the_changed_files(tmp_path):
    """The commit and ``git status --porcelain`` come from git where the checkout has it;
    a copy without ``.git`` (a device machine's) takes them from what
    ``device_bundle.py stamp`` or ``pack`` carried; with neither the record says so."""
    bundle = load_benchmark("device_bundle")
    checkout = tmp_path / "repo"
    checkout.mkdir()
    _git(checkout, "init", "-q")
    (checkout / ".gitignore").write_text("/.device/\n")
    (checkout / "a.py").write_text("x = 1\n")
    _git(checkout, "add", ".")
    _git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (checkout / "a.py").write_text("x = 2\n")
    commit = _git(checkout, "rev-parse", "HEAD")
    here = gpu_check.source_record(checkout)
    assert here == {"commit": commit, "dirty": [" M a.py"], "source": "git"}

    copy = tmp_path / "inside-another-repo" / "copy"  # the files without .git, in a repo
    copy.parent.mkdir()
    _git(copy.parent, "init", "-q")
    _git(copy.parent, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "--allow-empty", "-m", "not the copy's commit")
    (copy / ".device").mkdir(parents=True)
    (copy / "a.py").write_text("x = 2\n")
    none = gpu_check.source_record(copy)
    assert none["commit"] is None and none["dirty"] is None
    assert none["source"].startswith("unknown: no git checkout here")
    assert bundle.main(["stamp", "--root", str(checkout)]) == 0
    (copy / ".device" / "source.json").write_bytes(
        (checkout / ".device" / "source.json").read_bytes())
    stamped = gpu_check.source_record(copy)
    assert (stamped["commit"], stamped["dirty"]) == (commit, [" M a.py"])
    assert stamped["source"].startswith(".device/source.json (written by device_bundle.py")
    # pack records the same in each call's manifest (a newer record wins).
    (tmp_path / "w.whl").write_bytes(b"wheel")
    assert bundle.main(["pack", "--root", str(checkout), "--wheels",
                        str(tmp_path / "w.whl")]) == 0
    (copy / ".device" / "call-1").mkdir()
    (copy / ".device" / "call-1" / "manifest.json").write_bytes(
        (checkout / ".device" / "call-1" / "manifest.json").read_bytes())
    os.utime(copy / ".device" / "source.json", (1, 1))
    packed = gpu_check.source_record(copy)
    assert packed["commit"] == commit and packed["source"].startswith(
        ".device/call-1/manifest.json")


@pytest.mark.slow  # ~40 s: spec's and ar's programs, then three runs reusing them
def test_the_exactness_check_fails_without_both_accepted_and_rejected_drafts(monkeypatch):
    """A draft identical to the target accepts every token (the rejection path never
    runs) and a draft that never agrees accepts almost none: both fail the check, which
    the shipped draft passes; a changed token is caught and counted per generation."""
    from specjax import decode

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as run_step does for a step
    monkeypatch.setattr(gpu_check, "SPEC_METHODS", ("spec",))
    monkeypatch.setattr(gpu_check, "kernel_checks", lambda sh, interpret: [])
    monkeypatch.setattr(decode, "clear_compiled", lambda: None)  # the runs share programs
    sh = dataclasses.replace(gpu_check.default_shapes(True),
                             exact_combos=(("float32", "default"),))

    def check(draft_noise: float) -> dict:
        figures = {}
        gpu_check.step_exactness(dataclasses.replace(sh, draft_noise=draft_noise),
                                 lambda **update: figures.update(update))
        return figures

    shipped = check(sh.draft_noise)
    assert shipped["errors"] == [], shipped["errors"]
    assert all(r["equal"] and r["rejections"] > 0 and 1.3 < r["mean_accepted"] < r["depth"]
               for r in shipped["comparisons"]), shipped["comparisons"]
    assert {r["exact"] for r in shipped["references"]} == {"bitwise"}  # ar
    assert {r["exact"] for r in shipped["comparisons"]} == {"up to rounding"}
    assert shipped["summary"][0].startswith("float32 default spec: 6 of 6 generations equal")
    identical = check(0.0)
    assert all(r["equal"] for r in identical["comparisons"])
    assert all("the rejection path was not exercised" in r["acceptance_error"]
               for r in identical["comparisons"])
    assert len(identical["errors"]) == 2
    never = check(100.0)
    assert all("below 1.3" in r["acceptance_error"] for r in never["comparisons"])
    monkeypatch.setenv("GPU_CHECK_BREAK", "spec/float32")
    broken = check(sh.draft_noise)
    assert [(r["equal"], r["generations_equal"]) for r in broken["comparisons"]] == \
        [(False, 2), (False, 2)]
    assert "float32 default spec: 4 of 6 generations equal" in broken["summary"][0]
