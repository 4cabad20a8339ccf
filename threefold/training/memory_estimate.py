"""Per-device memory of a model and layout, predicted without running it.

Static memory: the parameters each rank holds (its pipeline stage's layers, embedding and
output layer; matrices divided by TP, experts by EP and expert TP; the vocabulary padded as
the run pads it) times the bytes per parameter of the precision and data-parallel strategy:

    strategy, precision            params  grads             optimizer
    megatron, fp32                 4       4                 8       (Adam moments)
    megatron, bf16                 2       4, or 2 with      12      (fp32 master + moments)
                                           --grad-reduce-in-bf16
    megatron, fp16                 2       2, or 4 with      12
                                           --accumulate-allreduce-grads-in-fp32
    + --use-distributed-optimizer                            optimizer / (DP x CP)
                                                             (expert weights: / expert-DP)
    ddp (fp32 params, autocast)    4       4                 8
    fsdp                           (4      4                 8) / (DP x CP)
                                   (expert weights: / expert-DP)
      + --overlap-moe-expert-parallel-comm: params + 2 (bf16/fp16) or 4, every parameter
        gathered through the step

Activations: training/activation_estimate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config import Config, ModelConfig, ParallelConfig
from threefold.config.fp8 import caches_fp8_weights, experts_in_fp8
from threefold.config.hybrid import ATTENTION, GDN, MAMBA, MAMBA_CONV_KERNEL, MLP, MOE
from threefold.config.precision_aware import DTYPE_BYTES
from threefold.parallel.pipeline_parallel.layout import chunk_layers_of
from threefold.training.activation_estimate import (
    fp8_layer,
    micro_batch_activation_bytes,
    micro_batches_in_flight,
    recompute_workspace_bytes,
)


def _mlp_parameters(model: ModelConfig, f: int, tp: int, h: int | None = None) -> int:
    """An MLP of hidden size `f` split over `tp` ranks (column-parallel biases split too),
    between widths `h` (the model's hidden size; an expert's under --moe-latent-size)."""
    h, fc1 = h or model.hidden_size, f * (2 if model.gated_linear_unit else 1)
    return (h * fc1 + f * h) // tp + ((fc1 // tp + h) if model.mlp_bias else 0)


def _per_feature(model: ModelConfig) -> int:
    """A norm's parameters per feature: its weight, and LayerNorm's bias (not Cohere's)."""
    return 2 if model.normalization == "LayerNorm" and model.layernorm_bias else 1


def _layer_parameters(
    model: ModelConfig,
    tp: int,
    moe: bool = False,
    ep: int = 1,
    etp: int = 1,
    linear: bool = False,
    symbol: str | None = None,
) -> int:
    """One transformer layer's parameters on one TP rank; an MoE layer's MLP is its router,
    its experts divided over EP (split inside over expert TP) and its shared expert over TP
    (with its gate); a `linear` layer's attention is a gated delta net. `symbol`: a hybrid
    stack's layer (config/hybrid.py), its norm and one part."""
    h, d = model.hidden_size, model.kv_channels
    if symbol == MAMBA:
        return _mamba_parameters(model, tp) + h * _per_feature(model)
    if symbol in (MLP, MOE):
        return _mlp_part_parameters(model, tp, moe, ep, etp) + h * _per_feature(model)
    gate = d * model.num_attention_heads if model.attention_output_gate else 0
    qkv = d * (model.num_attention_heads + 2 * model.num_query_groups) + gate
    # the norms before the attention and the MLP (one for both: Cohere's), and after them
    # (Gemma's, OLMo 2's)
    alone = symbol in (ATTENTION, GDN)  # (a hybrid stack's attention or gated delta net alone)
    inputs = 1 if model.parallel_attention_mlp_shared_norm or alone else 2
    norms = inputs * int(model.sublayer_input_norms) + 2 * int(model.post_sublayer_norm)
    norm = norms * h * _per_feature(model)
    if linear:
        count = _gdn_parameters(model, tp) + norm
    elif model.multi_latent_attention:
        count = _mla_parameters(model, tp) + norm
    else:
        count = (h * qkv + d * model.num_attention_heads * h) // tp + norm
        if model.softmax_type == "learnable":  # a sink logit per head
            count += model.num_attention_heads // tp
    if not alone:
        count += _mlp_part_parameters(model, tp, moe, ep, etp)
    if linear:
        return count
    if model.multi_latent_attention:
        return count + (h if model.add_bias_linear else 0)
    if model.qk_layernorm and model.qk_layernorm_across_heads:  # (OLMo 2's, split over TP)
        count += (model.num_attention_heads + model.num_query_groups) * d // tp
    elif model.qk_layernorm and model.qk_layernorm_per_head:  # (Command R+'s, split over TP)
        heads = model.num_attention_heads + model.num_query_groups
        count += heads * d * _per_feature(model) // tp
    elif model.qk_layernorm:
        count += 2 * d * _per_feature(model)
    if model.add_bias_linear:
        count += qkv // tp + h
    elif model.add_qkv_bias:
        count += qkv // tp
    return count


def _mlp_part_parameters(model: ModelConfig, tp: int, moe: bool, ep: int, etp: int) -> int:
    """A layer's MLP on one TP rank: dense, or the router, experts and shared expert."""
    if not moe:
        return _mlp_parameters(model, model.ffn_hidden_size, tp)
    h = model.hidden_size
    count = (h + int(model.add_bias_linear)) * model.num_experts  # the router
    count += model.num_experts // ep * _expert_parameters(model, etp)
    if model.moe_latent_size:  # the latent projections, whole on every rank
        count += 2 * h * model.moe_latent_size
        count += (h + model.moe_latent_size) if model.add_bias_linear else 0
    if model.moe_shared_expert_intermediate_size:
        count += _mlp_parameters(model, model.moe_shared_expert_intermediate_size, tp)
        count += h if model.moe_shared_expert_gate else 0
    return count


def _mamba_weights(model: ModelConfig, tp: int) -> int:
    """A Mamba mixer's in_proj and out_proj weight elements on one TP rank."""
    sections = model.mamba_sections()
    return model.hidden_size * (sum(sections) + sections[1]) // tp


def _mamba_parameters(model: ModelConfig, tp: int) -> int:
    """A Mamba mixer's parameters on one TP rank (model/mamba.py): its projections, the
    convolution over x, B and C with its bias, dt_bias, A_log and D per head and the gated
    norm's weight (all split by heads or groups)."""
    _, inner, states, _, heads = model.mamba_sections()
    conv = (inner + 2 * states) * (MAMBA_CONV_KERNEL + 1)
    return _mamba_weights(model, tp) + (conv + 3 * heads + inner) // tp


def _gdn_weights(model: ModelConfig, tp: int) -> int:
    """A gated delta net's in_proj and out_proj weight elements on one TP rank."""
    qk, _, v, _, heads, _ = model.gated_delta_net_sections()
    return model.hidden_size * (2 * qk + 3 * v + 2 * heads) // tp


def _gdn_parameters(model: ModelConfig, tp: int) -> int:
    """A gated delta net's parameters on one TP rank (model/gated_delta_net.py): its
    projections, the convolution over q, k and v, A_log and dt_bias per value head (all split
    by heads), and its output norm over a value head; no biases."""
    qk, _, v, _, heads, _ = model.gated_delta_net_sections()
    conv = (2 * qk + v) * model.linear_conv_kernel_dim
    count = _gdn_weights(model, tp) + (conv + 2 * heads) // tp
    return count + model.linear_value_head_dim * _per_feature(model)


def _mla_weights(model: ModelConfig, tp: int) -> int:
    """Multi-latent attention's linear weights on one TP rank: the down projections whole,
    the up and output projections split (model/mla.py)."""
    h, heads, r, c = (
        model.hidden_size,
        model.num_attention_heads,
        model.q_lora_rank,
        model.kv_lora_rank,
    )
    count = h * (c + model.qk_pos_emb_head_dim)
    count += r * h if r is not None else h * heads * model.q_head_dim // tp
    count += (r or 0) * heads * model.q_head_dim // tp
    count += c * heads * (model.qk_head_dim + model.v_head_dim) // tp
    return count + heads * model.v_head_dim * h // tp


def _mla_parameters(model: ModelConfig, tp: int) -> int:
    """`_mla_weights`, the latent norms and DSA's indexer (whole on every rank)."""
    norm = _per_feature(model)
    latents = model.kv_lora_rank + (model.q_lora_rank or 0)
    count = _mla_weights(model, tp) + (latents * norm if model.qk_layernorm else 0)
    return count + (_indexer_parameters(model) if model.sparse_attention else 0)


def _indexer_parameters(model: ModelConfig) -> int:
    """DeepSeek sparse attention's indexer (model/dsa.py): its query, key and head-weight
    projections and its key's LayerNorm."""
    h, heads, d = model.hidden_size, model.dsa_indexer_n_heads, model.dsa_indexer_head_dim
    return (model.q_lora_rank or h) * heads * d + h * d + 2 * d + h * heads


def _stage_layers(model: ModelConfig, parallel: ParallelConfig, stage: int) -> list[int]:
    """The 0-based numbers of the layers pipeline stage `stage` holds."""
    chunks = chunk_layers_of(parallel, model, stage)
    return [layer for offset, layers in chunks for layer in range(offset, offset + layers)]


def stage_expert_parameters(model: ModelConfig, parallel: ParallelConfig, stage: int) -> int:
    """The expert weights among `stage_parameters` (sharded over expert-DP, not DP x CP)."""
    if not model.is_moe:
        return 0
    pattern = model.moe_layer_pattern(model.num_layers)
    per_layer = (model.num_experts // parallel.expert_model_parallel_size) * _expert_parameters(
        model, parallel.expert_tensor_parallel_size
    )
    layers = sum(pattern[layer] for layer in _stage_layers(model, parallel, stage))
    if stage == parallel.pipeline_model_parallel_size - 1:  # MTP layers (model/mtp.py)
        layers += sum(model.layer_pattern_with_mtp()[model.num_layers :])
    return per_layer * layers


def _expert_parameters(model: ModelConfig, etp: int) -> int:
    """One expert on one expert-TP rank."""
    return _mlp_parameters(model, model.moe_ffn_hidden_size, etp, model.moe_latent_size)


def _mlp_weights(model: ModelConfig, f: int, tp: int, h: int | None = None) -> int:
    """fc1's and fc2's weight elements of an MLP of hidden size `f` split over `tp` ranks
    (between widths `h`: as `_mlp_parameters`)."""
    return (h or model.hidden_size) * f * (3 if model.gated_linear_unit else 2) // tp


def stage_fp8_weights(config: Config, stage: int) -> int:
    """The weight elements of the FP8 linear layers one rank of stage `stage` holds: attention's
    QKV and projection (a gated delta net's in_proj and out_proj), dense MLPs' and shared
    experts' fc1 and fc2, latent experts' projections, and under rowwise scaling
    the experts' (model/fp8.py)."""
    model, parallel = config.model, config.parallel
    tp, h, d = parallel.tensor_model_parallel_size, model.hidden_size, model.kv_channels
    gate = model.num_attention_heads if model.attention_output_gate else 0
    attention = h * d * (2 * model.num_attention_heads + 2 * model.num_query_groups + gate) // tp
    if model.multi_latent_attention:
        attention = _mla_weights(model, tp)
    mlp = _mlp_weights(model, model.ffn_hidden_size, tp)
    moe = _mlp_weights(model, model.moe_shared_expert_intermediate_size or 0, tp)
    moe += 2 * h * (model.moe_latent_size or 0)  # the latent projections
    if model.is_moe and experts_in_fp8(config.fp8):
        local = model.num_experts // parallel.expert_model_parallel_size
        etp = parallel.expert_tensor_parallel_size
        moe += local * _mlp_weights(model, model.moe_ffn_hidden_size, etp, model.moe_latent_size)
    pattern = model.moe_layer_pattern(model.num_layers)
    linear = model.linear_attention_pattern(model.num_layers)
    symbols = model.hybrid_layers() if model.hybrid else [None] * model.num_layers
    parts = {  # a hybrid stack's layers: one part each
        MAMBA: lambda layer: _mamba_weights(model, tp),
        ATTENTION: lambda layer: attention,
        GDN: lambda layer: _gdn_weights(model, tp),
        MLP: lambda layer: mlp,
        MOE: lambda layer: moe,
        None: lambda layer: (
            (_gdn_weights(model, tp) if linear[layer] else attention)
            + (moe if pattern[layer] else mlp)
        ),
    }
    count = sum(
        parts[symbols[layer]](layer)
        for layer in _stage_layers(model, parallel, stage)
        if fp8_layer(config, layer)
    )
    if stage == parallel.pipeline_model_parallel_size - 1 and config.fp8.enabled:
        # multi-token prediction's layers and projections (model/fp8.py)
        depth = attention + (moe if pattern[-1] else mlp) + 2 * h * h // tp
        if model.hybrid:  # (a depth's pattern)
            depth = sum(parts[s](None) for s in model.hybrid_mtp_layers()) + 2 * h * h // tp
        count += model.mtp_depths_built() * depth
    return count


def stage_parameters(
    model: ModelConfig, parallel: ParallelConfig, padded_vocab: int, stage: int
) -> int:
    """Parameters one rank of pipeline stage `stage` holds (at TP rank granularity)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h = model.hidden_size
    pattern = model.moe_layer_pattern(model.num_layers)
    linear = model.linear_attention_pattern(model.num_layers)
    symbols = model.hybrid_layers() if model.hybrid else [None] * model.num_layers
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    count = sum(
        _layer_parameters(
            model, tp, bool(pattern[layer]), ep, etp, bool(linear[layer]), symbols[layer]
        )
        for layer in _stage_layers(model, parallel, stage)
    )
    embedding = padded_vocab * h // tp
    if stage == 0:
        count += embedding
        if model.position_embedding_type == "learned_absolute":
            count += model.max_position_embeddings * h
    norm = h * _per_feature(model)
    if stage == pp - 1:
        count += norm  # final norm
        if model.untie_embeddings_and_output_weights or pp > 1:
            count += embedding  # the output layer, or the last stage's copy of the tied one
        if model.output_layer_bias:
            count += padded_vocab // tp
        count += _mtp_parameters(model, parallel, padded_vocab)
    return count


def _mtp_parameters(model: ModelConfig, parallel: ParallelConfig, padded_vocab: int) -> int:
    """The last stage's multi-token prediction depths (model/mtp.py): each a layer of the last
    layer's kind (a hybrid model's: the layers of a depth's pattern), eh_proj [h, 2h] split over
    TP and three norms; under PP its copy of the embedding (beside an untied output layer; a
    tied one's copy is that copy)."""
    depths = model.mtp_depths_built()
    if not depths:
        return 0
    tp, h = parallel.tensor_model_parallel_size, model.hidden_size
    last_moe = bool(model.moe_layer_pattern(model.num_layers)[-1])
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    norm = h * _per_feature(model)
    layer = _layer_parameters(model, tp, last_moe, ep, etp)
    if model.hybrid:
        layer = sum(
            _layer_parameters(model, tp, s == MOE, ep, etp, s == GDN, s)
            for s in model.hybrid_mtp_layers()
        )
    count = depths * (layer + 2 * h * h // tp + 3 * norm)
    if parallel.pipeline_model_parallel_size > 1:
        if model.untie_embeddings_and_output_weights:
            count += padded_vocab * h // tp
        if model.position_embedding_type == "learned_absolute":
            count += model.max_position_embeddings * h
    return count


def _word_tables(
    model: ModelConfig, parallel: ParallelConfig, padded_vocab: int, stage: int
) -> int:
    """The word-embedding and output-layer elements of `stage_parameters` (Adam's under Muon:
    megatron-core's `is_embedding_or_output_parameter`)."""
    pp, untied = parallel.pipeline_model_parallel_size, model.untie_embeddings_and_output_weights
    tables = (stage == 0) + (stage == pp - 1) * (
        (untied or pp > 1) + bool(model.mtp_num_layers and pp > 1 and untied)
    )
    return tables * padded_vocab * model.hidden_size // parallel.tensor_model_parallel_size


def parameter_count(model: ModelConfig, padded_vocab: int) -> int:
    """The whole model's parameters (a tied output layer counted once)."""
    return stage_parameters(model, ParallelConfig(expert_tensor_parallel_size=1), padded_vocab, 0)


def _bytes_per_parameter(
    config: Config, strategy: str, distributed_optimizer: bool
) -> tuple[float, float, float]:
    training, parallel = config.training, config.parallel
    # The ranks holding the same weights, over which optimizer state (and FSDP's parameters)
    # are sharded: data-parallel replicas and their context-parallel peers.
    dp = parallel.data_parallel_size * parallel.context_parallel_size
    if strategy in ("ddp", "fsdp"):
        share = dp if strategy == "fsdp" else 1
        return 4 / share, 4 / share, 8 / share
    half = training.bf16 or training.fp16
    params = 2 if half else 4
    grads = 4 if not half or parallel.accumulate_allreduce_grads_in_fp32 else 2
    # fp32 masters of their own: in half precision, offloaded, or beside --fp8-param-gather's
    # FP8 weights (the distributed optimizer then keeps them separate for every parameter)
    separate_masters = half or training.optimizer_cpu_offload or config.fp8.fp8_param_gather
    optimizer = 12 if separate_masters else 8
    if training.precision_aware_steps():  # (training/precision_aware.py)
        moments = DTYPE_BYTES[training.exp_avg_dtype] + DTYPE_BYTES[training.exp_avg_sq_dtype]
        fp32_masters = training.fp16 and training.main_params_dtype == "fp32"
        if not half:
            masters = 0
        elif config.fp8.fp8_param_gather or fp32_masters:
            masters = 4
        else:  # fp16 masters, or a bf16 weight's 16-bit remainders
            masters = 2
        optimizer = moments + masters
    if training.optimizer_cpu_offload:
        optimizer = 0  # in host memory, not the device's
    return params, grads, optimizer / (dp if distributed_optimizer else 1)


@dataclass
class MemoryEstimate:
    stage: int  # the pipeline stage that needs the most
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    micro_batches_in_flight: int
    fp8_weights: float = 0.0  # the step's FP8 weight copies, shared by its micro-batches

    @property
    def static(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.static + self.activations + self.fp8_weights


def estimate_stage(
    config: Config,
    stage: int,
    strategy: str | None = None,
    use_distributed_optimizer: bool | None = None,
) -> MemoryEstimate:
    parallel = config.parallel
    strategy = strategy or parallel.distributed_strategy
    distributed = (
        parallel.use_distributed_optimizer
        if use_distributed_optimizer is None
        else use_distributed_optimizer
    )
    count = stage_parameters(
        config.model,
        parallel,
        config.model.padded_vocab_size(parallel.tensor_model_parallel_size),
        stage,
    )
    params, grads, optimizer = _bytes_per_parameter(config, strategy, distributed)
    optimizer_bytes = count * optimizer
    experts = stage_expert_parameters(config.model, parallel, stage)
    dp_cp = parallel.data_parallel_size * parallel.context_parallel_size
    # Expert state is sharded over expert-DP, not DP x CP: the distributed optimizer's, and
    # FSDP2's parameters and gradients too (parallel/data_parallel/torch_native.py). The
    # per-parameter bytes divided by DP x CP: these many more expert elements make up for it.
    more_experts = experts * (dp_cp / parallel.expert_data_parallel_size - 1)
    if (distributed and strategy == "megatron") or strategy == "fsdp":
        optimizer_bytes += more_experts * optimizer
    sharded = more_experts if strategy == "fsdp" else 0
    if config.training.optimizer == "muon":  # one momentum, not Adam's two moments
        # (the few 1-D weights among the matrices: under 1% of them)
        vocabulary = config.model.padded_vocab_size(parallel.tensor_model_parallel_size)
        dense = count - experts - _word_tables(config.model, parallel, vocabulary, stage)
        shares = (dp_cp, parallel.expert_data_parallel_size) if distributed else (1, 1)
        optimizer_bytes -= 4 * (dense / shares[0] + experts / shares[1])
    fp8_weights = stage_fp8_weights(config, stage)
    gathered = config.fp8.fp8_param_gather
    in_flight = micro_batches_in_flight(config, stage)
    # The step's FP8 weights in both layouts, shared by its micro-batches (the row-major one
    # is the parameter under --fp8-param-gather; rowwise keeps the transposed one only;
    # linears traced into compiled layers read them too, cast before the step); uncached
    # (FSDP), each micro-batch in flight keeps its transposed one (a recomputed one only while
    # recomputing, left out).
    # --fp8-param-gather stores the FP8 weights in FP8 only: 1 byte each, not the run's dtype;
    # under FSDP2 the FP8 copies of a rank's rows sit beside its fp32 shards (4 bytes / share).
    stored_in_fp8 = params / 4 if strategy == "fsdp" else 1 - params
    parameter_bytes = (count + sharded) * params + fp8_weights * stored_in_fp8 * gathered
    if strategy == "fsdp" and parallel.overlap_moe_expert_parallel_comm:
        # every parameter gathered, in the compute dtype, through the step's combined
        # schedule (parallel/data_parallel/torch_native.py: gathered_through_the_schedule)
        parameter_bytes += count * (2 if config.training.bf16 or config.training.fp16 else 4)
    fp8_copies = 1 if gathered or config.fp8.fp8_recipe == "rowwise" else 2
    if not caches_fp8_weights(strategy):
        fp8_copies = 0 if config.model.recompute_granularity == "full" else in_flight
    activations = in_flight * micro_batch_activation_bytes(
        config, stage
    ) + recompute_workspace_bytes(config)
    return MemoryEstimate(
        stage,
        parameter_bytes,
        (count + sharded) * grads,
        optimizer_bytes,
        activations,
        in_flight,
        fp8_weights * fp8_copies,
    )


def estimate_memory(
    config: Config, strategy: str | None = None, use_distributed_optimizer: bool | None = None
) -> MemoryEstimate:
    """The estimate for the pipeline stage that needs the most memory."""
    stages = [
        estimate_stage(config, stage, strategy, use_distributed_optimizer)
        for stage in range(config.parallel.pipeline_model_parallel_size)
    ]
    return max(stages, key=lambda estimate: estimate.total)
