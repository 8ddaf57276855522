# Sourced by the GPU scripts (benchmarks/gpu_run.sh, benchmarks/train_draft_gpu.sh): makes
# `import specjax` work on a machine where it is not installed, from the checkout at $ROOT
# with the interpreter $PY. Uses the caller's say (a progress line) and die (an error line,
# then exit).
#
# specjax.kernels and specjax.checkpoints_tools live in kernels/ and checkpoints_tools/
# (pyproject's package-dir), so a bare PYTHONPATH=$ROOT is not enough. First
# `pip install --no-build-isolation --no-deps -e .`; if that fails, the installed layout as
# symlinks, then the checkout itself, on PYTHONPATH (so that the scripts that put the
# checkout on sys.path do not move it ahead of the shim).

# The check runs from / so that the working directory does not make a bare checkout
# importable by accident.
importable() {
    (cd / && "$PY" -c "import specjax.checkpoints_tools.sources, specjax.kernels" >/dev/null 2>&1)
}

make_specjax_importable() {
    if importable; then
        say "specjax importable: $(cd / && "$PY" -c 'import specjax; print(specjax.__file__)')"
        return 0
    fi
    say "specjax not importable: pip install --no-build-isolation --no-deps -e ."
    (cd "$ROOT" && "$PY" -m pip install --no-build-isolation --no-deps -e .) \
        >/tmp/specjax_pip.log 2>&1 || say "pip install failed (log: /tmp/specjax_pip.log)"
    if importable; then
        return 0
    fi
    SHIM=$(mktemp -d "${TMPDIR:-/tmp}/specjax-shim.XXXXXX")
    mkdir "$SHIM/specjax"
    for entry in "$ROOT"/specjax/*; do ln -s "$entry" "$SHIM/specjax/"; done
    ln -s "$ROOT/kernels" "$SHIM/specjax/kernels"
    ln -s "$ROOT/checkpoints_tools" "$SHIM/specjax/checkpoints_tools"
    export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    importable || die "specjax does not import, installed or from $SHIM (PYTHONPATH); run: cd / && $PY -c 'import specjax.kernels'"
    say "specjax from a symlinked layout: PYTHONPATH=$PYTHONPATH"
}
