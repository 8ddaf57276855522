"""The kernels of ``attn_impl="fused"``: the row-tiled fused linear kernel
(``kernels/linear_gpu.py``) and the position-ordered attention kernel
(``kernels/attention_ordered_gpu.py``), and the path as a whole.

The kernels run under Pallas' generic interpreter on the CPU (which fills output elements
a kernel never writes with NaN). Checked here:

* against :func:`fused_linear_reference` (the models' jnp layers) for every form the models
  use: plain, RMSNorm + bias + residual, SwiGLU from one fused gate|up matrix and from two
  matrices, the transposed (tied) float32 head; stacked weights at a traced layer; fp32 and
  bf16;
* row independence: each row of a 5/16/17/64-row call is bitwise the row computed alone,
  and a deliberately row-dependent tiling (a reduction chunk that changes with the row
  count, the bug the design rules out) is caught by the same comparison;
* the ordered attention against ``attention_reference`` (GQA 1-4, trees, causal prefill
  without a cache, lengths off the block, fp32/bf16, NaN in every slot it must not read;
  Phi-2's, Phi-3's and Gemma's head sizes, 80 and 96 on 128-wide tiles loaded masked, 256
  with 8-position blocks); a row's output bitwise the same alone and among 16 rows at
  those head sizes,
  and a block chosen from the row count caught;
* whole models: ``attn_impl="fused"`` logits equal the reference's within tolerance; a
  tree root's logits in an N-node verify pass are bitwise the one-token step's; and every
  node on a root-to-leaf path of a 17-node tree is bitwise the one-token step that ``ar``
  runs at that position after committing the path before it, while a KV blocking that
  changes with the number of new tokens (the deliberately wrong variant) is caught;
* the packed attention kernel (what the GPU variant's fused layers call: q|k|v rows read
  where the layer wrote them, chains gathered in the kernel, the output row-major) is bit
  for bit the ordered kernel on every case, reads no other layer, zeroes a tile of padding
  rows, and a chain read one slot off is caught; the path tests run with it and without
  it (the layout used under a tensor-parallel mesh);
* the q|k|v kernel that applies RoPE and writes a layer of the packed buffer in place
  (``qkv_rope_into_gpu``): against the reference, its projection bit for bit the linear
  kernel's, other layers untouched, the value heads not rotated (a rotated value head is
  caught), rows bitwise independent of the row count; whole models run it (head_dim 32:
  half a head is one 16-column tile) in the path tests;
* the features the fused layers take beyond Llama's (``CONFIGS``: elementwise ones, the
  query scale, partial RoPE, a NoPE layer, q/k and output norms; LayerNorms, parallel
  blocks, GELU; soft-capped attention and sliding windows; heads of 96 and 256; OLMo 2's,
  Command R's and Gemma's norms, slow):
  every node on a path is bitwise the ``ar`` step, and each feature computed one way for a
  one-token step and another for a verify pass is caught (the norms' sums chunked by the
  row count, the query scale folded into q, ...); the row-tiled norm kernel
  (``norm_groups_gpu``) against its reference, its rows bitwise independent of the row
  count, a row-dependent chunk caught;
* the launches: a fused pass is 5 Pallas calls per layer with fused q|k|v and gate|up
  weights (7 with separate q, k, v) plus the head, counted in its jaxpr;
* generation: ``ar`` (batch of two) and ``tree`` under ``"fused"`` give the reference's
  greedy tokens;
* the Triton lowering accepts the kernels at the model shapes (SmolLM2, Llama-7B; the norm
  kernel at Qwen3-0.6B's and OLMo-2-13B's);
* bad input: one-line errors.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kernels, models
from specjax.attention import attention_reference
from specjax.cache import advance, init_cache
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.kernel_options import KernelOptions
from specjax.kernels.attention_ordered_gpu import (GpuOrderedBlockSizes, check_packed,
                                                   ordered_attention_gpu,
                                                   ordered_attention_packed_gpu, packed_links)
from specjax.kernels.layout import round_up as layout_round_up
from specjax.kernels.norm_gpu import (GpuNormBlockSizes, norm_groups_gpu,
                                      norm_groups_reference)
from specjax.kernels.linear_gpu import (GpuLinearBlockSizes, check_rope_into, check_supported,
                                        fused_linear_gpu, fused_linear_reference,
                                        qkv_rope_into_gpu, qkv_rope_into_reference)
from specjax.models import decoder
from specjax.models.layers import rope_tables, write_rope_rows
from specjax.tree import ancestor_mask

from conftest import random_prompt
from kernel_rows import NODE, NODES, lone_node_inputs, the_node_alone
from tolerances import assert_sums_close, forward_sums
from test_kernels import Case, make_inputs, reference

# One kernel call against its reference: a norm and one K_IN-term product per output (two
# chained for SwiGLU), outputs up to ~16 here. fp32: atol + rtol * |want| = 2e-5 * (1 +
# |want|) exceeds sum_tolerance(longest_sum=K_IN, stages=2, magnitude=|want|) = 3.8e-6 *
# |want| (tests/tolerances.py) at every size; bf16: the inputs' and the output's rounding,
# 2**-8 relative each.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
L, K_IN, N_OUT = 3, 64, 96


def _arrays(dtype, rows=5, seed=0, k_in=K_IN, n_out=N_OUT):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (rows, k_in))
    w = 0.2 * jax.random.normal(ks[1], (L, k_in, 2 * n_out))
    w2 = 0.2 * jax.random.normal(ks[2], (L, k_in, n_out))
    norm = 1 + 0.1 * jax.random.normal(ks[3], (L, k_in))
    bias = 0.1 * jax.random.normal(ks[4], (L, 2 * n_out))
    residual = jax.random.normal(ks[5], (rows, n_out))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return tuple(map(cast, (x, w, w2, norm, bias, residual)))


def forms(n_out: int) -> dict:
    """name -> kwargs builder over (x, w, w2, norm, bias, residual) of :func:`_arrays`."""
    return {
        "plain": lambda x, w, w2, n, b, r: dict(weights=(w2,)),
        "norm-bias-residual": lambda x, w, w2, n, b, r: dict(
            weights=(w,), norm=n, biases=(b,), residual=r, offsets=(n_out,), width=n_out),
        "swiglu-fused-matrix": lambda x, w, w2, n, b, r: dict(
            weights=(w, w), norm=n, biases=(b, b), offsets=(0, n_out), width=n_out),
        "swiglu-two-matrices": lambda x, w, w2, n, b, r: dict(
            weights=(w2, w), offsets=(0, 0), width=n_out),
    }


FORMS = forms(N_OUT)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_kernel_matches_reference(form, dtype):
    x, *rest = _arrays(dtype)
    kwargs = FORMS[form](x, *rest)
    got = fused_linear_gpu(x, layer=jnp.int32(1), interpret=True, **kwargs)
    want = fused_linear_reference(x, layer=jnp.int32(1), **kwargs)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert bool(jnp.all(jnp.isfinite(got)))  # every output element written
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("form,activation,dtype", [
    ("swiglu-fused-matrix", "gelu_tanh", jnp.bfloat16), ("norm-bias-residual", "gelu",
                                                        jnp.float32)],
    ids=["geglu-bf16", "erf-gelu-one-matrix-fp32"])
def test_activation_epilogue_matches_reference(form, activation, dtype):
    """Gemma's GeGLU (two ranges, the tanh GELU of the gate) and GPT-NeoX's up projection
    (one range, the erf GELU) in the epilogue."""
    x, *rest = _arrays(dtype)
    kwargs = dict(FORMS[form](x, *rest), activation=activation)
    got = fused_linear_gpu(x, layer=jnp.int32(1), interpret=True, **kwargs)
    want = fused_linear_reference(x, layer=jnp.int32(1), **kwargs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    plain = fused_linear_reference(x, layer=jnp.int32(1), **FORMS[form](x, *rest))
    assert not np.allclose(np.asarray(got, np.float32), np.asarray(plain, np.float32))


def test_transposed_head_in_float32():
    """The tied-embedding head: weight [V, d] unstacked, norm folded in, float32 logits."""
    x, *_ = _arrays(jnp.bfloat16)
    table = (0.5 * jax.random.normal(jax.random.PRNGKey(3), (128, K_IN))).astype(jnp.bfloat16)
    norm = jnp.linspace(0.5, 1.5, K_IN).astype(jnp.bfloat16)
    kwargs = dict(norm=norm, transposed=True, float32_out=True)
    got = fused_linear_gpu(x, (table,), interpret=True, **kwargs)
    want = fused_linear_reference(x, (table,), **kwargs)
    assert got.dtype == jnp.float32 and got.shape == (5, 128)
    # bf16 products summed in fp32 over K_IN terms in two orders.
    assert_sums_close(got, want, longest_sum=K_IN, stages=2)


@pytest.mark.parametrize("rows", [5, 16, 17, 64])
def test_rows_are_bitwise_independent_of_the_row_count(rows):
    x, w, w2, norm, bias, residual = _arrays(jnp.float32, rows=rows, seed=rows)
    r = jnp.zeros((rows, N_OUT)) + residual[:1]
    kwargs = dict(weights=(w, w), norm=norm, biases=(bias, bias), offsets=(0, N_OUT),
                  width=N_OUT, layer=jnp.int32(2))
    together = fused_linear_gpu(x, residual=r, interpret=True, **kwargs)
    for row in {0, rows // 2, rows - 1}:
        alone = fused_linear_gpu(x[row:row + 1], residual=r[row:row + 1], interpret=True,
                                 **kwargs)
        np.testing.assert_array_equal(together[row], alone[0])


def test_a_row_dependent_tiling_is_caught():
    """The comparison above detects the bug the tiling rules out: a reduction chunk chosen
    from the row count (here 16 for one row, 64 for many) changes a row's last bits."""
    x, w, *_ = _arrays(jnp.float32, rows=32, seed=4)
    x = x * jnp.logspace(-3, 3, K_IN)  # terms of very different sizes: order matters
    kwargs = dict(weights=(w,), layer=jnp.int32(0))
    many = fused_linear_gpu(x, block_sizes=GpuLinearBlockSizes(block_k=64), interpret=True,
                            **kwargs)
    differs = 0
    for row in range(32):
        one = fused_linear_gpu(x[row:row + 1], block_sizes=GpuLinearBlockSizes(block_k=16),
                               interpret=True, **kwargs)
        differs += int(np.any(np.asarray(one[0]) != np.asarray(many[row])))
    assert differs > 0


