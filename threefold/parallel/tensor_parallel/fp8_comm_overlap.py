"""--tp-comm-overlap for FP8 layers (tensorwise and delayed scaling): comm_overlap.py's rings,
with FP8 bytes on the wire wherever the plain FP8 layer's collective already carries them or
could, and one `scaled_mm` per slice.

    column-parallel  fwd: x cast on each rank, its FP8 slices around the ring, each arriving
                          slice's GEMM while the next travels (the bytes of the plain layer's
                          FP8 all-gather, `Fp8Linear.gathers_in_fp8`)
                     bwd: g cast whole; each destination's partial dgrad GEMM added to the
                          running sum (run's dtype) that travels on
    row-parallel     fwd: x cast whole; the same ring of partial sums over the sequence
                     bwd: g cast on each rank, its FP8 slices around the ring, each slice's
                          dgrad GEMM while the next travels. The plain layer gathers g in the
                          run's dtype and casts after: the same bytes, since a slice is cast
                          with the scale of the whole gathered tensor (tensorwise: the amax
                          reduced over TP x CP, which is the gathered tensor's; delayed: the
                          history's), for half bf16's traffic.

Every FP8 operand is bitwise the plain layer's, and the weight gradient is the same one GEMM
over the whole gathered sequence; only the slices' GEMMs and the reduce-scatter's additions
run in another order. Rowwise and blockwise scaling, and --no-fp8-wgrad, need the gathered
input before any cast (kernels/fp8.py: `gathers_in_fp8`) and stay unoverlapped.
"""

from __future__ import annotations

import torch

from threefold.kernels.fp8 import (
    GRAD,
    INPUT,
    Fp8Linear,
    layer_weight_grad,
    output_dtype,
    remember_layer,
)
from threefold.kernels.fp8_gemms import FP8_MAX, scaled_mm
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.comm_overlap import gathered_products, reduce_scattered


