"""Which parameters weight decay applies to, as megatron-core decides it: shared by the
optimizer's parameter groups (threefold/training/optimizer.py) and the groups an export names
for Megatron-LM's optimizer (threefold/checkpoint/megatron/optimizer.py), so here, below both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from threefold.config.training import TrainingConfig


def decays(name: str, param: nn.Parameter, config: TrainingConfig) -> bool:
    """Whether weight decay applies: to matrices, and with --apply-wd-to-qk-layernorm to the
    query and key norms (megatron-core's name test: `q_layernorm.` or `k_layernorm.`)."""
    qk_norm = "q_layernorm." in name or "k_layernorm." in name
    return param.dim() > 1 or (config.apply_wd_to_qk_layernorm and qk_norm)
