"""Process groups: torch.distributed plus megatron-core's `parallel_state`.

megatron-core builds the tensor (TP), context (CP), pipeline (PP) and data (DP) groups with
Megatron's rank order: TP varies fastest, then CP, then DP, then PP. With world size 8, TP=2,
PP=2 the grid is `arange(8).view(pp=2, dp=2, tp=2)`; with TP=2, CP=2, DP=2 it is
`arange(8).view(dp=2, cp=2, tp=2)`; see docs/parallelism.md for the picture.

Everything below also answers sensibly when no process group exists (one process, sizes 1,
ranks 0), so the single-process reference run of a parity test needs no distributed setup.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import torch
import torch.distributed as dist

from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.pipeline_parallel.p2p import destroy_p2p_groups, initialize_p2p_groups


def _parallel_state():
    # megatron-core warns at import about missing Transformer Engine / apex: irrelevant here,
    # threefold owns its layers and kernels.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    return parallel_state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(backend: str | None = None, timeout_minutes: int = 10) -> torch.device:
    """Initialize torch.distributed from torchrun's environment (or as a world of one).

    Returns the device this rank computes on.
    """
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "--distributed-backend nccl needs CUDA GPUs and this machine has none; pass "
            "--distributed-backend gloo (or leave it out: gloo on CPU, nccl on GPUs)"
        )
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # plain `python pretrain_gpt.py`: a world of one
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
            )
        timeout = datetime.timedelta(minutes=timeout_minutes)
        # torchrun's static rendezvous keeps one store across --max-restarts: a restarted
        # worker would find the previous attempt's keys (dead peers' addresses) and hang in
        # the group's set-up. Each attempt gets its own namespace in the store.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            rank=rank,
            world_size=world_size,
            store=dist.PrefixStore(f"threefold/attempt_{attempt}", store),
        )
    return device


_GROUPS_BEFORE: set = set()


def _process_groups() -> set:
    # c10d keeps every group alive in its registry; there is no public way to list them.
    return set(dist.distributed_c10d._world.pg_map)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout_minutes: int = 10,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
) -> None:
    """Build TP/CP/PP/DP groups (and the experts' ETP, EP and expert-DP) over the initialized
    world with megatron-core."""
    destroy_model_parallel()
    _GROUPS_BEFORE.clear()
    _GROUPS_BEFORE.update(_process_groups())
    ps = _parallel_state()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        # On CPU the main groups already are gloo; duplicates would only cost start-up time.
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    initialize_p2p_groups(pipeline_model_parallel_size, timeout_minutes)


def initialize_from_config(parallel) -> tuple[torch.device, ParallelContext]:
    """torch.distributed from torchrun's environment and megatron-core's groups for the
    layout of a ParallelConfig; returns this rank's device and its parallel context."""
    device = initialize_distributed(
        parallel.distributed_backend, parallel.distributed_timeout_minutes
    )
    return device, initialize_layout(parallel)


def initialize_layout(parallel) -> ParallelContext:
    """megatron-core's groups for a ParallelConfig over the initialized world; the context."""
    initialize_model_parallel(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        parallel.distributed_timeout_minutes,
        parallel.context_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size,
    )
    context = parallel_context(parallel.sequence_parallel, parallel.comm_type)
    # The config's DP size (validated before launch) and the groups' must be one number.
    if context.dp.size != parallel.data_parallel_size:
        raise RuntimeError(
            f"{context.dp.size} data-parallel ranks, but the config was validated for "
            f"{parallel.data_parallel_size} (WORLD_SIZE {parallel.world_size})"
        )
    return context


def initialize_for_inference(
    pipeline_model_parallel_size: int = 1, tensor_model_parallel_size: int | None = None
) -> tuple[torch.device, ParallelContext]:
    """The generation and scoring tools' layout: the launched processes split into pipeline
    stages, the ranks of a stage tensor-parallel."""
    device = initialize_distributed()
    world, pp = global_world_size(), pipeline_model_parallel_size
    if pp < 1 or world % pp:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} does not divide the {world} launched processes"
        )
    tp = tensor_model_parallel_size or world // pp
    if tp * pp != world:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} is not "
            f"the {world} launched processes"
        )
    initialize_model_parallel(tp, pp)
    return device, parallel_context()


