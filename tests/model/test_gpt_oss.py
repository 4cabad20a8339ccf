"""GPT-OSS's model as threefold trains it: experts and router with biases (no
--disable-bias-linear; megatron-core's router bias), GPT-OSS's MLP, learned attention sinks and
a sliding window in every other layer. The router's bias, summed over TP under sequence
parallelism, and every layout as one process. Conversions: tests/tools/test_convert_gpt_oss.py
(transformers' GptOssForCausalLM, MXFP4 experts) and tests/tools/test_megatron_moe_checkpoints.py
(megatron-core's logits)."""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.model.test_quick_geglu import GPT_OSS_MLP
from tests.parallel.test_expert_parallel import MOE
from tests.parity import TRAINING, assert_matches_reference, train_job
from threefold.model.moe.router import _GatingLinear

GPT_OSS = [flag for flag in GPT_OSS_MLP if flag != "--disable-bias-linear"] + [
    "--softmax-type",
    "learnable",
    "--window-size",
    "3,0",
    "--window-attn-skip-freq",
    "2",
]


def test_the_router_in_fp32_adds_its_bias_as_a_linear_layer_does():
    """--moe-router-dtype's gating (logits and gradients in fp32 from bf16 operands) with a
    bias: F.linear's logits and gradients in fp32, the bias's gradient in its own dtype."""
    torch.manual_seed(0)
    tokens, weight = torch.randn(6, 8), torch.randn(4, 8)
    bias = torch.randn(4)
    operands = [t.to(torch.bfloat16).requires_grad_() for t in (tokens, weight, bias)]
    logits = _GatingLinear.apply(*operands, torch.float32)
    grad = torch.randn(6, 4)
    logits.backward(grad)
    exact = [t.to(torch.bfloat16).float().requires_grad_() for t in (tokens, weight, bias)]
    expected = F.linear(*exact)
    expected.backward(grad)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)
    for ours, theirs in zip(operands, exact):
        assert ours.grad.dtype == torch.bfloat16
        torch.testing.assert_close(ours.grad, theirs.grad.to(torch.bfloat16))


@pytest.mark.parametrize(
    "world,flags",
    [
        (
            4,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--expert-model-parallel-size", "2"],
        ),
        (2, ["--pipeline-model-parallel-size", "2", "--moe-router-dtype", "fp32"]),
    ],
    ids=["tp2-sp-ep2", "pp2-router-fp32"],
)
def test_gpt_oss_trains_as_one_process(world, flags):
    argv = GPT_OSS + TRAINING + MOE
    router_dtype = [f for f in flags if f in ("--moe-router-dtype", "fp32")]
    reference = train_job(argv + router_dtype, 4)
    biases = [name for name in reference["params"] if name.endswith("mlp.router.bias")]
    assert len(biases) == 2  # (one per layer, trained)
    assert_matches_reference(run_distributed(world, train_job, argv + flags, 4), reference, 1e-5)
