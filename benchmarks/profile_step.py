"""Where a decode/verify step's time goes, per method and dtype, with random weights.

One command, no checkpoint (random weights for a named config), from the repository root:

    python benchmarks/profile_step.py                              # smollm2-135m, every method
    python benchmarks/profile_step.py --model gpt2-large --dtypes bfloat16 --methods ar,tree
    python benchmarks/profile_step.py --model tiny --new-tokens 8 --prompt-length 20  # CPU check
    python benchmarks/profile_step.py --methods ar,tree --tree-budget 16  # a 16-node tree step

For every method (``ar``, ``ngram``, ``spec``, ``tree``, ``staged``) and dtype it
compiles the whole generation through the public API (:func:`specjax.generate`, which
caches the executables in :mod:`specjax.decode`) and reports, per **target pass** (one
step; the prefill is subtracted by also running the same executable with
``max_new_tokens=1``, a traced value):

* ``wall_ms_per_pass``: wall time of the compiled loop;
* from a :mod:`jax.profiler` trace (``--no-trace`` skips it): on a GPU, the device kernels
  (``device_ms_per_pass``, ``kernels_per_pass``, ``memcpy_per_pass`` with bytes where the
  trace records them, ``top_kernels``); on the CPU, the XLA thunks the runtime executed
  (``thunks_per_pass``, ``top_thunks``), the CPU's closest analogue of kernel launches;
* from the compiled program's HLO (``executable.as_text()``, the only part that means the
  same on every backend, since it is read from the program XLA built for *this* backend):
  per step (the body of the decode ``while`` loop, nested loops counted once and also
  weighted by their known trip counts), the operations that become kernels or thunks
  (fusions, custom calls such as the Pallas kernels, copies, dynamic-update-slices,
  gathers, scatters, sorts, ...), the copies with their bytes, the **cache-sized copies
  and writes** (an operation that produces a whole KV cache, or one layer of it, other
  than an in-place update), and the program's parameter / output / donated bytes.

Models (``--model``): ``tiny`` (3 layers, for tests), ``smollm2-135m``, ``gpt2``,
``gpt2-medium``, ``gpt2-large``, ``gpt2-xl`` and ``llama-7b`` (Llama-2-7B's shape, MHA
32 x 128, 32 layers). The draft of ``spec``/``tree``/``staged`` is the target's first
layers (``--draft-layers``, default 2); the n-gram tables of ``ngram``/``staged`` are fitted
to a random token corpus. Random weights accept few drafted tokens, so compare methods *per
target pass* (the step's cost), not per token. Each method runs at the backend's defaults
(:data:`specjax.methods.options.BACKEND_DEFAULTS`) but for ``--tree-budget``; every row
records the options its method ran with (``options``).

:func:`compile_step_programs` is the one place that builds a method's programs; everything
else reads what it returns.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

METHODS = ("ar", "ngram", "spec", "tree", "staged")
DRAFT_METHODS = ("spec", "tree", "staged")
NGRAM_METHODS = ("ngram", "staged")
BUDGET_METHODS = ("tree", "staged")  # the methods with a tree_budget option


# ----------------------------------------------------------------------------- models


def model_configs() -> dict:
    """Named configs: the presets of :mod:`specjax.config`, a Llama-7B shape and ``tiny``."""
    from specjax import config

    configs = {name: factory() for name, factory in config.PRESETS.items()}
    configs["llama-7b"] = config.ModelConfig(
        architecture="llama", vocab_size=32000, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008,
        max_position_embeddings=4096, norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_ids=(2,), bos_token_id=1)
    # Dimensions chosen distinct, so that no activation has a cache's shape by accident.
    configs["tiny"] = config.ModelConfig(
        architecture="llama", vocab_size=97, hidden_size=96, num_layers=3, num_heads=6,
        num_kv_heads=3, head_dim=16, intermediate_size=160, max_position_embeddings=1024,
        eos_token_ids=(2,))
    return configs


def random_model(name: str, dtype: str, seed: int = 0, fused: bool = False):
    """A :class:`specjax.Model` with random weights of the named config (no tokenizer);
    ``fused``: with fused q|k|v and gate|up projections (:func:`specjax.models.fuse_projections`)."""
    import specjax
    from specjax import models

    configs = model_configs()
    if name not in configs:
        raise SystemExit(f"unknown model {name!r}; expected one of {', '.join(configs)}")
    config = configs[name]
    params = models.init_params(config, jax.random.PRNGKey(seed), jnp.dtype(dtype))
    if fused:
        params = models.fuse_projections(config, params)
    # Not a known model's name: nothing shipped (draft, n-gram tables) is looked up for it.
    return specjax.Model(config, params, None, f"random-{name}")


def random_ngram_tables(vocab_size: int, seed: int = 0, tokens: int = 20000):
    """N-gram tables fitted to a random corpus (the stage-2 drafter's shape and cost)."""
    from specjax.training.ngram_build import build_ngram

    rng = np.random.default_rng(seed)
    # A small alphabet repeats bigrams and trigrams, so every table has rows.
    corpus = rng.integers(0, min(vocab_size, 512), tokens)
    return build_ngram([corpus], vocab_size).tables


def method_options(method: str, model, draft_layers: int, tables,
                   tree_budget: int | None = None, attn_impl="auto") -> dict:
    """Keyword arguments of :func:`specjax.generate` for ``method`` on a random model;
    ``tree_budget`` applies to :data:`BUDGET_METHODS` (``None``: the backend's default);
    ``attn_impl``: a :class:`specjax.KernelOptions`, or an attention implementation's name
    (the backend's default options with that attention)."""
    import jax
    import specjax
    from specjax.methods.options import backend_of

    kernels = attn_impl
    if isinstance(kernels, str):
        kernels = specjax.KernelOptions.default(backend_of(jax.default_backend())).replace(
            attention=attn_impl)
    options = {"method": method, "kernels": kernels}
    if method in DRAFT_METHODS:
        # At most all but one of the target's layers, so that the draft is a smaller model.
        layers = max(1, min(draft_layers, model.config.num_layers - 1))
        options["draft"] = model.first_layers(layers)
    if method in NGRAM_METHODS:
        options["ngram"] = tables
    if tree_budget is not None and method in BUDGET_METHODS:
        options["tree_budget"] = tree_budget
    return options


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class StepPrograms:
    """What :func:`compile_step_programs` builds for one method.

    Attributes:
      loop: the compiled whole generation (prefill + ``while_loop`` over steps).
      step: the compiled single step of the streaming driver (state donated), or ``None``.
      run: ``run(max_new_tokens) -> (seconds, target passes, draft passes)`` runs the
        compiled loop (no compilation) and blocks on the result.
      compile_seconds: compile time of the loop program.
      options: the method's options as the API resolved them (its ``stats["options"]``:
        the backend's defaults with the given options applied).
    """

    loop: object
    step: object | None
    run: object
    compile_seconds: float
    options: dict


def compile_step_programs(model, prompt: list[int], options: dict, max_new_tokens: int,
                          with_step: bool = True) -> StepPrograms:
    """Compiles ``method``'s programs through the public API and returns them.

    This is the one function that knows how the API builds programs: it clears
    :data:`specjax.decode._EXECUTABLES`, calls :func:`specjax.generate` (which compiles
    :func:`specjax.decode.run_to_completion` for the request) and, with ``with_step``,
    pulls the first item of :func:`specjax.stream_generate` (which compiles the donated
    step), then picks the executables out of the cache by function.
    """
    import specjax
    from specjax import decode

    decode.clear_compiled()
    kwargs = dict(options, stop=[])  # exactly max_new_tokens: random weights hit EOS

    def run(new_tokens: int):
        result = specjax.generate(model, prompt, max_new_tokens=new_tokens, **kwargs)
        return (result.stats["seconds"], result.stats["target_calls"],
                result.stats["draft_calls"])

    first = specjax.generate(model, prompt, max_new_tokens=max_new_tokens, **kwargs)
    step = None
    if with_step:
        stream = specjax.stream_generate(model, prompt, max_new_tokens=max_new_tokens, **kwargs)
        next(stream)
        stream.close()
    by_function = {key[0].__name__: executable
                   for key, executable in decode._EXECUTABLES.items()}
    if with_step:
        step = by_function.get("_step")
    return StepPrograms(loop=by_function["run_to_completion"], step=step, run=run,
                        compile_seconds=first.stats["compile_seconds"],
                        options=first.stats["options"])


# ----------------------------------------------------------------------------- HLO text

_ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|to_apply|condition|body|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Instructions that never become a kernel or thunk of their own.
FREE_OPCODES = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
                "add-dependency", "opt-barrier", "partition-id", "replica-id", "copy-done",
                "async-done", "async-update", "send-done", "recv-done", "domain"}
