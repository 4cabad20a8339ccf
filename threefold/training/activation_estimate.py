"""Per-micro-batch activation memory of a model and layout, predicted without running it
(training/memory_estimate.py adds the static memory).

Activations: the tensors threefold's layers keep for backward, per micro-batch, as they are in
this implementation (`measure_activation_bytes` measures the same thing on a real run; the
tests hold the two within 10%). With s sequence, b micro-batch, h hidden, f FFN, a heads, g
query groups of head size d, t TP, sigma = t under sequence parallelism (else 1), e bytes per
activation element, per layer (s is this rank's share of the sequence: divided over CP):
- each of the two norm+linear blocks: the norm's input (fp32, /sigma), its statistics, RMSNorm's
  normalized intermediate, and the linear's input (e, the whole sequence); with
  --post-sublayer-norm two more norms of the same cost on the sublayers' outputs, and with
  --no-sublayer-input-norms none before them;
- query and key norms (`qk_norm_bytes`; --qk-layernorm, across heads or per head, and
  --qk-l2-norm): fp32 copies of the queries and keys (in fp32 the queries' copy only, where the
  keys' input is a view of the QKV output the core keeps), the normalized intermediate of those
  with a weight (not F.layer_norm's) and the statistics per head (or per token across heads);
- attention: the QKV projection e s b (a d + 2 g d)/t, the attention output e s b a d/t,
  RoPE's rotated queries and keys, and the softmax log-sum-exp 4 b a s/t (flash attention keeps
  no s x s matrix, nor do attention sinks' blocks; selective recomputation drops the
  log-sum-exp); with --cp-comm-type
  allgather also the other CP ranks' keys and values (ring attention and Ulysses keep only
  this rank's share, so activations fall as 1/CP); with --attention-output-gate the gate's
  fp32 sigmoid and the gated context (the projection's input) too;
- MLP: e s b f/t times 4 (SwiGLU: fc1 output, SiLU output, product) or 2 (GELU); an MoE
  layer keeps, per (token, expert) pair, the expert's input and output and those
  intermediates at the expert's size over expert TP; an expert-TP rank computes the pairs of
  all its ETP peers;
- dropout masks when dropout is on;
- once a micro-batch, the attention masks every layer shares (`shared_mask_bytes`): SDPA's
  additive copies of packed documents' masks and of windows' bands (e b s^2, e s^2);
- DeepSeek sparse attention (`sparse_attention_bytes`): the mask of each query's chosen keys
  (s x s), and, when its indexer learns, its loss's s x s tensors (one per indexer head, and
  three more) as megatron-core 0.16's unfused DSA keeps them;
- a gated delta net layer instead of attention (`_gated_delta_net_activation_bytes`): its
  convolution's input and output, the projections' and gates' per-token tensors, the chunked
  rule's fp32 intermediates (per chunk of C tokens and value head: seven C x C matrices, the
  chunk's queries, keys and values in several forms, the state entering it), the gated norm
  and out_proj's input; under CP for the whole sequence and 1/CP of the heads
  (--recompute-modules gdn_norm_out: the norm's checkpoint keeps the core's output and a
  copy of z, 2e bytes per value element, instead of its 16 bytes of fp32 tensors and its
  statistics; in fp32 SiLU's copy of z goes too).
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
Selective recomputation (--recompute-modules): core_attn drops the core's log-sum-exp and
output; mlp and moe keep the MLP's input only; shared_experts drops the shared expert's
intermediates; moe_act the activation's output (fc1's stays); layernorm keeps each norm's input
instead of its internals and frees the linear's input where that is the norm's own output (no
SP gather, no FP8 copy); mla_up_proj keeps the latents and the down projection's output (the
shared key part is a view of it) instead of the core's query, key and value.
Full recomputation keeps only each recomputed group's input (e s b h/sigma) and re-creates one
group's activations during backward. The last stage adds the vocab-parallel cross-entropy's
gradient (e s b V/t chunked, 4 s b V/t for the reference's fp32 softmax). A pipeline stage
holds several micro-batches at once; their number comes from the schedule itself (1F1B: P - r
for stage r; interleaved: more).
"""

