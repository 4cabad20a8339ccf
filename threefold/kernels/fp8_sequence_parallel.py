"""An FP8 layer's sequence-parallel collectives run by its own GEMMs' autograd functions:
--tp-comm-overlap's rings (parallel/tensor_parallel/comm_overlap.py's, around the slices'
FP8 GEMMs), and a row-parallel layer's plain reduce-scatter, whose backward gathers the
output gradient in FP8. (A column-parallel layer's plain FP8 all-gather is kernels/fp8.py's.)
The TP layers reach these through their `Fp8Linear` (`all_gather_linear`,
`linear_reduce_scatter`).

One scale per tensor (tensorwise, delayed), FP8 bytes on the wire for both gathers:

    column-parallel  fwd: x cast on each rank, its FP8 slices around the ring, each arriving
                          slice's GEMM while the next travels (the bytes of the plain layer's
                          FP8 all-gather, `Fp8Linear.gathers_in_fp8`)
                     bwd: g cast whole; each destination's partial dgrad GEMM added to the
                          running sum (run's dtype) that travels on
    row-parallel     fwd: x cast whole; the same ring of partial sums over the sequence
                          (plain: one GEMM, then the reduce-scatter)
                     bwd: g cast on each rank and its FP8 slices around the ring, each slice's
                          dgrad GEMM while the next travels (plain: all-gathered in FP8, then
                          one GEMM). Gathering g in the run's dtype and casting after gives
                          the same bytes, since a slice is cast with the scale of the whole
                          gathered tensor (tensorwise: the amax reduced over TP x CP, which
                          is the gathered tensor's; delayed: the history's), for half bf16's
                          traffic, as Transformer Engine gathers FP8 gradients.

Rowwise and blockwise scaling: the gathered slices travel in the run's dtype, as the plain
layers gather them (the weight gradient's x^T and g^T are scaled per feature over the whole
sequence, which no rank has before the gather), and each arriving slice is cast for its own
GEMM: its rows' scales (per row, or per 1 x 128 block of a row) are those of the same rows in
the whole tensor, so the slices' FP8 operands are the plain layer's. The partial sums are as
above. --no-fp8-wgrad with one scale per tensor: the weight gradient takes the gathered input
(column-parallel) or gradient (row-parallel) unquantized, so those slices travel in the run's
dtype too, and each is cast as it arrives with the scale of the whole gathered tensor: from
the history (delayed), or from the amax each rank reduces from its own slice over TP x CP
before the ring starts (one scalar all-reduce, as the plain FP8 gather's cast takes), so the
slices' FP8 operands are the bytes of the plain layer's cast after its gather.

Every FP8 operand is bitwise the plain layer's, and the weight gradient is the same one GEMM
over the whole gathered sequence; only the slices' GEMMs and the reduce-scatter's additions
run in another order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from threefold.kernels.fp8_autograd import (
    GRAD,
    INPUT,
    bias_grad,
    fine_grained_weight_grad,
    gather_fp8_rows,
    output_dtype,
    remember_layer,
    tensorwise_weight_grad,
)
from threefold.kernels.fp8_gemms import FP8_MAX, scaled_mm
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.comm_overlap import gathered_products, reduce_scattered
from threefold.parallel.tensor_parallel.mappings import reduce_scatter_along_first_dim

if TYPE_CHECKING:  # (kernels/fp8.py's layers call in here: `Fp8Linear.all_gather_linear`)
    from threefold.kernels.fp8 import Fp8Linear


def _gathered_gemms(x8: torch.Tensor, gemm, tp: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring all-gather of this rank's FP8 rows `x8` (as bytes, which every backend takes)
    with `gemm` of each slice while the next travels: (the gathered FP8 rows, the products
    concatenated), both in sequence order."""
    slices, products = gathered_products(
        x8.view(torch.uint8), lambda part: gemm(part.view(x8.dtype)), tp
    )
    return torch.cat(slices).view(x8.dtype), torch.cat(products)


