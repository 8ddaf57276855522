"""Reliability: a short soak, generations that end at the cache's last slot and at the
model's position limit, faults inside a generation (drafts with NaN or Inf weights,
non-finite target logits, Ctrl-C while streaming) and threads sharing one model.

The long soak is ``benchmarks/soak.py`` (its result: ``benchmarks/results/soak_cpu.json``);
these tests load it and run it small, on its tiny random models. The tests share those
models, so they share compiled programs: every default-rule method at prompt bucket 16
and cache capacity 128 on the Llama target, and at the 100-position limit of the GPT-2
target. The short soak comes first: it counts the Llama target's programs.
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import pty
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import pytest
import transformers

import specjax
from specjax import api, decode
from specjax.errors import NumericalError
from specjax.state import plan_capacity

from conftest import fast_compiles
from helpers_checkpoints import _LLAMA, _build, tiny_vocabulary, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
SPECJAX = Path(sys.executable).with_name("specjax")
DRAFTED = ("spec", "tree", "staged")


@pytest.fixture(scope="module")
def soak():
    """``benchmarks/soak.py`` as a module."""
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # for its dataclasses
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("soak", None)


@pytest.fixture(scope="module")
def llama(soak):
    """Llama target (RoPE, 512 positions), two drafts sharing a config, n-gram tables
    (fitted to the target's text by programs compiled as the fast tests' are, so that the
    soak counts one program per method)."""
    with fast_compiles():
        return soak.build_fixture("llama", 512)


@pytest.fixture(scope="module")
def gpt2(soak, llama):
    """GPT-2 target (learned positions) with a 100-position table, and its drafts."""
    with fast_compiles():
        return soak.build_fixture("gpt2", 100, tables=llama.tables)


def ar_tokens(fixture, prompt, **kwargs) -> list[int]:
    return specjax.generate(fixture.target, prompt, **kwargs).tokens


# ----------------------------------------------------------------------------- soak


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_short_soak_is_exact_with_bounded_programs_and_flat_memory(soak, llama):
    # 150 random calls after a warm-up over every method: prompts of every length up to
    # 16, temperatures, top-k/top-p, seeds, both drafts, stop tokens, and generations
    # that fill the cache to its last slot.
    report = soak.soak(llama, 150, limits=("fill",))
    assert soak.problems(report) == []
    assert report["compiled_programs"] == 5  # one per method
    assert report["backend_compiles_after_warm_up"] == 0
    assert report["exact_comparisons"] >= 40 and report["calls"] >= 200


@pytest.mark.slow
def test_soak_every_rule_two_buckets_and_the_rope_position_limit(soak, llama):
    # Its own target config (384 positions), so its programs are counted apart.
    fixture = soak.build_fixture("llama", 384, tables=llama.tables)
    report = soak.soak(fixture, 300, combos=soak.ALL_COMBOS, buckets=(16, 32))
    assert soak.problems(report) == []
    assert report["compiled_programs"] == len(soak.ALL_COMBOS) * 2 + 5


# ----------------------------------------------------------------------------- limits


@pytest.mark.parametrize("method", [
    "ar", "spec", *(pytest.param(m, marks=pytest.mark.slow) for m in ("tree", "staged", "ngram"))])
def test_each_method_ends_cleanly_at_a_learned_position_limit(soak, gpt2, method):
    # GPT-2 reads a position table: the last steps of a speculative method draft and
    # verify nodes past it (never kept), and a prompt's padding can run past it too.
    runner = soak.Soak(gpt2, limits=("position",))
    calls = [c for c in soak.limit_calls(gpt2, random.Random(0), ("position",))
             if c.method == method]
    assert [len(c.prompt) + c.max_new_tokens for c in calls] == [100]
    if method == "ar":
        calls.append(soak.padded_past_table(runner))
    for call in calls:
        runner.check(call)  # equal to ar, every token asked for, no error
    assert runner.failures == []


@pytest.mark.slow  # 25 s: the slow tier keeps `make test` under 15 minutes
def test_every_method_fills_the_cache_to_its_last_slot(soak, llama):
    runner = soak.Soak(llama, limits=("fill",))
    calls = soak.limit_calls(llama, random.Random(1), ("fill",))
    assert sorted(c.method for c in calls) == sorted(soak.METHOD_NAMES)
    for call in calls:
        capacity = plan_capacity(len(call.prompt), call.max_new_tokens,
                                        soak.scratch(llama, call.method),
                                        llama.target.config)[1]
        total = len(call.prompt) + call.max_new_tokens + soak.scratch(llama, call.method)
        assert capacity == total == soak.CAPACITY
        runner.check(call)
    assert runner.failures == []


# ----------------------------------------------------------------------------- faults


def poisoned(model: specjax.Model, poison: str, token: int) -> specjax.Model:
    """``nan``: the embedding row of ``token`` is NaN (the draft turns NaN once it reads
    ``token``, its cache stays poisoned); ``inf``: the head's column of ``token`` is +inf
    (infinite or NaN logits at every step)."""
    params = dict(model.params)
    if poison == "nan":
        params["embed"] = params["embed"].at[token].set(jnp.nan)
    else:
        params["lm_head"] = params["lm_head"].at[:, token].set(jnp.inf)
    return specjax.Model(model.config, params, name=f"{poison}-draft")


@pytest.mark.parametrize("poison", ["nan", pytest.param("inf", marks=pytest.mark.slow)])
def test_a_draft_with_nan_or_inf_weights_does_not_change_the_output(llama, poison):
    prompt = [5, 61, 17, 88, 3, 40, 22]
    for temperature, seed in ((0.0, 0), (1.0, 7)):
        expected = ar_tokens(llama, prompt, max_new_tokens=40, temperature=temperature,
                             seed=seed)
        token = max(set(expected), key=expected.count)  # read early and often
        draft = poisoned(llama.drafts[1], poison, token)
        with pytest.raises(NumericalError):  # the poison bites: the draft alone fails
            specjax.generate(draft, prompt + [token], max_new_tokens=2)
        for method in DRAFTED:
            out = specjax.generate(llama.target, prompt, method=method, draft=draft,
                                   ngram=llama.tables if method == "staged" else None,
                                   max_new_tokens=40, temperature=temperature, seed=seed)
            assert out.tokens == expected, (method, temperature)


def test_non_finite_target_logits_stop_at_the_named_position(soak, llama):
    prompt = [9, 30, 71, 4, 12]
    clean = ar_tokens(llama, prompt, max_new_tokens=40)
    # A token the target emits at step k, absent before: feeding it gives NaN logits.
    k = next(i for i in range(3, 40) if clean[i] not in prompt + clean[:i] and clean[i])
    params = dict(llama.target.params)
    params["embed"] = params["embed"].at[clean[k]].set(jnp.nan)
    broken = specjax.Model(llama.target.config, params, name="broken")
    bad = len(prompt) + k + 1  # the token after the poisoned one

    with pytest.raises(NumericalError) as info:
        specjax.generate(broken, prompt, max_new_tokens=40)
    message = str(info.value)
    assert "\n" not in message
    assert f"token at position {bad} (new token {k + 2})" in message

    # Streaming yields every token up to the poisoned one, none from the NaN logits.
    streamed = []
    with pytest.raises(NumericalError, match=f"position {bad} "):
        for new, _ in specjax.stream_generate(broken, prompt, max_new_tokens=40):
            streamed += new
    assert streamed == clean[: k + 1]

    # Every method stops at the first step that met NaN (a speculative one may meet it
    # earlier, in a drafted node), with ar's tokens before it and nothing after.
    for method in soak.METHOD_NAMES:
        resources = llama.resources(method, draft=1)
        with pytest.raises(NumericalError) as info:
            specjax.generate(broken, prompt, method=method, max_new_tokens=40, **resources)
        request = api._prepare(broken, prompt, api.request(
            method=method, max_new_tokens=40, draft=resources.get("draft"),
            ngram=resources.get("ngram")))
        state, _, _ = decode.run_program(request.args[0], request.loop, *request.args[1:])
        stop, length = int(state.nonfinite_position), int(state.length)
        assert bool(state.nonfinite) and bool(state.done), method
        assert stop == length and len(prompt) < stop <= bad, method
        assert f"token at position {stop} " in str(info.value), method
        assert state.tokens[len(prompt): length].tolist() == clean[: length - len(prompt)]


# ----------------------------------------------------------------------------- threads


def test_two_threads_get_the_single_threaded_outputs(soak, llama):
    rng = random.Random(3)
    calls = []
    for method, verify in soak.DEFAULT_COMBOS:
        for temperature in (0.0, 1.0):
            prompt = tuple(rng.randrange(soak.VOCAB) for _ in range(rng.randint(1, 16)))
            calls.append(soak.Call(method, verify, prompt, rng.randint(10, 40), temperature,
                                   seed=rng.randrange(100), draft=rng.randrange(2)))

    def run(call):
        return specjax.generate(llama.target, list(call.prompt),
                                **call.kwargs(llama)).tokens

    def stream(call):  # the Python-driven driver (donates its state every step)
        chunks = specjax.stream_generate(llama.target, list(call.prompt),
                                         **call.kwargs(llama))
        return [token for new, _ in chunks for token in new]

    expected = {call: run(call) for call in calls}
    results, errors = [], []
    barrier = threading.Barrier(2)

    def worker(order):
        try:
            barrier.wait()
            for _ in range(4):
                for call in order:
                    results.append((call, run(call)))
                    if call.method in ("ar", "staged"):
                        results.append((call, stream(call)))
        except Exception as error:  # reported below, with the thread's call
            errors.append(repr(error))

    # Each thread runs in a copy of this one's context: the suite's compiler options (a
    # context variable) hold there too, so the threads share the programs compiled above.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(worker, order))
               for order in (calls, calls[::-1])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(results) == 2 * 4 * (len(calls) + 4)
    assert [call for call, tokens in results if tokens != expected[call]] == []


def test_threads_that_need_the_same_new_program_compile_it_once(soak, llama):
    prompt = list(range(1, 21))  # bucket 32: a program no other test compiles
    assert not any(bucket == 32 for _, _, bucket, _ in soak.programs(llama.target.config))
    barrier = threading.Barrier(2)
    outputs = []

    def worker():
        barrier.wait()
        out = specjax.generate(llama.target, prompt, max_new_tokens=12)
        outputs.append((out.stats["compile_seconds"] > 0, out.tokens))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(compiled for compiled, _ in outputs) == [False, True]
    assert outputs[0][1] == outputs[1][1]


# ----------------------------------------------------------------------------- Ctrl-C

PROMPT = "the then"
LONG = 3500  # the tiny model below emits no EOS in its first 3500 tokens after PROMPT


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, specjax.Model]:
    """A random Llama with a tokenizer, written as a GGUF file (4096 positions), and the
    model loaded from it."""
    tokens, _, _ = tiny_vocabulary()
    config = dict(_LLAMA, vocab_size=len(tokens), num_hidden_layers=2, num_key_value_heads=2,
                  tie_word_embeddings=False, max_position_embeddings=4096)
    path = write_tiny_gguf(_build(transformers.LlamaConfig, config, 1),
                           tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, specjax.load(path)


@pytest.fixture(scope="module")
def long_text(tiny_gguf) -> str:
    out = specjax.generate(tiny_gguf[1], PROMPT, max_new_tokens=LONG)
    assert len(out.tokens) == LONG, "the tiny model emitted EOS: pick another seed"
    return out.text


def test_threads_share_a_model_with_a_tokenizer(tiny_gguf):
    # String prompts: both threads encode and decode with the model's one tokenizer.
    model = tiny_gguf[1]
    prompts = ["the then", "def return", "in a an", "1 x y z", "while if else", "er on"]
    expected = {p: specjax.generate(model, p, max_new_tokens=16).text for p in prompts}
    errors, wrong = [], []

    def worker(order):
        try:
            for _ in range(5):
                for prompt in order:
                    if specjax.generate(model, prompt, max_new_tokens=16).text \
                            != expected[prompt]:
                        wrong.append(prompt)
        except Exception as error:  # reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(worker, o))
               for o in (prompts, prompts[::-1])]  # the context: see the test above
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and wrong == []


def interrupt_stream(argv: list[str], stdout, stderr, first_output, timeout=300.0):
    """Starts ``specjax ARGV`` and sends SIGINT once ``first_output()`` returns bytes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([str(SPECJAX), *argv], stdout=stdout, stderr=stderr, env=env)
    try:
        head = first_output(process, time.monotonic() + timeout)
        process.send_signal(signal.SIGINT)
        return process, head
    except BaseException:
        process.kill()
        process.wait()
        raise


