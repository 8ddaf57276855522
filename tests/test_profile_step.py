"""``benchmarks/profile_step.py`` on the CPU, and the compiled steps copy no KV cache.

The decode loop of every method must update its caches in place: a step that copies a
whole cache, or one layer of it, moves the cache's bytes once more per step (on an H100 the
speculative steps ran 150-240 memcpy kernels per target pass). These tests read the HLO
XLA compiled for the CPU (``executable.as_text()``); the structure they check (which
buffers are copied or rewritten whole) is decided before any backend-specific kernel
choice, so it is the check that can run without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile_step():
    path = ROOT / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_step"] = module  # for its dataclasses
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("profile_step", None)


# ----------------------------------------------------------------------------- the script


def test_a_run_stopped_part_way_keeps_its_rows(profile_step, tmp_path, monkeypatch):
    """The JSON is rewritten after every row: a run stopped at a time limit (gpu_run.sh's
    STEP_TIMEOUT) keeps what it measured, marked incomplete."""
    calls = []

    def profile_method(model, method, *args):
        calls.append(method)
        if len(calls) == 1:
            raise RuntimeError("first method failed")  # a row, not a lost run
        raise KeyboardInterrupt  # the time limit

    monkeypatch.setattr(profile_step, "profile_method", profile_method)
    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        profile_step.main(["--model", "tiny", "--methods", "ar,spec", "--dtypes", "float32",
                           "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] is False and calls == ["ar", "spec"]
    [row] = result["rows"]
    assert row["method"] == "ar" and "first method failed" in row["error"]
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no staging file left


@pytest.mark.slow
def test_profile_step_writes_sane_counts(profile_step, tmp_path):
    """One command on the tiny config: per-pass wall time, CPU thunks from the trace, and HLO
    counts of the step, all non-zero and consistent."""
    out = tmp_path / "profile.json"
    status = profile_step.main(["--model", "tiny", "--methods", "ar", "--dtypes", "float32",
                                "--prompt-length", "120", "--new-tokens", "12",
                                "--repeats", "1", "--json", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True
    assert result["backend"] == "cpu" and result["machine"]["versions"]["jax"]
    [row] = result["rows"]
    assert row["method"] == "ar" and row["dtype"] == "float32" and "error" not in row
    assert row["target_passes"] == 11  # 12 tokens: the prefill samples the first
    # A difference of two timings: its sign is noise on a loaded machine with a tiny model.
    assert np.isfinite(row["wall_ms_per_pass"])
    assert row["wall_ms_per_pass_with_prefill"] > 0 and row["prefill_ms"] > 0

    loop = row["hlo_loop"]
    assert loop["step_ops"] > 20 and loop["step_ops_weighted"] >= loop["step_ops"]
    assert loop["step_ops_by_kind"].get("fusion", 0) > 0 and loop["module"]["fusions"] > 0
    # The layer loop is inside the step, with the model's layer count as its trip count.
    assert any(l["trip_count"] == 3 and l["ops_per_iteration"] > 5 for l in loop["loops"])
    assert loop["cache_sized_copies_per_step"] == 0
    assert row["cache_shapes"] == [[3, 256, 3, 16]]

    step = row["hlo_step_program"]
    cache_bytes = 2 * 3 * 256 * 3 * 16 * 4  # K and V, float32
    assert step["donated_bytes"] >= cache_bytes  # the streaming step donates its state
    assert step["parameter_bytes"] > step["donated_bytes"] > 0

    trace = row["trace"]
    assert trace["kind"] == "cpu_thunk" and trace["where"]["threads"]
    # At least one thunk per layer per step ran (the layer loop alone runs 3 bodies).
    assert trace["thunks_per_pass"] >= 3
    assert trace["thunk_ms_per_pass"] > 0
    assert trace["top_thunks"] and all(t["calls_per_pass"] >= 0 for t in trace["top_thunks"])


def test_hlo_parser_reads_calls_trip_counts_and_aliasing(profile_step):
    """The parser on a small program whose structure is known."""

    def body(carry, _):
        buffer, total, i = carry
        row = jnp.full((1, 4), i, jnp.float32)
        # (Reading `buffer` here, e.g. summing it, would read the old buffer unordered with
        # the in-place write: XLA would then copy it every iteration.)
        return (jax.lax.dynamic_update_slice(buffer, row, (i, 0)), total + jnp.sum(row),
                i + 1), None

    def program(buffer):
        (buffer, total, _), _ = jax.lax.scan(body, (buffer, 0.0, 0), None, length=5)
        return buffer, total

    executable = jax.jit(program, donate_argnums=0).lower(jnp.zeros((8, 4))).compile()
    text = executable.as_text()
    module = profile_step.parse_hlo(text)
    assert module.entry in module.computations
    report = profile_step.analyze_program(text, cache_shapes=[(1, 8, 4, 1)], step="entry")
    assert [l["trip_count"] for l in report["loops"]] == [5]
    assert report["step_ops_weighted"] > report["step_ops"] > 0
    assert report["donated_parameters"] == [0] and report["donated_bytes"] == 8 * 4 * 4
    assert report["cache_sized_copies_per_step"] == 0  # updated in place


# ----------------------------------------------------------------------------- no cache copies

PROMPT_LENGTH, NEW_TOKENS = 120, 12  # capacity 256: more than one 128-slot attention block


@pytest.fixture(scope="module")
def programs(profile_step):
    """The compiled loop and streaming step of ``ar``, ``tree`` and ``staged`` on the tiny
    config (3 layers; draft: its first 2), with their cache shapes."""
    model = profile_step.random_model("tiny", "float32")
    tables = profile_step.random_ngram_tables(model.config.vocab_size)
    prompt = np.random.default_rng(1).integers(3, 97, PROMPT_LENGTH).tolist()
    out = {}
    for method in ("ar", "tree", "staged"):
        options = profile_step.method_options(method, model, 2, tables)
        compiled = profile_step.compile_step_programs(model, prompt, options, NEW_TOKENS)
        capacity = profile_step._capacity(compiled.loop)
        shapes = [(3, capacity, 3, 16)] + ([(2, capacity, 3, 16)] if "draft" in options else [])
        out[method] = (compiled.loop.as_text(), compiled.step.as_text(), shapes)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "tree", "staged"])
def test_compiled_steps_copy_no_cache(profile_step, programs, method):
    loop_text, step_text, shapes = programs[method]
    assert shapes[0][1] == 256
    for text, where in ((loop_text, "loop"), (step_text, "entry")):
        report = profile_step.analyze_program(text, shapes, step=where)
        assert report["step_ops"] > 0
        assert report["cache_copies"] == [] and report["cache_writes"] == [], (
            method, where, report["cache_copies"], report["cache_writes"])


@pytest.mark.parametrize("method,blocks", [pytest.param("spec", (0, 1), marks=pytest.mark.slow),
                                           ("tree", (0, 1)), ("tree", (0,))])
def test_feature_draft_steps_copy_no_cache_and_no_features(profile_step, method, blocks):
    """With a feature draft the loop also carries the target's features [S, d]: the step
    reads them at catch-up and writes the accepted path's rows in place; neither they nor
    the target or draft caches are copied or rewritten per step. A one-block draft (EAGLE's
    shape) too: XLA inlines its one-trip layer loop, and the cache was copied per draft
    pass until the scratch write was ordered after the attention's reads."""
    import specjax
    from specjax.checkpoints_tools import feature_draft as fd

    model = profile_step.random_model("tiny", "float32")
    config, params = fd.feature_draft_from_target(model.config, model.params, blocks)
    draft = specjax.Model.from_params(config, params, name="feature")
    prompt = np.random.default_rng(2).integers(3, 97, PROMPT_LENGTH).tolist()
    compiled = profile_step.compile_step_programs(model, prompt,
                                                  {"method": method, "draft": draft},
                                                  NEW_TOKENS, with_step=False)
    capacity = profile_step._capacity(compiled.loop)
    c = model.config
    shapes = [(c.num_layers, capacity, c.num_kv_heads, c.head_dim),
              (len(blocks), capacity, c.num_kv_heads, c.head_dim), (1, capacity, c.hidden_size)]
    report = profile_step.analyze_program(compiled.loop.as_text(), shapes, step="loop")
    assert report["step_ops"] > 0
    assert report["cache_copies"] == [] and report["cache_writes"] == [], (
        report["cache_copies"], report["cache_writes"])


