"""GGUF files (llama.cpp): model config, dequantized weights and tokenizer, without torch.

A GGUF file carries three things. :func:`read_gguf` parses the file itself, checking every
count, length and offset against the file's size first (see "reading" below); the ``gguf``
package supplies the type tables and the dequantization:

- metadata ``{arch}.*`` (``llama``, ``qwen2``, ``mistral``, ``gptneox``, ``phi2``,
  ``starcoder2``, ``starcoder``, ``command-r``, ``cohere2``, and ``qwen3``, ``gemma``,
  ``gemma2``, ``gemma3``, ``phi3``, ``smollm3``, ``granite``, ``olmo2``, ``stablelm``,
  ``qwen2moe``, ``qwen3moe``, ``olmoe``:
  :data:`FAMILY_ARCHITECTURES`) that becomes a :class:`~specjax.config.ModelConfig`;
- tensors named ``token_embd``, ``blk.N.attn_q`` ... that are dequantized to float32
  (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, K-quants: whatever ``gguf.quants`` can undo),
  renamed to their Hugging Face names and handed to the strict
  :func:`~specjax.checkpoints_tools.keymap.params_from_hf_tensors`, so an unmapped, missing
  or mis-shaped tensor is rejected exactly as for an HF checkpoint;
- a tokenizer in ``tokenizer.ggml.*`` fields (byte-level BPE or SentencePiece BPE),
  rebuilt with the ``tokenizers`` library.

Two layout facts matter:

- GGUF lists a tensor's shape fastest-axis first (``[in, out]``), but the arrays read
  from it are numpy row-major ``[out, in]``: the HF ``nn.Linear`` layout.
- llama.cpp's converter permutes the rows of Q and K (weights and biases) of ``llama``
  models so that its RoPE can rotate adjacent pairs; HF models rotate the two halves of a
  head. :func:`unpermute_rope_rows` undoes that. ``qwen2`` files are stored unpermuted.

The families of :data:`FAMILY_ARCHITECTURES` add three more (as llama.cpp's converter
writes them): none is permuted but ``smollm3`` and ``granite`` (llama.cpp converts them as
Llama); Gemma's norm weights are stored plus one (llama.cpp scales
by ``w``, HF by ``1 + w``), which :func:`params_from_gguf` subtracts (exactly: the stored
value is the float32 ``1 + w`` that HF computes); Phi-3's fused ``attn_qkv`` and ``ffn_up``
(gate and up) are split by the key table as for its HF checkpoint. llama.cpp writes OLMo 3
as ``olmo2`` with a sliding window, a per-layer pattern and YaRN, read as Hugging Face's
``olmo3`` (the scaling on the global layers only). ``gptneox`` (Pythia) files have their
own names (:data:`_NEOX_TENSOR_NAMES`) and q|k|v stacked, which :func:`_neox_qkv_to_hf`
interleaves per head again as the HF checkpoint has it; they name no activation and are
read with Pythia's exact GELU (HF's ``gelu``; llama.cpp's graph computes the tanh form).

Mixtures of experts: llama.cpp writes Mixtral as ``llama`` with ``expert_count`` and
``expert_used_count`` (Q/K permuted), Qwen2-MoE as ``qwen2moe`` (its shared expert as
``ffn_*_shexp`` of ``expert_shared_feed_forward_length``, its gate ``ffn_gate_inp_shexp``),
Qwen3-MoE as ``qwen3moe`` (experts of ``expert_feed_forward_length``) and OLMoE as
``olmoe``; the router is
``blk.N.ffn_gate_inp`` and each layer's experts are stacked in one tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps``, ``ffn_down_exps``, [E, out, in]), which
:func:`params_from_gguf` splits into the checkpoints' one tensor per expert. Whether the
picked experts' probabilities are rescaled to sum 1 is fixed per architecture in
llama.cpp's graphs (Mixtral and Qwen3-MoE yes, Qwen2-MoE and OLMoE no) unless the file says
``expert_weights_norm``.

RoPE scaling factors travel as tensors (:data:`ROPE_FACTOR_TENSORS`), read into the config
rather than the parameters: ``rope_freqs.weight`` (llama.cpp divides frequency i by factor i;
how Llama 3.1/3.2 files store their Llama 3 scaling) becomes LongRoPE with one factor set,
and Phi-3's ``rope_factors_long``/``rope_factors_short`` with
``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor`` become its
LongRoPE; ``rope.dimension_count`` below the head size is Phi-3's partial rotary.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from specjax import progress as progress_lib
from specjax.checkpoints_tools import keymap
from specjax.checkpoints_tools.hf import (as_numpy_dtype, check_chat_template, one_line,
                                         quiet_transformers_import)
from specjax.config import ModelConfig
from specjax.families import from_hf_config
from specjax.rope_scaling import RopeScaling
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError

# GGUF architectures that run as specjax "llama", and whether their Q/K rows are permuted.
_ARCHITECTURES = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False,
                  "gemma": False, "gemma2": False, "gemma3": False, "phi3": False, "smollm3": True,
                  "granite": True, "olmo2": False, "gptneox": False, "stablelm": False,
                  "phi2": False, "starcoder2": False, "starcoder": False, "command-r": False,
                  "cohere2": False,
                  "qwen2moe": False, "qwen3moe": False, "olmoe": False}
# GGUF architecture -> the Hugging Face model_type of the families with optional features.
# (llama.cpp's smollm3 has no key for its NoPE layers: every fourth, hard-coded, as the
# Hugging Face config's default no_rope_layer_interval gives.)
FAMILY_ARCHITECTURES = {"qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                        "gemma3": "gemma3_text",
                        "phi3": "phi3", "smollm3": "smollm3", "granite": "granite",
                        "olmo2": "olmo2", "stablelm": "stablelm", "qwen2moe": "qwen2_moe",
                        "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# Mixtures of experts: whether llama.cpp's graph rescales the picked experts'
# probabilities to sum 1 when the file does not say (``{arch}.expert_weights_norm``).
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# A stacked experts tensor -> the projection of each expert in the HF checkpoints
# (Mixtral's names, the others').
_EXPERT_TENSORS = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
                   "ffn_down_exps": ("w2", "down_proj")}
# Qwen2-MoE's shared expert and its gate (one tensor each) -> their checkpoint names.
_SHARED_EXPERT_TENSORS = {"ffn_gate_shexp": "shared_expert.gate_proj",
                          "ffn_up_shexp": "shared_expert.up_proj",
                          "ffn_down_shexp": "shared_expert.down_proj",
                          "ffn_gate_inp_shexp": "shared_expert_gate"}
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# GGUF tensor name -> HF name; "{i}" is the block index.
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
}
for _gguf, _hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                   ("attn_output", "o_proj")):
    for _kind in ("weight", "bias"):
        _TENSOR_NAMES[f"blk.{{i}}.{_gguf}.{_kind}"] = f"model.layers.{{i}}.self_attn.{_hf}.{_kind}"


_QK_NORMS = {"blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
             "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
# Gemma's four norms per block: llama.cpp's ffn_norm is the MLP's input norm.
_GEMMA_NORMS = {
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Per architecture: names added to (or replacing) _TENSOR_NAMES.
_FAMILY_TENSOR_NAMES = {
    "qwen3": _QK_NORMS,
    "qwen3moe": _QK_NORMS,
    "olmoe": _QK_NORMS,
    "gemma2": _GEMMA_NORMS,
    "gemma3": {**_GEMMA_NORMS, **_QK_NORMS},
    "phi3": {"blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
             "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight"},
    # OLMo 2: only the attention's and MLP's output norms (no attn_norm, no ffn_norm).
    "olmo2": {**_QK_NORMS, **{k: v for k, v in _GEMMA_NORMS.items() if "ffn_norm" not in k}},
    # StableLM: Llama's names, and the LayerNorms' biases.
    "stablelm": {"output_norm.bias": "model.norm.bias",
                 "blk.{i}.attn_norm.bias": "model.layers.{i}.input_layernorm.bias",
                 "blk.{i}.ffn_norm.bias": "model.layers.{i}.post_attention_layernorm.bias"},
}


# GPT-NeoX (Pythia): its own names on both sides (llama.cpp's converter stores q|k|v
# stacked, [3 * H * D, d]; the HF checkpoint interleaves them per head, see
# _neox_qkv_to_hf).
_NEOX_TENSOR_NAMES = {
    "token_embd.weight": "gpt_neox.embed_in.weight",
    "output_norm.weight": "gpt_neox.final_layer_norm.weight",
    "output_norm.bias": "gpt_neox.final_layer_norm.bias",
    "output.weight": "embed_out.weight",
    **{f"blk.{{i}}.{gguf}.{kind}": f"gpt_neox.layers.{{i}}.{hf}.{kind}"
       for gguf, hf in (("attn_norm", "input_layernorm"),
                        ("attn_qkv", "attention.query_key_value"),
                        ("attn_output", "attention.dense"),
                        ("ffn_norm", "post_attention_layernorm"),
                        ("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h"))
       for kind in ("weight", "bias")},
}


def _name_patterns(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)") + "$"), dst)
            for src, dst in table.items()]


# Phi-2 (phi-1, 1.5 too): Llama's block names for its one norm, q, k, v and output; fc1 and
# fc2 as ffn_up and ffn_down; every projection, the norms and the head with biases.
_PHI2_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "model.final_layernorm"), ("output", "lm_head"),
        ("blk.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
        ("blk.{i}.attn_q", "model.layers.{i}.self_attn.q_proj"),
        ("blk.{i}.attn_k", "model.layers.{i}.self_attn.k_proj"),
        ("blk.{i}.attn_v", "model.layers.{i}.self_attn.v_proj"),
        ("blk.{i}.attn_output", "model.layers.{i}.self_attn.dense"),
        ("blk.{i}.ffn_up", "model.layers.{i}.mlp.fc1"),
        ("blk.{i}.ffn_down", "model.layers.{i}.mlp.fc2")) for kind in ("weight", "bias")},
}


# StarCoder2: Llama's names for the norms and attention, ffn_up/ffn_down for c_fc/c_proj,
# LayerNorms with biases, projection biases when the model has them.
_STARCODER2_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "model.norm"),
        ("blk.{i}.attn_norm", "model.layers.{i}.input_layernorm"),
        ("blk.{i}.ffn_norm", "model.layers.{i}.post_attention_layernorm"),
        ("blk.{i}.attn_q", "model.layers.{i}.self_attn.q_proj"),
        ("blk.{i}.attn_k", "model.layers.{i}.self_attn.k_proj"),
        ("blk.{i}.attn_v", "model.layers.{i}.self_attn.v_proj"),
        ("blk.{i}.attn_output", "model.layers.{i}.self_attn.o_proj"),
        ("blk.{i}.ffn_up", "model.layers.{i}.mlp.c_fc"),
        ("blk.{i}.ffn_down", "model.layers.{i}.mlp.c_proj")) for kind in ("weight", "bias")},
    "output.weight": "lm_head.weight",
}


# StarCoder (GPTBigCode): GPT-2's names under "transformer."; attn_qkv is c_attn as the
# checkpoint stores it (q | k | v with one KV head).
_STARCODER_TENSOR_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output.weight": "lm_head.weight",
    **{f"{gguf}.{kind}": f"{hf}.{kind}" for gguf, hf in (
        ("output_norm", "transformer.ln_f"), ("blk.{i}.attn_norm", "transformer.h.{i}.ln_1"),
        ("blk.{i}.attn_qkv", "transformer.h.{i}.attn.c_attn"),
        ("blk.{i}.attn_output", "transformer.h.{i}.attn.c_proj"),
        ("blk.{i}.ffn_norm", "transformer.h.{i}.ln_2"),
        ("blk.{i}.ffn_up", "transformer.h.{i}.mlp.c_fc"),
        ("blk.{i}.ffn_down", "transformer.h.{i}.mlp.c_proj")) for kind in ("weight", "bias")},
}


def _tensor_names(arch: str | None) -> dict[str, str]:
    if arch == "gptneox":
        return _NEOX_TENSOR_NAMES
    if arch == "phi2":
        return _PHI2_TENSOR_NAMES
    if arch == "starcoder2":
        return _STARCODER2_TENSOR_NAMES
    if arch == "starcoder":
        return _STARCODER_TENSOR_NAMES
    return {**_TENSOR_NAMES, **_FAMILY_TENSOR_NAMES.get(arch, {})}


_NAMED_ARCHITECTURES = (None, *_FAMILY_TENSOR_NAMES, "gptneox", "phi2", "starcoder2",
                        "starcoder")
_TO_HF = {arch: _name_patterns(_tensor_names(arch)) for arch in _NAMED_ARCHITECTURES}
_TO_GGUF = {arch: _name_patterns({hf: gguf for gguf, hf in _tensor_names(arch).items()})
            for arch in _NAMED_ARCHITECTURES}


def _neox_qkv_to_hf(array: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's stacked GPT-NeoX q|k|v rows [3, H, D, ...] as the HF checkpoint's
    per-head interleaving [H, 3, D, ...] (weights [3*H*D, d] and biases [3*H*D])."""
    if array.shape[0] % (3 * num_heads):
        return array  # the key map names the wrong shape
    stacked = array.reshape(3, num_heads, array.shape[0] // (3 * num_heads), *array.shape[1:])
    return np.swapaxes(stacked, 0, 1).reshape(array.shape)


def _rename(name: str, patterns) -> str | None:
    for pattern, target in patterns:
        match = pattern.match(name)
        if match:
            return target.format(i=match.group(1)) if match.groups() else target
    return None


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF tensor name of a GGUF tensor name (of architecture ``arch``), or ``None``
    when it has none."""
    return _rename(gguf_name, _TO_HF.get(arch, _TO_HF[None]))


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation.

    llama.cpp stores, within each head, the rows in the order (0, D/2, 1, D/2+1, ...),
    i.e. it viewed the head's rows as [2, D/2] and transposed them to [D/2, 2]. We view them
    as [D/2, 2] and transpose back: :func:`keymap.pairs_to_halves`, the reordering Cohere's
    checkpoints (RoPE on adjacent pairs) need too.

    Args:
      rows: [num_heads * D, ...] weight ([out, in]) or bias ([out]).
      num_heads: heads the rows belong to (query heads for Q, KV heads for K).
    Returns:
      array of the same shape in HF order.
    """
    return keymap.pairs_to_halves(rows, num_heads)


# ----------------------------------------------------------------------------- reading
#
# The header is parsed here rather than by ``gguf.GGUFReader``: the reader trusts every
# count and length in the file (a crafted array count makes it loop for hours, and it keeps
# one numpy view per array element, about 150x the bytes it reads), and it fails with
# whatever exception a bad byte happens to cause. This parser checks every length against
# the bytes left in the file before it reads or allocates anything, so a damaged or hostile
# file fails in one line, in time and memory proportional to its size.

_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 3  # arrays of arrays of arrays
# Metadata strings in one file (each costs a Python object). Real vocabularies hold fewer
# than 300k tokens and as many merges; the cap bounds a file of empty strings to seconds.
_MAX_STRINGS = 1 << 22
_DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # GGUF value type -> struct code (little-endian)
_SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                  7: np.bool_, 10: "<u8", 11: "<i8", 12: "<f8"}
# Tensor types the file stores as plain items (the rest are blocks of bytes), as gguf's
# dequantize expects them.
_ITEM_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2",
                "I32": "<i4", "I64": "<i8"}


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file.

    Attributes:
      name: the GGUF tensor name (``blk.0.attn_q.weight``).
      tensor_type: its ``gguf.GGMLQuantizationType``.
      shape: dimensions as the file lists them, fastest axis first (``[in, out]``).
      data: a read-only view of the file: items ``[out, in]`` for F32/F16/..., bytes
        ``[out, row bytes]`` for block-quantized types (what ``gguf.quants.dequantize``
        takes).
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF file: metadata values by key, and tensors in file order.

    Metadata scalars are Python values, strings ``str``, numeric arrays numpy arrays and
    string arrays lists of ``str``. ``data_offset`` is where the tensor data section starts
    (everything before it is header).
    """

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensor]
    data_offset: int


class _Cursor:
    """Reads little-endian GGUF values from a byte buffer, checking every length first."""

    def __init__(self, buffer, source: str):
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = 0
        self.source = source
        self.strings = 0

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {message}")

    def need(self, count: int, what: str) -> None:
        if count > self.size - self.offset:
            raise self.fail(f"{what} at byte {self.offset} needs {count} bytes but the file has "
                            f"{self.size - self.offset} left (truncated or corrupt)")

    def scalar(self, code: str, what: str):
        width = struct.calcsize("<" + code)
        self.need(width, what)
        (value,) = struct.unpack_from("<" + code, self.buffer, self.offset)
        self.offset += width
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"length of {what}")
        self.need(length, what)
        self.strings += 1
        if self.strings > _MAX_STRINGS:
            raise self.fail(f"more than {_MAX_STRINGS} metadata strings")
        raw = bytes(self.buffer[self.offset:self.offset + length])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(f"{what} at byte {self.offset} is not UTF-8") from error
        self.offset += length
        return text

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        item_kind = self.scalar("I", f"element type of {what}")
        count = self.scalar("Q", f"element count of {what}")
        if item_kind in _SCALARS:
            dtype = np.dtype(_SCALAR_DTYPES[item_kind])
            self.need(count * dtype.itemsize, f"{count} elements of {what}")
            array = np.frombuffer(self.buffer, dtype, count, self.offset)
            array = array.astype(dtype.newbyteorder("="))  # a native-order copy
            self.offset += count * dtype.itemsize
            return array
        # strings take at least 8 bytes (their length), arrays at least 12 (type, count)
        smallest = {_STRING: 8, _ARRAY: 12}.get(item_kind)
        if smallest is None:
            raise self.fail(f"{what} has unknown element type {item_kind}")
        self.need(count * smallest, f"{count} elements of {what}")
        return [self.value(item_kind, what, depth + 1) for _ in range(count)]


def _tensor_info(cursor: _Cursor, index: int):
    name = cursor.string(f"name of tensor {index}")
    what = f"tensor {name!r}"
    num_dims = cursor.scalar("I", f"dimension count of {what}")
    if not 1 <= num_dims <= _MAX_DIMS:
        raise cursor.fail(f"{what} has {num_dims} dimensions; GGUF allows 1 to {_MAX_DIMS}")
    shape = tuple(cursor.scalar("Q", f"dimensions of {what}") for _ in range(num_dims))
    code = cursor.scalar("I", f"type of {what}")
    try:
        tensor_type = GGMLQuantizationType(code)
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError):
        raise cursor.fail(f"{what} has unknown tensor type code {code}") from None
    offset = cursor.scalar("Q", f"data offset of {what}")
    if shape[0] % block:
        raise cursor.fail(f"{what} has rows of {shape[0]} values, not a multiple of the "
                          f"{tensor_type.name} block size {block}")
    num_bytes = math.prod(shape) // block * block_bytes
    return name, tensor_type, shape, offset, num_bytes


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses a GGUF file (version 2 or 3, little-endian): metadata and tensor views.

    Every count, length, type code, offset and size is checked against the file before it
    is used, so a truncated, damaged or crafted file is rejected before anything is
    allocated for it. Tensor data is memory-mapped, not read.

    Raises:
      ModelNotFoundError: no such file.
      CheckpointError: naming the file and the first problem found.
    """
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path}: {size} bytes is too short for a GGUF file (truncated?)")
    try:
        buffer = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({one_line(error)})") from error
    cursor = _Cursor(buffer, source)
    magic = bytes(buffer[:4])
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    cursor.offset = 4
    version = cursor.scalar("I", "version")
    if version not in (2, 3):
        if version & 0xFFFF == 0:  # 2 or 3 written in the other byte order
            raise CheckpointError(f"{path}: big-endian GGUF files are not supported")
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count = cursor.scalar("Q", "tensor count")
    kv_count = cursor.scalar("Q", "metadata count")
    # the smallest metadata entry takes 13 bytes, the smallest tensor description 24
    cursor.need(kv_count * 13 + tensor_count * 24, f"{kv_count} metadata entries and "
                f"{tensor_count} tensor descriptions")
    fields: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"key of metadata entry {index}")
        if key in fields:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        kind = cursor.scalar("I", f"value type of metadata {key!r}")
        fields[key] = cursor.value(kind, f"metadata {key!r}")
    infos = []
    names = set()
    for index in range(tensor_count):
        info = _tensor_info(cursor, index)
        if info[0] in names:
            raise cursor.fail(f"duplicated tensor {info[0]!r}")
        names.add(info[0])
        infos.append(info)
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1
            or alignment & (alignment - 1)):
        raise CheckpointError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.offset // alignment) * alignment
    spans = []
    for name, tensor_type, shape, offset, num_bytes in infos:
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} data offset {offset} is not a "
                                  f"multiple of the alignment {alignment}")
        start = data_start + offset
        if start + num_bytes > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({tensor_type.name}, shape {list(shape)}) needs bytes "
                f"{start}..{start + num_bytes} but the file has {size} (truncated or corrupt)")
        spans.append((start, start + num_bytes, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the file")
    tensors = []
    for name, tensor_type, shape, offset, num_bytes in infos:
        rows = tuple(reversed(shape))  # numpy order: slowest axis first
        dtype = _ITEM_DTYPES.get(tensor_type.name)
        if dtype is None:  # blocks of bytes: [..., row bytes]
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            rows, dtype = (*rows[:-1], rows[-1] // block * block_bytes), np.uint8
        data = np.ndarray(rows, np.dtype(dtype), buffer=buffer, offset=data_start + offset)
        tensors.append(GGUFTensor(name, tensor_type, shape, data))
    return GGUFFile(path, fields, tensors, data_start)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed GGUF file ``path`` (see :func:`read_gguf`)."""
    return read_gguf(path)


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          list: "an array"}


def _field(reader: GGUFFile, key: str, default: Any = None, *, required: bool = False,
           source: str = "", kind: type | None = None):
    """The metadata value ``key``, checked to be of ``kind`` (int, float, str, bool, list)."""
    if key not in reader.fields:
        if required:
            raise CheckpointError(f"{source}: GGUF metadata {key!r} is missing")
        return default
    value = reader.fields[key]
    if kind is None:
        return value
    if kind is list:
        ok = isinstance(value, (list, np.ndarray)) and np.ndim(value) == 1
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise CheckpointError(f"{source}: GGUF metadata {key!r} should be {_KINDS[kind]}, "
                              f"found {_describe(value)}")
    return value


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _float32_value(value) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. The shortest decimal
    # that round-trips through float32 recovers the value the model was converted with.
    return float(str(np.float32(value)))


def _special_token_ids(reader: GGUFFile, source: str) -> tuple[list[int], int | None]:
    """(end ids: ``eos_token_id`` then ``eot_token_id``, without repeats; ``bos_token_id``
    or ``None``) of a file's tokenizer metadata."""
    def token_id(key):
        return _field(reader, f"tokenizer.ggml.{key}", source=source, kind=int)

    ends = (token_id("eos_token_id"), token_id("eot_token_id"))
    return list(dict.fromkeys(t for t in ends if t is not None)), token_id("bos_token_id")


def config_from_gguf(reader: GGUFFile, source: str = "gguf") -> ModelConfig:
    """Builds the :class:`ModelConfig` described by a GGUF file's metadata.

    Raises:
      CheckpointError: the architecture is not supported, or a needed key is missing, of
        the wrong type or out of range.
    """
    arch = _field(reader, "general.architecture", required=True, source=source, kind=str)
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{sorted(_ARCHITECTURES)}")

    def meta(key, default=None, kind=int):
        value = _field(reader, f"{arch}.{key}", default, required=default is None,
                       source=source, kind=kind)
        if kind is int and value is not None and value < 0:
            raise CheckpointError(f"{source}: GGUF metadata '{arch}.{key}' is negative ({value})")
        return value

    names = {tensor.name for tensor in reader.tensors}
    if arch in FAMILY_ARCHITECTURES:
        return _family_config(reader, arch, meta, names, source)
    if arch == "gptneox":
        return _neox_config(reader, meta, names, source)
    if arch == "phi2":
        return _phi2_config(reader, meta, names, source)
    if arch == "starcoder2":
        return _starcoder2_config(reader, meta, names, source)
    if arch == "starcoder":
        return _starcoder_config(reader, meta, names, source)
    if arch in ("command-r", "cohere2"):
        return _cohere_config(reader, arch, meta, names, source)
    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    if heads == 0:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' is 0")
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head dim "
            f"{head_dim}) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens", source=source, kind=list)
    vocab = len(tokens) if tokens is not None else meta("vocab_size")
    scaling = None
    scaling_type = meta("rope.scaling.type", "none", kind=str)
    if scaling_type == "linear":
        scaling = RopeScaling("linear", _float32_value(meta("rope.scaling.factor", kind=float)))
    elif scaling_type != "none":
        raise CheckpointError(f"{source}: RoPE scaling {scaling_type!r} is not supported")
    factors = _rope_factor_tensor(reader, "rope_freqs.weight", source)
    if factors is not None:
        if scaling is not None:
            raise CheckpointError(f"{source}: both 'rope_freqs.weight' and RoPE scaling "
                                  f"{scaling_type!r}; expected one")
        # llama.cpp divides frequency i by factor i (how it stores Llama 3.1's scaling):
        # LongRoPE's rule with one set of factors, never switched.
        scaling = RopeScaling("longrope", original_max_position_embeddings=meta(
            "context_length"), short_factor=factors, long_factor=factors)

    eos_ids, bos = _special_token_ids(reader, source)
    window = meta("attention.sliding_window", 0)
    experts = {}
    if meta("expert_count", 0):  # Mixtral, as llama.cpp's converter writes it
        experts = dict(family="mixtral", num_experts=meta("expert_count"),
                       experts_per_token=meta("expert_used_count"),
                       normalize_expert_weights=_field(
                           reader, f"{arch}.expert_weights_norm", True, source=source,
                           kind=bool))
    try:
        return ModelConfig(
            architecture="llama", vocab_size=vocab, hidden_size=hidden,
            num_layers=meta("block_count"), num_heads=heads,
            num_kv_heads=meta("attention.head_count_kv", heads), head_dim=head_dim,
            intermediate_size=meta("feed_forward_length"),
            max_position_embeddings=meta("context_length"),
            norm_eps=_float32_value(meta("attention.layer_norm_rms_epsilon", kind=float)),
            rope_theta=_float32_value(meta("rope.freq_base", 10000.0, kind=float)),
            rope_scaling=scaling, tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names, out_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_gate.bias" in names, eos_token_ids=tuple(eos_ids),
            bos_token_id=bos, sliding_window=window or None, **experts,
        )
    except InvalidArgumentError as error:
        raise CheckpointError(f"{source}: GGUF metadata describes an invalid model ({error})"
                              ) from None


def _neox_config(reader: GGUFFile, meta, names: set, source: str) -> ModelConfig:
    """The config of a ``gptneox`` file (Pythia, GPT-NeoX-20B) as llama.cpp's converter
    writes it: RoPE on ``rope.dimension_count`` dims of each head, ``use_parallel_residual``,
    LayerNorm's epsilon, no RoPE base (llama.cpp's default, 10000, unless written)."""
    return _layer_norm_config(reader, "gptneox", meta, names, source, {
        "model_type": "gpt_neox",
        "use_parallel_residual": _field(reader, "gptneox.use_parallel_residual", True,
                                        source=source, kind=bool),
        "attention_bias": "blk.0.attn_qkv.bias" in names})


def _phi2_config(reader: GGUFFile, meta, names: set, source: str) -> ModelConfig:
    """The config of a ``phi2`` file (Phi-1, 1.5, 2) as llama.cpp's converter writes it:
    RoPE on ``rope.dimension_count`` dims of each head, LayerNorm's epsilon. Files from the
    original Microsoft checkpoints fuse q|k|v in ``attn_qkv``: refused, naming it."""
    if "blk.0.attn_qkv.weight" in names:
        raise CheckpointError(f"{source}: a phi2 file with fused 'blk.0.attn_qkv.weight' is not "
                              f"supported; convert the model from its Hugging Face directory")
    return _layer_norm_config(reader, "phi2", meta, names, source, {
        "model_type": "phi", "num_key_value_heads": meta(
            "attention.head_count_kv", meta("attention.head_count"))})


def _starcoder2_config(reader: GGUFFile, meta, names: set, source: str) -> ModelConfig:
    """The config of a ``starcoder2`` file as llama.cpp's converter writes it: grouped KV
    heads, LayerNorm's epsilon, projection biases if its tensors are there. llama.cpp
    attends globally in every layer unless the file names ``attention.sliding_window``
    (its converter writes none): read so, a generation longer than the Hugging Face
    config's window (4,096 in the released models) follows llama.cpp, not transformers."""
    window = meta("attention.sliding_window", 0)
    return _layer_norm_config(reader, "starcoder2", meta, names, source, {
        "model_type": "starcoder2", "num_key_value_heads": meta(
            "attention.head_count_kv", meta("attention.head_count")),
        "use_bias": "blk.0.attn_q.bias" in names, "sliding_window": window or None})


def _starcoder_config(reader: GGUFFile, meta, names: set, source: str) -> ModelConfig:
    """The config of a ``starcoder`` file (StarCoder, SantaCoder: GPTBigCode) as llama.cpp's
    converter writes it: learned positions, one KV head (``attention.head_count_kv``),
    LayerNorm's epsilon."""
    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    if kv_heads not in (1, heads):
        raise CheckpointError(f"{source}: a starcoder file with {kv_heads} KV heads of {heads} "
                              f"is not supported; expected 1 (multi-query) or {heads}")
    return _layer_norm_config(reader, "starcoder", meta, names, source, {
        "model_type": "gpt_bigcode", "multi_query": kv_heads == 1 and heads > 1})


def _cohere_config(reader: GGUFFile, arch: str, meta, names: set, source: str) -> ModelConfig:
    """The config of a ``command-r`` (Command R) or ``cohere2`` (Command R7B) file as
    llama.cpp's converter writes it: q and k as the checkpoint stores them (RoPE on
    adjacent pairs, which the key map reorders), ``logit_scale``, LayerNorm's epsilon;
    ``cohere2``: ``attention.sliding_window`` on three layers of every four (llama.cpp's
    fixed pattern, transformers' default one), RoPE on those only."""
    family = {"model_type": "cohere" if arch == "command-r" else "cohere2",
              "num_key_value_heads": meta("attention.head_count_kv",
                                          meta("attention.head_count")),
              "logit_scale": _float32_value(meta("logit_scale", kind=float)),
              "attention_bias": "blk.0.attn_q.bias" in names}
    if "blk.0.attn_q_norm.weight" in names:
        raise CheckpointError(f"{source}: a {arch} file with per-head q/k norms "
                              f"('blk.0.attn_q_norm.weight') is not supported")
    if arch == "cohere2":
        family.update(sliding_window=meta("attention.sliding_window", 0) or None,
                      sliding_window_pattern=4)
    return _layer_norm_config(reader, arch, meta, names, source, family)


def _layer_norm_config(reader: GGUFFile, arch: str, meta, names: set, source: str,
                       family: dict) -> ModelConfig:
    """The config of a file of the LayerNorm families (RoPE partial or whole, never scaled)
    (``gptneox``, ``phi2``, ``starcoder2``, ``starcoder``, ``command-r``, ``cohere2``): the
    keys they share, then ``family``'s, as the Hugging Face config
    :func:`specjax.families.from_hf_config` reads."""
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    if heads == 0 or hidden % heads:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' "
                              f"({heads}) does not divide the width ({hidden})")
    if meta("rope.scaling.type", "none", kind=str) != "none" or "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: RoPE scaling in a {arch} file is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens", source=source, kind=list)
    eos, bos = _special_token_ids(reader, source)
    head_dim = hidden // heads
    cfg = {
        "vocab_size": len(tokens) if tokens is not None else meta("vocab_size"),
        "hidden_size": hidden, "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads, "intermediate_size": meta("feed_forward_length"),
        "max_position_embeddings": meta("context_length"),
        "layer_norm_eps": _float32_value(meta("attention.layer_norm_epsilon", kind=float)),
        "rope_theta": _float32_value(meta("rope.freq_base", 10000.0, kind=float)),
        "partial_rotary_factor": meta("rope.dimension_count", head_dim) / head_dim,
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": eos or None, "bos_token_id": bos, **family,
    }
    try:
        return from_hf_config(cfg)
    except InvalidArgumentError as error:
        raise CheckpointError(f"{source}: GGUF metadata describes an invalid model ({error})"
                              ) from None


