"""Megatron-LM's own functional-test configs run on CPU gloo ranks at their layouts: each
trains two iterations, or stops in one line naming the feature threefold lacks.

The flag sets are in tests/data/megatron_configs.yaml; bench/megatron_configs.py makes them
runnable on a CPU (mock data, gloo, local layers, a tiny model: everything else as given) and
surveys all of Megatron-LM's configs (bench/results/megatron_configs.md).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys

import pytest
import yaml

from tests.distributed import run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import megatron_configs  # noqa: E402

with open(os.path.join(os.path.dirname(__file__), "data", "megatron_configs.yaml")) as f:
    CONFIGS = yaml.safe_load(f)
TRAINS = [name for name, config in CONFIGS.items() if config["outcome"] == "trains"]
REFUSED = [name for name, config in CONFIGS.items() if config["outcome"] != "trains"]


def _train(argv: list[str]) -> list[float] | None:
    """Two iterations of the config on this rank; the last rank's losses."""
    from tests.parity import _setup

    trainer = _setup(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        losses = [trainer.train_step()[0] for _ in range(2)]
    return losses if trainer.parallel.world.rank == trainer.parallel.world.size - 1 else None


def _smaller_batches(argv: list[str], micro_batch_size: int = 4) -> list[str]:
    """Micro-batches of at most `micro_batch_size` samples, as many of them as before: the
    global batch shrinks by the same factor (the DeepSeek proxy's 256 in micro-batches of 32
    would take minutes a step on 2 cores; every layout and schedule stays as it was)."""
    argv = list(argv)
    micro, batch = argv.index("--micro-batch-size") + 1, argv.index("--global-batch-size") + 1
    factor = int(argv[micro]) // micro_batch_size
    if factor > 1 and int(argv[micro]) % micro_batch_size == int(argv[batch]) % factor == 0:
        argv[micro] = str(micro_batch_size)
        argv[batch] = str(int(argv[batch]) // factor)
    return argv


def _in_process_loading(argv: list[str]) -> list[str]:
    """--num-workers 0: the test's ranks are daemon processes, which may not start the data
    loader's worker processes (a launched run's ranks start them as the config asks)."""
    if "--num-workers" in argv:
        argv = list(argv)
        argv[argv.index("--num-workers") + 1] = "0"
    return argv


@pytest.mark.parametrize("name", TRAINS)
def test_config_trains_at_its_layout(name, tmp_path):
    argv = megatron_configs.command_line(CONFIGS[name]["MODEL_ARGS"], str(tmp_path))
    kind, message = megatron_configs.outcome(argv)
    assert kind == "parses", message
    argv = _in_process_loading(_smaller_batches(argv))
    losses = run_distributed(megatron_configs.world_size(argv), _train, argv)[-1]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(1024), rel=0.05)  # a fresh model's loss


@pytest.mark.parametrize("name", REFUSED)
def test_config_of_a_missing_feature_stops_in_one_line_naming_it(name, tmp_path):
    argv = megatron_configs.command_line(CONFIGS[name]["MODEL_ARGS"], str(tmp_path))
    kind, message = megatron_configs.outcome(argv)
    assert kind == "refused" and "\n" not in message
    assert CONFIGS[name]["outcome"] in message


def test_megatrons_gpt3_and_llama3_examples_as_their_flags_are_today(tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh (its batch-size schedule, beside the
    --global-batch-size it ends at) and examples/llama/train_llama3_8b_h100_fp8.sh's FP8
    recipe parse, FP8 parameter all-gathers with its distributed optimizer included, as their
    flags are today."""
    schedule = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    gpt3 = (
        "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
        "--max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 "
        "--global-batch-size 1536 --step-batch-size-schedule SCHEDULE --train-iters 500000 "
        "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
        "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 "
        "--lr-warmup-fraction .001 --lr-decay-iters 430000 --split 949,50,1 --log-interval 100 "
        "--save-interval 10000 --eval-interval 1000 --eval-iters 10 --mock-data --vocab-size 1024"
    ).split() + ["--save", str(tmp_path), "--load", str(tmp_path)]
    gpt3[gpt3.index("SCHEDULE")] = schedule
    kind, message = megatron_configs.outcome(gpt3)
    assert kind == "parses", message
    llama3 = CONFIGS["gpt/gpt3_mcore_te_tp1_pp1_uniform_full_recompute"]["MODEL_ARGS"] | {
        "--fp8-format": "hybrid",
        "--fp8-amax-history-len": 1024,
        "--fp8-amax-compute-algo": "max",
    }
    kind, message = megatron_configs.outcome(megatron_configs.command_line(llama3, str(tmp_path)))
    assert kind == "parses", message
    # the recipe also asks for FP8 parameter all-gathers, which need the distributed optimizer
    with_param_gather = megatron_configs.command_line(llama3, str(tmp_path)) + [
        "--fp8-param-gather"
    ]
    kind, message = megatron_configs.outcome(with_param_gather)
    assert kind == "refused" and message.startswith("--fp8-param-gather casts"), message
    kind, message = megatron_configs.outcome(with_param_gather + ["--use-distributed-optimizer"])
    assert kind == "parses", message
    # or Megatron-LM's PyTorch FSDP2, whose shards are then all-gathered in FP8
    kind, message = megatron_configs.outcome(with_param_gather + ["--use-torch-fsdp2"])
    assert kind == "parses", message
