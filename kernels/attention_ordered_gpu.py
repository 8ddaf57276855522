"""Position-ordered verify/decode attention for GPUs (Pallas, Triton lowering): a query's
arithmetic is the same in a one-token step and in a tree verification pass.

:mod:`.attention_gpu` reads the committed cache in splits and merges the new tokens (the
"tail") in a combine step; a one-token step at position ``p`` reads its context
``[0, p)`` from the cache, but a tree node at the same position reads its ancestors from
the tail, so the two sum the same terms in different orders and can differ in the last
bit. This kernel sums in an order fixed by *absolute position* alone:

* a query row (one tree node, one query head) sees the keys at positions ``0 .. its own``:
  ``[0, length)`` from the cache, then one new token per depth (its ancestors, then
  itself: the new tokens a row sees form a chain, as in prefill, decode and tree
  verification). They are laid out as one virtual sequence, the new tokens at
  ``length + depth``;
* the sequence is read in blocks of ``block_kv`` positions aligned at absolute position 0,
  one online-softmax update per block, in order, no splits. A block's keys come from the
  cache where ``position < length`` and from the row's own ancestor chain past it (a per-row
  block: the chains are gathered per node beforehand);
* scores and the P @ V sums are elementwise products reduced over fixed tile shapes
  ``[block_rows, block_kv, D]``, not tensor-core dots, so a row's sums never depend on
  other rows or on the tile's row count;
* blocks past a row's own position (other rows in its tile are deeper) are fully masked:
  the update is then an exact identity (max unchanged, correction ``exp(0) = 1``, zero
  probabilities), so the trip count does not change the result;
* a sliding window (``first_visible``, per query) masks keys by absolute position, the
  same in a step and in a pass (blocks wholly before it are identities too; the mask
  among the new tokens stays the chains' mask, without the window); a soft-cap
  (``softcap``) applies to each score.

Head sizes: any multiple of 16 up to 256. Triton's tiles are powers of two, so a head of
another size runs on tiles of the next (Phi-2's 80 and Phi-3's 96 on 128): the rows the
wrapper builds (queries, chains) are zero-padded to it, the cache and the packed q|k|v rows
are loaded into it masked past their D columns, and the output's D columns are stored
masked (:func:`_columns`). A padded column adds ``q * 0 = 0`` to every score and nothing to
any output column, and the tile width is a function of D alone, so each row's sums still
run over one fixed shape. ``block_kv`` is chosen from the head size alone
(:meth:`GpuOrderedBlockSizes.resolve`: 16 positions, 8 for 256-wide tiles), never from the
row count, so a one-token step and a verify pass group the same positions.

Why a row's result does not depend on the call: every quantity a row's output is reduced
from (its scores over a block, the block's maximum, the correction, the P @ V sums, the
running normaliser) is an elementwise product or a reduction *along that row only*, over a
tile shape ``[block_rows, block_kv, Dp]`` fixed by the head size, in position order over
blocks aligned at position 0; other rows of the tile change neither the operands nor the
shapes. Blocks wholly past a row's own position or before its window are exact identities
for it. By induction over depth (a node's keys/values come from projections that are
themselves row-independent, :mod:`.linear_gpu`), a verify pass then reproduces the
one-token steps bit for bit. The price: the cache is read once per *query* head (no GQA
sharing) and no split over the KV length; ``attention="fused"`` uses it, the default path
does not.

Drafting calls with a scratch window (``scratch_mask``) are not ordered this way; the
dispatcher sends them to :mod:`.attention_gpu`.
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

KERNEL_NAME = "GPU position-ordered attention kernel"
# Any multiple of 16 up to 256; a size that is not a power of two (Phi-2's 80, Phi-3's 96)
# runs on tiles of the next one (see _columns).
HEAD_DIMS = tuple(range(16, 257, 16))
DTYPES = layout.FLOAT_DTYPES
# The automatic block_kv for tiles up to 128 columns wide; wider tiles (256) take fewer
# positions, so that a [block_rows, block_kv, Dp] float32 temporary stays at 16 x 16 x 128.
AUTO_BLOCK_KV = 16
AUTO_BLOCK_WIDTH = 128


@dataclasses.dataclass(frozen=True)
class GpuOrderedBlockSizes:
    """Static tiling of :func:`ordered_attention_gpu`. Fixed per call shape family: never
    derived from the number of tokens or the cache length.

    Attributes:
      block_rows: query rows per program, a power of two >= 16.
      block_kv: positions per block, a power of two >= 8; ``None``: :meth:`resolve`'s
        choice from the head size alone.
      num_warps, num_stages: Triton's.
    """

    block_rows: int = 16
    block_kv: int | None = None
    num_warps: int = 8
    num_stages: int = 1

    def check(self) -> None:
        for name, least in (("block_rows", 16), ("block_kv", 8)):
            value = getattr(self, name)
            if value is not None and (value < least or value & (value - 1)):
                raise InvalidArgumentError(
                    f"{KERNEL_NAME}: {name}={value} must be a power of two >= {least}")

    def resolve(self, head_dim: int) -> int:
        """``block_kv`` for heads of ``head_dim``: the given one, else
        :data:`AUTO_BLOCK_KV` positions for tiles up to :data:`AUTO_BLOCK_WIDTH` columns
        and proportionally fewer for wider ones (8 for 256: the [16, 16, 256] float32
        temporaries of the scores' and the values' products would be twice the 128-wide
        tile's registers). A function of the head size only, so a one-token step and a
        verify pass block the same positions."""
        if self.block_kv is not None:
            return self.block_kv
        return AUTO_BLOCK_KV * AUTO_BLOCK_WIDTH // max(AUTO_BLOCK_WIDTH,
                                                       layout.next_power_of_2(head_dim))

    @property
    def chain_pad(self) -> int:
        """Zero slots on each side of a row's chain links (:func:`packed_links`): at least
        any ``block_kv`` :meth:`resolve` gives, whatever the head size."""
        return self.block_kv if self.block_kv is not None else AUTO_BLOCK_KV


def _columns(x, width: int):
    """x [..., D] zero-padded to [..., width] (x itself when D == width).

    Triton's tiles are powers of two: a head_dim that is not one runs on tiles of the next
    (80 and 96 on 128, 144 to 240 on 256). The few rows the wrapper builds (the queries,
    the chains) are zero-padded to it; the cache and the packed rows are not (that would be
    a copy of them per layer and step): the kernels load their D columns into the wider
    tile, masked, and store the output's D columns, masked. A padded column adds an exact
    0 to every score (``q * 0``) and to no output column, for every row alike: the sums'
    order over the tile is still one fixed shape per head size.
    """
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _column_mask(head_dim: int, width: int):
    """bool [width], ``True`` on the D columns a ``width``-wide tile takes from an array of
    ``head_dim`` columns, or ``None`` when they are the same."""
    if head_dim == width:
        return None
    return jnp.arange(width, dtype=jnp.int32) < head_dim


def ancestor_chains(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chain [T, T] int32, depth [T] int32) from the visibility mask among new tokens.

    ``depth[u]`` is the number of new tokens u sees besides itself; ``chain[t, j]`` is the
    new token at depth ``j`` that row t sees (0 past ``depth[t]``).
    """
    depth = jnp.sum(mask, axis=1, dtype=jnp.int32) - 1
    levels = jnp.arange(mask.shape[0], dtype=jnp.int32)
    at_level = mask[:, None, :] & (depth[None, None, :] == levels[None, :, None])  # [t, j, u]
    return jnp.argmax(at_level, axis=2).astype(jnp.int32), depth


def _block_update(carry, q, keys, values, valid, *, scale: float,
                  softcap: float | None = None):
    """One online-softmax step over a [rows, block_kv] block (the only arithmetic on scores
    and values; every block, cache or chain, goes through it). ``softcap``: scores become
    ``softcap * tanh(s / softcap)`` (Gemma 2), per element."""
    m, l, acc = carry
    s = jnp.sum(q[:, None, :] * keys, axis=2) * scale  # [rows, block_kv]
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid, s, layout.MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l = l * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + jnp.sum(p[:, :, None] * values, axis=1)
    return m_next, l, acc


def _ordered_rows(q, depth, length, cache_block, chain_block, *, block_kv: int,
                  scale: float, softcap: float | None = None, first=None):
    """The position-ordered online softmax of one row tile (both kernels' arithmetic).

    q [rows, D] float32 (one query head, one node per row); depth int32 [rows] (-1 for
    padding rows); ``cache_block(start, valid_slots)`` the committed keys and values of
    the block at ``start`` ([block_kv, D] each, zero where not valid); ``chain_block(start,
    in_cache)`` each row's ancestor chain at those positions ([rows, block_kv, D] each,
    zero in the cache's part and past the row's depth); ``first`` int32 [rows] or ``None``:
    each row's first visible position (a sliding window: keys before it are masked, by
    position, so the same in a step and in a pass; blocks wholly before it are exact
    identities like those past the row). Returns [rows, D] float32.
    """
    rows, head_dim = q.shape
    last = length + depth  # each row's own position; padding rows: length - 1
    # A tile of padding rows only (a one-token step's rows padded to a 64-row projection
    # tile) reads nothing and returns zeros; a tile with a real row runs every block.
    real = jnp.max(depth) >= 0
    end = jnp.where(real, length + jnp.max(depth) + 1, 0)
    offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def committed(block, carry):
        start = pl.multiple_of(block * block_kv, block_kv)
        positions = start + offsets
        keys, values = cache_block(start, positions < length)
        keys = jnp.broadcast_to(keys[None], (rows, block_kv, head_dim))
        values = jnp.broadcast_to(values[None], (rows, block_kv, head_dim))
        return _block_update(carry, q, keys, values, visible(positions), scale=scale,
                             softcap=softcap)

    def visible(positions):  # [rows, block_kv]: at or before the row, inside its window
        valid = positions[None, :] <= last[:, None]
        return valid if first is None else valid & (positions[None, :] >= first[:, None])

    def boundary(block, carry):
        start = pl.multiple_of(block * block_kv, block_kv)
        positions = start + offsets
        in_cache = positions < length
        keys, values = cache_block(start, in_cache)
        chain_keys, chain_values = chain_block(start, in_cache)
        keys = jnp.where(in_cache[None, :, None], keys[None], chain_keys.astype(jnp.float32))
        values = jnp.where(in_cache[None, :, None], values[None],
                           chain_values.astype(jnp.float32))
        return _block_update(carry, q, keys, values, visible(positions), scale=scale,
                             softcap=softcap)

    init = (jnp.full((rows,), layout.MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    # Blocks wholly before `length` read only the cache; the rest (at most the chain's
    # length in blocks, plus one) also read the chains. Both updates are _block_update on
    # identical values, so which loop a block falls in does not change its arithmetic.
    first_boundary = jnp.where(real, length // block_kv, 0)
    carry = lax.fori_loop(0, first_boundary, committed, init)
    carry = lax.fori_loop(first_boundary, pl.cdiv(end, block_kv), boundary, carry)
    _, l, acc = carry
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


def _cache_loader(k_ref, v_ref, layer, kv_head, block_kv: int, width: int):
    """``cache_block`` of :func:`_ordered_rows` over stacked caches [L, S, K, D]: blocks
    [block_kv, width] (the D columns, zeros past them; see :func:`_columns`)."""
    head_dim = k_ref.shape[-1]
    columns = slice(None) if head_dim == width else pl.ds(0, width)
    in_cache = _column_mask(head_dim, width)

    def cache_block(start, valid_slots):
        window = (layer, pl.ds(start, block_kv), kv_head, columns)
        mask = jnp.broadcast_to(valid_slots[:, None], (block_kv, width))
        if in_cache is not None:
            mask = mask & in_cache[None, :]
        keys = plgpu.load(k_ref.at[window], mask=mask, other=0).astype(jnp.float32)
        values = plgpu.load(v_ref.at[window], mask=mask, other=0).astype(jnp.float32)
        return keys, values
    return cache_block


def _ordered_kernel(length_ref, layer_ref, q_ref, depth_ref, first_ref, k_ref, v_ref,
                    chain_ref, o_ref, *, group: int, num_kv_heads: int, block_rows: int,
                    block_kv: int, scale: float, softcap: float | None):
    """One (query head, row tile) program.

    Refs: length_ref, layer_ref int32 [1]; q_ref [block_rows, Dp] (one head's rows,
    one node each, zero-padded to the tile width Dp); depth_ref int32 [block_rows] (-1 for
    padding rows); k_ref, v_ref the whole cache [L, S, K, D]; chain_ref the whole per-node
    chains, keys then values along the head axis, [rows, block_kv + C + block_kv, 2K, Dp]
    (chain slot ``block_kv + j`` = depth j, zeros around); output o_ref [block_rows, Dp].
    """
    head, tile = pl.program_id(0), pl.program_id(1)
    kv_head = head // group
    length, layer = length_ref[0], layer_ref[0]
    q = q_ref[...].astype(jnp.float32)
    rows, head_dim = q.shape
    row0 = tile * block_rows

    def chain_block(start, in_cache):
        # Chain slots for positions >= length: slot block_kv + (position - length) >= 1.
        chain_start = start - length + block_kv
        chain_valid = jnp.broadcast_to((~in_cache)[None, :, None], (rows, block_kv, head_dim))
        window = (pl.ds(row0, block_rows), pl.ds(chain_start, block_kv))
        keys = plgpu.load(chain_ref.at[(*window, kv_head, slice(None))], mask=chain_valid,
                          other=0)
        values = plgpu.load(chain_ref.at[(*window, num_kv_heads + kv_head, slice(None))],
                            mask=chain_valid, other=0)
        return keys, values

    out = _ordered_rows(q, depth_ref[...], length,
                        _cache_loader(k_ref, v_ref, layer, kv_head, block_kv, head_dim),
                        chain_block, block_kv=block_kv, scale=scale, softcap=softcap,
                        first=first_ref[...])
    o_ref[...] = out.astype(o_ref.dtype)


def _packed_kernel(length_ref, layer_ref, depth_ref, first_ref, links_ref, packed_ref, k_ref,
                   v_ref, o_ref, *, num_heads: int, group: int, num_kv_heads: int,
                   block_rows: int, block_kv: int, chain_pad: int, width: int, scale: float,
                   softcap: float | None):
    """One (query head, row tile) program of :func:`ordered_attention_packed_gpu`.

    Refs: length_ref, layer_ref int32 [1]; depth_ref int32 [block_rows]; links_ref the
    whole int32 [R, P + W + P] (P = ``chain_pad``; slot ``P + j``: the row's ancestor at
    depth j, a row index of ``packed``); packed_ref the whole [L, R, H + 2K, D]; k_ref,
    v_ref the whole cache [L, S, K, D]; output o_ref the whole [R, H*D], of which the
    program writes the head's D columns of its rows. Tiles are ``width`` (Dp >= D)
    columns wide, loaded and stored masked past D (:func:`_columns`).
    """
    head, tile = pl.program_id(0), pl.program_id(1)
    kv_head = head // group
    length, layer = length_ref[0], layer_ref[0]
    row0 = tile * block_rows
    head_dim = packed_ref.shape[-1]
    in_head = _column_mask(head_dim, width)
    columns = slice(None) if in_head is None else pl.ds(0, width)
    q_mask = None if in_head is None else jnp.broadcast_to(in_head[None, :],
                                                           (block_rows, width))
    q = packed_ref.at[layer, pl.ds(row0, block_rows), head, columns]
    q = plgpu.load(q) if q_mask is None else plgpu.load(q, mask=q_mask, other=0)
    q = q.astype(jnp.float32)
    rows = q.shape[0]
    depth = depth_ref[...]
    column_index = lax.broadcasted_iota(jnp.int32, (1, 1, width), 2)
    offsets = jnp.arange(block_kv, dtype=jnp.int32)

    def chain_block(start, in_cache):
        slots = start - length + offsets  # each position's depth below the cache
        links = plgpu.load(links_ref.at[pl.ds(row0, block_rows),
                                        pl.ds(start - length + chain_pad, block_kv)])
        valid = (~in_cache)[None, :] & (slots[None, :] <= depth[:, None])
        valid = valid[:, :, None]
        if in_head is not None:
            valid = valid & in_head[None, None, :]
        valid = jnp.broadcast_to(valid, (rows, block_kv, width))
        # A gather: row r's slot j reads packed row links[r, j] (all-integer indexing).
        source = links[:, :, None]
        keys = plgpu.load(packed_ref.at[layer, source, num_heads + kv_head, column_index],
                          mask=valid, other=0)
        values = plgpu.load(
            packed_ref.at[layer, source, num_heads + num_kv_heads + kv_head, column_index],
            mask=valid, other=0)
        return keys, values

    out = _ordered_rows(q, depth, length,
                        _cache_loader(k_ref, v_ref, layer, kv_head, block_kv, width),
                        chain_block, block_kv=block_kv, scale=scale, softcap=softcap,
                        first=first_ref[...])
    # The head's columns of the row-major output: a [block_rows, Dp] store, masked past D
    # (the next head's columns) when the tile is wider than the head.
    window = (pl.ds(row0, block_rows),
              pl.ds(pl.multiple_of(head * head_dim, 16), width))
    plgpu.store(o_ref.at[window], out.astype(o_ref.dtype), mask=q_mask)


def check_call(kernel_name: str, q, k_new, v_new, k_cache, v_cache, mask, scratch_mask, *,
               head_dims, dtypes):
    """The one-line checks both position-ordered kernels (GPU, TPU) make: the inputs'
    shapes and dtypes, and no scratch window. Returns the one-layer view of ``k_cache``."""
    k_cache, v_cache = layout.one_layer_caches(k_cache, v_cache, kernel_name)
    layout.check_inputs(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                        head_dims=head_dims, dtypes=dtypes, kernel=kernel_name)
    if scratch_mask is not None and scratch_mask.shape[1] > 0:
        raise InvalidArgumentError(
            f"{kernel_name}: no scratch window (drafting calls use the split kernel)")
    return k_cache


def check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask=None, *,
                    block_sizes: GpuOrderedBlockSizes = GpuOrderedBlockSizes(),
                    softcap=None, first_visible=None) -> int:
    """Raises :class:`InvalidArgumentError` (one line) unless the kernel takes the call
    (``softcap`` a positive number or ``None``, ``first_visible`` int32 [T] or ``None``);
    returns its ``block_kv`` (:meth:`GpuOrderedBlockSizes.resolve`)."""
    k_cache = check_call(KERNEL_NAME, q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                         head_dims=HEAD_DIMS, dtypes=DTYPES)
    layout.check_windows(q.shape[0], softcap, first_visible, KERNEL_NAME)
    block_sizes.check()
    block_kv = block_sizes.resolve(q.shape[-1])
    if k_cache is not None and k_cache.shape[0] % block_kv:
        # The block holding `length` is read whole from the cache.
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: cache capacity {k_cache.shape[0]} is not a multiple of "
            f"block_kv={block_kv}")
    return block_kv


def _score_scale(scale: float | None, head_dim: int) -> float:
    """The kernels' score scale: ``scale``, else ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "scale", "softcap"))
def ordered_attention_gpu(q, k_new, v_new, k_cache, v_cache, length, mask, scratch_mask=None,
                          *, layer=None,
                          block_sizes: GpuOrderedBlockSizes = GpuOrderedBlockSizes(),
                          interpret: bool = False, scale: float | None = None,
                          softcap: float | None = None, first_visible=None):
    """Attention with a position-ordered reduction; same semantics as
    :func:`specjax.attention.attention_reference` for calls whose rows see chains of new
    tokens (prefill, decode, tree verification); see the module docstring.

    Args:
      q: [T, H, D]; k_new, v_new: [T, K, D]; k_cache, v_cache: [S, K, D], [L, S, K, D]
        (with ``layer``) or ``None``; length: int32 []; mask: bool [T, T] (ancestors and
        self); scratch_mask: ``None`` or an empty [T, 0].
      layer: int32 [] layer of stacked caches.
      block_sizes: static :class:`GpuOrderedBlockSizes`.
      interpret: Pallas' interpreter instead of a GPU compile.
      scale: static score scale (``None``: ``D ** -0.5``), applied to each score in the
        kernel (Granite's and Gemma's query scale).
      softcap: static soft-cap of the scores (Gemma 2), or ``None``.
      first_visible: int32 [T], each query's first visible position (a sliding window,
        as :func:`specjax.attention.attention` takes it), or ``None``. ``mask`` must then
        be the chains' mask without the window (the window masks by position here).
    Returns:
      [T, H, D] in q's dtype.
    """
    block_kv = check_supported(q, k_new, v_new, k_cache, v_cache, mask, scratch_mask,
                               block_sizes=block_sizes, softcap=softcap,
                               first_visible=first_visible)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    width = layout.next_power_of_2(head_dim)  # the tiles' columns (see _columns)
    if k_cache is None:  # no prefix: a zero-length cache of one block
        k_cache = v_cache = jnp.zeros((1, block_kv, num_kv_heads, head_dim), k_new.dtype)
        length, layer = 0, 0
    elif layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    rows = layout.round_up(num_tokens, block_sizes.block_rows)
    # Per-node chains [rows, block_kv + T' + block_kv, 2K, Dp], T' = T rounded up to the
    # pad; slot block_kv + j holds the node's ancestor at depth j. The zero blocks on both
    # sides keep every block the kernel loads inside the array.
    links, depth = packed_links(mask, rows, block_sizes)
    pad = block_sizes.chain_pad
    index = links[:, pad:-pad]
    in_chain = jnp.arange(index.shape[1])[None, :] <= depth[:, None]

    # Keys and values gathered together (values after the keys' heads): one gather, one
    # kernel launch on a GPU, instead of two.
    new = _columns(jnp.concatenate([k_new, v_new], axis=1), width)
    gathered = jnp.where(in_chain[..., None, None], jnp.take(new, index, axis=0), 0)
    chain = jnp.pad(gathered, ((0, 0), (block_kv,) * 2, (0, 0), (0, 0)))
    queries = jnp.pad(_columns(q, width).transpose(1, 0, 2),
                      ((0, 0), (0, rows - num_tokens), (0, 0)))
    first = _first_rows(first_visible, rows)
    # Two one-element arrays (a reshape each, no kernel), not one stacked pair: stacking
    # the loop's layer counter with the length is a kernel launch of its own per layer.
    length = jnp.asarray(length, jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    query_spec = pl.BlockSpec((None, block_sizes.block_rows, width), lambda h, i: (h, i, 0))
    out = pl.pallas_call(
        functools.partial(_ordered_kernel, group=num_heads // num_kv_heads,
                          num_kv_heads=num_kv_heads,
                          block_rows=block_sizes.block_rows, block_kv=block_kv,
                          scale=_score_scale(scale, head_dim), softcap=softcap),
        grid=(num_heads, rows // block_sizes.block_rows),
        in_specs=[pl.no_block_spec, pl.no_block_spec, query_spec,
                  pl.BlockSpec((block_sizes.block_rows,), lambda h, i: (i,)),
                  pl.BlockSpec((block_sizes.block_rows,), lambda h, i: (i,)),
                  pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
        out_specs=query_spec,
        out_shape=jax.ShapeDtypeStruct((num_heads, rows, width), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="ordered_attention_gpu",
    )(length, layer, queries, depth, first, k_cache, v_cache, chain)
    return out[:, :num_tokens, :head_dim].transpose(1, 0, 2)


def _first_rows(first_visible, rows: int) -> jax.Array:
    """int32 [rows]: ``first_visible`` [T] padded to ``rows`` (no window: the lowest int32,
    every position visible)."""
    lowest = jnp.iinfo(jnp.int32).min
    if first_visible is None:
        return jnp.full((rows,), lowest, jnp.int32)
    first = jnp.asarray(first_visible, jnp.int32).reshape(-1)
    return jnp.pad(first, (0, rows - first.shape[0]), constant_values=lowest)


# ----------------------------------------------------------------------------- packed rows
#
# The same attention, reading a layer's queries, keys and values where the layer loop put
# them and writing what the output projection reads: one launch where the call above needs
# three more around it on a GPU (RoPE and transpose of q, the chains' gather, the output's
# transpose and pad).


def packed_links(mask: jax.Array, rows: int,
                 block_sizes: GpuOrderedBlockSizes = GpuOrderedBlockSizes()):
    """(links int32 [rows, P + W + P], depth int32 [rows]) for
    :func:`ordered_attention_packed_gpu`, from the visibility mask [T, T] among the new
    tokens (P = ``block_sizes.chain_pad``, W = T rounded up to P; rows past T have depth
    -1). Slot ``P + j`` of a row holds its ancestor at depth j (0, a valid row, elsewhere).
    Depends on the mask only (not on the head size): compute it once per pass, outside the
    layer loop."""
    num_tokens = mask.shape[0]
    chain, depth = ancestor_chains(mask)
    pad = block_sizes.chain_pad
    width = layout.round_up(num_tokens, pad)
    links = jnp.pad(chain, ((0, rows - num_tokens), (pad, width - num_tokens + pad)))
    return links, jnp.pad(depth, (0, rows - num_tokens), constant_values=-1)


def check_packed(packed, k_cache, v_cache, *, num_heads: int,
                 block_sizes: GpuOrderedBlockSizes = GpuOrderedBlockSizes()) -> int:
    """Raises :class:`InvalidArgumentError` (one line) unless
    :func:`ordered_attention_packed_gpu` takes these shapes and dtypes; returns its
    ``block_kv``."""
    block_sizes.check()
    if packed.ndim != 4:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: packed rows must be [L, R, H + 2K, D], got shape {packed.shape}")
    _, rows, heads, head_dim = packed.shape
    num_kv_heads, odd = divmod(heads - num_heads, 2)
    if num_heads <= 0 or odd or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {heads} packed heads are not {num_heads} query heads plus a "
            f"whole number of key and value heads dividing them")
    if head_dim not in HEAD_DIMS:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: head_dim {head_dim} not supported (expected a multiple of 16 "
            f"up to 256)")
    if jnp.dtype(packed.dtype) not in DTYPES:
        raise InvalidArgumentError(f"{KERNEL_NAME}: dtype {packed.dtype} not supported")
    if rows % block_sizes.block_rows:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: {rows} packed rows are not a multiple of "
            f"block_rows={block_sizes.block_rows}")
    block_kv = block_sizes.resolve(head_dim)
    if k_cache is None:
        return block_kv
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: caches must be [L, S, K, D] of one shape, got {k_cache.shape} "
            f"and {v_cache.shape}")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or k_cache.dtype != packed.dtype:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: cache {k_cache.shape} {k_cache.dtype} does not match "
            f"{num_kv_heads} KV heads of {head_dim} {packed.dtype}")
    if k_cache.shape[1] % block_kv:
        raise InvalidArgumentError(
            f"{KERNEL_NAME}: cache capacity {k_cache.shape[1]} is not a multiple of "
            f"block_kv={block_kv}")
    return block_kv


@functools.partial(jax.jit, static_argnames=("num_heads", "block_sizes", "interpret",
                                             "scale", "softcap"))
def ordered_attention_packed_gpu(packed, layer, k_cache, v_cache, length, links, depth, *,
                                 num_heads: int,
                                 block_sizes: GpuOrderedBlockSizes = GpuOrderedBlockSizes(),
                                 interpret: bool = False, scale: float | None = None,
                                 softcap: float | None = None, first_visible=None):
    """:func:`ordered_attention_gpu` on a layer loop's packed rows: same arithmetic, same
    result bit for bit, but reading and writing the layouts around it.

    Args:
      packed: [L, R, H + 2K, D]: row r of layer l holds token r's query heads (RoPE
        applied), then its key heads (RoPE applied), then its value heads; R a multiple of
        ``block_rows``, rows past the T tokens are padding.
      layer: int32 [] the layer to read.
      k_cache, v_cache: [L, S, K, D] committed caches, or ``None`` (no prefix).
      length: int32 [] committed slots.
      links, depth: :func:`packed_links` of the mask among the T new tokens.
      num_heads: H (static).
      block_sizes: static :class:`GpuOrderedBlockSizes`.
      interpret: Pallas' interpreter instead of a GPU compile.
      scale, softcap: as :func:`ordered_attention_gpu`.
      first_visible: int32 [T] or [R] (padded here), as :func:`ordered_attention_gpu`.
    Returns:
      [R, H*D] in ``packed``'s dtype, row-major as an output projection reads it; padding
      rows are finite (they attend to the cache; zero in a tile of padding rows only).
    """
    block_kv = check_packed(packed, k_cache, v_cache, num_heads=num_heads,
                            block_sizes=block_sizes)
    _, rows, heads, head_dim = packed.shape
    num_kv_heads = (heads - num_heads) // 2
    if k_cache is None:  # no prefix: a zero-length cache of one block
        k_cache = v_cache = jnp.zeros((1, block_kv, num_kv_heads, head_dim), packed.dtype)
        length = 0
    length = jnp.asarray(length, jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return pl.pallas_call(
        functools.partial(_packed_kernel, num_heads=num_heads,
                          group=num_heads // num_kv_heads, num_kv_heads=num_kv_heads,
                          block_rows=block_sizes.block_rows, block_kv=block_kv,
                          chain_pad=block_sizes.chain_pad,
                          width=layout.next_power_of_2(head_dim),
                          scale=_score_scale(scale, head_dim), softcap=softcap),
        grid=(num_heads, rows // block_sizes.block_rows),
        in_specs=[pl.no_block_spec, pl.no_block_spec,
                  pl.BlockSpec((block_sizes.block_rows,), lambda h, i: (i,)),
                  pl.BlockSpec((block_sizes.block_rows,), lambda h, i: (i,)),
                  pl.no_block_spec, pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,  # each program stores its head's columns (masked)
        out_shape=jax.ShapeDtypeStruct((rows, num_heads * head_dim), packed.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="ordered_attention_packed_gpu",
    )(length, layer, depth, _first_rows(first_visible, rows), links, packed, k_cache, v_cache)
