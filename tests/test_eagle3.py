"""EAGLE-3-class drafts: the target's block outputs, the training-time test, the reduced
vocabulary, exactness of decoding with them, the asset, and training (resumed)."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax
from specjax import api, decode, models
from specjax.cache import advance, init_cache
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.training import eagle3

from conftest import random_prompt, tiny_pair
from tolerances import assert_sums_close, forward_sums

NEW = 20
LAYERS = (0, 1, 2)
SHAPES = {
    "chain": dict(method="spec", draft_depth=3),
    "dynamic": dict(method="tree", tree_budget=8, draft_depth=3, draft_width=2),
}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama-gqa", seed=41)


@pytest.fixture(scope="module")
def target(pair):
    return pair[1]


def vocabulary(seed: int, size: int = 40, vocab: int = 97) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(vocab, size, replace=False))


def eagle3_params(target, seed: int, vocab=None):
    """(config, params) of an EAGLE-3 draft with random fusion and input weights (an
    untrained one reads no feature: ``fc = [I; 0]``)."""
    vocab = vocabulary(seed) if vocab is None else vocab
    config, params = eagle3.eagle3_draft_from_target(target.config, target.params, vocab,
                                                     LAYERS)
    rng = np.random.default_rng(seed)
    for name, scale in (("fc", 0.3), ("feature_fc", 0.2)):
        params[name] = (scale * rng.standard_normal(params[name].shape)).astype(np.float32)
    return config, params


def eagle3_draft(target, seed: int, vocab=None) -> specjax.Model:
    config, params = eagle3_params(target, seed, vocab)
    return specjax.Model.from_params(config, params, name=f"eagle3-{seed}")


def test_the_target_passes_return_its_blocks_outputs(pair):
    """The block outputs a verify pass returns (after a prefill through the cache, tree
    mask and all) equal transformers' hidden states of a plain forward over the same
    sequence at the same positions and blocks; so do the prefill's."""
    import torch

    hf_model, target = pair
    sequence = random_prompt(3, 14)
    with torch.no_grad():
        out = hf_model(torch.tensor([sequence]), output_hidden_states=True)
    # hidden_states[i + 1] is the output of block i (the last one is final-normed in HF).
    expected = np.concatenate([out.hidden_states[i + 1][0].numpy() for i in (0, 1)], axis=-1)
    layers = (0, 1)
    prefix = 9
    cache = init_cache(target.config, 32, jnp.float32)
    _, taps, cache = models.hidden_states(target.params, target.config,
                                          jnp.asarray(sequence[:prefix]),
                                          jnp.arange(prefix, dtype=jnp.int32), cache,
                                          feature_layers=layers)
    # Two float32 forward passes, summed in different orders (tests/tolerances.py).
    bound = forward_sums(target.config, len(sequence) + 1)
    assert_sums_close(taps, expected[:prefix], **bound)
    cache = advance(cache, prefix)
    # The rest as a tree: a chain with a sibling branch (node 5) that must not leak in.
    tokens = sequence[prefix:] + [7]
    parents = jnp.asarray([-1, 0, 1, 2, 3, 1], jnp.int32)
    from specjax.tree import ancestor_mask, depths

    mask = ancestor_mask(parents, jnp.ones((6,), jnp.bool_), 5)
    positions = prefix + depths(parents, 5)
    for impl in ("reference", "fused"):
        logits, taps, _ = models.forward(target.params, target.config, jnp.asarray(tokens),
                                         positions, cache, mask, attn_impl=impl,
                                         return_features=True, feature_layers=layers)
        assert_sums_close(taps[:5], expected[prefix:], **bound)
        assert_sums_close(logits[:5], out.logits[0, prefix:].numpy(), **bound)


@functools.lru_cache(maxsize=None)
def _family_target(variant: str):
    """A tiny transformers model of ``variant`` (tests/helpers_families.py) as a target."""
    from helpers_families import tiny_family_model
    from specjax.checkpoints_tools.keymap import params_from_hf_tensors
    from specjax.families import from_hf_config

    hf_model = tiny_family_model(variant, seed=3)
    config = from_hf_config(hf_model.config.to_dict())
    return specjax.Model.from_params(config, params_from_hf_tensors(config,
                                                                    _hub_tensors(hf_model)))


def _hub_tensors(hf_model) -> dict:
    """The model's tensors under the names its checkpoint files use (transformers keeps a
    mixture of experts stacked in memory and writes one tensor per expert)."""
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        return load_file(f"{directory}/model.safetensors")


