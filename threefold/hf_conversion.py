"""Hugging Face <-> threefold: configs and weights of LLaMA-family models and GPT-2.

Supported architectures: LlamaForCausalLM (Llama 2/3, SmolLM-style tied embeddings),
MistralForCausalLM (without sliding-window attention), Qwen2ForCausalLM (QKV bias),
Qwen3ForCausalLM (RMSNorm on each query and key head: --qk-layernorm) and GPT2LMHeadModel. A
config field threefold cannot reproduce (RoPE scaling, sliding windows, biases on only some
projections, other activations) is refused by name: a conversion never produces a silently
different model.

Weight layouts:
- QKV: HF keeps q, k and v projections apart; threefold stacks them per query group as
  megatron-core does, [q heads of the group, k, v] (GPT-2's fused c_attn is [all q; all k;
  all v] and its Conv1D weights are stored transposed);
- SwiGLU: fc1 = [gate; up], fc2 = down;
- RoPE: both use the rotate-half convention, so query/key weights need no permutation;
- the vocabulary is stored unpadded here; threefold pads it when it builds the model;
- --apply-layernorm-1p norm weights w are exported as the 1 + w Hugging Face multiplies by.
"""

from __future__ import annotations

import torch

from threefold.config import ConfigError, ModelConfig
from threefold.model import rope

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "GPT2LMHeadModel": "gpt2"}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "gpt2": "GPT2LMHeadModel"}


def _refuse(condition: bool, field: str, value, why: str) -> None:
    if condition:
        raise ConfigError(f"Hugging Face config field {field}={value!r} is not supported: {why}")


