PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test lint format bench

# A machine without torch gets the CPU build of torch 2.13 (a plain `torch` would pull a
# multi-GB CUDA build); a machine that has torch (e.g. a GPU node) keeps its own.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[dev]"

test: install
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check deepinfer_core kernels services tests benchmarks
	$(PYTHON) -m ruff format --check deepinfer_core kernels services tests benchmarks

format:
	$(PYTHON) -m ruff format deepinfer_core kernels services tests benchmarks
	$(PYTHON) -m ruff check --fix deepinfer_core kernels services tests benchmarks

bench: install
	$(PYTHON) benchmarks/offline_throughput.py
