"""The models the megatron-core tests build (tests/megatron_core_models.py): one dict of
TransformerConfig fields (and Megatron-LM args) per kind, LLaMA- and GPT-2-style bases and
the variants each architecture flag makes of them."""

from __future__ import annotations

SHAPES = {
    "llama": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        rotary_base=500000.0,
        rotary_interleaved=False,
        rotary_percent=1.0,
        squared_relu=False,
        norm_epsilon=1e-5,
    ),
    "gpt2": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=256,
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False,
        rotary_base=10000.0,
        rotary_interleaved=False,
        rotary_percent=1.0,
        squared_relu=False,
        norm_epsilon=1e-5,
    ),
}
# RoPE on adjacent pairs of the head dimension (Megatron-LM's --rotary-interleaved)
SHAPES["llama_interleaved"] = {**SHAPES["llama"], "rotary_interleaved": True}
# RoPE on half of each head's dimensions (--rotary-percent 0.5, Nemotron's)
SHAPES["llama_partial_rotary"] = {**SHAPES["llama"], "rotary_percent": 0.5}
# A sliding window of 3 keys back in every other layer (--window-size 3,0
# --window-attn-skip-freq 2: layers 2 and 4 keep full attention)
SHAPES["llama_window"] = {**SHAPES["llama"], "window_size": (3, 0), "window_attn_skip_freq": 2}
# GPT-OSS's attention sinks: a learned softmax logit per head (--softmax-type learnable), and
# the fixed logit 0 (off-by-one)
SHAPES["llama_sinks"] = {**SHAPES["llama"], "softmax_type": "learnable"}
SHAPES["llama_off_by_one"] = {**SHAPES["llama"], "softmax_type": "off-by-one"}
# GPT-OSS's MLP: quick_gelu(gate) * (up + 1), the halves clamped (at a value they reach here)
SHAPES["quick_geglu"] = {
    **SHAPES["llama"],
    "swiglu": False,
    "quick_geglu": True,
    "glu_linear_offset": 1.0,
    "activation_func_clamp_value": 0.05,
}
# relu(x)^2 MLPs (Megatron-LM's --squared-relu)
SHAPES["gpt2_squared_relu"] = {**SHAPES["gpt2"], "squared_relu": True}
# Nemotron's layer (Minitron's flags but --apply-layernorm-1p, which megatron-core's local
# spec does not build): LayerNorm, a squared-ReLU MLP, RoPE on half of each head
SHAPES["nemotron"] = {
    **SHAPES["llama"],
    "normalization": "LayerNorm",
    "swiglu": False,
    "squared_relu": True,
    "rotary_percent": 0.5,
}
# Multi-latent attention (Megatron-LM's --multi-latent-attention): learned positions beside
# MLA's own YaRN RoPE (as Megatron-LM's functional test), a query latent, latent norms, and a
# value head narrower than the query/key head; then plain RoPE, queries straight from the
# hidden state and a value head wider than the query/key head.
MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=12,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
    rope_type="yarn",
    rotary_scaling_factor=40.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    qk_layernorm=True,
)
SHAPES["mla"] = {
    **SHAPES["llama"],
    **MLA,
    "num_query_groups": 4,
    "position_embedding_type": "learned_absolute",
}
SHAPES["mla_rope"] = {
    **SHAPES["llama"],
    **MLA,
    "num_query_groups": 4,
    "q_lora_rank": None,
    "v_head_dim": 24,
    "rope_type": "rope",
    "qk_layernorm": False,
}
MLA_FIELDS = tuple(MLA)
# DeepSeek sparse attention (--experimental-attention-variant dsa) on that MLA: each query
# attends to the 6 keys an indexer of 4 heads of 16 scores highest (of up to 16), the indexer
# learning from its KL loss (weight 0.1)
DSA = dict(
    experimental_attention_variant="dsa",
    dsa_indexer_n_heads=4,
    dsa_indexer_head_dim=16,
    dsa_indexer_topk=6,
    dsa_indexer_loss_coeff=0.1,
    dsa_indexer_use_sparse_loss=False,
)
SHAPES["dsa"] = {**SHAPES["mla"], **DSA}
# ... over each query's top 6 only, RoPE on the indexer's heads MLA's way
SHAPES["dsa_sparse_interleaved"] = {
    **SHAPES["dsa"],
    "dsa_indexer_use_sparse_loss": True,
    "dsa_indexer_rope_interleaved": True,
}
# YaRN on other attention (--position-embedding-type yarn): 4x over an original context of 8,
# so the sequence of 16 reaches past it
YARN = dict(
    rotary_scaling_factor=4.0,
    mscale=1.0,
    mscale_all_dim=0.0,
    yarn_original_max_position_embeddings=8,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_correction_range_round_to_int=True,
)
SHAPES["llama_yarn"] = {**SHAPES["llama"], "position_embedding_type": "yarn", **YARN}
# Llama 4's attention: RoPE on adjacent pairs, skipped in every other layer (--no-rope-freq 2;
# Llama 4 skips it in every fourth), queries and keys scaled to unit RMS (--qk-l2-norm)
SHAPES["llama4"] = {
    **SHAPES["llama"],
    "rotary_interleaved": True,
    "no_rope_freq": 2,
    "qk_l2_norm": True,
}
# Mixture of experts (--num-experts): DeepSeek-V3's routing (sigmoid scores, an expert bias,
# scaled weights) and a shared expert, with a first dense layer (--moe-layer-freq [0,1,1,1]:
# megatron-core keeps such a model's layers apart); then every layer MoE (stacked layers),
# softmax routing, no shared expert.
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1, 1, 1],
    moe_shared_expert_intermediate_size=48,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5,
)
SHAPES["moe"] = {**SHAPES["llama"], **MOE}
# A hybrid (megatron-core's MambaModel, tests/megatron_core_hybrid.py): Mamba, attention, MLP
# and expert layers, no position embedding (Nemotron-H's); 8 Mamba heads of 16 in 2 groups
SHAPES["hybrid"] = {
    **SHAPES["llama"],
    "hybrid_layer_pattern": "M*M-E",
    "num_layers": 5,
    "position_embedding_type": "none",
    "mamba_state_dim": 8,
    "mamba_head_dim": 16,
    "mamba_num_groups": 2,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
}
# its four layers split over two pipeline stages as megatron-core 0.16 splits a hybrid's: "M*"
# and "ME"
SHAPES["hybrid4"] = {**SHAPES["hybrid"], "hybrid_layer_pattern": "M*ME", "num_layers": 4}
# without expert layers (megatron-core trains those under TP only with sequence parallelism,
# which its CPU norms lack)
SHAPES["hybrid_dense"] = {
    **SHAPES["hybrid"],
    "hybrid_layer_pattern": "M*M-",
    "num_layers": 4,
    "num_experts": None,
    "moe_ffn_hidden_size": None,
}
# as the newer Megatron-LM's Mamba mixers hold their parameters (tests/megatron_core_hybrid.py
# `hold_conv_params`; not one of Megatron-LM's args)
SHAPES["hybrid_newer"] = {**SHAPES["hybrid"], "mixer_conv_own": True}
SHAPES["hybrid_dense_newer"] = {**SHAPES["hybrid_dense"], "mixer_conv_own": True}
SHAPES["moe_stacked"] = {
    **SHAPES["llama"],
    **MOE,
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
}
# GPT-OSS as megatron-core builds it: every layer MoE, biases on every linear layer and on
# the router (add_bias_linear), its MLP, attention sinks, a sliding window in every other
# layer, and YaRN with its correction range not rounded
SHAPES["gpt_oss"] = {
    **SHAPES["moe_stacked"],
    "add_bias_linear": True,
    "swiglu": False,
    "quick_geglu": True,
    "glu_linear_offset": 1.0,
    "activation_func_clamp_value": 0.05,
    "softmax_type": "learnable",
    "window_size": (3, 0),
    "window_attn_skip_freq": 2,
    "position_embedding_type": "yarn",
    **YARN,
    "yarn_correction_range_round_to_int": False,
}
# Multi-token prediction (--mtp-num-layers 2) on the MoE model: each depth's layer is MoE, as
# the last decoder layer is.
SHAPES["moe_mtp"] = {**SHAPES["moe"], "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}
# ... over three stages laid out as DeepSeek-V3's (--pipeline-model-parallel-layout): the
# depths on a stage of their own, beside the last layers, the loss on the last stage alone
SHAPES["moe_mtp_layout"] = {**SHAPES["moe_mtp"], "pipeline_model_parallel_layout": "Et|tttmm|L"}
# ... and one depth on GPT-2 (learned positions, which the depth's embedding shifts; tied)
SHAPES["gpt2_mtp"] = {**SHAPES["gpt2"], "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3}
# Llama 4 Maverick's mixture on that attention: experts in every other layer, top-1 sigmoid
# routing, a shared expert, and each token scaled by its routing weight before its expert
# (--moe-apply-probs-on-input)
SHAPES["llama4_moe"] = {
    **SHAPES["llama4"],
    **MOE,
    "moe_layer_freq": [0, 1, 0, 1],
    "moe_router_topk": 1,
    "moe_router_enable_expert_bias": False,
    "moe_router_topk_scaling_factor": None,
    "moe_apply_probs_on_input": True,
}
# A mixture to upcycle the LLaMA model into (--moe-use-upcycling): every layer's 96-wide MLP
# in pieces of 48 (granularity 2) over 4 experts, top 2, no shared expert
SHAPES["llama_upcycled"] = {**SHAPES["moe_stacked"], "moe_ffn_hidden_size": 48}
