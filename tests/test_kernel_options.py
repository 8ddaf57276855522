"""One configuration surface: :class:`specjax.KernelOptions` and
:class:`specjax.BatchOptions` are what the API, ``specjax generate`` and ``specjax bench``
build the same way; bad values are one-line errors naming the field; the defaults come
from one place per backend; the options key the compiled programs; and the names they
replaced before the first release (``generate(attn_impl=, stop_tokens=, batch_size=,
compact_rows=)``, ``--attn-impl``, the ``SPECJAX_*`` kernel variables) are gone: refused
with a one-line error, or (the variables) read by nothing."""

from __future__ import annotations

import inspect
import warnings

import pytest

import specjax
from specjax import api, cli, decode, sampling
from specjax.batch_options import BatchOptions
from specjax.errors import InvalidArgumentError
from specjax.harness import cli as bench_cli
from specjax.kernel_options import KernelOptions
from specjax.state import MAX_BATCH_SIZE

from conftest import random_prompt, tiny_pair, with_fast_options

NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_pair("llama-gqa", seed=5, num_hidden_layers=2)[1]


# ----------------------------------------------------------------------------- the objects


@pytest.mark.parametrize("kwargs, field", [
    (dict(attention="flash"), "attention"),
    (dict(gpu_linear="cutlass"), "gpu_linear"),
    (dict(interpret_variant="cuda"), "interpret_variant"),
    (dict(sampling_rules="sometimes"), "sampling_rules"),
    (dict(compiler_options=3), "compiler_options"),
    (dict(compiler_options={"": 1}), "compiler_options"),
    (dict(compiler_options={"xla_a": [1]}), "compiler_options"),
])
def test_bad_values_are_one_line_errors_naming_the_field(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=f"KernelOptions.{field}") as info:
        KernelOptions(**kwargs)
    assert "\n" not in str(info.value)


def test_bad_batch_options_are_one_line_errors():
    for kwargs, field in ((dict(size=0), "size"), (dict(size=MAX_BATCH_SIZE + 1), "size"),
                          (dict(size=2.0), "size"), (dict(compact_rows="yes"), "compact_rows")):
        with pytest.raises(InvalidArgumentError, match=f"BatchOptions.{field}") as info:
            BatchOptions(**kwargs)
        assert "\n" not in str(info.value)
    assert BatchOptions(size=MAX_BATCH_SIZE).size == MAX_BATCH_SIZE


def test_options_are_hashable_and_compiler_options_are_sorted_pairs():
    a = KernelOptions(compiler_options={"xla_b": 1, "xla_a": "x"})
    b = KernelOptions(compiler_options=[("xla_a", "x"), ("xla_b", 1)])
    assert a == b and hash(a) == hash(b)
    assert a.compiler_options == (("xla_a", "x"), ("xla_b", 1))
    assert a.to_dict()["compiler_options"] == {"xla_a": "x", "xla_b": 1}
    assert len({a, b, KernelOptions()}) == 2


def test_one_default_per_backend():
    """The backends differ in the sampling rules only (static on a GPU: there XLA runs a
    conditional through the host); ``auto`` is made concrete where the defaults are built."""
    defaults = {p: KernelOptions.default(p) for p in ("cpu", "gpu", "tpu")}
    assert defaults["gpu"] == KernelOptions(sampling_rules="static")
    assert defaults["cpu"] == defaults["tpu"] == KernelOptions(sampling_rules="traced")
    for platform, options in defaults.items():
        assert sampling.static_rules(platform, options.sampling_rules) == \
            sampling.static_rules(platform)  # what "auto" always meant
        assert KernelOptions().resolved(platform) == options
    with pytest.raises(InvalidArgumentError, match="platform"):
        KernelOptions.default("cuda")


def test_generate_takes_at_most_eleven_named_settings():
    """method, max_new_tokens, temperature, top_k, top_p, seed, stop, chat, kernels, batch,
    progress; the method's options (and its draft and tables) by name through **options;
    and ``request=``, all of them at once (``api.request``)."""
    for function in (api.generate,):
        parameters = inspect.signature(function).parameters.values()
        named = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert "request" in named
        named.remove("request")
        assert len(named) <= 11, named
        assert set(named) <= set(inspect.signature(api.request).parameters), named
        assert "kernels" in named and "batch" in named
        assert not {"attn_impl", "stop_tokens", "batch_size", "compact_rows"} & set(named)


# ----------------------------------------------------------------------------- generate


