"""Dataclass configs, one per concern, each validating itself.

`threefold.arguments` maps Megatron-LM's flag names onto these; the names of the fields are the
flag names with dashes turned into underscores, so an error can always name the flag to fix.
Validation here needs no model, no data and no process group: it runs before any heavy work.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from threefold.errors import ConfigError, flag
from threefold.errors import require as _require
from threefold.kernels.config import KernelConfig
from threefold.training.config import TrainingConfig

__all__ = ["Config", "ConfigError", "KernelConfig", "TrainingConfig", "flag"]


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    group_query_attention: bool = False
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int = 128
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    add_position_embedding: bool = True  # False: Megatron's --no-position-embedding
    rotary_base: float = 10000.0
    use_rope_scaling: bool = False  # Llama 3.1's RoPE frequency scaling (model/rope.py)
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    # Norm weights stored centred on zero and applied as (1 + weight) (Megatron's
    # --apply-layernorm-1p): weight decay then pulls the scale towards 1, not 0.
    apply_layernorm_1p: bool = False
    qk_layernorm: bool = False  # a norm over each query and key head before RoPE (Qwen3)
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # QKV bias even with --disable-bias-linear (Qwen2)
    openai_gelu: bool = False  # GELU's tanh approximation (GPT-2)
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    # LoRA adapters (fine-tuning): rank None means none.
    lora_rank: int | None = None
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def finalize(self) -> None:
        """Fill the fields Megatron derives from others, then validate."""
        _require(self.num_layers > 0, "--num-layers must be positive")
        _require(self.hidden_size > 0, "--hidden-size must be positive")
        _require(
            self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0
            or self.kv_channels is not None,
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
        if self.group_query_attention:
            _require(self.num_query_groups is not None,
                     "--group-query-attention needs --num-query-groups")
        elif self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _require(
            self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads {self.num_attention_heads} is not divisible by "
            f"--num-query-groups {self.num_query_groups}; choose a divisor of the head count",
        )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _require(self.position_embedding_type in ("learned_absolute", "rope"),
                 "--position-embedding-type must be learned_absolute or rope")
        _require(self.add_position_embedding or self.position_embedding_type == "rope",
                 "--no-position-embedding: a model without position information is not "
                 "implemented; use --position-embedding-type rope (with which the flag changes "
                 "nothing)")
        if self.position_embedding_type == "learned_absolute":
            _require(
                self.seq_length <= self.max_position_embeddings,
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings} with learned positions; raise "
                "--max-position-embeddings or use --position-embedding-type rope",
            )
        if self.position_embedding_type == "rope":
            _require(self.kv_channels % 2 == 0,
                     f"rope needs an even head size, got --kv-channels {self.kv_channels}")
        _require(not self.use_rope_scaling or self.position_embedding_type == "rope",
                 "--use-rope-scaling needs --position-embedding-type rope")
        _require(self.rope_scaling_factor >= 1, "--rope-scaling-factor must be >= 1")
        _require(self.normalization in ("LayerNorm", "RMSNorm"),
                 "--normalization must be LayerNorm or RMSNorm")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{flag(name)} must be in [0, 1), got {value}")
        _require(self.make_vocab_size_divisible_by > 0,
                 "--make-vocab-size-divisible-by must be positive")
        self._finalize_recompute()
        self._finalize_lora()

    def _finalize_lora(self) -> None:
        if self.lora_rank is None:
            return
        _require(self.lora_rank >= 1, "--lora-rank must be >= 1")
        _require(0.0 <= self.lora_dropout < 1.0, "--lora-dropout must be in [0, 1)")
        targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        unknown = [t for t in self.lora_target_modules if t not in targets]
        _require(not unknown, f"--lora-target-modules: {', '.join(unknown)} unknown; choose "
                              f"from {', '.join(targets)}")

    def _finalize_recompute(self) -> None:
        granularity, method = self.recompute_granularity, self.recompute_method
        _require(granularity in (None, "full", "selective"),
                 "--recompute-granularity must be full or selective")
        if granularity == "full":
            _require(method in ("uniform", "block"),
                     "--recompute-granularity full needs --recompute-method uniform or block")
            _require(self.recompute_num_layers is not None and self.recompute_num_layers >= 1,
                     "--recompute-granularity full needs --recompute-num-layers >= 1")
        else:
            _require(method is None and self.recompute_num_layers is None,
                     "--recompute-method and --recompute-num-layers need "
                     "--recompute-granularity full")

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded so every tensor-parallel rank holds an equal, aligned slice."""
        _require(self.vocab_size is not None and self.vocab_size > 0,
                 "the vocabulary size is unknown: pass --vocab-size or a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


STRATEGIES = ("megatron", "ddp", "fsdp", "auto")
TOKENIZERS = (None, "SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
              "NullTokenizer")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # With --bf16 Megatron accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
    # (Config.finalize applies that default); fp16 keeps fp16 gradients unless asked.
    accumulate_allreduce_grads_in_fp32: bool = False
    grad_reduce_in_bf16: bool = False
    ddp_bucket_size: int | None = None  # elements; None: 40M (Megatron's default)
    # megatron: threefold's own DP (+ --use-distributed-optimizer); ddp / fsdp: PyTorch's
    # DistributedDataParallel / FSDP2 for TP=PP=1; auto: chosen from size and memory.
    distributed_strategy: str = "megatron"
    distributed_backend: str | None = None  # None: nccl when CUDA is present, else gloo
    distributed_timeout_minutes: float = 10  # collectives; the stall watchdog fires at 70%
    world_size: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def bucket_size(self) -> int:
        return self.ddp_bucket_size or 40_000_000

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    def _finalize_pipeline(self, model: ModelConfig) -> None:
        pp, layers = self.pipeline_model_parallel_size, model.num_layers
        per_stage = self.num_layers_per_virtual_pipeline_stage
        if per_stage is not None:
            _require(self.virtual_pipeline_model_parallel_size is None,
                     "give only one of --num-layers-per-virtual-pipeline-stage and "
                     "--virtual-pipeline-model-parallel-size")
            _require(per_stage > 0 and layers % (pp * per_stage) == 0,
                     f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                     f"{pp} x --num-layers-per-virtual-pipeline-stage {per_stage}")
            self.virtual_pipeline_model_parallel_size = layers // (pp * per_stage)
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp == 1:
            self.virtual_pipeline_model_parallel_size = vpp = None
        uneven = (self.decoder_first_pipeline_num_layers is not None
                  or self.decoder_last_pipeline_num_layers is not None)
        if vpp is not None:
            _require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
            _require(vpp > 1, "--virtual-pipeline-model-parallel-size must be a positive integer")
            _require(layers % (pp * vpp) == 0,
                     f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                     f"{pp} x --virtual-pipeline-model-parallel-size {vpp}")
            _require(not uneven, "--decoder-first/last-pipeline-num-layers cannot be combined "
                                 "with virtual pipeline stages")
        elif uneven:
            _require(pp > 1, "--decoder-first/last-pipeline-num-layers need "
                             "--pipeline-model-parallel-size > 1")
            from threefold.parallel.pipeline_layout import stage_layer_counts

            try:
                counts = stage_layer_counts(layers, pp, self.decoder_first_pipeline_num_layers,
                                            self.decoder_last_pipeline_num_layers)
            except ValueError as error:
                raise ConfigError(f"--decoder-first/last-pipeline-num-layers: {error}") from None
            _require(all(c >= 1 for c in counts),
                     "--decoder-first/last-pipeline-num-layers leave a stage without layers")
        else:
            _require(layers % pp == 0,
                     f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                     f"{pp}; change one or set --decoder-first/last-pipeline-num-layers")

    def _finalize_strategy(self) -> None:
        strategy = self.distributed_strategy
        _require(strategy in STRATEGIES,
                 f"--distributed-strategy must be one of {', '.join(STRATEGIES)}")
        if strategy in ("ddp", "fsdp"):
            _require(self.model_parallel_size == 1,
                     f"--distributed-strategy {strategy} needs --tensor-model-parallel-size 1 "
                     "and --pipeline-model-parallel-size 1; use --distributed-strategy "
                     "megatron for tensor/pipeline parallelism")
            megatron_only = [flag for flag, value in (
                ("--ddp-bucket-size", strategy == "fsdp" and self.ddp_bucket_size is not None),
                ("--use-distributed-optimizer", self.use_distributed_optimizer),
                ("--overlap-grad-reduce", self.overlap_grad_reduce),
                ("--overlap-param-gather", self.overlap_param_gather)) if value]
            _require(not megatron_only,
                     f"{', '.join(megatron_only)} belong to --distributed-strategy megatron; "
                     f"PyTorch {strategy.upper()} shards/overlaps on its own, drop them")
        if strategy == "auto":
            _require(not self.use_distributed_optimizer,
                     "--distributed-strategy auto decides on the distributed optimizer itself; "
                     "drop --use-distributed-optimizer or choose megatron")

    def finalize(self, model: ModelConfig) -> list[str]:
        """Validate the layout against the world and the model; returns warnings to print."""
        warnings = []
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(tp >= 1, "--tensor-model-parallel-size must be >= 1")
        _require(pp >= 1, "--pipeline-model-parallel-size must be >= 1")
        _require(
            self.world_size % (tp * pp) == 0,
            f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} "
            f"x --pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes",
        )
        self._finalize_pipeline(model)
        _require(
            model.num_attention_heads % tp == 0,
            f"--num-attention-heads {model.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
        _require(
            model.num_query_groups % tp == 0,
            f"--num-query-groups {model.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each TP rank needs whole query groups",
        )
        _require(
            model.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {model.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
        if self.sequence_parallel and tp == 1:
            # Megatron's behaviour: sequence parallelism only exists inside a TP group.
            warnings.append("--sequence-parallel has no effect with "
                            "--tensor-model-parallel-size 1; disabling it")
            self.sequence_parallel = False
        if self.sequence_parallel:
            _require(
                model.seq_length % tp == 0,
                f"--seq-length {model.seq_length} is not divisible by "
                f"--tensor-model-parallel-size {tp}, which --sequence-parallel needs",
            )
        _require(self.ddp_bucket_size is None or self.ddp_bucket_size >= 1,
                 "--ddp-bucket-size must be >= 1")
        _require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather needs --use-distributed-optimizer (only the "
                 "distributed optimizer all-gathers parameters)")
        self._finalize_strategy()
        _require(self.distributed_backend in (None, "gloo", "nccl"),
                 "--distributed-backend must be gloo or nccl")
        return warnings


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    # Megatron's per-split paths; finetune.py reads JSONL conversations from them.
    train_data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    data_cache_path: str | None = None
    mock_data: bool = False
    split: str = "969,30,1"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None  # GPT2BPETokenizer
    merge_file: str | None = None
    num_workers: int = 0
    mmap_bin_files: bool = True  # False: read .bin files through file handles
    # Pretraining windows split at end-of-document tokens (data/loader.DocumentMasks).
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def split_weights(self) -> list[float]:
        parts = self.split.replace("/", ",").split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split {self.split!r} must be numbers such as 969,30,1") from None
        weights = (weights + [0.0, 0.0, 0.0])[:3]
        _require(sum(weights) > 0 and all(w >= 0 for w in weights),
                 f"--split {self.split!r} needs non-negative weights with a positive sum")
        return [w / sum(weights) for w in weights]

    def finalize(self) -> None:
        _require(bool(self.data_path) + self.mock_data + bool(self.train_data_path) == 1,
                 "give exactly one of --data-path PREFIX, --train-data-path and --mock-data")
        _require(not (self.valid_data_path or self.test_data_path) or self.train_data_path,
                 "--valid-data-path/--test-data-path need --train-data-path")
        _require(self.tokenizer_type in TOKENIZERS,
                 f"--tokenizer-type {self.tokenizer_type} is not supported; use one of "
                 f"{', '.join(t for t in TOKENIZERS if t)}")
        if self.tokenizer_type in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
            _require(self.tokenizer_model is not None,
                     f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model "
                     f"{'FILE' if self.tokenizer_type == 'SentencePieceTokenizer' else 'DIR'}")
        self.split_weights()


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    async_save: bool = False  # write in the background; the tracker follows when complete
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False  # checkpoints without optimizer state (Megatron's flag)
    no_save_rng: bool = False  # checkpoints without the ranks' RNG states
    # Retention (torchtitan's keep_latest_k; Megatron-LM keeps every checkpoint): None keeps all.
    ckpt_keep_latest: int | None = None
    finetune: bool = False  # weights only; iteration and consumed samples start at 0
    use_checkpoint_args: bool = False  # model flags from --load (threefold/checkpoint_args.py)

    def finalize(self) -> None:
        if self.save_interval is not None:
            _require(self.save_interval >= 1, "--save-interval must be >= 1")
            _require(self.save is not None, "--save-interval needs --save DIR")
        _require(not self.async_save or self.save is not None, "--async-save needs --save DIR")
        if self.ckpt_keep_latest is not None:
            _require(self.ckpt_keep_latest >= 1, "--ckpt-keep-latest must be >= 1 (leave it "
                     "out to keep every checkpoint)")
            _require(self.save is not None, "--ckpt-keep-latest needs --save DIR")
        # --load equal to --save is how a run resumes itself (requeues, elastic restarts): a
        # first run finds nothing there yet and starts from scratch.
        _require(self.load is None or self.load == self.save or os.path.isdir(self.load),
                 f"--load {self.load}: no such directory; to resume a run from its own "
                 "checkpoints, give --load the --save directory")
        for name, value in (("--no-load-optim", self.no_load_optim),
                            ("--no-load-rng", self.no_load_rng), ("--finetune", self.finetune)):
            _require(not value or self.load is not None, f"{name} needs --load DIR")
        for name, value in (("--no-save-optim", self.no_save_optim),
                            ("--no-save-rng", self.no_save_rng)):
            _require(not value or self.save is not None, f"{name} needs --save DIR")


@dataclass
class LoggingConfig:
    log_interval: int = 100
    log_params_norm: bool = False  # L2 norm of all parameters, each counted once
    # A window of iterations for a profiler (training/profiling.py).
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    log_num_zeros_in_grad: bool = False  # gradient elements that are exactly zero
    # Megatron's timers (training/timers.py): which exist, how they are reported.
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    barrier_with_l1_time: bool = True
    log_timers_to_tensorboard: bool = False
    tensorboard_dir: str | None = None
    log_straggler: bool = False  # report ranks computing slower than straggler_factor x median
    straggler_factor: float = 1.3
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None

    def finalize(self) -> list[str]:
        _require(self.log_interval >= 1, "--log-interval must be >= 1")
        _require(self.straggler_factor > 1, "--straggler-factor must be above 1")
        _require(not self.log_timers_to_tensorboard or self.tensorboard_dir is not None,
                 "--log-timers-to-tensorboard writes to --tensorboard-dir; give one")
        warnings = []
        if self.log_timers_to_tensorboard and self.timing_log_level == 0:
            warnings.append("--log-timers-to-tensorboard writes the per-iteration timers of "
                            "--timing-log-level 1 or 2; at level 0 there are none")
        if not self.profile:
            return warnings + (["--use-pytorch-profiler has no effect without --profile"]
                               if self.use_pytorch_profiler else [])
        _require(0 <= self.profile_step_start < self.profile_step_end,
                 f"--profile-step-start {self.profile_step_start} must be >= 0 and below "
                 f"--profile-step-end {self.profile_step_end}")
        _require(not self.use_pytorch_profiler or self.tensorboard_dir is not None,
                 "--use-pytorch-profiler writes its trace to --tensorboard-dir; give one")
        return warnings


@dataclass
class Config:
    """Everything a run needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def finalize(self) -> list[str]:
        """Derive and validate everything that needs no model, data or process group."""
        self.model.finalize()
        warnings = self.parallel.finalize(self.model)
        self.training.finalize(self.parallel.data_parallel_size)
        parallel = self.parallel
        self._finalize_gradient_precision()
        if parallel.virtual_pipeline_model_parallel_size:
            for size in self.training.rampup_batch_sizes():
                micro_batches = self.training.num_micro_batches(parallel.data_parallel_size,
                                                                size)
                _require(
                    micro_batches % parallel.pipeline_model_parallel_size == 0,
                    f"the interleaved schedule needs the number of micro-batches "
                    f"({micro_batches} = global batch size {size} / (--micro-batch-size x DP)) "
                    "to be a multiple of --pipeline-model-parallel-size "
                    f"{parallel.pipeline_model_parallel_size}")
        self.data.finalize()
        self.checkpoint.finalize()
        warnings += self.logging.finalize()
        self.kernels.finalize()
        return warnings

    def _finalize_gradient_precision(self) -> None:
        parallel = self.parallel
        if not parallel.grad_reduce_in_bf16:
            # Megatron-LM: bf16 needs gradient accumulation and all-reduce in fp32.
            parallel.accumulate_allreduce_grads_in_fp32 |= self.training.bf16
            return
        _require(self.training.bf16, "--grad-reduce-in-bf16 needs --bf16; drop it")
        _require(not parallel.accumulate_allreduce_grads_in_fp32,
                 "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict "
                 "each other; give one")
        parallel.accumulate_allreduce_grads_in_fp32 = False

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """The inverse of `dataclasses.asdict`, as stored in a checkpoint's metadata."""
        return cls(model=ModelConfig(**values["model"]),
                   parallel=ParallelConfig(**values["parallel"]),
                   training=TrainingConfig(**values["training"]),
                   data=DataConfig(**values["data"]),
                   checkpoint=CheckpointConfig(**values["checkpoint"]),
                   logging=LoggingConfig(**values["logging"]),
                   kernels=KernelConfig(**values.get("kernels", {})))  # older checkpoints: none
