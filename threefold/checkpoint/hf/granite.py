"""GraniteForCausalLM (IBM Granite 3.0 to 3.3, 2B and 8B) and GraniteMoeForCausalLM (below):
the LLaMA family's tensors with four multipliers, each a threefold flag: `embedding_multiplier`
(--embedding-multiplier, the word embeddings scaled), `attention_multiplier` (--softmax-scale,
the scores' scale in place of 1/sqrt(head size)), `residual_multiplier`
(--residual-multiplier, the attention's and the MLP's outputs scaled before each residual add)
and `logits_scaling` (the logits divided by it: --logit-scale its inverse)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.moe import MoEAdapter
from threefold.config import ModelConfig


@dataclass(frozen=True)
class GraniteAdapter(LlamaAdapter):
    exports_granite: ClassVar[bool] = True
    exports_gemma: ClassVar[bool] = True  # (--embedding-multiplier, --softmax-scale only)
    # (--logit-scale; Cohere's norms are refused with the LayerNorm and parallel layers)
    exports_cohere: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        config = super().model_config(hf)
        config.embedding_multiplier = float(hf.get("embedding_multiplier", 1.0))
        config.softmax_scale = float(hf.get("attention_multiplier", 1.0))
        config.residual_multiplier = float(hf.get("residual_multiplier", 1.0))
        config.logit_scale = 1.0 / float(hf.get("logits_scaling", 1.0))
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (config.normalization != "RMSNorm" or not config.swiglu, "other than RMSNorm + SwiGLU"),
            (
                config.post_sublayer_norm
                or config.geglu
                or config.window_rotary_base
                or config.attn_logit_softcapping
                or config.final_logit_softcapping,
                "Gemma's layers besides its multipliers",
            ),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        head = config.kv_channels or config.hidden_size // config.num_attention_heads
        return {
            **super().hf_config(config),
            "embedding_multiplier": config.embedding_multiplier,
            "attention_multiplier": config.softmax_scale or 1 / math.sqrt(head),
            "residual_multiplier": config.residual_multiplier,
            "logits_scaling": 1.0 / config.logit_scale,
        }


GRANITE = GraniteAdapter("GraniteForCausalLM", "granite")


@dataclass(frozen=True)
class GraniteMoeAdapter(GraniteAdapter, MoEAdapter):
    """GraniteMoeForCausalLM (Granite 3.0 and 3.1 1B-A400M, 3B-A800M): Granite's multipliers and
    Mixtral's routing (the softmax over the top-k logits) in every layer, its experts stacked as
    the Hub keeps them: `block_sparse_moe.input_linear` [experts, 2 x ffn, hidden] (each
    expert's [gate; up] rows: threefold's linear_fc1), `output_linear` [experts, hidden, ffn],
    `router.layer` [experts, hidden] (transformers 5's live names read too)."""

    def _take_experts(self, take: Take, config: ModelConfig, i: int) -> dict:
        p, ours = f"model.layers.{i}.block_sparse_moe.", f"decoder.layers.{i}.mlp."
        names = ("input_linear.weight", "output_linear.weight", "router.layer.weight")
        if p + "experts.gate_up_proj" in take:  # transformers 5's names in memory
            names = ("experts.gate_up_proj", "experts.down_proj", "router.weight")
        fc1, fc2 = take(p + names[0]), take(p + names[1])
        out = {ours + "router.weight": take(p + names[2])}
        for e in range(config.num_experts):
            out[f"{ours}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
            out[f"{ours}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
        return out

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        p, ours = f"model.layers.{i}.block_sparse_moe.", f"decoder.layers.{i}.mlp."
        experts = [f"{ours}experts.local_experts.{e}." for e in range(config.num_experts)]
        return {
            p + "input_linear.weight": torch.stack(
                [state[e + "linear_fc1.weight"] for e in experts]
            ),
            p + "output_linear.weight": torch.stack(
                [state[e + "linear_fc2.weight"] for e in experts]
            ),
            p + "router.layer.weight": state[ours + "router.weight"],
        }

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for name in ("router_jitter_noise", "sliding_window"):  # (Mixtral's, not Granite's)
            hf.pop(name, None)
        return hf


GRANITE_MOE = GraniteMoeAdapter("GraniteMoeForCausalLM", "granitemoe")
