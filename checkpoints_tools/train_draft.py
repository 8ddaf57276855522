"""``specjax train-draft``: distil a small draft model from a target with optax.

The draft is a standard Llama-family model (the target's config with fewer layers), so it
also exports to a Hugging Face directory and runs as ``assistant_model`` in transformers.
It starts from a subset of the target's blocks (``init_layers``, e.g. the first two) and
shares the target's embedding, final norm and head, so only a few blocks have to learn.
Training runs it through :class:`specjax.flax_modules.LinenCausalLM`, the module a Flax
pipeline of one's own would train: the trained parameters are that module's ``params``
(and an :class:`~specjax.flax_modules.NNXCausalLM`'s state, via
:func:`~specjax.flax_modules.to_flax`), so a draft trained here and one trained elsewhere
are the same kind of object.

Loss, per token position of the corpus (all positions of each window):

* ``kl``  -- KL(p_target || q_draft) over the full vocabulary (distillation; default);
* ``tvd`` -- total variation 0.5 * sum |p - q| (the quantity acceptance depends on);
* ``ce``  -- next-token cross-entropy on the corpus text (no teacher pass; cheapest);
* ``ce+kl`` -- their sum.

The teacher's distributions are computed on the fly inside the jitted step (a forward
pass, no gradient). The training corpus must exist offline on any machine: by default it is
the Python standard library source of the running interpreter (``--corpus stdlib``), never
HumanEval (the benchmark); text files can be given instead. Files are split into training
and held-out sets by a hash of their path, and the held-out set measures **top-1
agreement**: how often the draft's argmax equals the target's, the quantity that drives
greedy acceptance.

Self-distillation corpus (``--corpus-from-target N``): a draft must imitate what the
target writes (on HumanEval: code, then markdown, explanations and test calls), which
library source does not show it. The target itself then generates ``N`` tokens
(:mod:`~specjax.checkpoints_tools.sample_corpus`: batched rows under ``jax.vmap``, one
jitted program, seed varied per row, temperature ``--target-temperature``, rows of
``--target-gen-len`` tokens cut at the end-of-text token) from HumanEval-shaped prompts:
the signature and docstring of functions found in the training files
(:func:`~specjax.checkpoints_tools.sample_corpus.docstring_prompts`), never HumanEval's
own (its package is not a source, and functions named like its problems are left out).
A further ``heldout_fraction`` of generations (at least ``eval_windows`` windows' worth)
comes from held-out files' prompts under other seeds: agreement on them is logged as
``heldout_target_agreement``. Each document is prompt + generation; with
``--target-chat-fraction`` that share of the prompts asks for the function through the
target's chat template instead, as a chat user would. Mixing rule: every
training batch takes ``round(target_corpus_fraction * batch_size)`` windows from the
generations and the rest from the file corpus (a fraction of 0 trains on none of them:
a control run that still measures agreement on them). The generations are cached in
``target_corpus.npz`` and reused by a rerun, or by another run whose ``OUT`` the file is
copied into (so that runs compare on the same held-out generations).

Feature drafts (``--feature-draft``; EAGLE-style, see
:mod:`~specjax.checkpoints_tools.feature_draft`): the draft reads the target's features as
well as the tokens, and learns to predict the target's next feature (smooth L1) and,
through the target's head, its next-token distribution (KL). The target's features come
from the same frozen target pass, on the fly; ``--feature-noise`` and ``--feature-unroll``
set the input noise and the second pass that reads the draft's own predictions.
``--init-layers`` then names the target blocks the draft starts from (one, e.g. ``0``, is
EAGLE's shape); ``--init-draft ASSET`` of a standalone draft starts from a feature draft
that computes exactly that draft (``fc = [I; 0]``), so training only adds what the
features carry. ``--feature-weight`` scales the feature term against the KL. These drafts
train through :mod:`specjax.models` directly (the Flax modules take no features).
Held-out agreement is logged at depth 1 (the draft's first proposal after the root).

EAGLE-3 drafts (``--eagle3``; :mod:`~specjax.checkpoints_tools.eagle3`): one block (from
the target block ``--init-layers``, default 0) reading the outputs of target blocks
``--feature-layers`` (default 1, L/2-1, L-4), fused, with a head of its own over the
``--draft-vocab`` ids most frequent in the training mix (:func:`draft_vocabulary`),
trained with ``--unroll`` training-time-test passes weighted ``--unroll-decay ** i`` on
the target's soft labels (plus ``--acceptance-weight`` x the acceptance objective). The
target's block outputs and logits come from the frozen target pass inside each step.
Held-out agreement is logged per depth (``*_agreement_depth``, with ``*_acceptance_depth``
and ``*_kl_depth``). With ``--corpus-from-target N --target-corpus-fraction 1`` it trains
on the target's own text alone.

``--time-budget SECONDS`` stops training that long after the run starts (the corpora and
compilation included), saves a checkpoint and exports as if the last step were reached; a
rerun resumes from there.

``--init-draft ASSET`` starts from a trained draft asset (e.g. continue the shipped draft
on the target's own text) instead of the target's blocks ``init_layers``.
``--add-layers 2,3`` grows the starting draft by copies of those target blocks with their
output projections zeroed (:func:`grow_draft`): a 3-4-layer draft that starts out equal to
the 2-layer one and trains from there.

Output directory ``OUT``::

    train_state/     orbax CheckpointManager (step, trainable params, optimizer state);
                     a rerun with the same OUT resumes from the latest step
    corpus.npz       the tokenized corpus (train/held-out token streams), reused on resume
    target_corpus.npz  with --corpus-from-target: the target's generations (train/held-out)
    train_log.jsonl  one JSON object per logged step (loss, tokens/s, agreement)
    draft/           the final draft as a specjax (orbax) checkpoint with tokenizer
    draft-hf/        the same draft as a Hugging Face directory (with ``--export-hf``)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from specjax import interrupts
from specjax.errors import InvalidArgumentError
from specjax.models import cast_floats

LOSSES = ("kl", "tvd", "ce", "ce+kl")
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Knobs of a draft-training run (every field is a CLI flag of ``train-draft``)."""

    init_layers: tuple[int, ...] = (0, 1)
    loss: str = "kl"
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    train_embeddings: bool = False
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16
    checkpoint_every: int = 100
    max_corpus_tokens: int = 20_000_000
    heldout_fraction: float = 0.02
    # Self-distillation (module docstring); recorded in train_config.json only when used.
    target_corpus_tokens: int = 0
    target_corpus_fraction: float = 0.5
    target_temperature: float = 1.0
    target_gen_len: int = 256
    target_batch_size: int = 16
    target_greedy_fraction: float = 0.0  # recorded only when set
    target_chat_fraction: float = 0.0  # recorded only when set
    init_draft: str | None = None
    add_layers: tuple[int, ...] = ()
    # Feature drafts (module docstring); recorded in train_config.json only when used.
    feature_draft: bool = False
    feature_noise: float = 0.1
    feature_unroll: int = 2
    feature_weight: float = 1.0
    # EAGLE-3 drafts (module docstring); recorded in train_config.json only when used.
    eagle3: bool = False
    feature_layers: tuple[int, ...] | None = None  # None: eagle3.default_feature_layers
    draft_vocab: int = 8192
    unroll: int = 4
    unroll_decay: float = 0.8
    acceptance_weight: float = 0.0
    # Arithmetic of the target's passes (generation and the frozen pass of each step) and of
    # the draft's forward and backward: "bfloat16" keeps float32 master weights and
    # optimizer state but multiplies in bfloat16 (float32 runs at IEEE precision, which on
    # a GPU is several times slower). Recorded only when not float32.
    compute_dtype: str = "float32"
    # Seconds the target may spend writing its training text: rows not begun by then are
    # left out (the held-out rows are written first). Recorded only when set.
    target_gen_seconds: float | None = None

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise InvalidArgumentError(f"unknown loss {self.loss!r}; expected one of {LOSSES}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows",
                     "checkpoint_every", "max_corpus_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.init_layers:
            raise InvalidArgumentError("init_layers must name at least one target layer")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise InvalidArgumentError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got "
                                       f"{self.compute_dtype!r}")
        if self.target_gen_seconds is not None and not self.target_gen_seconds > 0:
            raise InvalidArgumentError(
                f"target_gen_seconds must be > 0, got {self.target_gen_seconds}")
        if any(int(i) < 0 for i in self.add_layers):
            raise InvalidArgumentError(f"add_layers must be target layer indices >= 0, got "
                                       f"{tuple(self.add_layers)}")
        if not self.learning_rate > 0:
            raise InvalidArgumentError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 < self.heldout_fraction < 1:
            raise InvalidArgumentError(
                f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.target_corpus_tokens < 0:
            raise InvalidArgumentError(
                f"target_corpus_tokens must be >= 0, got {self.target_corpus_tokens}")
        if self.feature_draft:
            from specjax.checkpoints_tools.feature_draft import FeatureLossConfig

            FeatureLossConfig(noise=self.feature_noise, unroll=self.feature_unroll,
                              feature_weight=self.feature_weight)
        if self.eagle3:
            from specjax.checkpoints_tools.eagle3 import Eagle3LossConfig

            if self.feature_draft or self.init_draft is not None or self.add_layers:
                raise InvalidArgumentError("an EAGLE-3 draft starts from the target's blocks "
                                           "--init-layers: --feature-draft, --init-draft and "
                                           "--add-layers do not apply")
            if self.loss != "kl":
                raise InvalidArgumentError("an EAGLE-3 draft trains on the target's soft "
                                           "labels (--loss kl)")
            self.loss_config()
            if self.draft_vocab < 1:
                raise InvalidArgumentError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
            if self.feature_layers is not None and (
                    not self.feature_layers or any(int(i) < 0 for i in self.feature_layers)):
                raise InvalidArgumentError(f"feature_layers must be target block indices "
                                           f">= 0, got {self.feature_layers!r}")
        if self.target_corpus_tokens:
            if not 0 <= self.target_corpus_fraction <= 1:
                raise InvalidArgumentError("target_corpus_fraction must be in [0, 1], got "
                                           f"{self.target_corpus_fraction}")
            for name in ("target_greedy_fraction", "target_chat_fraction"):
                if not 0 <= getattr(self, name) <= 1:
                    raise InvalidArgumentError(f"{name} must be in [0, 1], got "
                                               f"{getattr(self, name)}")
            if not (self.target_temperature >= 0 and np.isfinite(self.target_temperature)):
                raise InvalidArgumentError("target_temperature must be a finite number >= 0, "
                                           f"got {self.target_temperature}")
            for name in ("target_gen_len", "target_batch_size"):
                if getattr(self, name) < 1:
                    raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")

    def record(self) -> dict:
        """The settings as stored in ``train_config.json``: fields of features not used
        are left out, so runs made before those features existed still resume."""
        record = dataclasses.asdict(self)
        if not self.target_corpus_tokens:
            for name in _TARGET_CORPUS_FIELDS:
                record.pop(name)
        else:
            for name in ("target_greedy_fraction", "target_chat_fraction"):
                if not getattr(self, name):
                    record.pop(name)
        if self.init_draft is None:
            record.pop("init_draft")
        if not self.add_layers:
            record.pop("add_layers")
        if not self.feature_draft:
            for name in _FEATURE_FIELDS:
                record.pop(name)
        if not self.eagle3:
            for name in _EAGLE3_FIELDS:
                record.pop(name)
        if self.compute_dtype == "float32":
            record.pop("compute_dtype")
        if self.target_gen_seconds is None:
            record.pop("target_gen_seconds")
        return record

    def loss_config(self):
        """The :class:`~specjax.checkpoints_tools.eagle3.Eagle3LossConfig` of an EAGLE-3 run."""
        from specjax.checkpoints_tools.eagle3 import Eagle3LossConfig

        return Eagle3LossConfig(unroll=self.unroll, decay=self.unroll_decay,
                                acceptance_weight=self.acceptance_weight)


_FEATURE_FIELDS = ("feature_draft", "feature_noise", "feature_unroll", "feature_weight")
_EAGLE3_FIELDS = ("eagle3", "feature_layers", "draft_vocab", "unroll", "unroll_decay",
                  "acceptance_weight")
_TARGET_CORPUS_FIELDS = ("target_corpus_tokens", "target_corpus_fraction",
                         "target_temperature", "target_gen_len", "target_batch_size",
                         "target_greedy_fraction", "target_chat_fraction")


# ----------------------------------------------------------------------------- corpus


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "dist-packages"} or "human_eval" in str(path).lower():
            continue
        files.append(path)
    return files


