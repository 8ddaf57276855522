"""Draft assets side by side in decoding: ``ar`` and each method that takes a draft, once per
draft, on the same HumanEval prompts, interleaved per prompt (so load drifts hit every
configuration alike), after a warm-up that compiles each program::

    python benchmarks/experiments/compare_drafts.py --skip 8 --limit 32 --temperatures 0,1 \\
        --methods staged,spec --drafts shipped=specjax/assets/smollm2-135m new=RUN/asset \\
        --json benchmarks/results/cpu/compare_drafts.json

Per configuration and temperature: the median over prompts of the speedup against ``ar``
on that prompt, the median ``mean_accepted`` (tokens per target pass), the summed
``tokens_by_origin`` and the draft's share of the tokens, and how many outputs equal
``ar``'s (with the coupled rule, at every temperature). Method settings are the
defaults for this machine's backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import specjax
    from specjax.checkpoints_tools.sources import load_bundled_draft
    from specjax.harness.environment import git_commit, machine, versions
    from specjax.humaneval import humaneval_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip", type=int, default=8, help="first HumanEval prompt index")
    parser.add_argument("--limit", type=int, default=32, help="one past the last index")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=_floats, default=[0.0])
    parser.add_argument("--methods", default="staged,spec")
    parser.add_argument("--drafts", nargs="+", required=True, metavar="NAME=ASSET_DIR")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0 <= args.skip < args.limit:
        parser.error(f"need 0 <= --skip < --limit, got {args.skip} and {args.limit}")
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in ("spec", "tree", "staged")]
    if unknown or not methods:
        parser.error(f"--methods takes spec, tree and staged, got {args.methods!r}")
    paths = {}
    for item in args.drafts:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in paths:
            parser.error(f"--drafts takes distinct NAME=ASSET_DIR, got {item!r}")
        paths[name] = path

    model = specjax.load(args.model)
    drafts = {name: load_bundled_draft(model, path) for name, path in paths.items()}
    configs = {"ar": dict(method="ar")}
    for method in methods:
        for name, draft in drafts.items():
            configs[f"{method}-{name}"] = dict(method=method, draft=draft)
    prompts = humaneval_prompts(args.limit)[args.skip:]
    started = time.time()
    load_start = os.getloadavg()
    for options in configs.values():  # compile outside the timed runs
        for temperature in args.temperatures:
            specjax.generate(model, prompts[0], max_new_tokens=8, temperature=temperature,
                             **options)
    rows = []
    for index, prompt in enumerate(prompts):
        for temperature in args.temperatures:
            reference = None
            for name, options in configs.items():
                out = specjax.generate(model, prompt, max_new_tokens=args.max_new_tokens,
                                       temperature=temperature, seed=0, **options)
                reference = out.tokens if reference is None else reference
                stats = out.stats
                rows.append({"prompt": args.skip + index, "temperature": temperature,
                             "config": name, "new_tokens": stats["new_tokens"],
                             "seconds": stats["seconds"],
                             "tokens_per_s": stats["tokens_per_s"],
                             "mean_accepted": stats["mean_accepted"],
                             "tokens_by_origin": stats["tokens_by_origin"],
                             "matches_ar": list(out.tokens) == list(reference)})
            mine = rows[-len(configs):]
            print(f"prompt {args.skip + index} T={temperature:g}: " + ", ".join(
                f"{r['config']} {r['tokens_per_s']:.1f} tok/s acc {r['mean_accepted']:.2f}"
                for r in mine), file=sys.stderr, flush=True)

    summary = {}
    for temperature in args.temperatures:
        at_t = [r for r in rows if r["temperature"] == temperature]
        ar_speed = {r["prompt"]: r["tokens_per_s"] for r in at_t if r["config"] == "ar"}
        for name in configs:
            mine = [r for r in at_t if r["config"] == name]
            origins: dict = {}
            for r in mine:
                for key, value in r["tokens_by_origin"].items():
                    origins[key] = origins.get(key, 0) + value
            tokens = sum(r["new_tokens"] for r in mine)
            summary[f"{name}@T={temperature:g}"] = {
                "median_speedup_vs_ar": statistics.median(
                    r["tokens_per_s"] / ar_speed[r["prompt"]] for r in mine),
                "total_tokens_per_s": tokens / sum(r["seconds"] for r in mine),
                "median_mean_accepted": statistics.median(r["mean_accepted"] for r in mine),
                "tokens_by_origin": origins,
                "draft_share": origins.get("draft", 0) / max(tokens, 1),
                "match_ar": f"{sum(r['matches_ar'] for r in mine)}/{len(mine)}"}
    for name, entry in summary.items():
        print(f"{name:>22}: {entry['median_speedup_vs_ar']:.2f}x ar (median), "
              f"{entry['total_tokens_per_s']:.1f} tok/s, accepted "
              f"{entry['median_mean_accepted']:.2f}, draft {100 * entry['draft_share']:.1f}%, "
              f"= ar {entry['match_ar']}")
    if args.json:
        record = {"benchmark": "compare_drafts", "argv": sys.argv[1:],
                  "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                  "load_average": {"start": load_start, "end": os.getloadavg()},
                  "machine": machine(), "versions": versions(), "git": git_commit(),
                  "prompts": [args.skip, args.limit], "max_new_tokens": args.max_new_tokens,
                  "drafts": paths, "summary": summary, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
