"""Whole models between formats: Hugging Face (safetensors and its tokenizer files), threefold
checkpoints of any layout and Megatron-LM's torch_dist; what tools/convert_checkpoint.py runs.
Each converter reads one format whole (TP = PP = 1) and writes the other.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from threefold.checkpoint.files import checkpoint_dir, read_metadata, saved_dir
from threefold.checkpoint.hf import (
    ADAPTERS,
    hf_config_from_model_config,
    hf_to_threefold,
    read_hf_config,
    threefold_to_hf,
)
from threefold.checkpoint.load import find_checkpoint, load_model
from threefold.checkpoint.megatron.format import is_megatron_checkpoint
from threefold.checkpoint.megatron.legacy import is_legacy_checkpoint
from threefold.checkpoint.megatron.optimizer import (
    ExportedOptimizer,
    export_shape,
    exported_common,
    steps_distributed,
    unexportable,
)
from threefold.checkpoint.megatron.save import check_export_directory, save_megatron_checkpoint
from threefold.checkpoint.resharding import SavedTensors
from threefold.checkpoint.save import save_weights_checkpoint
from threefold.config import Config, ConfigError, ModelConfig
from threefold.model import GPTModel
from threefold.model.lora import merged_weights
from threefold.parallel.tensor_parallel.sharding import gather_tensor_parallel, sharding_group
from threefold.written_aside import fsync_directory

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def read_hf_weights(directory: str) -> dict[str, torch.Tensor]:
    """A Hugging Face model's tensors, from model.safetensors or the shards its index lists; a
    file that is missing or not safetensors is one line naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(
                f"--load-dir {index}: not a safetensors index ({type(error).__name__}: {error})"
            ) from None
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConfigError(
            f"--load-dir {directory}: no model.safetensors or "
            "model.safetensors.index.json (safetensors checkpoints only)"
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(directory, str(name))
        if name != os.path.basename(str(name)) or not os.path.isfile(path):
            raise ConfigError(f"--load-dir {directory}: {name!r}, listed in its index, is missing")
        try:
            weights.update(load_file(path))
        except SafetensorError as error:
            raise ConfigError(
                f"--load-dir {path}: not a readable safetensors file ({error})"
            ) from None
    return weights


def tokenizer_files(source: str) -> list[str]:
    """The tokenizer's files in a Hugging Face directory (none when it has no tokenizer)."""
    found = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    return found if {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(found) else []


def copy_tokenizer_files(source: str, destination: str) -> bool:
    """Copy the tokenizer's files; returns whether there is a tokenizer at all."""
    found = tokenizer_files(source)
    if found:
        os.makedirs(destination, exist_ok=True)
    for name in found:
        shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))
    return bool(found)


def read_hf_model(load_dir: str) -> tuple[dict, str, ModelConfig, dict, set]:
    """(config.json, architecture, model config, threefold tensors, the weights' dtypes) of
    a Hugging Face model directory."""
    config_file = os.path.join(load_dir, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"--load-dir {load_dir}: no config.json; is it a Hugging Face model?")
    hf_config, architecture, model_config = read_hf_config(config_file, "--load-dir")
    weights = read_hf_weights(load_dir)
    # (MXFP4 experts' bytes and exponents are not the model's dtype)
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    tensors = hf_to_threefold(weights, model_config, architecture)
    return hf_config, architecture, model_config, tensors, dtypes


def hf_to_threefold_checkpoint(load_dir: str, save_dir: str) -> str:
    hf_config, architecture, model_config, tensors, dtypes = read_hf_model(load_dir)
    # (what the model exports as: a multimodal checkpoint's text model exports as its own)
    model_config.hf_architecture = ADAPTERS[architecture].exports_as or architecture
    prefixes = ADAPTERS[architecture].left_behind_prefixes
    if prefixes:  # a multimodal checkpoint's text model: said, not silently dropped
        print(
            f"> {load_dir}: {architecture}'s {', '.join(p + '*' for p in prefixes)} stay "
            "behind: the conversion is its text model"
        )
    dtypes = {str(dtype).removeprefix("torch.") for dtype in dtypes}
    config = Config(model=model_config)
    if tokenizer_files(load_dir):  # copied into the checkpoint as it is written
        config.data.tokenizer_type = "HuggingFaceTokenizer"
        config.data.tokenizer_model = os.path.join(checkpoint_dir(save_dir, 0), "tokenizer")
    hf = {
        "architecture": architecture,
        "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
        "config": hf_config,
    }
    return save_weights_checkpoint(
        save_dir,
        config,
        tensors,
        extra_metadata={"hf": hf},
        add_files=lambda path: copy_tokenizer_files(load_dir, os.path.join(path, "tokenizer")),
    )


