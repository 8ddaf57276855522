"""Stage-2 drafters: n-gram tables (builder, file format, jittable lookup), context lookup
and the proposal tree, each against a brute-force Python model; the build-ngram command."""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import cli
from specjax.drafters import (ORIGIN_LOOKUP, ORIGIN_NGRAM, NgramTables, load_ngram,
                              lookup_continuation, ngram_topk, propose, read_ngram_metadata,
                              save_ngram)
from specjax.drafters.ngram import _ngram_first, trigram_slots
from specjax.errors import CheckpointError, InvalidArgumentError, ModelNotFoundError
from specjax.training.ngram_build import (build_ngram, count_ngrams, katz_discounts,
                                          load_tokenizer)

V = 10  # with top_k = 5 the builder's 2 * top_k backoff candidates cover the vocabulary,
K = 5   # so its lists must equal the exact Katz ranking
K3 = 3


def markov_corpus(seed: int, num_sequences: int = 40, vocab: int = V) -> list[list[int]]:
    """Sequences from a random sparse second-order Markov chain: skewed, repetitive counts."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(vocab, vocab, vocab)) * 2.5
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    out = []
    for _ in range(num_sequences):
        seq = list(rng.integers(0, vocab, 2))
        for _ in range(rng.integers(0, 120)):
            seq.append(int(rng.choice(vocab, p=probs[seq[-2], seq[-1]])))
        out.append([int(t) for t in seq[:rng.integers(1, len(seq) + 1)]])
    return out


# --------------------------------------------------------------------------------------
# A brute-force Katz model from Python dicts.
# --------------------------------------------------------------------------------------


class ReferenceKatz:
    def __init__(self, sequences, vocab: int):
        self.vocab = vocab
        self.uni, self.bi, self.tri = Counter(), Counter(), Counter()
        for s in sequences:
            self.uni.update(s)
            self.bi.update(zip(s, s[1:]))
            self.tri.update(zip(s, s[1:], s[2:]))
        self.total = sum(self.uni.values())
        self.d2, _ = katz_discounts(np.array(list(self.bi.values()) or [0]))
        self.d3, _ = katz_discounts(np.array(list(self.tri.values()) or [0]))
        self.ctx2, self.ctx3 = Counter(), Counter()
        for (v, _), c in self.bi.items():
            self.ctx2[v] += c
        for (u, v, _), c in self.tri.items():
            self.ctx3[u, v] += c

    def p1(self, w):
        return self.uni[w] / self.total

    @staticmethod
    def _d(table, r):
        return table[min(r, len(table) - 1)]

    def _star2(self, w, v):
        return self._d(self.d2, self.bi[v, w]) * self.bi[v, w] / self.ctx2[v]

    @functools.lru_cache(maxsize=None)
    def alpha2(self, v):
        seen = [w for w in range(self.vocab) if self.bi[v, w]]
        left = 1 - sum(self._star2(w, v) for w in seen)
        denominator = 1 - sum(self.p1(w) for w in seen)
        return max(left, 0) / denominator if denominator > 1e-12 else 0.0

    def p2(self, w, v):
        return self._star2(w, v) if self.bi[v, w] else self.alpha2(v) * self.p1(w)

    @functools.lru_cache(maxsize=None)
    def alpha3(self, u, v):
        seen = [w for w in range(self.vocab) if self.tri[u, v, w]]
        left = 1 - sum(self.p3(w, u, v) for w in seen)
        denominator = 1 - sum(self.p2(w, v) for w in seen)
        return max(left, 0) / denominator if denominator > 1e-12 else 0.0

    def p3(self, w, u, v):
        r = self.tri[u, v, w]
        if r:
            return self._d(self.d3, r) * r / self.ctx3[u, v]
        return self.alpha3(u, v) * self.p2(w, v)

    def distribution(self, u, v) -> np.ndarray:
        """The distribution ngram_topk ranks by for context (u, v), -1 meaning none."""
        if u >= 0 and v >= 0 and self.ctx3[u, v]:
            return np.array([self.p3(w, u, v) for w in range(self.vocab)])
        if v >= 0 and self.ctx2[v]:
            return np.array([self.p2(w, v) for w in range(self.vocab)])
        return np.array([self.p1(w) for w in range(self.vocab)])


def assert_ranked(tokens, scores, probs: np.ndarray, k: int, score_probs=None):
    """``tokens`` (valid prefix) is a top-k ranking of ``probs`` (ties in any order) and
    ``scores`` are their log-probabilities under ``score_probs`` (default ``probs``)."""
    tokens = [int(t) for t in tokens]
    assert len(set(tokens)) == len(tokens)
    ranked = probs[tokens]
    assert np.all(np.diff(ranked) <= 1e-12), (tokens, ranked)
    excluded = np.setdiff1d(np.flatnonzero(probs > 0), tokens)
    if len(excluded):
        assert len(tokens) == k and ranked.min() >= probs[excluded].max() - 1e-12
    scored = (probs if score_probs is None else score_probs)[tokens]
    positive = scored > 0
    # An fp32 log of an fp32 probability against numpy's fp64 one: a few units of
    # 2**-24 relative on values of size up to ~|log 1e-6| = 14.
    np.testing.assert_allclose(np.asarray(scores)[positive], np.log(scored[positive]),
                               rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def built(seed: int, min_context_count: int = 1, buckets: int = 4096):
    corpus = markov_corpus(seed)
    result = build_ngram(corpus, V, top_k=K, trigram_top_k=K3, trigram_buckets=buckets,
                         min_context_count=min_context_count)
    return corpus, result


_all_topk = jax.jit(jax.vmap(ngram_topk, in_axes=(None, 0, 0)))


def all_contexts():
    pairs = [(u, v) for u in range(-1, V) for v in range(-1, V)]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


# --------------------------------------------------------------------------------------
# Builder.
# --------------------------------------------------------------------------------------


def test_counts_match_brute_force():
    corpus = markov_corpus(0)
    counts = count_ngrams(corpus, V)
    ref = ReferenceKatz(corpus, V)
    assert counts.unigram.tolist() == [ref.uni[w] for w in range(V)]
    assert {divmod(int(k), V): int(c) for k, c in zip(counts.bigram_keys,
                                                      counts.bigram_counts)} == dict(ref.bi)
    tri = {(int(k) // V // V, int(k) // V % V, int(k) % V): int(c)
           for k, c in zip(counts.trigram_keys, counts.trigram_counts)}
    assert tri == dict(ref.tri)
    # Negative ids separate: no n-gram spans them.
    split = count_ngrams([[1, 2, -1, 3, 4]], V)
    assert split.bigram_keys.tolist() == [1 * V + 2, 3 * V + 4] and len(split.trigram_keys) == 0


def test_katz_discounts_formula_and_fallback():
    n = {1: 100, 2: 40, 3: 20, 4: 12, 5: 8, 6: 6}
    counts = np.repeat(np.arange(1, 7), [n[r] for r in range(1, 7)])
    table, method = katz_discounts(counts)
    common = 6 * n[6] / n[1]
    for r in range(1, 6):
        expected = ((r + 1) * n[r + 1] / n[r] / r - common) / (1 - common)
        assert table[r] == pytest.approx(expected)
    assert method == "katz" and table[6] == 1.0
    table, method = katz_discounts(np.array([1, 1, 1, 2]))  # n3 = 0: Good-Turing undefined
    assert method == "absolute"
    discount = np.clip(3 / (3 + 2 * 1), 0.1, 0.9)
    assert table[1] == pytest.approx(1 - discount) and table[2] == pytest.approx((2 - discount) / 2)


@pytest.mark.parametrize("seed,min_context_count", [(0, 1), (1, 2), (2, 3)])
def test_ngram_topk_is_the_katz_ranking(seed, min_context_count):
    corpus, result = built(seed, min_context_count)
    assert result.metadata["trigram_contexts_dropped"] == 0
    ref = ReferenceKatz(corpus, V)
    prev2, prev1 = all_contexts()
    tokens, scores, valid = map(np.asarray, _all_topk(result.tables, prev2, prev1))
    assert np.all(valid[:, :K])  # 10 seen tokens fill every list
    stored = {tuple(key) for key in result.tables.trigram_keys.tolist()}
    for i, (u, v) in enumerate(zip(prev2, prev1)):
        p2 = np.array([ref.p2(w, v) for w in range(V)]) if v >= 0 and ref.ctx2[v] else None
        if u >= 0 and v >= 0 and ref.ctx3[u, v] >= min_context_count:
            # Stored, or left out because its bigram list ranks the same (and answers).
            probs = np.array([ref.p3(w, u, v) for w in range(V)])
            assert_ranked(tokens[i, :K3], scores[i, :K3], probs, K3,
                          score_probs=probs if (u, v) in stored else p2)
        elif p2 is not None:
            assert_ranked(tokens[i], scores[i], p2, K)
        else:
            assert_ranked(tokens[i], scores[i], np.array([ref.p1(w) for w in range(V)]), K)
        assert len(set(tokens[i].tolist())) == K
        assert np.all(scores[i][1:] <= scores[i][:-1])


def test_pruning_keeps_only_contexts_that_change_the_ranking():
    _, result = built(0)
    meta = result.metadata
    assert meta["trigram_contexts_redundant"] > 0
    assert meta["trigram_contexts_stored"] == (meta["trigram_contexts_eligible"]
                                               - meta["trigram_contexts_redundant"])
    t = result.tables
    stored = t.trigram_keys[:, 0] >= 0
    rows = t.bigram_index[t.trigram_keys[stored, 1]]
    assert np.all(np.any(t.trigram_tokens[stored] != t.bigram_tokens[rows, :K3], axis=1))


def test_katz_discount_promotes_a_strong_backoff_token():
    # (1, 2) was followed once each by 3..7; 2 is followed by 8 everywhere else. Raw
    # trigram counts would rank 3..7 first; Katz gives most of the mass to 8.
    corpus = [[1, 2, w] for w in range(3, 8)] + [[9, 2, 8]] * 40 + [[0, 4, 5, 6]] * 3
    result = build_ngram(corpus, V, top_k=5, trigram_top_k=3, trigram_buckets=64)
    tokens, _, _ = ngram_topk(result.tables, 1, 2)
    assert int(tokens[0]) == 8
    assert np.argmax(ReferenceKatz(corpus, V).distribution(1, 2)) == 8


def test_hash_collisions_are_checked_by_key():
    corpus, result = built(0, buckets=1)  # both probes hit bucket 0: one context fits
    meta = result.metadata
    assert meta["trigram_contexts_stored"] == 1 and meta["trigram_contexts_dropped"] > 0
    t = result.tables
    ref = ReferenceKatz(corpus, V)
    u0, v0 = (int(x) for x in t.trigram_keys[0])
    prev2, prev1 = all_contexts()
    tokens, _, _ = map(np.asarray, _all_topk(t, prev2, prev1))
    for i, (u, v) in enumerate(zip(prev2, prev1)):
        if (u, v) == (u0, v0):
            assert tokens[i, :K3].tolist() == t.trigram_tokens[0].tolist()
        elif v >= 0 and ref.ctx2[v]:  # any other context: its bigram list, never bucket 0's
            assert tokens[i].tolist() == t.bigram_tokens[t.bigram_index[v]].tolist()


def test_trigram_slots_numpy_equals_jax():
    rng = np.random.default_rng(0)
    prev2, prev1 = rng.integers(0, 49152, (2, 1000))
    for buckets in (1, 2, 1 << 18):
        ours = trigram_slots(prev2, prev1, buckets, xp=np)
        theirs = np.asarray(jax.jit(trigram_slots, static_argnums=2)(prev2, prev1, buckets))
        assert np.array_equal(ours, theirs) and ours.min() >= 0 and ours.max() < buckets
    assert len(np.unique(trigram_slots(prev2, prev1, 1 << 18, xp=np)[:, 0])) > 990


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=0), "top_k must be an integer >= 1"),
    (dict(trigram_top_k=6, top_k=5), "must not exceed top_k"),
    (dict(trigram_buckets=100), "power of two"),
    (dict(min_context_count=0), "min_context_count"),
])
def test_builder_rejects_bad_settings(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        build_ngram([[1, 2, 3]], V, **kwargs)


def test_builder_rejects_bad_corpora():
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        build_ngram([[], []], V)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        build_ngram([[1, 2], [3, V]], V)
    # One token: no bigram or trigram at all, still a usable table (unigram only).
    t = build_ngram([[4]], V, top_k=3, trigram_top_k=2, trigram_buckets=4).tables
    tokens, _, valid = ngram_topk(t, 1, 2)
    assert np.asarray(valid).tolist() == [True, False, False] and int(tokens[0]) == 4


def test_ngram_topk_jit_vmap_equals_eager():
    _, result = built(1, 2)
    tables = jax.tree.map(jnp.asarray, result.tables)
    prev2, prev1 = all_contexts()
    batched = _all_topk(tables, prev2, prev1)
    for i in range(0, len(prev2), 17):
        eager = ngram_topk(tables, int(prev2[i]), int(prev1[i]))
        for got, want in zip(batched, eager):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))


# --------------------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    _, result = built(0)
    path = save_ngram(tmp_path / "t.npz", result.tables, {**result.metadata, "note": "x"})
    loaded = load_ngram(path, vocab_size=V)
    for name in NgramTables._fields:
        want = getattr(result.tables, name)
        got = getattr(loaded, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.dtype.kind == "f":  # float16 on disk
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(got, want)
    meta = read_ngram_metadata(path)
    assert meta["note"] == "x" and meta["vocab_size"] == V and meta["top_k"] == K
    assert not list(tmp_path.glob(".*partial*"))


def test_a_tables_file_is_read_once_per_version(tmp_path, monkeypatch):
    """resolve_ngram reads a file once (the shipped tables took 0.06 s per generate call)
    and again when the file changes."""
    from types import SimpleNamespace

    from specjax import loading
    from specjax.drafters import ngram as ngram_lib

    reads = []
    read = ngram_lib.load_ngram
    monkeypatch.setattr(ngram_lib, "load_ngram",
                        lambda *args, **kwargs: reads.append(args) or read(*args, **kwargs))
    _, result = built(0)
    path = save_ngram(tmp_path / "t.npz", result.tables, result.metadata)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=V), assets=None, name="m")
    first = loading.resolve_ngram(model, path)
    assert loading.resolve_ngram(model, str(path)) is first and len(reads) == 1
    np.testing.assert_array_equal(first.bigram_index, result.tables.bigram_index)
    _, other = built(1)
    save_ngram(path, other.tables, other.metadata)
    second = loading.resolve_ngram(model, path)
    assert second is not first and len(reads) == 2
    np.testing.assert_array_equal(second.bigram_index, other.tables.bigram_index)


def _one_line_checkpoint_error(path, **kwargs):
    with pytest.raises(CheckpointError) as info:
        load_ngram(path, **kwargs)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    return str(info.value)


def test_corrupt_and_mismatched_files(tmp_path):
    _, result = built(0)
    good = save_ngram(tmp_path / "good.npz", result.tables, {})
    data = good.read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[:len(data) // 2])
    _one_line_checkpoint_error(tmp_path / "truncated.npz")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file at all")
    _one_line_checkpoint_error(tmp_path / "garbage.npz")
    assert "vocabulary of 10" in _one_line_checkpoint_error(good, vocab_size=49152)
    arrays = dict(np.load(good))
    np.savez(tmp_path / "missing.npz", **{k: v for k, v in arrays.items() if k != "bigram_index"})
    assert "bigram_index" in _one_line_checkpoint_error(tmp_path / "missing.npz")
    np.savez(tmp_path / "shape.npz",
             **{**arrays, "trigram_tokens": arrays["trigram_tokens"][:, :2]})
    assert "trigram_tokens" in _one_line_checkpoint_error(tmp_path / "shape.npz")
    np.savez(tmp_path / "other.npz", **{**arrays, "metadata": np.frombuffer(b'{"format": "x"}',
                                                                            np.uint8)})
    _one_line_checkpoint_error(tmp_path / "other.npz")
    with pytest.raises(ModelNotFoundError):
        load_ngram(tmp_path / "absent.npz")


# --------------------------------------------------------------------------------------
# Context lookup.
# --------------------------------------------------------------------------------------


def lookup_reference(history, length, num_tokens, min_n, max_n):
    h = list(history[:length])
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        for end in range(length - 2, n - 2, -1):
            if h[end - n + 1:end + 1] == h[length - n:]:
                cont = h[end + 1:end + 1 + num_tokens]
                return cont + [0] * (num_tokens - len(cont)), [True] * len(cont) + \
                    [False] * (num_tokens - len(cont)), n
    return [0] * num_tokens, [False] * num_tokens, 0


_lookup = jax.jit(lookup_continuation, static_argnames=("num_tokens", "min_n", "max_n"))
SIZE = 14


@settings(max_examples=150, deadline=None)
@given(history=st.lists(st.integers(0, 2), min_size=SIZE, max_size=SIZE),
       length=st.integers(0, SIZE), ns=st.sampled_from([(1, 3), (2, 2), (1, 1), (2, 4)]))
def test_lookup_matches_brute_force(history, length, ns):
    got = _lookup(np.asarray(history, np.int32), length, num_tokens=4, min_n=ns[0],
                  max_n=ns[1])
    tokens, valid, n = lookup_reference(history, length, 4, *ns)
    assert np.asarray(got.tokens).tolist() == tokens
    assert np.asarray(got.valid).tolist() == valid
    assert int(got.match_length) == n


def test_lookup_prefers_longer_then_more_recent():
    history = np.array([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3, 0, 0], np.int32)
    got = lookup_continuation(history, 11, 3)
    # "1 2 3" occurred at 1..3 (followed by 9); "2 3" more recently at 5..6 (followed by 7).
    assert int(got.match_length) == 3 and np.asarray(got.tokens).tolist() == [9, 2, 3]
    got = lookup_continuation(history, 11, 3, max_n=2)
    assert int(got.match_length) == 2 and np.asarray(got.tokens).tolist() == [7, 1, 2]
    batched = jax.vmap(lambda n: lookup_continuation(history, n, 3))(jnp.arange(4, 12))
    assert batched.tokens.shape == (8, 3)


# --------------------------------------------------------------------------------------
# Proposal trees.
# --------------------------------------------------------------------------------------


def propose_reference(topk, history, length, shape, use_lookup):
    """Level by level in Python; ``topk[(prev2, prev1)]`` is ngram_topk's valid list."""
    cont, cont_valid, _ = lookup_reference(list(history), length, len(shape), 1, 3)
    path = [int(t) for t in history[:length]]
    tokens, valid, origin = [], [], []
    alive = True
    for level, width in enumerate(shape):
        context = (path[-2] if len(path) >= 2 else -1, path[-1] if path else -1)
        candidates = [(cont[level], ORIGIN_LOOKUP)] if use_lookup and cont_valid[level] else []
        candidates += [(t, ORIGIN_NGRAM) for t in topk[context]
                       if t not in [c[0] for c in candidates]]
        chosen = candidates[:width] if alive else []
        tokens += [c[0] for c in chosen] + [0] * (width - len(chosen))
        origin += [c[1] for c in chosen] + [ORIGIN_NGRAM] * (width - len(chosen))
        valid += [True] * len(chosen) + [False] * (width - len(chosen))
        alive = bool(chosen)
        if alive:
            path.append(chosen[0][0])
    return tokens, valid, origin


