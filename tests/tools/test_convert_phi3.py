"""Hugging Face's Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4): its fused QKV and gate/up
projections in and out. A tiny Phi-3 with a sliding window of 8 and RoPE on half of each head
gives transformers' logits, and other logits with either undone; a bitwise round trip that
transformers loads; its per-token losses at TP2 x PP2; greedy generation as transformers'.
A tiny Phi-4 mini's LongRoPE: transformers' logits with the short and the long factors, a
round trip, and its per-token losses at TP2."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.tools.hf_models import converted_hf_model, has_transformers
from threefold.checkpoint.hf import model_config_from_hf
from threefold.checkpoint.load import load_model
from threefold.checkpoint.megatron.format import megatron_args
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("phi3", tmp_path_factory.mktemp("phi3"))


@pytest.mark.parametrize(
    "undone", [{}, {"window_size": None}, {"rotary_percent": 1.0}], ids=["as-is", "window", "half"]
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    """24 tokens over a window of 8; half of each head turned."""
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    assert (config.model.window_size, config.model.rotary_percent) == ("7,0", 0.5)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    """Generation past the window of 8 as the text grows, with transformers' cache."""
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


def test_tp2_pp2_per_token_losses_are_transformers(converted):
    hf_model, _, ours = converted
    tp2_pp2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_layout_losses(hf_model, ours, 4, tp2_pp2)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    return converted_hf_model("phi3-longrope", tmp_path_factory.mktemp("phi3-longrope"))


@pytest.mark.parametrize("length", [16, 24], ids=["short", "long"])
def test_longrope_logits_are_transformers_by_length_and_each_part_shows(longrope, length):
    """Up to the original context of 16 the short factors turn, beyond it the long ones, in
    transformers and in a run of that --seq-length; the other factors, or no attention
    factor, give other logits."""
    hf_model, _, ours = longrope
    config, _, _ = load_model(ours)
    # (converted at its original context: the short factors, as transformers at 16 tokens)
    assert (config.model.position_embedding_type, config.model.seq_length) == ("longrope", 16)
    assert config.model.longrope_attention_factor == pytest.approx((1 + math.log(4, 16)) ** 0.5)
    tokens = TOKENS[:, :length]
    with torch.no_grad():
        expected = hf_model(tokens).logits
    swapped = {
        "longrope_short_factor": config.model.longrope_long_factor,
        "longrope_long_factor": config.model.longrope_short_factor,
    }
    for changes, equal in (
        ({}, True),
        (swapped, False),
        ({"longrope_attention_factor": 1.0}, False),
    ):
        logits = logits_with(ours, tokens, seq_length=length, **changes)
        error = relative_error(logits, expected)
        assert error < 1e-5 if equal else error > 1e-3, (changes, error)


def test_longrope_round_trips_and_runs_at_tp2_as_transformers(longrope, tmp_path):
    """The export is the Hub's form (the original context at the top level too), which
    transformers loads with its logits; at TP2 with sequence parallelism, the factors read
    back by --use-checkpoint-args, the per-token losses of 24 tokens are transformers' with the
    long factors (CP: tests/parallel/test_context_parallel.py)."""
    hf_model, hf_dir, ours = longrope
    exported = str(tmp_path / "exported")
    assert_round_trip(hf_model, hf_dir, ours, exported, TOKENS)
    with open(os.path.join(exported, "config.json")) as f:
        saved = json.load(f)
    assert saved["original_max_position_embeddings"] == 16
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


def test_longrope_mistakes_are_one_line(longrope):
    with pytest.raises(ConfigError, match="Megatron-LM builds no --longrope-short-factor"):
        megatron_args(load_model(longrope[2])[0], 0)
    hf = {**longrope[0].config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    _, config = model_config_from_hf(hf)
    assert len(config.longrope_short_factor) == 6
    # (Phi3Config reads a rope_scaling of type yarn, Phi-3's first configs', as LongRoPE)
    legacy = {**hf, "rope_parameters": None, "rope_scaling": {**hf["rope_parameters"]}}
    legacy["partial_rotary_factor"] = legacy["rope_scaling"].pop("partial_rotary_factor")
    legacy["rope_scaling"].update(rope_type=None, type="yarn")
    assert model_config_from_hf(legacy)[1].longrope_long_factor == config.longrope_long_factor
    short = {**hf["rope_parameters"], "short_factor": [1.0] * 4}
    with pytest.raises(ConfigError, match="--longrope-short-factor holds 4 factors; RoPE turns 6"):
        model_config_from_hf({**hf, "rope_parameters": short})[1].finalize()
