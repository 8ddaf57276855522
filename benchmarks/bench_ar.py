"""Autoregressive decoding speed: specjax vs transformers, and while_loop overhead.

For each HumanEval prompt, in one process and interleaved so that machine drift hits both:

* specjax ``ar``: ``specjax.generate`` (one compiled program: prefill + ``lax.while_loop``),
  greedy, ``--max-new-tokens`` tokens exactly (stop tokens disabled);
* the same compiled program with ``max_new_tokens=1`` (a traced value: same executable,
  same cache capacity), which is the prefill plus the first sample;
* transformers ``generate(do_sample=False)`` on the same GGUF weights (PyTorch, same dtype),
  stop tokens disabled without suppressing EOS, with PyTorch's faster thread count (1 or
  all cores, probed before each run: OpenMP threads collapse when another process shares
  the cores);
* the bare jitted one-token forward + argmax, cache donated, at the mid-generation cache
  length and the same cache capacity: the floor for the loop's per-token time.

Derived per prompt:

* ``tokens_per_s``: new tokens / wall seconds of the whole generation, prefill included,
  for both specjax and transformers (what a user sees); compile time is excluded and
  reported apart;
* ``loop_per_token_ms = (seconds - prefill_seconds) / (new_tokens - 1)`` and
  ``loop_overhead = loop_per_token / bare_step - 1``: what the while_loop, the sampler and
  the bookkeeping add to one forward.

Each prompt is measured in ``--repeats`` rounds that interleave all four measurements, and
each number is the best over rounds (other processes only ever add time); rows (with every
round's seconds) and medians over prompts go to the JSON file with device, versions, commit
and load average.

    python benchmarks/bench_ar.py --limit 8 --max-new-tokens 128 --json benchmarks/results/ar_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import specjax
from specjax import api, decode, models
from specjax.cache import init_cache
from specjax.harness.environment import git_commit, versions, write_json
from specjax.harness.peers import fastest_torch_threads
from specjax.humaneval import humaneval_prompts


# What is timed: ``ar`` by name (a known model's default method is ``spec``), exactly
# ``max_new_tokens`` tokens (no stop tokens), greedy.
AR = dict(method="ar", stop=[])


def ar_program(model, ids: list[int], budget: int):
    """The loop and arguments of ``specjax.generate(model, ids, max_new_tokens=budget,
    **AR)``, built by the function ``generate`` builds them with, so that the same
    executable can be run with a smaller (traced) ``max_new_tokens``."""
    request = api._prepare(model, ids, api.request(
        backend=api.model_backend(model), assets=model.assets, max_new_tokens=budget, **AR))
    return request.loop, request.args


def prefill_seconds(loop, args) -> tuple[int, float]:
    """Runs the generation program with max_new_tokens=1; returns (new tokens, seconds)."""
    params, prompt, length, _, *rest = args
    state, compile_seconds, seconds = decode.run_program(params, loop, prompt, length,
                                                         jnp.int32(1), *rest)
    assert compile_seconds == 0.0, "the prefill run must reuse the generation's executable"
    return int(state.length - state.prompt_length), seconds


def bare_step_seconds(model, cache_length: int, capacity: int, repeats: int = 30) -> float:
    """Median seconds of the jitted one-token forward + argmax, cache donated and updated
    in place as in the while_loop, at a fixed cache length."""

    def step(params, cache, token, position):
        logits, cache = models.forward(params, model.config, token, position, cache)
        return jnp.argmax(logits[0]).astype(jnp.int32)[None], cache

    step = jax.jit(step, donate_argnums=1)
    cache = init_cache(model.config, capacity, model.params["embed"].dtype)
    cache = cache.replace(length=jnp.int32(cache_length))
    token, position = jnp.array([1], jnp.int32), jnp.array([cache_length], jnp.int32)
    for _ in range(3):  # compile and warm up
        token, cache = step(model.params, cache, token, position)
    jax.block_until_ready(token)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        token, cache = step(model.params, cache, token, position)
        jax.block_until_ready(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_transformers_twin(gguf_path: str, dtype: str):
    import torch
    import transformers

    folder, name = os.path.split(gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()


def transformers_generate(hf_model, ids: list[int], max_new_tokens: int):
    """Greedy, exactly ``max_new_tokens`` tokens: EOS is not a stop token (and, unlike
    ``min_new_tokens``, it is not suppressed either)."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        out = hf_model.generate(torch.tensor([ids]),
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        seconds = time.perf_counter() - start
    return out[0, len(ids):].tolist(), seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=8, help="number of HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-transformers", action="store_true", help="skip the PyTorch peer")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="PyTorch threads; 0 (default): before each transformers run, "
                             "probe 1 and all cores and keep the faster")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2 (the loop needs a step after the prefill)")

    from specjax.checkpoints_tools.sources import known_model_path

    load_average_start = os.getloadavg()
    start = time.perf_counter()
    model = specjax.load(args.model, dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    prompts = humaneval_prompts(args.limit)
    hf_model = None
    thread_candidates = [args.torch_threads] if args.torch_threads else sorted(
        {1, os.cpu_count() or 1})
    if not args.no_transformers:
        import torch

        hf_model = load_transformers_twin(str(known_model_path(args.model)), args.dtype)
        fastest_torch_threads(hf_model, thread_candidates)
        transformers_generate(hf_model, model.tokenizer(prompts[0])["input_ids"], 4)  # warm-up

    # First call: compile the program for the first prompt's bucket and capacity.
    first = specjax.generate(model, prompts[0], max_new_tokens=args.max_new_tokens, **AR)
    compile_seconds = first.stats["compile_seconds"]
    print(f"first-call compile {compile_seconds:.1f} s", file=sys.stderr)

    rows = []
    n = args.max_new_tokens
    for i, prompt in enumerate(prompts):
        ids = model.tokenizer(prompt)["input_ids"]
        loop, program_args = ar_program(model, ids, n)
        # Rounds interleave every measurement, so a burst of load from other processes
        # hits all of them; each number is then the best over rounds.
        runs: dict[str, list] = {"ours": [], "prefill": [], "bare": [], "theirs": []}
        threads, compile_here = [], 0.0
        for _ in range(args.repeats):
            ours = specjax.generate(model, ids, max_new_tokens=n, **AR)
            assert ours.stats["new_tokens"] == n and ours.stats["method"] == "ar"
            runs["ours"].append(ours.stats["seconds"])  # compile time excluded
            compile_here = max(compile_here, ours.stats["compile_seconds"])
            count, prefill = prefill_seconds(loop, program_args)
            assert count == 1
            runs["prefill"].append(prefill)
            runs["bare"].append(bare_step_seconds(model, len(ids) + n // 2, loop.capacity))
            if hf_model is not None:
                probe = fastest_torch_threads(hf_model, thread_candidates)
                threads.append({"threads": torch.get_num_threads(), "probe_ms": probe})
                theirs, hf_seconds = transformers_generate(hf_model, ids, n)
                runs["theirs"].append(hf_seconds)
        seconds, prefill, bare = min(runs["ours"]), min(runs["prefill"]), min(runs["bare"])
        loop_per_token = (seconds - prefill) / (n - 1)
        row = {"prompt": i, "prompt_tokens": len(ids), "prompt_bucket": loop.prompt_bucket,
               "cache_capacity": loop.capacity, "new_tokens": n,
               "specjax_seconds": seconds, "specjax_tokens_per_s": n / seconds,
               "specjax_compile_seconds": compile_here, "prefill_ms": 1e3 * prefill, "loop_per_token_ms": 1e3 * loop_per_token,
               "bare_step_ms": 1e3 * bare, "loop_overhead": loop_per_token / bare - 1.0,
               "runs_seconds": runs}
        if hf_model is not None:
            hf_seconds = min(runs["theirs"])
            row["transformers_seconds"] = hf_seconds
            row["transformers_tokens_per_s"] = n / hf_seconds
            row["transformers_threads"] = threads
            row["speedup_vs_transformers"] = hf_seconds / seconds
            mismatch = next((j for j, (a, b) in enumerate(zip(ours.tokens, theirs)) if a != b),
                            None)
            row["outputs_identical"] = mismatch is None and len(theirs) == n
            row["first_mismatch"] = mismatch
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("runs_seconds", "transformers_threads")}), file=sys.stderr)

    def median(key):
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    result = {
        "benchmark": "ar",
        "command": " ".join([os.path.relpath(sys.argv[0])] + (argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_start": load_average_start,
        "load_average_end": os.getloadavg(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "torch_thread_candidates": None if hf_model is None else thread_candidates,
        "versions": versions(),
        "git": git_commit(),
        "config": vars(args),
        "model_load_seconds": load_seconds,
        "first_call_compile_seconds": compile_seconds,
        "median": {k: median(k) for k in (
            "specjax_tokens_per_s", "transformers_tokens_per_s", "speedup_vs_transformers",
            "prefill_ms", "loop_per_token_ms", "bare_step_ms", "loop_overhead")},
        "all_outputs_identical": all(r.get("outputs_identical", True) for r in rows),
        "rows": rows,
    }
    print(json.dumps(result["median"], indent=1))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
