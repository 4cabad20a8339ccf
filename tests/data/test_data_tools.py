"""tools/preprocess_data.py writes Megatron's format; threefold reads it back exactly."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np

from threefold.data.gpt_dataset import indexed_datasets
from threefold.data.tokenizer import SentencePieceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog {i} times." * 3
         for i in range(40)]


def _tool(name: str, *argv: str) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *argv], check=True,
                   capture_output=True, timeout=120)


def test_preprocess_round_trip_through_megatron_core(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    _tool("train_tokenizer.py", "--input", str(corpus), "--vocab-size", "300",
          "--model-prefix", str(tmp_path / "sp"))
    _tool("preprocess_data.py", "--input", str(corpus), "--tokenizer-type",
          "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "sp.model"),
          "--output-prefix", str(tmp_path / "out"), "--append-eod", "--workers", "2")
    tokenizer = SentencePieceTokenizer(str(tmp_path / "sp.model"))
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in TEXTS]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    prefix = str(tmp_path / "out_text_document")
    megatron = IndexedDataset(prefix)
    assert len(megatron) == len(TEXTS)
    assert [megatron[i].tolist() for i in range(len(TEXTS))] == expected

    # threefold's samples are windows of the same concatenated stream.
    train, _, _ = indexed_datasets(prefix, 16, [1.0, 0.0, 0.0], tokenizer.vocab_size)
    stream = np.concatenate([np.array(e) for e in expected])
    assert np.array_equal(train[3], stream[48:65])
