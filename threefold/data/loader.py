"""Micro-batches for this rank: dataset + sampler -> {tokens, labels, loss_mask} tensors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from threefold.config import Config
from threefold.data.gpt_dataset import MockGPTDataset, indexed_datasets
from threefold.data.sampler import PretrainingSampler
from threefold.parallel import state


def build_datasets(config: Config) -> list:
    """Train, validation and test datasets (None where a split is empty)."""
    model, data = config.model, config.data
    if data.mock_data:
        # Sized to what the run reads, as Megatron sizes its mock splits.
        training = config.training
        sizes = [training.train_iters * training.global_batch_size,
                 max(training.eval_iters, 1) * training.global_batch_size,
                 max(training.eval_iters, 1) * training.global_batch_size]
        return [MockGPTDataset(model.seq_length, model.vocab_size, training.seed, split, size)
                for split, size in enumerate(sizes)]
    return indexed_datasets(data.data_path[0], model.seq_length, data.split_weights(),
                            model.vocab_size)


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, seed: int,
                  device: torch.device, shuffle: bool = True) -> Iterator[dict]:
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 state.data_parallel_rank(), state.data_parallel_world_size(),
                                 seed, shuffle)
    for indices in sampler:
        samples = torch.from_numpy(np.stack([dataset[i] for i in indices]))
        yield {
            "tokens": samples[:, :-1].to(device, non_blocking=True),
            "labels": samples[:, 1:].to(device, non_blocking=True),
            "loss_mask": torch.ones(samples.shape[0], samples.shape[1] - 1, device=device),
        }
