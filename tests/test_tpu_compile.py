"""The TPU kernels and whole generation programs compile for real TPU generations.

libtpu compiles for a TPU generation named by a topology (``v4:2x2x1``, ``v5e:2x2``,
``v6e:2x2``) on this CPU: XLA's TPU backend and Mosaic, the Pallas TPU compiler, run to
the end and raise what they would raise on the device (unprovable alignment, VMEM
exhaustion, unsupported layouts). The compiles run in a subprocess (``tests/tpu_aot.py``,
``JAX_PLATFORMS=cpu``) so that the rest of the suite never loads libtpu. Compiling is not
running: numerics are checked by the interpreter tests (``tests/test_kernels.py``).

Without libtpu these tests are skipped with the reason shown by ``pytest -ra``;
``make test-tpu`` installs the pinned one beside the environment and runs them, and with
``SPECJAX_REQUIRE_TPU_COMPILER=1`` (set by that target, which CI runs) a missing compiler
is a failure instead.

Default run (one worker, ~1-2.5 min on 2 CPU cores): two canaries (a Mosaic error and a
VMEM limit the compiler must refuse), the verify-attention kernel over shapes the models
use (GQA groups 1/3/4/8, head_dim 64/96/128, 1..128 tree nodes, float32 and bfloat16, with and
without a scratch window, and a prefill without a cache) for each of the three
generations, each kernel's VMEM (as the compiler reports it) against the kernel's estimate
and the generation's VMEM, and the whole ``ar`` program for v5e; the ``attn_impl="fused"``
kernels (``kernels/linear_tpu.py``, ``kernels/attention_ordered_tpu.py``) at SmolLM2's decode
and verify shapes and the whole fused ``ar`` program, for v5e. ``slow`` (run by CI):
``tree`` (greedy acceptance, v5e), ``staged`` (coupled, v4) and ``spec`` (rejection, v6e)
with the kind of draft shipped for SmolLM2-135M (an EAGLE-3 feature draft), and a
44-compile kernel sweep on v4 (every head shape and dtype at 1 node, and at 128 nodes with
a 128-slot window). ``benchmarks/tpu_compile_report.py`` compiles every program and a
198-compile kernel sweep for every generation and records the times.

Also here, without libtpu: the draft of those programs has the shipped draft's tensors; in
the TPU interpreter, the kernel's row tiles and its reading of one layer of a stacked cache
against the reference, and every model shape's tiling plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import tpu_aot
from conftest import random_prompt, tiny_pair
from specjax.attention import attention_reference
from specjax.errors import InvalidArgumentError
from specjax.kernels import TpuBlockSizes, attention_tpu, verify_attention_tpu
from test_kernels import Case, check_against_reference, make_inputs

COMPILER_PATH, MISSING = tpu_aot.find_compiler()
REQUIRE_ENV = "SPECJAX_REQUIRE_TPU_COMPILER"
# Skipped only where libtpu (the TPU compiler, installed beside .venv by `make tpu-compiler`)
# is absent, with the reason shown; `make test-tpu` (CI) sets REQUIRE_ENV, so there a missing
# compiler fails instead. The `tpu_compiler` mark selects them: `make test-tpu` runs only
# these (the interpreter tests below need no compiler and run in `make test`).
_skip_without_compiler = pytest.mark.skipif(
    COMPILER_PATH is None and os.environ.get(REQUIRE_ENV) != "1", reason=MISSING)


def needs_compiler(test):
    return pytest.mark.tpu_compiler(_skip_without_compiler(test))


TARGETS = ("v5e:2x2", "v6e:2x2", "v4:2x2x1")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One verify-attention call: H query heads, K KV heads, D head_dim, T tree nodes,
    M scratch slots, S cache slots (0: no cache, a prefill)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tokens: int
    dtype: str
    window: int = 0
    capacity: int = 4096

    def job(self, target: str, **extra) -> dict:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}
        return dict(kind="kernel", target=target, **fields, **extra)


# The models' head shapes: SmolLM2-135M (9/3 x 64, G=3), GPT-2 (MHA, G=1; XL: 25 heads),
# Llama-3.2-1B (32/8 x 64, G=4), Llama-3-8B (32/8 x 128, G=4), Qwen2-like G=8, Phi-3-mini
# (MHA, 32 x 96: blocks whose last dim is the array's 96, padded to 128 lanes in VMEM).
KERNEL_SHAPES = [
    Shape("smollm2-decode", 9, 3, 64, 1, "bfloat16"),
    Shape("smollm2-draft-level-window", 9, 3, 64, 6, "bfloat16", window=12),
    Shape("smollm2-tree-f32", 9, 3, 64, 36, "float32", capacity=2048),
    Shape("gpt2-mha-window-f32", 12, 12, 64, 16, "float32", window=16, capacity=1024),
    Shape("gpt2-xl-mha-36-nodes-f32", 25, 25, 64, 36, "float32", capacity=1024),
    Shape("llama8b-g4-d128-128-nodes-window", 32, 8, 128, 128, "bfloat16", window=128),
    Shape("g8-d128-64-nodes", 32, 4, 128, 64, "bfloat16", capacity=8192),
    Shape("g8-d64-128-nodes-window-f32", 16, 2, 64, 128, "float32", window=16, capacity=2048),
    Shape("smollm2-prefill-no-cache", 9, 3, 64, 128, "bfloat16", capacity=0),
    Shape("phi3-mini-d96-36-nodes-f32", 32, 32, 96, 36, "float32"),
]
# v4 has 16 MiB of VMEM: every shape compiles there too (the VMEM-heavy ones matter most).
FAST_KERNELS = [(target, shape) for target in TARGETS for shape in KERNEL_SHAPES]
# A large tree with the VMEM limit set far below what it needs: the compiler must refuse.
LARGE_TREE = KERNEL_SHAPES[5]
VMEM_CANARY = LARGE_TREE.job("v5e:2x2", vmem_limit_bytes=2 * tpu_aot.MiB)
CANARIES = [dict(kind="canary", target="v5e:2x2", dtype=dtype)
            for dtype in ("bfloat16", "float32")]
FAST_PROGRAMS = [dict(kind="program", target="v5e:2x2", method="ar")]
# attn_impl="fused" (kernels/linear_tpu.py, kernels/attention_ordered_tpu.py): every kernel
# call of a SmolLM2 layer and head at decode (1 row) and verify (16 rows) shapes, and the
# whole fused `ar` program, for v5e (~30 s together).
FUSED_KERNEL_JOBS = [dict(kind="fused_kernels", target="v5e:2x2", tokens=tokens)
                     for tokens in (1, 16)]
FUSED_PROGRAM = dict(kind="program", target="v5e:2x2", method="ar", attn_impl="fused")
# The families on the llama forward (tpu_aot.FAMILY_HF_CONFIGS), ar in bfloat16: Qwen3
# with the TPU attention kernel (v5e); with attn_impl="auto", Gemma 2 (v6e) and 3 (v5e),
# head_dim 256, and Phi-3 (v6e), head_dim 96, with the kernel (soft-capping, sliding
# windows), SmolLM3 (v5e; NoPE layers), Phi-4-mini (v6e; partial rotary, LongRoPE) and
# OLMo 3 (v5e; output norms, whole-width q/k norms, 3:1 windows, YaRN on global layers),
# GPT-NeoX (v6e; Pythia's LayerNorm, parallel residual, partial RoPE, biases), Mixtral
# (v5e; eight experts, two per token), and
# a Phi-3 with heads of 40 (which no kernel takes) with the jnp fallback (v6e). (Phi-2's
# head_dim 80: test_kernel_windows_tpu.py compiles both attention kernels at it.)
FAMILY_KERNEL_PROGRAMS = [
    dict(kind="program", target="v5e:2x2", method="ar", family="qwen3"),
    dict(kind="program", target="v6e:2x2", method="ar", family="gemma2", attn_impl="auto"),
    dict(kind="program", target="v5e:2x2", method="ar", family="gemma3", attn_impl="auto"),
    dict(kind="program", target="v6e:2x2", method="ar", family="phi3", attn_impl="auto"),
    dict(kind="program", target="v5e:2x2", method="ar", family="smollm3", attn_impl="auto"),
    dict(kind="program", target="v6e:2x2", method="ar", family="phi4-mini",
         attn_impl="auto"),
    dict(kind="program", target="v5e:2x2", method="ar", family="olmo3", attn_impl="auto"),
    dict(kind="program", target="v6e:2x2", method="ar", family="gpt-neox", attn_impl="auto"),
    dict(kind="program", target="v5e:2x2", method="ar", family="mixtral", attn_impl="auto")]
FAMILY_FALLBACK_PROGRAMS = [
    dict(kind="program", target="v6e:2x2", method="ar", family="phi3-head40",
         attn_impl="auto")]
# slow (CI runs it; the three compile in ~2 min, benchmarks/README.md): each speculative
# method with the draft shipped for SmolLM2-135M (an EAGLE-3 feature draft: one block
# reading three of the target's, a 12,288-id head; tpu_aot.program_configs), in bfloat16
# with the TPU attention kernel, on each generation, with three of the acceptance rules.
# benchmarks/tpu_compile_report.py compiles every program for every generation (see
# benchmarks/results/tpu_compile/programs.json).
SLOW_PROGRAMS = [dict(kind="program", target="v5e:2x2", method="tree", verify="greedy"),
                 dict(kind="program", target="v4:2x2x1", method="staged", verify="coupled"),
                 dict(kind="program", target="v6e:2x2", method="spec", verify="rejection")]
# Model head shapes (H, K, D): GPT-2 small, medium with head_dim 128, XL; Llama-2-7B (MHA);
# SmolLM2; Llama-3.2-3B; Llama-3.2-1B; Llama-3-8B; G=8 at head_dim 64 and 128; Phi-3-mini.
HEADS = [(12, 12, 64), (16, 16, 128), (25, 25, 64), (32, 32, 128), (9, 3, 64), (24, 8, 128),
         (32, 8, 64), (32, 8, 128), (16, 2, 64), (32, 4, 128), (32, 32, 96)]


def _sweep(targets, sizes):
    return [(target, Shape(f"h{h}-k{k}-d{d}-t{t}-m{m}-{dtype}", h, k, d, t, dtype, window=m))
            for target in targets for (h, k, d), dtype, (t, m) in itertools.product(
                HEADS, ("float32", "bfloat16"), sizes)]


# Every head shape x dtype at 1, 16 and 128 nodes (the last two with a scratch window of the
# same size) on every generation: the report's sweep (198 compiles).
FULL_SWEEP = _sweep(TARGETS, ((1, 0), (16, 16), (128, 128)))
# slow: the extremes on v4, the smallest VMEM, where the compiler counts all of the
# kernel's windows (44 compiles).
SWEEP = _sweep(("v4:2x2x1",), ((1, 0), (128, 128)))


def _key(job: dict) -> str:
    return "-".join(str(job.get(k)) for k in ("kind", "target", "method", "verify",
                                              "attn_impl", "dtype", "family", "draft",
                                              "num_heads", "num_kv_heads", "head_dim",
                                              "tokens", "window", "capacity",
                                              "vmem_limit_bytes"))


def _run(jobs: list[dict]) -> dict[str, dict]:
    records = tpu_aot.run_worker(jobs, vmem_report=True)
    return {_key(record): record for record in records}


@pytest.fixture(scope="module")
def fast_records():
    jobs = (CANARIES + [VMEM_CANARY] + [shape.job(target) for target, shape in FAST_KERNELS]
            + FAST_PROGRAMS + FUSED_KERNEL_JOBS + [FUSED_PROGRAM] + FAMILY_KERNEL_PROGRAMS
            + FAMILY_FALLBACK_PROGRAMS)
    return _run(jobs)


@pytest.fixture(scope="module")
def slow_records():
    return _run([shape.job(target) for target, shape in SWEEP] + SLOW_PROGRAMS)


def _compiled(record: dict) -> None:
    assert record["ok"], f"{record['target']}: {record['error']}\n{record.get('traceback', '')}"


# ----------------------------------------------------------------------------- canaries


@needs_compiler
def test_mosaic_errors_reach_the_test(fast_records):
    """A middle-axis load at a dynamic index is unprovable for bfloat16's packed tiles
    (E2003) but fine for float32: if this passed silently, nothing here would be checked."""
    bf16, f32 = (fast_records[_key(job)] for job in CANARIES)
    assert not bf16["ok"] and "E2003" in bf16["error"], bf16["error"]
    _compiled(f32)


@needs_compiler
def test_the_compiler_enforces_the_vmem_limit(fast_records):
    """The same kernel that fits its default limit fails when the limit is below its use:
    the VMEM we ask for is checked at compile time, as on the device."""
    record = fast_records[_key(VMEM_CANARY)]
    assert not record["ok"] and "vmem" in record["error"].lower(), record["error"]
    _compiled(fast_records[_key(LARGE_TREE.job("v5e:2x2"))])


# ----------------------------------------------------------------------------- kernels


def check_kernel(record: dict) -> None:
    """Compiled, and the VMEM the compiler gave each kernel is within the kernel's own
    estimate, which is within the budget, which is within the generation's VMEM."""
    _compiled(record)
    capacity = tpu_aot.TARGETS[record["target"]]
    assert record["vmem_capacity"] == capacity, "the compiler reports another VMEM size"
    has_cache = record["capacity"] > 0
    assert record["tpu_kernels"]["verify_attention_tpu_combine"] > 0
    assert (record["tpu_kernels"]["verify_attention_tpu_split"] > 0) == has_cache
    estimates = {"verify_attention_tpu_split": record["split_bytes"],
                 "verify_attention_tpu_combine": record["combine_bytes"]}
    assert set(record["vmem_used"]) == {k for k, v in estimates.items() if v > 0}
    for kernel, used in record["vmem_used"].items():
        assert 0 < used <= estimates[kernel] <= attention_tpu.VMEM_BUDGET < capacity, (
            f"{kernel}: compiler {used / 2**20:.2f} MiB, estimate "
            f"{estimates[kernel] / 2**20:.2f} MiB, budget {attention_tpu.VMEM_BUDGET >> 20} MiB")