def _is_heldout(path: Path, fraction: float) -> bool:
    digest = hashlib.sha256(str(path.name).encode() + str(path.parent.name).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


def tokenize_corpus(files: Sequence[Path], tokenizer, *, max_tokens: int, heldout_fraction: float,
                    separator: int, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes ``files`` into (train, heldout) int32 streams, documents joined by
    ``separator``. Stops once ``max_tokens`` tokens are collected."""
    train, held, total = [], [], 0
    iterator: Iterable[Path] = files
    if progress:
        from tqdm import tqdm

        iterator = tqdm(files, desc="tokenizing", unit="file")
    for path in iterator:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids.append(separator)
        (held if _is_heldout(path, heldout_fraction) else train).append(
            np.asarray(ids, np.int32))
        total += len(ids)
        if total >= max_tokens:
            break
    if not train or not held:
        raise InvalidArgumentError(
            "the corpus is too small: need text in both the training and held-out splits")
    return np.concatenate(train), np.concatenate(held)


CHAT_REQUEST = "Write the body of this Python function.\n\n```python\n{prompt}```"


def _spread(index: int, share: float) -> bool:
    """Whether item ``index`` of a sequence is one of a ``share`` of them, spread evenly."""
    return bool(np.floor((index + 1) * share) > np.floor(index * share))


def _encode_row(target, prompt: str, chat: bool) -> list[int]:
    """A generation row's prompt ids: the code itself, or (``chat``) a request to complete
    it through the target's chat template, the way a chat user asks (:data:`CHAT_REQUEST`)."""
    if not chat:
        return target.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"]
    from specjax.api import encode_prompt

    return encode_prompt(target, CHAT_REQUEST.format(prompt=prompt), chat=True)


def _generation_rows(target, params, prompts: list[str], rows: int, cfg: "TrainConfig",
                     seed: int, separator: int, progress,
                     deadline: float | None = None) -> np.ndarray:
    """Up to ``rows`` documents (prompt + generation + separator), joined as one int32
    stream, written in chunks of ``cfg.target_batch_size`` rows: a share
    ``target_greedy_fraction`` of the chunks greedily, spread evenly so that a run cut
    short keeps that share, the others at ``target_temperature``; a share
    ``target_chat_fraction`` of the rows, spread evenly too, asks through the chat template
    (:func:`_encode_row`). Row ``i`` samples with ``row_seed(seed, i)`` whatever its chunk.
    No chunk begins after ``deadline`` (``time.monotonic()``), except the first."""
    from specjax.checkpoints_tools import sample_corpus

    order = np.random.default_rng(seed).permutation(len(prompts))
    texts = [prompts[order[i % len(prompts)]] for i in range(rows)]  # cycled: seeds differ
    size, share = cfg.target_batch_size, cfg.target_greedy_fraction
    encoded, parts = [], []
    for chunk, begin in enumerate(range(0, rows, size)):
        if chunk and deadline is not None and time.monotonic() >= deadline:
            break
        # Encoded chunk by chunk: rows a deadline leaves out are never tokenized.
        encoded += [_encode_row(target, texts[i], _spread(i, cfg.target_chat_fraction))
                    for i in range(begin, min(begin + size, rows))]
        greedy = _spread(chunk, share)
        parts.append(sample_corpus.sample_continuations(
            params, target.config, encoded[begin:begin + size],
            num_new_tokens=cfg.target_gen_len,
            temperature=0.0 if greedy else cfg.target_temperature, seed=seed,
            first_row=begin, batch_size=size,
            stop_tokens=tuple(target.config.eos_token_ids) or (separator,)))
        progress(begin + len(parts[-1]))
    generated = np.concatenate(parts)
    documents = []
    for prompt, row in zip(encoded, generated):
        row = row[row >= 0]
        if row.size and row[-1] in target.config.eos_token_ids:
            row = row[:-1]
        documents.append(np.asarray(list(prompt) + row.tolist() + [separator], np.int32))
    return np.concatenate(documents)


def generate_target_corpus(target, files: Sequence[Path], cfg: "TrainConfig", *,
                           separator: int, log=print,
                           progress: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """The self-distillation corpus (see the module docstring): (train, held-out) int32
    streams of documents written by ``target``, and a description of how they were made.

    Args:
      target: a :class:`specjax.Model` with a tokenizer.
      files: the file corpus; its functions with docstrings become prompts (training
        files for training generations, held-out files for held-out ones).
      cfg: ``target_corpus_tokens`` generated positions for training (rows of
        ``target_gen_len``), ``target_temperature``, ``target_batch_size``, ``seed``;
        ``heldout_fraction`` more (at least ``eval_windows`` windows) for held-out.
      separator: the token that ends each document.
    Raises:
      InvalidArgumentError: the files hold no function with a docstring in either split.
    """
    from specjax.checkpoints_tools import sample_corpus

    exclude = sample_corpus.humaneval_entry_points()
    train_files = [f for f in files if not _is_heldout(f, cfg.heldout_fraction)]
    held_files = [f for f in files if _is_heldout(f, cfg.heldout_fraction)]
    train_prompts = sample_corpus.docstring_prompts(train_files, exclude_names=exclude)
    held_prompts = sample_corpus.docstring_prompts(held_files, exclude_names=exclude)
    if not train_prompts or not held_prompts:
        raise InvalidArgumentError(
            "--corpus-from-target needs functions with docstrings (the prompts) in both the "
            f"training and held-out files; found {len(train_prompts)} and {len(held_prompts)}")
    rows = -(-cfg.target_corpus_tokens // cfg.target_gen_len)
    window_rows = -(-cfg.eval_windows * (cfg.seq_len + 1) // cfg.target_gen_len)
    held_rows = max(int(np.ceil(rows * cfg.heldout_fraction)), window_rows, 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=rows + held_rows, desc="target corpus", unit="row")
    done = [0]

    def advance(count, offset):
        if bar is not None:
            bar.update(offset + count - done[0])
            done[0] = offset + count

    log(f"target corpus: generating {rows} + {held_rows} held-out rows of "
        f"{cfg.target_gen_len} tokens at temperature {cfg.target_temperature} "
        f"({cfg.target_greedy_fraction:g} of them greedy, {cfg.target_chat_fraction:g} "
        "through the chat template) from "
        f"{len(train_prompts)} + {len(held_prompts)} docstring prompts")
    began = time.perf_counter()
    params = cast_floats(target.params, cfg.compute_dtype)
    # The held-out rows first: a deadline (target_gen_seconds) cuts the training rows only.
    deadline = (None if cfg.target_gen_seconds is None
                else time.monotonic() + cfg.target_gen_seconds)
    try:
        held = _generation_rows(target, params, held_prompts, held_rows, cfg,
                                cfg.seed + 1_000_003, separator, lambda n: advance(n, rows))
        train = _generation_rows(target, params, train_prompts, rows, cfg, cfg.seed,
                                 separator, lambda n: advance(n, 0), deadline)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - began
    info = {"rows": rows, "heldout_rows": held_rows, "prompts": len(train_prompts),
            "train_tokens": int(train.size), "heldout_tokens": int(held.size),
            "compute_dtype": cfg.compute_dtype,
            "heldout_prompts": len(held_prompts), "humaneval_names_excluded": len(exclude),
            "seconds": round(seconds, 1),
            # Documents (prompts included) written per second.
            "generated_tokens_per_s": round((train.size + held.size) / max(seconds, 1e-9), 1)}
    return train, held, info


# ----------------------------------------------------------------------------- model


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
    if cfg.eagle3:
        from specjax.checkpoints_tools.eagle3 import eagle3_draft_from_target

        return eagle3_draft_from_target(target.config, target.params, draft_vocab,
                                        cfg.feature_layers, cfg.init_layers)
    if cfg.init_draft is None and cfg.feature_draft:
        from specjax.checkpoints_tools.feature_draft import feature_draft_from_target

        config, params = feature_draft_from_target(target.config, target.params,
                                                   cfg.init_layers)
    elif cfg.init_draft is None:
        config, params = draft_from_target(target.config, target.params, cfg.init_layers)
    else:
        import jax

        from specjax import models
        from specjax.checkpoints_tools.sources import load_bundled_draft

        draft = load_bundled_draft(target, cfg.init_draft)
        # Training scores the full vocabulary: the asset's head subset is a decoding speed-up.
        params = {k: v for k, v in draft.params.items() if k != models.HEAD_SUBSET}
        config, params = draft.config, jax.tree.map(np.asarray, params)
        if config.feature_input and not cfg.feature_draft:
            raise InvalidArgumentError(
                f"--init-draft {cfg.init_draft} is a feature draft: pass --feature-draft too")
        if cfg.feature_draft:  # a standalone draft becomes a feature draft computing it
            from specjax.checkpoints_tools.feature_draft import feature_draft_from_draft

            config, params = feature_draft_from_draft(config, params)
    if cfg.add_layers:
        config, params = grow_draft(config, params, target.config, target.params,
                                    cfg.add_layers)
    return config, params


# The parameters through which a Llama block writes to the residual stream.
_BLOCK_OUTPUTS = ("wo", "bo", "w_down", "b_down")


def grow_draft(config, params: dict, target_config, target_params: dict,
               target_layers: Sequence[int]):
    """(config, params) of a deeper draft: ``params``' blocks, then copies of the target
    blocks ``target_layers`` whose residual-stream outputs (``wo``, ``w_down`` and their
    biases) are zero. Each new block then adds exactly zero, so the grown draft computes
    exactly what the draft did, and training starts from it rather than from scratch (a
    3-4-layer draft that keeps what a trained 2-layer one learned)."""
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
        "embed", "lm_head", "position_embed", "draft_vocab")
    trainable = {k: v for k, v in params.items() if k not in frozen_keys}
    frozen = {k: v for k, v in params.items() if k in frozen_keys}
    return trainable, frozen


def make_steps(target_config, draft_config, cfg: TrainConfig, optimizer):
    """Jitted (train_step, eval_step) closures."""
    import jax
    import jax.numpy as jnp
    import optax

    if cfg.feature_draft:
        return make_feature_train_steps(target_config, draft_config, cfg, optimizer)
    if cfg.eagle3:
        from specjax.checkpoints_tools.eagle3 import make_eagle3_steps

        return make_eagle3_steps(target_config, draft_config, cfg.loss_config(), optimizer,
                                 cfg.compute_dtype)

    from specjax.flax_modules import LinenCausalLM

    def batched(params, config, windows):
        """Logits [B, T, V] of windows [B, T] through the Flax module a user's own
        pipeline trains (:mod:`specjax.flax_modules`): the same forward, the same tree."""
        return LinenCausalLM(config, attn_impl="reference").apply({"params": params},
                                                                  windows)[0]

    def loss_fn(trainable, frozen, target_params, windows):
        inputs, labels = windows[:, :-1], windows[:, 1:]
        q_logits = batched(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                           draft_config, inputs)
        log_q = jax.nn.log_softmax(q_logits, axis=-1)
        terms = {}
        if cfg.loss in ("ce", "ce+kl"):
            terms["ce"] = -jnp.mean(jnp.take_along_axis(log_q, labels[..., None], -1))
        if cfg.loss != "ce":
            p_logits = jax.lax.stop_gradient(batched(target_params, target_config, inputs))
            log_p = jax.nn.log_softmax(p_logits, axis=-1)
            p = jnp.exp(log_p)
            if cfg.loss == "tvd":
                terms["tvd"] = 0.5 * jnp.mean(jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1))
            else:
                terms["kl"] = jnp.mean(jnp.sum(p * (log_p - log_q), axis=-1))
            agree = jnp.mean(jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1))
        else:
            agree = jnp.mean(jnp.argmax(q_logits, -1) == labels)
        total = sum(terms.values())
        return total, {**terms, "agreement": agree}

    @jax.jit
    def train_step(trainable, opt_state, frozen, target_params, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, target_params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, loss, aux

    @jax.jit
    def eval_step(trainable, frozen, target_params, windows):
        """(top-1 agreement, KL(p || q)) on held-out windows."""
        inputs = windows[:, :-1]
        q = batched(cast_floats({**trainable, **frozen}, cfg.compute_dtype), draft_config,
                    inputs)
        p = batched(target_params, target_config, inputs)
        log_p, log_q = jax.nn.log_softmax(p, -1), jax.nn.log_softmax(q, -1)
        kl = jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))
        return jnp.mean(jnp.argmax(p, -1) == jnp.argmax(q, -1)), kl

    return train_step, eval_step


def make_feature_train_steps(target_config, draft_config, cfg: TrainConfig, optimizer):
    """:func:`make_steps` for a feature draft: the same signatures, the target's features
    from the frozen target pass, :func:`~specjax.checkpoints_tools.feature_draft.
    feature_loss` over the full head; evaluation reports depth-1 agreement and KL."""
    import jax
    import jax.numpy as jnp
    import optax

    from specjax.checkpoints_tools import feature_draft as fd

    loss_cfg = fd.FeatureLossConfig(noise=cfg.feature_noise, unroll=cfg.feature_unroll,
                                    feature_weight=cfg.feature_weight)
    plain = dataclasses.replace(loss_cfg, noise=0.0, unroll=1)
    base_key = jax.random.PRNGKey(cfg.seed)

    def inputs(frozen, target_params, windows):
        windows = windows[:, :-1]
        features = jax.lax.stop_gradient(
            fd.target_features(target_params, target_config, windows))
        return windows, features, fd.head_rows(frozen, draft_config, None)

    def loss_fn(trainable, frozen, target_params, windows):
        # Noise drawn per batch (the key follows the batch's tokens: reruns repeat it).
        key = jax.random.fold_in(base_key, jnp.sum(windows))
        windows, features, rows = inputs(frozen, target_params, windows)
        return fd.feature_loss(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                               draft_config, windows, features, rows, loss_cfg, key)

    @jax.jit
    def train_step(trainable, opt_state, frozen, target_params, windows):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, target_params, windows)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, aux

    @jax.jit
    def eval_step(trainable, frozen, target_params, windows):
        """(depth-1 top-1 agreement, KL(p || q)) on held-out windows."""
        windows, features, rows = inputs(frozen, target_params, windows)
        metrics = fd.feature_loss(cast_floats({**trainable, **frozen}, cfg.compute_dtype),
                                  draft_config, windows, features, rows, plain, base_key)[1]
        return metrics["agreement"], metrics["kl"]

    return train_step, eval_step


