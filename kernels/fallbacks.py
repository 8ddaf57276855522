"""Fallbacks recorded while a program is traced (installed as ``specjax.kernels.fallbacks``).

A kernel that does not take a call (its ``check_supported`` refuses the shapes or dtypes)
either raises or runs something else; the second is a *fallback*, and it is never silent:
the site calls :func:`record` with a one-line reason. Which path runs is decided from
static shapes while a program is traced, so a reason is recorded once per traced program,
not per run, and recording changes nothing in the program.

:func:`collecting` gathers the reasons recorded inside it. :func:`specjax.decode.compiled`
collects while it lowers a program and keeps the reasons beside the cached executable, so
a cached program reports them again; the API puts them in ``stats["fallbacks"]`` (a sorted
list of ``"site: reason"`` strings; empty when none). Outside a collector :func:`record`
does nothing.

Each reason is a :class:`Fallback`, which also says whether what ran instead keeps the
row independence of attention ``"fused"`` (``row_independent``): the site knows what it
ran, so it says so, and :func:`specjax.methods.exactness.run_exactness` reads the flag
rather than the words.

Recording happens in Python while tracing, so a function JAX does not trace again (a
``jax.jit`` of the same function object at the same shapes reuses its cached trace)
records nothing the second time: keep the reasons with what was traced, as
:func:`specjax.decode.compiled` does (it traces a new function for every program).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterable, Iterator

__all__ = ["Fallback", "collecting", "record", "record_all"]

_COLLECTOR: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "specjax_fallbacks", default=None)


@dataclasses.dataclass(frozen=True, order=True)
class Fallback:
    """One recorded fallback; ``str()`` gives the ``"site: reason"`` line users read.

    Attributes:
      site: the function that fell back, e.g. ``"fused_linear"``.
      reason: one line: what was refused and why, and what ran instead.
      row_independent: whether what ran instead still computes each row of a verify pass
        as the one-token step computes it (another row-tiled or position-ordered kernel),
        or computes no verify pass whose numbers decide a token (a long prefill, which
        ``ar`` shares; a draft's layers). ``False``: a jnp reference, attention that is not
        position-ordered, a kernel interpreted as XLA ops: the sums may then be ordered by
        the row count, and a fused run is no longer bitwise.
    """

    site: str
    reason: str
    row_independent: bool

    def __str__(self) -> str:
        return f"{self.site}: {self.reason}"


def record(site: str, reason: str, *, row_independent: bool) -> None:
    """Adds a :class:`Fallback` to the innermost active collector, if any.

    Args:
      site: the function that fell back, e.g. ``"fused_linear"``.
      reason: one line: what was refused and why, and what ran instead.
      row_independent: see :class:`Fallback` (no default: each site says what it ran).
    """
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.add(Fallback(site, reason, row_independent))


def record_all(reasons: Iterable[Fallback]) -> None:
    """Adds already recorded fallbacks (a cached program's) to the active collector."""
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.update(reasons)


@contextlib.contextmanager
def collecting(reasons: set | None = None) -> Iterator[set]:
    """Within the block, :func:`record` adds :class:`Fallback` records to ``reasons`` (a
    new set when ``None``), which the block gets; an enclosing collector gets nothing from
    inside (pass its reasons on with :func:`record_all`)."""
    reasons = set() if reasons is None else reasons
    token = _COLLECTOR.set(reasons)
    try:
        yield reasons
    finally:
        _COLLECTOR.reset(token)
