"""What a hybrid model's Mamba layer keeps for backward per micro-batch (model/mamba.py,
kernels/ssd.py): its norm and in_proj's input, as an attention layer keeps them
(training/activation_estimate.py), and the mixer's tensors, counted from what autograd saves
(tests/training/test_memory_estimate.py measures them).

Over the whole sequence (under CP each rank scans all of it for 1/CP of its heads) with this
rank's heads and groups, c = inner + 2 G N convolved channels:
- the projection's output, which z's SiLU keeps (a view of it in fp32; in bf16 an fp32 copy
  of z), the convolution's input, SiLU's input (the causal padding's K - 1 more columns) and
  output, and the step sizes before and after softplus;
- nothing of the scan's own (model/mamba.py recomputes it in backward from x, B, C and the
  step sizes: its per-chunk fp32 blocks were 5.9 GB a layer at Nemotron-H 8B's shape);
- the gated norm's fp32 input y, SiLU(z), their product, the normalized copy and the
  statistics per group, and out_proj's input.
"""

from __future__ import annotations

from threefold.config import Config
from threefold.config.hybrid import MAMBA_CONV_KERNEL


def mamba_layer_bytes(config: Config, s: int, b: int, e: int, sigma: int, fp8: bool) -> int:
    """A Mamba layer's bytes: its norm (as an attention layer's, never recomputed here), the
    input in_proj keeps (gathered over the sequence under SP; an FP8 copy in FP8), the mixer's
    and its residual dropout's mask."""
    model = config.model
    h, stats = model.hidden_size, 1 if model.normalization == "RMSNorm" else 2
    norm = 4 * s * b * h // sigma * (2 if stats == 1 else 1) + 4 * stats * s * b // sigma
    total = norm + (1 if fp8 else e) * s * b * h + mamba_mixer_bytes(config, b, e, fp8)
    return total + (e * s * b * h // sigma if model.hidden_dropout > 0 else 0)


def mamba_mixer_bytes(config: Config, b: int, e: int, fp8: bool = False) -> int:
    """Bytes a Mamba mixer keeps between in_proj's output and out_proj's input, for a
    micro-batch of `b` sequences in activations of `e` bytes."""
    model, parallel = config.model, config.parallel
    split = parallel.tensor_model_parallel_size * parallel.context_parallel_size
    seq = model.seq_length
    heads, groups = model.mamba_heads() // split, model.mamba_num_groups // split
    inner = heads * model.mamba_head_dim
    channels = inner + 2 * groups * model.mamba_state_dim
    projected = 2 * inner + 2 * groups * model.mamba_state_dim + heads
    # the convolution's input, SiLU's (the causal padding's K - 1 more columns) and its output,
    # which the recomputed scan keeps as its x, B and C
    total = e * b * channels * (3 * seq + MAMBA_CONV_KERNEL - 1)
    total += 2 * 4 * b * seq * heads  # the step sizes: softplus's input and output
    # z's SiLU keeps z: in fp32 a view of the whole projection, in bf16 an fp32 copy
    total += 4 * b * seq * (projected if e == 4 else inner)
    # the gated norm: y in fp32, SiLU(z), their product, the normalized copy, statistics
    total += 4 * b * (4 * seq * inner + seq * groups)
    total += (1 if fp8 else e) * b * seq * inner  # out_proj's input (an FP8 copy in FP8)
    return total
