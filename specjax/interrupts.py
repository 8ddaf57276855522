"""Ctrl-C (SIGINT) in the command line: complete output or none, and one line.

Python turns Ctrl-C into a ``KeyboardInterrupt`` raised wherever the main thread happens
to be. Around a checkpoint export that goes wrong in three ways:

* inside orbax's save, it unwinds the main thread while orbax's own threads are still
  writing: they then fail on the closed thread pool (``RuntimeError: cannot schedule new
  futures after shutdown``, a 100-line traceback) and keep writing into a directory that
  was just removed, so a partial directory is left;
* inside a garbage-collector callback (jax installs one, ``_xla_gc_callback``), the
  interpreter reports the exception ("Exception ignored in ...") and drops it: the work
  goes on as if Ctrl-C had not been pressed;
* inside the initialisation of a C extension that is being imported, it can turn into an
  ``ImportError`` or worse.

:func:`guard` fixes this for one block of work::

    with interrupts.guard() as interrupt:
        data = read_inputs()              # Ctrl-C acts at once, as usual ...
        interrupt.check()                 # ... and one that something swallowed acts here
        with interrupt.deferred():        # Ctrl-C is only recorded: writes run to the end
            staging = make_staging_dir()
            try:
                write(staging)
                interrupt.check()         # act on it between steps, never inside one
                os.replace(staging, destination)
            except BaseException:
                remove(staging)           # a second Ctrl-C cannot cut the clean-up short
                raise

A command line sets its own policy with :func:`command`: while it has nothing to clean
up yet (still reading), Ctrl-C prints one line and ends the process at once, raising
nothing; once its output is in place, Ctrl-C is ignored, so that the status it reports
(0, or 130 after a clean-up) is always true to what is on disk.

Work that writes nothing that must be completed or removed (``specjax generate``) uses
:func:`exit_on_interrupt` instead: Ctrl-C ends the process at once from a thread woken by
the signal itself, even while the main thread is inside XLA (compiling, running).

Signal handlers exist only in the main thread: elsewhere these helpers change nothing
(Python delivers no ``KeyboardInterrupt`` to other threads anyway).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_as_program = False  # see run_as_program; signal handlers are process-wide state anyway


def run_as_program() -> None:
    """Declares this process a command-line program (``specjax`` itself, not a caller of
    :func:`specjax.cli.main` in Python): from the moment a :func:`command`'s outcome is
    decided, Ctrl-C stays ignored until the process exits, instead of Python's handler
    coming back and letting a late Ctrl-C print a traceback at exit or change the status.
    """
    global _as_program
    _as_program = True


class Interrupt:
    """What :func:`guard` yields: records Ctrl-C and raises it where the work allows."""

    def __init__(self, previous):
        self._previous = previous  # the SIGINT handler the guard replaced
        self._received = 0  # Ctrl-C presses seen
        self._raised = 0  # presses raised (or being raised) as KeyboardInterrupt
        self._deferring = False
        self._completed = False

    @property
    def requested(self) -> bool:
        """Whether a Ctrl-C arrived that has not been raised (held back, or swallowed)."""
        return self._received > self._raised and not self._completed

    def check(self) -> None:
        """Raises ``KeyboardInterrupt`` if a Ctrl-C is pending (see :attr:`requested`).

        Raises:
          KeyboardInterrupt: a Ctrl-C was held back by :meth:`deferred`, or raised and then
            swallowed (by a garbage-collector callback).
        """
        if self.requested:
            self._raised = self._received
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within the block Ctrl-C is only recorded; :meth:`check` raises it.

        Leaving the block normally with a press pending raises it then. Use it around
        writes that must not stop half-way and around their clean-up.

        Raises:
          KeyboardInterrupt: when the block ends normally with a Ctrl-C pending.
        """
        outer = self._deferring
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = outer
        self.check()

    def completed(self) -> None:
        """Marks the work as done (its output is in place): a Ctrl-C pending or arriving
        from now on is dropped, since there is nothing left to stop. What follows, e.g.
        removing the copy an output replaced, then runs to its end. A :func:`command`
        around the guard learns it at the same moment."""
        self._completed = True
        owner = getattr(self._previous, "__self__", None)
        if isinstance(owner, Command):
            owner._completed()

    def _handle(self, signum, frame) -> None:
        self._received += 1
        if self._deferring or self._completed:
            return
        # Hand the press to the handler that was there before: by default it raises
        # KeyboardInterrupt right here; a command line's command() may end the process.
        self._raised += 1
        if callable(self._previous):
            self._previous(signum, frame)
        else:  # SIG_DFL: the default action, ending the process
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _swallowed(self) -> None:
        # The interpreter dropped a KeyboardInterrupt (raised in a gc callback): pending again.
        self._raised = max(self._raised - 1, 0)


