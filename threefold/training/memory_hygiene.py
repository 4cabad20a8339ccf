"""Megatron-LM's memory hygiene around the training loop.

`--manual-gc`: Python's cyclic collector runs when allocation counts say so, which is at a
different moment on every rank; a rank collecting stalls all the others at the next collective.
With the flag, automatic collection is off during `Trainer.train` and a collection runs every
`--manual-gc-interval` iterations (0: never on a schedule) and, unless `--no-manual-gc-eval`,
before and after each evaluation. The collector's previous state is restored afterwards.

`--empty-unused-memory-level`: return the CUDA caching allocator's unused blocks to the driver
(`torch.cuda.empty_cache`); level 1 after each training iteration and evaluation, level 2 also
between backward and the optimizer step. Nothing is cached on the CPU: there it does nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from threefold.config import TrainingConfig


class MemoryHygiene:
    def __init__(self, training: TrainingConfig, device: torch.device) -> None:
        self.training = training
        self.cuda = device.type == "cuda"
        self._collector_was_enabled: bool | None = None

    def __enter__(self) -> MemoryHygiene:
        if self.training.manual_gc:
            self._collector_was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._collector_was_enabled:
            gc.enable()
        self._collector_was_enabled = None

    def _empty_cache(self, level: int) -> None:
        if self.cuda and self.training.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    def before_optimizer_step(self) -> None:
        self._empty_cache(2)

    def after_iteration(self, iteration: int) -> None:
        interval = self.training.manual_gc_interval
        if self.training.manual_gc and interval and iteration % interval == 0:
            gc.collect()
        self._empty_cache(1)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        collect = self.training.manual_gc and self.training.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()
        self._empty_cache(1)