@pytest.mark.parametrize("nodes,window,layers", [(1, 0, 3), (5, 3, 3), (5, 3, 1), (5, 0, 1)])
def test_model_steps_in_a_loop_copy_no_cache(profile_step, nodes, window, layers):
    """The model's own step in a while loop, as the decode programs run it: a one-token
    forward and ``advance`` (``ar``), or a forward over a 5-node tree after a scratch window
    (as the drafters make) and the commit of a 3-node accepted path (speculative methods).
    No cache-sized copy or rewrite, with three layers or one (whose layer loop XLA inlines:
    the tree step copied the cache twice per step until the scratch write was ordered after
    the attention's reads)."""
    import dataclasses

    from specjax import models
    from specjax.cache import advance, commit_path, init_cache

    model = profile_step.random_model("tiny", "float32")
    config = dataclasses.replace(model.config, num_layers=layers)
    params = {**model.params,
              "layers": jax.tree.map(lambda a: a[:layers], model.params["layers"])}
    parents = jnp.asarray([-1, 0, 0, 1, 2][:nodes], jnp.int32)
    mask = jnp.tril(jnp.ones((nodes, nodes), bool)) if nodes == 1 else \
        jnp.asarray(np.asarray([[j == i or j == int(parents[i]) or
                                 (j == 0) for j in range(nodes)] for i in range(nodes)]))
    scratch = jnp.ones((nodes, window), bool) if window else None

    def step(cache):
        positions = cache.length + jnp.arange(nodes, dtype=jnp.int32)
        logits, cache = models.forward(params, config, positions % 97, positions, cache, mask,
                                       scratch)
        if nodes == 1:
            return advance(cache, 1)
        count = 1 + jnp.argmax(logits[:, 0]).astype(jnp.int32) % 3
        path = window + jnp.asarray([0, 1, 3], jnp.int32)  # root, node 1, its child 3
        return commit_path(cache, path, count)

    def program(cache):
        return jax.lax.while_loop(lambda c: c.length < 200, step, cache)

    cache = init_cache(config, 256)
    text = jax.jit(program, donate_argnums=0).lower(cache).compile().as_text()
    shapes = [(config.num_layers, 256, config.num_kv_heads, config.head_dim)]
    report = profile_step.analyze_program(text, shapes, step="loop")
    assert layers == 1 or any(l["trip_count"] == layers for l in report["loops"])
    assert report["cache_copies"] == [] and report["cache_writes"] == [], (
        report["cache_copies"], report["cache_writes"])