def _family_config(reader: GGUFFile, arch: str, meta, names: set, source: str) -> ModelConfig:
    """The config of a :data:`FAMILY_ARCHITECTURES` file: its metadata as the Hugging Face
    config keys :func:`specjax.families.from_hf_config` reads, so both formats share one
    reading of each family's features."""
    hidden, heads, layers = (meta("embedding_length"), meta("attention.head_count"),
                             meta("block_count"))
    if heads == 0:
        raise CheckpointError(f"{source}: GGUF metadata '{arch}.attention.head_count' is 0")
    head_dim = meta("attention.key_length", hidden // heads)
    rope_dims = meta("rope.dimension_count", head_dim)
    if rope_dims != head_dim and arch not in ("phi3", "stablelm"):
        raise CheckpointError(f"{source}: partial RoPE ({arch}.rope.dimension_count) is not "
                              f"supported")
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: tensor 'rope_freqs.weight' in a {arch} file is not "
                              f"supported")
    tokens = _field(reader, "tokenizer.ggml.tokens", source=source, kind=list)
    eos, bos = _special_token_ids(reader, source)
    cfg = {
        "model_type": FAMILY_ARCHITECTURES[arch],
        "vocab_size": len(tokens) if tokens is not None else meta("vocab_size"),
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads), "head_dim": head_dim,
        "intermediate_size": meta("feed_forward_length"),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": _float32_value(meta("attention.layer_norm_rms_epsilon", kind=float))
        if arch != "stablelm" else None,
        "rope_theta": _float32_value(meta("rope.freq_base", 10000.0, kind=float)),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": eos or None, "bos_token_id": bos,
    }
    # Phi-4-mini, StableLM: RoPE on the first rope_dims of each head
    cfg["partial_rotary_factor"] = rope_dims / head_dim
    if arch in _EXPERT_WEIGHTS_NORM:
        cfg.update(num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                   norm_topk_prob=_field(reader, f"{arch}.expert_weights_norm",
                                         _EXPERT_WEIGHTS_NORM[arch], source=source, kind=bool))
        if arch in ("qwen2moe", "qwen3moe"):
            cfg["moe_intermediate_size"] = meta("expert_feed_forward_length")
        if arch == "qwen2moe":
            cfg["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length", 0)
            cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
    if arch == "stablelm":
        cfg["layer_norm_eps"] = _float32_value(meta("attention.layer_norm_epsilon", kind=float))
        cfg["use_qkv_bias"] = "blk.0.attn_q.bias" in names
        # llama.cpp runs a file without MLP norms as parallel attention and MLP (whatever
        # use_parallel_residual says), which specjax's StableLM does not take.
        cfg["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in names
    scaling = meta("rope.scaling.type", "none", kind=str)
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": _float32_value(meta("rope.scaling.factor", kind=float))}
    elif scaling == "yarn" and arch == "olmo2":  # Olmo 3's, as llama.cpp's converter writes it
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": _float32_value(meta("rope.scaling.factor", kind=float)),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
        attention = meta("rope.scaling.attn_factor", 0.0, kind=float)
        if attention:
            cfg["rope_scaling"]["attention_factor"] = _float32_value(attention)
    elif scaling != "none":
        raise CheckpointError(f"{source}: RoPE scaling {scaling!r} is not supported")
    long, short = (_rope_factor_tensor(reader, f"rope_factors_{kind}.weight", source)
                   for kind in ("long", "short"))
    if (long is None) != (short is None):
        raise CheckpointError(f"{source}: 'rope_factors_long.weight' and "
                              f"'rope_factors_short.weight' come together; one is missing")
    if long is not None:
        if arch != "phi3" or "rope_scaling" in cfg:
            raise CheckpointError(f"{source}: LongRoPE factors in a {arch} file"
                                  f"{' with other RoPE scaling' if arch == 'phi3' else ''} are "
                                  f"not supported")
        # llama.cpp's Phi-3 (convert_hf_to_gguf.py): the factor sets as tensors, the
        # pretraining length and the attention factor as metadata.
        cfg["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": short,
                               "long_factor": long}
        attention = meta("rope.scaling.attn_factor", 0.0, kind=float)
        if attention:
            cfg["rope_scaling"]["attention_factor"] = _float32_value(attention)
    _family_layout(reader, arch, meta, layers, cfg, source)
    try:
        return from_hf_config(cfg)
    except InvalidArgumentError as error:
        raise CheckpointError(f"{source}: GGUF metadata describes an invalid model ({error})"
                              ) from None



def _family_layout(reader: GGUFFile, arch: str, meta, layers: int, cfg: dict,
                   source: str) -> None:
    """Adds to ``cfg`` (Hugging Face keys) what :func:`_family_config` reads per family:
    sliding windows and their layer pattern, Gemma's query scale and soft-caps, Granite's
    scalars, Gemma 3's local RoPE base."""
    window = meta("attention.sliding_window", 0)
    if window and arch in ("qwen3", "qwen2moe", "qwen3moe"):  # none slides in llama.cpp
        raise CheckpointError(f"{source}: a {arch} GGUF with a sliding window ({window}) is "
                              f"not supported; load the model from its HF directory")
    if window:
        cfg["sliding_window"] = window
        if arch == "olmo2":
            # llama.cpp writes Olmo 3 as olmo2 with its window and one flag per layer (its
            # converter's default: three sliding layers, then a global one).
            cfg["model_type"] = "olmo3"
            pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", source=source)
            sliding = (list(pattern) if isinstance(pattern, list) else
                       [(i + 1) % 4 != 0 for i in range(layers)])
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention"
                                  for s in sliding]
        if arch in _GEMMA_ARCHITECTURES:
            # llama.cpp's pattern: a period n (layer i slides iff i % n < n - 1; Gemma 2
            # alternates, Gemma 3 slides five in six) or one flag per layer.
            pattern = _field(reader, f"{arch}.attention.sliding_window_pattern",
                             2 if arch == "gemma2" else 6, source=source)
            sliding = (list(pattern) if isinstance(pattern, list) else
                       [i % int(pattern) < int(pattern) - 1 for i in range(layers)])
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention"
                                  for s in sliding]
    if arch in _GEMMA_ARCHITECTURES:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        # llama.cpp's query scale: attention.scale when written, else head_dim ** -0.5,
        # except the 27B models (46 / 62 blocks) whose scale is (hidden / heads) ** -0.5.
        scale = meta("attention.scale", 0.0, kind=float)
        big = layers == {"gemma2": 46, "gemma3": 62}.get(arch)
        cfg["query_pre_attn_scalar"] = (
            scale ** -2 if scale else
            cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = meta(key, 0.0, kind=float)
            cfg[key] = _float32_value(value) if value else None
    if arch == "granite":  # llama.cpp's names for Granite's four scalars
        for key, hf_key in (("embedding_scale", "embedding_multiplier"),
                            ("residual_scale", "residual_multiplier"),
                            ("logit_scale", "logits_scaling"),
                            ("attention.scale", "attention_multiplier")):
            value = meta(key, 0.0, kind=float)
            if value:
                cfg[hf_key] = _float32_value(value)
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = _float32_value(meta("rope.freq_base_swa", 10000.0,
                                                          kind=float))


# Tensors that carry RoPE scaling factors (read into the config, not parameters).
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight",
                       "rope_factors_short.weight")


