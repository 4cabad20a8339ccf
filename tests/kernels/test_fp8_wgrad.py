"""--no-fp8-wgrad (Megatron-LM's fp8_wgrad=False): an FP8 layer's weight gradient from the
operands in the run's precision, its forward and input gradient unchanged, for every recipe;
what the layer keeps for backward, the gradient buffer, the flags and the log line. Its
layouts against one device: tests/parallel/test_fp8.py."""

import pytest
import torch

from tests.kernels.test_fp8 import DEVICES
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.kernels.fp8 import Fp8Linear
from threefold.kernels.fp8_gemms import FP8_MAX
from threefold.kernels.fp8_recipe import Fp8Recipe
from threefold.parallel.data_parallel.gradient_buffer import GradientBuffer
from threefold.parallel.parallel_context import ParallelContext

RECIPES = {
    "delayed": {},
    "tensorwise": {"delayed": False},
    "rowwise": {"delayed": False, "rowwise": True},
    "blockwise": {"delayed": False, "blockwise": True},
}


def _layer(recipe: str, fp8_wgrad: bool) -> Fp8Linear:
    return Fp8Linear(Fp8Recipe(fp8_format="hybrid", fp8_wgrad=fp8_wgrad, **RECIPES[recipe]))


def _run(layer: Fp8Linear, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """The layer's output, input and weight gradients, and what its forward saved for backward
    (each saved tensor's dtype and shape)."""
    x, weight = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer.linear(x, weight, None)
    out.backward(grad)
    return out.detach(), x.grad, weight.grad, saved


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_weight_gradient_comes_from_the_unquantized_operands(recipe):
    """Bitwise: the forward and the input gradient are FP8's either way, and the weight
    gradient is grad^T @ x of the operands themselves, which the FP8 weight gradient is not.
    The layer keeps x for that, and no FP8 copy of it."""
    torch.manual_seed(0)
    x, weight = torch.randn(128, 256), torch.randn(128, 256) * 0.02
    grad = torch.randn(128, 128) * 1e-3
    out, dx, dw, saved = _run(_layer(recipe, fp8_wgrad=False), x, weight, grad)
    out8, dx8, dw8, saved8 = _run(_layer(recipe, fp8_wgrad=True), x, weight, grad)
    assert torch.equal(out, out8) and torch.equal(dx, dx8)  # the same code either way
    # the product of the operands (1e-6: the FP8 weight gradient is 1e-2 from it)
    torch.testing.assert_close(dw, grad.t() @ x, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(dw8, dw, rtol=1e-4, atol=0)
    assert (torch.float32, (128, 256)) in saved and (torch.float32, (128, 256)) not in saved8
    fp8_copies = [shape for dtype, shape in saved if dtype in FP8_MAX]
    assert len(fp8_copies) == len([s for dtype, s in saved8 if dtype in FP8_MAX]) - 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_bf16_operands_add_their_fp32_products_into_main_grad(recipe, device):
    """In bf16 the weight gradient goes into the fp32 gradient buffer as fp32 sums of the bf16
    operands' products, never rounded to bf16: the first micro-batch's written there, the
    second's added: to fp32's precision (a bf16 rounding would be 4e-3 off), on a GPU through
    mm's out_dtype, whose sums cuBLAS orders its own way."""
    torch.manual_seed(0)
    layer = _layer(recipe, fp8_wgrad=False).to(device)
    weight = torch.nn.Parameter((torch.randn(128, 256) * 0.02).bfloat16().to(device))
    buffer = GradientBuffer([weight], ParallelContext().dp)
    buffer.start_step(num_microbatches=2)
    expected = torch.zeros(128, 256, device=device)
    for _ in range(2):
        x = torch.randn(128, 256).bfloat16().to(device)
        grad = (torch.randn(128, 128) * 1e-3).bfloat16().to(device)
        out = layer.linear(x, weight, None, accumulate_in_main_grad=True)
        out.backward(grad)
        expected += grad.float().t() @ x.float()
    assert weight.main_grad.dtype == torch.float32 and weight.grad is None
    rtol = 1e-6 if device == "cpu" else 1e-5
    torch.testing.assert_close(weight.main_grad, expected, rtol=rtol, atol=rtol * 1e-3)
    assert not torch.equal(expected, expected.bfloat16().float())  # bf16 would round these


def test_the_flag_its_alias_its_log_line_and_its_refusal(capsys):
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    for flag in ("--no-fp8-wgrad", "--disable-fp8-wgrad"):
        assert not parse_args(LLAMA_STYLE + TRAINING + fp8 + [flag]).fp8.fp8_wgrad
    assert parse_args(LLAMA_STYLE + TRAINING + fp8).fp8.fp8_wgrad
    trainer = _setup(LLAMA_STYLE + TRAINING + fp8 + ["--no-fp8-wgrad"])
    assert not trainer.model.decoder.layers[0].mlp.linear_fc1.fp8.recipe.fp8_wgrad
    line = "> fp8: tensorwise current scaling, E4M3 activations and weights, E5M2 gradients; "
    assert line + "weight gradients in the run's precision;" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--no-fp8-wgrad"])
    refusal = "error: --no-fp8-wgrad belongs to FP8 training; add --fp8-format e4m3 or hybrid"
    assert refusal + ", or drop it\n" in capsys.readouterr().err
    # Every FP8 setting given without --fp8-format is named, not dropped
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--fp8-recipe", "tensorwise", "--fp8-margin", "1"])
    refusal = "error: --fp8-recipe and --fp8-margin belong to FP8 training; add --fp8-format"
    assert refusal in capsys.readouterr().err
    # but the layers kept in bf16, which a bf16 run keeps anyway, are said (Nemotron 3.5's
    # Megatron-LM config gives them without FP8)
    kept = ["--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"]
    assert not parse_args(LLAMA_STYLE + TRAINING + kept).fp8.enabled
    note = "WARNING: --first-last-layers-bf16 --num-layers-at-end-in-bf16: no effect without"
    assert note in capsys.readouterr().out


def test_fp8_interval_is_taken_and_named_as_ignored(capsys):
    """Megatron-LM's --fp8-interval, which Transformer Engine has ignored since 1.8."""
    parse_args(LLAMA_STYLE + TRAINING + ["--fp8-format", "hybrid", "--fp8-interval", "1"])
    assert "> --fp8-interval 1 has no effect: Transformer Engine ignores it" in (
        capsys.readouterr().out
    )
