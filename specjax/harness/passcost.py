"""Where a speculative step's time goes: target pass, draft passes, and the rest.

A suite measures each system's wall time per target pass (one step: drafting, one target
pass, acceptance and commit). This module times the step's forward passes on their own,
by the sizes the method declares (:class:`~specjax.methods.common.PassPlan`): the target
over ``target_nodes`` query rows under a tree mask, and every draft pass (its rows through
the blocks, its head rows through the head), each jitted and timed after a warm-up at a
cache of ``prefix`` committed tokens. What a step costs beyond those passes (stage-2
proposals, context lookup, ranking, tree selection, acceptance, cache commit, the loop)
is the *rest*: ``ms per target pass - target - draft`` (see
:func:`specjax.harness.report.pass_costs`).

    from specjax.harness.passcost import step_breakdown
    parts = step_breakdown(target, draft, specjax.method_options("staged"))
    # keys: target_nodes, target_ms, draft_passes ([rows, head_rows] each), draft_ms, ...
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import methods, models
from specjax.cache import init_cache
from specjax.loaded_model import Model
from specjax.methods.common import PassPlan
from specjax.tree import ancestor_mask, depths, kary_parents


def pass_plan(options, draft: Model | None) -> PassPlan:
    """The :class:`PassPlan` of the method ``options`` describe (``ar``: one node)."""
    method = methods.build(options, None if draft is None else draft.config)
    return getattr(method, "pass_plan", PassPlan())


def _pass(model: Model, rows: int, head_rows: int, prefix: int, attn_impl: str,
          tree: bool):
    """A blocking call running one forward pass of ``rows`` query rows (a 2-ary tree mask
    when ``tree``, else causal) over a cache of ``prefix`` tokens, head on ``head_rows``."""
    config = model.config
    capacity = 1 << int(prefix + rows + 1).bit_length()
    cache = init_cache(config, capacity, model.params["embed"].dtype).replace(
        length=jnp.int32(prefix))
    if tree and rows > 1:
        parents = jnp.asarray(kary_parents(2, rows, rows), jnp.int32)
        mask = ancestor_mask(parents, jnp.ones(rows, bool))
        positions = prefix + depths(parents)
    else:
        mask = models.causal_mask(rows)
        positions = prefix + jnp.arange(rows, dtype=jnp.int32)
    ids = jnp.asarray(np.arange(rows) % config.vocab_size, jnp.int32)
    # A feature draft (EAGLE-style) reads one feature row per token beside its id: the
    # target's (fused) block outputs or its own last output; their values do not change
    # the pass's cost.
    features = (jnp.zeros((rows, config.hidden_size), model.params["embed"].dtype)
                if config.feature_input else None)

    @jax.jit
    def run(params, cache, ids, positions, mask, features):
        hidden, _ = models.hidden_states(params, config, ids, positions, cache, mask,
                                         attn_impl=attn_impl, features=features)
        return models.lm_head(params, config, hidden[:head_rows])

    return lambda: jax.block_until_ready(run(model.params, cache, ids, positions, mask,
                                             features))


def step_breakdown(target: Model, draft: Model | None, options, *, prefix: int = 256,
                   attn_impl: str = "auto", repeats: int = 10) -> dict[str, Any]:
    """Times the forward passes of one step of the method ``options`` describe.

    Returns ``{"target_nodes", "target_ms", "draft_passes": [[rows, head_rows], ...],
    "draft_ms" (their sum), "prefix", "repeats"}``; medians over ``repeats`` calls.
    """
    return step_breakdowns(target, {"step": (options, draft)}, prefix=prefix,
                           attn_impl=attn_impl, repeats=repeats)["step"]


def step_breakdowns(target: Model, steps: dict[str, tuple[Any, Model | None]], *,
                    prefix: int = 256, attn_impl: str = "auto",
                    repeats: int = 10) -> dict[str, dict[str, Any]]:
    """:func:`step_breakdown` for several methods at once, their passes timed interleaved.

    Every distinct pass (model, rows, head rows) is compiled and run once, then each of
    ``repeats`` rounds times every pass once, in an order rotated from round to round, and
    a pass's time is its median over the rounds. A burst of load from elsewhere on the
    machine then lands on all the passes alike instead of on whichever method happened to
    be timed during it, so the methods' splits stay comparable with each other.

    ``steps`` maps a label to ``(options, draft)`` (``draft`` ``None`` for a method that
    takes none); returns one :func:`step_breakdown` dict per label, with ``interleaved``,
    the number of distinct passes timed together.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    plans = {label: pass_plan(options, draft) for label, (options, draft) in steps.items()}
    calls: dict[tuple, Any] = {}
    for label, plan in plans.items():
        draft = steps[label][1]
        key = ("target", plan.target_nodes, plan.target_nodes)
        if key not in calls:
            calls[key] = _pass(target, plan.target_nodes, plan.target_nodes, prefix,
                               attn_impl, tree=True)
        for rows, head_rows in plan.draft_passes:
            if ("draft", id(draft), rows, head_rows) not in calls:
                calls["draft", id(draft), rows, head_rows] = _pass(
                    draft, rows, head_rows, prefix, attn_impl, tree=False)
    keys = list(calls)
    for key in keys:
        calls[key]()  # compile and warm up
    times: dict[tuple, list[float]] = {key: [] for key in keys}
    for round_ in range(repeats):
        for i in range(len(keys)):
            key = keys[(i + round_) % len(keys)]
            start = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - start)
    ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    out = {}
    for label, plan in plans.items():
        out[label] = {
            "target_nodes": plan.target_nodes,
            "target_ms": ms["target", plan.target_nodes, plan.target_nodes],
            "draft_passes": [list(p) for p in plan.draft_passes],
            "draft_ms": sum(ms["draft", id(steps[label][1]), rows, head_rows]
                            for rows, head_rows in plan.draft_passes),
            "prefix": prefix, "repeats": repeats, "interleaved": len(keys)}
    return out
