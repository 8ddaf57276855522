"""Ctrl-C at many moments of real ``specjax convert``, ``build-ngram`` and ``train-draft``
processes: each run either completes (status 0, complete output) or stops with status 130,
exactly the line ``specjax: interrupted`` on stderr, and no output and nothing partial
(hidden ``.DST.partial-*`` directories, temporary files, orbax ``*-tmp`` steps) left.

The moments are found by watching the process, not by the clock, so that a slow machine
moves them to the same phases: while it reads its source (the file appears in
``/proc/PID/maps``: the loaders map it), while it writes (its partial output appears),
and at the very end (the output appears). Before that, while Python imports specjax and
jax, Ctrl-C is out of specjax's hands (``specjax/__init__`` imports jax before any code
of the command line runs).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import transformers

from helpers_checkpoints import tiny_vocabulary, write_tiny_gguf
from specjax import interrupts
from specjax.checkpoints_tools.orbax_io import load_orbax
from specjax.checkpoints_tools.sources import resolve_and_load
from specjax.drafters.ngram import load_ngram

SPECJAX = Path(sys.executable).with_name("specjax")
INTERRUPTED = "specjax: interrupted\n"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}


# ----------------------------------------------------------------------------- the guard
# In-process, with SIGINT raised by the test itself (signal.raise_signal runs the Python
# handler before it returns).


def test_a_ctrl_c_swallowed_by_a_gc_callback_is_raised_again(capsys):
    def press_during_collection(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is dropped by gc

    gc.callbacks.append(press_during_collection)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.guard() as interrupt:
                gc.collect()
                pending = interrupt.requested  # swallowed, so still pending ...
                interrupt.check()  # ... and raised here
    finally:
        gc.callbacks.remove(press_during_collection)
    assert pending
    assert capsys.readouterr().err == ""  # no "Exception ignored in ..." report
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_end_of_the_guard_raises_a_swallowed_ctrl_c():
    def press_during_collection(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(press_during_collection)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.guard():
                gc.collect()
    finally:
        gc.callbacks.remove(press_during_collection)


def test_deferred_ctrl_c_waits_for_the_block_and_its_clean_up():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.guard() as interrupt:
            with interrupt.deferred():
                signal.raise_signal(signal.SIGINT)
                steps.append("write")
                signal.raise_signal(signal.SIGINT)  # a second press changes nothing
                steps.append("clean up")
            steps.append("never")
    assert steps == ["write", "clean up"]


def test_check_raises_a_deferred_ctrl_c_between_steps_once():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.guard() as interrupt:
            with interrupt.deferred():
                interrupt.check()  # nothing pending
                signal.raise_signal(signal.SIGINT)
                try:
                    interrupt.check()
                except KeyboardInterrupt:
                    interrupt.check()  # acted on already: not raised twice
                    raise


def press_expecting_nothing() -> None:
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C was raised after the output was in place")


def test_after_completed_a_ctrl_c_is_dropped():
    try:
        with interrupts.guard() as interrupt:
            with interrupt.deferred():
                interrupt.completed()
                press_expecting_nothing()
            press_expecting_nothing()
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C was raised after the output was in place")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_after_a_ctrl_c_is_reported_as_the_ctrl_c():
    with pytest.raises(KeyboardInterrupt) as raised:
        with interrupts.guard() as interrupt:
            with interrupt.deferred():
                signal.raise_signal(signal.SIGINT)
                raise ImportError("an import that Ctrl-C broke")
    assert isinstance(raised.value.__cause__, ImportError)


def test_a_command_after_its_output_ignores_ctrl_c_and_otherwise_defers_to_guards():
    with interrupts.command("specjax: interrupted", exit_at_once=False) as command:
        with pytest.raises(KeyboardInterrupt):  # not exit_at_once: raised like Python's
            signal.raise_signal(signal.SIGINT)
        with interrupts.guard() as interrupt, interrupt.deferred():
            interrupt.completed()  # the command's output is in place: its outcome too
        press_expecting_nothing()
        command.finished()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_nothing_changes():
    seen = []

    def work():
        with interrupts.guard() as interrupt, interrupt.deferred():
            seen.append(signal.getsignal(signal.SIGINT))
        with interrupts.command("x"):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler] * 2


# ----------------------------------------------------------------------------- real processes


def tiny_llama_gguf(path: Path, hidden: int, layers: int, positions: int = 128) -> Path:
    """A random Llama with the tiny GGUF vocabulary, written as an F32 GGUF file."""
    tokens, _, _ = tiny_vocabulary()
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=positions, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        tie_word_embeddings=False)
    return write_tiny_gguf(transformers.LlamaForCausalLM(config).eval(), path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    # ~20 MB: reading and writing take about a second each, so both can be hit.
    return {"medium": tiny_llama_gguf(root / "medium.gguf", hidden=256, layers=8),
            "small": tiny_llama_gguf(root / "small.gguf", hidden=64, layers=2),
            # room for a long generation: streaming lasts long enough to be hit
            "long": tiny_llama_gguf(root / "long.gguf", hidden=64, layers=2,
                                    positions=1024)}


# ----------------------------------------------------------------------------- the harness


def mapped(path: Path) -> Callable[[int], bool]:
    """The process has ``path`` mapped into memory (it is reading it)."""
    def check(pid: int) -> bool:
        try:
            return str(path) in Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # the process is ending
            return False
    return check


def appears(directory: Path, pattern: str) -> Callable[[int], bool]:
    """Something matching ``pattern`` exists in ``directory``."""
    return lambda pid: any(directory.glob(pattern))


def interrupt_when(argv: list[str], moment: Callable[[int], bool], delay: float
                   ) -> tuple[int, str, str, bool]:
    """Runs ``specjax ARGV`` and sends SIGINT ``delay`` seconds after ``moment`` is seen.

    Returns:
      (exit status, stdout, stderr, whether SIGINT was sent before the process ended).
    """
    process = subprocess.Popen([str(SPECJAX), *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and not moment(process.pid):
            assert time.monotonic() < deadline, "the moment never came"
            time.sleep(0.002)
        time.sleep(delay)
        sent = process.poll() is None
        if sent:
            process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()  # only if the test itself failed above
    return process.returncode, out, err, sent


def leftovers(directory: Path) -> list[str]:
    """Paths under ``directory`` that an interrupted write may leave: hidden or temporary."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.name.startswith(".") or "tmp" in p.name or "partial" in p.name)


