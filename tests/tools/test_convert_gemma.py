"""Hugging Face's Gemma 3, Gemma 2 and Gemma 1 in and out. Gemma3ForCausalLM: a tiny Gemma 3 with
three windowed layers (their own RoPE base) and a full one (linear RoPE scaling), a query
scale of its own and norms away from their start gives transformers' logits, and other
logits with any of Gemma's layers undone; its per-token losses at TP2+SP and TP2 x PP2; a
bitwise round trip that transformers loads; greedy generation past the window. Gemma's options
train over TP2+SP x PP2 and TP2+SP x CP2 as one process; what does not fit is refused in one
line. Gemma2ForCausalLM: its soft-capped scores and logits each doing their part, TP2+SP,
TP2 x CP2 and CP2 by Ulysses, the round trip and generation. GemmaForCausalLM (Gemma 1): its
scaled embeddings and (1 + weight) norms each doing their part, TP2 x PP2, the round trip and
generation; Gemma 2's layers refused."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_MHA_STYLE, TRAINING, assert_matches_reference, train_job
from tests.tools.hf_models import converted_hf_model, has_transformers
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.checkpoint.megatron.format import megatron_args
from threefold.config import ConfigError

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402

from tests.tools.hf_checks import (  # noqa: E402
    TOKENS,
    TOKENS_25,
    TP2_SP_AND_TP2_PP2,
    assert_greedy_generation,
    assert_layout_losses,
    assert_round_trip,
    assert_text_of_multimodal,
    logits_with,
    relative_error,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("gemma3", tmp_path_factory.mktemp("gemma3"))


UNDONE = {
    "as-is": {},
    "embedding-scale": {"embedding_multiplier": 1.0},
    "query-scale": {"softmax_scale": None},
    "window-rope": {"window_rotary_base": None},
    "post-norms": {"post_sublayer_norm": False},
    "exact-gelu": {"openai_gelu": False},
    "norms-by-weight": {"apply_layernorm_1p": False},
}


@pytest.mark.parametrize("undone", UNDONE)
def test_logits_are_transformers_and_each_layer_does_its_part(converted, undone):
    hf_model, _, ours = converted
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
    error = relative_error(logits_with(ours, TOKENS, **UNDONE[undone]), expected)
    # (GELU's tanh approximation moves the logits least: 4e-5)
    assert error < 5e-6 if undone == "as-is" else error > 2e-5, error


def test_the_hubs_config_spelling_reads_the_same(converted):
    """The Hub's Gemma 3 configs (transformers 4's spelling) keep rope_theta,
    rope_local_base_freq and rope_scaling at the top level; transformers 5 moves them into
    rope_parameters by layer type."""
    hf_model, _, _ = converted
    hf = {**hf_model.config.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    _, expected = model_config_from_hf(hf)
    parameters = hf.pop("rope_parameters")
    hub = {**hf, "rope_theta": parameters["full_attention"]["rope_theta"]}
    hub.update(rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    _, config = model_config_from_hf(hub)
    assert config == expected
    assert (config.window_rotary_base, config.rotary_seq_len_interpolation_factor) == (100.0, 2.0)


@TP2_SP_AND_TP2_PP2
def test_parallel_layouts_compute_transformers_losses(converted, world, layout):
    hf_model, _, ours = converted
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


def test_round_trip_is_bitwise_and_generation_is_transformers(converted, tmp_path):
    hf_model, hf_dir, ours = converted
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)


def test_the_multimodal_files_convert_as_their_text_model(converted, tmp_path):
    """Gemma 3 4B and up are kept as Gemma3ForConditionalGeneration: its text model."""
    hf_model, _, ours = converted
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision.update(intermediate_size=64, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(
        text_config=hf_model.config.to_dict(), vision_config=vision, mm_tokens_per_image=4
    )
    both = transformers.Gemma3ForConditionalGeneration(config)
    both.model.language_model.load_state_dict(hf_model.model.state_dict())
    said = "vision_tower.*, multi_modal_projector.* stay behind"
    assert_text_of_multimodal(both, hf_model, ours, tmp_path, TOKENS, said)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return converted_hf_model("gemma2", tmp_path_factory.mktemp("gemma2"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"attn_logit_softcapping": None}, {"final_logit_softcapping": None}],
    ids=["as-is", "scores-uncapped", "logits-uncapped"],
)
def test_gemma2s_capped_scores_and_logits_are_transformers(gemma2, undone):
    """Gemma 2: no head norms, every other layer windowed, one RoPE base; its scores capped
    at 0.01 and its logits at 3."""
    hf_model, _, ours = gemma2
    config, _, _ = load_model(ours)
    assert (config.model.window_attn_skip_freq, config.model.qk_layernorm) == ("[1,0,1,0]", False)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 5e-6 if not undone else error > 1e-2, error


def test_gemma2_over_tp2_sp_round_trip_and_generation(gemma2, tmp_path):
    hf_model, hf_dir, ours = gemma2
    tp2_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_layout_losses(hf_model, ours, 2, tp2_sp, TOKENS_25)
    exported = str(tmp_path / "exported")
    assert_round_trip(hf_model, hf_dir, ours, exported, TOKENS, attn_implementation="eager")
    assert_greedy_generation(hf_model, ours)


@pytest.mark.parametrize(
    "world,layout",
    [
        (4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]),
        (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    ],
    ids=["tp2xcp2", "cp2-a2a"],
)
def test_gemma2s_capped_scores_over_context_parallel_ranks(gemma2, world, layout):
    """The capped attention's blocks over CP ranks (the ring's), or its whole sequences for
    a share of the heads (Ulysses): per-token losses are transformers'."""
    hf_model, _, ours = gemma2
    assert_layout_losses(hf_model, ours, world, layout, TOKENS_25)


