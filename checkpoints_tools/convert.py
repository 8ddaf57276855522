"""Converting any model source to a specjax checkpoint directory, atomically.

:func:`convert` loads what :func:`~specjax.checkpoints_tools.sources.resolve_and_load`
accepts (HF directory, hub id, GGUF file, known name) and writes it with
:func:`~specjax.checkpoints_tools.orbax_io.save_orbax`, recording what it was made from
(:func:`conversion_origin`, read back by
:func:`~specjax.checkpoints_tools.orbax_io.read_origin`).

The destination appears complete or not at all. Everything is written into a hidden
``.DST.partial-*`` directory beside it, which is renamed into place at the end. Ctrl-C
(see :mod:`specjax.interrupts`) stops the reading at once; while files are being written
it is held back until orbax has finished writing (orbax's threads cannot be stopped
half-way, and removing their directory under them left partial trees behind), then the
partial directory is removed and ``KeyboardInterrupt`` raised. The removal itself is not
cut short by a second Ctrl-C. Only a kill that Python cannot catch (SIGKILL, power loss)
can leave a ``.DST.partial-*`` directory, which is safe to delete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

import specjax
from specjax import interrupts, progress as progress_lib
from specjax.checkpoints_tools.hf import as_numpy_dtype
from specjax.checkpoints_tools.orbax_io import save_orbax
from specjax.checkpoints_tools.sources import known_origin, resolve_and_load
from specjax.errors import InvalidArgumentError


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype=None, progress: bool = True,
            overwrite: bool = False) -> Path:
    """Converts the model ``src`` into the specjax checkpoint directory ``dst``.

    Args:
      src: HF directory, hub id, GGUF file or known model name.
      dst: checkpoint directory to create.
      dtype: store parameters in this dtype (``"bfloat16"``, ``"float32"``...); ``None``
        keeps the source's (float32 for GGUF).
      progress: on a terminal, show the phases (loading, writing, finalizing) with their
        times and a per-tensor bar while loading (:mod:`specjax.progress`).
      overwrite: replace ``dst`` if it exists.
    Returns:
      ``dst`` as an absolute :class:`~pathlib.Path`.
    Raises:
      InvalidArgumentError: ``dst`` exists and ``overwrite`` is false.
      ModelNotFoundError, CheckpointError: as ``resolve_and_load``.
      KeyboardInterrupt: Ctrl-C; ``dst`` is then as it was (absent, or the old one).
    """
    as_numpy_dtype(dtype)  # reject a bad dtype before any slow loading
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise InvalidArgumentError(f"{dst} already exists; pass overwrite=True (--overwrite) "
                                   "to replace it")
    check_creatable(dst)
    with progress_lib.phases(progress) as shown, interrupts.guard() as interrupt:
        with shown.phase(f"loading {os.fspath(src)}"):
            config, params, tokenizer = resolve_and_load(src, dtype=dtype,
                                                         progress=shown.enabled)
        origin = conversion_origin(src, params)
        interrupt.check()  # one that jax's gc callback swallowed while loading
        with interrupt.deferred():
            dst.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
            try:
                with shown.phase(f"writing {dst}"):
                    save_orbax(staging, config, params, tokenizer, origin=origin)
                interrupt.check()
                with shown.phase("finalizing"):
                    _move_into_place(staging, dst, overwrite, interrupt)
            except BaseException:  # Ctrl-C included (raised by check): no half-written tree
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return dst


def check_creatable(dst: Path) -> None:
    """Rejects a destination whose directory cannot be created, before anything loads: the
    nearest existing parent must be a directory this process can write into.

    Raises:
      InvalidArgumentError: naming the parent that is missing, not a directory or not
        writable.
    """
    parent = dst.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidArgumentError(f"cannot create {dst}: {parent} is not a directory")
    try:  # permissions alone do not tell (root may write anywhere, /proc refuses anyway)
        os.rmdir(tempfile.mkdtemp(prefix=f".{dst.name}.probe-", dir=parent))
    except OSError as error:
        raise InvalidArgumentError(f"cannot create {dst}: cannot write into {parent} "
                                   f"({error.strerror})") from None


def conversion_origin(src: str | os.PathLike, params: dict) -> dict[str, Any]:
    """What :func:`convert` records about its source (see ``orbax_io.read_origin``).

    Args:
      src: the source as given to :func:`convert`.
      params: the parameters as they will be stored.
    Returns:
      ``{"source": str(src), "dtype": stored dtype name, "converted_by": "specjax
      <version>"}``, plus ``"known_model": name`` when ``src`` is a known model
      (:data:`~specjax.checkpoints_tools.sources.KNOWN_MODELS`): its name, its file, or a
      checkpoint converted from it.
    """
    dtypes = sorted({str(np.asarray(leaf).dtype) for leaf in jax.tree_util.tree_leaves(params)})
    origin: dict[str, Any] = {"source": os.fspath(src), "dtype": ",".join(dtypes),
                              "converted_by": f"specjax {specjax.__version__}"}
    known = known_origin(src)
    if known is not None:
        origin["known_model"] = known
    return origin


def _move_into_place(staging: Path, dst: Path, overwrite: bool,
                     interrupt: interrupts.Interrupt) -> None:
    """Renames ``staging`` to ``dst``, undoing it if Ctrl-C came meanwhile.

    An existing ``dst`` is set aside first (``os.replace`` cannot replace a non-empty
    directory) and put back on any failure; it is deleted only once the new one is in
    place and the conversion counts as done.
    """
    if dst.exists() and not overwrite:  # made by someone else while we were converting
        raise InvalidArgumentError(f"{dst} appeared during the conversion; pass "
                                   "overwrite=True (--overwrite) to replace it")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 is for the partial directory only
    aside = None
    if dst.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, aside / dst.name)
    try:
        os.replace(staging, dst)
        try:
            interrupt.check()
        except KeyboardInterrupt:
            os.replace(dst, staging)  # the caller removes it
            raise
    except BaseException:
        if aside is not None:
            os.replace(aside / dst.name, dst)
            aside.rmdir()
        raise
    interrupt.completed()  # from here a Ctrl-C cannot undo anything: the new dst stays
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
