"""The text model of a multimodal Hugging Face checkpoint (the Hub's Llama 4 and Gemma 3 4B+
files): the text config (`text_config`) and the tensors under `language_model.` convert as the
text family's, the vision encoder and its projector stay behind (`left_behind_prefixes`, which
the conversion names), and the model exports as the text architecture (`exports_as`).

A mixin before the text family's adapter: `class Gemma3Text(TextOfMultimodal, Gemma3Adapter)`.
"""

from __future__ import annotations

from threefold.checkpoint.hf.common import Take
from threefold.config import ModelConfig


class TextOfMultimodal:
    def model_config(self, hf: dict) -> ModelConfig:
        text = dict(hf["text_config"])
        if "tie_word_embeddings" in hf:  # (the top level's governs the output layer)
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return super().model_config(text)

    def take_weights(self, take: Take, config: ModelConfig, used: set[str]) -> dict:
        out = super().take_weights(lambda name: take("language_model." + name), config, used)
        if "lm_head.weight" in used:  # tied: a copy of the embeddings, if present at all
            used.add("language_model.lm_head.weight")
        return out
