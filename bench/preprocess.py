"""Data pipeline throughput: tools/preprocess_data.py with 1 and 2 workers on a ~50 MB JSONL,
then megatron-core's dataset index build for ~1 GB of tokens, cold and cached (start-up to the
first batch).

    python bench/preprocess.py [--workdir /tmp/threefold_bench] > bench/results/preprocess.md

The JSONL is synthetic (random words, so it compresses like text but needs no download) and
tokenized with a sentencepiece model trained on its first lines. The 1 GB token file is written
directly with megatron-core's builder (random ids), since tokenizing 1 GB on a laptop takes long
and does not change the index build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from threefold.data import megatron_core  # noqa: E402


def make_jsonl(path: str, megabytes: int) -> None:
    rng = np.random.default_rng(0)
    words = [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 9)))
        for _ in range(5000)
    ]
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 2**20:
            text = " ".join(rng.choice(words, size=int(rng.integers(100, 400))))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)


def run(*argv: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def write_tokens(prefix: str, total_tokens: int) -> None:
    IndexedDatasetBuilder = megatron_core.datasets().indexed_dataset.IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < total_tokens:
        lengths = rng.integers(200, 2000, size=10_000)
        ids = rng.integers(0, 31999, size=int(lengths.sum()), dtype=np.uint16)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for start, length in zip(starts, lengths):
            builder.add_document(ids[start : start + length], [int(length)])
        written += int(lengths.sum())
    builder.finalize(prefix + ".idx")


def first_batch_seconds(prefix: str, cache: str) -> float:
    """Start-up to the first training batch: config, dataset build (or cache load), sample."""
    code = (
        "import time; t = time.perf_counter()\n"
        "from threefold.arguments import parse_args\n"
        "from threefold.data.loader import build_datasets, micro_batches\n"
        "from threefold.parallel.parallel_context import Group\n"
        "import torch\n"
        f"c = parse_args(['--num-layers','1','--hidden-size','64','--num-attention-heads','1',"
        f"'--seq-length','4096','--micro-batch-size','1','--global-batch-size','256',"
        f"'--train-iters','900','--vocab-size','32000','--data-path','{prefix}',"
        f"'--data-cache-path','{cache}','--eval-iters','10'])\n"
        "d = build_datasets(c)\n"
        "next(micro_batches(d[0], 0, 1, 1234, torch.device('cpu'), Group()))\n"
        "print(time.perf_counter() - t)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/threefold_bench")
    parser.add_argument("--jsonl-mb", type=int, default=50)
    parser.add_argument(
        "--gigatokens", type=float, default=0.5, help="token count in 1e9 (uint16: 0.5 = 1 GB)"
    )
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    jsonl = os.path.join(args.workdir, "corpus.jsonl")
    if not os.path.isfile(jsonl):
        make_jsonl(jsonl, args.jsonl_mb)
    head = os.path.join(args.workdir, "head.jsonl")
    with open(jsonl) as f, open(head, "w") as out:
        out.writelines(line for _, line in zip(range(2000), f))
    run(
        "tools/train_tokenizer.py",
        "--input",
        head,
        "--vocab-size",
        "8000",
        "--model-prefix",
        os.path.join(args.workdir, "sp"),
    )
    size_mb = os.path.getsize(jsonl) / 2**20
    print(
        f"# Data pipeline benchmark\n\nMachine: {os.cpu_count()} CPU cores. "
        f"Input: {size_mb:.1f} MB synthetic JSONL.\n"
    )
    print("| preprocess_data.py | seconds | MB/s |\n|---|---|---|")
    for workers in (1, 2):
        seconds = run(
            "tools/preprocess_data.py",
            "--input",
            jsonl,
            "--json-keys",
            "text",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            os.path.join(args.workdir, "sp.model"),
            "--output-prefix",
            os.path.join(args.workdir, f"out{workers}"),
            "--append-eod",
            "--workers",
            str(workers),
        )
        print(f"| --workers {workers} | {seconds:.1f} | {size_mb / seconds:.1f} |")
    prefix = os.path.join(args.workdir, "tokens")
    if not os.path.isfile(prefix + ".idx"):
        write_tokens(prefix, int(args.gigatokens * 1e9))
    gigabytes = os.path.getsize(prefix + ".bin") / 2**30
    cache = os.path.join(args.workdir, "cache")
    subprocess.run(["rm", "-rf", cache], check=True)
    cold = first_batch_seconds(prefix, cache)
    warm = first_batch_seconds(prefix, cache)
    print(
        f"\n| start-up to the first batch, {gigabytes:.2f} GB of tokens, seq 4096, "
        f"230,400 training samples | seconds |\n|---|---|\n"
        f"| cold (megatron-core builds and caches the indices; vocabulary scan) | {cold:.1f} |\n"
        f"| cached (`--data-cache-path`) | {warm:.1f} |"
    )


if __name__ == "__main__":
    main()
