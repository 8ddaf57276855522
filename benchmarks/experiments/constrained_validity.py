"""Sampled outputs under a constraint are valid (issue 61): SmolLM2 at temperature 1.

Runs ``--count`` generations under a JSON schema and as many under a regular expression
(chat prompts asking for a person's record / a date, seeds 0, 1, ..., in batches of
``--batch-size`` rows: one program per batch), with ``--method`` (default: the method a
constraint decodes with by default), and checks each output: a finished one (it ended with EOS) must validate
(``jsonschema``) or match the whole pattern; one cut by ``--max-new-tokens`` must be a
prefix of a valid one (the ``regex`` package's partial matching for the pattern; for the
schema, counted as unfinished). Writes per constraint the counts of finished, valid and
invalid outputs, and every output.

    .venv/bin/python benchmarks/experiments/constrained_validity.py --count 100 \\
        --json benchmarks/results/cpu/constrained_validity_DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jsonschema
import regex

import specjax
from specjax.harness import environment

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                   "age": {"type": "integer"},
                   "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"}},
    "required": ["name", "age", "city"], "additionalProperties": False,
}
PATTERN = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PROMPTS = {
    "json_schema": "Invent a person and give their name, age and city as JSON.",
    "regex": "Give the date of a famous historical event as YYYY-MM-DD.",
}


def check_json(text: str, finished: bool) -> str:
    if not finished:
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def check_regex(text: str, finished: bool) -> str:
    if finished:
        return "valid" if regex.fullmatch(PATTERN, text) else "invalid"
    return "unfinished" if regex.fullmatch(PATTERN, text, partial=True) else "invalid"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100, help="generations per constraint")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default=None, help="default: a constraint's default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    host = environment.machine()
    model = specjax.load("smollm2-135m")
    eos = set(model.config.eos_token_ids)
    constraints = {"json_schema": (specjax.JsonSchema(SCHEMA), check_json),
                   "regex": (specjax.Regex(PATTERN), check_regex)}
    result = {"benchmark": "constrained_validity", "schema": SCHEMA, "pattern": PATTERN,
              "prompts": PROMPTS, "temperature": 1.0, "max_new_tokens": args.max_new_tokens,
              "command": "python benchmarks/experiments/constrained_validity.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              **host, "constraints": {}}
    for name, (constraint, check) in constraints.items():
        started, rows = time.perf_counter(), []
        for first in range(0, args.count, args.batch_size):
            seeds = list(range(first, min(first + args.batch_size, args.count)))
            outs = specjax.generate(model, [PROMPTS[name]] * len(seeds), chat=True,
                                    temperature=1.0, seed=seeds, constraint=constraint,
                                    max_new_tokens=args.max_new_tokens, method=args.method)
            for seed, out in zip(seeds, outs):
                finished = bool(out.tokens) and out.tokens[-1] in eos
                rows.append({"seed": seed, "text": out.text, "finished": finished,
                             "verdict": check(out.text, finished),
                             "method": out.stats["method"]})
            print(f"{name}: {len(rows)} done", file=sys.stderr, flush=True)
        counts = {verdict: sum(r["verdict"] == verdict for r in rows)
                  for verdict in ("valid", "invalid", "unfinished")}
        result["constraints"][name] = {"generations": len(rows), **counts,
                                       "method": rows[0]["method"],
                                       "seconds": round(time.perf_counter() - started, 1),
                                       "rows": rows}
        print(f"{name}: {counts}", file=sys.stderr, flush=True)
    result["load_average_end"] = os.getloadavg()
    if args.json:
        environment.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
