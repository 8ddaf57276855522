"""Progress on a terminal: named phases with their elapsed time, and per-item bars.

Usage::

    from specjax import progress

    with progress.phases(enabled=not args.json) as shown:
        with shown.phase("loading smollm2-135m"):
            model = load(...)               # a spinner and the running time meanwhile
        with shown.phase("compiling"):
            ...
        for tensor in shown.bar(tensors, desc="writing", unit="tensor"):
            ...                             # a tqdm bar, removed when done

What stays on the terminal (stderr)::

    loading smollm2-135m ... 8.1 s
    compiling ... 4.0 s

A phase that ends with an exception (an error, Ctrl-C) keeps its line with
``..., stopped`` after the time, so the error line that follows is not run into it.

Nothing at all is printed when ``enabled`` is false (e.g. ``--json``) or when stderr is
not a terminal (piped, captured, redirected to a file): output that a program reads keeps
its exact shape. The loaders' own ``progress=`` flags draw tqdm bars; pass them
``shown.enabled`` so that they show exactly when the phases do. Bars opened while a phase
is running are drawn on the line below it (tqdm stacks its open bars).

The phase lines are tqdm bars too (so that they and the loaders' bars share one terminal
without overwriting each other); a daemon thread redraws the running one every
``interval`` seconds.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, TextIO

from tqdm import tqdm

SPINNER = "|/-\\"


class Phases:
    """Draws phases on ``stream`` (see the module docstring); use :func:`phases`.

    Attributes:
      enabled: whether anything is drawn (asked for and ``stream`` is a terminal).
    """

    def __init__(self, enabled: bool, stream: TextIO | None = None, interval: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(enabled) and _isatty(self.stream)
        self._interval = interval
        self._clock = clock

    @contextlib.contextmanager
    def phase(self, description: str) -> Iterator[None]:
        """Shows ``description ... <seconds> s`` while the block runs and keeps it after.

        Args:
          description: what the phase does, e.g. ``"loading smollm2-135m"``.
        """
        if not self.enabled:
            yield
            return
        started = self._clock()
        line = tqdm(total=None, desc=description, bar_format="{desc}", file=self.stream,
                    leave=True, **self._width())

        def show(text: str) -> None:
            line.set_description_str(f"{description} ... {text}")

        stop = threading.Event()

        def redraw() -> None:
            turn = 0
            while not stop.wait(self._interval):
                turn += 1
                show(f"{self._clock() - started:.1f} s {SPINNER[turn % len(SPINNER)]}")

        show("")
        ticker = threading.Thread(target=redraw, name="specjax-progress", daemon=True)
        ticker.start()
        outcome = ""
        try:
            yield
        except BaseException:
            outcome = ", stopped"
            raise
        finally:
            stop.set()
            ticker.join()
            show(f"{self._clock() - started:.1f} s{outcome}")
            line.close()

    def bar(self, iterable: Iterable[Any] | None = None, total: int | None = None,
            desc: str = "", unit: str = "it") -> tqdm:
        """A tqdm bar for the items of a phase, removed from the terminal when closed.

        Args:
          iterable: items to wrap (or ``None`` and call ``update`` yourself).
          total: number of items, when ``iterable`` has no length.
          desc: label before the bar.
          unit: what one item is called.
        Returns:
          a tqdm bar (disabled, printing nothing, when the phases are).
        """
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=self.stream,
                    leave=False, disable=not self.enabled, **self._width())

    def _width(self) -> dict[str, Any]:
        # Lines follow the terminal's width; one that reports none (0 columns, e.g. a
        # pseudo-terminal nobody sized) would make tqdm cut or hide every line.
        try:
            known = os.get_terminal_size(self.stream.fileno()).columns > 0
        except (AttributeError, ValueError, OSError):  # no file descriptor: not measurable
            known = False
        return {"dynamic_ncols": True} if known else {"ncols": 0, "nrows": 20}


@contextlib.contextmanager
def phases(enabled: bool = True, stream: TextIO | None = None) -> Iterator[Phases]:
    """Phases drawn on ``stream`` (default: stderr) when ``enabled`` and it is a terminal.

    Args:
      enabled: false to print nothing (e.g. with ``--json``).
      stream: where to draw; a terminal, or nothing is drawn.
    Yields:
      a :class:`Phases`: ``phase(description)`` blocks, ``bar(...)``, ``enabled``.
    """
    yield Phases(enabled, stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def bars_shown(progress: bool, stream: TextIO | None = None) -> bool:
    """Whether a loader or tool asked for ``progress`` draws its tqdm bars: only on a
    terminal. A bar written to a file or a pipe is noise (``reading tensors: 0tensor``):
    the API's ``progress=True`` says what it does in plain lines there
    (:func:`reported`).

    Args:
      progress: what the caller asked for.
      stream: where the bars go (default: stderr).
    """
    return bool(progress) and _isatty(sys.stderr if stream is None else stream)


def terminal_bar(iterable: Iterable[Any] | None = None, *, progress: bool = True,
                 **settings) -> tqdm:
    """A tqdm bar on stderr, drawn only when ``progress`` and stderr is a terminal
    (:func:`bars_shown`); elsewhere a disabled bar that prints nothing.

    Args:
      iterable: items to wrap, or ``None`` (call ``update``).
      progress: what the caller asked for.
      **settings: tqdm's keywords (``desc``, ``unit``, ``total``, ``leave``...).
    """
    return tqdm(iterable, file=sys.stderr, disable=not bars_shown(progress), **settings)


@contextlib.contextmanager
def reported(description: str, stream: TextIO | None = None) -> Iterator[None]:
    """The Python API's ``progress=True``: ``description ... <seconds> s`` on ``stream``
    (default: stderr), drawn live on a terminal; elsewhere (a notebook, a log file) one
    line when the block starts and one when it ends.

    Args:
      description: what the block does, e.g. ``"loading smollm2-135m"``.
      stream: where to write.
    """
    stream = sys.stderr if stream is None else stream
    if _isatty(stream):
        with Phases(True, stream).phase(description):
            yield
        return
    started = time.perf_counter()
    print(f"{description} ...", file=stream, flush=True)
    outcome = ""
    try:
        yield
    except BaseException:
        outcome = ", stopped"
        raise
    finally:
        print(f"{description} ... {time.perf_counter() - started:.1f} s{outcome}", file=stream,
              flush=True)
