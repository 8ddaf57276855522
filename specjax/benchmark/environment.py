"""What a benchmark JSON records about where it ran (device, machine, versions, commit),
how it is written, and the one-call timer the micro-benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import subprocess
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
        return subprocess.check_output(["git", *args], text=True,
                                       stderr=subprocess.DEVNULL).strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty_files": git("status", "--porcelain", "--untracked-files=no").splitlines()}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty_files": []}


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
        # The kernel choices (SPECJAX_GPU_KERNELS, SPECJAX_KERNEL_INTERPRET) change what runs.
        "specjax_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECJAX_")},
        # Compile times are cache hits when a persistent compilation cache is on (the
        # specjax program turns it on; see the README).
        "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "versions": versions(),
        "git": git_commit(),
    }


def write_json(path: str | os.PathLike, result) -> Path:
    """Writes ``result`` as indented JSON to ``path`` (parent folders made as needed), whole
    or not at all: the text is serialised first and moved into place from a temporary file
    beside it, so a failure or Ctrl-C leaves no half-written result. Returns the path."""
    path = Path(path)
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
