"""Micro-batches for this rank: dataset + sampler -> {tokens, labels, loss_mask} tensors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from threefold.config import Config
from threefold.data.gpt_dataset import MockGPTDataset, megatron_datasets
from threefold.data.sampler import PretrainingSampler
from threefold.parallel import state


def build_datasets(config: Config, tokenizer=None) -> list:
    """Train, validation and test datasets (None where a split is empty)."""
    model, data, training = config.model, config.data, config.training
    # What the run reads: every training step's samples, and --eval-iters global batches of
    # validation and test (threefold evaluates on the same batches each time).
    evaluation = max(training.eval_iters, 1) * training.global_batch_size
    sizes = [training.train_iters * training.global_batch_size, evaluation, evaluation]
    if data.mock_data:
        return [MockGPTDataset(model.seq_length, model.vocab_size, training.seed, split, size)
                for split, size in enumerate(sizes)]
    return megatron_datasets(config, tokenizer, sizes)


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, seed: int,
                  device: torch.device, shuffle: bool = True) -> Iterator[dict]:
    # megatron-core's datasets are shuffled by their own indices: read them in order.
    shuffle = shuffle and not getattr(dataset, "shuffled", False)
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 state.data_parallel_rank(), state.data_parallel_world_size(),
                                 seed, shuffle)
    for indices in sampler:
        items = [dataset[i] for i in indices]
        if not isinstance(items[0], dict):  # pretraining: token windows, loss everywhere
            items = [{"tokens": item} for item in items]
        yield collate(items, device)


def collate(items: list[dict[str, np.ndarray]], device: torch.device) -> dict:
    """A micro-batch from samples of `seq_length + 1` tokens (and, for fine-tuning, a loss
    mask, and document ids and positions of packed documents)."""
    tokens = torch.from_numpy(np.stack([item["tokens"] for item in items]))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    if "loss_mask" in items[0]:
        batch["loss_mask"] = torch.from_numpy(np.stack([item["loss_mask"] for item in items]))
    else:
        batch["loss_mask"] = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    if "document_ids" in items[0]:
        documents = torch.from_numpy(np.stack([item["document_ids"] for item in items]))
        causal = torch.ones(documents.shape[1], documents.shape[1], dtype=torch.bool).tril()
        same = documents[:, :, None] == documents[:, None, :]
        batch["attention_mask"] = (same & causal).unsqueeze(1)  # [b, 1, s, s]
        batch["position_ids"] = torch.from_numpy(
            np.stack([item["position_ids"] for item in items]))
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}
