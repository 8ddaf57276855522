"""Generation speed with and without XLA compiler options, interleaved per prompt.

An option that makes one forward pass faster in isolation (``bench_verify.py``) need not
make generation faster: the generation program is one ``while_loop`` holding the target's
and the draft's passes, the sampler and the bookkeeping, and XLA schedules it as a whole.
This script settles it for a given option set, on the programs users run: for each method
and each HumanEval prompt it runs ``specjax.generate`` once with the options
(``specjax.KernelOptions(compiler_options=...)``) and once without, alternating which goes first from
prompt to prompt, after one compiling run of each. It reports, per method, the median over
prompts of the per-prompt tokens/s ratio (options / none) and the total tokens/s of each
side, and checks that both sides produced the same tokens. A row's ``prompt`` is its
position in the run: the HumanEval problem is number ``--skip`` + ``prompt``.

    python benchmarks/experiments/ab_compiler_options.py \\
        --option xla_cpu_enable_concurrency_optimized_scheduler=false \\
        --methods ar,spec,tree,staged --limit 8 --max-new-tokens 128 --json ab.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import specjax
from specjax.errors import InvalidArgumentError
from specjax.harness.environment import machine, write_json
from specjax.humaneval import humaneval_prompts


def parse_option(text: str) -> tuple[str, object]:
    """``name=value`` -> (name, value): ``true``/``false`` become booleans, integers ints,
    anything else stays a string (XLA's compiler options take these three kinds)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise InvalidArgumentError(f"--option {text!r}: expected NAME=VALUE")
    value = value.strip()
    if value.lower() in ("true", "false"):
        return name.strip(), value.lower() == "true"
    try:
        return name.strip(), int(value)
    except ValueError:
        return name.strip(), value


def run_ab(model, prompts: list[list[int]], methods: list[str], options: dict,
           max_new_tokens: int) -> dict:
    """Per method: every prompt's tokens/s with and without ``options``, their ratios, and
    whether the two sides generated the same tokens."""
    with_options = specjax.KernelOptions(compiler_options=options)

    def run(method, ids, side):
        return specjax.generate(model, ids, method=method, max_new_tokens=max_new_tokens,
                                stop=[], kernels=with_options if side == "with" else None)

    for method in methods:  # compile both programs before timing anything
        for side in ("with", "without"):
            run(method, prompts[0], side)
    rows = {method: [] for method in methods}
    for index, ids in enumerate(prompts):
        for method in methods:
            order = ("with", "without") if index % 2 == 0 else ("without", "with")
            out = {side: run(method, ids, side) for side in order}
            rate = {side: r.stats["new_tokens"] / r.stats["seconds"] for side, r in out.items()}
            rows[method].append({
                "prompt": index, "first": order[0],
                "tokens_per_s_with": rate["with"], "tokens_per_s_without": rate["without"],
                "ratio": rate["with"] / rate["without"],
                "new_tokens": out["with"].stats["new_tokens"],
                "seconds_with": out["with"].stats["seconds"],
                "seconds_without": out["without"].stats["seconds"],
                "same_tokens": list(out["with"].tokens) == list(out["without"].tokens)})
    summary = {}
    for method, method_rows in rows.items():
        tokens = sum(r["new_tokens"] for r in method_rows)
        summary[method] = {
            "median_ratio": statistics.median(r["ratio"] for r in method_rows),
            "total_tokens_per_s_with": tokens / sum(r["seconds_with"] for r in method_rows),
            "total_tokens_per_s_without": tokens / sum(r["seconds_without"] for r in method_rows),
            "same_tokens": sum(r["same_tokens"] for r in method_rows),
            "prompts": len(method_rows)}
    return {"rows": rows, "summary": summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA compiler option of the 'with' side (repeatable)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="ar,spec,tree,staged")
    parser.add_argument("--skip", type=int, default=0, help="HumanEval prompts to skip")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        options = dict(parse_option(text) for text in args.option)
        if not options:
            raise InvalidArgumentError("give at least one --option NAME=VALUE")
    except InvalidArgumentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    model = specjax.load(args.model)
    texts = humaneval_prompts(args.skip + args.limit)[args.skip:]
    prompts = [model.tokenizer(text)["input_ids"] for text in texts]
    host = machine()  # device, versions, commit, XLA_FLAGS, load at the start
    result = run_ab(model, prompts, methods, options, args.max_new_tokens)
    for method, row in result["summary"].items():
        print(f"{method}: with/without median ratio {row['median_ratio']:.3f}, total tok/s "
              f"{row['total_tokens_per_s_with']:.1f} / {row['total_tokens_per_s_without']:.1f}, "
              f"same tokens {row['same_tokens']}/{row['prompts']}")
    result.update({"benchmark": "ab_compiler_options", "options": options, **host,
                   "load_average_end": os.getloadavg(), "config": vars(args)})
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
