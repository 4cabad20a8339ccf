"""The LLaMA family: RMSNorm, SwiGLU, RoPE, grouped query attention. Its members differ in
data, not code: which biases they carry, whether queries and keys are normalized, and how
their configs spell sliding windows and biases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import (
    Adapter,
    Take,
    refuse,
    renamed,
    rope_scaling,
    rope_settings,
    split_qkv,
    stack_qkv,
)
from threefold.checkpoint.hf.multimodal import TextOfMultimodal
from threefold.config import ConfigError, ModelConfig


def _layer_names(i: int, config: ModelConfig) -> dict[str, str]:
    """threefold name suffix -> HF name for one layer (the tensors that are only renamed)."""
    p = f"model.layers.{i}."
    names = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
    }
    if config.qk_layernorm:
        names.update(
            {
                "self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",
                "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight",
            }
        )
    if config.add_bias_linear:
        names["self_attention.linear_proj.bias"] = p + "self_attn.o_proj.bias"
    if config.normalization == "LayerNorm" and config.layernorm_bias:  # (StarCoder2's, Nemotron's)
        names["input_layernorm.bias"] = p + "input_layernorm.bias"
        names["pre_mlp_layernorm.bias"] = p + "post_attention_layernorm.bias"
    return names


def _dense_mlp_names(i: int, config: ModelConfig) -> dict[str, str]:
    p = f"model.layers.{i}."
    names = {"mlp.linear_fc2.weight": p + "mlp.down_proj.weight"}
    if config.mlp_bias:
        names["mlp.linear_fc2.bias"] = p + "mlp.down_proj.bias"
    return names


@dataclass(frozen=True)
class LlamaAdapter(Adapter):
    architecture: str
    model_type: str
    qkv_bias: bool = False  # Qwen2: biases on q, k and v only (--add-qkv-bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on each query and key head (--qk-layernorm)
    # Qwen's configs name a window they do not use unless use_sliding_window is set.
    window_needs_flag: bool = False
    # Mistral: a sliding window in every layer (its config's default: 4096 tokens)
    windows: bool = False  # (the Adapter's class default, as a field here)
    # Qwen2, Qwen3: a sliding window in the layers `layer_types` names
    windows_by_layer: bool = False
    writes_biases: bool = True  # its config carries attention_bias / mlp_bias
    mlp_only_biases: bool = False  # LLaMA's config may bias the MLP alone (--add-mlp-bias)
    final_norm: ClassVar[str] = "model.norm"  # (Phi's: model.final_layernorm)
    extra_hf_config: dict = field(default_factory=dict)

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(
            hf.get("hidden_act", "silu") != "silu",
            "hidden_act",
            hf.get("hidden_act"),
            "SwiGLU with SiLU only",
        )
        refuse(
            hf.get("pretraining_tp", 1) != 1,
            "pretraining_tp",
            hf.get("pretraining_tp"),
            "must be 1",
        )
        window = self._window(hf)
        attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
        refuse(
            attention_bias and not mlp_bias,
            "attention_bias/mlp_bias",
            (attention_bias, mlp_bias),
            "threefold has biases on all projections, on the MLP only or on QKV only, not on "
            "the attention alone",
        )
        refuse(
            mlp_bias and not (attention_bias or self.mlp_only_biases),
            "mlp_bias",
            mlp_bias,
            f"{self.architecture} reads no mlp_bias",
        )
        heads = hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        hidden = hf["hidden_size"]
        positions = hf.get("max_position_embeddings", 4096)
        theta, scaling = rope_settings(hf)
        return ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hidden,
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            group_query_attention=groups != heads,
            num_query_groups=groups,
            kv_channels=hf.get("head_dim") or hidden // heads,
            # (LongRoPE: up to its original context, where transformers takes its short factors)
            seq_length=min(
                positions, 4096, scaling.get("longrope_original_max_position_embeddings", 4096)
            ),
            max_position_embeddings=positions,
            rotary_base=theta,
            **{"position_embedding_type": "rope", **scaling},
            normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            add_bias_linear=attention_bias,
            add_mlp_bias=mlp_bias and not attention_bias,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
            **window,
        )

    def _window(self, hf: dict) -> dict:
        """--window-size (and which layers, --window-attn-skip-freq) of a config's sliding
        window of `sliding_window` tokens, the query's own included: keys back = it - 1."""
        size = hf.get("sliding_window", 4096 if self.windows else None)
        if self.window_needs_flag and not hf.get("use_sliding_window"):
            size = None  # (named, not used)
        refuse(
            size is not None and not (self.windows or self.window_needs_flag),
            "sliding_window",
            size,
            f"{self.architecture} has no sliding window",
        )
        if size is None:
            return {}
        if not self.window_needs_flag:
            return {"window_size": f"{size - 1},0"}
        # Qwen: the layers from max_window_layers on (or those layer_types names) slide.
        layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", layers) else "full_attention"
            for i in range(layers)
        ]
        pattern = [int(kind == "sliding_attention") for kind in kinds]
        freq = "[" + ",".join(map(str, pattern)) + "]"
        return (
            {"window_size": f"{size - 1},0", "window_attn_skip_freq": freq} if any(pattern) else {}
        )

    @staticmethod
    def _layer_windows(config: ModelConfig) -> dict:
        """Qwen's config of the model's windows: use_sliding_window, and where there are
        some, their size (the query's own key counted) and the layers that slide."""
        window, pattern = config.attention_window(), config.window_pattern(config.num_layers)
        if window is None:
            return {"use_sliding_window": False}
        return {
            "use_sliding_window": True,
            "sliding_window": window + 1,
            "max_window_layers": pattern.index(1),  # (layer_types say which exactly)
            "layer_types": ["sliding_attention" if w else "full_attention" for w in pattern],
        }

    def check_exportable(self, config: ModelConfig) -> None:
        if not self.qk_norm:
            return super().check_exportable(config)
        if not config.qk_layernorm:
            raise ConfigError(
                f"{self.architecture} normalizes queries and keys and this model "
                "was trained without --qk-layernorm; export it as "
                "LlamaForCausalLM"
            )
        if config.normalization != "RMSNorm":
            raise ConfigError(
                f"{self.architecture} normalizes queries and keys with RMSNorm; "
                f"this model's --qk-layernorm uses {config.normalization}"
            )

    def hf_config(self, config: ModelConfig) -> dict:
        hf = {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups,
            "num_hidden_layers": config.num_layers,
            "head_dim": config.kv_channels,
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon,
            "rope_theta": config.rotary_base,
            "hidden_act": "silu",
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
            "attention_dropout": config.attention_dropout,
        }
        if self.writes_biases:
            hf.update(attention_bias=config.add_bias_linear, mlp_bias=config.mlp_bias)
        if self.windows:  # (explicit: without it Mistral's config means 4096)
            window = config.attention_window()
            hf["sliding_window"] = None if window is None else window + 1
        if self.window_needs_flag and self.windows_by_layer:
            hf.update(self._layer_windows(config))
        scaling = rope_scaling(config)
        if scaling is not None:
            hf["rope_scaling"] = scaling
        return {**hf, **self.extra_hf_config}

    def take_ends(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        """The embeddings, the final norm and the output layer (the decoder's ends)."""
        out = {
            "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
            "decoder.final_layernorm.weight": take(self.final_norm + ".weight"),
        }
        if config.normalization == "LayerNorm" and config.layernorm_bias:  # (StarCoder2's, Phi's)
            out["decoder.final_layernorm.bias"] = take(self.final_norm + ".bias")
        if config.output_layer_bias:  # (Phi's)
            out["output_layer.bias"] = take("lm_head.bias")
        if config.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = take("lm_head.weight")
        else:
            used.add("lm_head.weight")  # tied: a copy of the embeddings, if present at all
        return out

    def give_ends(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {
            "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
            self.final_norm + ".weight": state["decoder.final_layernorm.weight"],
        }
        if config.normalization == "LayerNorm" and config.layernorm_bias:
            out[self.final_norm + ".bias"] = state["decoder.final_layernorm.bias"]
        if config.output_layer_bias:
            out["lm_head.bias"] = state["output_layer.bias"]
        if config.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        return out

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = self.take_ends(take, config, used)
        for i in range(config.num_layers):
            out.update(self.take_layer(take, config, i))
        return out

    def take_layer(self, take: Take, config: ModelConfig, i: int) -> dict:
        """The file's layer i as threefold's `decoder.layers.{i}.` (a multi-token prediction
        depth's layer where the Hub numbers it after the decoder's: hf/deepseek.py)."""
        out = renamed(self.layer_names(i, config), i, take, to_hf=False)
        out.update(self.take_qkv(take, config, i))
        out.update(self.take_mlp(take, config, i))
        return out

    def layer_names(self, i: int, config: ModelConfig) -> dict[str, str]:
        """threefold name suffix -> HF name of layer i's tensors that are only renamed."""
        return _layer_names(i, config)

    def take_qkv(self, take: Take, config: ModelConfig, i: int) -> dict:
        """Layer i's QKV projection (fused in Phi-3's)."""
        ours, p = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
        weights = [take(p + f"{x}_proj.weight") for x in "qkv"]
        out = {ours + "linear_qkv.weight": stack_qkv(*weights, config)}
        if config.add_bias_linear or config.add_qkv_bias:
            biases = [take(p + f"{x}_proj.bias") for x in "qkv"]
            out[ours + "linear_qkv.bias"] = stack_qkv(*biases, config)
        return out

    def take_mlp(self, take: Take, config: ModelConfig, i: int) -> dict:
        """Layer i's MLP tensors (a mixture of experts in the MoE adapters)."""
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out = renamed(_dense_mlp_names(i, config), i, take, to_hf=False)
        out[ours + "mlp.linear_fc1.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        if config.mlp_bias:
            out[ours + "mlp.linear_fc1.bias"] = torch.cat(
                [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]
            )
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = self.give_ends(state, config)
        for i in range(config.num_layers):
            out.update(self.give_layer(state, config, i))
        return out

    def give_layer(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        """`take_layer`'s inverse."""
        out = renamed(self.layer_names(i, config), i, state.__getitem__, to_hf=True)
        out.update(self.give_qkv(state, config, i))
        out.update(self.give_mlp(state, config, i))
        return out

    def give_qkv(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
        out = {}
        q, k, v = split_qkv(state[ours + "linear_qkv.weight"], config, self.rotates_halves)
        out.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
        if config.add_bias_linear or config.add_qkv_bias:
            q, k, v = split_qkv(state[ours + "linear_qkv.bias"], config, self.rotates_halves)
            out.update({p + "q_proj.bias": q, p + "k_proj.bias": k, p + "v_proj.bias": v})
        return out

    def lora_modules(
        self, layer: str, i: int, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The Hugging Face modules of layer i's `layer` (linear_qkv, ...) with their LoRA
        (A, B), cut from threefold's adapter (A, B) as the weights are cut (hf/peft.py)."""
        p = f"model.layers.{i}."
        if layer == "linear_qkv":
            q, k, v = split_qkv(b, config, self.rotates_halves)
            return {p + f"self_attn.{x}_proj": (a, rows) for x, rows in zip("qkv", (q, k, v))}
        if layer == "linear_fc1":
            gate, up = b.chunk(2)
            return {p + "mlp.gate_proj": (a, gate), p + "mlp.up_proj": (a, up)}
        return {p + ("self_attn.o_proj" if layer == "linear_proj" else "mlp.down_proj"): (a, b)}

    def give_mlp(self, state: dict[str, torch.Tensor], config: ModelConfig, i: int) -> dict:
        ours, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out = renamed(_dense_mlp_names(i, config), i, state.__getitem__, to_hf=True)
        gate, up = state[ours + "mlp.linear_fc1.weight"].chunk(2)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
        if config.mlp_bias:
            gate, up = state[ours + "mlp.linear_fc1.bias"].chunk(2)
            out.update({p + "mlp.gate_proj.bias": gate, p + "mlp.up_proj.bias": up})
        return out


LLAMA = LlamaAdapter("LlamaForCausalLM", "llama", mlp_only_biases=True)
MISTRAL = LlamaAdapter("MistralForCausalLM", "mistral", windows=True)
QWEN2 = LlamaAdapter(
    "Qwen2ForCausalLM",
    "qwen2",
    qkv_bias=True,
    window_needs_flag=True,
    windows_by_layer=True,
    writes_biases=False,
)
QWEN3 = LlamaAdapter(
    "Qwen3ForCausalLM",
    "qwen3",
    qk_norm=True,
    window_needs_flag=True,
    windows_by_layer=True,
    writes_biases=False,
    extra_hf_config={"attention_bias": False},
)


@dataclass(frozen=True)
class Mistral3Adapter(TextOfMultimodal, LlamaAdapter):
    """Mistral3ForConditionalGeneration (Mistral Small 3.1 and 3.2): its text model, Mistral's
    (hf/multimodal.py)."""

    left_behind_prefixes: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.")
    exports_as: ClassVar[str] = "MistralForCausalLM"


MISTRAL3 = Mistral3Adapter("Mistral3ForConditionalGeneration", "mistral3", windows=True)
