"""Verify/decode attention: Pallas kernel vs the XLA reference, time and HBM bandwidth.

On a GPU (or TPU) machine, from the repository root, installed or not:

    python benchmarks/bench_kernels.py                 # -> benchmarks/results/kernels_<device>.json

It first checks the kernel against ``attention_reference`` on the device (bf16 and fp32,
trees and a scratch window, a stacked [L, S, K, D] cache read by layer index, Gemma's
sliding windows and soft-capping at its head sizes), then times
one layer's attention, kernel vs jitted reference, for cache lengths 512/2048/8192 and
N = 1/16/64 new tokens (tree nodes) in bf16, on SmolLM2-like heads (H=9, K=3, D=64) and
Llama-7B-like heads (H=32, K=8 and K=32, D=128).

Timing measures the kernels, not Python dispatch: one jitted program chains ``--inner``
calls (each call's output is the next call's queries, so XLA can neither merge nor hoist
them, and no host round trip separates them), its time is divided by ``--inner``, and the
median over ``--repeats`` runs is taken after a warm-up (compile) run. ``--device-time``
also reads the device time per call from a :mod:`jax.profiler` trace (the kernels'
durations summed, launch gaps excluded). Bandwidth is the K/V bytes a call must read,
``2 * length * K * D * itemsize``, over that time, against the device's peak HBM
bandwidth where known. The reference scores the whole cache capacity (``--headroom`` slots
past the length) under a mask, as the model's CPU path does.

``--sweep`` times the GPU kernel's tilings: ``block_rows`` 16/32/64 x ``num_warps`` 4/8 x
float32/bfloat16 (``--sweep-rows``, ``--sweep-warps``, ``--sweep-dtypes``), each checked
against the reference first, with the N = 1 call of the same tiling as the baseline of
each row (``vs_one_token``): the tree call should cost at most ~1.2x the one-token call.

On a CPU, ``--interpret --quick`` runs the same pipeline on tiny sizes with the kernel in
interpret mode: a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax.attention import attention_reference  # noqa: E402
from specjax.harness import environment  # noqa: E402
from specjax.tree import ancestor_mask, kary_parents  # noqa: E402

try:
    from specjax import kernels  # installed: kernels/ is specjax.kernels
except ImportError:  # a bare checkout: the same package as the top-level ``kernels``
    import kernels  # type: ignore[no-redef]

# Peak HBM bandwidth in bytes/s by device_kind substring (first match wins).
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("GH200", 4.0e12),
    ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 2.039e12),
    ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("RTX 4090", 1.008e12),
    ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12), ("TPU v5p", 2.765e12),
    ("TPU v6", 1.64e12), ("TPU v4", 1.2e12),
]
SHAPES = {  # name: (query heads H, KV heads K, head_dim D)
    "smollm2": (9, 3, 64),
    "llama7b-gqa": (32, 8, 128),
    "llama7b-mha": (32, 32, 128),
}
QUICK_SHAPES = {"tiny-gqa": (4, 2, 64), "tiny-g3": (6, 2, 64)}


@dataclasses.dataclass(frozen=True)
class Problem:
    shape: str
    heads: int
    kv_heads: int
    head_dim: int
    length: int
    nodes: int
    capacity: int
    dtype: str
    window: int = 0
    layers: int = 0  # > 0: a stacked [layers, S, K, D] cache, the last layer read
    sliding: int = 0  # > 0: a sliding window of this many positions (Gemma, Mistral, Phi-3)
    softcap: float = 0.0  # > 0: Gemma 2's attention soft-capping


def peak_bandwidth(device_kind: str) -> float | None:
    for name, peak in PEAK_BANDWIDTH:
        if name.lower() in device_kind.lower():
            return peak
    return None


def make_inputs(problem: Problem, seed: int = 0):
    """Random q/k/v, a k-ary tree mask (causal chain for N <= 2), NaN past the readable slots."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(problem.dtype)
    t, h, k, d = problem.nodes, problem.heads, problem.kv_heads, problem.head_dim

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    parents = np.asarray(kary_parents(4, 8, t) if t > 2 else np.arange(t) - 1, np.int32)
    mask = ancestor_mask(jnp.asarray(parents), jnp.ones(t, bool))
    scratch = jnp.asarray(rng.random((t, problem.window)) < 0.5) if problem.window else None
    shape = (problem.layers, problem.capacity, k, d) if problem.layers else \
        (problem.capacity, k, d)
    k_cache, v_cache = normal(*shape), normal(*shape)
    return (normal(t, h, d), normal(t, k, d), normal(t, k, d), k_cache, v_cache,
            jnp.int32(problem.length), mask, scratch)