# ----------------------------------------------------------------------------- start-up

STARTUP_DELAYS = (0.0, 0.05, 0.2, 0.5)


def importing_jaxlib(pid: int) -> bool:
    """The process is loading jaxlib's extension (``specjax.launch`` is then in charge:
    only Python's own start-up, before any program code runs, comes earlier)."""
    try:
        return "jaxlib" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # as Python raises it for a Ctrl-C at that moment


@pytest.mark.parametrize("moment", ["building the parser", "handing over to the CLI"])
def test_ctrl_c_after_the_imports_before_the_command_is_one_line(monkeypatch, capsys,
                                                                 moment):
    """After the imports (``specjax.launch`` has given Ctrl-C back to Python) and before a
    command sets its own handling: one line and status 130. The slow tier's Ctrl-C test
    with the real model caught a traceback from a press while the parser was being built
    (2026-12-02); this is that moment, and the one between launch and the CLI, made
    certain."""
    from specjax import cli, launch

    if moment == "building the parser":
        monkeypatch.setattr(cli, "build_parser", _interrupted)
        run = cli.main
    else:
        monkeypatch.setattr(cli, "main", _interrupted)
        run = launch.main
    previous = signal.getsignal(signal.SIGINT)
    try:
        status = run()
    except KeyboardInterrupt:
        pytest.fail(f"a Ctrl-C while {moment} escaped as KeyboardInterrupt")
    assert (status, capsys.readouterr().err) == (130, INTERRUPTED)
    assert signal.getsignal(signal.SIGINT) is previous


def test_ctrl_c_while_the_command_imports_jax_is_one_line(models, tmp_path):
    """Ctrl-C while Python imports jax and specjax (a second or two): one line and status
    130, never a traceback, an ImportError or a crash."""
    outcomes = []
    for i, delay in enumerate(STARTUP_DELAYS):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        status, out, err, sent = interrupt_when(
            ["convert", str(models["small"]), str(parent / "dst")], importing_jaxlib, delay)
        where = f"+{delay}s: status {status}, stderr {err!r}"
        if status == 0:
            assert sorted(os.listdir(parent)) == ["dst"], where
        else:
            assert (status, out, err) == (130, "", INTERRUPTED), where
            assert os.listdir(parent) == [], where
        outcomes.append(status if sent else "ended first")
    # Importing takes longer than the first delays: those runs were interrupted there.
    assert outcomes[:2] == [130, 130], outcomes


