"""Rendering a suite result (the JSON of ``specjax bench``) as text or Markdown.

:func:`render_markdown` is what goes into the README's results section: one table per
result file, systems (specjax methods and peers) by temperatures, headed by the machine
and the exact command stored in the file.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Sequence

from specjax.errors import InvalidArgumentError
from specjax.harness.environment import dirty_tree_warning


def read_result(path: str | Path) -> dict:
    """Loads a suite JSON file; raises :class:`InvalidArgumentError` if it is not one."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise InvalidArgumentError(f"cannot read benchmark result {str(path)!r}: {err}") from None
    if not isinstance(result, dict) or "aggregates" not in result or "rows" not in result:
        raise InvalidArgumentError(
            f"{str(path)!r} is not a 'specjax bench' result (no 'aggregates'/'rows')")
    return result


def _number(value, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _value(aggregate: dict, key: str, which: str):
    return (aggregate.get(key) or {}).get(which)


def _temperatures(result: dict) -> list[float]:
    return list(dict.fromkeys(a["temperature"] for a in result["aggregates"]))


def _systems(result: dict) -> list[str]:
    return list(dict.fromkeys(a["system"] for a in result["aggregates"]))


def _find(result: dict, system: str, temperature: float) -> dict | None:
    return next((a for a in result["aggregates"]
                 if a["system"] == system and a["temperature"] == temperature), None)


def _outputs(result: dict, system: str) -> str:
    """"yes (4/4)", "NO (1 of 4 differ)" or "–" over a system's checked rows."""
    checked = mismatched = 0
    for a in result["aggregates"]:
        if a["system"] == system and a.get("outputs"):
            checked += a["outputs"]["checked"]
            mismatched += a["outputs"]["mismatches"]
    if system == "ar":
        return "reference"
    if not checked:
        return "–"
    return f"yes ({checked}/{checked})" if not mismatched else f"NO ({mismatched} of {checked} differ)"


def _prompt_count(result: dict) -> int:
    """How many prompts a result has rows for (peer status rows carry no prompt)."""
    return len({r["prompt"] for r in result["rows"] if r.get("prompt") is not None})


def _heading(result: dict) -> list[str]:
    config = result.get("config", {})
    target = (result.get("models") or {}).get("target") or {}
    draft = (result.get("models") or {}).get("draft")
    versions = result.get("versions", {})
    machine = ", ".join(x for x in (
        f"{result.get('device_kind', '?')} ({result.get('device', '?')})",
        f"{result.get('cpu_count', '?')} CPUs",
        result.get("platform", ""),
        " ".join(f"{k} {versions[k]}" for k in ("jax", "transformers", "torch") if k in versions),
        f"git {str((result.get('git') or {}).get('commit', 'unknown'))[:10]}",
        result.get("date", "")) if x)
    peers = result.get("peers") or {}
    lines = [
        f"**{config.get('suite', 'suite')}**: {_prompt_count(result)} "
        f"prompts x {config.get('max_new_tokens')} new tokens, seed {config.get('seed')}; "
        f"target `{target.get('name', '?')}` ({target.get('dtype', '?')}), draft "
        + (f"`{draft['name']}`" if draft else "none")
        + (f"; peers on {peers.get('device')} ({peers.get('dtype')})" if peers.get("peers") else ""),
        "",
        f"Machine: {machine}" + (
            f"; load average {_load(result)}" if result.get("load_average_start") else ""),
        "",
        f"Command: `{result.get('command', '?')}`",
        "",
    ]
    dirty = dirty_tree_warning(result)
    if dirty:
        lines += [f"**Warning, {dirty}.**", ""]
    parts = _parts(result)
    return lines + ([parts, ""] if parts else [])


def _parts(result: dict) -> str | None:
    """For a run finished with ``--resume``: which prompts each part ran, when, at which
    commit and load (the heading's machine line is the first part's)."""
    segments = result.get("segments") or []
    if len(segments) < 2:
        return None
    prompts = _prompt_count(result)
    described = []
    for i, segment in enumerate(segments):
        last = segments[i + 1]["from_prompt"] - 1 if i + 1 < len(segments) else prompts - 1
        start, end = segment.get("load_average_start"), segment.get("load_average_end")
        load = (f", load {start[0]:.1f} -> {end[0]:.1f}" if start and end else "")
        commit = str((segment.get("git") or {}).get("commit", "unknown"))[:7]
        described.append(f"prompts {segment['from_prompt']}-{last} from "
                         f"{segment.get('date', '?')} at {commit}{load}")
    return f"Run in {len(segments)} parts (`--resume`): " + "; ".join(described) + "."


def _load(result: dict) -> str:
    start, end = result.get("load_average_start"), result.get("load_average_end")
    return f"{start[0]:.1f} at the start" + (f", {end[0]:.1f} at the end" if end else "")


def render_markdown(results: Sequence[dict]) -> str:
    """Markdown for one or more suite results.

    Per result: a heading paragraph (suite, sizes, models, machine, command), then a table
    with one row per system and, per temperature, tokens/s (total tokens / total seconds),
    the median per-prompt speedup over ``ar`` at that temperature, mean accepted tokens per
    target pass and weight bytes read per token relative to ``ar``; a last column says
    whether the outputs equal ``ar``'s. A second table gives the share of tokens by origin
    when the methods report it, a third the cost of a target pass (:func:`pass_costs`), a
    fourth each specjax system against its transformers counterpart (:func:`peer_ratios`)
    when peers ran.
    """
    out = []
    for result in results:
        out += _heading(result)
        temperatures = _temperatures(result)
        header = ["system"]
        for t in temperatures:
            header += [f"T={t:g} tok/s", f"T={t:g} speedup", f"T={t:g} accepted",
                       f"T={t:g} weights/token"]
        header.append("outputs = ar")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        for system in _systems(result):
            cells = [f"`{system}`"]
            reason = None
            for t in temperatures:
                a = _find(result, system, t)
                if a is None or a.get("status") != "ok":
                    reason = reason or (a or {}).get("reason")
                    cells += ["–"] * 4
                    continue
                cells += [_number(_value(a, "tokens_per_s", "aggregate"), 1),
                          _number(_value(a, "speedup_vs_ar", "median"), 2, "x"),
                          _number(_value(a, "mean_accepted", "aggregate"), 2),
                          _number(_value(a, "weight_bytes_vs_ar", "aggregate"), 2, "x")]
            if reason and all(c == "–" for c in cells[1:]):
                cells = [cells[0], f"{_status(result, system)}: {reason}"] + [""] * (len(header) - 2)
            else:
                cells.append(_outputs(result, system))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.append("tok/s: total new tokens / total seconds (compile time excluded); speedup: "
                   "median over prompts of tokens/s relative to `ar` at the same temperature; "
                   "accepted: tokens per target pass; weights/token: parameter bytes read per "
                   "generated token (every target and draft pass reads all its weights) "
                   "relative to `ar`; outputs = ar: generations token-for-token equal to `ar`'s "
                   "with the same seed (methods: at T=0 and, with the coupled rule, at every "
                   "T; peers: at T=0, for information).")
        out.append("")
        origins = [a for a in result["aggregates"]
                   if a.get("origin_fraction") and a["system"] != "ar"]
        if origins:
            names = list(dict.fromkeys(k for a in origins for k in a["origin_fraction"]))
            out.append("| system | T | " + " | ".join(f"from {n}" for n in names) + " |")
            out.append("|" + "---|" * (len(names) + 2))
            for a in origins:
                out.append(f"| `{a['system']}` | {a['temperature']:g} | " + " | ".join(
                    _number(100 * a["origin_fraction"].get(n, 0.0), 1, "%") for n in names) + " |")
            out.append("")
        costs = pass_costs(result)
        if any(c["system"] != "ar" for c in costs):
            split = any(c.get("target_ms") is not None for c in costs)
            head = ("| system | T | draft passes / target pass | ms / target pass "
                    "| vs `ar` step | accepted | speedup (totals) |")
            if split:
                head += " nodes | target pass ms | draft ms | rest ms |"
            out.append(head)
            out.append("|" + "---|" * (head.count("|") - 1))
            for c in costs:
                line = (f"| `{c['system']}` | {c['temperature']:g} | "
                        f"{_number(c['draft_passes_per_target_pass'], 2)} | "
                        f"{_number(c['ms_per_target_pass'], 1)} | "
                        f"{_number(c['vs_ar_step'], 2, 'x')} | "
                        f"{_number(c['accepted'], 2)} | {_number(c['speedup'], 2, 'x')} |")
                if split:
                    line += (f" {c.get('target_nodes', '–')} | {_number(c.get('target_ms'), 1)} "
                             f"| {_number(c.get('draft_ms'), 1)} | "
                             f"{_number(c.get('rest_ms'), 1)} |")
                out.append(line)
            out.append("")
            out.append("ms / target pass: total seconds / total target passes, i.e. one target "
                       "pass with the drafting (draft passes, stage 2) and bookkeeping around "
                       "it; vs `ar` step: that over `ar`'s ms per token at the same "
                       "temperature; speedup (totals) = accepted / vs `ar` step."
                       + (" The last columns split a step: the target pass over `nodes` query "
                          "rows and the step's draft passes, each timed on its own after the "
                          f"suite ({_timing(result)}), and the rest "
                          "(stage-2 proposals, lookup, ranking, tree selection, acceptance, "
                          "commit, loop) = ms / target pass - target - draft."
                          if split else "")
                       + (" A negative rest means those passes ran slower when timed on their "
                          "own than the suite's steps did (the machine's load changed, or "
                          "the standalone program runs differently): the split is then only "
                          "approximate."
                          if any((c.get("rest_ms") or 0) < 0 for c in costs) else ""))
            out.append("")
        ratios = peer_ratios(result)
        if ratios:
            out.append("| specjax | transformers | T | prompts | tok/s ratio (median) "
                       "| tok/s ratio (totals) |")
            out.append("|---|---|---|---|---|---|")
            for r in ratios:
                out.append(f"| `{r['system']}` | `{r['peer']}` | {r['temperature']:g} | "
                           f"{r['prompts']} | {r['median']:.2f}x | {r['aggregate']:.2f}x |")
            out.append("")
    return "\n".join(out)


# Which specjax system each transformers peer is set against: the same algorithm family
# (plain decoding, a draft model, prompt lookup) and the staged decoder with the same draft.
PEER_COUNTERPARTS = (("ar", "hf"), ("spec", "hf-assisted"), ("staged", "hf-assisted"),
                     ("ngram", "hf-lookup"))


def peer_ratios(result: dict) -> list[dict]:
    """specjax system vs transformers peer, per temperature, over the prompts both ran.

    Returns one dict per pair of :data:`PEER_COUNTERPARTS` present in ``result`` and
    temperature: ``system``, ``peer``, ``temperature``, ``prompts``, ``median`` (of the
    per-prompt tokens/s ratios) and ``aggregate`` (total tokens / total seconds of each).
    """
    rows = {}
    for row in result["rows"]:
        if row.get("status") == "ok" and row.get("seconds"):
            rows[(row["system"], row["temperature"], row["prompt"])] = row
    out = []
    for t in _temperatures(result):
        for system, peer in PEER_COUNTERPARTS:
            pairs = [(row, rows[(peer, t, p)]) for (name, temp, p), row in rows.items()
                     if name == system and temp == t and (peer, t, p) in rows]
            if not pairs:
                continue
            median = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs)
            rate = [sum(r["new_tokens"] for r in side) / sum(r["seconds"] for r in side)
                    for side in zip(*pairs)]
            out.append({"system": system, "peer": peer, "temperature": t,
                        "prompts": len(pairs), "median": median,
                        "aggregate": rate[0] / rate[1]})
    return out


