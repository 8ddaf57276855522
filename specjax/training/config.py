"""The settings of a draft-training run: :class:`TrainConfig`, one field per flag of
``specjax train-draft`` (:mod:`~specjax.commands.train_draft`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.errors import InvalidArgumentError
from specjax.training.eagle3 import OBJECTIVES, Eagle3LossConfig
from specjax.training.feature_draft import FeatureLossConfig

LOSSES = ("kl", "tvd", "lk", "ce", "ce+kl")
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
    # Self-distillation (specjax/commands/train_draft.py's docstring); recorded in
    # train_config.json only when used.
    target_corpus_tokens: int = 0
    target_corpus_fraction: float = 0.5
    target_temperature: float = 1.0
    target_gen_len: int = 256
    target_batch_size: int = 16
    target_greedy_fraction: float = 0.0  # recorded only when set
    target_chat_fraction: float = 0.0  # recorded only when set
    # On-policy text, the draft's rollouts (specjax/training/draft_corpus.py); recorded in
    # train_config.json only when used.
    draft_corpus_tokens: int = 0
    draft_corpus_fraction: float = 0.25
    rollout_draft: str | None = None  # the draft that writes them (a name or a path)
    rollout_temperature: float = 1.0
    rollout_len: int = 256
    rollout_depth: int = 0
    rollout_chat_fraction: float = 0.0  # of the prompts, as target_chat_fraction
    rollout_seconds: float | None = None  # no training row begun after this; recorded if set
    init_draft: str | None = None
    add_layers: tuple[int, ...] = ()
    # Feature drafts (specjax/commands/train_draft.py's docstring); recorded in
    # train_config.json only when used.
    feature_draft: bool = False
    feature_noise: float = 0.1
    feature_unroll: int = 2
    feature_weight: float = 1.0
    # EAGLE-3 drafts (specjax/commands/train_draft.py's docstring); recorded in
    # train_config.json only when used.
    eagle3: bool = False
    feature_layers: tuple[int, ...] | None = None  # None: eagle3.default_feature_layers
    draft_vocab: int = 8192
    unroll: int = 4
    unroll_decay: float = 0.8
    acceptance_weight: float = 0.0
    # The share of an EAGLE-3 run's learning-rate cosine already spent when warm-up ends
    # (steps.learning_rate): a run annealed by a time budget spent part of its clock
    # compiling, and this replays its schedule by step count. Recorded only when set.
    schedule_start: float = 0.0
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
        if not 0 <= self.schedule_start < 1:
            raise InvalidArgumentError(
                f"schedule_start must be in [0, 1), got {self.schedule_start}")
        if self.schedule_start and not self.eagle3:
            raise InvalidArgumentError("schedule_start (--schedule-start) shapes an EAGLE-3 "
                                       "run's learning rate: it needs --eagle3")
        if self.target_corpus_tokens < 0:
            raise InvalidArgumentError(
                f"target_corpus_tokens must be >= 0, got {self.target_corpus_tokens}")
        self._check_draft_corpus()
        if self.feature_draft:
            if self.loss != "kl":
                raise InvalidArgumentError(f"a feature draft trains on the target's "
                                           f"distributions (--loss kl), not {self.loss!r}")
            FeatureLossConfig(noise=self.feature_noise, unroll=self.feature_unroll,
                              feature_weight=self.feature_weight)
        if self.eagle3:
            if self.feature_draft or self.add_layers:
                raise InvalidArgumentError("an EAGLE-3 draft starts from the target's blocks "
                                           "--init-layers or from an EAGLE-3 asset "
                                           "--init-draft: --feature-draft and --add-layers "
                                           "do not apply")
            if self.loss not in OBJECTIVES:
                raise InvalidArgumentError(f"an EAGLE-3 draft trains on the target's "
                                           f"distributions: --loss one of {OBJECTIVES}, "
                                           f"not {self.loss!r}")
            self.loss_config()
            if self.draft_vocab < 1:
                raise InvalidArgumentError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
            if self.feature_layers is not None and (
                    not self.feature_layers or any(int(i) < 0 for i in self.feature_layers)):
                raise InvalidArgumentError(f"feature_layers must be target block indices "
                                           f">= 0, got {self.feature_layers!r}")
        if self.target_corpus_tokens or self.draft_corpus_tokens:
            # The rollouts are written as many rows at once as the target's text.
            if self.target_batch_size < 1:
                raise InvalidArgumentError(
                    f"target_batch_size must be >= 1, got {self.target_batch_size}")
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
            for name in ("target_gen_len",):
                if getattr(self, name) < 1:
                    raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")

    def _check_draft_corpus(self) -> None:
        """Refuses on-policy settings out of range (``--corpus-from-draft``)."""
        if self.draft_corpus_tokens < 0:
            raise InvalidArgumentError(
                f"draft_corpus_tokens must be >= 0, got {self.draft_corpus_tokens}")
        if not self.draft_corpus_tokens:
            return
        if not self.rollout_draft:
            raise InvalidArgumentError("--corpus-from-draft N needs the draft that writes "
                                       "the rollouts: --rollout-draft DRAFT (a shipped "
                                       "draft's name or a draft asset folder)")
        if not 0 <= self.draft_corpus_fraction <= 1:
            raise InvalidArgumentError("draft_corpus_fraction must be in [0, 1], got "
                                       f"{self.draft_corpus_fraction}")
        taken = (round(self.target_corpus_fraction * self.batch_size
                       * bool(self.target_corpus_tokens))
                 + round(self.draft_corpus_fraction * self.batch_size))
        if taken > self.batch_size:
            raise InvalidArgumentError(
                f"target_corpus_fraction {self.target_corpus_fraction} and "
                f"draft_corpus_fraction {self.draft_corpus_fraction} take {taken} of a "
                f"batch's {self.batch_size} windows: their sum must be at most 1")
        if not (self.rollout_temperature >= 0 and np.isfinite(self.rollout_temperature)):
            raise InvalidArgumentError("rollout_temperature must be a finite number >= 0, "
                                       f"got {self.rollout_temperature}")
        if not 0 <= self.rollout_chat_fraction <= 1:
            raise InvalidArgumentError("rollout_chat_fraction must be in [0, 1], got "
                                       f"{self.rollout_chat_fraction}")
        if self.rollout_len < 1:
            raise InvalidArgumentError(f"rollout_len must be >= 1, got {self.rollout_len}")
        if self.rollout_depth < 0:
            raise InvalidArgumentError(f"rollout_depth must be >= 0, got {self.rollout_depth}")
        if self.rollout_seconds is not None and not self.rollout_seconds > 0:
            raise InvalidArgumentError(f"rollout_seconds must be > 0, got {self.rollout_seconds}")

    def record(self) -> dict:
        """The settings as stored in ``train_config.json``: fields of features not used
        are left out, so runs made before those features existed still resume."""
        record = dataclasses.asdict(self)
        if not self.target_corpus_tokens:
            for name in TARGET_CORPUS_FIELDS:
                # The rollouts' prompts and batches are the target corpus's settings.
                if not (self.draft_corpus_tokens and name in ROLLOUT_SHARED_FIELDS):
                    record.pop(name)
        else:
            for name in ("target_greedy_fraction", "target_chat_fraction"):
                if not getattr(self, name):
                    record.pop(name)
        if not self.draft_corpus_tokens:
            for name in DRAFT_CORPUS_FIELDS:
                record.pop(name)
        elif self.rollout_seconds is None:
            record.pop("rollout_seconds")
        if self.init_draft is None:
            record.pop("init_draft")
        if not self.add_layers:
            record.pop("add_layers")
        if not self.feature_draft:
            for name in FEATURE_FIELDS:
                record.pop(name)
        if not self.eagle3:
            for name in EAGLE3_FIELDS:
                record.pop(name)
        if self.compute_dtype == "float32":
            record.pop("compute_dtype")
        if self.target_gen_seconds is None:
            record.pop("target_gen_seconds")
        if not self.schedule_start:
            record.pop("schedule_start")
        return record

    def loss_config(self):
        """The :class:`~specjax.training.eagle3.Eagle3LossConfig` of an EAGLE-3 run."""
        return Eagle3LossConfig(unroll=self.unroll, decay=self.unroll_decay,
                                acceptance_weight=self.acceptance_weight, objective=self.loss)


FEATURE_FIELDS = ("feature_draft", "feature_noise", "feature_unroll", "feature_weight")
EAGLE3_FIELDS = ("eagle3", "feature_layers", "draft_vocab", "unroll", "unroll_decay",
                  "acceptance_weight")
TARGET_CORPUS_FIELDS = ("target_corpus_tokens", "target_corpus_fraction",
                         "target_temperature", "target_gen_len", "target_batch_size",
                         "target_greedy_fraction", "target_chat_fraction")
DRAFT_CORPUS_FIELDS = ("draft_corpus_tokens", "draft_corpus_fraction", "rollout_draft",
                       "rollout_temperature", "rollout_len", "rollout_depth",
                       "rollout_chat_fraction",
                       "rollout_seconds")
# The target corpus's settings that the draft's rollouts use too (without it as well).
ROLLOUT_SHARED_FIELDS = ("target_batch_size",)
