"""Hugging Face's Exaone4ForCausalLM (EXAONE 4.0) in and out: OLMo 2's norms after the
sublayers, an RMSNorm over each query and key head, three layers in four attending in a window
with RoPE and the fourth to every key without positions. A tiny one gives transformers' logits
over 24 tokens, and other logits with RoPE everywhere, without windows or without the head
norms; the Hub's sliding_window_pattern ("LLLG", no layer_types) reads as transformers reads it,
and a config without sliding_window is RoPE everywhere without windows; a bitwise round trip
that transformers loads; greedy generation past the window; its per-token losses at TP2 + SP
and TP2 x PP2; what EXAONE 4 cannot express is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.tools.hf_models import converted_hf_model, has_transformers
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    TP2_SP_AND_TP2_PP2,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("exaone4", tmp_path_factory.mktemp("exaone4"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"no_rope_freq": None}, {"window_size": None}, {"qk_layernorm": False}],
    ids=["as-is", "rope-everywhere", "no-windows", "no-head-norms"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    model = config.model
    assert (model.window_attn_skip_freq, model.no_rope_freq) == ("[1,1,1,0]", "[0,0,0,1]")
    assert (model.qk_layernorm, model.qk_layernorm_across_heads) == (True, False)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def _config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def test_the_hubs_pattern_and_a_config_without_windows_read_as_transformers_reads_them(converted):
    _, hf_dir, ours = converted
    config, _, _ = load_model(ours)
    hub = {**_config(hf_dir), "sliding_window_pattern": "LLLG"}
    del hub["layer_types"]
    _, model = model_config_from_hf(hub)
    assert dataclasses.replace(model, hf_architecture="Exaone4ForCausalLM") == config.model
    _, model = model_config_from_hf({**_config(hf_dir), "sliding_window": None})
    assert (model.window_size, model.no_rope_freq) == (None, None)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"no_rope_freq": None}, "RoPE elsewhere than in the windowed layers"),
        ({"qk_layernorm_across_heads": True}, "with query and key norms over each head"),
    ],
    ids=["rope-everywhere", "across-heads"],
)
def test_what_exaone4_cannot_express_is_refused(converted, change, named):
    config, _, _ = load_model(converted[2])
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, dataclasses.replace(config.model, **change), "Exaone4ForCausalLM")
