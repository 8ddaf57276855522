"""Position-ordered verify/decode attention for TPUs (Pallas, Mosaic lowering): a query's
arithmetic is the same in a one-token step and in a tree verification pass.

The contract of :mod:`.attention_ordered_gpu` (read its docstring for why): each query
row sees the keys at positions ``0 .. its own`` as one virtual sequence (the committed
cache ``[0, length)``, then the row's ancestor chain at ``length + depth``), read in blocks
of ``block_kv`` positions aligned at absolute position 0, one online-softmax update per
block, in position order; blocks past a row's own position are exact identities. The
scores and the P @ V sums are dots *batched over the query rows* (per row one
``[1, D] x [D, block_kv]`` and one ``[1, block_kv] x [block_kv, D]`` product), so a row's
sums depend on its own operands only; a committed block's keys are broadcast to every
row, so both kinds of block run the same dot on the same shapes. Soft-capping
(``softcap``) applies to each score, elementwise; a sliding window (``first_visible``,
per query, carried per packed row) masks positions before it, by absolute position, the
same in a step and in a pass (a block wholly before a row's window is an exact identity
for it, like one past its position; the chains are the mask's without the window). Every
other quantity (the block maximum, the correction, the normaliser) is a reduction along
one row, and ``block_kv`` depends on the shapes alone (below). (Elementwise products
reduced with ``jnp.sum``, the GPU kernel's form, were not bitwise stable under the TPU
interpreter: XLA compiled the fused reductions differently in a one-token program and a
verify program.) So a verify pass reproduces the one-token steps bit for bit.

TPU layout (Mosaic needs the last two block dims to be multiples of (8, 128) or whole):

* grid ``(KV heads, row tiles, steps)``, semantics (parallel, parallel, arbitrary); a step
  is one block of ``block_kv`` absolute positions; the online-softmax state (m, l, acc)
  lives in VMEM scratch across the steps;
* query rows are packed as in :mod:`.layout` (row ``t * G + g``: node t, query head
  ``k * G + g``) with a unit axis, ``[K, R, 1, D]``, so that a tile is ``[block_rows, 1, D]``
  and every temporary is a 3-D value whose last two dims Mosaic tiles directly (scores
  ``[rows, 1, block_kv]``, the state ``[rows, 1, 1]`` and ``[rows, 1, D]``);
* **committed blocks** (``block < length // block_kv``) come from the cache
  ``[L, S, K, D]``, block ``(None, block_kv, None, D)`` at (layer, block, head): one layer,
  one KV head, read in place (the layer is scalar-prefetched; steps outside the committed
  run repeat the block index, so nothing new is fetched);
* the **boundary region** (from the block holding ``length`` to the end of the deepest
  chain: ``ceil((block_kv - 1 + T) / block_kv)`` blocks) is gathered per row by the
  wrapper, ``[K, R, W, D]``: slots before ``length`` copied from the cache (bitwise the
  values a committed block would read), then the row's chain (the new tokens at depths
  0..depth), zeros past it. The kernel reads it in ``[block_rows, block_kv, D]`` blocks,
  aligned like every other block. This replaces the GPU kernel's masked loads at unaligned
  chain offsets, which Mosaic cannot do.

``block_kv`` is the largest of 128, 64, 32, 16 that divides the cache capacity and keeps the
estimated VMEM (:func:`vmem_bytes`) within :data:`~.attention_tpu.VMEM_BUDGET` at 8 rows
per tile, else at 4, 2 or 1 (shapes and whether there is a window only, never the token
count: SmolLM2 gets 128 at 8 rows; Llama-2-7B's 32 KV heads of 128 get 32 at 4 rows).
Head sizes: 16 to 256 in powers of two, Phi-2's 80 and Phi-3's 96 (a block's last dim is
then the whole D, as Mosaic allows).
Calls it refuses (a capacity no multiple of 16 divides) go, like drafting calls with a
scratch window, to :mod:`.attention_tpu` through the dispatcher.

``interpret=True`` runs the TPU interpreter (``pltpu.InterpretParams``) on any backend.
Compiled for TPU v5e in the test suite; not yet run or timed on TPU hardware. Cost: every
row tile reads the committed cache once (no split over the KV length, no GQA sharing of a
key block across a dot), and the batched dots have one row each (M = 1), which leaves the
MXU mostly idle: the price of the fixed order, as on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.errors import InvalidArgumentError
from . import layout
from .attention_ordered_gpu import ancestor_chains, check_call
from .attention_tpu import VMEM_BUDGET, VMEM_LIMIT

KERNEL_NAME = "TPU position-ordered attention kernel"
# 80 (Phi-2), 96 (Phi-3): blocks whose last dim is the whole D
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
TAKES_LAYER_INDEX = True
BLOCK_KV_CHOICES = (128, 64, 32, 16)  # multiples of bf16's 16-row sublane tile


@dataclasses.dataclass(frozen=True)
class TpuOrderedBlockSizes:
    """Static tiling of :func:`ordered_attention_tpu`; fixed per call shape family, never
    derived from the number of tokens or the cache length.

    Attributes:
      block_rows: packed query rows per tile (any positive size: a leading dim), halved
        while the blocks would exceed the VMEM budget (:meth:`resolve`).
      block_kv: positions per block, a multiple of 16 dividing the cache capacity;
        ``None``: the largest of :data:`BLOCK_KV_CHOICES` that divides it and fits the
        VMEM budget (:meth:`resolve`).
      vmem_limit_bytes: scoped VMEM limit; ``None``: :data:`~.attention_tpu.VMEM_LIMIT`.
    """

    block_rows: int = 8
    block_kv: int | None = None
    vmem_limit_bytes: int | None = None

    def check(self) -> None:
        if self.block_rows < 1:
            raise InvalidArgumentError(f"{KERNEL_NAME}: block_rows={self.block_rows} must be >= 1")
        if self.block_kv is not None and (self.block_kv < 16 or self.block_kv % 16):
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_kv={self.block_kv} must be a positive multiple of 16")

    def resolve(self, capacity: int | None, num_kv_heads: int, head_dim: int,
                itemsize: int, windowed: bool = False) -> tuple[int, int]:
        """``(block_rows, block_kv)`` for a cache of ``capacity`` slots (``None``: no
        cache): ``block_kv`` the largest allowed block that divides it and keeps
        :func:`vmem_bytes` within :data:`~.attention_tpu.VMEM_BUDGET` at ``block_rows``
        rows per tile, else the same at half the rows (down to one row: many KV heads,
        e.g. 32 of 128, take 4). Shapes only, never the token count (``windowed``: with a
        sliding window's first positions, a model's static feature): the one-token step
        and the verify pass tile alike. A row's arithmetic does not depend on the rows
        beside it in its tile (``block_rows`` is a leading dim); ``block_kv`` sets the
        order of its sums.

        Raises:
          InvalidArgumentError: no allowed block divides the capacity and fits.
        """
        choices = (self.block_kv,) if self.block_kv is not None else BLOCK_KV_CHOICES
        dividing = [b for b in choices if capacity is None or capacity % b == 0]
        if not dividing:
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: cache capacity {capacity} is not a multiple of block_kv="
                f"{choices[-1]}")
        halvings = self.block_rows.bit_length()  # block_rows, half of it, ..., 1
        for block_rows in (self.block_rows >> i for i in range(halvings)):
            for block_kv in dividing:
                if vmem_bytes(block_rows, block_kv, num_kv_heads, head_dim, itemsize,
                              windowed) <= VMEM_BUDGET:
                    return block_rows, block_kv
        smallest = vmem_bytes(1, dividing[-1], num_kv_heads, head_dim, itemsize, windowed)
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {num_kv_heads} KV heads x head_dim {head_dim} with block_kv="
            f"{dividing[-1]} and one row per tile need ~{smallest / 2**20:.1f} MiB of VMEM "
            f"(budget {VMEM_BUDGET >> 20} MiB)")


# One (sublanes, 128 lanes) VMEM tile of 32 bits x 8 or 16 bits x 16 sublanes: what a
# [..., 1, D <= 128] or [..., 1, 1] block takes per leading index (the unit axis pads to
# the tile's sublanes).
_TILE = 8 * 128 * 4


def vmem_bytes(block_rows: int, block_kv: int, num_kv_heads: int, head_dim: int,
               itemsize: int, windowed: bool = False) -> int:
    """Estimated VMEM of one call, per (KV head, row) of a tile: the double-buffered region
    keys and values ``[block_kv, D]``; the double-buffered queries and output and the state
    scratch m, l, acc, each ``[1, D]`` or ``[1, 1]``, one tile each (the unit axis takes a
    whole tile's sublanes); two tiles of temporaries. Per row: its position block
    ``[1, 1]`` int32, double-buffered (``windowed``: the first positions' block and the
    comparisons with it, five tiles). Then the double-buffered cache keys and values.
    Fitted to the compiler's VMEM reports for v5e in bfloat16 at 8 to 32 KV heads of 64 and
    128, 2 to 8 rows, block_kv 16 to 64 (49-52 KiB per (head, row) at block_kv 16 and
    +1 KiB per position, against 52 here:
    ``benchmarks/results/tpu_compile/ordered_vmem_2026-11-30.json``); errs high: a smaller
    block only costs grid steps."""
    lanes = layout.round_up(head_dim, 128)
    tile = _TILE * lanes // 128  # a [1, D] row's tile
    kv_sublanes = layout.round_up(num_kv_heads, 32 // itemsize)
    per_head_row = (2 * 2 * block_kv * lanes * itemsize  # region k, v
                    + 2 * 2 * tile  # queries, output
                    + 2 * _TILE + tile  # m, l, acc
                    + 2 * tile)  # temporaries
    per_row = 2 * _TILE + (5 * _TILE if windowed else 0)
    cache = 2 * 2 * block_kv * kv_sublanes * lanes * itemsize
    return (num_kv_heads * block_rows * per_head_row + block_rows * per_row + cache
            + 64 * 1024)


def _batched_dot(a, b, *, contract: int):
    """Per row r: a[r] [1, X] times b[r] ([Y, X] with contract=2, [X, Y] with contract=1),
    float32 at full precision."""
    return lax.dot_general(a, b, (((2,), (contract,)), ((0,), (0,))),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _ordered_kernel(scalars_ref, q_ref, last_ref, *refs, block_kv: int, num_steps: int,
                    scale: float, softcap: float | None, windowed: bool):
    """One (row tile, position block) step, for every KV head.

    Refs: scalars_ref int32 [4] (SMEM: length, layer, first region block, end block);
    q_ref [K, rows, 1, D]; last_ref int32 [rows, 1, 1] (each row's own position; padding
    rows: length - 1); with ``windowed``, first_ref int32 [rows, 1, 1] (each row's first
    visible position); k_ref, v_ref the cache block [block_kv, K, D]; region_k_ref,
    region_v_ref the region block [K, rows, block_kv, D]; o_ref [K, rows, 1, D]; scratch
    m_ref, l_ref [K, rows, 1, 1], acc_ref [K, rows, 1, D] (float32).
    """
    if windowed:
        first_ref, *refs = refs
    k_ref, v_ref, region_k_ref, region_v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    step = pl.program_id(1)
    first, end = scalars_ref[2], scalars_ref[3]
    num_kv_heads, rows = q_ref.shape[:2]

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, layout.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def update(head, keys, values):
        # The only arithmetic on scores and values: every block, cache or region, comes
        # here with [rows, block_kv, D] float32 keys/values (see the module docstring).
        q = q_ref[head].astype(jnp.float32)  # [rows, 1, D]
        positions = step * block_kv + lax.broadcasted_iota(jnp.int32, (1, 1, block_kv), 2)
        valid = positions <= last_ref[...]  # [rows, 1, block_kv]
        if windowed:  # by absolute position, the same in a step and in a pass
            valid = valid & (positions >= first_ref[...])
        s = _batched_dot(q, keys, contract=2) * scale  # [rows, 1, block_kv]
        s = layout.capped(s, softcap)  # per score
        s = jnp.where(valid, s, layout.MASK_VALUE)
        m_prev = m_ref[head]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=2, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
        l_ref[head] = l_ref[head] * correction + jnp.sum(p, axis=2, keepdims=True)
        acc_ref[head] = acc_ref[head] * correction + _batched_dot(p, values, contract=1)
        m_ref[head] = m_next

    @pl.when(step < first)
    def _committed():
        for head in range(num_kv_heads):  # static index: a strided load Mosaic can align
            shape = (rows, block_kv, k_ref.shape[-1])
            update(head, jnp.broadcast_to(k_ref[:, head, :].astype(jnp.float32)[None], shape),
                   jnp.broadcast_to(v_ref[:, head, :].astype(jnp.float32)[None], shape))

    @pl.when((step >= first) & (step < end))
    def _region():
        for head in range(num_kv_heads):
            update(head, region_k_ref[head].astype(jnp.float32),
                   region_v_ref[head].astype(jnp.float32))

    @pl.when(step == num_steps - 1)
    def _finish():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: TpuOrderedBlockSizes = TpuOrderedBlockSizes(),
                    softcap=None, first_visible=None) -> int:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call
    (``softcap`` a positive number or ``None``, ``first_visible`` int32 [T] or ``None``);
    returns its ``(block_rows, block_kv)`` (:meth:`TpuOrderedBlockSizes.resolve`). Reads
    shapes and dtypes only."""
    k_cache = check_call(KERNEL_NAME, q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                         head_dims=HEAD_DIMS, dtypes=DTYPES)
    layout.check_windows(q.shape[0], softcap, first_visible, KERNEL_NAME)
    block_sizes.check()
    return block_sizes.resolve(None if k_cache is None else k_cache.shape[0], k_new.shape[1],
                               q.shape[2], jnp.dtype(q.dtype).itemsize,
                               windowed=first_visible is not None)


def _boundary_region(k_new, v_new, k_cache, v_cache, layer, length, chain, depth, *,
                     block_kv: int, width: int):
    """Per node, the positions ``base .. base + width`` (base: ``length`` rounded down to
    the block) of its virtual sequence: [T, width, K, D] keys and values (cache slots
    before ``length``, then the node's chain, zeros past it)."""
    num_tokens = k_new.shape[0]
    num_layers, capacity = k_cache.shape[:2]
    positions = (length // block_kv) * block_kv + jnp.arange(width, dtype=jnp.int32)
    in_cache = positions < length
    relative = positions - length  # depth of the chain entry at each position
    in_chain = (relative[None, :] >= 0) & (relative[None, :] <= depth[:, None])  # [T, W]
    index = jnp.take_along_axis(
        chain, jnp.broadcast_to(jnp.clip(relative, 0, num_tokens - 1), (num_tokens, width)),
        axis=1)  # [T, W]: the new token at that depth of each node's chain
    slots = layer * capacity + jnp.clip(positions, 0, capacity - 1)

    def region(new, cache):
        # A gather of `width` slots of one layer: the layer itself is never sliced out.
        committed = jnp.take(cache.reshape(num_layers * capacity, *cache.shape[2:]), slots,
                             axis=0)  # [W, K, D]
        chained = jnp.take(new, index, axis=0)  # [T, W, K, D]
        return jnp.where(in_cache[None, :, None, None], committed[None],
                         jnp.where(in_chain[..., None, None], chained, 0))

    return region(k_new, k_cache), region(v_new, v_cache)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale", "softcap"))
def ordered_attention_tpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None,
                          *, layer=None,
                          block_sizes: TpuOrderedBlockSizes = TpuOrderedBlockSizes(),
                          interpret: bool = False, scale: float | None = None,
                          softcap: float | None = None, first_visible=None):
    """Attention with a position-ordered reduction on a TPU; the arguments and result are
    those of :func:`specjax.kernels.attention_ordered_gpu.ordered_attention_gpu`, with
    ``block_sizes`` a static :class:`TpuOrderedBlockSizes` and ``interpret`` running the
    TPU interpreter (``scale``: the static score scale, ``None`` for ``D ** -0.5``;
    ``softcap``: the static soft-cap of each score; ``first_visible`` int32 [T]: each
    query's first visible position, a sliding window, with ``mask`` the chains' mask
    without it).

    Returns:
      [T, H, D] in q's dtype.
    """
    block_rows, block_kv = check_supported(q, k_new, v_new, k_cache, v_cache, mask,
                                           scratch_mask, block_sizes=block_sizes,
                                           softcap=softcap, first_visible=first_visible)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    if k_cache is None:  # no prefix: a zero-length cache of one block
        k_cache = v_cache = jnp.zeros((1, block_kv, num_kv_heads, head_dim), k_new.dtype)
        length, layer = 0, 0
    elif layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0  # free reshapes
    length = jnp.asarray(length, jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    rows = layout.round_up(num_tokens * group, block_rows)
    region_blocks = -(-(block_kv - 1 + num_tokens) // block_kv)
    num_steps = k_cache.shape[1] // block_kv + region_blocks

    chain, depth = ancestor_chains(mask)
    region_k, region_v = _boundary_region(k_new, v_new, k_cache, v_cache, layer, length,
                                          chain, depth, block_kv=block_kv,
                                          width=region_blocks * block_kv)

    def pack(region):  # [T, W, K, D] -> [K, rows, W, D], row t * G + g
        packed = jnp.repeat(region.transpose(2, 0, 1, 3), group, axis=1)
        return jnp.pad(packed, ((0, 0), (0, rows - num_tokens * group), (0, 0), (0, 0)))

    region_k, region_v = pack(region_k), pack(region_v)
    queries = layout.pack_queries(q, num_kv_heads, rows)[:, :, None, :]  # [K, rows, 1, D]
    packed_depth = jnp.pad(jnp.repeat(depth, group), (0, rows - num_tokens * group),
                           constant_values=-1)
    last = (length + packed_depth).reshape(rows, 1, 1)
    windowed = first_visible is not None
    # Each packed row's first visible position (row t * G + g: query t's; padding rows see
    # everything up to `last`, as without a window).
    first_rows = () if not windowed else (jnp.pad(
        jnp.repeat(first_visible.astype(jnp.int32), group), (0, rows - num_tokens * group),
        constant_values=jnp.iinfo(jnp.int32).min).reshape(rows, 1, 1),)
    first = length // block_kv
    end = -(-(length + jnp.max(depth) + 1) // block_kv)
    scalars = jnp.stack([length, layer, first, end]).astype(jnp.int32)

    def cache_index(tile, step, scalars_ref):
        # Past the committed run the index repeats: nothing new is fetched.
        block = jnp.minimum(step, jnp.maximum(scalars_ref[2] - 1, 0))
        return scalars_ref[1], block, 0, 0

    def region_index(tile, step, scalars_ref):
        return 0, tile, jnp.clip(step - scalars_ref[2], 0, region_blocks - 1), 0

    rows_spec = pl.BlockSpec((num_kv_heads, block_rows, 1, head_dim),
                             lambda tile, step, scalars_ref: (0, tile, 0, 0))
    position_spec = pl.BlockSpec((block_rows, 1, 1),
                                 lambda tile, step, scalars_ref: (tile, 0, 0))
    cache_spec = pl.BlockSpec((None, block_kv, num_kv_heads, head_dim), cache_index)
    region_spec = pl.BlockSpec((num_kv_heads, block_rows, block_kv, head_dim), region_index)
    state = lambda width: pltpu.VMEM((num_kv_heads, block_rows, 1, width), jnp.float32)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_ordered_kernel, block_kv=block_kv, num_steps=num_steps,
                          scale=(1.0 / math.sqrt(head_dim) if scale is None
                                 else float(scale)), softcap=softcap, windowed=windowed),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(rows // block_rows, num_steps),
            in_specs=[rows_spec, position_spec, *(position_spec,) * windowed,
                      cache_spec, cache_spec, region_spec, region_spec],
            out_specs=rows_spec,
            scratch_shapes=[state(1), state(1), state(head_dim)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, rows, 1, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=block_sizes.vmem_limit_bytes or VMEM_LIMIT),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ordered_attention_tpu",
    )(scalars, queries, last, *first_rows, k_cache, v_cache, region_k, region_v)
    return layout.unpack_output(out[:, :, 0, :], num_tokens, num_heads)
