"""The learning-rate and weight-decay schedule as a checkpoint stores it, and what a resumed
run follows: the run's flags must describe the checkpoint's schedule (else the load stops,
naming the flag) unless `--override-opt_param-scheduler` (the flags win) or
`--use-checkpoint-opt_param-scheduler` (the checkpoint wins), as in Megatron-LM. Here, below
the scheduler (threefold/training/lr_scheduler.py), so that a `--load` is checked against the
flags before start-up (threefold/checkpoint/loadable.py).
"""

from __future__ import annotations

from threefold.config.errors import ConfigError
from threefold.config.training import TrainingConfig

# Schedule values a checkpoint stores and a resume compares, with the flags that set them.
_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "decay_style": "--lr-decay-style",
    "warmup_steps": "--lr-warmup-iters/--lr-warmup-samples",
    "init_lr": "--lr-warmup-init",
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


def lr_schedule(config: TrainingConfig) -> dict:
    """The schedule the flags describe, as a checkpoint stores it (less the step)."""
    samples = config.train_samples is not None
    return {
        "max_lr": config.lr,
        "min_lr": config.min_lr,
        "decay_style": config.lr_decay_style,
        "warmup_steps": config.lr_warmup_samples if samples else config.lr_warmup_iters,
        "init_lr": config.lr_warmup_init,
        "decay_steps": config.lr_decay_samples if samples else config.lr_decay_iters,
        "wsd_decay_steps": config.lr_wsd_decay_samples if samples else config.lr_wsd_decay_iters,
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


def resumed_lr_schedule(saved: dict, config: TrainingConfig) -> dict:
    """The schedule a run with these flags follows from a checkpoint's `saved` one (its
    `state_dict`), or a ConfigError naming the first flag that differs, which the flags do not
    settle."""
    schedule = lr_schedule(config)
    for name, value in saved.items():
        if name not in schedule or config.override_opt_param_scheduler:
            continue  # older checkpoints store only the step
        if config.use_checkpoint_opt_param_scheduler:
            schedule[name] = value
        elif value != schedule[name] and not (
            name == "wd_incr_steps" and schedule["wd_incr_style"] == "constant"
        ):
            raise ConfigError(
                f"the checkpoint's schedule has {_FLAGS[name]} {value} but this run has "
                f"{schedule[name]}; use the checkpoint's value, or pass "
                "--override-opt_param-scheduler (this run's schedule) or "
                "--use-checkpoint-opt_param-scheduler (the checkpoint's)"
            )
    return schedule
