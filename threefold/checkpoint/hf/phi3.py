"""Phi3ForCausalLM (Phi-3 and Phi-3.5 mini and medium, Phi-4): the LLaMA family with its
projections fused.

    qkv_proj      [all q; all k; all v] rows -> linear_qkv's per-group [q..., k, v]
    gate_up_proj  [gate; up] rows             =  linear_fc1 (threefold's own order)

Everything else maps as LLaMA's: the norms, o_proj, down_proj and the ends; a sliding window
in every layer where the config names one (Phi-3 mini: 2047 tokens, --window-size 2046,0); RoPE
on the first partial_rotary_factor of each head, its halves rotated (--rotary-percent).
LongRoPE (the 128k-context models, Phi-3.5 and Phi-4 mini) is --position-embedding-type
longrope; its original context is the config's top-level original_max_position_embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from threefold.checkpoint.hf.common import Take, partial_rotary_factor, refuse, split_qkv, stack_qkv
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ConfigError, ModelConfig


class FusedGateUpMLP:
    """An LLaMA-family adapter's SwiGLU MLP whose gate and up projections are one tensor,
    [gate; up] rows (gate_up_proj: Phi-3's, GLM-4's): threefold's linear_fc1 as it is."""

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        return {
            ours + "linear_fc1.weight": take(p + "gate_up_proj.weight"),
            ours + "linear_fc2.weight": take(p + "down_proj.weight"),
        }

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        return {
            p + "gate_up_proj.weight": state[ours + "linear_fc1.weight"],
            p + "down_proj.weight": state[ours + "linear_fc2.weight"],
        }

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if layer == "linear_fc1":
            return {f"model.layers.{i}.mlp.gate_up_proj": (a, b)}
        return super().lora_modules(layer, i, a, b, config)


@dataclass(frozen=True)
class Phi3Adapter(FusedGateUpMLP, LlamaAdapter):
    partial_rope = True

    def model_config(self, hf: dict) -> ModelConfig:
        for field in ("attention_bias", "mlp_bias"):
            refuse(bool(hf.get(field)), field, hf.get(field), "Phi-3's projections have none")
        # (a config without sliding_window has none: Mistral's default of 4096 is not Phi's)
        hf = {"sliding_window": None, **hf}
        scaling = hf.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type")) == "yarn":  # (Phi3Config's reading)
            hf["rope_scaling"] = {**scaling, "type": "longrope", "rope_type": "longrope"}
        config = super().model_config(hf)
        config.rotary_percent = partial_rotary_factor(hf)
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        if config.add_bias_linear or config.add_qkv_bias or config.rotary_interleaved:
            raise ConfigError(
                f"{self.architecture} cannot express this model: biases, or RoPE on adjacent "
                "pairs (--rotary-interleaved)"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        hf["original_max_position_embeddings"] = (
            config.longrope_original_max_position_embeddings or config.max_position_embeddings
        )
        hf["partial_rotary_factor"] = config.rotary_percent
        # Phi3Config's defaults are Phi-3's vocabulary's (32000): the source's ids, when the
        # checkpoint was converted from one, are written over these
        hf.update(pad_token_id=None, eos_token_id=None)
        return hf

    def take_qkv(self, take: Take, config: ModelConfig, i: int) -> dict:
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        qkv = take(f"model.layers.{i}.self_attn.qkv_proj.weight")
        q, k, v = qkv.split([heads * d, groups * d, groups * d])
        return {f"decoder.layers.{i}.self_attention.linear_qkv.weight": stack_qkv(q, k, v, config)}

    def give_qkv(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        qkv = split_qkv(state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], config)
        return {f"model.layers.{i}.self_attn.qkv_proj.weight": torch.cat(qkv)}

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        p = f"model.layers.{i}."
        if layer == "linear_qkv":
            return {p + "self_attn.qkv_proj": (a, torch.cat(split_qkv(b, config)))}
        return super().lora_modules(layer, i, a, b, config)


PHI3 = Phi3Adapter("Phi3ForCausalLM", "phi3", windows=True, writes_biases=False)