# ----------------------------------------------------------------------------- convert

# (moment, delay): while reading the source, while orbax writes the parameters into DST's
# partial directory (its threads busy), and right when DST appears (the last steps, exit).
CONVERT_MOMENTS = [("reading", 0.0), ("reading", 0.15), ("writing", 0.0), ("writing", 0.05),
                   ("writing", 0.5), ("done", 0.0), ("done", 0.05)]


@pytest.mark.slow  # runs the command line several times (3-9 s each, idle)
def test_convert_is_complete_or_absent_at_every_ctrl_c(models, tmp_path):
    source = models["medium"]
    _, expected, _ = resolve_and_load(source)
    outcomes = {}
    for i, (moment, delay) in enumerate(CONVERT_MOMENTS):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        dst = parent / "dst"
        # save_orbax writes the config, then has orbax write the parameters.
        writing = appears(parent, ".dst.partial-*/specjax_config.json")
        watch = {"reading": mapped(source), "writing": writing,
                 "done": appears(parent, "dst")}[moment]
        status, out, err, sent = interrupt_when(["convert", str(source), str(dst)], watch,
                                                delay)
        where = f"{moment}+{delay}s: status {status}, stderr {err!r}"
        assert out == "", where
        if status == 0:
            assert err == f"wrote {dst}\n", where
            assert sorted(os.listdir(parent)) == ["dst"], where
            _, params, _ = load_orbax(dst)
            np.testing.assert_array_equal(params["embed"], expected["embed"], err_msg=where)
        else:
            assert (status, err) == (130, INTERRUPTED), where
            assert os.listdir(parent) == [], where  # no DST, no .dst.partial-*
        outcomes[(moment, delay)] = status if sent else "ended first"
    # The runs must have hit what they aimed at: reading and writing were interrupted.
    assert outcomes[("reading", 0.0)] == 130, outcomes
    assert outcomes[("writing", 0.0)] == 130, outcomes


# ----------------------------------------------------------------------------- build-ngram


@pytest.mark.slow  # runs the command line several times (3-9 s each, idle)
def test_build_ngram_is_complete_or_absent_at_every_ctrl_c(models, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 267, (20, 25_000)))
    moments = [("reading", 0.0), ("reading", 0.4), ("writing", 0.0), ("done", 0.0)]
    outcomes = {}
    for i, (moment, delay) in enumerate(moments):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        out_file = parent / "tables.npz"
        watch = {"reading": mapped(models["small"]),
                 "writing": appears(parent, ".tables.npz.partial-*"),
                 "done": appears(parent, "tables.npz")}[moment]
        status, out, err, sent = interrupt_when(
            ["build-ngram", str(out_file), "--tokenizer", str(models["small"]), "--tokens",
             str(tokens), "--trigram-buckets", "65536"], watch, delay)
        where = f"{moment}+{delay}s: status {status}, stderr {err!r}"
        assert out == "", where
        if status == 0:
            assert err.startswith(f"wrote {out_file} (") and err.count("\n") == 1, where
            assert os.listdir(parent) == ["tables.npz"], where
            load_ngram(out_file, vocab_size=267)
        else:
            assert (status, err) == (130, INTERRUPTED), where
            assert os.listdir(parent) == [], where
        outcomes[(moment, delay)] = status if sent else "ended first"
    assert outcomes[("reading", 0.0)] == 130, outcomes
    assert outcomes[("writing", 0.0)] == 130, outcomes


# ----------------------------------------------------------------------------- train-draft

TRAIN_LOG = ("corpus: ", "step ", "resumed from step ")


