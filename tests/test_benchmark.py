"""The benchmark harness (``specjax bench``): aggregates, output check, peers, JSON, plots.

Runs use tiny random Llama models and token-id prompts (no tokenizer), served to the CLI in
place of ``smollm2-135m`` and HumanEval, so the whole file takes well under a minute.
"""

from __future__ import annotations

import json
import sys

import jax
import pytest

from specjax import api, cli, sampling
from specjax.harness import metrics, peers, plots, report, runner

from conftest import random_prompt, serve_models, tiny_pair, with_fast_options

PROMPTS = [random_prompt(0, 9), random_prompt(1, 14)]
NEW = 8
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def models():
    target = tiny_pair("llama-mha", seed=21)[1]
    draft = tiny_pair("llama-mha", seed=22, num_hidden_layers=1)[1]
    return target, draft


@pytest.fixture
def served(monkeypatch, models):
    """``specjax bench -m tiny --draft tiny-draft`` gets the tiny models; the suite's prompts
    are PROMPTS."""
    return serve_models(monkeypatch, dict(zip(("tiny", "tiny-draft"), models)), PROMPTS)


# The tree shape every run here uses, so that its program compiles once for the file.
TREE = ("--tree-budget", "6", "--draft-depth", "3")


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main(["bench", "-m", "tiny", "--max-new-tokens", str(NEW),
                       "--warmup-tokens", "2", *argv])
    out, err = capsys.readouterr()
    return status, out, err


# ----------------------------------------------------------------------------- metrics


def synthetic_rows() -> list[dict]:
    """Three prompts; ar at 10, 5, 2.5 tok/s, tree at 20, 20, 10 tok/s. Target weights are
    100 bytes, draft weights 10 bytes."""
    rows = []
    for prompt, (ar_s, tree_s, calls, draft_calls) in enumerate(
            [(1.0, 0.5, 5, 20), (2.0, 0.5, 4, 16), (4.0, 1.0, 10, 40)]):
        rows.append({"prompt": prompt, "system": "ar", "kind": "specjax", "method": "ar",
                     "temperature": 0.0, "status": "ok", "new_tokens": 10, "seconds": ar_s,
                     "tokens_per_s": 10 / ar_s, "target_calls": 10, "draft_calls": 0,
                     "mean_accepted": 1.0,
                     "weight_bytes_read": 10 * 100})
        rows.append({"prompt": prompt, "system": "tree", "kind": "specjax", "method": "tree",
                     "temperature": 0.0, "status": "ok", "new_tokens": 10, "seconds": tree_s,
                     "tokens_per_s": 10 / tree_s, "target_calls": calls,
                     "mean_accepted": 10 / calls,
                     "draft_calls": draft_calls,
                     "weight_bytes_read": calls * 100 + draft_calls * 10,
                     "tokens_by_origin": {"draft": 10 - calls, "target": calls},
                     "must_match_ar": True, "matches_ar": prompt != 2})
    rows.append({"prompt": None, "system": "hf", "kind": "peer", "method": "hf",
                 "temperature": 0.0, "status": "unavailable", "reason": "torch is not installed"})
    return rows


def test_aggregates_of_synthetic_rows():
    rows = metrics.derive(synthetic_rows())
    tree = metrics.find_aggregate(metrics.aggregate(rows), "tree", 0.0)
    approx = pytest.approx
    assert tree["prompts"] == 3 and tree["status"] == "ok"
    assert tree["tokens_per_s"] == approx({"median": 20.0, "mean": 50 / 3, "aggregate": 15.0})
    # Per prompt 2x, 4x, 4x; in totals 30 tokens / 2 s against 30 tokens / 7 s.
    assert tree["speedup_vs_ar"] == approx({"median": 4.0, "mean": 10 / 3, "aggregate": 3.5})
    assert tree["mean_accepted"] == approx({"median": 2.0, "mean": 5.5 / 3, "aggregate": 30 / 19})
    assert tree["target_passes_per_token"]["aggregate"] == approx(19 / 30)
    assert tree["draft_passes_per_token"] == approx({"median": 2.0, "mean": 76 / 30,
                                                     "aggregate": 76 / 30})
    # Bytes per token 70, 56, 140 against ar's 100.
    assert tree["weight_bytes_per_token"] == approx({"median": 70.0, "mean": 266 / 3,
                                                     "aggregate": 2660 / 30})
    assert tree["weight_bytes_vs_ar"] == approx({"median": 0.7, "mean": 2.66 / 3,
                                                 "aggregate": 2660 / 3000})
    assert tree["tokens_by_origin"] == {"draft": 11, "target": 19}
    assert tree["origin_fraction"] == approx({"draft": 11 / 30, "target": 19 / 30})
    assert tree["outputs"] == {"checked": 3, "mismatches": 1, "required": True}
    ar = metrics.find_aggregate(metrics.aggregate(rows), "ar", 0.0)
    assert ar["speedup_vs_ar"]["aggregate"] == approx(1.0)
    assert ar["weight_bytes_vs_ar"]["median"] == approx(1.0)
    hf = metrics.find_aggregate(metrics.aggregate(rows), "hf", 0.0)
    assert hf == {"system": "hf", "kind": "peer", "method": "hf", "temperature": 0.0,
                  "tree_budget": None, "prompts": 0, "status": "unavailable",
                  "reason": "torch is not installed"}
    assert [r["prompt"] for r in metrics.mismatches(rows)] == [2]


def test_pass_costs_split_the_speedup_into_acceptance_and_pass_cost():
    rows = metrics.derive(synthetic_rows())
    aggregates = metrics.aggregate(rows)
    costs = {c["system"]: c for c in report.pass_costs({"rows": rows, "aggregates": aggregates})}
    approx = pytest.approx
    # ar: 30 tokens in 30 passes and 7 s; tree: 30 tokens in 19 passes (76 draft passes), 2 s.
    assert costs["ar"] == approx({"system": "ar", "temperature": 0.0,
                                  "draft_passes_per_target_pass": 0.0,
                                  "ms_per_target_pass": 7000 / 30, "vs_ar_step": 1.0,
                                  "accepted": 1.0, "speedup": 1.0})
    assert costs["tree"] == approx({"system": "tree", "temperature": 0.0,
                                    "draft_passes_per_target_pass": 4.0,
                                    "ms_per_target_pass": 2000 / 19,
                                    "vs_ar_step": (2000 / 19) / (7000 / 30),
                                    "accepted": 30 / 19, "speedup": 3.5})
    # The split agrees with the aggregate speedup computed from tokens/s.
    tree = metrics.find_aggregate(aggregates, "tree", 0.0)
    assert costs["tree"]["speedup"] == approx(tree["speedup_vs_ar"]["aggregate"])
    assert "| `tree` | 0 | 4.00 | 105.3 | 0.45x | 1.58 | 3.50x |" in report.render_markdown(
        [{"rows": rows, "aggregates": aggregates}])


