"""The TPU verify-attention kernel with Gemma-style soft-capping and sliding windows.

``verify_attention_tpu(..., softcap=c, first_visible=f)``: every score (committed slots
and tail) becomes ``c * tanh(score / c)`` before the mask, and query ``t`` sees committed
slot ``s`` iff ``f[t] <= s < length`` (the scratch window and the new tokens are not
windowed). In the TPU interpreter against ``attention_reference``, with the inputs
poisoned as in ``tests/test_kernels.py`` (NaN in every slot past ``length`` and the scratch
window; slots below a window stay finite, since other rows of the call read them); each
comparison is shown sharp (the reference with the window one slot later, or without the
cap, is far off). A row's output is bitwise the same alone and among 16 windowed nodes (the
tile-level skipping of blocks below every row's window changes nothing). And the kernel
compiles with Mosaic for TPU v5e and v4 at Gemma-like and Phi-3-like (head_dim 96) shapes,
and for v5e at a Phi-2-like one (head_dim 80, no window), within its VMEM estimate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpu_aot
from specjax.attention import attention_reference
from specjax.errors import InvalidArgumentError
from specjax.kernels import TpuBlockSizes, attention_tpu, verify_attention_tpu
from kernel_rows import LENGTH, NODE, NODES, lone_node_inputs, the_node_alone
from test_kernels import TOLERANCE, Case, make_inputs
from test_tpu_compile import needs_compiler

reference = jax.jit(attention_reference, static_argnames=("softcap",))
MIN = int(np.iinfo(np.int32).min)  # a global layer: every committed slot
BLOCKS_128 = TpuBlockSizes(block_kv=128, num_splits=2)


@dataclasses.dataclass(frozen=True)
class WindowCase:
    case: Case
    first_visible: tuple  # one per token
    softcap: float | None


def _sliding(length: int, depths, window: int) -> tuple:
    """Gemma's rule: a token at position ``length + depth`` sees the ``window`` positions
    up to its own (its first visible slot is ``position - window + 1``)."""
    return tuple(length + d - window + 1 for d in depths)


CASES = [
    # One token; its window starts in block 1: block 0 is skipped for the (only) tile.
    WindowCase(Case("decode-g2-f32", 1, 4, 2, 64, 300, 290, tree=False,
                    block_sizes=BLOCKS_128), (200,), 5.0),
    # A tree with a scratch window, GQA group 4: a global row, a row from slot 0, windows
    # starting inside blocks 1 and 2, one at the last committed slot and one past length
    # (no committed slot; its scratch slots and tokens still count).
    WindowCase(Case("tree-g4-scratch-bf16", 6, 8, 2, 128, 400, 300, window=3,
                    dtype=jnp.bfloat16, block_sizes=BLOCKS_128),
               (MIN, 0, 129, 256, 299, 350), 1.0),
    # Four row tiles of 8 (28 rows + 4 padding): tile 0 sees every block, tile 1's windows
    # start in block 2 (split 0 wholly below them), tile 2 in block 3 (one row sees no
    # committed slot), tile 3 holds padding rows (int32 max must not lower its minimum).
    WindowCase(Case("tree-g4-row-tiles-f32", 7, 8, 2, 64, 512, 400, window=2,
                    block_sizes=TpuBlockSizes(block_kv=128, num_splits=2, block_rows=8)),
               (MIN, 10, 300, 260, 390, 500, 129), 3.0),
    # Gemma's sliding rule over a causal run of 5 tokens, a window of 70 slots, 32-slot
    # blocks with three splits (some of them wholly below the windows).
    WindowCase(Case("causal-sliding-g1-bf16", 5, 2, 2, 64, 256, 180, tree=False,
                    dtype=jnp.bfloat16,
                    block_sizes=TpuBlockSizes(block_kv=32, num_splits=3)),
               _sliding(180, range(5), 70), 1.0),
    # Nothing committed: only the scratch window (not windowed) and the new tokens.
    WindowCase(Case("length0-g4-f32", 4, 4, 1, 64, 64, 0, window=2, block_sizes=BLOCKS_128),
               (0, -5, 3, MIN), 2.0),
    # Phi-3's head_dim 96 with its sliding rule (no cap in Phi-3; one here, to check it),
    # a scratch window, block_kv 32 and three splits.
    WindowCase(Case("causal-sliding-d96-f32", 4, 4, 2, 96, 256, 200, window=2, tree=False,
                    block_sizes=TpuBlockSizes(block_kv=32, num_splits=3)),
               _sliding(200, range(4), 50), 2.0),
    # No cache (a prefill): the cap applies to the tokens; first_visible has nothing to cut.
    WindowCase(Case("no-cache-f32", 5, 6, 2, 64, None, 0, tree=False), (0, 1, 2, 3, 4), 2.0),
    # Phi-2's head_dim 80 like Phi-3's 96 above (with a cap and a window, which Phi-2 has
    # not), bfloat16.
    WindowCase(Case("causal-sliding-d80-bf16", 4, 4, 2, 80, 256, 200, window=2, tree=False,
                    dtype=jnp.bfloat16,
                    block_sizes=TpuBlockSizes(block_kv=32, num_splits=3)),
               _sliding(200, range(4), 50), 2.0),
]


def _run(wcase: WindowCase, seed: int, **overrides):
    args, reference_args = make_inputs(wcase.case, seed)
    first = jnp.asarray(wcase.first_visible, jnp.int32)
    options = {} if wcase.case.block_sizes is None else {"block_sizes": wcase.case.block_sizes}
    out = verify_attention_tpu(*args, softcap=wcase.softcap, first_visible=first,
                               interpret=True, **options)

    def expected(**changes):
        kwargs = {"softcap": wcase.softcap, "first_visible": first, **changes}
        return np.asarray(reference(*reference_args, **kwargs), np.float32)

    return out, expected


@pytest.mark.parametrize("wcase", CASES, ids=lambda c: c.case.name)
def test_windowed_kernel_matches_reference(wcase):
    case = wcase.case
    out, expected = _run(wcase, seed=200 + CASES.index(wcase))
    want = expected()
    assert out.shape == want.shape and out.dtype == case.dtype
    got = np.asarray(out, np.float32)
    assert np.all(np.isfinite(got)), "unwritten or poisoned output"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=case.name)
    # Sharp: without the cap the outputs are far off ...
    assert np.abs(got - expected(softcap=None)).max() > 10 * tol, "softcap not seen"
    if case.capacity is not None and case.length > 0:
        # ... and so with every window one slot later (one committed slot fewer; 2x the
        # bfloat16 tolerance: it lands 4x-40x beyond it in these cases).
        later = expected(first_visible=jnp.asarray(wcase.first_visible, jnp.int32) + 1)
        factor = 100 if case.dtype == jnp.float32 else 2
        assert np.abs(got - later).max() > factor * tol, "window off by one not seen"


def test_stacked_cache_with_windows():
    """Gemma-3-like heads (4 query / 1 KV head of 256, bfloat16) reading layer 1 of a
    stacked cache whose other layers hold NaN, with a window and the cap."""
    case = Case("stacked-gemma3-like", 3, 4, 1, 256, 300, 260, window=2, dtype=jnp.bfloat16,
                block_sizes=BLOCKS_128)
    args, reference_args = make_inputs(case, seed=17)
    first = jnp.asarray(_sliding(260, (0, 1, 1), 100), jnp.int32)
    poison = jnp.full_like(args[3], jnp.nan)
    stacked = [jnp.stack([poison, cache]) for cache in args[3:5]]
    out = jax.jit(lambda layer, first: verify_attention_tpu(
        *args[:3], *stacked, *args[5:], layer=layer, softcap=1.0, first_visible=first,
        block_sizes=case.block_sizes, interpret=True))(jnp.int32(1), first)
    want = reference(*reference_args, softcap=1.0, first_visible=first)
    tol = TOLERANCE[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_windowed_row_arithmetic_does_not_depend_on_the_call(dtype):
    """A query row's output is bitwise the same alone (a one-token step, whose tile skips
    the blocks below its window) and as node 9 of a 16-node call, in another row tile
    beside rows whose windows start lower (so that tile computes those blocks, with the
    node's row wholly masked there). The node sees only itself among the new tokens."""
    args, rng = lone_node_inputs(4, dtype)
    q, k_new = args[:2]
    first = jnp.asarray(rng.integers(0, LENGTH, NODES), jnp.int32).at[NODE].set(200)
    first = first.at[NODE - 1].set(10).at[NODE + 1].set(MIN)  # its tile's other rows
    rows = 16 if dtype == jnp.bfloat16 else 8
    sizes = TpuBlockSizes(block_kv=128, num_splits=2, block_rows=rows)
    plan = attention_tpu.vmem_plan(q, k_new, None, True, sizes, windowed=True)
    assert plan.row_tiles > 1 and NODE * (q.shape[1] // k_new.shape[1]) >= plan.block_rows
    common = dict(softcap=3.0, block_sizes=sizes, interpret=True)
    together = verify_attention_tpu(*args, first_visible=first, **common)
    alone = verify_attention_tpu(*the_node_alone(args), first_visible=first[NODE:NODE + 1],
                                 **common)
    np.testing.assert_array_equal(np.asarray(together[NODE], np.float32),
                                  np.asarray(alone[0], np.float32))


def test_windows_are_checked():
    """first_visible must be int32 [T] and softcap a positive number: one-line refusals
    naming the kernel, from check_supported and the kernel alike."""
    case = Case("v", 2, 4, 2, 64, 16, 3, tree=False)
    args = make_inputs(case, seed=0)[1]
    bad = [(dict(first_visible=jnp.zeros((3,), jnp.int32)), "first_visible must be int32"),
           (dict(first_visible=jnp.zeros((2,), jnp.float32)), "first_visible must be int32"),
           (dict(softcap=0.0), "softcap must be a positive number"),
           (dict(softcap=-1.0), "softcap must be a positive number")]
    for kwargs, match in bad:
        with pytest.raises(InvalidArgumentError, match=f"TPU verify-attention kernel: {match}"):
            attention_tpu.check_supported(*args[:5], args[6], args[7], **kwargs)
        with pytest.raises(InvalidArgumentError, match=match):
            verify_attention_tpu(*args, interpret=True, **kwargs)
    assert attention_tpu.TAKES_WINDOWS
    # The windowed plan counts the rows' first-visible block in the split kernel's VMEM.
    plain = attention_tpu.check_supported(*args[:5], args[6], args[7])
    windowed = attention_tpu.check_supported(*args[:5], args[6], args[7], softcap=50.0,
                                             first_visible=jnp.zeros((2,), jnp.int32))
    assert windowed > plain


# ----------------------------------------------------------------------------- TPU compiles

# Gemma-3-270M's heads (4 query / 1 KV head of 256) in bfloat16 over a 4096-slot cache:
# a decode step, a 16-node tree and a draft level with a 12-slot scratch window; on v4
# (16 MiB of VMEM) also Gemma-2-2B's heads (8 / 4 of 256) in float32 and a VMEM-heavy
# 128-node MHA tree with a 128-slot window.
GEMMA3 = dict(num_heads=4, num_kv_heads=1, head_dim=256, dtype="bfloat16", capacity=4096)
WINDOWED = dict(kind="kernel", softcap=50.0, windowed=True)
PHI3 = dict(kind="kernel", windowed=True, num_heads=32, num_kv_heads=32, head_dim=96,
            dtype="bfloat16", capacity=4096)
# Phi-2's heads (32 / 32 of 80: blocks whose last dim is the array's 80), no window, no cap.
PHI2 = dict(kind="kernel", num_heads=32, num_kv_heads=32, head_dim=80, dtype="bfloat16",
            capacity=2048)
COMPILE_JOBS = [
    dict(WINDOWED, target=target, **GEMMA3, tokens=tokens, window=window)
    for target in ("v5e:2x2", "v4:2x2x1") for tokens, window in ((1, 0), (16, 0), (6, 12))
] + [
    dict(WINDOWED, target="v4:2x2x1", num_heads=8, num_kv_heads=4, head_dim=256,
         dtype="float32", capacity=4096, tokens=16, window=16),
    dict(WINDOWED, target="v4:2x2x1", num_heads=32, num_kv_heads=32, head_dim=128,
         dtype="float32", capacity=4096, tokens=128, window=128),
] + [
    # Phi-3-mini's heads (32 / 32 of 96: blocks whose last dim is the array's 96) with its
    # windows and no cap, bfloat16: a decode step on v5e, a 16-node tree with a 16-slot
    # scratch window on v5e and v4.
    dict(PHI3, target=target, tokens=tokens, window=window)
    for target, tokens, window in (("v5e:2x2", 1, 0), ("v5e:2x2", 16, 16), ("v4:2x2x1", 16, 16))
] + [
    # Phi-2's (head_dim 80): a 16-node tree with a 16-slot scratch window on v5e.
    dict(PHI2, target="v5e:2x2", tokens=16, window=16),
]


def _job_id(job: dict) -> str:
    return (f"{job['target']}-h{job['num_heads']}-k{job['num_kv_heads']}-d{job['head_dim']}-"
            f"t{job['tokens']}-m{job['window']}-{job['dtype']}")


@pytest.fixture(scope="module")
def compile_records():
    records = tpu_aot.run_worker(COMPILE_JOBS, vmem_report=True)
    return {_job_id(record): record for record in records}


@needs_compiler
@pytest.mark.parametrize("job", COMPILE_JOBS, ids=_job_id)
def test_windowed_kernel_compiles_within_vmem(compile_records, job):
    """Mosaic compiles both kernels with the cap and the window (the rows' int32
    [rows, 128] first-visible block, the per-tile first blocks in SMEM), and the VMEM the
    compiler reports for each kernel is within the kernel's estimate (which counts the new
    block), within the budget. (XLA may keep a small combine kernel's operands in VMEM and
    report no allocation of its own for it: v5e/v6e with one KV head of 256, windows or not;
    the split kernel, which reads the new block, is always reported.) The Phi-2 job (heads
    of 80) has neither cap nor window: it checks the head size."""
    record = compile_records[_job_id(job)]
    assert record["ok"], f"{record['target']}: {record['error']}\n{record.get('traceback', '')}"
    assert record["vmem_capacity"] == tpu_aot.TARGETS[record["target"]]
    assert all(count > 0 for count in record["tpu_kernels"].values()), record["tpu_kernels"]
    estimates = {"verify_attention_tpu_split": record["split_bytes"],
                 "verify_attention_tpu_combine": record["combine_bytes"]}
    assert "verify_attention_tpu_split" in record["vmem_used"], record["vmem_used"]
    for kernel, used in record["vmem_used"].items():
        assert 0 < used <= estimates[kernel] <= attention_tpu.VMEM_BUDGET, (
            f"{kernel}: compiler {used / 2**20:.2f} MiB, estimate "
            f"{estimates[kernel] / 2**20:.2f} MiB")


# The position-ordered kernel (attention "fused") with the cap and the windows, for v5e:
# Gemma-3-270M's heads (4 / 1 of 256) in bfloat16, a one-token step and a 16-node verify
# pass; Gemma-2-2B's (8 / 4 of 256) verify pass in float32; Phi-3-mini's 32 KV heads of 96
# (tpu_aot.FAMILY_HF_CONFIGS) with its windows and no cap, a 16-node verify pass: two tiles
# of 4 rows (at 8 rows the compiler reported 12.4 MiB for its blocks, over the 12 MiB
# budget, which the estimate of the time put at 9.6); 8 of Phi-2's 32 heads of 80 (no
# window).
ORDERED_JOBS = [
    dict(GEMMA3, kind="ordered_kernel", target="v5e:2x2", softcap=50.0, windowed=True,
         tokens=tokens, window=0) for tokens in (1, 16)
] + [
    dict(kind="ordered_kernel", target="v5e:2x2", num_heads=8, num_kv_heads=4, head_dim=256,
         dtype="float32", capacity=4096, tokens=16, window=0, softcap=50.0, windowed=True),
    dict(PHI3, kind="ordered_kernel", target="v5e:2x2", tokens=16, window=0),
    dict(PHI2, kind="ordered_kernel", target="v5e:2x2", tokens=16, window=0, num_heads=8,
         num_kv_heads=8),
]


@pytest.fixture(scope="module")
def ordered_records():
    records = tpu_aot.run_worker(ORDERED_JOBS, vmem_report=True)
    return {_job_id(record): record for record in records}


@needs_compiler
@pytest.mark.parametrize("job", ORDERED_JOBS, ids=_job_id)
def test_windowed_ordered_kernel_compiles_within_vmem(ordered_records, job):
    """Mosaic compiles the position-ordered kernel with the cap and the rows' first
    positions, and the VMEM the compiler reports for it is within the kernel's estimate
    (:func:`~specjax.kernels.attention_ordered_tpu.vmem_bytes`, which counts the windows'
    block), within the budget; the Phi-2 job (heads of 80), without either, checks the head
    size."""
    record = ordered_records[_job_id(job)]
    assert record["ok"], f"{record['target']}: {record['error']}\n{record.get('traceback', '')}"
    assert record["fused_kernels"]["ordered_attention_tpu"] > 0, record["fused_kernels"]
    used = record["vmem_used"]["ordered_attention_tpu"]
    assert 0 < used <= record["estimate"] <= attention_tpu.VMEM_BUDGET, (
        f"compiler {used / 2**20:.2f} MiB, estimate {record['estimate'] / 2**20:.2f} MiB "
        f"(block_kv {record['block_kv']})")
