"""JAX's persistent compilation cache, as the ``specjax`` program and ``specjax.load`` use it.

Compiling a decode program takes seconds to tens of seconds; cached, a later process loads
it instead. What recompiles within one process: a new method or method options, a new
prompt-length bucket (prompts are padded to powers of two), a new cache capacity (prompt
bucket + max_new_tokens, rounded up), a new batch size bucket, a new dtype, mesh or
attention implementation. The temperature, top-k, top-p, seed and max_new_tokens within a
capacity are traced: changing them reuses the program.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

COMPILATION_CACHE_ENV = "SPECJAX_COMPILATION_CACHE"
_CACHE_OFF = ("", "0", "off", "no", "false")
_CACHE_MAX_BYTES = 2 << 30


def use_compilation_cache(environ=os.environ) -> str | None:
    """Keeps the ``specjax`` program's compiled programs between runs: JAX's persistent
    compilation cache, in ``$SPECJAX_COMPILATION_CACHE`` (``off`` or ``0``: no cache), else
    ``$XDG_CACHE_HOME/specjax/xla`` (``~/.cache/specjax/xla``), every program cached, at most
    2 GiB (least recently used entries go first).

    JAX's own settings win: with ``JAX_COMPILATION_CACHE_DIR`` set this changes nothing, and
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` / ``JAX_COMPILATION_CACHE_MAX_SIZE`` stay.
    The ``specjax`` program calls it at start, :func:`specjax.load` before loading: the
    cache is process-wide JAX configuration, so code that set its own cache directory
    first (``jax.config.update("jax_compilation_cache_dir", ...)``) keeps it.

    Returns:
      None, or a one-line reason why a directory the user named cannot be used (the run
      goes on without a cache; an unusable default directory is skipped silently).
    """
    if jax.config.jax_compilation_cache_dir or environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    value = environ.get(COMPILATION_CACHE_ENV)
    if value is not None and value.strip().lower() in _CACHE_OFF:
        return None
    try:
        if value is not None:
            directory = Path(value).expanduser()
        else:
            base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
            directory = Path(base) / "specjax" / "xla"
        directory.mkdir(parents=True, exist_ok=True)
        usable = os.access(directory, os.W_OK | os.X_OK)
    except (OSError, RuntimeError):  # RuntimeError: no home directory
        usable = False
    if not usable:
        return (None if value is None else f"{COMPILATION_CACHE_ENV}={value}: not a writable "
                "directory; compiling without a cache")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in environ:
        jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)
    return None


