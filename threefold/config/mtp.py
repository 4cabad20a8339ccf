"""Multi-token prediction fields of the model (Megatron-LM's --mtp-num-layers; DeepSeek-V3's
MTP).

After the decoder, each of --mtp-num-layers depths predicts one token further: depth k takes
the previous depth's hidden states and the embeddings of the input shifted by k, and its own
transformer layer feeds the shared output layer. Its loss, averaged over the depths and
scaled by --mtp-loss-scaling-factor, is added to the language-model loss's gradient, not to
the reported loss (Megatron logs it apart, as `mtp_1 loss`, ...).

`ModelConfig` inherits the fields; their bounds are declared on them (`minimum=`).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    mtp_loss_scaling_factor: float = arg(
        0.1,
        minimum=0,
        checkpoint=MODEL,
        group=GROUP,
        help="weight of the multi-token prediction loss (averaged over the depths)",
    )

    def layer_pattern_with_mtp(self) -> list[int]:
        """1 for each MoE layer, the decoder's then the MTP depths' (each of the last decoder
        layer's kind, as megatron-core builds them)."""
        pattern = self.moe_layer_pattern(self.num_layers)
        return pattern + pattern[-1:] * (self.mtp_num_layers or 0)
