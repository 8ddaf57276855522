"""Soft-capping and sliding windows in the GPU verify-attention kernel (Gemma 2/3, Mistral,
Phi-3), on the CPU under Pallas' generic interpreter, against ``attention_reference``.

Every query row carries its own first visible slot (``first_visible``); the cases mix rows
whose window starts in a block the others read whole, rows that see no committed slot,
global rows (int32 min), a scratch window (not windowed) and an empty cache. Each
comparison is shown sharp enough to catch a window one slot off or a missing cap. Slots
past ``length`` hold NaN, as in ``tests/test_kernels.py``. Through the dispatcher: a model
with windows runs the kernel with ``attention="kernel"`` and gives ``"auto"``'s tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.attention import attention, attention_reference
from specjax.errors import InvalidArgumentError
from specjax.kernels import GpuBlockSizes, attention_gpu, verify_attention_gpu
from specjax.tree import ancestor_mask

from kernel_rows import LENGTH, NODE, NODES, lone_node_inputs, the_node_alone

reference = jax.jit(attention_reference, static_argnames=("softcap",))
# As tests/test_kernels.py: float32 online softmax against one softmax (rows of at most 160
# slots); bfloat16 probabilities and outputs (2**-8 relative each).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
LOWEST = int(np.iinfo(np.int32).min)
SMALL = GpuBlockSizes(block_rows=16, block_kv=16, num_splits=4)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    heads: int
    kv_heads: int
    capacity: int
    length: int
    window: int  # sliding window in slots; each row's first visible slot follows from it
    softcap: float | None = 2.0
    scratch: int = 0
    dtype: type = jnp.float32
    head_dim: int = 64
    block_sizes: object = SMALL
    global_row: int | None = None  # a row with first_visible = int32 min
    blind_row: int | None = None  # a row whose window starts past length


CASES = [
    # One token: blocks 0-2 are below the window (fv = 77 - 20 + 1 = 58) and not read.
    Case("decode-f32", 1, 4, 2, 100, 77, 20),
    # Seven nodes at depths 0-6 (fv from 45 to 51: block 2 is read whole for some rows and in
    # part for others), a global row and one that sees no committed slot; a scratch window.
    Case("tree-scratch-f32", 7, 6, 2, 96, 60, 16, scratch=3, global_row=2, blind_row=5),
    Case("tree-g4-bf16", 5, 8, 2, 128, 100, 40, dtype=jnp.bfloat16, block_sizes=None),
    Case("tree-no-cap-f32", 4, 8, 1, 64, 50, 7, softcap=None, global_row=0),
    Case("length0-f32", 3, 4, 4, 32, 0, 4),
    # Phi-3's head_dim 96 (128-wide tiles over the cache's 96 columns) with its windows and
    # no cap; a global row and a scratch window.
    Case("tree-d96-no-cap-f32", 5, 6, 2, 100, 70, 20, softcap=None, scratch=2, head_dim=96,
         global_row=1),
    Case("decode-d96-bf16", 1, 4, 4, 100, 77, 20, softcap=None, dtype=jnp.bfloat16,
         head_dim=96),
    # Phi-2's head_dim 80 (128-wide tiles over the cache's 80 columns), capped and windowed
    # (Phi-2 has neither; the tiles' masking is what is checked), with a scratch window.
    Case("tree-d80-f32", 5, 6, 2, 100, 70, 20, scratch=2, head_dim=80, global_row=3),
]


def make_inputs(case: Case, seed: int):
    """(kernel arguments with NaN past the readable slots, the reference's with 0 there,
    first_visible)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 2, case.dtype)

    t, h, k, d = case.tokens, case.heads, case.kv_heads, case.head_dim
    q, k_new, v_new = normal(t, h, d), normal(t, k, d), normal(t, k, d)
    parents = np.array([-1] + list(range(t - 1)), np.int32)  # a chain: depth = index
    mask = ancestor_mask(jnp.asarray(parents), jnp.ones(t, bool))
    first = case.length + np.arange(t) - case.window + 1
    if case.global_row is not None:
        first[case.global_row] = LOWEST
    if case.blind_row is not None:
        first[case.blind_row] = case.length + 3
    scratch_mask = jnp.asarray(rng.random((t, case.scratch)) < 0.5) if case.scratch else None
    k_cache, v_cache = normal(case.capacity, k, d), normal(case.capacity, k, d)
    readable = case.length + case.scratch
    poisoned = [c.at[readable:].set(jnp.nan) for c in (k_cache, v_cache)]
    clean = [c.at[readable:].set(0) for c in (k_cache, v_cache)]
    length = jnp.int32(case.length)
    return ((q, k_new, v_new, *poisoned, length, mask, scratch_mask),
            (q, k_new, v_new, *clean, length, mask, scratch_mask),
            jnp.asarray(first, jnp.int32))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_kernel_with_windows_and_softcap_matches_reference(case):
    args, reference_args, first = make_inputs(case, seed=len(case.name))
    options = {} if case.block_sizes is None else {"block_sizes": case.block_sizes}
    out = verify_attention_gpu(*args, softcap=case.softcap, first_visible=first,
                               interpret=True, **options)
    want = reference(*reference_args, softcap=case.softcap, first_visible=first)
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "unwritten or poisoned output"
    tol = TOLERANCE[case.dtype]
    got, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=case.name)
    if case.length == 0 or case.dtype != jnp.float32:
        return
    # Sharp enough to see the window one slot later, or the cap left out.
    later = reference(*reference_args, softcap=case.softcap, first_visible=first + 1)
    assert np.abs(got - np.asarray(later)).max() > 100 * tol
    if case.softcap is not None:
        uncapped = reference(*reference_args, first_visible=first)
        assert np.abs(got - np.asarray(uncapped)).max() > 100 * tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_windowed_row_does_not_depend_on_the_call(dtype, monkeypatch):
    """A query row's output is bitwise the same alone (the one-token step) and as one of 16
    nodes whose windows start earlier, so that its row block reads blocks it would skip
    alone: a block below a row's window leaves its running softmax exactly as it was."""
    monkeypatch.setattr(attention_gpu, "_multiprocessor_count", lambda: 4)
    args, _ = lone_node_inputs(5, dtype)
    # Node 9 at depth 0 (fv 251); the others start up to 100 slots earlier.
    first = jnp.asarray(LENGTH - 50 + 1 - 10 * np.abs(np.arange(NODES) - NODE), jnp.int32)
    common = dict(softcap=3.0, block_sizes=GpuBlockSizes(block_kv=16), interpret=True)
    together = verify_attention_gpu(*args, first_visible=first, **common)
    alone = verify_attention_gpu(*the_node_alone(args), first_visible=first[NODE:NODE + 1],
                                 **common)
    np.testing.assert_array_equal(np.asarray(together[NODE], np.float32),
                                  np.asarray(alone[0], np.float32))


