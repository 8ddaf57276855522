"""Flax NNX and linen modules over specjax parameters: bit-identical logits to
``models.forward``, one-to-one parameter trees, models trained in Flax loops decoding
speculatively (output = ``ar`` of the trained weights), and the orbax round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import specjax
from specjax import models, tree
from specjax.cache import advance, init_cache
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.checkpoints_tools.flax_export import save_for_specjax
from specjax.flax_modules import LinenCausalLM, NNXCausalLM, flax_params, model_from_flax, to_flax
from specjax.training.ngram_build import build_ngram

from conftest import TINY_VOCAB, random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

# gpt2: learned positions, biases, tied head; llama-gqa: RoPE, GQA, tied head (SmolLM2's
# shape). qwen2 (qkv biases, one kv head, separate head) runs in the batched test.
KINDS = ["gpt2", "llama-gqa"]


def _paths(model):
    """Three jitted ways to run the same model: the function, the NNX module, linen."""
    config = model.config

    @jax.jit
    def function(params, tokens, positions, cache, mask):
        return models.forward(params, config, tokens, positions, cache, mask)

    @nnx.jit
    def nnx_call(module, tokens, positions, cache, mask):
        return module(tokens, positions, cache, mask)

    linen_module, variables = to_flax(model, "linen")
    linen_call = jax.jit(linen_module.apply)
    nnx_module = to_flax(model)
    return {
        "function": lambda *a: function(model.params, *a),
        "nnx": lambda *a: nnx_call(nnx_module, *a),
        "linen": lambda *a: linen_call(variables, *a),
    }


def _assert_same(outputs):
    (ref_logits, ref_cache) = outputs["function"]
    for name in ("nnx", "linen"):
        logits, cache = outputs[name]
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits), err_msg=name)
        np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(ref_cache.k), err_msg=name)
        np.testing.assert_array_equal(np.asarray(cache.v), np.asarray(ref_cache.v), err_msg=name)
        assert int(cache.length) == int(ref_cache.length)


@pytest.mark.parametrize("kind", KINDS)
def test_modules_give_bit_identical_logits(kind):
    model = tiny_pair(kind, seed=3)[1]
    paths = _paths(model)
    prompt = jnp.asarray(random_prompt(1, 7), jnp.int32)
    cache = init_cache(model.config, 24)

    # Prefill: causal mask over 7 new tokens, K/V into the scratch slots.
    prefill = {name: run(prompt, jnp.arange(7, dtype=jnp.int32), cache, models.causal_mask(7))
               for name, run in paths.items()}
    _assert_same(prefill)
    cache = advance(prefill["function"][1], 7)

    # One-token decode after the committed prefix.
    token = jnp.asarray([5], jnp.int32)
    _assert_same({name: run(token, jnp.asarray([7], jnp.int32), cache, models.causal_mask(1))
                  for name, run in paths.items()})

    # A tree: branching nodes see only their ancestors; positions = length + depth.
    parents = jnp.asarray([-1, 0, 0, 1, 1, 2, 4], jnp.int32)
    mask = tree.ancestor_mask(parents, jnp.ones(7, jnp.bool_))
    positions = tree.positions(tree.depths(parents), cache.length)
    nodes = jnp.asarray(random_prompt(2, 7), jnp.int32)
    outputs = {name: run(nodes, positions, cache, mask) for name, run in paths.items()}
    _assert_same(outputs)
    assert not np.array_equal(np.asarray(outputs["function"][0][6]),
                              np.asarray(paths["function"](nodes, positions, cache,
                                                           models.causal_mask(7))[0][6]))


@pytest.mark.parametrize("kind", ["qwen2"])
def test_batched_call_matches_each_row(kind):
    """Tokens [B, T] (training batches) run the function on every row (vmap)."""
    model = tiny_pair(kind, seed=4)[1]
    module = to_flax(model)
    linen_module, variables = to_flax(model, "linen")
    batch = jnp.asarray([random_prompt(s, 9) for s in range(3)], jnp.int32)
    nnx_logits, cache = module(batch)
    linen_logits, _ = linen_module.apply(variables, batch)
    assert cache is None and nnx_logits.shape == (3, 9, TINY_VOCAB)
    np.testing.assert_array_equal(np.asarray(nnx_logits), np.asarray(linen_logits))
    for row in range(3):
        expected, _ = models.forward(model.params, model.config, batch[row],
                                     jnp.arange(9, dtype=jnp.int32))
        # A batch of rows may tile the matmuls' sums differently from one row.
        assert_sums_close(nnx_logits[row], expected, **forward_sums(model.config, 9))


def test_parameter_trees_are_specjax_trees():
    model = tiny_pair("qwen2", seed=5)[1]
    module = to_flax(model)
    state = nnx.state(module)
    # Nothing but Params, and they are the model's own arrays under the same paths.
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(nnx.state(module, nnx.Param)))
    pure = nnx.to_pure_dict(state)
    assert jax.tree.structure(pure) == jax.tree.structure(model.params)
    for got, want in zip(jax.tree.leaves(pure), jax.tree.leaves(model.params)):
        assert got is want
    assert module.layers.wq[...] is model.params["layers"]["wq"]

    # A random NNX initialisation is models.init_params with the same key.
    fresh = NNXCausalLM(model.config, rngs=nnx.Rngs(params=7))
    expected = models.init_params(model.config, nnx.Rngs(params=7).params())
    for got, want in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # linen's init declares exactly the specjax tree, initialised by the same rule.
    variables = LinenCausalLM(model.config).init(jax.random.key(0), jnp.zeros(3, jnp.int32))
    assert set(variables) == {"params"}
    models.check_params(model.config, variables["params"], source="linen init")
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(model.params)
    params = variables["params"]
    np.testing.assert_array_equal(np.asarray(params["layers"]["bq"]), 0.0)
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), 1.0)
    assert 0.015 < float(jnp.std(params["embed"])) < 0.025

    # And back: every form converts to the same parameters.
    for source in (module, nnx.state(module), to_flax(model, "linen"), model.params,
                   {"params": model.params}):
        config, got = flax_params(source, model.config)
        assert config == model.config
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(model.params)):
            assert a is b


def _next_token_loss(logits, windows):
    log_q = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_q, windows[:, 1:, None], axis=-1))


@pytest.mark.slow  # compiles spec, tree and staged programs (~1-2 min)
def test_models_trained_in_flax_loops_decode_speculatively(spec_target, spec_drafts):
    """A target fine-tuned with nnx.Optimizer and a draft with a linen TrainState decode
    with spec / tree / staged; greedy output equals ar of the fine-tuned target."""
    pattern = np.asarray(random_prompt(30, 6))
    windows = jnp.asarray(np.stack([np.roll(np.tile(pattern, 4), s) for s in range(4)]),
                          jnp.int32)  # [4, 24]: teach the target to repeat a 6-token cycle
    base_leaves = [np.asarray(a) for a in jax.tree.leaves(spec_target.params)]

    # Target: an NNX training loop (nnx.Optimizer, nnx.value_and_grad under nnx.jit).
    module = to_flax(spec_target)
    optimizer = nnx.Optimizer(module, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(module, optimizer, windows):
        loss, grads = nnx.value_and_grad(
            lambda m: _next_token_loss(m(windows)[0], windows))(module)
        optimizer.update(module, grads)
        return loss

    losses = [float(nnx_step(module, optimizer, windows)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    target = model_from_flax(module, name="tuned")
    # The source model is untouched: training replaced the module's arrays, not its own.
    for before, after in zip(base_leaves, jax.tree.leaves(spec_target.params)):
        np.testing.assert_array_equal(before, np.asarray(after))

    # Draft: a linen TrainState loop; its config comes from apply_fn.
    linen_module, variables = to_flax(spec_drafts["weak"], "linen")
    state = train_state.TrainState.create(apply_fn=linen_module.apply,
                                          params=variables["params"], tx=optax.adam(1e-2))

    @jax.jit
    def linen_step(state, windows):
        grads = jax.grad(lambda p: _next_token_loss(
            state.apply_fn({"params": p}, windows)[0], windows))(state.params)
        return state.apply_gradients(grads=grads)

    for _ in range(2):
        state = linen_step(state, windows)
    draft = model_from_flax(state, name="tuned-draft")
    assert draft.config == spec_drafts["weak"].config

    prompt = random_prompt(31, 9)
    expected = specjax.generate(target, prompt, max_new_tokens=16).tokens
    # Fine-tuning changed what greedy decoding produces (the test is about the new weights).
    assert expected != specjax.generate(spec_target, prompt, max_new_tokens=16).tokens
    tables = build_ngram([expected, np.tile(pattern, 4).tolist()], TINY_VOCAB, top_k=8,
                         trigram_top_k=4, trigram_buckets=256, min_context_count=1).tables
    for method in ("spec", "tree", "staged"):
        out = specjax.generate(target, prompt, max_new_tokens=16, method=method, draft=draft,
                               ngram=tables if method == "staged" else None)
        assert out.tokens == expected, method
    # The module still runs on its arrays after decoding (nothing was donated).
    module(jnp.asarray(prompt, jnp.int32))


def test_orbax_round_trip_to_specjax_load(tmp_path):
    model = tiny_pair("llama-gqa", seed=6)[1]
    # An NNX state (as a pipeline holds it after training) and a linen TrainState.
    module = NNXCausalLM(model.config, rngs=nnx.Rngs(params=1))
    linen_module = LinenCausalLM(model.config)
    state = train_state.TrainState.create(
        apply_fn=linen_module.apply, tx=optax.sgd(0.1),
        params=linen_module.init(jax.random.key(2), jnp.zeros(2, jnp.int32))["params"])
    for name, source, config in (("nnx", nnx.state(module, nnx.Param), model.config),
                                 ("linen", state, None)):
        expected = flax_params(source, config)[1]
        path = save_for_specjax(tmp_path / name, source, config)
        loaded = specjax.load(str(path))
        assert loaded.config == model.config
        assert jax.tree.structure(loaded.params) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # An nnx.State saved by orbax as is stores {"value": array} per leaf: not a specjax
    # tree, refused by name (save nnx.to_pure_dict(state), or use save_for_specjax).
    raw = tmp_path / "raw"
    save_for_specjax(raw, module)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(raw / "params-raw", nnx.state(module, nnx.Param))
    (raw / "params").rename(raw / "params-pure")
    (raw / "params-raw").rename(raw / "params")
    with pytest.raises(CheckpointError, match="parameter"):
        specjax.load(str(raw))


def test_conversion_errors():
    model = tiny_pair("gpt2", seed=7)[1]
    with pytest.raises(InvalidArgumentError, match="config="):
        model_from_flax(model.params)
    with pytest.raises(InvalidArgumentError, match="config="):
        model_from_flax(nnx.state(to_flax(model)))
    llama = tiny_pair("llama-gqa", seed=7)[1]
    with pytest.raises(CheckpointError, match="parameter"):
        model_from_flax(model.params, llama.config)
    with pytest.raises(InvalidArgumentError, match="differs"):
        model_from_flax(to_flax(model), llama.config)
    with pytest.raises(InvalidArgumentError, match="no parameters"):
        model_from_flax(LinenCausalLM(model.config), model.config)
    with pytest.raises(InvalidArgumentError, match="head subset"):
        to_flax(model.with_head_subset([1, 2, 3]))
    with pytest.raises(InvalidArgumentError, match="api"):
        to_flax(model, "haiku")
    with pytest.raises(InvalidArgumentError, match=r"\[B, T\]"):
        to_flax(model)(jnp.zeros((1, 2, 3), jnp.int32))
    with pytest.raises(InvalidArgumentError, match="rngs"):
        NNXCausalLM(model.config)


def test_train_draft_runs_through_the_module():
    """train-draft's steps compute what the former vmap of models.forward computed."""
    from specjax.commands import train_draft

    target = tiny_pair("llama-gqa", seed=8)[1]
    cfg = train_draft.TrainConfig(init_layers=(0, 2), steps=2, batch_size=2, seq_len=8,
                                  warmup_steps=1)
    config, params = train_draft.draft_from_target(target.config, target.params, (0, 2))
    trainable, frozen = train_draft.split_trainable(params, train_embeddings=False)
    _, eval_step = train_draft.make_steps(target.config, config, cfg,
                                          train_draft.make_optimizer(cfg))
    windows = jnp.asarray([random_prompt(s, 9) for s in range(2)], jnp.int32)
    agreement, kl = eval_step(trainable, frozen, target.params, windows)

    @jax.jit
    def reference(draft_params, target_params, inputs):
        def logits(p, c):
            return jax.vmap(lambda w: models.forward(
                p, c, w, jnp.arange(w.shape[0], dtype=jnp.int32), attn_impl="reference")[0])(
                    inputs)
        log_p = jax.nn.log_softmax(logits(target_params, target.config), -1)
        log_q = jax.nn.log_softmax(logits(draft_params, config), -1)
        return (jnp.mean(jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1)),
                jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)))

    want_agreement, want_kl = reference(params, target.params, windows[:, :-1])
    assert float(agreement) == float(want_agreement)
    # Both are the same mean of per-position sums over the vocabulary, summed in other
    # orders: relative error ~ u * sqrt(vocabulary * positions) (u = 2**-24), far below this.
    np.testing.assert_allclose(float(kl), float(want_kl), rtol=1e-6)
    assert float(kl) > 0


@pytest.fixture
def tiny_gguf_model(tmp_path):
    from helpers_checkpoints import gguf_llama, write_tiny_gguf
    return specjax.load(str(write_tiny_gguf(gguf_llama(seed=4), tmp_path / "tiny.gguf")))


def test_save_for_specjax_keeps_the_tokenizer_of_the_model_to_flax_was_made_from(
        tmp_path, tiny_gguf_model):
    """The README's round trip: to_flax, (train), save_for_specjax, specjax.load, and the
    loaded checkpoint generates from text: the tokenizer came along."""
    model = tiny_gguf_model
    assert model.tokenizer is not None
    module = to_flax(model, api="nnx")
    loaded = specjax.load(str(save_for_specjax(tmp_path / "nnx", module)))
    assert loaded.tokenizer is not None
    assert specjax.generate(loaded, "the", method="ar", max_new_tokens=3).tokens == \
        specjax.generate(model, "the", method="ar", max_new_tokens=3).tokens
    # Linen variables carry nothing but arrays: the tokenizer is passed.
    _, variables = to_flax(model, api="linen")
    loaded = specjax.load(str(save_for_specjax(tmp_path / "linen", variables, model.config,
                                               tokenizer=model.tokenizer)))
    assert loaded.tokenizer is not None
