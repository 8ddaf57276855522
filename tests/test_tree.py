"""Tree packing: device-derived structure against brute-force host walks, and builders."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from specjax import tree as tree_lib
from specjax.errors import InvalidArgumentError

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@st.composite
def random_trees(draw, min_size=1, max_size=12):
    """(parents, valid) with parents[i] < i and invalid nodes' children invalid."""
    size = draw(st.integers(min_size, max_size))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, size)]
    flags = [True] + draw(st.lists(st.booleans(), min_size=size - 1, max_size=size - 1))
    valid = [True]
    for i in range(1, size):
        valid.append(flags[i] and valid[parents[i]])
    return np.asarray(parents, np.int32), np.asarray(valid, bool)


def brute_ancestors(parents, valid):
    size = len(parents)
    mask = np.eye(size, dtype=bool)
    for i in range(size):
        if not valid[i]:
            continue
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def brute_depths(parents):
    out = []
    for i in range(len(parents)):
        d, j = 0, parents[i]
        while j >= 0:
            d, j = d + 1, parents[j]
        out.append(d)
    return np.asarray(out)


WIDTH = 3  # fixed so that each tree size compiles once; wider families test truncation


@jax.jit
def _derived(parents, valid, offset):
    node_depths = tree_lib.depths(parents)
    return (tree_lib.ancestor_mask(parents, valid), node_depths,
            tree_lib.positions(node_depths, offset), tree_lib.children_table(parents, valid, WIDTH))


@SETTINGS
@given(random_trees(), st.integers(0, 1000))
def test_derived_structure_matches_host_walk(tree, offset):
    parents, valid = tree
    mask, node_depths, pos, table = _derived(parents, valid, offset)
    expected_depths = brute_depths(parents)
    np.testing.assert_array_equal(np.asarray(mask), brute_ancestors(parents, valid))
    np.testing.assert_array_equal(np.asarray(node_depths), expected_depths)
    np.testing.assert_array_equal(np.asarray(pos), offset + expected_depths)
    for i in range(len(parents)):
        kids = [j for j in range(1, len(parents)) if parents[j] == i and valid[j]][:WIDTH]
        np.testing.assert_array_equal(np.asarray(table[i]), kids + [-1] * (WIDTH - len(kids)))


@pytest.mark.parametrize("seed", range(6))
def test_bounded_rounds_agree_with_full(seed):
    # max_depth only trims pointer-jumping rounds; deep chains need every round.
    rng = np.random.default_rng(seed)
    size = 17
    parents = np.array([-1] + [i - 1 if rng.random() < 0.7 else rng.integers(0, i)
                               for i in range(1, size)], np.int32)
    valid = np.ones(size, bool)
    max_depth = int(brute_depths(parents).max())
    mask, node_depths = jax.jit(
        lambda p, v: (tree_lib.ancestor_mask(p, v, max_depth), tree_lib.depths(p, max_depth)))(
            parents, valid)
    np.testing.assert_array_equal(np.asarray(mask), brute_ancestors(parents, valid))
    np.testing.assert_array_equal(np.asarray(node_depths), brute_depths(parents))


def test_ancestor_mask_detects_a_wrong_parent():
    # A chain's mask is lower-triangular; re-rooting node 3 must change rows 3 and 4.
    parents = tree_lib.chain_parents(5)
    mask = np.asarray(tree_lib.ancestor_mask(parents, np.ones(5, bool)))
    np.testing.assert_array_equal(mask, np.tril(np.ones((5, 5), bool)))
    other = parents.copy()
    other[3] = 0
    assert not np.array_equal(np.asarray(tree_lib.ancestor_mask(other, np.ones(5, bool))), mask)


# --------------------------------------------------------------------------------------
# select_top_nodes
# --------------------------------------------------------------------------------------


@st.composite
def candidate_sets(draw):
    """Candidates with cumulative scores made of exact binary fractions (ties abound)."""
    size = draw(st.integers(1, 14))
    parents, valid = draw(random_trees(min_size=size, max_size=size))
    steps = draw(st.lists(st.sampled_from([0.0, -0.5, -1.0, -1.5]), min_size=size, max_size=size))
    scores = np.zeros(size, np.float32)
    for i in range(1, size):
        scores[i] = scores[parents[i]] + steps[i]
    tokens = np.asarray(draw(st.lists(st.integers(0, 50), min_size=size, max_size=size)), np.int32)
    budget = draw(st.integers(1, size))
    return parents, scores, tokens, valid, budget


@functools.partial(jax.jit, static_argnames=("budget",))
def _select(parents, scores, tokens, valid, budget):
    return (tree_lib.select_top_nodes(parents, scores, tokens, valid, budget),
            tree_lib.select_top_indices(parents, scores, valid, budget))


