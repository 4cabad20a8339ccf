"""BambaForCausalLM (IBM's Bamba-9B) and GraniteMoeHybridForCausalLM (IBM Granite 4.0's hybrid
models, Granite-4.0-H Micro, Tiny and Small): each Hugging Face layer a Mamba-2 mixer or
attention, then an MLP, norm before each. threefold's hybrid stack (config/hybrid.py) holds a
part a layer, so Hugging Face's layer i is threefold's layers 2i (M or *) and 2i + 1 (- or E):
the pattern "M-M-*-" for [mamba, mamba, attention].

The Mamba mixer maps as it is (in_proj's [z; x; B; C; dt] rows, megatron-core's order too);
attention's q, k, v are fused into threefold's grouped linear_qkv. Bamba: LLaMA's SwiGLU MLP
and RMSNorm, RoPE on the first half of each head (--rotary-percent 0.5). Granite 4.0:
Granite's four multipliers (hf/granite.py; the residual one on the Mamba layers too), no
positions unless position_embedding_type says rope, and either a SwiGLU MLP (`shared_mlp`,
`input_linear` holding [gate; up]) or, with experts, GraniteMoe's experts and routing beside
that MLP as the shared expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Adapter, Take, refuse
from threefold.checkpoint.hf.hybrid_parts import (
    MambaNames,
    check_mamba,
    give_attention,
    give_mamba,
    hybrid_fields,
    take_attention,
    take_mamba,
)
from threefold.config import ModelConfig
from threefold.config.hybrid import ATTENTION, MAMBA, MAMBA_CONV_KERNEL, MLP, MOE
from threefold.model.mamba import GATED_NORM_EPS

# the Mamba settings' names in Bamba's and Granite 4.0's configs
NAMES_OF_SETTINGS = MambaNames(
    eps="rms_norm_eps",
    conv="mamba_d_conv",
    conv_bias="mamba_conv_bias",
    bias="mamba_proj_bias",
    state="mamba_d_state",
    head_dim="mamba_d_head",
    groups="mamba_n_groups",
    heads="mamba_n_heads",
)
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION}
_KINDS["full_attention"] = ATTENTION


def _mixers(hf: dict) -> list[str]:
    """M or * for each Hugging Face layer."""
    kinds = hf.get("layer_types") or hf.get("layers_block_type")
    if kinds is None:  # (Bamba's: the attention layers' indices)
        attention = set(hf.get("attn_layer_indices") or [])
        kinds = ["attention" if i in attention else "mamba" for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(kinds) - set(_KINDS))
    refuse(unknown, "layer_types", unknown, "mamba or attention layers only")
    return [_KINDS[kind] for kind in kinds]


@dataclass(frozen=True)
class BambaAdapter(Adapter):
    architecture: str = "BambaForCausalLM"
    model_type: str = "bamba"
    exports_hybrid: ClassVar[bool] = True
    partial_rope: ClassVar[bool] = True
    final_norm: ClassVar[str] = "model.final_layernorm"
    mlp_norm: ClassVar[str] = "pre_ff_layernorm"

    def model_config(self, hf: dict) -> ModelConfig:
        check_mamba(hf, NAMES_OF_SETTINGS)
        act = hf.get("hidden_act", "silu")
        refuse(act != "silu", "hidden_act", act, "SwiGLU with SiLU only")
        pattern = "".join(mixer + self._mlp_symbol(hf) for mixer in _mixers(hf))
        rope = hf.get("rope_parameters") or {}
        return ModelConfig(
            **hybrid_fields(hf, NAMES_OF_SETTINGS, pattern),
            ffn_hidden_size=hf["intermediate_size"],
            **self._positions(hf, rope),
            swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        )

    def _mlp_symbol(self, hf: dict) -> str:
        return MLP

    def _positions(self, hf: dict, rope: dict) -> dict:
        """Bamba's RoPE: on the first half of each head, whatever the config says."""
        return {
            "position_embedding_type": "rope",
            "rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "rotary_percent": 0.5,
        }

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        pattern = config.hybrid_layers() if config.hybrid else ""
        pairs = [pattern[i : i + 2] for i in range(0, len(pattern), 2)]
        problems = [
            (
                not pattern
                or any(len(p) < 2 or p[0] not in "M*" or p[1] not in "-E" for p in pairs),
                "a pattern other than pairs of a mixer (M or *) and an MLP (- or E)",
            ),
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (config.add_bias_linear or config.add_qkv_bias, "biases"),
            (config.norm_epsilon != GATED_NORM_EPS, f"--norm-epsilon {config.norm_epsilon}"),
            *self._own_problems(config),
        ]
        self.refuse_problems(problems)

    def _own_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        return [
            (config.is_moe, "experts (GraniteMoeHybridForCausalLM has them)"),
            (config.position_embedding_type != "rope", "other than RoPE"),
            (config.rotary_percent != 0.5, "RoPE on other than half of each head"),
            (config.residual_multiplier != 1.0, "Granite's multipliers"),
        ]

    def hf_config(self, config: ModelConfig) -> dict:
        mixers = config.hybrid_layers()[::2]
        hf = {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": len(mixers),
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
            "hidden_act": "silu",
            "mamba_d_state": config.mamba_state_dim,
            "mamba_d_head": config.mamba_head_dim,
            "mamba_n_heads": config.mamba_heads(),
            "mamba_n_groups": config.mamba_num_groups,
            "mamba_d_conv": MAMBA_CONV_KERNEL,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "attention_bias": False,
            "mlp_bias": False,
        }
        return {**hf, **self._hf_layers(config, mixers)}

    def _hf_layers(self, config: ModelConfig, mixers: str) -> dict:
        return {
            "attn_layer_indices": [i for i, mixer in enumerate(mixers) if mixer == ATTENTION],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": 0.5,
            },
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = {
            "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
            "decoder.final_layernorm.weight": take(self.final_norm + ".weight"),
        }
        if config.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = take("lm_head.weight")
        else:
            used.add("lm_head.weight")
        pattern = config.hybrid_layers()
        for i in range(len(pattern) // 2):
            mixer, p = f"decoder.layers.{2 * i}.", f"model.layers.{i}."
            norm = p + "input_layernorm.weight"
            if pattern[2 * i] == MAMBA:
                out.update(take_mamba(take, mixer, norm, p + "mamba."))
            else:
                out.update(take_attention(take, config, mixer, norm, p + "self_attn."))
            ours = f"decoder.layers.{2 * i + 1}."
            out[ours + "pre_mlp_layernorm.weight"] = take(p + self.mlp_norm + ".weight")
            out.update(self._take_mlp(take, config, ours + "mlp.", p, pattern[2 * i + 1]))
        return out

    def _take_mlp(self, take: Take, config: ModelConfig, ours: str, p: str, symbol: str) -> dict:
        gate, up = (take(p + f"feed_forward.{x}_proj.weight") for x in ("gate", "up"))
        return {
            ours + "linear_fc1.weight": torch.cat([gate, up]),
            ours + "linear_fc2.weight": take(p + "feed_forward.down_proj.weight"),
        }

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {
            "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
            self.final_norm + ".weight": state["decoder.final_layernorm.weight"],
        }
        if config.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        pattern = config.hybrid_layers()
        for i in range(len(pattern) // 2):
            mixer, p = f"decoder.layers.{2 * i}.", f"model.layers.{i}."
            norm = p + "input_layernorm.weight"
            if pattern[2 * i] == MAMBA:
                out.update(give_mamba(state, mixer, norm, p + "mamba."))
            else:
                out.update(give_attention(state, config, mixer, norm, p + "self_attn."))
            ours = f"decoder.layers.{2 * i + 1}."
            out[p + self.mlp_norm + ".weight"] = state[ours + "pre_mlp_layernorm.weight"]
            out.update(self._give_mlp(state, config, ours + "mlp.", p, pattern[2 * i + 1]))
        return out

    def _give_mlp(self, state: dict, config: ModelConfig, ours: str, p: str, symbol: str) -> dict:
        gate, up = state[ours + "linear_fc1.weight"].chunk(2)
        return {
            p + "feed_forward.gate_proj.weight": gate,
            p + "feed_forward.up_proj.weight": up,
            p + "feed_forward.down_proj.weight": state[ours + "linear_fc2.weight"],
        }


@dataclass(frozen=True)
class GraniteHybridAdapter(BambaAdapter):
    architecture: str = "GraniteMoeHybridForCausalLM"
    model_type: str = "granitemoehybrid"
    exports_moe: ClassVar[bool] = True
    exports_dense: ClassVar[bool] = True  # (Granite-4.0-H Micro has no experts)
    exports_granite: ClassVar[bool] = True
    exports_gemma: ClassVar[bool] = True  # (--embedding-multiplier, --softmax-scale only)
    exports_cohere: ClassVar[bool] = True  # (--logit-scale)
    final_norm: ClassVar[str] = "model.norm"
    mlp_norm: ClassVar[str] = "post_attention_layernorm"

    def model_config(self, hf: dict) -> ModelConfig:
        config = super().model_config(
            {**hf, "intermediate_size": hf.get("shared_intermediate_size", 1024)}
        )
        config.embedding_multiplier = float(hf.get("embedding_multiplier", 1.0))
        config.softmax_scale = float(hf.get("attention_multiplier", 1.0))
        config.residual_multiplier = float(hf.get("residual_multiplier", 1.0))
        config.logit_scale = 1.0 / float(hf.get("logits_scaling", 1.0))
        if hf.get("num_local_experts"):  # GraniteMoe's routing: softmax over the top k
            config.num_experts = hf["num_local_experts"]
            config.moe_router_topk = hf["num_experts_per_tok"]
            config.moe_ffn_hidden_size = hf["intermediate_size"]
            config.moe_shared_expert_intermediate_size = config.ffn_hidden_size
            config.moe_aux_loss_coeff = hf.get("router_aux_loss_coef", 0.0)
            config.moe_token_dispatcher_type = "alltoall"
        return config

    def _mlp_symbol(self, hf: dict) -> str:
        return MOE if hf.get("num_local_experts") else MLP

    def _positions(self, hf: dict, rope: dict) -> dict:
        kind = hf.get("position_embedding_type")
        refuse(kind not in (None, "nope", "rope"), "position_embedding_type", kind, "rope or none")
        if kind != "rope":
            return {"position_embedding_type": "none"}
        return {
            "position_embedding_type": "rope",
            "rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        }

    def _own_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        shared = config.moe_shared_expert_intermediate_size
        return [
            (config.rotary_percent != 1.0, "RoPE on part of each head"),
            (
                config.is_moe and shared != config.ffn_hidden_size,
                "no shared MLP of --ffn-hidden-size",
            ),
            (config.is_moe and config.moe_router_pre_softmax, "--moe-router-pre-softmax"),
            (config.moe_router_score_function != "softmax", "--moe-router-score-function"),
        ]

    def _hf_layers(self, config: ModelConfig, mixers: str) -> dict:
        head = config.kv_channels or config.hidden_size // config.num_attention_heads
        rope = config.position_embedding_type == "rope"
        hf = {
            "layer_types": ["mamba" if m == MAMBA else "attention" for m in mixers],
            "shared_intermediate_size": config.ffn_hidden_size,
            "intermediate_size": config.moe_ffn_hidden_size or config.ffn_hidden_size,
            "num_local_experts": config.num_experts or 0,
            "num_experts_per_tok": config.moe_router_topk if config.is_moe else 1,
            "router_aux_loss_coef": config.moe_aux_loss_coeff if config.is_moe else 0.0,
            "position_embedding_type": "rope" if rope else None,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
            "embedding_multiplier": config.embedding_multiplier,
            "attention_multiplier": config.softmax_scale or 1 / math.sqrt(head),
            "residual_multiplier": config.residual_multiplier,
            "logits_scaling": 1.0 / config.logit_scale,
        }
        return hf

    def _take_mlp(self, take: Take, config: ModelConfig, ours: str, p: str, symbol: str) -> dict:
        out = {}
        if symbol == MOE:
            moe = p + "block_sparse_moe."
            fc1, fc2 = take(moe + "input_linear.weight"), take(moe + "output_linear.weight")
            out[ours + "router.weight"] = take(moe + "router.layer.weight")
            for e in range(config.num_experts):
                out[f"{ours}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
                out[f"{ours}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
            ours += "shared_experts."
        out[ours + "linear_fc1.weight"] = take(p + "shared_mlp.input_linear.weight")
        out[ours + "linear_fc2.weight"] = take(p + "shared_mlp.output_linear.weight")
        return out

    def _give_mlp(self, state: dict, config: ModelConfig, ours: str, p: str, symbol: str) -> dict:
        out = {}
        if symbol == MOE:
            experts = [f"{ours}experts.local_experts.{e}." for e in range(config.num_experts)]
            moe = p + "block_sparse_moe."
            for name, ours_name in (
                ("input_linear", "linear_fc1"),
                ("output_linear", "linear_fc2"),
            ):
                out[f"{moe}{name}.weight"] = torch.stack(
                    [state[e + ours_name + ".weight"] for e in experts]
                )
            out[moe + "router.layer.weight"] = state[ours + "router.weight"]
            ours += "shared_experts."
        out[p + "shared_mlp.input_linear.weight"] = state[ours + "linear_fc1.weight"]
        out[p + "shared_mlp.output_linear.weight"] = state[ours + "linear_fc2.weight"]
        return out


BAMBA = BambaAdapter()
GRANITE_HYBRID = GraniteHybridAdapter()
