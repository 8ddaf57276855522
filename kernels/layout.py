"""Shared input checks and the data layout the verify-attention kernels work on.

Both kernels (:mod:`specjax.kernels.attention_gpu`, :mod:`specjax.kernels.attention_tpu`)
compute exactly :func:`specjax.attention.attention_reference` and split the keys a query
sees into two parts:

* **committed cache slots** ``s < length`` of ``k_cache``/``v_cache`` [S, K, D]. Every
  query sees all of them, so they need no mask: the kernels compare a slot iota with the
  traced ``length``. They are read in place (the cache is never copied or transposed),
  split over the KV length (flash-decoding) with an online softmax, and blocks at or past
  ``length`` are skipped;
* the **tail**: the scratch window (slots ``length .. length+M-1``, gathered here, M <=
  128) followed by the T new tokens. It is small (M + T <= 256 keys) and is handled in the
  combine step under an explicit mask.

Layout (axis letters: G = H // K query heads per KV head):

* queries: ``[K, R, D]`` with row ``r = t * G + g`` (tree node t, head ``k * G + g``), so one
  tile holds a KV head's whole group across all tree nodes and each K/V block read from
  memory serves all of them (GQA). R = T * G padded to ``rows`` with zero rows;
* tail keys/values: ``[K, P, D]`` (P = M + T padded), zeros in the padding;
* tail mask: ``[R, P]`` integers (1 = visible), the rows of ``scratch_mask`` and ``mask``
  repeated G times; padding rows and columns are 0. Scratch slots past the cache capacity
  are 0 too. Integers rather than bool because both Triton and Mosaic load them as plain
  vectors (int8 on GPU; int32 on TPU, whose int8 tiles are (32, 128)).

A padding row sees nothing; the kernels give it output 0 (its normaliser is 0) and
:func:`unpack_output` drops it.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from specjax.errors import InvalidArgumentError

MAX_TOKENS = 128  # new tokens (tree nodes) per call
MAX_SCRATCH = 128  # scratch-window slots per call
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Masked scores: finite, so that a fully masked row never computes inf - inf.
MASK_VALUE = -1e30


def check_inputs(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask, *, head_dims,
                 dtypes, kernel: str) -> None:
    """Raises :class:`InvalidArgumentError` (one line) unless a kernel supports the call.

    Args:
      q: [T, H, D]; k_new, v_new: [T, K, D]; k_cache, v_cache: [S, K, D] or ``None``;
      mask: bool [T, T]; scratch_mask: bool [T, M] or ``None``.
      head_dims: the head sizes the kernel supports.
      dtypes: the floating dtypes it supports.
      kernel: its name, for the messages.
    """
    if q.ndim != 3 or k_new.ndim != 3 or v_new.ndim != 3:
        raise InvalidArgumentError(
            f"{kernel}: q, k_new, v_new must be [T, H, D], [T, K, D], [T, K, D]; got shapes "
            f"{q.shape}, {k_new.shape}, {v_new.shape}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    if k_new.shape != (num_tokens, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise InvalidArgumentError(
            f"{kernel}: k_new and v_new must both be [T, K, D] = "
            f"[{num_tokens}, K, {head_dim}]; got {k_new.shape} and {v_new.shape}")
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise InvalidArgumentError(
            f"{kernel}: {num_tokens} new tokens per call; the kernel supports 1..{MAX_TOKENS} "
            "(use attention 'auto' or 'reference' for longer prefills)")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"{kernel}: {num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if head_dim not in head_dims:
        raise InvalidArgumentError(
            f"{kernel}: head_dim {head_dim} is not supported; supported: "
            f"{', '.join(map(str, head_dims))}")
    arrays = {"q": q, "k_new": k_new, "v_new": v_new}
    if k_cache is not None or v_cache is not None:
        if k_cache is None or v_cache is None:
            raise InvalidArgumentError(f"{kernel}: pass both k_cache and v_cache, or neither")
        if (k_cache.ndim != 3 or k_cache.shape[1:] != (num_kv_heads, head_dim)
                or v_cache.shape != k_cache.shape):
            raise InvalidArgumentError(
                f"{kernel}: k_cache and v_cache must both be [S, {num_kv_heads}, {head_dim}]; "
                f"got {k_cache.shape} and {v_cache.shape}")
        arrays.update(k_cache=k_cache, v_cache=v_cache)
    if jnp.dtype(q.dtype) not in dtypes:
        raise InvalidArgumentError(
            f"{kernel}: dtype {jnp.dtype(q.dtype).name} is not supported; supported: "
            f"{', '.join(jnp.dtype(d).name for d in dtypes)}")
    for name, array in arrays.items():
        if array.dtype != q.dtype:
            raise InvalidArgumentError(
                f"{kernel}: {name} has dtype {jnp.dtype(array.dtype).name} but q has "
                f"{jnp.dtype(q.dtype).name}; the kernel needs one dtype")
    if mask.shape != (num_tokens, num_tokens):
        raise InvalidArgumentError(
            f"{kernel}: mask must be [T, T] = [{num_tokens}, {num_tokens}]; got {mask.shape}")
    if scratch_mask is not None and k_cache is not None:
        if scratch_mask.ndim != 2 or scratch_mask.shape[0] != num_tokens:
            raise InvalidArgumentError(
                f"{kernel}: scratch_mask must be [T, M] with T = {num_tokens}; "
                f"got {scratch_mask.shape}")
        if scratch_mask.shape[1] > MAX_SCRATCH:
            raise InvalidArgumentError(
                f"{kernel}: scratch window of {scratch_mask.shape[1]} slots; the kernel "
                f"supports at most {MAX_SCRATCH}")


def check_windows(num_tokens: int, softcap, first_visible, kernel: str) -> None:
    """Raises :class:`InvalidArgumentError` (one line) unless ``softcap`` is ``None`` or a
    positive number and ``first_visible`` (a sliding window's first visible slot per
    query) is ``None`` or int32 [T]."""
    if softcap is not None and (isinstance(softcap, bool)
                                or not isinstance(softcap, numbers.Real) or not softcap > 0):
        raise InvalidArgumentError(
            f"{kernel}: softcap must be a positive number or None; got {softcap!r}")
    if first_visible is not None and (tuple(first_visible.shape) != (num_tokens,)
                                      or jnp.dtype(first_visible.dtype) != jnp.int32):
        raise InvalidArgumentError(
            f"{kernel}: first_visible must be int32 [T] = [{num_tokens}]; got "
            f"{jnp.dtype(first_visible.dtype).name} {tuple(first_visible.shape)}")


def capped(scores, softcap: float | None):
    """``softcap * tanh(scores / softcap)`` (Gemma 2's soft-capping, as
    ``attention_reference`` applies it), or the scores: both kernels' float32 scores."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def next_power_of_2(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(value, 1))))


