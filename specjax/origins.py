"""Who proposed an emitted token: the origin codes shared by drafters, methods and stats.

Every token a speculative step emits was proposed by one stage: the n-gram tables or
context lookup (stage 2), the draft model, or the target itself (the token the target adds
after the accepted path, and every token of ``ar``). Codes are int8 on device; names are
what :attr:`specjax.GenerationResult.origins` and the statistics print.
"""

from __future__ import annotations

ORIGIN_NGRAM = 0
ORIGIN_LOOKUP = 1
ORIGIN_DRAFT = 2
ORIGIN_TARGET = 3
NUM_ORIGINS = 4

ORIGIN_NAMES = {ORIGIN_NGRAM: "ngram", ORIGIN_LOOKUP: "lookup", ORIGIN_DRAFT: "draft",
                ORIGIN_TARGET: "target"}


def origin_name(code: int) -> str:
    """The name of an origin code (unknown or padding codes count as the target's)."""
    return ORIGIN_NAMES.get(int(code), "target")
