# Two commands matter: `make run` (main job on built-in defaults) and `make test` (whole suite).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP_CORE := $(VENV)/.core
STAMP_DEV := $(VENV)/.dev
STAMP_NATIVE := $(VENV)/.native

.PHONY: run test lint plan bench clean native

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or: make PY=python3)"; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# every CLI command works after `make run` (the `all` extra: plot, runtime, serve, ray; torch pinned)
$(STAMP_CORE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	@touch $@

$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev]'
	-@bash scripts/install_mooncake.sh $(BIN)/pip
	@touch $@ $(STAMP_CORE)

# the compiled simulator core (docs/simulator.md "Speed"): rebuilt when a simulator source
# changes; where it cannot be built (no C compiler) everything runs in pure Python
$(STAMP_NATIVE): $(wildcard src/dualpath/sim/*.py) | $(STAMP_CORE)
	-$(BIN)/dualpath native build
	@touch $@

native: $(STAMP_CORE)
	$(BIN)/dualpath native build
	@touch $(STAMP_NATIVE)

run: $(STAMP_CORE) $(STAMP_NATIVE)
	$(BIN)/dualpath run

test: $(STAMP_DEV) $(STAMP_NATIVE)
	$(BIN)/python -m pytest -q

lint: $(STAMP_DEV)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

plan: $(STAMP_CORE)
	$(BIN)/dualpath plan

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/dualpath/sim/_native
