"""Applies a family's key rules strictly: HF tensor names to specjax parameters and back.

Each family module of :mod:`specjax.families` gives its checkpoints' rule table (its
``key_rules``, :class:`~specjax.families.rules.Rule`): for each HF tensor name pattern, the
specjax leaf (or leaves) it fills and the transform that gets it there. Per-layer tensors
carry ``{i}`` in the pattern and fill row ``i`` of a stacked ``[L, ...]`` leaf; a mixture of
experts' tensors carry ``{e}`` too and fill row ``[i, e]`` of an ``[L, E, ...]`` leaf.

:func:`params_from_hf_tensors` fails with a :class:`CheckpointError` naming the tensor on
any unmapped, duplicated, missing or mis-shaped tensor. :func:`hf_tensors_from_params` is
the inverse (used to export a draft as an HF directory).
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.families import family_of
from specjax.families.rules import Rule
from specjax.models import param_shapes


def rules_for(config: ModelConfig) -> list[Rule]:
    """The key rules of ``config``'s family."""
    return family_of(config).key_rules(config)


# Tensors some checkpoints carry that hold no parameters (buffers) or duplicate a tied one.
def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")):
        return True
    ignores = family_of(config).ignores
    if ignores is not None and ignores(name, config):
        return True  # the family's own (buffers, another model's tower)
    return config.tie_word_embeddings and name == "lm_head.weight"


def _normalise_name(name: str, config: ModelConfig) -> str:
    """A stored tensor name as the family's key rules give it."""
    rename = family_of(config).checkpoint_name
    return name if rename is None else rename(name, config)


def _compile(rules: list[Rule]):
    compiled = []
    for rule in rules:
        pattern = "^" + re.escape(rule.hf_name).replace(re.escape("{i}"), r"(\d+)").replace(
            re.escape("{e}"), r"(\d+)") + "$"
        compiled.append((re.compile(pattern), rule))
    return compiled


def _leaf_shape(shapes: dict, leaf: str) -> tuple[int, ...]:
    node = shapes
    for part in leaf.split("/"):
        node = node[part]
    return node


def params_from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray],
                           source: str = "checkpoint", dtype=None) -> dict:
    """Builds the specjax parameter tree from HF-named tensors.

    Args:
      config: the model config the tensors must match.
      tensors: HF tensor name -> array (numpy or anything ``np.asarray`` accepts).
      source: a name for error messages (file or directory).
      dtype: cast every parameter to this dtype; ``None`` keeps the stored dtype.
    Raises:
      CheckpointError: naming the first unmapped, duplicated, missing or mis-shaped tensor.
    """
    shapes = param_shapes(config)
    compiled = _compile(rules_for(config))
    # leaf -> {layer: row} ({(layer, expert): row} for experts); nothing is sized by
    # num_layers before the tensors are seen, so a config claiming millions of layers costs
    # nothing until it is rejected.
    stacked: dict[str, dict] = {}
    flat: dict[str, np.ndarray] = {}
    seen: dict[str, str] = {}
    for raw_name, value in tensors.items():
        name = _normalise_name(raw_name, config)
        if _ignorable(name, config):
            continue
        for pattern, rule in compiled:
            match = pattern.match(name)
            if match:
                break
        else:
            raise CheckpointError(f"{source}: unmapped tensor {raw_name!r}")
        if name in seen:
            raise CheckpointError(f"{source}: duplicated tensor {raw_name!r} (also {seen[name]!r})")
        seen[name] = raw_name
        layer = int(match.group(1)) if match.groups() else None
        expert = int(match.group(2)) if len(match.groups()) > 1 else None
        if layer is not None and layer >= config.num_layers:
            raise CheckpointError(
                f"{source}: tensor {raw_name!r} names layer {layer} but the config has "
                f"{config.num_layers} layers")
        if expert is not None and expert >= config.num_experts:
            raise CheckpointError(
                f"{source}: tensor {raw_name!r} names expert {expert} but the config has "
                f"{config.num_experts} experts")
        parts = rule.to_ours(np.asarray(value))
        for leaf, part in zip(rule.leaves, parts):
            expected = _leaf_shape(shapes, leaf)
            expected = expected[(layer is not None) + (expert is not None):]
            if tuple(part.shape) != tuple(expected):
                raise CheckpointError(
                    f"{source}: tensor {raw_name!r} has shape {tuple(np.shape(value))}, which "
                    f"does not fit {leaf} {tuple(expected)}")
            if layer is None:
                flat[leaf] = part
            else:
                stacked.setdefault(leaf, {})[layer if expert is None else (layer, expert)] = part
    leaf_rules = {leaf: rule for _, rule in compiled for leaf in rule.leaves}
    for leaf, rule in leaf_rules.items():
        if "{e}" in rule.hf_name:
            rows = stacked.get(leaf, {})
            for i in range(config.num_layers):
                for e in range(config.num_experts):
                    if (i, e) not in rows:
                        raise CheckpointError(
                            f"{source}: missing tensor {rule.hf_name.format(i=i, e=e)!r}")
            stacked[leaf] = {i: np.stack([rows[(i, e)] for e in range(config.num_experts)])
                             for i in range(config.num_layers)}
        elif "{i}" in rule.hf_name:
            rows = stacked.get(leaf, {})
            if len(rows) < config.num_layers:  # the first missing layer is <= len(rows)
                missing = min(set(range(len(rows) + 1)) - set(rows))
                raise CheckpointError(
                    f"{source}: missing tensor {rule.hf_name.format(i=missing)!r}")
        elif leaf not in flat:
            raise CheckpointError(f"{source}: missing tensor {rule.hf_name!r}")
    params: dict = {"layers": {}}
    for leaf, value in flat.items():
        params[leaf] = value
    for leaf, rows in stacked.items():
        params["layers"][leaf.split("/", 1)[1]] = np.stack([rows[i] for i in range(len(rows))])
    if dtype is not None:
        params = {k: ({kk: vv.astype(dtype) for kk, vv in v.items()} if isinstance(v, dict)
                      else v.astype(dtype)) for k, v in params.items()}
    return params


def hf_tensors_from_params(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf_tensors`: HF tensor name -> numpy array."""
    out: dict[str, np.ndarray] = {}

    def get(leaf):
        node = params
        for part in leaf.split("/"):
            node = node[part]
        return np.asarray(node)

    for rule in rules_for(config):
        values = [get(leaf) for leaf in rule.leaves]
        if "{e}" in rule.hf_name:
            for i in range(config.num_layers):
                for e in range(config.num_experts):
                    out[rule.hf_name.format(i=i, e=e)] = np.ascontiguousarray(
                        rule.to_hf(*[v[i][e] for v in values]))
        elif "{i}" in rule.hf_name:
            for i in range(config.num_layers):
                out[rule.hf_name.format(i=i)] = np.ascontiguousarray(rule.to_hf(*[v[i] for v in values]))
        else:
            out[rule.hf_name] = np.ascontiguousarray(rule.to_hf(*values))
    prefix = family_of(config).export_prefix
    if prefix:
        out = {prefix + k: v for k, v in out.items()}
    return out
