"""Row-tiled RMSNorm of column groups in place, for GPUs: Pallas with the Triton lowering.

The q/k norms of the fused layers (Qwen3, Gemma 3, Qwen3-MoE: RMSNorm of each query and
key head; OLMo 2/3, OLMoE: of all the query heads at once, and of all the key heads)::

    x[:, start + g*W : start + (g+1)*W] := rms_norm(that group, weight[layer])

for ``g < groups``, on the q|k|v rows of a projection, written in place (the rows are
aliased to the output; columns outside the groups, such as the value heads, are kept).

**Row independence.** The norm is a reduction, and a reduction written in ``jax.numpy``
between the kernels may be tiled by XLA from the shape, that is from the number of rows.
Here a program takes a tile of ``block_rows`` (16) rows and one group; the sum of squares
runs over the group's columns chunk by chunk (``chunk``: the largest power of two <= 128
dividing W), in a fixed order, from that row alone. Nothing depends on the row count, so
a row's result is the same in a one-token step and in a verify pass.

Numerics follow :func:`specjax.kernels.numerics.rms_norm` (float32 statistics, the
normed row cast to the input dtype before the weight); :func:`rms_norm_groups_reference`
is the same in ``jax.numpy``. ``interpret=True`` runs the kernel in Pallas' generic
interpreter (the CPU test path).
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

KERNEL_NAME = "GPU group RMSNorm kernel"
DTYPES = layout.FLOAT_DTYPES


@dataclasses.dataclass(frozen=True)
class GpuNormBlockSizes:
    """Static tiling of :func:`rms_norm_groups_gpu`.

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


def check_supported(x, weight, *, start: int, groups: int,
                    block_sizes: GpuNormBlockSizes = GpuNormBlockSizes()) -> GpuNormBlockSizes:
    """Raises :class:`InvalidArgumentError` (one line) unless :func:`rms_norm_groups_gpu`
    takes the call; returns the resolved block sizes. Reads shapes and dtypes only."""
    if x.ndim != 2 or weight.ndim != 2:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: x must be [R, N] and the weight [L, W], got {x.shape} and "
            f"{weight.shape}")
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


def _norm_kernel(layer_ref, weight_ref, x_ref, o_ref, *, start: int, width: int,
                 chunk: int, block_rows: int, eps: float):
    """One (row tile, group) program; x_ref and o_ref are the same (aliased) [R, N] rows."""
    layer = layer_ref[0]
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_rows, block_rows), block_rows)
    base = start + pl.program_id(1) * width
    num = width // chunk
    dtype = x_ref.dtype

    def sum_squares(c, total):
        xc = x_ref[rows, pl.ds(base + c * chunk, chunk)].astype(jnp.float32)
        return total + jnp.sum(xc * xc, axis=1)

    total = lax.fori_loop(0, num, sum_squares, jnp.zeros((block_rows,), jnp.float32))
    inv_rms = lax.rsqrt(total / width + eps)

    def write(c, carry):
        columns = pl.ds(base + c * chunk, chunk)
        xc = x_ref[rows, columns].astype(jnp.float32)
        scale = weight_ref[layer, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)]
        o_ref[rows, columns] = scale.astype(dtype)[None, :] * (xc * inv_rms[:, None]).astype(
            dtype)
        return carry

    lax.fori_loop(0, num, write, 0)


@functools.partial(jax.jit, static_argnames=("start", "groups", "eps", "block_sizes",
                                             "interpret"))
def rms_norm_groups_gpu(x, weight, layer, *, start: int, groups: int, eps: float = 1e-6,
                        block_sizes: GpuNormBlockSizes = GpuNormBlockSizes(),
                        interpret: bool = False):
    """``x`` [R, N] with ``groups`` column groups of width W from column ``start`` each
    RMSNorm'd by ``weight[layer]`` (``weight`` [L, W], read in place at the traced
    ``layer``), the other columns unchanged; see the module docstring.

    Args:
      x: [R, N] rows, R a multiple of ``block_rows``.
      weight: [L, W] stacked norm weights; layer: int32 [].
      start, groups: the first group's column and the number of groups (static).
      eps: the norm's epsilon.
      block_sizes: static :class:`GpuNormBlockSizes`.
      interpret: Pallas' interpreter instead of a GPU compile.
    Returns:
      [R, N] in x's dtype.
    """
    config = check_supported(x, weight, start=start, groups=groups, block_sizes=block_sizes)
    width = weight.shape[1]
    kernel = functools.partial(_norm_kernel, start=start, width=width, chunk=config.chunk,
                               block_rows=config.block_rows, eps=float(eps))
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0] // config.block_rows, groups),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="rms_norm_groups_gpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), weight, x)


def rms_norm_groups_reference(x, weight, layer, *, start: int, groups: int,
                              eps: float = 1e-6):
    """:func:`rms_norm_groups_gpu` in ``jax.numpy`` (:func:`.numerics.rms_norm`)."""
    width = weight.shape[1]
    end = start + groups * width
    part = x[:, start:end].reshape(x.shape[0], groups, width)
    normed = rms_norm(part, jax.lax.dynamic_index_in_dim(weight, layer, keepdims=False), eps)
    return jnp.concatenate([x[:, :start], normed.reshape(x.shape[0], -1).astype(x.dtype),
                            x[:, end:]], axis=1)
