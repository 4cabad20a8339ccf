"""Predicted time of one training step for a model and layout on a cluster, without running it
(tools/plan_layout.py ranks layouts with it; docs/plan_layout.md gives its error).

Per micro-batch and transformer layer, on one GPU:
- matrix multiplications: their FLOPs (threefold/training/flops.py's count, divided over TP
  and CP; x3 for forward + backward, +1 forward of the recomputed layers under full
  recomputation) at `gemm_efficiency` of the bf16 peak, lower when a GEMM's local dimension is
  small: efficiency x d / (d + 128) relative to the calibration shape, d = min(h / TP, tokens);
- attention (scores and weighted sum, counted as Megatron counts them) at
  `attention_efficiency` (+1 forward under selective or full recomputation);
- everything memory-bound (norms, RoPE, SwiGLU, residuals, dropout, cross-entropy, casts):
  `memory_bytes_per_element` bytes per token and hidden element per layer through HBM;
- tensor parallelism: with sequence parallelism, 4 all-gathers/reduce-scatters of the layer's
  activation forward and 4 backward (4 more when recomputing), ring cost (t-1)/t x bytes /
  bus bandwidth, not overlapped (threefold has no TP communication overlap);
- context parallelism: the ring's K/V (forward) and dK/dV (backward) exchange, hidden behind
  the attention it overlaps with when shorter;
- expert parallelism (MoE layers): the token dispatcher's all-to-alls, dispatch and combine,
  forward and backward, each moving the rank's (token, expert) pairs of h elements, the share
  (EP-1)/EP leaving the rank, not overlapped; routing is taken as balanced, so the experts'
  FLOPs are the active parameters' (flops.py) spread evenly.
A pipeline step takes (m + (P-1)/V) x the slowest stage's micro-batch time (m micro-batches,
V virtual stages), plus the stage-to-stage sends. Data parallelism: the distributed
optimizer's gradient reduce-scatter and parameter all-gather, hidden behind the last
micro-batch's backward and the first one's forward with --overlap-grad-reduce /
--overlap-param-gather (else exposed); FSDP gathers parameters twice and scatters gradients
once per micro-batch, hidden behind that micro-batch's compute where shorter. The optimizer
step streams its state through HBM.

Collectives use the intra-node bandwidth when the group fits in one node and the inter-node one
otherwise (megatron-core orders ranks TP, CP, DP, PP: TP fastest). The calibrated constants
(H100) come from bench/results/gpu_mfu/profile.txt, the profile of the 1B benchmark step
(bench/plan_calibration.py derives them); the bandwidths are nominal link rates at the bus
efficiency NCCL typically reaches, to be overridden with measured ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from threefold.config import Config
from threefold.training.flops import attention_flops_per_token, training_flops_per_iteration
from threefold.training.memory_estimate import stage_parameters

# GEMM efficiency falls as a local matrix dimension shrinks toward the kernels' tile size.
_TILE = 128


@dataclass(frozen=True)
class Hardware:
    """One GPU type and its links. Efficiencies are fractions of `peak_tflops` (dense bf16)."""

    name: str
    peak_tflops: float
    hbm_gbps: float  # HBM bandwidth, GB/s
    gemm_efficiency: float
    attention_efficiency: float
    memory_bytes_per_element: float  # HBM bytes per token x hidden element x layer, fwd+bwd
    calibration_dim: int  # the local GEMM dimension the efficiencies were measured at
    intra_node_gbps: float  # NCCL bus bandwidth inside a node (NVLink), GB/s
    inter_node_gbps: float  # per GPU across nodes (InfiniBand / RoCE), GB/s
    latency_us: float = 10.0  # per collective or send


# Calibrated on one H100 SXM (bench/plan_calibration.py, from the 1B benchmark's profile):
# NVLink 4 (450 GB/s per direction) and 400 Gb/s per GPU across nodes, at 80% and 90%.
H100 = Hardware(
    name="H100",
    peak_tflops=989.0,
    hbm_gbps=3350.0,
    gemm_efficiency=0.837,
    attention_efficiency=0.646,
    memory_bytes_per_element=270.0,
    calibration_dim=2048,
    intra_node_gbps=360.0,
    inter_node_gbps=45.0,
)
# H200: H100's compute and links with faster HBM; A100: the same efficiencies assumed (not
# measured here), NVLink 3 (300 GB/s per direction) and 200 Gb/s per GPU.
HARDWARE = {
    "H100": H100,
    "H200": dataclasses.replace(H100, name="H200", hbm_gbps=4800.0),
    "A100": dataclasses.replace(
        H100,
        name="A100",
        peak_tflops=312.0,
        hbm_gbps=2039.0,
        intra_node_gbps=240.0,
        inter_node_gbps=22.5,
    ),
}


@dataclass
class StepTime:
    """Seconds of one step, by where they go (the parts the step is the sum of)."""

    compute: float = 0.0  # the pipeline's compute, bubble included
    bubble: float = 0.0  # of which the pipeline's fill and drain
    tensor_parallel: float = 0.0
    context_parallel: float = 0.0
    expert_parallel: float = 0.0
    pipeline_sends: float = 0.0
    data_parallel: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tensor_parallel
            + self.context_parallel
            + self.expert_parallel
            + self.pipeline_sends
            + self.data_parallel
            + self.optimizer
        )


def _ring(bytes_: float, ranks: int, gbps: float, hardware: Hardware) -> float:
    """An all-gather or reduce-scatter of `bytes_` (the whole tensor) over a ring."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * bytes_ / (gbps * 1e9) + hardware.latency_us * 1e-6


