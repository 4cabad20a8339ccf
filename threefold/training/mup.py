"""muP's optimizer scaling (config/mup.py), megatron-core's get_mup_config_overrides for Adam:
the hidden matrix-like parameters step at lr / m with eps / m, m the width multiplier; the
vector-like ones (embeddings, the output layer, norms, biases) at the base values. Matrices
Muon steps are left to it (its own scale: --muon-scale-mode)."""

from __future__ import annotations

from torch import nn

from threefold.config import ModelConfig
from threefold.model.gpt import is_embedding_or_output


def _embedding_class(name: str) -> bool:
    """megatron-core's `is_embedding_parameter` under muP: every embedding table (word and
    position) and the output layer."""
    return is_embedding_or_output(name) or name.split(".")[-2] == "position_embeddings"


def mup_lr_scales(
    named_parameters: list[tuple[str, nn.Parameter]],
    model: ModelConfig,
    matrices: dict | None = None,
) -> dict[nn.Parameter, float]:
    """{parameter: the factor on its learning rate and Adam eps} (empty without muP, or at a
    width multiplier of 1)."""
    width = model.mup_width_mult
    if width == 1.0:
        return {}
    matrices = matrices or {}
    return {
        param: 1.0 / width
        for name, param in named_parameters
        if param.dim() > 1 and not _embedding_class(name) and param not in matrices
    }
