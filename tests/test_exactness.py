"""``stats["exact"]``: each run says whether its tokens are ``ar``'s bit for bit, up to
rounding, or a sample of the same distribution, and why (specjax/methods/exactness.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax import kernels, models
from specjax.kernel_options import KernelOptions
from specjax.kernels.fallbacks import Fallback, collecting
from specjax.methods import exactness
from specjax.methods.exactness import (BITWISE, IN_DISTRIBUTION, UP_TO_ROUNDING,
                                       run_exactness)

from conftest import random_prompt

AUTO, FUSED = KernelOptions(), KernelOptions(attention="fused")


def test_the_fused_pass_limit_is_the_models():
    assert exactness.FUSED_MAX_TOKENS == models.FUSED_MAX_TOKENS


@pytest.mark.parametrize("method,verify,sampled,platform,kernels,rows,level,fragment", [
    ("ar", None, True, "gpu", AUTO, 1, BITWISE, "reference"),
    # ar's jump-forward under a constraint: one pass over a forced run of up to 8 tokens
    ("ar", None, False, "cpu", AUTO, 9, UP_TO_ROUNDING, "forced run"),
    ("ar", None, True, "gpu", FUSED, 9, BITWISE, "row-independent"),
    ("tree", "coupled", True, "gpu", FUSED, 32, BITWISE, "row-independent"),
    ("staged", "greedy", False, "tpu", FUSED, 64, BITWISE, "bit for bit"),
    ("tree", "coupled", False, "gpu", FUSED, 256, UP_TO_ROUNDING, "at most 128"),
    ("tree", "coupled", False, "gpu", AUTO, 32, UP_TO_ROUNDING, "by row count"),
    ("spec", "coupled", False, "cpu", AUTO, 7, UP_TO_ROUNDING, "matrix-vector"),
    ("spec", "coupled", False, "cpu", FUSED, 7, UP_TO_ROUNDING, "interpreter"),
    ("tree", "match", True, "gpu", FUSED, 32, IN_DISTRIBUTION, "'match'"),
    ("spec", "rejection", True, "cpu", AUTO, 7, IN_DISTRIBUTION, "distribution"),
    # at temperature 0 every rule is greedy: the tokens are ar's (up to rounding here)
    ("spec", "rejection", False, "cpu", AUTO, 7, UP_TO_ROUNDING, "near-tie"),
])
def test_each_path_has_its_level_and_reason(method, verify, sampled, platform, kernels,
                                            rows, level, fragment):
    got, reason = run_exactness(method, verify, sampled, platform, kernels, rows)
    assert got == level
    assert fragment in reason and "\n" not in reason


# What kernels/__init__.py and the models record when the fused path runs something else.
LINEAR_REFERENCE = Fallback("fused_linear", "width 100 is not a multiple of 16; its jnp "
                            "reference ran", row_independent=False)
PREFILL = Fallback("fused layers", "a 300-token pass (the fused kernels take at most 128 "
                   "tokens); attention='auto' ran", row_independent=True)
MOSAIC_TO_TRITON = Fallback("fused_linear", "the Mosaic GPU kernel takes no GELU; the call "
                            "goes to Triton", row_independent=True)


def _fused_attention_fallbacks(head_dim: int, capacity: int) -> set:
    """The fallbacks the GPU variant's fused attention records, traced (nothing runs) for
    a 3-node pass with 4 query heads over 2 KV heads of ``head_dim`` and a ``capacity``-slot
    stacked cache: the packed kernel's check, then the unpacked kernel."""
    sds = jax.ShapeDtypeStruct
    q, new = sds((3, 4, head_dim), jnp.float32), sds((3, 2, head_dim), jnp.float32)
    cache = sds((2, capacity, 2, head_dim), jnp.float32)
    with collecting() as reasons:
        kernels.packed_attention_takes((2, 16, 8, head_dim), jnp.float32, cache, cache,
                                       num_heads=4, variant="gpu")
        jax.eval_shape(lambda *a: kernels.ordered_attention(*a[:7], layer=a[7],
                                                            variant="gpu"),
                       q, new, new, cache, cache, sds((), jnp.int32), sds((3, 3), jnp.bool_),
                       sds((), jnp.int32))
    return reasons


@pytest.mark.parametrize("head_dim,capacity,level", [
    (256, 64, BITWISE), (96, 64, BITWISE), (80, 64, BITWISE), (64, 64, BITWISE),
    (64, 72, UP_TO_ROUNDING)],  # a capacity no ordered block divides: the verify kernel
    ids=lambda v: str(v))
def test_a_fused_run_whose_attention_fell_back_is_not_called_bitwise(head_dim, capacity,
                                                                     level):
    """Gemma's head size (256), Phi-3's (96) and Phi-2's (80) take the position-ordered
    kernels: no fallback, bitwise. A cache whose capacity the ordered kernel refuses runs
    the verify kernel, which is not position-ordered: up to rounding, naming it."""
    reasons = _fused_attention_fallbacks(head_dim, capacity)
    got, reason = run_exactness("tree", "coupled", False, "gpu", FUSED, 32, reasons)
    assert got == level, reason
    assert bool(reasons) == (level == UP_TO_ROUNDING), reasons
    if level == UP_TO_ROUNDING:
        assert "ordered_attention: " in reason and "\n" not in reason


@pytest.mark.parametrize("fallbacks,level", [
    ([LINEAR_REFERENCE, PREFILL], UP_TO_ROUNDING), ([PREFILL, MOSAIC_TO_TRITON], BITWISE),
    ([], BITWISE),
    # The flag decides, not the words: the same lines with the flag flipped
    ([dataclasses.replace(LINEAR_REFERENCE, row_independent=True)], BITWISE),
    ([dataclasses.replace(PREFILL, row_independent=False)], UP_TO_ROUNDING)],
    ids=["reference", "prefill-and-mosaic", "none", "reference-flagged-independent",
         "prefill-flagged-dependent"])
def test_a_fused_run_that_fell_back_is_not_called_bitwise(fallbacks, level):
    """A fused run with a fallback its site records as not row-independent (a projection's
    jnp reference) is up to rounding, naming it; a long prefill (shared by ar) or another
    row-tiled kernel in place of the first keeps it bitwise. The site's flag decides
    (:class:`~specjax.kernels.fallbacks.Fallback`), not the words of the reason."""
    got, reason = run_exactness("tree", "coupled", False, "gpu", FUSED, 32, fallbacks)
    assert got == level, reason
    if level == UP_TO_ROUNDING:
        assert str(fallbacks[0]) in reason and "\n" not in reason


def test_a_run_reports_its_exactness(spec_target, spec_drafts):
    prompt = random_prompt(7, 9)
    ar = specjax.generate(spec_target, prompt, max_new_tokens=6, method="ar")
    spec = specjax.generate(spec_target, prompt, max_new_tokens=6, method="spec",
                            draft=spec_drafts["weak"])
    sampled = specjax.generate(spec_target, prompt, max_new_tokens=6, method="spec",
                               draft=spec_drafts["weak"], temperature=1.0, verify="rejection")
    assert (ar.stats["exact"], spec.stats["exact"], sampled.stats["exact"]) == (
        BITWISE, UP_TO_ROUNDING, IN_DISTRIBUTION)
    assert all(r.stats["exact_reason"] for r in (ar, spec, sampled))
