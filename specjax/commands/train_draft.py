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
(:mod:`~specjax.training.sample_corpus`: batched rows under ``jax.vmap``, one
jitted program, seed varied per row, temperature ``--target-temperature``, rows of
``--target-gen-len`` tokens cut at the end-of-text token) from HumanEval-shaped prompts:
the signature and docstring of functions found in the training files
(:func:`~specjax.training.sample_corpus.docstring_prompts`), never HumanEval's
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

On-policy text (``--corpus-from-draft N --rollout-draft DRAFT``;
:mod:`~specjax.training.draft_corpus`): the draft's own rollouts, as on-policy distillation
trains a draft on what it writes (DistillSpec). The draft continues the prompts the
target's text is drawn from (the same rows and seeds per row; ``--rollout-chat-fraction``
of them through the chat template) for ``--rollout-len`` tokens at
``--rollout-temperature``; a feature draft reads the target's features for the prompt, then
its own states (``--rollout-depth D``: chains of D that the target reads before the next).
Only the tokens are stored: each step's frozen target pass computes the target's
distributions over them, as over any text. ``--draft-corpus-fraction`` of each batch's
windows come from them (with ``--target-corpus-fraction``, at most 1 in all), and held-out
rollouts give ``heldout_draft_agreement``. The rollouts are cached in ``draft_corpus.npz``;
``--corpora-only`` writes the corpora and stops, so that they are made on one machine (a
CPU) and copied into the ``OUT`` of a run on another (a GPU window, which then only
trains): a run reuses the file it finds if it was made with the run's rollout settings,
and refuses it otherwise.

Feature drafts (``--feature-draft``; EAGLE-style, see
:mod:`~specjax.training.feature_draft`): the draft reads the target's features as
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

