# mxmoe: `make test` (the whole suite on CPU), `make train` (a short MX training run on CPU).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.6.0

.PHONY: test lint train clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION) triton==$(TRITON_VERSION) \
		numpy tabulate tqdm matplotlib pytest pytest-timeout pytest-xdist hypothesis ruff "setuptools>=77"
	# the torchtitan integration's tests (torch stays pinned)
	$(BIN)/python -m pip install -q torchtitan==0.3.0 torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check mxmoe tests

# two pytest workers (pytest-xdist): the suite's processes are mostly single-threaded
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2
	PYTHON=$(BIN)/python ./scripts/check_cuda_build.sh

train: $(STAMP)
	$(BIN)/mxmoe train --config configs/debug_moe.toml

clean:
	rm -rf $(VENV) build *.egg-info
