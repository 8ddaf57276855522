"""What calling the model through a Flax module costs inside a jitted ``ar`` step.

One decode step (one-token forward at a fixed cache length + argmax, cache donated, as in
``bench_ar.py``'s bare step) compiled five ways over the same weights:

* ``function``: ``specjax.models.forward(params, config, ...)`` under ``jax.jit``;
* ``nnx``: ``nnx.merge(graphdef, state)(...)`` under ``jax.jit`` (an
  :class:`~specjax.flax_modules.NNXCausalLM` called inside a user's jitted step);
* ``linen``: ``LinenCausalLM(config).apply(variables, ...)`` under ``jax.jit``;
* ``nnx_jit``: the module passed to an ``nnx.jit`` step with flax's defaults (graph mode
  with graph updates: besides splitting and merging the module graph in Python around the
  program, the program returns every variable of the module, i.e. copies the weights on
  every call);
* ``nnx_jit_graph_false``: the same step under ``nnx.jit(..., graph=False)`` (the module
  is passed as a pytree; only changed variables come back).

The variants run interleaved in ``--rounds`` rounds of ``--steps`` steps each (in an order
that rotates every round), so machine drift hits all alike; ``nnx_jit`` runs afterwards,
alternating with the function (its weight copies would slow its neighbours). The JSON
reports each variant's median step time, its ratio to ``function``, the median of
per-round ratios (each round against the function's round beside it), whether the
optimized HLO of each variant equals the function's (after dropping names and source
metadata), and the load average.

    python benchmarks/experiments/bench_flax_overhead.py --json benchmarks/results/flax_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import specjax
from specjax import models
from specjax.cache import init_cache
from specjax.flax_modules import to_flax
from specjax.harness.environment import machine


def _normalised_hlo(compiled) -> str:
    """Optimized HLO text without metadata, module name or value names (which differ
    between otherwise identical programs traced from different Python functions)."""
    lines = compiled.as_text().splitlines()
    # The source tables (FileNames, FunctionNames, FileLocations, StackFrames) sit between
    # the module header and the first computation.
    body = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
    text = "\n".join(lines[:1] + lines[body:])
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r", stack_frame_id=\d+", "", text)
    # Parameter names come from the Python argument names (params / state / variables).
    for name, number in re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", text):
        text = re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w.])", f"param{number}", text)
    return re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)


def build_steps(model):
    """{variant: (jitted step, its first argument)}; every step maps
    (weights, cache, token, position) -> (next token, cache)."""
    config = model.config

    def finish(logits, cache):
        return jnp.argmax(logits[0]).astype(jnp.int32)[None], cache

    def function(params, cache, token, position):
        return finish(*models.forward(params, config, token, position, cache))

    module = to_flax(model)
    graphdef, state = nnx.split(module)

    def nnx_step(state, cache, token, position):
        return finish(*nnx.merge(graphdef, state)(token, position, cache))

    linen_module, variables = to_flax(model, "linen")

    def linen_step(variables, cache, token, position):
        return finish(*linen_module.apply(variables, token, position, cache))

    def module_step(module, cache, token, position):
        return finish(*module(token, position, cache))

    return {
        "function": (jax.jit(function, donate_argnums=1), model.params),
        "nnx": (jax.jit(nnx_step, donate_argnums=1), state),
        "linen": (jax.jit(linen_step, donate_argnums=1), variables),
        "nnx_jit": (nnx.jit(module_step, donate_argnums=1), module),
        "nnx_jit_graph_false": (nnx.jit(module_step, donate_argnums=1, graph=False), module),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache-length", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    parser.add_argument("--default-nnx-jit-rounds", type=int, default=6,
                        help="rounds of 2 steps of the default nnx.jit step, each after 2 "
                             "steps of the function")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    info = machine()
    model = specjax.load(args.model, dtype=args.dtype)
    steps = build_steps(model)
    token = jnp.array([1], jnp.int32)
    position = jnp.array([args.cache_length], jnp.int32)

    def fresh_cache():
        cache = init_cache(model.config, args.capacity, model.params["embed"].dtype)
        return cache.replace(length=jnp.int32(args.cache_length))

    caches, hlo, compile_seconds = {}, {}, {}
    for name, (step, weights) in steps.items():
        start = time.perf_counter()
        if not name.startswith("nnx_jit"):
            compiled = step.lower(weights, fresh_cache(), token, position).compile()
            hlo[name] = _normalised_hlo(compiled)
        caches[name] = fresh_cache()
        for _ in range(3):  # compile (nnx.jit variants) and warm up
            out, caches[name] = step(weights, caches[name], token, position)
        jax.block_until_ready(out)
        compile_seconds[name] = time.perf_counter() - start

    def timed(name: str, count: int) -> list[float]:
        step, weights = steps[name]
        seconds = []
        for _ in range(count):
            begin = time.perf_counter()
            out, caches[name] = step(weights, caches[name], token, position)
            jax.block_until_ready(out)
            seconds.append(time.perf_counter() - begin)
        return seconds

    # The default nnx.jit step copies the weights on every call (~10x a step): it is timed
    # on its own afterwards, so that its memory traffic does not slow its neighbours.
    names = [name for name in steps if name != "nnx_jit"]
    times = {name: [] for name in steps}
    round_medians = {name: [] for name in steps}
    for index in range(args.rounds):
        shift = index % len(names)  # rotate the order: no variant always runs first
        for name in names[shift:] + names[:shift]:
            this_round = timed(name, args.steps)
            times[name] += this_round
            round_medians[name].append(statistics.median(this_round))
    for _ in range(args.default_nnx_jit_rounds):
        for name in ("function", "nnx_jit"):
            this_round = timed(name, 2)
            round_medians[name].append(statistics.median(this_round))
            if name == "nnx_jit":
                times[name] += this_round

    base = statistics.median(times["function"])
    variants = {}
    for name in steps:
        median = statistics.median(times[name])
        # Per-round ratios pair each round with the function's round next to it in time.
        reference = round_medians["function"][-len(round_medians[name]):] if (
            name == "nnx_jit") else round_medians["function"][:args.rounds]
        per_round = [m / f for m, f in zip(round_medians[name], reference)]
        variants[name] = {
            "median_step_ms": 1e3 * median,
            "min_step_ms": 1e3 * min(times[name]),
            "ratio_to_function": median / base,
            "median_round_ratio": statistics.median(per_round),
            "round_ratio_range": [min(per_round), max(per_round)],
            "hlo_identical_to_function": (hlo[name] == hlo["function"]) if name in hlo else None,
            "compile_and_warmup_seconds": compile_seconds[name],
        }
    result = {
        "benchmark": "flax_overhead",
        "model": args.model, "dtype": args.dtype, "cache_length": args.cache_length,
        "capacity": args.capacity, "rounds": args.rounds, "steps_per_round": args.steps,
        "default_nnx_jit_rounds": args.default_nnx_jit_rounds,
        "machine": info, "load_average_end": os.getloadavg(), "variants": variants,
    }
    text = json.dumps(result, indent=2)
    print(json.dumps(variants, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
