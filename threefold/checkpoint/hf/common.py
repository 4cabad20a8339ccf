"""What the Hugging Face adapters share: refusals, RoPE settings, the QKV layouts and the
conversion driver that checks every tensor is used.

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

import math
from collections.abc import Callable

import torch

from threefold.config import ConfigError, ModelConfig
from threefold.config.cohere import CohereConfig
from threefold.config.fields import given_flags
from threefold.config.gemma import GemmaConfig
from threefold.config.granite import GraniteConfig
from threefold.config.mla import (
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
    yarn_mscale,
)
from threefold.config.olmo import OlmoConfig
from threefold.config.phi import PhiConfig
from threefold.model import rope

# Why a multi-latent attention model has no Hugging Face export (after "X has ").
NO_MLA = (
    "no multi-latent attention (--multi-latent-attention); export it as DeepseekV3ForCausalLM "
    "(or to Megatron-LM: --saver megatron)"
)


class TensorSource:
    """A Hugging Face state dict a conversion takes tensors from: `take(name)` returns one and
    marks it used (the driver refuses a checkpoint with tensors left over); `name in take`
    asks whether the checkpoint has it (for layouts that differ between versions)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state, self.used = state, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ConfigError(f"the Hugging Face checkpoint has no {name}")
        self.used.add(name)
        return self.state[name]

    def __contains__(self, name: str) -> bool:
        return name in self.state


Take = TensorSource | Callable[[str], torch.Tensor]


