"""Kernels per decode step on an H100, counted from programs compiled on this CPU.

Compiles whole generation programs (SmolLM2-135M-shaped, random abstract weights) for a
compile-only H100 through the worker the GPU compile tests use (``tests/gpu_aot.py``:
JAX's CUDA plugin, no GPU), and counts, in the program XLA's GPU compiler built, the
kernel-like operations of one decode step (``profile_step.analyze_program``: fusions,
kernel custom calls, copies, in-place updates; the layer loop's body once and weighted by
its 30 trips), the target layer loop's operations per layer ("-" where the layers are
unrolled: the fused path on a GPU), the Pallas kernels by
backend, the bytes copied per step, the bytes every data-movement fusion writes per step
(slices, pads, transposes: "moved MB") and any cache-sized copy. These are the launches a GPU
would run per step, up to what XLA's runtime groups into CUDA graphs; a profile on the
device (``benchmarks/gpu_run.sh``) measures their time.

Usage (after ``make gpu-compiler``)::

    .venv/bin/python benchmarks/gpu_compile_report.py \\
        --json benchmarks/results/h100-aot/step_counts.json

Programs are greedy (temperature 0) unless ``--temperature`` says otherwise (then every
method but ``ar`` verifies with the coupled rule), with the sampling rule fixed when the
program is traced, as ``generate`` builds it on a GPU; ``--sampling-rules traced`` compiles
every rule with the choice made on the device (``lax.cond``: the column ``cond`` counts
the conditionals in a step, each of which a GPU runs by copying its predicate to the host
and waiting for the device).

Configurations: ``kernel`` (the default ``attn_impl``: the verify-attention kernel, jnp
projections), ``fused`` (``attn_impl="fused"``: row-tiled projection kernels and ordered
attention, Triton), ``fused+qkv`` (the same with q|k|v and gate|up fused at load), and
``fused+qkv mosaic`` (projections in the Mosaic GPU kernel; bf16 only).

Method options: the CPU's defaults unless ``--defaults gpu`` (the abstract weights are on
no device, so a program takes the CPU's defaults; ``gpu`` gives what ``generate`` runs on a
GPU: bigger trees, four ``staged`` draft rounds, a ten-level ``ngram`` proposal; see
``specjax.methods.options.BACKEND_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import gpu_aot  # noqa: E402
from specjax.harness import environment  # noqa: E402

CONFIGS = {
    "kernel": dict(attn_impl="kernel"),
    "fused": dict(attn_impl="fused", gpu_kernels="triton"),
    "fused+qkv": dict(attn_impl="fused", gpu_kernels="triton", fused_projections=True),
    "fused+qkv mosaic": dict(attn_impl="fused", gpu_kernels="mosaic", fused_projections=True),
}
VERIFY = {"ar": None, "ngram": "greedy", "spec": "greedy", "tree": "greedy",
          "staged": "greedy"}
TARGET_LAYERS = 30


def layer_ops(record: dict) -> int | None:
    """Operations per iteration of the target's layer loop (its 30 trips)."""
    loops = [loop for loop in record["step"]["loops"] if loop["trip_count"] == TARGET_LAYERS]
    return loops[0]["ops_per_iteration"] if loops else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,ngram,spec,tree,staged")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sampling-rules", default="static", choices=("static", "traced"))
    parser.add_argument("--defaults", default="cpu", choices=("cpu", "gpu"),
                        help="whose method defaults the programs take")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    jobs = []
    for method in args.methods.split(","):
        if method not in VERIFY:
            parser.error(f"unknown method {method!r}")
        for dtype in args.dtypes.split(","):
            for name in args.configs.split(","):
                if name not in CONFIGS:
                    parser.error(f"unknown configuration {name!r}")
                if "mosaic" in name and dtype == "float32":
                    continue  # the Mosaic GPU kernel takes bf16/fp16 only
                verify = VERIFY[method] if args.temperature == 0 or method == "ar" else "coupled"
                jobs.append(dict(target="h100", method=method, verify=verify,
                                 dtype=dtype, config=name, temperature=args.temperature,
                                 sampling_rules=args.sampling_rules, defaults=args.defaults,
                                 **CONFIGS[name]))
    machine = environment.machine()
    records = gpu_aot.run_worker(jobs)
    print(f"{'method':<8}{'dtype':<10}{'config':<18}{'ok':<4}{'ops/step':>9}{'per layer':>10}"
          f"{'triton':>8}{'mosaic':>8}{'cond':>6}{'copy KB':>9}{'moved MB':>9}{'cache cp':>9}"
          f"{'compile s':>10}")
    failed = False
    for record in records:
        failed |= not record["ok"]
        if not record["ok"]:
            print(f"{record['method']:<8}{record['dtype']:<10}{record['config']:<18}FAILED "
                  f"{record['error'][:200]}")
            continue
        step = record["step"]
        weighted = step["step_ops_weighted_by_kind"]
        record["target_layer_ops"] = layer_ops(record)
        triton = weighted.get("custom-call(__gpu$xla.gpu.triton)", 0)
        mosaic = sum(v for k, v in weighted.items() if "mosaic_gpu" in k)
        print(f"{record['method']:<8}{record['dtype']:<10}{record['config']:<18}{'yes':<4}"
              f"{step['step_ops_weighted']:>9.0f}{record['target_layer_ops'] or '-':>10}"
              f"{triton:>8.0f}{mosaic:>8.0f}{step['step_ops_by_kind'].get('conditional', 0):>6}"
              f"{step['copy_bytes_per_step'] / 1024:>9.1f}"
              f"{step['data_movement_bytes_per_step'] / 1e6:>9.1f}"
              f"{step['cache_sized_copies_per_step']:>9.0f}{record['compile_s']:>10.1f}")
    if args.json:
        environment.write_json(args.json, {
            "benchmark": "kernel-like operations per decode step, compiled for an H100 on "
                         "this CPU (gpu_compile_report.py)",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine, "target": "NVIDIA H100 80GB HBM3 (compile-only device)",
            "model": "smollm2-135m shapes (30 layers); draft: the shipped kind, a one-block "
                     "EAGLE-3 feature draft (tests/tpu_aot.py, program_configs)",
            "method_defaults": args.defaults,
            "records": records})
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
