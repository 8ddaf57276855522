"""Stage-2 tables side by side: ``staged`` (and ``ar`` as the reference) with each table
file, on the same prompts, interleaved per prompt, after a warm-up that compiles each
program. Reports per configuration the median and total tokens/s, the median
``mean_accepted``, the summed ``tokens_by_origin`` and whether every output equals ``ar``.

    python benchmarks/experiments/compare_ngram_tables.py --skip 150 --limit 158 \\
        --draft-asset DRAFT_ASSET_DIR \\
        --tables shipped=specjax/assets/smollm2-135m/ngram.npz drafted=ngram_draft.npz \\
        --json benchmarks/results/cpu/ngram_from_draft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import specjax
    from specjax.drafters.ngram import read_ngram_metadata
    from specjax.harness.environment import git_commit, machine, versions
    from specjax.humaneval import humaneval_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip", type=int, default=150, help="first HumanEval prompt index")
    parser.add_argument("--limit", type=int, default=158, help="one past the last index")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--draft-asset", default=None, metavar="DIR")
    parser.add_argument("--tables", nargs="+", required=True, metavar="NAME=PATH")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    tables = dict(item.split("=", 1) for item in args.tables)
    model = specjax.load(args.model)
    draft = specjax.loading.resolve_draft(model, args.draft_asset)
    prompts = humaneval_prompts(args.limit)[args.skip:]
    configs = {"ar": dict(method="ar")}
    for name, path in tables.items():
        configs[f"staged-{name}"] = dict(method="staged", draft=draft, ngram=path)
    sampling = dict(temperature=args.temperature, seed=0)
    for options in configs.values():  # compile outside the timed runs
        specjax.generate(model, prompts[0], max_new_tokens=8, **sampling, **options)
    rows = []
    started = time.time()
    for index, prompt in enumerate(prompts):
        reference = None
        for name, options in configs.items():
            out = specjax.generate(model, prompt, max_new_tokens=args.max_new_tokens,
                                   **sampling, **options)
            reference = out.tokens if reference is None else reference
            stats = out.stats
            rows.append({"prompt": args.skip + index, "config": name,
                         "new_tokens": stats["new_tokens"], "seconds": stats["seconds"],
                         "tokens_per_s": stats["tokens_per_s"],
                         "mean_accepted": stats["mean_accepted"],
                         "tokens_by_origin": stats["tokens_by_origin"],
                         "matches_ar": list(out.tokens) == list(reference)})
        print(f"prompt {args.skip + index}: " + ", ".join(
            f"{r['config']} {r['tokens_per_s']:.1f} tok/s acc {r['mean_accepted']:.2f}"
            for r in rows[-len(configs):]), file=sys.stderr, flush=True)
    summary = {}
    for name in configs:
        mine = [r for r in rows if r["config"] == name]
        origins: dict = {}
        for r in mine:
            for key, value in r["tokens_by_origin"].items():
                origins[key] = origins.get(key, 0) + value
        summary[name] = {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "total_tokens_per_s": sum(r["new_tokens"] for r in mine)
            / sum(r["seconds"] for r in mine),
            "median_mean_accepted": statistics.median(r["mean_accepted"] for r in mine),
            "tokens_by_origin": origins,
            "all_match_ar": all(r["matches_ar"] for r in mine)}
    ar = summary["ar"]["total_tokens_per_s"]
    for entry in summary.values():
        entry["speedup_vs_ar_total"] = entry["total_tokens_per_s"] / ar
    for name, entry in summary.items():
        print(f"{name:>24}: {entry['total_tokens_per_s']:.1f} tok/s total "
              f"({entry['speedup_vs_ar_total']:.2f}x ar), mean_accepted median "
              f"{entry['median_mean_accepted']:.2f}, origins {entry['tokens_by_origin']}, "
              f"match ar {entry['all_match_ar']}")
    if args.json:
        record = {"benchmark": "compare_ngram_tables", "argv": sys.argv[1:],
                  "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                  "load_average": os.getloadavg(), "machine": machine(),
                  "versions": versions(), "git": git_commit(),
                  "prompts": [args.skip, args.limit], "max_new_tokens": args.max_new_tokens,
                  "temperature": args.temperature, "draft_asset": args.draft_asset,
                  "tables": {name: {"path": path, "metadata": read_ngram_metadata(path)}
                             for name, path in tables.items()},
                  "summary": summary, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
