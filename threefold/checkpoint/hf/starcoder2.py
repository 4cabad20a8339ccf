"""Starcoder2ForCausalLM (StarCoder2 3B, 7B, 15B): the LLaMA family's attention (grouped
queries, RoPE on each head's halves) with GPT-2's layer around it: LayerNorm with a bias, a
GELU MLP (c_fc, c_proj; gelu_pytorch_tanh: --openai-gelu), biases on every projection
(use_bias: --add-bias-linear), and a sliding window in every layer where `sliding_window` is
given (--window-size W-1,0; transformers' default is none)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.checkpoint.hf.common import Take, refuse, renamed
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ModelConfig

_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _mlp_names(config: ModelConfig) -> dict[str, str]:
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    pairs = {"mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
    return {f"{ours}.{k}": f"{theirs}.{k}" for ours, theirs in pairs.items() for k in kinds}


@dataclass(frozen=True)
class Starcoder2Adapter(LlamaAdapter):
    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "gelu_pytorch_tanh")
        refuse(activation not in _GELU, "hidden_act", activation, "GELU (exact or tanh) only")
        bias = hf.get("use_bias", True)
        llama = {
            **hf,
            "hidden_act": "silu",
            "rms_norm_eps": hf.get("norm_epsilon", 1e-5),
            "attention_bias": bias,
            "mlp_bias": bias,
            "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            "sliding_window": hf.get("sliding_window"),  # (none unless given)
        }
        config = super().model_config(llama)
        config.normalization, config.swiglu = "LayerNorm", False
        config.openai_gelu = _GELU[activation]
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (
                config.normalization != "LayerNorm" or not config.layernorm_bias,
                "norms other than LayerNorm with a bias",
            ),
            (config.gated_linear_unit or config.squared_relu, "a GLU or squared-ReLU MLP"),
            (config.add_qkv_bias, "biases on the query, key and value projections only"),
            (config.rotary_interleaved, "RoPE on adjacent pairs"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        hf["norm_epsilon"] = hf.pop("rms_norm_eps")
        hf.update(
            hidden_act="gelu_pytorch_tanh" if config.openai_gelu else "gelu",
            use_bias=config.add_bias_linear,
            residual_dropout=0.0,
            embedding_dropout=0.0,
        )
        return hf

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        return renamed(self._mlp(i, config), i, take, to_hf=False)

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        return renamed(self._mlp(i, config), i, state.__getitem__, to_hf=True)

    @staticmethod
    def _mlp(i: int, config: ModelConfig) -> dict[str, str]:
        return {ours: f"model.layers.{i}.{theirs}" for ours, theirs in _mlp_names(config).items()}

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        mlp = {"linear_fc1": "mlp.c_fc", "linear_fc2": "mlp.c_proj"}
        if layer in mlp:  # (one module each: no gate)
            return {f"model.layers.{i}.{mlp[layer]}": (a, b)}
        return super().lora_modules(layer, i, a, b, config)


STARCODER2 = Starcoder2Adapter(
    "Starcoder2ForCausalLM", "starcoder2", windows=True, writes_biases=False
)
