"""The Mosaic GPU (Hopper ``wgmma``) fused linear kernel, ``kernels/linear_mosaic_gpu.py``.

It runs here under JAX's Mosaic GPU interpreter, which simulates shared memory, TMA
copies, barriers and ``wgmma`` on the CPU, fills fresh buffers (the output included) with
NaN and raises on out-of-bounds reads. Checked:

* against :func:`fused_linear_reference` for every form the models use (plain, RMSNorm +
  bias + residual, SwiGLU from one fused gate|up matrix and from two matrices, a float32
  head), stacked weights at a traced layer, bfloat16 and float16, one and two row tiles;
* row independence: each row of a 5/64/70-row call is bitwise the row computed alone, and
  a reduction chunk chosen from the row count (the bug the fixed chunk rules out) is caught;
* the dispatcher: ``gpu_linear="mosaic"`` (``KernelOptions.gpu_linear``) sends the calls
  the kernel takes to it and the rest (float32, a transposed head, a width off 64) to the
  Triton kernel; the default never uses it; a bad value is one line;
* a whole bfloat16 model with it: every node on a root-to-leaf path of a 17-node verify
  pass is bitwise the one-token step ``ar`` runs there;
* the CUDA lowering accepts it at the SmolLM2 and Llama-7B shapes (the Pallas -> Mosaic GPU
  lowering runs on the CPU; PTX and timing need a GPU);
* bad input: one-line errors.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels, models
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.kernels import linear_mosaic_gpu
from specjax.kernels.linear_gpu import fused_linear_reference
from specjax.kernels.linear_mosaic_gpu import (MosaicGpuLinearBlockSizes, check_supported,
                                               fused_linear_mosaic_gpu)

import test_fused_kernels as fused_kernel_tests
from test_fused_kernels import _params, _path_versus_tree, _prefilled, _tiny_config

TOLERANCE = {jnp.bfloat16: 3e-2, jnp.float16: 5e-3}
K_IN, N_OUT = 128, 128


# Every form of the Triton kernel's tests, at widths the Mosaic kernel takes (64-multiples).
_arrays = functools.partial(fused_kernel_tests._arrays, k_in=K_IN, n_out=N_OUT)
FORMS = {**fused_kernel_tests.forms(N_OUT),
         "float32-out-bias": lambda x, w, w2, n, b, r: dict(
             weights=(w,), norm=n, biases=(b,), float32_out=True)}


CASES = [(form, jnp.bfloat16, 5) for form in sorted(FORMS)] + [
    (form, jnp.float16, 70) for form in ("norm-bias-residual", "swiglu-fused-matrix")]


@pytest.mark.parametrize("form,dtype,rows", CASES, ids=lambda v: getattr(v, "__name__", v))
def test_kernel_matches_reference(form, dtype, rows):
    x, *rest = _arrays(dtype, rows=rows)
    kwargs = FORMS[form](x, *rest)
    got = fused_linear_mosaic_gpu(x, layer=jnp.int32(1), interpret=True, **kwargs)
    want = fused_linear_reference(x, layer=jnp.int32(1), **kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.dtype == (jnp.float32 if kwargs.get("float32_out") else dtype)
    assert bool(jnp.all(jnp.isfinite(got)))  # every output element written
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def _rows_alone_match(rows: int, form: str) -> bool:
    x, w, _, norm, bias, residual = _arrays(jnp.bfloat16, rows=rows, seed=rows)
    kwargs = dict(weights=(w,), norm=norm, biases=(bias,), float32_out=True)
    if form == "swiglu-residual":
        kwargs = dict(weights=(w, w), norm=norm, biases=(bias, bias), offsets=(0, N_OUT),
                      width=N_OUT, residual=residual)
    together = fused_linear_mosaic_gpu(x, layer=jnp.int32(2), interpret=True, **kwargs)
    same = []
    for row in sorted({0, rows // 2, rows - 1}):
        one = {k: v[row:row + 1] if k == "residual" else v for k, v in kwargs.items()}
        alone = fused_linear_mosaic_gpu(x[row:row + 1], layer=jnp.int32(2), interpret=True,
                                        **one)
        same.append(bool(jnp.all(together[row] == alone[0])))
    return all(same)


@pytest.mark.parametrize("rows,form", [(5, "swiglu-residual"), (70, "float32-head")])
def test_rows_are_bitwise_independent_of_the_row_count(rows, form):
    assert _rows_alone_match(rows, form)


def test_a_row_dependent_reduction_chunk_is_caught(monkeypatch):
    """The comparison above detects a reduction chunk chosen from the row count (64 for one
    row, 128 for many): it changes a row's last float32 bits."""
    unjitted = fused_linear_mosaic_gpu.__wrapped__

    def chunk_by_rows(x, *args, **kwargs):
        monkeypatch.setattr(linear_mosaic_gpu, "BLOCK_K", 64 if x.shape[0] == 1 else 128)
        return unjitted(x, *args, **kwargs)

    monkeypatch.setitem(globals(), "fused_linear_mosaic_gpu", chunk_by_rows)
    assert not _rows_alone_match(5, "float32-head")


