"""The CPU's calibrated default method against ar on prompts (issue 60 item 2).

Times this machine's steps for the default method from scratch (a fresh calibration store
in a temporary folder: the calibration's own cost is measured too), then decodes each
prompt with ar and with the default the calibration chose, interleaved per prompt
(compiled first), at T=0 and T=1, and reports each prompt's speedup and the median.

    python benchmarks/experiments/bench_calibrated_default.py --prompts 16 \\
        --json benchmarks/results/cpu/calibrated_default_DATE.json

Prompts: HumanEval's last PROMPTS (the suite's protocol runs its first ones).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import specjax
from specjax import calibration
from specjax.harness.environment import machine, write_json
from specjax.humaneval import humaneval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="calibration-")
    os.environ[calibration.CALIBRATION_ENV] = os.path.join(store, "calibration.json")
    run = machine()
    model = specjax.load("smollm2-135m")
    prompts = humaneval_prompts()[-args.prompts:]
    result = {**run, "command": "python benchmarks/experiments/bench_calibrated_default.py "
              f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}",
              "prompts": f"HumanEval's last {args.prompts}", "temperatures": {}}
    for temperature in (0.0, 1.0):
        started = time.perf_counter()
        first = specjax.generate(model, prompts[0], max_new_tokens=8, temperature=temperature)
        chosen = first.stats["method"]
        entry = {"method": chosen, "method_choice": first.stats["method_choice"],
                 "calibration": first.stats.get("calibration"),
                 "first_call_seconds": round(time.perf_counter() - started, 1)}
        specjax.generate(model, prompts[0], method="ar", max_new_tokens=8,
                         temperature=temperature)
        rows = []
        for index, prompt in enumerate(prompts):
            timed = {}
            for method in ("ar", None):  # None: the default, as a user gets it
                settings = {} if method is None else {"method": method}
                out = specjax.generate(model, prompt, max_new_tokens=args.max_new_tokens,
                                       temperature=temperature, seed=index, **settings)
                if out.stats["compile_seconds"]:  # a new prompt bucket: time it compiled
                    out = specjax.generate(model, prompt, max_new_tokens=args.max_new_tokens,
                                           temperature=temperature, seed=index, **settings)
                timed[method or "default"] = out
            ar, default = timed["ar"], timed["default"]
            rows.append({"prompt": index, "ar_tokens_per_s": ar.stats["tokens_per_s"],
                         "default_tokens_per_s": default.stats["tokens_per_s"],
                         "speedup": default.stats["tokens_per_s"] / ar.stats["tokens_per_s"],
                         "mean_accepted": default.stats["mean_accepted"],
                         "same_tokens": ar.tokens == default.tokens})
            print(f"T={temperature:g} prompt {index}: {rows[-1]['speedup']:.2f}x", flush=True)
        speedups = [row["speedup"] for row in rows]
        entry.update(rows=rows, median_speedup=statistics.median(speedups),
                     min_speedup=min(speedups),
                     prompts_below_1=sum(value < 1.0 for value in speedups))
        result["temperatures"][f"{temperature:g}"] = entry
        print(f"T={temperature:g}: default {chosen}, median {entry['median_speedup']:.3f}x ar, "
              f"{entry['prompts_below_1']} of {len(rows)} prompts below 1.0x", flush=True)
    result["load_average_end"] = os.getloadavg()
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
