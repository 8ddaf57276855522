"""Hostile and damaged files: every loader rejects them in one line, fast, without
allocating memory the file does not justify, and without writing anything.

For each loader (GGUF, safetensors, shard index, orbax, n-gram tables, draft assets):

- crafted files, one per known attack on the format, each with the message it must give
  (a header claiming a 10^12-element tensor, a string or array longer than the file,
  offsets past the end, overlapping or duplicated entries, shard names outside the
  directory, pickled arrays...);
- a seeded hypothesis campaign over a small valid file: truncations, bit flips, and
  extreme values written over its length, count and offset fields. A damaged file may
  still load (a flip in weight bytes: none of these formats checksums its weights, except
  the zip inside an ``.npz``), or fail with a :class:`SpecjaxError`; anything else, a
  second line, a slow rejection, a large allocation or a written file fails the test.

Memory is the growth of the process's peak resident set (reset before each load, so
native allocations count); a rejection must come from the format checks (its message
says which), not from an allocation that failed.
``slow`` runs the campaigns 20 times longer. ``benchmarks/fuzz_loaders.py`` reuses the
builders here for a timed campaign.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.checkpoints_tools import orbax_io
from specjax.checkpoints_tools.assets import check_draft_asset
from specjax.checkpoints_tools.gguf_loader import load_gguf
from specjax.checkpoints_tools.gguf_reader import read_gguf
from specjax.checkpoints_tools.gguf_tokenizer import tokenizer_from_gguf
from specjax.checkpoints_tools.hf import load_hf_directory
from specjax.checkpoints_tools.orbax_io import load_orbax, save_orbax
from specjax.checkpoints_tools.sources import save_draft_asset
from specjax.drafters.ngram import load_ngram, save_ngram
from specjax.errors import CheckpointError, SpecjaxError
from specjax.models import init_params, param_shapes

SECONDS = 5.0  # slowest acceptable rejection (the CI machine is shared)
MIB = 1 << 20


# ----------------------------------------------------------------------------- the property


def _snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_symlink() or p.is_file()}


class PeakMemory:
    """Peak resident memory added while the block runs, in bytes (``.peak``).

    On Linux the process's high-water mark is reset through ``/proc/self/clear_refs``, so
    native allocations (safetensors, tokenizers, tensorstore) count too; elsewhere
    ``tracemalloc`` measures Python and numpy allocations.
    """

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.base = self._status("VmRSS")
            self.traced = False
        except OSError:
            tracemalloc.start()
            self.traced = True
        return self

    def __exit__(self, *exc):
        if self.traced:
            self.peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        else:
            self.peak = self._status("VmHWM") - self.base

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(field)


@dataclasses.dataclass
class Outcome:
    """What one load of a (possibly damaged) file did."""

    message: str | None  # the SpecjaxError's message; None if the file loaded
    seconds: float
    peak: int  # resident memory added, bytes
    wrote: bool  # files under the watched directory changed


def run_case(load, target: Path, watch: Path | None = None) -> Outcome:
    """Runs ``load(target)`` once, measuring it; any exception but a SpecjaxError escapes."""
    watch = watch or target.parent
    before = _snapshot(watch)
    started = time.perf_counter()
    with PeakMemory() as measured:
        try:
            load(target)
            message = None
        except SpecjaxError as error:
            message = str(error)
    return Outcome(message, time.perf_counter() - started, measured.peak,
                   _snapshot(watch) != before)


def memory_allowance(watch: Path) -> int:
    """Resident memory a load may add: 32 MiB + 16x the bytes of the files it reads."""
    return 32 * MIB + 16 * sum(size for size, _ in _snapshot(watch).values())


def violations(outcome: Outcome, named: str, memory: int) -> list[str]:
    """How ``outcome`` breaks the property (empty when it holds)."""
    found = []
    if outcome.seconds >= SECONDS:
        found.append(f"took {outcome.seconds:.1f} s")
    if outcome.peak >= memory:
        found.append(f"added {outcome.peak} bytes of resident memory")
    if outcome.wrote:
        found.append("wrote files")
    if outcome.message is not None:
        if "\n" in outcome.message:
            found.append("a message of several lines")
        if named not in outcome.message:
            found.append(f"a message not naming {named}")
        if "MemoryError" in outcome.message:
            found.append("ran out of memory")
    return found


def attempt(load, target: Path, *, named: str | None = None, watch: Path | None = None,
            memory: int | None = None) -> str | None:
    """Runs ``load(target)``; returns None if it loads, else the SpecjaxError message.

    Asserts: any error is a one-line SpecjaxError naming ``named`` (default: the target's
    name); it took under SECONDS; resident memory grew by less than ``memory`` (default:
    :func:`memory_allowance`); nothing under ``watch`` changed.
    """
    watch = watch or target.parent
    memory = memory_allowance(watch) if memory is None else memory
    outcome = run_case(load, target, watch)
    problems = violations(outcome, named or target.name, memory)
    assert not problems, (problems, outcome.message)
    return outcome.message


def rejects(load, target: Path, pattern: str, **kwargs) -> str:
    message = attempt(load, target, **kwargs)
    assert message is not None, f"{target.name} loaded"
    assert re.search(pattern, message), message
    return message


# ----------------------------------------------------------------------------- damage

# Values written over length, count and offset fields: 0, 1, sign bits, all ones...
EXTREMES = (0, 1, 0x7F, 0xFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 1 << 32, 1 << 40,
            (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


@st.composite
def damage(draw, size: int, header: int):
    """A mutation of a ``size``-byte file whose first ``header`` bytes hold its structure:
    ("truncate", n), ("flip", position, bits) or ("smash", position, width, value)."""
    kind = draw(st.sampled_from(("truncate", "flip", "flip", "smash", "smash")))
    if kind == "truncate":
        return ("truncate", draw(st.integers(0, size - 1)))
    # most positions fall in the header, where the lengths, counts and offsets are
    position = draw(st.one_of(st.integers(0, max(header - 1, 0)), st.integers(0, size - 1)))
    if kind == "flip":
        return ("flip", position, draw(st.integers(1, 255)))
    width = draw(st.sampled_from((1, 2, 4, 8)))
    return ("smash", position, width, draw(st.sampled_from(EXTREMES)) & ((1 << 8 * width) - 1))


def apply(data: bytes, mutation) -> bytes:
    if mutation[0] == "truncate":
        return data[:mutation[1]]
    out = bytearray(data)
    if mutation[0] == "flip":
        out[mutation[1]] ^= mutation[2]
    else:
        _, position, width, value = mutation
        out[position:position + width] = value.to_bytes(width, "little")[:len(out) - position]
    return bytes(out)


def campaign(examples: int):
    """Hypothesis settings of a seeded campaign of ``examples`` cases."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


