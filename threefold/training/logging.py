"""The training log line in Megatron-LM's format (existing log parsers read it), and the same
numbers as TensorBoard scalars (`--tensorboard-dir`) and Weights & Biases metrics
(`--wandb-project`; offline with WANDB_MODE=offline or without credentials).

Megatron-LM's fields come first, field for field as its `training_log` writes them: the
timestamp, `throughput per GPU (TFLOP/s/GPU)` with --log-throughput, the loss only when some
iteration of the window was not skipped, grad norm and zero count only after an update.
threefold's own (tokens/s, TFLOP/s per device, MFU, memory, decoupled learning rate) follow,
so regular expressions written for Megatron's line match threefold's."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

import torch

from threefold.config import Config, ConfigError
from threefold.training.flops import peak_tflops


@dataclass
class IterationStats:
    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float | None  # None: every iteration of the window was skipped
    loss_scale: float
    grad_norm: float | None
    skipped_iterations: int
    nan_iterations: int
    tokens_per_second: float
    tflops_per_device: float
    mfu: float | None = None
    memory_gib: float | None = None
    decoupled_learning_rate: float | None = None
    num_zeros_in_grad: int | None = None
    params_norm: float | None = None
    timers: dict[str, float] | None = None  # max over ranks (ms) per timer, for TensorBoard
    mtp_losses: dict[str, float] | None = None  # multi-token prediction (mtp_1 loss ...)
    moe_losses: dict[str, float] | None = None  # MoE auxiliary losses (load_balancing_loss ...)
    indexer_losses: dict[str, float] | None = None  # DeepSeek sparse attention (indexer loss)
    max_attention_logit: float | None = None  # --qk-clip, --log-max-attention-logit: last step's
    log_throughput: bool = False  # Megatron's --log-throughput field


@dataclass
class LogWindow:
    """The iterations since the last log line: their count, samples and unskipped losses, and
    how many were skipped (their loss nan or inf, or not). Megatron-LM's line counts the
    skipped iterations of its window, not of the run: an fp16 run's first ones, skipped while
    its loss scale comes down, each say 1 at --log-interval 1."""

    start: float = field(default_factory=time.perf_counter)
    iterations: int = 0
    samples: int = 0
    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    nan: int = 0

    def add(self, loss: float, skipped: bool, global_batch_size: int) -> None:
        self.iterations += 1
        self.samples += global_batch_size
        if not skipped:
            self.losses.append(loss)
        else:
            self.skipped += 1
            self.nan += not math.isfinite(loss)


def iteration_stats(
    config: Config,
    device: torch.device,
    world_size: int,
    flops_per_iteration: float,
    window: LogWindow,
    **progress,
) -> IterationStats:
    """The log-line numbers over `window` (whose iterations differ in size under
    --rampup-batch-size); `progress` holds the run's own: iteration, consumed_samples,
    learning rates, loss scale, grad norm, ..."""
    training = config.training
    seconds = time.perf_counter() - window.start
    samples_per_second = window.samples / seconds
    flops_per_sample = flops_per_iteration / training.global_batch_size
    tflops = flops_per_sample * samples_per_second / world_size / 1e12
    mfu = memory = None
    if device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(device))
        mfu = tflops / peak if peak else None
        memory = torch.cuda.max_memory_allocated(device) / 2**30
    mean_loss = sum(window.losses) / len(window.losses) if window.losses else None
    return IterationStats(
        train_iters=training.train_iters,
        elapsed_ms=seconds / window.iterations * 1e3,
        lm_loss=mean_loss,
        skipped_iterations=window.skipped,
        nan_iterations=window.nan,
        tokens_per_second=samples_per_second * config.model.seq_length,
        tflops_per_device=tflops,
        mfu=mfu,
        memory_gib=memory,
        log_throughput=config.logging.log_throughput,
        **progress,
    )


def progress(
    config: Config,
    train_state,
    scheduler,
    optimizer,
    loss_scaler,
    global_batch_size: int,
    grad_norm: float | None,
    skipped: bool = False,
) -> dict:
    """The run's own numbers for the log line (see `iteration_stats`), from its components.
    After a skipped iteration there is no grad norm or zero count (as in Megatron-LM)."""
    training, logging = config.training, config.logging
    return dict(
        iteration=train_state.iteration,
        consumed_samples=train_state.consumed_train_samples,
        learning_rate=scheduler.get_lr(),
        decoupled_learning_rate=(
            scheduler.get_lr(decoupled=True) if training.decoupled_lr is not None else None
        ),
        # the last iteration's, as Megatron (every rank takes part in the reductions)
        num_zeros_in_grad=(
            optimizer.num_zeros_in_grad if logging.log_num_zeros_in_grad and not skipped else None
        ),
        params_norm=optimizer.params_norm() if logging.log_params_norm else None,
        global_batch_size=global_batch_size,
        loss_scale=loss_scaler.scale,
        grad_norm=None if skipped else grad_norm,
    )


def timestamp() -> str:
    """Megatron-LM's log-line prefix: ` [2026-11-24 03:50:37.123456]`."""
    return f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"


