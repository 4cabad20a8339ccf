"""GPT-OSS's MLP (--quick-geglu, --glu-linear-offset, --activation-func-clamp-value): the GLU
megatron-core computes, in dense MLPs and experts, at TP2+SP and EP2 as one process, and its
mistakes in one line. megatron-core's logits of such a model:
tests/tools/test_megatron_checkpoints.py."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.model.mlp import GLU

# (no --swiglu: LLaMA's MLP becomes GPT-OSS's; a clamp these small activations reach)
GPT_OSS_MLP = [flag for flag in LLAMA_STYLE if flag != "--swiglu"] + [
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "0.5",
]


def test_the_glu_is_megatron_cores():
    from megatron.core.fusions.fused_bias_geglu import quick_geglu

    gate, up = torch.randn(2, 5, 8, dtype=torch.float64).unbind(0)
    glu = GLU(quick=True, offset=1.0)
    torch.testing.assert_close(glu(gate, up), quick_geglu(torch.cat([gate, up], -1), 1.0))
    clamped = GLU(quick=True, offset=1.0, clamp=0.5)(gate, up)
    expected = quick_geglu(torch.cat([gate.clamp(max=0.5), up.clamp(-0.5, 0.5)], -1), 1.0)
    torch.testing.assert_close(clamped, expected)
    assert not torch.allclose(clamped, glu(gate, up))  # (the clamp bites)


@pytest.mark.parametrize(
    "world,flags,moe",
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], False),
        (2, ["--expert-model-parallel-size", "2"], True),
    ],
    ids=["tp2-sp", "ep2-experts"],
)
def test_gpt_oss_mlps_train_as_one_process(world, flags, moe):
    argv = GPT_OSS_MLP + TRAINING + (MOE if moe else [])
    reference = train_job(argv, 4)
    assert_matches_reference(run_distributed(world, train_job, argv + flags, 4), reference, 1e-5)


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--quick-geglu", "--swiglu"], "--quick-geglu is the MLP's activation"),
        (["--glu-linear-offset", "1.0"], "shape a GLU MLP: add --quick-geglu, --swiglu or --geglu"),
        (
            ["--quick-geglu", "--activation-func-clamp-value", "0"],
            "--activation-func-clamp-value 0.0 must be > 0",
        ),
    ],
    ids=["with-swiglu", "offset-without-glu", "clamp-zero"],
)
def test_gpt_oss_mlp_mistakes_are_one_line(capsys, flags, said):
    argv = [flag for flag in LLAMA_STYLE if flag != "--swiglu"] + TRAINING + flags
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err
