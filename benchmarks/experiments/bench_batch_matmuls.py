"""How a decode step's matmuls scale with the batch: SmolLM2-135M's projection shapes.

Times, jitted, the step's matmuls alone for M rows (q|k|v [576, 960], o [576, 576],
gate|up [576, 3072], down [1536, 576], each x 30 layers, and the head [576, 49152]), fp32
at ``Precision.HIGHEST`` as the models run them, median of ``--repeats`` calls each, random
weights. Compare with a whole step of ``bench_batch.py`` at the same batch: the difference
is the per-row rest of the step (attention, norms, RoPE, sampling over the vocabulary).

    .venv/bin/python benchmarks/experiments/bench_batch_matmuls.py --json benchmarks/results/cpu/batch_matmuls.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# (in, out, times per step)
SHAPES = [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    matmul = jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    rng = np.random.default_rng(0)
    points = []
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = flops = 0.0
        for k, n, times in SHAPES:
            w = jnp.asarray(rng.standard_normal((k, n), np.float32))
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
            matmul(x, w).block_until_ready()  # compile
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                matmul(x, w).block_until_ready()
                samples.append(time.perf_counter() - start)
            seconds += float(np.median(samples)) * times
            flops += 2.0 * rows * k * n * times
        point = {"rows": rows, "step_matmul_ms": seconds * 1e3, "gflops": flops / seconds / 1e9,
                 "ms_per_row": seconds * 1e3 / rows, "load_average": os.getloadavg()}
        points.append(point)
        print(f"M={rows:3d}: {point['step_matmul_ms']:7.1f} ms, {point['gflops']:6.1f} GFLOP/s, "
              f"{point['ms_per_row']:6.2f} ms per row", file=sys.stderr, flush=True)
    result = {"benchmark": "batch_matmuls", "jax": jax.__version__,
              "device": str(jax.devices()[0]), "points": points}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
