"""Soak: thousands of ``specjax.generate`` calls in one process, on tiny random models.

What a research script or a notebook does for hours, compressed: one process calls
:func:`specjax.generate` again and again with a mix of prompt lengths (every length up
to the largest prompt bucket), methods, verify rules, sampling settings, drafts and stop
tokens, and now and then a generation that runs to the end of the cache or to the
model's position limit. It checks, and records in the JSON:

* **exactness**: every ``greedy``/``coupled`` output (and every ``ar`` output) equals
  ``ar``'s output for the same prompt and settings; ``match``/``rejection`` outputs are
  well formed (ids in the vocabulary, as many tokens as asked unless a stop token ended
  them);
* **compiled programs stay bounded**: :data:`specjax.decode._EXECUTABLES` holds one
  program per (method and rule, prompt bucket, cache capacity) that the warm-up visits,
  and XLA compiles nothing after the warm-up (every backend compilation is counted);
* **memory stays flat**: resident memory after the warm-up and at the end (at most 5%
  growth);
* **limits**: for every method, a generation whose sequence plus its scratch fills the
  cache to the last slot, and one that ends exactly at ``max_position_embeddings`` (a
  Llama target, RoPE, and a GPT-2 target, learned positions), finish without an error,
  with every token asked for, equal to ``ar``.

The models are random (vocabulary 97, width 64; the target 3 layers, two 2-layer drafts
sharing one config: a random one and the target's first layers) and the n-gram tables
are fitted to the target's own greedy text, so speculation both succeeds and fails. No
checkpoint, tokenizer or network is needed. A short version runs in the test suite
(``tests/test_reliability.py``).

    python benchmarks/soak.py --calls 2000 --json benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import time
from typing import Any

import jax
import numpy as np

import specjax
from specjax import api, decode, methods, models, requests
from specjax.config import ModelConfig
from specjax.harness.environment import machine, write_json
from specjax.state import bucket
from specjax.training.ngram_build import build_ngram

VOCAB = 97
CAPACITY = 128  # the cache capacity of every regular call (see Soak.max_new_tokens)
# (method, verify rule) pairs; greedy runs at temperature 0 only.
DEFAULT_COMBOS = (("ar", None), ("spec", "coupled"), ("tree", "coupled"),
                  ("staged", "coupled"), ("ngram", "coupled"))
ALL_COMBOS = DEFAULT_COMBOS + (("spec", "greedy"), ("spec", "rejection"), ("tree", "match"),
                               ("tree", "rejection"), ("staged", "greedy"),
                               ("staged", "match"), ("ngram", "rejection"))
METHOD_NAMES = ("ar", "spec", "tree", "staged", "ngram")
EXACT_RULES = (None, "greedy", "coupled")  # None: ar itself
TEMPERATURES = (0.0, 0.7, 1.0, 1.3)
TOP_KS = (0, 5, 40)
TOP_PS = (1.0, 0.9, 0.5)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# ----------------------------------------------------------------------------- models


def tiny_config(architecture: str = "llama", num_layers: int = 3,
                max_positions: int = 512) -> ModelConfig:
    """A tiny config (V = 97, width 64, 4 heads); GPT-2 with biases and tied head."""
    gpt2 = architecture == "gpt2"
    return ModelConfig(
        architecture=architecture, vocab_size=VOCAB, hidden_size=64, num_layers=num_layers,
        num_heads=4, num_kv_heads=4 if gpt2 else 2, head_dim=16, intermediate_size=128,
        max_position_embeddings=max_positions, tie_word_embeddings=gpt2, qkv_bias=gpt2,
        out_bias=gpt2, mlp_bias=gpt2)


def random_model(config: ModelConfig, seed: int, name: str) -> specjax.Model:
    """Random weights with matrices of std 0.3 (not 0.02): logits spread over several
    units, so greedy text is diverse and drafts are sometimes right, sometimes wrong."""
    params = models.init_params(config, jax.random.PRNGKey(seed))
    params = jax.tree.map(lambda a: a * 15.0 if a.ndim >= 2 else a, params)
    return specjax.Model.from_params(config, params, name=name)


@dataclasses.dataclass
class Fixture:
    """A target, drafts sharing one config (so they share compiled programs) and n-gram
    tables."""

    target: specjax.Model
    drafts: list[specjax.Model]
    tables: Any

    def resources(self, method: str, draft: int) -> dict:
        """The ``draft=`` / ``ngram=`` arguments ``method`` takes."""
        out = {}
        if method in ("spec", "tree", "staged"):
            out["draft"] = self.drafts[draft]
        if method in ("staged", "ngram"):
            out["ngram"] = self.tables
        return out


def build_fixture(architecture: str = "llama", max_positions: int = 512, seed: int = 0,
                  tables=None) -> Fixture:
    """The soak's models: a 3-layer target, a random 2-layer draft and the target's first
    two layers as a second draft; n-gram tables fitted to the target's greedy text
    (``tables``, when given, are used instead)."""
    config = tiny_config(architecture, 3, max_positions)
    target = random_model(config, seed, f"tiny-{architecture}-target")
    weak = random_model(dataclasses.replace(config, num_layers=2), seed + 1,
                        f"tiny-{architecture}-draft")
    drafts = [weak, target.first_layers(2)]
    if tables is None:
        rng = np.random.default_rng(seed)
        corpus = [specjax.generate(target, rng.integers(0, VOCAB, 6).tolist(),
                                   max_new_tokens=48).tokens for _ in range(8)]
        tables = build_ngram(corpus, VOCAB, top_k=8, trigram_top_k=4, trigram_buckets=256,
                             min_context_count=1).tables
    return Fixture(target, drafts, tables)


# ----------------------------------------------------------------------------- measuring


_compiles = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == BACKEND_COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def backend_compiles() -> int:
    """XLA compilations in this process since this module was imported."""
    return _compiles[0]


def rss_bytes() -> int:
    """Resident memory of this process (psutil, else ``/proc/self/statm``)."""
    gc.collect()
    try:
        import psutil
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


# ----------------------------------------------------------------------------- calls


@dataclasses.dataclass(frozen=True)
class Call:
    """One ``generate`` call's settings (hashable: the ``ar`` reference is memoised)."""

    method: str
    verify: str | None
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft: int = 0
    stop_tokens: tuple[int, ...] | None = None

    @property
    def exact(self) -> bool:
        """Whether the output must equal ``ar``'s token for token."""
        return self.verify in EXACT_RULES

    def reference(self) -> "Call":
        """The ``ar`` call this one must match (when :attr:`exact`)."""
        return dataclasses.replace(self, method="ar", verify=None, draft=0)

    def kwargs(self, fixture: Fixture) -> dict:
        out = dict(method=self.method, max_new_tokens=self.max_new_tokens,
                   temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                   seed=self.seed, stop=self.stop_tokens,
                   **fixture.resources(self.method, self.draft))
        if self.verify is not None:
            out["verify"] = self.verify
        return out


