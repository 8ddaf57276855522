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

The prefill samples the first new token under the constraint's initial state (every
method's prefill does, given the method's :meth:`constraint_of` tables); ``init`` starts
the automaton after it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import models
from specjax.cache import advance
from specjax.config import ModelConfig
from specjax.constraints import ConstraintTables, mask_logits, start_automaton
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
    uses_features = False
    feature_layers = ()

    def build_resources(self, draft_params=None, tables=None, constraint=None):
        """``None``, or constrained the constraint's tables."""
        del draft_params, tables
        return constraint if self.constrained else None

    def constraint_of(self, resources) -> ConstraintTables | None:
        return resources if self.constrained else None

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources,
             prompt_features) -> DecodeState:
        del params, loop, prompt_features
        if not self.constrained:
            return state
        return state.replace(method_state=ArState(automaton=start_automaton(resources, state)))

    def step(self, params, loop: DecodeLoop, state: DecodeState, resources) -> DecodeState:
        return ar_step(params, loop, state, resources if self.constrained else None)


# The method registry's entry (specjax.methods.REGISTRY): the options this module runs and
# the builder of its step object.
OPTIONS = (ArOptions,)


def build(options: ArOptions, draft_config: ModelConfig | None = None) -> Autoregressive:
    """The step object of ``ar`` (under a constraint the API sets ``constrained``, as for
    every method)."""
    del options, draft_config
    return Autoregressive()
