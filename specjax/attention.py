"""Attention of new tokens against a KV cache prefix plus a mask among the new tokens.

Models call :func:`attention` only; it dispatches to an implementation by name:

* ``"reference"`` -- pure ``jax.numpy`` over the whole static cache; the ground truth;
* ``"kernel"`` -- the Pallas kernels in :mod:`specjax.kernels` (GPU/TPU);
* ``"fused"`` -- the position-ordered kernel (:func:`specjax.kernels.ordered_attention`;
  the split kernel for drafting calls with a scratch window); the models also run their
  projections through the row-tiled linear kernel (:func:`specjax.models.hidden_states`);
* ``"auto"`` -- the kernel on GPU/TPU when one exists for the shapes (soft-capping and
  sliding windows included), else :func:`attention_reference`; where no kernel runs
  natively (a CPU) :func:`attention_blocked`, pure ``jax.numpy`` that reads only the slots
  in use.

Query ``t`` sees every committed cache slot ``s < length`` and the new token ``u`` iff
``mask[t, u]``. An optional ``scratch_mask`` [T, M] also shows it the uncommitted scratch
slot ``length + m`` iff ``scratch_mask[t, m]``: drafters use it to expand a tree level by
level, each level attending to the ancestors evaluated before it. ``mask`` is lower-triangular for prefill/decode and the ancestor mask (each
node sees itself and its ancestors) for tree verification. Every row of ``mask`` must have
its diagonal set, so no row is empty.

The cache is either one layer's ``[S, K, D]`` or every layer's ``[L, S, K, D]`` with a traced
``layer`` index: models pass the whole stacked cache and the index of the layer being run,
so that no implementation needs a copy of the layer's slots (slicing ``[L, S, K, D]`` by a
traced index inside the layer loop would otherwise materialise ``[S, K, D]`` per layer per
step; the kernels read the layer in place, the jnp paths slice only what they read).

Precision: float32 products run at ``Precision.HIGHEST`` (IEEE float32; a GPU's default
for float32 would be TF32, which rounds a verify pass and a one-token step differently),
narrower dtypes at the default (tensor cores, float32 accumulation). See
:func:`specjax.kernels.numerics.matmul_precision`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import kernels, sharding
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import ATTENTION_IMPLEMENTATIONS
from specjax.kernels.numerics import matmul_precision

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS


def _einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(subscripts, a, b, precision=matmul_precision(a, b))


def layer_slice(cache: jax.Array | None, layer) -> jax.Array | None:
    """One layer [S, K, D] of a cache given as [S, K, D] (``layer`` None) or [L, S, K, D]."""
    if cache is None or layer is None:
        return cache
    return jax.lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)


def _scaled_queries(q: jax.Array, num_kv_heads: int, scale: float | None) -> jax.Array:
    """q [T, H, D] as float32 [T, K, H/K, D] times the score scale (default D ** -0.5)."""
    num_tokens, num_heads, head_dim = q.shape
    qg = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    factor = 1.0 / jnp.sqrt(jnp.float32(head_dim)) if scale is None else jnp.float32(scale)
    return qg.astype(jnp.float32) * factor


def _capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit soft-capping), or the scores."""
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _committed_visible(slots: jax.Array, length, first_visible) -> jax.Array:
    """bool [1, S] (or [T, S] with ``first_visible`` [T]): committed slot ``s`` is visible
    iff ``s < length`` (and ``s >= first_visible[t]``, a sliding window; slot s holds
    position s)."""
    visible = (slots < length)[None, :]
    if first_visible is None:
        return visible
    return visible & (slots[None, :] >= first_visible[:, None])


