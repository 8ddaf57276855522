"""Verify/decode attention for TPUs: Pallas with the Mosaic lowering (flash-decoding).

Semantics: exactly :func:`specjax.attention.attention_reference`; the data layout (packed
query rows, the tail of scratch window + new tokens, the integer tail mask) is described
in :mod:`specjax.kernels.layout`.

Two ``pallas_call`` invocations, both with TPU-legal blocks (the last two block dims equal the
array's or are multiples of (8, 128)):

1. ``_split_kernel``, grid ``(splits, steps)`` with semantics (parallel, arbitrary): the
   committed slots are cut into ``splits`` runs of whole ``block_kv`` blocks, sized from
   the *traced* length (scalar-prefetched into SMEM). Step ``i`` of split ``j`` reads the
   cache block ``[block_kv, K, D]`` (every KV head at once, so the cache is read in place
   in its ``[S, K, D]`` layout, once); the index map clamps the block index to the run's
   last valid block, so steps past ``length`` fetch nothing new and ``pl.when`` skips their
   compute. For each KV head it updates an online softmax (VMEM scratch) for all of that
   head's query rows (group heads x tree nodes in one tile) and writes the unnormalised
   ``(acc, m, l)`` at the split's last step; ``m`` and ``l`` are kept broadcast over 128
   lanes, the layout Mosaic handles best.
2. ``_combine_kernel``, grid ``(K,)``: scores the tail under its mask, merges the splits'
   partials and writes the normalised output in the query dtype.

Float32 inputs use ``Precision.HIGHEST`` dots; bf16 inputs use the MXU with float32
accumulation. Softmax and accumulators are float32.

Interpret mode: ``interpret=True`` runs the kernels in the TPU interpreter
(``pltpu.InterpretParams``: memory spaces, DMAs and grid semantics simulated on the CPU,
uninitialised buffers filled with NaN), which is how the CPU tests check this kernel.
This kernel has been checked in that interpreter only; a real TPU compiles the Mosaic
code further (vector layouts), which no machine of this project could run yet.
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

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KERNEL_NAME = "TPU verify-attention kernel"
LANES = 128
VMEM_BUDGET = 48 * 2**20  # the most this kernel asks for (v7x has 64 MiB per core)


@dataclasses.dataclass(frozen=True)
class TpuBlockSizes:
    """Static tiling of :func:`verify_attention_tpu`.

    Attributes:
      block_kv: cache slots per grid step, a multiple of 128.
      num_splits: KV splits run in parallel (2 feeds both TensorCores of a megacore chip).
      vmem_limit_bytes: scoped VMEM limit; ``None``: twice the estimate, at least 32 MiB.
    """

    block_kv: int = 256
    num_splits: int = 2
    vmem_limit_bytes: int | None = None

    def check(self) -> None:
        if self.block_kv < LANES or self.block_kv % LANES:
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: block_kv={self.block_kv} must be a positive multiple of {LANES}")
        if self.num_splits < 1:
            raise InvalidArgumentError(f"{KERNEL_NAME}: num_splits={self.num_splits} must be >= 1")


def _dot(a, b, *, contract_b: int):
    """a @ b (contract_b=0) or a @ b.T (contract_b=1), float32 result."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _run(length, num_splits: int, block_kv: int):
    """(blocks per split, number of valid blocks) for a traced length."""
    num_blocks = pl.cdiv(length, block_kv)
    return pl.cdiv(num_blocks, num_splits), num_blocks


def _kv_index_map(num_splits: int, block_kv: int):
    def index_map(split, step, length_ref):
        per_split, num_blocks = _run(length_ref[0], num_splits, block_kv)
        block = split * per_split + jnp.minimum(step, jnp.maximum(per_split - 1, 0))
        # Past the run's end the index repeats, so the pipeline fetches nothing new.
        return jnp.maximum(jnp.minimum(block, num_blocks - 1), 0), 0, 0

    return index_map


