"""Bringing one's own model: ``train-draft`` and ``build-ngram`` on a small target without a
tokenizer (token ids in ``.npy`` files), the defaults that depend on the target (chosen
once it loads, one stderr line each), a failed run that leaves no folder behind, and the
checks that come before the target loads."""

from __future__ import annotations

import argparse
import json
import types

import numpy as np
import pytest

import specjax
from specjax import cli
from specjax.drafters import ngram as ngram_lib
from specjax.commands import train_draft

from helpers_checkpoints import VOCAB, save_tiny, tiny_model

# A 2-layer Llama of 61 ids, saved without a tokenizer.
NUM_LAYERS = 2
# The flags of a run that takes seconds (one tiny step).
QUICK = ["--steps", "1", "--batch-size", "1", "--seq-len", "8", "--eval-every", "1",
         "--eval-windows", "1", "--checkpoint-every", "1", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def tokenless_target(tmp_path_factory):
    """An HF directory of a 2-layer random Llama (vocabulary 61) with no tokenizer."""
    return save_tiny(tiny_model("llama-mha-tied"), tmp_path_factory.mktemp("target") / "hf")


def token_file(path, tokens: int, seed: int = 0):
    """A .npy file of ``tokens`` random ids below the tiny vocabulary, in rows of 50."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, tokens).reshape(-1, 50)
    np.save(path, ids.astype(np.int32))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def one_line_error(status: int, err: str, *fragments: str) -> None:
    """Status 2 and one error line, the last on stderr (after the run's log lines)."""
    assert status == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("specjax: error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in last, (fragment, err)


def test_a_target_without_tokenizer_trains_on_token_ids_with_its_defaults_said(
        capsys, tokenless_target, tmp_path):
    """The default --init-layers of a 2-layer target is one block, not a copy of the whole
    target, and stderr says so; the .npy corpus needs no tokenizer."""
    corpus = token_file(tmp_path / "ids.npy", 5000)
    out = tmp_path / "run"
    status, stdout, err = run(capsys, "train-draft", out, "--target", tokenless_target,
                              "--corpus", corpus, *QUICK)
    assert status == 0, err
    assert ("train-draft: --init-layers 0: the draft starts from target block 0 of 2\n"
            in err), err
    summary = json.loads(stdout)
    draft = specjax.load(summary["draft"])
    assert draft.config.num_layers == 1 and draft.tokenizer is None


def test_eagle3_defaults_follow_the_target_and_each_is_said():
    """On a 2-layer target of 61 ids: --draft-vocab becomes the whole vocabulary (the default
    8192 is larger), the feature layers those the rule gives, --init-layers 0."""
    parser = argparse.ArgumentParser()
    train_draft.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "out", "--eagle3"])
    config = types.SimpleNamespace(num_layers=NUM_LAYERS, vocab_size=VOCAB)
    lines = []
    train_draft.choose_defaults(args, config, lines.append)
    assert args.draft_vocab == VOCAB and args.init_layers == "0"
    assert lines == [
        "train-draft: --init-layers 0: the draft starts from target block 0 of 2",
        "train-draft: --feature-layers 1,0: the default rule 1, L/2-1, L-4 for a 2-layer "
        "target (clipped to its blocks, repeats dropped)",
        f"train-draft: --draft-vocab {VOCAB}: the target's whole vocabulary (the default "
        f"8192 is larger), of {VOCAB} ids"]
    assert train_draft.train_config(args).draft_vocab == VOCAB
    # Given flags stay as given, and are not announced.
    args = parser.parse_args(["train-draft", "out", "--eagle3", "--draft-vocab", "16",
                              "--feature-layers", "1", "--init-layers", "1"])
    lines.clear()
    train_draft.choose_defaults(args, config, lines.append)
    assert lines == [] and (args.draft_vocab, args.init_layers) == (16, "1")
    # A large target keeps the defaults as they were (and as earlier runs recorded them).
    args = parser.parse_args(["train-draft", "out"])
    train_draft.choose_defaults(args, types.SimpleNamespace(num_layers=30, vocab_size=49152),
                                lines.append)
    assert args.init_layers == "0,1"


def test_a_failed_run_leaves_no_folder_and_the_corrected_command_runs(
        capsys, tokenless_target, tmp_path):
    """Too little text for the held-out split: the error gives the sizes, and the folder the
    run created is gone, so that the corrected command does not find it claimed."""
    out = tmp_path / "run"
    small = token_file(tmp_path / "small.npy", 50)
    status, _, err = run(capsys, "train-draft", out, "--target", tokenless_target,
                         "--corpus", small, *QUICK)
    one_line_error(status, err, "a corpus split has 2 tokens, fewer than one window of 10 "
                   "(--seq-len 8 + 2)")
    assert not out.exists()
    status, _, err = run(capsys, "train-draft", out, "--target", tokenless_target,
                         "--corpus", token_file(tmp_path / "big.npy", 5000), *QUICK)
    assert status == 0, err
    assert (out / "draft").is_dir()


def test_bad_layers_and_vocabulary_are_refused_before_a_file_is_written(
        capsys, tokenless_target, tmp_path):
    corpus = token_file(tmp_path / "ids.npy", 5000)
    for flags, fragment in (
            (["--init-layers", "0,2"], "--init-layers 0,2: block 2 is out of range for a "
                                       "2-layer target (blocks 0 to 1)"),
            (["--eagle3", "--draft-vocab", "100"], f"--draft-vocab 100 exceeds the target's "
                                                   f"vocabulary of {VOCAB} ids"),
            (["--eagle3", "--feature-layers", "0,5"], "--feature-layers 0,5: block 5")):
        status, _, err = run(capsys, "train-draft", tmp_path / "run", "--target",
                             tokenless_target, "--corpus", corpus, *QUICK, *flags)
        one_line_error(status, err, fragment)
        assert not (tmp_path / "run").exists()


def test_text_without_a_tokenizer_names_the_way_to_give_token_ids(
        capsys, tokenless_target, tmp_path):
    text = tmp_path / "code.py"
    text.write_text("def f():\n    return 1\n")
    status, _, err = run(capsys, "train-draft", tmp_path / "run", "--target",
                         tokenless_target, "--corpus", text, *QUICK)
    one_line_error(status, err, "has no tokenizer to read text files", "--corpus FILE.npy")
    status, _, err = run(capsys, "build-ngram", tmp_path / "t.npz", "--tokenizer",
                         tokenless_target, "--text", text)
    one_line_error(status, err, "has no tokenizer to read text files", "--tokens FILE.npy")


def test_the_corpus_too_small_gives_its_sizes(tmp_path):
    from specjax.training.corpus import tokenize_corpus

    with pytest.raises(specjax.InvalidArgumentError,
                       match=r"the corpus is too small: 1 files gave 0 training and 51 "
                             r"held-out tokens"):
        tokenize_corpus([token_file(tmp_path / "ids.npy", 50)], None, max_tokens=10**6,
                        heldout_fraction=1 - 1e-9, separator=0)


def test_build_ngram_reads_token_ids_of_a_target_without_tokenizer(
        capsys, tokenless_target, tmp_path):
    out = tmp_path / "tables.npz"
    status, _, err = run(capsys, "build-ngram", out, "--tokenizer", tokenless_target,
                         "--tokens", token_file(tmp_path / "ids.npy", 2000))
    assert status == 0, err
    assert ngram_lib.load_ngram(out, vocab_size=VOCAB).vocab_size == VOCAB


def test_train_draft_checks_its_files_before_the_target_loads(capsys, monkeypatch, tmp_path):
    def load(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr(specjax, "load", load)
    status, _, err = run(capsys, "train-draft", tmp_path / "run", "--corpus",
                         tmp_path / "missing.txt")
    one_line_error(status, err, f"--corpus {tmp_path / 'missing.txt'}: no such file")
    status, _, err = run(capsys, "train-draft", tmp_path / "run", "--corpus", tmp_path)
    one_line_error(status, err, f"--corpus {tmp_path}: is a directory")
    assert not (tmp_path / "run").exists()


def test_train_draft_help_gives_every_option_help_and_its_default(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train-draft", "--help"])
    text = capsys.readouterr().out
    subparser = next(action for action in parser._subparsers._group_actions[0].choices.values()
                     if action.prog.endswith("train-draft"))
    formatter = subparser._get_formatter()
    for action in subparser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.nargs != 0:  # an option with a value states its default
            assert "(default" in formatter._get_help_string(action), action.option_strings
    assert "training steps (default: 2000)" in " ".join(text.split())
    assert "--seed SEED seed of the window sampling (and of the target's generations) " \
           "(default: 0)" in " ".join(text.split())
    assert "(default: none)" in text


def test_the_way_the_error_names_gives_token_ids_to_a_target_without_tokenizer(
        capsys, tokenless_target, tmp_path):
    """The error for a text prompt names --prompts-file; a line of token ids there runs."""
    status, _, err = run(capsys, "generate", "def f():", "-m", tokenless_target)
    one_line_error(status, err, "has no tokenizer: give token ids with --prompts-file")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [3, 17, 42, 5]}\n')
    status, out, err = run(capsys, "generate", "--prompts-file", prompts, "-m",
                           tokenless_target, "--method", "ar", "--max-new-tokens", "4")
    assert status == 0, err
    record = json.loads(out)
    assert record["prompt"] == [3, 17, 42, 5] and 1 <= len(record["tokens"]) <= 4


def test_the_readme_names_the_method_its_chat_example_runs():
    """The README's sampled chat call runs the default method at T=0.8 of each backend."""
    from pathlib import Path

    from specjax import loading

    line = next(line for line in (Path(__file__).parents[1] / "README.md").read_text()
                .splitlines() if '"Write a haiku"' in line and "temperature=0.8" in line)
    cpu, gpu = (loading.choose_default_method("smollm2-135m", backend, 0.8)[0]
                for backend in ("cpu", "gpu"))
    assert line.endswith(f"# {cpu} on CPU, {gpu} on GPU"), line
