"""Row-tiled fused linear layers for Hopper GPUs: Pallas with the Mosaic GPU lowering.

The same computation as :mod:`specjax.kernels.linear_gpu` (the Triton kernel), for
half-precision rows::

    y = residual + act(rms_norm(x) @ W + b)        # every part but the matmul optional

with the same arguments (stacked ``[L, K, N]`` weights read in place at a traced
``layer``, one matrix or two column ranges feeding SwiGLU, ``float32_out`` for the
logits; ``transposed`` weights are refused, see below). What differs is how the tile is
computed: one warpgroup per program issues ``wgmma`` (Hopper's asynchronous tensor-core
matmul) on tiles that TMA copies from global to shared memory, double-buffered by hand
(chunk ``c + 1`` is in flight while chunk ``c`` is multiplied).

**Only bfloat16 and float16.** ``wgmma`` takes float32 operands only as TF32, which would
break what ``float32`` means in this library (exact float32 products, see
:func:`.numerics.matmul_precision`). A float32 call is refused in one line and
:func:`specjax.kernels.fused_linear` gives it to the Triton kernel, whose float32 path
multiplies at ``Precision.HIGHEST``.

**Row independence.** A program takes 64 rows (one ``wgmma`` M tile; a one-token call is
padded to it), a column block of ``block_n`` and the reduction in chunks of 64 in a fixed
order; the tile sizes depend on the matrix shape only, the norm of a row uses only that
row. So a row's arithmetic is the same alone or among 64 tree nodes, as for the Triton
kernel, and a verify pass reproduces the one-token step bit for bit.

**Shapes.** K, the output width and the column offsets must be multiples of 64 (the
128-byte swizzle of a 16-bit tile). Transposed weights (a tied embedding head) are refused:
``wgmma`` can read a transposed operand, but the interpreter has no rule for the transpose
transform, so the path would be untested. Refused calls (one line) go, through
:func:`specjax.kernels.fused_linear`, to the Triton kernel (or with ``fallback`` the
reference).

**Testing without a GPU.** ``interpret=True`` runs the kernel under JAX's Mosaic GPU
interpreter (``InterpretGPUParams``, private in jax 0.10), which simulates shared memory,
TMA copies, barriers and ``wgmma`` on the CPU; ``tests/test_linear_mosaic_gpu.py`` checks
it against :func:`~specjax.kernels.linear_gpu.fused_linear_reference` and lowers it for
CUDA. It has not been timed on a GPU yet: the Triton kernel stays the default, and
``gpu_linear="mosaic"`` (``KernelOptions.gpu_linear``) opts in (see
:func:`specjax.kernels.fused_linear`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from specjax.errors import InvalidArgumentError
from . import layout
from .linear_gpu import _epilogue, check_call, stacked_operands

KERNEL_NAME = "Mosaic GPU fused linear kernel"
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_ROWS = 4096
ROWS = 64  # rows per program: the M of one wgmma
BLOCK_K = 64  # reduction chunk: 128 bytes of a 16-bit row, one swizzle span
_LAYER_WORDS = 32  # the layer index travels as int32[32]: a TMA copy of 128 bytes
_TILES = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
SMEM_LIMIT = 227 * 1024  # shared memory a program may use on an H100


def smem_bytes(block_n: int, num_parts: int) -> int:
    """Shared memory of one program at most (a residual and float32 output included):
    two x chunks, the normed chunk, two weight tiles per part, the residual tile, the
    output tile, the bias blocks and the layer words."""
    x_chunks = 3 * ROWS * BLOCK_K * 2
    weight_tiles = num_parts * 2 * BLOCK_K * block_n * 2
    epilogue = ROWS * block_n * (2 + 4) + num_parts * block_n * 2
    return x_chunks + weight_tiles + epilogue + 2 * BLOCK_K * 2 + _LAYER_WORDS * 4


@dataclasses.dataclass(frozen=True)
class MosaicGpuLinearBlockSizes:
    """Static tiling of :func:`fused_linear_mosaic_gpu`.

    Attributes:
      block_n: output columns per program, a multiple of 64 up to 256; ``None``: 128 when
        it divides the output width, else 64.
    """

    block_n: int | None = None

    def resolve(self, out_features: int) -> "MosaicGpuLinearBlockSizes":
        """The sizes for an output width: a function of the shape only, never of the
        row count."""
        if self.block_n is not None:
            return self
        return dataclasses.replace(self, block_n=128 if out_features % 128 == 0 else 64)

    def check(self) -> None:
        if self.block_n is not None and (self.block_n % 64 or not 64 <= self.block_n <= 256):
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_n={self.block_n} must be a multiple of 64 from 64 "
                f"to 256")


def check_supported(x, weights, *, offsets=(0,), width: int | None = None,
                    transposed: bool = False, stacked: bool = False,
                    block_sizes: MosaicGpuLinearBlockSizes = MosaicGpuLinearBlockSizes()
                    ) -> tuple[MosaicGpuLinearBlockSizes, int]:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values). Returns
    (the resolved block sizes, the output width N).
    """
    if transposed:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: transposed weights are not supported (JAX's Mosaic GPU "
            f"interpreter cannot run a transposed wgmma operand, so it would be untested); "
            f"the Triton kernel takes them")
    if jnp.dtype(x.dtype) == jnp.float32:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: float32 is not supported (wgmma multiplies float32 as TF32); "
            f"the Triton kernel takes it")
    in_features, width = check_call(KERNEL_NAME, x, weights, offsets=offsets, width=width,
                                    transposed=transposed, stacked=stacked, dtypes=DTYPES,
                                    max_rows=MAX_ROWS)
    if any(jnp.dtype(w.dtype) != jnp.dtype(x.dtype) for w in weights):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: weights {[str(w.dtype) for w in weights]} must have x's dtype "
            f"{x.dtype}")
    block_sizes.check()
    config = block_sizes.resolve(width)
    if in_features % BLOCK_K or width % config.block_n or any(
            offset % config.block_n for offset in offsets):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: K={in_features}, N={width} (offsets {offsets}) are not "
            f"multiples of the blocks {BLOCK_K} x {config.block_n}")
    if smem_bytes(config.block_n, len(weights)) > SMEM_LIMIT:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: block_n={config.block_n} with {len(weights)} weights needs "
            f"{smem_bytes(config.block_n, len(weights)) // 1024} KiB of shared memory; the "
            f"limit is {SMEM_LIMIT // 1024} KiB")
    return config, width


