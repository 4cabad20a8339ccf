"""Megatron-LM's timers: named phases timed on every rank and reported across ranks.

`--timing-log-level` decides which timers exist; one above it costs nothing:

    0  start-up (model-and-optimizer-setup, train/valid/test-data-iterators-setup,
       load-checkpoint) and save-checkpoint, each reported when it happens
    1  per iteration: forward-backward, all-grads-sync (the data-parallel reduction),
       optimizer
    2  per micro-batch: batch-generator, forward-compute, backward-compute, and the pipeline's
       forward-recv, forward-send, backward-recv, backward-send

Every start and stop synchronizes the GPU so that a timer measures the work and not its launch;
level 1 timers also start with a barrier (unless --no-barrier-with-level-1-timing) so that
they measure the phase, not the wait for a slower rank. Levels 1 and 2 therefore cost a little
speed on a GPU. At every --log-interval the per-iteration timers are averaged over the
iterations since the last report and printed as --timing-log-option says: `max` or `minmax`
(the default) over the ranks that ran them, or `all` ranks' times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

LEVELS = (0, 1, 2)
OPTIONS = ("max", "minmax", "all")
SETUP = ("model-and-optimizer-setup", "train/valid/test-data-iterators-setup", "load-checkpoint")
# The per-iteration timers in the order they are reported, with their levels.
ITERATION = {
    "forward-backward": 1,
    "forward-compute": 2,
    "backward-compute": 2,
    "batch-generator": 2,
    "forward-recv": 2,
    "forward-send": 2,
    "backward-recv": 2,
    "backward-send": 2,
    "all-grads-sync": 1,
    "optimizer": 1,
}
_NAME_WIDTH = 48
_INACTIVE = contextlib.nullcontext()


class Timers:
    def __init__(
        self,
        level: int = 0,
        option: str = "minmax",
        barrier_level_1: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.level, self.option, self.barrier_level_1 = level, option, barrier_level_1
        self.device = device or torch.device("cpu")
        self.elapsed: dict[str, float] = {}  # seconds accumulated since the last report

    def __call__(self, name: str, level: int) -> contextlib.AbstractContextManager:
        """Time the block under `name` when `level` is within --timing-log-level (above it,
        a shared no-op: the schedules call this per micro-batch)."""
        return _INACTIVE if level > self.level else self._timed(name, level)

    @contextlib.contextmanager
    def _timed(self, name: str, level: int) -> Iterator[None]:
        if level == 1 and self.barrier_level_1 and dist.is_initialized():
            dist.barrier()
        self._synchronize()
        start = time.perf_counter()
        yield
        self._synchronize()
        self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def report(
        self, names: tuple[str, ...] | list[str], normalizer: int = 1, reset: bool = True
    ) -> tuple[str | None, dict[str, float]]:
        """Collective over all ranks (every rank calls it with the same names): the block to
        print (None when no rank ran any of them) and the max over ranks in ms per name ran.
        The reported timers restart from zero if `reset`."""
        names = [name for name in names if ITERATION.get(name, 0) <= self.level]
        if not names:
            return None, {}
        read = self.elapsed.pop if reset else self.elapsed.get
        local = torch.tensor(
            [read(name, 0.0) * 1e3 / normalizer for name in names], dtype=torch.float64
        )
        per_rank = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            # NCCL gathers only device tensors; gloo takes the CPU ones as they are.
            moved = local.to(self.device)
            per_rank = [torch.empty_like(moved) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, moved)
        times = torch.stack(per_rank).cpu()  # [rank, name]
        maxima = {
            name: times[:, i].max().item()
            for i, name in enumerate(names)
            if (times[:, i] > 0).any()
        }
        if not maxima:
            return None, {}
        return self._format(names, times), maxima

    def _format(self, names: list[str], times: torch.Tensor) -> str:
        if self.option == "all":
            lines = ["times across ranks (ms):"]
            for i, name in enumerate(names):
                ran = [(rank, t) for rank, t in enumerate(times[:, i].tolist()) if t > 0]
                if ran:
                    lines.append(f"  {name}:")
                    lines += [f"     rank {rank:2d}: {t:.2f}" for rank, t in ran]
            return "\n".join(lines)
        lines = [
            "max time across ranks (ms):"
            if self.option == "max"
            else "(min, max) time across ranks (ms):"
        ]
        for i, name in enumerate(names):
            ran = times[:, i][times[:, i] > 0]
            if ran.numel():
                label = (name + " ").ljust(_NAME_WIDTH, ".")
                value = (
                    f"{ran.max().item():.2f}"
                    if self.option == "max"
                    else f"({ran.min().item():.2f}, {ran.max().item():.2f})"
                )
                lines.append(f"    {label}: {value}")
        return "\n".join(lines)