def _mosaic_calls(fn, *args) -> int:
    """How many Mosaic GPU linear kernel calls a function's jaxpr makes (traced afresh:
    the choice reads the environment at trace time, and a traced function is cached)."""
    def count(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.params.get("name") == "fused_linear_mosaic_gpu":
                total += 1
                continue
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                total += count(sub)
        return total
    return count(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr)


def test_dispatch_is_opt_in_and_by_shape_and_dtype():
    x, w, w2, *_ = _arrays(jnp.bfloat16)
    table = jnp.zeros((256, K_IN), jnp.bfloat16)
    odd = jnp.zeros((3, K_IN, 96), jnp.bfloat16)
    layer = jnp.int32(0)
    mosaic = dict(gpu_linear="mosaic")
    plain = lambda x, w, **o: kernels.fused_linear(x, (w,), layer=layer, **o)  # noqa: E731
    head = lambda x, t: kernels.fused_linear(x, (t,), transposed=True, **mosaic)  # noqa: E731
    assert kernels.gpu_kernel_backend() == "triton"
    assert _mosaic_calls(plain, x, w2) == 0
    plain = functools.partial(plain, **mosaic)
    assert kernels.select_variant() == ("gpu", True)
    assert _mosaic_calls(plain, x, w2) == 1
    assert _mosaic_calls(plain, x.astype(jnp.float32), w2.astype(jnp.float32)) == 0
    assert _mosaic_calls(head, x, table) == 0
    assert _mosaic_calls(plain, x, odd) == 0
    got = kernels.fused_linear(x, (w2,), layer=layer, **mosaic)  # Mosaic, interpreted
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(
        fused_linear_reference(x, (w2,), layer=layer), np.float32), rtol=3e-2, atol=3e-2)
    with pytest.raises(InvalidArgumentError, match="gpu_linear='cutlass'") as info:
        kernels.fused_linear(x, (w2,), layer=layer, gpu_linear="cutlass")
    assert "\n" not in str(info.value)


@pytest.mark.slow  # 18 s: the slow tier keeps `make test` under 15 minutes
def test_model_tree_nodes_are_bitwise_the_ar_steps():
    """bfloat16, ``attn_impl="fused"`` with the Mosaic kernel for q, o, gate|up and down
    (k and v are 32 wide and the tied head is transposed: the Triton kernel's). One layer:
    the interpreter is slow, and the layer loop is the same for more."""
    fused = KernelOptions(attention="fused", gpu_linear="mosaic")
    config = _tiny_config(num_layers=1)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params(config))
    tokens, positions = jnp.arange(3, dtype=jnp.int32), 12 + jnp.arange(3, dtype=jnp.int32)
    cache = _prefilled(config, params)
    forward = lambda: models.forward(params, config, tokens, positions, cache,  # noqa: E731
                                     attn_impl=fused)[0]
    assert _mosaic_calls(forward) == 4  # q, o, gate|up, down
    assert all(_path_versus_tree(config, params, 12, fused))


S = jax.ShapeDtypeStruct
I32 = S((), jnp.int32)


def _lowers_for_cuda(fn, *args) -> bool:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return "mosaic_gpu" in text


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-7b"])
def test_kernel_lowers_for_cuda_at_model_shapes(model):
    d, f, q, layers = {"smollm2-135m": (576, 1536, 960, 30),
                       "llama-7b": (4096, 11008, 3 * 4096, 32)}[model]
    dt = jnp.bfloat16
    rows = S((5, d), dt)
    norm = S((layers, d), dt)
    assert _lowers_for_cuda(lambda x, w, n, i: fused_linear_mosaic_gpu(
        x, (w,), norm=n, layer=i), rows, S((layers, d, q), dt), norm, I32)  # q|k|v
    assert _lowers_for_cuda(lambda x, w, n, i: fused_linear_mosaic_gpu(
        x, (w, w), norm=n, layer=i, offsets=(0, f), width=f), S((70, d), dt),
        S((layers, d, 2 * f), dt), norm, I32)  # gate|up, two row tiles
    assert _lowers_for_cuda(lambda h, w, r, i: fused_linear_mosaic_gpu(
        h, (w,), residual=r, layer=i), S((5, f), dt), S((layers, f, d), dt), rows, I32)
    assert _lowers_for_cuda(lambda x, w, b: fused_linear_mosaic_gpu(
        x, (w,), biases=(b,), float32_out=True), rows, S((d, q), dt), S((q,), dt))


@pytest.mark.parametrize("call,message", [
    (lambda x, w: check_supported(x.astype(jnp.float32), (w.astype(jnp.float32),)),
     "float32 is not supported"),
    (lambda x, w: check_supported(x, (w.T,), transposed=True),
     "transposed weights are not supported"),
    (lambda x, w: check_supported(x, (w[:, :96],)), r"N=96 .* not multiples"),
    (lambda x, w: check_supported(x[:, :96], (w[:96],)), r"K=96, .* not multiples"),
    (lambda x, w: check_supported(x, (w.astype(jnp.float16),)), "must have x's dtype"),
    (lambda x, w: check_supported(x, (w,), block_sizes=MosaicGpuLinearBlockSizes(96)),
     "block_n=96 must be a multiple of 64"),
    (lambda x, w: check_supported(x[:0], (w,)), "0 rows"),
    (lambda x, w: check_supported(x, (jnp.tile(w, (1, 4)),) * 2, offsets=(0, 256), width=256,
                                  block_sizes=MosaicGpuLinearBlockSizes(256)),
     "needs 249 KiB of shared memory; the limit is 227 KiB"),
])
def test_bad_input_is_one_line(call, message):
    x = jnp.zeros((3, K_IN), jnp.bfloat16)
    w = jnp.zeros((K_IN, N_OUT), jnp.bfloat16)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        call(x, w)
    assert "\n" not in str(info.value)


def test_block_n_depends_on_the_width_only():
    assert MosaicGpuLinearBlockSizes().resolve(960).block_n == 64
    assert MosaicGpuLinearBlockSizes().resolve(1536).block_n == 128
    assert MosaicGpuLinearBlockSizes(256).resolve(1536).block_n == 256
    # The defaults fit the shared memory with two weights (SwiGLU).
    assert linear_mosaic_gpu.smem_bytes(128, 2) <= linear_mosaic_gpu.SMEM_LIMIT
