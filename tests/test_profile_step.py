"""``benchmarks/profile_step.py`` on the CPU, and the compiled steps copy no KV cache.

The decode loop of every method must update its caches in place: a step that copies a
whole cache, or one layer of it, moves the cache's bytes once more per step (on an H100 the
speculative steps ran 150-240 memcpy kernels per target pass). These tests read the HLO
XLA compiled for the CPU (``executable.as_text()``); the structure they check (which
buffers are copied or rewritten whole) is decided before any backend-specific kernel
choice, so it is the check that can run without a GPU.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import users_compiles

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

    def profile_method(model, method, *args, **kwargs):
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


@pytest.mark.parametrize("argv, fragment", [
    (["--tree-budget", "0"], "expected an integer >= 1, got '0'"),
    (["--tree-budget", "-3"], "expected an integer >= 1"),
    (["--tree-budget", "2.5"], "expected an integer >= 1"),
    (["--tree-budget", "many"], "expected an integer >= 1"),
    (["--methods", "ar,ngram", "--tree-budget", "4"], "applies to tree and staged"),
    # More nodes than staged drafts, at the defaults of any backend (GPU: 132 candidates).
    (["--methods", "tree,staged", "--tree-budget", "999"], "tree_budget 999 exceeds"),
])
def test_a_bad_tree_budget_is_an_error_before_anything_runs(profile_step, tmp_path, capsys,
                                                          monkeypatch, argv, fragment):
    monkeypatch.setattr(profile_step, "profile_method", None)  # a call would fail the test
    out = tmp_path / "profile.json"
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main(["--model", "tiny", "--dtypes", "float32", "--json", str(out),
                           *argv])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " in last and fragment in last, last
    assert not out.exists()


def test_tree_budget_applies_to_the_methods_that_take_one(profile_step):
    from specjax.methods.options import methods_taking

    assert set(profile_step.BUDGET_METHODS) == set(methods_taking("tree_budget"))
    model = profile_step.random_model("tiny", "float32")
    for method in profile_step.METHODS:
        options = profile_step.method_options(method, model, 2, None, tree_budget=5,
                                              attn_impl="reference")
        assert options["kernels"].attention == "reference"  # --attn-impl reaches generate
        assert options.get("tree_budget") == (5 if method in ("tree", "staged") else None)
    assert "tree_budget" not in profile_step.method_options("tree", model, 2, None)


def test_tree_budget_reaches_the_program_and_each_row_records_its_options(profile_step,
                                                                        tmp_path, monkeypatch):
    """``--tree-budget 3`` on the tiny config: the row's ``options`` are those the API
    resolved (the budget given, the backend's defaults for the rest)."""
    from specjax.methods import method_options

    compile_loop_only = profile_step.compile_step_programs  # the streaming step: not needed
    monkeypatch.setattr(profile_step, "compile_step_programs",
                        lambda *args, **kwargs: compile_loop_only(
                            *args, **{**kwargs, "with_step": False}))
    out = tmp_path / "profile.json"
    status = profile_step.main(["--model", "tiny", "--methods", "tree", "--dtypes", "float32",
                                "--prompt-length", "8", "--new-tokens", "3", "--repeats", "1",
                                "--no-trace", "--tree-budget", "3", "--json", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["config"]["tree_budget"] == 3
    [row] = result["rows"]
    assert "error" not in row and row["attn_impl"] == "auto"
    expected = method_options("tree", backend=jax.default_backend(), tree_budget=3)
    assert row["options"] == json.loads(json.dumps(expected.to_dict()))
    assert row["options"]["tree_budget"] == 3


@pytest.mark.slow
@pytest.mark.users_compile
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
    # Thunk time per pass is also a difference of two runs' totals: its sign is noise too.
    assert np.isfinite(trace["thunk_ms_per_pass"])
    assert all(np.isfinite(t["ms_per_pass"]) for t in trace["top_thunks"])
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


# ----------------------------------------------------------------------------- GPU traces


def _gpu_trace(passes: int) -> list[dict]:
    """A ``jax.profiler`` trace of a GPU run, as the trace viewer's JSON writes it (XLA's
    CUPTI collector: one process per device, one line per CUDA stream named for the event
    kinds on it, ``memcpy_details`` / ``memset_details`` strings with the bytes): the
    prefill once, then ``passes`` target passes. Beside the stream lines: lines that
    repeat the kernels (XLA Ops, XLA Modules, Steps), CUPTI's overhead line and the host's
    threads, none of which may be counted.

    Per pass: fusion_a (10 us) twice, attention_split (30 us), XLA's memcpy32_post kernel
    (5 us, no bytes recorded), a 8192-byte MemcpyD2D (4 us) and a 256-byte Memset (1 us).
    The prefill: gemm_prefill (500 us), fusion_a (10 us), a 1024-byte MemcpyH2D (2 us).
    """
    gpu, host = 1, 2
    events = [
        {"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": gpu, "tid": 13, "name": "thread_name",
         "args": {"name": "Stream #13(Kernel,MemcpyD2D,Memset)"}},
        {"ph": "M", "pid": gpu, "tid": 14, "name": "thread_name",
         "args": {"name": "Stream #14(MemcpyH2D)"}},
        {"ph": "M", "pid": gpu, "tid": 15, "name": "thread_name",
         "args": {"name": "CUPTI overhead"}},
        {"ph": "M", "pid": gpu, "tid": 100, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": gpu, "tid": 101, "name": "thread_name",
         "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": gpu, "tid": 102, "name": "thread_name", "args": {"name": "Steps"}},
        {"ph": "M", "pid": host, "tid": 7, "name": "thread_name",
         "args": {"name": "python3"}},
    ]
    clock = [0.0]

    def kernel(name, dur, tid=13, pid=gpu, **args):
        args = {"correlation_id": len(events), "kernel_details": "regs:32 static_shared:0 "
                "dynamic_shared:0 grid:1,1,1 block:128,1,1 occ_pct:50", **args}
        events.append({"ph": "X", "pid": pid, "tid": tid, "ts": clock[0], "dur": dur,
                       "name": name, "args": args})
        # The same op on the derived lines, and its launch on the host.
        events.append({"ph": "X", "pid": gpu, "tid": 100, "ts": clock[0], "dur": dur,
                       "name": name.lower(), "args": {}})
        events.append({"ph": "X", "pid": host, "tid": 7, "ts": clock[0], "dur": 3.0,
                       "name": "cuLaunchKernel" if "mem" not in name.lower() else
                       "cuMemcpyAsync", "args": {}})
        clock[0] += dur + 1

    def memcpy(name, dur, size, tid=13):
        kernel(name, dur, tid, memcpy_details=f"kind_src:device kind_dst:device size:{size} "
               f"dest:0 async:1")

    events.append({"ph": "X", "pid": gpu, "tid": 101, "ts": 0.0, "dur": 9e5,
                   "name": "jit_run_to_completion", "args": {}})
    events.append({"ph": "X", "pid": gpu, "tid": 15, "ts": 0.0, "dur": 7.0,
                   "name": "Memcpy overhead", "args": {}})
    kernel("gemm_prefill", 500.0)
    kernel("fusion_a", 10.0)
    memcpy("MemcpyH2D", 2.0, 1024, tid=14)
    for _ in range(passes):
        events.append({"ph": "X", "pid": gpu, "tid": 102, "ts": clock[0], "dur": 60.0,
                       "name": "step", "args": {}})
        kernel("fusion_a", 10.0)
        kernel("attention_split", 30.0)
        kernel("fusion_a", 10.0)
        kernel("memcpy32_post", 5.0)
        memcpy("MemcpyD2D", 4.0, 8192)
        kernel("Memset", 1.0, memset_details="kind:device num_bytes:256 async:1")
    return events


def _write_trace(folder: Path, events: list[dict], mtime: float) -> None:
    """Where ``jax.profiler.trace`` writes it: <dir>/plugins/profile/<run>/<host>.trace.json.gz."""
    run = folder / "plugins" / "profile" / f"run_{mtime:.0f}"
    run.mkdir(parents=True)
    path = run / "host.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"displayTimeUnit": "ns", "metadata": {"highres-ticks": True},
                   "traceEvents": events}, handle)
    os.utime(path, (mtime, mtime))


def test_gpu_trace_parsing_against_hand_counted_kernels(profile_step, tmp_path):
    """The GPU branch of the trace reading, which no CPU run reaches, on a synthetic trace:
    per pass 6 kernels in 60 us, 3 memcpy/memset (two with bytes: 8192 + 256), and the top
    kernels ranked by their time per pass (the prefill's 500 us gemm by its 0)."""
    passes = 4
    _write_trace(tmp_path / "long", _gpu_trace(1), mtime=1e9)  # an older trace in the folder
    _write_trace(tmp_path / "long", _gpu_trace(passes), mtime=2e9)
    _write_trace(tmp_path / "short", _gpu_trace(0), mtime=2e9)
    events_long = profile_step.read_trace(str(tmp_path / "long"))
    events_short = profile_step.read_trace(str(tmp_path / "short"))

    kind, kernels, where = profile_step.kernel_events(events_long)
    assert kind == "device"
    assert where == {"processes": ["/device:GPU:0"],
                     "threads": ["Stream #13(Kernel,MemcpyD2D,Memset)", "Stream #14(MemcpyH2D)"]}
    assert len(kernels) == 3 + 6 * passes
    summary = profile_step.summarize_kernels(kernels)
    assert summary["us"] == pytest.approx(512.0 + 60.0 * passes)
    assert summary["memcpy"] == 1 + 3 * passes
    assert summary["memcpy_bytes"] == 1024 + (8192 + 256) * passes
    assert summary["memcpy_with_bytes"] == 1 + 2 * passes  # memcpy32_post records none
    assert profile_step.event_bytes({"args": {"memcpy_details": "kind_src:device "
                                              "kind_dst:pinned size:77 dest:0 async:0"}}) == 77

    report = profile_step.trace_report(events_long, events_short, passes, top=3)
    assert report["kind"] == "device"
    assert report["kernels_per_pass"] == 6
    assert report["device_ms_per_pass"] == pytest.approx(0.060)
    assert report["memcpy_per_pass"] == 3
    assert report["memcpy_bytes_per_pass"] == 8192 + 256
    assert report["memcpy_events_with_bytes"] == 1 + 2 * passes
    assert report["top_kernels"] == [
        {"name": "attention_split", "ms_per_pass": 0.03, "calls_per_pass": 1.0},
        {"name": "fusion_a", "ms_per_pass": 0.02, "calls_per_pass": 2.0},
        {"name": "memcpy32_post", "ms_per_pass": 0.005, "calls_per_pass": 1.0}]
    assert "thunks_per_pass" not in report and "thunk_ms_per_pass" not in report


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
        with users_compiles():  # a module fixture: set up before the test's own marker applies
            compiled = profile_step.compile_step_programs(model, prompt, options, NEW_TOKENS)
        capacity = profile_step._capacity(compiled.loop)
        shapes = [(3, capacity, 3, 16)] + ([(2, capacity, 3, 16)] if "draft" in options else [])
        out[method] = (compiled.loop.as_text(), compiled.step.as_text(), shapes)
    return out


@pytest.mark.slow
@pytest.mark.users_compile
@pytest.mark.parametrize("method", ["ar", "tree", "staged"])
def test_compiled_steps_copy_no_cache(profile_step, programs, method):
    loop_text, step_text, shapes = programs[method]
    assert shapes[0][1] == 256
    for text, where in ((loop_text, "loop"), (step_text, "entry")):
        report = profile_step.analyze_program(text, shapes, step=where)
        assert report["step_ops"] > 0
        assert report["cache_copies"] == [] and report["cache_writes"] == [], (
            method, where, report["cache_copies"], report["cache_writes"])


@pytest.mark.parametrize("method,blocks", [
    pytest.param("spec", (0, 1), marks=[pytest.mark.slow, pytest.mark.users_compile]),
    ("tree", (0, 1)), ("tree", (0,))])
def test_feature_draft_steps_copy_no_cache_and_no_features(profile_step, method, blocks):
    """With a feature draft the loop also carries the target's features [S, d]: the step
    reads them at catch-up and writes the accepted path's rows in place; neither they nor
    the target or draft caches are copied or rewritten per step. A one-block draft (EAGLE's
    shape) too: XLA inlines its one-trip layer loop, and the cache was copied per draft
    pass until the scratch write was ordered after the attention's reads."""
    import specjax
    from specjax.training import feature_draft as fd

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