def parallel_context(sequence_parallel: bool = False, cp_comm_type: str = "p2p") -> ParallelContext:
    """The groups megatron-core built (or a world of one when it built none), read once."""
    if not is_initialized():
        return ParallelContext(world=Group(None, global_world_size(), global_rank()))
    tp = Group(
        tensor_model_parallel_group(),
        tensor_model_parallel_world_size(),
        tensor_model_parallel_rank(),
    )
    pp = Group(
        pipeline_model_parallel_group(),
        pipeline_model_parallel_world_size(),
        pipeline_model_parallel_rank(),
    )
    ps = _parallel_state()
    dp_cp = Group(
        ps.get_data_parallel_group(with_context_parallel=True),
        ps.get_data_parallel_world_size(with_context_parallel=True),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    cp = Group(
        ps.get_context_parallel_group(),
        ps.get_context_parallel_world_size(),
        ps.get_context_parallel_rank(),
    )
    tp_cp = Group(
        ps.get_tensor_and_context_parallel_group(),
        ps.get_tensor_and_context_parallel_world_size(),
        ps.get_tensor_and_context_parallel_rank(),
    )
    ep = Group(
        ps.get_expert_model_parallel_group(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
    )
    expert_tp = Group(
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
    )
    expert_tp_ep = Group(
        ps.get_expert_tensor_and_model_parallel_group(),
        ps.get_expert_tensor_and_model_parallel_world_size(),
        ps.get_expert_tensor_and_model_parallel_rank(),
    )
    # The dispatcher addresses an expert's ETP ranks as EP rank x ETP + ETP rank.
    if expert_tp_ep.rank != ep.rank * expert_tp.size + expert_tp.rank:
        raise RuntimeError("megatron-core's expert groups are not ordered ETP-fastest")
    expert_dp = Group(
        ps.get_expert_data_parallel_group(),
        ps.get_expert_data_parallel_world_size(),
        ps.get_expert_data_parallel_rank(),
    )
    return ParallelContext(
        tp=tp,
        pp=pp,
        ep=ep,
        expert_tp=expert_tp,
        expert_tp_ep=expert_tp_ep,
        expert_dp=expert_dp,
        expert_model_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
        dp=Group(data_parallel_group(), data_parallel_world_size(), data_parallel_rank()),
        cp=cp,
        dp_cp=dp_cp,
        tp_cp=tp_cp,
        cp_comm_type=cp_comm_type,
        world=Group(dist.group.WORLD, global_world_size(), global_rank()),
        # Only the first and last stage belong to one (megatron-core asserts elsewhere).
        embedding_group=embedding_group() if pp.rank in (0, pp.size - 1) else None,
        model_parallel_group=model_parallel_group(),
        sequence_parallel=sequence_parallel and tp.size > 1,
    )


def destroy_model_parallel() -> None:
    """Tear the groups down for real. megatron-core's destroy only forgets its references; the
    groups (each with a gloo event-loop thread) would otherwise live on, so a process that
    re-initializes many layouts (the test workers) would accumulate hundreds of threads."""
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        return
    ps.destroy_model_parallel()
    # Its destroy misses some of its own globals (the intra-partial data-parallel group with
    # context parallelism, in 0.16): a group still referenced keeps its threads.
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    destroy_p2p_groups()
    for group in _process_groups() - _GROUPS_BEFORE:
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def is_initialized() -> bool:
    return dist.is_initialized() and _parallel_state().model_parallel_is_initialized()


def _query(name: str, default):
    if not is_initialized():
        return default
    return getattr(_parallel_state(), name)()


def tensor_model_parallel_group() -> dist.ProcessGroup | None:
    return _query("get_tensor_model_parallel_group", None)


def tensor_model_parallel_world_size() -> int:
    return _query("get_tensor_model_parallel_world_size", 1)


def tensor_model_parallel_rank() -> int:
    return _query("get_tensor_model_parallel_rank", 0)


def pipeline_model_parallel_group() -> dist.ProcessGroup | None:
    return _query("get_pipeline_model_parallel_group", None)


def pipeline_model_parallel_world_size() -> int:
    return _query("get_pipeline_model_parallel_world_size", 1)


def pipeline_model_parallel_rank() -> int:
    return _query("get_pipeline_model_parallel_rank", 0)


def data_parallel_group() -> dist.ProcessGroup | None:
    return _query("get_data_parallel_group", None)


def data_parallel_world_size() -> int:
    return _query("get_data_parallel_world_size", 1)


def data_parallel_rank() -> int:
    return _query("get_data_parallel_rank", 0)


def embedding_group() -> dist.ProcessGroup | None:
    """First and last pipeline stage of each pipeline: the holders of tied embeddings."""
    return _query("get_embedding_group", None)


def model_parallel_group() -> dist.ProcessGroup | None:
    """TP x PP: the ranks that together hold one replica of the model."""
    return _query("get_model_parallel_group", None)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_first_pipeline_stage() -> bool:
    return pipeline_model_parallel_rank() == 0


def is_last_pipeline_stage() -> bool:
    return pipeline_model_parallel_rank() == pipeline_model_parallel_world_size() - 1