def _gathered_gemms(x8: torch.Tensor, gemm, tp: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring all-gather of this rank's FP8 rows `x8` (as bytes, which every backend takes)
    with `gemm` of each slice while the next travels: (the gathered FP8 rows, the products
    concatenated), both in sequence order."""
    slices, products = gathered_products(
        x8.view(torch.uint8), lambda part: gemm(part.view(x8.dtype)), tp
    )
    return torch.cat(slices).view(x8.dtype), torch.cat(products)


def _weight_and_bias_grads(ctx, grads: torch.Tensor, x8_t, input_inverse, g8_t, grad_inverse):
    """The weight gradient from the whole sequence's FP8 operands, as the plain FP8 layer's
    (kernels/fp8.py: `layer_weight_grad`), and the bias gradient."""
    needs_weight, needs_bias = ctx.needs_input_grad[1:3]
    grad_weight = grad_bias = None
    if needs_weight:
        operands = (g8_t, x8_t.t(), grad_inverse, input_inverse)
        grad_weight = layer_weight_grad(
            ctx, lambda dtype, out=None: scaled_mm(*operands, dtype, out=out), operands
        )
    if needs_bias and ctx.has_bias:
        grad_bias = grads.sum(dim=0).to(ctx.bias_dtype)
    return grad_weight, grad_bias


class _Fp8AllGatherLinear(torch.autograd.Function):
    """Column-parallel: the FP8 layer's F.linear(all-gather(x), weight, bias), overlapped."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, accumulate: bool, tp: Group):
        x8, _, input_inverse = fp8.cast(INPUT, x.reshape(-1, x.shape[-1]))
        w8, w8_t, weight_inverse = fp8.weight_in_fp8(weight)
        out_dtype = output_dtype(x)
        gathered, output = _gathered_gemms(
            x8,
            lambda part: scaled_mm(
                part, w8.t(), input_inverse, weight_inverse, out_dtype, fast_accum=True
            ),
            tp,
        )
        if bias is not None:
            output = output + bias.to(out_dtype)
        ctx.save_for_backward(gathered.t().contiguous(), input_inverse, w8_t, weight_inverse)
        remember_layer(ctx, x, weight, bias, fp8, accumulate, traced=False)
        ctx.tp = tp
        return output.view(tp.size * x.shape[0], *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x8_t, input_inverse, w8_t, weight_inverse = ctx.saved_tensors
        tp = ctx.tp
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        g8, g8_t, grad_inverse = ctx.fp8.cast(GRAD, grads)
        grad_x = None
        if ctx.needs_input_grad[0]:
            pieces = g8.chunk(tp.size)  # (rows are sequence-major: a piece is a slice)
            local_shape = ctx.input_shape
            grad_x = reduce_scattered(
                lambda c: scaled_mm(pieces[c], w8_t.t(), grad_inverse, weight_inverse, ctx.dtype),
                tp,
                tp.size * local_shape.numel(),
                torch.empty((), dtype=ctx.dtype).element_size(),
            ).view(local_shape)
        grad_weight, grad_bias = _weight_and_bias_grads(
            ctx, grads, x8_t, input_inverse, g8_t, grad_inverse
        )
        return grad_x, grad_weight, grad_bias, None, None, None


class _Fp8LinearReduceScatter(torch.autograd.Function):
    """Row-parallel: reduce-scatter(the FP8 layer's F.linear(x, weight)) over the sequence,
    overlapped."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, accumulate: bool, tp: Group):
        inputs = x.reshape(-1, x.shape[-1])
        x8, x8_t, input_inverse = fp8.cast(INPUT, inputs)
        w8, w8_t, weight_inverse = fp8.weight_in_fp8(weight)
        out_dtype = output_dtype(x)
        pieces = x8.chunk(tp.size)
        output = reduce_scattered(
            lambda c: scaled_mm(
                pieces[c], w8.t(), input_inverse, weight_inverse, out_dtype, fast_accum=True
            ),
            tp,
            inputs.shape[0] * weight.shape[0],
            torch.empty((), dtype=out_dtype).element_size(),
        )
        ctx.save_for_backward(x8_t, input_inverse, w8_t, weight_inverse)
        remember_layer(ctx, x, weight, None, fp8, accumulate, traced=False)
        ctx.tp = tp
        return output.view(x.shape[0] // tp.size, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x8_t, input_inverse, w8_t, weight_inverse = ctx.saved_tensors
        # this rank's slice, cast with the scale of the whole gathered gradient (module doc)
        local8, _, grad_inverse = ctx.fp8.cast(GRAD, grad_output.reshape(-1, grad_output.shape[-1]))
        g8, grad_x = _gathered_gemms(
            local8,
            lambda part: scaled_mm(part, w8_t.t(), grad_inverse, weight_inverse, ctx.dtype),
            ctx.tp,
        )
        grad_weight, _ = _weight_and_bias_grads(
            ctx, g8, x8_t, input_inverse, g8.t().contiguous(), grad_inverse
        )
        return grad_x.view(ctx.input_shape), grad_weight, None, None, None


def _accumulates(fp8: Fp8Linear, weight: torch.Tensor, fuse: bool) -> bool:
    """As `Fp8Linear.linear`: into main_grad with --gradient-accumulation-fusion, and always
    for a weight stored in FP8 (--fp8-param-gather under FSDP2)."""
    return fuse or weight.dtype in FP8_MAX


# Eager, as comm_overlap.py's rings: traced, the P2P calls would hang.
@torch.compiler.disable
def fp8_all_gather_linear(
    fp8: Fp8Linear,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tp: Group,
    fuse: bool = False,
) -> torch.Tensor:
    """A column-parallel FP8 layer's output from this rank's slice `x` of the sequence, the FP8
    all-gather overlapped with the GEMMs (module doc); `fuse`: the weight gradient goes into
    `weight.main_grad`."""
    accumulate = _accumulates(fp8, weight, fuse)
    return _Fp8AllGatherLinear.apply(x, weight, bias, fp8, accumulate, tp)


@torch.compiler.disable
def fp8_linear_reduce_scatter(
    fp8: Fp8Linear, x: torch.Tensor, weight: torch.Tensor, tp: Group, fuse: bool = False
) -> torch.Tensor:
    """A row-parallel FP8 layer's output (no bias), reduce-scattered over the sequence, the
    reduce-scatter overlapped with the GEMMs (module doc)."""
    accumulate = _accumulates(fp8, weight, fuse)
    return _Fp8LinearReduceScatter.apply(x, weight, fp8, accumulate, tp)
