"""Logging, metrics, timers and profiling."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import arg

# the characters Weights & Biases refuses in a project name (wandb's own check raises deep in
# its setup, after start-up)
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


@dataclass
class LoggingConfig:
    log_interval: int = arg(100, minimum=1, help="print the log line every this many iterations")
    log_params_norm: bool = arg(
        False, help="add the L2 norm of all parameters to the log line"
    )  # L2 norm of all parameters, each counted once
    log_throughput: bool = arg(
        False, help="add Megatron's 'throughput per GPU (TFLOP/s/GPU)' to the log line"
    )  # (threefold's own TFLOP/s per device, tokens/s and MFU are always at its end)
    # A window of iterations for a profiler (training/profiling.py).
    profile: bool = arg(
        False,
        help=(
            "profile iterations --profile-step-start+1 .. --profile-step-end "
            "(CUDA: for nsys --capture-range=cudaProfilerApi)"
        ),
    )
    use_pytorch_profiler: bool = arg(
        False, help="with --profile: torch.profiler, trace written to --tensorboard-dir"
    )
    profile_step_start: int = arg(
        10, minimum=0, help="with --profile: the iteration after which profiling starts"
    )
    profile_step_end: int = arg(
        12, minimum=0, help="with --profile: the iteration after which it stops"
    )
    profile_ranks: list[int] = arg(
        default_factory=lambda: [0], help="global ranks to profile (default 0)"
    )
    moe_per_layer_logging: bool = arg(
        False, help="mixture of experts: also print each MoE layer's tokens per expert"
    )
    log_num_zeros_in_grad: bool = arg(
        False, help="add the number of gradient elements that are exactly zero to the log line"
    )  # gradient elements that are exactly zero
    # Megatron's timers (training/timers.py): which exist, how they are reported.
    timing_log_level: int = arg(
        0,
        help=(
            "0: start-up and checkpoint timers; 1: + forward-backward, "
            "gradient reduction, optimizer per iteration; 2: + per "
            "micro-batch compute and pipeline communication"
        ),
        choices=(0, 1, 2),
    )
    timing_log_option: str = arg(
        "minmax",
        help="report each timer's max over ranks, (min, max), or every rank's time",
        choices=("max", "minmax", "all"),
    )
    barrier_with_l1_time: bool = arg(
        True,
        help="start level-1 timers without a barrier (time includes waiting for other ranks)",
        flag="--no-barrier-with-level-1-timing",
    )
    log_timers_to_tensorboard: bool = arg(
        False, help="write each per-iteration timer's max over ranks to --tensorboard-dir"
    )
    tensorboard_dir: str | None = arg(
        None, help="write the log line's numbers as TensorBoard scalars here"
    )
    tensorboard_queue_size: int = arg(
        1000, minimum=1, help="TensorBoard events held before the writer flushes them to disk"
    )
    log_straggler: bool = arg(
        False,
        help=(
            "report ranks whose compute time per iteration is above --straggler-factor x the median"
        ),
    )  # report ranks computing slower than straggler_factor x median
    straggler_factor: float = arg(
        1.3, help="with --log-straggler: how many times the median is slow"
    )
    wandb_project: str | None = arg(
        None,
        help="log to Weights & Biases (offline without credentials or with WANDB_MODE=offline)",
    )
    wandb_exp_name: str | None = arg(None, help="the Weights & Biases run name")
    wandb_save_dir: str | None = arg(None, help="default: SAVE/wandb")
    wandb_entity: str | None = arg(None, help="the Weights & Biases team or user")

    def finalize(self) -> list[str]:
        _require(self.straggler_factor > 1, "--straggler-factor must be above 1")
        project = self.wandb_project or ""
        found = "".join(c for c in WANDB_PROJECT_FORBIDDEN if c in project)
        _require(
            len(project) <= 128 and not found,
            f"--wandb-project {project!r}: a Weights & Biases project name has at most 128 "
            f"characters and none of {' '.join(WANDB_PROJECT_FORBIDDEN)}"
            + (f" (it has {' '.join(found)})" if found else ""),
        )
        _require(
            not self.log_timers_to_tensorboard or self.tensorboard_dir is not None,
            "--log-timers-to-tensorboard writes to --tensorboard-dir; give one",
        )
        warnings = []
        if self.log_timers_to_tensorboard and self.timing_log_level == 0:
            warnings.append(
                "--log-timers-to-tensorboard writes the per-iteration timers of "
                "--timing-log-level 1 or 2; at level 0 there are none"
            )
        if not self.profile:
            return warnings + (
                ["--use-pytorch-profiler has no effect without --profile"]
                if self.use_pytorch_profiler
                else []
            )
        _require(
            0 <= self.profile_step_start < self.profile_step_end,
            f"--profile-step-start {self.profile_step_start} must be >= 0 and below "
            f"--profile-step-end {self.profile_step_end}",
        )
        _require(
            not self.use_pytorch_profiler or self.tensorboard_dir is not None,
            "--use-pytorch-profiler writes its trace to --tensorboard-dir; give one",
        )
        return warnings
