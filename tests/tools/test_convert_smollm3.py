"""Hugging Face's SmolLM3ForCausalLM (SmolLM3) in and out: the LLaMA layer whose every N-th
layer attends without RoPE (no_rope_layers: --no-rope-freq), here with use_sliding_window's
windows of 8 keys in those layers. A tiny one gives transformers' logits over 24 tokens, and
other logits with RoPE everywhere or without the windows; a bitwise round trip that
transformers loads; greedy generation past the window; its per-token losses at TP2 + SP and
TP2 x PP2. A dense model trained in threefold with layers without RoPE exports as SmolLM3;
with Llama 4's other options it is refused in one line."""

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
    return converted_hf_model("smollm3", tmp_path_factory.mktemp("smollm3"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"no_rope_freq": None}, {"window_size": None}],
    ids=["as-is", "rope-everywhere", "no-windows"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    assert (config.model.no_rope_freq, config.model.window_attn_skip_freq) == ("[0,1,0,1]",) * 2
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


SMOLLM3 = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
SMOLLM3 += ["--group-query-attention", "--num-query-groups", "2", "--swiglu"]
SMOLLM3 += ["--normalization", "RMSNorm", "--disable-bias-linear", "--no-rope-freq", "4"]
SMOLLM3 += ["--position-embedding-type", "rope", "--mock-data", "--vocab-size", str(VOCAB)]
SMOLLM3 += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_dense_model_with_layers_without_rope_exports_as_smollm3(tmp_path):
    exported = assert_exports_as(SMOLLM3, tmp_path, "SmolLM3ForCausalLM")
    assert exported["no_rope_layers"] == [1, 1, 1, 0]


def test_llama_4s_other_layers_are_refused():
    config = parse_args(SMOLLM3 + ["--qk-l2-norm"]).model
    with pytest.raises(ConfigError, match="Llama 4's layers other than --no-rope-freq"):
        threefold_to_hf({}, config, "SmolLM3ForCausalLM")
