"""What the Hugging Face hybrid families share (hf/nemotron_h.py, hf/granite_hybrid.py): the
Mamba-2 mixer's settings threefold builds (refused by name otherwise), its sizes and the
attention around it as threefold's config, and a Mamba or attention layer's tensors both ways.

The families name the same things differently; `MambaNames` says how one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.checkpoint.hf.common import Take, refuse, split_qkv, stack_qkv
from threefold.config.hybrid import MAMBA_CONV_KERNEL
from threefold.model.mamba import GATED_NORM_EPS

# a Mamba mixer's tensors, the same names in transformers' mixers and threefold's
MAMBA_PARTS = ("dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias", "in_proj.weight")
MAMBA_PARTS += ("norm.weight", "out_proj.weight")


@dataclass(frozen=True)
class MambaNames:
    """A family's config names of the Mamba mixer's settings."""

    eps: str  # the norms' epsilon, which transformers' gated norm takes too
    conv: str  # the convolution's width
    conv_bias: str
    bias: str  # biases on in_proj and out_proj
    state: str
    head_dim: str
    groups: str
    heads: str


def open_step_sizes(limit) -> bool:
    """Whether time_step_limit leaves the step sizes unclamped: (0, inf), the upper end as
    JSON cannot hold it (transformers writes {"__float__": "Infinity"})."""
    if limit is None:
        return True
    low, high = (x.get("__float__", x) if isinstance(x, dict) else x for x in limit)
    return float(low) == 0.0 and math.isinf(float(high))


def check_mamba(hf: dict, names: MambaNames) -> None:
    """Refuse, by name, a Mamba mixer threefold does not build (megatron-core's)."""
    for field, value, wanted, why in (
        (names.conv, hf.get(names.conv, 4), MAMBA_CONV_KERNEL, "megatron-core's 4"),
        (names.conv_bias, hf.get(names.conv_bias, True), True, "a convolution bias"),
        (names.bias, bool(hf.get(names.bias)), False, "no biases on the Mamba projections"),
        ("attention_bias", bool(hf.get("attention_bias")), False, "no attention biases"),
        ("mlp_bias", bool(hf.get("mlp_bias")), False, "no MLP biases"),
        (
            names.eps,
            hf.get(names.eps, 1e-5),
            GATED_NORM_EPS,
            f"the Mamba mixer's gated norm takes it in transformers, megatron-core's "
            f"{GATED_NORM_EPS} in threefold",
        ),
    ):
        refuse(value != wanted, field, value, why)
    limit = hf.get("time_step_limit")
    refuse(not open_step_sizes(limit), "time_step_limit", limit, "step sizes unclamped")


def hybrid_fields(hf: dict, names: MambaNames, pattern: str) -> dict:
    """The config fields a hybrid family's models share: the pattern, the attention's and
    norms' sizes, the Mamba mixers' (ModelConfig's keywords)."""
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    positions = hf.get("max_position_embeddings", 4096)
    return {
        "hybrid_layer_pattern": pattern,
        "num_layers": len(pattern),
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "seq_length": min(positions, 4096),
        "max_position_embeddings": positions,
        "normalization": "RMSNorm",
        "norm_epsilon": hf.get(names.eps, 1e-5),
        "add_bias_linear": False,
        "vocab_size": hf["vocab_size"],
        "init_method_std": hf.get("initializer_range", 0.02),
        "attention_dropout": hf.get("attention_dropout", 0.0),
        "hidden_dropout": 0.0,
        "mamba_state_dim": hf.get(names.state, 128),
        "mamba_head_dim": hf.get(names.head_dim, 64),
        "mamba_num_groups": hf.get(names.groups, 8),
        "mamba_num_heads": hf.get(names.heads, 128),
    }


def take_mamba(take: Take, ours: str, norm: str, mixer: str) -> dict:
    """threefold's Mamba layer `ours` from a family's norm name and mixer prefix."""
    return {
        ours + "norm.weight": take(norm),
        **{ours + "mixer." + name: take(mixer + name) for name in MAMBA_PARTS},
    }


def give_mamba(state: dict, ours: str, norm: str, mixer: str) -> dict:
    return {
        norm: state[ours + "norm.weight"],
        **{mixer + name: state[ours + "mixer." + name] for name in MAMBA_PARTS},
    }


def take_attention(take: Take, config, ours: str, norm: str, attention: str) -> dict:
    """threefold's attention-only layer `ours` from a family's norm name and attention prefix
    (q, k, v and o projections apart, fused into the grouped linear_qkv)."""
    q, k, v = (take(f"{attention}{x}_proj.weight") for x in "qkv")
    return {
        ours + "input_layernorm.weight": take(norm),
        ours + "self_attention.linear_qkv.weight": stack_qkv(q, k, v, config),
        ours + "self_attention.linear_proj.weight": take(attention + "o_proj.weight"),
    }


def give_attention(state: dict, config, ours: str, norm: str, attention: str) -> dict:
    qkv = split_qkv(state[ours + "self_attention.linear_qkv.weight"], config)
    return {
        norm: state[ours + "input_layernorm.weight"],
        **{f"{attention}{x}_proj.weight": t for x, t in zip("qkv", qkv)},
        attention + "o_proj.weight": state[ours + "self_attention.linear_proj.weight"],
    }
