"""The token sequences that spell a stop string, for the device to end a generation on.

A stop string ends a generation's text (:func:`specjax.generate`'s ``stop=``): the text is
cut before its first occurrence and the tokens end at the token that completed it (the
host rule: the first ``k`` such that the decoded text of the first ``k`` new tokens
contains a stop string). The device cannot decode, so it checks token sequences instead
(:class:`specjax.state.StopCondition`): :func:`stop_sequences` lists, from the tokenizer,

1. every single token whose text contains the string;
2. then sequences of 2 to ``MAX_STOP_LENGTH`` tokens whose texts, joined, contain it: the
   first token's text ends with a start of the string, the middle ones' texts lie inside
   it, the last token's text starts with the rest;

shortest first, then in turns from each string, lower ids first (the more frequent tokens
of a BPE vocabulary), up to ``MAX_STOP_SEQUENCES`` for all the strings of a request. A
token's text is its text after another token (so a SentencePiece word's leading space
counts), and each sequence is kept only where the tokenizer's own decoding of it contains
the string at the start of a generation, after an ordinary token and after a lone byte
piece (a token that decodes to U+FFFD): tokens whose text depends on their neighbours
(byte pieces, a space that the tokenizer's clean-up removes) are left out. A generation whose stop string comes out in a
tokenization not listed runs on, and the host's cut gives the same text and tokens (and
where a listed sequence ends one whose text holds no string, :func:`specjax.generate`
runs it again without sequences).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from specjax.state import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES

REPLACEMENT = "\ufffd"
# Candidates per split of a string into a first and a last token, by id (bounds the work on
# a string of common characters, whose pairs number millions).
_MAX_ENDS = 64
_MAX_CANDIDATES = 20_000  # sequences of 2 or more tokens looked at per string

_TEXTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Vocabulary:
    """Every token's text alone and after an anchor token, with the tokenizer's decode."""

    def __init__(self, tokenizer, vocab_size: int):
        self.decode = _decoder(tokenizer)
        size = min(vocab_size, len(tokenizer))
        self.anchor = _anchor(tokenizer, self.decode)
        anchor_text = self.decode([self.anchor])
        alone = _decode_all(tokenizer, [[t] for t in range(size)])
        after = _decode_all(tokenizer, [[self.anchor, t] for t in range(size)])
        self.texts: list[str | None] = []  # None: a token whose text depends on neighbours
        for single, pair in zip(alone, after):
            text = pair[len(anchor_text):] if pair.startswith(anchor_text) else None
            if text is None or REPLACEMENT in text or REPLACEMENT in single:
                text = None
            self.texts.append(text)
        self.byte_piece = next((t for t, text in enumerate(alone) if text == REPLACEMENT),
                               None)
        self.cleans_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def contains(self, sequence: Sequence[int], string: str) -> bool:
        """Whether the tokenizer's decoding of ``sequence`` contains ``string`` at the
        start of a generation, after the anchor and after a byte piece."""
        if string not in self.decode(list(sequence)):
            return False
        for before in (self.anchor, self.byte_piece):
            if before is None:
                continue
            head = self.decode([before])
            text = self.decode([before, *sequence])
            if not text.startswith(head) or string not in text[len(head):]:
                return False
        return True


def _decoder(tokenizer) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _decode_all(tokenizer, batches: list[list[int]]) -> list[str]:
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if batch_decode is not None:
        return list(batch_decode(batches, skip_special_tokens=True))
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in batches]


def _anchor(tokenizer, decode) -> int:
    """A token with a plain text (a letter) that the others are decoded after."""
    for letter in ("a", "x", "0"):
        ids = tokenizer(letter, add_special_tokens=False)["input_ids"]
        if ids and decode(ids[-1:]).strip():
            return int(ids[-1])
    return 0


def _vocabulary(tokenizer, vocab_size: int) -> _Vocabulary:
    """The tokenizer's :class:`_Vocabulary`, computed once per tokenizer and size."""
    try:
        found = _TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable: computed each time
        return _Vocabulary(tokenizer, vocab_size)
    if vocab_size not in found:
        found[vocab_size] = _Vocabulary(tokenizer, vocab_size)
    return found[vocab_size]


