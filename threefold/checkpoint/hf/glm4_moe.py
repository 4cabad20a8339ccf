"""Glm4MoeForCausalLM (GLM-4.5, 4.6, 4.7): the LLaMA family's grouped-query attention with
DeepSeek-V3's mixture of experts.

Attention is the LLaMA adapter's, with GLM's choices: biases on the query, key and value
projections only (attention_bias: --add-qkv-bias), RMSNorm on each query and key head before
RoPE (use_qk_norm: --qk-layernorm), and RoPE on the first partial_rotary_factor of each head,
its halves rotated (--rotary-percent; GLM-4.5: 0.5). The experts are DeepSeek-V3's
(hf/deepseek.py): first_k_dense_replace dense layers, then sigmoid scores with
e_score_correction_bias, in n_group groups, the top-k renormalized and scaled by
routed_scaling_factor, beside n_shared_experts shared experts. The Hub checkpoints'
multi-token prediction layer after the decoder's is a depth (--mtp-num-layers), as
DeepSeek-V3's (hf/deepseek.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.checkpoint.hf.common import Take, partial_rotary_factor, refuse, scaled_or_no_rope
from threefold.checkpoint.hf.deepseek import DeepSeekV3Adapter, deepseek_moe, mtp_depths
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ModelConfig


@dataclass(frozen=True)
class Glm4MoeAdapter(DeepSeekV3Adapter):
    exports_mla = False
    partial_rope = True

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(
            bool(hf.get("mlp_bias")), "mlp_bias", hf.get("mlp_bias"), "GLM's MLPs have no biases"
        )
        # The LLaMA adapter's attention and dense MLP, without biases; GLM's on q, k and v.
        config = LlamaAdapter.model_config(self, {**hf, "attention_bias": False})
        config.add_qkv_bias = bool(hf.get("attention_bias"))
        config.qk_layernorm = bool(hf.get("use_qk_norm"))
        config.rotary_percent = partial_rotary_factor(hf)
        for name, value in deepseek_moe(hf).items():
            setattr(config, name, value)
        config.mtp_num_layers = mtp_depths(hf)
        return config

    def attention_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        return [
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (config.add_bias_linear, "biases besides the query, key and value projections'"),
            (scaled_or_no_rope(config), "position embeddings besides plain RoPE"),
        ]

    def hf_config(self, config: ModelConfig) -> dict:
        return {
            **self.common_hf_config(config),
            **self.routing_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.kv_channels,
            "attention_bias": config.add_qkv_bias,
            "use_qk_norm": config.qk_layernorm,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": config.rotary_percent,
            },
            "attention_dropout": config.attention_dropout,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "num_nextn_predict_layers": config.mtp_depths_built(),
        }

    # (the LLaMA adapter's layers, GLM's attention; DeepSeek-V3's depths after them)
    def take_layer(self, take: Take, config: ModelConfig, i: int) -> dict:
        return LlamaAdapter.take_layer(self, take, config, i)

    def give_layer(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        return LlamaAdapter.give_layer(self, state, config, i)


GLM4_MOE = Glm4MoeAdapter("Glm4MoeForCausalLM", "glm4_moe", writes_biases=False)