def learning_rate(cfg: TrainConfig, step: int, clock: float = 0.0) -> float:
    """The learning rate of step ``step`` (0-based) of an EAGLE-3 run: linear warm-up over
    ``warmup_steps``, then a cosine from ``learning_rate`` down to a tenth of it over the
    run's progress, the larger of ``step / steps`` and ``clock`` (the fraction of a time
    budget spent; 0 without one)."""
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    if step < warmup:
        return cfg.learning_rate * step / max(warmup, 1)
    progress = max((step - warmup) / max(cfg.steps - warmup, 1), clock)
    progress = min(max(progress, 0.0), 1.0)
    return cfg.learning_rate * (0.1 + 0.45 * (1.0 + np.cos(np.pi * progress)))


def set_learning_rate(opt_state, value: float):
    """``opt_state`` of :func:`make_optimizer` for an EAGLE-3 run, its learning rate set
    to ``value`` (an input of the jitted step, so a new value does not recompile)."""
    import jax.numpy as jnp

    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(value, jnp.float32)
    return opt_state


def _clock_fraction(began: float, deadline: float | None) -> float:
    """The fraction of the time from ``began`` to ``deadline`` (both ``time.monotonic``)
    spent so far; 0 without a deadline."""
    if deadline is None:
        return 0.0
    return (time.monotonic() - began) / max(deadline - began, 1e-9)


