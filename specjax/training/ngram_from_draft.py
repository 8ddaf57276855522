"""N-gram tables fitted to a draft model's samples (``specjax build-ngram --from-draft``).

The staged speculation paper fitted its trigram model to tokens sampled from the draft at
temperature 1.5: the tables then propose what the draft would, at the cost of a table
lookup. :func:`build_ngram_from_draft` samples on device
(:mod:`specjax.training.sample_corpus`) and builds through
:func:`specjax.training.ngram_build.build_ngram_files`, optionally mixed with text and token
files.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specjax import interrupts
from specjax.errors import InvalidArgumentError
from specjax.loaded_model import Model
from specjax.training import sample_corpus
from specjax.training.ngram_build import (DEFAULT_MIN_CONTEXT_COUNT, DEFAULT_TOP_K,
                                          DEFAULT_TRIGRAM_BUCKETS, DEFAULT_TRIGRAM_TOP_K,
                                          build_ngram_files, check_settings,
                                          collect_text_files)

DEFAULT_SAMPLE_TEMPERATURE = 1.5  # the paper's
DEFAULT_SAMPLE_BATCH = 32
DEFAULT_SAMPLE_SEQ_LEN = 256


def check_draft_sampling(out: str | os.PathLike, num_samples: int, *,
                         temperature: float = DEFAULT_SAMPLE_TEMPERATURE,
                         batch_size: int = DEFAULT_SAMPLE_BATCH,
                         seq_len: int = DEFAULT_SAMPLE_SEQ_LEN,
                         samples_out: str | os.PathLike | None = None, **corpus) -> None:
    """The checks of :func:`build_ngram_from_draft`'s settings, which need no model (the
    command makes them before it loads one). Raises :class:`InvalidArgumentError`."""
    overwrite = corpus.get("overwrite", False)
    out = Path(out).expanduser()
    for path in [out] + ([Path(samples_out).expanduser()] if samples_out else []):
        if path.exists() and not overwrite:
            raise InvalidArgumentError(f"{path.absolute()} already exists; pass "
                                       "overwrite=True (--overwrite) to replace it")
    if not num_samples >= 1 or int(num_samples) != num_samples:
        raise InvalidArgumentError(f"the number of samples must be an integer >= 1, got "
                                   f"{num_samples}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise InvalidArgumentError(f"the sampling temperature must be > 0 (the paper: 1.5), "
                                   f"got {temperature}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not value >= 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    check_settings(1, *(corpus.get(name, default) for name, default in (
        ("top_k", DEFAULT_TOP_K), ("trigram_top_k", DEFAULT_TRIGRAM_TOP_K),
        ("trigram_buckets", DEFAULT_TRIGRAM_BUCKETS),
        ("min_context_count", DEFAULT_MIN_CONTEXT_COUNT))))


def build_ngram_from_draft(out: str | os.PathLike, target, draft, num_samples: int, *,
                           temperature: float = DEFAULT_SAMPLE_TEMPERATURE, seed: int = 0,
                           batch_size: int = DEFAULT_SAMPLE_BATCH,
                           seq_len: int = DEFAULT_SAMPLE_SEQ_LEN,
                           prompt_text: Sequence[str | os.PathLike] | None = None,
                           samples_out: str | os.PathLike | None = None,
                           progress: bool = False, log=None, **corpus) -> tuple[Path, dict]:
    """``specjax build-ngram --from-draft``: tables fitted to tokens sampled from a draft.

    Samples ``num_samples`` tokens from ``draft`` with
    :func:`~specjax.training.sample_corpus.draft_samples` (rows of ``seq_len``,
    prompts: the separator plus 0-16 tokens at a random offset of a file of
    ``prompt_text``, default 256 files of the standard library), then builds through
    :func:`build_ngram_files`, mixed with the text and token files given in ``corpus``.

    Args:
      out: the ``.npz`` file to write.
      target: the target :class:`~specjax.Model` (its tokenizer and vocabulary index the
        tables, and the draft must fit it).
      draft: the draft :class:`~specjax.Model` (``specjax build-ngram --from-draft`` loads
        it with :func:`specjax.loading.resolve_draft`).
      num_samples: tokens to sample (``>= 1``).
      temperature, seed, batch_size, seq_len: the sampling (see
        :func:`~specjax.training.sample_corpus.sample_continuations`).
      prompt_text: text files or directories for the prompts (``*.py`` in directories).
      samples_out: also save the samples as a 2-D ``.npy`` (``-1`` padded; reusable with
        ``--tokens``), written atomically before the tables.
      progress, log: progress bars; ``log`` is called with one-line messages.
      corpus: ``text``, ``tokens``, ``pattern``, ``exclude``, the table settings and
        ``overwrite``, as for :func:`build_ngram_files`.
    Returns:
      (path written, metadata stored).
    Raises:
      InvalidArgumentError: bad settings, ``out`` (or ``samples_out``) exists.
      KeyboardInterrupt: Ctrl-C; nothing half-written is left (see build_ngram_files).
    """
    started = time.perf_counter()
    out = Path(out).expanduser().absolute()
    check_draft_sampling(out, num_samples, temperature=temperature, batch_size=batch_size,
                         seq_len=seq_len, samples_out=samples_out, **corpus)
    for name, value in (("target", target), ("draft", draft)):
        if not isinstance(value, Model):
            raise InvalidArgumentError(f"the {name} must be a specjax.Model (load it first: "
                                       f"specjax.load, specjax.loading.resolve_draft), got "
                                       f"{type(value).__name__}")
    model, draft_model = target, draft
    files = (collect_text_files(prompt_text, "*.py", ()) if prompt_text is not None
             else None)
    streams = sample_corpus.prompt_streams(model.tokenizer, files, seed=seed)
    if log:
        log(f"sampling {num_samples} tokens from {draft_model.name} at temperature "
            f"{temperature} ({batch_size} rows x {seq_len} per batch)")
    began = time.perf_counter()
    samples = sample_corpus.draft_samples(draft_model, num_samples, temperature=temperature,
                                          seed=seed, batch_size=batch_size, seq_len=seq_len,
                                          streams=streams)
    seconds = time.perf_counter() - began
    if samples_out:
        _save_samples(Path(samples_out).expanduser().absolute(), samples)
    recorded = {"draft_samples": {
        "draft": str(draft) if not isinstance(draft, Model) else draft.name,
        "target": model.name, "tokens": int(num_samples),
        "tokens_kept": int((samples >= 0).sum()), "rows": int(samples.shape[0]),
        "temperature": float(temperature), "seed": int(seed), "batch_size": int(batch_size),
        "seq_len": int(seq_len), "prompt_files": len(streams),
        "prompts": "separator + 0-16 tokens at a random offset of a prompt file",
        "sampling_seconds": round(seconds, 2),
        "tokens_per_second": round(num_samples / max(seconds, 1e-9), 1),
        "samples_file": str(samples_out) if samples_out else None}}
    tokenizer = corpus.pop("tokenizer", None) or os.fspath(target if isinstance(target, str)
                                                           else model.name)
    path, metadata = build_ngram_files(out, tokenizer, sequences=list(samples),
                                       sources=recorded, progress=progress, **corpus)
    metadata["total_seconds"] = round(time.perf_counter() - started, 2)
    return path, metadata


def _save_samples(path: Path, samples: np.ndarray) -> None:
    """Writes ``samples`` to ``path`` (.npy) atomically (complete or absent on Ctrl-C)."""
    with interrupts.guard() as interrupt, interrupt.deferred():
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent,
                                        suffix=".npy")
        os.close(handle)
        try:
            np.save(name, samples)
            interrupt.check()
            os.replace(name, path)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
