"""Row-tiled fused linear layers for TPUs: Pallas with the Mosaic lowering.

The same computation and contract as :mod:`.linear_gpu` (whose
:func:`~.linear_gpu.fused_linear_reference` is the ground truth of both)::

    y = residual + act(rms_norm(x) @ W + b)        # every part but the matmul optional

for a few query rows: RMSNorm folded in, one matrix or two column ranges feeding SwiGLU,
bias and residual in the epilogue, stacked ``[L, K, N]`` weights read at a traced layer
(scalar-prefetched into SMEM and used by the weights' index maps, so only the blocks of
that layer are ever copied into VMEM), the transposed tied head with float32 logits.

**Grid.** ``(row tiles, column blocks, K chunks)`` with semantics (parallel, parallel,
arbitrary). Step ``k`` multiplies the row tile's ``[block_rows, block_k]`` chunk of x (the
norm applied to it, from the row's sum of squares over the whole row, which is the same
``[block_rows, K]`` input block at every step) by the weight block ``[block_k, block_n]``
and adds the float32 product to a VMEM accumulator; the last step runs the epilogue and
writes the output block.

**Row independence.** ``block_rows`` (16), ``block_n`` and ``block_k`` are functions of
the matrix shape only (:meth:`TpuLinearBlockSizes.resolve`), never of the row count; the
chunks are added in the grid's fixed order ``k = 0, 1, ...``; a row's norm reads only that
row. So a row's arithmetic is the same alone (a one-token step, padded to one tile) or
among 64 tree nodes, and a verify pass reproduces the one-token steps bit for bit.

**Blocks Mosaic accepts.** The last two dims of every block must be multiples of
(8, 128) or the array's whole dims. ``block_k`` is the largest multiple of 128 up to 512
dividing K, else K itself (SmolLM2's 576: one chunk). Columns:

* when the width N and every column offset are multiples of 128: ``block_n`` is the
  largest multiple of 128 up to 512 dividing all of them (gate|up, the head);
* when the call reads a whole matrix (offset 0, N = its width): one block of N columns
  (SmolLM2's o and down projections, 576 wide, and its fused q|k|v, 576|192|192 = 960
  wide, which the model projects in one call and splits after);
* otherwise (a column range that no 128-wide block can start at, such as k alone at
  column 576 of that q|k|v matrix): **the whole width** of the weight is one block; each
  step multiplies all its columns and the epilogue keeps the call's range, a static slice
  of the float32 product. Such a call reads and multiplies the whole matrix for its range;
  the alternative, an unaligned DMA window per call, is not used.

Numerics as :mod:`.linear_gpu`: float32 accumulation, float32 products at
``Precision.HIGHEST``, bf16 on the MXU's default, the epilogue shared with it.

VMEM: the blocks (double-buffered) and the accumulator are estimated by
:func:`vmem_bytes`; :func:`check_supported` refuses calls over
:data:`~.attention_tpu.VMEM_BUDGET` (a full-width block of a huge odd-width matrix, e.g.
a 50257-token tied head), which the dispatcher then runs with the reference.

``interpret=True`` runs the kernel in the TPU interpreter (``pltpu.InterpretParams``) on
any backend: the CPU test path. Compiled for TPU v5e in the test suite
(``tests/test_tpu_compile.py``; Mosaic and XLA run to the end on the CPU); not yet run or
timed on TPU hardware.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.errors import InvalidArgumentError
from . import layout
from .attention_tpu import VMEM_BUDGET, VMEM_LIMIT
# One epilogue and one dot for both kernels: they round exactly as the reference does.
from .linear_gpu import (_dot, _epilogue, check_activation,  # noqa: F401 (re-exports
                         check_call, fused_linear_reference,  # the reference)
                         stacked_operands)

KERNEL_NAME = "TPU fused linear kernel"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MAX_ROWS = 4096  # rows per call; more (a long prefill) goes to the reference path
LANES = 128
MAX_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class TpuLinearBlockSizes:
    """Static tiling of :func:`fused_linear_tpu`.

    Attributes:
      block_rows: rows per tile, a multiple of 16 (bf16's sublane tile; a one-token call
        pads to it).
      block_n: output columns per block, a multiple of 128; ``None``: chosen from the
        shape as the module docstring says (possibly the whole weight width).
      block_k: reduction chunk, a multiple of 128 dividing K; ``None``: the largest up to
        512, or K itself when 128 does not divide K.
      vmem_limit_bytes: scoped VMEM limit; ``None``: :data:`~.attention_tpu.VMEM_LIMIT`.
    """

    block_rows: int = 16
    block_n: int | None = None
    block_k: int | None = None
    vmem_limit_bytes: int | None = None

    def check(self) -> None:
        if self.block_rows < 16 or self.block_rows % 16:
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_rows={self.block_rows} must be a positive multiple of 16")
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < LANES or value % LANES):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: {name}={value} must be a positive multiple of {LANES}")

    def resolve(self, in_features: int, width: int, columns: tuple, offsets: tuple
                ) -> "ResolvedTiling":
        """The tiling of a call reading columns ``offset .. offset + width`` of each
        matrix (``columns`` wide, ``in_features`` = K rows): a function of the shape
        only, never of the row count.

        Raises:
          InvalidArgumentError: an explicit block that does not divide the shape.
        """
        block_k = self.block_k or (_multiple_of_128_divisor(in_features) or in_features)
        if in_features % block_k:
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_k={block_k} does not divide K={in_features}")
        aligned = _multiple_of_128_divisor(width, *offsets)
        if self.block_n is not None:
            if width % self.block_n or any(offset % self.block_n for offset in offsets):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: N={width} (offsets {offsets}) is not a multiple of "
                    f"block_n={self.block_n}")
            aligned = self.block_n
        if aligned:
            return ResolvedTiling(self.block_rows, aligned, block_k, (aligned,) * len(offsets))
        if all(c == width for c in columns) and not any(offsets):
            return ResolvedTiling(self.block_rows, width, block_k, (width,) * len(offsets))
        return ResolvedTiling(self.block_rows, width, block_k, tuple(columns), True)


@dataclasses.dataclass(frozen=True)
class ResolvedTiling:
    """Blocks of one call: ``block_n`` output columns per block, ``part_columns`` the
    columns of each weight's blocks. ``full_width``: a weight block holds all of its
    matrix's columns and the epilogue slices the call's range out of the product."""

    block_rows: int
    block_n: int
    block_k: int
    part_columns: tuple
    full_width: bool = False


def _multiple_of_128_divisor(*values: int) -> int:
    """The largest multiple of 128 up to :data:`MAX_BLOCK` dividing every value (0: none)."""
    for block in range(MAX_BLOCK, 0, -LANES):
        if all(v % block == 0 for v in values):
            return block
    return 0


def vmem_bytes(tiling: ResolvedTiling, *, in_features: int, width: int, num_parts: int,
               itemsize: int, weight_itemsize: int, has_norm: bool, has_residual: bool,
               float32_out: bool) -> int:
    """Estimated VMEM of one call: every block double-buffered, plus the accumulator."""
    rows, block_n, block_k = tiling.block_rows, tiling.block_n, tiling.block_k
    weight_columns = sum(tiling.part_columns)
    windows = (rows * block_k * itemsize  # x chunk
               + (rows * in_features * itemsize if has_norm else 0)  # whole rows
               + block_k * weight_columns * weight_itemsize
               + (8 * block_k * weight_itemsize if has_norm else 0)  # [1, block_k] norm
               + 8 * weight_columns * weight_itemsize  # biases (sublane-padded)
               + (rows * block_n * itemsize if has_residual else 0)
               + rows * block_n * (4 if float32_out else itemsize))
    return 2 * windows + rows * weight_columns * 4  # + the accumulators


def _linear_kernel(layer_ref, x_ref, *refs, num_parts: int, has_norm: bool,
                   has_bias: tuple, has_residual: bool, transposed: bool, slices: tuple,
                   num_k: int, eps: float, float32_out: bool, activation: str | None):
    """One (row tile, column block, K chunk) step.

    Refs: layer_ref int32 [1] (SMEM, used by the index maps only); x_ref the chunk
    [block_rows, block_k]; the whole rows [block_rows, K] if there is a norm; ``num_parts``
    weight blocks [block_k, block_n] ([block_n, block_k] transposed); the norm chunk
    [1, block_k] if any; a bias block [1, block_n] per part that has one; the residual
    block [block_rows, block_n] if any; the output block [block_rows, block_n]; last a
    float32 accumulator scratch [block_rows, columns] per part. ``slices``: per part, the
    static column range of its accumulator kept (the whole block unless full-width).
    """
    del layer_ref
    refs = list(refs)
    rows_ref = refs.pop(0) if has_norm else None
    weight_refs = [refs.pop(0) for _ in range(num_parts)]
    norm_ref = refs.pop(0) if has_norm else None
    bias_refs = [refs.pop(0) if flag else None for flag in has_bias]
    residual_ref = refs.pop(0) if has_residual else None
    o_ref, *acc_refs = refs
    step = pl.program_id(2)
    dtype = x_ref.dtype

    @pl.when(step == 0)
    def _init():
        for acc_ref in acc_refs:
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    xc = x_ref[...]
    if has_norm:
        # The row's sum of squares over all K (recomputed per chunk: the same values).
        whole = rows_ref[...].astype(jnp.float32)
        inv_rms = lax.rsqrt(jnp.sum(whole * whole, axis=1, keepdims=True)
                            / whole.shape[1] + eps)  # [rows, 1]
        xc = (norm_ref[...].astype(dtype)
              * (xc.astype(jnp.float32) * inv_rms).astype(dtype))
    for acc_ref, weight_ref in zip(acc_refs, weight_refs):
        acc_ref[...] += _dot(xc, weight_ref[...].astype(dtype), transposed=transposed)

    @pl.when(step == num_k - 1)
    def _finish():
        parts = [acc_ref[:, start:stop] for acc_ref, (start, stop) in zip(acc_refs, slices)]
        biases = [None if ref is None else ref[...][:, start:stop]
                  for ref, (start, stop) in zip(bias_refs, slices)]
        residual = None if residual_ref is None else residual_ref[...]
        y = _epilogue(parts, biases, residual, dtype=dtype, float32_out=float32_out,
                      activation=activation)
        o_ref[...] = y.astype(o_ref.dtype)


def check_supported(x, weights, *, offsets=(0,), width: int | None = None,
                    transposed: bool = False, stacked: bool = False,
                    block_sizes: TpuLinearBlockSizes = TpuLinearBlockSizes(),
                    has_norm: bool = True, has_residual: bool = True,
                    float32_out: bool = False) -> tuple[ResolvedTiling, int]:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values); the VMEM
    estimate assumes a norm and a residual unless told otherwise. Returns (the tiling, the
    output width N).
    """
    in_features, width = check_call(KERNEL_NAME, x, weights, offsets=offsets, width=width,
                                    transposed=transposed, stacked=stacked, dtypes=DTYPES,
                                    max_rows=MAX_ROWS)
    n_axis = -2 if transposed else -1
    block_sizes.check()
    tiling = block_sizes.resolve(in_features, width, tuple(w.shape[n_axis] for w in weights),
                                 tuple(offsets))
    needed = vmem_bytes(tiling, in_features=in_features, width=width,
                        num_parts=len(weights), itemsize=jnp.dtype(x.dtype).itemsize,
                        weight_itemsize=max(jnp.dtype(w.dtype).itemsize for w in weights),
                        has_norm=has_norm, has_residual=has_residual,
                        float32_out=float32_out)
    if needed > VMEM_BUDGET:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: blocks {tiling.block_k} x {tiling.part_columns} of weight "
            f"{weights[0].shape} need ~{needed / 2**20:.1f} MiB of VMEM (budget "
            f"{VMEM_BUDGET >> 20} MiB)")
    return tiling, width