def _split_kernel(length_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, acc_scratch,
                  m_scratch, l_scratch, *, block_kv: int, num_splits: int, scale: float):
    """Online softmax of every query row over one split of the committed slots.

    Refs: length_ref int32 [1] (SMEM); q_ref [K, R, D]; k_ref, v_ref [block_kv, K, D];
    outputs acc_ref [K, R, D], m_ref, l_ref [K, R, 128]; scratch of the same shapes.
    """
    split, step = pl.program_id(0), pl.program_id(1)
    length = length_ref[0]
    per_split, num_blocks = _run(length, num_splits, block_kv)
    block = split * per_split + step
    num_kv_heads, rows, _ = q_ref.shape

    @pl.when(step == 0)
    def _init():
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)
        m_scratch[...] = jnp.full(m_scratch.shape, layout.MASK_VALUE, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)

    @pl.when((step < per_split) & (block < num_blocks))
    def _accumulate():
        start = block * block_kv
        slots_by_column = start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        slots_by_row = start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        for head in range(num_kv_heads):
            k = k_ref[:, head, :]  # [block_kv, D]
            # Slots past the cache's end hold whatever the edge block's padding holds.
            v = jnp.where(slots_by_row < length, v_ref[:, head, :], 0)
            s = _dot(q_ref[head], k, contract_b=1) * scale  # [R, block_kv]
            s = jnp.where(slots_by_column < length, s, layout.MASK_VALUE)
            m_prev = m_scratch[head]  # [R, 128], all lanes equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            l_scratch[head] = correction * l_scratch[head] + jnp.sum(p, axis=1, keepdims=True)
            m_scratch[head] = m_next
            acc_scratch[head] = (correction[:, :1] * acc_scratch[head]
                                 + _dot(p.astype(v.dtype), v, contract_b=0))

    @pl.when(step == pl.num_programs(1) - 1)
    def _write():
        acc_ref[...] = acc_scratch[...]
        m_ref[...] = m_scratch[...]
        l_ref[...] = l_scratch[...]


