"""Command-line flags of the method options, shared by ``specjax generate`` and
``specjax bench``: built from the options classes, whose field metadata hold each option's
help text, so that defaults and help exist in one place."""

from __future__ import annotations

import argparse

from specjax.errors import InvalidArgumentError
from specjax.methods.options import (METHODS, TOPOLOGIES, MethodOptions, all_option_fields,
                                     describe_defaults, method_options, methods_taking)


def _topology(text: str):
    if text in TOPOLOGIES:
        return text
    return _numbers(int, "a parents list such as -1,0,0,1, or dynamic or kary")(text)


def _numbers(kind, example: str):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}") from None
    return parse


_PARSERS = {"ints": _numbers(int, "comma-separated integers such as 12,7,4,1,1,1"),
            "floats": _numbers(float, "comma-separated numbers such as 0.4,0.1"),
            "topology": _topology}


def flag_of(option: str) -> str:
    """The command-line flag of a method option (``tree_budget`` -> ``--tree-budget``)."""
    return all_option_fields()[option].metadata.get("flag") or "--" + option.replace("_", "-")


def add_method_arguments(p: argparse.ArgumentParser, *, budget_flag: bool = True) -> None:
    """The flags of every method option, built from the options classes (their help text
    and defaults live there only); ``specjax generate`` and ``specjax bench`` share them.

    Every flag defaults to ``None`` ("the method's default"), so that a flag given for a
    method that does not take it is an error (:func:`method_from_args`).
    """
    for name, field in all_option_fields().items():
        if name == "tree_budget" and not budget_flag:
            continue
        takers = "/".join(methods_taking(name))
        meta = field.metadata
        help_text = f"{takers}: {meta['help']} (default: {describe_defaults(name)})"
        flag = flag_of(name)
        if isinstance(field.default, bool):
            p.add_argument(flag, dest=name, action="store_const", const=not field.default,
                           default=None, help=f"{takers}: {meta.get('flag_help', meta['help'])}")
            continue
        kind = _PARSERS[meta["parse"]] if "parse" in meta else type(field.default)
        metavar = meta.get("metavar", "N" if kind is int else None)
        p.add_argument(flag, dest=name, type=kind, default=None, choices=meta.get("choices"),
                       metavar=metavar, help=help_text)


def method_from_args(args, method: str, backend: str = "cpu") -> MethodOptions:
    """The options of ``method`` from parsed flags (the ``backend``'s defaults for the
    rest); a flag it does not take is an error naming the flag and the method."""
    cls = METHODS[method]
    given = {name: getattr(args, name) for name in all_option_fields()
             if getattr(args, name, None) is not None}
    for name in given:
        if name not in cls.option_names():
            raise InvalidArgumentError(
                f"{flag_of(name)} does not apply to method {method!r} (it applies to "
                f"{', '.join(methods_taking(name))})")
    return method_options(method, backend=backend, **given)
