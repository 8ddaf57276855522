"""Static-size token trees: the data one speculative step verifies.

A tree has a static node budget ``N`` (the root included). Node 0 is the *root*: the last
committed token whose K/V is not in the cache yet, so the target's distribution at the root
is the one for the first new token. Every other node is a drafted continuation of its
parent. Three arrays describe a tree (:class:`Tree`):

* ``tokens: int32[N]`` the token at each node;
* ``parents: int32[N]`` with ``parents[0] == -1`` and ``0 <= parents[i] < i`` for ``i > 0``,
  so parents always come before their children (a topological order);
* ``valid: bool[N]`` with ``valid[0]`` True. An invalid node is padding: it is invisible to
  every other node, never accepted, and its children are invalid too.

Static numbers that travel with a tree (they fix array shapes, never traced): ``N``,
``max_depth`` (the root has depth 0; a plain autoregressive step is ``N = 1``,
``max_depth = 0``) and ``width`` ``W``, the most children any node may have.

Everything derived from a tree on device (depths, the ancestor mask used as the attention
mask, positions, the children table used by the acceptance walks) is computed here with
array operations only, so it works under ``jit`` and ``vmap``. Fixed topologies (chains,
k-ary trees, Medusa/Sequoia-style path lists) are host-side numpy constants, validated when
they are built; dynamic trees come from :func:`select_top_nodes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.errors import InvalidArgumentError


@struct.dataclass
class Tree:
    """One speculative tree (see the module docstring for the invariants)."""

    tokens: jax.Array  # int32 [N]
    parents: jax.Array  # int32 [N], -1 at the root, parents[i] < i
    valid: jax.Array  # bool [N], valid[0] is True; False marks padding

    @property
    def size(self) -> int:
        """N, the static node budget (root included)."""
        return self.tokens.shape[-1]


def _doubling_rounds(size: int, max_depth: int | None) -> int:
    """Pointer-jumping rounds needed to cover every ancestor distance up to the max depth."""
    deepest = size - 1 if max_depth is None else min(int(max_depth), size - 1)
    return max(deepest - 1, 0).bit_length()


# --------------------------------------------------------------------------------------
# Derived on device.
# --------------------------------------------------------------------------------------


def depths(parents: jax.Array, max_depth: int | None = None) -> jax.Array:
    """Depth of every node (root 0) by pointer jumping: O(log max_depth) gather rounds.

    Args:
      parents: int32 [N], -1 at the root.
      max_depth: optional static bound on the depth; it only saves rounds and must not be
        smaller than the true depth.
    Returns:
      int32 [N].
    """
    parents = jnp.asarray(parents, jnp.int32)
    jump = parents
    dist = (parents >= 0).astype(jnp.int32)  # distance from each node to ``jump``
    for _ in range(_doubling_rounds(parents.shape[0], max_depth)):
        has = jump >= 0
        safe = jnp.where(has, jump, 0)
        dist = dist + jnp.where(has, dist[safe], 0)
        jump = jnp.where(has, jump[safe], -1)
    return dist


def ancestor_mask(parents: jax.Array, valid: jax.Array, max_depth: int | None = None) -> jax.Array:
    """The tree attention mask: row i sees column j iff j is i or an ancestor of i.

    Invalid rows see only themselves and invalid columns are seen only by themselves, so
    padding nodes are invisible to everything. Computed by pointer jumping: after round k
    each row holds its ancestors up to distance 2**k, so O(log max_depth) rounds of an
    O(N**2) row gather (no N x N x N products).

    Args:
      parents: int32 [N], -1 at the root.
      valid: bool [N].
      max_depth: optional static bound on the depth (saves rounds).
    Returns:
      bool [N, N].
    """
    parents = jnp.asarray(parents, jnp.int32)
    valid = jnp.asarray(valid, jnp.bool_)
    size = parents.shape[0]
    index = jnp.arange(size)
    eye = index[:, None] == index[None, :]
    mask = eye | (parents[:, None] == index[None, :])
    jump = parents
    for _ in range(_doubling_rounds(size, max_depth)):
        has = jump >= 0
        safe = jnp.where(has, jump, 0)
        mask = mask | (has[:, None] & mask[safe])
        jump = jnp.where(has, jump[safe], -1)
    return eye | (mask & valid[:, None] & valid[None, :])


def positions(node_depths: jax.Array, offset: jax.Array | int) -> jax.Array:
    """Absolute position ids of the nodes.

    Args:
      node_depths: int32 [N] from :func:`depths`.
      offset: int32 [], the absolute position of the root (the committed prefix length,
        i.e. the cache's ``length``, since the root's K/V is not cached yet).
    Returns:
      int32 [N], ``offset + depth``.
    """
    return jnp.asarray(offset, jnp.int32) + jnp.asarray(node_depths, jnp.int32)


def children_table(parents: jax.Array, valid: jax.Array, width: int) -> jax.Array:
    """Children of every node, in index order, padded with -1.

    Only valid children are listed. A node with more than ``width`` valid children keeps
    its first ``width`` (lowest indices) and the rest are silently dropped: fixed
    topologies are checked on the host (:func:`validate_parents`); dynamic builders must
    respect the width themselves, or accept that the dropped children are never verified
    (which stays exact, they are just wasted).

    Args:
      parents: int32 [N].
      valid: bool [N].
      width: W, static, >= 0.
    Returns:
      int32 [N, W].
    Raises:
      InvalidArgumentError: a negative width.
    """
    if int(width) != width or width < 0:
        raise InvalidArgumentError(f"tree width must be an integer >= 0, got {width}")
    parents = jnp.asarray(parents, jnp.int32)
    valid = jnp.asarray(valid, jnp.bool_)
    size = parents.shape[0]
    if width == 0:  # a lone root (plain autoregressive step) has no children to list
        return jnp.full((size, 0), -1, jnp.int32)
    index = jnp.arange(size)
    is_child = valid & (index > 0) & (parents >= 0)
    earlier_sibling = (is_child[None, :] & (parents[None, :] == parents[:, None])
                       & (index[None, :] < index[:, None]))
    rank = jnp.sum(earlier_sibling, axis=1)
    keep = is_child & (rank < width)
    row = jnp.where(keep, parents, size)  # out of bounds -> dropped by the scatter
    table = jnp.full((size, width), -1, jnp.int32)
    return table.at[row, jnp.minimum(rank, width - 1)].set(index.astype(jnp.int32), mode="drop")


# --------------------------------------------------------------------------------------
# Dynamic trees.
# --------------------------------------------------------------------------------------


def select_top_indices(cand_parents: jax.Array, cand_scores: jax.Array, cand_valid: jax.Array,
                       budget: int) -> jax.Array:
    """Which candidates :func:`select_top_nodes` keeps, in tree order.

    Args:
      cand_parents: int32 [M], parents indexing candidates (-1 at candidate 0, the root).
      cand_scores: float32 [M], cumulative draft log-probabilities, non-increasing along
        every root-to-node path (NaN counts as -inf).
      cand_valid: bool [M]; invalid candidates are never selected as real nodes.
      budget: N, static, ``1 <= N <= M``.
    Returns:
      int32 [N]: ``source[k]`` is the candidate that becomes node k. The root comes
      first, then valid candidates by decreasing score (ties: lower candidate index), then
      the invalid candidates, which the caller turns into padding.
    """
    size = cand_scores.shape[0]
    if not 1 <= budget <= size:
        raise InvalidArgumentError(f"tree budget must be in [1, {size}] candidates, got {budget}")
    index = jnp.arange(size, dtype=jnp.int32)
    valid = jnp.asarray(cand_valid, jnp.bool_).at[0].set(True)
    scores = jnp.asarray(cand_scores, jnp.float32)
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    # Sort key: class (root 0, valid 1, invalid 2), then -score; the sort is stable so
    # equal keys keep index order.
    klass = jnp.where(index == 0, 0, jnp.where(valid, 1, 2)).astype(jnp.int32)
    neg_score = jnp.where(index == 0, 0.0, -scores)
    _, _, order = jax.lax.sort((klass, neg_score, index), num_keys=2, is_stable=True)
    return order[:budget]


def select_top_nodes(cand_parents: jax.Array, cand_scores: jax.Array, cand_tokens: jax.Array,
                     cand_valid: jax.Array, budget: int) -> Tree:
    """Builds a dynamic tree from the ``budget`` best candidates (EAGLE-2 / staged style).

    The root (candidate 0) is always kept; the other nodes are the ``budget - 1`` valid
    candidates with the highest scores, ties broken by lower candidate index. Because a
    score never increases from a parent to its child and a parent's index is lower than
    its child's, a parent always ranks before its child: the kept set is prefix-closed and,
    in rank order, parents precede children. Nodes are re-indexed in that order and the
    parents remapped. When fewer than ``budget`` candidates are valid, the tail is padding
    (``valid`` False, parent 0, token 0).

    Defensive: if the score contract is broken and a kept node's parent was not kept (or
    comes later), that node and its whole subtree become padding rather than a malformed
    tree.

    Use :func:`select_top_indices` to gather per-candidate data (draft distributions,
    draft K/V) into the same node order.

    Args:
      cand_parents: int32 [M], -1 at candidate 0, ``cand_parents[i] < i`` otherwise.
      cand_scores: float32 [M], cumulative draft log-probabilities.
      cand_tokens: int32 [M].
      cand_valid: bool [M].
      budget: N, static, ``1 <= N <= M``.
    Returns:
      A :class:`Tree` with N nodes.
    """
    cand_parents = jnp.asarray(cand_parents, jnp.int32)
    size = cand_parents.shape[0]
    source = select_top_indices(cand_parents, cand_scores, cand_valid, budget)
    node = jnp.arange(budget, dtype=jnp.int32)
    # new index of every candidate (-1 when not kept)
    new_index = jnp.full((size,), -1, jnp.int32).at[source].set(node)
    cand_parent = cand_parents[source]
    parents = jnp.where(cand_parent >= 0, new_index[jnp.maximum(cand_parent, 0)], -1)
    valid = jnp.asarray(cand_valid, jnp.bool_)[source] | (node == 0)
    ok = (node == 0) | ((parents >= 0) & (parents < node))
    valid = valid & ok
    parents = jnp.where(node == 0, -1, jnp.where(ok, parents, 0))
    # A node is real only if its whole ancestry is (pointer jumping, O(log N) rounds).
    jump = parents
    for _ in range(_doubling_rounds(budget, None)):
        has = jump >= 0
        safe = jnp.where(has, jump, 0)
        valid = valid & jnp.where(has, valid[safe], True)
        jump = jnp.where(has, jump[safe], -1)
    parents = jnp.where(node == 0, -1, jnp.where(valid, parents, 0))
    tokens = jnp.where(valid, jnp.asarray(cand_tokens, jnp.int32)[source], 0)
    return Tree(tokens=tokens, parents=parents, valid=valid)


# --------------------------------------------------------------------------------------
# Fixed topologies (host side, numpy).
# --------------------------------------------------------------------------------------


def validate_parents(parents: Sequence[int] | np.ndarray, width: int | None = None) -> np.ndarray:
    """Checks a fixed topology on the host and returns it as int32 numpy.

    Args:
      parents: [N] parent indices, -1 at the root.
      width: if given, the most children any node may have.
    Returns:
      int32 numpy [N].
    Raises:
      InvalidArgumentError: empty or not 1-D, ``parents[0] != -1``, a parent not before
        its child, or a node with more than ``width`` children.
    """
    array = np.asarray(parents)
    if array.ndim != 1 or array.shape[0] < 1:
        raise InvalidArgumentError(f"parents must be a non-empty 1-D array, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(f"parents must be integers, got dtype {array.dtype}")
    array = array.astype(np.int32)
    if array[0] != -1:
        raise InvalidArgumentError(f"parents[0] must be -1 (the root), got {array[0]}")
    index = np.arange(array.shape[0])
    bad = np.nonzero((index > 0) & ((array < 0) | (array >= index)))[0]
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"parents[{i}] = {array[i]} must be in [0, {i}): parents come before children")
    if width is not None:
        counts = np.bincount(array[1:], minlength=array.shape[0])
        if counts.max() > width:
            node = int(np.argmax(counts))
            raise InvalidArgumentError(
                f"node {node} has {int(counts[node])} children but the tree width is {width}; raise the width")
    return array


def measure_topology(parents: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """Static ``(max_depth, width)`` of a fixed topology (host side).

    Returns:
      The depth of the deepest node (root 0) and the largest number of children of one
      node (0 for a lone root).
    """
    array = validate_parents(parents)
    node_depths = np.zeros(array.shape[0], np.int64)
    for i in range(1, array.shape[0]):
        node_depths[i] = node_depths[array[i]] + 1
    width = int(np.bincount(array[1:]).max()) if array.shape[0] > 1 else 0
    return int(node_depths.max()), width


def chain_parents(budget: int) -> np.ndarray:
    """A chain of ``budget`` nodes (root included): classic speculative decoding.

    Returns:
      int32 numpy [budget], ``[-1, 0, 1, ..., budget - 2]``.
    Raises:
      InvalidArgumentError: budget < 1.
    """
    if int(budget) != budget or budget < 1:
        raise InvalidArgumentError(f"tree budget must be an integer >= 1, got {budget}")
    return np.arange(-1, budget - 1, dtype=np.int32)


def kary_parents(width: int, depth: int, budget: int | None = None) -> np.ndarray:
    """A complete ``width``-ary tree of ``depth`` levels below the root, breadth first,
    truncated to its first ``budget`` nodes (all of them when ``budget`` is None).

    In breadth-first order node ``i > 0`` has parent ``(i - 1) // width``.

    Returns:
      int32 numpy [budget].
    Raises:
      InvalidArgumentError: width < 1, depth < 1, budget < 1, or budget larger than the
        complete tree.
    """
    for name, value in (("width", width), ("depth", depth)):
        if int(value) != value or value < 1:
            raise InvalidArgumentError(f"tree {name} must be an integer >= 1, got {value}")
    full = sum(width**level for level in range(depth + 1))
    if budget is None:
        budget = full
    if int(budget) != budget or budget < 1:
        raise InvalidArgumentError(f"tree budget must be an integer >= 1, got {budget}")
    if budget > full:
        raise InvalidArgumentError(
            f"tree budget {budget} exceeds the {full} nodes of a {width}-ary tree of depth {depth}")
    index = np.arange(budget)
    return np.where(index == 0, -1, (index - 1) // width).astype(np.int32)


def parents_from_paths(paths: Sequence[Sequence[int]]) -> np.ndarray:
    """A fixed tree from a Medusa/Sequoia-style list of root-to-node paths.

    Each path is a tuple of child ranks (``(0,)`` = the root's first child, ``(0, 1)`` =
    that child's second child); the root itself is implicit. Nodes are numbered 1.. in the
    order ``sorted(paths, key=lambda p: (len(p), p))`` (breadth first, siblings by rank),
    so a drafter filling node ``i`` with its rank-``paths[i-1][-1]`` candidate can rely on
    that order. Ranks need not be contiguous.

    Returns:
      int32 numpy [len(paths) + 1].
    Raises:
      InvalidArgumentError: an empty path, a negative or non-integer rank, a duplicate
        path, or a list that is not prefix-closed (a path whose parent path is missing).
    """
    normalised = []
    for path in paths:
        path = tuple(path)
        if not path:
            raise InvalidArgumentError("paths must not contain the empty path: the root is implicit")
        if any(int(rank) != rank or rank < 0 for rank in path):
            raise InvalidArgumentError(f"path {path} must hold integer child ranks >= 0")
        normalised.append(tuple(int(rank) for rank in path))
    ordered = sorted(normalised, key=lambda p: (len(p), p))
    node_of = {(): 0}
    parents = [-1]
    for path in ordered:
        if path in node_of:
            raise InvalidArgumentError(f"path {path} appears twice")
        if path[:-1] not in node_of:
            raise InvalidArgumentError(
                f"paths are not prefix-closed: {path} needs its parent path {path[:-1]}")
        parents.append(node_of[path[:-1]])
        node_of[path] = len(parents) - 1
    return np.asarray(parents, np.int32)
