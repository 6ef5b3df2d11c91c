# The two commands a newcomer runs: `make demo` and `make test`.
# Both create .venv if missing, install the CPU torch wheel only when no torch is importable
# (a GPU user's CUDA torch is never replaced), then install zo_megatron in editable mode.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.zo_installed
TORCH_CPU ?= torch==2.13.0
NPROC  ?= 2

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.inc)
	@$(PY) -c "import torch" 2>/dev/null || { echo "[setup] installing $(TORCH_CPU) (CPU wheel)"; $(PIP) install -q "$(TORCH_CPU)"; }
	$(PIP) install -q setuptools wheel "pybind11>=2.12"
	$(PIP) install -q --no-build-isolation -e ".[dev,hf,mpi]"
	@$(PY) -m zo_megatron.offload.cpu_adam --info || true
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) pretrain/pretrain_gpt.py --tensor-parallel 2 --zero-offload

test: setup
	$(PY) -m pytest tests -q --durations=15

bench: setup
	$(PY) tools/bench_cpu_adam.py
	$(PY) tools/bench_train_step.py

clean:
	rm -rf build *.egg-info zo_megatron/*.so