def _add_prior_corpus(path, train: np.ndarray, held: np.ndarray, vocab_size: int):
    """(train, held) with the streams of the ``target_corpus.npz`` at ``path`` appended."""
    try:
        with np.load(path) as data:
            prior_train, prior_held = data["train"], data["heldout"]
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgumentError(f"prior target corpus {path} is not a target_corpus.npz "
                                   f"with train and heldout streams ({e})") from None
    for stream in (prior_train, prior_held):
        if stream.ndim != 1 or stream.size == 0 or stream.min() < 0 or stream.max() >= vocab_size:
            raise InvalidArgumentError(f"prior target corpus {path} holds ids outside the "
                                       f"target's vocabulary of {vocab_size}")
    return (np.concatenate([train, prior_train.astype(np.int32)]),
            np.concatenate([held, prior_held.astype(np.int32)]))


def make_optimizer(cfg: TrainConfig):
    import optax

    if cfg.eagle3:  # the rate is set before each step (learning_rate, set_learning_rate)
        adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=cfg.learning_rate,
                                                      weight_decay=cfg.weight_decay)
        return optax.chain(optax.clip_by_global_norm(1.0), adamw)
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup, max(cfg.steps, warmup + 1),
        end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay))


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch: int,
                   length: int) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens from ``stream``."""
    if stream.size < length + 1:
        raise InvalidArgumentError(
            f"corpus split has {stream.size} tokens, fewer than one window of {length + 1}")
    starts = rng.integers(0, stream.size - length, batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def mixed_windows(stream: np.ndarray, target_stream: np.ndarray | None,
                  rng: np.random.Generator, batch: int, length: int,
                  num_target: int) -> np.ndarray:
    """A batch of ``batch`` windows: the last ``num_target`` from ``target_stream`` (the
    target's generations), the others from ``stream`` (the file corpus)."""
    parts = []
    if num_target < batch:
        parts.append(sample_windows(stream, rng, batch - num_target, length))
    if num_target:
        parts.append(sample_windows(target_stream, rng, num_target, length))
    return np.concatenate(parts)


# ----------------------------------------------------------------------------- driver


def train_draft(target: Any, out: str | os.PathLike, cfg: TrainConfig, *,
                corpus_files: Sequence[Path] | None = None, export_hf: bool = False,
                progress: bool = False, log=print, time_budget: float | None = None,
                prior_target_corpora: Sequence[str | os.PathLike] = ()) -> dict:
    """Trains (or resumes training) a draft for ``target`` into ``out``.

    Args:
      target: a :class:`specjax.Model` with a tokenizer.
      out: output directory (see the module docstring); reused to resume.
      cfg: training knobs.
      corpus_files: text files; ``None`` means the standard library's sources.
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
    Returns:
      A summary dict (steps done, final held-out agreement, seconds, paths;
      ``stopped_by_time_budget`` when the budget ended it).
    Raises:
      KeyboardInterrupt: Ctrl-C. The run stops at once, except that a checkpoint or file
        being written is finished first; nothing half-written is left, ``draft`` (and
        ``draft-hf``) appear only with the run complete, and a rerun resumes.
    """
    with interrupts.guard() as interrupt:
        return _train(target, out, cfg, corpus_files, export_hf, progress, log, interrupt,
                      time_budget, tuple(prior_target_corpora))


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


def draft_vocabulary(out: Path, cfg: "TrainConfig", vocab_size: int,
                     generated: np.ndarray | None = None):
    """(ids, description) of an EAGLE-3 draft's vocabulary: the ``cfg.draft_vocab`` most
    frequent ids of the run's training mix (:func:`_head_subset`; ``generated``: the
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
    ids, description = _head_subset(out, cfg, cfg.draft_vocab, vocab_size, generated)
    with open(kept.with_suffix(".tmp"), "wb") as f:
        np.save(f, np.asarray(ids, np.int32))
    os.replace(kept.with_suffix(".tmp"), kept)
    return ids, description


def _start_run(target: Any, out: str | os.PathLike, cfg: TrainConfig, export_hf: bool,
               prior_target_corpora: tuple) -> Path:
    """Checks the request and claims ``out`` for it (its ``train_config.json``); refuses a
    folder that holds a run with other settings."""
    if target.tokenizer is None:
        raise InvalidArgumentError(f"target {target.name} has no tokenizer to read the corpus")
    if target.config.architecture != "llama":
        raise InvalidArgumentError("train-draft makes Llama-family drafts; the target is "
                                   f"{target.config.architecture}")
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


def _corpora(target: Any, out: Path, cfg: TrainConfig, corpus_files, prior_target_corpora,
             interrupt: interrupts.Interrupt, log, progress: bool):
    """(train, held-out, target train, target held-out) streams of a run: the file corpus
    (tokenized once into ``out/corpus.npz``) and, with ``cfg.target_corpus_tokens``, the
    target's own text (written once into ``out/target_corpus.npz``) plus prior corpora;
    ``None`` for the target's streams otherwise."""

    def corpus_file_list() -> list[Path]:
        files = stdlib_files() if corpus_files is None else [Path(f) for f in corpus_files]
        for f in files:
            if not f.is_file():
                raise InvalidArgumentError(f"corpus file {f} does not exist")
        return files

    separator = (target.config.eos_token_ids or (0,))[0]
    corpus_path = out / "corpus.npz"
    if corpus_path.exists():
        with np.load(corpus_path) as data:
            train, held = data["train"], data["heldout"]
    else:
        train, held = tokenize_corpus(corpus_file_list(), target.tokenizer,
                                      max_tokens=cfg.max_corpus_tokens,
                                      heldout_fraction=cfg.heldout_fraction,
                                      separator=separator, progress=progress)
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
        target_train, target_held, info = generate_target_corpus(
            target, corpus_file_list(), cfg, separator=separator, log=log, progress=progress)
        _save_npz(target_path, interrupt, train=target_train, heldout=target_held,
                  info=np.frombuffer(json.dumps(info).encode(), np.uint8))
        log(f"target corpus: {info['seconds']} s, {info['generated_tokens_per_s']} "
            "generated tokens/s")
    for prior in prior_target_corpora:
        target_train, target_held = _add_prior_corpus(prior, target_train, target_held,
                                                      target.config.vocab_size)
        log(f"target corpus: added the text of {prior}")
    log(f"target corpus: {target_train.size} training tokens, {target_held.size} "
        "held-out tokens")
    return train, held, target_train, target_held


def _train(target: Any, out: str | os.PathLike, cfg: TrainConfig,
           corpus_files: Sequence[Path] | None, export_hf: bool, progress: bool, log,
           interrupt: interrupts.Interrupt, time_budget: float | None = None,
           prior_target_corpora: tuple = ()) -> dict:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    started = time.monotonic()
    out = _start_run(target, out, cfg, export_hf, prior_target_corpora)
    train, held, target_train, target_held = _corpora(
        target, out, cfg, corpus_files, prior_target_corpora, interrupt, log, progress)

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
        evaluate_all = _evaluator(eval_step, frozen, target_params, cfg, held, target_held)
        num_target = 0 if target_train is None else int(
            round(cfg.target_corpus_fraction * cfg.batch_size))

        def batch_windows(rng):
            return mixed_windows(train, target_train, rng, cfg.batch_size, cfg.seq_len + 1,
                                 num_target)

        log_file = stack.enter_context((out / "train_log.jsonl").open("a"))
        if start == 0:  # where the draft starts from
            entry = evaluate_all(trainable)
            log_file.write(json.dumps({"step": 0, **entry, "time": time.time()}) + "\n")
            log(f"step 0: {_describe(entry)}, KL {entry['heldout_kl']:.4f}")
        rng = np.random.default_rng(cfg.seed + start)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=cfg.steps, initial=start, desc="train-draft",
                                           unit="step"))
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
    if out_of_time:
        summary["stopped_by_time_budget"] = True
    if export_hf:
        summary["draft_hf"] = str(out / "draft-hf")
    params = jax.tree.map(np.asarray, {**trainable, **frozen})
    with interrupt.deferred():
        _export(out, draft_config, params, target.tokenizer, export_hf, summary, interrupt)
    return summary


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