@needs_compiler
@pytest.mark.parametrize("target,shape", FAST_KERNELS,
                         ids=[f"{t}-{s.name}" for t, s in FAST_KERNELS])
def test_kernel_compiles_within_vmem(fast_records, target, shape):
    check_kernel(fast_records[_key(shape.job(target))])


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("target,shape", SWEEP, ids=[f"{t}-{s.name}" for t, s in SWEEP])
def test_kernel_sweep_compiles_within_vmem(slow_records, target, shape):
    check_kernel(slow_records[_key(shape.job(target))])


# ----------------------------------------------------------------------------- programs


def check_program(record: dict) -> None:
    """The whole generation (prefill + while loop) compiled, with the TPU kernels in it."""
    _compiled(record)
    assert all(count > 0 for count in record["tpu_kernels"].values()), record["tpu_kernels"]


@needs_compiler
@pytest.mark.parametrize("job", FAST_PROGRAMS, ids=_key)
def test_generation_program_compiles(fast_records, job):
    check_program(fast_records[_key(job)])


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("job", SLOW_PROGRAMS, ids=_key)
def test_every_generation_program_compiles(slow_records, job):
    check_program(slow_records[_key(job)])


@needs_compiler
@pytest.mark.parametrize("job", FAMILY_KERNEL_PROGRAMS, ids=_key)
def test_family_program_compiles_with_the_kernels(fast_records, job):
    check_program(fast_records[_key(job)])


