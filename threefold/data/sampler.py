"""Which samples each data-parallel rank reads, Megatron's MegatronPretrainingSampler.

Global batch k is samples [k*G, (k+1)*G) of a fixed permutation of the dataset (G the global
batch size); its micro-batches are consecutive runs of `micro_batch_size * dp` samples, of which
DP rank r takes the r-th `micro_batch_size`. The order depends only on the seed, not on the
layout, and `consumed_samples` alone says where to resume.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class PretrainingSampler:
    def __init__(
        self,
        dataset_size: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.dataset_size = dataset_size
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.world = data_parallel_rank, data_parallel_size
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._order = -1, None

    def _sample_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_size)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:  # one permutation per pass over the data
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
            self._epoch = epoch
        return int(self._order[offset])

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.world
        while True:
            start = self.consumed_samples + self.rank * self.micro_batch_size
            yield [self._sample_index(start + i) for i in range(self.micro_batch_size)]
            self.consumed_samples += step