def window_options(problem: Problem, mask) -> dict:
    """The kernel's and the reference's ``softcap`` and ``first_visible`` for ``problem``:
    node ``t`` at position ``length + depth(t)`` sees the ``sliding`` positions up to its
    own (a tree shallower than the window: the mask among the nodes needs no change)."""
    options = {}
    if problem.softcap:
        options["softcap"] = problem.softcap
    if problem.sliding:
        depth = jnp.sum(mask, axis=1).astype(jnp.int32) - 1  # ancestors seen, self excluded
        options["first_visible"] = problem.length + depth - problem.sliding + 1
    return options


def kernel_function(variant: str, interpret: bool, block_sizes):
    """The kernel as ``f(q, k_new, v_new, k_cache, v_cache, length, mask, scratch, *, layer,
    softcap=, first_visible=)``."""
    options = {"interpret": interpret}
    if block_sizes is not None:
        options["block_sizes"] = block_sizes
    if variant == "gpu":
        function = kernels.verify_attention_gpu
    else:
        function = kernels.verify_attention_tpu
    return lambda *args, layer=None, **extras: function(*args, **options, **extras, **(
        {} if layer is None else {"layer": layer}))


def reference_function():
    return lambda *args, layer=None: attention_reference(*args, layer=layer)


def check(problem: Problem, kernel, tolerance: float) -> dict:
    """Max abs error of the kernel vs the reference; slots past the readable ones are NaN
    (in every layer of a stacked cache but the one read, all of it is NaN)."""
    args = make_inputs(problem, seed=1)
    readable = problem.length + problem.window
    layer = problem.layers - 1 if problem.layers else None
    slots = (slice(None), slice(readable, None)) if problem.layers else (slice(readable, None),)
    poisoned = [c.at[slots].set(jnp.nan) for c in args[3:5]]
    clean = [c.at[slots].set(0) for c in args[3:5]]
    if problem.layers:
        poisoned = [c.at[:layer].set(jnp.nan) for c in poisoned]
    extras = window_options(problem, args[6])
    run = jax.jit(lambda *a: kernel(*a, layer=layer, **extras))
    out = run(*args[:3], *poisoned, *args[5:]).astype(jnp.float32)
    expected = jax.jit(lambda *a: attention_reference(*a, layer=layer, **extras))(
        *args[:3], *clean, *args[5:]).astype(jnp.float32)
    error = float(jnp.max(jnp.abs(out - expected)))
    ok = bool(jnp.all(jnp.isfinite(out))) and error <= tolerance
    return {**dataclasses.asdict(problem), "max_abs_error": error, "tolerance": tolerance,
            "ok": ok}


def chained(function, inner: int):
    """A jitted program running ``function`` ``inner`` times, each call's output [T, H, D]
    fed back as the next call's queries (a data dependency: no call can be merged with
    another or hoisted, and all run back to back on the device with no host in between)."""

    def run(q, *rest):
        for _ in range(inner):
            q = function(q, *rest).astype(q.dtype)
        return q

    return jax.jit(run)


def time_call(function, args, inner: int, repeats: int) -> float:
    """Median seconds per call of ``function``, from ``inner`` chained calls per run."""
    program = chained(function, inner)
    jax.block_until_ready(program(*args))  # compile + warm up
    jax.block_until_ready(program(*args))
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        rounds.append((time.perf_counter() - start) / inner)
    return statistics.median(rounds)


