"""Transformer Engine's fused cast-transpose as one Triton kernel: a 2-D tensor times a scale,
saturated and cast to FP8, written row-major and transposed, and (delayed scaling) the tensor's
amax max-accumulated into the step's, in one read of the input and one launch.

`reference.fp8_cast_transpose` under torch.compile gave three to four kernels per cast (an amax
reduction, the cast, the transpose), each a launch from Python, and an FP8 layer casts twice
per micro-batch (its input and its output gradient): on an H100 the 1B model's FP8 step was
bound by the host's launches, not the GPU. Used on CUDA where Triton imports
(kernels/dispatch.py); the same bytes as the reference (tests/kernels/test_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # a 64 x 64 tile: the transposed store goes through shared memory, coalesced


@triton.jit
def _cast_transpose(
    x_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    amax_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    limit,
    BLOCK: tl.constexpr,
    CAST: tl.constexpr,
    AMAX: tl.constexpr,
):
    # 64-bit offsets: a gradient of 16 x 8192 tokens by 28672 features has 2^31.8 elements
    r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_row + c[None, :] * stride_col, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if CAST:
        y = tl.minimum(tl.maximum(x * tl.load(scale_ptr), -limit), limit)
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
        tl.store(out_t_ptr + c[:, None] * rows + r[None, :], tl.trans(y), mask=tl.trans(mask))
    if AMAX:
        magnitude = tl.abs(x)
        # a NaN counts as inf: either makes the amax non-finite, which keeps the previous scale
        magnitude = tl.where(magnitude == magnitude, magnitude, float("inf"))
        tl.atomic_max(amax_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))


def fp8_cast_transpose(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_transpose` in one kernel: (tensor x scale in FP8 [rows, cols], its
    transpose [cols, rows]); each tile's amax max-accumulated straight into `amax_into` (no
    buffer to zero, no maximum after: two launches fewer per cast), or not computed."""
    rows, cols = tensor.shape
    quantized = torch.empty(rows, cols, dtype=dtype, device=tensor.device)
    transposed = torch.empty(cols, rows, dtype=dtype, device=tensor.device)
    _launch(tensor, (quantized, transposed, scale.float()), limit, amax_into)
    return quantized, transposed


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """`reference.amax` of a tensor of at least one dimension (as 2-D: its last and the rest),
    in one kernel."""
    result = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    _launch(tensor.reshape(-1, tensor.shape[-1]), None, 0.0, result)
    return result.view(())


def _launch(
    tensor: torch.Tensor,
    cast: tuple[torch.Tensor, ...] | None,
    limit: float,
    amax_into: torch.Tensor | None,
) -> None:
    """One launch over `tensor`'s 64 x 64 tiles: with `cast` (the FP8 output, its transpose,
    the scale) the casts, with `amax_into` the amax (where either is missing, the input
    stands in for its pointers, which the kernel then never reads)."""
    if not tensor.numel():
        return
    rows, cols = tensor.shape
    grid = (triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK))
    _cast_transpose[grid](
        tensor,
        *(cast or (tensor, tensor, tensor)),
        tensor if amax_into is None else amax_into,
        rows,
        cols,
        tensor.stride(0),
        tensor.stride(1),
        limit,
        BLOCK=BLOCK,
        CAST=cast is not None,
        AMAX=amax_into is not None,
    )
