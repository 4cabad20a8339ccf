"""Everything that watches the training loop without changing what it computes, entered once.

    metric writers      the Megatron log line, TensorBoard, Weights & Biases (training/logging)
    log window          iterations, samples and losses since the last log line (the run's
                        first line, Megatron-LM's after its first iteration, closes none)
    timers              Megatron's timers, reported with the log line (training/timers)
    profiler            --profile's window of iterations (training/profiling)
    watchdog            stall and straggler reports (training/watchdog)
    memory hygiene      --manual-gc, --empty-unused-memory-level (training/memory_hygiene)
    spiky-loss check    --check-for-spiky-loss (training/numerics)
    exit conditions     --exit-interval, --exit-duration-in-mins, signals (training/exit_conditions)
    run progress        progress / time-left lines and the end-of-run summary (run_progress)

`with observability:` starts the live parts for the loop and closes all of them, in reverse
order, however the loop ends. Outside it (start-up, the parity tests' single steps) the
watchdog is a stand-in that records nothing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import torch

from threefold.config import Config
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.exit_conditions import ExitConditions
from threefold.training.logging import (
    LogWindow,
    MetricWriters,
    format_iteration,
    format_validation,
    iteration_stats,
)
from threefold.training.memory_hygiene import MemoryHygiene
from threefold.training.numerics import SpikyLossDetector
from threefold.training.profiling import IterationProfiler
from threefold.training.run_progress import RunProgress
from threefold.training.timers import ITERATION, Timers
from threefold.training.watchdog import Watchdog


class Observability:
    def __init__(
        self, config: Config, parallel: ParallelContext, device: torch.device, start_time: float
    ) -> None:
        self.config, self.device, self.world_size = config, device, parallel.world.size
        logging = config.logging
        self.timers = Timers(
            logging.timing_log_level,
            logging.timing_log_option,
            logging.barrier_with_l1_time,
            device,
        )
        self.flops_per_iteration = 0.0  # the trainer sets it once the model is built
        self.rank = parallel.world.rank
        self.start_time = start_time  # --exit-duration-in-mins counts from here
        self.watchdog = Watchdog(config.parallel.distributed_timeout_minutes, live=False)
        self.hygiene = MemoryHygiene(config.training, device)
        self.profiler = IterationProfiler(config.logging, device, self.rank)
        self.window = LogWindow()
        self.first_line_due = False  # until the loop starts
        self.run_progress = RunProgress(config.training.train_iters)
        self._stack = contextlib.ExitStack()

    def print(self, message: str) -> None:
        if self.rank == 0:
            _write_line(message)

    def print_last(self, message: str) -> None:
        """Megatron-LM prints its iteration and evaluation lines on the last rank (a rank of
        the last pipeline stage, where the loss is computed)."""
        if self.rank == self.world_size - 1:
            _write_line(message)

    def print_timers(
        self, names: list[str] | tuple[str, ...], normalizer: int = 1, reset: bool = True
    ) -> dict[str, float]:
        """Report timers (collective: every rank calls it) and print them on rank 0; returns
        the max over ranks in ms per timer."""
        text, maxima = self.timers.report(names, normalizer, reset)
        if text:
            self.print(text)
        return maxima

    # -- the loop's lifetime -------------------------------------------------------------------
    def __enter__(self) -> Observability:
        config, logging, training = self.config, self.config.logging, self.config.training
        stack = self._stack
        self.writers = MetricWriters(logging if self.rank == 0 else None, config)
        stack.callback(self.writers.close)
        self.watchdog = Watchdog(
            config.parallel.distributed_timeout_minutes,
            logging.straggler_factor if logging.log_straggler else None,
        )
        stack.callback(self.watchdog.close)
        self.exits = ExitConditions(training, self.device, self.start_time)
        stack.callback(self.exits.close)
        stack.enter_context(self.hygiene)  # its first collection is not iteration time
        stack.callback(self._close_profiler)
        self.spikes = (
            SpikyLossDetector(training.spiky_loss_factor) if training.check_for_spiky_loss else None
        )
        self.window = LogWindow()
        self.first_line_due = True
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.__exit__(*exc_info)

    def _close_profiler(self) -> None:
        written = self.profiler.close()
        if written:
            print(written, flush=True)

    # -- around each iteration -----------------------------------------------------------------
    def before_iteration(self, completed: int) -> None:
        self.run_progress.before_iteration(completed)
        self.profiler.before_iteration(completed)

    def after_iteration(
        self, iteration: int, loss: float, skipped: bool, first_sample: int, global_batch_size: int
    ) -> None:
        written = self.profiler.after_iteration(iteration)
        if written:
            print(written, flush=True)
        self.hygiene.after_iteration(iteration)
        if self.spikes is not None:
            report = self.spikes.observe(loss, iteration, first_sample, global_batch_size)
            if report:
                self.print(report)
        self.window.add(loss, skipped, global_batch_size)
        if not skipped:
            self.run_progress.trained(loss)

    def log_due(self, iteration: int) -> bool:
        """Every --log-interval iterations, and after the first iteration this process trains:
        Megatron-LM's line that shows what the start cost (a resumed run's too)."""
        return self.first_line_due or self.closes_window(iteration)

    def closes_window(self, iteration: int) -> bool:
        """Whether the line at `iteration` closes its window: a line at --log-interval does.
        The first line between them leaves it open, as Megatron-LM's does, so the next line
        covers its interval whole. (Megatron-LM leaves the first line's window open at any
        interval: at --log-interval 1 its second line is the mean of two iterations, which no
        longer compares with an uninterrupted run's; threefold's is the iteration's own.)"""
        return iteration % self.config.logging.log_interval == 0

    def log(self, progress: dict) -> None:
        """The log line of the window (`progress`: the run's own numbers, training/logging's
        `progress`) and its timers; at --log-interval, the metric writers' point and the
        straggler report too, and a new window (the first line is only printed)."""
        logging, window, iteration = self.config.logging, self.window, progress["iteration"]
        closes = self.closes_window(iteration)
        self.first_line_due = False
        stats = iteration_stats(
            self.config, self.device, self.world_size, self.flops_per_iteration, window, **progress
        )
        self.print_last(format_iteration(stats))
        self.print(self.run_progress.line(iteration))
        maxima = self.print_timers(list(ITERATION), window.iterations, reset=closes)
        if closes:
            if logging.log_timers_to_tensorboard:
                stats.timers = maxima
            self.writers.log_iteration(stats)
            report = self.watchdog.straggler_report(
                iteration // logging.log_interval, iteration - window.iterations + 1, iteration
            )
            if report:
                self.print(report)
            self.window = LogWindow()

    @contextlib.contextmanager
    def evaluation(self, iteration: int) -> Iterator[None]:
        self.watchdog.enter("evaluation", iteration)
        with self.hygiene.evaluation():
            yield
        self.restart_window()

    def validation(
        self, iteration: int, loss: float | None, on: str | None = None, split: str = "validation"
    ) -> None:
        """Report an evaluation; `on`: Megatron's after-training reports ("validation set",
        "test set"); a test-set loss is not a validation point. `split`: the validation set's
        name (`validation-NAME` for one of --multiple-validation-sets, whose losses are not
        the run's best)."""
        if loss is None:
            return
        prefix = f"iteration {iteration}" + (f" on {on}" if on else "")
        self.print_last(format_validation(prefix, loss, split))
        if on != "test set":
            self.writers.log_validation(iteration, loss, split)
            if split == "validation":
                self.run_progress.validated(iteration, loss)

    def restart_window(self) -> None:
        """Evaluation and checkpoint time is not iteration time."""
        self.window.start = time.perf_counter()

    def exit_reason(self, iteration: int) -> str | None:
        return self.exits.reason(iteration)


def _write_line(message: str) -> None:
    """One write per line: rank 0 and the last rank share the terminal (or torchrun's pipe),
    and print()'s separate write of the newline, unbuffered, lets another rank's line in."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()