def device_time_call(function, args, inner: int) -> dict | None:
    """Device microseconds per call (kernels summed) and kernels per call, from a trace of
    one chained run; ``None`` when the trace holds no device kernels (a CPU)."""
    import tempfile

    import profile_step  # benchmarks/ is this script's directory

    program = chained(function, inner)
    jax.block_until_ready(program(*args))
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as folder:
        with jax.profiler.trace(folder):
            jax.block_until_ready(program(*args))
        kind, events, _ = profile_step.kernel_events(profile_step.read_trace(folder))
    if kind != "device" or not events:
        return None
    summary = profile_step.summarize_kernels(events)
    return {"device_us": summary["us"] / inner, "kernels_per_call": summary["count"] / inner,
            "by_kernel_us": {name: us / inner for name, us in summary["by_name"].most_common(5)}}


def problems(args) -> tuple[list[Problem], list[Problem]]:
    """(correctness checks, timed problems)."""
    shapes = QUICK_SHAPES if args.quick else SHAPES
    lengths = [int(x) for x in args.lengths.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    timed = [Problem(name, *shape, length, n, length + args.headroom, args.dtype)
             for name, shape in shapes.items() for length in lengths for n in nodes]
    first, (h, k, d) = next(iter(shapes.items()))
    last, (h2, k2, d2) = list(shapes.items())[-1]
    small = min(lengths)
    checks = [
        Problem(first, h, k, d, small + 3, 1, small + 64, "bfloat16"),
        Problem(first, h, k, d, small - 5, max(nodes), small + 64, "bfloat16", window=4),
        Problem(last, h2, k2, d2, max(lengths) - 7, 16 if not args.quick else 4,
                max(lengths) + 64, "bfloat16"),
        Problem(last, h2, k2, d2, small + 1, 5, small + 64, "float32", window=3),
        Problem(first, h, k, d, 0, 3, 64, "float32", window=2),
        # The model's call: a stacked cache read by layer index, a many-row tree.
        Problem(first, h, k, d, small + 9, max(nodes), small + 64, "float32", window=3,
                layers=3),
        Problem(first, h, k, d, small + 9, 1, small + 64, "bfloat16", layers=3),
        # Gemma 3's heads (4 / 1 of 256) with a sliding window a quarter of the shortest
        # length, and Gemma 2's (8 / 4 of 256) with soft-capping too and a scratch window.
        Problem("gemma3-sliding", 4, 1, 256, max(lengths) - 7, max(nodes), max(lengths) + 64,
                "bfloat16", layers=3, sliding=small // 4),
        Problem("gemma2-capped-sliding", 8, 4, 256, small + 9, 5, small + 64, "float32",
                window=3, sliding=small // 4, softcap=50.0),
        # Phi-3's heads (32 / 32 of 96: the cache's 96 columns in 128-wide tiles).
        Problem("phi3-d96", 32, 32, 96, max(lengths) - 7, 16 if not args.quick else 4,
                max(lengths) + 64, "bfloat16", layers=3),
    ]
    return checks, timed


def sweep(args, variant: str, interpret: bool, peak) -> list[dict]:
    """Times the GPU kernel's tilings (block_rows x num_warps x dtype) on the first shape.

    Each tiling is checked against the reference first (a failed check is recorded and its
    timings skipped); each row holds kernel microseconds per call for every N and length,
    and ``vs_one_token``: the call's time over the N = 1 call of the same tiling and length.
    """
    shapes = QUICK_SHAPES if args.quick else SHAPES
    name, (heads, kv_heads, head_dim) = next(iter(shapes.items()))
    lengths = [int(x) for x in args.lengths.split(",")]
    nodes = sorted({1, *[int(x) for x in args.nodes.split(",")]})
    rows = []
    for dtype in args.sweep_dtypes.split(","):
        for block_rows in [int(x) for x in args.sweep_rows.split(",")]:
            for num_warps in [int(x) for x in args.sweep_warps.split(",")]:
                sizes = kernels.GpuBlockSizes(block_rows=block_rows, num_warps=num_warps,
                                              block_kv=args.block_kv or 64,
                                              num_splits=args.num_splits)
                kernel = kernel_function(variant, interpret, sizes)
                tile = {"block_rows": block_rows, "num_warps": num_warps, "dtype": dtype}
                probe = Problem(name, heads, kv_heads, head_dim, min(lengths) - 3, max(nodes),
                                min(lengths) + 64, dtype, window=2, layers=2)
                verdict = check(probe, kernel, 1e-4 if dtype == "float32" else 3e-2)
                print(f"sweep {tile}: check max abs error {verdict['max_abs_error']:.2e} "
                      f"{'ok' if verdict['ok'] else 'FAILED'}", flush=True)
                if not verdict["ok"]:
                    rows.append({**tile, "check": verdict, "timings": []})
                    continue
                timings = []
                for length in lengths:
                    base = None
                    for n in nodes:
                        problem = Problem(name, heads, kv_heads, head_dim, length, n,
                                          length + args.headroom, dtype)
                        inputs = make_inputs(problem)
                        seconds = time_call(kernel, inputs, args.inner, args.repeats)
                        base = seconds if n == 1 else base
                        row = {"length": length, "nodes": n, "kernel_us": 1e6 * seconds,
                               "vs_one_token": seconds / base}
                        if args.device_time:
                            row["device"] = device_time_call(kernel, inputs, args.inner)
                        timings.append(row)
                        print(f"  {dtype} rows={block_rows} warps={num_warps} len={length} "
                              f"N={n}: {1e6 * seconds:.1f} us ({seconds / base:.2f}x N=1)",
                              flush=True)
                rows.append({**tile, "check": verdict, "timings": timings})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["gpu", "tpu"], default=None,
                        help="kernel; default: the backend's (gpu off a TPU)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernel in interpret mode (any backend; slow)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--lengths", default=None, help="cache lengths (default 512,2048,8192)")
    parser.add_argument("--nodes", default=None, help="new tokens N (default 1,16,64)")
    parser.add_argument("--headroom", type=int, default=128,
                        help="cache capacity = length + headroom")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20)")
    parser.add_argument("--inner", type=int, default=None, help="calls per round (default 10)")
    parser.add_argument("--block-kv", type=int, default=None)
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--block-rows", type=int, default=None)
    parser.add_argument("--num-warps", type=int, default=None)
    parser.add_argument("--device-time", action="store_true",
                        help="also read device time per call from a profiler trace")
    parser.add_argument("--sweep", action="store_true",
                        help="GPU kernel: time block_rows x num_warps x dtype tilings")
    parser.add_argument("--sweep-rows", default="16,32,64")
    parser.add_argument("--sweep-warps", default="4,8")
    parser.add_argument("--sweep-dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None,
                        help="output path (default benchmarks/results/kernels_<device>.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths = args.lengths or "40,100"
        args.nodes = args.nodes or "1,4"
        args.repeats = args.repeats or 2
        args.inner = args.inner or 2
    args.lengths = args.lengths or "512,2048,8192"
    args.nodes = args.nodes or "1,16,64"
    args.repeats = args.repeats or 20
    args.inner = args.inner or 10

    backend = jax.default_backend()
    variant = args.variant or ("tpu" if backend == "tpu" else "gpu")
    interpret = args.interpret or backend != variant
    if interpret and not args.interpret:
        parser.error(f"the {variant} kernel cannot run natively on backend {backend!r}; "
                     "pass --interpret (with --quick on a CPU)")
    device = jax.devices()[0]
    peak = peak_bandwidth(device.device_kind)
    print(f"device_kind: {device.device_kind}  backend: {backend}  jax {jax.__version__}  "
          f"kernel: {variant}{' (interpret)' if interpret else ''}  "
          f"peak HBM: {peak / 1e12 if peak else 'unknown'} TB/s", flush=True)

    block_sizes = None
    if args.block_kv or args.num_splits or args.block_rows or args.num_warps:
        cls = kernels.GpuBlockSizes if variant == "gpu" else kernels.TpuBlockSizes
        defaults = cls()
        changes = dict(block_kv=args.block_kv or defaults.block_kv,
                       num_splits=args.num_splits or defaults.num_splits)
        if variant == "gpu":
            changes.update(block_rows=args.block_rows or defaults.block_rows,
                           num_warps=args.num_warps or defaults.num_warps)
        elif args.block_rows or args.num_warps:
            parser.error("--block-rows and --num-warps are GPU kernel settings")
        block_sizes = dataclasses.replace(defaults, **changes)
    kernel = kernel_function(variant, interpret, block_sizes)
    reference = reference_function()

    checks, timed = problems(args)
    check_rows = []
    for problem in checks:
        row = check(problem, kernel, 1e-4 if problem.dtype == "float32" else 3e-2)
        check_rows.append(row)
        print(f"check {problem.shape} len={problem.length} N={problem.nodes} "
              f"M={problem.window} {problem.dtype}: max abs error {row['max_abs_error']:.2e} "
              f"{'ok' if row['ok'] else 'FAILED'}", flush=True)

    rows = []
    header = (f"{'shape':<12} {'length':>6} {'N':>3} {'kernel_us':>10} {'ref_us':>10} "
              f"{'speedup':>8} {'kernel_GB/s':>11} {'%peak':>6}")
    print(header, flush=True)
    for problem in timed:
        inputs = make_inputs(problem)
        kernel_s = time_call(kernel, inputs, args.inner, args.repeats)
        reference_s = time_call(reference, inputs, args.inner, args.repeats)
        timing = device_time_call(kernel, inputs, args.inner) if args.device_time else None
        kv_bytes = 2 * problem.length * problem.kv_heads * problem.head_dim * \
            jnp.dtype(problem.dtype).itemsize
        bandwidth = kv_bytes / kernel_s
        row = {**dataclasses.asdict(problem), "kernel_us": 1e6 * kernel_s,
               "reference_us": 1e6 * reference_s, "speedup": reference_s / kernel_s,
               "kv_bytes": kv_bytes, "kernel_bytes_per_s": bandwidth,
               "reference_bytes_per_s": kv_bytes / reference_s,
               "fraction_of_peak": bandwidth / peak if peak else None, "device": timing}
        rows.append(row)
        fraction = f"{100 * bandwidth / peak:6.1f}" if peak else f"{'-':>6}"
        print(f"{problem.shape:<12} {problem.length:>6} {problem.nodes:>3} "
              f"{row['kernel_us']:>10.1f} {row['reference_us']:>10.1f} {row['speedup']:>8.2f} "
              f"{bandwidth / 1e9:>11.1f} {fraction}", flush=True)

    sweep_rows = []
    if args.sweep:
        if variant != "gpu":
            parser.error("--sweep times the GPU kernel's tilings (--variant gpu)")
        sweep_rows = sweep(args, variant, interpret, peak)

    device_name = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_").lower()
    path = Path(args.json or ROOT / "benchmarks" / "results" / f"kernels_{device_name}.json")
    result = {
        "benchmark": "verify_attention_kernel",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.device_kind, "backend": backend, "variant": variant,
        "interpret": interpret, "peak_hbm_bytes_per_s": peak,
        "platform": platform.platform(), "python": platform.python_version(),
        "versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version()},
        "git": environment.git_commit(),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "timing": f"{args.inner} chained calls in one jitted program per run, median of "
                  f"{args.repeats} runs",
        "checks": check_rows, "rows": rows, "sweep": sweep_rows,
    }
    environment.write_json(path, result)
    print(f"wrote {path}")
    sweep_ok = all(row["check"]["ok"] for row in sweep_rows)
    return 0 if all(row["ok"] for row in check_rows) and sweep_ok else 1


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


if __name__ == "__main__":
    sys.exit(main())