def test_block_sizes_depend_on_the_shape_only():
    sizes = GpuLinearBlockSizes()
    assert sizes.resolve(576, 960) == sizes.resolve(576, 960)
    resolved = sizes.resolve(576, 960)
    assert resolved.block_k == 64 and 960 % resolved.block_n == 0 and resolved.block_rows == 16


@pytest.mark.parametrize("call,message", [
    (lambda: check_supported(jnp.zeros((2, 60)), [jnp.zeros((60, 64))]),
     "must be multiples of 16"),
    (lambda: check_supported(jnp.zeros((2, 64)), [jnp.zeros((64, 64))],
                             block_sizes=GpuLinearBlockSizes(block_n=128)),
     "not multiples of the blocks"),
    (lambda: check_supported(jnp.zeros((2, 64)), [jnp.zeros((32, 64))]),
     "does not take 64 input features"),
    (lambda: check_supported(jnp.zeros((2, 64)), [jnp.zeros((64, 64))], offsets=(32,),
                             width=64),
     "outside weight"),
    (lambda: check_supported(jnp.zeros((2, 64), jnp.int32), [jnp.zeros((64, 64))]),
     "dtype int32"),
    (lambda: check_supported(jnp.zeros((2, 64)), [jnp.zeros((64, 64))],
                             block_sizes=GpuLinearBlockSizes(block_n=24)), "power of two"),
])
def test_bad_input_is_one_line(call, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_fallback_takes_shapes_the_kernel_does_not():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 97))  # 97 columns: no 16-wide block
    with pytest.raises(InvalidArgumentError):
        kernels.fused_linear(x, (w,))
    got = kernels.fused_linear(x, (w,), fallback=True)
    # The fallback is the reference's own jnp product; rtol 1e-6 ~ u * sqrt(64) * 2 allows
    # XLA to fuse it differently inside the wrapper.
    np.testing.assert_allclose(got, fused_linear_reference(x, (w,)), rtol=1e-6)


# SmolLM2-135M q|k|v, gate|up, down and tied head; a Llama-7B gate|up; bf16 and fp32.
LOWERING = [((1, 576), (30, 576, 960), (0, 576), 192, None, jnp.bfloat16),
            ((64, 576), (30, 576, 3072), (0, 1536), 1536, None, jnp.bfloat16),
            ((16, 1536), (30, 1536, 576), (0,), 576, None, jnp.float32),
            ((1, 576), (49152, 576), (0,), 49152, "head", jnp.bfloat16),
            ((32, 4096), (32, 4096, 22016), (0, 11008), 11008, None, jnp.bfloat16)]