def _timing(result: dict) -> str:
    """How the result's standalone passes were timed (their breakdown entries say)."""
    parts = next(iter((result.get("pass_breakdown") or {}).values()), None) or {}
    how = f"jitted, cache of {parts.get('prefix', 256)} tokens"
    if parts.get("interleaved"):
        return (f"{how}, every system's passes interleaved over {parts['repeats']} rounds, "
                "medians")
    return f"{how}, median of {parts.get('repeats', 10)}, one system after another"


def pass_costs(result: dict) -> list[dict]:
    """Where each specjax system's time goes, per temperature, from the rows' totals.

    speedup over ``ar`` = (tokens per target pass) / (time per target pass relative to
    ``ar``'s time per token): a method wins only while its tree is accepted deeper than
    its pass (the target over the tree, the draft passes, stage 2) costs. Returns one dict
    per (specjax system, temperature) with target passes: ``system``, ``temperature``,
    ``draft_passes_per_target_pass``, ``ms_per_target_pass``, ``vs_ar_step``,
    ``accepted`` and ``speedup`` (totals; ``None`` where ``ar`` did not run); where the
    result has a ``pass_breakdown`` (:mod:`specjax.harness.passcost`), also
    ``target_nodes``, ``target_ms``, ``draft_ms`` and ``rest_ms`` (the step's time outside
    those passes).
    """
    totals: dict[tuple, list[float]] = {}
    for row in result["rows"]:
        if row.get("status") == "ok" and row.get("target_calls"):
            t = totals.setdefault((row["system"], row["temperature"]), [0, 0, 0, 0.0])
            t[0] += row["new_tokens"]
            t[1] += row["target_calls"]
            t[2] += row.get("draft_calls") or 0
            t[3] += row["seconds"]
    out = []
    breakdown = result.get("pass_breakdown") or {}
    for (system, temperature), (tokens, passes, draft_passes, seconds) in totals.items():
        ms = 1000 * seconds / passes
        ar = totals.get(("ar", temperature))
        ar_ms = 1000 * ar[3] / ar[0] if ar else None
        relative = ms / ar_ms if ar_ms else None
        row = {"system": system, "temperature": temperature,
               "draft_passes_per_target_pass": draft_passes / passes,
               "ms_per_target_pass": ms, "vs_ar_step": relative,
               "accepted": tokens / passes,
               "speedup": tokens / passes / relative if relative else None}
        parts = breakdown.get(system)
        if parts:
            row.update(target_nodes=parts["target_nodes"], target_ms=parts["target_ms"],
                       draft_ms=parts["draft_ms"],
                       rest_ms=ms - parts["target_ms"] - parts["draft_ms"])
        out.append(row)
    return out


