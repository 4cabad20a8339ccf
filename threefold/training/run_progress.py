"""Where a run stands, for people: a progress line after each log line (iteration x of N,
elapsed, time left) and a summary when training ends.

Megatron-LM's iteration line stays exactly as it is (log parsers read it); these are separate
lines starting with "> ", like threefold's other start-up and status lines.
"""

from __future__ import annotations

import datetime
import time


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class RunProgress:
    """Counts from the first iteration this process trains (a resumed run starts later)."""

    def __init__(self, train_iters: int) -> None:
        self.train_iters = train_iters
        self.start_time: float | None = None
        self.first_iteration = 0
        self.last_loss: float | None = None
        self.best_validation: tuple[float, int] | None = None

    def before_iteration(self, completed: int) -> None:
        if self.start_time is None:
            self.start_time, self.first_iteration = time.perf_counter(), completed

    def trained(self, loss: float) -> None:
        self.last_loss = loss

    def validated(self, iteration: int, loss: float) -> None:
        if self.best_validation is None or loss < self.best_validation[0]:
            self.best_validation = (loss, iteration)

    def _elapsed(self) -> float:
        return 0.0 if self.start_time is None else time.perf_counter() - self.start_time

    def line(self, iteration: int) -> str:
        """`> progress: 40 of 100 iterations (40.0%), 0:00:12 elapsed, about 0:00:18 left`: the
        time left at the mean pace so far (evaluation and checkpoints included). Never the
        words " iteration N": log parsers take such lines for Megatron's iteration line."""
        done = iteration - self.first_iteration
        left = self.train_iters - iteration
        pace = self._elapsed() / done if done else 0.0
        return (
            f"> progress: {iteration} of {self.train_iters} iterations "
            f"({100 * iteration / self.train_iters:.1f}%), {_clock(self._elapsed())} elapsed, "
            f"about {_clock(pace * left)} left"
        )

    def summary(self, iteration: int, checkpoint: str | None, unsaved: str = "no --save") -> str:
        """What the run did, in one line: iterations and time, the last training loss, the
        best validation loss, where the last checkpoint is."""
        done = iteration - self.first_iteration
        parts = [f"> done: {done} iterations (to {iteration}) in {_clock(self._elapsed())}"]
        if self.last_loss is not None:
            parts.append(f"last training loss {self.last_loss:.4f}")
        if self.best_validation is not None:
            loss, at = self.best_validation
            parts.append(f"best validation loss {loss:.4f} after {at} iterations")
        parts.append(f"checkpoint {checkpoint}" if checkpoint else f"no checkpoint ({unsaved})")
        return "; ".join(parts)
