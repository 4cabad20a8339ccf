"""Glm4ForCausalLM (GLM-4-0414 9B and 32B, GLM-Z1): the LLaMA family's attention with biases on
q, k and v alone (attention_bias: --add-qkv-bias) and RoPE on adjacent pairs of the first half
of each head (GLM's rotate_half: --rotary-interleaved --rotary-percent 0.5; the weights map as
they are), in a layer of four RMSNorms: before and after the attention (input_layernorm,
post_self_attn_layernorm) and before and after the MLP (post_attention_layernorm,
post_mlp_layernorm: --post-sublayer-norm beside the input norms, Gemma 3's sandwich); the
SwiGLU's gate and up projections one tensor (gate_up_proj, as Phi-3's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.common import partial_rotary_factor, refuse, scaled_or_no_rope
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.phi3 import FusedGateUpMLP
from threefold.config import ModelConfig


@dataclass(frozen=True)
class Glm4Adapter(FusedGateUpMLP, LlamaAdapter):
    exports_gemma: ClassVar[bool] = True  # (--post-sublayer-norm, Gemma's option)
    partial_rope: ClassVar[bool] = True
    rotates_halves: ClassVar[bool] = False

    def model_config(self, hf: dict) -> ModelConfig:
        qkv_bias = bool(hf.get("attention_bias", True))
        config = super().model_config({**hf, "attention_bias": False, "mlp_bias": False})
        refuse(
            scaled_or_no_rope(config),
            "rope_scaling",
            (hf.get("rope_parameters") or {}).get("rope_type"),
            "GLM-4's plain RoPE only",
        )
        config.add_qkv_bias, config.post_sublayer_norm = qkv_bias, True
        config.rotary_interleaved = True
        config.rotary_percent = partial_rotary_factor({"partial_rotary_factor": 0.5, **hf})
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        gemma = [
            config.embedding_multiplier != 1.0,
            config.geglu,
            config.softmax_scale,
            config.window_rotary_base,
            config.attn_logit_softcapping,
            config.final_logit_softcapping,
            config.apply_layernorm_1p,
        ]
        self.refuse_problems(
            [
                (
                    not config.post_sublayer_norm or not config.sublayer_input_norms,
                    "layers other than four norms, before and after each sublayer "
                    "(--post-sublayer-norm)",
                ),
                (any(gemma), "Gemma's layers other than --post-sublayer-norm"),
                (config.add_bias_linear, "biases other than q, k and v's (--add-qkv-bias)"),
                (
                    scaled_or_no_rope(config) or not config.rotary_interleaved,
                    "RoPE other than plain RoPE on adjacent pairs (--rotary-interleaved)",
                ),
            ]
        )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        del hf["rope_theta"]
        hf.update(
            attention_bias=config.add_qkv_bias,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": config.rotary_percent,
            },
        )
        return hf

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        names = super().layer_names(i, config)
        p = f"model.layers.{i}."
        names.update(
            {
                "post_self_attn_layernorm.weight": p + "post_self_attn_layernorm.weight",
                "post_mlp_layernorm.weight": p + "post_mlp_layernorm.weight",
            }
        )
        return names


GLM4 = Glm4Adapter("Glm4ForCausalLM", "glm4", writes_biases=False)
