"""A training run's latest saved state as a draft (:func:`export_latest`): usable before
the run ends, and written as a shipped asset with ``--asset``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from specjax import interrupts
from specjax.checkpoints_tools.sources import save_draft_asset
from specjax.errors import InvalidArgumentError
from specjax.training.config import TrainConfig
from specjax.training.drafts import draft_vocabulary, head_subset, initial_draft, split_trainable
from specjax.training.steps import make_optimizer


def export_latest(target: Any, out: str | os.PathLike, asset_dir: str | os.PathLike | None = None,
                  *, note: str = "", head_tokens: int | None = None) -> dict:
    """Writes the latest saved training state of ``out`` as ``out/draft`` (and, with
    ``asset_dir``, as a shipped asset: :func:`~specjax.checkpoints_tools.sources.save_draft_asset`).

    Lets a long run be used before it ends (or after it was stopped). ``head_tokens`` K
    gives the asset a head restricted to the K most frequent tokens of the run's training
    mix (:func:`~specjax.training.drafts.head_subset`,
    :func:`~specjax.checkpoints_tools.sources.frequent_tokens`).
    """
    import jax
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    run_file = out / "train_config.json"
    if not run_file.is_file():
        raise InvalidArgumentError(f"{out} holds no train-draft run ({run_file} is missing)")
    raw = json.loads(run_file.read_text())
    raw["init_layers"] = tuple(raw["init_layers"])
    for name in ("add_layers", "feature_layers"):
        if raw.get(name) is not None:
            raw[name] = tuple(raw[name])
    cfg = TrainConfig(**raw)
    if cfg.eagle3 and head_tokens is not None:
        raise InvalidArgumentError("--head-tokens: an EAGLE-3 draft's head already scores its "
                                   f"own vocabulary of {cfg.draft_vocab} ids (--draft-vocab)")
    vocab, vocab_source = draft_vocabulary(out, cfg, target.config.vocab_size)
    draft_config, draft_params = initial_draft(target, cfg, vocab)
    trainable, frozen = split_trainable(draft_params, cfg.train_embeddings)
    opt_state = make_optimizer(cfg).init(trainable)
    with ocp.CheckpointManager(out / "train_state") as manager:
        step = manager.latest_step()
        if step is None:
            raise InvalidArgumentError(f"{out}: no checkpoint saved yet")
        restored = manager.restore(step, args=ocp.args.StandardRestore(
            {"trainable": trainable, "opt_state": opt_state}))
    params = jax.tree.map(np.asarray, {**restored["trainable"], **frozen})
    log_lines = (out / "train_log.jsonl").read_text().splitlines() if (
        out / "train_log.jsonl").exists() else []
    entries = [json.loads(line) for line in log_lines if line.strip()]
    at_step = [e for e in entries if e["step"] == step]
    summary = {"step": step, "heldout_agreement": at_step[-1]["heldout_agreement"]
               if at_step else None}
    if asset_dir is not None:
        provenance = {"trained_steps": step, "train_config": json.loads(run_file.read_text()),
                      "heldout_top1_agreement": summary["heldout_agreement"],
                      "target": target.name, "note": note}
        if vocab_source is not None:
            provenance["draft_vocab_source"] = vocab_source
        subset = None
        if head_tokens is not None:
            if not 1 <= head_tokens <= target.config.vocab_size:
                raise InvalidArgumentError(
                    f"head_tokens must be in [1, {target.config.vocab_size}], got {head_tokens}")
            subset, provenance["head_tokens_source"] = head_subset(out, cfg, head_tokens,
                                                                    target.config.vocab_size)
        # Ctrl-C waits for the asset's files (then raises): none is left half-written.
        with interrupts.guard() as interrupt, interrupt.deferred():
            save_draft_asset(asset_dir, target.config, params, target.params["embed"],
                             provenance, head_tokens=subset,
                             feature_layers=draft_config.feature_layers)
        summary["asset"] = str(asset_dir)
    return summary
