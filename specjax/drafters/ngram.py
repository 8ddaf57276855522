"""Stage-2 n-gram drafter: Katz-backoff trigram tables as static-size arrays.

The staged-speculation paper's lowest stage is a Katz-backoff trigram model that proposes a
small fixed-shape token tree for the draft model to score. Here
the model is reduced to what drafting needs, ranked next-token lists, stored as arrays of
static size so that lookups run inside ``jit`` and ``vmap`` with no host round trip.

Tables (:class:`NgramTables`; ``V`` vocabulary, ``K`` = ``top_k``, ``K3`` =
``trigram_top_k``, ``R`` bigram rows, ``B`` trigram buckets):

* ``unigram_tokens int32[K]``, ``unigram_scores float32[K]``: the ``K`` most frequent
  tokens with their log-probabilities ``log c(w) / N``.
* ``bigram_index int32[V]``: row of ``bigram_*`` for a previous token, ``-1`` for a token
  never seen before another one. Only tokens seen as a context get a row, so ``R <= V``.
* ``bigram_tokens int32[R, K]``, ``bigram_scores float32[R, K]``: for previous token ``v``,
  the ``K`` best next tokens under the Katz distribution ``P(w | v)``, which already
  interleaves seen bigrams (discounted) with the unigram backoff ``alpha(v) P(w)``.
  ``bigram_log_alpha float32[R]`` is ``log alpha(v)``.
* ``trigram_keys int32[B, 2]``: the context ``(prev2, prev1)`` a bucket holds, ``-1`` for
  an empty bucket. ``trigram_tokens int32[B, K3]``, ``trigram_scores float32[B, K3]``,
  ``trigram_log_alpha float32[B]``: the ``K3`` best tokens under ``P(w | prev2, prev1)``
  (seen trigrams discounted, interleaved with ``alpha(prev2, prev1) P(w | prev1)``).

Invalid list entries hold token ``-1`` and score ``-inf``. Scores are natural-log
probabilities.

Katz discounting. Seen n-grams get ``d_r * r / c(context)`` where ``r`` is the n-gram count
and ``d_r`` the Good-Turing/Katz discount (``d_r = 1`` for ``r > 5``); the freed mass
goes to unseen tokens in proportion to the lower order. This changes the ranking where it
matters: a continuation seen once in a rare context ranks below a strong bigram
continuation that the context has never been followed by.

Hashing. A context ``(prev2, prev1)`` may live in one of :data:`NUM_PROBES` buckets given by
:func:`trigram_slots` (a murmur3-style mix of the pair, ``B`` a power of two). A lookup reads
those buckets and accepts one only if its stored key equals the context, so hash
collisions never return another context's list. Contexts that find no free bucket at
build time are dropped and back off to the bigram. The builder stores only contexts whose
list differs from their bigram list (the others would rank the same), most frequent first.

Backoff at lookup (:func:`ngram_topk`): the trigram list (when the context is stored), then
the bigram list, then the unigram list, deduplicated, first ``K`` entries. Ranking is the
list order. Scores are Katz log-probabilities (lower orders shifted by the log backoff
weights), capped by the previous entry's so that they never increase down the list: a
token seen after the context but beyond its stored list is scored by the lower order,
which can overestimate it. They are exact for the stored part of each list.

Memory. Tokens and keys take 4 bytes per entry on device, scores 4; on disk (``.npz``,
compressed) tokens and keys are ``uint16`` when ``V < 65535`` and scores ``float16``. For
SmolLM2 (``V = 49152``, ``K = 12``, ``K3 = 8``, ``B = 2**18``) the device tables take
about 22 MB (the trigram buckets 20 MB) and the compressed file 6.3 MB (see
``specjax/assets/smollm2-135m/README.md``).

File format (:func:`save_ngram`, :func:`load_ngram`): one ``.npz`` (never pickled) with the
arrays above and ``metadata``, a JSON object (format name and version, vocabulary size,
``top_k``, ``trigram_top_k``, buckets, hash, and how the tables were built) stored as
``uint8`` bytes. Files are written to a temporary name and renamed into place.

The stage-2 proposal tree (:func:`propose`) merges these lists with context lookup
(:mod:`specjax.drafters.lookup`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels
from specjax.constraints import DEAD_STATE, advance, forced_token
from specjax.drafters.lookup import lookup_continuation
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.origins import ORIGIN_LOOKUP, ORIGIN_NGRAM

FORMAT_NAME = "specjax-ngram"
FORMAT_VERSION = 1
NUM_PROBES = 2
HASH_NAME = "murmur3-fmix32-pair-2probe"

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


class NgramTables(NamedTuple):
    """Katz-backoff trigram tables, a pytree of arrays (see the module docstring)."""

    unigram_tokens: jax.Array  # int32 [K]
    unigram_scores: jax.Array  # float32 [K]
    bigram_index: jax.Array  # int32 [V], -1: no row
    bigram_tokens: jax.Array  # int32 [R, K]
    bigram_scores: jax.Array  # float32 [R, K]
    bigram_log_alpha: jax.Array  # float32 [R]
    trigram_keys: jax.Array  # int32 [B, 2], -1: empty bucket
    trigram_tokens: jax.Array  # int32 [B, K3]
    trigram_scores: jax.Array  # float32 [B, K3]
    trigram_log_alpha: jax.Array  # float32 [B]

    @property
    def vocab_size(self) -> int:
        return self.bigram_index.shape[-1]

    @property
    def top_k(self) -> int:
        """K, the length of the lists :func:`ngram_topk` returns."""
        return self.unigram_tokens.shape[-1]

    @property
    def num_buckets(self) -> int:
        return self.trigram_keys.shape[-2]


class Proposal(NamedTuple):
    """A stage-2 proposal tree of ``P = sum(shape)`` nodes (see :func:`propose`)."""

    tokens: jax.Array  # int32 [P], 0 where invalid
    parents: jax.Array  # int32 [P], -1: child of the sequence end; else parents[i] < i
    valid: jax.Array  # bool [P], prefix-closed
    origin: jax.Array  # int8 [P], ORIGIN_NGRAM or ORIGIN_LOOKUP


# --------------------------------------------------------------------------------------
# Hashing (shared by the numpy builder and the jnp lookup).
# --------------------------------------------------------------------------------------


def _fmix32(h, xp):
    """murmur3's 32-bit finaliser; ``h`` is uint32 (wrapping arithmetic)."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def trigram_slots(prev2, prev1, num_buckets: int, xp=jnp):
    """The :data:`NUM_PROBES` candidate buckets of the contexts ``(prev2, prev1)``.

    Args:
      prev2, prev1: int arrays of one shape ``[...]`` (numpy or jnp), token ids ``>= 0``.
      num_buckets: ``B``, a power of two.
      xp: ``numpy`` (builder) or ``jax.numpy`` (lookup); both give the same slots.
    Returns:
      int32 ``[..., NUM_PROBES]`` bucket indices in ``[0, B)``.
    """
    return xp.stack(_probe_slots(prev2, prev1, num_buckets, xp), axis=-1)