@functools.partial(jax.jit, static_argnames=(
    "offsets", "width", "transposed", "eps", "float32_out", "activation", "block_sizes",
    "interpret"))
def fused_linear_tpu(x, weights, *, norm=None, biases=None, residual=None, layer=None,
                     offsets=(0,), width: int | None = None, transposed: bool = False,
                     eps: float = 1e-6, float32_out: bool = False,
                     activation: str | None = None,
                     block_sizes: TpuLinearBlockSizes = TpuLinearBlockSizes(),
                     interpret: bool = False):
    """``residual + act(rms_norm(x) @ W + b)`` for a few rows on a TPU; the arguments and
    result are those of :func:`specjax.kernels.linear_gpu.fused_linear_gpu`, with
    ``block_sizes`` a static :class:`TpuLinearBlockSizes` and ``interpret`` running the TPU
    interpreter.

    Returns:
      [T, N] in x's dtype (float32 with ``float32_out``).
    """
    weights = tuple(weights)
    offsets = tuple(offsets)
    stacked = layer is not None
    check_activation(KERNEL_NAME, activation)
    tiling, width = check_supported(
        x, weights, offsets=offsets, width=width, transposed=transposed, stacked=stacked,
        block_sizes=block_sizes, has_norm=norm is not None, has_residual=residual is not None,
        float32_out=float32_out)
    weights, norm, biases = stacked_operands(weights, norm, biases, stacked)
    num_rows, in_features = x.shape
    block_rows, block_n, block_k = tiling.block_rows, tiling.block_n, tiling.block_k
    rows = layout.round_up(num_rows, block_rows)
    x_padded = jnp.pad(x, ((0, rows - num_rows), (0, 0)))
    layer_index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    out_dtype = jnp.float32 if float32_out else x.dtype
    num_k = in_features // block_k

    def column_block(offset):
        # Index of the block holding column `offset`: 0 for a full-width block.
        return 0 if tiling.full_width else offset // block_n

    def weight_spec(offset, columns):
        first = column_block(offset)
        if transposed:
            return pl.BlockSpec((None, columns, block_k),
                                lambda i, j, k, layer_ref: (layer_ref[0], j + first, k))
        return pl.BlockSpec((None, block_k, columns),
                            lambda i, j, k, layer_ref: (layer_ref[0], k, j + first))

    def bias_spec(offset, columns):
        first = column_block(offset)
        return pl.BlockSpec((None, 1, columns),
                            lambda i, j, k, layer_ref: (layer_ref[0], 0, j + first))

    out_spec = pl.BlockSpec((block_rows, block_n), lambda i, j, k, layer_ref: (i, j))
    inputs = [x_padded]
    specs = [pl.BlockSpec((block_rows, block_k), lambda i, j, k, layer_ref: (i, k))]
    if norm is not None:
        inputs.append(x_padded)
        specs.append(pl.BlockSpec((block_rows, in_features),
                                  lambda i, j, k, layer_ref: (i, 0)))
    inputs.extend(weights)
    specs.extend(map(weight_spec, offsets, tiling.part_columns))
    if norm is not None:
        inputs.append(norm.reshape(norm.shape[0], 1, in_features))
        specs.append(pl.BlockSpec((None, 1, block_k),
                                  lambda i, j, k, layer_ref: (layer_ref[0], 0, k)))
    for bias, offset, columns in zip(biases, offsets, tiling.part_columns):
        if bias is not None:
            inputs.append(bias.reshape(bias.shape[0], 1, bias.shape[1]))
            specs.append(bias_spec(offset, columns))
    if residual is not None:
        inputs.append(jnp.pad(residual.astype(x.dtype), ((0, rows - num_rows), (0, 0))))
        specs.append(out_spec)
    slices = tuple((offset, offset + width) if tiling.full_width else (0, block_n)
                   for offset in offsets)
    kernel = functools.partial(
        _linear_kernel, num_parts=len(weights), has_norm=norm is not None,
        has_bias=tuple(b is not None for b in biases), has_residual=residual is not None,
        transposed=transposed, slices=slices, num_k=num_k, eps=float(eps),
        float32_out=float32_out, activation=activation)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows // block_rows, width // block_n, num_k),
            in_specs=specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((block_rows, columns), jnp.float32)
                            for columns in tiling.part_columns],
        ),
        out_shape=jax.ShapeDtypeStruct((rows, width), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=block_sizes.vmem_limit_bytes or VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="fused_linear_tpu",
    )(layer_index, *inputs)
    return out[:num_rows]
