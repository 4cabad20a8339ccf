"""Every flag of Megatron-LM's command line (tests/data/megatron_flags.txt, from
bench/megatron_flags.py) is taken by threefold's parser or named in one line as a feature
threefold lacks: a Megatron-LM launch script never meets argparse's "unrecognized arguments"."""

import os

import pytest

from tests.conftest import CLI_MODEL, ROOT
from threefold import arguments, megatron_missing
from threefold.arguments import build_parser, parse_args
from threefold.parallel.flight_recorder import flight_recorder_environment
from threefold.training.logging import TensorBoardLogger

BASE = CLI_MODEL + "--train-iters 100".split()


def _megatron_flags() -> list[str]:
    with open(os.path.join(ROOT, "tests", "data", "megatron_flags.txt")) as f:
        return [line.strip() for line in f if line.startswith("--")]


def test_every_megatron_lm_flag_is_taken_or_named():
    flags = _megatron_flags()
    assert len(flags) > 800
    taken = {
        option
        for action in build_parser("pretrain_gpt.py")._actions
        for option in action.option_strings
    }
    unnamed = [f for f in flags if f not in taken and megatron_missing.missing_feature(f) is None]
    assert not unnamed, f"{len(unnamed)} Megatron-LM flags meet argparse's error: {unnamed}"


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--trust-remote-code"], "tokenizers that run code from their files"),
        (["--non-persistent-local-ckpt-dir", "/x"], "local checkpoints (NVIDIA Resiliency"),
        (["--no-dsa-indexer-scoring-relu"], "DSA indexers without the Hadamard rotation"),
    ],
    ids=["trust-remote-code", "prefix", "negated-prefix"],
)
def test_what_threefold_lacks_is_one_line(argv, named, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + argv)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


@pytest.mark.parametrize(
    "given,taken",
    [
        ([], True),
        (["--no-use-tokenizer-model-from-checkpoint-args"], False),
        (["--tokenizer-type", "GPT2BPETokenizer"], False),
    ],
)
def test_use_checkpoint_args_takes_the_tokenizer_unless_told_not_to(
    monkeypatch, tmp_path, given, taken
):
    asked = []

    def flags_for(load, save, with_tokenizer, pretrained=None):
        asked.append(with_tokenizer)
        return [], "model flags from the checkpoint"

    monkeypatch.setattr(arguments, "flags_for_use_checkpoint_args", flags_for)
    parse_args(BASE + ["--load", str(tmp_path), "--use-checkpoint-args", *given])
    assert asked == [taken]


def test_tensorboards_queue_size_is_the_writers(tmp_path):
    assert parse_args(BASE).logging.tensorboard_queue_size == 1000  # (Megatron-LM's default)
    config = parse_args(BASE + ["--tensorboard-queue-size", "7"])
    logger = TensorBoardLogger(str(tmp_path), config.logging.tensorboard_queue_size)
    assert logger.writer.max_queue == 7
    logger.close()


@pytest.mark.parametrize(
    "flags,expected_std",
    [([], 0.02), (["--embedding-init-method-std", "0.5"], 0.5)],
    ids=["as-the-layers", "its-own"],
)
def test_the_embeddings_initialization(flags, expected_std):
    from tests.parity import _setup

    trainer = _setup(BASE + ["--global-batch-size", "2", *flags])
    # (the rows that pad the vocabulary to a multiple of 128 are zeros)
    embedding = trainer.model_chunks[0].embedding.word_embeddings.weight[
        : trainer.config.model.vocab_size
    ]
    layer = trainer.model_chunks[0].decoder.layers[0].mlp.linear_fc1.weight
    assert embedding.std().item() == pytest.approx(expected_std, rel=0.05)
    assert layer.std().item() == pytest.approx(0.02, rel=0.05)  # (the layers' stays)


def test_the_flight_recorders_environment_is_megatron_lms(tmp_path):
    """Set only with a dump path (a directory: a file per rank in it); a variable the
    environment sets already is kept."""
    assert flight_recorder_environment(parse_args(BASE).parallel, {}) == []
    flags = ["--flight-recorder-dump-path", str(tmp_path), "--flight-recorder-trace-buffer-size"]
    flags += ["500", "--disable-flight-recorder-dump-on-timeout"]
    environ = {"TORCH_INCLUDE_STACK_TRACE": "1"}
    lines = flight_recorder_environment(parse_args(BASE + flags).parallel, environ)
    assert environ == {
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "_dump_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "_dump_"),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_INCLUDE_STACK_TRACE": "1",
        "TORCH_INCLUDE_ONLY_ACTIVE": "1",
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "1",
    }
    assert lines[1:] == [
        "> flight recorder: TORCH_INCLUDE_STACK_TRACE kept as the environment sets it"
    ]
    # a path the environment gives brings the flags' defaults with it
    environ = {"TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr"}
    flight_recorder_environment(parse_args(BASE).parallel, environ)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/tmp/fr"


def test_a_tensorboard_directory_that_cannot_be_made_is_one_line():
    """(procfs passes the check before start-up, even for root, and refuses the directory)"""
    from threefold.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--tensorboard-dir /proc/threefold/tb: cannot write"):
        TensorBoardLogger("/proc/threefold/tb")
