"""The training loop: compose the components a Config asks for, then step, log, evaluate, save.

    model chunks     model/gpt.py, one per virtual pipeline stage (training/build.py)
    data parallel    gradient sync + optimizer, threefold's or PyTorch's (training/data_parallel)
    scheduler        LR and weight-decay schedule (training/lr_scheduler.py)
    loss scaler      fp16's dynamic or a static scale (training/loss_scaler.py)
    train state      iteration and consumed samples (training/train_state.py)
    checkpointer     checkpoint/ (save.py, load.py, writer.py), given the components above
    observability    logging, timers, profiler, watchdog, memory hygiene (training/observability)

`Trainer` is used by `pretrain_gpt.py`, `finetune.py` and, in-process, by the parity tests,
which compare its per-iteration losses and final parameters across parallel layouts.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext

import torch

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.megatron.vocabulary import checkpoint_vocabulary
from threefold.config import Config
from threefold.data.loader import WholeSplit, build_datasets, micro_batches, validation_sets
from threefold.data.tokenizer import build_tokenizer, model_vocab_size
from threefold.model import GPTModel
from threefold.model.activation_offload import offload_summary
from threefold.model.loss import gpt_forward_step
from threefold.model.moe import start_aux_losses
from threefold.parallel.context_parallel.sequence import split_batch
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.pipeline_parallel.schedules import get_forward_backward_func
from threefold.parallel.tensor_parallel.random import set_random_seed
from threefold.training import faults
from threefold.training.build import build_model_and_optimizer
from threefold.training.checkpointer import Checkpointer
from threefold.training.flops import training_flops_per_iteration
from threefold.training.indexer_losses import IndexerLosses
from threefold.training.logging import progress
from threefold.training.moe_statistics import MoEStatistics
from threefold.training.mtp_losses import MTPLosses
from threefold.training.numerics import LargeGradsDetector, NonFiniteError, check_loss_and_grads
from threefold.training.observability import Observability
from threefold.training.qk_clip import QKClip
from threefold.training.replica_check import ReplicaCheck, ReplicaMismatchError
from threefold.training.rerun import IterationState, RerunExit, ResultValidation
from threefold.training.train_state import TrainState


class Trainer:
    def __init__(
        self, config: Config, device: torch.device, parallel: ParallelContext, build_data=None
    ) -> None:
        """`build_data(config, tokenizer)` gives the train, validation and test datasets
        (fine-tuning passes its own; pretraining reads --data-path)."""
        self.config, self.device, self.parallel = config, device, parallel
        training = config.training
        self.observability = Observability(config, parallel, device, start_time=time.time())
        self.timers = self.observability.timers
        set_random_seed(training.seed, parallel, device.type)
        self.tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        vocab_size = model_vocab_size(self.tokenizer, config.model.vocab_size)
        # (a Megatron-LM checkpoint's padded rows, where they are this vocabulary's padding)
        config.model.vocab_size, note = checkpoint_vocabulary(config.checkpoint.load, vocab_size)
        if note:
            self.print(note)
        # Data before the model: a bad file is reported before the heavy work starts.
        with self.timers("train/valid/test-data-iterators-setup", 0):
            self.datasets = (build_data or build_datasets)(config, self.tokenizer)
        self.validation_sets = validation_sets(self.datasets[1], training)
        if training.full_validation:
            for name, dataset in self.validation_sets:
                whole = WholeSplit(dataset, training.eval_global_batch_size)
                self.print(
                    f"> --full-validation: {name}: {whole.size} samples per evaluation, "
                    f"{whole.steps} steps of --eval-global-batch-size "
                    f"{training.eval_global_batch_size}"
                )
        with self.timers("model-and-optimizer-setup", 0):
            built = build_model_and_optimizer(config, parallel, device, self.print)
        self.model_chunks, self.data_parallel, self.scheduler, self.loss_scaler, self.fp8 = built
        self.optimizer = self.data_parallel.optimizer
        self.moe_statistics = (
            MoEStatistics(self.model_chunks, config.model, parallel)
            if config.model.is_moe
            else None
        )
        depths = config.model.mtp_num_layers
        self.mtp_losses = MTPLosses(self.model_chunks, depths, parallel) if depths else None
        observes = config.model.observes_attention_logits()
        self.qk_clip = QKClip(self.model_chunks, config.model, parallel) if observes else None
        self.indexer_losses = None
        if config.model.sparse_attention and (config.model.dsa_indexer_loss_coeff or 0) > 0:
            layers = config.model.num_layers
            self.indexer_losses = IndexerLosses(self.model_chunks, layers, parallel)
        self.state = TrainState()
        # Evaluation always runs full global batches; training's follow --rampup-batch-size.
        self.num_microbatches = training.num_micro_batches(parallel.dp.size)
        self.last_global_batch_size = training.global_batch_size
        model, vocab = config.model, self.model_chunks[0].padded_vocab_size
        flops = training_flops_per_iteration(model, training.global_batch_size, vocab)
        self.flops_per_iteration = self.observability.flops_per_iteration = flops
        # What travels between pipeline stages, and in which dtype.
        shape = (model.seq_length, training.micro_batch_size, model.hidden_size)
        shape = parallel.pipeline_tensor_shape(*shape)
        dtype = self.data_parallel.activation_dtype
        self.pipeline_options = dict(pp=parallel.pp, dtype=dtype, tensor_shape=shape)
        if config.parallel.delay_wgrad_compute:  # (the combined schedules')
            self.pipeline_options["delay_wgrad_compute"] = True
        if config.parallel.virtual_pipeline_model_parallel_size:
            group = config.parallel.microbatch_group_size_per_virtual_pipeline_stage
            self.pipeline_options["microbatch_group_size"] = group
        self._train_iterator = None
        # (what the first step's forward passes planned to offload: printed once it is known)
        self._offloading_unreported = model.fine_grained_activation_offloading
        self.validation = ResultValidation(training, parallel.world, device)
        self.large_grads = None  # --check-for-large-grads
        if training.check_for_large_grads:
            self.large_grads = LargeGradsDetector(parallel.world.rank)
        self.replica_check = ReplicaCheck(
            training.check_weight_hash_across_dp_replicas_interval,
            parallel,
            [p for chunk in self.model_chunks for p in chunk.parameters()],
            across_tp=training.test_mode,
        )
        self.checkpointer = Checkpointer(
            config.checkpoint, self.checkpoint_components, self.observability
        )

    def print(self, message: str) -> None:
        self.observability.print(message)

    @property
    def model(self) -> GPTModel:
        """The model, when this rank holds a single chunk of it (no virtual pipeline stages)."""
        (model,) = self.model_chunks
        return model

    def layout_independent_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their names in the whole single-device model, complete
        (an all-gather still in flight under --overlap-param-gather is waited for)."""
        self.data_parallel.finish_param_gather()
        chunks = self.model_chunks
        return [(c.layout_independent_name(n), p) for c in chunks for n, p in c.named_parameters()]

    def checkpoint_components(self) -> CheckpointComponents:
        """What a checkpoint saves and restores, each part with its own state."""
        parts = (self.optimizer, self.scheduler, self.loss_scaler, self.state, self.tokenizer)
        parameters = self.layout_independent_parameters
        return CheckpointComponents(
            self.config,
            self.parallel,
            parameters,
            *parts,
            fp8=self.fp8,
            parameters_in_model_dtype=self.data_parallel.parameters_in_model_dtype,
        )

    # -- one step -----------------------------------------------------------------------------
    def _forward_step(
        self, batch: dict, model: torch.nn.Module, input_tensor=None, *, per_token: bool
    ):
        with self.data_parallel.forward_context():
            output, loss_func = gpt_forward_step(
                batch, model, input_tensor, per_token, self.parallel.cp
            )
        return output, faults.inject(loss_func, self.parallel.world.rank, self.state.iteration + 1)

    def _batches(self, split: int, consumed_samples: int, shuffle: bool = True, dataset=None):
        """This rank's micro-batches of split `split` (of `dataset` in its place, if given)."""
        training = self.config.training
        micro_batch_size = training.eval_micro_batch_size if split else training.micro_batch_size
        where = (micro_batch_size, training.seed, self.device, self.parallel.dp)
        # --num-workers: training batches read ahead by worker processes (evaluation reads a
        # few batches now and then, in this process)
        workers = self.config.data.num_workers if split == 0 else 0
        batches = micro_batches(
            self.datasets[split] if dataset is None else dataset,
            consumed_samples,
            *where,
            shuffle=shuffle,
            num_workers=workers,
        )
        # The ranks of a CP group read the same samples and keep their share of each sequence.
        return (split_batch(batch, self.parallel.cp) for batch in batches)

    def _schedule(self, iterator, num_microbatches: int, **options) -> list[torch.Tensor]:
        """Forward (and backward) over the micro-batches by the pipeline's schedule."""
        schedule = get_forward_backward_func(
            self.parallel.pp, self.config.parallel.overlap_moe_expert_parallel_comm
        )
        chunks, options = self.data_parallel.wrapped_chunks, {**self.pipeline_options, **options}
        # The factor the schedule puts on the main loss, and the CP one gpt_forward_step does
        # (a CP rank's share of a loss is summed over CP, gradients are averaged): what the
        # auxiliary losses' gradients take.
        per_token = bool(options.get("per_token_loss"))
        divisor = 1 if per_token else num_microbatches
        scale = options.get("loss_scale", 1.0) / divisor * self.parallel.cp.size
        if self.moe_statistics is not None:
            start_aux_losses(self.model_chunks, scale)
        if self.mtp_losses is not None:
            self.mtp_losses.start(scale, per_token)
        if self.indexer_losses is not None:
            self.indexer_losses.start(scale, per_token)
        forward_step = functools.partial(self._forward_step, per_token=per_token)
        return schedule(forward_step, iterator, chunks, num_microbatches, **options)

    def train_iterator(self):
        if self._train_iterator is None:
            self._train_iterator = self._batches(0, self.state.consumed_train_samples)
        return self._train_iterator

    def train_step(self) -> tuple[float, float | None, bool]:
        """One global batch: forward/backward over micro-batches, gradient reduction, update.
        Returns (mean loss over the global batch, grad norm or None, whether it was skipped)."""
        iteration, training = self.state.iteration + 1, self.config.training
        watchdog, data_parallel = self.observability.watchdog, self.data_parallel
        # --rampup-batch-size: this iteration's global batch follows from the samples so far.
        global_batch_size = training.global_batch_size_at(self.state.consumed_train_samples)
        num_microbatches = training.num_micro_batches(self.parallel.dp.size, global_batch_size)
        watchdog.enter("forward-backward", iteration)
        for chunk in self.model_chunks:
            chunk.train(True)
        per_token = training.calculate_per_token_loss
        # --rerun-mode validate_results: what a rerun of this iteration starts from
        before = IterationState(self.fp8) if self.validation.enabled else None
        losses = self._forward_backward(num_microbatches, iteration)
        try:
            losses = self.validation.validate(
                iteration, losses, lambda: self._rerun(before, num_microbatches, iteration)
            )
        except RerunExit as stop:
            if stop.save:
                self._save_for_rerun(before, iteration)
            raise
        if training.check_for_nan_in_loss_and_grad:
            check_loss_and_grads(losses, data_parallel.local_grads_finite(), iteration)
        if self.large_grads is not None:
            for report in self.large_grads.observe(data_parallel.local_bucket_norms(), iteration):
                print(report, flush=True)
        if self.moe_statistics is not None:  # (after any rerun: the step's own counts)
            self.moe_statistics.after_iteration(num_microbatches)
        if self.mtp_losses is not None:
            self.mtp_losses.after_iteration(num_microbatches)
        if self.indexer_losses is not None:
            self.indexer_losses.after_iteration(num_microbatches)
        watchdog.enter("gradient reduction", iteration)
        with self.timers("all-grads-sync", 1):
            data_parallel.finish_grad_sync()
        if self.fp8 is not None:  # delayed scaling: the next step's scales
            self.fp8.after_step()
        total, weight = self._global_loss_totals(losses)
        # The gradients are a sum over micro-batches of (loss x scale / divisor), averaged over
        # DP replicas: the optimizer divides them by `divisor` to get the global batch's mean.
        divisor = self.loss_scaler.scale
        if per_token:  # the token count was not known during backward: divide now
            divisor *= max(weight, 1.0) / self.parallel.dp.size
        self.observability.hygiene.before_optimizer_step()
        watchdog.enter("optimizer step", iteration)
        with self.timers("optimizer", 1):
            factors = self.qk_clip.factors() if self.qk_clip is not None else None
            updated, grad_norm = self.optimizer.step(divisor, factors)
        self.loss_scaler.update(found_inf=not updated)
        if updated:
            self.scheduler.iteration_done(global_batch_size)
        self.state.iteration += 1
        self.state.consumed_train_samples += global_batch_size
        self.last_global_batch_size = global_batch_size
        return total / max(weight, 1.0), grad_norm, not updated

    def _forward_backward(self, num_microbatches: int, iteration: int) -> list[torch.Tensor]:
        """This iteration's forward and backward passes over its micro-batches."""
        data_parallel = self.data_parallel
        data_parallel.start_step(num_microbatches)
        start = time.perf_counter()
        faults.delay(self.parallel.world.rank, iteration)
        cached = self.fp8.weights_cached() if self.fp8 is not None else nullcontext()
        with self.timers("forward-backward", 1), cached:
            losses = self._schedule(
                self.train_iterator(),
                num_microbatches,
                loss_scale=self.loss_scaler.scale,
                per_token_loss=self.config.training.calculate_per_token_loss,
                timers=self.timers,
                **data_parallel.schedule_options(),
            )
        self.observability.watchdog.add_busy_time(time.perf_counter() - start)
        return losses

    def _rerun(
        self, before: IterationState, num_microbatches: int, iteration: int
    ) -> list[torch.Tensor]:
        """The iteration again, from the state before it: the same micro-batches and RNG."""
        before.restore()
        self._train_iterator = self._batches(0, self.state.consumed_train_samples)
        return self._forward_backward(num_microbatches, iteration)

    def _save_for_rerun(self, before: IterationState, iteration: int) -> None:
        """Save the state before `iteration` (its checkpoint, unless the last one is it) and
        the validation's record, for a job on other devices to rerun it."""
        save = self.config.checkpoint.save
        if save is None:
            raise RerunExit(
                17,
                "the result reproduced on this device, and without --save the iteration "
                "cannot be rerun on another; exiting",
            )
        before.restore()
        self._train_iterator = None  # the next reader starts at the samples consumed so far
        if self.checkpointer.last_saved != self.state.iteration:
            self.checkpointer.save(self.state.iteration)
        self.checkpointer.wait()
        self.validation.write_state(save, iteration)

    def _global_loss_totals(self, losses: list[torch.Tensor]) -> tuple[float, float]:
        """The reported [total, weight] pairs (see `gpt_forward_step`) summed over the global
        batch; only the last pipeline stage has losses, so the others receive the sums through
        a sum over the pipeline group."""
        totals = torch.stack(losses).sum(dim=0) if losses else torch.zeros(2, device=self.device)
        self.parallel.pp.all_reduce(totals)
        self.parallel.dp.all_reduce(totals)
        total, weight = totals.tolist()
        return total, weight

    def _print_moe_layers(self, tokens: torch.Tensor) -> None:
        for number, counts in zip(self.moe_statistics.moe_layer_numbers, tokens):
            shares = " ".join(f"{c:.0f}" for c in counts.tolist())
            self.print(f"> MoE layer {number}: tokens per expert per iteration: {shares}")

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """The global batch's loss from the reported [total, weight] pairs of this rank."""
        total, weight = self._global_loss_totals(losses)
        return total / max(weight, 1.0)

    @torch.no_grad()
    def evaluate(self, split: int = 1, advance: bool = True, dataset=None) -> float | None:
        """Mean loss over `--eval-iters` global batches of a split. On the validation split
        each evaluation reads on from where the last one stopped, as Megatron-LM's (the count
        is in the checkpoint; `advance=False` reads them without moving on); the test split is
        read from its start. --full-validation reads the whole validation split each time,
        every token's loss counted once. `dataset`: which of the `validation_sets` (default:
        the first)."""
        training, parallel = self.config.training, self.parallel
        if dataset is None:
            first = self.validation_sets[0][1] if self.validation_sets else None
            dataset = first if split == 1 else self.datasets[split]
        if dataset is None or not training.evaluates(split):
            return None
        for chunk in self.model_chunks:
            chunk.train(False)
        whole = split == 1 and training.full_validation
        if whole:
            dataset = WholeSplit(dataset, training.eval_global_batch_size)
            iterator, steps = self._batches(1, 0, shuffle=False, dataset=dataset), dataset.steps
        else:
            start = self.state.consumed_valid_samples if split == 1 else 0
            iterator = self._batches(split, start, shuffle=False, dataset=dataset)
            steps = training.eval_iters
            if split == 1 and advance:
                self.state.consumed_valid_samples += training.evaluation_samples()
        # --eval-global-batch-size / --eval-micro-batch-size (by default training's)
        count = training.num_eval_micro_batches(parallel.dp.size)
        shape = (self.config.model.seq_length, training.eval_micro_batch_size)
        shape = parallel.pipeline_tensor_shape(*shape, self.config.model.hidden_size)
        # (the reported losses are token sums and counts: the padding's micro-batches of
        # --full-validation hold no token, so they count nothing)
        per_token, losses = training.calculate_per_token_loss, []
        for _ in range(steps):
            losses += self._schedule(
                iterator, count, forward_only=True, tensor_shape=shape, per_token_loss=per_token
            )
        self.data_parallel.after_evaluation()
        if self.config.data.sft and not whole:
            return self._micro_batch_mean_loss(losses)
        return self._mean_loss(losses)

    def _micro_batch_mean_loss(self, losses: list[torch.Tensor]) -> float:
        """Megatron-LM's evaluation loss of --sft: the mean over every micro-batch of all
        ranks and steps of its own token mean (one with no loss token counts 0), not the
        token mean of them all. (--full-validation keeps the token mean: its padding
        micro-batches would count.)"""
        means = [total / weight.clamp(min=1) for total, weight in losses]
        return self._mean_loss([torch.stack((mean, torch.ones_like(mean))) for mean in means])

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> list[float]:
        """Train to --train-iters (or an exit condition); the per-iteration mean losses."""
        if self.config.training.skip_train:
            return self._evaluate_only()
        losses = []
        with self.observability:
            try:
                completed = True
                self._check_replicas(force=True)
                skipped = set(self.config.training.iterations_to_skip or ())
                while self.state.iteration < self.config.training.train_iters:
                    if self.state.iteration + 1 in skipped:
                        self._skip_iteration()
                        continue
                    losses.append(self._iteration())
                    reason = self.observability.exit_reason(self.state.iteration)
                    if reason is not None:
                        self.print(f"> exiting at iteration {self.state.iteration}: {reason}")
                        completed = False
                        break
                self.checkpointer.save_final(self.state.iteration)
                if completed:
                    self._final_evaluations()
                summary = self.observability.run_progress.summary(
                    self.state.iteration, self.checkpointer.last_path
                )
                self.print(summary)
            except (NonFiniteError, ReplicaMismatchError, RerunExit):
                self.checkpointer.wait()  # an earlier checkpoint in flight is a good one
                raise
            finally:
                # --num-workers' processes stop here, told to by their queues. Left to the
                # collection that frees the trainer (state.shut_down), the queues' feeder
                # threads were closed first, the workers never heard and each was killed
                # after DataLoader's 5 s timeout. A later step reads from consumed samples.
                self._train_iterator = None
        return losses

    def _skip_iteration(self) -> None:
        """--iterations-to-skip (Megatron-LM's): the next iteration's global batch is passed
        over. The weights, the optimizer and the LR schedule stay as they are; the iteration
        and the samples consumed move on, and the next one reads from there."""
        training = self.config.training
        global_batch_size = training.global_batch_size_at(self.state.consumed_train_samples)
        self.state.iteration += 1
        self.state.consumed_train_samples += global_batch_size
        self._train_iterator = None  # (the next reader starts at the samples consumed)
        self.print(
            f"> iteration {self.state.iteration} skipped (--iterations-to-skip): its "
            f"{global_batch_size} samples passed over, nothing trained"
        )

    def _evaluate_only(self) -> list[float]:
        """--skip-train (Megatron-LM's): the model as loaded, on the validation split from its
        start and on the test split; nothing trained, nothing saved."""
        self.print("skipping training (--skip-train is on) ...")
        self.state.consumed_valid_samples = 0
        progress = self.observability.run_progress
        progress.before_iteration(self.state.iteration)  # (0 iterations done, from here)
        with self.observability:
            self._final_evaluations()
            self.print(progress.summary(self.state.iteration, None, unsaved="--skip-train"))
        return []

    def _final_evaluations(self) -> None:
        """Megatron-LM's reports after training: the validation and the test split, each as
        `validation loss at iteration N on validation set / on test set`."""
        watch, iteration = self.observability, self.state.iteration
        self._validate(iteration, on="validation set")
        with watch.evaluation(iteration):
            loss = self.evaluate(2)
        watch.validation(iteration, loss, on="test set")

    def _validate(self, iteration: int, on: str | None = None) -> None:
        """Evaluate each validation set and report it under its name (Megatron-LM's
        `validation loss at ...`, `validation-NAME loss at ...`)."""
        watch = self.observability
        for name, dataset in self.validation_sets:
            with watch.evaluation(iteration):
                loss = self.evaluate(1, dataset=dataset)
            watch.validation(iteration, loss, on=on, split=name)

    def _iteration(self) -> float:
        """One training iteration and what follows it: the log line, evaluation, a save."""
        watch, training = self.observability, self.config.training
        first_sample = self.state.consumed_train_samples
        watch.before_iteration(self.state.iteration)
        loss, grad_norm, skipped = self.train_step()
        if self._offloading_unreported:
            self._offloading_unreported = False
            self.print(offload_summary(self.model_chunks))
        iteration, batch = self.state.iteration, self.last_global_batch_size
        self.checkpointer.poll()
        self.state.skipped_iterations += int(skipped)
        if skipped:
            self.state.nan_iterations += int(not torch.isfinite(torch.tensor(loss)))
        watch.after_iteration(iteration, loss, skipped, first_sample, batch)
        if watch.log_due(iteration):
            components = (self.state, self.scheduler, self.optimizer, self.loss_scaler)
            numbers, tokens = progress(self.config, *components, batch, grad_norm, skipped), None
            reset = watch.closes_window(iteration)
            if self.mtp_losses is not None:
                numbers["mtp_losses"] = self.mtp_losses.report(self.device, reset)
            if self.moe_statistics is not None:
                numbers["moe_losses"], tokens = self.moe_statistics.report(self.device, reset)
            if self.indexer_losses is not None:
                numbers["indexer_losses"] = self.indexer_losses.report(self.device, reset)
            if self.qk_clip is not None:  # (TensorBoard's alone, as Megatron-LM's)
                numbers["max_attention_logit"] = self.qk_clip.max_attention_logit
            watch.log(numbers)
            if tokens is not None and self.config.logging.moe_per_layer_logging:
                self._print_moe_layers(tokens)
        if training.evaluates_at(iteration):  # (and after training, as Megatron-LM)
            self._validate(iteration)
        self._check_replicas()  # before a save: a state whose replicas differ is never saved
        if self.checkpointer.due(iteration):
            self.checkpointer.save(iteration)
        elif self.checkpointer.non_persistent_due(iteration):
            self.checkpointer.save(iteration, non_persistent=True)
        return loss

    def _check_replicas(self, force: bool = False) -> None:
        """--check-weight-hash-across-dp-replicas-interval: when due (or `force`d, before the
        first iteration, if the flag is given), compare the replicas' weights."""
        check, iteration = self.replica_check, self.state.iteration
        if check.interval is not None and (force or check.due(iteration)):
            self.print(check.check(iteration, self.layout_independent_parameters()))
