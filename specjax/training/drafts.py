"""The draft a training run starts from: the target's blocks (:func:`draft_from_target`),
a trained draft asset, a feature or EAGLE-3 draft, grown by zeroed copies of target blocks
(:func:`grow_draft`); which of its parameters train (:func:`split_trainable`); and an
EAGLE-3 draft's vocabulary (:func:`draft_vocabulary`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from specjax import models
from specjax.checkpoints_tools.assets import DRAFT_CONFIG, DRAFT_TENSORS, DRAFT_VOCAB
from specjax.checkpoints_tools.hf import one_line, read_json_object
from specjax.checkpoints_tools.sources import frequent_tokens, load_bundled_draft
from specjax.errors import CheckpointError, InvalidArgumentError
from specjax.training.config import TrainConfig
from specjax.training.eagle3 import default_feature_layers, eagle3_draft_from_target
from specjax.training.feature_draft import feature_draft_from_draft, feature_draft_from_target


def draft_from_target(target_config, target_params, init_layers: Sequence[int]):
    """(config, params) of a draft made of the target blocks ``init_layers``."""
    import jax

    num = target_config.num_layers
    if any(not 0 <= i < num for i in init_layers):
        raise InvalidArgumentError(f"init_layers {tuple(init_layers)} out of range for a "
                                   f"{num}-layer target")
    index = np.asarray(init_layers)
    layers = jax.tree.map(lambda a: np.asarray(a)[index], target_params["layers"])
    params = {**{k: np.asarray(v) for k, v in target_params.items() if k != "layers"},
              "layers": layers}
    config = dataclasses.replace(target_config, num_layers=len(init_layers))
    return config, params


def initial_draft(target, cfg: "TrainConfig", draft_vocab=None):
    """(config, params) the run starts from: the target's blocks ``cfg.init_layers``, or
    the draft asset ``cfg.init_draft`` (its own tensors, full head); then grown by the
    target blocks ``cfg.add_layers`` (:func:`grow_draft`). An EAGLE-3 draft
    (``cfg.eagle3``) scores the ids ``draft_vocab`` (:func:`draft_vocabulary`)."""
    if cfg.eagle3 and cfg.init_draft is not None:
        return eagle3_from_asset(target, cfg)
    if cfg.eagle3:
        return eagle3_draft_from_target(target.config, target.params, draft_vocab,
                                        cfg.feature_layers, cfg.init_layers)
    if cfg.init_draft is None and cfg.feature_draft:
        config, params = feature_draft_from_target(target.config, target.params,
                                                   cfg.init_layers)
    elif cfg.init_draft is None:
        config, params = draft_from_target(target.config, target.params, cfg.init_layers)
    else:
        import jax

        draft = load_bundled_draft(target, cfg.init_draft)
        # Training scores the full vocabulary: the asset's head subset is a decoding speed-up.
        params = {k: v for k, v in draft.params.items() if k != models.HEAD_SUBSET}
        config, params = draft.config, jax.tree.map(np.asarray, params)
        if config.feature_input and not cfg.feature_draft:
            raise InvalidArgumentError(
                f"--init-draft {cfg.init_draft} is a feature draft: pass --feature-draft too")
        if cfg.feature_draft:  # a standalone draft becomes a feature draft computing it
            config, params = feature_draft_from_draft(config, params)
    if cfg.add_layers:
        config, params = grow_draft(config, params, target.config, target.params,
                                    cfg.add_layers)
    return config, params


def eagle3_asset_record(directory) -> dict:
    """The ``draft.json`` of the EAGLE-3 draft asset ``directory`` (``--eagle3
    --init-draft``): its ``feature_layers`` and ``draft_vocab_size`` are the run's."""
    record = read_json_object(Path(directory) / DRAFT_CONFIG)
    if not (record.get("feature_input") and record.get("draft_vocab_size")):
        raise InvalidArgumentError(
            f"--init-draft {directory} is not an EAGLE-3 draft (its draft.json has no "
            "feature_input and draft_vocab_size): with --eagle3 pass an asset of an "
            "earlier --eagle3 run, or drop --eagle3")
    return record


def eagle3_from_asset(target, cfg: "TrainConfig"):
    """(config, params) of the EAGLE-3 draft asset ``cfg.init_draft``, to train further:
    the same blocks, fusion, head and id map. The run's feature layers and vocabulary size
    must be the asset's (a draft reads the blocks it was trained on)."""
    import jax

    record = eagle3_asset_record(cfg.init_draft)
    layers = (cfg.feature_layers if cfg.feature_layers is not None
              else default_feature_layers(target.config.num_layers))
    if tuple(record.get("feature_layers") or ()) != tuple(layers):
        raise InvalidArgumentError(
            f"--init-draft {cfg.init_draft} reads target blocks "
            f"{tuple(record.get('feature_layers') or ())}, not the run's --feature-layers "
            f"{tuple(layers)}")
    if int(record["draft_vocab_size"]) != cfg.draft_vocab:
        raise InvalidArgumentError(
            f"--init-draft {cfg.init_draft} scores {record['draft_vocab_size']} ids, not the "
            f"run's --draft-vocab {cfg.draft_vocab}")
    draft = load_bundled_draft(target, cfg.init_draft)
    params = {k: v for k, v in draft.params.items() if k != models.HEAD_SUBSET}
    return draft.config, jax.tree.map(np.asarray, params)