def _guess_architecture(model: ModelConfig) -> str:
    if model.hybrid:  # (Mamba layers among the others: Nemotron-H's, or IBM's SwiGLU ones)
        if not model.swiglu:
            return "NemotronHForCausalLM"
        granite = model.is_moe or model.residual_multiplier != 1.0
        return "GraniteMoeHybridForCausalLM" if granite else "BambaForCausalLM"
    if model.output_layer_bias:  # (Phi's and GPT-J's: RoPE on halves or on adjacent pairs)
        return "GPTJForCausalLM" if model.rotary_interleaved else "PhiForCausalLM"
    if model.normalization == "LayerNorm" and model.rotary_position_embeddings:
        if model.squared_relu:
            return "NemotronForCausalLM"
        if not model.swiglu and not model.parallel_attention_mlp:
            return "Starcoder2ForCausalLM"  # (GPT-2's layer around LLaMA's attention)
        if not model.swiglu and model.add_bias_linear:
            if not model.parallel_attention_mlp_shared_norm:
                return "GPTNeoXForCausalLM"  # (a norm for each of the side-by-side sublayers)
        if not model.swiglu:
            return "FalconForCausalLM"
    if model.parallel_attention_mlp_shared_norm:  # (one norm read by the attention and MLP)
        return "Cohere2ForCausalLM" if model.window_size else "CohereForCausalLM"
    if model.multi_latent_attention:
        if model.is_moe and model.moe_router_score_function == "softmax":
            return "DeepseekV2ForCausalLM"  # (DeepSeek-V2's softmax routing)
        return "DeepseekV32ForCausalLM" if model.sparse_attention else "DeepseekV3ForCausalLM"
    if model.normalization == "LayerNorm" and model.position_embedding_type == "learned_absolute":
        return "GPT2LMHeadModel"
    if model.quick_geglu and model.is_moe and model.softmax_type == "learnable":
        return "GptOssForCausalLM"
    if model.normalization == "RMSNorm" and model.swiglu and model.rotary_position_embeddings:
        llama4 = [model.moe_apply_probs_on_input, model.attention_chunk_size, model.qk_l2_norm]
        llama4 += [model.attn_temperature_tuning, model.is_moe]
        if model.no_rope_freq and not any(llama4):  # (layers without RoPE, nothing else)
            return "SmolLM3ForCausalLM"
        if model.moe_apply_probs_on_input or model.no_rope_freq or model.attention_chunk_size:
            return "Llama4ForCausalLM"
        if model.residual_multiplier != 1.0:  # (Granite's multipliers)
            return "GraniteMoeForCausalLM" if model.is_moe else "GraniteForCausalLM"
        if model.is_moe and model.moe_router_score_function == "sigmoid":
            return "Glm4MoeForCausalLM"  # (DeepSeek-V3's routing)
        if model.is_moe and model.qk_layernorm_across_heads:
            return "OlmoeForCausalLM"  # (OLMo 2's query and key norms)
        if model.is_moe and model.moe_shared_expert_gate and not model.qk_layernorm:
            return "Qwen2MoeForCausalLM"  # (a gated shared expert)
        if model.is_moe:
            return "Qwen3MoeForCausalLM" if model.qk_layernorm else "MixtralForCausalLM"
        if model.qk_layernorm:
            return "Qwen3ForCausalLM"
        if model.window_size is not None and not model.add_qkv_bias:
            return "MistralForCausalLM"  # (a sliding window)
        return "Qwen2ForCausalLM" if model.add_qkv_bias else "LlamaForCausalLM"
    if model.normalization == "RMSNorm" and model.squared_relu and model.rotary_position_embeddings:
        return "ArceeForCausalLM"  # (LLaMA with Nemotron's squared-ReLU MLP)
    raise ConfigError(
        "this threefold model matches no Hugging Face architecture threefold "
        "exports (GPT-2: LayerNorm + learned positions; LLaMA/Qwen2/Qwen3, Llama 4 and the "
        "Mixtral/Qwen2-MoE/Qwen3-MoE/GLM-4.5 mixtures of experts: RMSNorm + SwiGLU + RoPE; "
        "GPT-OSS: experts with --quick-geglu and --softmax-type learnable; StarCoder2, Falcon and "
        "GPT-NeoX: LayerNorm + GELU + RoPE; Nemotron and Arcee: --squared-relu + RoPE; "
        "Cohere: --parallel-attention-mlp-shared-norm; Phi and GPT-J: --output-layer-bias)"
    )


