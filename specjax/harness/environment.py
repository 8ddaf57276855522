"""What a benchmark JSON records about where it ran (device, machine, versions, commit),
how it is written, and the one-call timer the micro-benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np

import specjax


def git_commit() -> dict:
    """``{"commit": HEAD or "unknown", "dirty_files": tracked files with changes}``."""

    def git(*args):
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL)

    try:  # status lines keep their leading space (" M path": changed, not staged)
        return {"commit": git("rev-parse", "HEAD").strip(),
                "dirty_files": git("status", "--porcelain", "--untracked-files=no").splitlines()}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty_files": []}


def _git_records(result):
    """Every dict in ``result`` that holds :func:`git_commit`'s ``dirty_files``, wherever
    the tool put it (top level, ``git``, ``machine``, each ``segments`` part of a resumed
    run)."""
    stack = [result]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "dirty_files" in node:
                yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def tree_changes(result) -> list[str]:
    """The uncommitted tracked files a result records (``git status --porcelain`` lines;
    older results lost the first line's leading space), sorted by path; empty for a run from a clean tree or a result that records no git
    state."""
    return sorted({line for record in _git_records(result)
                   for line in record.get("dirty_files") or ()}, key=lambda line: line[2:].strip())


def dirty_tree_warning(result) -> str | None:
    """One line saying that ``result`` was produced from a working tree with uncommitted
    changes (so its commit alone does not reproduce it), or ``None`` for a clean one."""
    changes = tree_changes(result)
    if not changes:
        return None
    shown = ", ".join(change.strip() for change in changes[:5])
    more = f" and {len(changes) - 5} more" if len(changes) > 5 else ""
    return (f"dirty tree: run with uncommitted changes to {len(changes)} tracked "
            f"file(s) ({shown}{more}); its commit alone does not reproduce it")


def versions() -> dict:
    """Versions of Python and the libraries a benchmark depends on (those installed)."""
    out = {"python": platform.python_version(), "jax": jax.__version__,
           "jaxlib": jaxlib.__version__, "numpy": np.__version__,
           "specjax": specjax.__version__}
    for name in ("flax", "transformers", "torch"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def machine() -> dict:
    """Device and host description, taken once at the start of a run."""
    device = jax.devices()[0]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(device),
        "device_kind": device.device_kind,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "specjax_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECJAX_")},
        # Compile times are cache hits when a persistent compilation cache is on (the
        # specjax program turns it on; see the README).
        "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "versions": versions(),
        "git": git_commit(),
    }


def write_json(path: str | os.PathLike, result, warn: bool = True) -> Path:
    """Writes ``result`` as indented JSON to ``path`` (parent folders made as needed), whole
    or not at all: the text is serialised first and moved into place from a temporary file
    beside it, so a failure or Ctrl-C leaves no half-written result. Returns the path.

    A result dict that records git state (:func:`git_commit`) gets a first key
    ``"dirty_tree"``: true when the run was made from a tree with uncommitted changes,
    which is then also said on stderr (``warn=False`` leaves that to a later, final write:
    a run that saves after every item says it once)."""
    path = Path(path)
    if isinstance(result, dict) and next(_git_records(result), None) is not None:
        warning = dirty_tree_warning(result)
        result = {"dirty_tree": warning is not None,
                  **{k: v for k, v in result.items() if k != "dirty_tree"}}
        if warning and warn:
            print(f"specjax: warning: {path}: {warning}", file=sys.stderr)
    text = json.dumps(result, indent=1) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(staging, path)
    except BaseException:
        os.unlink(staging)
        raise
    return path


def median_ms(fn, *args, repeats: int) -> float:
    """Milliseconds of ``fn(*args)`` (a jitted call, waited for), the median of ``repeats``
    calls after one untimed call (compilation and warm-up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)
