"""Staged speculative decoding (Spector & Re 2023): a draft model sped up by stage 2.

Two methods, both hashable static objects (built from their options,
:class:`~specjax.methods.options.StagedOptions` and
:class:`~specjax.methods.options.NgramOptions`) run by the drivers in
:mod:`specjax.decode`:

* :class:`Staged` (``method="staged"``): the draft model builds the target's tree, helped
  by a stage-2 drafter (n-gram tables + context lookup, :mod:`specjax.drafters`);
* :class:`NgramOnly` (``method="ngram"``): the stage-2 proposal tree goes straight to the
  target; no draft model.

One staged step, all in static shapes:

1. **First pass** (catch-up + stage 2): stage 2 proposes a small tree of fixed
   ``proposal`` shape continuing the sequence from the root (the pending last token). One
   draft pass runs the tokens the draft lags by (those accepted last step, root
   included) *and* the proposal (tree mask), so it both brings the draft cache up to the
   root and scores every proposal node. The draft then walks down the proposal from the
   root, following the child that equals its own best token at each node; the matched
   nodes form the *spine*.
2. **Later rounds** (``rounds - 1`` of them, static). At the spine's end ``e`` the draft's
   best child ``x`` (its "own" token) is appended; stage 2 proposes a tree continuing the
   sequence + spine + ``x``; the draft scores ``x`` and the proposal in one pass (the
   spine is visible through the scratch mask) and walks it as above.
3. **Select**: the candidates are every scored node (the root, proposal nodes, own
   tokens) and each one's top-``width`` children by the draft's ranking. A node's score is
   its cumulative draft log-probability, where a stage-2 proposal's per-token term is
   floored by a prior for its origin (``lookup_prior``, ``ngram_prior``): a weak draft then
   cannot veto a long context-lookup match. The target tree is the best ``budget``
   candidates (prefix-closed), as in the paper.
4. **Verify** with one target pass and any exact rule (``coupled`` by default at T > 0),
   then **commit** the accepted path.

**Feature drafts** (``draft_config.feature_input``, EAGLE-style, see
:mod:`specjax.methods.speculative`): a drafted node should read the feature the draft
predicted for its parent, but a pass scores a whole proposal tree at once, its parents
included. So the catch-up rows read the target's features (as in ``spec``), a later
round's own token reads the output of the spine end it continues (exact), and every
proposal node reads the feature its pass's node 0 reads (one or more positions stale).
This changes only how well the draft ranks proposals below their first level; the
verification is the same, so the output is too.

**Under a constraint** every stage-2 proposal keeps the tokens the automaton allows after
the spine above it, a forced token first (:func:`~specjax.drafters.ngram.propose`, as in
``ngram``), and the draft's ranking of each pass node's children is masked by the node's
state (as ``spec``'s draft), so the spine, the draft's own tokens and the candidates are
all allowed; a forced run becomes the spine. The verify pass masks the target's logits per
node, which alone keeps the output ``ar``'s.

A step costs ``rounds`` draft passes and one target pass. The draft may score only a
subset of the vocabulary (:meth:`specjax.Model.with_head_subset`; the shipped draft does),
which makes its passes cheaper without touching exactness.

Ranking of children (exactness never depends on it): ``greedy``/``coupled`` rank by
``log q~ + g_position`` (the same Gumbel noise the target uses), ``match`` and
``rejection`` by ``log q~``. The tree is a deterministic function of the draft and the
context, so ``rejection`` runs in ``deterministic`` children mode.

Token origins: each emitted token is counted as proposed by the n-gram tables, context
lookup, the draft model, or the target (the token the target adds after the accepted
path). The method state's ``tally`` (:class:`~specjax.methods.common.Tally`) holds the
origin of every generated token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import models
from specjax.cache import advance
from specjax.config import ModelConfig
from specjax.constraints import advance as advance_automaton
from specjax.constraints import mask_logits, start_automaton, tree_states
from specjax.drafters.model import commit_features, previous_features, start_draft
from specjax.drafters.ngram import NgramTables, propose
from specjax.methods.common import (DraftFeatures, PassPlan, Tally, commit_step, init_tally,
                                    rank_children, step_key, tree_constraint,
                                    verify_tree)
from specjax.methods.options import NgramOptions, StagedOptions
from specjax.origins import ORIGIN_DRAFT, ORIGIN_LOOKUP, ORIGIN_TARGET
from specjax.sampling import top_k
from specjax.state import DecodeLoop, DecodeState
from specjax.tree import Tree, ancestor_mask, select_top_indices, select_top_nodes

_KEY_TAG = 0x57A6


@struct.dataclass
class StagedResources:
    """What ``staged`` decodes with."""

    draft_params: dict | None  # the draft model's parameter tree (None: constrained ngram)
    tables: NgramTables  # stage-2 n-gram tables
    constraint: Any = None  # a constraint's ConstraintTables (constrained), or None


@struct.dataclass
class NgramState:
    """The state of ``ngram`` in ``DecodeState.method_state`` (``staged`` keeps a
    :class:`~specjax.drafters.model.DraftState`)."""

    tally: Tally  # per-step statistics
    automaton: jax.Array | None = None  # int32 []: constrained, the automaton's state


def _log(probability: float) -> float:
    return float(np.log(probability)) if probability > 0 else -np.inf


def _static_parents(proposal: tuple[int, ...]) -> np.ndarray:
    """Parents of a proposal tree (see :func:`specjax.drafters.ngram.propose`): level 1
    hangs under the sequence end (-1), level l + 1 under the first node of level l."""
    parents, first = [], -1
    for level, n in enumerate(proposal):
        parents += [first] * n
        first = sum(proposal[:level])
    return np.asarray(parents, np.int32)


def _pass_parents(proposal: tuple[int, ...]) -> np.ndarray:
    """Pass-local parents: node 0 (root or the draft's own token), then the proposal
    hanging under it."""
    static = _static_parents(proposal)
    return np.concatenate([[-1], np.where(static < 0, 0, static + 1)]).astype(np.int32)


def _proposal_depths(proposal: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([np.full(n, level + 1, np.int32) for level, n in enumerate(proposal)])


def walk_proposal(proposal: tuple[int, ...], pass_tokens, pass_valid, best_child, history,
                  visible, history_at, visible_at):
    """Walks down a draft pass's proposal from pass-local node 0 along the draft's own best
    tokens; matched nodes join the spine.

    At level ``l`` the walk moves to the first valid node whose parent is the current node
    and whose token is the draft's best child of it, and stops at the first level with
    none. Only a level's first node has children (:func:`_pass_parents`), so level ``l``
    can be reached only through level ``l - 1``'s first node: every level's match is
    computed at once and the walk is the run of levels that match, each through its
    parent. No per-level chain of scatters, which on a GPU would be launches one after
    another.

    Args:
      proposal: the stage-2 proposal shape (static).
      pass_tokens, pass_valid: [S] the pass's nodes (local 0 first).
      best_child: int32 [S], the draft's best child token of each pass node.
      history, visible: the spine's tokens and the draft's visible scratch slots; matched
        level ``l`` writes ``history[history_at + l]`` and ``visible[visible_at + node]``.
    Returns:
      (last node, levels matched, history, visible).
    """
    parents = _pass_parents(proposal)
    first = 1 + np.cumsum([0] + list(proposal))[:-1]  # each level's first pass node
    depth, width = len(proposal), max(proposal)
    nodes = first[:, None] + np.minimum(np.arange(width)[None, :],
                                        np.asarray(proposal)[:, None] - 1)  # [depth, width]
    real = np.arange(width)[None, :] < np.asarray(proposal)[:, None]
    level_parent = parents[first]  # static: every node of a level has this parent
    hit = (real & pass_valid[nodes]
           & (pass_tokens[nodes] == best_child[level_parent][:, None]))  # [depth, width]
    chosen = jnp.asarray(first, jnp.int32) + jnp.argmax(hit, axis=1).astype(jnp.int32)
    reached = jnp.concatenate([jnp.ones(1, bool), chosen[:-1] == level_parent[1:]])
    alive = jnp.cumprod(jnp.any(hit, axis=1) & reached).astype(bool)  # [depth]
    matched = jnp.sum(alive, dtype=jnp.int32)
    node = jnp.where(matched > 0, chosen[jnp.maximum(matched - 1, 0)], 0)
    history = history.at[jnp.where(alive, history_at + jnp.arange(depth), history.shape[0])].set(
        pass_tokens[chosen], mode="drop")
    visible = visible.at[jnp.where(alive, visible_at + chosen, visible.shape[0])].set(
        True, mode="drop")
    return node, matched, history, visible


@dataclasses.dataclass(frozen=True)
class NgramOnly:
    """``method="ngram"``: the stage-2 proposal (n-gram + context lookup) verified directly
    by the target, no draft model. The target tree has ``1 + sum(proposal)`` nodes; the
    ``rejection`` rule runs in ``deterministic`` children mode."""

    options: NgramOptions = NgramOptions()
    constrained: bool = False  # resources: StagedResources without a draft, and a constraint

    name = "ngram"
    uses_features = False
    feature_layers = ()

    @property
    def proposal(self) -> tuple[int, ...]:
        return self.options.proposal

    @property
    def max_depth(self) -> int:
        return len(self.proposal)

    @property
    def budget(self) -> int:
        return 1 + sum(self.proposal)

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write."""
        return max(self.budget, self.max_depth + 1) + 1

    @property
    def pass_plan(self) -> PassPlan:
        return PassPlan(target_nodes=self.budget)

    def build_resources(self, draft_params=None, tables=None, constraint=None):
        """The n-gram tables; constrained, with the constraint (:class:`StagedResources`
        without a draft)."""
        del draft_params
        if self.constrained:
            return StagedResources(draft_params=None, tables=tables, constraint=constraint)
        return tables

    def constraint_of(self, resources):
        return resources.constraint if self.constrained else None

    def _tables(self, resources) -> NgramTables:
        return resources.tables if self.constrained else resources

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources,
             prompt_features) -> DecodeState:
        del params, loop, prompt_features
        kept = NgramState(tally=init_tally(state, self.max_depth))
        if self.constrained:
            kept = kept.replace(automaton=start_automaton(resources.constraint, state))
        return state.replace(method_state=kept)

    def step(self, params, loop: DecodeLoop, state: DecodeState, resources) -> DecodeState:
        key = step_key(state.sampling, state.length, _KEY_TAG)
        automaton = None
        if self.constrained:  # the proposal keeps the tokens the automaton allows
            automaton = (resources.constraint, state.method_state.automaton)
        prop = propose(self._tables(resources), state.tokens, state.length, self.proposal,
                       use_lookup=self.options.use_lookup, automaton=automaton)
        root = state.tokens[state.length - 1]
        tree = Tree(tokens=jnp.concatenate([root[None], prop.tokens]),
                    parents=jnp.concatenate([jnp.array([-1], jnp.int32),
                                             jnp.where(prop.parents < 0, 0, prop.parents + 1)]),
                    valid=jnp.concatenate([jnp.array([True]), prop.valid]))
        origin = jnp.concatenate([jnp.array([ORIGIN_TARGET], jnp.int8), prop.origin])
        constraint = tree_constraint(self.constraint_of(resources),
                                     state.method_state.automaton, tree, self.max_depth)
        verdict, cache, finite = verify_tree(params, loop, state, tree, self.max_depth,
                                             max(self.proposal), self.options.verify, key,
                                             constraint=constraint)
        return commit_step(state, tree, origin, verdict, cache, finite, 0, state.method_state,
                           constraint)