@pytest.mark.parametrize("case", ["rope", "nope-layer", "neox-target", "gemma2-target",
                                  pytest.param("moe-target", marks=pytest.mark.slow),
                                  pytest.param("bigcode-target", marks=pytest.mark.slow)])
def test_the_unrolled_passes_read_what_decoding_reads(target, case):
    """Pass ``i`` of the training-time test at position ``r + i`` computes exactly what a
    depth-``i + 1`` chain node computes when decoding: the draft's cache filled with pass 0
    up to the root ``r``, then each node reading its parent's output, attending to the
    cache and its drafted ancestors (through the scratch slots). ``nope-layer``: the draft's
    block is a layer without RoPE (SmolLM3's NoPE layers), which training must skip too;
    ``neox-target``: a GPT-NeoX target's block (LayerNorm, parallel residual);
    ``gemma2-target``: a Gemma 2 target's (a query scale other than head_dim ** -0.5,
    soft-capped scores, a 5-token window in every other layer: before 2026-11-28 training
    attended without all three, which decoding applies);
    ``moe-target``: a Mixtral target's (its draft block routes over experts too, and
    slides a 6-token window); ``bigcode-target``: a GPTBigCode target's (learned positions,
    which pass ``i`` must read at ``r + i``, one KV head)."""
    if case in ("neox-target", "gemma2-target", "moe-target", "bigcode-target"):
        target = _family_target({"neox-target": "gpt-neox", "gemma2-target": "gemma2",
                                 "moe-target": "mixtral",
                                 "bigcode-target": "gpt-bigcode"}[case])
    config, params = eagle3_params(target, seed=1)
    if case == "nope-layer":
        config = dataclasses.replace(config, no_rope_layers=(0,))
    params = jax.tree.map(jnp.asarray, params)
    window = jnp.asarray(random_prompt(5, 12), jnp.int32)
    _, taps = eagle3.target_pass(target.params, target.config, window[None], LAYERS)
    taps = taps[0]
    unroll = 4
    inputs, outputs = eagle3.unroll_draft(params, config, window, taps, unroll)
    root = 6
    cache = init_cache(config, 32, jnp.float32)
    fused = models.fuse_features(params, config, taps)
    reads = jnp.concatenate([jnp.zeros_like(fused[:1]), fused[:-1]])
    hidden, cache = models.hidden_states(params, config, window[:root + 1],
                                         jnp.arange(root + 1, dtype=jnp.int32), cache,
                                         features=reads[:root + 1])
    # The same sums through the cache and without it, in other orders; each deeper pass
    # reads the one before, so its bound chains one pass further (tests/tolerances.py).
    bound = forward_sums(config, window.shape[0])
    assert_sums_close(hidden, outputs[0][:root + 1], **bound)
    cache = advance(cache, root + 1)
    parent = hidden[root:root + 1]
    for depth in range(1, unroll):
        position = root + depth
        scratch = jnp.ones((1, depth - 1), jnp.bool_)  # the drafted ancestors so far
        _, parent, cache = models.forward(params, config, window[position:position + 1],
                                          jnp.asarray([position], jnp.int32), cache,
                                          jnp.ones((1, 1), jnp.bool_), scratch,
                                          features=parent, return_features=True)
        assert_sums_close(parent[0], outputs[depth][position], longest_sum=bound["longest_sum"],
                          stages=bound["stages"] * (depth + 1))


def test_deeper_passes_read_the_drafts_own_features(target):
    """Pass 0 reads the target's fused features one position back; every deeper pass
    reads the previous pass's outputs, not the target's: perturbing the target's features
    at one position changes pass 0's inputs at the next position only, and the deeper
    passes' inputs stay the previous passes' outputs."""
    config, params = eagle3_params(target, seed=2)
    params = jax.tree.map(jnp.asarray, params)
    window = jnp.asarray(random_prompt(6, 10), jnp.int32)
    taps = eagle3.target_pass(target.params, target.config, window[None], LAYERS)[1][0]
    runs = []
    for delta in (0.0, 1.0):
        changed = taps.at[4].add(delta)
        runs.append(eagle3.unroll_draft(params, config, window, changed, 3))
        inputs, outputs = runs[-1]
        fused = models.fuse_features(params, config, changed)
        np.testing.assert_array_equal(inputs[0], eagle3.shift(fused))
        for i in (1, 2):
            np.testing.assert_array_equal(inputs[i], eagle3.shift(outputs[i - 1]))
            assert not np.allclose(inputs[i][1:], eagle3.shift(fused)[1:])
    differs = np.abs(np.asarray(runs[0][0][0] - runs[1][0][0])).max(axis=-1) > 0
    assert differs.tolist() == [t == 5 for t in range(10)]