def test_pass_costs_split_a_step_into_target_draft_and_rest():
    rows = metrics.derive(synthetic_rows())
    result = {"rows": rows, "aggregates": metrics.aggregate(rows),
              "pass_breakdown": {"tree": {"target_nodes": 8, "target_ms": 60.0,
                                          "draft_passes": [[4, 1], [2, 2]], "draft_ms": 30.0}}}
    costs = {c["system"]: c for c in report.pass_costs(result)}
    assert costs["tree"]["rest_ms"] == pytest.approx(2000 / 19 - 90.0)
    assert costs["tree"]["target_nodes"] == 8 and "rest_ms" not in costs["ar"]
    markdown = report.render_markdown([result])
    assert "| `tree` | 0 | 4.00 | 105.3 | 0.45x | 1.58 | 3.50x | 8 | 60.0 | 30.0 | 15.3 |" in markdown
    assert "| `ar` | 0 | 0.00 | 233.3 | 1.00x | 1.00 | 1.00x | – | – | – | – |" in markdown
    assert "median of 10, one system after another" in markdown  # an older result's timing
    assert "negative rest" not in markdown
    # Passes timed slower on their own than in the suite: the rest goes negative, and the
    # report says what that means instead of printing it bare.
    result["pass_breakdown"]["tree"].update(target_ms=90.0, repeats=10, interleaved=3)
    markdown = report.render_markdown([result])
    assert "| 8 | 90.0 | 30.0 | -14.7 |" in markdown
    assert "A negative rest means" in markdown
    assert "interleaved over 10 rounds" in markdown


def test_step_breakdowns_time_every_pass_once_per_round_in_rotation(monkeypatch):
    """Each distinct pass is compiled once, then timed once per round, the order rotated;
    methods sharing a pass share its time; a pass's time is its median over the rounds."""
    from specjax.harness import passcost
    from specjax.methods import method_options
    target, draft = tiny_pair("llama-gqa")
    clock = [0.0]
    calls = []
    # Each pass "takes" rows ms, 10x as long in round 1 (a burst of load elsewhere).
    def fake_pass(model, rows, head_rows, prefix, attn_impl, tree):
        key = ("target" if tree else "draft", rows, head_rows)
        def call():
            calls.append(key)
            runs = calls.count(key)  # 1: the warm-up, 2: round 0, 3: round 1, ...
            clock[0] += rows * 1e-3 * (10 if runs == 3 else 1)
        return call
    monkeypatch.setattr(passcost, "_pass", fake_pass)
    monkeypatch.setattr(passcost.time, "perf_counter", lambda: clock[0])
    steps = {"spec": (method_options("spec", draft_depth=3), draft),
             "tree": (method_options("tree", tree_budget=4, draft_depth=2, draft_width=2),
                      draft),
             "ngram": (method_options("ngram", proposal=(2, 1, 1)), None)}
    out = passcost.step_breakdowns(target, steps, repeats=5)
    distinct = list(dict.fromkeys(calls[:len(set(calls))]))
    assert len(distinct) == len(set(calls)) == out["spec"]["interleaved"]
    assert len(calls) == len(distinct) * 6  # warm-up + 5 rounds
    rounds = [calls[len(distinct) * (r + 1):len(distinct) * (r + 2)] for r in range(5)]
    for r, order in enumerate(rounds):
        assert order == distinct[r % len(distinct):] + distinct[:r % len(distinct)]
    # spec (4 nodes) and tree (4 nodes) share the target pass; medians ignore the burst.
    assert out["spec"]["target_ms"] == out["tree"]["target_ms"] == pytest.approx(4.0)
    assert out["ngram"]["target_ms"] == pytest.approx(5.0)  # root + 2 + 1 + 1 nodes
    assert out["spec"]["draft_ms"] == pytest.approx(4 + 1 + 1)
    assert out["tree"]["draft_ms"] == pytest.approx(sum(
        rows for rows, _ in out["tree"]["draft_passes"]))
    assert out["ngram"]["draft_passes"] == [] and out["ngram"]["draft_ms"] == 0
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        passcost.step_breakdowns(target, steps, repeats=0)


def test_pass_plans_follow_the_methods_options():
    from specjax.harness.passcost import pass_plan
    from specjax.methods import method_options
    _, draft = tiny_pair("llama-gqa")
    assert pass_plan(method_options("ar"), None).target_nodes == 1
    spec = pass_plan(method_options("spec", draft_depth=3), draft)
    assert (spec.target_nodes, spec.draft_passes) == (4, ((4, 1), (1, 1), (1, 1)))
    tree = pass_plan(method_options("tree", tree_budget=10, draft_depth=3,
                                            draft_width=2), draft)
    assert (tree.target_nodes, tree.draft_passes) == (10, ((4, 1), (2, 2), (2, 2)))
    staged = pass_plan(method_options("staged", tree_budget=8, draft_rounds=3,
                                              proposal=(2, 1)), draft)
    # chunk = max_depth + 1 = 1 + 2 + 2 * 3 + 1 = 10; first pass 10 + 3 rows, head on 1 + 3.
    assert (staged.target_nodes, staged.draft_passes) == (8, ((13, 4), (4, 4), (4, 4)))
    ngram = pass_plan(method_options("ngram", proposal=(3, 1)), None)
    assert (ngram.target_nodes, ngram.draft_passes) == (5, ())


def test_peer_ratios_pair_each_peer_with_its_counterpart_per_prompt():
    rows = []
    for prompt, (staged_s, assisted_s) in enumerate([(1.0, 2.0), (1.0, 8.0), (2.0, 6.0)]):
        for system, seconds in (("staged", staged_s), ("hf-assisted", assisted_s)):
            rows.append({"prompt": prompt, "system": system, "temperature": 1.0,
                         "status": "ok", "new_tokens": 12, "seconds": seconds,
                         "tokens_per_s": 12 / seconds})
    # A prompt the peer did not run counts in neither side; an unavailable peer gives no pair.
    rows.append({"prompt": 3, "system": "staged", "temperature": 1.0, "status": "ok",
                 "new_tokens": 12, "seconds": 0.1, "tokens_per_s": 120.0})
    rows.append({"prompt": None, "system": "hf-lookup", "temperature": 1.0,
                 "status": "unavailable"})
    result = {"rows": rows, "aggregates": [{"system": "staged", "temperature": 1.0}]}
    # Per prompt 2x, 8x, 3x (median 3x); in totals 36 tokens / 4 s against 36 / 16 s.
    assert report.peer_ratios(result) == [
        {"system": "staged", "peer": "hf-assisted", "temperature": 1.0, "prompts": 3,
         "median": pytest.approx(3.0), "aggregate": pytest.approx(4.0)}]
    assert "| `staged` | `hf-assisted` | 1 | 3 | 3.00x | 4.00x |" in report.render_markdown(
        [{**result, "aggregates": [{"system": "staged", "temperature": 1.0, "status": "ok"}]}])


def test_first_difference():
    assert metrics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_difference([1, 2, 3], [1, 2]) == 2
    assert metrics.must_match_ar("specjax", 1.0, None)
    assert not metrics.must_match_ar("specjax", 1.0, "match")
    assert not metrics.must_match_ar("peer", 0.0, None)


# ----------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def suite_run(models):
    target, draft = models
    config = runner.SuiteConfig(methods=("ar", "tree"), temperatures=(0.0, 1.0),
                                max_new_tokens=NEW, tree_budgets=(6,), draft_depth=3,
                                peers=("hf", "hf-assisted", "hf-lookup"), warmup_tokens=2)
    so_far = []
    result = runner.run_suite(config, target, draft, PROMPTS, progress="off",
                              on_prompt=so_far.append)
    return result, so_far


