"""Sharded vs unsharded decoding step on 8 simulated CPU devices (a correctness run).

The 8 devices are one CPU process's threads split 8 ways
(``--xla_force_host_platform_device_count=8``, set here before JAX starts): the sharded
programs run the real partitioned program with its collectives, but over the same cores,
so the times say what partitioning costs on this machine, not what 8 chips would gain.

For each mesh (one device, tensor parallel 2/4/8, data x model 2x4 and 4x2) and each batch
size, a tiny random Llama (``--layers``, ``--hidden``, 8 query and 8 KV heads) generates
``--new-tokens`` tokens greedily with ``ar``, compiled once and run ``--repeats`` times
after a warm-up. The same compiled program is also run with ``max_new_tokens=1`` (a
traced value: the prefill plus one sample), so

    step_ms = (seconds(new_tokens) - seconds(1)) / (new_tokens - 1)

is the time of one batched decoding step; the best of the repeats is reported (other
processes only ever add time), with the ratio to the one-device step of the same batch,
and whether the tokens equal the one-device tokens. JSON with device, versions, commit,
load average and every repeat's seconds::

    python benchmarks/experiments/bench_sharding.py --json benchmarks/results/cpu/bench_sharding.json
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax import models, sharding  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.harness.environment import git_commit, versions, write_json  # noqa: E402

MESHES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2), (8, 1)]  # (data, model)


def tiny_model(layers: int, hidden: int) -> specjax.Model:
    config = ModelConfig(architecture="llama", vocab_size=512, hidden_size=hidden,
                         num_layers=layers, num_heads=8, num_kv_heads=8,
                         head_dim=hidden // 8, intermediate_size=4 * hidden,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    params = models.init_params(config, jax.random.key(0))
    params = jax.tree.map(lambda a: a * 5 if a.ndim > 1 else a, params)  # diverse logits
    return specjax.Model.from_params(config, params, name=f"llama-{layers}x{hidden}")


def timed(model, prompts, new_tokens: int) -> tuple[float, list]:
    out = specjax.generate(model, prompts, max_new_tokens=new_tokens, method="ar",
                           stop=[])
    results = out if isinstance(out, list) else [out]
    return results[0].stats["seconds"], [r.tokens for r in results]


def measure(model, prompts, new_tokens: int, repeats: int) -> dict:
    timed(model, prompts, new_tokens)  # compile + warm up
    timed(model, prompts, 1)
    full, one, tokens = [], [], None
    for _ in range(repeats):  # interleaved, so drift hits both
        seconds, tokens = timed(model, prompts, new_tokens)
        full.append(seconds)
        one.append(timed(model, prompts, 1)[0])
    step_ms = 1e3 * (min(full) - min(one)) / (new_tokens - 1)
    return {"step_ms": step_ms, "seconds_full": full, "seconds_prefill": one,
            "tokens": tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    assert len(jax.devices()) == 8, jax.devices()

    model = tiny_model(args.layers, args.hidden)
    rng = np.random.default_rng(0)
    rows = []
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [rng.integers(0, 512, 12).tolist() for _ in range(batch)]
        prompts = prompts[0] if batch == 1 else prompts
        baseline = None
        for data, model_size in MESHES:
            if batch == 1 and data > 1 and model_size == 1:
                continue
            mesh = sharding.make_mesh(data=data, model=model_size,
                                      devices=jax.devices()[: data * model_size])
            placed = model if data * model_size == 1 else sharding.shard_model(model, mesh)
            result = measure(placed, prompts, args.new_tokens, args.repeats)
            if baseline is None:
                baseline = result
            row = {"batch": batch, "data": data, "model": model_size,
                   "step_ms": round(result["step_ms"], 3),
                   "vs_one_device": round(result["step_ms"] / baseline["step_ms"], 3),
                   "tokens_equal_one_device": result["tokens"] == baseline["tokens"],
                   "seconds_full": result["seconds_full"],
                   "seconds_prefill": result["seconds_prefill"]}
            rows.append(row)
            print(f"batch {batch:2d}  data {data} x model {model_size}: step "
                  f"{row['step_ms']:8.2f} ms  ({row['vs_one_device']:.2f}x one device)  "
                  f"tokens equal: {row['tokens_equal_one_device']}", flush=True)
    report = {
        "benchmark": "bench_sharding", "started": started,
        "device": f"{jax.devices()[0].platform}: 8 simulated devices in one process",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "versions": versions(), **git_commit(),
        "config": {"layers": args.layers, "hidden": args.hidden, "heads": 8, "kv_heads": 8,
                   "vocab": 512, "dtype": "float32", "method": "ar", "greedy": True,
                   "new_tokens": args.new_tokens, "prompt_tokens": 12,
                   "repeats": args.repeats, "xla_flags": os.environ["XLA_FLAGS"]},
        "rows": rows,
    }
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
