"""Megatron's `indexer loss` for the log line: DeepSeek sparse attention's indexer loss
(model/dsa.py), as megatron-core's DSAIndexerLossLoggingHelper reports it.

Every sparse attention layer sums its loss (with --dsa-indexer-loss-coeff) over an iteration's
micro-batches; after every iteration the layers' sums are added up here, divided by the number
of micro-batches. A report reduces the window once: summed over the pipeline stages (each
holds its layers), averaged over data-parallel replicas, over the model's layers and over the
window's iterations. (Every TP rank computes the whole loss: nothing to sum there.) The
trainer also hands the layers, each step, the factor the schedule puts on the main loss, which
their losses' gradients take.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.dsa import SparseAttention
from threefold.parallel.parallel_context import ParallelContext


class IndexerLosses:
    def __init__(
        self, model_chunks: list[nn.Module], num_layers: int, parallel: ParallelContext
    ) -> None:
        self.parallel, self.num_layers = parallel, num_layers
        self.layers = [
            module
            for chunk in model_chunks
            for module in chunk.modules()
            if isinstance(module, SparseAttention)
        ]
        self._reset()

    def _reset(self) -> None:
        self.iterations, self.sum = 0, torch.zeros(1, dtype=torch.float64)

    def start(self, scale: float) -> None:
        """A schedule's run begins: the gradient factor of the layers' losses."""
        for layer in self.layers:
            layer.aux_loss_scale = scale

    def after_iteration(self, num_microbatches: int) -> None:
        for layer in self.layers:
            loss = layer.take_loss()
            if loss is not None:
                self.sum += loss.double().cpu() / num_microbatches
        self.iterations += 1

    def report(self, device: torch.device) -> dict[str, float]:
        """{"indexer loss": its mean over the window}, reduced over all ranks; every rank
        calls."""
        total = self.sum.to(device)
        self.parallel.pp.all_reduce(total)
        self.parallel.dp.all_reduce(total)
        value = total.item() / self.parallel.dp.size / self.num_layers / max(self.iterations, 1)
        self._reset()
        return {"indexer loss": value}
