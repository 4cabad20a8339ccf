"""DeepseekV3ForCausalLM: multi-latent attention and DeepSeek-V3's mixture of experts; and
DeepseekV32ForCausalLM, the same with DeepSeek sparse attention's indexer in every layer.

Attention (threefold's model/mla.py is megatron-core's MLA, whose tensors these are):

    HF self_attn.                  threefold self_attention.
    q_a_proj, q_a_layernorm,       linear_q_down_proj, q_layernorm, linear_q_up_proj
      q_b_proj                       (or q_proj = linear_q_proj without a query latent)
    kv_a_proj_with_mqa             linear_kv_down_proj  ([kv latent; shared RoPE key] rows)
    kv_a_layernorm, kv_b_proj      kv_layernorm, linear_kv_up_proj  ([key; value] per head)
    o_proj                         linear_proj

The latent norms are --qk-layernorm's (megatron-core's MLA has them only then). RoPE is the
same: with rope_interleave (DeepSeek-V3's) transformers turns the even dimensions, then the
odd ones, as halves, as megatron-core's MLA does; YaRN keeps megatron-core's original context
4096 and betas 32/1, with the factor and temperature of --rotary-scaling-factor, --mscale and
--mscale-all-dim (the softmax scale YaRN's temperature squared, on both sides).

The MoE layers (after first_k_dense_replace dense ones: --moe-layer-freq) route as
--moe-router-score-function sigmoid with --moe-router-enable-expert-bias
(e_score_correction_bias), in n_group groups of which topk_group are kept
(--moe-router-num-groups, --moe-router-group-topk; transformers scores a group by its top 2
experts, megatron-core by its top k / group-topk: they must agree), the k probabilities
renormalized (norm_topk_prob, megatron-core's for k > 1) and times routed_scaling_factor
(--moe-router-topk-scaling-factor). The n_shared_experts shared experts are one MLP of
n_shared_experts x moe_intermediate_size (--moe-shared-expert-intermediate-size).

The multi-token prediction layers DeepSeek-V3's Hub checkpoints carry after the decoder's
(num_nextn_predict_layers of them: model.layers.61 of DeepSeek-V3's 61, as GLM-4.5's 92 of 92)
are threefold's depths (--mtp-num-layers, model/mtp.py): each a decoder layer of the last
layer's kind, with its enorm, hnorm, eh_proj and shared_head.norm (the depth's final norm), and
copies of the model's embedding and output layer (embed_tokens, shared_head.head), which
megatron-core's depths share: a copy that differs is refused. transformers computes none of
them; vLLM's DeepSeek MTP computes what megatron-core's depth does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take, TensorSource, refuse, refuse_other_values, renamed
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.moe import MoEAdapter
from threefold.checkpoint.hf.mtp_layers import give_mtp_depths, mtp_depths, take_mtp_depths
from threefold.config import ModelConfig
from threefold.config.mla import (
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
)

DEEPSEEK_V3_NAME = "DeepseekV3ForCausalLM"
# transformers' DeepSeek-V3 router scores a group of experts by its best two.
GROUP_SCORE_EXPERTS = 2
# transformers' MLA latent norms (q_a_layernorm, kv_a_layernorm): RMSNorm's default epsilon,
# whatever rms_norm_eps says
LATENT_NORM_EPSILON = 1e-6


def _attention_names(i: int, q_lora: bool) -> dict[str, str]:
    """threefold name suffix -> HF name for one layer's attention and norms."""
    p = f"model.layers.{i}."
    names = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "self_attention.linear_kv_down_proj.weight": p + "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": p + "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": p + "self_attn.kv_b_proj.weight",
        "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
    }
    if q_lora:
        names.update(
            {
                "self_attention.linear_q_down_proj.weight": p + "self_attn.q_a_proj.weight",
                "self_attention.q_layernorm.weight": p + "self_attn.q_a_layernorm.weight",
                "self_attention.linear_q_up_proj.weight": p + "self_attn.q_b_proj.weight",
            }
        )
    else:
        names["self_attention.linear_q_proj.weight"] = p + "self_attn.q_proj.weight"
    return names


def _shared_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}.mlp.shared_experts."
    return {"mlp.shared_experts.linear_fc2.weight": p + "down_proj.weight"}


