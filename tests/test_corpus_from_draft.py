"""``specjax train-draft --corpus-from-draft``: the draft's own rollouts as training text
(on-policy data). The rollouts come from the draft (a feature draft reading the target's
features for the prompt, then its own states; in chains that the target reads), are
seeded per row, use the prompts of the target's text, are mixed by their share and cached,
and bad settings are refused before anything loads. Tiny random models."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import cli, models
from specjax.commands import train_draft
from specjax.errors import InvalidArgumentError
from specjax.training import draft_corpus, eagle3, sample_corpus
from specjax.training.corpus import mixed_windows

from conftest import random_prompt, tiny_pair

LAYERS = (0, 1, 2)


@pytest.fixture(scope="module")
def target():
    return tiny_pair("llama-gqa", seed=41)[1]


def eagle3_params(target, seed: int, vocab=None):
    """(config, params) of an EAGLE-3 draft with random fusion and input weights, so that
    it reads its features (an untrained one, ``fc = [I; 0]``, reads none)."""
    if vocab is None:
        vocab = np.sort(np.random.default_rng(seed).choice(97, 40, replace=False))
    config, params = eagle3.eagle3_draft_from_target(target.config, target.params, vocab,
                                                     LAYERS)
    rng = np.random.default_rng(seed)
    for name, scale in (("fc", 0.3), ("feature_fc", 0.2)):
        params[name] = (scale * rng.standard_normal(params[name].shape)).astype(np.float32)
    return config, jax.tree.map(jnp.asarray, params)


def greedy_reference(target, config, params, prompt, count: int, depth: int) -> list[int]:
    """The draft's greedy continuation, one uncached pass per token: position ``t`` reads
    the target's (uncached) block outputs at ``t - 1`` up to the current chain's root (the
    last position the target has read: the prompt's last, then every ``depth`` tokens)
    and, below it, the draft's own output at ``t - 1`` as recorded when ``t - 1`` was
    the last position."""
    tokens, own = list(prompt), {}
    for _ in range(count):
        n = len(tokens) - 1  # the position whose output picks the next token
        root = len(prompt) - 1 + ((n - len(prompt) + 1) // depth * depth if depth else 0)
        ids = jnp.asarray(tokens, jnp.int32)
        positions = jnp.arange(len(tokens), dtype=jnp.int32)
        _, taps, _ = models.hidden_states(target.params, target.config, ids, positions,
                                          attn_impl="reference", feature_layers=LAYERS)
        fused = models.fuse_features(params, config, taps)
        rows = [jnp.zeros_like(fused[0]) if t == 0 else
                fused[t - 1] if t <= root else own[t - 1] for t in range(len(tokens))]
        hidden, _ = models.hidden_states(params, config, ids, positions,
                                         attn_impl="reference", features=jnp.stack(rows))
        own[n] = hidden[n]
        tokens.append(int(jnp.argmax(models.lm_head(params, config, hidden[n:n + 1])[0])))
    return tokens[len(prompt):]


@pytest.mark.slow  # compiles the rollout program (10-80 s on a shared CPU)
@pytest.mark.parametrize("depth", [0, 2, 3])
def test_a_greedy_rollout_is_the_drafts_own_continuation(target, depth):
    """T = 0: the batched program's rows (prompts of two lengths, one padded batch) equal
    the draft's greedy continuation computed token by token without caches; with chains,
    the target's features come back after each chain (so depths 0, 2 and 3 differ)."""
    config, params = eagle3_params(target, seed=4)
    prompts = [random_prompt(1, 5), random_prompt(2, 9), random_prompt(3, 7)]
    out = draft_corpus.rollout_continuations(target.params, target.config, params, config,
                                             prompts, num_new_tokens=7, temperature=0.0,
                                             depth=depth, batch_size=2)
    for prompt, row in zip(prompts, out):
        assert row.tolist() == greedy_reference(target, config, params, prompt, 7, depth)


@pytest.mark.slow  # compiles the rollout program (10-80 s on a shared CPU)
def test_depth_changes_what_the_draft_reads(target):
    """A control for the test above: chains that the target reads give other text than
    the draft alone (so the reference's rule is exercised, not trivially met)."""
    config, params = eagle3_params(target, seed=4)
    prompts = [random_prompt(s, 6) for s in range(4)]
    alone, chained = (draft_corpus.rollout_continuations(
        target.params, target.config, params, config, prompts, num_new_tokens=8,
        temperature=0.0, depth=depth, batch_size=4) for depth in (0, 1))
    assert not np.array_equal(alone, chained)


@pytest.mark.slow  # compiles the rollout program (10-80 s on a shared CPU)
def test_a_draft_that_knows_one_token_writes_only_it(target):
    """A reduced vocabulary of one id: every rollout token is that id, at T = 1 too."""
    config, params = eagle3_params(target, seed=5, vocab=[17])
    out = draft_corpus.rollout_continuations(target.params, target.config, params, config,
                                             [random_prompt(0, 6), random_prompt(1, 3)],
                                             num_new_tokens=9, temperature=1.0, seed=3,
                                             depth=2, batch_size=2)
    assert out.tolist() == [[17] * 9, [17] * 9]


@pytest.mark.slow  # compiles the rollout program (10-80 s on a shared CPU)
def test_rows_are_seeded_and_a_standalone_draft_samples_alone(target):
    """Row i samples with row_seed(seed, first_row + i): the same seed gives the same
    rows, another seed others; a row of a later part equals that row drawn alone. A draft
    without features is sampled as sample_continuations samples it."""
    config, params = eagle3_params(target, seed=6)
    prompts = [random_prompt(s, 5) for s in range(4)]

    def roll(seed, rows=prompts, first_row=0):
        return draft_corpus.rollout_continuations(
            target.params, target.config, params, config, rows, num_new_tokens=6,
            temperature=1.0, depth=3, seed=seed, batch_size=2, first_row=first_row)

    first = roll(0)
    assert np.array_equal(first, roll(0)) and not np.array_equal(first, roll(1))
    assert np.array_equal(roll(0, prompts[2:], first_row=2), first[2:])
    standalone = target.first_layers(1)
    args = dict(num_new_tokens=6, temperature=1.0, seed=2, batch_size=2)
    assert np.array_equal(
        draft_corpus.rollout_continuations(target.params, target.config, standalone.params,
                                           standalone.config, prompts, **args),
        sample_corpus.sample_continuations(standalone.params, standalone.config, prompts,
                                           **args))


def test_mixed_windows_take_each_share():
    rng = np.random.default_rng(0)
    files, generated, rollouts = (np.full(100, value, np.int32) for value in (1, 2, 3))
    batch = mixed_windows(files, generated, rng, 8, 5, 4, rollouts, 2)
    assert batch[:, 0].tolist() == [1, 1, 2, 2, 2, 2, 3, 3]
    only = mixed_windows(files, generated, rng, 4, 5, 0, rollouts, 4)
    assert only[:, 0].tolist() == [3, 3, 3, 3]
    with pytest.raises(InvalidArgumentError, match="exceed a batch of 4"):
        mixed_windows(files, generated, rng, 4, 5, 3, rollouts, 2)


BASE = dict(target_corpus_tokens=8, draft_corpus_tokens=8, rollout_draft="d", batch_size=4)


@pytest.mark.parametrize("overrides,message", [
    (dict(draft_corpus_tokens=-1), "draft_corpus_tokens must be >= 0"),
    (dict(rollout_draft=None), "needs the draft that writes"),
    (dict(draft_corpus_fraction=1.5), "draft_corpus_fraction must be in"),
    (dict(draft_corpus_fraction=-0.1), "draft_corpus_fraction must be in"),
    (dict(draft_corpus_fraction=0.5, target_corpus_fraction=0.75), "sum must be at most 1"),
    (dict(rollout_temperature=-1.0), "rollout_temperature"),
    (dict(rollout_len=0), "rollout_len"),
    (dict(rollout_depth=-1), "rollout_depth"),
    (dict(rollout_chat_fraction=2.0), "rollout_chat_fraction"),
])
def test_bad_settings(overrides, message):
    with pytest.raises(InvalidArgumentError, match=message):
        train_draft.TrainConfig(**{**BASE, **overrides})


def test_the_record_keeps_the_rollout_settings_only_when_used():
    record = train_draft.TrainConfig(**BASE, draft_corpus_fraction=0.25).record()
    assert record["draft_corpus_fraction"] == 0.25 and record["rollout_draft"] == "d"
    assert "rollout_len" not in train_draft.TrainConfig(target_corpus_tokens=8).record()
    # Without the target's text the rollouts still record the rows written at once, and a
    # share of the batch that the target's text would have taken is free.
    alone = train_draft.TrainConfig(**{**BASE, "target_corpus_tokens": 0},
                                    draft_corpus_fraction=1.0, rollout_chat_fraction=0.5)
    kept = alone.record()
    assert kept["rollout_chat_fraction"] == 0.5 and kept["target_batch_size"] == 16
    assert "target_corpus_fraction" not in kept and "target_corpus_tokens" not in kept


@pytest.mark.parametrize("args,message", [
    (["--corpus-from-target", "10", "--corpus-from-draft", "-5", "--rollout-draft",
      "smollm2-135m-draft"], "draft_corpus_tokens must be >= 0"),
    (["--corpus-from-target", "10", "--corpus-from-draft", "10"], "--rollout-draft DRAFT"),
    (["--corpus-from-target", "10", "--corpus-from-draft", "10", "--rollout-draft",
      "smollm2-135m-draft", "--draft-corpus-fraction", "2"], "draft_corpus_fraction must be"),
    (["--corpus-from-target", "10", "--corpus-from-draft", "10", "--rollout-draft",
      "no/such/draft"], "no draft 'no/such/draft'"),
    (["--rollout-temperature", "0.5"], "--rollout-temperature only apply with"),
    (["--corpora-only", "--asset", "x"], "--corpora-only writes the corpora"),
])
def test_cli_errors_are_one_line_before_anything_loads(tmp_path, capsys, monkeypatch, args,
                                                       message):
    def no_loading(*_, **__):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(specjax.api, "load", no_loading)
    code = cli.main(["train-draft", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("specjax: error:") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


MODULE = '''"""A module."""


def area_{i}(radius):
    """Area of a circle of the given radius."""
    return 3.14159 * radius ** 2


def scale_{i}(shape, factor):
    """Scales the shape by factor, returning a new list."""
    return [x * factor for x in shape]
'''


@pytest.mark.slow  # three short train-draft runs (~30-60 s)
def test_rollouts_are_made_ahead_carried_mixed_and_checked(tmp_path, monkeypatch):
    """``--corpora-only`` writes the rollouts (ids of the draft's vocabulary only, after
    the target corpus's prompts) and stops; a run that finds the file in its folder trains
    on it without the draft (here not loadable by name), taking its share of each batch,
    and logs agreement on held-out rollouts; a run with other rollout settings refuses
    the file."""
    import shutil

    from specjax.training import loop, ngram_build

    from conftest import tiny_target_with_tokenizer, write_corpus

    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    tokenizer = ngram_build.load_tokenizer("smollm2-135m")[0]
    target = tiny_target_with_tokenizer(tokenizer, 49152, max_positions=512, eos_token_id=2,
                                        bos_token_id=1)
    vocab = np.sort(np.random.default_rng(0).choice(np.arange(3, 49152), 256, replace=False))
    config, params = eagle3.eagle3_draft_from_target(target.config, target.params, vocab,
                                                     (0, 1, 2))
    draft = specjax.Model.from_params(config, params, name="tiny-eagle3")
    files = write_corpus(tmp_path, [MODULE.format(i=i) for i in range(40)])
    cfg = train_draft.TrainConfig(
        init_layers=(0,), eagle3=True, feature_layers=(0, 1, 2), draft_vocab=256,
        batch_size=2, seq_len=16, learning_rate=3e-3, warmup_steps=1, steps=2, eval_every=2,
        checkpoint_every=2, eval_windows=4, heldout_fraction=0.2, target_corpus_tokens=48,
        target_gen_len=24, target_batch_size=3, target_corpus_fraction=0.5,
        draft_corpus_tokens=96, rollout_draft="not-a-loadable-draft", rollout_len=24,
        draft_corpus_fraction=0.5, rollout_chat_fraction=0.5)
    made = train_draft.train_draft(target, tmp_path / "cpu", cfg, corpus_files=files,
                                   rollout_draft=draft, corpora_only=True, log=lambda _: None)
    path = tmp_path / "cpu" / "draft_corpus.npz"
    assert made["corpora"][str(path)]["train_tokens"] > 0
    assert not (tmp_path / "cpu" / "train_state").exists()
    with np.load(path) as data:
        rollouts = data["train"]
        info = json.loads(bytes(data["info"]).decode())
    assert info["settings"]["chat_fraction"] == 0.5 and info["rows"] == 4
    # Four documents (chat prompts hold the separator too): a prompt of the target corpus,
    # then 24 ids of the draft's vocabulary, then the separator.
    ends = [i for i in np.flatnonzero(rollouts == 2) if np.isin(rollouts[i - 24:i], vocab).all()]
    assert len(ends) == 4 and ends[-1] == rollouts.size - 1
    text = tokenizer.decode(rollouts.tolist())
    assert text.count("def area_") + text.count("def scale_") == 4
    assert text.count("<|im_start|>assistant") == 2  # half of the rows through the template

    taken = []

    def spy(*args):
        taken.append(args[5:])
        return mixed_windows(*args)

    monkeypatch.setattr(loop, "mixed_windows", spy)
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    shutil.copy(path, gpu / "draft_corpus.npz")
    messages = []
    summary = train_draft.train_draft(target, gpu, cfg, corpus_files=files,
                                      log=messages.append)
    assert any(m.startswith("draft corpus: reusing") for m in messages), messages
    assert summary["steps"] == 2 and 0 <= summary["heldout_draft_agreement"] <= 1
    assert all(t[0] == 1 and t[2] == 1 for t in taken) and len(taken) == 2
    log = [json.loads(line) for line in (gpu / "train_log.jsonl").read_text().splitlines()]
    assert all(len(e["heldout_draft_agreement_depth"]) == 4 for e in log)
    record = json.loads((gpu / "train_config.json").read_text())
    assert record["draft_corpus_fraction"] == 0.5 and record["rollout_len"] == 24

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(path, other / "draft_corpus.npz")
    with pytest.raises(InvalidArgumentError, match="temperature 1.0.*temperature 0.5"):
        train_draft.train_draft(target, other, dataclasses.replace(cfg, rollout_temperature=0.5),
                                corpus_files=files, log=lambda _: None)