@needs_compiler
@pytest.mark.parametrize("job", FAMILY_FALLBACK_PROGRAMS, ids=_key)
def test_family_program_compiles_with_the_attention_fallback(fast_records, job):
    """A head_dim the kernel does not take: the jnp attention, no attention kernel."""
    record = fast_records[_key(job)]
    _compiled(record)
    assert not any(record["tpu_kernels"].values()), record["tpu_kernels"]


@needs_compiler
@pytest.mark.parametrize("job", FUSED_KERNEL_JOBS, ids=_key)
def test_fused_kernels_compile(fast_records, job):
    """The fused linear kernel in each of its forms (the 960-wide fused q|k|v matrix whole,
    and its k range, which takes the full-width block; o, gate|up, down, the tied head) and the
    position-ordered attention compile with Mosaic at SmolLM2 shapes."""
    record = fast_records[_key(job)]
    _compiled(record)
    assert all(count > 0 for count in record["fused_kernels"].values()), record["fused_kernels"]


@needs_compiler
def test_fused_program_compiles(fast_records):
    """The whole ``attn_impl="fused"`` ``ar`` generation (prefill and decode steps through
    the fused layers) compiles for TPU, with both fused kernels in it."""
    record = fast_records[_key(FUSED_PROGRAM)]
    _compiled(record)
    assert all(count > 0 for count in record["fused_kernels"].values()), record["fused_kernels"]


