"""The distributed optimizer (`--use-distributed-optimizer`, ZeRO-1/2; Megatron-LM's
DistributedOptimizer): each data-parallel rank owns one contiguous shard of every bucket of the
flat gradient/parameter buffers and keeps fp32 masters and Adam moments only for the pieces of
parameters inside it. Gradients are reduce-scattered instead of all-reduced; after the step the
updated parameter shards are all-gathered (with --overlap-param-gather, during the next
forward).

With --use-precision-aware-optimizer the masters are kept by the optimizer itself, beside the
flat parameters they update, and it stores them and the moments in the dtypes asked for
(training/precision_aware.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import TrainingConfig
from threefold.kernels.fp8_gemms import FP8_MAX
from threefold.model.fp8_params import Fp8Parameters
from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.optimizer import AdamWithMasters, Piece


class DistributedOptimizer(AdamWithMasters):
    def __init__(
        self,
        named_parameters: list[tuple[str, nn.Parameter]],
        grad_buffers: list[GradientBuffer],
        config: TrainingConfig,
        parallel: ParallelContext,
        overlap_param_gather: bool = False,
        offload: bool = False,
        experts: bool = False,
        fp8_parameters: Fp8Parameters | None = None,
        matrices: dict | None = None,
        lr_scales: dict | None = None,
    ) -> None:
        """Each rank of a buffer's group owns one shard of every bucket of it: the dense
        buffer's over DP x CP and, in a mixture of experts (`experts`: on any stage, so that
        every rank joins the reduction of their norms), the expert buffer's over expert-DP.
        `fp8_parameters` (--fp8-param-gather): weights whose flat copies are FP8, cast from
        their masters after each step, so their masters are always separate fp32 copies.
        `matrices` (--optimizer muon): those Muon steps, each whole in one rank's shard (the
        buffers' `whole_params_per_shard`)."""
        if any(buffer.param_buffer is None for buffer in grad_buffers):
            raise ValueError(
                "the distributed optimizer needs GradientBuffers with flat_parameters=True"
            )
        dense = grad_buffers[0]
        # The group a buffer reduces over holds the other shards of its optimizer state.
        self.reduction_groups = [dense.dp.group, parallel.model_parallel_group]
        if experts:
            groups = [parallel.expert_dp_intra.group, parallel.expert_model_parallel_group]
            self.expert_reduction_groups = groups
        self.tp_rank, self.expert_tp_rank = parallel.tp.rank, parallel.expert_tp.rank
        self.reduction_device = dense.buffer.device
        self.grad_buffers = grad_buffers
        self._buffer_of = {p: buffer for buffer in grad_buffers for p in buffer.ranges}
        for buffer in grad_buffers:
            buffer.reduce_scatter = True
        self.overlap_param_gather = overlap_param_gather
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        self.fp8_parameters = fp8_parameters
        fp8 = self._fp8_weights = fp8_parameters.states if fp8_parameters is not None else {}
        self.separate_masters = config.bf16 or config.fp16 or offload or bool(fp8)
        # --use-precision-aware-optimizer: the optimizer keeps the masters of the flat
        # parameters' 16-bit pieces itself (FP8 weights' stay fp32 copies; fp32 weights are
        # their own).
        precision_aware = config.precision_aware_steps()
        pieces = []
        for param in self.model_params:
            buffer = self._buffer_of[param]
            start, end = buffer.ranges[param]
            # Buckets hold whole parameters, so a parameter meets one shard at most.
            shard_start, shard_end = buffer.shard_range(buffer.bucket_of(param))
            low, high = max(start, shard_start), min(end, shard_end)
            if low >= high:
                continue
            # (a view of the flat parameters, except for FP8 weights')
            flat = param.detach().view(-1)[low - start : high - start]
            # fp32: the master *is* the parameter shard (a view), so no extra copy is kept.
            separate = self.separate_masters and (param in fp8 or not precision_aware)
            master = self._master(flat, offload) if separate else nn.Parameter(flat.detach())
            if matrices and param in matrices and (low, high) != (start, end):
                raise RuntimeError("Muon's matrices must lie whole in one shard")
            pieces.append(Piece(param, low - start, high - start, master, separate))
        self._build(pieces, config, named_parameters, matrices, lr_scales, precision_aware)
        if fp8:
            fp8_parameters.set_shards(
                [(p.param, p.start, p.end, p.master) for p in self.pieces if p.param in fp8]
            )
            # the first FP8 copies, from the initial weights, which they replace
            self.copy_masters_to_model()
            fp8_parameters.store_in_fp8()

    def _slice(self, piece: Piece, of: str) -> torch.Tensor:
        """The piece's part of its buffer's gradients (`of="buffer"`) or parameters."""
        buffer = self._buffer_of[piece.param]
        start = buffer.ranges[piece.param][0]
        return getattr(buffer, of)[start + piece.start : start + piece.end]

    def _attach_grads(self) -> list[torch.Tensor]:
        if self.precision_aware:  # it reads the buffer's gradients, in the buffer's dtype
            for piece in self.pieces:
                piece.master.decoupled_grad = self._slice(piece, "buffer")
            return [piece.master.decoupled_grad for piece in self.pieces]
        for piece in self.pieces:
            piece.master.grad = self._fp32_grad(self._slice(piece, "buffer"), piece.master)
        return [piece.master.grad for piece in self.pieces]

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        for piece in self.pieces:
            if piece.separate and piece.param not in self._fp8_weights:
                self._slice(piece, "param_buffer").copy_(piece.master)
        if self.fp8_parameters is not None:
            self.fp8_parameters.cast()
        for buffer in self.grad_buffers:
            buffer.start_param_gather()
        if not self.overlap_param_gather:  # else each module waits in its forward pre-hook
            for buffer in self.grad_buffers:
                buffer.finish_param_gather()

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        for piece in self.pieces:
            if piece.separate:
                if piece.param.dtype in FP8_MAX:  # (only in the run's dtype: `in_model_dtype`)
                    raise RuntimeError(
                        "FP8-stored weights read outside Fp8Parameters.in_model_dtype"
                    )
                piece.master.copy_(piece.param.detach().view(-1)[piece.start : piece.end])
            elif self.precision_aware and piece.master.dtype != torch.float32:
                self.optimizer.store(piece.master, "master", piece.master.detach().float())
        if self.fp8_parameters is not None:  # and the FP8 copies from those masters
            self.copy_masters_to_model()

    def _assembled(self, param: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """The other ranks of the buffer's group hold the rest of the parameter's state; each
        element is one rank's, zero bits elsewhere, so a sum of the bit patterns as integers
        is exact (negative zeros and NaNs as stored)."""
        group = self._buffer_of[param].dp
        if group.size > 1:
            dist.all_reduce(flat.view(torch.int32), group=group.group)
        return flat

    @staticmethod
    def _piece_key(name: str, piece: Piece) -> str:
        return f"{name}[{piece.start}:{piece.end}]"
