# Sourced by gpu_run.sh and gpu_check.sh (bash): make `import specjax` work on a machine
# that has jax and the other dependencies but not specjax. Needs PY (the interpreter),
# ROOT (the checkout), the functions say and die, and a log path as $1.
#
# specjax.kernels and specjax.checkpoints_tools live in kernels/ and checkpoints_tools/
# (pyproject's package-dir), so a bare PYTHONPATH=$ROOT is not enough. The check runs from
# / so that the working directory does not make a bare checkout importable by accident.

importable() {
    (cd / && "$PY" -c "import specjax.checkpoints_tools.sources, specjax.kernels" >/dev/null 2>&1)
}

make_specjax_importable() {  # make_specjax_importable PIP_LOG
    command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (set PYTHON)"
    if importable; then
        say "specjax importable: $(cd / && "$PY" -c 'import specjax; print(specjax.__file__)')"
        return 0
    fi
    say "specjax not importable: pip install --no-build-isolation --no-deps -e ."
    (cd "$ROOT" && "$PY" -m pip install --no-build-isolation --no-deps -e . >"$1" 2>&1) \
        || say "pip install failed (log: $1)"
    importable && return 0
    # Fallback: the installed layout as symlinks, then the checkout itself (so that the
    # scripts that put the checkout on sys.path do not move it ahead of the shim).
    SHIM=$(mktemp -d "${TMPDIR:-/tmp}/specjax-shim.XXXXXX")
    mkdir "$SHIM/specjax"
    for entry in "$ROOT"/specjax/*; do ln -s "$entry" "$SHIM/specjax/"; done
    ln -s "$ROOT/kernels" "$SHIM/specjax/kernels"
    ln -s "$ROOT/checkpoints_tools" "$SHIM/specjax/checkpoints_tools"
    export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    importable || die "specjax does not import, installed or from $SHIM (PYTHONPATH); run: cd / && $PY -c 'import specjax.kernels'"
    say "specjax from a symlinked layout: PYTHONPATH=$PYTHONPATH"
}
