"""Megatron's `indexer loss` for the log line: DeepSeek sparse attention's indexer loss
(model/dsa.py, with --dsa-indexer-loss-coeff), as megatron-core's DSAIndexerLossLoggingHelper
reports it: the window's mean (reduced as training/layer_losses.py says) of the sum over the
layers, divided by the model's layers. Under --calculate-per-token-loss each layer's loss is
summed over its queries, not averaged (Megatron-LM's since megatron-core 0.16), and logged so.
"""

from __future__ import annotations

from torch import nn

from threefold.model.dsa import SparseAttention
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.layer_losses import LayerLosses


class IndexerLosses(LayerLosses):
    def __init__(
        self, model_chunks: list[nn.Module], num_layers: int, parallel: ParallelContext
    ) -> None:
        super().__init__(model_chunks, SparseAttention, 1, parallel)
        self.num_layers = num_layers

    def report(self, device, reset: bool = True) -> dict[str, float]:
        """{"indexer loss": its mean over the window and the layers}; every rank calls."""
        return {"indexer loss": self._window_means(device, reset).item() / self.num_layers}
