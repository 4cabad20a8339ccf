"""Learning-rate schedule with Megatron's semantics: linear warmup from 0 over
`--lr-warmup-iters`, then constant, linear or cosine decay to `--min-lr` at `--lr-decay-iters`,
and `--min-lr` after that. Under --train-samples the steps are samples: warmup over
`--lr-warmup-samples`, decay until `--lr-decay-samples`, one global batch per iteration.

Parameter groups marked `decoupled_lr` (the embeddings and output layer under --decoupled-lr)
follow the same schedule between --decoupled-lr and --decoupled-min-lr (default: --min-lr)."""

from __future__ import annotations

import math

from threefold.config import TrainingConfig


class OptimizerParamScheduler:
    def __init__(self, optimizer, config: TrainingConfig) -> None:
        self.optimizer = optimizer
        self.max_lr, self.min_lr = config.lr, config.min_lr
        self.decoupled = (config.decoupled_lr, config.decoupled_min_lr
                          if config.decoupled_min_lr is not None else config.min_lr)
        self.in_samples = config.train_samples is not None
        if self.in_samples:
            self.warmup_steps = config.lr_warmup_samples
            self.decay_steps = config.lr_decay_samples
        else:
            self.warmup_steps, self.decay_steps = config.lr_warmup_iters, config.lr_decay_iters
        self.style = config.lr_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, decoupled: bool = False) -> float:
        max_lr, min_lr = self.decoupled if decoupled else (self.max_lr, self.min_lr)
        if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
            return max_lr * self.num_steps / self.warmup_steps
        if self.style == "constant":
            return max_lr
        if self.num_steps > self.decay_steps:
            return min_lr
        decay_ratio = (self.num_steps - self.warmup_steps) / max(
            self.decay_steps - self.warmup_steps, 1)
        if self.style == "linear":
            coefficient = 1.0 - decay_ratio
        else:
            coefficient = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coefficient * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group.get("decoupled_lr", False))
        return self.get_lr()

    def iteration_done(self, global_batch_size: int) -> float:
        """Advance past one updated iteration of `global_batch_size` samples."""
        return self.step(global_batch_size if self.in_samples else 1)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.num_steps = 0
        self.step(state_dict["num_steps"])
