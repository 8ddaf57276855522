"""The real target with a tiny draft: speculative output equals ``ar`` token for token."""

import jax.numpy as jnp
import pytest

import specjax
from specjax import loading, models
from specjax.checkpoints_tools import sources
from specjax.checkpoints_tools.convert import convert


@pytest.fixture(scope="module")
def tiny_draft(smollm2):
    """A 2-layer draft cut from the target (shares its tokenizer and tied head)."""
    return smollm2.first_layers(2)


PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"]


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(method="spec", draft_depth=3), marks=pytest.mark.slow),
    pytest.param(dict(method="tree", tree_budget=8, draft_depth=3, draft_width=2),
                 marks=pytest.mark.slow),
    # staged with the shipped draft and tables: 34 s, slow too (the quick tier runs the
    # shipped draft greedy under spec, tree and staged below, and spec coupled in test_cli).
    pytest.param(dict(method="staged"), marks=pytest.mark.slow),
    pytest.param(dict(method="ngram"), marks=pytest.mark.slow)])
def test_greedy_and_coupled_equal_ar_on_smollm2(smollm2, tiny_draft, kwargs):
    if kwargs["method"] in ("spec", "tree"):
        kwargs = dict(kwargs, draft=tiny_draft)
    for prompt in PROMPTS:
        for sampling in (dict(), dict(temperature=1.0, seed=7)):
            # ``ar`` by name: the model's default method is ``spec`` with the shipped draft.
            expected = specjax.generate(smollm2, prompt, max_new_tokens=24, method="ar",
                                        **sampling).tokens
            out = specjax.generate(smollm2, prompt, max_new_tokens=24, **kwargs, **sampling)
            assert out.tokens == expected, (kwargs["method"], sampling)
            if kwargs["method"] in ("staged", "ngram") and not sampling:
                assert out.stats["mean_accepted"] > 1.0


# ----------------------------------------------------------------------------- shipped draft


def is_the_shipped_draft(draft) -> bool:
    """The EAGLE-3 draft of specjax/assets/smollm2-135m: one block reading target blocks
    1, 14 and 26, a 12,288-id head of its own."""
    config = draft.config
    return (draft.name == "smollm2-135m-draft" and config.num_layers == 1
            and config.feature_input and config.feature_layers == (1, 14, 26)
            and config.draft_vocab_size == 12288)


# A function's description as JSON (benchmarks/experiments/bench_constrained.py's shape).
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "arguments": {"type": "array", "items": {"type": "string"},
                                       "maxItems": 4}},
          "required": ["name", "arguments"]}


@pytest.mark.slow  # four programs of the real model under a constraint, and the schema's tables
@pytest.mark.parametrize("method", ["spec", "tree", "staged", "ngram"])
def test_every_method_under_a_json_schema_equals_ar_on_smollm2(smollm2, method):
    """Under a JSON schema on SmolLM2's 49k vocabulary, with the shipped draft and tables:
    greedy and coupled (T=1) outputs are constrained ar's, token for token, and drafted
    tokens are accepted (more than one token per target pass, greedy)."""
    import json

    import jsonschema

    constraint = specjax.JsonSchema(SCHEMA)
    request = "Describe this function as JSON with the keys name and arguments.\n\n"
    for sampling in (dict(), dict(temperature=1.0, seed=7)):
        kwargs = dict(constraint=constraint, max_new_tokens=40, chat=True, **sampling)
        expected = specjax.generate(smollm2, request + PROMPTS[1], method="ar", **kwargs)
        out = specjax.generate(smollm2, request + PROMPTS[1], method=method, **kwargs)
        assert out.tokens == expected.tokens, (method, sampling)
        if not sampling:
            assert out.stats["mean_accepted"] > 1.0, out.stats["mean_accepted"]
        if out.tokens[-1] in smollm2.config.eos_token_ids:  # a whole document: valid
            jsonschema.validate(json.loads(out.text), SCHEMA)


# Each way of naming the draft with `spec` (one program: the same draft, however named);
# `tree` and `staged` in the slow tier, compiled with the suite's fast options (marked
# fast_compile: the subject is which draft is found; each method's exactness as users
# compile is test_greedy_and_coupled_equal_ar_on_smollm2's): 17 s each as users compile,
# 9-10 s so, one process, 2026-12-02. Not `spec`'s or the converted checkpoint's test below:
# on the real model a program compiled so runs slower, and 12-16 tokens cost more than the
# compile saves (1.2 -> 4.3 s for a second `spec` case, 14 -> 18 s for the checkpoint).
FAST_TO_COMPILE = [pytest.mark.slow, pytest.mark.fast_compile]


@pytest.mark.parametrize("draft, method", [
    (None, "spec"), ("smollm2-135m-draft", "spec"), ("asset-folder", "spec"),
    pytest.param("smollm2-135m-draft", "tree", marks=FAST_TO_COMPILE),
    pytest.param("asset-folder", "staged", marks=FAST_TO_COMPILE)])
def test_the_shipped_draft_by_default_by_name_and_by_folder(smollm2, method, draft):
    if draft == "asset-folder":
        draft = str(sources.assets_dir() / "smollm2-135m")
    expected = specjax.generate(smollm2, PROMPTS[0], max_new_tokens=12, method="ar").tokens
    out = specjax.generate(smollm2, PROMPTS[0], max_new_tokens=12, method=method, draft=draft)
    assert out.tokens == expected
    assert out.stats["draft_calls"] > 0
    assert loading.resolve_draft(smollm2, draft).name == "smollm2-135m-draft"