# ----------------------------------------------------------------------------- valid files


def build_valid_files(root: Path) -> dict:
    """Small valid files of every kind under ``root``: a Q8_0 GGUF, an HF directory (one
    safetensors file) and a sharded one, an orbax checkpoint, n-gram tables and a draft
    asset (with its target's config). Each is loaded once, so that imports and first-use
    caches do not count as a later load's time or memory."""
    from helpers_checkpoints import gguf_llama, save_tiny, tiny_model, write_tiny_gguf

    root.mkdir(parents=True, exist_ok=True)
    gguf = write_tiny_gguf(gguf_llama(seed=5), root / "base.gguf", "Q8_0")
    model = tiny_model("llama-gqa-untied", seed=6)
    hf = save_tiny(model, root / "hf")
    sharded = save_tiny(model, root / "sharded", "sharded")
    config, params = load_hf_directory(hf)
    orbax = save_orbax(root / "orbax", config, params)
    ngram = save_ngram(root / "ngram.npz", _tiny_tables(), {})
    draft_config = dataclasses.replace(config, num_layers=1)
    draft_params = jax.tree.map(np.asarray, init_params(draft_config, jax.random.key(0)))
    asset = save_draft_asset(root / "asset", config, draft_params, params["embed"],
                             {"note": "fuzz"}, head_tokens=[3, 5, 7, 11])
    load_gguf(gguf), load_hf_directory(sharded), load_orbax(orbax), load_ngram(ngram)
    return dict(gguf=gguf, hf=hf, sharded=sharded, orbax=orbax, ngram=ngram, asset=asset,
                config=config)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return build_valid_files(tmp_path_factory.mktemp("valid"))


def _tiny_tables():
    from specjax.training.ngram_build import build_ngram

    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 12, 60).tolist() for _ in range(8)]
    return build_ngram(corpus, 12, top_k=4, trigram_top_k=2, trigram_buckets=64).tables


def _copy(source: Path, directory: Path, name: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / (name or source.name)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)
    return target


# ----------------------------------------------------------------------------- GGUF

# GGUF value types and the raw writer used to craft files that no writer would produce.
U8, I32, U32, F32, BOOL, STRING, ARRAY, U64 = 0, 5, 4, 6, 7, 8, 9, 10
T_F32, T_Q8_0 = 0, 8


def _text(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return _text(key) + struct.pack("<I", kind) + payload


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def f32(value: float) -> bytes:
    return struct.pack("<f", value)


def array(kind: int, items: list, count: int | None = None) -> bytes:
    body = b"".join(_text(i) if kind == STRING else struct.pack(
        "<" + {U8: "B", I32: "i", U32: "I"}[kind], i) for i in items)
    return struct.pack("<IQ", kind, len(items) if count is None else count) + body


def tensor_info(name: str, dims: list[int], kind: int = T_F32, offset: int = 0) -> bytes:
    return (_text(name) + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset))


def gguf_bytes(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", *,
               magic: bytes = b"GGUF", version: int = 3, counts: tuple | None = None) -> bytes:
    counts = counts or (len(tensors), len(kvs))
    out = bytearray(magic + struct.pack("<I", version) + struct.pack("<QQ", *counts))
    for item in (*kvs, *tensors):
        out += item
    out += b"\0" * (-len(out) % 32)
    return bytes(out + data)


def llama_kvs(replace: dict | None = None) -> list[bytes]:
    """Metadata of a valid 1-layer llama with a tiny tokenizer; ``replace`` maps a key to a
    new (type, payload), or to None to drop it."""
    from helpers_checkpoints import tiny_vocabulary

    tokens, types, merges = tiny_vocabulary()
    entries = {
        "general.architecture": (STRING, _text("llama")),
        "llama.block_count": (U32, u32(1)), "llama.context_length": (U32, u32(64)),
        "llama.embedding_length": (U32, u32(8)), "llama.feed_forward_length": (U32, u32(16)),
        "llama.attention.head_count": (U32, u32(2)),
        "llama.attention.layer_norm_rms_epsilon": (F32, f32(1e-6)),
        "tokenizer.ggml.model": (STRING, _text("gpt2")),
        "tokenizer.ggml.tokens": (ARRAY, array(STRING, tokens)),
        "tokenizer.ggml.token_type": (ARRAY, array(I32, types)),
        "tokenizer.ggml.merges": (ARRAY, array(STRING, merges)),
        "tokenizer.ggml.bos_token_id": (U32, u32(1)),
        "tokenizer.chat_template": (STRING, _text("{{ messages[0]['content'] }}")),
    }
    for key, value in (replace or {}).items():
        if value is None:
            entries.pop(key)
        else:
            entries[key] = value
    return [kv(key, kind, payload) for key, (kind, payload) in entries.items()]


