"""Hugging Face <-> threefold: configs and weights, one adapter per model family.

    llama.py   LlamaForCausalLM (Llama 2/3, SmolLM-style tied embeddings), MistralForCausalLM
               (without sliding-window attention), Qwen2ForCausalLM (QKV bias),
               Qwen3ForCausalLM (RMSNorm on each query and key head: --qk-layernorm)
    moe.py     MixtralForCausalLM, Qwen3MoeForCausalLM (mixtures of experts)
    deepseek.py  DeepseekV3ForCausalLM (multi-latent attention, DeepSeek-V3's routing)
    qwen3_next.py  Qwen3NextForCausalLM (gated delta nets, gated attention and shared expert)
    gpt2.py    GPT2LMHeadModel
    common.py  what they share: refusals, RoPE settings, the QKV layouts, the conversion driver

A config field threefold cannot reproduce (RoPE scaling, sliding windows, biases on only some
projections, other activations) is refused by name: a conversion never produces a silently
different model. A new family is a new adapter and one line in `ADAPTERS`.
"""

from __future__ import annotations

import torch

from threefold.checkpoint.hf.common import Adapter, refuse
from threefold.checkpoint.hf.deepseek import DEEPSEEK_V3
from threefold.checkpoint.hf.gpt2 import GPT2
from threefold.checkpoint.hf.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from threefold.checkpoint.hf.moe import MIXTRAL, QWEN3_MOE
from threefold.checkpoint.hf.qwen3_next import QWEN3_NEXT
from threefold.config import ModelConfig

ADAPTERS: dict[str, Adapter] = {
    adapter.architecture: adapter
    for adapter in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, QWEN3_NEXT, DEEPSEEK_V3, GPT2)
}


def architecture_of(hf: dict) -> str:
    model_types = {adapter.model_type: name for name, adapter in ADAPTERS.items()}
    names = hf.get("architectures") or [model_types.get(hf.get("model_type"), "?")]
    refuse(names[0] not in ADAPTERS, "architectures", names, f"supported: {', '.join(ADAPTERS)}")
    return names[0]


def model_config_from_hf(hf: dict) -> tuple[str, ModelConfig]:
    """(architecture, threefold model config) of a Hugging Face config.json."""
    architecture = architecture_of(hf)
    config = ADAPTERS[architecture].model_config(hf)
    config.finalize()
    return architecture, config


def hf_config_from_model_config(config: ModelConfig, architecture: str) -> dict:
    return ADAPTERS[architecture].hf_config(config)


def hf_to_threefold(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, architecture: str
) -> dict[str, torch.Tensor]:
    """Full threefold tensors (unpadded vocabulary) from a Hugging Face state dict."""
    return ADAPTERS[architecture].to_threefold(hf_state, config)


def threefold_to_hf(
    state: dict[str, torch.Tensor], config: ModelConfig, architecture: str
) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_threefold` (tied embeddings: no lm_head tensor, as HF saves)."""
    return ADAPTERS[architecture].to_hf(state, config)
