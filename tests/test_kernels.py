"""Pallas verify-attention kernels against ``attention_reference``, on the CPU.

The GPU kernel runs under Pallas' generic interpreter and the TPU kernel under the TPU
interpreter; both interpreters fill buffers a kernel never writes with NaN. The inputs are
poisoned too: every cache slot a query must not read (past ``length`` and past the scratch
window) holds NaN, so an out-of-range read or an unwritten output element fails the test.
The reference gets the same inputs with those slots zeroed (it multiplies every slot by its
probability, so it cannot take NaN there).

Shapes cover GQA ratios 1/3/4/8, head_dim 64, 80 (Phi-2's), 96 (Phi-3's) and 128 (and 48
and 144 for the GPU kernel), cache lengths that are not a multiple of the block (and 0),
one token and random trees, with and without a scratch window, float32 and bfloat16. At
head_dim 80 and 96 the GPU kernel's tiles are 128 wide over an 80- or 96-wide cache (at
48 64 wide, at 144 256 wide): the interpreter pads what a load reads past a dimension with
NaN, so an unmasked load of the cache's missing columns fails the test too. Also: both kernels
lower for their real targets (Triton / Mosaic), greedy generation with
``attn_impl="kernel"`` equals ``"reference"`` end to end, and bad input is refused with
one-line errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kernels
from specjax.attention import attention, attention_reference
from specjax.errors import InvalidArgumentError
from specjax.kernels import (GpuBlockSizes, TpuBlockSizes, attention_gpu,
                             verify_attention_gpu, verify_attention_tpu)
from specjax.tree import ancestor_mask

from conftest import random_prompt, tiny_pair
from kernel_rows import NODE, lone_node_inputs, the_node_alone

reference = jax.jit(attention_reference)  # one compile instead of op-by-op dispatch

# float32: online softmax vs one softmax, summed in another order. An output is a convex
# combination of values (|want| < 5 here) after D-term scores; the longest sum is a row of
# at most S = 300 slots: 1e-5 * (1 + |want|) exceeds sum_tolerance(longest_sum=300,
# stages=2, magnitude=|want|) = 8.3e-6 * |want| (tests/tolerances.py) at every size.
# bfloat16: the kernels round the probabilities to bf16 before the P @ V product, and the
# output is bf16 (2**-8 relative each).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int  # T
    heads: int  # H
    kv_heads: int  # K
    head_dim: int  # D
    capacity: int | None  # S; None: no cache
    length: int
    window: int = 0  # M, scratch slots
    tree: bool = True  # random tree mask (else causal)
    dtype: type = jnp.float32
    block_sizes: object = None


def make_inputs(case: Case, seed: int):
    """(kernel inputs with NaN in unreadable slots, the same inputs for the reference)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), case.dtype)

    t, h, k, d = case.tokens, case.heads, case.kv_heads, case.head_dim
    q, k_new, v_new = normal(t, h, d), normal(t, k, d), normal(t, k, d)
    if case.tree:
        parents = np.array([-1] + [rng.integers(0, i) for i in range(1, t)], np.int32)
        valid = np.ones(t, bool)
        if t > 2:
            valid[rng.integers(1, t)] = False  # padding node: sees only itself
        mask = ancestor_mask(jnp.asarray(parents), jnp.asarray(valid))
    else:
        mask = jnp.tril(jnp.ones((t, t), bool))
    scratch_mask = jnp.asarray(rng.random((t, case.window)) < 0.5) if case.window else None
    if case.capacity is None:
        args = (q, k_new, v_new, None, None, None, mask, scratch_mask)
        return args, args
    k_cache, v_cache = normal(case.capacity, k, d), normal(case.capacity, k, d)
    readable = case.length + case.window
    poisoned = [c.at[readable:].set(jnp.nan) for c in (k_cache, v_cache)]
    clean = [c.at[readable:].set(0) for c in (k_cache, v_cache)]
    length = jnp.int32(case.length)
    return ((q, k_new, v_new, *poisoned, length, mask, scratch_mask),
            (q, k_new, v_new, *clean, length, mask, scratch_mask))


