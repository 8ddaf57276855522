#!/usr/bin/env bash
# Every GPU target measured by one command, random weights at real shapes, nothing to bring:
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]          # from anywhere; OUT_DIR default
#                                                     # benchmarks/results/gpu_check
#     bash benchmarks/gpu_check.sh --suite [OUT_DIR]  # the real model (its packages
#                                                     # brought by device_bundle.py)
#
# Makes `import specjax` work on a machine that has jax (CUDA), flax, optax, orbax,
# transformers and torch but not specjax (as gpu_run.sh does: pip install -e, else a
# symlinked layout on PYTHONPATH), refuses a machine where jax sees no GPU, then runs
# benchmarks/gpu_check.py's steps in priority order within a time budget and writes
# OUT_DIR/gpu_check.json (rewritten after every step; it names the checkout's commit and
# changed files, from git or, on a copy without .git, from what
# `python benchmarks/device_bundle.py stamp` (or pack) left in a carried .device),
# OUT_DIR/gpu_check.md (the targets) and OUT_DIR/gpu_check_logs.tar.gz (each step's JSON
# and log). See gpu_check.py's docstring for the steps and benchmarks/README.md for what
# follows from the JSON.
#
# Environment: PYTHON (default python), GPU_CHECK_BUDGET (seconds, default 420; 900 on the CPU),
# GPU_CHECK_STEP_LIMIT (seconds per step), GPU_CHECK_STEPS (names: only these),
# SPECJAX_GPU_CHECK_CPU=1 (the CPU rehearsal: tiny shapes, JAX_PLATFORMS=cpu).
# Exit status: 0 if every step ran to its end, 1 if one failed or was not run, 2 if the
# run could not start.

set -u -o pipefail
PY=${PYTHON:-python}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac  # a relative path: relative to where we started
MODE=()
if [ "${1:-}" = --suite ]; then  # the real model's suite (gpu_check.py --suite)
    MODE=(--suite)
    shift
fi
OUT_DIR=${1:-benchmarks/results/gpu_check}
case $OUT_DIR in /*) ;; *) OUT_DIR=$PWD/$OUT_DIR ;; esac
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd -P)

say() { printf '[gpu_check] %s\n' "$*"; }
die() { printf 'gpu_check: error: %s\n' "$*" >&2; exit 2; }

if [ "${SPECJAX_GPU_CHECK_CPU:-0}" = 1 ]; then
    export JAX_PLATFORMS=cpu
    # A rehearsal, not a measurement: XLA's CPU backend compiles its many small programs
    # ~2x faster without its optimisations (tests/conftest.py's fast tier does the same).
    export XLA_FLAGS=${XLA_FLAGS:---xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false}
fi
# shellcheck source=benchmarks/specjax_importable.sh
source "$ROOT/benchmarks/specjax_importable.sh"
make_specjax_importable /tmp/gpu_check_pip.log
BACKEND=$("$PY" -c "import jax; print(jax.default_backend())" 2>/dev/null) \
    || die "jax did not start: $PY -c 'import jax; print(jax.devices())'"
if [ "$BACKEND" != gpu ] && [ "${SPECJAX_GPU_CHECK_CPU:-0}" != 1 ]; then
    die "jax sees no GPU (backend $BACKEND); check CUDA, or set SPECJAX_GPU_CHECK_CPU=1 for the CPU rehearsal"
fi
say "backend $BACKEND, output $OUT_DIR"
exec "$PY" benchmarks/gpu_check.py ${MODE[@]+"${MODE[@]}"} "$OUT_DIR"
