"""The method layer: options objects own defaults and validation; names and objects are
interchangeable; the API and the CLI agree on the default method."""

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax import api, cli, requests, sampling
from specjax.errors import InvalidArgumentError
from specjax.methods import (METHODS, NgramOptions, SpecOptions, StagedOptions, TreeOptions,
                             build, method_options)
from specjax.methods.flags import add_method_arguments, method_from_args
from specjax.methods.options import all_option_fields, describe_defaults

from conftest import fitted_tables, programs_set_aside, random_prompt


def test_every_method_has_an_options_class_with_validated_defaults():
    assert set(METHODS) == {"ar", "spec", "tree", "ngram", "staged"}
    for name, cls in METHODS.items():
        options = cls()
        assert options.name == name
        assert method_options(name) == options
        assert options.to_dict()["method"] == name


@pytest.mark.parametrize("method, changes, fragment", [
    ("tree", dict(tree_budget=0), "tree_budget must be an integer >= 1"),
    ("tree", dict(draft_width=True), "draft_width must be an integer"),
    ("spec", dict(draft_depth=-1), "draft_depth"),
    ("spec", dict(verify="bogus"), "unknown verify rule"),
    ("staged", dict(proposal=()), "proposal"),
    ("staged", dict(proposal=(2, 0)), "proposal"),
    ("staged", dict(stage2_prior=(1.0, 0.0)), "stage2_prior"),
    ("staged", dict(stage2_prior=(0.5,)), "stage2_prior"),
    ("staged", dict(tree_budget=500), "exceeds the"),
    ("ngram", dict(use_lookup="yes"), "use_lookup"),
    ("tree", dict(topology="binary"), "topology"),
    ("tree", dict(topology=(0, 1)), "parent"),
    ("spec", dict(draft_ranking="top"), "unknown draft_ranking 'top'"),
    ("tree", dict(verify="rejection", draft_ranking="sampled"), "needs a fixed topology"),
    ("spec", dict(tree_budget=4), "'tree_budget' does not apply to method 'spec'"),
    ("ar", dict(verify="coupled"), "'verify' does not apply to method 'ar'"),
    ("ngram", dict(draft_rounds=2), "does not apply to method 'ngram'"),
    ("staged", dict(beam_width=2), "unknown option 'beam_width'"),
    ("beam", {}, "unknown method"),
])
def test_invalid_options_are_rejected_naming_the_option(method, changes, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        method_options(method, **changes)


def test_options_are_frozen_hashable_and_normalised():
    options = StagedOptions(proposal=[3, 1], stage2_prior=[0, 0])
    assert options.proposal == (3, 1) and options.stage2_prior == (0.0, 0.0)
    assert hash(options) == hash(StagedOptions(proposal=(3, 1), stage2_prior=(0.0, 0.0)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.tree_budget = 3
    assert options.replace(tree_budget=4).tree_budget == 4
    with pytest.raises(InvalidArgumentError, match="draft_depth"):
        options.replace(draft_depth=2)


def test_an_options_object_and_a_name_with_keywords_are_one_method(spec_target):
    assert method_options("staged", tree_budget=8) == StagedOptions(tree_budget=8)
    assert method_options(StagedOptions(tree_budget=8), draft_rounds=2) == StagedOptions(
        tree_budget=8, draft_rounds=2)
    assert method_options("tree", topology="kary").fixed_parents is not None
    # The static method object is built from the options: one source of truth.
    assert build(SpecOptions(draft_depth=3), spec_target.config).shape.budget == 4
    assert build(StagedOptions(tree_budget=5), spec_target.config).budget == 5


def test_the_registry_holds_each_method_once_from_its_module():
    """Each method module exports the options it runs (``OPTIONS``) and their builder
    (``build``); the registry has every method of ``METHODS``, each with its own class,
    and options it does not hold are refused in one line (never run as another method)."""
    from specjax.methods import REGISTRY, ar, speculative, staged

    assert set(REGISTRY) == set(METHODS)
    assert all(REGISTRY[name].options is cls for name, cls in METHODS.items())
    assert [REGISTRY[name].builder for name in ("ar", "spec", "ngram")] == [
        ar.build, speculative.build, staged.build]

    @dataclasses.dataclass(frozen=True)
    class BeamOptions(SpecOptions):
        name = "beam"

    for wrong in (BeamOptions(), "spec", None):
        with pytest.raises(InvalidArgumentError, match="no method runs") as info:
            build(wrong, specjax.config.gpt2("124m"))
        assert "\n" not in str(info.value)
    from specjax.methods import choice
    assert {name: choice.needs(cls) for name, cls in METHODS.items()} == {
        "ar": (), "spec": ("draft",), "tree": ("draft",), "ngram": ("ngram",),
        "staged": ("draft", "ngram")}


def test_generate_takes_an_options_object_or_a_name(spec_target, spec_drafts):
    prompt = random_prompt(5, 9)
    draft = spec_drafts["weak"]
    by_object = specjax.generate(spec_target, prompt, max_new_tokens=12, draft=draft,
                                 method=TreeOptions(tree_budget=6, draft_width=2))
    by_name = specjax.generate(spec_target, prompt, max_new_tokens=12, draft=draft,
                               method="tree", tree_budget=6, draft_width=2)
    reference = specjax.generate(spec_target, prompt, max_new_tokens=12, method="ar")
    assert by_object.tokens == by_name.tokens == reference.tokens
    assert by_object.stats["options"] == by_name.stats["options"] == dict(
        TreeOptions(tree_budget=6, draft_width=2).to_dict())


def test_one_request_path_for_keywords_and_a_request(spec_target, spec_drafts):
    """``api.request`` checks every setting without the model; ``generate(request=...)``
    runs exactly what the same keywords run (``stream_generate(request=...)``: the CLI's
    streamed output, tests/test_cli.py)."""
    prompt = random_prompt(5, 9)
    keywords = dict(method="tree", tree_budget=6, draft_width=2, max_new_tokens=12)
    request = api.request(backend="cpu", assets=spec_target.assets,
                          draft=spec_drafts["weak"], **keywords)
    assert request.options == TreeOptions(tree_budget=6, draft_width=2)
    assert request.choice == "given" and request.kernels.sampling_rules != "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 3
    by_keywords = specjax.generate(spec_target, prompt, draft=spec_drafts["weak"], **keywords)
    by_request = specjax.generate(spec_target, prompt, request=request)
    assert by_request.tokens == by_keywords.tokens
    assert by_request.stats["options"] == by_keywords.stats["options"]
    # The default choice is the request's, for the assets it was made for.
    default = api.request(backend="cpu", assets="smollm2-135m")
    assert (default.options.name, default.choice) == ("spec", api.choose_default_method(
        "smollm2-135m", "cpu", 0.0)[1])


@pytest.mark.parametrize("make, message", [
    (lambda: api.request(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (lambda: api.request(temperature=-1.0), "temperature"),
    (lambda: api.request(method="ar", draft="x"), "takes no draft"),
    (lambda: api.request(method="spec", tree_budget=4), "'tree_budget' does not apply"),
    (lambda: api.request(method="ar", jump_forward=-1), "jump_forward must be an integer in "
                                                        "[0, 64], got -1"),
    (lambda: api.request(method="spec", jump_forward=2), "'jump_forward' does not apply"),
    (lambda: api.request(backend="gpuu"), "backend must be 'cpu', 'gpu' or 'tpu'"),
    (lambda: api.request(batch=3), "batch must be a specjax.BatchOptions"),
    (lambda: api.request().replace(max_new_tokens=4), "changes the seed, draft, ngram or "
                                                      "constraint only, not max_new_tokens"),
])
def test_a_request_refuses_a_bad_setting_in_one_line(make, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        make()


def test_a_request_is_whole_and_for_its_backend(spec_target):
    request = api.request(backend="cpu", method="ar", max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens, top_k given beside "
                                                   "request="):
        specjax.generate(spec_target, [1, 2], request=request, max_new_tokens=5, top_k=3)
    with pytest.raises(InvalidArgumentError, match="given beside request="):
        list(api.stream_generate(spec_target, [1, 2], request=request, tree_budget=3))
    on_gpu = api.request(backend="gpu", method="ar", max_new_tokens=4)
    with pytest.raises(InvalidArgumentError, match="made for backend 'gpu' and the model's "
                                                   "weights are on 'cpu'"):
        specjax.generate(spec_target, [1, 2], request=on_gpu)
    with pytest.raises(InvalidArgumentError, match="request must be a specjax.api.Request"):
        api._prepare(spec_target, [1, 2], {"method": "ar"})


def test_generate_rejects_an_option_the_method_does_not_take(spec_target):
    with pytest.raises(InvalidArgumentError, match="'draft_rounds' does not apply to "
                                                   "method 'tree'"):
        specjax.generate(spec_target, [1, 2], max_new_tokens=2, method="tree", draft_rounds=2)
    with pytest.raises(InvalidArgumentError, match="takes no draft"):
        specjax.generate(spec_target, [1, 2], max_new_tokens=2, method="ngram",
                         draft=spec_target)


def test_stream_generate_has_generate_s_defaults_and_rejects_unknown_arguments(spec_target):
    prompt = random_prompt(6, 5)
    streamed = [t for new, stats in specjax.stream_generate(spec_target, prompt) for t in new]
    assert streamed == specjax.generate(spec_target, prompt).tokens
    with pytest.raises(InvalidArgumentError, match="unknown option 'temprature'"):
        next(specjax.stream_generate(spec_target, prompt, temprature=1.0))


def test_cli_flags_come_from_the_options_classes():
    parser = argparse.ArgumentParser()
    add_method_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for name, field in all_option_fields().items():
        assert field.metadata.get("flag_help", field.metadata["help"]) in helps[name]
    assert describe_defaults("tree_budget") in helps["tree_budget"]
    args = parser.parse_args(["--tree-budget", "8", "--proposal", "3,1", "--no-lookup"])
    options = method_from_args(args, "staged")
    assert options == StagedOptions(tree_budget=8, proposal=(3, 1), use_lookup=False)
    with pytest.raises(InvalidArgumentError, match="--tree-budget does not apply to method "
                                                   "'ngram'"):
        method_from_args(args, "ngram")
    assert method_from_args(parser.parse_args([]), "ngram") == NgramOptions()


def test_api_and_cli_default_to_the_same_method(spec_target, smollm2, tmp_path):
    assert api.resolve_method(spec_target).name == "ar"  # no shipped assets
    assert api.resolve_method(smollm2).name == "spec"
    args = cli.build_parser().parse_args(["generate", "x", "-m", "smollm2-135m"])
    assert cli.check_generate_args(args)[0].options == api.resolve_method(smollm2)
    # A model without shipped assets: ar for both (the CLI decides without loading it).
    broken = tmp_path / "model"
    broken.mkdir()
    args = cli.build_parser().parse_args(["generate", "x", "-m", str(broken)])
    assert cli.check_generate_args(args)[0].options == api.resolve_method(spec_target)


def test_backend_defaults_apply_to_method_names_and_are_reported(spec_target, monkeypatch):
    from specjax.methods import options as opts
    assert opts.backend_of("cuda") == opts.backend_of("rocm") == opts.backend_of("gpu") == "gpu"
    assert opts.backend_of("tpu") == "tpu" and opts.backend_of("cpu") == "cpu"
    for backend, per_method in opts.BACKEND_DEFAULTS.items():  # the shipped table validates
        for method, values in per_method.items():
            built = method_options(method, backend=backend)
            assert {k: getattr(built, k) for k in values} == values
    # ar jumps forward over forced runs on an accelerator only (one pass per token on the
    # CPU, where a pass of several rows costs more than the forced tokens save).
    assert method_options("ar", backend="cpu").jump_forward == 0
    assert method_options("ar", backend="gpu").jump_forward == opts.JUMP_FORWARD
    assert method_options("ar", backend="tpu").jump_forward == opts.JUMP_FORWARD
    monkeypatch.setitem(opts.BACKEND_DEFAULTS, "gpu", {"tree": {"tree_budget": 24}})
    assert method_options("tree", backend="cuda").tree_budget == 24
    assert method_options("tree", backend="cuda", tree_budget=4).tree_budget == 4  # explicit
    assert method_options("tree", backend="cpu") == TreeOptions()
    # Objects too: what the caller left out takes the backend's default, what it set stays.
    assert method_options(TreeOptions(), backend="cuda") == method_options("tree",
                                                                           backend="cuda")
    assert method_options(TreeOptions(draft_depth=3), backend="cuda") == TreeOptions(
        tree_budget=24, draft_depth=3)
    assert method_options(TreeOptions(tree_budget=4), backend="gpu").tree_budget == 4
    assert method_options(TreeOptions().replace(tree_budget=8), backend="gpu").tree_budget == 8
    # Resolved options are concrete: resolving them again, for any backend, keeps them
    # (a GPU program compiled for an abstract model on the CPU keeps the GPU's tree).
    on_gpu = method_options(TreeOptions(), backend="gpu")
    assert method_options(on_gpu, backend="cpu") == on_gpu
    assert method_options(method_options("tree", backend="gpu"), backend="cpu") == on_gpu
    assert method_options(TreeOptions(), backend="cpu") == TreeOptions()
    assert "tree 8 (gpu: 24; tpu: 32)" in describe_defaults("tree_budget")
    out = specjax.generate(spec_target, [1, 2, 3], max_new_tokens=2, method="ar")
    assert out.stats["backend"] == "cpu"  # the test machine's weights are on the CPU
    monkeypatch.setattr(requests, "model_backend", lambda model: "gpu")
    assert api.resolve_method(spec_target, "tree").tree_budget == 24
    assert api.resolve_method(spec_target, TreeOptions()).tree_budget == 24
    assert api.resolve_method(spec_target, TreeOptions(), tree_budget=5).tree_budget == 5
    # A keyword and an option the object set, with another value: one place for each.
    with pytest.raises(InvalidArgumentError, match="tree_budget given as a keyword and"):
        api.resolve_method(spec_target, TreeOptions(tree_budget=4), tree_budget=5)
    assert api.resolve_method(spec_target, TreeOptions(tree_budget=4), tree_budget=4,
                              draft_depth=3) == TreeOptions(tree_budget=4, draft_depth=3)
    args = argparse.ArgumentParser()
    add_method_arguments(args)
    assert method_from_args(args.parse_args([]), "tree", "cuda").tree_budget == 24


BFLOAT16_PROMPTS = range(100, 108)  # seeds of 6-token prompts


@pytest.fixture(scope="module")
def bfloat16_target(spec_target):
    """The tiny target's first layer in bfloat16 (``--dtype auto`` on a GPU or TPU; one
    layer compiles faster) and n-gram tables fitted to its own greedy text."""
    one_layer = spec_target.first_layers(1)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), one_layer.params)
    target = specjax.Model(one_layer.config, params, name="tiny-bfloat16")
    return target, fitted_tables(target, BFLOAT16_PROMPTS, 48)


@pytest.mark.filterwarnings("ignore::specjax.errors.PerformanceWarning")  # bf16 on a CPU
@pytest.mark.parametrize("method", [name for name in METHODS if name != "ar"])
def test_every_method_equals_ar_in_bfloat16(bfloat16_target, method):
    """Greedy and coupled sampling at temperature 1 give ``ar``'s tokens, token for token,
    with bfloat16 weights and activations. The target drafts for itself and the prompts
    begin its tables' text, so most tokens come from deep tree nodes, whose logits the
    verify pass computes beside other nodes'. Runs are cheap once compiled, and a
    difference of one bfloat16 rounding from the one-token step changes a token only at a
    near-tie: 8 prompts x 48 tokens per rule (the verify pass's attention scaled by
    1 + 2**-8 changed 7 of 16 such prompts)."""
    target, tables = bfloat16_target
    assert {leaf.dtype for leaf in jax.tree.leaves(target.params)} == {jnp.dtype(jnp.bfloat16)}
    resources = {}
    if METHODS[method].uses_draft:
        resources["draft"] = target
    if METHODS[method].uses_ngram:
        resources["ngram"] = tables
    for temperature in ({}, dict(temperature=1.0)):
        accepted = []
        for seed in BFLOAT16_PROMPTS:
            prompt = random_prompt(seed, 6)
            expected = specjax.generate(target, prompt, max_new_tokens=48, seed=seed,
                                        **temperature).tokens
            out = specjax.generate(target, prompt, max_new_tokens=48, seed=seed,
                                   method=method, **resources, **temperature)
            assert out.tokens == expected, (method, temperature, seed)
            accepted.append(out.stats["mean_accepted"])
        if not temperature:  # the check above read drafted tokens, not only the roots'
            assert min(accepted) > 1.5, accepted


@pytest.fixture(scope="module")
def coupled_ar_tokens(bfloat16_target):
    """seed -> ``ar``'s tokens at temperature 1 for its prompt: once for the module, computed
    before any case below sets the compiled programs aside and patches the noise."""
    target, _ = bfloat16_target
    return {seed: specjax.generate(target, random_prompt(seed, 6), max_new_tokens=48,
                                   seed=seed, temperature=1.0).tokens
            for seed in BFLOAT16_PROMPTS}


@pytest.mark.filterwarnings("ignore::specjax.errors.PerformanceWarning")  # bf16 on a CPU
@pytest.mark.parametrize("method", [name for name in METHODS if name != "ar"])
def test_a_wrong_coupling_is_caught_by_every_method(bfloat16_target, coupled_ar_tokens,
                                                    method, monkeypatch, programs_aside):
    """The negative of the test above: the coupling made wrong in the way a real bug would
    be, the noise of a call over several tree nodes drawn for the next position (an
    off-by-one in the verify pass's positions; ``ar``'s one-position calls keep theirs).
    Each speculative method then departs from ``ar``'s coupled tokens, so the equality
    above is evidence of the coupling, not of a test that cannot fail."""
    target, tables = bfloat16_target
    resources = {}
    if METHODS[method].uses_draft:
        resources["draft"] = target
    if METHODS[method].uses_ngram:
        resources["ngram"] = tables
    right_noise = sampling.gumbel_noise

    def off_by_one_in_a_pass(seed, positions, vocab_size):
        shift = 1 if positions.shape[0] > 1 else 0
        return right_noise(seed, positions + shift, vocab_size)

    expected = coupled_ar_tokens
    programs_aside(jax_caches=True)  # the methods' programs compile again with the wrong noise
    monkeypatch.setattr(sampling, "gumbel_noise", off_by_one_in_a_pass)
    differ = [specjax.generate(target, random_prompt(seed, 6), max_new_tokens=48, seed=seed,
                               temperature=1.0, method=method, **resources).tokens
              != expected[seed] for seed in BFLOAT16_PROMPTS]
    assert any(differ), (method, differ)


def test_programs_set_aside_come_back_without_the_wrong_ones():
    """The wrong-rule tests' ``conftest.programs_set_aside``: inside, no program compiled
    before is found (a patched rule compiles afresh); after, those programs are back and
    none compiled inside is (sentinel entries: nothing compiles)."""
    from specjax import decode

    right, wrong = ("a right program",), ("a wrong program",)
    decode._EXECUTABLES[right], decode._FALLBACKS[right] = "right", frozenset()
    try:
        with programs_set_aside():
            assert right not in decode._EXECUTABLES
            decode._EXECUTABLES[wrong], decode._FALLBACKS[wrong] = "wrong", frozenset()
        assert decode._EXECUTABLES.get(right) == "right"
        assert wrong not in decode._EXECUTABLES and wrong not in decode._FALLBACKS
    finally:
        decode._EXECUTABLES.pop(right, None)
        decode._FALLBACKS.pop(right, None)
