"""The TPU (Mosaic) kernels of ``attn_impl="fused"``: the row-tiled fused linear kernel
(``kernels/linear_tpu.py``) and the position-ordered attention kernel
(``kernels/attention_ordered_tpu.py``), run under the TPU interpreter on the CPU (which
fills buffers a kernel never writes with NaN; the attention inputs hold NaN in every cache
slot a query must not read). The same checks as ``tests/test_fused_kernels.py`` for the
GPU kernels, reusing its inputs and helpers:

* the linear kernel against :func:`fused_linear_reference` for every form the models use
  (plain, RMSNorm + bias + residual, SwiGLU from one fused matrix and from two, the
  transposed float32 head), in each of its three column tilings (128-aligned blocks with
  several K chunks, a whole matrix, a full-width block sliced in the epilogue), fp32 and
  bf16;
* row independence: a row computed in calls of 1, 5, 16 and 17 rows is bitwise the same,
  and a reduction chunk chosen from the row count (the bug the tiling rules out) is caught;
* the ordered attention against ``attention_reference`` (the GPU test's cases, and its
  soft-capping and sliding windows check); with the cap and windows a row's output is
  bitwise the same alone and among 16 rows at heads of 80, 96 and 256, and a block chosen
  from the row count is caught;
* whole models through the dispatcher (``KernelOptions(interpret_variant="tpu")``): every node on a
  root-to-leaf path of a 17-node tree is bitwise the one-token ``ar`` step at its position
  (fp32; bf16 in the slow tier), on the GPU test's tiny model; in the slow tier also with
  its features and Gemma's soft-capped, windowed attention, where a window applied to the
  chains' mask is caught.

Limit of the interpreter check: XLA compiles an interpreted kernel body anew inside each
program, and does not always round it the same way in a one-token program and a verify
program. On other tiny models (hidden 256; or the default N(0, 0.02) weights, whose flat
softmax shows every last bit) a few path nodes differ in the last bits for the GPU kernels
under their interpreter as well as for these; a model-level wrong variant (a KV block
chosen from the token count) is therefore not asserted here, only the kernel-level one
(a K chunk chosen from the row count), which is exact.

``tests/test_tpu_compile.py`` compiles both kernels and a whole fused model step with
Mosaic for real TPU generations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kernels
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.kernels.attention_ordered_tpu import (TpuOrderedBlockSizes, ordered_attention_tpu,
                                                  vmem_bytes)
from specjax.kernels.attention_tpu import VMEM_BUDGET
from specjax.kernels.linear_tpu import (TpuLinearBlockSizes, check_supported,
                                        fused_linear_reference, fused_linear_tpu)

from test_fused_kernels import (CONFIGS, FORMS, ORDERED_CASES, TOLERANCE, WRONG_FEATURES,
                                _arrays, _feature_params, _params, _path_versus_tree,
                                _tiny_config, check_ordered_against_reference,
                                check_windows_against_reference,
                                ordered_row_alone_and_together)
from tolerances import assert_sums_close

# 128-aligned shapes: two K chunks of 128 and two column blocks of 128 per range.
ALIGNED = TpuLinearBlockSizes(block_k=128, block_n=128)
K_WIDE, N_WIDE = 256, 256


def _aligned_arrays(dtype, rows=5, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (rows, K_WIDE)) * jnp.logspace(-2, 2, K_WIDE)
    w = 0.1 * jax.random.normal(ks[1], (3, K_WIDE, 2 * N_WIDE))
    norm = 1 + 0.1 * jax.random.normal(ks[2], (3, K_WIDE))
    bias = 0.1 * jax.random.normal(ks[3], (3, 2 * N_WIDE))
    residual = jax.random.normal(ks[4], (rows, N_WIDE))
    return tuple(a.astype(dtype) for a in (x, w, norm, bias, residual))


def _check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))  # every element written
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_every_form_matches_the_reference(dtype):
    """The GPU test's forms (K=64, N=96: a whole matrix, and ranges at column 96 of a
    192-wide one, which take the full-width block), then norm + bias + residual + SwiGLU
    on 128-aligned ranges (two K chunks, two column blocks), and the tied head."""
    x, *rest = _arrays(dtype)
    for form in sorted(FORMS):
        kwargs = FORMS[form](x, *rest)
        got = fused_linear_tpu(x, layer=jnp.int32(1), interpret=True, **kwargs)
        _check(got, fused_linear_reference(x, layer=jnp.int32(1), **kwargs), dtype)
    x, w, norm, bias, residual = _aligned_arrays(dtype)
    for kwargs in (dict(weights=(w,), norm=norm, biases=(bias,), residual=residual,
                        offsets=(N_WIDE,), width=N_WIDE),
                   dict(weights=(w, w), norm=norm, biases=(bias, bias), offsets=(0, N_WIDE),
                        width=N_WIDE)):
        got = fused_linear_tpu(x, layer=jnp.int32(2), block_sizes=ALIGNED, interpret=True,
                               **kwargs)
        _check(got, fused_linear_reference(x, layer=jnp.int32(2), **kwargs), dtype)
    table = (0.5 * jax.random.normal(jax.random.PRNGKey(3), (96, 64))).astype(dtype)
    head = dict(norm=jnp.linspace(0.5, 1.5, 64).astype(dtype), transposed=True,
                float32_out=True)
    got = fused_linear_tpu(_arrays(dtype)[0], (table,), interpret=True, **head)
    want = fused_linear_reference(_arrays(dtype)[0], (table,), **head)
    assert got.dtype == jnp.float32
    # bf16 or fp32 products summed in fp32 over 64 terms in two orders.
    assert_sums_close(got, want, longest_sum=64, stages=2)


def test_tilings_follow_the_shape():
    sizes = TpuLinearBlockSizes()
    # SmolLM2-135M: q|k|v ranges of the 960-wide fused matrix take the full width; o and
    # down read whole 576-wide matrices; gate|up and the head get 512-wide blocks.
    for offset, width in ((0, 576), (576, 192), (768, 192)):
        tiling = sizes.resolve(576, width, (960,), (offset,))
        assert tiling.full_width and tiling.part_columns == (960,) and tiling.block_k == 576
    assert sizes.resolve(1536, 576, (576,), (0,)).part_columns == (576,)
    assert sizes.resolve(1536, 576, (576,), (0,)).block_k == 512
    assert sizes.resolve(576, 1536, (3072, 3072), (0, 1536)).block_n == 512
    assert not sizes.resolve(576, 49152, (49152,), (0,)).full_width


def test_rows_are_bitwise_independent_of_the_row_count():
    """Row r of calls over 1, 5, 16 and 17 rows: bitwise equal (two K chunks, SwiGLU)."""
    x, w, norm, bias, _ = _aligned_arrays(jnp.float32, rows=17, seed=7)
    kwargs = dict(weights=(w, w), norm=norm, biases=(bias, bias), offsets=(0, N_WIDE),
                  width=N_WIDE, layer=jnp.int32(1), block_sizes=ALIGNED, interpret=True)
    together = np.asarray(fused_linear_tpu(x, **kwargs))
    for count in (5, 16):
        part = np.asarray(fused_linear_tpu(x[:count], **kwargs))
        np.testing.assert_array_equal(part, together[:count])
    for row in (0, 4, 16):
        alone = np.asarray(fused_linear_tpu(x[row:row + 1], **kwargs))
        np.testing.assert_array_equal(alone[0], together[row])


def test_a_row_dependent_k_chunk_is_caught():
    """The comparison above sees the bug the tiling rules out: a K chunk chosen from the
    row count (the whole K for one row, 128 for many) changes a row's last bits."""
    x, w, *_ = _aligned_arrays(jnp.float32, rows=16, seed=4)
    kwargs = dict(weights=(w,), layer=jnp.int32(0), offsets=(0,), width=N_WIDE,
                  interpret=True)
    many = np.asarray(fused_linear_tpu(x, block_sizes=ALIGNED, **kwargs))
    one_chunk = TpuLinearBlockSizes(block_k=K_WIDE, block_n=128)
    differs = sum(
        bool(np.any(np.asarray(fused_linear_tpu(x[row:row + 1], block_sizes=one_chunk,
                                                **kwargs))[0] != many[row]))
        for row in range(0, 16, 3))
    assert differs > 0