@pytest.fixture(scope="module")
def small_tables():
    _, result = built(2, 2)
    tables = jax.tree.map(jnp.asarray, result.tables)
    prev2, prev1 = all_contexts()
    tokens, _, valid = map(np.asarray, _all_topk(tables, prev2, prev1))
    topk = {(int(u), int(v)): [int(t) for t, ok in zip(tokens[i], valid[i]) if ok]
            for i, (u, v) in enumerate(zip(prev2, prev1))}
    return tables, topk


_propose = jax.jit(propose, static_argnames=("shape", "use_lookup"))


def unrolled_spine(function):
    """``function`` with :func:`propose`'s spine traced level by level, as where the kernels
    are compiled (a GPU or TPU), rather than as the CPU's one loop body."""
    from unittest import mock

    from specjax.drafters import ngram

    def traced(*args, **kwargs):
        with mock.patch.object(ngram.kernels, "select_variant",
                               lambda *_, **__: ("gpu", False)):
            return function(*args, **kwargs)
    return traced


_propose_unrolled = jax.jit(unrolled_spine(propose), static_argnames=("shape", "use_lookup"))
SPINES = {"loop": _propose, "unrolled": _propose_unrolled}


def check_tree_invariants(proposal, shape):
    parents = np.asarray(proposal.parents)
    valid = np.asarray(proposal.valid)
    tokens = np.asarray(proposal.tokens)
    assert len(parents) == sum(shape) and proposal.origin.dtype == jnp.int8
    offsets = np.cumsum((0,) + shape)
    for level, (begin, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        expected_parent = -1 if level == 0 else offsets[level - 1]
        assert np.all(parents[begin:end] == expected_parent)
        level_valid = valid[begin:end]
        assert np.all(np.diff(level_valid.astype(int)) <= 0)  # valid nodes come first
        siblings = tokens[begin:end][level_valid]
        assert len(set(siblings.tolist())) == len(siblings)
    assert np.all(parents < np.arange(len(parents)))
    assert np.all(~valid | (parents < 0) | valid[np.maximum(parents, 0)])  # prefix-closed
    assert np.all(tokens[~valid] == 0)


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.integers(0, V - 1), min_size=16, max_size=16),
       length=st.integers(0, 16), use_lookup=st.booleans())
