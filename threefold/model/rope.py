"""Rotary position embeddings (RoPE) in the rotate-half layout used by megatron-core and
Hugging Face LLaMA: the head dimension's first and second halves form the rotated pairs.
The rotation itself is `threefold.kernels.reference.rotary` (or its fused version)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape [sequence, 1, 1, head_dim] for positions 0..seq_length-1."""
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos(), emb.sin()

