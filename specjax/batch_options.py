"""Batch options: how a list of prompts is cut into compiled batches (``batch=``).

No row's tokens depend on them: each row of a batch decodes exactly as it would alone.
"""

from __future__ import annotations

import dataclasses

from specjax.errors import InvalidArgumentError

# The most rows one compiled batch program takes (callers split longer lists).
MAX_BATCH_SIZE = 64


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """How a list of prompts runs (``generate(prompts, batch=...)``); no row's tokens
    depend on it.

    Attributes:
      size: rows per compiled program, in [1, 64]; a longer list runs as consecutive
        batches of this size. ``None``: the whole list in one batch. The program's row
        count is rounded up to a power of two (padding rows are discarded).
      compact_rows: once at most half of a program's rows are still generating, move
        them to a program of the next smaller power of two, so that finished rows stop
        costing work (compiles up to log2(B) more programs, once per process each; no
        effect over a device mesh).
    """

    size: int | None = None
    compact_rows: bool = True

    def __post_init__(self):
        size = self.size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or not 1 <= size <= MAX_BATCH_SIZE):
            raise InvalidArgumentError(f"BatchOptions.size must be an integer in "
                                       f"[1, {MAX_BATCH_SIZE}], got {size!r}")
        if not isinstance(self.compact_rows, bool):
            raise InvalidArgumentError(f"BatchOptions.compact_rows must be True or False, "
                                       f"got {self.compact_rows!r}")
