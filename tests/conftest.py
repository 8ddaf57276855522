"""Shared fixtures: tiny random transformers models and their specjax twins, and the real
embedded model (loaded once per session)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The specjax program keeps compiled programs in ~/.cache between runs; not for the tests
# (tests/test_cli.py turns it on where it tests it).
os.environ.setdefault("SPECJAX_COMPILATION_CACHE", "off")
# Nor do they time this machine's steps for the default method (specjax.calibration):
# they check the table's choice; tests/test_calibration.py turns it on where it tests it.
os.environ.setdefault("SPECJAX_CALIBRATION", "off")

import jax
import numpy as np
import pytest
import torch
import transformers

# The Ctrl-C tests (test_interrupt, test_reliability, ...) assume Python's own SIGINT
# handler. A process started in the background by a non-interactive shell inherits SIGINT
# *ignored*, and then Python keeps it ignored (and so do the CLI subprocesses these tests
# start): put the handler an interactive start would have given back.
if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
    signal.signal(signal.SIGINT, signal.default_int_handler)

import compile_profile
import specjax
from specjax import requests as _requests
from specjax.checkpoints_tools.keymap import params_from_hf_tensors
from specjax.families import from_hf_config

# A request's kernel options as users get them (fast_compiles patches the function).
_USERS_KERNEL_OPTIONS = _requests.kernel_options

# fp32 everywhere; exact matmuls so that parity tolerances mean what they say.
jax.config.update("jax_default_matmul_precision", "highest")

# CPython's cycle collector walks every tracked object on each full collection, and a
# worker holds torch, transformers, JAX and specjax (~10^6 objects) from here on: 4% of a
# test file's CPU time went to collections (tests/test_speculative.py, 2,694 of them,
# 2026-11-29). What the imports left alive is frozen out of the collector's walks, and the
# youngest generation is collected a tenth as often (JAX's tracing allocates in bursts).
gc.collect()
gc.freeze()
gc.set_threshold(7_000, 10, 10)

# One persistent compilation cache per test run, shared by the xdist workers: each test
# module drops its compiled programs when it ends (_release_compiled_programs), and many
# modules compile the same tiny models' programs again, as does the other worker. The
# cache is keyed on the program and its compile options, so a hit is the same executable.
# SPECJAX_TEST_XLA_CACHE names a folder to keep between runs, or "off"; JAX's own setting
# (JAX_COMPILATION_CACHE_DIR) wins.
TEST_CACHE_ENV = "SPECJAX_TEST_XLA_CACHE"


def pytest_addoption(parser):
    parser.addoption("--compile-profile", metavar="DIR", default=None,
                     help="record each test's time, CPU and JAX compiles under DIR and print "
                          "where the run's time went (tests/compile_profile.py)")


def _profile_directory(config):
    directory = config.getoption("compile_profile")
    return None if directory is None else Path(directory)


def pytest_configure(config):
    profile = _profile_directory(config)
    if profile is not None:
        if not hasattr(config, "workerinput"):  # the controller (or the only process)
            profile.mkdir(parents=True, exist_ok=True)
            for old in [*profile.glob("*.jsonl"), profile / "summary.json"]:
                old.unlink(missing_ok=True)
        config.pluginmanager.register(compile_profile.Recorder(profile), "compile_profile")
    directory = os.environ.get(TEST_CACHE_ENV)
    if directory is None and not hasattr(config, "workerinput"):  # the controller
        directory = tempfile.mkdtemp(prefix="specjax-tests-xla-")
        os.environ[TEST_CACHE_ENV] = directory  # the workers inherit it
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
    if (directory and directory.lower() != "off"
            and not jax.config.jax_compilation_cache_dir):
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _optimise_compiles(as_users=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``one_worker`` (they read one costly module fixture, such as a
    subprocess's report) come first, in their order. pytest-xdist's work stealing
    (``--dist worksteal``) hands each worker a contiguous share of the collection from the
    front and steals from the back of a queue, so they all run on the first worker and the
    fixture is made once: spread over two, each made it (the slow sharding subprocess ran
    twice in the slow tier of 2026-11-30, 134 s and 125 s). So long as they are fewer than
    a worker's share: in a run of those tests alone, both workers run them."""
    items.sort(key=lambda item: item.get_closest_marker("one_worker") is None)


