"""Megatron-LM flags parse into configs; mistakes fail fast with one line naming the flag."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import CLI_MODEL
from threefold.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = CLI_MODEL[:]


def test_megatron_flags_fill_the_configs():
    config = parse_args(
        BASE
        + [
            "--swiglu",
            "--disable-bias-linear",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--global-batch-size",
            "16",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        world_size=4,
    )
    assert config.model.ffn_hidden_size == 128  # Megatron: int(4h * 2/3 / 64) * 64
    assert config.model.add_bias_linear is False
    assert config.model.num_query_groups == 2
    assert config.parallel.data_parallel_size == 2
    assert config.training.num_micro_batches(2) == 4
    assert config.model.max_position_embeddings == 32


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "argv,expected",
    [
        (BASE + ["--no-such-flag", "1"], "--no-such-flag"),
        (BASE + ["--global-batch-size", "5"], "--global-batch-size 5"),
    ],
)
def test_command_line_mistakes_exit_2_fast_naming_the_flag(argv, expected):
    start = time.time()
    result = _cli(*argv)
    assert result.returncode == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) > 0
    assert time.time() - start < 10


@pytest.mark.parametrize(
    "extra,world_size,expected",
    [
        (
            ["--tensor-model-parallel-size", "3"],
            3,
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3",
        ),
        (
            [
                "--group-query-attention",
                "--num-query-groups",
                "1",
                "--tensor-model-parallel-size",
                "2",
            ],
            2,
            "--num-query-groups 1",
        ),
        (["--tensor-model-parallel-size", "2"], 3, "world size 3"),
        (["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
        (["--use-rope-scaling"], 1, "--use-rope-scaling needs --position-embedding-type rope"),
        (["--rotary-interleaved"], 1, "--rotary-interleaved needs --position-embedding-type rope"),
        (
            ["--squared-relu", "--swiglu"],
            1,
            "--squared-relu is the MLP's activation: drop --swiglu",
        ),
        (["--rotary-percent", "0.5"], 1, "--rotary-percent needs --position-embedding-type rope"),
        (
            ["--position-embedding-type", "rope", "--rotary-percent", "0.01"],
            1,
            "RoPE needs an even number of them, more than 0",
        ),
        (
            ["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
            1,
            "--rotary-percent 1.5: the share of each head RoPE turns, above 0 and at most 1",
        ),
        (["--max-position-embeddings", "16"], 1, "--max-position-embeddings 16"),
        (
            ["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"],
            4,
            "--ffn-hidden-size 30",
        ),
        (["--data-path", "x"], 1, "--data-path"),
        (["--lr", "1e-4", "--min-lr", "1e-3"], 1, "--min-lr"),
        (
            ["--pipeline-model-parallel-size", "4", "--num-layers", "6"],
            4,
            "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "6",
            ],
            2,
            "--virtual-pipeline-model-parallel-size 2",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-layers",
                "4",
                "--global-batch-size",
                "6",
            ],
            2,
            "multiple of --pipeline-model-parallel-size 2",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"],
            2,
            "--decoder-first/last-pipeline-num-layers",
        ),
        (["--overlap-param-gather"], 2, "--overlap-param-gather"),
        (
            ["--distributed-strategy", "fsdp", "--ddp-average-in-collective"],
            2,
            "--ddp-average-in-collective belongs to --distributed-strategy megatron",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
            1,
            "--recompute-method and --recompute-num-layers",
        ),
        (
            ["--microbatch-group-size-per-virtual-pipeline-stage", "2"],
            1,
            "shapes the interleaved schedule: add virtual pipeline stages or drop it",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size"]
            + ["2", "--num-layers", "4", "--global-batch-size", "8"]
            + ["--microbatch-group-size-per-virtual-pipeline-stage", "3"],
            2,
            "must be between --pipeline-model-parallel-size 2 and the micro-batches (4 = global "
            "batch size 8 / (--micro-batch-size x DP)), and leave a last group of 0 or at least 2",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split"],
            2,
            "--num-layers 2 plus the 1 layer(s) the embedding and loss count for do not split "
            "evenly over 2 model chunks",
        ),
        (
            ["--longrope-short-factor", "1", "2"],
            1,
            "--longrope-short-factor belong to --position-embedding-type longrope",
        ),
        (
            ["--position-embedding-type", "longrope", "--longrope-short-factor", "1"],
            1,
            "--position-embedding-type longrope takes --longrope-short-factor, "
            "--longrope-long-factor and --longrope-original-max-position-embeddings",
        ),
        (
            ["--position-embedding-type", "longrope", "--longrope-original-max-position-embeddings"]
            + ["16", "--longrope-short-factor", *"11111111", "--longrope-long-factor", "2", "0"],
            1,
            "--longrope-long-factor holds 2 factors; RoPE turns 8 pairs",
        ),
        (
            ["--parallel-attention-mlp-shared-norm"],
            1,
            "shares the attention's input norm with the MLP: add --parallel-attention-mlp",
        ),
        (
            ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
            + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
            1,
            "--recompute-modules layernorm frees the attention's norm output",
        ),
        (
            ["--normalization", "RMSNorm", "--no-layernorm-bias"],
            1,
            "--no-layernorm-bias drops LayerNorm's bias; RMSNorm has none",
        ),
        (
            ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
            + ["--fine-grained-activation-offloading", "--offload-modules", "mlp_norm"],
            1,
            "with --parallel-attention-mlp-shared-norm the MLP has none",
        ),
        (["--logit-scale", "0"], 1, "--logit-scale 0.0 must be positive"),
        (["--residual-multiplier", "-1"], 1, "--residual-multiplier -1.0 must be positive"),
        (["--no-save-optim"], 1, "--no-save-optim needs --save DIR"),
        (["--no-save-rng"], 1, "--no-save-rng needs --save DIR"),
        (
            ["--save", "run", "--save-interval", "2", "--save-retain-interval", "3"],
            1,
            "--save-retain-interval 3 must be a positive multiple of --save-interval 2",
        ),
    ],
)
def test_layout_mistakes_are_reported(capsys, extra, world_size, expected):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra, world_size=world_size)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_sequence_parallel_without_tensor_parallel_warns_and_disables(capsys):
    config = parse_args(BASE + ["--sequence-parallel"], world_size=1)
    assert config.parallel.sequence_parallel is False
    assert "--sequence-parallel has no effect" in capsys.readouterr().out


def test_query_groups_without_group_query_attention_are_said_to_differ_from_megatron(capsys):
    """Megatron-LM reads --num-query-groups only with --group-query-attention; threefold builds
    the groups either way, and says so where the two differ."""
    config = parse_args(BASE + ["--num-query-groups", "2"], world_size=1)
    assert config.model.num_query_groups == 2
    assert (
        "WARNING: --num-query-groups 2 without --group-query-attention" in capsys.readouterr().out
    )
    parse_args(BASE + ["--group-query-attention", "--num-query-groups", "2"], world_size=1)
    assert "--num-query-groups" not in capsys.readouterr().out


def test_what_not_to_load_without_load_warns(capsys):
    """Megatron-LM's GPT-OSS example passes --no-load-optim --no-load-rng without --load, and
    Megatron-LM runs it: a warning, not a refusal (--finetune without --load is refused)."""
    config = parse_args(BASE + ["--no-load-optim", "--no-load-rng"], world_size=1)
    out = capsys.readouterr().out
    for flag in ("--no-load-optim", "--no-load-rng"):
        assert f"WARNING: {flag} has no effect without --load: nothing is loaded" in out
    assert config.checkpoint.no_load_optim and config.checkpoint.load is None


def test_a_save_interval_without_save_warns_and_saves_nothing(capsys, tmp_path):
    """As Megatron-LM, whose DeepSeek-proxy configs comment out --save and keep the interval."""
    from threefold.training.checkpointer import Checkpointer

    config = parse_args(BASE + ["--save-interval", "2"], world_size=1)
    assert "WARNING: --save-interval 2 without --save: no checkpoint" in capsys.readouterr().out
    assert not Checkpointer(config.checkpoint, None, None).due(2)
    with_save = parse_args(BASE + ["--save-interval", "2", "--save", str(tmp_path)], world_size=1)
    assert Checkpointer(with_save.checkpoint, None, None).due(2)


def test_a_mistyped_flag_gets_one_line_naming_the_nearest_flag():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--num-layer", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: unrecognized arguments: --num-layer 2; did you mean "
        "--num-layers? (--help lists every flag)"
    ]


def test_every_flag_says_what_it_does_and_its_default():
    from threefold.arguments import build_parser

    actions = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 150
    assert [a.option_strings[0] for a in actions if not (a.help or "").strip()] == []
    text = build_parser().format_help()
    assert "--lr LR" in text and "peak learning rate (default: 0.0003)" in " ".join(text.split())


def test_a_rope_sequence_longer_than_the_recorded_context_is_said(capsys):
    parse_args(
        ["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope"]
        + ["--seq-length", "512", "--max-position-embeddings", "256"]
    )
    assert "WARNING: --seq-length 512 exceeds --max-position-embeddings 256" in (
        capsys.readouterr().out
    )
    parse_args(["--mock-data", "--vocab-size", "100", "--position-embedding-type", "rope"])
    assert "WARNING" not in capsys.readouterr().out


def test_every_float_flag_refuses_nan_and_infinity():
    """Taken, they came back after start-up as a loss gone NaN or a traceback
    (--moe-expert-capacity-factor inf, --distributed-timeout-minutes inf, --fp8-margin)."""
    import argparse
    import dataclasses

    from threefold.arguments import _SECTIONS, build_parser
    from threefold.config import Config

    floats = {
        f"{concern}.{field.name}"
        for concern in _SECTIONS
        for field in dataclasses.fields(getattr(Config(), concern))
        if "float" in field.type and field.metadata.get("cli", True)
    }
    # (--lr-warmup-iters, a float field, parses an int)
    actions = [a for a in build_parser()._actions if a.dest in floats and a.type is not int]
    assert len(actions) > 60 and "--longrope-short-factor" in {a.option_strings[0] for a in actions}
    for action in actions:
        assert action.type("0.5") == 0.5
        for text in ("nan", "inf", "-inf", "1e400"):
            with pytest.raises(argparse.ArgumentTypeError, match=f"finite number, not {text}"):
                action.type(text)
