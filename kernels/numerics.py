"""Numerics the models and the kernels' ``*_reference`` implementations share.

The kernels' references compute exactly what the models' jnp layers compute, so the two
call the same functions: the matmul precision rule, RMSNorm and RoPE. They live here, in the
kernels package because kernels import nothing from the models; ``specjax.models.layers``
and ``specjax.attention`` import them from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(*operands) -> jax.lax.Precision:
    """``HIGHEST`` when any operand is float32 (or wider), else ``DEFAULT``.

    The precision every matmul/einsum in the models and the jnp attention paths states
    explicitly, so that ``float32`` means float32 on every backend whatever the global
    ``jax_default_matmul_precision``; bf16/fp16 products keep the fast default.
    """
    wide = any(jnp.dtype(x.dtype).itemsize >= 4 and jnp.issubdtype(x.dtype, jnp.floating)
               for x in operands)
    return jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis: ``weight * x / rms(x)``.

    ``plus_one`` (Gemma): ``(1 + weight) * x / rms(x)``, the product taken in float32 before
    the cast back, as Gemma's reference does (Llama's casts first, then scales).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [T, heads, D] by the tables [T, R] (pairs are (i, i + R/2)): the first R
    dims of each head; the other D - R (partial rotary) pass through unchanged."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]],
                               axis=-1)
    half = rotary // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def write_rope_rows(packed: jax.Array, qkv: jax.Array, layer, cos: jax.Array,
                    sin: jax.Array, rope_heads: int) -> jax.Array:
    """Layer ``layer`` of ``packed`` [L, R, heads, D] := the rows ``qkv`` [R, heads * D]
    split into heads, RoPE (:func:`apply_rope`, tables [R, D]) applied to the first
    ``rope_heads`` (queries and keys): one in-place write of the buffer."""
    rows, heads, dim = packed.shape[1:]
    qkv = qkv.reshape(rows, heads, dim)
    qkv = jnp.concatenate([apply_rope(qkv[:, :rope_heads], cos, sin), qkv[:, rope_heads:]],
                          axis=1)
    return jax.lax.dynamic_update_index_in_dim(packed, qkv.astype(packed.dtype), layer, 0)
