# The README's two commands: `make quickstart` and `make test`. Each creates (or reuses) .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

QUICK ?=
quickstart: $(STAMP)
	$(BIN)/python -m scripts.cli quickstart $(QUICK)

# default tier + integration tier (what CI runs)
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not integration"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m eval.bench_runtime

.PHONY: venv quickstart test test-fast lint bench
