PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test lint format bench proto

# A machine without torch gets the CPU build of torch 2.13 (a plain `torch` would pull a
# multi-GB CUDA build); a machine that has torch (e.g. a GPU node) keeps its own.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e ".[dev]"

# One math thread per process: the suite runs several engine processes at once on small CPUs.
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check deepinfer_core deepinfer_kernels services tests benchmarks
	$(PYTHON) -m ruff format --check deepinfer_core deepinfer_kernels services tests benchmarks

format:
	$(PYTHON) -m ruff format deepinfer_core deepinfer_kernels services tests benchmarks
	$(PYTHON) -m ruff check --fix deepinfer_core deepinfer_kernels services tests benchmarks

# Regenerate the gRPC/protobuf modules in deepinfer_proto/ (tests/services/test_proto.py checks they are current).
proto:
	$(PYTHON) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. deepinfer_proto/*.proto
	rm -f deepinfer_proto/common_pb2_grpc.py deepinfer_proto/*_pb2_grpc.pyi

bench: install
	$(PYTHON) benchmarks/offline_throughput.py
