"""Cost of one target pass over a tree of N nodes, relative to a one-token decode step.

The target verifies a whole speculative tree in one forward pass; speculation pays when
that pass costs about as much as decoding one token. For N in ``--nodes``, this times the
jitted forward (tree mask over N new tokens + cache prefix of ``--prefix`` tokens), takes
the median over ``--repeats`` calls after a warm-up, and reports it relative to N = 1.

    python benchmarks/bench_verify.py --json benchmarks/results/verify_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import specjax
from specjax import models
from specjax.cache import init_cache
from specjax.harness.environment import git_commit, write_json
from specjax.tree import ancestor_mask, depths, kary_parents


def time_pass(model, nodes: int, prefix: int, capacity: int, repeats: int) -> float:
    parents = jnp.asarray(kary_parents(4, 8, nodes) if nodes > 1 else [-1], jnp.int32)
    mask = ancestor_mask(parents, jnp.ones(nodes, bool))
    positions = prefix + depths(parents)
    tokens = jnp.arange(nodes, dtype=jnp.int32) % model.config.vocab_size
    cache = init_cache(model.config, capacity).replace(length=jnp.int32(prefix))

    @jax.jit
    def verify(params, cache, tokens, positions, mask):
        logits, cache = models.forward(params, model.config, tokens, positions, cache, mask)
        return logits, cache

    jax.block_until_ready(verify(model.params, cache, tokens, positions, mask))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(verify(model.params, cache, tokens, positions, mask))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--nodes", default="1,4,8,16,32,64")
    parser.add_argument("--prefix", type=int, default=256, help="committed cache tokens")
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    model = specjax.load(args.model, dtype=args.dtype)
    nodes = [int(n) for n in args.nodes.split(",")]
    # Interleave the sizes over rounds so machine drift hits all of them alike.
    samples = {n: [] for n in nodes}
    for _ in range(3):
        for n in nodes:
            samples[n].append(time_pass(model, n, args.prefix, args.capacity, args.repeats))
    seconds = {n: statistics.median(v) for n, v in samples.items()}
    rows = [{"nodes": n, "ms": 1e3 * seconds[n], "relative_to_one_token": seconds[n] / seconds[1]}
            for n in nodes]
    for row in rows:
        print(json.dumps(row))
    result = {"benchmark": "verify_pass", "date": time.strftime("%Y-%m-%d"),
              "device": jax.devices()[0].device_kind, "platform": platform.platform(),
              "cpu_count": os.cpu_count(), "versions": {"jax": jax.__version__},
              "git": git_commit(), "config": vars(args), "rows": rows}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