def test_the_draft_programs_take_a_draft_of_the_shipped_ones_tensors():
    """Without libtpu: ``spec``/``tree``/``staged`` programs are built, by default, with a
    draft holding the tensors the shipped draft stores (names and shapes of
    ``specjax/assets/smollm2-135m/draft.safetensors``: an EAGLE-3 feature draft), so that the
    compile tests compile what users get; ``draft="token"`` gives the 2-layer token draft."""
    from safetensors import safe_open

    from specjax.checkpoints_tools import assets, sources

    with safe_open(str(sources.assets_dir() / "smollm2-135m" / assets.DRAFT_TENSORS),
                   "numpy") as f:
        shipped = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

    def draft_params(method, **options):
        _, args = tpu_aot.build_generation_program(method, **options)
        (draft,) = [arg.draft_params for arg in args if hasattr(arg, "draft_params")]
        return assets.flatten_tree(draft)

    for method in ("spec", "tree", "staged"):
        draft = draft_params(method, verify="greedy")
        assert {name: tuple(array.shape) for name, array in draft.items()
                if name not in assets.SHARED} == shipped, method
        assert draft["draft_vocab"].dtype == jnp.int32
    token = draft_params("tree", verify="greedy", draft="token")
    assert token["layers.wq"].shape[0] == 2 and "fc" not in token


