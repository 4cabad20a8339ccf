"""Everything a run needs, grouped by concern."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from threefold.config.activation_offload import check_offload_run
from threefold.config.checkpoint import CheckpointConfig
from threefold.config.data import DataConfig
from threefold.config.ep_overlap import check_ep_overlap
from threefold.config.errors import require as _require
from threefold.config.fields import check_minimums
from threefold.config.fp8 import Fp8Config
from threefold.config.kernels import KernelConfig
from threefold.config.logging import LoggingConfig
from threefold.config.model import ModelConfig
from threefold.config.moe import check_upcycling
from threefold.config.muon import check_muon_layout
from threefold.config.parallel import ParallelConfig
from threefold.config.precision_aware import check_precision_aware
from threefold.config.qk_clip import check_qk_clip_layout
from threefold.config.recompute import check_recompute_kernels
from threefold.config.training import TrainingConfig


def _check_interleaved(micro_batches: int, have: str, pp: int, group: int | None) -> None:
    """The interleaved schedule's bounds on a step's micro-batches (`have` says whose)."""
    if group is None:  # groups of PP micro-batches, the last one too
        _require(
            micro_batches % pp == 0,
            f"the interleaved schedule needs the number of micro-batches ({have}) "
            f"to be a multiple of --pipeline-model-parallel-size {pp}",
        )
        return
    # megatron-core's bounds: a group fills the pipeline, and so does the last one
    rest = micro_batches % group
    _require(
        pp <= group <= micro_batches and rest in (0, *range(pp, group)),
        f"--microbatch-group-size-per-virtual-pipeline-stage {group} must be between "
        f"--pipeline-model-parallel-size {pp} and the micro-batches ({have}), and "
        f"leave a last group of 0 or at least {pp}",
    )


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
    fp8: Fp8Config = field(default_factory=Fp8Config)

    def finalize(self) -> list[str]:
        """Derive and validate everything that needs no model, data or process group."""
        for part in fields(self):  # the bounds the fields declare, before anything uses them
            check_minimums(getattr(self, part.name))
        training = self.training
        precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
        warnings = self.parallel.finalize_megatron_fsdp(precision)  # the strategy, first
        warnings += self.model.finalize() + check_muon_layout(self)
        check_qk_clip_layout(self)
        warnings += self.parallel.finalize(self.model)
        self.training.finalize(self.parallel.data_parallel_size, self.model.seq_length)
        parallel = self.parallel
        check_precision_aware(self)  # (a bf16 --main-grads-dtype: bf16 gradient reduction)
        self._finalize_gradient_precision()
        group = parallel.microbatch_group_size_per_virtual_pipeline_stage
        _require(
            group is None or parallel.virtual_pipeline_model_parallel_size,
            "--microbatch-group-size-per-virtual-pipeline-stage shapes the interleaved "
            "schedule: add virtual pipeline stages or drop it",
        )
        if parallel.virtual_pipeline_model_parallel_size:
            dp = parallel.data_parallel_size
            for size in self.training.rampup_batch_sizes():
                micro_batches = self.training.num_micro_batches(dp, size)
                have = f"{micro_batches} = global batch size {size} / (--micro-batch-size x DP)"
                _check_interleaved(
                    micro_batches, have, parallel.pipeline_model_parallel_size, group
                )
            micro_batches = self.training.num_eval_micro_batches(dp)
            have = f"evaluation's {micro_batches} = --eval-global-batch-size / (--eval-micro-"
            have += "batch-size x DP)"
            _check_interleaved(micro_batches, have, parallel.pipeline_model_parallel_size, group)
        warnings += self.data.finalize()
        _require(
            not (training.full_validation and self.data.mock_data),
            "--full-validation reads the validation split once through, and --mock-data's "
            "never ends: give --data-path, or drop the flag for --eval-iters batches",
        )
        _require(
            not training.multiple_validation_sets or self.data.valid_data_path,
            "--multiple-validation-sets evaluates each --valid-data-path dataset on its own: "
            "give them with --train-data-path and --valid-data-path",
        )
        warnings += self._check_sparse_attention()
        warnings += self.checkpoint.finalize()
        warnings += check_upcycling(self)
        if training.skip_train:  # only the model is needed (Megatron-LM's warning)
            if not self.checkpoint.no_load_optim:
                warnings.append("enabling --no-load-optim when skipping training.")
            self.checkpoint.no_load_optim = self.checkpoint.no_load_rng = True
        warnings += self.logging.finalize()
        self.kernels.finalize()
        check_recompute_kernels(self)
        check_offload_run(self)
        check_ep_overlap(self)
        _require(
            not training.check_for_large_grads or parallel.distributed_strategy == "megatron",
            "--check-for-large-grads looks at the gradient buckets of threefold's data "
            "parallelism before their reduction (Megatron-LM's DDP's); PyTorch DDP and FSDP2 "
            "reduce on their own: use --distributed-strategy megatron or drop it",
        )
        distributed_optimizer = (
            parallel.distributed_strategy == "megatron" and parallel.use_distributed_optimizer
        )
        fsdp = parallel.distributed_strategy == "fsdp"
        lora = self.model.lora_rank is not None
        warnings += self.fp8.finalize(
            self.model.num_layers, self.training.fp16, distributed_optimizer, fsdp, lora
        )
        if self.model.moe_shared_expert_overlap and self.kernels.compile_layers:
            warnings.append(
                "--moe-shared-expert-overlap with --compile-layers: each compiled layer runs "
                "its shared expert as its graph orders it, not beside the all-to-alls"
            )
        return warnings

    def _check_sparse_attention(self) -> list[str]:
        """DeepSeek sparse attention over whole sequences on every rank."""
        if not self.model.sparse_attention:
            return []
        _require(
            self.parallel.context_parallel_size == 1,
            "--context-parallel-size with --experimental-attention-variant dsa: the indexer "
            "scores every earlier key of the whole sequence (megatron-core refuses it too); "
            "use TP, PP or DP",
        )
        if self.model.attention_dropout > 0:
            return [
                f"--attention-dropout {self.model.attention_dropout}: DeepSeek sparse attention "
                "drops no attention probabilities (as megatron-core's); it applies to no layer"
            ]
        return []

    def _finalize_gradient_precision(self) -> None:
        parallel = self.parallel
        if not parallel.grad_reduce_in_bf16:
            # Megatron-LM: bf16 needs gradient accumulation and all-reduce in fp32.
            parallel.accumulate_allreduce_grads_in_fp32 |= self.training.bf16
            return
        _require(self.training.bf16, "--grad-reduce-in-bf16 needs --bf16; drop it")
        _require(
            not parallel.accumulate_allreduce_grads_in_fp32,
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict "
            "each other; give one",
        )
        parallel.accumulate_allreduce_grads_in_fp32 = False

    @classmethod
    def from_dict(cls, values: dict) -> Config:
        """The inverse of `dataclasses.asdict`, as stored in a checkpoint's metadata."""
        return cls(
            model=ModelConfig(**values["model"]),
            parallel=ParallelConfig(**values["parallel"]),
            training=TrainingConfig(**values["training"]),
            data=DataConfig(**values["data"]),
            checkpoint=CheckpointConfig(**values["checkpoint"]),
            logging=LoggingConfig(**values["logging"]),
            kernels=KernelConfig(**values.get("kernels", {})),
            fp8=Fp8Config(**values.get("fp8", {})),
        )  # older checkpoints: no kernels, no fp8