def test_stats_record_the_kernel_options_and_they_key_the_programs(model):
    """Two compiler options: two executables (the second compiles), the same tokens; the
    same options again: no compile."""
    prompt = random_prompt(7, 9)
    level = {"xla_backend_optimization_level": 1}  # the fast tier compiles at 0
    first = specjax.generate(model, prompt, max_new_tokens=NEW, temperature=1.0, seed=2)
    assert first.stats["kernels"] == with_fast_options(KernelOptions.default("cpu")).to_dict()
    before = len(decode._EXECUTABLES)
    other = specjax.generate(model, prompt, max_new_tokens=NEW, temperature=1.0, seed=2,
                             kernels=KernelOptions(compiler_options=level))
    assert other.stats["compile_seconds"] > 0 and len(decode._EXECUTABLES) == before + 1
    assert other.stats["kernels"]["compiler_options"]["xla_backend_optimization_level"] == 1
    assert other.tokens == first.tokens
    again = specjax.generate(model, prompt, max_new_tokens=NEW, temperature=1.0, seed=2,
                             kernels=KernelOptions(compiler_options=level))
    assert again.stats["compile_seconds"] == 0.0


def test_stop_takes_strings_and_token_ids():
    assert api.split_stop(None) == ((), None)
    assert api.split_stop("\n\n") == (("\n\n",), None)
    assert api.split_stop(7) == ((), [7])
    assert api.split_stop(["x", 3, 4]) == (("x",), [3, 4])
    assert api.split_stop([]) == ((), [])  # nothing stops generation but the budget
    for bad in ([True], [""], 2.5, [None]):
        with pytest.raises(InvalidArgumentError, match="stop") as info:
            api.split_stop(bad)
        assert "\n" not in str(info.value)


def test_options_of_the_wrong_type_are_refused(model):
    with pytest.raises(InvalidArgumentError, match="kernels must be a specjax.KernelOptions"):
        specjax.generate(model, [1, 2, 3], max_new_tokens=2, kernels={"attention": "auto"})
    with pytest.raises(InvalidArgumentError, match="batch must be a specjax.BatchOptions"):
        specjax.generate(model, [[1, 2], [3, 4]], max_new_tokens=2, batch=2)


# ----------------------------------------------------------------------------- removed names


@pytest.mark.parametrize("keyword", ["stop_tokens", "attn_impl", "batch_size", "compact_rows"])
def test_the_replaced_generate_keywords_are_refused(model, keyword):
    with pytest.raises(InvalidArgumentError, match=f"unknown option '{keyword}'") as info:
        specjax.generate(model, [1, 2, 3], max_new_tokens=2, **{keyword: 1})
    assert "\n" not in str(info.value)


def test_the_old_kernel_variables_change_nothing(monkeypatch):
    for name, value in (("SPECJAX_SAMPLING_RULES", "static"), ("SPECJAX_GPU_KERNELS", "mosaic"),
                        ("SPECJAX_KERNEL_INTERPRET", "tpu")):
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KernelOptions.default("cpu") == KernelOptions(sampling_rules="traced")
        assert KernelOptions.from_args(_parsed("generate")) == KernelOptions()


# ----------------------------------------------------------------------------- command lines


def _parsed(command: str, *argv: str):
    parser = cli.build_parser()
    return parser.parse_args([command, *(["prompt"] if command == "generate" else []), *argv])


FLAGS = ["--attention", "reference", "--gpu-linear", "mosaic", "--interpret-variant", "tpu",
         "--sampling-rules", "static", "--compiler-option", "xla_a=1",
         "--compiler-option", "xla_b=false", "--compiler-option", "xla_c=fast"]


def test_generate_and_bench_build_the_same_options_from_the_same_flags():
    generate_args, bench_args = _parsed("generate", *FLAGS), _parsed("bench", *FLAGS)
    built = KernelOptions.from_args(generate_args, "cpu")
    assert built == KernelOptions.from_args(bench_args, "cpu") == KernelOptions(
        attention="reference", gpu_linear="mosaic", interpret_variant="tpu",
        sampling_rules="static", compiler_options={"xla_a": 1, "xla_b": False, "xla_c": "fast"})
    assert bench_cli.suite_config(bench_args).kernels == KernelOptions.from_args(
        bench_args, bench_cli.backend_of(bench_cli.jax.default_backend()))
    # No flags: the backend's default, as the API's.
    for command in ("generate", "bench"):
        assert KernelOptions.from_args(_parsed(command), "gpu") == KernelOptions.default("gpu")


def test_a_bad_flag_is_refused():
    with pytest.raises(InvalidArgumentError, match="NAME=VALUE"):
        KernelOptions.from_args(_parsed("bench", "--compiler-option", "oops"), "cpu")
    with pytest.raises(SystemExit):  # argparse: "unrecognized arguments: --attn-impl"
        _parsed("generate", "--attn-impl", "kernel")


def test_help_lists_the_kernel_flags(capsys):
    for command in ("generate", "bench"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([command, "--help"])
        text = capsys.readouterr().out
        for flag in ("--attention", "--gpu-linear", "--interpret-variant", "--sampling-rules",
                     "--compiler-option"):
            assert flag in text, (command, flag)