def _linear_kernel(layer_gmem, x_gmem, *refs, num_parts: int, offsets: tuple,
                   has_norm: bool, has_bias: tuple, has_residual: bool, block_n: int,
                   num_k: int, eps: float, float32_out: bool, interpret: bool):
    """One (row tile, column block) program.

    GMEM refs: the layer int32 [32]; x [R, K]; ``num_parts`` weights [L, K, N']; the norm
    weight [L, K] if any; a bias [L, N'] per part that has one; the residual [R, N] if
    any; the output [R, N]. Then the scratch: SMEM buffers and barriers
    (see :func:`fused_linear_mosaic_gpu`).
    """
    refs = list(refs)
    weight_gmem = [refs.pop(0) for _ in range(num_parts)]
    norm_gmem = refs.pop(0) if has_norm else None
    bias_gmem = [refs.pop(0) if flag else None for flag in has_bias]
    residual_gmem = refs.pop(0) if has_residual else None
    o_gmem = refs.pop(0)
    layer_smem, x_smem, xn_smem, norm_smem = refs[:4]
    weight_smem = refs[4:4 + num_parts]
    bias_smem, epilogue_smem, o_smem, chunk_bar, one_bar, epilogue_bar = refs[4 + num_parts:]

    row0 = pl.multiple_of(lax.axis_index("rows") * ROWS, ROWS)
    col0 = pl.multiple_of(lax.axis_index("cols") * block_n, block_n)
    rows = pl.ds(row0, ROWS)
    dtype = x_gmem.dtype
    # Register layouts: the accumulator's (WGMMA), its rows (reduce(1)) and columns
    # (reduce(0)). They are hints to the lowering and do not change a value; the
    # interpreter has no rule for them, so it reads the refs plainly.
    acc_layout = plgpu.Layout.WGMMA
    if interpret:
        load = lambda ref, _layout: ref[...]  # noqa: E731
        hint = lambda value, _layout: value  # noqa: E731
    else:
        load = lambda ref, layout: plgpu.load(ref, (), layout=layout)  # noqa: E731
        hint = plgpu.layout_cast

    plgpu.copy_gmem_to_smem(layer_gmem, layer_smem, one_bar)
    plgpu.barrier_wait(one_bar)
    layer = layer_smem[0]

    inv_rms = None
    if has_norm:
        # Pass 1: each row's sum of squares, chunk by chunk in a fixed order.
        def sum_squares(chunk, total):
            k0 = pl.multiple_of(chunk * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds(k0, BLOCK_K)], x_smem.at[0],
                                    one_bar)
            plgpu.barrier_wait(one_bar)
            xc = load(x_smem.at[0], acc_layout).astype(jnp.float32)
            return total + jnp.sum(xc * xc, axis=1)

        zeros = hint(jnp.zeros((ROWS,), jnp.float32), acc_layout.reduce(1))
        total = lax.fori_loop(0, num_k, sum_squares, zeros)
        inv_rms = lax.rsqrt(total / (num_k * BLOCK_K) + eps)

    def issue(chunk, slot):
        """Starts the TMA copies of reduction chunk ``chunk`` into buffer ``slot``."""
        k0 = pl.multiple_of(chunk * BLOCK_K, BLOCK_K)
        ks = pl.ds(k0, BLOCK_K)
        barrier = chunk_bar.at[slot]
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, ks], x_smem.at[slot], barrier)
        if has_norm:
            plgpu.copy_gmem_to_smem(norm_gmem.at[layer, ks], norm_smem.at[slot], barrier)
        for w_gmem, w_smem, offset in zip(weight_gmem, weight_smem, offsets):
            plgpu.copy_gmem_to_smem(w_gmem.at[layer, ks, pl.ds(col0 + offset, block_n)],
                                    w_smem.at[slot], barrier)

    def matmul(*accs):
        issue(0, 0)

        def step(chunk, carry):
            slot = lax.rem(chunk, 2)

            @pl.when(chunk + 1 < num_k)
            def _prefetch():  # the other buffer's wgmma finished last step
                issue(chunk + 1, 1 - slot)

            plgpu.barrier_wait(chunk_bar.at[slot])
            lhs = x_smem.at[slot]
            if has_norm:  # as rms_norm rounds: the normed row in x's dtype, then the weight
                xc = load(x_smem.at[slot], acc_layout).astype(jnp.float32)
                xc = xc * lax.broadcast_in_dim(inv_rms, xc.shape, (0,))
                scale = load(norm_smem.at[slot], acc_layout.reduce(0))
                xn_smem[...] = lax.broadcast_in_dim(scale, xc.shape, (1,)) * xc.astype(dtype)
                plgpu.commit_smem()
                lhs = xn_smem
            for acc, w_smem in zip(accs, weight_smem):
                plgpu.wgmma(acc, lhs, w_smem.at[slot])
            plgpu.wgmma_wait(0)
            return carry

        lax.fori_loop(0, num_k, step, 0)
        return tuple(acc[...] for acc in accs)

    parts = pl.run_scoped(matmul, *(plgpu.ACC((ROWS, block_n), jnp.float32)
                                    for _ in range(num_parts)))

    # Epilogue operands: the biases' column blocks and the residual tile.
    for part, (b_gmem, offset) in enumerate(zip(bias_gmem, offsets)):
        if b_gmem is not None:
            plgpu.copy_gmem_to_smem(b_gmem.at[layer, pl.ds(col0 + offset, block_n)],
                                    bias_smem.at[part], epilogue_bar)
    if has_residual:
        plgpu.copy_gmem_to_smem(residual_gmem.at[rows, pl.ds(col0, block_n)],
                                epilogue_smem, epilogue_bar)
    if has_residual or any(has_bias):
        plgpu.barrier_wait(epilogue_bar)
    biases = [None if b is None else lax.broadcast_in_dim(
        load(bias_smem.at[part], acc_layout.reduce(0)), (ROWS, block_n), (1,))
        for part, b in enumerate(bias_gmem)]
    residual = load(epilogue_smem, acc_layout) if has_residual else None
    y = _epilogue(parts, biases, residual, dtype=dtype, float32_out=float32_out)
    o_smem[...] = y.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, pl.ds(col0, block_n)])
    plgpu.wait_smem_to_gmem(0)


