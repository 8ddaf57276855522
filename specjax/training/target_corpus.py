"""Self-distillation text for draft training (``--corpus-from-target N``, see
:mod:`~specjax.commands.train_draft`): the target writes documents from docstring prompts
of the file corpus (:mod:`~specjax.training.corpus`), batched and seeded per row by
:mod:`~specjax.training.sample_corpus`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from specjax import progress as progress_lib
from specjax.errors import InvalidArgumentError
from specjax.loaded_model import encode_prompt
from specjax.models import cast_floats
from specjax.training import sample_corpus
from specjax.training.corpus import is_heldout

if TYPE_CHECKING:
    from specjax.training.config import TrainConfig


CHAT_REQUEST = "Write the body of this Python function.\n\n```python\n{prompt}```"


def _spread(index: int, share: float) -> bool:
    """Whether item ``index`` of a sequence is one of a ``share`` of them, spread evenly."""
    return bool(np.floor((index + 1) * share) > np.floor(index * share))


def _encode_row(target, prompt: str, chat: bool) -> list[int]:
    """A generation row's prompt ids: the code itself, or (``chat``) a request to complete
    it through the target's chat template, the way a chat user asks (:data:`CHAT_REQUEST`)."""
    if not chat:
        return target.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"]
    return encode_prompt(target, CHAT_REQUEST.format(prompt=prompt), chat=True)


def _generation_rows(target, prompts: list[str], rows: int, cfg: "TrainConfig",
                     seed: int, separator: int, progress, deadline: float | None = None, *,
                     write, greedy_share: float = 0.0, chat_share: float = 0.0) -> np.ndarray:
    """Up to ``rows`` documents (prompt + generation + separator), joined as one int32
    stream, written in chunks of ``cfg.target_batch_size`` rows by
    ``write(prompts, greedy, seed, first_row)`` (int32 [rows, L], cut at a stop token): a
    share ``greedy_share`` of the chunks greedily, spread evenly so that a run cut short
    keeps that share, the others at the writer's temperature; a share
    ``chat_share`` of the rows, spread evenly too, asks through the chat template
    (:func:`_encode_row`). Row ``i`` samples with ``row_seed(seed, i)`` whatever its chunk.
    No chunk begins after ``deadline`` (``time.monotonic()``), except the first."""
    order = np.random.default_rng(seed).permutation(len(prompts))
    texts = [prompts[order[i % len(prompts)]] for i in range(rows)]  # cycled: seeds differ
    size = cfg.target_batch_size
    encoded, parts = [], []
    for chunk, begin in enumerate(range(0, rows, size)):
        if chunk and deadline is not None and time.monotonic() >= deadline:
            break
        # Encoded chunk by chunk: rows a deadline leaves out are never tokenized.
        encoded += [_encode_row(target, texts[i], _spread(i, chat_share))
                    for i in range(begin, min(begin + size, rows))]
        parts.append(write(encoded[begin:begin + size], _spread(chunk, greedy_share), seed,
                           begin))
        progress(begin + len(parts[-1]))
    generated = np.concatenate(parts)
    documents = []
    for prompt, row in zip(encoded, generated):
        row = row[row >= 0]
        if row.size and row[-1] in target.config.eos_token_ids:
            row = row[:-1]
        documents.append(np.asarray(list(prompt) + row.tolist() + [separator], np.int32))
    return np.concatenate(documents)


