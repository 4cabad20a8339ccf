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

Activations: the tensors threefold's layers keep for backward, per micro-batch, as they are in
this implementation (`measure_activation_bytes` measures the same thing on a real run; the
tests hold the two within 10%). With s sequence, b micro-batch, h hidden, f FFN, a heads, g
query groups of head size d, t TP, sigma = t under sequence parallelism (else 1), e bytes per
activation element, per layer (s is this rank's share of the sequence: divided over CP):
- each of the two norm+linear blocks: the norm's input (fp32, /sigma), its statistics, RMSNorm's
  normalized intermediate, and the linear's input (e, the whole sequence);
- attention: the QKV projection e s b (h + 2 g d)/t, the attention output e s b h/t, RoPE's
  rotated queries and keys, and the softmax log-sum-exp 4 b a s/t (flash attention keeps no
  s x s matrix; selective recomputation drops the log-sum-exp); with --cp-comm-type
  allgather also the other CP ranks' keys and values (ring attention and Ulysses keep only
  this rank's share, so activations fall as 1/CP);
- MLP: e s b f/t times 4 (SwiGLU: fc1 output, SiLU output, product) or 2 (GELU); an MoE
  layer keeps, per (token, expert) pair, the expert's input and output and those
  intermediates at the expert's size over expert TP; an expert-TP rank computes the pairs of
  all its ETP peers;
- dropout masks when dropout is on.
FP8 layers (--fp8-format; model/fp8.py): the linear layers of attention, dense MLPs and shared
experts (and experts under rowwise scaling) keep 1-byte copies of their inputs instead of the
run's dtype: QKV and fc1 (the norm block's linear input; an MoE layer's router keeps it in the
run's dtype beside the shared expert's copy) and fc2 (SwiGLU's product) drop to 1 byte an
element, as does an FP8 expert's input per routed token; the projection's input is the
attention core's output, which the core keeps anyway (its copy adds 1 byte), unless selective
recomputation drops the core's. The step's FP8 weights are held once for all micro-batches
(`Fp8Scaling.weights_cached`), in both layouts (2 bytes per FP8 weight; 1 with
--fp8-param-gather, whose row-major copy is the parameter, and under rowwise scaling, which
keeps the transposed cast only); rowwise and blockwise inputs keep fp32 scales beside their
transposed copies (one per input feature; blockwise one per feature and 128 tokens); under
FSDP each micro-batch in flight keeps its own transposed copy; --fp8-param-gather stores the
FP8 weights in FP8 only (parameters: 1 byte each). Under --no-fp8-wgrad the layers keep their
inputs in the run's dtype, as without FP8, for the weight gradients (the weight copies stay).
Full recomputation keeps only each recomputed group's input (e s b h/sigma) and re-creates one
group's activations during backward. The last stage adds the vocab-parallel cross-entropy's
gradient (e s b V/t chunked, 4 s b V/t for the reference's fp32 softmax). A pipeline stage
holds several micro-batches at once; their number comes from the schedule itself (1F1B: P - r
for stage r; interleaved: more).
"""

from __future__ import annotations

from dataclasses import dataclass

from threefold.config import Config, ModelConfig, ParallelConfig
from threefold.config.fp8 import caches_fp8_weights, experts_in_fp8, traces_fp8_linears
from threefold.parallel.pipeline_parallel.layout import chunk_layers_of
from threefold.parallel.pipeline_parallel.order import interleaved_order, one_f_one_b_order


def _mlp_parameters(model: ModelConfig, f: int, tp: int) -> int:
    """An MLP of hidden size `f` split over `tp` ranks (column-parallel biases split too)."""
    h, fc1 = model.hidden_size, f * (2 if model.swiglu else 1)
    return (h * fc1 + f * h) // tp + ((fc1 // tp + h) if model.add_bias_linear else 0)


def _layer_parameters(
    model: ModelConfig, tp: int, moe: bool = False, ep: int = 1, etp: int = 1
) -> int:
    """One transformer layer's parameters on one TP rank; an MoE layer's MLP is its router,
    its experts divided over EP (split inside over expert TP) and its shared expert over TP."""
    h, d = model.hidden_size, model.kv_channels
    qkv = d * (model.num_attention_heads + 2 * model.num_query_groups)
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    if model.multi_latent_attention:
        count = _mla_parameters(model, tp) + 2 * norm
    else:
        count = (h * qkv + d * model.num_attention_heads * h) // tp + 2 * norm
    if moe:
        count += h * model.num_experts
        count += model.num_experts // ep * _mlp_parameters(model, model.moe_ffn_hidden_size, etp)
        if model.moe_shared_expert_intermediate_size:
            count += _mlp_parameters(model, model.moe_shared_expert_intermediate_size, tp)
    else:
        count += _mlp_parameters(model, model.ffn_hidden_size, tp)
    if model.multi_latent_attention:
        return count + (h if model.add_bias_linear else 0)
    if model.qk_layernorm:
        count += 2 * d * (2 if model.normalization == "LayerNorm" else 1)
    if model.add_bias_linear:
        count += qkv // tp + h
    elif model.add_qkv_bias:
        count += qkv // tp
    return count


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
    """`_mla_weights` and the latent norms (whole on every rank)."""
    norm = 2 if model.normalization == "LayerNorm" else 1
    latents = model.kv_lora_rank + (model.q_lora_rank or 0)
    return _mla_weights(model, tp) + (latents * norm if model.qk_layernorm else 0)


def _stage_layers(model: ModelConfig, parallel: ParallelConfig, stage: int) -> list[int]:
    """The 0-based numbers of the layers pipeline stage `stage` holds."""
    chunks = chunk_layers_of(parallel, model, stage)
    return [layer for offset, layers in chunks for layer in range(offset, offset + layers)]


def stage_expert_parameters(model: ModelConfig, parallel: ParallelConfig, stage: int) -> int:
    """The expert weights among `stage_parameters` (sharded over expert-DP, not DP x CP)."""
    if not model.is_moe:
        return 0
    pattern = model.moe_layer_pattern(model.num_layers)
    per_layer = (model.num_experts // parallel.expert_model_parallel_size) * _mlp_parameters(
        model, model.moe_ffn_hidden_size, parallel.expert_tensor_parallel_size
    )
    layers = sum(pattern[layer] for layer in _stage_layers(model, parallel, stage))
    if stage == parallel.pipeline_model_parallel_size - 1 and pattern[-1]:
        layers += model.mtp_num_layers or 0  # MTP layers: the last layer's kind
    return per_layer * layers


def _fp8_layer(config: Config, layer: int) -> bool:
    """Whether 0-based layer `layer` runs its linear layers in FP8."""
    fp8 = config.fp8
    return fp8.enabled and layer + 1 not in fp8.bf16_layers(config.model.num_layers)


def _mlp_weights(model: ModelConfig, f: int, tp: int) -> int:
    """fc1's and fc2's weight elements of an MLP of hidden size `f` split over `tp` ranks."""
    return model.hidden_size * f * (3 if model.swiglu else 2) // tp


def stage_fp8_weights(config: Config, stage: int) -> int:
    """The weight elements of the FP8 linear layers one rank of stage `stage` holds: attention's
    QKV and projection, dense MLPs' and shared experts' fc1 and fc2, and under rowwise scaling
    the experts' (model/fp8.py)."""
    model, parallel = config.model, config.parallel
    tp, h, d = parallel.tensor_model_parallel_size, model.hidden_size, model.kv_channels
    attention = h * d * (2 * model.num_attention_heads + 2 * model.num_query_groups) // tp
    if model.multi_latent_attention:
        attention = _mla_weights(model, tp)
    mlp = _mlp_weights(model, model.ffn_hidden_size, tp)
    moe = _mlp_weights(model, model.moe_shared_expert_intermediate_size or 0, tp)
    if model.is_moe and experts_in_fp8(config.fp8):
        local = model.num_experts // parallel.expert_model_parallel_size
        etp = parallel.expert_tensor_parallel_size
        moe += local * _mlp_weights(model, model.moe_ffn_hidden_size, etp)
    pattern = model.moe_layer_pattern(model.num_layers)
    count = sum(
        attention + (moe if pattern[layer] else mlp)
        for layer in _stage_layers(model, parallel, stage)
        if _fp8_layer(config, layer)
    )
    if stage == parallel.pipeline_model_parallel_size - 1 and config.fp8.enabled:
        # multi-token prediction's layers and projections (model/fp8.py)
        depth = attention + (moe if pattern[-1] else mlp) + 2 * h * h // tp
        count += (model.mtp_num_layers or 0) * depth
    return count


def stage_parameters(
    model: ModelConfig, parallel: ParallelConfig, padded_vocab: int, stage: int
) -> int:
    """Parameters one rank of pipeline stage `stage` holds (at TP rank granularity)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h = model.hidden_size
    pattern = model.moe_layer_pattern(model.num_layers)
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    count = sum(
        _layer_parameters(model, tp, bool(pattern[layer]), ep, etp)
        for layer in _stage_layers(model, parallel, stage)
    )
    embedding = padded_vocab * h // tp
    if stage == 0:
        count += embedding
        if model.position_embedding_type == "learned_absolute":
            count += model.max_position_embeddings * h
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    if stage == pp - 1:
        count += norm  # final norm
        if model.untie_embeddings_and_output_weights or pp > 1:
            count += embedding  # the output layer, or the last stage's copy of the tied one
        count += _mtp_parameters(model, parallel, padded_vocab)
    return count


def _mtp_parameters(model: ModelConfig, parallel: ParallelConfig, padded_vocab: int) -> int:
    """The last stage's multi-token prediction depths (model/mtp.py): each a layer of the last
    layer's kind, eh_proj [h, 2h] split over TP and three norms; under PP its copy of the
    embedding (beside an untied output layer; a tied one's copy is that copy)."""
    depths = model.mtp_num_layers or 0
    if not depths:
        return 0
    tp, h = parallel.tensor_model_parallel_size, model.hidden_size
    last_moe = bool(model.moe_layer_pattern(model.num_layers)[-1])
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    layer = _layer_parameters(model, tp, last_moe, ep, etp)
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
    return stage_parameters(model, ParallelConfig(), padded_vocab, 0)


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
    if training.optimizer_cpu_offload:
        optimizer = 0  # in host memory, not the device's
    return params, grads, optimizer / (dp if distributed_optimizer else 1)


def _local_sequence(config: Config) -> int:
    """The tokens of each sample this rank holds: the sequence divided over CP."""
    return config.model.seq_length // config.parallel.context_parallel_size


def layer_activation_bytes(
    config: Config, recompute_kept: bool = False, fp8: bool = False, moe: bool | None = None
) -> int:
    """What one transformer layer keeps for backward per micro-batch (see the module doc).
    `fp8`: the layer's linears run in FP8; `moe`: whether its MLP is an MoE layer (default:
    the average over the model's layers)."""
    model, parallel = config.model, config.parallel
    s, b, h = _local_sequence(config), config.training.micro_batch_size, model.hidden_size
    f, a, d, g = (
        model.ffn_hidden_size,
        model.num_attention_heads,
        model.kv_channels,
        model.num_query_groups,
    )
    t = parallel.tensor_model_parallel_size
    sigma = t if parallel.sequence_parallel else 1
    e = 2 if (config.training.bf16 or config.training.fp16) else 4
    if recompute_kept:  # full recomputation: the layer group's input only
        return e * s * b * h // sigma
    fp8 = fp8 and config.fp8.fp8_wgrad  # (module doc: --no-fp8-wgrad)
    if moe is None and model.is_moe:  # averaged over the layers: exact if all are MoE
        pattern = model.moe_layer_pattern(model.num_layers)
        share = sum(pattern) / len(pattern)
        dense, sparse = (layer_activation_bytes(config, False, fp8, kind) for kind in (False, True))
        return round((1 - share) * dense + share * sparse)
    rms = model.normalization == "RMSNorm"
    stats = 1 if rms else 2
    norm_block = 4 * s * b * h // sigma * (2 if rms else 1) + 4 * stats * s * b // sigma
    selective = model.recompute_granularity == "selective"
    mlp_in_fp8 = fp8 and not moe
    # The linear's input, gathered over the sequence under SP: an FP8 copy in an FP8 layer
    # (an MoE layer's second norm feeds the router, which keeps it in the run's dtype, and
    # the shared expert, whose FP8 copy adds 1 byte).
    qkv_input, fc1_input = (1 if fp8 else e), (1 if mlp_in_fp8 else e)
    if moe and fp8 and model.moe_shared_expert_intermediate_size:
        fc1_input += 1
    norm_blocks = 2 * norm_block + (qkv_input + fc1_input) * s * b * h
    # The projection's input, the attention core's output: kept by the core unless selective
    # recomputation drops it; the FP8 layer keeps its own copy.
    core_output = ((0 if selective else e) + 1) if fp8 else e
    attention = e * s * b * (h + 2 * g * d) // t + core_output * s * b * h // t
    if model.rotary_position_embeddings:
        attention += e * s * b * (h + g * d) // t
    if not selective:
        attention += 4 * b * a * s // t
        if parallel.context_parallel_size > 1 and parallel.comm_type == "allgather":
            # The other CP ranks' keys and values, gathered and kept for backward.
            others = model.seq_length - s
            attention += 2 * e * others * b * g * d // t
    if model.multi_latent_attention:
        norm_blocks -= qkv_input * s * b * h
        norm_blocks, attention = _mla_activation_bytes(config, s, b, e, norm_blocks, fp8)
    # fc1's output, SiLU's, and their product (fc2's input: 1 byte in FP8); GELU: two.
    mlp = _intermediate_bytes(model, e, mlp_in_fp8) * s * b * f // t
    if moe:
        mlp = _moe_activation_bytes(config, s, b, e, fp8)
    # and each FP8 input's fp32 scales, kept with its transposed copy (rowwise, blockwise)
    scales = _scale_bytes_per_feature(config, s, b) if fp8 else 0
    attention += scales * (h + h // t)
    mlp += scales * (h + f // t) if mlp_in_fp8 else 0
    # The masks of the two residual dropouts, in the activations' dtype as PyTorch's CPU
    # dropout keeps them (CUDA keeps 1-byte masks: the estimate is then a little high).
    dropout = 2 * e * s * b * h // sigma if model.hidden_dropout > 0 else 0
    return norm_blocks + attention + mlp + dropout


def _mla_activation_bytes(
    config: Config, s: int, b: int, e: int, norm_blocks: int, fp8: bool
) -> tuple[int, int]:
    """Multi-latent attention's share of a layer's activations (as `layer_activation_bytes`
    for other attention): the down projections' input, this rank's slice (and the query
    projection's gathered input without a query latent); each latent's norm and the up
    projection's gathered input; the core's queries, keys and values at the padded head size
    (model/mla.py), its output and log-sum-exp unless selective recomputation drops them, and
    the output projection's input (the context cut to the value heads). In FP8 each linear
    layer keeps a 1-byte copy of its input instead (each down projection its own)."""
    model, parallel = config.model, config.parallel
    t = parallel.tensor_model_parallel_size
    sigma = t if parallel.sequence_parallel else 1
    h, heads = model.hidden_size, model.num_attention_heads
    width, v = max(model.q_head_dim, model.v_head_dim), model.v_head_dim
    rms = model.normalization == "RMSNorm"
    x = 1 if fp8 else e  # a linear layer's kept input, per element
    lora = model.q_lora_rank is not None
    norm_blocks += (2 if fp8 and lora else 1) * x * s * b * h // sigma
    if not lora and (sigma > 1 or fp8):
        norm_blocks += x * s * b * h
    attention = 0
    for rank in [model.kv_lora_rank] + ([model.q_lora_rank] if lora else []):
        attention += x * s * b * rank
        if model.qk_layernorm:
            attention += 4 * s * b * rank // sigma * (2 if rms else 1)
            attention += 4 * (1 if rms else 2) * s * b // sigma
    attention += 3 * e * s * b * heads * width // t + x * s * b * heads * v // t
    if model.recompute_granularity != "selective":
        core_output = fp8 or width != v  # else it is the output projection's input
        attention += 4 * b * heads * s // t + (e * s * b * heads * width // t if core_output else 0)
        if parallel.context_parallel_size > 1 and parallel.comm_type == "allgather":
            attention += 2 * e * (model.seq_length - s) * b * heads * width // t
    return norm_blocks, attention


def _scale_bytes_per_feature(config: Config, s: int, b: int) -> int:
    """The fp32 scales an FP8 input's transposed copy keeps per input feature: one (rowwise),
    one per 128 of the s b tokens (blockwise), none (one per tensor)."""
    recipe = config.fp8.fp8_recipe
    return {"rowwise": 4, "blockwise": 4 * -(-s * b // 128)}.get(recipe, 0)


def _intermediate_bytes(model: ModelConfig, e: int, fp8: bool) -> int:
    """Bytes an MLP keeps per intermediate feature of a token: fc1's output, SiLU's and their
    product (GELU: fc1's output and GELU's), the last one fc2's input: 1 byte in FP8."""
    return e * (3 if model.swiglu else 1) + (1 if fp8 else e)


def _moe_activation_bytes(config: Config, s: int, b: int, e: int, fp8: bool) -> int:
    """An MoE MLP: this rank's s b / sigma tokens, each routed to k experts, come back as as
    many expert inputs (taken by the dispatch; fc1's FP8 copy when the experts run in FP8) and
    outputs; an expert keeps the dense MLP's intermediates for each (at its expert-TP share,
    for the pairs of all its ETP peers); the shared expert as the dense MLP of its size.
    Rowwise and blockwise scaling add the fp32 scales of each FP8 GEMM's input."""
    model, parallel = config.model, config.parallel
    t, etp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel_size
    h, f, shared = (
        model.hidden_size,
        model.moe_ffn_hidden_size,
        model.moe_shared_expert_intermediate_size,
    )
    sigma = t if parallel.sequence_parallel else 1
    pairs = s * b // sigma * model.moe_router_topk * etp
    experts = fp8 and experts_in_fp8(config.fp8)
    expert_input = 1 if experts else e
    total = pairs * ((expert_input + e) * h + _intermediate_bytes(model, e, experts) * f // etp)
    if experts:
        total += 4 * model.num_experts // parallel.expert_model_parallel_size * (h + f // etp)
    if shared:
        total += s * b * shared // t * _intermediate_bytes(model, e, fp8)
        total += _scale_bytes_per_feature(config, s, b) * (h + shared // t) if fp8 else 0
    return total


def _micro_batches_in_flight(config: Config, stage: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once, from the
    schedule's own action order (counted in model chunks' worth, divided by the chunks)."""
    parallel = config.parallel
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    m = config.training.num_micro_batches(parallel.data_parallel_size)
    if pp == 1:
        return 1
    group = parallel.microbatch_group_size_per_virtual_pipeline_stage
    order = interleaved_order(m, pp, stage, vpp, group) if vpp else one_f_one_b_order(m, pp, stage)
    held = most = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return -(-most // (vpp or 1))


def micro_batch_activation_bytes(config: Config, stage: int) -> int:
    """One micro-batch's activations on pipeline stage `stage` (all its model chunks)."""
    model, parallel = config.model, config.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    s, b, h = _local_sequence(config), config.training.micro_batch_size, model.hidden_size
    sigma = tp if parallel.sequence_parallel else 1
    e = 2 if (config.training.bf16 or config.training.fp16) else 4
    chunks = chunk_layers_of(parallel, model, stage)
    total = 0
    for offset, layers in chunks:
        recomputed = 0
        if model.recompute_granularity == "full":
            every = model.recompute_num_layers
            groups = (
                -(-layers // every) if model.recompute_method == "uniform" else min(every, layers)
            )
            recomputed = layers if model.recompute_method == "uniform" else groups
            total += groups * layer_activation_bytes(config, recompute_kept=True)
        # --recompute-method block recomputes a chunk's first layers; the rest keep theirs.
        for layer in range(offset + recomputed, offset + layers):
            total += layer_activation_bytes(config, fp8=_fp8_layer(config, layer))
    if model.multi_latent_attention:
        total += 2 * 4 * s * model.qk_pos_emb_head_dim  # MLA's cos/sin tables
    elif model.rotary_position_embeddings:
        total += 2 * 4 * s * model.kv_channels  # the cos/sin tables
    if stage == 0:
        total += 8 * s * b  # token ids
        if model.hidden_dropout > 0:
            total += e * s * b * h // sigma  # the embedding dropout's mask
    if stage == pp - 1:
        total += _output_activation_bytes(config, s, b, sigma, e)
        total += _mtp_activation_bytes(config, s, b, sigma, e)
    return total


def _output_activation_bytes(config: Config, s: int, b: int, sigma: int, e: int) -> int:
    """The final norm, the output layer's input and the loss's."""
    model, tp = config.model, config.parallel.tensor_model_parallel_size
    h, rms = model.hidden_size, model.normalization == "RMSNorm"
    total = 4 * s * b * h // sigma * (2 if rms else 1) + 4 * (1 if rms else 2) * s * b // sigma
    total += e * s * b * h
    # The cross-entropy's gradient: in the logits' dtype (chunked, the default) or the
    # reference's fp32 softmax; plus targets and mask.
    logits_bytes = e if config.kernels.cross_entropy_loss_fusion else 4
    return total + logits_bytes * s * b * model.padded_vocab_size(tp) // tp + 9 * s * b


def _mtp_activation_bytes(config: Config, s: int, b: int, sigma: int, e: int) -> int:
    """Each multi-token prediction depth: its embeddings (enorm's input), both norms'
    statistics, eh_proj's input [2h], its layer, and a final norm, output layer and loss as
    the model's own; the shifted tokens, positions, labels and mask."""
    model = config.model
    depths = model.mtp_num_layers or 0
    if not depths:
        return 0
    h, stats = model.hidden_size, 1 if model.normalization == "RMSNorm" else 2
    last_moe = bool(model.moe_layer_pattern(model.num_layers)[-1])
    per_depth = (
        e * s * b * h // sigma
        + 2 * 4 * stats * s * b // sigma
        + e * s * b * 2 * h // sigma
        + layer_activation_bytes(config, fp8=config.fp8.enabled, moe=last_moe)
        + _output_activation_bytes(config, s, b, sigma, e)
        + 3 * 8 * s * b
        + 4 * s * b
    )
    return depths * per_depth


def recompute_workspace_bytes(config: Config) -> int:
    """Full recomputation re-creates one group's activations during backward."""
    model = config.model
    if model.recompute_granularity != "full":
        return 0
    group = model.recompute_num_layers if model.recompute_method == "uniform" else 1
    return group * layer_activation_bytes(config, fp8=config.fp8.enabled)


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
    if distributed and strategy == "megatron":  # expert state is sharded over expert-DP
        optimizer_bytes += experts * optimizer * (dp_cp / parallel.expert_data_parallel_size - 1)
    if config.training.optimizer == "muon":  # one momentum, not Adam's two moments
        # (the few 1-D weights among the matrices: under 1% of them)
        vocabulary = config.model.padded_vocab_size(parallel.tensor_model_parallel_size)
        dense = count - experts - _word_tables(config.model, parallel, vocabulary, stage)
        shares = (dp_cp, parallel.expert_data_parallel_size) if distributed else (1, 1)
        optimizer_bytes -= 4 * (dense / shares[0] + experts / shares[1])
    fp8_weights = stage_fp8_weights(config, stage)
    gathered = config.fp8.fp8_param_gather
    in_flight = _micro_batches_in_flight(config, stage)
    # The step's FP8 weights in both layouts, shared by its micro-batches (the row-major one
    # is the parameter under --fp8-param-gather; rowwise keeps the transposed one only);
    # uncached (FSDP, and FP8 linears traced into compiled layers), each micro-batch in flight
    # keeps its transposed one (a recomputed one only while recomputing, left out).
    # --fp8-param-gather stores the FP8 weights in FP8 only: 1 byte each, not the run's dtype;
    # under FSDP2 the FP8 copies of a rank's rows sit beside its fp32 shards (4 bytes / share).
    stored_in_fp8 = params / 4 if strategy == "fsdp" else 1 - params
    parameter_bytes = count * params + fp8_weights * stored_in_fp8 * gathered
    fp8_copies = 1 if gathered or config.fp8.fp8_recipe == "rowwise" else 2
    pp = parallel.pipeline_model_parallel_size
    traced = traces_fp8_linears(config.kernels.compile_layers, pp, gathered)
    if not caches_fp8_weights(strategy) or traced:
        fp8_copies = 0 if config.model.recompute_granularity == "full" else in_flight
    activations = in_flight * micro_batch_activation_bytes(
        config, stage
    ) + recompute_workspace_bytes(config)
    return MemoryEstimate(
        stage,
        parameter_bytes,
        count * grads,
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