from __future__ import annotations

from collections.abc import Iterable

from threefold.config import Config, ModelConfig
from threefold.config.activation_offload import offload_plan
from threefold.config.fp8 import experts_in_fp8
from threefold.config.hybrid import ATTENTION, GDN, MAMBA, MLP, MOE
from threefold.config.linear_attention import RULE_CHUNK_SIZE as CHUNK_SIZE
from threefold.parallel.pipeline_parallel.layout import chunk_layers_of
from threefold.parallel.pipeline_parallel.order import interleaved_order, one_f_one_b_order
from threefold.training.attention_activations import (
    qk_norm_bytes,
    shared_mask_bytes,
    sparse_attention_bytes,
)
from threefold.training.mamba_activations import mamba_layer_bytes


def fp8_layer(config: Config, layer: int) -> bool:
    """Whether 0-based layer `layer` runs its linear layers in FP8."""
    fp8 = config.fp8
    return fp8.enabled and layer + 1 not in fp8.bf16_layers(config.model.num_layers)


def _local_sequence(config: Config) -> int:
    """The tokens of each sample this rank holds: the sequence divided over CP."""
    return config.model.seq_length // config.parallel.context_parallel_size


def layer_activation_bytes(
    config: Config,
    recompute_kept: bool = False,
    fp8: bool = False,
    moe: bool | None = None,
    linear: bool = False,
    symbol: str | None = None,
) -> int:
    """What one transformer layer keeps for backward per micro-batch (see the module doc).
    `fp8`: the layer's linears run in FP8; `moe`: whether its MLP is an MoE layer (default:
    the average over the model's layers); `linear`: its attention is a gated delta net;
    `symbol`: a hybrid stack's layer (config/hybrid.py), which holds one part."""
    if recompute_kept:  # full recomputation: the layer group's input only
        model, parallel = config.model, config.parallel
        sigma = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
        e = 2 if (config.training.bf16 or config.training.fp16) else 4
        return (
            e
            * _local_sequence(config)
            * config.training.micro_batch_size
            * (model.hidden_size)
            // sigma
        )
    return round(sum(layer_activation_parts(config, fp8, moe, linear, symbol).values()))