class GivenState(dict):
    """threefold's tensors handed to an export: remembers which ones it read, so that a
    tensor no Hugging Face name carries is refused instead of left behind."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default=None):
        self.read.add(name)
        return super().get(name, default)


def refuse(condition: bool, field: str, value, why: str) -> None:
    if condition:
        raise ConfigError(f"Hugging Face config field {field}={value!r} is not supported: {why}")


def refuse_router_jitter(hf: dict) -> None:
    """Routers that add noise to their logits while training (Mixtral's, Llama 4's option)."""
    jitter = hf.get("router_jitter_noise")
    refuse(bool(jitter), "router_jitter_noise", jitter, "router jitter is not implemented")


def refuse_other_values(settings: dict, fixed: dict, where: str, why: str) -> None:
    """Each of `fixed`'s fields, where `settings` gives it, must have its value there; `why`
    takes the field and that value."""
    for field, value in fixed.items():
        refuse(
            settings.get(field, value) != value,
            f"{where}.{field}",
            settings.get(field),
            why.format(field, value),
        )


def rope_settings(hf: dict) -> tuple[float, dict]:
    """(RoPE base, the ModelConfig fields of its scaling: Llama 3.1's llama3, YaRN or
    LongRoPE) of a Hugging Face config."""
    parameters = hf.get("rope_parameters") or {}
    scaling = {**(hf.get("rope_scaling") or {}), **parameters}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    refuse(
        rope_type not in (None, "default", "linear", "llama3", "yarn", "longrope", "su"),
        "rope_scaling",
        rope_type,
        "threefold implements plain RoPE, linear position interpolation, Llama 3.1's llama3 "
        "scaling, YaRN and LongRoPE",
    )
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "yarn":
        return theta, _yarn_fields(scaling, hf)
    if rope_type in ("longrope", "su"):  # ("su": its name in Phi-3's first configs)
        return theta, _longrope_fields(scaling, hf)
    if rope_type == "linear":  # (transformers divides the frequencies, megatron-core positions)
        return theta, {"rotary_seq_len_interpolation_factor": float(scaling["factor"])}
    if rope_type != "llama3":
        return theta, {}
    return theta, {
        "use_rope_scaling": True,
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_scaling_low_freq_factor": float(scaling.get("low_freq_factor", rope.LOW_FREQ_FACTOR)),
        "rope_scaling_high_freq_factor": float(
            scaling.get("high_freq_factor", rope.HIGH_FREQ_FACTOR)
        ),
        "rope_scaling_original_max_position_embeddings": int(
            scaling.get("original_max_position_embeddings", rope.ORIGINAL_CONTEXT)
        ),
    }


def scaled_or_no_rope(config: ModelConfig) -> bool:
    """Whether the model's positions are other than plain RoPE's: no RoPE, or RoPE scaled
    (llama3, YaRN, LongRoPE) or interpolated."""
    return (
        config.position_embedding_type != "rope"
        or config.use_rope_scaling
        or bool(config.rotary_seq_len_interpolation_factor)
    )


def plain_rope_theta(hf: dict, family: str) -> float:
    """The RoPE base of a config of a family with plain RoPE only (Phi's, Nemotron's): scaling,
    in rope_scaling or rope_parameters, is refused by name."""
    scaling = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    refuse(rope_type != "default", "rope_scaling", rope_type, f"{family}'s plain RoPE only")
    return float(scaling.get("rope_theta", hf.get("rope_theta", 10000.0)))


def partial_rotary_factor(hf: dict) -> float:
    """The share of each head RoPE turns (--rotary-percent): transformers 5 keeps it in
    rope_parameters, the Hub's configs at the top level."""
    parameters = hf.get("rope_parameters") or {}
    return float(parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def _yarn_fields(scaling: dict, hf: dict) -> dict:
    """YaRN as transformers reads it: the original context defaults to the model's, the
    factor to their ratio; the temperature from mscale over mscale_all_dim when both are
    given, else from the factor alone (threefold's mscale 1 over 0, Megatron-LM's default)."""
    original = scaling.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    given = scaling.get("attention_factor")
    implied = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    refuse(
        given is not None and abs(given - implied) > 1e-12,
        "rope_scaling.attention_factor",
        given,
        f"threefold's YaRN scales by mscale's ratio ({implied} here), not a factor of its own",
    )
    return {
        "position_embedding_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
        "yarn_original_max_position_embeddings": int(original),
        "yarn_beta_fast": float(scaling.get("beta_fast") or 32),
        "yarn_beta_slow": float(scaling.get("beta_slow") or 1),
        "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True)),
    }


def _longrope_fields(scaling: dict, hf: dict) -> dict:
    """LongRoPE as transformers reads it: the original context from the config's top level
    first (Phi-3's), the attention factor given, else from `factor`, else from the ratio of
    the contexts (config/longrope.py)."""
    positions = hf.get("max_position_embeddings", 4096)
    original = int(
        hf.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or positions
    )
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor") or positions / original
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "position_embedding_type": "longrope",
        "longrope_short_factor": [float(f) for f in scaling["short_factor"]],
        "longrope_long_factor": [float(f) for f in scaling["long_factor"]],
        "longrope_original_max_position_embeddings": original,
        "longrope_attention_factor": float(attention),
    }


def llama3_rope_scaling(config: ModelConfig) -> dict:
    return {
        "rope_type": "llama3",
        "factor": config.rope_scaling_factor,
        "low_freq_factor": config.rope_scaling_low_freq_factor,
        "high_freq_factor": config.rope_scaling_high_freq_factor,
        "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings,
    }


def rope_scaling(config: ModelConfig) -> dict | None:
    """A model's RoPE scaling as transformers' `rope_scaling` (None: plain RoPE)."""
    interpolation = config.rotary_seq_len_interpolation_factor
    if interpolation and config.use_rope_scaling:
        raise ConfigError(
            "transformers' rope_scaling holds one kind: this model has both "
            "--rotary-seq-len-interpolation-factor and --use-rope-scaling"
        )
    if interpolation:
        return {"rope_type": "linear", "factor": float(interpolation)}
    if config.use_rope_scaling:
        return llama3_rope_scaling(config)
    if config.position_embedding_type == "longrope":
        return {
            "rope_type": "longrope",
            "short_factor": config.longrope_short_factor,
            "long_factor": config.longrope_long_factor,
            "original_max_position_embeddings": config.longrope_original_max_position_embeddings,
            "attention_factor": config.longrope_attention_factor,
        }
    if config.position_embedding_type != "yarn":
        return None
    return {
        "rope_type": "yarn",
        "factor": config.rotary_scaling_factor,
        "original_max_position_embeddings": config.yarn_original_max_position_embeddings
        or YARN_ORIGINAL_MAX_POSITION_EMBEDDINGS,
        "beta_fast": config.yarn_beta_fast or YARN_BETA_FAST,
        "beta_slow": config.yarn_beta_slow or YARN_BETA_SLOW,
        "mscale": config.mscale,
        "mscale_all_dim": config.mscale_all_dim,
        "truncate": config.yarn_correction_range_round_to_int,
    }