CONTROL_OPCODES = {"while", "conditional", "call"}
IN_PLACE_ROOTS = {"dynamic-update-slice", "scatter"}
# A fusion made of these only moves data (a slice or layout change written to a new buffer):
# on a GPU XLA often runs such a fusion, or a plain contiguous slice, as a memcpy.
DATA_MOVEMENT = {"dynamic-slice", "slice", "bitcast", "reshape", "transpose", "copy",
                 "concatenate", "pad", "broadcast", "gather", "convert"}


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: str  # the result shape text, e.g. "f32[2,128,2,16]{3,2,1,0}" or a tuple
    operands: list[str]
    attributes: str
    root: bool

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, dims) of every array in the result shape."""
        return [(dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in _ARRAY.findall(self.shape)]

    @property
    def bytes(self) -> int:
        return sum(_ITEM_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in self.arrays)

    def called(self) -> dict[str, list[str]]:
        """Computations this instruction calls, by role (``body``, ``calls``, ``branch``...)."""
        out: dict[str, list[str]] = collections.defaultdict(list)
        for role, name in _CALLED.findall(self.attributes):
            out[role].append(name)
        for group in _BRANCHES.findall(self.attributes):
            out["branch"] += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
        return out

    @property
    def trip_count(self) -> int | None:
        match = _TRIP_COUNT.search(self.attributes)
        return int(match.group(1)) if match else None


@dataclasses.dataclass
class HloModule:
    computations: dict[str, list[Instruction]]
    entry: str
    header: str  # the ``HloModule`` line (input/output aliasing)
    entry_signature: str

    def root(self, computation: str) -> Instruction:
        instructions = self.computations[computation]
        return next((i for i in instructions if i.root), instructions[-1])


def _split_balanced(text: str) -> tuple[str, str]:
    """``text`` starts with '(': returns (the balanced group, the rest)."""
    depth = 0
    for index, char in enumerate(text):
        depth += char == "("
        depth -= char == ")"
        if depth == 0:
            return text[: index + 1], text[index + 1:]
    return text, ""


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    root, name, rest = match.groups()
    rest = rest.strip()
    if rest.startswith("("):
        shape, rest = _split_balanced(rest)
    else:
        shape, _, rest = rest.partition(" ")
    rest = rest.strip()
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    opcode = opcode_match.group(1)
    operands_text, attributes = _split_balanced(rest[len(opcode):])
    operands = re.findall(r"%([\w.\-]+)", operands_text)
    return Instruction(name, opcode, shape, operands, attributes, bool(root))


def parse_hlo(text: str) -> HloModule:
    """Parses the text of a compiled HLO module (``executable.as_text()``)."""
    computations: dict[str, list[Instruction]] = {}
    entry, header, signature, current = None, "", "", None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            header = line
            continue
        if line and not line[0].isspace():
            match = _HEADER.match(line)
            if match:
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry, signature = current, line
            elif line.startswith("}"):
                current = None
            continue
        if current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry, header, signature)


def _fused_root_opcodes(module: HloModule, instruction: Instruction) -> list[str]:
    """Opcodes a fusion writes its outputs with (the operands of a tuple root)."""
    called = instruction.called().get("calls", [])
    if not called or called[0] not in module.computations:
        return []
    root = module.root(called[0])
    if root.opcode != "tuple":
        return [root.opcode]
    by_name = {i.name: i for i in module.computations[called[0]]}
    return [by_name[o].opcode if o in by_name else "?" for o in root.operands]


_LAYOUT_ONLY = {"bitcast", "reshape", "copy"}


def _moves_data_only(module: HloModule, instruction: Instruction) -> bool:
    """A fusion whose output is a slice, gather, transpose, concatenation or pad of its
    inputs (index arithmetic on scalars aside): it writes data it did not compute."""
    called = instruction.called().get("calls", [])
    if not called or called[0] not in module.computations:
        return False
    by_name = {i.name: i for i in module.computations[called[0]]}
    node = module.root(called[0])
    while node.opcode in _LAYOUT_ONLY and node.operands and node.operands[0] in by_name:
        node = by_name[node.operands[0]]
    if node.opcode not in DATA_MOVEMENT - _LAYOUT_ONLY - {"convert", "broadcast"}:
        return False
    # Every array-valued instruction feeding it moves data too (no arithmetic on the data).
    arrays = [i for i in by_name.values() if any(dims for _, dims in i.arrays)
              and i.opcode not in FREE_OPCODES]
    return all(i.opcode in DATA_MOVEMENT for i in arrays)


def _category(module: HloModule, instruction: Instruction) -> str:
    if instruction.opcode == "fusion":
        roots = _fused_root_opcodes(module, instruction)
        if roots and all(r in IN_PLACE_ROOTS for r in roots):
            return "fusion(in-place update)"
        if _moves_data_only(module, instruction):
            return "fusion(data movement)"
        return "fusion"
    if instruction.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
        return f"custom-call({target.group(1) if target else '?'})"
    if instruction.opcode == "copy-start":
        return "copy"
    return instruction.opcode


def _is_cache_shaped(dims: tuple[int, ...], cache_shapes) -> bool:
    """A whole cache [L, S, K, D] or one layer [S, K, D] (size-1 axes ignored), the layer in
    any axis order (a transposed copy is a copy)."""
    def squeeze(shape):
        return tuple(d for d in shape if d != 1)

    dims = squeeze(dims)
    for shape in cache_shapes:
        if dims == squeeze(shape) or sorted(dims) == sorted(squeeze(shape[1:])):
            return True
    return False


def _writes_whole_cache(module: HloModule, instruction: Instruction, cache_shapes) -> bool:
    """Produces a cache-shaped array (a whole cache or one layer of it) by writing all of it:
    anything but an in-place update (dynamic-update-slice, scatter, or a fusion rooted in
    them), which XLA performs on the operand's buffer. Explicit copies are counted apart."""
    if instruction.opcode in FREE_OPCODES | CONTROL_OPCODES | {"copy", "copy-start"}:
        return False
    if instruction.opcode in IN_PLACE_ROOTS:
        return False
    if instruction.opcode == "fusion":
        roots = _fused_root_opcodes(module, instruction)
        arrays = instruction.arrays
        if len(roots) == len(arrays):
            return any(r not in IN_PLACE_ROOTS and _is_cache_shaped(a[1], cache_shapes)
                       for r, a in zip(roots, arrays))
    return any(_is_cache_shaped(dims, cache_shapes) for _, dims in instruction.arrays)


