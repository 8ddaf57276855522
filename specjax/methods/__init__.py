"""Decoding methods: their options (what a user sets) and their steps (what runs).

Per method, one frozen options class owns the defaults, validation and help text
(:mod:`specjax.methods.options`), and one hashable static object runs it inside the
compiled program (:class:`~specjax.methods.ar.Autoregressive`,
:class:`~specjax.methods.speculative.Speculative`, :class:`~specjax.methods.staged.Staged`,
:class:`~specjax.methods.staged.NgramOnly`). :func:`build` makes the second from the
first. Each step object builds its own resources (``build_resources``) and its own state
(``init``, kept in ``DecodeState.method_state``): the protocol is
:class:`specjax.state.Method`. The registry (:data:`REGISTRY`) maps each method's name to
its options class and builder, both exported by the method's module (``OPTIONS``,
``build``); a name it does not hold is an error everywhere. Shared pieces (statistics,
keys, ranking, commit) live in :mod:`specjax.methods.common`; the proposers, the draft
model's state and passes (:mod:`specjax.drafters.model`) among them, in
:mod:`specjax.drafters`.

| method   | options            | module        | resources         | state         |
|----------|--------------------|---------------|-------------------|---------------|
| ``ar``     | :class:`ArOptions`     | ``ar``          | none              | none          |
| ``spec``   | :class:`SpecOptions`   | ``speculative`` | ``DraftResources``  | ``DraftState``  |
| ``tree``   | :class:`TreeOptions`   | ``speculative`` | ``DraftResources``  | ``DraftState``  |
| ``ngram``  | :class:`NgramOptions`  | ``staged``      | ``NgramTables``     | ``NgramState``  |
| ``staged`` | :class:`StagedOptions` | ``staged``      | ``StagedResources`` | ``DraftState``  |
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.methods import ar, speculative, staged
from specjax.methods.ar import Autoregressive
from specjax.methods.options import (METHODS, VERIFY_RULES, ArOptions, MethodOptions,
                                     NgramOptions, SpecOptions, StagedOptions, TreeOptions,
                                     check_verify_rule, method_options)
from specjax.methods.speculative import Speculative
from specjax.methods.staged import NgramOnly, Staged
from specjax.state import Method


class Entry(NamedTuple):
    """One method of the registry: its options class and the builder of its step object
    (``builder(options, draft_config)``)."""

    options: type[MethodOptions]
    builder: Callable[[MethodOptions, ModelConfig | None], Method]


#: Method name -> :class:`Entry`, from the method modules' ``OPTIONS`` and ``build``
#: (``tests/test_methods.py`` checks that it names the methods of :data:`METHODS`).
REGISTRY: dict[str, Entry] = {cls.name: Entry(cls, module.build)
                              for module in (ar, speculative, staged) for cls in module.OPTIONS}


def build(options: MethodOptions, draft_config: ModelConfig | None = None) -> Method:
    """The static method object that runs ``options`` (with the draft's config, for
    methods that use a draft). Options of a method the registry does not hold raise."""
    entry = REGISTRY.get(getattr(options, "name", None))
    if entry is None or not isinstance(options, entry.options):
        raise InvalidArgumentError(
            f"no method runs {type(options).__name__} (name "
            f"{getattr(options, 'name', None)!r}); expected the options of one of "
            f"{', '.join(REGISTRY)}")
    if options.uses_draft and draft_config is None:
        raise ValueError(f"method {options.name!r} needs the draft's config")
    return entry.builder(options, draft_config)


__all__ = [
    "METHODS", "REGISTRY", "VERIFY_RULES", "ArOptions", "Autoregressive", "MethodOptions",
    "NgramOnly", "NgramOptions", "SpecOptions", "Speculative", "Staged", "StagedOptions",
    "TreeOptions", "build", "check_verify_rule", "method_options",
]
