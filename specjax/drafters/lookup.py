"""Context lookup (prompt-lookup drafting): continue the text as it went on last time.

If the last ``n`` tokens of the sequence occurred earlier in it, the tokens that followed
that earlier occurrence are a cheap, often right guess of what comes next: code restates
names, signatures and whole lines (on HumanEval prompts SmolLM2's next token is found this
way 63% of the time).

:func:`lookup_continuation` tries suffix lengths ``n = max_n .. min_n`` (static, longest
first) and takes the most recent earlier occurrence of the longest suffix that has one.
An occurrence is *earlier* when it ends before the last token, so at least one token of
continuation follows it; it may overlap the suffix (a repeating pattern continues
itself). Everything is array code over the static buffer ``history[S]`` with a traced
``length``: ``O(S * max_n)`` elementwise work and one reduction, no loop over ``S``,
jittable and vmappable.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.errors import InvalidArgumentError


class Continuation(NamedTuple):
    """What :func:`lookup_continuation` found."""

    tokens: jax.Array  # int32 [L], 0 where invalid
    valid: jax.Array  # bool [L], a prefix: False once the continuation reaches `length`
    match_length: jax.Array  # int32 scalar, n of the suffix matched; 0: no match
    start: jax.Array  # int32 scalar, index in history of tokens[0]; -1: no match


def lookup_continuation(history, length, num_tokens: int, *, min_n: int = 1,
                        max_n: int = 3) -> Continuation:
    """The continuation of the most recent earlier occurrence of the longest suffix.

    Args:
      history: int32[S] token buffer; only ``history[:length]`` is read.
      length: int32 scalar, ``0 <= length <= S`` (traced).
      num_tokens: ``L``, static number of continuation tokens returned.
      min_n, max_n: static suffix lengths tried, longest first (``1 <= min_n <= max_n``).
    Returns:
      :class:`Continuation`: ``tokens[i] = history[start + i]`` where
      ``start = e + 1`` and ``e`` is the last index of the chosen earlier occurrence;
      ``valid[i]`` is ``start + i < length``.
    """
    if not 1 <= min_n <= max_n:
        raise InvalidArgumentError(f"lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
    history = jnp.asarray(history, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    size = history.shape[0]
    ends = jnp.arange(size)  # candidate last index of an earlier occurrence
    # agree[e] after `back`: history[e - b] == history[length - 1 - b] for every b <= back,
    # i.e. the last back + 1 tokens occurred ending at e. Longer suffixes extend shorter ones.
    agree = ends >= 0
    matches = {}
    for back in range(max_n):
        if back < size:  # past the buffer, the bounds on `ends` below already exclude all
            target = history[jnp.clip(length - 1 - back, 0, size - 1)]
            shifted = jnp.concatenate([jnp.full(back, -1, jnp.int32), history[:size - back]])
            agree = agree & (shifted == target)
        n = back + 1
        if n >= min_n:
            matches[n] = agree & (ends >= n - 1) & (ends <= length - 2) & (length >= n + 1)
    longest_first = range(max_n, min_n - 1, -1)
    # The most recent occurrence of every length, in one reduction.
    last = jnp.max(jnp.where(jnp.stack([matches[n] for n in longest_first]), ends, -1), axis=1)
    best_end = jnp.asarray(-1, jnp.int32)
    best_n = jnp.asarray(0, jnp.int32)
    for i, n in enumerate(longest_first):
        take = (best_n == 0) & (last[i] >= 0)
        best_end = jnp.where(take, last[i], best_end)
        best_n = jnp.where(take, n, best_n)
    found = best_n > 0
    index = best_end + 1 + jnp.arange(num_tokens)
    valid = found & (index < length)
    tokens = jnp.where(valid, history[jnp.clip(index, 0, size - 1)], 0)
    return Continuation(tokens=tokens, valid=valid, match_length=best_n,
                        start=jnp.where(found, best_end + 1, -1))
