"""Verify/decode attention for TPUs: Pallas with the Mosaic lowering (flash-decoding).

Semantics: exactly :func:`specjax.attention.attention_reference`, Gemma-style attention
soft-capping (``softcap``: every score, committed slots and tail alike, becomes
``c * tanh(score / c)`` before the mask) and sliding windows (``first_visible``: query ``t``
sees committed slot ``s`` iff ``first_visible[t] <= s < length``; the scratch window and
the new tokens are not windowed) included; the data layout (packed query rows, the tail of
scratch window + new tokens, the integer tail mask) is described in
:mod:`specjax.kernels.layout`.

Two ``pallas_call`` invocations, both with TPU-legal blocks (the last two block dims equal the
array's or are multiples of (8, 128)):

1. ``_split_kernel``, grid ``(row_tiles, splits, steps)`` with semantics (parallel, parallel,
   arbitrary): the committed slots are cut into ``splits`` runs of whole ``block_kv`` blocks,
   sized from the *traced* length (scalar-prefetched into SMEM with the traced layer).
   Step ``i`` of split ``j`` reads the cache block ``[block_kv, K, D]`` of that layer
   (every KV head at once, so the cache is read in place in its ``[L, S, K, D]`` or
   ``[S, K, D]`` layout, never copied; the head is picked by a static index inside the
   kernel, never by a dynamic one, which Mosaic cannot prove aligned for bfloat16); the
   index map clamps the block index to the run's last valid block, so steps past
   ``length`` fetch nothing new and ``pl.when`` skips their compute. With a sliding window
   each packed query row carries its first visible slot (an int32 ``[rows, 128]`` block,
   lanes broadcast like ``m``/``l``; padding rows get int32 max and see nothing), the
   committed slots a row sees are ``first <= slot < length``, and masked probabilities
   are forced to 0 (a row may have a whole block masked). The split partition is still
   derived from ``length`` alone: a block below every row's window in the tile (its first
   block is scalar-prefetched per tile) is neither computed (``pl.when``; computing it
   would leave every row's ``(acc, m, l)`` bit-identical) nor fetched (the index map holds
   the index at the window's first block of the run). For each KV head it
   updates an online softmax for one tile of that head's query rows (group heads x tree
   nodes), accumulating straight into the split's output block ``(acc, m, l)``, which
   stays in VMEM across the steps; ``m`` and ``l`` are kept broadcast over 128 lanes, the
   layout Mosaic handles best.
2. ``_combine_kernel``, grid ``(K, row_tiles)``: scores the tail under its mask, merges the
   splits' partials and writes the normalised output in the query dtype.

VMEM: the query rows are tiled so that both kernels' estimated VMEM (:func:`vmem_plan`,
from the block sizes, counting double buffering and the (8, 128) tile padding) stays
under :data:`VMEM_BUDGET`, which fits the smallest VMEM of the generations we compile for
(TPU v4: 16 MiB per core; v5e/v6e: 128 MiB; v5p/v7x: 64 MiB), and ``block_kv`` (256 down
to 32 slots) is the largest among those needing the fewest tiles. Every supported model
shape takes one tile up to 36 tree nodes and at most 4 at 128 (each further tile reads
the committed cache once more). ``tests/test_tpu_compile.py`` compiles both kernels for
real TPU targets and checks the estimate against the VMEM the compiler allocates.

Float32 inputs use ``Precision.HIGHEST`` dots; bf16 inputs use the MXU with float32
accumulation. Softmax and accumulators are float32.

Interpret mode: ``interpret=True`` runs the kernels in the TPU interpreter
(``pltpu.InterpretParams``: memory spaces, DMAs and grid semantics simulated on the CPU,
uninitialised buffers filled with NaN), which is how the CPU tests check the numerics.
Compiled for TPU v4, v5e and v6e in the test suite (Mosaic and XLA run to the end, no
device needed); not yet run or timed on TPU hardware.
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

# Blocks end in the whole head_dim (the array's last dim), so 64, 80 (Phi-2) and 96
# (Phi-3) are legal; VMEM pads them to 128 lanes, which the estimates count.
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KERNEL_NAME = "TPU verify-attention kernel"
TAKES_LAYER_INDEX = True  # reads layer ``layer`` of an [L, S, K, D] cache in place
TAKES_WINDOWS = True  # takes ``softcap`` and ``first_visible`` (Gemma 2/3, sliding windows)
LANES = 128
# block_kv values tried, largest first. Below 128 the score tiles leave lanes idle, but
# every KV head shares a cache block, so many-head MHA models fit v4's VMEM only so.
BLOCK_KV_CHOICES = (256, 128, 64, 32)
MIN_BLOCK_KV = 32
MiB = 2**20
# Each kernel's estimated VMEM stays under this, so that it fits TPU v4's 16 MiB per core
# with room for Mosaic's internal scratch; the scoped limit asked of the compiler is v4's
# whole VMEM (every later generation has more).
VMEM_BUDGET = 12 * MiB
VMEM_LIMIT = 16 * MiB
# Score-sized float32 temporaries ([rows, keys]) live at once in a head's update: scores,
# probabilities, their exponentials and masks, and what the compiler spills of them.
_SCORE_TEMPORARIES = 8
_INTERNAL_SCRATCH = 64 * 1024  # Mosaic's own scratch per kernel (36 KiB in its reports)
# Float32 values per KV head that the split kernel keeps live at once (the heads' loop is
# unrolled and the compiler overlaps the heads): [block_kv, D]-sized ones (its K and V
# loads, the masked V, their float32 forms) and [rows, 128]-sized ones (scores, the
# running max and sum, the accumulator update). Fitted to the compiler's VMEM reports
# (spills: up to 4.7 block-sized per head with 16 KV heads; 2 row-sized at block_kv 32).
_HEAD_TEMPORARIES = 5
_HEAD_ROW_TEMPORARIES = 3


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Static tiling of :func:`verify_attention_tpu`.

    Attributes:
      block_kv: cache slots per grid step, a multiple of 32; ``None``: the largest of
        :data:`BLOCK_KV_CHOICES` among those needing the fewest row tiles.
      num_splits: KV splits run in parallel (2 feeds both TensorCores of a megacore chip).
      block_rows: query rows (tree nodes x query heads of one KV head) per tile, a multiple
        of the dtype's sublane tile (8 for float32, 16 for bfloat16); ``None``: the most
        that fit :data:`VMEM_BUDGET`.
      vmem_limit_bytes: scoped VMEM limit; ``None``: :data:`VMEM_LIMIT`.
    """

    block_kv: int | None = None
    num_splits: int = 2
    block_rows: int | None = None
    vmem_limit_bytes: int | None = None

    def check(self) -> None:
        if self.block_kv is not None and (self.block_kv < MIN_BLOCK_KV
                                          or self.block_kv % MIN_BLOCK_KV):
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_kv={self.block_kv} must be a positive multiple of "
                f"{MIN_BLOCK_KV}")
        if self.num_splits < 1:
            raise InvalidArgumentError(f"{KERNEL_NAME}: num_splits={self.num_splits} must be >= 1")
        if self.block_rows is not None and (self.block_rows < 8 or self.block_rows % 8):
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_rows={self.block_rows} must be a positive multiple of 8")


