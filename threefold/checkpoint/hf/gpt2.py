"""GPT2LMHeadModel: LayerNorm, GELU, learned positions, biases, tied embeddings; its fused
c_attn is [all q; all k; all v] and its Conv1D weights are stored transposed."""

from __future__ import annotations

import torch

from threefold.checkpoint.hf.common import Adapter, Take, refuse, renamed, split_qkv, stack_qkv
from threefold.config import ModelConfig


def _layer_names(i: int) -> dict[str, str]:
    """threefold name suffix -> HF name for one layer (the tensors that are only renamed)."""
    p = f"transformer.h.{i}."
    return {
        "input_layernorm.weight": p + "ln_1.weight",
        "input_layernorm.bias": p + "ln_1.bias",
        "pre_mlp_layernorm.weight": p + "ln_2.weight",
        "pre_mlp_layernorm.bias": p + "ln_2.bias",
        "self_attention.linear_proj.bias": p + "attn.c_proj.bias",
        "mlp.linear_fc1.bias": p + "mlp.c_fc.bias",
        "mlp.linear_fc2.bias": p + "mlp.c_proj.bias",
    }


_TOP = {
    "embedding.word_embeddings.weight": "transformer.wte.weight",
    "embedding.position_embeddings.weight": "transformer.wpe.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
}
# threefold suffix -> HF name of the Conv1D weights, stored transposed
_TRANSPOSED = {
    "self_attention.linear_proj.weight": "attn.c_proj.weight",
    "mlp.linear_fc1.weight": "mlp.c_fc.weight",
    "mlp.linear_fc2.weight": "mlp.c_proj.weight",
}


class GPT2Adapter(Adapter):
    architecture, model_type = "GPT2LMHeadModel", "gpt2"

    def model_config(self, hf: dict) -> ModelConfig:
        activation = hf.get("activation_function", "gelu_new")
        refuse(
            activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu"),
            "activation_function",
            activation,
            "GELU (exact or tanh) only",
        )
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            refuse(bool(hf.get(field)), field, hf.get(field), "not implemented")
        refuse(
            hf.get("scale_attn_weights") is False,
            "scale_attn_weights",
            False,
            "attention is always scaled by 1/sqrt(head size)",
        )
        hidden = hf["n_embd"]
        return ModelConfig(
            num_layers=hf["n_layer"],
            hidden_size=hidden,
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            num_attention_heads=hf["n_head"],
            seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            swiglu=False,
            add_bias_linear=True,
            openai_gelu=activation != "gelu",
            untie_embeddings_and_output_weights=False,
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            hidden_dropout=hf.get("resid_pdrop", 0.1),
        )

    def hf_config(self, config: ModelConfig) -> dict:
        return {
            **self.common_hf_config(config),
            "n_embd": config.hidden_size,
            "n_layer": config.num_layers,
            "n_head": config.num_attention_heads,
            "n_positions": config.max_position_embeddings,
            "n_inner": config.ffn_hidden_size,
            "layer_norm_epsilon": config.norm_epsilon,
            "activation_function": "gelu_new" if config.openai_gelu else "gelu",
            "attn_pdrop": config.attention_dropout,
            "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout,
            "tie_word_embeddings": True,
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = {ours: take(theirs) for ours, theirs in _TOP.items()}
        for i in range(config.num_layers):
            ours, p = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out.update(renamed(_layer_names(i), i, take, to_hf=False))
            q, k, v = take(p + "attn.c_attn.weight").t().chunk(3, dim=0)
            out[ours + "self_attention.linear_qkv.weight"] = stack_qkv(q, k, v, config)
            q, k, v = take(p + "attn.c_attn.bias").chunk(3, dim=0)
            out[ours + "self_attention.linear_qkv.bias"] = stack_qkv(q, k, v, config)
            out.update(
                {ours + suffix: take(p + theirs).t() for suffix, theirs in _TRANSPOSED.items()}
            )
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {theirs: state[ours] for ours, theirs in _TOP.items()}
        for i in range(config.num_layers):
            ours, p = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out.update(renamed(_layer_names(i), i, state.__getitem__, to_hf=True))
            qkv = state[ours + "self_attention.linear_qkv.weight"]
            out[p + "attn.c_attn.weight"] = torch.cat(split_qkv(qkv, config)).t()
            bias = state[ours + "self_attention.linear_qkv.bias"]
            out[p + "attn.c_attn.bias"] = torch.cat(split_qkv(bias, config))
            out.update(
                {p + theirs: state[ours + suffix].t() for suffix, theirs in _TRANSPOSED.items()}
            )
        return out


GPT2 = GPT2Adapter()
