"""`linear_blocks` computes `F.linear(...).chunk(...)`, and its hand-written backward the same
gradients autograd gives the stacked form, in fp32 and under autocast."""

import pytest
import torch
import torch.nn.functional as F

from threefold.parallel.tensor_parallel.layers import linear_blocks


def _case(bias: bool, blocks: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 16, generator=generator)
    weight = torch.randn(blocks * 12, 16, generator=generator)
    b = torch.randn(blocks * 12, generator=generator) if bias else None
    upstream = [torch.randn(6, 3, 12, generator=generator) for _ in range(blocks)]
    return x, weight, b, upstream


def _run(function, x, weight, bias, upstream, frozen_weight=False):
    leaves = [
        t.clone().requires_grad_(not (frozen_weight and t is weight)) if t is not None else None
        for t in (x, weight, bias)
    ]
    outputs = function(*leaves)
    # A different gradient for each block, and a nonlinear use of them, so a mix-up shows.
    loss = sum((out.float().tanh() * grad).sum() for out, grad in zip(outputs, upstream))
    loss.backward()
    return [out.detach() for out in outputs], [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_same_outputs_and_gradients_as_chunked_linear(bias, blocks):
    x, weight, b, upstream = _case(bias, blocks)
    got = _run(lambda *a: linear_blocks(*a, blocks), x, weight, b, upstream)
    want = _run(lambda x, w, b: F.linear(x, w, b).chunk(blocks, dim=-1), x, weight, b, upstream)
    for actual, expected in zip(got[0] + got[1], want[0] + want[1]):
        if expected is None:
            assert actual is None
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-5)


def test_frozen_weight_gets_no_gradient():
    x, weight, b, upstream = _case(True, 2)
    _, (grad_x, grad_weight, grad_bias) = _run(
        lambda *a: linear_blocks(*a, 2), x, weight, b, upstream, frozen_weight=True
    )
    assert grad_weight is None and grad_x is not None and grad_bias is not None


def test_under_autocast_matches_autocast_of_the_stacked_form():
    x, weight, b, upstream = _case(True, 2)

    def under_autocast(function):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return function(*args)

        return run

    got = _run(under_autocast(lambda *a: linear_blocks(*a, 2)), x, weight, b, upstream)
    want = _run(
        under_autocast(lambda x, w, b: F.linear(x, w, b).chunk(2, dim=-1)), x, weight, b, upstream
    )
    assert got[0][0].dtype == torch.bfloat16
    for actual, expected in zip(got[0] + got[1], want[0] + want[1]):
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
