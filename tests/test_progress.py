"""specjax.progress: phases with elapsed times on a terminal, nothing anywhere else.

A terminal is faked by a stream whose ``isatty()`` is true (or by patching the captured
stderr's); :func:`shown_lines` replays the output as a terminal would draw it.
"""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from specjax import progress
from specjax.checkpoints_tools.convert import convert

from helpers_checkpoints import gguf_llama, write_tiny_gguf


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A clock that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def shown_lines(text: str) -> list[str]:
    """The non-blank lines a terminal shows after ``text``: it understands carriage
    return, newline (as a terminal's output processing does, also back to column 0)
    and cursor-up (``ESC [ A``, which tqdm uses for bars below the first)."""
    screen: list[list[str]] = [[]]
    row = column = 0
    i = 0
    while i < len(text):
        if text.startswith("\x1b[A", i):
            row, i = max(row - 1, 0), i + 3
            continue
        char = text[i]
        i += 1
        if char == "\r":
            column = 0
        elif char == "\n":
            row, column = row + 1, 0
            while len(screen) <= row:
                screen.append([])
        else:
            line = screen[row]
            line.extend(" " * (column + 1 - len(line)))
            line[column] = char
            column += 1
    return [text for text in ("".join(line).rstrip() for line in screen) if text]


def run_phases(phases: progress.Phases, clock: Clock) -> None:
    with phases.phase("loading tiny"):
        clock.now += 8.14
    with phases.phase("compiling"):
        for _ in phases.bar(range(3), desc="steps"):
            clock.now += 1.0


def test_phases_on_a_terminal_keep_one_line_each_with_its_time():
    stream, clock = Terminal(), Clock()
    # A long interval: the redrawing thread never runs, so the output is exact.
    phases = progress.Phases(True, stream=stream, interval=60.0, clock=clock)
    assert phases.enabled
    run_phases(phases, clock)
    assert shown_lines(stream.getvalue()) == ["loading tiny ... 8.1 s", "compiling ... 3.0 s"]


def test_a_failed_phase_says_it_stopped_and_lets_the_error_through():
    stream, clock = Terminal(), Clock()
    phases = progress.Phases(True, stream=stream, interval=60.0, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        with phases.phase("writing out"):
            clock.now += 0.25
            raise KeyboardInterrupt
    assert shown_lines(stream.getvalue()) == ["writing out ... 0.2 s, stopped"]


def test_the_running_phase_is_redrawn_with_its_time_and_a_spinner():
    stream = Terminal()
    phases = progress.Phases(True, stream=stream, interval=0.01)

    def spinning() -> bool:
        return any(f" s {c}" in stream.getvalue() for c in progress.SPINNER)

    with phases.phase("waiting"):
        # The redrawing thread shows the running time without any call from here.
        deadline = time.monotonic() + 5.0
        while not spinning() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spinning(), stream.getvalue()
    assert shown_lines(stream.getvalue())[-1].startswith("waiting ... 0.")


@pytest.mark.parametrize("enabled, terminal", [(False, True), (True, False), (False, False)])
def test_nothing_is_printed_when_disabled_or_not_on_a_terminal(enabled, terminal):
    stream, clock = (Terminal() if terminal else io.StringIO()), Clock()
    phases = progress.Phases(enabled, stream=stream, interval=0.001, clock=clock)
    assert not phases.enabled
    run_phases(phases, clock)
    assert stream.getvalue() == ""


def test_phases_default_to_stderr(capsys, monkeypatch):
    with progress.phases(True) as phases:  # captured stderr: not a terminal
        assert not phases.enabled
        with phases.phase("quiet"):
            pass
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress.phases(True) as phases:
        with phases.phase("loud"):
            pass
    assert shown_lines(capsys.readouterr().err)[-1].startswith("loud ... 0.")


def test_convert_shows_its_phases_on_a_terminal_only(capsys, monkeypatch, tmp_path):
    source = write_tiny_gguf(gguf_llama(), tmp_path / "tiny.gguf")
    convert(source, tmp_path / "piped", progress=True)
    assert capsys.readouterr().err == ""  # stderr is captured, not a terminal

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    dst = tmp_path / "terminal"
    convert(source, dst, progress=True)
    kept = [line for line in shown_lines(capsys.readouterr().err) if " ... " in line]
    assert [line.split(" ... ")[0] for line in kept] == [
        f"loading {source}", f"writing {dst}", "finalizing"]
    assert all(line.split(" ... ")[1].endswith(" s") for line in kept), kept

    convert(source, tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""


def test_loading_a_tokenizer_without_torch_prints_no_transformers_advice(tmp_path):
    """Where torch is absent, importing transformers (for a tokenizer) printed "PyTorch was
    not found" on every load; specjax imports it with that advice silenced."""
    import subprocess

    path = write_tiny_gguf(gguf_llama(seed=3), tmp_path / "tiny.gguf")
    code = ("import sys; sys.modules['torch'] = None\n"  # torch absent, as find_spec sees it
            "from specjax import loading\n"
            f"assert loading.load({str(path)!r}).tokenizer is not None\n"
            "import transformers.utils.logging as logging\n"
            "logging.get_logger('x').warning_advice('advice after the import')\n")
    # As a user's shell has it: without the suite's TRANSFORMERS_VERBOSITY (conftest.py).
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=environment)
    assert done.returncode == 0, done.stderr
    assert "PyTorch was not found" not in done.stderr, done.stderr
    assert "advice after the import" in done.stderr  # silenced during the import only
