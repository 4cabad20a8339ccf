"""Hugging Face <-> threefold: configs and weights, one adapter per model family.

    llama.py   LlamaForCausalLM (Llama 2/3, SmolLM-style tied embeddings), MistralForCausalLM
               (and Mistral3ForConditionalGeneration's text model), Qwen2ForCausalLM (QKV bias),
               Qwen3ForCausalLM (RMSNorm on each query and key head: --qk-layernorm)
    llama_kin.py  Ernie4_5ForCausalLM, HeliumForCausalLM (RoPE on adjacent pairs),
               SeedOssForCausalLM (biases on q, k, v), ArceeForCausalLM (a squared-ReLU MLP)
    smollm3.py SmolLM3ForCausalLM (SmolLM3: LLaMA with every fourth layer without RoPE)
    moe.py     MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (mixtures of
               experts; Qwen2-MoE's beside a gated shared expert)
    deepseek.py  DeepseekV3ForCausalLM (multi-latent attention, DeepSeek-V3's routing),
               DeepseekV32ForCausalLM (the same with DeepSeek sparse attention's indexer)
    deepseek_v2.py  DeepseekV2ForCausalLM (DeepSeek-V2-Lite: the same attention, softmax routing)
    glm4.py    Glm4ForCausalLM (GLM-4-0414: four norms a layer, RoPE on pairs of half of each
               head, q, k, v biases)
    glm4_moe.py  Glm4MoeForCausalLM (GLM-4.5: grouped-query attention, DeepSeek-V3's routing)
    llama4.py  Llama4ForCausalLM (Llama 4 Scout and Maverick: layers without RoPE, chunked
               attention, top-1 experts weighted on their input beside a shared expert), and
               the text model of Llama4ForConditionalGeneration (the Hub's files)
    gpt_oss.py GptOssForCausalLM (biased experts and router, attention sinks, windows by layer,
               MXFP4 experts read)
    qwen3_next.py  Qwen3NextForCausalLM (gated delta nets, gated attention and shared expert)
    gemma.py   Gemma3ForCausalLM (Gemma 3's text models: GeGLU, norms after each sublayer,
               sliding windows with their own RoPE base, scaled embeddings), the text model
               of Gemma3ForConditionalGeneration (4B and up), Gemma2ForCausalLM (soft-capped)
               and GemmaForCausalLM (Gemma 1, CodeGemma: the LLaMA layer with Gemma's parts)
    multimodal.py  a multimodal checkpoint's text model (Llama 4's, Gemma 3's, Mistral 3's)
    olmo2.py   Olmo2ForCausalLM (norms after the sublayers only, query and key norms across
               heads), Olmo3ForCausalLM (the same with windows by layer, YaRN in the others),
               OlmoeForCausalLM (OLMoE: those query and key norms, experts)
    phi.py     PhiForCausalLM (Phi-1, Phi-1.5, Phi-2: one LayerNorm read by the attention and
               the MLP side by side, RoPE on part of each head, a bias on the output layer)
    exaone4.py Exaone4ForCausalLM (EXAONE 4.0: OLMo 2's norms, Qwen3's head norms, windows with
               RoPE, full layers without)
    phi3.py    Phi3ForCausalLM (Phi-3, Phi-3.5 and Phi-4: LLaMA with fused QKV and gate/up)
    gpt_neox.py  GPTNeoXForCausalLM (Pythia: the attention and the MLP reading one input)
    cohere.py  CohereForCausalLM (Command R, Aya: one bias-free LayerNorm read by the
               attention and the MLP side by side, interleaved RoPE, scaled logits),
               Cohere2ForCausalLM (Command R7B, Command A: windows with RoPE, full layers without)
    falcon.py  FalconForCausalLM (Falcon-7B, 40B, 180B, Falcon2-11B: side-by-side layers with one
               norm or two, one key and value head or groups)
    starcoder2.py  Starcoder2ForCausalLM (StarCoder2: LLaMA's attention in GPT-2's layer, windows)
    granite.py GraniteForCausalLM (IBM Granite 3: LLaMA with four multipliers),
               GraniteMoeForCausalLM (the same with Mixtral's routing, experts stacked)
    nemotron.py  NemotronForCausalLM (Nemotron-4, Minitron: LayerNorm1P, a squared-ReLU MLP,
               RoPE on half of each head)
    nemotron_h.py  NemotronHForCausalLM (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano: a hybrid
               stack of Mamba-2, attention, ReLU² MLP and expert layers)
    granite_hybrid.py  BambaForCausalLM (Bamba-9B), GraniteMoeHybridForCausalLM (Granite 4.0's
               hybrids): Mamba-2 or attention, then an MLP (or experts), in each layer
    gptj.py    GPTJForCausalLM (GPT-J: one LayerNorm read by the attention and the MLP side by
               side, biases on the MLP and the output layer, RoPE on adjacent pairs of a part)
    gpt2.py    GPT2LMHeadModel
    common.py  what they share: refusals, RoPE settings, the QKV layouts, the conversion driver

A config field threefold cannot reproduce (RoPE scaling, sliding windows, biases on only some
projections, other activations) is refused by name: a conversion never produces a silently
different model. A new family is a new adapter and one line in `ADAPTERS`.
"""

from __future__ import annotations

import json

import torch