EAGLE-3 drafts (``--eagle3``; :mod:`~specjax.training.eagle3`): one block (from the target
block ``--init-layers``, default 0) reading the outputs of target blocks
``--feature-layers`` (default 1, L/2-1, L-4), fused, with a head of its own over the
``--draft-vocab`` ids most frequent in the training mix
(:func:`~specjax.training.drafts.draft_vocabulary`), trained with ``--unroll``
training-time-test passes weighted ``--unroll-decay ** i`` on the target's soft labels
(plus ``--acceptance-weight`` x the acceptance objective). The target's block outputs and
logits come from the frozen target pass inside each step. Held-out agreement is logged per
depth (``*_agreement_depth``, with ``*_acceptance_depth`` and ``*_kl_depth``). With
``--corpus-from-target N --target-corpus-fraction 1`` it trains on the target's own text
alone. ``--eagle3 --init-draft ASSET`` trains the EAGLE-3 draft asset of an earlier run
further (its blocks, fusion, head and id map; its feature layers and vocabulary size
become the run's), so that short GPU windows add up.

``--time-budget SECONDS`` stops training that long after the run starts (the corpora and
compilation included), saves a checkpoint and exports as if the last step were reached; a
rerun resumes from there. An EAGLE-3 run's learning rate then anneals by the clock if that
ends first; ``--schedule-start`` replays such a schedule by step count (``--steps`` the
steps the budgeted run made; see :func:`~specjax.training.steps.learning_rate`).

``--init-draft ASSET`` starts from a trained draft asset (e.g. continue the shipped draft
on the target's own text) instead of the target's blocks ``init_layers``.
``--add-layers 2,3`` grows the starting draft by copies of those target blocks with their
output projections zeroed (:func:`~specjax.training.drafts.grow_draft`): a 3-4-layer
draft that starts out equal to the 2-layer one and trains from there.

Output directory ``OUT``::

    train_state/     orbax CheckpointManager (step, trainable params, optimizer state);
                     a rerun with the same OUT resumes from the latest step
    corpus.npz       the tokenized corpus (train/held-out token streams), reused on resume
    target_corpus.npz  with --corpus-from-target: the target's generations (train/held-out)
    draft_corpus.npz   with --corpus-from-draft: the draft's rollouts (train/held-out, and
                     the settings they were made with)
    train_log.jsonl  one JSON object per logged step (loss, tokens/s, agreement)
    draft/           the final draft as a specjax (orbax) checkpoint with tokenizer
    draft-hf/        the same draft as a Hugging Face directory (with ``--export-hf``)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specjax import api
from specjax import interrupts
from specjax import loading
from specjax.errors import InvalidArgumentError
# The public names of draft training, importable from here as before the package split.
from specjax.training.config import (COMPUTE_DTYPES, DRAFT_CORPUS_FIELDS, EAGLE3_FIELDS,
                                     FEATURE_FIELDS, LOSSES, ROLLOUT_SHARED_FIELDS,
                                     TARGET_CORPUS_FIELDS, TrainConfig)
from specjax.training.corpus import mixed_windows, sample_windows, stdlib_files, tokenize_corpus
from specjax.training.drafts import (draft_from_target, draft_vocabulary, eagle3_asset_record,
                                     grow_draft, initial_draft, split_trainable)
from specjax.training.eagle3 import default_feature_layers
from specjax.training.export import export_latest
from specjax.training.loop import train_draft
from specjax.training.steps import (learning_rate, make_feature_train_steps, make_optimizer,
                                    make_steps, set_learning_rate)
from specjax.training.target_corpus import CHAT_REQUEST, generate_target_corpus

__all__ = [
    "CHAT_REQUEST", "COMPUTE_DTYPES", "LOSSES", "TrainConfig", "add_parser", "draft_from_target",
    "draft_vocabulary", "export_latest", "generate_target_corpus", "grow_draft",
    "initial_draft", "learning_rate", "main", "make_feature_train_steps", "make_optimizer",
    "make_steps", "mixed_windows", "sample_windows", "set_learning_rate", "split_trainable",
    "stdlib_files", "tokenize_corpus", "train_config", "train_draft",
]


def _layer_list(text: str | None, flag: str):
    """``"1,14,26"`` -> ``(1, 14, 26)``; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes comma-separated integers, got {text!r}") \
            from None


# The default --draft-vocab of an EAGLE-3 draft (at most the target's vocabulary).
DEFAULT_DRAFT_VOCAB = TrainConfig.draft_vocab


def default_init_layers(num_layers: int, eagle3: bool = False) -> tuple[int, ...]:
    """The target blocks a draft starts from when ``--init-layers`` is not given: the
    first two (``0,1``), one for an EAGLE-3 draft (``0``), and one for a target of two
    blocks or fewer (two would copy it whole)."""
    return (0,) if eagle3 or num_layers <= 2 else (0, 1)


def choose_defaults(args, target_config, log) -> None:
    """Fills the ``train-draft`` flags whose default depends on the target, once it is
    loaded, and says what each became (one ``log`` line each): ``--init-layers``, and for
    ``--eagle3`` ``--feature-layers`` (logged only: the run records them as the default
    rule, as runs always did) and ``--draft-vocab`` (at most the target's vocabulary).

    Args:
      args: the parsed arguments (changed in place).
      target_config: the target's :class:`~specjax.config.ModelConfig`.
      log: called with each line.
    """
    num, vocab = target_config.num_layers, target_config.vocab_size
    if args.init_layers is None and args.init_draft is None:
        layers = default_init_layers(num, args.eagle3)
        args.init_layers = ",".join(map(str, layers))
        whole = " (the whole target: it has one block)" if num == len(layers) else ""
        log(f"train-draft: --init-layers {args.init_layers}: the draft starts from target "
            f"block{'s' if len(layers) > 1 else ''} {args.init_layers} of {num}{whole}")
    if not args.eagle3:
        return
    if args.feature_layers is None:
        layers = default_feature_layers(num)
        log(f"train-draft: --feature-layers {','.join(map(str, layers))}: the default rule "
            f"1, L/2-1, L-4 for a {num}-layer target (clipped to its blocks, repeats dropped)")
    if args.draft_vocab is None:
        args.draft_vocab = min(DEFAULT_DRAFT_VOCAB, vocab)
        reason = (f"the default {DEFAULT_DRAFT_VOCAB}" if vocab >= DEFAULT_DRAFT_VOCAB else
                  f"the target's whole vocabulary (the default {DEFAULT_DRAFT_VOCAB} is larger)")
        log(f"train-draft: --draft-vocab {args.draft_vocab}: {reason}, of {vocab} ids")


def check_corpus_paths(paths) -> None:
    """Refuses a ``--corpus`` path that is not a file, before anything loads."""
    for path in paths or ():
        file = Path(path).expanduser()
        if file.is_dir():
            raise InvalidArgumentError(f"--corpus {path}: is a directory; give its files "
                                       f"(text, or .npy token ids)")
        if not file.is_file():
            raise InvalidArgumentError(f"--corpus {path}: no such file")


def train_config(args) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``train-draft`` arguments, as given: its
    ``record()`` is the run's ``train_config.json`` (:func:`main` first fills an EAGLE-3
    ``--init-draft``'s vocabulary size and feature layers from the asset when not given,
    and the defaults that depend on the target, :func:`choose_defaults`).

    Raises:
      InvalidArgumentError: a setting out of range, or a layer list that is not integers.
    """
    init_layers = args.init_layers or ("0" if args.eagle3 else "0,1")
    return TrainConfig(init_layers=_layer_list(init_layers, "--init-layers"),
                       loss=args.loss, steps=args.steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, learning_rate=args.learning_rate,
                       warmup_steps=args.warmup_steps, train_embeddings=args.train_embeddings,
                       seed=args.seed, eval_every=args.eval_every,
                       eval_windows=args.eval_windows,
                       checkpoint_every=args.checkpoint_every,
                       max_corpus_tokens=args.max_corpus_tokens,
                       target_corpus_tokens=args.corpus_from_target or 0,
                       draft_corpus_tokens=args.corpus_from_draft or 0,
                       rollout_draft=args.rollout_draft,
                       **{name: value for name, value in (
                           ("draft_corpus_fraction", args.draft_corpus_fraction),
                           ("rollout_temperature", args.rollout_temperature),
                           ("rollout_len", args.rollout_len),
                           ("rollout_depth", args.rollout_depth),
                           ("rollout_chat_fraction", args.rollout_chat_fraction),
                           ("rollout_seconds", args.rollout_seconds)) if value is not None},
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
                           ("acceptance_weight", args.acceptance_weight),
                           ("schedule_start", args.schedule_start)) if value is not None})


