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

.PHONY: setup demo test test-all test-gpu gpu-setup gpu-proof bench clean

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

# ZO_REQUIRE_KERNEL=1: with a C++ compiler present, a CPU Adam kernel that did not build fails the
# run (tests/requirements_check.py) instead of silently testing the torch fallback only.
# TEST_WORKERS pytest-xdist workers (2: the CI machine's cores; the multi-rank tests start 2-4
# ranks each); --dist worksteal balances the tail (tests/harness.built_once shares an expensive
# module fixture between the workers).
# It prints the slowest tests and its own duration, set-up included (docs/testing.md).
# test-all adds the exhaustive variants marked slow.
TEST_WORKERS ?= 2
PYTEST_ARGS  := tests -q -n $(TEST_WORKERS) --dist worksteal --durations=30

test:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup && \
	ZO_REQUIRE_KERNEL=1 $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	echo "[make test] $$(( $$(date +%s) - start )) s including set-up, exit $$rc"; exit $$rc

test-all:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup && \
	ZO_REQUIRE_KERNEL=1 $(PY) -m pytest $(PYTEST_ARGS) -m ""; rc=$$?; \
	echo "[make test-all] $$(( $$(date +%s) - start )) s including set-up, exit $$rc"; exit $$rc

# The GPU suite (tests/gpu). On a machine whose $(PYTHON) has a CUDA torch, it runs in $(GPU_VENV):
# a venv that sees that torch (system site packages; if $(PYTHON) is itself a venv, a .pth file adds
# its site-packages), offline: megatron-core from a wheel in wheels/ when it is not importable
# (pip download --no-deps --python-version 3.12 --only-binary :all: megatron-core==0.16.1 -d wheels/),
# zo_megatron in editable mode without dependencies. Without CUDA the suite skips cleanly; with CUDA
# a missing transformers / megatron-core or an unbuilt CPU Adam kernel fails the run
# (ZO_REQUIRE_GPU_SUITE=1, tests/requirements_check.py) instead of skipping tests.
GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python

test-gpu:
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		$(MAKE) --no-print-directory gpu-setup && ZO_REQUIRE_GPU_SUITE=1 $(GPU_PY) -m pytest tests/gpu -v -rs --durations=10; \
	else \
		echo "[test-gpu] $(PYTHON) has no CUDA torch: the GPU suite skips"; \
		$(MAKE) --no-print-directory setup && $(PY) -m pytest tests/gpu -q -rs; \
	fi

gpu-setup:
	@test -x $(GPU_PY) || { $(PYTHON) -m venv --system-site-packages $(GPU_VENV) && \
		$(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(GPU_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_zo_parent_site.pth"; }
	@$(GPU_PY) -c "import megatron.core" 2>/dev/null || $(GPU_PY) -m pip install -q --no-deps \
		$$(ls wheels/megatron_core-*.whl 2>/dev/null | head -1 || true) $$(ls wheels/megatron_core-*.whl >/dev/null 2>&1 || echo "megatron-core==0.16.1")
	@$(GPU_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	@$(GPU_PY) -c "import torch, megatron.core, zo_megatron.offload.cpu_adam as a; print('[gpu-setup] torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| cpu adam', a.info()['isa'])"

# A lent GPU turned into evidence (tools/gpu_proof.py, docs/gpu.md): preflight, the GPU suite, a Llama
# throughput sweep (synchronous / overlapped / delayed CPU step) and the planner's largest model for 3
# iterations, in one command, offline. DRY_RUN=1 runs the same code path on a CPU at tiny sizes (CI
# does). Results: $(OUT)/gpu_proof.json, .md, .png. Six suite workers: the lent machine has 16 CPUs and
# the GPU tests are start-up bound (imports, CUDA contexts), not GPU bound.
OUT ?= gpu_proof
DRY_RUN ?=
GPU_PROOF_ARGS ?= --suite-workers 6

gpu-proof:
	@if [ -n "$(DRY_RUN)" ]; then \
		$(MAKE) --no-print-directory setup && $(PY) tools/gpu_proof.py --dry-run --out "$(OUT)"; \
	elif $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		$(MAKE) --no-print-directory gpu-setup && $(GPU_PY) tools/gpu_proof.py --out "$(OUT)" $(GPU_PROOF_ARGS); \
	else \
		echo "error: $(PYTHON) has no CUDA torch: make gpu-proof needs a GPU (DRY_RUN=1 checks the tool on a CPU)" >&2; exit 2; \
	fi

# bench_train.py's default is every world and both precisions (hours on a 2-core CPU): override BENCH_ARGS
BENCH_ARGS ?= --worlds 1,dp2 --precision fp32 --json bench_train.json

bench: setup
	$(PY) tools/bench_cpu_adam.py
	$(PY) tools/bench_train.py $(BENCH_ARGS)

clean:
	rm -rf build *.egg-info zo_megatron/*.so $(GPU_VENV)
