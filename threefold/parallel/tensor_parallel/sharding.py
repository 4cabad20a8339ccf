"""How a parameter is split across tensor-parallel ranks, and layout-independent initialization.

The attributes a parameter carries, as Megatron names them (`PARAMETER_ATTRIBUTES`; this is the
one place they are written down; the only code that sets them is below, the TP layers
(`shared_embedding`, `embedding_copy`: model/gpt.py) and the gradient buffer (`main_grad`)):

    tensor_model_parallel  bool       split over TP ranks (False: every TP rank holds it whole);
                                      an expert's weight: split over expert-TP ranks instead
    partition_dim          int        the split dimension (TP parameters only)
    partition_stride       int        > 1: the full tensor is `stride` stacked blocks, each split
                                      separately (SwiGLU's [gate; up])
    partition_sizes        tuple|None the same for stacked blocks of unequal sizes (the gated
                                      delta net's [q; k; v; z; beta; alpha] projection): each
                                      block's size in the full tensor
    master_shape           tuple      the full tensor's shape on one device (vocabulary padded)
    valid_rows             int|None   rows of the full tensor that are real (the rest: padding)
    vocabulary_rows        bool       its rows are the vocabulary's, padded to a multiple of
                                      --make-vocab-size-divisible-by x TP (so a checkpoint of
                                      another TP may hold more padding rows, or none)
    init_method            callable   init_method(full tensor, generator)
    sequence_parallel      bool       each TP rank computes part of its gradient, summed over TP
                                      (sequence-parallel norms and biases, query/key norms)
    shared_embedding       bool       one of the two copies of tied word embeddings under PP
    embedding_copy         bool       the last stage's copy (counted once in norms)
    expert_parallel        bool       an expert's weight (model/moe): on the one EP rank holding
                                      the expert (split over its expert-TP group when
                                      tensor_model_parallel), its gradient summed over expert-DP
    main_grad              Tensor     its view into the gradient buffer (parallel/data_parallel)

`initialize_parameters` draws each *full* tensor from a generator seeded by the run seed and the
parameter's layout-independent name, then keeps this rank's shard. A model built at TP=N thus
holds exactly the shards of the TP=1 model with the same seed (Megatron's
`--use-cpu-initialization` has the same property), which is what parity tests and users
comparing layouts need. Drawing on the CPU also makes the model the same on CPU and GPU.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from threefold.parallel.parallel_context import Group, ParallelContext

InitMethod = Callable[[torch.Tensor, torch.Generator], None]
PARAMETER_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "partition_sizes",
    "master_shape",
    "valid_rows",
    "vocabulary_rows",
    "init_method",
    "sequence_parallel",
    "shared_embedding",
    "embedding_copy",
    "expert_parallel",
)


def normal_init(std: float) -> InitMethod:
    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.normal_(0.0, std, generator=generator)

    return init


def xavier_uniform_init() -> InitMethod:
    """torch's xavier_uniform_ (Megatron-LM's --init-method-xavier-uniform) of the full matrix,
    so every TP layout draws the same; stacked experts' [E, out, in] tensor one expert at a
    time."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        for matrix in tensor.view(-1, *tensor.shape[-2:]):
            torch.nn.init.xavier_uniform_(matrix, generator=generator)

    return init


def constant_init(value: float) -> InitMethod:
    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.fill_(value)

    return init


def uniform_init(bound: float) -> InitMethod:
    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.uniform_(-bound, bound, generator=generator)

    return init


def log_uniform_init(low: float, high: float) -> InitMethod:
    """The logarithm of a uniform draw from [low, high] (a decay rate's A_log)."""

    def init(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.uniform_(low, high, generator=generator).log_()

    return init


def mark_replicated(
    param: torch.nn.Parameter, init_method: InitMethod, partial_grads: bool = False
) -> torch.nn.Parameter:
    """A parameter every TP rank holds whole. `partial_grads`: each rank computes only part of
    its gradient (its slice of the sequence under sequence parallelism, its heads for query/key
    norms), which must be summed over the TP group; Megatron's `sequence_parallel` attribute."""
    param.tensor_model_parallel = False
    param.master_shape = tuple(param.shape)
    param.valid_rows = param.shape[0] if param.dim() else None
    param.init_method = init_method
    param.sequence_parallel = partial_grads
    return param


def mark_expert(
    param: torch.nn.Parameter,
    init_method: InitMethod,
    partition_dim: int | None = None,
    master_shape: tuple[int, ...] | None = None,
    partition_stride: int = 1,
) -> torch.nn.Parameter:
    """A weight of one expert, on the rank that holds the expert, named by the expert's global
    index so it is initialized and saved alike at any EP. With a `partition_dim` it is split
    over the expert-TP group like a TP weight (`master_shape`: the whole expert's); without,
    every expert-TP rank holds it whole."""
    if partition_dim is None:
        mark_replicated(param, init_method)
    else:
        mark_tensor_parallel(param, partition_dim, init_method, master_shape, partition_stride)
    param.expert_parallel = True
    return param


def is_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)