def _probe_slots(prev2, prev1, num_buckets: int, xp=jnp) -> list:
    """:func:`trigram_slots` as a list of ``NUM_PROBES`` int32 arrays of the inputs' shape
    (no stacking: a lookup of one context stays scalar arithmetic)."""
    a = xp.asarray(prev2).astype(xp.uint32)
    b = xp.asarray(prev1).astype(xp.uint32)
    h = _fmix32(a * xp.uint32(0x9E3779B1) ^ _fmix32(b + xp.uint32(0x7F4A7C15), xp), xp)
    mask = xp.uint32(num_buckets - 1)
    return [(_fmix32(h + xp.uint32((0x9E3779B9 * p) & 0xFFFFFFFF), xp) & mask).astype(xp.int32)
            for p in range(NUM_PROBES)]


# --------------------------------------------------------------------------------------
# Lookups (jittable).
# --------------------------------------------------------------------------------------


def _first_unique(tokens, scores, valid, width: int):
    """The first ``width`` valid, not-yet-seen entries, in order; the rest padding.

    Args:
      tokens, scores, valid: ``[M]`` candidate lists in rank order.
    Returns:
      (tokens, scores, valid, order), each ``[width]``; ``order`` indexes the input.
    """
    size = tokens.shape[0]
    earlier = jnp.tril(jnp.ones((size, size), bool), k=-1)  # [M, M]: j < i
    repeated = jnp.any((tokens[:, None] == tokens[None, :]) & valid[None, :] & earlier, axis=1)
    keep = valid & ~repeated
    if width > size:  # pad so that a level may ask for more than there are candidates
        pad = width - size
        tokens = jnp.concatenate([tokens, jnp.zeros(pad, tokens.dtype)])
        scores = jnp.concatenate([scores, jnp.full(pad, -jnp.inf, scores.dtype)])
        keep = jnp.concatenate([keep, jnp.zeros(pad, bool)])
    order = jnp.argsort(~keep, stable=True)[:width]  # kept entries first, rank order kept
    keep = keep[order]
    return (jnp.where(keep, tokens[order], 0), jnp.where(keep, scores[order], -jnp.inf),
            keep, order)


