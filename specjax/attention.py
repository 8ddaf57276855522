"""Attention of new tokens against a KV cache prefix plus a mask among the new tokens.

Models call :func:`attention` only; it dispatches to an implementation by name:

* ``"reference"`` -- pure ``jax.numpy`` over the whole static cache; the ground truth;
* ``"kernel"`` -- the Pallas kernels in :mod:`specjax.kernels` (GPU/TPU);
* ``"auto"`` -- the kernel on GPU/TPU when one exists for the shapes; on CPU
  :func:`attention_blocked`, pure ``jax.numpy`` that reads only the slots in use.

Query ``t`` sees every committed cache slot ``s < length`` and the new token ``u`` iff
``mask[t, u]``. An optional ``scratch_mask`` [T, M] also shows it the uncommitted scratch
slot ``length + m`` iff ``scratch_mask[t, m]``: drafters use it to expand a tree level by
level, each level attending to the ancestors evaluated before it. ``mask`` is lower-triangular for prefill/decode and the ancestor mask (each
node sees itself and its ancestors) for tree verification. Every row of ``mask`` must have
its diagonal set, so no row is empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.errors import InvalidArgumentError

IMPLEMENTATIONS = ("auto", "reference", "kernel")


def attention_reference(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_cache: jax.Array | None,  # [S, K, D]
    v_cache: jax.Array | None,  # [S, K, D]
    length: jax.Array | int,  # int32 [], committed slots of the cache
    mask: jax.Array,  # bool [T, T]
    scratch_mask: jax.Array | None = None,  # bool [T, M]
) -> jax.Array:
    """Pure-jnp attention; returns [T, H, D] in the dtype of ``q``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    qg = qg * (1.0 / jnp.sqrt(jnp.float32(head_dim)))
    neg = jnp.float32(-1e30)

    s_new = jnp.einsum("tkgd,ukd->kgtu", qg, k_new.astype(jnp.float32))
    s_new = jnp.where(mask[None, None], s_new, neg)
    if k_cache is None:
        probs = jax.nn.softmax(s_new, axis=-1)
        out = jnp.einsum("kgtu,ukd->tkgd", probs, v_new.astype(jnp.float32))
    else:
        s_old = jnp.einsum("tkgd,skd->kgts", qg, k_cache.astype(jnp.float32))
        slots = jnp.arange(k_cache.shape[0])
        visible = (slots < length)[None, :]  # [1, S]
        if scratch_mask is not None and scratch_mask.shape[1] > 0:
            rel = slots - length
            in_window = (rel >= 0) & (rel < scratch_mask.shape[1])
            window = jnp.take(scratch_mask, jnp.clip(rel, 0, scratch_mask.shape[1] - 1), axis=1)
            visible = visible | (window & in_window[None, :])  # [T, S]
        s_old = jnp.where(visible[None, None], s_old, neg)
        probs = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
        p_old, p_new = probs[..., : k_cache.shape[0]], probs[..., k_cache.shape[0]:]
        out = (jnp.einsum("kgts,skd->tkgd", p_old, v_cache.astype(jnp.float32))
               + jnp.einsum("kgtu,ukd->tkgd", p_new, v_new.astype(jnp.float32)))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def attention_blocked(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_cache: jax.Array | None,  # [S, K, D]
    v_cache: jax.Array | None,  # [S, K, D]
    length: jax.Array | int,  # int32 []
    mask: jax.Array,  # bool [T, T]
    scratch_mask: jax.Array | None = None,  # bool [T, M]
    *,
    block: int = 128,
) -> jax.Array:
    """Same result as :func:`attention_reference`, reading only the cache slots in use.

    The cache is visited in blocks of ``block`` slots by a loop whose trip count is traced
    (``ceil((length + M) / block)``), with an online softmax, so the cost follows the
    committed length instead of the static capacity, and a prefill over an empty cache
    reads nothing. This is the CPU path of ``impl="auto"``.
    """
    if k_cache is None:
        return attention_reference(q, k_new, v_new, None, None, length, mask)
    num_tokens, num_heads, head_dim = q.shape
    capacity, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block = min(block, capacity)
    window = 0 if scratch_mask is None else scratch_mask.shape[1]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    qg = qg * (1.0 / jnp.sqrt(jnp.float32(head_dim)))
    neg = jnp.float32(-1e30)
    length = jnp.asarray(length, jnp.int32)
    used = jnp.minimum(length + window, capacity)
    num_blocks = (used + block - 1) // block

    def body(i, carry):
        m, l, acc = carry
        first = i * block
        start = jnp.minimum(first, capacity - block)  # dynamic_slice would clamp anyway
        slots = start + jnp.arange(block)
        k_blk = jax.lax.dynamic_slice_in_dim(k_cache, start, block).astype(jnp.float32)
        v_blk = jax.lax.dynamic_slice_in_dim(v_cache, start, block).astype(jnp.float32)
        visible = ((slots >= first) & (slots < length))[None, :]  # [1, B]
        if window:
            rel = slots - length
            in_window = (slots >= first) & (rel >= 0) & (rel < window)
            seen = jnp.take(scratch_mask, jnp.clip(rel, 0, window - 1), axis=1)
            visible = visible | (seen & in_window[None, :])  # [T, B]
        s = jnp.einsum("tkgd,bkd->kgtb", qg, k_blk)
        s = jnp.where(visible[None, None], s, neg)
        m_new = jnp.maximum(m, s.max(-1))
        scale = jnp.exp(m - m_new)
        # Masked slots must weigh 0 even while a row has seen nothing (m == neg).
        p = jnp.where(visible[None, None], jnp.exp(s - m_new[..., None]), 0.0)
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("kgtb,bkd->kgtd", p, v_blk)
        return m_new, l, acc

    shape = (num_kv_heads, group, num_tokens)
    init = (jnp.full(shape, neg), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    # The new tokens last; every row sees at least itself, so the final l is > 0.
    s = jnp.einsum("tkgd,ukd->kgtu", qg, k_new.astype(jnp.float32))
    s = jnp.where(mask[None, None], s, neg)
    m_new = jnp.maximum(m, s.max(-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = l * scale + p.sum(-1)
    acc = acc * scale[..., None] + jnp.einsum("kgtu,ukd->kgtd", p, v_new.astype(jnp.float32))
    out = (acc / l[..., None]).transpose(2, 0, 1, 3)  # [T, K, G, D]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
              impl: str = "auto"):
    """Dispatches to an attention implementation; see the module docstring for semantics.

    Args:
      q: [T, H, D] queries of the new tokens (RoPE already applied).
      k_new, v_new: [T, K, D] keys/values of the new tokens.
      k_cache, v_cache: [S, K, D] one layer's cache, or ``None`` (no prefix).
      length: int32 [], committed cache slots visible to every query.
      mask: bool [T, T], visibility among the new tokens.
      scratch_mask: optional bool [T, M], visibility of scratch slots ``length + m``.
      impl: ``"auto"``, ``"reference"`` or ``"kernel"`` (static).
    Returns:
      [T, H, D] attention output.
    """
    if impl not in IMPLEMENTATIONS:
        raise InvalidArgumentError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl == "reference":
        return attention_reference(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)
    if impl == "auto" and jax.default_backend() == "cpu":
        return attention_blocked(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask)
    from specjax import kernels  # imported lazily: Pallas is only needed off the CPU

    return kernels.verify_attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask,
                                    fallback=attention_reference if impl == "auto" else None)
