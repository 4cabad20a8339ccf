"""The model's architecture and its regularization (Megatron's model flags)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from threefold.config.activation_offload import ActivationOffloadConfig
from threefold.config.cohere import CohereConfig
from threefold.config.dsa import DSAConfig
from threefold.config.errors import flag
from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, FINETUNING, MODEL, arg, flag_of, given_flags
from threefold.config.gemma import GemmaConfig
from threefold.config.granite import GraniteConfig
from threefold.config.hybrid import HybridConfig
from threefold.config.linear_attention import LinearAttentionConfig
from threefold.config.llama4 import Llama4Config
from threefold.config.longrope import LongRopeConfig
from threefold.config.mla import MLAConfig
from threefold.config.moe import MoEConfig
from threefold.config.mtp import MTPConfig
from threefold.config.mup import MuPConfig
from threefold.config.olmo import OlmoConfig
from threefold.config.phi import PhiConfig
from threefold.config.qk_clip import QKClipConfig
from threefold.config.recompute import RecomputeConfig
from threefold.config.window_attention import WindowAttentionConfig


@dataclass
class ModelConfig(
    HybridConfig,
    MLAConfig,
    DSAConfig,
    LinearAttentionConfig,
    WindowAttentionConfig,
    Llama4Config,
    GemmaConfig,
    OlmoConfig,
    CohereConfig,
    GraniteConfig,
    PhiConfig,
    LongRopeConfig,
    MoEConfig,
    MTPConfig,
    RecomputeConfig,
    ActivationOffloadConfig,
    MuPConfig,
    QKClipConfig,
):
    """What each field is to a checkpoint (`checkpoint=`) is declared on it (config/fields.py). The
    hybrid stack's, mixture-of-experts, multi-latent attention, DeepSeek sparse attention,
    linear attention, sliding-window attention, Llama 4 attention, Gemma's, OLMo 2's, Cohere's
    and Granite's layers, Phi's output layer, LongRoPE, multi-token prediction, recomputation,
    activation offloading, muP and QK-clip fields are inherited (config/hybrid.py, config/moe.py,
    config/mla.py, config/dsa.py, config/linear_attention.py, config/window_attention.py,
    config/llama4.py, config/gemma.py, config/olmo.py, config/cohere.py, config/granite.py,
    config/phi.py, config/longrope.py, config/mtp.py, config/recompute.py,
    config/activation_offload.py, config/mup.py, config/qk_clip.py)."""

    num_layers: int = arg(2, checkpoint=ARCHITECTURE, minimum=1, help="transformer layers")
    hidden_size: int = arg(
        64, checkpoint=ARCHITECTURE, minimum=1, help="width of the residual stream"
    )
    ffn_hidden_size: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        minimum=1,
        help="default 4*hidden, or 2/3 of that rounded to 64 with --swiglu",
    )
    num_attention_heads: int = arg(
        4, checkpoint=ARCHITECTURE, minimum=1, help="query heads per layer"
    )
    group_query_attention: bool = arg(
        False, checkpoint=MODEL, help="grouped query attention: --num-query-groups key/value heads"
    )
    num_query_groups: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        help="key/value heads with --group-query-attention (default: one per query head)",
    )
    kv_channels: int | None = arg(
        None, checkpoint=ARCHITECTURE, minimum=1, help="head size; default hidden/heads"
    )
    seq_length: int = arg(128, checkpoint=MODEL, minimum=1, help="tokens per training sample")
    # Checked on load with learned positions only (the position table's rows).
    max_position_embeddings: int | None = arg(
        None, checkpoint=MODEL, help="rows of the learned position table; default --seq-length"
    )
    position_embedding_type: str = arg(
        "learned_absolute",
        checkpoint=ARCHITECTURE,
        choices=("learned_absolute", "rope", "yarn", "longrope", "none"),
        help="learned_absolute (GPT-2), rope (LLaMA), yarn (RoPE stretched by YaRN: "
        "--rotary-scaling-factor and the --yarn-* flags), longrope (Phi's: the --longrope-* "
        "flags) or none (no positions: attention beside the Mamba layers of a hybrid model, "
        "whose recurrence knows the order)",
    )
    # False: Megatron's --no-position-embedding
    add_position_embedding: bool = arg(
        True,
        checkpoint=MODEL,
        flag="--no-position-embedding",
        help=(
            "no learned position embedding (Megatron's deprecated form of "
            "--position-embedding-type rope, which it must come with)"
        ),
    )
    rotary_base: float = arg(10000.0, checkpoint=MODEL, minimum=1, help="RoPE theta")
    rotary_percent: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        help="the share of each head's dimensions RoPE turns (the first ones; Nemotron: 0.5); "
        "the rest pass through",
    )
    rotary_interleaved: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="RoPE rotates adjacent pairs (0,1), (2,3), ... of the head dimension (GPT-J, "
        "Meta's original LLaMA) instead of its two halves",
    )
    rotary_seq_len_interpolation_factor: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        minimum=1,
        help="RoPE's positions divided by this (linear position interpolation: a context this "
        "many times longer; Hugging Face's linear rope_scaling)",
    )
    # Llama 3.1's RoPE frequency scaling (model/rope.py)
    use_rope_scaling: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="Llama 3.1's RoPE frequency scaling (original context 8192)",
    )
    rope_scaling_factor: float = arg(
        8.0,
        checkpoint=ARCHITECTURE,
        help="with --use-rope-scaling; default 8 (Llama 3.1), 32 for Llama 3.2",
    )
    # Hugging Face's other llama3 values (Megatron-LM's are fixed: 1, 4 and 8192)
    rope_scaling_low_freq_factor: float = arg(
        1.0,
        checkpoint=ARCHITECTURE,
        help="with --use-rope-scaling: wavelengths beyond the original context over this are "
        "slowed",
    )
    rope_scaling_high_freq_factor: float = arg(
        4.0,
        checkpoint=ARCHITECTURE,
        help="with --use-rope-scaling: wavelengths below the original context over this are "
        "kept (Llama 4 Scout: 1)",
    )
    rope_scaling_original_max_position_embeddings: int = arg(
        8192,
        checkpoint=ARCHITECTURE,
        minimum=1,
        help="with --use-rope-scaling: the context before the scaling",
    )
    # YaRN (--position-embedding-type yarn; model/rope.py), beside the --rotary-scaling-factor,
    # --mscale and --mscale-all-dim it shares with multi-latent attention (config/mla.py)
    yarn_original_max_position_embeddings: int | None = arg(
        None, checkpoint=ARCHITECTURE, help="YaRN's original context (default 4096)"
    )
    yarn_beta_fast: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        help="YaRN: dimensions turning more often than this over the original context keep "
        "their frequency (default 32)",
    )
    yarn_beta_slow: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        help="YaRN: dimensions turning less often than this are stretched fully (default 1)",
    )
    yarn_correction_range_round_to_int: bool = arg(
        True,
        checkpoint=ARCHITECTURE,
        flag="--no-yarn-correction-range-round-to-int",
        help="YaRN's ramp between kept and stretched dimensions starts and ends between them",
    )
    normalization: str = arg(
        "LayerNorm",
        checkpoint=ARCHITECTURE,
        choices=("LayerNorm", "RMSNorm"),
        help="LayerNorm (GPT-2) or RMSNorm (LLaMA)",
    )
    norm_epsilon: float = arg(1e-5, checkpoint=MODEL, minimum=0, help="epsilon of every norm")
    # Norm weights stored centred on zero and applied as (1 + weight) (Megatron's
    # --apply-layernorm-1p): weight decay then pulls the scale towards 1, not 0.
    apply_layernorm_1p: bool = arg(
        False, checkpoint=ARCHITECTURE, help="norm weights centred on zero, applied as 1 + weight"
    )
    softmax_type: str = arg(
        "vanilla",
        checkpoint=ARCHITECTURE,
        choices=("vanilla", "off-by-one", "learnable"),
        help="attention's softmax: off-by-one adds a logit 0 beside each row's scores, "
        "learnable one learned per head (GPT-OSS's attention sinks)",
    )
    # a norm over each query and key head before RoPE (Qwen3)
    qk_layernorm: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="normalize each query and key head (--normalization, over the head size)",
    )
    swiglu: bool = arg(
        False, checkpoint=ARCHITECTURE, help="SwiGLU MLP (gate and up projections) instead of GELU"
    )
    add_bias_linear: bool = arg(
        True,
        checkpoint=ARCHITECTURE,
        flag="--disable-bias-linear",
        help="no biases in the linear layers (LLaMA)",
    )
    # QKV bias even with --disable-bias-linear (Qwen2)
    add_qkv_bias: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help=(
            "biases on the query, key and value projections even with --disable-bias-linear (Qwen2)"
        ),
    )
    # MLP bias even with --disable-bias-linear (GPT-J; transformers' LLaMA with mlp_bias alone)
    add_mlp_bias: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="biases on the MLP's fc1 and fc2 even with --disable-bias-linear (GPT-J)",
    )
    openai_gelu: bool = arg(
        False, checkpoint=ARCHITECTURE, help="tanh approximation of GELU"
    )  # GELU's tanh approximation (GPT-2)
    squared_relu: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="squared-ReLU MLPs, relu(x)^2 (Primer, Nemotron), instead of GELU",
    )
    # GPT-OSS's MLP: a GLU of quick GELU, x * sigmoid(1.702 x), whose linear half is offset
    # by --glu-linear-offset, both halves clamped to --activation-func-clamp-value
    quick_geglu: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="quick-GELU GLU MLPs: quick_gelu(gate) * (up + --glu-linear-offset) (GPT-OSS)",
    )
    glu_linear_offset: float = arg(
        0.0, checkpoint=ARCHITECTURE, help="added to a GLU's linear half (GPT-OSS: 1.0)"
    )
    activation_func_clamp_value: float | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        help="a GLU's gate clamped to at most V, its linear half to [-V, V] (GPT-OSS: 7.0)",
    )
    # GPT-NeoX's (Pythia's) and GPT-J's layer: x + attention(norm1(x)) + mlp(norm2(x))
    parallel_attention_mlp: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="the attention and the MLP both read the layer's input, their outputs added to it "
        "together (GPT-NeoX's use_parallel_residual)",
    )
    untie_embeddings_and_output_weights: bool = arg(
        False,
        checkpoint=ARCHITECTURE,
        help="an output layer of its own instead of the word embeddings",
    )
    attention_dropout: float = arg(
        0.1, checkpoint=FINETUNING, help="dropout on the attention probabilities"
    )
    hidden_dropout: float = arg(
        0.1, checkpoint=FINETUNING, help="dropout on the embeddings and before each residual add"
    )
    init_method_std: float = arg(
        0.02, minimum=0, help="standard deviation of the normal initialization"
    )
    embedding_init_method_std: float | None = arg(
        None,
        minimum=0,
        help="the embedding's normal initialization's standard deviation, where it is to "
        "differ from --init-method-std (default: the same initialization as the layers')",
    )
    init_method_xavier_uniform: bool = arg(
        False,
        help="Xavier-uniform initialization of the embeddings and every linear weight of the "
        "layers and output layer (U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of each whole "
        "matrix) instead of the normal one",
    )
    vocab_size: int | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        minimum=1,
        help=(
            "vocabulary size without a tokenizer (--mock-data, NullTokenizer); else the tokenizer's"
        ),
    )
    make_vocab_size_divisible_by: int = arg(
        128, checkpoint=MODEL, minimum=1, help="pad the vocabulary to a multiple of this x TP size"
    )
    # What a converted model came from: it travels with --use-checkpoint-args (finetune.py
    # always takes it), and an export writes it (checkpoint/convert.py)
    hf_architecture: str | None = arg(
        None,
        checkpoint=MODEL,
        help="the Hugging Face architecture the model was converted from, which its exports "
        "write (Phi3ForCausalLM, ...); set by the conversion",
    )
    # LoRA adapters (fine-tuning): rank None means none.
    lora_rank: int | None = arg(
        None,
        minimum=1,
        help="add LoRA adapters of this rank; freeze everything else",
        group="LoRA fine-tuning",
    )
    lora_alpha: float = arg(
        32.0, minimum=0, help="adapter scale alpha/rank (default 32)", group="LoRA fine-tuning"
    )
    lora_dropout: float = arg(
        0.0, minimum=0, group="LoRA fine-tuning", help="dropout on the adapters' input"
    )
    lora_freeze_experts: bool = arg(
        False,
        help="mixture of experts: no adapters on the experts (they stay frozen, as the router)",
        group="LoRA fine-tuning",
    )
    lora_target_modules: list[str] = arg(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        help="of linear_qkv linear_proj linear_fc1 linear_fc2 (default: all); "
        "multi-latent attention's linear_qkv: its up projections (or linear_q_proj); a gated "
        "delta net's linear_qkv and linear_proj: its in_proj and out_proj",
        group="LoRA fine-tuning",
    )

    @property
    def mlp_bias(self) -> bool:
        """Whether the dense MLPs' linears have biases (--add-bias-linear's, --add-mlp-bias)."""
        return self.add_bias_linear or self.add_mlp_bias

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLPs are GLUs: fc1 holds a gate and an up projection."""
        return self.swiglu or self.quick_geglu or self.geglu

    @property
    def rotary_position_embeddings(self) -> bool:
        """Whether attention turns queries and keys by the model's RoPE tables (rope, yarn,
        longrope)."""
        return self.position_embedding_type in ("rope", "yarn", "longrope")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE turns (megatron-core's int(kv_channels x
        rotary_percent))."""
        return int(self.kv_channels * self.rotary_percent)

    def _check_rope_scaling_bands(self) -> None:
        bands = (
            "rope_scaling_low_freq_factor",
            "rope_scaling_high_freq_factor",
            "rope_scaling_original_max_position_embeddings",
        )
        given = given_flags(self, ModelConfig, bands)
        _require(
            self.use_rope_scaling or not given,
            f"{' '.join(given)} belong to --use-rope-scaling: add it or drop them",
        )
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        _require(
            0 < low <= high,
            f"--rope-scaling-low-freq-factor {low} and --rope-scaling-high-freq-factor {high}: "
            "the low one must be above 0 and at most the high one",
        )

    def finalize(self) -> list[str]:
        """Fill the fields Megatron derives from others, then validate; returns warnings."""
        hybrid = self.finalize_hybrid()  # (the pattern sets --num-layers)
        self.finalize_mtp()
        self.finalize_qk_clip()
        _require(
            self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
            f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
            f"{self.num_attention_heads}; change one of them or set --kv-channels",
        )
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            # Megatron's default: with SwiGLU, 2/3 of 4h (rounded down to a multiple of 64) keeps
            # the parameter count of the two-matrix MLP.
            if self.swiglu:
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
                self.ffn_hidden_size = max(self.ffn_hidden_size, 64)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        _require(
            not self.squared_relu or not (self.swiglu or self.openai_gelu),
            "--squared-relu is the MLP's activation: drop --swiglu and --openai-gelu",
        )
        _require(
            not self.quick_geglu or not (self.swiglu or self.squared_relu or self.openai_gelu),
            "--quick-geglu is the MLP's activation: drop --swiglu, --squared-relu and "
            "--openai-gelu",
        )
        _require(
            self.gated_linear_unit
            or (self.glu_linear_offset == 0.0 and self.activation_func_clamp_value is None),
            "--glu-linear-offset and --activation-func-clamp-value shape a GLU MLP: add "
            "--quick-geglu, --swiglu or --geglu, or drop them",
        )
        _require(
            not (self.add_mlp_bias and self.num_experts),
            "--add-mlp-bias puts biases on the dense MLPs; with --num-experts it is not built: "
            "drop it (or use --add-bias-linear)",
        )
        _require(
            self.softmax_type == "vanilla" or not self.multi_latent_attention,
            f"--softmax-type {self.softmax_type} with --multi-latent-attention is not "
            "implemented; drop one",
        )
        _require(
            self.activation_func_clamp_value is None or self.activation_func_clamp_value > 0,
            f"--activation-func-clamp-value {self.activation_func_clamp_value} must be > 0",
        )
        if self.group_query_attention:
            _require(
                self.num_query_groups is not None,
                "--group-query-attention needs --num-query-groups",
            )
        elif self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        ungrouped = []
        if not self.group_query_attention and self.num_query_groups != self.num_attention_heads:
            ungrouped.append(
                f"--num-query-groups {self.num_query_groups} without --group-query-attention: "
                f"threefold builds {self.num_query_groups} key/value heads, Megatron-LM one per "
                "query head (it reads the flag only with --group-query-attention); add "
                "--group-query-attention to mean the same in both"
            )
        _require(
            self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads {self.num_attention_heads} is not divisible by "
            f"--num-query-groups {self.num_query_groups}; choose a divisor of the head count",
        )
        _require(
            not (self.init_method_xavier_uniform and self.use_mup),
            "--init-method-xavier-uniform with --use-mup: muP sets the initialization itself; "
            "drop one",
        )
        _require(  # (Megatron-LM draws the router's bias with the init method too, and fails)
            not (self.init_method_xavier_uniform and self.is_moe and self.add_bias_linear),
            "--init-method-xavier-uniform draws matrices, and a mixture's router bias (the "
            "default --add-bias-linear) is a vector drawn with the same method: add "
            "--disable-bias-linear",
        )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _require(
            self.position_embedding_type
            in ("learned_absolute", "rope", "yarn", "longrope", "none"),
            "--position-embedding-type must be learned_absolute, rope, yarn, longrope or none",
        )
        _require(
            self.add_position_embedding
            or self.rotary_position_embeddings
            or self.position_embedding_type == "none",
            "--no-position-embedding: a model without position information is not "
            "implemented; use --position-embedding-type rope (with which the flag changes "
            "nothing)",
        )
        if self.position_embedding_type == "learned_absolute":
            _require(
                self.seq_length <= self.max_position_embeddings,
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings} with learned positions; raise "
                "--max-position-embeddings or use --position-embedding-type rope",
            )
        if self.rotary_position_embeddings:
            _require(
                self.kv_channels % 2 == 0,
                f"rope needs an even head size, got --kv-channels {self.kv_channels}",
            )
            _require(
                0 < self.rotary_percent <= 1,
                f"--rotary-percent {self.rotary_percent}: the share of each head RoPE turns, "
                "above 0 and at most 1",
            )
            _require(
                self.rotary_dim > 0 and self.rotary_dim % 2 == 0,
                f"--rotary-percent {self.rotary_percent} of --kv-channels {self.kv_channels} "
                f"turns {self.rotary_dim} dimensions; RoPE needs an even number of them, more "
                "than 0",
            )
        for name, given in (
            ("--use-rope-scaling", self.use_rope_scaling),
            ("--rotary-interleaved", self.rotary_interleaved),
            ("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor),
        ):
            _require(
                not given or self.position_embedding_type == "rope",
                f"{name} needs --position-embedding-type rope",
            )
        _require(
            self.rotary_percent == 1.0 or self.position_embedding_type in ("rope", "longrope"),
            "--rotary-percent needs --position-embedding-type rope (or longrope)",
        )
        _require(
            not (self.rotary_seq_len_interpolation_factor and self.multi_latent_attention),
            "--rotary-seq-len-interpolation-factor with multi-latent attention, whose RoPE "
            "threefold builds without it; drop the flag",
        )
        yarn = [
            flag_of(f)
            for f in dataclasses.fields(self)
            if f.name.startswith("yarn_") and getattr(self, f.name) != f.default
        ]
        _require(
            not yarn or self.position_embedding_type == "yarn",
            f"{' '.join(yarn)} belong to --position-embedding-type yarn; add it or drop them",
        )
        _require(self.rope_scaling_factor >= 1, "--rope-scaling-factor must be >= 1")
        self._check_rope_scaling_bands()
        self.finalize_longrope()
        _require(
            self.normalization in ("LayerNorm", "RMSNorm"),
            "--normalization must be LayerNorm or RMSNorm",
        )
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")
        self.finalize_mla()
        self.finalize_dsa()
        self.finalize_linear_attention()
        self.finalize_window_attention()
        self.finalize_mup()
        self._finalize_lora()
        warnings = hybrid + ungrouped + self.finalize_moe(self.num_layers, self.ffn_hidden_size)
        warnings += self.finalize_llama4()
        self.finalize_gemma()
        self.finalize_olmo()
        warnings += self.finalize_recompute()
        self.finalize_cohere()
        self.finalize_granite()
        warnings += self.finalize_activation_offload()
        if self.seq_length > self.max_position_embeddings:  # (rope: learned refused above)
            return warnings + [
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}: RoPE runs at any length, but the model records "
                f"a context of {self.max_position_embeddings} (a Hugging Face export's "
                "max_position_embeddings); raise --max-position-embeddings to the length trained"
            ]
        return warnings

    def _finalize_lora(self) -> None:
        if self.lora_rank is None:
            return
        _require(0.0 <= self.lora_dropout < 1.0, "--lora-dropout must be in [0, 1)")
        targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        unknown = [t for t in self.lora_target_modules if t not in targets]
        _require(
            not unknown,
            f"--lora-target-modules: {', '.join(unknown)} unknown; choose "
            f"from {', '.join(targets)}",
        )

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded so every tensor-parallel rank holds an equal, aligned slice."""
        _require(
            self.vocab_size is not None and self.vocab_size > 0,
            "the vocabulary size is unknown: pass --vocab-size or a tokenizer",
        )
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)