@contextlib.contextmanager
def guard() -> Iterator[Interrupt]:
    """Watches Ctrl-C for the duration of the block (see the module docstring).

    A press outside :meth:`Interrupt.deferred` acts at once, as without the guard. If its
    ``KeyboardInterrupt`` is then swallowed (raised inside a garbage-collector callback,
    which the interpreter reports and drops), the next :meth:`Interrupt.check`, or the
    end of the block, raises it after all, and the "Exception ignored" report is not
    printed. If the block fails with another error after a press (an import that the
    press broke), ``KeyboardInterrupt`` is raised from that error. Where SIGINT is
    ignored (``SIG_IGN``) or outside the main thread, nothing changes.

    Yields:
      the :class:`Interrupt` to check and defer with.
    Raises:
      KeyboardInterrupt: Ctrl-C was pressed and the block ended without raising it.
    """
    previous = signal.getsignal(signal.SIGINT) if _in_main_thread() else signal.SIG_IGN
    interrupt = Interrupt(previous)
    if previous in (signal.SIG_IGN, None):  # ignored, or set outside Python: leave it
        yield interrupt
        return
    previous_unraisable = sys.unraisablehook

    def unraisable_hook(report):
        if isinstance(report.exc_value, KeyboardInterrupt):
            interrupt._swallowed()  # check() raises it again: the report is noise
        else:
            previous_unraisable(report)

    signal.signal(signal.SIGINT, interrupt._handle)
    sys.unraisablehook = unraisable_hook
    try:
        yield interrupt
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        if interrupt._received and not interrupt._completed:
            raise KeyboardInterrupt from error
        raise
    else:
        interrupt.check()
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_unraisable


class Command:
    """What :func:`command` yields: a command line's own handling of Ctrl-C.

    Attributes:
      exit_at_once: while true, Ctrl-C prints the message and ends the process at once;
        set it to false before work that must unwind (e.g. while orbax's threads may be
        writing), and Ctrl-C then raises ``KeyboardInterrupt``.
    """

    def __init__(self, message: str, status: int, exit_at_once: bool,
                 finish_on_completed: bool):
        self.exit_at_once = exit_at_once
        self._line = (message + "\n").encode()
        self._status = status
        self._finish_on_completed = finish_on_completed
        self._finished = False

    def finished(self) -> None:
        """The command's outcome is decided (its output is in place): a later Ctrl-C is
        ignored, so it can change neither the exit status nor what was printed."""
        self._finished = True

    def _completed(self) -> None:
        # A guard inside reports its output in place (Interrupt.completed): when that is the
        # command's output, this is the moment it is decided, with no gap in between.
        if self._finish_on_completed:
            self._finished = True

    def _handle(self, signum, frame) -> None:
        if self._finished:
            return
        if not self.exit_at_once:
            raise KeyboardInterrupt
        # os.write and os._exit: nothing of Python's (buffers, finally blocks, threads)
        # runs any more, so nothing else can be printed.
        prefix = b"\n" if _isatty(2) else b""  # end a progress line left on the terminal
        os.write(2, prefix + self._line)
        os._exit(self._status)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


