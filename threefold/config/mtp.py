"""Multi-token prediction fields of the model (Megatron-LM's --mtp-num-layers; DeepSeek-V3's
MTP).

After the decoder, each of --mtp-num-layers depths predicts one token further: depth k takes
the previous depth's hidden states and the embeddings of the input shifted by k, and its own
transformer layer feeds the shared output layer. Its loss, averaged over the depths and
scaled by --mtp-loss-scaling-factor, is added to the language-model loss's gradient, not to
the reported loss (Megatron logs it apart, as `mtp_1 loss`, ...).

--mtp-use-repeated-layer (Megatron-LM's) builds one depth and runs it for every depth, its
weights shared. `ModelConfig` inherits the fields; their bounds are declared on them
(`minimum=`); `finalize_mtp` is called from its finalize, after the hybrid pattern has set the
depths.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, MODEL, arg

GROUP = "multi-token prediction"


@dataclass
class MTPConfig:
    mtp_num_layers: int | None = arg(
        None,
        minimum=1,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="multi-token prediction depths after the decoder, one transformer layer each "
        "(none: next-token prediction only)",
    )
    mtp_use_repeated_layer: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="one depth's layers (and projection and norms) run for every depth, their weights "
        "shared (Megatron-LM's; Nemotron 3.5's)",
    )
    mtp_loss_scaling_factor: float = arg(
        0.1,
        minimum=0,
        checkpoint=MODEL,
        group=GROUP,
        help="weight of the multi-token prediction loss (averaged over the depths)",
    )

    def finalize_mtp(self) -> None:
        _require(
            not self.mtp_use_repeated_layer or self.mtp_num_layers,
            "--mtp-use-repeated-layer repeats a depth's layer over --mtp-num-layers depths: add "
            "--mtp-num-layers (or a hybrid pattern's / depths) or drop it",
        )

    def mtp_depths_built(self) -> int:
        """The depths with weights of their own: one, shared by all, under
        --mtp-use-repeated-layer."""
        depths = self.mtp_num_layers or 0
        return min(depths, 1) if self.mtp_use_repeated_layer else depths

    def layer_pattern_with_mtp(self, depths: int | None = None) -> list[int]:
        """1 for each MoE layer, the decoder's then the MTP depths' (each of the last decoder
        layer's kind, as megatron-core builds them): those built (`depths`: that many)."""
        pattern = self.moe_layer_pattern(self.num_layers)
        depths = self.mtp_depths_built() if depths is None else depths
        return pattern + pattern[-1:] * depths
