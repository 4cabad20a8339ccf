"""NemotronHForCausalLM (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano and Super): NVIDIA's
hybrid models trained with Megatron-LM, each layer one of Mamba-2, attention, MLP or mixture
of experts, as threefold's --hybrid-layer-pattern builds them (config/hybrid.py):

    layers_block_type   linear_attention  full_attention  mlp  moe
    pattern symbol      M                 *               -    E

(older configs: hybrid_override_pattern, the symbols themselves). Every layer is a norm and
its mixer, named `{backbone,model}.layers.N.norm` and `.mixer` in the files (transformers
saves the Hub's `backbone.`, and reads both). The Mamba mixer maps as it is (in_proj's rows
[z; x; B; C; dt] and the convolution's [x; B; C] are megatron-core's order too); attention has
no position embeddings (--position-embedding-type none) and q, k, v apart, fused into
threefold's grouped linear_qkv; MLPs and experts are one projection and a squared ReLU
(--squared-relu); the experts are routed by DeepSeek-V3's sigmoid scores with expert biases
(hf/deepseek.py), beside a shared expert of its own size; Nemotron 3 Super's experts work at
`moe_latent_size` between two projections (--moe-latent-size).

Nemotron 3 Super's multi-token prediction module (`num_nextn_predict_layers` depths of the
layers `mtp_layers_block_type`, or the older `mtp_hybrid_override_pattern`, names) is each depth
of threefold's hybrid pattern after `/` (model/mtp.py), the Hub numbering the depths' layers on
from one `mtp.layers.{i}` list: a depth's first layer holds its `enorm`, `hnorm` and `eh_proj`,
its last the `final_layernorm`, each its `norm` and `mixer` as a decoder layer does.
transformers builds no such module and ignores these tensors; vLLM's NemotronH-MTP computes
them as megatron-core's depth does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Adapter, Take, refuse
from threefold.checkpoint.hf.deepseek import deepseek_moe
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

KINDS = {
    "linear_attention": MAMBA,
    "full_attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
    "mamba": MAMBA,  # (the older names transformers still reads)
    "attention": ATTENTION,
}
# Nemotron 3 Super's latent experts' projections (moe_latent_size): megatron-core's names too
LATENT_PROJECTIONS = ("fc1_latent_proj", "fc2_latent_proj")
NAMES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", MOE: "moe"}
# the older config names of fields (transformers reads both)
# the Mamba settings' names in NemotronH's config
NAMES_OF_SETTINGS = MambaNames(
    eps="layer_norm_epsilon",
    conv="conv_kernel",
    conv_bias="use_conv_bias",
    bias="use_bias",
    state="ssm_state_size",
    head_dim="mamba_head_dim",
    groups="n_groups",
    heads="mamba_num_heads",
)
_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_limit": "time_step_limit",
}


# transformers' default depth (NemotronHConfig's mtp_layers_block_type)
_MTP_DEFAULT = ("full_attention", "moe")


def _mtp_pattern(hf: dict) -> str:
    """The multi-token prediction depths as the pattern's `/` parts ("": none). As
    transformers reads them: the older `mtp_hybrid_override_pattern` unless
    `mtp_layers_block_type` says otherwise than its default (an attention and an expert
    layer)."""
    depths = hf.get("num_nextn_predict_layers") or 0
    if not depths:
        return ""
    kinds = hf.get("mtp_layers_block_type") or list(_MTP_DEFAULT)
    depth = _pattern({"layers_block_type": kinds})
    if hf.get("mtp_hybrid_override_pattern") and kinds == list(_MTP_DEFAULT):
        depth = hf["mtp_hybrid_override_pattern"]
    return "/" + "/".join([depth] * depths)


def _pattern(hf: dict) -> str:
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        return hf["hybrid_override_pattern"]
    unknown = sorted(set(kinds) - set(KINDS))
    refuse(unknown, "layers_block_type", unknown, f"one of {', '.join(NAMES.values())}")
    return "".join(KINDS[kind] for kind in kinds)


@dataclass(frozen=True)
class NemotronHAdapter(Adapter):
    architecture: str = "NemotronHForCausalLM"
    model_type: str = "nemotron_h"
    exports_hybrid: ClassVar[bool] = True
    exports_mtp: ClassVar[bool] = True
    exports_moe: ClassVar[bool] = True
    exports_dense: ClassVar[bool] = True  # (most Nemotron-H models have no experts)
    deepseek_routing: ClassVar[bool] = True
    squared_relu_mlp: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        hf = {_ALIASES.get(name, name): value for name, value in hf.items()}
        check_mamba(hf, NAMES_OF_SETTINGS)
        for field, value, wanted, why in (
            ("mamba_hidden_act", hf.get("mamba_hidden_act", "silu"), "silu", "SiLU only"),
            ("mlp_hidden_act", hf.get("mlp_hidden_act", "relu2"), "relu2", "ReLU² only"),
            ("mamba_proj_bias", bool(hf.get("mamba_proj_bias")), False, "no biases there"),
            ("residual_in_fp32", bool(hf.get("residual_in_fp32")), False, "residuals as is"),
            ("sliding_window", hf.get("sliding_window"), None, "attention over all keys"),
            (
                "tie_word_embeddings",
                bool(hf.get("tie_word_embeddings")),
                False,
                "transformers never ties NemotronH's output layer",
            ),
        ):
            refuse(value != wanted, field, value, why)
        pattern = _pattern(hf) + _mtp_pattern(hf)
        config = ModelConfig(
            **hybrid_fields(hf, NAMES_OF_SETTINGS, pattern),
            ffn_hidden_size=hf["intermediate_size"],
            position_embedding_type="none",
            swiglu=False,
            squared_relu=True,
            untie_embeddings_and_output_weights=True,
        )
        if MOE in pattern:
            routing = {**hf, "num_hidden_layers": len(pattern), "n_shared_experts": 1}
            fields = deepseek_moe(routing)
            fields.update(
                moe_layer_freq="1",  # (the pattern's E layers)
                moe_shared_expert_intermediate_size=hf["moe_shared_expert_intermediate_size"],
                moe_latent_size=hf.get("moe_latent_size"),
            )
            for name, value in fields.items():
                setattr(config, name, value)
        return config

    def depth_marker(self, config: ModelConfig, k: int) -> str:
        return f"mtp.layers.{k * len(config.hybrid_mtp_layers())}.eh_proj.weight"

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        shared = config.moe_shared_expert_intermediate_size
        problems = [
            (not config.hybrid, "a model without --hybrid-layer-pattern"),
            (
                not config.untie_embeddings_and_output_weights,
                "tied embeddings (transformers' NemotronH never ties its output layer)",
            ),
            (config.normalization != "RMSNorm", f"--normalization {config.normalization}"),
            (not config.squared_relu or config.gated_linear_unit, "an MLP other than ReLU²"),
            (config.add_bias_linear or config.add_qkv_bias, "biases"),
            (config.position_embedding_type != "none", "position embeddings"),
            (config.norm_epsilon != GATED_NORM_EPS, f"--norm-epsilon {config.norm_epsilon}"),
            (config.is_moe and not shared, "experts without a shared expert"),
            (
                config.is_moe and config.moe_router_score_function != "sigmoid",
                "softmax routing scores",
            ),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        pattern = config.hybrid_layers()
        hf = {
            **self.common_hf_config(config),
            "layers_block_type": [NAMES[symbol] for symbol in pattern],
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "head_dim": config.kv_channels,
            "max_position_embeddings": config.max_position_embeddings,
            "layer_norm_epsilon": config.norm_epsilon,
            "tie_word_embeddings": False,
            "attention_dropout": config.attention_dropout,
            "mlp_hidden_act": "relu2",
            "ssm_state_size": config.mamba_state_dim,
            "mamba_head_dim": config.mamba_head_dim,
            "mamba_num_heads": config.mamba_heads(),
            "n_groups": config.mamba_num_groups,
            "conv_kernel": MAMBA_CONV_KERNEL,
            "use_conv_bias": True,
            "use_bias": False,
            "residual_in_fp32": False,
            # (the depths built: under --mtp-use-repeated-layer one, as Nemotron 3 Super's)
            "num_nextn_predict_layers": config.mtp_depths_built(),
            "mtp_layers_block_type": [NAMES[symbol] for symbol in config.hybrid_mtp_layers()]
            or None,
        }
        if config.is_moe:
            groups = config.moe_router_num_groups
            hf.update(
                n_routed_experts=config.num_experts,
                num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                n_shared_experts=1,
                n_group=groups or 1,
                topk_group=config.moe_router_group_topk if groups else 1,
                norm_topk_prob=config.moe_router_topk > 1,
                routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
                moe_latent_size=config.moe_latent_size,
            )
        return hf

    @staticmethod
    def _prefix(take: Take) -> str:
        return "model." if "model.embeddings.weight" in take else "backbone."

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        b = self._prefix(take)
        out = {
            "embedding.word_embeddings.weight": take(b + "embeddings.weight"),
            "decoder.final_layernorm.weight": take(b + "norm_f.weight"),
        }
        out["output_layer.weight"] = take("lm_head.weight")
        for i, symbol in enumerate(config.hybrid_layers()):
            out.update(
                self._take_layer(take, config, symbol, f"decoder.layers.{i}.", f"{b}layers.{i}.")
            )
        out.update({ours: take(theirs) for ours, theirs in _mtp_names(config).items()})
        for ours, p, symbol in _mtp_layers(config):
            out.update(self._take_layer(take, config, symbol, ours, p))
        return out

    def _take_layer(self, take: Take, config: ModelConfig, symbol: str, ours: str, p: str) -> dict:
        """A layer of the stack (`ours`: threefold's prefix, `p` the file's)."""
        if symbol == MAMBA:
            return take_mamba(take, ours, p + "norm.weight", p + "mixer.")
        if symbol == ATTENTION:
            return take_attention(take, config, ours, p + "norm.weight", p + "mixer.")
        out = {ours + "pre_mlp_layernorm.weight": take(p + "norm.weight")}
        p, ours = p + "mixer.", ours + "mlp."
        mlp = p
        if symbol == MOE:
            out.update(self._take_experts(take, config, ours, p))
            ours, mlp = ours + "shared_experts.", p + "shared_experts."
        out[ours + "linear_fc1.weight"] = take(mlp + "up_proj.weight")
        out[ours + "linear_fc2.weight"] = take(mlp + "down_proj.weight")
        return out

    @staticmethod
    def _take_experts(take: Take, config: ModelConfig, ours: str, p: str) -> dict:
        out = {
            ours + "router.weight": take(p + "gate.weight"),
            ours + "router.expert_bias": take(p + "gate.e_score_correction_bias").float(),
        }
        if config.moe_latent_size:
            for name in LATENT_PROJECTIONS:
                out[f"{ours}{name}.weight"] = take(f"{p}{name}.weight")
        stacked = p + "experts.up_proj" in take  # (transformers' in-memory layout)
        if stacked:
            up, down = take(p + "experts.up_proj"), take(p + "experts.down_proj")
        for e in range(config.num_experts):
            expert = f"{ours}experts.local_experts.{e}."
            if stacked:
                fc1, fc2 = up[e], down[e]
            else:
                fc1, fc2 = (take(f"{p}experts.{e}.{x}_proj.weight") for x in ("up", "down"))
            out[expert + "linear_fc1.weight"], out[expert + "linear_fc2.weight"] = fc1, fc2
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        b = "backbone."  # (the Hub's files, as transformers saves them)
        out = {
            b + "embeddings.weight": state["embedding.word_embeddings.weight"],
            b + "norm_f.weight": state["decoder.final_layernorm.weight"],
        }
        out["lm_head.weight"] = state["output_layer.weight"]
        for i, symbol in enumerate(config.hybrid_layers()):
            out.update(
                self._give_layer(state, config, symbol, f"decoder.layers.{i}.", f"{b}layers.{i}.")
            )
        out.update({theirs: state[ours] for ours, theirs in _mtp_names(config).items()})
        for ours, p, symbol in _mtp_layers(config):
            out.update(self._give_layer(state, config, symbol, ours, p))
        return out

    def _give_layer(self, state: dict, config: ModelConfig, symbol: str, ours: str, p: str) -> dict:
        """`_take_layer`'s inverse."""
        if symbol == MAMBA:
            return give_mamba(state, ours, p + "norm.weight", p + "mixer.")
        if symbol == ATTENTION:
            return give_attention(state, config, ours, p + "norm.weight", p + "mixer.")
        out = {p + "norm.weight": state[ours + "pre_mlp_layernorm.weight"]}
        p, ours = p + "mixer.", ours + "mlp."
        mlp = ours
        if symbol == MOE:
            out.update(self._give_experts(state, config, ours, p))
            mlp, p = ours + "shared_experts.", p + "shared_experts."
        out[p + "up_proj.weight"] = state[mlp + "linear_fc1.weight"]
        out[p + "down_proj.weight"] = state[mlp + "linear_fc2.weight"]
        return out

    @staticmethod
    def _give_experts(state: dict, config: ModelConfig, ours: str, p: str) -> dict:
        bias = state.get(ours + "router.expert_bias")
        out = {
            p + "gate.weight": state[ours + "router.weight"],
            p + "gate.e_score_correction_bias": (
                torch.zeros(config.num_experts) if bias is None else bias.float()
            ),
        }
        if config.moe_latent_size:
            for name in LATENT_PROJECTIONS:
                out[f"{p}{name}.weight"] = state[f"{ours}{name}.weight"]
        for e in range(config.num_experts):
            expert = f"{ours}experts.local_experts.{e}."
            out[f"{p}experts.{e}.up_proj.weight"] = state[expert + "linear_fc1.weight"]
            out[f"{p}experts.{e}.down_proj.weight"] = state[expert + "linear_fc2.weight"]
        return out


def _mtp_layers(config: ModelConfig) -> list[tuple[str, str, str]]:
    """(threefold's prefix, the file's, the symbol) of each built depth's layers: the Hub
    numbers them on across the depths."""
    depth = config.hybrid_mtp_layers()
    return [
        (f"mtp.layers.{k}.mtp_model_layer.layers.{j}.", f"mtp.layers.{k * len(depth) + j}.", symbol)
        for k in range(config.mtp_depths_built())
        for j, symbol in enumerate(depth)
    ]


def _mtp_names(config: ModelConfig) -> dict[str, str]:
    """threefold's name -> the file's of each depth's projection and norms: enorm, hnorm and
    eh_proj on its first layer, the final norm on its last."""
    count, names = len(config.hybrid_mtp_layers()), {}
    for k in range(config.mtp_depths_built()):
        first, last = f"mtp.layers.{k * count}.", f"mtp.layers.{(k + 1) * count - 1}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            names[f"mtp.layers.{k}.{name}"] = first + name
        names[f"mtp.layers.{k}.final_layernorm.weight"] = last + "final_layernorm.weight"
    return names


NEMOTRON_H = NemotronHAdapter()