def attention_reference(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_cache: jax.Array | None,  # [S, K, D]
    v_cache: jax.Array | None,  # [S, K, D]
    length: jax.Array | int,  # int32 [], committed slots of the cache
    mask: jax.Array,  # bool [T, T]
    scratch_mask: jax.Array | None = None,  # bool [T, M]
    *,
    layer: jax.Array | int | None = None,  # int32 [], with [L, S, K, D] caches
    scale: float | None = None,
    softcap: float | None = None,
    first_visible: jax.Array | None = None,  # int32 [T]
) -> jax.Array:
    """Pure-jnp attention; returns [T, H, D] in the dtype of ``q`` (``scale``,
    ``softcap``, ``first_visible``: see :func:`attention`)."""
    k_cache, v_cache = layer_slice(k_cache, layer), layer_slice(v_cache, layer)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    qg = _scaled_queries(q, num_kv_heads, scale)
    neg = jnp.float32(-1e30)

    s_new = _capped(_einsum("tkgd,ukd->kgtu", qg, k_new.astype(jnp.float32)), softcap)
    s_new = jnp.where(mask[None, None], s_new, neg)
    if k_cache is None:
        probs = jax.nn.softmax(s_new, axis=-1)
        out = _einsum("kgtu,ukd->tkgd", probs, v_new.astype(jnp.float32))
    else:
        s_old = _capped(_einsum("tkgd,skd->kgts", qg, k_cache.astype(jnp.float32)), softcap)
        slots = jnp.arange(k_cache.shape[0])
        visible = _committed_visible(slots, length, first_visible)  # [1 or T, S]
        if scratch_mask is not None and scratch_mask.shape[1] > 0:
            rel = slots - length
            in_window = (rel >= 0) & (rel < scratch_mask.shape[1])
            window = jnp.take(scratch_mask, jnp.clip(rel, 0, scratch_mask.shape[1] - 1), axis=1)
            visible = visible | (window & in_window[None, :])  # [T, S]
        s_old = jnp.where(visible[None, None], s_old, neg)
        probs = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
        p_old, p_new = probs[..., : k_cache.shape[0]], probs[..., k_cache.shape[0]:]
        out = (_einsum("kgts,skd->tkgd", p_old, v_cache.astype(jnp.float32))
               + _einsum("kgtu,ukd->tkgd", p_new, v_new.astype(jnp.float32)))
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
    layer: jax.Array | int | None = None,  # int32 [], with [L, S, K, D] caches
    scale: float | None = None,
    softcap: float | None = None,
    first_visible: jax.Array | None = None,  # int32 [T]
) -> jax.Array:
    """Same result as :func:`attention_reference`, reading only the cache slots in use.

    The cache is visited in blocks of ``block`` slots by a loop whose trip count is traced
    (``ceil((length + M) / block)``), with an online softmax, so the cost follows the
    committed length instead of the static capacity, and a prefill over an empty cache
    reads nothing; with a sliding window (``first_visible``, no scratch) the loop starts
    at the first block any query sees. This is the CPU path of ``impl="auto"``. With ``layer``, the caches are
    [L, S, K, D] and each block is sliced straight out of layer ``layer``.
    """
    extras = dict(scale=scale, softcap=softcap, first_visible=first_visible)
    if k_cache is None:
        return attention_reference(q, k_new, v_new, None, None, length, mask, **extras)
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    num_tokens, num_heads, head_dim = q.shape
    _, capacity, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block = min(block, capacity)
    window = 0 if scratch_mask is None else scratch_mask.shape[1]
    qg = _scaled_queries(q, num_kv_heads, scale)
    neg = jnp.float32(-1e30)
    length = jnp.asarray(length, jnp.int32)
    used = jnp.minimum(length + window, capacity)
    num_blocks = (used + block - 1) // block

    def body(i, carry):
        m, l, acc = carry
        first = i * block
        start = jnp.minimum(first, capacity - block)  # dynamic_slice would clamp anyway
        slots = start + jnp.arange(block)
        corner, size = (layer, start, 0, 0), (1, block, num_kv_heads, head_dim)
        k_blk = jax.lax.dynamic_slice(k_cache, corner, size)[0].astype(jnp.float32)
        v_blk = jax.lax.dynamic_slice(v_cache, corner, size)[0].astype(jnp.float32)
        visible = _committed_visible(slots, length, first_visible) & (slots >= first)
        if window:
            rel = slots - length
            in_window = (slots >= first) & (rel >= 0) & (rel < window)
            seen = jnp.take(scratch_mask, jnp.clip(rel, 0, window - 1), axis=1)
            visible = visible | (seen & in_window[None, :])  # [T, B]
        s = _capped(_einsum("tkgd,bkd->kgtb", qg, k_blk), softcap)
        s = jnp.where(visible[None, None], s, neg)
        m_new = jnp.maximum(m, s.max(-1))
        scale = jnp.exp(m - m_new)
        # Masked slots must weigh 0 even while a row has seen nothing (m == neg).
        p = jnp.where(visible[None, None], jnp.exp(s - m_new[..., None]), 0.0)
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + _einsum("kgtb,bkd->kgtd", p, v_blk)
        return m_new, l, acc

    shape = (num_kv_heads, group, num_tokens)
    init = (jnp.full(shape, neg), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    first_block = 0
    if first_visible is not None and not window:
        # A sliding window: blocks below every query's window are skipped (exact: such a
        # block would add weight 0 and leave the running maximum alone).
        first_block = jnp.clip(jnp.min(first_visible), 0, capacity) // block
    m, l, acc = jax.lax.fori_loop(first_block, num_blocks, body, init)
    # The new tokens last; every row sees at least itself, so the final l is > 0.
    s = _capped(_einsum("tkgd,ukd->kgtu", qg, k_new.astype(jnp.float32)), softcap)
    s = jnp.where(mask[None, None], s, neg)
    m_new = jnp.maximum(m, s.max(-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    l = l * scale + p.sum(-1)
    acc = acc * scale[..., None] + _einsum("kgtu,ukd->kgtd", p, v_new.astype(jnp.float32))
    out = (acc / l[..., None]).transpose(2, 0, 1, 3)  # [T, K, G, D]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def attention(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
              impl: str = "auto", layer=None, scale=None, softcap=None, first_visible=None,
              interpret_variant: str = "gpu"):
    """Dispatches to an attention implementation; see the module docstring for semantics.

    Args:
      q: [T, H, D] queries of the new tokens (RoPE already applied).
      k_new, v_new: [T, K, D] keys/values of the new tokens.
      k_cache, v_cache: [S, K, D] one layer's cache, [L, S, K, D] every layer's (with
        ``layer``), or ``None`` (no prefix).
      length: int32 [], committed cache slots visible to every query.
      mask: bool [T, T], visibility among the new tokens.
      scratch_mask: optional bool [T, M], visibility of scratch slots ``length + m``.
      impl: ``"auto"``, ``"reference"``, ``"kernel"`` or ``"fused"`` (static).
      layer: int32 [] index of the layer to read when the caches are [L, S, K, D].
      scale: static score scale (default ``D ** -0.5``).
      softcap: static ``c``: scores become ``c * tanh(score / c)`` before the mask.
      first_visible: int32 [T], a sliding window: query ``t`` sees committed slots
        ``first_visible[t] <= s < length`` only (``mask`` carries the window among the new
        tokens; scratch slots are not windowed: they hold tree ancestors, within the tree's
        depth of the query).
      interpret_variant: the kernels interpreted off GPU/TPU (``"gpu"`` or ``"tpu"``,
        ``KernelOptions.interpret_variant``).
    Returns:
      [T, H, D] attention output.
    """
    if impl not in IMPLEMENTATIONS:
        raise InvalidArgumentError(f"unknown attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    extras = dict(scale=scale, softcap=softcap, first_visible=first_visible)
    if impl == "reference":
        return attention_reference(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask,
                                   layer=layer, **extras)
    if impl == "auto" and kernels.select_variant(None, interpret_variant)[1]:
        # No kernel runs natively here (a CPU): the blocked jnp attention.
        return attention_blocked(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask,
                                 layer=layer, **extras)
    if scale is not None and impl != "fused":  # the kernels scale by D ** -0.5
        q = (q.astype(jnp.float32) * (scale * q.shape[-1] ** 0.5)).astype(q.dtype)

    def kernel(*args, layer, first_visible):
        if impl == "fused":  # the ordered kernels scale each score by `scale`; the
            # window by position (`mask` is then the chains' mask without it)
            return kernels.ordered_attention(*args, layer=layer, scale=scale,
                                             softcap=softcap, first_visible=first_visible,
                                             interpret_variant=interpret_variant)
        return kernels.verify_attention(*args, layer=layer, interpret_variant=interpret_variant,
                                        fallback=attention_reference if impl == "auto" else None,
                                        softcap=softcap, first_visible=first_visible)

    # Over a device mesh, once per shard of the heads (a Pallas call is opaque to XLA's
    # partitioner); directly otherwise.
    return sharding.attention_per_shard(kernel, q, k_new, v_new, k_cache, v_cache, length, mask,
                                        scratch_mask, layer=layer, first_visible=first_visible)
