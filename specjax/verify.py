"""Exact acceptance rules for tree verification, vectorised and on device.

After one target forward over a :class:`specjax.tree.Tree`, every node ``i`` has the
processed target distribution ``p~_i`` (``target_logp[i]``, from
:func:`specjax.sampling.target_log_probs`) of the token that FOLLOWS node ``i``. An
acceptance rule walks from the root, accepts a root-to-node path of drafted tokens and
draws one more token from the target (a correction or a bonus). Every rule here is
*lossless*: the emitted tokens are distributed exactly as autoregressive sampling from
``p~`` (coupled rule: are the very same tokens), whatever the draft proposed, as long as
the rule's assumption about how the children were drafted holds (stated per rule).

All rules return a :class:`Verdict`. The tokens emitted by one step are
``tokens[path[1:count]]`` followed by ``next_token`` (:func:`emitted_tokens`), and
:func:`specjax.cache.commit_path` consumes ``(path, count)`` to keep the accepted K/V.

The rules read logits only: the target pass that produces them is the methods'
(:func:`specjax.methods.common.verify_tree` runs it and applies a rule by name).

Rules:

* :func:`verify_greedy_or_coupled`: deterministic scores (greedy logits, or coupled
  ``log p~ + g_position``); follow the child whose token is the target's argmax.
* :func:`verify_match`: sample-then-match (the staged-speculation paper): the target draws
  its own token at every node with fresh randomness; follow matching children. Exact for
  any tree.
* :func:`verify_rejection`: multi-candidate rejection sampling down the tree, in three
  ``children_mode`` variants matching how the drafter picked each node's children:
  ``"with_replacement"`` (i.i.d. samples from ``q``; SpecInfer; a chain is
  Leviathan/Chen), ``"without_replacement"`` (Sequoia / recursive rejection sampling) and
  ``"deterministic"`` (children fixed independently of any sampling, e.g. draft top-k;
  exact for any tree).

Static arguments (they fix shapes, pass them as ``static_argnames`` under ``jit``):
``max_depth``, ``width``, ``children_mode``. Everything else is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.errors import InvalidArgumentError
from specjax.sampling import first_argmax, top_k
from specjax.tree import Tree, ancestor_mask, children_table, depths

CHILDREN_MODES = ("with_replacement", "without_replacement", "deterministic")

# Residuals with less mass than this are treated as empty (they only arise from rounding
# when the residual is exactly zero in exact arithmetic, an event of probability zero).
_MIN_MASS = 1e-30


@struct.dataclass
class Verdict:
    """The outcome of verifying one tree."""

    path: jax.Array  # int32 [max_depth + 1], accepted node indices, root first; 0 past count
    count: jax.Array  # int32 [], accepted nodes including the root (>= 1)
    next_token: jax.Array  # int32 [], the target's token after the last accepted node


def emitted_tokens(tree: Tree, verdict: Verdict) -> jax.Array:
    """The tokens one step emits, padded to a static length.

    Args:
      tree: the verified tree.
      verdict: its verdict.
    Returns:
      int32 [max_depth + 1]: ``tokens[path[1:count]]`` then ``next_token`` (``count``
      tokens in all), zeros after.
    """
    path = verdict.path
    slots = jnp.arange(path.shape[0])
    drafted = tree.tokens[jnp.concatenate([path[1:], jnp.zeros((1,), path.dtype)])]
    out = jnp.where(slots < verdict.count - 1, drafted, 0)
    return jnp.where(slots == verdict.count - 1, verdict.next_token, out).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Deterministic walks: greedy, coupled, and sample-then-match.
# --------------------------------------------------------------------------------------


def _walk_choices(tree: Tree, choice: jax.Array, max_depth: int) -> Verdict:
    """Follows, from the root, the child whose token equals ``choice`` at its parent.

    ``choice``: int32 [N], the target's token after each node. Among valid siblings with
    the same token the lowest index is followed. Fully vectorised: a node is accepted iff
    it and all its ancestors are the followed child of their parent.
    """
    parents = tree.parents
    valid = tree.valid.at[0].set(True)
    size = parents.shape[0]
    index = jnp.arange(size)
    is_child = valid & (index > 0) & (parents >= 0)
    match = is_child & (tree.tokens == choice[jnp.maximum(parents, 0)])
    earlier_match = (match[None, :] & (parents[None, :] == parents[:, None])
                     & (index[None, :] < index[:, None]))
    followed = (match & ~jnp.any(earlier_match, axis=1)) | (index == 0)
    mask = ancestor_mask(parents, valid, max_depth=None)
    node_depths = depths(parents)
    accepted = jnp.all(~mask | followed[None, :], axis=1) & valid & (node_depths <= max_depth)
    deepest = jnp.argmax(jnp.where(accepted, node_depths, -1))
    return _verdict_to(deepest, mask[deepest], node_depths, choice[deepest], max_depth)


def _verdict_to(node: jax.Array, ancestors: jax.Array, node_depths: jax.Array,
                next_token: jax.Array, max_depth: int) -> Verdict:
    """The verdict whose path ends at ``node``, from its ancestor row bool [N]."""
    level = jnp.arange(max_depth + 1)[:, None]
    on_path = ancestors[None, :] & (node_depths[None, :] == level)  # [max_depth + 1, N]
    path = jnp.sum(jnp.where(on_path, jnp.arange(ancestors.shape[0])[None, :], 0), axis=1)
    return Verdict(path=path.astype(jnp.int32), count=(node_depths[node] + 1).astype(jnp.int32),
                   next_token=jnp.asarray(next_token, jnp.int32))


def verify_greedy_or_coupled(tree: Tree, target_scores: jax.Array, max_depth: int) -> Verdict:
    """Greedy or coupled (Gumbel-max) verification.

    The target's token after node ``i`` is ``argmax(target_scores[i])``. With greedy
    logits (or ``log p~`` at temperature 0) this is greedy decoding; with coupled scores
    ``log p~_i + g_{position(i)}`` (:func:`specjax.sampling.perturbed_scores`) every node
    at the same absolute position shares the noise, and the emitted tokens are exactly
    those autoregressive coupled sampling would produce. The walk follows the child whose
    token equals the target's choice; if two valid siblings carry the same token, the
    lower index is followed (builders should avoid duplicates: the other one is wasted).

    Args:
      tree: N nodes.
      target_scores: float32 [N, V].
      max_depth: static; the path has ``max_depth + 1`` slots and deeper nodes are ignored.
    Returns:
      The :class:`Verdict`.
    """
    return _walk_choices(tree, first_argmax(target_scores), max_depth)


def verify_choices(tree: Tree, choice: jax.Array, max_depth: int) -> Verdict:
    """:func:`verify_greedy_or_coupled` from the target's token after each node, int32
    [N] (e.g. :func:`specjax.sampling.sample_tokens` of the tree's logits at positions + 1,
    which skips materialising the [N, V] scores)."""
    return _walk_choices(tree, choice.astype(jnp.int32), max_depth)


def verify_match(tree: Tree, target_logp: jax.Array, key: jax.Array, max_depth: int) -> Verdict:
    """Sample-then-match verification (the staged speculative decoding paper).

    The target draws its own token at every node from ``p~`` with independent randomness
    (Gumbel-max with fresh noise from ``key``), and the walk follows children whose token
    matches (lowest index among duplicates). Each emitted token is the target's own draw
    given the accepted prefix, so the rule is exact for any tree; acceptance at a node is
    the target mass on its distinct children.

    Args:
      tree: N nodes.
      target_logp: float32 [N, V], ``log p~`` at each node.
      key: a PRNG key.
      max_depth: static.
    Returns:
      The :class:`Verdict`.
    """
    noise = jax.random.gumbel(key, target_logp.shape, jnp.float32)
    choice = first_argmax(target_logp + noise)
    return _walk_choices(tree, choice, max_depth)


# --------------------------------------------------------------------------------------
# Rejection sampling down the tree.
# --------------------------------------------------------------------------------------


def _normalise_or(weights: jax.Array, fallback: jax.Array) -> jax.Array:
    """``weights / sum(weights)``, or ``fallback`` when the mass is (numerically) zero."""
    mass = jnp.sum(weights)
    return jnp.where(mass > _MIN_MASS, weights / jnp.maximum(mass, _MIN_MASS), fallback)


def _residual(target: jax.Array, proposal: jax.Array, fallback: jax.Array) -> jax.Array:
    """``norm(max(target - proposal, 0))``; ``fallback`` if that is empty (target == proposal)."""
    return _normalise_or(jnp.maximum(target - proposal, 0.0), fallback)


def _accept_probability(target: jax.Array, proposal: jax.Array, token: jax.Array) -> jax.Array:
    """``min(1, target(x) / proposal(x))``; 0 where the proposal has no mass on x."""
    r, q = target[token], proposal[token]
    return jnp.where(q > 0, jnp.minimum(1.0, r / jnp.where(q > 0, q, 1.0)), 0.0)


def verify_rejection(tree: Tree, target_logp: jax.Array, draft_logp: jax.Array | None,
                     key: jax.Array, max_depth: int, width: int,
                     children_mode: str = "with_replacement") -> Verdict:
    """Multi-candidate rejection sampling walking down the tree.

    At the current node (starting at the root) the residual ``r`` starts as ``p~`` there
    and the proposal ``q`` as ``q~`` there. The node's valid children (at most ``width``,
    in index order; see :func:`specjax.tree.children_table`) are tried in turn; child
    token ``x`` is accepted with probability

    * ``"with_replacement"`` (children i.i.d. from ``q``): ``min(1, r(x) / q(x))``; on
      reject ``r <- norm(max(r - q, 0))``. With one child per node this is
      Leviathan/Chen speculative sampling; duplicate sibling tokens are legitimate.
    * ``"without_replacement"`` (children drawn from ``q`` without replacement, in index
      order): ``min(1, r(x) / q(x))``; on reject ``r <- norm(max(r - q, 0))`` and ``q``
      loses ``x`` and is renormalised.
    * ``"deterministic"`` (children fixed independently of the verifier's randomness, e.g.
      the draft's top-k, or any hand-built tree): ``r(x)``; on reject ``r(x) <- 0`` and
      ``r`` is renormalised. ``draft_logp`` is not used and may be None.

    The first accepted child becomes the current node. If none is accepted (or the node
    has no valid children) ``next_token ~ r`` and the walk stops; at a leaf reached by
    accepting, that is ``next_token ~ p~`` there. Residuals with zero mass (possible only
    through rounding, e.g. ``r == q``) fall back to ``p~`` of the node. Drafted children
    must lie in the support of their proposal; one outside it is never accepted.

    Args:
      tree: N nodes.
      target_logp: float32 [N, V], ``log p~`` at each node.
      draft_logp: float32 [N, V], ``log q~`` at each node: the distribution the drafter
        sampled that node's children from. None only for ``"deterministic"``.
      key: a PRNG key.
      max_depth: static; nodes deeper than this are never accepted.
      width: static W, the most children tried per node.
      children_mode: static, one of :data:`CHILDREN_MODES`.
    Returns:
      The :class:`Verdict`.
    Raises:
      InvalidArgumentError: unknown ``children_mode``, or a missing ``draft_logp``.
    """
    if children_mode not in CHILDREN_MODES:
        raise InvalidArgumentError(
            f"children_mode must be one of {', '.join(CHILDREN_MODES)}, got {children_mode!r}")
    if draft_logp is None and children_mode != "deterministic":
        raise InvalidArgumentError(f"children_mode {children_mode!r} needs draft_logp")
    if draft_logp is None:
        draft_logp = target_logp  # unused: keeps one code path with static shapes
    tokens = tree.tokens
    valid = tree.valid.at[0].set(True)
    table = children_table(tree.parents, valid, width)  # [N, W]
    vocab = target_logp.shape[-1]
    # All randomness in one draw (each random-number site costs compile time): one
    # uniform per (level, sibling slot) for the accept tests, then V uniforms turned into
    # Gumbel noise for the final sample. Uniforms lie in [tiny, 1), so an acceptance
    # probability of 0 never accepts and 1 always does.
    noise = jax.random.uniform(key, ((max_depth + 1) * width + vocab,), jnp.float32,
                               minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    uniforms = noise[: (max_depth + 1) * width].reshape(max_depth + 1, width)
    gumbel = -jnp.log(-jnp.log(noise[(max_depth + 1) * width:]))

    def step(level, carry):
        node, done, path, count, final = carry
        p = jnp.exp(target_logp[node].astype(jnp.float32))
        q = jnp.exp(draft_logp[node].astype(jnp.float32))
        r = p
        chosen = jnp.int32(0)
        taken = jnp.bool_(False)
        # Children at level max_depth + 1 would overflow the path: never tried.
        open_ = ~done & (level < max_depth)
        for slot in range(width):  # static: W is small
            child = table[node, slot]
            live = open_ & ~taken & (child >= 0)
            x = tokens[jnp.maximum(child, 0)]
            if children_mode == "deterministic":
                # The same step with q = one-hot(x): min(1, r(x) / 1) = r(x), and
                # max(r - one-hot(x), 0) is r with x zeroed.
                proposal = jax.nn.one_hot(x, vocab, dtype=jnp.float32)
            else:
                proposal = q
            accept = live & (uniforms[level, slot] < _accept_probability(r, proposal, x))
            reject = live & ~accept
            r = jnp.where(reject, _residual(r, proposal, p), r)
            if children_mode == "without_replacement":
                removed = _normalise_or(q.at[x].set(0.0), jnp.zeros_like(q))
                q = jnp.where(reject, removed, q)
            chosen = jnp.where(accept, child, chosen)
            taken = taken | accept
        stop = ~done & ~taken
        final = jnp.where(stop, r, final)
        path = jnp.where(taken, path.at[level + 1].set(chosen), path)
        return (jnp.where(taken, chosen, node), done | stop, path,
                count + taken.astype(jnp.int32), final)

    init = (jnp.int32(0), jnp.bool_(False), jnp.zeros((max_depth + 1,), jnp.int32),
            jnp.int32(1), jnp.zeros((vocab,), jnp.float32))
    _, _, path, count, final = jax.lax.fori_loop(0, max_depth + 1, step, init)
    # Gumbel-max; log(0) = -inf excludes tokens outside the residual's support.
    next_token = first_argmax(jnp.log(final) + gumbel)
    return Verdict(path=path, count=count, next_token=next_token)


def sample_draft_children(key: jax.Array, draft_logp: jax.Array, width: int,
                          children_mode: str) -> jax.Array:
    """Draws one node's children the way :func:`verify_rejection` assumes.

    ``"with_replacement"``: ``width`` i.i.d. draws from ``q``; ``"without_replacement"``:
    sequential draws without replacement (Gumbel-top-k, in draw order);
    ``"deterministic"``: the ``width`` most likely tokens of ``q``, best first (``key``
    unused). Without replacement needs ``width`` tokens of positive mass, else the tail
    holds zero-mass tokens (never accepted).

    Args:
      key: a PRNG key.
      draft_logp: float32 [V], ``log q~`` at the parent.
      width: static W.
      children_mode: static, one of :data:`CHILDREN_MODES`.
    Returns:
      int32 [W] child tokens.
    """
    if children_mode == "with_replacement":
        return jax.random.categorical(key, draft_logp, shape=(width,)).astype(jnp.int32)
    if children_mode == "without_replacement":
        scores = draft_logp + jax.random.gumbel(key, draft_logp.shape, jnp.float32)
        return top_k(scores, width)[1].astype(jnp.int32)
    if children_mode == "deterministic":
        return top_k(draft_logp, width)[1].astype(jnp.int32)
    raise InvalidArgumentError(
        f"children_mode must be one of {', '.join(CHILDREN_MODES)}, got {children_mode!r}")
