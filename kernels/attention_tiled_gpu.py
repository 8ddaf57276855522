"""Position-ordered verify/decode attention on tensor-core dots (Pallas, Triton lowering):
a query's arithmetic is the same in a one-token step and in a tree verification pass, and
a GQA group's query heads share one read of the keys and values.

:mod:`.attention_ordered_gpu` makes a tree pass bitwise the one-token steps with
elementwise products, one program per *query* head. This kernel keeps its order (keys in
blocks aligned at absolute position 0, one online-softmax update per block, in order) but
computes each block with dots, which are row-independent for the same reason:

* **A dot at a fixed tile is row-independent.** Element ``c[i, j]`` of ``dot(A, B)`` at a
  fixed tile shape, instruction and order over the contracted axis depends only on
  ``A[i, :]`` and ``B[:, j]``: it is computed the same way whatever the other rows of
  ``A`` hold and however many of them are real. The tiles here never depend on the number
  of new tokens: ``block_rows`` and ``block_kv`` are fixed per shape family
  (:class:`GpuTiledBlockSizes`), and a one-token step pads its rows to ``block_rows``.
* **One program per (KV head, row tile).** A tile's rows are (new token, query head of the
  group) pairs, row ``t * G + g`` (:func:`.layout.pack_queries`), so the group's keys and
  values are read once for all its query heads. Scores are ``dot(q [R, D], K^T [D, Bk])``
  and the values' sum ``dot(p [R, Bk], V [Bk, D])``, both accumulated in float32.
* **Blocks wholly before the committed length** hold the same keys for every row: one
  shared dot each.
* **Blocks that reach past the committed length** hold, per row, the cache below
  ``length`` and the row's own ancestor chain above it (the new tokens a row sees form a
  chain: prefill, decode and tree verification). In the one-token step at the same
  position those keys are committed, so the step reads them in a shared block. To give
  both the same arithmetic, such a block runs the *same update* once per new token ``n``
  with rows in the tile, with ``n``'s keys and values (``dot(q_tile, K_n^T)``,
  ``dot(p, V_n)``, the softmax around them), and keeps the rows of ``n`` (its G query
  heads): their values are then exactly what a shared block with ``n``'s keys gives (the
  other rows' results are discarded). It costs two dots per token of the tile (at most
  ``block_rows / G + 1``; one in a one-token step) for the 1-2 blocks that overlap new
  tokens.
* **Blocks past a row's own position** (deeper rows share its tile) are fully masked: the
  update is an exact identity (max unchanged, correction ``exp(0) = 1``, zero
  probabilities, zero values), so the trip count does not change the result.
* **Optional split over the sequence** (``split_kv``): splits at absolute positions 0,
  ``split_kv``, ``2 split_kv``, ..., one program each, from a fresh softmax state; the
  partial (m, l, acc) merge in split order (:func:`merge_splits`). The boundaries and the
  order do not depend on the row count; a split holding none of a row's keys is
  (``MASK_VALUE``, 0, 0), which merges as exact zeros, so the one-token step's fewer
  non-empty splits merge to the same bits.

So for a row at absolute position ``p``, every block's scores, maximum, probabilities and
sums are the same operations on the same values whether the pass has 1 row or 64, and by
induction over depth (a node's keys and values come from row-independent projections) a
verify pass reproduces ``ar``'s one-token steps bit for bit. The result differs from
:mod:`.attention_ordered_gpu`'s in the last bits (dots are not its elementwise sums); the
two must not be mixed within one generation.

Drafting calls with a scratch window (``scratch_mask``) are refused, as by the ordered
kernel.
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
from .attention_ordered_gpu import ancestor_chains, check_call

KERNEL_NAME = "GPU tiled position-ordered attention kernel"
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = layout.FLOAT_DTYPES


@dataclasses.dataclass(frozen=True)
class GpuTiledBlockSizes:
    """Static tiling of :func:`tiled_attention_gpu` (powers of two >= 16: the smallest
    Triton dot). Fixed per call shape family: never derived from the number of tokens or
    the cache length; the cache capacity must be a multiple of ``block_kv``."""

    block_rows: int = 16
    block_kv: int = 64
    # Positions per split of the sequence (0: no split), a multiple of block_kv: splits at
    # absolute positions 0, split_kv, 2 split_kv, ..., one program each, merged in order.
    split_kv: int = 0
    num_warps: int = 4
    num_stages: int = 1

    def check(self) -> None:
        for name in ("block_rows", "block_kv"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: {name}={value} must be a power of two >= 16")
        if self.split_kv < 0 or self.split_kv % self.block_kv:
            raise InvalidArgumentError(
                f"{KERNEL_NAME}: split_kv={self.split_kv} must be 0 (no split) or a "
                f"multiple of block_kv={self.block_kv}")


def _dot(a, b, *, transposed: bool):
    """a @ b (b [K, N]) or a @ b.T (b [N, K]), float32 accumulation; float32 inputs at
    full precision (no TF32), so the tolerance of the reference holds."""
    precision = lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else \
        lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (1 if transposed else 0,)), ((), ())),
                           precision=(precision, precision),
                           preferred_element_type=jnp.float32)


def block_update(carry, q, keys, values, valid, *, scale: float):
    """One online-softmax step of a row tile over one block of keys (every block, shared
    or per row, goes through it: the only arithmetic on scores and values).

    Args:
      carry: (m [R], l [R], acc [R, D]) float32.
      q: [R, D] in the inputs' dtype; keys, values: [Bk, D] in the same dtype, zero
        where not readable.
      valid: bool [R, Bk], the keys each row sees.
      scale: the score scale.
    Returns:
      The next carry.
    """
    m, l, acc = carry
    s = _dot(q, keys, transposed=True) * scale  # [R, Bk]
    s = jnp.where(valid, s, layout.MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + _dot(p.astype(values.dtype), values, transposed=False)
    return m_next, l, acc


def _tiled_rows(q, depth, owner, tokens, length, cache_block, chain_block, blocks, *,
                block_kv: int, scale: float):
    """The position-ordered online softmax of one row tile over the blocks ``blocks``
    (first, limit) (int32: the whole sequence, or one split of it).

    Args:
      q: [R, D] the tile's rows (one KV head's group, (token, head) rows).
      depth: int32 [R], each row's depth among the new tokens (-1 for padding rows).
      owner: int32 [R], the new token each row belongs to.
      tokens: (first, stop) int32, the new tokens that own the tile's real rows.
      length: int32 [] committed slots.
      cache_block: ``(start, readable) ->`` the committed keys and values of the block at
        ``start`` ([Bk, D] each, zero where not readable).
      chain_block: ``(start, n) ->`` token n's ancestors' keys and values at the block's
        positions ([Bk, D] each, zero below ``length`` and past n's depth).
      blocks: (first, limit) int32 block indices.
    Returns:
      The carry (m [R], l [R], acc [R, D]) float32; the initial one (``MASK_VALUE``, 0, 0)
      for rows with no key in ``blocks``.
    """
    rows, head_dim = q.shape
    last = length + depth  # each row's own position; padding rows: length - 1
    # A tile of padding rows only reads nothing and returns zeros.
    real = jnp.max(depth) >= 0
    end = jnp.where(real, length + jnp.max(depth) + 1, 0)
    offsets = jnp.arange(block_kv, dtype=jnp.int32)
    update = functools.partial(block_update, scale=scale)

    def shared(block, carry):
        start = pl.multiple_of(block * block_kv, block_kv)
        positions = start + offsets
        keys, values = cache_block(start, positions < length)
        return update(carry, q, keys, values, positions[None, :] <= last[:, None])

    def boundary(block, carry):
        start = pl.multiple_of(block * block_kv, block_kv)
        positions = start + offsets
        in_cache = positions < length
        keys, values = cache_block(start, in_cache)
        valid = positions[None, :] <= last[:, None]

        def one_token(n, out):
            chain_keys, chain_values = chain_block(start, n)
            token_keys = jnp.where(in_cache[:, None], keys, chain_keys)
            token_values = jnp.where(in_cache[:, None], values, chain_values)
            m, l, acc = update(carry, q, token_keys, token_values, valid)
            mine = owner == n
            return (jnp.where(mine, m, out[0]), jnp.where(mine, l, out[1]),
                    jnp.where(mine[:, None], acc, out[2]))

        return lax.fori_loop(tokens[0], tokens[1], one_token, carry)

    init = (jnp.full((rows,), layout.MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    first_boundary = jnp.where(real, length // block_kv, 0)
    first, limit = blocks[0], jnp.minimum(blocks[1], pl.cdiv(end, block_kv))
    carry = lax.fori_loop(first, jnp.minimum(first_boundary, limit), shared, init)
    return lax.fori_loop(jnp.maximum(first, first_boundary), limit, boundary, carry)


def _normalized(l, acc):
    """The attention output from an online softmax's (l, acc): a row with no key (padding)
    gives zeros."""
    return acc / jnp.where(l == 0.0, 1.0, l)[..., None]


def _tiled_kernel(length_ref, layer_ref, q_ref, depth_ref, links_ref, k_new_ref, v_new_ref,
                  k_ref, v_ref, *out_refs, group: int, block_rows: int, block_kv: int,
                  split_kv: int, scale: float):
    """One (KV head, row tile[, split]) program.

    Refs: length_ref, layer_ref int32 [1]; q_ref [block_rows, D] (the group's rows, row
    ``t * group + g`` token t's); depth_ref int32 [block_rows]; links_ref the whole int32
    [T, Bk + W + Bk] (slot ``Bk + j``: the token's ancestor at depth j, an index of
    ``k_new``; -1 elsewhere);
    k_new_ref, v_new_ref the whole [T, K, D]; k_ref, v_ref the whole cache [L, S, K, D].
    Outputs: without a split, o_ref [block_rows, D]; with one (``split_kv`` positions per
    split, program axis 2), the split's m_ref, l_ref [block_rows] and acc_ref
    [block_rows, D], float32.
    """
    kv_head, tile = pl.program_id(0), pl.program_id(1)
    length, layer = length_ref[0], layer_ref[0]
    q = q_ref[...]
    head_dim = q.shape[1]
    row0 = tile * block_rows
    columns = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def cache_block(start, readable):
        window = (layer, pl.ds(start, block_kv), kv_head, slice(None))
        mask = jnp.broadcast_to(readable[:, None], (block_kv, head_dim))
        return (plgpu.load(k_ref.at[window], mask=mask, other=0),
                plgpu.load(v_ref.at[window], mask=mask, other=0))

    def chain_block(start, token):
        # Link slots for positions >= length: slot Bk + (position - length) >= 1.
        links = plgpu.load(links_ref.at[token, pl.ds(start - length + block_kv, block_kv)])
        mask = jnp.broadcast_to((links >= 0)[:, None], (block_kv, head_dim))
        # A gather: slot j reads new token links[j] (all-integer indexing).
        source = jnp.maximum(links, 0)[:, None]
        return (plgpu.load(k_new_ref.at[source, kv_head, columns], mask=mask, other=0),
                plgpu.load(v_new_ref.at[source, kv_head, columns], mask=mask, other=0))

    if split_kv:
        split = pl.program_id(2)
        per_split = split_kv // block_kv
        blocks = (split * per_split, (split + 1) * per_split)
    else:
        blocks = (0, pl.cdiv(k_ref.shape[1], block_kv) + links_ref.shape[1] // block_kv)
    owner = (row0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)) // group
    tokens = (row0 // group, jnp.minimum(pl.cdiv(row0 + block_rows, group),
                                         k_new_ref.shape[0]))
    m, l, acc = _tiled_rows(q, depth_ref[...], owner, tokens, length, cache_block,
                            chain_block, blocks, block_kv=block_kv, scale=scale)
    if split_kv:
        m_ref, l_ref, acc_ref = out_refs
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc
    else:
        (o_ref,) = out_refs
        o_ref[...] = _normalized(l, acc).astype(o_ref.dtype)


def merge_splits(m, l, acc):
    """The attention output from per-split partial softmaxes, merged in split order (a
    fixed, position-aligned order: the same for a one-token call and a pass). A split
    with no key for a row (m = ``MASK_VALUE``, l = 0, acc = 0) adds exact zeros.

    Args:
      m, l: float32 [splits, ...rows]; acc: float32 [splits, ...rows, D].
    Returns:
      float32 [...rows, D].
    """
    top = jnp.max(m, axis=0)
    l_sum, acc_sum = jnp.zeros_like(l[0]), jnp.zeros_like(acc[0])
    for split in range(m.shape[0]):  # unrolled: one order, written out
        weight = jnp.exp(m[split] - top)
        l_sum = l_sum + l[split] * weight
        acc_sum = acc_sum + acc[split] * weight[..., None]
    return _normalized(l_sum, acc_sum)


def tiled_links(mask: jax.Array, group: int, rows: int, block_kv: int):
    """(links int32 [T, Bk + W + Bk], depth int32 [rows]) of :func:`tiled_attention_gpu`,
    from the visibility mask [T, T] among the new tokens (W = T rounded up to
    ``block_kv``). Slot ``Bk + j`` of token t's links holds its ancestor at depth j, every
    other slot -1; ``depth`` is per row (row ``t * group + g`` is token t's; padding rows
    -1). Depends on the mask only."""
    num_tokens = mask.shape[0]
    chain, depth = ancestor_chains(mask)
    chain = jnp.where(jnp.arange(num_tokens)[None, :] <= depth[:, None], chain, -1)
    width = layout.round_up(num_tokens, block_kv)
    links = jnp.pad(chain, ((0, 0), (block_kv, width - num_tokens + block_kv)),
                    constant_values=-1)
    depth = jnp.repeat(depth, group)
    return links, jnp.pad(depth, (0, rows - depth.shape[0]), constant_values=-1)


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: GpuTiledBlockSizes = GpuTiledBlockSizes()) -> None:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call."""
    k_cache = check_call(KERNEL_NAME, q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                         head_dims=HEAD_DIMS, dtypes=DTYPES)
    block_sizes.check()
    if k_cache is not None and k_cache.shape[0] % block_sizes.block_kv:
        # The block holding `length` is read whole from the cache.
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: cache capacity {k_cache.shape[0]} is not a multiple of "
            f"block_kv={block_sizes.block_kv}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def tiled_attention_gpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None,
                        *, layer=None, block_sizes: GpuTiledBlockSizes = GpuTiledBlockSizes(),
                        interpret: bool = False):
    """Attention with a position-ordered reduction on tensor-core dots; same semantics as
    :func:`specjax.attention.attention_reference` for calls whose rows see chains of new
    tokens (prefill, decode, tree verification); see the module docstring.

    Args:
      q: [T, H, D]; k_new, v_new: [T, K, D]; k_cache, v_cache: [S, K, D], [L, S, K, D]
        (with ``layer``) or ``None``; length: int32 []; mask: bool [T, T] (ancestors and
        self); scratch_mask: ``None`` or an empty [T, 0].
      layer: int32 [] layer of stacked caches.
      block_sizes: static :class:`GpuTiledBlockSizes`.
      interpret: Pallas' interpreter instead of a GPU compile.
    Returns:
      [T, H, D] in q's dtype.
    """
    check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                    block_sizes=block_sizes)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    block_rows, block_kv = block_sizes.block_rows, block_sizes.block_kv
    if k_cache is None:  # no prefix: a zero-length cache of one block
        k_cache = v_cache = jnp.zeros((1, block_kv, num_kv_heads, head_dim), k_new.dtype)
        length, layer = 0, 0
    elif layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    rows = layout.round_up(num_tokens * group, block_rows)
    links, depth = tiled_links(mask, group, rows, block_kv)
    length = jnp.asarray(length, jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    split_kv = block_sizes.split_kv
    grid = (num_kv_heads, rows // block_rows)
    row_spec = pl.BlockSpec((None, block_rows, head_dim), lambda h, i, *_: (h, i, 0))
    if split_kv:  # positions reach length + T - 1 < S + T
        grid += (pl.cdiv(k_cache.shape[1] + num_tokens, split_kv),)
        splits = (grid[2], num_kv_heads, rows)
        vector_spec = pl.BlockSpec((None, None, block_rows), lambda h, i, j: (j, h, i))
        out_specs = [vector_spec, vector_spec,
                     pl.BlockSpec((None, None, block_rows, head_dim),
                                  lambda h, i, j: (j, h, i, 0))]
        out_shape = [jax.ShapeDtypeStruct(splits, jnp.float32)] * 2 + [
            jax.ShapeDtypeStruct((*splits, head_dim), jnp.float32)]
    else:
        out_specs = row_spec
        out_shape = jax.ShapeDtypeStruct((num_kv_heads, rows, head_dim), q.dtype)
    out = pl.pallas_call(
        functools.partial(_tiled_kernel, group=group, block_rows=block_rows,
                          block_kv=block_kv, split_kv=split_kv,
                          scale=1.0 / math.sqrt(head_dim)),
        grid=grid,
        in_specs=[pl.no_block_spec, pl.no_block_spec, row_spec,
                  pl.BlockSpec((block_rows,), lambda h, i, *_: (i,)),
                  pl.no_block_spec, pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,
                  pl.no_block_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="tiled_attention_gpu",
    )(length, layer, layout.pack_queries(q, num_kv_heads, rows), depth, links, k_new, v_new,
      k_cache, v_cache)
    if split_kv:
        out = merge_splits(*out).astype(q.dtype)
    return layout.unpack_output(out, num_tokens, num_heads)