@pytest.fixture(scope="module")
def suite_result(suite_run):
    return suite_run[0]


def test_the_results_so_far_come_after_every_prompt(suite_run):
    # What a caller saves as it goes, so that a run stopped at a time limit keeps them.
    result, so_far = suite_run
    assert len(so_far) == len(PROMPTS) > 1
    for done, partial in enumerate(so_far, start=1):
        assert partial["complete"] is False and partial["pass_breakdown"] == {}
        assert {r["prompt"] for r in partial["rows"]} == set(range(done))
        json.dumps(partial)
    assert result["complete"] is True
    assert so_far[-1]["rows"] == result["rows"]
    assert so_far[-1]["aggregates"] == result["aggregates"]


def test_every_method_matches_ar_and_rows_carry_stats(suite_result):
    rows = [r for r in suite_result["rows"] if r["kind"] == "specjax"]
    assert {(r["system"], r["temperature"]) for r in rows} == {
        (m, t) for m in ("ar", "tree") for t in (0.0, 1.0)}
    assert suite_result["all_outputs_match"] and suite_result["mismatches"] == []
    for row in rows:
        assert row["new_tokens"] == NEW  # stop tokens disabled
        assert row["stats"]["new_tokens"] == NEW  # the whole stats dict is carried
        if row["system"] != "ar":
            assert row["must_match_ar"] and row["matches_ar"], row  # coupled at T=1 too
            assert row["draft_calls"] > 0 and row["draft_passes_per_token"] > 0
        else:
            assert row["target_passes_per_token"] == 1.0 and row["weight_bytes_vs_ar"] == 1.0
    tree = [r for r in rows if r["system"] == "tree"][0]
    target_bytes = suite_result["models"]["target"]["weight_bytes"]
    draft_bytes = suite_result["models"]["draft"]["weight_bytes"]
    assert tree["weight_bytes_read"] == (tree["target_calls"] * target_bytes
                                         + tree["draft_calls"] * draft_bytes)
    assert tree["tree_budget"] == 6
    assert {w["system"] for w in suite_result["warmup"]} == {
        "ar", "tree", "hf", "hf-assisted", "hf-lookup"}
    # The step's passes, timed on their own: tree budget 6, depth 3, default width.
    parts = suite_result["pass_breakdown"]
    assert parts["ar"]["target_nodes"] == 1 and parts["ar"]["draft_passes"] == []
    assert parts["tree"]["target_nodes"] == 6 and parts["tree"]["draft_passes"][0] == [4, 1]
    assert len(parts["tree"]["draft_passes"]) == 3
    assert all(p["target_ms"] > 0 for p in parts.values()) and parts["tree"]["draft_ms"] > 0
    # Both systems' passes were timed together (ar's 1 node, tree's 6, tree's draft passes).
    assert parts["ar"]["interleaved"] == parts["tree"]["interleaved"] >= 3


def test_peers_run_on_the_same_weights(suite_result):
    assert {name: p["status"] for name, p in suite_result["peers"]["peers"].items()} == {
        "hf": "ok", "hf-assisted": "ok", "hf-lookup": "ok"}
    peer_rows = [r for r in suite_result["rows"] if r["kind"] == "peer"]
    assert len(peer_rows) == 3 * 2 * len(PROMPTS)
    for row in peer_rows:
        assert row["status"] == "ok" and row["new_tokens"] == NEW
        assert row["speedup_vs_ar"] > 0
        if row["temperature"] == 0:  # greedy transformers == greedy specjax, fp32
            assert row["matches_ar"] and not row["must_match_ar"], row
        else:
            assert "matches_ar" not in row
    json.dumps(suite_result)  # JSON-ready as returned