@dataclasses.dataclass
class _Tally:
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    weighted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    copies: list = dataclasses.field(default_factory=list)
    moves: list = dataclasses.field(default_factory=list)
    cache_copies: list = dataclasses.field(default_factory=list)
    cache_writes: list = dataclasses.field(default_factory=list)
    loops: list = dataclasses.field(default_factory=list)
    unknown_trip_counts: int = 0


def _walk(module: HloModule, computation: str, tally: _Tally, cache_shapes, weight: float,
          depth: int = 0, seen: tuple = ()) -> int:
    """Counts the kernel-like instructions of ``computation`` and what it calls through
    while/conditional/call (fusion bodies are one kernel each). Returns the static count."""
    if computation in seen or computation not in module.computations:
        return 0
    seen = seen + (computation,)
    static = 0
    for instruction in module.computations[computation]:
        called = instruction.called()
        if instruction.opcode == "while":
            trips = instruction.trip_count
            if trips is None:
                tally.unknown_trip_counts += 1
            body_ops = _walk(module, called["body"][0], tally, cache_shapes,
                             weight * (trips or 1), depth + 1, seen)
            body_ops += _walk(module, called["condition"][0], tally, cache_shapes,
                              weight * ((trips or 1) + 1), depth + 1, seen)
            tally.loops.append({"name": instruction.name, "depth": depth + 1,
                                "trip_count": trips, "ops_per_iteration": body_ops})
            tally.ops["while"] += 1
            static += body_ops
            continue
        if instruction.opcode == "conditional":
            tally.ops["conditional"] += 1
            for branch in called["branch"] + called["true_computation"] + \
                    called["false_computation"]:
                static += _walk(module, branch, tally, cache_shapes, weight, depth, seen)
            continue
        if instruction.opcode == "call":
            for target in called["to_apply"] + called["calls"]:
                static += _walk(module, target, tally, cache_shapes, weight, depth, seen)
            continue
        if instruction.opcode in FREE_OPCODES:
            continue
        category = _category(module, instruction)
        tally.ops[category] += 1
        tally.weighted[category] += weight
        static += 1
        record = {"name": instruction.name, "shape": instruction.shape.split("{")[0],
                  "bytes": instruction.bytes, "times_per_step": weight}
        if category in ("fusion(data movement)", "dynamic-slice", "slice", "transpose",
                        "concatenate", "pad", "gather"):
            tally.moves.append(record)
        if category == "copy":
            tally.copies.append(record)
            if any(_is_cache_shaped(dims, cache_shapes) for _, dims in instruction.arrays):
                tally.cache_copies.append(record)
        elif _writes_whole_cache(module, instruction, cache_shapes):
            tally.cache_writes.append({**record, "opcode": category})
    return static


