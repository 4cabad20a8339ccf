"""Llama4ForCausalLM (Llama 4 Scout and Maverick, transformers' text model).

Attention is the LLaMA adapter's with Llama 4's choices: RoPE on adjacent pairs of each head
(--rotary-interleaved: the rows need no regrouping), Llama 3.1's frequency scaling with the
config's own bands (Scout: high = low = 1), layers without RoPE where `no_rope_layers` holds 0
(--no-rope-freq as a pattern: 1 there), queries and keys scaled to unit RMS in the layers with
RoPE (use_qk_norm: --qk-l2-norm --qk-l2-norm-rope-layers-only), the layers with RoPE
attending in chunks of attention_chunk_size tokens (--attention-chunk-size) and the others'
queries tempered by position (attn_temperature_tuning, floor_scale, attn_scale:
config/llama4.py).

The MLP of a layer in `moe_layers` is Llama 4's mixture: top-1 sigmoid routing whose weight
scales the token before its expert (--moe-apply-probs-on-input), and a shared expert as wide
as the experts; the other layers' MLPs are intermediate_size_mlp wide (--ffn-hidden-size).
transformers stacks the experts (the Hub's files too):

    feed_forward.experts.gate_up_proj  [experts, hidden, 2 x expert] = each linear_fc1^T
                                       ([gate; up] rows as threefold's)
    feed_forward.experts.down_proj     [experts, expert, hidden]     = each linear_fc2^T
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take, refuse, refuse_router_jitter, rope_scaling
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.multimodal import TextOfMultimodal
from threefold.config import ModelConfig


def _pattern(values: list[int], layers: int) -> str | None:
    """A per-layer 0/1 list as --no-rope-freq's or --moe-layer-freq's pattern (None: no 1)."""
    return "[" + ",".join(map(str, values)) + "]" if any(values[:layers]) else None


@dataclass(frozen=True)
class Llama4Adapter(LlamaAdapter):
    exports_moe: ClassVar[bool] = True
    exports_llama4: ClassVar[bool] = True
    exports_dense: ClassVar[bool] = True  # (moe_layers empty)
    rotates_halves: ClassVar[bool] = False

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(
            bool(hf.get("attention_bias")),
            "attention_bias",
            hf.get("attention_bias"),
            "threefold has biases on every projection or none, and Llama 4's MLPs have none",
        )
        refuse_router_jitter(hf)
        topk = hf.get("num_experts_per_tok", 1)
        refuse(topk != 1, "num_experts_per_tok", topk, "Llama 4's routing is built for top-1")
        layers = hf["num_hidden_layers"]
        config = super().model_config({**hf, "intermediate_size": hf["intermediate_size_mlp"]})
        config.rotary_interleaved = True
        # transformers' no_rope_layers holds 1 for a layer WITH RoPE
        rope = [int(x) for x in hf.get("no_rope_layers") or [1] * layers][:layers]
        nope = _pattern([1 - x for x in rope], layers)
        config.no_rope_freq = nope
        config.qk_l2_norm = bool(hf.get("use_qk_norm"))
        config.qk_l2_norm_rope_layers_only = config.qk_l2_norm and nope is not None
        config.attention_chunk_size = hf.get("attention_chunk_size")
        config.attn_temperature_tuning = bool(hf.get("attn_temperature_tuning")) and bool(nope)
        if config.attn_temperature_tuning:
            config.attn_temperature_floor_scale = int(hf.get("floor_scale", 8192))
            config.attn_temperature_scale = float(hf.get("attn_scale", 0.1))
        step = hf.get("interleave_moe_layer_step", 1)
        moe = hf.get("moe_layers")
        if moe is None:
            moe = list(range(step - 1, layers, step))
        pattern = _pattern([int(i in moe) for i in range(layers)], layers)
        if pattern is not None:
            config.num_experts = hf["num_local_experts"]
            config.moe_router_topk = 1
            config.moe_router_score_function = "sigmoid"
            config.moe_apply_probs_on_input = True
            config.moe_ffn_hidden_size = hf["intermediate_size"]
            config.moe_shared_expert_intermediate_size = hf["intermediate_size"]
            config.moe_aux_loss_coeff = hf.get("router_aux_loss_coef", 0.0)
            config.moe_layer_freq = "1" if "0" not in pattern else pattern
            config.moe_token_dispatcher_type = "alltoall"
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        nope = any(config.no_rope_pattern(config.num_layers))
        problems = [
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (config.add_bias_linear or config.add_qkv_bias, "biases (--disable-bias-linear)"),
            (
                config.position_embedding_type != "rope"
                or not config.rotary_interleaved
                or config.rotary_seq_len_interpolation_factor,
                "RoPE other than on adjacent pairs (--rotary-interleaved), without interpolation",
            ),
            (
                config.qk_l2_norm and nope and not config.qk_l2_norm_rope_layers_only,
                "--qk-l2-norm in the layers without RoPE too (megatron-core's Llama 4; add "
                "--qk-l2-norm-rope-layers-only)",
            ),
            (
                config.is_moe
                and not (
                    config.moe_router_score_function == "sigmoid"
                    and config.moe_router_topk == 1
                    and config.moe_apply_probs_on_input
                ),
                "routing other than Llama 4's (top-1 sigmoid, --moe-apply-probs-on-input)",
            ),
            (
                config.is_moe
                and config.moe_shared_expert_intermediate_size != config.moe_ffn_hidden_size,
                "a shared expert other than one as wide as the experts",
            ),
            (config.mtp_num_layers, "multi-token prediction depths (--mtp-num-layers)"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        layers = config.num_layers
        nope = config.no_rope_pattern(layers)
        parameters = {"rope_type": "default", "rope_theta": config.rotary_base}
        parameters.update(rope_scaling(config) or {})
        moe = config.moe_layer_pattern(layers)
        return {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.moe_ffn_hidden_size or config.ffn_hidden_size,
            "intermediate_size_mlp": config.ffn_hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.kv_channels,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "rope_parameters": parameters,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
            "attention_bias": False,
            "num_local_experts": config.num_experts or 1,
            "num_experts_per_tok": 1,
            "moe_layers": [i for i, chosen in enumerate(moe) if chosen],
            "router_aux_loss_coef": config.moe_aux_loss_coeff,
            "router_jitter_noise": 0.0,
            "use_qk_norm": config.qk_l2_norm,
            "no_rope_layers": [1 - x for x in nope],
            "attention_chunk_size": config.attention_chunk_size,
            "attn_temperature_tuning": config.attn_temperature_tuning,
            "floor_scale": config.attn_temperature_floor_scale,
            "attn_scale": config.attn_temperature_scale,
        }

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.feed_forward."
        if not config.moe_layer_pattern(config.num_layers)[i]:
            gate_up = [take(p + "gate_proj.weight"), take(p + "up_proj.weight")]
            return {
                ours + "linear_fc1.weight": torch.cat(gate_up),
                ours + "linear_fc2.weight": take(p + "down_proj.weight"),
            }
        shared = p + "shared_expert."
        out = {
            ours + "router.weight": take(p + "router.weight"),
            ours + "shared_experts.linear_fc1.weight": torch.cat(
                [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
            ),
            ours + "shared_experts.linear_fc2.weight": take(shared + "down_proj.weight"),
        }
        fc1, fc2 = take(p + "experts.gate_up_proj"), take(p + "experts.down_proj")
        for e in range(config.num_experts):
            expert = f"{ours}experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = fc1[e].t()
            out[expert + "linear_fc2.weight"] = fc2[e].t()
        return out

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.feed_forward."
        if not config.moe_layer_pattern(config.num_layers)[i]:
            gate, up = state[ours + "linear_fc1.weight"].chunk(2)
            return {
                p + "gate_proj.weight": gate,
                p + "up_proj.weight": up,
                p + "down_proj.weight": state[ours + "linear_fc2.weight"],
            }
        gate, up = state[ours + "shared_experts.linear_fc1.weight"].chunk(2)
        experts = range(config.num_experts)
        local = f"{ours}experts.local_experts."
        return {
            p + "router.weight": state[ours + "router.weight"],
            p + "shared_expert.gate_proj.weight": gate,
            p + "shared_expert.up_proj.weight": up,
            p + "shared_expert.down_proj.weight": state[ours + "shared_experts.linear_fc2.weight"],
            p + "experts.gate_up_proj": torch.stack(
                [state[f"{local}{e}.linear_fc1.weight"].t() for e in experts]
            ),
            p + "experts.down_proj": torch.stack(
                [state[f"{local}{e}.linear_fc2.weight"].t() for e in experts]
            ),
        }


LLAMA4 = Llama4Adapter("Llama4ForCausalLM", "llama4_text", writes_biases=False)


@dataclass(frozen=True)
class Llama4ConditionalAdapter(TextOfMultimodal, Llama4Adapter):
    """Llama4ForConditionalGeneration, as the Hub keeps Scout and Maverick: its text model
    (hf/multimodal.py)."""

    left_behind_prefixes: ClassVar[tuple[str, ...]] = ("vision_model.", "multi_modal_projector.")
    exports_as: ClassVar[str] = "Llama4ForCausalLM"


LLAMA4_CONDITIONAL = Llama4ConditionalAdapter(
    "Llama4ForConditionalGeneration", "llama4", writes_biases=False
)
