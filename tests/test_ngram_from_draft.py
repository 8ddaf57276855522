"""Stage-2 tables from a draft's own samples (``specjax build-ngram --from-draft``): the
batched sampler (count, determinism, temperature, coupling with ``ar``), the build, and
the command's errors, with tiny random models over SmolLM2's vocabulary."""

import numpy as np
import pytest
import torch
import transformers

import specjax
from specjax import cli
from specjax.checkpoints_tools.keymap import params_from_hf_tensors
from specjax.checkpoints_tools.orbax_io import save_orbax
from specjax.families import from_hf_config
from specjax.drafters.ngram import load_ngram, read_ngram_metadata
from specjax.errors import InvalidArgumentError
from specjax.training import ngram_build, ngram_from_draft, sample_corpus

CODE = '''def mean(values):
    """Average of values."""
    return sum(values) / len(values)
'''


def tiny_llama(tokenizer, seed: int, layers: int, name: str) -> specjax.Model:
    """A random Llama with SmolLM2's vocabulary (49152) and tokenizer."""
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    config = from_hf_config(hf_config)
    params = params_from_hf_tensors(
        config, {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}, source=name)
    return specjax.Model.from_params(config, params, tokenizer, name=name)


@pytest.fixture(scope="module")
def tokenizer():
    return ngram_build.load_tokenizer("smollm2-135m")[0]


@pytest.fixture(scope="module")
def draft(tokenizer):
    return tiny_llama(tokenizer, seed=5, layers=1, name="tiny-draft")


@pytest.fixture(scope="module")
def target_dir(tokenizer, tmp_path_factory):
    """A tiny target saved as a specjax checkpoint, so it loads by path like a real one."""
    target = tiny_llama(tokenizer, seed=6, layers=2, name="tiny-target")
    path = tmp_path_factory.mktemp("target") / "tiny-target"
    save_orbax(path, target.config, target.params, tokenizer)
    return path


def test_sampler_count_shape_and_padding(draft):
    streams = [np.arange(100, 140, dtype=np.int32)]
    samples = sample_corpus.draft_samples(draft, 50, temperature=1.5, seed=3, batch_size=3,
                                          seq_len=16, streams=streams)
    assert samples.shape == (4, 16) and samples.dtype == np.int32
    flat = samples.reshape(-1)
    assert np.all(flat[50:] == sample_corpus.PAD)  # exactly N positions are sampled
    # each row: tokens, then (after its first stop token) only padding
    for row in samples[:, :]:
        stop = np.flatnonzero(row == 2)
        end = stop[0] + 1 if stop.size else len(row)
        assert np.all(row[end:] == sample_corpus.PAD)
    assert flat[flat >= 0].max() < draft.config.vocab_size


def test_sampler_is_deterministic_per_seed(draft):
    kwargs = dict(temperature=1.5, batch_size=4, seq_len=12)
    one = sample_corpus.draft_samples(draft, 48, seed=1, **kwargs)
    assert np.array_equal(one, sample_corpus.draft_samples(draft, 48, seed=1, **kwargs))
    other = sample_corpus.draft_samples(draft, 48, seed=2, **kwargs)
    assert not np.array_equal(one, other)
    # rows are independent samples, not copies (all prompts are the same separator here)
    assert len({tuple(row) for row in one}) == len(one)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1.5])
def test_sampler_rows_are_ar_generations(draft, temperature):
    """Row i is ``generate(method="ar", seed=row_seed(seed, i))``: exact sampling at T, and
    greedy decoding at T = 0 (batched and padded rows change nothing)."""
    prompts = [[2, 400, 401], [2], [2, 17, 18, 19, 20, 21]]
    out = sample_corpus.sample_continuations(draft.params, draft.config, prompts,
                                             num_new_tokens=10, temperature=temperature,
                                             seed=9, batch_size=2)
    for i, prompt in enumerate(prompts):
        ref = specjax.generate(draft, prompt, method="ar", max_new_tokens=10,
                               temperature=temperature, seed=sample_corpus.row_seed(9, i),
                               stop=[])
        assert out[i].tolist() == list(ref.tokens), (i, temperature)


def test_sampler_low_temperature_is_greedy_and_high_spreads(draft):
    prompts = [[2, 400 + i] for i in range(6)]
    kwargs = dict(num_new_tokens=12, seed=4, batch_size=6)
    greedy = sample_corpus.sample_continuations(draft.params, draft.config, prompts,
                                                temperature=0.0, **kwargs)
    cold = sample_corpus.sample_continuations(draft.params, draft.config, prompts,
                                              temperature=1e-4, **kwargs)
    hot = sample_corpus.sample_continuations(draft.params, draft.config, prompts,
                                             temperature=3.0, **kwargs)
    assert np.array_equal(cold, greedy)
    assert len(np.unique(hot)) > len(np.unique(greedy))


def test_sampler_keeps_to_a_restricted_head(draft):
    """A head-subset draft gives other tokens its floor logit; sampling must not pick them
    (with 49k floor tokens at T = 2 it otherwise would, almost every time)."""
    subset = np.arange(1000, 1064)
    restricted = draft.with_head_subset(subset)
    out = sample_corpus.sample_continuations(restricted.params, restricted.config, [[2]] * 4,
                                             num_new_tokens=16, temperature=2.0, seed=0,
                                             batch_size=4)
    assert np.isin(out, subset).all()


