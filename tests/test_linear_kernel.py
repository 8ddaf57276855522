"""The row-tiled fused linear kernel (``kernels/linear_gpu.py``) and ``attn_impl="fused"``.

The kernel runs under Pallas' generic interpreter on the CPU (which fills output elements
a kernel never writes with NaN). Checked here:

* against :func:`fused_linear_reference` (the models' jnp layers) for every form the models
  use: plain, RMSNorm + bias + residual, SwiGLU from one fused gate|up matrix and from two
  matrices, the transposed (tied) float32 head; stacked weights at a traced layer; fp32 and
  bf16;
* row independence: each row of a 5/16/17/64-row call is bitwise the row computed alone,
  and a deliberately row-dependent tiling (a reduction chunk that changes with the row
  count, the bug the design rules out) is caught by the same comparison;
* whole models: ``attn_impl="fused"`` logits equal the reference's within tolerance, and
  a tree root's logits in an N-node verify pass are bitwise the one-token step's;
* generation: ``ar``, ``spec`` and ``staged`` under ``"fused"`` give the reference's
  greedy tokens, batch 1 and 2;
* the Triton lowering accepts the model shapes (SmolLM2, Llama-7B) without a GPU;
* bad input: one-line errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kernels, models
from specjax.cache import advance, init_cache
from specjax.config import ModelConfig
from specjax.errors import InvalidArgumentError
from specjax.kernels.linear_gpu import (GpuLinearBlockSizes, check_supported,
                                        fused_linear_gpu, fused_linear_reference)
from specjax.tree import ancestor_mask

from conftest import random_prompt

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
L, K_IN, N_OUT = 3, 64, 96


def _arrays(dtype, rows=5, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (rows, K_IN))
    w = 0.2 * jax.random.normal(ks[1], (L, K_IN, 2 * N_OUT))
    w2 = 0.2 * jax.random.normal(ks[2], (L, K_IN, N_OUT))
    norm = 1 + 0.1 * jax.random.normal(ks[3], (L, K_IN))
    bias = 0.1 * jax.random.normal(ks[4], (L, 2 * N_OUT))
    residual = jax.random.normal(ks[5], (rows, N_OUT))
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return tuple(map(cast, (x, w, w2, norm, bias, residual)))


# name -> kwargs builder over (x, w, w2, norm, bias, residual)
FORMS = {
    "plain": lambda x, w, w2, n, b, r: dict(weights=(w2,)),
    "norm-bias-residual": lambda x, w, w2, n, b, r: dict(
        weights=(w,), norm=n, biases=(b,), residual=r, offsets=(N_OUT,), width=N_OUT),
    "swiglu-fused-matrix": lambda x, w, w2, n, b, r: dict(
        weights=(w, w), norm=n, biases=(b, b), offsets=(0, N_OUT), width=N_OUT),
    "swiglu-two-matrices": lambda x, w, w2, n, b, r: dict(
        weights=(w2, w), offsets=(0, 0), width=N_OUT),
}


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


def test_transposed_head_in_float32():
    """The tied-embedding head: weight [V, d] unstacked, norm folded in, float32 logits."""
    x, *_ = _arrays(jnp.bfloat16)
    table = (0.5 * jax.random.normal(jax.random.PRNGKey(3), (128, K_IN))).astype(jnp.bfloat16)
    norm = jnp.linspace(0.5, 1.5, K_IN).astype(jnp.bfloat16)
    kwargs = dict(norm=norm, transposed=True, float32_out=True)
    got = fused_linear_gpu(x, (table,), interpret=True, **kwargs)
    want = fused_linear_reference(x, (table,), **kwargs)
    assert got.dtype == jnp.float32 and got.shape == (5, 128)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


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
    cache = init_cache(config, capacity)
    _, cache = models.forward(params, config, prompt, jnp.arange(prompt_length), cache,
                              attn_impl="reference")
    return advance(cache, prompt_length)


MODEL_CASES = {
    "gqa-tied": (dict(), False),
    "mha-untied-bias-fused-projections": (dict(num_kv_heads=4, tie_word_embeddings=False,
                                               qkv_bias=True), True),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_fused_model_matches_reference_and_root_is_bitwise(case):
    overrides, fused = MODEL_CASES[case]
    config = _tiny_config(**overrides)
    params = _params(config, fused=fused)
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
        np.testing.assert_allclose(fused_logits, reference[:count], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(fused_logits[0], one[0])  # bit for bit


def test_fused_generation_equals_reference():
    """Greedy ``ar``, ``spec`` and ``staged`` (its draft-of-draft tables absent: lookup
    only) under ``attn_impl="fused"`` give the reference ``ar`` tokens; batch of two."""
    config = _tiny_config(num_layers=2)
    target = specjax.Model.from_params(config, _params(config, seed=5), name="fused-target")
    draft_config = _tiny_config(num_layers=1)
    draft = specjax.Model.from_params(draft_config, _params(draft_config, seed=6),
                                      name="fused-draft")
    prompts = [random_prompt(7, 9, vocab=config.vocab_size),
               random_prompt(8, 5, vocab=config.vocab_size)]
    expected = [specjax.generate(target, p, max_new_tokens=5, attn_impl="reference").tokens
                for p in prompts]
    got = specjax.generate(target, prompts, max_new_tokens=5, attn_impl="fused")
    assert [r.tokens for r in got] == expected
    spec = specjax.generate(target, prompts[0], max_new_tokens=5, attn_impl="fused",
                            method="spec", draft=draft, draft_depth=2)
    assert spec.tokens == expected[0] and spec.stats["draft_calls"] > 0


def test_unknown_attention_implementation_is_one_line():
    config = _tiny_config()
    model = specjax.Model.from_params(config, _params(config), name="tiny")
    with pytest.raises(InvalidArgumentError, match="fused") as info:
        specjax.generate(model, [1, 2, 3], max_new_tokens=2, attn_impl="fast")
    assert "\n" not in str(info.value)
