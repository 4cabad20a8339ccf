"""The FP8 casts as custom operators: opaque to torch.compile.

An FP8 linear traced into a compiled layer (--compile-layers) casts through one of two
namespaces with the signatures of kernels/reference.py's casts (`Fp8Linear`'s `_kernels`):

- the reference itself, which Inductor fuses with the ops around it (the norm's output cast as
  it is written). On an H100 one such fused kernel, an RMSNorm with the cast, its transpose
  and the amax, took 396 us per call where the hand-written Triton cast-transpose takes 45
  (bench/results/gpu_mfu_fp8_2026-11-26/). Our reading, not yet checked against the code
  Inductor wrote: a reduction kernel walks rows, so its transposed FP8 store is not tiled;
- this module, where each cast is one operator that Inductor calls and does not look into.
  It runs the run's eager cast (`KERNELS`: the Triton kernels on CUDA), so the graph's casts
  are the eager path's, launch for launch. The graph stays whole: no break per cast.

Which one a run uses is `KERNELS.opaque_fp8_casts` (kernels/dispatch.py: where the Triton
casts are chosen). The operators' fake versions run the reference on fake tensors, which gives
the shapes and strides the real kernels write (tests/kernels/test_fp8_casts.py compares them).
"""

from __future__ import annotations

import torch

from threefold.kernels import reference
from threefold.kernels.dispatch import KERNELS


@torch.library.custom_op("threefold::fp8_amax", mutates_args=())
def amax(tensor: torch.Tensor) -> torch.Tensor:
    """`reference.amax`, as the run computes it."""
    return KERNELS.amax(tensor)


# The casts that may max-accumulate an amax are two operators each, one mutating it and one
# not: torch 2.11 fails to trace an optional mutated argument given as None (tensorwise
# scaling records no amax; evaluation none either), which the GPUs' torch is.
@torch.library.custom_op("threefold::fp8_cast_transpose", mutates_args=())
def _cast_transpose(
    tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return KERNELS.fp8_cast_transpose(tensor, scale, dtype, limit, None)


@torch.library.custom_op("threefold::fp8_cast_transpose_recording", mutates_args=("amax_into",))
def _cast_transpose_recording(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    amax_into: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return KERNELS.fp8_cast_transpose(tensor, scale, dtype, limit, amax_into)


def fp8_cast_transpose(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_transpose`, as the run casts: `amax_into` max-accumulated in place."""
    if amax_into is None:
        return _cast_transpose(tensor, scale, dtype, limit)
    return _cast_transpose_recording(tensor, scale, dtype, limit, amax_into)


@torch.library.custom_op("threefold::fp8_cast_transpose_current", mutates_args=())
def _cast_transpose_current(
    tensor: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, limit: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return KERNELS.fp8_cast_transpose_current(tensor, amax, dtype, limit, margin, None)


@torch.library.custom_op(
    "threefold::fp8_cast_transpose_current_recording", mutates_args=("amax_into",)
)
def _cast_transpose_current_recording(
    tensor: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    margin: int,
    amax_into: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return KERNELS.fp8_cast_transpose_current(tensor, amax, dtype, limit, margin, amax_into)


def fp8_cast_transpose_current(
    tensor: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    limit: float,
    margin: int,
    amax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_transpose_current`, as the run casts."""
    if amax_into is None:
        return _cast_transpose_current(tensor, amax, dtype, limit, margin)
    return _cast_transpose_current_recording(tensor, amax, dtype, limit, margin, amax_into)


@torch.library.custom_op("threefold::fp8_cast_rows", mutates_args=())
def fp8_cast_rows(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_rows`, as the run casts."""
    return KERNELS.fp8_cast_rows(tensor, dtype, limit, margin)


@torch.library.custom_op("threefold::fp8_cast_blocks", mutates_args=())
def fp8_cast_blocks(
    tensor: torch.Tensor, dtype: torch.dtype, limit: float, margin: int, block_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fp8_cast_blocks`, as the run casts."""
    return KERNELS.fp8_cast_blocks(tensor, dtype, limit, margin, block_rows)


# Fake versions: the reference's outputs on fake tensors, without its in-place amax (a fake
# tensor's value is not there to update).
amax.register_fake(reference.amax)
fp8_cast_rows.register_fake(reference.fp8_cast_rows)
fp8_cast_blocks.register_fake(reference.fp8_cast_blocks)


@_cast_transpose.register_fake
def _(tensor, scale, dtype, limit):
    return reference.fp8_cast_transpose(tensor, scale, dtype, limit)


@_cast_transpose_recording.register_fake
def _(tensor, scale, dtype, limit, amax_into):
    return reference.fp8_cast_transpose(tensor, scale, dtype, limit)


@_cast_transpose_current.register_fake
def _(tensor, amax, dtype, limit, margin):
    return reference.fp8_cast_transpose_current(tensor, amax, dtype, limit, margin)


@_cast_transpose_current_recording.register_fake
def _(tensor, amax, dtype, limit, margin, amax_into):
    return reference.fp8_cast_transpose_current(tensor, amax, dtype, limit, margin)