def _status(result: dict, system: str) -> str:
    statuses = {a.get("status") for a in result["aggregates"] if a["system"] == system}
    return "error" if "error" in statuses else "unavailable"


def render_text(result: dict) -> str:
    """One line per (system, temperature): the end-of-run summary, after a warning line
    when the run was made from a tree with uncommitted changes."""
    dirty = dirty_tree_warning(result)
    lines = [f"warning: {dirty}"] if dirty else []
    for a in result["aggregates"]:
        head = f"T={a['temperature']:<4g} {a['system']:<14}"
        if a.get("status") != "ok":
            lines.append(f"{head} {a.get('status')}: {a.get('reason')}")
            continue
        parts = [f"{_number(_value(a, 'tokens_per_s', 'aggregate'), 1):>7} tok/s",
                 f"speedup {_number(_value(a, 'speedup_vs_ar', 'aggregate'), 2, 'x')}"
                 f" (median {_number(_value(a, 'speedup_vs_ar', 'median'), 2, 'x')})"]
        if _value(a, "mean_accepted", "aggregate") is not None:
            parts += [f"accepted {_number(_value(a, 'mean_accepted', 'aggregate'), 2)}",
                      f"target passes/token {_number(_value(a, 'target_passes_per_token', 'aggregate'), 2)}",
                      f"draft passes/token {_number(_value(a, 'draft_passes_per_token', 'aggregate'), 2)}",
                      f"weights {_number(_value(a, 'weight_bytes_vs_ar', 'aggregate'), 2, 'x')} ar"]
        outputs = a.get("outputs") or {}
        if outputs.get("checked"):
            parts.append(f"= ar {outputs['checked'] - outputs['mismatches']}/{outputs['checked']}")
        if a.get("origin_fraction") and a["system"] != "ar":
            parts.append("origin " + " ".join(f"{k} {100 * v:.0f}%"
                                              for k, v in a["origin_fraction"].items()))
        lines.append(head + "  ".join(parts))
    return "\n".join(lines)