def check_against_reference(kernel, case: Case, seed: int):
    args, reference_args = make_inputs(case, seed)
    options = {} if case.block_sizes is None else {"block_sizes": case.block_sizes}
    out = kernel(*args, interpret=True, **options)
    expected = reference(*reference_args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "unwritten or poisoned output"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol, err_msg=case.name)
    if case.capacity is not None and case.length > 0 and case.dtype == jnp.float32:
        # The comparison is sharp enough to see one cache slot too few.
        shorter = reference(*reference_args[:5], jnp.int32(case.length - 1), *reference_args[6:])
        assert float(jnp.max(jnp.abs(out - shorter))) > 100 * tol


GPU_SMALL = GpuBlockSizes(block_rows=16, block_kv=16, num_splits=4)
GPU_CASES = [
    # One token, MHA; 37 slots = 2 blocks + 5; the 4th split is empty.
    Case("decode-g1-d64-f32", 1, 2, 2, 64, 50, 37, tree=False, block_sizes=GPU_SMALL),
    # Default block sizes: 77 slots = one block of 64 + 13.
    Case("tree-g3-d64-bf16", 7, 6, 2, 64, 100, 77, window=2, dtype=jnp.bfloat16),
    # 24 query rows: two row blocks of 16.
    Case("tree-g4-d128-window-f32", 6, 8, 2, 128, 40, 21, window=5, block_sizes=GPU_SMALL),
    Case("tree-g8-d128-window-bf16", 3, 8, 1, 128, 48, 30, window=3, dtype=jnp.bfloat16,
         block_sizes=GPU_SMALL),
    # Nothing committed, and the window runs past the capacity: slots 0-2 exist, 3-4 do not.
    Case("length0-window-past-capacity-f32", 4, 4, 4, 64, 3, 0, window=5, block_sizes=GPU_SMALL),
    Case("no-cache-causal-f32", 5, 6, 2, 64, None, 0, tree=False),
    # Phi-3's head_dim 96 (128-wide tiles, the cache's 96 columns loaded masked): one token
    # over 2 blocks + 5 slots, and a GQA tree with a scratch window (read from the cache).
    Case("decode-g1-d96-f32", 1, 2, 2, 96, 50, 37, tree=False, block_sizes=GPU_SMALL),
    Case("tree-g3-d96-window-bf16", 7, 6, 2, 96, 100, 77, window=2, dtype=jnp.bfloat16),
    Case("tree-g4-d96-window-f32", 6, 8, 2, 96, 40, 21, window=5, block_sizes=GPU_SMALL),
    Case("no-cache-d96-f32", 5, 6, 2, 96, None, 0, tree=False),
    # Phi-2's head_dim 80 the same way (128-wide tiles over the cache's 80 columns).
    Case("decode-g1-d80-f32", 1, 2, 2, 80, 50, 37, tree=False, block_sizes=GPU_SMALL),
    Case("tree-g3-d80-window-bf16", 7, 6, 2, 80, 100, 77, window=2, dtype=jnp.bfloat16),
    Case("tree-g4-d80-window-f32", 6, 8, 2, 80, 40, 21, window=5, block_sizes=GPU_SMALL),
    Case("no-cache-d80-f32", 5, 6, 2, 80, None, 0, tree=False),
    # Other multiples of 16: 48 on 64-wide tiles, 144 on 256-wide ones.
    Case("tree-g3-d48-window-f32", 5, 6, 2, 48, 40, 21, window=3, block_sizes=GPU_SMALL),
    Case("tree-g4-d144-window-f32", 4, 8, 2, 144, 40, 21, window=2, block_sizes=GPU_SMALL),
]

