"""``specjax models``: the models known by name, what is shipped for each, and the method
each decodes with by default on each backend."""

from __future__ import annotations

from specjax import loading
from specjax.checkpoints_tools import sources
from specjax.methods import choice


def add_parser(sub) -> None:
    """Registers ``models`` on the CLI's subparsers."""
    p = sub.add_parser("models", help="list the known models and what is shipped for each",
                       description="The models known by name (-m NAME), where their weights "
                                   "come from, the draft and n-gram tables shipped for each, "
                                   "and the method each decodes with by default.")
    p.set_defaults(func=run)


def run(args) -> int:
    """``specjax models``: one block per known model."""
    del args
    for name, known in sources.KNOWN_MODELS.items():
        draft = loading.shipped_draft_name(name)
        folder = loading.shipped_assets(name)
        tables = folder / "ngram.npz" if loading.has_shipped_ngram(name) else None
        print(name)
        print(f"  weights: {known.filename} (pip package {known.distribution})")
        print(f"  draft: {f'{draft} ({folder})' if draft else 'none shipped'}")
        print(f"  n-gram tables: {tables or 'none shipped'}")
        for backend in ("cpu", "gpu", "tpu"):
            greedy = loading.default_method(name, backend, 0.0)
            sampled = loading.default_method(name, backend, 1.0)
            timed = ("" if (backend, "greedy") in choice.MEASURED
                     else " (not timed with this code)")
            print(f"  default method on {backend}: {greedy} at T=0, {sampled} at T>0{timed}")
        if draft or tables:
            print("  on a CPU: the table scaled by this machine's step costs, timed the first "
                  "time the model decodes with its default (SPECJAX_CALIBRATION=off: as is)")
    return 0
