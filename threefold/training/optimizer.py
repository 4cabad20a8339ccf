"""AdamW with fp32 master weights, global-norm clipping and loss-scale handling.

`MixedPrecisionOptimizer`: every data-parallel rank keeps the whole optimizer state. For fp32
models it updates the parameters themselves; for bf16/fp16 models it keeps fp32 master copies,
steps them with the fp32 `main_grad`s and copies the result into the half-precision parameters
(Megatron's Float16OptimizerWithFloat16Params).

`DistributedOptimizer` (`--use-distributed-optimizer`, ZeRO-1/2): each data-parallel rank
owns one contiguous shard of the flat gradient/parameter buffers and keeps fp32 masters and
Adam moments only for the pieces of parameters inside it. Gradients are reduce-scattered
instead of all-reduced; after the step the updated parameter shards are all-gathered.

Weight decay applies to matrices only: biases and norm weights (1-D) are excluded, as in
Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import TrainingConfig
from threefold.parallel import state
from threefold.parallel.data_parallel import GradientBuffer


def _counts_towards_norm(param: nn.Parameter) -> bool:
    """Each distinct parameter counts once across the model-parallel group: TP shards on every
    rank, replicated parameters only on TP rank 0, tied embeddings only on the first stage."""
    if getattr(param, "embedding_copy", False):  # the last stage's copy of tied embeddings
        return False
    return getattr(param, "tensor_model_parallel", False) or state.tensor_model_parallel_rank() == 0


def _all_reduce(tensor: torch.Tensor, groups: list) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
    return tensor


@dataclass
class _Piece:
    """The part [start, end) of a flattened model parameter that an fp32 master stands for."""

    param: nn.Parameter
    start: int
    end: int
    master: nn.Parameter


class _AdamWithMasters:
    """What both optimizers share: masters in `pieces`, AdamW over them, and the step."""

    # Groups whose members hold disjoint parts of the gradients, which the norm sums over: the
    # model-parallel group always, the DP group under the distributed optimizer.
    reduction_groups: list

    def _build(self, pieces: list[_Piece], config: TrainingConfig) -> None:
        self.pieces = pieces
        self.clip_grad = config.clip_grad
        self.half = config.bf16 or config.fp16
        groups = [
            {"params": [p.master for p in pieces if p.param.dim() > 1],
             "weight_decay": config.weight_decay},
            {"params": [p.master for p in pieces if p.param.dim() <= 1], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # A rank can own no piece at all (a tiny model over many DP ranks).
        self.optimizer = torch.optim.AdamW(
            groups or [{"params": [nn.Parameter(torch.zeros(1))]}], lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def master_params(self) -> list[nn.Parameter]:
        return [p.master for p in self.pieces]

    def _attach_grads(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        raise NotImplementedError

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global gradient norm over all ranks holding parts of the model; inf or nan when
        any gradient holds inf or nan (uncounted replicas are copies of counted ones), so one
        pass and one reduction also serve as the overflow check."""
        device = self.optimizer.param_groups[0]["params"][0].device
        counted = [g for piece, g in zip(self.pieces, grads) if _counts_towards_norm(piece.param)]
        total = (torch.stack(torch._foreach_norm(counted)).float().pow(2).sum() if counted
                 else torch.zeros((), dtype=torch.float32, device=device))
        return _all_reduce(total, self.reduction_groups).sqrt().item()

    @torch.no_grad()
    def step(self, loss_scale: float) -> tuple[bool, float | None]:
        """Unscale, check, clip and update. Returns (updated, grad norm); a step whose gradients
        hold inf or nan is skipped (updated False, norm None)."""
        grads = self._attach_grads()
        if loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        norm = self.grad_norm(grads)
        if not math.isfinite(norm):
            return False, None
        if self.clip_grad > 0 and norm > self.clip_grad and grads:
            torch._foreach_mul_(grads, self.clip_grad / (norm + 1e-6))
        if self.pieces:
            self.optimizer.step()
        self.copy_masters_to_model()
        for piece in self.pieces:
            piece.master.grad = None
        return True, norm

    def state_tensors(self, names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
        """The optimizer's tensors for a checkpoint, keyed by parameter name (and piece)."""
        tensors = {}
        for piece in self.pieces:
            key = self._piece_key(names[piece.param], piece)
            adam = self.optimizer.state[piece.master]
            if not adam:  # no step taken yet: give load something of the right shape to fill
                adam.update(step=torch.zeros((), dtype=torch.float32),
                            exp_avg=torch.zeros_like(piece.master),
                            exp_avg_sq=torch.zeros_like(piece.master))
            for field in ("exp_avg", "exp_avg_sq", "step"):
                tensors[f"optimizer.{field}.{key}"] = adam[field]
            if self.half:
                tensors[f"optimizer.master.{key}"] = piece.master.data
        return tensors

    @staticmethod
    def _piece_key(name: str, piece: _Piece) -> str:
        return name


class MixedPrecisionOptimizer(_AdamWithMasters):
    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]],
                 config: TrainingConfig) -> None:
        self.reduction_groups = [state.model_parallel_group()]
        half = config.bf16 or config.fp16
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        self._build([_Piece(p, 0, p.numel(),
                            nn.Parameter(p.detach().float().clone()) if half else p)
                     for p in self.model_params], config)

    def _attach_grads(self) -> list[torch.Tensor]:
        for piece in self.pieces:
            piece.master.grad = piece.param.main_grad
        return [piece.master.grad for piece in self.pieces]

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        if self.half:
            for piece in self.pieces:
                piece.param.copy_(piece.master)

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        if self.half:
            for piece in self.pieces:
                piece.master.copy_(piece.param)


class DistributedOptimizer(_AdamWithMasters):
    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]],
                 grad_buffer: GradientBuffer, config: TrainingConfig) -> None:
        if grad_buffer.param_buffer is None:
            raise ValueError("the distributed optimizer needs a GradientBuffer with "
                             "flat_parameters=True")
        self.reduction_groups = [state.data_parallel_group(), state.model_parallel_group()]
        self.grad_buffer = grad_buffer
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        half = config.bf16 or config.fp16
        shard_start, shard_end = grad_buffer.shard_range()
        pieces = []
        for param in self.model_params:
            start, end = grad_buffer.ranges[param]
            low, high = max(start, shard_start), min(end, shard_end)
            if low >= high:
                continue
            flat = grad_buffer.param_buffer[low:high].detach()
            # fp32: the master *is* the parameter shard (a view), so no extra copy is kept.
            master = nn.Parameter(flat.float().clone() if half else flat)
            pieces.append(_Piece(param, low - start, high - start, master))
        self._build(pieces, config)

    def _buffer_slice(self, piece: _Piece) -> slice:
        start = self.grad_buffer.ranges[piece.param][0]
        return slice(start + piece.start, start + piece.end)

    def _attach_grads(self) -> list[torch.Tensor]:
        for piece in self.pieces:
            piece.master.grad = self.grad_buffer.buffer[self._buffer_slice(piece)]
        return [piece.master.grad for piece in self.pieces]

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        if self.half:
            for piece in self.pieces:
                self.grad_buffer.param_buffer[self._buffer_slice(piece)].copy_(piece.master)
        self.grad_buffer.all_gather_parameters()

    @torch.no_grad()
    def copy_model_to_masters(self) -> None:
        if self.half:
            for piece in self.pieces:
                piece.master.copy_(self.grad_buffer.param_buffer[self._buffer_slice(piece)])

    @staticmethod
    def _piece_key(name: str, piece: _Piece) -> str:
        return f"{name}[{piece.start}:{piece.end}]"