def main(args) -> int:
    """Entry point of ``specjax train-draft`` (``args`` from the CLI parser)."""
    if args.eagle3 and args.init_draft:
        # Training an EAGLE-3 draft further: it reads the blocks and scores the ids it was
        # trained on (given flags must agree: checked when the draft loads).
        record = eagle3_asset_record(Path(args.init_draft).expanduser())
        if args.draft_vocab is None:
            args.draft_vocab = int(record["draft_vocab_size"])
        if args.feature_layers is None:
            args.feature_layers = ",".join(str(int(i)) for i in record["feature_layers"])
    cfg = train_config(args)
    if not args.feature_draft:
        given = [f"--{name.replace('_', '-')}" for name in FEATURE_FIELDS[1:]
                 if getattr(args, name) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with --feature-draft")
    if not args.eagle3:
        given = [f"--{name.replace('_', '-')}" for name in EAGLE3_FIELDS[1:]
                 if getattr(args, name) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with --eagle3")
    if args.time_budget is not None and not args.time_budget > 0:
        raise InvalidArgumentError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if not args.corpus_from_target:
        given = [f"--{name.replace('_', '-')}" for name in TARGET_CORPUS_FIELDS[1:]
                 if getattr(args, name) is not None
                 and not (args.corpus_from_draft and name in ROLLOUT_SHARED_FIELDS)]
        if args.target_gen_seconds is not None:
            given.append("--target-gen-seconds")
        if args.prior_target_corpus:
            given.append("--prior-target-corpus")
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with "
                                       "--corpus-from-target N")
    if not args.corpus_from_draft:
        given = [f"--{name.replace('_', '-')}" for name in DRAFT_CORPUS_FIELDS[1:]
                 if getattr(args, name) is not None]
        if given:
            raise InvalidArgumentError(f"{', '.join(given)} only apply with "
                                       "--corpus-from-draft N")
    else:
        loading.check_draft_spec(args.rollout_draft)
    if args.corpora_only and (args.asset or args.export_hf):
        raise InvalidArgumentError("--corpora-only writes the corpora and stops: nothing to "
                                   "export (--asset, --export-hf)")
    if args.head_tokens is not None and not args.asset:
        raise InvalidArgumentError("--head-tokens needs --asset DIR")
    check_corpus_paths(args.corpus)
    for prior in args.prior_target_corpus or ():
        if not Path(prior).expanduser().is_file():
            raise InvalidArgumentError(f"--prior-target-corpus {prior}: no such file")
    progress = sys.stderr.isatty()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # The outcome is decided when the draft is in place, or with --asset when the asset is
    # written too (a Ctrl-C in the instant between the two is reported, the asset complete).
    with interrupts.command("specjax: interrupted",
                            finish_on_completed=not args.asset) as on_interrupt:
        # Loading writes nothing: Ctrl-C may end the process at once.
        target = api.load(args.target, progress=progress)
        choose_defaults(args, target.config, log)
        cfg = train_config(args)
        rollout_draft = None
        if cfg.draft_corpus_tokens and not (Path(args.out) / "draft_corpus.npz").exists():
            rollout_draft = loading.resolve_draft(target, cfg.rollout_draft, progress=progress)
        on_interrupt.exit_at_once = False  # orbax's threads may be writing from here on
        summary = train_draft(target, args.out, cfg, corpus_files=args.corpus or None,
                              export_hf=args.export_hf, progress=progress, log=log,
                              time_budget=args.time_budget,
                              prior_target_corpora=args.prior_target_corpus or (),
                              rollout_draft=rollout_draft, corpora_only=args.corpora_only)
        if args.asset and not args.corpora_only:
            summary.update(export_latest(target, args.out, args.asset,
                                         head_tokens=args.head_tokens, note=args.note))
            on_interrupt.finished()
        print(json.dumps(summary))
    return 0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help with each option's default, where its help does not state it already: the
    value, or ``none`` for an option that is off unless given (flags say nothing)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if ("(default" in text or not action.option_strings
                or any(action.default is value for value in (False, argparse.SUPPRESS))):
            return text
        if action.default is None or action.default == "":
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def add_parser(subparsers) -> None:
    """Registers ``train-draft`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "train-draft", help="distil a small draft model from a target (optax, resumable)",
        description="Distil a Llama-family draft from TARGET into OUT (resumable; see "
                    "specjax.commands.train_draft). Defaults that depend on the target "
                    "(--init-layers, and with --eagle3 --feature-layers and --draft-vocab) "
                    "are chosen once it loads, one stderr line each.",
        formatter_class=_DefaultsFormatter)
    p.add_argument("out", help="output directory (reused to resume; one that a failed run "
                               "created is removed unless a checkpoint was saved)")
    p.add_argument("--target", default="smollm2-135m", help="target model name or path")
    p.add_argument("--corpus", nargs="*", default=None, metavar="FILE",
                   help="text files to train on, and/or .npy token files (1-D or 2-D integer "
                        "arrays: token ids, for a target without a tokenizer; their last "
                        "2%% is held out) (default: the Python standard library source)")
    p.add_argument("--init-layers", default=None,
                   help="comma-separated target blocks the draft starts from (default: 0,1; "
                        "0 for --eagle3 or a target of 2 blocks or fewer)")
    p.add_argument("--loss", default="kl", choices=LOSSES,
                   help="kl: distil the target's distributions; tvd: total variation (1 - "
                        "the acceptance rate at T=1); lk: -log of that acceptance rate; ce: "
                        "next-token cross-entropy on the text (no teacher pass); ce+kl: both "
                        "(--eagle3: kl, tvd or lk; --feature-draft: kl)")
    p.add_argument("--steps", type=int, default=2000, help="training steps")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="peak learning rate (AdamW, cosine decay after warm-up)")
    p.add_argument("--warmup-steps", type=int, default=50,
                   help="steps of linear learning-rate warm-up")
    p.add_argument("--train-embeddings", action="store_true",
                   help="also train the (tied) embedding; by default it stays the target's")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the window sampling (and of the target's generations)")
    p.add_argument("--eval-every", type=int, default=100,
                   help="steps between held-out evaluations (logged to train_log.jsonl)")
    p.add_argument("--eval-windows", type=int, default=16,
                   help="held-out windows (of --seq-len) agreement is measured on")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="steps between checkpoints (a rerun resumes from the latest)")
    p.add_argument("--max-corpus-tokens", type=int, default=20_000_000,
                   help="stop reading corpus files once this many tokens are read")
    p.add_argument("--init-draft", default=None, metavar="ASSET",
                   help="start from this draft asset (specjax train-draft --asset) instead "
                        "of the target blocks --init-layers; with --eagle3, an EAGLE-3 "
                        "asset trained further")
    p.add_argument("--add-layers", default=None, metavar="LAYERS",
                   help="grow the starting draft by these target blocks (comma-separated), "
                        "their output projections zeroed: the grown draft starts out "
                        "computing exactly the starting draft (a deeper draft that keeps "
                        "what --init-draft learned)")
    _add_draft_kind_arguments(p)
    _add_self_distillation_arguments(p)
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


def _add_draft_kind_arguments(p) -> None:
    """``train-draft``'s feature-draft and EAGLE-3 options (and the time budget)."""
    f = p.add_argument_group(
        "feature drafts", "EAGLE-style drafts that read the target's hidden states (see "
        "specjax.training.feature_draft); decode with method spec or tree")
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
        "specjax.training.eagle3); decode with method spec or tree")
    e.add_argument("--eagle3", action="store_true",
                   help="train an EAGLE-3 draft (its block starts from --init-layers, "
                        "default 0)")
    e.add_argument("--feature-layers", default=None, metavar="LAYERS",
                   help="target blocks it reads, comma-separated (default: 1, L/2-1, L-4)")
    e.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                   help="ids its head scores: the K most frequent of the training mix "
                        f"(default: {DEFAULT_DRAFT_VOCAB}, or the target's vocabulary if "
                        "smaller)")
    e.add_argument("--unroll", type=int, default=None,
                   help="training-time-test passes, each reading the previous one's outputs "
                        "(default: 4)")
    e.add_argument("--unroll-decay", type=float, default=None,
                   help="loss weight of pass i is DECAY**i (default: 0.8)")
    e.add_argument("--acceptance-weight", type=float, default=None,
                   help="weight of the acceptance objective 1 - sum min(p, q) (default: 0)")
    e.add_argument("--schedule-start", type=float, default=None, metavar="FRACTION",
                   help="the share of the learning rate's cosine already spent when warm-up "
                        "ends (default: 0): replays by step count a --time-budget run, whose "
                        "schedule followed a clock that ran on while it compiled")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop training this many seconds after the run starts (corpus "
                        "generation and compilation included), save and export as if the "
                        "last step were reached; a rerun resumes")