def _bandwidth(span: int, gpus_per_node: int, hardware: Hardware) -> float:
    """A group whose ranks lie `span` consecutive ranks apart fits a node or crosses nodes."""
    return hardware.intra_node_gbps if span <= gpus_per_node else hardware.inter_node_gbps


def _gemm_efficiency(hardware: Hardware, dim: float) -> float:
    def scale(d: float) -> float:
        return d / (d + _TILE)

    return hardware.gemm_efficiency * scale(dim) / scale(hardware.calibration_dim)


def predict_step_time(config: Config, hardware: Hardware, gpus_per_node: int) -> StepTime:
    """The predicted step time of `config`'s model, layout and batch (see the module doc)."""
    model, parallel, training = config.model, config.parallel, config.training
    t = parallel.tensor_model_parallel_size
    p = parallel.pipeline_model_parallel_size
    c = parallel.context_parallel_size
    d = parallel.data_parallel_size
    v = parallel.virtual_pipeline_model_parallel_size or 1
    b, s, h = training.micro_batch_size, model.seq_length, model.hidden_size
    m = training.global_batch_size // (b * d)
    element = 2 if (training.bf16 or training.fp16) else 4
    tokens = b * s / c  # this GPU's tokens per micro-batch
    vocab = model.padded_vocab_size(t)
    peak = hardware.peak_tflops * 1e12

    # One token's forward FLOPs per layer (Megatron's count; an MoE model's active ones).
    output_layer = 2 * h * vocab
    per_token = training_flops_per_iteration(model, 1, vocab) / 3 / s
    per_layer = (per_token - output_layer) / model.num_layers
    attention = attention_flops_per_token(model)
    gemm = per_layer - attention
    recompute = model.recompute_granularity
    gemm_passes = 3 + (1 if recompute == "full" else 0)
    # (of --recompute-modules the core attention only: the planner proposes no other)
    attention_passes = 3 + (1 if recompute == "full" or model.recomputes("core_attn") else 0)
    efficiency = _gemm_efficiency(hardware, min(h / t, b * s))
    layer = (
        gemm * gemm_passes * tokens / t / (peak * efficiency)
        + attention * attention_passes * tokens / t / (peak * hardware.attention_efficiency)
        + hardware.memory_bytes_per_element
        * tokens
        * h
        / t
        / (hardware.hbm_gbps * 1e9)
        * (4 / 3 if recompute == "full" else 1)
    )
    tp_span, cp_span = t, t * c
    activation = tokens * h * element
    tp_layer = (8 + (4 if recompute == "full" else 0)) * _ring(
        activation, t, _bandwidth(tp_span, gpus_per_node, hardware), hardware
    )
    if model.multi_latent_attention:  # a key and value per head, at the padded head size
        kv_heads, kv_dim = model.num_attention_heads, max(model.q_head_dim, model.v_head_dim)
    else:
        kv_heads, kv_dim = model.num_query_groups, model.kv_channels
    kv = tokens * 2 * kv_heads * kv_dim / t * element
    cp_layer = 0.0
    if c > 1:
        exchange = 3 * (c - 1) * (kv / (_bandwidth(cp_span, gpus_per_node, hardware) * 1e9))
        attention_time = attention * 3 * tokens / t / (peak * hardware.attention_efficiency)
        cp_layer = max(0.0, exchange - attention_time)

    ep = parallel.expert_model_parallel_size
    ep_layer = 0.0
    if ep > 1:
        # every (token, expert) pair reaches each expert-TP rank of its expert: with expert
        # TP = TP and sequence parallelism, a rank sends tokens x top-k x h elements per pass
        pairs = tokens * model.moe_router_topk * h * element
        etp = parallel.expert_tensor_parallel_size
        gbps = _bandwidth(etp * ep, gpus_per_node, hardware)
        moe_share = sum(model.moe_layer_pattern(model.num_layers)) / model.num_layers
        ep_layer = (
            moe_share * 4 * ((ep - 1) / ep * pairs / (gbps * 1e9) + hardware.latency_us * 1e-6)
        )

    layers_per_stage = model.num_layers / p
    output = output_layer * 3 * tokens / t / (peak * _gemm_efficiency(hardware, min(h, b * s)))
    stage = layers_per_stage * layer + output  # the last stage: the slowest
    slots = m + (p - 1) / v  # micro-batch slots of the slowest stage, fill and drain included
    result = StepTime()
    result.compute = slots * stage
    result.bubble = (p - 1) / v * stage
    result.tensor_parallel = slots * layers_per_stage * tp_layer
    result.context_parallel = slots * layers_per_stage * cp_layer
    result.expert_parallel = slots * layers_per_stage * ep_layer
    if p > 1:
        send = activation / (t if parallel.sequence_parallel else 1)
        pp_gbps = _bandwidth(t * c * d * 2, gpus_per_node, hardware)
        result.pipeline_sends = 2 * v * m * (send / (pp_gbps * 1e9) + hardware.latency_us * 1e-6)

    params = max(stage_parameters(model, parallel, vocab, r) for r in (0, p - 1))
    dp_ranks = d * c
    dp_gbps = _bandwidth(t * c * d, gpus_per_node, hardware)
    grad_bytes = 2 if parallel.grad_reduce_in_bf16 else 4
    forward_window = stage / 3  # one micro-batch's forward on the slowest stage
    if parallel.distributed_strategy == "fsdp":
        per_micro_batch = 2 * _ring(params * element, dp_ranks, dp_gbps, hardware) + _ring(
            params * grad_bytes, dp_ranks, dp_gbps, hardware
        )
        result.data_parallel = m * max(0.0, per_micro_batch - stage)
        state = params / dp_ranks
    else:
        reduce = _ring(params * grad_bytes, dp_ranks, dp_gbps, hardware)
        gather = _ring(params * element, dp_ranks, dp_gbps, hardware)
        if not parallel.use_distributed_optimizer:
            reduce, gather = 2 * reduce, 0.0  # an all-reduce, nothing to gather
        if parallel.overlap_grad_reduce:
            reduce = max(0.0, reduce - 2 * forward_window)
        if parallel.overlap_param_gather:
            gather = max(0.0, gather - forward_window)
        result.data_parallel = reduce + gather
        state = params / dp_ranks if parallel.use_distributed_optimizer else params
    # Adam: read and write master weights and both moments, read the gradient, write the
    # half-precision copy; the norm for clipping reads every local gradient once more.
    result.optimizer = (state * 34 + params * grad_bytes) / (hardware.hbm_gbps * 1e9)
    return result


def tokens_per_second(config: Config, step: StepTime) -> float:
    return config.training.global_batch_size * config.model.seq_length / step.total
