"""The eager reference of every kernel: plain PyTorch, the definition the fused paths match.

Norms and RoPE compute in fp32 whatever the activation dtype (as the fused kernels do) and
return the input dtype. Attention takes Megatron's [sequence, batch, heads, head_dim] layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from threefold.parallel.context_parallel.masks import additive


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    bias = None if bias is None else bias.float()  # (None: --no-layernorm-bias)
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the two blocks of megatron-core's stacked [gate; up] fc1 output."""
    return F.silu(gate) * up


def swiglu_stacked(x: torch.Tensor) -> torch.Tensor:
    """`swiglu` of the two blocks of one stacked [gate; up] fc1 output (an FP8 GEMM's, whose
    backward casts the whole gradient). Compiled, its backward writes both blocks' gradients
    into one tensor, where autograd's backward of `chunk` would concatenate them: a copy of the
    whole gradient, 8 ms of the 1B FP8 step's 321 ms of GPU time on an H100."""
    return swiglu(*x.chunk(2, dim=-1))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (megatron-core's squared_relu): one saved tensor, relu's output."""
    return torch.pow(F.relu(x), 2)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [sequence, batch, heads, head_dim] by the position tables, in fp32.

    The rotate-half form `x * cos + rotate_half(x) * sin`, written on the two halves (whose
    tables are equal): the same floating-point operations on half as many elements, without
    materializing rotate_half(x) (10% faster forward and backward on CPU)."""
    half = x.shape[-1] // 2
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[..., :half], sin[..., :half]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary` on adjacent pairs: elements 2i and 2i + 1 of the head dimension turn by
    frequency i (megatron-core's `rotary_interleaved`). The same products as megatron-core's
    interleaved rotate-half, on the pairs gathered into halves and then put back."""
    halves = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # evens, then odds
    return rotary(halves, cos, sin).unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def split_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query [s, b, heads, d], key and value [s, b, groups, d] of a fused QKV output laid
    out [s, b, groups, heads_per_group + 2, d] (each group's query heads, key, value), the
    query and key rotated (`rotary`) and each its own tensor. Compiled, one kernel each way:
    backward writes the three gradients straight into one tensor in qkv's layout, where
    autograd's backward of the split would concatenate them (a copy of the whole gradient, 6
    ms of the 1B FP8 step's GPU time on an H100) after the rotations' own kernels."""
    s, b, _, _, head_dim = qkv.shape
    query, key, value = qkv.split([heads_per_group, 1, 1], dim=3)
    query = rotary(query.reshape(s, b, -1, head_dim), cos, sin)  # heads of a group adjacent
    key = rotary(key.squeeze(3), cos, sin)
    # a copy, not a view of qkv: compiled, a view's gradient would be added to the rest's
    return query, key, value.squeeze(3).clone(memory_format=torch.contiguous_format)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Causal (or masked) attention of query [s, b, heads, d] over key/value [s, b, groups, d];
    query head i reads group i // (heads / groups). Returns the context [s, b, heads * d]."""
    s, b, heads, _ = query.shape
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # SDPA's own conversion, made once for all layers (context_parallel/masks.py)
        attention_mask = additive(attention_mask, query.dtype)
    # SDPA wants [batch, heads, sequence, head_dim]; its grouped-query convention is ours.
    query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    context = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=attention_mask is None,
        enable_gqa=heads != key.shape[1],
    )
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


def attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """`attention` whose softmax has one more logit per head, `sinks` [heads], beside the
    scaled scores of every query (megatron-core's SoftmaxOne, --softmax-type; GPT-OSS's
    attention sinks): it takes a share of each row's probability and attends to nothing.
    Written out (the scores are materialized), as no SDPA kernel takes such a logit."""
    return attention_written_out(query, key, value, attention_mask, dropout, sinks=sinks)


def attention_written_out(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`attention` with its [s, s] scores materialized in fp32: capped with `softcap`, and a
    last logit per head beside them with `sinks`."""
    s, b, heads, d = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads|groups, s, d]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) / math.sqrt(d)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, heads, 1, 1).expand(b, heads, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, dropout) if dropout > 0 else probs
    context = torch.matmul(probs.to(v.dtype), v)
    return context.permute(2, 0, 1, 3).reshape(s, b, -1)


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |tensor| as an fp32 scalar (exact in any dtype: a maximum does not round). Per row
    first, then over the rows: compiled for shapes that vary (an FP8 layer's inputs and
    gradients), one reduction of a whole tensor to a scalar ran in few thread blocks (98 us
    for 16M elements on an H100, nine times a read of them); a reduction per row spreads over
    the rows (not yet timed there: on CUDA an eager FP8 cast uses kernels/triton_fp8.py, one
    traced into a compiled layer this function)."""
    if tensor.dim() < 2:
        return tensor.detach().abs().amax().float()
    rows = tensor.detach().reshape(-1, tensor.shape[-1])
    return rows.abs().amax(dim=1).amax().float()


def fp8_cast(
    tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, limit: float
) -> torch.Tensor:
    """`tensor` x `scale` cast to FP8, saturating at +-`limit` (the format's max: E5M2 would
    otherwise overflow to inf, as TE's casts saturate)."""
    return (tensor.float() * scale).clamp(-limit, limit).to(dtype)


def fp8_cast_transpose(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D `tensor` cast as `fp8_cast` does, in both layouts the FP8 GEMMs take it (row-major
    and transposed): Transformer Engine's fused cast-transpose, one read of the input when
    compiled. `amax_into` (an fp32 scalar: delayed scaling's amax of the step so far): the
    tensor's amax is max-accumulated into it in place, in the same read."""
    quantized = fp8_cast(tensor, scale, dtype, limit)
    if amax_into is not None:
        torch.maximum(amax_into, amax(tensor), out=amax_into)
    # row-major whatever the input's layout, as the Triton kernel writes it: the compiled
    # layers' opaque casts (kernels/fp8_ops.py) declare these strides to Inductor
    quantized = quantized.contiguous()
    return quantized, quantized.t().contiguous()


def scale_from_amax(
    amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int, previous: torch.Tensor
) -> torch.Tensor:
    """TE's scale: FP8 max / amax / 2^margin, which maps the amax onto the format's largest
    value. A zero or non-finite amax (nothing seen yet, an overflow) keeps the previous scale,
    as does a scale that would not be finite. (`torch.div`: `448.0 / amax` would be
    `amax.reciprocal() * 448`, rounded twice.)"""
    scale = torch.div(fp8_max, amax) / 2**margin
    usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale)
    return torch.where(usable, scale, previous)


def power_of_two_floor(value: torch.Tensor) -> torch.Tensor:
    """The largest power of two at most each positive normal fp32 value: its exponent's bits.
    Exact, where `exp2(floor(log2(v)))` gives 2^k for a `v` just below 2^k (log2 rounds up to
    k there), which saturates the row's largest value; 0 for subnormals."""
    return (value.view(torch.int32) & 0x7F800000).view(torch.float32)


def rowwise_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int) -> torch.Tensor:
    """Per-row scales: FP8 max / amax / 2^margin rounded down to a power of two (as torchao's
    rowwise recipe: exact to undo, and a power-of-two change of a row, as a layout's gradient
    units, changes no FP8 value). A row of zeros, or one whose scale would not be finite,
    gets 1."""
    scale = power_of_two_floor(torch.div(fp8_max, amax) / 2**margin)
    usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale) & (scale > 0)
    return torch.where(usable, scale, torch.ones_like(scale))


def fp8_cast_transpose_current(
    tensor: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    margin: int,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling's cast (tensorwise, and delayed scaling's first step): the scale from
    `amax` (the tensor's, or the maximum over the ranks holding pieces of it), `limit` / amax
    / 2^margin or 1 (`scale_from_amax`), then `fp8_cast_transpose`; returns the two layouts
    and the scale's inverse, which the GEMMs take. With Triton one launch: the scale's
    arithmetic alone was fifteen."""
    scale = scale_from_amax(amax, limit, margin, torch.ones_like(amax))
    quantized, transposed = fp8_cast_transpose(tensor, scale, dtype, limit, amax_into)
    return quantized, transposed, scale.reciprocal()


def fp8_cast_rows(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise scaling's cast of a 2-D `tensor`: each row times `rowwise_scale` of its own
    amax, cast as `fp8_cast` does, row-major whatever the input's layout (a transposed view
    gives the transposed copy); returns the FP8 rows and the scales' inverses ([rows, 1],
    what the GEMM takes: exact, the scales being powers of two)."""
    amax = tensor.detach().abs().amax(dim=1, keepdim=True).float()
    scales = rowwise_scale(amax, limit, margin)
    return fp8_cast(tensor, scales, dtype, limit).contiguous(), scales.reciprocal()


# Blockwise scaling's block (Transformer Engine's Float8BlockScaling, DeepSeek-V3's): 1 x 128
# elements of an activation or gradient, 128 x 128 of a weight.
FP8_BLOCK = 128


def fp8_cast_blocks(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise scaling's cast of a 2-D `tensor`: each block of `block_rows` rows (1 or
    `FP8_BLOCK`) by `FP8_BLOCK` columns times `rowwise_scale` of the block's own amax (the
    blocks at the right and bottom edges cut short), cast as `fp8_cast` does, row-major
    whatever the input's layout (a transposed view gives the transposed copy); returns the FP8
    values and the scales' inverses, one per block ([ceil(rows / block_rows), ceil(cols /
    FP8_BLOCK)]: what the GEMM takes; 1 x 128 blocks' outer-dimension-major, as cuBLASLt takes
    them, so that no GEMM copies them)."""
    rows, cols = tensor.shape
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // FP8_BLOCK)
    padding = (0, col_blocks * FP8_BLOCK - cols, 0, row_blocks * block_rows - rows)
    magnitudes = F.pad(tensor.detach().float().abs(), padding)
    amax = magnitudes.view(row_blocks, block_rows, col_blocks, FP8_BLOCK).amax(dim=(1, 3))
    scales = rowwise_scale(amax, limit, margin)
    expanded = scales[:, None, :, None].expand(-1, block_rows, -1, FP8_BLOCK)
    expanded = expanded.reshape(row_blocks * block_rows, col_blocks * FP8_BLOCK)[:rows, :cols]
    inverses = block_inverses(row_blocks, col_blocks, block_rows, tensor.device)
    inverses.copy_(scales.reciprocal())
    return fp8_cast(tensor, expanded, dtype, limit).contiguous(), inverses


def block_inverses(
    row_blocks: int, col_blocks: int, block_rows: int, device: torch.device
) -> torch.Tensor:
    """The uninitialized [row_blocks, col_blocks] fp32 inverses of `fp8_cast_blocks`, laid out
    as cuBLASLt takes them: 1 x 128 blocks' outer-dimension-major, 128 x 128 blocks' row-major.
    The Triton kernel allocates its output here too, so that the strides the compiled layers'
    opaque cast declares (its fake runs this reference) are the ones it writes, even in a
    dimension of one block."""
    if block_rows == 1:
        return torch.empty(col_blocks, row_blocks, device=device).t()
    return torch.empty(row_blocks, col_blocks, device=device)


def dequantize_blocks(
    values: torch.Tensor, inverses: torch.Tensor, block_rows: int
) -> torch.Tensor:
    """`fp8_cast_blocks` undone in fp32: each block of FP8 `values` times its inverse (exact:
    the scales are powers of two)."""
    rows, cols = values.shape
    expanded = inverses.repeat_interleave(block_rows, 0)[:rows]
    return values.float() * expanded.repeat_interleave(FP8_BLOCK, 1)[:, :cols]
