"""The fused linear kernels at a model's shapes: Triton, Mosaic GPU and the XLA reference.

On a GPU machine, from the repository root, installed or not:

    python benchmarks/bench_linear.py --device-time --json benchmarks/results/DEVICE/linear.json

Times one layer's projections the way ``attn_impl="fused"`` calls them, as three units that
each map [T, d] rows back to [T, d] (so calls chain):

* ``attn``: RMSNorm + the fused q|k|v matrix, then o (reading the q columns) + residual;
* ``attn-rope``: the same as the packed fused layers run it: q|k|v with RoPE applied to q
  and k, written as one layer of a ``[layers, rows, heads, D]`` buffer (``triton``: the
  one kernel :func:`~specjax.kernels.linear_gpu.qkv_rope_into_gpu`; ``mosaic``: the
  projection kernel, then :func:`~specjax.models.layers.write_rope_rows` as an XLA
  fusion, as the models do), then o reading the buffer's query heads + residual. The rows
  are padded to 16 first and the buffer is created per call (two small operations the
  model does once per pass);
* ``mlp``: RMSNorm + the fused gate|up matrix with SwiGLU, then down + residual;
* ``head``: the final RMSNorm + the head, float32 logits (the first d of them chain on).

Weights are stacked over two layers and read at a traced layer, as in the model. Backends:
``xla`` (:func:`~specjax.kernels.linear_gpu.fused_linear_reference`, jitted: what XLA makes
of the jnp layers), ``triton`` (:func:`~specjax.kernels.linear_gpu.fused_linear_gpu`) and
``mosaic`` (:func:`~specjax.kernels.linear_mosaic_gpu.fused_linear_mosaic_gpu`; bf16/fp16
only, no tied head: a call it refuses is recorded as such). Each backend's unit output is
first checked against the reference's on the device; a failed check is recorded and the
run exits 1.

Timing is :mod:`bench_kernels`'s: ``--inner`` chained calls in one jitted program, median
over ``--repeats`` runs after a warm-up; ``--device-time`` adds the kernels' device time
from a profiler trace. Bandwidth is the unit's weight bytes over its time (the rows are
tiny next to the weights), against the device's peak: a one-token unit at ~100% of it
would be reading each weight once at full speed.

``--interpret --quick`` runs the pipeline on tiny shapes with both kernels interpreted on
any backend: a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (str(ROOT), str(ROOT / "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_kernels  # noqa: E402
from specjax.errors import InvalidArgumentError  # noqa: E402
from specjax.harness import environment  # noqa: E402

try:
    from specjax import kernels  # installed: kernels/ is specjax.kernels
except ImportError:  # a bare checkout: the same package as the top-level ``kernels``
    import kernels  # type: ignore[no-redef]

linear_gpu = importlib.import_module(f"{kernels.__name__}.linear_gpu")
linear_mosaic_gpu = importlib.import_module(f"{kernels.__name__}.linear_mosaic_gpu")
round_up = importlib.import_module(f"{kernels.__name__}.layout").round_up

UNITS = ("attn", "attn-rope", "mlp", "head")
BACKENDS = ("xla", "triton", "mosaic")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}  # relative to max |ref|
# name: (d, q width, k/v width, intermediate F, vocabulary V, tied head)
SHAPES = {
    "smollm2-135m": (576, 576, 192, 1536, 49152, True),
    "llama-7b": (4096, 4096, 4096, 11008, 32000, False),
}
QUICK_SHAPES = {"tiny": (128, 128, 64, 256, 512, False)}
HEAD_DIM = {"smollm2-135m": 64, "llama-7b": 128, "tiny": 32}  # the attn-rope unit's heads
LAYERS = 2


def unit_arrays(shape, unit: str, dtype, seed: int = 0) -> tuple:
    """The unit's weights, stacked [LAYERS, ...] (the head unstacked), scaled so outputs
    stay O(1) along the chain."""
    d, q, kv, f, vocab, tied = shape
    rng = np.random.default_rng(seed)

    def normal(*dims, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(dims, np.float32), dtype)

    norm = 1 + normal(LAYERS, d, scale=0.1)
    if unit in ("attn", "attn-rope"):
        return (normal(LAYERS, d, q + 2 * kv, scale=d ** -0.5),
                normal(LAYERS, q, d, scale=q ** -0.5), norm)
    if unit == "mlp":
        return (normal(LAYERS, d, 2 * f, scale=d ** -0.5),
                normal(LAYERS, f, d, scale=f ** -0.5), norm)
    head = normal(vocab, d, scale=d ** -0.5) if tied else normal(d, vocab, scale=d ** -0.5)
    return head, 1 + normal(d, scale=0.1)


def weight_bytes(shape, unit: str, dtype) -> int:
    d, q, kv, f, vocab, _ = shape
    elements = {"attn": d * (q + 2 * kv) + q * d, "mlp": d * 2 * f + f * d, "head": d * vocab}
    elements["attn-rope"] = elements["attn"]
    return elements[unit] * jnp.dtype(dtype).itemsize


def linear_for(backend: str, interpret: bool):
    if backend == "xla":
        return linear_gpu.fused_linear_reference
    kernel = (linear_gpu.fused_linear_gpu if backend == "triton"
              else linear_mosaic_gpu.fused_linear_mosaic_gpu)
    return functools.partial(kernel, interpret=interpret)


def unit_function(backend: str, unit: str, shape, interpret: bool, head_dim: int = 64):
    """``f(x, *arrays, layer) -> [T, d]`` in x's dtype."""
    d, q, _, f, _, tied = shape
    linear = linear_for(backend, interpret)
    if unit == "attn-rope":
        return _attn_rope(backend, shape, interpret, head_dim, linear)
    if unit == "attn":
        def attn(x, w_qkv, w_o, norm, layer):
            qkv = linear(x, (w_qkv,), norm=norm, layer=layer)
            return linear(qkv[:, :q], (w_o,), residual=x, layer=layer)
        return attn
    if unit == "mlp":
        def mlp(x, w_gate_up, w_down, norm, layer):
            h = linear(x, (w_gate_up, w_gate_up), norm=norm, offsets=(0, f), width=f,
                       layer=layer)
            return linear(h, (w_down,), residual=x, layer=layer)
        return mlp

    def head(x, table, norm, layer):
        del layer
        logits = linear(x, (table,), norm=norm, transposed=tied, float32_out=True)
        return logits[:, :d].astype(x.dtype)
    return head


