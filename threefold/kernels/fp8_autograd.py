"""What the FP8 linear layers' autograd functions share (kernels/fp8.py's, and their
sequence-parallel ones in kernels/fp8_sequence_parallel.py): the context a
forward leaves its backward, the output dtype, the FP8 all-gather and the weight and bias
gradients. A weight gradient is computed when due (`delayed_wgrad.when_due`): at once, or with
--delay-wgrad-compute at the combined step's next exchange, as a bf16 layer's."""

from __future__ import annotations

from functools import partial

import torch

from threefold.kernels.fp8_gemms import scaled_mm, unquantized_mm, weight_grad_into
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.delayed_wgrad import when_due
from threefold.parallel.tensor_parallel.mappings import all_gather_along_first_dim
from threefold.parallel.tensor_parallel.weight_grad import (
    accumulate_weight_grad,
    placeholder_grad,
    write_weight_grad,
)

# Index of each of a linear layer's tensors in its scaling state.
INPUT, WEIGHT, GRAD = 0, 1, 2


def remember_layer(ctx, x, weight, bias, fp8, accumulate: bool, traced: bool) -> None:
    """What an FP8 linear's backward needs beside its saved tensors: the parameter itself, for
    its main_grad (a saved tensor can come back as another object under activation
    recomputation), and the input's shape and dtypes. `fp8`: the layer's `Fp8Linear`."""
    ctx.fp8, ctx.accumulate, ctx.weight, ctx.traced = fp8, accumulate, weight, traced
    ctx.input_shape, ctx.dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would return: the autocast dtype under autocast (PyTorch DDP/FSDP2
    keep fp32 parameters), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def layer_weight_grad(ctx, gemm, operands: tuple | None = None) -> torch.Tensor:
    """The weight gradient from `gemm(out_dtype, out=None)`: in fp32 straight into main_grad,
    never rounded to bf16 (accumulating; written by the GEMM where main_grad still holds the
    step's zeros: `write_weight_grad`), else in the weight's dtype. Traced into a compiled
    layer, a tensorwise GEMM's `operands` go to one operator that decides between writing
    and adding as the graph runs (`weight_grad_into`); other GEMMs add."""
    if not ctx.accumulate:
        return gemm(ctx.weight.dtype)
    if not ctx.traced:
        return write_weight_grad(ctx.weight, gemm)
    # `Fp8Linear.linear` flagged the placeholder in the forward
    zeroed = getattr(ctx.weight, "main_grad_zeroed", None)
    if operands is None or zeroed is None:
        return accumulate_weight_grad(ctx.weight, gemm(torch.float32), flag=False)
    weight_grad_into(ctx.weight.main_grad, zeroed, *operands)
    return placeholder_grad(ctx.weight, flag=False)


def tensorwise_weight_grad(ctx, grads, x_kept, input_inverse, g8_t, grad_inverse):
    """One scale per tensor (tensorwise, delayed): dw = g^T x from the transposed FP8 copies
    `g8_t` and `x_kept` (x^T), or, --no-fp8-wgrad, from the gradients `grads` and the input
    `x_kept` unquantized; None where the weight needs no gradient."""
    if not ctx.needs_input_grad[1]:
        return None
    if not ctx.fp8.recipe.fp8_wgrad:
        return when_due(
            ctx.weight, partial(layer_weight_grad, ctx, partial(unquantized_mm, grads.t(), x_kept))
        )
    operands = (g8_t, x_kept.t(), grad_inverse, input_inverse)
    gemm = lambda dtype, out=None: scaled_mm(*operands, dtype, out=out)  # noqa: E731
    return when_due(ctx.weight, partial(layer_weight_grad, ctx, gemm, operands))


def fine_grained_weight_grad(ctx, grads, x_kept, x_t_inverses):
    """Rowwise and blockwise scaling: dw = g^T x, g^T cast now per row (or 1 x 128 block) of
    its own layout and `x_kept` the input's transposed cast with its scales' `x_t_inverses`;
    or, --no-fp8-wgrad, from `grads` and the input `x_kept` unquantized. None where the
    weight needs no gradient."""
    if not ctx.needs_input_grad[1]:
        return None
    fp8 = ctx.fp8
    if not fp8.recipe.fp8_wgrad:
        return when_due(
            ctx.weight, partial(layer_weight_grad, ctx, partial(unquantized_mm, grads.t(), x_kept))
        )

    def weight_grad() -> torch.Tensor:  # the cast of g^T too: it serves this GEMM alone
        g8_t, g_t_inverses = fp8.cast_fine(GRAD, grads.t())

        def gemm(dtype, out=None):
            # (cuBLASLt's rowwise and blockwise GEMMs write no given tensor: copied into `out`)
            result = fp8.fine_grained_mm(g8_t, x_kept.t(), g_t_inverses, x_t_inverses, dtype)
            return result if out is None else out.copy_(result)

        return layer_weight_grad(ctx, gemm)

    return when_due(ctx.weight, weight_grad)


def gather_fp8_rows(x8: torch.Tensor, tp: Group) -> torch.Tensor:
    """Every TP rank's FP8 rows, concatenated in rank order, gathered as bytes (which every
    backend takes)."""
    return all_gather_along_first_dim(x8.view(torch.uint8), tp).view(x8.dtype)


def bias_grad(ctx, grads: torch.Tensor) -> torch.Tensor | None:
    """The bias gradient from the 2-D output gradients, where the layer has a bias that
    needs one."""
    if not (ctx.needs_input_grad[2] and ctx.has_bias):
        return None
    return grads.sum(dim=0).to(ctx.bias_dtype)