def test_the_reduced_head_gives_probability_zero_outside_its_vocabulary(target):
    config, params = eagle3_params(target, seed=3)
    params = jax.tree.map(jnp.asarray, params)
    hidden = jax.random.normal(jax.random.PRNGKey(0), (5, config.hidden_size))
    full = models.lm_head(params, config, hidden)
    vocab = np.asarray(params["draft_vocab"])
    np.testing.assert_array_equal(full[:, vocab], models.draft_logits(params, config, hidden))
    outside = np.setdiff1d(np.arange(config.vocab_size), vocab)
    assert np.all(np.isneginf(full[:, outside]))
    # The untrained head is the target's (tied) rows of those ids.
    np.testing.assert_array_equal(params["draft_head"], target.params["embed"][vocab])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_and_coupled_equal_ar(target, shape, dtype):
    model = target if dtype == "float32" else specjax.Model.from_params(
        target.config, target.params, name="bf16", dtype=dtype)
    config, params = eagle3_params(target, seed=4)
    draft = specjax.Model.from_params(config, params, name="eagle3", dtype=dtype)
    assert draft.params["draft_vocab"].dtype == jnp.int32
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        prompt = random_prompt(seed, 7 + 5 * seed)
        expected = specjax.generate(model, prompt, max_new_tokens=NEW,
                                    temperature=temperature, seed=seed).tokens
        out = specjax.generate(model, prompt, max_new_tokens=NEW, temperature=temperature,
                               seed=seed, draft=draft, **SHAPES[shape])
        assert out.tokens == expected, (shape, temperature)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_greedy_and_coupled_equal_ar(target, dtype):
    """``staged`` with an EAGLE-3 draft (n-gram tables and context lookup proposing, the
    draft scoring): greedy and coupled output equal ``ar``'s."""
    from specjax.training.ngram_build import build_ngram

    model = target if dtype == "float32" else specjax.Model.from_params(
        target.config, target.params, name="bf16", dtype=dtype)
    config, params = eagle3_params(target, seed=8)
    draft = specjax.Model.from_params(config, params, name="eagle3", dtype=dtype)
    runs = ((0, 0.0), (1, 1.0))
    prompts = [random_prompt(seed + 30, 10) for seed, _ in runs]
    # One table set for both prompts (each prompt's text is in it): tables of one shape,
    # so both runs share one compiled program (a table per prompt had 9 and 10 bigram rows).
    tables = build_ngram([prompt * 3 for prompt in prompts], target.config.vocab_size,
                         top_k=4, trigram_top_k=2, trigram_buckets=64,
                         min_context_count=1).tables
    for (seed, temperature), prompt in zip(runs, prompts):
        expected = specjax.generate(model, prompt, max_new_tokens=NEW,
                                    temperature=temperature, seed=seed).tokens
        out = specjax.generate(model, prompt, max_new_tokens=NEW, temperature=temperature,
                               seed=seed, draft=draft, method="staged", ngram=tables)
        assert out.tokens == expected, temperature


def test_the_state_keeps_the_targets_block_outputs(target):
    """After decoding, ``state.method_state.features`` holds at every committed position
    the target's block outputs there (those of a plain forward over the whole output)."""
    draft = eagle3_draft(target, seed=5)
    prompt = random_prompt(8, 9)
    options = {k: v for k, v in SHAPES["dynamic"].items() if k != "method"}
    request = api._prepare(target, prompt, api.request(
        method="tree", max_new_tokens=NEW, draft=draft, **options))
    state = decode.run_program(request.args[0], request.loop, *request.args[1:])[0]
    length = int(state.length) - 1  # the last token is pending: the target has not run it
    tokens = jnp.asarray(state.tokens[:length])
    _, taps, _ = models.hidden_states(target.params, target.config, tokens,
                                      jnp.arange(length, dtype=jnp.int32),
                                      feature_layers=LAYERS)
    # The decode's passes (prefill, tree passes through the cache) against one forward.
    assert_sums_close(state.method_state.features[:length], taps,
                      **forward_sums(target.config, length))