def format_iteration(stats: IterationStats) -> str:
    line = (
        f"{timestamp()} iteration {stats.iteration:8d}/{stats.train_iters:8d} |"
        f" consumed samples: {stats.consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {stats.elapsed_ms:.1f} |"
    )
    if stats.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {stats.tflops_per_device:.1f} |"
    line += (
        f" learning rate: {stats.learning_rate:.6E} |"
        f" global batch size: {stats.global_batch_size:5d} |"
    )
    if stats.lm_loss is not None:
        line += f" lm loss: {stats.lm_loss:.6E} |"
    # After lm loss, the multi-token prediction, the MoE and the indexer losses, as Megatron.
    for name, value in _auxiliary_losses(stats).items():
        line += f" {name}: {value:.6E} |"
    line += f" loss scale: {stats.loss_scale:.1f} |"
    if stats.grad_norm is not None:
        line += f" grad norm: {stats.grad_norm:.3f} |"
    if stats.num_zeros_in_grad is not None:
        line += f" num zeros: {stats.num_zeros_in_grad} |"
    if stats.params_norm is not None:
        line += f" params norm: {stats.params_norm:.3f} |"
    line += (
        f" number of skipped iterations: {stats.skipped_iterations:3d} |"
        f" number of nan iterations: {stats.nan_iterations:3d} |"
    )
    # threefold's own fields, after all of Megatron-LM's
    if stats.decoupled_learning_rate is not None:
        line += f" decoupled learning rate: {stats.decoupled_learning_rate:.6E} |"
    line += (
        f" tokens per second: {stats.tokens_per_second:.1f} |"
        f" TFLOP/s per device: {stats.tflops_per_device:.3f} |"
    )
    if stats.mfu is not None:
        line += f" MFU: {100 * stats.mfu:.1f}% |"
    if stats.memory_gib is not None:
        line += f" max memory (GiB): {stats.memory_gib:.2f} |"
    return line


def _auxiliary_losses(stats: IterationStats) -> dict[str, float]:
    return {**(stats.mtp_losses or {}), **(stats.moe_losses or {}), **(stats.indexer_losses or {})}