def scratch(fixture: Fixture, method: str) -> int:
    """Cache slots past the sequence one step of ``method`` (default options) writes."""
    options = methods.method_options(method)
    draft = fixture.drafts[0].config if options.uses_draft else None
    return methods.build(options, draft).scratch


def max_scratch(fixture: Fixture, combos) -> int:
    return max(scratch(fixture, method) for method, _ in combos)


LIMITS = ("fill", "position")


def limit_calls(fixture: Fixture, rng: random.Random, limits=LIMITS) -> list[Call]:
    """Per method, greedy and without stop tokens: ``"fill"``, a generation whose
    sequence plus scratch fills the cache to its last slot (capacity 128), and
    ``"position"``, one that ends at ``max_position_embeddings``."""
    limit = fixture.target.config.max_position_embeddings
    calls = []
    for method in METHOD_NAMES:
        verify = None if method == "ar" else "coupled"
        prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 16)))
        fill = CAPACITY - scratch(fixture, method) - len(prompt)
        if "fill" in limits and fill >= 1 and len(prompt) + fill <= limit:
            calls.append(Call(method, verify, prompt, fill, stop_tokens=()))
        if "position" in limits:
            calls.append(Call(method, verify, prompt, limit - len(prompt), stop_tokens=()))
    return calls


