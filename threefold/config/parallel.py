"""The parallel layout: TP, PP (with virtual and uneven stages), CP (config/context_parallel.py),
EP, DP and its strategy (Megatron-FSDP's flags: config/megatron_fsdp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config.context_parallel import ContextParallelConfig
from threefold.config.ep_overlap import ExpertOverlapConfig
from threefold.config.errors import ConfigError
from threefold.config.errors import require as _require
from threefold.config.fields import arg
from threefold.config.flight_recorder import FlightRecorderConfig
from threefold.config.megatron_fsdp import MegatronFsdpConfig
from threefold.config.model import ModelConfig
from threefold.config.pipeline_layout import layout_layer_counts

STRATEGIES = ("megatron", "ddp", "fsdp", "auto")
MAX_TIMEOUT_MINUTES = 1e8


def stage_layer_counts(
    num_layers: int, pipeline_size: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers per pipeline stage (no virtual stages)."""
    if pipeline_size == 1:
        return [num_layers]
    counts: list[int | None] = [None] * pipeline_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    remaining = num_layers - fixed
    if free:
        if remaining < 0 or remaining % len(free):
            raise ValueError(f"{remaining} layers do not split evenly over {len(free)} stages")
        for i in free:
            counts[i] = remaining // len(free)
    elif remaining:
        raise ValueError(f"the first and last stage counts do not add up to {num_layers}")
    return counts  # type: ignore[return-value]