def test_peers_unavailable_are_rows_not_crashes(models, monkeypatch):
    target, _ = models
    no_draft = peers.TransformersPeers(["hf", "hf-assisted"], target, None)
    assert no_draft.status["hf"]["status"] == "ok"
    assert no_draft.status["hf-assisted"] == {"status": "unavailable",
                                              "reason": "no draft model (--draft)"}

    def broken(self, name, *args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(peers.TransformersPeers, "generate", broken)
    config = runner.SuiteConfig(methods=("ar",), max_new_tokens=NEW, warmup_tokens=2,
                                peers=("hf",))
    result = runner.run_suite(config, target, None, PROMPTS[:1], progress="off")
    assert metrics.find_aggregate(result["aggregates"], "hf", 0.0) == {
        "system": "hf", "kind": "peer", "method": "hf", "temperature": 0.0,
        "tree_budget": None, "prompts": 0, "status": "error",
        "reason": "failed at warm-up: RuntimeError: boom"}

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    config = runner.SuiteConfig(methods=("ar",), max_new_tokens=NEW, warmup_tokens=2,
                                peers=tuple(peers.PEERS))
    result = runner.run_suite(config, target, None, PROMPTS[:1], progress="off")
    for name in peers.PEERS:
        aggregate = metrics.find_aggregate(result["aggregates"], name, 0.0)
        assert aggregate["status"] == "unavailable", aggregate
        assert "torch is not installed" in aggregate["reason"]
    markdown = report.render_markdown([result])
    assert "| `hf-lookup` | unavailable: torch is not installed" in markdown


# ----------------------------------------------------------------------------- the CLI


def test_cli_json_plots_and_report(served, capsys, tmp_path, monkeypatch):
    from specjax.harness import environment

    out_json, plot_dir = tmp_path / "run.json", tmp_path / "plots"
    written = []  # the JSON is saved after every prompt, then whole
    real_write = environment.write_json
    monkeypatch.setattr(environment, "write_json",
                        lambda path, result, **kw: (written.append(result["complete"]),
                                                    real_write(path, result, **kw))[1])
    # A run from a tree with uncommitted changes says so in the file, once on stderr and in
    # both reports.
    monkeypatch.setattr(environment, "git_commit", lambda: {
        "commit": "0" * 40, "dirty_files": [" M specjax/decode.py"]})
    status, out, err = bench(capsys, "--methods", "ar,tree", "--draft", "tiny-draft", *TREE,
                             "--temperatures", "0,1", "--limit", "2", "--peers", "none",
                             "--json", str(out_json), "--plot", str(plot_dir))
    assert status == 0, err
    assert "MISMATCH" not in err
    assert written == [False, False, True]
    result = json.loads(out_json.read_text())
    assert next(iter(result)) == "dirty_tree" and result["dirty_tree"] is True
    assert err.count("dirty tree") == 1 and "specjax/decode.py" in err, err
    assert out.startswith("warning: dirty tree: run with uncommitted changes to 1 tracked")
    for key in ("command", "date", "device", "device_kind", "platform", "cpu_count",
                "load_average_start", "load_average_end", "versions", "git", "flags",
                "config", "models", "systems", "peers", "warmup", "rows", "aggregates",
                "mismatches", "all_outputs_match"):
        assert key in result, key
    assert {"jax", "flax", "transformers", "torch"} <= set(result["versions"])
    assert "commit" in result["git"]
    assert result["flags"]["tree_budget"] == 6 and result["flags"]["limit"] == 2
    assert result["config"]["tree_budgets"] == [6]
    assert result["systems"][1]["options"] == {"draft": served["tiny-draft"].name,
                                               "tree_budget": 6, "draft_depth": 3}
    # and every option it ran with, defaults included: what each of its generations reports
    ran = [r["stats"]["options"] for r in result["rows"] if r["system"] == "tree"]
    assert all(o == {"method": "tree", **result["systems"][1]["resolved_options"]} for o in ran)
    assert result["systems"][1]["resolved_options"]["tree_budget"] == 6
    assert result["models"]["draft"]["num_layers"] == 1
    assert {(a["system"], a["temperature"]) for a in result["aggregates"]} == {
        ("ar", 0.0), ("tree", 0.0), ("ar", 1.0), ("tree", 1.0)}
    for a in result["aggregates"]:
        for key in metrics.SUMMARISED:
            assert set(a[key]) == {"median", "mean", "aggregate"}, (a["system"], key)
    assert {p.name for p in plot_dir.iterdir()} == {
        "speedup_sorted.png", "mean_accepted.png", "tokens_by_origin.png"}
    for path in plot_dir.iterdir():
        assert path.read_bytes()[:8] == PNG

    capsys.readouterr()
    assert cli.main(["bench", "--report", str(out_json), "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| system | T=0 tok/s | T=0 speedup | T=0 accepted | T=0 weights/token | T=1 tok/s" in markdown
    assert "| `tree` |" in markdown and "yes (4/4)" in markdown
    assert result["command"] in markdown and result["device_kind"] in markdown
    assert "**Warning, dirty tree: run with uncommitted changes to 1 tracked file(s) " \
           "(M specjax/decode.py)" in markdown
    assert cli.main(["bench", "--report", str(out_json)]) == 0
    captured = capsys.readouterr()
    assert "T=1    tree" in captured.out and "stopped part-way" not in captured.err
    # A file saved part-way says so when reported.
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({**result, "complete": False, "rows": [
        r for r in result["rows"] if r["prompt"] == 0]}))
    assert cli.main(["bench", "--report", str(partial)]) == 0
    assert "partial.json is a run that stopped part-way, after 1 prompt(s)" in (
        capsys.readouterr().err)


def test_resume_keeps_the_finished_prompts_and_runs_the_rest(served, capsys, tmp_path,
                                                            monkeypatch):
    path = tmp_path / "run.json"
    args = ("--methods", "ar,tree", "--draft", "tiny-draft", *TREE, "--limit", "2",
            "--peers", "none", "--no-pass-breakdown", "--json", str(path), "--resume")
    status, _, err = bench(capsys, *args)  # no file yet: a whole run
    assert status == 0 and "starting at the first prompt" in err, err
    whole = json.loads(path.read_text())
    assert whole["complete"] is True
    assert [s["from_prompt"] for s in whole["segments"]] == [0]
    assert cli.main(["bench", "--report", str(path)]) == 0  # a report reads it

    # Stopped after prompt 0 (what the file holds after a kill); one row marked so that
    # keeping it shows.
    partial = {**whole, "complete": False, "rows": [r for r in whole["rows"]
                                                    if r["prompt"] == 0]}
    partial["rows"][1]["seconds"] = 1234.5
    path.write_text(json.dumps(partial))
    generated = []
    real_generate = api.generate
    monkeypatch.setattr(api, "generate", lambda model, prompt, **kw: (
        generated.append((list(prompt), kw["max_new_tokens"])), real_generate(model, prompt,
                                                                            **kw))[1])
    status, _, err = bench(capsys, *args)
    assert status == 0, err
    resumed = json.loads(path.read_text())
    assert resumed["complete"] is True and resumed["all_outputs_match"]
    assert [s["from_prompt"] for s in resumed["segments"]] == [0, 1]
    assert {"command", "date", "git", "load_average_start", "load_average_end"} <= set(
        resumed["segments"][1])
    assert resumed["date"] == whole["date"]  # the run's start stays the first segment's
    assert [(r["prompt"], r["system"]) for r in resumed["rows"]] == [
        (r["prompt"], r["system"]) for r in whole["rows"]]
    assert resumed["rows"][1]["seconds"] == 1234.5
    full_length = [p for p, n in generated if n == NEW]  # warm-up runs are 2 tokens long
    prompt_1 = [r["prompt_tokens"] for r in whole["rows"] if r["prompt"] == 1][0]
    assert len(full_length) == 2 and all(len(p) == prompt_1 for p in full_length)
    tree_1 = [a for a in resumed["aggregates"] if a["system"] == "tree"][0]
    assert tree_1["prompts"] == 2
    # The report says which part ran which prompts; a run in one part says nothing of parts.
    markdown = report.render_markdown([resumed])
    assert "Run in 2 parts (`--resume`): prompts 0-0 from " in markdown
    assert "; prompts 1-1 from " in markdown
    assert "Run in" not in report.render_markdown([whole])

    # What cannot be continued is a one-line error naming why.
    path.write_text(json.dumps(partial))
    for extra, setup, fragment in [
            (("--max-new-tokens", "4"), None, "config field 'max_new_tokens' was 8"),
            ((), lambda p: {**p, "complete": True}, "already complete"),
            ((), lambda p: {**p, "device_kind": "TPU v5e"}, "it ran on 'TPU v5e'"),
            ((), lambda p: {**p, "rows": p["rows"][:1]}, "prompt 0 lacks rows"),
            ((), lambda p: "{", "cannot resume from")]:
        saved = setup(partial) if setup else partial
        path.write_text(saved if isinstance(saved, str) else json.dumps(saved))
        status, _, err = bench(capsys, *args, *extra)
        assert status == 2 and err.startswith("specjax: error: ") and fragment in err, err
        assert err.count("\n") == 1
    status, _, err = bench(capsys, "--resume", "--limit", "1")
    assert status == 2 and "--resume needs --json PATH" in err


def test_tree_budget_sweep_systems_and_plot(models, tmp_path):
    target, draft = models
    config = runner.SuiteConfig(methods=("ar", "spec", "tree"), tree_budgets=(4, 8))
    systems = runner.build_systems(config, draft)
    assert [(s.label, s.tree_budget) for s in systems] == [
        ("ar", None), ("spec", None), ("tree@4", 4), ("tree@8", 8)]
    assert dict(systems[3].options) == {"draft": draft, "tree_budget": 8}
    aggregates = [{"system": f"tree@{b}", "kind": "specjax", "method": "tree",
                   "temperature": 0.0, "tree_budget": b, "status": "ok",
                   "speedup_vs_ar": {"median": s}} for b, s in ((4, 1.2), (8, 1.5), (16, 1.4))]
    written = plots.write_plots({"rows": [], "aggregates": aggregates}, tmp_path)
    assert [p.name for p in written] == ["speedup_vs_tree_budget.png"]
    assert written[0].read_bytes()[:8] == PNG


def test_mismatch_exits_1_unless_allowed(served, capsys, monkeypatch):
    real_generate = api.generate

    def wrong_tree(model, prompt, **kwargs):
        out = real_generate(model, prompt, **kwargs)
        if kwargs.get("method") == "tree" and len(out.tokens) > 3:
            out.tokens[3] = (out.tokens[3] + 1) % model.config.vocab_size
        return out

    monkeypatch.setattr(api, "generate", wrong_tree)
    args = ("--methods", "ar,tree", "--draft", "tiny-draft", *TREE, "--limit", "1")
    status, out, err = bench(capsys, *args)
    assert status == 1
    assert ("MISMATCH: tree differs from ar on prompt 0 at T=0: first differing new token "
            "is #3") in err
    assert "= ar 0/1" in out
    status, _, err = bench(capsys, *args, "--allow-mismatch")
    assert status == 0 and "MISMATCH" in err


def test_bad_flags_fail_in_one_line_before_loading(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(api, "load", no_load)
    for argv, fragment in [(("--methods", "ar,tree", "--draft", "none"), "needs a draft model"),
                           (("--peers", "hf,vllm"), "unknown peer 'vllm'"),
                           (("--temperatures", "0,-1", "--methods", "ar"), "temperatures"),
                           (("--draft", "first-layers:x"), "first-layers:K"),
                           (("--report", "/nonexistent.json"), "cannot read")]:
        status, out, err = bench(capsys, *argv)
        assert status == 2 and err.startswith("specjax: error: ") and fragment in err, err
        assert err.count("\n") == 1


def test_run_suite_script_is_specjax_bench(served, capsys, tmp_path, monkeypatch):
    """``benchmarks/run_suite.py`` (what gpu_run.sh and gpu_check.py run) takes ``specjax
    bench``'s flags, prints its summary, writes its JSON and exits with its status."""
    import runpy
    from pathlib import Path

    out = tmp_path / "suite.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run_suite.py"
    monkeypatch.setattr(sys, "argv", [str(script), "-m", "tiny", "--methods", "ar",
                                      "--temperatures", "0", "--limit", "1", "--peers", "none",
                                      "--max-new-tokens", str(NEW), "--warmup-tokens", "2",
                                      "--json", str(out)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    assert "T=0    ar" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "suite" and isinstance(result["dirty_tree"], bool)
    assert [(a["system"], a["temperature"]) for a in result["aggregates"]] == [("ar", 0.0)]
    assert [r["new_tokens"] for r in result["rows"]] == [NEW]


def test_bench_verify_times_each_tree_size_against_one_node(models, tmp_path, monkeypatch):
    """``benchmarks/bench_verify.py`` (gpu_run.sh's verify step) on a tiny model: one row
    per tree size, timed relative to one node, with the git state in the JSON."""
    from conftest import load_benchmark

    import specjax

    script = load_benchmark("bench_verify")
    monkeypatch.setattr(specjax, "load", lambda name, dtype: models[0])
    out = tmp_path / "verify.json"
    assert script.main(["--model", "tiny", "--nodes", "1,4", "--prefix", "16", "--capacity",
                        "128", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "verify_pass" and "commit" in result["git"]
    assert isinstance(result["dirty_tree"], bool)
    assert [r["nodes"] for r in result["rows"]] == [1, 4]
    assert result["rows"][0]["relative_to_one_token"] == 1.0
    assert all(r["ms"] > 0 for r in result["rows"])


# ----------------------------------------------------------------------------- scaling projection


def test_scaling_projection_formula_and_accepted_parsing(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from specjax.errors import InvalidArgumentError

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling_projection.py"
    spec = importlib.util.spec_from_file_location("scaling_projection", path)
    scaling = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scaling_projection", scaling)  # for its dataclass
    spec.loader.exec_module(scaling)

    acceptance = scaling.parse_accepted("4:1.5,8:2.0")
    assert acceptance == [
        {"config": "4:1.5", "tree_budget": 4, "draft_rounds": 1, "mean_accepted": 1.5},
        {"config": "8:2.0", "tree_budget": 8, "draft_rounds": 1, "mean_accepted": 2.0}]
    assert scaling.parse_accepted("4:2", rounds=3)[0]["draft_rounds"] == 3
    for bad in ("4-1.5", "4:x", "x:1.5", "4:1.5,", "4:0.5", "2:3", "4:1.5,4:2"):
        with pytest.raises(InvalidArgumentError) as info:
            scaling.parse_accepted(bad)
        assert "\n" not in str(info.value) and "--accepted" in str(info.value)

    # speedup = A * t_ar / (t_verify(N) + rounds * t_draft); budget 16 was not measured.
    times = {"124m": {"ar_ms": 10.0, "draft_ms": 2.0, "verify_ms": {"1": 10.0, "4": 11.0,
                                                                     "8": 12.0}}}
    acceptance.append({"config": "x", "tree_budget": 8, "draft_rounds": 2, "mean_accepted": 3.2})
    acceptance.append({"config": "y", "tree_budget": 16, "draft_rounds": 1, "mean_accepted": 4.0})
    rows = scaling.project(times, acceptance)["124m"]
    assert [r["config"] for r in rows] == ["4:1.5", "8:2.0", "x"]
    assert [r["projected_speedup"] for r in rows] == pytest.approx(
        [1.5 * 10 / (11 + 2), 2.0 * 10 / (12 + 2), 3.2 * 10 / (12 + 2 * 2)])
    assert rows[2]["step_ms"] == pytest.approx(16.0)

    # A tune_staged.py summary: staged configs only, options from the summary or the name.
    record = {"summary": {
        "ar": {"mean_accepted": 1.0},
        "ngram-1x10": {"mean_accepted": 1.4},
        "staged-b8-p2,1-prior0.5,0.2-r2-w1": {"mean_accepted": 2.5},
        "staged-b4-p2,1-prior0,0-r1-w1": {"mean_accepted": 1.8,
                                          "options": {"method": "staged", "tree_budget": 4,
                                                      "draft_rounds": 3}}}}
    (tmp_path / "tune.json").write_text(json.dumps(record))
    entries = scaling.read_acceptance(str(tmp_path / "tune.json"))
    assert [(e["tree_budget"], e["draft_rounds"], e["mean_accepted"]) for e in entries] == [
        (8, 2, 2.5), (4, 3, 1.8)]
    # A specjax bench result: staged systems that ran, measured draft passes per target pass.
    def aggregate(system, method, budget, accepted, draft_per_token, status="ok"):
        return {"system": system, "method": method, "temperature": 0.0, "status": status,
                "tree_budget": budget, "mean_accepted": {"aggregate": accepted},
                "target_passes_per_token": {"aggregate": 1 / accepted},
                "draft_passes_per_token": {"aggregate": draft_per_token}}
    bench = {"aggregates": [aggregate("ar", "ar", None, 1.0, 0.0),
                            aggregate("ngram", "ngram", 6, 2.0, 0.0),
                            aggregate("staged@4", "staged", 4, 2.0, 1.0),
                            aggregate("staged@8", "staged", 8, 2.5, 1.0, status="error")]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert scaling.read_acceptance(str(tmp_path / "bench.json")) == [
        {"config": "staged@4 T=0", "tree_budget": 4, "draft_rounds": pytest.approx(2.0),
         "mean_accepted": 2.0}]
    for bad in ({"summary": {"ar": {"mean_accepted": 1.0}}}, {"aggregates": [{}]}, [1]):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(InvalidArgumentError, match="--acceptance"):
            scaling.read_acceptance(str(tmp_path / "bad.json"))
    with pytest.raises(InvalidArgumentError):
        scaling.read_acceptance(str(tmp_path / "missing.json"))


def test_weight_bytes_of_a_subset_head_draft_skip_the_gathered_embedding(spec_target):
    from specjax.harness.runner import weight_bytes

    full = weight_bytes(spec_target)
    embed = spec_target.params["embed"].nbytes
    restricted = spec_target.with_head_subset([1, 2, 3])
    subset = restricted.params["head_subset"]
    assert weight_bytes(restricted) == (full - embed + subset["weight"].nbytes
                                        + subset["tokens"].nbytes)


# ----------------------------------------------------------------------------- bench_ar.py


def test_bench_ar_times_ar_and_its_prefill_reuses_the_generation_program(monkeypatch):
    """``bench_ar.py`` times ``ar`` by name, whatever the model's default method (a known
    model's is ``spec``; the script once timed ``staged``, then the default, as "ar"), and
    its prefill run is the generation's own executable with ``max_new_tokens=1``."""
    import importlib.util
    from pathlib import Path

    import jax

    import specjax
    from specjax import loading

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ar.py"
    spec = importlib.util.spec_from_file_location("bench_ar", path)
    bench_ar = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_ar", bench_ar)
    spec.loader.exec_module(bench_ar)

    config = specjax.config.ModelConfig(
        architecture="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256)
    params = specjax.models.init_params(config, jax.random.PRNGKey(0))
    # Named after a known model, so that its default method is spec.
    model = specjax.Model.from_params(config, params, name="tiny", assets="smollm2-135m")
    assert loading.default_method(model.assets) == "spec"
    ids = list(range(3, 40))
    out = specjax.generate(model, ids, max_new_tokens=6, **bench_ar.AR)
    assert out.stats["method"] == "ar" and len(out.tokens) == 6
    loop, args = bench_ar.ar_program(model, ids, 6)
    count, seconds = bench_ar.prefill_seconds(loop, args)  # asserts: no compile
    assert count == 1 and seconds > 0


# ------------------------------------------------------------ experiments/ab_compiler_options.py


def test_ab_compiler_options_applies_the_options_to_one_side_only(monkeypatch):
    """The 'with' side compiles its programs with the options and the other without them
    (checked on the options each compilation receives), both sides' tokens are compared,
    and a malformed option is refused in one line."""
    import importlib.util
    from pathlib import Path

    import jax

    import specjax
    from specjax import decode
    from specjax.errors import InvalidArgumentError

    path = (Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"
            / "ab_compiler_options.py")
    spec = importlib.util.spec_from_file_location("ab_compiler_options", path)
    ab = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ab_compiler_options", ab)
    spec.loader.exec_module(ab)

    assert ab.parse_option("xla_a=false") == ("xla_a", False)
    assert ab.parse_option(" xla_b = 3") == ("xla_b", 3)
    assert ab.parse_option("xla_c=fast") == ("xla_c", "fast")
    with pytest.raises(InvalidArgumentError, match="NAME=VALUE"):
        ab.parse_option("no-equals-sign")

    config = specjax.config.ModelConfig(
        architecture="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256)
    model = specjax.Model.from_params(config, specjax.models.init_params(
        config, jax.random.PRNGKey(0)), name="tiny")
    seen = []
    real_compiled = decode.compiled

    def spy(fn, loop, args, *rest, **kwargs):
        seen.append(loop.kernels.compiler_options)
        return real_compiled(fn, loop, args, *rest, **kwargs)

    monkeypatch.setattr(decode, "compiled", spy)
    # An option every XLA backend takes, so the options side really compiles with it.
    options = {"xla_backend_optimization_level": 1}
    base = with_fast_options(specjax.KernelOptions()).compiler_options
    result = ab.run_ab(model, [list(range(3, 20)), list(range(5, 30))], ["ar"], options, 5)
    # The 'without' side compiles with whatever options surround the run (the suite's
    # conftest sets some), the 'with' side with those plus ``options``.
    merged = tuple(sorted({**dict(base), **options}.items()))
    assert merged != base and set(seen) == {base, merged}
    summary = result["summary"]["ar"]
    assert summary["prompts"] == 2 and summary["same_tokens"] == 2
    rows = result["rows"]["ar"]
    assert [row["first"] for row in rows] == ["with", "without"]
    assert all(row["ratio"] > 0 and row["new_tokens"] == 5 for row in rows)


def test_write_json_writes_whole_results_or_nothing(tmp_path, monkeypatch):
    """Benchmark results (``specjax bench --json``, the scripts) are written whole: parent
    folders are made, a result that cannot be serialised leaves no file, and an interrupted
    write leaves the previous result as it was and no temporary file."""
    from specjax.harness import environment
    from specjax.harness.environment import write_json

    path = write_json(tmp_path / "new" / "result.json", {"rows": [1, 2], "median": 0.5})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "median": 0.5}
    with pytest.raises(TypeError):
        write_json(tmp_path / "bad.json", {"rows": object()})
    write_json(path, {"rows": [3]})  # an existing result is replaced, not appended to
    assert json.loads(path.read_text()) == {"rows": [3]}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(environment.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"rows": [4]})
    assert json.loads(path.read_text()) == {"rows": [3]}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["new", "result.json"]


def test_write_json_marks_a_result_from_a_dirty_tree(tmp_path, capsys):
    """A result that records git state gets a first key ``dirty_tree``: false from a clean
    tree; true, with one warning line on stderr, from a tree with uncommitted changes,
    wherever the git record sits (a resumed run's parts included). A result without git
    state is written as it is."""
    from specjax.harness import environment

    clean = {"commit": "a" * 40, "dirty_files": []}
    dirty = {"commit": "b" * 40, "dirty_files": [" M specjax/api.py", " M README.md"]}
    path = environment.write_json(tmp_path / "clean.json", {"git": clean, "rows": [1]})
    assert json.loads(path.read_text()) == {"dirty_tree": False, "git": clean, "rows": [1]}
    assert capsys.readouterr().err == ""

    resumed = {"machine": {"git": clean}, "segments": [{"git": clean}, {"git": dirty}]}
    path = environment.write_json(tmp_path / "dirty.json", resumed)
    written = json.loads(path.read_text())
    assert list(written)[0] == "dirty_tree" and written["dirty_tree"] is True
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specjax: warning: ") and (
        "uncommitted changes to 2 tracked file(s) (M README.md, M specjax/api.py)" in err)
    assert environment.tree_changes(written) == [" M README.md", " M specjax/api.py"]
    # bench_sharding's layout: git_commit()'s keys at the top level.
    environment.write_json(path, {**dirty, "rows": []}, warn=False)
    assert json.loads(path.read_text())["dirty_tree"] is True
    assert capsys.readouterr().err == ""

    path = environment.write_json(tmp_path / "plain.json", {"rows": [2]})
    assert json.loads(path.read_text()) == {"rows": [2]}
    assert environment.dirty_tree_warning({"git": clean}) is None


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_bench_kernels_checks_fp32_and_bf16_then_times_chained_calls(tmp_path, monkeypatch):
    """``bench_kernels.py --interpret --quick --sweep`` (the CPU smoke run of the GPU
    kernel's benchmark): the kernel is checked against the reference in float32 and
    bfloat16 (a stacked cache read by layer, trees, windows) before anything is timed; each
    tiling of the sweep is checked too; a kernel that computes the wrong thing fails the
    run (exit 1) with the failed checks recorded."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_kernels

    argv = ["--interpret", "--quick", "--variant", "gpu", "--repeats", "1", "--inner", "2",
            "--lengths", "40", "--nodes", "1,4"]
    out = tmp_path / "kernels.json"
    assert bench_kernels.main([*argv, "--sweep", "--sweep-rows", "16",
                               "--sweep-warps", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {c["dtype"] for c in result["checks"]} == {"float32", "bfloat16"}
    assert all(c["ok"] for c in result["checks"]) and len(result["checks"]) == 10
    assert any(c["head_dim"] == 96 for c in result["checks"])
    assert [(c["sliding"], c["softcap"]) for c in result["checks"] if c["sliding"]] == [
        (10, 0.0), (10, 50.0)]
    assert [(r["length"], r["nodes"]) for r in result["rows"]] == [
        (40, 1), (40, 4)] * len(bench_kernels.QUICK_SHAPES)
    assert all(r["kernel_us"] > 0 and r["reference_us"] > 0 for r in result["rows"])
    assert "2 chained calls in one jitted program" in result["timing"]
    assert result["sweep"] and all(r["check"]["ok"] for r in result["sweep"])

    # A kernel 1% off: its float32 checks fail and so does the run (only those checks run).
    real_kernel, real_problems = bench_kernels.kernel_function, bench_kernels.problems
    monkeypatch.setattr(bench_kernels, "kernel_function", lambda *a: (
        lambda *args, layer=None, **extras: 1.01 * real_kernel(*a)(*args, layer=layer,
                                                                   **extras)))
    monkeypatch.setattr(bench_kernels, "problems", lambda args: (
        [p for p in real_problems(args)[0] if p.dtype == "float32"], []))
    assert bench_kernels.main([*argv, "--json", str(out)]) == 1
    checks = json.loads(out.read_text())["checks"]
    assert len(checks) == 4 and not any(c["ok"] for c in checks)
    # A kernel that drops the sliding window fails the windowed checks.
    monkeypatch.setattr(bench_kernels, "kernel_function", lambda *a: (
        lambda *args, layer=None, first_visible=None, **extras: real_kernel(*a)(
            *args, layer=layer, **extras)))
    monkeypatch.setattr(bench_kernels, "problems", lambda args: (
        [p for p in real_problems(args)[0] if p.sliding], []))
    assert bench_kernels.main([*argv, "--json", str(out)]) == 1
    checks = json.loads(out.read_text())["checks"]
    assert len(checks) == 2 and not any(c["ok"] for c in checks)


def test_bench_linear_checks_each_backend_before_timing_it(tmp_path, monkeypatch):
    """``bench_linear.py --interpret --quick`` (the CPU smoke run): each backend's unit is
    checked against the reference, then timed; a kernel that computes the wrong thing is
    recorded as failed and the run exits 1."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_linear

    argv = ["--interpret", "--quick", "--units", "mlp", "--rows", "1", "--dtypes",
            "bfloat16", "--repeats", "1", "--inner", "1"]
    out = tmp_path / "linear.json"
    assert bench_linear.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["check"]["ok"]) for r in rows] == [
        ("xla", True), ("triton", True), ("mosaic", True)]
    assert all(r["us"] > 0 and r["weight_bytes"] == 3 * 128 * 256 * 2 for r in rows)

    real = bench_linear.linear_mosaic_gpu.fused_linear_mosaic_gpu
    monkeypatch.setattr(bench_linear.linear_mosaic_gpu, "fused_linear_mosaic_gpu",
                        lambda x, *a, **k: 0.5 * real(x, *a, **k))
    assert bench_linear.main([*argv, "--backends", "mosaic", "--json", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert not row["check"]["ok"]


def test_bench_truncation_checks_the_kept_tokens_then_times(tmp_path, monkeypatch):
    """``experiments/bench_truncation.py``: every truncating setting is checked against the
    sort-based truncation before either is timed; a truncation keeping other tokens exits
    1."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"
                                    / "experiments"))
    import bench_truncation

    out = tmp_path / "truncation.json"
    assert bench_truncation.main(["--rows", "2", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["setting"] for r in results] == list(bench_truncation.SETTINGS)
    assert all(r["specjax_ms"] > 0 for r in results)
    assert [("sort_ms" in r) for r in results] == [False, True, True, True]

    monkeypatch.setattr(sampling, "_truncate", lambda x, k, p, branch: x)  # keeps everything
    assert bench_truncation.main(["--rows", "2", "--repeats", "1"]) == 1


def test_bench_cpu_layer_loop_checks_the_four_programs_agree_then_times(tmp_path,
                                                                         monkeypatch):
    """``experiments/bench_cpu_layer_loop.py``: the four forms of the layer loop give the
    same output before they are timed; a form computing something else exits 1."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"
                                    / "experiments"))
    import bench_cpu_layer_loop

    out = tmp_path / "loop.json"
    argv = ["--layers", "2", "--rows", "1,3", "--repeats", "1"]
    assert bench_cpu_layer_loop.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["results"]] == [1, 3]
    assert result["weight_bytes"] == 2 * 2 * 576 * 1536 * 4
    for row in result["results"]:
        assert all(row[f"{name}_ms"] > 0 for name in ("scan", "fori", "separate",
                                                      "scan_unrolled"))
    real_scan = jax.lax.scan
    monkeypatch.setattr(jax.lax, "scan", lambda f, init, xs, **kw: real_scan(
        f, init * (1.0 + kw.pop("unroll", False)), xs, **kw))  # scan_unrolled doubles x
    assert bench_cpu_layer_loop.main(argv) == 1


def _bench_constrained(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"
                                    / "experiments"))
    import bench_constrained

    return bench_constrained


def _spelling_target():
    """A tiny random Llama over the byte-level tokenizer of ``test_constraints.py`` (its
    ``<eos>`` the model's end of sequence), in transformers' tokenizer wrapper."""
    from transformers import PreTrainedTokenizerFast

    import specjax
    from test_constraints import V, eos_id, tiny_tokenizer

    model = tiny_pair("llama-gqa", seed=5, vocab_size=V, eos_token_id=eos_id())[1]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(), eos_token="<eos>")
    return specjax.Model.from_params(model.config, model.params, tokenizer, name="tiny-spelling")


@pytest.mark.slow  # 8 s at load 3, 70 s at load 9: export, outlines' index, a compile
def test_bench_constrained_peer_is_transformers_under_outlines_on_our_weights(monkeypatch):
    """``experiments/bench_constrained.py --peer``: transformers' ``generate`` with
    outlines' processor for the schema, on the weights written from ours, gives greedy
    constrained ``ar``'s tokens (fp32, a tiny model), stopping at the model's EOS; the
    tokens a state forces are counted on the automaton (a forced letter and a forced EOS)."""
    pytest.importorskip("outlines")
    import jsonschema

    import specjax
    from specjax.constraints import build_tables
    from test_constraints import V, eos_id, tiny_tokenizer

    bench_constrained = _bench_constrained(monkeypatch)
    target = _spelling_target()
    # Its documents are at most 30 characters: every output ends within the budget.
    schema = {"type": "object", "properties": {"a": {"type": "boolean"},
                                               "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"]}
    peer = bench_constrained.OutlinesPeer(target, schema, torch_threads=1)
    assert peer.available(), peer.describe()
    assert peer.describe()["backend"] == "outlines_core" and peer.describe()["dtype"] == "float32"
    out = peer.generate(PROMPTS[1], 32)
    ours = specjax.generate(target, PROMPTS[1], method="ar", max_new_tokens=32,
                            constraint=specjax.JsonSchema(schema))
    assert out["tokens"] == ours.tokens and out["text"] == ours.text
    assert out["tokens"][-1] == eos_id() and out["tokens_per_s"] > 0
    jsonschema.validate(json.loads(out["text"]), schema)

    tables, _ = build_tables(specjax.Regex("x[0-9]"), tiny_tokenizer(), V, [eos_id()],
                             use_cache=False)
    x, one = (tiny_tokenizer().token_to_id(c) for c in "x1")
    assert bench_constrained.automaton_forced(tables, [x, one, eos_id()]) == 2


def test_bench_constrained_peer_without_outlines_is_a_reason(monkeypatch):
    """Without the ``outlines`` package the peer is a one-line reason, not a crash."""
    bench_constrained = _bench_constrained(monkeypatch)
    monkeypatch.setitem(sys.modules, "outlines", None)  # import outlines now fails
    peer = bench_constrained.OutlinesPeer(object(), {"type": "integer"})
    assert not peer.available()
    assert peer.describe() == {"status": "unavailable",
                               "reason": "outlines is not installed (pip install outlines)"}


def test_bench_constrained_samples_with_the_prompts_seed_and_refuses_a_greedy_peer(
        monkeypatch, capsys):
    """``--temperature``: each generation gets it with its prompt's seed; a negative one,
    or the (greedy) peer above 0, is refused in one line before the model loads."""
    import specjax

    bench_constrained = _bench_constrained(monkeypatch)
    calls = []
    monkeypatch.setattr(specjax, "generate", lambda model, prompt, **kw: calls.append(kw))
    bench_constrained.run_one("model", "p", "spec", True, {}, 8, temperature=1.0, seed=3)
    assert calls[0]["temperature"] == 1.0 and calls[0]["seed"] == 3
    assert calls[0]["method"] == "spec" and "constraint" in calls[0]
    monkeypatch.setattr(specjax, "load", lambda *a, **k: pytest.fail("loaded the model"))
    for argv, message in ((["--temperature", "-1"], "--temperature must be >= 0"),
                          (["--peer", "--temperature", "1"], "--peer runs transformers greedy")):
        with pytest.raises(SystemExit) as exited:
            bench_constrained.main(argv)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err


def test_bench_linear_attn_rope_unit_checks_the_rope_kernel(tmp_path, monkeypatch):
    """The ``attn-rope`` unit (q|k|v with RoPE into the packed buffer, then o) passes its
    check with the Triton kernel, and a kernel that leaves the queries unrotated fails it
    (the unit's output reads the query heads; keys and values are checked in
    tests/test_fused_kernels.py)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_linear

    argv = ["--interpret", "--quick", "--units", "attn-rope", "--rows", "1", "--dtypes",
            "float32", "--backends", "xla,triton", "--repeats", "1", "--inner", "1"]
    out = tmp_path / "linear.json"
    assert bench_linear.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["unit"], r["backend"], r["check"]["ok"]) for r in rows] == [
        ("attn-rope", "xla", True), ("attn-rope", "triton", True)]

    real = bench_linear.linear_gpu.qkv_rope_into_gpu
    monkeypatch.setattr(bench_linear.linear_gpu, "qkv_rope_into_gpu",
                        lambda *a, rope_heads, **k: real(*a, rope_heads=0, **k))
    assert bench_linear.main([*argv, "--backends", "triton", "--json", str(out)]) == 1


# ----------------------------------------------------------------------------- draft_agreement.py


def _draft_agreement(monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_agreement.py"
    spec = importlib.util.spec_from_file_location("draft_agreement", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "draft_agreement", module)
    spec.loader.exec_module(module)
    return module


def test_draft_agreement_scores_count_chains_of_hits_and_overlaps(monkeypatch):
    """At T = 0 a chain is the run of top-1 hits from a position, capped at the depth; at
    T > 0 ``accept`` is the overlap of the two distributions and a chain the sum of the
    running products of acceptances."""
    import numpy as np

    agreement = _draft_agreement(monkeypatch)
    hits = np.array([1, 1, 0, 1, 1, 1, 1, 0], bool)
    p = np.zeros((hits.size, 5))
    p[:, 2] = 3.0  # the target's top token is 2 everywhere
    q = np.zeros((hits.size, 5))
    q[np.arange(hits.size), np.where(hits, 2, 4)] = 3.0
    got = agreement.scores(p, q, 0.0, 4)
    np.testing.assert_array_equal(got["top1"], hits)
    np.testing.assert_array_equal(got["accept"], hits)
    np.testing.assert_array_equal(got["chain"], [2, 1, 0, 4, 3, 2, 1, 0])

    p = np.log(np.array([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.1, 0.1, 0.8]]) + 1e-30)
    q = np.log(np.array([[1.0, 0.0, 0.0], [0.2, 0.8, 0.0], [0.8, 0.1, 0.1]]) + 1e-30)
    got = agreement.scores(p, q, 1.0, 2)
    np.testing.assert_allclose(got["accept"], [0.5, 1.0, 0.3], atol=1e-9)
    np.testing.assert_allclose(got["chain"], [0.5 + 0.5 * 1.0, 1.0 + 1.0 * 0.3, 0.3],
                               atol=1e-9)
    np.testing.assert_array_equal(got["top1"], [1, 1, 0])  # ties: the first index
    assert "reach" not in got  # a full-vocabulary draft


def test_draft_agreement_reach_is_the_target_mass_a_subset_head_can_propose(monkeypatch):
    """``reach`` is whether the target's token is in the draft's head subset (T = 0) or the
    target's probability on the subset (T > 0); ``head_tokens`` reads the subset of a
    draft made with ``with_head_subset`` and is None for a full head."""
    import numpy as np

    agreement = _draft_agreement(monkeypatch)
    p = np.log(np.array([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]))
    q = np.log(np.array([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]]))  # the target's mass counts
    got = agreement.scores(p, q, 0.0, 2, head=[0, 2])
    np.testing.assert_array_equal(got["reach"], [0, 1])
    got = agreement.scores(p, q, 1.0, 2, head=[0, 2])
    np.testing.assert_allclose(got["reach"], [0.4, 0.8], atol=1e-9)
    _, draft = tiny_pair("llama-gqa")
    assert agreement.head_tokens(draft) is None
    np.testing.assert_array_equal(
        agreement.head_tokens(draft.with_head_subset([5, 3, 9])), [3, 5, 9])


def test_draft_agreement_teacher_forced_logits_reproduce_the_greedy_continuation(monkeypatch):
    """The one-pass logits over prompt + continuation pick, at every continuation position,
    the token greedy decoding wrote there: what the target's "top token" means in the
    scores is the token it actually decodes."""
    import numpy as np

    import specjax
    from specjax.training import sample_corpus

    agreement = _draft_agreement(monkeypatch)
    _, target = tiny_pair("llama-gqa")
    prompt = random_prompt(3, 21)
    row = sample_corpus.sample_continuations(target.params, target.config, [prompt],
                                             num_new_tokens=12, temperature=0.0)[0]
    assert list(row) == list(specjax.generate(target, prompt, method="ar",
                                              max_new_tokens=12).tokens)
    predicted = agreement.continuation_logits(target, prompt, row).argmax(-1)
    np.testing.assert_array_equal(predicted, row)
