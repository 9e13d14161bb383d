# mxmoe: `make test` (the whole suite on CPU, the torchtitan 0.2 adapter's tests included),
# `make train` (a short MX training run on CPU), `make wheel-check` (the wheel installed in a fresh
# venv trains from outside the checkout).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torchtitan 0.2.2 beside the venv's 0.3.0 (one venv cannot hold both): installed with --no-deps
# into a folder of its own, put first on PYTHONPATH for its adapter's tests. Its run-time
# dependencies (torchdata, datasets, tokenizers, tyro, tensorboard, einops, pillow) are 0.3.0's too.
TT02 := $(VENV)/torchtitan-0.2
TT02_STAMP := $(TT02)/.installed
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.6.0

.PHONY: test lint train wheel-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION) triton==$(TRITON_VERSION) \
		numpy tabulate tqdm "tyro>=1.0,<2" matplotlib pytest pytest-timeout pytest-xdist hypothesis ruff \
		"setuptools>=77"
	# the optional extras' tests: `mxmoe export` to safetensors, `--metrics.enable_wandb` (offline)
	$(BIN)/python -m pip install -q safetensors wandb torch==$(TORCH_VERSION)
	# the torchtitan integration's tests (torch stays pinned)
	$(BIN)/python -m pip install -q torchtitan==0.3.0 torch==$(TORCH_VERSION)
	# the peer the native (Blackwell) GEMM's tests compare with, and torchao's quantize_ entry point
	# (mxmoe.integrations.torchao); no deps (torch stays pinned)
	$(BIN)/python -m pip install -q --no-deps torchao==0.18.0
	# Hugging Face transformers (mxmoe.integrations.hf; accelerate: its Trainer), torch stays pinned
	$(BIN)/python -m pip install -q transformers==5.23.0 accelerate==1.16.0 torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check mxmoe tests

$(TT02_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --no-compile --upgrade --target $(TT02) torchtitan==0.2.2
	touch $@

# two pytest workers (pytest-xdist): the suite's processes are mostly single-threaded. The suite
# checks the CUDA build too (tests/quant/test_cuda_cast.py: nvcc of csrc/*.cu for sm_90, once per
# run, and binding.cpp against torch's headers), what scripts/check_cuda_build.sh does alone, and,
# given --torchtitan02, the 0.2 adapter's tests in a process of their own with $(TT02) on PYTHONPATH.
# Bytecode is written (env -u PYTHONDONTWRITEBYTECODE, which some environments set): a test process
# started after the first (each `mxmoe` subprocess, the subprocess jobs' runs) loads mxmoe's, the
# tests' and pytest's rewritten modules from __pycache__ instead of compiling them again
# (`pytest --collect-only`: 24.8 s without the cache, 17.3 s with it).
test: $(STAMP) $(TT02_STAMP) lint
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --torchtitan02=$(TT02)

train: $(STAMP)
	$(BIN)/mxmoe train --config debug_moe

# the wheel in a fresh venv (torch linked from $(VENV), the rest from pip's sources): a short
# training by config name from a folder outside the checkout (scripts/wheel_check.sh)
wheel-check: $(STAMP)
	bash scripts/wheel_check.sh $(BIN)/python

clean:
	rm -rf $(VENV) build *.egg-info