def _rope_factor_tensor(reader: GGUFFile, name: str, source: str) -> list[float] | None:
    """A 1-D RoPE factor tensor of the file as floats (positive, finite), or ``None``."""
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    array = _dequantize(tensor, source)
    if (array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array))
            or not np.all(array > 0)):
        raise CheckpointError(f"{source}: tensor {name!r} must be 1-D positive finite RoPE "
                              f"factors, got shape {array.shape}")
    return [float(f) for f in array]


def _gguf_names_in_message(message: str, arch: str | None = None) -> str:
    # keymap names tensors by their HF names; show the GGUF name the user can find too.
    def swap(match):
        gguf = _rename(match.group(1), _TO_GGUF.get(arch, _TO_GGUF[None]))
        return f"'{gguf}' ({match.group(1)})" if gguf else match.group(0)

    return re.sub(r"'((?:model\.|lm_head\.|gpt_neox\.|embed_out\.)[^']*)'", swap, message)


def _dequantize(tensor, source: str) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} has quantization {tensor.tensor_type.name}, "
            "which gguf cannot dequantize") from error
    except Exception as error:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} is corrupt ({one_line(error)})") from error
    if not np.issubdtype(array.dtype, np.floating):
        raise CheckpointError(f"{source}: tensor {tensor.name!r} has type "
                              f"{tensor.tensor_type.name}; weights must be floating-point")
    expected = tuple(int(n) for n in reversed(tensor.shape))  # gguf lists fastest axis first
    if array.shape != expected:
        raise CheckpointError(
            f"{source}: tensor {tensor.name!r} dequantized to shape {array.shape}, expected "
            f"{expected}")
    return array


