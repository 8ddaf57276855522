"""Batched generation: a list of prompts decodes as one program whose rows are independent.

The invariant: each row's tokens equal its own batch-1 output (same settings, same seed),
for every method, greedy and coupled sampling, whatever the other rows do (different
prompt lengths, early stops, padding rows). Plus: the compiled program is shared by
every batch of one bucket, the stochastic rules keep the target distribution with many
rows, and bad input is a one-line error.
"""

import jax
import numpy as np
import pytest

import specjax
from specjax import decode
from specjax.errors import InvalidArgumentError
from specjax.state import MAX_BATCH_SIZE, batch_bucket

from conftest import TINY_VOCAB, fitted_tables, random_prompt

# Mixed lengths; the 19-token prompt pads to a 32-token bucket, the others to 16.
PROMPTS = [random_prompt(40 + i, n) for i, n in enumerate([5, 19, 3, 11, 8])]
NEW = 14
SAMPLINGS = {"greedy": dict(), "coupled": dict(temperature=1.0, top_k=20)}
SEEDS = [3, 17, 5, 2, 9]


@pytest.fixture(scope="module")
def tables(spec_target):
    return fitted_tables(spec_target, range(200, 206), 32)


def _method(name, spec_drafts, tables):
    weak = spec_drafts["weak"]
    return {"ar": dict(method="ar"),
            "spec": dict(method="spec", draft=weak, draft_depth=3),
            "tree": dict(method="tree", draft=weak, tree_budget=6, draft_width=2),
            "ngram": dict(method="ngram", ngram=tables),
            "staged": dict(method="staged", draft=weak, ngram=tables, tree_budget=6)}[name]


def _singles(target, prompts, seeds, **kwargs):
    return [specjax.generate(target, p, seed=s, **kwargs) for p, s in zip(prompts, seeds)]


# One batch program per speculative method (5 rows: bucket 8, three padding rows); ar,
# cheap to compile, at several sizes.
# spec, tree, ngram and staged are in the slow tier: CI time. (In the fast tier,
# test_stream_generate_yields_per_row_tokens batches ngram, and
# test_staged_rejection_samples_the_target_distribution_with_many_rows and
# test_rows_stop_on_their_own_stop_tokens batch staged.)
@pytest.mark.parametrize("method, sizes", [
    ("ar", (1, 2, 3, 5)),
    *(pytest.param(m, (5,), marks=pytest.mark.slow) for m in ("spec", "tree", "ngram")),
    pytest.param("staged", (5,), marks=pytest.mark.slow)])  # 25 s
def test_each_row_equals_its_batch_1_output(spec_target, spec_drafts, tables, method, sizes):
    # Live-row compaction (its extra programs) for the method that uses every piece;
    # test_live_rows_move_to_smaller_programs covers ar.
    kwargs = dict(_method(method, spec_drafts, tables), max_new_tokens=NEW, stop=[],
                  batch=specjax.BatchOptions(compact_rows=method == "staged"))
    for name, sampling in SAMPLINGS.items():
        singles = _singles(spec_target, PROMPTS, SEEDS, **kwargs, **sampling)
        for size in sizes:
            outs = specjax.generate(spec_target, PROMPTS[:size], seed=SEEDS[:size], **kwargs,
                                    **sampling)
            assert [o.tokens for o in outs] == [s.tokens for s in singles[:size]], \
                (method, name, size)
            for row, (out, single) in enumerate(zip(outs, singles)):
                assert out.stats["batch"]["row"] == row
                assert out.stats["batch"]["compiled_rows"] == batch_bucket(size)
                # Ragged acceptance: each row keeps its own step count and histogram.
                assert out.stats["target_calls"] == single.stats["target_calls"]
                assert out.stats.get("accepted_histogram") == \
                    single.stats.get("accepted_histogram")
                assert out.origins == single.origins


@pytest.mark.slow
@pytest.mark.parametrize("method, verify_rule", [("tree", "rejection"), ("spec", "match")])
def test_stochastic_rules_equal_batch_1_with_per_row_seeds(spec_target, spec_drafts, tables,
                                                           method, verify_rule):
    kwargs = dict(_method(method, spec_drafts, tables), max_new_tokens=NEW, stop=[],
                  temperature=1.0, verify=verify_rule)
    singles = _singles(spec_target, PROMPTS, SEEDS, **kwargs)
    outs = specjax.generate(spec_target, PROMPTS, seed=SEEDS, **kwargs)
    assert [o.tokens for o in outs] == [s.tokens for s in singles]


def test_an_int_seed_is_every_row_s_seed(spec_target):
    kwargs = dict(max_new_tokens=NEW, temperature=1.0, stop=[], seed=11)
    outs = specjax.generate(spec_target, [PROMPTS[0], PROMPTS[0], PROMPTS[2]], **kwargs)
    assert outs[0].tokens == outs[1].tokens
    assert outs[2].tokens == specjax.generate(spec_target, PROMPTS[2], **kwargs).tokens