def _rope_fields(hf: dict) -> dict:
    """threefold's MLA RoPE fields of a DeepSeek-V3 config (plain RoPE, or megatron-core's
    YaRN)."""
    parameters = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    refuse(
        rope_type not in ("default", "yarn"),
        "rope_parameters.rope_type",
        rope_type,
        "multi-latent attention takes plain RoPE or YaRN",
    )
    if rope_type == "default":
        return {"rotary_base": theta, "rope_type": "rope"}
    fixed = {
        "original_max_position_embeddings": YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
        "beta_fast": YARN_BETA_FAST,
        "beta_slow": YARN_BETA_SLOW,
        "truncate": True,
    }
    refuse_other_values(
        parameters, fixed, "rope_parameters", "megatron-core's MLA YaRN has {} {} (DeepSeek-V3's)"
    )
    refuse(
        parameters.get("attention_factor") is not None,
        "rope_parameters.attention_factor",
        parameters.get("attention_factor"),
        "MLA's YaRN scales by mscale / mscale_all_dim, not a factor of its own",
    )
    return {
        "rotary_base": theta,
        "rope_type": "yarn",
        "rotary_scaling_factor": float(parameters["factor"]),
        "mscale": float(parameters.get("mscale") or 1.0),
        "mscale_all_dim": float(parameters.get("mscale_all_dim") or 0.0),
    }


def deepseek_experts(hf: dict, family: str) -> dict:
    """The experts' fields both DeepSeek routings share: first_k_dense_replace dense layers,
    then n_routed_experts of moe_intermediate_size beside n_shared_experts shared ones (one MLP
    of their sizes together). Empty when every layer is dense."""
    layers = hf["num_hidden_layers"]
    dense = min(hf.get("first_k_dense_replace") or 0, layers)
    if dense == layers:
        return {}
    shared = hf.get("n_shared_experts") or 0
    refuse(shared < 1, "n_shared_experts", shared, f"{family}'s routing comes with a shared expert")
    pattern = [int(i >= dense) for i in range(layers)]
    return {
        "num_experts": hf["n_routed_experts"],
        "moe_router_topk": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"],
        "moe_shared_expert_intermediate_size": shared * hf["moe_intermediate_size"],
        "moe_layer_freq": "1" if all(pattern) else str(pattern).replace(" ", ""),
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
    }


def deepseek_moe(hf: dict) -> dict:
    """The mixture-of-experts fields of a DeepSeek-V3-routed config (DeepSeek-V3's, GLM-4.5's):
    `deepseek_experts`, routed by sigmoid scores with expert biases, in groups, renormalized
    and scaled. Empty when every layer is dense (DeepSeek-V2-Lite-like: no experts)."""
    experts = deepseek_experts(hf, "DeepSeek-V3")
    if not experts:
        return {}
    k = hf["num_experts_per_tok"]
    groups, kept = hf.get("n_group") or 1, hf.get("topk_group") or 1
    refuse(
        groups > 1 and k // kept != GROUP_SCORE_EXPERTS,
        "n_group/topk_group",
        (groups, kept),
        f"transformers scores a group by its top {GROUP_SCORE_EXPERTS} experts, "
        f"megatron-core by its top num_experts_per_tok / topk_group ({k // kept} here)",
    )
    refuse(
        bool(hf.get("norm_topk_prob", True)) != (k > 1),
        "norm_topk_prob",
        hf.get("norm_topk_prob"),
        "megatron-core renormalizes sigmoid top-k probabilities exactly when k > 1",
    )
    return {
        **experts,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": kept if groups > 1 else None,
        "moe_router_topk_scaling_factor": hf.get("routed_scaling_factor") or None,
    }


