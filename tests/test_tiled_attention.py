"""The tiled position-ordered attention kernel (``kernels/attention_tiled_gpu.py``): tensor-core
dots at fixed tiles, a GQA group's query heads as rows of one tile.

It runs under Pallas' generic interpreter on the CPU (its dots lower to XLA dots). Checked:

* against ``attention_reference``: decode, trees, causal prefill without a cache, GQA groups
  1-4, length 0 and on a block edge, fp32 and bf16, the default and small blocks, NaN in
  every cache slot it must not read; sharp enough to see one cache slot too few;
* the bitwise property at the kernel level: each node's row of one tree call equals, bit
  for bit, the one-token call at that node's position after committing its ancestors to
  the cache, with the tree starting mid-block, across a block edge and at 0; fp32 and bf16;
* the same comparison catches two deliberately wrong variants: a KV block chosen from the
  number of new tokens, and blocks that reach past the committed length computed with
  elementwise products while the others use dots;
* the Triton lowering accepts it at SmolLM2's decode and 64-node verify shapes;
* bad input: one-line errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import InvalidArgumentError
from specjax.kernels import attention_tiled_gpu as tiled
from specjax.kernels import layout
from specjax.kernels.attention_tiled_gpu import (GpuTiledBlockSizes, check_supported,
                                                 merge_splits, tiled_attention_gpu)
from specjax.tree import ancestor_mask

from test_fused_kernels import PINNED_ORDER, TREE_PARENTS
from test_kernels import Case, make_inputs, reference

# As the ordered kernel's cases (tests/test_fused_kernels.py): an online softmax over
# blocks against one softmax, fp32; bf16 rounds the probabilities before P @ V and the
# output.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SMALL = GpuTiledBlockSizes(block_kv=16)
SPLIT = GpuTiledBlockSizes(block_kv=16, split_kv=32)  # splits at positions 0, 32, 64, ...

CASES = [
    Case("decode-g1-f32", 1, 2, 2, 64, 64, 37, tree=False, block_sizes=SMALL),
    Case("decode-g4-bf16-default-blocks", 1, 8, 2, 64, 128, 100, tree=False,
         dtype=jnp.bfloat16),
    Case("tree-g3-bf16", 7, 6, 2, 64, 96, 77, dtype=jnp.bfloat16, block_sizes=SMALL),
    Case("tree-g4-d128-edge-f32", 20, 8, 2, 128, 64, 32, block_sizes=SMALL),  # length on an edge
    Case("tree-g2-length0-f32", 5, 4, 2, 32, 48, 0, block_sizes=SMALL),
    Case("tree-g3-tiles-straddled-f32", 12, 3, 1, 32, 64, 29, block_sizes=SMALL),
    Case("prefill-no-cache-f32", 19, 4, 1, 64, None, 0, tree=False, block_sizes=SMALL),
    Case("decode-g3-f32-split", 1, 3, 1, 64, 96, 70, tree=False, block_sizes=SPLIT),
    Case("tree-g2-bf16-split", 9, 4, 2, 32, 64, 27, dtype=jnp.bfloat16, block_sizes=SPLIT),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case):
    args, reference_args = make_inputs(case, seed=CASES.index(case))
    options = {} if case.block_sizes is None else {"block_sizes": case.block_sizes}
    out = tiled_attention_gpu(*args, interpret=True, **options)
    expected = reference(*reference_args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "unwritten or poisoned output"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol)
    if case.capacity is not None and case.length > 0 and case.dtype == jnp.float32:
        # The comparison is sharp enough to see one cache slot too few.
        shorter = reference(*reference_args[:5], jnp.int32(case.length - 1), *reference_args[6:])
        assert float(jnp.max(jnp.abs(out - shorter))) > 100 * tol


# --- the bitwise property ---------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, LAYERS = 6, 2, 32, 64, 2  # G = 3: tokens straddle tiles


def _pinned(function, *args):
    """``function`` compiled for ``args`` with the backend's optimisations off (see
    ``PINNED_ORDER`` in tests/test_fused_kernels.py: the sums run in the order the
    kernel states, on any x86-64)."""
    return jax.jit(function).lower(*args).compile(compiler_options=PINNED_ORDER)


def _tree_inputs(dtype, seed=0):
    """(q [N, H, D], k_new, v_new [N, K, D], stacked caches [L, S, K, D], depth [N]) for
    the nodes of ``TREE_PARENTS``; keys of spread sizes so that sums' orders show."""
    nodes = len(TREE_PARENTS)
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    spread = jnp.logspace(-1, 1, HEAD_DIM)
    q = 2 * jax.random.normal(ks[0], (nodes, HEADS, HEAD_DIM)) * spread
    k_new = jax.random.normal(ks[1], (nodes, KV_HEADS, HEAD_DIM))
    v_new = jax.random.normal(ks[2], (nodes, KV_HEADS, HEAD_DIM)) * spread
    k_cache = jax.random.normal(ks[3], (LAYERS, CAPACITY, KV_HEADS, HEAD_DIM))
    v_cache = jax.random.normal(ks[4], (LAYERS, CAPACITY, KV_HEADS, HEAD_DIM)) * spread
    depth = []
    for p in TREE_PARENTS:
        depth.append(0 if p < 0 else depth[p] + 1)
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return (*map(cast, (q, k_new, v_new, k_cache, v_cache)), depth)