def params_from_gguf(reader: GGUFFile, config: ModelConfig, source: str = "gguf", dtype=None,
                     progress: bool = False) -> dict:
    """Dequantized parameter tree (numpy) of a GGUF file; see the module docstring."""
    arch = _field(reader, "general.architecture")
    permuted = _ARCHITECTURES.get(arch, False)
    tensors: dict[str, np.ndarray] = {}
    items = reader.tensors
    if progress:  # a bar on a terminal only
        items = progress_lib.terminal_bar(items, desc="dequantizing GGUF tensors",
                                          unit="tensor", leave=False)
    for tensor in items:
        if tensor.name in ROPE_FACTOR_TENSORS:
            continue  # read into the config (config_from_gguf)
        array = _dequantize(tensor, source)
        experts = _expert_tensors(tensor.name, array, config)
        if experts is not None:
            tensors.update(experts)
            continue
        name = hf_name(tensor.name, arch)
        if arch in _GEMMA_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1.0)  # stored 1 + w (see the module docstring)
        if arch == "gptneox" and ".attn_qkv." in tensor.name:
            array = _neox_qkv_to_hf(array, config.num_heads)
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


def _expert_tensors(name: str, array: np.ndarray, config: ModelConfig) -> dict | None:
    """A mixture of experts' router or stacked experts tensor under its checkpoint names
    (one tensor per expert: ``array[e]``); ``None`` for any other tensor."""
    match = re.fullmatch(r"blk\.(\d+)\.(ffn_\w+)\.weight", name)
    kinds = ("ffn_gate_inp", *_EXPERT_TENSORS, *_SHARED_EXPERT_TENSORS)
    if match is None or match.group(2) not in kinds or not config.num_experts:
        return None
    layer, kind = match.groups()
    prefix = (f"model.layers.{layer}.block_sparse_moe." if config.family == "mixtral"
              else f"model.layers.{layer}.mlp.")
    if kind == "ffn_gate_inp":
        return {prefix + "gate.weight": array}
    if kind in _SHARED_EXPERT_TENSORS:  # the gate may be stored 1-D ([d]); HF's is [1, d]
        shaped = array.reshape(1, -1) if kind == "ffn_gate_inp_shexp" else array
        return {f"{prefix}{_SHARED_EXPERT_TENSORS[kind]}.weight": shaped}
    projection = _EXPERT_TENSORS[kind][config.family != "mixtral"]
    return {f"{prefix}experts.{e}.{projection}.weight": array[e] for e in range(len(array))}


