"""The CPU attention path (blocked, reads only the slots in use) against the reference."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.attention import attention, attention_blocked, attention_reference
from specjax.tree import ancestor_mask


@st.composite
def problems(draw):
    num_kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3, 4]))
    tokens = draw(st.integers(1, 6))
    capacity = draw(st.integers(8, 70))
    window = draw(st.integers(0, 4))
    length = draw(st.integers(0, capacity - window))
    block = draw(st.sampled_from([4, 8, 16, 128]))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, tokens)]
    seed = draw(st.integers(0, 2**16))
    return num_kv, group, tokens, capacity, window, length, block, parents, seed


@settings(max_examples=15, deadline=None)
@given(problems())
def test_blocked_equals_reference(problem):
    num_kv, group, tokens, capacity, window, length, block, parents, seed = problem
    rng = np.random.default_rng(seed)
    head_dim = 8
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    q = normal(tokens, num_kv * group, head_dim)
    k_new, v_new = normal(tokens, num_kv, head_dim), normal(tokens, num_kv, head_dim)
    k_cache, v_cache = normal(capacity, num_kv, head_dim), normal(capacity, num_kv, head_dim)
    mask = np.asarray(ancestor_mask(np.asarray(parents, np.int32), np.ones(tokens, bool)))
    scratch = rng.random((tokens, window)) < 0.5 if window else None
    # Each jitted: one compile per example instead of one per operation and shape.
    expected = jax.jit(attention_reference)(q, k_new, v_new, k_cache, v_cache, length, mask,
                                            scratch)
    got = jax.jit(attention_blocked, static_argnames="block")(
        q, k_new, v_new, k_cache, v_cache, length, mask, scratch, block=block)
    # Blockwise (online) softmax against one softmax: outputs are convex combinations of
    # N(0, 1) values after 8-term scores over at most a few dozen slots; 2e-5 * (1 + |want|)
    # exceeds sum_tolerance(longest_sum=64, stages=2, magnitude=|want|) (tests/tolerances.py).
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=2e-5)


def test_blocked_ignores_slots_past_the_window():
    """Changing cache contents beyond length + M must not change the output (and a wrong
    visibility rule, e.g. reading the whole last block, would)."""
    rng = np.random.default_rng(1)
    q, kn, vn = (rng.normal(size=(2, 4, 8)).astype(np.float32),
                 rng.normal(size=(2, 2, 8)).astype(np.float32),
                 rng.normal(size=(2, 2, 8)).astype(np.float32))
    kc, vc = rng.normal(size=(2, 40, 2, 8)).astype(np.float32)
    mask = np.tril(np.ones((2, 2), bool))
    base = attention_blocked(q, kn, vn, kc, vc, 13, mask, np.ones((2, 2), bool), block=8)
    kc2, vc2 = kc.copy(), vc.copy()
    kc2[15:] += 5.0
    vc2[15:] -= 3.0
    moved = attention_blocked(q, kn, vn, kc2, vc2, 13, mask, np.ones((2, 2), bool), block=8)
    np.testing.assert_array_equal(np.asarray(base), np.asarray(moved))
    kc2[14] += 5.0  # the second scratch slot is visible: now the output must change
    assert not np.allclose(np.asarray(base), np.asarray(
        attention_blocked(q, kn, vn, kc2, vc2, 13, mask, np.ones((2, 2), bool), block=8)))


def test_auto_uses_the_blocked_path_on_cpu(monkeypatch):
    import specjax.attention as module

    assert jax.default_backend() == "cpu"
    calls = []
    monkeypatch.setattr(module, "attention_blocked",
                        lambda *a, **k: calls.append(1) or attention_reference(*a[:8]))
    x = np.ones((1, 2, 4), np.float32)
    attention(x, x[:, :1], x[:, :1], np.ones((8, 1, 4), np.float32),
              np.ones((8, 1, 4), np.float32), 3, np.ones((1, 1), bool), impl="auto")
    assert calls == [1]
