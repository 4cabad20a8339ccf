"""Building what the trainer composes: this rank's model chunks, its data parallelism with the
optimizer, the LR scheduler and the loss scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from threefold.config import Config
from threefold.config.fp8 import caches_fp8_weights, traces_fp8_linears
from threefold.kernels.dispatch import KERNELS, compile_layers, configure_for_model
from threefold.model import GPTModel
from threefold.model.fp8 import Fp8Scaling, convert_to_fp8
from threefold.model.meta_device import materialize, move_buffers, parameters_on_meta
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.pipeline_parallel.layout import chunk_layers_of
from threefold.training.data_parallel import (
    DataParallel,
    build_data_parallel,
    params_dtype,
    uses_torch_data_parallel,
)
from threefold.training.loss_scaler import build_loss_scaler
from threefold.training.lr_scheduler import OptimizerParamScheduler
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.muon import describe as describe_muon
from threefold.training.precision_aware import describe as describe_precision_aware
from threefold.training.strategy import resolve_auto_strategy


def build_model_chunks(
    config: Config, parallel: ParallelContext, device: torch.device, dtype: torch.dtype
) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving)."""
    pp, rank = parallel.pp.size, parallel.pp.rank
    layers = chunk_layers_of(config.parallel, config.model, rank)
    padded_vocab = config.model.padded_vocab_size(parallel.tp.size)
    meta = config.parallel.init_model_with_meta_device
    chunks = []
    for index, (offset, count) in enumerate(layers):
        with parameters_on_meta() if meta else contextlib.nullcontext():
            chunk = GPTModel(
                config.model,
                padded_vocab,
                parallel=parallel,
                pre_process=rank == 0 and index == 0,
                post_process=rank == pp - 1 and index == len(layers) - 1,
                num_layers=count,
                layer_offset=offset,
            )
        if not meta:
            chunk.initialize(config.training.seed)
            chunks.append(chunk.to(device=device, dtype=dtype))
        else:  # FSDP2 materializes its shards once it has cut them (TorchDataParallel)
            move_buffers(chunk.to(dtype=dtype), device)
            if config.parallel.distributed_strategy != "fsdp":
                materialize(chunk, device, config.training.seed)
            chunks.append(chunk)
        if config.fp8.enabled:
            convert_to_fp8(
                chunk,
                config.fp8,
                parallel,
                config.model.num_layers,
                device,
                config.training.calculate_per_token_loss,
                traced=traces_fp8_linears(
                    config.kernels.compile_layers, pp, config.fp8.fp8_param_gather
                ),
            )
        if config.kernels.compile_layers:
            compile_layers(chunk, config.kernels.compile_backend)
    return chunks


def build_model_and_optimizer(
    config: Config, parallel: ParallelContext, device: torch.device, report: Callable[[str], None]
):
    """(model chunks, data parallelism with its optimizer, scheduler, loss scaler, FP8 scaling
    or None); `report` prints the start-up choices on rank 0."""
    training, layout = config.training, config.parallel
    if layout.distributed_strategy == "auto":
        report(f"> {resolve_auto_strategy(config, device)}")
    report(
        configure_for_model(
            config.kernels,
            config.model,
            parallel.tp.size,
            device,
            params_dtype(config),
            training.micro_batch_size,
            config.fp8,
            parallel.pp.size,
            layout.comm_type if parallel.cp.size > 1 else None,
        )
    )
    torch_native = uses_torch_data_parallel(config)
    chunks = build_model_chunks(
        config, parallel, device, torch.float32 if torch_native else params_dtype(config)
    )
    offload = training.optimizer_cpu_offload and device.type != "cpu"
    if training.optimizer_cpu_offload and not offload:
        report("> --optimizer-cpu-offload: this run is on the CPU already, nothing to offload")
    data_parallel: DataParallel = build_data_parallel(chunks, config, parallel, device, offload)
    if config.kernels.gradient_accumulation_fusion and data_parallel.grad_buffer is not None:
        for chunk in chunks:
            for module in chunk.modules():
                if hasattr(module, "gradient_accumulation_fusion"):
                    # An FP8 layer adds its GEMM's fp32 weight gradient itself: it needs no
                    # addmm with out_dtype, and it can inside compiled layers too (its forward
                    # flags the placeholder: Fp8Linear.linear).
                    in_fp8 = getattr(module, "fp8", None) is not None
                    fuse = KERNELS.gradient_accumulation_fusion or in_fp8
                    module.gradient_accumulation_fusion = fuse
    if config.parallel.delay_wgrad_compute:  # (threefold/parallel/tensor_parallel/delayed_wgrad.py)
        for chunk in chunks:
            for module in chunk.modules():
                if hasattr(module, "delay_wgrad_compute"):
                    module.delay_wgrad_compute = True
    fp8 = None
    if config.fp8.enabled:
        cache = caches_fp8_weights(config.parallel.distributed_strategy)
        fp8 = Fp8Scaling(
            chunks,
            config.fp8,
            parallel,
            config.model.num_layers,
            cache,
            config.kernels.compile_layers,
        )
        report(fp8.describe())
    optimizer = data_parallel.optimizer
    if training.optimizer == "muon":
        report(describe_muon(training, len(optimizer.muon.matrices) if optimizer.muon else 0))
    if training.precision_aware_steps():
        report(describe_precision_aware(config))
    elif training.use_precision_aware_optimizer:  # (Megatron-LM's hybrid optimizer: the same)
        report(
            "> optimizer: --use-precision-aware-optimizer with --optimizer-cpu-offload: AdamW "
            "steps in host memory with fp32 masters and moments"
        )
    optimizer.initialize_state()
    optimizer.count_zeros = config.logging.log_num_zeros_in_grad
    named = [
        (chunk.layout_independent_name(name), param)
        for chunk in chunks
        for name, param in chunk.named_parameters()
    ]
    print(
        f"> rank {parallel.world.rank} {measure_bytes_per_parameter(named, data_parallel)}",
        flush=True,
    )
    return (
        chunks,
        data_parallel,
        OptimizerParamScheduler(optimizer, training),
        build_loss_scaler(training),
        fp8,
    )