@contextlib.contextmanager
def command(message: str, *, exit_at_once: bool = True, finish_on_completed: bool = True,
            status: int = 130) -> Iterator[Command]:
    """A command line's handling of Ctrl-C, for the duration of the block.

    While nothing needs cleaning up (imports, reading inputs), Ctrl-C writes ``message``
    and ends the process at once, without unwinding: nothing can swallow or garble it.
    A :func:`guard` inside still holds Ctrl-C back around its writes and raises
    ``KeyboardInterrupt`` afterwards, which the command line reports with the same line.
    Once the command's outcome is decided (:meth:`Command.finished`, or the output of a
    guard inside is in place), Ctrl-C is ignored until the block ends.

    Args:
      message: the one line to print, e.g. ``"specjax: interrupted"``.
      exit_at_once: the initial :attr:`Command.exit_at_once`.
      finish_on_completed: whether a guard's :meth:`Interrupt.completed` inside decides
        the outcome (false when more output follows).
      status: the exit status (130 = 128 + SIGINT, what shells report for Ctrl-C).
    Yields:
      the :class:`Command`.
    """
    handler = Command(message, status, exit_at_once, finish_on_completed)
    if not _in_main_thread() or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield handler
        return
    previous = signal.signal(signal.SIGINT, handler._handle)
    try:
        yield handler
    finally:
        # A program whose outcome is decided ignores Ctrl-C up to its exit: restoring
        # Python's handler here would leave an instant in which Ctrl-C changes it.
        done = handler._finished and _as_program
        signal.signal(signal.SIGINT, signal.SIG_IGN if done else previous)


class Watch:
    """What :func:`exit_on_interrupt` yields: marks what the exit must finish or ignore."""

    def __init__(self, message: str, status: int):
        self._line = (message + "\n").encode()
        self._status = status
        self._lock = threading.Lock()
        self._finished = False
        self.line_open = False  # stdout holds a line not yet ended (streamed text)
        # Held around each write of streamed text and its flush: the exit's newline then
        # follows what a write in progress puts on stdout, never lands inside it (the exit
        # may run on the watching thread while the main thread flushes).
        self.output = threading.RLock()

    def finished(self) -> None:
        """The command's outcome is decided (everything is printed): Ctrl-C from now on
        is ignored, so it changes neither the exit status nor the output."""
        self._finished = True

    def _exit(self) -> None:
        if self._finished:
            return
        if not self._lock.acquire(blocking=False):
            return  # the other path (thread or handler) is ending the process already
        # A write of streamed text in progress ends first (at most a second: a stdout
        # nobody reads must not keep the process alive; re-entrant for the handler, which
        # runs on the main thread).
        self.output.acquire(timeout=1.0)
        # Bytes straight to the file descriptors, then os._exit: no Python clean-up, no
        # interpreter shutdown racing XLA's own threads (what crashed or aborted).
        if self.line_open:
            _write(1, b"\n")
        _write(2, (b"\n" if _isatty(2) else b"") + self._line)
        os._exit(self._status)

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self._exit()

    def _watch(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # the write end closed: the block ended
                return
            if signal.SIGINT in data:
                self._exit()


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:  # a closed pipe: the line cannot be shown, the status still can
        pass


@contextlib.contextmanager
def exit_on_interrupt(message: str, *, status: int = 130) -> Iterator[Watch]:
    """Ctrl-C prints ``message`` and ends the process with ``status`` at once, at any
    moment of the block, even while the main thread is inside a long C++ call (XLA
    compiling, a device computation) that would hold Python's own handler back.

    For work that writes nothing that must be completed or removed (generating to the
    terminal). Python runs a signal handler only between bytecodes of the main thread, so
    a press during a compile used to wait for it, then unwind through jax while its
    threads ran and crash in the interpreter's shutdown (segfaults, ``pure virtual method
    called``), or be swallowed by a garbage-collector callback. Here the signal's C-level
    handler writes to a pipe (:func:`signal.set_wakeup_fd`) that a thread waits on; that
    thread writes the line and calls ``os._exit``. Once :meth:`Watch.finished`, Ctrl-C is
    ignored up to the end of the block (and, in a program, see :func:`run_as_program`,
    up to its exit). Outside the main thread, or where SIGINT is ignored, nothing changes.

    Yields:
      the :class:`Watch` (set ``line_open`` while streamed text has no newline yet).
    """
    watch = Watch(message, status)
    if not _in_main_thread() or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield watch
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGINT, watch._handle)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    thread = threading.Thread(target=watch._watch, args=(read_fd,), name="specjax-interrupt",
                              daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        done = watch._finished and _as_program
        signal.signal(signal.SIGINT, signal.SIG_IGN if done else previous_handler)
        signal.set_wakeup_fd(previous_fd)
        # A thread that is ending the process holds the lock: wait for the end there.
        with watch._lock:
            watch._finished = True
        os.close(write_fd)
        thread.join()
        os.close(read_fd)
