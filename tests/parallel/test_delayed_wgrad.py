"""--delay-wgrad-compute's GEMM paths one by one: inside a collecting backward pass each layer's
weight gradient waits for the flush, then arrives through autograd as the one computed at once
(plain, gradient-accumulation fusion's main_grad, SwiGLU's blocks with and without it, the
grouped experts, an FP8 layer's under each recipe, into main_grad or not), without building a
graph; outside one nothing waits. The combined schedule
that collects is tested in tests/parallel/test_ep_overlap.py."""

from __future__ import annotations

import pytest
import torch

from threefold.kernels.fp8 import Fp8Linear
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.model.moe import experts as experts_module
from threefold.parallel.tensor_parallel import delayed_wgrad
from threefold.parallel.tensor_parallel.delayed_wgrad import DelayableLinear
from threefold.parallel.tensor_parallel.layers import linear_blocks
from threefold.parallel.tensor_parallel.weight_grad import LinearWithGradAccumulation

COUNTS = [3, 0, 5]


def _plain(x, w):
    return DelayableLinear.apply(x, w, None)


def _fused(x, w):
    return LinearWithGradAccumulation.apply(x, w, None, False)


def _blocks(x, w):
    return torch.cat(linear_blocks(x, w, None, 2), dim=-1)


def _blocks_fused(x, w):
    return torch.cat(linear_blocks(x, w, None, 2, True), dim=-1)


def _grouped(x, w):
    return experts_module._GroupedLinear.apply(x, COUNTS, *w.chunk(len(COUNTS)))


def _fp8(recipe: Fp8Recipe, fused: bool):
    """An FP8 layer's GEMMs (a fresh scaling state each call), its weight gradient added to
    main_grad (`fused`) or returned."""
    return lambda x, w: Fp8Linear(recipe).linear(x, w, None, fused)


FP8_RECIPES = {
    "delayed": Fp8Recipe(delayed=True),
    "tensorwise": Fp8Recipe(delayed=False),
    "rowwise": Fp8Recipe(delayed=False, rowwise=True),
    "blockwise": Fp8Recipe(delayed=False, blockwise=True),
    "tensorwise-no-fp8-wgrad": Fp8Recipe(delayed=False, fp8_wgrad=False),
    "rowwise-no-fp8-wgrad": Fp8Recipe(delayed=False, rowwise=True, fp8_wgrad=False),
}
PATHS = {
    "plain": (_plain, False),
    "fused": (_fused, True),
    "blocks": (_blocks, False),
    "blocks-fused": (_blocks_fused, True),
    **{f"fp8-{name}": (_fp8(recipe, False), False) for name, recipe in FP8_RECIPES.items()},
    **{f"fp8-{name}-fused": (_fp8(recipe, True), True) for name, recipe in FP8_RECIPES.items()},
}


def _weight_gradient(path, deferred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight's gradient, the input's) after forward and backward, collected or not."""
    linear, fused = PATHS[path] if path in PATHS else (_grouped, False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=generator).requires_grad_()
    rows = 4 * len(COUNTS) if path == "grouped" else 8
    weight = torch.randn(rows, 6, generator=generator).requires_grad_()
    if path == "grouped":  # an expert's weights are parameters of their own
        leaves = [part.detach().requires_grad_() for part in weight.chunk(len(COUNTS))]
        linear = lambda x, w: experts_module._GroupedLinear.apply(x, COUNTS, *leaves)  # noqa: E731
    if fused:
        weight.main_grad = torch.zeros_like(weight)
    grad = torch.randn(8, 4 if path == "grouped" else rows, generator=generator)
    with delayed_wgrad.collected() if deferred else torch.enable_grad():
        linear(x, weight).backward(grad)
        if deferred:  # nothing has arrived before the flush
            held = leaves if path == "grouped" else [weight]
            assert all(w.grad is None for w in held)
            assert not fused or not weight.main_grad.any()
    if path == "grouped":
        result = torch.cat([leaf.grad for leaf in leaves])
    else:
        result = weight.main_grad if fused else weight.grad
    assert not result.requires_grad and result.grad_fn is None
    return result, x.grad


@pytest.mark.parametrize("path", [*PATHS, "grouped"])
def test_a_deferred_weight_gradient_arrives_at_the_flush_as_computed_at_once(path):
    deferred, at_once = _weight_gradient(path, True), _weight_gradient(path, False)
    torch.testing.assert_close(deferred[0], at_once[0], rtol=0, atol=0)
    torch.testing.assert_close(deferred[1], at_once[1], rtol=0, atol=0)


def test_nothing_waits_outside_a_collecting_pass():
    assert not delayed_wgrad.collecting()
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    _plain(x, w).sum().backward()
    assert w.grad is not None
