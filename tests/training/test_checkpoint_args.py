"""--use-checkpoint-args, as in Megatron-LM: the model's architecture, sequence length and
tokenizer come from the --load checkpoint, so resuming or evaluating needs only the training
flags; what the command line gives itself wins; a checkpoint that is not there is an error,
except a run's first start on its own --save directory."""

import dataclasses

import pytest

from tests.parity import LLAMA_STYLE, TRAINING, _setup, train_job
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.save import save_checkpoint

# A model far from the defaults in every field --use-checkpoint-args takes.
VARIANT = LLAMA_STYLE + [
    "--qk-layernorm",
    "--apply-layernorm-1p",
    "--no-position-embedding",
    "--rotary-base",
    "500000",
    "--norm-epsilon",
    "1e-6",
    "--kv-channels",
    "8",
    "--max-position-embeddings",
    "64",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    trainer = _setup(VARIANT + TRAINING + ["--save", directory])
    for _ in range(3):
        trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    return directory, trainer.config


def test_training_flags_alone_resume_the_checkpointed_model(checkpoint, capsys):
    directory, saved = checkpoint
    resumed = _setup(TRAINING + ["--load", directory, "--use-checkpoint-args"])
    assert f"> --use-checkpoint-args: model flags from {directory} (iteration 3): " in (
        capsys.readouterr().out
    )
    assert dataclasses.asdict(resumed.config.model) == dataclasses.asdict(saved.model)
    assert load_checkpoint(directory, resumed.checkpoint_components()) == 3
    straight = train_job(VARIANT + TRAINING, 5)["losses"]
    assert [resumed.train_step()[0] for _ in range(2)] == straight[3:]


def test_the_command_line_wins_over_the_checkpoint(checkpoint):
    directory, _ = checkpoint
    config = parse_args(
        TRAINING + ["--load", directory, "--use-checkpoint-args", "--seq-length", "8"]
    )
    assert config.model.seq_length == 8 and config.model.qk_layernorm


def test_a_first_start_on_its_own_save_directory_keeps_the_command_line(tmp_path, capsys):
    directory = str(tmp_path / "run")
    config = parse_args(
        LLAMA_STYLE + TRAINING + ["--save", directory, "--load", directory, "--use-checkpoint-args"]
    )
    assert "no checkpoint in --load" in capsys.readouterr().out
    assert config.model.normalization == "RMSNorm"


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "--use-checkpoint-args needs --load DIR"),
        (["--load", "{empty}"], "--load {empty}: holds no complete checkpoint"),
    ],
)
def test_without_a_checkpoint_it_is_refused(tmp_path, capsys, flags, message):
    empty = str(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(TRAINING + [f.format(empty=empty) for f in flags] + ["--use-checkpoint-args"])
    assert exit_info.value.code == 2
    assert message.format(empty=empty) in capsys.readouterr().err
