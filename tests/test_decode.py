"""Autoregressive decoding: parity with transformers, drivers, recompilation, stops, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import models
from specjax.errors import InvalidArgumentError, NumericalError
from specjax.sampling import make_sampling_params, sample_tokens

from conftest import hf_greedy, random_prompt, tiny_pair


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gpt2"])
def test_greedy_equals_transformers_generate(kind):
    hf_model, model = tiny_pair(kind, seed=11)
    for seed, length in [(0, 5), (1, 17), (2, 40)]:
        prompt = random_prompt(seed, length)
        got = specjax.generate(model, prompt, max_new_tokens=24).tokens
        assert got == hf_greedy(hf_model, prompt, 24)
        assert len(set(got)) > 3  # the tiny model is not degenerate: the test can fail


def test_streaming_driver_equals_while_loop():
    _, model = tiny_pair("llama-gqa", seed=12)
    prompt = random_prompt(3, 9)
    for kwargs in (dict(), dict(temperature=0.8, top_k=20, seed=5)):
        full = specjax.generate(model, prompt, max_new_tokens=16, **kwargs)
        streamed, stats = [], None
        for new, stats in specjax.stream_generate(model, prompt, max_new_tokens=16, **kwargs):
            streamed += new
        assert streamed == full.tokens
        assert stats["new_tokens"] == 16 and stats["target_calls"] == 16


def test_sampling_is_reproducible_and_seed_dependent():
    _, model = tiny_pair("gpt2", seed=13)
    prompt = random_prompt(4, 6)
    a = specjax.generate(model, prompt, max_new_tokens=20, temperature=1.0, seed=1).tokens
    b = specjax.generate(model, prompt, max_new_tokens=20, temperature=1.0, seed=1).tokens
    c = specjax.generate(model, prompt, max_new_tokens=20, temperature=1.0, seed=2).tokens
    assert a == b
    assert a != c


def test_sampled_tokens_use_position_keyed_noise():
    """Token t of a sampled generation is argmax(log p~ + g_t) of an uncached forward."""
    _, model = tiny_pair("llama-gqa", seed=14)
    prompt = random_prompt(5, 7)
    out = specjax.generate(model, prompt, max_new_tokens=10, temperature=0.9, top_p=0.9,
                           seed=77).tokens
    sequence = prompt + out
    logits, _ = models.forward(model.params, model.config, jnp.asarray(sequence),
                               jnp.arange(len(sequence)))
    positions = jnp.arange(len(prompt), len(sequence))
    expected = sample_tokens(logits[len(prompt) - 1: -1],
                             make_sampling_params(0.9, 0, 0.9, 77), positions)
    assert out == np.asarray(expected).tolist()


def test_no_recompilation_across_prompts_and_sampling_settings():
    # A config no other test uses, so the warm-up below must compile.
    _, model = tiny_pair("llama-gqa", seed=15, num_hidden_layers=2)
    compiles = []
    listener = (lambda name, *args, **kw: compiles.append(kw.get("fun_name"))
                if name.endswith("backend_compile_duration") else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        specjax.generate(model, random_prompt(0, 20), max_new_tokens=30)  # warm-up
        warm = len(compiles)
        # The generation program is named after its driver (XLA's module, profiles).
        assert "jit(run_to_completion)" in compiles
        for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 10, 1.0),
                                       (1.2, 0, 0.7), (0.9, 5, 0.9)]):
            out = specjax.generate(model, random_prompt(i + 1, 17 + i), max_new_tokens=25 + i,
                                   temperature=t, top_k=k, top_p=p, seed=i)
            assert out.stats["compile_seconds"] == 0.0
        assert len(compiles) == warm
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compiler_options_compile_their_own_program_with_the_same_tokens():
    """``KernelOptions.compiler_options`` reach XLA (a misspelt option fails to compile),
    key the executable cache (a new compile with them, none again), and change no token:
    the backend optimisation level does not change the arithmetic."""
    _, model = tiny_pair("llama-gqa", seed=16, num_hidden_layers=2)
    prompt = random_prompt(3, 11)
    plain = specjax.generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=4)
    level = specjax.KernelOptions(compiler_options={"xla_backend_optimization_level": 1})
    fast = specjax.generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=4,
                            kernels=level)  # the suite's is 0
    assert fast.stats["kernels"]["compiler_options"]["xla_backend_optimization_level"] == 1
    with pytest.raises(Exception, match="no_such"):
        specjax.generate(model, prompt, max_new_tokens=12, kernels=specjax.KernelOptions(
            compiler_options={"xla_no_such_option": 1}))
    again = specjax.generate(model, prompt, max_new_tokens=12, temperature=1.0, seed=4)
    assert fast.stats["compile_seconds"] > 0 and again.stats["compile_seconds"] == 0.0
    assert fast.tokens == plain.tokens == again.tokens


def test_stop_tokens_end_generation_and_are_kept():
    _, model = tiny_pair("gpt2", seed=16)
    prompt = random_prompt(6, 8)
    free = specjax.generate(model, prompt, max_new_tokens=20).tokens
    stop = free[5]
    first = free.index(stop)
    out = specjax.generate(model, prompt, max_new_tokens=20, stop=[stop]).tokens
    assert out == free[: first + 1]


def test_max_new_tokens_is_respected():
    _, model = tiny_pair("gpt2", seed=17)
    for n in (1, 2, 7):
        assert len(specjax.generate(model, [1, 2, 3], max_new_tokens=n).tokens) == n


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[1, 500]), "outside the vocabulary"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=600), "exceeds the model's"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(method="beam"), "unknown method"),
    (dict(stop=list(range(9))), "stop tokens"),
    (dict(kernels=specjax.KernelOptions(attention="fused")),
     # GPT-2 has no fused layers: running the default ones would drop the bitwise guarantee.
     "attention 'fused' needs a Llama-family model"),
    (dict(kernels="fused"), "kernels must be a specjax.KernelOptions"),
])
def test_bad_input_is_a_one_line_error(kwargs, match):
    _, model = tiny_pair("gpt2", seed=18)
    kwargs = {"prompt": [1, 2, 3], **kwargs}
    with pytest.raises(InvalidArgumentError, match=match) as info:
        specjax.generate(model, kwargs.pop("prompt"), **kwargs)
    assert "\n" not in str(info.value)


def test_string_prompt_without_tokenizer_is_an_error():
    _, model = tiny_pair("gpt2", seed=18)
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        specjax.generate(model, "hello")


def test_non_finite_logits_are_reported():
    _, model = tiny_pair("llama-gqa", seed=19)
    params = jax.tree.map(lambda a: a, model.params)
    params["final_norm"] = params["final_norm"].at[0].set(jnp.nan)
    broken = specjax.Model(model.config, params, name="broken")
    with pytest.raises(NumericalError, match="non-finite"):
        specjax.generate(broken, [1, 2, 3], max_new_tokens=4)


def test_half_precision_parameters_on_the_cpu_warn_and_still_run():
    """bf16/fp16 parameters on a CPU get a PerformanceWarning naming the dtype and the fix
    (XLA's CPU matmuls in half precision are several times slower than float32); float32
    parameters get none."""
    import warnings

    from specjax.errors import PerformanceWarning

    config = specjax.ModelConfig(architecture="llama", vocab_size=64, hidden_size=32,
                                 num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                                 intermediate_size=64, max_position_embeddings=128)
    params = models.init_params(config, jax.random.PRNGKey(0))
    for dtype in ("bfloat16", "float16"):
        model = specjax.Model.from_params(config, params, name="tiny", dtype=dtype)
        with pytest.warns(PerformanceWarning, match=f"tiny: {dtype} parameters on the CPU.*"
                                                    f"dtype='float32'"):
            out = specjax.generate(model, [1, 2, 3], method="ar", max_new_tokens=3)
        assert len(out.tokens) == 3
    model = specjax.Model.from_params(config, params, name="tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        specjax.generate(model, [1, 2, 3], method="ar", max_new_tokens=3)