def _eagle3_training(target, loss_cfg, compute_dtype: str = "float32"):
    """An untrained EAGLE-3 draft of ``target`` (its whole vocabulary, blocks LAYERS) and
    AdamW: (trainable, frozen, opt_state, train_step, eval_step)."""
    vocab = np.arange(target.config.vocab_size)
    config, params = eagle3.eagle3_draft_from_target(target.config, target.params, vocab,
                                                     LAYERS)
    trainable, frozen = eagle3.split_eagle3_trainable(jax.tree.map(jnp.asarray, params))
    optimizer = optax.adamw(1e-3)
    train_step, eval_step = eagle3.make_eagle3_steps(target.config, config, loss_cfg,
                                                     optimizer, compute_dtype)
    return trainable, frozen, optimizer.init(trainable), train_step, eval_step


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_training_lowers_the_loss(target, compute_dtype):
    """AdamW steps on the target's own text lower the EAGLE-3 loss (the depth-weighted KL
    to the target, every depth reading the draft's own features below the first) on that
    text, at every depth, and raise the depth-1 agreement; in float32 and with bfloat16
    products (float32 master weights, as ``--compute-dtype bfloat16`` trains)."""
    from specjax.models import cast_floats

    trainable, frozen, opt_state, train_step, eval_step = _eagle3_training(
        target, eagle3.Eagle3LossConfig(unroll=3), compute_dtype)
    target_params = cast_floats(target.params, compute_dtype)
    texts = []
    for seed in range(8):
        prompt = random_prompt(seed, 5)
        texts.append(prompt + specjax.generate(target, prompt, max_new_tokens=28).tokens)
    batch = jnp.asarray(texts, jnp.int32)
    before = eval_step(trainable, frozen, target_params, batch)
    for _ in range(30):
        trainable, opt_state, loss, _ = train_step(trainable, opt_state, frozen,
                                                   target_params, batch)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trainable))
    after = eval_step(trainable, frozen, target_params, batch)
    for depth in (1, 2, 3):
        assert after[f"kl{depth}"] < 0.7 * before[f"kl{depth}"], (depth, before, after)
    assert after["agreement1"] > before["agreement1"], (before, after)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("objective", ["tvd", "lk"])
def test_each_acceptance_objective_lowers_itself(target, objective):
    """``--loss tvd`` (1 - alpha) and ``--loss lk`` (-log alpha), alpha = sum min(p, q)
    the acceptance rate at T=1: the loss a step returns is that objective, depth-weighted
    (not the KL: the check a step that trained the KL instead would fail), and AdamW steps
    raise alpha at depth 1."""
    loss_cfg = eagle3.Eagle3LossConfig(unroll=2, objective=objective)
    trainable, frozen, opt_state, train_step, eval_step = _eagle3_training(target, loss_cfg)
    batch = jnp.asarray([random_prompt(seed, 5) + specjax.generate(
        target, random_prompt(seed, 5), max_new_tokens=20).tokens for seed in range(6)],
        jnp.int32)
    before = eval_step(trainable, frozen, target.params, batch)
    own = {"tvd": lambda m, d: 1.0 - m[f"acceptance{d}"],
           "lk": lambda m, d: -m[f"log_acceptance{d}"]}[objective]
    _, _, loss, _ = train_step(trainable, opt_state, frozen, target.params, batch)
    assert float(loss) == pytest.approx(
        float(own(before, 1) + loss_cfg.decay * own(before, 2)), rel=1e-5)
    for _ in range(20):
        trainable, opt_state, loss, _ = train_step(trainable, opt_state, frozen,
                                                   target.params, batch)
    after = eval_step(trainable, frozen, target.params, batch)
    assert own(after, 1) < 0.9 * own(before, 1), (before, after)
    assert after["acceptance1"] > before["acceptance1"]


