"""ar's jump-forward under a constraint on SmolLM2 (issue 61): tokens per target pass and
time per token with ``jump_forward`` 0 (one pass per token) and the default.

The constraints and prompts are those of ``constrained_validity.py`` (a JSON schema of a
person's record, a date pattern), chat template, greedy and at T=1 (seed 1). Per
constraint and temperature the two settings run interleaved ``--repeats`` times after a
warm-up call each; reported: tokens, target passes (the prefill's included), tokens per
pass, forced tokens, the fastest and the median seconds per token, and whether the two
settings' tokens are equal.

    .venv/bin/python benchmarks/experiments/jump_forward.py \\
        --json benchmarks/results/cpu/jump_forward_DATE.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import specjax
from specjax.harness import environment
from specjax.methods.options import JUMP_FORWARD

sys.path.insert(0, str(Path(__file__).resolve().parent))
import constrained_validity  # noqa: E402  (a sibling script, not a package)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = specjax.load("smollm2-135m")
    constraints = {"json_schema": specjax.JsonSchema(constrained_validity.SCHEMA),
                   "regex": specjax.Regex(constrained_validity.PATTERN)}
    rows = []
    for name, constraint in constraints.items():
        for temperature, seed in ((0.0, 0), (1.0, 1)):
            settings = dict(constraint=constraint, max_new_tokens=args.max_new_tokens,
                            temperature=temperature, seed=seed, chat=True, method="ar")
            prompt = constrained_validity.PROMPTS[name]
            runs = {jump: [] for jump in (0, JUMP_FORWARD)}
            for jump in runs:  # warm-up: compile
                specjax.generate(model, prompt, jump_forward=jump, **settings)
            for _ in range(args.repeats):
                for jump in runs:
                    runs[jump].append(specjax.generate(model, prompt, jump_forward=jump,
                                                       **settings))
            for jump, outs in runs.items():
                out = outs[0]
                per_token = [o.stats["seconds"] / len(o.tokens) for o in outs]
                rows.append({
                    "constraint": name, "temperature": temperature, "jump_forward": jump,
                    "tokens": len(out.tokens), "target_passes": out.stats["target_calls"],
                    "tokens_per_pass": round(out.stats["mean_accepted"], 3),
                    "forced_tokens": out.stats["forced_tokens"],
                    "ms_per_token_min": round(1000 * min(per_token), 1),
                    "ms_per_token_median": round(1000 * statistics.median(per_token), 1),
                    "equal_to_one_pass_per_token": out.tokens == runs[0][0].tokens,
                    "text": out.text})
                print({k: v for k, v in rows[-1].items() if k != "text"}, flush=True)
    result = {"benchmark": "jump_forward", "rows": rows, "repeats": args.repeats,
              "command": "python benchmarks/experiments/jump_forward.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              **environment.machine(), "load_average_end": os.getloadavg()}
    if args.json:
        environment.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