def _interpret_params(interpret: bool):
    """``interpret`` as ``plgpu.kernel`` takes it: ``None`` (compile) or the Mosaic GPU
    interpreter's default parameters (fresh buffers NaN-filled, out-of-bounds reads
    raise)."""
    if not interpret:
        return None
    # Private in jax 0.10 (the TPU interpreter's are public as pltpu.InterpretParams);
    # imported on use so that compiling never needs it.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


@functools.partial(jax.jit, static_argnames=(
    "offsets", "width", "transposed", "eps", "float32_out", "block_sizes", "interpret"))
def fused_linear_mosaic_gpu(x, weights, *, norm=None, biases=None, residual=None,
                            layer=None, offsets=(0,), width: int | None = None,
                            transposed: bool = False, eps: float = 1e-6,
                            float32_out: bool = False,
                            block_sizes=MosaicGpuLinearBlockSizes(),
                            interpret: bool = False):
    """``residual + act(rms_norm(x) @ W + b)`` for a few bfloat16/float16 rows; the
    arguments are :func:`specjax.kernels.linear_gpu.fused_linear_gpu`'s (with
    :class:`MosaicGpuLinearBlockSizes`). ``interpret=True`` runs the Mosaic GPU
    interpreter on any backend.
    """
    weights = tuple(weights)
    stacked = layer is not None
    config, width = check_supported(x, weights, offsets=tuple(offsets), width=width,
                                    transposed=transposed, stacked=stacked,
                                    block_sizes=block_sizes)
    weights, norm, biases = stacked_operands(weights, norm, biases, stacked)
    biases = tuple(None if b is None else b.astype(x.dtype) for b in biases)
    num_rows, in_features = x.shape
    rows = layout.round_up(num_rows, ROWS)
    block_n = config.block_n
    x_padded = jnp.pad(x, ((0, rows - num_rows), (0, 0)))
    layer_words = jnp.broadcast_to(jnp.asarray(0 if layer is None else layer, jnp.int32),
                                   (_LAYER_WORDS,))
    inputs = [layer_words, x_padded, *weights]
    if norm is not None:
        inputs.append(norm.astype(x.dtype))
    inputs.extend(b for b in biases if b is not None)
    if residual is not None:
        inputs.append(jnp.pad(residual.astype(x.dtype), ((0, rows - num_rows), (0, 0))))
    out_dtype = jnp.float32 if float32_out else x.dtype
    scratch = [
        plgpu.SMEM((_LAYER_WORDS,), jnp.int32),
        plgpu.SMEM((2, ROWS, BLOCK_K), x.dtype, transforms=_TILES),  # x chunks
        plgpu.SMEM((ROWS, BLOCK_K), x.dtype, transforms=_TILES),  # the normed chunk
        plgpu.SMEM((2, BLOCK_K), x.dtype),  # norm weight chunks
        *(plgpu.SMEM((2, BLOCK_K, block_n), x.dtype, transforms=_TILES) for _ in weights),
        plgpu.SMEM((len(weights), block_n), x.dtype),  # bias blocks
        plgpu.SMEM((ROWS, block_n), x.dtype, transforms=_TILES),  # residual tile
        plgpu.SMEM((ROWS, block_n), out_dtype),  # output tile
        # A chunk's copies: x, the norm chunk, one per weight.
        plgpu.Barrier(num_arrivals=1 + (norm is not None) + len(weights), num_barriers=2),
        plgpu.Barrier(num_arrivals=1),
        # The epilogue's copies: the biases and the residual.
        plgpu.Barrier(num_arrivals=max(1, sum(b is not None for b in biases)
                                       + (residual is not None))),
    ]
    kernel = functools.partial(
        _linear_kernel, num_parts=len(weights), offsets=tuple(offsets),
        has_norm=norm is not None, has_bias=tuple(b is not None for b in biases),
        has_residual=residual is not None, block_n=block_n,
        num_k=in_features // BLOCK_K, eps=float(eps), float32_out=float32_out,
        interpret=interpret)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, width), out_dtype),
        scratch_types=scratch,
        grid=(rows // ROWS, width // block_n),
        grid_names=("rows", "cols"),
        interpret=_interpret_params(interpret),
    )(*inputs)
    return out[:num_rows]
