"""``stats["exact"]``: each run says whether its tokens are ``ar``'s bit for bit, up to
rounding, or a sample of the same distribution, and why (specjax/methods/exactness.py)."""

from __future__ import annotations

import pytest

import specjax
from specjax import models
from specjax.kernel_options import KernelOptions
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


# What kernels/__init__.py records when the fused path runs something else.
HEAD_256 = ("ordered_attention_packed: head_dim 256 is not one of (16, 32, 64, 128); the "
            "fused layers run the unpacked kernels")
LINEAR_REFERENCE = "fused_linear: width 100 is not a multiple of 16; its jnp reference ran"
PREFILL = "fused layers: a 300-token pass (the fused kernels take at most 128 tokens)"
MOSAIC_TO_TRITON = "fused_linear: the Mosaic GPU kernel takes no GELU; the call goes to Triton"


@pytest.mark.parametrize("fallbacks,level", [
    ([HEAD_256], UP_TO_ROUNDING), ([LINEAR_REFERENCE, PREFILL], UP_TO_ROUNDING),
    ([PREFILL, MOSAIC_TO_TRITON], BITWISE), ([], BITWISE)])
def test_a_fused_run_that_fell_back_is_not_called_bitwise(fallbacks, level):
    """A fused run whose attention was not position-ordered, or whose projection ran its
    jnp reference, is up to rounding; a long prefill (shared by ar) or another row-tiled
    kernel in place of the first keeps it bitwise."""
    got, reason = run_exactness("tree", "coupled", False, "gpu", FUSED, 32, fallbacks)
    assert got == level, reason
    if level == UP_TO_ROUNDING:
        assert fallbacks[0] in reason and "\n" not in reason


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
