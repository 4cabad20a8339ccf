"""Data-parallel gradients: a contiguous fp32 gradient buffer and its reduction.

As in Megatron's DistributedDataParallel, every parameter's gradient accumulates into
`param.main_grad`, a view into one flat fp32 buffer, over all micro-batches of a global batch.
`finalize_model_grads` then makes the gradients complete and equal everywhere, once per step:
1. the buffer is averaged over the data-parallel group (PyTorch DDP semantics: the mean of the
   replicas' gradients), in buckets so no single message is huge, and with
   --overlap-grad-reduce each bucket as soon as backward has finished it; under the
   distributed optimizer it is reduce-scattered instead, each DP rank keeping its shard;
2. sequence-parallel replicated parameters (norms, row-parallel biases) saw only their rank's
   slice of the sequence: their gradients are summed over the TP group;
3. tied embeddings split over the first and last pipeline stage: summed over both.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from threefold.parallel.collectives import all_gather_single, reduce_scatter_single
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert
from threefold.parallel.tensor_parallel.weight_grad import mark_main_grad_added


class GradientBuffer:
    """`flat_parameters=True` also moves the parameters into one flat buffer of the same layout
    (the distributed optimizer all-gathers it), and `pad_to_multiple` pads each bucket so it
    splits into equal data-parallel shards: as in Megatron, a distributed-optimizer rank owns
    one contiguous shard *of every bucket*, so each bucket can be reduce-scattered and
    all-gathered on its own.

    Buckets are runs of whole parameters of at least `bucket_size` elements (Megatron's
    --ddp-bucket-size). With `overlap_grad_reduce`, a parameter's gradient is final once its
    hook has fired for every micro-batch of the step; when all of a bucket's gradients are
    final its reduction is launched asynchronously, overlapping the rest of the backward pass.

    `grad_dtype` is fp32 for fp32 models and with --accumulate-allreduce-grads-in-fp32;
    otherwise the parameters' dtype, as Megatron does.

    Gradients are averaged over the replicas of `dp`, the group it is given: the data-parallel
    group, or any other group of replicas (DP x CP). `gradient_scaling_factor` replaces the
    1 / replicas for a group that is not all the replicas (Megatron's name): expert gradients
    are summed over expert-DP and scaled by 1 / (DP x CP), since the experts of one rank also
    receive tokens from the other ranks of their EP group.

    `average_in_collective` (--ddp-average-in-collective, Megatron-LM's): the reduction
    averages, as NCCL's AVG does for floating point (each rank's values multiplied by 1 / group
    size as they enter the sum, no separate kernel); a scaling factor other than the mean is
    applied before it, as that factor x group size. Backends without AVG (gloo) get the same
    arithmetic from a multiplication and a sum.

    `param_dtype`, when the flat parameters are in another dtype than the parameters (FP8
    weights, --fp8-param-gather): the flat buffer holds their compute copies, which the
    optimizer writes (and which model/fp8_params.py makes the parameters' storage).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        dp: Group,
        bucket_size: int = 40_000_000,
        pad_to_multiple: int = 1,
        flat_parameters: bool = False,
        overlap_grad_reduce: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        needs_full_gradient=None,
        gradient_scaling_factor: float | None = None,
        param_dtype: torch.dtype | None = None,
        average_in_collective: bool = False,
        inter: Group | None = None,
        whole_params_per_shard: bool = False,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dp = dp
        self.scaling_factor = (
            1.0 / dp.size if gradient_scaling_factor is None else gradient_scaling_factor
        )
        self.average_in_collective = average_in_collective and dp.size > 1
        # --num-distributed-optimizer-instances: `dp` is one instance's ranks; the other
        # instances' copies of each shard are summed over `inter` after the reduce-scatter
        self.inter = inter if inter is not None and inter.size > 1 else None
        device = self.params[0].device
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[tuple[int, int]] = []  # [start, end) of each bucket in the buffer
        self._bucket_of: dict[nn.Parameter, int] = {}
        # Buckets always all-reduced, even under the distributed optimizer: they hold the
        # parameters whose gradients are then summed with a copy laid out differently in
        # another rank's buffer (tied embeddings across pipeline stages), which needs every
        # element of the gradient reduced, not only this rank's shard.
        self.full_buckets: set[int] = set()
        special, ordinary = [], []
        for param in self.params:
            (special if needs_full_gradient and needs_full_gradient(param) else ordinary).append(
                param
            )
        offset = 0
        # Reverse order, as Megatron lays the buffer out: backward produces the last layers'
        # gradients first, so their buckets complete first.
        for group in (ordinary, special):
            bucket_start = offset
            for param in reversed(group):
                self.ranges[param] = (offset, offset + param.numel())
                self._bucket_of[param] = len(self.buckets)
                offset += param.numel()
                if offset - bucket_start >= bucket_size:
                    offset = bucket_start = self._close_bucket(
                        bucket_start, offset, pad_to_multiple, group is special
                    )
            if bucket_start < offset:
                offset = self._close_bucket(bucket_start, offset, pad_to_multiple, group is special)
        if not self.buckets:
            offset = self._close_bucket(0, 0, pad_to_multiple, False)
        if whole_params_per_shard:
            offset = self._whole_params_per_shard()
        self.buffer = torch.zeros(offset, dtype=grad_dtype, device=device)
        moves_params = param_dtype is None
        self.param_buffer = (
            torch.zeros(offset, dtype=param_dtype or self.params[0].dtype, device=device)
            if flat_parameters
            else None
        )
        # The hook lives in the parameter's C++ side, out of the garbage collector's sight: a
        # strong reference to this buffer there would make buffer -> parameter -> hook ->
        # buffer a cycle nothing can free, keeping the model and its process groups alive.
        accumulate = _weak_hook(self._accumulate)
        # Whether each main_grad still holds the step's zeros, as a tensor a compiled graph
        # reads when it runs (`param.main_grad_is_zero` is the same for eager code).
        self.zeroed = torch.ones(len(self.ranges), dtype=torch.bool)
        for index, (param, (start, end)) in enumerate(self.ranges.items()):
            param.main_grad = self.buffer[start:end].view_as(param)
            param.main_grad_zeroed = self.zeroed[index]
            if self.param_buffer is not None and moves_params:
                self.param_buffer[start:end].copy_(param.data.view(-1))
                param.data = self.param_buffer[start:end].view_as(param)
            param.register_post_accumulate_grad_hook(accumulate)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.reduce_scatter = False  # set by the distributed optimizer
        # --check-for-nan-in-loss-and-grad, --check-for-large-grads: look at each bucket before
        # its reduction starts
        self.check_finite = self.check_norms = False
        self._gather_handles: dict[int, object] = {}
        self.start_step(num_microbatches=1)

    def _close_bucket(self, start: int, end: int, pad_to_multiple: int, full: bool) -> int:
        end = max(-(-end // pad_to_multiple) * pad_to_multiple, start + pad_to_multiple)
        if full:
            self.full_buckets.add(len(self.buckets))
        self.buckets.append((start, end))
        return end

    def _whole_params_per_shard(self) -> int:
        """Lay each bucket out again so that every DP rank's shard holds whole parameters (Muon
        under the distributed optimizer steps whole matrices, as Megatron-LM's layer-wise
        distributed optimizer): the bucket's parameters, in order, go to the rank where they
        start in an even split, each rank's run at the start of its shard, and every shard is
        as long as the longest run. Returns the buffer's length."""
        members: list[list[nn.Parameter]] = [[] for _ in self.buckets]
        for param, bucket in self._bucket_of.items():  # in layout order
            members[bucket].append(param)
        ranks, offset = self.dp.size, 0
        for bucket, params in enumerate(members):
            total = sum(p.numel() for p in params)
            runs: list[list[nn.Parameter]] = [[] for _ in range(ranks)]
            start = 0
            for param in params:
                runs[start * ranks // total].append(param)
                start += param.numel()
            shard = max([1] + [sum(p.numel() for p in run) for run in runs])
            for rank, run in enumerate(runs):
                position = offset + rank * shard
                for param in run:
                    self.ranges[param] = (position, position + param.numel())
                    position += param.numel()
            self.buckets[bucket] = (offset, offset + shard * ranks)
            offset += shard * ranks
        return offset

    def start_step(self, num_microbatches: int) -> None:
        """Zero the gradients and arm the per-bucket countdown for a step."""
        self.buffer.zero_()
        for param in self.params:  # the first gradient may be written, not added (weight_grad)
            param.main_grad_is_zero = True
        self.zeroed.fill_(True)
        self._expected_calls = num_microbatches
        self._calls = dict.fromkeys(self.params, 0)
        self._pending = [0] * len(self.buckets)
        for param in self.params:
            self._pending[self._bucket_of[param]] += 1
        self._handles: dict[int, tuple[object, torch.Tensor | None]] = {}
        self._nonfinite: list[torch.Tensor] = []
        self._norms: dict[int, torch.Tensor] = {}

    def _accumulate(self, param: torch.Tensor) -> None:
        added = getattr(param, "grad_added_to_main_grad", False)  # --gradient-accumulation-fusion
        if param.grad is None and not added:
            # none came (--delay-wgrad-compute: it comes through autograd again, deferred)
            return
        if added:
            param.grad_added_to_main_grad = False
        else:
            param.main_grad.add_(param.grad)
            mark_main_grad_added(param)
        param.grad = None
        if not self.overlap_grad_reduce:
            return
        self._calls[param] += 1
        if self._calls[param] == self._expected_calls:
            bucket = self._bucket_of[param]
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                self._look_at(bucket)  # this rank's own values, before the reduction
                self._launch(bucket)

    def _look_at(self, bucket: int) -> None:
        start, end = self.buckets[bucket]
        if self.check_finite:
            self._nonfinite.append(~torch.isfinite(self.buffer[start:end]).all())
        if self.check_norms:
            self._norms[bucket] = self.buffer[start:end].norm(p=2)

    def bucket_of(self, param: nn.Parameter) -> int:
        return self._bucket_of[param]

    # -- gradients ----------------------------------------------------------------------------
    def shard_range(self, bucket: int) -> tuple[int, int]:
        """This DP rank's slice of one bucket under the distributed optimizer."""
        start, end = self.buckets[bucket]
        size = (end - start) // self.dp.size
        start += self.dp.rank * size
        return start, start + size

    def _launch(self, bucket: int) -> None:
        """Start the bucket's mean over DP replicas: an all-reduce, or under the distributed
        optimizer a reduce-scatter after which only this rank's shard is complete."""
        world = self.dp.size
        if bucket in self._handles or (world == 1 and self.scaling_factor == 1.0):
            return
        start, end = self.buckets[bucket]
        op = dist.ReduceOp.SUM
        if self.average_in_collective:
            op = self._average(self.buffer[start:end], self.scaling_factor * world)
        elif self.scaling_factor == 1.0 / world:
            self.buffer[start:end].div_(world)  # the mean, rounded as a division
        else:
            self.buffer[start:end].mul_(self.scaling_factor)
        if world == 1:
            self._handles[bucket] = (None, None)  # scaled: not again in finish_grad_sync
            return
        group = self.dp.group
        if self.reduce_scatter and bucket not in self.full_buckets:
            shard_start, shard_end = self.shard_range(bucket)
            shard = torch.empty(
                shard_end - shard_start, dtype=self.buffer.dtype, device=self.buffer.device
            )
            handle = reduce_scatter_single(
                shard, self.buffer[start:end], op=op, group=group, async_op=True
            )
            self._handles[bucket] = (handle, shard)
        else:
            handle = dist.all_reduce(self.buffer[start:end], op=op, group=group, async_op=True)
            self._handles[bucket] = (handle, None)

    def _average(self, values: torch.Tensor, factor: float) -> dist.ReduceOp:
        """Scale `values` for an averaging reduction over the group (and by `factor` first,
        when that is not 1); returns the reduction's op."""
        if factor != 1.0:
            values.mul_(factor)
        if dist.get_backend(self.dp.group) == "nccl":
            return dist.ReduceOp.AVG  # NCCL's PreMulSum: x 1/n on the way into the sum
        values.mul_(1.0 / self.dp.size)
        return dist.ReduceOp.SUM

    def local_grads_finite(self) -> torch.Tensor:
        """Whether this rank's own gradients are all finite (a device bool): the buckets whose
        reduction --overlap-grad-reduce already started were looked at when it started (their
        storage is being written by it now), the others are looked at here."""
        launched = [self.buckets[b] for b in self._handles]
        flags = list(self._nonfinite) + [
            ~torch.isfinite(self.buffer[start:end]).all()
            for start, end in self.buckets
            if (start, end) not in launched
        ]
        return ~torch.stack(flags).any() if flags else torch.ones((), dtype=torch.bool)

    def local_bucket_norms(self) -> list[torch.Tensor]:
        """Each bucket's L2 norm of this rank's own gradients before the reduction (Megatron-LM's
        `check_grads`): those --overlap-grad-reduce launched were taken as they launched."""
        return [
            self._norms[bucket] if bucket in self._norms else self.buffer[start:end].norm(p=2)
            for bucket, (start, end) in enumerate(self.buckets)
        ]

    def finish_grad_sync(self) -> None:
        """Wait for the buckets launched during backward (overlap), and reduce the others."""
        for bucket in range(len(self.buckets)):
            self._launch(bucket)
        for bucket, (handle, shard) in self._handles.items():
            if handle is not None:
                handle.wait()
            elif self.inter is None:
                continue
            if self.inter is not None:
                start, end = self.buckets[bucket]
                dist.all_reduce(
                    self.buffer[start:end] if shard is None else shard, group=self.inter.group
                )
            if shard is not None:
                start, end = self.shard_range(bucket)
                self.buffer[start:end].copy_(shard)
        self._handles = {}

    # -- parameters (distributed optimizer) ---------------------------------------------------
    @torch.no_grad()
    def start_param_gather(self) -> None:
        """Every DP rank updated its shard of each bucket: share them, asynchronously."""
        if self.dp.size == 1:
            return
        # As bytes: FP8 copies (--fp8-param-gather) travel as one byte per element, and not
        # every backend has FP8 types.
        flat = self.param_buffer
        if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            flat = flat.view(torch.uint8)
        for bucket, (start, end) in enumerate(self.buckets):
            shard_start, shard_end = self.shard_range(bucket)
            local = flat[shard_start:shard_end].clone()
            self._gather_handles[bucket] = all_gather_single(
                flat[start:end], local, group=self.dp.group, async_op=True
            )

    def finish_param_gather(self, params=None) -> None:
        """Wait until the buckets holding `params` (all buckets by default) are gathered."""
        if not self._gather_handles:  # the common case in a forward pre-hook: nothing pending
            return
        buckets = (
            list(self._gather_handles)
            if params is None
            else {self._bucket_of[p] for p in params if p in self._bucket_of}
        )
        for bucket in buckets:
            handle = self._gather_handles.pop(bucket, None)
            if handle is not None:
                handle.wait()

    def wait_for_params_before_forward(self, modules: list[nn.Module]) -> None:
        """--overlap-param-gather: a module's forward first waits for the buckets of its own
        parameters and its children's, so the all-gather of later layers overlaps the forward
        of earlier ones. Its children's too: a module may read a child's weight without
        calling the child (SwiGLU's fc1 through `forward_blocks`, the learned position table
        sliced by the embedding), and the child's own hook then never fires; and all of its
        descendants' where it says it reads them (`reads_descendant_weights`: the experts'
        grouped GEMM, a mixture layer that calls its shared expert's halves)."""
        for chunk in modules:
            for module in chunk.modules():
                if getattr(module, "reads_descendant_weights", False):
                    owners = list(module.modules())
                else:
                    owners = [module, *module.children()]
                read = [
                    p
                    for owner in owners
                    for p in owner.parameters(recurse=False)
                    if p.requires_grad
                ]
                if read:
                    module.register_forward_pre_hook(
                        lambda _module, _args, read=read: self.finish_param_gather(read)
                    )


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    target = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = target()
        if bound is not None:
            bound(param)

    return hook


def all_reduce_sequence_parallel_grads(
    params: list[nn.Parameter], parallel: ParallelContext, grad_of: Callable = lambda p: p.main_grad
) -> None:
    """Sum over TP the gradients of weights every TP rank applies to its own part of the
    sequence (norms under sequence parallelism), and over expert TP those of an expert's
    (the replicated factor of its LoRA adapter). `grad_of`: where a parameter's gradient is
    (its main_grad; this rank's shard of `.grad` under PyTorch DDP/FSDP2)."""
    marked = [p for p in params if getattr(p, "sequence_parallel", False)]
    _sum_over(parallel.tp, [grad_of(p) for p in marked if not is_expert(p)])
    _sum_over(parallel.expert_tp, [grad_of(p) for p in marked if is_expert(p)])


def _sum_over(group: Group, grads: list[torch.Tensor]) -> None:
    if not grads or group.size == 1:
        return
    flat = group.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def all_reduce_embedding_grads(
    params: list[nn.Parameter], parallel: ParallelContext, grad_of: Callable = lambda p: p.main_grad
) -> None:
    """Tied embeddings under pipeline parallelism: the first stage's word embeddings and the
    last stage's output layer are two copies of one weight. Summing their gradients over
    megatron-core's embedding group (first and last stage) keeps the copies identical.
    `grad_of` as in all_reduce_sequence_parallel_grads (FSDP2: both stages shard the copy
    alike over equal DP groups, so the local shards line up)."""
    if parallel.pp.size == 1:
        return
    for param in params:
        if getattr(param, "shared_embedding", False):
            dist.all_reduce(grad_of(param), group=parallel.embedding_group)


def finalize_model_grads(
    grad_buffer: GradientBuffer, parallel: ParallelContext, others: tuple = ()
) -> None:
    """`others`: the further buffers (the FP8 weights', the experts'), each reduced over its
    own group; their weights every TP rank holds whole (MLA's FP8 down projections under SP)
    are summed over TP in the same message as the model buffer's. None is a tied embedding."""
    # The DP reduction comes first: with --overlap-grad-reduce it is already in flight on the
    # buffer, and the TP and embedding sums below commute with the DP mean.
    for buffer in (*others, grad_buffer):
        buffer.finish_grad_sync()
    params = [param for buffer in (grad_buffer, *others) for param in buffer.params]
    all_reduce_sequence_parallel_grads(params, parallel)
    all_reduce_embedding_grads(grad_buffer.params, parallel)
