"""SmolLM3ForCausalLM (SmolLM3 3B): the LLaMA layer (grouped queries, tied embeddings) whose
every no_rope_layer_interval-th layer attends without positions (NoPE: `no_rope_layers`, 1 for
each layer with RoPE: --no-rope-freq its complement, the option Llama 4 and Cohere2 use too).
With use_sliding_window, the layers `layer_types` names attend in a window of sliding_window
keys (the NoPE layers, as transformers builds them: --window-size W-1,0
--window-attn-skip-freq), as Qwen2's configs say it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ModelConfig


def _pattern(layers: list[int]) -> str:
    return "[" + ",".join(map(str, layers)) + "]"


@dataclass(frozen=True)
class SmolLM3Adapter(LlamaAdapter):
    exports_llama4: ClassVar[bool] = True  # (--no-rope-freq only)

    def model_config(self, hf: dict) -> ModelConfig:
        layers, every = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
        rope = hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
        config = super().model_config({"tie_word_embeddings": True, **hf})
        if not all(rope):
            config.no_rope_freq = _pattern([1 - layer for layer in rope])
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        llama4 = [
            config.qk_l2_norm,
            config.attention_chunk_size,
            config.attn_temperature_tuning,
            config.moe_apply_probs_on_input,
        ]
        self.refuse_problems([(any(llama4), "Llama 4's layers other than --no-rope-freq")])

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        nope = config.no_rope_pattern(config.num_layers)
        hf["no_rope_layers"] = [1 - layer for layer in nope]
        return hf


SMOLLM3 = SmolLM3Adapter(
    "SmolLM3ForCausalLM", "smollm3", window_needs_flag=True, windows_by_layer=True
)
