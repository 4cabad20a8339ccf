"""The model sizes FP8 GEMMs take on CUDA, checked before the model is built (kernels/dispatch.py's
`configure_for_model`): a size cuBLASLt refuses would otherwise fail deep in the first step."""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.config.errors import ConfigError


def check_fp8_shapes(model: ModelConfig, tensor_parallel_size: int) -> None:
    """cuBLASLt's FP8 GEMMs take dimensions that are multiples of 16: every linear layer's
    input and output features on one TP rank (the token count is checked by the GEMM)."""
    tp = tensor_parallel_size
    query_groups = model.num_query_groups
    heads = model.num_attention_heads
    features = {
        "--hidden-size / TP": model.hidden_size // tp,
        "--hidden-size": model.hidden_size,
        "--ffn-hidden-size / TP": model.ffn_hidden_size // tp,
    }
    if model.multi_latent_attention:
        features |= {
            "--kv-lora-rank": model.kv_lora_rank,
            "--kv-lora-rank + --qk-pos-emb-head-dim": model.kv_lora_rank
            + model.qk_pos_emb_head_dim,
            "attention heads x (--qk-head-dim + --qk-pos-emb-head-dim) / TP": heads
            * model.q_head_dim
            // tp,
            "attention heads x (--qk-head-dim + --v-head-dim) / TP": heads
            * (model.qk_head_dim + model.v_head_dim)
            // tp,
            "attention heads x --v-head-dim / TP": heads * model.v_head_dim // tp,
        }
        if model.q_lora_rank is not None:
            features["--q-lora-rank"] = model.q_lora_rank
    else:
        features |= {
            "attention heads x --kv-channels / TP": heads * model.kv_channels // tp,
            "query groups x --kv-channels / TP": query_groups * model.kv_channels // tp,
        }
    for what, size in features.items():
        if size % 16:
            raise ConfigError(
                f"--fp8-format on CUDA: {what} is {size}, but FP8 GEMMs need multiples of 16; "
                "choose model sizes (or a TP size) that give multiples of 16"
            )
