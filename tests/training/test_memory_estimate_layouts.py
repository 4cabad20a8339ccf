"""The memory estimate against what real gloo ranks hold, layout by layout: each rank checks
its own stage and shard (tests/training/test_memory_estimate.py holds the one-process cases
and the helpers)."""

import pytest

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from tests.training.test_memory_estimate import (
    DSA,
    FP8,
    GDN,
    LEARNS,
    MAMBA,
    MLA,
    MOE,
    SINKS,
    WIDE,
    _assert_within_10_percent,
    _measure_and_estimate,
)
from threefold.training.memory import measure_bytes_per_parameter
from threefold.training.memory_estimate import estimate_stage


@pytest.mark.parametrize(
    "world_size,flags",
    [
        (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (2, ["--pipeline-model-parallel-size", "2"]),
        (4, ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--bf16"]),
        (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
        (4, ["--context-parallel-size", "4", "--cp-comm-type", "allgather"]),
        (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--bf16"]),
        (
            4,
            ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
            + ["--sequence-parallel", "--recompute-granularity", "selective"],
        ),
        (
            4,
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"]
            + ["--hierarchical-context-parallel-sizes", "2", "2"],
        ),
        # a column-parallel linear keeps its own gathered copy of a recomputed norm's output
        (
            2,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]
            + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"],
        ),
        (2, MOE + ["--expert-model-parallel-size", "2", "--moe-layer-freq", "2"]),
        (4, MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
        # latent experts: the projections whole on each TP rank, the tokens moved at their width
        (
            4,
            MOE
            + ["--moe-latent-size", "48", "--tensor-model-parallel-size", "2"]
            + ["--sequence-parallel", "--expert-model-parallel-size", "2"],
        ),
        (
            4,
            FP8
            + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--use-distributed-optimizer", "--fp8-param-gather"],
        ),
        (2, FP8 + ["--pipeline-model-parallel-size", "2"]),
        # the last stage's MTP depth and its copy of the embedding
        (2, ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1"]),
        (2, FP8 + ["--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1"]),
        # sinks over CP: Ulysses's whole sequence for its heads, the ring's blocks
        (2, SINKS + ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--bf16"]),
        (2, SINKS + ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
        # the gated delta nets' exchange over CP: the whole sequence for 1/(TP x CP) of the heads
        (
            4,
            GDN
            + [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--context-parallel-size",
                "2",
            ],
        ),
        # the Mamba layers' exchange over CP beside the attention's ring, and their TP split
        (
            4,
            MAMBA
            + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--context-parallel-size", "2"],
        ),
    ],
    ids=[
        "tp2-sp",
        "pp2",
        "tp2-dp2-distributed-optimizer-bf16",
        "cp2-p2p",
        "cp4-allgather",
        "cp2-a2a-bf16",
        "tp2-sp-cp2-selective",
        "cp4-a2a+p2p",
        "tp2-sp-bf16-recompute-layernorm-mlp",
        "moe-ep2-every-other-layer",
        "moe-ep2-dp2-distributed-optimizer",
        "moe-latent-tp2-sp-ep2",
        "fp8-tp2-sp-dp2-param-gather",
        "fp8-pp2",
        "mtp-pp2",
        "fp8-mtp-pp2",
        "sinks-cp2-a2a-bf16",
        "sinks-cp2-p2p",
        "gated-delta-net-tp2-sp-cp2",
        "hybrid-tp2-sp-cp2",
    ],
)
def test_parallel_layouts(world_size, flags):
    # Each rank checks its own stage and shard.
    _assert_within_10_percent(
        run_distributed(world_size, _measure_and_estimate, LLAMA_STYLE + WIDE + TRAINING + flags)
    )


@pytest.mark.parametrize(
    "flags",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + DSA + LEARNS,
    ],
    ids=["tp2-sp", "cp2-allgather", "dsa-tp2-sp"],
)
def test_mla_parallel_layouts(flags):
    """Multi-latent attention's whole down projections and norms beside its split up
    projections (under sequence parallelism a slice of the sequence each), the gathered
    keys and values of --cp-comm-type allgather at the padded head size, and DSA's whole
    indexer on the gathered sequence."""
    _assert_within_10_percent(
        run_distributed(2, _measure_and_estimate, MLA + WIDE + TRAINING + flags)
    )


def _static_bytes(argv: list[str]) -> tuple[float, float]:
    """(measured, estimated) bytes of this rank's parameters, gradients and optimizer state."""
    trainer = _setup(argv)
    named = trainer.layout_independent_parameters()
    measured = measure_bytes_per_parameter(named, trainer.data_parallel)
    estimate = estimate_stage(trainer.config, trainer.parallel.pp.rank)
    return measured.total * sum(p.numel() for _, p in named), estimate.static


def test_fsdp_shards_the_experts_over_expert_data_parallel_as_estimated():
    """FSDP2 with experts: the experts' state shards over expert DP (2 here), the rest over
    DP x CP (4); the estimate counts each over its own ranks."""
    flags = MOE + ["--expert-model-parallel-size", "2", "--distributed-strategy", "fsdp"]
    results = run_distributed(4, _static_bytes, LLAMA_STYLE + WIDE + TRAINING + flags)
    for measured, estimated in results:
        assert abs(estimated - measured) <= 0.02 * measured, (measured, estimated)
