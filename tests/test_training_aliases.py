"""The old paths of the training modules (issue 42): ``specjax.checkpoints_tools.X`` for
the modules that moved to ``specjax.training.X`` still import for one release, warn with
the new path, and hand back the new module itself, so that old scripts keep working."""

import importlib
import sys

import pytest

MOVED = ("train_draft", "eagle3", "sample_corpus", "feature_draft", "ngram_build")


@pytest.mark.parametrize("name", MOVED)
def test_the_old_path_warns_and_is_the_new_module(name, monkeypatch):
    new = importlib.import_module(f"specjax.training.{name}")
    old = f"specjax.checkpoints_tools.{name}"
    # A fresh import each time: the warning comes from the alias module's first import.
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(importlib.import_module("specjax.checkpoints_tools"), name,
                        raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to specjax\.training\.{name}"):
        module = importlib.import_module(old)
    assert module is new
    assert sys.modules[old] is new
    package = sys.modules["specjax.checkpoints_tools"]
    assert getattr(package, name) is new  # `from specjax.checkpoints_tools import X`


def test_names_resolve_through_the_old_paths(monkeypatch):
    for name in MOVED:
        monkeypatch.delitem(sys.modules, f"specjax.checkpoints_tools.{name}", raising=False)
    with pytest.warns(DeprecationWarning):
        from specjax.checkpoints_tools.sample_corpus import _sample_batch, sample_continuations
        from specjax.checkpoints_tools.train_draft import TrainConfig, train_draft
    from specjax.training import sample_corpus
    from specjax.training.config import TrainConfig as NewConfig
    from specjax.training.loop import train_draft as new_train_draft

    assert TrainConfig is NewConfig and train_draft is new_train_draft
    assert sample_continuations is sample_corpus.sample_continuations
    assert _sample_batch is sample_corpus._sample_batch  # private names too
