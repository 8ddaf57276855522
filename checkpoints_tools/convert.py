"""Converting any model source to a specjax checkpoint directory, atomically.

:func:`convert` loads what :func:`~specjax.checkpoints_tools.sources.resolve_and_load`
accepts (HF directory, hub id, GGUF file, known name) and writes it with
:func:`~specjax.checkpoints_tools.orbax_io.save_orbax`. It writes into a hidden temporary
directory beside the destination and renames it into place only when everything is
written, so the destination either appears complete or not at all: on any error, or
Ctrl-C, the temporary directory is removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from specjax.checkpoints_tools.hf import as_numpy_dtype
from specjax.checkpoints_tools.orbax_io import save_orbax
from specjax.checkpoints_tools.sources import resolve_and_load
from specjax.errors import InvalidArgumentError


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype=None, progress: bool = True,
            overwrite: bool = False) -> Path:
    """Converts the model ``src`` into the specjax checkpoint directory ``dst``.

    Args:
      src: HF directory, hub id, GGUF file or known model name.
      dst: checkpoint directory to create.
      dtype: store parameters in this dtype (``"bfloat16"``, ``"float32"``...); ``None``
        keeps the source's (float32 for GGUF).
      progress: show a per-tensor progress bar while loading.
      overwrite: replace ``dst`` if it exists.
    Returns:
      ``dst`` as an absolute :class:`~pathlib.Path`.
    Raises:
      InvalidArgumentError: ``dst`` exists and ``overwrite`` is false.
      ModelNotFoundError, CheckpointError: as ``resolve_and_load``.
    """
    as_numpy_dtype(dtype)  # reject a bad dtype before any slow loading
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise InvalidArgumentError(f"{dst} already exists; pass overwrite=True (--overwrite) "
                                   "to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        config, params, tokenizer = resolve_and_load(src, dtype=dtype, progress=progress)
        save_orbax(staging, config, params, tokenizer)
        _move_into_place(staging, dst)
    except BaseException:  # KeyboardInterrupt included: never leave a half-written tree
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def _move_into_place(staging: Path, dst: Path) -> None:
    """Renames ``staging`` to ``dst``; an existing ``dst`` is set aside until that worked."""
    if not dst.exists():
        os.replace(staging, dst)
        return
    # os.replace cannot replace a non-empty directory: move the old one aside first.
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, aside / dst.name)
    try:
        os.replace(staging, dst)
    except BaseException:
        os.replace(aside / dst.name, dst)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