@dataclasses.dataclass(frozen=True)
class Staged(DraftFeatures):
    """``method="staged"``: draft model + stage 2 (see the module docstring).

    Attributes:
      options: the :class:`~specjax.methods.options.StagedOptions`: ``tree_budget`` (N,
        target tree nodes per target pass, root included), ``draft_rounds`` (R, draft
        passes per step, the first also catching the draft up), ``proposal`` (per-level
        candidates of each stage-2 proposal tree), ``draft_width`` (W, children recorded
        per spine node), ``verify``, ``use_lookup``, and ``stage2_prior``: floors, as
        probabilities in [0, 1), of the per-token score of a proposal node that came from
        context lookup / the n-gram tables (its score is ``log max(q~(token), prior)``; a
        weak draft would otherwise veto good stage-2 proposals; ranking only).
      draft_config: the draft model's config.
    """

    options: StagedOptions
    draft_config: ModelConfig
    constrained: bool = False  # decodes under a constraint (its tables in the resources)

    name = "staged"

    # Shorthands for the options the step reads.
    budget = property(lambda self: self.options.tree_budget)
    rounds = property(lambda self: self.options.draft_rounds)
    width = property(lambda self: self.options.draft_width)
    proposal = property(lambda self: self.options.proposal)
    verify = property(lambda self: self.options.verify)
    use_lookup = property(lambda self: self.options.use_lookup)
    lookup_prior = property(lambda self: self.options.stage2_prior[0])
    ngram_prior = property(lambda self: self.options.stage2_prior[1])
    pass_size = property(lambda self: self.options.pass_size)
    num_candidates = property(lambda self: self.options.num_candidates)

    @property
    def max_spine(self) -> int:
        """Most spine nodes (root included) one step can build."""
        return 1 + len(self.proposal) + (self.rounds - 1) * (1 + len(self.proposal))

    @property
    def max_depth(self) -> int:
        """Deepest possible target tree node (a child of the last spine node)."""
        return self.max_spine

    @property
    def chunk(self) -> int:
        """Catch-up rows of the first pass: at least the most tokens one step emits."""
        return self.max_depth + 1

    @property
    def window(self) -> int:
        """Draft scratch slots one step writes: catch-up chunk, first proposal, rounds."""
        return self.chunk + sum(self.proposal) + (self.rounds - 1) * self.pass_size

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write (target or draft)."""
        return max(self.budget, self.window, self.max_depth + 1) + 1

    @property
    def pass_plan(self) -> PassPlan:
        """The first pass (catch-up chunk + proposal; head on the root and the proposal),
        then ``rounds - 1`` passes of the draft's own token + a proposal."""
        n_prop = sum(self.proposal)
        passes = [(self.chunk + n_prop, 1 + n_prop)]
        passes += [(self.pass_size, self.pass_size)] * (self.rounds - 1)
        return PassPlan(target_nodes=self.budget, draft_passes=tuple(passes))

    # ------------------------------------------------------------------ method protocol

    def _rank(self, logits, sampling, child_positions, states=None):
        """Ranking log-scores [E, V] for the children of E evaluated nodes; under a
        constraint (``states``: its tables and each node's state) the tokens it forbids
        score ``-inf``."""
        if states is not None:
            logits = mask_logits(*states, logits)
        return rank_children(logits, sampling, child_positions, self.verify)

    def _start(self, resources: StagedResources, state: DecodeState):
        """Under a constraint, ``(tables, the automaton's state after the root)``; else
        ``None``."""
        if not self.constrained:
            return None
        return resources.constraint, state.method_state.automaton

    @staticmethod
    def _continued(states, node, token):
        """``(tables, state)``: the automaton's state after pass node ``node``, then
        ``token``, from a pass's :meth:`_pass_states` (``None`` without a constraint)."""
        if states is None:
            return None
        tables, node_states = states
        return tables, advance_automaton(tables, node_states[node], token)

    def _pass_states(self, start, pass_tokens):
        """Under a constraint (``start``: its tables and the state after pass node 0, the
        root or the draft's own token), ``(tables, the state after each pass node)``;
        ``None`` without one."""
        if start is None:
            return None
        tables, first_state = start
        return tables, tree_states(tables, first_state, pass_tokens,
                                   jnp.asarray(_pass_parents(self.proposal)),
                                   len(self.proposal))

    def build_resources(self, draft_params=None, tables=None,
                        constraint=None) -> StagedResources:
        return StagedResources(draft_params=draft_params, tables=tables,
                               constraint=constraint if self.constrained else None)

    def constraint_of(self, resources: StagedResources):
        return resources.constraint if self.constrained else None

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources: StagedResources,
             prompt_features) -> DecodeState:
        """Prefills the draft cache with the prompt; keeps the prompt's target features for
        a feature draft; starts a constraint's automaton after the prefill's token."""
        del params
        state = start_draft(resources.draft_params, self.draft_config, loop, state,
                            prompt_features, init_tally(state, self.max_depth))
        if not self.constrained:
            return state
        return state.replace(method_state=state.method_state.replace(
            automaton=start_automaton(resources.constraint, state)))

    def _pass_candidates(self, pass_tokens, pass_valid, pass_origin, rank, first_parent,
                         first_score, base: int):
        """Candidates of one draft pass: its S nodes (local 0 is the root or the draft's own
        token, the rest the stage-2 proposal hanging under it, with static pass-local
        parents) and each node's top-W children, as candidates ``base ..``.

        A node's score is its parent's score plus the parent's ranking of its token,
        floored by the stage-2 prior of the proposal's origin. Children that duplicate a
        pass node under the same parent are dropped (the pass node carries that token).
        """
        width, size = self.width, pass_tokens.shape[0]
        parents_np = _pass_parents(self.proposal)
        node_scores, node_tokens = top_k(rank, width)  # [S, W]
        prior = jnp.where(pass_origin[1:] == ORIGIN_LOOKUP, _log(self.lookup_prior),
                          _log(self.ngram_prior))
        step_scores = jnp.maximum(rank[parents_np[1:], pass_tokens[1:]], prior)
        pass_scores = jnp.zeros((size,), jnp.float32).at[0].set(first_score)
        for i in range(1, size):
            pass_scores = pass_scores.at[i].set(pass_scores[int(parents_np[i])]
                                                + step_scores[i - 1])
        pass_ok = pass_valid & jnp.isfinite(pass_scores)
        pass_cand = base + jnp.arange(size, dtype=jnp.int32)
        child_cand = (base + size
                      + jnp.arange(size * width, dtype=jnp.int32).reshape(size, width))
        same_parent = parents_np[None, :] == np.arange(size)[:, None]  # [S, S]
        dup = jnp.any(same_parent[:, None, :] & pass_ok[None, None, :]
                      & (node_tokens[:, :, None] == pass_tokens[None, None, :]), axis=-1)
        parents = jnp.where(np.arange(size) == 0, first_parent,
                            base + jnp.asarray(np.maximum(parents_np, 0)))
        candidates = dict(
            tokens=[pass_tokens, node_tokens.reshape(-1)],
            parents=[parents, jnp.repeat(pass_cand, width)],
            scores=[pass_scores, (pass_scores[:, None] + node_scores).reshape(-1)],
            valid=[pass_ok, (pass_ok[:, None] & ~dup & jnp.isfinite(node_scores)).reshape(-1)],
            origin=[pass_origin, jnp.full((size * width,), ORIGIN_DRAFT, jnp.int8)])
        nodes = dict(cand=pass_cand, scores=pass_scores, child_cand=child_cand,
                     child_scores=node_scores, child_tokens=node_tokens)
        return candidates, nodes

    def _select(self, cands: dict, kill: jax.Array) -> tuple[Tree, jax.Array]:
        """The target tree: the best ``budget`` candidates (prefix-closed) of every pass,
        but those in ``kill``, and the origin int8 [N] of each node's token."""
        cand_tokens, cand_parents = jnp.concatenate(cands["tokens"]), jnp.concatenate(
            cands["parents"])
        cand_scores, cand_origin = jnp.concatenate(cands["scores"]), jnp.concatenate(
            cands["origin"])
        cand_valid = jnp.concatenate(cands["valid"]) & ~kill
        cand_valid = cand_valid & jnp.isfinite(cand_scores)
        # select_top_nodes orders nodes exactly as select_top_indices does.
        tree = select_top_nodes(cand_parents, cand_scores, cand_tokens, cand_valid, self.budget)
        tree_origin = cand_origin[select_top_indices(cand_parents, cand_scores, cand_valid,
                                                     self.budget)]
        return tree, tree_origin

    def step(self, params, loop: DecodeLoop, state: DecodeState,
             resources: StagedResources) -> DecodeState:
        sampling, config = state.sampling, self.draft_config
        draft_params, tables = resources.draft_params, resources.tables
        width, size, depth_p = self.width, self.pass_size, len(self.proposal)
        chunk, n_prop = self.chunk, sum(self.proposal)
        root_position = state.length - 1
        key = step_key(sampling, state.length, _KEY_TAG)
        cache = state.method_state.draft_cache
        fresh = state.length - cache.length  # tokens the draft lags by, root included
        proposal_depth = _proposal_depths(self.proposal)
        proposal_parents = _static_parents(self.proposal)
        local_depth = np.concatenate([[0], proposal_depth])  # pass-local node depths
        pass_mask_parents = jnp.asarray(_pass_parents(self.proposal))

        # 1. First pass: catch the draft up to the root and score the root's stage-2
        # proposal, in one pass. Rows: `chunk` catch-up tokens (the first `fresh` real),
        # then the proposal; the head runs on the root's row and the proposal's rows.
        # Under a constraint the proposals and the draft's ranking keep what it allows.
        start = self._start(resources, state)
        prop = propose(tables, state.tokens, state.length, self.proposal,
                       use_lookup=self.use_lookup, automaton=start)
        pass_tokens = jnp.concatenate([state.tokens[root_position][None], prop.tokens])
        pending = jax.lax.dynamic_slice(state.tokens, (cache.length,), (chunk,))
        seen = jnp.arange(chunk) < fresh
        mask = jnp.concatenate([
            jnp.concatenate([models.causal_mask(chunk), jnp.zeros((chunk, n_prop), bool)], 1),
            jnp.concatenate([jnp.broadcast_to(seen, (n_prop, chunk)),
                             ancestor_mask(jnp.asarray(proposal_parents), prop.valid, depth_p)],
                            1)])
        positions = jnp.concatenate([cache.length + jnp.arange(chunk, dtype=jnp.int32),
                                     root_position + jnp.asarray(proposal_depth)])
        features = None
        if self.uses_features:  # the proposal reads what the root reads (module docstring)
            features = previous_features(
                draft_params, config, state.method_state,
                jnp.concatenate([positions[:chunk],
                                 jnp.full((n_prop,), root_position, jnp.int32)]))
        hidden, cache = models.hidden_states(draft_params, config,
                                             jnp.concatenate([pending, prop.tokens]), positions,
                                             cache, mask, attn_impl=loop.kernels,
                                             features=features)
        rows = jnp.concatenate([jax.lax.dynamic_index_in_dim(hidden, fresh - 1, keepdims=True),
                                hidden[chunk:]])
        pass_hidden = rows  # [S, d]: each pass node's output (a feature draft's prediction)
        logits = models.lm_head(draft_params, config, rows)  # [1 + P, V]
        states = self._pass_states(start, pass_tokens)
        rank = self._rank(logits, sampling, root_position + jnp.asarray(local_depth) + 1,
                          states)
        pass_valid = jnp.concatenate([jnp.array([True]), prop.valid])
        pass_origin = jnp.concatenate([jnp.array([ORIGIN_TARGET], jnp.int8), prop.origin])
        cands, nodes = self._pass_candidates(pass_tokens, pass_valid, pass_origin, rank,
                                             jnp.int32(-1), jnp.float32(0.0), 0)
        # Draft scratch: the catch-up rows (visible while real), the first proposal, then
        # each later round's pass; `visible` marks the spine's slots.
        visible = jnp.concatenate([seen, jnp.zeros((self.window - chunk,), jnp.bool_)])
        node, matched, history, visible = walk_proposal(
            self.proposal, pass_tokens, pass_valid, nodes["child_tokens"][:, 0], state.tokens,
            visible, state.length, chunk - 1)
        count = 1 + matched  # spine nodes so far (root included)
        kill = jnp.zeros((self.num_candidates,), jnp.bool_)  # duplicates found later
        base = (1 + n_prop) * (1 + width)

        # 2. Later rounds: the draft's own best child of the spine end + a stage-2 proposal
        # continuing after it, scored in one pass that sees the spine's scratch slots.
        for r in range(1, self.rounds):
            end_cand, end_score = nodes["cand"][node], nodes["scores"][node]
            own, own_score = nodes["child_tokens"][node, 0], nodes["child_scores"][node, 0]
            kill = kill.at[nodes["child_cand"][node, 0]].set(True)  # `own` is pass node 0
            history = history.at[state.length - 1 + count].set(own, mode="drop")
            start = self._continued(states, node, own)  # after the spine's end and `own`
            prop = propose(tables, history, state.length + count, self.proposal,
                           use_lookup=self.use_lookup, automaton=start)
            pass_tokens = jnp.concatenate([own[None], prop.tokens])
            pass_valid = jnp.concatenate([jnp.array([True]), prop.valid])
            offset = chunk + n_prop + (r - 1) * size
            positions = root_position + count + jnp.asarray(local_depth)
            mask = ancestor_mask(pass_mask_parents, pass_valid, depth_p)
            scratch_mask = jnp.broadcast_to(visible[None, :offset], (size, offset))
            features = None
            if self.uses_features:  # the spine end's output (module docstring)
                features = jnp.broadcast_to(pass_hidden[node], (size, pass_hidden.shape[1]))
            out = models.forward(draft_params, config, pass_tokens, positions, cache, mask,
                                 scratch_mask, attn_impl=loop.kernels, features=features,
                                 return_features=self.uses_features)
            logits, cache = out[0], out[-1]
            if self.uses_features:
                pass_hidden = out[1]
            states = self._pass_states(start, pass_tokens)
            rank = self._rank(logits, sampling, positions + 1, states)
            round_cands, nodes = self._pass_candidates(
                pass_tokens, pass_valid,
                jnp.concatenate([jnp.array([ORIGIN_DRAFT], jnp.int8), prop.origin]), rank,
                end_cand, end_score + own_score, base)
            for name in cands:
                cands[name] += round_cands[name]
            visible = visible.at[offset].set(True)
            node, matched, history, visible = walk_proposal(
                self.proposal, pass_tokens, pass_valid, nodes["child_tokens"][:, 0], history,
                visible, state.length + count, offset)
            count = count + 1 + matched
            base += size * (1 + width)
        cache = advance(cache, fresh)

        # 3. Select the target tree.
        tree, tree_origin = self._select(cands, kill)

        # 4. Verify (masked per node under a constraint) and commit.
        constraint = tree_constraint(self.constraint_of(resources),
                                     state.method_state.automaton, tree, self.max_depth)
        verified = verify_tree(params, loop, state, tree, self.max_depth, width, self.verify,
                               key, return_features=self.uses_features,
                               feature_layers=self.feature_layers, constraint=constraint)
        verdict, target_cache, finite = verified[:3]
        kept = state.method_state.replace(draft_cache=cache)
        if self.uses_features:
            kept = kept.replace(features=commit_features(state, verified[3], verdict.path))
        return commit_step(state, tree, tree_origin, verdict, target_cache, finite,
                           self.rounds, kept, constraint)


# The method registry's entry (specjax.methods.REGISTRY).
OPTIONS = (NgramOptions, StagedOptions)


def build(options: NgramOptions | StagedOptions,
          draft_config: ModelConfig | None = None) -> NgramOnly | Staged:
    """The step object of ``ngram`` (no draft) or ``staged`` (with the draft's config)."""
    if options.name == "ngram":
        return NgramOnly(options)
    return Staged(options, draft_config)
