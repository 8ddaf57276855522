"""Building blocks shared by the model families: norms, RoPE, projections.

All functions are pure and shape-polymorphic over leading axes. Norm statistics are
computed in float32 and cast back to the input dtype, as the reference implementations do.
Matmuls state their precision (HIGHEST for float32 operands) rather than relying on the
global ``jax_default_matmul_precision``.

RMSNorm, RoPE and the precision rule are defined in :mod:`specjax.kernels.numerics` (the
kernels' references call them too) and imported here for the families.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.kernels.numerics import (apply_rope, matmul_precision, rms_norm,  # noqa: F401
                                      write_rope_rows)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array | None,
               eps: float) -> jax.Array:
    """LayerNorm over the last axis (``bias`` ``None``: a scale only)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig, local: bool = False) -> jax.Array:
    """Per-pair inverse frequencies [R/2] (R = ``config.rope_dim``), scaled as
    ``config.rope_scaling`` says (``local``: the sliding-window layers' base
    ``config.local_rope_theta``, unscaled)."""
    dim = config.rope_dim
    theta = config.local_rope_theta if local else config.rope_theta
    base_powers = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv_freq = 1.0 / base_powers
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":
        factors = scaling.long_factor if scaling.long else scaling.short_factor
        return 1.0 / (jnp.asarray(factors, jnp.float32) * base_powers)
    if scaling.kind == "yarn":
        return _yarn_frequencies(base_powers, scaling, dim, theta)
    # Llama 3: long wavelengths are divided by ``factor``, short ones kept, and the band in
    # between interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def _yarn_frequencies(base_powers: jax.Array, scaling, dim: int,
                      theta: float) -> jax.Array:
    """YaRN: the pairs that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times
    kept, and a linear ramp over pair indices blends the band between."""
    def pair_turning(rotations):  # the (fractional) pair index that turns `rotations` times
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    interpolated = 1.0 / (scaling.factor * base_powers)
    return interpolated * (1 - keep) + (1.0 / base_powers) * keep


def rope_tables(config: ModelConfig, positions: jax.Array,
                local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [T, R] for position ids [T] (half-split layout, as in HF; R =
    ``config.rope_dim``), times the scaling's ``attention_factor`` (YaRN, LongRoPE; it
    scales queries and keys alike); ``local``: see :func:`rope_inverse_frequencies`."""
    inv_freq = rope_inverse_frequencies(config, local)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    scaling = None if local else config.rope_scaling
    factor = 1.0 if scaling is None else scaling.attention_factor
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (PyTorch's ``gelu(approximate="tanh")``)."""
    return jax.nn.gelu(x, approximate=True)


def dense(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight (+ bias)`` with weight stored [in, out], at the precision of the dtype
    (float32: IEEE float32, never TF32; see :func:`specjax.kernels.numerics.matmul_precision`)."""
    weight = weight.astype(x.dtype)
    y = jnp.dot(x, weight, precision=matmul_precision(x, weight))
    return y if bias is None else y + bias.astype(x.dtype)


def fuse_groups(layers: dict, groups: dict, concat=None) -> dict:
    """``layers`` with each group of parameters concatenated along the last axis.

    Args:
      layers: a family's stacked ``layers`` subtree (separate layout).
      groups: fused name -> the parameter names it concatenates, in order (a group whose
        parts are not all present is left alone).
      concat: how to join a group (default ``jnp.concatenate`` along the last axis; the
        families pass a shape rule to derive fused shapes).
    """
    concat = concat or (lambda parts: jnp.concatenate(parts, axis=-1))
    out = dict(layers)
    for name, parts in groups.items():
        if all(part in out for part in parts):
            out[name] = concat([out.pop(part) for part in parts])
    return out


def unfuse_groups(layers: dict, groups: dict, widths: dict) -> dict:
    """Inverse of :func:`fuse_groups` (an exact split), ``widths[name]`` giving each part's
    size along the last axis."""
    out = dict(layers)
    for name, parts in groups.items():
        if name in out:
            bounds = [sum(widths[name][:i + 1]) for i in range(len(parts) - 1)]
            out.update(zip(parts, jnp.split(out.pop(name), bounds, axis=-1)))
    return out


def concat_shapes(parts) -> tuple:
    """The shape of ``parts`` (shapes) concatenated along their last axis."""
    return tuple(parts[0][:-1]) + (sum(p[-1] for p in parts),)
