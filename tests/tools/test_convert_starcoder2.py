"""Hugging Face's Starcoder2ForCausalLM (StarCoder2) in and out: grouped queries and RoPE in
GPT-2's layer (LayerNorm with a bias, a GELU MLP, biases on every projection) with a sliding
window. A tiny one gives transformers' logits over 24 tokens in windows of 8, and other logits
without the window or the biases; a bitwise round trip that transformers loads; greedy
generation past the window; its per-token losses at TP2 + SP and TP2 x PP2; a model trained in
threefold with that layer exports as StarCoder2; what it cannot express is refused."""

from __future__ import annotations

import pytest
import torch

from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)


from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    TP2_SP_AND_TP2_PP2,
    assert_exports_as,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("starcoder2", tmp_path_factory.mktemp("starcoder2"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"window_size": None}, {"add_bias_linear": False}],
    ids=["as-is", "no-window", "no-biases"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    assert (config.model.window_size, config.model.add_bias_linear) == ("7,0", True)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


STARCODER2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
STARCODER2 += ["--group-query-attention", "--num-query-groups", "2", "--openai-gelu"]
STARCODER2 += ["--position-embedding-type", "rope", "--mock-data", "--vocab-size", str(VOCAB)]
STARCODER2 += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_starcoder2s_layer_exports_as_starcoder2(tmp_path):
    exported = assert_exports_as(STARCODER2, tmp_path, "Starcoder2ForCausalLM")
    assert exported["sliding_window"] is None


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--swiglu"], "a GLU or squared-ReLU MLP"),
        (["--disable-bias-linear", "--add-qkv-bias"], "biases on the query, key and value"),
        (["--rotary-interleaved"], "RoPE on adjacent pairs"),
    ],
    ids=["swiglu", "qkv-bias-only", "interleaved"],
)
def test_what_starcoder2_cannot_express_is_refused(flags, named):
    config = parse_args(STARCODER2 + flags).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, "Starcoder2ForCausalLM")
