"""Hugging Face's CohereForCausalLM (Command R, Aya): one LayerNorm without a bias read by the
attention and the MLP side by side, RoPE on adjacent pairs, scaled logits, tied embeddings.
A tiny one gives transformers' logits, and other logits with each of its choices undone; a
bitwise round trip that transformers loads; greedy generation; its per-token losses at
TP2 + SP and TP2 x PP2; Cohere's layers train over TP2 + SP x PP2 as one process; a model
trained in threefold with them exports as Cohere; what either side cannot express is refused in
one line. Cohere2 (Command R7B, Command A): windows with RoPE in three layers of four, full
attention without positions in the fourth, as transformers computes them."""

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

SEQUENTIAL = {"parallel_attention_mlp": False, "parallel_attention_mlp_shared_norm": False}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("cohere", tmp_path_factory.mktemp("cohere"))


@pytest.mark.parametrize(
    "undone",
    [
        {},
        {"parallel_attention_mlp_shared_norm": False},  # a norm of its own (at 1) for the MLP
        SEQUENTIAL,
        {"rotary_interleaved": False},
        {"logit_scale": 1.0},
    ],
    ids=["as-is", "mlp-norm", "sequential", "halves", "unscaled"],
)
def test_logits_are_transformers_and_each_choice_does_its_part(converted, undone):
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    assert not any(name.endswith("layernorm.bias") for name in model.state_dict())
    assert (config.model.logit_scale, config.model.untie_embeddings_and_output_weights) == (
        0.25,
        False,
    )
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    """The shared norm's output feeds both sublayers' column-parallel inputs (under SP: their
    gathers of the sequence)."""
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


COHERE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
COHERE += ["--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]
COHERE += ["--rotary-interleaved", "--normalization", "LayerNorm", "--no-layernorm-bias"]
COHERE += ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
COHERE += ["--logit-scale", "0.5", "--mock-data", "--vocab-size", str(VOCAB)]
COHERE += ["--seq-length", "24", "--micro-batch-size", "2", "--train-iters", "1"]


def test_a_model_trained_with_coheres_layers_exports_as_cohere(tmp_path):
    exported = assert_exports_as(COHERE, tmp_path, "CohereForCausalLM")
    assert exported["logit_scale"] == 0.5


@pytest.mark.parametrize("field,value", [("attention_bias", True)])
def test_what_threefold_cannot_compute_is_refused_by_name(converted, field, value):
    _, hf_dir, _ = converted
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = {**json.load(f), field: value}
    with pytest.raises(ConfigError, match=f"{field}={value}"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    "remove,architecture,named",
    [
        ([], "LlamaForCausalLM", "export this model as CohereForCausalLM"),
        ([], "GPTNeoXForCausalLM", "export this model as CohereForCausalLM"),
        (
            ["--parallel-attention-mlp-shared-norm"],
            "CohereForCausalLM",
            "cannot express this model: its layers read one LayerNorm",
        ),
    ],
    ids=["as-llama", "as-gpt-neox", "two-norms-as-cohere"],
)
def test_what_the_architectures_cannot_express_is_refused(remove, architecture, named):
    config = parse_args([flag for flag in COHERE if flag not in remove]).model
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, config, architecture)


def test_megatron_builds_none_of_coheres_layers():
    with pytest.raises(ConfigError, match="--parallel-attention-mlp-shared-norm"):
        megatron_args(parse_args(COHERE), 0)
    per_head = [flag for flag in COHERE if "shared-norm" not in flag]
    per_head += ["--qk-layernorm", "--qk-layernorm-per-head"]
    with pytest.raises(ConfigError, match="--qk-layernorm-per-head"):
        megatron_args(parse_args(per_head), 0)


def test_coheres_layers_train_over_tp2_sp_pp2_as_one_process():
    """The shared norm's weight gathers its gradient from both sublayers, summed over TP;
    Command R+'s query and key norms have a weight for each head, each TP rank its heads'."""
    layers = ["--rotary-interleaved", "--normalization", "LayerNorm", "--no-layernorm-bias"]
    layers += ["--parallel-attention-mlp", "--parallel-attention-mlp-shared-norm"]
    layers += ["--qk-layernorm", "--qk-layernorm-per-head"]
    argv = LLAMA_STYLE + layers + ["--logit-scale", "0.5", "--num-layers", "4"] + TRAINING
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