@dataclass(frozen=True)
class DeepSeekV3Adapter(MoEAdapter):
    exports_mla = True
    exports_mtp = True  # (the Hub's layers after the decoder's)
    deepseek_routing = True
    expert_score_bias: ClassVar[bool] = True  # e_score_correction_bias (not DeepSeek-V2's)
    # transformers scores a group by its top experts (DeepSeek-V2's: by its best one)
    group_score_experts: ClassVar[int] = GROUP_SCORE_EXPERTS

    def model_config(self, hf: dict) -> ModelConfig:
        for field, value, wanted, why in (
            ("hidden_act", hf.get("hidden_act", "silu"), "silu", "SwiGLU with SiLU only"),
            ("attention_bias", bool(hf.get("attention_bias")), False, "MLA has no biases"),
            ("pretraining_tp", hf.get("pretraining_tp", 1), 1, "must be 1"),
            (
                "rope_interleave",
                hf.get("rope_interleave", True),
                True,
                "megatron-core's MLA turns the even, then the odd dimensions (interleaved)",
            ),
            (
                "rms_norm_eps",
                hf.get("rms_norm_eps", LATENT_NORM_EPSILON),
                LATENT_NORM_EPSILON,
                f"transformers' latent norms have epsilon {LATENT_NORM_EPSILON}, and threefold's "
                "every norm one epsilon",
            ),
        ):
            refuse(value != wanted, field, value, why)
        layers = hf["num_hidden_layers"]
        heads = hf["num_attention_heads"]
        positions = hf.get("max_position_embeddings", 4096)
        config = ModelConfig(
            num_layers=layers,
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            seq_length=min(positions, 4096),
            max_position_embeddings=positions,
            position_embedding_type="rope",
            **_rope_fields(hf),
            normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            add_bias_linear=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
            multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_head_dim=hf["qk_nope_head_dim"],
            qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            qk_layernorm=True,  # the latent norms
        )
        for name, value in self.moe_fields(hf).items():
            setattr(config, name, value)
        config.mtp_num_layers = mtp_depths(hf)
        return config

    def moe_fields(self, hf: dict) -> dict:
        """The mixture-of-experts fields of the config (`deepseek_moe`'s routing)."""
        return deepseek_moe(hf)

    def _dense_layers(self, config: ModelConfig) -> int:
        """first_k_dense_replace: the dense layers before the first MoE one (all without
        experts)."""
        if not config.is_moe:
            return config.num_layers
        pattern = self._pattern(config)
        return pattern.index(1) if 1 in pattern else len(pattern)

    def check_exportable(self, config: ModelConfig) -> None:
        latent_norms = (
            config.multi_latent_attention and config.norm_epsilon != LATENT_NORM_EPSILON,
            f"latent norms of epsilon {config.norm_epsilon} (transformers' are "
            f"{LATENT_NORM_EPSILON} whatever rms_norm_eps says: --norm-epsilon "
            f"{LATENT_NORM_EPSILON})",
        )
        problems = self.attention_problems(config) + self.routing_problems(config)
        self.refuse_problems([*problems, latent_norms])

    def attention_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        """(whether, what) of what the architecture's attention cannot express."""
        return [
            (not config.multi_latent_attention, "attention other than multi-latent"),
            (
                config.sparse_attention and self.architecture == DEEPSEEK_V3_NAME,
                "DeepSeek sparse attention (DeepseekV32ForCausalLM has it)",
            ),
            (not config.qk_layernorm, "latents without norms (train with --qk-layernorm)"),
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (config.add_bias_linear, "biases on the linear layers"),
            (config.position_embedding_type != "rope", "position embeddings besides MLA's RoPE"),
        ]

    def routing_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        """(whether, what) of what the architecture's routing cannot express."""
        if not config.is_moe:
            return []
        k, dense = config.moe_router_topk, self._dense_layers(config)
        shared = config.moe_shared_expert_intermediate_size or 0
        groups, scored_by = config.moe_router_num_groups, self.group_score_experts
        return [
            *self.score_problems(config),
            (not all(self._pattern(config)[dense:]), "dense layers after MoE ones"),
            (
                shared == 0 or shared % config.moe_ffn_hidden_size,
                "no shared expert of a multiple of --moe-ffn-hidden-size",
            ),
            (
                groups and k // config.moe_router_group_topk != scored_by,
                f"groups not scored by their top {scored_by} experts "
                "(--moe-router-topk / --moe-router-group-topk)",
            ),
        ]

    def score_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        """(whether, what) of the routing scores the architecture cannot express."""
        return [(config.moe_router_score_function != "sigmoid", "softmax routing scores")]

    def hf_config(self, config: ModelConfig) -> dict:
        rope = {"rope_type": "default", "rope_theta": config.rotary_base}
        if config.mla_yarn and config.rotary_scaling_factor != 1.0:
            rope = {
                "rope_type": "yarn",
                "rope_theta": config.rotary_base,
                "factor": config.rotary_scaling_factor,
                "original_max_position_embeddings": YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
                "beta_fast": YARN_BETA_FAST,
                "beta_slow": YARN_BETA_SLOW,
                "mscale": config.mscale,
                "mscale_all_dim": config.mscale_all_dim,
            }
        return {
            **self.common_hf_config(config),
            **self.routing_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_attention_heads,
            "kv_lora_rank": config.kv_lora_rank,
            "q_lora_rank": config.q_lora_rank,
            "qk_rope_head_dim": config.qk_pos_emb_head_dim,
            "qk_nope_head_dim": config.qk_head_dim,
            "v_head_dim": config.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "rope_parameters": rope,
            "rope_interleave": True,
            "attention_bias": False,
            "attention_dropout": config.attention_dropout,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "num_nextn_predict_layers": config.mtp_depths_built(),
        }

    def routing_hf_config(self, config: ModelConfig) -> dict:
        """The routing fields of the config transformers reads."""
        # A dense model: one expert of the dense MLP's size, which no layer builds.
        expert_size = config.moe_ffn_hidden_size or config.ffn_hidden_size
        shared = config.moe_shared_expert_intermediate_size or expert_size
        groups = config.moe_router_num_groups
        k = config.moe_router_topk if config.is_moe else 1
        return {
            "moe_intermediate_size": expert_size,
            "n_shared_experts": shared // expert_size,
            "n_routed_experts": config.num_experts or 1,
            "routed_scaling_factor": config.moe_router_topk_scaling_factor or 1.0,
            "n_group": groups or 1,
            "topk_group": config.moe_router_group_topk if groups else 1,
            "num_experts_per_tok": k,
            "first_k_dense_replace": self._dense_layers(config),
            "norm_topk_prob": k > 1,
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = LlamaAdapter.take_weights(self, take, config, used)
        return out | take_mtp_depths(self, take, config, out)

    def depth_marker(self, config: ModelConfig, k: int) -> str:
        return f"model.layers.{config.num_layers + k}.eh_proj.weight"

    def take_layer(self, take: Take, config: ModelConfig, i: int) -> dict:
        out = renamed(_attention_names(i, config.q_lora_rank is not None), i, take, to_hf=False)
        return out | self.take_mlp(take, config, i)

    def _moe_layer(self, config: ModelConfig, i: int) -> bool:
        return config.is_moe and self._moe_at(config, i)

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        if not self._moe_layer(config, i):
            return LlamaAdapter.take_mlp(self, take, config, i)
        out = super().take_mlp(take, config, i)
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}.mlp."
        if self.expert_score_bias:
            bias = take(p + "gate.e_score_correction_bias").float()
            out[ours + "mlp.router.expert_bias"] = bias
        out.update(renamed(_shared_names(i), i, take, to_hf=False))
        shared = [take(p + "shared_experts.gate_proj.weight")]
        shared.append(take(p + "shared_experts.up_proj.weight"))
        out[ours + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(shared)
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = LlamaAdapter.give_weights(self, state, config)
        return out | give_mtp_depths(self, state, config)

    def give_layer(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        q_lora = config.q_lora_rank is not None
        out = renamed(_attention_names(i, q_lora), i, state.__getitem__, to_hf=True)
        return out | self.give_mlp(state, config, i)

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        if not self._moe_layer(config, i):
            return LlamaAdapter.give_mlp(self, state, config, i)
        out = super().give_mlp(state, config, i)
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}.mlp."
        if self.expert_score_bias:
            bias = state.get(ours + "mlp.router.expert_bias")
            if bias is None:  # routed without one: transformers' buffer of zeros
                bias = torch.zeros(config.num_experts)
            out[p + "gate.e_score_correction_bias"] = bias.float()
        out.update(renamed(_shared_names(i), i, state.__getitem__, to_hf=True))
        gate, up = state[ours + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
        out.update(
            {p + "shared_experts.gate_proj.weight": gate, p + "shared_experts.up_proj.weight": up}
        )
        return out


DEEPSEEK_V3 = DeepSeekV3Adapter(DEEPSEEK_V3_NAME, "deepseek_v3", writes_biases=False)


# The indexer's tensors: threefold's (megatron-core's) name under
# self_attention.core_attention.indexer. -> transformers' under self_attn.indexer.
_INDEXER = {
    "linear_wq_b.weight": "wq_b.weight",
    "linear_wk.weight": "wk.weight",
    "k_norm.weight": "k_norm.weight",
    "k_norm.bias": "k_norm.bias",
    "linear_weights_proj.weight": "weights_proj.weight",
}
# transformers' (and DeepSeek's) indexer key norm: a LayerNorm of epsilon 1e-6, whatever
# rms_norm_eps says
INDEXER_K_NORM_EPSILON = 1e-6


def _indexer_names(i: int) -> dict[str, str]:
    return {
        f"self_attention.core_attention.indexer.{ours}": f"model.layers.{i}.self_attn.indexer.{hf}"
        for ours, hf in _INDEXER.items()
    }


@dataclass(frozen=True)
class DeepSeekV32Adapter(DeepSeekV3Adapter):
    """DeepseekV32ForCausalLM: DeepSeek-V3's model whose attention is DeepSeek sparse attention
    (threefold's --experimental-attention-variant dsa, model/dsa.py): index_n_heads heads of
    index_head_dim picking index_topk keys, RoPE on their first dimensions as halves. Its
    Hadamard rotation, which transformers leaves out, changes no score."""

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(not hf.get("q_lora_rank"), "q_lora_rank", hf.get("q_lora_rank"), "must be set")
        layers = hf["num_hidden_layers"]
        dense = min(hf.get("first_k_dense_replace") or 0, layers)
        mlp_types = hf.get("mlp_layer_types")
        refuse(
            mlp_types not in (None, ["dense"] * dense + ["sparse"] * (layers - dense)),
            "mlp_layer_types",
            mlp_types,
            "must be first_k_dense_replace dense layers, then MoE ones",
        )
        attention_types = set(hf.get("layer_types") or ["indexed_attention"])
        refuse(
            attention_types != {"indexed_attention"},
            "layer_types",
            sorted(attention_types),
            "every layer's attention is DeepSeek sparse attention",
        )
        config = super().model_config(hf)
        config.experimental_attention_variant = "dsa"
        config.dsa_indexer_n_heads = hf["index_n_heads"]
        config.dsa_indexer_head_dim = hf["index_head_dim"]
        config.dsa_indexer_topk = hf["index_topk"]
        config.dsa_indexer_k_norm_epsilon = INDEXER_K_NORM_EPSILON
        # (sparse attention beside multi-token prediction is not built: the Hub's layer after
        # the decoder's is left out, said, as all such layers were before 2026-12-05)
        config.mtp_num_layers = None
        return config

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = super().take_weights(take, config, used)
        if isinstance(take, TensorSource):
            after = re.compile(r"model\.layers\.(\d+)\.")
            left = [
                n for n in take.state if (m := after.match(n)) and int(m[1]) >= config.num_layers
            ]
            if left:
                print(
                    f"> the Hub's multi-token prediction layers (model.layers.{config.num_layers} "
                    "on) are left out: DeepSeek sparse attention beside them is not built here"
                )
            used.update(left)
        return out

    def check_exportable(self, config: ModelConfig) -> None:
        problems = [
            (not config.sparse_attention, "attention other than DeepSeek sparse attention"),
            (config.q_lora_rank is None, "queries without a latent (--q-lora-rank)"),
            (config.dsa_indexer_rope_interleaved, "the indexer's RoPE turned MLA's way"),
            (
                (config.dsa_indexer_k_norm_epsilon or config.norm_epsilon)
                != INDEXER_K_NORM_EPSILON,
                f"an indexer key norm of epsilon other than {INDEXER_K_NORM_EPSILON} "
                "(--dsa-indexer-k-norm-epsilon)",
            ),
        ]
        self.refuse_problems(problems)
        super().check_exportable(config)

    def hf_config(self, config: ModelConfig) -> dict:
        return {
            **super().hf_config(config),
            "index_n_heads": config.dsa_indexer_n_heads,
            "index_head_dim": config.dsa_indexer_head_dim,
            "index_topk": config.dsa_indexer_topk,
        }

    def take_layer(self, take: Take, config: ModelConfig, i: int) -> dict:
        return super().take_layer(take, config, i) | renamed(
            _indexer_names(i), i, take, to_hf=False
        )

    def give_layer(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        return super().give_layer(state, config, i) | renamed(
            _indexer_names(i), i, state.__getitem__, to_hf=True
        )


DEEPSEEK_V32 = DeepSeekV32Adapter("DeepseekV32ForCausalLM", "deepseek_v32", writes_biases=False)
