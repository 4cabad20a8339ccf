"""FalconForCausalLM (Falcon-7B, 40B, 180B, Falcon2-11B): LayerNorm, GELU, RoPE on each head's
halves, no biases as a rule, tied embeddings, and one of three layers:

    Falcon-7B     the attention and the MLP side by side, reading one norm (input_layernorm:
                  --parallel-attention-mlp --parallel-attention-mlp-shared-norm); one key and
                  value head (multi_query)
    Falcon2-11B   the same with num_kv_heads groups (new_decoder_architecture,
                  num_ln_in_parallel_attn 1)
    40B, 180B     side by side, each with its norm (ln_attn, ln_mlp: --parallel-attention-mlp),
                  num_kv_heads groups (new_decoder_architecture)
    (and one after the other, input_layernorm then post_attention_layernorm: parallel_attn
    false, one key and value head or one per query head)

Its fused query_key_value holds each group's query heads, then its key and value head (new
architecture), all query heads then the one key and value (multi_query), or each head's query,
key and value in turn: in every case threefold's per-group [q..., k, v] rows, so the weights
only change names. ALiBi (the RW models) is refused by name.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from threefold.checkpoint.hf.common import Adapter, Take, refuse, renamed, scaled_or_no_rope
from threefold.config import ModelConfig

_TOP = {
    "embedding.word_embeddings.weight": "transformer.word_embeddings.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
}
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _norm_names(config: ModelConfig) -> dict[str, str]:
    if config.parallel_attention_mlp_shared_norm:
        return {"input_layernorm": "input_layernorm"}
    if config.parallel_attention_mlp:
        return {"input_layernorm": "ln_attn", "pre_mlp_layernorm": "ln_mlp"}
    return {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}


def _layer_names(i: int, config: ModelConfig) -> dict[str, str]:
    linears = {
        "self_attention.linear_qkv": "self_attention.query_key_value",
        "self_attention.linear_proj": "self_attention.dense",
        "mlp.linear_fc1": "mlp.dense_h_to_4h",
        "mlp.linear_fc2": "mlp.dense_4h_to_h",
    }
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    names = {
        f"{ours}.{kind}": f"{theirs}.{kind}" for ours, theirs in linears.items() for kind in kinds
    }
    for ours, theirs in _norm_names(config).items():
        names.update({f"{ours}.{kind}": f"{theirs}.{kind}" for kind in ("weight", "bias")})
    return {ours: f"transformer.h.{i}.{theirs}" for ours, theirs in names.items()}


class FalconAdapter(Adapter):
    architecture, model_type = "FalconForCausalLM", "falcon"
    parallel_layers: ClassVar[bool] = True
    exports_cohere: ClassVar[bool] = True  # (--parallel-attention-mlp-shared-norm only)

    def model_config(self, hf: dict) -> ModelConfig:
        refuse(bool(hf.get("alibi")), "alibi", hf.get("alibi"), "threefold has no ALiBi")
        activation = hf.get("activation", "gelu")
        refuse(activation not in _GELU, "activation", activation, "GELU (exact or tanh) only")
        parameters = hf.get("rope_parameters") or {}
        refuse(
            parameters.get("rope_type", "default") != "default",
            "rope_parameters.rope_type",
            parameters.get("rope_type"),
            "Falcon's plain RoPE only",
        )
        heads, hidden = hf["num_attention_heads"], hf.get("hidden_size", hf.get("n_embed"))
        new = bool(hf.get("new_decoder_architecture"))
        groups = hf.get("num_kv_heads") or heads
        if not new and hf.get("multi_query", True):
            groups = 1
        parallel = new or hf.get("parallel_attn", True)
        norms = hf.get("num_ln_in_parallel_attn") or (2 if new else 1)
        positions = hf.get("max_position_embeddings", 2048)
        return ModelConfig(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hidden,
            ffn_hidden_size=hf.get("ffn_hidden_size") or 4 * hidden,
            num_attention_heads=heads,
            group_query_attention=groups != heads,
            num_query_groups=groups,
            seq_length=min(positions, 4096),
            max_position_embeddings=positions,
            position_embedding_type="rope",
            rotary_base=float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0))),
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            swiglu=False,
            add_bias_linear=bool(hf.get("bias")),
            openai_gelu=_GELU[activation],
            parallel_attention_mlp=bool(parallel),
            parallel_attention_mlp_shared_norm=bool(parallel) and norms == 1,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
        )

    def check_exportable(self, config: ModelConfig) -> None:
        super().check_exportable(config)
        groups = config.num_query_groups or config.num_attention_heads
        problems = [
            (
                config.normalization != "LayerNorm" or not config.layernorm_bias,
                "norms other than LayerNorm with a bias",
            ),
            (config.add_qkv_bias, "biases on the query, key and value projections only"),
            (config.gated_linear_unit or config.squared_relu, "a GLU or squared-ReLU MLP"),
            (config.logit_scale != 1.0, "--logit-scale"),
            (
                not config.parallel_attention_mlp and groups not in (1, config.num_attention_heads),
                "grouped queries in layers one after the other",
            ),
            (
                scaled_or_no_rope(config)
                or config.rotary_interleaved
                or config.rotary_percent != 1,
                "RoPE other than plain RoPE on every dimension's halves",
            ),
            (config.is_moe or config.window_size is not None, "experts or windows"),
        ]
        self.refuse_problems(problems)

    def hf_config(self, config: ModelConfig) -> dict:
        groups = config.num_query_groups or config.num_attention_heads
        shared = config.parallel_attention_mlp_shared_norm
        # Falcon-7B's layer where it fits, otherwise the new architecture's
        new = config.parallel_attention_mlp and not (shared and groups == 1)
        return {
            **self.common_hf_config(config),
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_kv_heads": groups,
            "new_decoder_architecture": new,
            "multi_query": not new and groups == 1,
            "parallel_attn": config.parallel_attention_mlp,
            "num_ln_in_parallel_attn": (1 if shared else 2) if new else None,
            "ffn_hidden_size": config.ffn_hidden_size,
            "activation": "gelu_pytorch_tanh" if config.openai_gelu else "gelu",
            "bias": config.add_bias_linear,
            "alibi": False,
            "layer_norm_epsilon": config.norm_epsilon,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
            "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout,
            "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        }

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = {ours: take(theirs) for ours, theirs in _TOP.items()}
        if config.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = take("lm_head.weight")
        else:
            used.add("lm_head.weight")  # tied: a copy of the embeddings, if present at all
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i, config), i, take, to_hf=False))
        return out

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        out = {theirs: state[ours] for ours, theirs in _TOP.items()}
        if config.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        for i in range(config.num_layers):
            out.update(renamed(_layer_names(i, config), i, state.__getitem__, to_hf=True))
        return out


FALCON = FalconAdapter()
