"""Batched generation on this machine: total tokens/s of ``ar`` at several batch sizes, and
``staged`` / ``ngram`` against ``ar`` at one batch size (issue 16).

Each measurement runs ``specjax.generate`` on a list of B HumanEval prompts (the B shortest
of the first ``--pool`` prompts, so that prefill stays small next to decoding), greedy,
stop tokens off so every row makes exactly ``--max-new-tokens``. Programs are compiled
by a warm-up call first; each point is the median of ``--repeats`` runs.

Two rates per point:

* ``tokens_per_s``: all rows' new tokens / the program's wall time (prefill included);
* ``decode_tokens_per_s``: (new tokens - B) / (that time - the time of the same batch
  with ``max_new_tokens=1``, i.e. prefill and the first token): the decoding loop alone.

``--compaction on,off`` times every point with and without moving the live rows to
smaller programs as rows finish (rows of speculative methods finish at different steps).

Usage::

    .venv/bin/python benchmarks/bench_batch.py --json benchmarks/results/cpu/bench_batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import specjax
from specjax import api
from specjax import humaneval
from specjax.harness import environment


def _median_run(model, prompts, repeats: int, **kwargs) -> tuple[float, list]:
    specjax.generate(model, prompts, **kwargs)  # compiles (or finds) the program
    times, outs = [], None
    for _ in range(repeats):
        outs = specjax.generate(model, prompts, **kwargs)
        times.append(outs[0].stats["seconds"])
    return statistics.median(times), outs


def measure(model, prompts, method: str, max_new_tokens: int, repeats: int,
            compact_rows: bool = True) -> dict:
    """One point: ``method`` on the batch ``prompts``."""
    common = dict(method=method, stop=[], temperature=0.0,
                  batch=specjax.BatchOptions(compact_rows=compact_rows))
    seconds, outs = _median_run(model, prompts, repeats, max_new_tokens=max_new_tokens,
                                **common)
    prefill, _ = _median_run(model, prompts, repeats, max_new_tokens=1, **common)
    rows = len(prompts)
    tokens = sum(len(o.tokens) for o in outs)
    decode_seconds = seconds - prefill
    return {
        "method": method, "batch_size": rows, "compiled_rows": outs[0].stats["batch"]["compiled_rows"],
        "new_tokens": tokens, "seconds": seconds, "prefill_seconds": prefill,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_row": tokens / seconds / rows,
        "decode_tokens_per_s": (tokens - rows) / decode_seconds if decode_seconds > 0 else None,
        "mean_accepted": [o.stats["mean_accepted"] for o in outs],
        "target_calls": [o.stats["target_calls"] for o in outs],
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", default="1,4,8,16", help="ar batch sizes")
    parser.add_argument("--compare-methods", default="staged,ngram",
                        help="methods compared with ar at each --compare-batch-sizes")
    parser.add_argument("--compare-batch-sizes", default="8",
                        help="batch sizes where --compare-methods run (ar's point reused)")
    parser.add_argument("--pool", type=int, default=32,
                        help="the B shortest of the first POOL HumanEval prompts are used")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compaction", default="on",
                        help="on, off or on,off: live rows gathered into smaller programs "
                             "as rows finish (BatchOptions.compact_rows); with on,off "
                             "every point runs both ways, one after the other")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    settings = [x.strip() for x in args.compaction.split(",") if x.strip()]
    if not settings or set(settings) - {"on", "off"}:
        parser.error(f"--compaction takes on, off or on,off, got {args.compaction!r}")

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    compare = [int(x) for x in args.compare_batch_sizes.split(",") if x]
    methods = [m for m in args.compare_methods.split(",") if m]
    machine = environment.machine()
    model = specjax.load(args.model)
    pool = humaneval.humaneval_prompts(args.pool)
    lengths = [len(api.encode_prompt(model, p)) for p in pool]
    order = sorted(range(len(pool)), key=lambda i: (lengths[i], i))
    points = []
    for method, batch in [("ar", b) for b in sorted(set(sizes) | set(compare))] + \
            [(m, b) for b in compare for m in methods]:
        chosen = sorted(order[:batch])
        for setting in settings:
            start = time.perf_counter()
            point = measure(model, [pool[i] for i in chosen], method, args.max_new_tokens,
                            args.repeats, compact_rows=setting == "on")
            point["compaction"] = setting
            point["prompt_indices"] = chosen
            point["prompt_tokens"] = [lengths[i] for i in chosen]
            points.append(point)
            print(f"{method:>7} B={batch:<3} compaction {setting:<3} "
                  f"{point['tokens_per_s']:7.1f} tok/s total "
                  f"({point['tokens_per_s_per_row']:6.2f}/row), decode "
                  f"{point['decode_tokens_per_s'] or 0:7.1f} tok/s, accepted "
                  f"{statistics.mean(point['mean_accepted']):.2f}, load "
                  f"{point['load_average'][0]:.1f} [{time.perf_counter() - start:.0f} s]",
                  file=sys.stderr, flush=True)
    ar = {(p["batch_size"], p["compaction"]): p for p in points if p["method"] == "ar"}
    smallest = min(b for b, _ in ar)
    for point in points:
        base = ar[point["batch_size"], point["compaction"]]
        point["vs_ar_batch_1"] = point["tokens_per_s"] / ar[
            smallest, point["compaction"]]["tokens_per_s"]
        point["vs_ar_same_batch"] = point["tokens_per_s"] / base["tokens_per_s"]
    result = {"benchmark": "batch", "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
              **machine, "load_average_end": os.getloadavg(), "flags": vars(args),
              "points": points}
    if args.json:
        print(f"wrote {environment.write_json(args.json, result)}", file=sys.stderr)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
