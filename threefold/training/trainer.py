"""The training loop: build everything from a Config, then step, log, evaluate and save.

`Trainer` is used by `pretrain_gpt.py` and, in-process, by the parity tests, which compare its
per-iteration losses and final parameters across parallel layouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.checkpointing import save_checkpoint
from threefold.config import Config
from threefold.data.loader import build_datasets, micro_batches
from threefold.data.tokenizer import build_tokenizer, model_vocab_size
from threefold.model import GPTModel
from threefold.parallel import state
from threefold.parallel.data_parallel import GradientBuffer, finalize_model_grads
from threefold.parallel.random import set_random_seed
from threefold.parallel.schedules import get_forward_backward_func
from threefold.training.flops import peak_tflops, training_flops_per_iteration
from threefold.training.logging import (
    IterationStats,
    TensorBoardLogger,
    format_iteration,
    format_validation,
)
from threefold.training.loss_scaler import build_loss_scaler
from threefold.training.lr_scheduler import OptimizerParamScheduler
from threefold.training.optimizer import MixedPrecisionOptimizer


def print_rank_0(message: str) -> None:
    if state.global_rank() == 0:
        print(message, flush=True)


def gpt_forward_step(batch: dict, model: torch.nn.Module):
    """Megatron's forward step: the model's per-token loss and how to reduce it."""
    per_token_loss = model(batch["tokens"], labels=batch["labels"])
    loss_mask = batch["loss_mask"]

    def loss_func(output: torch.Tensor):
        loss = (output.float() * loss_mask).sum() / loss_mask.sum()
        return loss, loss.detach()

    return per_token_loss, loss_func


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


def build_model(config: Config, device: torch.device) -> GPTModel:
    tp = config.parallel.tensor_model_parallel_size
    model = GPTModel(config.model, config.model.padded_vocab_size(tp),
                     sequence_parallel=config.parallel.sequence_parallel)
    model.initialize(config.training.seed)
    dtype = (torch.bfloat16 if config.training.bf16
             else torch.float16 if config.training.fp16 else torch.float32)
    return model.to(device=device, dtype=dtype)


class Trainer:
    def __init__(self, config: Config, device: torch.device) -> None:
        self.config = config
        self.device = device
        training = config.training
        set_random_seed(training.seed, device.type)
        self.tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        config.model.vocab_size = model_vocab_size(self.tokenizer, config.model.vocab_size)
        self.model = build_model(config, device)
        self.grad_buffer = GradientBuffer(list(self.model.parameters()))
        self.optimizer = MixedPrecisionOptimizer(list(self.model.named_parameters()), training)
        self.scheduler = OptimizerParamScheduler(self.optimizer, training)
        self.loss_scaler = build_loss_scaler(training)
        self.state = TrainState()
        self.datasets = build_datasets(config)
        self.num_microbatches = training.num_micro_batches(state.data_parallel_world_size())
        self.flops_per_iteration = training_flops_per_iteration(
            config.model, training.global_batch_size, self.model.padded_vocab_size)
        self._train_iterator = None
        self._last_saved = None

    # -- one step -----------------------------------------------------------------------------
    def train_iterator(self):
        if self._train_iterator is None:
            self._train_iterator = micro_batches(
                self.datasets[0], self.state.consumed_train_samples,
                self.config.training.micro_batch_size, self.config.training.seed, self.device)
        return self._train_iterator

    def train_step(self) -> tuple[float, float | None, bool]:
        """One global batch: forward/backward over micro-batches, gradient reduction, update.
        Returns (mean loss over the global batch, grad norm or None, whether it was skipped)."""
        self.model.train()
        self.grad_buffer.zero()
        losses = get_forward_backward_func()(
            gpt_forward_step, self.train_iterator(), self.model, self.num_microbatches,
            loss_scale=self.loss_scaler.scale)
        finalize_model_grads(self.grad_buffer)
        updated, grad_norm = self.optimizer.step(self.loss_scaler.scale)
        self.loss_scaler.update(found_inf=not updated)
        if updated:
            self.scheduler.step(1)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.config.training.global_batch_size
        return self._data_parallel_mean(losses), grad_norm, not updated

    def _data_parallel_mean(self, losses: list[torch.Tensor]) -> float:
        mean = torch.stack(losses).mean()
        if state.data_parallel_world_size() > 1:
            dist.all_reduce(mean, group=state.data_parallel_group())
            mean /= state.data_parallel_world_size()
        return mean.item()

    @torch.no_grad()
    def evaluate(self, split: int = 1) -> float | None:
        """Mean loss over `--eval-iters` global batches of a split, always the same batches."""
        dataset = self.datasets[split]
        if dataset is None or self.config.training.eval_iters == 0:
            return None
        self.model.eval()
        iterator = micro_batches(dataset, 0, self.config.training.micro_batch_size,
                                 self.config.training.seed, self.device, shuffle=False)
        losses = []
        for _ in range(self.config.training.eval_iters):
            losses += get_forward_backward_func()(
                gpt_forward_step, iterator, self.model, self.num_microbatches, forward_only=True)
        return self._data_parallel_mean(losses)

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> list[float]:
        config, training = self.config, self.config.training
        tensorboard = TensorBoardLogger(config.logging.tensorboard_dir
                                        if state.global_rank() == 0 else None)
        losses, window_losses, window_start = [], [], time.perf_counter()
        window_iterations = 0
        while self.state.iteration < training.train_iters:
            loss, grad_norm, skipped = self.train_step()
            losses.append(loss)
            self.state.skipped_iterations += int(skipped)
            if skipped:
                self.state.nan_iterations += int(not torch.isfinite(torch.tensor(loss)))
            else:
                window_losses.append(loss)
            window_iterations += 1
            if self.state.iteration % config.logging.log_interval == 0:
                elapsed = (time.perf_counter() - window_start) / window_iterations
                stats = self._iteration_stats(elapsed, window_losses, grad_norm)
                print_rank_0(format_iteration(stats))
                tensorboard.log_iteration(stats)
                window_losses, window_iterations = [], 0
                window_start = time.perf_counter()
            if self.state.iteration % training.eval_interval == 0 or (
                    self.state.iteration == training.train_iters):
                valid_loss = self.evaluate()
                if valid_loss is not None:
                    print_rank_0(format_validation(self.state.iteration, valid_loss))
                    tensorboard.log_validation(self.state.iteration, valid_loss)
                window_start = time.perf_counter()  # evaluation time is not iteration time
            if self._should_save():
                self.save()
                window_start = time.perf_counter()
        if config.checkpoint.save and self._last_saved != self.state.iteration:
            self.save()
        tensorboard.close()
        return losses

    def _should_save(self) -> bool:
        checkpoint = self.config.checkpoint
        return bool(checkpoint.save and checkpoint.save_interval
                    and self.state.iteration % checkpoint.save_interval == 0)

    def save(self) -> None:
        start = time.perf_counter()
        path = save_checkpoint(self.config.checkpoint.save, self)
        self._last_saved = self.state.iteration
        print_rank_0(f"  saved checkpoint at iteration {self.state.iteration} to {path} "
                     f"in {time.perf_counter() - start:.2f} s")

    def _iteration_stats(self, elapsed: float, window_losses: list[float],
                         grad_norm: float | None) -> IterationStats:
        training = self.config.training
        tflops = self.flops_per_iteration / elapsed / state.global_world_size() / 1e12
        mfu = memory = None
        if self.device.type == "cuda":
            peak = peak_tflops(torch.cuda.get_device_name(self.device))
            mfu = tflops / peak if peak else None
            memory = torch.cuda.max_memory_allocated(self.device) / 2**30
        mean_loss = sum(window_losses) / len(window_losses) if window_losses else float("nan")
        return IterationStats(
            iteration=self.state.iteration, train_iters=training.train_iters,
            consumed_samples=self.state.consumed_train_samples, elapsed_ms=elapsed * 1e3,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            global_batch_size=training.global_batch_size, lm_loss=mean_loss,
            loss_scale=self.loss_scaler.scale, grad_norm=grad_norm,
            skipped_iterations=self.state.skipped_iterations,
            nan_iterations=self.state.nan_iterations,
            tokens_per_second=training.global_batch_size * self.config.model.seq_length / elapsed,
            tflops_per_device=tflops, mfu=mfu, memory_gib=memory)
