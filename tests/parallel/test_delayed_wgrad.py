"""--delay-wgrad-compute's GEMM paths one by one: inside a collecting backward pass each layer's
weight gradient waits for the flush, then arrives through autograd as the one computed at once
(plain, gradient-accumulation fusion's main_grad, SwiGLU's blocks with and without it, the
grouped experts, an FP8 layer's under each recipe, into main_grad or not, and --tp-comm-overlap's
ring GEMMs on two ranks), without building a graph; outside one nothing waits. The combined
schedule that collects is tested in tests/parallel/test_ep_overlap.py."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_distributed
from threefold.kernels.fp8 import Fp8Linear
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.model.moe import experts as experts_module
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel import delayed_wgrad
from threefold.parallel.tensor_parallel.comm_overlap import all_gather_linear, linear_reduce_scatter
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


def _backward(linear, fused: bool, deferred: bool, x, weight, grad, held: list) -> torch.Tensor:
    """The weight's gradient (main_grad where `fused`) after `linear(x, weight)`'s forward and
    backward, its weight gradients collected (`deferred`) or not; nothing of `held` (the
    weights) has a gradient before the flush."""
    if fused:
        weight.main_grad = torch.zeros_like(weight)
    with delayed_wgrad.collected() if deferred else torch.enable_grad():
        linear(x, weight).backward(grad)
        if deferred:  # nothing has arrived before the flush
            assert all(w.grad is None for w in held)
            assert not fused or not weight.main_grad.any()
    result = weight.main_grad if fused else torch.cat([w.grad for w in held])
    assert not result.requires_grad and result.grad_fn is None
    return result


def _weight_gradient(path, deferred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight's gradient, the input's) after forward and backward, collected or not."""
    linear, fused = PATHS[path] if path in PATHS else (_grouped, False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=generator).requires_grad_()
    rows = 4 * len(COUNTS) if path == "grouped" else 8
    weight = torch.randn(rows, 6, generator=generator).requires_grad_()
    held = [weight]
    if path == "grouped":  # an expert's weights are parameters of their own
        held = [part.detach().requires_grad_() for part in weight.chunk(len(COUNTS))]
        linear = lambda x, w: experts_module._GroupedLinear.apply(x, COUNTS, *held)  # noqa: E731
    grad = torch.randn(8, 4 if path == "grouped" else rows, generator=generator)
    return _backward(linear, fused, deferred, x, weight, grad, held), x.grad


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


def _ring_paths(tp: Group) -> dict:
    """--tp-comm-overlap's ring GEMMs, column-parallel (all-gather) and row-parallel
    (reduce-scatter), bf16 (asked to delay: a layer's own weight) and FP8 (every FP8 weight
    gradient is delayable): (linear(x, weight, fused), whether x is this rank's slice of the
    sequence)."""
    fp8 = {name: FP8_RECIPES[name] for name in ("delayed", "rowwise")}
    return {
        "all-gather": (lambda x, w, f: all_gather_linear(x, w, None, tp, f, delay=True), True),
        "reduce-scatter": (lambda x, w, f: linear_reduce_scatter(x, w, tp, f, delay=True), False),
        **{
            f"fp8-{name}-all-gather": (
                lambda x, w, f, r=recipe: Fp8Linear(r).all_gather_linear(x, w, None, tp, f),
                True,
            )
            for name, recipe in fp8.items()
        },
        **{
            f"fp8-{name}-reduce-scatter": (
                lambda x, w, f, r=recipe: Fp8Linear(r).linear_reduce_scatter(x, w, tp, f),
                False,
            )
            for name, recipe in fp8.items()
        },
    }


def _ring_job() -> list[str]:
    """On each TP rank, every ring path with its weight gradient collected, into main_grad
    or not: nothing before the flush, then bitwise what the path computes at once; the input
    gradient (the ring's) bitwise too. Returns the paths checked."""
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tp = Group(torch.distributed.group.WORLD, size, rank)
    checked = []
    for name, (linear, sliced) in _ring_paths(tp).items():
        for fused in (False, True):
            results = []
            for deferred in (True, False):
                generator = torch.Generator().manual_seed(rank)
                x = torch.randn(16 if sliced else 16 * size, 16, generator=generator)
                x.requires_grad_()
                weight = torch.randn(16, 16, generator=generator).requires_grad_()
                grad = torch.randn(16 * size if sliced else 16, 16, generator=generator)
                layer = functools.partial(linear, f=fused)
                gradient = _backward(layer, fused, deferred, x, weight, grad, [weight])
                results.append((gradient, x.grad))
            (deferred_w, deferred_x), (at_once_w, at_once_x) = results
            torch.testing.assert_close(deferred_w, at_once_w, rtol=0, atol=0)
            torch.testing.assert_close(deferred_x, at_once_x, rtol=0, atol=0)
            checked.append(f"{name}{'-fused' if fused else ''}")
    return checked


def test_the_ring_gemms_weight_gradients_wait_for_the_flush_too():
    """--tp-comm-overlap with --delay-wgrad-compute: the rings' weight-gradient GEMMs, bf16
    and FP8, wait for the flush and then arrive as computed at once, on 2 TP ranks."""
    for checked in run_distributed(2, _ring_job):
        assert len(checked) == 12