def _signature_bytes(module: HloModule) -> tuple[list[int], int]:
    """(bytes of each ENTRY parameter, bytes of the output)."""
    match = _HEADER.match(module.entry_signature)
    params_text, result_text = (match.group(3), match.group(4)) if match else ("", "")
    params = []
    for part in re.split(r",\s*(?=[\w.\-]+:)", params_text):
        arrays = _ARRAY.findall(part)
        params.append(sum(_ITEM_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x)
                          for d, dims in arrays))
    output = sum(_ITEM_BYTES.get(d, 4) * math.prod(int(x) for x in dims.split(",") if x)
                 for d, dims in _ARRAY.findall(result_text))
    return params, output


def _aliased_parameters(module: HloModule) -> list[int]:
    """ENTRY parameter numbers whose buffers the outputs reuse (donation)."""
    match = re.search(r"input_output_alias=\{(.*?)\}\s*(,\s*\w+=|$)", module.header)
    if not match:
        return []
    return sorted({int(p) for p in re.findall(r":\s*\((\d+),", match.group(1))})


def step_loop(module: HloModule) -> Instruction | None:
    """The decode loop of a whole-generation program: ENTRY's last ``while`` without a known
    trip count (scans over layers have one)."""
    loops = [i for i in module.computations[module.entry] if i.opcode == "while"]
    unknown = [i for i in loops if i.trip_count is None]
    return (unknown or loops or [None])[-1]


