"""Row-tiled fused linear layers for GPUs: Pallas with the Triton lowering.

One kernel computes, for a few query rows (a decode token, or the nodes of a verify pass)::

    y = residual + act(rms_norm(x) @ W + b)        # every part but the matmul optional

* ``rms_norm`` (``norm=``): the RMSNorm before a projection (attention, MLP, final norm),
  recomputed per tile from the rows in registers, never written to memory;
* ``W`` one matrix, or two column ranges whose outputs feed SwiGLU (``silu(gate) * up``),
  from one fused ``w_gate_up`` (the same array twice, at column offsets 0 and F) or from
  separate ``w_gate``/``w_up``; ``activation=`` picks the gate's GELU instead (GeGLU), or
  activates one matrix's product (a two-matrix MLP's up projection), in float32 in the
  epilogue (the erf GELU by a rational approximation: Triton's lowering has no erf);
* ``residual=``: the skip connection, added in the epilogue;
* weights stacked over layers ``[L, K, N]`` are read in place at a traced ``layer`` (the
  layer loop never copies a layer's matrices out); ``transposed=True`` reads ``[.., N, K]``
  (a tied embedding used as the output head).

This replaces, per projection, the norm's reduction and scaling, the matmul, the bias add,
the activation and the residual add (separate XLA ops, most of them separate kernels on a
GPU) by one launch.

:func:`qkv_rope_into_gpu` is the same kernel for a layer's fused q|k|v projection with
RoPE and the write in its epilogue: a program computes one chunk of *both* halves of a
head (RoPE rotates column i with column i + D/2, and a Triton tile cannot permute its
columns), rotates the query and key heads, and stores into layer ``l`` of the packed
``[L, R, heads, D]`` buffer that the attention kernel reads (aliased to its output, so
written in place).

**Row independence.** The row tile (``block_rows``, 16), the column block and the
reduction chunk (``block_k``) depend on the matrix shape only, never on the number of rows;
the reduction over K runs chunk by chunk in a fixed order; a row's norm uses only that
row. So a row's arithmetic is the same whether it is alone (a one-token step, padded to
one 16-row tile) or one of 64 tree nodes: a verify pass reproduces the one-token step's
logits bit for bit (``tests/test_linear_kernel.py`` checks this for whole models).

Numerics follow the models' (:mod:`.numerics`): float32 accumulation; float32 products at
``Precision.HIGHEST`` (never TF32); the norm in float32, cast back to the input dtype
before the norm weight, as the reference does. :func:`fused_linear_reference` is the same
computation in ``jax.numpy`` (the ground truth the tests compare against).

``interpret=True`` runs the kernel in Pallas' generic interpreter on any backend (the CPU
test path).
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
from .numerics import matmul_precision, rms_norm, write_rope_rows

KERNEL_NAME = "GPU fused linear kernel"
DTYPES = layout.FLOAT_DTYPES
MAX_ROWS = 4096  # rows per call; more (a long prefill) goes to the reference path


@dataclasses.dataclass(frozen=True)
class GpuLinearBlockSizes:
    """Static tiling of :func:`fused_linear_gpu` (powers of two >= 16).

    Attributes:
      block_rows: rows per program (16: the smallest Triton dot; a one-token call pads to it).
      block_n: output columns per program; ``None``: the largest power of two <= 128 that
        divides the output width while giving at least about two programs per streaming
        multiprocessor for one row tile.
      block_k: reduction chunk; ``None``: the largest power of two <= 128 dividing K.
      num_warps, num_stages: Triton launch parameters.
    """

    block_rows: int = 16
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def resolve(self, in_features: int, out_features: int) -> "GpuLinearBlockSizes":
        """The sizes for a [K=in_features] -> [N=out_features] matrix: a function of the
        shape only (see the module docstring), never of the row count."""
        block_k = self.block_k or _power_of_2_divisor(in_features, 128)
        block_n = self.block_n
        if block_n is None:
            wanted = max(16, 1 << max(0, (out_features // (2 * _multiprocessor_count()))
                                      .bit_length() - 1))
            block_n = min(_power_of_2_divisor(out_features, 128), wanted)
            block_n = max(block_n, min(16, _power_of_2_divisor(out_features, 16)))
        return dataclasses.replace(self, block_n=block_n, block_k=block_k)

    def check(self) -> None:
        for name in ("block_rows", "block_n", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: {name}={value} must be a power of two >= 16")


def _power_of_2_divisor(value: int, cap: int) -> int:
    """The largest power of two <= cap dividing value (1 when value is odd)."""
    return min(value & -value, cap) if value > 0 else 1


def _multiprocessor_count() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)  # 132: an H100 SXM


def _dot(a, b, *, transposed: bool):
    """a @ b (b [K, N]) or a @ b.T (b [N, K]) with float32 accumulation."""
    precision = lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else \
        lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (1 if transposed else 0,)), ((), ())),
                           precision=(precision, precision),
                           preferred_element_type=jnp.float32)


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


# erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4] (+-1 in float32 beyond): the float32 rational
# approximation of Eigen and XLA's CPU and GPU backends. Pallas' Triton lowering has no erf.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def _erf(x):
    """erf of float32 ``x`` in elementwise operations every lowering has."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    p, q = jnp.full_like(x, _ERF_P[0]), jnp.full_like(x, _ERF_Q[0])
    for c in _ERF_P[1:]:
        p = p * x2 + c
    for c in _ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


