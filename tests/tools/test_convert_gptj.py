"""Hugging Face's GPTJForCausalLM (GPT-J 6B) in and out: one LayerNorm read by the attention and
the MLP side by side, biases on the MLP alone (--add-mlp-bias) and on the output layer, RoPE on
adjacent pairs of the first rotary_dim dimensions of each head. A tiny one gives transformers'
logits, and other logits with each of its choices undone; a bitwise round trip that
transformers loads; greedy generation; its per-token losses at TP2 + SP and TP2 x PP2. The MLP's
biases alone train over TP2 + SP x PP2 as one process; a model trained in threefold with
GPT-J's layer exports as GPT-J; --add-mlp-bias is also LLaMA's mlp_bias without
attention_bias; what cannot carry it is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_MHA_STYLE, TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import threefold_to_hf
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
    return converted_hf_model("gptj", tmp_path_factory.mktemp("gptj"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"rotary_interleaved": False},
        {"rotary_percent": 1.0},
        {"add_mlp_bias": False},
        {"output_layer_bias": False},
    ],
    ids=["as-is", "halves", "rope-everywhere", "no-mlp-biases", "no-output-bias"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    """(RoPE on halves or on every dimension moves the logits least: 1e-3.)"""
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert (config.model.rotary_percent, config.model.add_mlp_bias) == (0.5, True)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 5e-4, error
    count = sum(p.numel() for p in model.parameters())
    assert parameter_count(config.model, model.padded_vocab_size) == count


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_mlp_biases_alone_train_over_tp2_sp_pp2_as_one_process():
    """fc1's bias is cut with its columns; fc2's is whole on every TP rank, its gradient
    summed over the sequence's shards."""
    argv = [a for a in LLAMA_MHA_STYLE if a != "--swiglu"] + ["--add-mlp-bias"]
    argv += ["--num-layers", "4"] + TRAINING
    reference = train_job(argv, 3)
    assert any(name.endswith("linear_fc2.bias") for name in reference["params"])
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


GPTJ = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
GPTJ += ["--normalization", "LayerNorm", "--position-embedding-type", "rope"]
GPTJ += ["--rotary-interleaved", "--rotary-percent", "0.25", "--openai-gelu"]
GPTJ += ["--disable-bias-linear", "--add-mlp-bias", "--output-layer-bias"]
GPTJ += ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
GPTJ += ["--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", str(VOCAB)]
GPTJ += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_gptjs_layer_exports_as_gptj(tmp_path):
    exported = assert_exports_as(GPTJ, tmp_path, "GPTJForCausalLM")
    assert exported["rotary_dim"] == 4


def test_llamas_mlp_bias_alone_is_add_mlp_bias(tmp_path_factory, tmp_path):
    hf_model, hf_dir, ours = converted_hf_model("llama-mlp-bias", tmp_path_factory.mktemp("mb"))
    config, _, _ = load_model(ours)
    assert (config.model.add_bias_linear, config.model.add_mlp_bias) == (False, True)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        assert relative_error(logits_with(ours, TOKENS, add_mlp_bias=False), expected) > 1e-3
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)


@pytest.mark.parametrize(
    "remove,add,architecture,named",
    [
        ([], [], "PhiForCausalLM", "no biases on the MLP alone"),
        (["--disable-bias-linear"], [], "GPTJForCausalLM", "biases other than the MLP's alone"),
        ([], ["--group-query-attention", "--num-query-groups", "2"], "GPTJForCausalLM", "grouped"),
    ],
    ids=["as-phi", "all-biases", "grouped-queries"],
)
def test_what_gptj_cannot_express_is_refused(remove, add, architecture, named):
    config = parse_args([flag for flag in GPTJ if flag not in remove] + add).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, architecture)


def test_mlp_biases_alone_are_refused_where_they_do_not_fit():
    argv = [a for a in LLAMA_MHA_STYLE if a != "--swiglu"] + ["--add-mlp-bias"] + TRAINING
    config = parse_args(argv).model
    with pytest.raises(ConfigError, match="no biases on the MLP alone"):
        threefold_to_hf({}, config, "MistralForCausalLM")
    with pytest.raises(ConfigError, match="--add-mlp-bias"):
        megatron_args(parse_args(argv), 0)
