"""A LoRA fine-tune's adapters as a PEFT adapter (`peft.PeftModel.from_pretrained(base, DIR)`,
vLLM's and transformers' LoRA loading): adapter_config.json and adapter_model.safetensors.

threefold adapts its fused layers (model/lora.py): `linear_qkv` and `linear_fc1` hold several
Hugging Face projections' rows. Their update B A splits exactly by B's rows: each Hugging Face
projection cut from the layer's rows gets the shared A and its rows of B (regrouped as the
weights are), at the same rank and alpha. `linear_proj` and `linear_fc2` map one to one.

    threefold                           PEFT (base_model.model. + the HF module)
    <layer>.adapter.linear_in.weight    <module>.lora_A.weight   [rank, in]
    <layer>.adapter.linear_out.weight   <module>.lora_B.weight   [out, rank]

The dense LLaMA family (LLaMA, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) is written (`LlamaAdapter`'s
`lora_modules`); a mixture of experts' adapters and other families are refused in one line
(the merged export, --saver hf, takes them all).
"""

from __future__ import annotations

import torch

from threefold.checkpoint.hf import ADAPTERS
from threefold.checkpoint.hf.llama import LlamaAdapter
from threefold.config import ConfigError, ModelConfig

_SUBLAYERS = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


def peft_adapter(
    state: dict[str, torch.Tensor], config: ModelConfig, architecture: str, base: str | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(adapter_model.safetensors' tensors, adapter_config.json) of the adapters in `state`
    (whole tensors by threefold name, adapters unmerged); `base`: the base model's name or
    path, as PEFT records it."""
    adapter = ADAPTERS[architecture]
    if not isinstance(adapter, LlamaAdapter) or adapter.exports_moe or config.is_moe:
        raise ConfigError(
            f"--saver peft writes the adapters of the dense LLaMA family (LLaMA, Mistral, "
            f"Qwen2, Qwen3, Phi-3, Gemma 3), not {architecture}'s: export the model merged "
            "(--saver hf)"
        )
    tensors, targets = {}, set()
    for i in range(config.num_layers):
        for layer, sublayer in _SUBLAYERS.items():
            ours = f"decoder.layers.{i}.{sublayer}.{layer}.adapter."
            if ours + "linear_in.weight" not in state:
                continue
            a, b = state[ours + "linear_in.weight"], state[ours + "linear_out.weight"]
            modules = adapter.lora_modules(layer, i, a, b, config)
            for module, (module_a, module_b) in modules.items():
                tensors[f"base_model.model.{module}.lora_A.weight"] = module_a
                tensors[f"base_model.model.{module}.lora_B.weight"] = module_b
                targets.add(module.rsplit(".", 1)[-1])
    if not tensors:
        raise ConfigError("the checkpoint holds no LoRA adapters (fine-tune with --lora-rank)")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    # (each module's A a copy of its own: PEFT keeps one per module, and safetensors
    # refuses tensors that share memory)
    return {name: t.clone() for name, t in tensors.items()}, adapter_config
