"""Hugging Face's DeepseekV2ForCausalLM (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite) in and out:
DeepSeek-V3's multi-latent attention (here without a query latent, YaRN with a temperature)
with DeepSeek-V2's routing, a softmax over all experts kept as it is and scaled, in groups scored
by their best expert, beside a shared expert. A tiny one gives transformers' logits, and other
logits with the top-k renormalized or unscaled; its live stacked experts convert as the saved
ones; a bitwise round trip that transformers loads; greedy generation; its per-token losses
at TP2 + SP x EP2 and PP2 x EP2. A threefold model with that routing exports as DeepSeek-V2; groups
scored otherwise (DeepSeek-V2's own 6 of 3 groups) are refused by name, and so is what
DeepSeek-V2 cannot express (transformers' latent norms have epsilon 1e-6 whatever
rms_norm_eps says)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.tools.hf_checks import assert_transformers_losses, per_token_losses
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
    return converted_hf_model("deepseek-v2", tmp_path_factory.mktemp("deepseek-v2"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"moe_router_pre_softmax": False}, {"moe_router_topk_scaling_factor": None}],
    ids=["as-is", "renormalized", "unscaled"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, _, _ = load_model(ours)
    model = config.model
    assert (model.moe_router_score_function, model.moe_router_pre_softmax) == ("softmax", True)
    assert (model.moe_router_num_groups, model.q_lora_rank) == (4, None)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_live_experts_round_trip_and_generation(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_live_experts_convert_as_saved(hf_model, hf_dir)
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


def test_tp2_sp_ep2per_token_losses_match_transformers(converted):
    """MLA's heads over TP with sequence parallelism, the experts over EP on the same two
    ranks."""
    hf_model, _, ours = converted
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    layout += ["--moe-token-dispatcher-type", "alltoall"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


def test_pp2_ep2per_token_losses_match_transformers(converted):
    """The dense first layer on one stage, the MoE layer on the other, its experts over EP2."""
    hf_model, _, ours = converted
    argv = ["--use-checkpoint-args", "--load", ours, "--mock-data", "--seq-length", "23"]
    argv += ["--micro-batch-size", "2", "--global-batch-size", "4"]
    argv += ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    argv += ["--pipeline-model-parallel-size", "2"]
    results = run_distributed(4, per_token_losses, argv, ours)
    assert_transformers_losses(hf_model, [r for r in results if r is not None])


V2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
V2 += ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16"]
V2 += ["--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--swiglu"]
V2 += ["--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type"]
V2 += ["rope", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
V2 += ["--moe-shared-expert-intermediate-size", "32", "--moe-router-pre-softmax"]
V2 += ["--moe-layer-freq", "[0,1]", "--untie-embeddings-and-output-weights", "--mock-data"]
V2 += ["--vocab-size", str(VOCAB), "--seq-length", "24", "--micro-batch-size", "2"]
V2 += ["--train-iters", "1", "--norm-epsilon", "1e-6"]


def test_a_model_with_deepseek_v2s_routing_exports_as_deepseek_v2(tmp_path):
    exported = assert_exports_as(V2, tmp_path, "DeepseekV2ForCausalLM")
    assert (exported["topk_method"], exported["q_lora_rank"]) == ("greedy", None)


def test_deepseek_v2s_own_groups_are_refused_by_name(converted):
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = {**json.load(f), "num_experts_per_tok": 4}  # (4 of 2 groups: 2 per group)
    with pytest.raises(ConfigError, match="topk_method='group_limited_greedy'"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--moe-router-score-function", "sigmoid"], "routing other than a softmax"),
        (
            ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
            "groups not scored by their top 1 experts",
        ),
        (["--norm-epsilon", "1e-5"], "latent norms of epsilon 1e-05"),
    ],
    ids=["sigmoid", "groups-by-two", "latent-norm-epsilon"],
)
def test_routing_deepseek_v2_cannot_express_is_refused(flags, named):
    config = parse_args(V2 + flags).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, "DeepseekV2ForCausalLM")
