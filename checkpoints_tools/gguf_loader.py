"""GGUF files (llama.cpp): model config and dequantized weights, without torch.

A GGUF file carries three things. :mod:`~specjax.checkpoints_tools.gguf_reader` parses the
file, checking every count, length and offset against the file's size first;
:mod:`~specjax.checkpoints_tools.gguf_tokenizer` rebuilds its tokenizer (``tokenizer.ggml.*``
fields) with the ``tokenizers`` library. This module reads the rest, through the family
that registers the file's architecture (the ``gguf`` of each module of
:mod:`specjax.families`, :class:`~specjax.families.common.GGUFArchitecture`):

- metadata ``{arch}.*`` that the family reads into a :class:`~specjax.config.ModelConfig`
  (:func:`config_from_gguf`, through :class:`GGUFMetadata`);
- tensors named ``token_embd``, ``blk.N.attn_q`` ... that are dequantized to float32,
  renamed to their Hugging Face names by the architecture's table (and its transform, where
  llama.cpp stores a tensor otherwise) and handed to the strict
  :func:`~specjax.checkpoints_tools.keymap.params_from_hf_tensors`, so an unmapped, missing
  or mis-shaped tensor is rejected exactly as for an HF checkpoint, its GGUF name shown.

llama.cpp's converter permutes the rows of Q and K (weights and biases) of some
architectures (``permuted``) so that its RoPE can rotate adjacent pairs; HF models rotate
the two halves of a head. :func:`unpermute_rope_rows` undoes that. RoPE scaling factors
travel as tensors (:data:`ROPE_FACTOR_TENSORS`), read into the config rather than the
parameters.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from specjax import progress as progress_lib
from specjax.checkpoints_tools import keymap
from specjax.checkpoints_tools.gguf_reader import (GGUFFile, dequantize_tensor, metadata_value,
                                                   read_gguf)
from specjax.checkpoints_tools.gguf_tokenizer import tokenizer_from_gguf
from specjax.checkpoints_tools.hf import as_numpy_dtype
from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.families import FAMILIES, family_of
from specjax.families.rules import pairs_to_halves

# Every GGUF architecture a family registers, by name.
_ARCHITECTURES = {arch.name: arch for family in FAMILIES for arch in family.gguf}


def _name_patterns(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)") + "$"), dst)
            for src, dst in table.items()]


_TO_HF = {name: _name_patterns(arch.tensor_names) for name, arch in _ARCHITECTURES.items()}
_TO_GGUF = {name: _name_patterns({hf: gguf for gguf, hf in arch.tensor_names.items()})
            for name, arch in _ARCHITECTURES.items()}


def _rename(name: str, patterns) -> str | None:
    for pattern, target in patterns:
        match = pattern.match(name)
        if match:
            return target.format(i=match.group(1)) if match.groups() else target
    return None


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF tensor name of a GGUF tensor name (of architecture ``arch``), or ``None``
    when it has none."""
    return _rename(gguf_name, _TO_HF.get(arch, ()))


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation.

    llama.cpp stores, within each head, the rows in the order (0, D/2, 1, D/2+1, ...),
    i.e. it viewed the head's rows as [2, D/2] and transposed them to [D/2, 2]. We view them
    as [D/2, 2] and transpose back: :func:`~specjax.families.rules.pairs_to_halves`, the
    reordering Cohere's checkpoints (RoPE on adjacent pairs) need too.

    Args:
      rows: [num_heads * D, ...] weight ([out, in]) or bias ([out]).
      num_heads: heads the rows belong to (query heads for Q, KV heads for K).
    Returns:
      array of the same shape in HF order.
    """
    return pairs_to_halves(rows, num_heads)


def _special_token_ids(reader: GGUFFile, source: str) -> tuple[list[int], int | None]:
    """(end ids: ``eos_token_id`` then ``eot_token_id``, without repeats; ``bos_token_id``
    or ``None``) of a file's tokenizer metadata."""
    def token_id(key):
        return metadata_value(reader, f"tokenizer.ggml.{key}", source=source, kind=int)

    ends = (token_id("eos_token_id"), token_id("eot_token_id"))
    return list(dict.fromkeys(t for t in ends if t is not None)), token_id("bos_token_id")


# Tensors that carry RoPE scaling factors (read into the config, not parameters).
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight",
                       "rope_factors_short.weight")


