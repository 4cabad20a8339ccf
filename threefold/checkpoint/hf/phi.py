"""PhiForCausalLM (Phi-1, Phi-1.5, Phi-2): GPT-J's layer with LLaMA's attention projections.

- one LayerNorm with a bias per layer, read by the attention and the MLP side by side, both
  added to the layer's input (`input_layernorm`: --parallel-attention-mlp
  --parallel-attention-mlp-shared-norm --normalization LayerNorm); the final norm likewise;
- q, k and v projections apart, grouped queries where num_key_value_heads says so; biases on
  every projection and on the MLP's fc1 and fc2 (--add-bias-linear), a GELU between them
  (gelu_new: --openai-gelu);
- RoPE on the first partial_rotary_factor of each head, its halves rotated (--rotary-percent;
  Phi-2: 0.4);
- optionally a LayerNorm with a bias on each query and key head (qk_layernorm: --qk-layernorm);
- an output layer of its own with a bias per vocabulary entry (lm_head: --output-layer-bias).

resid_pdrop is --hidden-dropout (which threefold applies to the embeddings too; Phi's
embd_pdrop is exported as it). Phi-3 and Phi-4 are another family (hf/phi3.py).
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
    scaled_or_no_rope,
)
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ConfigError, ModelConfig

_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
_BOTH = ("weight", "bias")


@dataclass(frozen=True)
class PhiAdapter(LlamaAdapter):
    exports_phi: ClassVar[bool] = True
    exports_cohere: ClassVar[bool] = True  # (--parallel-attention-mlp-shared-norm only)
    parallel_layers: ClassVar[bool] = True
    partial_rope: ClassVar[bool] = True
    final_norm: ClassVar[str] = "model.final_layernorm"

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "gelu_new")
        refuse(activation not in _GELU, "hidden_act", activation, "GELU (exact or tanh) only")
        llama = {
            **hf,
            "hidden_act": "silu",
            "rms_norm_eps": hf.get("layer_norm_eps", 1e-5),
            "rope_parameters": None,
            "rope_scaling": None,
            "rope_theta": plain_rope_theta(hf, "Phi"),
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        }
        config = super().model_config(llama)
        config.normalization, config.swiglu = "LayerNorm", False
        config.openai_gelu = _GELU[activation]
        config.add_bias_linear = config.output_layer_bias = True
        config.parallel_attention_mlp = config.parallel_attention_mlp_shared_norm = True
        config.rotary_percent = partial_rotary_factor({"partial_rotary_factor": 0.5, **hf})
        config.qk_layernorm = bool(hf.get("qk_layernorm"))
        config.hidden_dropout = float(hf.get("resid_pdrop", 0.0))
        return config

    def check_exportable(self, config: ModelConfig) -> None:
        problems = [
            (
                config.normalization != "LayerNorm" or not config.layernorm_bias,
                "norms other than LayerNorm with a bias",
            ),
            (
                not config.parallel_attention_mlp_shared_norm,
                "layers other than the attention and the MLP reading one norm side by side "
                "(--parallel-attention-mlp --parallel-attention-mlp-shared-norm)",
            ),
            (
                not config.add_bias_linear or config.add_qkv_bias,
                "projections without biases (Phi's have them all: --add-bias-linear)",
            ),
            (config.gated_linear_unit or config.squared_relu, "a GLU or squared-ReLU MLP"),
            (config.logit_scale != 1.0, "--logit-scale"),
            (config.qk_layernorm_per_head, "a weight of their own for each query and key head"),
            (
                scaled_or_no_rope(config) or config.rotary_interleaved,
                "RoPE other than plain RoPE on the halves of each head's turned part",
            ),
            (config.is_moe or config.window_size is not None, "experts or windows"),
        ]
        self.refuse_problems(problems)
        heads = config.kv_channels or config.hidden_size // config.num_attention_heads
        if config.qk_layernorm and heads * config.num_attention_heads != config.hidden_size:
            raise ConfigError(
                f"{self.architecture} sizes its query and key norms hidden size / heads; this "
                f"model's heads are --kv-channels {heads} wide"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = super().hf_config(config)
        for name in ("rms_norm_eps", "rope_theta", "attention_bias", "mlp_bias"):
            hf.pop(name, None)
        hf.update(
            hidden_act="gelu_new" if config.openai_gelu else "gelu",
            layer_norm_eps=config.norm_epsilon,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": config.rotary_percent,
            },
            qk_layernorm=config.qk_layernorm,
            resid_pdrop=config.hidden_dropout,
            embd_pdrop=config.hidden_dropout,
        )
        return hf

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        p = f"model.layers.{i}."
        modules = {"input_layernorm": "input_layernorm", "self_attention.linear_proj": "dense"}
        modules = {
            ours: p + ("" if "norm" in ours else "self_attn.") + theirs
            for ours, theirs in modules.items()
        }
        if config.qk_layernorm:
            for x in "qk":
                modules[f"self_attention.{x}_layernorm"] = p + f"self_attn.{x}_layernorm"
        modules.update({"mlp.linear_fc1": p + "mlp.fc1", "mlp.linear_fc2": p + "mlp.fc2"})
        return {
            f"{ours}.{kind}": f"{theirs}.{kind}"
            for ours, theirs in modules.items()
            for kind in _BOTH
        }

    def give_ends(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = super().give_ends(state, config)
        if not config.output_layer_bias:  # Phi's with a zero bias computes this model
            embeddings = state["embedding.word_embeddings.weight"]
            out["lm_head.bias"] = embeddings.new_zeros(len(embeddings))
        return out

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        return {}  # (fc1 and fc2 are only renamed: layer_names)

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        return {}

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        others = {
            "linear_proj": "self_attn.dense",
            "linear_fc1": "mlp.fc1",
            "linear_fc2": "mlp.fc2",
        }
        if layer in others:
            return {f"model.layers.{i}.{others[layer]}": (a, b)}
        return super().lora_modules(layer, i, a, b, config)


PHI = PhiAdapter("PhiForCausalLM", "phi", writes_biases=False)