@SETTINGS
@given(candidate_sets())
def test_select_top_nodes_keeps_best_prefix_closed_set(case):
    parents, scores, tokens, valid, budget = case
    tree, source = _select(parents, scores, tokens, valid, budget)
    new_parents, new_valid, new_tokens = (np.asarray(a) for a in (tree.parents, tree.valid, tree.tokens))
    source = np.asarray(source)

    ranked = [0] + sorted((i for i in range(1, len(parents)) if valid[i]), key=lambda i: (-scores[i], i))
    expected = ranked[:budget]
    assert int(new_valid.sum()) == len(expected)
    np.testing.assert_array_equal(source[: len(expected)], expected)  # order: root, then rank
    assert not new_valid[len(expected):].any()  # padding only at the tail

    assert new_parents[0] == -1 and new_valid[0]
    for k in range(1, budget):
        assert 0 <= new_parents[k] < k  # parents precede children, padding included
        if new_valid[k]:
            assert new_valid[new_parents[k]]  # prefix-closed
            assert source[new_parents[k]] == parents[source[k]]  # parents remapped
            assert new_tokens[k] == tokens[source[k]]
            assert scores[source[k]] <= scores[source[k - 1]]  # best first


def test_select_top_nodes_drops_orphans_when_scores_increase():
    # Contract broken: the child scores higher than its parent, which is not kept.
    parents = np.array([-1, 0, 1, 0], np.int32)
    scores = np.array([0.0, -3.0, -1.0, -2.0], np.float32)
    tree = tree_lib.select_top_nodes(parents, scores, np.arange(4), np.ones(4, bool), 3)
    np.testing.assert_array_equal(np.asarray(tree.valid), [True, False, True])
    np.testing.assert_array_equal(np.asarray(tree.parents), [-1, 0, 0])
    np.testing.assert_array_equal(np.asarray(tree.tokens), [0, 0, 3])


def test_select_top_nodes_rejects_bad_budget():
    with pytest.raises(InvalidArgumentError):
        tree_lib.select_top_nodes(jnp.array([-1, 0]), jnp.zeros(2), jnp.zeros(2, jnp.int32),
                                  jnp.ones(2, bool), 3)
    with pytest.raises(InvalidArgumentError):
        tree_lib.select_top_indices(jnp.array([-1, 0]), jnp.zeros(2), jnp.ones(2, bool), 0)


# --------------------------------------------------------------------------------------
# Fixed topologies
# --------------------------------------------------------------------------------------


def test_fixed_topologies():
    np.testing.assert_array_equal(tree_lib.chain_parents(1), [-1])
    np.testing.assert_array_equal(tree_lib.chain_parents(4), [-1, 0, 1, 2])
    np.testing.assert_array_equal(tree_lib.kary_parents(2, 2), [-1, 0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(tree_lib.kary_parents(3, 2, 6), [-1, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(tree_lib.kary_parents(3, 4, 1), [-1])
    assert tree_lib.kary_parents(4, 3).shape == (1 + 4 + 16 + 64,)
    assert tree_lib.kary_parents(2, 3).dtype == np.int32
    paths = [(1,), (0, 1), (0,), (0, 0), (0, 0, 0), (2,)]
    # sorted breadth first: (0,) (1,) (2,) (0,0) (0,1) (0,0,0)
    np.testing.assert_array_equal(tree_lib.parents_from_paths(paths), [-1, 0, 0, 0, 1, 1, 4])
    assert tree_lib.measure_topology(tree_lib.parents_from_paths(paths)) == (3, 3)
    assert tree_lib.measure_topology(tree_lib.chain_parents(5)) == (4, 1)
    assert tree_lib.measure_topology(tree_lib.chain_parents(1)) == (0, 0)
    assert tree_lib.measure_topology(tree_lib.kary_parents(3, 2, 9)) == (2, 3)


@pytest.mark.parametrize("build", [
    lambda: tree_lib.chain_parents(0),
    lambda: tree_lib.kary_parents(2, 0),
    lambda: tree_lib.kary_parents(0, 2),
    lambda: tree_lib.kary_parents(2, 2, 0),
    lambda: tree_lib.kary_parents(2, 2, 8),  # complete tree has 7 nodes
    lambda: tree_lib.parents_from_paths([(0,), (0, 1, 0)]),  # (0, 1) missing
    lambda: tree_lib.parents_from_paths([(1, 0)]),
    lambda: tree_lib.parents_from_paths([(0,), (0,)]),
    lambda: tree_lib.parents_from_paths([()]),
    lambda: tree_lib.parents_from_paths([(-1,)]),
    lambda: tree_lib.validate_parents([0, 0]),
    lambda: tree_lib.validate_parents([-1, 1]),
    lambda: tree_lib.validate_parents([-1, 0, 0, 0], width=2),
    lambda: tree_lib.validate_parents([]),
])
def test_fixed_topology_errors(build):
    with pytest.raises(InvalidArgumentError) as info:
        build()
    assert "\n" not in str(info.value)


def test_children_table_width_edge_cases():
    parents, valid = np.array([-1], np.int32), np.ones(1, bool)
    assert tree_lib.children_table(parents, valid, 0).shape == (1, 0)
    with pytest.raises(InvalidArgumentError):
        tree_lib.children_table(parents, valid, -1)


def test_validate_parents_accepts_width_exactly():
    np.testing.assert_array_equal(tree_lib.validate_parents([-1, 0, 0, 1], width=2), [-1, 0, 0, 1])