# ar in the quick tier; staged (42 s of compiling) in the slow one.
@pytest.mark.parametrize("method", ["ar", pytest.param("staged", marks=pytest.mark.slow)])
def test_rows_stop_on_their_own_stop_tokens(spec_target, spec_drafts, tables, method):
    kwargs = dict(_method(method, spec_drafts, tables), max_new_tokens=NEW)
    free = _singles(spec_target, PROMPTS, [0] * 5, stop=[], **kwargs)
    # Row 0 stops at its third token; the others when they meet it, or never.
    stop = [free[0].tokens[2]]
    singles = _singles(spec_target, PROMPTS, [0] * 5, stop=stop, **kwargs)
    outs = specjax.generate(spec_target, PROMPTS, stop=stop, **kwargs)
    assert [o.tokens for o in outs] == [s.tokens for s in singles]
    assert len(outs[0].tokens) <= 3 and outs[0].tokens[-1] == stop[0]
    assert max(len(o.tokens) for o in outs) > len(outs[0].tokens)  # the others went on


def test_batch_size_splits_a_long_list_into_programs(spec_target):
    kwargs = dict(max_new_tokens=6, stop=[])
    whole = specjax.generate(spec_target, PROMPTS, **kwargs)
    split = specjax.generate(spec_target, PROMPTS, **kwargs, batch=specjax.BatchOptions(
        size=2, compact_rows=False))
    assert [o.tokens for o in split] == [o.tokens for o in whole]
    assert [o.stats["batch"]["rows"] for o in split] == [2, 2, 2, 2, 1]
    assert [o.stats["batch"]["row"] for o in split] == list(range(5))


def test_one_compiled_program_per_batch_bucket(spec_target):
    """Batches of 3 and 4 rows (bucket 4), other prompts of the same prompt bucket, other
    seeds and budgets of the same capacity: no new compilation."""
    kwargs = dict(max_new_tokens=NEW, temperature=1.0, stop=[])
    specjax.generate(spec_target, PROMPTS[2:5], seed=[1, 2, 3], **kwargs)
    before = len(decode._EXECUTABLES)
    others = [random_prompt(90 + i, n) for i, n in enumerate([4, 12, 7, 9])]
    for rows, seeds in ((others, [4, 5, 6, 7]), (others[:3], 8)):
        outs = specjax.generate(spec_target, rows, seed=seeds, **dict(kwargs, max_new_tokens=9))
        assert all(o.stats["compile_seconds"] == 0.0 for o in outs)
    assert len(decode._EXECUTABLES) == before


def test_stream_generate_yields_per_row_tokens(spec_target, spec_drafts, tables):
    kwargs = dict(_method("ngram", spec_drafts, tables), max_new_tokens=NEW, stop=[],
                  # one program: compaction has its own test
                  batch=specjax.BatchOptions(compact_rows=False))
    expected = specjax.generate(spec_target, PROMPTS, **kwargs)
    rows, origins = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    *steps, (last_tokens, last_origins, stats) = specjax.stream_generate(
        spec_target, PROMPTS, origins=True, **kwargs)
    for new, names, nothing in steps:
        assert len(new) == len(names) == len(PROMPTS) and nothing is None
        for row in range(len(PROMPTS)):
            rows[row] += new[row]
            origins[row] += names[row]
    assert last_tokens == last_origins == []
    assert rows == [o.tokens for o in expected]
    assert origins == [o.origins for o in expected]
    assert [s["new_tokens"] for s in stats] == [len(o.tokens) for o in expected]


@pytest.mark.slow  # interpret mode
def test_the_pallas_kernel_batches_under_vmap(spec_target):
    """Attention ``"kernel"`` (interpret mode on CPU) gives each row its batch-1 tokens."""
    kwargs = dict(max_new_tokens=4, stop=[])
    outs = specjax.generate(spec_target, PROMPTS[:2],
                            kernels=specjax.KernelOptions(attention="kernel"), **kwargs)
    assert [o.tokens for o in outs] == [
        specjax.generate(spec_target, p, kernels=specjax.KernelOptions(attention="reference"),
                         **kwargs).tokens
        for p in PROMPTS[:2]]


@pytest.mark.parametrize("prompts, kwargs, fragment", [
    ([], {}, "the list of prompts is empty"),
    ([[1, 2], []], {}, r"prompts\[1\]: prompt is empty"),
    ([[1, 2]] * (MAX_BATCH_SIZE + 1), {}, "exceed the maximum batch size 64"),
    ([[1, 2]] * 3, dict(batch=lambda: specjax.BatchOptions(size=MAX_BATCH_SIZE + 1)),
     "BatchOptions.size must be"),
    ([[1, 2]] * 3, dict(batch=lambda: specjax.BatchOptions(size=0)), "BatchOptions.size must be"),
    ([[1, 2]] * 3, dict(seed=[1, 2]), "got 2 seeds for 3 prompts"),
    ([[1, 2]] * 2, dict(seed=[1, -1]), "seed must be an integer"),
    ([1, 2], dict(batch=lambda: specjax.BatchOptions(size=2)),
     "applies to a list of prompts only"),
    ([[1, 2], [1, TINY_VOCAB]], {}, r"prompts\[1\]: prompt token id"),
])
def test_bad_batches_are_one_line_errors(spec_target, prompts, kwargs, fragment):
    def built():  # a bad BatchOptions refuses itself when made: inside pytest.raises
        return {name: value() if callable(value) else value for name, value in kwargs.items()}

    for call in (lambda: specjax.generate(spec_target, prompts, max_new_tokens=2, **built()),
                 lambda: next(specjax.stream_generate(spec_target, prompts, max_new_tokens=2,
                                                      **built()))):
        with pytest.raises(InvalidArgumentError, match=fragment) as error:
            call()
        assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------- distribution


