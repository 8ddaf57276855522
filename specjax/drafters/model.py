"""The model drafter: a draft model's state and passes, for the methods that run one.

``spec`` and ``tree`` (:mod:`specjax.methods.speculative`) and ``staged``
(:mod:`specjax.methods.staged`) keep a :class:`DraftState` in
``DecodeState.method_state``: the draft's own KV cache, which lags the sequence by the
tokens the last step accepted, and, for a feature draft (EAGLE-style: the draft reads the
target's hidden states), the target's features of every committed position. The passes
here are the draft's prefill, its catch-up to the root of the next tree, and the feature
bookkeeping; how the tree is drafted from them is each method's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import models
from specjax.cache import KVCache, advance, init_cache
from specjax.config import ModelConfig
from specjax.state import DecodeLoop, DecodeState

if TYPE_CHECKING:
    from specjax.methods.common import Tally


@struct.dataclass
class DraftResources:
    """What a method with a draft model decodes with (``spec``, ``tree``)."""

    draft_params: dict  # the draft model's parameter tree
    constraint: Any = None  # a constraint's ConstraintTables (a constrained method), or None


@struct.dataclass
class DraftState:
    """The state of a method with a draft model (``spec``, ``tree``, ``staged``), in
    ``DecodeState.method_state``."""

    draft_cache: KVCache  # the draft's cache; lags the sequence by the last step's tokens
    tally: Tally  # per-step statistics
    # float [S, d]: the target's features (final-normed hidden states) at every position
    # the target has run, for a draft that reads them (``method.uses_features``); [S, F*d],
    # the outputs of target blocks ``method.feature_layers``, for a multi-layer feature
    # draft (the draft fuses them itself: the target pass stays the draft's). ``None``
    # for other drafts.
    features: jax.Array | None = None
    # int32 []: a constrained method's automaton state after the last committed token.
    automaton: jax.Array | None = None

    buffers = ("draft_cache", "features")  # read on the device only (specjax.state)


def start_draft(draft_params, draft_config: ModelConfig, loop: DecodeLoop,
                state: DecodeState, prompt_features, tally: Tally) -> DecodeState:
    """``state`` after the target prefill, with a :class:`DraftState`: the draft's cache
    holding the prompt (one draft pass), the prompt's target features kept when the
    draft reads them (``prompt_features`` [P, F], else ``None``), the method's empty
    ``tally``."""
    features = None
    if prompt_features is not None:
        features = jnp.zeros((loop.capacity, prompt_features.shape[1]), prompt_features.dtype)
        features = features.at[: loop.prompt_bucket].set(prompt_features)
    kept = DraftState(draft_cache=None, tally=tally, features=features)
    cache = draft_prefill(draft_params, draft_config, loop, state, kept)
    return state.replace(method_state=kept.replace(draft_cache=cache),
                         draft_calls=state.draft_calls + 1)


def previous_features(draft_params, draft_config: ModelConfig, kept, positions: jax.Array):
    """What a feature draft reads beside the tokens at ``positions`` [T]: the target's
    features kept in ``kept.features`` (a :class:`DraftState`) at ``positions - 1`` (zeros
    at position 0), fused to [T, d] by a multi-layer draft
    (:func:`specjax.models.fuse_features`); ``None`` for other drafts."""
    if not draft_config.feature_input:
        return None
    rows = jnp.take(kept.features, jnp.maximum(positions - 1, 0), axis=0)
    rows = models.fuse_features(draft_params, draft_config, rows)
    return jnp.where((positions > 0)[:, None], rows, jnp.zeros_like(rows))


def commit_features(state: DecodeState, node_features: jax.Array, path: jax.Array):
    """The kept target features (``state.method_state.features``) with the accepted
    path's written from the root's position on ([max_depth + 1] rows; those past the
    accepted count are overwritten before any read)."""
    kept = state.method_state.features
    return jax.lax.dynamic_update_slice(kept, node_features[path].astype(kept.dtype),
                                        (state.length - 1, jnp.int32(0)))


def draft_prefill(draft_params, draft_config: ModelConfig, loop: DecodeLoop,
                  state: DecodeState, kept: DraftState):
    """A draft cache holding the prompt (the draft's own prefill; no head needed)."""
    cache = init_cache(draft_config, loop.capacity, draft_params["embed"].dtype)
    positions = jnp.arange(loop.prompt_bucket, dtype=jnp.int32)
    _, cache = models.hidden_states(draft_params, draft_config,
                                    state.tokens[: loop.prompt_bucket], positions, cache,
                                    attn_impl=loop.kernels,
                                    features=previous_features(draft_params, draft_config, kept,
                                                               positions))
    return advance(cache, state.prompt_length)


def draft_catch_up(draft_params, draft_config: ModelConfig, loop: DecodeLoop,
                   state: DecodeState, cache, chunk: int):
    """Brings a lagging draft cache up to the sequence, root (pending last token) included.

    One draft pass over the fixed ``chunk`` of tokens starting at ``cache.length`` (the
    tokens accepted by the last step; ``chunk`` must be at least the most tokens one step
    can emit). The head runs on the root's row only.

    Returns:
      (cache advanced to ``state.length``, the draft's logits [1, V] at the root, its
      hidden state [1, d] there: a feature draft's prediction of the root's feature).
    """
    tokens = jax.lax.dynamic_slice(state.tokens, (cache.length,), (chunk,))
    positions = cache.length + jnp.arange(chunk, dtype=jnp.int32)
    hidden, cache = models.hidden_states(draft_params, draft_config, tokens, positions,
                                         cache, attn_impl=loop.kernels,
                                         features=previous_features(draft_params, draft_config,
                                                                    state.method_state,
                                                                    positions))
    fresh = state.length - cache.length
    root_hidden = jax.lax.dynamic_index_in_dim(hidden, fresh - 1, keepdims=True)
    return (advance(cache, fresh), models.lm_head(draft_params, draft_config, root_hidden),
            root_hidden)
