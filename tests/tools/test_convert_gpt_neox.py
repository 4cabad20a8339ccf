"""Hugging Face's GPTNeoXForCausalLM (Pythia, GPT-NeoX-20B) in and out: a tiny Pythia (the
attention and the MLP reading one input, RoPE on a quarter of each head, random biases and
norms) gives transformers' logits, and other logits with either undone; its per-token losses at
TP2 x PP2; a bitwise round trip that transformers loads; greedy generation. The parallel layer
trains over TP2+SP x PP2 as one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import converted_hf_model, has_transformers
from threefold.checkpoint.hf import threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return converted_hf_model("gpt-neox", tmp_path_factory.mktemp("gpt_neox"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"parallel_attention_mlp": False}, {"rotary_percent": 1.0}],
    ids=["as-is", "sequential", "whole-heads-rotated"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    assert (config.model.parallel_attention_mlp, config.model.rotary_percent) == (True, 0.25)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 2e-6 if not undone else error > 1e-4, error


def test_tp2_pp2_per_token_losses_are_transformers(converted):
    hf_model, _, ours = converted
    tp2_pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_layout_losses(hf_model, ours, 4, tp2_pp2)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


PYTHIA = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
PYTHIA += ["--seq-length", "16", "--position-embedding-type", "rope", "--rotary-percent", "0.5"]
PYTHIA += ["--parallel-attention-mlp", "--untie-embeddings-and-output-weights"]


def test_the_parallel_layer_trains_over_tp2_sp_pp2_as_one_process():
    argv = PYTHIA + TRAINING
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


def test_other_architectures_refuse_the_parallel_layer(converted):
    config, _, _ = load_model(converted[2])
    whole_heads = dataclasses.replace(config.model, rotary_percent=1.0)
    with pytest.raises(ConfigError, match="--parallel-attention-mlp\\): export it as GPTNeoX"):
        threefold_to_hf({}, whole_heads, "LlamaForCausalLM")