def test_propose_matches_reference(small_tables, history, length, use_lookup):
    tables, topk = small_tables
    shape = (6, 3, 2, 1)
    got = _propose(tables, np.asarray(history, np.int32), length, shape=shape,
                   use_lookup=use_lookup)
    check_tree_invariants(got, shape)
    tokens, valid, origin = propose_reference(topk, history, length, shape, use_lookup)
    assert np.asarray(got.tokens).tolist() == tokens
    assert np.asarray(got.valid).tolist() == valid
    assert np.asarray(got.origin).tolist() == origin


def scrambled_tables(seed: int, buckets: int = 8, rows: int = 6) -> NgramTables:
    """Tables no builder writes: holes (-1) anywhere in the lists, repeats across orders,
    contexts stored at either probe (the other holding another context), tokens without a
    bigram row. The lookups must follow their rules on any arrays of the right shapes."""
    rng = np.random.default_rng(seed)

    def lists(shape):
        return np.where(rng.random(shape) < 0.35, -1, rng.integers(0, V, shape)).astype(np.int32)

    keys = np.full((buckets, 2), -1, np.int32)
    for u, v in rng.integers(0, V, (buckets, 2)):
        probes = trigram_slots(np.array([u]), np.array([v]), buckets, xp=np)[0]
        slot = probes[rng.integers(0, len(probes))]  # at the first or the second probe
        keys[slot] = (u, v)
    scores = lambda shape: -rng.random(shape).astype(np.float32)  # noqa: E731
    return NgramTables(
        unigram_tokens=jnp.asarray(lists(K)), unigram_scores=jnp.asarray(scores(K)),
        bigram_index=jnp.asarray(rng.integers(-1, rows, V).astype(np.int32)),
        bigram_tokens=jnp.asarray(lists((rows, K))), bigram_scores=jnp.asarray(scores((rows, K))),
        bigram_log_alpha=jnp.asarray(scores(rows)),
        trigram_keys=jnp.asarray(keys), trigram_tokens=jnp.asarray(lists((buckets, K3))),
        trigram_scores=jnp.asarray(scores((buckets, K3))),
        trigram_log_alpha=jnp.asarray(scores(buckets)))