def analyze_program(text: str, cache_shapes=(), step: str = "loop") -> dict:
    """Counts of a compiled program, per step.

    Args:
      text: ``executable.as_text()``.
      cache_shapes: KV cache shapes ``(layers, capacity, kv_heads, head_dim)`` (target and
        draft); an array of one of these shapes, or of one layer of it, is *cache-sized*.
      step: ``"loop"``: the step is the body of the decode ``while`` loop
        (:func:`step_loop`); ``"entry"``: the program is one step (the streaming driver's).
    Returns:
      A JSON-ready dict: ``step_ops`` (kernel-like instructions in the step, nested loop
      bodies once), ``step_ops_by_kind``, ``step_ops_weighted`` (nested loops weighted by
      known trip counts: the count a run executes per step), ``loops``, ``copies`` /
      ``copy_bytes_per_step``, ``data_movement_ops`` / ``data_movement_bytes_per_step``
      (slices, transposes, concatenations, pads, gathers and fusions made only of them:
      candidates for the memcpys of a GPU profile, e.g. a layer's weights sliced out of
      the stacked [L, ...] parameters for a matmul that cannot read them in place),
      ``cache_copies`` and ``cache_writes`` (lists), ``module`` totals,
      ``parameter_bytes``, ``output_bytes``, ``donated_parameters``.
    """
    module = parse_hlo(text)
    cache_shapes = [tuple(int(d) for d in s) for s in cache_shapes]
    if step == "loop":
        loop = step_loop(module)
        if loop is None:
            raise ValueError("no while loop in the program: pass step='entry'")
        root_computations = [loop.called()["body"][0], loop.called()["condition"][0]]
    else:
        root_computations = [module.entry]
    tally = _Tally()
    ops = sum(_walk(module, c, tally, cache_shapes, 1.0) for c in root_computations)
    module_ops = collections.Counter()
    for instructions in module.computations.values():
        module_ops.update(i.opcode for i in instructions)
    params, output = _signature_bytes(module)
    return {
        "step_ops": ops,
        "step_ops_weighted": round(sum(tally.weighted.values()), 1),
        "step_ops_by_kind": dict(tally.ops.most_common()),
        "step_ops_weighted_by_kind": {k: round(v, 1) for k, v in tally.weighted.most_common()},
        "loops": tally.loops,
        "loops_with_unknown_trip_count": tally.unknown_trip_counts,
        "copies": len(tally.copies),
        "copy_bytes_per_step": int(sum(c["bytes"] * c["times_per_step"] for c in tally.copies)),
        "largest_copies": sorted(tally.copies, key=lambda c: -c["bytes"])[:10],
        "data_movement_ops": len(tally.moves),
        "data_movement_bytes_per_step": int(sum(m["bytes"] * m["times_per_step"]
                                                for m in tally.moves)),
        "largest_data_movements": sorted(tally.moves, key=lambda m: -m["bytes"])[:10],
        "cache_copies": tally.cache_copies,
        "cache_writes": tally.cache_writes,
        "cache_sized_copies_per_step": sum(c["times_per_step"] for c in tally.cache_copies)
        + sum(c["times_per_step"] for c in tally.cache_writes),
        "module": {"computations": len(module.computations),
                   "fusions": module_ops["fusion"], "custom_calls": module_ops["custom-call"],
                   "copies": module_ops["copy"] + module_ops["copy-start"],
                   "while_loops": module_ops["while"],
                   "instructions": sum(module_ops.values())},
        "parameter_bytes": sum(params),
        "output_bytes": output,
        "donated_parameters": _aliased_parameters(module),
        "donated_bytes": sum(params[i] for i in _aliased_parameters(module) if i < len(params)),
    }


# ----------------------------------------------------------------------------- traces

# Trace lines that repeat the kernels (per HLO op or module) rather than being kernels.
_DERIVED_LINES = ("xla ops", "xla modules", "steps", "tensorflow ops", "tensorflow name scope",
                  "source code", "framework", "launch stats", "xla traceme")
_CPU_NOT_THUNKS = ("end: ", "ThreadpoolListener", "ThunkExecutor", "ynn-worker")
_BYTES = re.compile(r"(?:size|bytes|num_bytes)[:=\s\"]+(\d+)", re.IGNORECASE)