def test_build_from_draft_gives_tables_staged_accepts(target_dir, draft, tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.py").write_text(CODE)
    out = tmp_path / "ngram.npz"
    path, meta = ngram_from_draft.build_ngram_from_draft(
        out, specjax.load(str(target_dir)), draft, 300, temperature=1.5, seed=0, batch_size=4,
        seq_len=32,
        prompt_text=[tmp_path / "text"], samples_out=tmp_path / "samples.npy",
        text=[tmp_path / "text"], top_k=4, trigram_top_k=2, trigram_buckets=256)
    assert path == out and out.is_file()
    samples = np.load(tmp_path / "samples.npy")
    assert samples.shape == (10, 32)
    stored = read_ngram_metadata(out)
    assert stored["draft_samples"]["tokens"] == 300 and stored["text_files"] == 1
    kept = int((samples >= 0).sum())
    assert stored["corpus_tokens"] == kept + len(
        draft.tokenizer(CODE, add_special_tokens=False)["input_ids"])
    target = specjax.load(target_dir)
    load_ngram(out, vocab_size=target.config.vocab_size)
    prompt = [2, 400, 401, 402]
    staged = specjax.generate(target, prompt, method="staged", draft=draft, ngram=out,
                              max_new_tokens=12)
    ar = specjax.generate(target, prompt, method="ar", max_new_tokens=12)
    assert list(staged.tokens) == list(ar.tokens)


def test_ctrl_c_while_sampling_leaves_nothing(target_dir, draft, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sample_corpus, "draft_samples", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ngram_from_draft.build_ngram_from_draft(tmp_path / "ngram.npz", specjax.load(
            str(target_dir)), draft, 10, samples_out=tmp_path / "samples.npy")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["--tokenizer", "smollm2-135m", "--samples", "10", "--tokens", "x.npy"],
     "--samples only apply with --from-draft"),
    (["--from-draft", "DRAFT", "--samples", "10"], "--from-draft needs --target"),
    (["--from-draft", "DRAFT", "--target", "TARGET"], "--from-draft needs --samples"),
    (["--from-draft", "DRAFT", "--target", "TARGET", "--tokenizer", "gpt2",
      "--samples", "5"], "drop --tokenizer"),
    (["--from-draft", "DRAFT", "--target", "TARGET", "--samples", "0"],
     "number of samples must be"),
    (["--from-draft", "DRAFT", "--target", "TARGET", "--samples", "5", "--temperature", "0"],
     "temperature must be > 0"),
    (["--from-draft", "DRAFT", "--target", "TARGET", "--samples", "5", "--seq-len", "0"],
     "seq_len must be >= 1"),
    (["--from-draft", "DRAFT", "--target", "TARGET", "--samples", "5", "--top-k", "0"],
     "top_k must be"),
    (["--from-draft", "{tmp}/absent", "--target", "TARGET", "--samples", "5"], "absent"),
    (["--text", "a.py"], "give --tokenizer"),
])
def test_cli_bad_flags_are_one_line_errors(target_dir, tmp_path, capsys, args, message):
    out = tmp_path / "out.npz"
    argv = [a.format(tmp=tmp_path).replace("TARGET", str(target_dir)) for a in args]
    code = cli.main(["build-ngram", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("specjax: error:") and err.count("\n") == 1
    assert not out.exists()


def test_cli_from_draft_writes_tables(target_dir, draft, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(specjax.loading, "resolve_draft", lambda model, spec: draft)
    out = tmp_path / "ngram.npz"
    code = cli.main(["build-ngram", str(out), "--from-draft", "tiny", "--target",
                     str(target_dir), "--samples", "64", "--seq-len", "16", "--batch-size",
                     "4", "--seed", "3", "--trigram-buckets", "256"])
    assert code == 0 and "wrote" in capsys.readouterr().err
    meta = read_ngram_metadata(out)["draft_samples"]
    assert (meta["tokens"], meta["seed"], meta["temperature"]) == (64, 3, 1.5)


def test_library_rejects_bad_settings(draft, tmp_path):
    with pytest.raises(InvalidArgumentError, match="max_prefix"):
        sample_corpus.draft_samples(draft, 8, max_prefix=-1)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        sample_corpus.sample_continuations(draft.params, draft.config, [[2]],
                                           num_new_tokens=4, temperature=-1.0)


def test_sampler_batches_pad_to_their_own_longest_prompt(draft, monkeypatch):
    """Rows run in order of prompt length and each batch pads to its own longest prompt
    (a corpus of docstring prompts has a few long ones: padding every short prompt to them
    made target generation several times slower); the output keeps the prompts' order and
    each row is still its own ``ar`` generation."""
    prompts = [[2] + list(range(300, 300 + n)) for n in (40, 2, 35, 3)]
    shapes = []
    real = sample_corpus._sample_batch

    def recording(params, config, capacity, num_new, padded, *rest):
        shapes.append((padded.shape, capacity))
        return real(params, config, capacity, num_new, padded, *rest)

    monkeypatch.setattr(sample_corpus, "_sample_batch", recording)
    out = sample_corpus.sample_continuations(draft.params, draft.config, prompts,
                                             num_new_tokens=6, temperature=1.0, seed=3,
                                             batch_size=2)
    assert shapes == [((2, 16), 128), ((2, 64), 128)]
    for i, prompt in enumerate(prompts):
        ref = specjax.generate(draft, prompt, method="ar", max_new_tokens=6, temperature=1.0,
                               seed=sample_corpus.row_seed(3, i), stop=[])
        assert out[i].tolist() == list(ref.tokens), i