def tree_versus_steps(kernel, dtype, length: int) -> list[bool]:
    """Per node of ``TREE_PARENTS`` (the tree's root at position ``length``, layer 1 of
    stacked caches): whether ``kernel``'s one-token call at the node's position, after
    writing its ancestors' keys and values at ``length .. length + depth - 1``, gives bit
    for bit the node's rows of one call over the whole tree (both compiled as
    :func:`_pinned`)."""
    q, k_new, v_new, k_cache, v_cache, depth = _tree_inputs(dtype)
    layer = jnp.int32(1)
    mask = ancestor_mask(jnp.asarray(TREE_PARENTS, jnp.int32),
                         jnp.ones(len(TREE_PARENTS), bool))

    def call(q, k_new, v_new, k_cache, v_cache, length, mask):
        return kernel(q, k_new, v_new, k_cache, v_cache, length, mask, layer=layer)

    tree_args = (q, k_new, v_new, k_cache, v_cache, jnp.int32(length), mask)
    tree = _pinned(call, *tree_args)(*tree_args)
    step = _pinned(call, q[:1], k_new[:1], v_new[:1], k_cache, v_cache, jnp.int32(length),
                   jnp.ones((1, 1), bool))
    same = []
    for node, node_depth in enumerate(depth):
        kc, vc, ancestor = k_cache, v_cache, TREE_PARENTS[node]
        for slot in range(node_depth - 1, -1, -1):  # commit the ancestors, deepest last
            kc = kc.at[1, length + slot].set(k_new[ancestor])
            vc = vc.at[1, length + slot].set(v_new[ancestor])
            ancestor = TREE_PARENTS[ancestor]
        out = step(q[node:node + 1], k_new[node:node + 1], v_new[node:node + 1], kc, vc,
                   jnp.int32(length + node_depth), jnp.ones((1, 1), bool))
        same.append(bool(jnp.all(out[0] == tree[node])))
    return same


def _right(*args, layer, block_sizes=SMALL):
    return tiled_attention_gpu(*args, layer=layer, block_sizes=block_sizes, interpret=True)


