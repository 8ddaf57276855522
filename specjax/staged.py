"""Staged speculative decoding (Spector & Re 2023): a draft model sped up by stage 2.

Two methods, both hashable static objects run by the drivers in :mod:`specjax.decode`:

* :class:`Staged` (``method="staged"``): the draft model builds the target's tree, helped
  by a stage-2 drafter (n-gram tables + context lookup, :mod:`specjax.drafters`);
* :class:`NgramOnly` (``method="ngram"``): the stage-2 proposal tree goes straight to the
  target; no draft model.

One staged step, all in static shapes:

1. **Catch-up**: one draft pass brings the draft cache up to the root (the pending last
   token) and gives the draft's distribution there. The *spine* starts as ``[root]``.
2. **Rounds** (``rounds`` of them, static). At the spine's end ``e`` the draft's best
   child ``x`` (its "own" token) is appended; stage 2 proposes a small tree of fixed
   ``proposal`` shape continuing the sequence + spine + ``x``; the draft scores ``x`` and
   the whole proposal in **one pass** (tree mask; the spine is visible through the
   scratch mask). The draft then walks down the proposal from ``x``, following the child
   that equals its own best token at each node; ``x`` and the matched proposal nodes join
   the spine. Each spine node records its top-``width`` children by the draft's ranking.
3. **Select**: the candidates are the root and the top-``width`` children of every spine
   node, scored by cumulative draft log-probability (ranking scores, see below); the
   target tree is the best ``budget`` of them (prefix-closed), as in the paper.
4. **Verify** with one target pass and any exact rule (``coupled`` by default at T > 0),
   then **commit** the accepted path.

Ranking of children (exactness never depends on it): ``greedy``/``coupled`` rank by
``log q~ + g_position`` (the same Gumbel noise the target uses), ``match`` and
``rejection`` by ``log q~``. The tree is a deterministic function of the draft and the
context, so ``rejection`` runs in ``deterministic`` children mode.

Token origins: each emitted token is counted as proposed by the n-gram tables, context
lookup, the draft model, or the target (the token the target adds after the accepted
path). ``state.aux["origins"]`` holds the origin of every generated token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import models
from specjax.cache import commit_path
from specjax.config import ModelConfig
from specjax.decode import DecodeLoop, DecodeState, append_tokens
from specjax.drafters.ngram import ORIGIN_LOOKUP, ORIGIN_NGRAM, propose
from specjax.errors import InvalidArgumentError
from specjax.sampling import perturbed_scores, target_log_probs
from specjax.speculative import VERIFY_RULES, draft_catch_up, draft_prefill, verify_tree
from specjax.tree import Tree, ancestor_mask, select_top_indices, select_top_nodes
from specjax.verify import Verdict, emitted_tokens

# Origin codes of emitted tokens (stats and ``--show-origin``).
ORIGIN_DRAFT = 2
ORIGIN_TARGET = 3
ORIGIN_NAMES = {ORIGIN_NGRAM: "ngram", ORIGIN_LOOKUP: "lookup", ORIGIN_DRAFT: "draft",
                ORIGIN_TARGET: "target"}
_KEY_TAG = 0x57A6


def _check_shape(proposal: tuple[int, ...]) -> None:
    if not proposal or any(not isinstance(n, int) or n < 1 for n in proposal):
        raise InvalidArgumentError(
            f"proposal shape must be a non-empty tuple of integers >= 1, got {proposal!r}")


def _check_verify(verify: str) -> None:
    if verify not in VERIFY_RULES:
        raise InvalidArgumentError(
            f"unknown verify rule {verify!r}; expected one of {VERIFY_RULES}")


def _static_parents(proposal: tuple[int, ...]) -> np.ndarray:
    """Parents of a proposal tree (see :func:`specjax.drafters.ngram.propose`): level 1
    hangs under the sequence end (-1), level l + 1 under the first node of level l."""
    parents, first = [], -1
    for level, n in enumerate(proposal):
        parents += [first] * n
        first = sum(proposal[:level])
    return np.asarray(parents, np.int32)


def _proposal_depths(proposal: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([np.full(n, level + 1, np.int32) for level, n in enumerate(proposal)])


def _commit(state: DecodeState, loop_aux: dict, tree: Tree, tree_origin: jax.Array,
            verdict: Verdict, target_cache, finite, draft_calls: int) -> DecodeState:
    """Commits the accepted path, appends the emitted tokens and records their origins."""
    tokens = emitted_tokens(tree, verdict)
    slots = jnp.arange(tokens.shape[0])
    path_origin = tree_origin[jnp.concatenate([verdict.path[1:],
                                               jnp.zeros((1,), verdict.path.dtype)])]
    origin = jnp.where(slots == verdict.count - 1, ORIGIN_TARGET, path_origin).astype(jnp.int8)
    start = state.length
    state = state.replace(
        cache=commit_path(target_cache, verdict.path, verdict.count),
        target_calls=state.target_calls + 1,
        draft_calls=state.draft_calls + draft_calls,
        nonfinite=state.nonfinite | ~finite, done=state.done | ~finite)
    state = append_tokens(state, tokens, verdict.count)
    kept = state.length - start  # after stop tokens and max_length
    origins = jax.lax.dynamic_update_slice(state.aux["origins"],
                                           jnp.where(slots < kept, origin, -1).astype(jnp.int8),
                                           (start,))
    counts = state.aux["origin_counts"] + jnp.sum(
        (origin[None, :] == jnp.arange(4, dtype=jnp.int8)[:, None]) & (slots < kept)[None, :],
        axis=1).astype(jnp.int32)
    accepted = state.aux["accepted"].at[verdict.count - 1].add(1)
    return state.replace(aux={**state.aux, **loop_aux, "origins": origins,
                              "origin_counts": counts, "accepted": accepted})


def _origin_aux(loop: DecodeLoop, max_depth: int) -> dict:
    return {"origins": jnp.full((loop.capacity,), -1, jnp.int8),
            "origin_counts": jnp.zeros((4,), jnp.int32),
            "accepted": jnp.zeros((max_depth + 1,), jnp.int32)}


@dataclasses.dataclass(frozen=True)
class NgramOnly:
    """``method="ngram"``: the stage-2 proposal (n-gram + context lookup) verified directly
    by the target, no draft model. The target tree has ``1 + sum(proposal)`` nodes.

    Attributes:
      proposal: per-level candidate counts of the proposal tree (static).
      verify: acceptance rule; ``rejection`` runs in ``deterministic`` children mode.
      use_lookup: merge context lookup into the proposals.
    """

    proposal: tuple[int, ...] = (2, 1, 1, 1, 1, 1, 1, 1)
    verify: str = "coupled"
    use_lookup: bool = True
    name: str = "ngram"

    def __post_init__(self):
        _check_shape(self.proposal)
        _check_verify(self.verify)

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

    def init(self, params, loop: DecodeLoop, state: DecodeState, tables) -> DecodeState:
        del params, tables
        return state.replace(aux=_origin_aux(loop, self.max_depth))

    def step(self, params, loop: DecodeLoop, state: DecodeState, tables) -> DecodeState:
        key = jax.random.fold_in(jax.random.fold_in(
            jax.random.PRNGKey(state.sampling.seed), state.length), _KEY_TAG)
        prop = propose(tables, state.tokens, state.length, self.proposal,
                       use_lookup=self.use_lookup)
        root = state.tokens[state.length - 1]
        tree = Tree(tokens=jnp.concatenate([root[None], prop.tokens]),
                    parents=jnp.concatenate([jnp.array([-1], jnp.int32),
                                             jnp.where(prop.parents < 0, 0, prop.parents + 1)]),
                    valid=jnp.concatenate([jnp.array([True]), prop.valid]))
        origin = jnp.concatenate([jnp.array([ORIGIN_TARGET], jnp.int8), prop.origin])
        width = max(self.proposal)
        verdict, cache, finite = verify_tree(params, loop, state, tree, self.max_depth, width,
                                              self.verify, key)
        return _commit(state, {}, tree, origin, verdict, cache, finite, 0)


@dataclasses.dataclass(frozen=True)
class Staged:
    """``method="staged"``: draft model + stage 2 (see the module docstring).

    Attributes:
      draft_config: the draft model's config.
      budget: N, target tree nodes verified per target pass (root included).
      rounds: R, draft passes per step after the catch-up pass.
      proposal: per-level candidate counts of each stage-2 proposal tree.
      width: W, children recorded per spine node (the draft's top-W).
      verify: acceptance rule.
      use_lookup: merge context lookup into the stage-2 proposals.
    """

    draft_config: ModelConfig
    budget: int = 4
    rounds: int = 1
    proposal: tuple[int, ...] = (2, 1, 1, 1)
    width: int = 1
    verify: str = "coupled"
    use_lookup: bool = True
    name: str = "staged"

    def __post_init__(self):
        _check_shape(self.proposal)
        _check_verify(self.verify)
        for name in ("budget", "rounds", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.budget > self.num_candidates:
            raise InvalidArgumentError(
                f"tree budget {self.budget} exceeds the {self.num_candidates} candidates that "
                f"{self.rounds} rounds x width {self.width} can draft")

    @property
    def pass_size(self) -> int:
        """Tokens in one round's draft pass: the draft's own token + the proposal."""
        return 1 + sum(self.proposal)

    @property
    def max_spine(self) -> int:
        """Most spine nodes (root included) one step can build."""
        return 1 + self.rounds * (1 + len(self.proposal))

    @property
    def num_candidates(self) -> int:
        return 1 + self.width + self.rounds * self.pass_size * (1 + self.width)

    @property
    def max_depth(self) -> int:
        """Deepest possible target tree node (a child of the last spine node)."""
        return self.max_spine

    @property
    def scratch(self) -> int:
        """Cache slots past the committed prefix one step may write (target or draft)."""
        return max(self.budget, self.rounds * self.pass_size, self.max_depth + 1) + 1

    # ------------------------------------------------------------------ ranking

    def _rank(self, logits, sampling, child_positions):
        """Ranking log-scores [E, V] for the children of E evaluated nodes."""

        def sampled(_):
            log_q = target_log_probs(logits, sampling)
            if self.verify in ("greedy", "coupled"):
                log_q = perturbed_scores(log_q, sampling, child_positions)
            return jax.nn.log_softmax(log_q, axis=-1)

        def greedy(_):
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

        return jax.lax.cond(sampling.temperature > 0, sampled, greedy, None)

    # ------------------------------------------------------------------ method protocol

    def init(self, params, loop: DecodeLoop, state: DecodeState, draft_params,
             tables) -> DecodeState:
        """Prefills the draft cache with the prompt."""
        del params, tables
        aux = {"draft_cache": draft_prefill(draft_params, self.draft_config, loop, state),
               **_origin_aux(loop, self.max_depth)}
        return state.replace(aux=aux, draft_calls=state.draft_calls + 1)

    def step(self, params, loop: DecodeLoop, state: DecodeState, draft_params,
             tables) -> DecodeState:
        sampling = state.sampling
        width, size, depth_p = self.width, self.pass_size, len(self.proposal)
        root_position = state.length - 1
        key = jax.random.fold_in(jax.random.fold_in(
            jax.random.PRNGKey(sampling.seed), state.length), _KEY_TAG)

        # 1. Catch the draft up to the root.
        cache, root_logits = draft_catch_up(draft_params, self.draft_config, loop, state,
                                            state.aux["draft_cache"], self.max_depth + 1)
        root_rank = self._rank(root_logits, sampling, (root_position + 1)[None])
        top_scores, top_tokens = jax.lax.top_k(root_rank[0], width)

        # Candidates (the target tree is the best `budget` of them): the root, its top-W
        # children, and per round every pass node and each pass node's top-W children.
        # A child that duplicates a pass node under the same parent is dropped (the pass
        # node carries the same token and score).
        cand_tokens = [state.tokens[root_position][None], top_tokens]
        cand_parents = [jnp.array([-1], jnp.int32), jnp.zeros((width,), jnp.int32)]
        cand_scores = [jnp.zeros((1,), jnp.float32), top_scores]
        cand_valid = [jnp.array([True]), jnp.ones((width,), jnp.bool_)]
        cand_origin = [jnp.array([ORIGIN_TARGET], jnp.int8),
                       jnp.full((width,), ORIGIN_DRAFT, jnp.int8)]
        # The spine end: its candidate index, score, top-W children and their block.
        end_cand, end_score = jnp.int32(0), jnp.float32(0.0)
        end_tokens, end_scores = top_tokens, top_scores
        end_block = jnp.int32(1)  # candidate index of the end's rank-0 child
        count = jnp.int32(1)  # spine nodes so far (root included)
        history = state.tokens
        visible = jnp.zeros((self.rounds * size,), jnp.bool_)  # scratch slots on the spine
        kill = jnp.zeros((self.num_candidates,), jnp.bool_)  # duplicates found later

        local_depth = np.concatenate([[0], _proposal_depths(self.proposal)])
        static = _static_parents(self.proposal)
        parents_np = np.concatenate([[-1], np.where(static < 0, 0, static + 1)])  # pass-local
        level_first = np.cumsum([0] + list(self.proposal))  # proposal index of level starts
        base = 1 + width

        # 2. Rounds: the draft's own token + a stage-2 proposal, scored in one pass.
        for r in range(self.rounds):
            own = end_tokens[0]
            kill = kill.at[end_block].set(True)  # the end's rank-0 child is `own` below
            history = history.at[state.length - 1 + count].set(own, mode="drop")
            prop = propose(tables, history, state.length + count, self.proposal,
                           use_lookup=self.use_lookup)
            pass_tokens = jnp.concatenate([own[None], prop.tokens])
            local_parents = jnp.asarray(parents_np)
            pass_valid = jnp.concatenate([jnp.array([True]), prop.valid])
            positions = root_position + count + jnp.asarray(local_depth)
            mask = ancestor_mask(local_parents, pass_valid, depth_p)
            scratch_mask = jnp.broadcast_to(visible[None, : r * size], (size, r * size))
            logits, cache = models.forward(draft_params, self.draft_config, pass_tokens,
                                           positions, cache, mask, scratch_mask,
                                           attn_impl=loop.attn_impl)
            rank = self._rank(logits, sampling, positions + 1)  # [size, V]
            node_scores, node_tokens = jax.lax.top_k(rank, width)  # [size, W]

            # Scores of the pass nodes: parent's score + the parent's ranking of the token.
            pass_scores = jnp.zeros((size,), jnp.float32).at[0].set(end_score + end_scores[0])
            for i in range(1, size):
                pi = int(parents_np[i])
                pass_scores = pass_scores.at[i].set(pass_scores[pi] + rank[pi, pass_tokens[i]])
            pass_ok = pass_valid & jnp.isfinite(pass_scores)
            pass_cand = base + jnp.arange(size, dtype=jnp.int32)
            block = base + size  # first child candidate of this round
            child_cand = block + jnp.arange(size * width, dtype=jnp.int32).reshape(size, width)
            # children duplicating a pass node with the same parent
            same_parent = parents_np[None, :] == np.arange(size)[:, None]  # [size, size]
            dup = jnp.any(same_parent[:, None, :] & pass_ok[None, None, :]
                          & (node_tokens[:, :, None] == pass_tokens[None, None, :]), axis=-1)
            cand_tokens += [pass_tokens, node_tokens.reshape(-1)]
            cand_parents += [jnp.where(np.arange(size) == 0, end_cand,
                                       base + jnp.asarray(np.maximum(parents_np, 0))),
                             jnp.repeat(pass_cand, width)]
            cand_scores += [pass_scores, (pass_scores[:, None] + node_scores).reshape(-1)]
            cand_valid += [pass_ok, (pass_ok[:, None] & ~dup
                                     & jnp.isfinite(node_scores)).reshape(-1)]
            cand_origin += [jnp.concatenate([jnp.array([ORIGIN_DRAFT], jnp.int8), prop.origin]),
                            jnp.full((size * width,), ORIGIN_DRAFT, jnp.int8)]

            # Walk down the proposal along the draft's own best tokens; the matched nodes
            # join the spine (visible to later rounds) and the last one is the new end.
            node, alive, matched = jnp.int32(0), jnp.bool_(True), jnp.int32(0)
            visible = visible.at[r * size].set(True)
            for level in range(depth_p):
                lo, hi = 1 + level_first[level], 1 + level_first[level + 1]
                hit = (pass_valid[lo:hi] & (local_parents[lo:hi] == node)
                       & (pass_tokens[lo:hi] == node_tokens[node, 0]))
                alive = alive & jnp.any(hit)
                nxt = lo + jnp.argmax(hit).astype(jnp.int32)
                history = history.at[jnp.where(alive, state.length + count + level,
                                               history.shape[0])].set(pass_tokens[nxt],
                                                                      mode="drop")
                visible = visible.at[jnp.where(alive, r * size + nxt, visible.shape[0])].set(
                    True, mode="drop")
                node = jnp.where(alive, nxt, node)
                matched = matched + alive.astype(jnp.int32)
            count = count + 1 + matched
            end_cand, end_score = pass_cand[node], pass_scores[node]
            end_tokens, end_scores = node_tokens[node], node_scores[node]
            end_block = child_cand[node, 0]
            base = block + size * width

        # 3. Select the target tree.
        cand_tokens, cand_parents = jnp.concatenate(cand_tokens), jnp.concatenate(cand_parents)
        cand_scores, cand_origin = jnp.concatenate(cand_scores), jnp.concatenate(cand_origin)
        cand_valid = jnp.concatenate(cand_valid) & ~kill
        cand_valid = cand_valid & jnp.isfinite(cand_scores)
        # select_top_nodes orders nodes exactly as select_top_indices does.
        tree = select_top_nodes(cand_parents, cand_scores, cand_tokens, cand_valid, self.budget)
        tree_origin = cand_origin[select_top_indices(cand_parents, cand_scores, cand_valid,
                                                     self.budget)]

        # 4. Verify and commit.
        verdict, target_cache, finite = verify_tree(params, loop, state, tree, self.max_depth,
                                                     width, self.verify, key)
        return _commit(state, {"draft_cache": cache}, tree, tree_origin, verdict, target_cache,
                       finite, 1 + self.rounds)
