"""Hugging Face's Olmo2ForCausalLM (OLMo 2) in and out: norms after the sublayers only, and
the query and key norms across all heads (config/olmo.py). A tiny OLMo 2 gives transformers'
logits, and others with norms before the sublayers too; its per-token losses at TP2+SP (the
heads' norm summed over the TP group) and TP2 x PP2; a bitwise round trip that transformers
loads; greedy generation. OLMo 2's layers train over TP2+SP x PP2 as one process. OLMoE
(OlmoeForCausalLM): those query and key norms in the LLaMA layer, over experts: transformers'
logits (others with the top-k renormalized), the stacked live experts, a round trip and its
losses at TP2 + SP x EP2."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_MHA_STYLE, TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import converted_hf_model, has_transformers

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
    return converted_hf_model("olmo2", tmp_path_factory.mktemp("olmo2"))


@pytest.mark.parametrize("undone", [{}, {"sublayer_input_norms": True}], ids=["as-is", "pre-norms"])
def test_logits_are_transformers(converted, undone):
    hf_model, _, ours = converted
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 2e-6 if not undone else error > 1e-2, error


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


OLMO = ["--post-sublayer-norm", "--no-sublayer-input-norms", "--qk-layernorm"]
OLMO += ["--qk-layernorm-across-heads", "--num-layers", "4"]


def test_olmo2s_layers_train_over_tp2_sp_pp2_as_one_process():
    argv = LLAMA_MHA_STYLE + OLMO + TRAINING
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return converted_hf_model("olmoe", tmp_path_factory.mktemp("olmoe"))


def test_olmoe_logits_experts_round_trip_and_tp2_sp_ep2_losses(olmoe, tmp_path):
    from tests.tools.hf_models import assert_live_experts_convert_as_saved

    hf_model, hf_dir, ours = olmoe
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        renormalized = logits_with(ours, TOKENS, moe_router_pre_softmax=False)
        assert relative_error(renormalized, expected) > 1e-3
    assert_live_experts_convert_as_saved(hf_model, hf_dir)
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    layout += ["--moe-token-dispatcher-type", "alltoall"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)
