"""The draft-training loop (:func:`train_draft`): claims the output folder, reads or
makes the corpora, trains with resumable orbax checkpoints, evaluates held-out agreement,
and exports the draft atomically (see :mod:`~specjax.commands.train_draft` for the folder
it writes)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specjax import interrupts
from specjax import progress as progress_lib
from specjax.checkpoints_tools.hf import save_hf_directory
from specjax.checkpoints_tools.orbax_io import save_orbax
from specjax.errors import InvalidArgumentError
from specjax.models import cast_floats
from specjax.training import draft_corpus, target_corpus
from specjax.training.config import TrainConfig
from specjax.training.corpus import (is_token_file, mixed_windows, sample_windows, stdlib_files,
                                     tokenize_corpus)
from specjax.training.drafts import draft_vocabulary, initial_draft, split_trainable
from specjax.training.steps import learning_rate, make_optimizer, make_steps, set_learning_rate


def _clock_fraction(began: float, deadline: float | None) -> float:
    """The fraction of the time from ``began`` to ``deadline`` (both ``time.monotonic``)
    spent so far; 0 without a deadline."""
    if deadline is None:
        return 0.0
    return (time.monotonic() - began) / max(deadline - began, 1e-9)


def train_draft(target: Any, out: str | os.PathLike, cfg: TrainConfig, *,
                corpus_files: Sequence[Path] | None = None, export_hf: bool = False,
                progress: bool = False, log=print, time_budget: float | None = None,
                prior_target_corpora: Sequence[str | os.PathLike] = (),
                rollout_draft: Any = None, corpora_only: bool = False) -> dict:
    """Trains (or resumes training) a draft for ``target`` into ``out``.

    Args:
      target: a :class:`specjax.Model`; with a tokenizer unless the corpus is token files.
      out: output directory (see :mod:`~specjax.commands.train_draft`); reused to resume.
        A run that fails (an error, not Ctrl-C) in a directory it created, before its
        first checkpoint, removes it: the corrected command starts afresh.
      cfg: training knobs.
      corpus_files: text files and ``.npy`` token files
        (:func:`~specjax.training.corpus.tokenize_corpus`); ``None`` means the standard
        library's sources.
      export_hf: also write ``out/draft-hf`` (transformers-loadable).
      progress: show progress bars.
      log: called with one-line progress messages.
      time_budget: seconds from this call (corpus generation and compilation included)
        after which training stops at the end of a step, saves a checkpoint and exports
        the draft as if ``cfg.steps`` were reached (a rerun resumes from there); ``None``:
        no limit.
      prior_target_corpora: ``target_corpus.npz`` files of earlier runs (text the target
        wrote, ``train`` and ``heldout`` streams): added to this run's target text
        (needs ``cfg.target_corpus_tokens``).
      rollout_draft: with ``cfg.draft_corpus_tokens``, the draft (a :class:`specjax.Model`,
        ``cfg.rollout_draft`` loaded) that writes the rollouts when
        ``out/draft_corpus.npz`` is not there yet; ``None`` where it is.
      corpora_only: write the corpora into ``out`` and stop before training (the text is
        made on one machine, and the files copied into the folder of a run elsewhere).
    Returns:
      A summary dict (steps done, final held-out agreement, seconds, paths;
      ``stopped_by_time_budget`` when the budget ended it; with ``corpora_only``, the
      corpus files' paths and token counts).
    Raises:
      KeyboardInterrupt: Ctrl-C. The run stops at once, except that a checkpoint or file
        being written is finished first; nothing half-written is left, ``draft`` (and
        ``draft-hf``) appear only with the run complete, and a rerun resumes.
    """
    folder = Path(out).absolute()
    created = not folder.exists()
    try:
        with interrupts.guard() as interrupt:
            return _train(target, out, cfg, corpus_files, export_hf, progress, log,
                          interrupt, time_budget, tuple(prior_target_corpora), rollout_draft,
                          corpora_only)
    except Exception:
        if created and not _has_checkpoint(folder):
            # Nothing worth resuming: a rerun with corrected settings must not find a
            # folder claimed by these ones (nor the corpus tokenized for them).
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _has_checkpoint(out: Path) -> bool:
    """Whether ``out`` holds a saved training step (orbax's numbered folders)."""
    state = out / "train_state"
    return state.is_dir() and any(p.name.isdigit() for p in state.iterdir())


def check_target(target: Any, cfg: TrainConfig, corpus_files=None) -> None:
    """Refuses, before a file is written, a run the target cannot serve: layers it lacks,
    a vocabulary larger than its own, text to read without a tokenizer.

    Raises:
      InvalidArgumentError: naming the flag and the target's size.
    """
    config = target.config
    if config.architecture != "llama":
        raise InvalidArgumentError("train-draft makes Llama-family drafts; the target is "
                                   f"{config.architecture}")
    num = config.num_layers
    for flag, layers in (("--init-layers", () if cfg.init_draft else cfg.init_layers),
                         ("--add-layers", cfg.add_layers),
                         ("--feature-layers", cfg.feature_layers if cfg.eagle3 else ())):
        wrong = [int(i) for i in layers or () if not 0 <= int(i) < num]
        if wrong:
            raise InvalidArgumentError(f"{flag} {','.join(map(str, layers))}: block "
                                       f"{wrong[0]} is out of range for a {num}-layer target "
                                       f"(blocks 0 to {num - 1})")
    if cfg.eagle3 and cfg.draft_vocab > config.vocab_size:
        raise InvalidArgumentError(f"--draft-vocab {cfg.draft_vocab} exceeds the target's "
                                   f"vocabulary of {config.vocab_size} ids")
    if target.tokenizer is None:
        text = [str(f) for f in corpus_files or () if not is_token_file(f)]
        if corpus_files is None or text:
            what = (f"text files ({text[0]})" if text else
                    "the standard library's source (the default corpus)")
            raise InvalidArgumentError(
                f"target {target.name} has no tokenizer to read {what}: give token ids "
                f"instead, --corpus FILE.npy (1-D or 2-D integer arrays)")
        if cfg.target_corpus_tokens:
            raise InvalidArgumentError(
                f"--corpus-from-target prompts the target with text: target {target.name} "
                f"has no tokenizer")


def _scores(result) -> dict:
    """An eval step's result as floats: ``agreement`` and ``kl`` (and, for EAGLE-3
    drafts, per-depth lists ``agreement_depth``, ``acceptance_depth``, ``kl_depth``)."""
    if not isinstance(result, dict):
        agree, kl = result
        return {"agreement": float(agree), "kl": float(kl)}
    out = {"agreement": float(result["agreement"]), "kl": float(result["kl"])}
    for name in ("agreement", "acceptance", "kl"):
        depths = sorted(int(k[len(name):]) for k in result
                        if k.startswith(name) and k[len(name):].isdigit())
        if depths:
            out[f"{name}_depth"] = [round(float(result[f"{name}{d}"]), 5) for d in depths]
    return out


def _start_run(target: Any, out: str | os.PathLike, cfg: TrainConfig, export_hf: bool,
               prior_target_corpora: tuple, corpus_files=None) -> Path:
    """Checks the request (:func:`check_target` and the flags) and claims ``out`` for it
    (its ``train_config.json``); refuses a folder that holds a run with other settings."""
    check_target(target, cfg, corpus_files)
    if export_hf and (cfg.feature_draft or cfg.eagle3):
        raise InvalidArgumentError("--export-hf: a feature draft has no Hugging Face "
                                   "equivalent (it reads the target's hidden states)")
    if prior_target_corpora and not cfg.target_corpus_tokens:
        raise InvalidArgumentError("--prior-target-corpus adds to the target's own text: it "
                                   "needs --corpus-from-target N")
    for prior in prior_target_corpora:
        if not Path(prior).is_file():
            raise InvalidArgumentError(f"prior target corpus {prior} does not exist")
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    record = json.dumps(cfg.record(), sort_keys=True)
    run_file = out / "train_config.json"
    if run_file.exists() and run_file.read_text().strip() != record:
        raise InvalidArgumentError(
            f"{out} holds a run with different settings ({run_file}); use a new directory")
    run_file.write_text(record + "\n")
    return out


def _corpus_file_list(corpus_files) -> list[Path]:
    """The file corpus: ``corpus_files``, or the standard library's sources."""
    files = stdlib_files() if corpus_files is None else [Path(f) for f in corpus_files]
    for f in files:
        if not f.is_file():
            raise InvalidArgumentError(f"corpus file {f} does not exist")
    return files


def _draft_corpus(target: Any, out: Path, cfg: TrainConfig, corpus_files, rollout_draft,
                  interrupt: interrupts.Interrupt, log, progress: bool):
    """(train, held-out) streams of the draft's rollouts (``cfg.draft_corpus_tokens``),
    written once into ``out/draft_corpus.npz`` (a file made elsewhere, e.g. on a CPU ahead
    of a GPU window, is reused if it was made with the run's settings); ``(None, None)``
    without them."""
    if not cfg.draft_corpus_tokens:
        return None, None
    path = out / "draft_corpus.npz"
    wanted = draft_corpus.rollout_settings(cfg)
    if path.exists():
        with np.load(path) as data:
            train, held = data["train"], data["heldout"]
            info = json.loads(bytes(data["info"]).decode()) if "info" in data else {}
        made = info.get("settings", {})
        differ = sorted(k for k in wanted if k != "draft" and made.get(k) != wanted[k])
        if differ:
            theirs = ", ".join(f"{k} {made.get(k)!r}" for k in differ)
            ours = ", ".join(f"{k} {wanted[k]!r}" for k in differ)
            raise InvalidArgumentError(f"{path} was made with other settings ({theirs}; this "
                                       f"run: {ours}): give those flags or a new directory")
        for stream in (train, held):
            if stream.ndim != 1 or stream.size == 0 or stream.min() < 0 \
                    or stream.max() >= target.config.vocab_size:
                raise InvalidArgumentError(f"{path} holds ids outside the target's vocabulary "
                                           f"of {target.config.vocab_size}")
        log(f"draft corpus: reusing {path} (written by {made.get('draft')})")
    else:
        if rollout_draft is None:
            raise InvalidArgumentError(f"{path} is not there: the rollouts need the draft "
                                       f"{cfg.rollout_draft} (rollout_draft)")
        separator = (target.config.eos_token_ids or (0,))[0]
        train, held, info = draft_corpus.generate_draft_corpus(
            target, rollout_draft, _corpus_file_list(corpus_files), cfg, separator=separator,
            log=log, progress=progress)
        _save_npz(path, interrupt, train=train, heldout=held,
                  info=np.frombuffer(json.dumps(info).encode(), np.uint8))
        log(f"draft corpus: {info['seconds']} s, {info['generated_tokens_per_s']} "
            "generated tokens/s")
    log(f"draft corpus: {train.size} training tokens, {held.size} held-out tokens")
    return train.astype(np.int32), held.astype(np.int32)


def _corpora(target: Any, out: Path, cfg: TrainConfig, corpus_files, prior_target_corpora,
             interrupt: interrupts.Interrupt, log, progress: bool):
    """(train, held-out, target train, target held-out) streams of a run: the file corpus
    (tokenized once into ``out/corpus.npz``) and, with ``cfg.target_corpus_tokens``, the
    target's own text (written once into ``out/target_corpus.npz``) plus prior corpora;
    ``None`` for the target's streams otherwise."""

    def corpus_file_list() -> list[Path]:
        return _corpus_file_list(corpus_files)

    separator = (target.config.eos_token_ids or (0,))[0]
    corpus_path = out / "corpus.npz"
    if corpus_path.exists():
        with np.load(corpus_path) as data:
            train, held = data["train"], data["heldout"]
    else:
        train, held = tokenize_corpus(corpus_file_list(), target.tokenizer,
                                      max_tokens=cfg.max_corpus_tokens,
                                      heldout_fraction=cfg.heldout_fraction,
                                      separator=separator, progress=progress,
                                      vocab_size=target.config.vocab_size)
        _save_npz(corpus_path, interrupt, train=train, heldout=held)
    log(f"corpus: {train.size} training tokens, {held.size} held-out tokens")
    if not cfg.target_corpus_tokens:
        return train, held, None, None
    target_path = out / "target_corpus.npz"
    if target_path.exists():
        with np.load(target_path) as data:
            target_train, target_held = data["train"], data["heldout"]
        log("target corpus: reusing " + str(target_path))
    else:
        target_train, target_held, info = target_corpus.generate_target_corpus(
            target, corpus_file_list(), cfg, separator=separator, log=log, progress=progress)
        _save_npz(target_path, interrupt, train=target_train, heldout=target_held,
                  info=np.frombuffer(json.dumps(info).encode(), np.uint8))
        log(f"target corpus: {info['seconds']} s, {info['generated_tokens_per_s']} "
            "generated tokens/s")
    for prior in prior_target_corpora:
        target_train, target_held = target_corpus.add_prior_corpus(prior, target_train, target_held,
                                                      target.config.vocab_size)
        log(f"target corpus: added the text of {prior}")
    log(f"target corpus: {target_train.size} training tokens, {target_held.size} "
        "held-out tokens")
    return train, held, target_train, target_held


def _train(target: Any, out: str | os.PathLike, cfg: TrainConfig,
           corpus_files: Sequence[Path] | None, export_hf: bool, progress: bool, log,
           interrupt: interrupts.Interrupt, time_budget: float | None = None,
           prior_target_corpora: tuple = (), rollout_draft: Any = None,
           corpora_only: bool = False) -> dict:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    started = time.monotonic()
    out = _start_run(target, out, cfg, export_hf, prior_target_corpora, corpus_files)
    train, held, target_train, target_held = _corpora(
        target, out, cfg, corpus_files, prior_target_corpora, interrupt, log, progress)
    draft_train, draft_held = _draft_corpus(target, out, cfg, corpus_files, rollout_draft,
                                            interrupt, log, progress)
    if corpora_only:
        return _corpora_summary(out, started, corpus=(train, held),
                                target_corpus=(target_train, target_held),
                                draft_corpus=(draft_train, draft_held))

    draft_config, trainable, frozen, optimizer, opt_state = _initial_state(
        target, out, cfg, target_train, log)
    target_params = jax.device_put(cast_floats(target.params, cfg.compute_dtype))

    manager = ocp.CheckpointManager(out / "train_state",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    with contextlib.ExitStack() as stack:
        # On the way out, Ctrl-C included, let orbax finish the save in flight (held back
        # from a second Ctrl-C): interrupting its threads left a half-written
        # "N.orbax-checkpoint-tmp" step and a "cannot schedule new futures" traceback.
        stack.callback(_close_manager, manager, interrupt)
        start = 0
        if manager.latest_step() is not None:
            start = manager.latest_step()
            restored = manager.restore(start, args=ocp.args.StandardRestore(
                {"trainable": trainable, "opt_state": opt_state}))
            trainable, opt_state = restored["trainable"], restored["opt_state"]
            log(f"resumed from step {start}")

        train_step, eval_step = make_steps(target.config, draft_config, cfg, optimizer)
        evaluate_all = _evaluator(eval_step, frozen, target_params, cfg, held, target_held,
                                  draft_held)
        batch_windows = _batch_sampler(cfg, train, target_train, draft_train)
        log_file = stack.enter_context((out / "train_log.jsonl").open("a"))
        if start == 0:  # where the draft starts from
            entry = evaluate_all(trainable)
            log_file.write(json.dumps({"step": 0, **entry, "time": time.time()}) + "\n")
            log(f"step 0: {_describe(entry)}, KL {entry['heldout_kl']:.4f}")
        rng = np.random.default_rng(cfg.seed + start)
        bar = None
        if progress:
            bar = stack.enter_context(progress_lib.terminal_bar(
                total=cfg.steps, initial=start, desc="train-draft", unit="step"))
        began = time.perf_counter()
        tokens_per_step = cfg.batch_size * cfg.seq_len
        agreement = target_agreement = None
        # The first timing window includes compiling.
        window_start, window_first = time.perf_counter(), start
        out_of_time = False
        # An EAGLE-3 run's learning rate follows the clock too: with a time budget the
        # schedule ends when the budget does, if that comes before the last step.
        deadline = None if time_budget is None else started + time_budget
        loop_began = time.monotonic()
        for step in range(start, cfg.steps):
            interrupt.check()  # one that a gc callback swallowed during the last step
            if cfg.eagle3:
                opt_state = set_learning_rate(opt_state, learning_rate(
                    cfg, step, _clock_fraction(loop_began, deadline)))
            windows = jnp.asarray(batch_windows(rng))
            trainable, opt_state, loss, aux = train_step(trainable, opt_state, frozen,
                                                         target_params, windows)
            done = step + 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss):.3f}")
            out_of_time = (time_budget is not None
                           and time.monotonic() - started >= time_budget)
            last = done == cfg.steps or out_of_time
            if done % cfg.eval_every == 0 or last:
                jax.block_until_ready(trainable)
                elapsed = time.perf_counter() - window_start
                timed_steps = done - max(window_first, start)
                scores = evaluate_all(trainable)
                agreement = scores["heldout_agreement"]
                entry = {"step": done, "loss": float(loss),
                         **{k: float(v) for k, v in aux.items()}, **scores,
                         "tokens_per_s": tokens_per_step * timed_steps / max(elapsed, 1e-9),
                         "time": time.time()}
                log_file.write(json.dumps(entry) + "\n")
                log_file.flush()
                log(f"step {done}: loss {float(loss):.4f}, {_describe(scores)}")
                target_agreement = scores.get("heldout_target_agreement")
                window_start, window_first = time.perf_counter(), done
            if done % cfg.checkpoint_every == 0 or last:
                with interrupt.deferred():  # orbax's save must not be cut half-way
                    manager.save(done, args=ocp.args.StandardSave(
                        {"trainable": trainable, "opt_state": opt_state}))
            if out_of_time:
                log(f"time budget of {time_budget:g} s reached after step {done}")
                break
    if agreement is None:
        scores = evaluate_all(trainable)
        agreement = scores["heldout_agreement"]
        target_agreement = scores.get("heldout_target_agreement")

    summary = {"steps": done if out_of_time else cfg.steps, "heldout_agreement": agreement,
               "seconds": time.perf_counter() - began, "draft": str(out / "draft")}
    if target_held is not None:
        summary["heldout_target_agreement"] = target_agreement
    if draft_held is not None:
        summary["heldout_draft_agreement"] = scores.get("heldout_draft_agreement")
    if out_of_time:
        summary["stopped_by_time_budget"] = True
    if export_hf:
        summary["draft_hf"] = str(out / "draft-hf")
    params = jax.tree.map(np.asarray, {**trainable, **frozen})
    with interrupt.deferred():
        _export(out, draft_config, params, target.tokenizer, export_hf, summary, interrupt)
    return summary


def _corpora_summary(out: Path, started: float, **streams) -> dict:
    """A ``corpora_only`` run's summary: each corpus file's path and token counts (the
    target's text with prior corpora added), and the seconds spent."""
    return {"corpora": {str(out / f"{name}.npz"): {"train_tokens": int(pair[0].size),
                                                   "heldout_tokens": int(pair[1].size)}
                        for name, pair in streams.items() if pair[0] is not None},
            "seconds": round(time.monotonic() - started, 1)}


def _batch_sampler(cfg: TrainConfig, train, target_train, draft_train):
    """``batch_windows(rng)``: a batch of windows, ``target_corpus_fraction`` of them from
    the target's text and ``draft_corpus_fraction`` from the draft's rollouts when the run
    has them (rounded), the rest from the file corpus."""
    num_target = 0 if target_train is None else int(
        round(cfg.target_corpus_fraction * cfg.batch_size))
    num_draft = 0 if draft_train is None else int(
        round(cfg.draft_corpus_fraction * cfg.batch_size))

    def batch_windows(rng):
        return mixed_windows(train, target_train, rng, cfg.batch_size, cfg.seq_len + 1,
                             num_target, draft_train, num_draft)

    return batch_windows


def _initial_state(target: Any, out: Path, cfg: TrainConfig, target_train, log):
    """(draft config, trainable and frozen parameters on the device, optimizer, its state)
    of a run's first step (a resumed run then restores the trainable part)."""
    import jax

    vocab, vocab_source = draft_vocabulary(out, cfg, target.config.vocab_size, target_train)
    if vocab is not None:
        log(f"draft vocabulary: {vocab_source}")
    draft_config, draft_params = initial_draft(target, cfg, vocab)
    trainable, frozen = split_trainable(draft_params, cfg.train_embeddings)
    optimizer = make_optimizer(cfg)
    return draft_config, trainable, jax.device_put(frozen), optimizer, optimizer.init(trainable)


def _evaluator(eval_step, frozen, target_params, cfg: TrainConfig, held, target_held,
               draft_held=None):
    """``evaluate(params) -> entry``: agreement and KL (per depth for EAGLE-3 drafts) on
    fixed held-out windows of the file corpus (``heldout_*``), of the target's own text
    (``heldout_target_*``) and of the draft's rollouts (``heldout_draft_*``), when there
    are those."""
    import jax.numpy as jnp

    rng = np.random.default_rng(cfg.seed + 1)
    windows = {"heldout": sample_windows(held, rng, cfg.eval_windows, cfg.seq_len + 1)}
    if target_held is not None:
        windows["heldout_target"] = sample_windows(target_held, rng, cfg.eval_windows,
                                                   cfg.seq_len + 1)
    if draft_held is not None:
        windows["heldout_draft"] = sample_windows(draft_held, rng, cfg.eval_windows,
                                                  cfg.seq_len + 1)

    def evaluate(params) -> dict:
        entry = {}
        for prefix, batch in windows.items():
            scores = _scores(eval_step(params, frozen, target_params, jnp.asarray(batch)))
            entry.update({f"{prefix}_{name}": value for name, value in scores.items()})
        return entry

    return evaluate


def _describe(entry: dict) -> str:
    """One log line's account of a held-out evaluation."""
    text = f"held-out top-1 agreement {entry['heldout_agreement']:.3f}"
    if "heldout_target_agreement" in entry:
        text += f" (on target generations {entry['heldout_target_agreement']:.3f})"
    if "heldout_draft_agreement" in entry:
        text += f" (on the draft's rollouts {entry['heldout_draft_agreement']:.3f})"
    if "heldout_target_agreement_depth" in entry:
        text += f", per depth {entry['heldout_target_agreement_depth']}"
    return text


def _save_npz(path: Path, interrupt: interrupts.Interrupt, **arrays) -> None:
    """``np.savez`` to ``path`` atomically (complete or absent, Ctrl-C held back)."""
    tmp = path.with_suffix(".tmp.npz")
    with interrupt.deferred():
        try:
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _close_manager(manager, interrupt: interrupts.Interrupt) -> None:
    with interrupt.deferred():
        manager.wait_until_finished()
        manager.close()


def _export(out: Path, config, params: dict, tokenizer, export_hf: bool, summary: dict,
            interrupt: interrupts.Interrupt) -> None:
    """Writes ``draft`` (and ``draft-hf``) into hidden directories first and moves them
    into place together, with ``summary.json``, only if no Ctrl-C came meanwhile."""
    names = ["draft", "draft-hf"] if export_hf else ["draft"]
    staged = {name: out / f".{name}.tmp" for name in names + ["summary.json"]}
    try:
        for path in staged.values():  # left by a run killed outright
            _remove(path)
        save_orbax(staged["draft"], config, params, tokenizer)
        interrupt.check()
        if export_hf:
            save_hf_directory(config, params, staged["draft-hf"], tokenizer)
            interrupt.check()
        staged["summary.json"].write_text(json.dumps(summary, indent=2) + "\n")
        for name in names:
            shutil.rmtree(out / name, ignore_errors=True)  # the previous run's
        for name, path in staged.items():
            os.replace(path, out / name)
    except BaseException:  # Ctrl-C included (raised by check): nothing half-written left
        for path in staged.values():
            _remove(path)
        raise
    interrupt.completed()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