@pytest.mark.slow  # 22 s; test_staged_distribution.py checks one row in the quick tier
def test_staged_rejection_samples_the_target_distribution_with_many_rows(spec_target,
                                                                         tables):
    """The second new token of many rows (one seed each, 64 rows per program) follows the
    exact marginal of the target (test_staged_distribution's check, batched)."""
    import test_staged_distribution as dist

    marginal = dist._second_token_marginal(spec_target)
    seeds = list(range(dist.SEEDS))
    tokens = []
    for first in range(0, len(seeds), MAX_BATCH_SIZE):
        chunk = seeds[first: first + MAX_BATCH_SIZE]
        outs = specjax.generate(spec_target, [dist.PROMPT] * len(chunk), seed=chunk,
                                max_new_tokens=2, stop=[], ngram=tables,
                                draft=spec_target, verify="rejection",
                                batch=specjax.BatchOptions(compact_rows=False),
                                **dist.SAMPLING, **dist.STAGED)
        tokens += [o.tokens[1] for o in outs]
    statistic, dof = dist._pooled_chi2(np.bincount(tokens, minlength=TINY_VOCAB), marginal)
    assert statistic < dist.chi2_threshold(dof), (statistic, dof)


# ----------------------------------------------------------------------------- real model

# 18, 27 and 25 tokens: rows of different lengths in one 32-token prompt bucket, so that
# each row's batch-1 runs share one program (a 15-token prompt had a 16-token bucket: one
# more real-model program per method to compile).
HUMANEVAL = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "from typing import List\n\n\ndef has_close_elements(numbers: List[float], "
             "threshold: float) -> bool:\n",
             "def is_palindrome(text: str) -> bool:\n"
             "    \"\"\"Whether the text reads the same backwards.\"\"\"\n"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "staged"])
def test_smollm2_rows_equal_batch_1(smollm2, method):
    """The real model's rows in one batch program equal their batch-1 calls. Compaction off:
    moving live rows to smaller programs compiles two more real-model programs per method
    (~100 s of CPU for staged), and its exactness is the tiny models'
    (test_live_rows_move_to_smaller_programs)."""
    for sampling in (dict(), dict(temperature=1.0, seed=[7, 8, 9])):
        seeds = sampling.get("seed", [0, 0, 0])
        outs = specjax.generate(smollm2, HUMANEVAL, method=method, max_new_tokens=24,
                                batch=specjax.BatchOptions(compact_rows=False), **sampling)
        for prompt, seed, out in zip(HUMANEVAL, seeds, outs):
            single = specjax.generate(smollm2, prompt, method=method, max_new_tokens=24,
                                      **dict(sampling, seed=seed))
            assert out.tokens == single.tokens, (method, sampling)
            assert out.text == single.text
    jax.clear_caches()


@pytest.mark.parametrize("driver", ["generate", "stream"])
def test_live_rows_move_to_smaller_programs(spec_target, monkeypatch, driver):
    """Once at most half the rows are live they are gathered into the next smaller bucket
    (5 rows in a bucket of 8: three padding rows are done at prefill; row 0 stops at its
    third token, leaving 4 live), and every row still gets its batch-1 tokens."""
    kwargs = dict(max_new_tokens=NEW)
    free = _singles(spec_target, PROMPTS, [0] * 5, stop=[], **kwargs)
    stop = [free[0].tokens[2]]
    singles = _singles(spec_target, PROMPTS, [0] * 5, stop=stop, **kwargs)
    sizes = []
    take = decode._take_rows
    monkeypatch.setattr(decode, "_take_rows",
                        lambda state, rows: sizes.append(len(rows)) or take(state, rows))
    off = specjax.generate(spec_target, PROMPTS, stop=stop,
                           batch=specjax.BatchOptions(compact_rows=False), **kwargs)
    assert [o.tokens for o in off] == [s.tokens for s in singles] and not sizes
    if driver == "generate":
        tokens = [o.tokens for o in specjax.generate(spec_target, PROMPTS, stop=stop,
                                                     **kwargs)]
    else:
        tokens = [[] for _ in PROMPTS]
        for new, _ in specjax.stream_generate(spec_target, PROMPTS, stop=stop,
                                              **kwargs):
            for row, ids in enumerate(new):
                tokens[row] += ids
    assert tokens == [s.tokens for s in singles]
    assert sizes and sizes[0] <= 4


def test_compact_rows_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="compact_rows") as info:
        specjax.BatchOptions(compact_rows="yes")
    assert "\n" not in str(info.value)
