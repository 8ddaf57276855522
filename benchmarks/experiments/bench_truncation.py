"""What top-k / top-p sampling adds to a step: the target distribution of N rows of
SmolLM2-sized logits (49,152), with and without truncation, against a sort-based
truncation (how specjax truncated before 6b579f6).

    .venv/bin/python benchmarks/experiments/bench_truncation.py --json benchmarks/results/cpu/truncation.json

Each row of the output is one jitted program, timed as the median of ``--repeats`` calls
after a warm-up; the sort-based version is checked to keep the same tokens on these logits
(random normal logits have no ties, where the two definitions differ) before it is timed.
Programs are built the way a CPU or TPU step builds them (settings traced, one program for
every rule); ``--static`` builds them the GPU's way (one rule per program, no conditional).
"""

from __future__ import annotations

import argparse
import os
import sys

ROWS = (1, 6, 16, 32)
VOCAB = 49152
SETTINGS = {"none": (0, 1.0), "top-k 50": (50, 1.0), "top-p 0.9": (0, 0.9),
            "top-k 50 + top-p 0.9": (50, 0.9)}


def sort_truncation(scaled, top_k, top_p):
    """Top-k then top-p by sorting the row (the definition before 6b579f6)."""
    import jax
    import jax.numpy as jnp

    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ordered = jnp.where(rank < k, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p) & (rank < k)
    keep = keep.at[..., 0].set(True)
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--static", action="store_true",
                        help="one rule per program (a GPU's programs), not traced rules")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import sampling
    from specjax.harness import environment
    from specjax.harness.environment import median_ms

    machine = environment.machine()  # the date and load average at the start
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for n in rows:
        logits = jax.random.normal(jax.random.PRNGKey(n), (n, VOCAB), jnp.float32) * 3
        for name, (top_k, top_p) in SETTINGS.items():
            params = sampling.make_sampling_params(1.0, top_k, top_p, 0,
                                                   static_rule=args.static)
            ours = jax.jit(lambda x, p: sampling.target_log_probs(x, p))
            row = {"rows": n, "setting": name, "top_k": top_k, "top_p": top_p,
                   "specjax_ms": median_ms(ours, logits, params, repeats=args.repeats)}
            if top_k or top_p < 1.0:
                by_sort = jax.jit(lambda x, k, p: jax.nn.log_softmax(sort_truncation(x, k, p)))
                k, p = jnp.int32(top_k), jnp.float32(top_p)
                same = np.array_equal(np.isfinite(np.asarray(by_sort(logits, k, p))),
                                      np.isfinite(np.asarray(ours(logits, params))))
                if not same:
                    print(f"the sort-based truncation keeps other tokens at {n} rows, {name}",
                          file=sys.stderr)
                    return 1
                row["sort_ms"] = median_ms(by_sort, logits, k, p, repeats=args.repeats)
            results.append(row)
            print(f"{n:3d} rows  {name:22s} specjax {row['specjax_ms']:8.2f} ms"
                  + (f"   sort {row['sort_ms']:8.2f} ms" if "sort_ms" in row else ""))
    if args.json:
        out = {"benchmark": "truncation", "command": " ".join(["benchmarks/experiments/bench_truncation.py",
                                                              *sys.argv[1:]]),
               **machine, "load_average_end": os.getloadavg(),
               "static_rules": args.static, "vocab": VOCAB, "results": results}
        print(f"wrote {environment.write_json(args.json, out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