def _add_self_distillation_arguments(p) -> None:
    """``train-draft``'s options for training on the target's own text."""
    g = p.add_argument_group(
        "self-distillation", "train on text the target writes itself (see the module "
        "docstring of specjax.commands.train_draft)")
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
                   help="generations run at once, the target's and the draft's rollouts "
                        "(default: 16)")
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
    o = p.add_argument_group(
        "on-policy text", "train on the draft's own rollouts, the target's distributions "
        "computed over them in each step (see specjax.training.draft_corpus)")
    o.add_argument("--corpus-from-draft", type=int, default=None, metavar="N",
                   help="the draft --rollout-draft writes N tokens after the prompts of "
                        "--corpus-from-target (the same rows, seeds and chat share; cached in "
                        "OUT/draft_corpus.npz) and they are mixed in")
    o.add_argument("--rollout-draft", default=None, metavar="DRAFT",
                   help="the draft that writes them: a shipped draft's name (e.g. "
                        "smollm2-135m-draft) or a draft asset folder")
    o.add_argument("--draft-corpus-fraction", type=float, default=None,
                   help="fraction of each batch's windows taken from the rollouts (default: "
                        "0.25; with --target-corpus-fraction at most 1 in all)")
    o.add_argument("--rollout-temperature", type=float, default=None,
                   help="the draft's sampling temperature (default: 1.0; 0: greedy)")
    o.add_argument("--rollout-len", type=int, default=None,
                   help="tokens the draft writes per prompt (default: 256)")
    o.add_argument("--rollout-depth", type=int, default=None, metavar="D",
                   help="a feature draft writes chains of D tokens, the target reading each "
                        "chain before the next, as decoding with every proposal accepted "
                        "(default: 0, one chain: the draft on its own states after the "
                        "prompt)")
    o.add_argument("--rollout-chat-fraction", type=float, default=None,
                   help="fraction of the prompts asked through the target's chat template, "
                        "spread over the rows as --target-chat-fraction is (default: 0)")
    o.add_argument("--rollout-seconds", type=float, default=None, metavar="SECONDS",
                   help="stop writing rollouts after this many seconds (rows not begun are "
                        "left out; the held-out rows are written first)")
    o.add_argument("--corpora-only", action="store_true",
                   help="write OUT's corpora (corpus.npz, target_corpus.npz, "
                        "draft_corpus.npz) and stop before training: make the text on one "
                        "machine, copy the files into another run's OUT, train there")
