"""What every speculative method shares: per-step statistics, keys, ranking, commit.

* :class:`Tally` -- the typed per-step statistics a speculative method carries in its
  state's ``tally`` (accepted-count histogram, origin of every token);
  :func:`specjax.api.generate` turns it into ``stats`` (:func:`tally_of`).
* :func:`step_key` -- the PRNG key of one step (fresh per position, never per call).
* :func:`rank_children` -- how a draft ranks the children it proposes, per verify rule.
* :func:`commit_step` -- keep the accepted path's K/V, append the emitted tokens, count
  them by origin.
* :func:`verify_tree` -- one target pass over a tree, then an acceptance rule of
  :mod:`specjax.verify` by name.
* :func:`tree_constraint` -- a constrained step's automaton states over its tree
  (``verify_tree`` masks with them, ``commit_step`` advances the automaton).
* :class:`PassPlan` -- the forward passes one step runs (for cost breakdowns).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax import models
from specjax.cache import commit_path
from specjax.constraints import advance as advance_automaton
from specjax.constraints import mask_logits, tree_states
from specjax.errors import InvalidArgumentError
from specjax.origins import NUM_ORIGINS, ORIGIN_TARGET
from specjax.sampling import (SamplingParams, by_temperature, perturbed_scores, sample_tokens,
                              target_log_probs)
from specjax.state import DecodeLoop, DecodeState, append_tokens, flag_nonfinite
from specjax.tree import Tree, ancestor_mask, depths
from specjax.verify import (Verdict, emitted_tokens, verify_choices, verify_match,
                            verify_rejection)


@struct.dataclass
class Tally:
    """Per-step statistics of a speculative method (all traced)."""

    accepted: jax.Array  # int32 [max_depth + 1]; [c]: steps that accepted c drafted tokens
    origins: jax.Array  # int8 [S]; origin code of every generated token, -1 elsewhere
    origin_counts: jax.Array  # int32 [NUM_ORIGINS]; emitted tokens per origin


class DraftFeatures:
    """What a method with a draft model tells the prefill and verify passes about the
    target features its draft reads (mixed into :class:`~specjax.methods.speculative.
    Speculative` and :class:`~specjax.methods.staged.Staged`; needs ``draft_config``)."""

    @property
    def uses_features(self) -> bool:
        """Whether the draft reads the target's features (the prefill then keeps them)."""
        return self.draft_config.feature_input

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target blocks whose outputs a multi-layer feature draft reads (static)."""
        return self.draft_config.feature_layers


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """The forward passes one step of a method runs, by size (static; read by the
    benchmarks to split a step's time into target pass, draft passes and the rest).

    Attributes:
      target_nodes: query rows of the step's one target pass (1 for ``ar``).
      draft_passes: one ``(rows, head_rows)`` per draft pass: query rows through the
        draft's blocks and rows through its head.
    """

    target_nodes: int = 1
    draft_passes: tuple[tuple[int, int], ...] = ()


def tally_of(state: DecodeState) -> Tally | None:
    """The tally in ``state``'s method state, or ``None`` for a method that keeps none
    (``ar``: every token is the target's)."""
    return getattr(state.method_state, "tally", None)


def init_tally(state: DecodeState, max_depth: int) -> Tally:
    """An empty tally, with the token the prefill sampled counted as the target's."""
    capacity = state.tokens.shape[0]
    first = state.prompt_length
    return Tally(accepted=jnp.zeros((max_depth + 1,), jnp.int32),
                 origins=jnp.full((capacity,), -1, jnp.int8).at[first].set(ORIGIN_TARGET),
                 origin_counts=jnp.zeros((NUM_ORIGINS,), jnp.int32).at[ORIGIN_TARGET].set(1))


def step_key(sampling: SamplingParams, length: jax.Array, tag: int) -> jax.Array:
    """The key of the step that starts at sequence length ``length``. It depends on (seed,
    length, method tag) only, so a step's randomness is reproducible from the request."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(sampling.seed), length),
                              tag)


def rank_children(logits: jax.Array, sampling: SamplingParams, child_positions: jax.Array,
                  verify: str, sample_key: jax.Array | None = None, argmax: bool = False):
    """How a draft ranks the children of E evaluated nodes; exactness never depends on it.

    ``greedy``/``coupled`` rank by ``log q~ + g_position`` (the Gumbel noise the target
    uses at that position, so at T > 0 the draft's best child is its guess of the target's
    coupled token), ``match`` and ``rejection`` by ``log q~``; with ``sample_key`` (the
    ``rejection`` rule over a fixed topology, or ``match`` drafting ``sampled``) by a fresh
    Gumbel perturbation, which makes the top children a sample without replacement. With
    ``argmax`` (``draft_ranking="argmax"``) every rule ranks by ``log q~``. At temperature
    0 by the logits.

    Args:
      logits: [E, V] draft logits.
      sampling: the request's sampling settings.
      child_positions: int32 [E], absolute positions of the children.
      verify: the verify rule.
      sample_key: key of a fresh perturbation (see above), or ``None``.
      argmax: rank by the draft's own probabilities, without noise (static).
    Returns:
      log-scores [E, V] (normalised per row).
    """

    def sampled(_):
        log_q = target_log_probs(logits, sampling)
        if argmax:
            scores = log_q
        elif verify in ("greedy", "coupled"):
            scores = perturbed_scores(log_q, sampling, child_positions)
        elif sample_key is not None:
            scores = log_q + jax.random.gumbel(sample_key, log_q.shape)
        else:
            scores = log_q
        return jax.nn.log_softmax(scores, axis=-1)

    def greedy(_):
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    return by_temperature(sampling, sampled, greedy, None)


def commit_step(state: DecodeState, tree: Tree, tree_origin: jax.Array, verdict: Verdict,
                target_cache, finite: jax.Array, draft_calls: int, kept,
                constraint=None) -> DecodeState:
    """Ends a speculative step: commits the accepted path, appends the emitted tokens (cut
    at a stop token and ``max_length``) and tallies them.

    Args:
      state: the state the step started from.
      tree: the verified tree; ``tree_origin`` int8 [N] the origin of each node's token.
      verdict: the verify rule's verdict.
      target_cache: the target cache holding the tree's K/V in scratch.
      finite: bool [], whether the valid nodes' target logits were all finite; if not,
        the step appends nothing and generation stops (:func:`specjax.state.flag_nonfinite`).
      draft_calls: draft passes this step ran (static).
      kept: the method's state after this step (e.g. its new draft cache) but for its
        ``tally`` and (under a constraint) its ``automaton``, which this updates.
      constraint: :func:`tree_constraint`'s pair, under a constraint (else ``None``).
    """
    if constraint is not None:  # the state after the accepted path and the next token
        tables, node_states = constraint
        kept = kept.replace(automaton=advance_automaton(
            tables, node_states[verdict.path[verdict.count - 1]], verdict.next_token))
    tokens = emitted_tokens(tree, verdict)
    slots = jnp.arange(tokens.shape[0])
    path_origin = tree_origin[jnp.concatenate([verdict.path[1:],
                                               jnp.zeros((1,), verdict.path.dtype)])]
    origin = jnp.where(slots == verdict.count - 1, ORIGIN_TARGET, path_origin).astype(jnp.int8)
    start = state.length
    state = state.replace(
        cache=commit_path(target_cache, verdict.path, verdict.count),
        target_calls=state.target_calls + 1,
        draft_calls=state.draft_calls + draft_calls)
    state = flag_nonfinite(state, finite)
    state = append_tokens(state, tokens, jnp.where(finite, verdict.count, 0))
    kept_slots = slots < state.length - start  # after stop tokens and max_length
    tally = kept.tally
    origins = jax.lax.dynamic_update_slice(tally.origins,
                                           jnp.where(kept_slots, origin, -1).astype(jnp.int8),
                                           (start,))
    counts = tally.origin_counts + jnp.sum(
        (origin[None, :] == jnp.arange(NUM_ORIGINS, dtype=jnp.int8)[:, None])
        & kept_slots[None, :], axis=1).astype(jnp.int32)
    accepted = tally.accepted.at[verdict.count - 1].add(1)
    tally = Tally(accepted=accepted, origins=origins, origin_counts=counts)
    return state.replace(method_state=kept.replace(tally=tally))


def verify_tree(params, loop: DecodeLoop, state: DecodeState, tree: Tree, max_depth: int,
                width: int, verify: str, key: jax.Array, draft_logp: jax.Array | None = None,
                children_mode: str = "deterministic", return_features: bool = False,
                feature_layers: tuple[int, ...] = (), constraint=None):
    """One target pass over ``tree`` (rooted at the pending last token), then the rule
    (on the target's logits masked per node by a constraint, when given).

    Args:
      params: target parameters; ``loop`` the static program description.
      state: the decode state (its cache holds the committed prefix).
      tree: the tree to verify (N nodes); ``max_depth`` and ``width`` its static bounds.
      verify: ``greedy``/``coupled`` (the target's coupled token after every node: what
        ``ar`` samples there), ``match`` or ``rejection``.
      key: the step's key (``match``/``rejection`` draw from it).
      draft_logp: [N, V] the draft's log q~ per node (``rejection`` only).
      children_mode: how the children were drafted (``rejection`` only).
      return_features: also return the target's features [N, d] of the nodes (static;
        for drafts that read them); with ``feature_layers`` the outputs of those target
        blocks [N, F*d] instead (a multi-layer feature draft's).
      constraint: ``(tables, node_states)``: a constraint's tables and the automaton's
        state after each node (:func:`specjax.constraints.tree_states`); the target's
        logits after each node are masked by its state, so every rule decides on the
        masked distributions (``ar``'s under the constraint).
    Returns:
      (verdict, target cache with the tree's K/V in scratch, whether the logits of the
      valid nodes were all finite), then the features when ``return_features``.
    """
    sampling = state.sampling
    node_depths = depths(tree.parents, max_depth)
    mask = ancestor_mask(tree.parents, tree.valid, max_depth)
    positions = state.length - 1 + node_depths
    out = models.forward(params, loop.config, tree.tokens, positions, state.cache, mask,
                         attn_impl=loop.kernels, return_features=return_features,
                         feature_layers=feature_layers)
    logits, cache = out[0], out[-1]
    finite = jnp.all(jnp.isfinite(logits) | ~tree.valid[:, None])  # before any mask
    if constraint is not None:
        logits = mask_logits(*constraint, logits)
    if verify in ("greedy", "coupled"):
        verdict = verify_choices(tree, sample_tokens(logits, sampling, positions + 1),
                                 max_depth)
    elif verify == "match":
        verdict = verify_match(tree, target_log_probs(logits, sampling), key, max_depth)
    elif verify == "rejection":
        verdict = verify_rejection(tree, target_log_probs(logits, sampling), draft_logp, key,
                                   max_depth, width, children_mode)
    else:
        raise InvalidArgumentError(f"unknown verify rule {verify!r}")
    if return_features:
        return verdict, cache, finite, out[1]
    return verdict, cache, finite


def tree_constraint(tables, automaton: jax.Array, tree: Tree, max_depth: int):
    """``verify_tree``'s ``constraint`` for a step under a constraint: ``(tables, the
    automaton's state after each node)``, from the state after the root (``automaton``);
    ``None`` without one (``tables`` None)."""
    if tables is None:
        return None
    return tables, tree_states(tables, automaton, tree.tokens, tree.parents, max_depth)