def _context_rows(tables: NgramTables, prev2, prev1):
    """Where the lists of the context ``(prev2, prev1)`` are: (trigram bucket, whether it
    holds the context, bigram row, whether ``prev1`` has one). Scalar selects and gathers,
    no reduction: the probe that holds the context is picked by selects."""
    prev2 = jnp.asarray(prev2, jnp.int32)
    prev1 = jnp.asarray(prev1, jnp.int32)
    vocab = tables.vocab_size
    known1 = (prev1 >= 0) & (prev1 < vocab)
    known = known1 & (prev2 >= 0) & (prev2 < vocab)
    slots = _probe_slots(prev2, prev1, tables.num_buckets)
    slot, trigram_hit = slots[0], jnp.asarray(False)
    for probe in reversed(range(NUM_PROBES)):  # the first probe holding the context wins
        hit = ((tables.trigram_keys[slots[probe], 0] == prev2)
               & (tables.trigram_keys[slots[probe], 1] == prev1) & known)
        slot = jnp.where(hit, slots[probe], slot)
        trigram_hit = trigram_hit | hit
    row = jnp.where(known1, tables.bigram_index[jnp.clip(prev1, 0, vocab - 1)], -1)
    return slot, trigram_hit, jnp.maximum(row, 0), row >= 0


def _candidates(tables: NgramTables, prev2, prev1):
    """The backoff lists after ``(prev2, prev1)``, concatenated and not deduplicated.

    Returns:
      (tokens int32[K3 + 2K], scores float32[K3 + 2K], valid bool[K3 + 2K]): the trigram
      list of the context (valid only when it is stored), then the bigram list of
      ``prev1`` (shifted by the trigram's log backoff weight), then the unigram list
      (shifted by both).
    """
    slot, trigram_hit, row, bigram_hit = _context_rows(tables, prev2, prev1)
    tri_tokens = tables.trigram_tokens[slot]
    tri_valid = trigram_hit & (tri_tokens >= 0)
    tri_alpha = jnp.where(trigram_hit, tables.trigram_log_alpha[slot], 0.0)
    bi_tokens = tables.bigram_tokens[row]
    bi_valid = bigram_hit & (bi_tokens >= 0)
    bi_scores = tables.bigram_scores[row] + tri_alpha
    bi_alpha = jnp.where(bigram_hit, tables.bigram_log_alpha[row], 0.0)

    uni_tokens = tables.unigram_tokens
    tokens = jnp.concatenate([tri_tokens, bi_tokens, uni_tokens])
    scores = jnp.concatenate([tables.trigram_scores[slot], bi_scores,
                              tables.unigram_scores + tri_alpha + bi_alpha])
    valid = jnp.concatenate([tri_valid, bi_valid, uni_tokens >= 0])
    return tokens, scores.astype(jnp.float32), valid


def ngram_topk(tables: NgramTables, prev2, prev1, top_k: int | None = None):
    """Ranked next tokens after ``(prev2, prev1)`` with trigram → bigram → unigram backoff.

    Jittable and vmappable (``prev2``, ``prev1`` are traced scalars; vmap over them for
    many contexts).

    Args:
      tables: the n-gram tables (a traced pytree).
      prev2: int32 scalar, the token before ``prev1``; ``-1`` when there is none (the
        trigram is skipped).
      prev1: int32 scalar, the last token; ``-1`` when there is none (unigram list only).
      top_k: static list length; default ``tables.top_k``.
    Returns:
      (tokens int32[k], scores float32[k], valid bool[k]): the trigram list of the
      context if it is stored, then the bigram list of ``prev1``, then the unigram list,
      deduplicated and cut at ``k``. Scores are non-increasing Katz log-probabilities
      (see the module docstring). Invalid entries have token 0 and score ``-inf``.
    """
    k = tables.top_k if top_k is None else int(top_k)
    tokens, scores, valid = _candidates(tables, prev2, prev1)
    tokens, scores, valid, _ = _first_unique(tokens, scores, valid, k)
    # Each order's list is sorted; where a lower order fills in, its backoff score can
    # exceed the last higher-order one (a token seen in the context but beyond its list
    # is scored by the lower order): cap it there so that scores follow the ranking.
    return tokens, jax.lax.cummin(scores), valid


