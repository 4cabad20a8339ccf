"""PyTorch's own data parallelism as fallbacks for small models (`--distributed-strategy`).

- `ddp`: `torch.nn.parallel.DistributedDataParallel`, every rank holding the whole model and
  optimizer (fp32 parameters; `--bf16`/`--fp16` compute under autocast).
- `fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on every transformer layer and on the
  model, the ZeRO-3 equivalent: parameters, gradients and Adam moments are sharded over the
  data-parallel ranks and each layer's parameters are all-gathered just before it runs. The
  sharded fp32 parameters are the masters; `--bf16`/`--fp16` all-gather them in that dtype and
  reduce-scatter gradients in fp32 (a `MixedPrecisionPolicy`).

`--grad-reduce-in-bf16` reduces gradients in bf16 instead: DDP through its bf16 compression
hook, FSDP2 through the policy's `reduce_dtype`.

Both compose with tensor parallelism (2D, as torchtitan and Megatron-LM's --use-torch-fsdp2):
threefold's TP layers hold their shards and run their own collectives, and DDP/FSDP2 work over
the data-parallel group only, each TP rank's shard replicated (DDP) or sharded (FSDP2) across
its DP peers. Sequence-parallel norm weights are then summed over TP after the DP reduction,
as in the megatron strategy.
Gradient synchronization is skipped on all but the last micro-batch of a step
(`no_sync_context`), so accumulation costs one reduction.

Mixture-of-experts under FSDP2 (as torchtitan's FSDP with expert parallelism): each layer's
experts are a unit of their own, sharded over the expert-data-parallel group (the ranks that
hold the same experts), the rest of the layer over DP. Their gradients are summed over that
group and divided by DP x CP, as the megatron strategy scales them (the experts of one rank
also serve the tokens of its EP peers). DDP would average every gradient over DP, experts
held by other ranks included, and is refused with experts (config/parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.sharding import PARAMETER_ATTRIBUTES, is_expert


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    dp: Group,
    bucket_elements: int,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    # --ddp-bucket-size counts elements; PyTorch DDP's buckets are in MiB (of fp32 gradients).
    wrapped = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp.group,
        bucket_cap_mb=bucket_elements * 4 / 2**20,
        # The gradients live in DDP's buckets: no second copy of them.
        gradient_as_bucket_view=True,
    )
    if reduce_dtype == torch.bfloat16:
        wrapped.register_comm_hook(dp.group, _all_reduce_in_bf16)
    return wrapped


def _all_reduce_in_bf16(group, bucket):
    """DDP communication hook: average a bucket in bf16 and write it back to the fp32 bucket.
    (PyTorch's own bf16 hook refuses anything but NCCL/XCCL; this one runs on gloo too.)
    Unannotated: DDP checks the annotations against the real classes, and this module's
    `from __future__ import annotations` would turn them into strings."""
    gradients = bucket.buffer()
    compressed = gradients.to(torch.bfloat16).div_(dist.get_world_size(group))
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def write_back(future):
        return gradients.copy_(future.value()[0])

    return work.get_future().then(write_back)


@torch.no_grad()
def average_grads(params: list[nn.Parameter], dp: Group, reduce_dtype: torch.dtype) -> None:
    """The mean over `dp` of the parameters' gradients, in one flat all-reduce (in
    `reduce_dtype`): what DDP's buckets do during backward, for a schedule that kept DDP from
    reducing (pipeline stages, whose micro-batches' forwards overlap)."""
    grads = [p.grad for p in params if p.grad is not None]
    if dp.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]).to(reduce_dtype).div_(dp.size)
    dp.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def wrap_fsdp(
    model: nn.Module,
    device: torch.device,
    dp: Group,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    expert_dp: Group | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 on every transformer layer and on the model; `expert_dp` (a model with experts):
    the group each layer's experts shard over (module doc). `reshard_after_forward` False
    (--torch-fsdp2-no-reshard-after-forward): each layer keeps its gathered parameters until
    its backward (ZeRO-2)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 replaces the parameters with new DTensor ones: their attributes are carried over.
    saved = {
        name: {a: getattr(p, a) for a in PARAMETER_ATTRIBUTES if hasattr(p, a)}
        for name, p in model.named_parameters()
    }
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=reduce_dtype,
    )
    experts = expert_blocks(model)
    if experts:
        expert_mesh = _mesh(expert_dp, device)
        for block in experts:
            fully_shard(
                block,
                mesh=expert_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
            if expert_dp.size > 1:
                # summed over expert DP, then / (DP x CP); a plain sum and a division, which
                # any backend runs (a factor other than the group's size is NCCL's PreMulSum
                # otherwise). Over one rank FSDP2 (torch 2.13) divides by a factor twice:
                # `divide_expert_grads` divides there instead.
                block.set_gradient_divide_factor(float(dp.size))
                block.set_force_sum_reduction_for_comms(True)
    mesh = _mesh(dp, device)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # embedding, final norm, output layer
    model.reshards_after_forward = reshard_after_forward  # (what the schedule puts back)
    for name, param in model.named_parameters():
        for attribute, value in saved[name].items():
            setattr(param, attribute, value)
    return model


@torch.no_grad()
def divide_expert_grads(params: list[nn.Parameter], dp: Group, expert_dp: Group) -> None:
    """Where each expert is on one rank of its stage (expert DP of 1: EP spans DP x CP), FSDP2
    leaves its gradient summed over nothing: / (DP x CP) here, as over a larger expert DP."""
    if expert_dp.size == 1 and dp.size > 1:
        for param in params:
            if is_expert(param) and param.grad is not None:
                local(param.grad).div_(dp.size)


def _mesh(group: Group, device: torch.device) -> DeviceMesh:
    # A group over the whole world is the default group (never torn down and re-created as
    # megatron-core's are when a layout changes).
    process_group = dist.group.WORLD if group.size == dist.get_world_size() else group.group
    # DTensor caches sharding plans by mesh, and meshes over the same ranks compare equal
    # unless their dimensions are named apart: named after the group, a mesh over groups
    # re-created for another layout (the test workers do that) never reuses a stale plan.
    name = f"dp{process_group.group_name}"
    return DeviceMesh.from_group(process_group, device.type, mesh_dim_names=(name,))


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost modules that hold expert weights only: each MoE layer's experts (their
    LoRA adapters are expert weights too). An expert weight outside them would be averaged
    over DP with other experts: refused."""
    blocks: list[str] = []
    found = []
    for name, module in model.named_modules():
        params = list(module.parameters())
        inside = any(name.startswith(block + ".") for block in blocks)
        if params and not inside and all(is_expert(p) for p in params):
            blocks.append(name)
            found.append(module)
    covered = {id(p) for block in found for p in block.parameters()}
    stray = [n for n, p in model.named_parameters() if is_expert(p) and id(p) not in covered]
    if stray:
        raise ValueError(f"{stray[0]}: an expert weight beside other weights in one module")
    return found


def reshard(model: nn.Module) -> None:
    """After a forward without backward (evaluation) FSDP2 leaves the root's parameters
    unsharded and registered in place of the sharded ones: put the sharded ones back."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def placed_as(like: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole`, the same whole tensor on every rank, placed as `like` is: where `like` is
    FSDP2's shard (a DTensor), a DTensor holding this rank's part of it (a local slice, no
    message); else `whole` itself."""
    if not isinstance(like, DTensor):
        return whole
    whole = whole.to(like.to_local().device)
    replicated = DTensor.from_local(whole, like.device_mesh, [Replicate()], run_check=False)
    return replicated.redistribute(placements=like.placements)


@torch.no_grad()
def add_replicated(param: torch.Tensor, update: torch.Tensor) -> None:
    """`param += update`, where `update` is the same whole tensor on every rank and `param`
    may be FSDP2's shard of it (a DTensor between steps): the shard adds its own part."""
    param.add_(placed_as(param, update))


