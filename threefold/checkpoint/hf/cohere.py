"""CohereForCausalLM (Command R, Command R 08-2024, Aya 23, Aya Expanse): the LLaMA family's
tensors with Cohere's layers (config/cohere.py):

- one LayerNorm per layer, without a bias, read by the attention and the MLP side by side,
  both added to the layer's input (`input_layernorm`: --parallel-attention-mlp
  --parallel-attention-mlp-shared-norm --normalization LayerNorm --no-layernorm-bias); the
  final norm likewise;
- RoPE on adjacent pairs of each head (--rotary-interleaved: the weights map as they are);
- the logits multiplied by logit_scale (--logit-scale; Command R: 0.0625), the embeddings
  tied as a rule.

Command R+ (use_qk_norm) normalizes each query and key head by a LayerNorm without a bias and
with a weight of its own, q_norm.weight [heads, head size] (--qk-layernorm
--qk-layernorm-per-head, its weights kept flat). A model whose query and key norms share one
weight exports with it repeated for each head. Refused by name: attention_bias (biases on the
attention's projections but not the MLP's).

Cohere2ForCausalLM (Command R7B, Command A) is Cohere's model whose `layer_types` name the
layers that attend within a sliding window of `sliding_window` keys (three in four; --window-size
W-1,0 with a --window-attn-skip-freq pattern) and turn them by RoPE; the other layers attend to
every key without positions (--no-rope-freq, the same pattern's complement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Take, refuse
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class CohereAdapter(LlamaAdapter):
    exports_cohere: ClassVar[bool] = True
    parallel_layers: ClassVar[bool] = True
    rotates_halves: ClassVar[bool] = False

    qk_norms: ClassVar[bool] = True  # (Command R+'s; Cohere2 has none)

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(
            bool(hf.get("attention_bias")),
            "attention_bias",
            hf.get("attention_bias"),
            "threefold has biases on all projections or none, and Cohere's MLP has none",
        )
        # (transformers' defaults for Cohere: the Hub's configs name theirs)
        defaults = {"rope_theta": 500000.0, "tie_word_embeddings": True}
        config = super().model_config(
            {**defaults, **hf, "rms_norm_eps": hf.get("layer_norm_eps", 1e-5)}
        )
        config.normalization, config.layernorm_bias = "LayerNorm", False
        config.parallel_attention_mlp = config.parallel_attention_mlp_shared_norm = True
        config.rotary_interleaved = True
        config.logit_scale = float(hf.get("logit_scale", 0.0625))
        config.qk_layernorm = config.qk_layernorm_per_head = bool(hf.get("use_qk_norm"))
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        if config.qk_layernorm and not self.qk_norms:
            raise ConfigError(
                f"{self.architecture} has no query/key norms and this model was trained with "
                "--qk-layernorm; export it as CohereForCausalLM"
            )
        cohere = (
            config.normalization == "LayerNorm"
            and not config.layernorm_bias
            and config.parallel_attention_mlp_shared_norm
            and config.rotary_interleaved
            and config.rotary_percent == 1.0
        )
        if not cohere or config.add_bias_linear or config.add_qkv_bias:
            raise ConfigError(
                f"{self.architecture} cannot express this model: its layers read one LayerNorm "
                "without a bias in parallel, turn adjacent pairs of every dimension, and have no "
                "biases (--normalization LayerNorm --no-layernorm-bias --parallel-attention-mlp "
                "--parallel-attention-mlp-shared-norm --rotary-interleaved)"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        hf["layer_norm_eps"] = hf.pop("rms_norm_eps")
        hf.update(
            logit_scale=config.logit_scale, use_qk_norm=config.qk_layernorm, attention_bias=False
        )
        return hf

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        names = super().layer_names(i, config)
        del names["pre_mlp_layernorm.weight"]  # (the attention's norm serves the MLP too)
        for x in "qk":  # (reshaped: take_qkv, give_qkv)
            names.pop(f"self_attention.{x}_layernorm.weight", None)
        return names

    def take_qkv(self, take: Take, config: ModelConfig, i: int) -> dict:
        out = super().take_qkv(take, config, i)
        if config.qk_layernorm:  # [heads, head size], flat in threefold
            ours, p = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
            for x in "qk":
                out[ours + f"{x}_layernorm.weight"] = take(p + f"{x}_norm.weight").flatten()
        return out

    def give_qkv(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        out = super().give_qkv(state, config, i)
        if config.qk_layernorm:
            ours, p = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
            d = config.kv_channels
            heads = {"q": config.num_attention_heads, "k": config.num_query_groups}
            for x in "qk":
                weight = state[ours + f"{x}_layernorm.weight"]
                # (one weight shared by the heads: each head's copy of it)
                out[p + f"{x}_norm.weight"] = weight.reshape(-1, d).expand(heads[x], d).clone()
        return out


COHERE = CohereAdapter("CohereForCausalLM", "cohere", writes_biases=False)

SLIDING, FULL = "sliding_attention", "full_attention"


def _pattern(layers: list[int]) -> str:
    return "[" + ",".join(map(str, layers)) + "]"


@dataclass(frozen=True)
class Cohere2Adapter(CohereAdapter):
    qk_norms: ClassVar[bool] = False
    windows_by_layer: ClassVar[bool] = True
    exports_llama4: ClassVar[bool] = True  # (--no-rope-freq, Llama 4's layers without RoPE)

    def model_config(self, hf: dict) -> ModelConfig:
        layers = hf["num_hidden_layers"]
        every = hf.get("sliding_window_pattern", 4)  # (the Hub's first configs)
        kinds = hf.get("layer_types") or [
            SLIDING if (i + 1) % every else FULL for i in range(layers)
        ]
        refuse(set(kinds) - {SLIDING, FULL}, "layer_types", kinds, f"{SLIDING} or {FULL} only")
        window = hf.get("sliding_window", 4096)
        refuse(
            window is None,
            "sliding_window",
            window,
            "transformers then turns no layer by RoPE; give the window",
        )
        config = super().model_config({k: v for k, v in hf.items() if k != "sliding_window"})
        sliding = [int(kind == SLIDING) for kind in kinds]
        if any(sliding):
            config.window_size = f"{window - 1},0"
            config.window_attn_skip_freq = None if all(sliding) else _pattern(sliding)
        if not all(sliding):
            config.no_rope_freq = _pattern([1 - layer for layer in sliding])
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        sliding = config.window_pattern(config.num_layers)
        llama4 = [
            config.qk_l2_norm,
            config.attention_chunk_size,
            config.attn_temperature_tuning,
            config.moe_apply_probs_on_input,
        ]
        if any(llama4) or config.no_rope_pattern(config.num_layers) != [1 - w for w in sliding]:
            raise ConfigError(
                f"{self.architecture} cannot express this model: RoPE turns exactly the layers "
                "with a window (--no-rope-freq the complement of --window-attn-skip-freq), and "
                "none of Llama 4's other layers"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        del hf["use_qk_norm"]
        sliding = config.window_pattern(config.num_layers)
        window = config.attention_window()
        hf.update(
            layer_types=[SLIDING if layer else FULL for layer in sliding],
            sliding_window=None if window is None else window + 1,
        )
        return hf


COHERE2 = Cohere2Adapter("Cohere2ForCausalLM", "cohere2", writes_biases=False)