def with_meta(key: str, kind: int, payload: bytes) -> bytes:
    """A header-only GGUF file of :func:`llama_kvs` with ``key`` set to (kind, payload)."""
    return gguf_bytes(llama_kvs({key: (kind, payload)}))


CRAFTED_GGUF = {
    "10^12-element tensor": (gguf_bytes(tensors=[tensor_info("token_embd.weight", [10**6, 10**6])],
                                        data=b"\0" * 64), r"needs bytes .* file has"),
    "element count past 2^64": (gguf_bytes(tensors=[tensor_info("x", [1 << 32, 1 << 32])],
                                           data=b"\0" * 64), r"needs bytes"),
    "unknown tensor type": (gguf_bytes(tensors=[tensor_info("x", [4], kind=999)]),
                            r"unknown tensor type code 999"),
    "unknown value type": (gguf_bytes([kv("general.name", 77, b"\0" * 8)]),
                           r"unknown value type 77"),
    "string longer than the file": (gguf_bytes([struct.pack("<Q", 1 << 62) + b"key"]),
                                    r"needs 4611686018427387904 bytes"),
    "value string longer than the file": (
        gguf_bytes([kv("general.name", STRING, struct.pack("<Q", (1 << 64) - 1))]),
        r"metadata 'general.name' .* needs"),
    "array of 2^60 bytes": (gguf_bytes([kv("a", ARRAY, array(U8, [], count=1 << 60))]),
                            r"1152921504606846976 elements of metadata 'a'"),
    "array of 2^40 strings": (gguf_bytes([kv("a", ARRAY, array(STRING, [], count=1 << 40))]),
                              r"elements of metadata 'a' .* needs"),
    "arrays nested too deep": (gguf_bytes([kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * 5)]),
                               r"nests arrays"),
    "tensor data past the end": (gguf_bytes(tensors=[tensor_info("x", [8], offset=1 << 40)]),
                                 r"needs bytes .* file has"),
    "duplicated tensor": (gguf_bytes(tensors=[tensor_info("x", [8]),
                                              tensor_info("x", [8], offset=32)],
                                     data=b"\0" * 64), r"duplicated tensor 'x'"),
    "duplicated metadata key": (gguf_bytes([kv("a", U32, u32(1)), kv("a", U32, u32(2))]),
                                r"'a' appears twice"),
    "1000 dimensions": (gguf_bytes(tensors=[_text("x") + struct.pack("<I", 1000)]),
                        r"1000 dimensions"),
    "tensor count 2^63": (gguf_bytes(counts=(1 << 63, 0)), r"9223372036854775808 tensor"),
    "metadata count 2^63": (gguf_bytes(counts=(0, 1 << 63)), r"9223372036854775808 metadata"),
    "misaligned tensor": (gguf_bytes(tensors=[tensor_info("x", [4], offset=4)], data=b"\0" * 64),
                          r"not a multiple of the alignment"),
    "overlapping tensors": (gguf_bytes(tensors=[tensor_info("x", [16]), tensor_info("y", [8])],
                                       data=b"\0" * 64), r"'[xy]' and '[xy]' overlap"),
    "row not a multiple of the block": (gguf_bytes(tensors=[tensor_info("x", [31], T_Q8_0)],
                                                   data=b"\0" * 64), r"block size 32"),
    "key not UTF-8": (gguf_bytes([kv(b"\xff\xfe", U32, u32(1))]), r"not UTF-8"),
    "alignment 3": (gguf_bytes([kv("general.alignment", U32, u32(3))]), r"not a power of two"),
    "bad magic": (b"GGML" + bytes(60), r"not a GGUF file"),
    "version 1": (gguf_bytes(version=1), r"version 1 is not supported"),
    "big-endian": (gguf_bytes(version=3 << 24), r"big-endian"),
    "20 bytes": (b"GGUF" + bytes(16), r"too short"),
    # metadata that parses but lies about its type or describes no model
    "architecture is an array": (with_meta("general.architecture", ARRAY, array(U8, [1])),
                                 r"'general.architecture' should be a string"),
    "width is a string": (with_meta("llama.embedding_length", STRING, _text("8")),
                          r"'llama.embedding_length' should be an integer"),
    "zero heads": (with_meta("llama.attention.head_count", U32, u32(0)), r"head_count' is 0"),
    "heads do not divide": (with_meta("llama.attention.head_count_kv", U32, u32(3)),
                            r"describes an invalid model"),
    "eps is a string": (with_meta("llama.attention.layer_norm_rms_epsilon", STRING, _text("x")),
                        r"should be a number"),
    "tokens are integers": (with_meta("tokenizer.ggml.tokens", ARRAY, array(U32, [1, 2])),
                            r"'tokenizer.ggml.tokens' should be an array of strings"),
    "token types are strings": (with_meta("tokenizer.ggml.token_type", ARRAY, array(STRING, ["a"])),
                                r"token_type' should be an array of integers"),
    "merge of unknown tokens": (with_meta("tokenizer.ggml.merges", ARRAY, array(STRING, ["zz qq"])),
                                r"tokenizer cannot be built"),
    "bos id out of range": (with_meta("tokenizer.ggml.bos_token_id", U32, u32(10**6)),
                            r"bos_token_id 1000000 is out of range"),
    "template is a number": (with_meta("tokenizer.chat_template", U32, u32(7)),
                             r"chat_template' should be a string"),
    "template reads __class__": (with_meta("tokenizer.chat_template", STRING, _text(
        "{{ ''.__class__.__mro__[1].__subclasses__() }}")), r"Python internal"),
}


