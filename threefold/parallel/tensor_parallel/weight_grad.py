"""--gradient-accumulation-fusion: a linear layer's weight gradient goes into `weight.main_grad`
(its view of the gradient buffer, parallel/data_parallel/gradient_buffer.py), not into a
gradient tensor that a separate kernel then adds there.

Autograd still receives a gradient for the weight: a placeholder, which the gradient buffer's
hook discards on seeing `grad_added_to_main_grad` (Megatron's attribute; its hook also counts
the call, so bucket readiness and overlap are unchanged).

Inside a layer compiled whole (--compile-layers) two things differ, both because a compiled
backward runs no Python:
- the flag is set by the forward (`flag_traced_accumulation`): exact while every backward
  follows its own forward, so not under pipeline parallelism (1F1B runs the next forward
  first; kernels/dispatch.py leaves those layers unfused);
- the product is added by one operator, `threefold::add_weight_grad_product`, that Inductor
  calls with main_grad itself. Traced as `addmm_`, the graph would add into a new buffer and
  copy that back: 16 bytes moved per fp32 gradient element where the fused GEMM moves 8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from threefold.parallel.tensor_parallel import delayed_wgrad


def mark_main_grad_added(weight: torch.Tensor) -> None:
    """`weight.main_grad` holds a gradient now: the gradient buffer's flags that it still
    holds the step's zeros are cleared, the attribute (read by eager code) and the tensor
    (read by compiled graphs: kernels/fp8_gemms.py's `weight_grad_into`). Once a step: later
    calls find the attribute cleared and touch no tensor."""
    if getattr(weight, "main_grad_is_zero", False):
        weight.main_grad_is_zero = False
        zeroed = getattr(weight, "main_grad_zeroed", None)
        if zeroed is not None:
            zeroed.fill_(False)


def placeholder_grad(weight: torch.Tensor, flag: bool = True) -> torch.Tensor:
    """What autograd receives for a weight whose gradient went into `main_grad` already: an
    uninitialized tensor (no memory traffic). `flag=False`: the caller's forward set it."""
    if flag:
        weight.grad_added_to_main_grad = True
        mark_main_grad_added(weight)
    return torch.empty_like(weight)


def flag_traced_accumulation(weight: torch.Tensor) -> bool:
    """Whether this forward is being traced into a compiled graph; if so, flag now what its
    backward will have added (a compiled backward cannot set an attribute). Only the
    attribute, which the traced code sets without reading (a read would be a guard, and a
    graph for each value): the tensor flag is the FP8 operator's, which no weight of these
    layers reaches."""
    traced = torch.compiler.is_compiling()
    if traced and weight.requires_grad:
        weight.grad_added_to_main_grad = True
        weight.main_grad_is_zero = False
    return traced


def _add_product(main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor) -> None:
    """`main_grad += grad_output^T @ inputs` in the GEMM (its beta = 1); bf16 operands into the
    fp32 buffer through addmm's out_dtype (CUDA)."""
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), inputs)
    else:
        torch.addmm(main_grad, grad_output.t(), inputs, out_dtype=main_grad.dtype, out=main_grad)


def _add_rows(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, row: int
) -> None:
    """`_add_product` into rows `row` onwards of main_grad (a stacked weight's block)."""
    _add_product(main_grad[row : row + grad_output.shape[1]], grad_output, inputs)


@torch.library.custom_op("threefold::add_weight_grad_product", mutates_args=("main_grad",))
def _add_product_op(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, row: int
) -> None:
    _add_rows(main_grad, grad_output, inputs, row)


@_add_product_op.register_fake
def _(main_grad, grad_output, inputs, row) -> None:
    return None


def add_weight_grad_product(
    main_grad: torch.Tensor,
    grad_output: torch.Tensor,
    inputs: torch.Tensor,
    traced: bool,
    row: int = 0,
) -> None:
    """`main_grad[row:] += grad_output^T @ inputs` for the rows grad_output has, in the
    weight-gradient GEMM; `traced`: inside a compiled graph (module doc)."""
    (_add_product_op if traced else _add_rows)(main_grad, grad_output, inputs, row)


def accumulate_weight_grad(
    weight: torch.Tensor, grad_weight: torch.Tensor, flag: bool = True
) -> torch.Tensor:
    """A weight gradient computed in fp32 already (the FP8 GEMM's output) added to
    `weight.main_grad`, skipping its rounding to the parameters' dtype; the placeholder
    (`placeholder_grad`'s `flag`)."""
    weight.main_grad.add_(grad_weight)
    return placeholder_grad(weight, flag)


def write_weight_grad(weight: torch.Tensor, gemm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """A weight gradient that `gemm(dtype, out)` computes in fp32 (an FP8 GEMM, which cannot
    accumulate into its output as addmm does) into `weight.main_grad`: written there by the
    GEMM itself while main_grad still holds the zeros the gradient buffer started the step
    with (`main_grad_is_zero`, set by its `start_step`: a step's first micro-batch), saving
    the add (in main_grad's dtype: 0 + x rounds as the GEMM's output does), else added.
    Returns the placeholder."""
    main_grad = weight.main_grad
    if getattr(weight, "main_grad_is_zero", False) and main_grad.is_contiguous():
        gemm(main_grad.dtype, main_grad)
        return placeholder_grad(weight)
    return accumulate_weight_grad(weight, gemm(torch.float32))


class LinearWithGradAccumulation(torch.autograd.Function):
    """`F.linear` whose weight gradient is accumulated into `weight.main_grad` by the GEMM
    (megatron-core's LinearWithGradAccumulationAndAsyncCommunication, without the overlap).
    `traced`: `flag_traced_accumulation`'s answer in the forward."""

    @staticmethod
    def forward(ctx, x, weight, bias, traced=False):
        ctx.save_for_backward(x)
        # The parameter itself, for its main_grad: under activation recomputation a saved
        # tensor comes back as another tensor object.
        ctx.weight, ctx.has_bias, ctx.traced = weight, bias is not None, traced
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x = (grads @ weight).view(x.shape) if needs_x else None
        grad_weight = None
        if needs_weight:
            inputs, traced = x.reshape(-1, x.shape[-1]), ctx.traced

            def product() -> torch.Tensor:
                add_weight_grad_product(weight.main_grad, grads, inputs, traced)
                return placeholder_grad(weight, flag=not traced)

            grad_weight = delayed_wgrad.when_due(weight, product)  # --delay-wgrad-compute
        grad_bias = grads.sum(dim=0) if needs_bias and ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None