def _attn_rope(backend: str, shape, interpret: bool, head_dim: int, linear):
    from specjax.models.layers import write_rope_rows

    d, q, kv, _, _, _ = shape
    heads, rope_heads = (q + 2 * kv) // head_dim, (q + kv) // head_dim

    def attn_rope(x, w_qkv, w_o, norm, layer):
        t = x.shape[0]
        rows = round_up(t, 16)
        x_rows = jnp.pad(x, ((0, rows - t), (0, 0)))
        # Positions 7.. (at 0 RoPE is the identity and would check nothing).
        angles = (jnp.arange(7, 7 + rows, dtype=jnp.float32)[:, None]
                  * 0.5 ** jnp.arange(head_dim // 2, dtype=jnp.float32)[None, :])
        angles = jnp.concatenate([angles, angles], axis=-1)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        packed = jnp.zeros((LAYERS, rows, heads, head_dim), x.dtype)
        if backend == "triton":
            packed = linear_gpu.qkv_rope_into_gpu(packed, x_rows, w_qkv, cos, sin, layer,
                                                  norm=norm, rope_heads=rope_heads,
                                                  interpret=interpret)
        else:
            packed = write_rope_rows(packed, linear(x_rows, (w_qkv,), norm=norm, layer=layer),
                                     layer, cos, sin, rope_heads)
        queries = jax.lax.dynamic_index_in_dim(packed, layer, keepdims=False)[
            :t, :q // head_dim].reshape(t, q)
        return linear(queries, (w_o,), residual=x, layer=layer)
    return attn_rope


def refusal(backend: str, unit: str, shape, rows: int, dtype) -> str | None:
    """Why the Mosaic GPU kernel refuses a call of the unit (``None``: it takes them all)."""
    if backend != "mosaic":
        return None
    d, q, kv, f, vocab, tied = shape
    x = jax.ShapeDtypeStruct((rows, d), dtype)
    struct = lambda *dims: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
    calls = {
        "attn-rope": [dict(x=struct(round_up(rows, 16), d),
                           weights=(struct(LAYERS, d, q + 2 * kv),), stacked=True),
                      dict(x=struct(rows, q), weights=(struct(LAYERS, q, d),), stacked=True)],
        "attn": [dict(x=x, weights=(struct(LAYERS, d, q + 2 * kv),), stacked=True),
                 dict(x=struct(rows, q), weights=(struct(LAYERS, q, d),), stacked=True)],
        "mlp": [dict(x=x, weights=(struct(LAYERS, d, 2 * f),) * 2, offsets=(0, f), width=f,
                     stacked=True),
                dict(x=struct(rows, f), weights=(struct(LAYERS, f, d),), stacked=True)],
        "head": [dict(x=x, weights=(struct(vocab, d) if tied else struct(d, vocab),),
                      transposed=tied)],
    }[unit]
    for call in calls:
        try:
            linear_mosaic_gpu.check_supported(call.pop("x"), call.pop("weights"), **call)
        except InvalidArgumentError as error:
            return str(error)
    return None


def _choose(parser, text: str, allowed, what: str) -> list[str]:
    chosen = text.split(",")
    for name in chosen:
        if name not in allowed:
            parser.error(f"unknown {what} {name!r}; expected some of {', '.join(allowed)}")
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES),
                        help="shapes: " + ", ".join(SHAPES))
    parser.add_argument("--units", default=",".join(UNITS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rows", default="1,16,64", help="rows T per call")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=10, help="chained calls per run")
    parser.add_argument("--device-time", action="store_true",
                        help="also read the kernels' device time from a profiler trace")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernels interpreted (any backend; slow)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    shapes = QUICK_SHAPES if args.quick else {
        name: SHAPES[name] for name in _choose(parser, args.models, SHAPES, "model")}
    units = _choose(parser, args.units, UNITS, "unit")
    backends = _choose(parser, args.backends, BACKENDS, "backend")
    dtypes = _choose(parser, args.dtypes, TOLERANCE, "dtype")
    rows_list = [int(r) for r in args.rows.split(",")]
    device = jax.devices()[0]
    interpret = args.interpret or jax.default_backend() != "gpu"
    if interpret and not (args.interpret or args.quick):
        parser.error("no GPU: the kernels would be interpreted; pass --interpret --quick "
                     "for a smoke test")
    peak = bench_kernels.peak_bandwidth(device.device_kind)
    layer = jnp.int32(LAYERS - 1)
    print(f"device {device.device_kind}; {'interpreted' if interpret else 'compiled'}; "
          f"peak {peak / 1e9 if peak else float('nan'):.0f} GB/s", flush=True)
    print(f"{'model':<14}{'unit':<10}{'dtype':<10}{'T':>4}  {'backend':<8}{'us':>10}"
          f"{'device us':>11}{'GB/s':>9}{'% peak':>8}  check", flush=True)
    rows_out, failed = [], False
    for model, shape in shapes.items():
        for unit in units:
            for dtype_name in dtypes:
                dtype = jnp.dtype(dtype_name)
                arrays = unit_arrays(shape, unit, dtype)
                nbytes = weight_bytes(shape, unit, dtype)
                for rows in rows_list:
                    x = jnp.asarray(np.random.default_rng(rows).standard_normal(
                        (rows, shape[0]), np.float32), dtype)
                    head_dim = HEAD_DIM[model]
                    expected = jax.jit(unit_function("xla", unit, shape, interpret,
                                                     head_dim))(
                        x, *arrays, layer).astype(jnp.float32)
                    scale = float(jnp.max(jnp.abs(expected)))
                    for backend in backends:
                        row = {"model": model, "unit": unit, "dtype": dtype_name,
                               "rows": rows, "backend": backend, "weight_bytes": nbytes}
                        why = refusal(backend, unit, shape, rows, dtype)
                        if why is None and backend == "mosaic" and dtype_name == "float32":
                            why = "float32: the Mosaic GPU kernel takes bf16/fp16 only"
                        if why is not None:
                            rows_out.append({**row, "refused": why})
                            print(f"{model:<14}{unit:<10}{dtype_name:<10}{rows:>4}  "
                                  f"{backend:<8} refused: {why}", flush=True)
                            continue
                        function = unit_function(backend, unit, shape, interpret, head_dim)
                        got = jax.jit(function)(x, *arrays, layer).astype(jnp.float32)
                        error = float(jnp.max(jnp.abs(got - expected))) / max(scale, 1e-30)
                        ok = (bool(jnp.all(jnp.isfinite(got)))
                              and error <= TOLERANCE[dtype_name])
                        failed |= not ok
                        seconds = bench_kernels.time_call(function, (x, *arrays, layer),
                                                          args.inner, args.repeats)
                        timing = (bench_kernels.device_time_call(
                            function, (x, *arrays, layer), args.inner)
                            if args.device_time else None)
                        measured = timing["device_us"] * 1e-6 if timing else seconds
                        bandwidth = nbytes / measured
                        row.update(us=1e6 * seconds, device=timing, bytes_per_s=bandwidth,
                                   fraction_of_peak=bandwidth / peak if peak else None,
                                   check={"relative_error": error,
                                          "tolerance": TOLERANCE[dtype_name], "ok": ok})
                        rows_out.append(row)
                        device_us = (f"{timing['device_us']:>11.1f}" if timing
                                     else f"{'-':>11}")
                        fraction = f"{100 * bandwidth / peak:>8.1f}" if peak else f"{'-':>8}"
                        print(f"{model:<14}{unit:<10}{dtype_name:<10}{rows:>4}  {backend:<8}"
                              f"{1e6 * seconds:>10.1f}{device_us}{bandwidth / 1e9:>9.1f}"
                              f"{fraction}  {'ok' if ok else 'FAILED'} ({error:.1e})",
                              flush=True)
    if args.json:
        environment.write_json(args.json, {
            "benchmark": "fused linear kernels per unit (bench_linear.py)",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": environment.machine(), "backend": jax.default_backend(),
            "interpreted": interpret, "peak_hbm_bytes_per_s": peak,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "timing": f"{args.inner} chained calls in one jitted program per run, median of "
                      f"{args.repeats} runs; bandwidth from device time when measured",
            "rows": rows_out})
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