def _read_when_ready(fd: int, process, deadline: float) -> bytes:
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            return os.read(fd, 65536)
        assert process.poll() is None, f"specjax exited with {process.returncode} first"
    raise AssertionError("no output before the deadline")


def test_ctrl_c_while_streaming_keeps_the_text_and_prints_one_line(tiny_gguf, long_text):
    argv = ["generate", "-m", str(tiny_gguf[0]), "--max-new-tokens", str(LONG), PROMPT]
    process, head = interrupt_stream(
        argv, subprocess.PIPE, subprocess.PIPE,
        lambda p, deadline: _read_when_ready(p.stdout.fileno(), p, deadline))
    out, err = process.communicate(timeout=120)
    out = (head + out).decode()
    assert (process.returncode, err.decode()) == (130, "specjax: interrupted\n")
    # What was generated so far, ended by a newline: a prefix of the whole text.
    assert out.endswith("\n")
    text = out[:-1]
    assert text and long_text.startswith(text) and len(text) < len(long_text)


@pytest.mark.slow
def test_ctrl_c_while_streaming_in_a_terminal_ends_with_one_line(tiny_gguf):
    # stdout and stderr on one terminal: progress, the streamed text, then exactly one
    # line saying it was interrupted, on a line of its own.
    controller, terminal = pty.openpty()
    streaming = re.compile(rb"compiling and prefilling \.\.\. [0-9.]+ s\r\n.", re.S)

    def stream_started(process, deadline):
        seen = b""
        while not streaming.search(seen):
            seen += _read_when_ready(controller, process, deadline)
        return seen

    try:
        argv = ["generate", "-m", str(tiny_gguf[0]), "--max-new-tokens", str(LONG), PROMPT]
        try:
            process, output = interrupt_stream(argv, terminal, terminal, stream_started)
        finally:
            os.close(terminal)  # the process holds its own copy
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every copy of the terminal closed, the process ended
                break
            if not chunk:
                break
            output += chunk
        process.wait(timeout=120)
    finally:
        os.close(controller)
    text = output.decode(errors="replace")
    assert process.returncode == 130
    assert text.endswith("\r\nspecjax: interrupted\r\n") and text.count("interrupted") == 1
    assert "Traceback" not in text