from threefold.checkpoint.hf.cohere import COHERE, COHERE2
from threefold.checkpoint.hf.common import Adapter, refuse
from threefold.checkpoint.hf.deepseek import DEEPSEEK_V3, DEEPSEEK_V32
from threefold.checkpoint.hf.deepseek_v2 import DEEPSEEK_V2
from threefold.checkpoint.hf.exaone4 import EXAONE4
from threefold.checkpoint.hf.falcon import FALCON
from threefold.checkpoint.hf.gemma import GEMMA, GEMMA2, GEMMA3, GEMMA3_CONDITIONAL
from threefold.checkpoint.hf.glm4 import GLM4
from threefold.checkpoint.hf.glm4_moe import GLM4_MOE
from threefold.checkpoint.hf.gpt2 import GPT2
from threefold.checkpoint.hf.gpt_neox import GPT_NEOX
from threefold.checkpoint.hf.gpt_oss import GPT_OSS
from threefold.checkpoint.hf.gptj import GPTJ
from threefold.checkpoint.hf.granite import GRANITE, GRANITE_MOE
from threefold.checkpoint.hf.granite_hybrid import BAMBA, GRANITE_HYBRID
from threefold.checkpoint.hf.llama import LLAMA, MISTRAL, MISTRAL3, QWEN2, QWEN3
from threefold.checkpoint.hf.llama4 import LLAMA4, LLAMA4_CONDITIONAL
from threefold.checkpoint.hf.llama_kin import ARCEE, ERNIE4_5, HELIUM, SEED_OSS
from threefold.checkpoint.hf.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from threefold.checkpoint.hf.nemotron import NEMOTRON
from threefold.checkpoint.hf.nemotron_h import NEMOTRON_H
from threefold.checkpoint.hf.olmo2 import OLMO2, OLMO3, OLMOE
from threefold.checkpoint.hf.phi import PHI
from threefold.checkpoint.hf.phi3 import PHI3
from threefold.checkpoint.hf.qwen3_next import QWEN3_NEXT
from threefold.checkpoint.hf.smollm3 import SMOLLM3
from threefold.checkpoint.hf.starcoder2 import STARCODER2
from threefold.config import ConfigError, ModelConfig

ADAPTERS: dict[str, Adapter] = {
    adapter.architecture: adapter
    for adapter in (
        LLAMA,
        MISTRAL,
        MISTRAL3,
        QWEN2,
        QWEN3,
        SMOLLM3,
        ERNIE4_5,
        HELIUM,
        SEED_OSS,
        ARCEE,
        PHI,
        PHI3,
        NEMOTRON,
        NEMOTRON_H,
        BAMBA,
        GRANITE_HYBRID,
        OLMO2,
        OLMO3,
        EXAONE4,
        OLMOE,
        GEMMA,
        GEMMA2,
        GEMMA3,
        GEMMA3_CONDITIONAL,
        MIXTRAL,
        QWEN3_MOE,
        QWEN2_MOE,
        QWEN3_NEXT,
        DEEPSEEK_V2,
        DEEPSEEK_V3,
        DEEPSEEK_V32,
        GLM4,
        GLM4_MOE,
        LLAMA4,
        LLAMA4_CONDITIONAL,
        GPT_OSS,
        GPT_NEOX,
        GPTJ,
        COHERE,
        COHERE2,
        FALCON,
        STARCODER2,
        GRANITE,
        GRANITE_MOE,
        GPT2,
    )
}


def architecture_of(hf: dict) -> str:
    model_types = {adapter.model_type: name for name, adapter in ADAPTERS.items()}
    names = hf.get("architectures") or [model_types.get(hf.get("model_type"), "?")]
    refuse(names[0] not in ADAPTERS, "architectures", names, f"supported: {', '.join(ADAPTERS)}")
    return names[0]


def model_config_from_hf(hf: dict) -> tuple[str, ModelConfig]:
    """(architecture, threefold model config) of a Hugging Face config.json."""
    architecture = architecture_of(hf)
    try:
        config = ADAPTERS[architecture].model_config(hf)
    except ConfigError:  # a field the adapter refuses by name
        raise
    except KeyError as error:  # a config.json cut short, or written by hand
        raise ConfigError(f"no {error.args[0]!r} field, which {architecture} needs") from None
    except (AttributeError, TypeError, ValueError) as error:  # a text where a number goes
        raise ConfigError(
            f"a field {architecture} reads has a value of the wrong type ({error})"
        ) from None
    # Megatron-LM's own converters set --no-position-embedding for a model whose positions
    # are not learned (its HF model scripts pass it), and its --load compares the flag
    config.add_position_embedding = config.position_embedding_type == "learned_absolute"
    config.finalize()
    return architecture, config


def read_hf_config(path: str, flag: str) -> tuple[dict, str, ModelConfig]:
    """(config.json, architecture, threefold model config) of a Hugging Face config file;
    a ConfigError naming `flag` and the file for one that is not JSON or not a model's."""
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except ValueError as error:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ConfigError(f"{flag} {path}: not a JSON config ({error})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{flag} {path}: not a JSON config (a {type(hf).__name__})")
    try:
        return hf, *model_config_from_hf(hf)
    except ConfigError as error:
        raise ConfigError(f"{flag} {path}: {error}") from None


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
