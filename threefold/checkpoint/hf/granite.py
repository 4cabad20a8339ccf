"""GraniteForCausalLM (IBM Granite 3.0 to 3.3, 2B and 8B): the LLaMA family's tensors with four
multipliers, each a threefold flag: `embedding_multiplier` (--embedding-multiplier, the word
embeddings scaled), `attention_multiplier` (--softmax-scale, the scores' scale in place of
1/sqrt(head size)), `residual_multiplier` (--residual-multiplier, the attention's and the MLP's
outputs scaled before each residual add) and `logits_scaling` (the logits divided by it:
--logit-scale its inverse)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class GraniteAdapter(LlamaAdapter):
    exports_granite: ClassVar[bool] = True
    exports_gemma: ClassVar[bool] = True  # (--embedding-multiplier, --softmax-scale only)
    # (--logit-scale; Cohere's norms are refused with the LayerNorm and parallel layers)
    exports_cohere: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        config = super().model_config(hf)
        config.embedding_multiplier = float(hf.get("embedding_multiplier", 1.0))
        config.softmax_scale = float(hf.get("attention_multiplier", 1.0))
        config.residual_multiplier = float(hf.get("residual_multiplier", 1.0))
        config.logit_scale = 1.0 / float(hf.get("logits_scaling", 1.0))
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (
                config.post_sublayer_norm
                or config.geglu
                or config.window_rotary_base
                or config.attn_logit_softcapping
                or config.final_logit_softcapping,
                "Gemma's layers besides its multipliers",
            ),
        ]
        for problem, what in problems:
            if problem:
                raise ConfigError(f"{self.architecture} cannot express this model: {what}")

    def hf_config(self, config: ModelConfig) -> dict:
        head = config.kv_channels or config.hidden_size // config.num_attention_heads
        return {
            **super().hf_config(config),
            "embedding_multiplier": config.embedding_multiplier,
            "attention_multiplier": config.softmax_scale or 1 / math.sqrt(head),
            "residual_multiplier": config.residual_multiplier,
            "logits_scaling": 1.0 / config.logit_scale,
        }


GRANITE = GraniteAdapter("GraniteForCausalLM", "granite")
