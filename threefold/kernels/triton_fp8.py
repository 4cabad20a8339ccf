"""FP8 casts as Triton kernels, one launch each: Transformer Engine's fused cast-transpose (a
2-D tensor times a scale, saturated and cast to FP8, written row-major and transposed, and for
delayed scaling the tensor's amax max-accumulated into the step's, in one read of the input),
the same with the scale derived from an amax in the kernel (current scaling), and rowwise
scaling's cast (each row's amax, power-of-two scale and cast), and blockwise scaling's (the same
per 1 x 128 or 128 x 128 block).

The reference functions (kernels/reference.py) under torch.compile gave three to four kernels
per cast (an amax reduction, the cast, the transpose) and eager scale arithmetic some fifteen
more, each a launch from Python, and an FP8 layer casts at least twice per micro-batch (its
input and its output gradient): on an H100 the 1B model's FP8 step was bound by the host's
launches, not the GPU. Used on CUDA where Triton imports (kernels/dispatch.py); the same bytes
as the reference (tests/kernels/test_fp8_casts.py). Scales and their inverses are divided with
`div_rn`, correctly rounded as PyTorch's divisions are (Triton's `/` is approximate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from threefold.kernels.reference import FP8_BLOCK, block_inverses

BLOCK = 64  # a 64 x 64 tile: the transposed store goes through shared memory, coalesced
# Rowwise: a program owns 16 rows and walks their columns twice (amax, then cast), 128 at a
# time; a transposed view's 16 rows are then 32 contiguous bytes of bf16 per column.
BLOCK_ROWS, BLOCK_COLS = 16, 128


@triton.jit
def _current_scale(amax, limit, unmargin):
    """`reference.scale_from_amax` with 1 as the previous scale: limit / amax / 2^margin where
    the amax is finite and positive and the scale finite (`unmargin`: 2^-margin)."""
    scale = tl.math.div_rn(limit, amax) * unmargin
    usable = (amax > 0) & (amax < float("inf")) & (scale < float("inf"))
    return tl.where(usable, scale, 1.0)


@triton.jit
def _power_of_two_scale(amax, limit, unmargin):
    """`reference.rowwise_scale`: limit / amax / 2^margin rounded down to a power of two by
    the exponent's bits, or 1 where the amax is not finite and positive."""
    exact = tl.math.div_rn(limit, amax) * unmargin
    scale = (exact.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    usable = (amax > 0) & (amax < float("inf")) & (scale > 0) & (scale < float("inf"))
    return tl.where(usable, scale, 1.0)


@triton.jit
def _magnitude(x):
    # a NaN counts as inf: either makes the amax non-finite, which keeps the previous scale
    magnitude = tl.abs(x)
    return tl.where(magnitude == magnitude, magnitude, float("inf"))


@triton.jit
def _load_tile(x_ptr, r, c, rows, cols, stride_row, stride_col):
    """The tile of rows `r` by columns `c` (64-bit offsets: a gradient of 16 x 8192 tokens
    by 28672 features has 2^31.8 elements) in fp32, 0 outside the tensor, and its mask."""
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_row + c[None, :] * stride_col, mask=mask, other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _cast_transpose(
    x_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    amax_ptr,
    inverse_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    limit,
    unmargin,
    BLOCK: tl.constexpr,
    CAST: tl.constexpr,
    AMAX: tl.constexpr,
    CURRENT: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    x, mask = _load_tile(x_ptr, r, c, rows, cols, stride_row, stride_col)
    if CAST:
        if CURRENT:  # `scale_ptr` holds the amax the scale follows from
            scale = _current_scale(tl.load(scale_ptr), limit, unmargin)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(inverse_ptr, tl.math.div_rn(1.0, scale))
        else:
            scale = tl.load(scale_ptr)
        y = tl.minimum(tl.maximum(x * scale, -limit), limit)
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
        tl.store(out_t_ptr + c[:, None] * rows + r[None, :], tl.trans(y), mask=tl.trans(mask))
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(_magnitude(x), axis=1), axis=0))


