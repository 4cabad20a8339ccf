"""Data parallelism as one interface with two implementations, so the loop never branches on it.

    MegatronDataParallel   threefold's gradient buffer (parallel/data_parallel.py) with the
                           mixed-precision or distributed optimizer; any TP/PP layout
    TorchDataParallel      PyTorch DDP or FSDP2 around each pipeline stage's one model chunk
                           (threefold's TP layers inside), with the fp32 parameters as their
                           own masters (--distributed-strategy ddp|fsdp)

Both answer the same calls in the order the loop makes them: `start_step` (zero gradients,
arm the reduction), `schedule_options` (what the forward/backward schedule needs: DDP's
no-sync for all micro-batches but the last), `forward_context` (autocast where the parameters
stay fp32), `finish_grad_sync`, then `optimizer.step` (clip and update); `after_evaluation`
puts FSDP's sharded parameters back; `activation_dtype` is what travels between pipeline
stages; `parameters_in_model_dtype` is what checkpoints read and write. Each owns its
optimizer.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from threefold.config import Config
from threefold.kernels.fp8 import WEIGHT
from threefold.model.fp8 import fp8_layers, fp8_weights
from threefold.model.fp8_fsdp_params import Fp8FsdpParameters, shard_in_fp8
from threefold.model.fp8_params import Fp8Parameters
from threefold.model.meta_device import holds_meta_parameters, materialize
from threefold.parallel.data_parallel.gradient_buffer import (
    GradientBuffer,
    all_reduce_embedding_grads,
    all_reduce_sequence_parallel_grads,
    finalize_model_grads,
)
from threefold.parallel.data_parallel.torch_native import (
    average_grads,
    divide_expert_grads,
    gathered_through_the_schedule,
    local,
    no_sync_context,
    reshard,
    wrap_ddp,
    wrap_fsdp,
)
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert
from threefold.training.distrib_optimizer import DistributedOptimizer
from threefold.training.muon import muon_matrices
from threefold.training.mup import mup_lr_scales
from threefold.training.optimizer import MixedPrecisionOptimizer, NativeOptimizer


def params_dtype(config: Config) -> torch.dtype:
    training = config.training
    return torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else torch.float32


def uses_torch_data_parallel(config: Config) -> bool:
    """DDP/FSDP keep fp32 parameters as masters and compute in half precision under autocast;
    threefold's own data parallelism keeps the parameters in the run's dtype."""
    return config.parallel.distributed_strategy in ("ddp", "fsdp")


class MegatronDataParallel:
    """Gradients accumulated in threefold's bucketed buffer and averaged over `parallel.dp_cp`
    (the ranks holding the same weights: data-parallel replicas and context-parallel peers).
    Expert weights (mixture of experts) have a buffer of their own, summed over expert-DP and
    scaled by 1 / (DP x CP), as Megatron's DDP does."""

    grad_buffer: GradientBuffer
    expert_grad_buffer: GradientBuffer | None = None

    def __init__(
        self,
        model_chunks: list[nn.Module],
        config: Config,
        parallel: ParallelContext,
        offload: bool,
    ) -> None:
        dp, training = config.parallel, config.training
        self.parallel = parallel
        self.activation_dtype = params_dtype(config)
        self.model_chunks = self.wrapped_chunks = model_chunks
        named = [
            (name, param) for chunk in model_chunks for name, param in chunk.named_parameters()
        ]
        distributed = dp.use_distributed_optimizer
        half = training.bf16 or training.fp16

        def summed_over_another_group(param: nn.Parameter) -> bool:
            """Tied embeddings under PP: after the DP reduction their gradients are summed
            between the first and last stage, whose buffers lay them out at different
            offsets, so a distributed-optimizer shard of one does not line up with the
            other's. (Sequence-parallel norms are summed over TP ranks, whose buffers have
            identical layouts and shards: no such issue.)"""
            return bool(getattr(param, "shared_embedding", False) and parallel.pp.size > 1)

        options = dict(
            average_in_collective=dp.ddp_average_in_collective,
            bucket_size=dp.bucket_size,
            flat_parameters=distributed,
            overlap_grad_reduce=dp.overlap_grad_reduce,
            whole_params_per_shard=distributed and training.optimizer == "muon",
            grad_dtype=(
                params_dtype(config)
                if half and not dp.accumulate_allreduce_grads_in_fp32
                else torch.float32
            ),
        )
        # --fp8-param-gather: the FP8 layers' weights get a buffer of their own, whose flat
        # parameters are their FP8 compute copies.
        fp8 = fp8_weights(model_chunks) if config.fp8.fp8_param_gather else {}
        experts = [p for _, p in named if is_expert(p) and p.requires_grad]
        dense = [p for _, p in named if not is_expert(p) and p not in fp8]
        # Under the distributed optimizer each bucket splits into one shard per rank of the
        # buffer's group.
        # --num-distributed-optimizer-instances: each instance shards over its own ranks
        # (the intra groups; all the replicas with one instance), the mean is over all of them.
        dense_group, expert_group = parallel.dp_cp_intra, parallel.expert_dp_intra
        mean = 1.0 / parallel.dp_cp.size
        self.grad_buffer = GradientBuffer(
            dense,
            dense_group,
            pad_to_multiple=dense_group.size if distributed else 1,
            needs_full_gradient=summed_over_another_group,
            gradient_scaling_factor=mean if dense_group.size != parallel.dp_cp.size else None,
            inter=parallel.dp_cp_inter,
            **options,
        )
        if experts:
            self.expert_grad_buffer = GradientBuffer(
                experts,
                expert_group,
                pad_to_multiple=expert_group.size if distributed else 1,
                gradient_scaling_factor=mean,
                inter=parallel.expert_dp_inter,
                **options,
            )
        self.fp8_parameters = None
        if fp8:
            fp8_buffer = GradientBuffer(
                list(fp8),
                dense_group,
                pad_to_multiple=dense_group.size,
                gradient_scaling_factor=mean if dense_group.size != parallel.dp_cp.size else None,
                inter=parallel.dp_cp_inter,
                param_dtype=next(iter(fp8.values())).recipe.dtypes[WEIGHT],
                **options,
            )
            self.fp8_parameters = Fp8Parameters(fp8, fp8_buffer)
        self.buffers = [
            b
            for b in (
                self.grad_buffer,
                self.fp8_parameters and self.fp8_parameters.buffer,
                self.expert_grad_buffer,
            )
            if b is not None
        ]
        for buffer in self.buffers:
            buffer.check_finite = training.check_for_nan_in_loss_and_grad
            buffer.check_norms = training.check_for_large_grads
        matrices = None
        if training.optimizer == "muon":
            matrices = muon_matrices(named, config.model, parallel, training)
        lr_scales = mup_lr_scales(named, config.model, matrices)
        if distributed:
            self.optimizer = DistributedOptimizer(
                named,
                self.buffers,
                training,
                parallel,
                dp.overlap_param_gather,
                offload,
                experts=config.model.is_moe,
                fp8_parameters=self.fp8_parameters,
                matrices=matrices,
                lr_scales=lr_scales,
            )
            if dp.overlap_param_gather:
                for buffer in self.buffers:
                    buffer.wait_for_params_before_forward(model_chunks)
        else:
            self.optimizer = MixedPrecisionOptimizer(
                named, training, parallel, offload, config.model.is_moe, matrices, lr_scales
            )

    def start_step(self, num_microbatches: int) -> None:
        for buffer in self.buffers:
            buffer.start_step(num_microbatches)

    def schedule_options(self) -> dict:
        return {}

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        finalize_model_grads(self.grad_buffer, self.parallel, tuple(self.buffers[1:]))

    def local_grads_finite(self) -> torch.Tensor:
        """Whether this rank's gradients, before the data-parallel reduction, are all finite
        (a device bool; under --overlap-grad-reduce each bucket was looked at as its
        reduction started)."""
        return torch.stack([buffer.local_grads_finite() for buffer in self.buffers]).all()

    def local_bucket_norms(self) -> list[torch.Tensor]:
        """This rank's norm of each bucket before the reduction, buffer by buffer (the
        model's, the FP8 weights', the experts')."""
        return [norm for buffer in self.buffers for norm in buffer.local_bucket_norms()]

    def gradient_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buffers)

    def extra_parameter_bytes(self) -> int:
        """Parameter bytes beside the parameters: the padding of --fp8-param-gather's FP8
        buffer (its copies are the FP8 weights' storage, counted with the parameters)."""
        return self.fp8_parameters.padding_bytes() if self.fp8_parameters is not None else 0

    def parameters_in_model_dtype(self) -> contextlib.AbstractContextManager:
        """While open, every parameter in the run's dtype, readable and writable (checkpoints):
        --fp8-param-gather stores its FP8 weights in FP8 only."""
        if self.fp8_parameters is None:
            return contextlib.nullcontext()
        return self.fp8_parameters.in_model_dtype()

    def finish_param_gather(self) -> None:
        """Wait for an --overlap-param-gather all-gather still in flight."""
        for buffer in self.buffers:
            buffer.finish_param_gather()

    def after_evaluation(self) -> None:
        pass