TPU_SMALL = TpuBlockSizes(block_kv=128, num_splits=2)
TPU_CASES = [
    # 290 slots = 2 blocks + 34; the last block is also the array's ragged edge (300).
    Case("decode-g1-d64-f32", 1, 2, 2, 64, 300, 290, tree=False, block_sizes=TPU_SMALL),
    Case("tree-g3-d128-window-bf16", 5, 6, 2, 128, 200, 130, window=3, dtype=jnp.bfloat16,
         block_sizes=TPU_SMALL),
    Case("tree-g4-length0-window-f32", 4, 8, 2, 64, 64, 0, window=2, block_sizes=TPU_SMALL),
    # Three splits over one valid block: two of them are empty.
    Case("tree-g8-3splits-bf16", 3, 8, 1, 64, 256, 100, dtype=jnp.bfloat16,
         block_sizes=TpuBlockSizes(block_kv=128, num_splits=3)),
    # Phi-3's head_dim 96 (blocks whose last dim is the array's whole 96).
    Case("decode-g1-d96-f32", 1, 2, 2, 96, 300, 290, tree=False, block_sizes=TPU_SMALL),
    Case("tree-g3-d96-window-bf16", 5, 6, 2, 96, 200, 130, window=3, dtype=jnp.bfloat16,
         block_sizes=TPU_SMALL),
    Case("tree-g4-d96-window-f32", 6, 8, 2, 96, 300, 170, window=4,
         block_sizes=TpuBlockSizes(block_kv=32, num_splits=3)),
    # Phi-2's head_dim 80 the same way.
    Case("decode-g1-d80-f32", 1, 2, 2, 80, 300, 290, tree=False, block_sizes=TPU_SMALL),
    Case("tree-g3-d80-window-bf16", 5, 6, 2, 80, 200, 130, window=3, dtype=jnp.bfloat16,
         block_sizes=TPU_SMALL),
    Case("tree-g4-d80-window-f32", 6, 8, 2, 80, 300, 170, window=4,
         block_sizes=TpuBlockSizes(block_kv=32, num_splits=3)),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_kernel_matches_reference(case):
    check_against_reference(verify_attention_gpu, case, seed=GPU_CASES.index(case))


@pytest.mark.parametrize("case", TPU_CASES, ids=lambda c: c.name)
def test_tpu_kernel_matches_reference(case):
    check_against_reference(verify_attention_tpu, case, seed=100 + TPU_CASES.index(case))


def _abstract(t, h, k, d, s, m, dtype):
    sds = jax.ShapeDtypeStruct
    return (sds((t, h, d), dtype), sds((t, k, d), dtype), sds((t, k, d), dtype),
            sds((s, k, d), dtype), sds((s, k, d), dtype), sds((), jnp.int32),
            sds((t, t), jnp.bool_), sds((t, m), jnp.bool_) if m else None)


# SmolLM2-like decode with a window, Llama-7B-like GQA tree, MHA tree in float32, a
# Phi-3-mini-like tree (32 heads of 96) with a window, a Phi-2-like tree (32 heads of 80).
LOWERING_SHAPES = [(1, 9, 3, 64, 2048, 4, jnp.bfloat16), (64, 32, 8, 128, 8192, 0, jnp.bfloat16),
                   (16, 32, 32, 128, 1000, 0, jnp.float32),
                   (16, 32, 32, 96, 4096, 12, jnp.bfloat16),
                   (16, 32, 32, 80, 2048, 0, jnp.bfloat16)]


@pytest.mark.parametrize("platform,kernel", [("cuda", verify_attention_gpu),
                                             ("tpu", verify_attention_tpu)])
def test_kernels_lower_for_their_hardware(platform, kernel):
    """Pallas-level legality (block shapes, ops) of the real lowering, without the device."""
    for shape in LOWERING_SHAPES:
        lowered = kernel.trace(*_abstract(*shape)).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        assert ("triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


PROMPT = random_prompt(5, 11)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_models():
    target = tiny_pair("llama-gqa", seed=31, num_hidden_layers=2)[1]  # H=4, K=2, D=16
    draft = tiny_pair("llama-gqa", seed=32, num_hidden_layers=1)[1]
    expected = specjax.generate(target, PROMPT, max_new_tokens=NEW_TOKENS,
                                kernels=specjax.KernelOptions(attention="reference")).tokens
    return target, draft, expected


@pytest.mark.parametrize("method", ["ar", pytest.param("tree", marks=pytest.mark.slow)])
def test_generate_with_kernel_equals_reference(tiny_models, method):
    """Greedy output with the kernel equals ``ar`` with the reference (speculation is
    lossless, so this is also what ``tree`` with the reference gives; one compile less)."""
    target, draft, expected = tiny_models
    # Depth 3: the draft's last level attends to the level before it through a scratch window.
    options = {} if method == "ar" else dict(method="tree", draft=draft, tree_budget=6,
                                             draft_depth=3, draft_width=2)
    got = specjax.generate(target, PROMPT, max_new_tokens=NEW_TOKENS,
                           kernels=specjax.KernelOptions(attention="kernel"), **options)
    assert got.tokens == expected
    if method == "tree":
        assert got.stats["draft_calls"] > 0


def test_tpu_variant_through_the_dispatcher():
    """``interpret_variant="tpu"`` routes ``impl="kernel"`` to the TPU kernel (no cache)."""
    assert kernels.select_variant(interpret_variant="tpu") == ("tpu", True)
    case = Case("tpu-no-cache-g1", 6, 2, 2, 128, None, 0)
    args, reference_args = make_inputs(case, seed=7)
    out = attention(*args, impl="kernel", interpret_variant="tpu")
    tol = TOLERANCE[jnp.float32]
    np.testing.assert_allclose(out, reference(*reference_args), rtol=tol, atol=tol)


def _valid_args(t=2, h=4, k=2, d=64, s=16, m=0, dtype=jnp.float32):
    case = Case("v", t, h, k, d, s, 3, window=m, tree=False, dtype=dtype)
    return make_inputs(case, seed=0)[1]


def _with(args, **changes):
    names = ("q", "k_new", "v_new", "k_cache", "v_cache", "length", "mask", "scratch_mask")
    return tuple(changes.get(name, value) for name, value in zip(names, args))


@pytest.mark.parametrize("kernel", [verify_attention_gpu, verify_attention_tpu])
@pytest.mark.parametrize("bad,match", [
    (lambda a: _valid_args(t=129), "129 new tokens"),
    (lambda a: _valid_args(d=40), "head_dim 40"),  # not a multiple of 16: neither takes it
    (lambda a: _valid_args(h=5, k=2), "not a multiple"),
    (lambda a: _with(a, k_cache=a[3].astype(jnp.bfloat16)), "k_cache has dtype bfloat16"),
    (lambda a: _with(a, mask=a[6][:1]), "mask must be"),
    (lambda a: _with(a, v_cache=None), "both k_cache and v_cache"),
    (lambda a: _valid_args(m=129), "at most 128"),
])
def test_bad_input_is_refused(kernel, bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        kernel(*bad(_valid_args()), interpret=True)


def test_bad_block_sizes_and_variant_are_refused():
    args = _valid_args()
    with pytest.raises(InvalidArgumentError, match="block_kv=24 must be a power of two"):
        verify_attention_gpu(*args, block_sizes=GpuBlockSizes(block_kv=24), interpret=True)
    with pytest.raises(InvalidArgumentError, match="block_kv=48 must be a positive multiple"):
        verify_attention_tpu(*args, block_sizes=TpuBlockSizes(block_kv=48), interpret=True)
    with pytest.raises(InvalidArgumentError, match="dtype float16 is not supported"):
        verify_attention_tpu(*_valid_args(dtype=jnp.float16), interpret=True)
    with pytest.raises(InvalidArgumentError, match="unknown kernel variant 'cuda'"):
        kernels.verify_attention(*args, interpret_variant="cuda")


def test_auto_uses_the_fallback_where_the_kernel_does_not_run(monkeypatch):
    calls = []

    def fallback(*args):
        calls.append(args[0].shape)
        return jnp.zeros_like(args[0])

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel must not run")

    kernels.verify_attention(*_valid_args(), fallback=fallback)  # CPU: never interpret
    # On a GPU, shapes the kernel does not take go to the fallback too.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_gpu, "verify_attention_gpu", no_kernel)
    kernels.verify_attention(*_valid_args(t=129), fallback=fallback)
    kernels.verify_attention(*_valid_args(d=40), fallback=fallback)
    assert calls == [(2, 4, 64), (129, 4, 64), (2, 4, 40)]
    with pytest.raises(AssertionError, match="must not run"):
        kernels.verify_attention(*_valid_args(), fallback=fallback)


# ----------------------------------------------------------------------------- GPU kernel: the
# stacked cache, tiling that ignores the row count


@pytest.mark.parametrize("dtype,nodes,window,head_dim", [
    (jnp.float32, 6, 3, 64), (jnp.bfloat16, 1, 0, 64), (jnp.float32, 4, 2, 96),
    (jnp.float32, 4, 2, 80)])
def test_gpu_kernel_reads_one_layer_of_a_stacked_cache(dtype, nodes, window, head_dim):
    """Models pass the whole [L, S, K, D] cache and a traced layer index: the kernel must
    read that layer in place and nothing else (every other layer, and the chosen layer's
    slots past the readable ones, hold NaN; at head_dim 80 and 96 too, with 128-wide
    tiles)."""
    case = Case("stacked", nodes, 6, 2, head_dim, 80, 45, window=window, tree=nodes > 2,
                dtype=dtype, block_sizes=GpuBlockSizes(block_kv=16, num_splits=2))
    args, reference_args = make_inputs(case, seed=41)
    layers, layer = 3, 1

    def stack(one_layer, fill):
        return jnp.stack([jnp.full_like(one_layer, fill)] * layer + [one_layer]
                         + [jnp.full_like(one_layer, fill)] * (layers - layer - 1))

    stacked = [stack(c, jnp.nan) for c in args[3:5]]
    out = verify_attention_gpu(*args[:3], *stacked, *args[5:], layer=jnp.int32(layer),
                               block_sizes=case.block_sizes, interpret=True)
    expected = reference(*reference_args)
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol)
    # The same through the dispatcher, as models call it (impl="kernel").
    clean = [stack(c, 0) for c in reference_args[3:5]]
    via = attention(*args[:3], *stacked, *args[5:], impl="kernel", layer=jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(via, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol)
    from specjax.attention import attention_blocked
    blocked = attention_blocked(*reference_args[:3], *clean, *reference_args[5:], block=16,
                                layer=jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(blocked, np.float32),
                               np.asarray(expected, np.float32), rtol=tol, atol=tol)


def test_gpu_tiling_ignores_the_number_of_rows():
    """16-row tiles for every call (64-row float32 tiles were ~30x slower on an H100), and
    KV splits chosen from the KV heads and capacity only."""
    for capacity in (256, 8192):
        resolved = {rows: GpuBlockSizes().resolve(rows, 3, capacity) for rows in (3, 48, 192)}
        assert {r.block_rows for r in resolved.values()} == {16}
        assert len({r.num_splits for r in resolved.values()}) == 1
    assert GpuBlockSizes(block_rows=64).resolve(3, 3, 256).block_rows == 64


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_row_arithmetic_does_not_depend_on_the_call(dtype, monkeypatch):
    """A query row's output is bitwise the same alone (a one-token step) and as one node of a
    16-node call, in another row block: the blocks, KV splits and merge order of a row do
    not depend on how many rows share the call. (With splits chosen per call, e.g. from
    the number of programs, a 4-SM device would split the one-token call 4 ways and the
    tree call 2 ways.) The node sees only itself among the new tokens, as a padding node or
    a root does."""
    monkeypatch.setattr(attention_gpu, "_multiprocessor_count", lambda: 4)
    args, _ = lone_node_inputs(3, dtype)
    sizes = GpuBlockSizes(block_kv=16)
    together = verify_attention_gpu(*args, block_sizes=sizes, interpret=True)
    alone = verify_attention_gpu(*the_node_alone(args), block_sizes=sizes, interpret=True)
    np.testing.assert_array_equal(np.asarray(together[NODE], np.float32),
                                  np.asarray(alone[0], np.float32))
