# Two commands on a fresh machine: `make serve` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install serve test lint bench profile clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/serve run --address local config/demo.yaml

test: install
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check app actors kernels loadtest tests
	$(BIN)/mypy app

profile: install
	$(BIN)/python -m app.profile --model config/models/opt-125m

bench: install
	$(BIN)/python -m loadtest.bench_engine
	$(BIN)/python -m loadtest.bench_scheduler

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