def test_the_shipped_draft_loads_under_a_bfloat16_target_and_refuses_other_weights(smollm2):
    bf16 = specjax.Model.from_params(smollm2.config, smollm2.params, smollm2.tokenizer,
                                     name="bf16", dtype="bfloat16", assets=smollm2.assets)
    draft = loading.resolve_draft(bf16)
    assert draft.dtype == jnp.bfloat16 and is_the_shipped_draft(draft)
    nudged = dict(smollm2.params, embed=smollm2.params["embed"] * 1.001)
    other = specjax.Model.from_params(smollm2.config, nudged, smollm2.tokenizer,
                                      name="other", assets=smollm2.assets)
    with pytest.raises(specjax.InvalidArgumentError, match="another embedding"):
        loading.resolve_draft(other)


def test_a_bfloat16_conversion_loaded_in_float32_keeps_the_shipped_draft(smollm2):
    """specjax convert --dtype bfloat16 stores the bf16-rounded embedding; generate loads
    it in float32 (its default): the draft recognises those weights by their recorded
    bfloat16 fingerprint instead of calling them another embedding."""
    import ml_dtypes
    import numpy as np
    rounded = np.asarray(smollm2.params["embed"]).astype(ml_dtypes.bfloat16).astype(np.float32)
    converted = specjax.Model.from_params(smollm2.config, dict(smollm2.params, embed=rounded),
                                          smollm2.tokenizer, name="converted",
                                          dtype="float32", assets=smollm2.assets)
    draft = loading.resolve_draft(converted)
    assert is_the_shipped_draft(draft) and draft.dtype == jnp.float32


def test_a_draft_asset_is_read_once_per_target_and_file_version(smollm2, tmp_path,
                                                                 monkeypatch):
    """generate() with no draft object used to read and fingerprint the shipped draft on
    every call (0.18 s for SmolLM2, the target's whole embedding hashed): now once per
    target, asset files and embedding, which is checked again when any of them changes."""
    reads = []
    read = sources.load_bundled_draft
    monkeypatch.setattr(sources, "load_bundled_draft",
                        lambda *args, **kwargs: reads.append(args) or read(*args, **kwargs))
    target = specjax.Model(smollm2.config, dict(smollm2.params), smollm2.tokenizer,
                           name="target", assets=smollm2.assets)
    first = loading.resolve_draft(target)
    assert loading.resolve_draft(target) is first and len(reads) == 1
    assert loading.resolve_draft(target, "smollm2-135m-draft") is first and len(reads) == 1
    # Another version of the asset's files (a folder given by path, rewritten).
    folder = tmp_path / "asset"
    folder.mkdir()
    for name in (sources.DRAFT_TENSORS, sources.DRAFT_CONFIG):
        (folder / name).write_bytes((sources.assets_dir() / smollm2.assets / name).read_bytes())
    by_folder = loading.resolve_draft(target, folder)
    assert by_folder is not first and len(reads) == 2
    assert loading.resolve_draft(target, str(folder)) is by_folder and len(reads) == 2
    config = folder / sources.DRAFT_CONFIG
    config.write_text(config.read_text() + " ")
    assert loading.resolve_draft(target, folder) is not by_folder and len(reads) == 3
    # Other weights on the same target object: the fingerprint is checked again.
    target.params = dict(target.params, embed=target.params["embed"] * 1.001)
    with pytest.raises(specjax.InvalidArgumentError, match="another embedding"):
        loading.resolve_draft(target)
    assert len(reads) == 4


def test_a_fused_target_gets_its_shipped_draft_fused(smollm2):
    """with_fused_projections: q|k|v and gate|up as one matrix each (what attn_impl="fused"
    runs in one kernel each); the shipped draft resolved for it takes the same layout
    (generation with both fused: tests/test_fused_projections.py)."""
    fused = smollm2.with_fused_projections()
    assert fused.with_fused_projections() is fused
    assert models.projections_fused(fused.params) and not models.projections_fused(smollm2.params)
    draft = loading.resolve_draft(fused)
    assert models.projections_fused(draft.params) and loading.resolve_draft(fused) is draft
    assert draft.head_size == loading.resolve_draft(smollm2).head_size  # its head subset kept
    assert not models.projections_fused(loading.resolve_draft(smollm2).params)


@pytest.mark.slow
def test_a_converted_checkpoint_keeps_its_shipped_draft_and_tables(smollm2, tmp_path):
    """``specjax convert smollm2-135m DIR`` records its origin: ``-m DIR`` then defaults to
    spec with the shipped draft (fingerprint-checked)."""
    dst = convert("smollm2-135m", tmp_path / "converted", progress=False)
    assert sources.known_origin(dst) == "smollm2-135m"
    model = specjax.load(dst)
    assert model.assets == "smollm2-135m"
    out = specjax.generate(model, PROMPTS[1], max_new_tokens=16)
    assert out.stats["method"] == "spec" and out.stats["draft_calls"] > 0
    assert out.tokens == specjax.generate(smollm2, PROMPTS[1], max_new_tokens=16,
                                          method="ar").tokens