def pytest_terminal_summary(terminalreporter, config):
    profile = _profile_directory(config)
    if profile is not None and not hasattr(config, "workerinput"):
        terminalreporter.section("where the time went (--compile-profile)")
        for line in compile_profile.report_lines(compile_profile.summarize(profile)):
            terminalreporter.write_line(line)


TINY_VOCAB = 97


def tiny_hf_config(kind: str, **overrides):
    """Tiny random configs; a large initializer range makes outputs diverse, not constant."""
    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.3, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if kind == "gpt2":
        cfg = dict(n_embd=64, n_layer=3, n_head=4, n_positions=256)
        return transformers.GPT2Config(**{**common, **cfg, **overrides})
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, max_position_embeddings=512)
    if kind == "llama-mha":
        return transformers.LlamaConfig(**{**common, **base, "num_key_value_heads": 4,
                                           "tie_word_embeddings": False, **overrides})
    if kind == "llama-gqa":
        return transformers.LlamaConfig(**{**common, **base, "num_key_value_heads": 2,
                                           "tie_word_embeddings": True, **overrides})
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**common, **base, "num_key_value_heads": 1,
                                           "tie_word_embeddings": False, **overrides})
    raise ValueError(kind)


def tiny_pair(kind: str, seed: int = 0, **overrides):
    """(transformers model, specjax Model) with identical random weights."""
    torch.manual_seed(seed)
    hf_config = tiny_hf_config(kind, **overrides)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    config = from_hf_config(hf_config)
    tensors = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    params = params_from_hf_tensors(config, tensors, source=kind)
    return hf_model, specjax.Model.from_params(config, params, name=f"tiny-{kind}-{seed}")


def serve_models(monkeypatch, served: dict, prompts) -> dict:
    """Makes ``specjax`` commands load the models in ``served`` by name (``-m tiny --draft
    tiny-draft``) and run the benchmark suite on ``prompts``; returns ``served``."""
    from specjax import loading
    from specjax import humaneval

    monkeypatch.setattr(loading, "load", lambda name, dtype=None, *, progress=False: served[name])
    real_check = loading.check_draft_spec
    monkeypatch.setattr(loading, "check_draft_spec",
                        lambda draft: None if draft in served else real_check(draft))
    monkeypatch.setattr(humaneval, "suite_prompts", lambda suite, limit: prompts[:limit])
    return served


def tiny_target_with_tokenizer(tokenizer, vocab_size: int, max_positions: int = 256,
                               **overrides) -> specjax.Model:
    """A 3-layer random Llama over a real tokenizer's vocabulary (for the tools that
    tokenize text: train-draft, build-ngram); ``overrides`` go to the LlamaConfig."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True, initializer_range=0.2, **overrides)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    config = from_hf_config(hf_config)
    params = params_from_hf_tensors(
        config, {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}, source="tiny")
    return specjax.Model.from_params(config, params, tokenizer, name="tiny-target")


def write_corpus(root, texts) -> list:
    """Writes ``texts`` as ``module_<i>.py`` files under ``root/corpus``; returns their
    paths. train-draft splits files into training and held-out by a hash of the file's and
    its folder's names, so the folder is named the same in every run: under pytest's
    numbered temporary folders ("corpus0", "corpus1", ... in the order fixtures ran) the
    split, and a run's losses, changed with which tests had run before."""
    files = []
    folder = root / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        path = folder / f"module_{i}.py"
        path.write_text(text)
        files.append(path)
    return files


def fitted_tables(model, seeds, max_new_tokens: int):
    """Stage-2 n-gram tables fitted to ``model``'s own greedy text (one 6-token random
    prompt per seed), so that stage 2 proposes tokens the model will accept."""
    from specjax.training.ngram_build import build_ngram

    corpus = [specjax.generate(model, random_prompt(s, 6), max_new_tokens=max_new_tokens).tokens
              for s in seeds]
    return build_ngram(corpus, TINY_VOCAB, top_k=8, trigram_top_k=4, trigram_buckets=256,
                       min_context_count=1).tables


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def drop_compiled_programs() -> None:
    """Drops every compiled program this process holds (specjax's and JAX's caches)."""
    from specjax import decode

    decode.clear_compiled()
    jax.clear_caches()


