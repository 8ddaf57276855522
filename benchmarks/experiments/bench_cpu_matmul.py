"""Why a verify pass over a few nodes costs more than a one-token step on the CPU.

Times, in one jitted program each, a float32 [M, K] x [K, N] product for M = 1..16 rows at
SmolLM2-135M's shapes: the tied head (576 x 49,152, 113 MB, read from memory every call)
and a stack of 30 distinct gate-sized projections (576 x 1,536 and back, 212 MB), with
every XLA CPU option passed on the command line as a variant (``--flags``). A speculative
target pass multiplies M = nodes rows by every weight, so the ratio to M = 1 is the
pass's cost over an `ar` step's before attention.

    .venv/bin/python benchmarks/experiments/bench_cpu_matmul.py --json benchmarks/results/cpu/matmul_rows.json

Each variant runs in its own process (XLA_FLAGS are read once per process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS = (1, 2, 4, 6, 8, 16)


FORMS = ("x@w", "w@x", "reduce")


def _product(form: str):
    """``x [M, K] @ w`` in one of three forms, ``w`` stored as that form wants it: ``x@w``
    (the models' form, ``w`` [K, N]), ``w@x`` (the weight as the left operand, ``w`` [N, K],
    the [N, M] product transposed back), ``reduce`` (a broadcast product summed over K,
    ``w`` [N, K]: one pass over the weight for all M rows, no matrix-product call)."""
    import jax
    import jax.numpy as jnp

    precision = jax.lax.Precision.HIGHEST
    if form == "x@w":
        return lambda x, w: jnp.matmul(x, w, precision=precision)
    if form == "w@x":
        return lambda x, w: jnp.matmul(w, x.T, precision=precision).T
    return lambda x, w: jnp.sum(w[:, None, :] * x[None, :, :], axis=-1).T


def measure(rows, repeats: int, form: str = "x@w") -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.harness.environment import median_ms

    rng = np.random.default_rng(0)
    stored = (lambda a: a) if form == "x@w" else (lambda a: np.ascontiguousarray(a.T))
    # the tied head as the models store it, [vocab, d]; x@w multiplies by its transpose
    head = jnp.asarray(rng.standard_normal((49152, 576), dtype=np.float32))
    ups = [jnp.asarray(stored(rng.standard_normal((576, 1536), dtype=np.float32) * 0.03))
           for _ in range(30)]
    downs = [jnp.asarray(stored(rng.standard_normal((1536, 576), dtype=np.float32) * 0.03))
             for _ in range(30)]
    product = _product(form)
    head_logits = jax.jit(lambda x, head: product(x, head.T if form == "x@w" else head))

    @jax.jit
    def projections(x, ups, downs):
        for up, down in zip(ups, downs):
            x = product(jnp.tanh(product(x, up)), down)
        return x

    out = {}
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, 576), dtype=np.float32))
        out[m] = {"head_ms": median_ms(head_logits, x, head, repeats=repeats),
                  "projections_ms": median_ms(projections, x, ups, downs, repeats=repeats),
                  # a check that the form computes the same product (float32 rounding apart)
                  "head_checksum": float(jnp.sum(head_logits(x, head)))}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--flags", nargs="*", default=[
        "", "--xla_cpu_use_xnnpack=true", "--xla_cpu_experimental_xnn_fusion_type=dot",
        "--xla_cpu_use_onednn=true", "--xla_cpu_multi_thread_eigen=false"],
        help="XLA_FLAGS variants, one process each ('' = the default)")
    parser.add_argument("--forms", nargs="*", choices=FORMS,
                        help="instead of flag variants, compare these forms of the product "
                             "under the default flags, one process each (see _product)")
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--form", default="x@w", choices=FORMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(rows, args.repeats, args.form)))
        return 0
    result = {"benchmark": "cpu_matmul_rows", "command": " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "load_average_start": os.getloadavg(), "variants": {}}
    # (variant name, XLA_FLAGS, form)
    variants = ([(f"form {form}", "", form) for form in args.forms] if args.forms else
                [(flags or "default", flags, "x@w") for flags in args.flags])
    for name, flags, form in variants:
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows,
                               "--repeats", str(args.repeats), "--form", form], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            result["variants"][name] = {"error": done.stderr.strip()[-300:]}
            print(f"{name}: failed", file=sys.stderr)
            continue
        times = json.loads(done.stdout.strip().splitlines()[-1])
        result["variants"][name] = times
        base = times[str(rows[0])]
        print(name)
        for m, t in times.items():
            print(f"  M={m:>2}: head {t['head_ms']:6.2f} ms ({t['head_ms'] / base['head_ms']:.2f}x)"
                  f"  projections {t['projections_ms']:6.2f} ms "
                  f"({t['projections_ms'] / base['projections_ms']:.2f}x)")
    result["load_average_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
