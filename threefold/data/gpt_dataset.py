"""GPT training samples: `seq_length + 1` consecutive tokens of the document stream.

Input and label of a sample are the same window shifted by one token, so consecutive samples
share one token, as in Megatron's GPTDataset. Documents are concatenated with their
end-of-document tokens (written by preprocessing) and samples run across document boundaries.

Sources: a Megatron `.bin/.idx` pair, read through megatron-core's `IndexedDataset` (a
memory-mapped numpy reader), or mock data whose every sample is a pure function of the seed and
the sample index, hence identical for every parallel layout.
"""

from __future__ import annotations

import os

import numpy as np

from threefold.config import ConfigError


def _split_bounds(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Document ranges of the train/valid/test splits, Megatron-style rounding."""
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [b - diff if i else b for i, b in enumerate(bounds)]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class TokenWindowDataset:
    """Samples of `seq_length + 1` tokens from a contiguous slice of a token stream."""

    def __init__(self, tokens: np.ndarray, seq_length: int, name: str) -> None:
        self.tokens = tokens
        self.seq_length = seq_length
        self.num_samples = max((len(tokens) - 1) // seq_length, 0)
        self.name = name

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)


def indexed_datasets(prefix: str, seq_length: int, split_weights: list[float],
                     vocab_size: int) -> list[TokenWindowDataset | None]:
    """Train, validation and test datasets from the `.bin/.idx` pair at `prefix`."""
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise ConfigError(f"--data-path {prefix}: {prefix + suffix} does not exist; "
                              "create it with tools/preprocess_data.py")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        indexed = IndexedDataset(prefix, mmap=True)
    except Exception as error:  # megatron-core raises AssertionError on a bad header
        raise ConfigError(f"--data-path {prefix}: unreadable .idx ({error})") from None
    offsets = np.concatenate([[0], np.cumsum(indexed.sequence_lengths, dtype=np.int64)])
    stream = np.memmap(prefix + ".bin", dtype=indexed.index.dtype, mode="r")
    if len(stream) < offsets[-1]:
        raise ConfigError(f"--data-path {prefix}: {prefix}.bin is truncated "
                          f"({len(stream)} tokens, the index expects {offsets[-1]})")
    if len(stream) and int(stream.max()) >= vocab_size:
        raise ConfigError(f"--data-path {prefix}: token id {int(stream.max())} is outside the "
                          f"model's vocabulary of {vocab_size}; use the tokenizer that made it")
    datasets = []
    for name, (first, last) in zip(("train", "valid", "test"),
                                   _split_bounds(len(indexed.sequence_lengths), split_weights)):
        dataset = TokenWindowDataset(stream[offsets[first]:offsets[last]], seq_length, name)
        datasets.append(dataset if len(dataset) else None)
    if datasets[0] is None:
        raise ConfigError(f"--data-path {prefix}: the train split holds fewer than "
                          f"--seq-length + 1 tokens; add data or change --split")
    return datasets


class MockGPTDataset:
    """Synthetic tokens: sample `i` of split `s` comes from a generator seeded by (seed, s, i)."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, split_index: int,
                 num_samples: int) -> None:
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.seed, self.split_index, self.num_samples = seed, split_index, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split_index, index])
        return rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)