@triton.jit
def _cast_rows(
    x_ptr,
    out_ptr,
    inverse_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    limit,
    unmargin,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    amax = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in tl.range(0, cols, BLOCK_COLS):
        c = start + tl.arange(0, BLOCK_COLS).to(tl.int64)
        x, _ = _load_tile(x_ptr, r, c, rows, cols, stride_row, stride_col)
        amax = tl.maximum(amax, tl.max(_magnitude(x), axis=1))
    scale = _power_of_two_scale(amax, limit, unmargin)
    tl.store(inverse_ptr + r, tl.math.div_rn(1.0, scale), mask=r < rows)
    for start in tl.range(0, cols, BLOCK_COLS):
        c = start + tl.arange(0, BLOCK_COLS).to(tl.int64)
        x, mask = _load_tile(x_ptr, r, c, rows, cols, stride_row, stride_col)
        y = tl.minimum(tl.maximum(x * scale[:, None], -limit), limit)
        tl.store(
            out_ptr + r[:, None] * cols + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )


@triton.jit
def _cast_blocks(
    x_ptr,
    out_ptr,
    inverse_ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    inverse_stride_row,
    inverse_stride_col,
    limit,
    unmargin,
    TILE_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SQUARE: tl.constexpr,
):
    # A tile of TILE_ROWS rows by one block of BLOCK columns: 1 x BLOCK blocks, a scale per
    # row of the tile; or (SQUARE) one BLOCK x BLOCK block, one scale.
    r = (tl.program_id(0) * TILE_ROWS + tl.arange(0, TILE_ROWS)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    x, mask = _load_tile(x_ptr, r, c, rows, cols, stride_row, stride_col)
    if SQUARE:
        scale = _power_of_two_scale(tl.max(tl.max(_magnitude(x), axis=1), axis=0), limit, unmargin)
        inverse = tl.math.div_rn(1.0, scale)
        block = tl.program_id(0) * inverse_stride_row + tl.program_id(1) * inverse_stride_col
        tl.store(inverse_ptr + block, inverse)
        y = x * scale
    else:
        scale = _power_of_two_scale(tl.max(_magnitude(x), axis=1), limit, unmargin)
        inverses = inverse_ptr + r * inverse_stride_row + tl.program_id(1) * inverse_stride_col
        tl.store(inverses, tl.math.div_rn(1.0, scale), mask=r < rows)
        y = x * scale[:, None]
    y = tl.minimum(tl.maximum(y, -limit), limit)
    tl.store(out_ptr + r[:, None] * cols + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


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
    layouts = _layouts(tensor, dtype)
    _launch(tensor, limit, layouts, scale.float(), amax_into)
    return layouts


def fp8_cast_transpose_current(
    tensor: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    margin: int,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_transpose_current` in one kernel: every tile derives the scale from
    `amax` itself, and the first writes its inverse."""
    quantized, transposed = _layouts(tensor, dtype)
    if not tensor.numel():  # nothing launched: the scale of no amax is 1
        return quantized, transposed, torch.ones((), device=tensor.device)
    inverse = torch.empty((), device=tensor.device)
    layouts = (quantized, transposed)
    _launch(tensor, limit, layouts, amax.float(), amax_into, inverse, unmargin=2.0**-margin)
    return quantized, transposed, inverse


def fp8_cast_rows(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_rows` in one kernel: the FP8 rows (row-major, whatever the input's
    layout) and the scales' inverses [rows, 1]."""
    rows, cols = tensor.shape
    quantized = torch.empty(rows, cols, dtype=dtype, device=tensor.device)
    if not cols:  # nothing launched: rows of no values are scaled by 1
        return quantized, torch.ones(rows, 1, device=tensor.device)
    inverses = torch.empty(rows, 1, device=tensor.device)
    if rows:
        _cast_rows[(triton.cdiv(rows, BLOCK_ROWS),)](
            tensor,
            quantized,
            inverses,
            rows,
            cols,
            tensor.stride(0),
            tensor.stride(1),
            limit,
            2.0**-margin,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=BLOCK_COLS,
        )
    return quantized, inverses


def fp8_cast_blocks(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_blocks` in one kernel: the FP8 values (row-major, whatever the
    input's layout) and the inverses per block (`block_rows`: 1 or `FP8_BLOCK`), laid out as
    the reference's."""
    rows, cols = tensor.shape
    row_blocks, col_blocks = triton.cdiv(rows, block_rows), triton.cdiv(cols, FP8_BLOCK)
    quantized = torch.empty(rows, cols, dtype=dtype, device=tensor.device)
    inverses = block_inverses(row_blocks, col_blocks, block_rows, tensor.device)
    if not tensor.numel():
        return quantized, inverses.fill_(1.0)
    square = block_rows == FP8_BLOCK
    tile_rows = FP8_BLOCK if square else BLOCK_ROWS
    _cast_blocks[(triton.cdiv(rows, tile_rows), col_blocks)](
        tensor,
        quantized,
        inverses,
        rows,
        cols,
        tensor.stride(0),
        tensor.stride(1),
        inverses.stride(0),
        inverses.stride(1),
        limit,
        2.0**-margin,
        TILE_ROWS=tile_rows,
        BLOCK=FP8_BLOCK,
        SQUARE=square,
        num_warps=8 if square else 4,
    )
    return quantized, inverses


def amax(tensor: torch.Tensor) -> torch.Tensor:
    """`reference.amax` of a tensor of at least one dimension (as 2-D: its last and the rest),
    in one kernel."""
    result = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    _launch(tensor.reshape(-1, tensor.shape[-1]), amax_into=result)
    return result.view(())


def _layouts(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = tensor.shape
    quantized = torch.empty(rows, cols, dtype=dtype, device=tensor.device)
    return quantized, torch.empty(cols, rows, dtype=dtype, device=tensor.device)


def _launch(
    tensor: torch.Tensor,
    limit: float = 0.0,
    layouts: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: torch.Tensor | None = None,
    amax_into: torch.Tensor | None = None,
    inverse: torch.Tensor | None = None,
    unmargin: float = 1.0,
) -> None:
    """One launch over `tensor`'s 64 x 64 tiles: with `layouts` (the FP8 output and its
    transpose) the cast by `scale`, or with `inverse` by the scale of the amax `scale` holds
    (written to `inverse`; `unmargin`: 2^-margin); with `amax_into` the amax (the input stands
    in for the pointers of what is missing, which the kernel then never reads)."""
    if not tensor.numel():
        return
    rows, cols = tensor.shape
    grid = (triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK))
    out, out_t = layouts or (tensor, tensor)
    _cast_transpose[grid](
        tensor,
        out,
        out_t,
        tensor if scale is None else scale,
        tensor if amax_into is None else amax_into,
        tensor if inverse is None else inverse,
        rows,
        cols,
        tensor.stride(0),
        tensor.stride(1),
        limit,
        unmargin,
        BLOCK=BLOCK,
        CAST=layouts is not None,
        AMAX=amax_into is not None,
        CURRENT=inverse is not None,
    )
