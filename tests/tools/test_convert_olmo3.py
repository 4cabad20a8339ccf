"""Hugging Face's Olmo3ForCausalLM (OLMo 3) in and out: OLMo 2's layers (norms after the
sublayers, query and key norms across heads), three in four attending in a window, and RoPE by
layer type: YaRN in the full layers (OLMo 3's long context), plain RoPE in the windowed ones
(--window-rotary-base). A tiny one gives transformers' logits over 24 tokens, and other logits
with YaRN everywhere, without the windows or without YaRN; the Hub's config format (rope_theta
and rope_scaling) reads as transformers 5's; a bitwise round trip that transformers loads;
greedy generation past the window and the original context; its per-token losses at TP2 + SP
and TP2 x PP2; other RoPE in the windowed layers is refused by name."""

from __future__ import annotations

import dataclasses
import json
import os

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
    return converted_hf_model("olmo3", tmp_path_factory.mktemp("olmo3"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"window_rotary_base": None},
        {"window_size": None, "window_rotary_base": None},
        {"position_embedding_type": "rope"},
    ],
    ids=["as-is", "yarn-everywhere", "no-windows", "no-yarn"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    model = config.model
    assert (model.position_embedding_type, model.window_attn_skip_freq) == ("yarn", "[1,1,1,0]")
    assert (model.window_size, model.window_rotary_base) == ("7,0", 10000.0)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def _hub_config(hf_dir: str) -> dict:
    """The model's config.json as the Hub's OLMo 3 configs write it: one rope_theta, the full
    layers' scaling as rope_scaling."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    parameters = hf.pop("rope_parameters")
    full = dict(parameters["full_attention"])
    return {**hf, "rope_theta": full.pop("rope_theta"), "rope_scaling": full}


def test_the_hubs_config_format_reads_the_same(converted):
    _, hf_dir, ours = converted
    config, _, _ = load_model(ours)
    _, hub = model_config_from_hf(_hub_config(hf_dir))
    assert dataclasses.replace(hub, hf_architecture="Olmo3ForCausalLM") == config.model


def test_other_rope_in_the_windowed_layers_is_refused_by_name(converted):
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    hf["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_parameters.sliding_attention="):
        model_config_from_hf(hf)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_yarn_beside_plain_rope_in_windows_trains_over_tp2_sp_x_cp2_as_one_process():
    """OLMo 3's RoPE: YaRN tables in the full layers, plain ones of their own base in the
    windowed layers, each CP rank turning its tokens by their places in the sequence."""
    from tests.distributed import run_distributed
    from tests.parity import LLAMA_MHA_STYLE, TRAINING, assert_matches_reference, train_job
    from tests.tools.test_convert_olmo2 import OLMO

    rope = ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8"]
    rope += ["--window-size", "5,0", "--window-attn-skip-freq", "[1,1,1,0]"]
    rope += ["--window-rotary-base", "100"]
    argv = ["yarn" if a == "rope" else a for a in LLAMA_MHA_STYLE + OLMO] + rope + TRAINING
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--context-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)