GEMMA = ["--embedding-multiplier", "5.7", "--post-sublayer-norm", "--geglu", "--openai-gelu"]
GEMMA += ["--softmax-scale", "0.3", "--window-size", "5,0", "--window-attn-skip-freq", "2"]
GEMMA += ["--window-rotary-base", "100", "--apply-layernorm-1p", "--qk-layernorm"]
GEMMA += ["--attn-logit-softcapping", "0.5", "--final-logit-softcapping", "3"]


@pytest.mark.parametrize(
    "layout",
    [
        ["--pipeline-model-parallel-size", "2"],
        ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
    ],
    ids=["tp2-sp-pp2", "tp2-sp-cp2"],
)
def test_gemmas_layers_train_over_tp2_sp_and_pp2_or_cp2_as_one_process(layout):
    argv = [a for a in LLAMA_MHA_STYLE if a != "--swiglu"] + GEMMA + TRAINING
    argv += ["--num-layers", "4"]
    reference = train_job(argv, 3)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *layout]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 3), reference, 1e-5)


def test_what_does_not_fit_is_one_line(converted, capsys):
    hf_model, _, ours = converted
    hf = {**hf_model.config.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0 is not supported"):
        model_config_from_hf({**hf, "final_logit_softcapping": 30.0})
    config, _, _ = load_model(ours)
    with pytest.raises(ConfigError, match="Megatron-LM builds no --embedding-multiplier"):
        megatron_args(config, 0)
    with pytest.raises(ConfigError, match="has none of Gemma's layers .* Gemma3ForCausalLM"):
        threefold_to_hf({}, config.model, "LlamaForCausalLM")
    from threefold.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(LLAMA_MHA_STYLE + ["--geglu"] + TRAINING)
    error = capsys.readouterr().err
    assert "--geglu is the MLP's activation: drop --swiglu" in error and error.count("\n") == 1


@pytest.fixture(scope="module")
def gemma1(tmp_path_factory):
    return converted_hf_model("gemma", tmp_path_factory.mktemp("gemma"))


@pytest.mark.parametrize(
    "undone",
    [{}, {"embedding_multiplier": 1.0}, {"apply_layernorm_1p": False}],
    ids=["as-is", "embeddings-unscaled", "norms-by-weight"],
)
def test_gemma1_logits_are_transformers_and_each_part_does_its_part(gemma1, undone):
    hf_model, _, ours = gemma1
    config, _, _ = load_model(ours)
    assert (config.model.geglu, config.model.post_sublayer_norm) == (True, False)
    with torch.no_grad():
        error = relative_error(logits_with(ours, TOKENS, **undone), hf_model(TOKENS).logits)
    assert error < 1e-5 if not undone else error > 1e-3, error


def test_gemma1_over_tp2_pp2_round_trip_generation_and_refusal(gemma1, tmp_path):
    hf_model, hf_dir, ours = gemma1
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_layout_losses(hf_model, ours, 4, layout, TOKENS_25)
    assert_round_trip(hf_model, hf_dir, ours, str(tmp_path / "exported"), TOKENS)
    assert_greedy_generation(hf_model, ours)
    config, _, _ = load_model(ours)
    config.model.post_sublayer_norm = True
    with pytest.raises(ConfigError, match="export as Gemma2ForCausalLM or Gemma3ForCausalLM"):
        threefold_to_hf({}, config.model, "GemmaForCausalLM")
