"""Megatron's `mtp_1 loss`, `mtp_2 loss`, ... for the log line: each multi-token prediction
depth's loss (model/mtp.py), as megatron-core's MTPLossLoggingHelper reports it (the window's
mean, reduced as training/layer_losses.py says). The depths also take --calculate-per-token-
loss's choice of how their losses are divided.
"""

from __future__ import annotations

from torch import nn

from threefold.model.mtp import MultiTokenPredictionBlock
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.layer_losses import LayerLosses


class MTPLosses(LayerLosses):
    def __init__(
        self, model_chunks: list[nn.Module], depths: int, parallel: ParallelContext
    ) -> None:
        super().__init__(model_chunks, MultiTokenPredictionBlock, depths, parallel)

    def report(self, device, reset: bool = True) -> dict[str, float]:
        """{`mtp_k loss`: its mean over the window}; every rank calls."""
        values = self._window_means(device, reset)
        return {f"mtp_{depth + 1} loss": value.item() for depth, value in enumerate(values)}
