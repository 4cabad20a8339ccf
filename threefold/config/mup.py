"""Maximal Update Parameterization's fields (Megatron-LM's --use-mup and --mup-*).

muP keeps a model's training dynamics as its width grows, so hyperparameters tuned on a narrow
proxy (--mup-base-hidden-size) transfer. With m = --hidden-size / --mup-base-hidden-size, as
megatron-core applies it:

    initialization   hidden matrices N(0, std / sqrt(m)); the projections into the residual
                     stream N(0, std / sqrt(2 L m)); embeddings (and an untied output layer)
                     N(0, std), unscaled
    attention        softmax scale sqrt(--mup-base-head-dim) / d ** --mup-attn-scale-power
                     (1/d by default, not 1/sqrt(d)); multi-latent attention keeps its own
                     (YaRN's temperature over sqrt(d)), as megatron-core's MLA does
    embeddings       times --mup-embedding-mult
    logits           times --mup-output-mult, 1/m when left at 1
    Adam             hidden matrices at lr / m and eps / m (training/mup.py); embeddings, the
                     output layer, norms and biases at the base values

`ModelConfig` inherits the fields (a checkpoint carries them, as Megatron-LM's args do);
`finalize_mup` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg, given_flags

GROUP = "muP"


@dataclass
class MuPConfig:
    use_mup: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="Maximal Update Parameterization: initialization, attention scale, logits and "
        "Adam's hidden learning rate scaled by the width over --mup-base-hidden-size",
    )
    mup_base_hidden_size: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the proxy model's hidden size the hyperparameters were tuned at (default: "
        "--hidden-size, a width multiplier of 1)",
    )
    mup_embedding_mult: float = arg(
        1.0, checkpoint=ARCHITECTURE, group=GROUP, help="multiplier of the embeddings' output"
    )
    mup_output_mult: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="multiplier of the logits (at 1: 1 / the width multiplier)",
    )
    mup_base_head_dim: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="softmax scale sqrt(this) / head size ** --mup-attn-scale-power (default: 1 / "
        "head size ** power)",
    )
    mup_attn_scale_power: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="1: muP's 1 / head size; 0.5: the standard 1 / sqrt(head size)",
    )

    @property
    def mup_width_mult(self) -> float:
        """m: the width over the proxy's (1 without muP)."""
        if not self.use_mup:
            return 1.0
        return self.hidden_size / (self.mup_base_hidden_size or self.hidden_size)

    @property
    def mup_logits_mult(self) -> float:
        """What the logits are multiplied by (megatron-core's auto-set mup_output_mult)."""
        if not self.use_mup:
            return 1.0
        width = self.mup_width_mult
        return 1.0 / width if self.mup_output_mult == 1.0 and width != 1.0 else self.mup_output_mult

    def mup_query_scale(self, head_dim: int) -> float:
        """The factor on the queries that turns the kernels' 1/sqrt(head_dim) into muP's
        softmax scale (1 without muP)."""
        if not self.use_mup:
            return 1.0
        base = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim**0.5
        return base / head_dim**self.mup_attn_scale_power * head_dim**0.5

    def finalize_mup(self) -> None:
        if not self.use_mup:
            given = given_flags(self, MuPConfig)
            _require(not given, f"{' '.join(given)}: muP settings without --use-mup; add it")
            return
        base = self.mup_base_hidden_size
        _require(base is None or base > 0, "--mup-base-hidden-size must be positive")
        _require(
            self.mup_base_head_dim is None or self.mup_base_head_dim > 0,
            "--mup-base-head-dim must be positive",
        )
