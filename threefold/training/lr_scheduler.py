"""Learning-rate and weight-decay schedules with Megatron-LM's semantics (its
OptimizerParamScheduler).

Learning rate: linear warmup from 0 over `--lr-warmup-iters`, then by `--lr-decay-style`
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

A checkpoint stores the schedule. On resume the run's flags must describe the same schedule
(else the load stops, naming the flag) unless `--override-opt_param-scheduler` (the flags win)
or `--use-checkpoint-opt_param-scheduler` (the checkpoint wins), as in Megatron-LM.
"""

from __future__ import annotations

import math

from threefold.config import ConfigError, TrainingConfig

# Schedule values a checkpoint stores and a resume compares, with the flags that set them.
_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "decay_style": "--lr-decay-style",
    "warmup_steps": "--lr-warmup-iters/--lr-warmup-samples",
    "decay_steps": "--lr-decay-iters/--lr-decay-samples",
    "wsd_decay_steps": "--lr-wsd-decay-iters/--lr-wsd-decay-samples",
    "wsd_decay_style": "--lr-wsd-decay-style",
    "decoupled_lr": "--decoupled-lr",
    "decoupled_min_lr": "--decoupled-min-lr",
    "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay",
    "wd_incr_style": "--weight-decay-incr-style",
    "wd_incr_steps": "--train-iters/--train-samples (the weight-decay ramp)",
}


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
        self.optimizer = optimizer
        self.in_samples = config.train_samples is not None
        samples = self.in_samples
        self.schedule = {
            "max_lr": config.lr,
            "min_lr": config.min_lr,
            "decay_style": config.lr_decay_style,
            "warmup_steps": config.lr_warmup_samples if samples else config.lr_warmup_iters,
            "decay_steps": config.lr_decay_samples if samples else config.lr_decay_iters,
            "wsd_decay_steps": (
                config.lr_wsd_decay_samples if samples else config.lr_wsd_decay_iters
            ),
            "wsd_decay_style": config.lr_wsd_decay_style,
            "decoupled_lr": config.decoupled_lr,
            "decoupled_min_lr": (
                config.decoupled_min_lr if config.decoupled_min_lr is not None else config.min_lr
            ),
            "start_wd": config.start_weight_decay,
            "end_wd": config.end_weight_decay,
            "wd_incr_style": config.weight_decay_incr_style,
            "wd_incr_steps": config.train_samples if samples else config.train_iters,
        }
        self.override = config.override_opt_param_scheduler
        self.use_checkpoint = config.use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self, decoupled: bool = False) -> float:
        s = self.schedule
        max_lr, min_lr = (
            (s["decoupled_lr"], s["decoupled_min_lr"]) if decoupled else (s["max_lr"], s["min_lr"])
        )
        warmup, decay, style = s["warmup_steps"], s["decay_steps"], s["decay_style"]
        if warmup > 0 and self.num_steps <= warmup:
            return max_lr * self.num_steps / warmup
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
            # lr_mult (muP's hidden matrices): every schedule here is linear in (--lr,
            # --min-lr) with warmup from 0, so this is the schedule of lr_mult x both.
            group["lr"] = self.get_lr(group.get("decoupled_lr", False)) * group.get("lr_mult", 1.0)
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        return self.get_lr()

    def iteration_done(self, global_batch_size: int) -> float:
        """Advance past one updated iteration of `global_batch_size` samples."""
        return self.step(global_batch_size if self.in_samples else 1)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, **self.schedule}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume at the checkpoint's step; its schedule is checked against (or replaces,
        with --use-checkpoint-opt_param-scheduler) this run's. Raises ConfigError on a
        difference the flags do not settle."""
        for name, saved in state_dict.items():
            if name not in self.schedule or self.override:
                continue  # older checkpoints store only the step
            if self.use_checkpoint:
                self.schedule[name] = saved
            elif saved != self.schedule[name] and not (
                name == "wd_incr_steps" and self.schedule["wd_incr_style"] == "constant"
            ):
                raise ConfigError(
                    f"the checkpoint's schedule has {_FLAGS[name]} {saved} but this run has "
                    f"{self.schedule[name]}; use the checkpoint's value, or pass "
                    "--override-opt_param-scheduler (this run's schedule) or "
                    "--use-checkpoint-opt_param-scheduler (the checkpoint's)"
                )
        self.num_steps = 0
        self.step(state_dict["num_steps"])
