"""The GPT/LLaMA model, written once for every parallel layout."""

from threefold.model.gpt import GPTModel

__all__ = ["GPTModel"]
