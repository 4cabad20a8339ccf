"""NemotronForCausalLM (Nemotron-4 15B and 340B, Minitron 4B and 8B, Mistral-NeMo-Minitron 8B):
NVIDIA's models trained with Megatron-LM, so every part of them is a Megatron flag:

- LayerNorm with a bias whose weight is stored centred on zero and scaled by 1 + weight
  (NemotronLayerNorm1P: --normalization LayerNorm --apply-layernorm-1p; the weights map as
  they are);
- an MLP of one projection and a squared ReLU (up_proj, relu2, down_proj: --squared-relu,
  no gate);
- LLaMA's attention (q, k and v apart, grouped queries, a head size of its own) with RoPE on
  the halves of the first partial_rotary_factor of each head (--rotary-percent; 0.5);
- biases where attention_bias and mlp_bias say (both or neither), untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import (
    Take,
    partial_rotary_factor,
    plain_rope_theta,
    refuse,
    renamed,
    scaled_or_no_rope,
)
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ModelConfig


def _mlp_names(i: int, config: ModelConfig) -> dict[str, str]:
    kinds = ("weight", "bias") if config.mlp_bias else ("weight",)
    pairs = {"mlp.linear_fc1": "mlp.up_proj", "mlp.linear_fc2": "mlp.down_proj"}
    return {
        f"{ours}.{kind}": f"model.layers.{i}.{theirs}.{kind}"
        for ours, theirs in pairs.items()
        for kind in kinds
    }


class UpDownMLP:
    """An LLaMA-family adapter's MLP of one projection and an activation, no gate (up_proj,
    down_proj: Nemotron's, Arcee's squared ReLU)."""

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        return renamed(_mlp_names(i, config), i, take, to_hf=False)

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        return renamed(_mlp_names(i, config), i, state.__getitem__, to_hf=True)

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if layer == "linear_fc1":  # (one module: no gate)
            return {f"model.layers.{i}.mlp.up_proj": (a, b)}
        return super().lora_modules(layer, i, a, b, config)


@dataclass(frozen=True)
class NemotronAdapter(UpDownMLP, LlamaAdapter):
    zero_centered_norms: ClassVar[bool] = True
    squared_relu_mlp: ClassVar[bool] = True
    partial_rope: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "relu2")
        refuse(activation != "relu2", "hidden_act", activation, "the squared ReLU only")
        llama = {
            **hf,
            "hidden_act": "silu",
            "rms_norm_eps": hf.get("norm_eps", 1e-5),
            "rope_parameters": None,
            "rope_scaling": None,
            "rope_theta": plain_rope_theta(hf, "Nemotron"),
        }
        config = super().model_config(llama)
        config.normalization, config.apply_layernorm_1p = "LayerNorm", True
        config.swiglu, config.squared_relu = False, True
        config.rotary_percent = partial_rotary_factor({"partial_rotary_factor": 0.5, **hf})
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (
                config.normalization != "LayerNorm" or not config.layernorm_bias,
                "norms other than LayerNorm with a bias",
            ),
            (config.gated_linear_unit or not config.squared_relu, "an MLP other than ReLU²"),
            (config.add_qkv_bias, "biases on the query, key and value projections only"),
            (
                scaled_or_no_rope(config) or config.rotary_interleaved,
                "RoPE other than plain RoPE on the halves of each head's turned part",
            ),
            (config.is_moe or config.window_size is not None, "experts or windows"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        del hf["rope_theta"]
        hf.update(
            hidden_act="relu2",
            norm_eps=hf.pop("rms_norm_eps"),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": config.rotary_percent,
            },
        )
        return hf


NEMOTRON = NemotronAdapter("NemotronForCausalLM", "nemotron")
