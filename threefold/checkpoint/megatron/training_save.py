"""A run's own checkpoints in Megatron-LM's torch_dist layout (--ckpt-format torch_dist), so
that Megatron-LM's --load takes them as they are, written by the ranks at any TP/PP/EP/DP
layout: what tools/convert_checkpoint.py --saver megatron writes from threefold's format
(checkpoint/megatron/save.py), tensor for tensor.

Each parameter, and each of Adam's fields (assembled from the distributed optimizer's pieces),
is gathered whole over its TP (expert-TP) group and kept by one rank of that group and of the
data-parallel replicas, the ranks taking turns, so a rank holds about its distributed-optimizer
shard's size in whole tensors. That rank cuts it as megatron-core's state dict keys it
(checkpoint/megatron/tensors.py: a layer's slice of a stacked tensor, an expert's, a section)
and hands each piece to torch.distributed.checkpoint as a chunk of the global tensor at its
offsets (tied embeddings' two stages offer the same chunks, which DCP writes once). Rank 0
writes common.pt (Megatron-LM's args; Adam's step, parameter groups and LR schedule) and
metadata.json. The directory is written as threefold's own are (checkpoint/
writer.py: `iter_N.partial/`, renamed when complete, the tracker last, --async-save in the
background), with threefold's manifest and Megatron-LM's integrity.json.

Each rank's RNG streams go beside them, `rng/rank_N.pt` as in threefold's own checkpoints
(Megatron-LM's args say it holds none of Megatron-LM's, which reads none of these), and
common.pt's `threefold` entry names the ranks' layout they belong to: a resume here at that
layout takes them, so it draws the dropout masks the run would have. What Megatron-LM's layout
cannot hold keeps a run in threefold's format, said at start-up (`blocker`): the state of other
optimizers, LoRA adapters, FP8 delayed scaling. PyTorch DDP/FSDP2 runs (--distributed-strategy
ddp|fsdp, Megatron-LM's --use-torch-fsdp2) save it as well: their fp32 parameters are the
masters, FSDP2's shards (of weights and Adam's fields) gathered whole over DP.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from threefold.checkpoint.components import CheckpointComponents
from threefold.checkpoint.loadable import check_architecture, rng_file, rng_layout
from threefold.checkpoint.megatron.format import BACKEND, described_model, megatron_args
from threefold.checkpoint.megatron.optimizer import (
    ExportShape,
    export_shape,
    exported_common,
    steps_distributed,
    unexportable,
)
from threefold.checkpoint.megatron.save import (
    HYBRID_OUTPUT_EXTRA_STATE,
    layer_stacking,
    megatron_common,
    megatron_tensor,
)
from threefold.checkpoint.megatron.tensors import (
    Part,
    extra_state,
    extra_state_key,
    layer_kinds,
    megatron_parts,
)
from threefold.checkpoint.save import rng_state
from threefold.checkpoint.writer import CheckpointWriter
from threefold.config import Config, ConfigError
from threefold.parallel.data_parallel.torch_native import full
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import (
    gather_tensor_parallel,
    is_expert,
    sharding_group,
)


def blocker(config: Config) -> str | None:
    """Why this run's checkpoints cannot be Megatron-LM's torch_dist (they are then saved in
    threefold's format, said at start-up), or None."""
    if config.model.lora_rank:
        return "a LoRA run's adapters have no place in it"
    if config.fp8.fp8 is not None and config.fp8.fp8_recipe == "delayed":
        return "--fp8-recipe delayed's scaling state (amax histories) has no place in it"
    try:  # what a --load of the checkpoint would build: this run's model, or a refusal
        args = megatron_args(config, 0)
        own = {"vocab_size": config.model.vocab_size}
        described = described_model(args, own, "--ckpt-format torch_dist")
        check_architecture("--ckpt-format torch_dist", dataclasses.asdict(described), config.model)
    except ConfigError as error:
        return str(error).split(" (")[0].split("; ")[0]
    reason = None if config.checkpoint.no_save_optim else unexportable(config, {})
    return None if reason is None else f"it cannot hold {reason}; --no-save-optim saves the model"


class _ChunkPlanner(DefaultSavePlanner):
    """Writes each tensor of the state dict as the chunk `chunks[name]` places it, (the global
    tensor's key, size, offsets), and the other values (megatron-core's serialized
    `_extra_state` objects) as their bytes, under their own names."""

    def __init__(self, chunks: dict[str, tuple[str, torch.Size, torch.Size]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks
        self._names = {(key, tuple(offsets)): name for name, (key, _, offsets) in chunks.items()}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, value in self.state_dict.items():
            if name not in self.chunks:
                items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
                continue
            key, size, offsets = self.chunks[name]
            data = TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=value.shape),
                properties=TensorProperties.create_from_tensor(value),
                size=size,
            )
            index = MetadataIndex(key, offsets)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return self.state_dict[index.fqn]
        return self.state_dict[self._names[(index.fqn, tuple(index.offset))]]

    def transform_object(self, write_item, object):
        return object  # (megatron-core's extra state: bytes it reads with one torch.load)


def _kept_whole(
    named: list[tuple[str, nn.Parameter]], optimizer, parallel: ParallelContext, fields: dict
) -> dict[str, dict[str, torch.Tensor]]:
    """{field: {name: whole tensor}} of the parameters this rank keeps, the weights' ("model")
    and, given the `optimizer`, Adam's `fields`: each is put together from the optimizer's
    pieces and gathered whole (and unpadded) over its TP (expert-TP) group, one parameter and
    field at a time, and kept by one rank of that group and one of the data-parallel replicas
    holding the same shard (DP x CP; an expert's: expert-DP), in turn, so that the keeping
    and writing spread over all of them and no rank holds more than one extra whole tensor
    on the device."""
    fields = ("model", *(fields if optimizer is not None else ()))
    pieces = optimizer.pieces_of() if optimizer is not None else {}
    kept: dict[str, dict[str, torch.Tensor]] = {field: {} for field in fields}
    for index, (name, param) in enumerate(named):
        group = sharding_group(param, parallel)
        replicas = parallel.expert_dp if is_expert(param) else parallel.dp_cp
        mine = index % group.size == group.rank
        mine = mine and (index // group.size) % replicas.size == replicas.rank
        for field in fields:
            if field == "model":  # (FSDP2's shards gathered over DP)
                value = full(param.detach())
            elif param.requires_grad:  # (no state: DeepSeek-V3's expert bias, say)
                value = optimizer.whole_state(field, param, pieces.get(param, []))
            else:
                continue
            whole = gather_tensor_parallel(value, param, group)
            if mine:
                kept[field][name] = whole.cpu()
    return kept


def _grid(part: Part, config: Config) -> tuple[int, ...]:
    """The leading shape a part's key stacks: every layer if stacked, then every expert."""
    layers = (config.model.num_layers,) if part.stacked else ()
    return layers + (config.model.num_experts,) * (len(part.index) - len(layers))


def _state(
    config: Config,
    kept: dict[str, dict[str, torch.Tensor]],
    kinds,
    dtype: torch.dtype,
    fields: dict[str, str],
) -> tuple[dict, dict]:
    """This rank's chunks (and extra-state objects) of megatron-core's state dict, and where
    each chunk lies in its global tensor; `fields`: Megatron-LM's names of the optimizer's."""
    stacked, sections = layer_stacking(config)
    mla = config.model.multi_latent_attention
    state, chunks = {}, {}
    for field, tensors in kept.items():
        prefix = "" if field == "model" else f"optimizer.state.{fields[field]}."
        for name, whole in tensors.items():
            key, tensor = megatron_tensor(
                config, name, whole, dtype if field == "model" else torch.float32
            )
            parts, module = megatron_parts(key, tensor, kinds, mla, stacked, sections)
            for part in parts:
                # (the slice as a chunk of the stack: of size 1 along the stacked axes)
                chunk = part.tensor.reshape((1,) * len(part.index) + tuple(part.tensor.shape))
                name_here = f"{prefix}{part.key}@{part.index}"
                state[name_here] = chunk
                chunks[name_here] = (
                    prefix + part.key,
                    torch.Size(_grid(part, config) + tuple(part.tensor.shape)),
                    torch.Size(part.index + (0,) * part.tensor.dim()),
                )
            if module is not None and field == "model":
                shape = _grid(module, config) or (1,)
                state[extra_state_key(module.key, module.index or (0,), shape)] = extra_state()
    return state, chunks


def _shape(config: Config, named: list[tuple[str, nn.Parameter]]) -> ExportShape:
    """The optimizer state's shape: for a Megatron-LM run of the same flags (its optimizer,
    expert layout and precision), as Megatron-LM's own save shapes it. The groups are the
    whole model's, each rank's stage's gathered (collective)."""
    layout, training = config.parallel, config.training

    def union(kinds: frozenset) -> frozenset:
        if not dist.is_initialized():
            return kinds
        gathered = [frozenset()] * dist.get_world_size()
        dist.all_gather_object(gathered, kinds)
        return frozenset().union(*gathered)

    return export_shape(
        named,
        config,
        steps_distributed(layout.use_distributed_optimizer, layout.distributed_strategy),
        (
            layout.tensor_model_parallel_size,
            layout.expert_model_parallel_size,
            layout.expert_tensor_parallel_size,
        ),
        training.bf16 or training.fp16,
        union,
    )


def save_megatron_training_checkpoint(
    root: str, components: CheckpointComponents, writer: CheckpointWriter
) -> str:
    """Write the components' state for the current iteration as Megatron-LM's torch_dist
    checkpoint; returns the directory (with an asynchronous `writer`, complete once
    `writer.wait()` returns). Every rank calls it."""
    config, parallel = components.config, components.parallel
    training = config.training
    dtype = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else torch.float32
    train_state = components.train_state.state_dict()
    iteration = train_state["iteration"]
    save_optimizer = not config.checkpoint.no_save_optim
    named = list(components.parameters())
    optimizer = components.optimizer if save_optimizer else None
    shape = _shape(config, named) if save_optimizer else ExportShape()
    if optimizer is not None:
        optimizer.initialize_state()  # (Adam's moments exist before the first step)
    with components.parameters_in_model_dtype():
        kept = _kept_whole(named, optimizer, parallel, shape.fields)
    kinds = layer_kinds([name for name, _ in named])
    state, chunks = _state(config, kept, kinds, dtype, shape.fields)
    if config.model.hybrid and parallel.is_last_pipeline_stage:
        state[HYBRID_OUTPUT_EXTRA_STATE] = extra_state()
    exported = None
    if save_optimizer:
        # (where the process group's backend works: NCCL's on the GPU)
        step = torch.tensor(components.optimizer.adam_step(), device=named[0][1].device)
        if dist.is_initialized():  # (a rank of the distributed optimizer may hold no piece)
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
        exported = exported_common(
            config,
            components.scheduler.state_dict(),
            float(step),
            shape,
            components.loss_scaler.state_dict(),
        )
    save_rng = not config.checkpoint.no_save_rng
    streams = {"rng_saved": save_rng, "rng_layout": rng_layout(config)}
    common = megatron_common(config, iteration, train_state, dtype, exported, streams)

    def write_rank_files(path: str) -> None:
        if save_rng:  # (beside Megatron-LM's files, which it does not read)
            os.makedirs(os.path.dirname(rng_file(path, writer.rank)), exist_ok=True)
            torch.save(rng_state(), rng_file(path, writer.rank))
        if writer.rank == 0:
            torch.save(common, os.path.join(path, "common.pt"))
            with open(os.path.join(path, "metadata.json"), "w") as f:
                json.dump(BACKEND, f)

    return writer.save(iteration, write_rank_files, state, _ChunkPlanner(chunks), integrity=True)
