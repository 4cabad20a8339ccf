"""Losses that layers add to the gradient beside the language-model loss, kept for the log:
multi-token prediction's (training/mtp_losses.py) and DeepSeek sparse attention's indexer loss
(training/indexer_losses.py).

The layers (of `kind`) sum their losses over an iteration's micro-batches (`take_losses`:
a tensor of `width` values, or None); after every iteration they are added up here, divided
by the number of micro-batches. A report reduces the window once: summed over the pipeline
stages (each holds its own layers), averaged over data-parallel replicas and over the window's
iterations. (Every TP rank computes the whole loss: nothing to sum there.) Each step the
trainer hands the layers the factor the schedule puts on the main loss, which their losses'
gradients take (`aux_loss_scale`), and --calculate-per-token-loss's choice (`per_token_loss`).
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.parallel.parallel_context import ParallelContext


class LayerLosses:
    def __init__(
        self, model_chunks: list[nn.Module], kind: type, width: int, parallel: ParallelContext
    ) -> None:
        self.parallel, self.width = parallel, width
        self.layers = [
            module
            for chunk in model_chunks
            for module in chunk.modules()
            if isinstance(module, kind)
        ]
        self._reset()

    def _reset(self) -> None:
        self.iterations = 0
        self.sums = torch.zeros(self.width, dtype=torch.float64)

    def start(self, scale: float, per_token_loss: bool) -> None:
        """A schedule's run begins: the gradient factor of the layers' losses, and whether
        they are sums (--calculate-per-token-loss) or means."""
        for layer in self.layers:
            layer.aux_loss_scale, layer.per_token_loss = scale, per_token_loss

    def after_iteration(self, num_microbatches: int) -> None:
        for layer in self.layers:
            losses = layer.take_losses()
            if losses is not None:
                self.sums += losses.double().cpu() / num_microbatches
        self.iterations += 1

    def _window_means(self, device: torch.device, reset: bool = True) -> torch.Tensor:
        """The sums' means over the window, reduced over all ranks (every rank calls); the
        window goes on unless `reset`."""
        sums = self.sums.to(device)
        self.parallel.pp.all_reduce(sums)
        self.parallel.dp.all_reduce(sums)
        values = sums.cpu() / self.parallel.dp.size / max(self.iterations, 1)
        if reset:
            self._reset()
        return values
