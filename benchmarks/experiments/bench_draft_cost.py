"""Cost of one staged draft pass relative to a one-token target step.

Times, jitted, after a warm-up (median of ``--repeats`` calls, best of two interleaved
rounds), at a cache of ``--prefix`` committed tokens: the target's one-token forward, and
the shipped draft's first staged pass (``--chunk`` catch-up rows + ``--proposal`` tokens,
the head on the root row and the proposal rows) with its restricted head and with the full
vocabulary head.

    .venv/bin/python benchmarks/experiments/bench_draft_cost.py --json benchmarks/results/draft_cost_cpu.json

``--layers 2,3,4`` adds drafts of the target's first K blocks with the shipped draft's head
subset (the cost of a larger draft's pass; its weights are untrained, which does not change
the cost), for choosing ``train-draft --init-layers``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import jax
    import jax.numpy as jnp

    import specjax
    from specjax import models
    from specjax.cache import init_cache
    from specjax.harness.environment import git_commit, machine, versions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--proposal", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", default="",
                        help="comma-separated block counts of extra drafts to time")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    layers = [int(k) for k in args.layers.split(",") if k.strip()]

    target = specjax.load(args.model)
    draft = specjax.loading.resolve_draft(target)  # the shipped draft
    full = specjax.Model(draft.config, {k: v for k, v in draft.params.items()
                                        if k != models.HEAD_SUBSET}, draft.tokenizer)

    def prepare(model, tokens: int, head_rows: int):
        """The jitted pass, compiled and warmed up once; returns a call that blocks."""
        cache = init_cache(model.config, 2 * args.prefix + 64).replace(
            length=jnp.int32(args.prefix))
        ids = jnp.arange(tokens, dtype=jnp.int32)

        @jax.jit
        def run(params, cache, ids):
            hidden, _ = models.hidden_states(params, model.config, ids,
                                             args.prefix + jnp.arange(tokens), cache)
            return models.lm_head(params, model.config, hidden[:head_rows])

        def call():
            return jax.block_until_ready(run(model.params, cache, ids))

        call()
        return call

    def timer(call) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    size = args.chunk + args.proposal
    calls = {"target_one_token": prepare(target, 1, 1),
             "draft_first_pass_subset_head": prepare(draft, size, 1 + args.proposal),
             "draft_first_pass_full_head": prepare(full, size, 1 + args.proposal)}
    subset = draft.params[models.HEAD_SUBSET]["tokens"]
    for k in layers:
        deeper = specjax.loading.resolve_draft(target, f"first-layers:{k}").with_head_subset(
            subset)
        calls[f"draft{k}_first_pass_subset_head"] = prepare(deeper, size, 1 + args.proposal)
        calls[f"draft{k}_one_token_subset_head"] = prepare(deeper, 1, 1)
    ms = {name: [] for name in calls}
    for _ in range(2):  # interleaved rounds; the faster kept
        for name, call in calls.items():
            ms[name].append(timer(call))
    best = {name: min(values) for name, values in ms.items()}
    base = best["target_one_token"]
    for name, value in best.items():
        print(f"{name:32s} {value:7.2f} ms  {value / base:5.2f}x target step")
    if args.json:
        record = {"command": " ".join(["python", "benchmarks/experiments/bench_draft_cost.py", *sys.argv[1:]]),
                  "machine": machine(), "versions": versions(), "git": git_commit(),
                  "config": vars(args), "head_size": draft.head_size, "ms": best,
                  "relative_to_target_step": {k: v / base for k, v in best.items()},
                  "rounds_ms": ms}
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