@contextlib.contextmanager
def programs_set_aside(jax_caches: bool = False):
    """Inside, specjax's compiled programs are set aside, so that what runs there compiles
    afresh: a test that patches a rule WRONG on purpose needs that, as the patched program
    has the right one's cache key and would otherwise reuse it. On leaving, what was
    compiled inside is dropped, so no wrong program outlives the block, and the programs
    set aside come back: the tests after it do not compile them again (wrong-rule tests had
    dropped them all: 8 of test_constraints' programs compiled two or three times,
    2026-11-30). ``jax_caches``: JAX's own caches are cleared too, on entering and on
    leaving (a rule patched under a function JAX traced and cached)."""
    from specjax import decode

    executables, fallbacks = dict(decode._EXECUTABLES), dict(decode._FALLBACKS)
    decode.clear_compiled()
    if jax_caches:
        jax.clear_caches()
    try:
        yield
    finally:
        decode.clear_compiled()
        if jax_caches:
            jax.clear_caches()
        decode._FALLBACKS.update(fallbacks)  # first: a reader finds both (decode.compiled)
        decode._EXECUTABLES.update(executables)


@pytest.fixture
def programs_aside():
    """``programs_aside(jax_caches=False)`` enters :func:`programs_set_aside` until the test
    ends (call it before patching a rule)."""
    with contextlib.ExitStack() as stack:
        yield lambda jax_caches=False: stack.enter_context(programs_set_aside(jax_caches))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test module's compiled programs are dropped when it ends: the suite compiles
    hundreds of programs, and keeping them all grows the process until XLA aborts."""
    yield
    drop_compiled_programs()


# The tiny models' generation programs compile with XLA's CPU backend optimisations off and
# with the CPU's older fusion emitters (LLVM IR emitted per fusion directly, not through the
# MLIR fusion emitters): measured on a `staged` and a `tree` program, backend compile
# 8.0-8.7 s at level 0 alone, 4.6 s with both, 20 s as users compile (2026-11-25). The HLO
# passes are those users get but two (below); `ar` and every method compile alike, so
# exactness is checked like for like. In both tiers: the slow one had spent most of its
# time compiling tiny batch and tree programs as users do, 1.5-3.5 minutes a test; with
# these options 0.8-1.7 (2026-11-29).
# Every other program compiles with XLA's optimisations off too (_optimise_compiles).
# Programs compile as users compile them in tests on the real model (SmolLM2: greedy and
# coupled exactness of every method, parity with transformers; not the sharding
# subprocess, whose subject is the partitioning, nor tests marked fast_compile: the
# command line's, whose subject is what it prints) and in tests marked
# users_compile (a method on each of six families in test_families' grid, the
# compiled-step structure in test_profile_step).
# Two of XLA's HLO passes are left out too: the loop-invariant code motion and the while
# loops' simplification took 2.5 of the 5.6 s of HLO passes of a tiny `tree` program (XLA's
# pass timings, TF_CPP_VMODULE=hlo_pass_pipeline=1), and the program's backend compile went
# from 6.3-7.6 s to 4.9-5.7 s without them (three runs each, 2026-11-29). Both only move or
# drop work (an invariant computed once before the loop; an unused loop value), never change
# an operation's arithmetic.
# And the kernels' LLVM code is generated as one module rather than split into 32 compiled
# on threads (the same functions, so the same machine code for each): on two busy cores the
# split costs more than it saves. A `tree` program's backend compile took 3.41 s of CPU
# instead of 3.69, a `spec` one's 3.18 instead of 3.65 (medians of five, the same lowered
# program each time); four quick test files (test_speculative, test_staged, test_methods,
# test_kernels) took 340 and 346 worker-seconds against 354 and 359, interleaved, with the
# option set through XLA_FLAGS for every program they compiled, not only these (2026-12-01).
_FAST_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                 "xla_disable_hlo_passes": "while-loop-invariant-code-motion,simplify-while-loops",
                 "xla_cpu_parallel_codegen_split_count": 1}


@functools.cache
def fast_compiler_options() -> dict:
    """:data:`_FAST_OPTIONS` less any this jaxlib's XLA refuses (an option may be retired
    in a later release: the suite then compiles without it rather than failing). None on
    a GPU or TPU: there the tests that run (``gpu_run.sh``'s ``exact`` step) check the
    programs as users compile them, and the backend's own optimisation level is what
    decides whether a verify pass reproduces the one-token step bit for bit."""
    if jax.default_backend() != "cpu":
        return {}

    def accepted(name, value):
        try:
            jax.jit(lambda x: x + 1).lower(np.float32(1)).compile(
                compiler_options={name: value})
        except Exception:  # noqa: BLE001 -- XLA's INVALID_ARGUMENT: no such option
            return False
        return True

    return {name: value for name, value in _FAST_OPTIONS.items() if accepted(name, value)}


def fast_xla_flags() -> str:
    """:func:`fast_compiler_options` as ``XLA_FLAGS`` (for the subprocess tests)."""
    return " ".join(f"--{name}={str(value).lower()}"
                    for name, value in fast_compiler_options().items())


def _optimise_compiles(as_users: bool) -> None:
    """Every other program a test process compiles (forward passes for parity, training
    steps, interpreted Pallas kernels) compiles with JAX's ``jax_disable_most_optimizations``
    (XLA's CPU backend at level 0, LLVM's expensive passes off) unless ``as_users``:
    tests/test_kernels.py's CPU time went from 170 s to 108 s (2026-11-29). Not on a GPU or
    TPU (:func:`fast_compiler_options` is empty there)."""
    jax.config.update("jax_disable_most_optimizations",
                      not as_users and bool(fast_compiler_options()))


@contextlib.contextmanager
def users_compiles():
    """Programs compiled inside compile as users compile them (without the options that
    :func:`fast_compiles` adds around the whole session)."""
    _optimise_compiles(as_users=True)
    try:
        with mock.patch.object(_requests, "kernel_options", _USERS_KERNEL_OPTIONS):
            yield
    finally:
        _optimise_compiles(as_users=False)


def with_fast_options(kernels):
    """``kernels`` (a :class:`specjax.KernelOptions`) with :func:`fast_compiler_options`
    under its own compiler options."""
    fast = fast_compiler_options()
    if not fast:
        return kernels
    return kernels.replace(compiler_options={**fast, **dict(kernels.compiler_options)})


@contextlib.contextmanager
def fast_compiles():
    """Inside, every request's :class:`specjax.KernelOptions` (``requests.kernel_options``, the
    one place a request's options are made concrete) carries :func:`fast_compiler_options`
    under its own compiler options, in every thread: so the programs are keyed, cached and
    reported (``stats["kernels"]``) with the options they compiled with."""
    from specjax import requests

    resolve = requests.kernel_options
    with mock.patch.object(requests, "kernel_options",
                           lambda backend, kernels=None: with_fast_options(
                               resolve(backend, kernels))):
        yield


@pytest.fixture(autouse=True, scope="session")
def _fast_compiles_everywhere():
    """The whole session compiles with :func:`fast_compiles`: the module and session
    fixtures that generate (n-gram tables fitted to a model's text, a benchmark run) too,
    which are set up before a test's own fixtures. Compiled as users compile, their `ar`
    programs took two to three times as long and were not the tests' programs (another
    key): the tests compiled the same program again."""
    with fast_compiles():
        yield


@pytest.fixture(autouse=True)
def _fast_compiles(request):
    if (request.node.get_closest_marker("users_compile")
            or ("smollm2" in request.fixturenames
                and not request.node.get_closest_marker("fast_compile"))):
        with users_compiles():
            yield
        return
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF), fp32."""
    with users_compiles():
        return specjax.load("smollm2-135m")


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` (a maintained tool) or
    ``benchmarks/experiments/<name>.py`` (a one-off experiment) as a module (neither folder
    is a package), registered in ``sys.modules`` under ``name`` (dataclasses look their
    module up there)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    path = folder / f"{name}.py"
    if not path.exists():
        path = folder / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def random_prompt(seed: int, length: int, vocab: int = TINY_VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.fixture(scope="session")
def spec_target():
    """The tiny target of the speculative tests."""
    return tiny_pair("llama-mha", seed=21)[1]


@pytest.fixture(scope="session")
def spec_drafts(spec_target):
    """A weak random draft, the target itself, and a draft that is always wrong (its
    negated head ranks the target's least likely tokens first)."""
    weak = tiny_pair("llama-mha", seed=22, num_hidden_layers=1)[1]
    wrong_params = dict(spec_target.params, lm_head=-spec_target.params["lm_head"])
    wrong = specjax.Model(spec_target.config, wrong_params, name="wrong")
    return {"weak": weak, "self": spec_target, "wrong": wrong}