def _rope(hf: dict) -> tuple[float, float | None]:
    """(RoPE base, Llama 3.1 scaling factor or None) of a Hugging Face config."""
    parameters = hf.get("rope_parameters") or {}
    scaling = {**(hf.get("rope_scaling") or {}), **parameters}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    _refuse(rope_type not in (None, "default", "llama3"), "rope_scaling", rope_type,
            "threefold implements plain RoPE and Llama 3.1's llama3 scaling")
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type != "llama3":
        return theta, None
    fixed = {"low_freq_factor": rope.LOW_FREQ_FACTOR, "high_freq_factor": rope.HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": rope.ORIGINAL_CONTEXT}
    for field, value in fixed.items():
        _refuse(scaling.get(field, value) != value, f"rope_scaling.{field}", scaling.get(field),
                f"llama3 scaling is implemented with {field}={value} (as Megatron-LM)")
    return theta, float(scaling["factor"])


def _llama3_rope_scaling(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": rope.LOW_FREQ_FACTOR,
            "high_freq_factor": rope.HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": rope.ORIGINAL_CONTEXT}


def architecture_of(hf: dict) -> str:
    names = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type"), "?")]
    _refuse(names[0] not in ARCHITECTURES, "architectures", names,
            f"supported: {', '.join(ARCHITECTURES)}")
    return names[0]


def model_config_from_hf(hf: dict) -> tuple[str, ModelConfig]:
    """(architecture, threefold model config) of a Hugging Face config.json."""
    architecture = architecture_of(hf)
    family = ARCHITECTURES[architecture]
    if family == "gpt2":
        activation = hf.get("activation_function", "gelu_new")
        _refuse(activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu"),
                "activation_function", activation, "GELU (exact or tanh) only")
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            _refuse(bool(hf.get(field)), field, hf.get(field), "not implemented")
        _refuse(hf.get("scale_attn_weights") is False, "scale_attn_weights", False,
                "attention is always scaled by 1/sqrt(head size)")
        hidden = hf["n_embd"]
        config = ModelConfig(
            num_layers=hf["n_layer"], hidden_size=hidden,
            ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
            num_attention_heads=hf["n_head"], seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            position_embedding_type="learned_absolute", normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), swiglu=False,
            add_bias_linear=True, openai_gelu=activation != "gelu",
            untie_embeddings_and_output_weights=False, vocab_size=hf["vocab_size"],
            init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attn_pdrop", 0.1), hidden_dropout=hf.get("resid_pdrop", 0.1))
    else:
        _refuse(hf.get("hidden_act", "silu") != "silu", "hidden_act", hf.get("hidden_act"),
                "SwiGLU with SiLU only")
        _refuse(hf.get("pretraining_tp", 1) != 1, "pretraining_tp", hf.get("pretraining_tp"),
                "must be 1")
        _refuse(hf.get("sliding_window") is not None and (
            family == "llama" or hf.get("use_sliding_window")), "sliding_window",
            hf.get("sliding_window"), "sliding-window attention is not implemented")
        attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
        _refuse(attention_bias != mlp_bias, "attention_bias/mlp_bias",
                (attention_bias, mlp_bias), "threefold has biases on all projections or none "
                "(or on QKV only, as Qwen2)")
        heads = hf["num_attention_heads"]
        groups = hf.get("num_key_value_heads") or heads
        hidden = hf["hidden_size"]
        positions = hf.get("max_position_embeddings", 4096)
        theta, scaling_factor = _rope(hf)
        config = ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hidden,
            ffn_hidden_size=hf["intermediate_size"], num_attention_heads=heads,
            group_query_attention=groups != heads, num_query_groups=groups,
            kv_channels=hf.get("head_dim") or hidden // heads,
            seq_length=min(positions, 4096), max_position_embeddings=positions,
            position_embedding_type="rope", rotary_base=theta,
            use_rope_scaling=scaling_factor is not None,
            rope_scaling_factor=scaling_factor or 8.0,
            normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
            add_bias_linear=attention_bias, add_qkv_bias=family == "qwen2",
            qk_layernorm=family == "qwen3",
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            vocab_size=hf["vocab_size"], init_method_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0)
    config.finalize()
    return architecture, config


def check_exportable(config: ModelConfig, architecture: str) -> None:
    """Refuse, by flag, a model the architecture would compute differently."""
    family = ARCHITECTURES[architecture]
    if config.qk_layernorm and family != "qwen3":
        raise ConfigError(f"{architecture} has no query/key norms and this model was trained "
                          "with --qk-layernorm; export it as Qwen3ForCausalLM")
    if family == "qwen3" and not config.qk_layernorm:
        raise ConfigError("Qwen3ForCausalLM normalizes queries and keys and this model was "
                          "trained without --qk-layernorm; export it as LlamaForCausalLM")
    if config.qk_layernorm and config.normalization != "RMSNorm":
        raise ConfigError("Qwen3ForCausalLM normalizes queries and keys with RMSNorm; this "
                          f"model's --qk-layernorm uses {config.normalization}")


def hf_config_from_model_config(config: ModelConfig, architecture: str) -> dict:
    family = ARCHITECTURES[architecture]
    common = {"architectures": [architecture], "vocab_size": config.vocab_size,
              "initializer_range": config.init_method_std, "torch_dtype": "float32"}
    if family == "gpt2":
        return {**common, "model_type": "gpt2", "n_embd": config.hidden_size,
                "n_layer": config.num_layers, "n_head": config.num_attention_heads,
                "n_positions": config.max_position_embeddings,
                "n_inner": config.ffn_hidden_size, "layer_norm_epsilon": config.norm_epsilon,
                "activation_function": "gelu_new" if config.openai_gelu else "gelu",
                "attn_pdrop": config.attention_dropout, "resid_pdrop": config.hidden_dropout,
                "embd_pdrop": config.hidden_dropout, "tie_word_embeddings": True}
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[architecture]
    hf = {**common, "model_type": model_type, "hidden_size": config.hidden_size,
          "intermediate_size": config.ffn_hidden_size,
          "num_attention_heads": config.num_attention_heads,
          "num_key_value_heads": config.num_query_groups,
          "num_hidden_layers": config.num_layers, "head_dim": config.kv_channels,
          "max_position_embeddings": config.max_position_embeddings,
          "rms_norm_eps": config.norm_epsilon, "rope_theta": config.rotary_base,
          "hidden_act": "silu",
          "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
          "attention_dropout": config.attention_dropout}
    if family == "llama":
        hf.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    if config.use_rope_scaling:
        hf["rope_scaling"] = _llama3_rope_scaling(config.rope_scaling_factor)
    if family == "qwen3":
        hf.update(attention_bias=False, use_sliding_window=False)
    return hf


def _hf_prefix(family: str) -> str:
    return "transformer" if family == "gpt2" else "model"


def _stack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               config: ModelConfig) -> torch.Tensor:
    """[all q; all k; all v] rows -> megatron-core's per-group [q..., k, v] rows."""
    groups, d = config.num_query_groups, config.kv_channels
    rest = q.shape[1:]
    q = q.reshape(groups, -1, d, *rest)
    k, v = k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, config: ModelConfig):
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, d, *rest)
    q, k, v = grouped.split([per_group, 1, 1], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def _layer_names(family: str, i: int, config: ModelConfig) -> dict[str, str]:
    """threefold name suffix -> HF name for one layer (the non-QKV tensors)."""
    if family == "gpt2":
        p = f"transformer.h.{i}."
        return {"input_layernorm.weight": p + "ln_1.weight",
                "input_layernorm.bias": p + "ln_1.bias",
                "pre_mlp_layernorm.weight": p + "ln_2.weight",
                "pre_mlp_layernorm.bias": p + "ln_2.bias",
                "self_attention.linear_proj.bias": p + "attn.c_proj.bias",
                "mlp.linear_fc1.bias": p + "mlp.c_fc.bias",
                "mlp.linear_fc2.bias": p + "mlp.c_proj.bias"}
    p = f"model.layers.{i}."
    names = {"input_layernorm.weight": p + "input_layernorm.weight",
             "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
             "self_attention.linear_proj.weight": p + "self_attn.o_proj.weight",
             "mlp.linear_fc2.weight": p + "mlp.down_proj.weight"}
    if config.qk_layernorm:
        names.update({"self_attention.q_layernorm.weight": p + "self_attn.q_norm.weight",
                      "self_attention.k_layernorm.weight": p + "self_attn.k_norm.weight"})
    return names


def _is_norm_weight(name: str) -> bool:
    return name.endswith("layernorm.weight")


def hf_to_threefold(hf_state: dict[str, torch.Tensor], config: ModelConfig,
                    architecture: str) -> dict[str, torch.Tensor]:
    """Full threefold tensors (unpadded vocabulary) from a Hugging Face state dict."""
    family = ARCHITECTURES[architecture]
    prefix = _hf_prefix(family)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise ConfigError(f"the Hugging Face checkpoint has no {name}")
        used.add(name)
        return hf_state[name]

    out: dict[str, torch.Tensor] = {}
    if family == "gpt2":
        out["embedding.word_embeddings.weight"] = take("transformer.wte.weight")
        out["embedding.position_embeddings.weight"] = take("transformer.wpe.weight")
        out["decoder.final_layernorm.weight"] = take("transformer.ln_f.weight")
        out["decoder.final_layernorm.bias"] = take("transformer.ln_f.bias")
    else:
        out["embedding.word_embeddings.weight"] = take(f"{prefix}.embed_tokens.weight")
        out["decoder.final_layernorm.weight"] = take(f"{prefix}.norm.weight")
        if config.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = take("lm_head.weight")
        else:
            used.add("lm_head.weight")  # tied: a copy of the embeddings, if present at all
    for i in range(config.num_layers):
        ours = f"decoder.layers.{i}."
        for suffix, theirs in _layer_names(family, i, config).items():
            out[ours + suffix] = take(theirs)
        if family == "gpt2":
            p = f"transformer.h.{i}."
            q, k, v = take(p + "attn.c_attn.weight").t().chunk(3, dim=0)
            out[ours + "self_attention.linear_qkv.weight"] = _stack_qkv(q, k, v, config)
            q, k, v = take(p + "attn.c_attn.bias").chunk(3, dim=0)
            out[ours + "self_attention.linear_qkv.bias"] = _stack_qkv(q, k, v, config)
            out[ours + "self_attention.linear_proj.weight"] = take(p + "attn.c_proj.weight").t()
            out[ours + "mlp.linear_fc1.weight"] = take(p + "mlp.c_fc.weight").t()
            out[ours + "mlp.linear_fc2.weight"] = take(p + "mlp.c_proj.weight").t()
            continue
        p = f"model.layers.{i}."
        attention = [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
        out[ours + "self_attention.linear_qkv.weight"] = _stack_qkv(*attention, config)
        if config.add_bias_linear or config.add_qkv_bias:
            biases = [take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            out[ours + "self_attention.linear_qkv.bias"] = _stack_qkv(*biases, config)
        out[ours + "mlp.linear_fc1.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        if config.add_bias_linear:
            out[ours + "self_attention.linear_proj.bias"] = take(p + "self_attn.o_proj.bias")
            out[ours + "mlp.linear_fc1.bias"] = torch.cat(
                [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
            out[ours + "mlp.linear_fc2.bias"] = take(p + "mlp.down_proj.bias")
    ignored = {n for n in hf_state if n.endswith((".attn.bias", ".attn.masked_bias",
                                                  "rotary_emb.inv_freq"))}
    left = set(hf_state) - used - ignored
    if left:
        raise ConfigError(f"the Hugging Face checkpoint has tensors threefold would not use: "
                          f"{sorted(left)[:5]}")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def threefold_to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
                    architecture: str) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_threefold` (tied embeddings: no lm_head tensor, as HF saves)."""
    check_exportable(config, architecture)
    if config.apply_layernorm_1p:  # Hugging Face multiplies by the weight itself
        state = {name: tensor + 1 if _is_norm_weight(name) else tensor
                 for name, tensor in state.items()}
    family = ARCHITECTURES[architecture]
    prefix = _hf_prefix(family)
    out: dict[str, torch.Tensor] = {}
    if family == "gpt2":
        out["transformer.wte.weight"] = state["embedding.word_embeddings.weight"]
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = state["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = state["decoder.final_layernorm.bias"]
    else:
        out[f"{prefix}.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
        out[f"{prefix}.norm.weight"] = state["decoder.final_layernorm.weight"]
        if config.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(config.num_layers):
        ours = f"decoder.layers.{i}."
        for suffix, theirs in _layer_names(family, i, config).items():
            out[theirs] = state[ours + suffix]
        if family == "gpt2":
            p = f"transformer.h.{i}."
            qkv = state[ours + "self_attention.linear_qkv.weight"]
            out[p + "attn.c_attn.weight"] = torch.cat(_split_qkv(qkv, config)).t()
            bias = state[ours + "self_attention.linear_qkv.bias"]
            out[p + "attn.c_attn.bias"] = torch.cat(_split_qkv(bias, config))
            out[p + "attn.c_proj.weight"] = state[ours + "self_attention.linear_proj.weight"].t()
            out[p + "mlp.c_fc.weight"] = state[ours + "mlp.linear_fc1.weight"].t()
            out[p + "mlp.c_proj.weight"] = state[ours + "mlp.linear_fc2.weight"].t()
            continue
        p = f"model.layers.{i}."
        q, k, v = _split_qkv(state[ours + "self_attention.linear_qkv.weight"], config)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v})
        if config.add_bias_linear or config.add_qkv_bias:
            q, k, v = _split_qkv(state[ours + "self_attention.linear_qkv.bias"], config)
            out.update({p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": k,
                        p + "self_attn.v_proj.bias": v})
        gate, up = state[ours + "mlp.linear_fc1.weight"].chunk(2)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
        if config.add_bias_linear:
            out[p + "self_attn.o_proj.bias"] = state[ours + "self_attention.linear_proj.bias"]
            gate, up = state[ours + "mlp.linear_fc1.bias"].chunk(2)
            out.update({p + "mlp.gate_proj.bias": gate, p + "mlp.up_proj.bias": up})
            out[p + "mlp.down_proj.bias"] = state[ours + "mlp.linear_fc2.bias"]
    return {name: tensor.contiguous() for name, tensor in out.items()}
