"""PNG plots of a suite result, drawn with matplotlib's Agg backend (no display needed).

* ``speedup_sorted.png``: per-prompt speedup over ``ar``, sorted, one panel per temperature
  (like Figure 2 of the staged-speculation paper);
* ``mean_accepted.png``: mean accepted tokens per target pass against temperature;
* ``tokens_by_origin.png``: share of tokens by origin (n-gram, lookup, draft, target),
  stacked, when the methods report it;
* ``speedup_vs_tree_budget.png``: speedup against the tree budget, when the result holds
  several budgets of one method (``--tree-budgets``).
"""

from __future__ import annotations

from pathlib import Path

from specjax.errors import InvalidArgumentError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgumentError(
            "plots need matplotlib: pip install 'specjax[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok_rows(result: dict) -> list[dict]:
    return [r for r in result["rows"] if r.get("status") == "ok"]


def _temperatures(result: dict) -> list[float]:
    return list(dict.fromkeys(a["temperature"] for a in result["aggregates"]))


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Writes the plots that ``result`` has data for into ``out_dir`` (created).

    Returns:
      The paths written.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("speedup_sorted", _speedup_sorted), ("mean_accepted", _mean_accepted),
                       ("tokens_by_origin", _tokens_by_origin),
                       ("speedup_vs_tree_budget", _speedup_vs_budget)):
        figure = draw(plt, result)
        if figure is None:
            continue
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _speedup_sorted(plt, result):
    rows = [r for r in _ok_rows(result)
            if r["system"] != "ar" and r.get("speedup_vs_ar") is not None]
    if not rows:
        return None
    temperatures = _temperatures(result)
    figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4),
                                squeeze=False)
    from matplotlib.ticker import MaxNLocator

    for ax, t in zip(axes[0], temperatures):
        systems = list(dict.fromkeys(r["system"] for r in rows if r["temperature"] == t))
        for system in systems:
            values = sorted((r["speedup_vs_ar"] for r in rows
                             if r["system"] == system and r["temperature"] == t), reverse=True)
            ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=system)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"temperature {t:g}")
        ax.set_xlabel("prompt (sorted by speedup)")
        ax.set_ylabel("speedup over ar")
        ax.legend(fontsize=8)
    figure.suptitle("Per-prompt speedup")
    return figure


def _mean_accepted(plt, result):
    aggregates = [a for a in result["aggregates"] if a.get("status") == "ok"
                  and a.get("kind") == "specjax" and a["system"] != "ar"
                  and (a.get("mean_accepted") or {}).get("mean") is not None]
    if not aggregates:
        return None
    figure, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(a["system"] for a in aggregates):
        points = sorted((a["temperature"], a["mean_accepted"]["mean"])
                        for a in aggregates if a["system"] == system)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
    ax.set_xlabel("temperature")
    ax.set_ylabel("mean accepted tokens per target pass")
    ax.set_title("Acceptance against temperature")
    ax.legend(fontsize=8)
    return figure


def _tokens_by_origin(plt, result):
    aggregates = [a for a in result["aggregates"]
                  if a.get("origin_fraction") and a["system"] != "ar"]
    if not aggregates:
        return None
    origins = list(dict.fromkeys(k for a in aggregates for k in a["origin_fraction"]))
    labels = [f"{a['system']}\nT={a['temperature']:g}" for a in aggregates]
    figure, ax = plt.subplots(figsize=(max(4, 1.2 * len(labels)), 4))
    bottom = [0.0] * len(aggregates)
    for origin in origins:
        heights = [a["origin_fraction"].get(origin, 0.0) for a in aggregates]
        ax.bar(labels, heights, bottom=bottom, label=origin)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("share of generated tokens")
    ax.set_ylim(0, 1)
    ax.set_title("Tokens by origin")
    ax.legend(fontsize=8)
    return figure


def _speedup_vs_budget(plt, result):
    aggregates = [a for a in result["aggregates"] if a.get("status") == "ok"
                  and a.get("tree_budget") is not None
                  and (a.get("speedup_vs_ar") or {}).get("median") is not None]
    curves: dict[tuple, list] = {}
    for a in aggregates:
        curves.setdefault((a["method"], a["temperature"]), []).append(
            (a["tree_budget"], a["speedup_vs_ar"]["median"]))
    curves = {k: sorted(v) for k, v in curves.items() if len({b for b, _ in v}) > 1}
    if not curves:
        return None
    figure, ax = plt.subplots(figsize=(6, 4))
    for (method, t), points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=f"{method}, T={t:g}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("tree budget (nodes verified per target pass)")
    ax.set_ylabel("median speedup over ar")
    ax.set_title("Speedup against tree budget")
    ax.legend(fontsize=8)
    return figure