def read_trace(directory: str) -> list[dict]:
    """The events of the newest ``*.trace.json.gz`` under ``directory``."""
    files = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
    with gzip.open(files[-1]) as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(events: list[dict]) -> tuple[str, list[dict], dict]:
    """(kind, events, where): the device kernels of a GPU/TPU trace (kind ``"device"``), else
    the XLA CPU runtime's thunks (kind ``"cpu_thunk"``). ``where`` names the processes and
    threads read, so a surprising count can be checked against the trace."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device_pids = {pid for pid, name in processes.items()
                   if re.search(r"/device:(GPU|TPU)", name)}
    if device_pids:
        def line(e):
            return threads.get((e["pid"], e.get("tid")), "").lower()

        chosen = [e for e in complete if e["pid"] in device_pids
                  and not any(line(e).startswith(d) for d in _DERIVED_LINES)]
        streams = [e for e in chosen if "stream" in line(e)]
        chosen = streams or chosen
        names = sorted({threads.get((e["pid"], e.get("tid")), "?") for e in chosen})
        return "device", chosen, {"processes": sorted(processes[p] for p in device_pids),
                                  "threads": names}
    cpu_threads = {key for key, name in threads.items() if "PjRtCpuClient" in name
                   or "XLAEigen" in name}
    chosen = [e for e in complete if (e["pid"], e.get("tid")) in cpu_threads
              and not e["name"].startswith(_CPU_NOT_THUNKS)]
    return "cpu_thunk", chosen, {"threads": sorted({threads[k] for k in cpu_threads})}


def event_bytes(event: dict) -> int | None:
    """Bytes a memcpy event moved, where the trace records them."""
    for value in (event.get("args") or {}).values():
        match = _BYTES.search(str(value)) if not isinstance(value, (int, float)) else None
        if match:
            return int(match.group(1))
    args = event.get("args") or {}
    for key in ("bytes", "num_bytes", "size"):
        if isinstance(args.get(key), (int, float)):
            return int(args[key])
    return None


def summarize_kernels(events: list[dict]) -> dict:
    """Counts, total microseconds, memcpy count/bytes and per-name totals of kernel events."""
    by_name = collections.Counter()
    counts = collections.Counter()
    memcpy, memcpy_bytes, memcpy_bytes_known = 0, 0, 0
    for event in events:
        name = event["name"][:120]
        by_name[name] += float(event["dur"])
        counts[name] += 1
        if "memcpy" in name.lower() or "memset" in name.lower():
            memcpy += 1
            size = event_bytes(event)
            if size is not None:
                memcpy_bytes += size
                memcpy_bytes_known += 1
    return {"count": len(events), "us": sum(by_name.values()), "memcpy": memcpy,
            "memcpy_bytes": memcpy_bytes, "memcpy_with_bytes": memcpy_bytes_known,
            "by_name": by_name, "counts": counts}


def traced(function, directory: str):
    """Runs ``function()`` under :func:`jax.profiler.trace`; returns (its result, events)."""
    with jax.profiler.trace(directory):
        result = function()
    return result, read_trace(directory)


def trace_report(events_long: list[dict], events_short: list[dict], passes: int,
                 top: int = 15) -> dict:
    """Per target pass, from the traces of a long run and of the prefill alone (the same
    program, ``passes`` fewer target passes): kernels (or CPU thunks), their time, memcpy
    count and bytes, and the ``top`` kernels by their time per pass (a kernel of the
    prefill alone, such as its matmuls over the prompt, ranks by its ~0 ms per pass, not by
    its time in the long run)."""
    kind, long_events, where = kernel_events(events_long)
    _, short_events, _ = kernel_events(events_short)
    long_k, short_k = summarize_kernels(long_events), summarize_kernels(short_events)
    label = "kernels" if kind == "device" else "thunks"
    per_pass = {name: (us - short_k["by_name"].get(name, 0.0)) / 1e3 / max(passes, 1)
                for name, us in long_k["by_name"].items()}
    ranked = sorted(per_pass, key=lambda name: (-per_pass[name], name))[:top]
    return {
        "kind": kind, "where": where,
        f"{label}_per_pass": _per_pass(long_k, short_k, passes, "count"),
        f"{'device' if kind == 'device' else 'thunk'}_ms_per_pass":
            None if passes <= 0 else (long_k["us"] - short_k["us"]) / 1e3 / passes,
        "memcpy_per_pass": _per_pass(long_k, short_k, passes, "memcpy"),
        "memcpy_bytes_per_pass": _per_pass(long_k, short_k, passes, "memcpy_bytes"),
        "memcpy_events_with_bytes": long_k["memcpy_with_bytes"],
        f"top_{label}": [
            {"name": name, "ms_per_pass": round(per_pass[name], 5),
             "calls_per_pass": round((long_k["counts"][name] - short_k["counts"].get(name, 0))
                                     / max(passes, 1), 3)}
            for name in ranked],
    }


# ----------------------------------------------------------------------------- one method


def _per_pass(long: dict, short: dict, passes: int, key: str) -> float | None:
    if passes <= 0:
        return None
    return (long[key] - short[key]) / passes


def profile_method(model, method: str, prompt: list[int], new_tokens: int, repeats: int,
                   draft_layers: int, tables, trace: bool, hlo_dir: str | None,
                   top: int = 15, tree_budget: int | None = None,
                   attn_impl="auto", with_step: bool = True) -> dict:
    """One row of the report (see the module docstring); ``with_step=False`` skips the
    streaming step's program (one compile fewer, no ``hlo_step_program``)."""
    options = method_options(method, model, draft_layers, tables, tree_budget, attn_impl)
    programs = compile_step_programs(model, prompt, options, new_tokens, with_step=with_step)
    # The prefill (and first sample) alone, with the same executable: max_new_tokens=1.
    # Interleaved, fastest of each kept: drift hits both alike.
    long_runs, short_runs = [], []
    for _ in range(repeats):
        long_runs.append(programs.run(new_tokens))
        short_runs.append(programs.run(1))
    long_s, passes_long, draft_long = min(long_runs)
    short_s, passes_short, draft_short = min(short_runs)
    passes = passes_long - passes_short
    row = {"method": method, "options": programs.options,
           "attn_impl": options["kernels"].attention, "kernels": options["kernels"].to_dict(),
           "target_passes": passes,
           "draft_passes_per_target_pass": (draft_long - draft_short) / max(passes, 1),
           "new_tokens": new_tokens, "compile_seconds": programs.compile_seconds,
           # (whole run - prefill run) / steps: the step alone; noisy when a step is short.
           "wall_ms_per_pass": 1e3 * (long_s - short_s) / max(passes, 1),
           # The whole run over every target pass, prefill included: an upper bound.
           "wall_ms_per_pass_with_prefill": 1e3 * long_s / max(passes_long, 1),
           "prefill_ms": 1e3 * short_s}

    draft = options.get("draft")
    capacity = _capacity(programs.loop)
    shapes = [(model.config.num_layers, capacity, model.config.num_kv_heads,
               model.config.head_dim)]
    if draft is not None:
        shapes.append((draft.config.num_layers, capacity, draft.config.num_kv_heads,
                       draft.config.head_dim))
    row["cache_shapes"] = shapes
    loop_text = programs.loop.as_text()
    row["hlo_loop"] = analyze_program(loop_text, shapes, step="loop")
    if programs.step is not None:
        step_text = programs.step.as_text()
        row["hlo_step_program"] = analyze_program(step_text, shapes, step="entry")
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{method}_loop.hlo").write_text(loop_text)
        if programs.step is not None:
            (Path(hlo_dir) / f"{method}_step.hlo").write_text(step_text)

    if trace:
        with tempfile.TemporaryDirectory(prefix="specjax-profile-") as folder:
            (_, passes_a, _), events_long = traced(lambda: programs.run(new_tokens),
                                                   os.path.join(folder, "long"))
            (_, passes_b, _), events_short = traced(lambda: programs.run(1),
                                                    os.path.join(folder, "short"))
        row["trace"] = trace_report(events_long, events_short, passes_a - passes_b, top)
    return row


