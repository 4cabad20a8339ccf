"""Hugging Face's PhiForCausalLM (Phi-1, Phi-1.5, Phi-2) in and out: one LayerNorm with a bias
read by the attention and the MLP side by side, RoPE on 0.4 of each head, biases on every
projection and on the output layer (--output-layer-bias). A tiny one gives transformers' logits,
and other logits with each of its choices undone; a bitwise round trip that transformers loads;
greedy generation; its per-token losses at TP2 + SP and TP2 x PP2. A second one (LayerNorms on
queries and keys, grouped queries, tied embeddings beside the output bias) does too at TP2 + SP.
The output layer's bias trains over TP2 + SP x PP2 as one process, tied or not; a model trained
in threefold with Phi's layer exports as Phi; what either side cannot express is refused in one
line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.checkpoint.megatron.format import megatron_args
from threefold.config import ConfigError
from threefold.training.memory_estimate import parameter_count

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
    return converted_hf_model("phi", tmp_path_factory.mktemp("phi"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"output_layer_bias": False},
        {"parallel_attention_mlp_shared_norm": False},  # a norm of its own (at 1) for the MLP
        {"rotary_percent": 1.0},
    ],
    ids=["as-is", "no-output-bias", "mlp-norm", "rope-everywhere"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    """(RoPE on the whole head moves the logits least: 9e-4.)"""
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert (config.model.rotary_percent, config.model.output_layer_bias) == (0.4, True)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 5e-4, error
    # The estimate's count is the model's: transformers' parameters, the vocabulary padded.
    count = sum(p.numel() for p in model.parameters())
    assert parameter_count(config.model, model.padded_vocab_size) == count
    padding = model.padded_vocab_size - VOCAB
    assert count == sum(p.numel() for p in hf_model.parameters()) + padding * (2 * 64 + 1)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    """The output layer's bias is cut with its vocabulary rows; under PP only the last stage
    holds it."""
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_query_and_key_norms_grouped_queries_and_tied_embeddings(tmp_path_factory, tmp_path):
    """Phi's qk_layernorm: a LayerNorm with a bias on each query and key head (--qk-layernorm
    over LayerNorm), beside 2 groups, exact GELU, tied embeddings with the output bias."""
    hf_model, hf_dir, ours = converted_hf_model("phi-qk", tmp_path_factory.mktemp("phi-qk"))
    config, _, _ = load_model(ours)
    assert config.model.qk_layernorm and not config.model.untie_embeddings_and_output_weights
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        assert relative_error(logits_with(ours, TOKENS, qk_layernorm=False), expected) > 1e-3
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


PHI_LAYER = ["--normalization", "LayerNorm", "--position-embedding-type", "rope"]
PHI_LAYER += ["--rotary-percent", "0.5", "--openai-gelu", "--output-layer-bias"]
PHI_LAYER += ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
PHI = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"] + PHI_LAYER
PHI += ["--mock-data", "--vocab-size", str(VOCAB)]
PHI += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_output_bias_trains_over_tp2_sp_pp2_as_one_process(tied):
    """The bias's gradient is each vocabulary shard's own (no sum over TP); tied, the last
    stage holds it beside its copy of the embeddings."""
    style = [flag for flag in LLAMA_STYLE if flag != "--swiglu"]
    untie = [] if tied else ["--untie-embeddings-and-output-weights"]
    argv = style + PHI_LAYER + untie + ["--num-layers", "4"] + TRAINING
    reference = train_job(argv, 3)
    assert any(name.endswith("output_layer.bias") for name in reference["params"])
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


def test_a_model_trained_with_phis_layer_exports_as_phi(tmp_path):
    exported = assert_exports_as(PHI, tmp_path, "PhiForCausalLM")
    assert exported["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert exported["hidden_act"] == "gelu_new"


@pytest.mark.parametrize("spelled", ["rope_parameters", "rope_scaling"])
def test_rope_scaling_is_refused_by_name(converted, spelled):
    """As transformers 5 writes it, and as the Hub's older configs do."""
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    linear = {"rope_type": "linear", "factor": 2.0}
    if spelled == "rope_scaling":
        hf.update(rope_theta=hf.pop("rope_parameters")["rope_theta"], rope_scaling=linear)
    else:
        hf["rope_parameters"].update(linear)
    with pytest.raises(ConfigError, match="rope_scaling='linear'"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    "remove,add,architecture,named",
    [
        ([], [], "GPTNeoXForCausalLM", "export this model as PhiForCausalLM"),
        # (RoPE on every dimension: Cohere refuses a part first)
        (["--rotary-percent", "0.5"], [], "CohereForCausalLM", "export this model as Phi"),
        (["--parallel-attention-mlp-shared-norm"], [], "PhiForCausalLM", "reading one norm"),
        ([], ["--disable-bias-linear"], "PhiForCausalLM", "projections without biases"),
        ([], ["--swiglu"], "PhiForCausalLM", "a GLU or squared-ReLU MLP"),
    ],
    ids=["as-gpt-neox", "as-cohere", "two-norms", "no-biases", "swiglu"],
)
def test_what_the_architectures_cannot_express_is_refused(remove, add, architecture, named):
    config = parse_args([flag for flag in PHI if flag not in remove] + add).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, architecture)


def test_a_model_without_the_output_bias_exports_as_phi_with_a_zero_one(converted):
    config, model, _ = load_model(converted[2])
    state = {n: t for n, t in model.state_dict().items() if n != "output_layer.bias"}
    config.model.output_layer_bias = False
    exported = threefold_to_hf(state, config.model, "PhiForCausalLM")
    assert torch.equal(exported["lm_head.bias"], torch.zeros(model.padded_vocab_size))


def test_megatron_builds_no_output_bias():
    with pytest.raises(ConfigError, match="--output-layer-bias"):
        megatron_args(parse_args(PHI), 0)
