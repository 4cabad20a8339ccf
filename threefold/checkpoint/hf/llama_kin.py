"""Families that are the LLaMA layer with one choice of their own, each a flag threefold has:

Ernie4_5ForCausalLM  ERNIE 4.5 dense (0.3B): RoPE on adjacent pairs (--rotary-interleaved;
                     the weights map as they are), use_bias for every projection, tied
                     embeddings as a rule
HeliumForCausalLM    Kyutai's Helium 1: RoPE on adjacent pairs
SeedOssForCausalLM   ByteDance's Seed-OSS: biases on q, k and v alone (attention_bias
                     without attention_out_bias: --add-qkv-bias), residual_dropout
                     (--hidden-dropout)
ArceeForCausalLM     Arcee's AFM: an MLP of one projection and a squared ReLU (up_proj,
                     relu2, down_proj: --squared-relu), as Nemotron's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.common import refuse
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.checkpoint.hf.nemotron import UpDownMLP
from threefold.config import ModelConfig


@dataclass(frozen=True)
class PairedRopeAdapter(LlamaAdapter):
    """The LLaMA layer whose RoPE turns adjacent pairs (transformers' GLM-style rotate_half);
    `use_bias`: its config names one bias flag for every projection (ERNIE 4.5's)."""

    rotates_halves: ClassVar[bool] = False
    use_bias: bool = False

    def model_config(self, hf: dict) -> ModelConfig:
        if self.use_bias:
            bias = bool(hf.get("use_bias"))
            hf = {"tie_word_embeddings": True, **hf, "attention_bias": bias, "mlp_bias": bias}
        config = super().model_config(hf)
        config.rotary_interleaved = True
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [(not config.rotary_interleaved, "RoPE on halves (--rotary-interleaved)")]
        if self.use_bias:
            problems.append((config.add_mlp_bias, "biases on the MLP alone"))
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        if self.use_bias:
            for name in ("attention_bias", "mlp_bias"):
                del hf[name]
            hf["use_bias"] = config.add_bias_linear
        return hf


ERNIE4_5 = PairedRopeAdapter("Ernie4_5ForCausalLM", "ernie4_5", use_bias=True)
HELIUM = PairedRopeAdapter("HeliumForCausalLM", "helium")


@dataclass(frozen=True)
class SeedOssAdapter(LlamaAdapter):
    def model_config(self, hf: dict) -> ModelConfig:
        for field in ("attention_out_bias", "mlp_bias"):
            refuse(
                bool(hf.get(field)),
                field,
                hf.get(field),
                "threefold biases every projection or q, k and v alone",
            )
        qkv = bool(hf.get("attention_bias", True))
        config = super().model_config({**hf, "attention_bias": False, "mlp_bias": False})
        config.add_qkv_bias = qkv
        config.hidden_dropout = float(hf.get("residual_dropout", 0.0))
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        self.refuse_problems([(config.add_bias_linear, "biases on every projection")])

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        hf.update(
            attention_bias=config.add_qkv_bias,
            attention_out_bias=False,
            mlp_bias=False,
            residual_dropout=config.hidden_dropout,
        )
        return hf


SEED_OSS = SeedOssAdapter("SeedOssForCausalLM", "seed_oss", writes_biases=False)


@dataclass(frozen=True)
class ArceeAdapter(UpDownMLP, LlamaAdapter):
    squared_relu_mlp: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "relu2")
        refuse(activation != "relu2", "hidden_act", activation, "the squared ReLU only")
        config = super().model_config({**hf, "hidden_act": "silu"})
        config.swiglu, config.squared_relu = False, True
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        self.refuse_problems(
            [(config.gated_linear_unit or not config.squared_relu, "an MLP other than ReLU²")]
        )

    def hf_config(self, config: ModelConfig) -> dict:
        return {**super().hf_config(config), "hidden_act": "relu2"}


ARCEE = ArceeAdapter("ArceeForCausalLM", "arcee")
