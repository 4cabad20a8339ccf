"""When to leave the training loop early, with a checkpoint: Megatron's `--exit-interval`,
`--exit-duration-in-mins` and `--exit-signal-handler`.

A cluster scheduler announces the end of an allocation with a signal (Slurm's
`#SBATCH --signal=USR1@90`, or SIGTERM before a kill). The handler only records it; the loop
finishes the iteration it is in, saves and exits 0, and a requeued job resumes from that save.
Signals and clocks reach the ranks at different moments, so the ranks agree on stopping through
one small all-reduce after each iteration; otherwise some would enter the next iteration's
collectives while the others save.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from threefold.config import TrainingConfig
from threefold.training.exit_signals import exit_signal_handler


class ExitConditions:
    """Checked after every iteration; `reason(iteration)` is the same on every rank."""

    def __init__(
        self, training: TrainingConfig, device: torch.device, start_time: float | None = None
    ) -> None:
        self.interval = training.exit_interval
        self.duration_s = (
            training.exit_duration_in_mins * 60
            if training.exit_duration_in_mins is not None
            else None
        )
        self.device = device
        self.start_time = time.time() if start_time is None else start_time
        self.signals = exit_signal_handler() if training.exit_signal_handler else None

    def reason(self, iteration: int) -> str | None:
        if self.interval is not None and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"  # the same iteration on every rank
        if self.signals is None and self.duration_s is None:
            return None
        local = torch.tensor(
            [
                self.signals is not None and self.signals.received is not None,
                self.duration_s is not None and time.time() - self.start_time > self.duration_s,
            ],
            dtype=torch.int32,
            device=self.device,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        received, overtime = local.tolist()
        if received:
            name = self.signals.received.name if self.signals.received else "a signal"
            return f"--exit-signal-handler: received {name} (on this or another rank)"
        if overtime:
            return f"--exit-duration-in-mins {self.duration_s / 60:g} reached"
        return None

    def close(self) -> None:
        if self.signals is not None:
            self.signals.close()
