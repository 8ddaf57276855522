"""GGUF files (llama.cpp), read without trusting them: the binary parser and dequantization.

:func:`read_gguf` parses the file itself, checking every count, length and offset against
the file's size first (see below); the ``gguf`` package supplies the type tables and the
dequantization (:func:`dequantize_tensor`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, K-quants).
GGUF lists a tensor's shape fastest-axis first (``[in, out]``), but the arrays read from it
are numpy row-major ``[out, in]``: the HF ``nn.Linear`` layout.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from specjax.checkpoints_tools.hf import one_line
from specjax.errors import CheckpointError, ModelNotFoundError

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


def metadata_value(reader: GGUFFile, key: str, default: Any = None, *, required: bool = False,
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


def dequantize_tensor(tensor: GGUFTensor, source: str) -> np.ndarray:
    """``tensor``'s values as float numpy ``[out, in]`` (whatever ``gguf.quants`` can
    undo), checked to be floating-point and of the shape the file lists."""
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