@dataclass
class ParallelConfig(
    MegatronFsdpConfig, ContextParallelConfig, ExpertOverlapConfig, FlightRecorderConfig
):
    tensor_model_parallel_size: int = arg(
        1, minimum=1, help="TP: ranks that split every layer's matrices"
    )
    pipeline_model_parallel_size: int = arg(
        1, minimum=1, help="PP: stages the layers are split into"
    )
    virtual_pipeline_model_parallel_size: int | None = arg(
        None, help="model chunks per pipeline rank (interleaved 1F1B)"
    )
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, help="layers per model chunk (instead of --virtual-pipeline-model-parallel-size)"
    )
    microbatch_group_size_per_virtual_pipeline_stage: int | None = arg(
        None,
        help="interleaved 1F1B: micro-batches that go through each model chunk before the next "
        "group starts (default: the pipeline size); between PP and the micro-batches",
    )
    num_virtual_stages_per_pipeline_rank: int | None = arg(
        None, help="model chunks per pipeline rank (Megatron-LM's newer spelling of V)"
    )
    account_for_embedding_in_pipeline_split: bool = arg(
        False, help="count the embedding as a layer of the first model chunk in the even split"
    )
    account_for_loss_in_pipeline_split: bool = arg(
        False, help="count the output layer and loss as a layer of the last model chunk"
    )
    decoder_first_pipeline_num_layers: int | None = arg(
        None, help="layers of the first pipeline stage (the rest split evenly)"
    )
    decoder_last_pipeline_num_layers: int | None = arg(
        None, help="layers of the last pipeline stage (the rest split evenly)"
    )
    pipeline_model_parallel_layout: str | None = arg(
        None,
        help="the layers of every model chunk, Megatron-LM's string: E embedding, t "
        "transformer layer, m MTP depth, L loss, | between chunks, x*n and (...)*n repeat "
        "(e.g. Et*3|(tt|)*6mL); the chunks per rank set the virtual pipeline size",
    )
    expert_model_parallel_size: int = arg(
        1, minimum=1, help="EP: ranks that split each MoE layer's experts (carved out of DP x CP)"
    )
    expert_tensor_parallel_size: int | None = arg(
        None,
        minimum=1,
        help="ETP: ranks that split each expert's matrices, as TP splits the dense MLP's "
        "(default: --tensor-model-parallel-size, as Megatron)",
    )
    use_tp_pp_dp_mapping: bool = arg(
        False,
        help=(
            "rank order TP-CP-EP-PP-DP instead of TP-CP-EP-DP-PP: a model replica's ranks are "
            "consecutive, so pipeline sends stay inside a node and DP reductions cross nodes"
        ),
    )
    sequence_parallel: bool = arg(
        False,
        help=(
            "split norms, dropout and activations between layers along "
            "the sequence over the TP ranks"
        ),
    )
    tp_comm_overlap: bool = arg(
        False,
        help="overlap the sequence-parallel all-gathers and reduce-scatters with the linear "
        "layers' GEMMs, slice by slice around the TP ring",
    )
    use_distributed_optimizer: bool = arg(
        False, help="shard fp32 master weights and Adam moments across data-parallel ranks"
    )
    num_distributed_optimizer_instances: int = arg(
        1,
        help="with --use-distributed-optimizer: split the data-parallel ranks into this many "
        "instances, each sharding the optimizer over its own ranks, whose gradients are "
        "all-reduced across instances (optimizer memory for fewer cross-node collectives)",
    )
    overlap_grad_reduce: bool = arg(
        False, help="all-reduce each gradient bucket as soon as backward has produced it"
    )
    overlap_param_gather: bool = arg(
        False, help="all-gather updated parameters bucket by bucket during the next forward"
    )
    # With --bf16 Megatron accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
    # (Config.finalize applies that default); fp16 keeps fp16 gradients unless asked.
    accumulate_allreduce_grads_in_fp32: bool = arg(
        False, help="fp32 gradient buffer for fp16 models (bf16 models have one by default)"
    )
    grad_reduce_in_bf16: bool = arg(
        False, help="with --bf16: accumulate and reduce gradients in bf16 instead of fp32"
    )
    ddp_average_in_collective: bool = arg(
        False,
        help="average gradients inside the collective (NCCL's AVG: each rank's gradient "
        "multiplied by 1 / DP on the way in) instead of dividing them before a sum",
    )
    ddp_bucket_size: int | None = arg(
        None, help="elements per gradient bucket"
    )  # elements; None: 40M (Megatron's default)
    # megatron: threefold's own DP (+ --use-distributed-optimizer); ddp / fsdp: PyTorch's
    # DistributedDataParallel / FSDP2 for TP=PP=1; auto: chosen from size and memory.
    distributed_strategy: str = arg(
        "megatron",
        help=(
            "megatron: threefold's data parallelism and optimizers; ddp, fsdp: PyTorch DDP / "
            "FSDP2 over the data-parallel ranks (threefold's TP/PP inside); auto: chosen from "
            "the parameter count and device memory"
        ),
        choices=STRATEGIES,
    )
    # FSDP2's ZeRO-2: each layer keeps its gathered parameters from its forward to its
    # backward (one all-gather a step instead of two; the memory of whole layers held)
    torch_fsdp2_reshard_after_forward: bool = arg(
        True,
        flag="--torch-fsdp2-no-reshard-after-forward",
        help="with FSDP2: keep each layer's gathered parameters from its forward to its "
        "backward (ZeRO-2: fewer all-gathers, more memory)",
    )
    # Megatron-LM's: parameters built without storage and materialized where they live; under
    # FSDP2 after sharding, so no rank holds the whole model (model/meta_device.py)
    init_model_with_meta_device: bool = arg(
        False,
        help="build the model on the meta device: under FSDP2 each rank then allocates and "
        "initializes only its shards (the same values as without it)",
    )
    distributed_backend: str | None = arg(
        None, help="default: nccl when CUDA is available, else gloo", choices=("gloo", "nccl")
    )  # None: nccl when CUDA is present, else gloo
    distributed_timeout_minutes: float = arg(
        10, help="timeout of collectives; the stall watchdog reports at 70% of it"
    )  # collectives; the stall watchdog fires at 70%
    world_size: int = arg(1, cli=False)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def ranks_per_replica(self) -> int:
        """TP x PP x CP: the ranks that together consume one data-parallel share of a batch."""
        return self.model_parallel_size * self.context_parallel_size

    def layout(self, separator: str = ", ") -> str:
        """`TP=2, PP=1, CP=2 (p2p), DP=2`: the sizes of the layout (CP only when used)."""
        sizes = [f"TP={self.tensor_model_parallel_size}", f"PP={self.pipeline_model_parallel_size}"]
        if self.context_parallel_size > 1:
            sizes.append(f"CP={self.context_parallel_size} ({self.comm_type})")
        if self.expert_model_parallel_size > 1:
            sizes.append(f"EP={self.expert_model_parallel_size}")
        return separator.join(sizes + [f"DP={self.data_parallel_size}"])

    @property
    def bucket_size(self) -> int:
        return self.ddp_bucket_size or 40_000_000

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.ranks_per_replica

    def _finalize_pipeline(self, model: ModelConfig) -> None:
        pp, layers = self.pipeline_model_parallel_size, model.num_layers
        if self.num_virtual_stages_per_pipeline_rank is not None:
            _require(
                self.virtual_pipeline_model_parallel_size is None
                and self.num_layers_per_virtual_pipeline_stage is None,
                "give only one of --num-virtual-stages-per-pipeline-rank, "
                "--virtual-pipeline-model-parallel-size and "
                "--num-layers-per-virtual-pipeline-stage",
            )
            self.virtual_pipeline_model_parallel_size = self.num_virtual_stages_per_pipeline_rank
        hybrid_layout = model.hybrid_pipeline_layout(pp)
        if hybrid_layout is not None:  # (megatron-core's conflicts)
            _require(
                self.pipeline_model_parallel_layout is None
                and self.virtual_pipeline_model_parallel_size is None,
                "--hybrid-layer-pattern's | cuts set the pipeline chunks: drop "
                "--pipeline-model-parallel-layout and the virtual pipeline flags",
            )
            self.pipeline_model_parallel_layout = hybrid_layout
        if self.pipeline_model_parallel_layout is not None:
            self._finalize_explicit_layout(model)
            return
        extra = int(self.account_for_embedding_in_pipeline_split)
        extra += int(self.account_for_loss_in_pipeline_split)
        if extra:
            self._finalize_accounted_split(layers, extra)
            return
        per_stage = self.num_layers_per_virtual_pipeline_stage
        if per_stage is not None:
            _require(
                self.virtual_pipeline_model_parallel_size is None,
                "give only one of --num-layers-per-virtual-pipeline-stage and "
                "--virtual-pipeline-model-parallel-size",
            )
            _require(
                per_stage > 0 and layers % (pp * per_stage) == 0,
                f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} x --num-layers-per-virtual-pipeline-stage {per_stage}",
            )
            self.virtual_pipeline_model_parallel_size = layers // (pp * per_stage)
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp == 1:
            self.virtual_pipeline_model_parallel_size = vpp = None
        uneven = (
            self.decoder_first_pipeline_num_layers is not None
            or self.decoder_last_pipeline_num_layers is not None
        )
        if vpp is not None:
            _require(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
            _require(vpp > 1, "--virtual-pipeline-model-parallel-size must be a positive integer")
            _require(
                layers % (pp * vpp) == 0,
                f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp} x --virtual-pipeline-model-parallel-size {vpp}",
            )
            _require(
                not uneven,
                "--decoder-first/last-pipeline-num-layers cannot be combined "
                "with virtual pipeline stages",
            )
        elif uneven:
            _require(
                pp > 1,
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1",
            )
            try:
                counts = stage_layer_counts(
                    layers,
                    pp,
                    self.decoder_first_pipeline_num_layers,
                    self.decoder_last_pipeline_num_layers,
                )
            except ValueError as error:
                raise ConfigError(f"--decoder-first/last-pipeline-num-layers: {error}") from None
            _require(
                all(c >= 1 for c in counts),
                "--decoder-first/last-pipeline-num-layers leave a stage without layers",
            )
        else:
            _require(
                layers % pp == 0,
                f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp}; change one or set --decoder-first/last-pipeline-num-layers",
            )

    def _finalize_explicit_layout(self, model: ModelConfig) -> None:
        """--pipeline-model-parallel-layout: the chunks per rank are the virtual pipeline size;
        no other flag may split the layers too (megatron-core's conflicts)."""
        _require(
            self.decoder_first_pipeline_num_layers is None
            and self.decoder_last_pipeline_num_layers is None
            and not self.account_for_embedding_in_pipeline_split
            and not self.account_for_loss_in_pipeline_split
            and self.num_layers_per_virtual_pipeline_stage is None,
            "--pipeline-model-parallel-layout places every layer: drop "
            "--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-"
            "split and --num-layers-per-virtual-pipeline-stage",
        )
        pp = self.pipeline_model_parallel_size
        chunks = len(self.chunk_layer_counts(model))
        given = self.virtual_pipeline_model_parallel_size
        _require(
            given is None or given * pp == chunks,
            f"--pipeline-model-parallel-layout has {chunks} chunks, {chunks // pp} per pipeline "
            f"rank, and --virtual-pipeline-model-parallel-size is {given}; drop the latter",
        )
        self.virtual_pipeline_model_parallel_size = chunks // pp if chunks > pp else None

    def chunk_layer_counts(self, model: ModelConfig) -> list[int]:
        """Transformer layers of each model chunk of --pipeline-model-parallel-layout, in the
        order they run."""
        return layout_layer_counts(
            self.pipeline_model_parallel_layout,
            self.pipeline_model_parallel_size,
            model.num_layers,
            model.mtp_num_layers,
        )

    def _finalize_accounted_split(self, layers: int, extra: int) -> None:
        """--account-for-embedding/loss-in-pipeline-split: PP x V chunks of equal slots, the
        embedding and the loss taking one each (megatron-core's get_num_layers_to_build)."""
        pp = self.pipeline_model_parallel_size
        _require(
            self.decoder_first_pipeline_num_layers is None
            and self.decoder_last_pipeline_num_layers is None,
            "--account-for-embedding/loss-in-pipeline-split cannot be combined with "
            "--decoder-first/last-pipeline-num-layers",
        )
        per_stage = self.num_layers_per_virtual_pipeline_stage
        if per_stage is not None:  # in slots, as megatron-core counts them
            _require(
                self.virtual_pipeline_model_parallel_size is None,
                "give only one of --num-layers-per-virtual-pipeline-stage and "
                "--virtual-pipeline-model-parallel-size",
            )
            slots_per_stage = (layers + extra) // pp
            _require(
                per_stage > 0 and slots_per_stage % per_stage == 0,
                f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the "
                f"{slots_per_stage} layers (embedding and loss counted) of a pipeline stage",
            )
            self.virtual_pipeline_model_parallel_size = slots_per_stage // per_stage
        if self.virtual_pipeline_model_parallel_size == 1:
            self.virtual_pipeline_model_parallel_size = None
        _require(
            self.virtual_pipeline_model_parallel_size is None or pp > 1,
            "virtual pipeline stages need --pipeline-model-parallel-size > 1",
        )
        chunks = pp * (self.virtual_pipeline_model_parallel_size or 1)
        _require(
            (layers + extra) % chunks == 0 and (layers + extra) // chunks >= 1,
            f"--num-layers {layers} plus the {extra} layer(s) the embedding and loss count for "
            f"do not split evenly over {chunks} model chunks (PP x virtual stages)",
        )

    def _finalize_expert_parallel(self, model: ModelConfig) -> None:
        ep, tp = self.expert_model_parallel_size, self.tensor_model_parallel_size
        cp, pp = self.context_parallel_size, self.pipeline_model_parallel_size
        if self.expert_tensor_parallel_size is None:
            # A dense model's expert groups go unused, but under --use-tp-pp-dp-mapping its
            # expert grid must still split each stage's ranks as the dense grid does.
            dense_etp = tp * cp if self.use_tp_pp_dp_mapping else 1
            self.expert_tensor_parallel_size = tp if model.is_moe else dense_etp
        etp = self.expert_tensor_parallel_size
        # megatron-core's rule: with DP after PP the dense and the experts' grids share their
        # pipelines only when a stage splits into as many replicas in each.
        _require(
            not self.use_tp_pp_dp_mapping or pp == 1 or etp * ep == tp * cp,
            f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs "
            f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} = "
            f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} (the same data-"
            "parallel size for experts as for the dense layers); change one or drop the mapping",
        )
        if not model.is_moe:
            _require(
                ep == 1,
                "--expert-model-parallel-size needs a mixture-of-experts model (--num-experts)",
            )
        # A dense model builds the experts' grid too (its groups go unused), as megatron-core
        # does: it must split a stage's ranks all the same.
        replica_ranks = tp * self.context_parallel_size * self.data_parallel_size
        _require(
            replica_ranks % (ep * etp) == 0,
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must "
            f"divide TP x CP x DP = {replica_ranks} (the experts are split over the ranks of "
            "one pipeline stage)",
        )
        if not model.is_moe:
            return
        _require(
            model.num_experts % ep == 0,
            f"--num-experts {model.num_experts} is not divisible by "
            f"--expert-model-parallel-size {ep}",
        )
        _require(
            model.moe_ffn_hidden_size % etp == 0,
            f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size} is not divisible by "
            f"--expert-tensor-parallel-size {etp}",
        )
        _require(
            tp == 1 or self.sequence_parallel,
            "mixture-of-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
            "(as in Megatron: each TP rank routes its own slice of the sequence)",
        )
        _require(
            self.distributed_strategy != "ddp",
            "mixture-of-experts under --distributed-strategy ddp is not implemented (DDP would "
            "average each expert's gradients with those of other experts): use megatron, fsdp "
            "or auto",
        )

    def _finalize_optimizer_instances(self) -> None:
        count, flag = (
            self.num_distributed_optimizer_instances,
            "--num-distributed-optimizer-instances",
        )
        _require(count >= 1, f"{flag} must be >= 1")
        if count == 1:
            return
        _require(
            self.use_distributed_optimizer and self.distributed_strategy == "megatron",
            f"{flag} {count} splits the distributed optimizer: add --use-distributed-optimizer",
        )
        replicas = self.data_parallel_size * self.context_parallel_size
        _require(
            replicas % count == 0 and self.expert_data_parallel_size % count == 0,
            f"{flag} {count} must divide DP x CP ({replicas}) and expert DP "
            f"({self.expert_data_parallel_size})",
        )
        _require(
            not self.ddp_average_in_collective,
            f"--ddp-average-in-collective with {flag} is not implemented; drop one",
        )

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert: the ranks of one pipeline stage over EP x ETP."""
        stage_ranks = self.world_size // self.pipeline_model_parallel_size
        return stage_ranks // (self.expert_model_parallel_size * self.expert_tensor_parallel_size)

    def _finalize_strategy(self) -> None:
        strategy = self.distributed_strategy
        _require(
            strategy in STRATEGIES, f"--distributed-strategy must be one of {', '.join(STRATEGIES)}"
        )
        if strategy in ("ddp", "fsdp"):
            # TP and PP compose (FSDP2/DDP over DP around each stage's model chunks, virtual
            # stages too, threefold's TP layers inside, as torchtitan and Megatron-LM's
            # --use-torch-fsdp2 do).
            megatron_only = [
                flag
                for flag, value in (
                    ("--ddp-bucket-size", strategy == "fsdp" and self.ddp_bucket_size is not None),
                    ("--use-distributed-optimizer", self.use_distributed_optimizer),
                    ("--overlap-grad-reduce", self.overlap_grad_reduce),
                    ("--overlap-param-gather", self.overlap_param_gather),
                    ("--ddp-average-in-collective", self.ddp_average_in_collective),
                )
                if value
            ]
            _require(
                not megatron_only,
                f"{', '.join(megatron_only)} belong{'s' if len(megatron_only) == 1 else ''} to "
                f"--distributed-strategy megatron; PyTorch {strategy.upper()} shards, overlaps "
                f"and averages on its own, drop {'it' if len(megatron_only) == 1 else 'them'}",
            )
        if strategy == "auto":
            _require(
                not self.use_distributed_optimizer,
                "--distributed-strategy auto decides on the distributed optimizer itself; "
                "drop --use-distributed-optimizer or choose megatron",
            )

    def finalize(self, model: ModelConfig) -> list[str]:
        """Validate the layout against the world and the model; returns warnings to print."""
        warnings = []
        _require(
            self.torch_fsdp2_reshard_after_forward or self.distributed_strategy in ("fsdp", "auto"),
            "--torch-fsdp2-no-reshard-after-forward shapes FSDP2: add --use-torch-fsdp2 (or "
            "--distributed-strategy fsdp) or drop it",
        )
        timeout = self.distributed_timeout_minutes
        # (torch counts a group's and its store's timeouts in 64-bit nanoseconds: 292 years)
        _require(
            0 < timeout <= MAX_TIMEOUT_MINUTES,
            f"--distributed-timeout-minutes must be positive and at most "
            f"{MAX_TIMEOUT_MINUTES:g} minutes, not {timeout:g}",
        )
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(
            self.world_size % (tp * pp) == 0,
            f"world size {self.world_size} is not divisible by --tensor-model-parallel-size {tp} "
            f"x --pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes",
        )
        self.finalize_context_parallel(model)
        self._finalize_pipeline(model)
        check_tensor_parallel_split(model, tp)
        if self.sequence_parallel and tp == 1:
            # Megatron's behaviour: sequence parallelism only exists inside a TP group.
            warnings.append(
                "--sequence-parallel has no effect with "
                "--tensor-model-parallel-size 1; disabling it"
            )
            self.sequence_parallel = False
        _require(
            self.sequence_parallel or not self.tp_comm_overlap,
            "--tp-comm-overlap overlaps the sequence-parallel collectives: add "
            "--sequence-parallel (and --tensor-model-parallel-size > 1)",
        )
        if self.sequence_parallel:
            _require(
                model.seq_length % tp == 0,
                f"--seq-length {model.seq_length} is not divisible by "
                f"--tensor-model-parallel-size {tp}, which --sequence-parallel needs",
            )
        _require(
            self.ddp_bucket_size is None or self.ddp_bucket_size >= 1,
            "--ddp-bucket-size must be >= 1",
        )
        _require(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (only the "
            "distributed optimizer all-gathers parameters)",
        )
        self._finalize_expert_parallel(model)
        self._finalize_optimizer_instances()
        self._finalize_strategy()
        _require(
            self.distributed_backend in (None, "gloo", "nccl"),
            "--distributed-backend must be gloo or nccl",
        )
        return warnings


def check_tensor_parallel_split(model: ModelConfig, tp: int) -> None:
    """The model's heads, query groups and FFN split evenly over `tp` ranks (training, and the
    generation tools at the layout they are launched with)."""
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
    if model.gated_delta_net:
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            heads = getattr(model, name)
            _require(
                heads % tp == 0,
                f"--{name.replace('_', '-')} {heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; each TP rank runs whole gated delta net heads",
            )
    if model.hybrid and "M" in model.hybrid_layers_with_mtp():
        for name, count in (("heads", model.mamba_heads()), ("groups", model.mamba_num_groups)):
            _require(
                count % tp == 0,
                f"the {count} Mamba {name} are not divisible by --tensor-model-parallel-size "
                f"{tp}; each TP rank runs whole heads and whole groups (--mamba-num-{name})",
            )
