"""AdamW with fp32 master weights, global-norm clipping and loss-scale handling.

For fp32 models the optimizer updates the parameters themselves. For bf16/fp16 models it keeps
fp32 master copies, steps them with the fp32 `main_grad`s, and copies the result back into the
half-precision parameters (Megatron's Float16OptimizerWithFloat16Params). Weight decay applies
to matrices only: biases and norm weights (1-D parameters) are excluded, as in Megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import TrainingConfig
from threefold.parallel import state


def _counts_towards_norm(param: nn.Parameter) -> bool:
    """Each distinct parameter counts once across the model-parallel group: TP shards on every
    rank, replicated parameters only on TP rank 0, tied embeddings only on the first stage."""
    if getattr(param, "embedding_copy", False):  # the last stage's copy of tied embeddings
        return False
    return getattr(param, "tensor_model_parallel", False) or state.tensor_model_parallel_rank() == 0


class MixedPrecisionOptimizer:
    def __init__(self, named_parameters: list[tuple[str, nn.Parameter]],
                 config: TrainingConfig) -> None:
        self.model_params = [p for _, p in named_parameters if p.requires_grad]
        self.clip_grad = config.clip_grad
        half = config.bf16 or config.fp16
        self.master_params = [
            nn.Parameter(p.detach().float().clone()) if half else p for p in self.model_params]
        decay, no_decay = [], []
        for (_, param), master in zip(
                [(n, p) for n, p in named_parameters if p.requires_grad], self.master_params):
            (no_decay if param.dim() == 1 else decay).append(master)
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        self.half = half

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _gather_main_grads(self) -> list[torch.Tensor]:
        for model_param, master in zip(self.model_params, self.master_params):
            master.grad = model_param.main_grad
        return [m.grad for m in self.master_params]

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        counted = [g for g, p in zip(grads, self.model_params) if _counts_towards_norm(p)]
        device = grads[0].device
        total = (torch.stack([g.float().pow(2).sum() for g in counted]).sum()
                 if counted else torch.zeros((), device=device))
        group = state.model_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return total.sqrt().item()

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        flag = torch.zeros((), device=grads[0].device)
        for grad in grads:
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        group = state.model_parallel_group()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    @torch.no_grad()
    def step(self, loss_scale: float) -> tuple[bool, float | None]:
        """Unscale, check, clip and update. Returns (updated, grad norm); a step whose gradients
        hold inf or nan is skipped (updated False, norm None)."""
        grads = self._gather_main_grads()
        if loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        if self._found_inf(grads):
            return False, None
        norm = self.grad_norm(grads)
        if self.clip_grad > 0 and norm > self.clip_grad:
            torch._foreach_mul_(grads, self.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        if self.half:
            for model_param, master in zip(self.model_params, self.master_params):
                model_param.copy_(master)
        for master in self.master_params:
            master.grad = None
        return True, norm