def whole_model(
    load_dir: str, loader: str, strictness: str = "raise_unexpected"
) -> tuple[Config, dict[str, torch.Tensor], dict, int]:
    """(config, whole tensors by name, metadata, iteration) of the latest checkpoint in a
    threefold or Megatron-LM (torch_dist) --load-dir, LoRA adapters folded in."""
    config, state, metadata, iteration, _ = whole_checkpoint(load_dir, loader, strictness)
    config.model.lora_rank = None  # (the adapters folded into the weights)
    return config, state, metadata, iteration


def whole_checkpoint(
    load_dir: str, loader: str, strictness: str = "raise_unexpected", merge_adapters: bool = True
) -> tuple[Config, dict, dict, int, GPTModel]:
    """`whole_model`'s, and the model at TP = PP = 1 it loaded (as saved: a LoRA run's
    config keeps its --lora-rank); `merge_adapters` False: LoRA's adapters kept apart."""
    iteration = find_checkpoint(load_dir) if os.path.isdir(load_dir) else None
    if iteration is None:
        raise ConfigError(f"--load-dir {load_dir}: holds no complete {loader} checkpoint")
    path = saved_dir(load_dir, iteration)
    megatron = is_megatron_checkpoint(path) or is_legacy_checkpoint(path)
    if megatron != (loader == "megatron"):
        other = "threefold" if loader == "megatron" else "megatron"
        raise ConfigError(
            f"--load-dir {load_dir}: not a {loader} checkpoint; it is a {other} one: "
            f"use --loader {other}"
        )
    metadata = read_metadata(load_dir, iteration)
    config, model, _ = load_model(
        load_dir, iteration=iteration, with_tokenizer=False, strictness=strictness
    )
    state = {}
    for name, param in model.named_parameters():
        name = model.layout_independent_name(name)
        state[name] = gather_tensor_parallel(
            param.detach(), param, sharding_group(param, model.parallel)
        )
    if config.model.lora_rank and merge_adapters:  # fine-tuned with LoRA: fold them in
        state = merged_weights(state, config.model.lora_alpha / config.model.lora_rank)
    return config, state, metadata, iteration, model


@dataclass(frozen=True)
class TargetRun:
    """What --saver megatron is told of the Megatron-LM run that goes on from an export's
    optimizer state: its --use-distributed-optimizer (None: as the saving run stepped), and
    the layout that decides whether it steps a mixture's experts apart (`expert_layout`)."""

    distributed: bool | None = None
    expert_parallel: int | None = None
    tensor_parallel: int | None = None
    expert_tensor_parallel: int | None = None

    @property
    def names_a_layout(self) -> bool:
        return any(
            size is not None
            for size in (self.expert_parallel, self.tensor_parallel, self.expert_tensor_parallel)
        )

    def expert_layout(self, saved: dict) -> tuple[int, int, int]:
        """(TP, EP, expert TP) of the run: the saving run's `saved` layout where no size is
        named, else the sizes named with Megatron-LM's defaults for the rest (1, and an
        expert TP of TP), as its command line would take them."""
        if not self.names_a_layout:
            tp = saved["tensor_model_parallel_size"]
            etp = saved.get("expert_tensor_parallel_size") or tp
            return tp, saved.get("expert_model_parallel_size", 1), etp
        tp = self.tensor_parallel or 1
        return tp, self.expert_parallel or 1, self.expert_tensor_parallel or tp


