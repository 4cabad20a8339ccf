"""The training loop: build everything from a Config, then step, log, evaluate and save.

`Trainer` is used by `pretrain_gpt.py` and, in-process, by the parity tests, which compare its
per-iteration losses and final parameters across parallel layouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.checkpoint_writer import CheckpointWriter
from threefold.checkpointing import save_checkpoint
from threefold.config import Config
from threefold.data.loader import build_datasets, micro_batches
from threefold.data.tokenizer import build_tokenizer, model_vocab_size
from threefold.kernels.dispatch import compile_layers, configure_for_model
from threefold.model import GPTModel
from threefold.parallel import state
from threefold.parallel.data_parallel import GradientBuffer, finalize_model_grads
from threefold.parallel.pipeline_layout import model_chunk_layers
from threefold.parallel.random import set_random_seed
from threefold.parallel.schedules import get_forward_backward_func
from threefold.parallel.strategy import resolve_auto_strategy
from threefold.parallel.torch_native import (
    local,
    no_sync_context,
    reshard,
    wrap_ddp,
    wrap_fsdp,
)
from threefold.training import faults
from threefold.training.exit_conditions import ExitConditions
from threefold.training.flops import training_flops_per_iteration
from threefold.training.logging import (
    MetricWriters,
    format_iteration,
    format_validation,
    iteration_stats,
)
from threefold.training.loss_scaler import build_loss_scaler
from threefold.training.lr_scheduler import OptimizerParamScheduler
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.memory_hygiene import MemoryHygiene
from threefold.training.numerics import NonFiniteError, SpikyLossDetector, check_loss_and_grads
from threefold.training.optimizer import (
    DistributedOptimizer,
    MixedPrecisionOptimizer,
    NativeOptimizer,
)
from threefold.training.profiling import IterationProfiler
from threefold.training.timers import ITERATION, Timers
from threefold.training.watchdog import Watchdog


def print_rank_0(message: str) -> None:
    if state.global_rank() == 0:
        print(message, flush=True)


def gpt_forward_step(batch: dict, model: torch.nn.Module,
                     input_tensor: torch.Tensor | None = None, per_token_loss: bool = False):
    """Megatron's forward step: the model's output (per-token loss on the last pipeline stage,
    hidden states elsewhere) and how to reduce it to the micro-batch loss.

    The reported value is [loss total, weight]: the global batch's loss is the sum of the
    totals over the sum of the weights. By default the loss is the micro-batch's mean over its
    loss-mask tokens, weighted 1 (every micro-batch counts the same, whatever its token count);
    with `per_token_loss` it is the sum over those tokens, weighted by their number, so every
    token of the global batch counts the same (Megatron's --calculate-per-token-loss)."""
    output = model(batch["tokens"], labels=batch["labels"], hidden_states=input_tensor,
                   attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids"))
    loss_mask = batch["loss_mask"]

    def loss_func(per_token_loss_values: torch.Tensor):
        total = (per_token_loss_values.float() * loss_mask).sum()
        tokens = loss_mask.sum().float()
        if per_token_loss:
            return total, torch.stack((total.detach(), tokens))
        # clamp: a fine-tuning micro-batch may hold no response token at all
        loss = total / tokens.clamp(min=1)
        return loss, torch.stack((loss.detach(), torch.ones_like(loss)))

    return output, loss_func


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


def params_dtype(config: Config) -> torch.dtype:
    training = config.training
    return (torch.bfloat16 if training.bf16 else torch.float16 if training.fp16
            else torch.float32)


def build_model_chunks(config: Config, device: torch.device,
                       dtype: torch.dtype) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving)."""
    parallel = config.parallel
    pp, rank = parallel.pipeline_model_parallel_size, state.pipeline_model_parallel_rank()
    layers = model_chunk_layers(config.model.num_layers, pp, rank,
                                parallel.virtual_pipeline_model_parallel_size,
                                parallel.decoder_first_pipeline_num_layers,
                                parallel.decoder_last_pipeline_num_layers)
    padded_vocab = config.model.padded_vocab_size(parallel.tensor_model_parallel_size)
    chunks = []
    for index, (offset, count) in enumerate(layers):
        chunk = GPTModel(config.model, padded_vocab,
                         sequence_parallel=parallel.sequence_parallel,
                         pre_process=rank == 0 and index == 0,
                         post_process=rank == pp - 1 and index == len(layers) - 1,
                         num_layers=count, layer_offset=offset)
        chunk.initialize(config.training.seed)
        chunks.append(chunk.to(device=device, dtype=dtype))
        if config.kernels.compile_layers:
            compile_layers(chunk)
    return chunks


def _summed_over_another_group(param: torch.nn.Parameter) -> bool:
    """Tied embeddings under PP: after the DP reduction their gradients are summed between the
    first and last stage, whose buffers lay them out at different offsets, so a distributed-
    optimizer shard of one does not line up with the other's. (Sequence-parallel norms are
    summed over TP ranks, whose buffers have identical layouts and shards: no such issue.)"""
    return bool(getattr(param, "shared_embedding", False)
                and state.pipeline_model_parallel_world_size() > 1)


class Trainer:
    def __init__(self, config: Config, device: torch.device,
                 build_data=build_datasets) -> None:
        """`build_data(config, tokenizer)` gives the train, validation and test datasets
        (fine-tuning passes its own)."""
        self.config = config
        self.device = device
        self.start_time = time.time()  # --exit-duration-in-mins counts from here
        training, logging = config.training, config.logging
        self.timers = Timers(logging.timing_log_level, logging.timing_log_option,
                             logging.barrier_with_l1_time, device)
        set_random_seed(training.seed, device.type)
        self.tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        config.model.vocab_size = model_vocab_size(self.tokenizer, config.model.vocab_size)
        # Data before the model: a bad file is reported before the heavy work starts.
        with self.timers("train/valid/test-data-iterators-setup", 0):
            self.datasets = build_data(config, self.tokenizer)
        with self.timers("model-and-optimizer-setup", 0):
            self._build_model_and_optimizer(device)
        parallel = config.parallel
        self.state = TrainState()
        # Evaluation always runs full global batches; training's follow --rampup-batch-size.
        self.num_microbatches = training.num_micro_batches(state.data_parallel_world_size())
        self.last_global_batch_size = training.global_batch_size
        self.flops_per_iteration = training_flops_per_iteration(
            config.model, training.global_batch_size, self.model_chunks[0].padded_vocab_size)
        sequence = config.model.seq_length // (
            parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1)
        # What travels between pipeline stages: [sequence (/ TP under SP), micro-batch, hidden].
        self.pipeline_options = {
            "tensor_shape": (sequence, training.micro_batch_size, config.model.hidden_size),
            "dtype": params_dtype(config)}
        self._train_iterator = None
        self.last_saved = None  # the iteration whose checkpoint is (being) written, or loaded
        checkpoint = config.checkpoint
        self.checkpoint_writer = (CheckpointWriter(checkpoint.save, checkpoint.async_save,
                                                   keep_latest=checkpoint.ckpt_keep_latest)
                                  if checkpoint.save else None)
        self.watchdog = Watchdog(parallel.distributed_timeout_minutes, live=False)  # see train()
        self.hygiene = MemoryHygiene(training, device)
        self.profiler = IterationProfiler(config.logging, device, state.global_rank())

    def _build_model_and_optimizer(self, device: torch.device) -> None:
        config, training, parallel = self.config, self.config.training, self.config.parallel
        if parallel.distributed_strategy == "auto":
            print_rank_0(f"> {resolve_auto_strategy(config, device)}")
        self.native = parallel.distributed_strategy in ("ddp", "fsdp")
        print_rank_0(configure_for_model(config.kernels, config.model,
                                         parallel.tensor_model_parallel_size, device,
                                         params_dtype(config), training.micro_batch_size))
        # DDP/FSDP keep fp32 parameters as masters and compute in half precision under
        # autocast; threefold's own data parallelism keeps the parameters in the run's dtype.
        self.model_chunks = build_model_chunks(
            config, device, torch.float32 if self.native else params_dtype(config))
        self.wrapped_chunks = self.model_chunks
        offload = training.optimizer_cpu_offload and device.type != "cpu"
        if training.optimizer_cpu_offload and not offload:
            print_rank_0("> --optimizer-cpu-offload: this run is on the CPU already, "
                         "nothing to offload")
        if self.native:
            self._build_torch_native(device)
        else:
            self._build_megatron_data_parallel(offload)
        self.optimizer.initialize_state()
        self.optimizer.count_zeros = config.logging.log_num_zeros_in_grad
        print(f"> rank {state.global_rank()} {measure_bytes_per_parameter(self)}", flush=True)
        self.scheduler = OptimizerParamScheduler(self.optimizer, training)
        self.loss_scaler = build_loss_scaler(training)

    def _build_megatron_data_parallel(self, offload: bool) -> None:
        parallel, training = self.config.parallel, self.config.training
        named = [(name, param) for chunk in self.model_chunks
                 for name, param in chunk.named_parameters()]
        distributed = parallel.use_distributed_optimizer
        half = training.bf16 or training.fp16
        self.grad_buffer = GradientBuffer(
            [param for _, param in named], bucket_size=parallel.bucket_size,
            pad_to_multiple=state.data_parallel_world_size() if distributed else 1,
            flat_parameters=distributed, overlap_grad_reduce=parallel.overlap_grad_reduce,
            grad_dtype=(params_dtype(self.config) if half
                        and not parallel.accumulate_allreduce_grads_in_fp32 else torch.float32),
            needs_full_gradient=_summed_over_another_group)
        if distributed:
            self.optimizer = DistributedOptimizer(
                named, self.grad_buffer, training, parallel.overlap_param_gather, offload)
            if parallel.overlap_param_gather:
                self.grad_buffer.wait_for_params_before_forward(self.model_chunks)
        else:
            self.optimizer = MixedPrecisionOptimizer(named, training, offload)

    def _build_torch_native(self, device: torch.device) -> None:
        (model,) = self.model_chunks
        self.grad_buffer = None
        fsdp = self.config.parallel.distributed_strategy == "fsdp"
        if not fsdp:  # DDP turns existing gradients into views of its buckets
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
        parallel = self.config.parallel
        reduce_dtype = torch.bfloat16 if parallel.grad_reduce_in_bf16 else torch.float32
        wrapped = (wrap_fsdp(model, device, params_dtype(self.config), reduce_dtype) if fsdp
                   else wrap_ddp(model, device, parallel.bucket_size, reduce_dtype))
        if fsdp:  # sharded gradients, allocated up front so memory is measured at start-up
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
        self.wrapped_chunks = [wrapped]
        self.optimizer = NativeOptimizer(list(model.named_parameters()),
                                         self.config.training, sharded=fsdp)

    def _forward_step(self, batch: dict, model: torch.nn.Module,
                      input_tensor: torch.Tensor | None = None):
        per_token = self.config.training.calculate_per_token_loss
        if not (self.native and params_dtype(self.config) != torch.float32):
            output, loss_func = gpt_forward_step(batch, model, input_tensor, per_token)
        else:
            with torch.autocast(self.device.type, dtype=params_dtype(self.config)):
                output, loss_func = gpt_forward_step(batch, model, input_tensor, per_token)
        return output, faults.inject(loss_func, state.global_rank(), self.state.iteration + 1)

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradients as they are before the data-parallel reduction."""
        if not self.native:
            return [self.grad_buffer.buffer]
        return [local(param.grad) for chunk in self.model_chunks
                for param in chunk.parameters() if param.grad is not None]

    @property
    def model(self) -> GPTModel:
        """The model, when this rank holds a single chunk of it (no virtual pipeline stages)."""
        (model,) = self.model_chunks
        return model

    def layout_independent_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their names in the whole single-device model, complete
        (an all-gather still in flight under --overlap-param-gather is waited for)."""
        if self.grad_buffer is not None:
            self.grad_buffer.finish_param_gather()
        return [(chunk.layout_independent_name(name), param) for chunk in self.model_chunks
                for name, param in chunk.named_parameters()]

    def _set_train(self, mode: bool) -> None:
        for chunk in self.model_chunks:
            chunk.train(mode)

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
        iteration = self.state.iteration + 1
        training = self.config.training
        # --rampup-batch-size: this iteration's global batch follows from the samples so far.
        global_batch_size = training.global_batch_size_at(self.state.consumed_train_samples)
        num_microbatches = training.num_micro_batches(state.data_parallel_world_size(),
                                                      global_batch_size)
        self.watchdog.enter("forward-backward", iteration)
        self._set_train(True)
        if self.native:
            self.optimizer.zero_grad()
        else:
            self.grad_buffer.start_step(num_microbatches)
        start = time.perf_counter()
        faults.delay(state.global_rank(), iteration)
        per_token = self.config.training.calculate_per_token_loss
        with self.timers("forward-backward", 1):
            losses = get_forward_backward_func()(
                self._forward_step, self.train_iterator(), self.wrapped_chunks,
                num_microbatches, loss_scale=self.loss_scaler.scale, **self.pipeline_options,
                per_token_loss=per_token, timers=self.timers,
                **({"no_sync_func": no_sync_context(self.wrapped_chunks[0])}
                   if self.native else {}))
        self.watchdog.add_busy_time(time.perf_counter() - start)
        if self.config.training.check_for_nan_in_loss_and_grad:
            check_loss_and_grads(losses, self._local_grads(), iteration)
        self.watchdog.enter("gradient reduction", iteration)
        if not self.native:  # DDP and FSDP have reduced the gradients during backward
            with self.timers("all-grads-sync", 1):
                finalize_model_grads(self.grad_buffer)
        total, weight = self._global_loss_totals(losses)
        # The gradients are a sum over micro-batches of (loss x scale / divisor), averaged over
        # DP replicas: the optimizer divides them by `divisor` to get the global batch's mean.
        divisor = self.loss_scaler.scale
        if per_token:  # the token count was not known during backward: divide now
            divisor *= max(weight, 1.0) / state.data_parallel_world_size()
        self.hygiene.before_optimizer_step()
        self.watchdog.enter("optimizer step", iteration)
        with self.timers("optimizer", 1):
            updated, grad_norm = self.optimizer.step(divisor)
        self.loss_scaler.update(found_inf=not updated)
        if updated:
            self.scheduler.iteration_done(global_batch_size)
        self.state.iteration += 1
        self.state.consumed_train_samples += global_batch_size
        self.last_global_batch_size = global_batch_size
        return total / max(weight, 1.0), grad_norm, not updated

    def _global_loss_totals(self, losses: list[torch.Tensor]) -> tuple[float, float]:
        """The reported [total, weight] pairs (see `gpt_forward_step`) summed over the global
        batch; only the last pipeline stage has losses, so the others receive the sums through
        a sum over the pipeline group."""
        totals = (torch.stack(losses).sum(dim=0) if losses
                  else torch.zeros(2, device=self.device))
        if state.pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(totals, group=state.pipeline_model_parallel_group())
        if state.data_parallel_world_size() > 1:
            dist.all_reduce(totals, group=state.data_parallel_group())
        total, weight = totals.tolist()
        return total, weight

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """The global batch's loss from the reported [total, weight] pairs of this rank."""
        total, weight = self._global_loss_totals(losses)
        return total / max(weight, 1.0)

    @torch.no_grad()
    def evaluate(self, split: int = 1) -> float | None:
        """Mean loss over `--eval-iters` global batches of a split, always the same batches."""
        dataset = self.datasets[split]
        if dataset is None or self.config.training.eval_iters == 0:
            return None
        self._set_train(False)
        iterator = micro_batches(dataset, 0, self.config.training.micro_batch_size,
                                 self.config.training.seed, self.device, shuffle=False)
        losses = []
        for _ in range(self.config.training.eval_iters):
            losses += get_forward_backward_func()(
                self._forward_step, iterator, self.wrapped_chunks, self.num_microbatches,
                forward_only=True, **self.pipeline_options)
        for chunk in self.wrapped_chunks:
            reshard(chunk)
        return self._mean_loss(losses)

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> list[float]:
        """Train to --train-iters (or an exit condition); the per-iteration mean losses."""
        config, training = self.config, self.config.training
        writers = MetricWriters(config.logging if state.global_rank() == 0 else None, config)
        logging = config.logging
        self.watchdog = Watchdog(config.parallel.distributed_timeout_minutes,
                                 logging.straggler_factor if logging.log_straggler else None)
        exits = ExitConditions(training, self.device, self.start_time)
        spikes = (SpikyLossDetector(training.spiky_loss_factor)
                  if training.check_for_spiky_loss else None)
        profiler = self.profiler
        self.hygiene.__enter__()  # its first collection is not iteration time
        losses, window_losses, window_start = [], [], time.perf_counter()
        window_iterations = window_samples = 0
        try:
            while self.state.iteration < training.train_iters:
                first_sample = self.state.consumed_train_samples
                profiler.before_iteration(self.state.iteration)
                loss, grad_norm, skipped = self.train_step()
                iteration = self.state.iteration
                self._report_background_save()
                written = profiler.after_iteration(iteration)
                if written:
                    print(written, flush=True)
                self.hygiene.after_iteration(iteration)
                losses.append(loss)
                self.state.skipped_iterations += int(skipped)
                if skipped:
                    self.state.nan_iterations += int(not torch.isfinite(torch.tensor(loss)))
                else:
                    window_losses.append(loss)
                if spikes is not None:
                    report = spikes.observe(loss, iteration, first_sample,
                                            self.last_global_batch_size)
                    if report:
                        print_rank_0(report)
                window_iterations += 1
                window_samples += self.last_global_batch_size
                if iteration % logging.log_interval == 0:
                    stats = iteration_stats(self, time.perf_counter() - window_start,
                                            window_iterations, window_samples, window_losses,
                                            grad_norm)
                    print_rank_0(format_iteration(stats))
                    maxima = self.print_timers(list(ITERATION), window_iterations)
                    if logging.log_timers_to_tensorboard:
                        stats.timers = maxima
                    writers.log_iteration(stats)
                    report = self.watchdog.straggler_report(
                        iteration // logging.log_interval, iteration - window_iterations + 1,
                        iteration)
                    if report:
                        print_rank_0(report)
                    window_losses, window_iterations, window_samples = [], 0, 0
                    window_start = time.perf_counter()
                if iteration % training.eval_interval == 0 or iteration == training.train_iters:
                    self.watchdog.enter("evaluation", iteration)
                    with self.hygiene.evaluation():
                        valid_loss = self.evaluate()
                    if valid_loss is not None:
                        print_rank_0(format_validation(iteration, valid_loss))
                        writers.log_validation(iteration, valid_loss)
                    window_start = time.perf_counter()  # evaluation time is not iteration time
                if self._should_save():
                    self.save()
                    window_start = time.perf_counter()
                reason = exits.reason(iteration)
                if reason is not None:
                    print_rank_0(f"> exiting at iteration {iteration}: {reason}")
                    break
            if config.checkpoint.save and self.last_saved != self.state.iteration:
                self.save()
            self.finish_pending_save()
        except NonFiniteError:
            self.finish_pending_save()  # an earlier checkpoint in flight is a good one
            raise
        finally:
            written = profiler.close()
            if written:
                print(written, flush=True)
            self.hygiene.__exit__()
            exits.close()
            self.watchdog.close()
            writers.close()
        return losses

    def _should_save(self) -> bool:
        checkpoint = self.config.checkpoint
        return bool(checkpoint.save and checkpoint.save_interval
                    and self.state.iteration % checkpoint.save_interval == 0)

    def save(self) -> None:
        self.watchdog.enter("checkpoint save", self.state.iteration)
        self.finish_pending_save()
        start = time.perf_counter()
        with self.timers("save-checkpoint", 0):
            path = save_checkpoint(self.config.checkpoint.save, self, self.checkpoint_writer)
        self.last_saved = self.state.iteration
        blocked = time.perf_counter() - start
        if self.checkpoint_writer.asynchronous:
            print_rank_0(f"  started saving checkpoint at iteration {self.state.iteration} "
                         f"in the background ({blocked:.2f} s blocked)")
        else:
            print_rank_0(f"  saved checkpoint at iteration {self.state.iteration} to {path} "
                         f"in {blocked:.2f} s")
        self.print_timers(["save-checkpoint"])

    def print_timers(self, names: list[str] | tuple[str, ...],
                     normalizer: int = 1) -> dict[str, float]:
        """Report timers (collective: every rank calls it) and print them on rank 0; returns
        the max over ranks in ms per timer."""
        text, maxima = self.timers.report(names, normalizer)
        if text:
            print_rank_0(text)
        return maxima

    def finish_pending_save(self) -> None:
        """Wait for an --async-save to complete everywhere (the tracker then names it)."""
        if self.checkpoint_writer is not None:
            self._saved(self.checkpoint_writer.wait())

    def _report_background_save(self) -> None:
        """After each iteration: note a background save that completed; raise
        CheckpointSaveError for one that failed (not one interval later, at the next save)."""
        if self.checkpoint_writer is not None:
            self._saved(self.checkpoint_writer.poll())

    def _saved(self, iteration: int | None) -> None:
        if iteration is not None:
            print_rank_0(f"  checkpoint at iteration {iteration} complete")
