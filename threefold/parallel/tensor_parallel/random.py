"""Random-number streams for dropout under tensor and expert parallelism, as Megatron arranges
them.

On every rank:
- the default stream, seeded identically on all TP ranks (seed + 100 * pipeline rank), used for
  dropout on activations that are replicated across the TP group, so the masks agree;
- the 'model-parallel-rng' stream, seeded seed + 2718 + TP rank, used inside `fork()` for dropout
  on activations that are split across the TP group (attention probabilities of a rank's heads,
  or a rank's sequence slice under sequence parallelism), so the masks differ;
- the 'expert-parallel-rng' stream, Megatron's, seeded seed + 1024 + 100 * EP rank + expert-TP
  rank, for dropout inside an expert on activations split across the expert-TP group (a LoRA
  adapter's input to fc2);
- the 'expert-model-parallel-rng' stream, seeded by the EP rank alone (`_EXPERT_SHARED_OFFSET`
  above Megatron's), for dropout inside an expert on activations its expert-TP ranks share (a
  LoRA adapter's input to fc1), so their masks agree.
An expert draws as many numbers as tokens were routed to it, which differ from EP rank to EP
rank, and the TP ranks can be different EP ranks (expert TP 1): from the TP streams, those
draws would put the ranks' default streams out of step, and with them every later mask that
must agree over TP. Hence streams of the experts' own.
Data-parallel replicas use the same seeds: they must agree on everything but their data (the
experts' streams aside: the EP ranks among them hold other experts).
Context-parallel ranks hold different tokens of one sequence, so all of their streams are
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
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
EXPERT_MODEL_PARALLEL_RNG = "expert-model-parallel-rng"
_CP_SEED_OFFSET = 104729  # a prime far above the pipeline offsets (100 per stage)
_EXPERT_SHARED_OFFSET = 7919  # a prime above any expert-TP rank: no expert seed repeats
_EXPERT_STREAMS = (EXPERT_PARALLEL_RNG, EXPERT_MODEL_PARALLEL_RNG)


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
        self.seeds: dict[str, int] = {}
        self.device_type = "cpu"

    def reset(self, device_type: str = "cpu") -> None:
        self.states, self.seeds = {}, {}
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
        self.seeds[name] = seed
        _set_state(self.device_type, saved)

    def resume(self, states: dict[str, torch.Tensor], seeds: dict[str, int]) -> None:
        """Take up a checkpoint's streams (`seeds`: the seeds they started from; none in files
        that predate them). The experts' streams only where they started from this rank's
        seeds: at another data-parallel size the saved rank whose streams this one resumes
        (the one at its TP, CP and PP place) can have held other experts. Streams the
        checkpoint lacks stay as seeded."""
        self.states = self.states | {
            name: state
            for name, state in states.items()
            if name not in _EXPERT_STREAMS or seeds.get(name) == self.seeds.get(name)
        }

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
    expert = seed + 1024 + 100 * parallel.ep.rank
    _TRACKER.add(EXPERT_PARALLEL_RNG, expert + parallel.expert_tp.rank)
    _TRACKER.add(EXPERT_MODEL_PARALLEL_RNG, expert + _EXPERT_SHARED_OFFSET)
