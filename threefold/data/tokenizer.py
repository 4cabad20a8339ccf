"""Tokenizers behind one small interface: `tokenize`, `detokenize`, `vocab_size`, `eod`."""

from __future__ import annotations

import os

from threefold.config import ConfigError, DataConfig


class SentencePieceTokenizer:
    def __init__(self, model_file: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_file):
            raise ConfigError(f"--tokenizer-model {model_file}: no such file; train one with "
                              "tools/train_tokenizer.py or fix the path")
        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.processor.vocab_size()
        self.eod = self.processor.eos_id()
        self.bos = self.processor.bos_id()

    def tokenize(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


class NullTokenizer:
    """Megatron's NullTokenizer: ids are given, `--vocab-size` of them plus one end-of-document."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(config: DataConfig, vocab_size: int | None):
    """The tokenizer `--tokenizer-type` names, or None for `--mock-data` without a tokenizer."""
    if config.tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(config.tokenizer_model)
    if config.tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    return None


def model_vocab_size(tokenizer, vocab_size_flag: int | None) -> int:
    """The model's vocabulary: the tokenizer's, or `--vocab-size` when it is at least as large."""
    if tokenizer is None:
        if vocab_size_flag is None:
            raise ConfigError("--mock-data without a tokenizer needs --vocab-size")
        return vocab_size_flag
    if isinstance(tokenizer, NullTokenizer) or vocab_size_flag is None:
        return tokenizer.vocab_size
    if vocab_size_flag < tokenizer.vocab_size:
        raise ConfigError(f"--vocab-size {vocab_size_flag} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer.vocab_size}); drop the flag or raise it")
    return vocab_size_flag
