"""What the text tools (tools/generate.py, tools/score.py, on threefold/inference.py) refuse,
each in one line and exit code 2: flags and files before torch is imported, then a checkpoint
without a tokenizer and a text of no tokens. Their sampling and scoring are proven against
transformers in tests/tools/test_convert_checkpoint.py."""

import argparse
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from tests.distributed import free_port
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError
from threefold.inference import load_for_text
from threefold.inference_flags import add_strictness_flag, add_tokenizer_flags


@pytest.fixture(scope="module")
def mock_data_run(tmp_path_factory) -> str:
    """A checkpoint of a run on --mock-data: token ids alone, so no tokenizer saved with it."""
    root = str(tmp_path_factory.mktemp("mock_data_run"))
    argv = LLAMA_STYLE + TRAINING + ["--vocab-size", "1024"]
    save_checkpoint(root, _setup(argv).checkpoint_components())
    return root


def _tool(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", name), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_a_run_without_a_tokenizer_is_refused_naming_the_flags_to_give(mock_data_run):
    parser = argparse.ArgumentParser()
    parser.add_argument("--load")
    add_tokenizer_flags(parser)
    add_strictness_flag(parser)
    args = parser.parse_args(["--load", mock_data_run])
    with pytest.raises(ConfigError, match="the run had no tokenizer .* with --tokenizer-type"):
        load_for_text(args, torch.device("cpu"), None)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--max-new-tokens", "-3"], "--max-new-tokens -3: give 0 or more"),
        (["--temperature", "-1"], "--temperature -1.0: give 0 (greedy) or a positive number"),
        (["--temperature", "nan"], "--temperature nan: give 0 (greedy) or a positive number"),
        (
            ["--temperature", "1", "--top-p", "0"],
            "--top-p 0.0: give a probability above 0, at most 1 (1: every token)",
        ),
        (["--top-p", "0.9"], "--top-p 0.9 is for sampling: give a --temperature above 0 with it"),
    ],
)
def test_a_sampling_flag_no_sample_can_follow_is_refused_before_torch(flags, line):
    # (before: torch.multinomial's traceback once the model had loaded, or a silent greedy)
    result = _tool("generate.py", "--load", "unread", "--prompt", "ROMEO:", *flags)
    assert (result.returncode, result.stderr) == (2, f"generate.py: error: {line}\n")


def test_an_input_that_is_no_utf8_text_file_is_refused_before_torch(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("Roméo".encode("latin-1"))
    for name, line in (
        ("latin1.txt", "not UTF-8 text (byte 3: invalid continuation byte)"),
        ("missing.txt", "no such file or directory"),
        ("", "is a directory"),
    ):
        path = str(tmp_path / name)
        result = _tool("score.py", "--load", "unread", "--input", path)
        expected = f"score.py: error: --input {path}: {line}\n"
        assert (result.returncode, result.stderr) == (2, expected)


def test_a_text_of_no_tokens_is_refused_naming_its_flag(mock_data_run, shakespeare_data, tmp_path):
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer"]
    tokenizer += ["--tokenizer-model", shakespeare_data["TOKENIZER_MODEL"]]
    # On 2 ranks at TP2, each meets it: the line is said once (before: once per rank).
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun += ["--master_port", str(free_port())]
    prompt = ["--load", mock_data_run, "--prompt", "", *tokenizer]
    result = subprocess.run(
        [sys.executable, *torchrun, os.path.join(ROOT, "tools", "generate.py"), *prompt],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("generate.py")]
    assert lines == [
        "generate.py: error: --prompt '' is no tokens (this tokenizer starts a text with no "
        "beginning-of-sequence token): give some text to continue"
    ], result.stderr[-2000:]
    (tmp_path / "empty.txt").write_text("")
    empty = str(tmp_path / "empty.txt")
    result = _tool("score.py", "--load", mock_data_run, "--input", empty, *tokenizer)
    assert result.stderr == (
        f"score.py: error: --input {empty}: the text has fewer than 2 tokens; nothing to score\n"
    )
    assert result.returncode == 2


def test_tokenizer_files_the_checkpoints_tokenizer_does_not_read_are_refused_naming_them(
    shakespeare_data, tmp_path
):
    """--vocab-file alone replaces a SentencePiece checkpoint's files with GPT-2's: said as
    such, not as a --tokenizer-model the user never dropped."""
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer"]
    tokenizer += ["--tokenizer-model", shakespeare_data["TOKENIZER_MODEL"], "--vocab-size", "1024"]
    save_checkpoint(
        str(tmp_path), _setup(LLAMA_STYLE + TRAINING + tokenizer).checkpoint_components()
    )
    parser = argparse.ArgumentParser()
    parser.add_argument("--load")
    add_tokenizer_flags(parser)
    add_strictness_flag(parser)
    args = parser.parse_args(["--load", str(tmp_path), "--vocab-file", "vocab.json"])
    with pytest.raises(ConfigError) as refused:
        load_for_text(args, torch.device("cpu"), None)
    assert str(refused.value) == (
        "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model FILE: the type is the "
        "checkpoint's, its files replaced by --vocab-file; give the --tokenizer-type that reads "
        "them"
    )