@torch.no_grad()
def copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """`param` set to `whole` (the same whole tensor on every rank; shaped as `param`), of
    which FSDP2's shard keeps its own part: how a checkpoint read whole fills either."""
    param.copy_(placed_as(param, whole.view(param.shape)))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered from its shards, else the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def no_sync_context(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context that suspends gradient reduction, for the non-final micro-batches."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync

    @contextlib.contextmanager
    def fsdp_no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return fsdp_no_sync


@contextlib.contextmanager
def gathered_through_the_schedule(model: nn.Module) -> Iterator[None]:
    """FSDP2 keeps every parameter it gathers until the context ends, then reshards them all
    (--overlap-moe-expert-parallel-comm: a micro-batch's forward runs beside another's
    backward, and FSDP2 would reshard a layer after one pass, or everything at the end of a
    backward, while the other pass still reads it; Megatron-LM turns off Megatron-FSDP's
    per-layer resharding in this schedule too). The gradients and optimizer state stay
    sharded; the parameters are whole for the step's forward and backward passes."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        # as wrapped again: every module as it was wrapped, and not the root
        model.set_reshard_after_forward(getattr(model, "reshards_after_forward", True))
        model.set_reshard_after_forward(False, recurse=False)
        model.set_reshard_after_backward(True)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