@pytest.mark.slow  # runs the command line several times (3-9 s each, idle)
def test_train_draft_leaves_nothing_half_written_at_any_ctrl_c(models, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the then in a an er on 1 def return for while if else x y z".split()
    for i in range(120):  # many files: the held-out split is drawn per file
        rng = np.random.default_rng(i)
        (corpus / f"{i}.txt").write_text(" ".join(rng.choice(words, 200)))
    # (moment, delay): an orbax checkpoint being saved, the final draft being written, the end.
    moments = [("checkpoint", 0.0), ("export", 0.0), ("done", 0.0)]
    outcomes = {}
    for i, (moment, delay) in enumerate(moments):
        run = tmp_path / f"run{i}"
        watch = {"checkpoint": appears(run / "train_state", "*"),
                 "export": appears(run, ".draft.tmp"), "done": appears(run, "draft")}[moment]
        status, out, err, sent = interrupt_when(
            ["train-draft", str(run), "--target", str(models["small"]), "--corpus",
             *map(str, sorted(corpus.iterdir())), "--steps", "6", "--batch-size", "2",
             "--seq-len", "16", "--checkpoint-every", "2", "--eval-every", "6",
             "--init-layers", "0"], watch, delay)
        where = f"{moment}+{delay}s: status {status}, stderr {err!r}"
        lines = err.splitlines(keepends=True)
        assert leftovers(run) == [], where  # orbax's N.orbax-checkpoint-tmp, .draft.tmp...
        if status == 0:
            assert all(line.startswith(TRAIN_LOG) for line in lines), where
            assert json.loads(out)["steps"] == 6, where
            load_orbax(run / "draft")
        else:
            assert status == 130 and lines[-1] == INTERRUPTED, where
            assert all(line.startswith(TRAIN_LOG) for line in lines[:-1]), where
            assert out == "" and not (run / "draft").exists(), where
        outcomes[(moment, delay)] = status if sent else "ended first"
    assert outcomes[("checkpoint", 0.0)] == 130, outcomes
    assert outcomes[("export", 0.0)] == 130, outcomes


# ----------------------------------------------------------------------------- generate
# Nothing of generate needs cleaning up: Ctrl-C at any moment (loading, compiling,
# prefill, streaming) ends it at once with status 130 and the one line, never a crash in
# the interpreter's shutdown, a traceback, or a press swallowed by a gc callback.


def interrupt_generate(argv: list[str], moment: Callable[[int, Path], bool], delay: float,
                       env: dict, out_file: Path) -> tuple[int, str, str, bool, float]:
    """Runs ``specjax generate ARGV`` (stdout to ``out_file``, so that the test can see
    streaming begin) and sends SIGINT ``delay`` s after ``moment(pid, out_file)``.

    Returns:
      (status, stdout, stderr, whether SIGINT was sent, seconds from SIGINT to the exit).
    """
    with open(out_file, "w") as sink:
        process = subprocess.Popen([str(SPECJAX), "generate", *argv], stdout=sink,
                                   stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 300
            while process.poll() is None and not moment(process.pid, out_file):
                assert time.monotonic() < deadline, "the moment never came"
                time.sleep(0.002)
            time.sleep(delay)
            sent = process.poll() is None
            pressed = time.monotonic()
            if sent:
                process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=300)
            waited = time.monotonic() - pressed
        finally:
            process.kill()  # only if the test itself failed above
    return process.returncode, out_file.read_text(), err, sent, waited


def streaming(pid: int, out_file: Path) -> bool:
    return out_file.stat().st_size > 0


def check_generate_outcome(status: int, out: str, err: str, where: str) -> None:
    if status == 0:
        assert err.startswith("[") and err.count("\n") == 1, where  # the summary line
        assert out.endswith("\n"), where
    else:
        assert (status, err) == (130, INTERRUPTED), where
        assert out == "" or out.endswith("\n"), where  # streamed text, then its newline


# (moment, delay): while the model file is read, then at moments of loading and
# compiling (which take seconds here), then once streaming has begun.
GENERATE_MOMENTS = [("reading", 0.0), ("reading", 0.5), ("reading", 2.0), ("streaming", 0.0)]


@pytest.mark.parametrize("cache", ["off", pytest.param("warm", marks=pytest.mark.slow)])
def test_generate_ctrl_c_at_any_moment_is_status_130_and_one_line(models, tmp_path, cache):
    model = models["long"]
    argv = ["-m", str(model), "the", "--max-new-tokens", "900", "--method", "ar"]
    env = dict(ENV, SPECJAX_COMPILATION_CACHE="off")
    if cache == "warm":
        env["SPECJAX_COMPILATION_CACHE"] = str(tmp_path / "xla")
        filled = subprocess.run([str(SPECJAX), "generate", *argv], env=env,
                                capture_output=True, text=True, timeout=600)
        assert filled.returncode == 0, filled.stderr
    outcomes = {}
    for i, (moment, delay) in enumerate(GENERATE_MOMENTS):
        watch = {"reading": lambda pid, _: mapped(model)(pid), "streaming": streaming}[moment]
        status, out, err, sent, _ = interrupt_generate(argv, watch, delay, env,
                                                       tmp_path / f"out{i}.txt")
        where = f"{moment}+{delay}s: status {status}, stderr {err!r}"
        check_generate_outcome(status, out, err, where)
        outcomes[(moment, delay)] = status if sent else "ended first"
    # The runs hit what they aimed at: the load and the streaming were interrupted.
    assert outcomes[("reading", 0.0)] == 130, outcomes
    assert outcomes[("streaming", 0.0)] == 130, outcomes


# A program whose compile takes seconds in one XLA call (no Python runs meanwhile).
SLOW_COMPILE = """
import sys
import jax, jax.numpy as jnp
from specjax import interrupts

def f(x):
    for i in range(3000):
        x = jnp.sin(x) * (i % 7 + 1) + jnp.cos(x[::-1])
    return x

with interrupts.exit_on_interrupt("specjax: interrupted"):
    lowered = jax.jit(f).lower(jnp.ones(64))  # Python: tracing
    print("compiling", flush=True)
    lowered.compile()  # seconds in XLA
print("compiled", flush=True)
"""


# The exit begins on the watching thread while the main thread is writing streamed text.
EXIT_DURING_A_WRITE = """
import sys, threading, time
from specjax import interrupts

with interrupts.exit_on_interrupt("specjax: interrupted") as watch:
    with watch.output:  # as the command writes a piece of streamed text
        watch.line_open = True
        threading.Thread(target=watch._exit).start()
        time.sleep(0.5)  # the exit has begun: it waits for this write to end
        sys.stdout.write("streamed text")
        sys.stdout.flush()
    time.sleep(30)
"""


def test_the_exit_ends_the_line_after_a_write_in_progress():
    """Found by the slow tier under load (2026-11-29): the newline a Ctrl-C adds after
    streamed text was written by the watching thread while the main thread's write of the
    next piece was being flushed, so that the piece came after it ('m\\n>'). The exit now
    waits for a write in progress; without that the text below is lost ('\\n')."""
    done = subprocess.run([sys.executable, "-c", EXIT_DURING_A_WRITE], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "streamed text\n",
                                                            INTERRUPTED)


def test_ctrl_c_during_a_long_compile_exits_at_once(tmp_path):
    """A press during one long XLA call ends the process within a second, with the one
    line: no KeyboardInterrupt unwinding through jax while its compile threads run."""
    process = subprocess.Popen([sys.executable, "-c", SLOW_COMPILE], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert process.stdout.readline() == "compiling\n"
        time.sleep(1.0)  # inside the compile (several seconds)
        assert process.poll() is None
        pressed = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=300)
        waited = time.monotonic() - pressed
    finally:
        process.kill()
    assert (process.returncode, out, err) == (130, "", INTERRUPTED)
    assert waited < 1.0, waited


@pytest.mark.slow  # the real model: loads in seconds, compiles for tens of seconds
@pytest.mark.parametrize("cache", ["off", "warm"])
def test_generate_ctrl_c_with_the_real_model(tmp_path, cache):
    argv = ["def fibonacci(n):", "--max-new-tokens", "300"]
    env = dict(ENV, SPECJAX_COMPILATION_CACHE="off")
    if cache == "warm":
        env["SPECJAX_COMPILATION_CACHE"] = str(tmp_path / "xla")
        filled = subprocess.run([str(SPECJAX), "generate", *argv], env=env,
                                capture_output=True, text=True, timeout=900)
        assert filled.returncode == 0, filled.stderr
    started = lambda pid, _: importing_jaxlib(pid)  # noqa: E731
    outcomes = []
    for i, delay in enumerate((3.0, 6.0, 9.0, 12.0, 16.0)):
        status, out, err, sent, waited = interrupt_generate(argv, started, delay, env,
                                                            tmp_path / f"out{i}.txt")
        where = f"+{delay}s: status {status}, stderr {err!r}"
        check_generate_outcome(status, out, err, where)
        if sent and status == 130:
            assert waited < 2.0, where
        outcomes.append(status if sent else "ended first")
    assert 130 in outcomes, outcomes


def test_a_process_started_with_ctrl_c_ignored_keeps_ignoring_it(models, tmp_path):
    """Started with SIGINT ignored (the background of a script, nohup), the command does
    not take Ctrl-C over while importing either: it runs to its end."""
    # The shell ignores SIGINT, then execs the command (same process) with it ignored.
    command = f"trap '' INT; exec {SPECJAX} convert {models['small']} {tmp_path / 'dst'}"
    process = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and not importing_jaxlib(process.pid):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert (process.returncode, err) == (0, f"wrote {tmp_path / 'dst'}\n")
