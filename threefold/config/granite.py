"""Granite's layer (transformers' GraniteForCausalLM: IBM Granite 3; checkpoint/hf/granite.py
sets it), beside what threefold has already for Granite's other multipliers
(--embedding-multiplier, --softmax-scale for attention_multiplier, --logit-scale for
1 / logits_scaling):

    --residual-multiplier M    the attention's and the MLP's outputs scaled by M before each
                               residual add (Granite 3 8B: 0.22)

Megatron-LM does not build it (a Megatron export is refused).

`ModelConfig` inherits the field; `finalize_granite` is called from its finalize.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg

GROUP = "Granite's layer"


@dataclass
class GraniteConfig:
    residual_multiplier: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the attention's and the MLP's outputs scaled by this before each residual add "
        "(Granite 3 8B: 0.22)",
    )

    def finalize_granite(self) -> None:
        _require(
            self.residual_multiplier > 0,
            f"--residual-multiplier {self.residual_multiplier} must be positive",
        )