def _exported_optimizer(
    load_dir: str,
    iteration: int,
    config: Config,
    metadata: dict,
    model: GPTModel,
    dtype: torch.dtype,
    target: TargetRun,
) -> ExportedOptimizer | None:
    """A threefold checkpoint's Adam state as Megatron-LM's optimizer keeps it, for a run in
    `dtype` of the saving run's layout or `target`'s, or None (and a line saying why) where it
    has none Megatron-LM can take."""
    reason = unexportable(config, metadata)
    if reason is not None:
        print(f"> the optimizer state is not exported ({reason}): the export holds the model")
        return None
    saved = SavedTensors(saved_dir(load_dir, iteration))
    layout = metadata["config"]["parallel"]
    saved_tp = layout["tensor_model_parallel_size"]
    distributed = target.distributed
    if distributed is None:
        distributed = steps_distributed(
            layout.get("use_distributed_optimizer", False),
            layout.get("distributed_strategy", "megatron"),
        )
    tp, ep, etp = target.expert_layout(layout)
    shape = export_shape(
        model.named_parameters(), config, distributed, (tp, ep, etp), dtype != torch.float32
    )
    print(
        f"> Adam's state is exported for {shape.describe()}: its --load takes no other "
        "(--[no-]target-use-distributed-optimizer changes it)"
    )
    if config.model.is_moe:
        own = "an optimizer of their own" if shape.experts_apart else "one optimizer with the rest"
        print(
            f"> the experts' optimizer state is laid out for Megatron-LM at TP {tp}, EP {ep}, "
            f"expert TP {etp} ({own}"
            + "; its --load takes no other: --target-tensor-parallel-size, "
            "--target-expert-parallel-size and --target-expert-tensor-parallel-size change it)"
        )
    elif target.names_a_layout:
        print("> the --target-*-parallel-size flags have no effect: the model has no experts")
    tensors: dict[str, dict] = {field: {} for field in shape.fields}
    for name, param in model.named_parameters():
        if not param.requires_grad:  # (no state: DeepSeek-V3's expert bias, a buffer there)
            continue
        name = model.layout_independent_name(name)
        for field in shape.fields:
            # an fp32 run's weights are their own masters
            source = "model" if field == "master" and not saved.has(field, name) else field
            tensors[field][name] = saved.full(source, name, param, saved_tp).float()
    common = exported_common(
        config, metadata["scheduler"], float(saved.step()), shape, metadata.get("loss_scaler")
    )
    return ExportedOptimizer(tensors, common, shape.fields)


def _refuse_a_used_directory(save_dir: str) -> None:
    if os.path.exists(save_dir) and not (os.path.isdir(save_dir) and not os.listdir(save_dir)):
        raise ConfigError(
            f"--save-dir {save_dir}: exists and is not an empty directory; an export writes "
            "over nothing: choose a new directory"
        )


def _partial_directory(save_dir: str) -> str:
    """Where an export is written before `_publish` renames it into place."""
    partial = os.path.normpath(save_dir) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # (a failed export's)
    os.makedirs(partial)
    return partial


def _publish(partial: str, save_dir: str) -> str:
    for name in os.listdir(partial):  # on disk before the rename makes them the export
        with open(os.path.join(partial, name), "rb") as f:
            os.fsync(f.fileno())
    os.replace(partial, save_dir)  # onto nothing, or onto an empty directory
    fsync_directory(os.path.dirname(os.path.abspath(save_dir)))
    return save_dir


def _hf_architecture(config: Config, metadata: dict, given: str | None) -> str:
    """--hf-architecture, else the one the model was converted from (which fine-tuning
    carries in its config), else the one its options match."""
    given = given or config.model.hf_architecture
    if given is not None and given not in ADAPTERS:
        raise ConfigError(f"--hf-architecture {given}: not one of {', '.join(ADAPTERS)}")
    return given or metadata.get("hf", {}).get("architecture") or _guess_architecture(config.model)


