"""What the kernel dispatch selects on a device computes the reference function there, in
bf16: every SDPA backend that runs the shapes, the attention `configure` picks, and a short
bf16 training run of a LLaMA-style model against the fp32 CPU run. The `cpu` legs run in CI;
the `cuda` legs where a GPU is (bench/gpu_session.sh tests)."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend

from tests.conftest import DEVICES
from tests.parity import LLAMA_STYLE, TRAINING, assert_losses_close, relative_error, train_job
from threefold.arguments import parse_args
from threefold.config import KernelConfig
from threefold.kernels import dispatch
from threefold.kernels.dispatch import KERNELS, AttentionShape, configure
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.trainer import Trainer

BF16_TOLERANCE = 2e-2  # see test_kernels.py
# Head size 64 and 2 query heads per group: the shapes of the 1B benchmark, scaled down.
SHAPE = AttentionShape(heads=8, groups=4, head_dim=64, dropout=0.0)


def _attention_inputs(device: str):
    generator = torch.Generator().manual_seed(5)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    query = tensor(128, 2, SHAPE.heads, SHAPE.head_dim)
    key, value = (tensor(128, 2, SHAPE.groups, SHAPE.head_dim) for _ in range(2))
    return (query, key, value), tensor(128, 2, SHAPE.heads * SHAPE.head_dim)


def _causal_attention(query, key, value, attention_mask, dropout):
    """Written out in fp32: softmax(q k^T / sqrt(d) + causal mask) v, query head i reading
    key/value group i // (heads / groups), in [s, b, heads, d] -> [s, b, heads * d]."""
    s, b, heads, d = query.shape
    repeat = heads // key.shape[2]
    key, value = (t.repeat_interleave(repeat, dim=2) for t in (key, value))
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) / d**0.5
    future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,kbhd->qbhd", weights, value).reshape(s, b, heads * d)


def _output_and_grads(attention, inputs, grad_output, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    output = attention(*leaves, None, 0.0)
    output.backward(grad_output.to(dtype))
    return [output.detach().float()] + [leaf.grad.float() for leaf in leaves]


def _assert_bf16_close(actual, expected, what):
    """Norm-wise: gradients sum 100s of bf16 products, so single small entries stray further
    than one rounding while the whole tensor stays within it (a wrong mask or head-to-group
    mapping is off by order 1)."""
    for name, got, want in zip(
        ("output", "query grad", "key grad", "value grad"), actual, expected
    ):
        error = relative_error(got.cpu(), want.cpu())
        assert error <= BF16_TOLERANCE, f"{what}: {name} relative error {error:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_every_sdpa_backend_that_runs_matches_fp32_math(device):
    inputs, grad_output = _attention_inputs(device)
    expected = _output_and_grads(_causal_attention, inputs, grad_output, torch.float32)
    ran = []
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ):
        for expand in (False, True):
            if dispatch._runs(backend, SHAPE, torch.device(device), torch.bfloat16, expand):
                actual = _output_and_grads(
                    dispatch._sdpa_with(backend, expand), inputs, grad_output, torch.bfloat16
                )
                _assert_bf16_close(actual, expected, f"{backend.name}, expanded {expand}")
                ran.append(backend)
                break
    # PyTorch has a flash kernel for both the CPU and Hopper GPUs in bf16 at head size 64.
    assert SDPBackend.FLASH_ATTENTION in ran and SDPBackend.MATH in ran, ran


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_configure_picks_matches_fp32_math(device):
    line = configure(KernelConfig(), torch.device(device), torch.bfloat16, "RMSNorm", SHAPE)
    if device == "cuda":  # auto prefers the fused kernels there, flash first when untimed
        assert "attention SDPA FLASH_ATTENTION" in line or "Transformer Engine" in line, line
    inputs, grad_output = _attention_inputs(device)
    expected = _output_and_grads(_causal_attention, inputs, grad_output, torch.float32)
    actual = _output_and_grads(KERNELS.attention, inputs, grad_output, torch.bfloat16)
    _assert_bf16_close(actual, expected, line)


@pytest.mark.parametrize("device", DEVICES[1:])  # the `cuda` leg alone: it times CUDA events
def test_the_fastest_backend_at_the_model_shape_matches_fp32_math(device):
    """With the model's sequence known, `auto` times the fused backends that run and keeps
    the fastest; whichever it is computes the same attention."""
    shape = dataclasses.replace(SHAPE, sequence=512, batch=2)
    line = configure(KernelConfig(), torch.device(device), torch.bfloat16, "RMSNorm", shape)
    if "Transformer Engine" not in line:
        assert "the fastest forward+backward at sequence 512 x micro-batch 2" in line, line
    inputs, grad_output = _attention_inputs(device)
    expected = _output_and_grads(_causal_attention, inputs, grad_output, torch.float32)
    actual = _output_and_grads(KERNELS.attention, inputs, grad_output, torch.bfloat16)
    _assert_bf16_close(actual, expected, line)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile_layers"])
def test_bf16_training_on_the_device_follows_fp32(device, compiled):
    """Five steps with the device's default kernels in bf16 (fp32 master weights and Adam
    state) track the fp32 CPU run of the same data and initial weights; eager, and with
    compiled layers, whose weight-gradient GEMMs add bf16 products into the fp32 gradient
    buffer from inside the graph on CUDA (tensor_parallel/weight_grad.py)."""
    argv = LLAMA_STYLE + TRAINING
    flags = ["--bf16"]
    if compiled:
        if device == "cpu":  # the CPU's: test_compile_layers.py, in fp32 (no bf16 addmm here)
            pytest.skip("compiled layers on the CPU: test_compile_layers.py")
        torch._dynamo.reset()  # a fresh cache: a full one would fall back to eager quietly
        flags += ["--compile-layers"]
    expected = train_job(argv, 5)["losses"]
    trainer = Trainer(parse_args(argv + flags), torch.device(device), ParallelContext())
    if device == "cuda":
        assert "weight gradients accumulated into the gradient buffer" in KERNELS.description
    assert next(trainer.model.parameters()).device.type == device
    losses = [trainer.train_step()[0] for _ in range(5)]
    assert_losses_close(losses, expected, BF16_TOLERANCE)