# ----------------------------------------------------------------------------- tiling (no libtpu)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_tiles_match_the_reference(dtype):
    """Several row tiles per KV head (block_rows below the rows) compute the same as one:
    the TPU interpreter against the reference, as in tests/test_kernels.py."""
    rows = 16 if dtype == jnp.bfloat16 else 8
    case = Case(f"row-tiles-{jnp.dtype(dtype).name}", 7, 8, 2, 64, 300, 170, window=3,
                dtype=dtype, block_sizes=TpuBlockSizes(block_kv=128, block_rows=rows))
    q, k_new, *_, scratch_mask = (a for a in case_inputs(case))
    plan = attention_tpu.vmem_plan(q, k_new, scratch_mask, True, case.block_sizes)
    assert plan.row_tiles > 1  # 7 nodes x 4 heads = 28 rows
    check_against_reference(verify_attention_tpu, case, seed=5)


def test_small_kv_blocks_match_the_reference():
    """block_kv below 128 (what many-head MHA models get) with three splits, some empty."""
    case = Case("kv32-3splits-bf16", 5, 6, 2, 64, 300, 170, window=4, dtype=jnp.bfloat16,
                block_sizes=TpuBlockSizes(block_kv=32, num_splits=3))
    check_against_reference(verify_attention_tpu, case, seed=9)