# Lengths: mid-block (the tree's positions 20-26 inside one 16-slot block); across a block
# edge (12-18: a node at depth >= 4 reads block [0, 16) as a shared block in its step and
# per row in the tree); 0 (no cache). With splits of 32 positions: also across a split
# edge (28-34).
@pytest.mark.parametrize("sizes,length", [(SMALL, 20), (SMALL, 12), (SMALL, 0), (SPLIT, 12),
                                          (SPLIT, 28)], ids=["20", "12", "0", "12-split",
                                                             "28-split"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_every_tree_node_is_bitwise_its_one_token_step(dtype, sizes, length):
    kernel = lambda *args, layer: _right(*args, layer=layer, block_sizes=sizes)  # noqa: E731
    assert all(tree_versus_steps(kernel, dtype, length))


ROW_COUNT_DEPENDENT = {  # (sizes for a one-token call, for a pass)
    "block": (GpuTiledBlockSizes(block_kv=16), GpuTiledBlockSizes(block_kv=32)),
    "split": (GpuTiledBlockSizes(block_kv=16, split_kv=16), SPLIT),
}


@pytest.mark.parametrize("variant", sorted(ROW_COUNT_DEPENDENT))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_a_row_count_dependent_tiling_is_caught(dtype, variant):
    """The KV block (16 slots for a one-token call, 32 for a pass) or the split (16
    positions, 32) chosen from the number of new tokens: from position 20, the step splits
    at position 16 the keys that the pass reads in one block or split."""
    one, many = ROW_COUNT_DEPENDENT[variant]

    def tiled_by_row_count(q, *args, layer):
        sizes = one if q.shape[0] == 1 else many
        return tiled_attention_gpu(q, *args, layer=layer, block_sizes=sizes, interpret=True)

    assert not all(tree_versus_steps(tiled_by_row_count, dtype, 20))


def test_an_empty_split_merges_as_an_exact_identity():
    """A split with no key for a row, inserted anywhere, leaves the merge's bits unchanged
    (a one-token call has fewer non-empty splits than a pass over the same positions)."""
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    m = 3 * jax.random.normal(ks[0], (3, 5))
    l = jnp.exp(jax.random.normal(ks[1], (3, 5)))
    acc = jax.random.normal(ks[2], (3, 5, 16))
    want = merge_splits(m, l, acc)
    empty = (jnp.full((1, 5), layout.MASK_VALUE), jnp.zeros((1, 5)), jnp.zeros((1, 5, 16)))
    for at in range(4):
        got = merge_splits(*(jnp.concatenate([a[:at], e, a[at:]])
                             for a, e in zip((m, l, acc), empty)))
        np.testing.assert_array_equal(got, want)
    # Not vacuous: a split with one key does change the result.
    one_key = (m[:1] - 1, jnp.ones((1, 5)), acc[:1])
    assert not np.array_equal(merge_splits(*(jnp.concatenate([a, e]) for a, e in
                                             zip((m, l, acc), one_key))), want)


def _halves(terms, axis):
    """The sum over ``axis`` as two half sums added: the order of an elementwise reduction
    that is not the dot's (on a GPU a warp reduces as a tree; on the CPU, XLA's unoptimised
    dot and an unsplit elementwise sum are the same sequential loop, so an elementwise
    variant must also reorder to be a different arithmetic there)."""
    first, second = jnp.split(terms, 2, axis=axis)
    return jnp.sum(first, axis=axis) + jnp.sum(second, axis=axis)


def _elementwise_update(carry, q, keys, values, valid, *, scale):
    """:func:`tiled.block_update` with elementwise products (float32 probabilities, sums
    in :func:`_halves` order) instead of dots."""
    m, l, acc = carry
    keys, values = keys.astype(jnp.float32), values.astype(jnp.float32)
    s = _halves(q.astype(jnp.float32)[:, None, :] * keys[None], axis=2) * scale
    s = jnp.where(valid, s, layout.MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + _halves(p[:, :, None] * values[None], axis=1)
    return m_next, l, acc


@pytest.fixture
def fresh_traces():
    """Kernels traced anew (a monkeypatched helper must not hit a cached trace), and not
    reused by later tests."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_mixed_arithmetic_is_caught(dtype, monkeypatch, fresh_traces):
    """Blocks that reach past the committed length computed with elementwise products,
    the others with dots: from position 12, a node at depth >= 4 reads block [0, 16) with
    dots in its step (wholly committed) and elementwise in the tree (it holds new tokens)."""
    original = tiled._tiled_rows
    traced = []

    def mixed(*args, **kwargs):
        # The kernel traces `block_update` twice: first in the loop over shared blocks,
        # then in the per-row loop over the blocks past `length`, which gets the
        # elementwise update.
        real_update = tiled.block_update
        calls = []

        def update(*args, **kwargs):
            calls.append(1)
            return (real_update if len(calls) == 1 else _elementwise_update)(*args, **kwargs)

        monkeypatch.setattr(tiled, "block_update", update)
        try:
            return original(*args, **kwargs)
        finally:
            monkeypatch.setattr(tiled, "block_update", real_update)
            traced.append(len(calls))

    monkeypatch.setattr(tiled, "_tiled_rows", mixed)
    same = tree_versus_steps(_right, dtype, 12)
    assert traced == [2, 2], traced  # tree and step: one shared update, one per-row
    depth = _tree_inputs(dtype)[-1]
    # Nodes whose step reads [0, 16) wholly committed differ; the others agree.
    assert not all(s for s, d in zip(same, depth) if d >= 4)
    assert all(s for s, d in zip(same, depth) if d < 4)


# --- Triton lowering and input checks ---------------------------------------------------

def test_lowers_for_triton():
    sds = jax.ShapeDtypeStruct
    # SmolLM2-135M decode and a 64-node verify (bf16, and the verify in fp32), without
    # and with splits of 256 positions.
    for t, dtype, split_kv in [(1, jnp.bfloat16, 0), (64, jnp.bfloat16, 0),
                               (64, jnp.float32, 0), (1, jnp.bfloat16, 256),
                               (64, jnp.bfloat16, 256)]:
        h, k, d, s, layers = 9, 3, 64, 2048, 30
        lowered = tiled_attention_gpu.trace(
            sds((t, h, d), dtype), sds((t, k, d), dtype), sds((t, k, d), dtype),
            sds((layers, s, k, d), dtype), sds((layers, s, k, d), dtype), sds((), jnp.int32),
            sds((t, t), jnp.bool_), layer=sds((), jnp.int32),
            block_sizes=GpuTiledBlockSizes(split_kv=split_kv),
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


def _args(t=2, s=64):
    q, kv = jnp.zeros((t, 4, 32)), jnp.zeros((t, 2, 32))
    return q, kv, kv, jnp.zeros((s, 2, 32)), jnp.zeros((s, 2, 32)), jnp.ones((t, t), bool)


@pytest.mark.parametrize("call,message", [
    (lambda: check_supported(*_args(), block_sizes=GpuTiledBlockSizes(block_kv=24)),
     "power of two"),
    (lambda: check_supported(*_args(), block_sizes=GpuTiledBlockSizes(block_rows=8)),
     "power of two"),
    (lambda: check_supported(*_args(s=48)), "not a multiple of block_kv=64"),
    (lambda: check_supported(*_args(), block_sizes=GpuTiledBlockSizes(split_kv=96)),
     "split_kv=96 must be 0"),
    (lambda: check_supported(*_args(), scratch_mask=jnp.ones((2, 3), bool)),
     "no scratch window"),
    (lambda: check_supported(*_args()[:5], jnp.ones((3, 3), bool)), "mask must be"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
