"""threefold/inference.py's refusal of a checkpoint it cannot turn into text (its sampling and
scoring are proven against transformers in tests/tools/test_convert_checkpoint.py)."""

import argparse

import pytest
import torch

from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError
from threefold.inference import load_for_text
from threefold.inference_flags import add_tokenizer_flags


def test_a_run_without_a_tokenizer_is_refused_naming_the_flags_to_give(tmp_path):
    # --mock-data: the run trained on token ids alone, so no tokenizer was saved with it.
    save_checkpoint(str(tmp_path), _setup(LLAMA_STYLE + TRAINING).checkpoint_components())
    parser = argparse.ArgumentParser()
    parser.add_argument("--load")
    add_tokenizer_flags(parser)
    args = parser.parse_args(["--load", str(tmp_path)])
    with pytest.raises(ConfigError, match="the run had no tokenizer .* with --tokenizer-type"):
        load_for_text(args, torch.device("cpu"), None)
