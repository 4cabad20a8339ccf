"""The generation and scoring tools' own flags, apart from threefold.inference so that a tool
answers --help or a mistyped flag before it imports torch (in a tenth of a second, where
importing torch takes three)."""

from __future__ import annotations

import argparse

from threefold.arguments import positive
from threefold.config.checkpoint import DIST_CKPT_STRICTNESS

TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file")


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """The tools' layout: pipeline stages (Megatron's flag), the other ranks tensor-parallel."""
    group = parser.add_argument_group("layout (of the launched processes)")
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=positive(int),
        default=1,
        help="pipeline stages (default 1); the launched processes / stages are TP ranks",
    )
    group.add_argument(
        "--tensor-model-parallel-size",
        type=positive(int),
        help="TP ranks per stage (default: launched processes / pipeline stages)",
    )
    add_strictness_flag(parser)


def add_strictness_flag(parser: argparse.ArgumentParser) -> None:
    """What a Megatron-LM checkpoint's tensors no parameter takes do, as pretrain_gpt.py's
    --dist-ckpt-strictness (refused by default)."""
    parser.add_argument(
        "--dist-ckpt-strictness",
        choices=DIST_CKPT_STRICTNESS,
        default="raise_unexpected",
        help="a Megatron-LM checkpoint's tensors the model has no parameter for: refuse them "
        "(raise_*, the default), name them and go on (log_*, return_*), or do not look",
    )


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    """The tools' own tokenizer flags: by default the checkpoint's tokenizer is used; a
    Megatron-LM checkpoint names files on the machine that trained it, these name local ones."""
    group = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    for flag in TOKENIZER_FLAGS:
        group.add_argument(flag, help=f"instead of the checkpoint's {flag.removeprefix('--')}")


def tokenizer_files(args: argparse.Namespace) -> dict:
    """{DataConfig field: value} of the tokenizer flags given."""
    names = [flag.removeprefix("--").replace("-", "_") for flag in TOKENIZER_FLAGS]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
