"""Process groups: built once for a layout, in Megatron's rank order, read into a ParallelContext.

The groups are those megatron-core's `parallel_state.initialize_model_parallel` builds, with
the same members (`threefold.parallel.rank_order`: TP varies fastest, then CP, then DP, then
PP; with world size 8, TP=2, PP=2 the grid is `arange(8).view(pp=2, dp=2, tp=2)`; see
docs/parallelism.md for the picture; `--use-tp-pp-dp-mapping` puts PP before DP), so a rank
holds the shard it would in Megatron-LM. They are built here rather than by megatron-core:
importing it (its package imports torch's compiler) took 2.6 s of a tiny run's 6.5 s start, for
groups that are a few `new_group` calls.

Everything below also answers sensibly when no process group exists (one process, sizes 1,
ranks 0), so the single-process reference run of a parity test needs no distributed setup.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist

from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.pipeline_parallel.p2p import destroy_p2p_groups, initialize_p2p_groups
from threefold.parallel.rank_order import DEFAULT_ORDER, TP_PP_DP_ORDER, RankLayout

# This rank's group of each kind (`_GROUP_KINDS`), while a layout is initialized.
_GROUPS: dict[str, Group] = {}


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


# Each kind of group: its name (the ParallelContext field it fills) and its members in the
# layout; the comments give megatron-core's name for it. Every rank creates every group, in
# this order, as `new_group` needs.
_GROUP_KINDS = (
    ("tp", lambda layout: layout.dense("tp")),  # tensor model parallel
    ("pp", lambda layout: layout.dense("pp")),  # pipeline model parallel
    ("dp", lambda layout: layout.dense("dp")),  # data parallel
    ("cp", lambda layout: layout.dense("cp")),  # context parallel
    ("dp_cp", lambda layout: layout.dense("dp-cp")),  # data parallel with context parallel
    ("tp_cp", lambda layout: layout.dense("tp-cp")),  # tensor and context parallel
    ("model_parallel", lambda layout: layout.dense("tp-pp")),  # model parallel
    ("embedding", lambda layout: layout.embedding()),  # embedding
    ("ep", lambda layout: layout.experts("ep")),  # expert model parallel
    ("expert_tp", lambda layout: layout.experts("tp")),  # expert tensor parallel
    ("expert_tp_ep", lambda layout: layout.experts("tp-ep")),  # expert tensor and model parallel
    ("expert_dp", lambda layout: layout.experts("dp")),  # expert data parallel
    # --num-distributed-optimizer-instances (none at 1): intra-partial data parallel (with CP),
    # the ranks across instances, and the same for expert data parallel
    ("dp_cp_intra", lambda layout: layout.instances(layout.dense("dp-cp"), "intra")),
    ("dp_cp_inter", lambda layout: layout.instances(layout.dense("dp-cp"), "inter")),
    ("expert_dp_intra", lambda layout: layout.instances(layout.experts("dp"), "intra")),
    ("expert_dp_inter", lambda layout: layout.instances(layout.experts("dp"), "inter")),
    # expert tensor-model-pipeline parallel
    ("expert_model_parallel", lambda layout: layout.experts("tp-ep-pp")),
)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout_minutes: int = 10,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    num_distributed_optimizer_instances: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
) -> None:
    """Build the TP/CP/PP/DP groups (and the experts' ETP, EP and expert-DP, and a2a+p2p's
    levels of CP) over the initialized world, in Megatron's rank order `order` (megatron-core's
    argument)."""
    destroy_model_parallel()
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size == 1:
        raise ValueError("an interleaved (virtual) pipeline needs a pipeline of 2+ stages")
    layout = RankLayout(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        order,
        num_distributed_optimizer_instances,
    )
    _GROUPS_BEFORE.clear()
    _GROUPS_BEFORE.update(_process_groups())
    rank, timeout = dist.get_rank(), datetime.timedelta(minutes=timeout_minutes)
    kinds = list(_GROUP_KINDS)
    if hierarchical_context_parallel_sizes:
        kinds += _hierarchical_cp_kinds(hierarchical_context_parallel_sizes[0])
    for kind, members in kinds:
        for ranks in members(layout):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                _GROUPS[kind] = Group(group, len(ranks), ranks.index(rank))
    initialize_p2p_groups(layout.dense("pp"), timeout_minutes)


def _hierarchical_cp_kinds(a2a_size: int) -> list:
    """megatron-core's hierarchical context-parallel groups of two levels: each CP group's
    consecutive runs of `a2a_size` ranks (the all-to-all), and its ranks `a2a_size` apart (the
    ring)."""
    return [
        (
            "cp_a2a",
            lambda layout: [
                r[i : i + a2a_size] for r in layout.dense("cp") for i in range(0, len(r), a2a_size)
            ],
        ),
        (
            "cp_p2p",
            lambda layout: [r[i::a2a_size] for r in layout.dense("cp") for i in range(a2a_size)],
        ),
    ]


def initialize_from_config(parallel) -> tuple[torch.device, ParallelContext]:
    """torch.distributed from torchrun's environment and the groups for the layout of a
    ParallelConfig; returns this rank's device and its parallel context."""
    device = initialize_distributed(
        parallel.distributed_backend, parallel.distributed_timeout_minutes
    )
    return device, initialize_layout(parallel)