def test_kernel_lowers_for_triton():
    """Pallas-level legality of the real Triton lowering (power-of-two tiles, ops)."""
    sds = jax.ShapeDtypeStruct
    for x_shape, w_shape, offsets, width, kind, dtype in LOWERING:
        head = kind == "head"
        weights = (sds(w_shape, dtype),) * len(offsets)
        norm = sds((w_shape[-1],) if head else (w_shape[0], w_shape[1]), dtype)
        lowered = fused_linear_gpu.trace(
            sds(x_shape, dtype), weights, norm=norm, layer=None if head else sds((), jnp.int32),
            offsets=offsets, width=width, transposed=head, float32_out=head,
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


def test_ordered_attention_lowers_for_triton():
    sds = jax.ShapeDtypeStruct
    # SmolLM2 decode and a 64-node verify; a Llama-7B (MHA, D=128) verify.
    for t, h, k, d, s, layers, dtype in [(1, 9, 3, 64, 2048, 30, jnp.bfloat16),
                                         (64, 9, 3, 64, 2048, 30, jnp.float32),
                                         (64, 32, 32, 128, 4096, 32, jnp.bfloat16)]:
        lowered = ordered_attention_gpu.trace(
            sds((t, h, d), dtype), sds((t, k, d), dtype), sds((t, k, d), dtype),
            sds((layers, s, k, d), dtype), sds((layers, s, k, d), dtype), sds((), jnp.int32),
            sds((t, t), jnp.bool_), layer=sds((), jnp.int32),
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


# --- position-ordered attention ---------------------------------------------------------

ORDERED_CASES = [
    Case("decode-g1-f32", 1, 2, 2, 64, 64, 37, tree=False),
    Case("tree-g3-bf16", 7, 6, 2, 64, 96, 77, dtype=jnp.bfloat16),
    Case("tree-g4-d128-aligned-f32", 20, 8, 2, 128, 64, 32),  # length on a block edge
    Case("tree-g2-length0-f32", 5, 4, 2, 32, 48, 0),
    Case("prefill-no-cache-f32", 19, 4, 1, 64, None, 0, tree=False),
    # Phi-3's head size (the GPU kernels' tiles 128 wide over the cache's and the packed
    # rows' 96 columns, loaded masked: the interpreter reads NaN past a dimension) and
    # Gemma's (8-position blocks on the GPU), the length mid-block
    Case("tree-g2-d96-f32", 6, 4, 2, 96, 64, 21),
    Case("tree-g4-d256-bf16", 5, 4, 1, 256, 32, 13, dtype=jnp.bfloat16),
    # Phi-2's (80 of the 128-wide tiles' columns), the length mid-block
    Case("tree-g3-d80-bf16", 5, 6, 2, 80, 48, 29, dtype=jnp.bfloat16),
]


def check_ordered_against_reference(kernel, case):
    """``kernel(*args, interpret=True)`` equals the reference on ``case`` (both variants'
    tests): shape, dtype, every output written, values within the dtype's tolerance."""
    args, reference_args = make_inputs(case, seed=ORDERED_CASES.index(case))
    out = kernel(*args, interpret=True)
    expected = reference(*reference_args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "unwritten or poisoned output"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol)


WINDOW_CASE = Case("tree-window-f32", 12, 4, 2, 32, 64, 20)


def check_windows_against_reference(kernel, case=WINDOW_CASE, seed=7):
    """Soft-capped scores and a 6-position window per query (cutting the cache for every
    node, and the deeper nodes' chains), by position in ``kernel`` (interpreted), against
    the jnp attention given the window as the models give it (the mask among the new
    tokens cut, ``first_visible`` for the cache); each shown sharp: without the cap, or
    with every window one position later, the outputs are far off. Returns the output."""
    args, reference_args = make_inputs(case, seed=seed)
    _, _, _, _, _, length, mask, _ = args
    depth = jnp.sum(mask, axis=1, dtype=jnp.int32) - 1
    first = length + depth - 5

    def expected(softcap, first):
        near = (length + depth)[None, :] >= first[:, None]
        return np.asarray(attention_reference(*reference_args[:6], mask & near,
                                              softcap=softcap, first_visible=first))

    out = kernel(*args, interpret=True, softcap=2.0, first_visible=first)
    got = np.asarray(out)
    np.testing.assert_allclose(got, expected(2.0, first), rtol=2e-5, atol=2e-5)
    assert np.abs(got - expected(None, first)).max() > 1e-2, "softcap not seen"
    assert np.abs(got - expected(2.0, first + 1)).max() > 1e-2, "window off by one not seen"
    return out


def test_ordered_attention_with_softcap_and_windows_matches_reference():
    """:func:`check_windows_against_reference`, and the packed kernel bit for bit the
    unpacked one."""
    case = WINDOW_CASE
    out = check_windows_against_reference(ordered_attention_gpu)
    args = make_inputs(case, seed=7)[0]
    q, length, mask = args[0], args[5], args[6]
    first = length + jnp.sum(mask, axis=1, dtype=jnp.int32) - 1 - 5
    extras = dict(softcap=2.0, first_visible=first)
    packed_args, _, t = _packed_case(case, seed=7)
    got = ordered_attention_packed_gpu(*packed_args, num_heads=q.shape[1], interpret=True,
                                       **extras)
    assert bool(jnp.all(got[:t].reshape(out.shape) == out))


@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: c.name)
def test_ordered_attention_matches_reference(case):
    check_ordered_against_reference(ordered_attention_gpu, case)


def ordered_row_alone_and_together(kernel, dim: int, sizes_for, **extras):
    """(node 9 of :func:`kernel_rows.lone_node_inputs`' 16-node call over a 300-slot cache,
    with heads of ``dim``; the same node alone, a one-token step), each by ``kernel``
    (interpreted) with the block sizes ``sizes_for(rows)`` gives for that many rows, and
    ``extras`` (``first_visible`` [16] is cut to the node's alone). Output rows as float32
    numpy arrays [H, D]."""
    args, _ = lone_node_inputs(6, jnp.float32, heads=4, dim=dim)
    first = extras.pop("first_visible", None)
    windows = ({}, {}) if first is None else ({"first_visible": first},
                                             {"first_visible": first[NODE:NODE + 1]})
    together = kernel(*args, block_sizes=sizes_for(NODES), interpret=True, **windows[0],
                      **extras)
    alone = kernel(*the_node_alone(args), block_sizes=sizes_for(1), interpret=True,
                   **windows[1], **extras)
    return np.asarray(together[NODE], np.float32), np.asarray(alone[0], np.float32)


@pytest.mark.parametrize("dim", [80, 96, pytest.param(256, marks=pytest.mark.slow)])
def test_ordered_rows_of_phi_and_gemma_heads_do_not_depend_on_the_row_count(dim):
    """At Phi-2's, Phi-3's and Gemma's head sizes (tiles 128, 128 and 256 wide; 16-, 16- and
    8-position blocks, chosen from the head size) a query row's output is bitwise the same
    alone and among 16 rows; with the block chosen from the row count instead (8 positions alone, 16
    together: the deliberately wrong variant) it is not."""
    right = GpuOrderedBlockSizes().resolve(dim)
    together, alone = ordered_row_alone_and_together(
        ordered_attention_gpu, dim, lambda rows: GpuOrderedBlockSizes())
    np.testing.assert_array_equal(together, alone)
    together, alone = ordered_row_alone_and_together(
        ordered_attention_gpu, dim,
        lambda rows: GpuOrderedBlockSizes(block_kv=8 if rows == 1 else 16))
    assert np.any(together != alone)
    assert right == (8 if dim == 256 else 16)


def test_ordered_attention_refuses_what_it_does_not_order():
    q = jnp.zeros((2, 2, 64))
    kv = jnp.zeros((2, 2, 64))
    cache = jnp.zeros((50, 2, 64))  # capacity not a multiple of the 16-slot block
    mask = jnp.eye(2, dtype=bool)
    with pytest.raises(InvalidArgumentError, match="not a multiple of block_kv") as info:
        ordered_attention_gpu(q, kv, kv, cache, cache, jnp.int32(3), mask, interpret=True)
    assert "\n" not in str(info.value)
    window = jnp.ones((2, 1), bool)
    with pytest.raises(InvalidArgumentError, match="scratch window"):
        ordered_attention_gpu(q, kv, kv, cache[:48], cache[:48], jnp.int32(3), mask, window,
                              interpret=True)


def _packed_case(case, seed):
    """(packed-kernel arguments, the ordered kernel's output, T) for ``case``: the new
    tokens' q|k|v rows as layer 1 of a two-layer packed buffer, with a tile of padding rows
    past them (as a one-token step padded to 64 rows has), the cache as layer 1 of a
    two-layer cache; layer 0 of both NaN (never read)."""
    args, _ = make_inputs(case, seed=seed)
    q, k_new, v_new, k_cache, v_cache, length, mask, _ = args
    expected = ordered_attention_gpu(q, k_new, v_new, k_cache, v_cache, length, mask,
                                     interpret=True)
    t, h, d = q.shape
    rows = -(-t // 16) * 16 + 16
    rows_t = jnp.pad(jnp.concatenate([q, k_new, v_new], axis=1),
                     ((0, rows - t), (0, 0), (0, 0)))
    packed = jnp.stack([jnp.full_like(rows_t, jnp.nan), rows_t])
    if k_cache is not None:
        k_cache, v_cache = (jnp.stack([jnp.full_like(c, jnp.nan), c]) for c in (k_cache, v_cache))
    links, depth = packed_links(mask, rows)
    return (packed, jnp.int32(1), k_cache, v_cache, length, links, depth), expected, t


@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: c.name)
def test_packed_attention_is_bitwise_the_ordered_kernel(case):
    """The packed kernel (q|k|v rows read in place, output row-major) computes what the
    ordered kernel does, bit for bit, and reads nothing of other layers or past the cache's
    length (NaN there); its padding rows are written and finite, and a tile of padding
    rows only is zero (it reads nothing)."""
    args, expected, t = _packed_case(case, ORDERED_CASES.index(case))
    num_heads = expected.shape[1]
    out = ordered_attention_packed_gpu(*args, num_heads=num_heads, interpret=True)
    assert out.shape == (args[0].shape[1], num_heads * case.head_dim)
    assert out.dtype == case.dtype
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), "unwritten or poisoned output"
    assert bool(jnp.all(out[:t].reshape(expected.shape) == expected))
    assert bool(jnp.all(out[-16:] == 0))


def test_packed_attention_catches_a_misread_chain():
    """The bitwise comparison above fails when the kernel reads a chain slot off by one
    (links shifted by a slot): it checks the gather, not just the cache part."""
    case = ORDERED_CASES[1]  # a 7-node tree
    args, expected, t = _packed_case(case, 1)
    links = jnp.roll(args[5], 1, axis=1)
    out = ordered_attention_packed_gpu(*args[:5], links, args[6],
                                       num_heads=expected.shape[1], interpret=True)
    assert not bool(jnp.all(out[:t].reshape(expected.shape) == expected))


@pytest.mark.parametrize("shape,cache,heads,message", [
    ((2, 16, 7, 64), (2, 64, 2, 64), 4, "not 4 query heads"),
    ((2, 16, 8, 40), (2, 64, 2, 40), 4, "head_dim 40"),  # not a multiple of 16
    ((2, 16, 8, 272), (2, 64, 2, 272), 4, "head_dim 272"),  # over 256
    ((2, 20, 8, 64), (2, 64, 2, 64), 4, "not a multiple of block_rows"),
    ((2, 16, 8, 64), (2, 50, 2, 64), 4, "not a multiple of block_kv"),
    ((2, 16, 8, 64), (2, 64, 3, 64), 4, "does not match"),
])
def test_packed_attention_bad_input_is_one_line(shape, cache, heads, message):
    packed = jnp.zeros(shape, jnp.float32)
    k_cache = jnp.zeros(cache, jnp.float32)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        check_packed(packed, k_cache, k_cache, num_heads=heads)
    assert "\n" not in str(info.value)
    assert not kernels.packed_attention_takes(shape, jnp.float32, k_cache, k_cache,
                                              num_heads=heads, variant="gpu")
    assert not kernels.packed_attention_takes((2, 16, 8, 64), jnp.float32, None, None,
                                              num_heads=4, variant="tpu")
    with pytest.raises(InvalidArgumentError, match="GPU kernel only") as info:
        kernels.ordered_attention_packed(packed, 0, k_cache, k_cache, 0, None, None,
                                         num_heads=heads, variant="tpu")
    assert "\n" not in str(info.value)


