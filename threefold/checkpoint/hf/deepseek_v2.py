"""DeepseekV2ForCausalLM (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite; DeepSeek-V2 and V2.5 where
their groups fit): DeepSeek-V3's multi-latent attention (hf/deepseek.py: the same tensors, the
query straight from the hidden state where q_lora_rank is null, RoPE on adjacent pairs as
transformers' complex product turns them) with DeepSeek-V2's routing:

- a softmax over all n_routed_experts, its top num_experts_per_tok probabilities kept as
  they are (--moe-router-score-function softmax --moe-router-pre-softmax; norm_topk_prob is
  not read by transformers' DeepSeek-V2) and times routed_scaling_factor
  (--moe-router-topk-scaling-factor);
- topk_method greedy, or group_limited_greedy over n_group groups of which topk_group are kept
  (--moe-router-num-groups, --moe-router-group-topk), a group scored by its best expert:
  megatron-core scores it by its top num_experts_per_tok / topk_group, so that ratio must be
  1 (DeepSeek-V2's 6 / 3 is refused by name);
- no expert biases; n_shared_experts shared experts as one MLP, after first_k_dense_replace
  dense layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.common import refuse
from threefold.checkpoint.hf.deepseek import DeepSeekV3Adapter, deepseek_experts
from threefold.config import ModelConfig

GREEDY, GROUPS = "greedy", "group_limited_greedy"


@dataclass(frozen=True)
class DeepSeekV2Adapter(DeepSeekV3Adapter):
    expert_score_bias: ClassVar[bool] = False
    group_score_experts: ClassVar[int] = 1

    def moe_fields(self, hf: dict) -> dict:
        experts = deepseek_experts(hf, "DeepSeek-V2")
        if not experts:
            return {}
        k = hf["num_experts_per_tok"]
        method = hf.get("topk_method", GREEDY)
        refuse(method not in (GREEDY, GROUPS), "topk_method", method, f"{GREEDY} or {GROUPS}")
        groups, kept = (hf.get("n_group") or 1, hf.get("topk_group") or 1)
        if method == GREEDY:
            groups = kept = 1
        refuse(
            groups > 1 and k // kept != 1,
            "topk_method",
            method,
            "transformers scores a group by its best expert, megatron-core by its top "
            f"num_experts_per_tok / topk_group ({k // kept} here)",
        )
        refuse(
            hf.get("moe_layer_freq", 1) != 1,
            "moe_layer_freq",
            hf.get("moe_layer_freq"),
            "transformers' DeepSeek-V2 has experts in every layer after the dense ones",
        )
        scaling = hf.get("routed_scaling_factor", 1.0)
        return {
            **experts,
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": True,
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": kept if groups > 1 else None,
            "moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None,
        }

    def score_problems(self, config: ModelConfig) -> list[tuple[bool, str]]:
        return [
            (
                config.moe_router_score_function != "softmax" or not config.moe_router_pre_softmax,
                "routing other than a softmax over all experts (--moe-router-pre-softmax)",
            ),
            (config.moe_router_enable_expert_bias, "expert biases"),
        ]

    def routing_hf_config(self, config: ModelConfig) -> dict:
        hf = super().routing_hf_config(config)
        groups = config.moe_router_num_groups
        return {**hf, "topk_method": GROUPS if groups else GREEDY, "norm_topk_prob": False}


DEEPSEEK_V2 = DeepSeekV2Adapter("DeepseekV2ForCausalLM", "deepseek_v2", writes_biases=False)
