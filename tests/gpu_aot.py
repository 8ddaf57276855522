"""Ahead-of-time compilation for an NVIDIA H100 on a machine without a GPU.

JAX's CUDA PJRT plugin (``jax-cuda12-pjrt``, with ``jax-cuda12-plugin``) holds XLA's GPU
compiler, and with it the Triton and Mosaic GPU kernel compilers. Given a GPU description
(the ``GpuTargetConfig`` below, an H100 SXM's numbers) ``jax.experimental.topologies``
makes a *compile-only* device: a jitted function lowers and compiles for sm_90 on the CPU,
and ``.compile()`` raises what the GPU compilers raise (shared memory over the limit, a
Triton or Mosaic GPU error). Compiling is not running: numerics stay with the interpreter
tests, and timings with a real GPU (``benchmarks/gpu_run.sh``).

What this adds over the CPU counts of ``benchmarks/profile_step.py``: the compiled program
is the one XLA builds *for the GPU* (its fusions, copies and kernel custom calls), so the
kernel-like operations per decode step counted in it are the launches a GPU would run, up
to what XLA's runtime merges (command buffers) or a profile shows as memcpys.

This module is the worker the compile tests (``tests/test_gpu_compile.py``) and
``benchmarks/gpu_compile_report.py`` run in a subprocess, with ``JAX_PLATFORMS=cpu`` and
the plugin on ``PYTHONPATH``, so the rest of the suite never loads the CUDA plugin::

    python tests/gpu_aot.py JOBS.json OUT.json
    python tests/gpu_aot.py --requirement     # the pinned plugin packages, for pip
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where `make gpu-compiler` installs the plugin (pip --target), outside the main environment:
# in the venv, every JAX process would look for a GPU and log that it found none.
COMPILER_DIR_ENV = "SPECJAX_GPU_COMPILER"
DEFAULT_COMPILER_DIR = ROOT / ".venv" / "gpu-compiler"
PLUGIN_PACKAGES = ("jax-cuda12-pjrt", "jax-cuda12-plugin")  # pinned to the installed jax

# An H100 SXM (80 GB HBM3) as XLA describes one: what the compiler tunes and checks for.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TARGETS = {"h100": H100_TARGET_CONFIG}


# ----------------------------------------------------------------------------- parent side


def requirements() -> list[str]:
    """The plugin packages pinned to the installed jax (a plugin is built for one jaxlib)."""
    import importlib.metadata

    version = importlib.metadata.version("jaxlib")
    return [f"{name}=={version}" for name in PLUGIN_PACKAGES]


def find_compiler() -> tuple[str | None, str]:
    """(a PYTHONPATH entry holding the CUDA plugin; None when absent, with the reason)."""
    for path in filter(None, [os.environ.get(COMPILER_DIR_ENV), str(DEFAULT_COMPILER_DIR)]):
        if (Path(path) / "jax_plugins" / "xla_cuda12").is_dir():
            return path, ""
    return None, (f"the CUDA compiler plugin is not installed: `make gpu-compiler` puts it in "
                  f"{DEFAULT_COMPILER_DIR.relative_to(ROOT)} (or set {COMPILER_DIR_ENV}); "
                  f"`make test-gpu` installs it and runs these tests")


def run_worker(jobs: list[dict], *, timeout: float = 1800) -> list[dict]:
    """Runs ``jobs`` in one subprocess (``JAX_PLATFORMS=cpu``, the plugin on the path).

    Raises:
      RuntimeError: the plugin is missing, or the worker died (its output tail included).
    """
    path, reason = find_compiler()
    if path is None:
        raise RuntimeError(reason)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    import tpu_aot  # this folder: the shared parent side

    return tpu_aot.run_jobs(Path(__file__), jobs, env, timeout=timeout,
                            what="GPU compile worker")


# ----------------------------------------------------------------------------- worker side


def _sharding(target: str):
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target],
                                            topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def _compile_kernels_for_gpu() -> None:
    """Makes attention ``"kernel"``/``"fused"`` pick the GPU kernels, compiled (the
    dispatcher chooses from ``jax.default_backend()``, the CPU in this process)."""
    from specjax import kernels

    kernels.select_variant = lambda variant=None, interpret_variant="gpu": ("gpu", False)


def kernel_counts(text: str) -> dict[str, int]:
    """Custom calls in a compiled program's HLO, by target (the Pallas kernels are
    ``__gpu$xla.gpu.triton`` and ``mosaic_gpu...``; cuBLAS/cuDNN calls have their own)."""
    counts: dict[str, int] = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', text):
        counts[target] = counts.get(target, 0) + 1
    return counts


def _cache_shapes(compiled, job: dict) -> list[tuple[int, ...]]:
    """The KV cache shapes [L, S, K, D] of the job's generation: the target's and, for the
    draft methods, the draft's (:func:`tpu_aot.program_configs`), S read from the compiled
    program."""
    import profile_step
    import tpu_aot

    capacity = profile_step._capacity(compiled)
    configs = tpu_aot.program_configs(job["method"], family=job.get("family"),
                                      draft=job.get("draft"))
    return [(c.num_layers, capacity, c.num_kv_heads, c.head_dim) for c in configs if c]


def canary(sharding):
    """A kernel the GPU compiler must refuse: the Mosaic GPU linear kernel at a tiling whose
    shared memory (~253 KiB) is over the H100's 227 KiB, its own check switched off. Proves
    that compiler errors reach us."""
    import jax
    import jax.numpy as jnp

    from specjax.kernels import linear_mosaic_gpu

    linear_mosaic_gpu.SMEM_LIMIT = 1 << 30
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)  # noqa: E731
    sizes = linear_mosaic_gpu.MosaicGpuLinearBlockSizes(256)
    fn = jax.jit(lambda x, w: linear_mosaic_gpu.fused_linear_mosaic_gpu(
        x, (w, w), offsets=(0, 512), width=512, float32_out=True, block_sizes=sizes))
    return fn, (sds(5, 576), sds(576, 1024))


def run_job(job: dict) -> dict:
    """Lowers and compiles one job for its target; never raises.

    Job: ``{"kind": "canary"}`` (:func:`canary`), or ``{"target": "h100", "method",
    "verify", "dtype", "attn_impl", "gpu_kernels", "fused_projections", "temperature",
    "sampling_rules", "defaults", "family", "draft"}`` (a whole generation program as
    ``generate`` builds it on a GPU, SmolLM2-135M-shaped, :func:`tpu_aot.build_generation_program`;
    ``defaults``: whose method defaults, ``cpu`` unless given; ``draft``: the shipped kind
    unless given, :func:`tpu_aot.program_configs`). The record adds ``ok``,
    ``error``, the lower and compile seconds, the fallbacks recorded while tracing (all,
    and those not row-independent: :mod:`specjax.kernels.fallbacks`), the kernel custom
    calls (:func:`kernel_counts`) and :func:`profile_step.analyze_program`'s per-step
    counts.
    """
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_step
    import tpu_aot

    record = dict(job, ok=False, error=None)
    try:
        sharding = _sharding(job.get("target", "h100"))
        if job.get("kind") == "canary":
            fn, args = canary(sharding)
            start = time.perf_counter()
            fn.lower(*args).compile()
            record["ok"] = True
            return record
        _compile_kernels_for_gpu()
        # On a GPU, generate fixes the sampling rule when tracing (one program per rule);
        # the abstract weights are on no device, so say so. ``gpu_kernels``: the linear
        # kernel's backend (triton/mosaic).
        fn, args = tpu_aot.build_generation_program(
            job["method"], verify=job.get("verify"), dtype=job.get("dtype", "bfloat16"),
            attn_impl=job.get("attn_impl", "kernel"),
            fused_projections=job.get("fused_projections", False),
            temperature=job.get("temperature", 0.0), defaults=job.get("defaults", "cpu"),
            family=job.get("family"), sampling_rules=job.get("sampling_rules", "static"),
            gpu_linear=job.get("gpu_kernels", "triton"), draft=job.get("draft"))
        from specjax.kernels import fallbacks

        start = time.perf_counter()
        with fallbacks.collecting() as reasons:  # recorded while the program is traced
            lowered = fn.lower(*tpu_aot._abstract(args, sharding))
        record["lower_s"] = round(time.perf_counter() - start, 3)
        record["fallbacks"] = sorted(str(reason) for reason in reasons)
        record["unordered_fallbacks"] = sorted(str(reason) for reason in reasons
                                               if not reason.row_independent)
        compiled = tpu_aot.compile_timed(lowered, record)
        text = compiled.as_text()
        record["kernels"] = kernel_counts(text)
        record["cache_shapes"] = _cache_shapes(compiled, job)
        analysis = profile_step.analyze_program(text, cache_shapes=record["cache_shapes"])
        record["step"] = {k: analysis[k] for k in (
            "step_ops", "step_ops_weighted", "step_ops_by_kind", "step_ops_weighted_by_kind",
            "loops", "copies", "copy_bytes_per_step", "largest_copies",
            "data_movement_bytes_per_step", "largest_data_movements",
            "cache_sized_copies_per_step", "cache_copies",
            "cache_writes", "donated_parameters")}
        record["ok"] = True
    except Exception as error:  # noqa: BLE001 -- the record carries it to the test
        record["error"] = f"{type(error).__name__}: {error}"[:4000]
        if not isinstance(error, jax.errors.JaxRuntimeError):
            record["traceback"] = traceback.format_exc()[-3000:]
    return record


def main(argv: list[str]) -> int:
    if argv == ["--requirement"]:  # for `make gpu-compiler`
        print(" ".join(requirements()))
        return 0
    jobs_file, out_file = argv[:2]
    import jax

    if jax.default_backend() != "cpu":
        print("the GPU compile worker runs with JAX_PLATFORMS=cpu", file=sys.stderr)
        return 3
    records = []
    for job in json.loads(Path(jobs_file).read_text()):
        record = run_job(job)
        records.append(record)
        print(json.dumps({k: record.get(k) for k in ("method", "dtype", "attn_impl",
                                                     "gpu_kernels", "ok", "compile_s")}),
              flush=True)
    Path(out_file).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