def test_packed_attention_lowers_for_triton():
    sds = jax.ShapeDtypeStruct
    # SmolLM2 decode and a 64-node verify; a Llama-7B (MHA, D=128) verify.
    for rows, h, k, d, s, layers, dtype in [(16, 9, 3, 64, 2048, 30, jnp.bfloat16),
                                            (64, 9, 3, 64, 2048, 30, jnp.float32),
                                            (64, 32, 32, 128, 4096, 32, jnp.bfloat16)]:
        width = 16 + layout_round_up(rows, 16) + 16
        lowered = ordered_attention_packed_gpu.trace(
            sds((layers, rows, h + 2 * k, d), dtype), sds((), jnp.int32),
            sds((layers, s, k, d), dtype), sds((layers, s, k, d), dtype), sds((), jnp.int32),
            sds((rows, width), jnp.int32), sds((rows,), jnp.int32), num_heads=h,
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


# --- q|k|v with RoPE, written into the packed buffer ---------------------------------------

ROPE_HEADS, ALL_HEADS, HEAD_DIM = 6, 8, 64  # 4 query + 2 key heads rotated, 2 value heads


def _rope_arrays(dtype, rows=16, seed=0, bias=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (rows, K_IN)).astype(dtype)
    w = (0.2 * jax.random.normal(ks[1], (L, K_IN, ALL_HEADS * HEAD_DIM))).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(ks[2], (L, K_IN))).astype(dtype)
    b = (0.1 * jax.random.normal(ks[3], (L, ALL_HEADS * HEAD_DIM))).astype(dtype)
    config = _tiny_config(num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM)
    cos, sin = rope_tables(config, 7 + jnp.arange(rows))
    packed = jnp.full((L, rows, ALL_HEADS, HEAD_DIM), jnp.nan, dtype)  # NaN: never written
    return packed, x, w, cos, sin, dict(norm=norm, bias=b if bias else None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_qkv_rope_kernel_matches_reference_and_writes_one_layer(dtype, bias):
    packed, x, w, cos, sin, kwargs = _rope_arrays(dtype, bias=bias)
    layer = jnp.int32(1)
    got = qkv_rope_into_gpu(packed, x, w, cos, sin, layer, rope_heads=ROPE_HEADS,
                            interpret=True, **kwargs)
    want = qkv_rope_into_reference(packed, x, w, cos, sin, layer, rope_heads=ROPE_HEADS,
                                   **kwargs)
    assert got.shape == packed.shape and got.dtype == dtype
    assert bool(jnp.all(jnp.isnan(got[0]))) and bool(jnp.all(jnp.isnan(got[2])))
    assert bool(jnp.all(jnp.isfinite(got[1])))  # every element of the layer written
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    # The projection is the linear kernel's, bit for bit (nothing rotated: rope_heads=0).
    plain = qkv_rope_into_gpu(packed, x, w, cos, sin, layer, rope_heads=0, interpret=True,
                              **kwargs)
    linear = fused_linear_gpu(x, (w,), norm=kwargs["norm"], biases=(kwargs["bias"],),
                              layer=layer, interpret=True)
    np.testing.assert_array_equal(plain[1].reshape(x.shape[0], -1), linear)
    # The value heads are written as projected.
    np.testing.assert_array_equal(got[1, :, ROPE_HEADS:], plain[1, :, ROPE_HEADS:])


def test_a_rotated_value_head_is_caught():
    """The reference comparison above fails for a kernel that also rotates a value head."""
    packed, x, w, cos, sin, kwargs = _rope_arrays(jnp.float32)
    layer = jnp.int32(2)
    wrong = qkv_rope_into_gpu(packed, x, w, cos, sin, layer, rope_heads=ROPE_HEADS + 1,
                              interpret=True, **kwargs)
    want = qkv_rope_into_reference(packed, x, w, cos, sin, layer, rope_heads=ROPE_HEADS,
                                   **kwargs)
    assert not np.allclose(wrong[2], want[2], rtol=TOLERANCE[jnp.float32],
                           atol=TOLERANCE[jnp.float32])


def test_qkv_rope_rows_are_bitwise_independent_of_the_row_count():
    packed, x, w, cos, sin, kwargs = _rope_arrays(jnp.float32, rows=48, seed=3)
    many = qkv_rope_into_gpu(packed, x, w, cos, sin, jnp.int32(0), rope_heads=ROPE_HEADS,
                             interpret=True, **kwargs)
    for row in (0, 17, 47):  # alone, padded to one 16-row tile as the models pad it
        pad = lambda a: jnp.pad(a[row:row + 1], ((0, 15), (0, 0)))  # noqa: E731
        one = qkv_rope_into_gpu(packed[:, :16], pad(x), w, pad(cos), pad(sin), jnp.int32(0),
                                rope_heads=ROPE_HEADS, interpret=True, **kwargs)
        np.testing.assert_array_equal(one[0, 0], many[0, row])


def test_qkv_rope_dispatch_falls_back_where_the_kernel_does_not_take_the_shape():
    """Half a head of 8 columns (head_dim 16) is under one Triton tile: the dispatcher
    projects with the linear kernel and rotates and writes with jnp."""
    packed, x, w, cos, sin, kwargs = _rope_arrays(jnp.float32)
    packed16 = packed.reshape(L, 16, ALL_HEADS * 4, 16)
    cos16, sin16 = cos[:, :16], sin[:, :16]
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        check_rope_into(packed16, x, w, cos16, sin16, rope_heads=24, **kwargs)
    got = kernels.qkv_rope_into(packed16, x, w, cos16, sin16, jnp.int32(1), rope_heads=24,
                                **kwargs)
    linear = fused_linear_gpu(x, (w,), norm=kwargs["norm"], biases=(kwargs["bias"],),
                              layer=jnp.int32(1), interpret=True)
    np.testing.assert_array_equal(
        got, write_rope_rows(packed16, linear, jnp.int32(1), cos16, sin16, 24))


@pytest.mark.parametrize("change,message", [
    (dict(packed=jnp.zeros((L, 16, ALL_HEADS * HEAD_DIM))), "must be \\[L, R, heads, D\\]"),
    (dict(packed=jnp.zeros((L, 16, ALL_HEADS, HEAD_DIM), jnp.bfloat16)), "buffer is bfloat16"),
    (dict(x=jnp.zeros((32, K_IN))), "x has 32 rows and the buffer 16"),
    (dict(w=jnp.zeros((L, K_IN, 7 * HEAD_DIM))), "does not fill 3 layers of 8 heads"),
    (dict(cos=jnp.zeros((16, HEAD_DIM), jnp.bfloat16)), "cos table must be float32"),
    (dict(rope_heads=9), "rope_heads=9 outside 0..8"),
    (dict(norm=jnp.zeros((K_IN,))), "norm \\(64,\\) is not"),
])
def test_qkv_rope_bad_input_is_one_line(change, message):
    packed, x, w, cos, sin, kwargs = _rope_arrays(jnp.float32)
    args = dict(packed=packed, x=x, w=w, cos=cos, sin=sin, rope_heads=ROPE_HEADS, **kwargs)
    args.update(change)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        qkv_rope_into_gpu(args["packed"], args["x"], args["w"], args["cos"], args["sin"],
                          jnp.int32(0), norm=args["norm"], bias=args["bias"],
                          rope_heads=args["rope_heads"], interpret=True)
    assert "\n" not in str(info.value)


def test_qkv_rope_kernel_lowers_for_triton():
    sds = jax.ShapeDtypeStruct
    # SmolLM2-135M (9 + 3 + 3 heads of 64) at 16 and 64 rows; Llama-7B (32 * 3 of 128).
    for rows, k_in, heads, rope_heads, d, layers, dtype in [
            (16, 576, 15, 12, 64, 30, jnp.bfloat16), (64, 576, 15, 12, 64, 30, jnp.float32),
            (64, 4096, 96, 64, 128, 32, jnp.bfloat16)]:
        lowered = qkv_rope_into_gpu.trace(
            sds((layers, rows, heads, d), dtype), sds((rows, k_in), dtype),
            sds((layers, k_in, heads * d), dtype), sds((rows, d), jnp.float32),
            sds((rows, d), jnp.float32), sds((), jnp.int32), norm=sds((layers, k_in), dtype),
            rope_heads=rope_heads).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


# --- norms of column groups in place (q/k, output, LayerNorm and 1 + w input norms) ------

def _norm_arrays(dtype, rows=16, width=32, groups=4, seed=0):
    """Rows [rows, 32 + groups * width + 32] (terms of very different sizes, and an offset:
    the order of the sums matters), weights and biases [L, width]."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    columns = 64 + groups * width
    x = 0.5 + jax.random.normal(ks[0], (rows, columns)) * jnp.logspace(-2, 2, columns)
    w = 1 + 0.2 * jax.random.normal(ks[1], (L, width))
    b = 0.2 * jax.random.normal(ks[2], (L, width))
    return x.astype(dtype), w.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("width,groups,kind,bias,dtype", [
    pytest.param(32, 4, "rms", False, jnp.float32, marks=pytest.mark.slow),
    (32, 4, "rms", False, jnp.bfloat16), (128, 1, "layer", True, jnp.float32),
    pytest.param(128, 1, "rms_plus_one", False, jnp.bfloat16, marks=pytest.mark.slow)],
    ids=["per-head-rms-fp32", "per-head-rms-bf16", "whole-layer-bias-fp32",
         "whole-plus-one-bf16"])
def test_group_norm_kernel_matches_reference_and_keeps_other_columns(width, groups, kind,
                                                                     bias, dtype):
    x, w, b = _norm_arrays(dtype, width=width, groups=groups)
    kwargs = dict(start=32, groups=groups, kind=kind, bias=b if bias else None)
    got = norm_groups_gpu(x, w, jnp.int32(1), interpret=True, **kwargs)
    want = norm_groups_reference(x, w, jnp.int32(1), **kwargs)
    end = 32 + groups * width
    for part in (slice(0, 32), slice(end, None)):  # value heads and the like: untouched
        np.testing.assert_array_equal(got[:, part], x[:, part])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_group_norm_rows_are_bitwise_independent_and_a_row_dependent_chunk_is_caught(kind):
    """Each row of a 48-row call is bitwise the row normed in a 16-row call of its own; the
    same comparison fails with the sums chunked by the row count (128 columns at once for
    one tile, 16 at a time for more)."""
    x, w, b = _norm_arrays(jnp.float32, rows=48, width=128, groups=1, seed=3)

    def norm(rows, **kwargs):  # compiled as the path tests compile (see PINNED_ORDER)
        def call(rows, w, b):
            return norm_groups_gpu(rows, w, jnp.int32(0), start=32, groups=1, kind=kind,
                                   bias=b if kind == "layer" else None, interpret=True,
                                   **kwargs)
        return _pinned(call, rows, w, b)(rows, w, b)

    together = norm(x)
    wrong = norm(x, block_sizes=GpuNormBlockSizes(chunk=16))
    differs = 0
    for row in range(0, 48, 5):
        alone = norm(jnp.pad(x[row:row + 1], ((0, 15), (0, 0))))
        np.testing.assert_array_equal(together[row], alone[0])
        differs += int(np.any(np.asarray(wrong[row]) != np.asarray(alone[0])))
    assert differs > 0


@pytest.mark.parametrize("shape,weight,kwargs,message", [
    ((16, 96), (2, 24), dict(start=0, groups=2), "multiple of 16"),
    ((8, 96), (2, 32), dict(start=0, groups=2), "not a multiple of block_rows"),
    ((16, 96), (2, 32), dict(start=64, groups=2), "outside x"),
    ((16, 96), (32,), dict(start=0, groups=2), "weight \\[L, W\\]"),
    ((16, 96), (2, 32), dict(start=0, groups=2, kind="layernorm"), "kind 'layernorm'"),
    ((16, 96), (2, 32), dict(start=0, groups=2, bias=jnp.zeros((2, 32))), "LayerNorm's"),
])
def test_group_norm_bad_input_is_one_line(shape, weight, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        norm_groups_gpu(jnp.zeros(shape), jnp.ones(weight), jnp.int32(0), interpret=True,
                            **kwargs)
    assert "\n" not in str(info.value)


def test_group_norm_and_scaled_attention_lower_for_triton():
    """The norm kernel at Qwen3-0.6B's q|k|v rows (16 + 8 + 8 heads of 128; per head),
    OLMo-2-13B's (40 query heads normed at once: a 5120-wide group), as a LayerNorm with
    biases and a 1 + w RMSNorm; the projection kernel with a GELU epilogue (tanh, gated;
    erf, one matrix); and the packed attention with a query scale of its own (Granite's),
    lower for Triton."""
    sds = jax.ShapeDtypeStruct
    for rows, heads, kv_heads, d, whole, dtype in [(16, 16, 8, 128, False, jnp.bfloat16),
                                                   (64, 16, 8, 128, False, jnp.float32),
                                                   (64, 40, 40, 128, True, jnp.bfloat16)]:
        width, groups = (heads * d, 1) if whole else (d, heads)
        lowered = norm_groups_gpu.trace(
            sds((rows, (heads + 2 * kv_heads) * d), dtype), sds((28, width), dtype),
            sds((), jnp.int32), start=0, groups=groups).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    # Gemma-2B's GeGLU (2048 -> 2 x 16384) and Pythia-1B's erf-GELU up projection.
    for weights, offsets, width, activation in (((32768,) * 2, (0, 16384), 16384, "gelu_tanh"),
                                                ((8192,), (0,), 8192, "gelu")):
        lowered = fused_linear_gpu.trace(
            sds((16, 2048), jnp.bfloat16), tuple(sds((18, 2048, n), jnp.bfloat16)
                                                 for n in weights),
            layer=sds((), jnp.int32), offsets=offsets, width=width, activation=activation,
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    # StableLM-2-1.6B's LayerNorm with biases (2048 wide) and Gemma-2B's 1 + w (2048).
    for kind, bias in (("layer", True), ("rms_plus_one", False)):
        lowered = norm_groups_gpu.trace(
            sds((16, 2048), jnp.bfloat16), sds((24, 2048), jnp.bfloat16), sds((), jnp.int32),
            start=0, groups=1, kind=kind, bias=sds((24, 2048), jnp.bfloat16) if bias else None,
        ).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    lowered = ordered_attention_packed_gpu.trace(
        sds((40, 64, 32 + 2 * 8, 128), jnp.bfloat16), sds((), jnp.int32),
        sds((40, 4096, 8, 128), jnp.bfloat16), sds((40, 4096, 8, 128), jnp.bfloat16),
        sds((), jnp.int32), sds((64, 96), jnp.int32), sds((64,), jnp.int32), num_heads=32,
        scale=0.0078125).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    # Soft-capped scores and a window per query, at Qwen3-8B's 32 / 8 heads of 128.
    for kernel, args in (
            (ordered_attention_packed_gpu, (
                sds((36, 64, 48, 128), jnp.bfloat16), sds((), jnp.int32),
                sds((36, 4096, 8, 128), jnp.bfloat16), sds((36, 4096, 8, 128), jnp.bfloat16),
                sds((), jnp.int32), sds((64, 96), jnp.int32), sds((64,), jnp.int32))),
            (ordered_attention_gpu, (
                sds((64, 32, 128), jnp.bfloat16), sds((64, 8, 128), jnp.bfloat16),
                sds((64, 8, 128), jnp.bfloat16), sds((36, 4096, 8, 128), jnp.bfloat16),
                sds((36, 4096, 8, 128), jnp.bfloat16), sds((), jnp.int32),
                sds((64, 64), jnp.bool_)))):
        extra = dict(num_heads=32) if kernel is ordered_attention_packed_gpu else dict(
            layer=sds((), jnp.int32))
        lowered = kernel.trace(*args, softcap=50.0, first_visible=sds((64,), jnp.int32),
                               scale=0.0625, **extra).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()


# --- whole models ---------------------------------------------------------------------

def _tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=256)
    return ModelConfig("llama", **{**base, **overrides})


def _params(config, seed=0, fused=False):
    params = models.init_params(config, jax.random.PRNGKey(seed))
    # Larger weights than the N(0, 0.02) init: logits spread over several units.
    params = jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, params)
    return models.fuse_projections(config, params) if fused else params


def _prefilled(config, params, prompt_length=12, capacity=64):
    prompt = jax.random.randint(jax.random.PRNGKey(1), (prompt_length,), 0, config.vocab_size)
    cache = init_cache(config, capacity, params["embed"].dtype)
    _, cache = models.forward(params, config, prompt, jnp.arange(prompt_length), cache,
                              attn_impl="reference")
    return advance(cache, prompt_length)


MODEL_CASES = {
    "gqa-tied": (dict(), False),
    "mha-untied-bias-fused-projections": (dict(num_kv_heads=4, tie_word_embeddings=False,
                                               qkv_bias=True), True),
    "features": ("features", True),  # CONFIGS below
    "olmo-norms": ("olmo-norms", False),
    "windows": ("windows", False),
}


@pytest.mark.parametrize("case", [
    "gqa-tied", pytest.param("mha-untied-bias-fused-projections", marks=pytest.mark.slow),
    pytest.param("features", marks=pytest.mark.slow),
    pytest.param("olmo-norms", marks=pytest.mark.slow),
    pytest.param("windows", marks=pytest.mark.slow)])
def test_fused_model_matches_reference_and_root_is_bitwise(case):
    overrides, fused = MODEL_CASES[case]
    config = _tiny_config(**(CONFIGS[overrides] if isinstance(overrides, str) else overrides))
    params = _feature_params(config)
    params = models.fuse_projections(config, params) if fused else params
    cache = _prefilled(config, params)
    parents = [-1, 0, 0, 1, 3, 2, 0, 6, 7, 7, 1, 4, 11, 12, 5, 2, 15]  # 17 nodes
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    tokens = jax.random.randint(jax.random.PRNGKey(2), (len(parents),), 0, config.vocab_size)
    positions = 12 + jnp.asarray(depth, jnp.int32)
    mask = ancestor_mask(jnp.asarray(parents, jnp.int32), jnp.ones(len(parents), bool))

    def run(impl, count):
        return jax.jit(lambda c: models.forward(
            params, config, tokens[:count], positions[:count], c, mask[:count, :count],
            attn_impl=impl)[0])(cache)

    reference = run("reference", len(parents))
    one = run("fused", 1)
    for count in (3, len(parents)):
        fused_logits = run("fused", count)
        # Other kernels, other summation orders: bounded by the pass's sums.
        assert_sums_close(fused_logits, reference[:count], **forward_sums(config, 12 + count))
        np.testing.assert_array_equal(fused_logits[0], one[0])  # bit for bit


def _pallas_calls(jaxpr) -> list[str]:
    """Names of the Pallas calls in a jaxpr, a scan's body counted once (one layer)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name")))
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += _pallas_calls(sub)
    return names


@pytest.mark.parametrize("fused_projections,head_dim,per_layer,qkv", [
    (False, 16, 7, "fused_linear_gpu"), (True, 16, 5, "fused_linear_gpu"),
    (True, 32, 5, "qkv_rope_into_gpu")],
    ids=["separate", "fused-projections", "fused-projections-rope-kernel"])
def test_kernel_calls_per_layer(fused_projections, head_dim, per_layer, qkv):
    """A fused verify pass is ``per_layer`` Pallas calls per layer plus the head: q|k|v
    (one call over the fused matrix; else three), attention, o, gate|up and down. With
    fused weights and half a head of at least one 16-column tile, the q|k|v call is the
    kernel that also applies RoPE and writes the packed rows. The logits agree with the
    reference."""
    config = _tiny_config(num_kv_heads=4, tie_word_embeddings=False, qkv_bias=True,
                          head_dim=head_dim)
    params = _params(config, fused=fused_projections)
    cache = _prefilled(config, params)
    tokens, positions = jnp.arange(3, dtype=jnp.int32), 12 + jnp.arange(3, dtype=jnp.int32)

    def run(impl):
        return models.forward(params, config, tokens, positions, cache, attn_impl=impl)[0]

    calls = _pallas_calls(jax.make_jaxpr(lambda: run("fused"))().jaxpr)
    assert len(calls) == per_layer + 1, calls
    # The packed kernel, which reads the layer's q|k|v rows in place (the GPU variant).
    assert sum("ordered_attention_packed" in name for name in calls) == 1, calls
    assert calls[0] == qkv, calls
    # Other kernels, other summation orders: bounded by the pass's sums.
    assert_sums_close(jax.jit(lambda: run("fused"))(), jax.jit(lambda: run("reference"))(),
                      **forward_sums(config, 15))


TREE_PARENTS = [-1, 0, 0, 1, 3, 2, 0, 6, 7, 7, 1, 4, 11, 12, 5, 2, 15]  # 17 nodes, depth 6


# The interpreted kernels run as XLA CPU programs, so LLVM's optimiser on this CPU may
# reorder what the kernels write (vector width and FMA contraction differ between AVX2 and
# AVX-512 machines: at its default level the right kernel failed this comparison on an AMD
# Zen 3 and passed on an Intel Xeon). Compiled without the backend's optimisations, the sums
# run in the order the kernel code states, which is the property under test (on a GPU the
# kernel's own tiles fix the order), and the result is the same on every x86-64.
PINNED_ORDER = {"xla_backend_optimization_level": 0}


def _pinned(function, *args):
    """``function`` compiled for ``args`` with :data:`PINNED_ORDER`."""
    return jax.jit(function).lower(*args).compile(compiler_options=PINNED_ORDER)


def _path_versus_tree(config, params, prompt_length, options=KernelOptions(attention="fused")):
    """For the two deepest leaves of :data:`TREE_PARENTS`: per node on the root-to-leaf
    path, whether ``ar``'s one-token step (after committing the path before it) gives
    bitwise the logits of that node in the one verify pass over the whole tree (both with
    ``options``, compiled as :func:`_pinned`)."""
    cache = _prefilled(config, params, prompt_length)
    depth = []
    for p in TREE_PARENTS:
        depth.append(0 if p < 0 else depth[p] + 1)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (len(depth),), 0, config.vocab_size)
    positions = prompt_length + jnp.asarray(depth, jnp.int32)
    mask = ancestor_mask(jnp.asarray(TREE_PARENTS, jnp.int32), jnp.ones(len(depth), bool))
    tree = _pinned(lambda c: models.forward(params, config, tokens, positions, c, mask,
                                            attn_impl=options)[0], cache)(cache)
    step = _pinned(lambda c, t, p: models.forward(params, config, t[None], p[None], c,
                                                  attn_impl=options),
                   cache, tokens[0], positions[0])
    same = []
    for leaf in (13, 16):
        path, node = [], leaf
        while node >= 0:
            path.insert(0, node)
            node = TREE_PARENTS[node]
        c = cache
        for node in path:
            logits, c = step(c, tokens[node], positions[node])
            c = advance(c, 1)
            same.append(bool(jnp.all(logits[0] == tree[node])))
    return same


def _unpacked(monkeypatch):
    """Fused layers without the packed attention kernel (as under a tensor-parallel mesh):
    q, k, v, RoPE'd outside, through :func:`kernels.ordered_attention`."""
    monkeypatch.setattr(kernels, "packed_attention_takes", lambda *args, **kwargs: False)


# Every feature the fused layers take beyond Llama's (decoder.block_fused's docstring), in one
# config: scaled embeddings, Granite's multipliers (embeddings, residual adds, logits), a
# query scale, a head bias, a logit scale and final soft-capping (elementwise between the
# kernels, or the score scale in the attention kernel); partial RoPE (16 of 32 dims) and a
# NoPE layer (the rotation tables); per-head q/k norms and norms on the attention and MLP
# outputs (the row-tiled norm kernel; the 32-wide heads and 64-wide rows let a wrong
# variant sum them in two or four chunks).
FEATURES = dict(embed_scale=True, embed_multiplier=1.5, residual_multiplier=0.3,
                logits_divisor=3.0, logit_scale=1.3, final_softcap=20.0, query_scale=0.2,
                head_bias=True, tie_word_embeddings=False, head_dim=32, rotary_dim=16,
                no_rope_layers=(1, 0), qk_norm=True, sandwich_norms=True)


def _feature_params(config, dtype=jnp.float32):
    """:func:`_params` with the q/k and output norms' weights and the head bias away from
    their 1 and 0, and with a LayerNorm or ``1 + w`` RMSNorm every norm's weight and every
    bias."""
    params = _params(config)
    names = ["q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"]
    if config.norm_kind != "rms" or config.norm_plus_one:
        names += [name for name in params["layers"] if name.endswith(("norm", "bias"))
                  or name.startswith("b")]
    keys = jax.random.split(jax.random.PRNGKey(3), len(names) + 2)
    layers = dict(params["layers"])
    for key, name in zip(keys, names):
        if name in layers:
            layers[name] = layers[name] + 0.2 * jax.random.normal(key, layers[name].shape)
    params = {**params, "layers": layers}
    if config.head_bias:
        params["lm_head_bias"] = 0.5 * jax.random.normal(keys[-1], (config.vocab_size,))
    if "final_norm_bias" in params:
        params["final_norm_bias"] = 0.2 * jax.random.normal(keys[-2], (config.hidden_size,))
    return jax.tree.map(lambda a: a.astype(dtype), params)


CONFIGS = {"llama": {}, "features": FEATURES,
           # OLMo 2's layout: q and k each normed over all their heads (one 128-wide group),
           # no norms on the blocks' inputs
           "olmo-norms": dict(FEATURES, qk_norm_whole=True, pre_norms=False),
           # GPT-NeoX's layout: LayerNorms with biases (the norm kernel), the MLP beside
           # attention, two matrices with the erf GELU between them (the epilogue), biases
           # on q|k|v, o and the MLP, RoPE on half of each head; and a head bias
           "layer-norms": dict(norm_kind="layer", parallel_residual=True, qkv_bias=True,
                               out_bias=True, rotary_dim=8, tie_word_embeddings=False,
                               head_bias=True, gated_mlp=False, hidden_act="gelu",
                               mlp_bias=True),
           # Command R's: one LayerNorm without a bias that attention and MLP share
           "shared-layer-norm": dict(norm_kind="layer_nobias", parallel_residual=True,
                                     shared_input_norm=True, logit_scale=0.25),
           # Gemma's RMSNorm by 1 + w (on the inputs, q and k, and the outputs) and GeGLU
           "plus-one": dict(FEATURES, norm_plus_one=True, hidden_act="gelu_tanh")}
# Gemma 2/3's attention: soft-capped scores, a 5-position window every other layer (the
# 17-node tree's paths are 7 deep: the window cuts both the cache and the chains), and the
# sliding layers' own RoPE base
CONFIGS["windows"] = dict(CONFIGS["plus-one"], attn_softcap=3.0, layer_windows=(5, 0),
                          local_rope_theta=100.0)
# Phi-3's and Gemma's head sizes (the GPU ordered kernels' tiles 128 wide over 96 columns;
# 256 wide with 8-position blocks), the query scale keeping the scores as spread as the
# 16-wide heads' (at D ** -0.5 the wider heads' softmax is one-hot on these weights: its
# sums then round nothing, whatever their order)
CONFIGS["head-96"] = dict(head_dim=96, query_scale=0.04)
CONFIGS["head-256"] = dict(head_dim=256, num_heads=2, num_kv_heads=1, query_scale=0.015)


# The tree starting mid-block, and on a block edge; fp32 and bf16; the packed kernel (what
# a GPU runs) and the unpacked one; Llama's layers, and with the features the fused layers
# take beyond them (CONFIGS).
@pytest.mark.parametrize("name,prompt_length,dtype,packed", [
    ("llama", 12, jnp.float32, True), ("llama", 12, jnp.bfloat16, True),
    ("llama", 12, jnp.float32, False), ("llama", 12, jnp.bfloat16, False),
    pytest.param("llama", 16, jnp.float32, True, marks=pytest.mark.slow),
    pytest.param("llama", 16, jnp.float32, False, marks=pytest.mark.slow),
    ("features", 12, jnp.float32, True), ("windows", 12, jnp.bfloat16, True),
    ("head-96", 12, jnp.float32, True),
    pytest.param("head-256", 12, jnp.bfloat16, True, marks=pytest.mark.slow),
    pytest.param("head-96", 12, jnp.bfloat16, False, marks=pytest.mark.slow),
    pytest.param("layer-norms", 12, jnp.bfloat16, False, marks=pytest.mark.slow),
    pytest.param("windows", 12, jnp.float32, False, marks=pytest.mark.slow),
    pytest.param("features", 12, jnp.bfloat16, False, marks=pytest.mark.slow),
    pytest.param("features", 12, jnp.bfloat16, True, marks=pytest.mark.slow),
    pytest.param("features", 12, jnp.float32, False, marks=pytest.mark.slow),
    pytest.param("olmo-norms", 12, jnp.float32, True, marks=pytest.mark.slow),
    pytest.param("layer-norms", 12, jnp.float32, True, marks=pytest.mark.slow),
    pytest.param("shared-layer-norm", 12, jnp.bfloat16, True, marks=pytest.mark.slow),
    pytest.param("plus-one", 12, jnp.float32, True, marks=pytest.mark.slow)],
    ids=lambda v: {jnp.float32: "fp32", jnp.bfloat16: "bf16", True: "packed",
                   False: "unpacked"}.get(v, str(v)))
def test_every_node_on_a_path_is_bitwise_the_ar_step(name, prompt_length, dtype, packed,
                                                     monkeypatch):
    if not packed:
        _unpacked(monkeypatch)
    config = _tiny_config(**CONFIGS[name])
    params = _feature_params(config, dtype)
    assert all(_path_versus_tree(config, params, prompt_length))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_every_node_on_a_path_is_bitwise_the_ar_step_with_the_rope_kernel(dtype):
    """The same with fused q|k|v weights and head_dim 32: each layer's rows are written by
    the q|k|v kernel that applies RoPE (``qkv_rope_into_gpu``), as on a GPU."""
    config = _tiny_config(head_dim=32)
    params = jax.tree.map(lambda a: a.astype(dtype), _params(config, fused=True))
    names = _pallas_calls(jax.make_jaxpr(lambda: models.forward(
        params, config, jnp.arange(2), 12 + jnp.arange(2), _prefilled(config, params),
        attn_impl="fused"))().jaxpr)
    assert "qkv_rope_into_gpu" in names, names
    assert all(_path_versus_tree(config, params, 12))


@pytest.mark.parametrize("packed,config", [
    (True, "llama"), (False, "llama"),
    pytest.param(True, "head-96", marks=pytest.mark.slow),
    pytest.param(True, "head-256", marks=pytest.mark.slow)],
    ids=["packed", "unpacked", "packed-head-96", "packed-head-256"])
def test_a_row_count_dependent_blocking_is_caught(monkeypatch, packed, config):
    """The same comparison fails for the ordered kernel with its KV block chosen from the
    number of new tokens (16 slots for a one-token step, 32 for a verify pass): the bug the
    fixed blocking rules out. The tree starts at position 20, so the one-token step's
    16-slot blocks split the keys that the verify pass's 32-slot block reads in one update:
    a later block's larger score rescales the sums, which the one-block pass never does.
    Also at Phi-3's and Gemma's head sizes (:data:`CONFIGS`)."""
    def blocked_by_row_count(q, *args, layer, interpret_variant, **extras):
        sizes = GpuOrderedBlockSizes(block_kv=16 if q.shape[0] == 1 else 32)
        return ordered_attention_gpu(q, *args, layer=layer, block_sizes=sizes, interpret=True,
                                     **extras)

    def sizes_for(rows):  # 16 packed rows: a one-token step (and short verify passes)
        return GpuOrderedBlockSizes(block_kv=16 if rows == 16 else 32)

    def packed_blocked_by_row_count(packed, *args, num_heads, interpret_variant, **extras):
        return ordered_attention_packed_gpu(packed, *args, num_heads=num_heads,
                                            block_sizes=sizes_for(packed.shape[1]),
                                            interpret=True, **extras)

    if packed:
        monkeypatch.setattr(kernels, "ordered_attention_packed", packed_blocked_by_row_count)
        monkeypatch.setattr(kernels, "packed_links",
                            lambda mask, rows: packed_links(mask, rows, sizes_for(rows)))
    else:
        _unpacked(monkeypatch)
        monkeypatch.setattr(kernels, "ordered_attention", blocked_by_row_count)
    config = _tiny_config(**CONFIGS[config])
    assert not all(_path_versus_tree(config, _params(config), 20))


def _norms_chunked_by_row_count(monkeypatch, width: int):
    """The norms of ``width`` columns (the q/k norms' 32, the output norms' 64) summed in
    one chunk for a one-token step's 16 rows and in 16-column chunks for more: the sum of
    squares associates differently."""
    right = kernels.norm_groups

    def norm(x, weight, layer, *, interpret_variant, **kwargs):
        if weight.shape[1] != width:
            return right(x, weight, layer, interpret_variant=interpret_variant, **kwargs)
        sizes = GpuNormBlockSizes(chunk=width if x.shape[0] <= 16 else 16)
        rows = jnp.pad(x, ((0, -x.shape[0] % 16), (0, 0)))  # the head's rows are not padded
        return norm_groups_gpu(rows, weight, layer, block_sizes=sizes, interpret=True,
                               **kwargs)[:x.shape[0]]

    monkeypatch.setattr(kernels, "norm_groups", norm)


def _scale_folded_into_queries(monkeypatch):
    """On the multi-row path the query scale multiplies q (as the verify kernel takes it)
    instead of each score."""
    _unpacked(monkeypatch)
    ordered = kernels.ordered_attention

    def attention(q, *args, scale=None, **kwargs):
        if q.shape[0] > 1 and scale is not None:
            q = (q.astype(jnp.float32) * (scale * q.shape[-1] ** 0.5)).astype(q.dtype)
            scale = None
        return ordered(q, *args, scale=scale, **kwargs)

    monkeypatch.setattr(kernels, "ordered_attention", attention)


def _logits_capped_first(monkeypatch):
    """On the multi-row path the logits are soft-capped before the divisor and scale. (A
    product and a division by constants reordered is no variant: XLA folds both into one
    product either way.)"""
    finish = models.finish_logits

    def finish_logits(config, logits):
        if logits.shape[0] == 1:
            return finish(config, logits)
        logits = config.final_softcap * jnp.tanh(logits / config.final_softcap)
        return logits / config.logits_divisor * config.logit_scale

    monkeypatch.setattr(models, "finish_logits", finish_logits)


def _residual_multiplier_in_the_output_norm(monkeypatch):
    """On the multi-row path Granite's residual multiplier is folded into the output
    norms' weights (``w * m``) instead of multiplying the normed output."""
    add_output = decoder._add_output

    def folded(config, linear, x, h, weight, bias, index, post_norm=None,
               interpret_variant="gpu"):
        if h.shape[0] == 16 or post_norm is None:
            return add_output(config, linear, x, h, weight, bias, index, post_norm,
                              interpret_variant)
        out = linear(h, (weight,), biases=(bias,), layer=index, eps=config.norm_eps)
        m = jnp.asarray(config.residual_multiplier, post_norm.dtype)
        return x + kernels.norm_groups(out, post_norm * m, index, start=0, groups=1,
                                       eps=config.norm_eps, interpret_variant=interpret_variant)

    monkeypatch.setattr(decoder, "_add_output", folded)


def _partial_rope_over_the_whole_head(monkeypatch):
    """On the multi-row path partial RoPE's tables are widened to the whole head (cos 1,
    sin 0 past them), which pairs dim i with i + D/2 instead of i + R/2."""
    context = decoder.layer_context

    def widened(config, tables, index):
        cos, sin = context(config, tables, index)
        if cos.shape[0] == 16:
            return cos, sin
        pad = config.head_dim - cos.shape[1]
        return (jnp.pad(cos, ((0, 0), (0, pad)), constant_values=1.0),
                jnp.pad(sin, ((0, 0), (0, pad))))

    monkeypatch.setattr(decoder, "layer_context", widened)


def _nope_layer_rotated(monkeypatch):
    """On the multi-row path the NoPE layer is rotated like the others."""
    context = decoder.layer_context
    monkeypatch.setattr(decoder, "layer_context", lambda config, tables, index: (
        context(config, tables, index) if tables[0].shape[0] == 16 else tables))


def _layer_norm_chunked_by_row_count(monkeypatch):
    """LayerNorm's sums (the inputs' and the final norm's, 64 wide) in one chunk for a
    one-token step and in 16-column chunks for more."""
    _norms_chunked_by_row_count(monkeypatch, 64)


def _plus_one_folded_into_the_weight(monkeypatch):
    """On the multi-row path Gemma's ``1 + w`` norms are plain RMSNorms by the weight
    ``1 + w`` rounded to the model dtype (normed row cast first, then scaled)."""
    right = kernels.norm_groups

    def norm(x, weight, layer, *, kind, **kwargs):
        if kind == "rms_plus_one" and x.shape[0] > 16:
            return right(x, 1 + weight, layer, kind="rms", **kwargs)
        return right(x, weight, layer, kind=kind, **kwargs)

    monkeypatch.setattr(kernels, "norm_groups", norm)


def _gelu_outside_the_kernel(monkeypatch):
    """On the multi-row path GPT-NeoX's up projection's GELU is applied in jnp to the
    kernel's product rounded to the model dtype, instead of to the float32 product in the
    epilogue."""
    right = kernels.fused_linear

    def linear(x, weights, *, activation=None, **kwargs):
        if activation is None or x.shape[0] <= 16:
            return right(x, weights, activation=activation, **kwargs)
        return jax.nn.gelu(right(x, weights, **kwargs), approximate=False)

    monkeypatch.setattr(kernels, "fused_linear", linear)


def _window_in_the_chains_mask(monkeypatch):
    """On the verify pass a sliding window is applied to the mask the ordered kernel reads
    the chains from (as the jnp attention takes it) instead of by position in the kernel:
    a deep node's chain then misses its distant ancestors, and its depth, its position."""
    _unpacked(monkeypatch)
    ordered = kernels.ordered_attention

    def attention(q, k_new, v_new, k_cache, v_cache, length, mask, *rest, first_visible=None,
                  **kwargs):
        if q.shape[0] > 1 and first_visible is not None:
            depth = jnp.sum(mask, axis=1) - 1
            mask = mask & ((length + depth)[None, :] >= first_visible[:, None])
        return ordered(q, k_new, v_new, k_cache, v_cache, length, mask, *rest,
                       first_visible=first_visible, **kwargs)

    monkeypatch.setattr(kernels, "ordered_attention", attention)


WRONG_FEATURES = {"qk-norm-chunks": lambda patch: _norms_chunked_by_row_count(patch, 32),
                  "output-norm-chunks": lambda patch: _norms_chunked_by_row_count(patch, 64),
                  "layer-norm-chunks": _layer_norm_chunked_by_row_count,
                  "plus-one-folded": _plus_one_folded_into_the_weight,
                  "gelu-outside-the-kernel": _gelu_outside_the_kernel,
                  "window-in-the-chains-mask": _window_in_the_chains_mask,
                  "query-scale": _scale_folded_into_queries,
                  "logits": _logits_capped_first,
                  "residual-multiplier": _residual_multiplier_in_the_output_norm,
                  "partial-rope": _partial_rope_over_the_whole_head,
                  "nope-layer": _nope_layer_rotated}


# (config, dtype) of a wrong variant, where not FEATURES in float32 (1 + w folded into the
# weight, and the GELU of a rounded product, are different roundings in bfloat16 only).
WRONG_CONFIGS = {"layer-norm-chunks": ("layer-norms", jnp.float32),
                 "plus-one-folded": ("plus-one", jnp.bfloat16),
                 "gelu-outside-the-kernel": ("layer-norms", jnp.bfloat16),
                 "window-in-the-chains-mask": ("windows", jnp.float32)}


@pytest.mark.parametrize("variant", [
    name if name == "qk-norm-chunks" else pytest.param(name, marks=pytest.mark.slow)
    for name in WRONG_FEATURES])
def test_a_feature_computed_differently_by_row_count_is_caught(monkeypatch, variant):
    """The comparison of :func:`test_every_node_on_a_path_is_bitwise_the_ar_step` fails
    when one feature is computed one way for a one-token step and another for a verify
    pass (with :data:`FEATURES`, or the config of :data:`CONFIGS` that has the feature):
    the q/k norms', the output norms' or LayerNorm's sums chunked by the row count (the
    bug the norm kernel's fixed chunks rule out), Gemma's ``1 + w`` folded into the
    weight, GPT-NeoX's GELU applied outside the kernel, a sliding window applied to the
    mask the chains are read from, the query scale folded into q (as
    the verify kernel takes it), the logits soft-capped first, the residual multiplier
    folded into the output norms' weights, partial RoPE's pairs taken over the whole head,
    a NoPE layer rotated."""
    WRONG_FEATURES[variant](monkeypatch)
    name, dtype = WRONG_CONFIGS.get(variant, ("features", jnp.float32))
    config = _tiny_config(**CONFIGS[name])
    assert not all(_path_versus_tree(config, _feature_params(config, dtype), 12))


@pytest.mark.parametrize("method", ["tree", pytest.param("ar-batch", marks=pytest.mark.slow),
                                    pytest.param("tree-features", marks=pytest.mark.slow)])
def test_fused_generation_equals_reference(method):
    """Greedy ``tree`` and ``ar`` over a batch of two under ``attn_impl="fused"`` give the
    reference ``ar`` tokens; ``tree-features``: a target with every feature of
    :data:`FEATURES`."""
    config = _tiny_config(num_layers=2, **(FEATURES if method == "tree-features" else {}))
    target = specjax.Model.from_params(config, _feature_params(config) if config.qk_norm
                                       else _params(config, seed=5), name="fused-target")
    prompts = [random_prompt(7, 9, vocab=config.vocab_size),
               random_prompt(8, 5, vocab=config.vocab_size)]
    expected = [specjax.generate(target, p, max_new_tokens=5,
                                 kernels=KernelOptions(attention="reference")).tokens
                for p in prompts]
    if method == "ar-batch":
        got = specjax.generate(target, prompts, max_new_tokens=5,
                               kernels=KernelOptions(attention="fused"))
        assert [r.tokens for r in got] == expected
        return
    draft_config = _tiny_config(num_layers=1)
    draft = specjax.Model.from_params(draft_config, _params(draft_config, seed=6),
                                      name="fused-draft")
    # The draft's levels attend through a scratch window (the split kernel's calls).
    tree = specjax.generate(target, prompts[0], max_new_tokens=5,
                            kernels=KernelOptions(attention="fused"),
                            method="tree", draft=draft, tree_budget=6, draft_depth=3,
                            draft_width=2)
    assert tree.tokens == expected[0] and tree.stats["draft_calls"] > 0
    assert tree.stats["fallbacks"] == []  # drafting calls' split kernel is by design


def test_unknown_attention_implementation_is_one_line():
    config = _tiny_config()
    model = specjax.Model.from_params(config, _params(config), name="tiny")
    with pytest.raises(InvalidArgumentError, match="fused") as info:
        specjax.generate(model, [1, 2, 3], max_new_tokens=2,
                         kernels=KernelOptions(attention="fast"))
    assert "\n" not in str(info.value)