def test_command_r_plus_query_and_key_norms_have_a_weight_for_each_head(tmp_path_factory, tmp_path):
    """use_qk_norm: a bias-free LayerNorm of each query and key head with its own weight
    (--qk-layernorm --qk-layernorm-per-head): transformers' logits, other logits without the
    norms or with one weight for all heads (their mean), a bitwise round trip, and TP2 + SP
    (each rank its heads' weights) computing transformers' per-token losses."""
    hf_model, hf_dir, ours = converted_hf_model("cohere-qk", tmp_path_factory.mktemp("qk"))
    config, model, _ = load_model(ours)
    assert config.model.qk_layernorm and config.model.qk_layernorm_per_head
    count = sum(p.numel() for p in model.parameters())
    assert parameter_count(config.model, model.padded_vocab_size) == count
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert relative_error(logits_with(ours, TOKENS), expected) < 1e-5
        assert relative_error(logits_with(ours, TOKENS, qk_layernorm=False), expected) > 1e-3
        for layer in model.decoder.layers:  # one weight for every head: the heads' mean
            for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
                heads = norm.weight.view(-1, config.model.kv_channels)
                heads.copy_(heads.mean(0).expand_as(heads))
        averaged = model(TOKENS)[..., :VOCAB].transpose(0, 1)
        assert relative_error(averaged, expected) > 1e-3
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_layout_losses(hf_model, ours, 2, layout, TOKENS_25)


def test_query_and_key_norms_of_one_weight_export_as_each_heads_copy(tmp_path):
    exported = assert_exports_as(COHERE + ["--qk-layernorm"], tmp_path, "CohereForCausalLM")
    assert exported["use_qk_norm"]


@pytest.mark.parametrize(
    "flags,architecture,named",
    [
        (["--qk-layernorm", "--qk-layernorm-per-head"], "Qwen3ForCausalLM", "as CohereFor"),
        (["--qk-layernorm"], "Cohere2ForCausalLM", "export it as CohereForCausalLM"),
    ],
    ids=["as-qwen3", "as-cohere2"],
)
def test_per_head_norms_are_refused_where_they_do_not_fit(flags, architecture, named):
    with pytest.raises(ConfigError, match=named):
        threefold_to_hf({}, parse_args(COHERE + flags).model, architecture)


def test_per_head_norms_without_query_and_key_norms_are_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(COHERE + ["--qk-layernorm-per-head"])
    assert stop.value.code == 2 and "add --qk-layernorm" in capsys.readouterr().err


@pytest.fixture(scope="module")
def converted2(tmp_path_factory):
    return converted_hf_model("cohere2", tmp_path_factory.mktemp("cohere2"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"window_size": None}, {"no_rope_freq": None}],
    ids=["as-is", "no-windows", "rope-everywhere"],
)
def test_cohere2_logits_are_transformers_and_each_choice_does_its_part(converted2, undone):
    """24 tokens over windows of 8."""
    hf_model, _, ours = converted2
    config, _, _ = load_model(ours)
    assert (config.model.window_size, config.model.window_attn_skip_freq) == ("7,0", "[1,1,1,0]")
    assert config.model.no_rope_freq == "[0,0,0,1]"
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_cohere2_round_trip_generation_and_tp2_pp2_losses(converted2, tmp_path):
    hf_model, hf_dir, ours = converted2
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_layout_losses(hf_model, ours, 4, layout, TOKENS_25)


def test_cohere2_refuses_rope_elsewhere_than_the_windows():
    windows = COHERE + ["--window-size", "7,0", "--window-attn-skip-freq", "[1,0]"]
    config = parse_args(windows + ["--no-rope-freq", "[1,0]"]).model
    with pytest.raises(ConfigError, match="RoPE turns exactly the layers with a window"):
        threefold_to_hf({}, config, "Cohere2ForCausalLM")
    config = parse_args(windows + ["--no-rope-freq", "[0,1]"]).model
    with pytest.raises(ConfigError, match="with Cohere's layers and windows: Cohere2ForCausalLM"):
        threefold_to_hf({}, config, "CohereForCausalLM")