def _load_gguf_all(path: Path):
    """load_gguf, and for header-only files the metadata stages it would reach."""
    reader = read_gguf(path)
    if not reader.tensors:  # crafted metadata without weights: config and tokenizer only
        from specjax.checkpoints_tools.gguf_loader import config_from_gguf

        config_from_gguf(reader, str(path))
        tokenizer_from_gguf(reader, str(path))
        raise CheckpointError(f"{path}: (no tensors: metadata accepted)")
    return load_gguf(path)


@pytest.mark.parametrize("case", sorted(CRAFTED_GGUF))
def test_crafted_gguf_is_rejected_by_its_checks(tmp_path, case):
    data, pattern = CRAFTED_GGUF[case]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    rejects(_load_gguf_all, path, pattern)


def test_metadata_of_the_crafted_files_is_valid_when_unchanged(tmp_path):
    # the metadata cases above fail for the change they make, not for the base they share
    path = tmp_path / "llama.gguf"
    path.write_bytes(gguf_bytes(llama_kvs()))
    assert "metadata accepted" in attempt(_load_gguf_all, path)


def _gguf_damage_property(files, tmp_path_factory, mutation):
    base = files["gguf"].read_bytes()
    directory = tmp_path_factory.mktemp("gguf")
    path = directory / "damaged.gguf"
    path.write_bytes(apply(base, mutation))
    attempt(load_gguf, path)


def _gguf_header(files) -> int:
    return read_gguf(files["gguf"]).data_offset


def test_damaged_gguf_loads_or_fails_in_one_line(files, tmp_path_factory):
    size, header = files["gguf"].stat().st_size, _gguf_header(files)

    @campaign(120)
    @given(damage(size, header))
    def run(mutation):
        _gguf_damage_property(files, tmp_path_factory, mutation)

    run()


@pytest.mark.slow
def test_damaged_gguf_long_campaign(files, tmp_path_factory):
    size, header = files["gguf"].stat().st_size, _gguf_header(files)

    @campaign(2400)
    @given(damage(size, header))
    def run(mutation):
        _gguf_damage_property(files, tmp_path_factory, mutation)

    run()


def test_gguf_with_every_tensor_byte_flipped_still_parses_the_same_header(files, tmp_path):
    # flips in weight bytes cannot be detected (GGUF has no checksums); they must not
    # change what the header says
    data = bytearray(files["gguf"].read_bytes())
    header = _gguf_header(files)
    data[header:] = bytes(b ^ 0x5A for b in data[header:])
    path = tmp_path / "flipped.gguf"
    path.write_bytes(bytes(data))
    original, flipped = read_gguf(files["gguf"]), read_gguf(path)
    assert [(t.name, t.shape) for t in original.tensors] == \
        [(t.name, t.shape) for t in flipped.tensors]


# ----------------------------------------------------------------------------- safetensors


def safetensors_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


CRAFTED_SAFETENSORS = {
    "header length 2^63": (safetensors_bytes(b"{}", length=1 << 63), r"claims 9223372036854775808"),
    "header longer than the file": (safetensors_bytes(b"{}", length=4096), r"claims 4096 bytes"),
    "header not JSON": (safetensors_bytes(b"{not json"), r"not valid JSON"),
    "header nested 10^5 deep": (safetensors_bytes(b"[" * 100_000 + b"]" * 100_000),
                                r"not valid JSON"),
    "header is a list": (safetensors_bytes(b"[]"), r"not a JSON object"),
    "duplicated name": (safetensors_bytes(b'{"a": %s, "a": %s}' % (
        json.dumps(_entry()).encode(), json.dumps(_entry(offsets=(8, 16))).encode()), bytes(16)),
        r"'a' appears twice"),
    "overlapping offsets": (safetensors_bytes({"a": _entry(offsets=(0, 8)),
                                               "b": _entry(offsets=(4, 12))}, bytes(12)),
                            r"'a' and 'b' overlap"),
    "offsets past the end": (safetensors_bytes(
        {"a": _entry(shape=(1 << 20,), offsets=(0, 1 << 22))}, bytes(8)), r"run past the 8 data"),
    "10^12 elements in 8 bytes": (safetensors_bytes({"a": _entry(shape=(10**6, 10**6))}, bytes(8)),
                                  r"F32 \[1000000, 1000000\] \(4000000000000 bytes\) but its "
                                  r"data_offsets span 8"),
    "dtype does not fit the span": (safetensors_bytes({"a": _entry(dtype="F64")}, bytes(8)),
                                    r"\(16 bytes\) but its data_offsets span 8"),
    "unknown dtype": (safetensors_bytes({"a": _entry(dtype="F128")}, bytes(8)),
                      r"unsupported dtype 'F128'"),
    "negative dimension": (safetensors_bytes({"a": _entry(shape=(-2,))}, bytes(8)),
                           r"malformed shape"),
    "boolean dimension": (safetensors_bytes({"a": _entry(shape=(True, 2))}, bytes(8)),
                          r"malformed shape"),
    "reversed offsets": (safetensors_bytes({"a": _entry(offsets=(8, 0))}, bytes(8)),
                         r"malformed data_offsets"),
    "gap between tensors": (safetensors_bytes({"a": _entry(offsets=(8, 16))}, bytes(16)),
                            r"bytes 0..8 belong to no tensor"),
    "trailing bytes": (safetensors_bytes({"a": _entry()}, bytes(12)), r"cover 8 of the 12"),
    "extra entry field": (safetensors_bytes({"a": {**_entry(), "code": "x"}}, bytes(8)),
                          r"entry of tensor 'a'"),
    "metadata not strings": (safetensors_bytes({"__metadata__": {"a": 1}}), r"__metadata__"),
    "7 bytes": (b"\x02\0\0\0\0\0\0", r"too short"),
}