def _activate(activation: str, y):
    """``activation`` of float32 ``y``: SiLU, the tanh GELU, or the exact (erf) GELU."""
    if activation == "silu":
        return y * (1.0 / (1.0 + jnp.exp(-y)))
    if activation == "gelu_tanh":
        return 0.5 * y * (1.0 + jnp.tanh(0.7978845608028654 * (y + 0.044715 * y * y * y)))
    return 0.5 * y * (1.0 + _erf(y * 0.7071067811865476))


def check_activation(kernel_name: str, activation: str | None) -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise InvalidArgumentError(
            f"{kernel_name}: activation {activation!r} is not one of {ACTIVATIONS}")


def _epilogue(parts, biases, residual, *, dtype, float32_out: bool,
              activation: str | None = None):
    """From the float32 products of the 1-2 column ranges to the output, as the
    reference rounds: product in ``dtype`` (+ bias), the gated activation of two ranges
    (``activation``, SiLU by default: SwiGLU) or the activation of one (none by
    default), + residual."""
    if float32_out:
        y = parts[0]
        for bias in biases[:1]:
            if bias is not None:
                y = y + bias.astype(jnp.float32)
        return y
    outs = []
    for part, bias in zip(parts, biases):
        y = part.astype(dtype)
        if bias is not None:
            y = y + bias.astype(dtype)
        outs.append(y)
    if len(outs) == 2:
        gate = outs[0].astype(jnp.float32)
        y = _activate(activation or "silu", gate).astype(dtype) * outs[1]
    elif activation is not None:
        y = _activate(activation, outs[0].astype(jnp.float32)).astype(dtype)
    else:
        y = outs[0]
    if residual is not None:
        y = residual + y
    return y


def _products(layer, x_ref, weight_refs, norm_ref, *, rows, cols: tuple, transposed: bool,
              block_rows: int, block_n: int, block_k: int, num_k: int, eps: float):
    """The float32 products [block_rows, block_n] of the row tile ``rows`` (RMSNorm'd when
    ``norm_ref``) with each weight's columns ``cols[i]:cols[i] + block_n``, the reduction
    over K chunk by chunk in a fixed order (the same for any number of rows)."""
    dtype = x_ref.dtype
    inv_rms = None
    if norm_ref is not None:
        def sum_squares(chunk, total):
            xc = x_ref[rows, pl.ds(pl.multiple_of(chunk * block_k, block_k), block_k)]
            xc = xc.astype(jnp.float32)
            return total + jnp.sum(xc * xc, axis=1)

        total = lax.fori_loop(0, num_k, sum_squares, jnp.zeros((block_rows,), jnp.float32))
        inv_rms = lax.rsqrt(total / (num_k * block_k) + eps)

    def accumulate(chunk, accs):
        k0 = pl.multiple_of(chunk * block_k, block_k)
        xc = x_ref[rows, pl.ds(k0, block_k)]
        if norm_ref is not None:
            scale = norm_ref[layer, pl.ds(k0, block_k)]
            xc = (scale.astype(dtype)[None, :]
                  * (xc.astype(jnp.float32) * inv_rms[:, None]).astype(dtype))
        out = []
        for acc, weight_ref, col in zip(accs, weight_refs, cols):
            columns = pl.ds(col, block_n)
            w = weight_ref[layer, columns, pl.ds(k0, block_k)] if transposed else \
                weight_ref[layer, pl.ds(k0, block_k), columns]
            out.append(acc + _dot(xc, w.astype(dtype), transposed=transposed))
        return tuple(out)

    init = tuple(jnp.zeros((block_rows, block_n), jnp.float32) for _ in weight_refs)
    return lax.fori_loop(0, num_k, accumulate, init)