@dataclasses.dataclass(frozen=True)
class VmemPlan:
    """Tiling and estimated VMEM of one call (see :func:`vmem_plan`).

    Attributes:
      block_kv: cache slots per step; block_rows: query rows per tile; row_tiles: tiles per
        KV head; tail: tail keys after padding (P).
      split_bytes: estimated VMEM of the split kernel (0 without a cache).
      combine_bytes: estimated VMEM of the combine kernel.
    """

    block_kv: int
    block_rows: int
    row_tiles: int
    tail: int
    split_bytes: int
    combine_bytes: int

    @property
    def rows(self) -> int:
        """R, query rows per KV head after padding."""
        return self.block_rows * self.row_tiles

    @property
    def estimate(self) -> int:
        return max(self.split_bytes, self.combine_bytes)


def _split_vmem(block_rows, num_kv_heads, head_dim, block_kv, itemsize,
                windowed: bool = False) -> int:
    """Bytes of VMEM the split kernel needs for a tile of ``block_rows`` rows (``windowed``:
    with the rows' first visible slots, an int32 [block_rows, 128] block)."""
    lanes = layout.round_up(head_dim, LANES)  # head_dim 64 still fills 128 lanes
    kv_sublanes = layout.round_up(num_kv_heads, 32 // itemsize)  # K tiles [block_kv, K, D]
    windows = (num_kv_heads * block_rows * lanes * itemsize  # queries
               + 2 * block_kv * kv_sublanes * lanes * itemsize  # k, v
               + num_kv_heads * block_rows * (lanes + 2 * LANES) * 4  # acc, m, l
               + (block_rows * LANES * 4 if windowed else 0))  # first visible slots
    temporaries = (_SCORE_TEMPORARIES * block_rows * layout.round_up(block_kv, LANES) * 4
                   + num_kv_heads * 4 * (_HEAD_TEMPORARIES * block_kv * lanes
                                         + _HEAD_ROW_TEMPORARIES * block_rows * LANES))
    return 2 * windows + temporaries + _INTERNAL_SCRATCH  # windows are double-buffered


def _combine_vmem(block_rows, head_dim, tail, num_splits, itemsize) -> int:
    """Bytes of VMEM the combine kernel needs for a tile of ``block_rows`` rows."""
    lanes = layout.round_up(head_dim, LANES)
    windows = (2 * block_rows * lanes * itemsize  # queries, output
               + 2 * tail * lanes * itemsize  # tail keys, values
               + block_rows * tail * 4  # tail mask (int32)
               + num_splits * block_rows * (lanes + 2 * LANES) * 4)  # partials
    temporaries = _SCORE_TEMPORARIES * block_rows * tail * 4 + block_rows * lanes * 4
    return 2 * windows + temporaries + _INTERNAL_SCRATCH


def vmem_plan(q, k_new, scratch_mask, has_cache: bool,
              block_sizes: TpuBlockSizes | None = None, *, windowed: bool = False) -> VmemPlan:
    """Tiling and VMEM estimate for these shapes (arrays or ``ShapeDtypeStruct``;
    ``windowed``: with ``first_visible``, whose block the split kernel reads too).

    Among the allowed ``block_kv`` values, takes the one needing the fewest row tiles (each
    tile reads the cache again), then the largest; each tile's rows are the most that keep
    both kernels' estimates under :data:`VMEM_BUDGET`.

    Raises:
      InvalidArgumentError: not even one sublane tile of rows fits the budget.
    """
    block_sizes = block_sizes or TpuBlockSizes()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    itemsize = jnp.dtype(q.dtype).itemsize
    sublanes = 32 // itemsize  # row tile of the query/output blocks: 8 f32, 16 bf16
    needed = layout.round_up(num_tokens * (num_heads // num_kv_heads), sublanes)
    tail = layout.round_up(layout.tail_width(num_tokens, scratch_mask, has_cache), LANES)
    splits = block_sizes.num_splits if has_cache else 0
    if block_sizes.block_rows is not None and block_sizes.block_rows % sublanes:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: block_rows={block_sizes.block_rows} must be a multiple of "
            f"{sublanes} for {jnp.dtype(q.dtype).name}")

    def bytes_for(block_kv, rows):
        split = (_split_vmem(rows, num_kv_heads, head_dim, block_kv, itemsize, windowed)
                 if has_cache else 0)
        return split, _combine_vmem(rows, head_dim, tail, splits, itemsize)

    def plan_for(block_kv):
        if block_sizes.block_rows is not None:
            largest = block_sizes.block_rows
        else:
            # Both estimates grow linearly in the rows: the largest tile that fits.
            largest = needed
            for base, step in zip(bytes_for(block_kv, 0), bytes_for(block_kv, sublanes)):
                if step > base:
                    largest = min(largest,
                                  max(VMEM_BUDGET - base, 0) // (step - base) * sublanes)
        largest = min(largest, needed)
        if largest < sublanes:
            return None
        row_tiles = -(-needed // largest)
        block_rows = layout.round_up(-(-needed // row_tiles), sublanes)  # least padding
        return VmemPlan(block_kv, block_rows, row_tiles, tail, *bytes_for(block_kv, block_rows))

    choices = (block_sizes.block_kv,) if block_sizes.block_kv else BLOCK_KV_CHOICES
    plans = [p for p in map(plan_for, choices) if p is not None and p.estimate <= VMEM_BUDGET]
    if not plans:
        smallest = plan_for(choices[-1]) or VmemPlan(choices[-1], sublanes, 1, tail,
                                                     *bytes_for(choices[-1], sublanes))
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {num_kv_heads} KV heads x head_dim {head_dim} "
            f"({jnp.dtype(q.dtype).name}) with block_kv={choices[-1]} and "
            f"{smallest.block_rows} query rows per tile need ~{smallest.estimate / MiB:.1f} "
            f"MiB of VMEM (budget {VMEM_BUDGET // MiB} MiB); use a smaller block_kv or "
            "block_rows")
    return min(plans, key=lambda p: (p.row_tiles, -p.block_kv))


def _dot(a, b, *, contract_b: int):
    """a @ b (contract_b=0) or a @ b.T (contract_b=1), float32 result."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _run(length, num_splits: int, block_kv: int):
    """(blocks per split, number of valid blocks) for a traced length."""
    num_blocks = pl.cdiv(length, block_kv)
    return pl.cdiv(num_blocks, num_splits), num_blocks


def _kv_index_map(num_splits: int, block_kv: int, windowed: bool = False):
    def index_map(tile, split, step, scalars_ref):
        per_split, num_blocks = _run(scalars_ref[0], num_splits, block_kv)
        last = jnp.maximum(per_split - 1, 0)
        offset = jnp.minimum(step, last)
        if windowed:
            # Steps below the tile's window (computed by none of its rows) hold the index
            # at the window's first block of the run: one fetch, used by the step that
            # reaches it. The partition (the runs) does not move.
            offset = jnp.maximum(offset, jnp.minimum(scalars_ref[2 + tile]
                                                     - split * per_split, last))
        block = split * per_split + offset
        # Past the run's end the index repeats, so the pipeline fetches nothing new.
        return scalars_ref[1], jnp.maximum(jnp.minimum(block, num_blocks - 1), 0), 0, 0

    return index_map


def _split_kernel(scalars_ref, q_ref, *refs, block_kv: int, num_splits: int, scale: float,
                  softcap: float | None, windowed: bool):
    """Online softmax of one tile of query rows over one split of the committed slots.

    Refs: scalars_ref int32 [2 + tiles] (SMEM: length, layer, then with a window each row
    tile's first block: the first block any of its rows sees); q_ref [K, rows, D]; with a
    window first_ref int32 [rows, 128] (each row's first visible slot, all lanes equal);
    k_ref, v_ref [block_kv, K, D] (of the layer);
    outputs (resident across the steps, so they are the running state) acc_ref [K, rows, D],
    m_ref, l_ref [K, rows, 128].
    """
    if windowed:
        first_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    else:
        (k_ref, v_ref, acc_ref, m_ref, l_ref), first_ref = refs, None
    tile, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = scalars_ref[0]
    per_split, num_blocks = _run(length, num_splits, block_kv)
    block = split * per_split + step
    num_kv_heads = q_ref.shape[0]
    computed = (step < per_split) & (block < num_blocks)
    if windowed:  # a block below every row's window adds nothing to any row: skipped
        computed = computed & (block >= scalars_ref[2 + tile])

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, layout.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(computed)
    def _accumulate():
        start = block * block_kv
        slots_by_column = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        slots_by_row = start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        visible = slots_by_column < length  # [1, block_kv]
        if windowed:  # [rows, block_kv]
            visible = visible & (slots_by_column >= first_ref[:, :1])
        for head in range(num_kv_heads):  # static index: a strided load Mosaic can align
            k = k_ref[:, head, :]  # [block_kv, D]
            # Slots past the cache's end hold whatever the edge block's padding holds.
            v = jnp.where(slots_by_row < length, v_ref[:, head, :], 0)
            s = layout.capped(_dot(q_ref[head], k, contract_b=1) * scale,
                              softcap)  # [rows, block_kv]
            s = jnp.where(visible, s, layout.MASK_VALUE)
            m_prev = m_ref[head]  # [rows, 128], all lanes equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            if windowed:
                # A row may see none of the block, and nothing yet (m == MASK_VALUE, where
                # exp(s - m) is 1): its masked slots must weigh 0, so that a wholly masked
                # block leaves (acc, m, l) bit-identical, as skipping it does. (Without
                # this the weights would still vanish from the output, by the next
                # correction or the combine's exp(MASK_VALUE - m), but not from the state.)
                p = jnp.where(visible, p, 0.0)
            l_ref[head] = correction * l_ref[head] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[head] = m_next
            acc_ref[head] = (correction[:, :1] * acc_ref[head]
                             + _dot(p.astype(v.dtype), v, contract_b=0))


def _combine_kernel(q_ref, tail_k_ref, tail_v_ref, tail_mask_ref, *refs, scale: float,
                    num_splits: int, softcap: float | None):
    """Tail attention merged with the splits' partials, for one KV head and row tile.

    Refs: q_ref [rows, D]; tail_k_ref, tail_v_ref [P, D]; tail_mask_ref int32 [rows, P];
    then (with a cache) acc_ref [splits, rows, D], m_ref, l_ref [splits, rows, 128];
    o_ref [rows, D].
    """
    *partials, o_ref = refs
    tail_v = tail_v_ref[...]
    visible = tail_mask_ref[...] != 0
    s = layout.capped(_dot(q_ref[...], tail_k_ref[...], contract_b=1) * scale,
                      softcap)  # [rows, P]
    s = jnp.where(visible, s, layout.MASK_VALUE)
    m = jnp.max(s, axis=1, keepdims=True)  # [rows, 1]
    if partials:
        acc_ref, m_ref, l_ref = partials
        for split in range(num_splits):
            m = jnp.maximum(m, m_ref[split][:, :1])
    p = jnp.where(visible, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=1, keepdims=True)
    acc = _dot(p.astype(tail_v.dtype), tail_v, contract_b=0)
    if partials:
        for split in range(num_splits):
            # 0 for an empty split, or one whose slots all lie outside the row's window
            weight = jnp.exp(m_ref[split][:, :1] - m)
            acc = acc + weight * acc_ref[split]
            l = l + weight * l_ref[split][:, :1]
    # Only padding rows have l == 0 (every real row sees its own token).
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: TpuBlockSizes = TpuBlockSizes(), softcap=None,
                    first_visible=None) -> int:
    """Raises :class:`InvalidArgumentError` unless the kernel takes these shapes/dtypes.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values); the caches
    may be one layer [S, K, D] or all layers [L, S, K, D]; ``softcap`` must be a positive
    number and ``first_visible`` int32 [T] (or ``None``). Returns the kernel's estimated
    VMEM use in bytes (the larger of its two ``pallas_call``; see :func:`vmem_plan`).
    """
    k_cache, v_cache = layout.one_layer_caches(k_cache, v_cache, KERNEL_NAME)
    layout.check_inputs(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                        head_dims=HEAD_DIMS, dtypes=DTYPES, kernel=KERNEL_NAME)
    layout.check_windows(q.shape[0], softcap, first_visible, KERNEL_NAME)
    block_sizes.check()
    return vmem_plan(q, k_new, scratch_mask, k_cache is not None, block_sizes,
                     windowed=first_visible is not None).estimate


def _first_visible_rows(first_visible, group: int, rows: int, block_rows: int,
                        block_kv: int, capacity: int):
    """(int32 [rows, 128]: packed row ``t * G + g``'s first visible slot
    ``first_visible[t]`` in every lane, int32 max for padding rows (they see nothing);
    int32 [rows // block_rows]: each row tile's first block, the first any of its rows
    sees)."""
    per_row = jnp.repeat(first_visible.astype(jnp.int32), group)
    per_row = jnp.pad(per_row, (0, rows - per_row.shape[0]),
                      constant_values=jnp.iinfo(jnp.int32).max)
    lowest = jnp.min(per_row.reshape(rows // block_rows, block_rows), axis=1)
    first_blocks = jnp.clip(lowest, 0, capacity) // block_kv
    return jnp.broadcast_to(per_row[:, None], (rows, LANES)), first_blocks


def _split_partials(scalars, queries, k_cache, v_cache, first_visible, plan: VmemPlan, *,
                    splits: int, group: int, scale: float, softcap: float | None,
                    vmem_limit: int, interpret):
    """The split kernel's ``pallas_call``: the partials (acc [splits, K, rows, D], m, l
    [splits, K, rows, 128]) over the committed slots of the stacked caches [L, S, K, D];
    ``first_visible`` int32 [T] or ``None`` (no window)."""
    num_kv_heads, rows, head_dim = queries.shape
    block_rows, block_kv, capacity = plan.block_rows, plan.block_kv, k_cache.shape[1]
    windowed = first_visible is not None
    steps = pl.cdiv(pl.cdiv(capacity, block_kv), splits)
    kv_spec = pl.BlockSpec((None, block_kv, num_kv_heads, head_dim),
                           _kv_index_map(splits, block_kv, windowed))
    inputs = [queries]
    specs = [pl.BlockSpec((num_kv_heads, block_rows, head_dim),
                          lambda tile, split, step, scalars_ref: (0, tile, 0))]
    if windowed:
        first_rows, first_blocks = _first_visible_rows(first_visible, group, rows, block_rows,
                                                       block_kv, capacity)
        scalars = jnp.concatenate([scalars, first_blocks])
        inputs.append(first_rows)
        specs.append(pl.BlockSpec((block_rows, LANES),
                                  lambda tile, split, step, scalars_ref: (tile, 0)))
    state_spec = lambda width: pl.BlockSpec(  # noqa: E731
        (None, num_kv_heads, block_rows, width),
        lambda tile, split, step, scalars_ref: (split, 0, tile, 0))
    state_shape = lambda width: jax.ShapeDtypeStruct(  # noqa: E731
        (splits, num_kv_heads, rows, width), jnp.float32)
    return pl.pallas_call(
        functools.partial(_split_kernel, block_kv=block_kv, num_splits=splits, scale=scale,
                          softcap=softcap, windowed=windowed),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(plan.row_tiles, splits, steps),
            in_specs=[*specs, kv_spec, kv_spec],
            out_specs=[state_spec(head_dim), state_spec(LANES), state_spec(LANES)],
        ),
        out_shape=[state_shape(head_dim), state_shape(LANES), state_shape(LANES)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="verify_attention_tpu_split",
    )(scalars, *inputs, k_cache, v_cache)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "softcap"))
def verify_attention_tpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                         layer=None, softcap: float | None = None, first_visible=None,
                         block_sizes: TpuBlockSizes = TpuBlockSizes(),
                         interpret: bool = False):
    """Tree/decode attention on a TPU (Mosaic); same semantics as ``attention_reference``.

    Args:
      q: [T, H, D] queries, 1 <= T <= 128, D in (64, 80, 96, 128, 256).
      k_new, v_new: [T, K, D] keys/values of the new tokens (H a multiple of K).
      k_cache, v_cache: [S, K, D] one layer's cache, [L, S, K, D] every layer's (read at
        ``layer``, in place), or ``None``.
      length: int32 [], committed cache slots visible to every query.
      mask: bool [T, T], visibility among the new tokens (diagonal set).
      scratch_mask: optional bool [T, M], visibility of scratch slots ``length + m``.
      layer: int32 [] (traced) layer of [L, S, K, D] caches; ``None`` for [S, K, D].
      softcap: static ``c`` > 0: every score becomes ``c * tanh(score / c)`` before the
        mask (committed slots and tail); ``None``: no capping.
      first_visible: int32 [T] (traced) or ``None``, a sliding window: query ``t`` sees
        committed slot ``s`` iff ``first_visible[t] <= s < length`` (int32 min: every
        slot; past ``length``: none). The scratch window and the new tokens are not
        windowed (``mask`` carries the window among the new tokens).
      block_sizes: static :class:`TpuBlockSizes`.
      interpret: run in the TPU interpreter (``pltpu.InterpretParams``) on any backend.
    Returns:
      [T, H, D] in the dtype of ``q``.
    Raises:
      InvalidArgumentError: shapes, head_dim, dtype or sizes the kernel cannot take.
    """
    config = block_sizes
    check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask, block_sizes=config,
                    softcap=softcap, first_visible=first_visible)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    has_cache = k_cache is not None
    if not has_cache:
        first_visible = None  # only committed slots are windowed
    windowed = first_visible is not None
    if has_cache and (k_cache.ndim == 4) != (layer is not None):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: pass layer= exactly when the caches are [L, S, K, D] (got caches "
            f"of rank {k_cache.ndim} and layer={'None' if layer is None else 'an index'})")
    if has_cache and layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0  # a free reshape
    plan = vmem_plan(q, k_new, scratch_mask, has_cache, config, windowed=windowed)
    rows, block_rows, tiles, tail = plan.rows, plan.block_rows, plan.row_tiles, plan.tail
    vmem_limit = config.vmem_limit_bytes or VMEM_LIMIT
    scale = 1.0 / math.sqrt(head_dim)
    length = jnp.asarray(0 if length is None else length, jnp.int32)
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    scalars = jnp.stack([length, layer])
    interpret = pltpu.InterpretParams() if interpret else False

    queries = layout.pack_queries(q, num_kv_heads, rows)
    window_k = window_v = None
    window_mask = scratch_mask
    if has_cache and scratch_mask is not None and scratch_mask.shape[1] > 0:
        # The scratch window as a small cache of its own (M slots from slot 0), so that the
        # shared packing never slices a layer out of the stacked cache.
        window_k, window_v, window_mask = layout.scratch_window(k_cache, v_cache, layer,
                                                               length, scratch_mask)
    tail_k, tail_v, tail_mask = layout.pack_tail(
        k_new, v_new, window_k, window_v, jnp.int32(0), mask, window_mask, group=group,
        rows=rows, tail=tail, mask_dtype=jnp.int32)

    partials = []
    partial_specs = []
    splits = config.num_splits
    if has_cache:
        partials = _split_partials(scalars, queries, k_cache, v_cache, first_visible, plan,
                                   splits=splits, group=group, scale=scale, softcap=softcap,
                                   vmem_limit=vmem_limit, interpret=interpret)
        partial_spec = lambda width: pl.BlockSpec(  # noqa: E731
            (splits, None, block_rows, width), lambda head, tile: (0, head, tile, 0))
        partial_specs = [partial_spec(head_dim), partial_spec(LANES), partial_spec(LANES)]

    rows_spec = pl.BlockSpec((None, block_rows, head_dim), lambda head, tile: (head, tile, 0))
    tail_spec = pl.BlockSpec((None, tail, head_dim), lambda head, tile: (head, 0, 0))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, scale=scale, num_splits=splits if has_cache else 0,
                          softcap=softcap),
        grid=(num_kv_heads, tiles),
        in_specs=[rows_spec, tail_spec, tail_spec,
                  pl.BlockSpec((block_rows, tail), lambda head, tile: (tile, 0)),
                  *partial_specs],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="verify_attention_tpu_combine",
    )(queries, tail_k, tail_v, tail_mask, *partials)
    return layout.unpack_output(out, num_tokens, num_heads)