def sharding_group(param: torch.nn.Parameter, parallel: ParallelContext) -> Group:
    """The group a parameter's TP split runs over: expert-TP for an expert's, else TP."""
    return parallel.expert_tp if is_expert(param) else parallel.tp


def mark_tensor_parallel(
    param: torch.nn.Parameter,
    partition_dim: int,
    init_method: InitMethod,
    master_shape: tuple[int, ...],
    partition_stride: int = 1,
    valid_rows: int | None = None,
    partition_sizes: tuple[int, ...] | None = None,
) -> torch.nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride
    param.partition_sizes = partition_sizes
    param.master_shape = tuple(master_shape)
    param.valid_rows = master_shape[0] if valid_rows is None else valid_rows
    param.vocabulary_rows = valid_rows is not None
    param.init_method = init_method
    param.sequence_parallel = False
    return param


def _blocks(tensor: torch.Tensor, param: torch.nn.Parameter, parts: int) -> tuple:
    """The stacked blocks that are split separately, cut from the full tensor (`parts` 1) or
    from one of `parts` shards."""
    sizes = getattr(param, "partition_sizes", None)
    if sizes is None:
        return tensor.chunk(param.partition_stride, dim=param.partition_dim)
    return tensor.split([size // parts for size in sizes], dim=param.partition_dim)


def shard_of(full: torch.Tensor, param: torch.nn.Parameter, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a full tensor, following the parameter's partitioning."""
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return full
    dim = param.partition_dim
    blocks = _blocks(full, param, 1)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim)


def unshard(shards: list[torch.Tensor], param: torch.nn.Parameter) -> torch.Tensor:
    """Inverse of `shard_of`: the full tensor from every rank's shard, in rank order."""
    if not getattr(param, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    dim = param.partition_dim
    per_rank_blocks = [_blocks(shard, param, len(shards)) for shard in shards]
    blocks = [torch.cat(rank_blocks, dim=dim) for rank_blocks in zip(*per_rank_blocks)]
    return torch.cat(blocks, dim=dim)


def parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def initialize_parameters(
    named_parameters: list[tuple[str, torch.nn.Parameter]], seed: int, parallel: ParallelContext
) -> None:
    """Initialize each parameter as the shard of a full tensor drawn from a per-name generator.

    `named_parameters` must use layout-independent names (global layer numbers).
    """
    for name, param in named_parameters:
        full = torch.zeros(param.master_shape, dtype=torch.float32)
        generator = torch.Generator().manual_seed(parameter_seed(seed, name))
        rows = param.valid_rows if param.dim() else None
        param.init_method(full[:rows] if rows is not None else full, generator)
        group = sharding_group(param, parallel)
        shard = shard_of(full, param, group.rank, group.size)
        if isinstance(param, DTensor):
            # sharded by FSDP2 before it was initialized (--init-model-with-meta-device): this
            # rank's rows, cut as FSDP2 cuts them, with no communication (every rank drew alike)
            mesh, placements = param.device_mesh, param.placements
            shard = distribute_tensor(shard, mesh, placements, src_data_rank=None).to_local()
            param = param.to_local()
        param.copy_(shard)


@torch.no_grad()
def gather_tensor_parallel(
    tensor: torch.Tensor, param: torch.nn.Parameter, tp: Group
) -> torch.Tensor:
    """The full, unpadded tensor of `param` (or of a same-shaped companion such as its gradient),
    gathered from every rank of `tp`."""
    if getattr(param, "tensor_model_parallel", False) and tp.size > 1:
        shards = [torch.empty_like(tensor) for _ in range(tp.size)]
        dist.all_gather(shards, tensor.contiguous(), group=tp.group)
        tensor = unshard(shards, param)
    if param.dim() and param.valid_rows is not None:
        tensor = tensor[: param.valid_rows]
    return tensor