def format_validation(prefix: str, loss: float, split: str = "validation") -> str:
    """Megatron-LM's evaluation report: the line between two rules of dashes. `prefix`:
    `iteration N` during training, `iteration N on validation set` / `on test set` after."""
    ppl = math.exp(min(20.0, loss))
    line = f" {split} loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def _scalars(stats: IterationStats) -> dict[str, float]:
    """The iteration's numbers under TensorBoard names (Megatron's, where it has them)."""
    values = {
        "lm loss": stats.lm_loss,  # (absent when the whole window was skipped)
        "learning-rate": stats.learning_rate,
        "decoupled-learning-rate": stats.decoupled_learning_rate,
        "num-zeros": stats.num_zeros_in_grad,
        "params-norm": stats.params_norm,
        "loss-scale": stats.loss_scale,
        "grad-norm": stats.grad_norm,
        "tokens-per-second": stats.tokens_per_second,
        "tflops-per-device": stats.tflops_per_device,
        "mfu": stats.mfu,
        "max-memory-gib": stats.memory_gib,
        "skipped-iterations": stats.skipped_iterations,
        "nan-iterations": stats.nan_iterations,
        "iteration-time-ms": stats.elapsed_ms,
        "max_attention_logit": stats.max_attention_logit,
    }
    values.update(_auxiliary_losses(stats))
    values.update({f"{name}-time": ms for name, ms in (stats.timers or {}).items()})
    return {name: value for name, value in values.items() if value is not None}


class TensorBoardLogger:
    def __init__(self, log_dir: str | None, queue_size: int = 1000) -> None:
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            try:
                self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)
            except OSError as error:  # (what the check before start-up cannot see: /proc)
                raise ConfigError(
                    f"--tensorboard-dir {log_dir}: cannot write there ({error.strerror}); give "
                    "a path in a writable directory"
                ) from None

    def log_iteration(self, stats: IterationStats) -> None:
        if self.writer is None:
            return
        for name, value in _scalars(stats).items():
            self.writer.add_scalar(name, value, stats.iteration)

    def log_validation(self, iteration: int, loss: float, split: str = "validation") -> None:
        if self.writer is not None:
            self.writer.add_scalar(f"lm loss {split}", loss, iteration)
            self.writer.add_scalar(f"lm loss {split} ppl", math.exp(min(20.0, loss)), iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _has_wandb_credentials() -> bool:
    """An API key in the environment, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()


class WandbLogger:
    """Weights & Biases run named by --wandb-exp-name in --wandb-project, files under
    --wandb-save-dir. Without credentials (and WANDB_MODE unset) it logs offline: `wandb sync
    DIR` uploads the run later."""

    def __init__(self, logging_config, config) -> None:
        self.run = None
        if logging_config is None or not logging_config.wandb_project:
            return
        try:
            import wandb
        except ImportError:
            from threefold.config import ConfigError

            raise ConfigError(
                "--wandb-project needs the wandb package: pip install wandb "
                "(or pip install threefold[wandb])"
            ) from None
        mode = os.environ.get("WANDB_MODE") or (None if _has_wandb_credentials() else "offline")
        if mode == "offline" and not os.environ.get("WANDB_MODE"):
            print("> --wandb-project: no W&B credentials; logging offline", flush=True)
        save_dir = logging_config.wandb_save_dir or os.path.join(
            config.checkpoint.save or ".", "wandb"
        )
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(
            project=logging_config.wandb_project,
            name=logging_config.wandb_exp_name,
            dir=save_dir,
            mode=mode,
            entity=logging_config.wandb_entity,
            config=asdict(config),
        )

    def log_iteration(self, stats: IterationStats) -> None:
        if self.run is not None:
            self.run.log(_scalars(stats), step=stats.iteration)

    def log_validation(self, iteration: int, loss: float, split: str = "validation") -> None:
        if self.run is not None:
            ppl = math.exp(min(20.0, loss))
            self.run.log({f"lm loss {split}": loss, f"lm loss {split} ppl": ppl}, step=iteration)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MetricWriters:
    """TensorBoard and W&B together; `logging_config` None on ranks that do not log."""

    def __init__(self, logging_config, config) -> None:
        self.writers = [
            TensorBoardLogger(
                logging_config.tensorboard_dir if logging_config else None,
                logging_config.tensorboard_queue_size if logging_config else 1000,
            ),
            WandbLogger(logging_config, config),
        ]

    def log_iteration(self, stats: IterationStats) -> None:
        for writer in self.writers:
            writer.log_iteration(stats)

    def log_validation(self, iteration: int, loss: float, split: str = "validation") -> None:
        for writer in self.writers:
            writer.log_validation(iteration, loss, split)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
