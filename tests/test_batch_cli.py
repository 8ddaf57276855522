"""``specjax generate --prompts-file`` (JSONL in, JSONL out, in batches) and ``specjax bench
--batch-size``: outputs equal the Python API's batch-1 results; bad input is one line,
exit 2."""

from __future__ import annotations

import json

import pytest

import specjax
from specjax import api, cli, loading

from conftest import random_prompt, serve_models, tiny_pair
from helpers_checkpoints import gguf_llama, write_tiny_gguf
from test_cli import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama with a tokenizer, as a GGUF file."""
    return write_tiny_gguf(gguf_llama(seed=3), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def write_lines(path, *lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_prompts_file_writes_one_json_line_per_prompt(capsys, tmp_path, tiny_gguf):
    model = specjax.load(str(tiny_gguf))
    prompts_file = write_lines(
        tmp_path / "prompts.jsonl",
        json.dumps({"id": "first", "prompt": "hello world"}),
        json.dumps("the cat"),
        "",  # blank lines are skipped
        json.dumps({"prompt": [5, 6, 7, 8, 9, 10, 11], "seed": 42}),
        json.dumps({"id": 7, "prompt": "a"}))
    out_path = tmp_path / "out.jsonl"
    settings = ["--method", "ar", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]
    status, out, err = run_cli(capsys, "generate", "-m", str(tiny_gguf), "--prompts-file",
                               prompts_file, "--batch-size", "3", "--output", str(out_path),
                               *settings)
    assert status == 0, err
    assert out == ""
    assert err.startswith("[ar] 4 prompts in batches of 3: ") and err.count("\n") == 1, err
    records = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["id"] for r in records] == ["first", 1, 2, 7]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    prompts = ["hello world", "the cat", [5, 6, 7, 8, 9, 10, 11], "a"]
    for record, prompt, seed in zip(records, prompts, [3, 3, 42, 3]):
        expected = specjax.generate(model, prompt, method="ar", max_new_tokens=6,
                                    temperature=1.0, seed=seed)
        assert record["prompt"] == prompt
        assert record["tokens"] == expected.tokens and record["text"] == expected.text
        assert record["stats"]["new_tokens"] == len(expected.tokens)
    assert [r["stats"]["batch"]["rows"] for r in records] == [3, 3, 3, 1]

    # Without --output the lines go to stdout.
    status, out, err = run_cli(capsys, "generate", "-m", str(tiny_gguf), "--prompts-file",
                               prompts_file, *settings)
    assert status == 0, err
    assert [json.loads(line)["tokens"] for line in out.splitlines()] == \
        [r["tokens"] for r in records]


@pytest.mark.parametrize("lines, argv, fragment", [
    (None, [], "no such file"),
    ([], [], "no prompts in it"),
    (["{not json"], [], "line 1: not JSON"),
    (['"ok"', '{"text": "x"}'], [], 'line 2: expected an object with a "prompt" field'),
    (['{"prompt": 3}'], [], '"prompt" must be a string or a list of token ids'),
    (['{"prompt": "x", "seed": "one"}'], [], '"seed" must be an integer'),
    (['"ok"', '""'], [], "line 2: the prompt is empty"),  # before the model loads
    (['"ok"'], ["--batch-size", "0"], "--batch-size must be in [1, 64]"),
    (['"ok"'], ["--batch-size", "65"], "--batch-size must be in [1, 64]"),
    (['"ok"'], ["a prompt"], "give a prompt or --prompts-file, not both"),
])
def test_prompts_file_errors_are_one_line(capsys, tmp_path, tiny_gguf, lines, argv, fragment):
    path = tmp_path / "prompts.jsonl"
    if lines is not None:
        write_lines(path, *lines)
    assert_one_line_error(*run_cli(capsys, "generate", "-m", str(tiny_gguf), "--method", "ar",
                                   "--max-new-tokens", "2", "--prompts-file", str(path),
                                   *argv), fragment)


def test_batch_flags_need_a_prompts_file(capsys, tiny_gguf):
    for flags in (["--batch-size", "2"], ["--output", "x.jsonl"]):
        assert_one_line_error(*run_cli(capsys, "generate", "x", "-m", str(tiny_gguf), *flags),
                              "applies to --prompts-file only")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "-m", str(tiny_gguf)])
    out, err = capsys.readouterr()
    assert_one_line_error(exit_info.value.code, out, err, "required: prompt")


# ----------------------------------------------------------------------------- bench

PROMPTS = [random_prompt(0, 9), random_prompt(1, 14), random_prompt(2, 4)]


@pytest.fixture
def served(monkeypatch):
    target = tiny_pair("llama-mha", seed=21)[1]
    draft = tiny_pair("llama-mha", seed=22, num_hidden_layers=1)[1]
    return serve_models(monkeypatch, {"tiny": target, "tiny-draft": draft}, PROMPTS)


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_bench_batch_size_reports_total_and_per_row_rates(capsys, tmp_path, served):
    out_json = tmp_path / "batch.json"
    status, out, err = run_cli(capsys, "bench", "-m", "tiny", "--methods", "ar,tree",
                               "--draft", "tiny-draft", "--tree-budget", "6", "--limit", "3",
                               "--max-new-tokens", "6", "--warmup-tokens", "2",
                               "--temperatures", "0,1", "--batch-size", "2",
                               "--json", str(out_json))
    assert status == 0, err
    assert "MISMATCH" not in err
    assert "batch size 2" in out and "tok/s/row" in out
    result = json.loads(out_json.read_text())
    assert result["benchmark"] == "batch" and result["batch_size"] == 2
    assert result["all_outputs_match"]
    for key in ("command", "date", "device", "load_average_start", "load_average_end",
                "versions", "models", "systems", "warmup", "batches", "aggregates"):
        assert key in result, key
    assert [b["rows"] for b in result["batches"] if b["system"] == "ar"] == [2, 1, 2, 1]
    for a in result["aggregates"]:
        assert a["new_tokens"] == 3 * 6  # stop tokens off: every row makes max_new_tokens
        assert a["tokens_per_s_per_row"] == pytest.approx(a["tokens_per_s"] / 2)
    speedups = {(a["system"], a["temperature"]): a["speedup"] for a in result["aggregates"]}
    assert speedups[("ar", 0.0)] == 1.0


def test_bench_batch_mismatch_exits_1(capsys, served, monkeypatch):
    real_generate = api.generate

    def wrong_tree(model, prompt, **kwargs):
        outs = real_generate(model, prompt, **kwargs)
        if kwargs.get("method") == "tree":
            outs[0].tokens[1] = (outs[0].tokens[1] + 1) % model.config.vocab_size
        return outs

    monkeypatch.setattr(api, "generate", wrong_tree)
    status, out, err = run_cli(capsys, "bench", "-m", "tiny", "--methods", "ar,tree",
                               "--draft", "tiny-draft", "--tree-budget", "6", "--limit", "2",
                               "--max-new-tokens", "4", "--warmup-tokens", "2",
                               "--batch-size", "2")
    assert status == 1
    assert "MISMATCH: tree prompt 0 T=0 differs from ar at token 1" in err


@pytest.mark.parametrize("argv, fragment", [
    (["--batch-size", "0"], "--batch-size must be in [1, 64]"),
    (["--batch-size", "2", "--peers", "hf"], "--peers run at batch 1 only"),
])
def test_bench_batch_flag_errors(capsys, argv, fragment, monkeypatch):
    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("loaded a model"))
    assert_one_line_error(*run_cli(capsys, "bench", "-m", "tiny", "--methods", "ar", *argv),
                          fragment)