def stack_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """[all q; all k; all v] rows -> megatron-core's per-group [q..., k, v] rows."""
    groups, d = config.num_query_groups, config.kv_channels
    rest = q.shape[1:]
    q = q.reshape(groups, -1, d, *rest)
    k, v = k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, config: ModelConfig, halves: bool = True):
    """The inverse of `stack_qkv`; `halves`: for a model that rotates each head's halves
    (transformers' LLaMA; Llama 4 rotates adjacent pairs, as --rotary-interleaved does)."""
    groups, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, d, *rest)
    q, k, v = grouped.split([per_group, 1, 1], dim=1)
    if config.rotary_interleaved and halves:
        # Hugging Face rotates each head's halves: pair (2i, 2i + 1) becomes rows i and
        # d/2 + i, which turns the same scores (a dot product does not see the order).
        q, k = (x.unflatten(2, (d // 2, 2)).transpose(2, 3).flatten(2, 3) for x in (q, k))
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


# The families whose own layers (the flags of config/<family>.py) only their adapters export:
# the Adapter attribute that says so, whose layers they are, and the architecture to export as.
FAMILY_LAYERS = (
    (GraniteConfig, "exports_granite", "Granite's", "GraniteForCausalLM"),
    # (before Cohere's: Phi's layer has Cohere's shared norm, and only Phi exports both)
    (PhiConfig, "exports_phi", "Phi's", "PhiForCausalLM"),
    (CohereConfig, "exports_cohere", "Cohere's", "CohereForCausalLM"),
    (GemmaConfig, "exports_gemma", "Gemma's", "Gemma3ForCausalLM"),
    (OlmoConfig, "exports_olmo", "OLMo 2's", "Olmo2ForCausalLM"),
)


class Adapter:
    """One Hugging Face model family. Subclasses say how its config and tensors map to
    threefold's (`model_config`, `hf_config`, `take_weights`, `give_weights`); the driver
    below checks that a conversion uses every tensor and exports what threefold computes."""

    architecture: str
    model_type: str
    exports_moe = False  # a mixture-of-experts architecture
    exports_mla = False  # multi-latent attention (hf/deepseek.py)
    # DeepSeek-V3's routing: sigmoid scores, expert biases, groups, scaled weights
    # (hf/deepseek.py, hf/glm4_moe.py)
    deepseek_routing = False
    partial_rope = False  # RoPE on the first part of each head (hf/qwen3_next.py, hf/glm4_moe.py)
    # gated delta nets, gated attention and a gated shared expert, RoPE on part of each head
    # (hf/qwen3_next.py)
    exports_qwen3_next = False
    # a shared expert scaled by a sigmoid gate (hf/moe.py: Qwen2-MoE's, Qwen3-Next's)
    gated_shared_expert = False
    exports_llama4 = False  # transformers' Llama 4 layers (hf/llama4.py)
    exports_dense = False  # a mixture-of-experts architecture whose layers may all be dense
    exports_hybrid = False  # a hybrid stack of Mamba and other layers (hf/nemotron_h.py)
    exports_mtp = False  # its files hold multi-token prediction depths (Nemotron 3 Super's mtp.*)
    exports_gemma = False  # Gemma's layers (config/gemma.py, hf/gemma.py)
    parallel_layers = False  # --parallel-attention-mlp (hf/gpt_neox.py)
    exports_olmo = False  # OLMo 2's layers (config/olmo.py, hf/olmo2.py)
    exports_granite = False  # Granite's residual multiplier (config/granite.py, hf/granite.py)
    # config/cohere.py's layers (hf/cohere.py; hf/falcon.py: the shared norm, checked there)
    exports_cohere = False
    exports_phi = False  # config/phi.py's output-layer bias (hf/phi.py)
    squared_relu_mlp = False  # --squared-relu's MLP (hf/nemotron.py)
    mlp_only_biases = False  # --add-mlp-bias (hf/llama.py's LLaMA, hf/gptj.py)
    rotates_halves = True  # RoPE on each head's halves (Llama 4: on adjacent pairs)
    windows = False  # a sliding window in every layer (Mistral's)
    windows_by_layer = False  # a sliding window in the layers it names (GPT-OSS's)
    sinks = False  # a learned sink logit per head (--softmax-type learnable: GPT-OSS's)
    # Its norms scale by (1 + weight), as --apply-layernorm-1p's do (Qwen3-Next's).
    zero_centered_norms = False
    # Hugging Face tensors that carry nothing (buffers some versions save).
    ignored_suffixes = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
    # Parts of a multimodal checkpoint a conversion of its text model leaves out (said at
    # conversion: `left_behind`).
    left_behind_prefixes: tuple[str, ...] = ()
    exports_as: str | None = None  # the architecture its models export as (None: its own)

    def model_config(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def depth_marker(self, config: ModelConfig, k: int) -> str | None:
        """The name of a tensor of multi-token prediction depth k (0-based) in the files, when
        the architecture's files hold depths (None: they hold none)."""
        return None

    def hf_config(self, config: ModelConfig) -> dict:
        raise NotImplementedError

    def check_exportable(self, config: ModelConfig) -> None:
        if config.qk_layernorm:
            raise ConfigError(
                f"{self.architecture} has no query/key norms and this model was "
                "trained with --qk-layernorm; export it as Qwen3ForCausalLM"
            )

    def refuse_problems(self, problems: list[tuple[bool, str]]) -> None:
        """`check_exportable`'s one line: the first of `problems` (whether it holds, what the
        architecture cannot express) that holds."""
        for problem, what in problems:
            if problem:
                raise ConfigError(f"{self.architecture} cannot express this model: {what}")

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        raise NotImplementedError

    def give_weights(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
        raise NotImplementedError

    def common_hf_config(self, config: ModelConfig) -> dict:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "initializer_range": config.init_method_std,
            "torch_dtype": "float32",
        }

    def to_threefold(
        self, hf_state: dict[str, torch.Tensor], config: ModelConfig
    ) -> dict[str, torch.Tensor]:
        # (hf/mtp_layers.py reads this module's Take)
        from threefold.checkpoint.hf.mtp_layers import keep_held_depths

        keep_held_depths(self, config, hf_state)
        take = TensorSource(hf_state)
        used = take.used
        out = self.take_weights(take, config, used)
        left = {n for n in hf_state if not n.endswith(self.ignored_suffixes)} - used
        left -= set(self.left_behind(hf_state))
        if left:
            raise ConfigError(
                f"the Hugging Face checkpoint has tensors threefold would not "
                f"use: {sorted(left)[:5]}"
            )
        return {name: tensor.contiguous() for name, tensor in out.items()}

    def left_behind(self, hf_state: dict[str, torch.Tensor]) -> list[str]:
        """The tensors of `hf_state` the conversion leaves out (`left_behind_prefixes`)."""
        prefixes = self.left_behind_prefixes
        return [name for name in hf_state if prefixes and name.startswith(prefixes)]

    def to_hf(self, state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        if config.hybrid != self.exports_hybrid:
            raise ConfigError(
                f"this model is a hybrid stack (--hybrid-layer-pattern), which {self.architecture} "
                "is not; export it as NemotronHForCausalLM"
                if config.hybrid
                else f"{self.architecture} is a hybrid stack and this model is a GPT one; export "
                "it as LlamaForCausalLM"
            )
        if config.is_moe and not self.exports_moe:
            raise ConfigError(
                f"this model is a mixture of experts, which {self.architecture} is not; export "
                "it as MixtralForCausalLM or Qwen3MoeForCausalLM"
            )
        if self.exports_moe and not config.is_moe and not (self.exports_mla or self.exports_dense):
            raise ConfigError(
                f"{self.architecture} is a mixture of experts and this model is dense; export "
                "it as LlamaForCausalLM or Qwen3ForCausalLM"
            )
        if config.multi_latent_attention and not self.exports_mla:
            raise ConfigError(f"{self.architecture} has {NO_MLA}")
        if config.rotary_percent != 1.0 and not self.partial_rope:
            raise ConfigError(
                f"{self.architecture} turns every dimension of each head with RoPE; this "
                f"model's --rotary-percent {config.rotary_percent} turns only some"
            )
        if config.is_moe and config.moe_expert_capacity_factor is not None:
            raise ConfigError(
                f"{self.architecture} drops no tokens, and this model's experts take at most "
                f"--moe-expert-capacity-factor {config.moe_expert_capacity_factor} times their "
                "share: transformers would compute something else"
            )
        if config.moe_router_topk_scaling_factor and not self.deepseek_routing:
            raise ConfigError(
                f"{self.architecture} does not scale its routing weights, and this model's "
                f"--moe-router-topk-scaling-factor {config.moe_router_topk_scaling_factor} "
                "does (DeepseekV3ForCausalLM's and Glm4MoeForCausalLM's routed_scaling_factor)"
            )
        if (config.moe_router_enable_expert_bias or config.moe_router_num_groups) and not (
            self.deepseek_routing
        ):
            raise ConfigError(
                f"{self.architecture} routes by plain top-k scores; this model's DeepSeek-V3 "
                "routing (--moe-router-enable-expert-bias, --moe-router-num-groups) is "
                "DeepseekV3ForCausalLM's and Glm4MoeForCausalLM's"
            )
        heads = config.kv_channels or config.hidden_size // config.num_attention_heads
        if config.use_mup and (
            config.mup_logits_mult != 1.0
            or config.mup_embedding_mult != 1.0
            or (config.mup_query_scale(heads) != 1.0 and not config.multi_latent_attention)
        ):
            raise ConfigError(
                f"{self.architecture} has no muP multipliers: this --use-mup model scales its "
                "logits, embeddings or attention scores, which the export would lose"
            )
        gated = [
            flag
            for flag, given in (
                ("--experimental-attention-variant", config.gated_delta_net),
                ("--attention-output-gate", config.attention_output_gate),
                (
                    "--moe-shared-expert-gate",
                    config.moe_shared_expert_gate and not self.gated_shared_expert,
                ),
            )
            if given
        ]
        if gated and not self.exports_qwen3_next:
            raise ConfigError(
                f"{self.architecture} has no gated delta nets or gates ({' '.join(gated)}); "
                "export this model as Qwen3NextForCausalLM (or, with only a gated shared "
                "expert, Qwen2MoeForCausalLM)"
            )
        llama4 = [
            flag
            for flag, given in (
                ("--no-rope-freq", config.no_rope_freq),
                ("--qk-l2-norm", config.qk_l2_norm),
                ("--moe-apply-probs-on-input", config.moe_apply_probs_on_input),
                ("--attention-chunk-size", config.attention_chunk_size),
                ("--attn-temperature-tuning", config.attn_temperature_tuning),
            )
            if given
        ]
        if llama4 and not self.exports_llama4:
            raise ConfigError(
                f"{self.architecture} has none of Llama 4's layers ({' '.join(llama4)}): "
                "export this model as Llama4ForCausalLM (with Cohere's layers and windows: "
                "Cohere2ForCausalLM)"
            )
        for fields, exports, family, architecture in FAMILY_LAYERS:
            flags = given_flags(config, fields)
            if flags and not getattr(self, exports):
                raise ConfigError(
                    f"{self.architecture} has none of {family} layers ({' '.join(flags)}): "
                    f"export this model as {architecture}"
                )
        if config.parallel_attention_mlp and not self.parallel_layers:
            raise ConfigError(
                f"{self.architecture}'s MLP reads the attention's output, and this model's "
                "reads the layer's input (--parallel-attention-mlp): export it as "
                "GPTNeoXForCausalLM"
            )
        if config.add_mlp_bias and not (config.add_bias_linear or self.mlp_only_biases):
            raise ConfigError(
                f"{self.architecture} has no biases on the MLP alone (--add-mlp-bias): export "
                "this model as LlamaForCausalLM or GPTJForCausalLM"
            )
        if config.squared_relu and not self.squared_relu_mlp:
            raise ConfigError(
                f"{self.architecture} has no squared-ReLU MLPs (--squared-relu): export this "
                "model as NemotronForCausalLM (LayerNorm) or ArceeForCausalLM (RMSNorm)"
            )
        if config.window_size is not None and not (
            self.windows_by_layer or (self.windows and config.window_attn_skip_freq is None)
        ):
            some = " in some layers" if config.window_attn_skip_freq else ""
            raise ConfigError(
                f"{self.architecture} has no sliding window in every layer, and this model "
                f"attends in a window (--window-size){some}: export it as MistralForCausalLM "
                "(every layer slides) or Qwen2ForCausalLM (the layers it names)"
            )
        if config.softmax_type != "vanilla" and not self.sinks:
            raise ConfigError(
                f"{self.architecture} has no attention sinks, and this model's softmax has one "
                f"more logit per head (--softmax-type {config.softmax_type}): export a mixture "
                "of experts with learned sinks as GptOssForCausalLM"
            )
        if config.quick_geglu and not self.sinks:
            raise ConfigError(
                f"{self.architecture} has no quick-GELU GLU MLPs (--quick-geglu); "
                "GptOssForCausalLM's experts have them"
            )
        if config.rotary_interleaved and config.rotary_percent != 1.0 and self.rotates_halves:
            raise ConfigError(
                f"{self.architecture} rotates the halves of each head's turned part; a "
                f"--rotary-interleaved model with --rotary-percent {config.rotary_percent} does "
                "not export to it (regrouping part of each head is not implemented)"
            )
        if config.rotary_interleaved and config.qk_layernorm and self.rotates_halves:
            raise ConfigError(
                f"{self.architecture} rotates the halves of each head; a --rotary-interleaved "
                "model with --qk-layernorm does not export to it (its norm weights would need "
                "the regrouping its query and key rows get, which is not implemented)"
            )
        self.check_exportable(config)
        # Hugging Face multiplies by the weight itself (or by 1 + weight: zero_centered_norms)
        shift = int(config.apply_layernorm_1p) - int(self.zero_centered_norms)
        if shift:
            state = {
                name: tensor + shift if name.endswith("layernorm.weight") else tensor
                for name, tensor in state.items()
            }
        given = GivenState(state)
        out = self.give_weights(given, config)
        left = sorted(set(given) - given.read)
        if left:
            raise ConfigError(
                f"{self.architecture} has no place for {', '.join(left[:3])}"
                f"{f' and {len(left) - 3} more' if len(left) > 3 else ''}: the export would "
                "compute something else without them"
            )
        return {name: tensor.contiguous() for name, tensor in out.items()}


def renamed(
    names: dict[str, str], i: int, source: Callable[[str], torch.Tensor], to_hf: bool
) -> dict[str, torch.Tensor]:
    """Layer i's tensors that only change name: threefold suffix -> HF name (`names`)."""
    ours = f"decoder.layers.{i}."
    if to_hf:
        return {theirs: source(ours + suffix) for suffix, theirs in names.items()}
    return {ours + suffix: source(theirs) for suffix, theirs in names.items()}