def _reduce_scattered_output(ctx, tp: Group, partial, out_dtype: torch.dtype) -> torch.Tensor:
    """A row-parallel forward's output: `partial(c)`, this rank's GEMM for slice c of the
    sequence, summed around the ring; this rank's slice, [s / TP, b, output features]."""
    x_shape, out_features = ctx.input_shape, ctx.weight.shape[0]
    numel = x_shape.numel() // x_shape[-1] * out_features
    output = reduce_scattered(partial, tp, numel, out_dtype.itemsize)
    ctx.tp = tp
    return output.view(x_shape[0] // tp.size, *x_shape[1:-1], out_features)


def _cast_as_gathered(fp8: Fp8Linear, index: int, local: torch.Tensor, gemm, tp: Group):
    """One scale per tensor with --no-fp8-wgrad (module doc): this rank's slice `local` of the
    sequence around the ring in the run's dtype, each slice cast as it arrives with the scale
    of the whole gathered tensor (its amax reduced from this rank's slice before the ring:
    `Fp8Linear.current_amax`) and `gemm(slice8, inverse)` of it while the next travels:
    (the gathered rows, unquantized, and the products), both in sequence order."""
    rows = local.reshape(-1, local.shape[-1])  # (sequence-major: the slices are runs of rows)
    current = fp8.current_amax(rows)

    def product(part: torch.Tensor) -> torch.Tensor:
        part8, _, inverse = fp8.cast_part(index, part, current)
        return gemm(part8, inverse)

    slices, products = gathered_products(rows, product, tp)
    return torch.cat(slices), torch.cat(products)


class _Fp8AllGatherLinear(torch.autograd.Function):
    """Column-parallel: the FP8 layer's F.linear(all-gather(x), weight, bias), overlapped."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, accumulate: bool, tp: Group):
        w8, w8_t, weight_inverse = fp8.weight_in_fp8(weight)
        out_dtype = output_dtype(x)

        def gemm(part8: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
            return scaled_mm(part8, w8.t(), inverse, weight_inverse, out_dtype, fast_accum=True)

        if fp8.recipe.fp8_wgrad:
            x8, _, input_inverse = fp8.cast(INPUT, x.reshape(-1, x.shape[-1]))
            gathered, output = _gathered_gemms(x8, lambda part: gemm(part, input_inverse), tp)
            kept = (gathered.t().contiguous(), input_inverse)
        else:  # the weight gradient takes the gathered input unquantized
            gathered, output = _cast_as_gathered(fp8, INPUT, x, gemm, tp)
            kept = (gathered, None)
        if bias is not None:
            output = output + bias.to(out_dtype)
        ctx.save_for_backward(*kept, w8_t, weight_inverse)
        remember_layer(ctx, x, weight, bias, fp8, accumulate, traced=False)
        ctx.tp = tp
        return output.view(tp.size * x.shape[0], *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, input_inverse, w8_t, weight_inverse = ctx.saved_tensors
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
                ctx.dtype.itemsize,
            ).view(local_shape)
        grad_weight = tensorwise_weight_grad(ctx, grads, x_kept, input_inverse, g8_t, grad_inverse)
        return grad_x, grad_weight, bias_grad(ctx, grads), None, None, None


class _Fp8LinearReduceScatter(torch.autograd.Function):
    """Row-parallel: reduce-scatter(the FP8 layer's F.linear(x, weight)) over the sequence, in
    the ring with `overlap`, else the plain collectives (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, accumulate: bool, tp: Group, overlap: bool):
        inputs = x.reshape(-1, x.shape[-1])
        x8, x8_t, input_inverse = fp8.cast(INPUT, inputs)
        w8, w8_t, weight_inverse = fp8.weight_in_fp8(weight)
        out_dtype = output_dtype(x)
        kept = (x8_t, input_inverse) if fp8.recipe.fp8_wgrad else (inputs, None)
        ctx.save_for_backward(*kept, w8_t, weight_inverse)
        remember_layer(ctx, x, weight, None, fp8, accumulate, traced=False)
        ctx.overlap = overlap

        def gemm(rows8: torch.Tensor) -> torch.Tensor:
            return scaled_mm(
                rows8, w8.t(), input_inverse, weight_inverse, out_dtype, fast_accum=True
            )

        if not overlap:
            ctx.tp = tp
            output = gemm(x8).view(*x.shape[:-1], weight.shape[0])
            return reduce_scatter_along_first_dim(output, tp)
        pieces = x8.chunk(tp.size)
        return _reduce_scattered_output(ctx, tp, lambda c: gemm(pieces[c]), out_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, input_inverse, w8_t, weight_inverse = ctx.saved_tensors
        fp8 = ctx.fp8

        def gemm(rows8: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
            return scaled_mm(rows8, w8_t.t(), inverse, weight_inverse, ctx.dtype)

        if not fp8.recipe.fp8_wgrad:  # (overlapped: the plain path is `gathers_in_fp8`'s only)
            grads, grad_x = _cast_as_gathered(fp8, GRAD, grad_output, gemm, ctx.tp)
            grad_weight = tensorwise_weight_grad(ctx, grads, x_kept, None, None, None)
            return grad_x.view(ctx.input_shape), grad_weight, None, None, None, None
        # this rank's slice, cast with the scale of the whole gathered gradient (module doc)
        local8, _, grad_inverse = fp8.cast(GRAD, grad_output.reshape(-1, grad_output.shape[-1]))
        if ctx.overlap:
            g8, grad_x = _gathered_gemms(local8, lambda rows8: gemm(rows8, grad_inverse), ctx.tp)
        else:
            g8 = gather_fp8_rows(local8, ctx.tp)
            grad_x = gemm(g8, grad_inverse)
        g8_t = g8.t().contiguous()
        grad_weight = tensorwise_weight_grad(ctx, None, x_kept, input_inverse, g8_t, grad_inverse)
        return grad_x.view(ctx.input_shape), grad_weight, None, None, None, None


class _Fp8FineGrainedAllGatherLinear(torch.autograd.Function):
    """Column-parallel, rowwise or blockwise: the slices of x around the ring in the run's
    dtype, each cast and multiplied as it arrives (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8: Fp8Linear, accumulate: bool, tp: Group):
        (w8, w_inverses), (w8_t, w_t_inverses) = fp8.fine_grained_weight(weight)
        out_dtype = output_dtype(x)

        def product(part: torch.Tensor) -> torch.Tensor:
            part8, inverses = fp8.cast_fine(INPUT, part.reshape(-1, part.shape[-1]))
            return fp8.fine_grained_mm(
                part8, w8.t(), inverses, w_inverses, out_dtype, weight=True, fast_accum=True
            )

        slices, outputs = gathered_products(x, product, tp)
        gathered = torch.cat(slices)
        inputs = gathered.reshape(-1, x.shape[-1])
        output = torch.cat(outputs)
        if bias is not None:
            output = output + bias.to(output.dtype)
        kept = fp8.cast_fine(INPUT, inputs.t()) if fp8.recipe.fp8_wgrad else (inputs, None)
        ctx.save_for_backward(*kept, w8_t, w_t_inverses)
        remember_layer(ctx, x, weight, bias, fp8, accumulate, traced=False)
        ctx.tp = tp
        return output.view(*gathered.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, x_t_inverses, w8_t, w_t_inverses = ctx.saved_tensors
        fp8, tp = ctx.fp8, ctx.tp
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            g8, g_inverses = fp8.cast_fine(GRAD, grads)
            pieces, inverses = g8.chunk(tp.size), g_inverses.chunk(tp.size)
            grad_x = reduce_scattered(
                lambda c: fp8.fine_grained_mm(
                    pieces[c], w8_t.t(), inverses[c], w_t_inverses, ctx.dtype, weight=True
                ),
                tp,
                tp.size * ctx.input_shape.numel(),
                ctx.dtype.itemsize,
            ).view(ctx.input_shape)
        grad_weight = fine_grained_weight_grad(ctx, grads, x_kept, x_t_inverses)
        return grad_x, grad_weight, bias_grad(ctx, grads), None, None, None


class _Fp8FineGrainedLinearReduceScatter(torch.autograd.Function):
    """Row-parallel, rowwise or blockwise: the partial sums' ring, and in backward the slices
    of g around the ring in the run's dtype, each cast and multiplied as it arrives."""

    @staticmethod
    def forward(ctx, x, weight, fp8: Fp8Linear, accumulate: bool, tp: Group):
        inputs = x.reshape(-1, x.shape[-1])
        x8, x_inverses = fp8.cast_fine(INPUT, inputs)
        kept = fp8.cast_fine(INPUT, inputs.t()) if fp8.recipe.fp8_wgrad else (inputs, None)
        (w8, w_inverses), (w8_t, w_t_inverses) = fp8.fine_grained_weight(weight)
        out_dtype = output_dtype(x)
        pieces, inverses = x8.chunk(tp.size), x_inverses.chunk(tp.size)
        ctx.save_for_backward(*kept, w8_t, w_t_inverses)
        remember_layer(ctx, x, weight, None, fp8, accumulate, traced=False)
        return _reduce_scattered_output(
            ctx,
            tp,
            lambda c: fp8.fine_grained_mm(
                pieces[c], w8.t(), inverses[c], w_inverses, out_dtype, weight=True, fast_accum=True
            ),
            out_dtype,
        )

    @staticmethod
    def backward(ctx, grad_output):
        x_kept, x_t_inverses, w8_t, w_t_inverses = ctx.saved_tensors
        fp8 = ctx.fp8

        def product(part: torch.Tensor) -> torch.Tensor:
            part8, inverses = fp8.cast_fine(GRAD, part.reshape(-1, part.shape[-1]))
            return fp8.fine_grained_mm(
                part8, w8_t.t(), inverses, w_t_inverses, ctx.dtype, weight=True
            )

        slices, grads_x = gathered_products(grad_output, product, ctx.tp)
        grads = torch.cat(slices).reshape(-1, grad_output.shape[-1])
        grad_weight = fine_grained_weight_grad(ctx, grads, x_kept, x_t_inverses)
        return torch.cat(grads_x).view(ctx.input_shape), grad_weight, None, None, None


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
    function = _Fp8FineGrainedAllGatherLinear if fp8.recipe.fine_grained else _Fp8AllGatherLinear
    return function.apply(x, weight, bias, fp8, accumulate, tp)


@torch.compiler.disable
def fp8_linear_reduce_scatter(
    fp8: Fp8Linear,
    x: torch.Tensor,
    weight: torch.Tensor,
    tp: Group,
    fuse: bool = False,
    overlap: bool = True,
) -> torch.Tensor:
    """A row-parallel FP8 layer's output (no bias), reduce-scattered over the sequence: with
    `overlap` in the ring beside the GEMMs, else (one scale per tensor:
    `Fp8Linear.gathers_in_fp8`) by the plain collectives, the gradient gathered in FP8
    (module doc)."""
    accumulate = _accumulates(fp8, weight, fuse)
    if fp8.recipe.fine_grained:
        return _Fp8FineGrainedLinearReduceScatter.apply(x, weight, fp8, accumulate, tp)
    return _Fp8LinearReduceScatter.apply(x, weight, fp8, accumulate, tp, overlap)
