"""Phi's output layer (transformers' PhiForCausalLM: Phi-1, Phi-1.5, Phi-2; checkpoint/hf/phi.py
sets it), beside Cohere's shared norm (config/cohere.py), --rotary-percent and --openai-gelu:

    --output-layer-bias        the output layer adds a bias to the logits, one per vocabulary
                               entry (Phi's lm_head, GPT-J's); under TP each rank holds its
                               vocabulary shard's

Megatron-LM builds no output-layer bias (a Megatron export is refused).

`ModelConfig` inherits the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.fields import ARCHITECTURE, arg

GROUP = "Phi's output layer"


@dataclass
class PhiConfig:
    output_layer_bias: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="the output layer adds a bias per vocabulary entry to the logits (Phi's lm_head)",
    )
