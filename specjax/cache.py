"""The KV cache: a fixed-capacity pytree with a length cursor.

Slots ``[0, length)`` hold the committed prefix. A forward pass over T new tokens writes
their K/V into the *scratch* slots ``[length, length + T)`` without moving the cursor; the
caller then commits what it keeps:

* prefill / one-token decode keep every new token in order, so committing is just
  advancing the cursor (:func:`advance`);
* tree verification keeps one root-to-leaf path, so :func:`commit_path` gathers the
  accepted nodes' K/V into ``[length, length + a)`` and advances by ``a``.

Rolling back is never moving the cursor: rejected scratch slots are overwritten later.
The capacity must leave room for the scratch slots of the widest pass; drivers check this
on the host before compiling (``dynamic_update_slice`` would otherwise clamp silently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.config import ModelConfig


@struct.dataclass
class KVCache:
    """Keys and values of every layer for one sequence."""

    k: jax.Array  # [layers, capacity, kv_heads, head_dim]
    v: jax.Array  # [layers, capacity, kv_heads, head_dim]
    length: jax.Array  # int32 [], number of committed slots

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, capacity: int, dtype=jnp.float32) -> KVCache:
    """Returns an empty cache with ``capacity`` slots per layer.

    Args:
      config: the model the cache belongs to.
      capacity: S, static number of slots (prefix + scratch).
      dtype: storage dtype of K and V.
    """
    shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((), jnp.int32))


def write_scratch(cache: KVCache, k_new: jax.Array, v_new: jax.Array, offset: int = 0) -> KVCache:
    """Writes the K/V of T new tokens into slots ``[length + offset, length + offset + T)``.

    Args:
      k_new, v_new: [layers, T, kv_heads, head_dim].
      offset: number of scratch slots to skip (already-written tree levels; may be traced).
    Returns:
      The cache with the scratch slots filled; ``length`` is unchanged.
    """
    start = (0, cache.length + offset, 0, 0)
    return cache.replace(
        k=jax.lax.dynamic_update_slice(cache.k, k_new.astype(cache.k.dtype), start),
        v=jax.lax.dynamic_update_slice(cache.v, v_new.astype(cache.v.dtype), start),
    )


def advance(cache: KVCache, count: jax.Array | int) -> KVCache:
    """Commits the first ``count`` scratch slots as they are (prefill, chain decode)."""
    return cache.replace(length=cache.length + jnp.asarray(count, jnp.int32))


def commit_path(cache: KVCache, path: jax.Array, count: jax.Array) -> KVCache:
    """Commits an accepted tree path.

    Args:
      path: int32 [M], scratch indices (relative to ``length``) of the accepted nodes in
        root-to-leaf order; entries at and after ``count`` are ignored.
      count: int32 [], number of accepted nodes (``1 <= count <= M``).
    Returns:
      The cache whose slots ``length + j`` hold the K/V of scratch node ``path[j]`` for
      ``j < count``, with ``length`` advanced by ``count``. No other slot changes meaning.
    """
    width = path.shape[0]
    j = jnp.arange(width)
    # Slots past ``count`` are rewritten with their own scratch contents (identity), so
    # the gather/scatter has a static shape and touches nothing it should not.
    source = cache.length + jnp.where(j < count, path, j)

    def move(buf):
        rows = jnp.take(buf, source, axis=1)  # [layers, M, kv_heads, head_dim]
        return jax.lax.dynamic_update_slice(buf, rows, (0, cache.length, 0, 0))

    return cache.replace(k=move(cache.k), v=move(cache.v), length=cache.length + count)
