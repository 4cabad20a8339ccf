"""Exaone4ForCausalLM (EXAONE 4.0 1.2B, 32B): OLMo 2's layer (hf/olmo2.py: an RMSNorm after the
attention and after the MLP, none before) with Qwen3's query and key norms (an RMSNorm over each
head, one weight for all: --qk-layernorm without --qk-layernorm-across-heads). Where
sliding_window is given, the layers `layer_types` names (sliding_window_pattern: three in four,
the last layer full) attend in a window with RoPE, and the others attend to every key without
positions (--no-rope-freq the complement of --window-attn-skip-freq, as Cohere2's); without it,
every layer attends to every key with RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from threefold.checkpoint.hf.olmo2 import FULL, SLIDING, Olmo2Adapter
from threefold.config import ModelConfig


def _pattern(layers: list[int]) -> str:
    return "[" + ",".join(map(str, layers)) + "]"


def _layer_types(hf: dict) -> list[str]:
    """Each layer's attention, as Exaone4Config reads sliding_window_pattern: every N-th
    layer full (N an int), or a string of L (local) and G (global) repeated; the last layer
    full."""
    layers = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return hf["layer_types"]
    pattern = hf.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        kinds = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(layers)]
        return kinds[:-1] + [FULL]
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


@dataclass(frozen=True)
class Exaone4Adapter(Olmo2Adapter):
    qk_across_heads: ClassVar[bool] = False
    windows_by_layer: ClassVar[bool] = True
    exports_llama4: ClassVar[bool] = True  # (--no-rope-freq only)

    def model_config(self, hf: dict) -> ModelConfig:
        window = hf.get("sliding_window", 4096)
        kinds = _layer_types(hf) if window is not None else [FULL] * hf["num_hidden_layers"]
        llama = {**hf, "layer_types": kinds, "use_sliding_window": window is not None}
        config = super().model_config(llama)
        sliding = [int(kind == SLIDING) for kind in kinds]
        if any(sliding) and not all(sliding):
            config.no_rope_freq = _pattern([1 - layer for layer in sliding])
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        sliding = config.window_pattern(config.num_layers)
        nope = config.no_rope_pattern(config.num_layers)
        llama4 = [
            config.qk_l2_norm,
            config.attention_chunk_size,
            config.attn_temperature_tuning,
            config.moe_apply_probs_on_input,
        ]
        rope_in_windows = (
            nope == [1 - layer for layer in sliding] if any(sliding) else not any(nope)
        )
        self.refuse_problems(
            [
                (any(llama4), "Llama 4's layers other than --no-rope-freq"),
                (
                    not rope_in_windows,
                    "RoPE elsewhere than in the windowed layers (--no-rope-freq the complement "
                    "of --window-attn-skip-freq; with no window, RoPE in every layer)",
                ),
            ]
        )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for name in ("use_sliding_window", "max_window_layers"):
            hf.pop(name, None)
        window = config.attention_window()
        sliding = config.window_pattern(config.num_layers)
        hf.update(
            sliding_window=None if window is None else window + 1,
            layer_types=[SLIDING if layer else FULL for layer in sliding],
        )
        return hf


EXAONE4 = Exaone4Adapter("Exaone4ForCausalLM", "exaone4", window_needs_flag=True)
