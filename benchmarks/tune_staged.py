"""Side-by-side probe of staged / n-gram settings, used to pick the library defaults.

Every configuration runs on the same prompts, interleaved per prompt (machine drift hits
all alike), after a short warm-up that compiles each program; the report is the median
tokens/s over prompts, the ratio to ``ar`` and the median ``mean_accepted``.

    python benchmarks/tune_staged.py --limit 3 --max-new-tokens 128 \
        --json benchmarks/results/tune_staged_cpu.json

Besides the named configurations below, ``--configs`` takes ad-hoc ones written
``method:option=value,...`` with tuple values joined by ``/``, e.g.
``staged:tree_budget=8,draft_rounds=3,stage2_prior=0/0`` or ``spec:draft_depth=6``
(``staged:`` alone: the method's defaults for this machine's backend). The
report adds, per configuration, the share of tokens from each origin (draft, lookup,
n-gram, target) and the draft passes per target pass, which do not depend on the machine's
load (tokens/s does).
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


def _value(text: str):
    parts = text.split("/")
    values = []
    for part in parts:
        for cast in (int, float):
            try:
                values.append(cast(part))
                break
            except ValueError:
                continue
        else:
            values.append({"true": True, "false": False}.get(part.lower(), part))
    return tuple(values) if len(parts) > 1 else values[0]


def parse_config(name: str) -> dict:
    """``method:key=value,...`` -> generate() keywords (see the module docstring)."""
    method, _, rest = name.partition(":")
    options = {"method": method}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"configuration {name!r}: {item!r} is not option=value")
        options[key] = _value(value)
    return options


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax

    import specjax
    from specjax.harness.environment import git_commit, machine, versions, write_json
    from specjax.humaneval import humaneval_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32",
                        help="parameter dtype (bfloat16 on a GPU: what generate runs there)")
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
        configs = {"ar": CONFIGS["ar"]}
        for n in names:
            if n in CONFIGS:
                configs[n] = CONFIGS[n]
            elif ":" in n:
                configs[n] = parse_config(n)
            else:
                parser.error(f"unknown configuration {n!r}; known: {', '.join(CONFIGS)}, or "
                             "method:option=value,...")

    model = specjax.load(args.model, dtype=args.dtype)
    if args.draft_asset:
        draft = specjax.loading.resolve_draft(model, args.draft_asset)
        for options in configs.values():
            if options["method"] == "staged":
                options["draft"] = draft
    prompts = humaneval_prompts(args.limit)[args.skip:]
    for options in configs.values():  # a bad configuration fails here, before any timing
        specjax.methods.method_options(options["method"],
                                       **{k: v for k, v in options.items()
                                          if k not in ("method", "draft")})
    sampling = dict(temperature=args.temperature, seed=0)
    for options in configs.values():  # compile outside the timed runs
        specjax.generate(model, prompts[0], max_new_tokens=8, **sampling, **options)
    rows = []
    header = {"command": " ".join(["python", "benchmarks/tune_staged.py", *sys.argv[1:]]),
              "machine": machine(), "versions": versions(), "git": git_commit(),
              "limit": args.limit, "skip": args.skip, "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "backend": jax.default_backend()}

    def summarize(rows: list[dict], complete: bool) -> None:
        # Also after every prompt ("complete": false), so that a run stopped part-way
        # (gpu_run.sh's STEP_TIMEOUT, a device call's limit) keeps its prompts.
        ar = statistics.median(r["tokens_per_s"] for r in rows if r["config"] == "ar")
        summary = {}
        for name in configs:
            mine = [r for r in rows if r["config"] == name]
            rate = statistics.median(r["tokens_per_s"] for r in mine)
            tokens = sum(r["new_tokens"] for r in mine)
            calls = sum(r["target_calls"] for r in mine)
            origins = {}
            for r in mine:
                for origin, count in (r["tokens_by_origin"] or {}).items():
                    origins[origin] = origins.get(origin, 0) + count
            summary[name] = {"tokens_per_s": rate, "vs_ar": rate / ar,
                             "mean_accepted": statistics.median(r["mean_accepted"] for r in mine),
                             "accepted_total": tokens / calls,
                             "draft_calls_per_target_call":
                                 sum(r["draft_calls"] for r in mine) / calls,
                             "origin_share": {o: c / tokens for o, c in origins.items()},
                             "all_same_as_ar": all(r["same_as_ar"] for r in mine)}
            share = " ".join(f"{o} {c / tokens:.0%}" for o, c in origins.items() if c)
            if complete:
                print(f"{name:32s} {rate:6.1f} tok/s  x{rate / ar:.2f}  accepted "
                      f"{tokens / calls:.2f}  draft/target "
                      f"{summary[name]['draft_calls_per_target_call']:.2f}  {share}  "
                      f"same as ar: {summary[name]['all_same_as_ar']}", flush=True)
        if args.json:
            record = {**header, "summary": summary, "rows": rows, "complete": complete}
            write_json(args.json, json.loads(json.dumps(record, default=str)),
                       warn=complete)  # a dirty tree is said once, at the last save

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
                         "new_tokens": out.stats["new_tokens"],
                         "target_calls": out.stats["target_calls"],
                         "draft_calls": out.stats["draft_calls"],
                         "tokens_by_origin": out.stats.get("tokens_by_origin"),
                         "same_as_ar": out.tokens == reference})
        summarize(rows, complete=index == len(prompts) - 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