def _combine_kernel(q_ref, tail_k_ref, tail_v_ref, tail_mask_ref, *refs, scale: float,
                    num_splits: int):
    """Tail attention merged with the splits' partials, for one KV head.

    Refs: q_ref [R, D]; tail_k_ref, tail_v_ref [P, D]; tail_mask_ref int32 [R, P]; then
    (with a cache) acc_ref [splits, R, D], m_ref, l_ref [splits, R, 128]; o_ref [R, D].
    """
    *partials, o_ref = refs
    tail_v = tail_v_ref[...]
    visible = tail_mask_ref[...] != 0
    s = _dot(q_ref[...], tail_k_ref[...], contract_b=1) * scale  # [R, P]
    s = jnp.where(visible, s, layout.MASK_VALUE)
    m = jnp.max(s, axis=1, keepdims=True)  # [R, 1]
    if partials:
        acc_ref, m_ref, l_ref = partials
        for split in range(num_splits):
            m = jnp.maximum(m, m_ref[split][:, :1])
    p = jnp.where(visible, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=1, keepdims=True)
    acc = _dot(p.astype(tail_v.dtype), tail_v, contract_b=0)
    if partials:
        for split in range(num_splits):
            weight = jnp.exp(m_ref[split][:, :1] - m)  # 0 for an empty split
            acc = acc + weight * acc_ref[split]
            l = l + weight * l_ref[split][:, :1]
    # Only padding rows have l == 0 (every real row sees its own token).
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _vmem_estimate(num_kv_heads, rows, head_dim, block_kv, tail, itemsize) -> int:
    sublanes = layout.round_up(num_kv_heads, 32 // itemsize)  # K is tiled on sublanes
    kv_blocks = 2 * 2 * block_kv * sublanes * head_dim * itemsize  # k, v; double-buffered
    queries = 2 * num_kv_heads * rows * head_dim * itemsize
    state = 3 * num_kv_heads * rows * (head_dim + 2 * LANES) * 4  # scratch + outputs
    scores = 4 * rows * max(block_kv, tail) * 4
    return kv_blocks + queries + state + scores


def _padded_sizes(q, k_new, scratch_mask, has_cache: bool) -> tuple[int, int]:
    """(rows, tail): R padded to the sublane tiling, M + T padded to whole lanes."""
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k_new.shape[1]
    rows = layout.round_up(num_tokens * group, 32 // jnp.dtype(q.dtype).itemsize)
    tail = layout.round_up(layout.tail_width(num_tokens, scratch_mask, has_cache), LANES)
    return rows, tail


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: TpuBlockSizes = TpuBlockSizes()) -> int:
    """Raises :class:`InvalidArgumentError` unless the kernel takes these shapes/dtypes.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values). Returns the
    kernel's estimated VMEM use in bytes.
    """
    layout.check_inputs(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                        head_dims=HEAD_DIMS, dtypes=DTYPES, kernel=KERNEL_NAME)
    block_sizes.check()
    num_kv_heads, head_dim = k_new.shape[1:]
    rows, tail = _padded_sizes(q, k_new, scratch_mask, k_cache is not None)
    estimate = _vmem_estimate(num_kv_heads, rows, head_dim, block_sizes.block_kv, tail,
                              jnp.dtype(q.dtype).itemsize)
    if estimate > VMEM_BUDGET:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {num_kv_heads} KV heads x {rows} query rows x head_dim {head_dim} "
            f"need ~{estimate >> 20} MiB of VMEM (budget {VMEM_BUDGET >> 20} MiB); "
            "use fewer tree nodes or a smaller block_kv")
    return estimate


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def verify_attention_tpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                         block_sizes: TpuBlockSizes = TpuBlockSizes(), interpret: bool = False):
    """Tree/decode attention on a TPU (Mosaic); same semantics as ``attention_reference``.

    Args:
      q: [T, H, D] queries, 1 <= T <= 128, D in (64, 128, 256).
      k_new, v_new: [T, K, D] keys/values of the new tokens (H a multiple of K).
      k_cache, v_cache: [S, K, D] one layer's cache, or ``None``.
      length: int32 [], committed cache slots visible to every query.
      mask: bool [T, T], visibility among the new tokens (diagonal set).
      scratch_mask: optional bool [T, M], visibility of scratch slots ``length + m``.
      block_sizes: static :class:`TpuBlockSizes`.
      interpret: run in the TPU interpreter (``pltpu.InterpretParams``) on any backend.
    Returns:
      [T, H, D] in the dtype of ``q``.
    Raises:
      InvalidArgumentError: shapes, head_dim, dtype or sizes the kernel cannot take.
    """
    config = block_sizes
    estimate = check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                               block_sizes=config)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    has_cache = k_cache is not None
    rows, tail = _padded_sizes(q, k_new, scratch_mask, has_cache)
    vmem_limit = config.vmem_limit_bytes or min(max(2 * estimate, 32 * 2**20), VMEM_BUDGET)
    scale = 1.0 / math.sqrt(head_dim)
    length = jnp.asarray(0 if length is None else length, jnp.int32).reshape(1)
    interpret = pltpu.InterpretParams() if interpret else False

    queries = layout.pack_queries(q, num_kv_heads, rows)
    tail_k, tail_v, tail_mask = layout.pack_tail(
        k_new, v_new, k_cache, v_cache, length[0], mask, scratch_mask, group=group, rows=rows,
        tail=tail, mask_dtype=jnp.int32)

    partials = []
    partial_specs = []
    splits = config.num_splits
    if has_cache:
        capacity = k_cache.shape[0]
        steps = pl.cdiv(pl.cdiv(capacity, config.block_kv), splits)
        kv_spec = pl.BlockSpec((config.block_kv, num_kv_heads, head_dim),
                               _kv_index_map(splits, config.block_kv))
        state_shape = (num_kv_heads, rows)
        whole = lambda *shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
        per_split = lambda *shape: pl.BlockSpec(  # noqa: E731
            (None, *shape), lambda split, step, length_ref: (split,) + (0,) * len(shape))
        partials = pl.pallas_call(
            functools.partial(_split_kernel, block_kv=config.block_kv, num_splits=splits,
                              scale=scale),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(splits, steps),
                in_specs=[whole(num_kv_heads, rows, head_dim), kv_spec, kv_spec],
                out_specs=[per_split(*state_shape, head_dim), per_split(*state_shape, LANES),
                           per_split(*state_shape, LANES)],
                scratch_shapes=[pltpu.VMEM((*state_shape, head_dim), jnp.float32),
                                pltpu.VMEM((*state_shape, LANES), jnp.float32),
                                pltpu.VMEM((*state_shape, LANES), jnp.float32)],
            ),
            out_shape=[
                jax.ShapeDtypeStruct((splits, *state_shape, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((splits, *state_shape, LANES), jnp.float32),
                jax.ShapeDtypeStruct((splits, *state_shape, LANES), jnp.float32),
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit),
            interpret=interpret,
            name="verify_attention_tpu_split",
        )(length, queries, k_cache, v_cache)
        partial_specs = [
            pl.BlockSpec((splits, None, rows, head_dim), lambda h: (0, h, 0, 0)),
            pl.BlockSpec((splits, None, rows, LANES), lambda h: (0, h, 0, 0)),
            pl.BlockSpec((splits, None, rows, LANES), lambda h: (0, h, 0, 0)),
        ]

    head_spec = lambda *shape: pl.BlockSpec((None, *shape), lambda h: (h, 0, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_combine_kernel, scale=scale, num_splits=splits if has_cache else 0),
        grid=(num_kv_heads,),
        in_specs=[head_spec(rows, head_dim), head_spec(tail, head_dim), head_spec(tail, head_dim),
                  pl.BlockSpec((rows, tail), lambda h: (0, 0)), *partial_specs],
        out_specs=head_spec(rows, head_dim),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="verify_attention_tpu_combine",
    )(queries, tail_k, tail_v, tail_mask, *partials)
    return layout.unpack_output(out, num_tokens, num_heads)
