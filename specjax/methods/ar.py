"""Autoregressive decoding (``method="ar"``): one target pass per token, the reference
every other method's output is checked against.

:class:`Autoregressive` is the static step object (options:
:class:`~specjax.methods.options.ArOptions`). Unconstrained it takes no resources and keeps
no state of its own (``DecodeState.method_state`` stays ``None``). Constrained
(``Autoregressive(constrained=True)``), its resources are a constraint's
:class:`~specjax.constraints.ConstraintTables` and its state an :class:`ArState`: the
automaton state of the sequence, after the last sampled token. Each token is then sampled
from the target's logits masked by that state (:func:`specjax.constraints.mask_logits`),
greedy or coupled alike, and the state advances over it.

The prefill samples the first new token without the constraint; a constrained ``init``
samples it again from the prompt's last logits, masked (the prefill keeps the final hidden
states over the prompt for it: ``uses_features``), and puts it in the first one's place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import models
from specjax.cache import advance
from specjax.config import ModelConfig
from specjax.constraints import INITIAL_STATE, ConstraintTables, mask_logits
from specjax.constraints import advance as advance_automaton
from specjax.methods.options import ArOptions
from specjax.sampling import sample_tokens
from specjax.state import DecodeLoop, DecodeState, append_tokens, check_finite


@struct.dataclass
class ArState:
    """The constrained ``ar`` method's state."""

    automaton: jax.Array  # int32 []: the constraint's state after the last sampled token


def ar_step(params, loop: DecodeLoop, state: DecodeState,
            tables: ConstraintTables | None = None) -> DecodeState:
    """One autoregressive step: feed the pending token, sample the next one (from the logits
    masked by ``state.method_state.automaton`` when ``tables`` is given)."""
    position = state.length - 1
    token = jax.lax.dynamic_index_in_dim(state.tokens, position, keepdims=True)  # [1]
    logits, cache = models.forward(params, loop.config, token, position[None], state.cache,
                                   attn_impl=loop.kernels)
    state = state.replace(cache=advance(cache, 1), target_calls=state.target_calls + 1)
    state = check_finite(state, logits)  # the target's own logits, before any mask
    if tables is not None:
        logits = mask_logits(tables, state.method_state.automaton, logits)
    new = sample_tokens(logits, state.sampling, state.length[None])
    if tables is not None:
        state = state.replace(method_state=ArState(
            automaton=advance_automaton(tables, state.method_state.automaton, new[0])))
    return append_tokens(state, new, (~state.nonfinite).astype(jnp.int32))


def constrained_first_token(params, loop: DecodeLoop, state: DecodeState,
                            tables: ConstraintTables, hidden: jax.Array) -> DecodeState:
    """Samples the first new token again, from the prompt's last logits masked by the
    constraint's initial state, in place of the prefill's unconstrained one.

    Args:
      params, loop: the target's parameters and the static loop.
      state: the state the prefill returned (one token appended, unless it stopped on
        non-finite logits).
      tables: the constraint's tables.
      hidden: float [P, F], the target's final-normed hidden states over the padded prompt.

    Returns:
      The state with the masked first token and an :class:`ArState`.
    """
    last = models.lm_head(params, loop.config, jax.lax.dynamic_index_in_dim(
        hidden, state.prompt_length - 1, keepdims=True))  # [1, V]
    start = jnp.int32(INITIAL_STATE)
    first = sample_tokens(mask_logits(tables, start, last), state.sampling,
                          state.prompt_length[None])
    # Undo the prefill's append (it set ``done`` only for a stop token, the length limit or
    # non-finite logits; the last stays) and append the masked token instead.
    state = state.replace(length=state.prompt_length, done=state.nonfinite,
                          method_state=ArState(automaton=advance_automaton(tables, start,
                                                                           first[0])))
    return append_tokens(state, first, (~state.nonfinite).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Autoregressive:
    """The ``ar`` method: one target pass per token.

    Attributes:
      constrained: sample under a constraint, whose tables are the resources (static: the
        tables themselves are traced, so constraints of one size bucket share a program).
    """

    name: str = "ar"
    scratch: int = 1
    constrained: bool = False
    feature_layers = ()

    @property
    def uses_features(self) -> bool:
        """Constrained, the prefill keeps the final hidden states over the prompt (the
        first token is sampled again from them, masked)."""
        return self.constrained

    def build_resources(self, draft_params=None, tables=None) -> None:
        del draft_params, tables
        return None

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources,
             prompt_features) -> DecodeState:
        if not self.constrained:
            return state
        return constrained_first_token(params, loop, state, resources, prompt_features)

    def step(self, params, loop: DecodeLoop, state: DecodeState, resources) -> DecodeState:
        return ar_step(params, loop, state, resources if self.constrained else None)


# The method registry's entry (specjax.methods.REGISTRY): the options this module runs and
# the builder of its step object.
OPTIONS = (ArOptions,)


def build(options: ArOptions, draft_config: ModelConfig | None = None) -> Autoregressive:
    """The step object of ``ar`` (a constrained request builds its own: the API's)."""
    del options, draft_config
    return Autoregressive()
