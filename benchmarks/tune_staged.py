"""Side-by-side probe of staged / n-gram settings, used to pick the library defaults.

Every configuration runs on the same prompts, interleaved per prompt (machine drift hits
all alike), after a short warm-up that compiles each program; the report is the median
tokens/s over prompts, the ratio to ``ar`` and the median ``mean_accepted``.

    python benchmarks/tune_staged.py --limit 3 --max-new-tokens 128 \
        --json benchmarks/results/tune_staged_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

def _staged(budget, proposal, prior, rounds=1, width=1):
    name = (f"staged-b{budget}-p{','.join(map(str, proposal))}-prior{prior[0]:g},{prior[1]:g}"
            f"-r{rounds}-w{width}")
    return name, dict(method="staged", tree_budget=budget, proposal=proposal,
                      stage2_prior=prior, draft_rounds=rounds, draft_width=width)


CONFIGS = dict([
    ("ar", dict(method="ar")),
    ("ngram-2,1,1,1,1,1,1,1", dict(method="ngram", proposal=(2, 1, 1, 1, 1, 1, 1, 1))),
    ("ngram-1x10", dict(method="ngram", proposal=(1,) * 10)),
    _staged(4, (2, 1, 1, 1), (0.0, 0.0)),
    _staged(4, (2, 1, 1, 1), (0.5, 0.2)),
    _staged(4, (2, 1, 1, 1), (0.3, 0.1)),
    _staged(4, (1, 1, 1, 1), (0.5, 0.2)),
    _staged(4, (2, 1, 1, 1, 1, 1), (0.5, 0.2)),
    _staged(5, (2, 1, 1, 1, 1), (0.5, 0.2)),
    _staged(6, (2, 1, 1, 1, 1, 1), (0.5, 0.2)),
    _staged(8, (2, 1, 1, 1, 1, 1, 1, 1), (0.5, 0.2)),
    _staged(8, (2, 1, 1, 1, 1, 1, 1, 1), (0.7, 0.3)),
    _staged(8, (2, 1, 1, 1, 1, 1, 1, 1), (0.3, 0.1)),
    _staged(12, (3, 2, 1, 1, 1, 1, 1, 1, 1, 1), (0.5, 0.2)),
    _staged(8, (2, 1, 1, 1, 1, 1, 1, 1), (0.5, 0.2), width=2),
    _staged(8, (2, 1, 1, 1), (0.5, 0.2), rounds=2),
    _staged(6, (2, 1, 1, 1), (0.5, 0.2), rounds=2),
    _staged(4, (2, 1, 1, 1, 1, 1), (0.7, 0.3)),
    _staged(6, (2, 1, 1, 1, 1, 1), (0.7, 0.3)),
    _staged(6, (2, 1, 1, 1, 1, 1, 1, 1), (0.9, 0.5)),
    _staged(8, (2, 1, 1, 1, 1, 1, 1, 1), (0.9, 0.5)),
])


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import specjax
    from specjax.benchmark.environment import git_commit, machine, versions
    from specjax.benchmark.humaneval import humaneval_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out the first SKIP prompts (probe other prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-asset", default=None, metavar="DIR",
                        help="a draft asset directory (default: the one shipped)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; otherwise sampled (coupled rule), same seed for all")
    parser.add_argument("--configs", default=None,
                        help="semicolon-separated subset of the configuration names to run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.configs:
        names = args.configs.split(";")
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
        configs = {n: CONFIGS[n] for n in ["ar", *names] if n in CONFIGS}

    model = specjax.load(args.model)
    if args.draft_asset:
        draft = specjax.loading.resolve_draft(model, args.draft_asset)
        for options in configs.values():
            if options["method"] == "staged":
                options["draft"] = draft
    prompts = humaneval_prompts(args.limit)[args.skip:]
    sampling = dict(temperature=args.temperature, seed=0)
    for options in configs.values():  # compile outside the timed runs
        specjax.generate(model, prompts[0], max_new_tokens=8, **sampling, **options)
    rows = []
    for index, prompt in enumerate(prompts):
        reference = None
        for name, options in configs.items():
            out = specjax.generate(model, prompt, max_new_tokens=args.max_new_tokens, **sampling,
                                   **options)
            reference = out.tokens if reference is None else reference
            rows.append({"prompt": index, "config": name,
                         "options": {k: v for k, v in options.items() if k != "draft"},
                         "tokens_per_s": out.stats["tokens_per_s"],
                         "mean_accepted": out.stats["mean_accepted"],
                         "same_as_ar": out.tokens == reference})
    ar = statistics.median(r["tokens_per_s"] for r in rows if r["config"] == "ar")
    summary = {}
    for name in configs:
        mine = [r for r in rows if r["config"] == name]
        rate = statistics.median(r["tokens_per_s"] for r in mine)
        summary[name] = {"tokens_per_s": rate, "vs_ar": rate / ar,
                         "mean_accepted": statistics.median(r["mean_accepted"] for r in mine),
                         "all_same_as_ar": all(r["same_as_ar"] for r in mine)}
        print(f"{name:32s} {rate:6.1f} tok/s  x{rate / ar:.2f}  accepted "
              f"{summary[name]['mean_accepted']:.2f}  same as ar: "
              f"{summary[name]['all_same_as_ar']}")
    if args.json:
        record = {"command": " ".join(["python", "benchmarks/tune_staged.py", *sys.argv[1:]]),
                  "machine": machine(), "versions": versions(), "git": git_commit(), "summary": summary, "rows": rows,
                  "limit": args.limit, "skip": args.skip, "temperature": args.temperature,
                  "max_new_tokens": args.max_new_tokens}
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
