"""Megatron's `mtp_1 loss`, `mtp_2 loss`, ... for the log line: each multi-token prediction
depth's loss (model/mtp.py), as megatron-core's MTPLossLoggingHelper reports it.

The last pipeline stage's depths sum their losses over an iteration's micro-batches; after
every iteration they are moved here divided by the number of micro-batches. A report reduces
the window once: summed over the pipeline stages (only the last computes them), averaged over
data-parallel replicas and over the window's iterations. (Every TP rank computes the whole
loss: nothing to sum there.) The trainer also hands the depths, each step, the factor the
schedule puts on the main loss, which their losses' gradients take.
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.model.mtp import MultiTokenPredictionBlock
from threefold.parallel.parallel_context import ParallelContext


class MTPLosses:
    def __init__(
        self, model_chunks: list[nn.Module], depths: int, parallel: ParallelContext
    ) -> None:
        self.parallel, self.depths = parallel, depths
        self.blocks = [
            module
            for chunk in model_chunks
            for module in chunk.modules()
            if isinstance(module, MultiTokenPredictionBlock)
        ]
        self._reset()

    def _reset(self) -> None:
        self.iterations = 0
        self.sums = torch.zeros(self.depths, dtype=torch.float64)

    def start(self, scale: float, per_token_loss: bool) -> None:
        """A schedule's run begins: the gradient factor of the depths' losses."""
        for block in self.blocks:
            block.aux_loss_scale, block.per_token_loss = scale, per_token_loss

    def after_iteration(self, num_microbatches: int) -> None:
        for block in self.blocks:
            losses = block.take_losses()
            if losses is not None:
                self.sums += losses.double().cpu() / num_microbatches
        self.iterations += 1

    def report(self, device: torch.device) -> dict[str, float]:
        """{`mtp_k loss`: its mean over the window}, reduced over all ranks; every rank calls."""
        sums = self.sums.to(device)
        self.parallel.pp.all_reduce(sums)
        self.parallel.dp.all_reduce(sums)
        values = sums.cpu() / self.parallel.dp.size / max(self.iterations, 1)
        self._reset()
        return {f"mtp_{depth + 1} loss": value.item() for depth, value in enumerate(values)}
