"""Never a silent fallback (issue 42): every place a run runs something
other than what was asked for is recorded while its program is traced
(:mod:`specjax.kernels.fallbacks`) and listed in ``stats["fallbacks"]``.

Checked here, on tiny random models on the CPU:

* the kernel sites (fused_linear, verify_attention, ordered_attention) record a precise
  reason when they fall back, and nothing when the kernel takes the call; tracing under a
  collector gives the same program;
* the models layer records ``attn_impl="fused"`` running ``"auto"`` for a pass over
  ``FUSED_MAX_TOKENS`` tokens and for a family without fused layers;
* a run: a fused generation with a prompt over 128 tokens lists the fused -> auto
  fallback and gives the ``"auto"`` run's tokens; the same call again (a cached program)
  lists it again; a plain run lists none (``generate``, a batch, ``stream_generate``).

Removing any one ``record`` call these tests reach makes them fail (checked by hand).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import specjax
from specjax import kernels, models
from specjax.config import ModelConfig
from specjax.kernels import fallbacks

from conftest import random_prompt
from test_kernels import _valid_args

SDS = jax.ShapeDtypeStruct
# attn_impl="fused" on the CPU warns that it is slow (interpreted kernels): meant here.
pytestmark = pytest.mark.filterwarnings("ignore::specjax.errors.PerformanceWarning")


def _lines(reasons) -> set[str]:
    """The ``"site: reason"`` lines of recorded fallbacks (what ``stats`` lists)."""
    return {str(reason) for reason in reasons}


def _traced(fn, *args) -> set:
    """The fallbacks' lines recorded while tracing ``fn(*args)`` (nothing runs)."""
    with fallbacks.collecting() as reasons:
        jax.eval_shape(fn, *args)
    return _lines(reasons)


def test_refused_projection_is_recorded_and_a_taken_one_is_not():
    x = SDS((3, 64), jnp.float32)
    refused = SDS((64, 97), jnp.float32)  # 97 columns: no 16-wide tile
    taken = SDS((64, 96), jnp.float32)
    assert _traced(lambda x, w: kernels.fused_linear(x, (w,), fallback=True),
                   x, refused) == {
        "fused_linear: GPU fused linear kernel: K=64 and N=97 must be multiples of 16 (the "
        "smallest Triton tile); its jnp reference ran"}
    assert _traced(lambda x, w: kernels.fused_linear(x, (w,), fallback=True),
                   x, taken) == set()
    # Outside a collector nothing is kept, and a collector sees nothing of an inner one.
    fallbacks.record("site", "reason", row_independent=True)
    with fallbacks.collecting() as outer:
        with fallbacks.collecting() as inner:
            fallbacks.record("site", "reason", row_independent=False)
    assert (outer, _lines(inner)) == (set(), {"site: reason"})
    assert [reason.row_independent for reason in inner] == [False]


def test_recording_leaves_the_program_unchanged():
    x = jnp.ones((3, 64), jnp.float32)
    w = jnp.linspace(-1, 1, 64 * 97, dtype=jnp.float32).reshape(64, 97)

    def lowered():  # a new function each time: JAX traces it again (no cached trace)
        return jax.jit(lambda x, w: kernels.fused_linear(x, (w,), fallback=True)).lower(
            x, w).as_text()

    plain = lowered()
    with fallbacks.collecting() as reasons:
        collected = lowered()
    assert reasons and collected == plain


def test_verify_attention_records_what_auto_runs_instead(monkeypatch):
    def fallback(*args):
        return jnp.zeros_like(args[0])

    with fallbacks.collecting() as interpreted:  # a direct call on the CPU
        kernels.verify_attention(*_valid_args(), fallback=fallback)
    assert _lines(interpreted) == {"verify_attention: no Pallas kernel runs natively on "
                                   "the cpu backend; attention='auto' ran the jnp attention"}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with fallbacks.collecting() as refused:
        kernels.verify_attention(*_valid_args(t=129), fallback=fallback)
    (reason,) = _lines(refused)
    assert reason.startswith("verify_attention: GPU verify-attention kernel: 129 new tokens")
    assert reason.endswith("supports 1..128; attention='auto' ran the jnp attention"), reason