def _evaluator(eval_step, frozen, target_params, cfg: TrainConfig, held, target_held):
    """``evaluate(params) -> entry``: agreement and KL (per depth for EAGLE-3 drafts) on
    fixed held-out windows of the file corpus (``heldout_*``) and of the target's own text
    (``heldout_target_*``, when there is one)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(cfg.seed + 1)
    windows = {"heldout": sample_windows(held, rng, cfg.eval_windows, cfg.seq_len + 1)}
    if target_held is not None:
        windows["heldout_target"] = sample_windows(target_held, rng, cfg.eval_windows,
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
    from specjax.checkpoints_tools.hf import save_hf_directory
    from specjax.checkpoints_tools.orbax_io import save_orbax

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


def _head_subset(out: Path, cfg: "TrainConfig", k: int, vocab_size: int,
                 generated: np.ndarray | None = None):
    """(ids, description) of the ``k`` most frequent tokens of the run's training mix: the
    file corpus alone, or with ``--corpus-from-target`` the file corpus and the target's
    generations weighted by the windows each gives a batch (the draft must cover what the
    target writes, and a draft never proposes a token outside its head)."""
    from specjax.checkpoints_tools.sources import frequent_tokens

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


def export_latest(target: Any, out: str | os.PathLike, asset_dir: str | os.PathLike | None = None,
                  *, note: str = "", head_tokens: int | None = None) -> dict:
    """Writes the latest saved training state of ``out`` as ``out/draft`` (and, with
    ``asset_dir``, as a shipped asset: :func:`~specjax.checkpoints_tools.sources.save_draft_asset`).

    Lets a long run be used before it ends (or after it was stopped). ``head_tokens`` K
    gives the asset a head restricted to the K most frequent tokens of the run's training
    mix (:func:`_head_subset`, :func:`~specjax.checkpoints_tools.sources.frequent_tokens`).
    """
    import jax
    import orbax.checkpoint as ocp

    from specjax.checkpoints_tools.sources import save_draft_asset

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
            subset, provenance["head_tokens_source"] = _head_subset(out, cfg, head_tokens,
                                                                    target.config.vocab_size)
        # Ctrl-C waits for the asset's files (then raises): none is left half-written.
        with interrupts.guard() as interrupt, interrupt.deferred():
            save_draft_asset(asset_dir, target.config, params, target.params["embed"],
                             provenance, head_tokens=subset,
                             feature_layers=draft_config.feature_layers)
        summary["asset"] = str(asset_dir)
    return summary


def _layer_list(text: str | None, flag: str):
    """``"1,14,26"`` -> ``(1, 14, 26)``; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes comma-separated integers, got {text!r}") \
            from None


