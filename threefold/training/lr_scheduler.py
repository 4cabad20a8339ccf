"""Learning-rate schedule with Megatron's semantics: linear warmup from 0 over
`--lr-warmup-iters`, then constant, linear or cosine decay to `--min-lr` at `--lr-decay-iters`,
and `--min-lr` after that."""

from __future__ import annotations

import math

from threefold.config import TrainingConfig


class OptimizerParamScheduler:
    def __init__(self, optimizer, config: TrainingConfig) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr = config.lr, config.min_lr
        self.warmup_steps = config.lr_warmup_iters
        self.decay_steps = config.lr_decay_iters
        self.style = config.lr_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return self.max_lr * self.num_steps / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if self.num_steps > self.decay_steps:
            return self.min_lr
        decay_ratio = (self.num_steps - self.warmup_steps) / max(
            self.decay_steps - self.warmup_steps, 1)
        if self.style == "linear":
            coefficient = 1.0 - decay_ratio
        else:
            coefficient = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.num_steps = 0
        self.step(state_dict["num_steps"])
