"""What --fim-data costs the training process per sample.

Fill-in-the-middle (threefold/data/fim.py) detokenizes each chosen document of a sample, cuts
its text and tokenizes the three parts again. threefold reads batches in the training process
(Megatron-LM in DataLoader workers), so that time adds to every step's. This measures it on
the embedded Shakespeare corpus with a byte-level BPE tokenizer trained here (GPT-2's kind,
FIM sentinels among its special tokens; no hub), through threefold's HuggingFaceTokenizer
(`transformers`' fast tokenizer, what `--tokenizer-type HuggingFaceTokenizer` loads):

    python bench/fim_cost.py [--seq-length 4096] [--samples 200] [--vocab-size 32000]

and prints the milliseconds per sample at --fim-rate 0.5 and 1.0, and per step of a given
micro-batch count; then what a micro-batch costs the training process when each one's step
takes --step-ms (a sleep standing in for the GPU's work), read in the process
(--num-workers 0) and by DataLoader worker processes (--num-workers 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SENTINELS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]


def _documents() -> list[str]:
    with open(os.path.join(ROOT, "data", "shakespeare.jsonl")) as f:
        return [json.loads(line)["text"] for line in f]


def _tokenizer(directory: str, vocab_size: int):
    """A byte-level BPE trained on the corpus, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from threefold.data.tokenizer import HuggingFaceTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SENTINELS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_documents(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        directory
    )
    return HuggingFaceTokenizer(directory)


def _samples(tokenizer, seq_length: int, count: int) -> list[np.ndarray]:
    """Samples as the dataset builds them: documents with their end-of-document tokens,
    packed and cut at the sequence length."""
    stream: list[int] = []
    for text in _documents():
        stream += tokenizer.tokenize(text) + [tokenizer.eod]
        if len(stream) >= seq_length * count:
            break
    tokens = np.array(stream[: seq_length * count], dtype=np.int32)
    return list(tokens.reshape(count, seq_length))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--micro-batches", type=int, default=8, help="samples per step per rank")
    parser.add_argument("--step-ms", type=float, default=20.0, help="a micro-batch's step")
    args = parser.parse_args()

    from threefold.config import DataConfig
    from threefold.data.fim import FillInTheMiddle

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = _tokenizer(directory, args.vocab_size)
        samples = _samples(tokenizer, args.seq_length, args.samples)
        documents = sum(int((s == tokenizer.eod).sum()) + 1 for s in samples) / len(samples)
        print(
            f"{len(samples)} samples of {args.seq_length} tokens, {documents:.1f} documents "
            f"each (Shakespeare's scenes), vocabulary {tokenizer.vocab_size} (byte-level BPE)"
        )
        print(
            "| --fim-rate | ms per sample | ms per step of "
            f"{args.micro_batches} samples |\n|---|---|---|"
        )
        for rate in (0.5, 1.0):
            config = DataConfig(fim_data=True, fim_rate=rate, fim_eod_token="<|endoftext|>")
            fim = FillInTheMiddle(config, tokenizer, seed=1234)
            start = time.perf_counter()
            for index, sample in enumerate(samples):
                fim(sample, index)
            per_sample = (time.perf_counter() - start) / len(samples) * 1e3
            print(f"| {rate} | {per_sample:.2f} | {per_sample * args.micro_batches:.1f} |")
        print(
            f"\nmicro-batches of 1 sample at --fim-rate 0.5, a {args.step_ms:.0f} ms step each:"
            "\n| --num-workers | ms per micro-batch | over the step |\n|---|---|---|"
        )
        config = DataConfig(fim_data=True, fim_rate=0.5, fim_eod_token="<|endoftext|>")
        dataset = _Rearranged(samples, FillInTheMiddle(config, tokenizer, seed=1234))
        for workers in (0, 2):
            per_batch = _read_while_stepping(dataset, workers, args.step_ms / 1e3) * 1e3
            print(f"| {workers} | {per_batch:.1f} | {per_batch - args.step_ms:+.1f} |")


class _Rearranged:
    """The samples as --fim-data's dataset gives them: rearranged when read."""

    def __init__(self, samples: list[np.ndarray], fim) -> None:
        self.samples, self.fim = samples, fim

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.fim(self.samples[index], index)


def _read_while_stepping(dataset, workers: int, step_s: float) -> float:
    """Seconds per micro-batch of threefold's loader, each followed by a step of `step_s`
    (the first few, while workers start, left out)."""
    import torch

    from threefold.data.loader import micro_batches
    from threefold.parallel.parallel_context import Group

    batches = micro_batches(
        dataset, 0, 1, 1234, torch.device("cpu"), Group(), shuffle=False, num_workers=workers
    )
    for _ in range(4):
        next(batches)
    count = len(dataset) - 8
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
        time.sleep(step_s)
    return (time.perf_counter() - start) / count


if __name__ == "__main__":
    main()
