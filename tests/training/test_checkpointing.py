"""Checkpoints resume exactly and the tracker only ever names complete checkpoints."""

import os

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    LLAMA_STYLE,
    TRAINING,
    _full,
    _setup,
    _without_key_bias,
    assert_close_dicts,
    train_job,
)
from threefold.checkpointing import TRACKER, load_checkpoint, save_checkpoint
from threefold.config import ConfigError

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # RNG state must resume too


def _resume_job(argv: list[str], directory: str) -> dict:
    straight = train_job(argv, 6)
    first = _setup(argv + ["--save", directory])
    for _ in range(3):
        first.train_step()
    save_checkpoint(directory, first)
    second = _setup(argv)
    assert load_checkpoint(directory, second) == 3
    resumed_losses = [second.train_step()[0] for _ in range(3)]
    params = _without_key_bias(_full(second), second)
    return {"straight": straight, "resumed_losses": resumed_losses, "resumed_params": params}


@pytest.mark.parametrize("world_size,layout", [
    (2, []), (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--pipeline-model-parallel-size", "2"]), (2, ["--use-distributed-optimizer", "--bf16"]),
    (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--ddp-bucket-size", "3000"]),
    (2, ["--distributed-strategy", "fsdp"])])
def test_save_and_resume_is_bitwise_identical(tmp_path, world_size, layout):
    argv = LLAMA_STYLE + TRAINING + DROPOUT + layout
    result = run_distributed(world_size, _resume_job, argv, str(tmp_path / "ckpt"))[0]
    assert result["resumed_losses"] == result["straight"]["losses"][3:]
    assert_close_dicts(result["resumed_params"], result["straight"]["params"], 0.0, "parameter")


def test_tracker_names_only_complete_checkpoints(tmp_path):
    directory = str(tmp_path)
    trainer = _setup(LLAMA_STYLE + TRAINING)
    trainer.train_step()
    save_checkpoint(directory, trainer)
    assert open(os.path.join(directory, TRACKER)).read().strip() == "1"
    # A later save that dies before finishing leaves a partial directory and the old tracker.
    os.makedirs(os.path.join(directory, "iter_0000002"))
    fresh = _setup(LLAMA_STYLE + TRAINING)
    assert load_checkpoint(directory, fresh) == 1
    assert fresh.state.iteration == 1


def test_loading_into_another_tensor_parallel_size_is_refused(tmp_path):
    directory = str(tmp_path)
    save_checkpoint(directory, _setup(LLAMA_STYLE + TRAINING))
    run_distributed(2, _load_expecting_error, LLAMA_STYLE + TRAINING +
                    ["--tensor-model-parallel-size", "2"], directory)


def _load_expecting_error(argv: list[str], directory: str) -> None:
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 1"):
        load_checkpoint(directory, _setup(argv))