@pytest.fixture(scope="module")
def config_json(files) -> bytes:
    return (files["hf"] / "config.json").read_bytes()


@pytest.mark.parametrize("case", sorted(CRAFTED_SAFETENSORS))
def test_crafted_safetensors_is_rejected_by_its_checks(tmp_path, config_json, case):
    data, pattern = CRAFTED_SAFETENSORS[case]
    (tmp_path / "config.json").write_bytes(config_json)
    (tmp_path / "model.safetensors").write_bytes(data)
    rejects(lambda p: load_hf_directory(p.parent), tmp_path / "model.safetensors", pattern)


def _safetensors_header(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _safetensors_property(files, tmp_path_factory, mutation):
    base = (files["hf"] / "model.safetensors").read_bytes()
    directory = tmp_path_factory.mktemp("st")
    shutil.copyfile(files["hf"] / "config.json", directory / "config.json")
    (directory / "model.safetensors").write_bytes(apply(base, mutation))
    attempt(lambda p: load_hf_directory(p.parent), directory / "model.safetensors")


def test_damaged_safetensors_loads_or_fails_in_one_line(files, tmp_path_factory):
    file = files["hf"] / "model.safetensors"
    size, header = file.stat().st_size, _safetensors_header(file)

    @campaign(120)
    @given(damage(size, header))
    def run(mutation):
        _safetensors_property(files, tmp_path_factory, mutation)

    run()


@pytest.mark.slow
def test_damaged_safetensors_long_campaign(files, tmp_path_factory):
    file = files["hf"] / "model.safetensors"
    size, header = file.stat().st_size, _safetensors_header(file)

    @campaign(2400)
    @given(damage(size, header))
    def run(mutation):
        _safetensors_property(files, tmp_path_factory, mutation)

    run()


def test_config_claiming_millions_of_layers_costs_nothing(files, tmp_path):
    # found by the long GGUF campaign (a flipped bit in block_count): nothing may be sized
    # by the config before the tensors back it
    directory = _copy(files["hf"], tmp_path, "ckpt")
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 1 << 22
    (directory / "config.json").write_text(json.dumps(config))
    rejects(lambda p: load_hf_directory(p.parent), directory / "model.safetensors",
            r"missing tensor 'model.layers.3.", memory=8 * MIB)


# ----------------------------------------------------------------------------- shard index

INDEX = "model.safetensors.index.json"


def _sharded_copy(files, directory: Path) -> tuple[Path, dict, str]:
    """A copy of the sharded checkpoint in ``directory/ckpt``; returns (dir, index, a shard)."""
    checkpoint = _copy(files["sharded"], directory, "ckpt")
    index = json.loads((checkpoint / INDEX).read_text())
    return checkpoint, index, sorted(set(index["weight_map"].values()))[0]


def _rename_shard(index: dict, shard: str, new_name) -> dict:
    weight_map = {k: (new_name if v == shard else v) for k, v in index["weight_map"].items()}
    return {**index, "weight_map": weight_map}


@pytest.mark.parametrize("where", ["parent", "absolute", "dotdot-inside", "backslash"])
def test_index_naming_files_outside_the_directory_is_refused(files, tmp_path, where):
    checkpoint, index, shard = _sharded_copy(files, tmp_path)
    # a valid shard outside the directory: without the check, the load would succeed
    outside = shutil.move(checkpoint / shard, tmp_path / shard)
    (checkpoint / "sub").mkdir()
    name = {"parent": f"../{shard}", "absolute": str(outside),
            "dotdot-inside": f"sub/../../{shard}", "backslash": f"..\\{shard}"}[where]
    (checkpoint / INDEX).write_text(json.dumps(_rename_shard(index, shard, name)))
    rejects(lambda p: load_hf_directory(p.parent), checkpoint / INDEX,
            r"is outside the checkpoint directory", watch=tmp_path)


def test_index_naming_a_link_out_of_the_directory_is_refused(files, tmp_path):
    checkpoint, index, shard = _sharded_copy(files, tmp_path)
    outside = shutil.move(checkpoint / shard, tmp_path / shard)
    (checkpoint / shard).symlink_to(outside)
    rejects(lambda p: load_hf_directory(p.parent), checkpoint / INDEX,
            r"links to .* outside the checkpoint directory", watch=tmp_path)


def test_links_inside_the_directory_and_into_the_hub_cache_blobs_are_followed(files, tmp_path):
    # the HF cache keeps a snapshot's files as links into the repo's blobs/
    repo = tmp_path / "models--x--y"
    snapshot = _copy(files["sharded"], repo / "snapshots", "abc123")
    (repo / "blobs").mkdir()
    for file in snapshot.glob("*.safetensors"):
        blob = shutil.move(file, repo / "blobs" / file.name)
        file.symlink_to(Path("../../blobs") / file.name)
        assert blob.is_file()
    assert attempt(lambda p: load_hf_directory(p.parent), snapshot / INDEX, watch=tmp_path) is None


@pytest.mark.parametrize("edit,pattern", [
    (lambda index, shard: _rename_shard(index, shard, ["a", "b"]), r"not a file name"),
    (lambda index, shard: _rename_shard(index, shard, ""), r"shard name is empty"),
    (lambda index, shard: {"weight_map": [shard]}, r"no weight_map object"),
    (lambda index, shard: {}, r"no weight_map object"),
    (lambda index, shard: "[" * 100_000, r"unreadable"),
    (lambda index, shard: [index], r"expected a JSON object"),
])
def test_malformed_index_is_named(files, tmp_path, edit, pattern):
    checkpoint, index, shard = _sharded_copy(files, tmp_path)
    edited = edit(index, shard)
    (checkpoint / INDEX).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    rejects(lambda p: load_hf_directory(p.parent), checkpoint / INDEX, pattern)


def test_index_link_loop_and_huge_index_are_named(files, tmp_path):
    checkpoint, index, shard = _sharded_copy(files, tmp_path)
    (checkpoint / shard).unlink()
    (checkpoint / "loop").symlink_to(checkpoint / shard)
    (checkpoint / shard).symlink_to(checkpoint / "loop")
    rejects(lambda p: load_hf_directory(p.parent), checkpoint / INDEX, r"cannot be resolved")
    with open(checkpoint / INDEX, "r+b") as handle:  # sparse: 65 MiB of nothing
        handle.truncate(65 * MIB)
    rejects(lambda p: load_hf_directory(p.parent), checkpoint / INDEX, r"too large")


def _shard_names():
    parts = st.sampled_from(["..", ".", "sub", "x.safetensors", "/", "", "\\", "~", "%2e%2e"])
    return st.lists(parts, min_size=1, max_size=5).map("/".join)


def _index_property(files, tmp_path_factory, name):
    directory = tmp_path_factory.mktemp("index")
    checkpoint, index, shard = _sharded_copy(files, directory)
    (checkpoint / INDEX).write_text(json.dumps(_rename_shard(index, shard, name)))
    message = attempt(lambda p: load_hf_directory(p.parent), checkpoint / INDEX,
                      watch=directory)
    assert message is not None  # no generated name is the real shard's


def test_generated_shard_names_never_leave_the_directory(files, tmp_path_factory):
    @campaign(60)
    @given(_shard_names())
    def run(name):
        _index_property(files, tmp_path_factory, name)

    run()


# ----------------------------------------------------------------------------- orbax


def test_orbax_arrays_are_checked_before_restore(files, tmp_path, monkeypatch):
    # a config that does not match the stored arrays fails from their metadata, before
    # orbax allocates and reads anything
    import orbax.checkpoint as ocp

    checkpoint = _copy(files["orbax"], tmp_path, "ckpt")
    record = json.loads((checkpoint / "specjax_config.json").read_text())
    record["vocab_size"] = 10**9
    (checkpoint / "specjax_config.json").write_text(json.dumps(record))

    def restore(*args, **kwargs):
        raise AssertionError("restore ran before the stored arrays were checked")

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", restore)
    rejects(lambda p: load_orbax(p.parent), checkpoint / "params",
            r"parameter \['embed'\] has shape \(\d+, \d+\), expected \(1000000000, ",
            watch=checkpoint)


@pytest.mark.parametrize("shape,dtype,pattern", [
    ((1 << 20, 1 << 10), np.float32, r"declare \d{10} bytes but the directory holds 1024"),
    ((4, 8), np.int32, r"dtype int32, not floating-point"),
])
def test_orbax_declared_arrays_must_be_floats_the_files_justify(tmp_path, shape, dtype,
                                                                 pattern):
    from specjax.config import ModelConfig

    config = ModelConfig(architecture="gpt2", vocab_size=shape[0], hidden_size=shape[1],
                         num_layers=1, num_heads=1, num_kv_heads=1, head_dim=shape[1],
                         intermediate_size=4, max_position_embeddings=4)
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), param_shapes(config),
                        is_leaf=lambda x: isinstance(x, tuple))
    tree["embed"] = jax.ShapeDtypeStruct(shape, dtype)
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "data").write_bytes(bytes(1024))
    with pytest.raises(CheckpointError, match=pattern):
        orbax_io._check_stored_arrays(tree, config, tmp_path / "params")


