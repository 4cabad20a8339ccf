"""Hugging Face's Llama4ForCausalLM (Scout's and Maverick's text model) beside what
tests/tools/test_convert_checkpoint.py runs for every family (logits, the round trip bitwise,
transformers loading the export): each choice transformers' Llama 4 makes beyond
megatron-core's doing its part, per-token losses over TP2+SP x EP2 and PP2 x EP2, the text
model of the Hub's multimodal files, and what does not fit refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.parity import LLAMA_MHA_STYLE, TRAINING
from tests.tools.hf_models import VOCAB, converted_hf_model, has_transformers
from threefold.arguments import parse_args
from threefold.checkpoint.hf import model_config_from_hf, threefold_to_hf
from threefold.checkpoint.load import load_model
from threefold.checkpoint.megatron.format import megatron_args
from threefold.config import ConfigError
from threefold.model import GPTModel

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402

from tests.tools.hf_checks import TOKENS, TOKENS_25, assert_layout_losses, assert_text_of_multimodal  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers' model, its directory, threefold's checkpoint of it)."""
    return converted_hf_model("llama4", tmp_path_factory.mktemp("llama4"))


def _relative_error(logits: torch.Tensor, expected: torch.Tensor) -> float:
    return ((logits - expected).abs().max() / expected.abs().max()).item()


# Each of transformers' choices undone: the model then computes other logits.
UNDONE = {
    "chunks": {"attention_chunk_size": None},
    "temperature": {"attn_temperature_tuning": False},
    "l2-norm-everywhere": {"qk_l2_norm_rope_layers_only": False},
    "megatron-rope-bands": {"rope_scaling_high_freq_factor": 4.0},
    "rope-on-halves": {"rotary_interleaved": False},
}


@pytest.mark.parametrize("undone", UNDONE)
def test_each_of_llama4s_choices_is_what_transformers_computes(converted, undone):
    """24 tokens: six chunks of 4, queries tempered from position 3 on, Scout's RoPE bands
    over an original context of 8."""
    hf_model, _, ours = converted
    config, model, _ = load_model(ours)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        assert _relative_error(model(TOKENS)[..., :VOCAB].transpose(0, 1), expected) < 1e-5
        other = GPTModel(
            dataclasses.replace(config.model, **UNDONE[undone]), model.padded_vocab_size
        )
        other.load_state_dict(model.state_dict())
        assert _relative_error(other(TOKENS)[..., :VOCAB].transpose(0, 1), expected) > 1e-3


@pytest.mark.parametrize("length", [24, 3, 22], ids=["whole-chunks", "one-short-chunk", "cut"])
def test_chunks_folded_into_the_batch_are_the_masked_attention(converted, length):
    """Over whole chunks (or one shorter than a chunk) each chunk attends in the batch with no
    mask; the same scores as the chunk mask, which packed documents and a cut chunk use."""
    _, _, ours = converted
    attention = load_model(ours)[1].decoder.layers[0].self_attention
    assert attention.chunk == 4
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(length, 2, 4, 16, generator=generator)
    key, value = (torch.randn(length, 2, 2, 16, generator=generator) for _ in range(2))
    one_document = torch.ones(1, 1, length, length, dtype=torch.bool)
    with torch.no_grad():
        plain = attention._core_attention(query, key, value, None)
        masked = attention._core_attention(query, key, value, one_document)
    torch.testing.assert_close(plain, masked, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["tp2-sp-x-ep2", "pp2-x-ep2"],
)
def test_expert_parallel_layouts_compute_transformers_losses(converted, layout):
    hf_model, _, ours = converted
    experts = ["--global-batch-size", "4", "--expert-model-parallel-size", "2"]
    experts += ["--moe-token-dispatcher-type", "alltoall"]
    assert_layout_losses(hf_model, ours, 4, experts + layout, TOKENS_25)


def test_the_hubs_multimodal_files_convert_as_their_text_model(converted, tmp_path):
    """Scout and Maverick are kept as Llama4ForConditionalGeneration: its text model."""
    hf_model, _, ours = converted
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision.update(intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32)
    vision.update(projector_input_dim=32, projector_output_dim=64)
    config = transformers.Llama4Config(text_config=hf_model.config.to_dict(), vision_config=vision)
    both = transformers.Llama4ForConditionalGeneration(config)
    both.language_model.load_state_dict(hf_model.state_dict())
    said = "vision_model.*, multi_modal_projector.* stay behind"
    assert_text_of_multimodal(both, hf_model, ours, tmp_path, TOKENS, said)


def test_what_threefold_cannot_convert_is_one_line(converted):
    hf_model, _, ours = converted
    hf = hf_model.config.to_dict()
    with pytest.raises(ConfigError, match="num_experts_per_tok=2 is not supported: Llama 4's"):
        model_config_from_hf(
            {**hf, "architectures": ["Llama4ForCausalLM"], "num_experts_per_tok": 2}
        )
    config, _, _ = load_model(ours)
    # Megatron-LM's args have no place for these: it would load another model
    with pytest.raises(
        ConfigError,
        match="Megatron-LM builds no --qk-l2-norm-rope-layers-only --attention-chunk-size",
    ):
        megatron_args(config, 0)
    halves = dataclasses.replace(config.model, rotary_interleaved=False)
    with pytest.raises(ConfigError, match="RoPE other than on adjacent pairs"):
        threefold_to_hf({}, halves, "Llama4ForCausalLM")
    with pytest.raises(ConfigError, match="has none of Llama 4's layers .* Llama4ForCausalLM"):
        threefold_to_hf({}, config.model, "MixtralForCausalLM")


CHUNKED = ["--attention-chunk-size", "4"]


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--qk-l2-norm", "--qk-l2-norm-rope-layers-only"], "add both or drop it"),
        (["--attn-temperature-tuning"], "scales the queries of the layers without RoPE"),
        (["--no-rope-freq", "2", "--attn-temperature-scale", "0.2"], "belong to --attn-temp"),
        (["--rope-scaling-high-freq-factor", "1"], "belong to --use-rope-scaling"),
        (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "5"], "at most the high one"),
        (CHUNKED + ["--window-size", "3,0"], "one mask of the two"),
    ],
    ids=["l2-rope-only", "temperature", "temperature-scale", "bands", "band-order", "window"],
)
def test_transformers_llama4_options_out_of_place_are_one_line(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_MHA_STYLE + argv + TRAINING, world_size=2)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


def test_the_options_travel_with_a_threefold_checkpoint(converted):
    """--use-checkpoint-args takes each option from the converted checkpoint."""
    _, _, ours = converted
    argv = ["--use-checkpoint-args", "--load", ours, "--mock-data", "--train-iters", "1"]
    config = parse_args(argv + ["--micro-batch-size", "2", "--global-batch-size", "4"])
    model = config.model
    assert (model.attention_chunk_size, model.attn_temperature_floor_scale) == (4, 4)
    assert model.attn_temperature_tuning and model.qk_l2_norm_rope_layers_only
    assert (model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor) == (1.0, 1.0)
    assert model.rope_scaling_original_max_position_embeddings == 8
    assert model.no_rope_freq == "[0,1,0,1]" and model.moe_layer_freq == "[0,1,0,1]"
