"""--moe-grouped-gemm keeps the experts' weights as their parameters between forward and
backward: the [E, out, in] stack the grouped GEMM reads is made again for its backward, not
kept (a copy of every local expert's weight per micro-batch in flight); the gradients are
those of the stack kept; saved-tensor hooks outside it (a measurement, activation
offloading, a checkpoint) see every other tensor the GEMM saves."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.model.test_activation_offload import MOE_MODEL, OFFLOAD
from tests.parity import train_job
from threefold.arguments import parse_args
from threefold.model.moe import experts as experts_module
from threefold.model.moe.experts import Experts
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel import delayed_wgrad
from threefold.parallel.tensor_parallel.sharding import normal_init

COUNTS = [3, 0, 5, 2]


def _experts() -> tuple[Experts, torch.Tensor]:
    config = parse_args(MOE_MODEL + ["--moe-grouped-gemm"]).model
    experts = Experts(config, ParallelContext(), normal_init(0.1), normal_init(0.1))
    generator = torch.Generator().manual_seed(0)
    for param in experts.parameters():
        param.data.normal_(0, 0.1, generator=generator)
    tokens = torch.randn(sum(COUNTS), config.hidden_size, requires_grad=True)
    return experts, tokens


def _saved(experts: Experts, tokens: torch.Tensor) -> tuple[list[tuple], torch.Tensor]:
    """The shapes an outer hook sees saved, and the output."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = experts(tokens, COUNTS)
    return shapes, out


def test_the_stack_is_made_again_for_backward_not_kept(monkeypatch):
    experts, tokens = _experts()
    params = [tokens, *experts.parameters()]
    expert = experts.local_experts["0"]
    # the GEMMs' transposed views of the stacks
    stacks = {
        (len(COUNTS), *linear.weight.shape[::-1])
        for linear in (expert.linear_fc1, expert.linear_fc2)
    }
    shapes, out = _saved(experts, tokens)
    assert not stacks & set(shapes)
    assert any(shape[-1] == tokens.shape[1] for shape in shapes)  # the tokens: outer hooks'
    grads = torch.autograd.grad(out.square().sum(), params)
    # the stack kept, as autograd keeps it without the hooks
    monkeypatch.setattr(
        experts_module,
        "_grouped_linear",
        lambda x, weights, counts: experts_module._grouped_matmul(x, torch.stack(weights), counts),
    )
    shapes, out = _saved(experts, tokens)
    assert stacks <= set(shapes)
    expected = torch.autograd.grad(out.square().sum(), params)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "flags",
    [
        OFFLOAD + ["--offload-modules", "expert_fc1", "moe_act"],
        ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
    ],
    ids=["offloaded", "recomputed"],
)
def test_the_grouped_gemm_under_other_hooks_trains_as_the_loop(flags):
    """Activation offloading (the GEMM's input in its group) and the MoE layer's checkpoint
    take what the GEMM saves besides the stack; three steps match the looped experts."""
    loop = train_job(MOE_MODEL + flags, 3)
    grouped = train_job(MOE_MODEL + ["--moe-grouped-gemm"] + flags, 3)
    assert grouped["losses"] == pytest.approx(loop["losses"], rel=1e-6)
    for name, value in loop["params"].items():
        assert grouped["params"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
def test_the_delayable_grouped_gemm_gives_the_grouped_gemms_gradients(device, deferred):
    """--delay-wgrad-compute's grouped GEMM (torch._grouped_mm on CUDA bf16, the padded batched
    matmul elsewhere): the output and gradients of the grouped GEMM autograd differentiates,
    its weight gradients computed at once or deferred to a flush, an expert without tokens
    included."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(sum(COUNTS), 16, generator=generator).to(device, dtype)
    weights = [torch.randn(24, 16, generator=generator).to(device, dtype) for _ in COUNTS]
    grad = torch.randn(sum(COUNTS), 24, generator=generator).to(device, dtype)
    results = []
    for delayable in (False, True):
        x = tokens.clone().requires_grad_()
        w = [weight.clone().requires_grad_() for weight in weights]
        if delayable:
            out = experts_module._GroupedLinear.apply(x, COUNTS, *w)
            with delayed_wgrad.collected() if deferred else contextlib.nullcontext():
                out.backward(grad)
                assert all((v.grad is None) == deferred for v in w)
        else:
            out = experts_module._grouped_linear(x, w, COUNTS)
            out.backward(grad)
        results.append((out, x.grad, [v.grad for v in w]))
    (out, x_grad, w_grads), (out2, x_grad2, w_grads2) = results
    tolerance = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(x_grad2, x_grad, **tolerance)
    for ours, theirs in zip(w_grads2, w_grads):
        torch.testing.assert_close(ours, theirs, **tolerance)