def _linear_kernel(layer_ref, x_ref, *refs, num_parts: int, offsets: tuple, has_norm: bool,
                   has_bias: tuple, has_residual: bool, transposed: bool, block_rows: int,
                   block_n: int, block_k: int, num_k: int, eps: float, float32_out: bool,
                   activation: str | None = None):
    """One (row tile, column block) program.

    Refs: layer_ref int32 [1]; x_ref the whole padded input [R, K]; then ``num_parts``
    weight refs (whole, [L, K, N] or [L, N, K]); the norm weight [L, K] if any; a bias
    [L, N] per part that has one; the residual block [block_rows, block_n] if any; last
    the output block [block_rows, block_n].
    """
    refs = list(refs)
    weight_refs = [refs.pop(0) for _ in range(num_parts)]
    norm_ref = refs.pop(0) if has_norm else None
    bias_refs = [refs.pop(0) if flag else None for flag in has_bias]
    residual_ref = refs.pop(0) if has_residual else None
    (o_ref,) = refs
    layer = layer_ref[0]
    row0 = pl.multiple_of(pl.program_id(0) * block_rows, block_rows)
    col0 = pl.multiple_of(pl.program_id(1) * block_n, block_n)
    parts = _products(layer, x_ref, weight_refs, norm_ref,
                      rows=pl.ds(row0, block_rows),
                      cols=tuple(col0 + offset for offset in offsets), transposed=transposed,
                      block_rows=block_rows, block_n=block_n, block_k=block_k, num_k=num_k,
                      eps=eps)
    biases = [None if ref is None else ref[layer, pl.ds(col0 + offset, block_n)]
              for ref, offset in zip(bias_refs, offsets)]
    residual = None if residual_ref is None else residual_ref[...]
    y = _epilogue(parts, biases, residual, dtype=x_ref.dtype, float32_out=float32_out,
                  activation=activation)
    o_ref[...] = y.astype(o_ref.dtype)