def generate_target_corpus(target, files: Sequence[Path], cfg: "TrainConfig", *,
                           separator: int, log=print,
                           progress: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """The self-distillation corpus (see :mod:`~specjax.commands.train_draft`): (train,
    held-out) int32 streams of documents written by ``target``, and a description of how
    they were made.

    Args:
      target: a :class:`specjax.Model` with a tokenizer.
      files: the file corpus; its functions with docstrings become prompts (training
        files for training generations, held-out files for held-out ones).
      cfg: ``target_corpus_tokens`` generated positions for training (rows of
        ``target_gen_len``), ``target_temperature``, ``target_batch_size``, ``seed``;
        ``heldout_fraction`` more (at least ``eval_windows`` windows) for held-out.
      separator: the token that ends each document.
    Raises:
      InvalidArgumentError: the files hold no function with a docstring in either split.
    """
    params = cast_floats(target.params, cfg.compute_dtype)

    def write(prompts, greedy, seed, first_row):
        return sample_corpus.sample_continuations(
            params, target.config, prompts, num_new_tokens=cfg.target_gen_len,
            temperature=0.0 if greedy else cfg.target_temperature, seed=seed,
            first_row=first_row, batch_size=cfg.target_batch_size,
            stop_tokens=tuple(target.config.eos_token_ids) or (separator,))

    return write_documents(
        target, files, cfg, tokens=cfg.target_corpus_tokens, row_length=cfg.target_gen_len,
        write=write, greedy_share=cfg.target_greedy_fraction,
        chat_share=cfg.target_chat_fraction, separator=separator, log=log,
        progress=progress, name="target corpus", flag="--corpus-from-target",
        seconds=cfg.target_gen_seconds,
        how=(f"at temperature {cfg.target_temperature} ({cfg.target_greedy_fraction:g} of "
             f"them greedy, {cfg.target_chat_fraction:g} through the chat template)"))


def write_documents(target, files: Sequence[Path], cfg: "TrainConfig", *, tokens: int,
                    row_length: int, write, greedy_share: float, chat_share: float,
                    separator: int, log,
                    progress: bool, name: str, flag: str, how: str,
                    seconds: float | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train, held-out) streams of documents that ``write`` continues from the docstring
    prompts of ``files`` (:func:`generate_target_corpus`; the draft's rollouts of
    :mod:`~specjax.training.draft_corpus` draw the same prompts, row for row), and a
    description.

    Args:
      tokens: positions written for training, in rows of ``row_length``; held-out rows
        come first, ``heldout_fraction`` as many (at least ``eval_windows`` windows), from
        held-out files' prompts with seed ``cfg.seed + 1_000_003``.
      write: ``write(prompts, greedy, seed, first_row)`` -> int32 [rows, row_length].
      greedy_share: the share of chunks written greedily.
      chat_share: the share of rows asked through the chat template.
      name, flag, how: for the log line and the error.
      seconds: no training chunk begins this long after the start (None: no limit).
    Raises:
      InvalidArgumentError: the files hold no function with a docstring in either split.
    """
    exclude = sample_corpus.humaneval_entry_points()
    train_files = [f for f in files if not is_heldout(f, cfg.heldout_fraction)]
    held_files = [f for f in files if is_heldout(f, cfg.heldout_fraction)]
    train_prompts = sample_corpus.docstring_prompts(train_files, exclude_names=exclude)
    held_prompts = sample_corpus.docstring_prompts(held_files, exclude_names=exclude)
    if not train_prompts or not held_prompts:
        raise InvalidArgumentError(
            f"{flag} needs functions with docstrings (the prompts) in both the "
            f"training and held-out files; found {len(train_prompts)} and {len(held_prompts)}")
    rows = -(-tokens // row_length)
    window_rows = -(-cfg.eval_windows * (cfg.seq_len + 1) // row_length)
    held_rows = max(int(np.ceil(rows * cfg.heldout_fraction)), window_rows, 1)
    bar = None
    if progress:
        bar = progress_lib.terminal_bar(total=rows + held_rows, desc=name, unit="row")
    done = [0]

    def advance(count, offset):
        if bar is not None:
            bar.update(offset + count - done[0])
            done[0] = offset + count

    log(f"{name}: generating {rows} + {held_rows} held-out rows of {row_length} tokens "
        f"{how} from {len(train_prompts)} + {len(held_prompts)} docstring prompts")
    began = time.perf_counter()
    # The held-out rows first: a deadline cuts the training rows only.
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        held = _generation_rows(target, held_prompts, held_rows, cfg, cfg.seed + 1_000_003,
                                separator, lambda n: advance(n, rows), write=write,
                                greedy_share=greedy_share, chat_share=chat_share)
        train = _generation_rows(target, train_prompts, rows, cfg, cfg.seed, separator,
                                 lambda n: advance(n, 0), deadline, write=write,
                                 greedy_share=greedy_share, chat_share=chat_share)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - began
    info = {"rows": rows, "heldout_rows": held_rows, "prompts": len(train_prompts),
            "train_tokens": int(train.size), "heldout_tokens": int(held.size),
            "compute_dtype": cfg.compute_dtype,
            "heldout_prompts": len(held_prompts), "humaneval_names_excluded": len(exclude),
            "seconds": round(seconds, 1),
            # Documents (prompts included) written per second.
            "generated_tokens_per_s": round((train.size + held.size) / max(seconds, 1e-9), 1)}
    return train, held, info


def add_prior_corpus(path, train: np.ndarray, held: np.ndarray, vocab_size: int):
    """(train, held) with the streams of the ``target_corpus.npz`` at ``path`` appended."""
    try:
        with np.load(path) as data:
            prior_train, prior_held = data["train"], data["heldout"]
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgumentError(f"prior target corpus {path} is not a target_corpus.npz "
                                   f"with train and heldout streams ({e})") from None
    for stream in (prior_train, prior_held):
        if stream.ndim != 1 or stream.size == 0 or stream.min() < 0 or stream.max() >= vocab_size:
            raise InvalidArgumentError(f"prior target corpus {path} holds ids outside the "
                                       f"target's vocabulary of {vocab_size}")
    return (np.concatenate([train, prior_train.astype(np.int32)]),
            np.concatenate([held, prior_held.astype(np.int32)]))
