"""megatron-core's parameters as its modules hold them: the order a layer registers them in,
which of them TP splits and along which dimension, and which it stores a section at a time.

The distributed optimizer lays Adam's state out in its gradient buffers in registration order
(checkpoint/megatron/buckets.py), and the legacy format keeps each TP rank's shard
(checkpoint/megatron/legacy_tensors.py), so reading either takes these facts of the modules
megatron-core builds. A module registers its own parameters before its submodules' (so a Mamba
mixer's dt_bias, A_log and D come before its in_proj), each module its weight before its bias.
Megatron-LM's mixers since its change #4899 (June 2026, after megatron-core 0.16) hold the
convolution's weight and bias as their own parameters, first (`conv1d_weight`, `conv1d_bias`:
`conv_own`); their checkpoint keys stayed `conv1d.weight` and `conv1d.bias`.
"""

from __future__ import annotations

import re

# Transformer Engine's fused norms under the local spec's module names
NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "self_attention.linear_q_up_proj.layer_norm_": "self_attention.q_layernorm.",
    "self_attention.linear_kv_up_proj.layer_norm_": "self_attention.kv_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    "mixer.in_proj.layer_norm_": "norm.",  # a hybrid model's Mamba layer's
}
# megatron-core's local-spec layers register their modules in this order: a TransformerLayer's
# (a hybrid's attention, MLP and expert layers are TransformerLayers with some modules left
# out), then a Mamba layer's (its mixer, then its norm).
LAYER_ORDER = (
    "input_layernorm.",
    # learnable softmax offsets (gpt-oss's sinks); a sparse attention's indexer
    "self_attention.core_attention.softmax_offset",
    "self_attention.core_attention.indexer.linear_wq_b.",
    "self_attention.core_attention.indexer.linear_wk.",
    "self_attention.core_attention.indexer.k_norm.",
    "self_attention.core_attention.indexer.linear_weights_proj.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.linear_q_proj.",  # multi-latent attention's
    "self_attention.linear_q_down_proj.",
    "self_attention.linear_q_up_proj.",
    "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "self_attention.kv_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.router.",
    "mlp.experts.experts.linear_fc1.",
    "mlp.experts.experts.linear_fc2.",
    "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
    "mlp.shared_experts.gate_weight",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
    "mixer.dt_bias",
    "mixer.A_log",
    "mixer.D",
    "mixer.in_proj.",
    "mixer.conv1d.",
    "mixer.norm.",
    "mixer.out_proj.",
    "norm.",
)
EXPERTS = LAYER_ORDER.index("mlp.experts.experts.linear_fc1.")
# Transformer Engine's spec fuses a norm into the linear layer after it (a LayerNormLinear
# registers the norm first): the norm comes just before that layer. (A multi-latent attention
# layer's input norm stays a module of its own, first.)
_TE_FUSED = {
    "input_layernorm.": "self_attention.linear_qkv.",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.",
    "norm.": "mixer.in_proj.",
}
# a multi-token prediction layer's modules, its transformer layer's parameters in between
MTP_ORDER = ("enorm.", "hnorm.", "eh_proj.", "transformer_layer.", "final_layernorm.")
MTP = re.compile(
    r"^mtp\.layers\.(\d+)\.((?:enorm|hnorm|eh_proj|transformer_layer|final_layernorm)\..+)$"
)
# model tensors that are buffers, not parameters (no optimizer state)
BUFFERS = (".expert_bias",)
# the parameters outside the layers, by module, in megatron-core's GPTModel's order (the
# decoder's layers come after the embeddings, its multi-token prediction block after its final
# norm, before the output layer); a hybrid stack's final norm is its `final_norm`
OUTSIDE_LAYERS = (
    "embedding.word_embeddings",
    "embedding.position_embeddings",
    "decoder.final_layernorm",
    "output_layer",
    "decoder.final_norm",
)
# megatron-core's sections of a gated delta net's and a Mamba mixer's tensors, in threefold's
# order along rows: torch_dist stores each apart, and each TP rank holds its share of each,
# one after another
SECTIONS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.conv1d.weight": ("query", "key", "value"),
    "mixer.in_proj.weight": ("z", "x", "B", "C", "dt"),
    "mixer.conv1d.weight": ("x", "B", "C"),
    "mixer.conv1d.bias": ("x", "B", "C"),
}
# split over TP (an expert's: expert-TP) along rows, or along columns (row-parallel layers);
# every other parameter is whole on each TP rank. Multi-latent attention's down projections
# are column-parallel in the local spec, duplicated in Transformer Engine's. A Mamba mixer is
# split by heads (and its B and C by groups) throughout.
_SPLIT = re.compile(
    r"^(embedding\.word_embeddings\.weight|output_layer\.weight|.*eh_proj\.weight"
    r"|.*linear_(qkv|proj|fc1|fc2|q_proj|q_up_proj|kv_up_proj)\.weight|.*linear_(qkv|fc1)\.bias"
    r"|.*core_attention\.softmax_offset"
    r"|.*mixer\.(in_proj\.weight|conv1d\.weight|conv1d\.bias|dt_bias|A_log|D|norm\.weight"
    r"|out_proj\.weight))$"
)
_DOWN_PROJECTIONS = re.compile(r"^.*linear_(q|kv)_down_proj\.weight$")
_COLUMNS = re.compile(r"^.*(linear_proj|linear_fc2|mixer\.out_proj)\.weight$")


def tp_split_dim(rest: str, te_spec: bool) -> int | None:
    """The dimension megatron-core splits a parameter (a key, or a layer's name within the
    layer) along over TP (an expert's: expert-TP); None where each TP rank holds it whole."""
    if not (_SPLIT.match(rest) or (not te_spec and _DOWN_PROJECTIONS.match(rest))):
        return None
    return 1 if _COLUMNS.match(rest) else 0


def _canonical(rest: str) -> str:
    for fused, own in NORMS.items():
        if rest.startswith(fused):
            return own + rest[len(fused) :]
    return rest


def layer_order(
    rest: str, expert: int | None, te_spec: bool, mla: bool, grouped: bool, conv_own: bool = False
) -> tuple:
    """Where a layer's parameter comes among the layer's, as megatron-core registers them
    (`grouped`: Transformer Engine's GroupedLinear experts; `conv_own`: a Mamba mixer's
    convolution its own parameters, newer Megatron-LM's); None for a name it has not."""
    rest = _canonical(rest)
    position = next((i for i, p in enumerate(LAYER_ORDER) if rest.startswith(p)), None)
    if position is None:
        return None
    module = LAYER_ORDER[position]
    fused_into = _TE_FUSED.get(module)
    if te_spec and fused_into and not (mla and position == 0):
        position = LAYER_ORDER.index(fused_into) - 0.5
    if conv_own and module == "mixer.conv1d.":
        position = LAYER_ORDER.index("mixer.dt_bias") - 0.5
    bias = rest.endswith("bias")
    if expert is None:
        return (position, bias)
    if grouped:  # GroupedLinear: fc1's weight0..N, then fc2's
        return (position, bias, expert)
    return (EXPERTS, expert, position, bias)  # SequentialMLP: expert by expert