def _rope_factor_tensor(reader: GGUFFile, name: str, source: str) -> list[float] | None:
    """A 1-D RoPE factor tensor of the file as floats (positive, finite), or ``None``."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    array = dequantize_tensor(tensor, source)
    if (array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array))
            or not np.all(array > 0)):
        raise CheckpointError(f"{source}: tensor {name!r} must be 1-D positive finite RoPE "
                              f"factors, got shape {array.shape}")
    return [float(f) for f in array]


class GGUFMetadata:
    """What a family module reads of a GGUF file to build its config (the ``config`` of a
    :class:`~specjax.families.common.GGUFArchitecture`), each value checked as it is read.

    Attributes:
      arch: the file's ``general.architecture``.
      source: the file's name, for error messages.
      names: the names of its tensors.
    """

    def __init__(self, reader: GGUFFile, arch: str, source: str):
        self.reader, self.arch, self.source = reader, arch, source
        self.names = {tensor.name for tensor in reader.tensors}

    def meta(self, key: str, default=None, kind: type = int):
        """The value of ``{arch}.{key}`` (required when ``default`` is ``None``); an int is
        checked to be >= 0."""
        value = metadata_value(self.reader, f"{self.arch}.{key}", default,
                               required=default is None, source=self.source, kind=kind)
        if kind is int and value is not None and value < 0:
            raise CheckpointError(f"{self.source}: GGUF metadata '{self.arch}.{key}' is "
                                  f"negative ({value})")
        return value

    def field(self, key: str, default=None, kind: type | None = None):
        """The value of the metadata key ``key`` (not prefixed), or ``default``."""
        return metadata_value(self.reader, key, default, source=self.source, kind=kind)

    def special_token_ids(self) -> tuple[list[int], int | None]:
        """See :func:`_special_token_ids`."""
        return _special_token_ids(self.reader, self.source)

    def rope_factors(self, name: str) -> list[float] | None:
        """The RoPE factor tensor ``name`` (:data:`ROPE_FACTOR_TENSORS`) as floats, or
        ``None``."""
        return _rope_factor_tensor(self.reader, name, self.source)


def config_from_gguf(reader: GGUFFile, source: str = "gguf") -> ModelConfig:
    """Builds the :class:`ModelConfig` described by a GGUF file's metadata (its
    architecture's family reads it, see :class:`GGUFMetadata`).

    Raises:
      CheckpointError: the architecture is not supported, or a needed key is missing, of
        the wrong type or out of range.
    """
    arch = metadata_value(reader, "general.architecture", required=True, source=source,
                          kind=str)
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{sorted(_ARCHITECTURES)}")
    return _ARCHITECTURES[arch].config(GGUFMetadata(reader, arch, source))


def _gguf_names_in_message(message: str, arch: str | None = None) -> str:
    # keymap names tensors by their HF names; show the GGUF name the user can find too.
    def swap(match):
        gguf = _rename(match.group(1), _TO_GGUF.get(arch, ()))
        return f"'{gguf}' ({match.group(1)})" if gguf else match.group(0)

    return re.sub(r"'((?:model\.|lm_head\.|gpt_neox\.|embed_out\.)[^']*)'", swap, message)


def params_from_gguf(reader: GGUFFile, config: ModelConfig, source: str = "gguf", dtype=None,
                     progress: bool = False) -> dict:
    """Dequantized parameter tree (numpy) of a GGUF file; see the module docstring."""
    arch = metadata_value(reader, "general.architecture")
    entry = _ARCHITECTURES.get(arch)
    permuted = entry is not None and entry.permuted
    transform = entry.transform if entry is not None else None
    family_tensors = family_of(config).gguf_tensors
    tensors: dict[str, np.ndarray] = {}
    items = reader.tensors
    if progress:  # a bar on a terminal only
        items = progress_lib.terminal_bar(items, desc="dequantizing GGUF tensors",
                                          unit="tensor", leave=False)
    for tensor in items:
        if tensor.name in ROPE_FACTOR_TENSORS:
            continue  # read into the config (config_from_gguf)
        array = dequantize_tensor(tensor, source)
        renamed = (family_tensors(tensor.name, array, config) if family_tensors is not None
                   else None)
        if renamed is not None:  # stacked experts: one HF tensor each
            tensors.update(renamed)
            continue
        name = hf_name(tensor.name, arch)
        if transform is not None:  # stored otherwise than the HF checkpoint holds it
            array = transform(tensor.name, array, config)
        heads = (config.num_heads if ".self_attn.q_proj." in (name or "") else
                 config.num_kv_heads if ".self_attn.k_proj." in (name or "") else None)
        if name is None:
            name = tensor.name  # keymap reports it as unmapped
        elif permuted and heads and array.shape[0] == heads * config.head_dim:
            array = unpermute_rope_rows(array, heads)  # other shapes: keymap names them
        tensors[name] = array
    try:
        return keymap.params_from_hf_tensors(config, tensors, source=source,
                                             dtype=as_numpy_dtype(dtype))
    except CheckpointError as error:
        raise CheckpointError(_gguf_names_in_message(str(error), arch)) from None


# ----------------------------------------------------------------------------- public


def load_gguf(path: str | os.PathLike, dtype=None, progress: bool = False
              ) -> tuple[ModelConfig, dict, Any]:
    """Loads a llama-family GGUF file.

    Args:
      path: the ``.gguf`` file.
      dtype: cast the dequantized (float32) parameters to this dtype; ``None`` keeps float32.
      progress: show a per-tensor progress bar while dequantizing.
    Returns:
      (config, params, tokenizer): params is the nested dict of numpy arrays described by
      :mod:`specjax.models`; tokenizer is a ``transformers.PreTrainedTokenizerFast``.
    Raises:
      ModelNotFoundError: no such file.
      CheckpointError: the file is truncated, corrupt or crafted (a count, length or offset
        the file cannot hold, see :func:`read_gguf`), its architecture, quantization or
        tokenizer is not supported, a metadata value has the wrong type, its chat template
        reaches for Python internals, or a tensor is unmapped, missing or mis-shaped.
    """
    source = str(path)
    reader = read_gguf(path)
    config = config_from_gguf(reader, source)
    tokenizer = tokenizer_from_gguf(reader, source, model_max_length=config.max_position_embeddings)
    params = params_from_gguf(reader, config, source, dtype=dtype, progress=progress)
    return config, params, tokenizer
