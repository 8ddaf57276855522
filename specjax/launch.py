"""The ``specjax`` command's entry point: Ctrl-C is one line from the first instant.

Importing the CLI imports jax, jaxlib and the model code, which takes seconds. A Ctrl-C
then would raise ``KeyboardInterrupt`` inside the initialisation of a C extension: a
traceback, an ``ImportError``, or a crash. This module imports nothing heavy (``specjax``
itself loads its names lazily): it first makes Ctrl-C print ``specjax: interrupted`` and
end the process with status 130 (nothing has been written yet, so nothing needs cleaning
up), then imports the CLI, whose commands set their own policy (:mod:`specjax.interrupts`).
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = "specjax: interrupted\n"


def _exit_interrupted(signum, frame) -> None:
    del signum, frame
    try:
        sys.stderr.write(INTERRUPTED)
        sys.stderr.flush()
    finally:
        os._exit(130)  # no clean-up to run, and no half-imported module to unwind


def main() -> int:
    """Runs ``specjax`` with the command line's arguments."""
    # A process started with SIGINT ignored (in the background of a script, under nohup)
    # keeps ignoring it, as the commands do.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if not ignored:
        previous = signal.signal(signal.SIGINT, _exit_interrupted)
    from specjax import cli  # the slow imports

    try:
        if not ignored:
            signal.signal(signal.SIGINT, previous)
        return cli.main()
    except KeyboardInterrupt:  # between the line above and the CLI's own handling of it
        sys.stderr.write(INTERRUPTED)
        return 130


if __name__ == "__main__":
    sys.exit(main())
