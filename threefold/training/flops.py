"""Model FLOPs per training iteration, counted as Megatron-LM and torchtitan count them.

Only matrix multiplications count, each as 2 FLOPs per multiply-add; backward costs twice the
forward, so a training step is 3x the forward. Per token and layer the forward does
- attention projections: 2 h (h + 2 g d) for QKV (g query groups of size d) plus 2 h^2 for the
  output projection;
- attention scores and weighted sum: 2 * 2 s h (the full s x s product, as Megatron counts it
  even though causal masking could skip half);
- MLP: 2 * 2 h f, or 2 * 3 h f with SwiGLU (gate, up and down projections); in an MoE layer
  the k experts a token is routed to (expert size f_e), the shared expert (size f_s) and the
  router 2 h E: active parameters only, as Megatron counts them (under --moe-latent-size the
  experts at the latent width l, plus 2 * 2 h l for the projections down and up);
and the output layer 2 h V. Multi-latent attention's projections are counted as Megatron-LM
counts them (`_mla_flops_per_token`), and so are gated delta net layers
(`gated_delta_net_flops_per_token`), a hybrid stack's Mamba layers (`mamba_flops_per_token`;
its attention, MLP and MoE layers each count their part above), --attention-output-gate's
gate projection (2 h^2 more for QKV) and multi-token prediction's depths (a layer each, its
norms and projection, its logits). See docs/performance.md for the derivation and MFU.
"""

from __future__ import annotations

from threefold.config import ModelConfig


def training_flops_per_iteration(
    config: ModelConfig, global_batch_size: int, padded_vocab_size: int
) -> float:
    h, s = config.hidden_size, config.seq_length
    d, heads, groups = config.kv_channels, config.num_attention_heads, config.num_query_groups
    f = config.ffn_hidden_size
    attention = attention_flops_per_token(config)
    if config.multi_latent_attention:
        qkv, projection = _mla_flops_per_token(config)
    else:
        gate = heads if config.attention_output_gate else 0
        qkv = 2 * h * d * (heads + 2 * groups + gate)
        projection = 2 * d * heads * h
    per_size = 2 * (3 if config.swiglu else 2) * h  # FLOPs per unit of MLP hidden size
    dense = per_size * f
    moe = 0
    if config.is_moe:
        shared = config.moe_shared_expert_intermediate_size or 0
        routed = config.moe_router_topk * config.moe_ffn_hidden_size
        moe = per_size * (routed + shared) + 2 * h * config.num_experts
        if config.moe_latent_size:  # experts at the latent width, and its two projections
            moe += per_size * routed * (config.moe_latent_size - h) // h
            moe += 2 * 2 * h * config.moe_latent_size
    depths = config.mtp_num_layers or 0
    per_token_forward = 0
    linear = config.linear_attention_pattern(config.num_layers)
    # (a hybrid model's multi-token prediction depths: their patterns' layers; every depth
    # computes, its weights shared or not)
    symbols = config.hybrid_layers_with_mtp(depths) if config.hybrid else ""
    for layer, is_moe in enumerate(config.layer_pattern_with_mtp(depths)):
        symbol = symbols[layer] if layer < len(symbols) else None
        if symbol == "M":  # a hybrid stack's layers hold one part each
            per_token_forward += mamba_flops_per_token(config)
            continue
        if symbol in ("-", "E"):
            pass
        elif symbol == "G" or (symbol is None and layer < len(linear) and linear[layer]):
            per_token_forward += gated_delta_net_flops_per_token(config)
        else:
            per_token_forward += qkv + projection + attention
        if symbol not in ("*", "G"):  # (attention or a gated delta net alone)
            per_token_forward += moe if is_moe else dense
    # Each MTP depth's norms (Megatron-LM counts 3h multiply-adds) and projection [2h -> h],
    # and every depth's logits beside the main ones.
    per_token_forward += depths * 2 * (3 * h + 2 * h * h)
    per_token_forward += (1 + depths) * 2 * h * padded_vocab_size
    return 3.0 * per_token_forward * global_batch_size * s


def attention_flops_per_token(config: ModelConfig) -> int:
    """The core attention's forward FLOPs per token and layer: scores and weighted sum over the
    whole s x s (as Megatron-LM counted them before halving for the causal mask)."""
    heads, s = config.num_attention_heads, config.seq_length
    if config.multi_latent_attention:
        return 2 * s * heads * (config.q_head_dim + config.v_head_dim)
    return 2 * 2 * s * config.kv_channels * heads


def gated_delta_net_flops_per_token(config: ModelConfig) -> int:
    """A gated delta net layer's forward FLOPs per token, as Megatron-LM counts them: its
    projections, the convolution, and 4 d_v^2 per value head for the rule's products."""
    h, d_v, heads = config.hidden_size, config.linear_value_head_dim, config.linear_num_value_heads
    qk, v = config.linear_num_key_heads * config.linear_key_head_dim, heads * d_v
    in_proj = h * (2 * qk + 2 * v + 2 * heads)
    conv = config.linear_conv_kernel_dim * (2 * qk + v)
    return 2 * (in_proj + conv + 4 * heads * d_v * d_v + h * v)


def mamba_flops_per_token(config: ModelConfig) -> int:
    """A Mamba layer's forward FLOPs per token, as Megatron-LM counts them: in_proj,
    7 d_inner N for the scan, out_proj."""
    h, sections = config.hidden_size, config.mamba_sections()
    inner = sections[1]
    return 2 * h * sum(sections) + 7 * inner * config.mamba_state_dim + 2 * inner * h


def _mla_flops_per_token(config: ModelConfig) -> tuple[int, int]:
    """Multi-latent attention's forward FLOPs per token: (the projections to query, key and
    value, the output projection), the first as Megatron-LM counts them (the latents' down and
    up projections, one multiply per latent element for its norm, the shared RoPE key part)."""
    h, heads = config.hidden_size, config.num_attention_heads
    q_head, v_head, rope = config.q_head_dim, config.v_head_dim, config.qk_pos_emb_head_dim
    if config.q_lora_rank is None:
        query = h * heads * q_head
    else:
        query = config.q_lora_rank * (h + heads * q_head + 1)
    key_value = config.kv_lora_rank * (h + heads * (config.qk_head_dim + v_head) + 1)
    return 2 * (query + key_value + h * rope), 2 * heads * v_head * h


# Dense bf16 peak of the GPUs MFU is reported for (TFLOP/s, no sparsity); the first key found
# in the device name wins, so the PCIe and NVL variants come before the SXM default.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None
