"""Verify/decode attention for GPUs: Pallas with the Triton lowering (flash-decoding).

Semantics: exactly :func:`specjax.attention.attention_reference`; the data layout (packed
query rows, the tail of scratch window + new tokens, the integer tail mask) is described
in :mod:`specjax.kernels.layout`.

Two ``pallas_call`` invocations:

1. ``_split_kernel``, grid ``(K, row blocks, splits)``: the committed slots ``[0, length)``
   are cut into ``splits`` contiguous runs of whole ``block_kv`` blocks (the run length is
   computed from the *traced* length, so a short context still spreads over every split);
   each program loops over its run only (a ``fori_loop`` with traced bounds, so no block
   at or past ``length`` is read) and keeps an online softmax ``(m, l, acc)`` for its
   ``block_rows`` query rows, which it writes out unnormalised. K/V are read in place from
   the cache (one layer ``[S, K, D]``, or layer ``layer`` of the stacked ``[L, S, K, D]``:
   the layer is a traced index, so the model never copies a layer's slots out) with masked
   loads; the last block's slots past ``length`` load as zeros and score ``MASK_VALUE``.
2. ``_combine_kernel``, grid ``(K, row blocks)``: scores the tail under its mask, merges
   it with the splits' partials (rescaling each by ``exp(m_split - m)``) and writes the
   normalised output in the query dtype.

Soft-capping (Gemma 2) and sliding windows (Gemma 2/3, Mistral, Phi-3): with ``softcap``
every float32 score becomes ``c * tanh(score / c)`` before the mask; with ``first_visible``
each packed row carries its query's first visible slot, the split kernel masks slots below
it (what a row accumulates before the first slot it sees is scaled by exactly 0 later, so
its output does not depend on the other rows of its block) and a row block does not read
the blocks below all of its rows' windows. The splits' runs stay the ones ``length``
gives: a short window over a long cache leaves the early splits idle.

Head sizes: any multiple of 16 up to 256. Triton's tiles are powers of two, so a head_dim
that is not one (Phi-2's 80, Phi-3's 96) runs on tiles of the next (128; 144 to 240 on
256): the packed queries and tail rows are zero-padded to it (a few rows per call), the
cache is not: the split kernel loads the cache's D columns into the wider tile with the
columns past D masked off, and the output is cut back to D.

Scores, softmax and accumulators are float32; the scale ``1/sqrt(D)`` is applied to the
float32 scores. Float32 inputs use IEEE float32 dots (``Precision.HIGHEST``; Triton's
default would be TF32); bf16/fp16 inputs use the tensor cores with float32 accumulation.

Tiling (:class:`GpuBlockSizes`): every call uses the same ``block_rows`` (16 by default)
whatever the number of query rows, more rows meaning more row blocks in the grid, and the
number of KV splits depends on the KV heads and the capacity only. So a query row's
arithmetic (its blocks, splits and merge order) does not depend on how many tree nodes
share the call. The 16-row tile is also the one the one-token call has always used: a
64-row tile was ~30x slower per call on an H100 in float32 (benchmarks/README.md,
"Kernels"), as [64, 64] float32 tiles for q, k, v, the scores and the accumulator under
IEEE (non-tensor-core) dots on 4 warps very likely spill registers.
``benchmarks/bench_kernels.py --sweep`` times 16/32/64 rows x 4/8 warps x fp32/bf16.

``interpret=True`` runs the same kernels with Pallas' generic interpreter on any backend
(the CPU test path): output buffers start as NaN there, so an element a kernel fails to
write shows up in the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.errors import InvalidArgumentError
from . import layout

# Any multiple of 16 up to 256; Triton's tiles are powers of two: a size that is not one
# (Phi-2's 80, Phi-3's 96) runs on tiles of the next (see _columns).
HEAD_DIMS = tuple(range(16, 257, 16))
DTYPES = layout.FLOAT_DTYPES
KERNEL_NAME = "GPU verify-attention kernel"
DEFAULT_BLOCK_ROWS = 16
TAKES_LAYER_INDEX = True  # reads layer ``layer`` of an [L, S, K, D] cache in place
TAKES_WINDOWS = True  # soft-capping (``softcap``) and sliding windows (``first_visible``)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Static tiling of :func:`verify_attention_gpu` (all powers of two >= 16).

    Attributes:
      block_rows: query rows (tree nodes x the group's heads) per program; ``None``:
        :data:`DEFAULT_BLOCK_ROWS` (16) for every call; more rows mean more row blocks.
      block_kv: cache slots per inner-loop step.
      num_splits: KV splits per (KV head, row block); ``None``: about one program per
        streaming multiprocessor for one row block, with at least two blocks per split at
        full capacity (independent of the number of rows).
      num_warps, num_stages: Triton launch parameters.
    """

    block_rows: int | None = None
    block_kv: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def resolve(self, rows: int, num_kv_heads: int, capacity: int) -> "GpuBlockSizes":
        """Fills in the ``None`` sizes for a call with ``rows`` query rows per KV head.

        ``block_rows`` defaults to :data:`DEFAULT_BLOCK_ROWS` for every call, and the
        default ``num_splits`` ignores ``rows``: a row's reduction order is then the same
        in a one-token step and in a 64-node verify pass (see the module docstring).
        """
        del rows  # deliberately: see the docstring
        block_rows = self.block_rows or DEFAULT_BLOCK_ROWS
        num_splits = self.num_splits
        if num_splits is None:
            # About one wave of programs for a one-row-block call, but at least two blocks
            # per split at full capacity: each split writes float32 partials that the
            # combine reads back.
            wanted = layout.next_power_of_2(-(-_multiprocessor_count() // num_kv_heads))
            most = 1 << max(0, (capacity // (2 * self.block_kv)).bit_length() - 1)
            num_splits = max(1, min(wanted, most, 256))
        return dataclasses.replace(self, block_rows=block_rows, num_splits=num_splits)

    def check(self) -> None:
        """Raises :class:`InvalidArgumentError` for a size that is set and not allowed."""
        for name in ("block_rows", "block_kv", "num_splits", "num_warps"):
            value = getattr(self, name)
            floor = 16 if name in ("block_rows", "block_kv") else 1
            if value is not None and (value < floor or value & (value - 1)):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: {name}={value} must be a power of two >= {floor}")


def _multiprocessor_count() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)  # 132: an H100 SXM


def _dot(a, b, *, contract_b: int):
    """a @ b (contract_b=0) or a @ b.T (contract_b=1), float32 result."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                           precision=(precision, precision),
                           preferred_element_type=jnp.float32)


def _columns(x, width: int):
    """x [..., D] zero-padded, or cut, to [..., width] (x itself when D == width).

    Triton's tiles are powers of two: a head_dim that is not one (Phi-2's 80, Phi-3's 96)
    runs on tiles of the next (128 for both). The few packed rows (queries, tail keys and
    values) are zero-padded to it; the cache is not (that would be a cache-sized copy per
    layer and step): the split kernel loads its D columns into the wider tile, masked. The
    padded columns add 0 to every score and give 0 in the output, which is cut back to D.
    """
    extra = width - x.shape[-1]
    if extra < 0:
        return x[..., :width]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _split_kernel(length_ref, layer_ref, q_ref, *refs, block_kv: int, scale: float,
                  softcap: float | None, windowed: bool):
    """Online softmax of one row block over one split of the committed cache slots.

    Refs: length_ref, layer_ref int32 [1]; q_ref [block_rows, Dp] (one KV head's rows,
    zero-padded to the tile width Dp); with ``windowed``, first_ref int32 [block_rows]
    (each row's first visible slot); k_ref, v_ref the whole cache [L, S, K, D], D <= Dp
    (its columns D..Dp-1 are not loaded: they load as zeros); outputs acc_ref
    [block_rows, Dp], m_ref, l_ref [block_rows].
    """
    if windowed:
        first_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    else:
        k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    head, split = pl.program_id(0), pl.program_id(2)
    num_splits = pl.num_programs(2)
    length, layer = length_ref[0], layer_ref[0]
    num_blocks = pl.cdiv(length, block_kv)
    per_split = pl.cdiv(num_blocks, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    q = q_ref[...]
    rows, padded_dim = q.shape
    head_dim = k_ref.shape[-1]  # the cache's; below padded_dim (80 of 128) its tail is masked
    columns = slice(None) if head_dim == padded_dim else pl.ds(0, padded_dim)
    first_visible = None
    if windowed:
        first_visible = first_ref[...]  # [rows]
        # Blocks below every row's window are not read. For a row, a block it cannot see
        # adds nothing that survives (see below): its result does not depend on the rows it
        # shares the program with. The split's run stays the one ``length`` gives.
        lowest = jnp.clip(jnp.min(first_visible), 0, length)
        first = jnp.maximum(first, lowest // block_kv)

    def body(block, carry):
        acc, m, l = carry
        start = pl.multiple_of(block * block_kv, block_kv)
        slots = start + jnp.arange(block_kv, dtype=jnp.int32)
        valid = slots < length  # [block_kv]
        load_mask = jnp.broadcast_to(valid[:, None], (block_kv, padded_dim))
        if head_dim != padded_dim:  # a [block_kv, Dp] tile over the D columns the cache has
            in_cache = jnp.arange(padded_dim, dtype=jnp.int32) < head_dim
            load_mask = load_mask & in_cache[None, :]
        window = (layer, pl.ds(start, block_kv), head, columns)
        k = plgpu.load(k_ref.at[window], mask=load_mask, other=0)
        v = plgpu.load(v_ref.at[window], mask=load_mask, other=0)
        s = layout.capped(_dot(q, k, contract_b=1) * scale, softcap)  # [rows, block_kv]
        visible = valid[None, :]
        if windowed:
            visible = visible & (slots[None, :] >= first_visible[:, None])
        s = jnp.where(visible, s, layout.MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_next)
        # A row that has seen no slot yet (m_next still MASK_VALUE) sums junk here; the
        # first block it sees scales that by exp(MASK_VALUE - m) = 0, as the combine does
        # for a split it saw nothing of.
        p = jnp.exp(s - m_next[:, None])
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, contract_b=0)
        return acc, m_next, l

    init = (jnp.zeros((rows, padded_dim), jnp.float32),
            jnp.full((rows,), layout.MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(first, last, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _combine_kernel(q_ref, tail_k_ref, tail_v_ref, tail_mask_ref, *refs, scale: float,
                    num_splits: int, softcap: float | None):
    """Tail attention merged with the splits' partials; writes the normalised output.

    Refs: q_ref [block_rows, D]; tail_k_ref, tail_v_ref [P, D]; tail_mask_ref int8
    [block_rows, P]; then (when there is a cache) acc_ref [splits, block_rows, D], m_ref,
    l_ref [splits, block_rows]; last the output o_ref [block_rows, D].
    """
    *partials, o_ref = refs
    q = q_ref[...]
    tail_v = tail_v_ref[...]
    visible = tail_mask_ref[...] != 0
    s = layout.capped(_dot(q, tail_k_ref[...], contract_b=1) * scale, softcap)  # [rows, P]
    s = jnp.where(visible, s, layout.MASK_VALUE)
    m = jnp.max(s, axis=1)
    if partials:
        acc_ref, m_ref, l_ref = partials
        m = lax.fori_loop(0, num_splits, lambda j, m: jnp.maximum(m, m_ref[j]), m)
    p = jnp.where(visible, jnp.exp(s - m[:, None]), 0.0)
    l = jnp.sum(p, axis=1)
    acc = _dot(p.astype(tail_v.dtype), tail_v, contract_b=0)
    if partials:
        def merge(j, carry):
            acc, l = carry
            weight = jnp.exp(m_ref[j] - m)  # 0 for an empty split (m_ref = MASK_VALUE)
            return acc + weight[:, None] * acc_ref[j], l + weight * l_ref[j]

        acc, l = lax.fori_loop(0, num_splits, merge, (acc, l))
    # Only padding rows have l == 0 (every real row sees its own token).
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: GpuBlockSizes = GpuBlockSizes(), softcap=None,
                    first_visible=None) -> GpuBlockSizes:
    """Raises :class:`InvalidArgumentError` unless the kernel takes these shapes/dtypes.

    Only shapes and dtypes are read (arrays or ``jax.ShapeDtypeStruct`` values); the caches
    may be one layer [S, K, D] or all layers [L, S, K, D]. Returns the block sizes resolved
    for the call.
    """
    k_cache, v_cache = layout.one_layer_caches(k_cache, v_cache, KERNEL_NAME)
    layout.check_inputs(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                        head_dims=HEAD_DIMS, dtypes=DTYPES, kernel=KERNEL_NAME)
    layout.check_windows(q.shape[0], softcap, first_visible, KERNEL_NAME)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_new.shape[1]
    capacity = k_cache.shape[0] if k_cache is not None else 0
    block_sizes.check()
    config = block_sizes.resolve(num_tokens * num_heads // num_kv_heads, num_kv_heads, capacity)
    config.check()
    return config


@functools.partial(jax.jit, static_argnames=("softcap", "block_sizes", "interpret"))
def verify_attention_gpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None, *,
                         layer=None, softcap: float | None = None, first_visible=None,
                         block_sizes: GpuBlockSizes = GpuBlockSizes(),
                         interpret: bool = False):
    """Tree/decode attention on a GPU (Triton); same semantics as ``attention_reference``.

    Args:
      q: [T, H, D] queries, 1 <= T <= 128.
      k_new, v_new: [T, K, D] keys/values of the new tokens (H a multiple of K).
      k_cache, v_cache: [S, K, D] one layer's cache, [L, S, K, D] every layer's (read at
        ``layer``, in place), or ``None``.
      length: int32 [], committed cache slots visible to every query.
      mask: bool [T, T], visibility among the new tokens (diagonal set).
      scratch_mask: optional bool [T, M], visibility of scratch slots ``length + m``.
      layer: int32 [] (traced) layer of [L, S, K, D] caches; ``None`` for [S, K, D].
      softcap: static ``c``: every score becomes ``c * tanh(score / c)`` before the mask
        (Gemma 2); ``None``: none.
      first_visible: optional int32 [T], a sliding window: query ``t`` sees committed
        slots ``first_visible[t] <= s < length`` only (``mask`` carries the window among
        the new tokens; scratch slots are not windowed). Cache blocks below every query's
        window in a row block are not read.
      block_sizes: static :class:`GpuBlockSizes`.
      interpret: run in Pallas' interpreter (any backend) instead of compiling for a GPU.
    Returns:
      [T, H, D] in the dtype of ``q``.
    Raises:
      InvalidArgumentError: shapes, head_dim, dtype or block sizes the kernel cannot take.
    """
    config = check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                             block_sizes=block_sizes, softcap=softcap,
                             first_visible=first_visible)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    has_cache = k_cache is not None
    if has_cache and (k_cache.ndim == 4) != (layer is not None):
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: pass layer= exactly when the caches are [L, S, K, D] (got caches "
            f"of rank {k_cache.ndim} and layer={'None' if layer is None else 'an index'})")
    if has_cache and layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0  # a free reshape
    rows = layout.round_up(num_tokens * group, config.block_rows)
    tail = max(16, layout.next_power_of_2(layout.tail_width(num_tokens, scratch_mask, has_cache)))
    scale = 1.0 / math.sqrt(head_dim)
    length = jnp.asarray(0 if length is None else length, jnp.int32)
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)

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
        rows=rows, tail=tail, mask_dtype=jnp.int8)
    padded_dim = layout.next_power_of_2(head_dim)  # 128 for 80 or 96 (see _columns)
    queries, tail_k, tail_v = (_columns(x, padded_dim) for x in (queries, tail_k, tail_v))
    row_blocks = rows // config.block_rows
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    query_spec = pl.BlockSpec((None, config.block_rows, padded_dim), lambda h, i, *_: (h, i, 0))

    partials = []
    partial_specs = []
    if has_cache:
        splits = config.num_splits
        windowed = first_visible is not None
        row_spec = pl.BlockSpec((config.block_rows,), lambda h, i, j: (i,))
        # Each packed row's first visible slot (row t * G + g is query t's; padding rows
        # see no slot).
        first_rows = () if not windowed else (jnp.pad(
            jnp.repeat(first_visible.astype(jnp.int32), group), (0, rows - num_tokens * group),
            constant_values=jnp.iinfo(jnp.int32).max),)
        # The length and the layer as two one-element arrays (a reshape each, no kernel),
        # not one stacked pair: stacking the layer counter with the length is a launch of
        # its own in every layer.
        partials = pl.pallas_call(
            functools.partial(_split_kernel, block_kv=config.block_kv, scale=scale,
                              softcap=softcap, windowed=windowed),
            grid=(num_kv_heads, row_blocks, splits),
            in_specs=[pl.no_block_spec, pl.no_block_spec, query_spec,
                      *[row_spec] * windowed, pl.no_block_spec, pl.no_block_spec],
            out_specs=[
                pl.BlockSpec((None, None, config.block_rows, padded_dim),
                             lambda h, i, j: (j, h, i, 0)),
                pl.BlockSpec((None, None, config.block_rows), lambda h, i, j: (j, h, i)),
                pl.BlockSpec((None, None, config.block_rows), lambda h, i, j: (j, h, i)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((splits, num_kv_heads, rows, padded_dim), jnp.float32),
                jax.ShapeDtypeStruct((splits, num_kv_heads, rows), jnp.float32),
                jax.ShapeDtypeStruct((splits, num_kv_heads, rows), jnp.float32),
            ],
            compiler_params=params,
            interpret=interpret,
            name="verify_attention_gpu_split",
        )(length.reshape(1), layer.reshape(1), queries, *first_rows, k_cache, v_cache)
        partial_specs = [
            pl.BlockSpec((splits, None, config.block_rows, padded_dim), lambda h, i: (0, h, i, 0)),
            pl.BlockSpec((splits, None, config.block_rows), lambda h, i: (0, h, i)),
            pl.BlockSpec((splits, None, config.block_rows), lambda h, i: (0, h, i)),
        ]

    tail_spec = pl.BlockSpec((None, tail, padded_dim), lambda h, i: (h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, scale=scale, softcap=softcap,
                          num_splits=config.num_splits if has_cache else 0),
        grid=(num_kv_heads, row_blocks),
        in_specs=[query_spec, tail_spec, tail_spec,
                  pl.BlockSpec((config.block_rows, tail), lambda h, i: (i, 0)),
                  *partial_specs],
        out_specs=query_spec,
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, rows, padded_dim), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="verify_attention_gpu_combine",
    )(queries, tail_k, tail_v, tail_mask, *partials)
    return layout.unpack_output(_columns(out, head_dim), num_tokens, num_heads)
