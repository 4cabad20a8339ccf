"""Hugging Face's GraniteForCausalLM (IBM Granite 3) in and out: LLaMA with four multipliers.
A tiny Granite gives transformers' logits, and other logits with each multiplier undone; a
bitwise round trip that transformers loads; greedy generation; its per-token losses at
TP2 x PP2; a model trained in threefold with --residual-multiplier exports as Granite, and as
LLaMA is refused in one line. GraniteMoe: the same multipliers over Mixtral's routing, its
stacked experts read and written as the Hub keeps them (and as transformers 5 holds them),
transformers' logits, a bitwise round trip and its per-token losses at PP2 x EP2."""

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
    return converted_hf_model("granite", tmp_path_factory.mktemp("granite"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"embedding_multiplier": 1.0},
        {"softmax_scale": None},
        {"residual_multiplier": 1.0},
        {"logit_scale": 1.0},
    ],
    ids=["as-is", "embedding", "attention", "residual", "logits"],
)
def test_logits_are_transformers_and_each_multiplier_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    model = config.model
    assert (model.embedding_multiplier, model.softmax_scale) == (3.0, 0.1)
    assert (model.residual_multiplier, model.logit_scale) == (0.5, 0.25)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_round_trip_generation_and_tp2_pp2_losses(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_layout_losses(hf_model, ours, 4, layout, TOKENS_25)


GRANITE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
GRANITE += ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
GRANITE += ["--position-embedding-type", "rope", "--residual-multiplier", "0.25"]
GRANITE += ["--mock-data", "--vocab-size", str(VOCAB), "--seq-length", "24"]
GRANITE += ["--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_a_residual_multiplier_exports_as_granite(tmp_path):
    """The other multipliers written as the ones it computes with (the attention's: 1/4)."""
    exported = assert_exports_as(GRANITE, tmp_path, "GraniteForCausalLM")
    assert (exported["residual_multiplier"], exported["attention_multiplier"]) == (0.25, 0.25)


@pytest.mark.parametrize(
    "flags,architecture,named",
    [
        ([], "LlamaForCausalLM", r"none of Granite's layers \(--residual-multiplier\)"),
        (["--post-sublayer-norm"], "GraniteForCausalLM", "Gemma's layers besides"),
        (["--normalization", "LayerNorm", "--no-layernorm-bias"], "GraniteForCausalLM", "RMSNorm"),
    ],
    ids=["as-llama", "post-norms", "layernorm"],
)
def test_what_the_architectures_cannot_express_is_refused(flags, architecture, named):
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, parse_args(GRANITE + flags).model, architecture)


@pytest.fixture(scope="module")
def converted_moe(tmp_path_factory):
    return converted_hf_model("granite-moe", tmp_path_factory.mktemp("granite_moe"))


def test_granite_moe_logits_round_trip_and_pp2_ep2_losses(converted_moe, tmp_path):
    from tests.tools.hf_models import assert_live_experts_convert_as_saved

    hf_model, hf_dir, ours = converted_moe
    with torch.no_grad():
        assert relative_error(logits_with(ours, TOKENS), hf_model(TOKENS).logits) < 1e-5
        unscaled = logits_with(ours, TOKENS, residual_multiplier=1.0)
        assert relative_error(unscaled, hf_model(TOKENS).logits) > 1e-3
    assert_live_experts_convert_as_saved(hf_model, hf_dir)
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    layout += ["--moe-token-dispatcher-type", "alltoall", "--global-batch-size", "4"]  # (DP2)
    assert_layout_losses(hf_model, ours, 4, layout, TOKENS_25)
