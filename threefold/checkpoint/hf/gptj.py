"""GPTJForCausalLM (GPT-J 6B and its fine-tunes): the attention and the MLP side by side,
reading one LayerNorm (ln_1: --parallel-attention-mlp --parallel-attention-mlp-shared-norm);
q, k and v projections apart and out_proj without biases, fc_in and fc_out with them
(--disable-bias-linear --add-mlp-bias), a GELU between them (gelu_new: --openai-gelu); RoPE of
base 10000 on adjacent pairs of the first rotary_dim dimensions of each head
(--rotary-interleaved --rotary-percent rotary_dim / head size: the weights map as they are);
an output layer of its own with a bias (lm_head: --output-layer-bias). resid_pdrop is
--hidden-dropout, attn_pdrop --attention-dropout."""

from __future__ import annotations

from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import (
    Adapter,
    Take,
    refuse,
    renamed,
    scaled_or_no_rope,
    split_qkv,
    stack_qkv,
)
from threefold.config import ModelConfig

_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
_TOP = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",
    "output_layer.bias": "lm_head.bias",
}


def _layer_names(i: int) -> dict[str, str]:
    """threefold name suffix -> HF name of layer i's tensors that are only renamed."""
    p = f"transformer.h.{i}."
    names = {
        "input_layernorm.weight": "ln_1.weight",
        "input_layernorm.bias": "ln_1.bias",
        "self_attention.linear_proj.weight": "attn.out_proj.weight",
    }
    for ours, theirs in (("mlp.linear_fc1", "mlp.fc_in"), ("mlp.linear_fc2", "mlp.fc_out")):
        names.update({f"{ours}.{kind}": f"{theirs}.{kind}" for kind in ("weight", "bias")})
    return {ours: p + theirs for ours, theirs in names.items()}


class GPTJAdapter(Adapter):
    architecture, model_type = "GPTJForCausalLM", "gptj"
    parallel_layers: ClassVar[bool] = True
    partial_rope: ClassVar[bool] = True
    rotates_halves: ClassVar[bool] = False
    exports_cohere: ClassVar[bool] = True  # (--parallel-attention-mlp-shared-norm only)
    exports_phi: ClassVar[bool] = True  # (--output-layer-bias)
    mlp_only_biases: ClassVar[bool] = True

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("activation_function", "gelu_new")
        refuse(activation not in _GELU, "activation_function", activation, "GELU only")
        hidden, heads = hf["n_embd"], hf["n_head"]
        rotary = hf.get("rotary_dim") or hidden // heads
        positions = hf.get("n_positions", 2048)
        return ModelConfig(
            num_layers=hf["n_layer"],
            hidden_size=hidden,
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            num_attention_heads=heads,
            seq_length=min(positions, 4096),
            max_position_embeddings=positions,
            position_embedding_type="rope",
            rotary_base=10000.0,
            rotary_percent=rotary / (hidden // heads),
            rotary_interleaved=True,
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            swiglu=False,
            openai_gelu=_GELU[activation],
            add_bias_linear=False,
            add_mlp_bias=True,
            output_layer_bias=True,
            parallel_attention_mlp=True,
            parallel_attention_mlp_shared_norm=True,
            untie_embeddings_and_output_weights=True,
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attn_pdrop", 0.0),
            hidden_dropout=hf.get("resid_pdrop", 0.0),
        )

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        problems = [
            (
                config.normalization != "LayerNorm" or not config.layernorm_bias,
                "norms other than LayerNorm with a bias",
            ),
            (
                not config.parallel_attention_mlp_shared_norm,
                "layers other than the attention and the MLP reading one norm side by side",
            ),
            (
                config.add_bias_linear or config.add_qkv_bias or not config.add_mlp_bias,
                "biases other than the MLP's alone (--disable-bias-linear --add-mlp-bias)",
            ),
            (config.gated_linear_unit or config.squared_relu, "a GLU or squared-ReLU MLP"),
            (config.num_query_groups != config.num_attention_heads, "grouped queries"),
            (
                scaled_or_no_rope(config)
                or not config.rotary_interleaved
                or config.rotary_base != 10000.0,
                "RoPE other than plain RoPE of base 10000 on adjacent pairs",
            ),
            (not config.untie_embeddings_and_output_weights, "tied embeddings"),
            (config.logit_scale != 1.0, "--logit-scale"),
            (config.is_moe or config.window_size is not None, "experts or windows"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        head = config.kv_channels
        return {
            **self.common_hf_config(config),
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_inner": config.ffn_hidden_size,
            "n_positions": config.max_position_embeddings,
            "rotary_dim": round(config.rotary_percent * head),
            "activation_function": "gelu_new" if config.openai_gelu else "gelu",
            "layer_norm_epsilon": config.norm_epsilon,
            "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout,
            "attn_pdrop": config.attention_dropout,
            "tie_word_embeddings": False,
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = {ours: take(theirs) for ours, theirs in _TOP.items()}
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i), i, take, to_hf=False))
            p = f"transformer.h.{i}.attn."
            qkv = [take(p + f"{x}_proj.weight") for x in "qkv"]
            out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = stack_qkv(*qkv, config)
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {theirs: state[ours] for ours, theirs in _TOP.items() if ours != "output_layer.bias"}
        bias = state.get("output_layer.bias")
        if bias is None:  # (GPT-J's with a zero bias computes this model)
            bias = out["transformer.wte.weight"].new_zeros(len(out["transformer.wte.weight"]))
        out["lm_head.bias"] = bias
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i), i, state.__getitem__, to_hf=True))
            qkv = state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"]
            q, k, v = split_qkv(qkv, config, halves=False)
            p = f"transformer.h.{i}.attn."
            out.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
        return out


GPTJ = GPTJAdapter()
