"""Gemma3ForCausalLM (Gemma 3's text models: gemma-3-270m, gemma-3-1b) and Gemma2ForCausalLM
(Gemma 2: without head norms, every other layer windowed, one RoPE base, soft-capped scores
and logits: --attn-logit-softcapping, --final-logit-softcapping).

The LLaMA family's tensors with Gemma's layers (config/gemma.py):

    embed_tokens, scaled by sqrt(hidden_size)       --embedding-multiplier
    RMSNorms scaling by 1 + weight                  --apply-layernorm-1p (weights as stored)
    input_layernorm, pre_feedforward_layernorm      input_layernorm, pre_mlp_layernorm
    post_attention_layernorm, post_feedforward_...  --post-sublayer-norm: the attention's and
                                                    the MLP's outputs normed before each add
    self_attn.q_norm, k_norm                        --qk-layernorm
    gelu_pytorch_tanh(gate) * up                    --geglu --openai-gelu
    scores scaled by query_pre_attn_scalar^-1/2     --softmax-scale
    sliding_attention layers, sliding_window        --window-size W-1,0 and
                                                    --window-attn-skip-freq's pattern
    their RoPE (rope_local_base_freq, unscaled)     --window-rotary-base; the full layers'
                                                    by --rotary-base, linear scaling as
                                                    --rotary-seq-len-interpolation-factor

Bidirectional attention and attention biases are refused by name.
Gemma3ForConditionalGeneration (4B and up) converts as its text model (hf/multimodal.py).
GemmaForCausalLM (Gemma 1, CodeGemma) is the LLaMA layer with Gemma's embeddings, norms and
GeGLU only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.common import refuse, rope_scaling, rope_settings
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.multimodal import TextOfMultimodal
from threefold.config import ModelConfig


def _rope(hf: dict) -> tuple[dict, dict | None]:
    """(the full layers', the sliding layers' or None where they share it) RoPE settings, as
    transformers 5 keeps them per layer type or the Hub's configs (rope_theta,
    rope_local_base_freq, rope_scaling)."""
    parameters = hf.get("rope_parameters") or {}
    if "full_attention" in parameters:
        return parameters["full_attention"], parameters.get("sliding_attention") or {}
    full = {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    full.update(parameters)
    if "rope_local_base_freq" not in hf:
        return full, None
    return full, {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}


@dataclass(frozen=True)
class Gemma3Adapter(LlamaAdapter):
    exports_gemma: ClassVar[bool] = True
    zero_centered_norms: ClassVar[bool] = True
    gemma2: ClassVar[bool] = False  # Gemma 2: soft-capping, no head norms, one RoPE

    def model_config(self, hf: dict) -> ModelConfig:
        if not self.gemma2:
            for field in ("final_logit_softcapping", "attn_logit_softcapping"):
                refuse(hf.get(field) is not None, field, hf.get(field), "Gemma 3 has none")
        for field in ("use_bidirectional_attention", "attention_bias"):
            refuse(bool(hf.get(field)), field, hf.get(field), "Gemma's text models have none")
        activation = hf.get("hidden_activation", "gelu_pytorch_tanh")
        refuse(
            activation not in ("gelu_pytorch_tanh", "gelu"),
            "hidden_activation",
            activation,
            "Gemma's GeGLU with GELU or its tanh approximation only",
        )
        full, local = _rope(hf)
        refuse(
            (local or {}).get("rope_type", "default") != "default",
            "rope_parameters.sliding_attention",
            local,
            "the sliding layers' RoPE is plain RoPE",
        )
        theta, scaling = rope_settings({"rope_parameters": full})
        layers = hf["num_hidden_layers"]
        every = 2 if self.gemma2 else hf.get("sliding_window_pattern", 6)  # (a full layer)
        kinds = hf.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "sliding" for i in range(layers)
        ]
        pattern = [int(kind != "full_attention") for kind in kinds]
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // heads
        groups = hf.get("num_key_value_heads") or heads
        positions = hf.get("max_position_embeddings", 32768)
        scalar = hf.get("query_pre_attn_scalar", head_dim)
        window = hf.get("sliding_window")
        windows = {}
        if window is not None and any(pattern):
            windows = {
                "window_size": f"{window - 1},0",
                "window_attn_skip_freq": "[" + ",".join(map(str, pattern)) + "]",
            }
            if local is not None:
                windows["window_rotary_base"] = float(local.get("rope_theta", 10000.0))
        return ModelConfig(
            num_layers=layers,
            hidden_size=hidden,
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            group_query_attention=groups != heads,
            num_query_groups=groups,
            kv_channels=head_dim,
            seq_length=min(positions, 4096),
            max_position_embeddings=positions,
            rotary_base=theta,
            **{"position_embedding_type": "rope", **scaling},
            normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            apply_layernorm_1p=True,
            qk_layernorm=not self.gemma2,
            geglu=True,
            openai_gelu=activation == "gelu_pytorch_tanh",
            add_bias_linear=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
            embedding_multiplier=hidden**0.5,
            post_sublayer_norm=True,
            softmax_scale=None if scalar == head_dim else scalar**-0.5,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            **windows,
        )

    def check_exportable(self, config: ModelConfig) -> None:
        problems = [
            (config.normalization != "RMSNorm" or not config.apply_layernorm_1p, "other norms"),
            (not config.geglu, "an MLP other than GeGLU"),
            (config.qk_layernorm == self.gemma2, "query and key norms (Gemma 3's, not Gemma 2's)"),
            (
                not self.gemma2
                and (config.attn_logit_softcapping or config.final_logit_softcapping),
                "soft-capping (Gemma 2's)",
            ),
            (not config.post_sublayer_norm, "no norms after the sublayers"),
            (
                abs(config.embedding_multiplier - config.hidden_size**0.5) > 1e-6,
                "embeddings scaled other than by sqrt(--hidden-size)",
            ),
            (config.add_bias_linear or config.add_qkv_bias, "biases"),
            (config.position_embedding_type != "rope" or config.use_rope_scaling, "other RoPE"),
            (config.rotary_interleaved or config.rotary_percent != 1.0, "RoPE on pairs or part"),
            (
                config.window_size is not None
                and (config.window_rotary_base is None) != self.gemma2,
                "the windows' RoPE base (Gemma 3's own, Gemma 2's shared)",
            ),
            (config.is_moe or config.mtp_num_layers, "experts or multi-token prediction"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        window, pattern = config.attention_window(), config.window_pattern(config.num_layers)
        full = {"rope_type": "default", "rope_theta": config.rotary_base}
        full.update(rope_scaling(config) or {})
        local = {"rope_type": "default", "rope_theta": config.window_rotary_base or 10000.0}
        rope = full if self.gemma2 else {"full_attention": full, "sliding_attention": local}
        scale = config.softmax_scale
        return {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.kv_channels,
            "hidden_activation": "gelu_pytorch_tanh" if config.openai_gelu else "gelu",
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "rope_parameters": rope,
            "query_pre_attn_scalar": config.kv_channels if scale is None else round(scale**-2),
            "sliding_window": None if window is None else window + 1,
            "layer_types": [
                "sliding_attention" if windowed else "full_attention" for windowed in pattern
            ],
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
            "attention_bias": False,
            "final_logit_softcapping": config.final_logit_softcapping,
            "attn_logit_softcapping": config.attn_logit_softcapping,
            "pad_token_id": None,
        }

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        p = f"model.layers.{i}."
        return {
            **super().layer_names(i, config),
            "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
            "pre_mlp_layernorm.weight": p + "pre_feedforward_layernorm.weight",
            "post_self_attn_layernorm.weight": p + "post_attention_layernorm.weight",
            "post_mlp_layernorm.weight": p + "post_feedforward_layernorm.weight",
        }


GEMMA3 = Gemma3Adapter(
    "Gemma3ForCausalLM", "gemma3_text", windows_by_layer=True, writes_biases=False
)


@dataclass(frozen=True)
class Gemma3ConditionalAdapter(TextOfMultimodal, Gemma3Adapter):
    """Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B): its text model
    (hf/multimodal.py)."""

    left_behind_prefixes: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")
    exports_as: ClassVar[str] = "Gemma3ForCausalLM"


GEMMA3_CONDITIONAL = Gemma3ConditionalAdapter(
    "Gemma3ForConditionalGeneration", "gemma3", windows_by_layer=True, writes_biases=False
)


@dataclass(frozen=True)
class Gemma2Adapter(Gemma3Adapter):
    """Gemma2ForCausalLM (Gemma 2 2B, 9B, 27B): Gemma 3's layers without head norms, every
    other layer windowed, one RoPE base, and its scores and logits soft-capped
    (--attn-logit-softcapping, --final-logit-softcapping)."""

    gemma2: ClassVar[bool] = True


GEMMA2 = Gemma2Adapter("Gemma2ForCausalLM", "gemma2", windows_by_layer=True, writes_biases=False)


@dataclass(frozen=True)
class GemmaAdapter(LlamaAdapter):
    """GemmaForCausalLM (Gemma 2B and 7B, CodeGemma): the LLaMA family's layer with Gemma's
    embeddings scaled by sqrt(hidden_size), its (1 + weight) RMSNorms and GeGLU, and none of
    Gemma 2's and 3's norms after the sublayers, head norms, windows or soft-capping. Its
    configs' `hidden_act` "gelu" means the tanh approximation, as transformers reads it."""

    exports_gemma: ClassVar[bool] = True
    zero_centered_norms: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "gelu_pytorch_tanh")
        refuse(
            activation not in ("gelu_pytorch_tanh", "gelu"),
            "hidden_act",
            activation,
            "Gemma's GeGLU with GELU's tanh approximation only",
        )
        refuse(
            bool(hf.get("use_bidirectional_attention")),
            "use_bidirectional_attention",
            hf.get("use_bidirectional_attention"),
            "threefold's attention is causal",
        )
        config = super().model_config(
            {**hf, "hidden_act": "silu", "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
        )
        config.swiglu, config.geglu, config.openai_gelu = False, True, True
        config.apply_layernorm_1p = True
        config.embedding_multiplier = hf["hidden_size"] ** 0.5
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (config.normalization != "RMSNorm" or not config.apply_layernorm_1p, "other norms"),
            (not (config.geglu and config.openai_gelu), "an MLP other than tanh GeGLU"),
            (
                abs(config.embedding_multiplier - config.hidden_size**0.5) > 1e-6,
                "embeddings scaled other than by sqrt(--hidden-size)",
            ),
            (
                config.post_sublayer_norm
                or config.softmax_scale
                or config.window_rotary_base
                or config.attn_logit_softcapping
                or config.final_logit_softcapping,
                "Gemma 2's and 3's layers (export as Gemma2ForCausalLM or Gemma3ForCausalLM)",
            ),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        return {**super().hf_config(config), "hidden_act": "gelu_pytorch_tanh"}


GEMMA = GemmaAdapter(
    "GemmaForCausalLM", "gemma", writes_biases=False, extra_hf_config={"attention_bias": False}
)
