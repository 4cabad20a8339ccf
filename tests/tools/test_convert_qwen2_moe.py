"""Hugging Face's Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's biased attention,
Qwen3-MoE's routing, and a shared expert scaled by a sigmoid gate. A tiny one (a dense layer
among MoE ones, unnormalized top-k probabilities) gives transformers' logits, and other logits
with the gate, the biases or the unnormalized probabilities undone; a bitwise round trip that
transformers loads; greedy generation; its per-token losses at TP2 + SP x EP2; a model trained
in threefold with a gated shared expert exports as Qwen2-MoE; what it cannot express is refused
in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tools.hf_models import (
    VOCAB,
    assert_live_experts_convert_as_saved,
    converted_hf_model,
    has_transformers,
)
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402

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
    return converted_hf_model("qwen2-moe", tmp_path_factory.mktemp("qwen2_moe"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"moe_shared_expert_gate": False},
        {"add_qkv_bias": False},
        {"moe_router_pre_softmax": False},
    ],
    ids=["as-is", "gate", "qkv-bias", "normalized-top-k"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    model = config.model
    assert (model.moe_shared_expert_intermediate_size, model.moe_shared_expert_gate) == (24, True)
    assert (model.add_qkv_bias, model.moe_router_pre_softmax, model.moe_layer_freq) == (
        True,
        True,
        "[1,0,1,1]",
    )
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


def test_tp2_sp_ep2_per_token_losses_match_transformers(converted):
    """The shared expert and its gate over TP with sequence parallelism, the routed experts
    over EP (the same two ranks: --expert-tensor-parallel-size 1)."""
    hf_model, _, ours = converted
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    assert_layout_losses(
        hf_model, ours, 2, layout + ["--moe-token-dispatcher-type", "alltoall"], TOKENS_25
    )


def test_qwen2_moes_own_sliding_window_rule(converted):
    """Without layer_types, Qwen2MoeConfig slides the even layers below max_window_layers
    (Qwen2Config: the layers from it on)."""
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    hf.pop("layer_types", None)
    hf.update(use_sliding_window=True, sliding_window=8, max_window_layers=3)
    _, config = model_config_from_hf(hf)
    theirs = transformers.Qwen2MoeConfig(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=3
    ).layer_types
    pattern = [int(kind == "sliding_attention") for kind in theirs]
    assert (config.window_size, config.window_attn_skip_freq) == (
        "7,0",
        str(pattern).replace(" ", ""),
    )
    assert pattern == [1, 0, 1, 0]


QWEN2_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
QWEN2_MOE += ["--group-query-attention", "--num-query-groups", "2", "--add-qkv-bias"]
QWEN2_MOE += ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
QWEN2_MOE += ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
QWEN2_MOE += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
QWEN2_MOE += ["--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"]
QWEN2_MOE += ["--mock-data", "--vocab-size", str(VOCAB), "--seq-length", "24"]
QWEN2_MOE += ["--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_a_gated_shared_expert_exports_as_qwen2_moe(tmp_path):
    """The export's guess for a gated shared expert beside Qwen2's attention (top-k
    renormalized: norm_topk_prob)."""
    exported = assert_exports_as(QWEN2_MOE, tmp_path, "Qwen2MoeForCausalLM")
    assert (exported["norm_topk_prob"], exported["shared_expert_intermediate_size"]) == (True, 48)


@pytest.mark.parametrize(
    "flags,architecture,named",
    [
        (
            ["--moe-shared-expert-gate"],
            "Qwen2MoeForCausalLM",
            "MoE layers without a gated shared expert",
        ),
        ([], "Qwen3MoeForCausalLM", "with only a gated shared expert, Qwen2MoeForCausalLM"),
        ([], "MixtralForCausalLM", "with only a gated shared expert, Qwen2MoeForCausalLM"),
    ],
    ids=["no-gate", "as-qwen3-moe", "as-mixtral"],
)
def test_what_the_architectures_cannot_express_is_refused(flags, architecture, named):
    argv = [flag for flag in QWEN2_MOE if flag not in flags]
    config = parse_args(argv).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, architecture)


def test_stacked_experts_of_a_live_model_convert_as_the_saved_ones(converted):
    hf_model, hf_dir, _ = converted
    tensors = assert_live_experts_convert_as_saved(hf_model, hf_dir)
    assert any(name.endswith("shared_experts.gate_weight") for name in tensors)