def case_inputs(case: Case):
    return make_inputs(case, seed=0)[0]


@pytest.mark.parametrize("window", [0, 3])
def test_layer_of_a_stacked_cache_is_read_in_place(window):
    """[L, S, K, D] caches with a traced layer: the kernel reads that layer (the others hold
    NaN, so a read of the wrong layer or a copy of the whole cache shows) and equals the
    reference on it."""
    case = Case("layer", 5, 6, 2, 64, 300, 170, window=window, dtype=jnp.float32,
                block_sizes=TpuBlockSizes(block_kv=128))
    args, reference_args = make_inputs(case, seed=11)
    poison = jnp.full_like(args[3], jnp.nan)
    stacked = [jnp.stack([poison, cache, poison]) for cache in args[3:5]]
    out = jax.jit(lambda layer: verify_attention_tpu(
        *args[:3], *stacked, *args[5:], layer=layer, block_sizes=case.block_sizes,
        interpret=True))(jnp.int32(1))
    expected = jax.jit(attention_reference)(*reference_args)
    # Online softmax against one softmax: the attention kernels' bound (tests/test_kernels.py).
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="pass layer= exactly"):
        verify_attention_tpu(*args[:3], *stacked, *args[5:], interpret=True)


def test_generate_with_the_tpu_kernel_equals_reference():
    """Through the dispatcher (which hands the TPU kernel the stacked cache and the layer):
    greedy ``ar`` with the TPU kernel in the interpreter gives the reference's tokens."""
    # H=4, K=2, D=64 (the kernel takes head_dim 64, 128, 256).
    target = tiny_pair("llama-gqa", seed=31, num_hidden_layers=2, hidden_size=256)[1]
    prompt = random_prompt(5, 11)
    expected = specjax.generate(target, prompt, max_new_tokens=4,
                                kernels=specjax.KernelOptions(attention="reference"))
    got = specjax.generate(target, prompt, max_new_tokens=4, kernels=specjax.KernelOptions(
        attention="kernel", interpret_variant="tpu"))
    assert got.tokens == expected.tokens


def test_every_model_shape_has_a_plan_within_budget():
    """Every head shape, 1..128 nodes, both dtypes, with and without a window: the kernel
    accepts it with the default block sizes and its estimate stays under the budget (the
    compile tests check the estimate against the compiler on a representative subset)."""
    for (h, k, d), dtype, tokens, window in itertools.product(
            HEADS, (jnp.float32, jnp.bfloat16), range(1, 129), (0, 128)):
        q = jax.ShapeDtypeStruct((tokens, h, d), dtype)  # the plan reads shapes only
        k_new = jax.ShapeDtypeStruct((tokens, k, d), dtype)
        scratch = jax.ShapeDtypeStruct((tokens, window), bool) if window else None
        plan = attention_tpu.vmem_plan(q, k_new, scratch, True)
        assert plan.estimate <= attention_tpu.VMEM_BUDGET
        assert plan.rows >= tokens * (h // k) and plan.row_tiles <= 4, (h, k, d, tokens)


def test_a_block_that_cannot_fit_is_refused():
    q = k_new = jax.ShapeDtypeStruct((128, 32, 128), jnp.float32)
    with pytest.raises(InvalidArgumentError, match="MiB of VMEM"):
        attention_tpu.vmem_plan(q, k_new, None, True, TpuBlockSizes(block_kv=1024))
