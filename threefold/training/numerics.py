"""Guards on the numbers a step produces.

`--check-for-nan-in-loss-and-grad` (Megatron's flag): after backward and before the gradients
are reduced, every rank looks at its own losses and gradients (under --overlap-grad-reduce,
each bucket as its reduction starts, as Megatron-LM's DDP does: once it started, the bucket's
storage is the collective's to write); the ranks share what they found
in one all-reduce, so all of them stop at the same iteration, and the message names the ranks
where the first non-finite value appeared. Nothing is saved after that: the last checkpoint is
the last good state. (fp16 runs do not need it: the loss scaler skips such steps and backs off.)

`--check-for-large-grads` (Megatron-LM's, as its rerun state machine runs it when reruns are
disabled: a warning, the run goes on): each step, each gradient bucket's L2 norm on this rank
before its reduction; the first 100 norms (bucket by bucket, step by step) set the largest
expected, and from then on a norm of 10 times that or more is reported by the rank that saw
it, in Megatron-LM's words.

`--check-for-spiky-loss` (also Megatron's flag, here reporting only): a loss above
`--spiky-loss-factor` times the mean of the recent finite losses is logged with the global batch
and the sample indices it was computed on, so the batch can be inspected.
"""

from __future__ import annotations

import math
import os
from collections import deque

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient with --check-for-nan-in-loss-and-grad."""


def _ranks(flags: torch.Tensor) -> str:
    ranks = flags.nonzero().flatten().tolist()
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_loss_and_grads(
    losses: list[torch.Tensor], grads_finite: torch.Tensor, iteration: int
) -> None:
    """Raise NonFiniteError on every rank if any rank's local losses or gradients hold inf or
    nan. `grads_finite`: whether this rank's gradients before the data-parallel reduction are
    (the data parallelism's `local_grads_finite`, a device bool)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = grads_finite.device
    flags = torch.zeros(2, world, device=device)
    # On by default, so every iteration runs it: the tests stay on the device, and the one
    # host sync is the reduced flags' below (not one per tensor).
    if losses:
        finite = torch.stack([torch.isfinite(t).all().to(device) for t in losses]).all()
        flags[0, rank] = (~finite).float()
    flags[1, rank] = (~grads_finite).float()
    if world > 1:
        dist.all_reduce(flags)
    bad_loss, bad_grad = flags[0] > 0, flags[1] > 0
    if bad_loss.any():
        found = f"non-finite loss on {_ranks(bad_loss)}"
    elif bad_grad.any():
        found = f"non-finite gradient on {_ranks(bad_grad)}"
    else:
        return
    raise NonFiniteError(f"--check-for-nan-in-loss-and-grad: {found} at iteration {iteration}")


class SpikyLossDetector:
    """Flags a loss above `factor` times the mean of the last `window` finite losses."""

    def __init__(self, factor: float, window: int = 20) -> None:
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def observe(
        self, loss: float, iteration: int, first_sample: int, global_batch_size: int
    ) -> str | None:
        """A report when `loss` (of global batch `iteration - 1`, samples `first_sample` ...)
        is a spike; the spike is kept out of the running mean."""
        if not torch.isfinite(torch.tensor(loss)):
            return None
        mean = sum(self.recent) / len(self.recent) if self.recent else None
        if mean is not None and len(self.recent) >= 5 and loss > self.factor * mean:
            return (
                f"  spiky loss at iteration {iteration}: lm loss {loss:.6E} is "
                f"{loss / mean:.1f}x the mean of the last {len(self.recent)} iterations "
                f"(--spiky-loss-factor {self.factor:g}); global batch {iteration - 1}, "
                f"samples {first_sample} to {first_sample + global_batch_size - 1}"
            )
        self.recent.append(loss)
        return None


class LargeGradsDetector:
    """Megatron-LM's `is_unexpectedly_large(threshold=10, context="grads")` over the bucket
    norms: its first `samples` values set the largest, after which a value of `threshold`
    times that is flagged. NaN and Inf are --check-for-nan-in-loss-and-grad's."""

    def __init__(self, rank: int, threshold: float = 10.0, samples: int = 100) -> None:
        self.rank, self.threshold, self.samples = rank, threshold, samples
        self.seen, self.largest = 0, 0.0

    def observe(self, norms: list[torch.Tensor], iteration: int) -> list[str]:
        """Reports of this iteration's unexpectedly large bucket norms (one host sync)."""
        values = torch.stack(norms).tolist() if norms else []
        reports = []
        for bucket, value in enumerate(values):
            value = math.fabs(value)
            if not math.isfinite(value):
                continue
            if self.seen < self.samples:
                self.seen += 1
                self.largest = max(self.largest, value)
                continue
            if value >= self.largest * self.threshold:
                reports.append(
                    f"Rank {self.rank}, node {os.uname()[1]}, iteration {iteration}: Unexpected "
                    f"result {value:.6E} (message='found unexpected large grads in bucket "
                    f"#{bucket} in backward pass before data-parallel communication collective')"
                )
        return reports