def valid_lists(tables):
    prev2, prev1 = all_contexts()
    tokens, _, valid = map(np.asarray, _all_topk(tables, prev2, prev1))
    return {(int(u), int(v)): [int(t) for t, ok in zip(tokens[i], valid[i]) if ok]
            for i, (u, v) in enumerate(zip(prev2, prev1))}


@pytest.mark.parametrize("seed", range(4))
def test_ngram_first_is_the_first_entry_of_ngram_topk(seed):
    # propose's spine takes each level's first n-gram entry by selects, not from the list.
    tables = scrambled_tables(seed)
    topk = valid_lists(tables)
    prev2, prev1 = all_contexts()
    first, found = map(np.asarray, jax.jit(jax.vmap(_ngram_first, in_axes=(None, 0, 0)))(
        tables, prev2, prev1))
    for i, (u, v) in enumerate(zip(prev2, prev1)):
        want = topk[int(u), int(v)]
        assert bool(found[i]) == bool(want) and int(first[i]) == (want[0] if want else 0)


# The spine is one loop body on the CPU and unrolled levels on a GPU or TPU: both against
# the reference here.
@pytest.mark.parametrize("spine", SPINES)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 7), history=st.lists(st.integers(0, V - 1), min_size=16,
                                                 max_size=16),
       length=st.integers(0, 16), use_lookup=st.booleans())
