"""A fixed tree shaped by the draft's measured acceptance per depth and rank (issue 60,
item 3), against the dynamic tree of the same budget.

1. **Measure** (held-out standard-library docstring prompts, never HumanEval): ``tree``
   over "spine" topologies of R = 1, 2, 3 ranked children per level (level l's children
   hang from level l - 1's first node) gives, per depth d, the chance that one of the top
   R children is the target's token given that the spine above was accepted
   (``stats["accepted_histogram"]`` summed over rows). Their differences are the chance
   ``a[d][r]`` that the child of rank r is (ranks beyond the last measured count as 0).
2. **Shape** (the positional model of Sequoia, Chen et al. 2024): a node's value is the
   product of ``a`` along its path; the best tree of N nodes under that model is grown
   greedily from the root, each time adding the candidate of highest value (a node's first
   child, or its parent's next ranked child), since values only fall along both moves.
3. **Compare** on HumanEval prompts: tokens per target pass and seconds of the shaped tree
   against ``tree``'s dynamic default (the best ``tree_budget`` nodes by the draft's own
   cumulative scores, drafted anew at every step), both with ``tree_budget`` nodes.

    .venv/bin/python benchmarks/experiments/tree_shape.py --json \\
        benchmarks/results/cpu/tree_shape_DATE.json
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time

import numpy as np

import specjax
from specjax.harness.environment import machine, write_json
from specjax.humaneval import humaneval_prompts
from specjax.training import corpus, sample_corpus


def spine_parents(width: int, depth: int) -> list[int]:
    """``width`` children per level, each level's under the previous level's first node."""
    parents, spine = [-1], 0
    for _ in range(depth):
        parents += [spine] * width
        spine = len(parents) - width
    return parents


def acceptance_table(hits: dict[int, np.ndarray], depth: int) -> np.ndarray:
    """``a[d][r]`` [depth, R]: from ``hits[R][d]``, the steps whose accepted length reached
    ``d + 1`` over those that reached ``d`` with a top-``R`` spine tree (``hits[R]``
    [depth + 1], ``hits[R][0]`` every step)."""
    widths = sorted(hits)
    table = np.zeros((depth, len(widths)))
    for d in range(depth):
        # Within the top R given the spine above: P_R(>= d + 1) / P_1(>= d).
        reached = [hits[w][d + 1] / max(hits[w][0], 1) / max(hits[1][d] / hits[1][0], 1e-9)
                   for w in widths]
        cumulative = np.maximum.accumulate(np.clip(reached, 0.0, 1.0))
        table[d] = np.diff(np.concatenate([[0.0], cumulative]))
    return table


def shaped_parents(table: np.ndarray, budget: int) -> tuple[list[int], float]:
    """The ``budget``-node tree (root included) of greatest expected accepted length under
    ``table`` [depth, ranks], grown greedily; returns (parents, expected drafts accepted)."""
    depth, ranks = table.shape
    parents, expected = [-1], 0.0
    # (-value, tiebreak, parent node, depth index, rank)
    frontier = [(-table[0][0], 0, 0, 0, 0)]
    count = 1
    while len(parents) < budget and frontier:
        negative, _, parent, d, r = heapq.heappop(frontier)
        if -negative <= 0:
            break
        node = len(parents)
        parents.append(parent)
        expected += -negative
        if r + 1 < ranks:  # the parent's next ranked child
            value = -negative / max(table[d][r], 1e-12) * table[d][r + 1]
            heapq.heappush(frontier, (-value, count, parent, d, r + 1))
            count += 1
        if d + 1 < depth:  # this node's first child
            heapq.heappush(frontier, (negative * table[d + 1][0], count, node, d + 1, 0))
            count += 1
    return parents, expected


def _run(model, prompts, batch_size, **options):
    """(summed accepted histogram, new tokens, target passes, seconds) over ``prompts``."""
    histogram, tokens, passes, seconds = None, 0, 0, 0.0
    for first in range(0, len(prompts), batch_size):
        rows = prompts[first:first + batch_size]
        out = specjax.generate(model, rows, seed=list(range(first, first + len(rows))),
                               **options)
        for result in out:
            h = np.asarray(result.stats["accepted_histogram"], np.int64)
            histogram = h if histogram is None else histogram + h
            tokens += result.stats["new_tokens"]
            passes += result.stats["target_calls"]
        seconds += out[0].stats["seconds"]
    return histogram, tokens, passes, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure-prompts", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32, help="HumanEval prompts compared")
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--widths", default="1,2,3")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    host = machine()
    model = specjax.load("smollm2-135m")
    files = [f for f in corpus.stdlib_files() if corpus.is_heldout(f, 0.02)]
    measure = sample_corpus.docstring_prompts(
        files, exclude_names=sample_corpus.humaneval_entry_points())[:args.measure_prompts]
    compare = humaneval_prompts(args.prompts)
    widths = [int(w) for w in args.widths.split(",")]
    records = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        common = dict(method="tree", temperature=temperature,
                      max_new_tokens=args.max_new_tokens)
        hits = {}
        for width in widths:
            histogram, tokens, passes, _ = _run(
                model, measure, args.batch_size, topology=spine_parents(width, args.depth),
                **common)
            reached = np.array([histogram[d:].sum() for d in range(args.depth + 1)])
            hits[width] = reached
            print(f"T={temperature:g} spine width {width}: reached {reached.tolist()}, "
                  f"{tokens / passes:.3f} tokens/pass", flush=True)
        table = acceptance_table(hits, args.depth)
        parents, expected = shaped_parents(table, args.budget)
        print(f"T={temperature:g} a[d][r] = {np.round(table, 3).tolist()}\n"
              f"  shaped tree {parents} (expected {1 + expected:.3f} tokens/pass)", flush=True)
        compared = {}
        for name, options in (("dynamic", dict(tree_budget=args.budget)),
                              ("shaped", dict(topology=parents))):
            _, tokens, passes, seconds = _run(model, compare, args.batch_size,
                                              **options, **common)
            compared[name] = {"tokens_per_pass": tokens / passes, "new_tokens": tokens,
                              "target_calls": passes, "seconds": round(seconds, 2),
                              "tokens_per_s": round(tokens / seconds, 2)}
            print(f"  {name}: {tokens / passes:.3f} tokens/pass, "
                  f"{tokens / seconds:.1f} tokens/s", flush=True)
        records.append({"temperature": temperature,
                        "spine_hits": {str(w): h.tolist() for w, h in hits.items()},
                        "acceptance": table.tolist(), "shaped_parents": parents,
                        "expected_tokens_per_pass": 1 + expected, "compared": compared})
    result = {"benchmark": "tree_shape", "budget": args.budget, "depth": args.depth,
              "widths": widths, "measure_prompts": len(measure), "prompts": len(compare),
              "max_new_tokens": args.max_new_tokens, "finished": time.strftime("%H:%M:%S"),
              "command": "python benchmarks/experiments/tree_shape.py "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              **host, "records": records}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
