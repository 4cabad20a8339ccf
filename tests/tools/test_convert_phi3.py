"""Hugging Face's Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4): its fused QKV and gate/up
projections in and out. A tiny Phi-3 with a sliding window of 8 and RoPE on half of each head
gives transformers' logits, and other logits with either undone; a bitwise round trip that
transformers loads; its per-token losses at TP2 x PP2; greedy generation as transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.tools.hf_models import converted_hf_model, has_transformers
from threefold.checkpoint.hf import model_config_from_hf
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


def test_longrope_is_refused_by_name(converted):
    hf = {**converted[0].config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    with pytest.raises(ConfigError, match="rope_scaling='longrope' is not supported"):
        model_config_from_hf({**hf, "rope_parameters": longrope})
