"""Key rules: how one Hugging Face tensor name fills specjax parameters, and the rule
builders the family modules share.

A family's rule table (its ``key_rules``) lists, for each HF tensor name pattern, the
specjax leaf (or leaves) it fills and the transform that gets it there (:func:`linear`:
transpose an HF ``[out, in]`` Linear weight to our ``[in, out]``). Per-layer tensors carry
``{i}`` in the pattern and fill row ``i`` of a stacked ``[L, ...]`` leaf; a mixture of
experts' tensors carry ``{e}`` too and fill row ``[i, e]`` of an ``[L, E, ...]`` leaf.
:mod:`specjax.checkpoints_tools.keymap` applies the table, strictly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from specjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor -> one or more specjax leaves.

    Attributes:
      hf_name: the HF tensor name; ``{i}`` stands for the layer index.
      leaves: specjax leaf paths ("layers/wq"); several when one HF tensor is split.
      to_ours: HF array -> tuple of arrays, one per leaf (per layer for layer leaves).
      to_hf: inverse of ``to_ours``.
    """

    hf_name: str
    leaves: tuple[str, ...]
    to_ours: Callable = lambda a: (a,)
    to_hf: Callable = lambda *a: a[0]


def linear(leaf: str, hf_name: str) -> Rule:
    """A Linear weight stored ``[out, in]`` by HF and ``[in, out]`` by us."""
    return Rule(hf_name, (leaf,), lambda a: (a.T,), lambda a: a.T)


def same(leaf: str, hf_name: str) -> Rule:
    """A tensor stored as the leaf holds it."""
    return Rule(hf_name, (leaf,))


def linear_split(leaves: tuple[str, ...], hf_name: str, widths: tuple[int, ...]) -> Rule:
    """A fused Linear weight ``[sum(widths), in]`` split into ``[in, width]`` leaves."""
    bounds = np.cumsum(widths)[:-1]
    return Rule(hf_name, leaves, lambda a: tuple(np.split(a.T, bounds, axis=-1)),
                lambda *parts: np.concatenate(parts, axis=-1).T)


def layer_norm_rules(*norms: tuple[str, str]) -> list[Rule]:
    """A LayerNorm's two rules per (leaf, HF module): ``.weight`` to the leaf, ``.bias`` to
    the leaf + ``_bias``."""
    return [rule for leaf, module in norms
            for rule in (same(leaf, module + ".weight"), same(leaf + "_bias", module + ".bias"))]


def per_head_qkv_rules(config: ModelConfig, module: str) -> tuple[Rule, Rule]:
    """The weight and bias rules of a Linear whose output rows interleave q, k and v per
    head, [H, 3 (q, k, v), D] (GPT-NeoX's ``query_key_value``, GPTBigCode's ``c_attn``
    without multi-query)."""
    heads, dim = config.num_heads, config.head_dim

    def split_weight(a):  # [H*3*D, d] -> three [d, H*D]
        a = a.reshape(heads, 3, dim, -1)
        return tuple(a[:, j].reshape(heads * dim, -1).T for j in range(3))

    def join_weight(*parts):
        return np.stack([part.T.reshape(heads, dim, -1) for part in parts], axis=1).reshape(
            heads * 3 * dim, -1)

    def split_bias(a):
        a = a.reshape(heads, 3, dim)
        return tuple(a[:, j].reshape(-1) for j in range(3))

    def join_bias(*parts):
        return np.stack([part.reshape(heads, dim) for part in parts], axis=1).reshape(-1)

    return (Rule(module + ".weight", ("layers/wq", "layers/wk", "layers/wv"), split_weight,
                 join_weight),
            Rule(module + ".bias", ("layers/bq", "layers/bk", "layers/bv"), split_bias,
                 join_bias))


def pairs_to_halves(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows [heads * D, ...] of q or k whose RoPE rotates adjacent pairs (2i, 2i + 1) of each
    head, reordered so that the pairs sit at (i, i + D/2), where this forward's RoPE rotates
    them; q and k reordered alike give the same scores."""
    dim = rows.shape[0] // heads
    return rows.reshape(heads, dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def halves_to_pairs(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`pairs_to_halves`."""
    dim = rows.shape[0] // heads
    return rows.reshape(heads, 2, dim // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
