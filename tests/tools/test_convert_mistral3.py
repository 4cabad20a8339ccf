"""Mistral3ForConditionalGeneration (Mistral Small 3.1 and 3.2), as the Hub keeps it: its text
model, Mistral's (a sliding window of 8 here), converts to the tensors of MistralForCausalLM's
conversion bitwise, its vision tower and projector are said to stay behind, and it exports as
MistralForCausalLM, which transformers loads with the text model's logits."""

from __future__ import annotations

import pytest

from tests.tools.hf_models import converted_hf_model, has_transformers

if not has_transformers():
    pytest.skip("transformers is not installed", allow_module_level=True)

import transformers  # noqa: E402

from tests.tools.hf_checks import TOKENS, assert_text_of_multimodal  # noqa: E402


def test_the_hubs_files_convert_as_their_text_model(tmp_path):
    hf_model, _, ours = converted_hf_model("mistral", tmp_path / "mistral")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    vision.update(intermediate_size=64, image_size=28, patch_size=14)
    text = hf_model.config.to_dict()
    # (the top level's tie_word_embeddings governs the output layer: the text model's, untied)
    config = transformers.Mistral3Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False
    )
    both = transformers.Mistral3ForConditionalGeneration(config)
    both.model.language_model.load_state_dict(hf_model.model.state_dict())
    both.lm_head.load_state_dict(hf_model.lm_head.state_dict())
    said = "vision_tower.*, multi_modal_projector.* stay behind"
    assert_text_of_multimodal(both, hf_model, ours, tmp_path, TOKENS, said)
