"""``specjax bench --batch-size B``: the systems decoding the prompts in batches.

One compiled program per batch (:func:`specjax.generate` with a list of prompts); each
row's tokens are checked against ``ar``'s for the same prompt, as :func:`run_suite`
checks each prompt's (:mod:`specjax.harness.runner`, which holds the suite's config and
systems).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from specjax import api
from specjax.errors import InvalidArgumentError
from specjax.harness.runner import (METHOD_OPTIONS, SuiteConfig, System, build_systems,
                                    describe_model, describe_options, log_line)
from specjax.loaded_model import check_draft_compatible
from specjax.loading import resolve_ngram


def run_batch_suite(config: SuiteConfig, target, draft, prompts: Sequence[str | Sequence[int]],
                    batch_size: int, *, log: Callable[[str], None] = log_line,
                    generate: Callable[..., list] | None = None) -> dict[str, Any]:
    """``specjax bench --batch-size B``: every system decodes the prompts in batches of
    ``batch_size`` rows (one compiled program per batch, :func:`specjax.generate` with a
    list of prompts).

    Per system and temperature: a warm-up batch (the first ``batch_size`` prompts,
    ``warmup_tokens`` each) compiles the program; then each batch runs ``repeats`` times
    and keeps its fastest run. Each row's tokens are checked against ``ar``'s for the same
    prompt, as in :func:`run_suite`. Peers and the pass breakdown do not run here.

    Returns:
      ``{"config", "batch_size", "models", "systems", "warmup", "batches", "aggregates",
      "mismatches", "all_outputs_match"}``. A batch row: system, temperature, first prompt,
      rows, new_tokens (all rows), seconds, tokens_per_s (all rows together) and
      tokens_per_s_per_row (that divided by the rows), mean_accepted per row. Aggregates
      per (system, temperature): the same over every batch, and ``speedup`` over ``ar``.
    """
    generate = generate or api.generate
    if not prompts:
        raise InvalidArgumentError("no prompts to run")
    if config.peers:
        raise InvalidArgumentError("peers run at batch 1 only: drop --peers with --batch-size")
    ids = [api.encode_prompt(target, p) for p in prompts]
    ngram = None
    if any("ngram" in METHOD_OPTIONS.get(m, ()) for m in config.methods):
        ngram = resolve_ngram(target, config.ngram)
    systems = build_systems(config, draft, ngram)
    if draft is not None:
        check_draft_compatible(target, draft)
    common = dict(top_k=config.top_k, top_p=config.top_p, seed=config.seed, stop=[],
                  kernels=config.kernels)
    if config.constraint is not None:  # the output ends where the constraint is met
        common.update(stop=None, constraint=config.constraint)
    chunks = [ids[i: i + batch_size] for i in range(0, len(ids), batch_size)]

    def run(system: System, rows, temperature, max_new_tokens):
        return generate(target, rows, max_new_tokens=max_new_tokens, temperature=temperature,
                        method=system.method, **common, **system.kwargs())

    warmup, batches, failed = [], [], []
    reference: dict[tuple, list[int]] = {}  # (prompt, temperature) -> ar's tokens
    for temperature in config.temperatures:
        for system in systems:
            outs = run(system, chunks[0], temperature,
                       min(config.warmup_tokens, config.max_new_tokens))
            warmup.append({"system": system.label, "temperature": temperature,
                           "compile_seconds": outs[0].stats["compile_seconds"],
                           "seconds": outs[0].stats["seconds"]})
            for number, chunk in enumerate(chunks):
                best = None
                for _ in range(config.repeats):
                    outs = run(system, chunk, temperature, config.max_new_tokens)
                    if best is None or outs[0].stats["seconds"] < best[0].stats["seconds"]:
                        best = outs
                first = number * batch_size
                tokens = sum(len(o.tokens) for o in best)
                seconds = best[0].stats["seconds"]
                batches.append({
                    "system": system.label, "method": system.method,
                    "temperature": temperature, "first_prompt": first, "rows": len(chunk),
                    "compiled_rows": best[0].stats["batch"]["compiled_rows"],
                    "new_tokens": tokens, "seconds": seconds,
                    "tokens_per_s": tokens / seconds if seconds > 0 else None,
                    "tokens_per_s_per_row": tokens / seconds / len(chunk) if seconds > 0
                    else None,
                    "compile_seconds": best[0].stats["compile_seconds"],
                    "mean_accepted": [o.stats["mean_accepted"] for o in best]})
                must_match = system.label == "ar" or temperature == 0 or (
                    dict(system.options).get("verify") in (None, "coupled", "greedy"))
                for offset, out in enumerate(best):
                    key = (first + offset, temperature)
                    if system.label == "ar":
                        reference[key] = out.tokens
                    elif must_match and out.tokens != reference[key]:
                        at = next((j for j, (a, b) in enumerate(zip(out.tokens,
                                                                    reference[key]))
                                   if a != b), min(len(out.tokens), len(reference[key])))
                        failed.append({"prompt": key[0], "system": system.label,
                                       "temperature": temperature, "first_mismatch": at})
                        log(f"MISMATCH: {system.label} prompt {key[0]} T={temperature:g} "
                            f"differs from ar at token {at}")
    aggregates = []
    for temperature in config.temperatures:
        base = None
        for system in systems:
            mine = [b for b in batches
                    if b["system"] == system.label and b["temperature"] == temperature]
            tokens = sum(b["new_tokens"] for b in mine)
            seconds = sum(b["seconds"] for b in mine)
            rate = tokens / seconds if seconds > 0 else None
            if system.label == "ar":
                base = rate
            accepted = [a for b in mine for a in b["mean_accepted"]]
            aggregates.append({
                "system": system.label, "temperature": temperature, "batch_size": batch_size,
                "prompts": len(ids), "new_tokens": tokens, "seconds": seconds,
                "tokens_per_s": rate,
                "tokens_per_s_per_row": None if rate is None else rate / batch_size,
                "mean_accepted": sum(accepted) / len(accepted),
                "speedup": None if not (rate and base) else rate / base})
    return {"config": dataclasses.asdict(config), "batch_size": batch_size,
            "models": {"target": describe_model(target), "draft": describe_model(draft)},
            "systems": [{"label": s.label, "method": s.method, "tree_budget": s.tree_budget,
                         "options": describe_options(s, config),
                         "resolved_options": dict(s.resolved)} for s in systems],
            "warmup": warmup, "batches": batches, "aggregates": aggregates,
            "mismatches": failed, "all_outputs_match": not failed}


def render_batch_text(result: dict) -> str:
    """The text table of :func:`run_batch_suite`'s aggregates."""
    lines = [f"batch size {result['batch_size']}: tokens/s of all rows together and per row",
             f"{'system':<12} {'T':>4} {'tok/s':>9} {'tok/s/row':>10} {'accepted':>9} "
             f"{'speedup':>8}"]
    for a in result["aggregates"]:
        def fmt(value, spec):
            return "-" if value is None else format(value, spec)

        lines.append(f"{a['system']:<12} {a['temperature']:>4g} {fmt(a['tokens_per_s'], '9.1f')} "
                     f"{fmt(a['tokens_per_s_per_row'], '10.2f')} "
                     f"{a['mean_accepted']:>9.2f} "
                     f"{'-' if a['speedup'] is None else format(a['speedup'], '7.2f') + 'x'}")
    return "\n".join(lines)