def test_ordered_attention_records_a_refused_capacity_but_not_a_drafting_call():
    tokens, heads, kv_heads, dim = 2, 4, 2, 16
    q = SDS((tokens, heads, dim), jnp.float32)
    new = SDS((tokens, kv_heads, dim), jnp.float32)
    length = SDS((), jnp.int32)
    mask = SDS((tokens, tokens), jnp.bool_)

    def attend(capacity, scratch=0):
        cache = SDS((capacity, kv_heads, dim), jnp.float32)
        scratch_mask = SDS((tokens, scratch), jnp.bool_) if scratch else None
        return _traced(lambda *a: kernels.ordered_attention(*a), q, new, new, cache, cache,
                       length, mask, scratch_mask)

    block = kernels.GpuOrderedBlockSizes().resolve(dim)
    assert attend(4 * block) == set()
    (reason,) = attend(4 * block + 8)
    assert reason.startswith("ordered_attention: ") and f"{4 * block + 8}" in reason
    assert "verify_attention's kernel ran" in reason
    assert attend(4 * block, scratch=3) == set()  # drafting calls take that kernel by design


def _config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=1024)
    return ModelConfig("llama", **{**base, **overrides})


def _forward_reasons(config: ModelConfig, num_tokens: int) -> set:
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.PRNGKey(0)))
    tokens = SDS((num_tokens,), jnp.int32)
    return _traced(lambda p, t: models.forward(p, config, t, jnp.arange(num_tokens),
                                               attn_impl="fused"), params, tokens)


def test_models_record_fused_layers_running_auto():
    assert _forward_reasons(_config(), 200) == {
        "fused layers: a 200-token pass (the fused kernels take at most 128 tokens); "
        "attention='auto' ran"}
    assert _forward_reasons(_config(), 16) == set()
    gpt2 = ModelConfig("gpt2", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=4, head_dim=16, intermediate_size=128,
                       max_position_embeddings=256)
    assert _forward_reasons(gpt2, 16) == {
        "fused layers: gpt2 models have none; attention='auto' ran"}


def _model():
    config = _config()
    params = models.init_params(config, jax.random.PRNGKey(3))
    params = jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, params)
    return specjax.Model.from_params(config, params, name="fallbacks-tiny")


def test_a_fused_run_over_128_tokens_lists_the_fallback_cached_or_not():
    model = _model()
    prompt = random_prompt(11, 130, vocab=model.config.vocab_size)  # a 256-token prefill
    expected = ["fused layers: a 256-token pass (the fused kernels take at most 128 "
                "tokens); attention='auto' ran"]
    auto = specjax.generate(model, prompt, max_new_tokens=3,
                            kernels=specjax.KernelOptions(attention="auto"))
    assert auto.stats["fallbacks"] == []
    fused = specjax.generate(model, prompt, max_new_tokens=3,
                             kernels=specjax.KernelOptions(attention="fused"))
    assert fused.stats["fallbacks"] == expected
    assert fused.tokens == auto.tokens
    again = specjax.generate(model, prompt, max_new_tokens=3,
                             kernels=specjax.KernelOptions(attention="fused"))
    assert again.stats["compile_seconds"] == 0.0  # the cached program
    assert again.stats["fallbacks"] == expected and again.tokens == fused.tokens


def test_a_plain_run_lists_no_fallback():
    model = _model()
    prompts = [random_prompt(1, 9, vocab=128), random_prompt(2, 5, vocab=128)]
    assert specjax.generate(model, prompts[0], max_new_tokens=2).stats["fallbacks"] == []
    assert [r.stats["fallbacks"] for r in specjax.generate(model, prompts,
                                                           max_new_tokens=2)] == [[], []]
    *_, (_, stats) = specjax.stream_generate(model, prompts[0], max_new_tokens=2)
    assert stats["fallbacks"] == []


def test_a_streamed_run_lists_its_fallbacks_and_keeps_none_set_between_steps():
    model = _model()
    steps = specjax.stream_generate(model, random_prompt(11, 130, vocab=128),
                                    max_new_tokens=2,
                                    kernels=specjax.KernelOptions(attention="fused"))
    items = []
    for item in steps:
        items.append(item)
        fallbacks.record("caller", "between steps",  # no collector is active here
                         row_independent=False)
    assert items[-1][1]["fallbacks"] == [
        "fused layers: a 256-token pass (the fused kernels take at most 128 tokens); "
        "attention='auto' ran"]