def test_the_learning_rate_follows_steps_or_the_clock():
    """An EAGLE-3 run's rate: linear warm-up, then a cosine to a tenth, ended by the last
    step or by the time budget, whichever comes first; set between steps without
    rebuilding the optimizer."""
    from specjax.commands import train_draft

    cfg = train_draft.TrainConfig(eagle3=True, init_layers=(0,), steps=110, warmup_steps=10,
                                  learning_rate=1e-3)
    rate = train_draft.learning_rate
    assert rate(cfg, 0) == 0.0 and rate(cfg, 5) == pytest.approx(5e-4)
    assert rate(cfg, 10) == pytest.approx(1e-3) and rate(cfg, 60) == pytest.approx(5.5e-4)
    assert rate(cfg, 110) == pytest.approx(1e-4)
    assert rate(cfg, 20, clock=1.0) == pytest.approx(1e-4)  # the budget is spent
    assert rate(cfg, 20, clock=0.5) == pytest.approx(5.5e-4)
    assert rate(cfg, 60, clock=0.1) == rate(cfg, 60)  # the steps are further along
    optimizer = train_draft.make_optimizer(cfg)
    state = optimizer.init({"w": jnp.ones(3)})
    state = train_draft.set_learning_rate(state, 0.25)
    updates, _ = optimizer.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})
    # Adam's first update is -lr * g / (|g| + eps): eps = 1e-8 against |g| = 1 moves it by
    # ~1e-8 relative, far inside this.
    np.testing.assert_allclose(updates["w"], -0.25 * np.ones(3), rtol=1e-6)
    with pytest.raises(InvalidArgumentError, match="compute_dtype must be one of"):
        train_draft.TrainConfig(compute_dtype="float16")


