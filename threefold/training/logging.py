"""The training log line in Megatron-LM's format (existing log parsers read it) and
TensorBoard scalars."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tflops_per_device: float
    mfu: float | None = None
    memory_gib: float | None = None


def format_iteration(stats: IterationStats) -> str:
    line = (f" iteration {stats.iteration:8d}/{stats.train_iters:8d} |"
            f" consumed samples: {stats.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {stats.elapsed_ms:.1f} |"
            f" learning rate: {stats.learning_rate:.6E} |"
            f" global batch size: {stats.global_batch_size:5d} |"
            f" lm loss: {stats.lm_loss:.6E} |"
            f" loss scale: {stats.loss_scale:.1f} |")
    if stats.grad_norm is not None:
        line += f" grad norm: {stats.grad_norm:.3f} |"
    line += (f" number of skipped iterations: {stats.skipped_iterations:3d} |"
             f" number of nan iterations: {stats.nan_iterations:3d} |"
             f" tokens per second: {stats.tokens_per_second:.1f} |"
             f" TFLOP/s per device: {stats.tflops_per_device:.3f} |")
    if stats.mfu is not None:
        line += f" MFU: {100 * stats.mfu:.1f}% |"
    if stats.memory_gib is not None:
        line += f" max memory (GiB): {stats.memory_gib:.2f} |"
    return line


def format_validation(iteration: int, loss: float, split: str = "validation") -> str:
    ppl = math.exp(min(20.0, loss))
    return (f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |")


class TensorBoardLogger:
    def __init__(self, log_dir: str | None) -> None:
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def log_iteration(self, stats: IterationStats) -> None:
        if self.writer is None:
            return
        step = stats.iteration
        for name, value in (("lm loss", stats.lm_loss), ("learning-rate", stats.learning_rate),
                            ("loss-scale", stats.loss_scale), ("grad-norm", stats.grad_norm),
                            ("tokens-per-second", stats.tokens_per_second),
                            ("tflops-per-device", stats.tflops_per_device),
                            ("mfu", stats.mfu), ("max-memory-gib", stats.memory_gib)):
            if value is not None:
                self.writer.add_scalar(name, value, step)

    def log_validation(self, iteration: int, loss: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)
            self.writer.add_scalar("lm loss validation ppl", math.exp(min(20.0, loss)), iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