def stop_sequences(tokenizer, vocab_size: int, strings: Sequence[str],
                   limit: int = MAX_STOP_SEQUENCES) -> list[tuple[int, ...]]:
    """The token sequences that spell ``strings`` (see the module docstring), at most
    ``limit``; none without a tokenizer.

    Args:
      tokenizer: the model's tokenizer (``decode``, ``__call__``, ``len``), or ``None``.
      vocab_size: the model's vocabulary size (ids past the tokenizer's are never listed).
      strings: the stop strings.
      limit: the most sequences returned.
    Returns:
      Sequences of 1 to ``MAX_STOP_LENGTH`` token ids, shortest first.
    """
    if tokenizer is None or not strings:
        return []
    vocabulary = _vocabulary(tokenizer, vocab_size)
    # [length][string]: the candidates, lower ids first; taken by length, then in turns
    # from each string, so that one string's many spellings do not crowd out another's.
    by_length: dict[int, list[list[tuple[int, ...]]]] = {}
    for index, string in enumerate(strings):
        if vocabulary.cleans_spaces and " " in string:
            continue  # the clean-up may take the string's space out of the text
        for sequence in _spellings(vocabulary.texts, string):
            by_length.setdefault(len(sequence), [[] for _ in strings])[index].append(sequence)
    found: list[tuple[int, ...]] = []
    for length in sorted(by_length):
        queues = [sorted(set(candidates), key=lambda s: (sorted(s), s), reverse=True)
                  for candidates in by_length[length]]
        while any(queues):
            for string, queue in zip(strings, queues):
                if not queue:
                    continue
                if len(found) == limit:
                    return found
                sequence = queue.pop()
                if sequence not in found and vocabulary.contains(sequence, string):
                    found.append(sequence)
    return found


def _spellings(texts: list[str | None], string: str) -> list[tuple[int, ...]]:
    """Candidate sequences for one string, by the texts alone (unchecked; at most
    ``_MAX_CANDIDATES`` besides the single tokens)."""
    found = [(t,) for t, text in enumerate(texts) if text and string in text]
    pieces: dict[str, list[int]] = {}
    inside = {string[a:b] for a in range(len(string)) for b in range(a + 1, len(string) + 1)}
    for t, text in enumerate(texts):
        if text and text in inside:
            pieces.setdefault(text, []).append(t)
    lasts: dict[str, list[int]] = {}  # by the rest of the string they start with
    budget = len(found) + _MAX_CANDIDATES
    for split in range(1, len(string)):
        head = string[:split]
        firsts = [t for t, text in enumerate(texts)
                  if text and text.endswith(head) and string not in text][:_MAX_ENDS]
        for middle in _middles(pieces, string, split, MAX_STOP_LENGTH - 2):
            rest = string[split + sum(len(texts[t]) for t in middle):]
            if not rest or not firsts:
                continue
            if rest not in lasts:
                lasts[rest] = [t for t, text in enumerate(texts)
                               if text and text.startswith(rest)][:_MAX_ENDS]
            found += [(first, *middle, last) for first in firsts for last in lasts[rest]]
            if len(found) >= budget:
                return found[:budget]
    return found


def _middles(pieces: dict[str, list[int]], string: str, start: int,
             most: int) -> list[tuple[int, ...]]:
    """Sequences of at most ``most`` tokens whose texts spell ``string[start:end]`` for
    some ``end`` before the string's end (the empty sequence included)."""
    found: list[tuple[int, ...]] = [()]
    if most == 0:
        return found
    for end in range(start + 1, len(string)):
        for token in pieces.get(string[start:end], [])[:_MAX_ENDS]:
            found += [(token, *rest) for rest in _middles(pieces, string, end, most - 1)]
    return found
