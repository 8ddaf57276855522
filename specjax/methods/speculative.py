"""Draft-model speculative decoding: one jitted step (draft -> pack -> verify -> commit).

A :class:`Speculative` method (``spec`` or ``tree``) is a hashable static object built
from its options (:class:`~specjax.methods.options.SpecOptions`,
:class:`~specjax.methods.options.TreeOptions`) and the draft's config; it sits in the
:class:`~specjax.state.DecodeLoop` and the drivers in :mod:`specjax.decode` run it exactly
like ``ar``. It decodes with :class:`~specjax.drafters.model.DraftResources` and keeps a
:class:`~specjax.drafters.model.DraftState` (the draft's cache, kept target features, a
tally; the model drafter's passes live in :mod:`specjax.drafters.model`). One step:

1. **Draft catch-up.** The draft cache lags the sequence by the tokens accepted in the
   previous step; one draft pass over a fixed chunk of ``depth + 1`` tokens brings it up to
   the root (the pending last token) and yields the draft's distribution at the root.
2. **Draft the tree**, level by level, one draft pass per level (the nodes of a level
   attend to the committed prefix and, through the scratch mask, to their ancestors
   drafted before them):

   * dynamic (``topology=None``): each level expands the ``width`` best frontier nodes
     into their top-``width`` children; the target tree is the best ``budget`` candidates by
     cumulative draft score (prefix-closed), as in the staged speculation paper;
   * fixed topology (chain, k-ary, path list): node ``i`` is the ``rank(i)``-th ranked
     child of its parent.

   How children are ranked depends on the acceptance rule (all exact):
   ``greedy``/``coupled`` rank by ``log q~ + g_position`` (the same Gumbel noise the target
   uses; at temperature 0 by the draft's logits), ``match`` by ``log q~``, ``rejection`` by
   a fresh Gumbel perturbation for fixed topologies (children are a sample without
   replacement) and by ``log q~`` for dynamic trees (deterministic children).
3. **Verify**: one target pass over the packed tree (ancestor mask, positions = length +
   depth), then the acceptance rule (:mod:`specjax.verify`).
4. **Commit** the accepted path's K/V in the target cache and append the emitted tokens.

Every step emits at least one token (the target's own), so the output is exactly that of
autoregressive decoding (greedy, coupled) or distributed exactly like it (match,
rejection), whatever the draft.

**Feature drafts** (EAGLE-style, Li et al. 2024; a draft whose config has
``feature_input``): the draft's input at position ``t`` is its token and the target's
feature (final-normed hidden state) at ``t - 1``, and its output feature goes through its
head. The target's features of every committed position are kept in
``DraftState.features`` (the prefill and each verify pass compute them anyway; the step
commits the accepted path's). Catch-up reads them; below the root, a drafted node reads the
feature the draft predicted for its parent. A multi-layer feature draft (EAGLE-3 class,
``draft_config.feature_layers``) reads the outputs of several target blocks instead, which
the prefill and verify passes return beside their logits, kept as [S, F*d] and fused by
the draft's ``feature_fc`` where it reads them. Only proposals change: exactness is the
verify rule's, as for any draft.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels, models
from specjax.config import ModelConfig
from specjax.constraints import advance as advance_automaton
from specjax.constraints import mask_logits, start_automaton
from specjax.drafters.model import (DraftResources, commit_features, draft_catch_up,
                                    start_draft)
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.methods.common import (DraftFeatures, PassPlan, commit_step, init_tally,
                                    rank_children, step_key, tree_constraint,
                                    verify_tree)
from specjax.methods.options import SpecOptions, TreeOptions, fixed_topology_shape
from specjax.origins import ORIGIN_DRAFT, ORIGIN_TARGET
from specjax.sampling import target_log_probs, top_k
from specjax.state import DecodeLoop, DecodeState
from specjax.tree import Tree, chain_parents, select_top_nodes

_KEY_TAG = 0x5EC


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Static tree shape.

    Attributes:
      budget: N, tree nodes verified per target pass, the root included.
      depth: D, deepest drafted level (draft passes per step = D, catch-up included).
      width: W, children drafted per expanded node (and frontier size of dynamic trees).
      topology: fixed parents array (tuple) or ``None`` for a dynamic tree.
    """

    budget: int
    depth: int
    width: int
    topology: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("budget", "depth", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"tree {name} must be an integer >= 1, got {value!r}")

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix that one step may write."""
        return max(self.budget, self.depth + 1, self.width * self.depth + 1) + 1


@dataclasses.dataclass(frozen=True)
class _Fixed:
    """Host-side tables of a fixed topology (all static)."""

    parents: np.ndarray  # [N]
    node_depth: np.ndarray  # [N]
    rank: np.ndarray  # [N], index among siblings
    row: np.ndarray  # [N], draft-distribution row of each node (-1 for leaves)
    levels: list  # levels[d] = node indices at depth d
    evaluated: list  # evaluated[d] = internal node indices at depth d (d >= 1)
    scratch_masks: list  # [len(evaluated[d]), slots before] bool, per level


def _fixed_tables(parents: np.ndarray) -> _Fixed:
    n = len(parents)
    node_depth = np.zeros(n, np.int32)
    rank = np.zeros(n, np.int32)
    seen: dict[int, int] = {}
    for i in range(1, n):
        node_depth[i] = node_depth[parents[i]] + 1
        rank[i] = seen.get(int(parents[i]), 0)
        seen[int(parents[i])] = rank[i] + 1
    internal = set(int(p) for p in parents[1:])
    depth = int(node_depth.max())
    levels = [[i for i in range(n) if node_depth[i] == d] for d in range(depth + 1)]
    row = np.full(n, -1, np.int32)
    row[0] = 0
    evaluated, slot_of, masks = [[]], {}, [None]
    for d in range(1, depth + 1):
        nodes = [i for i in levels[d] if i in internal]
        mask = np.zeros((len(nodes), len(slot_of)), bool)
        for r, i in enumerate(nodes):
            a = int(parents[i])
            while a > 0:
                mask[r, slot_of[a]] = True
                a = int(parents[a])
        for i in nodes:
            slot_of[i] = len(slot_of)
            row[i] = len(slot_of)  # row 0 is the root
        evaluated.append(nodes)
        masks.append(mask)
    return _Fixed(parents, node_depth, rank, row, levels, evaluated, masks)


@dataclasses.dataclass(frozen=True)
class Speculative(DraftFeatures):
    """A draft-model speculative method (``spec`` = chain, ``tree``); hashable, static.

    Attributes:
      options: the method's options (validated).
      draft_config: the draft model's config.
    """

    options: SpecOptions | TreeOptions
    draft_config: ModelConfig
    constrained: bool = False  # decodes under a constraint (its tables in the resources)

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def verify(self) -> str:
        return self.options.verify

    @property
    def shape(self) -> TreeShape:
        """The static tree shape the options describe."""
        options = self.options
        if options.name == "spec":
            depth = options.draft_depth
            return TreeShape(budget=depth + 1, depth=depth, width=1,
                             topology=tuple(int(p) for p in chain_parents(depth + 1)))
        parents = options.fixed_parents
        if parents is None:
            return TreeShape(budget=options.tree_budget, depth=options.draft_depth,
                             width=options.draft_width)
        depth, width = fixed_topology_shape(parents)
        return TreeShape(budget=len(parents), depth=max(depth, 1), width=max(width, 1),
                         topology=parents)

    @property
    def scratch(self) -> int:
        return self.shape.scratch

    @property
    def pass_plan(self) -> PassPlan:
        """Catch-up (``depth + 1`` rows, head on the root's), then one pass per drafted
        level below the root: ``width`` frontier rows (dynamic) or the level's expanded
        nodes (fixed topology)."""
        shape = self.shape
        passes = [(shape.depth + 1, 1)]
        if shape.topology is None:
            passes += [(shape.width, shape.width)] * (shape.depth - 1)
        else:
            fixed = self._fixed
            passes += [(len(fixed.evaluated[level]), len(fixed.evaluated[level]))
                       for level in range(1, len(fixed.levels)) if len(fixed.evaluated[level])]
        return PassPlan(target_nodes=shape.budget, draft_passes=tuple(passes))

    # ------------------------------------------------------------------ helpers

    @property
    def _fixed(self) -> _Fixed | None:
        if self.shape.topology is None:
            return None
        return _fixed_tables(np.asarray(self.shape.topology, np.int32))

    @property
    def _sampled_children(self) -> bool:
        """Whether the draft samples its children with a fresh perturbation (without
        replacement): a fixed topology under ``rejection`` (unless ``draft_ranking`` is
        ``argmax``), or ``match`` with ``draft_ranking="sampled"``."""
        ranking = self.options.draft_ranking
        if self.verify == "rejection":
            return self.shape.topology is not None and ranking != "argmax"
        return self.verify == "match" and ranking == "sampled"

    @property
    def children_mode(self) -> str:
        """How the drafted children relate to ``q~`` (for the rejection rule)."""
        return "without_replacement" if self._sampled_children else "deterministic"

    def _rank(self, logits: jax.Array, sampling, child_positions: jax.Array,
              key: jax.Array) -> jax.Array:
        """Ranking log-scores [E, V] for drafting children of E nodes
        (:func:`~specjax.methods.common.rank_children`, as ``draft_ranking`` says)."""
        return rank_children(logits, sampling, child_positions, self.verify,
                             key if self._sampled_children else None,
                             argmax=self.options.draft_ranking == "argmax")

    def _draft_pass(self, draft_params, loop: DecodeLoop, cache, tokens, positions,
                    scratch_mask, features, scratch_offset=None):
        """One draft pass over a level's E nodes: (logits [E, V], cache, the draft's
        hidden states [E, d], which a feature draft's children read, or ``None``).
        ``features``: a feature draft's input per node (its parent's predicted feature);
        ``scratch_offset``: see :func:`specjax.models.forward`."""
        count = tokens.shape[0]
        out = models.forward(draft_params, self.draft_config, tokens, positions, cache,
                             jnp.eye(count, dtype=jnp.bool_), scratch_mask,
                             attn_impl=loop.kernels, features=features,
                             return_features=self.uses_features,
                             scratch_offset=scratch_offset)
        return out[0], out[-1], out[1] if self.uses_features else None

    # ------------------------------------------------------------------ method protocol

    def build_resources(self, draft_params=None, tables=None,
                        constraint=None) -> DraftResources:
        del tables
        return DraftResources(draft_params=draft_params,
                              constraint=constraint if self.constrained else None)

    def constraint_of(self, resources: DraftResources):
        return resources.constraint if self.constrained else None

    def init(self, params, loop: DecodeLoop, state: DecodeState, resources: DraftResources,
             prompt_features) -> DecodeState:
        """Prefills the draft cache with the prompt; keeps the prompt's target features for
        a feature draft; starts a constraint's automaton after the prefill's token."""
        del params
        state = start_draft(resources.draft_params, self.draft_config, loop, state,
                            prompt_features, init_tally(state, self.shape.depth))
        if not self.constrained:
            return state
        return state.replace(method_state=state.method_state.replace(
            automaton=start_automaton(resources.constraint, state)))

    def step(self, params, loop: DecodeLoop, state: DecodeState,
             resources: DraftResources) -> DecodeState:
        shape, sampling, draft_params = self.shape, state.sampling, resources.draft_params
        root_position = state.length - 1
        draft_key, verify_key = jax.random.split(step_key(sampling, state.length, _KEY_TAG))

        # 1. Catch the draft cache up to the root.
        cache, root_logits, root_hidden = draft_catch_up(
            draft_params, self.draft_config, loop, state, state.method_state.draft_cache,
            shape.depth + 1)
        root_token = state.tokens[root_position]

        # 2. Draft the tree (only tokens the constraint allows, where the rule permits).
        build = self._draft_fixed if shape.topology is not None else self._draft_dynamic
        automaton = None
        if self._filters_draft:
            automaton = (resources.constraint, state.method_state.automaton)
        tree, draft_logp, cache = build(draft_params, loop, cache, root_token, root_logits,
                                        root_hidden if self.uses_features else None,
                                        root_position, sampling, draft_key, automaton)

        # 3. Verify with one target pass (masked per node under a constraint).
        constraint = tree_constraint(self.constraint_of(resources),
                                     state.method_state.automaton, tree, shape.depth)
        verified = verify_tree(params, loop, state, tree, shape.depth, shape.width,
                               self.verify, verify_key, draft_logp, self.children_mode,
                               return_features=self.uses_features,
                               feature_layers=self.feature_layers, constraint=constraint)
        verdict, target_cache, finite = verified[:3]
        kept = state.method_state.replace(draft_cache=cache)
        if self.uses_features:
            kept = kept.replace(features=commit_features(state, verified[3], verdict.path))

        # 4. Commit (catch-up + one draft pass per expanded level = depth passes).
        origin = jnp.full((tree.size,), ORIGIN_DRAFT, jnp.int8).at[0].set(ORIGIN_TARGET)
        return commit_step(state, tree, origin, verdict, target_cache, finite, shape.depth,
                           kept, constraint)

    # ------------------------------------------------------------------ tree builders

    @property
    def _filters_draft(self) -> bool:
        """Under a constraint the draft proposes only the tokens the automaton allows
        along its own path (its logits masked like the target's): forbidden proposals
        are never accepted, so they would only take nodes. Not for a fixed topology under
        ``rejection``: that rule takes the children as a sample without replacement from
        the draft's distribution, which must not run out of tokens."""
        return self.constrained and not (self.shape.topology is not None
                                         and self.verify == "rejection")

    def _draft_dynamic(self, draft_params, loop, cache, root_token, root_logits,
                       root_hidden, root_position, sampling, key, automaton=None):
        """``automaton``: ``(tables, the state after the root)`` to draft under, or None.

        Each level expands the ``width`` best frontier nodes; their ancestry says which
        earlier levels' scratch slots each sees. Unrolled, it grows by a level's columns as
        the level is drafted; in one loop body (:meth:`_levels_in_one_loop`) it is as wide
        as the deepest level's from the start, the columns not drafted yet False, and each
        level writes its slots at a traced offset: bitwise the same logits and tree
        (``tests/test_speculative.py``)."""
        width, depth = self.shape.width, self.shape.depth
        keys = jax.random.split(key, depth)
        if automaton is not None:
            tables, root_state = automaton
            root_logits = mask_logits(tables, root_state[None], root_logits)
        rank = self._rank(root_logits, sampling, (root_position + 1)[None], keys[0])
        top_scores, top_tokens = top_k(rank[0], width)
        frontier_states = None
        if automaton is not None:
            frontier_states = advance_automaton(tables, root_state, top_tokens)
        # A feature draft's input per frontier node: its parent's predicted feature.
        frontier_features = (None if root_hidden is None
                             else jnp.broadcast_to(root_hidden, (width, root_hidden.shape[1])))
        looped = self._levels_in_one_loop(loop)
        seen_at_most = (depth - 2) * width  # scratch slots the deepest level sees

        def level(carry, xs):
            """Level ``index``: the frontier's pass, its children, the next frontier; out:
            the level's candidates (tokens, parents, scores) in their tree order."""
            (cache, frontier, frontier_tokens, frontier_scores, ancestry, frontier_states,
             frontier_features) = carry
            index, level_key = xs
            positions = jnp.full((width,), root_position + index, jnp.int32)
            logits, cache, hidden = self._draft_pass(
                draft_params, loop, cache, frontier_tokens, positions,
                ancestry[:, :seen_at_most] if looped else ancestry, frontier_features,
                scratch_offset=(index - 1) * width if looped else None)
            if automaton is not None:
                logits = mask_logits(tables, frontier_states, logits)
            rank = self._rank(logits, sampling, positions + 1, level_key)
            child_scores, child_tokens = top_k(rank, width)  # [W, W]
            child_scores = frontier_scores[:, None] + child_scores
            base = 1 + width + (index - 1) * width * width
            out = (child_tokens.reshape(-1), jnp.repeat(frontier, width),
                   child_scores.reshape(-1))
            best_scores, best = top_k(child_scores.reshape(-1), width)
            parent_row = best // width
            own = jnp.eye(width, dtype=jnp.bool_)[parent_row]  # the level's own columns
            if looped:
                ancestry = jax.lax.dynamic_update_slice(ancestry[parent_row], own,
                                                        (0, (index - 1) * width))
            else:
                ancestry = jnp.concatenate([ancestry[parent_row], own], axis=1)
            frontier_tokens = child_tokens.reshape(-1)[best]
            if automaton is not None:
                frontier_states = advance_automaton(tables, frontier_states[parent_row],
                                                    frontier_tokens)
            if hidden is not None:
                frontier_features = hidden[parent_row]
            return (cache, base + best.astype(jnp.int32), frontier_tokens, best_scores,
                    ancestry, frontier_states, frontier_features), out

        carry = (cache, 1 + jnp.arange(width, dtype=jnp.int32), top_tokens, top_scores,
                 jnp.zeros((width, (depth - 1) * width if looped else 0), jnp.bool_),
                 frontier_states, frontier_features)
        cands = ([root_token[None], top_tokens],  # tokens, parents, scores in tree order
                 [jnp.array([-1], jnp.int32), jnp.zeros((width,), jnp.int32)],
                 [jnp.zeros((1,), jnp.float32), top_scores])
        if looped:
            carry, levels = jax.lax.scan(level, carry, (jnp.arange(1, depth, dtype=jnp.int32),
                                                        keys[1:]))
            levels = [levels]
        else:
            levels = []
            for index in range(1, depth):
                carry, out = level(carry, (index, keys[index]))
                levels.append(out)
        for out in levels:  # the loop's outputs stacked [depth - 1, W * W], or one level's
            for parts, part in zip(cands, out):
                parts.append(part.reshape(-1))
        cache, (cand_tokens, cand_parents, cand_scores) = carry[0], cands
        scores = jnp.concatenate(cand_scores)
        tree = select_top_nodes(jnp.concatenate(cand_parents), scores,
                                jnp.concatenate(cand_tokens), jnp.isfinite(scores),
                                self.shape.budget)
        return tree, None, cache

    def _draft_fixed(self, draft_params, loop, cache, root_token, root_logits, root_hidden,
                     root_position, sampling, key, automaton=None):
        """``automaton``: ``(tables, the state after the root)`` to draft under, or None."""
        if self._levels_in_one_loop(loop):
            return self._draft_chain(draft_params, loop, cache, root_token, root_logits,
                                     root_hidden, root_position, sampling, key, automaton)
        fixed = self._fixed
        width, n = self.shape.width, len(fixed.parents)
        keys = jax.random.split(key, len(fixed.levels))
        if automaton is not None:
            tables, root_state = automaton
            root_logits = mask_logits(tables, root_state[None], root_logits)
            node_states = jnp.full((n,), root_state, jnp.int32)
        rank = self._rank(root_logits, sampling, (root_position + 1)[None], keys[0])
        ranked = [top_k(rank[0], width)[1][None]]  # per evaluated row: [rows, W]
        dists = [target_log_probs(root_logits, sampling)]  # log q~ (the rejection rule's)
        tokens = jnp.zeros((n,), jnp.int32).at[0].set(root_token)
        hiddens = [root_hidden]  # a feature draft's predicted feature per evaluated row
        for level in range(1, len(fixed.levels)):
            nodes = np.asarray(fixed.levels[level])
            table = jnp.concatenate(ranked)
            rows = fixed.row[fixed.parents[nodes]]
            tokens = tokens.at[nodes].set(table[rows, fixed.rank[nodes]])
            if automaton is not None:
                node_states = node_states.at[nodes].set(advance_automaton(
                    tables, node_states[fixed.parents[nodes]], tokens[nodes]))
            evaluated = np.asarray(fixed.evaluated[level], np.int32)
            if len(evaluated) == 0:
                continue
            positions = jnp.full((len(evaluated),), root_position + level, jnp.int32)
            features = (None if root_hidden is None else
                        jnp.concatenate(hiddens)[fixed.row[fixed.parents[evaluated]]])
            logits, cache, hidden = self._draft_pass(draft_params, loop, cache,
                                                     tokens[evaluated], positions,
                                                     jnp.asarray(fixed.scratch_masks[level]),
                                                     features)
            if automaton is not None:
                logits = mask_logits(tables, node_states[evaluated], logits)
            hiddens.append(hidden)
            rank = self._rank(logits, sampling, positions + 1, keys[level])
            ranked.append(top_k(rank, width)[1])
            dists.append(target_log_probs(logits, sampling))
        dists = jnp.concatenate(dists)
        draft_logp = dists[np.maximum(fixed.row, 0)]
        tree = Tree(tokens=tokens, parents=jnp.asarray(fixed.parents),
                    valid=jnp.ones((n,), jnp.bool_))
        return tree, draft_logp, cache

    def _levels_in_one_loop(self, loop: DecodeLoop) -> bool:
        """Whether a chain's or a dynamic tree's drafted levels run as one loop body: where
        the kernels are interpreted (the CPU) and attention is the jnp one (``"auto"``
        there, or ``"reference"``), for ``draft_depth`` 4 or more (at 3, two drafted
        levels, the loop saved nothing measurable). Each level is then compiled once: a
        depth-4 ``spec`` program compiled in ~1.5 s less of ~5.5 (docs/results.md). The
        kernels' paths (a GPU, a TPU, the kernels interpreted) and other fixed topologies
        keep unrolled levels, whose scratch windows are as wide as the slots written."""
        shape = self.shape
        return ((shape.topology is None or shape.width == 1) and shape.depth > 3
                and kernels.select_variant()[1]
                and KernelOptions.of(loop.kernels).attention in ("auto", "reference"))

    def _draft_chain(self, draft_params, loop, cache, root_token, root_logits, root_hidden,
                     root_position, sampling, key, automaton=None):
        """:meth:`_draft_fixed` for a chain, its drafted levels one ``lax.scan`` body. Level
        ``l`` (1 .. depth-1) sees the scratch slots of levels 1 .. l-1 through a window as
        wide as the deepest level's, the rest of it masked, and writes its slot after them
        (a traced offset): the jnp attention gives a fully masked block weight 0 exactly
        (and the reference attention masks every slot past the window already), so each
        level's logits, and so the tree and ``log q~``, are bitwise the unrolled levels'
        (``tests/test_speculative.py``)."""
        depth = self.shape.depth
        fixed = self._fixed
        keys = jax.random.split(key, depth + 1)
        state = None
        if automaton is not None:
            tables, root_state = automaton
            root_logits = mask_logits(tables, root_state[None], root_logits)
        rank = self._rank(root_logits, sampling, (root_position + 1)[None], keys[0])
        first = top_k(rank[0], 1)[1]  # [1]: level 1's token
        if automaton is not None:
            state = advance_automaton(tables, jnp.full((1,), root_state, jnp.int32), first)
        window = jnp.arange(depth - 2)[None]  # [1, M]: the deepest level's slots before

        def level(carry, xs):
            cache, token, state, parent_hidden = carry
            index, level_key = xs
            positions = jnp.full((1,), root_position + index, jnp.int32)
            logits, cache, hidden = self._draft_pass(draft_params, loop, cache, token,
                                                     positions, window < index - 1,
                                                     parent_hidden, scratch_offset=index - 1)
            if automaton is not None:
                logits = mask_logits(tables, state, logits)
            rank = self._rank(logits, sampling, positions + 1, level_key)
            child = top_k(rank, 1)[1][:, 0]  # [1]
            if automaton is not None:
                state = advance_automaton(tables, state, child)
            return (cache, child, state, hidden), (child, target_log_probs(logits, sampling))

        (cache, _, _, _), (children, dists) = jax.lax.scan(
            level, (cache, first, state, root_hidden),
            (jnp.arange(1, depth, dtype=jnp.int32), keys[1:depth]))
        tokens = jnp.concatenate([root_token[None].astype(jnp.int32), first.astype(jnp.int32),
                                  children.reshape(-1).astype(jnp.int32)])
        dists = jnp.concatenate([target_log_probs(root_logits, sampling),
                                 dists.reshape(depth - 1, -1)])
        draft_logp = dists[np.maximum(fixed.row, 0)]
        tree = Tree(tokens=tokens, parents=jnp.asarray(fixed.parents),
                    valid=jnp.ones((depth + 1,), jnp.bool_))
        return tree, draft_logp, cache


# The method registry's entry (specjax.methods.REGISTRY).
OPTIONS = (SpecOptions, TreeOptions)


def build(options: SpecOptions | TreeOptions, draft_config: ModelConfig) -> Speculative:
    """The step object of ``spec`` or ``tree`` with the draft's config."""
    return Speculative(options, draft_config)
