"""Learning-rate and weight-decay schedules with Megatron-LM's semantics (its
OptimizerParamScheduler).

Learning rate: linear warmup from `--lr-warmup-init` (default 0) over `--lr-warmup-iters`, then
by `--lr-decay-style`
- constant: --lr;
- linear / cosine: from --lr down to `--min-lr` at `--lr-decay-iters`;
- inverse-square-root: --lr x sqrt(warmup / step), never below --min-lr;
- WSD (warmup-stable-decay): --lr until the last `--lr-wsd-decay-iters` before
  --lr-decay-iters, then down to --min-lr by `--lr-wsd-decay-style` (exponential, linear,
  cosine or minus_sqrt);
and --min-lr after --lr-decay-iters. Under --train-samples every step count is in samples
(`--lr-warmup-samples`, `--lr-decay-samples`, `--lr-wsd-decay-samples`), one global batch per
iteration. Groups marked `decoupled_lr` (the embeddings and output layer under --decoupled-lr)
follow the same schedule between --decoupled-lr and --decoupled-min-lr.

Weight decay: `--weight-decay` throughout, or with `--weight-decay-incr-style linear|cosine`
from `--start-weight-decay` to `--end-weight-decay` over the whole run; groups with
`wd_mult` 0 (biases and norms) never decay.

A checkpoint stores the schedule; what a resumed run follows is threefold/config/lr_schedule.py's
(the run's flags must describe the same schedule unless --override-opt_param-scheduler or
--use-checkpoint-opt_param-scheduler says which wins).
"""

from __future__ import annotations

import math

from threefold.config import TrainingConfig
from threefold.config.lr_schedule import lr_schedule, resumed_lr_schedule


def _decayed(style: str, ratio: float) -> float:
    """The coefficient from 1 (ratio 0) down to 0 (ratio 1) of a decay style."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5**ratio - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


class OptimizerParamScheduler:
    def __init__(self, optimizer, config: TrainingConfig) -> None:
        self.optimizer, self.config = optimizer, config
        self.in_samples = config.train_samples is not None
        self.schedule = lr_schedule(config)
        self.num_steps = 0
        self.step(0)

    def get_lr(self, decoupled: bool = False, lr_mult: float = 1.0) -> float:
        """The learning rate of a group (`decoupled`: --decoupled-lr's; `lr_mult`: muP's hidden
        matrices', whose peak and floor it scales, as megatron-core's per-group max_lr and
        min_lr: the warmup starts from --lr-warmup-init in every group)."""
        s = self.schedule
        max_lr, min_lr = (
            (s["decoupled_lr"], s["decoupled_min_lr"]) if decoupled else (s["max_lr"], s["min_lr"])
        )
        max_lr, min_lr = max_lr * lr_mult, min_lr * lr_mult
        warmup, decay, style = s["warmup_steps"], s["decay_steps"], s["decay_style"]
        if warmup > 0 and self.num_steps <= warmup:
            start = s.get("init_lr", 0.0)  # (a checkpoint's schedule from before the flag)
            return start + (max_lr - start) * self.num_steps / warmup
        if style == "constant":
            return max_lr
        if self.num_steps > decay:
            return min_lr
        if style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(warmup, 1) / max(self.num_steps, 1)))
        if style == "WSD":
            anneal_start = decay - s["wsd_decay_steps"]
            coefficient = (
                1.0
                if self.num_steps <= anneal_start
                else _decayed(
                    s["wsd_decay_style"], (self.num_steps - anneal_start) / s["wsd_decay_steps"]
                )
            )
        else:
            coefficient = _decayed(style, (self.num_steps - warmup) / max(decay - warmup, 1))
        return min_lr + coefficient * (max_lr - min_lr)

    def get_wd(self) -> float:
        s = self.schedule
        if s["wd_incr_style"] == "constant" or self.num_steps > s["wd_incr_steps"]:
            return s["end_wd"]
        ratio = self.num_steps / s["wd_incr_steps"]
        rising = ratio if s["wd_incr_style"] == "linear" else _decayed("cosine", 1.0 - ratio)
        return s["start_wd"] + rising * (s["end_wd"] - s["start_wd"])

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        weight_decay = self.get_wd()
        for group in self.optimizer.param_groups:
            decoupled = group.get("decoupled_lr", False)
            group["lr"] = self.get_lr(decoupled, group.get("lr_mult", 1.0))
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        return self.get_lr()

    def iteration_done(self, global_batch_size: int) -> float:
        """Advance past one updated iteration of `global_batch_size` samples."""
        return self.step(global_batch_size if self.in_samples else 1)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **self.schedule}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the checkpoint's step, on the schedule `resumed_lr_schedule` settles."""
        self.schedule = resumed_lr_schedule(state_dict, self.config)
        self.num_steps = 0
        self.step(state_dict["num_steps"])