def _capacity(executable) -> int:
    """The cache capacity of a compiled generation (the length of its token buffer output)."""
    module = parse_hlo(executable.as_text())
    match = _HEADER.match(module.entry_signature)
    # The output tuple holds the cache [L, S, K, D] first (DecodeState.cache).
    arrays = _ARRAY.findall(match.group(4)) if match else []
    for _, dims in arrays:
        dims = [int(d) for d in dims.split(",") if d]
        if len(dims) == 4:
            return dims[1]
    raise ValueError("cannot find the cache in the program's outputs")


# ----------------------------------------------------------------------------- main


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def main(argv=None) -> int:
    from specjax.errors import InvalidArgumentError
    from specjax.kernel_options import KernelOptions, add_kernel_arguments
    from specjax.methods import method_options as resolve_options
    from specjax.methods.options import backend_of, describe_defaults

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"named config: {', '.join(model_configs())}")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-length", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs, fastest kept")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--tree-budget", type=_positive_int, default=None, metavar="N",
                        help=f"nodes per target pass of {' and '.join(BUDGET_METHODS)} "
                             f"(default: the backend's, {describe_defaults('tree_budget')}); "
                             f"each row records its method's options")
    add_kernel_arguments(parser)  # --attention etc., as specjax generate's
    parser.add_argument("--fused-projections", action="store_true",
                        help="fuse q|k|v and gate|up weights (models.fuse_projections)")
    parser.add_argument("--no-trace", action="store_true", help="skip the profiler traces")
    parser.add_argument("--hlo-dir", default=None, help="also write each program's HLO text")
    parser.add_argument("--top", type=int, default=15, help="top kernels listed")
    parser.add_argument("--json", default=None,
                        help="output (default benchmarks/results/profile_<model>_<device>.json)")
    args = parser.parse_args(argv)
    try:
        kernels = KernelOptions.from_args(args, backend_of(jax.default_backend()))
    except InvalidArgumentError as error:
        parser.error(str(error))

    from specjax.harness import environment
    from specjax.harness.environment import machine

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; expected a subset of {','.join(METHODS)}")
    if args.tree_budget is not None:
        takers = [m for m in methods if m in BUDGET_METHODS]
        if not takers:
            parser.error(f"--tree-budget applies to {' and '.join(BUDGET_METHODS)}, not to "
                         f"--methods {','.join(methods)}")
        for method in takers:  # e.g. staged's budget is bounded by the candidates it drafts
            try:
                resolve_options(method, backend=jax.default_backend(),
                                tree_budget=args.tree_budget)
            except InvalidArgumentError as error:
                parser.error(f"--tree-budget {args.tree_budget}: {error}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"model {args.model}", flush=True)
    result = {"benchmark": "profile_step", "command": " ".join([Path(sys.executable).name,
                                                                *sys.argv]),
              "machine": machine(), "backend": jax.default_backend(),
              "config": {k: v for k, v in vars(args).items() if k != "json"},
              "rows": []}
    device_name = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_").lower()
    path = Path(args.json or ROOT / "benchmarks" / "results" /
                f"profile_{args.model}_{device_name}.json")

    def write(complete: bool) -> None:
        # After every row too (with "complete": false), so that a run stopped part-way
        # (gpu_run.sh's STEP_TIMEOUT, a device call's time limit) keeps the rows it has.
        result["complete"] = complete
        environment.write_json(path, json.loads(json.dumps(result, default=_json_default)))

    vocab = model_configs()[args.model].vocab_size if args.model in model_configs() else 0
    tables = random_ngram_tables(vocab) if any(m in NGRAM_METHODS for m in methods) else None
    prompt = np.random.default_rng(1).integers(3, vocab, args.prompt_length).tolist()
    for dtype in dtypes:
        model = random_model(args.model, dtype, fused=args.fused_projections)
        for method in methods:
            started = time.perf_counter()
            try:
                row = profile_method(model, method, prompt, args.new_tokens, args.repeats,
                                     args.draft_layers, tables, not args.no_trace,
                                     args.hlo_dir and os.path.join(args.hlo_dir, dtype),
                                     args.top, tree_budget=args.tree_budget,
                                     attn_impl=kernels)
            except Exception as error:  # one failed method is a row, not a lost run
                row = {"method": method, "error": f"{type(error).__name__}: {error}"[:500]}
            budget = row.get("options", {}).get("tree_budget")
            options_note = f"{method} {dtype}" + (f" (tree_budget {budget})" if budget else "")
            row["dtype"] = dtype
            row["model"] = args.model
            row["seconds"] = time.perf_counter() - started
            result["rows"].append(row)
            print(_summary_line(options_note, row), flush=True)
            write(complete=False)
        del model
        from specjax import decode

        decode.clear_compiled()
    write(complete=True)
    print(f"wrote {path}")
    return 1 if any("error" in row for row in result["rows"]) else 0


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, collections.Counter):
        return dict(value)
    raise TypeError(type(value).__name__)


def _summary_line(label: str, row: dict) -> str:
    if "error" in row:
        return f"{label}: ERROR {row['error']}"
    hlo = row["hlo_loop"]
    parts = [f"{label}: {row['wall_ms_per_pass']:.3f} ms/pass wall",
             f"step ops {hlo['step_ops']} (weighted {hlo['step_ops_weighted']})",
             f"copies {hlo['copies']} ({hlo['copy_bytes_per_step']} B/step)",
             f"data movement {hlo['data_movement_ops']} "
             f"({hlo['data_movement_bytes_per_step']} B/step)",
             f"cache-sized copies/writes per step {hlo['cache_sized_copies_per_step']}"]
    trace = row.get("trace")
    if trace:
        for key in ("kernels_per_pass", "thunks_per_pass", "device_ms_per_pass",
                    "memcpy_per_pass"):
            if trace.get(key) is not None:
                parts.append(f"{key} {trace[key]:.1f}" if "ms" not in key
                             else f"{key} {trace[key]:.3f}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