# ----------------------------------------------------------------------------- tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex that splits text into words before byte-level BPE.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "codeshell",
                     "command-r", "mpt", "olmo"), _GPT2_SPLIT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# llama.cpp (and these models' original tokenizer.json, as a Digits(individual_digits=True)
# step) first isolate every digit for these. transformers' GGUF loader does not, and the two
# disagree on whitespace before a digit: "\n    0" splits into the words ["\n   ", " 0"]
# there and ["\n    ", "0"] in llama.cpp. ``split_digits`` picks llama.cpp's behaviour.
_DIGIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})

# tokenizer.ggml.token_type values (SentencePiece's piece types, which llama.cpp writes for
# every vocabulary kind).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE_MARK = "\u2581"  # SentencePiece writes a space as "▁"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte spelled as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the characters
    from U+0100 on, in byte order.
    """
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: chr(byte) for byte in kept}
    for offset, byte in enumerate(b for b in range(256) if b not in spelling):
        spelling[byte] = chr(0x100 + offset)
    return spelling


class _Vocabulary(NamedTuple):
    """The ``tokenizer.*`` fields that every GGUF tokenizer kind shares."""
    tokens: list[str]
    token_types: list[int]
    special_ids: dict[str, int]  # "bos", "eos", "unknown", "padding" -> id, where given
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def special(self, name: str) -> str | None:
        index = self.special_ids.get(name)
        return None if index is None else self.tokens[index]


def _metadata_reader(reader: GGUFFile, source: str):
    """(get, strings): typed readers of ``tokenizer.*`` metadata for error-naming code."""
    def get(key, default=None, kind=None):
        return _field(reader, f"tokenizer.{key}", default, source=source, kind=kind)

    def strings(key):
        values = get(key, [], kind=list)
        if not all(isinstance(value, str) for value in values):
            raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.{key}' should be an "
                                  "array of strings")
        return list(values)

    return get, strings


def _read_vocabulary(reader: GGUFFile, source: str, add_bos_default: bool) -> _Vocabulary:
    """Tokens, their types, the special token ids, the BOS/EOS flags and the chat template.

    ``add_bos_default`` applies when the file has no ``tokenizer.ggml.add_bos_token``
    (llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise).
    """
    get, strings = _metadata_reader(reader, source)
    tokens = strings("ggml.tokens")
    token_types = get("ggml.token_type", np.full(len(tokens), _NORMAL, np.int32), kind=list)
    if not isinstance(token_types, np.ndarray) or token_types.dtype.kind not in "iu":
        raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.ggml.token_type' should be "
                              "an array of integers")
    if not tokens or len(token_types) != len(tokens):
        raise CheckpointError(f"{source}: GGUF tokenizer fields are incomplete (tokens and "
                              "one token_type per token are needed)")
    special_ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        index = get(f"ggml.{name}_token_id", kind=int)
        if index is None:
            continue
        if not 0 <= index < len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.{name}_token_id {index} is out "
                                  "of range")
        special_ids[name] = index
    add_bos = get("ggml.add_bos_token", add_bos_default, kind=bool) and "bos" in special_ids
    add_eos = get("ggml.add_eos_token", False, kind=bool) and "eos" in special_ids
    chat_template = get("chat_template", kind=str)
    if chat_template is not None:
        check_chat_template(chat_template, f"{source}: tokenizer.chat_template")
    return _Vocabulary(tokens, token_types.tolist(), special_ids, add_bos, add_eos,
                       chat_template)


def _byte_level_tokenizer(reader: GGUFFile, vocabulary: _Vocabulary, source: str,
                          split_digits: bool):
    """(tokenizers.Tokenizer, keep) for ``tokenizer.ggml.model == "gpt2"``: byte-level BPE
    with the file's merges; ``keep(token)`` says whether a control or user-defined token
    can be added whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    get, strings = _metadata_reader(reader, source)
    pre = get("ggml.pre", "default", kind=str)
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"{source}: GGUF pre-tokenizer {pre!r} is not supported; expected one of "
            f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    if "tokenizer.ggml.merges" not in reader.fields:
        raise CheckpointError(f"{source}: GGUF tokenizer fields are incomplete (a byte-level "
                              "BPE vocabulary needs tokenizer.ggml.merges)")
    pair_list = []
    for merge in strings("ggml.merges"):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{source}: malformed GGUF merge {merge[:40]!r}")
        pair_list.append((parts[0], parts[1]))

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # Byte-level vocabularies are written in the byte alphabet; a token that is not
        # (a raw special token) is respelled so that the BPE model can still hold it.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(vocabulary.tokens)}
    regexes = [_PRE_TOKENIZER_SPLITS[pre]]
    if split_digits and pre in _DIGIT_PRE_TOKENIZERS:
        regexes.insert(0, r"\p{N}")
    # tokenizers rejects, e.g., a merge of tokens not in the vocabulary: the caller names it.
    backend = Tokenizer(models.BPE(vocab, pair_list, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens fit the byte alphabet in a well-formed file; one that
    # does not is a mislabel and would be cut, not matched whole: leave it to BPE.
    return backend, lambda token: set(token) <= alphabet


def sentencepiece_merges(tokens: list[str], token_types: list[int],
                         scores) -> list[tuple[str, str]]:
    """BPE merges that tokenize as SentencePiece BPE does with these scores.

    SentencePiece (and llama.cpp's SPM tokenizer) repeatedly joins the adjacent pair of
    pieces whose joined piece is in the vocabulary with the highest score. A ranked merge
    list says the same: each way to cut a piece into two pieces of the vocabulary is a
    merge, ranked by the joined piece's score, best first. Equal scores rank by the joined
    piece's id (SentencePiece writes pieces in merge order); among equal scores
    SentencePiece joins the leftmost pair instead, which differs only for ties.

    Only normal pieces take part: control and byte tokens are never the result of joining,
    and user-defined ones are matched whole before BPE runs.

    Args:
      tokens: the vocabulary [V].
      token_types: ``tokenizer.ggml.token_type`` [V].
      scores: ``tokenizer.ggml.scores`` [V].
    Returns:
      (left, right) pairs, best first.
    """
    scores = np.asarray(scores, np.float64).tolist()  # Python floats: faster to index
    mergeable: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind == _NORMAL:
            mergeable.setdefault(token, index)
    ranked = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, mergeable[left], left, right))
    ranked.sort()  # (score, id, left id) is unique per merge: the strings never compare
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_tokenizer(reader: GGUFFile, vocabulary: _Vocabulary, source: str):
    """(tokenizers.Tokenizer, keep) for ``tokenizer.ggml.model == "llama"`` (SentencePiece
    BPE: Llama 2, Mistral, Gemma 2/3, Phi-3), tokenizing as llama.cpp does.

    Spaces become "▁" and, where ``tokenizer.ggml.add_space_prefix`` says so (llama.cpp's
    default; Gemma's files say no), every stretch of text between special tokens starts
    with one. Characters outside the vocabulary fall back to ``<0xNN>`` byte tokens. The
    file's merges, if any, are ignored as llama.cpp ignores them: the scores rank merging.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    get, _ = _metadata_reader(reader, source)
    tokens = vocabulary.tokens
    scores = get("ggml.scores", kind=list)
    if scores is None:
        scores = np.zeros(len(tokens), np.float32)  # llama.cpp reads a missing score as 0
    if (not isinstance(scores, np.ndarray) or scores.dtype.kind not in "fiu"
            or len(scores) != len(tokens)):
        raise CheckpointError(f"{source}: GGUF metadata 'tokenizer.ggml.scores' should be an "
                              f"array of {len(tokens)} numbers, one per token")
    byte_tokens = {f"<0x{byte:02X}>" for byte in range(256)}
    if vocabulary.special("unknown") is None and not byte_tokens <= set(tokens):
        # BPE would then drop the characters it cannot spell, silently.
        raise CheckpointError(f"{source}: the GGUF SentencePiece vocabulary has neither an "
                              "unknown token (tokenizer.ggml.unknown_token_id) nor the 256 "
                              "byte tokens <0x00>..<0xFF>, so it cannot encode every text")
    add_prefix = get("ggml.add_space_prefix", True, kind=bool)
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, vocabulary.token_types, scores)
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=vocabulary.special("unknown"),
                                   fuse_unk=True, byte_fallback=True))
    # The normalizer runs on each stretch between added tokens, so Prepend puts "▁" after
    # every special token too, as llama.cpp does; a pre-tokenizer would split words, which
    # SentencePiece does not.
    replace = normalizers.Replace(" ", _SPACE_MARK)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE_MARK), replace])
                          if add_prefix else replace)
    steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prefix space of the first word
    backend.decoder = decoders.Sequence(steps)
    return backend, lambda token: True


# tokenizer.ggml.model values supported, and what they name.
_TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}


def tokenizer_from_gguf(reader: GGUFFile, source: str = "gguf", model_max_length: int | None = None,
                        *, split_digits: bool = False):
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*`` fields.

    Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM,
    Llama 3, Qwen2, StarCoder ...), tokenized as transformers' own GGUF loader does
    (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), and SentencePiece BPE
    vocabularies (``"llama"``: Llama 2, Mistral, Gemma 2/3, Phi-3), tokenized as llama.cpp
    does (see :func:`_sentencepiece_tokenizer`); neither needs torch or sentencepiece.
    Tokens marked control become special tokens and those marked user-defined become added
    tokens, so both stay whole.

    Args:
      reader: a parsed file (see :func:`read_gguf`).
      source: a name for error messages.
      model_max_length: recorded on the tokenizer (the model's context length).
      split_digits: for SmolLM/StarCoder-style files (``tokenizer.ggml.pre`` "smollm",
        "starcoder" ...), isolate every digit first as llama.cpp and the models' original
        tokenizers do; transformers does not (see ``_DIGIT_PRE_TOKENIZERS``).

    Raises:
      CheckpointError: the file has no tokenizer, one of a kind not supported here, fields
        of the wrong type, or a chat template that reaches for Python internals.
    """
    kind = _field(reader, "tokenizer.ggml.model", source=source, kind=str)
    if kind is None:
        raise CheckpointError(f"{source}: the GGUF file has no tokenizer (tokenizer.ggml.model)")
    if kind not in _TOKENIZER_KINDS:
        supported = ", ".join(f"{name!r} ({what})" for name, what in _TOKENIZER_KINDS.items())
        raise CheckpointError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported (only {supported}); "
            "load the model's HF directory for its tokenizer")
    vocabulary = _read_vocabulary(reader, source, add_bos_default=kind == "llama")
    try:
        if kind == "gpt2":
            backend, keep = _byte_level_tokenizer(reader, vocabulary, source, split_digits)
        else:
            backend, keep = _sentencepiece_tokenizer(reader, vocabulary, source)
        return _wrap_tokenizer(backend, keep, vocabulary, model_max_length)
    except CheckpointError:
        raise
    except Exception as error:  # tokenizers/transformers raise Exception, ValueError...
        raise CheckpointError(f"{source}: the GGUF tokenizer cannot be built "
                              f"({one_line(error)})") from error


def _wrap_tokenizer(backend, keep, vocabulary: _Vocabulary, model_max_length: int | None):
    """Adds the control / user-defined tokens that ``keep`` accepts and BOS/EOS to
    ``backend``, and wraps it as transformers' tokenizer (chat template included)."""
    from tokenizers import AddedToken, processors
    with quiet_transformers_import():
        from transformers import PreTrainedTokenizerFast

    pairs = list(zip(vocabulary.tokens, vocabulary.token_types))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in pairs if kind == _CONTROL and keep(token)])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in pairs if kind == _USER_DEFINED and keep(token)])
    bos, eos = vocabulary.special("bos"), vocabulary.special("eos")
    template = ([bos] if vocabulary.add_bos else []) + ["$A"] + (
        [eos] if vocabulary.add_eos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=template, pair=template + ["$B:1"],
        special_tokens=[(vocabulary.special(name), vocabulary.special_ids[name])
                        for name in ("bos", "eos") if name in vocabulary.special_ids])
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos,
        unk_token=vocabulary.special("unknown"), pad_token=vocabulary.special("padding"),
        chat_template=vocabulary.chat_template, add_bos_token=vocabulary.add_bos,
        add_eos_token=vocabulary.add_eos, **kwargs)


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
