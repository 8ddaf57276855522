"""The inputs of the attention kernels' row-independence tests: 16 tree nodes over a
300-slot committed cache, node 9 seeing only itself among the new tokens (as a padding node
or a root does), and the same node's call alone (a one-token step)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

NODES, NODE, LENGTH, CAPACITY = 16, 9, 300, 512


def lone_node_inputs(seed: int, dtype, heads: int = 6, kv_heads: int = 2, dim: int = 64):
    """((q, k_new, v_new, k_cache, v_cache, length, mask) of the 16-node call, the random
    generator, for whatever else a test draws)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q, k_new, v_new = normal(NODES, heads, dim), normal(NODES, kv_heads, dim), \
        normal(NODES, kv_heads, dim)
    k_cache, v_cache = normal(CAPACITY, kv_heads, dim), normal(CAPACITY, kv_heads, dim)
    mask = jnp.tril(jnp.ones((NODES, NODES), bool)).at[NODE].set(jnp.arange(NODES) == NODE)
    return (q, k_new, v_new, k_cache, v_cache, jnp.int32(LENGTH), mask), rng


def the_node_alone(args):
    """The arguments of :func:`lone_node_inputs`'s call for node 9 alone."""
    q, k_new, v_new, k_cache, v_cache, length, _ = args
    one = slice(NODE, NODE + 1)
    return q[one], k_new[one], v_new[one], k_cache, v_cache, length, jnp.ones((1, 1), bool)