def test_a_schedule_start_replays_a_budgeted_runs_clock_by_step_count(capsys):
    """--schedule-start S: after warm-up the cosine starts at S and ends at the last step.
    A budgeted run whose clock stood at S when warm-up ended and ran on evenly to the
    budget's end at its last step had the same rates (its --steps far beyond), which is
    how the shipped draft's recipe replays its runs. 0 (the default) changes nothing and
    is not recorded; the option is EAGLE-3's only and a fraction below 1."""
    import argparse

    from specjax import cli
    from specjax.commands import train_draft

    rate = train_draft.learning_rate
    base = dict(eagle3=True, init_layers=(0,), warmup_steps=10, learning_rate=1e-3)
    replay = train_draft.TrainConfig(steps=110, schedule_start=0.2, **base)
    budgeted = train_draft.TrainConfig(steps=40_000, **base)
    plain = train_draft.TrainConfig(steps=110, **base)
    for step in (0, 5, 10, 35, 60, 109, 110):
        clock = 0.2 + 0.8 * (step - 10) / 100 if step >= 10 else 0.0
        assert rate(replay, step) == pytest.approx(rate(budgeted, step, clock=clock)), step
    assert rate(replay, 5) == rate(plain, 5)  # the warm-up is the steps'
    assert rate(replay, 10) == pytest.approx(1e-4 + 9e-4 * (1 + np.cos(0.2 * np.pi)) / 2)
    assert rate(replay, 110) == pytest.approx(1e-4)
    assert rate(replay, 20, clock=0.9) == pytest.approx(rate(plain, 20, clock=0.9))
    assert "schedule_start" not in plain.record()
    assert replay.record()["schedule_start"] == 0.2

    parser = argparse.ArgumentParser()
    train_draft.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "out", "--eagle3", "--schedule-start", "0.25"])
    assert train_draft.train_config(args).schedule_start == 0.25
    for argv, message in ((["--schedule-start", "0.25"], "it needs --eagle3"),
                          (["--eagle3", "--schedule-start", "1"], "schedule_start must be in")):
        assert cli.main(["train-draft", "out", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_an_eagle3_asset_round_trips(target, tmp_path):
    """``save_draft_asset`` stores the draft's own tensors (float16) and its id map
    (int32), records the feature layers and vocabulary size, and never the shared
    embedding; loading it gives the same draft (same map, same head rows), which decodes
    exactly; a damaged map fails in one line."""
    from safetensors.numpy import load_file, save_file

    from specjax.checkpoints_tools.sources import load_bundled_draft, save_draft_asset

    config, params = eagle3_params(target, seed=6)
    asset = save_draft_asset(tmp_path / "a", target.config, params, target.params["embed"],
                             {"note": "test"}, feature_layers=config.feature_layers)
    record = json.loads((asset / "draft.json").read_text())
    assert record["feature_layers"] == list(LAYERS) and record["draft_vocab_size"] == 40
    tensors = load_file(str(asset / "draft.safetensors"))
    assert "embed" not in tensors and tensors["draft_vocab"].dtype == np.int32
    assert tensors["draft_head"].dtype == np.float16
    draft = load_bundled_draft(target, asset)
    assert draft.config == config
    np.testing.assert_array_equal(draft.params["draft_vocab"], params["draft_vocab"])
    np.testing.assert_array_equal(draft.params["draft_head"],
                                  params["draft_head"].astype(np.float16).astype(np.float32))
    prompt = random_prompt(9, 6)
    assert (specjax.generate(target, prompt, max_new_tokens=12, draft=draft,
                             **SHAPES["dynamic"]).tokens
            == specjax.generate(target, prompt, max_new_tokens=12).tokens)
    tensors["draft_vocab"] = np.full(40, 3, np.int32)
    save_file(tensors, str(asset / "draft.safetensors"))
    with pytest.raises(CheckpointError, match="draft_vocab must hold distinct ids"):
        load_bundled_draft(target, asset)


def test_a_run_continues_an_eagle3_asset(target, tmp_path):
    """``--eagle3 --init-draft ASSET`` starts from the asset's own tensors (float16-stored,
    so the same values rounded) and keeps its id map, saved as the run's vocabulary; flags
    that disagree with the asset, or a draft that is not EAGLE-3, fail in one line."""
    from specjax.checkpoints_tools.sources import save_draft_asset
    from specjax.training import drafts
    from specjax.training.config import TrainConfig

    config, params = eagle3_params(target, seed=8)
    asset = save_draft_asset(tmp_path / "a", target.config, params, target.params["embed"],
                             {"note": "test"}, feature_layers=config.feature_layers)
    cfg = TrainConfig(eagle3=True, init_draft=str(asset), feature_layers=LAYERS,
                      draft_vocab=40)
    out = tmp_path / "run"
    out.mkdir()
    vocab, source = drafts.draft_vocabulary(out, cfg, target.config.vocab_size)
    np.testing.assert_array_equal(vocab, params["draft_vocab"])
    assert str(asset) in source
    np.testing.assert_array_equal(np.load(out / "draft_vocab.npy"), params["draft_vocab"])
    got_config, got = drafts.initial_draft(target, cfg, vocab)
    assert got_config == config
    stored = jax.tree.map(lambda a: np.asarray(a).astype(np.float16).astype(np.float32),
                          {k: v for k, v in params.items() if k not in ("embed", "draft_vocab")})
    jax.tree.map(np.testing.assert_array_equal,
                 {k: v for k, v in got.items() if k in stored}, stored)
    assert set(got) == set(params)
    np.testing.assert_array_equal(got["draft_vocab"], params["draft_vocab"])
    trainable, frozen = drafts.split_trainable(got, False)
    assert "fc" in trainable and "draft_vocab" in frozen

    with pytest.raises(InvalidArgumentError, match="scores 40 ids, not the run's"):
        drafts.initial_draft(target, TrainConfig(eagle3=True, init_draft=str(asset),
                                                 feature_layers=LAYERS), None)
    with pytest.raises(InvalidArgumentError, match=r"reads target blocks \(0, 1, 2\)"):
        drafts.initial_draft(target, TrainConfig(eagle3=True, init_draft=str(asset),
                                                 feature_layers=(0, 1), draft_vocab=40), None)
    token_draft = save_draft_asset(tmp_path / "t", target.config,
                                   {k: v for k, v in target.params.items() if k != "embed"},
                                   target.params["embed"], {"note": "token draft"})
    with pytest.raises(InvalidArgumentError, match="is not an EAGLE-3 draft"):
        drafts.initial_draft(target, TrainConfig(eagle3=True, init_draft=str(token_draft)),
                             None)


@pytest.mark.slow  # ~18 s of compiling: the slow tier keeps `make test` under 15 minutes
def test_the_pass_cost_split_times_a_feature_draft(target):
    """``specjax bench``'s pass-cost split (after the prompts) runs an EAGLE-3 draft's
    passes with feature rows, as decoding does; it stopped a whole suite run with "a feature
    draft needs features" on 2026-11-27."""
    from specjax.harness import passcost
    from specjax.methods import method_options

    draft = eagle3_draft(target, seed=5, vocab=vocabulary(5))
    out = passcost.step_breakdowns(
        target, {"spec": (method_options("spec", draft_depth=2), draft),
                 "staged": (method_options("staged"), draft)}, prefix=8, repeats=1)
    for label in ("spec", "staged"):
        assert out[label]["draft_passes"], out[label]
        assert out[label]["draft_ms"] > 0 and out[label]["target_ms"] > 0


def test_errors_are_one_line(target):
    with pytest.raises(InvalidArgumentError, match="draft_vocab must be distinct ids"):
        eagle3.eagle3_draft_from_target(target.config, target.params, [1, 1, 2], LAYERS)
    with pytest.raises(InvalidArgumentError, match="feature_layers .* out of range"):
        eagle3.eagle3_draft_from_target(target.config, target.params, [1, 2], (0, 3))
    with pytest.raises(InvalidArgumentError, match="unroll must be an integer >= 1"):
        eagle3.Eagle3LossConfig(unroll=0)
    from specjax.training.config import TrainConfig

    with pytest.raises(InvalidArgumentError, match="unknown EAGLE-3 objective 'ce'"):
        eagle3.Eagle3LossConfig(objective="ce")
    with pytest.raises(InvalidArgumentError, match="--loss one of .*, not 'ce'"):
        TrainConfig(eagle3=True, loss="ce")
    with pytest.raises(InvalidArgumentError, match=r"feature draft .*\(--loss kl\), not 'lk'"):
        TrainConfig(feature_draft=True, loss="lk")
    assert TrainConfig(eagle3=True, loss="lk").loss_config().objective == "lk"
    draft = eagle3_draft(target, seed=7)
    with pytest.raises(InvalidArgumentError, match="already scores a reduced vocabulary"):
        draft.with_head_subset([1, 2, 3])
    short = specjax.Model.from_params(
        target.config.__class__(**{**target.config.__dict__, "num_layers": 2}),
        {**target.params, "layers": jax.tree.map(lambda a: a[:2], target.params["layers"])},
        name="short")
    with pytest.raises(InvalidArgumentError, match="reads the outputs of target blocks"):
        specjax.generate(short, [1, 2, 3], max_new_tokens=4, draft=draft, method="spec")


def test_default_feature_layers():
    assert eagle3.default_feature_layers(30) == (1, 14, 26)
    assert eagle3.default_feature_layers(3) == (1, 0)


MODULE = '''"""A module."""


def area_{i}(radius):
    """Area of a circle of the given radius."""
    return 3.14159 * radius ** 2


def scale_{i}(shape, factor):
    """Scales the shape by factor, returning a new list."""
    return [x * factor for x in shape]
'''


# A train-draft --eagle3 run in seconds: a 256-id head, windows of 16, a target corpus of
# 96 tokens the target writes itself.
TINY_RUN = dict(init_layers=(0,), eagle3=True, feature_layers=(0, 1, 2), draft_vocab=256,
                batch_size=2, seq_len=16, learning_rate=3e-3, warmup_steps=1, eval_every=2,
                eval_windows=4, heldout_fraction=0.2, target_corpus_tokens=96,
                target_gen_len=24, target_batch_size=3, target_corpus_fraction=1.0)


@pytest.fixture(scope="module")
def tokenizer_target():
    from specjax.training import ngram_build

    from conftest import tiny_target_with_tokenizer

    tokenizer = ngram_build.load_tokenizer("smollm2-135m")[0]
    return tiny_target_with_tokenizer(tokenizer, 49152, max_positions=512, eos_token_id=2,
                                      bos_token_id=1)


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_train_draft_stops_at_its_time_budget_resumes_and_exports(tokenizer_target, tmp_path,
                                                                 monkeypatch):
    """``train-draft --eagle3`` on the target's own text: a run stopped by its time budget
    saves and exports at that step; the rerun resumes there and finishes; the log has
    per-depth held-out agreement on the target's continuations; the draft's vocabulary is
    the most frequent ids of that text; the asset decodes exactly."""
    from specjax.checkpoints_tools import sources
    from specjax.commands import train_draft
    from specjax.training import sample_corpus

    from conftest import write_corpus

    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    target = tokenizer_target
    files = write_corpus(tmp_path, [MODULE.format(i=i) for i in range(40)])
    cfg = train_draft.TrainConfig(**TINY_RUN, unroll=3, steps=6, checkpoint_every=2)
    out = tmp_path / "run"
    messages = []
    first = train_draft.train_draft(target, out, cfg, corpus_files=files,
                                    log=messages.append, time_budget=1e-3)
    assert first["steps"] == 1 and first["stopped_by_time_budget"], first
    assert specjax.load(first["draft"]).config.draft_vocab_size == 256
    again = train_draft.train_draft(target, out, cfg, corpus_files=files, log=messages.append)
    assert "resumed from step 1" in messages and again["steps"] == 6
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [0, 1, 2, 4, 6]
    assert all(len(e["heldout_target_agreement_depth"]) == 3 for e in log)

    asset = tmp_path / "asset"
    train_draft.export_latest(target, out, asset)
    draft = sources.load_bundled_draft(target, directory=asset)
    assert draft.config.feature_layers == (0, 1, 2) and draft.config.draft_vocab_size == 256
    with np.load(out / "target_corpus.npz") as corpus:
        counts = np.bincount(corpus["train"], minlength=target.config.vocab_size)
    kept = np.asarray(draft.params["draft_vocab"])
    assert counts[kept].min() >= np.delete(counts, kept).max()  # the most frequent ids
    ids = [5, 17, 300, 42, 7]
    expected = specjax.generate(target, ids, max_new_tokens=8).tokens
    for method in ("spec", "tree"):
        assert specjax.generate(target, ids, max_new_tokens=8, method=method,
                                draft=draft).tokens == expected
    with pytest.raises(InvalidArgumentError, match="head-tokens"):
        train_draft.export_latest(target, out, tmp_path / "bad", head_tokens=64)

    # Trained further (--init-draft): the second run starts where the first ended (its
    # step-0 held-out KL is the first run's last, the asset's float16 rounding aside).
    more = dataclasses.replace(cfg, init_draft=str(asset), steps=2)
    train_draft.train_draft(target, tmp_path / "more", more, corpus_files=files,
                            log=messages.append)
    log2 = [json.loads(line)
            for line in (tmp_path / "more" / "train_log.jsonl").read_text().splitlines()]
    first_kl, last_kl = (log[0]["heldout_target_kl_depth"][0],
                         log[-1]["heldout_target_kl_depth"][0])
    start_kl = log2[0]["heldout_target_kl_depth"][0]
    assert abs(start_kl - last_kl) < 0.1 * abs(first_kl - last_kl), (first_kl, last_kl, start_kl)
    with pytest.raises(InvalidArgumentError, match="--feature-draft and --add-layers do not"):
        train_draft.TrainConfig(eagle3=True, feature_draft=True)


@pytest.mark.slow  # a target corpus, six steps and an export per family: ~1 min each
@pytest.mark.parametrize("variant", ["qwen3-tied", "gemma3"])
def test_train_draft_eagle3_for_a_users_own_target(variant, tmp_path, monkeypatch):
    """``train-draft --eagle3`` on a target of another family (a tiny random Qwen3, whose
    blocks norm q and k, and Gemma 3, whose norms scale by 1 + w, embeddings by sqrt(d)
    and layers alternate sliding and global attention) over a real tokenizer: the run
    trains, exports, and the asset decodes exactly like ``ar`` with spec and tree."""
    from specjax.checkpoints_tools import sources
    from specjax.checkpoints_tools.keymap import params_from_hf_tensors
    from specjax.commands import train_draft
    from specjax.families import from_hf_config
    from specjax.training import ngram_build, sample_corpus

    from conftest import write_corpus
    from helpers_families import tiny_family_model

    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    tokenizer = ngram_build.load_tokenizer("smollm2-135m")[0]
    hf = tiny_family_model(variant, vocab_size=49152, max_position_embeddings=512,
                           eos_token_id=2, bos_token_id=1)
    config = from_hf_config(hf.config)
    params = params_from_hf_tensors(
        config, {k: v.detach().numpy() for k, v in hf.state_dict().items()}, source=variant)
    target = specjax.Model.from_params(config, params, tokenizer, name=f"tiny-{variant}")
    files = write_corpus(tmp_path, [MODULE.format(i=i) for i in range(24)])
    cfg = train_draft.TrainConfig(**TINY_RUN, unroll=2, steps=4, checkpoint_every=4)
    result = train_draft.train_draft(target, tmp_path / "run", cfg, corpus_files=files,
                                     log=lambda message: None)
    assert result["steps"] == 4
    log = [json.loads(line)
           for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(e["heldout_target_kl_depth"]).all() for e in log)
    train_draft.export_latest(target, tmp_path / "run", tmp_path / "asset")
    draft = sources.load_bundled_draft(target, directory=tmp_path / "asset")
    assert draft.config.feature_layers == (0, 1, 2) and draft.config.draft_vocab_size == 256
    ids = [5, 17, 300, 42, 7]
    expected = specjax.generate(target, ids, max_new_tokens=8).tokens
    for method in ("spec", "tree"):
        assert specjax.generate(target, ids, max_new_tokens=8, method=method,
                                draft=draft).tokens == expected, method
