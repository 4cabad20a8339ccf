"""GPTNeoXForCausalLM (GPT-NeoX-20B, Pythia): LayerNorm, GELU, biases everywhere, RoPE on the
first rotary_pct of each head (its halves rotated: --rotary-percent), untied embeddings, and
with use_parallel_residual the attention and the MLP reading the same input
(--parallel-attention-mlp).

Its fused query_key_value holds each head's [q; k; v] rows in turn: with a key and value head
per query head this is threefold's per-group [q, k, v] layout as it is, so the weights only
change names.
"""

from __future__ import annotations

import torch

from threefold.checkpoint.hf.common import (
    Adapter,
    Take,
    partial_rotary_factor,
    refuse,
    renamed,
    scaled_or_no_rope,
)
from threefold.config import ModelConfig

_TOP = {
    "embedding.word_embeddings.weight": "gpt_neox.embed_in.weight",
    "decoder.final_layernorm.weight": "gpt_neox.final_layer_norm.weight",
    "decoder.final_layernorm.bias": "gpt_neox.final_layer_norm.bias",
    "output_layer.weight": "embed_out.weight",
}
_LAYER = {
    "input_layernorm": "input_layernorm",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "self_attention.linear_qkv": "attention.query_key_value",
    "self_attention.linear_proj": "attention.dense",
    "mlp.linear_fc1": "mlp.dense_h_to_4h",
    "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def _layer_names(i: int) -> dict[str, str]:
    p = f"gpt_neox.layers.{i}."
    return {
        f"{ours}.{kind}": f"{p}{theirs}.{kind}"
        for ours, theirs in _LAYER.items()
        for kind in ("weight", "bias")
    }


class GPTNeoXAdapter(Adapter):
    architecture, model_type = "GPTNeoXForCausalLM", "gpt_neox"
    partial_rope = True
    parallel_layers = True

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("hidden_act", "gelu")
        refuse(
            activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"),
            "hidden_act",
            activation,
            "GELU (exact or tanh) only",
        )
        refuse(
            hf.get("attention_bias") is False,
            "attention_bias",
            False,
            "threefold has biases on every projection or none, and GPT-NeoX's MLP has them",
        )
        parameters = hf.get("rope_parameters") or {}
        refuse(
            parameters.get("rope_type", "default") != "default",
            "rope_parameters.rope_type",
            parameters.get("rope_type"),
            "GPT-NeoX's plain RoPE only",
        )
        rotary = {"partial_rotary_factor": hf.get("rotary_pct", 1.0), **parameters}
        positions = hf.get("max_position_embeddings", 2048)
        return ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            seq_length=min(positions, 4096),
            max_position_embeddings=positions,
            position_embedding_type="rope",
            rotary_base=float(parameters.get("rope_theta", hf.get("rotary_emb_base", 10000))),
            rotary_percent=partial_rotary_factor({"rope_parameters": rotary}),
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_eps", 1e-5),
            swiglu=False,
            add_bias_linear=True,
            openai_gelu=activation != "gelu",
            parallel_attention_mlp=hf.get("use_parallel_residual", True),
            untie_embeddings_and_output_weights=True,
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
        )

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (config.normalization != "LayerNorm", "RMSNorm"),
            (not config.add_bias_linear, "no biases"),
            (config.gated_linear_unit or config.squared_relu, "a GLU or squared-ReLU MLP"),
            (config.num_query_groups not in (None, config.num_attention_heads), "grouped queries"),
            (not config.untie_embeddings_and_output_weights, "tied embeddings"),
            (
                scaled_or_no_rope(config) or config.rotary_interleaved,
                "RoPE other than plain RoPE on each head's halves",
            ),
            (config.is_moe or config.window_size is not None, "experts or windows"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        return {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.ffn_hidden_size,
            "hidden_act": "gelu_new" if config.openai_gelu else "gelu",
            "max_position_embeddings": config.max_position_embeddings,
            "layer_norm_eps": config.norm_epsilon,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": config.rotary_base,
                "partial_rotary_factor": config.rotary_percent,
            },
            "use_parallel_residual": config.parallel_attention_mlp,
            "attention_bias": True,
            "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout,
            "tie_word_embeddings": False,
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = {ours: take(theirs) for ours, theirs in _TOP.items()}
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i), i, take, to_hf=False))
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {theirs: state[ours] for ours, theirs in _TOP.items()}
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i), i, state.__getitem__, to_hf=True))
        return out


GPT_NEOX = GPTNeoXAdapter()