def _ngram_first(tables: NgramTables, prev2, prev1):
    """(token, found): :func:`ngram_topk`'s first entry after ``(prev2, prev1)`` (token 0
    when the lists are empty). One scalar select per list entry, last entry first, and no
    reduction, so that :func:`propose`'s chain of these can fuse on an accelerator."""
    slot, trigram_hit, row, bigram_hit = _context_rows(tables, prev2, prev1)
    lists = [(tables.trigram_tokens, slot, trigram_hit), (tables.bigram_tokens, row, bigram_hit),
             (tables.unigram_tokens[None], 0, jnp.asarray(True))]
    token, found = jnp.asarray(0, jnp.int32), jnp.asarray(False)
    for table, index, hit in reversed(lists):
        for i in reversed(range(table.shape[-1])):
            candidate = table[index, i]
            valid = hit & (candidate >= 0)
            token = jnp.where(valid, candidate, token)
            found = found | valid
    return token, found


def propose(tables: NgramTables, history, length, shape: Sequence[int], *,
            use_lookup: bool = True, min_n: int = 1, max_n: int = 3,
            automaton: tuple | None = None) -> Proposal:
    """The stage-2 proposal tree continuing ``history[:length]``.

    Level 1 holds the ranked top ``shape[0]`` next tokens; level ``l + 1`` holds
    ``shape[l]`` ranked children of the first (best) node of level ``l``: a ranked spine
    with alternatives (the paper's shape is ``(12, 7, 4, 1, 1, 1)``). Nodes are laid out
    level by level, so node ``sum(shape[:l])`` is the spine node of level ``l + 1``.

    Ranking at each level: when context lookup
    (:func:`~specjax.drafters.lookup.lookup_continuation`) found an earlier occurrence of
    the longest ``min_n..max_n``-token suffix, its continuation token for that level is
    rank 0 (so the spine follows the continuation while it lasts); the other ranks are the
    :func:`ngram_topk` list conditioned on the last two tokens of the path, without
    repeats.

    Under a constraint (``automaton``: its tables and the state after ``history[:length]``)
    every level keeps only the tokens the automaton allows after the spine above it, and a
    state that allows one token only (:func:`~specjax.constraints.forced_token`) ranks it
    first: a forced run of tokens becomes the spine (jump-forward; it is always accepted).

    Jittable with ``tables``, ``history``, ``length`` and the automaton's state traced;
    ``shape``, ``use_lookup``, ``min_n`` and ``max_n`` are static. Only the spine is
    computed level after level (scalar selects and gathers, which fuse into about two
    launches per level on a GPU); all levels' lists are then ranked and deduplicated in one batched computation.

    Args:
      tables: the n-gram tables.
      history: int32[S] token ids; only ``history[:length]`` is read.
      length: int32 scalar, ``0 <= length <= S``.
      shape: per-level candidate counts, each ``>= 1``.
      use_lookup: merge the context-lookup continuation (False: n-gram only).
      min_n, max_n: suffix lengths tried by context lookup (longest first).
    Returns:
      :class:`Proposal` with ``P = sum(shape)`` nodes: ``tokens``, ``parents`` (``-1`` for
      level-1 nodes, the children of the sequence end that the caller attaches; otherwise
      the index of the previous level's first node, so ``parents[i] < i``), ``valid``
      (prefix-closed: a node is valid only if its parent is; padding has token 0) and
      ``origin`` (:data:`ORIGIN_NGRAM` or :data:`ORIGIN_LOOKUP`).
    """
    shape = tuple(int(s) for s in shape)
    if not shape or min(shape) < 1:
        raise InvalidArgumentError(f"proposal shape must be a non-empty tuple of counts >= 1, "
                                   f"got {shape}")
    history = jnp.asarray(history, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    size = history.shape[0]
    depth = len(shape)

    def token_at(i):
        return jnp.where((i >= 0) & (i < length), history[jnp.clip(i, 0, size - 1)], -1)

    if use_lookup:
        continuation = lookup_continuation(history, length, depth, min_n=min_n, max_n=max_n)
        lookup_tokens, lookup_valid = continuation.tokens, continuation.valid
    else:
        lookup_tokens = jnp.zeros(depth, jnp.int32)
        lookup_valid = jnp.zeros(depth, bool)

    # 1. The spine, level by level (_spine); only this chain is sequential.
    context2, context1, allowed = _spine(tables, lookup_tokens, lookup_valid,
                                         token_at(length - 2), token_at(length - 1), depth,
                                         automaton)

    # 2. Every level's ranked candidates at once: the lookup token first, then the n-gram
    # list of the level's context, deduplicated; level l keeps its first shape[l]. A level
    # is there while every level above it has a candidate (its spine node is its parent).
    width = max(shape)
    if automaton is None:
        ngram_tokens, _, ngram_valid = jax.vmap(ngram_topk, in_axes=(None, 0, 0))(
            tables, context2, context1)  # [depth, K]
        cand_tokens = jnp.concatenate([lookup_tokens[:, None], ngram_tokens], axis=1)
        cand_valid = jnp.concatenate([lookup_valid[:, None], ngram_valid], axis=1)
    else:  # every level was ranked in step 1
        cand_tokens, cand_valid = allowed
    level_tokens, _, level_valid, order = jax.vmap(
        lambda t, v: _first_unique(t, jnp.zeros(t.shape, jnp.float32), v, width))(
        cand_tokens, cand_valid)  # [depth, width]
    found = level_valid[:, 0]
    alive = jnp.concatenate([jnp.ones(1, bool), jnp.cumprod(found[:-1]).astype(bool)])
    level_valid = level_valid & alive[:, None]
    first = 0 if automaton is None else 1  # under a constraint, candidate 0 is forced
    level_origin = jnp.where(level_valid & (order == first), ORIGIN_LOOKUP,
                             ORIGIN_NGRAM).astype(jnp.int8)  # the lookup's candidate
    level_tokens = jnp.where(level_valid, level_tokens, 0)

    return _pack_levels(shape, level_tokens, level_valid, level_origin)


def _spine(tables: NgramTables, lookup_tokens, lookup_valid, prev2, prev1, depth: int,
           automaton: tuple | None):
    """:func:`propose`'s spine: each level's context is the previous two spine tokens, and
    its spine token is the lookup continuation's while it lasts, else the n-gram lists'
    first entry (under a constraint: the first the automaton allows, a forced token first).

    Returns:
      (context2 int32 [depth], context1 int32 [depth]: each level's context; under a
      constraint, (tokens [depth, M], valid [depth, M]): each level's candidates, ranked,
      those the automaton forbids invalid; otherwise None).
    """
    state = jnp.int32(0) if automaton is None else jnp.asarray(automaton[1], jnp.int32)

    def ranked_at(level, prev2, prev1, state):
        ngram_tokens, _, ngram_valid = ngram_topk(tables, prev2, prev1)
        return _allowed_candidates(automaton[0], state, lookup_tokens[level][None],
                                   lookup_valid[level][None], ngram_tokens, ngram_valid)

    def spine_level(carry, level):
        """One level: ``carry`` is its context and automaton state; out: the context and,
        under a constraint, the level's ranked candidates."""
        prev2, prev1, state = carry
        if automaton is None:
            token, _ = _ngram_first(tables, prev2, prev1)  # 0 when the lists are empty
            token = jnp.where(lookup_valid[level], lookup_tokens[level], token)
            ranked = ()
        else:
            ranked = ranked_at(level, prev2, prev1, state)
            tokens, valid = ranked
            token = jnp.where(jnp.any(valid), tokens[jnp.argmax(valid)], 0)
            state = advance(automaton[0], state, token)
        return (prev1, token, state), (prev2, prev1, ranked)

    # Where the kernels are compiled (a GPU or TPU) the levels are unrolled: selects and
    # gathers that fuse into about two launches a level, no loop counter or condition.
    # Interpreted (the CPU), one loop body serves every level: the same integer
    # operations, compiled once (an 8-level proposal's program compiled in ~2 s less).
    carry = (prev2, prev1, state)
    if kernels.select_variant()[1] and depth > 2:
        carry, levels = jax.lax.scan(spine_level, carry, jnp.arange(depth - 1))
        levels = [levels]
    else:
        levels = []
        for level in range(depth - 1):
            carry, out = spine_level(carry, level)
            levels.append(jax.tree.map(lambda x: x[None], out))
    prev2, prev1, state = carry  # the last level's context; it is ranked under a constraint
    ranked = () if automaton is None else ranked_at(depth - 1, prev2, prev1, state)
    levels.append(jax.tree.map(lambda x: x[None], (prev2, prev1, ranked)))
    context2, context1, ranked = jax.tree.map(lambda *xs: jnp.concatenate(xs), *levels)
    return context2, context1, None if automaton is None else ranked


def _pack_levels(shape, level_tokens, level_valid, level_origin) -> Proposal:
    """The per-level ``[depth, width]`` arrays laid out level by level as a :class:`Proposal`."""
    parents, parent_index = [], -1
    for level, count in enumerate(shape):
        parents.append(np.full(count, parent_index, np.int32))
        parent_index = sum(shape[:level])  # this level's first node parents the next

    def levels(array):
        return jnp.concatenate([array[level, :count] for level, count in enumerate(shape)])
    return Proposal(tokens=levels(level_tokens).astype(jnp.int32),
                    parents=jnp.asarray(np.concatenate(parents)),
                    valid=levels(level_valid),
                    origin=levels(level_origin))


def _allowed_candidates(constraint, state, lookup_tokens, lookup_valid, ngram_tokens,
                        ngram_valid):
    """One level's candidates under a constraint in ``state``: the token the state forces
    (if it allows one only), the lookup's, the n-gram list's; those it forbids invalid."""
    forced = forced_token(constraint, state)
    tokens = jnp.concatenate([jnp.maximum(forced, 0)[None], lookup_tokens, ngram_tokens])
    valid = jnp.concatenate([(forced >= 0)[None], lookup_valid, ngram_valid])
    return tokens, valid & (advance(constraint, state, tokens) != DEAD_STATE)


# --------------------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------------------

_TOKEN_FIELDS = ("unigram_tokens", "bigram_tokens", "trigram_keys", "trigram_tokens")
_SCORE_FIELDS = ("unigram_scores", "bigram_scores", "bigram_log_alpha", "trigram_scores",
                 "trigram_log_alpha")


def bundled_ngram_path(model_name: str) -> Path:
    """The n-gram file shipped for a known model (``specjax/assets/<name>/ngram.npz``).

    Raises:
      ModelNotFoundError: no tables are shipped for ``model_name``.
    """
    path = _ASSETS / model_name / "ngram.npz"
    if not path.is_file():
        raise ModelNotFoundError(f"no bundled n-gram tables for {model_name!r} (looked for "
                                 f"{path}); build them with 'specjax build-ngram'")
    return path


def _disk_token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < np.iinfo(np.uint16).max else np.int32


def _to_disk_tokens(array: np.ndarray, vocab_size: int) -> np.ndarray:
    dtype = _disk_token_dtype(vocab_size)
    array = np.asarray(array, np.int64)
    if dtype is np.uint16:
        array = np.where(array < 0, np.iinfo(np.uint16).max, array)
    return array.astype(dtype)


def _from_disk_tokens(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint16:
        out = array.astype(np.int32)
        out[array == np.iinfo(np.uint16).max] = -1
        return out
    return array.astype(np.int32)


def save_ngram(path: str | os.PathLike, tables: NgramTables, metadata: dict[str, Any]) -> Path:
    """Writes ``tables`` to the ``.npz`` file ``path`` atomically (temp file + rename).

    Args:
      path: destination file; its directory is created if needed.
      tables: numpy or jax arrays.
      metadata: JSON-serialisable build information, stored with the format fields
        (``format``, ``version``, ``vocab_size``, ``top_k``, ``trigram_top_k``,
        ``trigram_buckets``, ``num_probes``, ``hash``), which it may not override.
    Returns:
      ``path`` as an absolute :class:`~pathlib.Path`.
    """
    path = Path(path).expanduser().absolute()
    arrays = {name: np.asarray(value) for name, value in tables._asdict().items()}
    vocab_size = arrays["bigram_index"].shape[0]
    header = {**metadata, "format": FORMAT_NAME, "version": FORMAT_VERSION,
              "vocab_size": int(vocab_size), "top_k": int(arrays["unigram_tokens"].shape[0]),
              "trigram_top_k": int(arrays["trigram_tokens"].shape[1]),
              "trigram_buckets": int(arrays["trigram_keys"].shape[0]),
              "num_probes": NUM_PROBES, "hash": HASH_NAME}
    stored = {"metadata": np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)}
    for name, value in arrays.items():
        if name in _TOKEN_FIELDS:
            stored[name] = _to_disk_tokens(value, vocab_size)
        elif name in _SCORE_FIELDS:
            stored[name] = value.astype(np.float16)
        else:
            stored[name] = value.astype(np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez_compressed(file, **stored)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp's 0600 is for the partial file only
        os.replace(staging, path)
    except BaseException:  # KeyboardInterrupt included: never leave a half-written file
        Path(staging).unlink(missing_ok=True)
        raise
    return path


def _check(condition: bool, source: str, message: str) -> None:
    if not condition:
        raise CheckpointError(f"{source}: not valid n-gram tables ({message})")


def read_ngram_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of an n-gram file (see :func:`load_ngram` for the errors)."""
    return _read(path)[1]


def load_ngram(path: str | os.PathLike, vocab_size: int | None = None) -> NgramTables:
    """Loads tables written by :func:`save_ngram` as numpy arrays (int32 / float32).

    Args:
      path: the ``.npz`` file.
      vocab_size: when given, the model's vocabulary size, which the tables must match.
    Returns:
      :class:`NgramTables` of numpy arrays (``jax.device_put`` them, or pass them to a
      jitted function directly).
    Raises:
      ModelNotFoundError: no such file.
      CheckpointError: the file is corrupt, truncated, of another format or version, its
        arrays are inconsistent, or its vocabulary does not match ``vocab_size``.
    """
    tables, meta = _read(path)
    if vocab_size is not None and meta["vocab_size"] != int(vocab_size):
        raise CheckpointError(f"{path}: n-gram tables are for a vocabulary of "
                              f"{meta['vocab_size']} tokens, the model has {int(vocab_size)}")
    return tables


# Deflate expands data at most ~1032 times; a member claiming more than this is not what
# save_ngram wrote, whatever its header says.
_MAX_DEFLATE_RATIO = 1100


def _check_archive(path, source: str) -> None:
    """Checks each array of the ``.npz`` against its stored size before numpy reads it.

    numpy allocates the shape an ``.npy`` header declares before reading the data, so a
    header claiming 10^12 elements would allocate first and fail later. Here every member
    must be one of the expected arrays, hold no Python objects, and declare exactly the
    bytes it stores, and its stored size must be one deflate can produce.
    """
    expected = {f"{name}.npy" for name in (*NgramTables._fields, "metadata")}
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            names = [member.filename for member in members]
            _check(len(set(names)) == len(names), source, "an array appears twice")
            for name in sorted(set(names) - expected):
                raise CheckpointError(f"{source}: not valid n-gram tables (unexpected member "
                                      f"{name[:60]!r})")
            for member in members:
                ratio = 1 if member.compress_type == zipfile.ZIP_STORED else _MAX_DEFLATE_RATIO
                _check(member.file_size <= member.compress_size * ratio + 4096, source,
                       f"{member.filename} claims {member.file_size} bytes from "
                       f"{member.compress_size} compressed")
                with archive.open(member) as stream:
                    version = np.lib.format.read_magic(stream)
                    _check(version in ((1, 0), (2, 0)), source,
                           f"{member.filename} is .npy version {version}")
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(stream)
                    header_bytes = stream.tell()
                _check(not dtype.hasobject, source, f"{member.filename} holds Python objects "
                       "(pickled), which are never loaded")
                declared = math.prod(shape) * dtype.itemsize
                _check(declared == member.file_size - header_bytes, source,
                       f"{member.filename} declares {dtype} {shape} ({declared} bytes) but "
                       f"stores {member.file_size - header_bytes}")
    except CheckpointError:
        raise
    except Exception as error:  # zipfile, zlib, ValueError, EOFError... for damaged files
        raise CheckpointError(f"{source}: unreadable n-gram file, corrupt or truncated "
                              f"({type(error).__name__}: {' '.join(str(error).split())[:200]})"
                              ) from error


def _read(path) -> tuple[NgramTables, dict[str, Any]]:
    source = str(path)
    if not Path(path).is_file():
        raise ModelNotFoundError(f"{source}: no such n-gram file")
    _check_archive(path, source)
    try:
        with np.load(path, allow_pickle=False) as archive:
            stored = {name: archive[name] for name in archive.files}
    except Exception as error:  # zipfile, zlib, ValueError, EOFError... for damaged files
        text = " ".join(str(error).split())[:200]
        raise CheckpointError(f"{source}: unreadable n-gram file, corrupt or truncated "
                              f"({type(error).__name__}: {text})") from error
    _check("metadata" in stored, source, "no metadata")
    try:
        meta = json.loads(stored.pop("metadata").tobytes().decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{source}: n-gram metadata is not JSON") from error
    _check(isinstance(meta, dict) and meta.get("format") == FORMAT_NAME, source,
           f"format is not {FORMAT_NAME!r}")
    if meta.get("version") != FORMAT_VERSION or meta.get("num_probes") != NUM_PROBES \
            or meta.get("hash") != HASH_NAME:
        raise CheckpointError(
            f"{source}: n-gram format version {meta.get('version')!r} / hash "
            f"{meta.get('hash')!r}; this specjax reads version {FORMAT_VERSION} / {HASH_NAME}")
    missing = sorted(set(NgramTables._fields) - set(stored))
    _check(not missing, source, f"missing arrays {missing}")
    arrays = {}
    for name in NgramTables._fields:
        value = stored[name]
        # the dtypes save_ngram writes: a wider integer could wrap around into a valid id
        allowed = (("f2", "f4") if name in _SCORE_FIELDS else ("u2", "i4")
                   if name in _TOKEN_FIELDS else ("i4",))
        _check(f"{value.dtype.kind}{value.dtype.itemsize}" in allowed, source,
               f"{name} is {value.dtype}, expected {' or '.join(allowed)}")
        if name in _SCORE_FIELDS:
            arrays[name] = value.astype(np.float32)
        else:
            arrays[name] = _from_disk_tokens(value)
    tables = NgramTables(**arrays)
    _check_shapes(tables, meta, source)
    return tables, meta


def _check_shapes(t: NgramTables, meta: dict, source: str) -> None:
    vocab, k = meta.get("vocab_size"), meta.get("top_k")
    k3, buckets = meta.get("trigram_top_k"), meta.get("trigram_buckets")
    _check(all(isinstance(x, int) and x >= 1 for x in (vocab, k, k3, buckets)), source,
           "metadata lacks vocab_size, top_k, trigram_top_k or trigram_buckets")
    _check(buckets & (buckets - 1) == 0, source, f"{buckets} buckets is not a power of two")
    rows = t.bigram_tokens.shape[0] if t.bigram_tokens.ndim == 2 else -1
    expected = {
        "unigram_tokens": (k,), "unigram_scores": (k,), "bigram_index": (vocab,),
        "bigram_tokens": (rows, k), "bigram_scores": (rows, k), "bigram_log_alpha": (rows,),
        "trigram_keys": (buckets, 2), "trigram_tokens": (buckets, k3),
        "trigram_scores": (buckets, k3), "trigram_log_alpha": (buckets,),
    }
    _check(rows >= 1, source, f"bigram_tokens has shape {t.bigram_tokens.shape}, expected "
           f"(rows >= 1, {k})")
    for name, want in expected.items():
        got = getattr(t, name).shape
        _check(got == want, source, f"{name} has shape {got}, expected {want}")
    for name in _TOKEN_FIELDS:
        value = getattr(t, name)
        _check(bool(np.all((value >= -1) & (value < vocab))), source,
               f"{name} holds ids outside [0, {vocab})")
    _check(bool(np.all((t.bigram_index >= -1) & (t.bigram_index < rows))), source,
           "bigram_index points outside the bigram rows")