@pytest.mark.parametrize("call,message", [
    (lambda: check_supported(jnp.zeros((2, 64)), [jnp.zeros((32, 64))]),
     "does not take 64 input features"),
    (lambda: check_supported(jnp.zeros((2, 256)), [jnp.zeros((256, 256))],
                             block_sizes=TpuLinearBlockSizes(block_n=192)), "multiple of 128"),
    (lambda: check_supported(jnp.zeros((2, 256)), [jnp.zeros((256, 384))],
                             block_sizes=TpuLinearBlockSizes(block_n=256)), "block_n=256"),
    (lambda: check_supported(jnp.zeros((2, 768)), [jnp.zeros((50257, 768))], transposed=True),
     "MiB of VMEM"),
    (lambda: check_supported(jnp.zeros((2, 64), jnp.float16), [jnp.zeros((64, 64))]),
     "dtype float16"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


# --- position-ordered attention ---------------------------------------------------------

@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: c.name)
def test_ordered_attention_matches_reference(case):
    check_ordered_against_reference(ordered_attention_tpu, case)


def test_ordered_attention_with_softcap_and_windows_matches_reference():
    """Soft-capping and sliding windows (Gemma 2/3, Phi-3), by position in the kernel:
    the GPU test's check (sharp on both)."""
    check_windows_against_reference(ordered_attention_tpu)


@pytest.mark.parametrize("dim", [80, 96, pytest.param(256, marks=pytest.mark.slow)])
def test_windowed_rows_do_not_depend_on_the_row_count(dim):
    """With the cap and a window per row (node 9's starting mid-cache, its tile's other
    rows' lower or none), at Phi-2's, Phi-3's and Gemma's head sizes, a row's output is
    bitwise the same alone and among 16 rows; with ``block_kv`` chosen from the row count (16
    alone, 32 together: the deliberately wrong variant) it is not."""
    first = jnp.asarray([0, 50, 7, 299, -3, 120, 260, 10, 200, 171, 0, 1, 2, 300, 299, 298],
                        jnp.int32)
    first = first.at[8].set(jnp.iinfo(jnp.int32).min)  # a global row in node 9's tile
    windows = dict(softcap=3.0, first_visible=first)
    together, alone = ordered_row_alone_and_together(
        ordered_attention_tpu, dim, lambda rows: TpuOrderedBlockSizes(), **windows)
    np.testing.assert_array_equal(together, alone)
    together, alone = ordered_row_alone_and_together(
        ordered_attention_tpu, dim,
        lambda rows: TpuOrderedBlockSizes(block_kv=16 if rows == 1 else 32), **windows)
    assert np.any(together != alone)


def test_many_kv_heads_tile_fewer_rows_chosen_by_shape_alone():
    """The tiling follows the KV heads, head size, dtype and window, never the row count:
    SmolLM2's 3 KV heads of 64 tile 8 rows with 128-position blocks, Llama-2-7B's 32 of 128
    4 rows with 32 (at 8 rows with 16-position blocks the compiler reported 12.48 MiB on
    v5e, over the 12 MiB budget: the estimate says so); every tiling chosen is within the
    budget, and what fits in none is refused in one line. A row's output is bitwise the same
    in tiles of 8 rows and of 4 (the row count's wrong variant: the windowed test above)."""
    sizes = TpuOrderedBlockSizes()
    assert sizes.resolve(4096, 3, 64, 2) == (8, 128)
    assert sizes.resolve(4096, 32, 128, 2) == sizes.resolve(4096, 32, 128, 2, True) == (4, 32)
    assert vmem_bytes(8, 16, 32, 128, 2) > VMEM_BUDGET >= vmem_bytes(4, 32, 32, 128, 2)
    refused = 0
    for heads in (1, 3, 8, 16, 32, 64):
        for dim in (64, 96, 128, 256):
            for itemsize in (2, 4):
                try:
                    rows, block_kv = sizes.resolve(4096, heads, dim, itemsize, True)
                except InvalidArgumentError as error:
                    assert "\n" not in str(error) and "one row per tile" in str(error)
                    refused += 1
                    continue
                assert vmem_bytes(rows, block_kv, heads, dim, itemsize, True) <= VMEM_BUDGET
                assert rows == 8 or vmem_bytes(rows * 2, 16, heads, dim, itemsize,
                                               True) > VMEM_BUDGET
    assert 0 < refused < 6  # only 64 KV heads of the widest
    outputs = [ordered_row_alone_and_together(
        ordered_attention_tpu, 64, lambda _: TpuOrderedBlockSizes(block_rows=rows, block_kv=32))
        for rows in (8, 4)]
    np.testing.assert_array_equal(outputs[0][0], outputs[1][0])
    np.testing.assert_array_equal(outputs[0][0], outputs[0][1])


def test_ordered_attention_refuses_what_it_does_not_order():
    q = kv = jnp.zeros((2, 2, 64))
    mask = jnp.eye(2, dtype=bool)
    cache = jnp.zeros((50, 2, 64))  # no multiple of 16 divides the capacity
    with pytest.raises(InvalidArgumentError, match="not a multiple of block_kv") as info:
        ordered_attention_tpu(q, kv, kv, cache, cache, jnp.int32(3), mask, interpret=True)
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match="scratch window"):
        ordered_attention_tpu(q, kv, kv, cache[:48], cache[:48], jnp.int32(3), mask,
                              jnp.ones((2, 1), bool), interpret=True)
    with pytest.raises(InvalidArgumentError, match="first_visible must be int32") as info:
        ordered_attention_tpu(q, kv, kv, cache[:48], cache[:48], jnp.int32(3), mask,
                              first_visible=jnp.zeros((3,), jnp.int32), interpret=True)
    assert "\n" not in str(info.value)


# --- through the dispatcher, whole models ------------------------------------------------

def test_the_dispatcher_picks_the_tpu_kernels():
    assert kernels.select_variant(interpret_variant="tpu") == ("tpu", True)
    x, w, *_ = _arrays(jnp.float32)
    np.testing.assert_array_equal(
        kernels.fused_linear(x, (w,), layer=jnp.int32(0), fallback=True,
                             interpret_variant="tpu"),
        fused_linear_tpu(x, (w,), layer=jnp.int32(0), interpret=True))
    huge = jnp.zeros((50257, 64))  # over the VMEM budget: the reference runs
    np.testing.assert_array_equal(
        kernels.fused_linear(x, (huge,), transposed=True, fallback=True,
                             interpret_variant="tpu"),
        fused_linear_reference(x, (huge,), transposed=True))


@pytest.mark.parametrize("dtype", [jnp.float32,
                                   pytest.param(jnp.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_every_node_on_a_path_is_bitwise_the_ar_step(dtype):
    config = _tiny_config()
    params = jax.tree.map(lambda a: a.astype(dtype), _params(config))
    assert all(_path_versus_tree(config, params, 12, KernelOptions(attention="fused",
                                                                  interpret_variant="tpu")))


TPU_FUSED = KernelOptions(attention="fused", interpret_variant="tpu")


@pytest.mark.parametrize("name", [pytest.param("features", marks=pytest.mark.slow),
                                  pytest.param("layer-norms", marks=pytest.mark.slow),
                                  pytest.param("windows", marks=pytest.mark.slow)])
def test_every_node_on_a_path_is_bitwise_the_ar_step_with_the_features(name):
    """The same with the features the fused layers take beyond Llama's
    (``test_fused_kernels.CONFIGS``): the TPU kernels with the query scale, GELU epilogues,
    Gemma's soft-capped scores and sliding windows; the norms in the (Triton) norm kernel,
    interpreted."""
    config = _tiny_config(**CONFIGS[name])
    assert all(_path_versus_tree(config, _feature_params(config), 12, TPU_FUSED))


@pytest.mark.slow
def test_a_window_applied_to_the_chains_mask_is_caught(monkeypatch):
    """The comparison above fails on the TPU kernel when the verify pass's window is
    applied to the mask the chains are read from instead of by position in the kernel
    (``test_fused_kernels``' wrong variant): a deep node's chain misses its distant
    ancestors."""
    WRONG_FEATURES["window-in-the-chains-mask"](monkeypatch)
    config = _tiny_config(**CONFIGS["windows"])
    assert not all(_path_versus_tree(config, _feature_params(config), 12, TPU_FUSED))