def _asset_vocabulary(directory) -> np.ndarray:
    """The id map [K] of the EAGLE-3 draft asset ``directory``."""
    from safetensors import safe_open

    path = Path(directory) / DRAFT_TENSORS
    try:
        with safe_open(str(path), framework="numpy") as tensors:
            vocab = (np.asarray(tensors.get_tensor(DRAFT_VOCAB), np.int32)
                     if DRAFT_VOCAB in tensors.keys() else None)
    except Exception as error:  # safetensors' errors on a missing or damaged file
        raise CheckpointError(f"{path}: unreadable ({one_line(error)})") from error
    if vocab is None:
        raise InvalidArgumentError(f"--init-draft {directory}: {DRAFT_TENSORS} holds no "
                                   f"{DRAFT_VOCAB} (not an EAGLE-3 draft)")
    return vocab


# The parameters through which a Llama block writes to the residual stream.
_BLOCK_OUTPUTS = ("wo", "bo", "w_down", "b_down", "we_down")


def grow_draft(config, params: dict, target_config, target_params: dict,
               target_layers: Sequence[int]):
    """(config, params) of a deeper draft: ``params``' blocks, then copies of the target
    blocks ``target_layers`` whose residual-stream outputs (``wo``, ``w_down`` and their
    biases; the experts' ``we_down``) are zero. Each new block then adds exactly zero, so
    the grown draft computes exactly what the draft did, and training starts from it rather
    than from scratch (a 3-4-layer draft that keeps what a trained 2-layer one learned)."""
    import jax

    if config.architecture != "llama":
        raise InvalidArgumentError(
            f"growing a draft needs a Llama-family draft, not {config.architecture}")
    num = target_config.num_layers
    if any(not 0 <= i < num for i in target_layers):
        raise InvalidArgumentError(f"add_layers {tuple(target_layers)} out of range for a "
                                   f"{num}-layer target")
    index = np.asarray(target_layers)
    new = {name: np.array(np.asarray(value)[index])
           for name, value in target_params["layers"].items()}
    for name in _BLOCK_OUTPUTS:
        if name in new:
            new[name] = np.zeros_like(new[name])
    layers = {name: np.concatenate([np.asarray(params["layers"][name]),
                                    new[name].astype(np.asarray(params["layers"][name]).dtype)])
              for name in params["layers"]}
    config = dataclasses.replace(config, num_layers=config.num_layers + len(index))
    return config, {**params, "layers": jax.tree.map(np.asarray, layers)}


def split_trainable(params: dict, train_embeddings: bool) -> tuple[dict, dict]:
    """(trainable, frozen) parts of a draft's parameters (a reduced head's id map is
    always frozen)."""
    frozen_keys = ("draft_vocab",) if train_embeddings else (
        "embed", "lm_head", "lm_head_bias", "position_embed", "draft_vocab")
    trainable = {k: v for k, v in params.items() if k not in frozen_keys}
    frozen = {k: v for k, v in params.items() if k in frozen_keys}
    return trainable, frozen


def draft_vocabulary(out: Path, cfg: "TrainConfig", vocab_size: int,
                     generated: np.ndarray | None = None):
    """(ids, description) of an EAGLE-3 draft's vocabulary: the ``cfg.draft_vocab`` most
    frequent ids of the run's training mix (:func:`head_subset`; ``generated``: the
    target's text it trains on, prior corpora included, else the run's own file), ``None``
    for others. Chosen once and kept in ``out/draft_vocab.npy``: a resumed run and its
    export read the same map whatever they are given."""
    if not cfg.eagle3:
        return None, None
    if cfg.draft_vocab > vocab_size:
        raise InvalidArgumentError(f"draft_vocab {cfg.draft_vocab} exceeds the target's "
                                   f"vocabulary of {vocab_size}")
    kept = Path(out) / "draft_vocab.npy"
    if kept.exists():
        return np.load(kept), f"the {cfg.draft_vocab} ids chosen when the run began ({kept})"
    if cfg.init_draft is not None:  # a draft trained further keeps its vocabulary
        ids = _asset_vocabulary(cfg.init_draft)
        description = f"the {ids.size} ids of the draft it starts from ({cfg.init_draft})"
    else:
        ids, description = head_subset(out, cfg, cfg.draft_vocab, vocab_size, generated)
    with open(kept.with_suffix(".tmp"), "wb") as f:
        np.save(f, np.asarray(ids, np.int32))
    os.replace(kept.with_suffix(".tmp"), kept)
    return ids, description


def head_subset(out: Path, cfg: "TrainConfig", k: int, vocab_size: int,
                 generated: np.ndarray | None = None):
    """(ids, description) of the ``k`` most frequent tokens of the run's training mix: the
    file corpus alone, or with ``--corpus-from-target`` the file corpus and the target's
    generations weighted by the windows each gives a batch (the draft must cover what the
    target writes, and a draft never proposes a token outside its head)."""
    with np.load(out / "corpus.npz") as corpus:
        files = corpus["train"]
    target_file = out / "target_corpus.npz"
    share = (round(cfg.target_corpus_fraction * cfg.batch_size) / cfg.batch_size
             if cfg.target_corpus_tokens else 0.0)
    if share == 0 or (generated is None and not target_file.exists()):
        return (frequent_tokens(files, k, vocab_size),
                f"the {k} most frequent ids of the run's training corpus")
    if generated is None:
        with np.load(target_file) as data:
            generated = data["train"]
    mixture = [(files, 1.0 - share), (generated, share)]
    return (frequent_tokens(None, k, vocab_size, mixture=mixture),
            f"the {k} most frequent ids of the run's training mix: relative frequencies of "
            f"the file corpus weighted {1 - share:g} and of the target's generations "
            f"{share:g}")
