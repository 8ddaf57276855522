"""Drafting at T > 0 from the draft's probabilities or by its argmax (issue 60, item 3).

For each acceptance rule, ``spec`` and ``tree`` (the shipped EAGLE-3 draft, the CPU's
default shapes) decode the same prompts at temperature 1 with ``draft_ranking="sampled"``
(the draft's children drawn from its distribution: with the target's own noise under
``coupled``, a fresh sample under ``match`` and ``rejection``) and ``"argmax"`` (its most
likely children), and record the tokens committed per target pass: the only thing the
option changes (every rule is exact either way). Tokens per pass do not depend on the
machine's speed or load, so this runs beside other work.

    .venv/bin/python benchmarks/experiments/draft_ranking.py --prompts 32 \\
        --json benchmarks/results/cpu/draft_ranking_DATE.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import specjax
from specjax.harness.environment import machine, write_json
from specjax.humaneval import humaneval_prompts

# (method, rule, ranking, extra options); a dynamic tree under rejection drafts by argmax
# only (its best nodes are no sample of the draft), so its fixed k-ary tree of the same
# budget is compared there too.
CONFIGS = [(method, rule, ranking, {})
           for method in ("spec", "tree") for rule in ("coupled", "match", "rejection")
           for ranking in ("sampled", "argmax")
           if not (method == "tree" and rule == "rejection")]
CONFIGS += [("tree", "rejection", "argmax", {}),
            ("tree", "rejection", "sampled", {"topology": "kary"}),
            ("tree", "rejection", "argmax", {"topology": "kary"})]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="the first N HumanEval prompts")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rules", default="coupled,match,rejection",
                        help="the acceptance rules compared (comma-separated)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rules = args.rules.split(",")
    host = machine()
    model = specjax.load("smollm2-135m")
    prompts = humaneval_prompts(args.prompts)
    records = []
    for method, rule, ranking, extra in [c for c in CONFIGS if c[1] in rules]:
        started, per_row, tokens, passes = time.perf_counter(), [], 0, 0
        for first in range(0, len(prompts), args.batch_size):
            rows = prompts[first:first + args.batch_size]
            out = specjax.generate(model, rows, method=method, verify=rule,
                                   draft_ranking=ranking, temperature=args.temperature,
                                   max_new_tokens=args.max_new_tokens,
                                   seed=list(range(first, first + len(rows))), **extra)
            for result in out:
                per_row.append(result.stats["mean_accepted"])
                tokens += result.stats["new_tokens"]
                passes += result.stats["target_calls"]
        record = {"method": method, "verify": rule, "draft_ranking": ranking, **extra,
                  "tokens_per_pass": tokens / passes,
                  "median_tokens_per_pass": statistics.median(per_row),
                  "new_tokens": tokens, "target_calls": passes, "per_prompt": per_row,
                  "seconds": round(time.perf_counter() - started, 1)}
        records.append(record)
        print(f"{method:5s} {rule:9s} {ranking:8s} {extra or ''} "
              f"{record['tokens_per_pass']:.3f} tokens/pass "
              f"(median {record['median_tokens_per_pass']:.3f}), {record['seconds']} s",
              flush=True)
    result = {"benchmark": "draft_ranking", "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "rules": rules,
              "command": "python benchmarks/experiments/draft_ranking.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              **host, "records": records}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
