"""Fallbacks recorded while a program is traced (installed as ``specjax.kernels.fallbacks``).

A kernel that does not take a call (its ``check_supported`` refuses the shapes or dtypes)
either raises or runs something else; the second is a *fallback*, and it is never silent:
the site calls :func:`record` with a one-line reason. Which path runs is decided from
static shapes while a program is traced, so a reason is recorded once per traced program,
not per run, and recording changes nothing in the program.

:func:`collecting` gathers the reasons recorded inside it. :func:`specjax.decode.compiled`
collects while it lowers a program and keeps the reasons beside the cached executable, so
a cached program reports them again; the API puts them in ``stats["fallbacks"]`` (a sorted
list; empty when none). Outside a collector :func:`record` does nothing.

Recording happens in Python while tracing, so a function JAX does not trace again (a
``jax.jit`` of the same function object at the same shapes reuses its cached trace)
records nothing the second time: keep the reasons with what was traced, as
:func:`specjax.decode.compiled` does (it traces a new function for every program).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterable, Iterator

__all__ = ["collecting", "record", "record_all"]

_COLLECTOR: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "specjax_fallbacks", default=None)


def record(site: str, reason: str) -> None:
    """Adds ``"{site}: {reason}"`` to the innermost active collector, if any.

    Args:
      site: the function that fell back, e.g. ``"fused_linear"``.
      reason: one line: what was refused and why, and what ran instead.
    """
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.add(f"{site}: {reason}")


def record_all(reasons: Iterable[str]) -> None:
    """Adds already formatted reasons (a cached program's) to the active collector."""
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.update(reasons)


@contextlib.contextmanager
def collecting(reasons: set | None = None) -> Iterator[set]:
    """Within the block, :func:`record` adds to ``reasons`` (a new set when ``None``),
    which the block gets; an enclosing collector gets nothing from inside (pass its
    reasons on with :func:`record_all`)."""
    reasons = set() if reasons is None else reasons
    token = _COLLECTOR.set(reasons)
    try:
        yield reasons
    finally:
        _COLLECTOR.reset(token)
