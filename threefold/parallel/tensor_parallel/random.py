"""Random-number streams for dropout under tensor parallelism, as Megatron arranges them.

Two streams exist on every rank:
- the default stream, seeded identically on all TP ranks (seed + 100 * pipeline rank), used for
  dropout on activations that are replicated across the TP group, so the masks agree;
- the 'model-parallel-rng' stream, seeded seed + 2718 + TP rank, used inside `fork()` for dropout
  on activations that are split across the TP group (attention probabilities of a rank's heads,
  or a rank's sequence slice under sequence parallelism), so the masks differ.
Data-parallel replicas use the same seeds: they must agree on everything but their data.
Context-parallel ranks hold different tokens of one sequence, so both of their streams are
offset by the CP rank (Megatron leaves them equal, which repeats one rank's dropout pattern on
every other rank's tokens).

Megatron's tracker swaps CUDA generator states; this one swaps whichever generator the model's
device draws from, so it works on CPU too.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from threefold.parallel.parallel_context import ParallelContext

MODEL_PARALLEL_RNG = "model-parallel-rng"
_CP_SEED_OFFSET = 104729  # a prime far above the pipeline offsets (100 per stage)


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, rng_state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(rng_state)
    else:
        torch.set_rng_state(rng_state)


class RNGStatesTracker:
    """Named generator states that `fork()` swaps in and out of the device's default generator."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cpu"

    def reset(self, device_type: str = "cpu") -> None:
        self.states = {}
        self.device_type = device_type

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call set_random_seed first")
        saved = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def set_random_seed(seed: int, parallel: ParallelContext, device_type: str = "cpu") -> None:
    """Seed every generator of this rank the way Megatron's `_set_random_seed` does."""
    seed = seed + 100 * parallel.pp.rank + _CP_SEED_OFFSET * parallel.cp.rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + parallel.tp.rank)
