"""Row-tiled norms of column groups in place, for GPUs: Pallas with the Triton lowering.

The norms of the fused layers that the projection kernels do not fold in: the q/k norms
(Qwen3, Gemma 3, Qwen3-MoE: RMSNorm of each query and key head; OLMo 2/3, OLMoE: of all the
query heads at once, and of all the key heads), the norms on the attention and MLP outputs
(Gemma 2/3, OLMo 2/3), and input norms other than Llama's RMSNorm (LayerNorm with or
without a bias, RMSNorm by ``1 + w``)::

    x[:, start + g*W : start + (g+1)*W] := norm(that group, weight[layer], bias[layer])

for ``g < groups``, written in place (the rows are aliased to the output; columns outside
the groups, such as the value heads, are kept). ``kind``: ``"rms"``
(:func:`.numerics.rms_norm`), ``"rms_plus_one"`` (the same by ``1 + w``, Gemma's) or
``"layer"`` (LayerNorm, as ``specjax.models.layers.layer_norm``).

**Row independence.** A norm is a reduction, and a reduction written in ``jax.numpy``
between the kernels may be tiled by XLA from the shape, that is from the number of rows.
Here a program takes a tile of ``block_rows`` (16) rows and one group; each sum (of
squares; LayerNorm's sum, then its sum of squared deviations) runs over the group's
columns chunk by chunk (``chunk``: the largest power of two <= 128 dividing W), in a fixed
order, from that row alone. Nothing depends on the row count, so a row's result is the
same in a one-token step and in a verify pass.

Numerics follow the models' norms (float32 statistics; RMSNorm casts the normed row to the
input dtype before the weight, the others scale in float32 and cast last);
:func:`norm_groups_reference` is the same in ``jax.numpy``. ``interpret=True`` runs the
kernel in Pallas' generic interpreter (the CPU test path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.errors import InvalidArgumentError
from . import layout
from .numerics import rms_norm

KERNEL_NAME = "GPU group norm kernel"
DTYPES = layout.FLOAT_DTYPES
KINDS = ("rms", "rms_plus_one", "layer")


@dataclasses.dataclass(frozen=True)
class GpuNormBlockSizes:
    """Static tiling of :func:`norm_groups_gpu`.

    Attributes:
      block_rows: rows per program (a power of two >= 16; the fused layers' row tile).
      chunk: columns summed per step; ``None``: the largest power of two <= 128 dividing
        the group width (a function of the width only).
      num_warps, num_stages: Triton launch parameters.
    """

    block_rows: int = 16
    chunk: int | None = None
    num_warps: int = 4
    num_stages: int = 1

    def resolve(self, width: int) -> "GpuNormBlockSizes":
        return dataclasses.replace(self, chunk=self.chunk or min(width & -width, 128))


def check_supported(x, weight, *, start: int, groups: int, kind: str = "rms", bias=None,
                    block_sizes: GpuNormBlockSizes = GpuNormBlockSizes()) -> GpuNormBlockSizes:
    """Raises :class:`InvalidArgumentError` (one line) unless :func:`norm_groups_gpu`
    takes the call; returns the resolved block sizes. Reads shapes and dtypes only."""
    if x.ndim != 2 or weight.ndim != 2:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: x must be [R, N] and the weight [L, W], got {x.shape} and "
            f"{weight.shape}")
    if kind not in KINDS:
        raise InvalidArgumentError(f"{KERNEL_NAME}: kind {kind!r} is not one of {KINDS}")
    if bias is not None and (kind != "layer" or tuple(bias.shape) != tuple(weight.shape)):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: a bias is LayerNorm's, of the weight's shape {weight.shape}; got "
            f"{tuple(bias.shape)} with kind {kind!r}")
    if jnp.dtype(x.dtype) not in DTYPES:
        raise InvalidArgumentError(f"{KERNEL_NAME}: dtype {x.dtype} is not supported")
    width = weight.shape[1]
    config = block_sizes.resolve(width)
    rows, chunk = config.block_rows, config.chunk
    if rows < 16 or rows & (rows - 1) or chunk < 16 or chunk & (chunk - 1) or width % chunk:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: group width {width} must be a multiple of 16 (chunk {chunk}) "
            f"and block_rows={rows} a power of two >= 16")
    if x.shape[0] % rows:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {x.shape[0]} rows are not a multiple of block_rows={rows}")
    if start < 0 or groups < 1 or start + groups * width > x.shape[1]:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {groups} groups of {width} from column {start} are outside "
            f"x {x.shape}")
    return config


def _norm_kernel(layer_ref, weight_ref, *refs, start: int, width: int, chunk: int,
                 block_rows: int, eps: float, kind: str, has_bias: bool):
    """One (row tile, group) program. Refs: layer int32 [1], weight [L, W], the bias [L, W]
    if any, then x and the output: the same (aliased) [R, N] rows."""
    bias_ref = refs[0] if has_bias else None
    x_ref, o_ref = refs[-2:]
    layer = layer_ref[0]
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_rows, block_rows), block_rows)
    base = start + pl.program_id(1) * width
    num = width // chunk
    dtype = x_ref.dtype

    def load(c):
        return x_ref[rows, pl.ds(base + c * chunk, chunk)].astype(jnp.float32)

    def row_sum(term):  # sum over the group's chunks in order: [block_rows]
        return lax.fori_loop(0, num, lambda c, total: total + jnp.sum(term(c), axis=1),
                             jnp.zeros((block_rows,), jnp.float32))

    mean = row_sum(load) / width if kind == "layer" else None
    if kind == "layer":
        inv = lax.rsqrt(row_sum(lambda c: jnp.square(load(c) - mean[:, None])) / width + eps)
    else:
        inv = lax.rsqrt(row_sum(lambda c: load(c) * load(c)) / width + eps)

    def write(c, carry):
        columns = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        xc = load(c)
        scale = weight_ref[layer, columns]
        if kind == "rms":
            y = scale.astype(dtype)[None, :] * (xc * inv[:, None]).astype(dtype)
        elif kind == "rms_plus_one":
            y = xc * inv[:, None] * (1.0 + scale.astype(jnp.float32))[None, :]
        else:
            y = (xc - mean[:, None]) * inv[:, None] * scale.astype(jnp.float32)[None, :]
            if bias_ref is not None:
                y = y + bias_ref[layer, columns].astype(jnp.float32)[None, :]
        o_ref[rows, pl.ds(base + c * chunk, chunk)] = y.astype(dtype)
        return carry

    lax.fori_loop(0, num, write, 0)


@functools.partial(jax.jit, static_argnames=("start", "groups", "eps", "kind", "block_sizes",
                                             "interpret"))
def norm_groups_gpu(x, weight, layer, *, start: int, groups: int, eps: float = 1e-6,
                    kind: str = "rms", bias=None,
                    block_sizes: GpuNormBlockSizes = GpuNormBlockSizes(),
                    interpret: bool = False):
    """``x`` [R, N] with ``groups`` column groups of width W from column ``start`` each
    normed (``kind``, see the module docstring) by ``weight[layer]`` (``weight`` [L, W],
    read in place at the traced ``layer``; LayerNorm's ``bias`` [L, W] likewise), the other
    columns unchanged.

    Args:
      x: [R, N] rows, R a multiple of ``block_rows``.
      weight: [L, W] stacked norm weights; layer: int32 [].
      start, groups: the first group's column and the number of groups (static).
      eps: the norm's epsilon.
      kind: ``"rms"``, ``"rms_plus_one"`` or ``"layer"`` (static).
      bias: LayerNorm's [L, W] bias, or ``None``.
      block_sizes: static :class:`GpuNormBlockSizes`.
      interpret: Pallas' interpreter instead of a GPU compile.
    Returns:
      [R, N] in x's dtype.
    """
    config = check_supported(x, weight, start=start, groups=groups, kind=kind, bias=bias,
                             block_sizes=block_sizes)
    width = weight.shape[1]
    kernel = functools.partial(_norm_kernel, start=start, width=width, chunk=config.chunk,
                               block_rows=config.block_rows, eps=float(eps), kind=kind,
                               has_bias=bias is not None)
    inputs = [jnp.asarray(layer, jnp.int32).reshape(1), weight]
    inputs += [bias] if bias is not None else []
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0] // config.block_rows, groups),
        in_specs=[pl.no_block_spec] * (len(inputs) + 1),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        input_output_aliases={len(inputs): 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="norm_groups_gpu",
    )(*inputs, x)


def norm_groups_reference(x, weight, layer, *, start: int, groups: int, eps: float = 1e-6,
                          kind: str = "rms", bias=None):
    """:func:`norm_groups_gpu` in ``jax.numpy`` (the models' norms)."""
    width = weight.shape[1]
    end = start + groups * width
    part = x[:, start:end].reshape(x.shape[0], groups, width)
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
    if kind == "layer":
        xf = part.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        normed = (xf - mean) * jax.lax.rsqrt(var + eps) * pick(weight).astype(jnp.float32)
        if bias is not None:
            normed = normed + pick(bias).astype(jnp.float32)
    else:
        normed = rms_norm(part, pick(weight), eps, plus_one=kind == "rms_plus_one")
    return jnp.concatenate([x[:, :start], normed.reshape(x.shape[0], -1).astype(x.dtype),
                            x[:, end:]], axis=1)