def initialize_layout(parallel) -> ParallelContext:
    """The groups for a ParallelConfig over the initialized world; the context."""
    initialize_model_parallel(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        parallel.distributed_timeout_minutes,
        parallel.context_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tensor_parallel_size,
        TP_PP_DP_ORDER if parallel.use_tp_pp_dp_mapping else DEFAULT_ORDER,
        parallel.num_distributed_optimizer_instances,
        parallel.hierarchical_context_parallel_sizes,
    )
    context = parallel_context(
        parallel.sequence_parallel, parallel.comm_type, parallel.tp_comm_overlap
    )
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


def parallel_context(
    sequence_parallel: bool = False, cp_comm_type: str = "p2p", tp_comm_overlap: bool = False
) -> ParallelContext:
    """The groups of the initialized layout (or a world of one when none is), read once."""
    if not is_initialized():
        return ParallelContext(world=Group(None, global_world_size(), global_rank()))
    groups = _GROUPS
    # The dispatcher addresses an expert's ETP ranks as EP rank x ETP + ETP rank.
    ep, expert_tp, expert_tp_ep = groups["ep"], groups["expert_tp"], groups["expert_tp_ep"]
    if expert_tp_ep.rank != ep.rank * expert_tp.size + expert_tp.rank:
        raise RuntimeError("the expert groups are not ordered ETP-fastest")
    embedding = groups.get("embedding")  # only the first and last stage hold one
    # one distributed-optimizer instance: it shards over all the replicas, none across
    instances = {
        "dp_cp_intra": groups.get("dp_cp_intra", groups["dp_cp"]),
        "dp_cp_inter": groups.get("dp_cp_inter", Group()),
        "expert_dp_intra": groups.get("expert_dp_intra", groups["expert_dp"]),
        "expert_dp_inter": groups.get("expert_dp_inter", Group()),
    }
    return ParallelContext(
        **instances,
        **{name: groups[name] for name in ("tp", "pp", "dp", "cp", "dp_cp", "tp_cp")},
        cp_a2a=groups.get("cp_a2a", Group()),
        cp_p2p=groups.get("cp_p2p", Group()),
        ep=ep,
        expert_tp=expert_tp,
        expert_tp_ep=expert_tp_ep,
        expert_dp=groups["expert_dp"],
        expert_model_parallel_group=groups["expert_model_parallel"].group,
        world=Group(dist.group.WORLD, global_world_size(), global_rank()),
        embedding_group=embedding.group if embedding is not None else None,
        model_parallel_group=groups["model_parallel"].group,
        cp_comm_type=cp_comm_type,
        sequence_parallel=sequence_parallel and groups["tp"].size > 1,
        tp_comm_overlap=tp_comm_overlap and sequence_parallel and groups["tp"].size > 1,
    )


def destroy_model_parallel() -> None:
    """Tear the groups down for real: each group keeps a gloo event-loop thread, so a process
    that initializes many layouts (the test workers) would otherwise accumulate hundreds."""
    if not _GROUPS:
        return
    _GROUPS.clear()
    destroy_p2p_groups()
    for group in _process_groups() - _GROUPS_BEFORE:
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def shut_down() -> None:
    """The end of a launched program: the layout's groups, then the default one, as
    torch.distributed asks before exit, then the collection that frees them.

    Destroying a gloo group only forgets it (its `shutdown` stops nothing); its threads are
    joined when the last reference to it goes. That must happen here, while the interpreter
    is whole: a gloo thread still finishing a collective when the interpreter tears down
    needs the GIL it can no longer take, and the rank aborts ("terminate called without an
    active exception", exit -6) after a run that succeeded. So the caller holds no group
    here (no trainer, model or ParallelContext: `startup.run_then_shut_down` calls this once
    the function that held them has returned), and the collection frees the reference
    cycles that still do (bench/gloo_exit.py shows the abort; tests/test_shut_down.py the
    threads gone)."""
    destroy_model_parallel()
    _GROUPS_BEFORE.clear()  # (the default group, kept to tell a layout's groups from it)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def is_initialized() -> bool:
    return dist.is_initialized() and bool(_GROUPS)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def global_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