def check_call(kernel_name: str, x, weights, *, offsets, width: int | None,
               transposed: bool, stacked: bool, dtypes=DTYPES, max_rows: int = MAX_ROWS
               ) -> tuple[int, int]:
    """The one-line checks every fused linear kernel (GPU, TPU) makes of a call: x's rank,
    dtype and row count, the weights' ranks and input features, the column ranges.
    Returns (K, the output width N).
    """
    if x.ndim != 2:
        raise InvalidArgumentError(f"{kernel_name}: x must be [T, K], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in dtypes:
        raise InvalidArgumentError(f"{kernel_name}: dtype {x.dtype} is not supported")
    if not 1 <= x.shape[0] <= max_rows:
        raise InvalidArgumentError(
            f"{kernel_name}: {x.shape[0]} rows; the kernel takes 1 to {max_rows}")
    if len(weights) not in (1, 2) or len(offsets) != len(weights):
        raise InvalidArgumentError(
            f"{kernel_name}: one or two weights with one column offset each, got "
            f"{len(weights)} weights and offsets {offsets}")
    rank = 3 if stacked else 2
    k_axis, n_axis = (-1, -2) if transposed else (-2, -1)
    in_features = x.shape[1]
    if width is None:
        width = weights[0].shape[n_axis] - offsets[0]
    for w, offset in zip(weights, offsets):
        if w.ndim != rank:
            raise InvalidArgumentError(
                f"{kernel_name}: weights must have rank {rank}, got shape {w.shape}")
        if w.shape[k_axis] != in_features:
            raise InvalidArgumentError(
                f"{kernel_name}: weight {w.shape} does not take {in_features} input features")
        if offset < 0 or offset + width > w.shape[n_axis]:
            raise InvalidArgumentError(
                f"{kernel_name}: columns {offset}..{offset + width} are outside weight "
                f"{w.shape}")
    return in_features, width


def stacked_operands(weights: tuple, norm, biases, stacked: bool) -> tuple:
    """(weights, norm, biases) with the layer axis the kernels index: unstacked ones as a
    one-layer stack (free reshapes); biases one per weight, ``None`` where absent."""
    biases = tuple(biases) if biases is not None else (None,) * len(weights)
    if not stacked:
        weights = tuple(w[None] for w in weights)
        norm = None if norm is None else norm[None]
        biases = tuple(None if b is None else b[None] for b in biases)
    return weights, norm, biases


def check_supported(x, weights, *, offsets=(0,), width: int | None = None,
                    transposed: bool = False, stacked: bool = False,
                    block_sizes: GpuLinearBlockSizes = GpuLinearBlockSizes()
                    ) -> tuple[GpuLinearBlockSizes, int]:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values). Returns
    (the resolved block sizes, the output width N).
    """
    in_features, width = check_call(KERNEL_NAME, x, weights, offsets=offsets, width=width,
                                    transposed=transposed, stacked=stacked)
    block_sizes.check()
    if in_features % 16 or width % 16:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: K={in_features} and N={width} must be multiples of 16 (the "
            f"smallest Triton tile)")
    config = block_sizes.resolve(in_features, width)
    config.check()
    if in_features % config.block_k or width % config.block_n or any(
            offset % config.block_n for offset in offsets):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: K={in_features}, N={width} (offsets {offsets}) are not "
            f"multiples of the blocks {config.block_k} x {config.block_n}")
    return config, width


@functools.partial(jax.jit, static_argnames=(
    "offsets", "width", "transposed", "eps", "float32_out", "activation", "block_sizes",
    "interpret"))
def fused_linear_gpu(x, weights, *, norm=None, biases=None, residual=None, layer=None,
                     offsets=(0,), width: int | None = None, transposed: bool = False,
                     eps: float = 1e-6, float32_out: bool = False,
                     activation: str | None = None,
                     block_sizes: GpuLinearBlockSizes = GpuLinearBlockSizes(),
                     interpret: bool = False):
    """``residual + act(rms_norm(x) @ W + b)`` for a few rows; see the module docstring.

    Args:
      x: [T, K] input rows.
      weights: tuple of one or two matrices, [K, N'] or, with ``layer``, [L, K, N']
        ([.., N', K] when ``transposed``). Two matrices (possibly the same array) give
        SwiGLU: ``silu(x W0[:, o0:o0+N]) * (x W1[:, o1:o1+N])``.
      norm: optional RMSNorm weight [K] ([L, K] with ``layer``) applied to x first.
      biases: optional tuple, one bias [N'] ([L, N']) or ``None`` per weight.
      residual: optional [T, N] added to the result.
      layer: int32 [] traced layer of stacked weights; ``None`` for unstacked ones.
      offsets: static first output column of each weight's range.
      width: static output width N (default: the first weight's columns after its offset).
      transposed: weights are stored [.., N', K].
      eps: the norm's epsilon.
      float32_out: return the float32 product (+ bias) without rounding to x's dtype (the
        logits head).
      activation: static ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``: the gate's activation
        with two weights (``None``: SiLU), or the activation of one weight's product
        (``None``: none; a two-matrix MLP's up projection).
      block_sizes: static :class:`GpuLinearBlockSizes`.
      interpret: run in Pallas' interpreter (any backend) instead of compiling for a GPU.
    Returns:
      [T, N] in x's dtype (float32 with ``float32_out``).
    """
    weights = tuple(weights)
    stacked = layer is not None
    check_activation(KERNEL_NAME, activation)
    config, width = check_supported(x, weights, offsets=tuple(offsets), width=width,
                                    transposed=transposed, stacked=stacked,
                                    block_sizes=block_sizes)
    weights, norm, biases = stacked_operands(weights, norm, biases, stacked)
    num_rows, in_features = x.shape
    rows = layout.round_up(num_rows, config.block_rows)
    x_padded = jnp.pad(x, ((0, rows - num_rows), (0, 0)))
    layer_index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    out_dtype = jnp.float32 if float32_out else x.dtype
    block = pl.BlockSpec((config.block_rows, config.block_n), lambda i, j: (i, j))
    inputs = [layer_index, x_padded, *weights]
    specs = [pl.no_block_spec] * (2 + len(weights))
    if norm is not None:
        inputs.append(norm)
        specs.append(pl.no_block_spec)
    for bias in biases:
        if bias is not None:
            inputs.append(bias)
            specs.append(pl.no_block_spec)
    if residual is not None:
        inputs.append(jnp.pad(residual.astype(x.dtype), ((0, rows - num_rows), (0, 0))))
        specs.append(block)
    kernel = functools.partial(
        _linear_kernel, num_parts=len(weights), offsets=tuple(offsets),
        has_norm=norm is not None, has_bias=tuple(b is not None for b in biases),
        has_residual=residual is not None, transposed=transposed,
        block_rows=config.block_rows, block_n=config.block_n, block_k=config.block_k,
        num_k=in_features // config.block_k, eps=float(eps), float32_out=float32_out,
        activation=activation)
    out = pl.pallas_call(
        kernel,
        grid=(rows // config.block_rows, width // config.block_n),
        in_specs=specs,
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((rows, width), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="fused_linear_gpu",
    )(*inputs)
    return out[:num_rows]


def fused_linear_reference(x, weights, *, norm=None, biases=None, residual=None, layer=None,
                           offsets=(0,), width: int | None = None, transposed: bool = False,
                           eps: float = 1e-6, float32_out: bool = False,
                           activation: str | None = None):
    """The same computation as :func:`fused_linear_gpu` in ``jax.numpy`` (the models'
    reference layers: :func:`.numerics.rms_norm` and ``specjax.models.layers.dense``)."""
    weights = tuple(weights)
    pick = (lambda a: a) if layer is None else (
        lambda a: None if a is None else lax.dynamic_index_in_dim(a, layer, keepdims=False))
    n_axis = 0 if transposed else 1
    if width is None:
        width = pick(weights[0]).shape[n_axis] - offsets[0]
    h = x if norm is None else rms_norm(x, pick(norm), eps)
    biases = tuple(biases) if biases is not None else (None,) * len(weights)
    parts, part_biases = [], []
    for w, b, offset in zip(weights, biases, offsets):
        w = lax.slice_in_dim(pick(w), offset, offset + width, axis=n_axis)
        w = w.T if transposed else w
        parts.append(jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32,
                             precision=matmul_precision(h)))
        part_biases.append(None if b is None else
                           lax.slice_in_dim(pick(b), offset, offset + width, axis=0))
    res = None if residual is None else residual.astype(x.dtype)
    return _epilogue(parts, part_biases, res, dtype=x.dtype, float32_out=float32_out,
                     activation=activation)


# ------------------------------------------------------- q|k|v rows, RoPE'd, written in place

def _qkv_rope_kernel(layer_ref, x_ref, weight_ref, *refs, has_norm: bool, has_bias: bool,
                     head_dim: int, rope_heads: int, chunks: int, block_rows: int,
                     block_n: int, block_k: int, num_k: int, eps: float):
    """One (row tile, head, chunk) program of :func:`qkv_rope_into_gpu`: the chunk's columns
    in both halves of one head (the pairs RoPE rotates together: column i with i + D/2),
    two products, the rotation (q and k heads), and two stores into the layer's rows.

    Refs: layer_ref int32 [1]; x_ref [R, K]; weight_ref [L, K, N]; the norm weight [L, K]
    if any; the bias [L, N] if any; cos, sin [R, D] float32; the packed buffer [L, R, N]
    (the input aliased to the output, not read); the output, the same buffer.
    """
    refs = list(refs)
    norm_ref = refs.pop(0) if has_norm else None
    bias_ref = refs.pop(0) if has_bias else None
    cos_ref, sin_ref, _, o_ref = refs
    layer = layer_ref[0]
    half = head_dim // 2
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_rows, block_rows), block_rows)
    head = pl.program_id(1) // chunks
    offset = pl.multiple_of((pl.program_id(1) % chunks) * block_n, block_n)
    first = pl.multiple_of(head * head_dim + offset, block_n)
    second = pl.multiple_of(first + half, block_n)
    parts = _products(layer, x_ref, (weight_ref, weight_ref), norm_ref, rows=rows,
                      cols=(first, second), transposed=False, block_rows=block_rows,
                      block_n=block_n, block_k=block_k, num_k=num_k, eps=eps)
    dtype = x_ref.dtype
    a, b = (_epilogue((part,), (None if bias_ref is None else
                                bias_ref[layer, pl.ds(col, block_n)],),
                      None, dtype=dtype, float32_out=False)
            for part, col in zip(parts, (first, second)))
    # RoPE as numerics.apply_rope computes it: x * cos + rotate_half(x) * sin in
    # float32, rotate_half(x) = (-x[D/2:], x[:D/2]).
    af, bf = a.astype(jnp.float32), b.astype(jnp.float32)
    first_cols, second_cols = pl.ds(offset, block_n), pl.ds(offset + half, block_n)
    rotated_a = (af * cos_ref[rows, first_cols] + (-bf) * sin_ref[rows, first_cols])
    rotated_b = (bf * cos_ref[rows, second_cols] + af * sin_ref[rows, second_cols])
    rotate = head < rope_heads
    o_ref[layer, rows, pl.ds(first, block_n)] = jnp.where(rotate, rotated_a.astype(dtype), a)
    o_ref[layer, rows, pl.ds(second, block_n)] = jnp.where(rotate, rotated_b.astype(dtype), b)


def check_rope_into(packed, x, weight, cos, sin, *, norm=None, bias=None, rope_heads: int,
                    block_sizes: GpuLinearBlockSizes = GpuLinearBlockSizes()
                    ) -> GpuLinearBlockSizes:
    """Raises :class:`InvalidArgumentError` (one line) unless :func:`qkv_rope_into_gpu`
    takes the call; returns its block sizes (``block_n``: the chunk of a half head). Reads
    shapes and dtypes only (arrays or ``jax.ShapeDtypeStruct`` values), never the row count
    beyond its tiling."""
    name = f"{KERNEL_NAME} (q|k|v with RoPE)"
    if len(packed.shape) != 4:
        raise InvalidArgumentError(
            f"{name}: the packed buffer must be [L, R, heads, D], got shape {packed.shape}")
    layers, rows, heads, dim = packed.shape
    if jnp.dtype(packed.dtype) != jnp.dtype(x.dtype):
        raise InvalidArgumentError(
            f"{name}: the packed buffer is {packed.dtype} and x is {x.dtype}")
    in_features, width = check_call(name, x, (weight,), offsets=(0,), width=None,
                                    transposed=False, stacked=True)
    block_sizes.check()
    if x.shape[0] != rows or rows % block_sizes.block_rows:
        raise InvalidArgumentError(
            f"{name}: x has {x.shape[0]} rows and the buffer {rows}; both must be the same "
            f"multiple of {block_sizes.block_rows}")
    if weight.shape[0] != layers or width != heads * dim:
        raise InvalidArgumentError(
            f"{name}: weight {weight.shape} does not fill {layers} layers of {heads} heads "
            f"of {dim}")
    if dim % 32 or in_features % 16:
        raise InvalidArgumentError(
            f"{name}: head dimension {dim} must be a multiple of 32 (half a head: one "
            f"16-column Triton tile) and K={in_features} of 16")
    if not 0 <= rope_heads <= heads:
        raise InvalidArgumentError(f"{name}: rope_heads={rope_heads} outside 0..{heads}")
    for table, label in ((cos, "cos"), (sin, "sin")):
        if tuple(table.shape) != (rows, dim) or jnp.dtype(table.dtype) != jnp.float32:
            raise InvalidArgumentError(
                f"{name}: the {label} table must be float32 [{rows}, {dim}], got "
                f"{table.dtype}{list(table.shape)}")
    if norm is not None and tuple(norm.shape) != (layers, in_features):
        raise InvalidArgumentError(f"{name}: norm {norm.shape} is not [{layers}, {in_features}]")
    if bias is not None and tuple(bias.shape) != (layers, width):
        raise InvalidArgumentError(f"{name}: bias {bias.shape} is not [{layers}, {width}]")
    config = block_sizes.resolve(in_features, width // 2)
    block_n = min(config.block_n, _power_of_2_divisor(dim // 2, 128))
    config = dataclasses.replace(config, block_n=block_n)
    config.check()
    if (dim // 2) % block_n or in_features % config.block_k:
        raise InvalidArgumentError(
            f"{name}: half a head ({dim // 2}) and K={in_features} are not multiples of the "
            f"blocks {block_n} and {config.block_k}")
    return config


@functools.partial(jax.jit, static_argnames=("rope_heads", "eps", "block_sizes", "interpret"))
def qkv_rope_into_gpu(packed, x, weight, cos, sin, layer, *, norm=None, bias=None,
                      rope_heads: int, eps: float = 1e-6,
                      block_sizes: GpuLinearBlockSizes = GpuLinearBlockSizes(),
                      interpret: bool = False):
    """Writes layer ``layer`` of the packed q|k|v buffer in one launch: the rows of
    ``rms_norm(x) @ W + b`` split into heads, RoPE applied to the first ``rope_heads``
    (the query and key heads), stored in place (the buffer is aliased to the output).

    This is :func:`fused_linear_gpu` (same tiling rules: a row's arithmetic does not
    depend on the number of rows) with the rotation and the write of
    :func:`qkv_rope_into_reference` in its epilogue; a program computes one chunk of both
    halves of a head, the columns RoPE pairs. Without it a layer runs the projection, then
    the rotation and the write as an XLA fusion: one launch more per layer.

    Args:
      packed: [L, R, heads, D] buffer (a layer loop's carry); R = x's rows.
      x: [R, K] rows (R a multiple of the row tile, 16).
      weight: [L, K, heads * D] stacked fused q|k|v weights, read at ``layer``.
      cos, sin: float32 [R, D] RoPE tables (half-split layout, as
        :func:`specjax.models.layers.rope_tables`).
      layer: int32 [] the layer to write.
      norm: optional RMSNorm weight [L, K]; bias: optional [L, heads * D].
      rope_heads: the leading heads RoPE rotates; the rest (values) are written as
        projected.
      eps: the norm's epsilon.
      block_sizes, interpret: as :func:`fused_linear_gpu`.
    Returns:
      ``packed`` with layer ``layer``'s rows written; other layers untouched.
    """
    config = check_rope_into(packed, x, weight, cos, sin, norm=norm, bias=bias,
                             rope_heads=rope_heads, block_sizes=block_sizes)
    layers, rows, heads, dim = packed.shape
    in_features = x.shape[1]
    chunks = dim // 2 // config.block_n
    inputs = [jnp.asarray(layer, jnp.int32).reshape(1), x, weight]
    inputs += [a for a in (norm, bias) if a is not None]
    inputs += [cos, sin, packed.reshape(layers, rows, heads * dim)]
    kernel = functools.partial(
        _qkv_rope_kernel, has_norm=norm is not None, has_bias=bias is not None,
        head_dim=dim, rope_heads=rope_heads, chunks=chunks, block_rows=config.block_rows,
        block_n=config.block_n, block_k=config.block_k,
        num_k=in_features // config.block_k, eps=float(eps))
    out = pl.pallas_call(
        kernel,
        grid=(rows // config.block_rows, heads * chunks),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((layers, rows, heads * dim), packed.dtype),
        input_output_aliases={len(inputs) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="qkv_rope_into_gpu",
    )(*inputs)
    return out.reshape(packed.shape)


def qkv_rope_into_reference(packed, x, weight, cos, sin, layer, *, norm=None, bias=None,
                            rope_heads: int, eps: float = 1e-6):
    """:func:`qkv_rope_into_gpu` in ``jax.numpy``: :func:`fused_linear_reference`, then
    :func:`.numerics.write_rope_rows`."""
    qkv = fused_linear_reference(x, (weight,), norm=norm, biases=(bias,), layer=layer, eps=eps)
    return write_rope_rows(packed, qkv, layer, cos, sin, rope_heads)