class Soak:
    """Runs calls, checks each against ``ar`` or for well-formedness, counts them."""

    def __init__(self, fixture: Fixture, combos=DEFAULT_COMBOS, buckets=(16,), seed: int = 0,
                 limits=LIMITS):
        self.fixture = fixture
        self.combos = tuple(combos)
        self.buckets = tuple(buckets)
        self.limits = tuple(limits)
        self.rng = random.Random(seed)
        self.references: dict[Call, list[int]] = {}
        self.calls = 0
        self.calls_by_method: dict[str, int] = {}
        self.exact_checked = 0
        self.failures: list[str] = []
        # Regular calls keep sequence + scratch within CAPACITY: one cache size.
        self.max_new_tokens = min(
            CAPACITY - max(self.buckets) - max_scratch(fixture, self.combos),
            fixture.target.config.max_position_embeddings - max(self.buckets))
        if self.max_new_tokens < 1:
            raise ValueError(f"buckets {self.buckets} leave no room in a {CAPACITY}-slot cache")

    def generate(self, call: Call) -> list[int]:
        """One ``generate`` call (counted)."""
        out = specjax.generate(self.fixture.target, list(call.prompt),
                               **call.kwargs(self.fixture))
        self.calls += 1
        self.calls_by_method[call.method] = self.calls_by_method.get(call.method, 0) + 1
        if out.stats["new_tokens"] != len(out.tokens):
            self.failures.append(f"{call}: stats count {out.stats['new_tokens']} tokens, "
                                 f"the output has {len(out.tokens)}")
        return out.tokens

    def check(self, call: Call) -> None:
        """Runs ``call`` and records a failure if its output is wrong."""
        tokens = self.generate(call)
        if not call.stop_tokens and len(tokens) != call.max_new_tokens:
            # The tiny models have no EOS: only a stop token given ends a generation early.
            self.failures.append(f"{call}: {len(tokens)} tokens, asked for "
                                 f"{call.max_new_tokens}")
        if call.exact:
            reference = call.reference()
            if reference not in self.references:
                self.references[reference] = (tokens if call.method == "ar"
                                              else self.generate(reference))
            self.exact_checked += call.method != "ar"
            if tokens != self.references[reference]:
                self.failures.append(f"{call}: {tokens} != ar {self.references[reference]}")
            return
        stops = set(call.stop_tokens or ())
        ended = len(tokens) == call.max_new_tokens or bool(tokens and tokens[-1] in stops)
        if not ended or any(not 0 <= t < VOCAB for t in tokens) \
                or any(t in stops for t in tokens[:-1]):
            self.failures.append(f"{call}: malformed output {tokens}")

    def random_call(self) -> Call:
        """A call mixing every setting: prompt length 1 .. the largest bucket."""
        rng = self.rng
        method, verify = rng.choice(self.combos)
        temperature = 0.0 if verify == "greedy" or rng.random() < 0.4 else rng.choice(
            TEMPERATURES[1:])
        prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, max(self.buckets))))
        stop = None if rng.random() < 0.7 else (rng.randrange(VOCAB),)
        return Call(method, verify, prompt, rng.randint(1, self.max_new_tokens), temperature,
                    rng.choice(TOP_KS) if temperature else 0,
                    rng.choice(TOP_PS) if temperature else 1.0, rng.randrange(2**32),
                    rng.randrange(len(self.fixture.drafts)), stop)

    def warm_up(self) -> None:
        """Every (method and rule, prompt bucket) at temperature 0 and above, and the
        limit calls: every program the soak needs."""
        for method, verify in self.combos:
            for size in self.buckets:
                length = self.rng.randint(size // 2 + 1, size)
                prompt = tuple(self.rng.randrange(VOCAB) for _ in range(length))
                for temperature in ((0.0,) if verify == "greedy" else (0.0, 1.0)):
                    self.check(Call(method, verify, prompt, 8, temperature, seed=1))
        for call in limit_calls(self.fixture, self.rng, self.limits):
            self.check(call)

    def run(self, calls: int, limit_every: int = 100) -> None:
        """``calls`` random calls; every ``limit_every``-th is a limit call instead."""
        for i in range(calls):
            if self.limits and limit_every and i % limit_every == limit_every - 1:
                self.check(self.rng.choice(limit_calls(self.fixture, self.rng, self.limits)))
            else:
                self.check(self.random_call())


def programs(config: ModelConfig, kernels=None) -> list[tuple]:
    """The compiled generation programs of a target: (method, verify, prompt bucket,
    capacity) of every :func:`specjax.generate` executable cached for ``config`` (and,
    given ``kernels``, compiled with those :class:`~specjax.KernelOptions`: a program the
    fixture compiled under other compiler options is another program, not the soak's)."""
    out = []
    for fn, loop, *_ in decode._EXECUTABLES:
        if (fn is decode.run_to_completion and loop.config == config
                and (kernels is None or loop.kernels == kernels)):
            verify = getattr(getattr(loop.method, "options", None), "verify", None)
            out.append((loop.method.name, verify, loop.prompt_bucket, loop.capacity))
    return sorted(out)


def expected_programs(fixture: Fixture, combos, buckets, limits=LIMITS) -> int:
    """Compiled generation programs the warm-up makes: one per (method and rule, prompt
    bucket) at capacity 128, plus one per method for the position limit when it needs a
    larger cache."""
    limit = fixture.target.config.max_position_embeddings
    extra = sum(bucket(limit + scratch(fixture, method), 128) != CAPACITY
                for method in METHOD_NAMES) if "position" in limits else 0
    return len(combos) * len(buckets) + extra


def soak(fixture: Fixture, calls: int, combos=DEFAULT_COMBOS, buckets=(16,), seed: int = 0,
         log=None, limits=LIMITS) -> dict:
    """Warms up, then runs ``calls`` random calls; returns the report (see the module
    docstring). Programs are counted per target config: other calls on the same target
    (with other buckets or rules) add to the count."""
    report: dict[str, Any] = {"rss_start_bytes": rss_bytes()}
    compiles_before = backend_compiles()
    start = time.perf_counter()
    # what every soak call runs with
    kernels = requests.kernel_options(requests.model_backend(fixture.target))
    runner = Soak(fixture, combos, buckets, seed, limits)
    runner.warm_up()
    warm = time.perf_counter()
    report.update(rss_warm_bytes=rss_bytes(), warm_up_calls=runner.calls,
                  warm_up_seconds=warm - start,
                  backend_compiles_warm_up=backend_compiles() - compiles_before)
    compiles_warm = backend_compiles()
    done = 0
    while done < calls:
        chunk = min(200, calls - done)
        runner.run(chunk)
        done += chunk
        if log:
            log(f"{done}/{calls} calls, {len(runner.failures)} failures, "
                f"rss {rss_bytes() / 2**20:.1f} MiB")
    end = time.perf_counter()
    compiled = programs(fixture.target.config, kernels)
    report.update(
        rss_end_bytes=rss_bytes(), soak_calls=runner.calls - report["warm_up_calls"],
        calls=runner.calls, calls_by_method=runner.calls_by_method,
        exact_comparisons=runner.exact_checked, soak_seconds=end - warm,
        wall_seconds=end - start, failures=runner.failures[:20],
        failure_count=len(runner.failures),
        compiled_programs=len(compiled), programs=compiled,
        expected_programs=expected_programs(fixture, combos, buckets, limits),
        backend_compiles_after_warm_up=backend_compiles() - compiles_warm,
        max_new_tokens=runner.max_new_tokens, combos=[list(c) for c in combos],
        buckets=list(buckets), limits=list(limits))
    report["rss_growth_after_warm_up"] = (report["rss_end_bytes"] / report["rss_warm_bytes"]
                                          - 1.0)
    return report


def problems(report: dict, max_growth: float = 0.05) -> list[str]:
    """What the report shows wrong (empty when the soak passed)."""
    out = [f"{report['failure_count']} wrong outputs, e.g. {report['failures'][:1]}"] \
        if report["failure_count"] else []
    if report["compiled_programs"] != report["expected_programs"]:
        out.append(f"{report['compiled_programs']} compiled programs, expected "
                   f"{report['expected_programs']}")
    if report["backend_compiles_after_warm_up"]:
        out.append(f"{report['backend_compiles_after_warm_up']} XLA compilations after the "
                   "warm-up")
    if report["rss_growth_after_warm_up"] > max_growth:
        out.append(f"resident memory grew {100 * report['rss_growth_after_warm_up']:.1f}% "
                   f"after the warm-up (limit {100 * max_growth:.0f}%)")
    return out


def padded_past_table(runner: Soak) -> Call:
    """An ``ar`` call whose prompt bucket (128) runs past a 100-position table: only
    padding rows sit there."""
    limit = runner.fixture.target.config.max_position_embeddings
    length = limit - 10
    if bucket(length) <= limit:
        raise ValueError(f"a {length}-token prompt's bucket fits {limit} positions")
    return Call("ar", None, tuple(runner.rng.randrange(VOCAB) for _ in range(length)), 10)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000,
                        help="random calls after the warm-up (default: 2000)")
    parser.add_argument("--buckets", default="16,32",
                        help="prompt buckets; prompts take every length up to the largest "
                             "(default: 16,32)")
    parser.add_argument("--rules", choices=("default", "all"), default="all",
                        help="default: each method's default rule; all: greedy, match and "
                             "rejection too (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")  # as the tests run
    buckets = tuple(int(b) for b in args.buckets.split(","))
    combos = ALL_COMBOS if args.rules == "all" else DEFAULT_COMBOS
    env = machine()
    rss_process_start = rss_bytes()
    started = time.perf_counter()
    llama = build_fixture("llama", 512, seed=args.seed)
    # GPT-2 (learned positions) at a limit that is not a power of two: its last steps
    # draft past the position table.
    gpt2 = build_fixture("gpt2", 100, seed=args.seed, tables=llama.tables)
    fixtures_seconds = time.perf_counter() - started

    def log(message):
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr,
              flush=True)

    log(f"fixtures built in {fixtures_seconds:.1f} s; soaking the Llama target")
    report = soak(llama, args.calls, combos, buckets, args.seed, log)
    log("limits of the GPT-2 target")
    learned = Soak(gpt2, DEFAULT_COMBOS, (16,), args.seed)
    for call in limit_calls(gpt2, learned.rng, ("position",)) + [padded_past_table(learned)]:
        learned.check(call)
    report["gpt2_limit_calls"] = learned.calls
    report["gpt2_limit_failures"] = learned.failures
    report["fixtures_seconds"] = fixtures_seconds
    report["rss_process_start_bytes"] = rss_process_start
    found = problems(report) + [f"GPT-2 limits: {f}" for f in learned.failures]
    record = {"benchmark": "soak", "environment": env,
              "load_average_end": os.getloadavg(),
              "config": {"calls": args.calls, "buckets": list(buckets), "rules": args.rules,
                         "seed": args.seed, "capacity": CAPACITY,
                         "target": dataclasses.asdict(llama.target.config)},
              "passed": not found, "problems": found, **report}
    log(f"{report['calls']} calls in {report['wall_seconds']:.1f} s, "
        f"{report['compiled_programs']} programs, rss "
        f"{report['rss_start_bytes'] / 2**20:.1f} / {report['rss_warm_bytes'] / 2**20:.1f} / "
        f"{report['rss_end_bytes'] / 2**20:.1f} MiB; "
        + ("passed" if not found else "; ".join(found)))
    if args.json:
        write_json(args.json, json.loads(json.dumps(record, default=str)))
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