def _orbax_files(checkpoint: Path) -> list[Path]:
    return sorted(p for p in checkpoint.rglob("*") if p.is_file())


def _orbax_property(files, tmp_path_factory, choice, action, mutation_seed):
    directory = tmp_path_factory.mktemp("orbax")
    checkpoint = _copy(files["orbax"], directory, "ckpt")
    candidates = _orbax_files(checkpoint)
    target = candidates[choice % len(candidates)]
    data = target.read_bytes()
    if action == "delete":
        target.unlink()
    elif action == "junk":
        target.write_bytes(np.random.default_rng(mutation_seed).bytes(max(len(data), 1)))
    elif data:
        rng = np.random.default_rng(mutation_seed)
        mutation = (("truncate", int(rng.integers(0, len(data)))) if action == "truncate" else
                    ("flip", int(rng.integers(0, len(data))), int(rng.integers(1, 256))))
        target.write_bytes(apply(data, mutation))
    attempt(load_orbax, checkpoint, named=str(checkpoint))


def test_damaged_orbax_loads_or_fails_in_one_line(files, tmp_path_factory):
    count = len(_orbax_files(files["orbax"]))

    @campaign(30)
    @given(st.integers(0, count - 1), st.sampled_from(("delete", "junk", "truncate", "flip")),
           st.integers(0, 2**32 - 1))
    def run(choice, action, seed):
        _orbax_property(files, tmp_path_factory, choice, action, seed)

    run()


@pytest.mark.slow
def test_damaged_orbax_long_campaign(files, tmp_path_factory):
    count = len(_orbax_files(files["orbax"]))

    @campaign(600)
    @given(st.integers(0, count - 1), st.sampled_from(("delete", "junk", "truncate", "flip")),
           st.integers(0, 2**32 - 1))
    def run(choice, action, seed):
        _orbax_property(files, tmp_path_factory, choice, action, seed)

    run()


# ----------------------------------------------------------------------------- n-gram tables


def _npz(path: Path, arrays: dict) -> Path:
    """Writes ``arrays`` as an uncompressed .npz (np.save each: objects are pickled)."""
    import io

    with zipfile.ZipFile(path, "w") as archive:
        for name, value in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, value, allow_pickle=True)
            archive.writestr(f"{name}.npy", buffer.getvalue())
    return path


