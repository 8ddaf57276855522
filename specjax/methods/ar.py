"""Autoregressive decoding (``method="ar"``): one target pass per token, the reference
every other method's output is checked against.

:class:`Autoregressive` is the static step object (options:
:class:`~specjax.methods.options.ArOptions`); it takes no resources and keeps no state of
its own (``DecodeState.method_state`` stays ``None``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import models
from specjax.cache import advance
from specjax.sampling import sample_tokens
from specjax.state import DecodeLoop, DecodeState, append_tokens, check_finite


def ar_step(params, loop: DecodeLoop, state: DecodeState) -> DecodeState:
    """One autoregressive step: feed the pending token, sample the next one."""
    position = state.length - 1
    token = jax.lax.dynamic_index_in_dim(state.tokens, position, keepdims=True)  # [1]
    logits, cache = models.forward(params, loop.config, token, position[None], state.cache,
                                   attn_impl=loop.kernels)
    state = state.replace(cache=advance(cache, 1), target_calls=state.target_calls + 1)
    state = check_finite(state, logits)
    new = sample_tokens(logits, state.sampling, state.length[None])
    return append_tokens(state, new, (~state.nonfinite).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Autoregressive:
    """The ``ar`` method: one target pass per token."""

    name: str = "ar"
    scratch: int = 1
    uses_features = False
    feature_layers = ()

    def build_resources(self, draft_params=None, tables=None) -> None:
        del draft_params, tables
        return None

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources,
             prompt_features) -> DecodeState:
        del params, loop, resources, prompt_features
        return state

    def step(self, params, loop: DecodeLoop, state: DecodeState, resources) -> DecodeState:
        del resources
        return ar_step(params, loop, state)
