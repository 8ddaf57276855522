"""Structured output on this machine: each method under a JSON-schema constraint against
``ar`` under the same constraint and ``ar`` without it (issue 61).

The prompts ask SmolLM2 (chat template) for a HumanEval function's signature and
docstring as JSON; the schema (:data:`SCHEMA`) fixes the document's shape. Per prompt the
configurations run interleaved (each compiled by a warm-up call first), greedy, so the
constrained methods' texts must equal constrained ``ar``'s (checked and recorded). Reported
per configuration: median tokens/s over the prompts, tokens per target pass, the median
speedup over constrained ``ar`` (per-prompt ratios), and the outputs that are valid
documents (``jsonschema``). Also the cold build time of the schema's tables on the model's
vocabulary (the disk cache off) and their size.

Not measured here: jump-forward (not implemented), a transformers + outlines peer (the
``outlines`` package is not installed on this machine).

Usage::

    .venv/bin/python benchmarks/experiments/bench_constrained.py --limit 8 --max-new-tokens 96 \\
        --json benchmarks/results/cpu/constrained_2026-11-30.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jsonschema

import specjax
from specjax import humaneval
from specjax.constraints import build_tables
from specjax.harness import environment

# A function's signature and docstring: name, up to 6 arguments, a one-paragraph summary.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,30}$"},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 6},
        "returns": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "arguments", "returns", "summary"],
}
REQUEST = ("Describe this Python function as JSON with the keys name, arguments, returns "
           "and summary.\n\n{prompt}")
CONFIGS = [  # (label, method, constrained)
    ("ar", "ar", False), ("ar+schema", "ar", True), ("spec+schema", "spec", True),
    ("tree+schema", "tree", True), ("staged+schema", "staged", True),
]


def run_one(model, prompt: str, method: str, constrained: bool, max_new_tokens: int):
    kwargs = dict(method=method, max_new_tokens=max_new_tokens, chat=True)
    if constrained:
        kwargs["constraint"] = specjax.JsonSchema(SCHEMA)
    return specjax.generate(model, REQUEST.format(prompt=prompt), **kwargs)


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="HumanEval prompts (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    host = environment.machine()
    model = specjax.load("smollm2-135m")
    started = time.perf_counter()
    tables, info = build_tables(specjax.JsonSchema(SCHEMA), model.tokenizer,
                                model.config.vocab_size, model.config.eos_token_ids,
                                use_cache=False)
    build = {"seconds": time.perf_counter() - started, "states": info.num_states,
             "token_classes": info.num_classes,
             "table_bucket": [info.state_bucket, info.class_bucket],
             "table_bytes": info.table_bytes}
    print(f"tables: {build}", file=sys.stderr)

    prompts = humaneval.humaneval_prompts(args.limit)
    for label, method, constrained in CONFIGS:  # compile each program once
        run_one(model, prompts[0], method, constrained, args.max_new_tokens)
        print(f"warm: {label}", file=sys.stderr)
    rows = {label: [] for label, _, _ in CONFIGS}
    for index, prompt in enumerate(prompts):
        order = CONFIGS if index % 2 == 0 else CONFIGS[::-1]  # alternate who goes first
        for label, method, constrained in order:
            out = run_one(model, prompt, method, constrained, args.max_new_tokens)
            rows[label].append({"prompt": index, "tokens": out.tokens, "text": out.text,
                                "seconds": out.stats["seconds"],
                                "tokens_per_s": out.stats["tokens_per_s"],
                                "mean_accepted": out.stats["mean_accepted"],
                                "valid": valid(out.text)})
        print(f"prompt {index} done", file=sys.stderr)

    reference = rows["ar+schema"]
    summary = {}
    for label, method, constrained in CONFIGS:
        own = rows[label]
        summary[label] = {
            "method": method, "constrained": constrained,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in own),
            "median_tokens_per_target_pass": statistics.median(r["mean_accepted"] for r in own),
            "median_speedup_vs_constrained_ar": statistics.median(
                r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(own, reference)),
            "valid_documents": sum(r["valid"] for r in own),
            "same_tokens_as_constrained_ar": sum(r["tokens"] == a["tokens"]
                                                 for r, a in zip(own, reference)),
            "prompts": len(own),
        }
        print(f"{label:14s} {summary[label]}", file=sys.stderr)
    result = {"benchmark": "bench_constrained", "schema": SCHEMA, "request": REQUEST,
              "max_new_tokens": args.max_new_tokens, "limit": args.limit,
              "table_build": build, "summary": summary, "rows": rows, **host,
              "load_average_end": os.getloadavg()}
    if args.json:
        environment.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