class TorchDataParallel:
    """PyTorch DDP or FSDP2 (`fsdp`) around each of the stage's model chunks (one, or one per
    virtual pipeline stage); gradients in `param.grad`. Under pipeline parallelism FSDP2
    reduce-scatters a chunk's gradients in its last backward of the step, after every
    micro-batch accumulated; DDP cannot have several forwards in flight, so the schedule
    holds its reduction back throughout and `finish_grad_sync` averages the gradients over DP
    itself. What the stages exchange is the residual stream: in the compute dtype under FSDP2
    (its parameters are cast), fp32 under DDP's autocast."""

    grad_buffer = None

    def __init__(
        self,
        model_chunks: list[nn.Module],
        config: Config,
        parallel: ParallelContext,
        device: torch.device,
        fsdp: bool,
    ) -> None:
        self.model_chunks = model_chunks
        dp = config.parallel
        if not fsdp:  # DDP turns existing gradients into views of its buckets
            for chunk in model_chunks:
                for param in chunk.parameters():
                    param.grad = torch.zeros_like(param)
        reduce_dtype = torch.bfloat16 if dp.grad_reduce_in_bf16 else torch.float32
        self.compute_dtype = params_dtype(config)
        self.activation_dtype = self.compute_dtype if fsdp else torch.float32
        self.device_type = device.type
        # --fp8-param-gather: the FP8 layers' weights all-gathered in FP8 (FSDP2 only: the
        # config refuses DDP), prepared before FSDP2 shards them
        fp8_layers_gathered = fp8_layers(model_chunks) if config.fp8.fp8_param_gather else []
        shard_in_fp8(fp8_layers_gathered)
        self.wrapped_chunks = []
        for chunk in model_chunks:
            wrapped = (
                wrap_fsdp(
                    chunk,
                    device,
                    parallel.dp_cp,
                    self.compute_dtype,
                    reduce_dtype,
                    parallel.expert_dp if config.model.is_moe else None,
                    dp.torch_fsdp2_reshard_after_forward,
                )
                if fsdp
                else wrap_ddp(chunk, device, parallel.dp_cp, dp.bucket_size, reduce_dtype)
            )
            if holds_meta_parameters(chunk):  # --init-model-with-meta-device: only the shards
                materialize(chunk, device, config.training.seed)
            if fsdp:  # sharded gradients, allocated up front so memory is measured at start-up
                for param in chunk.parameters():
                    param.grad = torch.zeros_like(param)
            self.wrapped_chunks.append(wrapped)
        self.parallel = parallel
        self.fsdp = fsdp
        self.reduce_after_schedule = not fsdp and parallel.pp.size > 1
        self.reduce_dtype = reduce_dtype
        self.fp8_parameters = None
        if fp8_layers_gathered:
            self.fp8_parameters = Fp8FsdpParameters(
                fp8_layers_gathered, parallel.dp_cp, self.wrapped_chunks
            )
        named = [
            (name, param) for chunk in model_chunks for name, param in chunk.named_parameters()
        ]
        self.optimizer = NativeOptimizer(
            named,
            config.training,
            parallel,
            sharded=fsdp,
            experts=config.model.is_moe,
            fp8_parameters=self.fp8_parameters,
            lr_scales=mup_lr_scales(named, config.model),
        )

    def start_step(self, num_microbatches: int) -> None:
        self.optimizer.zero_grad()

    def schedule_options(self) -> dict:
        chunks = self.wrapped_chunks
        syncs = [no_sync_context(chunk) for chunk in chunks]
        return {
            # (one per chunk under virtual pipeline stages: each reduces in its last backward)
            "no_sync_func": syncs[0] if len(chunks) == 1 else syncs,
            # (FSDP2, read by the combined schedule of --overlap-moe-expert-parallel-comm)
            "gathered_func": functools.partial(_all_gathered_through_the_schedule, chunks),
        }

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def finish_grad_sync(self) -> None:
        # DDP and FSDP reduce over DP during backward (DDP under PP: here); what remains is
        # TP's part and, under PP, the tied embeddings' two copies.
        params = [param for chunk in self.model_chunks for param in chunk.parameters()]
        if self.reduce_after_schedule:
            average_grads(params, self.parallel.dp_cp, self.reduce_dtype)
        if self.fsdp:
            divide_expert_grads(params, self.parallel.dp_cp, self.parallel.expert_dp)
        all_reduce_sequence_parallel_grads(params, self.parallel, lambda p: local(p.grad))
        all_reduce_embedding_grads(params, self.parallel, lambda p: local(p.grad))

    def _local_grads(self) -> list[torch.Tensor]:
        return [
            local(param.grad)
            for chunk in self.model_chunks
            for param in chunk.parameters()
            if param.grad is not None
        ]

    def local_grads_finite(self) -> torch.Tensor:
        """Whether this rank's gradients are all finite (DDP and FSDP2 have reduced them by the
        end of backward, so a non-finite value shows on every rank)."""
        grads = self._local_grads()
        if not grads:
            return torch.ones((), dtype=torch.bool)
        return torch.stack([torch.isfinite(grad).all() for grad in grads]).all()

    def gradient_bytes(self) -> int:
        return sum(grad.numel() * grad.element_size() for grad in self._local_grads())

    def extra_parameter_bytes(self) -> int:
        """--fp8-param-gather's FP8 copies of this rank's rows."""
        return self.fp8_parameters.fp8_bytes() if self.fp8_parameters is not None else 0

    def parameters_in_model_dtype(self) -> contextlib.AbstractContextManager:
        """While open, every parameter a plain tensor (--fp8-param-gather's FP8 layers' shards
        are FSDP2 all-gather extensions otherwise)."""
        if self.fp8_parameters is None:
            return contextlib.nullcontext()
        return self.fp8_parameters.in_model_dtype()

    def finish_param_gather(self) -> None:
        pass

    def after_evaluation(self) -> None:
        for chunk in self.wrapped_chunks:
            reshard(chunk)


@contextlib.contextmanager
def _all_gathered_through_the_schedule(chunks: list[nn.Module]):
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            stack.enter_context(gathered_through_the_schedule(chunk))
        yield


DataParallel = MegatronDataParallel | TorchDataParallel


def build_data_parallel(
    model_chunks: list[nn.Module],
    config: Config,
    parallel: ParallelContext,
    device: torch.device,
    offload: bool,
) -> DataParallel:
    strategy = config.parallel.distributed_strategy
    if strategy in ("ddp", "fsdp"):
        return TorchDataParallel(model_chunks, config, parallel, device, strategy == "fsdp")
    return MegatronDataParallel(model_chunks, config, parallel, offload)
