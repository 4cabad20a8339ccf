"""Rotary position embeddings (RoPE) in the rotate-half layout used by megatron-core and
Hugging Face LLaMA: the head dimension's first and second halves form the rotated pairs.
The rotation itself is `threefold.kernels.reference.rotary` (or its fused version).

`--use-rope-scaling` applies Llama 3.1's frequency scaling (Megatron-LM's and Hugging Face's
`llama3` rope type), by default with Megatron's fixed constants: wavelengths beyond the
original context of 8192 / low-frequency factor 1 are slowed by `--rope-scaling-factor`, those
below 8192 / high-frequency factor 4 are kept, and the band between is interpolated smoothly
(--rope-scaling-low-freq-factor, --rope-scaling-high-freq-factor and
--rope-scaling-original-max-position-embeddings give Hugging Face's other values: Llama 4
Scout's 1 and 1 leave no band).

Multi-latent attention brings its own RoPE over --qk-pos-emb-head-dim (`rotary_embedding`),
by default YaRN (megatron-core's `YarnRotaryEmbedding`): frequencies whose wavelengths fit
the original context many times are kept, those that fit it less than once are slowed by
--rotary-scaling-factor, with a linear ramp between; the tables are scaled by YaRN's mscale
ratio. `--position-embedding-type yarn` stretches other attention's RoPE the same way, with
its own original context and betas (--yarn-*).

`--position-embedding-type longrope` divides each frequency by a factor of its own, the short
or the long ones by --seq-length, and scales the tables (config/longrope.py).

`--rotary-seq-len-interpolation-factor F` divides the positions by F (linear position
interpolation, Hugging Face's `linear` rope type): a model trained on N tokens reads F x N."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.config.mla import (
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
    yarn_mscale,
)
from threefold.kernels.dispatch import KERNELS

ORIGINAL_CONTEXT = 8192
LOW_FREQ_FACTOR = 1.0
HIGH_FREQ_FACTOR = 4.0


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling: Megatron's constants by default; Llama 4 Scout's keeps
    no band between (high = low = 1: --rope-scaling-high-freq-factor)."""

    factor: float
    low_freq_factor: float = LOW_FREQ_FACTOR
    high_freq_factor: float = HIGH_FREQ_FACTOR
    original_context: int = ORIGINAL_CONTEXT


def llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > scaling.original_context / low, inv_freq / factor, inv_freq)
    if high == low:  # no band to interpolate in
        return slowed
    smooth = (scaling.original_context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelength >= scaling.original_context / high) & (
        wavelength <= scaling.original_context / low
    )
    return torch.where(medium, interpolated, slowed)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        base: float,
        scaling: Llama3Scaling | None = None,
        interpolation_factor: float | None = None,
    ) -> None:
        """`scaling`: Llama 3.1's frequency scaling; `interpolation_factor`: positions
        divided by it (--rotary-seq-len-interpolation-factor, as megatron-core's)."""
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None:
            inv_freq = llama3_scaled(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.interpolation_factor = interpolation_factor

    def forward(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables of shape [sequence, 1, 1, head_dim] for positions 0..seq_length-1."""
        positions = torch.arange(seq_length, device=device, dtype=torch.float32)
        if self.interpolation_factor is not None:
            positions *= 1 / self.interpolation_factor
        freqs = torch.outer(positions, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos(), emb.sin()


def _yarn_correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The dimension whose wavelength fits `rotations` times into the original context."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


@dataclass(frozen=True)
class Yarn:
    """YaRN's settings (megatron-core's `YarnRotaryEmbedding`; multi-latent attention's are
    its MLATransformerConfig defaults for the original context, betas and rounding)."""

    factor: float
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_context: int = YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    round_to_int: bool = True


def yarn_frequencies(dim: int, base: float, yarn: Yarn) -> torch.Tensor:
    """YaRN's inverse frequencies, as megatron-core computes them (in fp32)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    kept = 1.0 / (base**exponents)
    slowed = 1.0 / (yarn.factor * base**exponents)
    low = _yarn_correction_dim(yarn.beta_fast, dim, base, yarn.original_context)
    high = _yarn_correction_dim(yarn.beta_slow, dim, base, yarn.original_context)
    if yarn.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    keep = 1.0 - ramp.clamp(0, 1)
    return slowed * (1 - keep) + kept * keep


class ScaledRotaryEmbedding(RotaryEmbedding):
    """RoPE of given inverse frequencies whose tables are multiplied by `table_scale`: YaRN's
    (mscale over mscale_all_dim's ratio) and LongRoPE's (its attention factor)."""

    def __init__(self, inv_freq: torch.Tensor, table_scale: float) -> None:
        nn.Module.__init__(self)
        self.interpolation_factor = None
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.table_scale = table_scale

    def forward(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(seq_length, device)
        return cos * self.table_scale, sin * self.table_scale


def yarn_rotary_embedding(head_dim: int, base: float, yarn: Yarn) -> ScaledRotaryEmbedding:
    table_scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(
        yarn.factor, yarn.mscale_all_dim
    )
    return ScaledRotaryEmbedding(yarn_frequencies(head_dim, base, yarn), table_scale)


def longrope_rotary_embedding(config: ModelConfig) -> ScaledRotaryEmbedding:
    """LongRoPE (config/longrope.py): each frequency divided by its factor, computed in fp32
    as transformers' `longrope` does; the tables scaled by the attention factor."""
    dim = config.rotary_dim
    factors = torch.tensor(config.longrope_factors, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (factors * config.rotary_base**exponents)
    return ScaledRotaryEmbedding(inv_freq, config.longrope_attention_factor)


def rotate_mla(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """megatron-core's MLA RoPE (its indexer's too): the even dimensions, then the odd ones,
    turned as halves."""
    halves = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return KERNELS.rotary(halves, *rotary)


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding | None:
    """The model's RoPE tables: multi-latent attention's own (YaRN or plain, over
    --qk-pos-emb-head-dim, whatever --position-embedding-type says, as megatron-core's MLA),
    else --position-embedding-type rope's or yarn's over the rotated share of each head."""
    stretch = Yarn(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)
    if config.multi_latent_attention:
        dim = config.qk_pos_emb_head_dim
        if not config.mla_yarn:
            return RotaryEmbedding(dim, config.rotary_base)
        return yarn_rotary_embedding(dim, config.rotary_base, stretch)
    if config.position_embedding_type == "yarn":
        given = {
            "original_context": config.yarn_original_max_position_embeddings,
            "beta_fast": config.yarn_beta_fast,
            "beta_slow": config.yarn_beta_slow,
        }
        stretch = replace(
            stretch,
            round_to_int=config.yarn_correction_range_round_to_int,
            **{name: value for name, value in given.items() if value is not None},
        )
        return yarn_rotary_embedding(config.rotary_dim, config.rotary_base, stretch)
    if config.position_embedding_type == "longrope":
        return longrope_rotary_embedding(config)
    if config.position_embedding_type != "rope":
        return None
    scaling = None
    if config.use_rope_scaling:
        scaling = Llama3Scaling(
            config.rope_scaling_factor,
            config.rope_scaling_low_freq_factor,
            config.rope_scaling_high_freq_factor,
            config.rope_scaling_original_max_position_embeddings,
        )
    interpolation = config.rotary_seq_len_interpolation_factor
    return RotaryEmbedding(config.rotary_dim, config.rotary_base, scaling, interpolation)
