"""On-policy text for draft training (``--corpus-from-draft N``, see
:mod:`~specjax.commands.train_draft`): the draft's own rollouts, as on-policy distillation
trains a draft on what it writes itself (DistillSpec).

The prompts are those of ``--corpus-from-target`` (docstring prompts of the file corpus,
HumanEval's names left out, a share ``rollout_chat_fraction`` of them through the chat
template, spread over the rows as ``target_chat_fraction`` is, rows cycled in the same
seeded order, row ``i`` sampling with
:func:`~specjax.training.sample_corpus.row_seed` ``(seed, i)``); the draft continues each
for ``rollout_len`` tokens at ``rollout_temperature``, with the coupled sampling rule of
:func:`specjax.sampling.sample_tokens` (the token at position ``t`` uses noise drawn from
``(row seed, t)``; 0 is greedy).

Only the tokens are stored (``draft_corpus.npz``, int32 streams like
``target_corpus.npz``): training runs the frozen target over every window inside the
jitted step (:mod:`~specjax.training.steps`, :mod:`~specjax.training.eagle3`), so the
target's distributions at each position of a rollout are computed there, over the whole
vocabulary, and need no file. A new EAGLE-3 draft's vocabulary is chosen from the file
corpus and the target's text (:func:`~specjax.training.drafts.draft_vocabulary`), not from
the rollouts, which the writing draft drew from its own vocabulary.

A standalone draft (no ``feature_input``) is sampled as it drafts, by
:func:`~specjax.training.sample_corpus.sample_continuations`. A feature draft
(EAGLE-style, and EAGLE-3 with ``feature_layers``) reads the target's features, as at
decoding (:mod:`specjax.drafters.model`): the target runs over the prompt; the draft's
prefill reads the target's features one position back; then each new token reads the
draft's own output at the position before, the feature a drafted node reads below the
root. ``rollout_depth`` D > 0 makes the rollout a sequence of chains of D tokens, as
speculative decoding drafts them when every proposal is accepted: after each chain the
target runs over its D tokens (one cached pass) and the draft rewrites its cache over them
reading the target's features (its catch-up), so that the next chain starts from the
target's features again. D = 0 is one chain: after the prompt the draft reads only its own
states, deeper than decoding ever lets it, so later tokens drift from the text the
target's features would give.

:func:`rollout_continuations` is one jitted program per (batch, prompt bucket, length):
``jax.vmap`` over rows of a per-row program (prefills, then a ``lax.fori_loop`` of chains,
each a ``lax.fori_loop`` of one-token draft steps).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import models
from specjax.cache import advance, init_cache
from specjax.errors import InvalidArgumentError
from specjax.sampling import SamplingParams, sample_tokens
from specjax.models import cast_floats
from specjax.training import sample_corpus, target_corpus

if TYPE_CHECKING:
    from specjax.training.config import TrainConfig


def _target_features(params, config, layers: tuple, tokens, positions, cache):
    """The target's features at ``positions`` (its blocks ``layers``' outputs [T, F*d], or
    its final-normed states [T, d] without layers) and its cache with them written."""
    if layers:
        _, taps, cache = models.hidden_states(params, config, tokens, positions, cache,
                                              attn_impl="reference", feature_layers=layers)
        return taps, cache
    return models.hidden_states(params, config, tokens, positions, cache,
                                attn_impl="reference")


def _rollout_row(target_params, target_config, draft_params, draft_config, capacity: int,
                 num_new: int, depth: int, prompt, prompt_length, temperature, seed):
    """``num_new`` (a multiple of ``depth``) draft tokens after ``prompt[:prompt_length]``
    (int32 [P]) for one row, in chains of ``depth`` (see the module docstring)."""
    sampling = SamplingParams(temperature=temperature, top_k=jnp.int32(0),
                              top_p=jnp.float32(1.0), seed=seed)
    layers = tuple(draft_config.feature_layers or ())

    def reads(features, positions, before):
        """What the draft reads at ``positions`` [T]: the target's ``features`` [T, F] one
        position back (``before`` [F] the target's feature ahead of the first), fused;
        zeros at position 0."""
        behind = jnp.concatenate([before[None], features[:-1]])
        fused = models.fuse_features(draft_params, draft_config, behind)
        return jnp.where((positions > 0)[:, None], fused, jnp.zeros_like(fused))

    def draft_pass(tokens, positions, features, cache):
        return models.hidden_states(draft_params, draft_config, tokens, positions, cache,
                                    attn_impl="reference", features=features)

    def sample(hidden, position):
        logits = models.lm_head(draft_params, draft_config, hidden[None])
        return sample_tokens(logits, sampling, position[None])[0]

    positions = jnp.arange(prompt.shape[0], dtype=jnp.int32)
    target_cache = init_cache(target_config, capacity, target_params["embed"].dtype)
    features, target_cache = _target_features(target_params, target_config, layers, prompt,
                                              positions, target_cache)
    target_cache = advance(target_cache, prompt_length)
    hidden, cache = draft_pass(prompt, positions,
                               reads(features, positions, jnp.zeros_like(features[0])),
                               init_cache(draft_config, capacity, draft_params["embed"].dtype))
    cache = advance(cache, prompt_length)
    root = jax.lax.dynamic_index_in_dim(hidden, prompt_length - 1, keepdims=False)
    last_feature = jax.lax.dynamic_index_in_dim(features, prompt_length - 1, keepdims=False)

    def chain(c, carry):
        cache, target_cache, root, last_feature, out = carry
        start = prompt_length + c * depth  # the position of the chain's first token
        out = out.at[c * depth].set(sample(root, start))

        def step(j, carry):  # the token at start + j - 1 in, the one at start + j out
            cache, previous, out = carry
            position = start + j - 1
            token = jax.lax.dynamic_index_in_dim(out, c * depth + j - 1, keepdims=True)
            hidden, cache = draft_pass(token, position[None], previous[None], cache)
            return advance(cache, 1), hidden[0], out.at[c * depth + j].set(
                sample(hidden[0], position + 1))

        cache, _, out = jax.lax.fori_loop(1, depth, step, (cache, root, out))
        if num_new == depth:  # one chain: nothing reads the target again
            return cache, target_cache, root, last_feature, out
        # The target's pass over the chain, then the draft's catch-up reading its features.
        tokens = jax.lax.dynamic_slice(out, (c * depth,), (depth,))
        chain_positions = start + jnp.arange(depth, dtype=jnp.int32)
        features, target_cache = _target_features(target_params, target_config, layers,
                                                  tokens, chain_positions, target_cache)
        cache = cache.replace(length=start)
        hidden, cache = draft_pass(tokens, chain_positions,
                                   reads(features, chain_positions, last_feature), cache)
        return (advance(cache, depth), advance(target_cache, depth), hidden[-1],
                features[-1], out)

    out = jnp.zeros(num_new, jnp.int32)
    carry = (cache, target_cache, root, last_feature, out)
    return jax.lax.fori_loop(0, num_new // depth, chain, carry)[-1]


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 5, 6))
def _rollout_batch(target_params, target_config, draft_params, draft_config, capacity: int,
                   num_new: int, depth: int, prompts, prompt_lengths, temperature, seeds):
    row = functools.partial(_rollout_row, target_params, target_config, draft_params,
                            draft_config, capacity, num_new, depth)
    return jax.vmap(row, in_axes=(0, 0, None, 0))(prompts, prompt_lengths, temperature, seeds)


def rollout_continuations(target_params, target_config, draft_params, draft_config,
                          prompts: Sequence[Sequence[int]], *, num_new_tokens: int,
                          temperature: float, depth: int = 0, seed: int = 0,
                          batch_size: int = 16, stop_tokens: Sequence[int] = (),
                          first_row: int = 0) -> np.ndarray:
    """The draft's continuation of each prompt (see the module docstring).

    Args:
      target_params, target_config: the target, whose features a feature draft reads.
      draft_params, draft_config: the draft (a standalone one is sampled alone).
      prompts: ``R`` prompts of at least one token id each.
      num_new_tokens: ``L``, tokens the draft writes after each prompt (static).
      temperature: ``T >= 0`` (0: greedy); traced.
      depth: ``D``, tokens per chain of a feature draft (the target reads them and the
        draft catches up after each); 0: one chain of ``L`` (static).
      seed, batch_size, stop_tokens, first_row: as
        :func:`~specjax.training.sample_corpus.sample_continuations`.
    Returns:
      int32 ``[R, L]``, :data:`~specjax.training.sample_corpus.PAD` after each row's first
      stop token.
    Raises:
      InvalidArgumentError: a bad setting or an empty prompt.
    """
    if depth < 0:
        raise InvalidArgumentError(f"the rollout depth must be >= 0, got {depth}")
    if not draft_config.feature_input:
        return sample_corpus.sample_continuations(
            draft_params, draft_config, prompts, num_new_tokens=num_new_tokens,
            temperature=temperature, seed=seed, batch_size=batch_size,
            stop_tokens=stop_tokens, first_row=first_row)
    if num_new_tokens < 1 or batch_size < 1:
        raise InvalidArgumentError(f"num_new_tokens and batch_size must be >= 1, got "
                                   f"{num_new_tokens} and {batch_size}")
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {temperature}")
    if not prompts:
        return np.zeros((0, num_new_tokens), np.int32)
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise InvalidArgumentError("every prompt needs at least one token")
    depth = min(depth or num_new_tokens, num_new_tokens)
    written = -(-num_new_tokens // depth) * depth  # whole chains, cut to L afterwards
    limit = min(target_config.max_position_embeddings, draft_config.max_position_embeddings)
    if int(lengths.max()) + written > limit:
        raise InvalidArgumentError(
            f"longest prompt ({lengths.max()}) + {written} new tokens exceeds the models' "
            f"{limit} positions")
    seeds = np.asarray([sample_corpus.row_seed(seed, first_row + i)
                        for i in range(len(prompts))], np.uint32)
    out = np.empty((len(prompts), num_new_tokens), np.int32)
    for rows, count, padded, capacity in sample_corpus.length_sorted_batches(
            prompts, lengths, batch_size, written):
        tokens = _rollout_batch(target_params, target_config, draft_params, draft_config,
                                capacity, written, depth, jnp.asarray(padded),
                                jnp.asarray(lengths[rows]), jnp.float32(temperature),
                                jnp.asarray(seeds[rows]))
        out[rows[:count]] = np.asarray(tokens)[:count, :num_new_tokens]
    return sample_corpus.cut_at_stop(out, stop_tokens)


def rollout_settings(cfg: "TrainConfig") -> dict:
    """The settings a ``draft_corpus.npz`` was made with (stored in it, and compared with a
    run's when the run finds one in its folder)."""
    return {"draft": cfg.rollout_draft, "tokens": cfg.draft_corpus_tokens,
            "temperature": cfg.rollout_temperature, "length": cfg.rollout_len,
            "depth": cfg.rollout_depth, "seed": cfg.seed,
            "chat_fraction": cfg.rollout_chat_fraction,
            "heldout_fraction": cfg.heldout_fraction}


def generate_draft_corpus(target, draft, files: Sequence[Path], cfg: "TrainConfig", *,
                          separator: int, log=print,
                          progress: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """The on-policy corpus (see the module docstring): (train, held-out) int32 streams of
    documents, each a prompt of ``--corpus-from-target`` (the same rows, seeds and chat
    share) and the draft's rollout after it, and a description of how they were made
    (``settings``: :func:`rollout_settings`).

    Args:
      target: a :class:`specjax.Model` with a tokenizer (it writes the prompts' features).
      draft: its draft, a :class:`specjax.Model` (e.g. ``specjax.loading.resolve_draft``).
      files: the file corpus, whose docstrings are the prompts.
      cfg: ``draft_corpus_tokens`` positions for training, in rows of ``rollout_len`` at
        ``rollout_temperature`` in chains of ``rollout_depth``; ``target_batch_size`` rows
        at once; ``heldout_fraction`` more (at least ``eval_windows`` windows) held out,
        written first; no training row begins ``rollout_seconds`` after the start.
      separator: the token that ends each document.
    Raises:
      InvalidArgumentError: no prompts in either split (as for the target's text).
    """
    target_params = cast_floats(target.params, cfg.compute_dtype)
    draft_params = cast_floats(draft.params, cfg.compute_dtype)
    stop = tuple(target.config.eos_token_ids) or (separator,)

    def write(prompts, greedy, seed, first_row):
        return rollout_continuations(
            target_params, target.config, draft_params, draft.config, prompts,
            num_new_tokens=cfg.rollout_len, temperature=cfg.rollout_temperature,
            depth=cfg.rollout_depth, seed=seed, batch_size=cfg.target_batch_size,
            stop_tokens=stop, first_row=first_row)

    depth = (f"in chains of {cfg.rollout_depth}, the target read after each"
             if cfg.rollout_depth else "on its own states after the prompt")
    train, held, info = target_corpus.write_documents(
        target, files, cfg, tokens=cfg.draft_corpus_tokens, row_length=cfg.rollout_len,
        write=write, greedy_share=0.0, chat_share=cfg.rollout_chat_fraction,
        separator=separator, log=log, progress=progress,
        name="draft corpus", flag="--corpus-from-draft", seconds=cfg.rollout_seconds,
        how=(f"by the draft {cfg.rollout_draft} at temperature {cfg.rollout_temperature} "
             f"{depth} ({cfg.rollout_chat_fraction:g} through the chat template)"))
    info["settings"] = rollout_settings(cfg)
    return train, held, info
