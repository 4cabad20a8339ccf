"""Megatron-LM's `--sft` data: JSONL conversations, one packed sample per line.

The data paths (`--data-path [WEIGHT] FILE.jsonl ...` with `--split`, or the per-split flags)
name JSONL files (data/conversations.py), which megatron-core's builder blends and splits by
line as Megatron-LM's does, so a run reads the same lines in the same order. Unlike
pretraining windows, the lines are not shuffled: a split is its lines in file order, over and
over.

A line's messages are split into conversations at each system turn; each is rendered by the
SFTTokenizer (data/sft_tokenizer.py) and packed after the previous one with positions from 0,
attending only within itself. The pack ends where `--seq-length` ends: the conversation that
reaches it is cut there and the rest of the line dropped; a shorter pack is filled with the
prompt format's pad token, which continues the last conversation's positions. Under context
parallelism each conversation is first padded to a multiple of 2 x CP tokens, as
Megatron-LM pads it (the samples then depend on CP, as Megatron-LM's do). The token after
the last input is always a pad token, and a pad token is never a target.
"""

from __future__ import annotations

import numpy as np

from threefold.config import ConfigError
from threefold.data import megatron_core
from threefold.data.conversations import Conversations, line_offsets
from threefold.data.gpt_dataset import MegatronSamples
from threefold.data.sft_tokenizer import IGNORE_INDEX

_mcore = megatron_core.datasets()
SAMPLE_KEYS = ("tokens", "loss_mask", "position_ids", "document_ids")


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """A line's messages as conversations: a new one starts at each system turn."""
    conversations: list[list[dict]] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def pack(
    messages: list[dict], tokenizer, seq_length: int, multiple: int = 1
) -> dict[str, np.ndarray]:
    """A line's sample: `seq_length + 1` tokens, and per input position its loss mask,
    position and conversation (the loader's per-document attention). `multiple`: each
    conversation is padded to a multiple of it (Megatron-LM's 2 x CP under context
    parallelism, whose per-sequence split needs it), the padding continuing its positions."""
    size, pad = seq_length + 1, tokenizer.pad
    tokens: list[int] = []
    targets: list[int] = []
    positions: list[int] = []
    ends: list[int] = []  # where each conversation's tokens end

    def fill(count: int) -> None:
        first = positions[-1] + 1 if positions else 0
        tokens.extend([pad] * count)
        targets.extend([pad] * count)
        positions.extend(range(first, first + count))

    for conversation in split_conversations(messages):
        ids, wanted = tokenizer.tokenize_conversation(conversation)
        tokens += ids
        targets += wanted
        positions += range(len(ids))
        fill(-len(tokens) % multiple)
        ends.append(len(tokens))
        if len(tokens) >= size:  # cut: the last input is the sample's last, then a pad
            tokens[seq_length:], targets[seq_length:] = [pad], [pad]
            del positions[size:]
            break
    fill(size - len(tokens))
    ends[-1] = seq_length  # (the filling, or the cut, belongs to the last conversation)
    labels = np.array(targets[1:])
    documents = np.searchsorted(np.array(ends), np.arange(seq_length), side="right")
    return {
        "tokens": np.array(tokens, dtype=np.int64),
        "loss_mask": ((labels != IGNORE_INDEX) & (labels != pad)).astype(np.float32),
        "position_ids": np.array(positions[:seq_length], dtype=np.int64),
        "document_ids": documents.astype(np.int64),
    }


def padding_multiple(config) -> int:
    """What each conversation is padded to a multiple of: 2 x CP under context parallelism."""
    cp = config.context_parallel_size or 1
    return 2 * cp if cp > 1 else 1


class SFTDataset(_mcore.megatron_dataset.MegatronDataset):
    """megatron-core's view of one JSONL file's split: sample `i` is line
    `indices[i % len(indices)]` packed (megatron-core gives a split's lines in file order)."""

    def __len__(self) -> int:
        # (no size asked, as --full-validation asks none: each line once)
        return len(self.indices) if self.num_samples is None else self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        record = int(self.indices[index % len(self.indices)])
        config = self.config
        try:
            messages, multiple = self.dataset[record], padding_multiple(config)
            return pack(messages, config.tokenizer, config.sequence_length, multiple)
        except ConfigError as error:  # (met when read: name the line)
            raise ConfigError(f"{self.dataset.where(record)}: {error}") from None

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Conversations) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config) -> Conversations:
        # (checked by SFTData.check first, which names the flag: this finds it indexed)
        return Conversations(dataset_path, line_offsets(dataset_path, "--data-path", True))


class SFTSamples(MegatronSamples):
    """A split of --sft samples, read in order (megatron-core's order, as Megatron-LM's
    sampler reads them)."""

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = self.dataset[index]  # (a blend's also says which file: dataset_id)
        return {name: sample[name] for name in SAMPLE_KEYS}


class SFTData:
    """What `gpt_dataset.megatron_datasets` reads --sft's JSONL files with."""

    dataset_class = SFTDataset

    def __init__(self, config, tokenizer) -> None:
        self.config, self.dataset_tokenizer = config, tokenizer
        self.masks = config.data.sft_tokenizer_prompt_format != "default"

    def check(self, path: str, flag: str) -> None:
        line_offsets(path, flag, self.masks)

    def cache_directories(self, paths: list[str]) -> list[str]:
        # (only a blend's indices are cached, and only under --data-cache-path)
        return [self.config.data.data_cache_path] if self.config.data.data_cache_path else []

    def samples(self, dataset, split: int) -> SFTSamples:
        return SFTSamples(dataset)