def test_propose_matches_reference_on_scrambled_tables(spine, seed, history, length,
                                                       use_lookup):
    tables = scrambled_tables(seed)
    shape = (4, 2, 1, 1, 1, 1, 1)
    got = SPINES[spine](tables, np.asarray(history, np.int32), length, shape=shape,
                   use_lookup=use_lookup)
    check_tree_invariants(got, shape)
    tokens, valid, origin = propose_reference(valid_lists(tables), history, length, shape,
                                              use_lookup)
    assert np.asarray(got.tokens).tolist() == tokens
    assert np.asarray(got.valid).tolist() == valid
    assert np.asarray(got.origin).tolist() == origin


def test_propose_spine_follows_the_lookup_continuation(small_tables):
    tables, _ = small_tables
    shape = (12, 7, 4, 1, 1, 1)  # the paper's shape; lists here hold at most 5 + 1
    history = np.array([3, 1, 4, 1, 5, 9, 2, 6, 8, 3, 1, 4, 0, 0, 0, 0], np.int32)
    got = _propose(tables, history, 12, shape=shape, use_lookup=True)
    check_tree_invariants(got, shape)
    spine = np.cumsum((0,) + shape)[:-1]
    # "3 1 4" recurs; its continuation 1 5 9 2 6 8 is the spine, each rank 0 from lookup.
    assert np.asarray(got.tokens)[spine].tolist() == [1, 5, 9, 2, 6, 8]
    assert np.all(np.asarray(got.origin)[spine] == ORIGIN_LOOKUP)
    assert np.all(np.asarray(got.origin)[np.setdiff1d(np.arange(sum(shape)), spine)]
                  == ORIGIN_NGRAM)
    # The continuation runs out at `length`: later levels are n-gram only.
    got = _propose(tables, np.array([7, 2, 7, 2] + [0] * 12, np.int32), 4, shape=shape,
                   use_lookup=True)
    check_tree_invariants(got, shape)
    assert np.asarray(got.origin)[spine].tolist() == [1, 1, 0, 0, 0, 0]
    assert np.asarray(got.tokens)[spine][:2].tolist() == [7, 2]


