"""Mixtures of experts of the LLaMA family: MixtralForCausalLM, Qwen3MoeForCausalLM and
Qwen2MoeForCausalLM.

Attention, norms and embeddings are the LLaMA adapter's; the MLP of an MoE layer is a router
(HF `gate.weight` = threefold's `mlp.router.weight`, [experts, hidden]) and experts stored one
by one, as the Hub and `save_pretrained` store them (transformers 5's in-memory state dict,
with the experts stacked in `mlp.experts.gate_up_proj` / `down_proj`, is read too):

    Mixtral     block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
    Qwen3-MoE   mlp.experts.{e}.gate_proj, up_proj, down_proj
    threefold   mlp.experts.local_experts.{e}.linear_fc1 = [gate; up], linear_fc2 = down

Routing: both take the softmax over all experts and its top-k; Mixtral (and Qwen3-MoE with
norm_topk_prob) renormalizes the k probabilities, which is the softmax over the top-k logits
(threefold's default), and Qwen3-MoE without it keeps them (--moe-router-pre-softmax).
Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) become --moe-layer-freq.

Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) routes as Qwen3-MoE, has Qwen2's attention
(biases on q, k and v: qkv_bias) and beside the experts a shared expert whose output a
sigmoid gate scales (`mlp.shared_expert.*` and `mlp.shared_expert_gate`: threefold's
`mlp.shared_experts` with --moe-shared-expert-gate, as Qwen3-Next's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take, refuse, refuse_router_jitter
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ModelConfig


@dataclass(frozen=True)
class MoEAdapter(LlamaAdapter):
    exports_moe: ClassVar[bool] = True
    moe_prefix: str = "mlp"  # the MoE block's name inside a layer
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    renormalizes_always: bool = True  # Mixtral; Qwen3-MoE says so in norm_topk_prob

    def model_config(self, hf: dict) -> ModelConfig:
        refuse_router_jitter(hf)
        refuse(
            bool(hf.get("shared_expert_intermediate_size")) and not self.gated_shared_expert,
            "shared_expert_intermediate_size",
            hf.get("shared_expert_intermediate_size"),
            "a gated shared expert is not implemented",
        )
        config = super().model_config(hf)
        layers = hf["num_hidden_layers"]
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        config.num_experts = hf.get("num_local_experts") or hf["num_experts"]
        config.moe_router_topk = hf["num_experts_per_tok"]
        config.moe_ffn_hidden_size = hf.get("moe_intermediate_size") or hf["intermediate_size"]
        config.moe_router_pre_softmax = not (
            self.renormalizes_always or hf.get("norm_topk_prob", False)
        )
        config.moe_aux_loss_coeff = hf.get("router_aux_loss_coef", 0.0)
        config.moe_layer_freq = "1" if all(pattern) else str(pattern).replace(" ", "")
        config.moe_token_dispatcher_type = "alltoall"
        if self.gated_shared_expert:
            config.moe_shared_expert_intermediate_size = hf["shared_expert_intermediate_size"]
            config.moe_shared_expert_gate = True
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (config.moe_router_score_function != "softmax", "--moe-router-score-function"),
            (
                self.renormalizes_always and config.moe_router_pre_softmax,
                "--moe-router-pre-softmax",
            ),
            (
                config.moe_shared_expert_intermediate_size and not self.gated_shared_expert,
                "--moe-shared-expert-intermediate-size",
            ),
            (
                self.gated_shared_expert and not config.moe_shared_expert_gate,
                "MoE layers without a gated shared expert (--moe-shared-expert-gate)",
            ),
            (
                config.add_bias_linear,
                "biases on the linear layers (train with --disable-bias-linear)",
            ),
            (
                self.renormalizes_always and not all(self._pattern(config)),
                "dense layers (--moe-layer-freq)",
            ),
        ]
        self.refuse_problems(problems)

    @staticmethod
    def _pattern(config: ModelConfig) -> list[int]:
        return config.moe_layer_pattern(config.num_layers)

    def _moe_at(self, config: ModelConfig, i: int) -> bool:
        """Whether the file's layer i holds experts: past the decoder's, a multi-token
        prediction depth's layer, of the last layer's kind as megatron-core builds it."""
        return bool(self._pattern(config)[min(i, config.num_layers - 1)])

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        pattern = self._pattern(config)
        hf.update(
            num_experts_per_tok=config.moe_router_topk,
            router_aux_loss_coef=config.moe_aux_loss_coeff,
            output_router_logits=False,
        )
        if self.renormalizes_always:  # Mixtral: every layer, one size for all MLPs
            hf.update(
                num_local_experts=config.num_experts,
                intermediate_size=config.moe_ffn_hidden_size,
                router_jitter_noise=0.0,
                sliding_window=None,
            )
        else:
            hf.update(
                num_experts=config.num_experts,
                moe_intermediate_size=config.moe_ffn_hidden_size,
                norm_topk_prob=not config.moe_router_pre_softmax,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
            )
        if self.gated_shared_expert:
            hf["shared_expert_intermediate_size"] = config.moe_shared_expert_intermediate_size
        return hf

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        if not self._moe_at(config, i):
            return super().take_mlp(take, config, i)
        out = self._take_experts(take, config, i)
        if self.gated_shared_expert:
            ours, p = f"decoder.layers.{i}.mlp.shared_experts.", f"model.layers.{i}.mlp."
            shared = [take(p + f"shared_expert.{x}_proj.weight") for x in ("gate", "up")]
            out[ours + "linear_fc1.weight"] = torch.cat(shared)
            out[ours + "linear_fc2.weight"] = take(p + "shared_expert.down_proj.weight")
            out[ours + "gate_weight"] = take(p + "shared_expert_gate.weight")
        return out

    def _take_experts(self, take: Take, config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{self.moe_prefix}."
        stacked = f"model.layers.{i}.mlp."
        if stacked + "experts.gate_up_proj" in take:  # transformers 5's own state dict
            out = {ours + "router.weight": take(stacked + "gate.weight")}
            fc1, fc2 = take(stacked + "experts.gate_up_proj"), take(stacked + "experts.down_proj")
            for e in range(config.num_experts):  # [gate; up] rows, as linear_fc1
                out[f"{ours}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
                out[f"{ours}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
            return out
        gate, up, down = self.expert_names
        out = {ours + "router.weight": take(p + "gate.weight")}
        for e in range(config.num_experts):
            theirs, expert = f"{p}experts.{e}.", f"{ours}experts.local_experts.{e}."
            fc1 = [take(f"{theirs}{gate}.weight"), take(f"{theirs}{up}.weight")]
            out[expert + "linear_fc1.weight"] = torch.cat(fc1)
            out[expert + "linear_fc2.weight"] = take(f"{theirs}{down}.weight")
        return out

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        if not self._moe_at(config, i):
            return super().give_mlp(state, config, i)
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{self.moe_prefix}."
        gate, up, down = self.expert_names
        out = {p + "gate.weight": state[ours + "router.weight"]}
        for e in range(config.num_experts):
            theirs, expert = f"{p}experts.{e}.", f"{ours}experts.local_experts.{e}."
            gate_weight, up_weight = state[expert + "linear_fc1.weight"].chunk(2)
            out[f"{theirs}{gate}.weight"] = gate_weight
            out[f"{theirs}{up}.weight"] = up_weight
            out[f"{theirs}{down}.weight"] = state[expert + "linear_fc2.weight"]
        if self.gated_shared_expert:
            ours, p = ours + "shared_experts.", f"model.layers.{i}.mlp."
            gate_weight, up_weight = state[ours + "linear_fc1.weight"].chunk(2)
            out[p + "shared_expert.gate_proj.weight"] = gate_weight
            out[p + "shared_expert.up_proj.weight"] = up_weight
            out[p + "shared_expert.down_proj.weight"] = state[ours + "linear_fc2.weight"]
            out[p + "shared_expert_gate.weight"] = state[ours + "gate_weight"]
        return out


MIXTRAL = MoEAdapter(
    "MixtralForCausalLM", "mixtral", moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2")
)
QWEN3_MOE = MoEAdapter(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    qk_norm=True,
    window_needs_flag=True,
    writes_biases=False,
    extra_hf_config={"attention_bias": False, "use_sliding_window": False},
    renormalizes_always=False,
)


@dataclass(frozen=True)
class Qwen2MoeAdapter(MoEAdapter):
    gated_shared_expert: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        if hf.get("use_sliding_window") and not hf.get("layer_types"):
            # Qwen2MoeConfig's own rule, not Qwen2's: the even layers below max_window_layers
            below = hf.get("max_window_layers", 28)
            kinds = [
                "sliding_attention" if i % 2 == 0 and i < below else "full_attention"
                for i in range(hf["num_hidden_layers"])
            ]
            hf = {**hf, "layer_types": kinds}
        config = super().model_config(hf)
        config.add_qkv_bias = bool(hf.get("qkv_bias", True))
        return config

    def hf_config(self, config: ModelConfig) -> dict:
        return {**super().hf_config(config), "qkv_bias": config.add_qkv_bias}


QWEN2_MOE = Qwen2MoeAdapter(
    "Qwen2MoeForCausalLM",
    "qwen2_moe",
    qkv_bias=True,
    window_needs_flag=True,
    windows_by_layer=True,
    writes_biases=False,
    renormalizes_always=False,
)
