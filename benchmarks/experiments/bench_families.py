"""``ar`` speed of the families on the llama forward against Llama at the same size (CPU).

One tiny config per family (hidden 512, 8 layers, 8 query / 4 KV heads of 64, MLP 1536,
vocabulary 32000, random weights), each with its family's features: Qwen3's q/k norms;
Gemma 2's GeGLU, (1 + w) and sandwich norms, scaled embeddings, soft-capping and
alternating 64-token windows; Gemma 3's q/k norms, 5:1 windows and local RoPE; Phi-3's
64-token window in every layer. Sizes are equal so that a family slower than Llama is slow
for its features, not its shapes.

For each family: the compile time of the ``ar`` generation program (the first
``generate``), then ``--rounds`` rounds that run every family once each, interleaved (so
machine drift hits all), each a greedy generation of ``--new-tokens`` tokens after a
16-token prompt (no stop tokens); tokens/s is the best round (other processes only add
time) and its ratio to Llama's. The JSON records device, versions, commit and the load
average at start and end (the CPU is shared).

    python benchmarks/experiments/bench_families.py --json benchmarks/results/cpu/families_ar.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import numpy as np

import specjax
from specjax import models
from specjax.config import ModelConfig
from specjax.harness.environment import machine, write_json

_BASE = dict(architecture="llama", vocab_size=32000, hidden_size=512, num_layers=8,
             num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
             max_position_embeddings=4096, tie_word_embeddings=True)
_GEMMA = dict(norm_plus_one=True, hidden_act="gelu_tanh", embed_scale=True,
              sandwich_norms=True)
FAMILIES = {
    "llama": {},
    "qwen3": dict(family="qwen3", qk_norm=True),
    "gemma2": dict(family="gemma2", attn_softcap=50.0, final_softcap=30.0,
                   layer_windows=(64, 0), **_GEMMA),
    "gemma3": dict(family="gemma3_text", qk_norm=True, layer_windows=(64,) * 5 + (0,),
                   local_rope_theta=10000.0, rope_theta=1000000.0, **_GEMMA),
    "phi3": dict(family="phi3", layer_windows=(64,), tie_word_embeddings=False),
}


def family_model(name: str) -> specjax.Model:
    config = ModelConfig(**{**_BASE, **FAMILIES[name]})
    params = models.init_params(config, jax.random.key(0))
    # Matrices at 0.2 (not 0.02) so that logits spread and tokens vary.
    params = jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, params)
    return specjax.Model.from_params(config, params, name=f"tiny-{name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/cpu/families_ar.json")
    args = parser.parse_args()
    env = machine()
    prompt = np.random.default_rng(0).integers(0, 32000, 16).tolist()
    run = dict(max_new_tokens=args.new_tokens, method="ar", stop=[])
    family_models = {name: family_model(name) for name in FAMILIES}
    rows = {}
    for name, model in family_models.items():
        out = specjax.generate(model, prompt, **run)
        rows[name] = {"config": dataclasses.asdict(model.config),
                      "compile_seconds": out.stats["compile_seconds"],
                      "attention_fallback": out.stats.get("attention_fallback"),
                      "rounds_tokens_per_s": []}
    for _ in range(args.rounds):
        for name, model in family_models.items():
            start = time.perf_counter()
            out = specjax.generate(model, prompt, **run)
            seconds = time.perf_counter() - start
            assert out.stats["compile_seconds"] == 0.0, name
            rows[name]["rounds_tokens_per_s"].append(len(out.tokens) / seconds)
    for row in rows.values():
        row["tokens_per_s"] = max(row["rounds_tokens_per_s"])
    for row in rows.values():
        row["vs_llama"] = row["tokens_per_s"] / rows["llama"]["tokens_per_s"]
    result = {"benchmark": "bench_families", "machine": env,
              "load_average_end": os.getloadavg(),
              "settings": {"new_tokens": args.new_tokens, "rounds": args.rounds,
                           "prompt_tokens": len(prompt), "method": "ar", "dtype": "float32"},
              "families": rows}
    write_json(args.json, result)
    for name, row in rows.items():
        print(f"{name:7s} {row['tokens_per_s']:7.1f} tok/s  x{row['vs_llama']:.2f} vs llama  "
              f"compile {row['compile_seconds']:.1f} s")


if __name__ == "__main__":
    main()
