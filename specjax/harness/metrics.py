"""Per-prompt metrics and their aggregates: pure functions over row dictionaries.

A *row* is one generation: one prompt, one system (a specjax method, or a transformers
peer), one temperature. Keys every ``"ok"`` row has: ``prompt``, ``system``, ``kind``
(``"specjax"`` or ``"peer"``), ``method``, ``temperature``, ``tree_budget``, ``new_tokens``,
``seconds`` (compile time excluded) and ``tokens_per_s``. specjax rows also have the
generation's ``stats`` (carried through whole, including keys this module does not know)
and ``target_calls``, ``draft_calls``, ``mean_accepted``, ``weight_bytes_read``, and
``tokens_by_origin`` when the method reports it. :func:`derive` adds the ratios to the
``ar`` row of the same prompt and temperature; :func:`aggregate` summarises each
(system, temperature) group over prompts.

Memory traffic (the staged-speculation paper's metric): at batch 1 decoding is bound by
reading weights, so every target pass is counted as reading all target parameters once
and every draft pass all draft parameters once; ``weight_bytes_per_token`` is that total
over the generated tokens, ``weight_bytes_vs_ar`` the same relative to ``ar``. Stage-2
tables (n-gram, lookup) are not counted: a proposal reads a few rows, not the tables. For
a mixture of experts every expert is counted, which overstates a pass of few rows (a
one-row pass reads the k experts it picked, not all E; see ``specjax.models.decoder``).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

AR = "ar"
# Per-row values summarised over prompts as median, mean and an aggregate.
SUMMARISED = ("tokens_per_s", "speedup_vs_ar", "mean_accepted", "target_passes_per_token",
              "draft_passes_per_token", "weight_bytes_per_token", "weight_bytes_vs_ar")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length when
    one is a prefix of the other), or ``None`` when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def must_match_ar(kind: str, temperature: float, verify: str | None) -> bool:
    """Whether a row's tokens must equal ``ar``'s: specjax methods at temperature 0, and
    at temperature > 0 under the coupled rule (the default), which reproduces ``ar``'s
    sampled tokens with the same seed. Peers are compared (at temperature 0) but never
    required to match."""
    return kind == "specjax" and (temperature == 0 or verify in (None, "coupled"))


def _ratio(numerator, denominator):
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def derive(rows: list[dict]) -> list[dict]:
    """Adds per-token and relative-to-``ar`` values to each ``"ok"`` row, in place.

    Adds ``target_passes_per_token``, ``draft_passes_per_token``,
    ``weight_bytes_per_token`` (specjax rows) and ``speedup_vs_ar``,
    ``weight_bytes_vs_ar`` (any row with an ``ar`` row for the same prompt and
    temperature). Returns ``rows``.
    """
    ar = {(r["prompt"], r["temperature"]): r for r in rows
          if r.get("status") == "ok" and r["system"] == AR}
    for row in rows:
        if row.get("status") != "ok":
            continue
        n = row["new_tokens"]
        if "target_calls" in row:
            row["target_passes_per_token"] = _ratio(row["target_calls"], n)
            row["draft_passes_per_token"] = _ratio(row.get("draft_calls", 0), n)
            row["weight_bytes_per_token"] = _ratio(row.get("weight_bytes_read"), n)
        base = ar.get((row["prompt"], row["temperature"]))
        if base is not None:
            row["speedup_vs_ar"] = _ratio(row.get("tokens_per_s"), base.get("tokens_per_s"))
            row["weight_bytes_vs_ar"] = _ratio(row.get("weight_bytes_per_token"),
                                               base.get("weight_bytes_per_token"))
    return rows


def _summary(values: list, aggregate) -> dict:
    values = [v for v in values if v is not None]
    return {"median": statistics.median(values) if values else None,
            "mean": statistics.fmean(values) if values else None,
            "aggregate": aggregate}


def _total(rows: Iterable[dict], key: str):
    values = [r.get(key) for r in rows]
    return None if not values or any(v is None for v in values) else sum(values)


def group_key(row: dict) -> tuple:
    return row["system"], row["temperature"]


def aggregate(rows: list[dict]) -> list[dict]:
    """Summaries per (system, temperature), in the order the groups first appear.

    Each value of :data:`SUMMARISED` gets ``median`` and ``mean`` over prompts and an
    ``aggregate`` computed from totals: tokens/s = total tokens / total seconds, speedup =
    that over ``ar``'s on the same prompts, mean accepted = total tokens / total target
    passes, passes and weight bytes per token = totals / total tokens. Groups with no
    ``"ok"`` row carry the first row's ``status`` and ``reason`` instead.
    """
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(group_key(row), []).append(row)
    ar_rows = {(r["prompt"], r["temperature"]): r for r in rows
               if r.get("status") == "ok" and r["system"] == AR}
    out = []
    for (system, temperature), members in groups.items():
        ok = [r for r in members if r.get("status") == "ok"]
        first = members[0]
        summary: dict[str, Any] = {
            "system": system, "kind": first.get("kind"), "method": first.get("method"),
            "temperature": temperature, "tree_budget": first.get("tree_budget"),
            "prompts": len(ok)}
        if not ok:
            summary.update(status=first.get("status"), reason=first.get("reason"))
            out.append(summary)
            continue
        summary["status"] = "ok"
        failures = [{k: r.get(k) for k in ("prompt", "status", "reason")}
                    for r in members if r.get("status") != "ok"]
        if failures:  # e.g. a peer that failed part-way through the run
            summary["failures"] = failures
        tokens, seconds = _total(ok, "new_tokens"), _total(ok, "seconds")
        tokens_per_s = _ratio(tokens, seconds)
        base = [ar_rows[(r["prompt"], temperature)] for r in ok
                if (r["prompt"], temperature) in ar_rows]
        base_tokens_per_s = _ratio(_total(base, "new_tokens"), _total(base, "seconds"))
        target_calls, draft_calls = _total(ok, "target_calls"), _total(ok, "draft_calls")
        weight_bytes = _total(ok, "weight_bytes_read")
        base_weight_bytes = _ratio(_total(base, "weight_bytes_read"), _total(base, "new_tokens"))
        aggregates = {
            "tokens_per_s": tokens_per_s,
            "speedup_vs_ar": _ratio(tokens_per_s, base_tokens_per_s) if len(base) == len(ok) else None,
            "mean_accepted": _ratio(tokens, target_calls),
            "target_passes_per_token": _ratio(target_calls, tokens),
            "draft_passes_per_token": _ratio(draft_calls, tokens),
            "weight_bytes_per_token": _ratio(weight_bytes, tokens),
            "weight_bytes_vs_ar": (_ratio(_ratio(weight_bytes, tokens), base_weight_bytes)
                                   if len(base) == len(ok) else None),
        }
        for key in SUMMARISED:
            summary[key] = _summary([r.get(key) for r in ok], aggregates[key])
        summary["new_tokens"], summary["seconds"] = tokens, seconds
        compile_seconds = [r.get("compile_seconds") or 0.0 for r in ok]
        summary["compile_seconds"] = {"total": sum(compile_seconds), "max": max(compile_seconds)}
        origins: dict[str, int] = {}
        for r in ok:
            for origin, count in (r.get("tokens_by_origin") or {}).items():
                origins[origin] = origins.get(origin, 0) + int(count)
        if origins:
            total = sum(origins.values())
            summary["tokens_by_origin"] = origins
            summary["origin_fraction"] = {k: v / total for k, v in origins.items()} if total else {}
        checked = [r for r in ok if r.get("matches_ar") is not None]
        summary["outputs"] = {
            "checked": len(checked),
            "mismatches": sum(1 for r in checked if not r["matches_ar"]),
            "required": any(r.get("must_match_ar") for r in ok)}
        out.append(summary)
    return out


def mismatches(rows: list[dict]) -> list[dict]:
    """The rows whose tokens had to equal ``ar``'s and did not."""
    return [r for r in rows if r.get("must_match_ar") and r.get("matches_ar") is False]


def find_aggregate(aggregates: list[dict], system: str, temperature: float) -> dict | None:
    return next((a for a in aggregates
                 if a["system"] == system and a["temperature"] == temperature), None)