def main(args) -> int:
    """Entry point of ``specjax train-draft`` (``args`` from the CLI parser)."""
    import specjax

    init_layers = args.init_layers or ("0" if args.eagle3 else "0,1")
    cfg = TrainConfig(init_layers=_layer_list(init_layers, "--init-layers"),
                      loss=args.loss, steps=args.steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, learning_rate=args.learning_rate,
                      warmup_steps=args.warmup_steps, train_embeddings=args.train_embeddings,
                      seed=args.seed, eval_every=args.eval_every,
                      eval_windows=args.eval_windows,
                      checkpoint_every=args.checkpoint_every,
                      max_corpus_tokens=args.max_corpus_tokens,
                      target_corpus_tokens=args.corpus_from_target or 0,
                      **{name: value for name, value in (
                          ("target_corpus_fraction", args.target_corpus_fraction),
                          ("target_temperature", args.target_temperature),
                          ("target_gen_len", args.target_gen_len),
                          ("target_batch_size", args.target_batch_size),
                          ("target_greedy_fraction", args.target_greedy_fraction),
                          ("target_chat_fraction", args.target_chat_fraction),
                          ("target_gen_seconds", args.target_gen_seconds))
                         if value is not None},
                      compute_dtype=args.compute_dtype,
                      init_draft=(str(Path(args.init_draft).expanduser().absolute())
                                  if args.init_draft else None),
                      add_layers=tuple(int(x) for x in args.add_layers.split(","))
                      if args.add_layers else (),
                      feature_draft=args.feature_draft,
                      **{name: value for name, value in (
                          ("feature_noise", args.feature_noise),
                          ("feature_unroll", args.feature_unroll),
                          ("feature_weight", args.feature_weight)) if value is not None},
                      eagle3=args.eagle3,
                      **{name: value for name, value in (
                          ("feature_layers", _layer_list(args.feature_layers, "--feature-layers")),
                          ("draft_vocab", args.draft_vocab), ("unroll", args.unroll),
                          ("unroll_decay", args.unroll_decay),
                          ("acceptance_weight", args.acceptance_weight)) if value is not None})
    if not args.feature_draft:
        given = [f"--{name.replace('_', '-')}" for name in _FEATURE_FIELDS[1:]
                 if getattr(args, name) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with --feature-draft")
    if not args.eagle3:
        given = [f"--{name.replace('_', '-')}" for name in _EAGLE3_FIELDS[1:]
                 if getattr(args, name) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with --eagle3")
    if args.time_budget is not None and not args.time_budget > 0:
        raise InvalidArgumentError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if not args.corpus_from_target:
        given = [f"--{name.replace('_', '-')}" for name in _TARGET_CORPUS_FIELDS[1:]
                 if getattr(args, name) is not None]
        if args.target_gen_seconds is not None:
            given.append("--target-gen-seconds")
        if args.prior_target_corpus:
            given.append("--prior-target-corpus")
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with "
                                       "--corpus-from-target N")
    if args.head_tokens is not None and not args.asset:
        raise InvalidArgumentError("--head-tokens needs --asset DIR")
    progress = sys.stderr.isatty()
    # The outcome is decided when the draft is in place, or with --asset when the asset is
    # written too (a Ctrl-C in the instant between the two is reported, the asset complete).
    with interrupts.command("specjax: interrupted",
                            finish_on_completed=not args.asset) as on_interrupt:
        # Loading writes nothing: Ctrl-C may end the process at once.
        target = specjax.load(args.target, progress=progress)
        on_interrupt.exit_at_once = False  # orbax's threads may be writing from here on
        summary = train_draft(target, args.out, cfg, corpus_files=args.corpus or None,
                              export_hf=args.export_hf, progress=progress,
                              log=lambda msg: print(msg, file=sys.stderr, flush=True),
                              time_budget=args.time_budget,
                              prior_target_corpora=args.prior_target_corpus or ())
        if args.asset:
            summary.update(export_latest(target, args.out, args.asset,
                                         head_tokens=args.head_tokens, note=args.note))
            on_interrupt.finished()
        print(json.dumps(summary))
    return 0


def add_parser(subparsers) -> None:
    """Registers ``train-draft`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "train-draft", help="distil a small draft model from a target (optax, resumable)",
        description="Distil a Llama-family draft from TARGET into OUT (resumable; see "
                    "specjax.checkpoints_tools.train_draft).")
    p.add_argument("out", help="output directory (reused to resume)")
    p.add_argument("--target", default="smollm2-135m", help="target model name or path")
    p.add_argument("--corpus", nargs="*", default=None,
                   help="text files to train on (default: the Python standard library source)")
    p.add_argument("--init-layers", default=None,
                   help="comma-separated target blocks the draft starts from (default 0,1; "
                        "0 for --eagle3)")
    p.add_argument("--loss", default="kl", choices=LOSSES)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--train-embeddings", action="store_true",
                   help="also train the (tied) embedding; by default it stays the target's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16,
                   help="held-out windows (of --seq-len) agreement is measured on")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--max-corpus-tokens", type=int, default=20_000_000)
    p.add_argument("--init-draft", default=None, metavar="ASSET",
                   help="start from this draft asset (specjax train-draft --asset) instead "
                        "of the target blocks --init-layers")
    p.add_argument("--add-layers", default=None, metavar="LAYERS",
                   help="grow the starting draft by these target blocks (comma-separated), "
                        "their output projections zeroed: the grown draft starts out "
                        "computing exactly the starting draft (a deeper draft that keeps "
                        "what --init-draft learned)")
    f = p.add_argument_group(
        "feature drafts", "EAGLE-style drafts that read the target's hidden states (see "
        "specjax.checkpoints_tools.feature_draft); decode with method spec or tree")
    f.add_argument("--feature-draft", action="store_true",
                   help="train a feature draft (start it from one block: --init-layers 0)")
    f.add_argument("--feature-noise", type=float, default=None,
                   help="uniform noise added to the features it reads (default: 0.1)")
    f.add_argument("--feature-unroll", type=int, default=None, choices=(1, 2),
                   help="2 (default): also train on its own predictions (depth 2)")
    f.add_argument("--feature-weight", type=float, default=None,
                   help="weight of the feature-regression term against the KL (default: 1; "
                        "0.1 suits continuing a trained draft, --init-draft)")
    e = p.add_argument_group(
        "EAGLE-3 drafts", "a one-block draft reading several target blocks' outputs, with its "
        "own head over a reduced vocabulary, trained with the training-time test (see "
        "specjax.checkpoints_tools.eagle3); decode with method spec or tree")
    e.add_argument("--eagle3", action="store_true",
                   help="train an EAGLE-3 draft (its block starts from --init-layers, "
                        "default 0)")
    e.add_argument("--feature-layers", default=None, metavar="LAYERS",
                   help="target blocks it reads, comma-separated (default: 1, L/2-1, L-4)")
    e.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="ids its head scores: the K most frequent of the training mix "
                        "(default: 8192)")
    e.add_argument("--unroll", type=int, default=None,
                   help="training-time-test passes, each reading the previous one's outputs "
                        "(default: 4)")
    e.add_argument("--unroll-decay", type=float, default=None,
                   help="loss weight of pass i is DECAY**i (default: 0.8)")
    e.add_argument("--acceptance-weight", type=float, default=None,
                   help="weight of the acceptance objective 1 - sum min(p, q) (default: 0)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop training this many seconds after the run starts (corpus "
                        "generation and compilation included), save and export as if the "
                        "last step were reached; a rerun resumes")
    g = p.add_argument_group(
        "self-distillation", "train on text the target writes itself (see the module "
        "docstring of specjax.checkpoints_tools.train_draft)")
    g.add_argument("--corpus-from-target", type=int, default=None, metavar="N",
                   help="generate N tokens with the target from docstring prompts of the "
                        "corpus files (cached in OUT/target_corpus.npz) and mix them in")
    g.add_argument("--target-corpus-fraction", type=float, default=None,
                   help="fraction of each batch's windows taken from the target's "
                        "generations (default: 0.5; 0: only measure agreement on them)")
    g.add_argument("--target-temperature", type=float, default=None,
                   help="sampling temperature of the generations (default: 1.0; 0: greedy)")
    g.add_argument("--target-gen-len", type=int, default=None,
                   help="tokens generated per prompt (default: 256)")
    g.add_argument("--target-greedy-fraction", type=float, default=None,
                   help="fraction of the generations written greedily, the rest at "
                        "--target-temperature (default: 0)")
    g.add_argument("--target-batch-size", type=int, default=None,
                   help="generations run at once (default: 16)")
    g.add_argument("--target-chat-fraction", type=float, default=None,
                   help="fraction of the prompts asked through the target's chat template "
                        "(a request to complete the function), so that chat users' text is "
                        "in the mix too (default: 0)")
    g.add_argument("--target-gen-seconds", type=float, default=None, metavar="SECONDS",
                   help="stop writing the target's text after this many seconds (rows not "
                        "begun are left out; the held-out rows are written first)")
    g.add_argument("--prior-target-corpus", action="append", default=None, metavar="NPZ",
                   help="also train on the text of an earlier run's target_corpus.npz "
                        "(repeatable)")
    p.add_argument("--compute-dtype", default="float32", choices=COMPUTE_DTYPES,
                   help="dtype of the target's passes and of the draft's products (float32 "
                        "master weights either way; bfloat16 is several times faster on a "
                        "GPU or TPU)")
    p.add_argument("--export-hf", action="store_true",
                   help="also write OUT/draft-hf, loadable by transformers")
    p.add_argument("--asset", default=None, metavar="DIR",
                   help="also write the trained draft as a shippable asset into DIR "
                        "(draft.safetensors + draft.json, sharing the target's embedding)")
    p.add_argument("--head-tokens", type=int, default=None, metavar="K",
                   help="with --asset: restrict the draft's head to the K most frequent "
                        "tokens of the training mix (file corpus and, with "
                        "--corpus-from-target, the target's generations by their share of "
                        "a batch); faster draft passes, exactness unaffected")
    p.add_argument("--note", default="", help="with --asset: a note stored in draft.json")
    p.set_defaults(func=main)
