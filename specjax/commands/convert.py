"""``specjax convert``: a checkpoint (model name, GGUF file, HF directory or hub id) into
specjax's orbax format, through :func:`specjax.checkpoints_tools.convert.convert`."""

from __future__ import annotations

import sys

from specjax import interrupts, progress
from specjax.checkpoints_tools.convert import convert
from specjax.checkpoints_tools.hf import as_numpy_dtype
from specjax.errors import InvalidArgumentError


def add_parser(sub) -> None:
    """Registers ``convert`` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="convert a checkpoint to specjax's orbax format",
                       description="Convert SRC (model name, GGUF file, HF directory or hub id) "
                                   "into an orbax directory DST (config + params + tokenizer, "
                                   "and specjax_origin.json: what it was made from, so that a "
                                   "converted known model keeps its shipped draft and n-gram "
                                   "tables). DST appears only when the conversion succeeded: "
                                   "Ctrl-C at any moment leaves no DST and no partial "
                                   "directory. On a terminal, shows each phase with its time.")
    p.add_argument("src", help="model name, GGUF file, HF or specjax directory, or hub id")
    p.add_argument("dst", help="the checkpoint directory to create")
    p.add_argument("--dtype", default=None,
                   help="store parameters in this dtype: float32, bfloat16 or float16 "
                        "(default: as loaded)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=run)


# The dtypes --dtype names in its help (others numpy knows as floating types work too).
CONVERT_DTYPES = ("float32", "bfloat16", "float16")


def run(args) -> int:
    """``specjax convert SRC DST``."""
    if args.dtype is not None:
        try:
            as_numpy_dtype(args.dtype)
        except InvalidArgumentError:
            raise InvalidArgumentError(f"--dtype {args.dtype}: not a parameter dtype; use "
                                       f"{', '.join(CONVERT_DTYPES)}") from None
    # Until convert() writes (it holds Ctrl-C back then, and cleans up), nothing needs
    # cleaning up: Ctrl-C ends the process at once, so that no gc callback or import can
    # swallow or garble it. Once DST is in place, Ctrl-C is ignored (see interrupts.command).
    with interrupts.command("specjax: interrupted"):
        convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite,
                progress=progress.bars_shown(True))
        print(f"wrote {args.dst}", file=sys.stderr)
    return 0