def to_hf_checkpoint(
    load_dir: str,
    save_dir: str,
    dtype: str | None,
    loader: str,
    strictness: str = "raise_unexpected",
    architecture: str | None = None,
) -> str:
    """A Hugging Face model directory (model.safetensors, config.json, the tokenizer's files)
    at `save_dir`, which must not exist or be empty: an export never writes over files. It
    is written beside it and renamed into place once complete, so an export that fails (or
    a disk that fills) leaves no half-written model where transformers would load it."""
    from safetensors.torch import save_file

    _refuse_a_used_directory(save_dir)
    config, state, metadata, iteration = whole_model(load_dir, loader, strictness)
    hf = metadata.get("hf", {})
    architecture = _hf_architecture(config, metadata, architecture)
    if config.model.mtp_num_layers and not ADAPTERS[architecture].exports_mtp:
        # Hugging Face's architectures predict the next token only (NemotronH's files hold
        # Nemotron 3 Super's depths, which transformers ignores); said, not silently dropped.
        print(
            f"> {load_dir}: its {config.model.mtp_num_layers} multi-token prediction depths "
            "(mtp.layers.*) stay behind: the export is the next-token model"
        )
        state = {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}
    tensors = threefold_to_hf(state, config.model, architecture)
    target = getattr(torch, dtype or hf.get("dtype", "float32"))
    tensors = {name: t.to(target).contiguous() for name, t in tensors.items()}
    partial = _partial_directory(save_dir)
    save_file(tensors, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    hf_config = hf_config_from_model_config(config.model, architecture)
    hf_config["torch_dtype"] = str(target).removeprefix("torch.")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in hf.get("config", {}):
            hf_config[key] = hf["config"][key]
    # A model trained here pads with no token id, not with its architecture's default one
    # (SmolLM3's, Nemotron's), which a vocabulary of its own may not even hold.
    hf_config.setdefault("pad_token_id", None)
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    copy_tokenizer_files(os.path.join(saved_dir(load_dir, iteration), "tokenizer"), partial)
    return _publish(partial, save_dir)


def to_peft_adapter(
    load_dir: str,
    save_dir: str,
    dtype: str | None,
    strictness: str = "raise_unexpected",
    architecture: str | None = None,
    base: str | None = None,
) -> str:
    """A LoRA fine-tune's adapters as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors; checkpoint/hf/peft.py) for the Hugging Face base model `base`,
    written as `to_hf_checkpoint` writes."""
    from safetensors.torch import save_file

    from threefold.checkpoint.hf.peft import peft_adapter

    _refuse_a_used_directory(save_dir)
    config, state, metadata, _, _ = whole_checkpoint(
        load_dir, "threefold", strictness, merge_adapters=False
    )
    architecture = _hf_architecture(config, metadata, architecture)
    tensors, adapter_config = peft_adapter(state, config.model, architecture, base)
    target = getattr(torch, dtype or metadata.get("hf", {}).get("dtype", "float32"))
    partial = _partial_directory(save_dir)
    tensors = {name: t.to(target).contiguous() for name, t in tensors.items()}
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"), {"format": "pt"})
    with open(os.path.join(partial, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    return _publish(partial, save_dir)


def to_megatron_checkpoint(
    load_dir: str,
    save_dir: str,
    dtype: str | None,
    loader: str,
    strictness: str = "raise_unexpected",
    target: TargetRun = TargetRun(),
) -> str:
    """A Megatron-LM torch_dist checkpoint (iteration 0 from Hugging Face, else the source's
    iteration) of a Hugging Face or threefold model; dtype as imported / as trained; a threefold
    checkpoint's optimizer state for the Megatron-LM run `target` describes."""
    check_export_directory(save_dir)  # (before the model is read)
    if loader == "hf":
        _, _, model_config, state, dtypes = read_hf_model(load_dir)
        config, iteration, train_state = Config(model=model_config), 0, {}
        default = dtypes.pop() if len(dtypes) == 1 else torch.float32
        written = getattr(torch, dtype) if dtype else default
        optimizer = None
    else:
        config, state, metadata, iteration, model = whole_checkpoint(load_dir, loader, strictness)
        train_state = metadata.get("train_state", {})
        default = torch.bfloat16 if config.training.bf16 else torch.float32
        written = getattr(torch, dtype) if dtype else default
        optimizer = _exported_optimizer(
            load_dir, iteration, config, metadata, model, written, target
        )
        config.model.lora_rank = None  # (the adapters folded into the weights)
    return save_megatron_checkpoint(
        save_dir, config, state, written, iteration, train_state, optimizer
    )


def megatron_to_threefold_checkpoint(
    load_dir: str, save_dir: str, strictness: str = "raise_unexpected"
) -> str:
    """A weights-only threefold checkpoint of a Megatron-LM one, like a Hugging Face import."""
    config, state, _, _ = whole_model(load_dir, "megatron", strictness)
    config = Config(model=config.model, data=config.data)  # whole tensors: TP = PP = 1
    return save_weights_checkpoint(save_dir, config, state)