def _toy_decode(layer_indexed: bool):
    """A while loop of decode steps over a [L, S, K, D] cache, with attention written the way
    ``specjax.models.hidden_states`` reads the cache (``layer_indexed``) or the way it used to
    (a scan over the cache's layers, which slices a copy of every layer each step)."""
    from specjax.attention import attention_blocked

    layers, capacity, heads, dim = 3, 256, 2, 16
    mask = jnp.ones((1, 1), bool)

    def step(state):
        cache_k, cache_v, length, x = state

        def layer(carry, xs):
            x, index = carry
            if layer_indexed:
                k_layer, v_layer = cache_k, cache_v
            else:
                k_layer, v_layer = xs
            q = jnp.broadcast_to(x, (1, heads, dim))
            out = attention_blocked(q, q, q, k_layer, v_layer, length, mask,
                                    layer=index if layer_indexed else None)
            return (out[0, 0], index + 1), q[:, :, :]

        xs = None if layer_indexed else (cache_k, cache_v)
        (x, _), new = jax.lax.scan(layer, (x, jnp.int32(0)), xs, length=layers)
        start = (0, length, 0, 0)
        cache_k = jax.lax.dynamic_update_slice(cache_k, new, start)
        cache_v = jax.lax.dynamic_update_slice(cache_v, new, start)
        return cache_k, cache_v, length + 1, x

    def program(cache_k, cache_v):
        state = (cache_k, cache_v, jnp.int32(3), jnp.ones((dim,)))
        return jax.lax.while_loop(lambda s: s[2] < 40, step, state)

    cache = jnp.zeros((layers, capacity, heads, dim))
    text = jax.jit(program, donate_argnums=(0, 1)).lower(cache, cache).compile().as_text()
    return text, [(layers, capacity, heads, dim)]


def test_copy_check_catches_a_per_layer_cache_copy(profile_step):
    """The analysis is sharp: scanning over the cache's layers (the model's old layer loop)
    copies each layer's K and V every step, and the same step reading the layer by index
    copies nothing."""
    text, shapes = _toy_decode(layer_indexed=False)
    copying = profile_step.analyze_program(text, shapes, step="loop")
    assert copying["cache_sized_copies_per_step"] >= 3, copying["cache_writes"]
    text, shapes = _toy_decode(layer_indexed=True)
    clean = profile_step.analyze_program(text, shapes, step="loop")
    assert clean["cache_sized_copies_per_step"] == 0, (clean["cache_copies"],
                                                       clean["cache_writes"])
