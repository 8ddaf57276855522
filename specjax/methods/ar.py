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

Jump-forward (``jump_forward`` = F > 0; the default on a GPU or TPU, 0 on the CPU): a
state that allows one token only (:func:`specjax.constraints.forced_token`) needs no target
pass to choose it, since masked logits with one finite entry sample that token at any
temperature and with any noise. A step first follows the forced run after the pending
token (at most F tokens, and no further than the budget), then runs one target pass over
the pending token and the run (causal; of 1, 2 or F + 1 rows, the fewest that hold them: a
``lax.switch``, which a batch's ``vmap`` turns into every pass and a select) and samples
the next token from the logits after the run's last token, with the noise of its own
position. The tokens are those of one pass per token, computed by a pass of several rows
instead of several passes of one: on the CPU that may round differently in the last bits,
as a speculative verify pass may (:mod:`specjax.methods.exactness`). A forced token is
appended only if the logits before it were finite, as one pass per token would check (a
non-finite row may also spoil the rows before it in the same pass, through attention
weights of zero: generation then stops a few tokens earlier than one pass per token would;
it stops, and reports it, either way). ``ArState.forced`` counts the forced tokens
committed (``stats["forced_tokens"]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import models
from specjax.cache import advance
from specjax.config import ModelConfig
from specjax.constraints import ConstraintTables, forced_token, mask_logits, start_automaton
from specjax.constraints import advance as advance_automaton
from specjax.methods.options import ArOptions
from specjax.sampling import sample_tokens
from specjax.state import (DecodeLoop, DecodeState, append_tokens, check_finite,
                           flag_nonfinite)


@struct.dataclass
class ArState:
    """The constrained ``ar`` method's state."""

    automaton: jax.Array  # int32 []: the constraint's state after the last sampled token
    forced: jax.Array  # int32 []: forced tokens committed without a pass of their own


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
        state = state.replace(method_state=state.method_state.replace(
            automaton=advance_automaton(tables, state.method_state.automaton, new[0])))
    return append_tokens(state, new, (~state.nonfinite).astype(jnp.int32))


def forced_run(tables: ConstraintTables, automaton: jax.Array, room: jax.Array,
               width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The run of forced tokens after ``automaton`` (each state allowing one token only).

    Args:
      tables: the constraint's tables; ``automaton`` int32 [] the state to start from.
      room: int32 [], the most tokens the run may hold (the budget left).
      width: the most it holds (static).
    Returns:
      (int32 [width] its tokens, 0 past its end; int32 [] its length; the state after it).
    """
    tokens, count, state, alive = [], jnp.int32(0), automaton, jnp.bool_(True)
    for index in range(width):
        token = forced_token(tables, state)
        alive = alive & (token >= 0) & (index < room)
        tokens.append(jnp.where(alive, token, 0))
        state = jnp.where(alive, advance_automaton(tables, state, token), state)
        count = count + alive.astype(jnp.int32)
    return jnp.stack(tokens), count, state


def pass_sizes(width: int) -> tuple[int, ...]:
    """The row counts of the target passes a jump-forward step picks from (static): one
    (nothing forced), two (one forced token: on a BPE vocabulary the common case, a
    separator; the text of a longer forced string has several tokenizations, so few states
    force a token) and ``1 + width``. Each is a forward pass compiled into the program, so
    no more: on the CPU a pass's cost grows with its rows."""
    return tuple(sorted({1, 2, 1 + width}))


def jump_forward_step(params, loop: DecodeLoop, state: DecodeState, tables: ConstraintTables,
                      width: int) -> DecodeState:
    """One constrained step that commits the forced run after the pending token (at most
    ``width`` tokens) and the token sampled after it, with one target pass (module
    docstring)."""
    run, count, after = forced_run(tables, state.method_state.automaton,
                                   state.max_length - state.length, width)
    position = state.length - 1
    feed = jnp.concatenate([jax.lax.dynamic_slice(state.tokens, (position,), (1,)), run])
    positions = position + jnp.arange(width + 1, dtype=jnp.int32)
    rows = jnp.arange(width + 1)

    def target_pass(size: int):
        def run_pass(_):
            logits, cache = models.forward(params, loop.config, feed[:size], positions[:size],
                                           state.cache, attn_impl=loop.kernels)
            finite = jnp.ones((width + 1,), bool).at[:size].set(
                jnp.all(jnp.isfinite(logits), axis=-1))
            return jax.lax.dynamic_index_in_dim(logits, count, keepdims=True), finite, cache
        return run_pass

    sizes = pass_sizes(width)  # the smallest that holds the pending token and the run
    which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), count + 1)
    last, finite, cache = jax.lax.switch(which, [target_pass(size) for size in sizes], None)
    bad = ~finite & (rows <= count)  # a row's logits choose the token after it
    lead = jnp.where(jnp.any(bad), jnp.argmax(bad), count + 1)  # rows finite from the first
    new = sample_tokens(mask_logits(tables, after, last), state.sampling,
                        (state.length + count)[None])
    tokens = jnp.where(rows < count, jnp.concatenate([run, new]), new[0])
    start = state.length
    state = state.replace(cache=advance(cache, count + 1), target_calls=state.target_calls + 1)
    state = append_tokens(state, tokens, lead)
    # Non-finite logits stop generation where one pass per token would have seen them: at
    # the first such row, unless the tokens before it already ended the generation.
    state = flag_nonfinite(state, (lead > count) | state.done)
    kept = state.method_state
    return state.replace(method_state=kept.replace(
        automaton=advance_automaton(tables, after, new[0]),
        forced=kept.forced + jnp.minimum(count, state.length - start)))


@dataclasses.dataclass(frozen=True)
class Autoregressive:
    """The ``ar`` method: one target pass per token (under a constraint with
    ``jump_forward``, one per sampled token: forced runs ride along).

    Attributes:
      constrained: sample under a constraint, whose tables are the resources (static: the
        tables themselves are traced, so constraints of one size bucket share a program).
      jump_forward: under a constraint, the most forced tokens one pass commits beside its
        sampled one (module docstring); 0: one pass per token.
    """

    name: str = "ar"
    constrained: bool = False
    jump_forward: int = 0
    uses_features = False
    feature_layers = ()

    @property
    def jumps(self) -> bool:
        """Whether a step commits forced runs (constrained, ``jump_forward`` > 0)."""
        return self.constrained and self.jump_forward > 0

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write."""
        return 1 + (self.jump_forward if self.jumps else 0)

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
        return state.replace(method_state=ArState(automaton=start_automaton(resources, state),
                                                  forced=jnp.int32(0)))

    def step(self, params, loop: DecodeLoop, state: DecodeState, resources) -> DecodeState:
        if self.jumps:
            return jump_forward_step(params, loop, state, resources, self.jump_forward)
        return ar_step(params, loop, state, resources if self.constrained else None)


# The method registry's entry (specjax.methods.REGISTRY): the options this module runs and
# the builder of its step object.
OPTIONS = (ArOptions,)


def build(options: ArOptions, draft_config: ModelConfig | None = None) -> Autoregressive:
    """The step object of ``ar`` (under a constraint the API sets ``constrained``, as for
    every method)."""
    del draft_config
    return Autoregressive(jump_forward=options.jump_forward)