def layer_activation_parts(
    config: Config,
    fp8: bool = False,
    moe: bool | None = None,
    linear: bool = False,
    symbol: str | None = None,
) -> dict[str, float]:
    """`layer_activation_bytes` by the module whose forward saves each tensor: the modules
    --offload-modules names (config/activation_offload.py), and "rest"."""
    model, parallel = config.model, config.parallel
    s, b, h = _local_sequence(config), config.training.micro_batch_size, model.hidden_size
    f = model.ffn_hidden_size
    t = parallel.tensor_model_parallel_size
    sigma = t if parallel.sequence_parallel else 1
    e = 2 if (config.training.bf16 or config.training.fp16) else 4
    fp8 = fp8 and config.fp8.fp8_wgrad  # (module doc: --no-fp8-wgrad)
    if symbol == MAMBA:  # (its norm is never recomputed nor offloaded: all of it "rest")
        return {"rest": mamba_layer_bytes(config, s, b, e, sigma, fp8)}
    if moe is None and model.is_moe:  # averaged over the layers: exact if all are MoE
        pattern = model.moe_layer_pattern(model.num_layers)
        share = sum(pattern) / len(pattern)
        dense, sparse = (
            layer_activation_parts(config, fp8, kind, linear, symbol) for kind in (0, 1)
        )
        return {
            name: (1 - share) * dense.get(name, 0) + share * sparse.get(name, 0)
            for name in dense.keys() | sparse.keys()
        }
    rms = model.normalization == "RMSNorm"
    stats = 1 if rms else 2
    norm_block = 4 * s * b * h // sigma * (2 if rms else 1) + 4 * stats * s * b // sigma
    norms = model.recomputes("layernorm")
    if norms:  # a recomputed norm keeps its input only
        norm_block = e * s * b * h // sigma
    mlp_recomputed = model.recomputes("moe" if moe else "mlp")
    mlp_in_fp8 = fp8 and not moe
    # The linear's input, gathered over the sequence under SP: an FP8 copy in an FP8 layer
    # (an MoE layer's second norm feeds the router, which keeps it in the run's dtype, and
    # the shared expert, whose FP8 copy adds 1 byte). Where it is the norm's output itself
    # (no gather, no FP8 copy), a recomputed norm frees it.
    qkv_input, fc1_input = (1 if fp8 else e), (1 if mlp_in_fp8 else e)
    if norms and sigma == 1:
        qkv_input, fc1_input = (1 if fp8 else 0), (1 if mlp_in_fp8 else 0)
    if moe and fp8 and model.moe_shared_expert_intermediate_size:
        fc1_input += 0 if model.recomputes("shared_experts") else 1
    if mlp_recomputed:  # the MLP keeps its input only: the norm's output, unless freed
        fc1_input = 0 if norms else e / sigma
    # --parallel-attention-mlp-shared-norm (Cohere's): one norm; without SP its output is the
    # QKV linear's input, kept once for both
    shared = model.parallel_attention_mlp_shared_norm
    if shared and sigma == 1 and not mlp_in_fp8:
        fc1_input = 0
    mlp_norm = 0 if shared else norm_block
    if model.parallel_attention_mlp and not shared and (norms or e == 4):
        # GPT-NeoX's norm each: both read the layer's input, and where they keep that tensor
        # itself (fp32, or recomputed; in bf16 each keeps its own fp32 copy) it is kept once
        mlp_norm -= e * s * b * h // sigma
    if not model.sublayer_input_norms:  # (OLMo 2's: the sublayers read the residual stream)
        norm_block = mlp_norm = 0
    parts = {"attn_norm": norm_block}
    parts["qkv_linear"] = round(qkv_input * s * b * h)
    rest = 0  # the attention's; the MLP's in `mlp`
    mlp = {"mlp_norm": mlp_norm, "rest": round(fc1_input * s * b * h)}
    if model.post_sublayer_norm:  # (never recomputed, never offloaded: kept whole)
        rest += 2 * (4 * s * b * h // sigma * (2 if rms else 1) + 4 * stats * s * b // sigma)
    if linear:  # (its input projection keeps the norm's output as a linear's input)
        rest += parts.pop("qkv_linear") + _gated_delta_net_activation_bytes(config, b, e)
    elif model.multi_latent_attention:
        mla = _mla_activation_parts(config, s, b, e, fp8)
        rest += mla.pop("rest") + sparse_attention_bytes(config, s, b, e)
        parts.update(mla)
    else:
        attention = _attention_parts(config, s, b, e, fp8)
        rest += attention.pop("rest")
        parts.update(attention)
        parts["qkv_linear"] += qk_norm_bytes(config, s, b, e)
    # and each FP8 input's fp32 scales, kept with its transposed copy (rowwise, blockwise)
    scales = _scale_bytes_per_feature(config, s, b) if fp8 else 0
    rest += scales * (h + h // t)
    if not mlp_recomputed:
        if moe:
            experts = _moe_activation_parts(config, s, b, e, fp8)
            mlp = {**mlp, **experts, "rest": mlp["rest"] + experts["rest"]}
        else:  # fc1's output, SiLU's, and their product (fc2's input: 1 byte in FP8); GELU: 2
            mlp["rest"] += _intermediate_bytes(model, e, mlp_in_fp8) * s * b * f // t
            mlp["rest"] += scales * (h + f // t) if mlp_in_fp8 else 0
    # The mask of each residual dropout, in the activations' dtype as PyTorch's CPU dropout
    # keeps it (CUDA keeps 1-byte masks: the estimate is then a little high).
    dropout = e * s * b * h // sigma if model.hidden_dropout > 0 else 0
    if symbol in (MLP, MOE):  # (a hybrid stack's layers hold one part each)
        return {**mlp, "rest": mlp["rest"] + dropout}
    if symbol == ATTENTION:
        return {**parts, "rest": rest + dropout}
    return {**parts, **mlp, "rest": rest + mlp["rest"] + 2 * dropout}


def _attention_parts(config: Config, s: int, b: int, e: int, fp8: bool) -> dict[str, int]:
    """Self-attention's share of a layer's activations (as `layer_activation_parts`). The core
    keeps its queries, keys and values and the log-sum-exp (under selective recomputation its
    checkpoint keeps the inputs, which offloading leaves). RoPE's rotated queries and keys
    count as kept by the rest: a GPU's attention reads them as views, and offloading the core
    frees them too, but the CPU's copies its inputs and keeps none of them (the estimate is
    the GPU's; the offloading it predicts errs low). The
    projection's input, the core's output, is one storage both keep ("attn_output": freed
    once both have offloaded it), unless selective recomputation drops the core's; the FP8
    projection keeps its own copy beside the core's."""
    model, parallel = config.model, config.parallel
    a, d = model.num_attention_heads, model.kv_channels
    g, t = model.num_query_groups, parallel.tensor_model_parallel_size
    q = a * d  # the queries' and the context's width (GPT-OSS's is not the hidden size)
    core = e * s * b * (q + 2 * g * d) // t
    rope = e * s * b * (q + g * d) // t if model.rotary_position_embeddings else 0
    # --attention-output-gate: the gate's fp32 sigmoid, and the product the projection reads
    # instead of the core's output, which the product's multiply keeps (in FP8 the
    # projection's copy of the product, counted below, where the core keeps its output)
    gate = 4 * s * b * q // t if model.attention_output_gate else 0
    if model.recomputes("core_attn"):
        gate += e * s * b * q // t if gate else 0
        projection = (1 if fp8 else e) * s * b * q // t + gate
        return {"core_attn": 0, "attn_proj": projection, "attn_output": 0, "rest": rope + core}
    core += 4 * b * a * s // t  # (attention sinks' blocks keep a log-sum-exp too)
    if parallel.context_parallel_size > 1 and parallel.comm_type == "allgather":
        # The other CP ranks' keys and values, gathered and kept for backward.
        core += 2 * e * (model.seq_length - s) * b * g * d // t
    output = e * s * b * q // t
    if gate and not fp8:
        gate += output
    if fp8:
        projection = s * b * q // t + gate
        return {"core_attn": core + output, "attn_proj": projection, "attn_output": 0, "rest": rope}
    return {"core_attn": core, "attn_proj": gate, "attn_output": output, "rest": rope}


def _gated_delta_net_activation_bytes(config: Config, b: int, e: int) -> int:
    """A gated delta net layer's activations between in_proj's input and out_proj's (model/
    gated_delta_net.py), as its autograd graph keeps them: for the whole sequence (under CP
    each rank runs all of it for 1/CP of its heads), c = 2 qk + v convolved channels and this
    rank's value heads. In fp32 the convolution's SiLU output (which q and k view) and a copy
    of z are kept; in bf16 fp32 copies of q, k and z."""
    model, parallel = config.model, config.parallel
    split = parallel.tensor_model_parallel_size * parallel.context_parallel_size
    seq, width = model.seq_length, model.linear_conv_kernel_dim
    heads = model.linear_num_value_heads // split
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    qk, v = model.linear_num_key_heads // split * dk, heads * dv
    c = 2 * qk + v
    total = e * b * (2 * seq + width - 1) * c  # the convolution's input and output
    if e == 4:  # the SiLU output (q, k read as fp32 views) and a copy of z (its SiLU)
        total += 4 * b * seq * (c + v)
    else:  # fp32 copies of q, k (L2 norm) and z (its SiLU)
        total += 4 * b * seq * (2 * qk + v)
    total += 4 * b * seq * (2 * model.linear_num_key_heads // split + 3 * heads)  # rsqrt, gates
    # the gated norm: its fp32 input and normalized copies and statistics, SiLU(z), the
    # norm's output and the product (out_proj's input)
    total += (12 + 2 * e) * b * seq * v + 4 * b * seq * heads
    if model.recomputes("gdn_norm_out"):
        # the norm's checkpoint keeps the core's output and a copy of z instead: its fp32
        # tensors and statistics go (in bf16 also z's fp32 copy, out_proj keeping a copy of
        # its input; in fp32 out_proj's input itself, and SiLU's copy of z)
        total -= b * seq * ((16 - e) * v + 4 * heads + (4 * v if e == 4 else 0))
    chunks = -(-seq // CHUNK_SIZE)
    rows = chunks * CHUNK_SIZE  # the padded sequence
    rule = 7 * chunks * CHUNK_SIZE**2 + rows * (5 * dk + 3 * dv + 5) + chunks * dk * dv
    return total + 4 * b * heads * rule


def _mla_activation_parts(config: Config, s: int, b: int, e: int, fp8: bool) -> dict[str, int]:
    """Multi-latent attention's share of a layer's activations (as `layer_activation_parts`
    for other attention). The QKV module's: the down projections' input, this rank's slice
    (and the query projection's gathered input without a query latent), each latent's norm
    and the up projection's gathered input. The core's: its queries, keys and values at the
    padded head size (model/mla.py), its output and log-sum-exp unless selective
    recomputation drops them. The output projection's input (the context cut to the value
    heads). In FP8 each linear layer keeps a 1-byte copy of its input instead (each down
    projection its own)."""
    model, parallel = config.model, config.parallel
    t = parallel.tensor_model_parallel_size
    sigma = t if parallel.sequence_parallel else 1
    h, heads = model.hidden_size, model.num_attention_heads
    width, v = max(model.q_head_dim, model.v_head_dim), model.v_head_dim
    rms = model.normalization == "RMSNorm"
    x = 1 if fp8 else e  # a linear layer's kept input, per element
    lora = model.q_lora_rank is not None
    # the down projections' input: the norm's output (freed where the norm is recomputed)
    qkv = 0
    if fp8 or not model.recomputes("layernorm"):
        qkv += (2 if fp8 and lora else 1) * x * s * b * h // sigma
    if not lora and (sigma > 1 or fp8):
        qkv += x * s * b * h
    # Recomputed up projections keep their inputs in the run's dtype (and the whole down
    # projection's output, which the shared key part is a view of), not the core's query,
    # key and value.
    up = model.recomputes("mla_up_proj")
    qkv += e * s * b * model.qk_pos_emb_head_dim if up else 0
    qkv += e * s * b * model.kv_lora_rank // sigma if up and model.qk_layernorm else 0
    for rank in [model.kv_lora_rank] + ([model.q_lora_rank] if lora else []):
        qkv += (e if up else x) * s * b * rank
        if model.qk_layernorm:
            qkv += 4 * s * b * rank // sigma * (2 if rms else 1)
            qkv += 4 * (1 if rms else 2) * s * b // sigma
    core = 0 if up else 3 * e * s * b * heads * width // t
    projection = x * s * b * heads * v // t
    if model.recomputes("core_attn"):  # (its checkpoint keeps the inputs)
        parts = {"core_attn": 0, "attn_proj": projection, "attn_output": 0, "rest": core}
        return {"qkv_linear": qkv, **parts}
    core += 4 * b * heads * s // t
    if parallel.context_parallel_size > 1 and parallel.comm_type == "allgather":
        core += 2 * e * (model.seq_length - s) * b * heads * width // t
    if fp8 or width != v:  # the core's output and the projection's own (cut, or FP8) input
        parts = {"core_attn": core + e * s * b * heads * width // t, "attn_proj": projection}
        return {"qkv_linear": qkv, **parts, "attn_output": 0, "rest": 0}
    return {"qkv_linear": qkv, "core_attn": core, "attn_proj": 0, "attn_output": projection}


def _scale_bytes_per_feature(config: Config, s: int, b: int) -> int:
    """The fp32 scales an FP8 input's transposed copy keeps per input feature: one (rowwise),
    one per 128 of the s b tokens (blockwise), none (one per tensor)."""
    recipe = config.fp8.fp8_recipe
    return {"rowwise": 4, "blockwise": 4 * -(-s * b // 128)}.get(recipe, 0)


def _intermediate_bytes(model: ModelConfig, e: int, fp8: bool) -> int:
    """Bytes an MLP keeps per intermediate feature of a token: fc1's output, SiLU's and their
    product (GELU: fc1's output and GELU's), the last one fc2's input: 1 byte in FP8."""
    return e * (3 if model.gated_linear_unit else 1) + (1 if fp8 else e)


def _moe_activation_parts(
    config: Config, s: int, b: int, e: int, fp8: bool
) -> dict[str, int | float]:
    """An MoE MLP: this rank's s b / sigma tokens, each routed to k experts, come back as as
    many expert inputs (taken by the dispatch, kept by fc1: `expert_fc1`; its FP8 copy when
    the experts run in FP8) and outputs; an expert keeps the dense MLP's intermediates for
    each (at its expert-TP share, for the pairs of all its ETP peers): fc1's output and the
    activation's (`moe_act`), fc2's input (`expert_fc2`: offloaded with the others under
    `fused_group_mlp`); the shared expert as the dense MLP of its size. Latent experts
    (--moe-latent-size) move and keep their tokens at the latent width; fc1_latent_proj reads
    the router's input (its FP8 copy in an FP8 layer), fc2_latent_proj keeps the combined
    tokens. Rowwise and blockwise scaling add the fp32 scales of each FP8 GEMM's input."""
    model, parallel = config.model, config.parallel
    t, etp = parallel.tensor_model_parallel_size, parallel.expert_tensor_parallel_size
    h, f, shared = (
        model.hidden_size,
        model.moe_ffn_hidden_size,
        model.moe_shared_expert_intermediate_size,
    )
    sigma = t if parallel.sequence_parallel else 1
    pairs = s * b // sigma * model.moe_router_topk * etp
    width, latent = model.moe_latent_size or h, model.moe_latent_size or 0
    experts = fp8 and experts_in_fp8(config.fp8)
    fc2_input = 1 if experts else e
    activation = _intermediate_bytes(model, e, experts) - fc2_input
    if model.recomputes("moe_act"):  # the activation's output freed (an FP8 fc2 keeps a copy)
        activation, fc2_input = e * (2 if model.gated_linear_unit else 1), 1 if experts else 0
    parts = {
        "expert_fc1": pairs * (1 if experts else e) * width,
        "moe_act": pairs * activation * f // etp,
        "expert_fc2": pairs * fc2_input * f // etp,
    }
    rest = pairs * e * width
    if experts:
        rest += 4 * model.num_experts // parallel.expert_model_parallel_size * (width + f // etp)
    if latent:
        rest += s * b // sigma * (latent * (1 if fp8 else e) + (h if fp8 else 0))
        rest += _scale_bytes_per_feature(config, s, b) * (h + latent) if fp8 else 0
    if shared and not model.recomputes("shared_experts"):
        rest += s * b * shared // t * _intermediate_bytes(model, e, fp8)
        rest += _scale_bytes_per_feature(config, s, b) * (h + shared // t) if fp8 else 0
    return {**parts, "rest": rest}


def micro_batches_in_flight(config: Config, stage: int) -> int:
    """The most micro-batches whose activations stage `stage` holds at once, from the
    schedule's own action order (counted in model chunks' worth, divided by the chunks)."""
    parallel = config.parallel
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    m = config.training.num_micro_batches(parallel.data_parallel_size)
    # --overlap-moe-expert-parallel-comm: a micro-batch's forward runs beside the previous
    # one's backward (one more warm-up forward under interleaving)
    combined = parallel.overlap_moe_expert_parallel_comm
    if pp == 1:
        return 2 if combined and m > 1 else 1
    group = parallel.microbatch_group_size_per_virtual_pipeline_stage
    if vpp:
        order = interleaved_order(m, pp, stage, vpp, group, combined)
    else:
        order = one_f_one_b_order(m, pp, stage)
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
    stage_layers = [layer for offset, layers in chunks for layer in range(offset, offset + layers)]
    total = shared_mask_bytes(config, stage_layers, s, b, e)
    for offset, layers in chunks:
        groups, recomputed = _recomputed_layers(model, layers)
        total += groups * layer_activation_bytes(config, recompute_kept=True)
        linear = model.linear_attention_pattern(model.num_layers)
        kept = range(offset + recomputed, offset + layers)
        for layer in kept:
            total += layer_activation_bytes(
                config, fp8=fp8_layer(config, layer), **_layer_kind(model, layer, linear)
            )
        total -= offloaded_activation_bytes(config, kept, stage)
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


def _recomputed_layers(model: ModelConfig, layers: int) -> tuple[int, int]:
    """Of a stack of `layers` under full recomputation: (the groups whose input is kept, the
    layers recomputed). --recompute-method block recomputes the stack's first layers; the
    rest keep theirs. (0, 0) without full recomputation."""
    if model.recompute_granularity != "full":
        return 0, 0
    every = model.recompute_num_layers
    if model.recompute_method == "uniform":
        return -(-layers // every), layers
    return min(every, layers), min(every, layers)


def _layer_kind(model: ModelConfig, layer: int, linear: list[int]) -> dict:
    """`layer_activation_bytes`'s keywords for the (0-based) layer: its attention's kind, and
    in a hybrid stack its symbol and whether it holds experts."""
    if not model.hybrid:
        return {"linear": bool(linear[layer])}
    return _symbol_kind(model.hybrid_layers_with_mtp()[layer])


def _symbol_kind(symbol: str) -> dict:
    """`layer_activation_bytes`'s keywords for a hybrid stack's layer of `symbol`."""
    if symbol == GDN:  # (an attention-only layer, its attention a gated delta net)
        return {"symbol": ATTENTION, "moe": False, "linear": True}
    return {"symbol": symbol, "moe": symbol == MOE}


# The offloadable modules in the order a layer's forward runs them (config/activation_offload.py).
FORWARD_ORDER = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
EXPERT_ORDER = ("expert_fc1", "moe_act")


def offloaded_activation_bytes(config: Config, layers: Iterable[int], stage: int) -> int:
    """What activation offloading moves to host memory of one micro-batch's activations
    through a model chunk's `layers` (0-based): --cpu-offloading-num-layers N the first N
    layers' whole; --fine-grained-activation-offloading each offloaded module's share of
    `layer_activation_parts` is a group (the experts' looped one per local expert), planned
    as the model plans its groups (`offload_plan`). A group under --min-offloaded-tensor-size
    elements in all stays; multi-token prediction layers are counted as kept."""
    model, parallel = config.model, config.parallel
    pattern = model.moe_layer_pattern(model.num_layers)
    linear = model.linear_attention_pattern(model.num_layers)
    if model.offloads_layers():  # the first N layers whole (no pipeline stages: refused)
        first = [layer for layer in layers if layer < model.cpu_offloading_num_layers]
        return sum(
            layer_activation_bytes(
                config, fp8=fp8_layer(config, i), **_layer_kind(model, i, linear)
            )
            for i in first
        )
    if not model.fine_grained_activation_offloading:
        return 0
    e = 2 if (config.training.bf16 or config.training.fp16) else 4
    looped = not model.moe_grouped_gemm or config.fp8.enabled and experts_in_fp8(config.fp8)
    local_experts = (model.num_experts or 1) // parallel.expert_model_parallel_size
    groups = []  # (the bytes a group saves, those offloading it frees)
    for layer in layers:
        fp8, moe = fp8_layer(config, layer), bool(pattern[layer])
        kind = _layer_kind(model, layer, linear)
        parts = layer_activation_parts(
            config, fp8, moe, kind.get("linear", False), kind.get("symbol")
        )
        output = parts.get("attn_output", 0)  # freed with the projection's (module doc)
        for name in FORWARD_ORDER:
            if model.offloads(name):
                shared = output if name in ("core_attn", "attn_proj") else 0
                own = parts.get(name, 0)
                groups.append((own + shared, own + (shared if name == "attn_proj" else 0)))
        if not moe:
            continue
        if model.offloads("fused_group_mlp"):
            whole = sum(parts[name] for name in (*EXPERT_ORDER, "expert_fc2"))
            groups.append((whole, whole))
            continue
        split = local_experts if looped and local_experts > 1 else 1
        chosen = [parts[name] / split for name in EXPERT_ORDER if model.offloads(name)]
        groups += [(size, size) for size in chosen] * split
    # (a group whose tensors are all under the minimum is, in all, under it)
    sizes = [size if size >= e * model.min_offloaded_tensor_size else 0 for size, _ in groups]
    keep = stage * model.delta_offload_bytes_across_pp_ranks
    planned = offload_plan(sizes, model.activation_offload_fraction, keep)
    return round(sum(groups[i][1] for i in planned))


def _output_activation_bytes(config: Config, s: int, b: int, sigma: int, e: int) -> int:
    """The final norm, the output layer's input and the loss's."""
    model, tp = config.model, config.parallel.tensor_model_parallel_size
    h, rms = model.hidden_size, model.normalization == "RMSNorm"
    total = 4 * s * b * h // sigma * (2 if rms else 1) + 4 * (1 if rms else 2) * s * b // sigma
    total += e * s * b * h
    # The cross-entropy's gradient: in the logits' dtype (chunked, the default) or the
    # reference's fp32 softmax; plus targets and mask.
    logits_bytes = e if config.kernels.cross_entropy_loss_fusion else 4
    if model.final_logit_softcapping:  # (Gemma 2's cap: tanh keeps its output, e a logit)
        logits_bytes += e
    return total + logits_bytes * s * b * model.padded_vocab_size(tp) // tp + 9 * s * b


def _mtp_activation_bytes(config: Config, s: int, b: int, sigma: int, e: int) -> int:
    """Each multi-token prediction depth: its embeddings (enorm's input), both norms'
    statistics, eh_proj's input [2h], its layer (a hybrid model's: its pattern's layers, a
    stack recomputed as the decoder's is), and a final norm, output layer and loss as the
    model's own; the shifted tokens, positions, labels and mask."""
    model = config.model
    depths = model.mtp_num_layers or 0
    if not depths:
        return 0
    h, stats = model.hidden_size, 1 if model.normalization == "RMSNorm" else 2
    last_moe = bool(model.moe_layer_pattern(model.num_layers)[-1])
    layers = layer_activation_bytes(config, fp8=config.fp8.enabled, moe=last_moe)
    if model.hybrid:  # (a depth's pattern of layers)
        symbols = model.hybrid_mtp_layers()
        groups, recomputed = _recomputed_layers(model, len(symbols))
        layers = groups * layer_activation_bytes(config, recompute_kept=True) + sum(
            layer_activation_bytes(config, fp8=config.fp8.enabled, **_symbol_kind(symbol))
            for symbol in symbols[recomputed:]
        )
    per_depth = (
        e * s * b * h // sigma
        + 2 * 4 * stats * s * b // sigma
        + e * s * b * 2 * h // sigma
        + layers
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
    if model.hybrid:  # (its layers' kinds differ: the largest)
        linear = model.linear_attention_pattern(model.num_layers)
        kinds = [_layer_kind(model, layer, linear) for layer in range(model.num_layers)]
        largest = max(layer_activation_bytes(config, fp8=config.fp8.enabled, **k) for k in kinds)
        return group * largest
    return group * layer_activation_bytes(config, fp8=config.fp8.enabled)
