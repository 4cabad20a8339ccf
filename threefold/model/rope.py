"""Rotary position embeddings (RoPE) in the rotate-half layout used by megatron-core and
Hugging Face LLaMA: the head dimension's first and second halves form the rotated pairs.
The rotation itself is `threefold.kernels.reference.rotary` (or its fused version).

`--use-rope-scaling` applies Llama 3.1's frequency scaling (Megatron-LM's and Hugging Face's
`llama3` rope type) with Megatron's fixed constants: wavelengths beyond the original context of
8192 / low-frequency factor 1 are slowed by `--rope-scaling-factor`, those below 8192 /
high-frequency factor 4 are kept, and the band between is interpolated smoothly."""

from __future__ import annotations

import math

import torch
from torch import nn

ORIGINAL_CONTEXT = 8192
LOW_FREQ_FACTOR = 1.0
HIGH_FREQ_FACTOR = 4.0


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(
        wavelength > ORIGINAL_CONTEXT / LOW_FREQ_FACTOR, inv_freq / factor, inv_freq
    )
    smooth = (ORIGINAL_CONTEXT / wavelength - LOW_FREQ_FACTOR) / (
        HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR
    )
    interpolated = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelength >= ORIGINAL_CONTEXT / HIGH_FREQ_FACTOR) & (
        wavelength <= ORIGINAL_CONTEXT / LOW_FREQ_FACTOR
    )
    return torch.where(medium, interpolated, slowed)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, scaling_factor: float | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling_factor is not None:
            inv_freq = llama3_scaled(inv_freq, scaling_factor)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape [sequence, 1, 1, head_dim] for positions 0..seq_length-1."""
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos(), emb.sin()