def test_propose_rejects_bad_shape(small_tables):
    with pytest.raises(InvalidArgumentError, match="proposal shape"):
        propose(small_tables[0], np.zeros(4, np.int32), 2, (3, 0))


# --------------------------------------------------------------------------------------
# specjax build-ngram (real SmolLM2 tokenizer from the embedded GGUF).
# --------------------------------------------------------------------------------------

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 3


def run_cli(capsys, *argv):
    code = cli.main(["build-ngram", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.err


def test_cli_build_ngram_text_and_tokens(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(CODE)
    (tmp_path / "src" / "skip.txt").write_text("not python")
    samples = np.array([[1604, 803, 24, -1], [1604, 803, 24, 81]])
    np.save(tmp_path / "samples.npy", samples)
    out = tmp_path / "tables" / "ngram.npz"
    code, err = run_cli(capsys, out, "--tokenizer", "smollm2-135m", "--text", tmp_path / "src",
                        "--pattern", "*.py", "--tokens", tmp_path / "samples.npy",
                        "--top-k", "4", "--trigram-top-k", "2", "--trigram-buckets", "256")
    assert code == 0 and "wrote" in err
    tokenizer, vocab = load_tokenizer("smollm2-135m")
    ids = tokenizer(CODE, add_special_tokens=False)["input_ids"]
    meta = read_ngram_metadata(out)
    assert meta["corpus_tokens"] == len(ids) + 7 and meta["corpus_sequences"] == 3
    assert meta["text_files"] == 1 and meta["vocab_size"] == vocab == 49152
    tables = load_ngram(out, vocab_size=vocab)
    # After "return a" come " +" and " -", three times each: the best two.
    [plus] = tokenizer(" +", add_special_tokens=False)["input_ids"]
    [minus] = tokenizer(" -", add_special_tokens=False)["input_ids"]
    at = ids.index(plus)
    tokens, _, _ = ngram_topk(tables, ids[at - 2], ids[at - 1])
    assert set(np.asarray(tokens).tolist()[:2]) == {plus, minus}
    code, err = run_cli(capsys, out, "--tokenizer", "smollm2-135m", "--tokens",
                        tmp_path / "samples.npy")
    assert code == 2 and "already exists" in err


@pytest.mark.parametrize("args,message", [
    (["--text", "{tmp}/absent.py"], "absent.py: no such file"),
    (["--text", "{tmp}/empty.py"], "no tokens"),
    (["--tokens", "{tmp}/bad.npy"], "integer array"),
    (["--text", "{tmp}/empty.py", "--top-k", "0"], "top_k must be"),
    ([], "no corpus"),
])
def test_cli_build_ngram_errors_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "empty.py").write_text("")
    np.save(tmp_path / "bad.npy", np.ones(3, np.float32))
    out = tmp_path / "out.npz"
    code, err = run_cli(capsys, out, "--tokenizer", "smollm2-135m",
                        *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and message in err
    assert err.startswith("specjax: error:") and err.count("\n") == 1
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))
