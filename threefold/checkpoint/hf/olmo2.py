"""Olmo2ForCausalLM (OLMo 2 1B, 7B, 13B, 32B): the LLaMA family's tensors with OLMo 2's layers
(config/olmo.py): no norm before the attention and the MLP, a norm after each
(post_attention_layernorm, post_feedforward_layernorm: --post-sublayer-norm
--no-sublayer-input-norms), and the query and key norms over all heads together (q_norm,
k_norm of width heads x head size: --qk-layernorm --qk-layernorm-across-heads). OLMoE's
mixture of experts (OlmoeForCausalLM, below) has those query and key norms in the LLaMA layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.common import refuse, rope_scaling
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.moe import MoEAdapter
from threefold.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Olmo2Adapter(LlamaAdapter):
    exports_olmo: ClassVar[bool] = True
    exports_gemma: ClassVar[bool] = True  # (--post-sublayer-norm, Gemma's option too)
    # its query and key norms over all heads together (EXAONE 4's: over each head, one weight)
    qk_across_heads: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        config = super().model_config(hf)
        config.post_sublayer_norm = True
        config.sublayer_input_norms = False
        config.qk_layernorm, config.qk_layernorm_across_heads = True, self.qk_across_heads
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        gemma = [
            config.embedding_multiplier != 1.0,
            config.geglu,
            config.softmax_scale,
            config.window_rotary_base and not self.windows_by_layer,
            config.attn_logit_softcapping,
            config.final_logit_softcapping,
        ]
        olmo = (
            config.post_sublayer_norm
            and not config.sublayer_input_norms
            and config.normalization == "RMSNorm"
            and config.qk_layernorm
            and config.qk_layernorm_across_heads == self.qk_across_heads
        )
        if any(gemma) or not olmo or config.add_bias_linear or config.add_qkv_bias:
            across = " --qk-layernorm-across-heads" if self.qk_across_heads else ""
            raise ConfigError(
                f"{self.architecture} cannot express this model: its layers are normed (RMSNorm) "
                f"after the sublayers only, with query and key norms "
                f"{'across heads' if self.qk_across_heads else 'over each head'}, and no biases "
                f"(--post-sublayer-norm --no-sublayer-input-norms --qk-layernorm{across})"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        hf.pop("mlp_bias", None)
        return hf

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        p = f"model.layers.{i}."
        return {
            "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
            "self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight",
            "post_self_attn_layernorm.weight": p + "post_attention_layernorm.weight",
            "post_mlp_layernorm.weight": p + "post_feedforward_layernorm.weight",
        }


OLMO2 = Olmo2Adapter("Olmo2ForCausalLM", "olmo2")

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Olmo3Adapter(Olmo2Adapter):
    """Olmo3ForCausalLM (OLMo 3 7B, 32B): OLMo 2's layers, of which those `layer_types` names
    (three in four) attend in a window of sliding_window keys (--window-size W-1,0
    --window-attn-skip-freq). RoPE is given per layer type: the full layers' may be YaRN
    (OLMo 3's long context), the windowed layers' plain RoPE of its own base
    (--window-rotary-base, Gemma 3's option)."""

    windows_by_layer: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        parameters = hf.get("rope_parameters") or {}
        if FULL in parameters:  # (transformers 5: RoPE by layer type)
            full = parameters[FULL]
            local = parameters.get(SLIDING) or {"rope_theta": full.get("rope_theta", 10000.0)}
        else:  # (the Hub's configs: the scaling is the full layers')
            theta = parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
            full = {"rope_theta": theta, **(hf.get("rope_scaling") or {}), **parameters}
            local = {"rope_theta": theta}
        refuse(
            local.get("rope_type", "default") != "default",
            "rope_parameters.sliding_attention",
            local,
            "the sliding layers' RoPE is plain RoPE",
        )
        window = hf.get("sliding_window", 4096)
        layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [SLIDING if (i + 1) % 4 else FULL for i in range(layers)]
        llama = {**hf, "rope_parameters": full, "rope_scaling": None, "layer_types": kinds}
        llama.update(use_sliding_window=window is not None, sliding_window=window)
        config = super().model_config(llama)
        local_theta = float(local.get("rope_theta", 10000.0))
        scaled = config.position_embedding_type != "rope" or local_theta != config.rotary_base
        if config.window_size is not None and scaled:
            config.window_rotary_base = local_theta
        return config

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for name in ("rope_theta", "rope_scaling", "use_sliding_window", "max_window_layers"):
            hf.pop(name, None)
        pattern = config.window_pattern(config.num_layers)
        window = config.attention_window()
        full = {"rope_type": "default", "rope_theta": config.rotary_base}
        full.update(rope_scaling(config) or {})
        local = {
            "rope_type": "default",
            "rope_theta": config.window_rotary_base or config.rotary_base,
        }
        hf.update(
            sliding_window=None if window is None else window + 1,
            layer_types=[SLIDING if layer else FULL for layer in pattern],
            rope_parameters={FULL: full, SLIDING: local},
        )
        return hf


OLMO3 = Olmo3Adapter("Olmo3ForCausalLM", "olmo3", window_needs_flag=True)


@dataclass(frozen=True)
class OlmoeAdapter(MoEAdapter):
    """OlmoeForCausalLM (OLMoE 1B-7B): the LLaMA layer (norms before the sublayers) with OLMo
    2's query and key norms across all heads (--qk-layernorm-across-heads) and Qwen3-MoE's
    experts and routing (the top-k probabilities kept: norm_topk_prob) in every layer; its
    `intermediate_size` is each expert's. clip_qkv is refused by name."""

    exports_olmo: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        clip = hf.get("clip_qkv")
        refuse(clip is not None, "clip_qkv", clip, "threefold does not clamp q, k and v")
        config = super().model_config(hf)
        config.qk_layernorm_across_heads = True
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        olmoe = (
            config.qk_layernorm_across_heads
            and config.sublayer_input_norms
            and not config.post_sublayer_norm
            and all(self._pattern(config))
        )
        if not olmoe:
            raise ConfigError(
                f"{self.architecture} cannot express this model: its layers are normed before "
                "the sublayers, with query and key norms across heads "
                "(--qk-layernorm-across-heads), and every one a mixture of experts"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for name in ("moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
            hf.pop(name)  # (Qwen's: OLMoE's experts are its intermediate_size)
        return {**hf, "intermediate_size": config.moe_ffn_hidden_size, "clip_qkv": None}


OLMOE = OlmoeAdapter(
    "OlmoeForCausalLM",
    "olmoe",
    qk_norm=True,
    writes_biases=False,
    extra_hf_config={"attention_bias": False},
    renormalizes_always=False,
)
