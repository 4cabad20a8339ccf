"""Activation recomputation (Megatron's --recompute-granularity / -method / -num-layers).

Recomputed regions keep only their inputs during the forward pass and run again during the
backward pass. Dropout inside them must draw the same masks both times: torch's checkpoint
restores the default generator, and `context_fn` here additionally snapshots the TP-split
stream of threefold's RNG tracker at the original forward and reinstates it for the
recomputation (what Megatron's CheckpointFunction does for its CUDA tracker).
"""

from __future__ import annotations

import contextlib

import torch.utils.checkpoint

from threefold.parallel.tensor_parallel.random import get_rng_tracker


class _TrackerSnapshot:
    def __init__(self) -> None:
        self.states = None

    @contextlib.contextmanager
    def during_forward(self):
        self.states = {name: s.clone() for name, s in get_rng_tracker().states.items()}
        yield

    @contextlib.contextmanager
    def during_recompute(self):
        global _recomputing
        tracker = get_rng_tracker()
        current = tracker.states
        tracker.states = {name: s.clone() for name, s in self.states.items()}
        _recomputing += 1
        try:
            yield
        finally:
            _recomputing -= 1
            tracker.states = current


_recomputing = 0


def is_recomputing() -> bool:
    """Inside the backward pass's second forward of a recomputed region: what the forward
    records (MoE routing statistics) was recorded the first time."""
    return _recomputing > 0


# Inside a layer compiled whole (--compile-layers) the recomputed region runs eager between two
# compiled graphs: the compiler's own checkpoint cannot take this `context_fn`.
@torch.compiler.disable
def checkpoint(function, *args):
    """`function(*args)`, recomputed in backward instead of keeping its activations."""
    snapshot = _TrackerSnapshot()
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (snapshot.during_forward(), snapshot.during_recompute()),
    )
