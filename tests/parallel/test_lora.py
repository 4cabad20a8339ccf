"""LoRA adapters under tensor parallelism: which adapter gradients are summed over which group.

A dense layer's replicated factor (a column-parallel layer's A, a row-parallel layer's B) has
on each TP rank only that rank's share of its gradient: it is summed over TP. An expert's
adapter is split over the expert-TP group as the expert is, on the one rank that holds the
expert, its gradient reduced over expert DP like the expert's; its replicated factor is summed
over expert TP, and a whole one (expert TP 1) over nothing. Summing that one over TP as well
counted it twice (Megatron's buffers: relative error 5.8e-4 after three steps, Adam hiding
most of the factor of two; FSDP2: 0.14)."""

import pytest

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"]
LORA = ["--lora-rank", "4", "--lr", "3e-2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ETP1 = ["--expert-tensor-parallel-size", "1"]


@pytest.mark.parametrize("strategy", [[], ["--use-torch-fsdp2"]], ids=["megatron", "fsdp2"])
def test_expert_adapters_are_not_summed_over_tp(strategy):
    argv = LLAMA_STYLE + TRAINING + MOE + LORA
    reference = train_job(argv, 3)
    assert any(".local_experts." in n and ".adapter." in n for n in reference["params"])
    results = run_distributed(2, train_job, argv + TP2_SP + ETP1 + strategy, 3)
    assert_matches_reference(results, reference, 1e-5)


EXPERT_TP2 = {
    "tp2-sp": (2, TP2_SP),  # expert TP 2 on the TP ranks (ETP's default is TP)
    "etp2-over-dp": (2, ["--expert-tensor-parallel-size", "2"]),  # TP 1: expert TP spans DP
    "tp2-sp-ep2": (4, TP2_SP + ["--expert-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("strategy", [[], ["--use-torch-fsdp2"]], ids=["megatron", "fsdp2"])
@pytest.mark.parametrize("layout", EXPERT_TP2)
def test_expert_adapters_split_over_expert_tp_train_as_one_process(strategy, layout):
    """Adapters on experts split over expert TP 2 (fc1's [gate; up] blocks split separately):
    three steps as one process. Over DP, without the sum over expert TP, the replicated factors
    of the adapters would each hold one rank's share of their gradient."""
    world_size, flags = EXPERT_TP2[layout]
    argv = LLAMA_STYLE + TRAINING + MOE + LORA
    reference = train_job(argv, 3)
    results = run_distributed(world_size, train_job, argv + flags + strategy, 3)
    assert_matches_reference(results, reference, 1e-5)