def pack_queries(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """[T, H, D] -> [K, rows, D], row ``t * G + g``, zero rows past T * G."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    packed = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    packed = packed.reshape(num_kv_heads, num_tokens * group, head_dim)
    return jnp.pad(packed, ((0, 0), (0, rows - num_tokens * group), (0, 0)))


def unpack_output(out: jax.Array, num_tokens: int, num_heads: int) -> jax.Array:
    """[K, rows, D] -> [T, H, D] (inverse of :func:`pack_queries`, padding dropped)."""
    num_kv_heads, _, head_dim = out.shape
    group = num_heads // num_kv_heads
    out = out[:, : num_tokens * group].reshape(num_kv_heads, num_tokens, group, head_dim)
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)


def pack_tail(k_new, v_new, k_cache, v_cache, length, mask, scratch_mask, *, group: int,
              rows: int, tail: int, mask_dtype):
    """The tail keys/values [K, tail, D] (scratch window, then new tokens) and mask [rows, tail].

    Args:
      k_new, v_new: [T, K, D]; k_cache, v_cache: [S, K, D] or ``None``.
      length: int32 [], committed slots; the scratch window starts there.
      mask: bool [T, T]; scratch_mask: bool [T, M] or ``None``.
      group: G, query heads per KV head; rows: padded R; tail: padded P >= M + T.
      mask_dtype: integer dtype of the returned mask.
    """
    num_tokens = k_new.shape[0]
    keys, values, visible = k_new, v_new, mask
    if k_cache is not None and scratch_mask is not None and scratch_mask.shape[1] > 0:
        window = scratch_mask.shape[1]
        slots = length + jnp.arange(window, dtype=jnp.int32)
        in_cache = slots < k_cache.shape[0]  # a window may run past the capacity
        index = jnp.clip(slots, 0, k_cache.shape[0] - 1)
        keys = jnp.concatenate([jnp.take(k_cache, index, axis=0), k_new], axis=0)
        values = jnp.concatenate([jnp.take(v_cache, index, axis=0), v_new], axis=0)
        visible = jnp.concatenate([scratch_mask & in_cache[None, :], mask], axis=1)
    width = keys.shape[0]
    keys = jnp.pad(keys.transpose(1, 0, 2), ((0, 0), (0, tail - width), (0, 0)))
    values = jnp.pad(values.transpose(1, 0, 2), ((0, 0), (0, tail - width), (0, 0)))
    visible = jnp.repeat(visible.astype(mask_dtype), group, axis=0)  # row t * G + g
    visible = jnp.pad(visible, ((0, rows - num_tokens * group), (0, tail - width)))
    return keys, values, visible


def tail_width(num_tokens: int, scratch_mask, has_cache: bool) -> int:
    """M + T, the number of tail keys before padding."""
    window = scratch_mask.shape[1] if (has_cache and scratch_mask is not None) else 0
    return window + num_tokens


def scratch_window(k_cache, v_cache, layer, length, scratch_mask):
    """The scratch window as a small cache of its own: (K rows [M, K, D], V rows, mask
    [N, M] with slots past the capacity hidden), from layer ``layer`` of the stacked
    [L, S, K, D] caches, slots ``length .. length + M - 1`` (M = ``scratch_mask.shape[1]``).
    A gather of M rows: the layer itself is never sliced out (shared by the GPU and TPU
    kernels' wrappers)."""
    num_layers, capacity = k_cache.shape[:2]
    slots = length + jnp.arange(scratch_mask.shape[1], dtype=jnp.int32)
    index = layer * capacity + jnp.clip(slots, 0, capacity - 1)

    def rows(cache):
        return jnp.take(cache.reshape(num_layers * capacity, *cache.shape[2:]), index, axis=0)

    return rows(k_cache), rows(v_cache), scratch_mask & (slots < capacity)[None, :]


def one_layer_caches(k_cache, v_cache, kernel: str):
    """(K, V) as one layer's shape/dtype, from [S, K, D] or stacked [L, S, K, D] caches,
    for the kernels' input checks; stacked caches must share one shape.

    Raises:
      InvalidArgumentError: stacked K and V caches of different shapes.
    """
    if k_cache is not None and v_cache is not None and (
            k_cache.ndim == 4 or v_cache.ndim == 4) and k_cache.shape != v_cache.shape:
        raise InvalidArgumentError(
            f"{kernel}: k_cache and v_cache must have one shape; got {k_cache.shape} "
            f"and {v_cache.shape}")

    def one(cache):
        if cache is None or cache.ndim != 4:
            return cache
        return jax.ShapeDtypeStruct(cache.shape[1:], cache.dtype)

    return one(k_cache), one(v_cache)
