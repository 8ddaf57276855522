"""What the layer loop over stacked weights costs on the CPU, against separate arrays.

specjax's models keep each weight of every layer in one stacked [L, ...] array and run the
layers as a loop that reads layer ``i`` at a traced index. This times, in one jitted
program each, 30 gate-sized MLP layers (576 x 1,536 and back, fp32 HIGHEST, 212 MB of
weights, the matmul part of SmolLM2-135M's MLPs) over M rows, four ways:

- ``scan``: ``lax.scan`` over the stacked weights (what the models do);
- ``fori``: ``lax.fori_loop`` reading ``W[i]`` at the loop index;
- ``separate``: the layers unrolled over 30 separate arrays per weight;
- ``scan_unrolled``: ``lax.scan(..., unroll=True)`` over the stacked weights.

The programs are timed interleaved (each round times each once, in an order rotated from
round to round), median of ``--repeats`` rounds; all four must give the same output first (to float32 rounding).

    .venv/bin/python benchmarks/experiments/bench_cpu_layer_loop.py --json benchmarks/results/cpu/layer_loop_2026-11-26.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

LAYERS, D, F = 30, 576, 1536


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,6,16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.harness import environment

    machine = environment.machine()
    rng = np.random.default_rng(0)
    up = jnp.asarray(rng.standard_normal((args.layers, D, F), dtype=np.float32) * 0.03)
    down = jnp.asarray(rng.standard_normal((args.layers, F, D), dtype=np.float32) * 0.03)
    ups, downs = [up[i] for i in range(args.layers)], [down[i] for i in range(args.layers)]
    hi = jax.lax.Precision.HIGHEST

    def mlp(x, w, v):
        return x + jnp.dot(jax.nn.silu(jnp.dot(x, w, precision=hi)), v, precision=hi)

    def scan(x, w, v):
        return jax.lax.scan(lambda x, wv: (mlp(x, *wv), None), x, (w, v))[0]

    def fori(x, w, v):
        return jax.lax.fori_loop(0, args.layers, lambda i, x: mlp(x, w[i], v[i]), x)

    def separate(x, ws, vs):
        for w, v in zip(ws, vs):
            x = mlp(x, w, v)
        return x

    def scan_unrolled(x, w, v):
        return jax.lax.scan(lambda x, wv: (mlp(x, *wv), None), x, (w, v), unroll=True)[0]

    programs = {"scan": (jax.jit(scan), (up, down)), "fori": (jax.jit(fori), (up, down)),
                "separate": (jax.jit(separate), (ups, downs)),
                "scan_unrolled": (jax.jit(scan_unrolled), (up, down))}
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, D), dtype=np.float32) * 0.1)
        outs = {name: np.asarray(f(x, *w)) for name, (f, w) in programs.items()}
        for name, out in outs.items():
            if not np.allclose(out, outs["scan"], rtol=1e-4, atol=1e-5):
                print(f"{name} differs from scan at {m} rows", file=sys.stderr)
                return 1
        times = {name: [] for name in programs}
        names = list(programs)
        for round_ in range(args.repeats):
            for i in range(len(names)):  # the order rotated from round to round
                name = names[(i + round_) % len(names)]
                f, w = programs[name]
                start = time.perf_counter()
                jax.block_until_ready(f(x, *w))
                times[name].append(time.perf_counter() - start)
        row = {"rows": m, **{f"{name}_ms": 1e3 * statistics.median(t)
                             for name, t in times.items()}}
        results.append(row)
        print(f"{m:3d} rows  " + "  ".join(f"{name} {row[name + '_ms']:7.2f} ms"
                                            for name in programs))
    if args.json:
        out = {"benchmark": "cpu_layer_loop", "command": " ".join(
                   ["benchmarks/experiments/bench_cpu_layer_loop.py", *sys.argv[1:]]),
               **machine, "load_average_end": os.getloadavg(), "layers": args.layers,
               "weight_bytes": int(up.nbytes + down.nbytes), "results": results}
        print(f"wrote {environment.write_json(args.json, out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
