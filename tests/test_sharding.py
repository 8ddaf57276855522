"""Sharded generation over 8 simulated CPU devices equals one device's.

The checks run in a subprocess (``python tests/test_sharding.py [fast|slow]``) started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``, so this process and the rest of
the suite keep their single CPU device; the subprocess prints one JSON report and the
tests below read it. Tiny random Llama models whose head counts divide 8 (GQA: 16 query
heads over 8 KV heads, head_dim 16) and a one-layer draft; every configuration runs greedy
and with coupled sampling (temperature 1, one seed) and must give the single-device
tokens (batches: each row its own batch-1 tokens). The fast tier (:data:`CASES`):

* ``ar`` on tensor-parallel meshes of 2, 4 and 8 devices and data x model 2x4 and 4x2;
* ``tree`` (draft sharded like the target) on 2x4, ``staged`` (draft replicated, n-gram
  tables) on 4x2;
* the Pallas kernel (``attn_impl="kernel"``, interpret mode) per shard under ``shard_map``
  on 2x4;
* a batch of 4 prompts of different lengths on 2x4 (rows over ``data``);
* ``ar`` on 2x4 for a Gemma-style model (q/k and sandwich norms, soft-capping, a sliding
  layer and local RoPE; ``tree`` on model=4 in the slow tier);
* streaming (the Python-driven step) on 2x4; the parameter specs; one-line errors for a
  model whose KV heads do not divide the ``model`` axis, fused projections and a mesh
  that does not fit the devices.

The slow tier (:data:`SLOW_CASES`, ``make test-all``) adds ``tree`` on model=4,
``staged`` on model=8, the kernel under ``tree``, GPT-2, pure data parallel over 8, a
batched ``tree`` with the kernel on 4x2, ``tree`` on 2x4 for a mixture of experts
(Qwen2-MoE-style, its experts split like the MLP), and SmolLM2-135M through
``load(mesh=)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

DEVICES = 8
NEW_TOKENS = 10
# (name, mesh (data, model), method, attn_impl): every one is run greedy and coupled.
CASES = [
    ("ar-tp2", (1, 2), "ar", "auto"),
    ("ar-tp4", (1, 4), "ar", "auto"),
    ("ar-tp8", (1, 8), "ar", "auto"),
    ("ar-dp2-tp4", (2, 4), "ar", "auto"),
    ("ar-dp4-tp2", (4, 2), "ar", "auto"),
    ("tree-dp2-tp4", (2, 4), "tree", "auto"),
    ("staged-dp4-tp2", (4, 2), "staged", "auto"),
    ("ar-kernel-dp2-tp4", (2, 4), "ar", "kernel"),
    # A batch of 4 prompts of different lengths: rows split over 'data', heads over 'model'.
    ("batch-ar-dp2-tp4", (2, 4), "batch-ar", "auto"),
    # The Gemma-style features (q/k and sandwich norms, soft-capping, a sliding layer).
    ("gemma-ar-dp2-tp4", (2, 4), "gemma-ar", "auto"),
]
# Run by `make test-all` only (a second subprocess, about a minute more).
SLOW_CASES = [
    ("tree-tp4", (1, 4), "tree", "auto"),
    ("staged-tp8", (1, 8), "staged", "auto"),
    ("tree-kernel-dp2-tp4", (2, 4), "tree", "kernel"),
    ("gpt2-ar-tp4", (1, 4), "gpt2-ar", "auto"),
    ("batch-ar-dp8", (8, 1), "batch-ar", "auto"),
    ("batch-tree-dp4-tp2", (4, 2), "batch-tree", "kernel"),
    ("gemma-tree-tp4", (1, 4), "gemma-tree", "auto"),
    # A mixture of experts (Qwen2-MoE-style, a shared expert beside four routed ones): each
    # expert's MLP split over 'model'.
    ("moe-tree-dp2-tp4", (2, 4), "moe-tree", "auto"),
]
TEMPERATURES = (0.0, 1.0)
METHOD_OPTIONS = {
    "ar": {},
    "tree": dict(tree_budget=6, draft_depth=2, draft_width=2),
    "staged": dict(tree_budget=6, draft_rounds=1, draft_width=2, proposal=(2, 1)),
}


# ----------------------------------------------------------------------------- the subprocess


def _models():
    import jax

    import specjax
    from specjax import models
    from specjax.config import ModelConfig

    def tiny(seed, **overrides):
        fields = dict(architecture="llama", vocab_size=97, hidden_size=64, num_layers=2,
                      num_heads=16, num_kv_heads=8, head_dim=16, intermediate_size=128,
                      max_position_embeddings=256, tie_word_embeddings=False)
        config = ModelConfig(**{**fields, **overrides})
        params = models.init_params(config, jax.random.key(seed))
        # Matrices at 0.2 instead of 0.02: diverse, far-from-tied logits (as conftest's).
        params = jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, params)
        return specjax.Model.from_params(config, params, name=f"tiny-{seed}")

    target = tiny(0)
    draft = tiny(1, num_layers=1, num_heads=8)
    gpt2 = tiny(2, architecture="gpt2", num_heads=8, num_kv_heads=8, num_layers=2,
                tie_word_embeddings=True)
    gemma = tiny(3, family="gemma3_text", qk_norm=True, norm_plus_one=True,
                 hidden_act="gelu_tanh", embed_scale=True, sandwich_norms=True,
                 attn_softcap=5.0, final_softcap=8.0, layer_windows=(4, 0),
                 local_rope_theta=100.0, tie_word_embeddings=True)
    moe = tiny(4, family="qwen2_moe", num_experts=4, experts_per_token=2, shared_expert_size=32)
    return target, draft, gpt2, gemma, moe


def _run_checks(cases: list) -> dict:
    import jax
    import numpy as np

    import specjax
    from specjax import models, sharding
    from specjax.errors import InvalidArgumentError
    from specjax.training.ngram_build import build_ngram

    assert len(jax.devices()) == DEVICES, jax.devices()
    target, draft, gpt2, gemma, moe = _models()
    prompt = np.random.default_rng(0).integers(0, 97, 7).tolist()
    corpus = [specjax.generate(target, np.random.default_rng(s).integers(0, 97, 5).tolist(),
                               max_new_tokens=24, method="ar").tokens for s in range(4)]
    tables = build_ngram(corpus, 97, top_k=4, trigram_top_k=2, trigram_buckets=64,
                         min_context_count=1).tables

    batch = [np.random.default_rng(s).integers(0, 97, 2 + 3 * s).tolist() for s in range(4)]

    def generate(model, prompts, method, temperature, attn_impl, draft_model):
        """The new tokens of ``prompts`` (one prompt, or a list: one list per prompt)."""
        resources = {}
        if method in ("tree", "staged"):
            resources["draft"] = draft_model
        if method == "staged":
            resources["ngram"] = tables
        out = specjax.generate(model, prompts, max_new_tokens=NEW_TOKENS, method=method,
                               temperature=temperature, seed=3,
                               kernels=specjax.KernelOptions(attention=attn_impl),
                               **METHOD_OPTIONS[method], **resources)
        return [o.tokens for o in out] if isinstance(out, list) else out.tokens

    report = {"cases": {}, "errors": {}}
    references = {}
    for name, (data, model_size), kind, attn_impl in cases:
        start = time.perf_counter()
        method = kind.split("-", 1)[1] if kind.startswith(("gpt2-", "gemma-", "batch-", "moe-")
                                                          ) else kind
        one = {"gpt2": gpt2, "gemma": gemma, "moe": moe}.get(kind.split("-")[0], target)
        mesh = sharding.make_mesh(data=data, model=model_size,
                                  devices=jax.devices()[: data * model_size])
        sharded = sharding.shard_model(one, mesh)
        # The tree's draft is sharded like the target; staged's stays replicated.
        sharded_draft = sharding.shard_model(draft, mesh, replicate=method != "tree")
        outcome = {}
        for temperature in TEMPERATURES:
            key = (kind, temperature)
            if key not in references:  # one device, the jnp path, batch-1 calls
                references[key] = (
                    [generate(one, p, method, temperature, "auto", draft) for p in batch]
                    if kind.startswith("batch-")
                    else generate(one, prompt, method, temperature, "auto", draft))
            got = generate(sharded, batch if kind.startswith("batch-") else prompt, method,
                           temperature, attn_impl, sharded_draft)
            outcome[str(temperature)] = {"reference": references[key], "sharded": got}
        report["cases"][name] = dict(outcome, seconds=time.perf_counter() - start)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    if cases is SLOW_CASES:
        # A streamed batch over 2x4: rows over 'data', every step read by the host.
        mesh = sharding.make_mesh(data=2, model=4)
        rows = [[] for _ in batch]
        for item in specjax.stream_generate(sharding.shard_model(target, mesh), batch,
                                            max_new_tokens=NEW_TOKENS, method="ar",
                                            temperature=1.0, seed=3):
            for row, new in zip(rows, item[0]):
                row.extend(new)
        report["stream_batch"] = {"sharded": rows, "reference": [
            generate(target, p, "ar", 1.0, "auto", draft) for p in batch]}
        # The real model through load(mesh=): SmolLM2-135M has 9 heads over 3 KV heads.
        try:
            specjax.load("smollm2-135m", mesh=sharding.make_mesh(model=2,
                                                                 devices=jax.devices()[:2]))
        except InvalidArgumentError as error:
            report["errors"]["smollm2_tp2"] = str(error)
        real = specjax.load("smollm2-135m", mesh=sharding.make_mesh(
            model=3, devices=jax.devices()[:3]))
        text = "def fibonacci(n):"
        report["smollm2_tp3"] = {
            "sharded": specjax.generate(real, text, max_new_tokens=8, method="ar").tokens,
            "reference": specjax.generate(specjax.load("smollm2-135m"), text,
                                          max_new_tokens=8, method="ar").tokens}
        return report
    # Streaming drives the same step from Python.
    mesh = sharding.make_mesh(data=2, model=4)
    sharded = sharding.shard_model(target, mesh)
    streamed = [t for new, stats in specjax.stream_generate(
        sharded, prompt, max_new_tokens=NEW_TOKENS, method="ar", temperature=1.0, seed=3)
        for t in new]
    report["stream"] = {"reference": references[("ar", 1.0)], "sharded": streamed}
    # Parameters and the cache really are split (not silently replicated).
    report["specs"] = {k: v for k, v in sharding.describe(sharded.params).items()
                       if k in ("layers/wk", "layers/wo", "layers/w_down", "embed")}

    # Sizes that do not divide the mesh.
    bad_kv = sharding.make_mesh(data=1, model=8)
    for label, call in {
        "gqa_kv_heads": lambda: sharding.shard_params(
            _with(target.config, num_kv_heads=2, num_heads=8), _params(
                _with(target.config, num_kv_heads=2, num_heads=8)), bad_kv),
        "fused": lambda: sharding.shard_params(target.config, models.fuse_projections(
            target.config, target.params), bad_kv),
        "mesh_size": lambda: sharding.make_mesh(data=3, model=2),
    }.items():
        try:
            call()
            report["errors"][label] = None
        except InvalidArgumentError as error:
            report["errors"][label] = str(error)
    return report


def _with(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def _params(config):
    import jax

    from specjax import models

    return models.init_params(config, jax.random.key(0))


# ----------------------------------------------------------------------------- the tests


def _subprocess_report(which: str) -> dict:
    from conftest import fast_xla_flags  # the test process only (it loads torch)

    # XLA's CPU backend optimisations off and the older fusion emitters, in both tiers:
    # the SPMD partitioning under test (HLO passes) is the same either way (the fast
    # subprocess: 35 s with the first alone, 22 s with both, 2026-11-25; the slow one, with
    # SmolLM2-135M, took 350 s compiling as users do, 2026-11-29).
    flags = f"--xla_force_host_platform_device_count={DEVICES} {fast_xla_flags()}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, which], env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"the sharding subprocess failed ({done.returncode}):\n"
                    f"{done.stderr[-6000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.perf_counter() - start
    print(f"sharding subprocess ({which}): {result['wall_seconds']:.1f} s")
    return result


# The tests reading a report are marked one_worker (tests/conftest.py): collected first, so
# that one xdist worker runs them all and the subprocess runs once.
@pytest.fixture(scope="module")
def report():
    return _subprocess_report("fast")


@pytest.fixture(scope="module")
def slow_report():
    return _subprocess_report("slow")


def _check_case(outcome: dict, case: str) -> None:
    for temperature in map(str, TEMPERATURES):
        reference = outcome[temperature]["reference"]
        rows = reference if case.startswith("batch-") else [reference]
        assert [len(row) for row in rows] == [NEW_TOKENS] * len(rows)
        assert outcome[temperature]["sharded"] == outcome[temperature]["reference"], (
            case, temperature)


@pytest.mark.one_worker
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sharded_tokens_equal_one_device(report, case):
    _check_case(report["cases"][case], case)


@pytest.mark.one_worker
@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in SLOW_CASES])
def test_more_sharded_configurations_equal_one_device(slow_report, case):
    _check_case(slow_report["cases"][case], case)


@pytest.mark.one_worker
@pytest.mark.slow
def test_load_with_a_mesh_shards_the_real_model(slow_report):
    assert slow_report["smollm2_tp3"]["sharded"] == slow_report["smollm2_tp3"]["reference"]
    assert len(slow_report["smollm2_tp3"]["reference"]) == 8
    assert slow_report["errors"]["smollm2_tp2"] == (
        "cannot shard parameter layers/wq over mesh axis 'model' of size 2: num_heads=9 is "
        "not a multiple of 2; choose a 'model' size that divides it (or replicate the model)")


@pytest.mark.one_worker
@pytest.mark.slow
def test_streaming_a_sharded_batch_equals_one_device(slow_report):
    assert slow_report["stream_batch"]["sharded"] == slow_report["stream_batch"]["reference"]


@pytest.mark.one_worker
def test_streaming_sharded_equals_one_device(report):
    assert report["stream"]["sharded"] == report["stream"]["reference"]


@pytest.mark.one_worker
def test_parameters_are_split_over_the_model_axis(report):
    from jax.sharding import PartitionSpec as P

    assert report["specs"] == {"embed": str(P()),
                               "layers/wk": str(P(None, None, "model")),
                               "layers/wo": str(P(None, "model", None)),
                               "layers/w_down": str(P(None, "model", None))}


@pytest.mark.one_worker
def test_sizes_that_do_not_divide_the_mesh_are_one_line_errors(report):
    errors = report["errors"]
    message = errors["gqa_kv_heads"]
    assert message is not None and "\n" not in message
    assert "layers/wk" in message and "num_kv_heads=2" in message and "size 8" in message
    assert "fused projections" in errors["fused"] and "\n" not in errors["fused"]
    assert errors["mesh_size"] == "a mesh of data=3 x model=2 needs 6 devices, got 8"


def test_mesh_and_specs_without_devices():
    """In this (single-device) process: mesh validation and the spec table."""
    from jax.sharding import PartitionSpec as P

    from specjax import models, sharding
    from specjax.errors import InvalidArgumentError

    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    with pytest.raises(InvalidArgumentError, match="mesh axes must be"):
        sharding.check_mesh(__import__("jax").sharding.Mesh(mesh.devices, ("x", "y")))
    with pytest.raises(InvalidArgumentError, match="'model' must be a positive integer"):
        sharding.make_mesh(model=0)
    target, _, gpt2, _, moe = _models()
    specs = sharding.param_specs(gpt2.config, gpt2.params)
    assert specs["layers"]["w_fc"] == P(None, None, "model")
    assert specs["layers"]["b_fc"] == P(None, "model")
    assert specs["layers"]["w_proj"] == P(None, "model", None)
    assert specs["pos_embed"] == P()
    fused = models.fuse_projections(target.config, target.params)
    assert sharding.param_specs(target.config, fused)["layers"]["w_qkv"] == P()
    experts = sharding.param_specs(moe.config, moe.params)["layers"]  # [L, E, d, F], [L, E, F, d]
    assert experts["we_gate"] == experts["we_up"] == P(None, None, None, "model")
    assert experts["we_down"] == P(None, None, "model", None) and experts["router"] == P()
    assert experts["ws_gate"] == P(None, None, "model") and experts["shared_gate"] == P()


if __name__ == "__main__":
    print(json.dumps(_run_checks(SLOW_CASES if sys.argv[1:] == ["slow"] else CASES)))


def test_a_mesh_from_jax_make_mesh_works_and_a_wrong_one_is_refused_at_load(tmp_path):
    """jax.make_mesh gives Explicit axes by default (jax >= 0.10), where a sharding
    constraint asserts: load takes the same devices as an Auto mesh and generates as one
    device does. A mesh with other axes is refused at load, naming them (one device here:
    the 8-device cases above cover the splitting)."""
    import jax
    from helpers_checkpoints import gguf_llama, write_tiny_gguf

    import specjax

    path = str(write_tiny_gguf(gguf_llama(seed=4), tmp_path / "tiny.gguf"))
    expected = specjax.generate(specjax.load(path), "the", method="ar", max_new_tokens=4)
    for kwargs in ({}, {"axis_types": (jax.sharding.AxisType.Explicit,) * 2},
                   {"axis_types": (jax.sharding.AxisType.Auto,) * 2}):
        mesh = jax.make_mesh((1, 1), ("data", "model"), **kwargs)
        model = specjax.load(path, mesh=mesh)
        got = specjax.generate(model, "the", method="ar", max_new_tokens=4)
        assert got.tokens == expected.tokens, kwargs
    with pytest.raises(specjax.InvalidArgumentError,
                       match=r"mesh axes must be \('data', 'model'\), got \('x', 'y'\)"):
        specjax.load(path, mesh=jax.make_mesh((1, 1), ("x", "y")))
