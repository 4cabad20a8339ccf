"""The path a new user walks with their own small corpus, end to end and as the README shows it:
train a tokenizer, preprocess, pretrain with the default --split, generate. Each step is a
command run as a user runs it."""

import json
import os
import subprocess
import sys
import time

from threefold.data.tokenizer import SentencePieceTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = [
    f"def step_{i}(x):\n    return x + {i}\n\nROMEO:\n  Is it day {i}? It is the east.\n"
    for i in range(100)
]
MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
MODEL += "--position-embedding-type rope --normalization RMSNorm --swiglu"
TRAINING = "--micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-3 "
TRAINING += "--log-interval 10 --eval-interval 20 --eval-iters 2"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_own_corpus_from_tokenizer_to_sample(tmp_path):
    corpus, prefix = tmp_path / "corpus.jsonl", str(tmp_path / "corpus")
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    sp_prefix = str(tmp_path / "sp")
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
    tokenizer.append(sp_prefix + ".model")

    result = _run(
        "tools/train_tokenizer.py",
        "--input",
        str(corpus),
        "--vocab-size",
        "400",
        "--model-prefix",
        sp_prefix,
    )
    assert result.returncode == 0, result.stderr
    sp = SentencePieceTokenizer(sp_prefix + ".model")
    assert all(sp.detokenize(sp.tokenize(text)) == text for text in DOCUMENTS)

    result = _run(
        "tools/preprocess_data.py",
        "--input",
        str(corpus),
        "--output-prefix",
        prefix,
        "--append-eod",
        *tokenizer,
    )
    assert result.returncode == 0, result.stderr

    # The default --split 969,30,1 of 100 documents leaves the test split empty: one line
    # naming --split, in seconds (megatron-core would count epochs of it forever); with the
    # split it suggests, training runs.
    save = str(tmp_path / "checkpoints")
    argv = [*MODEL.split(), *TRAINING.split(), "--data-path", prefix + "_text_document"]
    argv += ["--save", save, *tokenizer]
    start = time.monotonic()
    result = _run("pretrain_gpt.py", *argv)
    assert time.monotonic() - start < 10
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--split" in result.stderr and "e.g. --split 90,5,5" in result.stderr
    result = _run("pretrain_gpt.py", *argv, "--split", "90,5,5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "iteration       20/      20" in result.stdout
    assert "validation loss at iteration 20" in result.stdout

    result = _run(
        "tools/generate.py", "--load", save, "--prompt", "ROMEO:\n", "--max-new-tokens", "8"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ROMEO:\n") and len(result.stdout) > len("ROMEO:\n")
