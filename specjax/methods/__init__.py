"""Decoding methods: their options (what a user sets) and their steps (what runs).

Per method, one frozen options class owns the defaults, validation and help text
(:mod:`specjax.methods.options`), and one hashable static object runs it inside the
compiled program (:class:`~specjax.methods.ar.Autoregressive`,
:class:`~specjax.methods.speculative.Speculative`, :class:`~specjax.methods.staged.Staged`,
:class:`~specjax.methods.staged.NgramOnly`). :func:`build` makes the second from the
first. Each step object builds its own resources (``build_resources``) and its own state
(``init``, kept in ``DecodeState.method_state``): the protocol is
:class:`specjax.state.Method`. Shared pieces (statistics, keys, ranking, commit) live in
:mod:`specjax.methods.common`.

| method   | options            | module        | resources         | state         |
|----------|--------------------|---------------|-------------------|---------------|
| ``ar``     | :class:`ArOptions`     | ``ar``          | none              | none          |
| ``spec``   | :class:`SpecOptions`   | ``speculative`` | ``DraftResources``  | ``DraftState``  |
| ``tree``   | :class:`TreeOptions`   | ``speculative`` | ``DraftResources``  | ``DraftState``  |
| ``ngram``  | :class:`NgramOptions`  | ``staged``      | ``NgramTables``     | ``NgramState``  |
| ``staged`` | :class:`StagedOptions` | ``staged``      | ``StagedResources`` | ``DraftState``  |
"""

from __future__ import annotations

from specjax.config import ModelConfig
from specjax.methods.ar import Autoregressive
from specjax.methods.options import (METHODS, VERIFY_RULES, ArOptions, MethodOptions,
                                     NgramOptions, SpecOptions, StagedOptions, TreeOptions,
                                     check_verify_rule, method_options)
from specjax.methods.speculative import Speculative
from specjax.methods.staged import NgramOnly, Staged
from specjax.state import Method


def build(options: MethodOptions, draft_config: ModelConfig | None = None) -> Method:
    """The static method object that runs ``options`` (with the draft's config, for
    methods that use a draft)."""
    if options.uses_draft and draft_config is None:
        raise ValueError(f"method {options.name!r} needs the draft's config")
    if options.name == "ar":
        return Autoregressive()
    if options.name in ("spec", "tree"):
        return Speculative(options, draft_config)
    if options.name == "ngram":
        return NgramOnly(options)
    return Staged(options, draft_config)


__all__ = [
    "METHODS", "VERIFY_RULES", "ArOptions", "Autoregressive", "MethodOptions", "NgramOnly",
    "NgramOptions", "SpecOptions", "Speculative", "Staged", "StagedOptions", "TreeOptions",
    "build", "check_verify_rule", "method_options",
]