def _npy_claiming(shape: tuple, dtype: str, data: bytes) -> bytes:
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


class _Canary:
    """Pickled into an object array: unpickling it would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture(scope="module")
def tables(files) -> dict:
    with np.load(files["ngram"]) as archive:
        return {name: archive[name] for name in archive.files}


def _ngram_cases(tables: dict, tmp: Path) -> dict:
    def edited(**changes):
        return {**tables, **changes}

    meta = tables["metadata"]
    return {
        "pickled objects": (edited(unigram_tokens=np.array([_Canary(tmp / "pwned")], object)),
                            r"unigram_tokens.npy holds Python objects"),
        "float64 scores": (edited(unigram_scores=tables["unigram_scores"].astype(np.float64)),
                           r"unigram_scores is float64, expected f2 or f4"),
        "int64 tokens": (edited(bigram_tokens=tables["bigram_tokens"].astype(np.int64)),
                         r"bigram_tokens is int64"),
        "uint32 index": (edited(bigram_index=tables["bigram_index"].astype(np.uint32)),
                         r"bigram_index is uint32, expected i4"),
        "1-D rows": (edited(bigram_tokens=tables["bigram_tokens"].reshape(-1)),
                     r"bigram_tokens has shape"),
        "extra member": (edited(payload=np.zeros(3)), r"unexpected member 'payload.npy'"),
        "metadata not an object": (edited(metadata=np.frombuffer(b"[1]", np.uint8)),
                                   r"format is not"),
        "metadata nested 10^5 deep": (edited(metadata=np.frombuffer(b"[" * 100_000, np.uint8)),
                                      r"metadata is not JSON"),
        "metadata missing": ({k: v for k, v in tables.items() if k != "metadata"},
                             r"no metadata"),
        "ids past the vocabulary": (edited(unigram_tokens=tables["unigram_tokens"] + 1000),
                                    r"ids outside"),
    }


def test_crafted_ngram_tables_are_rejected(tables, tmp_path):
    for case, (arrays, pattern) in _ngram_cases(tables, tmp_path).items():
        path = _npz(tmp_path / f"{case.replace(' ', '_')}.npz", arrays)
        rejects(load_ngram, path, pattern)
    assert not (tmp_path / "pwned").exists()


def test_npy_header_claiming_10_12_elements_is_refused_before_numpy_allocates(tmp_path):
    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("trigram_keys.npy", _npy_claiming((10**12, 2), "<i4", bytes(64)))
    rejects(load_ngram, path, r"trigram_keys.npy declares int32 \(1000000000000, 2\) "
            r"\(8000000000000 bytes\) but stores 64", memory=4 * MIB)


def test_zip_member_claiming_more_than_deflate_can_produce_is_refused(tables, tmp_path):
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, value in tables.items():
            archive.writestr(f"{name}.npy", _npy_claiming(value.shape, value.dtype.str,
                                                          value.tobytes()))
    data = bytearray(path.read_bytes())
    # the central directory's uncompressed size of the first member: 4 GiB - 2
    entry = data.index(b"PK\x01\x02")
    data[entry + 24:entry + 28] = struct.pack("<I", 0xFFFF_FFFE)
    path.write_bytes(bytes(data))
    rejects(load_ngram, path, r"claims 4294967294 bytes from \d+ compressed")


def test_duplicated_and_unknown_npy_versions_are_named(tables, tmp_path):
    import warnings

    path = tmp_path / "twice.npz"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate
        with zipfile.ZipFile(path, "w") as archive:
            for name in ("metadata", "metadata"):
                archive.writestr(f"{name}.npy", _npy_claiming((3,), "|u1", b"{}\n"))
    rejects(load_ngram, path, r"an array appears twice")
    version3 = _npy_claiming((3,), "|u1", b"{}\n").replace(b"NUMPY\x01", b"NUMPY\x03")
    with zipfile.ZipFile(tmp_path / "v3.npz", "w") as archive:
        archive.writestr("metadata.npy", version3)
    rejects(load_ngram, tmp_path / "v3.npz", r"\.npy version \(3, 0\)")


def _ngram_property(files, tmp_path_factory, mutation):
    directory = tmp_path_factory.mktemp("ngram")
    path = directory / "damaged.npz"
    path.write_bytes(apply(files["ngram"].read_bytes(), mutation))
    attempt(load_ngram, path)


def test_damaged_ngram_loads_or_fails_in_one_line(files, tmp_path_factory):
    size = files["ngram"].stat().st_size

    @campaign(150)
    @given(damage(size, size))
    def run(mutation):
        _ngram_property(files, tmp_path_factory, mutation)

    run()


@pytest.mark.slow
def test_damaged_ngram_long_campaign(files, tmp_path_factory):
    size = files["ngram"].stat().st_size

    @campaign(3000)
    @given(damage(size, size))
    def run(mutation):
        _ngram_property(files, tmp_path_factory, mutation)

    run()


# ----------------------------------------------------------------------------- draft assets


@pytest.fixture(scope="module")
def asset(files):
    from safetensors.numpy import load_file

    directory = files["asset"]
    record = json.loads((directory / "draft.json").read_text())
    tensors = load_file(str(directory / "draft.safetensors"))
    return directory, record, tensors, files["config"]


def test_the_valid_asset_passes(asset):
    check_draft_asset(*asset)


def _asset_rejects(asset, pattern, record=None, tensors=None):
    directory, base_record, base_tensors, config = asset
    with pytest.raises(CheckpointError) as info:
        check_draft_asset(directory, base_record if record is None else record,
                          base_tensors if tensors is None else tensors, config)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message, message
    assert re.search(pattern, message), message


def test_asset_tensor_problems_are_named(asset):
    _, record, tensors, config = asset
    wq = tensors["layers.wq"]
    for changes, pattern in [
        ({"layers.wq": None}, r"draft.safetensors: missing tensor 'layers.wq'"),
        ({"layers.extra": wq}, r"unexpected tensor 'layers.extra'"),
        ({"embed": wq}, r"unexpected tensor 'embed'"),
        ({"layers.wk": tensors["layers.wk"].swapaxes(1, 2)},  # [1, d, K*D] -> [1, K*D, d]
         r"'layers.wk' has shape \(1, 32, 64\), expected \(1, 64, 32\)"),
        ({"layers.wq": wq.astype(np.float32)}, r"'layers.wq' is float32, expected float16"),
        ({"head_tokens": np.array([3, 5, 7, 11], np.int64)}, r"head_tokens is int64"),
        ({"head_tokens": np.array([[3, 5], [7, 11]], np.int32)}, r"1-D int32"),
        ({"head_tokens": np.array([5, 3, 7, 11], np.int32)}, r"sorted, distinct"),
        ({"head_tokens": np.array([3, 3, 7, 11], np.int32)}, r"sorted, distinct"),
        ({"head_tokens": np.array([3, 5, 7, 10**6], np.int32)}, r"sorted, distinct ids in"),
        ({"head_tokens": np.array([-1, 5, 7, 11], np.int32)}, r"sorted, distinct ids in"),
        ({"head_tokens": np.array([3, 5, 7], np.int32)}, r"holds 3 ids, draft.json says 4"),
        ({"head_tokens": None}, r"lacks a head_tokens tensor"),
    ]:
        edited = {k: v for k, v in {**tensors, **changes}.items() if v is not None}
        _asset_rejects(asset, pattern, tensors=edited)


def test_asset_record_problems_are_named(asset):
    _, record, tensors, config = asset
    for changes, pattern in [
        ({"num_layers": "1"}, r"draft.json: num_layers must be a positive integer"),
        ({"num_layers": True}, r"num_layers must be"),
        ({"num_layers": 0}, r"num_layers must be"),
        ({"num_layers": 2}, r"missing tensor|has shape"),
        ({"embed_fingerprint": 5}, r"embed_fingerprint must be 16 hex digits"),
        ({"embed_fingerprint": "../../etc/passwd"}, r"embed_fingerprint"),
        ({"base_config": None}, r"base_config must be an object"),
        ({"base_config": {"hidden_size": 7, "vocab_size": config.vocab_size}},
         r"base_config.hidden_size is 7, but the target model has"),
        ({"base_config": {"hidden_size": config.hidden_size}}, r"base_config.vocab_size is None"),
        ({"head_tokens": None}, r"says head_tokens None but the file has"),
        ({"head_tokens": "4"}, r"head_tokens must be null or a positive integer"),
    ]:
        _asset_rejects(asset, pattern, record={**record, **changes})
    _asset_rejects(asset, r"expected a JSON object, found list", record=[record])


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**40) | st.floats()
                     | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def test_generated_asset_records_pass_only_when_valid(asset):
    directory, record, tensors, config = asset

    def integer(value, want):
        return type(value) is int and value == want

    valid = {
        "num_layers": lambda v: integer(v, record["num_layers"]),
        "embed_fingerprint": lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{16}", v),
        "head_tokens": lambda v: integer(v, record["head_tokens"]),
        "base_config": lambda v: isinstance(v, dict)
        and integer(v.get("hidden_size"), config.hidden_size)
        and integer(v.get("vocab_size"), config.vocab_size),
        "note": lambda v: True,  # provenance is free-form
    }

    @campaign(200)
    @given(st.sampled_from(sorted(valid)), _JSON)
    def run(field, value):
        try:
            check_draft_asset(directory, {**record, field: value}, tensors, config)
            passed = True
        except CheckpointError as error:
            assert "\n" not in str(error) and str(directory) in str(error)
            passed = False
        assert passed == bool(valid[field](value)), (field, value)

    run()


def test_generated_asset_tensors_pass_only_when_valid(asset):
    directory, record, tensors, config = asset
    names = sorted(tensors)

    @campaign(150)
    @given(st.sampled_from(names), st.sampled_from(("float16", "float32", "int32", "int64")),
           st.lists(st.integers(0, 40), min_size=0, max_size=3))
    def run(name, dtype, shape):
        original = tensors[name]
        value = (np.zeros(shape, dtype) if name != "head_tokens"
                 else np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape))
        try:
            check_draft_asset(directory, record, {**tensors, name: value}, config)
        except CheckpointError as error:
            assert "\n" not in str(error) and "draft.safetensors" in str(error)
        else:
            assert value.dtype == original.dtype and value.shape == original.shape
            if name == "head_tokens":
                assert np.all(np.diff(value) > 0)

    run()


# ----------------------------------------------------------------------------- the script


def test_fuzz_loaders_script_writes_a_summary_per_loader(tmp_path):
    """``benchmarks/fuzz_loaders.py`` at 3 cases a loader (its own campaigns, seeded): every
    loader is fuzzed, nothing escapes, and the JSON records the machine and git state."""
    from conftest import load_benchmark

    script = load_benchmark("fuzz_loaders")
    out = tmp_path / "fuzz.json"
    assert script.main(["--cases", "3", "--seed", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "fuzz_loaders" and isinstance(result["dirty_tree"], bool)
    assert set(result["loaders"]) == {"gguf", "safetensors", "shard index", "orbax", "ngram",
                                      "draft asset"}
    for name, loader in result["loaders"].items():
        assert loader["violations"] == [] and not loader.get("escaped"), name
        assert loader["cases"] == loader["loaded"] + loader["rejected"], name
    assert "commit" in result["machine"]["git"]
