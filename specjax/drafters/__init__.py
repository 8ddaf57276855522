"""Drafters: cheap proposers of tokens for the draft and target models to check.

Stage 2 of staged speculative decoding (Spector & Ré 2023; docs/guide.md):

* :mod:`specjax.drafters.ngram`: Katz-backoff trigram tables as static-size arrays,
  :func:`ngram_topk` and the proposal tree :func:`propose`;
* :mod:`specjax.drafters.lookup`: context (prompt) lookup, :func:`lookup_continuation`;
* :mod:`specjax.drafters.model`: a draft model's state and passes (stage 1: the draft that
  ``spec``, ``tree`` and ``staged`` run), :class:`DraftState`.

Tables are built by ``specjax build-ngram`` (:mod:`specjax.training.ngram_build`).
"""

from specjax.drafters.lookup import Continuation, lookup_continuation
from specjax.drafters.ngram import (ORIGIN_LOOKUP, ORIGIN_NGRAM, NgramTables, Proposal,
                                    bundled_ngram_path, load_ngram, ngram_topk, propose,
                                    read_ngram_metadata, save_ngram)

__all__ = [
    "Continuation", "NgramTables", "ORIGIN_LOOKUP", "ORIGIN_NGRAM", "Proposal",
    "bundled_ngram_path", "load_ngram", "lookup_continuation", "ngram_topk", "propose",
    "read_ngram_metadata", "save_ngram",
]
