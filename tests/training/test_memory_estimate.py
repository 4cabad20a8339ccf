"""tools/estimate_memory.py's predictions match what real (CPU) runs hold."""

import os
import subprocess
import sys

import pytest

from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, LLAMA_STYLE, TRAINING, _setup
from threefold.training.memory import measure_activation_bytes, measure_bytes_per_parameter
from threefold.training.memory_estimate import estimate_stage, micro_batch_activation_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2"]
MOE += ["--moe-shared-expert-intermediate-size", "64"]
# Wider than the parity models so the layers, not the logits, dominate the activations.
WIDE = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "32"]


def _measure_and_estimate(argv: list[str]) -> dict:
    trainer = _setup(argv)
    stage = trainer.parallel.pp.rank
    named = trainer.layout_independent_parameters()
    count = sum(p.numel() for _, p in named)
    estimate = estimate_stage(trainer.config, stage)
    measured = measure_bytes_per_parameter(named, trainer.data_parallel)
    batch = next(trainer.train_iterator())
    activations = measure_activation_bytes(
        trainer.model_chunks,
        batch,
        trainer.pipeline_options["tensor_shape"],
        trainer.pipeline_options["dtype"],
    )
    return {
        "static": (measured.total * count, estimate.static),
        "activations": (activations, micro_batch_activation_bytes(trainer.config, stage)),
    }


def _assert_within_10_percent(results: list[dict]) -> None:
    for result in results:
        for what, (measured, estimated) in result.items():
            assert abs(estimated - measured) <= 0.1 * measured, (what, measured, estimated)


@pytest.mark.parametrize(
    "flags",
    [
        LLAMA_STYLE + WIDE,
        LLAMA_STYLE + WIDE + ["--bf16", "--recompute-granularity", "selective"],
        GPT2_STYLE
        + WIDE
        + [
            "--max-position-embeddings",
            "32",
            "--hidden-dropout",
            "0.1",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
        LLAMA_STYLE + WIDE + MOE,
    ],
    ids=["llama", "llama-bf16-selective", "gpt2-dropout-full-block", "llama-moe"],
)
def test_single_process(flags):
    _assert_within_10_percent([_measure_and_estimate(flags + TRAINING)])


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
        (2, MOE + ["--expert-model-parallel-size", "2", "--moe-layer-freq", "2"]),
        (4, MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]),
    ],
    ids=[
        "tp2-sp",
        "pp2",
        "tp2-dp2-distributed-optimizer-bf16",
        "cp2-p2p",
        "cp4-allgather",
        "cp2-a2a-bf16",
        "tp2-sp-cp2-selective",
        "moe-ep2-every-other-layer",
        "moe-ep2-dp2-distributed-optimizer",
    ],
)
def test_parallel_layouts(world_size, flags):
    # Each rank checks its own stage and shard.
    _assert_within_10_percent(
        run_distributed(world_size, _measure_and_estimate, LLAMA_STYLE + WIDE + TRAINING + flags)
    )


def test_cli_prints_every_stage():
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "estimate_memory.py"),
            "--world-size",
            "8",
            "--gpu-memory-gib",
            "80",
            *LLAMA_STYLE,
            "--vocab-size",
            "32000",
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "TP=2 PP=2 DP=2" in result.stdout
    assert result.stdout.count(" fits") == 2  # one line per pipeline stage