@pytest.mark.parametrize("first,match", [
    (jnp.zeros((3,), jnp.int32), r"first_visible must be int32 \[T\] = \[2\]; got int32 \(3,\)"),
    (jnp.zeros((2,), jnp.float32), r"first_visible must be int32 \[T\] = \[2\]; got float32"),
    (-1.0, "softcap must be a positive number or None; got -1.0"),
])
def test_a_bad_first_visible_or_softcap_is_refused(first, match):
    q = jnp.zeros((2, 4, 64))
    kv = jnp.zeros((2, 2, 64))
    cache = jnp.zeros((16, 2, 64))
    extras = dict(softcap=first) if isinstance(first, float) else dict(first_visible=first)
    with pytest.raises(InvalidArgumentError, match=match) as info:
        verify_attention_gpu(q, kv, kv, cache, cache, jnp.int32(3), jnp.eye(2, dtype=bool),
                             interpret=True, **extras)
    assert "\n" not in str(info.value)


def test_the_dispatcher_gives_windows_to_the_kernel_that_takes_them(monkeypatch):
    """``attention(impl="kernel")`` runs the GPU kernel with the window and cap (same output
    as the reference); a kernel module without them (``TAKES_WINDOWS`` unset) is refused in
    one line with ``"kernel"`` and left to the jnp attention, recorded, with ``"auto"``."""
    case = CASES[1]
    args, reference_args, first = make_inputs(case, seed=0)
    extras = dict(softcap=case.softcap, first_visible=first, scale=0.3)
    want = np.asarray(attention_reference(*reference_args, **extras))
    got = np.asarray(attention(*args, impl="kernel", **extras))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert kernels.takes_windows("gpu")
    monkeypatch.delattr(attention_gpu, "TAKES_WINDOWS")
    with pytest.raises(InvalidArgumentError, match="takes no soft-capping or sliding") as info:
        attention(*args, impl="kernel", **extras)
    assert "\n" not in str(info.value)
    # As on a GPU: "auto" reaches the kernel dispatcher.
    monkeypatch.setattr(kernels, "select_variant", lambda *args: ("gpu", False))
    with kernels.fallbacks.collecting() as reasons:
        out = attention(*reference_args, impl="auto", **extras)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert any("takes no soft-capping" in str(reason) for reason in reasons), reasons
