"""Adapters for NVIDIA's optional kernel libraries, used only when they import.

- Transformer Engine: `DotProductAttention` (cuDNN / flash fused attention) for core attention.
  It has no parameters, so parameter names and checkpoints stay megatron-core's local-spec
  ones. TE's fused norm+linear modules are not used: they own their weights under other names.
- apex: `fused_layer_norm_affine` / `fused_rms_norm_affine` and `FusedAdam`.

Both are CUDA-only builds; neither installs on a CPU machine, where tests check the wiring
against stand-in modules (tests/kernels/test_dispatch.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def try_import(name: str) -> ModuleType | None:
    """The module, or None when it is not installed or fails to load (a CUDA build without a
    GPU raises at import)."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


class TEAttention:
    """Core attention through `transformer_engine.pytorch.DotProductAttention`, in Megatron's
    [sequence, batch, heads, head_dim] layout. One module per shape and dropout, built lazily
    (dropout is a constructor argument in TE; evaluation asks for dropout 0)."""

    def __init__(self, te_pytorch: ModuleType) -> None:
        self.te = te_pytorch
        self.modules: dict[tuple, torch.nn.Module] = {}

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float,
    ) -> torch.Tensor:
        heads, groups, head_dim = query.shape[2], key.shape[2], query.shape[3]
        signature = (heads, groups, head_dim, dropout, attention_mask is None)
        if signature not in self.modules:
            self.modules[signature] = self.te.DotProductAttention(
                num_attention_heads=heads,
                kv_channels=head_dim,
                num_gqa_groups=groups,
                attention_dropout=dropout,
                qkv_format="sbhd",
                attn_mask_type="causal" if attention_mask is None else "arbitrary",
            )
        if attention_mask is None:
            return self.modules[signature](query, key, value)
        # TE's arbitrary masks mark the positions to *exclude*; ours mark those to keep.
        return self.modules[signature](query, key, value, attention_mask=~attention_mask)


class ApexNorms:
    def __init__(self, apex_norm: ModuleType) -> None:
        self.apex = apex_norm

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        if bias is None:  # (--no-layernorm-bias: apex's affine kernel takes a bias)
            bias = torch.zeros_like(weight)
        return self.apex.fused_layer_norm_affine(x, weight, bias, (x.shape[-1],), eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.apex.fused_rms_norm_affine(x, weight, (x.shape[-1],), eps)
